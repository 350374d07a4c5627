"""SIGKILL during `omni-rl preprocess`, then a rerun: the cache verifies and is complete."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from omni_rl.cli import main
from omni_rl.preprocess.cache import MediaCache
from omni_rl.preprocess.image import ImageBudget
from omni_rl.preprocess.pipeline import Budgets, referenced_keys
from omni_rl.preprocess.synthetic import moving_square, write_video
from omni_rl.preprocess.video import VideoBudget

OMNI_RL = str(Path(sys.executable).parent / "omni-rl")


def wait_for_group_to_die(pgid: int, timeout: float = 30) -> None:
    """SIGKILL is delivered asynchronously: wait until no live process is left in the group."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = False
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[-1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                alive = True
                break
        if not alive:
            return
        time.sleep(0.05)
    raise AssertionError(f"process group {pgid} still alive after SIGKILL")


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
def test_sigkill_then_rerun_gives_a_verified_complete_cache(tmp_path, seed):
    rng = random.Random(seed)
    rows = []
    for i in range(40):
        direction = ["left", "right", "up", "down"][i % 4]
        write_video(tmp_path / "m" / f"{i}.mp4", moving_square(direction, 1.0, 20, 320 + 8 * i, 240), 20)
        rows.append({"id": f"r{i}", "problem": "p", "problem_type": "counting", "answer": 1, "videos": [f"m/{i}.mp4"]})
    rows.append({"id": "bad", "problem": "p", "problem_type": "counting", "answer": 1, "videos": ["m/none.mp4"]})
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cache_dir = tmp_path / "cache"
    command = [OMNI_RL, "preprocess", str(data), "--cache", str(cache_dir), "--workers", "2"]

    process = subprocess.Popen(command, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    entries = cache_dir / "entries"
    deadline = time.monotonic() + 120
    target = rng.randint(1, 25)  # kill after a random number of entries
    while time.monotonic() < deadline and process.poll() is None:
        if entries.is_dir() and sum(1 for _ in entries.glob("*/*.safetensors")) >= target:
            break
        time.sleep(0.01)
    time.sleep(rng.uniform(0, 0.05))
    assert process.poll() is None, "the run finished before it could be killed; make the dataset larger"
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    wait_for_group_to_die(process.pid)
    cache = MediaCache(cache_dir)
    partial = len(cache.entry_keys())
    assert 1 <= partial < 40
    assert main(["cache", "verify", str(cache_dir)]) == 0  # nothing half-written is an entry

    assert main(["preprocess", str(data), "--cache", str(cache_dir), "--workers", "2"]) == 0
    assert main(["cache", "verify", str(cache_dir)]) == 0
    budgets = Budgets(VideoBudget(patch_size=14), ImageBudget(patch_size=14))
    keys = referenced_keys(data, budgets, cache)
    assert len(keys) == 40 and keys <= set(cache.entry_keys())
    assert not list(cache_dir.rglob("*.tmp"))
    failures = (cache_dir / "failures.jsonl").read_text().splitlines()
    assert [json.loads(line)["id"] for line in failures] == ["bad"]
