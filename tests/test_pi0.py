"""pi_0 as a flow policy's backbone (``omni_rl.models.pi0``): the tiny checkpoint, the
prefix encoded once per observation, and the velocity field against transformers' own
``sample_actions``."""

from __future__ import annotations

import math
import os

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
        "state": torch.randn(batch, backbone.model.config.max_state_dim, generator=generator),
    }


def test_the_tiny_checkpoint_loads_and_repeats_by_seed(tiny_pi0, tmp_path):
    from safetensors.torch import load_file

    backbone = Pi0Backbone.from_pretrained(tiny_pi0)
    assert (backbone.horizon, backbone.action_dim, backbone.steps) == (8, 8, 4)
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


@pytest.mark.parametrize("chunk", [None, 5])
def test_the_ode_chain_over_one_prefix_equals_sample_actions(tiny_pi0, chunk):
    """Euler steps of ``velocity`` over a prefix encoded once give transformers'
    ``sample_actions`` on the same noise, and the prefix's cache is left as it was; also
    with the checkpoint loaded for a chunk of another length (as ``policy.horizon`` does)."""
    backbone = Pi0Backbone.from_pretrained(tiny_pi0, **({} if chunk is None else {"chunk_size": chunk})).eval()
    assert backbone.horizon == (chunk or 8)
    obs = observations(backbone)
    state = obs.pop("state")
    noise = torch.randn(3, backbone.horizon, backbone.action_dim, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = backbone.model.sample_actions(state=state, noise=noise.clone(), **obs)
        prefix = backbone.encode_prefix(**obs)
        length = prefix.cache.get_seq_length()
        x, delta = noise, 1.0 / backbone.steps
        for step in range(backbone.steps):
            t = torch.full((3,), 1.0 - step * delta)
            v, tokens = backbone.expert(prefix, state, x, t)
            assert tokens.shape == (3, backbone.horizon, backbone.feature_dim)
            assert prefix.cache.get_seq_length() == length
            x = ode_step(x, v, delta)
    torch.testing.assert_close(x, want, atol=1e-5, rtol=1e-5)


def test_the_vlm_runs_once_per_observation_and_only_the_expert_learns(tiny_pi0):
    backbone = Pi0Backbone.from_pretrained(tiny_pi0)
    backbone.train_vlm(False)
    obs = observations(backbone)
    state = obs.pop("state")
    calls = []
    hook = backbone.model.model.vlm.register_forward_hook(lambda *_: calls.append(1))
    prefix = backbone.encode_prefix(**obs)
    x = torch.randn(3, backbone.horizon, backbone.action_dim)
    loss = 0
    for t in (1.0, 0.75, 0.5, 0.25):
        v, _ = backbone.expert(prefix, state, x, torch.full((3,), t))
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


def pi0_policy(tiny_pi0, env_action_dim=None, processor=None, layout=None, privileged_dim=0, **fields):
    from omni_rl.config import build_section
    from omni_rl.models.flow_policy import FlowPolicy
    from omni_rl.models.flow_policy_config import FlowPolicyConfig

    config = build_section(FlowPolicyConfig, {"horizon": 8, "executed": 5, "width": 32, **fields}, "policy")
    backbone = Pi0Backbone.from_pretrained(tiny_pi0, processor, layout, env_action_dim, privileged_dim)
    backbone.train_vlm(False)
    return FlowPolicy(config, backbone)


def pi0_observations(policy, batch: int = 3, seed: int = 0):
    from omni_rl.models.pi0 import Pi0Observation

    return Pi0Observation(**observations(policy.backbone, batch, seed))


@pytest.mark.parametrize("method", ["flow_noise", "flow_sde"])
def test_the_policy_with_its_noise_zeroed_samples_pi0s_own_actions(tiny_pi0, method):
    """``vla_checks``; pi_0's model takes the state beside the prefix."""
    from vla_checks import assert_zeroed_noise_samples_the_models_actions

    policy = pi0_policy(tiny_pi0, method=method).eval()
    obs = pi0_observations(policy)
    assert_zeroed_noise_samples_the_models_actions(policy, obs, method, {"state": obs.state})


def test_the_chain_logprob_is_the_hand_computed_one_and_scoring_repeats_sampling(tiny_pi0):
    from omni_rl.algorithms.flow import bounded_std

    policy = pi0_policy(tiny_pi0, method="flow_noise").eval()
    obs = pi0_observations(policy)
    drawn = policy.sample(obs, generator=torch.Generator().manual_seed(3))
    assert drawn.stochastic.all()
    with torch.no_grad():
        logp, entropy, value = policy.chain_logprob_value(obs, drawn.chain, drawn.stochastic)
        prefix = policy.backbone.encode_prefix(
            obs.input_ids, obs.attention_mask, obs.pixel_values, obs.pixel_attention_mask
        )
        hand = -0.5 * drawn.chain[:, 0] ** 2 - 0.5 * math.log(2 * math.pi)
        for k in range(policy.steps):
            x, t = drawn.chain[:, k], torch.full((3,), 1.0 - k / policy.steps)
            v, tokens = policy.backbone.expert(prefix, obs.state, x, t)
            mean, std = x - v / policy.steps, bounded_std(policy.noise_net(tokens), 0.08, 0.16)
            hand += -0.5 * ((drawn.chain[:, k + 1] - mean) / std) ** 2 - std.log() - 0.5 * math.log(2 * math.pi)
    torch.testing.assert_close(logp, hand, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(drawn.logp, logp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(drawn.value, value)
    torch.testing.assert_close(policy.value_of(obs), value)  # the critic does not read the chain's noise
    assert entropy.shape == (3,) and (entropy > -2).all()


def test_a_ppo_forwards_graph_is_freed_by_its_backward(tiny_pi0):
    """Every tensor a PPO forward saves for backward is released by the backward (the
    critic's pass over the expert runs without a graph: its graph, never backpropagated,
    stayed alive with the prefix's cache until the update ended)."""
    import gc
    import weakref

    policy = pi0_policy(tiny_pi0, method="flow_noise").train()
    obs = pi0_observations(policy)
    drawn = policy.sample(obs, generator=torch.Generator().manual_seed(3))

    class Saved:
        def __init__(self, tensor):
            self.tensor = tensor

    alive = weakref.WeakSet()

    def pack(tensor):
        saved = Saved(tensor)
        alive.add(saved)
        return saved

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda saved: saved.tensor):
        logp, entropy, value = policy.chain_logprob_value(obs, drawn.chain, drawn.stochastic)
        assert len(alive) > 0
        (logp.sum() + entropy.sum() + value.sum()).backward()
    del logp, entropy, value
    gc.collect()
    assert len(alive) == 0


@pytest.mark.parametrize("train", [True, False])
def test_the_critic_without_a_graph_gives_the_detached_critics_values_and_gradients(tiny_pi0, train):
    """The critic's expert pass under no_grad against the same pass with a graph and its
    features detached, on a mixed batch (instructions of two lengths, a missing camera):
    the same values, the same gradients in the value head, none in the expert."""
    policy = pi0_policy(tiny_pi0, method="flow_noise").train(train)
    obs = pi0_observations(policy)
    features = policy.backbone.encode(obs)
    value = policy.value(obs, features)
    value.square().sum().backward()
    grads = [p.grad.clone() for p in policy.value_head.parameters()]
    assert all(p.grad is None for p in policy.backbone.parameters())
    policy.zero_grad(set_to_none=True)

    still = torch.zeros(len(obs), policy.horizon, policy.action_dim)
    _, tokens = policy.backbone.expert(features.prefix, features.state, still, torch.ones(len(obs)))
    plain = policy.value_head(tokens.mean(1).detach()).squeeze(-1)
    plain.square().sum().backward()
    torch.testing.assert_close(value, plain, atol=0, rtol=0)
    for got, want in zip(grads, (p.grad for p in policy.value_head.parameters()), strict=True):
        torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_the_bc_loss_is_pi0s_own_flow_matching_loss(tiny_pi0):
    from vla_checks import assert_bc_loss_is_the_models_loss

    policy = pi0_policy(tiny_pi0)
    obs = pi0_observations(policy)
    assert_bc_loss_is_the_models_loss(policy, obs, {"state": obs.state})


def test_the_bc_loss_on_fewer_env_numbers_is_pi0s_own_loss_over_them(tiny_pi0):
    """An env of 3 numbers on the checkpoint's 8: PI0's own loss on the actions
    zero-padded, the noise over all 8 numbers (as its forward, openpi and lerobot draw
    it, and as sampling starts them), averaged over the env's 3 numbers of the real
    steps (the last chunk cut by its episode's end)."""
    policy = pi0_policy(tiny_pi0, env_action_dim=3)
    obs = pi0_observations(policy)
    generator = torch.Generator().manual_seed(4)
    actions = torch.randn(3, 8, 3, generator=generator)
    eps, t = torch.randn(3, 8, 8, generator=generator), torch.rand(3, generator=generator)
    mask = torch.ones(3, 8)
    mask[-1, 5:] = 0
    ours = policy.bc_loss(obs, actions, mask, t, eps)
    policy.backbone.model.config.loss_reduction = "none"
    per_element = policy.backbone.model(
        state=obs.state,
        noise=eps,
        timestep=t,
        actions=torch.nn.functional.pad(actions, (0, 5)),
        input_ids=obs.input_ids,
        attention_mask=obs.attention_mask,
        pixel_values=obs.pixel_values,
        pixel_attention_mask=obs.pixel_attention_mask,
    ).loss
    assert per_element.shape == (3, 8, 8)
    want = (per_element[..., :3] * mask[:, :, None]).sum() / (3 * mask.sum())
    torch.testing.assert_close(ours, want, atol=1e-6, rtol=1e-5)


def test_cloning_trains_the_input_columns_of_the_padded_numbers(tiny_pi0):
    """Sampling starts every number of a chunk from N(0, 1), the checkpoint's padding
    past the env's 2 included: behaviour cloning (``flow_ppo.cloning_loss``) noises
    them too, so the action input projection's columns for them get gradient at every
    step (with their noise at zero they got none, and their random weights moved the
    env's velocity)."""
    from transformers import AutoProcessor

    from omni_rl.engine.config import AdamWConfig
    from omni_rl.engine.engine import TrainingEngine
    from omni_rl.recipes.flow_ppo import Demos, cloning_loss
    from omni_rl.sim.pixel_targets import layout

    processor = AutoProcessor.from_pretrained(tiny_pi0)
    policy = pi0_policy(tiny_pi0, env_action_dim=2, processor=processor, layout=layout())
    generator = torch.Generator().manual_seed(7)
    obs = torch.randint(0, 256, (6, policy.backbone.layout.size), generator=generator).float()
    obs[:, 3 * policy.backbone.layout.image_size**2] = torch.tensor([0.0, 1.0]).repeat(3)  # instruction indices
    demos = Demos(obs, torch.randn(6, 8, 2, generator=generator), torch.ones(6, 8))
    engine = TrainingEngine(
        policy,
        AdamWConfig(lr=1e-3),
        torch.device("cpu"),
        total_steps=3,
        precision="fp32",
        param_groups=lambda model: [{"params": model.actor_parameters()}],
    )
    weight = policy.backbone.model.embed_action_time.action_in_proj.weight  # [width, 8]
    start = weight.detach().clone()
    for _ in range(3):
        engine.backward(cloning_loss(engine, demos, 4, generator))
        assert weight.grad[:, :2].abs().sum() > 0 and weight.grad[:, 2:].abs().sum() > 0
        engine.step()
    assert (weight.detach() - start)[:, 2:].abs().min() > 0


def with_action_statistics(tiny_pi0, mean, std):
    """The tiny checkpoint's processor carrying action statistics (its own has none)."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(tiny_pi0)
    processor.actions_mean, processor.actions_std = mean, std
    return processor


def test_actions_normalize_by_the_processors_statistics_and_back(tiny_pi0):
    """mean [0.5, -1], std [2, 0.25]: the action (1.5, -0.5) is (1 / 2, 0.5 / 0.25) =
    (0.5, 2) in pi_0's units (``PI0Processor.normalize``'s rule), and back; without
    statistics (or a processor) actions pass as they are; statistics of another size
    than the env's actions are refused, naming both."""
    from omni_rl.models.pi0 import normalize, unnormalize

    processor = with_action_statistics(tiny_pi0, [0.5, -1.0], [2.0, 0.25])
    actions = torch.tensor([[1.5, -0.5], [0.5, -1.0]])
    normalized = normalize(processor, "actions", actions)
    torch.testing.assert_close(normalized, torch.tensor([[0.5, 2.0], [0.0, 0.0]]))
    torch.testing.assert_close(normalized, processor.normalize(actions, "actions"))
    torch.testing.assert_close(unnormalize(processor, "actions", normalized), actions)
    chunks = torch.randn(3, 8, 2, generator=torch.Generator().manual_seed(8))
    torch.testing.assert_close(unnormalize(processor, "actions", normalize(processor, "actions", chunks)), chunks)
    for plain in (None, with_action_statistics(tiny_pi0, None, None)):
        assert normalize(plain, "actions", chunks) is chunks and unnormalize(plain, "actions", chunks) is chunks
    with pytest.raises(OmniRLError, match=r"3 numbers .* 2 action numbers"):
        normalize(with_action_statistics(tiny_pi0, [0.0] * 3, [1.0] * 3), "actions", chunks)
    with pytest.raises(OmniRLError, match=r"3 numbers .* 2 action numbers"):
        pi0_policy(tiny_pi0, env_action_dim=2, processor=with_action_statistics(tiny_pi0, [0.0] * 3, [1.0] * 3))


def test_the_state_is_normalized_on_its_own_device_before_padding(tiny_pi0):
    """State statistics apply to the env's numbers, then the state is zero-padded; the
    statistics follow the values' device (PI0Processor's own ``normalize`` makes CPU
    tensors, which a CUDA state would refuse): a state on the meta device stays there."""
    from transformers import AutoProcessor

    from omni_rl.models.pi0 import normalize, pi0_inputs

    processor = AutoProcessor.from_pretrained(tiny_pi0)
    processor.state_mean, processor.state_std = [1.0, -2.0, 0.0], [0.5, 4.0, 1.0]
    images = torch.zeros(2, 3, 32, 32, dtype=torch.uint8)
    state = torch.tensor([[2.0, 2.0, 3.0], [1.0, -2.0, -1.0]])
    inputs = pi0_inputs(processor, images, ["go left", "go right"], state)
    expected = torch.tensor([[2.0, 1.0, 3.0], [0.0, 0.0, -1.0]])
    torch.testing.assert_close(inputs.state[:, :3], expected)
    assert inputs.state.shape[1] == processor.max_state_dim and (inputs.state[:, 3:] == 0).all()
    assert normalize(processor, "state", state.to("meta")).device.type == "meta"
    with pytest.raises(OmniRLError, match=r"3 numbers .* 2 state numbers"):
        normalize(processor, "state", state[:, :2])


def test_a_policy_clones_normalized_actions_and_drives_the_env_unnormalized(tiny_pi0):
    """A processor with action statistics: the cloning loss on env actions is a plain
    policy's on the actions normalized by hand, and the sampled actions are a plain
    policy's (the same weights and draws) unnormalized by hand; the chain stays in
    pi_0's units."""
    mean, std = torch.tensor([0.5, -1.0]), torch.tensor([2.0, 0.25])
    processor = with_action_statistics(tiny_pi0, mean.tolist(), std.tolist())
    scaled, plain = pi0_policy(tiny_pi0, env_action_dim=2, processor=processor), pi0_policy(tiny_pi0, env_action_dim=2)
    plain.load_state_dict(scaled.state_dict())
    obs = pi0_observations(scaled)
    generator = torch.Generator().manual_seed(9)
    actions = mean + std * torch.randn(3, 8, 2, generator=generator)
    eps, t = torch.randn(3, 8, 8, generator=generator), torch.rand(3, generator=generator)
    mask = torch.ones(3, 8)
    ours = scaled.bc_loss(obs, actions, mask, t, eps)
    torch.testing.assert_close(ours, plain.bc_loss(obs, (actions - mean) / (std + 1e-8), mask, t, eps))
    scaled.eval(), plain.eval()
    drawn = scaled.sample(obs, generator=torch.Generator().manual_seed(10))
    want = plain.sample(obs, generator=torch.Generator().manual_seed(10))
    torch.testing.assert_close(drawn.chain, want.chain)
    torch.testing.assert_close(drawn.actions, want.actions * (std + 1e-8) + mean)
    assert (drawn.actions - want.actions).abs().max() > 0.1


def test_one_prefix_per_observation_in_sampling_and_scoring(tiny_pi0):
    from vla_checks import sample_and_score_counting_vlm_passes

    policy = pi0_policy(tiny_pi0, method="flow_sde", sde_mode="chain")
    _, (logp, _, value) = sample_and_score_counting_vlm_passes(policy, pi0_observations(policy), 5)
    (logp.sum() + value.sum()).backward()
    trained = {name for name, p in policy.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert not any(".vlm." in name for name in trained) and any(".dit." in name for name in trained)
    assert any(name.startswith("value_head.") for name in trained)


def test_a_saved_policy_loads_and_samples_the_same(tiny_pi0, tmp_path):
    from omni_rl.models.flow_policy import FlowPolicy

    policy = pi0_policy(tiny_pi0).eval()
    obs = pi0_observations(policy)
    policy.save_pretrained(tmp_path / "policy")
    again = FlowPolicy.from_pretrained(tmp_path / "policy").eval()
    noise = policy.noise(3, torch.Generator().manual_seed(6))
    torch.testing.assert_close(again.sample(obs, noise=noise).actions, policy.sample(obs, noise=noise).actions)


def test_a_saved_policy_loads_as_the_type_it_was_saved_as(tiny_pi0, tmp_path):
    """``FlowPolicy.from_pretrained`` reads the type the checkpoint was saved as: a pi0
    checkpoint comes back on a ``Pi0Backbone`` and samples what the saved one did, a
    state-MLP checkpoint on a ``StateBackbone``; a checkpoint of an unknown type, or
    whose weights are another type's, says what it holds."""
    import json

    from omni_rl.errors import OmniRLError
    from omni_rl.models.flow_policy import FlowPolicy, StateBackbone
    from omni_rl.models.flow_policy_config import FlowPolicyConfig

    policy = pi0_policy(tiny_pi0).eval()
    obs = pi0_observations(policy)
    policy.save_pretrained(tmp_path / "pi0")
    again = FlowPolicy.from_pretrained(tmp_path / "pi0").eval()
    assert type(again.backbone) is Pi0Backbone
    noise = policy.noise(3, torch.Generator().manual_seed(6))
    torch.testing.assert_close(again.sample(obs, noise=noise).actions, policy.sample(obs, noise=noise).actions)
    config = FlowPolicyConfig(horizon=4, executed=2)
    FlowPolicy(config, StateBackbone(config, obs_dim=5, action_dim=3)).save_pretrained(tmp_path / "mlp")
    assert type(FlowPolicy.from_pretrained(tmp_path / "mlp").backbone) is StateBackbone
    (tmp_path / "mlp" / "policy.safetensors").write_bytes((tmp_path / "pi0" / "policy.safetensors").read_bytes())
    with pytest.raises(OmniRLError, match=r"policy.safetensors does not match a mlp policy"):
        FlowPolicy.from_pretrained(tmp_path / "mlp")
    spec = json.loads((tmp_path / "mlp" / "policy.json").read_text())
    spec["type"] = "pi07"
    (tmp_path / "mlp" / "policy.json").write_text(json.dumps(spec))
    with pytest.raises(OmniRLError, match=r"policy type 'pi07' is not one of \['mlp', 'pi0', 'pi05'\]"):
        FlowPolicy.from_pretrained(tmp_path / "mlp")


def test_vlm_adapters_train_in_the_vlms_place_and_export_merged(tiny_pi0, tmp_path):
    """``policy.vlm_lora``: where the VLM trains only its language model's adapters do
    (the expert always); the exported checkpoint, the adapters merged into plain
    weights, loads without peft and samples what the adapted policy samples."""
    from omni_rl.models.flow_policy import FlowPolicy

    lora = {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    policy = pi0_policy(tiny_pi0, type="pi0", train_vlm="bc", vlm_lora=lora)
    policy.backbone.add_vlm_lora(policy.config.vlm_lora)
    policy.backbone.train_vlm(True)
    vlm = {name for name, p in policy.backbone.model.model.vlm.named_parameters() if p.requires_grad}
    assert vlm and all("language_model" in name and ".lora_" in name for name in vlm)
    assert {name.split(".")[-4] for name in vlm} == {"q_proj", "v_proj"}  # X.lora_A.default.weight
    assert any(p.requires_grad for p in policy.backbone.model.model.dit.parameters())
    policy.backbone.train_vlm(False)
    assert not any(p.requires_grad for p in policy.backbone.model.model.vlm.parameters())
    with torch.no_grad():  # B starts at zero: move it so the adapters change the outputs
        for name, p in policy.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(len(name)))
    policy.eval()
    obs = pi0_observations(policy)
    noise = policy.noise(3, torch.Generator().manual_seed(6))
    adapted = policy.sample(obs, noise=noise).actions
    policy.save_pretrained(tmp_path / "policy")
    again = FlowPolicy.from_pretrained(tmp_path / "policy").eval()
    assert not any(".lora_" in name for name, _ in again.named_parameters())
    torch.testing.assert_close(again.sample(obs, noise=noise).actions, adapted, atol=1e-5, rtol=1e-5)
    plain = pi0_policy(tiny_pi0).eval()
    plain.load_state_dict({k: v for k, v in again.state_dict().items() if not k.startswith("backbone.")}, strict=False)
    assert (plain.sample(obs, noise=noise).actions - adapted).abs().max() > 1e-3  # the adapters mattered


def test_vlm_adapters_need_a_pi0_vlm_that_trains():
    from omni_rl.config import build_section
    from omni_rl.errors import ConfigError
    from omni_rl.models.flow_policy_config import FlowPolicyConfig

    with pytest.raises(ConfigError, match="vlm_lora: does nothing under type: mlp"):
        build_section(FlowPolicyConfig, {"vlm_lora": {"rank": 4}}, "policy")
    with pytest.raises(ConfigError, match="vlm_lora: does nothing under train_vlm: never"):
        build_section(FlowPolicyConfig, {"type": "pi0", "train_vlm": "never", "vlm_lora": {"rank": 4}}, "policy")


def test_a_horizon_other_than_the_checkpoints_chunk_is_refused(tiny_pi0):
    with pytest.raises(OmniRLError, match="chunk_size"):
        pi0_policy(tiny_pi0, horizon=4, executed=4)


def test_a_critic_on_a_privileged_state_reads_it_and_needs_its_size(tiny_pi0):
    from omni_rl.config import build_section
    from omni_rl.models.flow_policy import FlowPolicy
    from omni_rl.models.flow_policy_config import FlowPolicyConfig

    config = build_section(FlowPolicyConfig, {"horizon": 8, "width": 32, "value_input": "obs"}, "policy")
    with pytest.raises(OmniRLError, match="privileged"):
        FlowPolicy(config, Pi0Backbone.from_pretrained(tiny_pi0))
    policy = FlowPolicy(config, Pi0Backbone.from_pretrained(tiny_pi0, privileged_dim=5))
    obs = pi0_observations(policy)
    obs.privileged = torch.randn(3, 5)
    torch.testing.assert_close(policy.value_of(obs), policy.value_head(obs.privileged).squeeze(-1).detach())


def test_the_tiny_processor_turns_env_observations_into_a_policys_inputs(tiny_pi0):
    from transformers import AutoProcessor

    from omni_rl.models.pi0 import pi0_inputs
    from omni_rl.sim.pixel_targets import PixelTargetsEnv

    processor = AutoProcessor.from_pretrained(tiny_pi0)
    env = PixelTargetsEnv(4, seed=0)
    env.reset()
    obs = env.observe()
    inputs = pi0_inputs(processor, obs.images, obs.instructions, obs.state)
    assert inputs.pixel_values.shape == (4, 1, 3, 32, 32) and inputs.pixel_attention_mask.all()
    assert inputs.state.shape == (4, 8) and torch.equal(inputs.state[:, :2], obs.state)
    assert (inputs.input_ids == processor.image_token_id).sum(-1).tolist() == [16] * 4
    for i in range(4):
        real = inputs.input_ids[i][inputs.attention_mask[i].bool()]
        assert processor.tokenizer.decode(real[16:]) == f"<bos>{obs.instructions[i]}\n"
    policy = pi0_policy(tiny_pi0)
    drawn = policy.sample(inputs, generator=torch.Generator().manual_seed(0))
    assert drawn.actions.shape == (4, 8, 8)
    env.step(drawn.actions[:, 0, :2])  # an action's first two numbers drive the point


def test_bad_observations_are_refused_with_the_reason(tiny_pi0):
    from transformers import AutoProcessor

    from omni_rl.models.pi0 import pi0_inputs

    processor = AutoProcessor.from_pretrained(tiny_pi0)
    images, state = torch.zeros(2, 3, 32, 32, dtype=torch.uint8), torch.zeros(2, 2)
    with pytest.raises(OmniRLError, match=r"env 1's instruction .* over the limit of 48"):
        pi0_inputs(processor, images, ["go left", "go " * 30], state)
    # the limit is the text's: 38 tokens of it beside the image's 16 pass
    inputs = pi0_inputs(processor, images, ["go left", "go " * 12], state)
    assert inputs.attention_mask.sum(-1).tolist() == [16 + 9, 16 + 38]
    with pytest.raises(OmniRLError, match="uint8"):
        pi0_inputs(processor, images.float(), ["a", "b"], state)
    with pytest.raises(OmniRLError, match="2 images, 1 instructions"):
        pi0_inputs(processor, images, ["a"], state)


@pytest.mark.slow
@pytest.mark.parametrize("train_vlm", ["bc", "never", "bc_lora"])
def test_flow_ppo_clones_and_trains_a_tiny_pi0_from_pixels_and_language(tiny_pi0, tmp_path, train_vlm):
    """``policy.type: pi0`` on PixelTargets-v0: scripted demos (images and instructions
    in flat observations), behaviour cloning, two Flow-Noise PPO iterations, held-out
    evaluation; the exported policy loads and samples as the trained one does. The VLM
    trains in behaviour cloning only (``train_vlm: bc``), or never, or its adapters do
    (``bc_lora``: the export merges them into the query and value projections)."""
    import json

    from safetensors.torch import load_file

    from omni_rl.models.config import LoRAConfig
    from omni_rl.models.flow_policy import FlowPolicy
    from omni_rl.recipe_loader import config_from_dict
    from omni_rl.recipes import flow_ppo
    from omni_rl.sim.experts import collect_demos

    lora = {"rank": 2, "alpha": 4, "target_modules": ["q_proj", "v_proj"]}
    demos = tmp_path / "demos.safetensors"
    collect_demos("PixelTargets-v0", 4, demos, num_envs=2)
    config = {
        "recipe": "flow_ppo",
        "run": {"output_dir": str(tmp_path / "run"), "seed": 0, "device": "cpu"},
        "env": {"task": "PixelTargets-v0", "num_envs": 4, "max_episode_steps": 10, "ignore_terminations": False},
        "policy": {"type": "pi0", "path": str(tiny_pi0), "horizon": 8, "executed": 5, "width": 32}
        | ({"train_vlm": "bc", "vlm_lora": lora} if train_vlm == "bc_lora" else {"train_vlm": train_vlm}),
        "bc": {"demos": str(demos), "steps": 3, "batch_size": 8},
        "ppo": {"epochs": 1, "minibatches": 2, "critic_warmup": 0},
        "trainer": {"steps": 2, "eval_every": 0, "eval_episodes": 4},
    }
    results = flow_ppo.train(config_from_dict(config, "test"))
    out = tmp_path / "run"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2] and {"loss/value", "env/success_once"} <= set(rows[-1])
    assert all(r["optim/actor_grad_norm"] > 0 and r["update/actor_updated"] == 1.0 for r in rows[1:])
    assert 0 <= results["success_bc"] <= 1 and 0 <= results["success_rl"] <= 1 and results["env_steps"] == 2 * 4 * 10
    bc = [json.loads(line) for line in (out / "bc" / "metrics.jsonl").read_text().splitlines()]
    assert bc[-1]["step"] == 3 and bc[-1]["bc/loss"] > 0
    start, trained = (load_file(path / "model.safetensors") for path in (tiny_pi0, out / "model" / "backbone"))
    moved = {k for k in start if (trained[k] - start[k]).abs().max() > 0}  # checkpoint names: the released ones
    assert any("gemma_expert." in k for k in moved)
    vlm_moved = {k for k in moved if "paligemma." in k}
    assert bool(vlm_moved) == (train_vlm != "never")
    if train_vlm == "bc_lora":
        assert all("language_model" in k and k.endswith(("q_proj.weight", "v_proj.weight")) for k in vlm_moved)
    policy = FlowPolicy.from_pretrained(out / "model").eval()
    adapted = Pi0Backbone.from_pretrained(tiny_pi0)
    adapted.add_vlm_lora(LoRAConfig(**lora))
    vlm = {
        "bc": sum(p.numel() for p in policy.backbone.model.model.vlm.parameters()),
        "never": 0,
        "bc_lora": sum(p.numel() for name, p in adapted.named_parameters() if ".lora_" in name),
    }[train_vlm]
    ppo_actor = results["trainable_parameters_ppo"] - sum(p.numel() for p in policy.critic_parameters())
    assert results["trainable_parameters_bc"] == ppo_actor + vlm  # PPO trains the critic too, never the VLM
    assert policy.env_action_dim == 2 and policy.backbone.layout.instructions[0] == "go to the red target"
    obs = torch.randint(0, 256, (2, policy.backbone.layout.size)).float()
    obs[:, 3 * 32 * 32] = torch.tensor([0.0, 1.0])  # the instruction indices
    assert policy.sample(obs, deterministic=True, start=torch.zeros(2, 8, 8)).actions.shape == (2, 8, 2)


def test_a_pi0_policy_on_a_state_vector_task_is_refused(tiny_pi0, tmp_path):
    from omni_rl.recipe_loader import config_from_dict
    from omni_rl.recipes import flow_ppo

    config = {
        "recipe": "flow_ppo",
        "run": {"output_dir": str(tmp_path / "run"), "device": "cpu"},
        "env": {"task": "PointMass-v0", "num_envs": 2},
        "policy": {"type": "pi0", "path": str(tiny_pi0), "horizon": 8, "executed": 5},
        "trainer": {"steps": 1},
    }
    with pytest.raises(OmniRLError, match="PointMass-v0 observes state vectors"):
        flow_ppo.train(config_from_dict(config, "test"))


def test_flow_ppo_needs_the_pi0_checkpoint_and_an_mlp_policy_has_no_vlm():
    from omni_rl.errors import ConfigError
    from omni_rl.recipe_loader import config_from_dict

    pi0 = {"recipe": "flow_ppo", "env": {"task": "PixelTargets-v0"}, "policy": {"type": "pi0", "horizon": 8}}
    with pytest.raises(ConfigError, match=r"policy\.path: name the pi0 checkpoint"):
        config_from_dict(pi0, "test")
    with pytest.raises(ConfigError, match="train_vlm"):
        config_from_dict({"recipe": "flow_ppo", "policy": {"train_vlm": "never"}}, "test")


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["pi0", "pi05"])
def test_two_processes_train_the_pi0_policy_one_process_trains(tiny_pi0, tmp_path, kind):
    """torchrun, 2 processes (gloo on CPU) under DDP and under FSDP2, each with half the
    envs: the same weights (heads, action expert, and the VLM that behaviour cloning
    trains) and metrics as one process; FSDP2's run saves its checkpoints too. pi_0 and
    pi_0.5 alike."""
    import itertools
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from safetensors.torch import load_file

    from omni_rl.config import save_config
    from omni_rl.models.pi05 import build_tiny_pi05
    from omni_rl.recipe_loader import config_from_dict
    from omni_rl.sim.experts import collect_demos

    checkpoint = tiny_pi0 if kind == "pi0" else build_tiny_pi05(tmp_path / "pi05", seed=0)
    demos = tmp_path / "demos.safetensors"
    collect_demos("PixelTargets-v0", 4, demos, num_envs=2)
    config = {
        "recipe": "flow_ppo",
        "run": {"seed": 0, "device": "cpu"},
        "env": {"task": "PixelTargets-v0", "num_envs": 4, "max_episode_steps": 10, "ignore_terminations": False},
        "policy": {"type": kind, "path": str(checkpoint), "horizon": 8, "executed": 5, "width": 32},
        "bc": {"demos": str(demos), "steps": 2, "batch_size": 8},
        "ppo": {"epochs": 1, "minibatches": 2},
        "trainer": {"steps": 2, "eval_every": 0, "eval_episodes": 4},
    }
    path = tmp_path / "config.yaml"
    save_config(config_from_dict(config, "test"), path)
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMNI_RL_THREADS": "1"}
    torchrun = [str(bin_dir / "torchrun"), "--standalone", "--nproc-per-node=2"]
    for name, launcher in (("one", [sys.executable]), ("ddp", torchrun), ("fsdp", torchrun)):
        command = [*launcher, "-m", "omni_rl", "train", str(path), "--set", f"run.output_dir={tmp_path / name}"]
        if name != "one":
            command += ["--set", f"trainer.strategy={name}"]
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "fsdp" / "checkpoints" / "step-00000002").is_dir()
    for part, strategy in itertools.product(("policy.safetensors", "backbone/model.safetensors"), ("ddp", "fsdp")):
        one, two = (load_file(tmp_path / name / "model" / part) for name in ("one", strategy))
        assert one.keys() == two.keys()
        gaps = {k: (one[k] - two[k]).abs().max().item() for k in one}
        # an attention key bias's gradient is zero in exact arithmetic (softmax ignores a
        # shift shared by every key), so what Adam steps on is rounding noise, scaled to
        # the learning rate (1e-3, 2 BC steps with the VLM training): bounded, not equal
        noise = {k for k in gaps if k.endswith("k_proj.bias")}
        assert max(v for k, v in gaps.items() if k not in noise) < 1e-5, (part, strategy)
        assert all(gaps[k] < 2 * 2e-3 for k in noise), (part, strategy)

    def rows(name):
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        return [{k: v for k, v in json.loads(x).items() if not k.startswith(("time/", "throughput/"))} for x in lines]

    for strategy in ("ddp", "fsdp"):
        for got, want in zip(rows(strategy), rows("one"), strict=True):
            assert got == pytest.approx(want, rel=1e-4, abs=1e-6), strategy


