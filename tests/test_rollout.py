"""The HF rollout engine: one prefill per prompt, correct continuations, recorded log-probs."""

from __future__ import annotations

import pytest
import torch

from omni_rl.algorithms.losses import token_logprobs
from omni_rl.errors import OmniRLError
from omni_rl.models import FAMILIES, load, placeholder_token_ids
from omni_rl.models.inputs import append_completion
from omni_rl.rollout.config import RolloutConfig
from omni_rl.rollout.hf import HFRolloutEngine, SamplingParams


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_rollouts_equal_plain_generate(family, tiny_checkpoint, family_prompts):
    model, processor = load(tiny_checkpoint(family))
    inputs = family_prompts(family, processor)
    engine = HFRolloutEngine(model, processor)
    rollouts = engine.generate(inputs, n=3, sampling=SamplingParams(temperature=0.0, max_new_tokens=12))
    with torch.no_grad():
        reference = model.generate(
            **inputs,
            do_sample=False,
            max_new_tokens=12,
            suppress_tokens=engine.banned,
            eos_token_id=engine.stop_ids,
            pad_token_id=engine.pad_id,
        )
    reference = reference[:, inputs["input_ids"].shape[1] :]
    assert rollouts.completion_ids.shape[0] == 6 and rollouts.group_size == 3
    for prompt in range(2):
        want = reference[prompt]
        for sample in range(3):
            got = rollouts.completion_ids[prompt * 3 + sample]
            length = int(rollouts.lengths[prompt * 3 + sample])
            assert got[:length].tolist() == want[:length].tolist(), (family, prompt, sample)


def test_each_prompt_is_encoded_and_prefilled_once(tiny_checkpoint, family_prompts):
    model, processor = load(tiny_checkpoint("qwen2_5_vl"))
    inputs = family_prompts("qwen2_5_vl", processor)
    calls = {"vision": 0, "prompt_tokens": 0}
    visual = model.model.visual
    hooks = [
        visual.register_forward_hook(lambda *_: calls.__setitem__("vision", calls["vision"] + 1)),
        model.model.language_model.register_forward_pre_hook(
            lambda module, args, kwargs: calls.__setitem__(
                "prompt_tokens",
                calls["prompt_tokens"] + kwargs["inputs_embeds"].shape[0] * kwargs["inputs_embeds"].shape[1],
            ),
            with_kwargs=True,
        ),
    ]
    engine = HFRolloutEngine(model, processor)
    n, new = 4, 6
    rollouts = engine.generate(inputs, n=n, sampling=SamplingParams(temperature=1.0, max_new_tokens=new))
    for hook in hooks:
        hook.remove()
    batch, prompt_length = inputs["input_ids"].shape
    steps = rollouts.completion_ids.shape[1]
    # one vision pass for the batch; the language model sees each prompt once (P - 1 tokens),
    # then one token per sequence per decoding step
    assert calls["vision"] == 1
    assert calls["prompt_tokens"] == batch * (prompt_length - 1) + batch * n * steps


