"""A LeRobot pi_0 checkpoint converted to the transformers one the flow recipe loads
(``omni_rl.models.lerobot``), on a tiny checkpoint written in LeRobot's layout: its
config.json fields, openpi's weight names under ``model.``, and the normalizer's
statistics beside ``policy_preprocessor.json``, as LeRobot's code names them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from omni_rl.errors import OmniRLError
from omni_rl.models.lerobot import NORMALIZER, convert_lerobot_pi0
from omni_rl.models.pi0 import build_tiny_pi0, normalize

STATE = torch.tensor([0.5, -1.0, 2.0, 0.0, 3.0, 1.0])
STATE_STD = torch.tensor([1.0, 2.0, 0.5, 1.0, 4.0, 0.25])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_pi0(tmp_path_factory.mktemp("tiny"), seed=3)


def lerobot_checkpoint(
    tiny: Path, root: Path, prefix: str = "model.", modes: dict | None = None, drop: str = ""
) -> Path:
    """``tiny``'s weights and shapes as LeRobot's ``save_pretrained`` writes a pi0."""
    root.mkdir(parents=True, exist_ok=True)
    weights = load_file(str(tiny / "model.safetensors"))  # transformers saves under openpi's names
    save_file({prefix + k: v for k, v in weights.items() if not (drop and drop in k)}, str(root / "model.safetensors"))
    config = {
        "type": "pi0",
        "n_obs_steps": 1,
        "chunk_size": 8,
        "n_action_steps": 8,
        "max_state_dim": 8,
        "max_action_dim": 8,
        "num_inference_steps": 4,
        "paligemma_variant": "gemma_2b",
        "action_expert_variant": "gemma_300m",
        "image_resolution": [32, 32],
        "normalization_mapping": {"VISUAL": "IDENTITY", "STATE": "MEAN_STD", "ACTION": "MEAN_STD"},
        "input_features": {"observation.state": {"type": "STATE", "shape": [6]}},
        "output_features": {"action": {"type": "ACTION", "shape": [6]}},
    }
    (root / "config.json").write_text(json.dumps(config))
    state_file = "policy_preprocessor_step_6_normalizer_processor.safetensors"
    norm_map = modes or config["normalization_mapping"]
    steps = [
        {"registry_name": "rename_observations_processor", "config": {"rename_map": {}}},
        {"registry_name": NORMALIZER, "config": {"eps": 1e-8, "norm_map": norm_map}, "state_file": state_file},
    ]
    (root / "policy_preprocessor.json").write_text(json.dumps({"name": "policy_preprocessor", "steps": steps}))
    stats = {
        "observation.state.mean": STATE,
        "observation.state.std": STATE_STD,
        "observation.state.q01": STATE - 1,  # other statistics LeRobot keeps: not read
        "action.mean": -STATE,
        "action.std": 2 * STATE_STD,
    }
    save_file(stats, str(root / state_file))
    return root


@pytest.mark.parametrize("prefix", ["model.", ""])
def test_a_lerobot_pi0_converts_to_the_same_weights_and_its_statistics(tiny, tmp_path, prefix):
    """Under LeRobot's ``model.`` prefix (its save_pretrained) or without it (the
    released files): every weight the same, and the processor normalizes states and
    actions by LeRobot's mean and std."""
    from transformers import AutoProcessor, PI0ForConditionalGeneration

    source = lerobot_checkpoint(tiny, tmp_path / "lerobot", prefix)
    out = convert_lerobot_pi0(source, tmp_path / "out", tokenizer=tiny, sizes=tiny / "config.json")
    want = PI0ForConditionalGeneration.from_pretrained(tiny).state_dict()
    got = PI0ForConditionalGeneration.from_pretrained(out).state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    processor = AutoProcessor.from_pretrained(out)
    x = torch.randn(5, 6)
    torch.testing.assert_close(normalize(processor, "state", x), (x - STATE) / (STATE_STD + 1e-8))
    torch.testing.assert_close(normalize(processor, "actions", x), (x + STATE) / (2 * STATE_STD + 1e-8))
    assert processor.chunk_size == 8 and processor.max_state_dim == 8


def test_what_does_not_convert_is_refused_naming_the_file(tiny, tmp_path):
    quantiles = {"VISUAL": "IDENTITY", "STATE": "QUANTILES", "ACTION": "QUANTILES"}
    source = lerobot_checkpoint(tiny, tmp_path / "q", modes=quantiles)
    with pytest.raises(OmniRLError, match=r"policy_preprocessor.json: STATE is normalized by QUANTILES"):
        convert_lerobot_pi0(source, tmp_path / "out", tokenizer=tiny, sizes=tiny / "config.json")
    source = lerobot_checkpoint(tiny, tmp_path / "missing", drop="state_proj")
    with pytest.raises(OmniRLError, match=r"model.safetensors: 2 missing keys against PI0 \(.*state_proj"):
        convert_lerobot_pi0(source, tmp_path / "out", tokenizer=tiny, sizes=tiny / "config.json")
    source = lerobot_checkpoint(tiny, tmp_path / "pi05")
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "type": "pi05"}))
    with pytest.raises(OmniRLError, match=r"config.json: a LeRobot policy of type 'pi05'; only pi0 converts"):
        convert_lerobot_pi0(source, tmp_path / "out", tokenizer=tiny)
    source = lerobot_checkpoint(tiny, tmp_path / "variant")
    (source / "config.json").write_text(json.dumps({**config, "paligemma_variant": "dummy"}))
    with pytest.raises(OmniRLError, match=r"'paligemma_variant': 'dummy'.*--sizes"):
        convert_lerobot_pi0(source, tmp_path / "out", tokenizer=tiny)
    assert not (tmp_path / "out").exists()  # nothing written by a refused conversion


def test_the_cli_converts_a_lerobot_pi0(tiny, tmp_path, capsys):
    from omni_rl.cli import main

    source = lerobot_checkpoint(tiny, tmp_path / "lerobot")
    out = tmp_path / "out"
    argv = ["convert-policy", str(source), str(out), "--tokenizer", str(tiny), "--sizes", str(tiny / "config.json")]
    assert main(argv) == 0
    assert (out / "model.safetensors").is_file() and "wrote" in capsys.readouterr().out
