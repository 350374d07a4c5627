"""Grounding in time and space: temporal, spatial, spatio-temporal, tracking.

Boxes are [x1, y1, x2, y2] in continuous coordinates (area = width x height, no +1).
A row declares the coordinate space of its gold boxes in ``box_space`` and of the
model's answers in ``prediction_space`` (default: the same): ``pixel`` (the original
image), ``resized`` (the image the model saw, as preprocessing resized it), ``norm1``
(0-1) or ``norm1000`` (0-1000, Qwen2-VL and Qwen3-VL). Different spaces are converted
through ``image_size`` and ``resized_size`` ([height, width]) recorded by
preprocessing; IoU is unchanged by scaling both boxes alike, so equal spaces need none.
"""

from __future__ import annotations

import math

from omni_rl.rewards.base import Target, register
from omni_rl.rewards.parsing import box_iou, interval_iou, load_json, parse_box, parse_span, parse_time

SPACES = ("pixel", "resized", "norm1", "norm1000")
MAX_JSON_CHARS = 100_000


# ------------------------------------------------------------------------- temporal


def _gold_span(target: Target) -> tuple[float, float]:
    span = parse_span(target.answer)
    if span is None:
        raise ValueError(f"temporal answer {target.answer!r} is not a [start, end] span")
    return span


def _validate_temporal(target: Target) -> None:
    _gold_span(target)


@register(
    "temporal_grounding",
    aliases=("temporal", "tvg", "moment_retrieval"),
    fits=lambda p, _: parse_span(p) is not None,
    validate=_validate_temporal,
)
def temporal_grounding(prediction: str, target: Target) -> tuple[float, dict]:
    span = parse_span(prediction)
    if span is None:
        return 0.0, {"predicted": None}
    return interval_iou(span, _gold_span(target)), {"predicted": list(span)}


# -------------------------------------------------------------------------- spatial


def _scale(space: str, fields: dict) -> tuple[float, float]:
    """(width, height) that divide a box in ``space`` into 0-1 coordinates."""
    if space == "norm1":
        return 1.0, 1.0
    if space == "norm1000":
        return 1000.0, 1000.0
    key = "image_size" if space == "pixel" else "resized_size"
    size = fields.get(key)
    if not (isinstance(size, (list, tuple)) and len(size) == 2 and all(isinstance(v, (int, float)) for v in size)):
        raise ValueError(f"converting boxes from '{space}' coordinates needs the row field {key} = [height, width]")
    height, width = float(size[0]), float(size[1])
    if width <= 0 or height <= 0:
        raise ValueError(f"{key} {size} is not a positive size")
    return width, height


def _spaces(fields: dict) -> tuple[str, str]:
    gold = fields.get("box_space", "pixel")
    predicted = fields.get("prediction_space", gold)
    for name, space in (("box_space", gold), ("prediction_space", predicted)):
        if space not in SPACES:
            raise ValueError(f"{name} '{space}' is not one of {', '.join(SPACES)}")
    return gold, predicted


def iou_in_spaces(predicted, gold, fields: dict) -> float:
    """IoU of a predicted and a gold box, each in its declared space."""
    gold_space, predicted_space = _spaces(fields)
    if gold_space != predicted_space:
        gw, gh = _scale(gold_space, fields)
        pw, ph = _scale(predicted_space, fields)
        gold = (gold[0] / gw, gold[1] / gh, gold[2] / gw, gold[3] / gh)
        predicted = (predicted[0] / pw, predicted[1] / ph, predicted[2] / pw, predicted[3] / ph)
    return box_iou(predicted, gold)


def _validate_spatial(target: Target) -> None:
    if parse_box(target.answer) is None:
        raise ValueError(f"spatial answer {target.answer!r} is not an [x1, y1, x2, y2] box")
    gold_space, predicted_space = _spaces(target.fields)
    # a row with an image gets image_size and resized_size from preprocessing when it loads
    if gold_space != predicted_space and not target.fields.get("images"):
        _scale(gold_space, target.fields)
        _scale(predicted_space, target.fields)