def test_sampled_logprobs_match_a_teacher_forced_forward(tiny_checkpoint, family_prompts):
    model, processor = load(tiny_checkpoint("qwen2_5_vl"))
    inputs = family_prompts("qwen2_5_vl", processor)
    engine = HFRolloutEngine(model, processor)
    torch.manual_seed(0)
    sampling = SamplingParams(temperature=0.7, max_new_tokens=8)
    rollouts = engine.generate(inputs, n=2, sampling=sampling)
    repeated = {
        k: v.repeat_interleave(2, dim=0) if k in ("input_ids", "attention_mask", "mm_token_type_ids") else v
        for k, v in inputs.items()
    }
    repeated["pixel_values_videos"] = torch.cat(
        [inputs["pixel_values_videos"][: len(inputs["pixel_values_videos"]) // 2]] * 2
        + [inputs["pixel_values_videos"][len(inputs["pixel_values_videos"]) // 2 :]] * 2
    )
    repeated["video_grid_thw"] = inputs["video_grid_thw"].repeat_interleave(2, dim=0)
    repeated["second_per_grid_ts"] = inputs["second_per_grid_ts"].repeat_interleave(2, dim=0)
    batch, _ = append_completion(repeated, rollouts.completion_ids, rollouts.completion_mask)
    with torch.no_grad():
        logits = model(**batch).logits[:, inputs["input_ids"].shape[1] - 1 : -1]
    banned = placeholder_token_ids(processor)
    logits[..., banned] = float("-inf")
    expected = token_logprobs(logits / sampling.temperature, rollouts.completion_ids) * rollouts.completion_mask
    torch.testing.assert_close(rollouts.logprobs, expected, atol=1e-4, rtol=1e-4)


def test_completions_never_hold_placeholders_and_report_finish_reasons(tiny_checkpoint, family_prompts):
    model, processor = load(tiny_checkpoint("qwen2_5_omni_thinker"))
    engine = HFRolloutEngine(model, processor)
    torch.manual_seed(1)
    rollouts = engine.generate(
        family_prompts("qwen2_5_omni_thinker", processor),
        n=4,
        sampling=SamplingParams(temperature=1.5, top_k=50, top_p=0.95, max_new_tokens=10),
    )
    assert not torch.isin(rollouts.completion_ids, torch.tensor(engine.banned)).any()
    for length, reason, mask in zip(rollouts.lengths, rollouts.finish_reasons, rollouts.completion_mask, strict=True):
        assert int(mask.sum()) == int(length)
        assert reason in ("stop", "length")
        if reason == "length":
            assert int(length) == 10
    assert (rollouts.logprobs <= 0).all() and len(rollouts.texts) == 8


def test_gumbel_noise_samples_the_distribution():
    from omni_rl.rollout.hf import gumbel_noise, token_keys

    probs = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0])
    logp = torch.log(probs)
    seeds = torch.arange(20_000, dtype=torch.int64)
    keys = token_keys(5, "cpu")
    picks = (logp[None, :] + gumbel_noise(seeds, step=3, tokens=keys)).argmax(-1)
    freq = torch.bincount(picks, minlength=5).float() / len(seeds)
    # binomial std at p=0.5 over 20k draws is 0.0035: 0.015 is over four of them
    torch.testing.assert_close(freq, probs, atol=0.015, rtol=0)
    assert freq[4] == 0  # a masked token (-inf) is never drawn
    # the same seeds and step give the same noise; another step gives other noise
    assert torch.equal(gumbel_noise(seeds[:8], 3, keys), gumbel_noise(seeds[:8], 3, keys))
    assert not torch.equal(gumbel_noise(seeds[:8], 3, keys), gumbel_noise(seeds[:8], 4, keys))
    # a token's noise does not depend on the vocabulary it is drawn from
    assert torch.equal(gumbel_noise(seeds[:8], 3, token_keys(9, "cpu"))[:, :5], gumbel_noise(seeds[:8], 3, keys))


def test_the_rollout_runs_in_inference_mode_and_returns_tensors_training_can_use(tiny_checkpoint, family_prompts):
    """An unsharded model's prefill and decoding run in inference mode (said in
    ``rollout/inference_mode``); the completions, log-probs and a kept prefill it
    returns are ordinary tensors that the update's forward and backward take."""
    from omni_rl.models.forward import group_forward

    model, processor = load(tiny_checkpoint("qwen2_5_vl"))
    inputs = family_prompts("qwen2_5_vl", processor)
    modes = []
    model.model.language_model.register_forward_pre_hook(lambda *_: modes.append(torch.is_inference_mode_enabled()))
    engine = HFRolloutEngine(model, processor)
    plain = engine.generate(inputs, 2, SamplingParams(max_new_tokens=3), seeds=[0, 1])
    assert len(modes) == 4 and all(modes)  # the prefill and 3 decoding steps
    assert engine.metrics()["rollout/inference_mode"] == 1.0
    modes.clear()
    kept = engine.generate(inputs, 2, SamplingParams(max_new_tokens=3), seeds=[0, 1], keep_prefill=True)
    assert modes == [False, True, True, True]  # the kept prefill under autograd
    assert torch.equal(kept.completion_ids, plain.completion_ids)
    for rollouts in (plain, kept):
        assert not any(t.is_inference() for t in (rollouts.completion_ids, rollouts.logprobs, rollouts.lengths))
        model.train()
        out = group_forward(
            model, inputs, rollouts.completion_ids, rollouts.completion_mask, 2, prefix=rollouts.prefill
        )
        (out.logp * rollouts.completion_mask).sum().backward()
        assert model.lm_head.weight.grad is not None
        model.zero_grad(set_to_none=True)


def test_a_prompts_completions_do_not_depend_on_its_batch(tiny_checkpoint, family_prompts):
    """Seeded per completion: prompt 1 rolled out alone equals prompt 1 rolled out next to
    prompt 0 (what makes N ranks sample what one process samples)."""
    model, processor = load(tiny_checkpoint("qwen2_5_vl"))
    engine = HFRolloutEngine(model, processor)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=8)
    both = engine.generate(family_prompts("qwen2_5_vl", processor), n=3, sampling=sampling, seeds=[11, 12])
    alone = engine.generate(family_prompts("qwen2_5_vl", processor, only=1), n=3, sampling=sampling, seeds=[12])
    width = alone.completion_ids.shape[1]
    assert torch.equal(both.completion_ids[3:, :width], alone.completion_ids)
    torch.testing.assert_close(both.logprobs[3:, :width], alone.logprobs, atol=1e-5, rtol=1e-5)
    other = engine.generate(family_prompts("qwen2_5_vl", processor, only=1), n=3, sampling=sampling, seeds=[13])
    assert not torch.equal(other.completion_ids, alone.completion_ids)


def test_decoding_reads_the_prompt_keys_once_per_group(tiny_checkpoint, family_prompts, monkeypatch):
    """Each decoding step attends to the B prompts' stored keys and to a cache of the
    completions' own tokens only (no G copies of the prompt's keys); that cache is
    allocated once (max_new_tokens slots) and step s sees its first s + 1 slots."""
    from omni_rl.models import shared_prefix

    model, processor = load(tiny_checkpoint("qwen2_5_vl"))
    inputs = family_prompts("qwen2_5_vl", processor)
    seen, buffers = [], set()
    real = shared_prefix.grouped_attention

    def spy(module, query, key, value, attention_mask, store, scaling):
        if module.layer_idx == 0:
            visible = attention_mask.reshape(key.shape[0], -1).sum(-1).unique().tolist()
            seen.append((store.layers[0][0].shape[0], key.shape[0], key.shape[2], visible))
            buffers.add(key.data_ptr())
        return real(module, query, key, value, attention_mask, store, scaling)

    monkeypatch.setattr(shared_prefix, "grouped_attention", spy)
    rollouts = HFRolloutEngine(model, processor).generate(inputs, n=4, sampling=SamplingParams(max_new_tokens=5))
    assert seen == [(2, 8, 5, [step + 1]) for step in range(rollouts.completion_ids.shape[1])]
    assert len(buffers) == 1


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_decoding_builds_no_attention_mask(family, tiny_checkpoint, family_prompts, monkeypatch):
    """The decoding steps hand the model their own-key mask, a view of one row, so
    transformers builds none: its mask function runs for the prefill only."""
    from transformers import masking_utils

    model, processor = load(tiny_checkpoint(family))
    inputs = family_prompts(family, processor)
    calls = []
    real = masking_utils.create_causal_mask

    def spy(*args, **kwargs):
        mask = real(*args, **kwargs)
        calls.append(mask is kwargs.get("attention_mask"))
        return mask

    for module in {type(m).__module__ for m in model.modules()}:
        if hasattr(__import__(module, fromlist=["_"]), "create_causal_mask"):
            monkeypatch.setattr(f"{module}.create_causal_mask", spy)
    rollouts = HFRolloutEngine(model, processor).generate(inputs, n=2, sampling=SamplingParams(max_new_tokens=4))
    steps = rollouts.completion_ids.shape[1]
    assert steps > 1 and calls.count(False) <= 1, (family, calls)  # built: the prefill's (or none)
    assert calls.count(True) >= steps, (family, calls)  # every step's went through, handed back as it is


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_prompts_leave_room_for_the_completion_within_the_models_positions(family, tiny_checkpoint, caplog):
    """A prompt and its completion fit the decoder's positions, as the vllm engine
    requires: the longest prompt is the model's positions less max_new_tokens where
    rollout.max_prompt_length would pass them, and a completion longer than the
    positions is refused."""
    model, processor = load(tiny_checkpoint(family))
    engine = HFRolloutEngine(model, processor)
    positions = model.config.get_text_config().max_position_embeddings
    assert positions == 4096
    with caplog.at_level("INFO", logger="omni_rl.rollout.hf"):
        assert engine.max_prompt_tokens(RolloutConfig(max_prompt_length=100, max_new_tokens=256)) == 100
        assert engine.max_prompt_tokens(RolloutConfig(max_prompt_length=3840, max_new_tokens=256)) == 3840
        assert not [r for r in caplog.records if r.name == "omni_rl.rollout.hf"]
        assert engine.max_prompt_tokens(RolloutConfig(max_prompt_length=16384, max_new_tokens=256)) == 3840
        assert engine.max_prompt_tokens(RolloutConfig(max_prompt_length=16384, max_new_tokens=96)) == 4000
    said = [r.getMessage() for r in caplog.records if r.name == "omni_rl.rollout.hf"]
    assert said == [
        "hf rollout: prompts over 3840 tokens are skipped: the model's 4096 positions less "
        "rollout.max_new_tokens=256 (rollout.max_prompt_length=16384)"
    ]
    with pytest.raises(OmniRLError, match=r"max_new_tokens=4096 leaves no room for a prompt within the model's 4096"):
        engine.max_prompt_tokens(RolloutConfig(max_new_tokens=4096))


def test_a_negative_top_k_is_refused():
    """rollout.top_k -5 passed: the hf engine and the trainer read it as top-k off and
    vLLM was handed -5 as it was, so one config meant two things."""
    from omni_rl.config import FieldError

    with pytest.raises(FieldError, match=r"must be >= 0 \(0 disables\)") as refused:
        RolloutConfig(top_k=-5)
    assert refused.value.field_name == "top_k"
    assert RolloutConfig(top_k=0).top_k == 0 and RolloutConfig(top_k=20).top_k == 20
