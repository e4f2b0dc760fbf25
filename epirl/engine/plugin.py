"""epirl's vLLM general plugin: the matched W8A16 engine and the CPU W8A8 emulation.

Loaded by vLLM through the `vllm.general_plugins` entry point (`epirl.engine.plugin:register`) and
called again by `RolloutEngine` (idempotent), it registers two quantization methods:

- `epirl_w8a16` (engine.precision=w8a16, the *matched* engine): weights quantized online exactly like
  vLLM's `fp8_per_tensor` (one fp32 scale per fused module, `epirl.kernels.quantize_weight_fp8`), stored
  like vLLM (`weight` = `[K, N]` view of `[N, K]` e4m3 codes, `weight_scale` `[1]`), and every linear
  layer computes `epirl.kernels.w8a16_lora` — the trainer's forward op — with the live adapter's LoRA
  term inside the same call.
- `epirl_w8a8_emu` (engine.precision=w8a8 on CPU only): vLLM has no W8A8 kernels on CPU, so the base
  GEMM is `epirl.kernels.w8a8_lora` (the reference of vLLM's per-token-activation FP8 GEMM, same
  contracts) and LoRA stays on vLLM's own LoRA path, as in vLLM's real W8A8 engine. Logged at start.

How LoRA is fused for w8a16 (vLLM 0.26–0.33): vLLM replaces each target linear with a
`BaseLinearLayerWithLoRA` subclass whose `forward` calls `self.apply(x, bias)`, which runs the base
layer's `quant_method.apply` and then adds LoRA with punica kernels (σ folded into B in bf16, a
separate GEMM and a separate rounding — not the trainer's arithmetic). `attach()` shadows `apply` on
each such *instance* (several subclasses override `apply`, so patching one class would miss some) with
`_fused_apply`, which calls `w8a16_lora(x, codes_slice, s_w, A_i, B_i, σ)` once per logical slice
(q, k, v / gate, up): exactly the per-HF-module call the trainer makes. A and B come from fixed
per-layer buffers owned by this plugin, refreshed by `active_adapter()` before each generate/score:
fixed addresses keep the path CUDA-graph safe, and unscaled B keeps σ where the trainer applies it.
vLLM still loads the adapter into its own stacked buffers (the scheduler needs the request), but the
w8a16 layers never read them. Limitation: one adapter (or none) per batch — what the RL loop does.
"""

from __future__ import annotations

import contextlib
import logging
import types
from typing import Any, Iterator

import torch

log = logging.getLogger(__name__)

W8A16 = "epirl_w8a16"
W8A8_EMU = "epirl_w8a8_emu"
_registered = False


def register() -> None:
    """vLLM general-plugin entry point: register epirl's quantization methods (idempotent)."""
    global _registered
    if _registered:
        return
    from vllm.model_executor.layers.quantization import register_quantization_config

    register_quantization_config(W8A16)(_make_config_class(W8A16, activation_fp8=False))
    register_quantization_config(W8A8_EMU)(_make_config_class(W8A8_EMU, activation_fp8=True))
    _registered = True


# ---------------------------------------------------------------------------------------------------
# Quantization config and linear method
# ---------------------------------------------------------------------------------------------------


def _make_config_class(name: str, activation_fp8: bool):
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.quantization.base_config import QuantizationConfig

    class EpirlFp8Config(QuantizationConfig):
        """Online per-tensor FP8 weights through epirl's kernels (see module docstring)."""

        def get_name(self):
            return name

        def get_supported_act_dtypes(self) -> list[torch.dtype]:
            return [torch.bfloat16, torch.float16, torch.float32]

        @classmethod
        def get_min_capability(cls) -> int:
            return 0  # the kernels dispatch to their torch reference where Triton cannot run

        @staticmethod
        def get_config_filenames() -> list[str]:
            return []  # online quantization: nothing to read from the checkpoint

        @classmethod
        def from_config(cls, config: dict[str, Any]) -> "EpirlFp8Config":
            return cls()

        def get_quant_method(self, layer: torch.nn.Module, prefix: str):
            if isinstance(layer, LinearBase):
                return EpirlFp8LinearMethod(activation_fp8)
            return None  # embeddings, LM head, norms: unquantized, as vLLM's fp8 method leaves them

    EpirlFp8Config.__name__ = f"EpirlFp8Config_{name}"
    return EpirlFp8Config


