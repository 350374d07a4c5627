"""Process-wide runtime settings: torch threads, seeds, device and dtype, and the
``run:`` section that configures them (``RunConfig``).

This is the one place that sets torch's CPU thread count: on small machines an
oversubscribed pool makes timings swing tenfold, so tests and benchmarks pin it.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from omni_rl.config import require
from omni_rl.errors import OmniRLError

THREADS_ENV = "OMNI_RL_THREADS"


@dataclass
class RunConfig:
    """Where a run writes, and on what hardware."""

    name: str = "run"
    """A label for logs and metrics."""
    output_dir: str = "runs/run"
    """Directory for the resolved config, metrics, checkpoints and summaries."""
    seed: int = 0
    """Seed for Python, NumPy and torch."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """'auto' picks CUDA when available (under torchrun, each rank its local GPU);
    numeric precision is the trainer's (``trainer.precision``)."""
    threads: int | None = None
    """torch CPU threads; unset reads OMNI_RL_THREADS, else torch's default."""
    overwrite: bool = False
    """Start afresh in an output_dir that holds a run, deleting its checkpoints,
    metrics, evaluations and exported model (``omni-rl train --overwrite``); without
    it (or ``--resume``) such a directory is an error."""

    def __post_init__(self):
        require(self.threads is None or self.threads >= 1, "threads", "must be >= 1")


def set_threads(threads: int | None = None) -> int:
    """Pin torch's intra-op threads to ``threads``, else ``$OMNI_RL_THREADS``, else leave
    torch's default. Returns the count in force."""
    if threads is None and os.environ.get(THREADS_ENV):
        raw = os.environ[THREADS_ENV]
        if not raw.isdigit() or int(raw) < 1:
            raise OmniRLError(f"{THREADS_ENV}={raw!r}: expected a positive integer")
        threads = int(raw)
    if threads is not None:
        torch.set_num_threads(threads)
    return torch.get_num_threads()


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (all devices)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def resolve_device(device: str = "auto") -> torch.device:
    """'auto' -> CUDA when available, else CPU; 'cuda' without a GPU is a user error."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise OmniRLError(f"device '{device}' requested but no CUDA device is available")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """'auto' -> bfloat16 on CUDA, float32 on CPU; else the named dtype."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
