"""A batched point-mass reaching task in pure torch, for fast algorithm tests.

Each env holds a point and a goal in the square [-1, 1]^2. An action in [-1, 1]^2 moves
the point by ``speed`` times the action. The reward is the distance gained towards the
goal, plus 1 on reaching it (within ``radius``), which ends the episode (unless
``ignore_terminations``: then every step inside the radius earns the 1); episodes are
truncated after ``max_episode_steps``. Observation: point, goal, goal - point.
"""

from __future__ import annotations

import torch

from omni_rl.sim.base import EpisodeTracker, StepResult


class PointMassEnv:
    """N point-mass envs stepped together (see ``omni_rl.sim.base.VecEnv``)."""

    obs_dim = 6
    action_dim = 2
    backend = "torch"

    def __init__(
        self,
        num_envs: int,
        seed: int = 0,
        device: str | torch.device = "cpu",
        max_episode_steps: int = 50,
        speed: float = 0.15,
        radius: float = 0.2,
        ignore_terminations: bool = False,
    ):
        self.num_envs = num_envs
        self.device = torch.device(device)
        self.max_episode_steps = max_episode_steps
        self.speed, self.radius = speed, radius
        self.ignore_terminations = ignore_terminations
        self.action_low = -torch.ones(self.action_dim, device=self.device)
        self.action_high = torch.ones(self.action_dim, device=self.device)
        self._seed_generators(seed)
        self.point = torch.zeros(num_envs, 2, device=self.device)
        self.goal = torch.zeros(num_envs, 2, device=self.device)
        self.steps = torch.zeros(num_envs, dtype=torch.long, device=self.device)
        self.tracker = EpisodeTracker(num_envs, self.device)

    def _seed_generators(self, seed: int | list[int]) -> None:
        seeds = seed if isinstance(seed, list) else [seed + i for i in range(self.num_envs)]
        if len(seeds) != self.num_envs:
            raise ValueError(f"PointMass-v0: {len(seeds)} seeds for {self.num_envs} envs")
        self.generators = [torch.Generator().manual_seed(int(s)) for s in seeds]

    def _draw(self, envs: list[int]) -> None:
        """New start points and goals for ``envs``, from each env's own generator."""
        for i in envs:
            start_goal = torch.rand(2, 2, generator=self.generators[i]) * 2 - 1
            self.point[i], self.goal[i] = start_goal.to(self.device)
            self.steps[i] = 0

    def _obs(self) -> torch.Tensor:
        return torch.cat([self.point, self.goal, self.goal - self.point], dim=1)

    def reset(self, seed: int | list[int] | None = None) -> torch.Tensor:
        """Start every env anew; a seed (or one seed per env) makes the draws reproducible."""
        if seed is not None:
            self._seed_generators(seed)
        self._draw(list(range(self.num_envs)))
        self.tracker = EpisodeTracker(self.num_envs, self.device)
        return self._obs()

    def step(self, actions: torch.Tensor) -> StepResult:
        actions = actions.to(self.device).clamp(self.action_low, self.action_high)
        before = (self.goal - self.point).norm(dim=1)
        self.point = (self.point + self.speed * actions).clamp(-1.0, 1.0)
        after = (self.goal - self.point).norm(dim=1)
        success = after < self.radius
        reward = (before - after) + success.float()
        self.steps += 1
        terminated = success & (not self.ignore_terminations)
        truncated = ~terminated & (self.steps >= self.max_episode_steps)
        done = terminated | truncated
        final_obs = self._obs()
        ended = self.tracker.update(reward, success, done)
        if done.any():
            self._draw(torch.nonzero(done).flatten().tolist())
        return StepResult(self._obs(), reward, terminated, truncated, final_obs, success, ended)

    def close(self) -> None:
        """Nothing to release."""


def expert_action(obs: torch.Tensor, speed: float = 0.15) -> torch.Tensor:
    """The scripted expert: head straight for the goal ([N, 6] -> [N, 2])."""
    return (obs[:, 4:6] / speed).clamp(-1.0, 1.0)