def _linear_method_base():
    from vllm.model_executor.layers.linear import LinearMethodBase

    return LinearMethodBase


class EpirlFp8LinearMethod(_linear_method_base()):
    """Create bf16 weights for loading, quantize after loading, compute with epirl.kernels."""

    def __init__(self, activation_fp8: bool):
        self.activation_fp8 = activation_fp8

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size,
                       output_size, params_dtype, **extra_weight_attrs):
        from vllm.model_executor.parameter import ModelWeightParameter
        from vllm.model_executor.utils import set_weight_attrs

        weight_loader = extra_weight_attrs.pop("weight_loader")
        weight = ModelWeightParameter(
            data=torch.empty(sum(output_partition_sizes), input_size_per_partition, dtype=params_dtype),
            input_dim=1, output_dim=0, weight_loader=weight_loader)
        layer.register_parameter("weight", weight)
        set_weight_attrs(weight, extra_weight_attrs)
        # Logical widths split fused modules (qkv_proj → q, k, v) for LoRA slices and shared views.
        layer.logical_widths = list(output_partition_sizes)

    def process_weights_after_loading(self, layer) -> None:
        from epirl.kernels import quantize_weight_fp8

        codes, scale = quantize_weight_fp8(layer.weight.data, group_sizes=layer.logical_widths)
        # vLLM's layout: `weight` is the [K, N] transpose view of [N, K] row-major codes.
        layer.weight = torch.nn.Parameter(codes.t(), requires_grad=False)
        layer.weight_scale = torch.nn.Parameter(scale.to(torch.float32).reshape(1), requires_grad=False)

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        from epirl.kernels import w8a8_lora, w8a16_lora

        op = w8a8_lora if self.activation_fp8 else w8a16_lora
        return op(x, layer.weight.t(), layer.weight_scale, bias=bias)


# ---------------------------------------------------------------------------------------------------
# The fused LoRA path of the matched engine
# ---------------------------------------------------------------------------------------------------


