"""A flow-matching action-chunk policy with a value head, for online RL in simulation.

The policy maps an observation to a chunk of H actions (the first ``executed`` of
which are run before the next query) by K denoising steps of a learned velocity field
(convention and formulas in ``omni_rl.algorithms.flow``). The observation encoder is a
registered, replaceable part: an MLP over state vectors here; a VLA backbone's
features can take its place. The value head reads detached encoder features, so the
critic's loss never moves the actor.

Sampling methods:
  - ``ode``: deterministic, for evaluation;
  - ``flow_noise``: every step stochastic, std from a learned noise head;
  - ``flow_sde``: ``hybrid`` (one step per query, drawn at random, is stochastic; the
    others follow the ODE) or ``chain`` (every step stochastic).
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from omni_rl.algorithms.flow import (
    bounded_std,
    chain_logprob,
    gaussian_entropy,
    ode_step,
    sde_step,
)
from omni_rl.registry import Registry

ENCODERS: Registry = Registry("observation encoder")


def mlp(sizes: list[int], activation: type[nn.Module] = nn.SiLU) -> nn.Sequential:
    """Linear layers with ``activation`` between them (none after the last)."""
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(sizes)):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(activation())
    return nn.Sequential(*layers)


@ENCODERS.register("mlp")
class MLPEncoder(nn.Module):
    """State vector [N, obs_dim] -> features [N, width]."""

    def __init__(self, obs_dim: int, width: int):
        super().__init__()
        self.net = nn.Sequential(mlp([obs_dim, width, width]), nn.SiLU())
        self.out_dim = width

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.net(obs)


def time_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Sinusoidal features of t in [0, 1]: [N] -> [N, dim]."""
    freqs = torch.exp(torch.arange(dim // 2, device=t.device, dtype=t.dtype) * (-math.log(1000.0) / (dim // 2)))
    angles = 1000.0 * t[:, None] * freqs[None, :]
    return torch.cat([angles.sin(), angles.cos()], dim=1)


@dataclass
class ChunkSample:
    """Action chunks drawn for N observations and what PPO needs to score them again.

    Attributes:
        actions: [N, H, D] the denoised chunks (x at t = 0).
        chain: [N, K+1, H, D] x at every time, from the start noise to the actions.
        stochastic: [N, K] bool, the steps that were sampled rather than ODE steps.
        logp: [N, H, D] per-element log-likelihood of the chain under the sampler.
        value: [N] the critic's estimate for the observations.
    """

    actions: torch.Tensor
    chain: torch.Tensor
    stochastic: torch.Tensor
    logp: torch.Tensor
    value: torch.Tensor


class FlowPolicy(nn.Module):
    """Flow-matching chunk policy with Flow-Noise / Flow-SDE sampling and a value head.

    Args:
        obs_dim, action_dim: the env's sizes.
        horizon: H, actions per chunk; ``executed``: how many are run per query.
        steps: K denoising steps.
        width: hidden width of the encoder, velocity, noise and value networks.
        encoder: registered observation encoder name.
        method: 'flow_noise' or 'flow_sde' (how RL samples; 'ode' always available).
        sigma_min, sigma_max: the noise head's std bounds (Flow-Noise).
        noise_level: Flow-SDE's ``a``; sde_mode: 'hybrid' or 'chain'.
    """

    def __init__(
        self,
        obs_dim: int,
        action_dim: int,
        horizon: int = 4,
        executed: int = 4,
        steps: int = 4,
        width: int = 128,
        encoder: str = "mlp",
        method: str = "flow_noise",
        sigma_min: float = 0.08,
        sigma_max: float = 0.16,
        noise_level: float = 0.5,
        sde_mode: str = "hybrid",
    ):
        super().__init__()
        self.settings = {
            "obs_dim": obs_dim,
            "action_dim": action_dim,
            "horizon": horizon,
            "executed": executed,
            "steps": steps,
            "width": width,
            "encoder": encoder,
            "method": method,
            "sigma_min": sigma_min,
            "sigma_max": sigma_max,
            "noise_level": noise_level,
            "sde_mode": sde_mode,
        }
        if not 1 <= executed <= horizon:
            raise ValueError(f"executed actions {executed} must be within 1..horizon {horizon}")
        if method not in ("flow_noise", "flow_sde"):
            raise ValueError(f"flow method '{method}': use flow_noise or flow_sde")
        if sde_mode not in ("hybrid", "chain"):
            raise ValueError(f"Flow-SDE mode '{sde_mode}': use hybrid or chain")
        self.obs_dim, self.action_dim = obs_dim, action_dim
        self.horizon, self.executed, self.steps = horizon, executed, steps
        self.method, self.sde_mode = method, sde_mode
        self.sigma_min, self.sigma_max, self.noise_level = sigma_min, sigma_max, noise_level
        self.encoder = ENCODERS.get(encoder)(obs_dim, width)
        features, flat, self.time_dim = self.encoder.out_dim, horizon * action_dim, 32
        self.velocity_net = mlp([flat + self.time_dim + features, width, width, flat])
        self.noise_net = mlp([flat + self.time_dim + features, width, flat])
        self.value_head = mlp([features, width, 1])
        mask = torch.zeros(horizon, action_dim)
        mask[:executed] = 1.0
        self.register_buffer("action_mask", mask, persistent=False)

    def save_pretrained(self, directory: str | Path) -> None:
        """Write ``policy.json`` (constructor arguments) and ``policy.safetensors``."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "policy.json").write_text(json.dumps(self.settings, indent=2))
        tensors = {k: v.detach().cpu().contiguous() for k, v in self.state_dict().items()}
        save_file(tensors, directory / "policy.safetensors")

    @classmethod
    def from_pretrained(cls, directory: str | Path, **overrides) -> FlowPolicy:
        """A policy written by ``save_pretrained``; ``overrides`` change sampling settings
        (e.g. ``method``) without touching the weights."""
        directory = Path(directory)
        if not (directory / "policy.json").is_file():
            raise FileNotFoundError(f"{directory}: no policy.json (not a flow-policy checkpoint)")
        policy = cls(**{**json.loads((directory / "policy.json").read_text()), **overrides})
        policy.load_state_dict(load_file(directory / "policy.safetensors"))
        return policy

    @property
    def delta(self) -> float:
        return 1.0 / self.steps

    def actor_parameters(self) -> list[nn.Parameter]:
        return [p for name, p in self.named_parameters() if not name.startswith("value_head.")]

    def critic_parameters(self) -> list[nn.Parameter]:
        return list(self.value_head.parameters())

    def _heads_input(self, x: torch.Tensor, t: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        return torch.cat([x.flatten(1), time_embedding(t, self.time_dim), features], dim=1)

    def velocity(self, x: torch.Tensor, t: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """v(x_t, t | obs): [N, H, D] with t: [N]."""
        return self.velocity_net(self._heads_input(x, t, features)).view_as(x)

    def value(self, features: torch.Tensor) -> torch.Tensor:
        """V(obs) from detached features: [N]."""
        return self.value_head(features.detach()).squeeze(-1)

    def _transition(self, x, t, features):
        """Velocity, and mean and std of a stochastic step from t (``t``: [N])."""
        v = self.velocity(x, t, features)
        if self.method == "flow_noise":
            raw = self.noise_net(self._heads_input(x, t, features)).view_as(x)
            return v, ode_step(x, v, self.delta), bounded_std(raw, self.sigma_min, self.sigma_max)
        return v, *sde_step(x, v, t[:, None, None], self.delta, self.noise_level)

    def _stochastic_steps(self, n: int, device, generator: torch.Generator | None) -> torch.Tensor:
        """[N, K] bool: every step, or one random step per query (Flow-SDE hybrid)."""
        if self.method == "flow_sde" and self.sde_mode == "hybrid":
            pick = torch.randint(self.steps, (n,), generator=generator, device=device)
            return torch.arange(self.steps, device=device)[None, :] == pick[:, None]
        return torch.ones(n, self.steps, dtype=torch.bool, device=device)

    @torch.no_grad()
    def sample(self, obs: torch.Tensor, deterministic: bool = False, generator=None) -> ChunkSample:
        """Draw one chunk per observation; ``deterministic`` follows the ODE from the
        start noise (no step noise), for evaluation."""
        n, device = obs.shape[0], obs.device
        features = self.encoder(obs)
        x = torch.randn(n, self.horizon, self.action_dim, generator=generator, device=device)
        stochastic = self._stochastic_steps(n, device, generator)
        if deterministic:
            stochastic = torch.zeros_like(stochastic)
        chain, means, stds = [x], [], []
        for k in range(self.steps):
            t = torch.full((n,), 1.0 - k * self.delta, device=device)
            v, mean, std = self._transition(x, t, features)
            noise = torch.randn(x.shape, generator=generator, device=device)
            x = torch.where(stochastic[:, k, None, None], mean + std * noise, ode_step(x, v, self.delta))
            chain.append(x)
            means.append(mean)
            stds.append(std)
        chain_t = torch.stack(chain, dim=1)
        logp = chain_logprob(
            chain_t, torch.stack(means, 1), torch.stack(stds, 1), stochastic, self.method == "flow_noise"
        )
        return ChunkSample(x, chain_t, stochastic, logp, self.value(features))

    def evaluate(self, obs: torch.Tensor, chain: torch.Tensor, stochastic: torch.Tensor):
        """Per-element log-likelihood [N, H, D], mean entropy of the stochastic steps
        [N] and value [N] of stored chains under the current parameters (with grad)."""
        n, k = chain.shape[0], self.steps
        features = self.encoder(obs)
        x = chain[:, :k].reshape(n * k, self.horizon, self.action_dim)
        t = (1.0 - torch.arange(k, device=obs.device, dtype=x.dtype) * self.delta).repeat(n)
        _, mean, std = self._transition(x, t, features.repeat_interleave(k, dim=0))
        mean = mean.view(n, k, self.horizon, self.action_dim)
        std = std.view(n, k, self.horizon, self.action_dim)
        logp = chain_logprob(chain, mean, std, stochastic, self.method == "flow_noise")
        weights = stochastic.float()[:, :, None, None] * self.action_mask
        entropy = (gaussian_entropy(std) * weights).sum(dim=(1, 2, 3)) / weights.sum(dim=(1, 2, 3)).clamp(min=1.0)
        return logp, entropy, self.value(features)

    def bc_loss(self, obs: torch.Tensor, actions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Flow-matching loss on expert chunks: ``actions`` [N, H, D], ``mask`` [N, H]
        (1 on real actions; chunks cut by an episode's end are padded)."""
        features = self.encoder(obs)
        t = torch.rand(actions.shape[0], device=obs.device)
        eps = torch.randn_like(actions)
        x_t = t[:, None, None] * eps + (1 - t[:, None, None]) * actions
        error = (self.velocity(x_t, t, features) - (eps - actions)) ** 2
        weights = mask[:, :, None].expand_as(error)
        return (error * weights).sum() / weights.sum().clamp(min=1.0)
