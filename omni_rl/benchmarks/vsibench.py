"""VSI-Bench (nyu-visionx/VSI-Bench): spatial questions about indoor-scene videos.

Layout: ``test-00000-of-00001.parquet`` (or ``test.jsonl``) with columns id, dataset
(arkitscenes, scannet, scannetpp), scene_name, question_type, question, options
(["A. chair", ...] or null) and ground_truth (a letter, or a number as a string), and
the videos as ``<dataset>/<scene_name>.mp4``.

Multiple-choice types score accuracy; numeric types score the mean relative accuracy
(MRA) over thresholds 0.50, 0.55, ..., 0.95, as VSI-Bench's code computes it.

Scoring follows lmms-eval 0.7.2's ``vsibench`` task: its prompt, 16 greedy tokens, its
denominator (every row) and its aggregation (per type, the three relative-direction
types averaged into one, overall the mean of the eight). lmms-eval reads the first
word of the response, a trailing period dropped: a choice is right when that word is
the letter, a number is that word as a float (0.7.2; its later main branch reads the
first number). Here choices go through omni_rl's ``multiple_choice`` parser and
numbers through ``regression``'s, which reads the last number: the two agree on the
one-word answers the prompt asks for, and omni_rl also reads "B. table" or "about 4
meters" ("about" scores 0 in lmms-eval).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from omni_rl.benchmarks.base import (
    LMMS_EVAL,
    Benchmark,
    Protocol,
    Reading,
    Scored,
    Variant,
    find_table,
    grouped,
    lettered,
    mean,
    media_file,
    option_texts,
    read_table,
    register_benchmark,
    render,
)

NUMERIC = ("object_counting", "object_abs_distance", "object_size_estimation", "room_size_estimation")
CHOICE = (
    "object_rel_direction_easy",
    "object_rel_direction_medium",
    "object_rel_direction_hard",
    "object_rel_distance",
    "route_planning",
    "obj_appearance_order",
)
NUMERIC_POST = "Please answer the question using a single word or phrase."
CHOICE_POST = "Answer with the option's letter from the given choices directly."
PROTOCOL = Protocol(
    nframes=32,
    prompt="These are frames of a video.\n{question}\n{options}{post_prompt}",
    max_new_tokens=16,
    answer_parser="auto",
    metric="vsibench",
)
LMMS_EVAL_SCORING = Variant(
    follows=f"lmms-eval {LMMS_EVAL}, lmms_eval/tasks/vsibench",
    parser=(
        "lmms-eval: the first word, a trailing period dropped (the letter, or float() of it); here omni_rl's "
        "multiple_choice parser and regression's number parser (the last number)"
    ),
    denominator="every row; per type, relative directions averaged, overall the mean of the eight",
    metric="vsibench",
)
# as VSI-Bench computes them: numpy.linspace(0.50, 0.95, 10)
THRESHOLDS = [float(t) for t in np.linspace(0.5, 0.95, 10)]


def mean_relative_accuracy(predicted: float, gold: float) -> float:
    """VSI-Bench's MRA: the share of thresholds t in 0.50..0.95 with
    |predicted - gold| / gold <= 1 - t (floating point, as its code computes it)."""
    if gold == 0:
        return float(predicted == 0)
    error = abs(predicted - gold) / abs(gold)
    return sum(error <= 1 - t for t in THRESHOLDS) / len(THRESHOLDS)


def read(root: Path, protocol: Protocol) -> Reading:
    reading = Reading()
    table = find_table(root, "test-*.parquet", "test.jsonl", "*.parquet")
    if table is None:
        return reading
    for index, record in enumerate(read_table(table)):
        where, row_id = f"{table}:{index}", str(record.get("id", index))
        kind = str(record.get("question_type", ""))
        if kind not in NUMERIC + CHOICE:
            reading.fail(row_id, where, f"unknown question_type {kind!r}")
            continue
        video = media_file(root, [f"{record.get('dataset')}/{record.get('scene_name')}.mp4"])
        if video is None:
            reading.fail(row_id, where, f"video {record.get('dataset')}/{record.get('scene_name')}.mp4 not found")
            continue
        gold = str(record.get("ground_truth", "")).strip()
        options = option_texts(record.get("options"))
        row = {
            "id": row_id,
            "origin": where,
            "problem": str(record.get("question", "")),
            "videos": [str(video)],
            "question_type": kind,
            "task": kind,
            "dataset": record.get("dataset"),
            "scene_name": record.get("scene_name"),
            "data_source": f"vsibench/{kind}",
        }
        if kind in CHOICE:
            if gold not in "ABCDEFGHIJ"[: len(options)] or not gold:
                reading.fail(row_id, where, f"ground_truth {gold!r} is not a letter of the {len(options)} options")
                continue
            row |= {"problem_type": "multiple_choice", "answer": gold, "options": options}
            extra = {"options": "Options:\n" + lettered(options) + "\n", "post_prompt": CHOICE_POST}
        else:
            try:
                row |= {"problem_type": "regression", "answer": float(gold)}
            except ValueError:
                reading.fail(row_id, where, f"ground_truth {gold!r} is not a number")
                continue
            extra = {"options": "", "post_prompt": NUMERIC_POST}
        row["benchmark_prompt"] = render(protocol, row, **extra)
        reading.rows.append(row)
    return reading


def score(row: dict, parsed: Any, reward_accuracy: float) -> float:
    """Numeric rows: VSI-Bench's MRA of the parsed number; others: the reward's accuracy."""
    if row["question_type"] in NUMERIC:
        return mean_relative_accuracy(float(parsed), float(row["answer"])) if parsed is not None else 0.0
    return reward_accuracy


def aggregate(scored: list[Scored], metric: str) -> dict[str, float]:
    """Per type: accuracy (choice) or MRA (numeric), as fractions; the three relative
    direction types are averaged into one; overall is the mean of the 8 scores."""
    per_type = {k: mean([s.score for s in v]) for k, v in grouped(scored, "question_type").items()}
    out = {}
    for kind, value in per_type.items():
        if not kind.startswith("object_rel_direction_"):
            out[f"{kind}_{'mra' if kind in NUMERIC else 'accuracy'}"] = value
    directions = [v for k, v in per_type.items() if k.startswith("object_rel_direction_")]
    if directions:
        out["object_rel_direction_accuracy"] = mean(directions)
    return {"overall": mean(list(out.values())), **dict(sorted(out.items()))}


register_benchmark(
    Benchmark(
        name="vsibench",
        protocol=PROTOCOL,
        read=read,
        aggregate=aggregate,
        metrics=("vsibench",),
        layout="test-*.parquet (or test.jsonl) and <dataset>/<scene_name>.mp4",
        variants={"lmms-eval": LMMS_EVAL_SCORING},
        score=score,
    )
)
