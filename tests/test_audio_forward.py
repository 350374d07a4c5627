"""Audio and Omni prompts in the shared group forward: the audio encoder runs once per
group, several prompts per batch stay aligned with their own sound, videos heard with
their sound get the model's own interleaved positions, and released Omni checkpoints
train their thinker alone."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from omni_rl.algorithms.losses import token_logprobs
from omni_rl.models import FAMILIES, build_tiny, load
from omni_rl.models.forward import group_forward, reset_rope_deltas, text_positions
from omni_rl.models.inputs import append_completion, collate_prompts, encode_prompts
from omni_rl.preprocess.image import ImageBudget, read_image
from omni_rl.preprocess.synthetic import moving_square, tone, write_image, write_video
from omni_rl.preprocess.video import VideoBudget, read_video
from omni_rl.rollout.hf import HFRolloutEngine, SamplingParams

PER_MEDIUM = {"pixel_values": "image_grid_thw", "pixel_values_videos": "video_grid_thw"}
PER_ITEM = ("input_features", "feature_attention_mask", "video_second_per_grid")


def turn(kind: str | None, question: str) -> list[dict]:
    content = ([{"type": kind}] if kind else []) + [{"type": "text", "text": question}]
    return [{"role": "user", "content": content}]


def expanded(prompt: dict, n: int) -> dict:
    """One encoded prompt with its media copied n times (the naive layout)."""
    out = {k: prompt[k].repeat_interleave(n, 0) for k in ("input_ids", "attention_mask")}
    for key, grid in PER_MEDIUM.items():
        if key in prompt:
            out[key], out[grid] = prompt[key].repeat(n, 1), prompt[grid].repeat(n, 1)
    for key in PER_ITEM:
        if key in prompt:
            out[key] = prompt[key].repeat_interleave(n, 0)
    return out


def per_prompt_logp(model, prompts: list[dict], ids, mask, n: int) -> torch.Tensor:
    """Each prompt alone, G copies of it and its media, through transformers' own forward
    (its own positions, ``use_audio_in_video`` as the prompt says)."""
    out = []
    for b, prompt in enumerate(prompts):
        rows = slice(b * n, (b + 1) * n)
        batch, _ = append_completion(expanded(prompt, n), ids[rows], mask[rows])
        extra = {}
        if "use_audio_in_video" in prompt:
            extra["use_audio_in_video"] = bool(prompt["use_audio_in_video"][0])
        elif (positions := text_positions(model, batch["attention_mask"])) is not None:
            extra["position_ids"] = positions
        reset_rope_deltas(model)
        logits = model(**batch, **extra).logits[:, prompt["input_ids"].shape[1] - 1 : -1]
        out.append(token_logprobs(logits, ids[rows]))
    return torch.cat(out)


def completions(rows: int, length: int = 5, seed: int = 0):
    ids = torch.randint(0, 200, (rows, length), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[1, 3:] = 0
    mask[-1, 1:] = 0
    return ids, mask


def gradients(model, loss_fn) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss_fn().backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def assert_same_values_and_gradients(model, inputs, prompts, n, ids, mask):
    with torch.no_grad():
        shared = group_forward(model, inputs, ids, mask, n).logp
        reference = per_prompt_logp(model, prompts, ids, mask, n)
    torch.testing.assert_close(shared * mask, reference * mask, atol=1e-5, rtol=1e-5)
    model.train()
    weights = torch.linspace(0.5, 1.5, ids.numel()).reshape(ids.shape) * mask  # per-token, like advantages
    got = gradients(model, lambda: (group_forward(model, inputs, ids, mask, n).logp * weights).sum())
    want = gradients(model, lambda: (per_prompt_logp(model, prompts, ids, mask, n) * weights).sum())
    assert got.keys() == want.keys() and any("audio" in name for name in got)
    for name in got:
        torch.testing.assert_close(got[name], want[name], atol=1e-5, rtol=1e-5, msg=name)


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    path = write_video(tmp_path_factory.mktemp("av") / "a.mp4", moving_square("up", 2.0, 10, 96, 64), 10)
    return read_video(path, VideoBudget(patch_size=14, min_pixels=4 * 784, max_pixels=8 * 784, fps=2.0))


def test_three_prompts_of_four_completions_keep_their_own_sound(tiny_checkpoint):
    """3 prompts x G=4 with sounds of different lengths, in one batch: log-probs and
    gradients equal each prompt's own forward with its sound copied G times. A batch
    whose features and feature masks were expanded in different orders fails this."""
    model, processor = load(tiny_checkpoint("qwen2_audio"))
    waves = [tone(0.6, hz=300.0), tone(1.7, hz=900.0), tone(1.1, hz=1500.0)]
    prompts = [dict(encode_prompts(processor, [turn("audio", f"Q{i}?")], audios=[w])) for i, w in enumerate(waves)]
    inputs = collate_prompts(prompts, processor.tokenizer.pad_token_id)
    ids, mask = completions(12)
    assert_same_values_and_gradients(model, inputs, prompts, 4, ids, mask)


@pytest.mark.parametrize("family", ["qwen2_5_omni_thinker", "qwen3_omni_moe_thinker"])
def test_omni_batches_mix_heard_videos_silent_videos_images_and_audio(family, tiny_checkpoint, tmp_path):
    """One Omni batch: a video heard with its sound, the same video without, an image, an
    audio clip, and another heard video. Every prompt's positions are its own (the
    model takes one use_audio_in_video flag per batch); values and gradients equal
    transformers' forward of each prompt alone."""
    model, processor = load(tiny_checkpoint(family))
    patch = FAMILIES.get(family).patch_size
    area = (2 * patch) ** 2
    video = write_video(tmp_path / "a.mp4", moving_square("up", 2.0, 10, 96, 64), 10)
    clip = read_video(video, VideoBudget(patch_size=patch, min_pixels=4 * area, max_pixels=8 * area, fps=2.0))
    image = read_image(
        write_image(tmp_path / "i.png", np.full((60, 90, 3), 200, np.uint8)),
        ImageBudget(patch_size=patch, max_pixels=16 * area),
    ).pixels
    prompts = [
        encode_prompts(processor, [turn("video", "Which way?")], videos=[clip], video_audios=[tone(2.0, hz=300.0)]),
        encode_prompts(processor, [turn("video", "What moves, and where?")], videos=[clip]),
        encode_prompts(processor, [turn("image", "Colour?")], images=[image]),
        encode_prompts(processor, [turn("audio", "Pitch?")], audios=[tone(1.5, hz=800.0)]),
        encode_prompts(processor, [turn("video", "Sound?")], videos=[clip], video_audios=[tone(1.0, hz=600.0)]),
    ]
    prompts = [dict(p) for p in prompts]
    inputs = collate_prompts(prompts, processor.tokenizer.pad_token_id)
    assert inputs["use_audio_in_video"].tolist() == [True, False, False, False, True]
    ids, mask = completions(10, seed=1)
    assert_same_values_and_gradients(model, inputs, prompts, 2, ids, mask)


