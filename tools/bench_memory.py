"""Peak memory of one GRPO update on a long video prompt: omni_rl against the peer way.

The model is a random-init Qwen2.5-VL with the 3B model's widths and real vocabulary
(151,936), cut to a few decoder layers and vision blocks (tools/random_model.py); its
vision block attends within windows, as 28 of the 3B model's 32 do (a full-attention
block over 4,400 patches would make CPU SDPA materialize [16, 4400, 4400] scores per
video, which no GPU kernel keeps, and would dominate both sides' figures). The
workload is one GRPO update for one video prompt of about 1,000 visual tokens and G
completions of 64 tokens: the old log-probs (no gradient), then the gradient pass
(clipped policy loss, backward) and the AdamW step. It runs

- omni: ``omni_rl.models.forward.group_forward``, the recipe's forward: the prompt and
  its video once per group, its keys held once, logits only at completion tokens in
  chunks, the tied weight's (the 3B shape ties its head) gradients added in place into
  one as ``TrainingEngine`` has it in one process (``forward.accumulate_in_place``);
- peer: each completion forwarded with its own copy of the prompt and video, logits
  kept over the completion tokens only (TRL's way), via ``full_forward``;

peer at G=8 and omni at G=4, 8 and 16, each in its own process. The figure is the peak
above the set-up (model, gradients' first allocation and AdamW state all made before
measuring): on CUDA the allocator's peak, on CPU the resident set's high-water mark
(reset through /proc/self/clear_refs before each phase). Last line:
``memory peer/omni = X`` at G=8.

    python tools/bench_memory.py [--layers 2] [--vision-depth 1] [--device cpu]
    python tools/bench_memory.py --device cuda --model runs/gpu_check/model --frames 64 \
        --checkpointing --runs omni:8,peer:8
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
MIB = 2**20


def _rss_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


class Peak:
    """Peak memory of a phase above the memory in use when the phase started."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def start(self) -> int:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            return torch.cuda.memory_allocated()
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
        return _rss_bytes("VmRSS")

    def peak(self) -> int:
        if self.cuda:
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated()
        return _rss_bytes("VmHWM")


def _video_prompt(processor, frames: int, size: int):
    from omni_rl.models.inputs import encode_prompts
    from omni_rl.preprocess.video import VideoClip

    pixels = np.random.default_rng(0).integers(0, 256, (frames, 3, size, size), dtype=np.uint8)
    clip = VideoClip(pixels, fps=2.0, total_frames=frames, indices=list(range(frames)), original_size=(size, size))
    messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What moves, and where?"}]}]
    return dict(encode_prompts(processor, [messages], videos=[clip]))


def child(args) -> None:
    """One configuration, in this process: prints one JSON line."""
    from omni_rl.algorithms.losses import clipped_policy_loss
    from omni_rl.models import load
    from omni_rl.models.forward import accumulate_in_place, full_forward, group_forward, tied_head
    from omni_rl.models.inputs import collate_prompts

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model, processor = load(args.model, device=device, dtype=torch.float32)
    if args.checkpointing:
        model.gradient_checkpointing_enable({"use_reentrant": False})
    model.train()
    if args.mode == "omni" and (tied := tied_head(model)) is not None:
        accumulate_in_place(tied)  # as TrainingEngine does in one process
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    for p in model.parameters():  # AdamW's state and the gradients exist before measuring
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)
    pad = processor.tokenizer.pad_token_id
    prompt = _video_prompt(processor, args.frames, args.size)
    g = args.group
    inputs = collate_prompts([prompt] * (g if args.mode == "peer" else 1), pad)
    inputs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (g, args.new_tokens), generator=generator).to(device)
    mask = torch.ones_like(ids)
    advantages = torch.randn(g, generator=generator).sign().to(device)

    def logp():
        with torch.autocast(device.type, dtype=dtype, enabled=device.type == "cuda"):
            if args.mode == "peer":
                return full_forward(model, inputs, ids, mask).logp
            return group_forward(model, inputs, ids, mask, g).logp

    def gradient_pass():
        loss, _ = clipped_policy_loss(logp(), old, advantages, mask)
        loss.backward()

    peak = Peak(device)
    phases = {}
    prompt_tokens = int(inputs["input_ids"].shape[1])
    report = {"mode": args.mode, "group": g, "prompt_tokens": prompt_tokens, "phases": phases}
    old = None
    steps = (
        ("old_logprobs", lambda: torch.no_grad()(logp)()),
        ("gradient", gradient_pass),
        ("step", optimizer.step),
    )
    try:
        for name, run in steps:
            base = peak.start()
            start = time.perf_counter()
            result = run()
            if name == "old_logprobs":
                old = result
            top = peak.peak()  # on CUDA: after the phase's kernels end, then its time
            phases[name] = {"s": time.perf_counter() - start, "peak_mib": (top - base) / MIB}
    except torch.OutOfMemoryError:
        report["oom"] = True
    print(json.dumps(report))


