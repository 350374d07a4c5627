"""GRPO-family RL for vision/audio-language models, read top to bottom.

Each step: sample prompts, roll out G completions per prompt (each prompt prefilled
once), score them through the reward router, compute group advantages, update the
policy (the prompt and its media computed once per group in the gradient forward too),
log and checkpoint. The math lives in ``omni_rl.algorithms``; this file orders it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from omni_rl.algorithms.advantages import compute_advantages
from omni_rl.algorithms.losses import aggregate, clipped_policy_loss, gspo_policy_loss, kl_estimate
from omni_rl.algorithms.sampling import informative_groups, mask_truncated, overlong_penalty
from omni_rl.config import GRPOConfig
from omni_rl.data.dataset import Sample, encode_sample
from omni_rl.errors import OmniRLError
from omni_rl.models.forward import full_forward, group_forward
from omni_rl.models.inputs import collate_prompts
from omni_rl.recipes.common import (
    MetricsLog,
    Timer,
    resume_state,
    save_if_due,
    setup_data,
    setup_model,
    setup_optimizer,
    start_run,
)
from omni_rl.rewards import Target, load_plugins, score_batch
from omni_rl.rewards import aggregate as reward_metrics
from omni_rl.rollout import build_engine
from omni_rl.rollout.hf import SamplingParams, concat_rollouts, select_groups

MAX_BAD_STEPS = 3


# ---------------------------------------------------------------------- step helpers


@dataclass
class Batch:
    """One step's prompts, their encoded inputs, and everything rolled out for them."""

    samples: list[Sample]
    encoded: list[dict]


def _draw(dataset, sampler, count, processor, max_prompt_length, skipped) -> Batch:
    """``count`` prompts, skipping (and counting) those longer than the limit: their
    media tokens are never cut."""
    samples, encoded = [], []
    while len(samples) < count:
        for index in sampler.next_batch(count - len(samples)):
            sample = dataset[index]
            inputs = encode_sample(processor, sample)
            if inputs["input_ids"].shape[1] > max_prompt_length:
                skipped["prompt_too_long"] += 1
                continue
            samples.append(sample)
            encoded.append(dict(inputs))
        if skipped["prompt_too_long"] > 100 * count:
            raise OmniRLError(f"nearly every prompt exceeds rollout.max_prompt_length={max_prompt_length}")
    return Batch(samples, encoded)


def _score(samples: list[Sample], texts: list[str], n: int, cfg: GRPOConfig):
    types = [s.problem_type for s in samples for _ in range(n)]
    targets = [Target(s.answer, s.options, s.fields) for s in samples for _ in range(n)]
    return score_batch(types, texts, targets, cfg.rewards.settings(), cfg.rewards.workers)


def _collect(dataset, sampler, engine, processor, sampling, cfg: GRPOConfig, skipped: dict, timer):
    """Sample, roll out and score until the step has ``prompts_per_step`` prompts (with
    dynamic sampling: prompts whose G rewards differ, within ``max_resample_rounds``
    extra rounds). Returns (batch, rollouts, results, rewards [B*G])."""
    algo, n, want = cfg.algorithm, cfg.rollout.n, cfg.data.prompts_per_step
    pad = processor.tokenizer.pad_token_id
    samples, encoded, parts, results, rewards = [], [], [], [], []
    rounds = 0
    while rounds == 0 or (algo.dynamic_sampling and rounds <= algo.max_resample_rounds and len(samples) < want):
        rounds += 1
        with timer("rollout"):
            drawn = _draw(dataset, sampler, want - len(samples), processor, cfg.rollout.max_prompt_length, skipped)
            rollouts = engine.rollout(drawn.samples, drawn.encoded, n, sampling)
        with timer("reward"):
            scored = _score(drawn.samples, rollouts.texts, n, cfg)
            reward = torch.tensor([r.score for r in scored])
            if algo.overlong == "penalty":
                buffer = min(algo.overlong_buffer, cfg.rollout.max_new_tokens)
                reward = reward + overlong_penalty(
                    rollouts.lengths.cpu(), cfg.rollout.max_new_tokens, buffer, algo.overlong_factor
                )
        keep = list(range(len(drawn.samples)))
        if algo.dynamic_sampling:
            informative = informative_groups(reward, n)
            keep = [i for i in keep if informative[i]]
            skipped["groups_filtered"] += len(drawn.samples) - len(keep)
        rows = [i * n + g for i in keep for g in range(n)]
        samples += [drawn.samples[i] for i in keep]
        encoded += [drawn.encoded[i] for i in keep]
        parts.append(select_groups(rollouts, keep))
        results += [scored[r] for r in rows]
        rewards.append(reward[rows])
    skipped["sampling_rounds"] = rounds
    return Batch(samples, encoded), concat_rollouts(parts, pad), results, torch.cat(rewards)


