"""A LeRobot pi_0 or pi_0.5 checkpoint converted to the transformers one the flow recipe
loads (``omni_rl.models.lerobot``), on tiny checkpoints written in LeRobot's layout: its
config.json fields, the weights under the names openpi's and LeRobot's modules give them
(``paligemma_with_expert.paligemma.model.vision_tower.vision_model.*``, the language
model's layers without transformers' inner ``model.``, the embedding stored as the
``lm_head`` it is tied to, pi_0.5's expert ``lm_head`` that nothing reads), under
``model.`` or not, and the normalizer's statistics beside ``policy_preprocessor.json``,
as LeRobot's code names them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from omni_rl.errors import OmniRLError
from omni_rl.models.lerobot import NORMALIZER, convert_lerobot_policy
from omni_rl.models.pi0 import build_tiny_pi0, normalize
from omni_rl.models.pi05 import build_tiny_pi05

STATE = torch.tensor([0.5, -1.0, 2.0, 0.0, 3.0, 1.0])
STATE_STD = torch.tensor([1.0, 2.0, 0.5, 1.0, 4.0, 0.25])
# each family's LeRobot default: pi_0 by mean and std, pi_0.5 by quantiles
MODES = {"pi0": "MEAN_STD", "pi05": "QUANTILES"}
MODEL_CLASS = {"pi0": "PI0ForConditionalGeneration", "pi05": "PI05ForConditionalGeneration"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_pi0(tmp_path_factory.mktemp("tiny"), seed=3)


@pytest.fixture(scope="module")
def tiny05(tmp_path_factory):
    return build_tiny_pi05(tmp_path_factory.mktemp("tiny05"), seed=3)


def openpi_name(name: str) -> str:
    """The name openpi's and LeRobot's modules give a weight that transformers' PI0/PI05
    ``save_pretrained`` writes (it reverses its key mapping into a newer PaliGemma's
    layout): SigLIP under ``vision_model``, the Gemma layers straight under
    ``language_model``, the token embedding as the ``lm_head`` tied to it."""
    name = name.replace("paligemma.model.vision_tower.", "paligemma.model.vision_tower.vision_model.")
    name = name.replace("language_model.model.", "language_model.")
    return name.replace("paligemma.model.language_model.embed_tokens.weight", "paligemma.lm_head.weight")


def lerobot_checkpoint(
    tiny: Path, root: Path, prefix: str = "model.", modes: dict | None = None, drop: str = "", kind: str = "pi0"
) -> Path:
    """``tiny``'s weights and shapes as LeRobot's ``save_pretrained`` writes a ``kind``
    policy (``pi0`` or ``pi05``)."""
    root.mkdir(parents=True, exist_ok=True)
    weights = {openpi_name(k): v for k, v in load_file(str(tiny / "model.safetensors")).items()}
    if kind == "pi05":  # LeRobot's pi_0.5 keeps its expert's lm_head, which PI05 has no use for
        width = weights["action_in_proj.weight"].shape[0]
        vocab = weights["paligemma_with_expert.paligemma.lm_head.weight"].shape[0]
        weights["paligemma_with_expert.gemma_expert.lm_head.weight"] = torch.randn(vocab, width)
    save_file({prefix + k: v for k, v in weights.items() if not (drop and drop in k)}, str(root / "model.safetensors"))
    mode = MODES[kind]
    config = {
        "type": kind,
        "n_obs_steps": 1,
        "chunk_size": 8,
        "n_action_steps": 8,
        "max_state_dim": 8,
        "max_action_dim": 8,
        "num_inference_steps": 4,
        "paligemma_variant": "gemma_2b",
        "action_expert_variant": "gemma_300m",
        "image_resolution": [32, 32],
        "normalization_mapping": {"VISUAL": "IDENTITY", "STATE": mode, "ACTION": mode},
        "input_features": {"observation.state": {"type": "STATE", "shape": [6]}},
        "output_features": {"action": {"type": "ACTION", "shape": [6]}},
    }
    if kind == "pi05":
        config["tokenizer_max_length"] = 200
    (root / "config.json").write_text(json.dumps(config))
    state_file = "policy_preprocessor_step_6_normalizer_processor.safetensors"
    norm_map = modes or config["normalization_mapping"]
    steps = [
        {"registry_name": "rename_observations_processor", "config": {"rename_map": {}}},
        {"registry_name": NORMALIZER, "config": {"eps": 1e-8, "norm_map": norm_map}, "state_file": state_file},
    ]
    (root / "policy_preprocessor.json").write_text(json.dumps({"name": "policy_preprocessor", "steps": steps}))
    stats = {  # LeRobot keeps every statistic; the mode picks what is read
        "observation.state.mean": STATE,
        "observation.state.std": STATE_STD,
        "observation.state.q01": STATE - STATE_STD,
        "observation.state.q99": STATE + 3 * STATE_STD,
        "action.mean": -STATE,
        "action.std": 2 * STATE_STD,
        "action.q01": -STATE - 2 * STATE_STD,
        "action.q99": -STATE,
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
    out = convert_lerobot_policy(source, tmp_path / "out", tokenizer=tiny, sizes=tiny / "config.json")
    want = PI0ForConditionalGeneration.from_pretrained(tiny).state_dict()
    got = PI0ForConditionalGeneration.from_pretrained(out).state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    processor = AutoProcessor.from_pretrained(out)
    x = torch.randn(5, 6)
    torch.testing.assert_close(normalize(processor, "state", x), (x - STATE) / (STATE_STD + 1e-8))
    torch.testing.assert_close(normalize(processor, "actions", x), (x + STATE) / (2 * STATE_STD + 1e-8))
    assert processor.chunk_size == 8 and processor.max_state_dim == 8


@pytest.mark.parametrize("prefix", ["model.", ""])
def test_a_lerobot_pi05_converts_to_the_same_weights_and_its_quantiles(tiny05, tmp_path, prefix):
    """pi_0.5 under LeRobot's names (its expert's unused ``lm_head`` included): every
    PI05 weight the same; the processor is a ``PI05Processor`` that maps states and
    actions to [-1, 1] by LeRobot's 1st and 99th percentiles (LeRobot's own formula,
    written out here), and the policy's observations write the state so normalized into
    the prompt; a flow policy's backbone loads the result."""
    from transformers import AutoProcessor, PI05ForConditionalGeneration

    from omni_rl.models.pi0 import unnormalize
    from omni_rl.models.pi05 import Pi05Backbone, pi05_inputs

    source = lerobot_checkpoint(tiny05, tmp_path / "lerobot", prefix, kind="pi05")
    out = convert_lerobot_policy(source, tmp_path / "out", tokenizer=tiny05, sizes=tiny05 / "config.json")
    want = PI05ForConditionalGeneration.from_pretrained(tiny05).state_dict()
    got = PI05ForConditionalGeneration.from_pretrained(out).state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    processor = AutoProcessor.from_pretrained(out)
    assert type(processor).__name__ == "PI05Processor" and processor.state_mean is None
    x = torch.randn(5, 6)
    low, high = STATE - STATE_STD, STATE + 3 * STATE_STD
    torch.testing.assert_close(normalize(processor, "state", x), 2 * (x - low) / (high - low) - 1)
    low, high = -STATE - 2 * STATE_STD, -STATE
    torch.testing.assert_close(normalize(processor, "actions", x), 2 * (x - low) / (high - low) - 1)
    torch.testing.assert_close(unnormalize(processor, "actions", normalize(processor, "actions", x)), x)
    state = torch.stack([STATE - STATE_STD, STATE + 3 * STATE_STD])  # q01 and q99: -1 and +1
    obs = pi05_inputs(processor, torch.zeros(2, 3, 32, 32, dtype=torch.uint8), ["go", "go"], state)
    prompts = processor.tokenizer.batch_decode(obs.input_ids, skip_special_tokens=True)
    assert "State: 0 0 0 0 0 0" in prompts[0] and "State: 255 255 255 255 255 255" in prompts[1]
    backbone = Pi05Backbone.from_pretrained(out, processor, env_action_dim=6)
    noise = torch.randn(2, 8, 8)
    velocity, _ = backbone.velocity(noise, torch.ones(2), backbone.encode(obs))
    assert velocity.shape == noise.shape and velocity.isfinite().all()


