"""nestpipe.trainer"""
