"""GRPO-family RL for vision/audio-language models, read top to bottom.

Each step: sample prompts, roll out G completions per prompt (each prompt prefilled
once), score them through the reward router, compute group advantages, update the
policy (the prompt and its media computed once per group in the gradient forward too),
log and checkpoint. The math lives in ``omni_rl.algorithms``; this file orders it.

With ``rollout.staleness: 1`` the last of torchrun's processes runs ``_serve_rollouts``:
it samples, rolls out and scores step k+1's prompts with step k's weights while the
trainers update on step k's, deals each trainer its groups, and takes the new weights
after every step (``omni_rl.rollout.remote``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import astuple, dataclass, field
from functools import partial

import torch

from omni_rl.algorithms.advantages import compute_advantages
from omni_rl.algorithms.correction import (
    MismatchSums,
    log_ratio,
    mismatch_sums,
    sequence_keep,
    sequence_tis_weights,
    tis_weights,
)
from omni_rl.algorithms.losses import (
    PolicyLossStats,
    aggregate,
    clipped_policy_loss,
    gspo_policy_loss,
    kl_estimate,
    masked_mean,
)
from omni_rl.algorithms.sampling import informative_groups, mask_truncated, overlong_penalty
from omni_rl.data.dataset import Sample
from omni_rl.engine import distributed
from omni_rl.engine.engine import TrainingEngine, resolve_precision
from omni_rl.evaluation.during_training import HeldOut
from omni_rl.models.forward import Entropy, Prefix, SamplingFilter, group_forward, training_dropout
from omni_rl.models.inputs import TOKEN_KEYS, answer_end, collate_prompts
from omni_rl.recipes.common import (
    Balance,
    Timer,
    balance_by_swaps,
    draw_rows,
    finish_run,
    last_row,
    max_over_mean,
    model_dir,
    model_inputs,
    pack_by_tokens,
    per_rank,
    rank_loads,
    resume_steps,
    save_if_due,
    setup_data,
    setup_model,
    start_run,
)
from omni_rl.recipes.grpo_config import GRPOConfig
from omni_rl.rewards import Target, load_plugins, score_batch
from omni_rl.rewards import aggregate as reward_metrics
from omni_rl.rollout import build_rollout_engine, prompt_seed, remote
from omni_rl.rollout.hf import Rollouts, SamplingParams, concat_rollouts, replace_completions, select_groups

_log = logging.getLogger(__name__)
NO_FILTER = SamplingFilter()  # an engine that samples with temperature alone
PUSH_BUCKET_BYTES = 256 * 2**20  # weights pushed to a rollout process per message

# ---------------------------------------------------------------------- step helpers


@dataclass
class Batch:
    """One step's prompts on this rank, their encoded inputs, sampling seeds and draw
    numbers in the run. ``filler``: the rank kept no group of its own this step (dynamic
    sampling) and trains on one with zero weight, so that its forwards stay in step with
    the other ranks'."""

    samples: list[Sample]
    encoded: list[dict]
    seeds: list[int]
    numbers: list[int]
    filler: bool = False


@dataclass
class Collected:
    """A step's rollouts on one trainer (``_collect``'s results) and what collecting
    them counted: ``skipped`` and ``mixed`` (this rank's share), the dealing's
    ``balance`` metrics. From a rollout process also: ``version``, the training steps
    behind the weights that generated them; ``sampler``, the sampler's state once they
    were drawn; ``report``, the process's own figures (``_serve_rollouts``)."""

    batch: Batch
    rollouts: Rollouts
    results: list
    rewards: torch.Tensor
    filtered: list[str]
    skipped: dict
    mixed: dict
    balance: dict
    version: int = 0
    sampler: dict | None = None
    report: dict = field(default_factory=dict)


def _draw(
    dataset, sampler, count: int, processor, cfg: GRPOConfig, skipped: dict, max_prompt: int, balance: Balance
) -> Batch:
    """This rank's ``count`` prompts (``draw_rows``: bad rows are skipped, rows dealt to
    ranks by their tokens), skipping and counting those longer than the limit
    ``max_prompt`` (their media tokens are never cut); each prompt's sampling seed
    follows from its draw number, wherever it is dealt."""

    def too_long(sample: Sample, inputs: dict) -> str | None:
        if inputs["input_ids"].shape[1] <= max_prompt:
            return None
        skipped["prompt_too_long"] += 1
        limit = cfg.rollout.max_prompt_length
        return f"prompts over the rollout engine's limit of {max_prompt} tokens (rollout.max_prompt_length={limit})"

    drawn = draw_rows(dataset, sampler, count, processor, too_long, balance)
    seeds = [prompt_seed(cfg.run.seed, number, cfg.rollout.n) for number, _, _ in drawn]
    numbers = [number for number, _, _ in drawn]
    return Batch([sample for _, sample, _ in drawn], [inputs for _, _, inputs in drawn], seeds, numbers)


def _score(samples: list[Sample], texts: list[str], n: int, cfg: GRPOConfig):
    types = [s.problem_type for s in samples for _ in range(n)]
    targets = [Target(s.answer, s.options, s.fields) for s in samples for _ in range(n)]
    return score_batch(types, texts, targets, cfg.rewards.settings(), cfg.rewards.workers)


def takes_offline(accuracy: float, mode: str, below: float | None) -> bool:
    """Whether a group of this online accuracy takes its row's offline answer
    (``algorithm.offline_responses``)."""
    return mode == "always" or (mode == "below" and accuracy < below)


