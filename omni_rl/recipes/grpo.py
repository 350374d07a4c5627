"""GRPO-family RL for vision/audio-language models, read top to bottom.

Each step: sample prompts, roll out G completions per prompt (each prompt prefilled
once), score them through the reward router, compute group advantages, update the
policy (the prompt and its media computed once per group in the gradient forward too),
log and checkpoint. The math lives in ``omni_rl.algorithms``; this file orders it.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from omni_rl import checkpoint
from omni_rl.algorithms.advantages import compute_advantages
from omni_rl.algorithms.losses import aggregate, clipped_policy_loss, gspo_policy_loss, kl_estimate
from omni_rl.algorithms.sampling import informative_groups, mask_truncated, overlong_penalty
from omni_rl.config import GRPOConfig, save_config
from omni_rl.data.dataset import MediaDataset, Sample, encode_sample
from omni_rl.data.sampler import PromptSampler
from omni_rl.errors import OmniRLError
from omni_rl.models import build_tiny, load
from omni_rl.models.forward import group_forward
from omni_rl.models.inputs import collate_prompts
from omni_rl.preprocess.pipeline import Budgets
from omni_rl.rewards import Target, load_plugins, score_batch
from omni_rl.rewards import aggregate as reward_metrics
from omni_rl.rollout.hf import HFRolloutEngine, SamplingParams, concat_rollouts, select_groups
from omni_rl.runtime import resolve_device, resolve_dtype, seed_everything, set_threads

MAX_BAD_STEPS = 3


# ----------------------------------------------------------------------------- setup


def _setup_model(cfg: GRPOConfig, out: Path, resume_from: Path | None):
    """Policy, processor and (when KL is on without LoRA) a frozen reference copy."""
    device = resolve_device(cfg.run.device)
    dtype = resolve_dtype(cfg.run.dtype, device)
    base = Path(cfg.model.path) if cfg.model.path else out / "tiny_model"
    if not cfg.model.path and not (base / "config.json").is_file():
        build_tiny(cfg.model.tiny_family, base, seed=cfg.run.seed)
    lora = cfg.model.lora
    source = resume_from / "model" if resume_from is not None and lora is None else base
    model, processor = load(source, device=device, dtype=dtype)
    if cfg.model.freeze_vision_tower:
        for name, param in model.named_parameters():
            if "visual" in name:
                param.requires_grad_(False)
    if lora is not None:
        from peft import LoraConfig, PeftModel, get_peft_model

        if resume_from is not None:
            model = PeftModel.from_pretrained(model, resume_from / "model", is_trainable=True)
        else:
            target = "|".join(lora.target_modules)
            spec = LoraConfig(
                r=lora.rank,
                lora_alpha=lora.alpha,
                lora_dropout=lora.dropout,
                target_modules=rf".*language_model.*\.({target})",
            )
            model = get_peft_model(model, spec)
    if cfg.model.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    reference = None
    if cfg.algorithm.kl_coef > 0 and lora is None:
        reference, _ = load(base, device=device, dtype=dtype)
        reference.requires_grad_(False)
    model.train()
    return model, processor, reference


def _setup_optimizer(cfg: GRPOConfig, model):
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise OmniRLError("no trainable parameters (is everything frozen?)")
    optimizer = cfg.optimizer.build(params)
    warmup = cfg.trainer.warmup_steps
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup) if warmup else 1.0)
    return optimizer, scheduler


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
            rollouts = engine.generate(collate_prompts(drawn.encoded, pad), n, sampling)
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


def _reference_logp(model, reference, inputs, ids, mask, n, temperature):
    if reference is not None:
        return group_forward(reference, inputs, ids, mask, n, temperature).logp
    with model.disable_adapter():  # LoRA: the reference is the base without adapters
        return group_forward(model, inputs, ids, mask, n, temperature).logp


@torch.no_grad()
def _sequence_kl(model, reference, inputs, rollouts, mask, cfg) -> torch.Tensor:
    """Summed per-token KL estimate of each completion: [B*G]."""
    inputs = _to(inputs, model.device)
    ids, n, temperature = rollouts.completion_ids.to(model.device), cfg.rollout.n, cfg.rollout.temperature
    logp = group_forward(model, inputs, ids, mask, n, temperature).logp
    ref = _reference_logp(model, reference, inputs, ids, mask, n, temperature)
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


class _Timer:
    """Seconds per phase of a step: ``with timer("rollout"): ...``."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    def __call__(self, phase: str):
        timer = self

        class _Phase:
            def __enter__(self):
                self.start = time.perf_counter()

            def __exit__(self, *exc):
                timer.seconds[phase] = timer.seconds.get(phase, 0.0) + time.perf_counter() - self.start

        return _Phase()

    @property
    def total(self) -> float:
        return sum(self.seconds.values())

    def metrics(self) -> dict:
        return {**{f"time/{k}": v for k, v in self.seconds.items()}, "time/step": self.total}


