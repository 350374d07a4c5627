"""Dataset rows from JSONL or Parquet, checked against the row schema (docs/guides/data.md, "The
row format").

A bad row never stops a read: it becomes a ``RowFailure`` naming the file, the row
(line number for JSONL, index for Parquet) and the reason, and the rest are kept.
A key that looks like a misspelt schema key (``video`` for ``videos``, ``question``
for ``problem``) is warned about once per file with the key it probably means; under
``strict`` such rows are failures. ``columns`` renames a dataset's own keys to the
schema's (``{"question": "problem", "video": "videos"}``) before the checks.
"""

from __future__ import annotations

import difflib
import json
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from omni_rl.errors import OmniRLError, RowFailure

log = logging.getLogger(__name__)

MEDIA_FIELDS = ("images", "videos", "audios")
PLACEHOLDER = re.compile(r"<(image|video|audio)>")
"""A medium's place in a problem's text: each stands for the row's next medium of its kind."""
SCHEMA_KEYS = ("id", "problem", "problem_type", "answer", "options", *MEDIA_FIELDS, "data_source", "use_audio_in_video")
# keys other datasets use for a schema key (matched case-insensitively)
LIKELY = {
    "video": "videos",
    "image": "images",
    "audio": "audios",
    "question": "problem",
    "prompt": "problem",
    "query": "problem",
    "type": "problem_type",
    "choices": "options",
    "candidates": "options",
    "label": "answer",
    "ground_truth": "answer",
    "gt": "answer",
}


def meant_key(key: str) -> str | None:
    """The schema key an unknown ``key`` probably means (``video`` -> ``videos``,
    ``Videos`` -> ``videos``, ``question`` -> ``problem``), or None."""
    lower = key.lower()
    if lower in SCHEMA_KEYS and key != lower:
        return lower
    if lower in LIKELY:
        return LIKELY[lower]
    if len(lower) <= 3:  # "ids", "src": too short to guess from
        return None
    close = difflib.get_close_matches(lower, SCHEMA_KEYS, n=1, cutoff=0.85)
    return close[0] if close else None


@dataclass(frozen=True)
class Row:
    """One dataset row; ``fields`` holds every key of the source row, unknown ones included."""

    id: str
    problem: str
    problem_type: str
    answer: object
    images: tuple[str, ...] = ()
    videos: tuple[str, ...] = ()
    audios: tuple[str, ...] = ()
    source: str = ""
    """``file:line`` (JSONL) or ``file:index`` (Parquet) where the row was read."""
    fields: dict = field(default_factory=dict, compare=False, repr=False)


def read_failures(path: str | Path) -> list[RowFailure]:
    """The failures a preprocess run recorded in ``path`` (a cache's
    ``failures.jsonl``); none when there is no such file. A line that is not a
    failure record is left out, and said once."""
    path = Path(path)
    if not path.is_file():
        return []
    failures, unreadable = [], 0
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
            failures.append(RowFailure(record["id"], str(record["path"]), str(record["reason"])))
        except (json.JSONDecodeError, TypeError, KeyError):
            unreadable += line.strip() != ""
    if unreadable:
        log.warning("%s: %d lines are not failure records {id, path, reason}; left out", path, unreadable)
    return failures


def _missing(raw: dict, key: str, what: str) -> str:
    """Why ``key`` is unusable, naming a key of the row that probably meant it."""
    stand_ins = [k for k in raw if k not in SCHEMA_KEYS and meant_key(k) == key]
    if not stand_ins:
        return f"'{key}' {what}"
    other = stand_ins[0]
    return f"'{key}' {what} (the row has '{other}': rename it or map it with data.columns: {{{other}: {key}}})"


def placeholder_excess(problem: str, media: dict) -> str | None:
    """Why ``problem`` holds more ``<image>``/``<video>``/``<audio>`` placeholders of a
    kind than ``media`` (``{"videos": [...], ...}``) has, or None."""
    placed = PLACEHOLDER.findall(problem)
    for kind in ("image", "video", "audio"):
        have = len(media.get(f"{kind}s", ()))
        if placed.count(kind) > have:
            return (
                f"the problem has {placed.count(kind)} <{kind}> placeholder(s) and the row {have} {kind}(s): "
                "each places one of them"
            )
    return None


