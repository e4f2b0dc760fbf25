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
separate GEMM and a separate rounding — not the trainer's arithmetic). `register()` wraps `apply` on
that class and on every subclass that overrides it (`vllm_compat.lora_layers`): when the base layer's
method is epirl's W8A16 one, the wrapper calls the custom op `epirl::w8a16_lora_slices`, i.e.
`w8a16_lora(x, codes_i, s_w, A_i, B_i, σ)` once per logical slice (q, k, v / gate, up) — exactly the
per-HF-module call the trainer makes — and vLLM's punica path is not run. A qkv_proj layer (ONE_CALL_LAYERS; unless
`kernels.fused_slices: false`) is instead one `w8a16_lora` call over the whole
layer, its slices' adapters held as one block-diagonal A_cat / B_bd (kernels/w8a16/slices.py), the call the
trainer's SliceGroup makes (kernels/lora_linear/sliced.py). It is patched at class level
in `register()`, before vLLM builds the model, so that torch.compile and CUDA-graph capture see it;
the op is a torch custom op so the compiler treats the kernel as one opaque call.

The adapter reaches the op through fixed per-layer buffers (A_i [r, K], B_i [N_i, r], unscaled, model
dtype) created when the weights are quantized, i.e. before any graph capture, and refreshed in place
by `active_adapter()` before each generate/score (zeros when no adapter is wanted: adding an exact 0
leaves the base result bitwise unchanged). Fixed addresses keep captured graphs valid. Rank, σ = alpha/r (fixed per
engine, which the publisher checks) and fused slices come from the engine's `EngineSpec` (epirl/engine/spec.py),
which vLLM carries in its `additional_config`: `create_weights` reads it while vLLM builds the layer and keeps it on
the layer. vLLM still loads each adapter into its
own stacked buffers (its scheduler needs the request), but w8a16 layers never read them.
Limitation: one adapter (or none) per batch — what the RL loop does.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import Any, Iterator

import torch

from epirl.engine import serving_lora, spec as engine_spec
from epirl.engine.naming import NameMap
from epirl.kernels import quantize_weight_fp8, w8a8_lora, w8a16_lora
from epirl.kernels.w8a16.slices import block_views, per_slice_call
from epirl.kernels.w8a16.ws_splitk import reserve_counters
from epirl.engine.vllm_compat import lora_layers, model_access, punica, quantization
from epirl.engine.vllm_compat.detect import on_cuda
from epirl.model.loading import PACKED_MODULES, runs_as_one_call

log = logging.getLogger(__name__)

W8A16 = "epirl_w8a16"


W8A8_EMU = "epirl_w8a8_emu"
_registered = False


def register() -> None:
    """vLLM general-plugin entry point: register epirl's quantization methods (idempotent)."""
    global _registered
    if _registered:
        return
    quantization.register(W8A16, _make_config_class(W8A16, activation_fp8=False))
    quantization.register(W8A8_EMU, _make_config_class(W8A8_EMU, activation_fp8=True))
    patched = lora_layers.wrap_lora_apply(lambda base: getattr(base, "_epirl_lora", None) is not None, _fused_apply)
    log.debug("epirl plugin: patched apply of %d LoRA linear classes", patched)
    # EPIRL_SERVING_KERNELS=fused|timed: serve FP8 (W8A8) LoRA layers with epirl.kernels.w8a8_multi_lora in a plain
    # `vllm serve` / `vllm.LLM` too (epirl's engine installs them when its spec asks). Opt-in until an end-to-end vLLM
    # run shows it beats vLLM's LoRA path.
    if serving_lora.read_mode() != "off":
        serving_lora.install()
    _registered = True


# ---------------------------------------------------------------------------------------------------
# Quantization config and linear method
# ---------------------------------------------------------------------------------------------------


def _make_config_class(name: str, activation_fp8: bool):
    linear_base = quantization.linear_base()

    class EpirlFp8Config(quantization.config_base()):
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
            if isinstance(layer, linear_base):
                return _linear_method_class()(activation_fp8)
            return None  # embeddings, LM head, norms: unquantized, as vLLM's fp8 method leaves them

    EpirlFp8Config.__name__ = f"EpirlFp8Config_{name}"
    return EpirlFp8Config