def _log(path: Path, writer, row: dict) -> None:
    with path.open("a") as f:
        f.write(json.dumps(row) + "\n")
    for key, value in row.items():
        if key != "step" and isinstance(value, (int, float)):
            writer.add_scalar(key, value, row["step"])


def _truncate_metrics(path: Path, step: int) -> None:
    """Keep only the metrics of steps up to ``step`` (a resumed run redoes the rest)."""
    if not path.exists():
        return
    kept = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= step]
    path.write_text("".join(line + "\n" for line in kept))


# ------------------------------------------------------------------------------ train


def train(cfg: GRPOConfig, resume: str | None = None) -> dict:
    """Run GRPO; returns the last step's metrics. ``resume``: None, 'auto' or a
    checkpoint directory."""
    out = Path(cfg.run.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_config(cfg, out / "config.yaml")
    set_threads(cfg.run.threads)
    seed_everything(cfg.run.seed)
    resume_from = checkpoint.latest(out) if resume == "auto" else (Path(resume) if resume else None)

    load_plugins(cfg.rewards.custom)
    model, processor, reference = _setup_model(cfg, out, resume_from)
    dataset = MediaDataset(
        cfg.data.train,
        Budgets.from_config(cfg.media),
        cfg.data.cache,
        cfg.data.cache_mode,
        cfg.data.strict,
        cfg.data.prompt_template,
    )
    sampler = PromptSampler(len(dataset), cfg.run.seed, cfg.data.shuffle)
    optimizer, scheduler = _setup_optimizer(cfg, model)
    engine = HFRolloutEngine(model, processor)
    sampling = SamplingParams(cfg.rollout.temperature, cfg.rollout.top_p, cfg.rollout.top_k, cfg.rollout.max_new_tokens)
    n, algo, pad = cfg.rollout.n, cfg.algorithm, processor.tokenizer.pad_token_id
    start_step, bad_steps = 0, 0
    metrics_path = out / "metrics.jsonl"
    if resume_from is not None:
        state = checkpoint.load_state(resume_from, optimizer, scheduler)
        sampler.load_state_dict(state["sampler"])
        start_step = state["step"]
        _truncate_metrics(metrics_path, start_step)  # drop steps logged after the checkpoint
    elif metrics_path.exists():
        metrics_path.unlink()
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(out / "tensorboard"))
    row: dict = {}
    bar = tqdm(range(start_step, cfg.trainer.steps), initial=start_step, total=cfg.trainer.steps, desc="grpo")
    for step in bar:
        timer = _Timer()
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
                inputs = collate_prompts(batch.encoded, pad)
                rewards = rewards - algo.kl_coef * _sequence_kl(model, reference, inputs, rollouts, mask, cfg).cpu()
            advantages = compute_advantages(algo.advantage, rewards, n).to(model.device)
        # UPDATE: mini-batches of prompts, several epochs, against stored old log-probs
        with timer("update"):
            update = _update(model, reference, optimizer, scheduler, batch, rollouts, mask, advantages, pad, cfg)
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
        }
        _log(metrics_path, writer, row)
        bar.set_postfix(reward=f"{row.get('reward/mean', 0):.3f}", s_step=f"{timer.total:.1f}")
        # CHECKPOINT
        last = step + 1 == cfg.trainer.steps
        if last or (cfg.trainer.save_every and (step + 1) % cfg.trainer.save_every == 0):
            checkpoint.save(
                out,
                step + 1,
                model,
                processor,
                optimizer,
                scheduler,
                sampler.state_dict(),
                keep_last=cfg.trainer.keep_last,
            )
    writer.close()
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
    sub_inputs = {tuple(c): _to(collate_prompts([batch.encoded[p] for p in c], pad_id), model.device) for c in chunks}
    needs_old = algo.epochs > 1 or len(chunks) > 1
    old, ref = {}, {}
    with torch.no_grad():
        for chunk in chunks:
            rows = _rows(chunk, n)
            if needs_old:
                old[tuple(chunk)] = group_forward(
                    model, sub_inputs[tuple(chunk)], ids[rows], mask[rows], n, cfg.rollout.temperature
                ).logp
            if algo.kl_coef > 0 and not algo.kl_in_reward:
                ref[tuple(chunk)] = _reference_logp(
                    model, reference, sub_inputs[tuple(chunk)], ids[rows], mask[rows], n, cfg.rollout.temperature
                )
    totals: dict[str, float] = {}
    updates = 0
    skipped_nan = 0
    for _ in range(algo.epochs):
        for chunk in chunks:
            rows = _rows(chunk, n)
            out = group_forward(
                model,
                sub_inputs[tuple(chunk)],
                ids[rows],
                mask[rows],
                n,
                cfg.rollout.temperature,
                with_entropy=True,
                entropy_grad=algo.entropy_coef > 0,
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
