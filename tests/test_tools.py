"""Small runs of the benchmarks in tools/: they run on the real code paths and print their ratio last."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent


def test_bench_cache_small_run(tmp_path):
    args = [
        "--out",
        str(tmp_path),
        "--videos",
        "2",
        "--seconds",
        "2",
        "--width",
        "320",
        "--height",
        "240",
        "--repeats",
        "1",
    ]
    result = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "bench_cache.py"), *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert any(line.startswith("preprocess, 2 workers:") for line in lines)
    assert lines[-1].startswith("ratio raw/cache: ")
    assert float(lines[-1].split()[2]) > 1.0  # the cache is faster than decoding, even for tiny clips


def test_bench_rewards_small_run():
    tool = ROOT / "tools" / "bench_rewards.py"
    result = subprocess.run(
        [sys.executable, str(tool), "--responses", "500", "--math", "40"], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert lines[-2].startswith("math scores/s: ")
    assert lines[-1].startswith("non-math scores/s on one core: ")
    assert float(lines[-1].split()[-4]) > 0 and float(lines[-2].split()[2]) > 0
