"""The training-side dataset: rows + media cache -> samples -> model inputs.

Media come from the cache when ``cache_mode`` allows, else they are decoded from the
raw file by the same ``decode_medium`` the offline pipeline runs, so a sample built
from the cache equals one built from the raw file, bit for bit.

A row's entries are found through the cache index that preprocessing wrote (see
``omni_rl.preprocess.index``): reading a sample stats its source files but never
hashes an unchanged one, and needs no raw file at all once it is cached.

cache_mode:
    prefer_cache  read cached entries; a medium the index cannot name (row not
                  indexed, source changed: size or mtime differ) is looked up by its
                  file's hash, and decoded when that misses too
    cache_only    read cached entries only; raw media may be deleted. A medium the
                  index cannot name is an error naming the row, the file and why
    no_cache      always decode the raw files

Bad rows never stop a run. A row found unusable when the dataset loads is refused
(``failures``, counted in data/rows_refused); one that fails as it is read (its media
do not decode, its prompt does not encode) is a ``BadRow``, which ``encoded`` reports
once, counts in skipped/bad_rows and skips. ``strict`` makes either an error.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np

from omni_rl.engine import distributed
from omni_rl.errors import OmniRLError, RowFailure
from omni_rl.models.inputs import encode_prompts
from omni_rl.preprocess.audio import SAMPLE_RATE
from omni_rl.preprocess.cache import MediaCache
from omni_rl.preprocess.index import DatasetIndex, IndexMiss
from omni_rl.preprocess.inputs import inputs_key, pack, processor_digest, unpack
from omni_rl.preprocess.pipeline import Budgets, decode_medium, medium_key, row_media
from omni_rl.preprocess.rows import PLACEHOLDER, Row, read_failures, read_rows
from omni_rl.preprocess.video import VideoClip
from omni_rl.rewards import check_targets
from omni_rl.rewards.choice import option_texts

log = logging.getLogger(__name__)


class BadRow(OmniRLError):
    """A row that fails as it is read: its media do not decode, its prompt does not
    encode, or it asks for what its media lack (``media.missing_video_audio: skip``).
    ``MediaDataset.encoded`` reports it once, counts it and skips it."""

    def __init__(self, failure: RowFailure):
        where = f"{failure.path}: " if failure.path else ""
        super().__init__(f"{where}row '{failure.id}': {failure.reason}")
        self.failure = failure


CacheMode = Literal["prefer_cache", "cache_only", "no_cache"]
CACHE_MODES = ("prefer_cache", "cache_only", "no_cache")


@dataclass
class Sample:
    """One prompt with its decoded media and ground truth.

    Attributes:
        messages: chat messages whose content parts are typed text/image/video/audio.
        images: uint8 [H, W, 3] arrays, in prompt order.
        videos: decoded clips, in prompt order.
        audios: mono float32 16 kHz waveforms, in prompt order.
        video_audios: with ``use_audio_in_video``, one entry per video: its own sound
            track, or None for a video without one heard as video only; else empty.
    """

    id: str
    problem_type: str
    answer: object
    messages: list[dict]
    images: list[np.ndarray] = field(default_factory=list)
    videos: list[VideoClip] = field(default_factory=list)
    audios: list[np.ndarray] = field(default_factory=list)
    video_audios: list[np.ndarray] = field(default_factory=list)
    options: list[str] | None = None
    data_source: str | None = None
    fields: dict = field(default_factory=dict, repr=False)
    source: str = ""
    """Where its row was read (``file:line``), for errors."""
    media_keys: list[str] | None = None
    """The cache key of each of its media, in row order (None without a cache)."""


DEFAULT_TEMPLATE = "{problem}{options}"


def render_prompt(template: str, row: Row) -> str:
    """The question text: ``template`` filled with the row's fields; ``{options}``
    becomes a lettered list ("\\nOptions:\\nA. left\\nB. right", options written with
    their own letters lettered once, as the scorer reads them) or nothing, and
    ``{option_list}`` the options as given, a Python list ("['left', 'right']", R1-AQA's
    form)."""
    options = row.fields.get("options") or []
    listed = "".join(f"\n{chr(65 + i)}. {option}" for i, option in enumerate(option_texts(options)))
    values = {
        **row.fields,
        "problem": row.problem,
        "options": f"\nOptions:{listed}" if options else "",
        "option_list": str([str(o) for o in options]),
    }
    try:
        return template.format_map(values)
    except KeyError as err:
        raise OmniRLError(f"prompt_template field {err} is not in row '{row.id}'") from None
    except (ValueError, IndexError) as err:
        raise OmniRLError(f"prompt_template {template!r} is not a valid format string ({err})") from None


def build_messages(problem: str, kinds: list[str]) -> list[dict]:
    """A user turn with media parts (in ``kinds`` order) and the problem text.

    Media go first, unless the text holds ``<image>`` / ``<video>`` / ``<audio>``
    placeholders: then each placeholder is replaced by the next medium of its kind, and
    media without a placeholder go first.
    """
    wanted = PLACEHOLDER.findall(problem)
    remaining = list(kinds)
    for kind in wanted:
        if kind not in remaining:
            raise OmniRLError(f"the problem has more <{kind}> placeholders than the row has {kind}s")
        remaining.remove(kind)
    content: list[dict] = [{"type": kind} for kind in remaining]
    # split() with a capturing group alternates text pieces and placeholder kinds
    for i, piece in enumerate(PLACEHOLDER.split(problem)):
        if i % 2:
            content.append({"type": piece})
        elif piece:
            content.append({"type": "text", "text": piece})
    return [{"role": "user", "content": content}]


def _clip_from_entry(tensors: dict, meta: dict) -> VideoClip:
    return VideoClip(
        frames=tensors["frames"].numpy(),
        fps=meta["fps"],
        total_frames=meta["total_frames"],
        indices=list(meta["indices"]),
        original_size=tuple(meta["original_size"]),
        backend=meta.get("decoder", "cache"),
    )


class MediaDataset:
    """Rows of a JSONL/Parquet file with their media, as ``Sample``s.

    Args:
        data: the dataset file; media paths are relative to its directory.
        budgets: decoding parameters (must match the cache's to hit it).
        cache: a preprocessed cache directory, or None.
        cache_mode: see the module docstring.
        strict: a row that cannot be used is an error, not a skip.
        prompt_template: how a row becomes the question text (see ``render_prompt``).
        columns: the dataset's own keys renamed to the schema's (``{"question": "problem"}``).
        report_refused: log the refused rows; False for a caller that reports
            ``failures`` itself (curation, which writes them out).
        inputs: the dtype the cache's model inputs entries of this run store media
            features in (``omni_rl.preprocess.inputs``: float32, or bfloat16 for a run
            that computes in bf16), or None to run the processor on every read. A row
            whose entry is missing is encoded from its media, counted in
            ``data/inputs_misses`` and the first one logged with why.

    Every check that needs no decoding runs here, before any training:
    - the row schema (``omni_rl.preprocess.rows``);
    - the problem type: an unknown type is an error naming each unknown type, its
      file and rows, and the known types;
    - the gold answer: one its scorer can never match (an unparsable math answer, a
      letter beyond the options...) is a failure;
    - the media: a path that escapes the dataset's folder, a missing file (unless the
      cache index names its entry), or under ``cache_only`` a medium the index cannot
      name (saying which media setting differs) is a failure;
    - the cache's ``failures.jsonl``: a row that preprocess could not cache (the same
      file, line and id) is a failure, with the reason preprocess recorded.
    Each failure is logged (file:row id: reason) and kept in ``failures``; its row is
    skipped (``strict``: the first is an error). Rows that fail later, as they are
    read, are ``bad`` (see ``encoded``).
    """

    def __init__(
        self,
        data: str | Path,
        budgets: Budgets,
        cache: str | Path | None = None,
        cache_mode: CacheMode = "prefer_cache",
        strict: bool = False,
        prompt_template: str = DEFAULT_TEMPLATE,
        columns: dict[str, str] | None = None,
        report_refused: bool = True,
        inputs: str | None = None,
    ):
        if cache_mode not in CACHE_MODES:
            raise OmniRLError(f"cache_mode '{cache_mode}' is not one of {', '.join(CACHE_MODES)}")
        if cache_mode == "cache_only" and cache is None:
            raise OmniRLError("cache_mode 'cache_only' needs a cache directory")
        self.data = Path(data)
        self.budgets = budgets
        self.cache = MediaCache(cache) if cache is not None and cache_mode != "no_cache" else None
        self.uncached = self.cache is not None and cache_mode == "prefer_cache" and not self.cache.root.is_dir()
        if self.uncached:  # a cache that was never made: say so once, and count every read as a miss
            log.warning(
                "%s: the cache %s does not exist: every medium is decoded on the fly (counted in data/cache_misses); "
                "make it with omni-rl preprocess %s --cache %s --config YOUR_TRAINING_CONFIG",
                self.data,
                cache,
                self.data,
                cache,
            )
            self.cache = None
        self.index = DatasetIndex(self.cache, self.data) if self.cache is not None else None
        self.cache_mode = cache_mode
        self.rows: list[Row]
        self.failures: list[RowFailure]
        self.rows, self.failures = read_rows(self.data, columns, strict)
        self.read = len(self.rows) + len(self.failures)
        self.left_out = 0
        problems = check_targets(self.rows)
        _refuse_unknown_types(self.data, problems)
        self._drop([RowFailure(p.id, p.path, p.reason) for p in problems])
        self._drop(self._media_failures())
        self._drop(self._cached_failures())
        if self.failures and (report_refused or strict):
            _report(self.data, self.failures, strict)
        self.strict = strict
        self.bad: dict[str, RowFailure] = {}  # row id -> why it failed as it was read
        self.prompt_template = prompt_template
        for row in self.rows:
            render_prompt(prompt_template, row)  # a template naming a missing field fails here
        self.cache_hits = 0
        self.cache_misses = 0
        self.cache_corrupt = 0
        self.index_misses = 0
        self.videos_without_sound = 0
        self.audio_cut = 0
        self.inputs = inputs if self.cache is not None else None
        self.inputs_hits = 0
        self.inputs_misses = 0
        self._processors: dict[int, str] = {}  # id(processor) -> its digest

    def __len__(self) -> int:
        return len(self.rows)

    def _drop(self, failures: list[RowFailure]) -> None:
        bad = {f.id for f in failures}
        self.rows = [row for row in self.rows if row.id not in bad]
        self.failures += failures

    def _media_failures(self) -> list[RowFailure]:
        """Rows whose media cannot be read, found without decoding: a path escaping the
        dataset's folder, a missing file the cache cannot stand in for, or (cache_only)
        a medium the cache index cannot name."""
        failures = []
        for row in self.rows:
            try:
                for position, (kind, path) in enumerate(row_media(row, self.data.parent, self.budgets)):
                    self._check_medium(row, position, kind, path)
            except OmniRLError as err:
                failures.append(RowFailure(row.id, row.source, str(err)))
        return failures

    def _check_medium(self, row: Row, position: int, kind: str, path: Path) -> None:
        if self.index is not None:
            try:
                self.index.key(
                    row.id, position, kind, path, self.budgets.params_digest(kind), self.budgets.params(kind)
                )
                return  # the cache holds it, whether or not the raw file is still there
            except IndexMiss as miss:
                if self.cache_mode == "cache_only":
                    raise OmniRLError(f"{path}: {miss} (cache_mode cache_only)") from None
        if not path.is_file():
            raise OmniRLError(f"{path}: no such file")

    def _cached_failures(self) -> list[RowFailure]:
        """Rows that the last preprocess run into the cache listed in its
        ``failures.jsonl`` (matched by file, line and id, so a duplicate id's first row
        is not taken for its refused copy), refused now rather than failing when drawn.

        A failure recorded under a relative path from another working directory does
        not match; its row is then skipped when it fails to decode (see ``encoded``)."""
        if self.cache is None:
            return []
        listed = self.cache.root / "failures.jsonl"
        here = self.data.resolve()
        failed = {}
        for failure in read_failures(listed):
            file, _, line = failure.path.rpartition(":")
            if failure.id is not None and file and Path(file).resolve() == here:
                failed[failure.id, line] = failure.reason
        refused = []
        for row in self.rows:
            reason = failed.get((row.id, row.source.rpartition(":")[2]))
            if reason is not None:
                why = f"{reason} (preprocess could not cache it, {listed}: fix the media and preprocess again)"
                refused.append(RowFailure(row.id, row.source, why))
        return refused

    def use_only(self, rows: list[Row]) -> None:
        """Use ``rows``, some of its rows (an eval set's ``limit``); the others are
        reported as left out."""
        self.left_out += len(self.rows) - len(rows)
        self.rows = rows

    def load_report(self) -> dict[str, int]:
        """Rows read, used and refused at load, and left out by ``use_only`` where some
        were (read = used + refused + left out)."""
        used, refused = len(self.rows), len(self.failures)
        report = {"data/rows_read": self.read, "data/rows_used": used, "data/rows_refused": refused}
        return report | ({"data/rows_left_out": self.left_out} if self.left_out else {})

    def _key(self, row: Row, position: int, kind: str, path: Path) -> str:
        """The cache key of a row's medium: from the index, or (prefer_cache) by hashing the file."""
        try:
            return self.index.key(
                row.id, position, kind, path, self.budgets.params_digest(kind), self.budgets.params(kind)
            )
        except IndexMiss as miss:
            if self.cache_mode == "cache_only":
                raise OmniRLError(f"{path}: {miss}") from None
            if not self.index_misses:
                log.warning(
                    "%s: %s; hashing the file to find its entry (slow; counted in data/index_misses)", path, miss
                )
            self.index_misses += 1
        return medium_key(kind, path, self.budgets)

    def cache_metrics(self) -> dict[str, int]:
        """Reads since this dataset was made (a resumed run counts from its resume: a
        checkpoint does not keep these): from the cache, decoded from raw files, and
        found by hashing the source because the index could not name the entry; videos
        used without the sound their row asked for (``missing_video_audio:
        video_only``); sounds cut at ``media.max_audio_seconds``; and the bad rows this
        process skipped (``run_metrics`` counts each once over every process)."""
        return {
            "data/cache_hits": self.cache_hits,
            "data/cache_misses": self.cache_misses,
            "data/index_misses": self.index_misses,
            "data/cache_corrupt": self.cache_corrupt,
            "data/videos_without_sound": self.videos_without_sound,
            "data/audio_cut": self.audio_cut,
            "data/inputs_hits": self.inputs_hits,
            "data/inputs_misses": self.inputs_misses,
            "skipped/bad_rows": len(self.bad),
        }

    def run_metrics(self) -> dict[str, int]:
        """``cache_metrics`` over every process (a collective: each calls it): the reads
        summed, and each bad row counted once, however many processes it was dealt to
        (in a later epoch another rank may read a row one rank found bad)."""
        counts = self.cache_metrics()
        bad = set(distributed.gather_objects(list(self.bad)))
        return {**distributed.sum_counts(counts), "skipped/bad_rows": len(bad)}

    def encoded(self, index: int, processor) -> tuple[Sample, dict] | None:
        """Row ``index`` as a sample with its model inputs, or None for a bad row (its
        media do not decode, its prompt does not encode: a ``BadRow``).

        A bad row is logged once (file, row, reason; the first ``MAX_REPORTED``, then a
        count), counted in ``skipped/bad_rows`` and skipped from then on without being
        read again; under ``strict`` it is an error naming it. Any other exception is
        a bug, not a bad row, and is raised."""
        row = self.rows[index]
        if row.id in self.bad:
            return None
        try:
            sample = self[index]
            return sample, self._inputs(sample, processor)
        except BadRow as bad:
            if self.strict:
                raise OmniRLError(f"{bad} (data.strict: a bad row stops the run)") from None
            self.bad[row.id] = bad.failure
            if len(self.bad) <= MAX_REPORTED:
                log.warning("%s (row skipped; counted in skipped/bad_rows)", bad)
            elif len(self.bad) == MAX_REPORTED + 1:
                log.warning("%s: more bad rows skipped, not logged (skipped/bad_rows counts them all)", self.data)
            return None

    def inputs_key(self, sample: Sample, processor) -> str | None:
        """The key of ``sample``'s model inputs entry for ``processor`` (None: this
        dataset reads no inputs entries)."""
        if self.inputs is None or sample.media_keys is None:
            return None
        digest = self._processors.get(id(processor))
        if digest is None:
            digest = self._processors[id(processor)] = processor_digest(processor)
        return inputs_key(sample.media_keys, sample.messages, digest, self.inputs)

    def _inputs(self, sample: Sample, processor) -> dict:
        """``sample``'s model inputs: from its inputs entry, else from the processor."""
        key = self.inputs_key(sample, processor)
        if key is None:
            return dict(encode_sample(processor, sample))
        if self.cache.has(key):
            try:
                inputs = unpack(self.cache.read(key))
                self.inputs_hits += 1
                return inputs
            except OmniRLError as err:
                why = f"{err} (omni-rl cache verify moves it aside)"
        else:
            why = (
                f"the cache holds no model inputs of this row for this processor and {self.inputs} features "
                f"(omni-rl preprocess {self.data} --cache {self.cache.root} --config YOUR_TRAINING_CONFIG writes them)"
            )
        if not self.inputs_misses:
            log.warning(
                "%s: row '%s': %s; running the processor instead (counted in data/inputs_misses)",
                sample.source,
                sample.id,
                why,
            )
        self.inputs_misses += 1
        return dict(encode_sample(processor, sample))

    def cache_inputs(self, processor, progress: bool = True, limit: int | None = None) -> dict[str, int]:
        """Write the model inputs entry of every row (the first ``limit``) that lacks
        one (``inputs`` must be set); returns how many were written, already there,
        and bad (their media or prompt fail: each logged)."""
        from tqdm import tqdm

        if self.inputs is None:
            raise OmniRLError(f"{self.data}: model inputs are cached only beside media in a cache directory")
        counts = {"written": 0, "present": 0, "bad": 0}
        count = len(self) if limit is None else min(limit, len(self))
        for index in tqdm(range(count), desc="model inputs", unit="row", disable=not progress):
            try:  # a row whose media or prompt fail is reported, counted, and the others go on
                sample = self[index]
                key = self.inputs_key(sample, processor)
                if self.cache.has(key):
                    counts["present"] += 1
                    continue
                inputs = encode_sample(processor, sample)
            except BadRow as bad:
                log.warning("%s (its model inputs are not cached; counted as failed)", bad)
                counts["bad"] += 1
                continue
            tensors, meta = pack(inputs, self.inputs, sample.media_keys)
            self.cache.write(key, tensors, meta)
            counts["written"] += 1
        return counts

    def _sound(self, row: Row, kind: str, path: Path, tensors: dict, meta: dict) -> np.ndarray:
        """An audio clip or a video's own sound; one that went on past
        ``media.max_audio_seconds`` was cut there: counted, and the first one logged."""
        limit = self.budgets.max_audio_seconds
        # an entry cached before cuts were recorded: a sound that fills the budget was cut
        cut = meta.get("cut", round(meta["seconds"] * SAMPLE_RATE) >= int(limit * SAMPLE_RATE))
        if cut:
            if not self.audio_cut:
                lost = (
                    "the video's later frames are seen without it" if kind == "video_audio" else "the rest is not heard"
                )
                log.warning(
                    "%s: row '%s': %s: the sound is cut at media.max_audio_seconds (%g s) and %s "
                    "(raise media.max_audio_seconds to keep it; counted in data/audio_cut)",
                    row.source,
                    row.id,
                    path,
                    limit,
                    lost,
                )
            self.audio_cut += 1
        return tensors["audio"].numpy()

    def _video_sound(self, row: Row, path: Path, tensors: dict, meta: dict):
        """A video's own sound track, or None when it has none and the config says to
        use the video without it (else the row is bad)."""
        if not meta.get("missing"):
            return self._sound(row, "video_audio", path, tensors, meta)
        reason = f"{path}: the row asks for the video's sound and the video has no audio track"
        if self.budgets.missing_video_audio == "skip":
            raise BadRow(RowFailure(row.id, row.source, f"{reason} (media.missing_video_audio: skip)"))
        if not self.videos_without_sound:
            log.warning(
                "%s: row '%s': %s; using it without sound (media.missing_video_audio: video_only; "
                "counted in data/videos_without_sound)",
                row.source,
                row.id,
                reason,
            )
        self.videos_without_sound += 1
        return None

    def _medium(self, row: Row, position: int, kind: str, path: Path) -> tuple[dict, dict, str | None]:
        """A medium's tensors, metadata and cache key (None without a cache)."""
        key = None
        if self.cache is not None:
            key = self._key(row, position, kind, path)
            if self.cache.has(key):
                try:
                    entry = self.cache.read(key)
                    self.cache_hits += 1
                    return entry.tensors, entry.meta, key
                except OmniRLError as err:
                    if self.cache_mode == "cache_only":
                        raise
                    if not self.cache_corrupt:
                        log.warning(
                            "%s; decoding %s instead (omni-rl cache verify moves such entries aside and a rerun of "
                            "preprocess rebuilds them; counted in data/cache_corrupt)",
                            err,
                            path,
                        )
                    self.cache_corrupt += 1
            if self.cache_mode == "cache_only":
                raise OmniRLError(f"{path}: its entry {key} is not in the cache {self.cache.root} (removed by gc?)")
            self.cache_misses += 1
        elif self.uncached:
            self.cache_misses += 1
        tensors, meta = decode_medium(kind, path, self.budgets)
        return {name: _as_tensor(a) for name, a in tensors.items()}, meta, key

    def _row_media(self, row: Row) -> list[tuple[str, Path, dict, dict, str | None]]:
        """(kind, path, tensors, metadata, cache key) of every medium of a row. A medium that cannot
        be read (the decoders turn every failure of a file into an ``OmniRLError`` that
        names it; a cache entry missing under ``cache_only``) makes the row bad."""
        try:
            media = row_media(row, self.data.parent, self.budgets)
            return [(kind, path, *self._medium(row, i, kind, path)) for i, (kind, path) in enumerate(media)]
        except OmniRLError as err:
            raise BadRow(RowFailure(row.id, row.source, str(err))) from None

    def __getitem__(self, index: int) -> Sample:
        row = self.rows[index]
        sample = Sample(
            id=row.id,
            problem_type=row.problem_type,
            answer=row.answer,
            messages=[],
            options=row.fields.get("options"),
            data_source=row.fields.get("data_source"),
            fields=row.fields,
            source=row.source,
        )
        kinds, keys = [], []
        for kind, path, tensors, meta, key in self._row_media(row):
            keys.append(key)
            if kind == "video":
                sample.videos.append(_clip_from_entry(tensors, meta))
            elif kind == "image":
                sample.images.append(tensors["pixels"].numpy())
                # what the grounding scorers convert boxes with (unless the row says otherwise)
                if len(sample.images) == 1:
                    sample.fields = {
                        "image_size": meta["original_size"],
                        "resized_size": meta["resized_size"],
                        **sample.fields,
                    }
            elif kind == "audio":
                sample.audios.append(self._sound(row, kind, path, tensors, meta))
            else:  # video_audio
                sample.video_audios.append(self._video_sound(row, path, tensors, meta))
            if kind != "video_audio":
                kinds.append(kind)
        if any(sound is None for sound in sample.video_audios):
            sample.video_audios = []  # heard as video only: all of the row's videos, or none
        sample.media_keys = keys if self.cache is not None else None
        try:
            sample.messages = build_messages(render_prompt(self.prompt_template, row), kinds)
        except OmniRLError as err:
            raise BadRow(RowFailure(row.id, row.source, str(err))) from None
        return sample


MAX_REPORTED = 20


def _report(data: Path, failures: list[RowFailure], strict: bool) -> None:
    """Log each refused row once (the first ``MAX_REPORTED``, then a count); under
    ``strict`` the first is an error."""
    if strict:
        first = failures[0]
        raise OmniRLError(f"{first} (data.strict: {len(failures)} rows refused)")
    for failure in failures[:MAX_REPORTED]:
        log.warning("%s (row skipped)", failure)
    if len(failures) > MAX_REPORTED:
        more = len(failures) - MAX_REPORTED
        log.warning("%s: %d more rows skipped (the run's data/rows_refused counts them all)", data, more)


def _refuse_unknown_types(data: Path, problems) -> None:
    """An error listing every unknown problem type with its rows (a typo, or a
    plug-in scorer that is not loaded), before anything is built."""
    unknown: dict[str, list] = {}
    for problem in problems:
        if problem.unknown_type is not None:
            unknown.setdefault(problem.unknown_type, []).append(problem)
    if not unknown:
        return
    lines = []
    for rows in unknown.values():
        where = ", ".join(f"{p.path} {p.id}" for p in rows[:3])
        lines.append(f"{rows[0].reason} in {len(rows)} rows: {where}{' ...' if len(rows) > 3 else ''}")
    raise OmniRLError(f"{data}: " + "; ".join(lines))


def _as_tensor(array: np.ndarray):
    import torch

    return torch.from_numpy(np.ascontiguousarray(array))


def encode_sample(processor, sample: Sample):
    """Model inputs (a batch of one) for a sample's prompt.

    Raises:
        BadRow: naming the row, when its prompt cannot be encoded: media the model
            cannot take (``OmniRLError``), or media the processor refuses (processors
            check their inputs with ``ValueError``). Other errors are bugs and pass.
    """
    try:
        return encode_prompts(
            processor,
            [sample.messages],
            images=sample.images,
            videos=sample.videos,
            audios=sample.audios,
            video_audios=sample.video_audios,
        )
    except (OmniRLError, ValueError) as err:
        reason = str(err) if isinstance(err, OmniRLError) else f"{type(processor).__name__} cannot encode it: {err}"
        raise BadRow(RowFailure(sample.id, sample.source, reason)) from None
