"""PPO for chunked policies: GAE, the clipped surrogate, the clipped Huber value loss,
and episode-group advantages for the critic-free variant.

Time runs over chunks: one transition is one action chunk, its reward the sum of the
rewards of the actions executed. Shapes: [T, N] for T chunks of N envs.
"""

from __future__ import annotations

import torch


def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    next_values: torch.Tensor,
    terminated: torch.Tensor,
    done: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation.

    Args:
        rewards: [T, N] chunk rewards.
        values: [T, N] V(s_t).
        next_values: [T, N] V of the state after chunk t: the next chunk's state, or,
            where the episode was truncated, its final observation (bootstrap).
        terminated: [T, N] the episode ended in a terminal state (no bootstrap).
        done: [T, N] the episode ended (terminated or truncated): the advantage
            recursion stops there.
        gamma, lam: discount per chunk and GAE's lambda.

    Returns:
        advantages [T, N] and returns (advantages + values) [T, N].
    """
    not_terminal = 1.0 - terminated.float()
    continues = 1.0 - done.float()
    deltas = rewards + gamma * next_values * not_terminal - values
    advantages = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[0])
    for t in reversed(range(rewards.shape[0])):
        running = deltas[t] + gamma * lam * continues[t] * running
        advantages[t] = running
    return advantages, advantages + values


def normalize(advantages: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Zero mean, unit std over the batch."""
    return (advantages - advantages.mean()) / (advantages.std() + eps)


def _reduce(loss: torch.Tensor, reduction: str) -> torch.Tensor:
    """'mean' over all entries, or 'sum' over the batch (first) dim of each item's mean
    over the others: a share of a larger batch's mean, to be divided by its size."""
    if reduction == "mean":
        return loss.mean()
    if reduction == "sum":
        return loss.flatten(1).mean(dim=1).sum() if loss.dim() > 1 else loss.sum()
    raise ValueError(f"reduction '{reduction}': use 'mean' or 'sum'")


def clipped_surrogate(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    clip_low: float,
    clip_high: float,
    reduction: str = "mean",
) -> tuple[torch.Tensor, dict]:
    """PPO's clipped objective as a loss (mean over all entries, or with ``reduction``
    'sum' the sum over the batch of each item's mean).

    ``logp`` / ``old_logp``: [B] per chunk, or [B, ...] per element with ``advantages``
    broadcast from [B]. Returns the loss and ratio statistics (over this batch)."""
    while advantages.dim() < logp.dim():
        advantages = advantages.unsqueeze(-1)
    ratio = torch.exp(logp - old_logp)
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = _reduce(-torch.minimum(ratio * advantages, clipped * advantages), reduction)
    with torch.no_grad():
        stats = {
            "ratio_mean": ratio.mean().item(),
            "ratio_max": ratio.max().item(),
            "clip_fraction": ((ratio < 1.0 - clip_low) | (ratio > 1.0 + clip_high)).float().mean().item(),
            "approx_kl": ((ratio - 1) - (logp - old_logp)).mean().item(),
        }
    return loss, stats


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    clip: float | None,
    huber_delta: float,
    reduction: str = "mean",
) -> torch.Tensor:
    """Huber loss to the returns; with ``clip``, the pessimistic max against a value
    kept within ``clip`` of the old one (PPO's value clipping). ``reduction``: 'mean'
    or 'sum' over the batch."""
    loss = torch.nn.functional.huber_loss(values, returns, reduction="none", delta=huber_delta)
    if clip is not None:
        kept = old_values + (values - old_values).clamp(-clip, clip)
        loss = torch.maximum(loss, torch.nn.functional.huber_loss(kept, returns, reduction="none", delta=huber_delta))
    return _reduce(loss, reduction)


def group_advantages(returns: torch.Tensor, groups: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Critic-free advantages: each episode's return minus its group's mean, over the
    group's std (episodes from the same initial state form a group).

    Args:
        returns: [E] episode returns.
        groups: [E] group index of each episode.
    """
    advantages = torch.zeros_like(returns)
    for g in groups.unique():
        members = groups == g
        r = returns[members]
        std = r.std() if r.numel() > 1 else torch.ones((), dtype=r.dtype)
        advantages[members] = (r - r.mean()) / (std + eps)
    return advantages
