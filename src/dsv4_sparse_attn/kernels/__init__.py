"""CUDA kernels, one module per kernel family; ``dispatch`` picks a kernel or the reference."""
