"""Benchmark reward scoring throughput on the real scorers.

    python tools/bench_rewards.py [--responses 10000 --math 1000 --workers 2]

Scores a seeded mix of realistic responses (right, wrong and malformed answers in the
think/answer template) over the eleven non-math problem types in this process on one
core, then math answers through ``score_batch`` with ``--workers`` verifier processes,
in groups of 8 responses per distinct gold answer as GRPO produces them.
Prints both rates; the non-math rate (target >= 5,000 scores/s) last.
"""

from __future__ import annotations

import argparse
import random
import time

from omni_rl.rewards import Target, score_batch
from omni_rl.runtime import set_threads


def _wrap(answer: str, rng: random.Random) -> str:
    thinking = " ".join(rng.choice(["look", "the", "square", "moves", "count", "frames", "so"]) for _ in range(30))
    form = rng.random()
    if form < 0.7:
        return f"<think>{thinking}</think><answer>{answer}</answer>"
    if form < 0.85:
        return f"<answer>{answer}</answer>"
    return f"{thinking} {answer}"


def make_cases(n: int, rng: random.Random) -> tuple[list[str], list[str], list[Target]]:
    """``n`` (problem_type, response, target) triples over the non-math types."""
    makers = {
        "multiple_choice": lambda: (rng.choice("ABCD"), Target(rng.choice("ABCD"), ["left", "right", "up", "down"])),
        "boolean": lambda: (rng.choice(["yes", "no", "Yes, it is.", "maybe"]), Target(rng.choice(["yes", "no"]))),
        "numerical": lambda: (f"{rng.uniform(0, 100):.2f}", Target(round(rng.uniform(0, 100), 2))),
        "regression": lambda: (f"{rng.uniform(1, 20):.1f} meters", Target(round(rng.uniform(1, 20), 1))),
        "counting": lambda: (str(rng.randint(0, 6)), Target(rng.randint(0, 6))),
        "ocr": lambda: ("the quick brown fox", Target(rng.choice(["the quick brown fox", "a quick red fox jumps"]))),
        "open_ended": lambda: (
            "the red square moves right",
            Target(rng.choice(["cat", "the red square moves to the right side of the frame"])),
        ),
        "temporal_grounding": lambda: (
            f"from {rng.uniform(0, 5):.1f} to {rng.uniform(5, 10):.1f} seconds",
            Target([round(rng.uniform(0, 5), 1), round(rng.uniform(5, 10), 1)]),
        ),
        "spatial_grounding": lambda: (
            f"[{rng.randint(0, 50)}, {rng.randint(0, 50)}, {rng.randint(60, 120)}, {rng.randint(60, 120)}]",
            Target([10, 10, 80, 90]),
        ),
        "spatio_temporal_grounding": lambda: (
            '{"time": [0, 3], "boxes": {"1": [0, 0, 10, 10], "2": [2, 2, 12, 12]}}',
            Target({"time": [0, 4], "boxes": {"1": [0, 0, 10, 10], "2": [0, 0, 10, 10]}}),
        ),
        "tracking": lambda: (
            '{"1": [0, 0, 10, 10], "2": [4, 4, 14, 14]}',
            Target({"1": [0, 0, 10, 10], "2": [5, 5, 15, 15]}),
        ),
    }
    types, responses, targets = [], [], []
    names = list(makers)
    for i in range(n):
        name = names[i % len(names)]
        answer, target = makers[name]()
        types.append(name)
        responses.append(_wrap(answer, rng))
        targets.append(target)
    return types, responses, targets


def make_math(n: int, rng: random.Random, group: int = 8) -> tuple[list[str], list[str], list[Target]]:
    """Math answers in GRPO groups: ``group`` responses per distinct gold fraction."""
    responses, targets = [], []
    for i in range(n):
        if i % group == 0:
            a, b = rng.randint(1, 999), rng.randint(2, 999)
        gold = rf"\frac{{{a}}}{{{b}}}"
        answer = rng.choice([rf"\frac{{{2 * a}}}{{{2 * b}}}", f"{a}/{b}", f"{a / b:.3f}", str(a + b)])
        responses.append(_wrap(answer, rng))
        targets.append(Target(gold))
    return ["math"] * n, responses, targets


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--responses", type=int, default=10_000)
    parser.add_argument("--math", type=int, default=1_000)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    set_threads(1)
    rng = random.Random(0)

    types, responses, targets = make_cases(args.responses, rng)
    score_batch(types[:200], responses[:200], targets[:200])  # warm-up (imports, regex caches)
    started = time.perf_counter()
    results = score_batch(types, responses, targets)
    mixed_rate = len(results) / (time.perf_counter() - started)

    m_types, m_responses, m_targets = make_math(args.math, rng)
    score_batch(
        m_types[: args.workers * 2],
        m_responses[: args.workers * 2],
        m_targets[: args.workers * 2],
        workers=args.workers,
    )  # start the verifier processes
    started = time.perf_counter()
    math_results = score_batch(m_types, m_responses, m_targets, workers=args.workers)
    math_rate = len(math_results) / (time.perf_counter() - started)

    accuracy = sum(r.accuracy for r in results) / len(results)
    math_accuracy = sum(r.accuracy for r in math_results) / len(math_results)
    print(f"non-math: {len(results)} responses over 11 types, mean accuracy {accuracy:.3f}")
    print(f"math: {len(math_results)} responses, {args.workers} workers, mean accuracy {math_accuracy:.3f}")
    print(f"math scores/s: {math_rate:.0f}  (target >= 200)")
    print(f"non-math scores/s on one core: {mixed_rate:.0f}  (target >= 5000)")


if __name__ == "__main__":
    main()