def _mix_offline(samples: list[Sample], rollouts, scored: list, processor, cfg: GRPOConfig, mixed: dict):
    """Each group whose row has an ``offline_response`` and that ``takes_offline``: its
    last completion replaced by that answer (tokenized, closed as the chat template
    closes an answer, ``answer_end``, cut at ``max_new_tokens``) and scored like the
    others. ``mixed`` counts the groups seen, those that took one and their rewards."""
    tokenizer = processor.tokenizer
    algo, n = cfg.algorithm, cfg.rollout.n
    accuracy = [sum(r.accuracy for r in scored[p * n : (p + 1) * n]) / n for p in range(len(samples))]
    mode, below = algo.offline_responses, algo.offline_below
    chosen = [
        p
        for p, sample in enumerate(samples)
        if sample.fields.get("offline_response") and takes_offline(accuracy[p], mode, below)
    ]
    mixed["groups"] += len(samples)
    if not chosen:
        return rollouts, scored
    answers = {p * n + n - 1: str(samples[p].fields["offline_response"]) + answer_end(processor) for p in chosen}
    ids = {row: tokenizer(text, add_special_tokens=False)["input_ids"] for row, text in answers.items()}
    decode = partial(tokenizer.decode, skip_special_tokens=True)
    rollouts = replace_completions(rollouts, ids, decode, tokenizer.pad_token_id, cfg.rollout.max_new_tokens)
    results = _score([samples[p] for p in chosen], [rollouts.texts[row] for row in ids], 1, cfg)
    scored = list(scored)
    for row, result in zip(ids, results, strict=True):
        scored[row] = result
    mixed["offline"] += len(chosen)
    mixed["offline_reward"] += sum(r.score for r in results)
    mixed["offline_cut"] += sum(rollouts.finish_reasons[row] == "length" for row in ids)
    return rollouts, scored


def _collect(
    dataset, sampler, rollout, processor, sampling, cfg: GRPOConfig, skipped: dict, mixed: dict, balance: Balance, timer
):
    """Sample, roll out and score until this rank has its share of ``prompts_per_step``
    (with dynamic sampling: prompts whose G rewards differ, within
    ``max_resample_rounds`` extra rounds; every rank rolls out as many prompts per round
    so that collectives stay in step); rows' offline answers are mixed into their
    groups first (``_mix_offline``, counted in ``mixed``). Returns (batch, rollouts,
    results, rewards [B*G], filtered: the data source of each completion of the groups
    dynamic sampling dropped, which taught nothing); ``balance`` records how each
    round's rows were dealt to ranks."""
    algo, n = cfg.algorithm, cfg.rollout.n
    want = per_rank(cfg.data.prompts_per_step, distributed.ranks(), "data.prompts_per_step")
    pad = processor.tokenizer.pad_token_id
    samples, encoded, seeds, numbers, parts, results, rewards, filtered = [], [], [], [], [], [], [], []
    rounds = 0
    while True:
        short = distributed.all_max(want - len(samples))
        if rounds and (not algo.dynamic_sampling or rounds > algo.max_resample_rounds or not short):
            break
        rounds += 1
        with timer("rollout"):
            limit = rollout.max_prompt_tokens(cfg.rollout)
            drawn = _draw(dataset, sampler, short, processor, cfg, skipped, limit, balance)
            rollouts = rollout.rollout(drawn.samples, drawn.encoded, n, sampling, drawn.seeds)
        with timer("reward"):
            scored = _score(drawn.samples, rollouts.texts, n, cfg)
            if algo.offline_responses != "never":
                rollouts, scored = _mix_offline(drawn.samples, rollouts, scored, processor, cfg, mixed)
            reward = torch.tensor([r.score for r in scored])
            if algo.overlong == "penalty":
                reward = reward + overlong_penalty(
                    rollouts.lengths.cpu(), cfg.rollout.max_new_tokens, algo.overlong_buffer, algo.overlong_factor
                )
        # the groups in draw order until this rank is full: what it drew past that (every
        # rank draws the largest shortfall) only kept it in step, and counts nowhere
        informative = informative_groups(reward, n) if algo.dynamic_sampling else [True] * len(drawn.samples)
        keep, alike = [], []
        for i in range(len(drawn.samples)):
            if len(keep) == want - len(samples):
                break
            (keep if informative[i] else alike).append(i)
        skipped["groups_filtered"] += len(alike)
        filtered += [drawn.samples[i].data_source for i in alike for _ in range(n)]
        rows = [i * n + g for i in keep for g in range(n)]
        samples += [drawn.samples[i] for i in keep]
        encoded += [drawn.encoded[i] for i in keep]
        seeds += [drawn.seeds[i] for i in keep]
        numbers += [drawn.numbers[i] for i in keep]
        parts.append(select_groups(rollouts, keep))
        results += [scored[r] for r in rows]
        rewards.append(reward[rows])
    skipped["sampling_rounds"] = rounds
    batch = Batch(samples, encoded, seeds, numbers)
    if distributed.all_max(len(samples)) and not samples:
        # nothing kept here while other ranks train: one group with zero weight
        batch = Batch(drawn.samples[:1], drawn.encoded[:1], drawn.seeds[:1], drawn.numbers[:1], filler=True)
        parts.append(select_groups(rollouts, [0]))
        rewards.append(reward[:n])
    return batch, concat_rollouts(parts, pad), results, torch.cat(rewards), filtered


class PooledMeans:
    """Means over the elements of an update (the policy loss's ratio diagnostics, the
    entropy, the KL to the reference), each pooled over every micro-batch and rank of a
    mini-batch (weighed by the elements it counts: valid tokens, or sequences for GSPO's
    ratios; an empty one counts nowhere), then averaged over the mini-batches; and the
    largest ratio of them all. ``defaults``: the names logged, in the order every rank
    sums them, each with its value where nothing counted."""

    RATIOS = ("clip_fraction", "ratio_mean", "approx_kl", "dual_clip_fraction")

    def __init__(self, defaults: dict[str, float]):
        self.defaults = defaults
        self.sums: dict[int, dict[str, list[float]]] = {}
        self.largest = -math.inf

    def add(self, mini_batch: int, name: str, mean: float, count: int) -> None:
        """One micro-batch's ``mean`` of ``name`` over its ``count`` elements."""
        if count and name in self.defaults:
            total = self.sums.setdefault(mini_batch, {}).setdefault(name, [0.0, 0.0])
            total[0] += mean * count
            total[1] += count

    def add_ratios(self, mini_batch: int, stats: PolicyLossStats) -> None:
        """The policy loss's diagnostics of one micro-batch (``loss/<name>``)."""
        for name in self.RATIOS:
            self.add(mini_batch, f"loss/{name}", getattr(stats, name), stats.elements)
        if stats.elements:
            self.largest = max(self.largest, stats.ratio_max)

    def metrics(self, mini_batches: int) -> dict:
        """Every name's mean, and ``loss/ratio_max``, over every rank (every rank calls
        this: two collectives)."""
        names = list(self.defaults)
        flat = distributed.all_sum(
            [x for j in range(mini_batches) for name in names for x in self.sums.get(j, {}).get(name, [0.0, 0.0])]
        )
        out = {}
        for k, name in enumerate(names):
            at = [2 * (j * len(names) + k) for j in range(mini_batches)]
            means = [flat[i] / flat[i + 1] for i in at if flat[i + 1]]
            out[name] = sum(means) / len(means) if means else self.defaults[name]
        largest = distributed.all_max(float(self.largest))
        out["loss/ratio_max"] = largest if largest > -math.inf else 1.0  # 1: no valid token anywhere
        return out