def test_a_videos_sound_reaches_the_omni_model_interleaved_with_its_frames(tiny_checkpoint, clip):
    model, processor = load(tiny_checkpoint("qwen2_5_omni_thinker"))
    tokenizer = processor.tokenizer
    video_id, audio_id = (tokenizer.convert_tokens_to_ids(t) for t in ("<|VIDEO|>", "<|AUDIO|>"))

    def encoded(sound):
        return dict(encode_prompts(processor, [turn("video", "Heard?")], videos=[clip], video_audios=[sound]))

    low, high, silent = encoded(tone(2.0, hz=300.0)), encoded(tone(2.0, hz=1200.0)), encoded(None)
    ids = low["input_ids"][0].tolist()
    assert audio_id not in silent["input_ids"][0].tolist()
    # frames then their sound, 2-second chunk by chunk, inside one span (2 s of video: one chunk)
    first_audio, last_video = ids.index(audio_id), len(ids) - 1 - ids[::-1].index(video_id)
    assert last_video < first_audio and ids[first_audio - 1] == video_id
    assert not torch.equal(low["input_features"], high["input_features"])
    continuation = torch.tensor([[11, 12, 13]])
    with torch.no_grad():
        logp = [group_forward(model, p, continuation, torch.ones_like(continuation), 1).logp for p in (low, high)]
    assert (logp[0] - logp[1]).abs().max() > 1e-4  # the model hears the difference


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("family", ["qwen2_audio", "qwen2_5_omni_thinker", "qwen3_omni_moe_thinker"])
def test_the_audio_encoder_runs_once_per_batch_in_rollout_and_update(family, checkpointing, tiny_checkpoint):
    model, processor = load(tiny_checkpoint(family))
    if checkpointing:
        model.gradient_checkpointing_enable({"use_reentrant": False})
    waves = [tone(0.5 + 0.4 * i, hz=400.0 * (i + 1)) for i in range(3)]
    prompts = [dict(encode_prompts(processor, [turn("audio", "Which?")], audios=[w])) for w in waves]
    inputs = collate_prompts(prompts, processor.tokenizer.pad_token_id)
    calls = []
    tower = model.audio_tower if hasattr(model, "audio_tower") else model.model.audio_tower
    hook = tower.register_forward_hook(lambda module, args, out: calls.append(args[0].shape))
    with torch.no_grad():
        rollouts = HFRolloutEngine(model, processor).generate(inputs, 4, SamplingParams(max_new_tokens=4), [1, 2, 3])
    assert len(calls) == 1 and rollouts.completion_ids.shape[0] == 12
    model.train()
    ids, mask = completions(12)
    group_forward(model, inputs, ids, mask, 4).logp.sum().backward()
    hook.remove()
    assert len(calls) == 2  # one more for the gradient forward of 12 completions
    assert calls[0] == calls[1] and (calls[1][0] == 3 if family == "qwen2_audio" else True)