def run_child(args, mode: str, group: str) -> dict:
    command = [
        sys.executable,
        __file__,
        "--child",
        mode,
        "--group",
        group,
        "--model",
        str(args.model),
        "--frames",
        str(args.frames),
        "--size",
        str(args.size),
        "--new-tokens",
        str(args.new_tokens),
        "--threads",
        str(args.threads),
        "--device",
        args.device,
        *(["--checkpointing"] if args.checkpointing else []),
    ]
    # a fixed mmap threshold: glibc returns a freed block of 128 KiB or more to the system,
    # where its default raises the threshold as blocks are freed and keeps them resident,
    # so that a phase reusing the previous phase's freed pages read low by their size
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}
    out = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env)
    if out.returncode:
        raise SystemExit(f"{mode} G={group} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=2, help="decoder layers of the 3B-shaped model")
    parser.add_argument("--vision-depth", type=int, default=1, help="vision blocks")
    parser.add_argument("--frames", type=int, default=8, help="video frames (2 per temporal patch)")
    parser.add_argument("--size", type=int, default=448, help="frame side in pixels (a multiple of 28)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--checkpointing", action="store_true", help="gradient checkpointing (real-size runs)")
    parser.add_argument(
        "--runs", default="peer:8,omni:4,omni:8,omni:16", help="configurations MODE:G, each in its own process"
    )
    parser.add_argument("--model", type=Path, help="a checkpoint from tools/random_model.py (default: built here)")
    parser.add_argument("--child", choices=("omni", "peer"), help=argparse.SUPPRESS)
    parser.add_argument("--group", type=int, default=8, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        args.mode = args.child
        return child(args)
    with tempfile.TemporaryDirectory() as tmp:
        if args.model is None:
            args.model = Path(tmp) / "model"
            build = [sys.executable, str(ROOT / "tools/random_model.py"), "--shape", "3b", "--dtype", "float32"]
            build += ["--layers", str(args.layers), "--vision-depth", str(args.vision_depth), "--out", str(args.model)]
            build += ["--full-attention-blocks", "none"]
            subprocess.run(build, check=True, cwd=ROOT)
        runs = [run_child(args, *run.split(":")) for run in args.runs.split(",")]
    tokens = runs[0]["prompt_tokens"]
    print(f"prompt tokens {tokens}, {args.new_tokens} new tokens per completion, device {args.device}")
    print(f"{'config':<12}{'phase':<14}{'seconds':>9}{'peak MiB':>10}")
    for r in runs:
        name = f"{r['mode']} G={r['group']}"
        for phase, v in r["phases"].items():
            print(f"{name:<12}{phase:<14}{v['s']:>9.2f}{v['peak_mib']:>10.0f}")
        if r.get("oom"):
            print(f"{name:<12}out of memory")
        else:  # sequence tokens (prompt plus completion, per completion) through both forwards
            seconds = r["phases"]["old_logprobs"]["s"] + r["phases"]["gradient"]["s"]
            print(f"{name:<12}{'tokens/s':<14}{r['group'] * (tokens + args.new_tokens) / seconds:>9.0f}")
    peaks = {
        (r["mode"], r["group"]): max(v["peak_mib"] for v in r["phases"].values()) for r in runs if not r.get("oom")
    }
    if ("omni", 4) in peaks and ("omni", 16) in peaks:
        growth = peaks["omni", 16] / peaks["omni", 4] - 1
        print(f"omni peak G=4 {peaks['omni', 4]:.0f} MiB, G=16 {peaks['omni', 16]:.0f} MiB: +{100 * growth:.0f}%")
    both = sorted({g for m, g in peaks if m == "peer"} & {g for m, g in peaks if m == "omni"})
    if both:  # the largest G both ways ran at
        g = both[-1]
        print(f"peak at G={g}: peer {peaks['peer', g]:.0f} MiB, omni {peaks['omni', g]:.0f} MiB")
        print(f"memory peer/omni = {peaks['peer', g] / peaks['omni', g]:.2f}")


if __name__ == "__main__":
    main()
