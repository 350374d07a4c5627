"""The vLLM rollout engine: request building, sampling parameters and packaging are
checked everywhere; the engine itself runs where vllm and a GPU are installed."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from omni_rl.config import config_from_dict
from omni_rl.data.dataset import Sample
from omni_rl.errors import OmniRLError
from omni_rl.models import load, placeholder_token_ids
from omni_rl.preprocess.synthetic import moving_square, write_video
from omni_rl.preprocess.video import VideoBudget, read_video
from omni_rl.rollout import build_engine
from omni_rl.rollout.hf import SamplingParams
from omni_rl.rollout.vllm import BAN, package, request, sampling_kwargs

HAS_VLLM = importlib.util.find_spec("vllm") is not None


def _video_sample(tmp_path) -> Sample:
    write_video(tmp_path / "a.mp4", moving_square("up", 2.0, 10, 96, 64), 10)
    clip = read_video(tmp_path / "a.mp4", VideoBudget(patch_size=14, min_pixels=4 * 784, max_pixels=8 * 784))
    messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "Which way?"}]}]
    return Sample("a", "multiple_choice", "A", messages, videos=[clip], options=["up", "down"])


def test_request_has_one_placeholder_and_the_cached_frames(tmp_path, tiny_checkpoint):
    _, processor = load(tiny_checkpoint("qwen2_5_vl"))
    sample = _video_sample(tmp_path)
    got = request(processor, sample)
    assert got["prompt"].count("<|video_pad|>") == 1  # vLLM expands it from the frames
    assert got["prompt"].endswith("<|im_start|>assistant\n")
    frames, metadata = got["multi_modal_data"]["video"]
    clip = sample.videos[0]
    assert frames.dtype == np.uint8 and frames.shape == (len(clip.indices), *clip.frames.shape[2:], 3)
    np.testing.assert_array_equal(frames, clip.frames.transpose(0, 2, 3, 1))
    assert metadata["fps"] == clip.fps and metadata["frames_indices"] == clip.indices


def test_request_for_several_media_lists_them():
    image = np.zeros((28, 28, 3), dtype=np.uint8)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "?"}]}]
    sample = Sample("b", "counting", 2, messages, images=[image, image], audios=[np.zeros(160, np.float32)])
    processor = SimpleNamespace(apply_chat_template=lambda m, **_: "PROMPT")
    got = request(processor, sample)
    assert got["prompt"] == "PROMPT"
    assert len(got["multi_modal_data"]["image"]) == 2
    waveform, rate = got["multi_modal_data"]["audio"]
    assert rate == 16_000 and waveform.shape == (160,)


def test_sampling_kwargs_match_the_hf_engine():
    kwargs = sampling_kwargs(SamplingParams(0.7, 0.9, 20, 64), 8, [1, 2], [5, 6], seed=3)
    assert kwargs["n"] == 8 and kwargs["max_tokens"] == 64 and kwargs["logprobs"] == 0
    assert (kwargs["temperature"], kwargs["top_p"], kwargs["top_k"]) == (0.7, 0.9, 20)
    assert kwargs["logit_bias"] == {5: BAN, 6: BAN} and kwargs["stop_token_ids"] == [1, 2]
    greedy = sampling_kwargs(SamplingParams(0.0, 0.5, 7, 4), 1, [1], [], seed=0)
    assert (greedy["temperature"], greedy["top_p"], greedy["top_k"]) == (0.0, 1.0, 0)


def _completion(tokens, logps, reason):
    steps = [{t: SimpleNamespace(logprob=lp)} for t, lp in zip(tokens, logps, strict=True)]
    return SimpleNamespace(token_ids=tokens, logprobs=steps, finish_reason=reason, text=f"t{len(tokens)}")


def test_package_pads_masks_and_keeps_sampled_logprobs():
    outputs = [
        SimpleNamespace(outputs=[_completion([7, 8, 2], [-0.1, -0.2, -0.3], "stop"), _completion([9], [-1.0], "stop")]),
        SimpleNamespace(outputs=[_completion([4, 4, 4, 4], [-0.5] * 4, "length"), _completion([], [], "stop")]),
    ]
    got = package(outputs, n=2, pad_id=0, stop_ids=[2])
    assert got.completion_ids.tolist() == [[7, 8, 2, 0], [9, 0, 0, 0], [4, 4, 4, 4], [0, 0, 0, 0]]
    assert got.completion_mask.tolist() == [[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]]
    assert got.lengths.tolist() == [3, 1, 4, 0]
    assert torch.allclose(got.logprobs[0], torch.tensor([-0.1, -0.2, -0.3, 0.0]))
    assert got.finish_reasons == ["stop", "stop", "length", "stop"]
    assert got.truncated.tolist() == [False, False, True, False]
    assert got.texts == ["t3", "t1", "t4", "t0"] and got.group_size == 2


def test_package_rejects_a_wrong_group_size():
    outputs = [SimpleNamespace(outputs=[_completion([1], [-0.1], "stop")])]
    with pytest.raises(OmniRLError, match="expected 2"):
        package(outputs, n=2, pad_id=0, stop_ids=[1])


def _grpo_config(tmp_path, engine: str):
    return config_from_dict(
        {
            "recipe": "grpo",
            "run": {"output_dir": str(tmp_path / "run"), "seed": 0},
            "data": {"train": str(tmp_path / "rows.jsonl")},
            "rollout": {"engine": engine, "n": 4, "max_new_tokens": 8, "vllm": {"gpu_memory_utilization": 0.3}},
        },
        "test",
    )


@pytest.mark.skipif(HAS_VLLM, reason="vllm is installed here; the engine test below runs instead")
def test_vllm_engine_without_vllm_says_how_to_get_it(tmp_path, tiny_checkpoint):
    model, processor = load(tiny_checkpoint("qwen2_5_vl"))
    with pytest.raises(OmniRLError, match=r"omni-rl\[vllm\].*rollout.engine: hf"):
        build_engine(_grpo_config(tmp_path, "vllm"), model, processor, tiny_checkpoint("qwen2_5_vl"))


@pytest.mark.skipif(not (HAS_VLLM and torch.cuda.is_available()), reason="needs vllm and a CUDA GPU")
def test_vllm_engine_samples_groups_and_follows_weight_updates(tmp_path, tiny_checkpoint):
    path = tiny_checkpoint("qwen2_5_vl")
    model, processor = load(path, device="cuda", dtype=torch.bfloat16)
    engine = build_engine(_grpo_config(tmp_path, "vllm"), model, processor, path)
    samples = [_video_sample(tmp_path)] * 2
    got = engine.rollout(samples, [], 4, SamplingParams(1.0, 1.0, 0, 8), seeds=[1, 2])
    assert got.completion_ids.shape[0] == 8 and got.group_size == 4
    assert not torch.isin(got.completion_ids, torch.tensor(placeholder_token_ids(processor))).any()
    assert (got.logprobs[got.completion_mask == 0] == 0).all() and (got.logprobs[got.completion_mask == 1] <= 0).all()
    greedy = SamplingParams(0.0, 1.0, 0, 8)
    before = engine.rollout(samples[:1], [], 1, greedy, seeds=[0]).completion_ids
    with torch.no_grad():
        model.lm_head.weight.mul_(-1.0)  # a different policy must give different greedy text
    engine.load_weights(model)
    after = engine.rollout(samples[:1], [], 1, greedy, seeds=[0]).completion_ids
    assert not torch.equal(before, after)
