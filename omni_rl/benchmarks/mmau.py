"""MMAU test-mini: 1,000 multiple-choice questions on sound, music and speech.

Layout (the MMAU authors' release): ``mmau-test-mini.json``, a JSON list of
``{"id", "audio_id": "./test-mini-audios/<id>.wav", "question", "choices", "answer"
(the right choice's text), "task" (sound, music, speech), "difficulty", "category",
"sub-category", "dataset"}``, with the clips under ``test-mini-audios/``.

Two protocols (``protocol.variant``):

- ``lmms-eval`` (the default) follows lmms-eval 0.7.2's ``mmau_test_mini`` task
  (unchanged since 0.7.1): its prompt asking for the letter, 128 greedy tokens, and
  its denominator, every row. lmms-eval reads "(X)", then " X ", then "X." for X in A-D
  only, so a fifth choice is never read, and when it finds none it guesses a letter at
  random. Here omni_rl's ``multiple_choice`` parser reads the answer: every letter up
  to the number of choices, or a choice's text; an answer naming none is wrong (and
  ``accuracy_answered`` leaves it out), never a guess.
- ``official`` scores as MMAU's own ``evaluation.py`` does (Sakshi113/MMAU): the
  answer's words must hold every word of the right choice and none of the words only
  the other choices have (reward type ``choice_words``), over every row. A letter alone
  is never right there, so this protocol's prompt asks for the choice's text.

``answer_parser: choice_text`` (R1-AQA's reward: the choice's text, a letter is not an
answer) works under either prompt.
"""

from __future__ import annotations

from pathlib import Path

from omni_rl.benchmarks.base import (
    ACCURACIES,
    LETTERS,
    LMMS_EVAL,
    Benchmark,
    Protocol,
    Reading,
    Scored,
    Variant,
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
VARIANTS = {
    "lmms-eval": Variant(
        follows=f"lmms-eval {LMMS_EVAL}, lmms_eval/tasks/mmau",
        parser=(
            "lmms-eval: '(X)', then ' X ', then 'X.' for X in A-D only, a random letter when none is found; here "
            "omni_rl's multiple_choice parser, every letter of the choices or a choice's text, and no guess"
        ),
        denominator="every row",
        metric="accuracy",
    ),
    "official": Variant(
        follows="MMAU's evaluation.py (Sakshi113/MMAU, 7468292)",
        parser="the answer's words hold every word of the right choice and none only the others have (choice_words)",
        denominator="every row with a response",
        metric="accuracy",
        overrides={
            "answer_parser": "choice_words",
            "prompt": "{question}\nChoices:\n{choices}\nAnswer with the text of the correct choice.",
        },
    ),
}
# parsers whose gold answer is the choice's text: a letter would be ambiguous among
# choices that are letters themselves (root notes "C", "D", "G", "A")
TEXT_PARSERS = ("choice_text", "choice_words")


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
        gold, category = choices.index(record["answer"]), record.get("category")
        row = {
            "id": row_id,
            "origin": where,
            "problem": str(record.get("question", "")),
            "problem_type": "multiple_choice",
            "answer": record["answer"] if protocol.answer_parser in TEXT_PARSERS else LETTERS[gold],
            "options": choices,
            "audios": [str(audio.resolve())],
            "task": record.get("task"),
            "difficulty": record.get("difficulty"),
            "category": category[0] if isinstance(category, list) and category else category,
            "sub-category": record.get("sub-category"),
            "dataset": record.get("dataset"),
            "data_source": f"mmau/{record.get('task')}",
        }
        listed = "\n".join(f"- {choice}" for choice in choices)
        row["benchmark_prompt"] = render(protocol, row, options=lettered(choices), choices=listed)
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
        metrics=ACCURACIES,
        layout="mmau-test-mini.json and test-mini-audios/<id>.wav",
        variants=VARIANTS,
    )
)
