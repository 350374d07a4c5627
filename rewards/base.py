"""The reward contract: typed results, the scorer registry, answer extraction, format.

A problem type registers a *judge*: ``judge(prediction, target) -> accuracy`` (or
``(accuracy, details)``), where ``prediction`` is the answer text extracted from the
response and ``target`` carries ``answer``, ``options`` and the row's ``fields``. The
registry wraps it into a ``Scorer``, a callable ``(response, target) -> RewardResult``
that adds answer extraction, the format check and the weighted total, and never
raises on model output: a judge that throws, or breaks its contract by returning an
accuracy outside [0, 1] (nan included), scores accuracy 0 with the error in ``details``.

Ranges: a judge's accuracy and the format score are in [0, 1], and the weights are
finite, >= 0 and sum to at most 1 (``weights_problem``), so a built-in reward
``w_acc * accuracy + w_fmt * format`` is in [0, 1] without being clipped. Plug-in
scorers (``omni_rl.rewards.router``) may return any finite value.
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
        score: the reward, ``w_acc * accuracy + w_fmt * format``, in [0, 1] for the
            built-in scorers; any finite value for a plug-in.
        accuracy: how right the answer is, in [0, 1] for the built-in scorers.
        format: how well the response follows the template and fits the type, in [0, 1]
            for the built-in scorers.
        details: what was extracted and why (for logs and debugging); ``error`` when the
            scorer failed, ``nonfinite`` when a plug-in returned nan or inf.
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
        require_template: a response that does not follow ``template`` as a whole
            gets no accuracy term in its score (its ``accuracy`` is still reported),
            so an answer followed by anything, or cut off before its closing tag, is
            not rewarded like a finished one.
        math_timeout: hard limit in seconds on one math verification.

    Raises:
        ValueError: on weights that ``weights_problem`` refuses.
    """

    template: Literal["think_answer", "answer_only"] = "think_answer"
    accuracy_weight: float = 0.9
    format_weight: float = 0.1
    weights: dict[str, tuple[float, float]] = field(default_factory=dict)
    math_timeout: float = 2.0
    require_template: bool = False

    def __post_init__(self):
        pairs = {"default": (self.accuracy_weight, self.format_weight), **self.weights}
        for name, (accuracy, format_) in pairs.items():
            if (problem := weights_problem(accuracy, format_)) is not None:
                raise ValueError(f"{name} weights: accuracy {accuracy:g} and format {format_:g} {problem}")

    def weights_for(self, problem_type: str) -> tuple[float, float]:
        return self.weights.get(problem_type, (self.accuracy_weight, self.format_weight))


def weights_problem(accuracy: float, format_: float) -> str | None:
    """Why an (accuracy, format) weight pair is refused, phrased to follow the two
    weights ("... 1 and ... 0.5 sum to 1.5, ..."), or None when it is usable.

    A built-in reward is ``w_acc * accuracy + w_fmt * format`` with accuracy and format
    in [0, 1], and is never clipped. Refused:

    - a negative or non-finite weight: it rewards wrong answers or broken templates, or
      turns every reward into inf or nan;
    - both weights 0: every completion scores 0 and nothing is learnt;
    - a sum above 1: the reward would leave [0, 1], so problem types with different
      weights would train on different scales in one batch (advantages that are not
      divided by the group's spread, or are whitened over the batch, weigh them
      unequally) and ``reward/mean`` would stop reading as a fraction; clipping the sum
      back into [0, 1] instead erases the format term (with 1 and 0.5, a right answer
      scores 1.0 with or without format).

    A sum below 1 only scales the reward, and a zero format weight is an explicit
    choice of no format signal (``{ocr: [1.0, 0.0]}``); both are accepted.
    """
    if not (math.isfinite(accuracy) and math.isfinite(format_) and accuracy >= 0 and format_ >= 0):
        return "must be finite and >= 0"
    total = accuracy + format_
    if total == 0:
        return "are both 0: every completion would score 0"
    if total > 1 + 1e-9:  # 0.7 + 0.3 and the like are 1 up to rounding
        return (
            f"sum to {total:g}, above 1: rewards are not clipped and built-in ones stay in [0, 1] only when "
            f"the weights sum to at most 1 (the same ratio: {accuracy / total:.3g} and {format_ / total:.3g})"
        )
    return None


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
    """``text`` without its tag blocks (an unclosed block runs to the end; a closing
    tag before any opening one ends a block the prompt opened, as chat templates that
    open ``<think>`` in the generation prompt do, so the text before it goes too)."""
    out, depth, position = [], 0, 0
    for i, m in enumerate(tags.finditer(text)):
        if not m.group(1):
            if depth == 0:
                out.append(text[position : m.start()])
            depth += 1
        elif depth or i == 0:
            depth = max(depth - 1, 0)
            position = m.end()
    if depth == 0:
        out.append(text[position:])
    return "".join(out)


