"""PPO for chunked policies: GAE and the clipped Huber value loss (the clipped policy
surrogate is ``omni_rl.algorithms.losses.clipped_policy_loss``, the critic-free
variant's group advantages ``omni_rl.algorithms.advantages.grpo_advantages``; both are
GRPO's too).

Time runs over chunks: one transition is one action chunk of h executed env steps.
The discount and GAE's lambda are set per env step and turned into per-chunk terms
(:func:`chunk_discounting`), so the effective horizon does not change with the chunk
size. Shapes: [T, N] for T chunks of N envs, [T, N, h] per env step.
"""

from __future__ import annotations

import torch


def chunk_discounting(
    step_rewards: torch.Tensor, alive: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-step discounting folded into chunks.

    Args:
        step_rewards: [T, N, h] rewards of each executed env step (0 where not alive).
        alive: [T, N, h] bool, the step belongs to the episode the chunk started in.
        gamma, lam: discount and GAE lambda per env step.

    Returns:
        reward [T, N]: sum_j gamma^j r_j over the chunk's steps of its episode;
        discount [T, N]: gamma^n, n the number of those steps (what the next state's
        value is discounted by); lam [T, N]: lam^n.
    """
    h = step_rewards.shape[-1]
    powers = gamma ** torch.arange(h, dtype=step_rewards.dtype, device=step_rewards.device)
    live = alive.to(step_rewards.dtype)
    n = live.sum(dim=-1)
    reward = (step_rewards * live * powers).sum(dim=-1)
    return reward, torch.pow(gamma, n), torch.pow(lam, n)


def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    next_values: torch.Tensor,
    terminated: torch.Tensor,
    done: torch.Tensor,
    gamma: float | torch.Tensor,
    lam: float | torch.Tensor,
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
        gamma, lam: discount and GAE's lambda per chunk, floats or [T, N] (from
            :func:`chunk_discounting`).

    Returns:
        advantages [T, N] and returns (advantages + values) [T, N].
    """
    gamma = torch.as_tensor(gamma, dtype=rewards.dtype, device=rewards.device).expand_as(rewards)
    lam = torch.as_tensor(lam, dtype=rewards.dtype, device=rewards.device).expand_as(rewards)
    not_terminal = 1.0 - terminated.float()
    continues = 1.0 - done.float()
    deltas = rewards + gamma * next_values * not_terminal - values
    advantages = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[0])
    for t in reversed(range(rewards.shape[0])):
        running = deltas[t] + gamma[t] * lam[t] * continues[t] * running
        advantages[t] = running
    return advantages, advantages + values


def explained_variance(values: torch.Tensor, returns: torch.Tensor) -> float:
    """1 - Var(returns - values) / Var(returns): 1 for a perfect critic, 0 for one that
    predicts the mean, negative for worse (NaN where the returns do not vary)."""
    var = returns.var()
    return float("nan") if var == 0 else float(1.0 - (returns - values).var() / var)


def _reduce(loss: torch.Tensor, reduction: str) -> torch.Tensor:
    """'mean' over all entries, or 'sum' over the batch (first) dim of each item's mean
    over the others: a share of a larger batch's mean, to be divided by its size."""
    if reduction == "mean":
        return loss.mean()
    if reduction == "sum":
        return loss.flatten(1).mean(dim=1).sum() if loss.dim() > 1 else loss.sum()
    raise ValueError(f"reduction '{reduction}': use 'mean' or 'sum'")


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
