"""Supervised fine-tuning, read top to bottom: the cold start before RL.

Same data, media pipeline and models as GRPO; each row's target completion is rendered
from its fields (``sft.target_template``) and the loss is the token-mean cross-entropy
on the target tokens only.
"""

from __future__ import annotations

import logging

import torch

from omni_rl.data.dataset import Sample
from omni_rl.engine import distributed
from omni_rl.engine.engine import TrainingEngine
from omni_rl.errors import OmniRLError
from omni_rl.evaluation.during_training import HeldOut
from omni_rl.models.forward import (
    completion_logprobs,
    explicit_positions,
    head_replaced,
    output_head,
    reset_rope_deltas,
)
from omni_rl.models.inputs import IGNORE_INDEX, answer_end, append_completion, collate_prompts
from omni_rl.recipes.common import (
    Balance,
    Timer,
    draw_rows,
    finish_run,
    last_row,
    max_over_mean,
    model_inputs,
    pack_by_tokens,
    per_rank,
    resume_steps,
    save_if_due,
    setup_data,
    setup_model,
    start_run,
)
from omni_rl.recipes.sft_config import SFTConfig
from omni_rl.rollout.hf import max_positions

_log = logging.getLogger(__name__)


def render_target(template: str, sample: Sample) -> str:
    """The target completion of a sample: ``template`` filled with its row's fields."""
    try:
        return template.format_map({**sample.fields, "answer": sample.answer})
    except KeyError as err:
        raise OmniRLError(f"sft.target_template field {err} is not in row '{sample.id}'") from None


def row_limit(cfg: SFTConfig, model) -> tuple[int, str] | None:
    """The longest row trained and what sets it: ``sft.max_length`` or the model's
    positions, whichever is less (None: neither sets one)."""
    limits = [(cfg.sft.max_length, f"sft.max_length={cfg.sft.max_length}")] if cfg.sft.max_length else []
    positions = max_positions(model)
    if positions is not None:
        limits.append((positions, f"the model's {positions} positions"))
    return min(limits) if limits else None


def _encode(
    dataset, sampler, count: int, processor, cfg: SFTConfig, balance: Balance, limit, skipped: dict
) -> list[tuple[dict, list[int]]]:
    """This rank's ``count`` rows of the step (``draw_rows``: a bad row is skipped and
    another drawn in its place, rows dealt to ranks by their prompt tokens), each as its
    encoded prompt (with media) and its target's token ids (closed as the chat template
    closes an answer, ``answer_end``). A row longer
    than ``limit`` (``row_limit``) is skipped too, counted in ``skipped``."""
    tokenizer, end = processor.tokenizer, answer_end(processor)

    def target_ids(sample: Sample) -> list[int]:
        target = render_target(cfg.sft.target_template, sample) + end
        return tokenizer(target, add_special_tokens=False)["input_ids"]

    def too_long(sample: Sample, inputs: dict) -> str | None:
        tokens = inputs["input_ids"].shape[-1] + len(target_ids(sample))
        if limit is None or tokens <= limit[0]:
            return None
        if not skipped["row_too_long"]:
            _log.warning(
                "row '%s': %d tokens with its target, over %s: skipped (counted in skipped/row_too_long)",
                sample.id,
                tokens,
                limit[1],
            )
        skipped["row_too_long"] += 1
        return f"rows over {limit[1]}"

    drawn = draw_rows(dataset, sampler, count, processor, too_long, balance)
    return [(inputs, target_ids(sample)) for _, sample, inputs in drawn]


def _micro_batches(rows: list[tuple[dict, list[int]]], cfg: SFTConfig) -> list[list[int]]:
    """Row positions per forward: ``micro_batch_size`` at a time, or packed by length
    under ``max_tokens_per_microbatch``."""
    micro, budget = cfg.trainer.micro_batch_size, cfg.trainer.max_tokens_per_microbatch
    if budget:
        return pack_by_tokens([(p["input_ids"].shape[-1], len(t)) for p, t in rows], budget, micro)
    step = micro or len(rows)
    return [list(range(i, min(i + step, len(rows)))) for i in range(0, len(rows), step)]


def _batch(rows: list[tuple[dict, list[int]]], processor, device):
    """Model inputs and labels (-100 on prompts and padding) for encoded rows."""
    tokenizer = processor.tokenizer
    inputs = collate_prompts([p for p, _ in rows], tokenizer.pad_token_id)
    encoded = tokenizer.pad({"input_ids": [t for _, t in rows]}, return_tensors="pt", padding_side="right")
    batch, labels = append_completion(inputs, encoded["input_ids"], encoded["attention_mask"])
    return {k: v.to(device) for k, v in batch.items()}, labels.to(device)


