"""Filters and shaping between rollout and update: dynamic sampling, overlong handling."""

from __future__ import annotations

import torch

from omni_rl.algorithms.advantages import EQUAL_REWARDS_TOL, equal_groups


def informative_groups(rewards: torch.Tensor, group_size: int, tol: float = EQUAL_REWARDS_TOL) -> torch.Tensor:
    """DAPO's dynamic sampling: groups whose rewards are not all equal (only those give
    a non-zero group-relative advantage). rewards: [B*G] -> bool [B]."""
    return ~equal_groups(rewards.float().view(-1, group_size), tol).squeeze(1)


def overlong_penalty(lengths: torch.Tensor, max_length: int, buffer: int, factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment added to the reward. lengths: [N] -> [N].

    0 up to ``max_length - buffer`` tokens, then falling linearly to ``-factor`` at
    ``max_length``, and ``-factor`` beyond.
    """
    if buffer <= 0 or buffer > max_length:
        raise ValueError("buffer must be in (0, max_length]")
    start = max_length - buffer
    excess = (lengths.float() - start).clamp(min=0)
    return -factor * (excess / buffer).clamp(max=1.0)


def mask_truncated(mask: torch.Tensor, truncated: torch.Tensor) -> torch.Tensor:
    """Overlong filtering: drop every token of completions cut off at the length limit
    from the loss. mask: [N, L]; truncated: bool [N] -> [N, L]."""
    return mask * (~truncated.bool())[:, None].to(mask.dtype)
