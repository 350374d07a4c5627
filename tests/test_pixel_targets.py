"""The pixel-and-language reaching task (``omni_rl.sim.pixel_targets``): what the image
and the instruction carry, and that the scripted expert solves it."""

from __future__ import annotations

import torch

from omni_rl.sim.pixel_targets import COLOURS, RGB, PixelTargetsEnv, expert_action, render, unpack


def pixel_of(position: torch.Tensor, size: int) -> tuple[int, int]:
    """(row, column) of a point of the square in a ``size``² image (row 0 is y = 1)."""
    column = int((position[0] + 1) / 2 * size)
    row = int((1 - position[1]) / 2 * size)
    return min(row, size - 1), min(column, size - 1)


def test_the_image_shows_each_target_in_its_colour_and_the_instruction_names_the_goal():
    env = PixelTargetsEnv(6, seed=3)
    flat = env.reset()
    assert flat.shape == (6, env.obs_dim) == (6, 3 * 32 * 32 + 9)
    obs = unpack(flat, 32)
    assert obs.flat().equal(flat) and obs.images.equal(env.observe().images)
    assert obs.images.shape == (6, 3, 32, 32) and obs.images.dtype == torch.uint8
    assert obs.state.shape == (6, 2) and obs.privileged.shape == (6, 6)
    for i in range(6):
        for k, colour in enumerate(COLOURS):
            row, column = pixel_of(env.targets[i, k], 32)
            assert tuple(obs.images[i, :, row, column].tolist()) == RGB[colour]
        named = COLOURS.index(obs.instructions[i].split()[3])
        assert obs.instructions[i] == f"go to the {COLOURS[named]} target"
        assert torch.equal(obs.privileged[i, 2:4], env.targets[i, named])
        row, column = pixel_of(obs.state[i], 32)
        assert tuple(obs.images[i, :, row, column].tolist()) == RGB["point"]
    assert {obs.instructions[i] for i in range(6)} == {"go to the red target", "go to the blue target"}


def test_the_scripted_expert_reaches_the_named_target_every_time():
    env = PixelTargetsEnv(8, seed=0, max_episode_steps=30)
    obs, ended = env.reset(), []
    for _ in range(60):
        result = env.step(expert_action(obs))
        obs, ended = result.obs, ended + result.episodes
    assert len(ended) >= 16 and all(e.success_once for e in ended)
    assert min(e.length for e in ended) >= 2  # no episode starts on its target


def test_the_same_seed_gives_the_same_episodes():
    assert torch.equal(PixelTargetsEnv(4, seed=7).reset(), PixelTargetsEnv(4, seed=7).reset())


def test_render_draws_the_point_over_the_targets():
    image = render(torch.tensor([[0.5, 0.5]]), torch.tensor([[[0.5, 0.5], [-0.5, -0.5]]]), 32, 0.2)[0]

    def colour(x: float, y: float) -> tuple:
        row, column = pixel_of(torch.tensor([x, y]), 32)
        return tuple(image[:, row, column].tolist())

    assert colour(0.5, 0.5) == RGB["point"] and colour(0.66, 0.5) == RGB["red"]
    assert colour(-0.5, -0.5) == RGB["blue"] and colour(-0.9, 0.9) == RGB["background"]


def test_the_controls_change_what_is_shown_and_not_the_task():
    """``blank_images``: every image the empty background; ``swap_instructions``: the
    other target named. The episodes (targets, goal, privileged state) stay the same."""
    from omni_rl.sim import make_vec_env

    plain, blank, swapped = (
        make_vec_env("PixelTargets-v0", 6, seed=5, **controls)
        for controls in ({}, {"blank_images": True}, {"swap_instructions": True})
    )
    want = unpack(plain.reset(), 32)
    shown_blank, shown_swapped = unpack(blank.reset(), 32), unpack(swapped.reset(), 32)
    background = torch.tensor(RGB["background"], dtype=torch.uint8)[None, :, None, None]
    assert shown_blank.images.equal(background.expand_as(want.images)) and not want.images.equal(shown_blank.images)
    assert shown_blank.instruction.equal(want.instruction) and shown_swapped.images.equal(want.images)
    assert shown_swapped.instruction.equal(1 - want.instruction)
    for shown in (shown_blank, shown_swapped):
        assert shown.privileged.equal(want.privileged) and shown.state.equal(want.state)


def test_the_controls_are_pixel_targets_options_only():
    import pytest

    from omni_rl.config import build_section
    from omni_rl.errors import OmniRLError
    from omni_rl.sim import make_vec_env
    from omni_rl.sim.config import SimEnvConfig

    with pytest.raises(OmniRLError, match="unexpected options blank_images"):
        make_vec_env("PointMass-v0", 2, blank_images=True)
    with pytest.raises(OmniRLError, match=r"env\.blank_images.*PixelTargets-v0 only"):
        build_section(SimEnvConfig, {"task": "PushCube-v1", "blank_images": True}, "env")


def test_a_control_mode_the_point_tasks_lack_is_refused():
    """env.control_mode was taken and ignored on PointMass-v0 and PixelTargets-v0 (a
    misspelt controller ran as the default), where a wrong obs_mode or reward_mode is
    refused. Their one control is the default's, which passes."""
    import pytest

    from omni_rl.errors import OmniRLError
    from omni_rl.sim import make_vec_env

    for task in ("PointMass-v0", "PixelTargets-v0"):
        for mode in ("pd_joint_pos", "no_such_controller"):
            with pytest.raises(OmniRLError, match=f"{task}: has one control"):
                make_vec_env(task, 2, control_mode=mode)
        make_vec_env(task, 2, control_mode="pd_ee_delta_pos").close()


def test_a_slower_demonstrator_records_scaled_actions_and_says_so():
    from omni_rl.sim.experts import collect_demos

    full, slow = (collect_demos("PixelTargets-v0", 2, seed=7, action_scale=scale) for scale in (1.0, 0.5))
    assert slow.meta["action_scale"] == 0.5 and full.meta["action_scale"] == 1.0
    assert slow.obs[0].equal(full.obs[0]) and torch.allclose(slow.actions[0], 0.5 * full.actions[0])
    assert len(slow.obs) > len(full.obs)  # the slow one takes more steps to the same targets
