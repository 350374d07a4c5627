"""Reward and accuracy aggregated for logging: overall, per problem_type, per data_source."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from omni_rl.rewards.base import RewardResult


def aggregate(
    results: Sequence[RewardResult], problem_types: Sequence[str], data_sources: Sequence[str | None] | None = None
) -> dict[str, float]:
    """Means keyed ``reward/mean``, ``accuracy/<problem_type>``, ``format/source/<data_source>``...
    plus ``count/<problem_type>`` and ``reward/nonfinite``, the number of results whose
    plug-in returned nan or inf (scored 0 instead: ``omni_rl.rewards.router``)."""
    if not results:
        return {}
    sources = data_sources if data_sources is not None else [None] * len(results)
    groups: dict[str, list[RewardResult]] = defaultdict(list)
    for result, problem_type, source in zip(results, problem_types, sources, strict=True):
        groups["mean"].append(result)
        groups[problem_type].append(result)
        if source:
            groups[f"source/{source}"].append(result)
    metrics = {}
    for group, members in groups.items():
        n = len(members)
        metrics[f"reward/{group}"] = sum(r.score for r in members) / n
        metrics[f"accuracy/{group}"] = sum(r.accuracy for r in members) / n
        metrics[f"format/{group}"] = sum(r.format for r in members) / n
        if group != "mean" and not group.startswith("source/"):
            metrics[f"count/{group}"] = float(n)
    metrics["reward/nonfinite"] = float(sum("nonfinite" in r.details for r in results))
    return metrics
