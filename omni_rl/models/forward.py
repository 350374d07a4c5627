"""The gradient forward of G completions per prompt, with the prompt computed and held once.

A group's G sequences share their prompt: its media (thousands of video tokens) and
its text. Here the prompt minus its last token runs once per prompt through the
media encoders and the language model, with gradients, and each decoder layer keeps
its keys and values once (``omni_rl.models.shared_prefix``). The G completions then
run on top, attending to those keys without G copies of them. Backward sends every
completion's gradient through the shared prompt once. The log-probs equal those of
the full B*G sequences (a test checks every family), at a fraction of the compute and
activation memory when prompts are long. Gradient checkpointing keeps all of this:
the prompt still runs once per group.

Logits exist only where they are used: the prompt's forward projects no position onto
the vocabulary, and the completions' forward projects only completion tokens, a chunk
at a time, into log-probs (and entropies when asked). Under autograd each chunk is
recomputed in backward, so no [N, L, V] tensor is kept; the gradients are exact.

Positions follow generation's convention (attention-mask cumsum plus the multimodal
RoPE offsets of the prefill), so log-probs here match the sampler's.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from omni_rl.models.shared_prefix import (
    PrefixStore,
    PromptBackward,
    ReadPrefix,
    RecordPrefix,
    prompts_unmasked,
    read_apart,
)

# Tensors whose second dimension runs over the prompt's tokens.
TOKEN_ALIGNED = ("input_ids", "attention_mask", "mm_token_type_ids", "token_type_ids")
# fp32 logits of one chunk of completion tokens stay under this many bytes.
CHUNK_BYTES = 128 * 2**20

Entropy = Literal["off", "metric", "grad"]
# tied weights whose gradient the chunked head adds into ``.grad`` in place (``accumulate_in_place``)
_IN_PLACE: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()  # by id


@dataclass
class GroupOutput:
    """logp, entropy: [N, L] over completion tokens (entropy None when ``off``; zero at
    masked positions). log_kept: [N, L] (None without a ``SamplingFilter``), detached."""

    logp: torch.Tensor
    entropy: torch.Tensor | None
    log_kept: torch.Tensor | None = None
    prompt: PromptBackward | None = None
    """The prompt's backward, to run after the completions' (``group_forward(...,
    apart=True)``); None where the two run in one call."""


@dataclass(frozen=True)
class SamplingFilter:
    """What a rollout engine's sampling distribution removes beyond temperature: banned
    token ids, then top-k, then top-p (transformers' and vLLM's order and rules)."""

    banned: tuple[int, ...] = ()
    top_k: int = 0
    top_p: float = 1.0

    @property
    def trivial(self) -> bool:
        return not self.banned and self.top_k <= 0 and self.top_p >= 1.0


def log_kept_mass(logits: torch.Tensor, spec: SamplingFilter) -> torch.Tensor:
    """log of the probability mass that ``spec`` keeps, under softmax(logits): the
    sampled distribution's log-prob of a kept token is the full one minus this.
    logits: [M, V] fp32, temperature applied -> [M].

    top-k keeps every logit >= the k-th largest (ties kept); top-p removes, in
    ascending order, the tokens whose cumulative probability stays <= 1 - top_p,
    always keeping the most likely one.
    """
    log_z = torch.logsumexp(logits, dim=-1)
    if spec.top_k <= 0 and spec.top_p >= 1.0:  # bans alone: no [M, V] copy needed
        if not spec.banned:
            return torch.zeros_like(log_z)
        banned = torch.logsumexp(logits[:, list(spec.banned)], dim=-1) - log_z
        return torch.log1p(-torch.exp(banned))
    kept = logits.clone()
    if spec.banned:
        kept[:, list(spec.banned)] = -math.inf
    if spec.top_k > 0:
        kth = torch.topk(kept, min(spec.top_k, kept.shape[-1]), dim=-1).values[:, -1:]
        kept = kept.masked_fill(kept < kth, -math.inf)
    if spec.top_p < 1.0:
        ordered, order = torch.sort(kept, dim=-1)
        drop = ordered.softmax(-1).cumsum(-1) <= 1 - spec.top_p
        drop[:, -1] = False
        kept = kept.masked_fill(drop.scatter(-1, order, drop), -math.inf)
    return torch.logsumexp(kept, dim=-1) - log_z


@dataclass
class Prefix:
    """A prefilled batch of prompts: their stored keys and values, how many real tokens
    each has, and their multimodal RoPE offsets ([B, 1], or None)."""

    store: PrefixStore
    lengths: torch.Tensor
    deltas: torch.Tensor | None


def _rope_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if hasattr(m, "rope_deltas")]


def reset_rope_deltas(model: torch.nn.Module) -> None:
    """Forget RoPE offsets stored by an earlier forward, so the next prefill computes its own."""
    for module in _rope_modules(model):
        module.rope_deltas = None


def _rope_deltas(model: torch.nn.Module) -> torch.Tensor | None:
    for module in _rope_modules(model):
        if isinstance(module.rope_deltas, torch.Tensor):
            return module.rope_deltas
    return None


MEDIA_INPUTS = ("pixel_values", "pixel_values_videos", "input_features")
"""Processor outputs that carry media: a batch without any of them is text only."""


def text_positions(model: torch.nn.Module, attention_mask: torch.Tensor) -> torch.Tensor | None:
    """Explicit positions for models without multimodal RoPE (left padding not counted,
    as in generation); None lets multimodal-RoPE models compute their own."""
    if _rope_modules(model):
        return None
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def explicit_positions(model: torch.nn.Module, batch: dict) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(positions, multimodal RoPE offsets [B, 1]) to pass with ``batch``, or None for
    either that the model computes itself. Takes the per-prompt ``use_audio_in_video``
    flags out of ``batch``: prompts that hear their videos get positions computed one
    by one (``omni_rl.models.omni.prompt_positions``); models without multimodal RoPE
    get ``text_positions``; so does a text-only batch of a multimodal-RoPE model, on
    each of the three axes with offsets 0 (Qwen2-VL, Qwen2.5-VL and Qwen3-VL compute
    positions only when the batch has media, and otherwise count the left padding,
    which the completions' positions do not)."""
    heard = batch.pop("use_audio_in_video", None)
    if heard is not None and bool(heard.any()):
        from omni_rl.models.omni import prompt_positions

        return prompt_positions(_rope_modules(model)[0], batch, heard)
    mask = batch["attention_mask"]
    if not _rope_modules(model):
        return text_positions(model, mask), None
    if any(batch.get(key) is not None for key in MEDIA_INPUTS):
        return None, None
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
    return positions[None].expand(3, -1, -1), torch.zeros(mask.shape[0], 1, dtype=torch.long, device=mask.device)


