"""Parsers shared by the scorers: numbers, spans of time, boxes, normalized text.

Every parser returns None on text it cannot read (never raises on model output) and
works in time linear in the input.
"""

from __future__ import annotations

import json
import math
import re
import unicodedata
from dataclasses import dataclass
from fractions import Fraction

NUMBER_WORDS = {
    w: i
    for i, w in enumerate(
        [
            "zero",
            "one",
            "two",
            "three",
            "four",
            "five",
            "six",
            "seven",
            "eight",
            "nine",
            "ten",
            "eleven",
            "twelve",
            "thirteen",
            "fourteen",
            "fifteen",
            "sixteen",
            "seventeen",
            "eighteen",
            "nineteen",
            "twenty",
        ]
    )
}
# A number: optional sign, digits with optional thousands separators, decimals,
# exponent, an optional fraction denominator and a percent sign.
NUMBER = re.compile(
    r"(?<![\w.])([-+−]?)(\d{1,3}(?:,\d{3})+(?!\d)|\d+)(\.\d+)?(?:[eE]([-+]?\d{1,4}))?(?:\s*/\s*(\d+))?\s*(%)?"
    r"|(?<![\w.])([-+−]?)\.(\d+)"
)
# "a × 10^b" (× written ×, \\times, \\cdot, ·, * or x; the power ^ or **, its exponent in
# braces or not, or superscript: "10⁵") and "10^b" alone, read as one number "aeb".
TIMES_TEN_TO = re.compile(
    r"(?:(?<![\d,.])(\d[\d,]*(?:\.\d+)?)\s*(?:×|\\times|\\cdot|·|\*|x|X)\s*)?"
    r"(?<![\w.])10\s*(?:\^|\*\*)\s*(\{)?\s*([-+−]?\d{1,4})\s*(?(2)\})"
)
SUPERSCRIPT_POWER = re.compile(r"(?<![\w.])10([⁻]?[⁰¹²³⁴⁵⁶⁷⁸⁹]+)")
SUPERSCRIPTS = str.maketrans("⁰¹²³⁴⁵⁶⁷⁸⁹⁻", "0123456789-")
# "2nd", "3rd": an ordinal names a place, not an amount, beside another number
ORDINAL = re.compile(r"(?:st|nd|rd|th)\b", re.IGNORECASE)
# a scale after a number multiplies it ("one hundred", "1.5 million"); before the last
# number word it makes a compound number ("one hundred and five"), which is not read
SCALES = {"hundred": 100, "thousand": 1_000, "million": 1_000_000, "billion": 1_000_000_000}
SCALE_AFTER = re.compile(r"\s*(" + "|".join(SCALES) + r")\b", re.IGNORECASE)
SCALE_BEFORE = re.compile(r"\b(?:" + "|".join(SCALES) + r")(?:\s+and)?\s+$", re.IGNORECASE)
# A whole word: "someone" and "twenty-one" hold none.
NUMBER_WORD = re.compile(r"(?<![\w-])(" + "|".join(NUMBER_WORDS) + r")(?![\w-])", re.IGNORECASE)
# "one" as a pronoun, not a number: "each one", "the one on the left", "no one", "one of them"
PRONOUN_ONE = re.compile(
    r"(?:\b(?:each|this|that|the|which|every|any|no|some|another|other|same|last|next|right|wrong) )one\b"
    r"|\bone(?= of\b|'s\b| another\b)",
    re.IGNORECASE,
)
MAX_NUMBER_TEXT = 5_000


def _last_number_word(text: str) -> tuple[int, int, float | None] | None:
    """(start, end, value) of the last number word in ``text`` ("one" as a pronoun
    aside), or None when there is none. Its value is None when another number word or a
    scale precedes it with only spaces (or "and") between ("twenty one", "one hundred
    and five"): numbers past twenty in words are not read, not misread as their last
    word."""
    pronouns = {m.end() for m in PRONOUN_ONE.finditer(text)}
    words = [m for m in NUMBER_WORD.finditer(text) if m.end() not in pronouns]
    if not words:
        return None
    last = words[-1]
    joined = len(words) > 1 and not text[words[-2].end() : last.start()].strip()
    if joined or SCALE_BEFORE.search(text, 0, last.start()):
        return last.start(), last.end(), None
    return last.start(), last.end(), float(NUMBER_WORDS[last.group(1).lower()])


