"""Benchmark the one-step-off rollout against the synchronous one, side by side in one
run, on the same cores.

    python tools/bench_async.py [--steps 12 --threads 2 --width 128 --rounds 3]

The same GRPO config (the video quickstart's GRPO phase until 2026-12-06: a tiny
Qwen2.5-VL, 16-frame clips, 8 prompts of 8 completions of up to 24 tokens, a KL
reference) runs two ways, ``--rounds`` times each, alternating which goes first:
synchronously in one process with ``--threads`` torch threads, and with
``rollout.staleness: 1`` under torchrun as one trainer and one rollout process with
half the threads each (the thread split is printed). Each run's seconds per step are
the trainer's own (``time/step``: its rollout and update, or its wait for the next
batch, its update and the weight push), the median of the steps after the first.
Each round's ratio is printed; the last line is their median,
``one-step-off speedup sync/async = X``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml
from bench_gather_once import TORCHRUN, alternating, free_port

from omni_rl.preprocess.scenes import write_video_qa


def config(root: Path, data: Path, args: argparse.Namespace, staleness: int) -> Path:
    """The quickstart's GRPO settings on ``data``, in fp32, with ``staleness``."""
    raw = {
        "recipe": "grpo",
        "run": {"output_dir": str(root / "run"), "seed": 0, "threads": args.threads // (1 + staleness)},
        "model": {"tiny_family": "qwen2_5_vl", "tiny_width": args.width},
        "data": {"train": str(data), "prompts_per_step": 8},
        "media": {
            "family": "qwen2_5_vl",
            "fps": None,
            "nframes": 16,
            "min_frames": 2,
            "max_frames": 16,
            "video_min_pixels": 3136,
            "video_max_pixels": 3136,
        },
        "rollout": {"n": 8, "max_new_tokens": 24, "staleness": staleness},
        "algorithm": {"kl_coef": 0.05},
        "trainer": {"steps": args.steps, "save_every": 0, "precision": "fp32"},
        "optimizer": {"type": "adamw", "lr": 2.0e-4},
    }
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.yaml").write_text(yaml.safe_dump(raw))
    return root / "config.yaml"


def run(path: Path, processes: int) -> list[dict]:
    """The config's metrics rows, from ``omni_rl train`` in one process or under torchrun."""
    train = ["-m", "omni_rl", "train", str(path)]
    if processes == 1:
        command = [sys.executable, *train]
    else:
        rendezvous = ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}"]
        command = [TORCHRUN, f"--nproc-per-node={processes}", *rendezvous, *train]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"bench_async: the run of {path} failed:\n{done.stderr[-3000:]}")
    return [json.loads(line) for line in (path.parent / "run" / "metrics.jsonl").read_text().splitlines()]


def phases(timed: list[dict]) -> str:
    """The medians of a run's timed phases but the whole step's, for one line."""
    names = sorted({k for x in timed for k in x if k.startswith(("time/", "rollout_process/"))} - {"time/step"})
    return "medians: " + ", ".join(f"{k} {statistics.median(x.get(k, 0.0) for x in timed):.3f}" for k in names)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12, help="GRPO steps per run (the first is not timed)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the synchronous run (even)")
    parser.add_argument("--width", type=int, default=128, help="the tiny model's hidden width")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each side, alternating which goes first")
    args = parser.parse_args()
    if args.threads < 2 or args.threads % 2:
        parser.error("--threads must be even: the one-step-off run splits them between its two processes")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        data = write_video_qa(work / "data", videos=8, seed=0, seconds=2.0)
        rows = {
            (name, r): run(config(work / f"{name}{r}", data, args, int(name == "async")), 1 + (name == "async"))
            for r, name in alternating(("sync", "async"), args.rounds)
        }
    half = args.threads // 2
    print(f"synchronous: 1 process, {args.threads} threads; one-step-off: 1 trainer + 1 rollout process, {half} each")
    ratios = []
    for r in range(args.rounds):
        seconds = {}
        for name in ("sync", "async"):
            timed = rows[name, r][1:]
            seconds[name] = statistics.median(x["time/step"] for x in timed)
            rate = f"{seconds[name]:.3f} s/step ({1 / seconds[name]:.2f} steps/s"
            print(f"round {r + 1} {name:<6} {rate}; {phases(timed)})")
        ratios.append(seconds["sync"] / seconds["async"])
        print(f"round {r + 1}: sync/async {ratios[-1]:.2f}")
    staleness = [x["rollout/staleness"] for x in rows["async", 0]]
    print(f"one-step-off staleness per step: {staleness}")
    print(f"one-step-off speedup sync/async = {statistics.median(ratios):.2f} (median of {args.rounds} rounds)")


if __name__ == "__main__":
    main()
