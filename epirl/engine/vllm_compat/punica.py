"""A LoRA linear layer's live state as vLLM's punica path reads it: the wrapped base layer and its FP8 weight,
the slice widths, the adapter slot buffers, and the per-token slot map (with its adapter-sorted order).

Read from vLLM 0.26.0 and 0.32.0 source (same names in both):
- `vllm/lora/layers/base_linear.py`: `BaseLinearLayerWithLoRA.__init__` sets `self.base_layer`;
  `create_lora_weights(max_loras, ...)` allocates `self.lora_a_stacked` / `self.lora_b_stacked` (one tensor per
  slice, `[max_loras, 1, rows, cols]`) and `self.output_slices`; `column_parallel_linear.py` sets
  `output_slices` per fused slice (q, k, v / gate, up) and overrides `create_lora_weights`.
- `vllm/lora/layers/base.py`: `BaseLayerWithLoRA.set_mapping(punica_wrapper)` stores `self.punica_wrapper`.
- `vllm/lora/punica_wrapper/punica_base.py`: the property `PunicaWrapperBase.token_lora_indices` (token -> slot,
  -1 = no adapter, the first `indices_len[0]` entries of a fixed buffer); `punica_gpu.py` sets
  `self.token_mapping_meta` (`LoRAKernelMeta`, `vllm/lora/ops/triton_ops/lora_kernel_metadata.py`) whose field
  `token_indices_sorted_by_lora_ids` is the batch sorted by slot (CPU wrappers have no such metadata), with
  `active_lora_ids` / `num_tokens_per_lora` (each present slot, -1 first, and its token count, in sorted order:
  `lora_token_start_loc` is their running sum; unused entries -1 / 0, reset by `_reset` in `prepare_tensors`), and
  `no_lora_flag_cpu`, a CPU bool tensor `[1]` that `prepare_tensors` sets to "no token of this batch has an
  adapter" (vLLM's punica ops return early on it, `punica_gpu.py` `add_lora_fused_moe` / the `lora_shrink` and
  `lora_expand` ops; with `cudagraph_specialize_lora` vLLM captures separate graphs for such batches).
- `vllm/lora/layers/base_linear.py`: `BaseLinearLayerWithLoRA` computes its base output as
  `self._get_quant_method().apply(self.base_layer, x, bias)` (in `_apply_sync`, 0.26 and 0.32), where
  `_get_quant_method()` is `self.base_layer.quant_method`; punica then adds the LoRA term (`_apply_sync(x, bias)`:
  base output + `punica_wrapper.add_lora_linear`, vLLM's whole LoRA linear without the aux-stream variant).
- `vllm/model_executor/layers/quantization/fp8.py`: `Fp8LinearMethod` registers `weight` (stored transposed,
  a `[K, N]` view of `[N, K]` e4m3 codes), `weight_scale` and, for static activation scales only,
  `input_scale` (set to None for dynamic per-token activations); the layer's method is `quant_method`.

Public API that would replace it: none in 0.26–0.33. A LoRA-kernel hook (a `PunicaWrapper` subclass chosen by
`LoRAConfig`, receiving the stacked buffers, slices and token mapping) would replace every read here.
"""

from __future__ import annotations

import inspect

import torch

from epirl.engine.vllm_compat.detect import absent
from epirl.kernels.w8a8_multi.segmented import Segments


def base_of(layer):
    """The linear layer a LoRA layer wraps (its quantized weight lives there)."""
    return layer.base_layer


def per_tensor_fp8_weight(base):
    """(weight, scale) of a base layer holding FP8 e4m3 codes with one per-tensor scale and dynamic (per-token)
    activations, else None. `weight` is as vLLM stores it (usually the `[K, N]` view of `[N, K]` codes)."""
    weight = getattr(base, "weight", None)
    scale = getattr(base, "weight_scale", None)
    if not isinstance(weight, torch.Tensor) or weight.dtype != torch.float8_e4m3fn or scale is None:
        return None
    if scale.numel() != 1 or getattr(base, "input_scale", None) is not None:
        return None  # per-channel weights or static activation scales
    return weight, scale


def quant_method(base):
    """The base layer's quantization method object (None if it has none)."""
    return getattr(base, "quant_method", None)