def _policy_loss(out, old_logp, ref_logp, adv, mask, denominator: float, cfg: GRPOConfig, tis=None):
    """This micro-batch's share of its mini-batch's loss (sums divided by the whole
    mini-batch's ``denominator`` over every rank), its terms' shares (``loss/*``), the
    policy loss's diagnostics (``PolicyLossStats``) and the per-token means of the KL
    and the entropy with their token count (``PooledMeans``, whatever the
    aggregation); ``tis``: the
    rollout correction's weights (per token [N, L], per sequence [N] for GSPO), or None.
    The policy, KL and entropy terms share one aggregation and one fixed length
    (``max_new_tokens``, not this micro-batch's trimmed width)."""
    algo = cfg.algorithm
    (eps_low, eps_high), mode, length = algo.clip_range, algo.averaging, cfg.rollout.max_new_tokens
    if algo.loss == "gspo":
        loss, stats = gspo_policy_loss(out.logp, old_logp, adv, mask, eps_low, eps_high, denominator, tis)
    else:
        loss, stats = clipped_policy_loss(
            out.logp, old_logp, adv, mask, eps_low, eps_high, algo.dual_clip, mode, length, denominator, tis
        )
    sums, means = {"loss/policy": loss.item()}, {}
    if ref_logp is not None and not algo.kl_in_reward:
        per_token = kl_estimate(out.logp, ref_logp, algo.kl_estimator)
        kl = aggregate(per_token, mask, mode, length, denominator)
        loss = loss + algo.kl_coef * kl
        sums["loss/kl"] = kl.item()  # the term as the loss aggregates it
        means["actor/kl"] = masked_mean(per_token, mask)
    if out.entropy is not None:
        entropy = aggregate(out.entropy, mask, mode, length, denominator)
        loss = loss - algo.entropy_coef * entropy
        sums["loss/entropy"] = entropy.item()  # the term as the loss aggregates it
        means["actor/entropy"] = masked_mean(out.entropy, mask)
    return loss, sums, stats, means


def _width(mask: torch.Tensor, rows: list[int]) -> int:
    """Columns that hold a completion token in any of ``rows`` (at least one)."""
    return max(1, int(mask[rows].sum(-1).max()))


def _logprobs(
    model,
    batch: Batch,
    chunk: list[int],
    ids,
    mask,
    pad_id: int,
    cfg,
    entropy: Entropy = "off",
    kept=None,
    apart=False,
    prefix: Prefix | None = None,
):
    """Log-probs [rows, width] of the completions of the prompts in ``chunk`` through
    ``model`` (the engine's training model, or the reference), trimmed to the longest
    completion among them: each prompt and its media computed once per group, its keys
    held once, with or without gradient checkpointing. ``kept``: a ``SamplingFilter``
    whose kept mass is returned too; ``apart``: the prompt's backward returned to run
    after the completions' (``group_forward``); ``prefix``: the chunk's prompts already
    prefilled by ``model`` (the rollout's, ``rollout.reuse_prefill``)."""
    n, rows = cfg.rollout.n, _rows(chunk, cfg.rollout.n)
    width = _width(mask, rows)
    encoded = [batch.encoded[p] for p in chunk]
    if prefix is not None:  # the media are in the prefill: only the tokens are read
        encoded = [{k: v for k, v in e.items() if k in TOKEN_KEYS} for e in encoded]
    inputs = collate_prompts(encoded, pad_id)
    device = ids.device
    inputs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    return group_forward(
        model, inputs, ids[rows, :width], mask[rows, :width], n, cfg.rollout.temperature, entropy, kept, apart, prefix
    )


def _reference_logp(engine: TrainingEngine, reference, batch, chunk, ids, mask, pad_id, cfg) -> torch.Tensor:
    if reference is not None:
        return _logprobs(reference, batch, chunk, ids, mask, pad_id, cfg).logp
    with engine.module.disable_adapter():  # LoRA: the reference is the base without adapters
        return _logprobs(engine.model, batch, chunk, ids, mask, pad_id, cfg).logp


@torch.no_grad()
def _sequence_kl(engine: TrainingEngine, reference, batch, rollouts, mask, pad_id, cfg) -> torch.Tensor:
    """Summed per-token KL estimate of each completion: [B*G]."""
    ids, everything = rollouts.completion_ids.to(engine.device), list(range(len(batch.samples)))
    logp = _logprobs(engine.model, batch, everything, ids, mask, pad_id, cfg).logp
    ref = _reference_logp(engine, reference, batch, everything, ids, mask, pad_id, cfg)
    return (kl_estimate(logp, ref, cfg.algorithm.kl_estimator) * mask[:, : logp.shape[1]]).sum(-1)


def _advantages(rewards: torch.Tensor, filler: bool, cfg: GRPOConfig) -> torch.Tensor:
    """Advantages [B*G] of this rank's completions. Statistics over the batch (REINFORCE++'s
    whitening) sum every rank's groups, so N ranks compute what one process does; a
    ``filler`` group (zero weight) counts in none of them and gets zeros."""
    own = rewards[:0] if filler else rewards
    advantages = compute_advantages(cfg.algorithm.advantage, own, cfg.rollout.n, distributed.all_sum)
    return torch.zeros_like(rewards, dtype=torch.float) if filler else advantages


