"""Rollout/trainer parity on CPU: per-prompt seeds, the processed distribution compared
like with like, the mismatch metrics and the corrections, and sampling that ignores
the checkpoint's generation config."""

from __future__ import annotations

import copy
import itertools
import math

import pytest
import torch
from transformers import SuppressTokensLogitsProcessor, TopKLogitsWarper, TopPLogitsWarper

from omni_rl.algorithms.correction import (
    log_ratio,
    mismatch_sums,
    sequence_keep,
    sequence_tis_weights,
    tis_weights,
)
from omni_rl.data.sampler import PromptSampler
from omni_rl.models import load
from omni_rl.models.forward import SamplingFilter, group_forward, log_kept_mass
from omni_rl.models.inputs import collate_prompts
from omni_rl.recipe_loader import load_config
from omni_rl.recipes import grpo
from omni_rl.rollout.hf import HFRolloutEngine, SamplingParams, stop_token_ids

# ------------------------------------------------------------------------------- seeds


def test_prompt_seeds_are_distinct_per_draw_and_step_by_the_group_size():
    """A row drawn twice (here every draw is row 0) gets two seeds; completion g of a
    prompt is seeded seed + g, so the G-wide ranges of a run never overlap."""
    sampler = PromptSampler(size=1, seed=0)
    seeds = []
    for _ in range(3):  # three calls of two prompts, both the same row
        first = sampler.drawn
        assert sampler.next_batch(2) == [0, 0]
        seeds += [grpo.prompt_seed(7, first + j, 8) for j in range(2)]
    assert [b - a for a, b in itertools.pairwise(seeds)] == [8] * 5
    children = {s + g for s in seeds for g in range(8)}
    assert len(children) == 6 * 8
    assert grpo.prompt_seed(8, 0, 8) != grpo.prompt_seed(7, 0, 8)  # the run seed moves them


def test_the_draw_counter_is_restored_with_the_sampler():
    sampler = PromptSampler(size=5, seed=3)
    sampler.next_batch(7)
    resumed = PromptSampler(size=5, seed=3)
    resumed.load_state_dict(sampler.state_dict())
    assert resumed.drawn == sampler.drawn == 7
    assert resumed.next_batch(4) == sampler.next_batch(4)


def test_identical_prompts_in_one_call_get_different_groups(tiny_checkpoint, family_prompts):
    model, processor = load(tiny_checkpoint("qwen2_5_vl"))
    prompt = dict(family_prompts("qwen2_5_vl", processor, only=0))
    inputs = collate_prompts([prompt, prompt], processor.tokenizer.pad_token_id)
    seeds = [grpo.prompt_seed(0, d, 4) for d in (10, 11)]
    got = HFRolloutEngine(model, processor).generate(inputs, 4, SamplingParams(max_new_tokens=6), seeds)
    first, second = got.completion_ids[:4], got.completion_ids[4:]
    assert not torch.equal(first, second)
    again = HFRolloutEngine(model, processor).generate(inputs, 4, SamplingParams(max_new_tokens=6), seeds)
    assert torch.equal(again.completion_ids, got.completion_ids)  # and seeded: reproducible


# ----------------------------------------------------------- the generation config


def test_the_checkpoints_generation_config_does_not_shape_sampling(tiny_checkpoint, family_prompts):
    """Sampling follows the rollout section only: a repetition penalty, a low
    temperature and a top-k in the checkpoint's generation config change nothing (vLLM
    is started with generation_config='vllm' for the same reason)."""
    model, processor = load(tiny_checkpoint("qwen2_5_vl"))
    inputs = family_prompts("qwen2_5_vl", processor)
    sampling = SamplingParams(max_new_tokens=8)
    plain = HFRolloutEngine(model, processor).generate(inputs, 3, sampling, seeds=[5, 6])
    model.generation_config.repetition_penalty = 5.0
    model.generation_config.no_repeat_ngram_size = 1
    model.generation_config.temperature = 0.1
    model.generation_config.top_k = 2
    shaped = HFRolloutEngine(model, processor).generate(inputs, 3, sampling, seeds=[5, 6])
    assert torch.equal(plain.completion_ids, shaped.completion_ids)
    assert torch.allclose(plain.logprobs, shaped.logprobs)


