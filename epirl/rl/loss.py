"""The DAPO/GRPO policy loss and importance-sampling corrections, as pure functions with metrics.

Shapes: B sequences × T response tokens, `mask_B_T` marks real response tokens. All log-probs are fp32
log-probs of the sampled tokens at the sampling temperature.

Three policies meet here:
  π_engine (sampled the tokens; `engine_logprobs`), π_old (trainer at sampling time; `old_logprobs`), and
  π_θ (trainer now; `logprobs`). The PPO ratio is π_θ/π_old. The engine–trainer mismatch is corrected by
  w = π_old/π_engine per token: truncated (TIS, w ← min(w, C)), masked (MIS, tokens with w > C dropped), or
  per sequence (the product of the token ratios). Weights carry no gradient.
"""

from __future__ import annotations

import torch

CORRECTIONS = ("none", "tis", "mis", "seq-tis", "seq-mis")


def masked_mean(values_B_T: torch.Tensor, mask_B_T: torch.Tensor) -> torch.Tensor:
    mask = mask_B_T.to(values_B_T.dtype)
    return (values_B_T * mask).sum() / mask.sum().clamp(min=1.0)


def bitwise_equal(a_B_T: torch.Tensor, b_B_T: torch.Tensor) -> torch.Tensor:
    """Where two fp32 log-prob tensors hold the same bits (the engine and the trainer computed the same number, not a
    close one: -0.0 differs from +0.0, a NaN equals only the same NaN)."""
    return a_B_T.float().contiguous().view(torch.int32) == b_B_T.float().contiguous().view(torch.int32)


