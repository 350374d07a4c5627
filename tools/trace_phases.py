"""A traced step's phases and their peaks: the tracker, the table per phase, the
provenance line, shared by ``tools/trace_memory.py`` and ``tools/trace_flow.py``."""

from __future__ import annotations

import dataclasses
import datetime
import platform
import subprocess
import sys
import time
from collections import Counter

import torch
from fake_values import ROOT, call_site
from torch_private import Propagation, autograd_node, peak_tracker, restart_peak

GB = 2**30
T0 = time.perf_counter()


def tracker_for(model, optimizer, fsdp: bool):
    """The memory tracker of a trace (``torch_private.peak_tracker``), standing aside
    during DTensor's sharding propagation, and noting the line that issued each new
    peak's operation (``peak_site``)."""
    return peak_tracker(model, optimizer, fsdp, stand_aside=lambda: Propagation.depth > 0, where=peak_site)


def peak_site() -> str:
    """``call_site`` with FSDP2's frames too (its hooks allocate in a backward), and in a
    backward the autograd node running (a backward's Python stack ends at the call of
    ``backward`` or a hook)."""
    node = autograd_node()
    return call_site(("/torch/nn/", "/torch/distributed/fsdp/")) + (f", in {node}" if node else "")


def module_label(name: str | None, backward: bool) -> str:
    """``model.layers.3.mlp (backward)`` for the module ``ModTracker`` names
    ``Qwen2_5_VLForConditionalGeneration.model.layers.3.mlp`` (``tracker.running``)."""
    if name is None:
        return "outside any module" + (" (backward)" if backward else "")
    inside = name.partition(".")[2] or "the model itself"
    return f"{inside} ({'backward' if backward else 'forward'})"


@dataclasses.dataclass
class Phase:
    """One phase's peak: bytes by kind at the moment of its highest total."""

    name: str
    device: str
    peak: dict[str, int] = dataclasses.field(default_factory=dict)
    start: int = 0
    """Total bytes live when the phase (its heaviest occurrence) began."""
    rise: int = 0
    """The most bytes any occurrence allocated above what was live when it began."""
    seconds: float = 0.0
    count: int = 0
    at: str | None = None
    """The module running at the peak (``module_label``)."""
    site: str | None = None
    """The line that issued the peak's operation (``peak_site``)."""

    @property
    def total(self) -> int:
        return self.peak.get("Total", 0)


class Phases:
    """Which phase of the step runs now, and the tracker's peak within each."""

    def __init__(self, tracker, device: str, marks: bool = False):
        self.tracker, self.device = tracker, device
        self.done: dict[str, Phase] = {}
        self.current: str | None = None
        self.started = 0.0
        self.start_total = 0
        self.marks = marks  # profiler ranges named after the phases (real runs)
        self.mark = None

    def _total(self, snapshot: dict) -> dict[str, int]:
        merged: Counter = Counter()
        for per_device in snapshot.values():
            merged.update({str(getattr(k, "value", k)): v for k, v in per_device.items()})
        return dict(merged)

    def enter(self, name: str) -> None:
        if name == self.current:
            return
        self.close()
        self.current, self.started = name, time.perf_counter()
        print(f"[trace] {name} ({self.device}) at {time.perf_counter() - T0:.0f} s", file=sys.stderr, flush=True)
        if self.marks:
            self.mark = torch.autograd.profiler.record_function(f"phase:{name}")
            self.mark.__enter__()
        # the trackers keep one peak since they started: start this phase's from now
        self.start_total = self._total(restart_peak(self.tracker)).get("Total", 0)

    def close(self) -> None:
        if self.current is None:
            return
        peak = self._total(self.tracker.get_tracker_snapshot("peak"))
        phase = self.done.setdefault(self.current, Phase(self.current, self.device))
        phase.seconds += time.perf_counter() - self.started
        phase.count += 1
        phase.rise = max(phase.rise, peak.get("Total", 0) - self.start_total)
        if peak.get("Total", 0) >= phase.total:
            phase.peak, phase.start = peak, self.start_total
            running = self.tracker.running
            phase.at = module_label(*running) if running else None
            phase.site = self.tracker.site
        if self.mark is not None:
            self.mark.__exit__(None, None, None)
            self.mark = None
        self.current = None


KINDS = (
    ("Sharded Param", "params (shard)"),
    ("Unsharded Param", "params (gathered)"),
    ("Parameter", "params"),
    ("Buffer", "buffers"),
    ("Sharded Grad", "grads (shard)"),
    ("Unsharded Grad", "grads (gathered)"),
    ("Gradient", "grads"),
    ("Grad", "grads"),
    ("OptState", "optimizer state"),
    ("Optstate", "optimizer state"),
    ("All Gather", "all-gather buffers"),
    ("Reduce Scatter", "reduce-scatter buffers"),
    ("Inputs", "inputs"),
    ("Activation", "activations"),
    ("Temp", "temporaries"),
)


def provenance() -> str:
    """When, at which commit, on what: for the results page."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True)
        commit += " (with local changes)" if dirty.stdout.strip() else ""
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    machine = f"{platform.machine()}, {platform.processor() or 'cpu'}, torch {torch.__version__}"
    return f"{when}, commit {commit}, {machine}, fake tensors (no GPU)"


def rank0_row(row: dict) -> dict:
    """``distributed.mean_metrics`` of ranks that all hold this rank's row: the row. (The
    fake process group moves no bytes, and ``all_gather_object`` unpickles what it
    gathers, which fake tensors do not hold.)"""
    return dict(row)


def print_phases(phases: dict[str, Phase]) -> None:
    """Each phase's bytes by kind at its peak, with the module and the line at it."""
    for phase in phases.values():
        print(
            f"\nphase {phase.name}: ran on {phase.device}, {phase.count}x, {phase.seconds:.1f} s; "
            f"live at its start {phase.start / GB:.2f} GB"
        )
        shown: Counter = Counter()
        for key, label in KINDS:
            shown[label] += phase.peak.get(key, 0)
        for label, value in shown.items():
            if value:
                print(f"  {label:<24}{value / GB:>9.2f} GB")
        print(f"  {'peak':<24}{phase.total / GB:>9.2f} GB" + (f"  at {phase.at}" if phase.at else ""))
        if phase.site:
            print(f"  {'issued by':<24}{phase.site}")


def print_peak(phases: dict[str, Phase]) -> None:
    """The last lines: the heaviest phase and its peak (``peak per rank = X GB``)."""
    heaviest = max(phases.values(), key=lambda p: p.total)
    print(f"heaviest phase: {heaviest.name}")
    print(f"peak per rank = {heaviest.total / GB:.2f} GB")


def phases_json(phases: dict[str, Phase]) -> dict:
    keys = ("device", "peak", "start", "rise", "count", "at", "site")
    return {p.name: {k: getattr(p, k) for k in keys} for p in phases.values()}
