"""Choice problems: multiple_choice (a letter, or an option's text), choice_text (the
option's text only, as R1-AQA scores audio QA) and boolean."""

from __future__ import annotations

import re

from omni_rl.rewards.base import Target, register
from omni_rl.rewards.parsing import normalize_text

LETTERS = "ABCDEFGHIJ"
# "B", "(B)", "B.", "B)", "B:"
LONE = re.compile(r"\(?\s*([A-Ja-j])\s*\)?\s*[.):：]?")
# "Answer: B", "the answer is (B).", "Option B", "correct choice: C"
PREFIXED = re.compile(
    r"(?:the\s+)?(?:correct\s+|final\s+)?(?:answer|option|choice)\s*(?:is|:|：)?\s*\(?([A-Ja-j])\)?\s*[.)]?",
    re.IGNORECASE,
)
# "B. the text", "(B) the text"
LABELLED = re.compile(r"\(?([A-J])\)?\s*[.):：]\s*(.+)", re.DOTALL)
# "... so the answer is B ..." anywhere in a longer text
ANSWER_IS = re.compile(r"(?:answer|option|choice)\s*(?:is|:|：)\s*\(?([A-J])\)?(?![A-Za-z])", re.IGNORECASE)
STANDALONE = re.compile(r"(?<![A-Za-z])([A-J])(?![A-Za-z])")
OPTION_PREFIX = re.compile(r"^\s*\(?[A-J]\)?\s*[.):：]\s*")


def _option_texts(options: list[str] | None) -> list[str]:
    """Options without a leading 'A.' / '(A)' label, normalized."""
    return [normalize_text(OPTION_PREFIX.sub("", str(o))) for o in options or []]


def _by_text(text: str, options: list[str] | None) -> str | None:
    """The letter of the one option whose text equals ``text`` (normalized)."""
    texts = _option_texts(options)
    norm = normalize_text(text)
    return LETTERS[texts.index(norm)] if norm and texts.count(norm) == 1 else None


def parse_choice(prediction: str, options: list[str] | None = None) -> str | None:
    """The single option letter a prediction names, or None.

    Accepted: a lone letter ("B", "(B)", "B.", "B)"), an option's text, "Answer: B" /
    "the answer is B", "B. <that option's text>", or a longer text that says "the answer
    is B" and names no other letter. Several letters ("A, B, C, D"), a letter beyond the
    options, or a label whose text is another option's are not an answer.
    """
    text = prediction.strip()
    letter = None
    if m := LONE.fullmatch(text):
        letter = m.group(1).upper()
    elif options and (by_text := _by_text(text, options)):
        letter = by_text
    elif m := PREFIXED.fullmatch(text):
        letter = m.group(1).upper()
    elif m := LABELLED.fullmatch(text):
        letter = m.group(1)
        named = _by_text(m.group(2), options) if options else None
        if (named is not None and named != letter) or len({x for x in STANDALONE.findall(m.group(2))} - {letter}) > 0:
            letter = None
    elif len(said := {x.upper() for x in ANSWER_IS.findall(text)}) == 1:
        letter = said.pop()
        if {x for x in STANDALONE.findall(text)} - {letter}:
            letter = None
    allowed = LETTERS[: len(options)] if options else LETTERS
    return letter if letter is not None and letter in allowed else None


def gold_letter(target: Target) -> str:
    """The gold answer as a letter: given as a letter, or as an option's text."""
    answer = str(target.answer).strip()
    letter = parse_choice(answer, target.options) if answer else None
    if letter is None:
        raise ValueError(f"multiple_choice answer {answer!r} is not an option letter or an option's text")
    return letter


def _validate_choice(target: Target) -> None:
    gold_letter(target)


@register(
    "multiple_choice",
    aliases=("multiple-choice", "mcq", "choice"),
    fits=lambda p: parse_choice(p) is not None,
    validate=_validate_choice,
)
def multiple_choice(prediction: str, target: Target) -> tuple[float, dict]:
    letter = parse_choice(prediction, target.options)
    gold = gold_letter(target)
    return float(letter == gold), {"predicted": letter, "gold": gold}


def gold_text(target: Target) -> str:
    """The gold option's text (normalized): the answer given as a letter or as text."""
    texts = _option_texts(target.options)
    if not texts:
        raise ValueError("choice_text needs the row's options")
    return texts[LETTERS.index(gold_letter(target))]


def _validate_choice_text(target: Target) -> None:
    gold_text(target)


@register("choice_text", fits=lambda p: bool(p.strip()), validate=_validate_choice_text)
def choice_text(prediction: str, target: Target) -> tuple[float, dict]:
    """Right when the answer is the gold option's text (case, punctuation and spacing
    aside); a letter is not an answer here."""
    predicted = normalize_text(OPTION_PREFIX.sub("", prediction)) if not LONE.fullmatch(prediction.strip()) else ""
    gold = gold_text(target)
    return float(predicted == gold), {"predicted": predicted, "gold": gold}


TRUE = {"yes", "y", "true", "t", "1", "correct", "right", "yeah", "yep", "affirmative", "是", "对"}
FALSE = {"no", "n", "false", "f", "0", "incorrect", "wrong", "nope", "negative", "否", "不是", "错"}


STRONG = {"yes": True, "true": True, "no": False, "false": False}


def parse_bool(text) -> bool | None:
    """yes/no, true/false, 1/0 and their common forms, alone or leading a sentence
    ("Yes, it is."); a hedge naming both ("yes and no") is no answer."""
    if isinstance(text, bool):
        return text
    norm = normalize_text(str(text))
    if norm in TRUE:
        return True
    if norm in FALSE:
        return False
    if len({STRONG[w] for w in norm.split() if w in STRONG}) > 1:
        return None
    first = norm.split(" ", 1)[0] if norm else ""
    if first in TRUE - {"1", "t", "y"}:
        return True
    if first in FALSE - {"0", "f", "n"}:
        return False
    return None


def _validate_bool(target: Target) -> None:
    if parse_bool(target.answer) is None:
        raise ValueError(f"boolean answer {target.answer!r} is not yes/no or true/false")


@register(
    "boolean",
    aliases=("yes_no", "bool", "true_false"),
    fits=lambda p: parse_bool(p) is not None,
    validate=_validate_bool,
)
def boolean(prediction: str, target: Target) -> tuple[float, dict]:
    predicted = parse_bool(prediction)
    gold = parse_bool(target.answer)
    return float(predicted is not None and predicted == gold), {"predicted": predicted}
