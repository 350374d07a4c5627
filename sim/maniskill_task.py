"""What builds one ManiSkill task, shared by the backends (``omni_rl.sim.maniskill``) and
the CPU backend's workers (``omni_rl.sim.maniskill_worker``): the backends start the
workers, so the workers do not import the backends back."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class TaskSettings:
    """What ``gym.make`` needs to build one ManiSkill task (picklable, for the workers).

    Attributes:
        task: ManiSkill env id, e.g. ``PickCube-v1``.
        obs_mode: ManiSkill observation mode (``state``: a flat vector).
        control_mode: the robot controller, e.g. ``pd_ee_delta_pos``.
        max_episode_steps: env steps before an episode is truncated.
        ignore_terminations: run every episode to its time limit, success or not (the
            task is judged by success_once; a dense reward then favours staying solved
            rather than ending the episode).
        reward_mode: ManiSkill's ``normalized_dense`` (at most 1 per step), ``dense`` or
            ``sparse`` (1 on success).
    """

    task: str
    obs_mode: str
    control_mode: str
    max_episode_steps: int
    ignore_terminations: bool = False
    reward_mode: str = "normalized_dense"

    def make_kwargs(self, sim_backend: str, num_envs: int) -> dict[str, Any]:
        """Keyword arguments of ``gym.make(task, ...)`` for a PhysX backend."""
        return {
            "num_envs": num_envs,
            "obs_mode": self.obs_mode,
            "control_mode": self.control_mode,
            "reward_mode": self.reward_mode,
            "sim_backend": sim_backend,
            # state observations render nothing; naming the device spares a warning
            # about falling back from CUDA rendering on CPU-only machines
            "render_backend": "gpu" if torch.cuda.is_available() else "cpu",
            "max_episode_steps": self.max_episode_steps,
            # seed each later (unseeded) episode from the env's seeded main RNG too; without
            # this ManiSkill draws them from the process's global torch RNG
            "enhanced_determinism": True,
        }
