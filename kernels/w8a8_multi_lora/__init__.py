"""See reference.py (the numerics), triton.py (K1 shrink + K2 FP8 GEMM with the multi-adapter epilogue) and
dispatch.py (timed choice between the fused path and vendor GEMM + adapter kernels)."""
