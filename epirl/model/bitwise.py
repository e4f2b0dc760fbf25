"""The trainer's half of the bitwise pairing (`engine.bitwise`): the Hugging Face decoder's norms, attention and
MLP run `epirl.kernels.invariant`, the ops the matched engine runs in vLLM's model (epirl/engine/vllm_compat/invariant_layers.py).

The projections already are the engine's (the W8A16 op); here the rest of the forward follows: every RMSNorm, the
rotary embedding (one fp32 table built the same way on both sides), causal attention, SiLU-and-multiply. The decoder
layer's own code stays: its residual adds are bf16 adds, which round the fp32 sum exactly as the engine's fused
add-and-norm does, and they happen in the same places. The LM head is `chunked_token_logprobs(..., bitwise=True)`.
Installed as bound methods on the modules (the model definition stays transformers'), so a model that is not a
Llama-style decoder is refused by name instead of being half converted.
"""

from __future__ import annotations

import itertools
import types

import torch
from torch import nn

from epirl.kernels import invariant

SUPPORTED_ACTIVATIONS = ("silu",)


class BitwiseUnsupported(ValueError):
    """The model has a part the bitwise forward has no shared kernel for."""


def rope_settings(config) -> tuple[float, int, int]:
    """(base, rotary_dim, positions) of a default (unscaled) rotary embedding; anything else is refused."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    scaling = getattr(config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type != "default":
        raise BitwiseUnsupported(f"engine.bitwise: rotary embedding type {rope_type!r} has no bitwise kernel "
                                 "(the unscaled one has)")
    base = params.get("rope_theta", getattr(config, "rope_theta", None))
    if base is None:
        raise BitwiseUnsupported("engine.bitwise: the model config names no rope_theta")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rotary_dim = int(head_dim * params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)))
    return float(base), rotary_dim, int(config.max_position_embeddings)


def _norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    return invariant.rms_norm(hidden_states, self.weight, self.variance_epsilon)


def _mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    return self.down_proj(invariant.silu_mul(self.gate_proj(x), self.up_proj(x)))


def _attention_forward(self, hidden_states: torch.Tensor, position_embeddings=None, attention_mask=None,
                       past_key_values=None, **kwargs):
    """Right-padded sequences from position 0 (the trainer's batches; `Policy.token_logprobs` refuses a mask)."""
    batch, seq, _ = hidden_states.shape
    shape = (batch, seq, -1, self.head_dim)
    q = self.q_proj(hidden_states).view(shape)
    k = self.k_proj(hidden_states).view(shape)
    v = self.v_proj(hidden_states).view(shape)
    if getattr(self, "q_norm", None) is not None:  # Qwen3: per-head RMSNorm before the rotation
        q, k = self.q_norm(q), self.k_norm(k)
    positions = torch.arange(seq, device=hidden_states.device)
    table = self._epirl_rotary_table
    q, k = invariant.rotary(q, positions, table), invariant.rotary(k, positions, table)
    out = invariant.attention_batched(q, k, v, self.scaling)
    return self.o_proj(out.reshape(batch, seq, -1)), None


def install_bitwise_forward(model: nn.Module, config) -> int:
    """Make every decoder layer of `model` run the invariant ops; returns the number of modules changed. Refuses
    (BitwiseUnsupported, one line) a model whose layers are not RMSNorm + rotary attention + gated SiLU MLP."""
    act = getattr(config, "hidden_act", None)
    if act not in SUPPORTED_ACTIVATIONS:
        raise BitwiseUnsupported(f"engine.bitwise: MLP activation {act!r} has no bitwise kernel "
                                 f"(supported: {', '.join(SUPPORTED_ACTIVATIONS)})")
    base, rotary_dim, positions = rope_settings(config)
    changed = attention = 0
    for name, module in model.named_modules():
        kind = type(module).__name__
        if kind.endswith("RMSNorm") and hasattr(module, "variance_epsilon"):
            module.forward = types.MethodType(_norm_forward, module)
        elif kind.endswith("Attention") and hasattr(module, "q_proj"):
            if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", False):
                raise BitwiseUnsupported(f"engine.bitwise: {name} uses a sliding window, which has no bitwise kernel")
            device = next(itertools.chain(module.parameters(), module.buffers())).device
            module._epirl_rotary_table = invariant.rotary_table(rotary_dim, base, positions, device)
            module.forward = types.MethodType(_attention_forward, module)
            attention += 1
        elif kind.endswith("MLP") and all(hasattr(module, p) for p in ("gate_proj", "up_proj", "down_proj")):
            module.forward = types.MethodType(_mlp_forward, module)
        elif kind.endswith(("Norm", "LayerNorm")) or (kind.endswith("Attention") and not hasattr(module, "q_proj")):
            raise BitwiseUnsupported(f"engine.bitwise: {name} ({kind}) has no bitwise kernel")
        else:
            continue
        changed += 1
    if attention == 0:
        raise BitwiseUnsupported(f"engine.bitwise: no attention layer found in {type(model).__name__}")
    return changed
