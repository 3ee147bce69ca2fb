"""commopt.kernels: bucketing and packing kernels (torch reference, numba CPU, CuPy CUDA)."""
