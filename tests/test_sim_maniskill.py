"""ManiSkill envs behind the VecEnv contract, the scripted experts and demo collection.

These run the real simulator (SAPIEN on the CPU backend). Without a GPU, SAPIEN needs the
lavapipe driver that ``tools/setup_vulkan.sh`` (``make setup``) unpacks: where it is
missing, these tests fail, they do not skip.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from omni_rl.errors import OmniRLError
from omni_rl.sim import make_vec_env
from omni_rl.sim.experts import expert_action, load_demos
from omni_rl.sim.maniskill import resolve_backend, seeded_resets

ROOT = Path(__file__).resolve().parents[1]
OMNI_RL = str(Path(sys.executable).parent / "omni-rl")


@pytest.fixture(scope="module")
def push_env():
    """PushCube-v1, 2 CPU envs, 5-step episodes (shared: each env start costs seconds)."""
    env = make_vec_env("PushCube-v1", 2, backend="cpu", seed=0, max_episode_steps=5)
    yield env
    env.close()


def random_actions(n: int, steps: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.rand(n, 4, generator=g) * 2 - 1 for _ in range(steps)]


def test_a_vulkan_driver_is_available_for_sapien():
    from omni_rl.sim.vulkan import ensure_vulkan, gpu_vulkan_driver

    chosen = ensure_vulkan() or os.environ.get("VK_ICD_FILENAMES") or gpu_vulkan_driver()
    assert chosen, "no Vulkan driver for SAPIEN: run tools/setup_vulkan.sh (part of 'make setup')"


def test_importing_sim_loads_no_simulator():
    code = "import sys, omni_rl.sim; print(sorted(m for m in ('mani_skill', 'sapien') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_reset_and_step_shapes(push_env):
    assert (push_env.num_envs, push_env.obs_dim, push_env.action_dim) == (2, 35, 4)
    assert push_env.device == torch.device("cpu") and push_env.max_episode_steps == 5
    assert torch.equal(push_env.action_low, -torch.ones(4)) and torch.equal(push_env.action_high, torch.ones(4))
    obs = push_env.reset(seed=0)
    assert obs.shape == (2, 35) and obs.dtype == torch.float32
    result = push_env.step(torch.full((2, 4), 5.0))  # clipped to the bounds
    assert result.obs.shape == result.final_obs.shape == (2, 35)
    assert result.obs.dtype == result.final_obs.dtype == result.reward.dtype == torch.float32
    for flags in (result.terminated, result.truncated, result.success, result.done):
        assert flags.shape == (2,) and flags.dtype == torch.bool
    assert result.reward.shape == (2,) and torch.isfinite(result.reward).all()
    with pytest.raises(ValueError, match=r"actions must be \[2, 4\]"):
        push_env.step(torch.zeros(3, 4))


def test_auto_reset_reports_the_episode_and_its_last_observation(push_env):
    push_env.reset(seed=1)
    rewards = []
    for t in range(1, 6):
        result = push_env.step(torch.zeros(2, 4))
        rewards.append(result.reward)
        if t < 5:
            assert not result.done.any() and result.episodes == []
            assert torch.equal(result.final_obs, result.obs)
    assert result.truncated.all() and not result.terminated.any()
    assert [(e.env, e.length) for e in result.episodes] == [(0, 5), (1, 5)]
    returns = torch.stack(rewards).sum(0)
    assert [e.ret for e in result.episodes] == pytest.approx(returns.tolist(), rel=1e-5)
    # obs starts the next episode (a new cube position); final_obs ends the old one
    cube = slice(28, 31)
    assert not torch.allclose(result.final_obs[:, cube], result.obs[:, cube])
    after = push_env.step(torch.zeros(2, 4))
    assert not after.done.any()


def rollout(env, seed: int, actions: list[torch.Tensor]) -> list[torch.Tensor]:
    trace = [env.reset(seed=seed)]
    for a in actions:
        r = env.step(a)
        trace += [r.obs, r.final_obs, r.reward]
    return trace


def test_seeded_rollouts_repeat_exactly(push_env):
    actions = random_actions(2, 8, seed=0)  # crosses an auto-reset at step 5
    first, second = rollout(push_env, 3, actions), rollout(push_env, 3, actions)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    other = rollout(push_env, 4, actions)
    assert not torch.equal(first[0], other[0])
    # env i is seeded seed + i
    assert torch.equal(first[0][1], other[0][0])


def test_first_reset_uses_the_constructor_seed(push_env):
    seeded = push_env.reset(seed=0)
    env = make_vec_env("PushCube-v1", 2, backend="cpu", seed=0, max_episode_steps=5)
    try:
        assert torch.equal(env.reset(), seeded)
    finally:
        env.close()


@pytest.mark.parametrize("task", ["PushCube-v1", "PickCube-v1"])
def test_expert_solves_seeded_episodes_and_success_is_reported(task):
    env = make_vec_env(task, 2, backend="cpu", seed=0)
    try:
        obs, episodes = env.reset(), []
        for _ in range(2 * env.max_episode_steps):
            result = env.step(expert_action(task, obs))
            # these tasks end an episode only on success
            assert (result.terminated <= result.success).all()
            episodes += result.episodes
            obs = result.obs
            if len(episodes) >= 4:
                break
    finally:
        env.close()
    assert len(episodes) >= 4
    assert all(e.success_once for e in episodes), episodes
    assert all(e.length < env.max_episode_steps for e in episodes), episodes


def test_collect_demos_cli_writes_a_loadable_file(tmp_path):
    out = tmp_path / "demos" / "push.safetensors"
    args = ["sim", "collect-demos", "--task", "PushCube-v1", "--episodes", "3", "--out", str(out)]
    args += ["--seed", "5", "--num-envs", "2", "--backend", "cpu"]
    run = subprocess.run([OMNI_RL, *args], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "wrote 3 episodes" in run.stdout
    demos = load_demos(out)
    steps = len(demos.obs)
    assert demos.obs.shape == (steps, 35) and demos.actions.shape == (steps, 4)
    assert demos.reward.shape == demos.episode.shape == demos.step.shape == (steps,)
    assert demos.episode.unique().tolist() == [0, 1, 2]
    assert (demos.episode[1:] >= demos.episode[:-1]).all()
    for e in range(3):
        assert demos.step[demos.episode == e].tolist() == list(range(int((demos.episode == e).sum())))
    assert demos.success.tolist() == [True, True, True]
    assert demos.meta == {
        "task": "PushCube-v1",
        "control_mode": "pd_ee_delta_pos",
        "obs_mode": "state",
        "episodes": 3,
        "success_rate": 1.0,
        "seed": 5,
        "num_envs": 2,
        "episode_seeds": [5, 8],
        "action_scale": 1.0,
    }
    from safetensors import safe_open

    with safe_open(str(out), framework="pt") as f:  # plain safetensors, JSON metadata
        assert json.loads(f.metadata()["omni_rl"])["task"] == "PushCube-v1"


def test_collect_demos_cli_names_an_unknown_task():
    args = ["sim", "collect-demos", "--task", "PushCub-v1", "--episodes", "1", "--out", "x.safetensors"]
    run = subprocess.run([OMNI_RL, *args], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert run.returncode == 2
    assert run.stderr.strip().count("\n") == 0
    assert "PushCub-v1" in run.stderr and "PushCube-v1" in run.stderr


def test_user_errors_name_the_problem(push_env):
    with pytest.raises(OmniRLError, match=r"unknown ManiSkill task 'PushCub-v1'.*PushCube-v1"):
        make_vec_env("PushCub-v1", 2, backend="cpu")
    with pytest.raises(OmniRLError, match="obs_mode 'depth'"):
        make_vec_env("PushCube-v1", 2, backend="cpu", obs_mode="depth")
    with pytest.raises(OmniRLError, match="expert reads state observations"):
        expert_action("PickCube-v1", torch.zeros(2, 35))
    if not torch.cuda.is_available():
        with pytest.raises(OmniRLError, match="no CUDA device"):
            make_vec_env("PushCube-v1", 2, backend="gpu")


def test_demos_are_seeded_episode_by_episode_whatever_the_env_count(tmp_path):
    """Episode e is seeded SEED + e: two envs or three, the same first observations."""
    from omni_rl.sim.experts import collect_demos

    firsts = []
    for num_envs in (2, 3):
        demos = collect_demos("PushCube-v1", 3, seed=7, num_envs=num_envs, backend="cpu")
        firsts.append(demos.obs[demos.step == 0])
        assert demos.meta["episode_seeds"] == [7, 10]
    assert torch.equal(firsts[0], firsts[1])
    env = make_vec_env("PushCube-v1", 1, backend="cpu", seed=0)
    try:
        assert torch.equal(env.reset(seed=[9]), firsts[0][2:3])  # episode 2 starts as seed 9 does
    finally:
        env.close()


class BatchedSceneLikeManiSkill:
    """ManiSkill 3.0's seeded reset of a batched (GPU) scene, as its source does it:
    torch is seeded with the first seed of the list, then the reset envs (``env_idx``)
    draw their initial states from that one stream, in order."""

    def __init__(self, num_envs: int):
        self.state = torch.full((num_envs, 2), float("nan"))
        self.calls = 0

    def reset(self, seed: list[int], options: dict | None = None):
        env_idx = options["env_idx"] if options else torch.arange(self.state.shape[0])
        generator = torch.Generator().manual_seed(seed[0])
        self.state[env_idx] = torch.rand(len(env_idx), 2, generator=generator)
        self.calls += 1
        return self.state.clone(), {"success": torch.zeros(self.state.shape[0], dtype=torch.bool)}


def test_gpu_resets_give_each_env_the_start_of_its_own_seed():
    seeds = [11, 12, 11, 13]
    naive = BatchedSceneLikeManiSkill(4)
    naive.reset(seed=seeds)  # one batched call: env i's start follows seeds[0], not seeds[i]
    assert not torch.equal(naive.state[0], naive.state[2])  # a critic-free group would not share its start

    scene = BatchedSceneLikeManiSkill(4)
    obs, _ = seeded_resets(scene, seeds, torch.device("cpu"))
    assert scene.calls == 4 and torch.equal(obs, scene.state)
    assert torch.equal(scene.state[0], scene.state[2])  # equal seeds, equal starts
    alone = BatchedSceneLikeManiSkill(1)
    for i, s in enumerate(seeds):  # the start a scene of one env gives that seed
        alone.reset(seed=[s])
        assert torch.equal(scene.state[i], alone.state[0])
    changed = BatchedSceneLikeManiSkill(4)
    seeded_resets(changed, [11, 12, 11, 99], torch.device("cpu"))  # another env's seed changes nothing else
    assert torch.equal(changed.state[:3], scene.state[:3]) and not torch.equal(changed.state[3], scene.state[3])


def test_the_gpu_backend_resets_through_the_per_env_path():
    """ManiSkillGPUEnv's seeded reset (built without CUDA: its scene is the stand-in)."""
    from omni_rl.sim.maniskill import ManiSkillGPUEnv

    env = ManiSkillGPUEnv.__new__(ManiSkillGPUEnv)
    env._env, env.num_envs, env.device, env.task = BatchedSceneLikeManiSkill(3), 3, torch.device("cpu"), "PushCube-v1"
    obs = env._reset(5)  # an int seeds env i with 5 + i, each alone
    alone = BatchedSceneLikeManiSkill(1)
    for i in range(3):
        alone.reset(seed=[5 + i])
        assert torch.equal(obs[i], alone.state[0])


def test_auto_backend_says_what_it_chose(caplog):
    with caplog.at_level("WARNING", logger="omni_rl.sim.maniskill"):
        chosen = resolve_backend("auto")
    assert chosen == ("gpu" if torch.cuda.is_available() else "cpu")
    assert f"env.backend auto: ManiSkill's {chosen} backend" in caplog.text
