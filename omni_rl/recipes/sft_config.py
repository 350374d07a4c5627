"""The SFT recipe's config: its target section (``sft:``) and root config."""

from __future__ import annotations

from dataclasses import dataclass, field

from omni_rl.config import FieldError
from omni_rl.data.config import DataConfig, check_eval
from omni_rl.engine.config import AdamWConfig, OptimizerConfig, TrainerConfig
from omni_rl.models.config import ModelConfig
from omni_rl.preprocess.config import MediaConfig
from omni_rl.recipes.logging_config import LoggingConfig
from omni_rl.runtime import RunConfig


@dataclass
class SFTSection:
    """What the model is taught to answer."""

    target_template: str = "<answer>{answer}</answer>"
    """The target completion, filled with the row's fields ({answer}, {solution}, ...)."""
    max_length: int = 0
    """The longest row trained, in tokens: its prompt (media tokens included) and its
    target. A longer row is skipped, another drawn in its place, and counted in
    ``skipped/row_too_long``; so is one over the model's positions
    (``max_position_embeddings``) whatever this says. 0: the model's positions alone."""

    def __post_init__(self):
        if self.max_length < 0:
            raise FieldError("max_length", "must be >= 0 (0: the model's positions)")


@dataclass
class SFTConfig:
    """Supervised fine-tuning (a cold start before RL) on the same data and models."""

    run: RunConfig = field(default_factory=lambda: RunConfig(name="sft", output_dir="runs/sft"))
    """Output directory, seed and hardware."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Metrics backends: jsonl, tensorboard, wandb."""
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
        check_eval(self.data, self.trainer)
        if self.data.sampler.type != "uniform":
            raise FieldError("data.sampler.type", "ucb learns from GRPO's advantages; SFT draws uniformly")
