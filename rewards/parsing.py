"""Parsers shared by the scorers: numbers, spans of time, boxes, normalized text.

Every parser returns None on text it cannot read (never raises on model output) and
works in time linear in the input.
"""

from __future__ import annotations

import json
import math
import re
import unicodedata
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
    r"(?<![\w.])([-+−]?)(\d{1,3}(?:,\d{3})+|\d+)(\.\d+)?(?:[eE]([-+]?\d{1,4}))?(?:\s*/\s*(\d+))?\s*(%)?"
    r"|(?<![\w.])([-+−]?)\.(\d+)"
)
MAX_NUMBER_TEXT = 5_000


def parse_number(text: str) -> float | None:
    """The last number in ``text`` ("1,234.5", "45%", "3.2e5", "3/4", "-2", "seven"),
    or None when there is none or it is not finite. Percent signs are dropped: "45%"
    reads as 45."""
    if text is None:
        return None
    text = str(text)[-MAX_NUMBER_TEXT:].strip()
    matches = list(NUMBER.finditer(text))
    if not matches:
        word = text.lower().strip(" .!")
        return float(NUMBER_WORDS[word]) if word in NUMBER_WORDS else None
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
    value *= sign
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


# ------------------------------------------------------------------------ time spans

CLOCK = re.compile(r"(?<![\d:])(?:(\d{1,2}):)?(\d{1,2}):(\d{2}(?:\.\d+)?)(?![\d:])")
SECONDS = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?)(?![\w.])")


def _seconds_values(text: str) -> list[float]:
    """Times in order of appearance: hh:mm:ss / mm:ss clocks, then plain numbers."""
    values: list[tuple[int, float]] = []
    taken = []
    for m in CLOCK.finditer(text):
        hours = int(m.group(1) or 0)
        values.append((m.start(), hours * 3600 + int(m.group(2)) * 60 + float(m.group(3))))
        taken.append((m.start(), m.end()))
    for m in SECONDS.finditer(text):
        if not any(a <= m.start() < b for a, b in taken):
            values.append((m.start(), float(m.group(1))))
    return [v for _, v in sorted(values)]


def parse_span(value) -> tuple[float, float] | None:
    """A [start, end] time span in seconds from ``[s, e]``, ``{"time": [s, e]}``,
    "from s to e seconds", "s-e", "mm:ss to mm:ss"; None if unreadable or end < start."""
    if isinstance(value, str):
        text = value.strip()[:MAX_NUMBER_TEXT]
        if text[:1] in "[{":
            try:
                return parse_span(json.loads(text))
            except (json.JSONDecodeError, RecursionError):
                pass
        numbers = _seconds_values(text)
        span = numbers[:2] if len(numbers) >= 2 else None
    elif isinstance(value, dict):
        span = value.get("time") or value.get("span") or value.get("timestamps")
        return parse_span(span) if span is not None else None
    elif isinstance(value, (list, tuple)) and len(value) == 2:
        span = value
    else:
        return None
    try:
        start, end = float(span[0]), float(span[1])
    except (TypeError, ValueError, IndexError):
        return None
    if not (math.isfinite(start) and math.isfinite(end)) or end < start or start < 0:
        return None
    return start, end


def interval_iou(a: tuple[float, float], b: tuple[float, float]) -> float:
    """IoU of two [start, end] intervals; two identical points score 1."""
    inter = max(0.0, min(a[1], b[1]) - max(a[0], b[0]))
    union = max(a[1], b[1]) - min(a[0], b[0])
    if union <= 0:
        return 1.0 if a == b else 0.0
    return inter / union


# ----------------------------------------------------------------------------- boxes

BOX_NUMBERS = re.compile(r"[-+]?\d+(?:\.\d+)?")


def parse_box(value) -> tuple[float, float, float, float] | None:
    """An [x1, y1, x2, y2] box from a list, a dict with ``bbox``/``bbox_2d``/``box``, or
    text holding four numbers; None when unreadable or degenerate (x2 < x1 or y2 < y1)."""
    if isinstance(value, str):
        text = value.strip()[:MAX_NUMBER_TEXT]
        if text[:1] in "[{":
            try:
                return parse_box(json.loads(text))
            except (json.JSONDecodeError, RecursionError):
                pass
        numbers = BOX_NUMBERS.findall(text)
        value = numbers[:4] if len(numbers) >= 4 else None
    if isinstance(value, dict):
        for key in ("bbox_2d", "bbox", "box"):
            if key in value:
                return parse_box(value[key])
        return None
    if isinstance(value, (list, tuple)) and len(value) == 1 and isinstance(value[0], (list, tuple, dict)):
        return parse_box(value[0])
    if not isinstance(value, (list, tuple)) or len(value) != 4:
        return None
    try:
        x1, y1, x2, y2 = (float(v) for v in value)
    except (TypeError, ValueError):
        return None
    if not all(math.isfinite(v) for v in (x1, y1, x2, y2)) or x2 < x1 or y2 < y1:
        return None
    return x1, y1, x2, y2


def box_iou(a: tuple[float, float, float, float], b: tuple[float, float, float, float]) -> float:
    """IoU of two boxes in continuous coordinates (area = width x height, no +1)."""
    iw = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    ih = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = iw * ih
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    if union <= 0:
        return 1.0 if a == b else 0.0
    return inter / union
