"""LoRA linear layers on a frozen 16-bit base, and their injection into a transformers model.

The FP8-base counterpart is `epirl.kernels.Fp8LoRALinear`; both expose the same trainable
parameters, `lora_A` [r, in] and `lora_B` [out, r] (PEFT's layout, unscaled), and compute
`y = x Wᵀ (+ b) + σ · (x Aᵀ) Bᵀ` with σ = alpha / r (kernels/README.md, numerical contracts: the LoRA term is added
after the base output, in the same order as vLLM's punica path).
"""

from __future__ import annotations

import zlib
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

# Every projection epirl knows how to wrap (one list for the config check and the model). Qwen3.5's
# gated-DeltaNet layers add the in_proj_* family and out_proj; Llama / Qwen3 / Qwen3.5 full attention and
# MLPs use the first seven.
from epirl.config import ALL_PROJECTIONS
from epirl.kernels import peft_lora_init


class LoRALinear(nn.Module):
    """A frozen bf16/fp32 linear layer plus a trainable low-rank update (the `trainer.base: bf16` path)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, lora_a: torch.Tensor,
                 lora_b: torch.Tensor, lora_scale: float):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        # The base stays a (frozen) Parameter so transformers' dtype/device introspection keeps working.
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.lora_A = nn.Parameter(lora_a)
        self.lora_B = nn.Parameter(lora_b)
        self.lora_scale = float(lora_scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = F.linear(x, self.weight, self.bias)
        # LoRA parameters are fp32 masters; compute in the activation dtype, as vLLM does with bf16 adapters.
        lora = F.linear(F.linear(x, self.lora_A.to(x.dtype)), self.lora_B.to(x.dtype))
        return base + self.lora_scale * lora

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, r={self.lora_A.shape[0]}, "
                f"scale={self.lora_scale:g}, base={self.weight.dtype}")


def is_lora_module(module: nn.Module) -> bool:
    """Duck-typed so that epirl's bf16 LoRALinear and the kernels' Fp8LoRALinear both qualify."""
    return isinstance(getattr(module, "lora_A", None), nn.Parameter) and isinstance(
        getattr(module, "lora_B", None), nn.Parameter)


def init_lora_weights(module_name: str, rank: int, in_features: int, out_features: int,
                      seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """PEFT's default init (`epirl.kernels.peft_lora_init`: A kaiming-uniform with a=√5, B zeros), fp32 on the
    CPU, seeded per module name.

    Seeding by name (not by visiting order or device RNG) gives the bf16 and the FP8 policy of one
    seed bit-identical adapters, which is what lets tests compare the two bases step by step.
    """
    module_seed = seed * 1_000_003 + zlib.crc32(module_name.encode())
    return peft_lora_init(rank, in_features, out_features, torch.float32, "cpu", seed=module_seed)


def projection_modules(model: nn.Module, names: tuple[str, ...] = ALL_PROJECTIONS
                       ) -> Iterator[tuple[str, nn.Linear]]:
    """(qualified name, module) of every nn.Linear whose leaf name is a known projection (not lm_head)."""
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in names:
            yield name, module


def replace_module(model: nn.Module, qualified_name: str, new_module: nn.Module) -> None:
    parent_name, _, leaf = qualified_name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, leaf, new_module)


def inject_lora(model: nn.Module, targets: list[str], rank: int, alpha: float, seed: int,
                lora_dtype: torch.dtype = torch.float32) -> list[str]:
    """Replace every target nn.Linear by a LoRALinear on its own (frozen) weight; returns the names.

    Non-target projections stay plain nn.Linear and are frozen along with everything else.
    """
    for param in model.parameters():
        param.requires_grad_(False)
    wrapped = []
    for name, linear in list(projection_modules(model, tuple(targets))):
        lora_a, lora_b = init_lora_weights(name, rank, linear.in_features, linear.out_features, seed)
        device = linear.weight.device
        module = LoRALinear(linear.weight.data, None if linear.bias is None else linear.bias.data,
                            lora_a.to(device, lora_dtype), lora_b.to(device, lora_dtype), alpha / rank)
        replace_module(model, name, module)
        wrapped.append(name)
    if not wrapped:
        raise ValueError(f"lora.targets {targets} matched no linear layer of {type(model).__name__}")
    return wrapped


def lora_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Trainable LoRA modules by qualified name (frozen zero-rank placeholders excluded)."""
    return {name: m for name, m in model.named_modules() if is_lora_module(m) and m.lora_A.requires_grad}


