"""Owners: CPU (numba kernels), torch devices (CUDA/HIP), and worker processes."""