@register(
    "spatial_grounding",
    aliases=("grounding", "rec", "bbox"),
    fits=lambda p, _: parse_box(p) is not None,
    validate=_validate_spatial,
)
def spatial_grounding(prediction: str, target: Target) -> tuple[float, dict]:
    box = parse_box(prediction)
    if box is None:
        return 0.0, {"predicted": None}
    return iou_in_spaces(box, parse_box(target.answer), target.fields), {"predicted": list(box)}


# ------------------------------------------------------------ boxes over time, tracking


def _load(value):
    """A JSON answer as a value (code fence allowed); a non-string is already one."""
    return load_json(value, MAX_JSON_CHARS) if isinstance(value, str) else value


def parse_track(value) -> dict[float, tuple] | None:
    """Boxes by timestamp from ``{"boxes": {"1.0": box, ...}}``, ``{"1.0": box}`` or
    ``[{"time": 1.0, "box": box}, ...]`` (``timestamp`` or ``t`` for ``time``); a box in
    any shape parse_box reads, a timestamp in any parse_time reads, rounded to 0.01 s.
    A timestamp whose box is unreadable or ambiguous is left out."""
    value = _load(value)
    if isinstance(value, dict) and "boxes" in value:
        value = value["boxes"]
    items = []
    if isinstance(value, dict):
        items = list(value.items())
    elif isinstance(value, list):
        for entry in value:
            if isinstance(entry, dict):
                t = next((entry[k] for k in ("time", "timestamp", "t") if k in entry), None)
                items.append((t, entry))  # parse_box finds the entry's box key, or its one box
    track = {}
    for t, box in items:
        seconds = parse_time(t)
        parsed = parse_box(box)
        if parsed is not None and seconds is not None and math.isfinite(seconds):
            track[round(seconds, 2)] = parsed
    return track or None


def mean_track_iou(predicted: dict | None, gold: dict, fields: dict) -> float:
    """Mean box IoU over the gold timestamps; a missing prediction counts 0."""
    predicted = predicted or {}
    return sum(iou_in_spaces(predicted[t], box, fields) if t in predicted else 0.0 for t, box in gold.items()) / len(
        gold
    )


def _gold_track(target: Target) -> dict:
    track = parse_track(target.answer)
    if track is None:
        raise ValueError(f"answer {str(target.answer)[:80]!r} holds no boxes by timestamp")
    return track


def _validate_tracking(target: Target) -> None:
    _gold_track(target)
    _spaces(target.fields)


@register(
    "tracking",
    aliases=("object_tracking",),
    fits=lambda p, _: parse_track(p) is not None,
    validate=_validate_tracking,
)
def tracking(prediction: str, target: Target) -> tuple[float, dict]:
    predicted = parse_track(prediction)
    return mean_track_iou(predicted, _gold_track(target), target.fields), {"boxes": len(predicted or {})}


def _validate_spatio_temporal(target: Target) -> None:
    gold = _load(target.answer)
    if not isinstance(gold, dict) or parse_span(gold) is None:
        raise ValueError("spatio_temporal_grounding answer needs 'time': [start, end] and 'boxes'")
    _gold_track(target)


@register(
    "spatio_temporal_grounding",
    aliases=("stvg", "spatio_temporal"),
    fits=lambda p, _: isinstance(_load(p), dict),
    validate=_validate_spatio_temporal,
)
def spatio_temporal_grounding(prediction: str, target: Target) -> tuple[float, dict]:
    """0.5 x tIoU + 0.5 x mean box IoU over the gold timestamps."""
    predicted = _load(prediction)
    gold = _load(target.answer)
    span = parse_span(predicted) if isinstance(predicted, dict) else None
    t_iou = interval_iou(span, parse_span(gold)) if span is not None else 0.0
    box_score = mean_track_iou(
        parse_track(predicted) if isinstance(predicted, dict) else None, _gold_track(target), target.fields
    )
    return 0.5 * t_iou + 0.5 * box_score, {"t_iou": t_iou, "box_iou": box_score}
