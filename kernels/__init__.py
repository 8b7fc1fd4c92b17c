"""Triton kernels, each with its PyTorch reference beside it (importable as ``moe_rl.kernels``)."""
