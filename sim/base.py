"""The contract every batched environment of ``omni_rl.sim`` follows.

Observations, actions, rewards and flags are torch tensors with the env index first.
Environments reset themselves: when an episode ends, ``step`` returns the first
observation of the next episode in ``obs`` and the last one of the ended episode in
``final_obs`` (to bootstrap the value of a truncated episode), and reports the
episode's statistics once in ``episodes``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch


@dataclass(frozen=True)
class EpisodeStats:
    """One finished episode.

    Attributes:
        env: index of the env it ran in.
        success_once: whether the task was solved at any step of the episode.
        ret: sum of its rewards.
        length: env steps it lasted.
    """

    env: int
    success_once: bool
    ret: float
    length: int


@dataclass
class StepResult:
    """What one batched step returns.

    Attributes:
        obs: [N, obs_dim] float32, the observation to act on next (a new episode's
            first one where an episode just ended).
        reward: [N] float32.
        terminated: [N] bool, the episode ended in a terminal state (success or failure).
        truncated: [N] bool, the episode hit its time limit.
        final_obs: [N, obs_dim], the ended episodes' last observations (equal to
            ``obs`` where no episode ended).
        success: [N] bool, the task is solved at this step.
        episodes: statistics of the episodes that ended at this step.
    """

    obs: torch.Tensor
    reward: torch.Tensor
    terminated: torch.Tensor
    truncated: torch.Tensor
    final_obs: torch.Tensor
    success: torch.Tensor
    episodes: list[EpisodeStats] = field(default_factory=list)

    @property
    def done(self) -> torch.Tensor:
        """[N] bool, the episode ended (terminated or truncated)."""
        return self.terminated | self.truncated


class VecEnv(Protocol):
    """N environments stepped together."""

    num_envs: int
    obs_dim: int
    action_dim: int
    action_low: torch.Tensor  # [action_dim]
    action_high: torch.Tensor  # [action_dim]
    max_episode_steps: int
    device: torch.device

    def reset(self, seed: int | list[int] | None = None) -> torch.Tensor:
        """Start a new episode in every env; returns obs [N, obs_dim]. A seed makes the
        initial states reproducible (env i is seeded ``seed + i``); a list gives each
        env its own seed (equal seeds, equal initial states: groups for GRPO)."""
        ...

    def step(self, actions: torch.Tensor) -> StepResult:
        """Apply actions [N, action_dim] (clipped to the action bounds)."""
        ...

    def close(self) -> None:
        """Release worker processes and simulator resources."""
        ...


class EpisodeTracker:
    """Running return, length and success-once of N envs; ``update`` returns the
    statistics of the episodes that ended."""

    def __init__(self, num_envs: int):
        self.ret = torch.zeros(num_envs)
        self.length = torch.zeros(num_envs, dtype=torch.long)
        self.success = torch.zeros(num_envs, dtype=torch.bool)

    def update(self, reward: torch.Tensor, success: torch.Tensor, done: torch.Tensor) -> list[EpisodeStats]:
        self.ret += reward.detach().float().cpu()
        self.length += 1
        self.success |= success.detach().bool().cpu()
        ended = [
            EpisodeStats(int(i), bool(self.success[i]), float(self.ret[i]), int(self.length[i]))
            for i in torch.nonzero(done.cpu(), as_tuple=False).flatten().tolist()
        ]
        finished = done.detach().bool().cpu()
        self.ret[finished] = 0.0
        self.length[finished] = 0
        self.success[finished] = False
        return ended