def _scaled(value: float | None, text: str, end: int) -> float | None:
    """``value`` times the scale word right after it ("hundred", "million"), if any."""
    scale = SCALE_AFTER.match(text, end)
    return value * SCALES[scale.group(1).lower()] if scale and value is not None else value


def _is_exponent(text: str, start: int) -> bool:
    """Whether the number at ``start`` is a power's exponent ("m^2", "km**2", "^{3}");
    looks back over the spaces and brace before it only (linear over all numbers)."""
    i = start
    while i > 0 and text[i - 1] in " {":
        i -= 1
    return text.endswith("^", 0, i) or text.endswith("**", 0, i)


def _digit_numbers(text: str) -> tuple[str, list[re.Match]]:
    """``text`` (its end) with powers of ten folded into one number ("3.2 × 10^5" ->
    "3.2e5"), and its numbers in digits that ``parse_number`` reads: no power's
    exponent, and no ordinal beside another number."""
    text = str(text)[-MAX_NUMBER_TEXT:].strip()
    text = SUPERSCRIPT_POWER.sub(lambda m: "10^" + m.group(1).translate(SUPERSCRIPTS), text)
    text = TIMES_TEN_TO.sub(lambda m: f"{m.group(1) or 1}e{m.group(3).replace('−', '-')}", text)
    matches = [m for m in NUMBER.finditer(text) if not _is_exponent(text, m.start())]
    amounts = [m for m in matches if not ORDINAL.match(text, m.end())]
    return text, amounts or matches


def numbers_in(text: str) -> int:
    """How many numbers in digits ``text`` holds as ``parse_number`` reads them: "25
    m^2", "3.2 × 10^5" and "4 people in the 2nd clip" hold one, "3 to 5" two."""
    return len(_digit_numbers(text)[1])


def parse_number(text: str) -> float | None:
    """The last number in ``text``, written in digits ("1,234.5", "45%", "3.2e5", "3/4",
    "-2", "about 4 meters", "3.2 × 10^5", "3 x 10⁸") or as a word from zero to twenty
    ("seven", "There are three chairs."), times a scale word after it ("1.5 million",
    "one hundred"); None when there is none or it is not finite. Percent signs are
    dropped: "45%" reads as 45. A power's exponent is no answer: "25 m^2" reads as 25;
    nor an ordinal beside another number: "4 people in the 2nd clip" reads as 4."""
    if text is None:
        return None
    text, matches = _digit_numbers(text)
    word = _last_number_word(text)
    if word is not None and (not matches or word[0] > matches[-1].start()):
        return _scaled(word[2], text, word[1])
    if not matches:
        return None
    m = matches[-1]
    if m.group(8) is not None:  # ".5"
        sign = -1 if m.group(7) in ("-", "−") else 1
        return sign * float("0." + m.group(8))
    sign = -1 if m.group(1) in ("-", "−") else 1
    integer = m.group(2).replace(",", "")
    try:
        if m.group(5) is not None and m.group(3) is None and m.group(4) is None:
            denominator = int(m.group(5))
            if denominator == 0:
                return None
            value = float(Fraction(int(integer), denominator))
        else:
            value = float(integer + (m.group(3) or "") + (f"e{m.group(4)}" if m.group(4) else ""))
    except (ValueError, OverflowError):
        return None
    value = _scaled(value * sign, text, m.end())
    return value if math.isfinite(value) else None


def parse_integer(text: str) -> int | None:
    """An integer answer ("3", "3 objects", "three"); None for non-integers."""
    value = parse_number(text)
    if value is None or value != int(value) or abs(value) > 1e15:
        return None
    return int(value)


def normalize_text(text: str, *, lower: bool = True, punctuation: bool = True, spaces: bool = True) -> str:
    """NFKC text with case folded, punctuation removed and runs of spaces collapsed."""
    text = unicodedata.normalize("NFKC", str(text))
    if lower:
        text = text.casefold()
    if punctuation:
        text = "".join(" " if unicodedata.category(c).startswith("P") else c for c in text)
    if spaces:
        text = " ".join(text.split())
    return text


