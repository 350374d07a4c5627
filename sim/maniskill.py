"""ManiSkill 3 tasks as batched envs that follow :class:`omni_rl.sim.base.VecEnv`.

Two backends:

- ``cpu``: gymnasium's ``AsyncVectorEnv`` over ManiSkill's ``CPUGymWrapper``, one env per
  worker process on PhysX's CPU solver (ManiSkill's CPU backend holds one env per
  process). Workers start from a clean interpreter (``forkserver``), select the Vulkan
  driver before importing ManiSkill and run torch on one thread. Tensors cross the
  process boundary as NumPy arrays.
- ``gpu``: ManiSkill's batched PhysX on CUDA (``physx_cuda``) behind its
  ``ManiSkillVectorEnv``; observations, rewards and flags stay on the GPU.

Seeding. A seeded reset of ManiSkill's batched scene seeds torch with the *first* seed
of the list and draws every env's initial state from that one stream, so env i's start
does not follow its own seed: a group of envs given one seed would not share a start
state, and a held-out seed would not name the same episode as on the CPU backend,
where each env is a scene of its own. The GPU backend therefore resets env by env
(:func:`seeded_resets`), each env alone with its own seed first in the list: its start
then depends on that seed alone, and equal seeds give equal starts. The cost is one
partial reset per env per seeded reset (one per training iteration and evaluation
round; ``time/reset`` in the metrics). The CUDA and CPU random streams differ, so a
seed's start on the GPU is not the CPU's start of that seed: compare held-out success
within one backend.

Observations are flat: ManiSkill's state vector (``obs_mode="state"``), or with
``obs_mode="rgb"`` the camera's image, the task's instruction, the joint positions and
the state vector in the layout a pi0 policy reads (``layout``; see
``omni_rl.sim.maniskill_task``). An rgb env renders at resets, at episode ends and at
steps taken with ``look=True`` (the default); a rollout passes ``look=False`` inside a
chunk, whose observations nobody reads, and so renders once a chunk. Nothing is
downloaded at run time: a task whose assets are missing is an error.
"""

from __future__ import annotations

import abc
import difflib
import functools
import logging
import multiprocessing

import numpy as np
import torch

from omni_rl.errors import OmniRLError
from omni_rl.sim.base import EpisodeTracker, StepResult
from omni_rl.sim.maniskill_task import DEFAULT_IMAGE_SIZE, INSTRUCTIONS, OBS_MODES, TaskSettings
from omni_rl.sim.vulkan import ensure_vulkan

log = logging.getLogger(__name__)

BACKENDS = ("auto", "cpu", "gpu")
REWARD_MODES = ("normalized_dense", "dense", "sparse")
# Workers must not inherit the parent's torch thread pool or a SAPIEN/Vulkan instance,
# which ``fork`` would copy; forkserver starts them from a clean interpreter.
WORKER_CONTEXT = "forkserver"
WORKER_MODULE = "omni_rl.sim.maniskill_worker"


