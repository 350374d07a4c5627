"""The quickstart: a tiny VLM learns a synthetic video-QA task on a CPU, SFT then GRPO.

It generates a video-QA set of moving shapes (direction, count, colour, entry time)
with a held-out split, caches the media, builds a tiny Qwen2.5-VL, runs a short SFT
cold start on part of the training set, evaluates on the held-out split, runs GRPO
from the SFT checkpoint, evaluates again, and writes ``summary.json`` (held-out
accuracy after SFT and after RL, per problem type, seconds) and curve PNGs.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from omni_rl import checkpoint
from omni_rl.config import QuickstartConfig, QuickstartData, config_from_dict, save_config, to_dict
from omni_rl.data.dataset import MediaDataset
from omni_rl.evaluate import evaluate, table
from omni_rl.models import load
from omni_rl.preprocess.pipeline import Budgets, preprocess
from omni_rl.preprocess.scenes import write_video_qa
from omni_rl.recipes import grpo, sft
from omni_rl.runtime import set_threads


def _split(data: Path, fraction: float, out: Path) -> Path:
    """The first ``fraction`` of the rows (whole videos: 4 rows each)."""
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


def _held_out(cfg: QuickstartConfig, model_dir: Path, dataset: MediaDataset) -> dict:
    model, processor = load(model_dir)
    return evaluate(model, processor, dataset, samples=1, max_new_tokens=cfg.grpo.max_new_tokens, progress=False)


def main(cfg: QuickstartConfig) -> dict:
    """Run the quickstart; returns (and writes) its summary."""
    started = time.perf_counter()
    out = Path(cfg.run.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_config(cfg, out / "config.yaml")
    set_threads(cfg.run.threads)
    d = cfg.data
    # DATA: synthetic clips with known answers; the held-out split uses other scenes
    train = _write_split(d, out / "data" / "train", d.train_videos, cfg.run.seed)
    heldout = _write_split(d, out / "data" / "heldout", d.heldout_videos, cfg.run.seed + 10_000)
    sft_rows = _split(train, d.sft_fraction, train.parent / "sft.jsonl")
    budgets = Budgets.from_config(cfg.media)
    for data in (train, heldout):
        preprocess(data, out / "cache", budgets, workers=1, progress=False)
    shared = {
        "model": {"tiny_family": cfg.media.family, "tiny_width": cfg.model.width},
        "media": to_dict(cfg.media),
        "run": {**to_dict(cfg.run), "output_dir": ""},
    }
    heldout_set = MediaDataset(heldout, budgets, out / "cache", "prefer_cache", prompt_template=d.prompt_template)

    # SFT: a short cold start on part of the training set
    sft_cfg = config_from_dict(
        {
            "recipe": "sft",
            **shared,
            "run": {**shared["run"], "output_dir": str(out / "sft")},
            "data": {
                "train": str(sft_rows),
                "cache": str(out / "cache"),
                "prompts_per_step": cfg.sft.prompts_per_step,
                "prompt_template": d.prompt_template,
            },
            "trainer": {"steps": cfg.sft.steps},
            "optimizer": {"type": "adamw", "lr": cfg.sft.lr},
        },
        "quickstart sft",
    )
    sft.train(sft_cfg)
    sft_model = checkpoint.latest(out / "sft") / "model"
    after_sft = _held_out(cfg, sft_model, heldout_set)

    # GRPO: from the SFT checkpoint, on the whole training set
    g = cfg.grpo
    grpo_cfg = config_from_dict(
        {
            "recipe": "grpo",
            **shared,
            "run": {**shared["run"], "output_dir": str(out / "grpo")},
            "model": {"path": str(sft_model)},
            "data": {
                "train": str(train),
                "cache": str(out / "cache"),
                "prompts_per_step": g.prompts_per_step,
                "prompt_template": d.prompt_template,
            },
            "rollout": {"n": g.n, "max_new_tokens": g.max_new_tokens, "temperature": g.temperature},
            "algorithm": {"advantage": g.advantage, "dynamic_sampling": g.dynamic_sampling},
            "rewards": {"template": "answer_only"},
            "trainer": {"steps": g.steps},
            "optimizer": {"type": "adamw", "lr": g.lr},
        },
        "quickstart grpo",
    )
    grpo.train(grpo_cfg)
    after_rl = _held_out(cfg, checkpoint.latest(out / "grpo") / "model", heldout_set)

    summary = {
        "heldout_accuracy_sft": after_sft["accuracy"],
        "heldout_accuracy_rl": after_rl["accuracy"],
        "per_type": {
            t: {"sft": after_sft["per_type"][t], "rl": after_rl["per_type"][t]} for t in after_sft["per_type"]
        },
        "heldout_rows": after_rl["rows"],
        "blank_frames": d.blank_frames,
        "seconds": round(time.perf_counter() - started, 1),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    _plots(out)
    print("held-out after SFT:\n" + table(after_sft))
    print("held-out after RL:\n" + table(after_rl))
    return summary


def _plots(out: Path) -> None:
    from omni_rl.plots import plot_metrics

    for run in ("sft", "grpo"):
        plot_metrics(out / run, out / "plots" / run)
