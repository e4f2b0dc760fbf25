"""Which kernel runs Qwen3.5's gated DeltaNet layers in the trainer: flash-linear-attention's chunked
kernels when they import *and work* on this device, else transformers' torch fallback.

transformers binds `chunk_gated_delta_rule` to fla whenever `fla` imports, but fla can import and still fail
at run time (fla 0.6 refuses its Hopper backward below Triton 3.7.1; its kernels need CUDA). A tiny forward +
backward on the device decides; on failure the model is switched to the torch path, with the reason, so a
run never dies in its first backward and the benchmark output says which kernel it measured.
"""

from __future__ import annotations

import inspect
import logging
import sys

import torch
from torch import nn

from epirl.config import first_line

log = logging.getLogger(__name__)
GLOBAL_NAME = "torch_chunk_gated_delta_rule"  # the module-level function the layers call (transformers ≥ 5)
ATTRIBUTE_NAME = "chunk_gated_delta_rule"  # the per-layer attribute older transformers set in __init__


def _gdn_layers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet")]


def _implementation(fn) -> object:
    """The function transformers' hub wrapper really calls (its closure's `implementation`), or `fn`."""
    for cell in getattr(fn, "__closure__", None) or ():
        value = cell.cell_contents
        if callable(value) and getattr(value, "__module__", "").startswith("fla"):
            return value
    return fn


def _is_fla(fn) -> bool:
    return getattr(_implementation(fn), "__module__", "").startswith("fla")


def _fla_works(fn, device: torch.device) -> str | None:
    """None when fla's chunked rule runs forward and backward here; else the reason it does not."""
    if device.type != "cuda":
        return "fla kernels need CUDA"
    try:
        B, T, H, K = 1, 64, 2, 64
        q, k, v = (torch.randn(B, T, H, K, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        g = -torch.rand(B, T, H, device=device, dtype=torch.float32)
        beta = torch.rand(B, T, H, device=device, dtype=torch.bfloat16)
        out, _ = _implementation(fn)(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)
        out.float().sum().backward()
        torch.cuda.synchronize(device)
    except Exception as exc:  # noqa: BLE001 - any failure means: use the fallback
        return f"{type(exc).__name__}: {first_line(exc, '')[:160]}"
    return None


def _torch_path(fn):
    raw = getattr(fn, "__wrapped__", fn)
    accepted = set(inspect.signature(raw).parameters)

    def torch_chunk_gated_delta_rule(*args, **kwargs):
        return raw(*args, **{k: v for k, v in kwargs.items() if k in accepted})

    return torch_chunk_gated_delta_rule


def select_gdn_kernel(model: nn.Module, device: torch.device) -> str:
    """'none' (no gated DeltaNet layers), 'fla', or 'torch (<why>)'; switches the model to torch when fla fails."""
    layers = _gdn_layers(model)
    if not layers:
        return "none"
    module = sys.modules[type(layers[0]).__module__]
    per_layer = hasattr(layers[0], ATTRIBUTE_NAME)
    current = getattr(layers[0], ATTRIBUTE_NAME) if per_layer else getattr(module, GLOBAL_NAME, None)
    if current is None:
        return "unknown"
    if not _is_fla(current):
        if device.type == "cuda":
            log.warning("Qwen3.5 linear attention runs transformers' torch fallback (flash-linear-attention not "
                        "installed): correct, but >10x slower")
        return "torch (flash-linear-attention not installed)"
    reason = _fla_works(current, device)
    if reason is None:
        return "fla"
    # Older transformers: the layer holds fla's function and the module keeps the torch one under GLOBAL_NAME.
    fallback = _torch_path(getattr(module, GLOBAL_NAME) if per_layer else current)
    if per_layer:
        for layer in layers:
            setattr(layer, ATTRIBUTE_NAME, fallback)
    else:
        setattr(module, GLOBAL_NAME, fallback)
    log.warning("flash-linear-attention does not work here (%s): Qwen3.5 linear attention uses transformers' torch "
                "fallback (correct, much slower)", reason)
    return f"torch (fla failed: {reason})"
