"""Triton kernels with PyTorch references (paged copies, quantization, eviction scoring).

Installed as ``kvpool.kernels``: pure functions over tensors, no pool state. Empty until the
kernels issue.
"""
