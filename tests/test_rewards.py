"""Rewards: the golden table, routing, plug-ins, load-time checks, math timeouts."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from omni_rl.errors import OmniRLError
from omni_rl.preprocess.rows import Row
from omni_rl.rewards import (
    SCORERS,
    RewardResult,
    RewardSettings,
    Target,
    aggregate,
    check_targets,
    extract_answer,
    load_plugins,
    score,
    score_batch,
)

CASES = [json.loads(line) for line in (Path(__file__).parent / "data" / "reward_cases.jsonl").read_text().splitlines()]
TYPES = [
    "multiple_choice",
    "choice_text",
    "choice_words",
    "numerical",
    "regression",
    "counting",
    "math",
    "ocr",
    "open_ended",
    "boolean",
    "temporal_grounding",
    "spatial_grounding",
    "spatio_temporal_grounding",
    "tracking",
]


def test_golden_table_covers_every_type_with_200_cases():
    assert len(CASES) >= 200
    assert {c["type"] for c in CASES} == set(TYPES)
    assert all(c["why"] for c in CASES)


@pytest.mark.parametrize("case", CASES, ids=[f"{i + 1}-{c['type']}" for i, c in enumerate(CASES)])
def test_golden_case(case):
    result = score(
        case["type"], case["response"], case["answer"], options=case.get("options"), **case.get("fields", {})
    )
    assert result.accuracy == pytest.approx(case["accuracy"], abs=1e-6), (case["why"], result.details)
    if "format" in case:
        assert result.format == case["format"], (case["why"], result.details)
    assert 0.0 <= result.score <= 1.0


def test_total_is_the_weighted_sum_and_weights_are_overridable():
    result = score("counting", "<think>x</think><answer>3</answer>", 3)
    assert (result.accuracy, result.format, result.score) == (1.0, 1.0, 1.0)
    wrong = score("counting", "<think>x</think><answer>4</answer>", 3)
    assert wrong.score == pytest.approx(0.1)  # 0.9 x 0 + 0.1 x 1
    settings = RewardSettings(weights={"counting": (0.5, 0.5)})
    assert score("counting", "4", 3, settings=settings).score == pytest.approx(0.5 * 0 + 0.5 * 0.5)
    answer_only = RewardSettings(template="answer_only")
    assert score("counting", "<answer>3</answer>", 3, settings=answer_only).format == 1.0
    assert score("counting", "<think>x</think><answer>3</answer>", 3, settings=answer_only).format == 0.5


def test_require_template_rewards_accuracy_only_in_finished_responses():
    """An answer followed by more text, or given without its tags, keeps its accuracy
    (reported) but earns only its format term; a clean one scores as before."""
    strict = RewardSettings(template="answer_only", require_template=True)
    clean = score("multiple_choice", "<answer>B</answer>", "B", options=["x", "y"], settings=strict)
    assert (clean.accuracy, clean.format, clean.score) == (1.0, 1.0, pytest.approx(1.0))
    for response in ("<answer>B</answer>6655666", "B"):
        result = score("multiple_choice", response, "B", options=["x", "y"], settings=strict)
        lenient = score(
            "multiple_choice", response, "B", options=["x", "y"], settings=RewardSettings(template="answer_only")
        )
        assert result.accuracy == lenient.accuracy == 1.0, response
        assert result.format == 0.5 and result.score == pytest.approx(0.1 * 0.5), response
        assert lenient.score == pytest.approx(0.9 + 0.1 * 0.5), response


def test_a_think_block_the_prompt_opened_follows_the_template():
    """Qwen3's thinking chat templates end the prompt with ``<think>``: the completion
    starts inside the block and closes it. It follows think_answer as a whole response
    would (before, no such completion could: under require_template a right and a wrong
    answer scored alike, 0.05, and GRPO's advantages were 0)."""
    strict = RewardSettings(require_template=True)
    right = score(
        "multiple_choice", "reasoning\n</think>\n\n<answer>B</answer>", "B", options=["x", "y"], settings=strict
    )
    wrong = score(
        "multiple_choice", "reasoning\n</think>\n\n<answer>A</answer>", "B", options=["x", "y"], settings=strict
    )
    assert (right.accuracy, right.format, right.score) == (1.0, 1.0, pytest.approx(1.0))
    assert (wrong.accuracy, wrong.format, wrong.score) == (0.0, 1.0, pytest.approx(0.1))
    # only a block the prompt opened: a second block, or tags out of order, still do not
    for response in ("a</think><think>b</think><answer>B</answer>", "</think></think><answer>B</answer>"):
        assert score("multiple_choice", response, "B", options=["x", "y"]).format == 0.5, response
    assert score("multiple_choice", "</think><answer>B</answer>", "B", options=["x", "y"]).format == 1.0


@pytest.mark.parametrize("problem_type", TYPES)
def test_an_empty_answer_never_earns_accuracy(problem_type):
    answers = {
        "multiple_choice": "A",
        "choice_text": "left",
        "choice_words": "left",
        "numerical": 0,
        "regression": 0,
        "counting": 0,
        "math": "0",
        "ocr": "x",
        "open_ended": "x",
        "boolean": "no",
        "temporal_grounding": [0, 1],
        "spatial_grounding": [0, 0, 1, 1],
        "spatio_temporal_grounding": {"time": [0, 1], "boxes": {"0": [0, 0, 1, 1]}},
        "tracking": {"0": [0, 0, 1, 1]},
    }
    options = ["left", "right"] if problem_type in ("choice_text", "choice_words") else None
    for response in ("<answer></answer>", "<think>x</think><answer> </answer>", "", "<think></think>"):
        result = score(problem_type, response, answers[problem_type], options=options)
        assert result.accuracy == 0.0, (problem_type, response)


@pytest.mark.parametrize("options", [None, ["left", "right", "up", "down"]])
def test_listing_every_option_never_earns_accuracy(options):
    for listing in (
        "A, B, C, D",
        "A B C D",
        "A/B/C/D",
        "ABCD",
        "(A)(B)(C)(D)",
        "A or B or C or D",
        "A. left B. right C. up D. down",
        "left, right, up, down",
        "the answer is A, B, C or D",
    ):
        for gold in "ABCD":
            assert score("multiple_choice", f"<answer>{listing}</answer>", gold, options=options).accuracy == 0


def test_extraction():
    assert extract_answer("<answer>a</answer><answer>b</answer>") == ("b", "answer_tag")
    assert extract_answer(r"so \boxed{\frac{1}{2}}.") == (r"\frac{1}{2}", "boxed")
    assert extract_answer(r"\boxed{1} then \boxed{{2}}") == ("{2}", "boxed")
    assert extract_answer("<think>A</think> B") == ("B", "raw")
    assert extract_answer("<answer>  </answer>") == (None, "answer_tag")
    assert extract_answer(r"\boxed{unclosed") == (r"\boxed{unclosed", "raw")


def test_unknown_type_lists_the_known_ones_and_the_closest():
    with pytest.raises(OmniRLError) as err:
        score("temporal_grounding_v2", "x", [0, 1])
    message = str(err.value)
    assert "did you mean 'temporal_grounding'" in message
    for name in TYPES:
        assert name in message


def test_aliases_route_to_the_same_scorer():
    assert score("mcq", "<answer>B</answer>", "B").accuracy == 1.0
    assert SCORERS.get("tvg") is SCORERS.get("temporal_grounding")


def row(problem_type, answer, options=None, **fields):
    data = {"id": f"{problem_type}-{answer}", "problem": "q", "problem_type": problem_type, "answer": answer}
    if options:
        data["options"] = options
    data.update(fields)
    return Row(id=data["id"], problem="q", problem_type=problem_type, answer=answer, source="d.jsonl:1", fields=data)


def test_check_targets_finds_unscorable_gold_answers_at_load_time():
    rows = [
        row("multiple_choice", "B"),
        row("multiple_choice", "sideways", options=["left", "right"]),
        row("math", "\\frac{1}{2}"),
        row("math", "\\frac{"),
        row("counting", 2.5),
        row("temporal_grounding", [5, 1]),
        row("spatial_grounding", [0, 0, 1, 1], box_space="pixel", prediction_space="norm1000"),
        row("numerical", "about"),
    ]
    problems = {p.id: p.reason for p in check_targets(rows)}
    assert set(problems) == {
        "multiple_choice-sideways",
        "math-\\frac{",
        "counting-2.5",
        "temporal_grounding-[5, 1]",
        "spatial_grounding-[0, 0, 1, 1]",
        "numerical-about",
    }
    assert "cannot be parsed by math-verify" in problems["math-\\frac{"]
    assert "needs the row field image_size" in problems["spatial_grounding-[0, 0, 1, 1]"]
    # an unknown type is a problem of its row too (every row is checked, not the first)
    unknown = check_targets([row("countng", 1), row("countng", 2), row("counting", 1)])
    assert [(p.id, p.unknown_type) for p in unknown] == [("countng-1", "countng"), ("countng-2", "countng")]
    assert "unknown problem type 'countng' (did you mean 'counting'?)" in unknown[0].reason


def test_a_numeric_gold_of_several_numbers_is_refused_at_load_time():
    """ "3 to 5", "1 minute 30 seconds" and "3:45" loaded as numerical and regression
    golds and were read as their last number (5, 30, 45). A gold is one number, with
    its unit, its power of ten or its scale word."""
    several = ["3 to 5", "1 minute 30 seconds", "3:45", "between 2 and 4"]
    one = ["25 m^2", "3.2 × 10^5", "1.5 million", "45%", "seven", "about 4 meters", "1,234", "-2.5", "3/4", 12]
    for kind in ("numerical", "regression"):
        problems = {p.id: p.reason for p in check_targets([row(kind, a) for a in several + one])}
        assert set(problems) == {f"{kind}-{a}" for a in several}, kind
        assert "holds 2 numbers; the gold is one number" in problems[f"{kind}-3 to 5"]


def test_math_is_bounded_by_its_timeout():
    started = time.perf_counter()
    result = score("math", "<answer>9^9^9^9</answer>", "1")
    assert time.perf_counter() - started < 10  # includes starting the worker once
    started = time.perf_counter()
    again = score("math", "<answer>9^{9^{9^{9}}}</answer>", "2")
    assert time.perf_counter() - started < 2.5
    assert result.accuracy == again.accuracy == 0.0
    # a check math-verify gave up on is an error, counted in reward/scorer_errors, not a
    # silent wrong answer (this one equals 2, and takes sympy past the limit)
    slow = score("math", "<answer>\\sum_{n=1}^{10^{9}} 1/n^2 - \\sum_{n=1}^{10^{9}} 1/n^2 + 2</answer>", "2")
    assert slow.accuracy == 0.0
    for checked in (again, slow):
        assert "timed out" in checked.details.get("error", ""), checked.details


def test_math_verify_gets_the_gold_answer_first(monkeypatch):
    """Run the worker's check in this process and record verify's argument order."""
    import math_verify

    from omni_rl.rewards import math_worker

    calls = []
    real = math_verify.verify

    def spy(gold, target, **kwargs):
        calls.append((gold, target))
        return real(gold, target, **kwargs)

    monkeypatch.setattr(math_verify, "verify", spy)
    assert math_worker._check("\\frac{1}{2}", "7") == (True, False)
    ((gold, target),) = calls
    assert str(gold[-1]) == "\\frac{1}{2}" and str(target[-1]) == "7"


def test_score_batch_matches_single_scores():
    types = ["math", "counting", "math", "multiple_choice", "ocr"] * 4
    responses = [
        "<answer>1/2</answer>",
        "<answer>3</answer>",
        "<answer>2</answer>",
        "<answer>B</answer>",
        "<answer>hello</answer>",
    ] * 4
    answers = ["0.5", 3, "3", "B", "hello"] * 4
    targets = [Target(a) for a in answers]
    batch = score_batch(types, responses, targets, workers=2)
    singles = [score(t, r, a) for t, r, a in zip(types, responses, answers, strict=True)]
    assert [(r.score, r.accuracy) for r in batch] == [(r.score, r.accuracy) for r in singles]
    assert [r.accuracy for r in batch[:5]] == [1.0, 1.0, 0.0, 1.0, 1.0]


def test_plugins_from_config_and_errors(tmp_path, monkeypatch):
    module = tmp_path / "my_rewards.py"
    module.write_text(
        "from omni_rl.rewards import RewardResult\n"
        "def length(response, target):\n"
        "    return RewardResult(1.0 if len(response) <= target.answer else 0.0, 1.0, 0.0, {})\n"
        "def broken(response, target):\n"
        "    raise RuntimeError('boom')\n"
        "def plain(response, target):\n"
        "    return 7\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    added = load_plugins({"short": "my_rewards:length", "broken": "my_rewards:broken", "plain": "my_rewards:plain"})
    try:
        assert sorted(added) == ["broken", "plain", "short"]
        assert score("short", "abc", 5).score == 1.0
        crashed = score("broken", "abc", 5)
        assert crashed.score == 0.0 and "boom" in crashed.details["error"]
        assert score("plain", "abc", 5).score == 7.0  # a plug-in's value is used as it is
        assert load_plugins({"short": "my_rewards:length"}) == []  # same function again: no-op
        with pytest.raises(OmniRLError, match="clashes with a registered problem type"):
            load_plugins({"counting": "my_rewards:length"})
        with pytest.raises(OmniRLError, match="cannot import"):
            load_plugins({"x": "my_rewards:missing"})
        with pytest.raises(OmniRLError, match="expected 'module:function'"):
            load_plugins({"x": "my_rewards"})
    finally:
        for name in ("short", "broken", "plain"):
            SCORERS._items.pop(name, None)


def test_aggregate_per_type_and_source():
    results = [RewardResult(1.0, 1.0, 1.0), RewardResult(0.0, 0.0, 0.5), RewardResult(0.5, 0.5, 1.0)]
    metrics = aggregate(results, ["counting", "counting", "ocr"], ["a", "b", "a"])
    assert metrics["reward/mean"] == pytest.approx(0.5)
    assert metrics["accuracy/counting"] == pytest.approx(0.5) and metrics["count/counting"] == 2
    assert metrics["reward/ocr"] == pytest.approx(0.5)
    assert metrics["accuracy/source/a"] == pytest.approx(0.75) and metrics["format/source/b"] == pytest.approx(0.5)
    assert aggregate([], [], []) == {}


def test_rewards_config_maps_to_settings():
    from omni_rl.errors import ConfigError
    from omni_rl.recipe_loader import config_from_dict

    cfg = config_from_dict({"recipe": "preprocess", "rewards": {"weights": {"ocr": [1.0, 0.0]}, "math_timeout": 1.5}})
    settings = cfg.rewards.settings()
    assert settings.weights_for("ocr") == (1.0, 0.0) and settings.weights_for("counting") == (0.9, 0.1)
    assert settings.math_timeout == 1.5
    assert score("ocr", "hello", "hello", settings=settings).score == 1.0
    with pytest.raises(ConfigError, match=r"rewards\.template: must be one of"):
        config_from_dict({"recipe": "preprocess", "rewards": {"template": "xml"}})


def test_rewards_cli(tmp_path, capsys):
    from omni_rl.cli import main

    data = tmp_path / "d.jsonl"
    data.write_text(
        json.dumps({"id": "a", "problem": "p", "problem_type": "counting", "answer": 2})
        + "\n"
        + json.dumps({"id": "b", "problem": "p", "problem_type": "math", "answer": "\\frac{"})
        + "\n"
    )
    assert main(["rewards", "check", str(data)]) == 1
    out = capsys.readouterr().out
    # the types in brackets are the scorable rows' (they added up to more than the count)
    assert "unscorable:" in out and "row 'b'" in out and "1 of 2 rows scorable (counting 1)" in out
    assert main(["rewards", "score", "--type", "counting", "--answer", "3", "--response", "<answer>3</answer>"]) == 0
    assert '"accuracy": 1.0' in capsys.readouterr().out
    assert main(["rewards", "score", "--type", "countng", "--answer", "3", "--response", "3"]) == 2


def test_plugins_from_the_entry_point_group(tmp_path, monkeypatch):
    """A package that declares an ``omni_rl.rewards`` entry point is found without config."""
    (tmp_path / "ep_rewards.py").write_text("def always(response, target):\n    return 0.25\n")
    info = tmp_path / "ep_rewards-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: ep-rewards\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[omni_rl.rewards]\nquarter = ep_rewards:always\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        assert "quarter" in load_plugins()
        assert score("quarter", "anything", None).score == 0.25
    finally:
        SCORERS._items.pop("quarter", None)


# ------------------------------------------------------------------ reward ranges

RANGE_PLUGINS = {
    "signed": "reward_plugins:signed",
    "unstable": "reward_plugins:unstable",
    "nan_format": "reward_plugins:nan_format",
}


@pytest.fixture
def range_plugins():
    load_plugins(RANGE_PLUGINS)
    yield
    for name in RANGE_PLUGINS:
        SCORERS._items.pop(name, None)


def test_plugin_rewards_outside_0_1_are_used_as_they_are(range_plugins):
    assert score("signed", "Sorry, I cannot tell.", None).score == -1.0  # a penalty stays a penalty
    bonus = score("signed", "It is **B**.", None)
    assert (bonus.score, bonus.accuracy, bonus.format) == (2.0, 2.0, 0.0)
    assert "nonfinite" not in bonus.details and "error" not in bonus.details


def test_a_nonfinite_plugin_reward_scores_0_and_is_counted(range_plugins):
    results = [score("unstable", response, None) for response in ("nan", "inf", "-inf", "0.25", "text")]
    assert [r.score for r in results] == [0.0, 0.0, 0.0, 0.25, 1.0]
    assert results[0].details["nonfinite"] == {"score": "nan", "accuracy": "nan"}
    assert results[2].details["nonfinite"] == {"score": "-inf", "accuracy": "-inf"}
    partial = score("nan_format", "x", None)  # only the nan value becomes 0
    assert (partial.score, partial.accuracy, partial.format) == (0.5, 1.0, 0.0)
    assert partial.details == {"why": "format left undefined", "nonfinite": {"format": "nan"}}
    metrics = aggregate([*results, partial], ["unstable"] * 5 + ["nan_format"])
    assert metrics["reward/nonfinite"] == 4.0  # nan, inf, -inf and the nan format
    assert metrics["reward/mean"] == pytest.approx((0.25 + 1.0 + 0.5) / 6)
    assert aggregate(results[3:], ["unstable"] * 2)["reward/nonfinite"] == 0.0  # logged on every step


def test_a_judge_outside_0_1_is_reported_not_clipped():
    from omni_rl.rewards import register

    register("range_test_judge")(lambda prediction, target: float(prediction))
    try:
        over = score("range_test_judge", "<answer>1.5</answer>", None)
        assert over.accuracy == 0.0 and "accuracy 1.5, outside [0, 1]" in over.details["error"]
        assert "accuracy nan, outside [0, 1]" in score("range_test_judge", "nan", None).details["error"]
        inside = score("range_test_judge", "<think>x</think><answer>0.5</answer>", None)
        assert inside.accuracy == 0.5 and inside.score == pytest.approx(0.9 * 0.5 + 0.1 * 1.0)
        assert "error" not in inside.details
    finally:
        SCORERS._items.pop("range_test_judge", None)


@pytest.mark.parametrize(
    ("rewards", "message"),
    [
        (
            {"accuracy_weight": 1.0, "format_weight": 0.5},
            r"rewards\.format_weight: accuracy_weight 1 and format_weight 0\.5 sum to 1\.5, above 1.*0\.667 and 0\.333",
        ),
        (
            {"accuracy_weight": -0.5},
            r"rewards\.accuracy_weight: accuracy_weight -0\.5 and format_weight 0\.1 must be finite and >= 0",
        ),
        ({"format_weight": float("inf")}, r"rewards\.format_weight: accuracy_weight 0\.9 and format_weight inf must"),
        ({"accuracy_weight": float("nan")}, r"rewards\.accuracy_weight: accuracy_weight nan and format_weight 0\.1"),
        ({"accuracy_weight": 0.0, "format_weight": 0.0}, r"rewards\.format_weight: .* are both 0"),
        ({"weights": {"ocr": [1.0, 0.5]}}, r"rewards\.weights\.ocr: accuracy 1 and format 0\.5 sum to 1\.5, above 1"),
    ],
    ids=["sum-above-1", "negative", "inf", "nan", "all-zero", "per-type-sum-above-1"],
)
def test_weights_that_leave_0_1_or_say_nothing_are_refused_at_load(rewards, message):
    from omni_rl.errors import ConfigError
    from omni_rl.recipe_loader import config_from_dict

    with pytest.raises(ConfigError, match=message):
        config_from_dict({"recipe": "preprocess", "rewards": rewards})


def test_reward_settings_refuse_the_same_weights():
    with pytest.raises(ValueError, match=r"default weights: accuracy 1 and format 0\.5 sum to 1\.5"):
        RewardSettings(accuracy_weight=1.0, format_weight=0.5)
    with pytest.raises(ValueError, match=r"counting weights: accuracy -1 and format 1 must be finite and >= 0"):
        RewardSettings(weights={"counting": (-1.0, 1.0)})
    # a sum of 1 up to rounding, a smaller one, or no format weight: accepted, and the sum is the reward
    settings = RewardSettings(
        accuracy_weight=0.7, format_weight=0.3, weights={"ocr": (1.0, 0.0), "counting": (0.5, 0.25)}
    )
    assert score("counting", "<think>x</think><answer>3</answer>", 3, settings=settings).score == 0.75


def test_dynamic_sampling_keeps_a_group_told_apart_by_a_penalty(range_plugins):
    import torch

    from omni_rl.algorithms.sampling import informative_groups

    responses = ["Sorry, no idea.", "It is 3.", "**3**", "**3**"]
    results = score_batch(["signed"] * 4, responses, [Target(3)] * 4)
    rewards = torch.tensor([r.score for r in results])
    assert rewards.tolist() == [-1.0, 0.0, 2.0, 2.0]
    assert informative_groups(rewards, 2).tolist() == [True, False]  # -1 against 0 teaches; 2 against 2 does not


def test_rewards_cli_prints_plugin_values_and_refuses_bad_weights(capsys):
    from omni_rl.cli import main

    plug = [
        "--set",
        "rewards.custom.signed=reward_plugins:signed",
        "--set",
        "rewards.custom.unstable=reward_plugins:unstable",
    ]
    try:
        assert main(["rewards", "score", "--type", "signed", "--answer", "3", "--response", "Sorry.", *plug]) == 0
        assert json.loads(capsys.readouterr().out)["score"] == -1.0
        assert main(["rewards", "score", "--type", "unstable", "--answer", "3", "--response", "nan", *plug]) == 0
        printed = json.loads(capsys.readouterr().out)  # valid JSON: no bare NaN
        assert printed["score"] == 0.0 and printed["details"]["nonfinite"]["score"] == "nan"
    finally:
        for name in ("signed", "unstable"):
            SCORERS._items.pop(name, None)
    weights = ["--set", "rewards.accuracy_weight=1", "--set", "rewards.format_weight=0.5"]
    assert main(["rewards", "score", "--type", "counting", "--answer", "3", "--response", "3", *weights]) == 2
    assert "accuracy_weight 1 and format_weight 0.5 sum to 1.5" in capsys.readouterr().err


@pytest.mark.parametrize(
    "weights, custom, message",
    [
        ({"mcq": [0.5, 0.5]}, {}, "weights are keyed by the type's name: write 'multiple_choice'"),
        ({"multiple_chioce": [0.5, 0.5]}, {}, "no built-in problem type 'multiple_chioce'.*multiple_choice"),
        ({"signed": [0.5, 0.5]}, {"signed": "reward_plugins:signed"}, "'signed' is a plug-in"),
    ],
)
def test_weights_that_no_scorer_reads_are_refused_at_load(weights, custom, message):
    from omni_rl.config import ConfigError
    from omni_rl.recipe_loader import config_from_dict

    with pytest.raises(ConfigError, match=rf"rewards\.weights\.\w+: .*{message}"):
        config_from_dict(
            {"recipe": "grpo", "rewards": {"weights": weights, "custom": custom}, "run": {"output_dir": "x"}}, "test"
        )


def test_rewards_check_names_the_end_of_a_line_cut_short(tmp_path, capsys):
    """A line cut at its end is invalid JSON 'at the end of the line', not 'column 1'
    (where the decoder lands past the newline); an error inside a line keeps its column."""
    from omni_rl.cli import main

    data = tmp_path / "d.jsonl"
    good = json.dumps({"id": "a", "problem": "p", "problem_type": "counting", "answer": 2})
    data.write_text(good + '\n{"id": "x", "problem"\n{"id": "y" "problem": "p"}\n')
    assert main(["rewards", "check", str(data)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[:2] == [
        f"unreadable: {data}:2: invalid JSON (Expecting ':' delimiter at the end of the line)",
        f"unreadable: {data}:3: invalid JSON (Expecting ',' delimiter at column 12)",
    ]