@pytest.mark.parametrize(
    ("family", "thinker_family", "vocoder"),
    [("qwen2_5_omni", "qwen2_5_omni_thinker", "token2wav"), ("qwen3_omni_moe", "qwen3_omni_moe_thinker", "code2wav")],
)
def test_a_released_omni_checkpoint_trains_its_thinker_alone(tmp_path, family, thinker_family, vocoder):
    """A released Omni checkpoint (thinker + talker + vocoder) loads as its thinker:
    nothing of the talker is built; saving writes a thinker checkpoint that says what
    it holds, and attach-talker puts it back beside the released talker."""
    from omni_rl.cli import main

    source = build_tiny(family, tmp_path / "released", audio_seconds=4)
    saved = load_file(source / "model.safetensors")
    assert any(k.startswith("talker.") for k in saved) and any(k.startswith(f"{vocoder}.") for k in saved)
    model, _ = load(source)
    assert type(model).__name__ == FAMILIES.get(thinker_family).model_class
    assert not any("talker" in name or vocoder in name for name, _ in model.named_modules())
    # every saved thinker weight is loaded (experts may be fused on load: compare totals)
    thinker_saved = [v for k, v in saved.items() if k.startswith("thinker.")]
    loaded = list(model.state_dict().values())
    assert sum(v.numel() for v in loaded) == sum(v.numel() for v in thinker_saved)
    total = sum(float(v.double().abs().sum()) for v in thinker_saved)
    assert sum(float(v.double().abs().sum()) for v in loaded) == pytest.approx(total, rel=1e-9)
    assert torch.equal(model.lm_head.weight, saved["thinker.lm_head.weight"])

    rows = tmp_path / "data.jsonl"
    write_wav_rows(rows)
    config = {
        "recipe": "sft",
        "run": {"output_dir": str(tmp_path / "run"), "threads": 2},
        "model": {"path": str(source)},
        "media": {"family": family, "max_audio_seconds": 2.0},
        "data": {"train": str(rows), "prompts_per_step": 2},
        "trainer": {"steps": 1, "save_every": 1},
    }
    (tmp_path / "sft.yaml").write_text(json.dumps(config))
    assert main(["train", str(tmp_path / "sft.yaml")]) == 0
    trained = next((tmp_path / "run" / "checkpoints").iterdir()) / "model"
    assert json.loads((trained / "config.json").read_text())["model_type"] == thinker_family
    note = json.loads((trained / "omni_rl_export.json").read_text())
    assert note["source"] == str(source.resolve()) and "thinker only" in note["holds"]
    reloaded, _ = load(trained)  # a thinker checkpoint: it loads as one, weights and all
    thinker = load_file(trained / "model.safetensors")
    assert not any(k.startswith("thinker.") for k in thinker)
    assert torch.equal(reloaded.lm_head.weight, thinker["lm_head.weight"])

    attach = ["attach-talker", "--thinker", str(trained), "--source", str(source), "--out", str(tmp_path / "f")]
    assert main(attach) == 0
    full = load_file(tmp_path / "f" / "model.safetensors")
    assert {k for k in full if not k.startswith("thinker.")} == {k for k in saved if not k.startswith("thinker.")}
    assert all(torch.equal(full[f"thinker.{k}"], v) for k, v in thinker.items())
    assert any(not torch.equal(full[f"thinker.{k}"], saved[f"thinker.{k}"]) for k in thinker)  # it trained
    assert json.loads((tmp_path / "f" / "config.json").read_text())["model_type"] == family


def write_wav_rows(path):
    from omni_rl.preprocess.synthetic import write_wav

    for i in range(2):
        write_wav(path.parent / f"t{i}.wav", tone(1.0, hz=300.0 * (i + 1)))
    rows = [
        {"id": f"r{i}", "problem": "Pitch?", "problem_type": "counting", "answer": i, "audios": [f"t{i}.wav"]}
        for i in range(2)
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
