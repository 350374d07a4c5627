"""The GRPO recipe's config: its update section (``algorithm:``) and root config."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from omni_rl.algorithms.losses import Aggregation
from omni_rl.config import require, require_unset
from omni_rl.data.config import DataConfig, check_eval
from omni_rl.engine.config import AdamWConfig, OptimizerConfig, TrainerConfig
from omni_rl.models.config import ModelConfig
from omni_rl.preprocess.config import MediaConfig
from omni_rl.recipes.logging_config import LoggingConfig
from omni_rl.registry import did_you_mean
from omni_rl.rewards.config import RewardsConfig
from omni_rl.rollout.config import RolloutConfig
from omni_rl.runtime import RunConfig

_CLIP_DEFAULTS = {"clipped": (0.2, 0.28), "gspo": (3e-4, 4e-4)}  # (eps_low, eps_high) per loss


@dataclass
class AlgorithmConfig:
    """The GRPO-family update."""

    advantage: str = "grpo"
    """Advantage estimator: grpo, dr_grpo, rloo or reinforce_pp."""
    loss: Literal["clipped", "gspo"] = "clipped"
    """Token-level clipped ratio (PPO/GRPO/DAPO) or sequence-level ratio (GSPO)."""
    eps_low: float | None = None
    """Lower clip range; unset: 0.2 for clipped, 3e-4 for gspo (the GSPO paper's)."""
    eps_high: float | None = None
    """Upper clip range; unset: 0.28 for clipped (clip-higher), 4e-4 for gspo."""
    dual_clip: float | None = None
    """Dual-clip constant c > 1 for negative advantages (clipped only); unset disables."""
    aggregation: Aggregation | None = None
    """How the clipped loss, KL and entropy average over tokens; unset: token-mean.
    Refused under gspo, which averages over sequences (see ``averaging``)."""
    kl_coef: float = 0.0
    """Weight of KL(policy || reference); 0 needs no reference model."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator."""
    kl_in_reward: bool = False
    """Subtract the KL from the reward instead of adding it to the loss."""
    entropy_coef: float = 0.0
    """Entropy bonus weight."""
    epochs: int = 1
    """Passes over each rollout batch (PPO epochs)."""
    mini_batch_prompts: int = 0
    """Prompts per optimizer step within a batch; 0 uses the whole batch."""
    dynamic_sampling: bool = False
    """Drop groups whose rewards are all equal and sample more prompts to refill."""
    max_resample_rounds: int = 3
    """Cap on extra sampling rounds per step with dynamic sampling."""
    overlong: Literal["none", "mask", "penalty"] = "none"
    """Truncated completions: kept, dropped from the loss, or softly penalized."""
    overlong_buffer: int = 64
    """Tokens before max_new_tokens where the soft penalty ramps up."""
    overlong_factor: float = 1.0
    """Size of the full overlong penalty."""
    rollout_correction: Literal["auto", "none", "tis", "mask"] = "auto"
    """Correction for the rollout engine sampling from a slightly different policy than
    the trainer scores: tis weighs each token's loss by min(pi/mu, cap) (truncated
    importance sampling); mask drops completions whose sequence ratio prod pi/mu leaves
    [1/cap, cap]; auto is tis with the vllm engine or a one-step-off rollout
    (``rollout.staleness: 1``) and none with hf (which then samples with the trainer's
    own weights). The mismatch itself is logged every step either way."""
    rollout_correction_cap: float = 2.0
    """The cap C of the correction (> 1)."""
    offline_responses: Literal["never", "always", "below"] = "never"
    """Rows' ``offline_response`` (a worked answer) in their groups: never; always, one
    completion of each such row's group replaced by it; below, only where the group's
    online accuracy is below ``offline_below``. Its behaviour log-prob is the trainer's
    own at rollout time, and its ratio is clipped like the others'."""
    offline_below: float | None = None
    """With ``offline_responses: below``: the online accuracy under which a group takes
    its row's offline answer (in (0, 1])."""

    def __post_init__(self):
        from omni_rl.algorithms.advantages import ADVANTAGES

        require(
            self.advantage in ADVANTAGES,
            "advantage",
            f"unknown estimator '{self.advantage}'{did_you_mean(self.advantage, ADVANTAGES.names())}; "
            f"known: {', '.join(ADVANTAGES)}",
        )
        low, high = self.clip_range
        require(0 <= low < 1, "eps_low", f"need 0 <= eps_low < 1, got {low}")
        require(high >= 0, "eps_high", f"need eps_high >= 0, got {high}")
        require(self.dual_clip is None or self.dual_clip > 1, "dual_clip", "must be > 1")
        if self.loss == "gspo":
            require_unset(
                {"aggregation": self.aggregation, "dual_clip": self.dual_clip},
                "loss: gspo (its loss, KL and entropy average over sequences, and it clips one ratio per "
                "sequence, with no dual clip)",
            )
        require(self.kl_coef >= 0 and self.entropy_coef >= 0, "kl_coef", "coefficients must be >= 0")
        require(self.epochs >= 1, "epochs", "must be >= 1")
        require(self.mini_batch_prompts >= 0, "mini_batch_prompts", "must be >= 0")
        require(self.overlong_buffer >= 1, "overlong_buffer", "must be >= 1")
        require(self.overlong_factor >= 0, "overlong_factor", "must be >= 0 (a penalty)")
        require(self.max_resample_rounds >= 0, "max_resample_rounds", "must be >= 0")
        require(self.rollout_correction_cap > 1, "rollout_correction_cap", "must be > 1")
        if self.offline_responses == "below":
            below = self.offline_below
            require(
                below is not None and 0 < below <= 1, "offline_below", "offline_responses: below needs it in (0, 1]"
            )
        else:
            require_unset({"offline_below": self.offline_below}, f"offline_responses: {self.offline_responses}")

    @property
    def clip_range(self) -> tuple[float, float]:
        """(eps_low, eps_high) in force: the ones set, else the loss's own defaults."""
        low, high = _CLIP_DEFAULTS[self.loss]
        return (low if self.eps_low is None else self.eps_low, high if self.eps_high is None else self.eps_high)

    @property
    def averaging(self) -> Aggregation:
        """The aggregation in force for the policy loss, KL and entropy. ``aggregation``
        (token-mean when unset) for the clipped loss. GSPO's policy term is a mean over
        sequences, so its KL and entropy terms are too: each sequence's token mean,
        averaged over sequences (seq-mean-token-mean), all three divided by the batch's
        sequence count; the KL then weighs as much against the policy term as a
        token-mean KL does under the clipped loss, whatever the completions' length."""
        if self.loss == "gspo":
            return "seq-mean-token-mean"
        return self.aggregation or "token-mean"


@dataclass
class GRPOConfig:
    """GRPO-family RL of a vision/audio-language model against verifiable rewards."""

    run: RunConfig = field(default_factory=lambda: RunConfig(name="grpo", output_dir="runs/grpo"))
    """Output directory, seed and hardware."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Metrics backends: jsonl, tensorboard, wandb."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy."""
    data: DataConfig = field(default_factory=DataConfig)
    """Rows, prompts and batch size."""
    media: MediaConfig = field(default_factory=MediaConfig)
    """Decoding budgets (must match the cache's)."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Sampling."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """Advantages, loss and regularizers."""
    rewards: RewardsConfig = field(default_factory=RewardsConfig)
    """Scoring."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Steps, clipping, checkpoints."""
    optimizer: OptimizerConfig = field(default_factory=lambda: AdamWConfig(lr=1e-6))
    """The optimizer."""

    def __post_init__(self):
        check_eval(self.data, self.trainer)
        algo, longest = self.algorithm, self.rollout.max_new_tokens
        require(
            algo.overlong != "penalty" or algo.overlong_buffer <= longest,
            "algorithm.overlong_buffer",
            f"{algo.overlong_buffer} is more than rollout.max_new_tokens ({longest}): the penalty's ramp would "
            "start before the first token and penalize every completion",
        )
        require(
            not (self.media.use_audio_in_video and self.rollout.engine == "vllm"),
            "media.use_audio_in_video",
            "videos heard with their sound are not sent to vLLM yet; use rollout.engine: hf",
        )
        require(
            not (self.rollout.staleness and self.data.sampler.type == "ucb"),
            "rollout.staleness",
            "the UCB sampler learns from each step's advantages before it draws the next step's prompts, which "
            "a one-step-off rollout has drawn already; use data.sampler.type: uniform, or staleness: 0",
        )
