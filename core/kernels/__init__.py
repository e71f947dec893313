"""Triton kernels (the CUDA path); each has a torch reference and a test against float64."""