def _target_nll(model, batch: dict, labels, tokens: float):
    """Summed cross-entropy of the target tokens divided by ``tokens``, the whole step's
    target count over every rank and micro-batch (transformers' ``num_items_in_batch``).

    The decoder's hidden states go through the chunked head GRPO uses
    (``completion_logprobs``) at the target positions only, a chunk at a time, so no
    [B, L, V] logits exist: at a 7B model's 152k vocabulary they are about 0.6 MB per
    token in fp32, and a prompt's media tokens make most of L. Equals
    ``model(**batch, labels=labels, num_items_in_batch=tokens).loss`` in value and
    gradients (a test), except that Qwen2-Audio's transformers head ignores
    ``num_items_in_batch`` and averages each micro-batch: here every family's sum is
    divided by ``tokens``; and that an MoE's load-balancing term, which transformers
    adds whole to each call, is weighted by this micro-batch's share of ``tokens``, so
    that a step counts it once however its rows are split over micro-batches and ranks.

    Args:
        batch: model inputs, ``input_ids`` [B, L] (and their media).
        labels: [B, L], the target tokens, -100 on prompts and padding.
    """
    reset_rope_deltas(model)
    batch = dict(batch)
    positions, _ = explicit_positions(model, batch)
    if positions is not None:
        batch["position_ids"] = positions
    # transformers' shift: the state at t predicts token t + 1, the last predicts none
    targets = labels[:, 1:]
    head = output_head(model)
    with head_replaced(
        model, lambda hidden: completion_logprobs(hidden[:, :-1], head, targets, targets != IGNORE_INDEX)
    ):
        out = model(**batch, use_cache=False)
    loss = -out.logits[..., 0].sum() / tokens
    aux = getattr(out, "aux_loss", None)
    if aux is not None:  # MoE load balancing, which transformers adds to a ``labels=`` loss
        share = (targets != IGNORE_INDEX).sum() / tokens
        loss = loss + _unwrapped(model).router_aux_loss_coef * aux.to(loss.device) * share
    return loss


def _unwrapped(model):
    while isinstance(model, torch.nn.parallel.DistributedDataParallel):
        model = model.module
    return model


def train(cfg: SFTConfig, resume: str | None = None) -> dict:
    """Run SFT; returns the last step's metrics."""
    run = start_run(cfg, resume)
    dataset, sampler = setup_data(cfg, run.device)  # every row checked before the model is built
    # no rewards or rollout section: default reward settings, pass@K at 1.0
    heldout = HeldOut.for_run(cfg, run.out, inputs=model_inputs(cfg, run.device))
    model, processor, _ = setup_model(cfg, run)
    engine = TrainingEngine.from_config(model, cfg.trainer, cfg.optimizer, run.device, cfg.trainer.steps)
    rows = per_rank(cfg.data.prompts_per_step, run.ranks, "data.prompts_per_step")
    limit, skipped = row_limit(cfg, model), {"row_too_long": 0}  # since the run started; logged per step
    log, bar = resume_steps(cfg, run, engine, sampler, "sft", heldout)
    row: dict = {}
    for step in bar:
        timer = Timer()
        # DATA: this rank's share of the step's rows, with media; targets rendered from the rows
        with timer("data"):
            balance, before = Balance(cfg.data.balance_tolerance), skipped["row_too_long"]
            encoded = _encode(dataset, sampler, rows, processor, cfg, balance, limit, skipped)
            plan = _micro_batches(encoded, cfg)
            # packed by length, ranks may differ in forwards: the short ones repeat their
            # first with zero weight, so that sharded forwards stay in step
            steps = distributed.lockstep(plan)
            weights = [1.0 if real else 0.0 for _, real in steps]
            parts = [_batch([encoded[i] for i in micro], processor, run.device) for micro, _ in steps]
            (tokens,) = distributed.all_sum(
                [float(sum(w * int((labels != -100).sum()) for (_, labels), w in zip(parts, weights, strict=True)))]
            )
        # UPDATE: cross-entropy on the target tokens, accumulated over micro-batches
        with timer("update"):
            loss = 0.0
            for (batch, labels), weight in zip(parts, weights, strict=True):
                part = _target_nll(engine.model, batch, labels, tokens) * weight
                engine.backward(part)
                loss += part.item()
            result = engine.step()
        # LOG / CHECKPOINT
        (loss,) = distributed.all_sum([loss])
        row = {
            "step": step + 1,
            "loss/sft": loss,
            "optim/grad_norm": result.grad_norm,
            "tokens/target": int(tokens),
            "skipped/row_too_long": round(distributed.all_sum([float(skipped["row_too_long"] - before)])[0]),
            **dataset.run_metrics(),
            **dataset.load_report(),
            **engine.metrics(),
            **distributed.mean_metrics(timer.metrics()),
            **balance.metrics(),
            "balance/max_over_mean": max_over_mean(
                distributed.all_gather_ints(sum(p["input_ids"].shape[-1] + len(t) for p, t in encoded))
            ),
        }
        evaluated = heldout.add_to(row, engine, processor)
        log.log(row, force=evaluated or step + 1 == cfg.trainer.steps)
        bar.set_postfix(loss=f"{row['loss/sft']:.3f}")
        save_if_due(cfg, run, step + 1, engine, processor, {"sampler": sampler.state_dict()})
    log.close()
    row = row or last_row(run.out)  # a finished run resumed runs no step
    finish_run(run, cfg.trainer.steps, {"train": dataset, **heldout.datasets()}, row)
    return row
