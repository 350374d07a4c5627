"""Typed configs: dataclasses loaded from YAML, overridden with ``--set a.b=c``.

A config file names its recipe at the top (``recipe: demo``), which picks the root
dataclass from ``RECIPE_CONFIGS``; every section below it is a dataclass whose fields
carry a one-line docstring. Sections with several implementations (optimizers, ...)
derive from ``Choice`` and pick their class by a ``type:`` key from a registry.

Everything a user can get wrong is a ``ConfigError`` that names the file, the dotted
key and the reason: an unknown key (with the closest valid key), a wrong type, a
value out of range (raised by a section's ``__post_init__`` through ``require``).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

import yaml

from omni_rl.errors import ConfigError
from omni_rl.registry import Registry, did_you_mean


class FieldError(ValueError):
    """Raised inside ``__post_init__``; the loader adds the file and section to it."""

    def __init__(self, field_name: str, message: str):
        super().__init__(message)
        self.field_name = field_name


def require(condition: bool, field_name: str, message: str) -> None:
    """Validation helper for ``__post_init__``: raise FieldError unless ``condition``."""
    if not condition:
        raise FieldError(field_name, message)


class Choice:
    """Base of a section chosen by its ``type:`` key from ``registry``."""

    registry: ClassVar[Registry]
    default_type: ClassVar[str]


# --------------------------------------------------------------------------- sections


def _require_family(name: str, field_name: str) -> None:
    from omni_rl.models.families import FAMILIES

    require(
        name in FAMILIES,
        field_name,
        f"unknown family '{name}'{did_you_mean(name, FAMILIES.names())}; known: {', '.join(FAMILIES)}",
    )


@dataclass
class RunConfig:
    """Where a run writes, and on what hardware."""

    name: str = "run"
    """A label for logs and metrics."""
    output_dir: str = "runs/run"
    """Directory for the resolved config, metrics, checkpoints and summaries."""
    seed: int = 0
    """Seed for Python, NumPy and torch."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """'auto' picks CUDA when available."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """'auto' is bfloat16 on CUDA and float32 on CPU."""
    threads: int | None = None
    """torch CPU threads; unset reads OMNI_RL_THREADS, else torch's default."""

    def __post_init__(self):
        require(self.threads is None or self.threads >= 1, "threads", "must be >= 1")


@dataclass
class LoRAConfig:
    """Low-rank adapters (peft); the reference policy is the base with adapters off."""

    rank: int = 16
    """Adapter rank r."""
    alpha: int = 32
    """Scaling numerator (the update is scaled by alpha / r)."""
    dropout: float = 0.0
    """Dropout on the adapter input."""
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    """Names of the linear layers that get adapters (in the language model)."""

    def __post_init__(self):
        require(self.rank >= 1, "rank", "must be >= 1")
        require(0 <= self.dropout < 1, "dropout", "must be in [0, 1)")


@dataclass
class ModelConfig:
    """Which checkpoint to load and which of its parameters train."""

    path: str | None = None
    """A local Hugging Face checkpoint directory; unset builds a tiny model."""
    tiny_family: str = "qwen2_5_vl"
    """Family of the tiny model built when ``path`` is unset."""
    tiny_width: int = 64
    """Decoder width of that tiny model (a multiple of 32; 64: ~0.2 M params, 128: ~0.6 M)."""
    freeze_vision_tower: bool = False
    """Keep the vision encoder's weights fixed."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward to save memory (the group forward then
    recomputes the shared prompt prefix per mini-batch)."""
    lora: LoRAConfig | None = None
    """Train low-rank adapters instead of the full model."""

    def __post_init__(self):
        _require_family(self.tiny_family, "tiny_family")
        require(self.tiny_width >= 32 and self.tiny_width % 32 == 0, "tiny_width", "must be a multiple of 32")


@dataclass
class GenerationConfig:
    """Sampling parameters for answers."""

    max_new_tokens: int = 16
    """Longest answer in tokens."""
    temperature: float = 0.0
    """0 decodes greedily."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    top_k: int = 0
    """Sample among the k most likely tokens; 0 disables."""

    def __post_init__(self):
        require(self.max_new_tokens >= 1, "max_new_tokens", "must be >= 1")
        require(self.temperature >= 0, "temperature", "must be >= 0")
        require(0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        require(self.top_k >= 0, "top_k", "must be >= 0")


@dataclass
class TrainerConfig:
    """The optimization loop."""

    steps: int = 30
    """Optimizer steps."""
    log_every: int = 5
    """Print and log metrics every this many steps."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this; 0 disables clipping."""
    warmup_steps: int = 0
    """Linear learning-rate warm-up from 0 over this many steps."""
    save_every: int = 0
    """Write a checkpoint every this many steps (0: only at the end)."""
    keep_last: int = 2
    """Checkpoints kept on disk."""

    def __post_init__(self):
        require(self.steps >= 1, "steps", "must be >= 1")
        require(self.log_every >= 1, "log_every", "must be >= 1")
        require(self.max_grad_norm >= 0, "max_grad_norm", "must be >= 0")
        require(self.warmup_steps >= 0, "warmup_steps", "must be >= 0")
        require(self.save_every >= 0, "save_every", "must be >= 0")
        require(self.keep_last >= 1, "keep_last", "must be >= 1")


