"""What a benchmark preset is: its protocol, how it reads the published files into
rows, how it writes the prompt, and how it turns per-row scores into its metrics.

A preset reads the benchmark's files as distributed (a local directory; nothing is
downloaded) into rows of omni_rl's schema (``id``, ``problem``, ``problem_type``,
``answer``, ``options``, media paths, plus the benchmark's own fields, ``task`` among
them). The same rows feed ``omni-rl eval --benchmark`` and ``omni-rl data convert``.

Each preset names the scorer it follows (``Variant``): the lmms-eval release whose task
gives its prompt, settings, denominator and aggregation, how that release reads an
answer, and how omni_rl's parser, which also scores training, differs from it. The
results record it under ``configs.<task>.follows``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omni_rl.config import build_section, require
from omni_rl.errors import OmniRLError, RowFailure
from omni_rl.registry import Registry


@dataclass(frozen=True)
class Protocol:
    """How a benchmark is run and scored; every field can be overridden, and the
    overrides are written into the results.

    Frames come from ``nframes`` (uniform over the video) or ``fps``; pixel budgets are
    qwen-vl-utils' (unset: the family's defaults).
    """

    nframes: int | None = 32
    """Frames sampled uniformly per video (unset: use ``fps``)."""
    fps: float | None = None
    """Frames per second instead of ``nframes``."""
    max_frames: int = 768
    """Most frames ``fps`` may sample."""
    video_max_pixels: int | None = None
    """Largest frame area after resizing."""
    video_total_pixels: int | None = None
    """Budget over all frames of a video."""
    max_audio_seconds: float = 30.0
    """Audio is cut to this length."""
    prompt: str = "{question}"
    """The prompt template; fields: {question}, {options} (in the benchmark's style),
    {subtitles} (Video-MME), {choices} (MMAU: the choices unlettered, one per line) and
    any field of the benchmark's rows."""
    temperature: float = 0.0
    """0: greedy; sampling temperature otherwise (pass@K needs > 0)."""
    max_new_tokens: int = 16
    """Longest answer generated."""
    samples: int = 1
    """Completions per question: 1 scores the one answer, K > 1 scores pass@K."""
    answer_parser: str = "multiple_choice"
    """The omni_rl reward type whose parser reads the answer (after <answer> tags, if
    any): multiple_choice, choice_text, regression, temporal_grounding, ..."""
    metric: str = "accuracy"
    """How scores aggregate; each benchmark lists the metrics it knows. Accuracy
    metrics differ in their denominator: ``accuracy`` every scored row,
    ``accuracy_responded`` rows whose response is not empty, ``accuracy_answered`` rows
    whose answer parsed."""
    variant: str = "lmms-eval"
    """Which of the preset's protocols the other fields start from: ``lmms-eval`` (every
    preset), or another the preset names (``mmau_test_mini``: ``official``)."""

    def __post_init__(self):
        require((self.nframes is None) != (self.fps is None), "nframes", "set one of nframes and fps")
        require(self.nframes is None or self.nframes >= 2, "nframes", "must be >= 2")
        require(self.fps is None or self.fps > 0, "fps", "must be > 0")
        require(self.samples >= 1, "samples", "must be >= 1")
        require(self.samples == 1 or self.temperature > 0, "temperature", "pass@K needs temperature > 0")
        require(self.max_new_tokens >= 1, "max_new_tokens", "must be >= 1")
        if self.answer_parser != "auto":
            from omni_rl.rewards import SCORERS

            require(
                self.answer_parser in SCORERS,
                "answer_parser",
                f"not a reward type; known: {', '.join(SCORERS.names())}",
            )

    def overridden(self, overrides: dict[str, Any], where: str = "protocol") -> Protocol:
        """A copy with ``overrides`` applied, typed and checked (a ConfigError names the
        field)."""
        return build_section(Protocol, overrides, where, self)

    def frame_sampling(self) -> dict:
        """The ``media:`` fields that choose a video's frames (``VideoBudget``'s)."""
        return {
            "fps": self.fps,
            "nframes": self.nframes,
            "min_frames": 2 if self.fps is not None else 4,
            "max_frames": self.max_frames,
        }

    def media(self, family: str) -> dict:
        """The ``media:`` section this protocol decodes with, for ``family``."""
        return {
            "family": family,
            **self.frame_sampling(),
            "video_max_pixels": self.video_max_pixels,
            "video_total_pixels": self.video_total_pixels,
            "max_audio_seconds": self.max_audio_seconds,
        }


@dataclass
class Reading:
    """A benchmark's rows, read from its files: the usable ones and a failure (file,
    row, reason) for every other one."""

    rows: list[dict] = field(default_factory=list)
    failures: list[RowFailure] = field(default_factory=list)

    def fail(self, row_id: str | None, where: str, reason: str) -> None:
        self.failures.append(RowFailure(row_id, where, reason))


@dataclass(frozen=True)
class Scored:
    """One row's outcome: its score in [0, 1] (accuracy, MRA or IoU), the parsed
    answer of its best completion (None: nothing parsable), and the row."""

    row: dict
    score: float
    parsed: Any
    responses: list[str]


LMMS_EVAL = "0.7.2"
"""The lmms-eval release the presets follow (tag v0.7.2). It changed Video-MME's parser
(to its shared ``extract_mcq_answer``), scored Charades-STA in the harness for the first
time and reported each VSI-Bench type as its own metric; MVBench and MMAU are as in
0.7.1."""


@dataclass(frozen=True)
class Variant:
    """One protocol of a preset and the scorer it follows, written into the results.

    Attributes:
        follows: the reference scorer ("lmms-eval 0.7.2, lmms_eval/tasks/mvbench").
        parser: how the reference reads an answer, and how omni_rl's parser differs.
        denominator: which rows the reference divides by.
        metric: the ``protocol.metric`` that divides by the same rows (the default).
        overrides: protocol fields that differ from the preset's lmms-eval protocol.
    """

    follows: str
    parser: str
    denominator: str
    metric: str
    overrides: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Benchmark:
    """A benchmark preset.

    Attributes:
        name: lmms-eval's task name.
        protocol: the default protocol (lmms-eval's task settings unless noted).
        read: ``(directory, protocol) -> Reading`` from the files as distributed.
        aggregate: ``(scored rows, metric) -> {metric name: value}`` in lmms-eval's
            units (percent or fraction, as its task reports).
        metrics: the names ``protocol.metric`` may take.
        layout: one line on the files it reads (for errors and the docs).
        variants: the protocols by name, ``lmms-eval`` (the default protocol) first,
            each with the scorer it follows.
        score: ``(row, parsed answer, reward accuracy) -> score`` where the benchmark's
            metric differs from the reward's (VSI-Bench's MRA); default: the accuracy.
        rows_of: another preset whose rows these are, read under another protocol
            (Video-MME with subtitles: videomme); ``omni-rl data convert`` offers the
            presets with rows of their own.
    """

    name: str
    protocol: Protocol
    read: Callable[[Path, Protocol], Reading]
    aggregate: Callable[[list[Scored], str], dict[str, float]]
    metrics: tuple[str, ...]
    layout: str
    variants: dict[str, Variant]
    score: Callable[[dict, Any, float], float] | None = None
    rows_of: str | None = None

    def protocol_for(self, overrides: dict[str, Any]) -> Protocol:
        """The protocol of the variant ``overrides`` names (default: lmms-eval's), with
        ``overrides`` applied on top; an error lists the variants."""
        name = str(overrides.get("variant", self.protocol.variant))
        if name not in self.variants:
            known = ", ".join(self.variants)
            raise OmniRLError(f"protocol.variant: {self.name} has the protocols {known}, not '{name}'")
        return self.protocol.overridden({**self.variants[name].overrides, **overrides})

    def load(self, directory: str | Path, protocol: Protocol) -> Reading:
        """The benchmark's rows under ``directory``; an error naming the expected layout
        when the directory holds none of its files."""
        root = Path(directory)
        if not root.is_dir():
            raise OmniRLError(f"{root}: no such directory (benchmark {self.name} expects {self.layout})")
        if protocol.metric not in self.metrics:
            raise OmniRLError(f"protocol.metric: {self.name} knows {', '.join(self.metrics)}, not '{protocol.metric}'")
        reading = self.read(root, protocol)
        if not reading.rows and not reading.failures:
            raise OmniRLError(f"{root}: no {self.name} files found (expected {self.layout})")
        return reading


BENCHMARKS: Registry[Benchmark] = Registry("benchmark")


def register_benchmark(benchmark: Benchmark) -> Benchmark:
    BENCHMARKS.register(benchmark.name)(benchmark)
    return benchmark


# ------------------------------------------------------------------- shared helpers


LETTERS = "ABCDEFGHIJ"


def lettered(options: list[str], style: str = "{letter}. {text}") -> str:
    """Options one per line, labelled A, B, ... in ``style``."""
    return "\n".join(style.format(letter=LETTERS[i], text=text) for i, text in enumerate(options))


def render(protocol: Protocol, row: dict, **extra) -> str:
    """The row's prompt under the protocol; a template naming a field the rows lack is
    an error naming the field."""
    try:
        return protocol.prompt.format_map({**row, "question": row["problem"], **extra})
    except KeyError as err:
        raise OmniRLError(f"protocol.prompt names {err}, which rows of this benchmark do not have") from None
    except (ValueError, IndexError) as err:
        raise OmniRLError(f"protocol.prompt {protocol.prompt!r} is not a valid format string ({err})") from None


def media_file(root: Path, candidates: list[str]) -> Path | None:
    """The first of ``candidates`` (paths under ``root``) that is a file."""
    for candidate in candidates:
        path = root / candidate
        if path.is_file():
            return path
    return None


def find_table(root: Path, *patterns: str) -> Path | None:
    """The first file under ``root`` matching the first pattern that matches any
    (patterns are relative globs, tried in order)."""
    for pattern in patterns:
        found = sorted(root.glob(pattern))
        if found:
            return found[0]
    return None


def option_texts(options) -> list[str]:
    """Options as plain texts: "A. chair" -> "chair" (the prompt letters them again),
    when every option carries its own label in order (``rewards.choice.option_texts``)."""
    from omni_rl.rewards.choice import option_texts as texts

    return texts(options)


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise OmniRLError(f"{path}: unreadable JSON ({err})") from None


def read_table(path: Path) -> list[dict]:
    """The records of a Parquet or JSONL file."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            return pq.read_table(path).to_pylist()
        except Exception as err:  # noqa: BLE001 - pyarrow raises many error types for bad files
            raise OmniRLError(f"{path}: unreadable Parquet file ({err})") from None
    records = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise OmniRLError(f"{path}:{number}: invalid JSON ({err.msg})") from None
    return records


def spread(items: list, limit: int) -> list:
    """``limit`` items spread evenly over ``items`` (all of them when limit is 0 or
    covers them), so that a subset of a benchmark keeps every task."""
    if not limit or limit >= len(items):
        return list(items)
    return [items[i * len(items) // limit] for i in range(limit)]


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def grouped(scored: list[Scored], key: str) -> dict[str, list[Scored]]:
    """Scored rows grouped by a row field, in sorted order of the field's values."""
    groups: dict[str, list[Scored]] = {}
    for item in scored:
        groups.setdefault(str(item.row.get(key, "unknown")), []).append(item)
    return dict(sorted(groups.items()))


ACCURACIES = ("accuracy", "accuracy_responded", "accuracy_answered")


def accuracy(scored: list[Scored], metric: str) -> float:
    """Percent right over the rows the metric counts: every scored row (``accuracy``:
    lmms-eval's Video-MME and MMAU, and MMAU's own script); rows with a
    response that is not empty (``accuracy_responded``: lmms-eval's MVBench, which
    drops only a response that is exactly empty: its Qwen wrappers do not strip, so a
    blank one counts, as a wrong answer); rows whose answer parsed (``accuracy_answered``:
    Video-MME's own script, which counts a question only when it finds a letter; no
    lmms-eval task divides so)."""
    if metric == "accuracy_responded":
        scored = [s for s in scored if any(r != "" for r in s.responses)]
    elif metric == "accuracy_answered":
        scored = [s for s in scored if s.parsed is not None]
    return 100.0 * mean([s.score for s in scored])
