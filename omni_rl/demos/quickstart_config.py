"""The quickstart's config (``omni-rl quickstart``): the synthetic set and tiny model it
generates, and the SFT and GRPO recipes' own configs, which it fills with what it
generates and runs."""

from __future__ import annotations

from dataclasses import dataclass, field

from omni_rl.config import require
from omni_rl.data.config import DataConfig
from omni_rl.engine.config import AdamWConfig, TrainerConfig
from omni_rl.preprocess.config import MediaConfig
from omni_rl.recipes.grpo_config import AlgorithmConfig, GRPOConfig
from omni_rl.recipes.sft_config import SFTConfig
from omni_rl.rewards.config import RewardsConfig
from omni_rl.rollout.config import RolloutConfig
from omni_rl.runtime import RunConfig

# what the quickstart fills in its sft and grpo sections (from its run, media, model
# and data sections, and the files it generates); setting them there is an error
FILLED = (
    "run",
    "media",
    "model.path",
    "model.tiny_family",
    "model.tiny_width",
    "data.train",
    "data.cache",
    "data.prompt_template",
)


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


def quickstart_sft() -> SFTConfig:
    """The SFT cold start: 300 steps of 8 prompts at lr 2e-3."""
    return SFTConfig(
        data=DataConfig(prompts_per_step=8),
        trainer=TrainerConfig(steps=300),
        optimizer=AdamWConfig(lr=2e-3),
    )


def quickstart_grpo() -> GRPOConfig:
    """The GRPO phase: 600 steps of 8 prompts x 8 completions at lr 2e-4 (higher rates
    collapse the tiny model to empty answers); 40 new tokens, as the tiny tokenizer
    spends one token per byte; answers without a <think> part, accuracy rewarded only
    in responses that end with the answer (without it, one SFT start drifted into
    text after ``</answer>`` and collapsed)."""
    return GRPOConfig(
        data=DataConfig(prompts_per_step=8),
        rollout=RolloutConfig(n=8, max_new_tokens=40, temperature=1.0),
        algorithm=AlgorithmConfig(advantage="grpo", dynamic_sampling=False),
        rewards=RewardsConfig(template="answer_only", require_template=True),
        trainer=TrainerConfig(steps=600),
        optimizer=AdamWConfig(lr=2e-4),
    )


def _dotted_get(obj, dotted: str):
    for name in dotted.split("."):
        obj = getattr(obj, name)
    return obj


def require_unfilled(cfg, defaults: dict, keys: tuple[str, ...]) -> None:
    """Validation helper: the fields ``keys`` of the recipe sections (``defaults``:
    section name -> its default config) that a quickstart fills are left at default."""
    for name, default in defaults.items():
        for key in keys:
            require(
                _dotted_get(getattr(cfg, name), key) == _dotted_get(default, key),
                f"{name}.{key}",
                "the quickstart fills this from its own run, media, model and data sections; set those instead",
            )


@dataclass
class QuickstartConfig:
    """``omni-rl quickstart``: synthetic data, cache, tiny model, SFT, eval, GRPO, eval."""

    run: RunConfig = field(
        default_factory=lambda: RunConfig(
            name="quickstart", output_dir="runs/quickstart", threads=2, cpu_kernels="avx2"
        )
    )
    """Output directory, seed and hardware (of both phases)."""
    media: MediaConfig = field(
        default_factory=lambda: MediaConfig(min_frames=2, max_frames=8, video_min_pixels=3136, video_max_pixels=12544)
    )
    """Frame sampling and budgets (small, for a CPU; of both phases)."""
    data: QuickstartData = field(default_factory=QuickstartData)
    """The synthetic set."""
    model: QuickstartModel = field(default_factory=QuickstartModel)
    """The tiny model."""
    sft: SFTConfig = field(default_factory=quickstart_sft)
    """The cold start: an SFT recipe config whose run, media, model path and tiny
    settings, data.train, data.cache and data.prompt_template the quickstart fills."""
    grpo: GRPOConfig = field(default_factory=quickstart_grpo)
    """The RL phase: a GRPO recipe config, filled like ``sft`` (model.path: the SFT
    checkpoint)."""

    def __post_init__(self):
        require_unfilled(self, {"sft": quickstart_sft(), "grpo": quickstart_grpo()}, FILLED)
