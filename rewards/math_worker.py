"""The math-verify worker process: ``python -m omni_rl.rewards.math_worker``.

Reads JSON lines ``{"gold", "prediction"}`` on stdin and answers each with
``{"gold_ok", "correct"}`` or ``{"error"}`` on stdout (an error too where math-verify
timed out and found no match). It runs math-verify in its main thread, where
math-verify's SIGALRM timeouts work; the parent enforces a hard limit.
"""

from __future__ import annotations

import functools
import json
import logging
import re
import sys

LATEX_COMMAND = re.compile(r"\\[A-Za-z]+")
PROSE = re.compile(r"[A-Za-z]{3,}")
INNER_TIMEOUT = 1  # seconds, math-verify's parse and verify limits (whole seconds)


class GaveUp(logging.Handler):
    """Counts math-verify's timeouts: it logs each one as a warning and answers as if
    nothing parsed or matched, which a caller could not tell from a wrong answer."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += record.getMessage().startswith("Timeout")


GAVE_UP = GaveUp()
logging.getLogger("math_verify").addHandler(GAVE_UP)


def _found_expression(parsed) -> bool:
    """Whether a math-verify reading holds an expression: it falls back to the raw
    string alone when it finds none."""
    return any(not isinstance(item, str) for item in parsed)


def _parse(text: str) -> tuple:
    """math-verify's reading of ``text``, and a timeout counted in ``GAVE_UP`` each time
    (the reading is cached: a gold answer is checked against a whole group)."""
    parsed, timed_out = _reading(text)
    GAVE_UP.count += timed_out
    return parsed


@functools.lru_cache(maxsize=8192)
def _reading(text: str) -> tuple[tuple, bool]:
    """(math-verify's reading of ``text``, whether it timed out)."""
    before = GAVE_UP.count
    parsed = _read(text)
    timed_out = GAVE_UP.count > before
    GAVE_UP.count = before
    return parsed, timed_out


def _read(text: str) -> tuple:
    """math-verify's reading of ``text``, in math mode first where it looks like math."""
    from math_verify import parse

    # An extracted answer is usually bare LaTeX ("2\\pi", "x^2+1"): read it in math mode
    # first, since math-verify's plain-text reading takes "2\\pi" for 2. Prose stays
    # plain text: in math mode its words become long products of symbols. A reading
    # that found no expression (math-verify then returns the raw string alone, as for
    # "$\\[...\\]$") falls through to the plain-text one.
    if "$" not in text and "\\boxed" not in text and not PROSE.search(LATEX_COMMAND.sub("", text)):
        parsed = parse(f"${text}$", parsing_timeout=INNER_TIMEOUT)
        if _found_expression(parsed):
            return tuple(parsed)
    return tuple(parse(text, parsing_timeout=INNER_TIMEOUT))


def _check(gold: str, prediction: str | None) -> tuple[bool, bool]:
    """(gold parses, prediction equals gold); runs in the worker."""
    from math_verify import verify

    parsed_gold = _parse(gold)
    if not _found_expression(parsed_gold):
        return False, False
    if prediction is None:
        return True, False
    parsed = _parse(prediction)
    return True, bool(parsed) and bool(verify(list(parsed_gold), list(parsed), timeout_seconds=INNER_TIMEOUT))


def _serve(stdin, stdout) -> None:
    """Worker loop over JSON lines: {"gold", "prediction"} in, {"gold_ok", "correct"} or
    {"error"} out."""
    for line in stdin:
        try:
            job = json.loads(line)
            GAVE_UP.count = 0
            gold_ok, correct = _check(job["gold"], job["prediction"])
            reply = {"gold_ok": gold_ok, "correct": correct}
            if GAVE_UP.count and not correct:
                reply = {"error": f"math-verify timed out ({INNER_TIMEOUT} s limit)"}
        except Exception as err:  # noqa: BLE001 - report, keep serving
            reply = {"error": f"{type(err).__name__}: {err}"[:300]}
        stdout.write(json.dumps(reply) + "\n")
        stdout.flush()


if __name__ == "__main__":
    _serve(sys.stdin, sys.stdout)
