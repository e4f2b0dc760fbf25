"""epirl.kernels: FP8 quantization, W8A16/W8A8 GEMMs with a LoRA epilogue, and the FP8 LoRA linear.

One folder per op (`fp8_quant/`, `w8a16/`, `w8a8/`, `w8a8_multi/`, `lora_linear/`): its `reference.py` beside its
Triton kernels, and in its `__init__.py` the public function, which dispatches to the Triton kernel for CUDA tensors
and to the plain-torch reference elsewhere;
`EPIRL_KERNELS=reference` or `backend="reference"` forces the reference. The references define the
numerics (see kernels/README.md); shapes and layouts:
  codes  `[N, K]` float8_e4m3fn row-major (nn.Linear layout; vLLM stores `weight = codes.t()`, `[K, N]`)
  scale  fp32 `[1]` (one per fused module)      x `[..., K]` bf16      A `[r, K]`      B `[N, r]`
"""

from __future__ import annotations

from .fp8_quant import quantize_activation_fp8, quantize_weight_fp8, split_fused, weight_kn_view
from .fp8_quant.reference import FP8_DTYPE, FP8_MAX, MIN_SCALE, dequantize
from .lora_linear.module import Fp8LoRAFunction, Fp8LoRALinear, lora_linear_backward, peft_lora_init
from .lora_linear.reference import lora_linear_backward as lora_linear_backward_reference
from .w8a8 import w8a8_lora
from .w8a8_multi import w8a8_multi_lora
from .w8a16 import w8a16_lora

__all__ = [
    "FP8_DTYPE", "FP8_MAX", "MIN_SCALE", "dequantize", "quantize_weight_fp8", "quantize_activation_fp8",
    "split_fused", "weight_kn_view", "w8a16_lora", "w8a8_lora", "w8a8_multi_lora", "lora_linear_backward",
    "lora_linear_backward_reference", "Fp8LoRAFunction", "Fp8LoRALinear", "peft_lora_init",
]