# ------------------------------------------------------------ answers in JSON or brackets

PLAIN_NUMBER = r"[-+]?(?:\d+(?:\.\d+)?|\.\d+)"
MAX_NESTING = 6  # JSON levels searched for a box or span; deeper answers are not read


def load_json(text: str, limit: int = MAX_NUMBER_TEXT) -> dict | list | None:
    """The JSON object or array ``text`` holds, a Markdown code fence around it allowed
    (```json ... ```, as Qwen2.5-VL writes); None for anything else."""
    text = text[:limit].strip()
    if len(text) >= 6 and text.startswith("```") and text.endswith("```"):
        language, _, body = text[3:-3].partition("\n")
        text = (body if language.strip().isalpha() or not language.strip() else text[3:-3]).strip()
    if text[:1] not in ("[", "{"):
        return None
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):  # ValueError also covers integers past 4300 digits
        return None
    return value if isinstance(value, (dict, list)) else None


def as_float(value) -> float | None:
    """A JSON number or a numeric string as a float (maybe not finite); None for
    anything else, booleans included."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        return None
    try:
        return float(value)
    except (ValueError, OverflowError):
        return None


def _numbers(values, count: int) -> tuple[float, ...] | None:
    """``values`` as floats when it is a list of exactly ``count`` numbers."""
    if not isinstance(values, (list, tuple)) or len(values) != count:
        return None
    floats = tuple(as_float(v) for v in values)
    return None if any(v is None for v in floats) else floats


def _only(candidates) -> tuple | None:
    """The one distinct candidate that is not None; None when there are none or several
    different ones (repeats of one value count once)."""
    found = {c for c in candidates if c is not None}
    return found.pop() if len(found) == 1 else None


def _bracketed(text: str, pattern: re.Pattern) -> set[tuple[float, ...]]:
    """The distinct bracketed groups of numbers ``pattern`` finds in ``text``."""
    return {tuple(float(g) for g in m.groups()) for m in pattern.finditer(text)}


# ------------------------------------------------------------------------ time spans

CLOCK = re.compile(r"(?<![\d:])(?:(\d{1,2}):)?(\d{1,2}):(\d{2}(?:\.\d+)?)(?![\d:])")
# a number and its unit, glued ("5s", "2min", "1m30s") or after a space ("2 minutes",
# "1 s"); no unit is seconds. Not part of "1.2.3", "5th" or "5 so"
QUANTITY = re.compile(
    r"(?:(?<![\w.])|(?<=\d[hm]))(\d+(?:\.\d+)?)"
    r"(?:(h|hrs?|m|mins?|s|secs?)(?![^\W\d])|(?: (hours?|hrs?|h|minutes?|mins?|seconds?|secs?|s))(?!\w)|(?!\w|\.\d))"
)
UNIT_SECONDS = {"h": 3600, "m": 60, "s": 1}  # by the unit's first letter
# what may join the parts of one time: "1 minute 30 seconds", "1 min, 30 s", "1h and 5m"
COMPOUND_GAP = re.compile(r" ?(?:,|and)? ?")
BRACKETED_SPAN = re.compile(rf"[\[(]\s*({PLAIN_NUMBER})\s*,\s*({PLAIN_NUMBER})\s*[\])]")
SPAN_PAIRS = (("start", "end"), ("start_time", "end_time"))
SPAN_KEYS = ("time", "timestamp", "timestamps", "span", "segment")


@dataclass
class _Time:
    """A time as written: where it is, its value in its unit and the unit's seconds
    (None when no unit was written; 1 for a clock)."""

    start: int
    end: int
    value: float
    unit: int | None


def _written_times(text: str) -> list[_Time]:
    """The clocks and numbers of ``text`` in order, each with its own unit, if any."""
    times = [
        _Time(m.start(), m.end(), int(m.group(1) or 0) * 3600 + int(m.group(2)) * 60 + float(m.group(3)), 1)
        for m in CLOCK.finditer(text)
    ]
    clocks = [(t.start, t.end) for t in times]
    for m in QUANTITY.finditer(text):
        if not any(a <= m.start() < b for a, b in clocks):
            unit = m.group(2) or m.group(3)
            times.append(_Time(m.start(), m.end(), float(m.group(1)), unit and UNIT_SECONDS[unit[0]]))
    return sorted(times, key=lambda t: t.start)


def _seconds_values(text: str) -> list[float]:
    """Times in seconds, in order of appearance: hh:mm:ss / mm:ss clocks and numbers
    with or without a unit (hours, minutes, seconds; none is seconds). A number
    without one takes the unit of the time right after it when that one has its own
    ("from 1 to 2 minutes"), and larger units followed by smaller ones make one time
    ("1 minute 30 seconds", "1m30s")."""
    merged: list[_Time] = []
    for t in _written_times(text):
        last = merged[-1] if merged else None
        joined = last is not None and last.unit and t.unit and last.unit > t.unit
        if joined and COMPOUND_GAP.fullmatch(text[last.end : t.start]):
            merged[-1] = _Time(last.start, t.end, last.value * last.unit / t.unit + t.value, t.unit)
        else:
            merged.append(t)
    seconds = []
    for i, t in enumerate(merged):
        unit = t.unit or (merged[i + 1].unit if i + 1 < len(merged) and merged[i + 1].unit else 1)
        seconds.append(t.value * unit)
    return seconds


def parse_time(value) -> float | None:
    """One time in seconds: a number, or text holding exactly one time ("12.5", "5s",
    "01:05"); None otherwise."""
    seconds = as_float(value)
    if seconds is None and isinstance(value, str):
        times = _seconds_values(value[:MAX_NUMBER_TEXT])
        seconds = times[0] if len(times) == 1 else None
    return seconds


def _text_span(text: str) -> tuple[float, float] | None:
    """Two times from free text: the one bracketed pair ("[s, e]"), or else all the
    text's times when there are exactly two ("from 1s to 5s", "00:10 - 00:20")."""
    text = text[:MAX_NUMBER_TEXT]
    bracketed = _bracketed(text, BRACKETED_SPAN)
    if bracketed:
        return _only(bracketed)
    times = _seconds_values(text)
    return (times[0], times[1]) if len(times) == 2 else None


