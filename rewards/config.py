"""The rewards section (``rewards:``): how completions are scored."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from omni_rl.config import require
from omni_rl.registry import did_you_mean
from omni_rl.rewards.base import SCORERS, weights_problem


@dataclass
class RewardsConfig:
    """How completions are scored (see ``omni_rl.rewards``)."""

    template: Literal["think_answer", "answer_only"] = "think_answer"
    """Response template the format score checks."""
    accuracy_weight: float = 0.9
    """Weight of accuracy in the total reward (>= 0; with format_weight, sums to at most 1)."""
    format_weight: float = 0.1
    """Weight of format in the total reward (>= 0; with accuracy_weight, sums to at most 1)."""
    weights: dict[str, tuple[float, float]] = field(default_factory=dict)
    """Per built-in problem type (accuracy, format) weights, e.g. {ocr: [1.0, 0.0]}; keyed by
    the type's name (not an alias, not a plug-in: a plug-in's value is its reward)."""
    math_timeout: float = 2.0
    """Hard limit in seconds on one math verification."""
    require_template: bool = False
    """Reward accuracy only in responses that follow ``template`` as a whole (built-in
    scorers): an answer followed by more text, or cut off before its closing tag, then
    scores its format term alone. ``accuracy/*`` metrics still report every answer."""
    workers: int = 2
    """Processes verifying math answers in parallel."""
    custom: dict[str, str] = field(default_factory=dict)
    """User scorers: {problem_type: 'package.module:function'}."""

    def __post_init__(self):
        # the rule and its reasons: omni_rl.rewards.base.weights_problem
        accuracy, format_ = self.accuracy_weight, self.format_weight
        problem = weights_problem(accuracy, format_)
        blamed = "format_weight" if math.isfinite(accuracy) and accuracy >= 0 else "accuracy_weight"
        require(problem is None, blamed, f"accuracy_weight {accuracy:g} and format_weight {format_:g} {problem}")
        for name, (accuracy, format_) in self.weights.items():
            # the scorer reads its weights by its own name: any other key would do nothing
            require(
                name not in self.custom,
                f"weights.{name}",
                f"does nothing: '{name}' is a plug-in (custom.{name}), whose value is its reward; remove it",
            )
            require(
                name in SCORERS,
                f"weights.{name}",
                f"no built-in problem type '{name}'{did_you_mean(name, SCORERS.names())}",
            )
            canonical = SCORERS.canonical(name)
            require(canonical == name, f"weights.{name}", f"weights are keyed by the type's name: write '{canonical}'")
            problem = weights_problem(accuracy, format_)
            require(problem is None, f"weights.{name}", f"accuracy {accuracy:g} and format {format_:g} {problem}")
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
            require_template=self.require_template,
        )
