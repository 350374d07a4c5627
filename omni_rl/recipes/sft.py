"""Supervised fine-tuning, read top to bottom: the cold start before RL.

Same data, media pipeline and models as GRPO; each row's target completion is rendered
from its fields (``sft.target_template``) and the loss is the token-mean cross-entropy
on the target tokens only.
"""

from __future__ import annotations

from omni_rl.data.dataset import Sample, encode_sample
from omni_rl.engine import distributed
from omni_rl.engine.engine import Engine
from omni_rl.errors import OmniRLError
from omni_rl.models.forward import reset_rope_deltas, text_positions
from omni_rl.models.inputs import append_completion, collate_prompts
from omni_rl.recipes.common import Timer, per_rank, resume_steps, save_if_due, setup_data, setup_model, start_run
from omni_rl.recipes.sft_config import SFTConfig


def render_target(template: str, sample: Sample) -> str:
    """The target completion of a sample: ``template`` filled with its row's fields."""
    try:
        return template.format_map({**sample.fields, "answer": sample.answer})
    except KeyError as err:
        raise OmniRLError(f"sft.target_template field {err} is not in row '{sample.id}'") from None


def _batch(dataset, indices, processor, cfg: SFTConfig, device):
    """Model inputs and labels (-100 on prompts and padding) for the rows ``indices``."""
    tokenizer = processor.tokenizer
    samples = [dataset[i] for i in indices]
    inputs = collate_prompts([dict(encode_sample(processor, s)) for s in samples], tokenizer.pad_token_id)
    targets = [render_target(cfg.sft.target_template, s) + tokenizer.eos_token for s in samples]
    encoded = tokenizer(targets, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False)
    batch, labels = append_completion(inputs, encoded["input_ids"], encoded["attention_mask"])
    return {k: v.to(device) for k, v in batch.items()}, labels.to(device)


def _target_nll(model, batch: dict, labels, tokens: float):
    """Summed cross-entropy of the target tokens divided by ``tokens``, the whole step's
    target count over every rank and micro-batch (transformers' ``num_items_in_batch``)."""
    reset_rope_deltas(model)
    positions = text_positions(model, batch["attention_mask"])
    extra = {"position_ids": positions} if positions is not None else {}
    return model(**batch, labels=labels, num_items_in_batch=tokens, **extra).loss


def train(cfg: SFTConfig, resume: str | None = None) -> dict:
    """Run SFT; returns the last step's metrics."""
    run = start_run(cfg, resume)
    model, processor, _ = setup_model(cfg, run)
    dataset, sampler = setup_data(cfg)
    engine = Engine.from_config(model, cfg.trainer, cfg.optimizer, run.device, cfg.trainer.steps)
    rows = per_rank(cfg.data.prompts_per_step, run.ranks, "data.prompts_per_step")
    micro = cfg.trainer.micro_batch_size or rows
    log, bar = resume_steps(cfg, run, engine, sampler, "sft")
    row: dict = {}
    for step in bar:
        timer = Timer()
        # DATA: this rank's share of the step's rows, with media; targets rendered from the rows
        with timer("data"):
            indices = sampler.next_batch(cfg.data.prompts_per_step)[run.ranks.rank * rows : (run.ranks.rank + 1) * rows]
            parts = [_batch(dataset, indices[i : i + micro], processor, cfg, run.device) for i in range(0, rows, micro)]
            (tokens,) = distributed.all_sum([float(sum(int((labels != -100).sum()) for _, labels in parts))])
        # UPDATE: cross-entropy on the target tokens, accumulated over micro-batches
        with timer("update"):
            loss = 0.0
            for batch, labels in parts:
                part = _target_nll(engine.model, batch, labels, tokens)
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
            **engine.metrics(),
            **distributed.mean_metrics(timer.metrics()),
        }
        log.log(row, force=step + 1 == cfg.trainer.steps)
        bar.set_postfix(loss=f"{row['loss/sft']:.3f}")
        save_if_due(cfg, run, step + 1, engine, processor, {"sampler": sampler.state_dict()})
    log.close()
    return row
