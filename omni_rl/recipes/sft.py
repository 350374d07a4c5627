"""Supervised fine-tuning, read top to bottom: the cold start before RL.

Same data, media pipeline and models as GRPO; each row's target completion is rendered
from its fields (``sft.target_template``) and the loss is the token-mean cross-entropy
on the target tokens only.
"""

from __future__ import annotations

import torch
from tqdm import tqdm

from omni_rl.config import SFTConfig
from omni_rl.data.dataset import Sample, encode_sample
from omni_rl.errors import OmniRLError
from omni_rl.models.forward import reset_rope_deltas, text_positions
from omni_rl.models.inputs import append_completion, collate_prompts
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


def train(cfg: SFTConfig, resume: str | None = None) -> dict:
    """Run SFT; returns the last step's metrics."""
    out, resume_from = start_run(cfg, resume)
    model, processor, _ = setup_model(cfg, out, resume_from)
    dataset, sampler = setup_data(cfg)
    optimizer, scheduler = setup_optimizer(cfg, model)
    start_step = resume_state(resume_from, optimizer, scheduler, sampler)
    log = MetricsLog(out, start_step if resume_from is not None else None)
    row: dict = {}
    for step in (
        bar := tqdm(range(start_step, cfg.trainer.steps), initial=start_step, total=cfg.trainer.steps, desc="sft")
    ):
        timer = Timer()
        # DATA: prompts with their media, targets rendered from the rows
        with timer("data"):
            batch, labels = _batch(dataset, sampler.next_batch(cfg.data.prompts_per_step), processor, cfg, model.device)
        # UPDATE: cross-entropy on the target tokens
        with timer("update"):
            reset_rope_deltas(model)
            positions = text_positions(model, batch["attention_mask"])
            loss = model(**batch, labels=labels, **({"position_ids": positions} if positions is not None else {})).loss
            if not torch.isfinite(loss):
                raise OmniRLError(f"step {step + 1}: the SFT loss is {loss.item()}; lower optimizer.lr")
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            clip = cfg.trainer.max_grad_norm or float("inf")
            grad_norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], clip)
            optimizer.step()
            scheduler.step()
        # LOG / CHECKPOINT
        row = {
            "step": step + 1,
            "loss/sft": loss.item(),
            "optim/grad_norm": grad_norm.item(),
            "optim/lr": scheduler.get_last_lr()[0],
            "tokens/target": int((labels != -100).sum()),
            **timer.metrics(),
        }
        log.log(row)
        bar.set_postfix(loss=f"{row['loss/sft']:.3f}")
        # CHECKPOINT
        save_if_due(cfg, out, step + 1, model, processor, optimizer, scheduler, sampler)
    log.close()
    return row