def output_head(model: torch.nn.Module) -> torch.nn.Module:
    """The vocabulary projection (through DDP and LoRA wrappers)."""
    while isinstance(model, torch.nn.parallel.DistributedDataParallel):
        model = model.module
    return model.get_output_embeddings()


@contextmanager
def head_replaced(model: torch.nn.Module, forward: Callable[[torch.Tensor], torch.Tensor]) -> Iterator[None]:
    """Run the vocabulary projection as ``forward(hidden)`` inside the model's forward
    (where sharded weights are gathered), then restore it."""
    head = output_head(model)
    head.forward = forward
    try:
        yield
    finally:
        del head.forward


def _chunk_outputs(
    logits: torch.Tensor, ids: torch.Tensor, with_entropy: bool, kept: SamplingFilter | None
) -> torch.Tensor:
    """[M, 1 to 3]: log p(ids), then the entropy and the kept mass (``log_kept_mass``)
    where asked, from fp32 logits [M, V]."""
    log_z = torch.logsumexp(logits, dim=-1)
    columns = [logits.gather(-1, ids[:, None]).squeeze(-1) - log_z]
    if with_entropy:
        columns.append(log_z - (torch.softmax(logits, dim=-1) * logits).sum(-1))
    if kept is not None:
        columns.append(log_kept_mass(logits, kept))
    return torch.stack(columns, dim=-1)


def _logits(hidden, weight, bias, compute: torch.dtype, temperature: float) -> torch.Tensor:
    """fp32 logits [M, V] of hidden states [M, H], the matmul in ``compute`` dtype."""
    logits = F.linear(hidden.to(compute), weight, None if bias is None else bias.to(compute)).float()
    return logits / temperature if temperature != 1.0 else logits


