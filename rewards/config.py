"""The rewards section (``rewards:``): how completions are scored."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from omni_rl.config import require


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