def _policy_loss(out, old_logp, ref_logp, adv, mask, cfg: GRPOConfig):
    """The loss of one mini-batch and its diagnostics."""
    algo = cfg.algorithm
    if algo.loss == "gspo":
        loss, stats = gspo_policy_loss(out.logp, old_logp, adv, mask, algo.eps_low, algo.eps_high)
    else:
        loss, stats = clipped_policy_loss(
            out.logp,
            old_logp,
            adv,
            mask,
            algo.eps_low,
            algo.eps_high,
            algo.dual_clip,
            algo.aggregation,
            cfg.rollout.max_new_tokens,
        )
    metrics = {
        "loss/policy": loss.item(),
        "loss/clip_fraction": stats.clip_fraction,
        "loss/ratio_mean": stats.ratio_mean,
        "loss/ratio_max": stats.ratio_max,
    }
    if ref_logp is not None and not algo.kl_in_reward:
        kl = aggregate(kl_estimate(out.logp, ref_logp, algo.kl_estimator), mask, algo.aggregation)
        loss = loss + algo.kl_coef * kl
        metrics["loss/kl"] = kl.item()
    if out.entropy is not None:
        entropy = aggregate(out.entropy, mask, algo.aggregation)
        loss = loss - algo.entropy_coef * entropy
        metrics["actor/entropy"] = entropy.item()
    return loss, metrics


