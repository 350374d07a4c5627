"""Group-relative advantage estimators for outcome rewards.

Rewards arrive flat, ``[B*G]``: G completions of each of B prompts, group by group.
Each estimator is ``(rewards, group_size, *, batch_sum)``. When these rewards are one
process's part of the batch, ``batch_sum`` sums a list of floats over every part (the
recipe passes the collective); statistics over groups, such as REINFORCE++'s
whitening, then cover the whole batch, so N processes compute what one does.
Group-relative estimators use only their own groups and never call it.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from omni_rl.registry import Registry

ADVANTAGES: Registry[Callable[..., torch.Tensor]] = Registry("advantage estimator")

BatchSum = Callable[[list[float]], list[float]]


def local_sum(values: list[float]) -> list[float]:
    """The ``batch_sum`` of a batch held whole by this process: the values themselves."""
    return list(values)


# Rewards no further apart than this are equal (dynamic sampling's test too).
EQUAL_REWARDS_TOL = 1e-6


def _groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    if rewards.ndim != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards must be [B*G] with G={group_size}, got shape {tuple(rewards.shape)}")
    return rewards.float().view(-1, group_size)


def equal_groups(r: torch.Tensor, tol: float = EQUAL_REWARDS_TOL) -> torch.Tensor:
    """Whether each group's rewards are all equal (within ``tol``). r: [B, G] -> bool [B, 1]."""
    return (r.amax(dim=1, keepdim=True) - r.amin(dim=1, keepdim=True)) <= tol


def _centred(r: torch.Tensor) -> torch.Tensor:
    """[B, G] rewards minus their group's mean, exactly 0 in a group of equal rewards:
    float32 has no exact mean of eight 0.1s, and members one rounding step off it would
    otherwise carry noise that a division by the group's std (as small) blows up."""
    return (r - r.mean(dim=1, keepdim=True)).masked_fill(equal_groups(r), 0.0)


@ADVANTAGES.register("grpo")
def grpo_advantages(
    rewards: torch.Tensor, group_size: int, eps: float = 1e-6, *, batch_sum: BatchSum = local_sum
) -> torch.Tensor:
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
    return (_centred(r) / (std + eps)).flatten()


@ADVANTAGES.register("dr_grpo")
def dr_grpo_advantages(rewards: torch.Tensor, group_size: int, *, batch_sum: BatchSum = local_sum) -> torch.Tensor:
    """Dr. GRPO: r - group mean, no std normalization (which favours easy and hard
    prompts). rewards: [B*G] -> [B*G]."""
    return _centred(_groups(rewards, group_size)).flatten()


@ADVANTAGES.register("rloo")
def rloo_advantages(rewards: torch.Tensor, group_size: int, *, batch_sum: BatchSum = local_sum) -> torch.Tensor:
    """RLOO: r_i minus the mean of the other G-1 rewards of its group.
    rewards: [B*G] -> [B*G]."""
    if group_size < 2:
        raise ValueError("RLOO needs at least 2 completions per prompt")
    r = _groups(rewards, group_size)
    others = (r.sum(dim=1, keepdim=True) - r) / (group_size - 1)
    return (r - others).masked_fill(equal_groups(r), 0.0).flatten()


@ADVANTAGES.register("reinforce_pp")
def reinforce_pp_advantages(
    rewards: torch.Tensor, group_size: int, eps: float = 1e-6, *, batch_sum: BatchSum = local_sum
) -> torch.Tensor:
    """REINFORCE++ with a group baseline: r - group mean, then whitened over the whole
    batch (mean 0, std 1, std with Bessel's correction), each completion counting once.
    verl weighs completions by their tokens, which shifts every advantage wherever
    length and reward go together and gives a group of equal rewards a non-zero one.

    Args:
        rewards: [B*G], this process's groups (possibly none).
        batch_sum: sums over every process's groups (see the module's docstring); it is
            called once whatever this part holds, so a collective stays in step.
    Returns:
        advantages [B*G]; only centered when the whole batch has fewer than 2.
    """
    centered = dr_grpo_advantages(rewards, group_size)
    wide = centered.double()  # the sum of squares in float64: N parts add up exactly enough
    count, total, squares = batch_sum([float(wide.numel()), float(wide.sum()), float((wide**2).sum())])
    if count < 2:
        return centered
    mean = total / count
    std = math.sqrt(max(squares - count * mean**2, 0.0) / (count - 1))
    return ((wide - mean) / (std + eps)).float()


def compute_advantages(
    method: str, rewards: torch.Tensor, group_size: int, batch_sum: BatchSum = local_sum
) -> torch.Tensor:
    """Dispatch to the estimator registered as ``method``. rewards: [B*G] -> [B*G].
    ``batch_sum``: see the module's docstring; every process must call this alike."""
    return ADVANTAGES.get(method)(rewards, group_size, batch_sum=batch_sum)
