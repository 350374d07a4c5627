"""pi_0 as a flow policy's backbone (``omni_rl.models.pi0``): the tiny checkpoint, the
prefix encoded once per observation, and the velocity field against transformers' own
``sample_actions``."""

from __future__ import annotations

import pytest
import torch

from omni_rl.algorithms.flow import ode_step
from omni_rl.errors import OmniRLError
from omni_rl.models.pi0 import Pi0Backbone, build_tiny_pi0


@pytest.fixture(scope="module")
def tiny_pi0(tmp_path_factory):
    return build_tiny_pi0(tmp_path_factory.mktemp("pi0"), seed=0)


def observations(backbone: Pi0Backbone, batch: int = 3, seed: int = 0) -> dict:
    """Two cameras (the second missing in the last row), an instruction of 6 tokens
    (the last row's 4, right-padded), a state."""
    config = backbone.model.config
    generator = torch.Generator().manual_seed(seed)
    vision = config.vlm_config.vision_config
    per_image = (vision.image_size // vision.patch_size) ** 2
    image_id = config.vlm_config.image_token_id
    words = torch.randint(0, image_id, (batch, 6), generator=generator)
    input_ids = torch.cat([torch.full((batch, 2 * per_image), image_id), words], 1)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[-1, -2:] = 0
    cameras = torch.ones(batch, 2, dtype=torch.bool)
    cameras[-1, 1] = False
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "pixel_values": torch.randn(batch, 2, 3, vision.image_size, vision.image_size, generator=generator),
        "pixel_attention_mask": cameras,
        "state": torch.randn(batch, backbone.state_dim, generator=generator),
    }


def test_the_tiny_checkpoint_loads_and_repeats_by_seed(tiny_pi0, tmp_path):
    from safetensors.torch import load_file

    backbone = Pi0Backbone.from_pretrained(tiny_pi0)
    assert (backbone.chunk, backbone.action_dim, backbone.steps) == (8, 8, 4)
    again = build_tiny_pi0(tmp_path / "again", seed=0)
    first, second = load_file(tiny_pi0 / "model.safetensors"), load_file(again / "model.safetensors")
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


def test_the_cli_writes_a_tiny_pi0(tmp_path, capsys):
    from transformers import PI0ForConditionalGeneration

    from omni_rl.cli import main

    assert main(["tiny-model", "--family", "pi0", "--out", str(tmp_path), "--width", "32"]) == 0
    assert "wrote tiny pi0" in capsys.readouterr().out
    model = PI0ForConditionalGeneration.from_pretrained(tmp_path)
    assert model.config.vlm_config.text_config.hidden_size == 32


def test_the_ode_chain_over_one_prefix_equals_sample_actions(tiny_pi0):
    """Euler steps of ``velocity`` over a prefix encoded once give transformers'
    ``sample_actions`` on the same noise, and the prefix's cache is left as it was."""
    backbone = Pi0Backbone.from_pretrained(tiny_pi0).eval()
    obs = observations(backbone)
    state = obs.pop("state")
    noise = torch.randn(3, backbone.chunk, backbone.action_dim, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = backbone.model.sample_actions(state=state, noise=noise.clone(), **obs)
        prefix = backbone.encode_prefix(**obs)
        length = prefix.cache.get_seq_length()
        x, delta = noise, 1.0 / backbone.steps
        for step in range(backbone.steps):
            t = torch.full((3,), 1.0 - step * delta)
            v, tokens = backbone.velocity(prefix, state, x, t)
            assert tokens.shape == (3, backbone.chunk, backbone.feature_dim)
            assert prefix.cache.get_seq_length() == length
            x = ode_step(x, v, delta)
    torch.testing.assert_close(x, want, atol=1e-5, rtol=1e-5)


def test_the_vlm_runs_once_per_observation_and_only_the_expert_learns(tiny_pi0):
    backbone = Pi0Backbone.from_pretrained(tiny_pi0)
    backbone.freeze_vlm()
    obs = observations(backbone)
    state = obs.pop("state")
    calls = []
    hook = backbone.model.model.vlm.register_forward_hook(lambda *_: calls.append(1))
    prefix = backbone.encode_prefix(**obs)
    x = torch.randn(3, backbone.chunk, backbone.action_dim)
    loss = 0
    for t in (1.0, 0.75, 0.5, 0.25):
        v, _ = backbone.velocity(prefix, state, x, torch.full((3,), t))
        loss = loss + v.square().mean()
    loss.backward()
    hook.remove()
    assert len(calls) == 1
    learned = {name for name, p in backbone.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert learned and not any(".vlm." in name for name in learned)
    assert any(".dit." in name for name in learned) and "model.action_out_proj.weight" in learned


def test_cameras_that_do_not_match_their_mask_are_refused(tiny_pi0):
    backbone = Pi0Backbone.from_pretrained(tiny_pi0)
    obs = observations(backbone)
    obs.pop("state")
    obs["pixel_attention_mask"] = obs["pixel_attention_mask"][:, :1]
    with pytest.raises(OmniRLError, match="pixel_attention_mask"):
        backbone.encode_prefix(**obs)
