"""Errors a user can cause and fix: the CLI prints them on one line and exits 2."""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path


class OmniRLError(Exception):
    """A problem with the user's input (config, data, paths), not a bug in omni_rl."""


class ConfigError(OmniRLError):
    """A config file or override that does not match the schema."""


@dataclass(frozen=True)
class RowFailure:
    """A row that could not be used: where it is and why (the row readers, converters and
    benchmark presets report these; the one type every layer shares)."""

    id: str | None
    path: str
    reason: str

    def __str__(self) -> str:
        """``file:line id: reason``; ``file:line: reason`` for a row with no id (a line
        that is not JSON)."""
        where = f"{self.path} {self.id}" if self.id else self.path
        return f"{where}: {self.reason}"

    def to_json(self) -> str:
        return json.dumps({"id": self.id, "path": self.path, "reason": self.reason}, ensure_ascii=False)


class DiskFull(OmniRLError):
    """A write found its disk (or the user's quota) full: the run stops at once, since
    every later write would fail too, and nothing it was writing is left half done."""


# what the OS says when a write finds no room: the device is full, or the user's quota
DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


def disk_full(err: BaseException, path: str | Path, size: int | None = None) -> DiskFull | None:
    """The ``DiskFull`` that ``err`` stands for, or None when it is another failure.

    Args:
        err: what a write raised: an ``OSError`` with errno ENOSPC or EDQUOT, or an
            error that carries the OS's message for them (safetensors' Rust writer
            raises ``SafetensorError("... No space left on device (os error 28)")``;
            torch.distributed.checkpoint wraps each rank's ``OSError`` in a
            ``CheckpointException`` whose text holds it), itself or in its chain.
        path: what was being written.
        size: the bytes that write needed, when known.
    """
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno in DISK_FULL_ERRNOS:
            code = err.errno
            break
        text = str(err)
        code = next((c for c in DISK_FULL_ERRNOS if os.strerror(c) in text), None)
        if code is not None:
            break
        err = err.__cause__ or err.__context__
    else:
        return None
    needed = f"about {size:,} bytes" if size is not None else "an amount not known in advance"
    return DiskFull(
        f"{path}: out of disk space ({os.strerror(code)}) writing {needed}; free space there "
        "(or raise the quota) and rerun"
    )


@contextmanager
def stop_on_disk_full(path: str | Path, size: int | None = None) -> Iterator[None]:
    """Turn a full disk inside the block into ``DiskFull`` naming ``path`` and ``size``
    (see ``disk_full``); every other error passes through unchanged."""
    try:
        yield
    except DiskFull:
        raise
    except Exception as err:
        full = disk_full(err, path, size)
        if full is None:
            raise
        raise full from err
