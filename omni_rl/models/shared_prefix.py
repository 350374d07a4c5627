"""Attention for G completions over one prompt whose keys and values are held once.

A group's G completions share their prompt. Repeating the prompt's KV cache G times
(``batch_repeat_interleave``) shares the compute but not the memory: at 20,000 video
tokens that is G copies of every layer's keys and values, in rollout and in the
gradient forward. Here the decoder's attention is an implementation registered with
transformers, ``omni_rl_sdpa``:

- without a ``shared_prefix`` argument it is plain SDPA, so generation, evaluation and
  SFT are untouched;
- with ``shared_prefix=RecordPrefix(store)`` (the prompt's forward) it keeps each
  layer's post-RoPE keys and values in ``store`` and runs SDPA prompt by prompt over
  the real tokens (views past the left padding, so no [B, 1, P, P] mask is built:
  ``prompts_unmasked``);
- with ``shared_prefix=ReadPrefix(store)`` (the completions' forward, rows grouped G
  per prompt) each prompt's G completions attend to the prompt's keys, read in place
  once for all G, and to their own keys causally: two fused attention calls merged by
  their log-sum-exps (``omni_rl.models.block_attention``), with no mask over the
  prompt and no copy of its keys.

The roles are fixed objects handed to each forward, so gradient checkpointing, which
replays a layer's forward with the same arguments during backward, replays the same
role: a replayed prompt layer does not overwrite what it recorded, and a replayed
completion layer reads the same prompt keys. Gradients from every completion reach the
prompt's keys and values, and through them the media encoders, once.

A layer sharded by FSDP2 gathers its weights again for a backward when the gradient
reaches the outputs of one of its forwards; the prompt's keys and values are not
outputs of its layer, and the last layer's prompt output gets no gradient at all. So a
layer whose weights are freed after forward and backward registers its gather here
(``gather_on_prompt_gradient``), and the recorded keys and values call it when their
gradient arrives (``gather_before_backward``; pi0's prefix cache does the same), before
the prompt pass's projections run backward.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from omni_rl.errors import OmniRLError
from omni_rl.models.block_attention import GroupAttention, own_bias

NAME = "omni_rl_sdpa"


class PrefixStore:
    """The prompts' keys and values, layer by layer, as their forward produced them.

    Attributes:
        key_mask: bool [B, P], which prompt positions are real tokens (left padding first).
        starts: each prompt's first real position (its keys are a view from there on).
        layers: layer index -> (keys, values), each [B, kv_heads, P, head_dim].

    Plain classes, not dataclasses: wrappers that rebuild a forward's arguments (FSDP2
    casting inputs to bf16) copy dataclasses field by field, which would record into a
    copy of the store.
    """

    def __init__(self, key_mask: torch.Tensor):
        self.key_mask = key_mask
        self.starts = left_padding(key_mask)
        self.layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}


def read_apart(store: PrefixStore) -> tuple[PrefixStore, PromptBackward]:
    """A store for the completions to read whose keys and values are leaves sharing the
    recorded ones' memory, and the prompt's backward from what those leaves collect.

    In one backward call the completions' weight gradients wait for the prompt's: both
    passes use every weight, so each weight's gradient accumulator waits for an edge
    from each, and autograd runs the prompt's nodes (created first) only after every
    completion node. At 20,000 prompt tokens that held the completion pass's gradients
    of every decoder layer at once (11 GB at 7B). Through the leaves the completions'
    backward accumulates (under FSDP2: reduce-scatters) each layer's gradient as it
    goes, and ``PromptBackward.run`` then runs the prompt's from the gradients the
    leaves collected: the same sums, in two calls."""
    read = copy.copy(store)
    read.layers = {
        i: (k.detach().requires_grad_(k.requires_grad), v.detach().requires_grad_(v.requires_grad))
        for i, (k, v) in store.layers.items()
    }
    pairs = [(rec, leaf) for i in store.layers for rec, leaf in zip(store.layers[i], read.layers[i], strict=True)]
    return read, PromptBackward([(rec, leaf) for rec, leaf in pairs if rec.requires_grad])


class PromptBackward:
    """The prompt's part of a group forward's graph, run by ``run`` after the completions'
    backward (``read_apart``)."""

    def __init__(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]):
        self.pairs = pairs
        """(recorded keys or values, the leaf the completions read in their place)."""

    def run(self) -> None:
        """Backward from the recorded keys and values with the gradients their leaves
        collected; the references are dropped after (a second call does nothing)."""
        fed = [(recorded, leaf.grad) for recorded, leaf in self.pairs if leaf.grad is not None]
        for _, leaf in self.pairs:
            leaf.grad = None
        self.pairs = []
        if fed:
            torch.autograd.backward([t for t, _ in fed], [g for _, g in fed])


def left_padding(key_mask: torch.Tensor) -> list[int]:
    """How many padding positions open each row of a left-padded bool mask [B, P]
    (one host read per prefill); a mask with holes elsewhere is refused."""
    lengths = key_mask.sum(-1)
    real = torch.arange(key_mask.shape[1], device=key_mask.device)[None, :] >= key_mask.shape[1] - lengths[:, None]
    if not torch.equal(real, key_mask):
        raise OmniRLError("the shared-prefix forward takes left-padded prompts; this attention mask has holes")
    return (key_mask.shape[1] - lengths).tolist()


class RecordPrefix:
    """The prompts' forward: SDPA, keeping each layer's keys and values."""

    __slots__ = ("store",)

    def __init__(self, store: PrefixStore):
        self.store = store


class ReadPrefix:
    """The completions' forward: rows are G completions per prompt, in prompt order."""

    __slots__ = ("store",)

    def __init__(self, store: PrefixStore):
        self.store = store


