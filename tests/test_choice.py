"""Choice answers as models write them, scored the way the reference scorers score them.

``data/choice_golden.jsonl`` holds realistic responses (multiple_choice, choice_text and
choice_words) with options drawn from MMAU test-mini, MVBench, Video-MME and VSI-Bench,
each with its verdict and a one-line reason. Add a case by appending a line; a verdict
that differs from lmms-eval's, MMAU's or Video-MME's scorers says so in its reason.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from omni_rl.rewards import score
from omni_rl.rewards.choice import option_texts, parse_choice

GOLDEN = [
    json.loads(line) for line in (Path(__file__).parent / "data" / "choice_golden.jsonl").read_text().splitlines()
]
LETTERS = "ABCDEFGHIJ"


def test_golden_table():
    assert len(GOLDEN) >= 150
    assert {c["problem_type"] for c in GOLDEN} == {"multiple_choice", "choice_text", "choice_words"}
    assert all(c["reason"] and c["expected"] in (0, 1) for c in GOLDEN)
    wrong = []
    for number, case in enumerate(GOLDEN, start=1):
        result = score(case["problem_type"], case["response"], case["gold"], options=case["options"])
        if result.accuracy != case["expected"]:
            wrong.append(f"line {number}: {case['response']!r} -> {result.details} ({case['reason']})")
    assert not wrong, "\n".join(wrong)


# every option list of the table that has no repeated text
OPTION_SETS = list({json.dumps(o): o for c in GOLDEN if (o := c["options"]) and len(set(o)) == len(o)}.values())


@pytest.mark.parametrize("options", OPTION_SETS, ids=[o[0][:12] for o in OPTION_SETS])
def test_every_option_by_its_label_and_text_or_stated_after_an_article(options):
    """Whatever an option's text holds (a capital, an initial, a label of its own), its
    letter with its text is right, another letter with it is wrong, and reasoning that
    opens with the article 'A' and states a letter is read as that letter."""
    texts = option_texts(options)
    for i, text in enumerate(texts):
        letter, other = LETTERS[i], LETTERS[(i + 1) % len(texts)]
        for response in (f"{letter}. {text}", f"({letter}) {text}", f"{letter}: {text}", f"**{letter}. {text}**"):
            assert parse_choice(response, options) == letter, response
        assert parse_choice(f"{other}. {text}", options) is None
        stated = f"A person speaks softly in the clip, so the best option is {letter}."
        assert parse_choice(stated, options) == letter
        assert parse_choice(f"a dog barks twice. The answer is ({letter}).", options) == letter
        assert parse_choice(f"The answer is {letter} or {other}.", options) is None


def test_option_labels_are_dropped_only_when_every_option_has_its_own():
    assert option_texts(["A. chair", "B. table", "(C) sofa"]) == ["chair", "table", "sofa"]
    chords = ["B:maj7/1", "A#:hdim7(11)/1", "E:(1,5)/1", "G#:min7(4,*5)/1"]
    assert option_texts(chords) == chords
    authors = ["Mark Twain", "J.D. Salinger", "Ernest Hemingway", "F. Scott Fitzgerald"]
    assert option_texts(authors) == authors
    assert option_texts(["A:maj(#11)/1", "A:maj/5"]) == ["A:maj(#11)/1", "A:maj/5"]


def test_a_long_reasoning_is_read_in_linear_time():
    """A long reasoning full of capitals and articles, then the answer."""
    reasoning = "A dog barks. B and C look alike, but (D) does not; I think a cat is there. " * 1000
    for size in (1, 2):  # 75,000 and 150,000 characters
        started = time.perf_counter()
        result = score("multiple_choice", reasoning * size + "So the best option is C.", "C")
        assert result.accuracy == 1.0 and time.perf_counter() - started < 2.0
    started = time.perf_counter()
    for problem_type in ("multiple_choice", "choice_text", "choice_words"):
        score(problem_type, "answer is " * 20_000 + "(A)" * 20_000, "B", options=["left", "right"])
    assert time.perf_counter() - started < 4.0


@pytest.mark.parametrize(
    ("problem_type", "response", "answer", "options", "accuracy", "predicted"),
    [
        (
            "multiple_choice",
            "B. A dog jumps into the pool.",
            "B",
            ["A cat sleeps.", "A dog jumps into the pool."],
            1,
            "B",
        ),
        ("multiple_choice", "A person walks to the door, so the best option is C.", "C", None, 1, "C"),
        ("multiple_choice", "B\nThe dog leaps in.", "B", None, 1, "B"),
        ("choice_text", "A. Woman", "Woman", ["Man", "Woman", "Child"], 0, None),  # another option's label
        ("choice_text", "B. Woman", "Woman", ["Man", "Woman", "Child"], 1, "Woman"),
        ("choice_words", "The speaker is a woman.", "Woman", ["Man", "Woman", "Child"], 1, "Woman"),
    ],
)
def test_rewards_score_prints_the_verdict_of_each_style(
    capsys, problem_type, response, answer, options, accuracy, predicted
):
    from omni_rl.cli import main

    args = ["rewards", "score", "--type", problem_type, "--answer", answer, "--response", response]
    assert main([*args, *(["--options", *options] if options else [])]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert (printed["accuracy"], printed["details"]["predicted"]) == (accuracy, predicted)


def test_a_multiple_choice_row_with_more_options_than_letters_is_refused():
    """A 12-option row loaded; its prompt offered K and L, which the scorer cannot read
    (format 0 for naming a real option, and 0 for its text through a caught IndexError)."""
    from omni_rl.preprocess.rows import check_row
    from omni_rl.rewards import check_targets

    def row(count):
        options = [f"opt{i}" for i in range(count)]
        return check_row(
            {"id": f"r{count}", "problem": "?", "problem_type": "multiple_choice", "answer": "B", "options": options}
        )

    problems = check_targets([row(10), row(12)])
    assert [(p.id, p.reason) for p in problems] == [
        ("r12", "multiple_choice reads the option letters A to J: 12 options are more than 10")
    ]
