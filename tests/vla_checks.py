"""Exactness checks every VLA backbone of a flow policy passes against its transformers
model (``tests/test_pi0.py``, ``tests/test_pi05.py``): ``model_inputs`` are the
observation's tensors the model's own calls take beside the prefix's (pi_0's state)."""

from __future__ import annotations

import torch


def prefix_inputs(obs) -> dict:
    return {
        "input_ids": obs.input_ids,
        "attention_mask": obs.attention_mask,
        "pixel_values": obs.pixel_values,
        "pixel_attention_mask": obs.pixel_attention_mask,
    }


def assert_zeroed_noise_samples_the_models_actions(policy, obs, method: str, model_inputs: dict) -> None:
    """The chain with every stochastic step's draw at 0 (the noise head's and the SDE's
    std forced out) and the deterministic sampler both give the model's own
    ``sample_actions`` on the same start noise."""
    noise = policy.noise(len(obs), torch.Generator().manual_seed(2))
    noise.steps.zero_()
    if method == "flow_sde":  # the SDE step's mean is not the ODE's: only the deterministic path applies
        drawn = policy.sample(obs, deterministic=True, start=noise.start)
    else:
        drawn = policy.sample(obs, noise=noise)
    with torch.no_grad():
        want = policy.backbone.model.sample_actions(
            noise=noise.start.clone(), num_steps=policy.steps, **prefix_inputs(obs), **model_inputs
        )
    torch.testing.assert_close(drawn.actions, want, atol=1e-5, rtol=1e-5)


def assert_bc_loss_is_the_models_loss(policy, obs, model_inputs: dict) -> None:
    """The cloning loss at given times and noise is the model's own flow-matching loss."""
    n, horizon, dims = len(obs), policy.horizon, policy.action_dim
    generator = torch.Generator().manual_seed(4)
    actions = torch.randn(n, horizon, dims, generator=generator)
    eps, t = torch.randn(n, horizon, dims, generator=generator), torch.rand(n, generator=generator)
    ours = policy.bc_loss(obs, actions, torch.ones(n, horizon), t, eps)
    theirs = policy.backbone.model(noise=eps, timestep=t, actions=actions, **prefix_inputs(obs), **model_inputs).loss
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-5)


def sample_and_score_counting_vlm_passes(policy, obs, seed: int):
    """(the drawn sample, PPO's forward of it: logp, entropy, value), asserting that
    sampling and scoring each ran the VLM once over the batch, whatever the number of
    denoising steps."""
    calls = []
    hook = policy.backbone.model.model.vlm.register_forward_hook(lambda *_: calls.append(1))
    try:
        drawn = policy.sample(obs, generator=torch.Generator().manual_seed(seed))
        assert len(calls) == 1
        scored = policy(obs, drawn.chain, drawn.stochastic)
        assert len(calls) == 2
    finally:
        hook.remove()
    return drawn, scored
