"""The offline pipeline: rows -> decoded, sampled, resized media -> cache entries.

``decode_medium`` is the single place that turns a source file into tensors; the cache
stores its output, and training without a cache calls it directly, so inputs built
from the cache equal those built from the raw file bit for bit.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from omni_rl.errors import DiskFull, OmniRLError, RowFailure, disk_full
from omni_rl.preprocess.audio import SAMPLE_RATE, NoAudioStream, decode_audio
from omni_rl.preprocess.cache import MediaCache, atomic_write_bytes, entry_key, file_digest, params_digest
from omni_rl.preprocess.image import ImageBudget, read_image
from omni_rl.preprocess.index import DatasetIndex, IndexedMedium, IndexMiss, lookup
from omni_rl.preprocess.rows import Row, read_rows, resolve_media_path
from omni_rl.preprocess.video import VideoBudget, read_video

KINDS = {"images": "image", "videos": "video", "audios": "audio"}


@dataclass(frozen=True)
class Budgets:
    """Everything that changes decoded media, resolved from a ``MediaConfig``."""

    video: VideoBudget
    image: ImageBudget
    max_audio_seconds: float = 30.0
    use_audio_in_video: bool = False
    media_root: str | None = None
    missing_video_audio: str = "skip"
    """What a row does whose video has no sound track (not a decoding parameter)."""

    @classmethod
    def from_config(cls, media) -> Budgets:
        """From a ``omni_rl.preprocess.config.MediaConfig``."""
        from omni_rl.models.families import FAMILIES

        patch = FAMILIES.get(media.family).patch_size or 14
        image = ImageBudget(patch_size=patch, min_pixels=media.image_min_pixels, max_pixels=media.image_max_pixels)
        smallest, largest = image.pixels()
        if smallest > largest:  # one of them unset: qwen-vl-utils' default for the patch
            raise OmniRLError(
                f"media.image_min_pixels ({smallest}) is above media.image_max_pixels ({largest}) for "
                f"{media.family} (patch {patch}; an unset one is qwen-vl-utils' default): no image could be resized"
            )
        return cls(
            video=VideoBudget(
                patch_size=patch,
                fps=media.fps,
                nframes=media.nframes,
                min_frames=media.min_frames,
                max_frames=media.max_frames,
                min_pixels=media.video_min_pixels,
                max_pixels=media.video_max_pixels,
                total_pixels=media.video_total_pixels,
            ),
            image=image,
            max_audio_seconds=media.max_audio_seconds,
            use_audio_in_video=media.use_audio_in_video,
            media_root=media.media_root,
            missing_video_audio=media.missing_video_audio,
        )

    def params(self, kind: str) -> dict:
        """The parameters that change the output of ``kind`` (part of its cache key;
        a video's own audio track, ``video_audio``, takes the audio parameters and
        starts at the video's first frame)."""
        if kind == "video":
            return {"video": self.video.key()}
        if kind == "image":
            return {"image": self.image.key()}
        audio = {"sample_rate": SAMPLE_RATE, "max_seconds": self.max_audio_seconds, "mono": "channel mean"}
        return {**audio, "starts": "at the first video frame"} if kind == "video_audio" else audio

    def all_params(self) -> dict:
        return {k: self.params(k) for k in ("video", "image", "audio", "video_audio")}

    def params_digest(self, kind: str) -> str:
        """The digest of ``params(kind)``, under which the cache index files keys."""
        return params_digest(self.params(kind))


def decode_medium(kind: str, path: Path, budgets: Budgets) -> tuple[dict[str, np.ndarray], dict]:
    """Tensors and metadata of one medium. ``kind``: image, video, audio, or
    video_audio (a video's own audio track). A video without a sound track gives an
    empty video_audio marked ``missing``: whether its row is skipped or heard without
    sound is the reader's choice (``media.missing_video_audio``), not the cache's."""
    if kind == "video":
        clip = read_video(path, budgets.video)
        meta = {
            "fps": clip.fps,
            "total_frames": clip.total_frames,
            "indices": clip.indices,
            "timestamps": clip.timestamps,
            "duration": clip.total_frames / clip.fps,
            "original_size": list(clip.original_size),
            "resized_size": list(clip.frames.shape[2:4]),
            "decoder": clip.backend,
        }
        return {"frames": clip.frames}, meta
    if kind == "image":
        image = read_image(path, budgets.image)
        return {"pixels": image.pixels}, {
            "original_size": list(image.original_size),
            "resized_size": list(image.pixels.shape[:2]),
        }
    try:
        sound = decode_audio(path, budgets.max_audio_seconds, from_video_start=kind == "video_audio")
    except NoAudioStream:
        if kind != "video_audio":
            raise
        return {"audio": np.zeros(0, np.float32)}, {"sample_rate": SAMPLE_RATE, "seconds": 0.0, "missing": True}
    seconds = sound.wave.size / SAMPLE_RATE
    # cut: the sound goes on past max_audio_seconds (the reader reports it: data/audio_cut)
    return {"audio": sound.wave}, {"sample_rate": SAMPLE_RATE, "seconds": seconds, "cut": sound.cut}


def row_media(row: Row, data_root: Path, budgets: Budgets) -> list[tuple[str, Path]]:
    """(kind, resolved path) of every medium of a row, in row order."""
    media_root = Path(budgets.media_root) if budgets.media_root else None
    out = []
    for name, kind in KINDS.items():
        for path in getattr(row, name):
            resolved = resolve_media_path(path, data_root, media_root)
            out.append((kind, resolved))
            if kind == "video" and (budgets.use_audio_in_video or row.fields.get("use_audio_in_video")):
                out.append(("video_audio", resolved))
    return out


def medium_key(kind: str, path: Path, budgets: Budgets) -> str:
    """The cache key of one medium (hashes the file's bytes)."""
    if not path.is_file():
        raise OmniRLError(f"{path}: no such file")
    return entry_key(kind, file_digest(path), budgets.params(kind))


def indexed_medium(
    indexed: list[IndexedMedium] | None, position: int, kind: str, path: Path, budgets: Budgets
) -> IndexedMedium:
    """The index record of a row's medium as it is now, with its key under ``budgets``;
    the file is hashed only when the row's previous records cannot name the key."""
    if not path.is_file():
        raise OmniRLError(f"{path}: no such file")
    now = IndexedMedium.stat(kind, path)  # before hashing: a file changed meanwhile looks changed next time
    digest = budgets.params_digest(kind)
    try:
        key = lookup(indexed, position, kind, path, digest)
    except IndexMiss:
        key = medium_key(kind, path, budgets)
    return replace(now, keys={digest: key})


@dataclass(frozen=True)
class RowOutcome:
    """What caching one row did: ``status`` is cached (it wrote an entry), present (every
    entry it needs was there), no_media or failed; ``media`` are the row's index records
    (empty when it failed), ``wrote`` the keys of the entries it wrote."""

    row_id: str
    status: str
    bytes: int = 0
    failure: RowFailure | None = None
    media: tuple[IndexedMedium, ...] = ()
    wrote: tuple[str, ...] = ()


def cache_row(
    row: Row, data_root: Path, cache: MediaCache, budgets: Budgets, indexed: list[IndexedMedium] | None = None
) -> RowOutcome:
    """Cache every medium of a row (a row is cached whole or counted as failed). A full
    disk is not the row's fault: it raises ``DiskFull``, which stops the run.

    ``indexed``: the row's records from an earlier run, which spare hashing unchanged files.
    """
    written, wrote = 0, []
    try:
        media = row_media(row, data_root, budgets)
        records = [indexed_medium(indexed, i, kind, path, budgets) for i, (kind, path) in enumerate(media)]
        for (kind, path), record in zip(media, records, strict=True):
            key = record.keys[budgets.params_digest(kind)]
            if cache.has(key):
                continue
            tensors, meta = decode_medium(kind, path, budgets)
            written += cache.write(key, tensors, {**meta, "kind": kind, "source": str(path)})
            wrote.append(key)
    except DiskFull:
        raise
    except OmniRLError as err:
        return RowOutcome(row.id, "failed", written, RowFailure(row.id, row.source, str(err)))
    except Exception as err:  # a bad file must never stop the run (a full disk does)
        full = disk_full(err, getattr(err, "filename", None) or cache.root)  # a decoder's own scratch file
        if full is not None:
            raise full from err
        reason = f"{type(err).__name__}: {err}"
        return RowOutcome(row.id, "failed", written, RowFailure(row.id, row.source, reason))
    status = "cached" if wrote else "present" if media else "no_media"
    return RowOutcome(row.id, status, written, media=tuple(records), wrote=tuple(wrote))


def _worker_init(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)


def _cache_row_job(args) -> RowOutcome:
    return cache_row(*args)


@dataclass
class PreprocessReport:
    """Counts of a preprocess run: its rows, each counted once, as cached (it wrote an
    entry), shared (another row of this run wrote the entries it needs: several
    questions on one clip), already cached (by an earlier run), no media, or failed."""

    rows: int
    cached: int
    already_cached: int
    failed: int
    shared: int
    no_media: int
    failures_by_reason: dict[str, int]
    bytes_written: int
    seconds: float
    failures: list[RowFailure] = field(default_factory=list, repr=False)
    """The rows that could not be cached (what ``failures.jsonl`` lists)."""

    def table(self) -> str:
        lines = [
            f"{'rows':<16}{self.rows:>10}",
            f"{'cached':<16}{self.cached:>10}",
            f"{'shared media':<16}{self.shared:>10}",
            f"{'already cached':<16}{self.already_cached:>10}",
            f"{'no media':<16}{self.no_media:>10}",
            f"{'failed':<16}{self.failed:>10}",
        ]
        lines += [f"  {reason[:60]:<58}{n:>6}" for reason, n in sorted(self.failures_by_reason.items())]
        lines += [f"{'bytes written':<16}{self.bytes_written:>10}", f"{'seconds':<16}{self.seconds:>10.1f}"]
        return "\n".join(lines)


def _reason_class(failure: RowFailure) -> str:
    """A failure's reason without the file name, for the summary table."""
    reason = failure.reason
    if ": " in reason and ("/" in reason.split(": ", 1)[0] or "\\" in reason.split(": ", 1)[0]):
        reason = reason.split(": ", 1)[1]
    return reason.split(" (", 1)[0]


def preprocess(
    data: str | Path,
    cache_dir: str | Path,
    budgets: Budgets,
    workers: int | None = None,
    limit: int | None = None,
    progress: bool = True,
    columns: dict[str, str] | None = None,
    strict: bool = False,
    shard: tuple[int, int] | None = None,
) -> PreprocessReport:
    """Cache every row of ``data``; failures go to ``CACHE/failures.jsonl``, the rows'
    entry keys to the cache index (see ``omni_rl.preprocess.index``).

    ``shard=(k, n)``: cache only share ``k`` of ``n``, for ``n`` processes preprocessing
    one dataset together (torchrun ranks). Rows that share their first medium fall in
    one share, so that two processes rarely decode (and write) the same entry. Entries
    are content-keyed and renamed into place, and the index and the manifest are merged
    under the cache's lock, so the shares do not collide; but a share neither removes
    stale temporary files (a live writer on another node looks dead from here) nor
    writes ``failures.jsonl`` (it sees only its own): the caller does both, the latter
    from every share's ``report.failures``.

    Resumable: entries already present are skipped, and files unchanged since the last
    run (same size and mtime) are not hashed again, so a rerun does only what is
    missing. The manifest is written last.

    Raises:
        DiskFull: a write found the disk full. The run stops at once (rows not begun
            are not decoded); the entries written before stay whole and a rerun keeps
            them, while the index, ``failures.jsonl`` and the manifest keep their
            previous contents.
    """
    from tqdm import tqdm

    started = time.perf_counter()
    data = Path(data)
    cache = MediaCache(cache_dir)
    cache.manifest()  # refuse a foreign cache before doing any work
    if shard is None:
        cache.remove_stale_temps()
    rows, failures = read_rows(data, columns, strict)
    if limit is not None:
        rows = rows[:limit]
    if shard is not None:
        rows = _share(rows, data.parent, budgets, *shard)
        failures = failures if shard[0] == 0 else []  # unreadable lines: every share reads them, one reports them
    workers = workers or os.cpu_count() or 1
    index = DatasetIndex(cache, data)
    jobs = [(row, data.parent, cache, budgets, index.rows.get(row.id)) for row in rows]
    outcomes: list[RowOutcome] = []
    with tqdm(total=len(jobs), desc="preprocess", unit="row", disable=not progress) as bar:
        if workers == 1:
            import torch

            threads = torch.get_num_threads()  # a training process's pinned threads, given back below
            _worker_init(1)
            try:
                for outcome in map(_cache_row_job, jobs):
                    outcomes.append(outcome)
                    bar.update()
            finally:
                torch.set_num_threads(threads)
        else:
            with ProcessPoolExecutor(workers, initializer=_worker_init, initargs=(1,)) as pool:
                try:
                    for outcome in pool.map(_cache_row_job, jobs, chunksize=1):
                        outcomes.append(outcome)
                        bar.update()
                except BaseException:
                    pool.shutdown(cancel_futures=True)  # rows not begun are not decoded
                    raise
    failures += [o.failure for o in outcomes if o.failure is not None]
    index.update({o.row_id: list(o.media) for o in outcomes if o.failure is None})
    if shard is None:
        write_failures(cache, failures)
    cache.record_params(budgets.all_params())
    counts = row_counts(outcomes)
    return PreprocessReport(
        rows=len(rows) + len(failures) - counts["failed"],
        cached=counts["cached"],
        already_cached=counts["already_cached"],
        failed=len(failures),
        shared=counts["shared"],
        no_media=counts["no_media"],
        failures_by_reason=dict(Counter(_reason_class(f) for f in failures)),
        bytes_written=sum(o.bytes for o in outcomes),
        seconds=time.perf_counter() - started,
        failures=failures,
    )


def row_counts(outcomes: list[RowOutcome]) -> Counter:
    """Rows by what caching them did (``PreprocessReport``): a row whose entries were all
    there is shared when another row of this run wrote one of them, else already cached."""
    written = {key for outcome in outcomes for key in outcome.wrote}

    def status(outcome: RowOutcome) -> str:
        if outcome.status != "present":
            return outcome.status
        keys = {key for medium in outcome.media for key in medium.keys.values()}
        return "shared" if keys & written else "already_cached"

    return Counter(map(status, outcomes))


def write_failures(cache: MediaCache, failures: list[RowFailure]) -> None:
    """``CACHE/failures.jsonl``: the rows the last preprocess run could not cache."""
    atomic_write_bytes(cache.root / "failures.jsonl", "".join(f.to_json() + "\n" for f in failures).encode())


def _share(rows: list[Row], data_root: Path, budgets: Budgets, index: int, count: int) -> list[Row]:
    """Share ``index`` of ``count`` of ``rows``: rows grouped by their first medium (a
    benchmark asks several questions of one video), groups dealt round-robin in order
    of first appearance, so every process computes the same split."""
    groups: dict[str, list[Row]] = {}
    for row in rows:
        try:
            media = row_media(row, data_root, budgets)
        except OmniRLError:  # a path escaping its root: the row fails alone, in some share
            media = []
        groups.setdefault(str(media[0][1]) if media else f"row:{row.id}:{row.source}", []).append(row)
    return [row for i, group in enumerate(groups.values()) if i % count == index for row in group]


def referenced_keys(
    data: str | Path, budgets: Budgets, cache: MediaCache, columns: dict[str, str] | None = None
) -> set[str]:
    """Cache keys of every medium the valid rows of ``data`` (its keys renamed by
    ``columns``, as training reads it) reference under ``budgets``: from the cache index
    where it can say (raw file unchanged or deleted), else by hashing the file; a medium
    that is neither indexed nor on disk has no key."""
    data = Path(data)
    rows, _ = read_rows(data, columns)
    index = DatasetIndex(cache, data)
    keys = set()
    for row in rows:
        try:
            media = row_media(row, data.parent, budgets)
        except OmniRLError:  # a path escaping its root: the row was never cached
            continue
        for position, (kind, path) in enumerate(media):
            try:
                keys.add(index.key(row.id, position, kind, path, budgets.params_digest(kind)))
            except IndexMiss:
                if path.is_file():
                    keys.add(medium_key(kind, path, budgets))
    return keys


def summary_json(report: PreprocessReport) -> str:
    return json.dumps({k: v for k, v in asdict(report).items() if k != "failures"}, indent=2)
