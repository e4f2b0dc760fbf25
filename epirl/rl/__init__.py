"""GRPO/DAPO: advantages, losses, the optimizer step (`trainer`) and the colocated loop (`loop.train`)."""

from epirl.rl.advantages import group_advantages, informative_groups
from epirl.rl.loss import aggregate, dapo_loss, importance_weights, masked_mean

__all__ = ["aggregate", "dapo_loss", "group_advantages", "importance_weights", "informative_groups", "masked_mean"]
