"""The SFT recipe and the evaluator: small runs on synthetic shapes."""

from __future__ import annotations

import json

import pytest

from omni_rl.cli import main
from omni_rl.preprocess.scenes import write_video_qa
from omni_rl.recipe_loader import load_config
from omni_rl.recipes import sft

MEDIA = ["media.min_frames=2", "media.max_frames=8", "media.video_min_pixels=3136", "media.video_max_pixels=12544"]


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    return write_video_qa(tmp_path_factory.mktemp("shapes"), videos=4, seed=1, seconds=2.0)


def test_sft_memorizes_a_small_set(tmp_path, shapes):
    cfg = load_config(
        None,
        [
            f"data.train={shapes}",
            f"run.output_dir={tmp_path}",
            "run.threads=2",
            "trainer.steps=40",
            "trainer.save_every=20",
            "data.prompts_per_step=8",
            "optimizer.lr=3e-3",
            *MEDIA,
        ],
        recipe="sft",
    )
    final = sft.train(cfg)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 40 and final == rows[-1]
    assert rows[-1]["loss/sft"] < 0.5 * rows[0]["loss/sft"]
    assert (tmp_path / "checkpoints" / "step-00000040" / "model" / "config.json").is_file()


def test_eval_cli_reports_accuracy_per_type(tmp_path, shapes, capsys):
    cfg = load_config(
        None,
        [
            f"data.train={shapes}",
            f"run.output_dir={tmp_path / 'run'}",
            "run.threads=2",
            "trainer.steps=60",
            "data.prompts_per_step=16",
            "optimizer.lr=3e-3",
            *MEDIA,
        ],
        recipe="sft",
    )
    sft.train(cfg)
    model = tmp_path / "run" / "checkpoints" / "step-00000060" / "model"
    summary_file = tmp_path / "eval.json"
    args = [
        "eval",
        "--model",
        str(model),
        "--data",
        str(shapes),
        "--config",
        str(tmp_path / "run" / "config.yaml"),
        "--max-new-tokens",
        "24",
        "--out",
        str(summary_file),
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "overall" in out and "multiple_choice" in out
    summary = json.loads(summary_file.read_text())
    assert summary["rows"] == 16 and summary["samples"] == 1
    assert set(summary["per_type"]) == {"multiple_choice", "counting", "temporal_grounding"}
    # trained on exactly these rows: greedy answers reproduce most of them
    assert summary["accuracy"] > 0.5
    assert main([*args[:-2], "--samples", "2"]) == 0
    assert "pass@2" in capsys.readouterr().out


def test_rows_eval_and_training_eval_score_alike(tmp_path, shapes, monkeypatch):
    """``omni-rl eval`` on rows and a ``data.eval`` rows set during training answer and
    score on one path: the same answers (right on every other row) give the same
    summary, and the training metrics are that summary's."""
    import torch

    from omni_rl.data.config import EvalSetConfig
    from omni_rl.data.dataset import MediaDataset
    from omni_rl.evaluation import pipeline
    from omni_rl.evaluation.during_training import HeldOut
    from omni_rl.preprocess.pipeline import Budgets

    def canned(model, processor, dataset, sampling, samples, indices, *rest):
        rows = [dataset.rows[i] for i in indices]
        return [(row, [str(row.answer) if k % 2 == 0 else "no idea"]) for k, row in enumerate(rows)], []

    monkeypatch.setattr(pipeline, "answer_rows", canned)
    cfg = load_config(None, [f"data.train={shapes}", f"run.output_dir={tmp_path}", *MEDIA], recipe="sft")
    cfg.data.eval = [EvalSetConfig(data=str(shapes), name="held")]
    metrics = HeldOut(cfg, tmp_path, "qwen2_5_vl")(torch.nn.Linear(1, 1), None, step=3)
    during = json.loads((tmp_path / "eval" / "held" / "step-3" / "results.json").read_text())

    dataset = MediaDataset(shapes, Budgets.from_config(cfg.media), prompt_template=cfg.data.prompt_template)
    rows = pipeline.evaluate_rows(None, None, dataset)
    assert rows["accuracy"] == 0.5 and rows["rows"] == 16
    assert {k: v for k, v in during.items() if k not in ("step", "skipped_rows")} == {
        k: v for k, v in rows.items() if k not in ("rows_read", "refused_rows", "skipped_rows")
    }
    assert during["step"] == 3 and during["skipped_rows"] == 0
    assert metrics["eval/held/accuracy"] == rows["accuracy"] and metrics["eval/held/rows"] == 16
    per_type = {k.removeprefix("eval/held/accuracy/"): v for k, v in metrics.items() if "accuracy/" in k}
    assert per_type == rows["per_type"]