def _offline_metrics(mixed: dict, mode: str) -> dict:
    """Over every rank: the share of scored groups that took an offline answer, and
    the mean reward of those answers and the share of them cut at ``max_new_tokens``
    (``algorithm.offline_responses``)."""
    if mode == "never":
        return {}
    groups, offline, reward, cut = distributed.all_sum(
        [mixed["groups"], mixed["offline"], mixed["offline_reward"], mixed["offline_cut"]]
    )
    row = {"offline/groups_share": offline / max(groups, 1)}
    if offline:
        row["offline/reward_mean"] = reward / offline
        row["offline/cut_share"] = cut / offline
    return row


def _tokens(batch: Batch, rollouts) -> int:
    """This rank's tokens of the step: its prompts (media included) and completions
    (none for a filler group, which trains with zero weight)."""
    if batch.filler:
        return 0
    return sum(inputs["input_ids"].shape[-1] for inputs in batch.encoded) + int(rollouts.lengths.sum())


def _rollout_metrics(rollouts, filler: bool) -> dict:
    """Response lengths over every rank's completions; a rank's filler group (a copy
    of another rank's, trained with zero weight) adds none, or they would count twice."""
    lengths, truncated = rollouts.lengths, rollouts.truncated
    if filler:
        lengths, truncated = lengths[:0], truncated[:0]
    count, total, clipped = distributed.all_sum([len(lengths), float(lengths.sum()), float(truncated.sum())])
    longest = distributed.all_max(int(lengths.max()) if len(lengths) else 0)
    if not count:
        return {}
    return {
        "response/length_mean": total / count,
        "response/length_max": longest,
        "response/clipped_fraction": clipped / count,
        "rollout/tokens": int(total),
    }