def grouped_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    store: PrefixStore,
    scaling: float | None,
) -> torch.Tensor:
    """Attention of G completions per prompt over the prompt's stored keys and their own
    (``omni_rl.models.block_attention``: no concatenation, head expansion or dense mask).

    Args:
        query: [B*G, H, T, D]; key, value: [B*G, kv_heads, K, D], the completions' own.
        attention_mask: what transformers built for the completions' own keys; only a
            decoding step's (one query per row: the cache's valid slots) is read, a
            longer block being causal over right-padded rows.
    Returns:
        [B*G, T, H, D], as transformers' attention functions return it.
    """
    prefix_key, prefix_value = store.layers[module.layer_idx]
    # Under autocast (bf16-mixed in one process or DDP) the rotary-embedded query and keys
    # come out fp32 and the values bf16; the fused kernels take one dtype, the one sdpa's
    # autocast casts its inputs to.
    device = query.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else query.dtype
    query, key, value, prefix_key, prefix_value = (t.to(dtype) for t in (query, key, value, prefix_key, prefix_value))
    rows, heads, queries, dim = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    group = rows // prefix_key.shape[0]
    scale = dim**-0.5 if scaling is None else scaling
    bias = own_bias(attention_mask, heads // kv_heads, queries, keys, query.dtype, query.device)
    out = GroupAttention.apply(query, key, value, bias, scale, group, store.starts, prefix_key, prefix_value)
    return out.transpose(1, 2)


def shared_prefix_attention(module, query, key, value, attention_mask, shared_prefix=None, **kwargs):
    """The registered attention function (see the module docstring)."""
    if isinstance(shared_prefix, ReadPrefix):
        return grouped_attention(
            module, query, key, value, attention_mask, shared_prefix.store, kwargs.get("scaling")
        ), None
    if isinstance(shared_prefix, RecordPrefix):
        store = shared_prefix.store
        if module.layer_idx not in store.layers:  # a replay under checkpointing keeps the first
            store.layers[module.layer_idx] = (key, value)
            gather_before_backward(module, key, value)
        return prompt_attention(module, query, key, value, store.starts, **kwargs), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


# attention module -> the gather of the sharded layer holding it (``gather_on_prompt_gradient``)
_GATHERS: weakref.WeakKeyDictionary[torch.nn.Module, weakref.WeakMethod] = weakref.WeakKeyDictionary()


def gather_on_prompt_gradient(attention: torch.nn.Module, gather: Callable[[], object]) -> None:
    """Call ``gather`` (a bound method: the FSDP2 layer's ``unshard``) when the gradient
    of the prompt keys and values ``attention`` records arrives in backward. Held
    weakly: a dropped model leaves nothing behind."""
    _GATHERS[attention] = weakref.WeakMethod(gather)


def gather_before_backward(module: torch.nn.Module, *recorded: torch.Tensor) -> None:
    """Hooks on keys and values ``module`` (an attention layer) produced for later
    forwards to read, which run its layer's gather (if one is registered) when their
    gradient arrives: a tensor's hook runs just before the node that produced it runs
    backward."""
    method = _GATHERS.get(module)
    if method is None:
        return

    def gather(grad: torch.Tensor) -> None:
        bound = method()
        if bound is not None:
            bound()

    for tensor in recorded:
        if tensor.requires_grad:
            tensor.register_hook(gather)


def prompt_attention(module, query, key, value, starts: list[int], **kwargs) -> torch.Tensor:
    """Causal attention of left-padded prompts, each over its own real tokens (views
    past its padding, so no [B, 1, P, P] mask): [B, P, H, D], zero at padding."""
    kwargs.pop("is_causal", None)
    if starts == [0]:  # one unpadded prompt: the keys as they are
        return sdpa_attention_forward(module, query, key, value, None, is_causal=True, **kwargs)[0]
    out = query.new_zeros(query.shape[0], query.shape[2], query.shape[1], query.shape[3])
    for b, start in enumerate(starts):
        one = slice(b, b + 1)
        out[one, start:] = sdpa_attention_forward(
            module, query[one, :, start:], key[one, :, start:], value[one, :, start:], None, is_causal=True, **kwargs
        )[0]
    return out


_PROMPTS_UNMASKED: ContextVar[bool] = ContextVar("omni_rl_prompts_unmasked", default=False)


@contextmanager
def prompts_unmasked() -> Iterator[None]:
    """Within: the decoder builds no attention mask (a prompt forward's attention reads
    each prompt's padding from its ``PrefixStore`` instead)."""
    token = _PROMPTS_UNMASKED.set(True)
    try:
        yield
    finally:
        _PROMPTS_UNMASKED.reset(token)


def decoder_mask(*args, **kwargs):
    """transformers' SDPA mask, except inside ``prompts_unmasked``."""
    return None if _PROMPTS_UNMASKED.get() else sdpa_mask(*args, **kwargs)


AttentionInterface.register(NAME, shared_prefix_attention)
AttentionMaskInterface.register(NAME, decoder_mask)


def decoder_config(model: torch.nn.Module):
    """The language model's config (the one its attention layers read)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.config.get_text_config(decoder=True)


def install(model: torch.nn.Module) -> None:
    """Give the model's language decoder the shared-prefix attention (plain SDPA unless a
    forward passes ``shared_prefix``); its encoders keep their own attention."""
    config = decoder_config(model)
    if config._attn_implementation not in ("sdpa", NAME):
        raise OmniRLError(
            f"the shared-prefix forward builds on SDPA attention; this model's decoder uses "
            f"{config._attn_implementation!r}"
        )
    kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
    if kinds != {"full_attention"}:
        raise OmniRLError(
            f"the shared-prefix forward attends to every earlier key; this model's decoder has "
            f"{', '.join(sorted(kinds - {'full_attention'}))} layers (a config's use_sliding_window: "
            f"set it false to train this checkpoint with full attention)"
        )
    config._attn_implementation = NAME
