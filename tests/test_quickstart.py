"""A small version of the quickstart that `make demo` runs in full: it runs and logs."""

import json

from omni_rl.cli import main


def test_quickstart_small_run(tmp_path, capsys):
    args = [
        "quickstart",
        "--set",
        f"run.output_dir={tmp_path}",
        "--set",
        "data.train_videos=4",
        "--set",
        "data.heldout_videos=2",
        "--set",
        "sft.steps=3",
        "--set",
        "grpo.steps=2",
        "--set",
        "grpo.n=2",
        "--set",
        "grpo.prompts_per_step=2",
    ]
    assert main(args) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert set(summary) >= {"heldout_accuracy_sft", "heldout_accuracy_rl", "per_type", "seconds"}
    assert 0 <= summary["heldout_accuracy_sft"] <= 1 and 0 <= summary["heldout_accuracy_rl"] <= 1
    assert summary["heldout_rows"] == 8
    assert set(summary["per_type"]) == {"multiple_choice", "counting", "temporal_grounding"}
    assert len((tmp_path / "sft" / "metrics.jsonl").read_text().splitlines()) == 3
    assert len((tmp_path / "grpo" / "metrics.jsonl").read_text().splitlines()) == 2
    assert (tmp_path / "plots" / "grpo" / "reward_mean.png").is_file()
    assert "held-out after RL" in capsys.readouterr().out
