"""Attention backends: a torch reference that runs anywhere, Triton kernels on GPUs."""