def importance_weights(
    old_logprobs_B_T: torch.Tensor,
    engine_logprobs_B_T: torch.Tensor,
    mask_B_T: torch.Tensor,
    correction: str,
    cap: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-token weights w (no gradient) that correct rollouts sampled by the engine, plus metrics.

    tis: w = min(π_old/π_eng, C) per token.  mis: w = π_old/π_eng, 0 where it exceeds C.
    seq-tis / seq-mis: the same on the sequence ratio Π_t π_old/π_eng, broadcast to the tokens.
    """
    if correction not in CORRECTIONS:
        raise ValueError(f"unknown correction '{correction}', expected one of {CORRECTIONS}")
    mask = mask_B_T.bool()
    log_ratio_B_T = (old_logprobs_B_T - engine_logprobs_B_T).detach().masked_fill(~mask, 0.0)
    ratio_B_T = log_ratio_B_T.exp()
    equal_B_T = bitwise_equal(old_logprobs_B_T, engine_logprobs_B_T)
    metrics = {
        "mismatch/k3_kl": masked_mean(ratio_B_T - 1 - log_ratio_B_T, mask).item(),  # KL(engine‖trainer) est.
        "mismatch/max_abs_logratio": log_ratio_B_T.abs().max().item() if mask.any() else 0.0,
        "mismatch/mean_ratio": masked_mean(ratio_B_T, mask).item(),
        "mismatch/bitwise_frac": masked_mean(equal_B_T.float(), mask).item(),
        # the count behind it: sums over micro-batches and ranks exactly, so a step with none reports 1.0, not 1 - ulp
        "mismatch/unequal_tokens": float((~equal_B_T & mask).sum().item()),
    }
    if correction == "none":
        return torch.ones_like(ratio_B_T), metrics | {"is/clipped_frac": 0.0}
    if correction.startswith("seq-"):
        seq_log_ratio_B = log_ratio_B_T.sum(dim=1)
        seq_ratio_B = seq_log_ratio_B.clamp(max=60.0).exp()  # avoid inf; anything this large is capped anyway
        exceeds_B = seq_ratio_B > cap
        weight_B = seq_ratio_B.clamp(max=cap) if correction == "seq-tis" else torch.where(exceeds_B, 0.0, seq_ratio_B)
        weights_B_T = weight_B[:, None].expand_as(ratio_B_T) * mask
        return weights_B_T, metrics | {"is/clipped_frac": exceeds_B.float().mean().item()}
    exceeds_B_T = (ratio_B_T > cap) & mask
    if correction == "tis":
        weights_B_T = ratio_B_T.clamp(max=cap)
    else:
        weights_B_T = torch.where(exceeds_B_T, torch.zeros_like(ratio_B_T), ratio_B_T)
    return weights_B_T * mask, metrics | {"is/clipped_frac": masked_mean(exceeds_B_T.float(), mask).item()}


def aggregate(loss_B_T: torch.Tensor, mask_B_T: torch.Tensor, mode: str, total_tokens: float | None = None) -> torch.Tensor:
    """token-mean: Σ loss / Σ tokens (DAPO; `total_tokens` = the whole step's count so micro-batches add up);
    seq-mean-token-sum: mean over sequences of per-sequence sums; seq-mean-token-mean: GRPO's original."""
    mask = mask_B_T.to(loss_B_T.dtype)
    if mode == "token-mean":
        denom = mask.sum().clamp(min=1.0) if total_tokens is None else torch.tensor(float(total_tokens))
        return (loss_B_T * mask).sum() / denom
    if mode == "seq-mean-token-sum":
        return (loss_B_T * mask).sum(dim=1).mean()
    if mode == "seq-mean-token-mean":
        return ((loss_B_T * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)).mean()
    raise ValueError(f"unknown loss aggregation '{mode}'")


def dapo_loss(
    logprobs_B_T: torch.Tensor,
    old_logprobs_B_T: torch.Tensor,
    advantages_B: torch.Tensor,
    mask_B_T: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    is_weights_B_T: torch.Tensor | None = None,
    ref_logprobs_B_T: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    loss_agg: str = "token-mean",
    total_tokens: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped policy-gradient loss with clip-higher (ε_low, ε_high), optional IS weights and k3 KL.

    per token: −w · min(ρ·A, clip(ρ, 1−ε_low, 1+ε_high)·A), ρ = exp(logp − logp_old); + β·k3(π_θ‖π_ref).
    """
    mask = mask_B_T.bool()
    log_ratio_B_T = (logprobs_B_T - old_logprobs_B_T).masked_fill(~mask, 0.0)
    ratio_B_T = log_ratio_B_T.exp()
    adv_B_T = advantages_B[:, None].to(ratio_B_T.dtype).expand_as(ratio_B_T)
    unclipped_B_T = ratio_B_T * adv_B_T
    clipped_B_T = ratio_B_T.clamp(1.0 - clip_low, 1.0 + clip_high) * adv_B_T
    pg_loss_B_T = -torch.minimum(unclipped_B_T, clipped_B_T)
    if is_weights_B_T is not None:
        pg_loss_B_T = pg_loss_B_T * is_weights_B_T.detach()
    loss_B_T = pg_loss_B_T
    kl_value = 0.0
    if kl_coef > 0.0:
        if ref_logprobs_B_T is None:
            raise ValueError("kl_coef > 0 needs ref_logprobs")
        ref_log_ratio_B_T = (ref_logprobs_B_T - logprobs_B_T).masked_fill(~mask, 0.0)
        kl_B_T = ref_log_ratio_B_T.exp() - 1.0 - ref_log_ratio_B_T
        loss_B_T = loss_B_T + kl_coef * kl_B_T
        kl_value = masked_mean(kl_B_T.detach(), mask).item()
    loss = aggregate(loss_B_T, mask_B_T, loss_agg, total_tokens)
    with torch.no_grad():
        clipped_low = (ratio_B_T < 1.0 - clip_low) & (adv_B_T < 0) & mask
        clipped_high = (ratio_B_T > 1.0 + clip_high) & (adv_B_T > 0) & mask
        metrics = {
            "loss/pg": aggregate(pg_loss_B_T.detach(), mask_B_T, loss_agg, total_tokens).item(),
            "loss/clip_frac_low": masked_mean(clipped_low.float(), mask).item(),
            "loss/clip_frac_high": masked_mean(clipped_high.float(), mask).item(),
            "loss/ratio_mean": masked_mean(ratio_B_T.detach(), mask).item(),
            "loss/kl_ref": kl_value,
        }
    return loss, metrics
