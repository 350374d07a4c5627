"""The vLLM rollout engine: request building, prompt parity, sampling parameters,
finish reasons, engine arguments, config validation, bucketed weight gathering and the
sleep/sync/reset order (against a stand-in for ``vllm.LLM``) are checked everywhere;
the engine itself runs where vllm and a GPU are installed (and in
``tools/gpu_smoke_vllm.py``)."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from omni_rl.config import ConfigError
from omni_rl.data.dataset import Sample
from omni_rl.errors import OmniRLError
from omni_rl.models import load, placeholder_token_ids
from omni_rl.preprocess.synthetic import moving_square, write_video
from omni_rl.preprocess.video import VideoBudget, read_video
from omni_rl.recipe_loader import config_from_dict
from omni_rl.rollout import build_rollout_engine
from omni_rl.rollout import vllm as engine_module
from omni_rl.rollout.hf import SamplingParams
from omni_rl.rollout.vllm import (
    BAN,
    VLLMRolloutEngine,
    check_prompts,
    engine_arguments,
    full_weights,
    max_positions,
    package,
    request,
    sampling_kwargs,
)

HAS_VLLM = importlib.util.find_spec("vllm") is not None


def _video_sample(tmp_path) -> Sample:
    write_video(tmp_path / "a.mp4", moving_square("up", 2.0, 10, 96, 64), 10)
    clip = read_video(tmp_path / "a.mp4", VideoBudget(patch_size=14, min_pixels=4 * 784, max_pixels=8 * 784))
    messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "Which way?"}]}]
    return Sample("a", "multiple_choice", "A", messages, videos=[clip], options=["up", "down"])


def _video_sample(tmp_path) -> Sample:
    write_video(tmp_path / "a.mp4", moving_square("up", 2.0, 10, 96, 64), 10)
    clip = read_video(tmp_path / "a.mp4", VideoBudget(patch_size=14, min_pixels=4 * 784, max_pixels=8 * 784))
    messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "Which way?"}]}]
    return Sample("a", "multiple_choice", "A", messages, videos=[clip], options=["up", "down"])


# ------------------------------------------------------------------------ requests


def test_request_has_one_placeholder_the_cached_frames_and_keeps_them_as_they_are(tmp_path, tiny_checkpoint):
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
    # what the trainer's processor call is told too: no resize, no second frame sampling
    assert got["mm_processor_kwargs"] == {"do_resize": False, "do_sample_frames": False}


def test_request_for_several_media_lists_them():
    image = np.zeros((28, 28, 3), dtype=np.uint8)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "?"}]}]
    sample = Sample("b", "counting", 2, messages, images=[image, image], audios=[np.zeros(160, np.float32)])
    processor = SimpleNamespace(apply_chat_template=lambda m, **_: "PROMPT")
    got = request(processor, sample)
    assert got["prompt"] == "PROMPT" and got["mm_processor_kwargs"] == {"do_resize": False}
    assert len(got["multi_modal_data"]["image"]) == 2
    waveform, rate = got["multi_modal_data"]["audio"]
    assert rate == 16_000 and waveform.shape == (160,)


def test_a_processor_that_samples_frames_by_default_keeps_the_cached_ones(tmp_path, tiny_checkpoint):
    """Released Qwen3-VL processors sample frames again unless told not to; with the
    shared media arguments the token count is that of the cached frames."""
    from omni_rl.data.dataset import encode_sample

    _, processor = load(tiny_checkpoint("qwen3_vl"))
    write_video(tmp_path / "a.mp4", moving_square("up", 2.0, 10, 96, 64), 10)
    clip = read_video(tmp_path / "a.mp4", VideoBudget(patch_size=16, min_pixels=4 * 1024, max_pixels=8 * 1024))
    messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "?"}]}]
    sample = Sample("a", "multiple_choice", "A", messages, videos=[clip], options=["up", "down"])
    kept = encode_sample(processor, sample)["input_ids"].shape[1]
    processor.video_processor.do_sample_frames = True
    assert encode_sample(processor, sample)["input_ids"].shape[1] == kept


def test_sampling_kwargs_match_the_hf_engine():
    kwargs = sampling_kwargs(SamplingParams(0.7, 0.9, 20, 64), 8, [1, 2], [5, 6], seed=3)
    assert kwargs["n"] == 8 and kwargs["max_tokens"] == 64 and kwargs["logprobs"] == 0
    assert (kwargs["temperature"], kwargs["top_p"], kwargs["top_k"]) == (0.7, 0.9, 20)
    assert kwargs["logit_bias"] == {5: BAN, 6: BAN} and kwargs["stop_token_ids"] == [1, 2]
    assert kwargs["seed"] == 3  # children get 3 + g (vLLM's rule; the recipe's seeds step by G)
    greedy = sampling_kwargs(SamplingParams(0.0, 0.5, 7, 4), 1, [1], [], seed=0)
    assert (greedy["temperature"], greedy["top_p"], greedy["top_k"]) == (0.0, 1.0, 0)


# ------------------------------------------------------------------------ outputs


def _completion(tokens, logps, reason):
    steps = [{t: SimpleNamespace(logprob=lp)} for t, lp in zip(tokens, logps, strict=True)]
    return SimpleNamespace(token_ids=tokens, logprobs=steps, finish_reason=reason, text=f"t{len(tokens)}")


def test_package_pads_masks_and_keeps_sampled_logprobs():
    outputs = [
        SimpleNamespace(outputs=[_completion([7, 8, 2], [-0.1, -0.2, -0.3], "stop"), _completion([9], [-1.0], "stop")]),
        SimpleNamespace(outputs=[_completion([4, 4, 4, 4], [-0.5] * 4, "length"), _completion([], [], "stop")]),
    ]
    got = package(outputs, n=2, pad_id=0)
    assert got.completion_ids.tolist() == [[7, 8, 2, 0], [9, 0, 0, 0], [4, 4, 4, 4], [0, 0, 0, 0]]
    assert got.completion_mask.tolist() == [[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]]
    assert got.lengths.tolist() == [3, 1, 4, 0]
    assert torch.allclose(got.logprobs[0], torch.tensor([-0.1, -0.2, -0.3, 0.0]))
    assert got.finish_reasons == ["stop", "stop", "length", "stop"]
    assert got.truncated.tolist() == [False, False, True, False]
    assert got.texts == ["t3", "t1", "t4", "t0"] and got.group_size == 2


@pytest.mark.parametrize("reason", ["abort", "error", "repetition"])
def test_an_aborted_or_failed_completion_is_an_error_naming_the_row_not_a_truncation(reason):
    outputs = [SimpleNamespace(outputs=[_completion([1], [-0.1], "stop"), _completion([2, 3], [-0.1, -0.2], reason)])]
    samples = [Sample("row-17", "counting", 1, [])]
    with pytest.raises(OmniRLError, match=rf"row row-17: vLLM ended completion 1 with finish_reason '{reason}'"):
        package(outputs, n=2, pad_id=0, samples=samples)


def test_package_rejects_a_wrong_group_size():
    outputs = [SimpleNamespace(outputs=[_completion([1], [-0.1], "stop")])]
    with pytest.raises(OmniRLError, match="expected 2"):
        package(outputs, n=2, pad_id=0)


def test_prompt_token_ids_are_checked_against_the_trainers(tmp_path, tiny_checkpoint):
    from omni_rl.data.dataset import encode_sample

    _, processor = load(tiny_checkpoint("qwen2_5_vl"))
    sample = _video_sample(tmp_path)
    inputs = dict(encode_sample(processor, sample))
    ids = inputs["input_ids"][0].tolist()
    check_prompts([SimpleNamespace(prompt_token_ids=ids)], [sample], [inputs])
    video = processor.tokenizer.convert_tokens_to_ids("<|video_pad|>")
    one_more = [*ids[: ids.index(video)], video, *ids[ids.index(video) :]]  # one extra video token
    with pytest.raises(OmniRLError, match=r"row a: vLLM's prompt has \d+ tokens and the trainer's \d+.*media"):
        check_prompts([SimpleNamespace(prompt_token_ids=one_more)], [sample], [inputs])


# ------------------------------------------------------------ settings and limits


def _grpo_config(tmp_path, engine: str, **rollout):
    vllm = {"gpu_memory_utilization": 0.3, "max_model_len": 2048, **rollout.pop("vllm", {})}
    section = {"engine": engine, "n": 4, "max_new_tokens": 8, "max_prompt_length": 1024, "vllm": vllm, **rollout}
    return config_from_dict(
        {
            "recipe": "grpo",
            "run": {"output_dir": str(tmp_path / "run"), "seed": 0},
            "data": {"train": str(tmp_path / "rows.jsonl")},
            "rollout": section,
        },
        "test",
    )


def test_max_model_len_must_hold_the_longest_prompt_and_completion(tmp_path):
    with pytest.raises(ConfigError, match=r"vllm\.max_model_len: 32768 is less than .* = 41024.*31744"):
        _grpo_config(tmp_path, "vllm", max_prompt_length=40000, max_new_tokens=1024, vllm={"max_model_len": 32768})
    # the hf engine has no such limit
    _grpo_config(tmp_path, "hf", max_prompt_length=40000, max_new_tokens=1024, vllm={"max_model_len": 32768})


def test_tensor_parallel_rollout_is_a_config_error_that_says_what_to_do(tmp_path):
    with pytest.raises(ConfigError, match=r"tensor_parallel_size: .*each rank runs its own vLLM engine.*torchrun"):
        _grpo_config(tmp_path, "vllm", vllm={"tensor_parallel_size": 2})


def test_engine_arguments_colocate_with_sleep_mode_and_the_launchers_processes(tmp_path):
    rollout = _grpo_config(tmp_path, "vllm").rollout
    alone = engine_arguments(rollout, "ckpt", seed=3, lora_rank=0, launched=False)
    assert alone["enable_sleep_mode"] and alone["generation_config"] == "vllm"
    assert alone["logprobs_mode"] == "processed_logprobs" and alone["max_model_len"] == 2048
    assert "distributed_executor_backend" not in alone and "enable_lora" not in alone
    ranked = engine_arguments(rollout, "ckpt", seed=3, lora_rank=16, launched=True)
    assert ranked["distributed_executor_backend"] == "external_launcher"
    assert (ranked["enable_lora"], ranked["max_lora_rank"], ranked["max_loras"]) == (True, 16, 1)
    # vLLM serves a fixed set of ranks: an adapter of rank 4 fits in its rank-8 slots
    assert engine_arguments(rollout, "ckpt", seed=3, lora_rank=4, launched=False)["max_lora_rank"] == 8
    with pytest.raises(OmniRLError, match="exceeds vLLM's largest adapter rank 512"):
        engine_arguments(rollout, "ckpt", seed=3, lora_rank=600, launched=False)


def test_full_weights_come_in_bf16_buckets_covering_the_state(tiny_checkpoint):
    model, _ = load(tiny_checkpoint("qwen2_5_vl"))
    state = model.state_dict()
    buckets = list(full_weights(model, bucket_bytes=64 * 1024))
    assert len(buckets) > 1
    names = [name for bucket in buckets for name, _ in bucket]
    assert names == list(state)
    for bucket in buckets[:-1]:  # a bucket closes at the first tensor that reaches the size
        sizes = [t.numel() * t.element_size() for _, t in bucket]
        assert sum(sizes[:-1]) < 64 * 1024 <= sum(sizes)
    for name, tensor in (pair for bucket in buckets for pair in bucket):
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, state[name].to(torch.bfloat16))


# --------------------------------------- the engine's order of calls (vLLM stood in)


class FakeLLM:
    """Stands in for ``vllm.LLM`` on CPUs: records the calls the engine makes and
    loads weights into a real copy of the model the way vLLM's ``load_weights`` does
    (returning the names it loaded). ``skip``: a parameter it never loads."""

    skip: str | None = None

    def __init__(self, **kwargs):
        self.kwargs, self.calls = kwargs, []
        self.model, _ = load(kwargs["model"])
        self.model.load_weights = self._load
        self.llm_engine = SimpleNamespace(reset_encoder_cache=lambda: self.calls.append("reset_encoder_cache"))

    def _load(self, weights):
        params = dict(self.model.named_parameters())
        loaded = set()
        for name, tensor in weights:
            if name in params and name != self.skip:
                params[name].data.copy_(tensor)
                loaded.add(name)
        return loaded

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self, tags):
        self.calls.append(("wake_up", tuple(tags)))

    def apply_model(self, func):
        self.calls.append("apply_model")
        return [func(self.model)]

    def reset_prefix_cache(self):
        self.calls.append("reset_prefix_cache")

    def reset_mm_cache(self):
        self.calls.append("reset_mm_cache")


@pytest.fixture
def fake_vllm(monkeypatch):
    module = SimpleNamespace(
        LLM=FakeLLM,
        SamplingParams=dict,
        lora=SimpleNamespace(request=SimpleNamespace(LoRARequest=lambda *a: a)),
    )
    monkeypatch.setitem(__import__("sys").modules, "vllm", module)
    return module


def _engine(tmp_path, model, path, free_gb: float = 60, **vllm) -> VLLMRolloutEngine:
    """An engine on the stand-in, started as if on an 80 GiB GPU with ``free_gb`` free."""
    _, processor = load(path)
    rollout = _grpo_config(tmp_path, "vllm", vllm=vllm).rollout
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.cuda, "is_available", lambda: True)
        patch.setattr(torch.cuda, "mem_get_info", lambda: (free_gb * 2**30, 80 * 2**30))
        return VLLMRolloutEngine(path, processor, rollout, model, tmp_path)


def test_a_sleeping_engine_wakes_weights_syncs_resets_caches_then_wakes_kv(tmp_path, tiny_checkpoint, fake_vllm):
    path = tiny_checkpoint("qwen2_5_vl")
    policy, _ = load(path)
    engine = _engine(tmp_path, policy, path, sync_bucket_mb=1)
    assert engine.llm.kwargs["enable_sleep_mode"] and engine.max_prompt_tokens(None) == 1024
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.5)
    engine.sleep()
    with pytest.raises(OmniRLError, match="asleep"):
        engine.rollout([], [], 4, SamplingParams(), [])
    engine.load_weights(policy)
    calls = engine.llm.calls
    syncs = calls.count("apply_model") - 1  # the last one lists vLLM's parameters
    assert syncs >= 1
    assert calls == [
        ("sleep", 2),  # a full fine-tune: weights and KV cache dropped
        ("wake_up", ("weights",)),
        *["apply_model"] * (syncs + 1),
        "reset_prefix_cache",
        "reset_mm_cache",
        "reset_encoder_cache",
        ("wake_up", ("kv_cache",)),
    ]
    served = dict(engine.llm.model.named_parameters())
    for name, p in policy.named_parameters():
        assert torch.equal(served[name], p.detach().to(torch.bfloat16).float()), name
    engine.llm.calls.clear()
    engine.load_weights(policy)  # awake: no wake-ups, still the resets
    assert ("wake_up", ("weights",)) not in engine.llm.calls and "reset_encoder_cache" in engine.llm.calls


def test_a_sync_that_misses_a_parameter_is_an_error(tmp_path, tiny_checkpoint, fake_vllm, monkeypatch):
    path = tiny_checkpoint("qwen2_5_vl")
    policy, _ = load(path)
    name = next(n for n, _ in policy.named_parameters() if n.endswith("q_proj.weight"))
    monkeypatch.setattr(FakeLLM, "skip", name)
    engine = _engine(tmp_path, policy, path)
    with pytest.raises(OmniRLError, match=rf"left 1 of vLLM's parameters unloaded.*{name}"):
        engine.load_weights(policy)


def _lora_policy(path, targets):
    from peft import LoraConfig, get_peft_model

    model, _ = load(path)
    return get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=targets, init_lora_weights=False))


def test_lora_syncs_the_adapter_alone_as_a_new_lora_request(tmp_path, tiny_checkpoint, fake_vllm):
    from peft import PeftModel
    from safetensors.torch import load_file

    path = tiny_checkpoint("qwen2_5_vl")
    policy = _lora_policy(path, ["q_proj", "v_proj"])
    engine = _engine(tmp_path, policy, path)
    assert engine.llm.kwargs["enable_lora"] and engine.llm.kwargs["max_lora_rank"] == 8
    base = {n: p.clone() for n, p in engine.llm.model.named_parameters()}
    engine.sleep()
    engine.load_weights(policy)
    assert engine.llm.calls[0] == ("sleep", 1)  # LoRA: the base is offloaded, not dropped
    assert "apply_model" not in engine.llm.calls
    name, version, adapter_dir = engine.lora_request
    assert (name, version) == ("policy-v1", 1)
    tensors = load_file(f"{adapter_dir}/adapter_model.safetensors")
    assert tensors and all("lora_" in k for k in tensors)
    engine.load_weights(policy)
    assert engine.lora_request[1] == 2 and not (tmp_path / "vllm_lora" / "rank0" / "v1").exists()
    for n, p in engine.llm.model.named_parameters():
        assert torch.equal(p, base[n])  # the served base weights are never touched
    reloaded = PeftModel.from_pretrained(load(path)[0], engine.lora_request[2])
    theirs = {k: v for k, v in reloaded.state_dict().items() if "lora_" in k}
    for k, v in policy.state_dict().items():
        if "lora_" in k:
            assert torch.equal(theirs[k], v), k


def test_adapters_on_the_vision_tower_are_refused(tmp_path, tiny_checkpoint, fake_vllm):
    path = tiny_checkpoint("qwen2_5_vl")
    policy = _lora_policy(path, ["q_proj", "qkv"])  # qkv: the vision blocks' attention
    with pytest.raises(OmniRLError, match=r"language model only.*visual"):
        _engine(tmp_path, policy, path)


def test_the_engine_checks_positions_and_free_memory_before_starting(tmp_path, tiny_checkpoint, fake_vllm):
    path = tiny_checkpoint("qwen2_5_vl")
    policy, _ = load(path)
    assert max_positions(policy) == 4096
    with pytest.raises(OmniRLError, match=r"max_model_len=8192 exceeds the model's 4096 positions"):
        _engine(tmp_path, policy, path, max_model_len=8192)
    with pytest.raises(OmniRLError, match=r"asks for 24.0 GiB, but only 20.0 GiB .* at most 0.23"):
        _engine(tmp_path, policy, path, free_gb=20)


def test_engine_module_imports_without_vllm():
    assert engine_module.FINISHED == ("stop", "length")


# ------------------------------------------------------------ the real engine


@pytest.mark.skipif(HAS_VLLM, reason="vllm is installed here; the engine test below runs instead")
def test_vllm_engine_without_vllm_says_how_to_get_it(tmp_path, tiny_checkpoint):
    path = tiny_checkpoint("qwen2_5_vl")
    model, processor = load(path)
    with pytest.raises(OmniRLError, match=r"omni-rl\[vllm\].*rollout.engine: hf"):
        build_rollout_engine(_grpo_config(tmp_path, "vllm"), model, processor, path, tmp_path)


@pytest.mark.skipif(not (HAS_VLLM and torch.cuda.is_available()), reason="needs vllm and a CUDA GPU")
def test_vllm_engine_samples_groups_and_follows_weight_updates(tmp_path, tiny_checkpoint):
    path = tiny_checkpoint("qwen2_5_vl")
    model, processor = load(path, device="cuda", dtype=torch.bfloat16)
    engine = build_rollout_engine(_grpo_config(tmp_path, "vllm"), model, processor, path, tmp_path)
    engine.load_weights(model)
    from omni_rl.data.dataset import encode_sample

    samples = [_video_sample(tmp_path)] * 2
    encoded = [dict(encode_sample(processor, s)) for s in samples]
    got = engine.rollout(samples, encoded, 4, SamplingParams(1.0, 1.0, 0, 8), seeds=[1, 9])
    assert got.completion_ids.shape[0] == 8 and got.group_size == 4
    assert not torch.equal(got.completion_ids[:4], got.completion_ids[4:])  # same prompt, other seeds
    assert not torch.isin(got.completion_ids, torch.tensor(placeholder_token_ids(processor))).any()
    assert (got.logprobs[got.completion_mask == 0] == 0).all() and (got.logprobs[got.completion_mask == 1] <= 0).all()
    greedy = SamplingParams(0.0, 1.0, 0, 8)
    before = engine.rollout(samples[:1], encoded[:1], 1, greedy, seeds=[0]).completion_ids
    engine.sleep()
    with torch.no_grad():
        model.lm_head.weight.mul_(-1.0)  # a different policy must give different greedy text
    engine.load_weights(model)
    after = engine.rollout(samples[:1], encoded[:1], 1, greedy, seeds=[0]).completion_ids
    assert not torch.equal(before, after)


@pytest.mark.parametrize("config", ["configs/qwen2_5_vl_7b_video_grpo.yaml", "configs/qwen3_vl_video_grpo.yaml"])
def test_the_real_size_configs_hold_their_longest_prompt_with_vllm(config):
    from omni_rl.recipe_loader import load_config

    rollout = load_config(config, ["rollout.engine=vllm"]).rollout
    assert rollout.vllm.max_model_len >= rollout.max_prompt_length + rollout.max_new_tokens


def test_the_gpu_smoke_script_says_what_it_needs_on_a_machine_without_cuda():
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    hidden = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # no GPU visible, on any machine
    result = subprocess.run(
        [sys.executable, str(root / "tools/gpu_smoke_vllm.py")], capture_output=True, text=True, timeout=300, env=hidden
    )
    assert result.returncode == 1 and "needs a CUDA GPU" in result.stderr
