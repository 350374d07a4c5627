"""A flow-matching action-chunk policy with a value head, for online RL in simulation.

The policy maps an observation to a chunk of H actions (the first ``executed`` of
which are run before the next query) by K denoising steps of a learned velocity field
(convention and formulas in ``omni_rl.algorithms.flow``). The observation encoder is a
registered, replaceable part: an MLP over state vectors here; a VLA backbone's
features can take its place. The critic never moves the actor: it reads either the
raw observation through a network of its own (``value_input="obs"``, for state
vectors: features cloned from a few demonstrations describe the states the expert
visited, not the value of the ones RL reaches) or the encoder's detached features
(``"features"``, for a backbone whose input is too large for a second network).

Sampling methods:
  - ``ode``: deterministic, for evaluation;
  - ``flow_noise``: std from a learned noise head, at every step (``noise_steps="all"``,
    pi_RL's) or at the last step alone (``"last"``, the others follow the ODE);
  - ``flow_sde``: ``hybrid`` (one step per query is stochastic, the others follow the
    ODE) or ``chain`` (every step stochastic).

Which steps are stochastic (Flow-SDE's ``hybrid_step``, Flow-Noise's ``noise_steps``)
decides whether exploration reaches the action. A flow cloned from a deterministic
expert contracts: its later steps pull a perturbed x back onto the learned path, so
noise injected early is largely erased before the action comes out. On the quickstart's
cloned PushCube policy (``tools/noise_reach.py``, K = 4) the action's std with noise at
step 0, 1, 2 or 3 alone is 0.060, 0.075, 0.081 and 0.144 for Flow-SDE (a = 0.5) and
0.014, 0.021, 0.039 and 0.120 for Flow-Noise. Drawn uniformly (pi_RL's choice,
``uniform``), three chunks in four explore less than half as much as the last step
allows, yet every chunk carries a gradient. ``last`` (the default) always makes the
final step stochastic; ``late`` draws step k with weight k + 1.
"""

from __future__ import annotations

import importlib
import itertools
import json
import math
from contextlib import nullcontext
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
from omni_rl.config import build_section, to_dict
from omni_rl.errors import OmniRLError
from omni_rl.models.flow_policy_config import FlowPolicyConfig
from omni_rl.registry import Registry

ENCODERS: Registry = Registry("observation encoder")
# each ``policy.type``'s class, imported when a checkpoint of that type is loaded (the
# pi0 module builds on this one, so it cannot be imported here)
POLICY_CLASSES = {"mlp": ("omni_rl.models.flow_policy", "FlowPolicy"), "pi0": ("omni_rl.models.pi0", "Pi0FlowPolicy")}
HYBRID_STEPS = ("last", "late", "uniform")


