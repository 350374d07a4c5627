"""Converters from other datasets' files to omni_rl rows (the row schema of DESIGN.md).

A converter is ``fn(src) -> Conversion`` registered under a format name with
``@register_format("video-r1")``. It maps each source record to rows whose media paths
are relative to the source file's folder (or absolute); ``write_conversion`` moves them
relative to the output's folder and writes the rows, the failures and a summary.

Every row a converter offers goes through ``Conversion.add``, which applies the
loader's schema check and the reward scorer's answer check: what is written is exactly
what ``read_rows`` and ``check_targets`` accept, and the rest are failures naming the
source file, the record and the reason.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from omni_rl.benchmarks import BENCHMARKS
from omni_rl.errors import OmniRLError, RowFailure
from omni_rl.preprocess.rows import MEDIA_FIELDS, check_row, placeholder_excess
from omni_rl.registry import Registry

PROGRESS_MIN_ROWS = 10_000
"""``convert`` shows a progress bar from this many rows on."""


@dataclass
class Conversion:
    """What a converter made of a source file.

    ``counts`` is {source problem type: {our problem type: rows}} over written rows;
    ``records`` counts source records (a conversation record may give several rows).
    """

    rows: list[dict] = field(default_factory=list)
    failures: list[RowFailure] = field(default_factory=list)
    counts: dict[str, dict[str, int]] = field(default_factory=dict)
    records: int = 0
    format: str = ""
    _seen: dict[str, str] = field(default_factory=dict, repr=False)

    def add(self, row: dict, where: str, source_type: str) -> None:
        """Keep ``row`` (read at ``where``), or record why it cannot be used: a duplicate
        id, a schema error, or an answer its problem type's scorer cannot read."""
        from omni_rl.rewards import check_targets

        row_id = row.get("id") if isinstance(row.get("id"), str) else None
        if row_id in self._seen:
            return self.fail(row_id, where, f"duplicate id (first at {self._seen[row_id]})")
        checked = check_row(row)
        if isinstance(checked, str):
            return self.fail(row_id, where, checked)
        try:
            problems = check_targets([checked])
        except OmniRLError as err:  # an unknown problem type: a converter's mapping is wrong
            return self.fail(row_id, where, str(err))
        if problems:
            return self.fail(row_id, where, f"{row['problem_type']} answer: {problems[0].reason}")
        self._seen[checked.id] = where
        self.rows.append(row)
        by_type = self.counts.setdefault(source_type, {})
        by_type[row["problem_type"]] = by_type.get(row["problem_type"], 0) + 1

    def fail(self, row_id: str | None, where: str, reason: str) -> None:
        self.failures.append(RowFailure(row_id, where, reason))


FORMATS: Registry[Callable[[Path], Conversion]] = Registry("data format")


def register_format(name: str, aliases: tuple[str, ...] = ()) -> Callable:
    """Register the decorated ``fn(src: Path) -> Conversion`` as format ``name``."""
    return FORMATS.register(name, aliases)


# ---------------------------------------------------------------------------------------
# Reading source files


