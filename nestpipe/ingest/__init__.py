"""nestpipe.ingest"""