OPTIMIZERS: Registry[type] = Registry("optimizer")


@dataclass
class OptimizerConfig(Choice):
    """An optimizer, chosen by ``type:``."""

    registry: ClassVar[Registry] = OPTIMIZERS
    default_type: ClassVar[str] = "adamw"

    lr: float = 1e-5
    """Learning rate."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""

    def __post_init__(self):
        require(self.lr > 0, "lr", "must be > 0")
        require(self.weight_decay >= 0, "weight_decay", "must be >= 0")

    def build(self, params: Iterable) -> Any:
        """The torch optimizer over ``params``."""
        raise NotImplementedError


@OPTIMIZERS.register("adamw")
@dataclass
class AdamWConfig(OptimizerConfig):
    """torch.optim.AdamW."""

    betas: tuple[float, float] = (0.9, 0.999)
    """Adam's moment decay rates."""
    eps: float = 1e-8
    """Adam's denominator epsilon."""

    def build(self, params: Iterable) -> Any:
        import torch

        return torch.optim.AdamW(params, lr=self.lr, betas=self.betas, eps=self.eps, weight_decay=self.weight_decay)


@OPTIMIZERS.register("sgd")
@dataclass
class SGDConfig(OptimizerConfig):
    """torch.optim.SGD with momentum."""

    momentum: float = 0.9
    """Momentum factor."""

    def build(self, params: Iterable) -> Any:
        import torch

        return torch.optim.SGD(params, lr=self.lr, momentum=self.momentum, weight_decay=self.weight_decay)


@dataclass
class DemoVideoConfig:
    """The generated clip the demo asks about: a square crossing a plain background."""

    direction: Literal["left", "right", "up", "down"] = "right"
    """Where the square moves; the answer the demo teaches."""
    seconds: float = 2.0
    """Clip length."""
    fps: int = 15
    """Frame rate of the encoded clip."""
    width: int = 160
    """Frame width in pixels."""
    height: int = 120
    """Frame height in pixels."""
    sample_fps: float = 2.0
    """Frames per second handed to the model."""

    def __post_init__(self):
        require(self.seconds > 0, "seconds", "must be > 0")
        require(self.fps >= 1, "fps", "must be >= 1")
        require(self.width >= 32 and self.height >= 32, "width", "frames must be at least 32x32")
        require(self.sample_fps > 0, "sample_fps", "must be > 0")


@dataclass
class MediaConfig:
    """How media are decoded, sampled and resized (qwen-vl-utils' rules), and where they
    may live. Every field that changes the output is part of the cache key; unset pixel
    budgets take qwen-vl-utils' defaults for the family's patch size."""

    family: str = "qwen2_5_vl"
    """Model family; fixes the patch size (14 for Qwen2/2.5-VL and Omni, 16 for Qwen3-VL)."""
    fps: float | None = 2.0
    """Frames sampled per second of video (unset: use ``nframes``)."""
    nframes: int | None = None
    """A fixed number of frames per video instead of ``fps``."""
    min_frames: int = 4
    """Fewest frames sampled by ``fps``."""
    max_frames: int = 768
    """Most frames sampled by ``fps``."""
    video_min_pixels: int | None = None
    """Smallest frame area after resizing."""
    video_max_pixels: int | None = None
    """Largest frame area after resizing."""
    video_total_pixels: int | None = None
    """Budget over all frames of a video; caps each frame's area at total / frames * 2."""
    image_min_pixels: int | None = None
    """Smallest image area after resizing."""
    image_max_pixels: int | None = None
    """Largest image area after resizing."""
    max_audio_seconds: float = 30.0
    """Audio is cut to this length (Whisper-style encoders take 30 s)."""
    use_audio_in_video: bool = False
    """Also decode each video's own audio track."""
    media_root: str | None = None
    """The only directory absolute media paths may point into."""

    def __post_init__(self):
        _require_family(self.family, "family")
        require(self.fps is not None or self.nframes is not None, "fps", "set fps or nframes")
        require(self.fps is None or self.nframes is None, "nframes", "set fps or nframes, not both")
        require(self.fps is None or self.fps > 0, "fps", "must be > 0")
        require(self.nframes is None or self.nframes >= 2, "nframes", "must be >= 2")
        require(2 <= self.min_frames <= self.max_frames, "min_frames", "need 2 <= min_frames <= max_frames")
        require(self.max_audio_seconds > 0, "max_audio_seconds", "must be > 0")
        for name in (
            "video_min_pixels",
            "video_max_pixels",
            "video_total_pixels",
            "image_min_pixels",
            "image_max_pixels",
        ):
            value = getattr(self, name)
            require(value is None or value > 0, name, "must be > 0")
        for kind in ("video", "image"):
            low, high = getattr(self, f"{kind}_min_pixels"), getattr(self, f"{kind}_max_pixels")
            require(low is None or high is None or low <= high, f"{kind}_max_pixels", f"must be >= {kind}_min_pixels")


