"""Scripted experts for ManiSkill's Panda cube tasks, and demonstrations collected with them.

An expert maps a batch of flat state observations (ManiSkill 3.0.1, ``obs_mode="state"``)
to ``pd_ee_delta_pos`` actions: an end-effector xyz delta in the robot's base frame,
normalized to [-1, 1] (1 is 0.1 m), and the gripper (1 open, -1 closed). Experts keep no
memory: each env's phase (approach, descend, grasp, carry, push) is read off its state, so
one call serves envs at different points of their episodes.

The flat state is ManiSkill's ``agent`` entries (qpos [9], qvel [9]) followed by the task's
``_get_obs_extra`` entries in insertion order:

- PushCube-v1 [35]: qpos 0:9, qvel 9:18, tcp_pose 18:25, goal_pos 25:28, obj_pose 28:35
- PickCube-v1 [42]: qpos 0:9, qvel 9:18, is_grasped 18, tcp_pose 19:26, goal_pos 26:29,
  obj_pose 29:36, tcp_to_obj_pos 36:39, obj_to_goal_pos 39:42

Poses are position [3] then quaternion [4]; the TCP is the point between the fingertips.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from omni_rl.errors import OmniRLError
from omni_rl.registry import Registry
from omni_rl.runtime import umask_files
from omni_rl.sim import pixel_targets

log = logging.getLogger(__name__)

CONTROL_MODE = "pd_ee_delta_pos"
# demonstrations' default first seed: above every training seed (below
# trainer.eval_seed, 1e6 by default) and every held-out seed (from eval_seed up)
DEMO_SEED = 2_000_000
OBS_MODE = "state"
MAX_DELTA = 0.1  # metres of end-effector motion that a normalized action of 1 asks for
GAIN = 2.0  # action = GAIN * position error / MAX_DELTA, clipped: fast far away, gentle near
CUBE_HALF = 0.02  # half the cube's side in both tasks
OPEN, CLOSED = 1.0, -1.0


@dataclass(frozen=True)
class Expert:
    """A scripted policy for one task.

    Attributes:
        obs_dim: the length of the task's flat observation.
        act: ``obs [N, obs_dim] -> actions [N, A]`` (ManiSkill's: xyz delta, gripper).
    """

    obs_dim: int
    act: Callable[[torch.Tensor], torch.Tensor]


EXPERTS: Registry[Expert] = Registry("scripted expert")


def expert_action(task: str, obs: torch.Tensor) -> torch.Tensor:
    """The scripted expert's actions for a batch of states.

    Args:
        task: a task with an expert (``EXPERTS``), e.g. ``PickCube-v1``.
        obs: [N, obs_dim] flat state observations of that task.

    Returns:
        [N, A] float32 actions in [-1, 1] (ManiSkill's ``pd_ee_delta_pos``), on ``obs``'s
        device.
    """
    expert = EXPERTS.get(task)
    if obs.ndim != 2 or obs.shape[1] != expert.obs_dim:
        raise OmniRLError(
            f"{task}: the expert reads {OBS_MODE} observations [N, {expert.obs_dim}], got {list(obs.shape)}"
        )
    return expert.act(obs.float())


def _move(tcp: torch.Tensor, target: torch.Tensor, gripper: torch.Tensor, limit: torch.Tensor) -> torch.Tensor:
    """Actions [N, 4] that move the TCP towards a target and set the gripper.

    Args:
        tcp, target: [N, 3] positions.
        gripper: [N], 1 open, -1 closed.
        limit: [N, 1], the largest normalized step per axis, at most 1.
    """
    delta = GAIN * (target - tcp) / MAX_DELTA
    return torch.cat([torch.maximum(torch.minimum(delta, limit), -limit), gripper[:, None]], dim=1)


def _push_cube(obs: torch.Tensor) -> torch.Tensor:
    """PushCube-v1: get behind the cube at its height with the gripper closed (a flat
    pusher), then push it along +x, towards the goal, until its centre reaches the goal.

    Goals lie up to 0.3 m ahead, at the edge of the arm's reach, where the CPU backend's
    IK fails on long steps and the controller then freezes the arm: pushes get shorter
    past x = 0.12 m and shorter still while the arm is frozen. A cube spawned in the far
    corner still ends short of the goal about once in 200 episodes.
    """
    tcp, goal, cube = obs[:, 18:21], obs[:, 25:28], obs[:, 28:31]
    behind = cube[:, 0] - CUBE_HALF - 0.03  # fingertips clear of the cube's back face
    start = torch.stack([behind, cube[:, 1], torch.full_like(behind, CUBE_HALF)], dim=1)
    hover = start + torch.tensor([0.0, 0.0, 0.06], device=obs.device)
    # keep the cube's y while pushing, so a drift sideways is corrected
    finish = torch.stack([goal[:, 0] - CUBE_HALF - 0.01, cube[:, 1], start[:, 2]], dim=1)
    in_line = (tcp[:, 0] < cube[:, 0] - CUBE_HALF) & ((tcp[:, 1] - cube[:, 1]).abs() < 0.015)
    pushing = in_line & (tcp[:, 2] < CUBE_HALF + 0.015)
    target = torch.where(pushing[:, None], finish, torch.where(in_line[:, None], start, hover))
    frozen = obs[:, 9:16].abs().amax(dim=1) < 0.02  # arm joint speeds
    push_limit = torch.where(frozen, 0.05, torch.where(tcp[:, 0] > 0.12, 0.15, 0.5))
    limit = torch.where(pushing, push_limit, 1.0)[:, None]
    return _move(tcp, target, torch.full_like(behind, CLOSED), limit)


def _pick_cube(obs: torch.Tensor) -> torch.Tensor:
    """PickCube-v1: hover over the cube, descend with the gripper open, close it, then
    carry the cube to the goal and hold still there (success needs a static robot)."""
    grasped = obs[:, 18] > 0.5
    tcp, goal, cube = obs[:, 19:22], obs[:, 26:29], obs[:, 29:32]
    hover = cube + torch.tensor([0.0, 0.0, 0.06], device=obs.device)
    over = torch.linalg.norm(tcp[:, :2] - cube[:, :2], dim=1) < 0.015
    at_cube = over & ((tcp[:, 2] - cube[:, 2]).abs() < 0.01)
    carry = tcp + goal - cube  # move the cube, not the TCP, onto the goal
    target = torch.where(
        grasped[:, None], carry, torch.where(at_cube[:, None], tcp, torch.where(over[:, None], cube, hover))
    )
    gripper = torch.where(grasped | at_cube, CLOSED, OPEN)
    limit = torch.where(grasped, 0.7, 1.0)[:, None]  # full-speed carries shake a fresh grasp loose
    return _move(tcp, target, gripper, limit)


EXPERTS.register("PushCube-v1")(Expert(obs_dim=35, act=_push_cube))
EXPERTS.register("PickCube-v1")(Expert(obs_dim=42, act=_pick_cube))
# the pixel task's expert reads the privileged part of its flat observation (32² images)
EXPERTS.register("PixelTargets-v0")(Expert(obs_dim=3 * 32 * 32 + 9, act=pixel_targets.expert_action))


@dataclass
class Demos:
    """Expert episodes, flattened over time.

    Attributes:
        obs: [T, obs_dim] float32, the observation each action was taken in.
        actions: [T, action_dim] float32.
        reward: [T] float32, the reward that followed each action.
        episode: [T] int64, the episode each step belongs to (0..E-1, in order).
        step: [T] int64, the step's index within its episode.
        success: [E] bool, whether each episode solved the task at some step.
        meta: task, control_mode, obs_mode (and an rgb file's image_size), episodes,
            success_rate, seed, num_envs and episode_seeds ([first, end): episode e was
            seeded first + e), action_scale and the controls the policy was shown.
    """

    obs: torch.Tensor
    actions: torch.Tensor
    reward: torch.Tensor
    episode: torch.Tensor
    step: torch.Tensor
    success: torch.Tensor
    meta: dict

    TENSORS = ("obs", "actions", "reward", "episode", "step", "success")


def collect_demos(
    task: str,
    episodes: int,
    out: str | Path | None = None,
    seed: int = DEMO_SEED,
    num_envs: int = 2,
    backend: str = "auto",
    progress: bool = False,
    controls: dict | None = None,
    action_scale: float = 1.0,
    obs_mode: str = OBS_MODE,
    image_size: int | None = None,
) -> Demos:
    """Run the task's scripted expert for ``episodes`` episodes and keep every step.

    Episode e is reset with seed ``seed + e`` (rounds of ``num_envs`` episodes, each env
    playing one episode a round), so the seeds a file holds are known exactly (its
    ``meta["episode_seeds"]``, checked against the held-out seeds before behaviour
    cloning) and the result depends on ``seed`` alone.

    Args:
        task: a task with a scripted expert, e.g. ``PushCube-v1``.
        episodes: E, how many episodes to record.
        out: where to write them (safetensors: the tensors of :class:`Demos`, and its
            ``meta`` as JSON under the metadata key ``omni_rl``); None: don't write.
        seed: the first episode's seed (default: above every training and held-out seed).
        num_envs: envs stepped together.
        backend: sim backend (``auto``, ``cpu`` or ``gpu``).
        progress: show a progress bar of finished episodes.
        controls: what the policy is shown instead (PixelTargets-v0's ``blank_images``);
            the expert reads the privileged state either way.
        action_scale: the expert's actions times this (below 1: a demonstrator slower
            than the task allows, whose clone RL can beat); recorded in ``meta``.
        obs_mode: a ManiSkill task's ``state`` or ``rgb`` (every step's camera image
            recorded, for a pi0 policy to clone; the expert reads the state vector).
        image_size: ``rgb``: the camera image's side (default 64).

    Returns:
        The recorded :class:`Demos`.
    """
    from tqdm import tqdm

    from omni_rl.sim import make_vec_env

    EXPERTS.canonical(task)  # an unknown task fails before the simulator starts
    if episodes < 1:
        raise OmniRLError(f"{task}: episodes must be at least 1, got {episodes}")
    if not 0 < action_scale <= 1:
        raise OmniRLError(f"{task}: action_scale must be in (0, 1], got {action_scale}")
    camera = {"image_size": image_size} if image_size is not None else {}
    modes = {"control_mode": CONTROL_MODE, "obs_mode": obs_mode, **camera, **(controls or {})}
    env = make_vec_env(task, num_envs, backend=backend, seed=seed, **modes)
    # a camera env's expert reads the privileged state vector behind the image
    layout = env.layout if obs_mode == "rgb" else None
    try:
        steps: list[list[tuple[torch.Tensor, torch.Tensor, float]]] = [[] for _ in range(episodes)]
        success = torch.zeros(episodes, dtype=torch.bool)
        with tqdm(total=episodes, desc=f"demos {task}", unit="episode", disable=not progress) as bar:
            for first in range(0, episodes, num_envs):
                obs = env.reset(seed=[seed + first + i for i in range(num_envs)])
                playing = [first + i < episodes for i in range(num_envs)]  # the env's round episode runs
                while any(playing):
                    view = obs if layout is None else layout.split(obs)[3]
                    actions = action_scale * expert_action(task, view)
                    result = env.step(actions)
                    rewards = result.reward.cpu()
                    for i in range(num_envs):
                        if playing[i]:
                            steps[first + i].append((obs[i].cpu(), actions[i].cpu(), float(rewards[i])))
                    for stats in result.episodes:
                        if playing[stats.env]:
                            success[first + stats.env] = stats.success_once
                            playing[stats.env] = False
                            bar.update(1)
                    obs = result.obs
    finally:
        env.close()
    info = {"task": task, "seed": seed, "num_envs": num_envs, "episode_seeds": [seed, seed + episodes]}
    info.update(controls or {}, action_scale=action_scale, obs_mode=obs_mode)
    if layout is not None:
        info["image_size"] = layout.image_size
    demos = _stack(steps, success, info)
    if out is not None:
        save_demos(demos, out)
    return demos


def check_demo_seeds(path: str | Path, eval_seed: int, eval_episodes: int) -> None:
    """Refuse demonstrations whose episodes share a seed with the held-out ones
    ``[eval_seed, eval_seed + eval_episodes)``: cloning them would leak the evaluation.
    A file from before per-episode seeds records no range; that is said once."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = json.loads((f.metadata() or {}).get("omni_rl", "{}"))
    if "episode_seeds" not in meta:
        log.warning("%s: records no episode seeds; cannot check them against the held-out seeds", path)
        return
    low, high = meta["episode_seeds"]
    if low < eval_seed + eval_episodes and eval_seed < high:
        raise OmniRLError(
            f"{path}: demo seeds [{low}, {high}) overlap the held-out seeds "
            f"[{eval_seed}, {eval_seed + eval_episodes}); collect them with --seed {DEMO_SEED} (the default) "
            "or move trainer.eval_seed"
        )


def _stack(steps: list[list[tuple[torch.Tensor, torch.Tensor, float]]], success: torch.Tensor, info: dict) -> Demos:
    """Per-episode lists of (obs, action, reward) -> flat :class:`Demos`."""
    flat = [s for episode in steps for s in episode]
    lengths = torch.tensor([len(episode) for episode in steps])
    meta = {
        **info,
        "control_mode": CONTROL_MODE,
        "episodes": len(steps),
        "success_rate": float(success.float().mean()),
    }
    return Demos(
        obs=torch.stack([o for o, _, _ in flat]).float(),
        actions=torch.stack([a for _, a, _ in flat]).float(),
        reward=torch.tensor([r for _, _, r in flat], dtype=torch.float32),
        episode=torch.repeat_interleave(torch.arange(len(steps)), lengths),
        step=torch.cat([torch.arange(n) for n in lengths.tolist()]),
        success=success,
        meta=meta,
    )


def save_demos(demos: Demos, path: str | Path) -> Path:
    """Write demos as safetensors, atomically (a temp file renamed into place), with the
    mode the user's umask gives a new file (safetensors creates its file 600)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tensors = {name: getattr(demos, name).contiguous() for name in Demos.TENSORS}
    save_file(tensors, str(tmp), metadata={"omni_rl": json.dumps(demos.meta, sort_keys=True)})
    umask_files(tmp)
    os.replace(tmp, path)
    return path


def load_demos(path: str | Path) -> Demos:
    """Read demos written by :func:`save_demos`."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = json.loads(f.metadata()["omni_rl"])
            tensors = {name: f.get_tensor(name) for name in Demos.TENSORS}
    except FileNotFoundError:
        raise OmniRLError(f"{path}: no such demos file") from None
    except Exception as err:  # noqa: BLE001 - a damaged file fails in safetensors' own ways
        raise OmniRLError(f"{path}: unreadable demos file ({err})") from None
    return Demos(**tensors, meta=meta)


def demo_chunks(path: str | Path, horizon: int, episodes: int | None = None):
    """Expert chunks from a demonstrations file, for behaviour cloning: obs [M, O],
    actions [M, H, D] (the next H actions of the same episode, the last one repeated
    past its end) and a mask [M, H] that is 1 on real actions. ``episodes``: keep only
    the first this many (episodes are numbered 0, 1, ... in the file)."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise OmniRLError(f"{path}: demonstrations file not found (omni-rl sim collect-demos writes one)")
    with safe_open(str(path), "pt") as f:
        obs, actions, episode = f.get_tensor("obs"), f.get_tensor("actions"), f.get_tensor("episode")
    if episodes is not None:
        keep = episode < episodes
        obs, actions, episode = obs[keep], actions[keep], episode[keep]
    count = obs.shape[0]
    index = torch.arange(count)
    chunks, mask = [], []
    last = index.clone()
    for j in range(horizon):
        ahead = (index + j).clamp(max=count - 1)
        real = (index + j < count) & (episode[ahead] == episode)
        last = torch.where(real, ahead, last)
        chunks.append(actions[last])
        mask.append(real)
    return obs.float(), torch.stack(chunks, dim=1).float(), torch.stack(mask, dim=1).float()
