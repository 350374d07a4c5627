"""The console script as a user runs it: exit codes, one-line errors, help."""

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from omni_rl.cli import main

ROOT = Path(__file__).parent.parent
OMNI_RL = str(Path(sys.executable).parent / "omni-rl")


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([OMNI_RL, *args], capture_output=True, text=True, cwd=ROOT, timeout=300)


def test_help_lists_subcommands():
    result = run("--help")
    assert result.returncode == 0
    for name in ("config", "tiny-model", "demo"):
        assert name in result.stdout
    config_help = run("config", "--help")
    assert "check" in config_help.stdout and "show" in config_help.stdout


def test_config_check_passes_on_every_shipped_config():
    files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "configs").glob("*.yaml"))
    result = run("config", "check", *files)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("ok: ") == len(files)


def test_misspelled_key_exits_2_with_one_line_naming_it(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text((ROOT / "configs" / "demo.yaml").read_text().replace("  steps: 30", "  stpes: 30"))
    result = run("config", "check", str(bad))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "stpes" in lines[0] and "did you mean 'steps'" in lines[0]
    assert "Traceback" not in result.stderr


def test_override_with_misspelled_key_exits_2():
    result = run("config", "check", "configs/demo.yaml", "--set", "trainer.stpes=3")
    assert result.returncode == 2
    assert "did you mean 'steps'" in result.stderr


@pytest.mark.parametrize(
    "argv",
    [
        ["--debug", "config", "check", "configs/does-not-exist.yaml"],
        ["config", "check", "configs/does-not-exist.yaml", "--debug"],
        ["config", "--debug", "show", "configs/does-not-exist.yaml"],
        ["train", "configs/does-not-exist.yaml", "--debug"],
        ["train", "--debug", "--config", "configs/does-not-exist.yaml"],
    ],
)
def test_debug_anywhere_on_the_line_shows_the_traceback(argv, capsys):
    from omni_rl.errors import ConfigError

    with pytest.raises(ConfigError, match="cannot read config"):
        main(argv)
    assert main([a for a in argv if a != "--debug"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot read config" in err[0]


def test_debug_after_the_subcommand_in_the_console_script():
    plain = run("train", "configs/does-not-exist.yaml")
    assert plain.returncode == 2 and "Traceback" not in plain.stderr
    debug = run("train", "configs/does-not-exist.yaml", "--debug")
    assert debug.returncode == 1
    assert "Traceback" in debug.stderr and "ConfigError: configs/does-not-exist.yaml: cannot read" in debug.stderr


def test_train_and_config_show_take_the_config_once_as_positional_or_option(capsys):
    not_trainable = "configs/demo.yaml: recipe 'demo' is not trainable"
    for argv in (["train", "configs/demo.yaml"], ["train", "--config", "configs/demo.yaml"]):
        assert main(argv) == 2
        assert not_trainable in capsys.readouterr().err  # the file was read either way
    for argv, error in (
        (["train", "--resume", "auto"], "train: a config is required: omni-rl train CONFIG (or --config CONFIG)"),
        (["train", "configs/demo.yaml", "--config", "configs/demo.yaml"], "train: give the config once"),
        (["config", "show"], "config show: a config is required"),
        (["config", "show", "configs/demo.yaml", "--config", "configs/demo.yaml"], "config show: give the config once"),
        (["config", "check"], "config check: give at least one config"),
    ):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith(f"omni-rl: error: {error}") and err.count("\n") == 1, err
    assert main(["config", "show", "--config", "configs/demo.yaml"]) == 0
    assert "recipe: demo" in capsys.readouterr().out
    assert main(["config", "check", "configs/demo.yaml", "--config", "configs/preprocess_tiny.yaml"]) == 0
    out = capsys.readouterr().out
    assert "ok: configs/demo.yaml (recipe: demo)" in out and "ok: configs/preprocess_tiny.yaml" in out


def test_eval_benchmark_refuses_a_config(capsys):
    argv = ["eval", "--benchmark", "mvbench", "--data", "x", "--config", "configs/preprocess_tiny.yaml"]
    assert main(argv) == 2
    assert "eval --benchmark: --config does not apply" in capsys.readouterr().err


# the configs each command reads, by recipe ("protocol": eval --benchmark's protocol fields)
READS = {
    "config check": ("grpo", "sft", "flow_ppo", "demo"),
    "config show": ("grpo", "sft", "flow_ppo", "demo"),
    "demo": ("demo",),
    "train": ("grpo", "sft", "flow_ppo"),
    "quickstart": ("quickstart", "quickstart_audio", "quickstart_sim", "quickstart_vla"),
    "eval": ("preprocess", "protocol"),
    "curate text-only": ("grpo",),
    "curate difficulty": ("grpo",),
    "preprocess": ("preprocess",),
    "cache gc": ("preprocess",),
    "rewards check": ("preprocess",),
    "rewards score": ("preprocess",),
}


def test_set_is_only_on_commands_that_read_a_config_and_its_examples_apply():
    import dataclasses
    import re

    from omni_rl.benchmarks.base import Protocol
    from omni_rl.cli import COMMANDS
    from omni_rl.config import parse_override
    from omni_rl.errors import OmniRLError
    from omni_rl.recipe_loader import load_config

    def flag(name, option):
        return next((kw for flags, kw in COMMANDS.get(name).arguments if option in flags), None)

    assert {n for n in COMMANDS if flag(n, "--set")} == set(READS)
    assert {n for n in COMMANDS if flag(n, "--config")} == set(READS)
    for name, recipes in READS.items():
        examples = re.findall(r"--set ([\w.]+=[\w.:]+)", flag(name, "--set")["help"])
        assert examples, name
        for example in examples:
            loads = []
            for recipe in recipes:
                if recipe == "protocol":
                    keys, value = parse_override(example)
                    loads.append(keys[0] == "protocol" and bool(dataclasses.replace(Protocol(), **{keys[1]: value})))
                    continue
                try:
                    loads.append(bool(load_config(None, [example], recipe=recipe)))
                except OmniRLError:
                    loads.append(False)
            assert any(loads), f"{name}: --set {example} applies to none of {recipes}"


def test_rewards_score_takes_its_response_as_an_option(capsys, monkeypatch):
    base = ["rewards", "score", "--type", "multiple_choice", "--answer", "B", "--options", "A. cat", "B. dog"]
    with pytest.raises(SystemExit) as exit:  # the old positional would be swallowed by --options
        main([*base, "<answer>B</answer>"])
    assert exit.value.code == 2
    assert "the following arguments are required: --response" in capsys.readouterr().err
    assert main([*base, "--response", "<answer>B</answer>"]) == 0
    out = capsys.readouterr().out
    assert '"accuracy": 1.0' in out and '"predicted": "B"' in out and '"format": 0.5' in out  # no <think>
    monkeypatch.setattr("sys.stdin", __import__("io").StringIO("<answer>A</answer>\n"))
    assert main([*base, "--response", "-", "--set", "rewards.template=answer_only"]) == 0
    out = capsys.readouterr().out
    assert '"accuracy": 0.0' in out and '"predicted": "A"' in out and '"format": 1.0' in out
    assert main([*base, "--response", "B", "--set", "rewards.templat=answer_only"]) == 2
    assert "did you mean 'template'" in capsys.readouterr().err


def test_the_cli_page_lists_every_subcommand():
    import re

    from omni_rl.cli import COMMANDS

    page = (ROOT / "docs" / "guides" / "cli.md").read_text()
    assert page.startswith("# The `omni-rl` command")
    block = page.split("```", 2)[1]
    listed = set()
    for line in block.splitlines():
        if line.startswith("omni-rl "):
            words = []
            for token in line.split()[1:]:
                if not re.fullmatch(r"[a-z][a-z0-9-]*", token):
                    break
                words.append(token)
            listed.add(" ".join(words))
    assert listed == set(COMMANDS)


def test_unknown_family_exits_2(tmp_path):
    assert main(["tiny-model", "--family", "qwen25_vl", "--out", str(tmp_path)]) == 2


def test_config_show_prints_resolved_yaml(capsys):
    assert main(["config", "show", "configs/demo.yaml", "--set", "optimizer.type=sgd"]) == 0
    out = capsys.readouterr().out
    assert "recipe: demo" in out and "type: sgd" in out and "momentum: 0.9" in out


PLAIN_TRANSFORMERS = """
import sys, numpy as np, torch
from transformers import AutoModelForImageTextToText, AutoProcessor
path = sys.argv[1]
model = AutoModelForImageTextToText.from_pretrained(path)
processor = AutoProcessor.from_pretrained(path)
messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}]
text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
image = np.random.default_rng(0).integers(0, 255, (64, 96, 3), dtype=np.uint8)
inputs = processor(text=[text], images=[image], return_tensors="pt")
out = model.generate(**inputs, max_new_tokens=8, min_new_tokens=8, do_sample=False)
assert out.shape[1] == inputs["input_ids"].shape[1] + 8
assert "omni_rl" not in sys.modules
print(type(model).__name__, out.shape[1] - inputs["input_ids"].shape[1])
"""


def test_tiny_model_loads_in_plain_transformers(tmp_path):
    out = tmp_path / "tiny"
    result = run("tiny-model", "--family", "qwen2_5_vl", "--out", str(out))
    assert result.returncode == 0, result.stderr
    loaded = subprocess.run(
        [sys.executable, "-c", PLAIN_TRANSFORMERS, str(out)], capture_output=True, text=True, cwd=tmp_path, timeout=300
    )
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout.split() == ["Qwen2_5_VLForConditionalGeneration", "8"]


def test_train_checks_every_input_path_before_it_loads_or_writes(tmp_path, capsys):
    """A missing input is one error naming each config field and its path, and the run's
    output directory is not even made (it used to write config.yaml, then load the model)."""
    out = tmp_path / "run"
    flow = [
        "train",
        "configs/pixel_targets_pi0_tiny.yaml",
        f"--set=run.output_dir={out}",
        f"--set=policy.path={tmp_path / 'pi0_tiny'}",
        f"--set=bc.demos={tmp_path / 'demos.safetensors'}",
    ]
    assert main(flow) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert f"policy.path: {tmp_path / 'pi0_tiny'}: no such directory" in err
    assert f"bc.demos: {tmp_path / 'demos.safetensors'}: no such file" in err
    assert not out.exists()
    grpo = [
        "train",
        "configs/grpo_tiny_shapes.yaml",
        f"--set=run.output_dir={out}",
        f"--set=data.train={tmp_path / 'train.jsonl'}",
        f"--set=data.cache={tmp_path / 'cache'}",
        "--set=data.cache_mode=cache_only",
        f"--set=model.path={tmp_path / 'model'}",
    ]
    assert main(grpo) == 2
    err = capsys.readouterr().err
    for name, path in (("data.train", "train.jsonl"), ("data.cache", "cache"), ("model.path", "model")):
        assert f"{name}: {tmp_path / path}: no such" in err, err
    assert not out.exists()


MODEL_OUT = ("--model", "m", "--out", "o")
FAST_FAIL = """
import sys
from omni_rl.cli import main
code = main(sys.argv[1:])
heavy = sorted(m for m in ("torch", "transformers", "numpy") if m in sys.modules)
print(code, heavy)
"""


@pytest.mark.parametrize(
    "argv, error",
    [
        (["train", "configs/does-not-exist.yaml"], "configs/does-not-exist.yaml: cannot read config"),
        (["train", "--config", "configs/does-not-exist.yaml"], "configs/does-not-exist.yaml: cannot read config"),
        (["train"], "train: a config is required"),
        (["train", "configs/demo.yaml", "--config", "configs/demo.yaml"], "train: give the config once"),
        (["train", "configs/grpo_tiny_shapes.yaml", "--resume", "runs/nowhere"], "runs/nowhere: not a checkpoint"),
        (["train", "configs/grpo_tiny_shapes.yaml", "--set", "trainer.steps"], "--set 'trainer.steps': expected KEY="),
        (["train", "configs/demo.yaml"], "configs/demo.yaml: recipe 'demo' is not trainable"),
        (["config", "show", "configs/does-not-exist.yaml"], "configs/does-not-exist.yaml: cannot read config"),
        (["eval", "--model", "m", "--data", "README.md", "--config", "nowhere.yaml"], "nowhere.yaml: cannot read"),
        (["eval", "--data", "d"], "eval: --model is required"),
        (["eval", "--model", "m", "--data", "d", "--samples", "0"], "eval: --samples must be >= 1"),
        (["eval", "--model", "m", "--data", "README.md", "--max-new-tokens", "0"], "eval: --max-new-tokens must be"),
        (["eval", "--model", "m", "--data", "nowhere.jsonl"], "nowhere.jsonl: no such dataset file"),
        (["eval", "--model", "m", "--data", "README.md", "--out", "docs"], "eval --out docs: a directory"),
        (["curate", "text-only", "README.md", *MODEL_OUT, "--max-new-tokens", "-5"], "curate: --max-new-tokens must"),
        (["train", "configs/grpo_tiny_shapes.yaml", "--resume", "auto", "--overwrite"], "train: --resume and --overw"),
        (["tiny-model", "--family", "qwen2_5_vl", "--out", "x", "--width", "-64"], "tiny-model: --width must be >= 1"),
        (["tiny-model", "--family", "qwen2_5_vl", "--out", "README.md"], "tiny-model --out README.md: a file"),
        (["preprocess", "README.md", "--cache", "c", "--limit", "-1"], "preprocess: --limit must be >= 1, got -1"),
        (["preprocess", "README.md", "--cache", "c", "--workers", "0"], "preprocess: --workers must be >= 1, got 0"),
        (
            ["sim", "collect-demos", "--task", "PixelTargets-v0", "--episodes", "2", "--out", "o", "--num-envs", "0"],
            "sim collect-demos: --num-envs must be >= 1",
        ),
        (["attach-talker", "--thinker", "docs", "--source", "docs", "--out", "o"], "attach-talker --thinker docs: not"),
        (["preprocess", "README.md", "--cache", "README.md"], "preprocess --cache README.md: a file; name a dir"),
        (["train", "configs/grpo_tiny_shapes.yaml", "--set", "run.output_dir=README.md"], "run.output_dir README"),
        (["curate", "text-only", "README.md", "--model", "m", "--out", "README.md"], "curate --out README.md: a file"),
        (
            ["sim", "collect-demos", "--task", "PixelTargets-v0", "--episodes", "2", "--out", "docs"],
            "sim collect-demos --out docs: a directory",
        ),
        (["curate", "text-only", "nowhere.jsonl", *MODEL_OUT], "nowhere.jsonl: no such dataset"),
        (["curate", "text-only", "README.md", *MODEL_OUT, "--threshold", "0"], "curate: --threshold 0.0 is not in"),
        (["curate", "difficulty", "README.md", *MODEL_OUT, "--low", "0.9", "--high", "0.1"], "curate: --low 0.9"),
        (["curate", "difficulty", "README.md", *MODEL_OUT, "--samples", "0"], "curate: --samples must be >= 1"),
        (["curate", "difficulty", "README.md", *MODEL_OUT, "--samples", "1"], "curate difficulty: --samples 1"),
    ],
    ids=[
        "missing",
        "missing_option",
        "none",
        "twice",
        "resume",
        "set",
        "not_trainable",
        "config_show",
        "eval_config",
        "eval_model",
        "eval_samples",
        "eval_max_new_tokens",
        "eval_data_first",
        "eval_out_directory",
        "curate_max_new_tokens",
        "resume_and_overwrite",
        "tiny_width",
        "tiny_out_file",
        "preprocess_limit",
        "preprocess_workers",
        "collect_demos_envs",
        "attach_talker_dirs",
        "preprocess_cache_file",
        "train_output_dir_file",
        "curate_out_file",
        "collect_demos_out_directory",
        "curate_data",
        "curate_threshold",
        "curate_bounds",
        "curate_samples",
        "difficulty_one_sample",
    ],
)
def test_a_bad_config_path_or_argument_fails_before_the_heavy_imports(argv, error):
    """What the command line itself gets wrong is reported before torch is imported
    (seconds of an idle wait, before): the one-line error, and no torch in the process."""
    result = subprocess.run(
        [sys.executable, "-c", FAST_FAIL, *argv], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert result.stderr.startswith(f"omni-rl: error: {error}"), result.stderr
    assert result.stdout.split("\n")[0] == "2 []", result.stdout


def _leaf_parsers(parser, words=()):
    """(command words, parser) of every command the parser runs, nested groups walked."""
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for word, sub in action.choices.items():
                yield from _leaf_parsers(sub, (*words, word))
            return
    yield " ".join(words), parser


def test_the_cli_page_shows_every_flag_of_every_command():
    """Each option a command's --help shows is on that command's usage lines in
    docs/guides/cli.md (--set and --debug, which the block's comment gives every command
    that takes them, apart), and each command is in the page's table of where it is
    documented: the page and the parser cannot drift apart."""
    from omni_rl.cli import build_parser

    page = (ROOT / "docs" / "guides" / "cli.md").read_text()
    block = page.split("```", 2)[1].splitlines()
    shared = {flag for line in block if line.startswith("#") for flag in ("--set", "--debug") if flag in line}
    assert shared == {"--set", "--debug"}
    table = page.split("## Where each command is documented", 1)[1]
    entries = []  # a usage line with its indented continuation lines
    for line in block:
        if line.startswith(" ") and entries:
            entries[-1] += " " + line.strip()
        elif line.startswith("omni-rl "):
            entries.append(line)
    lacking = []
    for name, parser in _leaf_parsers(build_parser()):
        usage = " ".join(entry for entry in entries if entry.startswith(f"omni-rl {name} "))
        flags = {f for a in parser._actions for f in a.option_strings if f.startswith("--")} - {"--help"} - shared
        lacking += [f"{name} {flag}" for flag in sorted(flags) if not re.search(rf"{flag}(?![\w-])", usage)]
        if f"`{name}`" not in table:
            lacking.append(f"{name}: not in the table")
    assert not lacking, lacking


def test_the_tiny_models_page_gives_the_tiny_pi0s_parameter_count(tmp_path):
    from safetensors import safe_open

    from omni_rl.models.pi0 import build_tiny_pi0

    out = build_tiny_pi0(tmp_path / "pi0", seed=0, width=64)
    with safe_open(str(Path(out) / "model.safetensors"), framework="pt") as f:
        count = sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())  # noqa: SIM118 - safe_open is not iterable
    page = " ".join((ROOT / "docs" / "guides" / "tiny-models.md").read_text().split())
    assert f"about {count / 1e6:.2f} M parameters at width 64 ({count:,};" in page, count


@pytest.mark.parametrize("command", [["rewards", "check", "README.md"], ["preprocess", "README.md", "--cache", "c"]])
def test_data_settings_without_a_config_say_what_to_pass(command, capsys):
    """``--set data.columns=...`` without ``--config`` read "<preprocess defaults>: data:
    unknown key 'data' in the top level"; it says what to pass now."""
    from omni_rl.cli import main

    assert main([*command, "--set", "data.columns={q: problem}"]) == 2
    assert "--set data.*: needs --config with a training config" in capsys.readouterr().err


def test_an_unknown_tiny_model_family_lists_the_vla_backbones_too(tmp_path, capsys):
    """``tiny-model`` builds pi0 and pi05 too; its error listed only the Qwen families."""
    from omni_rl.cli import main

    assert main(["tiny-model", "--family", "pi1", "--out", str(tmp_path / "m")]) == 2
    err = capsys.readouterr().err
    assert "(did you mean 'pi0'?)" in err and err.rstrip().endswith("qwen3_vl, pi0, pi05")


def test_config_check_checks_every_file_and_tiny_model_keeps_a_checkpoint(tmp_path, capsys):
    """config check stopped at its first bad file, leaving the rest unchecked;
    tiny-model --out replaced a checkpoint already there without a word."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("recipe: grpo\ntrainer: {steps: -1}\n")
    good = str(ROOT / "configs" / "grpo_tiny_shapes.yaml")
    assert main(["config", "check", good, str(bad), good]) == 2
    out, err = capsys.readouterr()
    assert out.count("ok: ") == 2 and f"{bad}: trainer.steps" in err
    assert main(["tiny-model", "--family", "qwen2_5_vl", "--out", str(tmp_path / "m")]) == 0
    capsys.readouterr()
    assert main(["tiny-model", "--family", "qwen2_vl", "--out", str(tmp_path / "m")]) == 2
    assert "holds a checkpoint (config.json, model.safetensors); pass --overwrite" in capsys.readouterr().err
    assert "Qwen2_5_VL" in (tmp_path / "m" / "config.json").read_text()
    assert main(["tiny-model", "--family", "qwen2_vl", "--out", str(tmp_path / "m"), "--overwrite"]) == 0
    assert "Qwen2_5_VL" not in (tmp_path / "m" / "config.json").read_text()


def test_rewards_score_refuses_a_gold_it_cannot_read_and_check_an_empty_file(tmp_path, capsys):
    """rewards score printed 0 and exited 0 for a gold its scorer cannot read (the
    reason buried in details.error); rewards check passed an empty file."""
    argv = ["rewards", "score", "--type", "temporal_grounding", "--response", "1 - 2"]
    assert main([*argv, "--answer", "abc"]) == 2
    assert "rewards score: temporal answer 'abc' is not a [start, end] span" in capsys.readouterr().err
    assert main([*argv, "--answer", "[1, 2]"]) == 0
    assert '"accuracy": 1.0' in capsys.readouterr().out
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert main(["rewards", "check", str(empty)]) == 1
    assert f"{empty}: holds no row" in capsys.readouterr().err


def test_a_path_the_system_refuses_is_one_line_naming_it(tmp_path, capsys, monkeypatch):
    """An output under a file, or on a read-only filesystem, ended in a traceback (and
    exit 1 from tiny-model's mkdir, 0 from the console script's view of it)."""
    import errno
    import os

    blocker = tmp_path / "afile"
    blocker.write_text("")
    assert main(["tiny-model", "--family", "qwen2_5_vl", "--out", str(blocker / "m")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"omni-rl: error: {blocker / 'm'}: Not a directory (rerun with --debug for the traceback)"]

    def read_only(path, *_, **__):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))

    monkeypatch.setattr(os, "mkdir", read_only)
    assert main(["tiny-model", "--family", "qwen2_5_vl", "--out", str(tmp_path / "m")]) == 1
    assert f"{tmp_path / 'm'}: Read-only file system" in capsys.readouterr().err
    with pytest.raises(OSError, match="Read-only"):
        main(["tiny-model", "--family", "qwen2_5_vl", "--out", str(tmp_path / "m"), "--debug"])