def _load_records(src: Path) -> Iterable[tuple[str, object]]:
    """(where, record) for a JSON list ("file:index") or a JSONL file ("file:line");
    an undecodable JSONL line is yielded as an ``OmniRLError`` in place of its record."""
    if not src.is_file():
        raise OmniRLError(f"{src}: no such file")
    if src.suffix == ".jsonl":
        return list(_jsonl_records(src))
    try:
        data = json.loads(src.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise OmniRLError(f"{src}: not a JSON file ({err}); JSONL files need the .jsonl suffix") from None
    if not isinstance(data, list):
        raise OmniRLError(f"{src}: expected a JSON list of records, got {type(data).__name__}")
    return [(f"{src}:{index}", record) for index, record in enumerate(data)]


def _jsonl_records(src: Path) -> Iterable[tuple[str, object]]:
    with open(src, "rb") as f:
        for number, line in enumerate(f, start=1):
            if line.strip():
                try:
                    yield f"{src}:{number}", json.loads(line.decode("utf-8"))
                except (UnicodeDecodeError, json.JSONDecodeError) as err:
                    yield f"{src}:{number}", OmniRLError(f"invalid JSON line ({err})")


# "A. text", "A) text", "A: text", "(A) text"
LABEL = re.compile(r"\s*(?:\(([A-J])\)|([A-J])\s*[.):：])\s*(\S.*?)\s*", re.DOTALL)


def _label(text: str) -> tuple[str, str] | None:
    """(letter, text) of a labelled option such as "B. a dog", or None."""
    m = LABEL.fullmatch(text)
    return (m.group(1) or m.group(2), m.group(3)) if m else None


def _option_texts(options: list) -> list[str] | str:
    """Options without their "A." labels (the prompt template adds its own), or the reason
    they are unusable. Unlabelled options are kept as they are."""
    if not all(isinstance(o, str) and o.strip() for o in options):
        return "'options' must be a list of non-empty strings"
    labels = [_label(o) for o in options]
    if not any(labels):
        return [o.strip() for o in options]
    if [label[0] if label else None for label in labels] != [chr(65 + i) for i in range(len(options))]:
        return f"options are not labelled A, B, C... in order: {options}"
    return [text for _, text in labels]


def _kept_fields(record: dict, consumed: tuple[str, ...]) -> dict:
    """The record's fields other than those a converter turned into schema fields."""
    return {key: value for key, value in record.items() if key not in consumed}


# ---------------------------------------------------------------------------------------
# Video-R1 (Video-R1-260k.json, Video-R1-COT-165k.json)

VIDEO_R1_TYPES = {
    "multiple choice": "multiple_choice",
    "numerical": "numerical",
    "OCR": "ocr",
    "free-form": "open_ended",
    "regression": "regression",
}
VIDEO_R1_MEDIA = {"video": "videos", "image": "images"}
ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


@register_format("video-r1")
def video_r1(src: Path) -> Conversion:
    """Video-R1's training JSON: a list of records with ``problem_id``, ``problem``,
    ``data_type`` (video|image), ``problem_type``, ``options`` ("A. text"), ``solution``
    ("<answer>A</answer>"), ``path`` (relative to the JSON's folder) and ``data_source``;
    the COT file adds ``process``. Fields other than ``path`` are kept; the source's
    problem type is kept as ``source_problem_type``."""
    conversion = Conversion()
    for index, (where, record) in enumerate(_load_records(Path(src))):
        conversion.records += 1
        row = _video_r1_row(record, index)
        if isinstance(row, str):
            problem_id = record.get("problem_id") if isinstance(record, dict) else None
            conversion.fail(None if problem_id is None else f"video-r1-{problem_id}", where, row)
        else:
            conversion.add(row, where, record["problem_type"])
    return conversion


def _video_r1_row(record: object, index: int) -> dict | str:
    """Our row for one Video-R1 record, or the reason it cannot be mapped."""
    if isinstance(record, Exception):
        return str(record)
    if not isinstance(record, dict):
        return f"expected a JSON object, got {type(record).__name__}"
    source_type = record.get("problem_type")
    if source_type not in VIDEO_R1_TYPES:
        return f"unknown problem_type {source_type!r} (known: {', '.join(VIDEO_R1_TYPES)})"
    m = ANSWER_TAG.search(str(record.get("solution") or ""))
    if m is None:
        return f"no <answer>...</answer> in solution {str(record.get('solution'))[:80]!r}"
    if record.get("data_type") not in VIDEO_R1_MEDIA:
        return f"data_type {record.get('data_type')!r} is neither 'video' nor 'image'"
    path = record.get("path")
    if not isinstance(path, str) or not path.strip():
        return "missing 'path'"
    problem_id = record.get("problem_id")
    row = {
        **_kept_fields(record, ("path", "problem_type", "options")),
        "id": f"video-r1-{index if problem_id is None else problem_id}",
        "problem_type": VIDEO_R1_TYPES[source_type],
        "answer": m.group(1).strip(),
        VIDEO_R1_MEDIA[record["data_type"]]: [path],
        "source_problem_type": source_type,
    }
    options = record.get("options") or []
    if row["problem_type"] == "multiple_choice":
        if not isinstance(options, list) or not options:
            return "multiple choice without options"
        texts = _option_texts(options)
        if isinstance(texts, str):
            return texts
        row["options"] = texts
    return row


# ---------------------------------------------------------------------------------------
# LLaVA-Video-178K-style conversations

HUMAN = ("human", "user")
GPT = ("gpt", "assistant")
MEDIA_TOKEN = re.compile(r"^\s*(?:<image>|<video>)\s*")  # a leading one: the media go first anyway
OPTIONS_HEADER = re.compile(r"\s*(?:options|choices)\s*:?\s*", re.IGNORECASE)
# "B", "B.", "(B)", "B. text", "(B) text"; not "B text" or a word that starts with a capital
# "Answer: B", "The answer is B", "The correct answer is (B) text": the phrase before the letter
ANSWER_PHRASE = re.compile(r"^\s*(?:the\s+)?(?:correct\s+)?answer(?:\s+is)?\s*[:：]?\s*", re.IGNORECASE)
# "A. left B. right" on one line: options the block reader does not take apart
INLINE_OPTIONS = re.compile(r"(?:^|\s)\(?A[.)]\s+\S.*\s\(?B[.)]\s+\S")
ANSWER_LETTER = re.compile(r"\s*(?:\(([A-J])\)\s*(?:[.:：]\s*)?(.*?)|([A-J])\s*(?:[.):：]\s*(.*?))?)\s*", re.DOTALL)


@register_format("llava-video")
def llava_video(src: Path) -> Conversion:
    """LLaVA-Video-178K-style conversations (a JSON list, or JSONL): records with ``id``,
    ``video`` or ``image`` (relative to the file's folder), ``conversations`` of
    human/gpt turns and ``data_source``. One row per human->gpt pair, id "<id>-<k>"
    (k from 0); the record's other fields are kept."""
    conversion = Conversion()
    for index, (where, record) in enumerate(_load_records(Path(src))):
        conversion.records += 1
        if isinstance(record, Exception):
            conversion.fail(None, where, str(record))
            continue
        if not isinstance(record, dict):
            conversion.fail(None, where, f"expected a JSON object, got {type(record).__name__}")
            continue
        record_id = str(record["id"]) if record.get("id") not in (None, "") else str(index)
        media = _llava_media(record)
        turns = record.get("conversations")
        if isinstance(media, str) or not isinstance(turns, list) or not turns:
            reason = media if isinstance(media, str) else "no 'conversations' list"
            conversion.fail(record_id, where, reason)
            continue
        kept = _kept_fields(record, ("id", "video", "image", "conversations"))
        pairs = _pairs(turns)
        if not pairs:
            speakers = ", ".join(repr(t.get("from")) if isinstance(t, dict) else type(t).__name__ for t in turns[:4])
            conversion.fail(record_id, where, f"no turn from 'human' or 'user' (the turns' 'from': {speakers})")
            continue
        for k, (question, answer) in enumerate(pairs):
            row_id = f"{record_id}-{k}"
            if answer is None:
                conversion.fail(row_id, where, f"turn {k}: no gpt reply")
            elif not isinstance(answer, str) or not answer.strip():
                conversion.fail(row_id, where, f"turn {k}: empty answer")
            elif not isinstance(question, str) or not question.strip():
                conversion.fail(row_id, where, f"turn {k}: empty question")
            else:
                question = _media_tokens(question, media)
                row = placeholder_excess(question, media) or _llava_row(question, answer.strip())
                if isinstance(row, str):
                    conversion.fail(row_id, where, f"turn {k}: {row}")
                else:
                    conversion.add({**kept, "id": row_id, **row, **media}, where, "conversation")
    return conversion


def _llava_media(record: dict) -> dict[str, list[str]] | str:
    """{"videos": [...], "images": [...]} of a record (either left out where it has
    none: a text-only record, or an empty list), or why its paths cannot be read."""
    media = {}
    for key, ours in (("video", "videos"), ("image", "images")):
        value = record.get(key)
        paths = [value] if isinstance(value, str) else value if isinstance(value, list) else None
        if value is not None and (paths is None or not all(isinstance(p, str) and p.strip() for p in paths)):
            return f"'{key}' must be a path or a list of paths"
        if paths:
            media[ours] = paths
    return media


def _media_tokens(question: str, media: dict) -> str:
    """LLaVA writes ``<image>`` for a video too: in a record of videos alone each is a
    ``<video>``, the placeholder of the record's next video."""
    return question.replace("<image>", "<video>") if "videos" in media and "images" not in media else question


def _speaker(turn: object) -> str | None:
    """A turn's ``from``, lower-cased ("Human" is "human")."""
    return str(turn.get("from")).lower() if isinstance(turn, dict) else None


def _pairs(turns: list) -> list[tuple[object, object | None]]:
    """(question, answer) for each human turn; the answer is None when no gpt turn follows."""
    pairs = []
    for i, turn in enumerate(turns):
        if _speaker(turn) in HUMAN:
            after = turns[i + 1] if i + 1 < len(turns) else None
            reply = after.get("value") if _speaker(after) in GPT else None
            pairs.append((turn.get("value"), reply))
    return pairs


def _llava_row(question: str, answer: str) -> dict | str:
    """The problem, type, answer (and options) of one turn, or why it cannot be mapped.

    Multiple choice: the question holds an "A. ..."/"(A) ..." block, one option to a
    line (blank lines between them allowed), and the answer is a letter ("E", "E.",
    "E. text", after "Answer:" or "The answer is"); the block leaves the question (the
    prompt template renders the options). A letter answer to options written on one
    line is refused. Anything else is open_ended, its question as written."""
    from omni_rl.rewards.parsing import normalize_text

    question = MEDIA_TOKEN.sub("", question, count=1).strip()
    lines = question.split("\n")
    filled = [i for i, line in enumerate(lines) if line.strip()]  # blank lines may part the options
    labels = [_label(lines[i]) for i in filled]
    first = next((k for k, label in enumerate(labels) if label and label[0] == "A"), None)
    chosen = ANSWER_LETTER.fullmatch(ANSWER_PHRASE.sub("", answer, count=1))
    last = first
    while last is not None and last < len(labels) and labels[last] and labels[last][0] == chr(65 + last - first):
        last += 1
    if chosen is None or first is None or last - first < 2:
        if chosen is not None and INLINE_OPTIONS.search(question):
            return (
                f"answer {answer!r} is a letter, but the options are not one to a line (A. ..., B. ...): none was read"
            )
        return {"problem": question, "problem_type": "open_ended", "answer": answer}
    options = [text for _, text in labels[first:last]]
    letter, text = chosen.group(1) or chosen.group(3), chosen.group(2) or chosen.group(4)
    if ord(letter) - 65 >= len(options):
        return f"answer {answer!r} is beyond options A-{chr(64 + len(options))}"
    if text and normalize_text(text) != normalize_text(options[ord(letter) - 65]):
        return f"answer {answer!r} contradicts option {letter} {options[ord(letter) - 65]!r}"
    start, end = filled[first], filled[last - 1] + 1
    if first > 0 and OPTIONS_HEADER.fullmatch(lines[filled[first - 1]]):
        start = filled[first - 1]
    problem = "\n".join(lines[:start] + lines[end:]).strip()
    return {"problem": problem, "problem_type": "multiple_choice", "answer": letter, "options": options}


# ---------------------------------------------------------------------------------------
# Writing


def _benchmark_format(name: str) -> Callable[[Path], Conversion]:
    """A converter reading benchmark ``name``'s files as distributed (a directory), as
    ``omni-rl eval --benchmark`` reads them, into rows to train on (media paths absolute)."""

    def read(src: Path) -> Conversion:
        benchmark = BENCHMARKS.get(name)
        reading = benchmark.load(src.resolve(), benchmark.protocol)
        conversion = Conversion(failures=list(reading.failures))
        conversion.records = len(reading.rows) + len(reading.failures)
        for row in reading.rows:
            row = {k: v for k, v in row.items() if k != "benchmark_prompt"}  # the eval prompt; training has its own
            conversion.add(row, row["origin"], str(row.get("task") or name))
        return conversion

    return read


for _name in BENCHMARKS:
    if BENCHMARKS.get(_name).rows_of is None:  # a preset sharing another's rows converts as that one
        register_format(_name)(_benchmark_format(_name))


def failures_path(out: Path) -> Path:
    """Where ``write_conversion`` writes the failures of ``out`` (``x.jsonl`` -> ``x.failures.jsonl``)."""
    return out.with_suffix(".failures.jsonl")


def summary_path(out: Path) -> Path:
    """Where ``write_conversion`` writes the summary of ``out`` (``x.jsonl`` -> ``x.summary.json``)."""
    return out.with_suffix(".summary.json")


def _write_lines(path: Path, lines: Iterable[str]) -> None:
    """Stream ``lines`` into a temporary file beside ``path``, then rename it into place.
    (preprocess.cache's atomic_write_bytes takes one buffer and imports torch.)"""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            for line in lines:
                f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_conversion(conversion: Conversion, src_root: Path, out: Path, progress: bool = False) -> dict:
    """Write ``conversion``'s rows to ``out`` (JSONL), its failures to ``x.failures.jsonl``
    (removed when there are none) and ``x.summary.json`` last; return the summary.

    Media paths in the rows are relative to ``src_root`` or absolute. A file under
    ``out``'s folder is written relative to it; any other is written absolute, and the
    summary's ``media_root`` (``src_root`` when it holds them all, else their common
    folder) is what the config's ``media.media_root`` must be set to. Links are followed,
    as the loader does. ``read`` = ``written`` + ``failed`` counts rows (a conversation
    record may give several); ``records`` counts source records.
    """
    from tqdm import tqdm

    src_root, out = Path(src_root).resolve(), Path(out)
    if out.suffix == ".parquet":
        raise OmniRLError(f"{out}: converted rows are written as JSONL; name the output *.jsonl")
    out_dir = out.parent.resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    out_prefix = os.path.join(out_dir, "")
    folders: dict[str, str] = {}  # resolving each folder once keeps 10^5 rows fast (pathlib does not)
    outside: set[str] = set()
    missing: list[str] = []

    def relocate(path: str) -> str:
        folder, name = os.path.split(os.path.join(src_root, path))  # an absolute path stays itself
        if folder not in folders:
            folders[folder] = os.path.realpath(folder)
        resolved = os.path.join(folders[folder], name)
        if os.path.islink(resolved):  # the loader follows links: place the file they point to
            resolved = os.path.realpath(resolved)
        if not os.path.isfile(resolved):
            missing.append(resolved)
        if resolved.startswith(out_prefix):
            return resolved[len(out_prefix) :].replace(os.sep, "/")
        outside.add(os.path.dirname(resolved))
        return resolved

    def lines() -> Iterable[str]:
        rows = tqdm(conversion.rows, desc="write", unit="row", disable=not progress)
        for row in rows:
            moved = {key: [relocate(p) for p in row[key]] for key in MEDIA_FIELDS if row.get(key)}
            yield json.dumps({**row, **moved}, ensure_ascii=False)

    _write_lines(out, lines())
    failures_file = failures_path(out)
    if conversion.failures:
        _write_lines(failures_file, (f.to_json() for f in conversion.failures))
    else:
        failures_file.unlink(missing_ok=True)  # a stale file would describe another run
    media_root = None
    if outside:  # the source's root when it holds them all: the folder users know
        inside_src = all(Path(folder).is_relative_to(src_root) for folder in outside)
        media_root = str(src_root) if inside_src else os.path.commonpath(sorted(outside))
    problem_types: dict[str, int] = {}
    for by_type in conversion.counts.values():
        for name, n in by_type.items():
            problem_types[name] = problem_types.get(name, 0) + n
    summary = {
        "format": conversion.format or None,
        "out": str(out),
        "records": conversion.records,
        "read": len(conversion.rows) + len(conversion.failures),
        "written": len(conversion.rows),
        "failed": len(conversion.failures),
        "counts": conversion.counts,
        "problem_types": dict(sorted(problem_types.items())),
        "failures_file": str(failures_file) if conversion.failures else None,
        "media_root": media_root,
        "note": f"media outside {out_dir} are written as absolute paths: set media.media_root to {media_root}"
        if media_root
        else None,
        "missing_media": len(missing),
        "missing_media_example": missing[0] if missing else None,
    }
    _write_lines(summary_path(out), [json.dumps(summary, indent=2, ensure_ascii=False)])
    return summary


def convert(format: str, src: str | Path, out: str | Path) -> dict:
    """Convert ``src`` from ``format`` into rows at ``out`` (see ``write_conversion``);
    media paths in ``src`` are taken relative to its folder (or, for a benchmark's
    directory, to it). Returns the summary."""
    name = FORMATS.canonical(format)
    src = Path(src)
    if Path(out).resolve() == src.resolve():
        raise OmniRLError(f"{out}: the output would overwrite the input")
    conversion = FORMATS.get(name)(src)
    conversion.format = name
    progress = len(conversion.rows) >= PROGRESS_MIN_ROWS
    root = src if src.is_dir() else src.parent  # a benchmark is a directory; a training set a file
    return write_conversion(conversion, root, Path(out), progress=progress)


def summary_table(summary: dict) -> str:
    """The summary as ``omni-rl data convert`` prints it."""
    lines = [f"{'source type':<24}{'problem type':<26}{'rows':>8}"]
    for source_type, by_type in sorted(summary["counts"].items()):
        lines += [f"{source_type:<24}{name:<26}{n:>8}" for name, n in sorted(by_type.items())]
    lines.append(f"read {summary['read']}, written {summary['written']}, failed {summary['failed']}")
    if summary["failures_file"]:
        lines.append(f"failures: {summary['failures_file']}")
    if summary["missing_media"]:
        lines.append(f"media files not found: {summary['missing_media']} (first: {summary['missing_media_example']})")
    if summary["note"]:
        lines.append(summary["note"])
    lines.append(f"wrote {summary['out']} and {summary_path(Path(summary['out']))}")
    return "\n".join(lines)
