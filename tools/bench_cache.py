"""Benchmark the media cache against decoding raw files, side by side in one run.

    python tools/bench_cache.py [--videos 48 --seconds 10 --fps 30 --width 640 --height 480]
                                [--steps 40 --train-steps 8 --quickstart-clips N]

Measures, on synthetic H.264 clips sampled at 2 fps under a 128x28x28-pixel frame budget:
  1. preprocessing throughput (videos/s) with 1 and 2 workers, each into a fresh cache;
  2. reading cached entries into tensors (bytes/s; every byte copied out of the memory
     map) as a fraction of a plain memory copy of the same bytes (page cache warm);
  3. the median time to build one sample's media, and its model inputs (media and the
     tiny Qwen2.5-VL processor), from the raw file vs from the cache, and its model
     inputs read from the cache's inputs entry (``MediaDataset.encoded`` with
     ``inputs``: what the processor returned, cached by ``cache_inputs``): the model
     inputs ratio, raw file over inputs entry.
Then, on the quickstart's own data (its training split and media settings, its tiny
model's processor), the median time to draw and encode one GRPO step's prompts as the
recipe does (``dataset.encoded`` for each drawn row) with ``cache_mode`` no_cache,
prefer_cache on a preprocessed cache, and prefer_cache with inputs entries; and the
median time of whole GRPO steps (rollout, reward, update) of the quickstart's GRPO
phase on its tiny model, the three ways. The last line is the whole step's ratio,
``cache speedup raw/cache = X``, raw files over the cache with inputs entries.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from omni_rl.data.dataset import MediaDataset, encode_sample
from omni_rl.data.sampler import PromptSampler
from omni_rl.demos.quickstart import _filled
from omni_rl.demos.quickstart_config import QuickstartConfig
from omni_rl.models import build_tiny, load
from omni_rl.preprocess.cache import MediaCache
from omni_rl.preprocess.image import ImageBudget
from omni_rl.preprocess.motion import write_motion_qa
from omni_rl.preprocess.pipeline import Budgets, preprocess
from omni_rl.preprocess.scenes import random_scene, render
from omni_rl.preprocess.synthetic import write_video
from omni_rl.preprocess.video import VideoBudget
from omni_rl.recipes import grpo
from omni_rl.runtime import set_threads


def make_videos(root: Path, n: int, seconds: float, fps: int, width: int, height: int) -> Path:
    """``n`` scene clips and a dataset row for each, in a folder of ``root`` named by the
    clips' settings (a clip is reused when already there: one of other settings never is).
    Returns the rows' JSONL."""
    import json

    root = root / f"{width}x{height}_{fps}fps_{seconds:g}s"
    rng = np.random.default_rng(0)
    rows = []
    for i in range(n):
        name = f"media/clip_{i:03d}.mp4"
        objects = random_scene(rng, seconds, width, height)
        if not (root / name).is_file():
            write_video(root / name, render(objects, seconds, fps, width, height), fps)
        rows.append(
            {
                "id": f"clip{i}",
                "problem": "How many shapes?",
                "problem_type": "counting",
                "answer": len(objects),
                "videos": [name],
            }
        )
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return data


def time_preprocess(data: Path, cache: Path, budgets: Budgets, workers: int) -> float:
    shutil.rmtree(cache, ignore_errors=True)
    report = preprocess(data, cache, budgets, workers=workers, progress=False)
    assert report.failed == 0, report.failures_by_reason
    return report.cached / report.seconds


def read_fraction_of_memcpy(cache_dir: Path, repeats: int = 3) -> tuple[float, float]:
    """(bytes/s reading every entry into tensors, bytes/s copying the same bytes in memory).

    Both copy into the same pre-faulted buffers; the reads come out of the entries'
    memory maps (page cache warm), the copies out of tensors already in memory.
    """
    cache = MediaCache(cache_dir)
    keys = cache.entry_keys()
    sources = [cache.read(k).tensors["frames"].clone() for k in keys]  # also warms the page cache
    buffers = [torch.zeros_like(t) for t in sources]
    total = sum(t.numel() * t.element_size() for t in sources)
    read_times, copy_times = [], []
    for _ in range(repeats):
        started = time.perf_counter()
        for key, buffer in zip(keys, buffers, strict=True):
            buffer.copy_(cache.read(key).tensors["frames"])
        read_times.append(time.perf_counter() - started)
        started = time.perf_counter()
        for buffer, source in zip(buffers, sources, strict=True):
            buffer.copy_(source)
        copy_times.append(time.perf_counter() - started)
    return total / min(read_times), total / min(copy_times)


