"""A new user's mistakes, replayed on a small dataset: each is reported with its file,
row and reason, and training either skips the row before step 1 or stops before the
model is built. Also the row format's docs section and example file."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import yaml

from omni_rl.cli import main
from omni_rl.preprocess.rows import read_rows

ROOT = Path(__file__).parent.parent
EXAMPLES = ROOT / "examples"
MEDIA = {"min_frames": 2, "max_frames": 4, "video_min_pixels": 3136, "video_max_pixels": 6272}


def dataset(tmp_path: Path, *extra: dict) -> Path:
    """Four good video rows (the example clip) plus ``extra`` rows."""
    shutil.copytree(EXAMPLES / "media", tmp_path / "data" / "media")
    good = [
        {"id": f"good-{i}", "problem": "Which way does the square move?", "problem_type": "multiple_choice",
         "answer": "B", "options": ["left", "right"], "videos": ["media/square_right.mp4"]}
        for i in range(4)
    ]  # fmt: skip
    path = tmp_path / "data" / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [*good, *extra]))
    return path


def config(tmp_path: Path, rows: Path, recipe: str = "sft", **sections) -> Path:
    raw = {
        "recipe": recipe,
        "run": {"output_dir": str(tmp_path / "run"), "threads": 2},
        "model": {"tiny_family": "qwen2_5_vl"},
        "data": {"train": str(rows), "prompts_per_step": 2},
        "media": MEDIA,
        "trainer": {"steps": 1},
    }
    for name, values in sections.items():
        raw[name] = {**raw.get(name, {}), **values}
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def train(tmp_path, rows, *args, **sections) -> int:
    return main(["train", str(config(tmp_path, rows, **sections)), *args])


def metrics(tmp_path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]


def test_a_misspelt_media_key_is_named_with_the_key_it_means(tmp_path, caplog):
    data = dataset(tmp_path, {"id": "typo", "problem": "q", "problem_type": "counting", "answer": 1,
                              "video": ["media/square_right.mp4"]})  # fmt: skip
    assert train(tmp_path, data) == 0
    warning = next(r.getMessage() for r in caplog.records if "unknown key 'video'" in r.getMessage())
    assert warning.startswith(f"{data}:5: unknown key 'video' (did you mean 'videos'?) in 1 rows")
    assert "data.columns: {video: videos}" in warning
    # --strict refuses the row (before step 1), and a column mapping uses it as meant
    rows, failures = read_rows(data, strict=True)
    assert [(f.id, f.path) for f in failures] == [("typo", f"{data}:5")] and len(rows) == 4
    rows, failures = read_rows(data, columns={"video": "videos"})
    assert not failures and rows[-1].videos == ("media/square_right.mp4",)


def test_dropped_rows_are_reported_and_counted(tmp_path, caplog, capsys):
    data = dataset(
        tmp_path,
        {"id": "no-answer", "question": "q", "problem_type": "counting", "answer": 1},
        {"id": "bad-gold", "problem": "q", "problem_type": "multiple_choice", "answer": "Z", "options": ["a", "b"]},
    )
    assert train(tmp_path, data) == 0
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith(f"{data}:5 no-answer: 'problem' must be a non-empty string (the row has 'question'")
               for m in messages)  # fmt: skip
    assert any(m.startswith(f"{data}:6 bad-gold: multiple_choice answer 'Z'") for m in messages)
    row = metrics(tmp_path)[-1]
    assert (row["data/rows_read"], row["data/rows_used"], row["data/rows_refused"]) == (6, 4, 2)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["data"]["train"]["data/rows_read"] == 6 and summary["data"]["train"]["data/rows_refused"] == 2
    # eval says how many rows it read, scored and refused
    model = tmp_path / "run"
    assert main(["eval", "--model", str(model), "--data", str(data), "--max-new-tokens", "2"]) == 0
    assert "6 rows read: 4 scored, 2 refused when loading, 0 skipped" in capsys.readouterr().out


def test_bad_media_paths_are_refused_before_step_1(tmp_path, caplog):
    outside = tmp_path / "elsewhere.mp4"
    shutil.copy(EXAMPLES / "media" / "square_right.mp4", outside)
    data = dataset(
        tmp_path,
        {"id": "escapes", "problem": "q", "problem_type": "counting", "answer": 1, "videos": ["../elsewhere.mp4"]},
        {"id": "missing", "problem": "q", "problem_type": "counting", "answer": 1, "videos": ["media/gone.mp4"]},
    )
    assert train(tmp_path, data) == 0
    messages = [r.getMessage() for r in caplog.records]
    assert any(
        re.match(rf"{re.escape(str(data))}:5 escapes: media path \.\./elsewhere\.mp4 escapes ", m) for m in messages
    )
    assert any(m.startswith(f"{data}:6 missing: ") and "gone.mp4: no such file" in m for m in messages)
    assert metrics(tmp_path)[-1]["data/rows_refused"] == 2
    # --strict (data.strict): the first bad row stops the run before the model is built
    assert train(tmp_path / "strict", data, data={"strict": True}) == 2
    assert not (tmp_path / "strict" / "run" / "tiny_model").exists()


BROKEN = {"id": "broken", "problem": "Which way does the square move?", "problem_type": "multiple_choice",
          "answer": "A", "options": ["left", "right"], "videos": ["media/broken.mp4"]}  # fmt: skip


def broken_dataset(tmp_path: Path) -> tuple[Path, Path]:
    """Four good rows and, at line 5, a row whose mp4 is cut off half way (no moov atom:
    no decoder opens it, yet the file is there, so the row passes every load check)."""
    data = dataset(tmp_path, BROKEN)
    video = data.parent / "media" / "broken.mp4"
    clip = (EXAMPLES / "media" / "square_right.mp4").read_bytes()
    video.write_bytes(clip[: len(clip) // 2])
    return data, video.resolve()


def test_an_undecodable_video_is_reported_once_counted_and_skipped_in_sft_grpo_and_eval(tmp_path, caplog, capsys):
    data, video = broken_dataset(tmp_path)
    held = data.parent / "held.jsonl"  # an eval set with its own broken row (line 2)
    held.write_text(data.read_text().splitlines()[0] + "\n" + json.dumps({**BROKEN, "id": "held-broken"}) + "\n")
    reason = f"{video}: cannot decode video"
    runs = {
        "sft": {"data": {"prompts_per_step": 4, "eval": [{"data": str(held), "max_new_tokens": 2}]}},
        "grpo": {"data": {"prompts_per_step": 4}, "rollout": {"n": 2, "max_new_tokens": 4}},
    }
    for recipe, sections in runs.items():
        caplog.clear()
        # two steps of 4 over 5 rows: every row is drawn, some twice
        assert train(tmp_path / recipe, data, recipe=recipe, trainer={"steps": 2}, **sections) == 0
        warnings = [r.getMessage() for r in caplog.records if "broken.mp4" in r.getMessage()]
        train_warnings = [m for m in warnings if m.startswith(f"{data}:5: row 'broken': {reason}")]
        assert len(train_warnings) == 1 and train_warnings[0].endswith("(row skipped; counted in skipped/bad_rows)")
        row = metrics(tmp_path / recipe)[-1]
        assert row["skipped/bad_rows"] == 1 and row["data/rows_used"] == 5
        summary = json.loads((tmp_path / recipe / "run" / "summary.json").read_text())
        assert summary["data"]["train"]["skipped/bad_rows"] == 1
        if recipe == "sft":  # the eval set during training: its bad row reported and skipped too
            assert [m for m in warnings if m.startswith(f"{held}:2: row 'held-broken': {reason}")]
            assert row["eval/held/rows"] == 1 and row["eval/held/skipped"] == 1
    # omni-rl eval: the same row reported, skipped and counted
    caplog.clear()
    capsys.readouterr()
    assert main(["eval", "--model", str(tmp_path / "sft" / "run"), "--data", str(data), "--max-new-tokens", "2"]) == 0
    assert "5 rows read: 4 scored, 0 refused when loading, 1 skipped" in capsys.readouterr().out
    assert sum(f"{data}:5: row 'broken': {reason}" in r.getMessage() for r in caplog.records) == 1


def test_under_data_strict_an_undecodable_video_stops_training_and_eval_naming_it(tmp_path, capsys):
    data, video = broken_dataset(tmp_path)
    strict = {"data": {"strict": True, "prompts_per_step": 4}, "trainer": {"steps": 2}}
    named = f"{data}:5: row 'broken': {video}: cannot decode video"
    for recipe, sections in (("sft", {}), ("grpo", {"rollout": {"n": 2, "max_new_tokens": 4}})):
        assert train(tmp_path / recipe, data, recipe=recipe, **strict, **sections) == 2
        err = capsys.readouterr().err
        assert named in err and "(data.strict: a bad row stops the run)" in err
    model = tmp_path / "sft" / "run" / "tiny_model"
    args = ["eval", "--model", str(model), "--data", str(data), "--max-new-tokens", "2"]
    assert main([*args, "--config", str(config(tmp_path / "cfg", data, **strict))]) == 2
    err = capsys.readouterr().err
    assert named in err and "data.strict" in err


def test_rows_preprocess_could_not_cache_are_refused_at_load(tmp_path, caplog):
    data, video = broken_dataset(tmp_path)
    cache = tmp_path / "cache"
    base = config(tmp_path / "pre", data)
    assert main(["preprocess", str(data), "--cache", str(cache), "--config", str(base)]) == 0
    assert '"id": "broken"' in (cache / "failures.jsonl").read_text()
    assert train(tmp_path, data, data={"cache": str(cache), "prompts_per_step": 4}, trainer={"steps": 2}) == 0
    refusals = [r.getMessage() for r in caplog.records if r.getMessage().startswith(f"{data}:5 broken: ")]
    assert len(refusals) == 1 and f"{video}: cannot decode video" in refusals[0]
    assert f"preprocess could not cache it, {cache / 'failures.jsonl'}" in refusals[0]
    row = metrics(tmp_path)[-1]
    assert (row["data/rows_read"], row["data/rows_used"], row["data/rows_refused"]) == (5, 4, 1)
    assert row["skipped/bad_rows"] == 0 and row["data/cache_misses"] == 0


def test_an_unknown_type_stops_before_the_model_is_built_naming_its_rows(tmp_path, capsys):
    data = dataset(
        tmp_path, *[{"id": f"t{i}", "problem": "q", "problem_type": "countng", "answer": 1} for i in range(2)]
    )
    assert train(tmp_path, data) == 2
    err = capsys.readouterr().err
    assert "unknown problem type 'countng' (did you mean 'counting'?)" in err
    assert f"in 2 rows: {data}:5 t0, {data}:6 t1" in err
    assert not (tmp_path / "run" / "tiny_model").exists()
    assert main(["rewards", "check", str(data)]) == 1  # every problem, not the first
    out = capsys.readouterr().out
    assert out.count("unknown problem type 'countng'") == 2


def test_stale_media_settings_say_which_setting_differs(tmp_path, capsys):
    data = dataset(tmp_path)
    cache = tmp_path / "cache"
    base = config(tmp_path, data, data={"cache": str(cache)})
    assert main(["preprocess", str(data), "--cache", str(cache), "--config", str(base)]) == 0
    capsys.readouterr()
    # the training config samples at another rate: under cache_only every row is refused, saying why
    code = train(tmp_path / "stale", data, data={"cache": str(cache), "cache_mode": "cache_only"}, media={"fps": 1.0})
    assert code == 2
    err = capsys.readouterr().err
    assert "no usable rows (4 refused" in err
    assert not (tmp_path / "stale" / "run" / "tiny_model").exists()
    from omni_rl.data.dataset import MediaDataset
    from omni_rl.preprocess.config import MediaConfig
    from omni_rl.preprocess.pipeline import Budgets

    stale = MediaDataset(data, Budgets.from_config(MediaConfig(**MEDIA, fps=1.0)), cache, "cache_only")
    assert "video.fps: cached 2.0, this run 1.0" in stale.failures[0].reason
    # prefer_cache with the preprocess config's settings: every medium is a hit, logged per step
    assert train(tmp_path / "hit", data, data={"cache": str(cache)}) == 0
    row = metrics(tmp_path / "hit")[-1]
    assert row["data/cache_hits"] == 2 and row["data/cache_misses"] == 0


def test_a_corrupt_entry_is_moved_aside_and_rebuilt_by_preprocess(tmp_path, capsys):
    from omni_rl.preprocess.cache import MediaCache

    data = dataset(tmp_path)
    cache = tmp_path / "cache"
    assert main(["preprocess", str(data), "--cache", str(cache)]) == 0
    [key] = MediaCache(cache).entry_keys()
    entry = MediaCache(cache).path(key)
    blob = bytearray(entry.read_bytes())
    blob[-5] ^= 0xFF  # a flipped bit in the tensor bytes
    entry.write_bytes(bytes(blob))
    capsys.readouterr()
    assert main(["cache", "verify", str(cache)]) == 1
    out = capsys.readouterr().out
    assert f"corrupt: {entry}: tensor bytes do not match their digest; moved to {cache}/corrupt/" in out
    assert "rerun omni-rl preprocess" in out
    assert main(["preprocess", str(data), "--cache", str(cache)]) == 0
    assert main(["cache", "verify", str(cache)]) == 0 and "1 ok, 0 corrupt, 0 made from them" in capsys.readouterr().out


def test_cache_commands_refuse_a_directory_that_is_not_a_cache(tmp_path, capsys):
    assert main(["cache", "stats", str(tmp_path / "nowhere")]) == 2
    assert "no such cache directory" in capsys.readouterr().err
    (tmp_path / "plain").mkdir()
    assert main(["cache", "verify", str(tmp_path / "plain")]) == 2
    assert "not an omni_rl media cache" in capsys.readouterr().err


def test_run_directories_overwrite_and_resume_messages(tmp_path, capsys):
    data = dataset(tmp_path)
    assert train(tmp_path, data) == 0
    err = capsys.readouterr().err
    run = tmp_path / "run"
    assert f"omni-rl: writing to {run}" in err
    assert f"omni-rl: final model: {run}/model (-> {run}/checkpoints/step-00000001/model)" in err
    assert (run / "model" / "config.json").is_file()
    # the run directory is a model for eval
    assert main(["eval", "--model", str(run), "--data", str(data), "--max-new-tokens", "2"]) == 0
    capsys.readouterr()
    # a rerun into it: an error offering --resume auto and --overwrite, before anything is built
    assert train(tmp_path, data) == 2
    err = capsys.readouterr().err
    assert f"{run} holds a run" in err and "--resume auto" in err and "--overwrite" in err
    assert train(tmp_path, data, "--resume", "auto") == 0
    assert "the run finished at step 1 (trainer.steps=1): nothing to train" in capsys.readouterr().err
    assert train(tmp_path, data, "--overwrite") == 0
    assert len(metrics(tmp_path)) == 1
    assert train(tmp_path / "fresh", data, "--resume", "auto") == 0
    assert f"nothing to resume in {tmp_path / 'fresh' / 'run'}: starting at step 0" in capsys.readouterr().err
    # a directory that holds no model says where models live
    assert main(["eval", "--model", str(tmp_path), "--data", str(data)]) == 2
    assert "OUTPUT_DIR/checkpoints/step-N/model" in capsys.readouterr().err


def test_the_documented_row_format_and_the_example_file(tmp_path):
    from omni_rl.data.dataset import MediaDataset
    from omni_rl.preprocess.config import MediaConfig
    from omni_rl.preprocess.pipeline import Budgets
    from omni_rl.rewards import SCORERS

    page = (ROOT / "docs" / "guides" / "data.md").read_text()
    section = page.split("## The row format", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"^\| `(\w+)` \|", section, flags=re.MULTILINE))
    assert {"id", "problem", "problem_type", "answer", "options"} <= documented
    types = {t for t in documented if t in SCORERS}
    assert types == {n for n in SCORERS.names() if n in documented} and len(types) >= 12
    assert "examples/rows.jsonl" in section
    example = MediaDataset(
        EXAMPLES / "rows.jsonl", Budgets.from_config(MediaConfig(**MEDIA, family="qwen2_5_omni_thinker"))
    )
    assert not example.failures and len(example) == 11
    assert {r.problem_type for r in example.rows} <= types
    assert all(example[i].messages for i in range(len(example)))  # every medium decodes


def test_a_line_that_is_not_json_is_named_by_its_line_and_the_line_end(tmp_path, caplog):
    """A cut last line: the dataset names it 'rows.jsonl:5: invalid JSON (... at the end
    of the line)', with no stray space where a row's id would go."""
    from omni_rl.data.dataset import MediaDataset
    from omni_rl.preprocess.image import ImageBudget
    from omni_rl.preprocess.pipeline import Budgets
    from omni_rl.preprocess.video import VideoBudget

    rows = dataset(tmp_path)
    rows.write_text(rows.read_text() + '{"id": "cut", "problem"\n')
    with caplog.at_level("WARNING", logger="omni_rl.data.dataset"):
        MediaDataset(rows, Budgets(VideoBudget(), ImageBudget()), cache_mode="no_cache")
    said = [r.getMessage() for r in caplog.records]
    assert said == [f"{rows}:5: invalid JSON (Expecting ':' delimiter at the end of the line) (row skipped)"]


def test_every_file_a_run_writes_takes_the_users_umask(tmp_path):
    """safetensors creates its files 600: the media cache, the tiny model, a checkpoint's
    exported model and its shards would be unreadable to the user's group. Every file
    preprocess and a training run write gets the mode the umask gives (644 under 022)."""
    import os
    import stat

    data = dataset(tmp_path)
    cache = tmp_path / "cache"
    before = os.umask(0o022)
    try:
        base = config(tmp_path, data, data={"cache": str(cache)})
        assert main(["preprocess", str(data), "--cache", str(cache), "--config", str(base)]) == 0
        assert train(tmp_path, data, data={"cache": str(cache)}) == 0
    finally:
        os.umask(before)
    written = [p for root in (cache, tmp_path / "run") for p in root.rglob("*") if p.is_file()]
    assert any(p.suffix == ".safetensors" for p in written)
    modes = {str(p.relative_to(tmp_path)): oct(stat.S_IMODE(p.stat().st_mode)) for p in written}
    assert {path: mode for path, mode in modes.items() if mode != "0o644"} == {}


def test_eval_writes_its_summary_where_asked_takes_any_config_with_media_and_fails_when_nothing_scored(
    tmp_path, tiny_checkpoint, capsys
):
    """eval's --out in a folder not made yet raised FileNotFoundError after the whole
    evaluation, losing it; the quickstart's config (its data section not a training
    config's) raised AttributeError; a config without media did too; and an evaluation
    that scored no row exited 0."""
    data = dataset(tmp_path)
    model = str(tiny_checkpoint("qwen2_5_vl"))
    base = ["eval", "--model", model, "--data", str(data), "--max-new-tokens", "2"]
    out = tmp_path / "new" / "folder" / "summary.json"
    assert main([*base, "--out", str(out), "--config", str(ROOT / "configs" / "quickstart.yaml")]) == 0
    assert json.loads(out.read_text())["rows"] == 4
    capsys.readouterr()
    assert main([*base, "--config", str(ROOT / "configs" / "demo.yaml")]) == 2
    assert "configs/demo.yaml: this recipe's config has no 'media' section" in capsys.readouterr().err
    unreadable = tmp_path / "data" / "missing_media.jsonl"
    row = {"id": "gone", "problem": "Which way?", "problem_type": "open_ended", "answer": "left", "videos": ["no.mp4"]}
    unreadable.write_text(json.dumps(row) + "\n")
    assert main(["eval", "--model", model, "--data", str(unreadable), "--max-new-tokens", "2"]) == 1
    assert f"{unreadable}: no row was scored" in capsys.readouterr().err
