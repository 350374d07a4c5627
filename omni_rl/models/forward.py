"""The gradient forward of G completions per prompt, with the prompt computed once.

A group's G sequences share their prompt: its media (thousands of video tokens) and
its text. Here the prompt minus its last token runs once per prompt through the
media encoders and the language model, with gradients; its KV cache is repeated G
times (a differentiable copy) and the G completions run on top. Backward sends every
completion's gradient through the shared prefix once. The logits equal those of the
full B*G sequences (a test checks every family), at a fraction of the compute and
activation memory when prompts are long.

Positions follow generation's convention (attention-mask cumsum plus the multimodal
RoPE offsets of the prefill), so log-probs here match the sampler's.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch

from omni_rl.algorithms.losses import entropy_from_logits, token_logprobs

# Tensors whose second dimension runs over the prompt's tokens.
TOKEN_ALIGNED = ("input_ids", "attention_mask", "mm_token_type_ids", "token_type_ids")


@dataclass
class GroupOutput:
    """logp, entropy: [N, L] over completion tokens (entropy None unless asked for)."""

    logp: torch.Tensor
    entropy: torch.Tensor | None


def _rope_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if hasattr(m, "rope_deltas")]


def _completion_outputs(logits, completion_ids, temperature, with_entropy, entropy_grad) -> GroupOutput:
    """Log-probs (and entropies) of completion tokens from their logits [N, L, V]."""
    if temperature != 1.0:
        logits = logits / temperature
    logp = token_logprobs(logits, completion_ids)
    entropy = None
    if with_entropy:
        with nullcontext() if entropy_grad else torch.no_grad():
            entropy = entropy_from_logits(logits)
    return GroupOutput(logp, entropy)


def reset_rope_deltas(model: torch.nn.Module) -> None:
    """Forget RoPE offsets stored by an earlier forward, so the next prefill computes its own."""
    for module in _rope_modules(model):
        module.rope_deltas = None


def repeat_rope_deltas(model: torch.nn.Module, batch: int, n: int) -> torch.Tensor | None:
    """Repeat the per-prompt multimodal RoPE offsets stored by a prefill to its n samples;
    returns them ([B*n, 1]) or None for models without them."""
    deltas = None
    for module in _rope_modules(model):
        value = module.rope_deltas
        if isinstance(value, torch.Tensor) and value.shape[0] == batch:
            module.rope_deltas = value.repeat_interleave(n, dim=0)
        if isinstance(module.rope_deltas, torch.Tensor):
            deltas = module.rope_deltas
    return deltas


def text_positions(model: torch.nn.Module, attention_mask: torch.Tensor) -> torch.Tensor | None:
    """Explicit positions for models without multimodal RoPE (left padding not counted,
    as in generation); None lets multimodal-RoPE models compute their own."""
    if _rope_modules(model):
        return None
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def prefix_inputs(model: torch.nn.Module, inputs: dict) -> dict:
    """The prompts without their last token, ready for a prefill forward.

    Models without multimodal RoPE get explicit positions from the attention mask, as
    generation uses them, so that left padding is not counted; multimodal-RoPE models
    compute theirs (and their offsets) from the mask themselves.
    """
    prefix = {k: (v[:, :-1] if k in TOKEN_ALIGNED else v) for k, v in inputs.items()}
    positions = text_positions(model, prefix["attention_mask"])
    if positions is not None:
        prefix["position_ids"] = positions
    return prefix


def group_forward(
    model: torch.nn.Module,
    inputs: dict,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    group_size: int,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = True,
) -> GroupOutput:
    """Per-token log-probs of G completions for each of B prompts.

    Args:
        inputs: the B left-padded prompts (``input_ids`` [B, P] and their media tensors).
        completion_ids, completion_mask: [B*G, L], grouped prompt by prompt.
        temperature: logits are divided by it (as in sampling).
        with_entropy: also return per-token entropies (entropy_grad: differentiable, for
            an entropy bonus; else a detached metric).
    Returns:
        log-probs [B*G, L] (and entropies) of the completion tokens.
    """
    batch = inputs["input_ids"].shape[0]
    n = group_size
    reset_rope_deltas(model)
    cache = model(**prefix_inputs(model, inputs), use_cache=True).cache
    cache.batch_repeat_interleave(n)
    deltas = repeat_rope_deltas(model, batch, n)

    last = inputs["input_ids"][:, -1:].repeat_interleave(n, dim=0)
    tail = torch.cat([last, completion_ids[:, :-1]], dim=1)
    prompt_mask = inputs["attention_mask"].repeat_interleave(n, dim=0)
    attention_mask = torch.cat([prompt_mask, completion_mask[:, :-1].to(prompt_mask.dtype)], dim=1)
    positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -tail.shape[1] :]
    if deltas is not None:
        positions = positions[None].expand(3, -1, -1) + deltas[None].to(positions.device)
    extra = {}
    if "mm_token_type_ids" in inputs:
        extra["mm_token_type_ids"] = torch.cat(
            [inputs["mm_token_type_ids"].repeat_interleave(n, dim=0), torch.zeros_like(tail[:, 1:])], dim=1
        )
    logits = model(
        input_ids=tail, attention_mask=attention_mask, cache=cache, position_ids=positions, use_cache=True, **extra
    ).logits
    return _completion_outputs(logits, completion_ids, temperature, with_entropy, entropy_grad)


def full_forward(
    model: torch.nn.Module,
    expanded: dict,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = True,
) -> GroupOutput:
    """The same log-probs from whole sequences, each prompt copied once per completion.

    Used under gradient checkpointing, which cannot keep a KV cache across the
    recomputation: memory is saved, and the prompt (media included) runs G times.

    Args:
        expanded: prompts already repeated G times each ([B*G, P] and their media).
        completion_ids, completion_mask: [B*G, L].
    """
    from omni_rl.models.inputs import append_completion

    reset_rope_deltas(model)
    batch, _ = append_completion(expanded, completion_ids, completion_mask)
    positions = text_positions(model, batch["attention_mask"])
    if positions is not None:
        batch["position_ids"] = positions
    prompt_length = expanded["input_ids"].shape[1]
    logits = model(**batch).logits[:, prompt_length - 1 : -1]
    return _completion_outputs(logits, completion_ids, temperature, with_entropy, entropy_grad)
