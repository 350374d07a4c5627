"""A flow-matching action-chunk policy with a value head, for online RL in simulation.

The policy maps an observation to a chunk of H actions (the first ``executed`` of
which are run before the next query) by K denoising steps of a learned velocity field
(convention and formulas in ``omni_rl.algorithms.flow``). The velocity field is a
backbone (``VelocityBackbone``, one per ``policy.type``): MLPs over state vectors
(``StateBackbone``) or pi_0 (``omni_rl.models.pi0``); the chain, its log-probs, the
noise head, the critic, the cloning loss and save/load are written once, here. The
critic never moves the actor: it reads either a privileged state through a network of
its own (``value_input="obs"``, for state vectors: features cloned from a few
demonstrations describe the states the expert visited, not the value of the ones RL
reaches) or the backbone's detached features (``"features"``, for a backbone whose
input is too large for a second network; pi_RL's critic).

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
from abc import ABC, abstractmethod
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

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
# each ``policy.type``'s backbone, imported when a policy of that type is loaded (the
# pi0 module imports transformers' PI0, which a state-vector run never needs)
BACKBONES = {
    "mlp": ("omni_rl.models.flow_policy", "StateBackbone"),
    "pi0": ("omni_rl.models.pi0", "Pi0Backbone"),
    "pi05": ("omni_rl.models.pi05", "Pi05Backbone"),
}
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


class VelocityBackbone(nn.Module, ABC):
    """The network behind a ``FlowPolicy``'s velocity field. The policy owns what every
    backbone shares (the Flow-Noise and Flow-SDE chain, its log-probs, the noise head,
    the critic, the cloning loss, save and load); a backbone provides:

    - ``encode``: an observation batch once into the context every denoising step reads;
    - ``velocity``: v at (x_t, t) and the features the noise head reads at that step;
    - ``critic_features``: what a critic on features reads (``value_input: features``);
    - ``privileged``: the privileged state a critic on the observation reads (``obs``);
    - ``to_env`` and ``from_env``: its actions in the env's units and back;
    - ``save`` and ``load``: what it writes beside the policy's heads.

    Sizes (set by each backbone): ``horizon`` actions of ``action_dim`` numbers, of which
    the env runs the first ``env_action_dim``; the noise head maps ``noise_dims[0]``
    features to ``noise_dims[1]`` numbers; ``feature_dim`` and ``privileged_dim`` are
    the critic's two possible inputs (0: none).
    """

    KIND: ClassVar[str]  # its policy.type
    DEFAULT_VALUE_INPUT: ClassVar[str] = "obs"  # value_input when unset
    HAS_VLM: ClassVar[bool] = False  # whether train_vlm switches a VLM per phase
    SAVED_APART: ClassVar[str | None] = None  # the prefix of the weights ``save`` writes itself

    horizon: int
    action_dim: int
    env_action_dim: int
    noise_dims: tuple[int, int]
    feature_dim: int
    privileged_dim: int

    @abstractmethod
    def encode(self, obs):
        """The context of a batch of observations, computed once per batch."""

    @abstractmethod
    def velocity(self, x: torch.Tensor, t: torch.Tensor, context) -> tuple[torch.Tensor, torch.Tensor]:
        """(v [N, H, D], the noise head's input) at x_t [N, H, D] and t [N]."""

    @abstractmethod
    def critic_features(self, context) -> torch.Tensor:
        """[N, feature_dim]: what a critic on features reads (the policy detaches it)."""

    @abstractmethod
    def privileged(self, obs, context=None) -> torch.Tensor:
        """[N, privileged_dim]: the state a critic on the observation reads."""

    def critic_sizes(self, value_input: str, width: int) -> list[int]:
        """The critic MLP's layer sizes."""
        return [self.privileged_dim if value_input == "obs" else self.feature_dim, width, 1]

    def repeat(self, context, times: int):
        """The context of each observation ``times`` times in a row, so that scoring runs a
        chain's K steps as one batch; None (here): this backbone's context does not
        repeat (a prefix's key-value cache), and the steps run one after another."""
        return None

    def from_env(self, actions: torch.Tensor) -> torch.Tensor:
        """Actions in the env's units [..., env_action_dim] as the velocity field reads them."""
        return actions

    def to_env(self, actions: torch.Tensor) -> torch.Tensor:
        """The velocity field's actions [..., env_action_dim] in the env's units."""
        return actions

    @abstractmethod
    def save(self, directory: Path, weights: dict[str, torch.Tensor]) -> dict:
        """Write what this backbone keeps apart from ``policy.safetensors`` (its weights
        under ``SAVED_APART``) to ``directory``; returns its fields of ``policy.json``."""

    @classmethod
    @abstractmethod
    def load(cls, directory: Path, spec: dict, config: FlowPolicyConfig) -> VelocityBackbone:
        """The backbone ``save`` wrote, its weights outside ``SAVED_APART`` not yet loaded."""


def backbone_class(kind: str, where: str) -> type[VelocityBackbone]:
    """The backbone class of ``policy.type`` ``kind`` (``where`` names the source)."""
    if kind not in BACKBONES:
        raise OmniRLError(f"{where}: policy type {kind!r} is not one of {sorted(BACKBONES)}")
    module, name = BACKBONES[kind]
    return getattr(importlib.import_module(module), name)


class StateBackbone(VelocityBackbone):
    """MLPs over state vectors: a registered observation encoder (``policy.encoder``),
    and a velocity MLP over the flattened chunk, a sinusoidal time embedding and the
    encoder's features. The noise head reads the velocity MLP's input."""

    KIND = "mlp"

    def __init__(self, config: FlowPolicyConfig, obs_dim: int, action_dim: int):
        super().__init__()
        self.obs_dim = self.privileged_dim = obs_dim
        self.horizon, self.action_dim = config.horizon, action_dim
        self.env_action_dim = action_dim
        width = config.width
        self.encoder = ENCODERS.get(config.encoder)(obs_dim, width)
        self.feature_dim, flat, self.time_dim = self.encoder.out_dim, config.horizon * action_dim, 32
        heads = flat + self.time_dim + self.feature_dim
        self.velocity_net = mlp([heads, width, width, flat])
        self.noise_dims = (heads, flat)

    def encode(self, obs: torch.Tensor) -> torch.Tensor:
        return self.encoder(obs)

    def velocity(self, x: torch.Tensor, t: torch.Tensor, context: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        heads = torch.cat([x.flatten(1), time_embedding(t, self.time_dim), context], dim=1)
        return self.velocity_net(heads).view_as(x), heads

    def critic_features(self, context: torch.Tensor) -> torch.Tensor:
        return context

    def privileged(self, obs: torch.Tensor, context=None) -> torch.Tensor:
        return obs

    def critic_sizes(self, value_input: str, width: int) -> list[int]:
        """Two hidden layers on the state: a critic of its own, not a head on features."""
        return [self.obs_dim, width, width, 1] if value_input == "obs" else [self.feature_dim, width, 1]

    def repeat(self, context: torch.Tensor, times: int) -> torch.Tensor:
        return context.repeat_interleave(times, dim=0)

    def save(self, directory: Path, weights: dict[str, torch.Tensor]) -> dict:
        return {"obs_dim": self.obs_dim, "action_dim": self.action_dim}

    @classmethod
    def load(cls, directory: Path, spec: dict, config: FlowPolicyConfig) -> StateBackbone:
        return cls(config, spec["obs_dim"], spec["action_dim"])


class FlowPolicy(nn.Module):
    """Flow-matching chunk policy with Flow-Noise / Flow-SDE sampling and a value head,
    over a velocity backbone (``VelocityBackbone``).

    The Flow-Noise noise head is a ``width``-wide MLP on the backbone's step features,
    its std bounded to [sigma_min, sigma_max]. The critic reads the backbone's detached
    features (``value_input: features``) or a privileged state through its own MLP
    (``obs``); it never moves the actor. The chain's log-probability is the sum over its
    stochastic steps: the likelihood of the chain, which PPO's ratio needs (RLinf's mean
    over steps rescales the ratio's log by 1/K).

    Args:
        config: the architecture and how RL samples it (``FlowPolicyConfig``; its unset
            mode fields take their mode's defaults). ``noise_level`` is read once:
            the recipe anneals the attribute of that name.
        backbone: the velocity field; its ``horizon`` must be ``config.horizon``.
    """

    CASTS_OWN_INPUTS = True
    """FSDP2 hands ``forward`` its inputs uncast: it computes in its weights' dtype as
    sampling does (``_weights_dtype``) and scores the stored fp32 chain (a chain cast to
    bf16 moved each step's log-density by up to about 0.25 before any update)."""

    def __init__(self, config: FlowPolicyConfig, backbone: VelocityBackbone):
        super().__init__()
        if config.horizon != backbone.horizon:
            raise OmniRLError(
                f"policy.horizon {config.horizon}: the {backbone.KIND} backbone predicts {backbone.horizon} "
                f"actions a chunk (a pi0 checkpoint: load it with chunk_size={config.horizon})"
            )
        self.config, self.backbone = config, backbone
        self.action_dim, self.env_action_dim = backbone.action_dim, backbone.env_action_dim
        self._read_sampling(config)
        self.value_input = config.value_input or backbone.DEFAULT_VALUE_INPUT
        if self.value_input == "obs" and backbone.privileged_dim < 1:
            raise OmniRLError(
                f"policy.value_input obs: the {backbone.KIND} critic reads a privileged state; give its size"
            )
        self.noise_net = mlp([backbone.noise_dims[0], config.width, backbone.noise_dims[1]])
        self.value_head = mlp(backbone.critic_sizes(self.value_input, config.width))
        # PPO's ratio and entropy read the numbers the env runs
        mask = torch.zeros(self.horizon, self.action_dim)
        mask[: self.executed, : self.env_action_dim] = 1.0
        self.register_buffer("action_mask", mask, persistent=False)

    def _read_sampling(self, config: FlowPolicyConfig) -> None:
        """The chunk's sizes and how RL samples it, from ``config`` (its mode's defaults
        where unset)."""
        self.horizon, self.executed, self.steps = config.horizon, config.executed, config.denoise_steps
        self.method = config.method
        self.sde_mode, self.hybrid_step = config.setting("sde_mode"), config.setting("hybrid_step")
        self.noise_steps = config.setting("noise_steps")
        self.sigma_min, self.sigma_max = config.setting("sigma_min"), config.setting("sigma_max")
        self.noise_level = config.setting("noise_level")

    def save_pretrained(self, directory: str | Path, state_dict: dict[str, torch.Tensor] | None = None) -> None:
        """Write ``policy.json`` (the backbone's type and fields, the ``policy:`` config),
        what the backbone keeps apart (a pi0 checkpoint in ``backbone/``) and
        ``policy.safetensors``: the other weights, of the policy or of ``state_dict``
        (the full weights a sharded engine gathered, see
        ``omni_rl.engine.checkpoint.export_model``)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        weights = self.state_dict() if state_dict is None else state_dict
        inner = {k.removeprefix("backbone."): v for k, v in weights.items() if k.startswith("backbone.")}
        fields = self.backbone.save(directory, inner)
        spec = {"type": self.backbone.KIND, **fields, "config": to_dict(self.config)}
        apart = self._saved_apart()
        tensors = {k: v.detach().cpu().contiguous() for k, v in weights.items() if not (apart and k.startswith(apart))}
        save_file(tensors, directory / "policy.safetensors")
        (directory / "policy.json").write_text(json.dumps(spec, indent=2))

    def _saved_apart(self) -> str | None:
        """The prefix of the policy's weights its backbone saves itself."""
        return None if self.backbone.SAVED_APART is None else f"backbone.{self.backbone.SAVED_APART}"

    @classmethod
    def from_pretrained(cls, directory: str | Path, **overrides) -> FlowPolicy:
        """The policy ``save_pretrained`` wrote (``OUTPUT_DIR/model`` of a flow_ppo run),
        on the backbone its ``policy.json``'s ``type`` names (none: the state MLP, as
        checkpoints before it had); ``overrides`` change ``policy:`` fields that leave
        the weights' shapes alone (e.g. ``method``)."""
        directory = Path(directory)
        if not (directory / "policy.json").is_file():
            raise FileNotFoundError(f"{directory}: no policy.json (not a flow-policy checkpoint)")
        spec = json.loads((directory / "policy.json").read_text())
        backbone = backbone_class(spec.get("type", "mlp"), str(directory))
        config = build_section(FlowPolicyConfig, {**spec["config"], **overrides}, "policy")
        policy = cls(config, backbone.load(directory, spec, config))
        mismatch = f"{directory}: policy.safetensors does not match a {backbone.KIND} policy"
        try:
            missing, unexpected = policy.load_state_dict(load_file(directory / "policy.safetensors"), strict=False)
        except RuntimeError as err:  # a weight of another shape
            raise OmniRLError(f"{mismatch}: {err}") from err
        apart = policy._saved_apart()
        if unexpected or any(not (apart and k.startswith(apart)) for k in missing):
            raise OmniRLError(f"{mismatch} (unexpected {sorted(unexpected)[:5]}, missing {sorted(missing)[:5]})")
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
        """What the actor's optimizer holds: the trainable parameters (a frozen VLM's are
        not), the critic's aside."""
        return [p for name, p in self.named_parameters() if p.requires_grad and not name.startswith("value_head.")]

    def critic_parameters(self) -> list[nn.Parameter]:
        return list(self.value_head.parameters())

    def velocity(self, x: torch.Tensor, t: torch.Tensor, context) -> torch.Tensor:
        """v(x_t, t | obs): [N, H, D] with t: [N] and the observations' ``context``."""
        return self.backbone.velocity(x, t, context)[0]

    def value(self, obs, context) -> torch.Tensor:
        """V(obs) [N], from the privileged state or the detached features (``value_input``)."""
        if self.value_input == "obs":
            return self.value_head(self.backbone.privileged(obs, context)).squeeze(-1)
        return self.value_head(self.backbone.critic_features(context).detach()).squeeze(-1)

    def _transition(self, x, t, context):
        """Velocity, and mean and std of a stochastic step from t (``t``: [N])."""
        v, heads = self.backbone.velocity(x, t, context)
        if self.method == "flow_noise":
            std = bounded_std(self.noise_net(heads).view_as(x), self.sigma_min, self.sigma_max)
            return v, ode_step(x, v, self.delta), std
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
        obs,
        deterministic: bool = False,
        generator: torch.Generator | None = None,
        noise: ChunkNoise | None = None,
        start: torch.Tensor | None = None,
    ) -> ChunkSample:
        """Draw one chunk per observation. The randomness is ``noise`` when given, else
        drawn from ``generator``. ``deterministic`` follows the ODE from the start noise
        (``start`` [N, H, D], or ``noise.start``, or drawn), for evaluation. The actions
        are cut to the env's numbers and in its units (``VelocityBackbone.to_env``); the
        chain keeps every number, in the backbone's units."""
        n = len(obs)
        if deterministic:
            start = start if start is not None else noise.start if noise is not None else self.start_noise(n, generator)
            noise = None
        elif noise is None:
            noise = self.noise(n, generator)
        with self._weights_dtype(obs.device):
            drawn = self._sample(obs, noise, start)
        drawn.actions = self.backbone.to_env(drawn.actions[..., : self.env_action_dim])
        return drawn

    def _sample(self, obs, noise: ChunkNoise | None, start: torch.Tensor | None) -> ChunkSample:
        """``noise`` None: the ODE from ``start``."""
        n, device = len(obs), obs.device
        context = self.backbone.encode(obs)
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
            v, mean, std = self._transition(x, t, context)
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
        return ChunkSample(x.float(), chain_t, stochastic, logp.float(), self.value(obs, context).float())

    @torch.no_grad()
    def value_of(self, obs) -> torch.Tensor:
        """V(obs) [N] outside training (bootstrapping truncated episodes); a critic on the
        privileged state encodes nothing."""
        with self._weights_dtype(obs.device):
            context = None if self.value_input == "obs" else self.backbone.encode(obs)
            return self.value(obs, context).float()

    def _weights_dtype(self, device: torch.device):
        """Compute in the weights' dtype where it is not fp32: sampling outside
        ``forward`` and ``forward`` itself (its inputs uncast, ``CASTS_OWN_INPUTS``) see
        the bf16 weights FSDP2 gathers under bf16-mixed. fp32 weights
        leave the caller's precision alone: under bf16-mixed in one process or DDP the
        engine's ``forward_context`` autocasts sampling as it does the forward."""
        dtype = next(self.parameters()).dtype
        return nullcontext() if dtype == torch.float32 else torch.autocast(device.type, dtype=dtype)

    def forward(self, obs, *tensors: torch.Tensor, bc: bool = False):
        """The training forward, the call data-parallel wrappers hook:
        ``policy(obs, chain, stochastic)`` is :meth:`chain_logprob_value` (PPO);
        ``policy(obs, actions, mask, t, eps, count, bc=True)`` is :meth:`bc_loss`."""
        with self._weights_dtype(obs.device):  # bf16 weights gathered by FSDP2: as ``sample`` computes
            if bc:
                return self.bc_loss(obs, *tensors)
            logp, entropy, value = self.chain_logprob_value(obs, *tensors)
        # fp32 (bf16 autocast computes the networks) and no views (FSDP2 hooks warn about those)
        return logp.float(), entropy.float(), value.to(torch.float32, copy=True)

    def chain_logprob_value(self, obs, chain: torch.Tensor, stochastic: torch.Tensor):
        """Per-element log-likelihood [N, H, D], mean entropy of the stochastic steps
        [N] and value [N] of stored chains under the current parameters (with grad).
        The K steps run as one batch where the backbone can repeat its context, else
        one after another over the observations' one context."""
        n, k = len(obs), self.steps
        context = self.backbone.encode(obs)
        times = self.times(obs.device).to(chain.dtype)
        repeated = self.backbone.repeat(context, k)
        if repeated is not None:
            x = chain[:, :k].reshape(n * k, *self.chunk_shape)
            _, mean, std = self._transition(x, times.repeat(n), repeated)
            mean, std = mean.view(n, k, *self.chunk_shape), std.view(n, k, *self.chunk_shape)
        else:
            means, stds = [], []
            for step in range(k):
                _, mean, std = self._transition(chain[:, step], times[step].expand(n), context)
                means.append(mean)
                stds.append(std)
            mean, std = torch.stack(means, 1), torch.stack(stds, 1)
        return *self._chain_scores(chain, mean, std, stochastic), self.value(obs, context)

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
        obs,
        actions: torch.Tensor,
        mask: torch.Tensor,
        t: torch.Tensor | None = None,
        eps: torch.Tensor | None = None,
        count: float | None = None,
    ) -> torch.Tensor:
        """Flow-matching loss on expert chunks: ``actions`` [N, H, env numbers] in the
        env's units, ``mask`` [N, H] (1 on real actions; chunks cut by an episode's end
        are padded), averaged over the real elements of the env's numbers. The actions
        are taken to the backbone's units (``from_env``) and zero-padded to its numbers;
        ``eps`` [N, H, backbone's numbers] noises every number (sampling starts them all
        from N(0, 1); PI0's own loss, openpi and lerobot draw it so). ``t`` [N] and
        ``eps`` are drawn when not given; ``count``: the number of real elements to
        average over (default: this batch's; a process holding part of a larger batch
        passes the whole batch's)."""
        t = torch.rand(actions.shape[0], device=obs.device) if t is None else t
        actions = self.backbone.from_env(actions)
        actions = torch.nn.functional.pad(actions, (0, self.action_dim - actions.shape[-1]))
        eps = torch.randn_like(actions) if eps is None else eps
        if eps.shape != actions.shape:
            raise OmniRLError(
                f"bc_loss: eps {tuple(eps.shape)} must noise the backbone's {self.action_dim} action numbers "
                f"({tuple(actions.shape)})"
            )
        context = self.backbone.encode(obs)
        x_t = t[:, None, None] * eps + (1 - t[:, None, None]) * actions
        error = (self.velocity(x_t, t, context) - (eps - actions))[..., : self.env_action_dim] ** 2
        weights = mask[:, :, None].expand_as(error)
        count = weights.sum() if count is None else torch.tensor(float(count), device=obs.device)
        return (error * weights).sum() / count.clamp(min=1.0)