@dataclass
class RewardsConfig:
    """How completions are scored (see ``omni_rl.rewards``)."""

    template: Literal["think_answer", "answer_only"] = "think_answer"
    """Response template the format score checks."""
    accuracy_weight: float = 0.9
    """Weight of accuracy in the total reward."""
    format_weight: float = 0.1
    """Weight of format in the total reward."""
    weights: dict[str, tuple[float, float]] = field(default_factory=dict)
    """Per problem type (accuracy, format) weights, e.g. {ocr: [1.0, 0.0]}."""
    math_timeout: float = 2.0
    """Hard limit in seconds on one math verification."""
    workers: int = 2
    """Processes verifying math answers in parallel."""
    custom: dict[str, str] = field(default_factory=dict)
    """User scorers: {problem_type: 'package.module:function'}."""

    def __post_init__(self):
        require(self.accuracy_weight >= 0 and self.format_weight >= 0, "accuracy_weight", "weights must be >= 0")
        for name, pair in self.weights.items():
            require(all(w >= 0 for w in pair), "weights", f"weights of '{name}' must be >= 0")
        require(self.math_timeout > 0, "math_timeout", "must be > 0")
        require(self.workers >= 1, "workers", "must be >= 1")

    def settings(self):
        """The ``RewardSettings`` the scorers take."""
        from omni_rl.rewards import RewardSettings

        return RewardSettings(
            template=self.template,
            accuracy_weight=self.accuracy_weight,
            format_weight=self.format_weight,
            weights=dict(self.weights),
            math_timeout=self.math_timeout,
        )


@dataclass
class DataConfig:
    """The training (and evaluation) rows and how they become prompts."""

    train: str = ""
    """A JSONL or Parquet dataset (media paths relative to its folder)."""
    eval: str | None = None
    """A held-out dataset for evaluation."""
    cache: str | None = None
    """A cache made by ``omni-rl preprocess`` with the same media settings."""
    cache_mode: Literal["prefer_cache", "cache_only", "no_cache"] = "prefer_cache"
    """How the cache is used (see omni_rl.data.dataset)."""
    prompt_template: str = "{problem}{options}"
    """The question shown to the model; fields: {problem}, {options} and any row field."""
    prompts_per_step: int = 4
    """Prompts sampled per step (each gets rollout.n completions)."""
    shuffle: bool = True
    """Visit the rows in a seeded random order, reshuffled every epoch."""
    strict: bool = False
    """Rows whose answers cannot be scored are errors instead of skips."""

    def __post_init__(self):
        require(self.prompts_per_step >= 1, "prompts_per_step", "must be >= 1")


