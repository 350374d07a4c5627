"""The audio quickstart's config (``omni-rl quickstart --audio``): the synthetic
audio-QA set and tiny Qwen2-Audio it generates, and the SFT and GRPO recipes' own
configs, which it fills with what it generates and runs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from omni_rl.config import require
from omni_rl.data.config import DataConfig
from omni_rl.demos.quickstart_config import FILLED, REFUSED_KEYS, QuickstartModel, require_unfilled
from omni_rl.engine.config import AdamWConfig, TrainerConfig
from omni_rl.preprocess.config import MediaConfig
from omni_rl.recipes.grpo_config import AlgorithmConfig, GRPOConfig
from omni_rl.recipes.sft_config import SFTConfig
from omni_rl.rewards.config import RewardsConfig
from omni_rl.rollout.config import RolloutConfig
from omni_rl.runtime import RunConfig

AUDIO_FILLED = FILLED | {"model.tiny_audio_seconds": "set model.audio_seconds instead"}


@dataclass
class AudioQuickstartData:
    """The synthetic audio-QA set: one clip per question, the four kinds in turn."""

    train_clips: int = 800
    """Training clips (one question each)."""
    heldout_clips: int = 200
    """Held-out clips, never trained on."""
    sft_fraction: float = 0.25
    """Part of the training set used for the SFT cold start."""
    silent: bool = False
    """Control run: the same questions over silence (accuracy should stay near chance)."""
    prompt_template: str = "{problem}{options}"
    """How rows become questions."""

    def __post_init__(self):
        require(self.train_clips >= 8 and self.heldout_clips >= 4, "train_clips", "need >= 8 train, >= 4 held out")
        require(0 < self.sft_fraction <= 1, "sft_fraction", "must be in (0, 1]")


@dataclass
class AudioQuickstartModel(QuickstartModel):
    """The tiny model the quickstart builds (its family is ``media.family``)."""

    audio_seconds: int = 2
    """Audio window of the tiny encoder: the clips are under 2 s, and a 30 s window
    would make every forward pay for 28 s of padding."""

    def __post_init__(self):
        super().__post_init__()
        require(self.audio_seconds >= 1, "audio_seconds", "must be >= 1")


def audio_sft() -> SFTConfig:
    """The SFT cold start: 100 steps of 8 prompts at lr 5e-4, which teaches the answer
    format (at 2e-3 the tiny model stops hearing: 600 steps stay at chance, where 600
    steps at 5e-4 reach 0.96 held out)."""
    return SFTConfig(
        data=DataConfig(prompts_per_step=8),
        trainer=TrainerConfig(steps=100),
        optimizer=AdamWConfig(lr=5e-4),
    )


def audio_grpo() -> GRPOConfig:
    """The GRPO phase: 400 steps of 8 prompts x 8 completions at lr 2e-4; 24 new tokens
    (an answer is about 18, one token per byte); answers without a <think> part,
    accuracy rewarded only in responses that end with the answer."""
    return GRPOConfig(
        data=DataConfig(prompts_per_step=8),
        rollout=RolloutConfig(n=8, max_new_tokens=24, temperature=1.0),
        algorithm=AlgorithmConfig(advantage="grpo", dynamic_sampling=False),
        rewards=RewardsConfig(template="answer_only", require_template=True),
        trainer=TrainerConfig(steps=400),
        optimizer=AdamWConfig(lr=2e-4),
    )


@dataclass
class AudioQuickstartConfig:
    """``omni-rl quickstart --audio``: synthetic audio QA, cache, tiny Qwen2-Audio, SFT,
    eval, GRPO, eval."""

    run: RunConfig = field(
        default_factory=lambda: RunConfig(
            name="quickstart_audio", output_dir="runs/quickstart_audio", threads=2, cpu_kernels="avx2"
        )
    )
    """Output directory, seed and hardware (of both phases)."""
    media: MediaConfig = field(default_factory=lambda: MediaConfig(family="qwen2_audio", max_audio_seconds=2.0))
    """Audio decoding (of both phases); ``family`` is the tiny model's."""
    data: AudioQuickstartData = field(default_factory=AudioQuickstartData)
    """The synthetic set."""
    model: AudioQuickstartModel = field(default_factory=AudioQuickstartModel)
    """The tiny model."""
    sft: SFTConfig = field(default_factory=audio_sft)
    """The cold start: an SFT recipe config whose run, media, model path and tiny
    settings, data.train, data.cache and data.prompt_template the quickstart fills."""
    grpo: GRPOConfig = field(default_factory=audio_grpo)
    """The RL phase: a GRPO recipe config, filled like ``sft`` (model.path: the SFT
    checkpoint)."""
    REFUSED_KEYS: ClassVar[dict[str, str]] = REFUSED_KEYS

    def __post_init__(self):
        from omni_rl.models.families import FAMILIES

        require(
            "audio" in FAMILIES.get(self.media.family).modalities, "media.family", "must be a family that takes audio"
        )
        require(
            self.media.max_audio_seconds <= self.model.audio_seconds,
            "media.max_audio_seconds",
            "must fit the tiny model's audio window (model.audio_seconds)",
        )
        require_unfilled(self, {"sft": audio_sft(), "grpo": audio_grpo()}, AUDIO_FILLED)
