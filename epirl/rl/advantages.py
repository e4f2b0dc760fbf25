"""Group-relative advantages (GRPO) and DAPO's dynamic sampling filter."""

from __future__ import annotations

import torch


def group_advantages(rewards_P_G: torch.Tensor, std_normalize: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """A_pg = r_pg − mean_g(r_p·), divided by the group's std when `std_normalize` (GRPO; off = Dr. GRPO).

    A group whose rewards are all equal gets zero advantages (no signal, and no division by a zero std).
    The std is the unbiased sample std, as in DeepSeekMath/verl.
    """
    if rewards_P_G.ndim != 2 or rewards_P_G.shape[1] < 2:
        raise ValueError(f"rewards must be [prompts, samples>=2], got {tuple(rewards_P_G.shape)}")
    rewards_P_G = rewards_P_G.float()
    centred_P_G = rewards_P_G - rewards_P_G.mean(dim=1, keepdim=True)
    if not std_normalize:
        return centred_P_G
    std_P_1 = rewards_P_G.std(dim=1, keepdim=True)
    return torch.where(std_P_1 > eps, centred_P_G / (std_P_1 + eps), torch.zeros_like(centred_P_G))


def informative_groups(rewards_P_G: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Mask of groups whose rewards are not all equal (DAPO dynamic sampling keeps only these)."""
    return (rewards_P_G.max(dim=1).values - rewards_P_G.min(dim=1).values) > eps