def _fused_apply(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Replacement for `BaseLinearLayerWithLoRA.apply` on w8a16 layers (bound per instance)."""
    from epirl.kernels import w8a16_lora

    base = self.base_layer
    codes = base.weight.t()  # [N, K] row-major
    state = self._epirl_lora  # _LayerLoRA
    if not state.enabled:
        return w8a16_lora(x, codes, base.weight_scale, bias=bias)
    outs = []
    start = 0
    for width, (a, b) in zip(state.widths, state.buffers):
        part_bias = None if bias is None else bias[start:start + width]
        outs.append(w8a16_lora(x, codes[start:start + width], base.weight_scale, a, b, state.scale,
                               bias=part_bias))
        start += width
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)


class _LayerLoRA:
    """Fixed LoRA buffers of one fused/plain layer: per slice A [r, K], B [N_i, r] (unscaled)."""

    def __init__(self, hf_names: list[str], widths: list[int], k: int, rank: int, dtype, device):
        self.hf_names, self.widths = hf_names, widths
        self.buffers = [(torch.zeros(rank, k, dtype=dtype, device=device),
                         torch.zeros(w, rank, dtype=dtype, device=device)) for w in widths]
        self.enabled = False
        self.scale = 1.0

    def load(self, modules: dict[str, tuple[torch.Tensor, torch.Tensor]] | None, scale: float) -> None:
        """Copy the adapter's tensors in (a module the adapter lacks gets zeros, i.e. no LoRA)."""
        self.enabled = modules is not None
        self.scale = scale
        for name, (a_buf, b_buf) in zip(self.hf_names, self.buffers):
            pair = modules.get(name) if modules is not None else None
            if pair is None:
                a_buf.zero_()
                b_buf.zero_()
            else:
                a_buf.copy_(pair[0])
                b_buf.copy_(pair[1])


def _packed_mapping(model) -> dict[str, list[str]]:
    mapping = dict(getattr(model, "packed_modules_mapping", {}) or {})
    return mapping or {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


def _hf_names(vllm_name: str, widths: list[int], mapping: dict[str, list[str]]) -> list[str]:
    """`model.layers.0.self_attn.qkv_proj` → [..q_proj, ..k_proj, ..v_proj] (by logical widths)."""
    name = vllm_name.replace(".base_layer", "")
    parent, _, leaf = name.rpartition(".")
    subs = mapping.get(leaf)
    if subs is None or len(subs) != len(widths):
        return [name]
    return [f"{parent}.{s}" if parent else s for s in subs]


def attach(engine) -> None:
    """After engine start: give every LoRA-wrapped w8a16 layer fixed buffers and the fused apply."""
    if engine.precision == "w8a8" and not _is_cuda():
        log.warning("engine.precision=w8a8 on CPU: vLLM has no W8A8 CPU kernels; EMULATING vLLM's W8A8 "
                    "numerics with epirl.kernels.w8a8_lora (reference) - slow, numerics only")
    if engine.precision != "w8a16":
        return
    from epirl.engine import compat

    BaseLinearLayerWithLoRA = compat.lora_linear_base_class()

    model = compat.model(engine.llm)
    mapping = _packed_mapping(model)
    rank = engine.cfg.lora.rank
    # A and B live in the activation dtype: w8a16_lora casts them to x.dtype first anyway.
    dtype = engine.llm.llm_engine.vllm_config.model_config.dtype
    layers = []
    for name, module in model.named_modules():
        if not isinstance(module, BaseLinearLayerWithLoRA):
            continue
        base = module.base_layer
        if not isinstance(getattr(base, "quant_method", None), EpirlFp8LinearMethod):
            continue
        widths = list(getattr(base, "logical_widths", [base.weight.shape[1]]))
        k = base.weight.shape[0]
        module._epirl_lora = _LayerLoRA(_hf_names(name, widths, mapping), widths, k, rank,
                                        dtype, base.weight.device)
        module.apply = types.MethodType(_fused_apply, module)
        layers.append(module)
    engine._epirl_w8a16_layers = layers
    engine._epirl_loaded = ("none", None)
    log.info("w8a16: fused W8A16+LoRA path on %d LoRA-wrapped layers", len(layers))


def detach(engine) -> None:
    engine._epirl_w8a16_layers = []


@contextlib.contextmanager
def active_adapter(engine, lora_request) -> Iterator[None]:
    """Before a generate/score: make the w8a16 buffers hold the requested adapter (or none)."""
    layers = getattr(engine, "_epirl_w8a16_layers", None)
    if layers:
        adapter = engine.adapter if lora_request is not None else None
        key = ("none", None) if adapter is None else ("adapter", adapter.request.lora_int_id)
        if engine._epirl_loaded != key:
            modules = None if adapter is None else adapter.modules
            for layer in layers:
                layer._epirl_lora.load(modules, 1.0 if adapter is None else adapter.scale)
            engine._epirl_loaded = key
    yield


def _is_cuda() -> bool:
    from epirl.engine import compat

    return compat.on_cuda()


# ---------------------------------------------------------------------------------------------------
# Shared FP8 base for the trainer (`trainer.base: shared`)
# ---------------------------------------------------------------------------------------------------


def fp8_base_views(model) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{HF module name: (codes [N_i, K] view, scale [1])} of every FP8 linear in the engine's model.

    Works for epirl's methods and vLLM's own fp8 methods alike (both store `weight` as the [K, N]
    transpose of row-major codes and one `weight_scale` per fused module). Views share storage with
    the engine: no copy of the base is made, so a trainer built on them holds no second base.
    """
    mapping = _packed_mapping(model)
    views: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        scale = getattr(module, "weight_scale", None)
        if not isinstance(weight, torch.Tensor) or weight.dtype != torch.float8_e4m3fn or scale is None:
            continue
        if scale.numel() != 1:
            raise NotImplementedError(f"{name}: weight_scale has {scale.numel()} entries, want per-tensor")
        codes = weight.t()
        if not codes.is_contiguous():
            raise RuntimeError(f"{name}: engine codes are not [N, K] row-major; cannot share zero-copy")
        widths = list(getattr(module, "logical_widths", None) or [codes.shape[0]])
        start = 0
        for hf_name, width in zip(_hf_names(name, widths, mapping), widths):
            views[hf_name] = (codes[start:start + width], scale)
            start += width
    return views
