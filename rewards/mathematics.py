"""Math answers, checked by math-verify (gold answer first) in a worker process.

math-verify's own timeouts use SIGALRM, which works only in a process's main thread,
and sympy can run for minutes on inputs like ``9^9^9^9``. So every check runs in a
child process's main thread with math-verify's timeouts on, and the parent enforces
a hard limit by killing the child (and starting a new one) when it overruns.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from omni_rl.rewards.base import Target, register


@dataclass
class MathOutcome:
    gold_ok: bool
    correct: bool
    error: str | None = None


class MathVerifier:
    """A math-verify worker process with a hard per-check time limit.

    The worker is a fresh interpreter (``python -m omni_rl.rewards.math_worker``), so it
    inherits no threads, locks or CUDA state from the trainer and never re-runs the
    user's main script.
    """

    def __init__(self, timeout: float = 2.0):
        self.timeout = timeout
        self._process: subprocess.Popen | None = None
        self._buffer = b""
        self._lock = threading.Lock()

    def _start(self) -> None:
        self._process = subprocess.Popen(
            [sys.executable, "-m", "omni_rl.rewards.math_worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        self._buffer = b""

    def _stop(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.wait()
        self._process = None

    def _read_line(self, limit: float) -> bytes | None:
        deadline = time.monotonic() + limit
        fd = self._process.stdout.fileno()
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                raise EOFError("the worker exited")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line

    def check(self, gold: str, prediction: str | None) -> MathOutcome:
        """Verify one prediction; a check that overruns ``timeout`` counts as wrong."""
        with self._lock:
            limit = self.timeout
            if self._process is None or self._process.poll() is not None:
                self._start()
                limit += 60  # the first check also pays for the worker's imports
            try:
                self._process.stdin.write(json.dumps({"gold": gold, "prediction": prediction}).encode() + b"\n")
                self._process.stdin.flush()
                line = self._read_line(limit)
            except (OSError, EOFError) as err:
                self._stop()
                return MathOutcome(True, False, f"worker failed: {err}")
            if line is None:
                self._stop()
                return MathOutcome(True, False, f"timed out after {self.timeout} s")
        reply = json.loads(line)
        if "error" in reply:
            return MathOutcome(True, False, reply["error"])
        return MathOutcome(reply["gold_ok"], reply["correct"])

    def close(self) -> None:
        with self._lock:
            self._stop()

    def __del__(self):
        self._stop()


_local = threading.local()
_slots: list[MathVerifier] = []
_slots_lock = threading.Lock()


_timeout = [2.0]


def set_timeout(seconds: float) -> None:
    """The hard limit on one check, for every verifier slot."""
    with _slots_lock:
        _timeout[0] = seconds
        for verifier in _slots:
            verifier.timeout = seconds


def slot(index: int) -> MathVerifier:
    """The ``index``-th long-lived verifier: batch scoring keeps its worker processes
    alive across calls instead of starting new ones every step."""
    with _slots_lock:
        while len(_slots) <= index:
            _slots.append(MathVerifier(_timeout[0]))
        return _slots[index]


@contextlib.contextmanager
def using_slot(index: int):
    """Make this thread check math with verifier ``slot(index)``."""
    previous = getattr(_local, "verifier", None)
    _local.verifier = slot(index)
    try:
        yield
    finally:
        _local.verifier = previous


def default_verifier() -> MathVerifier:
    """This thread's verifier: the slot it was bound to, else slot 0."""
    return getattr(_local, "verifier", None) or slot(0)


def _validate_math(target: Target) -> None:
    outcome = default_verifier().check(str(target.answer), None)
    if not outcome.gold_ok:
        raise ValueError(f"math answer {target.answer!r} cannot be parsed by math-verify")


@register("math", aliases=("math_verify", "latex"), validate=_validate_math, slow=True)
def math_answer(prediction: str, target: Target) -> tuple[float, dict]:
    outcome = default_verifier().check(str(target.answer), prediction)
    details = {"error": outcome.error} if outcome.error else {}
    return float(outcome.correct), details
