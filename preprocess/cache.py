"""The media cache: decoded tensors in safetensors files, keyed by content and parameters.

Layout of a cache directory::

    manifest.json                 format name and version, every parameter set written
    entries/ab/abcdef....safetensors
    index/<dataset digest>.json   (row, medium) -> entry key per dataset (see index.py)
    failures.jsonl                rows the last preprocess run could not cache

An entry's key hashes the format version, the media kind, the SHA-256 of the source
file's bytes and every parameter that changes the output (patch size and budgets
included), so a changed file or parameter is a miss, never old data. Each entry holds
its tensors (uint8 frames or images, float32 PCM) and JSON metadata, including a digest
of the tensor bytes that ``verify`` recomputes. Every write goes to a temporary file
that is renamed into place, the manifest last, so a killed run leaves no half entry; a
full disk stops the writer with ``DiskFull`` and removes its temporary file.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from omni_rl.errors import OmniRLError, stop_on_disk_full
from omni_rl.runtime import umask_files

FORMAT = "omni_rl.media_cache"
FORMAT_VERSION = 1
_CHUNK = 1 << 20


def file_digest(path: str | Path) -> str:
    """SHA-256 hex digest of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def tensors_digest(tensors: dict[str, np.ndarray]) -> str:
    """SHA-256 over the names, dtypes, shapes and bytes of ``tensors`` (sorted by name)."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        array = np.ascontiguousarray(tensors[name])
        digest.update(f"{name}|{array.dtype.str}|{array.shape}|".encode())
        digest.update(memoryview(array).cast("B"))
    return digest.hexdigest()


def meta_digest(meta: dict) -> str:
    """SHA-256 of an entry's metadata (its canonical JSON, without this digest)."""
    fields = {k: v for k, v in meta.items() if k != "meta_sha256"}
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def params_digest(params: dict) -> str:
    """Short stable digest of a parameter mapping."""
    return hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()[:16]


