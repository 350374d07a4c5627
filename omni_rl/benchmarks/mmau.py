"""MMAU test-mini: 1,000 multiple-choice questions on sound, music and speech.

Layout (the MMAU authors' release): ``mmau-test-mini.json``, a JSON list of
``{"id", "audio_id": "./test-mini-audios/<id>.wav", "question", "choices", "answer"
(the right choice's text), "task" (sound, music, speech), "difficulty", "category",
"sub-category", "dataset"}``, with the clips under ``test-mini-audios/``.

Scoring: the response names a choice by its letter or by its text (lmms-eval's prompt
asks for the letter; MMAU's own scorer matches the text). ``answer_parser:
choice_text`` accepts the text only.
"""

from __future__ import annotations

from pathlib import Path

from omni_rl.benchmarks.base import (
    Benchmark,
    Protocol,
    Reading,
    Scored,
    accuracy,
    grouped,
    lettered,
    read_json,
    register_benchmark,
    render,
)
from omni_rl.errors import OmniRLError

PROTOCOL = Protocol(
    nframes=32,
    prompt="{question}\n{options}\nAnswer with the option's letter from the given choices directly.",
    max_new_tokens=128,
    answer_parser="multiple_choice",
    metric="accuracy",
)


def read(root: Path, protocol: Protocol) -> Reading:
    reading = Reading()
    path = root / "mmau-test-mini.json"
    if not path.is_file():
        return reading
    records = read_json(path)
    if not isinstance(records, list):
        raise OmniRLError(f"{path}: expected a JSON list of questions")
    for index, record in enumerate(records):
        where, row_id = f"{path}:{index}", str(record.get("id") or index)
        choices = [str(c) for c in record.get("choices") or []]
        if record.get("answer") not in choices:
            reading.fail(row_id, where, f"answer {record.get('answer')!r} is not one of the choices")
            continue
        audio = root / str(record.get("audio_id", ""))
        if not audio.is_file():
            reading.fail(row_id, where, f"audio {record.get('audio_id')} not found under {root}")
            continue
        category = record.get("category")
        row = {
            "id": row_id,
            "origin": where,
            "problem": str(record.get("question", "")),
            "problem_type": "multiple_choice",
            "answer": "ABCDEFGHIJ"[choices.index(record["answer"])],
            "options": choices,
            "audios": [str(audio.resolve())],
            "task": record.get("task"),
            "difficulty": record.get("difficulty"),
            "category": category[0] if isinstance(category, list) and category else category,
            "sub-category": record.get("sub-category"),
            "dataset": record.get("dataset"),
            "data_source": f"mmau/{record.get('task')}",
        }
        row["benchmark_prompt"] = render(protocol, row, options=lettered(choices))
        reading.rows.append(row)
    return reading


def aggregate(scored: list[Scored], metric: str) -> dict[str, float]:
    """Accuracy (percent) overall, per task (sound, music, speech) and per difficulty."""
    out = {"accuracy": accuracy(scored, metric)}
    for key in ("task", "difficulty"):
        out |= {f"accuracy/{key}/{k}": accuracy(v, metric) for k, v in grouped(scored, key).items()}
    return out


register_benchmark(
    Benchmark(
        name="mmau_test_mini",
        protocol=PROTOCOL,
        read=read,
        aggregate=aggregate,
        metrics=("accuracy", "accuracy_answered"),
        layout="mmau-test-mini.json and test-mini-audios/<id>.wav",
    )
)