@pytest.mark.slow
def test_a_pi0_run_resumed_from_a_checkpoint_repeats_the_uninterrupted_one(tiny_pi0, tmp_path):
    """Behaviour cloning with the VLM training, then PPO over the frozen VLM, checkpoints
    every iteration; the run copied without its last checkpoint and resumed (``--resume
    auto``) logs the last iteration the uninterrupted run logged, and ends with its
    weights."""
    import json
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    from safetensors.torch import load_file

    from omni_rl.config import save_config
    from omni_rl.recipe_loader import config_from_dict
    from omni_rl.runtime import AVX2_KERNELS
    from omni_rl.sim.experts import collect_demos

    demos = tmp_path / "demos.safetensors"
    collect_demos("PixelTargets-v0", 4, demos, num_envs=2)
    config = {
        "recipe": "flow_ppo",
        "run": {"seed": 0, "device": "cpu", "output_dir": str(tmp_path / "a")},
        "env": {"task": "PixelTargets-v0", "num_envs": 4, "max_episode_steps": 10, "ignore_terminations": False},
        "policy": {"type": "pi0", "path": str(tiny_pi0), "horizon": 8, "executed": 5, "width": 32},
        "bc": {"demos": str(demos), "steps": 2, "batch_size": 8},
        "ppo": {"epochs": 1, "minibatches": 2, "critic_warmup": 0},
        "trainer": {"steps": 3, "eval_every": 2, "eval_episodes": 4, "save_every": 1, "keep_last": 3},
    }
    path = tmp_path / "config.yaml"
    save_config(config_from_dict(config, "test"), path)
    # both runs in fresh processes, without the kernel pins an earlier test may have set
    env = {k: v for k, v in os.environ.items() if k not in AVX2_KERNELS}
    command = [str(Path(sys.executable).parent / "omni-rl"), "train", str(path)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    shutil.copytree(tmp_path / "a", tmp_path / "b", symlinks=True)
    shutil.rmtree(tmp_path / "b" / "checkpoints" / "step-00000003")
    resumed = [*command, "--set", f"run.output_dir={tmp_path / 'b'}", "--resume", "auto"]
    done = subprocess.run(resumed, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]

    def rows(name):
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        return [{k: v for k, v in json.loads(x).items() if not k.startswith(("time/", "throughput/"))} for x in lines]

    assert [r["step"] for r in rows("b")] == [0, 1, 2, 3] and rows("b") == rows("a")
    for part in ("policy.safetensors", "backbone/model.safetensors"):
        a, b = (load_file(tmp_path / name / "model" / part) for name in ("a", "b"))
        assert all(torch.equal(a[k], b[k]) for k in a), part


def test_a_pi0_backbone_keeps_transformers_own_layers_through_train_and_eval(tiny_pi0, monkeypatch):
    """No hub kernels on load, so no mode switch swaps a layer (see test_loading)."""
    import transformers.modeling_utils

    def no_kernelize(*args, **kwargs):
        raise AssertionError("kernelize was called")

    monkeypatch.setattr(transformers.modeling_utils, "kernelize", no_kernelize)
    backbone = Pi0Backbone.from_pretrained(tiny_pi0)
    assert backbone.model.use_kernels is False
    backbone.model.train()
    backbone.model.eval()
