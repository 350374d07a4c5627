"""A small run of the demo `make demo` runs, through the console script and the library."""

import json

import yaml

from omni_rl.demos import demo
from omni_rl.recipe_loader import load_config


def test_demo_runs_logs_and_learns_the_answer(tmp_path):
    cfg = load_config("configs/demo.yaml", [f"run.output_dir={tmp_path}", "trainer.steps=30"])
    summary = demo.main(cfg)
    assert summary["family"] == "qwen2_5_vl"
    assert summary["parameters"] <= 2_000_000
    assert summary["video"]["frames"] == 4
    assert summary["answer_after"] == "right" and summary["correct_after"]
    assert summary["loss_last"] < summary["loss_first"]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(5, 31, 5))  # trainer.log_every: 5
    assert all({"train/loss", "train/grad_norm", "time/step"} <= set(r) for r in rows)
    assert json.loads((tmp_path / "summary.json").read_text()) == summary
    resolved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert resolved["recipe"] == "demo" and resolved["trainer"]["steps"] == 30
    assert load_config(tmp_path / "config.yaml") == cfg


def test_demo_rejects_a_family_without_video(tmp_path, tiny_checkpoint):
    from omni_rl.cli import main

    path = tiny_checkpoint("qwen2_audio")
    code = main(["demo", "--set", f"model.path={path}", "--set", f"run.output_dir={tmp_path}"])
    assert code == 2