def _updates_per_step(cfg: GRPOConfig) -> int:
    """Optimizer steps per training step (the schedule's unit)."""
    mini = cfg.algorithm.mini_batch_prompts or cfg.data.prompts_per_step
    return cfg.algorithm.epochs * -(-cfg.data.prompts_per_step // mini)


# ------------------------------------------------------------------------------ train


def train(cfg: GRPOConfig, resume: str | None = None) -> dict:
    """Run GRPO; returns the last step's metrics. ``resume``: None, 'auto' or a
    checkpoint directory."""
    run = start_run(cfg, resume, rollout_processes=cfg.rollout.staleness)
    if run.ranks.rollout_process:
        return _serve_rollouts(cfg, run)
    load_plugins(cfg.rewards.custom)
    dataset, sampler = setup_data(cfg, run.device)  # every row checked before the model is built
    sampling = SamplingParams.of(cfg.rollout)
    heldout = HeldOut.for_run(cfg, run.out, cfg.rewards.settings(), sampling, model_inputs(cfg, run.device))
    model, processor, reference = setup_model(cfg, run, with_reference=cfg.algorithm.kl_coef > 0)
    total = cfg.trainer.steps * _updates_per_step(cfg)
    engine = TrainingEngine.from_config(model, cfg.trainer, cfg.optimizer, run.device, total)
    if reference is not None:
        reference = engine.wrap_frozen(reference)
    rollout = build_rollout_engine(cfg, engine.module, processor, model_dir(cfg, run.out), run.out)
    kept = SamplingFilter(tuple(rollout.banned), cfg.rollout.top_k, cfg.rollout.top_p)
    n, algo, pad = cfg.rollout.n, cfg.algorithm, processor.tokenizer.pad_token_id
    log, bar = resume_steps(cfg, run, engine, sampler, "grpo", heldout)
    _log.info("rollout correction: %s (cap %g)", _correction(cfg), algo.rollout_correction_cap)
    if cfg.rollout.reuse_prefill:
        blocker = _prefill_blocker(cfg, engine)
        if blocker is None:
            rollout.keep_prefill = True  # the hf engine's: the update reads its prefill
        else:
            _log.info("rollout.reuse_prefill: the update runs the prompts again: %s", blocker)
    # a rollout process generates each next batch while this one trains (rollout.staleness: 1)
    worker, pending = distributed.rollout_rank(), None
    push = _sampling_dtype(engine.precision)
    if worker is not None and run.ranks.is_main:  # also when there is nothing to train: it ends then
        remote.send_object({"step": bar.n, "sampler": sampler.state_dict()}, worker)
    if worker is not None and bar.n < cfg.trainer.steps:
        _log.info(
            "rollout.staleness: 1: process %d generates each step's prompts with the weights of the step before "
            "(%d trainer(s) update meanwhile); weights pushed in %s",
            worker,
            run.ranks.world_size,
            push,
        )
        remote.push_weights(engine.module, worker, push, PUSH_BUCKET_BYTES)  # a resumed or LoRA policy
        pending = remote.receive_object(worker)
    rollout.load_weights(engine.module)  # a resumed or LoRA policy differs from the checkpoint it started from
    row: dict = {}
    for step in bar:
        timer = Timer()
        # ROLLOUT + REWARD: G completions per prompt (each prompt prefilled once), scored by
        # problem_type; dynamic sampling drops groups that cannot teach and samples more
        if pending is not None:
            collected = pending
            sampler.load_state_dict(collected.sampler)  # past this batch's draws: what a checkpoint keeps
        else:
            balance = Balance(cfg.data.balance_tolerance)
            collected = _collect_step(dataset, sampler, rollout, processor, sampling, cfg, timer, balance)
        batch, rollouts, results, rewards = collected.batch, collected.rollouts, collected.results, collected.rewards
        rollout.sleep()  # the engine's memory goes to the update (vLLM's sleep mode)
        types = [s.problem_type for s in batch.samples for _ in range(n)] if not batch.filler else []
        sources = [s.data_source for s in batch.samples for _ in range(n)] if not batch.filler else []
        # ADVANTAGE: group-relative within each rank's groups; REINFORCE++ whitens over every rank's
        with timer("advantage"):
            generated = rollouts.completion_mask.to(run.device)
            if batch.filler:
                generated = torch.zeros_like(generated)
            # the loss's tokens: overlong masking leaves out the answers cut at the limit
            mask = (
                mask_truncated(generated, rollouts.truncated.to(run.device)) if algo.overlong == "mask" else generated
            )
            reward_kl = [0.0, 0.0]  # this rank's summed per-token KL and its tokens
            if algo.kl_coef > 0 and algo.kl_in_reward and batch.samples:
                # every answer's reward sets its group's baseline, a cut one's too: each pays its KL
                kl = _sequence_kl(engine, reference, batch, rollouts, generated, pad, cfg)
                rewards = rewards - algo.kl_coef * kl.cpu()
                reward_kl = [float(kl.sum()), float(generated.sum())]
            advantages = _advantages(rewards, batch.filler, cfg).to(run.device)
        # UPDATE: mini-batches of prompts, several epochs, against stored old log-probs
        with timer("update"):
            # the rows written: the schedule's, the last, and those an evaluation logs
            logged = log.due(step + 1, force=step + 1 == cfg.trainer.steps or heldout.due(step + 1))
            update = _update(engine, reference, batch, rollouts, mask, advantages, pad, cfg, logged, kept)
            if algo.kl_coef > 0 and algo.kl_in_reward:
                total, tokens = distributed.all_sum(reward_kl)
                update["actor/kl"] = total / tokens if tokens else 0.0
        if worker is None:
            with timer("weight_sync"):  # wakes a sleeping engine with the new weights
                rollout.load_weights(engine.module)
        elif step + 1 < cfg.trainer.steps:
            with timer("weight_sync"):  # to the rollout process, which sends the next batch once it has them
                remote.push_weights(engine.module, worker, push, PUSH_BUCKET_BYTES)
            with timer("rollout_wait"):
                pending = remote.receive_object(worker)
        # LOG: every rank's rewards and diagnostics; a UCB sampler learns each source's
        # absolute advantages (every rank's, in draw order, as one process would: the same
        # state on every rank, however rows were dealt), a group dynamic sampling dropped
        # counting |A| = 0 for each of its completions
        magnitudes = [] if batch.filler else advantages.abs().tolist()
        drawn = [] if batch.filler else [number for number in batch.numbers for _ in range(n)]
        sampled = [] if batch.filler else (~rollouts.replaced).tolist()  # not an offline answer
        columns = list(zip(results, types, sources, magnitudes, drawn, sampled, strict=True))
        everything = distributed.gather_objects(columns)
        columns = [list(x) for x in zip(*everything, strict=True)] or [[], [], [], [], [], []]
        every_result, _, every_source, every_magnitude, every_drawn, _ = columns
        every_filtered = distributed.gather_objects(collected.filtered)
        observe_in_draw_order(sampler, every_source, every_magnitude, every_drawn, every_filtered)
        # the policy's own answers (result, type, source): offline ones have offline/reward_mean
        own = [column[:3] for column in everything if column[5]]
        scores = reward_metrics(*map(list, zip(*own, strict=True))) if own else {}
        skipped = _skipped_metrics(collected.skipped)
        report = collected.report
        row = {
            "step": step + 1,
            **scores,
            **distributed.mean_metrics(timer.metrics()),
            **skipped,
            **update,
            **_rollout_metrics(rollouts, batch.filler),
            **distributed.mean_metrics(report.get("engine") if worker is not None else rollout.metrics()),
            "rollout/staleness": step - collected.version if worker is not None else 0,
            **{k: v for k, v in report.items() if k not in ("engine", "cache")},
            **engine.metrics(),
            "reward/scorer_errors": sum("error" in r.details for r in every_result),
            **(report["cache"] if worker is not None else dataset.run_metrics()),
            **dataset.load_report(),
            **sampler.metrics(),
            **_offline_metrics(collected.mixed, algo.offline_responses),
            **collected.balance,
            "balance/max_over_mean": max_over_mean(distributed.all_gather_ints(_tokens(batch, rollouts))),
        }
        seconds = row["rollout_process/rollout_s"] if worker is not None else row["time/rollout"]
        row["throughput/rollout_tokens_per_s"] = row.get("rollout/tokens", 0) / max(seconds, 1e-9)
        evaluated = heldout.add_to(row, engine, processor)
        log.log(row, force=evaluated or step + 1 == cfg.trainer.steps)
        bar.set_postfix(reward=f"{row.get('reward/mean', 0):.3f}", s_step=f"{row['time/step']:.1f}")
        # CHECKPOINT
        save_if_due(cfg, run, step + 1, engine, processor, {"sampler": sampler.state_dict()})
    log.close()
    row = row or last_row(run.out)  # a finished run resumed runs no step
    finish_run(run, cfg.trainer.steps, {"train": dataset, **heldout.datasets()}, row)
    return row


def observe_in_draw_order(sampler, sources: list, magnitudes: list, drawn: list, filtered: list) -> None:
    """Feed the sampler a step's absolute advantages, one per completion of every rank
    (gathered in rank order, with each completion's prompt's draw number), in draw order:
    dealing rows by length (``data.balance_tolerance``) can give a rank a later draw of
    a source than another rank holds, and a source's window keeps its latest values.
    Then |A| = 0 for each completion of the groups dynamic sampling dropped."""
    order = sorted(range(len(drawn)), key=drawn.__getitem__)
    sampler.observe([sources[i] for i in order] + filtered, [magnitudes[i] for i in order] + [0.0] * len(filtered))


def _skipped_metrics(skipped: dict) -> dict:
    """``skipped/*`` of a step: prompts too long and groups filtered counted over every
    rank (a rank's share of a rollout process's counts sums back to the whole), the
    sampling rounds a rank's, averaged."""
    counts = [k for k in sorted(skipped) if k != "sampling_rounds"]
    *summed, rounds = distributed.all_sum([float(skipped[k]) for k in [*counts, "sampling_rounds"]])
    out = {f"skipped/{k}": round(v) for k, v in zip(counts, summed, strict=True)}
    return out | {"skipped/sampling_rounds": rounds / distributed.ranks().world_size}


def _collect_step(dataset, sampler, rollout, processor, sampling, cfg: GRPOConfig, timer, balance) -> Collected:
    """``_collect`` with fresh counters; ``balance``: a ``Balance`` that deals rows to
    ranks by tokens, or None (one process generating for every rank)."""
    skipped = {"prompt_too_long": 0, "groups_filtered": 0, "sampling_rounds": 0}  # bad rows: the dataset counts
    mixed = {"groups": 0, "offline": 0, "offline_reward": 0.0, "offline_cut": 0}
    out = _collect(dataset, sampler, rollout, processor, sampling, cfg, skipped, mixed, balance, timer)
    return Collected(*out, skipped, mixed, balance.metrics() if balance is not None else {})


def _sampling_dtype(precision: str) -> torch.dtype:
    """The dtype a rollout process samples in: the trainer forward's (bf16 under either
    bf16 precision)."""
    return torch.float32 if precision == "fp32" else torch.bfloat16


def cast_weights(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """The parameters in ``dtype``, in place; buffers stay as loaded: the rotary
    frequencies (``inv_freq``) in fp32, as the trainer's forward and ``from_pretrained``
    in bf16 keep them (``module.to(bf16)`` rounds them too: 0.37% off in Qwen2.5-VL's
    text RoPE, about 1 rad of angle by position 1,000)."""
    for param in model.parameters():
        param.data = param.data.to(dtype)


# -------------------------------------------------------------------- rollout process


def _serve_rollouts(cfg: GRPOConfig, run) -> dict:
    """The rollout process of a one-step-off run (``rollout.staleness: 1``). It takes the
    start step, the sampler's state and the weights from the trainers, then for each
    step k: draws, rolls out and scores the whole batch (``_collect`` in one process,
    dynamic sampling included) with the weights of step k - 1 (of step k after a
    checkpoint or at the start, so that a resumed run repeats the uninterrupted one),
    takes step k's weights, and deals each trainer its groups by prompt tokens."""
    trainers = distributed.rollout_rank()  # global ranks 0 .. trainers - 1; this process is the last
    start = remote.receive_object(0)  # sent once trainer 0 built the model
    if start["step"] >= cfg.trainer.steps:
        return {}
    load_plugins(cfg.rewards.custom)
    dataset, sampler = setup_data(cfg, run.device)
    sampler.load_state_dict(start["sampler"])
    model, processor, _ = setup_model(cfg, run)
    dtype = _sampling_dtype(resolve_precision(cfg.trainer.precision, run.device))
    cast_weights(model, dtype)
    rollout = build_rollout_engine(cfg, model, processor, model_dir(cfg, run.out), run.out)
    sampling = SamplingParams.of(cfg.rollout)
    remote.receive_weights(model, 0, dtype)
    version, every = start["step"], cfg.trainer.save_every
    _log.info("rollout process %d: generating steps %d-%d", trainers, start["step"] + 1, cfg.trainer.steps)
    for step in range(start["step"], cfg.trainer.steps):
        timer = Timer()
        fresh = step == start["step"] or (every and step % every == 0)
        with timer("weights_wait"):
            while version < (step if fresh else step - 1):
                remote.receive_weights(model, 0, dtype)
                version += 1
        generated_with = version
        collected = _collect_step(dataset, sampler, rollout, processor, sampling, cfg, timer, None)
        with timer("weights_wait"):  # step k's weights, pushed before the trainers take this batch
            while version < step:
                remote.receive_weights(model, 0, dtype)
                version += 1
        collected.version, collected.sampler = generated_with, sampler.state_dict()
        collected.report = {
            **{f"rollout_process/{k}_s": v for k, v in timer.seconds.items()},
            "engine": rollout.metrics(),
            "cache": dataset.cache_metrics(),
        }
        for rank, part in enumerate(_deal_to_trainers(collected, trainers, cfg)):
            remote.send_object(part, rank)
    return {}


def _deal_to_trainers(collected: Collected, trainers: int, cfg: GRPOConfig) -> list[Collected]:
    """The whole batch's groups dealt to ``trainers`` ranks: in draw order, as evenly as
    counts go, then swapped by prompt tokens within ``data.balance_tolerance``; a
    trainer left without a group trains on a copy of the first with zero weight. Rank 0
    carries the counts that are summed over ranks; each rank ``skipped``'s share."""
    batch, n, count = collected.batch, cfg.rollout.n, len(collected.batch.samples)
    tokens = [inputs["input_ids"].shape[-1] for inputs in batch.encoded]
    drawn = [i * trainers // count for i in range(count)]
    tolerance = cfg.data.balance_tolerance
    owners = drawn if tolerance is None else balance_by_swaps(tokens, drawn, trainers, tolerance)
    balance = Balance(tolerance, sum(a != b for a, b in zip(drawn, owners, strict=True)))
    if count:
        balance.drawn.append(max_over_mean(rank_loads(tokens, drawn, trainers)))
        balance.dealt.append(max_over_mean(rank_loads(tokens, owners, trainers)))
    rollouts = collected.rollouts
    rollouts = dataclasses.replace(  # pickled for another process: on the CPU
        rollouts, **{f.name: getattr(rollouts, f.name).cpu() for f in _tensor_fields(rollouts)}
    )
    skipped = {k: v if k == "sampling_rounds" else v / trainers for k, v in collected.skipped.items()}
    none = {k: 0 for k in collected.mixed}
    parts = []
    for rank in range(trainers):
        keep = [i for i in range(count) if owners[i] == rank]
        filler = not keep and count > 0
        if filler:
            keep = [0]
        rows = _rows(keep, n)
        part = Batch(
            [batch.samples[i] for i in keep],
            [batch.encoded[i] for i in keep],
            [batch.seeds[i] for i in keep],
            [batch.numbers[i] for i in keep],
            filler,
        )
        parts.append(
            Collected(
                part,
                select_groups(rollouts, keep),
                [] if filler else [collected.results[r] for r in rows],
                collected.rewards[rows],
                collected.filtered if rank == 0 else [],
                skipped,
                collected.mixed if rank == 0 else none,
                balance.metrics(),
                collected.version,
                collected.sampler,
                collected.report,
            )
        )
    return parts


def _tensor_fields(rollouts: Rollouts) -> list:
    return [f for f in dataclasses.fields(rollouts) if isinstance(getattr(rollouts, f.name), torch.Tensor)]


def _rows(chunk: list[int], n: int) -> list[int]:
    """Completion rows of the prompts in ``chunk`` (G consecutive rows per prompt)."""
    return [p * n + g for p in chunk for g in range(n)]


def _plan(prompts: list[int], lengths: list[tuple[int, int]], cfg: GRPOConfig) -> list[list[list[int]]]:
    """Mini-batches (one optimizer step each) of micro-batches (one forward and backward
    each) of this rank's prompts, padded to the same shape on every rank: a rank short
    of a micro-batch repeats its first one, marked by an empty list, with zero weight.

    Micro-batches hold ``trainer.micro_batch_size`` prompts, or are packed by length
    under ``trainer.max_tokens_per_microbatch`` (``lengths``: per prompt, its prompt
    tokens and its G completions' padded tokens)."""
    ranks = distributed.ranks()
    mini = per_rank(cfg.algorithm.mini_batch_prompts or cfg.data.prompts_per_step, ranks, "mini-batch prompts")
    micro, budget = cfg.trainer.micro_batch_size, cfg.trainer.max_tokens_per_microbatch
    minis = [prompts[i : i + mini] for i in range(0, len(prompts), mini)]
    plan = []
    for c, _ in distributed.lockstep(minis, filler=list):  # a rank out of mini-batches runs empty ones
        if budget:
            chunks = [[c[j] for j in b] for b in pack_by_tokens([lengths[p] for p in c], budget, micro)]
        else:
            step = micro or len(c) or 1
            chunks = [c[i : i + step] for i in range(0, len(c), step)]
        plan.append([chunk if real else [] for chunk, real in distributed.lockstep(chunks, filler=list)])
    return plan


def _entropy_mode(cfg: GRPOConfig, logged: bool) -> Entropy:
    """Differentiable entropy for a bonus; a detached one only on steps that log it."""
    if cfg.algorithm.entropy_coef > 0:
        return "grad"
    return "metric" if logged else "off"


def _correction(cfg: GRPOConfig) -> str:
    """The rollout correction in force (``auto``: tis with vLLM or a one-step-off
    rollout, none with hf sampling with the trainer's own weights)."""
    mode = cfg.algorithm.rollout_correction
    if mode == "auto":
        return "tis" if cfg.rollout.engine == "vllm" or cfg.rollout.staleness else "none"
    return mode


def _ratio_log(out, behaviour: torch.Tensor, mask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """log pi - log mu of these rows' tokens, like with like: the trainer's log-probs
    under the same processed distribution (top-k, top-p, banned tokens) the engine's
    were recorded under."""
    width = out.logp.shape[1]
    trainer = out.logp.detach() - (out.log_kept if out.log_kept is not None else 0.0)
    return log_ratio(trainer, behaviour[rows, :width], mask[rows, :width])


def _prefill_blocker(cfg: GRPOConfig, engine: TrainingEngine) -> str | None:
    """Why the update's forward cannot read the rollout's prefill (``rollout.reuse_prefill``),
    or None where it can: the two must be one forward of one batch with the same
    weights, mode and wrapper."""
    algo, trainer = cfg.algorithm, cfg.trainer
    micro = trainer.micro_batch_size
    reasons = {
        "rollout.engine is vllm: its prefill is not the policy's": cfg.rollout.engine != "hf",
        "rollout.staleness 1: the rollout process prefills with the step before's weights": cfg.rollout.staleness,
        f"trainer.strategy {engine.strategy}: the update's forward runs through its wrapper": engine.strategy
        != "single",
        "model.gradient_checkpointing: the prefill's activations would be held, not recomputed": (
            cfg.model.gradient_checkpointing
        ),
        "algorithm.epochs > 1: the later epochs run with new weights": algo.epochs > 1,
        "the update splits the batch (algorithm.mini_batch_prompts, trainer.micro_batch_size or "
        "max_tokens_per_microbatch)": (0 < algo.mini_batch_prompts < cfg.data.prompts_per_step)
        or (0 < micro < cfg.data.prompts_per_step)
        or trainer.max_tokens_per_microbatch > 0,
        "algorithm.dynamic_sampling: a step's batch is drawn over several rounds": algo.dynamic_sampling,
        "algorithm.rollout_correction mask: old log-probs come from a forward of their own": _correction(cfg) == "mask",
    }
    reason = next((reason for reason, applies in reasons.items() if applies), None)
    if reason is None and (dropout := training_dropout(engine.module)) is not None:
        reason = f"the model drops activations in training ({dropout}): the rollout's prefill (eval mode) differs"
    return reason


def _update(
    engine: TrainingEngine,
    reference,
    batch,
    rollouts,
    mask,
    advantages,
    pad_id,
    cfg,
    logged: bool,
    kept: SamplingFilter = NO_FILTER,
) -> dict:
    """PPO-style epochs over mini-batches of prompts, each accumulated over micro-batches
    and stepped by the engine; returns the mini-batches' mean diagnostics over ranks,
    with the rollout/trainer mismatch of the batch and its correction (``kept``: what
    the rollout engine's sampling removed beyond temperature)."""
    algo, n = cfg.algorithm, cfg.rollout.n
    correction, cap = _correction(cfg), algo.rollout_correction_cap
    ids = rollouts.completion_ids.to(engine.device)
    behaviour = rollouts.logprobs.to(engine.device)
    # an offline answer's behaviour log-prob is the trainer's own at rollout time: its
    # log pi/mu is 0, and it counts in no mismatch figure
    sampled = mask.masked_fill(rollouts.replaced.to(mask.device)[:, None], 0)
    prompts = list(range(len(batch.samples)))
    planned = _updates_per_step(cfg)  # what the schedule counts, taken or not
    if not distributed.all_max(len(prompts)):
        engine.skip_steps(planned)
        return {"skipped_update": 1}
    lengths = [(batch.encoded[p]["input_ids"].shape[-1], n * _width(mask, _rows([p], n))) for p in prompts]
    plan = _plan(prompts, lengths, cfg)
    needs_old = algo.epochs > 1 or len(plan) > 1 or correction == "mask"
    # the rollout's prefill of these prompts, read by the one forward of the whole batch
    prefill, rollouts.prefill = rollouts.prefill, None
    if prefill is not None and (needs_old or plan != [[prompts]]):
        prefill = None
    reused = prefill is not None
    filt = None if kept.trivial else kept
    old, ref, ratios = {}, {}, {}
    with torch.no_grad():
        for m, chunks in enumerate(plan):
            for i, chunk in enumerate(chunks):
                chunk = chunk or prompts[:1]  # a padding forward keeps collectives in step
                if needs_old:
                    out = _logprobs(engine.model, batch, chunk, ids, mask, pad_id, cfg, kept=filt)
                    old[m, i], ratios[m, i] = out.logp, _ratio_log(out, behaviour, sampled, _rows(chunk, n))
                if algo.kl_coef > 0 and not algo.kl_in_reward:
                    ref[m, i] = _reference_logp(engine, reference, batch, chunk, ids, mask, pad_id, cfg)
    loss_mask, dropped = mask, 0
    if correction == "mask":  # before the denominators: a dropped completion counts nowhere
        loss_mask = mask.clone()
        for (m, i), ratio in ratios.items():
            rows = _rows(plan[m][i], n)
            if rows:
                keep = sequence_keep(ratio, mask[rows, : ratio.shape[1]], cap)
                dropped += int((~keep & mask[rows].bool().any(-1)).sum())
                loss_mask[rows] *= keep[:, None].to(mask.dtype)
    sums: dict[str, float] = {}
    entropy = _entropy_mode(cfg, logged)
    logged_means = {"loss/clip_fraction": 0.0, "loss/ratio_mean": 1.0, "loss/approx_kl": 0.0}
    if algo.dual_clip is not None:
        logged_means["loss/dual_clip_fraction"] = 0.0
    if algo.kl_coef > 0 and not algo.kl_in_reward:
        logged_means["actor/kl"] = 0.0
    if entropy != "off":
        logged_means["actor/entropy"] = 0.0
    pooled = PooledMeans(logged_means)
    mismatch = MismatchSums()
    grad_norms = []
    for epoch in range(algo.epochs):
        for m, chunks in enumerate(plan):
            mini_rows = _rows([p for c in chunks for p in c], n)
            if algo.averaging == "token-mean":
                (denominator,) = distributed.all_sum([float(loss_mask[mini_rows].sum())])
            else:
                (denominator,) = distributed.all_sum([float(loss_mask[mini_rows].any(-1).sum())])
            denominator = max(denominator, 1.0)
            for i, chunk in enumerate(chunks):
                weight = 1.0 if chunk else 0.0
                chunk = chunk or prompts[:1]
                rows = _rows(chunk, n)
                out = _logprobs(
                    engine.model,
                    batch,
                    chunk,
                    ids,
                    mask,
                    pad_id,
                    cfg,
                    entropy,
                    None if needs_old else filt,
                    apart=engine.prompt_apart,
                    prefix=prefill,
                )
                prefill = None  # read once: its graph goes with this forward's backward
                width = out.logp.shape[1]
                old_logp = old[m, i] if needs_old else out.logp.detach()
                ratio = ratios[m, i] if needs_old else _ratio_log(out, behaviour, sampled, rows)
                if epoch == 0 and weight:
                    mismatch = mismatch + mismatch_sums(ratio, sampled[rows, :width], cap)
                tis = None
                if correction == "tis":
                    weigh = sequence_tis_weights if algo.loss == "gspo" else tis_weights
                    tis = weigh(ratio, loss_mask[rows, :width], cap)
                loss, part_sums, part_stats, part_means = _policy_loss(
                    out, old_logp, ref.get((m, i)), advantages[rows], loss_mask[rows, :width], denominator, cfg, tis
                )
                engine.backward(loss * weight, out.prompt)
                del out, loss  # the micro-batch's graph, before the next forward or the step
                for key, value in part_sums.items():
                    sums[key] = sums.get(key, 0.0) + value * weight
                if weight:
                    pooled.add_ratios(m + epoch * len(plan), part_stats)
                    tokens = int(loss_mask[rows, :width].sum())
                    for name, mean in part_means.items():
                        pooled.add(m + epoch * len(plan), name, mean, tokens)
            grad_norms.append(engine.step().grad_norm)  # global: the same on every rank
    engine.skip_steps(planned - len(grad_norms))  # a batch dynamic sampling left short
    keys = sorted(sums)
    totals = distributed.all_sum([sums[k] for k in keys])
    stats = {k: v / len(grad_norms) for k, v in zip(keys, totals, strict=True)}
    stats["optim/grad_norm"] = sum(grad_norms) / len(grad_norms)
    stats["update/micro_batches"] = sum(len(chunks) for chunks in plan)
    stats["update/prompt_backward_apart"] = float(engine.prompt_apart)  # 0 under ddp: one backward call
    stats["update/prefill_reused"] = float(reused)
    if engine.tied_grad_in_place is not None:
        stats["update/tied_grad_in_place"] = float(engine.tied_grad_in_place)
    stats.update(pooled.metrics(len(grad_norms)))
    sequences = float(mask.bool().any(-1).sum())
    stats.update(_mismatch_metrics(mismatch, dropped, sequences, correction, per_sequence=algo.loss == "gspo"))
    return stats


def _mismatch_metrics(
    sums: MismatchSums, dropped: int, sequences: float, correction: str, per_sequence: bool = False
) -> dict:
    """The rollout/trainer mismatch over every rank's tokens, and what the correction did
    (``per_sequence``: the truncation caps sequences, GSPO's, and its share counts them)."""
    abs_diff, k3, tokens, over_cap, sampled, sampled_over, dropped, sequences = distributed.all_sum(
        [*astuple(sums), float(dropped), sequences]
    )
    tokens = max(tokens, 1.0)
    row = {"rollout/logp_abs_diff": abs_diff / tokens, "rollout/kl_k3": k3 / tokens}
    if correction == "tis":
        capped = sampled_over / max(sampled, 1.0) if per_sequence else over_cap / tokens
        row["rollout/tis_capped_fraction"] = capped
    if correction == "mask":
        row["rollout/masked_fraction"] = dropped / max(sequences, 1.0)
    return row
