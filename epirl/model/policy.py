"""`Policy`: the trainer-side causal LM with LoRA linears, and log-probs computed in token chunks.

The LM head runs over `chunk_tokens` tokens at a time with an fp32 log-softmax, so the
[tokens, vocab] logits never exist at once (a 9B Qwen3.5 has a 248k vocabulary: 8×2048 tokens of fp32
logits would be 16 GB). Each chunk is activation-checkpointed, so the backward recomputes one chunk's
logits at a time instead of keeping all of them (epirl/model/logprobs.py).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

from epirl.model.logprobs import chunked_token_logprobs
from epirl.model.lora import lora_modules as find_lora_modules
from epirl.model.memory import policy_memory_report


def peft_key(module_name: str, which: str) -> str:
    """PEFT's saved tensor name: `base_model.model.<module path>.lora_{A,B}.weight`."""
    return f"base_model.model.{module_name}.lora_{which}.weight"


class Policy:
    """A transformers causal LM whose target projections are LoRA linears (bf16 or FP8 base)."""

    def __init__(self, model: nn.Module, base: str, lora_rank: int, lora_alpha: float, targets: list[str],
                 model_path: str):
        self.model = model
        self.base = base
        self.lora_rank = lora_rank
        self.lora_alpha = lora_alpha
        self.targets = list(targets)
        self.model_path = model_path
        self._lora_modules = find_lora_modules(model)
        # Storage pointers of base tensors the rollout engine owns (`trainer.base: shared`).
        self.engine_storages: set[int] = set()
        # The checkpoint keeps the text model under `model.language_model.` (Qwen3.5): adapter files use it.
        self.nests_text_model = False
        self.random_weights = False  # model.load_format=dummy: saved adapters are marked, never evaluated
        self.linear_attention_kernel = "none"  # Qwen3.5 gated DeltaNet: "fla" or "torch (...)"
        self.bitwise = False  # engine.bitwise: the decoder and the LM head run the invariant ops (model.bitwise)

    @property
    def device(self) -> torch.device:
        return self.model.get_input_embeddings().weight.device

    def lora_modules(self) -> dict[str, nn.Module]:
        return dict(self._lora_modules)

    def lora_parameters(self) -> list[nn.Parameter]:
        return [p for m in self._lora_modules.values() for p in (m.lora_A, m.lora_B)]

    def lora_state_dict(self) -> dict[str, torch.Tensor]:
        """PEFT-named, unscaled, detached clones (vLLM scales B in place when it loads an adapter)."""
        state = {}
        for name, module in self._lora_modules.items():
            state[peft_key(name, "A")] = module.lora_A.detach().clone()
            state[peft_key(name, "B")] = module.lora_B.detach().clone()
        return state

    @torch.no_grad()
    def load_lora_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Inverse of `lora_state_dict`; every LoRA tensor must be present with the right shape."""
        expected = {peft_key(n, w) for n in self._lora_modules for w in "AB"}
        missing, unexpected = expected - state.keys(), state.keys() - expected
        if missing or unexpected:
            raise KeyError(f"LoRA state dict mismatch: {len(missing)} missing (e.g. {sorted(missing)[:2]}), "
                           f"{len(unexpected)} unexpected (e.g. {sorted(unexpected)[:2]})")
        for name, module in self._lora_modules.items():
            for which in "AB":
                param = getattr(module, f"lora_{which}")
                tensor = state[peft_key(name, which)]
                if tensor.shape != param.shape:
                    raise ValueError(f"{peft_key(name, which)}: shape {tuple(tensor.shape)} != {tuple(param.shape)}"
                                     f" (adapter rank {tensor.shape} vs lora.rank={self.lora_rank}?)")
                param.copy_(tensor)

    def hidden_states(self, input_ids_B_T: torch.Tensor, attention_mask_B_T: torch.Tensor | None = None
                      ) -> torch.Tensor:
        """The decoder body's final (normed) hidden states [B, T, H]; no logits."""
        body = self.model.get_decoder()
        out = body(input_ids=input_ids_B_T, attention_mask=attention_mask_B_T, use_cache=False)
        return out.last_hidden_state

    def token_logprobs(self, input_ids_B_T: torch.Tensor, targets_B_T: torch.Tensor, temperature: float,
                       chunk_tokens: int, with_entropy: bool = False,
                       attention_mask_B_T: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """fp32 log p(targets[b, t] | input_ids[b, :t+1]) / T-softmax, [B, T]; optional entropy [B, T].

        Differentiable w.r.t. the LoRA parameters. With right padding no attention mask is needed
        (causal attention never looks right); pass one for left padding.
        """
        if self.bitwise and attention_mask_B_T is not None:
            raise ValueError("engine.bitwise: the trainer's bitwise attention takes right-padded sequences "
                             "without an attention mask")
        hidden_B_T_H = self.hidden_states(input_ids_B_T, attention_mask_B_T)
        batch, seq = targets_B_T.shape
        hidden_N_H = hidden_B_T_H.reshape(batch * seq, -1)
        logprobs_N, entropy_N = chunked_token_logprobs(
            hidden_N_H, targets_B_T.reshape(-1), self.model.get_output_embeddings(), temperature,
            chunk_tokens, with_entropy, exact_head=self.bitwise)
        entropy_B_T = None if entropy_N is None else entropy_N.view(batch, seq)
        return logprobs_N.view(batch, seq), entropy_B_T

    @contextlib.contextmanager
    def adapter_disabled(self) -> Iterator[None]:
        """The base model: every LoRA term scaled by 0 (exactly: σ = 0), restored on exit."""
        scales = {name: module.lora_scale for name, module in self._lora_modules.items()}
        try:
            for module in self._lora_modules.values():
                module.lora_scale = 0.0
            yield
        finally:
            for name, module in self._lora_modules.items():
                module.lora_scale = scales[name]

    def memory_report(self) -> dict:
        """Bytes: base_projection (+ _dtype), base_other (embeddings, LM head, norms), base_weight (all three
        count only what the trainer owns), base_shared (engine-owned storages it maps), lora_param,
        lora_grad, optimizer_bytes_est (AdamW), static; on CUDA also cuda_peak_allocated and
        peak_activation_bytes_est (peak − allocated now: call between steps, after resetting the peak stats)."""
        return policy_memory_report(self)

    def train(self) -> "Policy":
        self.model.train()
        return self

    def eval(self) -> "Policy":
        self.model.eval()
        return self