def test_what_does_not_convert_is_refused_naming_the_file(tiny, tiny05, tmp_path):
    quantiles = {"VISUAL": "IDENTITY", "STATE": "QUANTILES", "ACTION": "QUANTILES"}
    source = lerobot_checkpoint(tiny, tmp_path / "q", modes=quantiles)
    with pytest.raises(OmniRLError, match=r"policy_preprocessor.json: STATE is normalized by QUANTILES; PI0Processor"):
        convert_lerobot_policy(source, tmp_path / "out", tokenizer=tiny, sizes=tiny / "config.json")
    minmax = {"VISUAL": "IDENTITY", "STATE": "MIN_MAX", "ACTION": "QUANTILES"}
    source = lerobot_checkpoint(tiny05, tmp_path / "minmax", modes=minmax, kind="pi05")
    with pytest.raises(OmniRLError, match=r"STATE is normalized by MIN_MAX; PI05Processor .* MEAN_STD or QUANTILES"):
        convert_lerobot_policy(source, tmp_path / "out", tokenizer=tiny05, sizes=tiny05 / "config.json")
    source = lerobot_checkpoint(tiny, tmp_path / "missing", drop="state_proj")
    with pytest.raises(OmniRLError, match=r"model.safetensors: 2 missing keys against PI0 \(.*state_proj"):
        convert_lerobot_policy(source, tmp_path / "out", tokenizer=tiny, sizes=tiny / "config.json")
    source = lerobot_checkpoint(tiny05, tmp_path / "missing05", drop="time_mlp_in", kind="pi05")
    with pytest.raises(OmniRLError, match=r"model.safetensors: 2 missing keys against PI05 \(.*time_mlp_in"):
        convert_lerobot_policy(source, tmp_path / "out", tokenizer=tiny05, sizes=tiny05 / "config.json")
    source = lerobot_checkpoint(tiny, tmp_path / "smolvla")
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "type": "smolvla"}))
    with pytest.raises(OmniRLError, match=r"config.json: a LeRobot policy of type 'smolvla'; only \['pi0', 'pi05'\]"):
        convert_lerobot_policy(source, tmp_path / "out", tokenizer=tiny)
    (source / "config.json").write_text(json.dumps({**config, "type": "pi05", "tokenizer_max_length": 48}))
    with pytest.raises(OmniRLError, match=r"config.json: tokenizer_max_length 48; .* 200"):
        convert_lerobot_policy(source, tmp_path / "out", tokenizer=tiny)
    source = lerobot_checkpoint(tiny, tmp_path / "variant")
    (source / "config.json").write_text(json.dumps({**config, "paligemma_variant": "dummy"}))
    with pytest.raises(OmniRLError, match=r"'paligemma_variant': 'dummy'.*--sizes"):
        convert_lerobot_policy(source, tmp_path / "out", tokenizer=tiny)
    source = lerobot_checkpoint(tiny05, tmp_path / "half", kind="pi05")
    stats = next(source.glob("*normalizer_processor.safetensors"))
    save_file({k: v for k, v in load_file(str(stats)).items() if k != "action.q99"}, str(stats))
    with pytest.raises(OmniRLError, match=r"normalizer_processor.safetensors: QUANTILES needs action.q01 and q99"):
        convert_lerobot_policy(source, tmp_path / "out", tokenizer=tiny05, sizes=tiny05 / "config.json")
    assert not (tmp_path / "out").exists()  # nothing written by a refused conversion


