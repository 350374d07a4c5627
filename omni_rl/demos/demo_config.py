"""The demo's config (``omni-rl demo``): the generated clip it asks about and the
root config."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from omni_rl.config import require
from omni_rl.engine.config import AdamWConfig, OptimizerConfig, TrainerConfig
from omni_rl.models.config import GenerationConfig, ModelConfig
from omni_rl.runtime import RunConfig


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


# the fields of the shared model and trainer sections the demo never reads, each with why
NOT_FOR_DEMO = {
    "model": {
        "freeze_vision_tower": "the demo trains every weight",
        "gradient_checkpointing": "the demo's steps are one short clip each",
        "lora": "the demo trains every weight",
    },
    "trainer": {
        "save_every": "the demo writes its model once, at the end",
        "keep_last": "the demo writes no checkpoints",
        "eval_every": "the demo asks its question before and after training",
        "best_metric": "the demo keeps no best model",
        "micro_batch_size": "each step is one clip",
        "max_tokens_per_microbatch": "each step is one clip",
        "dist_timeout_minutes": "the demo runs in one process",
    },
}


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

    def __post_init__(self):
        defaults = {"model": ModelConfig(), "trainer": TrainerConfig()}
        for section, fields in NOT_FOR_DEMO.items():
            for name, why in fields.items():
                value = getattr(getattr(self, section), name)
                require(
                    value == getattr(defaults[section], name), f"{section}.{name}", f"does nothing in the demo: {why}"
                )
