"""Task-routed verifiable rewards (imported as ``omni_rl.rewards``).

``score(problem_type, response, answer, options=..., **fields) -> RewardResult`` routes
by problem type through one registry; each module registers a family of types:
choice (multiple_choice, boolean), numeric (numerical, regression, counting),
mathematics (math), text (ocr, open_ended) and grounding (temporal_grounding,
spatial_grounding, spatio_temporal_grounding, tracking).
"""

from omni_rl.rewards import choice, grounding, mathematics, numeric, text  # noqa: F401 - registers the types
from omni_rl.rewards.base import SCORERS, RewardResult, RewardSettings, Scorer, Target, extract_answer, register
from omni_rl.rewards.metrics import aggregate
from omni_rl.rewards.router import check_targets, get_scorer, load_plugins, score, score_batch

__all__ = [
    "SCORERS",
    "RewardResult",
    "RewardSettings",
    "Scorer",
    "Target",
    "aggregate",
    "check_targets",
    "extract_answer",
    "get_scorer",
    "load_plugins",
    "register",
    "score",
    "score_batch",
]
