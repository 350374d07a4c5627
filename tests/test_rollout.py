"""The HF rollout engine: one prefill per prompt, correct continuations, recorded log-probs."""

from __future__ import annotations

import pytest
import torch

from omni_rl.algorithms.losses import token_logprobs
from omni_rl.models import FAMILIES, load, placeholder_token_ids
from omni_rl.models.inputs import append_completion
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
