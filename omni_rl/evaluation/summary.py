"""Summaries of scored rows: accuracy overall, per problem type and per data source,
and the tables the CLI prints (rows, and a benchmark's lmms-eval results)."""

from __future__ import annotations

from collections import defaultdict


def chance(fields: dict) -> float | None:
    """Accuracy of a uniform guess at a row with ``options`` (None without)."""
    return 1 / len(fields["options"]) if fields.get("options") else None


def summarize(per_row: list[tuple[str, str, float, float]], samples: int) -> dict:
    """Mean accuracy overall and grouped by problem type and data source, from each
    row's ``(problem type, data source, best accuracy, mean accuracy)``: with one
    sample the greedy accuracy, with K the pass@K; with K > 1 also ``sampled_accuracy``,
    the mean over every completion (the accuracy of one sampled answer, which training's
    rewards see)."""
    by_type, by_source = defaultdict(list), defaultdict(list)
    for problem_type, source, accuracy, _ in per_row:
        by_type[problem_type].append(accuracy)
        by_source[source].append(accuracy)

    def mean(values):
        return sum(values) / len(values) if values else 0.0

    summary = {
        "accuracy": mean([a for _, _, a, _ in per_row]),
        "samples": samples,
        "rows": len(per_row),
        "per_type": {k: mean(v) for k, v in sorted(by_type.items())},
        "per_source": {k: mean(v) for k, v in sorted(by_source.items())},
        "count_per_type": {k: len(v) for k, v in sorted(by_type.items())},
    }
    if samples > 1:
        summary["sampled_accuracy"] = mean([m for *_, m in per_row])
    return summary


def rows_table(summary: dict) -> str:
    """A plain-text table of a rows summary (``summarize``'s, with the row counts of
    ``evaluate_rows`` when present)."""
    label = "accuracy" if summary["samples"] == 1 else f"pass@{summary['samples']}"
    lines = [f"{'problem type':<28}{'rows':>6}{label:>12}"]
    for name, value in summary["per_type"].items():
        lines.append(f"{name:<28}{summary['count_per_type'][name]:>6}{value:>12.3f}")
    lines.append(f"{'overall':<28}{summary['rows']:>6}{summary['accuracy']:>12.3f}")
    if "sampled_accuracy" in summary:
        lines.append(f"{'one sampled answer':<28}{summary['rows']:>6}{summary['sampled_accuracy']:>12.3f}")
    if "rows_read" in summary:
        lines.append(
            f"{summary['rows_read']} rows read: {summary['rows']} scored, {summary['refused_rows']} refused when "
            f"loading, {summary['skipped_rows']} skipped (the log says which and why)"
        )
    return "\n".join(lines)


def benchmark_table(results: dict) -> str:
    """A benchmark's aggregate scores (lmms-eval's results layout), one per line, and
    how many rows they cover."""
    name, scores = next(iter(results["results"].items()))
    counts = results["n-samples"][name]
    follows = results["configs"][name]["follows"]
    lines = [
        f"{name}: {counts['effective']} of {counts['original']} rows scored ({results['skipped']['count']} skipped)",
        f"  protocol {follows['variant']}: follows {follows['follows']}"
        + ("" if follows["same_denominator"] else f" (its denominator is metric {follows['metric']})"),
    ]
    lines += [f"  {key.removesuffix(',none'):<48}{value:>10.3f}" for key, value in scores.items() if key != "alias"]
    return "\n".join(lines)


def benchmark_metrics(results: dict) -> dict:
    """A benchmark's aggregate scores without lmms-eval's ``,none`` suffix, and the
    count of rows skipped (the metrics training logs)."""
    scores = next(iter(results["results"].values()))
    return {k.removesuffix(",none"): v for k, v in scores.items() if k != "alias"} | {
        "skipped": results["skipped"]["count"]
    }
