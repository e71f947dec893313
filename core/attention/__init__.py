"""Attention over the KV cache: torch ops (CPU path), Triton kernels (CUDA path), and block storage."""
