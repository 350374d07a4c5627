"""The quickstart: a tiny VLM learns a synthetic video-QA task on a CPU, SFT then GRPO.

It generates a video-QA set of moving shapes (direction, count, colour, entry time)
with a held-out split, caches the media, builds a tiny Qwen2.5-VL, runs a short SFT
cold start on part of the training set, evaluates on the held-out split, runs GRPO
from the SFT checkpoint, evaluates again, and writes ``summary.json`` (held-out
accuracy after SFT and after RL, per problem type, seconds) and curve PNGs. The two
phases are the sft and grpo recipes run on the config's ``sft`` and ``grpo`` sections,
filled with what the quickstart generates.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

from omni_rl.config import save_config
from omni_rl.data.dataset import MediaDataset
from omni_rl.demos.quickstart_config import QuickstartConfig, QuickstartData
from omni_rl.engine import checkpoint
from omni_rl.evaluation.pipeline import evaluate_rows
from omni_rl.evaluation.summary import rows_table
from omni_rl.models import load
from omni_rl.preprocess.pipeline import Budgets, preprocess
from omni_rl.preprocess.scenes import write_video_qa
from omni_rl.recipes import grpo, sft
from omni_rl.runtime import apply_run_settings


def split_rows(data: Path, fraction: float, out: Path) -> Path:
    """The first ``fraction`` of the rows, in whole fours (a video's four questions;
    one of each audio kind)."""
    rows = data.read_text().splitlines()
    keep = max(4, int(len(rows) * fraction) // 4 * 4)
    out.write_text("\n".join(rows[:keep]) + "\n")
    return out


def _write_split(d: QuickstartData, out: Path, videos: int, seed: int) -> Path:
    """One split of the synthetic video-QA set; returns its dataset path."""
    return write_video_qa(
        out,
        videos,
        seed,
        d.seconds,
        d.fps,
        d.width,
        d.height,
        blank=d.blank_frames,
        shuffle_options=d.shuffle_options,
        uniform=d.uniform_scenes,
    )


def _held_out(cfg, model_dir: Path, dataset: MediaDataset) -> dict:
    model, processor = load(model_dir)
    return evaluate_rows(
        model, processor, dataset, samples=1, max_new_tokens=cfg.grpo.rollout.max_new_tokens, progress=False
    )


def _filled(cfg, recipe_cfg, run_dir: Path, rows: Path, model_path: str | None = None, **tiny):
    """A recipe's config (``cfg.sft`` or ``cfg.grpo``) with what the quickstart generates
    filled in: its run and media, the tiny model (or ``model_path``; ``tiny``: more
    ``model.tiny_*`` settings), the rows and cache."""
    model = replace(recipe_cfg.model, path=model_path, tiny_family=cfg.media.family, tiny_width=cfg.model.width, **tiny)
    cache = str(Path(cfg.run.output_dir) / "cache")
    data = replace(recipe_cfg.data, train=str(rows), cache=cache, prompt_template=cfg.data.prompt_template)
    run = replace(cfg.run, output_dir=str(run_dir), overwrite=True)  # a rerun of the quickstart starts afresh
    return replace(recipe_cfg, run=run, media=cfg.media, model=model, data=data)


def run_phases(cfg, train: Path, sft_rows: Path, heldout: Path, **tiny) -> tuple[dict, dict]:
    """Cache every split, SFT on ``sft_rows``, evaluate on ``heldout``, GRPO on
    ``train`` from the SFT checkpoint, evaluate again. Returns both evaluations.
    ``cfg`` is a quickstart config (run, media, model, data, sft and grpo sections)."""
    out = Path(cfg.run.output_dir)
    budgets = Budgets.from_config(cfg.media)
    for data in (train, sft_rows, heldout):  # each split gets its cache index (sft's media are train's)
        preprocess(data, out / "cache", budgets, workers=1, progress=False)
    template = cfg.data.prompt_template
    heldout_set = MediaDataset(heldout, budgets, out / "cache", "prefer_cache", prompt_template=template)

    # SFT: a short cold start on part of the training set
    sft.train(_filled(cfg, cfg.sft, out / "sft", sft_rows, **tiny))
    sft_model = checkpoint.latest(out / "sft") / "model"
    after_sft = _held_out(cfg, sft_model, heldout_set)

    # GRPO: from the SFT checkpoint, on the whole training set
    grpo.train(_filled(cfg, cfg.grpo, out / "grpo", train, model_path=str(sft_model), **tiny))
    after_rl = _held_out(cfg, checkpoint.latest(out / "grpo") / "model", heldout_set)
    return after_sft, after_rl


def write_summary(out: Path, after_sft: dict, after_rl: dict, started: float, **extra) -> dict:
    """``summary.json`` (held-out accuracy after SFT and after RL, per problem type and
    data source, ``extra``, seconds), curve PNGs, and both tables printed."""
    summary = {
        "heldout_accuracy_sft": after_sft["accuracy"],
        "heldout_accuracy_rl": after_rl["accuracy"],
        "per_type": {
            t: {"sft": after_sft["per_type"][t], "rl": after_rl["per_type"][t]} for t in after_sft["per_type"]
        },
        "per_source": {
            s: {"sft": after_sft["per_source"][s], "rl": after_rl["per_source"][s]} for s in after_sft["per_source"]
        },
        "heldout_rows": after_rl["rows"],
        **extra,
        "seconds": round(time.perf_counter() - started, 1),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    _plots(out)
    print("held-out after SFT:\n" + rows_table(after_sft))
    print("held-out after RL:\n" + rows_table(after_rl))
    return summary


def begin(cfg) -> tuple[float, Path, dict]:
    """(start time, output directory, runtime settings in force) of a quickstart run:
    the directory made, the resolved config saved in it, threads and CPU kernels set."""
    started = time.perf_counter()
    out = Path(cfg.run.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_config(cfg, out / "config.yaml")
    return started, out, apply_run_settings(cfg.run)


def main(cfg: QuickstartConfig) -> dict:
    """Run the quickstart; returns (and writes) its summary."""
    started, out, runtime = begin(cfg)
    d = cfg.data
    # DATA: synthetic clips with known answers; the held-out split uses other scenes
    train = _write_split(d, out / "data" / "train", d.train_videos, cfg.run.seed)
    heldout = _write_split(d, out / "data" / "heldout", d.heldout_videos, cfg.run.seed + 10_000)
    sft_rows = split_rows(train, d.sft_fraction, train.parent / "sft.jsonl")
    after_sft, after_rl = run_phases(cfg, train, sft_rows, heldout)
    return write_summary(out, after_sft, after_rl, started, blank_frames=d.blank_frames, runtime=runtime)


def _plots(out: Path) -> None:
    from omni_rl.plots import plot_metrics

    for run in ("sft", "grpo"):
        plot_metrics(out / run, out / "plots" / run)