@pytest.mark.parametrize("kind", ["pi0", "pi05"])
def test_the_cli_converts_a_lerobot_policy(tiny, tiny05, tmp_path, capsys, kind):
    from omni_rl.cli import main

    model = {"pi0": tiny, "pi05": tiny05}[kind]
    source = lerobot_checkpoint(model, tmp_path / "lerobot", kind=kind)
    out = tmp_path / "out"
    argv = ["convert-policy", str(source), str(out), "--tokenizer", str(model), "--sizes", str(model / "config.json")]
    assert main(argv) == 0
    assert json.loads((out / "config.json").read_text())["architectures"] == [MODEL_CLASS[kind]]
    assert "wrote" in capsys.readouterr().out


def gemma_style_tokenizer(out: Path) -> Path:
    """A small tokenizer of PaliGemma's kind, written where ``--tokenizer`` reads it:
    transformers' ``GemmaTokenizer`` (SentencePiece's BPE as a tokenizer.json: ``▁`` for
    spaces, no dummy prefix, byte fallback), with the words of PixelTargets'
    instructions merged into pieces."""
    from transformers import GemmaTokenizer

    vocab = {token: i for i, token in enumerate(["<pad>", "<eos>", "<bos>", "<unk>"])}
    vocab.update({f"<0x{b:02X}>": 4 + b for b in range(256)})
    for piece in ["▁", *"abcdefghijklmnopqrstuvwxyz"]:
        vocab[piece] = len(vocab)
    merges = []
    for word in ["go", "to", "the", "red", "blue", "target"]:
        piece = "▁"
        for letter in word:
            merges.append((piece, letter))
            piece += letter
            vocab.setdefault(piece, len(vocab))
    GemmaTokenizer(vocab=vocab, merges=merges).save_pretrained(out)
    return out