def extract_answer(response: str) -> tuple[str | None, str]:
    """(the answer text, where it came from), read outside the <think> blocks (a draft
    there is no answer): the last <answer> block, else the last \\boxed{}, else that
    text itself; a response wholly inside <think> blocks has its tags and boxes read
    there. None when empty."""
    outside = strip_blocks(response, THINK_TAGS)
    searched = outside if outside.strip() else response
    tagged = last_tag_block(searched, ANSWER_TAGS)
    if tagged is not None:
        text, source = tagged, "answer_tag"
        boxed = last_boxed(text)
        if boxed is not None:
            text, source = boxed, "answer_tag_boxed"
    elif (boxed := last_boxed(searched)) is not None:
        text, source = boxed, "boxed"
    else:
        text, source = outside, "raw"
    text = text.strip()
    return (text or None), source


def template_ok(response: str, template: str) -> bool:
    """Whether the whole response follows the template, each tag exactly once. Under
    ``think_answer`` a response whose first think tag is ``</think>`` closes a block the
    prompt opened (Qwen3's thinking chat templates), and follows it as the block and
    the rest would."""
    first = THINK_TAGS.search(response)
    if template == "think_answer" and first is not None and first.group(1):
        response = "<think>" + response
    return TEMPLATES[template].fullmatch(response) is not None


# -------------------------------------------------------------------------- registry


@dataclass(frozen=True)
class Scorer:
    """A problem type's scorer: ``scorer(response, target, settings) -> RewardResult``.

    Attributes:
        name: the problem type.
        judge: ``(prediction, target) -> accuracy | (accuracy, details)``, accuracy in
            [0, 1]; prediction is the extracted answer text (never empty).
        fits: ``(prediction, target) -> bool``, whether the answer has the type's shape
            for this row (one of its options for multiple choice, a number for
            numerical...); part of the format score.
        validate: ``target -> None``, raises ValueError on a gold answer that could never
            be matched; run when a dataset loads.
        slow: scored in worker processes by ``score_batch`` (math).
    """

    name: str
    judge: Callable[[str, Target], float | tuple[float, dict]]
    fits: Callable[[str, Target], bool] = lambda prediction, target: True
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
                accuracy = float(accuracy)
                if not 0.0 <= accuracy <= 1.0:  # a judge bug: reported, never clipped into range
                    raise ValueError(f"the {self.name} judge returned accuracy {accuracy}, outside [0, 1]")
                fits = bool(self.fits(prediction, target))
            except Exception as err:  # noqa: BLE001 - model output must never crash a run
                details["error"] = f"{type(err).__name__}: {err}"[:300]
                accuracy = 0.0
        follows = template_ok(response, settings.template)
        fmt = (0.5 if follows else 0.0) + (0.5 if fits else 0.0)
        credited = accuracy if follows or not settings.require_template else 0.0
        w_acc, w_fmt = settings.weights_for(self.name)
        return RewardResult(w_acc * credited + w_fmt * fmt, accuracy, fmt, details)


SCORERS: Registry[Scorer] = Registry("problem type")


def register(
    name: str,
    aliases: tuple[str, ...] = (),
    *,
    fits: Callable[[str, Target], bool] | None = None,
    validate: Callable[[Target], None] | None = None,
    slow: bool = False,
) -> Callable:
    """Decorator registering a judge as the scorer of problem type ``name``."""

    def decorate(judge: Callable) -> Callable:
        SCORERS.register(name, aliases)(Scorer(name, judge, fits or (lambda prediction, target: True), validate, slow))
        return judge

    return decorate