def entry_key(kind: str, source_digest: str, params: dict) -> str:
    """The cache key of one decoded medium."""
    blob = json.dumps(
        {"format_version": FORMAT_VERSION, "kind": kind, "source": source_digest, "params": params}, sort_keys=True
    )
    return hashlib.sha256(blob.encode()).hexdigest()


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to a temporary file beside ``path`` (its folder created), then
    rename it into place. A full disk raises ``DiskFull``; a failed write leaves no
    temporary file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with stop_on_disk_full(path, len(data)):
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    """Whether ``pid`` is a running process (a zombie, killed but not yet reaped, is not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


@dataclass(frozen=True)
class Entry:
    """A cached medium: its tensors (memory-mapped reads) and metadata."""

    tensors: dict[str, torch.Tensor]
    meta: dict


@dataclass(frozen=True)
class GcPlan:
    """What ``cache gc`` would delete and keep: entry key -> bytes."""

    delete: dict[str, int]
    keep: dict[str, int]

    @property
    def delete_bytes(self) -> int:
        return sum(self.delete.values())

    @property
    def keep_bytes(self) -> int:
        return sum(self.keep.values())


class MediaCache:
    """A cache directory (created on first write)."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

    @classmethod
    def existing(cls, root: str | Path) -> MediaCache:
        """A cache that must already exist (commands that read one); anything else is
        an error naming the directory."""
        cache = cls(root)
        if not cache.root.is_dir():
            raise OmniRLError(f"{cache.root}: no such cache directory (omni-rl preprocess DATA --cache DIR makes one)")
        if not cache.manifest_path.is_file() and not (cache.root / "entries").is_dir():
            raise OmniRLError(f"{cache.root}: not an omni_rl media cache (no manifest.json or entries/)")
        cache.manifest()  # a foreign or newer format is an error too
        return cache

    def quarantine(self, key: str) -> Path:
        """Move a corrupt entry to ``CACHE/corrupt/`` (kept for inspection): the cache no
        longer has it, so readers decode the raw file and preprocess writes it again."""
        target = self.root / "corrupt" / self.path(key).name
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(self.path(key), target)
        return target

    @property
    def manifest_path(self) -> Path:
        return self.root / "manifest.json"

    def path(self, key: str) -> Path:
        """Where the entry ``key`` lives."""
        return self.root / "entries" / key[:2] / f"{key}.safetensors"

    def has(self, key: str) -> bool:
        return self.path(key).is_file()

    def manifest(self) -> dict:
        """The manifest, or an empty one for a new cache; a foreign or newer format is an error."""
        if not self.manifest_path.is_file():
            return {"format": FORMAT, "format_version": FORMAT_VERSION, "param_sets": {}}
        try:
            manifest = json.loads(self.manifest_path.read_text())
        except json.JSONDecodeError as err:
            raise OmniRLError(f"{self.manifest_path}: unreadable manifest ({err})") from None
        if manifest.get("format") != FORMAT or manifest.get("format_version") != FORMAT_VERSION:
            raise OmniRLError(
                f"{self.manifest_path}: cache format {manifest.get('format')} v{manifest.get('format_version')} "
                f"is not {FORMAT} v{FORMAT_VERSION}; use a new cache directory"
            )
        return manifest

    def record_params(self, params: dict) -> None:
        """Add a parameter set to the manifest (written atomically, after the entries)."""
        with self.locked():
            manifest = self.manifest()  # another run may have added a set since
            manifest["param_sets"][params_digest(params)] = params
            manifest["updated"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            atomic_write_bytes(self.manifest_path, json.dumps(manifest, indent=2, sort_keys=True).encode())

    @contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the cache's lock (``CACHE/.lock``) while reading and rewriting a shared
        file, so two preprocess runs never lose each other's updates."""
        with stop_on_disk_full(self.root / ".lock"):
            self.root.mkdir(parents=True, exist_ok=True)
            lock = open(self.root / ".lock", "a")  # noqa: SIM115 - opened under the guard, held below
        with lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def write(self, key: str, tensors: dict[str, np.ndarray], meta: dict) -> int:
        """Write one entry atomically; returns its size in bytes. A full disk raises
        ``DiskFull``; a failed write leaves no temporary file."""
        path = self.path(key)
        meta = {**meta, "key": key, "format_version": FORMAT_VERSION, "tensors_sha256": tensors_digest(tensors)}
        meta["meta_sha256"] = meta_digest(meta)
        metadata = {"omni_rl": json.dumps(meta, sort_keys=True)}
        size = sum(a.nbytes for a in tensors.values()) + len(metadata["omni_rl"])  # safetensors adds a small header
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            with stop_on_disk_full(path, size):
                path.parent.mkdir(parents=True, exist_ok=True)
                tensors = {name: torch.from_numpy(np.ascontiguousarray(a)) for name, a in tensors.items()}
                save_file(tensors, str(tmp), metadata=metadata)
                umask_files(tmp)  # safetensors writes 600
                with open(tmp, "rb+") as f:
                    os.fsync(f.fileno())
                os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        return path.stat().st_size

    def read(self, key: str) -> Entry:
        """Read an entry; tensors are read from a memory map."""
        path = self.path(key)
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = json.loads(f.metadata()["omni_rl"])
                tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 - safe_open has no __iter__
        except FileNotFoundError:
            raise OmniRLError(f"{path}: no cache entry {key}") from None
        except Exception as err:  # noqa: BLE001 - a damaged file fails in safetensors' own ways
            raise OmniRLError(f"{path}: unreadable cache entry ({err})") from None
        return Entry(tensors, meta)

    def meta(self, key: str) -> dict | None:
        """An entry's metadata without its tensors, or None when it is unreadable."""
        try:
            with safe_open(str(self.path(key)), framework="pt") as f:
                return json.loads(f.metadata()["omni_rl"])
        except Exception:  # noqa: BLE001 - a damaged file fails in safetensors' own ways
            return None

    def entry_keys(self) -> list[str]:
        """Every entry key on disk."""
        return sorted(p.stem for p in (self.root / "entries").glob("*/*.safetensors"))

    def check(self, key: str) -> str | None:
        """Why the entry ``key`` is corrupt, or None when its tensors and its metadata
        (fps, frame indices, sizes, stored dtypes: what builds the model's inputs) match
        their digests. Entries written before metadata digests have their tensors checked."""
        try:
            entry = self.read(key)
        except OmniRLError as err:
            return str(err)
        if entry.meta.get("key") != key:
            return f"entry claims key {entry.meta.get('key')}"
        actual = tensors_digest({name: t.numpy() for name, t in entry.tensors.items()})
        if actual != entry.meta.get("tensors_sha256"):
            return "tensor bytes do not match their digest"
        if "meta_sha256" in entry.meta and meta_digest(entry.meta) != entry.meta["meta_sha256"]:
            return "metadata does not match its digest"
        return None

    def gc_plan(self, referenced: set[str]) -> GcPlan:
        """Which entries a gc keeps (those in ``referenced``) and deletes, with their bytes."""
        sizes = {key: self.path(key).stat().st_size for key in self.entry_keys()}
        return GcPlan(
            delete={k: n for k, n in sizes.items() if k not in referenced},
            keep={k: n for k, n in sizes.items() if k in referenced},
        )

    def remove(self, key: str) -> int:
        """Delete an entry; returns the bytes freed."""
        path = self.path(key)
        size = path.stat().st_size
        path.unlink()
        return size

    def remove_stale_temps(self) -> int:
        """Delete temporary files left by writers that were killed; returns how many.

        A temp file names its writer's pid; files of live processes are kept, so a
        concurrent run is not disturbed.
        """
        removed = 0
        for tmp in self.root.rglob(".*.tmp"):
            pid = tmp.name.rsplit(".", 2)[-2]
            if pid.isdigit() and _alive(int(pid)):
                continue
            tmp.unlink(missing_ok=True)
            removed += 1
        return removed

    def stats(self) -> dict:
        """Entry counts and bytes, overall and by media kind."""
        kinds: dict[str, dict[str, int]] = {}
        total = 0
        for key in self.entry_keys():
            size = self.path(key).stat().st_size
            total += size
            meta = self.meta(key)
            kind = meta.get("kind", "?") if meta is not None else "unreadable"
            row = kinds.setdefault(kind, {"entries": 0, "bytes": 0})
            row["entries"] += 1
            row["bytes"] += size
        manifest = self.manifest()
        return {
            "root": str(self.root),
            "format_version": manifest["format_version"],
            "param_sets": len(manifest["param_sets"]),
            "entries": sum(k["entries"] for k in kinds.values()),
            "bytes": total,
            "by_kind": kinds,
        }
