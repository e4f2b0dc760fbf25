"""`Fp8Linear`: a frozen FP8 projection without an adapter (projections outside `lora.targets`).

The engine quantizes every projection, targeted by LoRA or not, so the trainer must too. This runs the
kernels' `Fp8LoRAFunction` with no LoRA operands: the same W8A16 forward and the codes-reading backward
for dX, never a dequantized weight.
"""

from __future__ import annotations

import torch
from torch import nn

from epirl.kernels import Fp8LoRAFunction
from epirl.kernels.fp8_quant.reference import check_weight_codes


class Fp8Linear(nn.Module):
    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        check_weight_codes(codes)
        self.out_features, self.in_features = codes.shape
        # Non-persistent, as in Fp8LoRALinear: the base belongs to the checkpoint / engine, not to us.
        self.register_buffer("codes", codes, persistent=False)
        self.register_buffer("scale", scale.float().reshape(1), persistent=False)
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if getattr(self, "slice_group", None) is not None:  # grouped only with `kernels.fused_slices` on
            return self.slice_group.output(self.slice_index, x)  # one call for the fused layer
        return Fp8LoRAFunction.apply(x, None, None, self.codes, self.scale, self.bias, 0.0, None)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, frozen fp8"