class _ChunkedHead(torch.autograd.Function):
    """Log-probs (and entropies) of M positions under the vocabulary projection, a chunk
    of positions at a time. Backward recomputes each chunk's logits and writes its
    gradients analytically: the hidden states' into one [M, H] tensor, the weight's
    into one [V, H] buffer in place, so no [M, V] tensor outlives its chunk and no
    per-chunk weight gradient is allocated.

    The weight's (and bias's) gradient adds up in fp32 whatever the parameter's dtype
    and is cast once at the end: under FSDP2 bf16-mixed the gathered weight is bf16,
    and a bf16 buffer would round the running sum once per chunk (about 38 times per
    micro-batch at a 7B model's vocabulary), each rounding at bf16's 2^-9 relative to
    the whole sum so far. The fp32 buffer costs one transient [V, H] fp32 tensor.

    A tied weight marked by ``accumulate_in_place`` whose fp32 gradient exists already
    (a second micro-batch) has its chunks added into that gradient in place, and no
    buffer: the buffer and the gradient would be two full [V, H] fp32 tensors at once.

    d log p(y) / d logit = onehot(y) - p;  d entropy / d logit = -p * (logit - E_p[logit]).
    The kept-mass column, when asked for, is a diagnostic and gets no gradient.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, ids, temperature, with_entropy, kept, per_chunk):
        device = hidden.device.type
        compute = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype
        ctx.save_for_backward(hidden, weight, bias, ids)
        ctx.compute, ctx.temperature, ctx.per_chunk, ctx.with_entropy = compute, temperature, per_chunk, with_entropy
        w = weight.to(compute)
        parts = [
            _chunk_outputs(
                _logits(hidden[s : s + per_chunk], w, bias, compute, temperature),
                ids[s : s + per_chunk],
                with_entropy,
                kept,
            )
            for s in range(0, hidden.shape[0], per_chunk)
        ]
        width = 1 + with_entropy + (kept is not None)
        return torch.cat(parts) if parts else hidden.new_zeros(0, width, dtype=torch.float32)

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, bias, ids = ctx.saved_tensors
        compute, temperature, per_chunk = ctx.compute, ctx.temperature, ctx.per_chunk
        w = weight.to(compute)
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        fp32 = torch.float32  # the buffers' dtype (see the class docstring)
        into = _in_place_grad(weight) if ctx.needs_input_grad[1] else None
        grad_weight = into
        if grad_weight is None and ctx.needs_input_grad[1]:
            grad_weight = torch.zeros_like(weight, dtype=fp32)
        grad_bias = torch.zeros_like(bias, dtype=fp32) if bias is not None and ctx.needs_input_grad[2] else None
        for s in range(0, hidden.shape[0], per_chunk):
            h, g = hidden[s : s + per_chunk], grad_out[s : s + per_chunk].float()
            logits = _logits(h, w, bias, compute, temperature)
            p = torch.softmax(logits, dim=-1)
            grad = p * -g[:, :1]  # the same numbers as -p * g, without a [M, V] -p
            grad.scatter_add_(-1, ids[s : s + per_chunk, None], g[:, :1])
            if ctx.with_entropy:
                expected = (p * logits).sum(-1, keepdim=True)
                grad -= g[:, 1:2] * p * (logits - expected)
            grad /= temperature
            if grad_hidden is not None:
                grad_hidden[s : s + per_chunk] = (grad.to(compute) @ w).to(hidden.dtype)
            if grad_weight is not None:
                grad_weight.addmm_(grad.t(), h.float())
            if grad_bias is not None:
                grad_bias += grad.sum(0)
            # else the next chunk's [M, V] tensors are built while these are still named
            del logits, p, grad
        if into is not None:
            grad_weight = None  # added into the parameter's gradient already
        elif grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        if grad_bias is not None:
            grad_bias = grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None


def tied_head(model: torch.nn.Module) -> torch.nn.Embedding | None:
    """The input embedding where the output head shares its weight (a tied head, as
    Qwen2.5-VL 3B's and Qwen2-VL 2B's) and that weight trains; else None."""
    try:
        embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    except (AttributeError, NotImplementedError):  # not a language model (a flow policy's MLP)
        return None
    if not isinstance(embedding, torch.nn.Embedding) or head is None or embedding.weight is not head.weight:
        return None
    return embedding if embedding.weight.requires_grad else None


def accumulate_in_place(embedding: torch.nn.Embedding) -> None:
    """Give a tied weight (``tied_head``) one full gradient, never two: the chunked
    head adds its chunks into the weight's existing fp32 gradient in place (a second
    micro-batch; ``_ChunkedHead``), and the token lookup's gradient is sparse, its rows
    added in place into the head's or the existing gradient (autograd adds a sparse
    gradient into a dense one in place). Otherwise the head's [V, H] fp32 buffer stands
    beside the weight's gradient, and the lookup's dense [V, H] gradient beside the
    head's at the end of backward: 1.2 GB each at the 3B shape. A lookup gradient that
    lands alone (no head in that backward) is made dense as it lands, for the optimizer.

    For a model trained in one process only (the caller's to know): the head's part
    then reaches the gradient outside autograd's accumulation, which DDP's reducer
    watches, and under FSDP2 the prompt's backward call, after the completions' were
    reduce-scattered, would leave a sparse gradient that FSDP2 cannot reduce-scatter."""

    def densify(param: torch.Tensor) -> None:
        if param.grad is not None and param.grad.is_sparse:
            param.grad = param.grad.to_dense()

    weight = embedding.weight
    _IN_PLACE[id(weight)] = weight
    embedding.sparse = True
    weight.register_post_accumulate_grad_hook(densify)


def _in_place_grad(weight: torch.Tensor) -> torch.Tensor | None:
    """The gradient the chunked head may add ``weight``'s into in place, if any."""
    grad = weight.grad if _IN_PLACE.get(id(weight)) is weight else None
    if grad is None or grad.dtype != torch.float32 or grad.layout != torch.strided or not grad.is_contiguous():
        return None
    return grad


def completion_logprobs(
    hidden: torch.Tensor,
    head: torch.nn.Module,
    ids: torch.Tensor,
    mask: torch.Tensor,
    temperature: float = 1.0,
    entropy: Entropy = "off",
    kept: SamplingFilter | None = None,
) -> torch.Tensor:
    """Per-token log-probs (then entropies, then kept masses) at the masked-in
    positions, chunk by chunk.

    Args:
        hidden: [N, L, H] final hidden states; ids, mask: [N, L].
        kept: also compute ``log_kept_mass`` under this filter (detached).
    Returns:
        [N, L, 1 to 3], zero where ``mask`` is 0. Each chunk's logits are recomputed in
        backward rather than kept.
    """
    keep = mask.bool()
    per_chunk = max(1, CHUNK_BYTES // (4 * head.weight.shape[0]))
    values = _ChunkedHead.apply(
        hidden[keep], head.weight, head.bias, ids[keep], temperature, entropy != "off", kept, per_chunk
    )
    width = values.shape[-1]
    if entropy == "metric" or kept is not None:
        grad_columns = 2 if entropy == "grad" else 1
        values = torch.cat([values[:, :grad_columns], values[:, grad_columns:].detach()], dim=-1)
    out = values.new_zeros(*ids.shape, width)
    out[keep] = values
    return out


def prefill(model: torch.nn.Module, inputs: dict) -> Prefix:
    """The prompts without their last token, through the media encoders and the decoder,
    once each; every layer's keys and values are kept (with their graph, under autograd)
    and no position is projected onto the vocabulary.

    Models without multimodal RoPE get explicit positions from the attention mask, as
    generation uses them, so that left padding is not counted; multimodal-RoPE models
    compute theirs (and their offsets) from the mask themselves, except Omni prompts
    that hear their videos: those get positions computed prompt by prompt
    (``omni_rl.models.omni.prompt_positions``).
    """
    prefix = {k: (v[:, :-1] if k in TOKEN_ALIGNED else v) for k, v in inputs.items()}
    positions, deltas = explicit_positions(model, prefix)
    if positions is not None:
        prefix["position_ids"] = positions
    store = PrefixStore(prefix["attention_mask"].bool())
    reset_rope_deltas(model)
    with head_replaced(model, lambda hidden: hidden[:, :0]), prompts_unmasked():
        model(**prefix, use_cache=False, shared_prefix=RecordPrefix(store))
    return Prefix(store, inputs["attention_mask"].long().sum(-1), deltas if deltas is not None else _rope_deltas(model))


def training_dropout(model: torch.nn.Module) -> str | None:
    """Where a training-mode forward of ``model`` would drop activations at random (a
    dropout module or a config's dropout or layer-drop rate above 0), or None: without
    any, its forward in training mode computes what it computes in eval mode."""
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd) and module.p > 0:
            return f"{name} (p={module.p})"
        config = getattr(module, "config", None)
        if hasattr(config, "to_dict"):
            rate = _dropout_rate(config.to_dict())
            if rate is not None:
                return f"{type(config).__name__}.{rate}"
    return None


def _dropout_rate(settings: dict) -> str | None:
    """The first 'key=value' of a config dict (nested configs included) that drops at a
    rate above 0."""
    for key, value in settings.items():
        if isinstance(value, dict):
            found = _dropout_rate(value)
            if found is not None:
                return f"{key}.{found}"
        elif any(word in str(key) for word in ("dropout", "layerdrop")) and _positive(value):
            return f"{key}={value}"
    return None


def _positive(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def tail_positions(prefix: Prefix, tail_mask: torch.Tensor, n: int) -> torch.Tensor:
    """Positions of the completions' tokens (the prompt's last token first): the
    prompt's real-token count onwards, counting only real completion tokens, plus the
    prompt's multimodal RoPE offset ([3, N, T]) where the model has one ([N, T] else)."""
    offsets = torch.cumsum(tail_mask.long(), dim=-1) - tail_mask.long()[:, :1]
    positions = prefix.lengths.repeat_interleave(n)[:, None].to(offsets.device) - 1 + offsets
    if prefix.deltas is None:
        return positions
    deltas = prefix.deltas.repeat_interleave(n, dim=0).to(positions.device)
    return positions[None].expand(3, -1, -1) + deltas[None]


def group_forward(
    model: torch.nn.Module,
    inputs: dict,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    group_size: int,
    temperature: float = 1.0,
    entropy: Entropy = "off",
    kept: SamplingFilter | None = None,
    apart: bool = False,
    prefix: Prefix | None = None,
) -> GroupOutput:
    """Per-token log-probs of G completions for each of B prompts.

    Args:
        inputs: the B left-padded prompts (``input_ids`` [B, P] and their media tensors).
        completion_ids, completion_mask: [B*G, L], grouped prompt by prompt.
        temperature: logits are divided by it (as in sampling).
        entropy: ``off``; ``metric`` (detached, for logging); ``grad`` (differentiable,
            for an entropy bonus).
        kept: also return each position's ``log_kept_mass`` under this filter.
        apart: under autograd, the completions read the prompt's keys and values
            through leaves, and the result's ``prompt`` runs the prompt's backward after
            theirs (``shared_prefix.read_apart``: each layer's gradient is complete, and
            reduced, as the completions' backward passes it, not held to the end).
        prefix: these prompts' ``prefill`` made by ``model`` with its current weights,
            with its graph (a rollout's, ``HFRolloutEngine.keep_prefill``), read instead
            of running the prompts again; its graph is consumed by this forward's backward.
    Returns:
        log-probs [B*G, L] (and entropies, kept masses) of the completion tokens.
    """
    n = group_size
    if prefix is None:
        prefix = prefill(model, inputs)
    store, prompt = prefix.store, None
    if apart and torch.is_grad_enabled():
        store, prompt = read_apart(store)
    last = inputs["input_ids"][:, -1:].repeat_interleave(n, dim=0)
    tail = torch.cat([last, completion_ids[:, :-1]], dim=1)
    tail_mask = torch.cat([torch.ones_like(last), completion_mask[:, :-1].to(last.dtype)], dim=1)
    extra = {}
    if "mm_token_type_ids" in inputs:
        extra["mm_token_type_ids"] = torch.zeros_like(tail)
    head = output_head(model)
    with head_replaced(
        model,
        lambda hidden: completion_logprobs(hidden, head, completion_ids, completion_mask, temperature, entropy, kept),
    ):
        out = model(
            input_ids=tail,
            attention_mask=tail_mask,
            position_ids=tail_positions(prefix, tail_mask, n),
            use_cache=False,
            shared_prefix=ReadPrefix(store),
            **extra,
        ).logits
    log_kept = out[..., -1] if kept is not None else None
    if entropy == "off":
        return GroupOutput(out[..., 0], None, log_kept, prompt)
    return GroupOutput(out[..., 0], out[..., 1].detach() if entropy == "metric" else out[..., 1], log_kept, prompt)


def full_forward(
    model: torch.nn.Module,
    expanded: dict,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    temperature: float = 1.0,
) -> GroupOutput:
    """The naive way, as peer frameworks do it: every completion forwarded with its own
    copy of the prompt and media, logits kept over the completion tokens only. The
    reference the shared forward is tested and benchmarked against.

    Args:
        expanded: prompts already repeated G times each ([B*G, P] and their media).
        completion_ids, completion_mask: [B*G, L].
    """
    from omni_rl.models.inputs import append_completion

    reset_rope_deltas(model)
    batch, _ = append_completion(expanded, completion_ids, completion_mask)
    batch.pop("labels", None)
    positions, _ = explicit_positions(model, batch)
    if positions is not None:
        batch["position_ids"] = positions
    head, keep = output_head(model), completion_ids.shape[1] + 1
    with head_replaced(model, lambda hidden: F.linear(hidden[:, -keep:], head.weight, head.bias)):
        logits = model(**batch).logits[:, :-1]
    if temperature != 1.0:
        logits = logits / temperature
    logits = logits.float()
    logp = logits.gather(-1, completion_ids[..., None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    return GroupOutput(logp * completion_mask, None)
