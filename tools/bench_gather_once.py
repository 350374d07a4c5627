"""Benchmark a rollout that gathers FSDP2's weights once against one that gathers them
for every decoded token, side by side in one run.

    python tools/bench_gather_once.py [--steps 4 --tokens 32 --width 128 --processes 2 --rounds 3]

Runs the same GRPO config under torchrun over gloo, FSDP2 on a tiny Qwen2.5-VL
(``model.tiny_width``), with only ``rollout.gather_once`` changed, ``--rounds`` times
each side, alternating which goes first (once, per-token; per-token, once; ...). It
reads each run's metrics: the bytes gathered into a rank per decoded token after the
prefill, the bytes a step's rollouts gathered in all, and the median rollout time of
the steps after the first. The runs must agree on every other metric (the same tokens,
rewards and losses); the tool says so or fails. Each round's ratio is printed; the last
line is their median, ``gather once speedup per-token/once = X``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from omni_rl.preprocess.scenes import write_video_qa

TORCHRUN = str(Path(sys.executable).parent / "torchrun")
GATHERS = ("once", "per_token")  # the two sides: rollout.gather_once true, false
GATHER_KEYS = ("rollout/gathered_bytes", "rollout/gathered_bytes_per_token")


def config(root: Path, data: Path, args: argparse.Namespace, gather_once: bool) -> Path:
    """A small GRPO config on ``data``, FSDP2 in fp32, ``rollout.gather_once`` set."""
    raw = {
        "recipe": "grpo",
        "run": {"output_dir": str(root / "run"), "seed": 0, "threads": 1},
        "model": {"tiny_family": "qwen2_5_vl", "tiny_width": args.width},
        "data": {"train": str(data), "prompts_per_step": 2 * args.processes},
        "media": {
            "family": "qwen2_5_vl",
            "min_frames": 2,
            "max_frames": 4,
            "video_min_pixels": 3136,
            "video_max_pixels": 6272,
        },
        "rollout": {"n": 4, "max_new_tokens": args.tokens, "gather_once": gather_once},
        "algorithm": {"epochs": 1, "mini_batch_prompts": 0},
        "trainer": {"steps": args.steps, "save_every": 0, "strategy": "fsdp", "precision": "fp32"},
        "optimizer": {"type": "adamw", "lr": 1.0e-4},
    }
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.yaml").write_text(yaml.safe_dump(raw))
    return root / "config.yaml"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(path: Path, processes: int) -> list[dict]:
    """The config's metrics rows, from ``torchrun -m omni_rl train``."""
    rendezvous = ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}"]
    command = [TORCHRUN, f"--nproc-per-node={processes}", *rendezvous, "-m", "omni_rl", "train", str(path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMNI_RL_THREADS": "1"}
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"bench_gather_once: the run of {path} failed:\n{done.stderr[-3000:]}")
    lines = (path.parent / "run" / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def alternating(sides: tuple[str, str], rounds: int) -> list[tuple[int, str]]:
    """(round, side) in run order: the first side leads in even rounds, the second in
    odd ones, so that the machine's drift falls on both sides alike."""
    return [(r, side) for r in range(rounds) for side in (sides if r % 2 == 0 else sides[::-1])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4, help="GRPO steps per run (the first is not timed)")
    parser.add_argument("--tokens", type=int, default=32, help="rollout.max_new_tokens")
    parser.add_argument("--width", type=int, default=128, help="the tiny model's hidden width")
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3, help="runs of each side, alternating which goes first")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        data = write_video_qa(work / "data", videos=4, seed=0, seconds=2.0)
        rows = {
            (name, r): run(config(work / f"{name}{r}", data, args, name == "once"), args.processes)
            for r, name in alternating(GATHERS, args.rounds)
        }
    first = rows["once", 0]
    for metrics in rows.values():
        for a, b in zip(first, metrics, strict=True):
            same = {k for k in a if not k.startswith(("time/", "throughput/")) and k not in GATHER_KEYS}
            if any(a[k] != b.get(k) for k in same):
                sys.exit("bench_gather_once: the runs differ beyond their gathers and timings")
    print(f"the {len(rows)} runs agree on every metric but their gathers and timings")
    for name in GATHERS:
        last = rows[name, 0][-1]
        print(
            f"{name:<10} gathered per decoded token {last['rollout/gathered_bytes_per_token'] / 2**20:8.2f} MiB, "
            f"per step's rollouts {last['rollout/gathered_bytes'] / 2**20:8.2f} MiB"
        )
    ratios = []
    for r in range(args.rounds):
        seconds = {name: statistics.median(x["time/rollout"] for x in rows[name, r][1:]) for name in GATHERS}
        ratios.append(seconds["per_token"] / seconds["once"])
        print(
            f"round {r + 1}: rollout once {seconds['once']:.3f} s, per token {seconds['per_token']:.3f} s "
            f"(medians of steps 2-{args.steps}): {ratios[-1]:.2f}"
        )
    print(f"gather once speedup per-token/once = {statistics.median(ratios):.2f} (median of {args.rounds} rounds)")


if __name__ == "__main__":
    main()
