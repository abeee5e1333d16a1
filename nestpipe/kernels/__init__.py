"""nestpipe.kernels"""