def _find_span(value, nesting: int) -> tuple[float, float] | None:
    """The one span in a JSON value (unvalidated): ``[s, e]``, ``[[s, e]]``, an object
    with start/end or start_time/end_time, or one of SPAN_KEYS holding a span."""
    if nesting < 0:
        return None
    if isinstance(value, dict):
        for start, end in SPAN_PAIRS:
            if start in value and end in value:
                times = parse_time(value[start]), parse_time(value[end])
                return None if None in times else times
        key = next((k for k in SPAN_KEYS if k in value), None)
        return None if key is None else _find_span(value[key], nesting - 1)
    if not isinstance(value, (list, tuple)):
        return None
    if len(value) == 2 and not any(isinstance(v, (list, tuple, dict)) for v in value):
        times = parse_time(value[0]), parse_time(value[1])
        return None if None in times else times
    return _only(_find_span(v, nesting - 1) for v in value)


def parse_span(value) -> tuple[float, float] | None:
    """A [start, end] time span in seconds, or None.

    Accepted: ``[s, e]`` (numbers or time strings such as "01:05"); a list holding one
    span (``[[s, e]]``; repeats of it count once); an object with ``start``/``end``,
    ``start_time``/``end_time``, or ``time``/``timestamp``/``timestamps``/``span``/
    ``segment`` holding a span; such JSON inside a code fence; text with one bracketed
    pair or exactly two times ("from 2 to 4 seconds", "1 - 5 seconds", "from 1s to 5s",
    "mm:ss to mm:ss", "from 1 to 2 minutes", "1m30s - 2m"; see ``_seconds_values``).
    Refused: several different spans, text with other than two times and no single
    bracketed pair, end < start, a negative or non-finite start.
    """
    if isinstance(value, str):
        loaded = load_json(value)
        span = _text_span(value) if loaded is None else _find_span(loaded, MAX_NESTING)
    else:
        span = _find_span(value, MAX_NESTING)
    if span is None or not all(math.isfinite(v) for v in span) or span[1] < span[0] or span[0] < 0:
        return None
    return span


