"""Tiny offline models of every family: build, load back, forward, backward, generate."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from omni_rl.errors import OmniRLError
from omni_rl.models import FAMILIES, build_tiny, family_of, load, placeholder_token_ids
from omni_rl.models.inputs import IGNORE_INDEX, append_completion, encode_prompts
from omni_rl.preprocess.image import ImageBudget, read_image
from omni_rl.preprocess.synthetic import moving_square, tone, write_image, write_video
from omni_rl.preprocess.video import VideoBudget, read_video

ALL = [
    "qwen2_vl",
    "qwen2_5_vl",
    "qwen3_vl",
    "qwen2_audio",
    "qwen2_5_omni_thinker",
    "qwen3_omni_moe_thinker",
    "qwen2_5_omni",
    "qwen3_omni_moe",
]
# released Omni checkpoints load as their thinker
LOADED_AS = {"qwen2_5_omni": "qwen2_5_omni_thinker", "qwen3_omni_moe": "qwen3_omni_moe_thinker"}
ENCODER_PREFIXES = ("visual", "audio_tower")


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("media")
    write_video(root / "clip.mp4", moving_square("up", 2.0, 15, 128, 96), 15)
    write_image(root / "image.png", np.random.default_rng(0).integers(0, 255, (80, 120, 3), dtype=np.uint8))
    return root


def decoded_clip(media_dir, patch_size: int = 14):
    budget = VideoBudget(patch_size=patch_size, min_pixels=4 * patch_size**2 * 4, max_pixels=32 * patch_size**2 * 4)
    return read_video(media_dir / "clip.mp4", budget)


def media_prompt(family: str, media_dir) -> tuple[list[dict], dict]:
    """A one-prompt conversation with every modality the family takes (Omni: audio and image),
    media decoded by the pipeline for the family's patch size."""
    spec = FAMILIES.get(family)
    content, media = [], {}
    if "image" in spec.modalities:
        content.append({"type": "image"})
        budget = ImageBudget(patch_size=spec.patch_size, max_pixels=64 * spec.patch_size**2 * 4)
        media["images"] = [read_image(media_dir / "image.png", budget).pixels]
    if "video" in spec.modalities and family != "qwen2_5_omni_thinker":
        content.append({"type": "video"})
        media["videos"] = [decoded_clip(media_dir, spec.patch_size)]
    if "audio" in spec.modalities:
        content.append({"type": "audio"})
        media["audios"] = [tone(1.0)]
    content.append({"type": "text", "text": "Describe it."})
    return [{"role": "user", "content": content}], media


def test_every_family_is_registered():
    assert sorted(FAMILIES) == sorted(ALL)


def test_load_refuses_a_decoder_with_sliding_window_layers(tmp_path):
    """The shared-prefix attention attends to every real prompt key and every earlier
    completion key; a decoder whose layers attend within a window would compute
    something else, so it is refused at load, not trained on silently."""
    path = build_tiny("qwen2_5_vl", tmp_path / "model")
    config = json.loads((path / "config.json").read_text())
    config["text_config"].update(use_sliding_window=True, sliding_window=16, max_window_layers=1)
    config["text_config"].pop("layer_types", None)  # as released configs: derived from the window
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(OmniRLError, match="sliding_attention"):
        load(path)


@pytest.mark.parametrize("family", ALL)
def test_tiny_model_forward_backward_generate(family, tiny_checkpoint, media_dir):
    path = tiny_checkpoint(family)
    assert family_of(path).name == family
    model, processor = load(path)
    assert type(model).__name__ == FAMILIES.get(LOADED_AS.get(family, family)).model_class
    assert sum(p.numel() for p in model.parameters()) <= 2_000_000

    messages, media = media_prompt(family, media_dir)
    inputs = encode_prompts(processor, [messages], **media)
    if "videos" in media:
        assert inputs["video_grid_thw"][0, 0].item() == len(media["videos"][0].indices) // 2
    if "audios" in media:
        assert "input_features" in inputs

    # forward + backward: the loss reaches the media encoder
    model.train()
    batch, labels = append_completion(inputs, processor.tokenizer("a cat", return_tensors="pt")["input_ids"])
    loss = model(**batch, labels=labels).loss
    assert torch.isfinite(loss)
    loss.backward()
    encoder_grads = [
        p.grad.abs().sum().item()
        for name, p in model.named_parameters()
        if any(prefix in name for prefix in ENCODER_PREFIXES) and p.grad is not None
    ]
    assert encoder_grads and sum(encoder_grads) > 0

    # generate exactly 16 tokens, none of them a media placeholder
    model.eval()
    banned = placeholder_token_ids(processor)
    assert banned
    with torch.no_grad():
        out = model.generate(
            **inputs,
            max_new_tokens=16,
            min_new_tokens=16,
            do_sample=False,
            suppress_tokens=banned,
            pad_token_id=processor.tokenizer.pad_token_id,
        )
    new = out[0, inputs["input_ids"].shape[1] :]
    assert new.numel() == 16
    assert not set(new.tolist()) & set(banned)


