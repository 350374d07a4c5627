"""The environment section (``env:``): the batched simulation environments."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from omni_rl.config import require


@dataclass
class SimEnvConfig:
    """The batched simulation environments."""

    task: str = "PushCube-v1"
    """ManiSkill task id (PushCube-v1, PickCube-v1, ...) or PointMass-v0 (pure torch)."""
    num_envs: int = 8
    """Environments stepped in parallel."""
    backend: Literal["auto", "cpu", "gpu"] = "auto"
    """cpu: one env per process; gpu: ManiSkill's batched GPU simulation; auto: gpu when CUDA is there."""
    obs_mode: Literal["state", "rgb"] = "state"
    """state: ManiSkill's state vector; rgb (ManiSkill tasks, for pi0 policies): the camera's
    image, the task's instruction and the joint positions, with the state vector as
    privileged input for the experts and a privileged critic."""
    image_size: int | None = None
    """obs_mode rgb: the camera image's side in pixels (unset: 64)."""
    control_mode: str = "pd_ee_delta_pos"
    """Controller the actions drive (a ManiSkill task's; PointMass-v0 and PixelTargets-v0
    have this one only)."""
    reward_mode: Literal["normalized_dense", "dense", "sparse"] = "normalized_dense"
    """ManiSkill's reward: dense shaping scaled to at most 1 per step, unscaled, or 1 on success."""
    max_episode_steps: int = 50
    """Episode length; one training iteration runs one episode's worth of steps per env."""
    blank_images: bool = False
    """PixelTargets-v0: every camera image blank (a control: what a policy learns without
    seeing where the targets are)."""
    ignore_terminations: bool = True
    """Run episodes to the time limit even after success (judged by success_once): with a
    dense reward, ending the episode on success would pay less than hovering near it."""

    def __post_init__(self):
        require(self.num_envs >= 1, "num_envs", "must be >= 1")
        require(self.max_episode_steps >= 1, "max_episode_steps", "must be >= 1")
        require(not self.blank_images or self.task == "PixelTargets-v0", "blank_images", "PixelTargets-v0 only")
        require(self.image_size is None or self.obs_mode == "rgb", "image_size", "sizes the camera of obs_mode rgb")
        require(self.image_size is None or self.image_size >= 8, "image_size", "must be >= 8")

    def controls(self) -> dict:
        """What the policy is shown instead (``make_vec_env``'s control options)."""
        return {"blank_images": True} if self.blank_images else {}

    def options(self) -> dict:
        """The env's options beyond its task, count and backend, as ``make_vec_env`` reads them."""
        modes = {"obs_mode": self.obs_mode, "control_mode": self.control_mode, "reward_mode": self.reward_mode}
        camera = {"image_size": self.image_size} if self.image_size is not None else {}
        return {**modes, **camera, **self.controls()}
