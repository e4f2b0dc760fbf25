"""Triton GEMM building blocks shared by the ops (no public op of its own: the numerics of every call are
defined by the calling op's reference.py).

- `scaled`: row-major scaled GEMM with a LoRA epilogue (W8A8 on FP8 tensor cores; bf16 operands too)
  and the batch-invariant split LoRA down-projection W8A8 uses;
- `weight_stationary`: the W8A16 GEMM yᵀ = W·xᵀ (forward and dX), with the fixed K chunking, the split-K
  decode path and the LoRA down-projection fused into the split-K partial kernel;
- `configs`: the committed per-(shape, M bucket) tile table (`ws_configs.json`, written by
  scripts/tune_w8a16.py) and the fixed K chunking.
"""