def make_maniskill_env(
    task: str,
    num_envs: int,
    backend: str = "auto",
    obs_mode: str = "state",
    control_mode: str = "pd_ee_delta_pos",
    seed: int = 0,
    max_episode_steps: int | None = None,
    ignore_terminations: bool = False,
    reward_mode: str = "normalized_dense",
    image_size: int | None = None,
) -> ManiSkillCPUEnv | ManiSkillGPUEnv:
    """N copies of a ManiSkill task stepped together.

    Args:
        task: ManiSkill env id, e.g. ``PushCube-v1`` or ``PickCube-v1``.
        num_envs: N, the number of parallel envs.
        backend: ``cpu`` (one process per env), ``gpu`` (batched CUDA PhysX) or ``auto``
            (``gpu`` when CUDA is available).
        obs_mode: ``state`` (ManiSkill's flat state vector) or ``rgb`` (the camera's
            image, the instruction and the joint positions before it; see the module).
        control_mode: ManiSkill controller, e.g. ``pd_ee_delta_pos`` (xyz delta + gripper).
        seed: env i's first episode is seeded ``seed + i`` unless ``reset`` gets a seed.
        max_episode_steps: time limit; default: the task's registered one.
        ignore_terminations: episodes end only at the time limit.
        reward_mode: ``normalized_dense``, ``dense`` or ``sparse``.
        image_size: ``rgb``: the camera image's side (default 64).

    Returns:
        A :class:`~omni_rl.sim.base.VecEnv`; call ``reset`` before ``step``.
    """
    if num_envs < 1:
        raise OmniRLError(f"{task}: num_envs must be at least 1, got {num_envs}")
    if obs_mode not in OBS_MODES:
        raise OmniRLError(f"{task}: obs_mode '{obs_mode}' is not supported; supported: {', '.join(OBS_MODES)}")
    if obs_mode == "rgb" and task not in INSTRUCTIONS:
        known = ", ".join(INSTRUCTIONS)
        raise OmniRLError(f"{task}: obs_mode rgb needs the task's instruction; tasks with one: {known}")
    if image_size is not None and obs_mode != "rgb":
        raise OmniRLError(f"{task}: image_size sizes the camera of obs_mode rgb; obs_mode is {obs_mode}")
    if image_size is not None and image_size < 8:
        raise OmniRLError(f"{task}: image_size must be at least 8, got {image_size}")
    if reward_mode not in REWARD_MODES:
        raise OmniRLError(f"{task}: reward_mode '{reward_mode}' is not supported; supported: {', '.join(REWARD_MODES)}")
    backend = resolve_backend(backend)
    spec = _task_spec(task)
    steps = max_episode_steps or spec.max_episode_steps
    if steps is None:
        raise OmniRLError(f"{task}: the task registers no episode limit; pass max_episode_steps")
    settings = TaskSettings(
        task, obs_mode, control_mode, int(steps), ignore_terminations, reward_mode, image_size or DEFAULT_IMAGE_SIZE
    )
    try:
        if backend == "gpu":
            return ManiSkillGPUEnv(settings, num_envs, seed)
        return ManiSkillCPUEnv(settings, num_envs, seed)
    except RuntimeError as err:
        if "vk::" not in str(err) and "vulkan" not in str(err).lower():
            raise
        raise OmniRLError(
            f"{task}: SAPIEN found no usable Vulkan device ({err}); on a machine without a GPU driver "
            "run tools/setup_vulkan.sh (part of 'make setup')"
        ) from err


def resolve_backend(backend: str) -> str:
    """``auto`` -> ``gpu`` when CUDA is available, else ``cpu`` (said in the log: the
    two backends step different simulators); ``gpu`` needs CUDA."""
    if backend not in BACKENDS:
        raise OmniRLError(f"unknown sim backend '{backend}'; known: {', '.join(BACKENDS)}")
    if backend == "auto":
        chosen = "gpu" if torch.cuda.is_available() else "cpu"
        reason = "CUDA is available" if chosen == "gpu" else "no CUDA device"
        log.warning("env.backend auto: ManiSkill's %s backend (%s); set env.backend to choose", chosen, reason)
        return chosen
    if backend == "gpu" and not torch.cuda.is_available():
        raise OmniRLError("sim backend 'gpu' requested but no CUDA device is available; use 'cpu'")
    return backend


