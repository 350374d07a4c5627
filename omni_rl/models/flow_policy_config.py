"""The flow policy section (``policy:``): the flow-matching action-chunk policy and
how RL samples it (see ``omni_rl.models.flow_policy``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from omni_rl.config import ModeDefaults, require, require_unset
from omni_rl.models.config import LoRAConfig


@dataclass
class FlowPolicyConfig(ModeDefaults):
    """The flow-matching action-chunk policy and how RL samples it. Fields of one
    sampling method (or one PPO mode) are unset by default, meaning their default
    in that mode, and refused in the others, where they would do nothing."""

    UNSET: ClassVar[dict[str, Any]] = {
        "sigma_min": 0.08,
        "sigma_max": 0.16,
        "noise_steps": "all",
        "noise_level": 0.5,
        "sde_mode": "hybrid",
        "hybrid_step": "last",
        "logprob": "sum",
        "train_vlm": "bc",
    }

    type: Literal["mlp", "pi0", "pi05"] = "mlp"
    """The policy family: MLPs over state vectors, or a VLA loaded from ``path`` for envs
    with pixels and language (PixelTargets-v0): pi_0 (transformers' PI0: a VLM prefix
    over a camera image and an instruction, and an action expert) or pi_0.5 (PI05: the
    state written into the prompt, the time into the expert's norms)."""
    path: str | None = None
    """pi0, pi05: the checkpoint directory with its processor (a released one, or what
    ``omni-rl tiny-model --family pi0`` or ``pi05`` writes); flow_ppo needs it, the VLA
    quickstart writes a tiny one when it is unset."""
    train_vlm: Literal["never", "bc", "always"] | None = None
    """pi0: when the VLM trains beside the action expert and heads: never, in behaviour
    cloning only (unset: pi_0's fine-tuning, then pi_RL's RL on the expert), or in both."""
    vlm_lora: LoRAConfig | None = None
    """pi0: where the VLM trains (``train_vlm``), low-rank adapters (peft) on its language
    model's ``target_modules`` train instead of its weights; the exported checkpoint
    holds the merged weights. None: the VLM's weights themselves train."""
    horizon: int = 4
    """Actions per chunk (H); pi0: the checkpoint is loaded with this chunk_size (its
    weights do not depend on it; pi_RL predicts 8 on ManiSkill and executes 5)."""
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
    sigma_min: float | None = None
    """Flow-Noise: smallest std of the noise head; unset: 0.08."""
    sigma_max: float | None = None
    """Flow-Noise: largest std of the noise head; unset: 0.16."""
    noise_steps: Literal["all", "last"] | None = None
    """Flow-Noise: the noise head samples at every denoising step (pi_RL; unset) or at the
    last alone (its noise reaches the action; the flow erases earlier noise)."""
    noise_level: float | None = None
    """Flow-SDE: a in sigma_t = a * sqrt(t / (1 - t)); unset: 0.5."""
    noise_level_end: float | None = None
    """Flow-SDE: a at the last PPO iteration, reached linearly from noise_level (explore
    widely first, then sample near the deterministic path); None: a stays noise_level."""
    sde_mode: Literal["hybrid", "chain"] | None = None
    """Flow-SDE: one stochastic step per query (hybrid; unset) or all steps (chain)."""
    hybrid_step: Literal["last", "late", "uniform"] | None = None
    """Flow-SDE hybrid's stochastic step: the last one (unset; its noise reaches the action,
    the flow erases earlier noise), drawn with weight k + 1 (late), or uniformly (pi_RL)."""
    value_input: Literal["obs", "features"] | None = None
    """What the critic reads: a privileged state through its own MLP (obs), or the
    backbone's detached features; unset: the backbone's choice (obs for type mlp, whose
    observation is the state; features for pi0). Refused with ppo.critic_free, which
    has no critic."""
    logprob: Literal["sum", "mean"] | None = None
    """With ppo.ratio chunk: a chunk's log-prob is the sum over executed actions and dims
    (unset), or their mean (which scales the log-ratio by 1 / their count, and so
    widens the effective clip range). Refused with ppo.ratio element."""

    @property
    def vla(self) -> bool:
        """Whether the policy is a VLA (a checkpoint at ``path`` with a VLM)."""
        return self.type != "mlp"

    def __post_init__(self):
        if self.vla:
            never = "train_vlm: never (the VLM never trains)"
            require(
                self.vlm_lora is None or self.setting("train_vlm") != "never", "vlm_lora", f"does nothing under {never}"
            )
            require(self.encoder == "mlp", "encoder", f"a {self.type} policy's VLM encodes its observations")
        else:
            require(self.path is None, "path", "is read by the VLA policy types (pi0, pi05) only")
            require_unset({"train_vlm": self.train_vlm, "vlm_lora": self.vlm_lora}, "type: mlp (no VLM)")
        require(1 <= self.executed <= self.horizon, "executed", "must be within 1..horizon")
        require(self.denoise_steps >= 1, "denoise_steps", "must be >= 1")
        if self.method == "flow_noise":
            unused = ("noise_level", "noise_level_end", "sde_mode", "hybrid_step")
            require_unset({n: getattr(self, n) for n in unused}, "method: flow_noise (its noise head learns the std)")
        else:
            unused = ("sigma_min", "sigma_max", "noise_steps")
            mode = "method: flow_sde (its std is noise_level's; sde_mode and hybrid_step pick the noisy steps)"
            require_unset({n: getattr(self, n) for n in unused}, mode)
        if self.setting("sde_mode") == "chain":
            require_unset({"hybrid_step": self.hybrid_step}, "sde_mode: chain (every step is stochastic)")
        low, high = self.setting("sigma_min"), self.setting("sigma_max")
        require(0 < low <= high, "sigma_min", f"need 0 < sigma_min <= sigma_max, got {low} and {high}")
        require(self.setting("noise_level") > 0, "noise_level", "must be > 0")
        require(self.noise_level_end is None or self.noise_level_end > 0, "noise_level_end", "must be > 0")
