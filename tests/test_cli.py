"""The console script as a user runs it: exit codes, one-line errors, help."""

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


def test_debug_shows_the_traceback(capsys):
    from omni_rl.errors import ConfigError

    with pytest.raises(ConfigError):
        main(["--debug", "config", "check", "configs/does-not-exist.yaml"])
    assert main(["config", "check", "configs/does-not-exist.yaml"]) == 2
    assert "cannot read config" in capsys.readouterr().err


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