def hybrid_step_weights(choice: str, steps: int) -> torch.Tensor:
    """[K] probabilities of each denoising step being Flow-SDE hybrid's stochastic one:
    'uniform' 1/K each (pi_RL), 'late' proportional to k + 1, 'last' all on K - 1."""
    if choice == "uniform":
        weights = torch.ones(steps)
    elif choice == "late":
        weights = torch.arange(1, steps + 1, dtype=torch.float32)
    elif choice == "last":
        weights = torch.zeros(steps)
        weights[-1] = 1.0
    else:
        raise ValueError(f"Flow-SDE hybrid step '{choice}': use {', '.join(HYBRID_STEPS)}")
    return weights / weights.sum()


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
class ChunkNoise:
    """The randomness of sampling N chunks, drawn up front so that it can be drawn for
    every env of a run on each process and sliced (``noise[rows]``): then what an env
    samples does not depend on how the envs are split over processes.

    Attributes:
        start: [N, H, D] x at t = 1.
        steps: [N, K, H, D] standard normal draws of the stochastic steps.
        pick: [N] the one stochastic step of Flow-SDE ``hybrid``.
    """

    start: torch.Tensor
    steps: torch.Tensor
    pick: torch.Tensor

    def __getitem__(self, index) -> ChunkNoise:
        """Index the leading (chunk) dims of every part alike."""
        return ChunkNoise(self.start[index], self.steps[index], self.pick[index])

    def view(self, *lead: int) -> ChunkNoise:
        """The chunk dim split into ``lead`` dims (e.g. [C * N] -> [C, N])."""
        return ChunkNoise(
            self.start.view(*lead, *self.start.shape[1:]),
            self.steps.view(*lead, *self.steps.shape[1:]),
            self.pick.view(*lead),
        )

    def to(self, device) -> ChunkNoise:
        return ChunkNoise(self.start.to(device), self.steps.to(device), self.pick.to(device))


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
        config: the architecture and how RL samples it (``FlowPolicyConfig``; its unset
            mode fields take their mode's defaults). ``noise_level`` is read once:
            the recipe anneals the attribute of that name.
        obs_dim, action_dim: the env's sizes.
    """

    def __init__(self, config: FlowPolicyConfig, obs_dim: int, action_dim: int):
        super().__init__()
        self.config, self.obs_dim, self.action_dim = config, obs_dim, action_dim
        horizon, width = config.horizon, config.width
        self._read_sampling(config)
        self.encoder = ENCODERS.get(config.encoder)(obs_dim, width)
        features, flat, self.time_dim = self.encoder.out_dim, horizon * action_dim, 32
        self.velocity_net = mlp([flat + self.time_dim + features, width, width, flat])
        self.noise_net = mlp([flat + self.time_dim + features, width, flat])
        self.value_input = config.setting("value_input")
        self.value_head = mlp([obs_dim, width, width, 1] if self.value_input == "obs" else [features, width, 1])
        self._register_action_mask(action_dim, action_dim)

    def _read_sampling(self, config: FlowPolicyConfig) -> None:
        """The chunk's sizes and how RL samples it, from ``config`` (its mode's defaults
        where unset)."""
        self.horizon, self.executed, self.steps = config.horizon, config.executed, config.denoise_steps
        self.method = config.method
        self.sde_mode, self.hybrid_step = config.setting("sde_mode"), config.setting("hybrid_step")
        self.noise_steps = config.setting("noise_steps")
        self.sigma_min, self.sigma_max = config.setting("sigma_min"), config.setting("sigma_max")
        self.noise_level = config.setting("noise_level")

    def _register_action_mask(self, action_dim: int, executed_dims: int) -> None:
        """``action_mask`` [H, D]: 1 on the numbers the env runs (the first ``executed``
        actions' first ``executed_dims`` numbers), what PPO's ratio and entropy read."""
        mask = torch.zeros(self.horizon, action_dim)
        mask[: self.executed, :executed_dims] = 1.0
        self.register_buffer("action_mask", mask, persistent=False)

    def save_pretrained(self, directory: str | Path, state_dict: dict[str, torch.Tensor] | None = None) -> None:
        """Write ``policy.json`` (the policy's type, the env's sizes and the ``policy:`` config) and
        ``policy.safetensors``: the policy's own weights, or ``state_dict`` (the full
        weights a sharded engine gathered, see ``omni_rl.engine.checkpoint.export_model``)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        spec = {"type": "mlp", "obs_dim": self.obs_dim, "action_dim": self.action_dim, "config": to_dict(self.config)}
        (directory / "policy.json").write_text(json.dumps(spec, indent=2))
        weights = self.state_dict() if state_dict is None else state_dict
        tensors = {k: v.detach().cpu().contiguous() for k, v in weights.items()}
        save_file(tensors, directory / "policy.safetensors")

    @classmethod
    def from_pretrained(cls, directory: str | Path, **overrides) -> FlowPolicy:
        """The policy ``save_pretrained`` wrote (``OUTPUT_DIR/model`` of a flow_ppo run),
        of the type it was saved as (its ``policy.json``'s ``type``; none: the state
        MLP, as checkpoints before it had: a pi0 checkpoint loads as a ``Pi0FlowPolicy``
        through this class too); ``overrides`` change ``policy:``
        fields that leave the weights' shapes alone (e.g. ``method``). A subclass asked
        for a checkpoint of another type says so."""
        directory = Path(directory)
        if not (directory / "policy.json").is_file():
            raise FileNotFoundError(f"{directory}: no policy.json (not a flow-policy checkpoint)")
        spec = json.loads((directory / "policy.json").read_text())
        kind = spec.get("type", "mlp")
        if kind not in POLICY_CLASSES:
            raise OmniRLError(f"{directory}: policy type {kind!r} is not one of {sorted(POLICY_CLASSES)}")
        module, name = POLICY_CLASSES[kind]
        saved = getattr(importlib.import_module(module), name)
        if not issubclass(saved, cls):
            raise OmniRLError(
                f"{directory} holds a {kind} policy ({saved.__name__}), not a {cls.__name__}: "
                "load it with FlowPolicy.from_pretrained"
            )
        config = build_section(FlowPolicyConfig, {**spec["config"], **overrides}, "policy")
        return saved.load_saved(directory, spec, config)

    @classmethod
    def load_saved(cls, directory: Path, spec: dict, config: FlowPolicyConfig) -> FlowPolicy:
        """This type's policy from ``directory``, whose ``policy.json`` reads ``spec``."""
        policy = cls(config, spec["obs_dim"], spec["action_dim"])
        policy.load_state_dict(load_file(directory / "policy.safetensors"))
        return policy

    @property
    def delta(self) -> float:
        return 1.0 / self.steps

    @property
    def chunk_shape(self) -> tuple[int, int]:
        """(H, D): one chunk's actions."""
        return self.horizon, self.action_dim

    def times(self, device: torch.device) -> torch.Tensor:
        """[K] fp32: t at each denoising step, 1 down to ``delta``. Sampling and scoring
        read this one grid: ``1 - k * delta`` rounded from Python floats differs from the
        fp32 product in the last bit for K = 5 or 10, which moved the first ratio off 1."""
        return 1.0 - torch.arange(self.steps, device=device, dtype=torch.float32) * self.delta

    def actor_parameters(self) -> list[nn.Parameter]:
        return [p for name, p in self.named_parameters() if not name.startswith("value_head.")]

    def critic_parameters(self) -> list[nn.Parameter]:
        return list(self.value_head.parameters())

    def _heads_input(self, x: torch.Tensor, t: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        return torch.cat([x.flatten(1), time_embedding(t, self.time_dim), features], dim=1)

    def velocity(self, x: torch.Tensor, t: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """v(x_t, t | obs): [N, H, D] with t: [N]."""
        return self.velocity_net(self._heads_input(x, t, features)).view_as(x)

    def value(self, obs: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """V(obs) [N], from the observation or the detached features (``value_input``)."""
        return self.value_head(obs if self.value_input == "obs" else features.detach()).squeeze(-1)

    def _transition(self, x, t, features):
        """Velocity, and mean and std of a stochastic step from t (``t``: [N])."""
        v = self.velocity(x, t, features)
        if self.method == "flow_noise":
            raw = self.noise_net(self._heads_input(x, t, features)).view_as(x)
            return v, ode_step(x, v, self.delta), bounded_std(raw, self.sigma_min, self.sigma_max)
        return v, *sde_step(x, v, t[:, None, None], self.delta, self.noise_level)

    def start_noise(self, n: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """x at t = 1 for ``n`` chunks [n, H, D]: all the deterministic sampler needs."""
        device = generator.device if generator is not None else torch.device("cpu")
        return torch.randn((n, *self.chunk_shape), generator=generator, device=device)

    def noise(self, n: int, generator: torch.Generator | None = None) -> ChunkNoise:
        """The randomness of sampling ``n`` chunks, on the generator's device (CPU
        without one), drawn in the order sampling uses it: the start, Flow-SDE
        hybrid's stochastic step, then the noise of each denoising step."""
        device = generator.device if generator is not None else torch.device("cpu")
        start = self.start_noise(n, generator)
        pick = torch.full((n,), self.steps - 1, dtype=torch.long, device=device)
        if self.method == "flow_sde" and self.sde_mode == "hybrid" and self.hybrid_step != "last":
            weights = hybrid_step_weights(self.hybrid_step, self.steps).to(device)
            pick = torch.multinomial(weights.expand(n, -1), 1, replacement=True, generator=generator).squeeze(1)
        steps = torch.randn((n, self.steps, *self.chunk_shape), generator=generator, device=device)
        return ChunkNoise(start, steps, pick)

    def _stochastic_steps(self, pick: torch.Tensor) -> torch.Tensor:
        """[N, K] bool: every step, the ``pick``-th one (Flow-SDE hybrid) or the last
        (Flow-Noise with ``noise_steps="last"``)."""
        if self.method == "flow_sde" and self.sde_mode == "hybrid":
            return torch.arange(self.steps, device=pick.device)[None, :] == pick[:, None]
        stochastic = torch.ones(pick.shape[0], self.steps, dtype=torch.bool, device=pick.device)
        if self.method == "flow_noise" and self.noise_steps == "last":
            stochastic[:, :-1] = False
        return stochastic

    @torch.no_grad()
    def sample(
        self,
        obs: torch.Tensor,
        deterministic: bool = False,
        generator: torch.Generator | None = None,
        noise: ChunkNoise | None = None,
        start: torch.Tensor | None = None,
    ) -> ChunkSample:
        """Draw one chunk per observation. The randomness is ``noise`` when given, else
        drawn from ``generator``. ``deterministic`` follows the ODE from the start noise
        (``start`` [N, H, D], or ``noise.start``, or drawn), for evaluation."""
        n = len(obs)
        if deterministic:
            start = start if start is not None else noise.start if noise is not None else self.start_noise(n, generator)
            noise = None
        elif noise is None:
            noise = self.noise(n, generator)
        with self._weights_dtype(obs.device):
            return self._sample(obs, noise, start)

    def _sample(self, obs: torch.Tensor, noise: ChunkNoise | None, start: torch.Tensor | None) -> ChunkSample:
        """``noise`` None: the ODE from ``start``."""
        n, device = len(obs), obs.device
        features = self.encoder(obs)
        if noise is None:
            x = start.to(device)
            stochastic = torch.zeros(n, self.steps, dtype=torch.bool, device=device)
        else:
            noise = noise.to(device)
            x, stochastic = noise.start, self._stochastic_steps(noise.pick)
        chain, means, stds = [x], [], []
        times = self.times(device)
        for k in range(self.steps):
            t = times[k].expand(n)
            v, mean, std = self._transition(x, t, features)
            x = ode_step(x, v, self.delta)
            if noise is not None:
                x = torch.where(stochastic[:, k, None, None], mean + std * noise.steps[:, k], x)
            chain.append(x)
            means.append(mean)
            stds.append(std)
        chain_t = torch.stack(chain, dim=1).float()
        logp = chain_logprob(
            chain_t, torch.stack(means, 1), torch.stack(stds, 1), stochastic, self.method == "flow_noise"
        )
        return ChunkSample(x.float(), chain_t, stochastic, logp.float(), self.value(obs, features).float())

    @torch.no_grad()
    def value_of(self, obs: torch.Tensor) -> torch.Tensor:
        """V(obs) [N] outside training (bootstrapping truncated episodes)."""
        with self._weights_dtype(obs.device):
            return self.value(obs, None if self.value_input == "obs" else self.encoder(obs)).float()

    def _weights_dtype(self, device: torch.device):
        """Compute in the weights' dtype where it is not fp32: sampling outside
        ``forward`` sees the bf16 weights FSDP2 gathers under bf16-mixed. fp32 weights
        leave the caller's precision alone: under bf16-mixed in one process or DDP the
        engine's ``forward_context`` autocasts sampling as it does the forward."""
        dtype = next(self.parameters()).dtype
        return nullcontext() if dtype == torch.float32 else torch.autocast(device.type, dtype=dtype)

    def forward(self, obs: torch.Tensor, *tensors: torch.Tensor, bc: bool = False):
        """The training forward, the call data-parallel wrappers hook:
        ``policy(obs, chain, stochastic)`` is :meth:`chain_logprob_value` (PPO);
        ``policy(obs, actions, mask, t, eps, count, bc=True)`` is :meth:`bc_loss`."""
        if bc:
            return self.bc_loss(obs, *tensors)
        logp, entropy, value = self.chain_logprob_value(obs, *tensors)
        # fp32 (bf16 autocast computes the networks) and no views (FSDP2 hooks warn about those)
        return logp.float(), entropy.float(), value.to(torch.float32, copy=True)

    def chain_logprob_value(self, obs: torch.Tensor, chain: torch.Tensor, stochastic: torch.Tensor):
        """Per-element log-likelihood [N, H, D], mean entropy of the stochastic steps
        [N] and value [N] of stored chains under the current parameters (with grad)."""
        n, k = chain.shape[0], self.steps
        features = self.encoder(obs)
        x = chain[:, :k].reshape(n * k, self.horizon, self.action_dim)
        t = self.times(obs.device).to(x.dtype).repeat(n)
        _, mean, std = self._transition(x, t, features.repeat_interleave(k, dim=0))
        mean = mean.view(n, k, self.horizon, self.action_dim)
        std = std.view(n, k, self.horizon, self.action_dim)
        return *self._chain_scores(chain, mean, std, stochastic), self.value(obs, features)

    def _chain_scores(self, chain, mean, std, stochastic) -> tuple[torch.Tensor, torch.Tensor]:
        """The chain's per-element log-likelihood [N, H, D] under the steps' ``mean`` and
        ``std`` [N, K, H, D], and the mean entropy of its stochastic steps over the
        numbers the env runs [N]."""
        logp = chain_logprob(chain, mean, std, stochastic, self.method == "flow_noise")
        weights = stochastic.float()[:, :, None, None] * self.action_mask
        entropy = (gaussian_entropy(std) * weights).sum(dim=(1, 2, 3)) / weights.sum(dim=(1, 2, 3)).clamp(min=1.0)
        return logp, entropy

    def bc_loss(
        self,
        obs: torch.Tensor,
        actions: torch.Tensor,
        mask: torch.Tensor,
        t: torch.Tensor | None = None,
        eps: torch.Tensor | None = None,
        count: float | None = None,
    ) -> torch.Tensor:
        """Flow-matching loss on expert chunks: ``actions`` [N, H, D], ``mask`` [N, H]
        (1 on real actions; chunks cut by an episode's end are padded), averaged over
        the real action elements. ``t`` [N] and ``eps`` [N, H, D] are drawn when not
        given; ``count``: the number of real elements to average over (default: this
        batch's; a process holding part of a larger batch passes the whole batch's)."""
        features = self.encoder(obs)
        t = torch.rand(actions.shape[0], device=obs.device) if t is None else t
        eps = torch.randn_like(actions) if eps is None else eps
        x_t = t[:, None, None] * eps + (1 - t[:, None, None]) * actions
        error = (self.velocity(x_t, t, features) - (eps - actions)) ** 2
        weights = mask[:, :, None].expand_as(error)
        count = weights.sum() if count is None else torch.tensor(float(count), device=obs.device)
        return (error * weights).sum() / count.clamp(min=1.0)