def test_stop_tokens_include_the_generation_configs_end_tokens(tiny_checkpoint):
    model, processor = load(tiny_checkpoint("qwen2_5_vl"))
    tokenizer = processor.tokenizer
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, 7]
    assert stop_token_ids(processor, model) == sorted({tokenizer.eos_token_id, tokenizer.pad_token_id, 7})


def test_the_rollout_stops_where_sft_ends_an_answer(tiny_checkpoint):
    """With the tokenizer's end and the generation config's naming <|endoftext|> alone
    (released Qwen2-Audio's tokenizer does), a completion ran on past the <|im_end|>
    that SFT and offline answers end with: into a next turn, which the reward read."""
    model, processor = load(tiny_checkpoint("qwen2_audio"))
    tokenizer = processor.tokenizer
    tokenizer.eos_token = "<|endoftext|>"
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in stop_token_ids(processor, model)


# ---------------------------------------------------- the processed distribution


@pytest.mark.parametrize(
    "spec", [SamplingFilter((3, 5), 0, 1.0), SamplingFilter((), 6, 1.0), SamplingFilter((2,), 8, 0.7)]
)
def test_kept_mass_turns_full_logprobs_into_transformers_processed_ones(spec):
    torch.manual_seed(0)
    logits = torch.randn(5, 20) * 3 / 0.8  # temperature 0.8 applied
    processors = [SuppressTokensLogitsProcessor(list(spec.banned))] if spec.banned else []
    if spec.top_k:
        processors.append(TopKLogitsWarper(spec.top_k))
    if spec.top_p < 1:
        processors.append(TopPLogitsWarper(spec.top_p))
    scores = logits.clone()
    for p in processors:
        scores = p(None, scores)
    processed = torch.log_softmax(scores, -1)
    kept = torch.isfinite(processed)
    full = torch.log_softmax(logits, -1) - log_kept_mass(logits, spec)[:, None]
    assert torch.allclose(processed[kept], full[kept], atol=1e-5)
    assert (log_kept_mass(logits, spec) <= 0).all()
    assert torch.allclose(log_kept_mass(logits, SamplingFilter()), torch.zeros(5), atol=1e-6)


def test_trainer_logprobs_match_the_engines_like_with_like(tiny_checkpoint, family_prompts):
    """With top-k, top-p and banned placeholders the hf engine records processed
    log-probs; the trainer's full log-probs minus the kept mass equal them."""
    model, processor = load(tiny_checkpoint("qwen2_5_vl"))
    inputs = family_prompts("qwen2_5_vl", processor)
    engine = HFRolloutEngine(model, processor)
    sampling = SamplingParams(temperature=0.9, top_p=0.8, top_k=20, max_new_tokens=8)
    got = engine.generate(inputs, 3, sampling, seeds=[1, 2])
    spec = SamplingFilter(tuple(engine.banned), 20, 0.8)
    mask = got.completion_mask
    with torch.no_grad():
        out = group_forward(model, inputs, got.completion_ids, mask, 3, temperature=0.9, kept=spec)
    processed = (out.logp - out.log_kept) * mask
    assert torch.allclose(processed, got.logprobs * mask, atol=1e-5)
    assert (out.logp - got.logprobs)[mask.bool()].abs().max() > 1e-3  # unlike the full ones


# ------------------------------------------------------------- the correction math


def test_mismatch_sums_worked_by_hand():
    trainer = torch.tensor([[-1.0, -2.0, 0.0]])
    rollout = torch.tensor([[-1.5, -2.0, -9.0]])
    mask = torch.tensor([[1, 1, 0]])
    r = log_ratio(trainer, rollout, mask)  # [0.5, 0, masked]
    assert r.tolist() == [[0.5, 0.0, 0.0]]
    sums = mismatch_sums(r, mask, cap=1.5)
    assert sums.abs_diff == pytest.approx(0.5) and sums.tokens == 2
    assert sums.k3 == pytest.approx(math.exp(0.5) - 1 - 0.5)  # the second token adds 0
    assert sums.over_cap == 1  # e^0.5 = 1.65 > 1.5


