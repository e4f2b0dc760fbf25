"""See reference.py (the numerics) and triton.py (the CUDA kernel)."""
