"""Scores of answered rows: each row's best completion by the reward parsers (pass@K
for K completions), for rows and for a benchmark preset's rows (then by the preset's
parser and score)."""

from __future__ import annotations

from omni_rl.benchmarks.base import Scored
from omni_rl.preprocess.rows import Row
from omni_rl.rewards import RewardSettings, Target, score_batch


def row_accuracies(
    rows: list[Row], answers: dict[str, list[str]], fields: dict[str, dict], settings: RewardSettings | None = None
) -> list[tuple[Row, list[float]]]:
    """Each of ``rows`` answered in ``answers`` ({row id: completions}), in the rows'
    order, with its completions' accuracies, scored with ``fields`` ({row id: the
    fields its sample was asked with}, ``answer.gathered``'s). ``settings``: the run's
    reward settings (None: the defaults)."""
    answered = [row for row in rows if row.id in answers]
    flat = [(row, text) for row in answered for text in answers[row.id]]
    results = score_batch(
        [row.problem_type for row, _ in flat],
        [text for _, text in flat],
        [Target(row.answer, row.fields.get("options"), fields[row.id]) for row, _ in flat],
        settings,
    )
    scores: dict[str, list[float]] = {}
    for (row, _), result in zip(flat, results, strict=True):
        scores.setdefault(row.id, []).append(result.accuracy)
    return [(row, scores[row.id]) for row in answered]


def score_rows(
    rows: list[Row], answers: dict[str, list[str]], fields: dict[str, dict], settings: RewardSettings | None = None
) -> list[tuple[str, str, float, float]]:
    """``(problem type, data source, best accuracy, mean accuracy)`` of each of ``rows``
    answered in ``answers`` ({row id: completions}), in the rows' order: its best
    completion's accuracy and the mean over its completions (``row_accuracies``, with
    ``fields``)."""
    return [
        (row.problem_type, row.fields.get("data_source") or "unknown", max(s), sum(s) / len(s))
        for row, s in row_accuracies(rows, answers, fields, settings)
    ]


def score_benchmark(prepared, answers: dict[str, list[str]]) -> list[Scored]:
    """Each answered row of a prepared benchmark (``benchmark.Prepared``) scored by the
    protocol's parser and the preset's score: the best of its responses."""
    benchmark, ids = prepared.benchmark, [i for i in prepared.rows if i in answers]
    flat = [(row_id, text) for row_id in ids for text in answers[row_id]]
    rows = [prepared.rows[row_id] for row_id, _ in flat]
    results = score_batch(
        [r["problem_type"] for r in rows],
        [text for _, text in flat],
        [Target(r["answer"], r.get("options"), r) for r in rows],
    )
    best: dict[str, Scored] = {}
    for (row_id, _), row, result in zip(flat, rows, results, strict=True):
        parsed = result.details.get("predicted")
        value = benchmark.score(row, parsed, result.accuracy) if benchmark.score else result.accuracy
        if row_id not in best or value > best[row_id].score:
            best[row_id] = Scored(row, value, parsed, answers[row_id])
    return [best[row_id] for row_id in ids]
