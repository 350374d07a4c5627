"""The data section (``data:``): the training rows and how they become prompts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from omni_rl.config import require


@dataclass
class DataConfig:
    """The training (and evaluation) rows and how they become prompts."""

    train: str = ""
    """A JSONL or Parquet dataset (media paths relative to its folder)."""
    eval: str | None = None
    """A held-out dataset to evaluate during training; not wired yet (an error when
    set): evaluate a run's checkpoints with ``omni-rl eval``."""
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
        require(
            self.eval is None,
            "eval",
            "not wired yet: held-out evaluation during training arrives with the benchmarks work; "
            "run omni-rl eval --model OUTPUT_DIR/checkpoints/step-N/model --data FILE after training",
        )