@dataclass
class VLLMConfig:
    """The vLLM engine (rollout.engine: vllm; GPU machines with the vllm extra)."""

    gpu_memory_utilization: float = 0.5
    """Share of GPU memory vLLM may take (the trainer needs the rest)."""
    tensor_parallel_size: int = 1
    """GPUs one engine spans."""
    max_model_len: int = 32768
    """Longest prompt plus completion, in tokens."""
    enforce_eager: bool = False
    """Skip CUDA graph capture (slower decoding, faster start)."""

    def __post_init__(self):
        require(0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization", "must be in (0, 1]")
        require(self.tensor_parallel_size >= 1, "tensor_parallel_size", "must be >= 1")


@dataclass
class RolloutConfig:
    """How completions are sampled during training."""

    engine: Literal["hf", "vllm"] = "hf"
    """Generation engine: hf (CPUs and GPUs, samples with the policy itself) or vllm
    (GPUs, ``pip install omni-rl[vllm]``; weights copied in after each update)."""
    vllm: VLLMConfig = field(default_factory=VLLMConfig)
    """vLLM engine settings (used when engine is vllm)."""
    n: int = 8
    """Completions per prompt (the group size G)."""
    temperature: float = 1.0
    """Sampling temperature (> 0)."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    top_k: int = 0
    """Sample among the k most likely tokens; 0 disables."""
    max_new_tokens: int = 256
    """Longest completion."""
    max_prompt_length: int = 16384
    """Prompts longer than this (media tokens included) are skipped and counted."""

    def __post_init__(self):
        require(self.n >= 2, "n", "GRPO needs at least 2 completions per prompt")
        require(self.temperature > 0, "temperature", "must be > 0 for RL")
        require(0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        require(self.max_new_tokens >= 1, "max_new_tokens", "must be >= 1")


@dataclass
class AlgorithmConfig:
    """The GRPO-family update."""

    advantage: str = "grpo"
    """Advantage estimator: grpo, dr_grpo, rloo or reinforce_pp."""
    loss: Literal["clipped", "gspo"] = "clipped"
    """Token-level clipped ratio (PPO/GRPO/DAPO) or sequence-level ratio (GSPO)."""
    eps_low: float = 0.2
    """Lower clip range."""
    eps_high: float = 0.28
    """Upper clip range (clip-higher)."""
    dual_clip: float | None = None
    """Dual-clip constant c > 1 for negative advantages; unset disables."""
    aggregation: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "token-mean"
    """How per-token losses are averaged."""
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

    def __post_init__(self):
        from omni_rl.algorithms.advantages import ADVANTAGES

        require(
            self.advantage in ADVANTAGES,
            "advantage",
            f"unknown estimator '{self.advantage}'{did_you_mean(self.advantage, ADVANTAGES.names())}; "
            f"known: {', '.join(ADVANTAGES)}",
        )
        require(0 <= self.eps_low < 1 and self.eps_high >= 0, "eps_low", "need 0 <= eps_low < 1 and eps_high >= 0")
        require(self.dual_clip is None or self.dual_clip > 1, "dual_clip", "must be > 1")
        require(self.kl_coef >= 0 and self.entropy_coef >= 0, "kl_coef", "coefficients must be >= 0")
        require(self.epochs >= 1, "epochs", "must be >= 1")
        require(self.mini_batch_prompts >= 0, "mini_batch_prompts", "must be >= 0")
        require(self.overlong_buffer >= 1, "overlong_buffer", "must be >= 1")


# ------------------------------------------------------------------------- root configs

RECIPE_CONFIGS: Registry[type] = Registry("recipe")


@RECIPE_CONFIGS.register("preprocess")
@dataclass
class PreprocessConfig:
    """Offline caching of a dataset's media (``omni-rl preprocess``)."""

    media: MediaConfig = field(default_factory=MediaConfig)
    """Decoding, sampling and resizing parameters."""
    rewards: RewardsConfig = field(default_factory=RewardsConfig)
    """Scoring, for checking that every row's problem type and answer can be scored."""


@RECIPE_CONFIGS.register("grpo")
@dataclass
class GRPOConfig:
    """GRPO-family RL of a vision/audio-language model against verifiable rewards."""

    run: RunConfig = field(default_factory=lambda: RunConfig(name="grpo", output_dir="runs/grpo"))
    """Output directory, seed and hardware."""
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
        require(bool(self.data.train), "data", "data.train must name a dataset file")


@dataclass
class SFTSection:
    """What the model is taught to answer."""

    target_template: str = "<answer>{answer}</answer>"
    """The target completion, filled with the row's fields ({answer}, {solution}, ...)."""


@RECIPE_CONFIGS.register("sft")
@dataclass
class SFTConfig:
    """Supervised fine-tuning (a cold start before RL) on the same data and models."""

    run: RunConfig = field(default_factory=lambda: RunConfig(name="sft", output_dir="runs/sft"))
    """Output directory, seed and hardware."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The model."""
    data: DataConfig = field(default_factory=DataConfig)
    """Rows, prompts and batch size."""
    media: MediaConfig = field(default_factory=MediaConfig)
    """Decoding budgets (must match the cache's)."""
    sft: SFTSection = field(default_factory=SFTSection)
    """Targets."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Steps, clipping, checkpoints."""
    optimizer: OptimizerConfig = field(default_factory=lambda: AdamWConfig(lr=1e-5))
    """The optimizer."""

    def __post_init__(self):
        require(bool(self.data.train), "data", "data.train must name a dataset file")


@dataclass
class SimEnvConfig:
    """The batched simulation environments."""

    task: str = "PushCube-v1"
    """ManiSkill task id (PushCube-v1, PickCube-v1, ...) or PointMass-v0 (pure torch)."""
    num_envs: int = 8
    """Environments stepped in parallel."""
    backend: Literal["auto", "cpu", "gpu"] = "auto"
    """cpu: one env per process; gpu: ManiSkill's batched GPU simulation; auto: gpu when CUDA is there."""
    obs_mode: str = "state"
    """Observation mode (state vectors)."""
    control_mode: str = "pd_ee_delta_pos"
    """Controller the actions drive."""
    max_episode_steps: int = 50
    """Episode length; one training iteration runs one episode's worth of steps per env."""
    ignore_terminations: bool = True
    """Run episodes to the time limit even after success (judged by success_once): with a
    dense reward, ending the episode on success would pay less than hovering near it."""

    def __post_init__(self):
        require(self.num_envs >= 1, "num_envs", "must be >= 1")
        require(self.max_episode_steps >= 1, "max_episode_steps", "must be >= 1")


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
    noise_level: float = 0.5
    """Flow-SDE: a in sigma_t = a * sqrt(t / (1 - t))."""
    sde_mode: Literal["hybrid", "chain"] = "hybrid"
    """Flow-SDE: one random stochastic step per query (hybrid) or all steps (chain)."""
    logprob: Literal["sum", "mean"] = "sum"
    """A chunk's log-prob: the sum over executed actions and dims, or their mean (RLinf)."""

    def __post_init__(self):
        require(1 <= self.executed <= self.horizon, "executed", "must be within 1..horizon")
        require(self.denoise_steps >= 1, "denoise_steps", "must be >= 1")
        require(0 < self.sigma_min <= self.sigma_max, "sigma_min", "need 0 < sigma_min <= sigma_max")
        require(self.noise_level > 0, "noise_level", "must be > 0")


@dataclass
class PPOConfig:
    """PPO over action chunks (or the critic-free GRPO variant)."""

    gamma: float = 0.99
    """Discount per chunk."""
    lam: float = 0.95
    """GAE lambda."""
    clip_low: float = 0.2
    """Lower ratio clip (1 - clip_low)."""
    clip_high: float = 0.28
    """Upper ratio clip (1 + clip_high)."""
    ratio: Literal["chunk", "element"] = "chunk"
    """One ratio per chunk, or one per action element."""
    value_clip: float | None = 0.2
    """Keep the new value within this of the old one in the loss (None: off)."""
    huber_delta: float = 10.0
    """Huber loss threshold of the value loss."""
    value_coef: float = 0.5
    """Weight of the value loss."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus."""
    normalize_advantages: bool = True
    """Zero-mean, unit-std advantages per mini-batch."""
    actor_lr: float = 3e-4
    """Learning rate of the encoder, velocity and noise networks."""
    critic_lr: float = 1e-3
    """Learning rate of the value head."""
    max_grad_norm: float = 1.0
    """Global gradient-norm clip (0: off)."""
    epochs: int = 4
    """Passes over each rollout batch."""
    minibatches: int = 4
    """Mini-batches per pass."""
    critic_free: bool = False
    """GRPO variant: groups of episodes from one initial state, advantage = normalized return."""
    group_size: int = 4
    """Critic-free: episodes per initial state (num_envs must be a multiple)."""

    def __post_init__(self):
        require(0 < self.gamma <= 1, "gamma", "must be in (0, 1]")
        require(0 <= self.lam <= 1, "lam", "must be in [0, 1]")
        require(self.epochs >= 1 and self.minibatches >= 1, "epochs", "epochs and minibatches must be >= 1")
        require(self.group_size >= 2, "group_size", "must be >= 2")


@dataclass
class FlowTrainerConfig:
    """The outer loop of flow-policy RL."""

    iterations: int = 100
    """Rollout-and-update iterations (each: one episode's worth of steps in every env)."""
    eval_every: int = 10
    """Evaluate success on held-out seeds every this many iterations (0: only at the end)."""
    eval_episodes: int = 50
    """Held-out episodes per evaluation."""
    eval_seed: int = 1_000_000
    """First held-out seed (training never uses seeds this high)."""
    save_every: int = 0
    """Checkpoint every this many iterations (0: only at the end)."""
    keep_last: int = 2
    """Checkpoints kept on disk."""

    def __post_init__(self):
        require(self.iterations >= 1, "iterations", "must be >= 1")
        require(self.eval_episodes >= 1, "eval_episodes", "must be >= 1")


@dataclass
class BCConfig:
    """Behaviour cloning from demonstrations before RL (the warm start)."""

    demos: str | None = None
    """Demonstrations file (omni-rl sim collect-demos); unset: no warm start."""
    episodes: int | None = None
    """Use only the first this many demo episodes (few-shot SFT); unset: all."""
    steps: int = 1000
    """Optimizer steps."""
    lr: float = 1e-3
    """Learning rate."""
    batch_size: int = 256
    """Chunks per step."""


@RECIPE_CONFIGS.register("flow_ppo")
@dataclass
class FlowPPOConfig:
    """``omni-rl train``: behaviour cloning, then Flow-Noise / Flow-SDE PPO in simulation."""

    run: RunConfig = field(default_factory=lambda: RunConfig(name="flow_ppo", output_dir="runs/flow_ppo"))
    """Output directory, seed and hardware."""
    env: SimEnvConfig = field(default_factory=SimEnvConfig)
    """The environments."""
    policy: FlowPolicyConfig = field(default_factory=FlowPolicyConfig)
    """The policy."""
    ppo: PPOConfig = field(default_factory=PPOConfig)
    """The update."""
    trainer: FlowTrainerConfig = field(default_factory=FlowTrainerConfig)
    """The loop."""
    bc: BCConfig = field(default_factory=BCConfig)
    """The warm start."""

    def __post_init__(self):
        if self.ppo.critic_free and self.env.num_envs % self.ppo.group_size:
            raise FieldError("env.num_envs", "must be a multiple of ppo.group_size with ppo.critic_free")


@RECIPE_CONFIGS.register("quickstart_sim")
@dataclass
class QuickstartSimConfig:
    """``omni-rl quickstart --sim``: scripted demos, behaviour cloning to a partial start,
    Flow-Noise PPO on CPU ManiSkill envs, held-out success before and after."""

    run: RunConfig = field(
        default_factory=lambda: RunConfig(name="quickstart_sim", output_dir="runs/quickstart_sim", threads=2)
    )
    """Output directory, seed and hardware."""
    demo_episodes: int = 5
    """Expert episodes collected for the warm start (from seeds the evaluation never uses)."""
    env: SimEnvConfig = field(default_factory=lambda: SimEnvConfig(task="PushCube-v1", num_envs=8, backend="cpu"))
    """The environments."""
    policy: FlowPolicyConfig = field(default_factory=lambda: FlowPolicyConfig(logprob="mean"))
    """The policy (log-probs averaged per element keep the chunk ratio near 1)."""
    ppo: PPOConfig = field(default_factory=lambda: PPOConfig(actor_lr=5e-5))
    """The update (a small actor rate keeps the cloned policy from drifting)."""
    trainer: FlowTrainerConfig = field(
        default_factory=lambda: FlowTrainerConfig(iterations=300, eval_every=50, eval_episodes=100)
    )
    """The loop (held-out success is measured on ``eval_episodes`` seeds)."""
    bc: BCConfig = field(default_factory=lambda: BCConfig(steps=500))
    """Behaviour cloning (its ``demos`` is the collected file)."""

    def __post_init__(self):
        require(self.demo_episodes >= 1, "demo_episodes", "must be >= 1")


@dataclass
class QuickstartData:
    """The synthetic video-QA set of the quickstart."""

    train_videos: int = 200
    """Training scenes (4 questions each)."""
    heldout_videos: int = 50
    """Held-out scenes, never trained on."""
    seconds: float = 2.0
    """Clip length."""
    fps: int = 8
    """Clip frame rate."""
    width: int = 96
    """Frame width."""
    height: int = 72
    """Frame height."""
    sft_fraction: float = 0.5
    """Part of the training set used for the SFT cold start."""
    blank_frames: bool = False
    """Control run: the same questions over empty frames (accuracy should stay near chance)."""
    shuffle_options: bool = False
    """Shuffle multiple-choice options; off, the letter is the class (learnable by a tiny model)."""
    uniform_scenes: bool = True
    """Shapes of one colour moving one way (questions about all of them, the whole
    palette as colour options); off, each shape has its own colour and direction."""
    prompt_template: str = "{problem}{options}"
    """How rows become questions."""

    def __post_init__(self):
        require(self.train_videos >= 2 and self.heldout_videos >= 1, "train_videos", "need >= 2 train, >= 1 held out")
        require(0 < self.sft_fraction <= 1, "sft_fraction", "must be in (0, 1]")


@dataclass
class QuickstartModel:
    """The tiny model the quickstart builds (its family is ``media.family``)."""

    width: int = 128
    """Decoder width (128: about 0.6 M params, which learns the colour question in
    a few hundred steps; 64 barely sees the video)."""

    def __post_init__(self):
        require(self.width >= 32 and self.width % 32 == 0, "width", "must be a multiple of 32")


@dataclass
class QuickstartSFT:
    """The SFT cold start."""

    steps: int = 300
    """Optimizer steps."""
    lr: float = 2e-3
    """Learning rate."""
    prompts_per_step: int = 8
    """Batch size."""


@dataclass
class QuickstartGRPO:
    """The GRPO phase."""

    steps: int = 600
    """Optimizer steps."""
    lr: float = 2e-4
    """Learning rate (higher rates collapse the tiny model to empty answers)."""
    n: int = 8
    """Completions per prompt."""
    prompts_per_step: int = 8
    """Prompts per step."""
    max_new_tokens: int = 40
    """Longest completion (the tiny tokenizer spends one token per byte)."""
    temperature: float = 1.0
    """Sampling temperature."""
    advantage: str = "grpo"
    """Advantage estimator."""
    dynamic_sampling: bool = False
    """Replace groups whose rewards are all equal (costs extra rollout rounds)."""


@RECIPE_CONFIGS.register("quickstart")
@dataclass
class QuickstartConfig:
    """``omni-rl quickstart``: synthetic data, cache, tiny model, SFT, eval, GRPO, eval."""

    run: RunConfig = field(
        default_factory=lambda: RunConfig(name="quickstart", output_dir="runs/quickstart", threads=2)
    )
    """Output directory, seed and hardware."""
    media: MediaConfig = field(
        default_factory=lambda: MediaConfig(min_frames=2, max_frames=8, video_min_pixels=3136, video_max_pixels=12544)
    )
    """Frame sampling and budgets (small, for a CPU)."""
    data: QuickstartData = field(default_factory=QuickstartData)
    """The synthetic set."""
    model: QuickstartModel = field(default_factory=QuickstartModel)
    """The tiny model."""
    sft: QuickstartSFT = field(default_factory=QuickstartSFT)
    """The cold start."""
    grpo: QuickstartGRPO = field(default_factory=QuickstartGRPO)
    """The RL phase."""


@RECIPE_CONFIGS.register("demo")
@dataclass
class DemoConfig:
    """The end-to-end demo: build or load a model, ask it which way a square moves in a
    generated clip, teach it the answer with supervised steps, ask again."""

    run: RunConfig = field(default_factory=lambda: RunConfig(name="demo", output_dir="runs/demo"))
    """Output directory, seed and hardware."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The checkpoint (or tiny family)."""
    video: DemoVideoConfig = field(default_factory=DemoVideoConfig)
    """The generated clip."""
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    """How answers are decoded."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """The supervised steps."""
    optimizer: OptimizerConfig = field(default_factory=lambda: AdamWConfig(lr=1e-3))
    """The optimizer of those steps."""


# ---------------------------------------------------------------------------- loading


def _describe(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 60 else text[:57] + '...'}"


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(tp: Any, value: Any, where: str) -> Any:
    """``value`` checked and converted to the annotation ``tp``; ConfigError otherwise."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(arg, value, where)
            except ConfigError as err:
                errors.append(str(err))
        if len(errors) == 1:
            raise ConfigError(errors[0])
        raise ConfigError(f"{where}: expected {_type_name(tp)}, got {_describe(value)}")
    if origin is Literal:
        if value not in args:
            choices = ", ".join(repr(a) for a in args)
            raise ConfigError(f"{where}: must be one of {choices}, got {value!r}")
        return value
    if isinstance(tp, type) and issubclass(tp, Choice):
        return _build_choice(tp, value, where)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, where)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {_describe(value)}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {_describe(value)}")
        return value
    if tp is float:
        # YAML 1.1 reads '1e-6' (no dot) as a string; accept any numeric spelling.
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {_describe(value)}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {_describe(value)}")
        return value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {_describe(value)}")
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            if len(value) != len(args):
                raise ConfigError(f"{where}: expected {len(args)} items, got {len(value)}")
            return tuple(_coerce(a, v, f"{where}[{i}]") for i, (a, v) in enumerate(zip(args, value, strict=True)))
        item = args[0] if args else Any
        items = [_coerce(item, v, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {_describe(value)}")
        key_tp, val_tp = args or (Any, Any)
        return {_coerce(key_tp, k, where): _coerce(val_tp, v, f"{where}.{k}") for k, v in value.items()}
    raise TypeError(f"config annotation {tp!r} at {where} is not supported")


def _build_choice(base: type, value: Any, where: str) -> Any:
    if isinstance(value, base):
        return value
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: expected a mapping with a 'type' key, got {_describe(value)}")
    value = dict(value)
    name = value.pop("type", base.default_type)
    if name not in base.registry:
        known = ", ".join(base.registry)
        raise ConfigError(
            f"{where}.type: unknown {base.registry.kind} '{name}'{did_you_mean(str(name), base.registry.names())}; "
            f"known: {known}"
        )
    return _build(base.registry.get(name), value, where)


def _build(cls: type, value: Any, where: str) -> Any:
    """An instance of dataclass ``cls`` from the mapping ``value``."""
    if isinstance(value, cls):
        return value
    if value is None:
        value = {}
    if not isinstance(value, dict):
        raise ConfigError(f"{where or 'config'}: expected a mapping, got {_describe(value)}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    kwargs = {}
    for key, raw in value.items():
        if key not in names:
            section = f"section '{where}'" if where else "the top level"
            raise ConfigError(
                f"{where + '.' if where else ''}{key}: unknown key '{key}' in {section}"
                f"{did_you_mean(str(key), names)}; valid keys: {', '.join(names)}"
            )
        kwargs[key] = _coerce(hints[key], raw, f"{where}.{key}" if where else key)
    try:
        return cls(**kwargs)
    except FieldError as err:
        name = f"{where}.{err.field_name}" if where else err.field_name
        raise ConfigError(f"{name}: {err}") from None


def parse_override(text: str) -> tuple[list[str], Any]:
    """``'a.b=c'`` -> (['a', 'b'], c) with c read as a YAML scalar (so typed)."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {text!r}: expected KEY=VALUE, e.g. trainer.steps=10")
    return key.strip().split("."), yaml.safe_load(raw) if raw.strip() else ""


def apply_overrides(raw: dict, overrides: Iterable[str]) -> dict:
    """A copy of the raw config mapping with each ``a.b=c`` override set."""
    import copy

    out = copy.deepcopy(raw)
    for text in overrides:
        keys, value = parse_override(text)
        node = out
        for depth, key in enumerate(keys[:-1]):
            child = node.get(key)
            if child is None:
                child = node[key] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"--set {text}: '{'.'.join(keys[: depth + 1])}' is not a section")
            node = child
        node[keys[-1]] = value
    return out


def config_from_dict(raw: dict, source: str = "config") -> Any:
    """The root config of ``raw['recipe']``, validated; errors name ``source``."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a mapping at the top level")
    raw = dict(raw)
    recipe = raw.pop("recipe", None)
    if recipe is None:
        raise ConfigError(f"{source}: missing 'recipe' key; known recipes: {', '.join(RECIPE_CONFIGS)}")
    if recipe not in RECIPE_CONFIGS:
        raise ConfigError(
            f"{source}: recipe: unknown recipe '{recipe}'{did_you_mean(str(recipe), RECIPE_CONFIGS.names())}; "
            f"known: {', '.join(RECIPE_CONFIGS)}"
        )
    try:
        return _build(RECIPE_CONFIGS.get(recipe), raw, "")
    except ConfigError as err:
        raise ConfigError(f"{source}: {err}") from None


def read_yaml(path: str | Path) -> dict:
    """The mapping in a YAML file, or a ConfigError naming the file and the line."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise ConfigError(f"{path}: cannot read config: {err.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        raise ConfigError(f"{path}: invalid YAML{where}: {getattr(err, 'problem', err)}") from None
    return data if data is not None else {}


def load_config(path: str | Path | None, overrides: Iterable[str] = (), recipe: str | None = None) -> Any:
    """Load, override and validate a config file.

    Args:
        path: a YAML file; None starts from ``recipe``'s defaults.
        overrides: ``a.b=c`` strings applied before validation.
        recipe: the recipe of a config built from defaults alone.
    """
    raw = read_yaml(path) if path is not None else {"recipe": recipe}
    raw = apply_overrides(raw, overrides)
    return config_from_dict(raw, str(path) if path is not None else f"<{recipe} defaults>")


def recipe_name(cfg: Any) -> str:
    """The recipe name a root config was registered under."""
    for name in RECIPE_CONFIGS:
        if type(cfg) is RECIPE_CONFIGS.get(name):
            return name
    raise TypeError(f"{type(cfg).__name__} is not a registered recipe config")


def to_dict(obj: Any) -> Any:
    """Plain data (YAML-safe) for a config; ``Choice`` sections carry their ``type``."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out = {}
        if isinstance(obj, Choice):
            out["type"] = next(n for n in obj.registry if obj.registry.get(n) is type(obj))
        for f in dataclasses.fields(obj):
            out[f.name] = to_dict(getattr(obj, f.name))
        return out
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def save_config(cfg: Any, path: str | Path) -> Path:
    """Write the resolved config (recipe first) as YAML; it loads back to an equal config."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"recipe": recipe_name(cfg), **to_dict(cfg)}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    tmp.replace(path)
    return path
