"""Curves of a run's metrics.jsonl as PNG files (matplotlib, headless)."""

from __future__ import annotations

import json
from pathlib import Path

DEFAULT_KEYS = (
    "reward/mean",
    "accuracy/mean",
    "format/mean",
    "loss/policy",
    "loss/sft",
    "loss/kl",
    "actor/entropy",
    "response/length_mean",
    "optim/grad_norm",
    "time/step",
    "env/success_once",
    "env/return",
    "eval/success",
    "loss/value",
    "policy/noise_std",
    "throughput/env_steps_per_s",
)


def eval_keys(rows: list[dict]) -> list[str]:
    """The evaluation scores logged during training (``eval/NAME/METRIC``), without
    their row counts."""
    keys = {k for r in rows for k in r if k.startswith("eval/") and k.count("/") >= 2}
    return sorted(k for k in keys if k.rsplit("/", 1)[1] not in ("rows", "skipped"))


def plot_metrics(run_dir: str | Path, out_dir: str | Path | None = None, keys=DEFAULT_KEYS) -> list[Path]:
    """One PNG per metric present in ``run_dir/metrics.jsonl`` (``keys`` and every
    evaluation score); returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    out_dir = Path(out_dir) if out_dir is not None else run_dir / "plots"
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for key in (*keys, *eval_keys(rows)):
        points = [(r["step"], r[key]) for r in rows if key in r]
        if not points:
            continue
        figure, axis = plt.subplots(figsize=(5, 3.2))
        axis.plot(*zip(*points, strict=True), marker="." if len(points) < 60 else None)
        axis.set_xlabel("step")
        axis.set_title(key)
        axis.grid(alpha=0.3)
        figure.tight_layout()
        path = out_dir / (key.replace("/", "_") + ".png")
        figure.savefig(path, dpi=100)
        plt.close(figure)
        written.append(path)
    sources = sorted({k for r in rows for k in r if k.startswith("sampler/prob/")})
    if sources:  # the UCB sampler's probabilities, one line per data source
        figure, axis = plt.subplots(figsize=(5, 3.2))
        for key in sources:
            axis.plot(*zip(*[(r["step"], r[key]) for r in rows if key in r], strict=True), label=key[13:])
        axis.set_xlabel("step")
        axis.set_title("sampler/prob (data.sampler.type=ucb)")
        axis.set_ylim(0, 1)
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7)
        figure.tight_layout()
        path = out_dir / "sampler_prob.png"
        figure.savefig(path, dpi=100)
        plt.close(figure)
        written.append(path)
    return written
