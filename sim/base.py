"""The contract every batched environment of ``omni_rl.sim`` follows.

Observations, actions, rewards and flags are torch tensors with the env index first.
Environments reset themselves: when an episode ends, ``step`` returns the first
observation of the next episode in ``obs`` and the last one of the ended episode in
``final_obs`` (to bootstrap the value of a truncated episode), and reports the
episode's statistics once in ``episodes``.
"""

from __future__ import annotations

from dataclasses import dataclass
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
class EndedEpisodes:
    """Statistics of the episodes that ended at one step, as tensors on the env's device
    (reading them needs no host copy until :meth:`stats` is called).

    Attributes:
        done: [N] bool, the env's episode ended at this step.
        success_once: [N] bool, it was solved at some step (meaningful where ``done``).
        ret: [N] float32, the sum of its rewards.
        length: [N] long, env steps it lasted.
    """

    done: torch.Tensor
    success_once: torch.Tensor
    ret: torch.Tensor
    length: torch.Tensor

    def stats(self) -> list[EpisodeStats]:
        """The ended episodes as a list (one host copy)."""
        done, success, ret, length = (x.cpu() for x in (self.done, self.success_once, self.ret, self.length))
        return [
            EpisodeStats(int(i), bool(success[i]), float(ret[i]), int(length[i]))
            for i in torch.nonzero(done).flatten().tolist()
        ]


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
        ended: statistics of the episodes that ended at this step, on the env's device.
    """

    obs: torch.Tensor
    reward: torch.Tensor
    terminated: torch.Tensor
    truncated: torch.Tensor
    final_obs: torch.Tensor
    success: torch.Tensor
    ended: EndedEpisodes | None = None

    @property
    def done(self) -> torch.Tensor:
        """[N] bool, the episode ended (terminated or truncated)."""
        return self.terminated | self.truncated

    @property
    def episodes(self) -> list[EpisodeStats]:
        """The episodes that ended at this step (a host copy: for scripts and tests; the
        training loop reads ``ended``)."""
        return [] if self.ended is None else self.ended.stats()


class VecEnv(Protocol):
    """N environments stepped together."""

    num_envs: int
    obs_dim: int
    action_dim: int
    action_low: torch.Tensor  # [action_dim]
    action_high: torch.Tensor  # [action_dim]
    max_episode_steps: int
    device: torch.device
    backend: str  # what steps the envs: ManiSkill's "cpu" or "gpu", or "torch"

    def reset(self, seed: int | list[int] | None = None) -> torch.Tensor:
        """Start a new episode in every env; returns obs [N, obs_dim]. A seed makes the
        initial states reproducible (env i is seeded ``seed + i``); a list gives each
        env its own seed, and env i's initial state depends on ``seed[i]`` alone (equal
        seeds, equal initial states: groups for GRPO)."""
        ...

    def step(self, actions: torch.Tensor) -> StepResult:
        """Apply actions [N, action_dim] (clipped to the action bounds)."""
        ...

    def close(self) -> None:
        """Release worker processes and simulator resources."""
        ...


class EpisodeTracker:
    """Running return, length and success-once of N envs on ``device``; ``update``
    returns the statistics of the episodes that ended, without leaving the device."""

    def __init__(self, num_envs: int, device: torch.device | str = "cpu"):
        self.ret = torch.zeros(num_envs, device=device)
        self.length = torch.zeros(num_envs, dtype=torch.long, device=device)
        self.success = torch.zeros(num_envs, dtype=torch.bool, device=device)

    def update(self, reward: torch.Tensor, success: torch.Tensor, done: torch.Tensor) -> EndedEpisodes:
        device = self.ret.device
        self.ret += reward.detach().float().to(device)
        self.length += 1
        self.success |= success.detach().bool().to(device)
        finished = done.detach().bool().to(device)
        ended = EndedEpisodes(finished, self.success.clone(), self.ret.clone(), self.length.clone())
        self.ret.masked_fill_(finished, 0.0)
        self.length.masked_fill_(finished, 0)
        self.success.masked_fill_(finished, False)
        return ended