def check_row(raw: object) -> Row | str:
    """A Row from a decoded record, or the reason it is invalid."""
    if not isinstance(raw, dict):
        return f"expected a JSON object, got {type(raw).__name__}"
    for key in ("id", "problem", "problem_type"):
        if not isinstance(raw.get(key), str) or not raw.get(key):
            return _missing(raw, key, "must be a non-empty string")
    if raw.get("answer") is None:
        return _missing(raw, "answer", "is missing")
    options = raw.get("options")
    listed = isinstance(options, list) and all(isinstance(o, (str, int, float)) for o in options)
    if options is not None and not listed:
        return f"'options' must be a list of the options' texts, got {options!r:.80}"
    media = {}
    for key in MEDIA_FIELDS:
        given = raw.get(key)
        value = [] if given is None else [given] if isinstance(given, str) and given else given
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) and v for v in value):
            return f"'{key}' must be a list of paths, got {given!r:.80}"
        media[key] = tuple(value)
    heard = raw.get("use_audio_in_video")
    if heard is not None and not isinstance(heard, bool):
        return f"'use_audio_in_video' must be true or false, got {heard!r:.80}"
    excess = placeholder_excess(raw["problem"], media)
    if excess:
        return excess
    return Row(
        id=raw["id"],
        problem=raw["problem"],
        problem_type=raw["problem_type"],
        answer=raw["answer"],
        **media,
        fields=dict(raw),
    )


def _records(path: Path) -> Iterator[tuple[str, object | str]]:
    """(where, record or decode-error string) for every row of a file."""
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise OmniRLError(f"{path}: reading Parquet needs pyarrow (pip install pyarrow)") from None
        try:
            table = pq.read_table(path)
        except Exception as err:  # noqa: BLE001 - pyarrow raises many error types for bad files
            raise OmniRLError(f"{path}: unreadable Parquet file ({err})") from None
        for index, record in enumerate(table.to_pylist()):
            yield f"{path}:{index}", record
        return
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            where = f"{path}:{number}"
            try:
                yield where, json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as err:
                yield where, f"line is not valid UTF-8 ({err.reason} at byte {err.start})"
            except json.JSONDecodeError as err:
                yield where, f"invalid JSON ({err.msg} at {_json_place(err)})"


def _json_place(err: json.JSONDecodeError) -> str:
    """Where in its line a JSON error is: "column N", or "the end of the line" for a line
    cut short (the decoder then stands past its last character, or on the next line)."""
    line_end = err.doc.rstrip("\r\n \t")
    return "the end of the line" if err.pos >= len(line_end) else f"column {err.colno}"


def rename_columns(record: dict, columns: dict[str, str]) -> dict | str:
    """``record`` with its keys renamed by ``columns``, or why it cannot be."""
    renamed = {}
    for key, value in record.items():
        name = columns.get(key, key)
        if name in renamed:
            return f"two keys become '{name}' under data.columns ({key} and another)"
        renamed[name] = value
    return renamed


def read_rows(
    path: str | Path, columns: dict[str, str] | None = None, strict: bool = False
) -> tuple[list[Row], list[RowFailure]]:
    """Every valid row of a JSONL or Parquet file, and a failure for every other one.

    Duplicate ids: the first row keeps the id, later ones are failures. Keys that look
    like misspelt schema keys are logged once per key (failures under ``strict``).
    """
    path = Path(path)
    if not path.is_file():
        raise OmniRLError(f"{path}: no such dataset file")
    rows, failures, seen = [], [], {}
    suspect: dict[str, list[str]] = {}  # unknown key -> where it was seen
    for where, record in _records(path):
        if isinstance(record, dict) and columns:
            record = rename_columns(record, columns)
        if isinstance(record, str):
            failures.append(RowFailure(None, where, record))
            continue
        if isinstance(record, dict):
            odd = {k: meant for k in record if k not in SCHEMA_KEYS and (meant := meant_key(k))}
            for key in odd:
                suspect.setdefault(key, []).append(where)
            if odd and strict:
                key, meant = next(iter(odd.items()))
                failures.append(RowFailure(record.get("id"), where, f"unknown key '{key}' (did you mean '{meant}'?)"))
                continue
        row = check_row(record)
        row_id = record.get("id") if isinstance(record, dict) and isinstance(record.get("id"), str) else None
        if isinstance(row, str):
            failures.append(RowFailure(row_id, where, row))
        elif row.id in seen:
            failures.append(RowFailure(row.id, where, f"duplicate id (first at {seen[row.id]})"))
        else:
            seen[row.id] = where
            rows.append(Row(**{**row.__dict__, "source": where}))
    for key, places in suspect.items():
        log.warning(
            "%s: unknown key '%s' (did you mean '%s'?) in %d rows; its values are not used. Rename it, or map it "
            "with data.columns: {%s: %s}%s",
            places[0],
            key,
            meant_key(key),
            len(places),
            key,
            meant_key(key),
            " (--strict: those rows are refused)" if strict else "",
        )
    return rows, failures


def resolve_media_path(path: str, data_root: Path, media_root: Path | None = None) -> Path:
    """The file a row's media path names.

    Relative paths are relative to the dataset's directory and may not climb out of
    it; absolute paths are accepted only under ``media_root``.
    """
    candidate = Path(path)
    if candidate.is_absolute():
        if media_root is None:
            raise OmniRLError(f"absolute media path {path} needs a configured media_root")
        base = media_root.resolve()
    else:
        base = data_root.resolve()
        candidate = base / candidate
    resolved = candidate.resolve()
    if not resolved.is_relative_to(base):
        raise OmniRLError(f"media path {path} escapes {base}")
    return resolved