def base_apply(layer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The layer's output without adapter, computed as vLLM's LoRA layer computes its base output (its base layer's
    quantization method `apply`): a batch without adapter served this way equals vLLM's own no-LoRA path."""
    base = base_of(layer)
    return quant_method(base).apply(base, x, bias)


def vllm_lora_apply(layer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The layer's output through vLLM's own path: base quantization method + its punica LoRA kernels (not the
    class-level `apply`, which epirl wraps)."""
    return layer._apply_sync(x, bias)


def no_lora_flag(layer) -> torch.Tensor | None:
    """vLLM's CPU bool tensor `[1]`, True when the current batch has no adapter on any token (set by the punica
    wrapper's kernel metadata before each forward); None where the wrapper keeps no such metadata (CPU)."""
    meta = getattr(layer.punica_wrapper, "token_mapping_meta", None)
    flag = getattr(meta, "no_lora_flag_cpu", None)
    return flag if isinstance(flag, torch.Tensor) and flag.device.type == "cpu" else None


def slice_widths(layer) -> list[int]:
    """Output rows of each slice (q, k, v / gate, up; one entry for a plain linear)."""
    return [int(w) for w in layer.output_slices]


def slot_views(stacked) -> list[torch.Tensor]:
    """vLLM's per-slice slot buffers `[max_loras, 1, rows, cols]` as `[max_loras, rows, cols]` views (no copy)."""
    return [t[:, 0] if t.dim() == 4 else t for t in stacked]


def slot_buffers(layer) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(A per slice `[max_loras, r, K]`, B per slice `[max_loras, N_i, r]`): views of vLLM's own buffers."""
    return slot_views(layer.lora_a_stacked), slot_views(layer.lora_b_stacked)


def token_slots(layer) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(token -> slot map of the current batch, -1 = no adapter; the token indices sorted by slot, or None where
    vLLM's punica wrapper keeps no such metadata)."""
    punica = layer.punica_wrapper
    order = getattr(getattr(punica, "token_mapping_meta", None), "token_indices_sorted_by_lora_ids", None)
    return punica.token_lora_indices, order


META_SEGMENT_FIELDS = ("token_indices_sorted_by_lora_ids", "active_lora_ids", "num_tokens_per_lora")


def token_segments(layer):
    """The current batch's tokens grouped by slot, as vLLM's `LoRAKernelMeta` holds them (sorted token indices,
    each segment's slot (-1: none or unused) and token count; `prepare_tensors` refills these
    fixed device buffers before every step, so CUDA graphs replay with the step's own metadata, as vLLM's LoRA
    kernels do), as an `epirl.kernels.w8a8_multi.segmented.Segments`; None where the wrapper keeps none."""
    meta = getattr(layer.punica_wrapper, "token_mapping_meta", None)
    fields = [getattr(meta, name, None) for name in META_SEGMENT_FIELDS]
    if not all(isinstance(t, torch.Tensor) and t.is_cuda for t in fields):
        return None

    return Segments(*fields)


def punica_lora_adder(x: torch.Tensor, lora_a: list[torch.Tensor], lora_b: list[torch.Tensor],
                      token_lora: torch.Tensor, scale: float):
    """vLLM's own LoRA kernels on one batch, as its GPU punica wrapper calls them in `add_lora_linear`
    (`vllm/lora/punica_wrapper/punica_gpu.py`, 0.26 and 0.32): `lora_shrink` into an fp32 buffer
    `[slices, M, r]` (scaled by `scale`), then `lora_expand` adding each slice's part into its columns of y;
    both take the token metadata of `LoRAKernelMeta` (`lora_kernel_metadata.py`: `make`, `prepare_tensors`,
    `meta_args(token_nums, specialize_active_lora)` in 0.26 and 0.32; the flag is passed only where it exists,
    False = the launch grid sized for every slot, as vLLM's default config does).
    The metadata is prepared here, once, as vLLM prepares it once per step outside its CUDA graphs; returns
    `add(y)`, which adds σ (x A_lᵀ) B_lᵀ per token into y `[M, Σ N_i]` in place (graph-capturable).
    For benchmarks and timing against epirl's kernels. lora_a / lora_b: per slice `[L, r, K]` / `[L, N_i, r]`."""
    from vllm.lora.ops.triton_ops import LoRAKernelMeta, lora_expand, lora_shrink

    M, (L, r, _) = x.shape[0], lora_a[0].shape
    meta = LoRAKernelMeta.make(max_loras=L, max_num_tokens=M, device=x.device)
    meta.prepare_tensors(token_lora.to(torch.int32))
    params = inspect.signature(meta.meta_args).parameters
    args = meta.meta_args(M, **({"specialize_active_lora": False} if "specialize_active_lora" in params else {}))
    buffer = torch.empty(len(lora_a), M, r, dtype=torch.float32, device=x.device)
    lora_a, lora_b = tuple(lora_a), tuple(lora_b)

    def add(y: torch.Tensor) -> torch.Tensor:
        lora_shrink(x, lora_a, buffer, *args, scale)
        lora_expand(buffer, lora_b, y, *args, offset_start=0, add_inputs=True)
        return y

    return add


def _source_lacks(symbol: str, needles: list[str]) -> list[str]:
    """`symbol:needle` for each instance attribute assignment the class's source no longer makes."""
    module, _, path = symbol.partition(":")
    import importlib

    obj = importlib.import_module(module)
    for part in path.split("."):
        obj = getattr(obj, part)
    source = inspect.getsource(obj)
    return [f"{symbol} sets {needle}" for needle in needles if needle not in source]


def missing() -> list[str]:
    """What this module relies on that the installed vLLM lacks."""
    base_linear = "vllm.lora.layers.base_linear:BaseLinearLayerWithLoRA"
    lacking = absent([f"{base_linear}.create_lora_weights", f"{base_linear}._apply_sync",
                      "vllm.lora.layers.base:BaseLayerWithLoRA.set_mapping",
                      "vllm.lora.punica_wrapper.punica_base:PunicaWrapperBase.token_lora_indices",
                      "vllm.lora.ops.triton_ops.lora_kernel_metadata:LoRAKernelMeta"])
    if lacking:
        return lacking
    from vllm.lora.ops.triton_ops.lora_kernel_metadata import LoRAKernelMeta

    for field in (*META_SEGMENT_FIELDS, "no_lora_flag_cpu"):
        if field not in getattr(LoRAKernelMeta, "__annotations__", {}):
            lacking.append(f"vllm.lora.ops.triton_ops.lora_kernel_metadata:LoRAKernelMeta.{field}")
    lacking += _source_lacks(base_linear, ["self.base_layer =", "self.lora_a_stacked =", "self.lora_b_stacked =",
                                           "self.output_slices", ".apply(self.base_layer, x, bias)",
                                           "self.base_layer.quant_method"])
    lacking += _source_lacks("vllm.lora.layers.base:BaseLayerWithLoRA.set_mapping", ["self.punica_wrapper"])
    return lacking
