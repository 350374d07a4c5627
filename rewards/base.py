"""The reward contract: typed results, the scorer registry, answer extraction, format.

A problem type registers a *judge*: ``judge(prediction, target) -> accuracy`` (or
``(accuracy, details)``), where ``prediction`` is the answer text extracted from the
response and ``target`` carries ``answer``, ``options`` and the row's ``fields``. The
registry wraps it into a ``Scorer``, a callable ``(response, target) -> RewardResult``
that adds answer extraction, the format check and the weighted total, and never
raises on model output: a judge that throws scores 0 with the error in ``details``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from omni_rl.registry import Registry

# --------------------------------------------------------------------------- results


@dataclass(frozen=True)
class RewardResult:
    """One scored completion.

    Attributes:
        score: the reward, ``w_acc * accuracy + w_fmt * format``, in [0, 1].
        accuracy: how right the answer is, in [0, 1].
        format: how well the response follows the template and fits the type, in [0, 1].
        details: what was extracted and why (for logs and debugging).
    """

    score: float
    accuracy: float
    format: float
    details: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Target:
    """What a response is scored against: the gold answer, options and row fields."""

    answer: Any
    options: list[str] | None = None
    fields: dict = field(default_factory=dict)


# -------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class RewardSettings:
    """How rewards are computed (the ``rewards`` config section maps onto this).

    Attributes:
        template: ``think_answer`` (<think>...</think><answer>...</answer>) or
            ``answer_only`` (<answer>...</answer>).
        accuracy_weight, format_weight: default weights of the total.
        weights: per problem type (accuracy, format) weights overriding the default.
        math_timeout: hard limit in seconds on one math verification.
    """

    template: Literal["think_answer", "answer_only"] = "think_answer"
    accuracy_weight: float = 0.9
    format_weight: float = 0.1
    weights: dict[str, tuple[float, float]] = field(default_factory=dict)
    math_timeout: float = 2.0

    def weights_for(self, problem_type: str) -> tuple[float, float]:
        return self.weights.get(problem_type, (self.accuracy_weight, self.format_weight))


# ------------------------------------------------------------------------ extraction

# Responses can be huge and adversarial ("<answer>" x 25,000, "\\boxed{" x 3,000):
# everything here runs in time linear in the response, with no backtracking regexes.
ANSWER_TAGS = re.compile(r"<(/?)answer>", re.IGNORECASE)
THINK_TAGS = re.compile(r"<(/?)think>", re.IGNORECASE)
BOXED_OPEN = re.compile(r"\\boxed\s*\{")
BRACES = re.compile(r"[{}]")
TEMPLATES = {
    "think_answer": re.compile(
        r"\s*<think>((?!</?think>).)*</think>\s*<answer>((?!</?answer>).)*</answer>\s*", re.DOTALL | re.IGNORECASE
    ),
    "answer_only": re.compile(r"\s*<answer>((?!</?answer>).)*</answer>\s*", re.DOTALL | re.IGNORECASE),
}
MAX_RESPONSE_CHARS = 200_000


def last_boxed(text: str) -> str | None:
    r"""Content of the last closed ``\boxed{...}`` (nested braces balanced), or None."""
    boxed = {m.end() - 1 for m in BOXED_OPEN.finditer(text)}
    if not boxed:
        return None
    best: tuple[int, int] | None = None
    stack: list[int] = []
    for m in BRACES.finditer(text):
        if m.group() == "{":
            stack.append(m.start())
        elif stack:
            opened = stack.pop()
            if opened in boxed and (best is None or opened > best[0]):
                best = (opened, m.start())
    return None if best is None else text[best[0] + 1 : best[1]]


def last_tag_block(text: str, tags: re.Pattern) -> str | None:
    """Content between the last closing tag and the last opening tag before it."""
    opened = closed = None
    for m in tags.finditer(text):
        if m.group(1):
            if opened is not None:
                closed = (opened, m.start())
        else:
            opened = m.end()
    return None if closed is None else text[closed[0] : closed[1]]


def strip_blocks(text: str, tags: re.Pattern) -> str:
    """``text`` without its tag blocks (an unclosed block runs to the end)."""
    out, depth, position = [], 0, 0
    for m in tags.finditer(text):
        if not m.group(1):
            if depth == 0:
                out.append(text[position : m.start()])
            depth += 1
        elif depth:
            depth -= 1
            position = m.end()
    if depth == 0:
        out.append(text[position:])
    return "".join(out)


def extract_answer(response: str) -> tuple[str | None, str]:
    """(the answer text, where it came from): the last <answer> block, else the last
    \\boxed{}, else the response without its <think> blocks; None when empty."""
    tagged = last_tag_block(response, ANSWER_TAGS)
    if tagged is not None:
        text, source = tagged, "answer_tag"
        boxed = last_boxed(text)
        if boxed is not None:
            text, source = boxed, "answer_tag_boxed"
    elif (boxed := last_boxed(response)) is not None:
        text, source = boxed, "boxed"
    else:
        text, source = strip_blocks(response, THINK_TAGS), "raw"
    text = text.strip()
    return (text or None), source


def template_ok(response: str, template: str) -> bool:
    """Whether the whole response follows the template, each tag exactly once."""
    return TEMPLATES[template].fullmatch(response) is not None


# -------------------------------------------------------------------------- registry


def _clamp(value: float) -> float:
    return 0.0 if not math.isfinite(value) else min(1.0, max(0.0, float(value)))


@dataclass(frozen=True)
class Scorer:
    """A problem type's scorer: ``scorer(response, target, settings) -> RewardResult``.

    Attributes:
        name: the problem type.
        judge: ``(prediction, target) -> accuracy | (accuracy, details)``; prediction is
            the extracted answer text (never empty).
        fits: ``prediction -> bool``, whether the answer has the type's shape (a letter
            for multiple choice, a number for numerical...); part of the format score.
        validate: ``target -> None``, raises ValueError on a gold answer that could never
            be matched; run when a dataset loads.
        slow: scored in worker processes by ``score_batch`` (math).
    """

    name: str
    judge: Callable[[str, Target], float | tuple[float, dict]]
    fits: Callable[[str], bool] = lambda prediction: True
    validate: Callable[[Target], None] | None = None
    slow: bool = False

    def __call__(self, response: str, target: Target, settings: RewardSettings | None = None) -> RewardResult:
        settings = settings or RewardSettings()
        if not isinstance(response, str):
            response = "" if response is None else str(response)
        response = response[:MAX_RESPONSE_CHARS]
        prediction, source = extract_answer(response)
        details: dict = {"extracted": None if prediction is None else prediction[:200], "source": source}
        accuracy = 0.0
        fits = False
        if prediction is not None:
            try:
                judged = self.judge(prediction, target)
                accuracy, extra = judged if isinstance(judged, tuple) else (judged, {})
                details.update(extra)
                fits = bool(self.fits(prediction))
            except Exception as err:  # noqa: BLE001 - model output must never crash a run
                details["error"] = f"{type(err).__name__}: {err}"[:300]
                accuracy = 0.0
        fmt = (0.5 if template_ok(response, settings.template) else 0.0) + (0.5 if fits else 0.0)
        w_acc, w_fmt = settings.weights_for(self.name)
        accuracy = _clamp(accuracy)
        return RewardResult(_clamp(w_acc * accuracy + w_fmt * fmt), accuracy, fmt, details)


SCORERS: Registry[Scorer] = Registry("problem type")


def register(
    name: str,
    aliases: tuple[str, ...] = (),
    *,
    fits: Callable[[str], bool] | None = None,
    validate: Callable[[Target], None] | None = None,
    slow: bool = False,
) -> Callable:
    """Decorator registering a judge as the scorer of problem type ``name``."""

    def decorate(judge: Callable) -> Callable:
        SCORERS.register(name, aliases)(Scorer(name, judge, fits or (lambda prediction: True), validate, slow))
        return judge

    return decorate