def test_a_pi0_converts_with_a_sentencepiece_style_tokenizer_and_reads_its_pieces(tmp_path):
    """PaliGemma's tokenizer path, offline: a tiny pi0 whose vocabulary is a
    SentencePiece-style Gemma tokenizer's converts with ``--tokenizer`` pointing at it;
    the processor keeps the GemmaTokenizer, its image placeholder is the model's, and an
    observation's prompt holds the instruction's pieces (``▁red``, bytes for what the
    vocabulary lacks) after the image tokens and ``<bos>``."""
    from transformers import AutoProcessor, AutoTokenizer, PI0Processor

    from omni_rl.models.pi0 import Pi0Backbone, pi0_inputs, save_seeded, tiny_pi0_config, tiny_pi0_processor

    words = gemma_style_tokenizer(tmp_path / "paligemma")
    processor = PI0Processor(
        tiny_pi0_processor().image_processor, AutoTokenizer.from_pretrained(words), max_state_dim=8, chunk_size=8
    )
    config = tiny_pi0_config(len(processor.tokenizer), processor.image_token_id)
    tiny = save_seeded("PI0ForConditionalGeneration", config, processor, tmp_path / "tiny", seed=3)
    source = lerobot_checkpoint(tiny, tmp_path / "lerobot")
    out = convert_lerobot_policy(source, tmp_path / "out", tokenizer=words, sizes=tiny / "config.json")

    converted = AutoProcessor.from_pretrained(out)
    assert type(converted.tokenizer).__name__ == "GemmaTokenizer"
    assert converted.image_token_id == processor.image_token_id == config.vlm_config.image_token_id
    images = torch.zeros(2, 3, 32, 32, dtype=torch.uint8)
    obs = pi0_inputs(converted, images, ["go to the red target", "go to the purple target"], torch.zeros(2, 6))
    text = obs.input_ids[0][obs.input_ids[0] != converted.image_token_id]
    pieces = converted.tokenizer.convert_ids_to_tokens(text[obs.attention_mask[0][16:].bool()].tolist())
    assert pieces == ["<bos>", "g", "o", "▁to", "▁the", "▁red", "▁target", "<0x0A>"]
    assert "p" in converted.tokenizer.convert_ids_to_tokens(obs.input_ids[1].tolist())  # a word it lacks, spelled
    backbone = Pi0Backbone.from_pretrained(out, converted, env_action_dim=6)
    x = torch.randn(2, 8, 8)
    velocity, _ = backbone.velocity(x, torch.ones(2), backbone.encode(obs))
    assert velocity.shape == x.shape and velocity.isfinite().all()