def median_seconds(dataset: MediaDataset, processor, repeats: int) -> tuple[float, float]:
    """Median seconds per sample for (media only, model inputs = media + processor)."""
    media, inputs = [], []
    for _ in range(repeats):
        for index in range(len(dataset)):
            started = time.perf_counter()
            sample = dataset[index]
            media.append(time.perf_counter() - started)
            encode_sample(processor, sample)
            inputs.append(time.perf_counter() - started)
    return statistics.median(media), statistics.median(inputs)


def encoded_seconds(dataset: MediaDataset, processor, repeats: int) -> float:
    """Median seconds per sample of its model inputs as training reads them
    (``dataset.encoded``: from the inputs entries where ``dataset.inputs`` is set)."""
    seconds = []
    for _ in range(repeats):
        for index in range(len(dataset)):
            started = time.perf_counter()
            dataset.encoded(index, processor)
            seconds.append(time.perf_counter() - started)
    return statistics.median(seconds)


def step_seconds(dataset: MediaDataset, processor, steps: int, prompts_per_step: int, seed: int) -> tuple[float, float]:
    """Median seconds per step for (media only, model inputs as training reads them) of
    one step's drawn prompts (the same rows for any dataset of the same file and seed)."""
    sampler = PromptSampler(len(dataset), seed)
    media, inputs = [], []
    for _ in range(steps):
        indices = sampler.next_batch(prompts_per_step)
        started = time.perf_counter()
        for index in indices:
            dataset[index]
        media.append(time.perf_counter() - started)
        started = time.perf_counter()
        for index in indices:
            dataset.encoded(index, processor)
        inputs.append(time.perf_counter() - started)
    return statistics.median(media), statistics.median(inputs)


def quickstart_steps(cfg: QuickstartConfig, out: Path, steps: int, clips: int | None) -> dict[str, tuple[float, float]]:
    """Median seconds per GRPO step of the quickstart's data, (media only, model inputs),
    from raw files and from the cache; ``clips``: clips in its training split (default:
    the quickstart's)."""
    clips = clips or cfg.data.train_clips
    train = write_motion_qa(out / "data" / "train", clips, cfg.run.seed, kinds=tuple(cfg.data.kinds))  # its own writer
    budgets = Budgets.from_config(cfg.media)
    shutil.rmtree(out / "cache", ignore_errors=True)
    report = preprocess(train, out / "cache", budgets, workers=1, progress=False)
    assert report.failed == 0, report.failures_by_reason
    _, processor = load(build_tiny(cfg.media.family, out / "tiny_model", width=cfg.model.width))
    per_step, seed = cfg.grpo.data.prompts_per_step, cfg.run.seed
    template = cfg.data.prompt_template
    raw_set = MediaDataset(train, budgets, cache_mode="no_cache", prompt_template=template)
    cached_set = MediaDataset(train, budgets, out / "cache", "prefer_cache", prompt_template=template)
    inputs_set = MediaDataset(train, budgets, out / "cache", "prefer_cache", prompt_template=template, inputs="float32")
    inputs_set.cache_inputs(processor)  # what omni-rl preprocess --config writes for a fp32 run
    step_seconds(cached_set, processor, 2, per_step, seed + 1)  # warm the page cache and the processor
    times = {
        "raw": step_seconds(raw_set, processor, steps, per_step, seed),
        "cache": step_seconds(cached_set, processor, steps, per_step, seed),
        "inputs": step_seconds(inputs_set, processor, steps, per_step, seed),
    }
    assert cached_set.cache_misses == 0, "the quickstart's cache should hold every drawn row"
    assert inputs_set.inputs_misses == 0, "the quickstart's cache should hold every drawn row's model inputs"
    return times, train


def quickstart_train_seconds(cfg: QuickstartConfig, out: Path, train: Path, steps: int) -> dict[str, float]:
    """Median seconds per whole GRPO step (rollout, reward, update) of the quickstart's
    GRPO phase on its tiny model (the one ``quickstart_steps`` wrote the inputs entries
    with), reading raw files (``no_cache``), the cache's media (``prefer_cache``) and its
    media and model inputs (``inputs``); the first step (warm-up) is left out."""
    cfg = replace(cfg, run=replace(cfg.run, output_dir=str(out)))
    seconds = {}
    for name, mode, inputs in (
        ("no_cache", "no_cache", False),
        ("cache", "prefer_cache", False),
        ("inputs", "prefer_cache", True),
    ):
        run = _filled(cfg, cfg.grpo, out / f"grpo_{name}", train, model_path=str(out / "tiny_model"))
        run = replace(
            run,
            data=replace(run.data, cache_mode=mode, cache_inputs=inputs),
            trainer=replace(run.trainer, steps=steps + 1, save_every=0, log_every=1),
        )
        grpo.train(run)
        rows = [json.loads(line) for line in (out / f"grpo_{name}" / "metrics.jsonl").read_text().splitlines()]
        read = rows[-1]["data/inputs_hits"], rows[-1]["data/inputs_misses"]
        assert read[0] > 0 and read[1] == 0 if inputs else read == (0, 0), f"{name}: model inputs read, encoded: {read}"
        seconds[name] = statistics.median(r["time/step"] for r in rows[1:])
    return seconds