@functools.cache
def _linear_method_class() -> type:
    """The linear method class, built on first use: subclassing vLLM's base imports vLLM (seconds), which a
    process that only reads a config or prints an error should not pay."""

    class EpirlFp8LinearMethod(quantization.linear_method_base()):
        """Create bf16 weights for loading, quantize after loading, compute with epirl.kernels."""

        def __init__(self, activation_fp8: bool):
            self.activation_fp8 = activation_fp8

        def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size,
                           output_size, params_dtype, **extra_weight_attrs):
            weight_loader = extra_weight_attrs.pop("weight_loader")
            weight = quantization.weight_parameter(
                torch.empty(sum(output_partition_sizes), input_size_per_partition, dtype=params_dtype), weight_loader,
                extra_weight_attrs)
            layer.register_parameter("weight", weight)
            # Logical widths split fused modules (qkv_proj → q, k, v) for LoRA slices and shared views.
            layer.logical_widths = list(output_partition_sizes)
            # the engine's settings, read while vLLM's config is in effect (it is while the model is constructed)
            layer._epirl_spec = engine_spec.current() or engine_spec.EngineSpec()

        def process_weights_after_loading(self, layer) -> None:
            dtype, device = layer.weight.dtype, layer.weight.device
            codes, scale = quantize_weight_fp8(layer.weight.data, group_sizes=layer.logical_widths)
            # vLLM's layout: `weight` is the [K, N] transpose view of [N, K] row-major codes.
            layer.weight = torch.nn.Parameter(codes.t(), requires_grad=False)
            layer.weight_scale = torch.nn.Parameter(scale.to(torch.float32).reshape(1), requires_grad=False)
            spec = getattr(layer, "_epirl_spec", None) or engine_spec.EngineSpec()
            if not self.activation_fp8 and device.type == "cuda":
                reserve_counters(device)  # before vLLM captures its graphs (`kernels/w8a16/ws_splitk.py` says why)
            if not self.activation_fp8 and spec.lora_rank > 0:
                layer._epirl_lora = _LayerLoRA(layer.logical_widths, codes.shape[1], spec.lora_rank, spec.lora_scale,
                                               dtype, device, one_call=_one_call(layer, spec.fused_slices))

        def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
            if self.activation_fp8:
                return w8a8_lora(x, layer.weight.t(), layer.weight_scale, bias=bias)
            return torch.ops.epirl.w8a16_lora_slices(x, layer.weight.t(), layer.weight_scale, [], [],
                                                     list(layer.logical_widths), 1.0, bias)

    return EpirlFp8LinearMethod


# ---------------------------------------------------------------------------------------------------
# The fused LoRA path of the matched engine
# ---------------------------------------------------------------------------------------------------

def _one_call(layer, fused_slices: bool) -> bool:
    """Whether this fused layer's LoRA runs as one block-diagonal call (`kernels.fused_slices`, on by default,
    `kernels/w8a16/slices.py`): the layers of ONE_CALL_LAYERS (qkv_proj) whose logical slices are one Hugging
    Face module each, which the trainer groups the same way (`epirl.model.loading.group_fused_layer`)."""
    leaf = getattr(layer, "prefix", "").rpartition(".")[2]
    return runs_as_one_call(leaf, fused_slices) and len(PACKED_MODULES[leaf]) == len(layer.logical_widths)


@torch.library.custom_op("epirl::w8a16_lora_slices", mutates_args=())
def w8a16_lora_slices(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, lora_a: list[torch.Tensor],
                      lora_b: list[torch.Tensor], widths: list[int], lora_scale: float,
                      bias: torch.Tensor | None, a_cat: torch.Tensor | None = None,
                      b_bd: torch.Tensor | None = None) -> torch.Tensor:
    """`w8a16_lora` per logical slice of a fused layer, each written into its columns of the layer's output (no
    concatenation kernel; no LoRA when the lists are empty) — or, given the block operands a_cat / b_bd (fused
    slices on), one call for the whole layer, the trainer's `SliceGroup` call."""
    if a_cat is not None:
        return w8a16_lora(x, codes, scale, a_cat, b_bd, lora_scale, bias=bias)
    if not lora_a:
        return w8a16_lora(x, codes, scale, bias=bias)
    if len(widths) == 1:
        return w8a16_lora(x, codes, scale, lora_a[0], lora_b[0], lora_scale, bias=bias)
    y = per_slice_call(x.reshape(-1, x.shape[-1]), codes, scale, lora_a, lora_b, widths, lora_scale, bias)
    return y.reshape(*x.shape[:-1], codes.shape[0])


@w8a16_lora_slices.register_fake
def _(x, codes, scale, lora_a, lora_b, widths, lora_scale, bias, a_cat=None, b_bd=None):
    return x.new_empty((*x.shape[:-1], codes.shape[0]))


