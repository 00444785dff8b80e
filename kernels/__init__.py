"""pdctl.kernels"""
