"""One optimizer step of the LoRA trainer over a rollout batch: micro-batches, DAPO loss, AdamW, clipping.

The policy (epirl.model.Policy) owns the network; this file owns the optimization: which tensors go in,
how gradients accumulate so that micro-batching does not change the loss (token-mean over the whole step),
and the learning-rate schedule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from epirl.config import EpirlConfig
from epirl.rl.distributed import Ranks, bitwise_fraction
from epirl.rl.loss import dapo_loss, importance_weights


@dataclass
class TrainBatch:
    """Sequences of one step, right-padded. Position t predicts `targets_B_T[:, t]` from tokens ≤ t.

    mask_B_T marks response tokens (the ones the loss sees); engine_logprobs_B_T are the engine's
    processed log-probs of those tokens (0 elsewhere); advantages_B one per sequence. old_logprobs_B_T
    (π_old, when `rl.ppo_epochs` > 1) and ref_logprobs_B_T (the base model, when `rl.kl_coef` > 0) are
    scored once before the step's first update.
    """

    input_ids_B_T: torch.Tensor
    targets_B_T: torch.Tensor
    mask_B_T: torch.Tensor
    engine_logprobs_B_T: torch.Tensor
    advantages_B: torch.Tensor
    old_logprobs_B_T: torch.Tensor | None = None
    ref_logprobs_B_T: torch.Tensor | None = None

    @property
    def num_sequences(self) -> int:
        return self.input_ids_B_T.shape[0]

    def _map(self, fn) -> "TrainBatch":
        return TrainBatch(*(None if t is None else fn(t) for t in (
            self.input_ids_B_T, self.targets_B_T, self.mask_B_T, self.engine_logprobs_B_T, self.advantages_B,
            self.old_logprobs_B_T, self.ref_logprobs_B_T)))

    def slice(self, start: int, stop: int) -> "TrainBatch":
        # Trim right padding shared by the whole micro-batch: shorter micro-batches run faster.
        mask = self.mask_B_T[start:stop]
        length = int(mask.any(dim=0).nonzero().max().item()) + 1 if mask.any() else 1
        return self._map(lambda t: t[start:stop, :length] if t.ndim == 2 else t[start:stop])

    def to(self, device) -> "TrainBatch":
        return self._map(lambda t: t.to(device))


def build_batch(sequences: list[tuple[list[int], list[int], list[float], float]], pad_id: int) -> TrainBatch:
    """From (prompt_ids, completion_ids, engine_logprobs, advantage) tuples to padded tensors."""
    full = [p + c for p, c, _, _ in sequences]
    length = max(len(s) for s in full) - 1
    B = len(sequences)
    input_ids = torch.full((B, length), pad_id, dtype=torch.long)
    targets = torch.full((B, length), pad_id, dtype=torch.long)
    mask = torch.zeros((B, length), dtype=torch.bool)
    engine_lp = torch.zeros((B, length), dtype=torch.float32)
    for b, (prompt, completion, lps, _) in enumerate(sequences):
        seq = full[b]
        n = len(seq) - 1
        input_ids[b, :n] = torch.tensor(seq[:-1])
        targets[b, :n] = torch.tensor(seq[1:])
        start = len(prompt) - 1  # position whose target is the first completion token
        mask[b, start:start + len(completion)] = True
        engine_lp[b, start:start + len(completion)] = torch.tensor(lps, dtype=torch.float32)
    advantages = torch.tensor([s[3] for s in sequences], dtype=torch.float32)
    return TrainBatch(input_ids, targets, mask, engine_lp, advantages)


def build_optimizer(params: list[torch.nn.Parameter], cfg: EpirlConfig):
    """AdamW over the LoRA parameters and a linear-warmup-then-constant LR schedule."""
    # fused on every device (torch has it on CPU too): the CPU tests run the optimizer the GPU runs, which updates
    # the parameters in place without bumping their `_version` (nothing may key a cache on it)
    optimizer = torch.optim.AdamW(params, lr=cfg.trainer.lr, betas=tuple(cfg.trainer.betas),
                                  weight_decay=cfg.trainer.weight_decay, fused=True)
    warmup = cfg.trainer.warmup_steps
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / (warmup + 1)) if warmup else 1.0)
    return optimizer, scheduler


def train_step(policy, optimizer, scheduler, batch: TrainBatch | None, cfg: EpirlConfig, device,
               ranks: Ranks | None = None) -> dict[str, float]:
    """`rl.ppo_epochs` optimizer steps over the rollout batch; metrics of the last one.

    π_old (for epochs after the first) and the KL reference (the base model: adapter off) are scored once,
    before the first update; with one epoch π_old is the current trainer itself, detached. With several
    ranks `batch` is this rank's part of the global batch (None: no sequences here; the rank still joins
    every collective).
    """
    rl, ranks = cfg.rl, ranks or Ranks()
    if rl.ppo_epochs > 1 and batch is not None:
        batch.old_logprobs_B_T = score_batch(policy, batch, cfg, device)
    if rl.kl_coef > 0.0 and batch is not None:
        with policy.adapter_disabled():
            batch.ref_logprobs_B_T = score_batch(policy, batch, cfg, device)
    for _ in range(rl.ppo_epochs):
        metrics = optimizer_step(policy, optimizer, scheduler, batch, cfg, device, ranks)
    return metrics | {"train/epochs": float(rl.ppo_epochs)}


@torch.no_grad()
def score_batch(policy, batch: TrainBatch, cfg: EpirlConfig, device) -> torch.Tensor:
    """The policy's log-probs of the batch's targets [B, T] (0 past each micro-batch's trimmed length)."""
    out_B_T = torch.zeros(batch.targets_B_T.shape, dtype=torch.float32)
    for start in range(0, batch.num_sequences, cfg.trainer.micro_batch_size):
        micro = batch.slice(start, start + cfg.trainer.micro_batch_size).to(device)
        logprobs_B_T, _ = policy.token_logprobs(micro.input_ids_B_T, micro.targets_B_T, cfg.rl.temperature,
                                                cfg.trainer.logprob_chunk_tokens)
        out_B_T[start:start + micro.num_sequences, :logprobs_B_T.shape[1]] = logprobs_B_T.float().cpu()
    return out_B_T


def optimizer_step(policy, optimizer, scheduler, batch: TrainBatch | None, cfg: EpirlConfig, device,
                   ranks: Ranks | None = None) -> dict[str, float]:
    """Forward/backward over micro-batches, clip, step. Returns metrics averaged over the step's tokens.

    Token and sequence counts are those of the global batch (summed over ranks) and the gradients are summed
    over ranks before clipping, so any split of the batch over ranks and micro-batches gives the same update;
    each rank's metrics are then its additive share (see distributed.reduce_metrics)."""
    rl, tr, ranks = cfg.rl, cfg.trainer, ranks or Ranks()
    local_sequences = 0 if batch is None else batch.num_sequences
    total_tokens = ranks.sum(0.0 if batch is None else float(batch.mask_B_T.sum().item()))
    total_sequences = ranks.sum(float(local_sequences))
    sums: dict[str, float] = {}
    optimizer.zero_grad(set_to_none=True)
    policy.model.train()
    for start in range(0, local_sequences, tr.micro_batch_size):
        micro = batch.slice(start, start + tr.micro_batch_size).to(device)
        logprobs_B_T, entropy_B_T = policy.token_logprobs(
            micro.input_ids_B_T, micro.targets_B_T, rl.temperature, tr.logprob_chunk_tokens, with_entropy=True)
        old_logprobs_B_T = logprobs_B_T.detach() if micro.old_logprobs_B_T is None else micro.old_logprobs_B_T
        weights_B_T, is_metrics = importance_weights(
            old_logprobs_B_T, micro.engine_logprobs_B_T, micro.mask_B_T, rl.correction, rl.tis_cap)
        loss, loss_metrics = dapo_loss(
            logprobs_B_T, old_logprobs_B_T, micro.advantages_B, micro.mask_B_T,
            clip_low=rl.clip_low, clip_high=rl.clip_high, is_weights_B_T=weights_B_T,
            ref_logprobs_B_T=micro.ref_logprobs_B_T, kl_coef=rl.kl_coef,
            loss_agg=rl.loss_agg, total_tokens=total_tokens if rl.loss_agg == "token-mean" else None)
        # token-mean already divides by the whole step's token count; per-sequence means are weighted by the
        # micro-batch's share of the sequences, so any micro-batching sums to the same step loss.
        micro_weight = 1.0 if rl.loss_agg == "token-mean" else micro.num_sequences / total_sequences
        (loss * micro_weight).backward()
        tokens = float(micro.mask_B_T.sum().item())
        share = tokens / max(total_tokens, 1.0)
        with torch.no_grad():
            mask = micro.mask_B_T
            entropy = (entropy_B_T * mask).sum().item() / max(tokens, 1.0) if entropy_B_T is not None else 0.0
        for key, value in {**is_metrics, **loss_metrics, "train/entropy": entropy}.items():
            if key == "loss/pg":
                sums[key] = sums.get(key, 0.0) + value * micro_weight
            elif key == "mismatch/max_abs_logratio":
                sums[key] = max(sums.get(key, 0.0), value)
            elif key == "mismatch/unequal_tokens":
                sums[key] = sums.get(key, 0.0) + value
            elif key.startswith("is/") and rl.correction.startswith("seq-"):  # per-sequence fractions
                sums[key] = sums.get(key, 0.0) + value * micro.num_sequences / total_sequences
            else:
                sums[key] = sums.get(key, 0.0) + value * share
    if "mismatch/unequal_tokens" in sums:  # from the count (reduce_metrics does the same over ranks)
        sums["mismatch/bitwise_frac"] = bitwise_fraction(sums["mismatch/unequal_tokens"], total_tokens)
    dist_metrics = ranks.all_reduce_gradients(policy.lora_parameters())
    grad_norm = torch.nn.utils.clip_grad_norm_(policy.lora_parameters(), tr.max_grad_norm)
    if not math.isfinite(grad_norm.item()):
        optimizer.zero_grad(set_to_none=True)
        raise FloatingPointError(f"non-finite gradient norm {grad_norm.item()}: the run stops before the adapter "
                                 "is updated (the last checkpoint is intact)")
    optimizer.step()
    scheduler.step()
    return sums | dist_metrics | {"train/grad_norm": grad_norm.item(), "train/lr": scheduler.get_last_lr()[0],
                                  "train/tokens": total_tokens, "train/sequences": total_sequences}
