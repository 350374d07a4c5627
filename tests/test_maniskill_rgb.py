"""ManiSkill tasks with a camera (``obs_mode: rgb``): the flat layout a pi0 policy reads,
rendering only where a policy looks, experts on the privileged state, demos with
images, and a tiny pi0 trained on PushCube from pixels. The real simulator on the CPU
backend (lavapipe, as in ``test_sim_maniskill.py``)."""

from __future__ import annotations

import json

import pytest
import torch

from omni_rl.errors import OmniRLError
from omni_rl.sim import make_vec_env
from omni_rl.sim.episodes import run_chunk
from omni_rl.sim.experts import collect_demos, expert_action, load_demos

SIZE = 32
PIXELS = 3 * SIZE * SIZE


@pytest.fixture(scope="module")
def rgb_env():
    """PushCube-v1 with a 32² camera, 2 CPU envs, 6-step episodes."""
    env = make_vec_env("PushCube-v1", 2, backend="cpu", seed=0, obs_mode="rgb", image_size=SIZE, max_episode_steps=6)
    yield env
    env.close()


def test_the_layout_holds_the_camera_the_instruction_the_joints_and_the_state(rgb_env):
    layout = rgb_env.layout
    assert (layout.image_size, layout.instructions) == (SIZE, ("push the cube to the goal",))
    assert (layout.state_dim, layout.privileged_dim, rgb_env.obs_dim) == (9, 35, PIXELS + 1 + 9 + 35)
    images, index, joints, privileged = layout.split(rgb_env.reset(seed=[3, 4]))
    assert images.shape == (2, 3, SIZE, SIZE) and images.dtype == torch.uint8
    assert images.float().std() > 10 and not torch.equal(images[0], images[1])  # a scene, two starts
    assert index.tolist() == [0, 0]
    # the joints are the state vector's qpos; the state vector is what a state env gives
    assert torch.equal(joints, privileged[:, :9])
    state_env = make_vec_env("PushCube-v1", 2, backend="cpu", seed=0, max_episode_steps=6)
    try:
        assert torch.equal(privileged, state_env.reset(seed=[3, 4]))
    finally:
        state_env.close()


def test_images_render_where_asked_and_at_episode_ends(rgb_env):
    rgb_env.reset(seed=0)
    rendered = rgb_env.renders
    still = torch.zeros(2, 4)
    blind = rgb_env.step(still, look=False)
    assert blind.obs[:, :PIXELS].abs().sum() == 0 and rgb_env.renders == rendered
    seen = rgb_env.step(still)  # look defaults to on
    assert (seen.obs[:, :PIXELS].abs().sum(dim=1) > 0).all() and rgb_env.renders == rendered + 2
    for _ in range(3):
        result = rgb_env.step(still, look=False)
    assert not result.done.any()
    result = rgb_env.step(still, look=False)  # the 6th step: both episodes end
    assert result.done.all()
    # the ended episodes' last images and the new episodes' first ones
    assert (result.final_obs[:, :PIXELS].abs().sum(dim=1) > 0).all()
    assert (result.obs[:, :PIXELS].abs().sum(dim=1) > 0).all()
    assert not torch.equal(result.final_obs[:, :PIXELS], result.obs[:, :PIXELS])


def test_a_chunk_renders_its_last_step_only(rgb_env):
    """Five executed actions, no episode ending: one image per env (the next chunk's
    observation), not five."""
    rgb_env.reset(seed=0)
    before = rgb_env.renders
    outcome = run_chunk(rgb_env, torch.zeros(2, 8, 4), executed=5)
    assert rgb_env.renders == before + 2 and not outcome.truncated.any()
    assert (outcome.next_obs[:, :PIXELS].abs().sum(dim=1) > 0).all()


def test_demos_record_images_and_the_expert_reads_the_state(tmp_path):
    demos = collect_demos("PushCube-v1", 2, tmp_path / "demos.safetensors", num_envs=2, obs_mode="rgb", image_size=SIZE)
    loaded = load_demos(tmp_path / "demos.safetensors")
    assert loaded.meta["obs_mode"] == "rgb" and loaded.meta["image_size"] == SIZE
    assert loaded.obs.shape[1] == PIXELS + 1 + 9 + 35 and demos.meta["success_rate"] == 1.0
    assert (loaded.obs[:, :PIXELS].abs().sum(dim=1) > 0).all()  # every step's image
    # the actions are the expert's on the state vector behind each image
    assert torch.allclose(loaded.actions, expert_action("PushCube-v1", loaded.obs[:, PIXELS + 10 :]))


def test_camera_settings_that_cannot_work_are_refused():
    from omni_rl.errors import ConfigError
    from omni_rl.recipe_loader import config_from_dict

    with pytest.raises(ConfigError, match="image_size"):
        config_from_dict({"recipe": "flow_ppo", "env": {"image_size": SIZE}}, "test")
    with pytest.raises(OmniRLError, match="image_size sizes the camera of obs_mode rgb"):
        make_vec_env("PushCube-v1", 1, backend="cpu", image_size=SIZE)
    with pytest.raises(OmniRLError, match="needs the task's instruction"):
        make_vec_env("StackCube-v1", 1, backend="cpu", obs_mode="rgb")
    with pytest.raises(OmniRLError, match="one observation mode"):
        make_vec_env("PointMass-v0", 1, obs_mode="rgb")


def test_a_tiny_pi0_clones_and_trains_on_pushcube_from_pixels(tmp_path):
    """BC on camera demos, then Flow-Noise PPO, with a critic on the privileged state:
    the loop runs, logs its held-out success and exports the policy."""
    from omni_rl.models.pi0 import build_tiny_pi0
    from omni_rl.recipe_loader import config_from_dict
    from omni_rl.recipes import flow_ppo

    build_tiny_pi0(tmp_path / "pi0")
    collect_demos("PushCube-v1", 2, tmp_path / "demos.safetensors", num_envs=2, obs_mode="rgb", image_size=SIZE)
    cfg = config_from_dict(
        {
            "recipe": "flow_ppo",
            "run": {"seed": 0, "output_dir": str(tmp_path / "run"), "device": "cpu"},
            "env": {
                "task": "PushCube-v1",
                "num_envs": 2,
                "backend": "cpu",
                "obs_mode": "rgb",
                "image_size": SIZE,
                "max_episode_steps": 10,
                "ignore_terminations": False,
            },
            "policy": {"type": "pi0", "path": str(tmp_path / "pi0"), "horizon": 8, "executed": 5, "width": 32},
            "bc": {"demos": str(tmp_path / "demos.safetensors"), "steps": 2, "batch_size": 8},
            "ppo": {"epochs": 1, "minibatches": 2},
            "trainer": {"steps": 1, "eval_every": 0, "eval_episodes": 2},
        },
        "test",
    )
    flow_ppo.train(cfg)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["results"]["heldout_episodes"] == 2 and 0 <= summary["results"]["success_bc"] <= 1
    assert (tmp_path / "run" / "model" / "policy.safetensors").is_file()
