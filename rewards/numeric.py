"""Numeric problems: numerical (tolerances), regression (mean relative accuracy), counting."""

from __future__ import annotations

import math
from decimal import ROUND_HALF_UP, Context, Decimal

from omni_rl.rewards.base import Target, register
from omni_rl.rewards.parsing import numbers_in, parse_integer, parse_number

# 0.50, 0.55, ..., 0.95 as exact decimals: the comparison below is strict, and binary
# floats would put 7 vs 10 (error 0.3) on the wrong side of 1 - 0.70.
MRA_THRESHOLDS = tuple(Decimal(50 + 5 * i) / 100 for i in range(10))


def _gold_number(target: Target) -> float:
    answer = target.answer
    value = float(answer) if isinstance(answer, (int, float)) and not isinstance(answer, bool) else None
    if value is None:
        value = parse_number(str(answer))
    if value is None or not math.isfinite(value):
        raise ValueError(f"answer {answer!r} is not a finite number")
    return value


def _validate_number(target: Target) -> None:
    _gold_number(target)
    if isinstance(target.answer, str) and (count := numbers_in(target.answer)) > 1:
        raise ValueError(
            f"answer {target.answer!r} holds {count} numbers; the gold is one number (with its unit, power of ten "
            "or scale word), and a score reads the last"
        )


# digits enough for any finite float at any rounding numbers_match asks for (1e308 to
# 2 decimals, 5e-324 to its 2 significant digits)
EXACT = Context(prec=800, rounding=ROUND_HALF_UP)


def rounded(value: float, decimals: int) -> Decimal:
    """``value`` as the decimal it is written as, rounded half up (2.675 -> 2.68, where
    binary rounding gives 2.67)."""
    return Decimal(repr(value)).quantize(Decimal(1).scaleb(-decimals), context=EXACT)


def numbers_match(predicted: float, gold: float, rel_tol: float | None, abs_tol: float | None) -> bool:
    """Equal within the tolerances, or (with none given) equal after rounding to 2
    decimals, or to the gold's 2 significant digits where that is finer (a gold under
    0.1: 6.67e-11 is not matched by 9e-11, as both would be 0.00)."""
    if rel_tol is None and abs_tol is None:
        decimals = 2 if gold == 0 else max(2, 1 - math.floor(math.log10(abs(gold))))
        return rounded(predicted, decimals) == rounded(gold, decimals)
    return math.isclose(predicted, gold, rel_tol=rel_tol or 0.0, abs_tol=abs_tol or 0.0)


@register(
    "numerical", aliases=("numeric", "number"), fits=lambda p, _: parse_number(p) is not None, validate=_validate_number
)
def numerical(prediction: str, target: Target) -> tuple[float, dict]:
    """Row fields ``rel_tol`` / ``abs_tol`` set the tolerance."""
    predicted = parse_number(prediction)
    gold = _gold_number(target)
    if predicted is None:
        return 0.0, {"predicted": None}
    ok = numbers_match(predicted, gold, target.fields.get("rel_tol"), target.fields.get("abs_tol"))
    return float(ok), {"predicted": predicted, "gold": gold}


def mean_relative_accuracy(predicted: float, gold: float) -> float:
    """Mean relative accuracy as the VSI-Bench paper writes it and Video-R1's evaluation
    computes it: the fraction of thresholds t in 0.50..0.95 with relative error
    |pred - gold| / |gold| < 1 - t. A zero gold needs an exact prediction. VSI-Bench's
    code (and ``--benchmark vsibench``, omni_rl.benchmarks.vsibench) also counts an
    error equal to 1 - t: 3 for 4 scores 0.5 here, 0.6 there. (Video-R1's training
    reward is 1 - min(1, relative error): 0.75 for 3 against 4.)"""
    if gold == 0:
        return float(predicted == 0)
    # numbers are compared as the decimals they were written as (2.7 vs 3 is 0.1 off)
    p, g = Decimal(repr(predicted)), Decimal(repr(gold))
    error = abs(p - g) / abs(g)
    return sum(error < 1 - t for t in MRA_THRESHOLDS) / len(MRA_THRESHOLDS)


@register("regression", aliases=("mra",), fits=lambda p, _: parse_number(p) is not None, validate=_validate_number)
def regression(prediction: str, target: Target) -> tuple[float, dict]:
    predicted = parse_number(prediction)
    if predicted is None:
        return 0.0, {"predicted": None}
    return mean_relative_accuracy(predicted, _gold_number(target)), {"predicted": predicted}


def _validate_count(target: Target) -> None:
    value = _gold_number(target)
    if value != int(value):
        raise ValueError(f"counting answer {target.answer!r} is not an integer")


@register("counting", aliases=("count",), fits=lambda p, _: parse_integer(p) is not None, validate=_validate_count)
def counting(prediction: str, target: Target) -> tuple[float, dict]:
    """Exact integer match; a row field ``tolerance`` accepts counts that far off."""
    predicted = parse_integer(prediction)
    if predicted is None:
        return 0.0, {"predicted": None}
    tolerance = target.fields.get("tolerance") or 0
    return float(abs(predicted - int(_gold_number(target))) <= tolerance), {"predicted": predicted}