def _fused_apply(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`apply` of a LoRA-wrapped w8a16 layer: base GEMM and the live adapter in the same kernel call."""
    base = punica.base_of(self)
    state = base._epirl_lora
    return torch.ops.epirl.w8a16_lora_slices(x, base.weight.t(), base.weight_scale, state.lora_a,
                                             state.lora_b, state.widths, state.scale, bias, state.a_cat, state.b_bd)


class _LayerLoRA:
    """Fixed LoRA buffers of one fused/plain layer: per slice A [r, K], B [N_i, r] (unscaled). one_call: the slices'
    buffers are views into one A_cat [S·r, K] and the diagonal blocks of one B_bd [N, S·r] (zeros elsewhere), which
    the layer's one call reads."""

    def __init__(self, widths: list[int], k: int, rank: int, scale: float, dtype, device, one_call: bool = False):
        self.widths = list(widths)
        self.hf_slices: list[tuple[str, int]] = []  # (HF module, first row in it) per slice; set by attach()
        self.a_cat = self.b_bd = None
        if one_call:
            self.a_cat = torch.zeros(len(widths) * rank, k, dtype=dtype, device=device)
            self.b_bd = torch.zeros(sum(widths), len(widths) * rank, dtype=dtype, device=device)
            self.lora_a, self.lora_b = block_views(self.a_cat, self.b_bd, widths, rank)
        else:
            self.lora_a = [torch.zeros(rank, k, dtype=dtype, device=device) for _ in widths]
            self.lora_b = [torch.zeros(w, rank, dtype=dtype, device=device) for w in widths]
        self.scale = scale

    def load(self, modules: dict[str, tuple[torch.Tensor, torch.Tensor]] | None) -> None:
        """Copy the adapter's tensors in place (a module the adapter lacks gets zeros: no LoRA).

        A slice of a module that spans several slices (Qwen3.5's in_proj_qkv inside in_proj_qkvz) takes the
        module's A and its rows of B: every output row is computed on its own, so the result is the same."""
        for (name, row), width, a_buf, b_buf in zip(self.hf_slices, self.widths, self.lora_a, self.lora_b):
            pair = modules.get(name) if modules is not None else None
            if pair is None:
                a_buf.zero_()
                b_buf.zero_()
            else:
                a_buf.copy_(pair[0])
                b_buf.copy_(pair[1][row:row + width])


class FusedAdapterSlot:
    """The matched engine's fixed per-layer LoRA buffers and the id of the adapter they hold (None: zeros)."""

    def __init__(self, layers: list[_LayerLoRA]):
        self.layers = layers
        self.loaded: int | None = None  # buffers start zeroed


def attach(llm, precision: str) -> FusedAdapterSlot | None:
    """After engine start: name the w8a16 layers' LoRA buffers (HF module names) for publishing; None for the
    other precisions (vLLM's own LoRA path serves them)."""
    if precision == "w8a8" and not on_cuda():
        log.warning("engine.precision=w8a8 on CPU: vLLM has no W8A8 CPU kernels; EMULATING vLLM's W8A8 "
                    "numerics with epirl.kernels.w8a8_lora (reference) - slow, numerics only")
    if precision != "w8a16":
        return None
    lora_base = lora_layers.lora_linear_base_class()
    model = model_access.model(llm)
    names = NameMap(model)
    layers = []
    for name, module in model.named_modules():
        state = getattr(getattr(module, "base_layer", None), "_epirl_lora", None)
        if not isinstance(module, lora_base) or state is None:
            continue
        state.hf_slices = names.slices(name, state.widths)
        layers.append(state)
    if not layers:
        raise RuntimeError("w8a16 engine: no LoRA-wrapped epirl layers found (enable_lora off or targets empty?)")
    log.info("w8a16: fused W8A16+LoRA op on %d LoRA-wrapped layers (σ=%g)", len(layers), layers[0].scale)
    return FusedAdapterSlot(layers)


@contextlib.contextmanager
def active_adapter(slot: FusedAdapterSlot | None, adapter) -> Iterator[None]:
    """Before a generate/score: make the w8a16 buffers hold `adapter` (a PublishedAdapter; None = zeros)."""
    if slot is not None and slot.layers:
        layers = slot.layers
        key = None if adapter is None else adapter.request.lora_int_id
        if slot.loaded != key:
            if adapter is not None and abs(adapter.scale - layers[0].scale) > 1e-12 * layers[0].scale:
                raise ValueError(f"adapter σ={adapter.scale} differs from the engine's fixed σ={layers[0].scale}")
            if adapter is not None:
                homeless = set(adapter.modules) - {name for state in layers for name, _ in state.hf_slices}
                if homeless:  # serving without them would sample from a different policy than the trainer's
                    raise RuntimeError(f"w8a16 engine has no layer for {len(homeless)} adapter modules, e.g. "
                                       f"{sorted(homeless)[:3]} (module naming between vLLM and the trainer)")
            for state in layers:
                state.load(None if adapter is None else adapter.modules)
            slot.loaded = key
    yield


# ---------------------------------------------------------------------------------------------------
# Shared FP8 base for the trainer (`trainer.base: shared`)
# ---------------------------------------------------------------------------------------------------


def fp8_base_views(model) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{HF module name: (codes [N_i, K] view, scale [1])} of every FP8 linear in the engine's model.

    Works for epirl's methods and vLLM's own fp8 methods alike (both store `weight` as the [K, N]
    transpose of row-major codes and one `weight_scale` per fused module). Views share storage with
    the engine: no copy of the base is made, so a trainer built on them holds no second base.
    """
    names = NameMap(model)
    layers = []
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        scale = getattr(module, "weight_scale", None)
        if not isinstance(weight, torch.Tensor) or weight.dtype != torch.float8_e4m3fn or scale is None:
            continue
        if scale.numel() != 1:
            raise NotImplementedError(f"{name}: weight_scale has {scale.numel()} entries, want per-tensor")
        layers.append((name, module, weight, scale))
    # How this vLLM holds FP8 weights, read off a non-square one: a square weight fits either layout.
    non_square = [w for _, _, w, _ in layers if w.ndim == 2 and w.shape[0] != w.shape[1]]
    transposed_view = not non_square or non_square[0].t().is_contiguous()
    views: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for name, module, weight, scale in layers:
        codes = _row_major_codes(name, module, weight, transposed_view)
        widths = list(getattr(module, "logical_widths", None) or [codes.shape[0]])
        for hf_name, first, rows in names.module_ranges(name, widths):
            views[hf_name] = (codes[first:first + rows], scale)
    return views


def _row_major_codes(name: str, module, weight: torch.Tensor, transposed_view: bool) -> torch.Tensor:
    """The [N, K] row-major codes behind a vLLM FP8 weight, zero-copy, in the layout this vLLM uses.

    vLLM's CUTLASS / torch._scaled_mm paths keep `weight` as the [K, N] transposed view of row-major codes
    (stride (1, K)); a version that keeps the loaded [N, K] tensor has it contiguous. Never a copy: a weight
    that is not in the model's layout (e.g. a contiguous [K, N] transpose) cannot be shared and says so.
    """
    if transposed_view and weight.t().is_contiguous():
        return weight.t()
    out_features = getattr(module, "output_size_per_partition", None) or getattr(module, "output_size", None)
    if not transposed_view and weight.is_contiguous() and (out_features is None or weight.shape[0] == out_features):
        return weight
    raise RuntimeError(f"{name}: engine FP8 weight {tuple(weight.shape)} with strides {weight.stride()} is not in "
                       "this model's layout ([N, K] row-major or its transpose view); cannot share it zero-copy "
                       "(use trainer.base=fp8)")


def embedding_views(model) -> dict[str, torch.Tensor]:
    """{"input": [V_padded, H], "output": [V_padded, H]}: the engine's token embedding and LM head weights.

    vLLM pads the vocabulary (rows past the checkpoint's are zero); the trainer takes the first V rows.
    With tied embeddings vLLM may hold one module for both (then only "input" is returned). Absent entries
    (e.g. a quantized LM head) mean "not shareable": the trainer then loads its own copy.
    """
    embedding_class, lm_head_class = quantization.embedding_classes()
    found: dict[str, torch.Tensor] = {}
    ambiguous: set[str] = set()
    for name, module in model.named_modules():
        if not isinstance(module, embedding_class):
            continue
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            continue
        role = "output" if isinstance(module, lm_head_class) else "input"
        if role in found and found[role].data_ptr() != weight.data_ptr():
            ambiguous.add(role)  # e.g. a draft/MTP head beside the model's own: which one is ours is unclear
            log.info("engine has a second %s embedding (%s): the trainer loads its own copy", role, name)
        found[role] = weight.data
    return {role: weight for role, weight in found.items() if role not in ambiguous}


@contextlib.contextmanager
def captured_layer_io(model, wanted: list[str]) -> Iterator[dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """While active, record the first (input, output) of each named layer (found by name suffix: the model
    may sit in a wrapper whose prefix differs by vLLM version). For checks of the matched engine's layers
    against the kernel; hooks do not fire inside CUDA-graph replay, so use an eager engine."""
    modules = {w: m for n, m in model.named_modules() for w in wanted if n == w or n.endswith("." + w)}
    missing = [w for w in wanted if w not in modules]
    if missing:
        raise KeyError(f"no layer named like {missing}")
    captured: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def recorder(name):
        def hook(module, args, out):  # returns None: a returned value would replace the output
            if name not in captured:
                captured[name] = (args[0].clone(), (out[0] if isinstance(out, tuple) else out).clone())
        return hook

    hooks = [modules[w].register_forward_hook(recorder(w)) for w in wanted]
    try:
        yield captured
    finally:
        for h in hooks:
            h.remove()
