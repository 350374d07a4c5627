"""The worker side of the ManiSkill CPU backend.

Importing this module selects the Vulkan driver and then imports ManiSkill, in that
order. The CPU backend's forkserver preloads it, so each worker process is forked with
ManiSkill already imported instead of importing it itself (about 3 s of CPU per worker).
"""

from __future__ import annotations

from omni_rl.sim.vulkan import ensure_vulkan

ensure_vulkan()

import mani_skill.envs  # noqa: E402, F401  (registers the tasks)
from mani_skill.utils.wrappers.gymnasium import CPUGymWrapper  # noqa: E402

from omni_rl.runtime import set_threads  # noqa: E402
from omni_rl.sim.maniskill_task import TaskSettings  # noqa: E402


def make_cpu_env(settings: TaskSettings) -> CPUGymWrapper:
    """One ManiSkill env on PhysX's CPU solver, as a plain (unbatched, NumPy) gymnasium env."""
    return CPUGymWrapper(settings.make("physx_cpu", num_envs=1), ignore_terminations=settings.ignore_terminations)


def worker_cpu_env(settings: TaskSettings) -> CPUGymWrapper:
    """:func:`make_cpu_env` in a worker process, on one torch thread: the workers together
    already occupy every core."""
    set_threads(1)
    return make_cpu_env(settings)
