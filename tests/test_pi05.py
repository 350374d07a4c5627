"""pi_0.5 as a flow policy's backbone (``omni_rl.models.pi05``): the tiny checkpoint,
the state written into the prompt as PI05's processor writes it, the chain and the
cloning loss against transformers' own ``sample_actions`` and loss, one VLM pass per
observation, and the critic on the VLM's features."""

from __future__ import annotations

import pytest
import torch
from vla_checks import (
    assert_bc_loss_is_the_models_loss,
    assert_zeroed_noise_samples_the_models_actions,
    sample_and_score_counting_vlm_passes,
)

from omni_rl.errors import OmniRLError
from omni_rl.models.flow_policy import FlowPolicy
from omni_rl.models.pi05 import Pi05Backbone, build_tiny_pi05, pi05_inputs

INSTRUCTIONS = ["go to the red target", "go to the blue target", "stay"]


@pytest.fixture(scope="module")
def tiny_pi05(tmp_path_factory):
    return build_tiny_pi05(tmp_path_factory.mktemp("pi05"), seed=0)


@pytest.fixture(scope="module")
def processor(tiny_pi05):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(tiny_pi05)


def pi05_policy(tiny_pi05, processor, env_action_dim=None, **fields):
    from omni_rl.config import build_section
    from omni_rl.models.flow_policy_config import FlowPolicyConfig

    fields = {"type": "pi05", "horizon": 8, "executed": 5, "width": 32, **fields}
    config = build_section(FlowPolicyConfig, fields, "policy")
    backbone = Pi05Backbone.from_pretrained(tiny_pi05, processor, env_action_dim=env_action_dim)
    backbone.train_vlm(False)
    return FlowPolicy(config, backbone)


def observations(processor, seed: int = 0):
    """Three envs' camera images, instructions of three lengths, states in [-1, 1]."""
    generator = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (3, 3, 32, 32), dtype=torch.uint8, generator=generator)
    state = torch.rand(3, 2, generator=generator) * 2 - 1
    return pi05_inputs(processor, images, INSTRUCTIONS, state)


def test_the_tiny_checkpoint_loads_and_the_cli_writes_it(tiny_pi05, tmp_path, capsys):
    from transformers import PI05ForConditionalGeneration

    from omni_rl.cli import main

    again = build_tiny_pi05(tmp_path / "again", seed=0)
    ours, theirs = (PI05ForConditionalGeneration.from_pretrained(p).state_dict() for p in (tiny_pi05, again))
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert main(["tiny-model", "--family", "pi05", "--out", str(tmp_path / "cli"), "--width", "32"]) == 0
    assert "wrote tiny pi05" in capsys.readouterr().out
    model = PI05ForConditionalGeneration.from_pretrained(tmp_path / "cli")
    assert model.config.vlm_config.text_config.hidden_size == 32


@pytest.mark.parametrize(
    "stats",
    [
        {"state_mean": [0.1, -0.2], "state_std": [0.5, 2.0]},
        {"state_q01": [-0.8, -1.5], "state_q99": [0.9, 1.5], "state_mean": [5.0, 5.0], "state_std": [9.0, 9.0]},
    ],
    ids=["mean_std", "quantiles"],
)
def test_the_state_goes_into_the_prompt_as_pi05s_processor_writes_it(tiny_pi05, processor, stats):
    """With state statistics (PI05Processor refuses a state without them), mean and std
    or quantiles (which it prefers where it has both), ``pi05_inputs`` gives what the
    processor's own call gives: the prompt with the discretized state, the images, the
    masks."""
    from transformers import AutoProcessor

    stats = AutoProcessor.from_pretrained(tiny_pi05, **stats)
    generator = torch.Generator().manual_seed(1)
    images = torch.randint(0, 256, (3, 3, 32, 32), dtype=torch.uint8, generator=generator)
    state = torch.rand(3, 2, generator=generator) * 2 - 1
    ours = pi05_inputs(stats, images, INSTRUCTIONS, state)
    theirs = stats(images=[[image] for image in images], text=INSTRUCTIONS, state=state, padding="longest")
    assert "State: " in stats.tokenizer.decode(ours.input_ids[0])
    for name in ("input_ids", "attention_mask", "pixel_values", "pixel_attention_mask"):
        torch.testing.assert_close(getattr(ours, name), theirs[name], atol=0, rtol=0)
    moved = pi05_inputs(stats, images, INSTRUCTIONS, state + 0.5)
    assert not torch.equal(moved.input_ids, ours.input_ids)  # the model sees the state