def interval_iou(a: tuple[float, float], b: tuple[float, float]) -> float:
    """IoU of two [start, end] intervals; two identical points score 1."""
    inter = max(0.0, min(a[1], b[1]) - max(a[0], b[0]))
    union = max(a[1], b[1]) - min(a[0], b[0])
    if union <= 0:
        return 1.0 if a == b else 0.0
    return inter / union


# ----------------------------------------------------------------------------- boxes

# a number standing alone: the digits of "x1" and "y2" are names, not coordinates
BOX_NUMBER = re.compile(rf"(?<![\w.]){PLAIN_NUMBER}")
BRACKETED_BOX = re.compile(rf"[\[(]\s*({PLAIN_NUMBER})" + rf"\s*,\s*({PLAIN_NUMBER})" * 3 + r"\s*[\])]")
BOX_KEYS = ("bbox_2d", "bbox", "box", "boxes")
CORNER_KEYS = ("x1", "y1", "x2", "y2")
# Objects searched for a box under keys other than BOX_KEYS: the answer's own values
# ({"person": box}) and one level down ({"answer": {"person": box}}).
OTHER_KEY_LEVELS = 2


def _text_box(text: str) -> tuple[float, ...] | None:
    """Four numbers from free text: the one bracketed group of four ("[x1, y1, x2, y2]"),
    or else all the text's numbers when there are exactly four ("(x1,y1),(x2,y2)",
    "x1=0, y1=0, x2=10, y2=10")."""
    text = text[:MAX_NUMBER_TEXT]
    bracketed = _bracketed(text, BRACKETED_BOX)
    if bracketed:
        return _only(bracketed)
    numbers = BOX_NUMBER.findall(text)
    return tuple(float(n) for n in numbers) if len(numbers) == 4 else None


def _find_box(value, nesting: int, levels: int) -> tuple[float, ...] | None:
    """The one box-shaped value in a JSON value (unvalidated): four numbers, a list of
    them, an object with one of BOX_KEYS or CORNER_KEYS, or an object whose values
    (``levels`` objects deep) hold one box under any key; None for none or several."""
    if nesting < 0:
        return None
    if isinstance(value, (list, tuple)):
        box = _numbers(value, 4)
        return box if box is not None else _only(_find_box(v, nesting - 1, levels) for v in value)
    if not isinstance(value, dict):
        return None
    key = next((k for k in BOX_KEYS if k in value), None)
    if key is not None:
        return _find_box(value[key], nesting - 1, levels)
    if all(k in value for k in CORNER_KEYS):
        return _numbers([value[k] for k in CORNER_KEYS], 4)
    if levels == 0:
        return None
    return _only(_find_box(v, nesting - 1, levels - 1) for v in value.values())


def parse_box(value) -> tuple[float, float, float, float] | None:
    """An [x1, y1, x2, y2] box, or None.

    Accepted: a list of four numbers; a list holding one box (``[[...]]``,
    ``[{"bbox_2d": [...], "label": "cat"}]``; repeats of one box count once); an object
    with ``bbox_2d``/``bbox``/``box``/``boxes`` holding a box, or with ``x1``..``y2``;
    an object whose only box sits under any other key, among its values or one level
    down (``{"person": [...]}``, ``{"answer": {"bbox": [...]}}``); such JSON inside a
    code fence; text with one bracketed group of four numbers or exactly four numbers.
    Refused: several different boxes (a degenerate one counts), degenerate (x2 < x1 or
    y2 < y1) or non-finite boxes, lists of other than four numbers, x/y/width/height
    objects (corner or centre is not said), text with other than four numbers and no
    single bracketed group.
    """
    if isinstance(value, str):
        loaded = load_json(value)
        box = _text_box(value) if loaded is None else _find_box(loaded, MAX_NESTING, OTHER_KEY_LEVELS)
    else:
        box = _find_box(value, MAX_NESTING, OTHER_KEY_LEVELS)
    if box is None or not all(math.isfinite(v) for v in box) or box[2] < box[0] or box[3] < box[1]:
        return None
    return box


def box_iou(a: tuple[float, float, float, float], b: tuple[float, float, float, float]) -> float:
    """IoU of two boxes in continuous coordinates (area = width x height, no +1)."""
    iw = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    ih = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = iw * ih
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    if union <= 0:
        return 1.0 if a == b else 0.0
    return inter / union
