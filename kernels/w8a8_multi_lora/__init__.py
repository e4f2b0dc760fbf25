"""See reference.py (the numerics), triton.py (K1 shrink + K2 FP8 GEMM with the multi-adapter epilogue), segmented.py
(segment-tiled shrink + expand after a vendor GEMM, one adapter per tile) and dispatch.py (timed choice between the
fused path, vendor GEMM + adapter kernels and vendor GEMM + vLLM's own LoRA kernels)."""