def test_quantile_statistics_normalize_as_pi05s_processor_does_and_back(tiny_pi05):
    """Quantiles map [q01, q99] to [-1, 1] (``PI05Processor.normalize``, a zero range
    divided by 1e-8), and ``unnormalize`` takes the model's actions back; half a pair
    is refused."""
    from transformers import AutoProcessor

    from omni_rl.models.pi0 import normalize, unnormalize

    q01, q99 = [-1.0, 0.5, 2.0], [3.0, 0.5, 4.0]
    quantiles = AutoProcessor.from_pretrained(tiny_pi05, actions_q01=q01, actions_q99=q99)
    actions = torch.randn(4, 8, 3, generator=torch.Generator().manual_seed(5)) * 3
    ours = normalize(quantiles, "actions", actions)
    torch.testing.assert_close(ours, quantiles.normalize(actions, "actions"), atol=0, rtol=0)
    back = unnormalize(quantiles, "actions", ours)
    torch.testing.assert_close(back[..., [0, 2]], actions[..., [0, 2]])
    half = AutoProcessor.from_pretrained(tiny_pi05, actions_q01=q01)
    with pytest.raises(OmniRLError, match="actions_q01 and actions_q99 go together"):
        normalize(half, "actions", actions)


def test_long_prompts_are_refused(tiny_pi05):
    from transformers import AutoProcessor

    images = torch.zeros(1, 3, 32, 32, dtype=torch.uint8)
    plain = AutoProcessor.from_pretrained(tiny_pi05)
    with pytest.raises(OmniRLError, match=r"env 0's prompt .* tokens besides the image's, over the limit of 30"):
        pi05_inputs(plain, images, ["go to the red target"], torch.zeros(1, 2), max_tokens=30)


@pytest.mark.parametrize("method", ["flow_noise", "flow_sde"])
def test_the_policy_with_its_noise_zeroed_samples_pi05s_own_actions(tiny_pi05, processor, method):
    """pi_0.5 takes the state in the prompt: its model's calls take the prefix alone."""
    policy = pi05_policy(tiny_pi05, processor, method=method).eval()
    assert_zeroed_noise_samples_the_models_actions(policy, observations(processor), method, {})


def test_the_bc_loss_is_pi05s_own_flow_matching_loss(tiny_pi05, processor):
    assert_bc_loss_is_the_models_loss(pi05_policy(tiny_pi05, processor), observations(processor), {})


def test_one_vlm_pass_per_observation_in_sampling_and_scoring(tiny_pi05, processor):
    """Sampling and PPO's scoring each run the VLM once over the batch, whatever the
    number of denoising steps; the chain scores as it was drawn, and the gradient of
    the chain's log-likelihood reaches the expert, not the frozen VLM."""
    policy = pi05_policy(tiny_pi05, processor).train()
    drawn, (logp, entropy, value) = sample_and_score_counting_vlm_passes(policy, observations(processor), 3)
    torch.testing.assert_close(logp, drawn.logp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(value, drawn.value)
    (logp.sum() + entropy.sum()).backward()
    learned = {n for n, p in policy.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert any(".dit." in n for n in learned) and "noise_net.0.weight" in learned
    assert not any(".vlm." in n for n in learned)


def test_the_critic_on_features_reads_the_vlms_prefix_detached(tiny_pi05, processor):
    """pi_RL's critic for pi_0.5: the masked mean of the VLM's last hidden states over
    each observation's prompt (padding excluded), detached: its gradient reaches the
    value head alone, even with the VLM training."""
    policy = pi05_policy(tiny_pi05, processor, value_input="features")
    policy.backbone.train_vlm(True)
    obs = observations(processor)
    assert obs.attention_mask.sum(-1).unique().numel() == 3  # three prompt lengths
    core = policy.backbone.model.model
    hidden = core.vlm(
        inputs_embeds=core.embed_prefix(obs.input_ids, obs.pixel_values, obs.pixel_attention_mask),
        attention_mask=obs.attention_mask,
        position_ids=obs.attention_mask.cumsum(-1) - 1,
        token_type_ids=torch.zeros_like(obs.input_ids),
    ).last_hidden_state
    want = torch.stack([h[m.bool()].mean(0) for h, m in zip(hidden, obs.attention_mask, strict=True)])
    value = policy.value(obs, policy.backbone.encode(obs))
    torch.testing.assert_close(value, policy.value_head(want).squeeze(-1), atol=1e-5, rtol=1e-5)
    value.sum().backward()
    assert all(p.grad is None for p in policy.backbone.parameters())
    assert all(p.grad is not None for p in policy.value_head.parameters())


def test_a_saved_policy_loads_on_its_backbone_and_samples_the_same(tiny_pi05, processor, tmp_path):
    policy = pi05_policy(tiny_pi05, processor, env_action_dim=2).eval()
    obs = observations(processor)
    policy.save_pretrained(tmp_path / "policy")
    again = FlowPolicy.from_pretrained(tmp_path / "policy").eval()
    assert type(again.backbone) is Pi05Backbone and again.env_action_dim == 2
    noise = policy.noise(3, torch.Generator().manual_seed(6))
    sampled = policy.sample(obs, noise=noise).actions
    assert sampled.shape == (3, 8, 2)
    torch.testing.assert_close(again.sample(obs, noise=noise).actions, sampled)
