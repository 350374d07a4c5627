"""Simulation environments for robot-policy RL (imported as ``omni_rl.sim``).

:func:`make_vec_env` builds any of them behind the :class:`~omni_rl.sim.base.VecEnv`
contract. Simulators import lazily: importing this package loads neither ManiSkill nor
SAPIEN.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from omni_rl.sim.base import VecEnv

POINT_MASS = "PointMass-v0"
PIXEL_TARGETS = "PixelTargets-v0"


def make_vec_env(
    task: str,
    num_envs: int,
    backend: str = "auto",
    seed: int = 0,
    max_episode_steps: int | None = None,
    ignore_terminations: bool = False,
    **maniskill_options,
) -> VecEnv:
    """N envs of ``task`` stepped together.

    Args:
        task: ``PointMass-v0`` (a small batched torch env for fast algorithm tests),
            ``PixelTargets-v0`` (the same with a camera image and an instruction, for VLA
            policies) or a ManiSkill env id such as ``PushCube-v1`` or ``PickCube-v1``.
        num_envs: N.
        backend: ``auto``, ``cpu`` or ``gpu``: where the envs run (``auto``: on CUDA when
            available).
        seed: env i's first episode is seeded ``seed + i``.
        max_episode_steps: time limit; default: the task's own.
        ignore_terminations: end episodes only at the time limit, also after success.
        **maniskill_options: ``obs_mode``, ``control_mode``, ``reward_mode`` and (rgb)
            ``image_size`` of a ManiSkill task (see :func:`omni_rl.sim.maniskill.make_maniskill_env`);
            PixelTargets-v0's controls ``blank_images`` and ``swap_instructions``
            (``PixelTargetsEnv``).
    """
    if task in (POINT_MASS, PIXEL_TARGETS):
        return _point_mass(task, num_envs, backend, seed, max_episode_steps, ignore_terminations, maniskill_options)
    from omni_rl.sim.maniskill import make_maniskill_env

    return make_maniskill_env(
        task,
        num_envs,
        backend=backend,
        seed=seed,
        max_episode_steps=max_episode_steps,
        ignore_terminations=ignore_terminations,
        **maniskill_options,
    )


def _point_mass(
    task: str,
    num_envs: int,
    backend: str,
    seed: int,
    max_episode_steps: int | None,
    ignore_terminations: bool,
    options: dict,
) -> VecEnv:
    from omni_rl.errors import OmniRLError
    from omni_rl.runtime import resolve_device
    from omni_rl.sim.pixel_targets import PixelTargetsEnv
    from omni_rl.sim.point_mass import PointMassEnv

    # the flow recipe passes a ManiSkill env section through unchanged; PointMass has no
    # observation or control modes to choose, and one reward: each must be the default
    controls = {"blank_images", "swap_instructions"} if task == PIXEL_TARGETS else set()
    unknown = sorted(set(options) - {"obs_mode", "control_mode", "reward_mode"} - controls)
    if unknown:
        raise OmniRLError(f"{task}: unexpected options {', '.join(unknown)}")
    if options.get("obs_mode", "state") != "state":
        shown = "the image, instruction and state it always shows" if task == PIXEL_TARGETS else "its state"
        raise OmniRLError(f"{task}: has one observation mode ({shown}); leave env.obs_mode unset")
    if options.get("control_mode", "pd_ee_delta_pos") != "pd_ee_delta_pos":
        raise OmniRLError(
            f"{task}: has one control (an action moves the point by a bounded step, as pd_ee_delta_pos moves an "
            "end effector); leave env.control_mode unset"
        )
    if options.get("reward_mode", "normalized_dense") != "normalized_dense":
        raise OmniRLError(f"{task}: has one reward (distance gained, 1 on reaching); leave env.reward_mode unset")
    device = resolve_device({"gpu": "cuda"}.get(backend, backend))
    steps = {} if max_episode_steps is None else {"max_episode_steps": max_episode_steps}
    env = PixelTargetsEnv if task == PIXEL_TARGETS else PointMassEnv
    shown = {k: v for k, v in options.items() if k in controls}
    return env(num_envs, seed=seed, device=device, ignore_terminations=ignore_terminations, **steps, **shown)