def test_build_is_seeded_and_deterministic(tmp_path):
    a = build_tiny("qwen2_vl", tmp_path / "a", seed=1)
    b = build_tiny("qwen2_vl", tmp_path / "b", seed=1)
    c = build_tiny("qwen2_vl", tmp_path / "c", seed=2)
    weights = [(d / "model.safetensors").read_bytes() for d in (a, b, c)]
    assert weights[0] == weights[1]
    assert weights[0] != weights[2]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_tiny_width_scales_every_family(family, tmp_path):
    model, _ = load(build_tiny(family, tmp_path / "w", width=128))
    wide = sum(p.numel() for p in model.parameters())
    model, _ = load(build_tiny(family, tmp_path / "n", width=64))
    assert wide > 2 * sum(p.numel() for p in model.parameters())
    text = model.config.get_text_config()
    assert text.hidden_size == 64 and text.num_attention_heads * 16 == 64
    with pytest.raises(OmniRLError, match="multiple of 32"):
        build_tiny(family, tmp_path / "bad", width=48)


def test_qwen2_5_vl_uses_mm_token_type_ids_for_3d_positions(tiny_checkpoint, media_dir):
    model, processor = load(tiny_checkpoint("qwen2_5_vl"))
    messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "Where?"}]}]
    inputs = encode_prompts(processor, [messages], videos=[decoded_clip(media_dir)])
    video_id = processor.tokenizer.convert_tokens_to_ids("<|video_pad|>")
    assert torch.equal(inputs["mm_token_type_ids"].bool(), inputs["input_ids"] == video_id)
    with torch.no_grad():
        full = model(**inputs).logits
        without = model(**{k: v for k, v in inputs.items() if k != "mm_token_type_ids"}).logits
    # Without the ids the model falls back to 1-D positions and computes something else.
    assert not torch.allclose(full, without, atol=1e-5)
    # Appended completion tokens are typed as text, so the prompt's logits are unchanged.
    batch, _ = append_completion(inputs, torch.tensor([[100, 101]]))
    with torch.no_grad():
        extended = model(**batch).logits
    torch.testing.assert_close(extended[:, : full.shape[1]], full)


def test_chat_template_dispatches_on_type_for_datasets_style_rows(tiny_checkpoint):
    """Rows read through `datasets` carry every key in every part, with None values."""
    _, processor = load(tiny_checkpoint("qwen2_5_vl"))
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image", "image": None, "video": None, "text": None},
                {"type": "text", "image": None, "video": None, "text": "What is it?"},
            ],
        }
    ]
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.count("<|image_pad|>") == 1
    assert "<|video_pad|>" not in text
    assert text.endswith("What is it?<|im_end|>\n<|im_start|>assistant\n")
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n")


def test_omni_thinker_config_fields(tiny_checkpoint):
    path = tiny_checkpoint("qwen2_5_omni_thinker")
    config = json.loads((path / "config.json").read_text())
    _, processor = load(path)
    tokenizer = processor.tokenizer
    assert config["vision_start_token_id"] == tokenizer.convert_tokens_to_ids("<|vision_bos|>")
    rope = config["text_config"]["rope_parameters"]
    assert rope["rope_type"] == "default"
    assert (
        sum(rope["mrope_section"]) * 2
        == config["text_config"]["hidden_size"] // config["text_config"]["num_attention_heads"]
    )


def test_completion_labels_mask_prompt_and_padding():
    inputs = {"input_ids": torch.tensor([[1, 2, 3]]), "attention_mask": torch.ones(1, 3, dtype=torch.long)}
    batch, labels = append_completion(inputs, torch.tensor([[7, 8, 0]]), torch.tensor([[1, 1, 0]]))
    assert batch["input_ids"].tolist() == [[1, 2, 3, 7, 8, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 1, 0]]
    assert labels.tolist() == [[IGNORE_INDEX] * 3 + [7, 8, IGNORE_INDEX]]


def test_load_rejects_non_checkpoints(tmp_path):
    from omni_rl.errors import OmniRLError

    with pytest.raises(OmniRLError, match=r"no config\.json"):
        load(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(OmniRLError, match="model_type 'llama' is not supported"):
        load(tmp_path)


@pytest.mark.parametrize("family", ALL)
def test_collated_prompts_equal_a_batch_encode(family, tiny_checkpoint, family_prompts):
    from omni_rl.models.inputs import collate_prompts

    _, processor = load(tiny_checkpoint(family))
    together = family_prompts(family, processor)
    singles = [family_prompts(family, processor, only=i) for i in range(2)]
    collated = collate_prompts(singles, processor.tokenizer.pad_token_id)
    assert set(collated) == {k for k, v in together.items() if isinstance(v, torch.Tensor)}
    for key, value in collated.items():
        want = torch.as_tensor(together[key])
        if key in ("input_features", "feature_attention_mask") and family.startswith("qwen3_omni"):
            # Qwen3-Omni pads features to the batch's longest clip with its silence value,
            # and its batch encode clamps every clip's log-mel at the batch's maximum - 8:
            # a clip's features depend on its batch-mates. Encoded alone (as omni_rl does),
            # they do not; collating keeps each prompt's own features, zero-padded and
            # masked.
            for row, single in enumerate(singles):
                width = single[key].shape[-1]
                assert torch.equal(value[row, ..., :width], single[key][0]), key
                assert not value[row, ..., width:].any(), key
            continue
        assert torch.equal(value, want), key
