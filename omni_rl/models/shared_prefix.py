"""Attention for G completions over one prompt whose keys and values are held once.

A group's G completions share their prompt. Repeating the prompt's KV cache G times
(``batch_repeat_interleave``) shares the compute but not the memory: at 20,000 video
tokens that is G copies of every layer's keys and values, in rollout and in the
gradient forward. Here the decoder's attention is an implementation registered with
transformers, ``omni_rl_sdpa``:

- without a ``shared_prefix`` argument it is plain SDPA, so generation, evaluation and
  SFT are untouched;
- with ``shared_prefix=RecordPrefix(store)`` (the prompt's forward) it is SDPA and it
  also keeps each layer's post-RoPE keys and values in ``store``;
- with ``shared_prefix=ReadPrefix(store)`` (the completions' forward, rows grouped G
  per prompt) each prompt's G completions are laid side by side as one query sequence
  that attends to the prompt's keys once, plus its own completion causally
  (a block-diagonal mask), in one SDPA call.

The roles are fixed objects handed to each forward, so gradient checkpointing, which
replays a layer's forward with the same arguments during backward, replays the same
role: a replayed prompt layer does not overwrite what it recorded, and a replayed
completion layer reads the same prompt keys. Gradients from every completion reach the
prompt's keys and values, and through them the media encoders, once.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from omni_rl.errors import OmniRLError

NAME = "omni_rl_sdpa"


class PrefixStore:
    """The prompts' keys and values, layer by layer, as their forward produced them.

    Attributes:
        key_mask: bool [B, P], which prompt positions are real tokens (not left padding).
        layers: layer index -> (keys, values), each [B, kv_heads, P, head_dim].

    Plain classes, not dataclasses: wrappers that rebuild a forward's arguments (FSDP2
    casting inputs to bf16) copy dataclasses field by field, which would record into a
    copy of the store.
    """

    def __init__(self, key_mask: torch.Tensor):
        self.key_mask = key_mask
        self.layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}


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


def group_mask(key_mask: torch.Tensor, tail_mask: torch.Tensor, group_size: int) -> torch.Tensor:
    """The bool mask [B, 1, G*T, P + G*K] of G completions side by side.

    Args:
        key_mask: bool [B, P], the prompts' real tokens.
        tail_mask: bool [B*G, T, K], what each completion query sees of its own keys.
    """
    batch, prompt = key_mask.shape
    _, queries, keys = tail_mask.shape
    n = group_size
    prefix = key_mask[:, None, None, :].expand(batch, 1, n * queries, prompt)
    same = torch.eye(n, dtype=torch.bool, device=tail_mask.device)
    blocks = tail_mask.view(batch, n, queries, 1, keys) & same[None, :, None, :, None]
    return torch.cat([prefix, blocks.reshape(batch, 1, n * queries, n * keys)], dim=-1)


def _tail_mask(attention_mask: torch.Tensor | None, rows: int, queries: int, keys: int, device) -> torch.Tensor:
    """bool [rows, T, K] from the mask transformers built for the completions alone
    (None means causal, the last ``queries`` of ``keys`` positions being the queries)."""
    if attention_mask is None:
        q = torch.arange(queries, device=device)[:, None] + (keys - queries)
        causal = q >= torch.arange(keys, device=device)[None, :]
        return causal.expand(rows, queries, keys)
    if attention_mask.dtype != torch.bool:  # an additive float mask
        attention_mask = attention_mask == 0
    return attention_mask[:, 0].expand(rows, queries, keys)


def grouped_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    store: PrefixStore,
    scaling: float | None,
) -> torch.Tensor:
    """Attention of G completions per prompt over the prompt's stored keys and their own.

    Args:
        query: [B*G, H, T, D]; key, value: [B*G, kv_heads, K, D], the completions' own.
    Returns:
        [B*G, T, H, D], as transformers' attention functions return it.
    """
    prefix_key, prefix_value = store.layers[module.layer_idx]
    batch = prefix_key.shape[0]
    rows, heads, queries, dim = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    n = rows // batch

    def side_by_side(t: torch.Tensor, length: int, width: int) -> torch.Tensor:
        return t.view(batch, n, width, length, dim).transpose(1, 2).reshape(batch, width, n * length, dim)

    groups = heads // kv_heads
    k = repeat_kv(torch.cat([prefix_key, side_by_side(key, keys, kv_heads)], dim=2), groups)
    v = repeat_kv(torch.cat([prefix_value, side_by_side(value, keys, kv_heads)], dim=2), groups)
    mask = group_mask(store.key_mask, _tail_mask(attention_mask, rows, queries, keys, query.device), n)
    out = torch.nn.functional.scaled_dot_product_attention(
        side_by_side(query, queries, heads), k, v, attn_mask=mask, scale=scaling
    )
    return out.view(batch, heads, n, queries, dim).permute(0, 2, 3, 1, 4).reshape(rows, queries, heads, dim)


def shared_prefix_attention(module, query, key, value, attention_mask, shared_prefix=None, **kwargs):
    """The registered attention function (see the module docstring)."""
    if isinstance(shared_prefix, ReadPrefix):
        return grouped_attention(
            module, query, key, value, attention_mask, shared_prefix.store, kwargs.get("scaling")
        ), None
    if isinstance(shared_prefix, RecordPrefix):
        shared_prefix.store.layers.setdefault(module.layer_idx, (key, value))
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register(NAME, shared_prefix_attention)
AttentionMaskInterface.register(NAME, sdpa_mask)


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
    config._attn_implementation = NAME
