"""The cache index: which cache entry holds each medium of each preprocessed row.

Training looks a row's media up here instead of hashing the source files, so it can
run from the cache alone (``cache_only`` with the raw media deleted), and it notices a
changed source by its size and mtime (``prefer_cache``) without reading it.

One JSON file per dataset, ``CACHE/index/<digest of the dataset's path>.json``, so
several datasets share a cache and preprocessing one rewrites only its own file::

    {"format": "omni_rl.media_index", "format_version": 1,
     "dataset": "/abs/train.jsonl",
     "rows": {"<row id>": [{"kind": "video", "path": "/abs/m/a.mp4",
                            "size": 81234, "mtime_ns": 1732982400000000000,
                            "keys": {"<params digest>": "<entry key>"}}]}}

A row's list follows ``row_media`` order. ``keys`` maps the digest of the media
parameters an entry was built with (``params_digest(Budgets.params(kind))``) to its
key, so a file preprocessed under two budgets has two keys. Re-preprocessing merges
into the file (a changed source replaces its record) under the cache's lock, and the
file is replaced atomically.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from omni_rl.errors import OmniRLError
from omni_rl.preprocess.cache import MediaCache, atomic_write_bytes, params_digest

FORMAT = "omni_rl.media_index"
FORMAT_VERSION = 1


class IndexMiss(OmniRLError):
    """The index cannot name a medium's entry; the message says why."""


@dataclass(frozen=True)
class IndexedMedium:
    """One medium of a row as preprocessing saw it: its source's size and mtime, and
    its entry key under each parameter set it was cached with."""

    kind: str
    path: str
    size: int
    mtime_ns: int
    keys: dict[str, str] = field(default_factory=dict)

    @classmethod
    def stat(cls, kind: str, path: Path, keys: dict[str, str] | None = None) -> IndexedMedium:
        """A record of ``path`` as it is on disk now."""
        info = path.stat()
        return cls(kind, str(path), info.st_size, info.st_mtime_ns, dict(keys or {}))

    def same_source(self, other: IndexedMedium) -> bool:
        return (self.kind, self.path, self.size, self.mtime_ns) == (other.kind, other.path, other.size, other.mtime_ns)


def lookup(records: list[IndexedMedium] | None, position: int, kind: str, path: Path, digest: str) -> str:
    """The entry key of a row's ``position``-th medium under the parameters ``digest``.

    Only stats the source: an unchanged file (same size and mtime) or a deleted one
    keeps its indexed key.

    Raises:
        IndexMiss: the row is not indexed, its media or the file changed since it was
            preprocessed, or it was never cached with these parameters.
    """
    if records is None:
        raise IndexMiss("not in the cache index (preprocess the dataset into this cache; failed rows are not indexed)")
    record = records[position] if position < len(records) else None
    if record is None or (record.kind, record.path) != (kind, str(path)):
        raise IndexMiss("the row's media changed since it was preprocessed")
    try:
        now = IndexedMedium.stat(kind, path)
    except FileNotFoundError:
        now = record  # the raw file is gone: the cache is all there is
    if not now.same_source(record):
        raise IndexMiss("the file changed since it was preprocessed (size or mtime differ)")
    if digest not in record.keys:
        known = ", ".join(sorted(record.keys))
        raise IndexMiss(f"not preprocessed with these media settings (params {digest}; cached with {known})")
    return record.keys[digest]


def _flat(params: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in params.items():
        if isinstance(value, dict):
            out |= _flat(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


def settings_diff(cached: dict, wanted: dict) -> str:
    """The decoding parameters that differ, as "video.fps: cached 2.0, this run 1.0"."""
    a, b = _flat(cached), _flat(wanted)
    differ = [f"{k}: cached {a.get(k)}, this run {b.get(k)}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    return "; ".join(differ) or "none visible (another format version)"


def _index_path(cache: MediaCache, dataset: Path) -> Path:
    name = hashlib.sha256(str(dataset.resolve()).encode()).hexdigest()[:16]
    return cache.root / "index" / f"{name}.json"


class DatasetIndex:
    """The index of one dataset in one cache (empty until the dataset is preprocessed).

    Args:
        cache: the cache.
        dataset: the dataset file (identified by its resolved path).
    """

    def __init__(self, cache: MediaCache, dataset: str | Path):
        self.cache = cache
        self.dataset = Path(dataset).resolve()
        self.path = _index_path(cache, self.dataset)
        self.rows = self._read()

    def _read(self) -> dict[str, list[IndexedMedium]]:
        if not self.path.is_file():
            return {}
        try:
            raw = json.loads(self.path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise OmniRLError(f"{self.path}: unreadable cache index ({err})") from None
        if raw.get("format") != FORMAT or raw.get("format_version") != FORMAT_VERSION:
            raise OmniRLError(
                f"{self.path}: index format {raw.get('format')} v{raw.get('format_version')} "
                f"is not {FORMAT} v{FORMAT_VERSION}; preprocess the dataset again"
            )
        try:
            return {row_id: [IndexedMedium(**m) for m in media] for row_id, media in raw["rows"].items()}
        except (KeyError, TypeError, AttributeError) as err:
            raise OmniRLError(f"{self.path}: malformed cache index ({err}); preprocess the dataset again") from None

    def key(self, row_id: str, position: int, kind: str, path: Path, digest: str, params: dict | None = None) -> str:
        """``lookup`` of a row by id (see there). With ``params`` (this run's, whose
        digest is ``digest``), a miss on settings names the settings that differ."""
        if not self.rows:
            raise IndexMiss(f"the cache {self.cache.root} has no index of {self.dataset} (preprocess it there)")
        records = self.rows.get(row_id)
        try:
            return lookup(records, position, kind, path, digest)
        except IndexMiss as miss:
            record = records[position] if records and position < len(records) else None
            if params is None or record is None or not record.keys or digest in record.keys:
                raise
            # the manifest records each run's parameters of every kind; find this kind's
            by_digest = {
                params_digest(p[kind]): p[kind]
                for p in self.cache.manifest()["param_sets"].values()
                if isinstance(p, dict) and kind in p
            }
            cached = [by_digest[d] for d in sorted(record.keys) if d in by_digest]
            if not cached:
                raise
            differ = settings_diff(cached[0], params)
            raise IndexMiss(
                f"not preprocessed with these media settings: {differ} (preprocess with the training config: "
                f"omni-rl preprocess DATA --cache {self.cache.root} --config CONFIG)"
            ) from miss

    def update(self, rows: dict[str, list[IndexedMedium]]) -> None:
        """Merge freshly preprocessed rows into the index file and write it atomically.

        A medium whose source is unchanged keeps its keys for other parameter sets; a
        changed one starts afresh. Rows not in ``rows`` are kept as they are.
        """
        with self.cache.locked():
            self.rows = self._read()  # another run may have written it since
            for row_id, media in rows.items():
                old = self.rows.get(row_id, [])
                self.rows[row_id] = [_merge(old[i] if i < len(old) else None, m) for i, m in enumerate(media)]
            blob = {
                "format": FORMAT,
                "format_version": FORMAT_VERSION,
                "dataset": str(self.dataset),
                "rows": {row_id: [asdict(m) for m in media] for row_id, media in sorted(self.rows.items())},
            }
            atomic_write_bytes(self.path, json.dumps(blob, indent=1, ensure_ascii=False).encode())


def _merge(old: IndexedMedium | None, new: IndexedMedium) -> IndexedMedium:
    if old is None or not old.same_source(new):
        return new
    return IndexedMedium(new.kind, new.path, new.size, new.mtime_ns, {**old.keys, **new.keys})