def real_size_steps(data: Path, out: Path, frames: int, pixels: int, widths: list[int], steps: int) -> dict:
    """Median seconds per whole GRPO step (rollout, reward, update) on the real-size clips,
    ``frames`` frames of ``pixels`` each, for a tiny Qwen2.5-VL of each decoder width
    (4 prompts, G = 4, 16 new tokens): reading raw files, the media entries, and the
    media and inputs entries; the first step (warm-up) is left out.
    Returns {width: {mode: seconds}}."""
    from omni_rl.data.config import DataConfig
    from omni_rl.engine.config import TrainerConfig
    from omni_rl.models.config import ModelConfig
    from omni_rl.preprocess.config import MediaConfig
    from omni_rl.recipes.common import write_model_inputs
    from omni_rl.recipes.grpo_config import GRPOConfig
    from omni_rl.rollout.config import RolloutConfig
    from omni_rl.runtime import RunConfig

    media = MediaConfig(nframes=frames, fps=None, max_frames=frames, video_min_pixels=pixels, video_max_pixels=pixels)
    cache = out / "cache"
    shutil.rmtree(cache, ignore_errors=True)
    report = preprocess(data, cache, Budgets.from_config(media), workers=2, progress=False)
    assert report.failed == 0, report.failures_by_reason
    modes = (("raw", "no_cache", False), ("media", "prefer_cache", False), ("inputs", "prefer_cache", True))
    seconds: dict[int, dict[str, float]] = {}
    for width in widths:
        model = build_tiny("qwen2_5_vl", out / f"model_{width}", width=width)
        seconds[width] = {}
        for name, mode, inputs in modes:
            run_dir = out / f"grpo_{width}_{name}"
            cfg = GRPOConfig(
                run=RunConfig(name="bench", output_dir=str(run_dir), seed=0, device="cpu", overwrite=True),
                model=ModelConfig(path=str(model)),
                data=DataConfig(
                    train=str(data), cache=str(cache), cache_mode=mode, cache_inputs=inputs, prompts_per_step=4
                ),
                media=media,
                rollout=RolloutConfig(n=4, max_new_tokens=16),
                trainer=TrainerConfig(steps=steps + 1, log_every=1, save_every=0, precision="fp32"),
            )
            if inputs:
                write_model_inputs(cfg, data, cache, torch.device("cpu"), progress=False)
            grpo.train(cfg)
            rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
            read = rows[-1]["data/inputs_hits"], rows[-1]["data/inputs_misses"]
            assert read[0] > 0 and read[1] == 0 if inputs else read == (0, 0), f"{name}: inputs read, encoded: {read}"
            seconds[width][name] = statistics.median(r["time/step"] for r in rows[1:])
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/bench_cache"))
    parser.add_argument("--videos", type=int, default=48)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--fps", type=int, default=30)
    parser.add_argument("--width", type=int, default=640)
    parser.add_argument("--height", type=int, default=480)
    parser.add_argument("--threads", type=int, default=1, help="torch threads in this process")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40, help="GRPO steps of quickstart data timed per mode")
    parser.add_argument("--train-steps", type=int, default=8, help="whole GRPO steps timed per mode")
    parser.add_argument("--quickstart-clips", type=int, default=None, help="clips (default: the quickstart's)")
    parser.add_argument("--real-frames", type=int, default=64, help="frames of the real-size clips' GRPO steps")
    parser.add_argument("--real-widths", default="64,256", help="decoder widths of the tiny models those steps train")
    parser.add_argument("--real-steps", type=int, default=4, help="whole GRPO steps timed per width and mode")
    args = parser.parse_args()
    set_threads(args.threads)

    data = make_videos(args.out / "data", args.videos, args.seconds, args.fps, args.width, args.height)
    frame_pixels = 128 * 28 * 28
    budgets = Budgets(
        video=VideoBudget(patch_size=14, fps=2.0, min_pixels=frame_pixels, max_pixels=frame_pixels),
        image=ImageBudget(),
    )
    cache = args.out / "cache"
    one = time_preprocess(data, cache, budgets, workers=1)
    two = time_preprocess(data, cache, budgets, workers=2)
    read_bps, copy_bps = read_fraction_of_memcpy(cache)

    _, processor = load(build_tiny("qwen2_5_vl", args.out / "tiny_model"))
    raw_media, raw = median_seconds(MediaDataset(data, budgets, cache_mode="no_cache"), processor, args.repeats)
    cached_media, cached = median_seconds(MediaDataset(data, budgets, cache, "cache_only"), processor, args.repeats)
    inputs_set = MediaDataset(data, budgets, cache, "cache_only", inputs="float32")
    inputs_set.cache_inputs(processor, progress=False)
    from_inputs = encoded_seconds(inputs_set, processor, args.repeats)
    assert inputs_set.inputs_misses == 0

    print(f"videos: {args.videos} x {args.seconds:g} s, {args.fps} fps, {args.width}x{args.height}, H.264")
    print(f"preprocess, 1 worker:      {one:8.2f} videos/s")
    print(f"preprocess, 2 workers:     {two:8.2f} videos/s")
    print(f"cache read:                {read_bps / 1e9:8.2f} GB/s")
    print(f"memory copy:               {copy_bps / 1e9:8.2f} GB/s")
    print(f"read / memcpy:             {read_bps / copy_bps:8.2f}  (target >= 0.3)")
    print(f"media from raw file:       {raw_media * 1e3:8.1f} ms (median; decode, sample, resize)")
    print(f"media from cache:          {cached_media * 1e3:8.1f} ms (median; index lookup, map entry)")
    print(f"media ratio raw/cache:     {raw_media / cached_media:8.1f}")
    print(f"sample from raw file:      {raw * 1e3:8.1f} ms (median; media + processor)")
    print(f"sample from cache:         {cached * 1e3:8.1f} ms (median)")
    print(f"sample ratio raw/cache:    {raw / cached:8.2f}")
    print(f"inputs from cache entries: {from_inputs * 1e3:8.1f} ms (median; media + the processor's cached output)")
    print(f"model inputs raw/cache:    {raw / from_inputs:8.1f}  (target >= 20)")

    widths = [int(w) for w in args.real_widths.split(",")]
    real = real_size_steps(data, args.out / "real", args.real_frames, frame_pixels, widths, args.real_steps)
    print(
        f"real-size clips, {args.real_frames} frames of {frame_pixels:,} pixels, "
        f"whole GRPO step (median of {args.real_steps}):"
    )
    for width, times in real.items():
        print(
            f"  width {width:4d}: raw {times['raw']:7.3f} s, media entries {times['media']:7.3f} s, "
            f"inputs entries {times['inputs']:7.3f} s; raw/inputs {times['raw'] / times['inputs']:5.2f}"
        )

    quickstart = QuickstartConfig()
    steps, train = quickstart_steps(quickstart, args.out / "quickstart", args.steps, args.quickstart_clips)
    whole = quickstart_train_seconds(quickstart, args.out / "quickstart", train, args.train_steps)
    (raw_media, raw_step), (cached_media, cached_step) = steps["raw"], steps["cache"]
    inputs_step = steps["inputs"][1]
    per_step = quickstart.grpo.data.prompts_per_step
    print(f"quickstart data, GRPO steps of {per_step} prompts, median of {args.steps} steps:")
    print(f"step media from raw files: {raw_media:8.4f} s (no_cache)")
    print(f"step media from cache:     {cached_media:8.4f} s (prefer_cache)")
    print(f"step from raw files:       {raw_step:8.4f} s (media + processor)")
    print(f"step from cache:           {cached_step:8.4f} s (media + processor)")
    print(f"step from inputs entries:  {inputs_step:8.4f} s (media + cached processor output)")
    print(f"data speedup raw/cache:    {raw_step / cached_step:8.2f} (media entries)")
    print(f"data speedup raw/inputs:   {raw_step / inputs_step:8.2f} (media and inputs entries)")
    print(f"whole GRPO step, raw:      {whole['no_cache']:8.4f} s (median of {args.train_steps} steps)")
    print(f"whole GRPO step, cache:    {whole['cache']:8.4f} s (media)")
    print(f"whole GRPO step, inputs:   {whole['inputs']:8.4f} s (media and model inputs)")
    print(f"cache speedup raw/cache = {whole['no_cache'] / whole['inputs']:.2f}")


if __name__ == "__main__":
    main()
