"""What builds one ManiSkill task, shared by the backends (``omni_rl.sim.maniskill``) and
the CPU backend's workers (``omni_rl.sim.maniskill_worker``): the backends start the
workers, so the workers do not import the backends back.

With a camera (``obs_mode="rgb"``) the task's observations are flat vectors laid out as
``omni_rl.observations.FlatLayout`` reads them: the task camera's image [3, S, S] (values
0-255), the index of the task's instruction (one per task, ``INSTRUCTIONS``), the
robot's joint positions (what the actor sees beside the image), then ManiSkill's whole
state vector (privileged: goal and object poses, for the scripted experts and a
privileged critic; ManiSkill's own RGB mode leaves them out). ManiSkill simulates in
state mode and the camera renders only when asked (``CameraObservation.look``), at a
reset and at an episode's end: a rollout renders at chunk starts, not at every step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import gymnasium as gym
import torch

from omni_rl.errors import OmniRLError

OBS_MODES = ("state", "rgb")
DEFAULT_IMAGE_SIZE = 64
# what the policy is told to do; ManiSkill's tasks carry no instruction of their own
INSTRUCTIONS = {
    "PushCube-v1": "push the cube to the goal",
    "PickCube-v1": "pick up the cube and move it to the goal",
}


@dataclass(frozen=True)
class TaskSettings:
    """What ``gym.make`` needs to build one ManiSkill task (picklable, for the workers).

    Attributes:
        task: ManiSkill env id, e.g. ``PickCube-v1``.
        obs_mode: ``state`` (ManiSkill's flat state vector) or ``rgb`` (the camera's image,
            the instruction, the joint positions and the state vector, see the module).
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
    image_size: int = DEFAULT_IMAGE_SIZE
    """``rgb``: the camera image's side in pixels."""

    def make_kwargs(self, sim_backend: str, num_envs: int) -> dict[str, Any]:
        """Keyword arguments of ``gym.make(task, ...)`` for a PhysX backend."""
        camera = {"sensor_configs": {"width": self.image_size, "height": self.image_size}}
        return {
            "num_envs": num_envs,
            "obs_mode": "state",  # an rgb task renders its camera itself, when asked
            **(camera if self.obs_mode == "rgb" else {}),
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

    def make(self, sim_backend: str, num_envs: int) -> gym.Env:
        """The task's batched ManiSkill env (torch tensors), behind a
        :class:`CameraObservation` in ``rgb`` mode."""
        env = gym.make(self.task, **self.make_kwargs(sim_backend, num_envs))
        return CameraObservation(env, self) if self.obs_mode == "rgb" else env


class CameraObservation(gym.Wrapper):
    """A batched ManiSkill env whose observations are the flat camera layout (module
    docstring). The image is rendered at every reset, at a step where some env's
    episode ends (its last observation, which ``final_obs`` carries) and at a step
    taken with ``look`` set; the other steps carry zeros in its place, for observations
    nobody reads (the steps inside an action chunk). ``look`` is on until told off."""

    def __init__(self, env: gym.Env, settings: TaskSettings):
        super().__init__(env)
        base = env.unwrapped
        cameras = list(base.scene.sensors)
        if not cameras:
            raise OmniRLError(f"{settings.task}: obs_mode rgb needs a camera; the task has none")
        self.camera = cameras[0]
        self.image_size = settings.image_size
        self.ignore_terminations = settings.ignore_terminations
        self.look = True
        self.renders = 0  # images rendered (each render covers every env of the batch)
        self.state_dim = int(base.agent.robot.get_qpos().shape[-1])
        self.privileged_dim = int(base.single_observation_space.shape[0])
        size = 3 * self.image_size**2 + 1 + self.state_dim + self.privileged_dim
        # ManiSkill's way to give a wrapped observation its space: the batch, resized
        base.update_obs_space(torch.zeros(base.num_envs, size))

    def observe(self, state: torch.Tensor, render: bool) -> torch.Tensor:
        """[N, 3·S·S + 1 + dof + P] from the state vectors [N, P]."""
        base = self.env.unwrapped
        n, pixels = state.shape[0], 3 * self.image_size**2
        if render:
            self.renders += 1
            image = base.get_sensor_images()[self.camera]["rgb"]  # [N, S, S, 3] uint8
            flat = image.permute(0, 3, 1, 2).reshape(n, pixels).to(state.device, torch.float32)
        else:
            flat = torch.zeros(n, pixels, device=state.device)
        qpos = base.agent.robot.get_qpos().to(state.device, torch.float32).reshape(n, self.state_dim)
        return torch.cat([flat, torch.zeros(n, 1, device=state.device), qpos, state.float()], dim=1)

    def reset(self, **kwargs):
        obs, info = self.env.reset(**kwargs)
        return self.observe(obs, render=True), info

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        ends = truncated if self.ignore_terminations else terminated | truncated
        render = self.look or bool(torch.as_tensor(ends).any())
        return self.observe(obs, render), reward, terminated, truncated, info
