"""Process-wide runtime settings: torch threads, seeds, device and dtype, and the
``run:`` section that configures them (``RunConfig``).

This is the one place that sets torch's CPU thread count: on small machines an
oversubscribed pool makes timings swing tenfold, so tests and benchmarks pin it.
"""

from __future__ import annotations

import logging
import os
import platform
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from omni_rl.config import require
from omni_rl.errors import OmniRLError

_log = logging.getLogger(__name__)
THREADS_ENV = "OMNI_RL_THREADS"
# The settings that make ATen's vectorised kernels, oneDNN and MKL take their AVX2 code
# paths whatever the CPU offers. They are read when each library first computes, so they
# take effect when set before the run's first tensor operation.
AVX2_KERNELS = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_CBWR": "AVX2"}


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
    cpu_kernels: Literal["native", "avx2"] = "native"
    """CPU kernel paths: 'native' uses the widest vector instructions the CPU has
    (AVX-512 where present); 'avx2' pins torch's kernels (ATen, oneDNN, MKL) to their
    AVX2 paths, so a seeded CPU run gives the same numbers on any x86-64 CPU with AVX2
    (for the same thread count); the quickstarts' default, because the summation order
    of the wider kernels differs and a seeded run then ends elsewhere on another CPU."""
    overwrite: bool = False
    """Start afresh in an output_dir that holds a run, deleting its checkpoints,
    metrics, evaluations and exported model (``omni-rl train --overwrite``); without
    it (or ``--resume``) such a directory is an error. The quickstarts always start
    their runs afresh, whatever this says."""

    def __post_init__(self):
        require(self.threads is None or self.threads >= 1, "threads", "must be >= 1")


def umask_mode() -> int:
    """The mode a new file gets under this process's umask (0o644 under 022)."""
    umask = os.umask(0)  # reading the umask means setting it: put it straight back
    os.umask(umask)
    return 0o666 & ~umask


def umask_files(path: str | Path) -> None:
    """Give the file ``path``, or every file under the folder ``path``, the mode a new
    file gets under the umask: safetensors creates its files 600, which would leave
    weights and cache entries unreadable to the user's group."""
    path = Path(path)
    mode = umask_mode()
    for file in [path] if path.is_file() else (p for p in path.rglob("*") if p.is_file()):
        os.chmod(file, mode)


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


def pin_cpu_kernels(kernels: str) -> str:
    """Apply ``RunConfig.cpu_kernels`` to this process and the processes it starts
    (environment workers); returns the ATen kernel level in force ('AVX2', 'AVX512',
    ...) for the run's summary. A pin that cannot take effect (not an x86-64 CPU, no
    AVX2, or tensors already computed at another level in this process) is said once
    in the log and leaves the environment as it was, so that the processes this one
    starts compute as it does."""
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    if kernels == "avx2" and not x86:
        _warn_once(f"run.cpu_kernels=avx2 applies to x86-64 CPUs only; this {platform.machine()} runs its own")
    before = {name: os.environ.get(name) for name in AVX2_KERNELS}
    if kernels == "avx2" and x86:
        os.environ.update(AVX2_KERNELS)
    capability = torch.backends.cpu.get_cpu_capability()
    if kernels == "avx2" and x86 and capability != "AVX2":
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        _warn_once(
            f"run.cpu_kernels=avx2: torch's CPU kernels run at {capability} in this process (already in use "
            "before the run started, or no AVX2): its numbers may differ from another CPU's"
        )
    return capability


_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        _log.warning(message)


def apply_run_settings(run: RunConfig) -> dict:
    """Threads and CPU kernels of ``run`` set for this process (and the CUDA allocator's
    settings, ``use_expandable_segments``); returns what is in force (``{"threads": ...,
    "cpu_kernels": ...}``) for the run's summary."""
    use_expandable_segments()
    return {"threads": set_threads(run.threads), "cpu_kernels": pin_cpu_kernels(run.cpu_kernels)}


ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"
# torch's newer name for the same setting; a user's value under either name stands
ALLOC_CONF_NEW = "PYTORCH_ALLOC_CONF"


def use_expandable_segments() -> str | None:
    """On a machine with CUDA, let the caching allocator grow segments in place
    (``expandable_segments:True``) unless the user set ``PYTORCH_CUDA_ALLOC_CONF`` or
    ``PYTORCH_ALLOC_CONF`` (even to nothing): rollout and update alternate tensor shapes,
    which otherwise fragment the cache into blocks neither can reuse. It must be set
    before CUDA's first allocation; the ``omni-rl`` command sets it first thing. Returns
    the setting in force (None without CUDA)."""
    if not torch.cuda.is_available():
        return None
    for name in (ALLOC_CONF, ALLOC_CONF_NEW):
        if name in os.environ:
            return os.environ[name]
    if torch.cuda.is_initialized():
        _log.warning("%s set after CUDA started: it applies from the next process on", ALLOC_CONF)
    os.environ[ALLOC_CONF] = "expandable_segments:True"
    _log.info("%s=expandable_segments:True (set %s to choose otherwise)", ALLOC_CONF, ALLOC_CONF)
    return os.environ[ALLOC_CONF]


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