def _task_spec(task: str):
    """ManiSkill's registration of ``task``, after checking that its assets are on disk."""
    ensure_vulkan()
    import mani_skill.envs  # noqa: F401  (registers the tasks)
    from mani_skill.utils import assets
    from mani_skill.utils.registration import REGISTERED_ENVS

    if task not in REGISTERED_ENVS:
        close = difflib.get_close_matches(task, REGISTERED_ENVS, n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise OmniRLError(f"unknown ManiSkill task '{task}'{hint}")
    spec = REGISTERED_ENVS[task]
    missing = []
    for asset_id in spec.asset_download_ids or []:
        grouped = asset_id in assets.DATA_GROUPS
        ids = assets.expand_data_group_into_individual_data_source_ids(asset_id) if grouped else [asset_id]
        missing += [i for i in ids if not assets.is_data_source_downloaded(i)]
    if missing:
        # ManiSkill would stop and ask on stdin; omni_rl downloads nothing at run time
        raise OmniRLError(
            f"{task}: ManiSkill assets missing: {', '.join(missing)}; fetch them where a network is "
            f"available (python -m mani_skill.utils.download_asset {task})"
        )
    return spec


class _ManiSkillVecEnv(abc.ABC):
    """What both backends share: bounds, seeding of the first reset, clipping, episode
    statistics. Subclasses implement ``_reset(seed)`` and ``_step(actions)``."""

    def __init__(self, settings: TaskSettings, num_envs: int, seed: int, device: torch.device, obs_space, act_space):
        if len(obs_space.shape) != 1:
            raise OmniRLError(f"{settings.task}: expected flat observations, got shape {obs_space.shape}")
        self.task = settings.task
        self.num_envs = num_envs
        self.obs_dim = int(obs_space.shape[0])
        self.action_dim = int(act_space.shape[0])
        self.action_low = torch.as_tensor(act_space.low, dtype=torch.float32, device=device)
        self.action_high = torch.as_tensor(act_space.high, dtype=torch.float32, device=device)
        self.max_episode_steps = settings.max_episode_steps
        self.device = device
        self.backend = "gpu" if device.type == "cuda" else "cpu"
        # ManiSkill seeds every env 2022 at creation; the first reset uses ``seed`` instead
        # so that the envs differ and a run is reproducible without an explicit seed.
        self._first_seed: int | None = seed
        self._tracker: EpisodeTracker | None = None
        self.layout = None  # an rgb env's FlatLayout
        self.renders_on_request = settings.obs_mode == "rgb"
        if self.renders_on_request:
            from omni_rl.observations import FlatLayout

            parts = self._camera_parts()  # (joint positions, state vector)
            instructions = (INSTRUCTIONS[settings.task],)
            self.layout = FlatLayout(settings.image_size, instructions, state_dim=parts[0], privileged_dim=parts[1])
            if self.layout.size != self.obs_dim:
                raise AssertionError(f"{self.task}: the camera layout {self.layout} is not {self.obs_dim} wide")

    def reset(self, seed: int | list[int] | None = None) -> torch.Tensor:
        """Start a new episode in every env (env i seeded ``seed + i``, or ``seed[i]`` for a
        list); returns obs [N, obs_dim]. Without a seed, each env's episode RNG continues
        (the first call uses the constructor's seed)."""
        if isinstance(seed, list) and len(seed) != self.num_envs:
            raise ValueError(f"{self.task}: {len(seed)} seeds for {self.num_envs} envs")
        if seed is None:
            seed, self._first_seed = self._first_seed, None
        else:
            self._first_seed = None
        self._tracker = EpisodeTracker(self.num_envs, self.device)
        return self._reset(seed)

    def step(self, actions: torch.Tensor, look: bool = True) -> StepResult:
        """Apply actions [N, action_dim], clipped to the action bounds; ended episodes
        reset. ``look=False``: an rgb env may leave this step's images unrendered (zeros)
        where no episode ended."""
        if self._tracker is None:
            raise RuntimeError(f"{self.task}: call reset() before step()")
        if tuple(actions.shape) != (self.num_envs, self.action_dim):
            raise ValueError(
                f"{self.task}: actions must be [{self.num_envs}, {self.action_dim}], got {list(actions.shape)}"
            )
        clipped = torch.clamp(actions.to(self.device, torch.float32), self.action_low, self.action_high)
        if self.renders_on_request:
            self._look(look)
        result = self._step(clipped)
        result.ended = self._tracker.update(result.reward, result.success, result.done)
        return result

    @abc.abstractmethod
    def _reset(self, seed: int | list[int] | None) -> torch.Tensor:
        """Reset every env with the backend's own seeding; returns obs [N, obs_dim]."""

    @abc.abstractmethod
    def _step(self, actions: torch.Tensor) -> StepResult:
        """Step clipped actions [N, action_dim]; ``ended`` is filled in by ``step``."""

    @abc.abstractmethod
    def _camera_parts(self) -> tuple[int, int]:
        """An rgb env's (joint positions, state vector) sizes."""

    @abc.abstractmethod
    def _look(self, on: bool) -> None:
        """Whether an rgb env renders the next step's images (``CameraObservation.look``)."""

    @property
    def renders(self) -> int:
        """Env images an rgb env has rendered so far (for benchmarks and tests)."""
        return 0


class ManiSkillCPUEnv(_ManiSkillVecEnv):
    """N ManiSkill envs, one per worker process, on PhysX's CPU solver."""

    def __init__(self, settings: TaskSettings, num_envs: int, seed: int):
        import gymnasium as gym

        from omni_rl.runtime import set_threads
        from omni_rl.sim.maniskill_worker import worker_cpu_env

        # Workers fork from a server that has ManiSkill imported already (a no-op when
        # this process's forkserver is running).
        multiprocessing.get_context(WORKER_CONTEXT).set_forkserver_preload([WORKER_MODULE])
        threads = torch.get_num_threads()
        try:
            self._envs = gym.vector.AsyncVectorEnv(
                [functools.partial(worker_cpu_env, settings)] * num_envs,
                context=WORKER_CONTEXT,
                autoreset_mode=gym.vector.AutoresetMode.SAME_STEP,
            )
        finally:
            set_threads(threads)  # gymnasium also ran env_fns[0] in this process, to read the spaces
        space, act_space = self._envs.single_observation_space, self._envs.single_action_space
        self._looking = True
        super().__init__(settings, num_envs, seed, torch.device("cpu"), space, act_space)

    def _camera_parts(self) -> tuple[int, int]:
        return self._envs.get_attr("state_dim")[0], self._envs.get_attr("privileged_dim")[0]

    def _look(self, on: bool) -> None:
        if on != self._looking:  # one message to the workers when it changes
            self._envs.set_attr("look", on)
            self._looking = on

    @property
    def renders(self) -> int:
        return sum(self._envs.get_attr("renders")) if self.renders_on_request else 0

    def _reset(self, seed: int | list[int] | None) -> torch.Tensor:
        obs, info = self._envs.reset(seed=seed)  # gymnasium: env i gets seed + i, or seed[i]
        if "success" not in info:
            raise OmniRLError(f"{self.task}: ManiSkill reports no 'success' for this task")
        return torch.from_numpy(obs).float()

    def _step(self, actions: torch.Tensor) -> StepResult:
        obs, reward, terminated, truncated, info = self._envs.step(actions.numpy())
        # Same-step autoreset: ``obs`` and ``info`` of an ended env already belong to its
        # next episode; the ended episode's last ones are under final_obs / final_info.
        final_obs, success = obs.copy(), info["success"].copy()
        for i in np.flatnonzero(terminated | truncated):
            final_obs[i] = info["final_obs"][i]
            success[i] = info["final_info"]["success"][i]
        return StepResult(
            obs=torch.from_numpy(obs).float(),
            reward=torch.from_numpy(np.asarray(reward, dtype=np.float32)),
            terminated=torch.from_numpy(terminated.astype(bool)),
            truncated=torch.from_numpy(truncated.astype(bool)),
            final_obs=torch.from_numpy(final_obs).float(),
            success=torch.from_numpy(success.astype(bool)),
        )

    def close(self) -> None:
        """Stop the worker processes."""
        self._envs.close()


class ManiSkillGPUEnv(_ManiSkillVecEnv):
    """N ManiSkill envs in one batched PhysX scene on CUDA; tensors stay on the GPU."""

    def __init__(self, settings: TaskSettings, num_envs: int, seed: int):
        from mani_skill.vector.wrappers.gymnasium import ManiSkillVectorEnv

        # inside the vector env's autoreset: an ended episode's last images are rendered
        # before it resets them
        self._camera = settings.make("physx_cuda", num_envs=num_envs)
        self._env = ManiSkillVectorEnv(self._camera, auto_reset=True, ignore_terminations=settings.ignore_terminations)
        space, act_space = self._env.single_observation_space, self._env.single_action_space
        super().__init__(settings, num_envs, seed, torch.device(self._env.device), space, act_space)

    def _camera_parts(self) -> tuple[int, int]:
        return self._camera.state_dim, self._camera.privileged_dim

    def _look(self, on: bool) -> None:
        self._camera.look = on

    @property
    def renders(self) -> int:
        return self._camera.renders * self.num_envs if self.renders_on_request else 0

    def _reset(self, seed: int | list[int] | None) -> torch.Tensor:
        seeds = seed if seed is None or isinstance(seed, list) else [seed + i for i in range(self.num_envs)]
        if seeds is None:
            obs, info = self._env.reset()
        else:
            obs, info = seeded_resets(self._env, seeds, self.device)
        if "success" not in info:
            raise OmniRLError(f"{self.task}: ManiSkill reports no 'success' for this task")
        return obs.float()

    def _step(self, actions: torch.Tensor) -> StepResult:
        obs, reward, terminated, truncated, info = self._env.step(actions)
        done = terminated | truncated
        final_obs, success = obs, info["success"]
        if "final_info" in info:  # some env ended and was reset (partially) in this step
            final_obs = torch.where(done[:, None], info["final_observation"], obs)
            success = torch.where(done, info["final_info"]["success"], success)
        return StepResult(
            obs=obs.float(),
            reward=reward.float(),
            terminated=terminated.bool(),
            truncated=truncated.bool(),
            final_obs=final_obs.float(),
            success=success.bool(),
        )

    def close(self) -> None:
        """Release the simulator."""
        self._env.close()


def seeded_resets(env, seeds: list[int], device: torch.device):
    """Reset every env of a batched ManiSkill scene so that env i's initial state
    depends on ``seeds[i]`` alone: one partial reset per env, env i alone, with a seed
    list whose first entry (the one ManiSkill seeds torch with) and i-th entry (its own
    episode RNG) are ``seeds[i]``. Env 0 goes last, so the scene's recorded episode
    seeds end as ``seeds``. Returns the (obs, info) of the last reset, whose
    observations cover every env.

    Args:
        env: a ManiSkill vector env: ``reset(seed=list, options={"env_idx": ...})``.
        seeds: one per env.
        device: the scene's device (``env_idx`` lives there).
    """
    result = None
    for i in [*range(1, len(seeds)), 0]:
        order = list(seeds)
        order[0] = seeds[i]
        result = env.reset(seed=order, options={"env_idx": torch.tensor([i], device=device)})
    return result
