"""Small runs of the benchmarks in tools/: they run on the real code paths and print their ratio last."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent


def run_tool(name: str, args: list[str], cwd: Path = ROOT, timeout: int = 600) -> list[str]:
    """Run tools/NAME with ARGS; its stdout lines (it must exit 0)."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "tools" / name), *args], capture_output=True, text=True, timeout=timeout, cwd=cwd
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.strip().splitlines()


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
        "--steps",
        "3",
        "--train-steps",
        "1",
        "--quickstart-clips",
        "4",
        "--real-frames",
        "4",
        "--real-widths",
        "64",
        "--real-steps",
        "1",
    ]
    lines = run_tool("bench_cache.py", args, cwd=tmp_path)
    (real,) = [line for line in lines if line.startswith("  width   64: raw ")]
    assert float(real.split()[-1]) > 0  # the real-size steps ran all three ways
    assert any(line.startswith("preprocess, 2 workers:") for line in lines)
    assert any(line.startswith("sample ratio raw/cache:") for line in lines)
    (data,) = [line for line in lines if line.startswith("data speedup raw/cache:")]
    assert float(data.split()[3]) > 1.0  # a step's inputs: the cache beats decoding, even for tiny clips
    (data,) = [line for line in lines if line.startswith("data speedup raw/inputs:")]
    assert float(data.split()[3]) > 1.0  # and with the processor's output cached too
    (sample,) = [line for line in lines if line.startswith("model inputs raw/cache:")]
    assert float(sample.split()[3]) > 1.0
    # the whole step (one timed step here: model time dominates, so only its presence is checked)
    assert lines[-1].startswith("cache speedup raw/cache = ") and float(lines[-1].split()[-1]) > 0


def test_bench_rewards_small_run():
    lines = run_tool("bench_rewards.py", ["--responses", "500", "--math", "40"])
    assert lines[-2].startswith("math scores/s: ")
    assert lines[-1].startswith("non-math scores/s on one core: ")
    assert float(lines[-1].split()[-4]) > 0 and float(lines[-2].split()[2]) > 0


def test_bench_memory_small_run(tmp_path, tiny_checkpoint):
    """Both ways on a tiny model and a short clip: each configuration in its own process,
    the phase table, and the ratio last."""
    args = ["--model", str(tiny_checkpoint("qwen2_5_vl")), "--frames", "4", "--size", "56"]
    args += ["--new-tokens", "4", "--threads", "1", "--runs", "peer:2,omni:2"]
    lines = run_tool("bench_memory.py", args)
    for config in ("peer G=2", "omni G=2"):
        assert any(line.startswith(config) and "gradient" in line for line in lines)
        assert any(line.startswith(config) and "tokens/s" in line for line in lines)
    assert lines[-1].startswith("memory peer/omni = ")


def test_bench_vs_trl_small_run():
    """One warm-up and one measured step per side, alternating, and one video pass."""
    args = ["--steps", "1", "--warmup", "1", "--video-reps", "1", "--width", "64"]
    lines = run_tool("bench_vs_trl.py", args, timeout=900)
    assert any(line.startswith("video shared vs naive forward+backward: naive/shared = ") for line in lines)
    assert any(
        "its update read the rollout's prefill in 1 of 1 measured steps, its rollout ran in inference mode in 1" in line
        for line in lines
    )
    assert lines[-1].startswith("ratio trl/omni = ")


def test_bench_sim_small_run():
    """Two ManiSkill CPU envs, one timed round: at the CPU config's mini-batch size (26
    chunks) two envs take one mini-batch an epoch; the config's own count is timed too."""
    lines = run_tool("bench_sim.py", ["--envs", "2", "--rounds", "1"])
    assert lines[0].endswith("8 envs, 8 epochs of 4 mini-batches of about 26 chunks")
    (row,) = [line for line in lines if line.startswith("N=2: random actions ")]
    assert "(ppo.minibatches=1)" in row and "(ppo.minibatches=4)" in row
    assert lines[-1].startswith("ratio (training loop / random stepping), the config's mini-batch size: N=2 ")
    assert float(lines[-1].split("N=2 ")[1].split()[0]) > 0


def test_bench_sim_camera_rows():
    """One camera env, one timed round of each: rendering once a 4-step chunk is faster
    than rendering every step."""
    lines = run_tool("bench_sim.py", ["--camera", "16", "--envs", "1", "--rounds", "1"])
    (row,) = [line for line in lines if line.startswith("N=1: state ")]
    rates = [float(part.split()[-1]) for part in row.split(" env steps/s")[0:1]]
    every, chunk = (float(row.split(name)[1].split()[0].rstrip(",")) for name in ("every step ", "once a chunk "))
    assert rates[0] > 0 and chunk > every > 0, row


def test_bench_cache_makes_clips_of_the_settings_asked_for(tmp_path):
    """A second run with other clip settings into the same --out gets clips of its own
    settings, not the first run's (10 s clips sampled at 64 frames met 2 s ones there)."""
    import av

    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import bench_cache
    finally:
        sys.path.remove(str(ROOT / "tools"))

    def frames(data: Path) -> list[int]:
        rows = [json.loads(line) for line in data.read_text().splitlines()]
        counts = []
        for row in rows:
            with av.open(str(data.parent / row["videos"][0])) as container:
                counts.append(sum(1 for _ in container.decode(video=0)))
        return counts

    assert frames(bench_cache.make_videos(tmp_path, 2, 1.0, 8, 64, 48)) == [8, 8]
    assert frames(bench_cache.make_videos(tmp_path, 2, 2.0, 8, 64, 48)) == [16, 16]
    assert frames(bench_cache.make_videos(tmp_path, 2, 1.0, 8, 64, 48)) == [8, 8]  # the first clips, reused


def test_the_ab_benches_alternate_which_side_goes_first():
    """bench_async and bench_gather_once run each side --rounds times, the other side
    first in every other round, so that a slow stretch of the machine falls on both."""
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        from bench_gather_once import alternating
    finally:
        sys.path.remove(str(ROOT / "tools"))
    assert alternating(("a", "b"), 3) == [(0, "a"), (0, "b"), (1, "b"), (1, "a"), (2, "a"), (2, "b")]
    assert alternating(("a", "b"), 1) == [(0, "a"), (0, "b")]
