"""The flow policy section (``policy:``): the flow-matching action-chunk policy and
how RL samples it (see ``omni_rl.models.flow_policy``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from omni_rl.config import require


@dataclass
class FlowPolicyConfig:
    """The flow-matching action-chunk policy and how RL samples it."""

    horizon: int = 4
    """Actions per chunk (H)."""
    executed: int = 4
    """Actions of a chunk run before the policy is queried again (h <= H)."""
    denoise_steps: int = 4
    """Denoising steps K."""
    width: int = 256
    """Hidden width of the networks."""
    encoder: str = "mlp"
    """Observation encoder (registry name)."""
    method: Literal["flow_noise", "flow_sde"] = "flow_noise"
    """Flow-Noise (learned noise head) or Flow-SDE (ODE-to-SDE conversion)."""
    sigma_min: float = 0.08
    """Flow-Noise: smallest std of the noise head."""
    sigma_max: float = 0.16
    """Flow-Noise: largest std of the noise head."""
    noise_steps: Literal["all", "last"] = "all"
    """Flow-Noise: the noise head samples at every denoising step (pi_RL) or at the last alone
    (its noise reaches the action; the flow erases earlier noise)."""
    noise_level: float = 0.5
    """Flow-SDE: a in sigma_t = a * sqrt(t / (1 - t))."""
    noise_level_end: float | None = None
    """Flow-SDE: a at the last PPO iteration, reached linearly from noise_level (explore
    widely first, then sample near the deterministic path); None: a stays noise_level."""
    sde_mode: Literal["hybrid", "chain"] = "hybrid"
    """Flow-SDE: one stochastic step per query (hybrid) or all steps (chain)."""
    hybrid_step: Literal["last", "late", "uniform"] = "last"
    """Flow-SDE hybrid's stochastic step: the last one (its noise reaches the action; the
    flow erases earlier noise), drawn with weight k + 1 (late), or uniformly (pi_RL)."""
    value_input: Literal["obs", "features"] = "obs"
    """What the critic reads: the observation through its own MLP, or the encoder's detached features."""
    logprob: Literal["sum", "mean"] = "sum"
    """With ppo.ratio chunk: a chunk's log-prob is the sum over executed actions and dims, or their mean (RLinf)."""

    def __post_init__(self):
        require(1 <= self.executed <= self.horizon, "executed", "must be within 1..horizon")
        require(self.denoise_steps >= 1, "denoise_steps", "must be >= 1")
        require(0 < self.sigma_min <= self.sigma_max, "sigma_min", "need 0 < sigma_min <= sigma_max")
        require(self.noise_level > 0, "noise_level", "must be > 0")
        require(self.noise_level_end is None or self.noise_level_end > 0, "noise_level_end", "must be > 0")
        require(
            self.noise_level_end is None or self.method == "flow_sde",
            "noise_level_end",
            "is Flow-SDE's; Flow-Noise learns its noise (sigma_min, sigma_max)",
        )
        require(
            self.method == "flow_noise" or self.noise_steps == "all",
            "noise_steps",
            "is Flow-Noise's; Flow-SDE picks its steps with sde_mode and hybrid_step",
        )