def test_gspo_counts_capped_sequences_where_its_cap_is_per_sequence():
    """Under GSPO the truncation caps each sequence's geometric-mean ratio: a sequence of
    token ratios 3, 1/3, 3, 1/3 (mean 1, weight 1) is not capped though half its tokens
    are over the cap; a sequence at 3, 3 is. The token-level loss counts tokens."""
    r = torch.log(torch.tensor([[3.0, 1 / 3, 3.0, 1 / 3], [3.0, 3.0, 1.0, 1.0]]))
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    sums = mismatch_sums(r * mask, mask, cap=2.0)
    assert sequence_tis_weights(r * mask, mask, cap=2.0).tolist() == pytest.approx([1.0, 2.0])
    gspo = grpo._mismatch_metrics(sums, 0, 2.0, "tis", per_sequence=True)
    assert gspo["rollout/tis_capped_fraction"] == 0.5  # the second sequence of two
    tokens = grpo._mismatch_metrics(sums, 0, 2.0, "tis", per_sequence=False)
    assert tokens["rollout/tis_capped_fraction"] == 4 / 6


def test_tis_weights_and_sequence_masks_follow_their_formulas():
    r = torch.tensor([[0.1, 1.0, -0.3], [0.2, 0.2, 0.2]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    weights = tis_weights(r, mask, cap=2.0)
    expected = torch.tensor([[math.exp(0.1), 2.0, math.exp(-0.3)], [math.exp(0.2), math.exp(0.2), 0.0]])
    assert torch.allclose(weights, expected)
    seq = sequence_tis_weights(r, mask, cap=2.0)  # capped geometric means
    assert torch.allclose(seq, torch.tensor([min(math.exp(0.8 / 3), 2.0), math.exp(0.2)]))
    # sequence ratios e^0.8 and e^0.4: with cap 2 (log 0.69) the first is dropped
    assert sequence_keep(r, mask, cap=2.0).tolist() == [False, True]
    assert sequence_keep(r, mask, cap=3.0).tolist() == [True, True]


# --------------------------------- the mismatch of an engine on stale weights


def _stale_rollout(tiny_checkpoint, family_prompts):
    """A policy, and completions sampled by the hf engine from a copy of its weights
    taken before they moved."""
    model, processor = load(tiny_checkpoint("qwen2_5_vl"))
    encoded = [dict(family_prompts("qwen2_5_vl", processor, only=i)) for i in range(2)]
    stale = copy.deepcopy(model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02, alpha=1.0)
    engine = HFRolloutEngine(stale, processor)
    sampling = SamplingParams(max_new_tokens=6)
    rollouts = engine.generate(collate_prompts(encoded, processor.tokenizer.pad_token_id), 4, sampling, seeds=[1, 2])
    return model, processor, encoded, rollouts, SamplingFilter(tuple(engine.banned))


@pytest.mark.parametrize("correction", ["tis", "mask"])
def test_the_logged_mismatch_of_a_stale_engine_matches_a_hand_computation(
    tiny_checkpoint, family_prompts, correction, monkeypatch
):
    from omni_rl.engine.config import SGDConfig
    from omni_rl.engine.engine import TrainingEngine

    model, processor, encoded, rollouts, spec = _stale_rollout(tiny_checkpoint, family_prompts)
    pad = processor.tokenizer.pad_token_id
    mask = rollouts.completion_mask
    with torch.no_grad():
        out = group_forward(model, collate_prompts(encoded, pad), rollouts.completion_ids, mask, 4, kept=spec)
    r = (out.logp - out.log_kept - rollouts.logprobs) * mask
    tokens = mask.sum()
    cap = 1.02
    expected_abs = float(r.abs().sum() / tokens)
    expected_k3 = float(((torch.exp(r) - 1 - r) * mask).sum() / tokens)
    assert expected_abs > 1e-3  # the stale engine really differs

    seen = []
    real_loss = grpo.clipped_policy_loss

    def spy(*args, **kwargs):
        seen.append((args[3].clone(), None if args[-1] is None else args[-1].clone()))
        return real_loss(*args, **kwargs)

    monkeypatch.setattr(grpo, "clipped_policy_loss", spy)
    overrides = ["data.train=x", "rollout.n=4", "algorithm.epochs=1", f"algorithm.rollout_correction={correction}"]
    cfg = load_config(None, [*overrides, f"algorithm.rollout_correction_cap={cap}"], recipe="grpo")
    model.train()
    engine = TrainingEngine(model, SGDConfig(lr=0.1), torch.device("cpu"), total_steps=1)
    batch = grpo.Batch(samples=[None, None], encoded=encoded, seeds=[1, 2], numbers=[0, 1])
    advantages = torch.tensor([1.0, -1, -1, 1, -1, 1, 1, -1])
    stats = grpo._update(engine, None, batch, rollouts, mask, advantages, pad, cfg, True, spec)
    assert stats["rollout/logp_abs_diff"] == pytest.approx(expected_abs, rel=1e-4)
    assert stats["rollout/kl_k3"] == pytest.approx(expected_k3, rel=1e-3)
    ((loss_mask, weights),) = seen
    width = loss_mask.shape[1]
    if correction == "tis":
        assert torch.allclose(weights, torch.exp(r[:, :width]).clamp(max=cap) * mask[:, :width], atol=1e-5)
        over = float(((r > math.log(cap)) & mask.bool()).sum() / tokens)
        assert stats["rollout/tis_capped_fraction"] == pytest.approx(over)
    else:
        keep = (r.sum(-1).abs() <= math.log(cap)).tolist()
        assert weights is None
        assert loss_mask.bool().any(-1).tolist() == [k and bool(m.any()) for k, m in zip(keep, mask, strict=True)]
        assert stats["rollout/masked_fraction"] == pytest.approx(keep.count(False) / 8)


def test_an_engine_on_the_trainers_weights_shows_no_mismatch(tiny_checkpoint, family_prompts):
    from omni_rl.engine.config import SGDConfig
    from omni_rl.engine.engine import TrainingEngine

    model, processor = load(tiny_checkpoint("qwen2_5_vl"))
    encoded = [dict(family_prompts("qwen2_5_vl", processor, only=i)) for i in range(2)]
    pad = processor.tokenizer.pad_token_id
    engine = HFRolloutEngine(model, processor)
    rollouts = engine.generate(collate_prompts(encoded, pad), 4, SamplingParams(max_new_tokens=6), seeds=[1, 2])
    cfg = load_config(None, ["data.train=x", "rollout.n=4", "algorithm.rollout_correction=tis"], recipe="grpo")
    torch_engine = TrainingEngine(model, SGDConfig(lr=0.1), torch.device("cpu"), total_steps=1)
    batch = grpo.Batch(samples=[None, None], encoded=encoded, seeds=[1, 2], numbers=[0, 1])
    advantages = torch.tensor([1.0, -1, -1, 1, -1, 1, 1, -1])
    stats = grpo._update(
        torch_engine,
        None,
        batch,
        rollouts,
        rollouts.completion_mask,
        advantages,
        pad,
        cfg,
        True,
        SamplingFilter(tuple(engine.banned)),
    )
    assert stats["rollout/logp_abs_diff"] < 1e-5 and stats["rollout/tis_capped_fraction"] == 0


def test_auto_correction_is_tis_with_vllm_and_none_with_hf():
    base = ["data.train=x", "rollout.max_prompt_length=1000", "rollout.max_new_tokens=24"]
    hf = load_config(None, base, recipe="grpo")
    vllm = load_config(None, [*base, "rollout.engine=vllm", "rollout.vllm.max_model_len=1024"], recipe="grpo")
    assert grpo._correction(hf) == "none" and grpo._correction(vllm) == "tis"
