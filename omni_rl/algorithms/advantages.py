"""Group-relative advantage estimators for outcome rewards.

Rewards arrive flat, ``[B*G]``: G completions of each of B prompts, group by group.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from omni_rl.registry import Registry

ADVANTAGES: Registry[Callable[..., torch.Tensor]] = Registry("advantage estimator")


def _groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    if rewards.ndim != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards must be [B*G] with G={group_size}, got shape {tuple(rewards.shape)}")
    return rewards.float().view(-1, group_size)


@ADVANTAGES.register("grpo")
def grpo_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """GRPO: (r - group mean) / (group std + eps), std with Bessel's correction.

    Args:
        rewards: [B*G].
    Returns:
        advantages [B*G]; 0 for a group whose rewards are all equal.
    """
    r = _groups(rewards, group_size)
    if r.numel() == 0:  # every group was filtered out
        return rewards.float()
    std = r.std(dim=1, keepdim=True) if group_size > 1 else torch.zeros_like(r[:, :1])
    return ((r - r.mean(dim=1, keepdim=True)) / (std + eps)).flatten()


@ADVANTAGES.register("dr_grpo")
def dr_grpo_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Dr. GRPO: r - group mean, no std normalization (which favours easy and hard
    prompts). rewards: [B*G] -> [B*G]."""
    r = _groups(rewards, group_size)
    return (r - r.mean(dim=1, keepdim=True)).flatten()


@ADVANTAGES.register("rloo")
def rloo_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """RLOO: r_i minus the mean of the other G-1 rewards of its group.
    rewards: [B*G] -> [B*G]."""
    if group_size < 2:
        raise ValueError("RLOO needs at least 2 completions per prompt")
    r = _groups(rewards, group_size)
    others = (r.sum(dim=1, keepdim=True) - r) / (group_size - 1)
    return (r - others).flatten()


@ADVANTAGES.register("reinforce_pp")
def reinforce_pp_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """REINFORCE++ with a group baseline: r - group mean, then whitened over the whole
    batch (mean 0, std 1). rewards: [B*G] -> [B*G]."""
    centered = dr_grpo_advantages(rewards, group_size)
    if centered.numel() < 2:
        return centered
    return (centered - centered.mean()) / (centered.std() + eps)


def compute_advantages(method: str, rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Dispatch to the estimator registered as ``method``."""
    return ADVANTAGES.get(method)(rewards, group_size)