def _checkpointing(model) -> bool:
    """Whether activation (gradient) checkpointing is on (through a LoRA wrapper too)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(base), name):
            return bool(getattr(base, name))
    return False


def _logprobs(model, batch: Batch, chunk: list[int], ids, mask, pad_id: int, cfg: GRPOConfig, **entropy):
    """Log-probs of the completions of the prompts in ``chunk``: each prompt computed once
    per group, or, under gradient checkpointing (which cannot keep a KV cache), copied
    once per completion."""
    n, rows = cfg.rollout.n, _rows(chunk, cfg.rollout.n)
    if _checkpointing(model) and model.training:
        expanded = collate_prompts([batch.encoded[p] for p in chunk for _ in range(n)], pad_id)
        return full_forward(
            model, _to(expanded, model.device), ids[rows], mask[rows], cfg.rollout.temperature, **entropy
        )
    inputs = collate_prompts([batch.encoded[p] for p in chunk], pad_id)
    return group_forward(model, _to(inputs, model.device), ids[rows], mask[rows], n, cfg.rollout.temperature, **entropy)


def _reference_logp(model, reference, batch, chunk, ids, mask, pad_id, cfg) -> torch.Tensor:
    if reference is not None:
        return _logprobs(reference, batch, chunk, ids, mask, pad_id, cfg).logp
    with model.disable_adapter():  # LoRA: the reference is the base without adapters
        return _logprobs(model, batch, chunk, ids, mask, pad_id, cfg).logp


@torch.no_grad()
def _sequence_kl(model, reference, batch, rollouts, mask, pad_id, cfg) -> torch.Tensor:
    """Summed per-token KL estimate of each completion: [B*G]."""
    ids, everything = rollouts.completion_ids.to(model.device), list(range(len(batch.samples)))
    logp = _logprobs(model, batch, everything, ids, mask, pad_id, cfg).logp
    ref = _reference_logp(model, reference, batch, everything, ids, mask, pad_id, cfg)
    return (kl_estimate(logp, ref, cfg.algorithm.kl_estimator) * mask).sum(-1)


def _to(inputs: dict, device) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


def _rollout_metrics(rollouts, cfg: GRPOConfig) -> dict:
    if not len(rollouts.lengths):
        return {}
    lengths = rollouts.lengths.float()
    return {
        "response/length_mean": lengths.mean().item(),
        "response/length_max": lengths.max().item(),
        "response/clipped_fraction": rollouts.truncated.float().mean().item(),
        "rollout/tokens": int(lengths.sum()),
    }


# ------------------------------------------------------------------------------ train


def train(cfg: GRPOConfig, resume: str | None = None) -> dict:
    """Run GRPO; returns the last step's metrics. ``resume``: None, 'auto' or a
    checkpoint directory."""
    out, resume_from = start_run(cfg, resume)

    load_plugins(cfg.rewards.custom)
    model, processor, reference = setup_model(cfg, out, resume_from, with_reference=cfg.algorithm.kl_coef > 0)
    dataset, sampler = setup_data(cfg)
    optimizer, scheduler = setup_optimizer(cfg, model)
    engine = build_engine(cfg, model, processor, Path(cfg.model.path) if cfg.model.path else out / "tiny_model")
    sampling = SamplingParams(cfg.rollout.temperature, cfg.rollout.top_p, cfg.rollout.top_k, cfg.rollout.max_new_tokens)
    n, algo, pad = cfg.rollout.n, cfg.algorithm, processor.tokenizer.pad_token_id
    start_step, bad_steps = resume_state(resume_from, optimizer, scheduler, sampler), 0
    log = MetricsLog(out, start_step if resume_from is not None else None)
    row: dict = {}
    bar = tqdm(range(start_step, cfg.trainer.steps), initial=start_step, total=cfg.trainer.steps, desc="grpo")
    for step in bar:
        timer = Timer()
        skipped = {"prompt_too_long": 0, "groups_filtered": 0, "sampling_rounds": 0}
        # ROLLOUT + REWARD: G completions per prompt (each prompt prefilled once), scored by
        # problem_type; dynamic sampling drops groups that cannot teach and samples more
        batch, rollouts, results, rewards = _collect(dataset, sampler, engine, processor, sampling, cfg, skipped, timer)
        types = [s.problem_type for s in batch.samples for _ in range(n)]
        sources = [s.data_source for s in batch.samples for _ in range(n)]
        # ADVANTAGE: group-relative; dynamic sampling keeps groups that can teach
        with timer("advantage"):
            mask = rollouts.completion_mask.to(model.device)
            if algo.overlong == "mask":
                mask = mask_truncated(mask, rollouts.truncated.to(model.device))
            if algo.kl_coef > 0 and algo.kl_in_reward and batch.samples:
                rewards = rewards - algo.kl_coef * _sequence_kl(model, reference, batch, rollouts, mask, pad, cfg).cpu()
            advantages = compute_advantages(algo.advantage, rewards, n).to(model.device)
        # UPDATE: mini-batches of prompts, several epochs, against stored old log-probs
        with timer("update"):
            update = _update(model, reference, optimizer, scheduler, batch, rollouts, mask, advantages, pad, cfg)
            engine.load_weights(model)
        bad_steps = bad_steps + 1 if update.get("skipped_nan") else 0
        if bad_steps >= MAX_BAD_STEPS:
            raise OmniRLError(
                f"step {step + 1}: the loss was NaN or infinite {MAX_BAD_STEPS} steps in a row; "
                "lower optimizer.lr or check the data"
            )
        # LOG
        row = {
            "step": step + 1,
            **reward_metrics(results, types, sources),
            **update,
            **timer.metrics(),
            **_rollout_metrics(rollouts, cfg),
            **{f"skipped/{k}": v for k, v in skipped.items()},
            "optim/lr": scheduler.get_last_lr()[0],
            "scorer_errors": sum("error" in r.details for r in results),
            "throughput/rollout_tokens_per_s": int(rollouts.lengths.sum()) / max(timer.seconds["rollout"], 1e-9),
        }
        log.log(row)
        bar.set_postfix(reward=f"{row.get('reward/mean', 0):.3f}", s_step=f"{timer.total:.1f}")
        # CHECKPOINT
        save_if_due(cfg, out, step + 1, model, processor, optimizer, scheduler, sampler)
    log.close()
    return row


def _rows(chunk: list[int], n: int) -> list[int]:
    """Completion rows of the prompts in ``chunk`` (G consecutive rows per prompt)."""
    return [p * n + g for p in chunk for g in range(n)]


def _update(model, reference, optimizer, scheduler, batch, rollouts, mask, advantages, pad_id, cfg) -> dict:
    """PPO-style epochs over mini-batches of prompts; returns averaged diagnostics."""
    algo, n = cfg.algorithm, cfg.rollout.n
    ids = rollouts.completion_ids.to(model.device)
    prompts = list(range(len(batch.samples)))
    if not prompts:
        return {"skipped_update": 1}
    size = algo.mini_batch_prompts or len(prompts)
    chunks = [prompts[i : i + size] for i in range(0, len(prompts), size)]
    needs_old = algo.epochs > 1 or len(chunks) > 1
    old, ref = {}, {}
    with torch.no_grad():
        for chunk in chunks:
            if needs_old:
                old[tuple(chunk)] = _logprobs(model, batch, chunk, ids, mask, pad_id, cfg).logp
            if algo.kl_coef > 0 and not algo.kl_in_reward:
                ref[tuple(chunk)] = _reference_logp(model, reference, batch, chunk, ids, mask, pad_id, cfg)
    totals: dict[str, float] = {}
    updates = 0
    skipped_nan = 0
    for _ in range(algo.epochs):
        for chunk in chunks:
            rows = _rows(chunk, n)
            out = _logprobs(
                model, batch, chunk, ids, mask, pad_id, cfg, with_entropy=True, entropy_grad=algo.entropy_coef > 0
            )
            old_logp = old[tuple(chunk)] if needs_old else out.logp.detach()
            loss, metrics = _policy_loss(out, old_logp, ref.get(tuple(chunk)), advantages[rows], mask[rows], cfg)
            if not torch.isfinite(loss):
                skipped_nan += 1
                optimizer.zero_grad(set_to_none=True)
                continue
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            clip = cfg.trainer.max_grad_norm or float("inf")
            grad_norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], clip)
            optimizer.step()
            metrics["optim/grad_norm"] = grad_norm.item()
            for key, value in metrics.items():
                totals[key] = totals.get(key, 0.0) + value
            updates += 1
    if updates:
        scheduler.step()  # the schedule counts steps that updated the policy
    stats = {k: v / updates for k, v in totals.items()} if updates else {}
    if skipped_nan:
        stats["skipped_nan"] = skipped_nan
    return stats
