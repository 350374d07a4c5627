"""The ``logging:`` section every training recipe's root config holds: where per-step
metrics go (``omni_rl.recipes.common.MetricsLog`` writes them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from omni_rl.config import require
from omni_rl.registry import did_you_mean

BACKENDS = ("jsonl", "tensorboard", "wandb")


@dataclass
class LoggingConfig:
    """Metrics backends, written by rank 0 every ``trainer.log_every`` steps."""

    backends: list[str] = field(default_factory=lambda: ["jsonl", "tensorboard"])
    """Any of jsonl (OUTPUT_DIR/metrics.jsonl), tensorboard (OUTPUT_DIR/tensorboard) and
    wandb (``pip install -e '.[wandb]'``). jsonl cannot be left out: resume, the
    quickstarts' plots and the benchmarks read metrics.jsonl."""
    wandb_project: str = "omni_rl"
    """The wandb project the run belongs to (the entity comes from WANDB_ENTITY or the
    logged-in user)."""
    wandb_mode: Literal["offline", "online", "disabled"] = "offline"
    """offline writes the run under wandb_dir only (``wandb sync`` uploads it later);
    online streams it and needs ``wandb login``; this setting wins over WANDB_MODE."""
    wandb_dir: str | None = None
    """The directory given to ``wandb.init(dir=...)``: wandb writes its run folders into
    its ``wandb/`` subfolder. Unset: OUTPUT_DIR, so runs land in OUTPUT_DIR/wandb/."""

    def __post_init__(self):
        for name in self.backends:
            require(
                name in BACKENDS,
                "backends",
                f"unknown backend '{name}'{did_you_mean(name, BACKENDS)}; known: {', '.join(BACKENDS)}",
            )
        twice = sorted({name for name in self.backends if self.backends.count(name) > 1})
        require(not twice, "backends", f"{', '.join(repr(n) for n in twice)} listed more than once")
        require(
            "jsonl" in self.backends,
            "backends",
            "must include 'jsonl': resume, plots and benchmarks read OUTPUT_DIR/metrics.jsonl; "
            "list the other backends beside it",
        )
        require(bool(self.wandb_project.strip()), "wandb_project", "must not be empty")
