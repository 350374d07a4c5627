"""Attention of G completions over their prompt's keys held once, without dense masks
or expanded heads.

A group's G completions attend to two blocks of keys: the prompt's (shared by all G,
stored once per prompt) and their own (causal). Instead of concatenating the blocks
(a copy of the prompt's keys per layer call, per decoded token in rollout), expanding
them to every query head (``repeat_kv``: H / kv_heads copies) and masking the result
with a ``[G*T, P + G*T]`` bool tensor, each block is attended to on its own by a fused
kernel that also returns the rows' log-sum-exps, and the two outputs are merged
exactly:

    L = logaddexp(L_prompt, L_own),  out = exp(L_prompt - L) out_prompt + exp(L_own - L) out_own

Backward runs each block's fused backward with the merged output and log-sum-exp,
which gives that block's exact share of the gradient (the rule ring attention uses);
the queries' gradient is the sum of the shares.

- Grouped-query attention without copies: the query heads that share a key head are
  folded into the query length (``fold_heads``), so every kernel sees kv_heads heads.
- The prompt block needs no mask: each prompt's real keys are a view past its left
  padding, and its G completions' queries are laid end to end against it.
- The own block is causal. Completions are right-padded, so a real token's causal
  window holds only real tokens; in decoding (one query per row) the cache's own mask
  is used as it is (a ``[N, 1, 1, K]`` row, no larger).

The fused kernels are PyTorch's: the flash kernel on CPU, the memory-efficient kernel
on CUDA (it takes an additive bias and returns log-sum-exps, padded to 32 rows).
"""

from __future__ import annotations

import torch

aten = torch.ops.aten

# the CUDA memory-efficient kernel pads log-sum-exps to a multiple of this many rows
CUDA_LSE_ALIGN = 32


def _on_cuda(query: torch.Tensor) -> bool:
    """Whether the fused calls on ``query`` go to the CUDA memory-efficient kernels."""
    return query.device.type == "cuda"


def _kernel(query, key, value, bias, scale) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    """(out [B, h, M, D], lse [B, h, M] fp32, what backward needs) of one fused call."""
    if _on_cuda(query):
        out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(
            query, key, value, bias, True, 0.0, False, scale=scale
        )
        return out, lse[..., : query.shape[2]], (seed, offset)
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, 0.0, False, attn_mask=bias, scale=scale
    )
    return out, lse, ()


def _kernel_backward(grad, query, key, value, bias, out, lse, scale, extra) -> tuple[torch.Tensor, ...]:
    """(d query, d key, d value) of one fused call, given the merged out and lse."""
    if _on_cuda(query):
        rows = lse.shape[-1]
        padded = torch.nn.functional.pad(lse, (0, -rows % CUDA_LSE_ALIGN))
        seed, offset = extra
        dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
            grad,
            query,
            key,
            value,
            bias,
            _rows_heads_major(out),
            padded,
            seed,
            offset,
            0.0,
            [True, True, True, False],
            False,
            scale=scale,
        )
        return dq, dk, dv
    return aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad, query, key, value, out, lse, 0.0, False, attn_mask=bias, scale=scale
    )


def _rows_heads_major(out: torch.Tensor) -> torch.Tensor:
    """``out`` [B, h, M, D] laid out [B, M, h, D] in memory, as the CUDA kernel returns
    it: its backward takes ``out``'s batch and head strides but reads row m at m * h * D
    whatever the tensor's own row stride (the merged output here is [B, h, M, D]
    contiguous, so it would read past the tensor)."""
    return out.transpose(1, 2).contiguous().transpose(1, 2)


def fold_heads(x: torch.Tensor, kv_heads: int, rows_per_block: int = 1) -> torch.Tensor:
    """[R, H, T, ...] -> [R / n, kv_heads, (H / kv_heads) * n * T, ...] with n =
    ``rows_per_block``: the query heads sharing a key head (``repeat_kv``'s order,
    head h reads key head h // groups), and n consecutive rows, laid along the length."""
    rows, heads, length = x.shape[:3]
    tail = x.shape[3:]
    groups, n = heads // kv_heads, rows_per_block
    x = x.reshape(rows // n, n, kv_heads, groups, length, *tail).transpose(1, 2).transpose(2, 3)
    return x.reshape(rows // n, kv_heads, groups * n * length, *tail)


def unfold_heads(x: torch.Tensor, heads: int, length: int, rows_per_block: int = 1) -> torch.Tensor:
    """The inverse of ``fold_heads``: [R / n, kv_heads, groups * n * T, ...] -> [R, H, T, ...]."""
    blocks, kv_heads = x.shape[:2]
    tail = x.shape[3:]
    groups, n = heads // kv_heads, rows_per_block
    x = x.reshape(blocks, kv_heads, groups, n, length, *tail).transpose(2, 3).transpose(1, 2)
    return x.reshape(blocks * n, heads, length, *tail)


def causal_bias(groups: int, queries: int, keys: int, dtype, device) -> torch.Tensor:
    """Additive bias [1, 1, groups * T, K] of causal attention in ``fold_heads``' layout
    (row i is query i mod T, the queries being the last T of the K keys)."""
    query = torch.arange(queries, device=device).repeat(groups)[:, None] + (keys - queries)
    hidden = query < torch.arange(keys, device=device)[None, :]
    return torch.zeros(hidden.shape, dtype=dtype, device=device).masked_fill_(hidden, float("-inf"))[None, None]


def own_bias(attention_mask: torch.Tensor | None, groups: int, queries: int, keys: int, dtype, device):
    """The own block's additive bias in ``fold_heads``' layout, or None for none."""
    if queries == 1:  # decoding: the cache's own mask row, shared by the folded heads
        if attention_mask is None:
            return None
        if attention_mask.dtype == torch.bool:
            return torch.zeros(attention_mask.shape, dtype=dtype, device=device).masked_fill_(
                ~attention_mask, float("-inf")
            )
        return attention_mask.to(dtype)
    return causal_bias(groups, queries, keys, dtype, device)


def _cuda_aligned(bias: torch.Tensor | None, query: torch.Tensor, heads: int) -> torch.Tensor | None:
    """The bias as the CUDA kernel takes it: [B, h, M, K] (broadcast views) over a last
    dimension padded to a multiple of 16 elements."""
    if bias is None or not _on_cuda(query):
        return bias
    keys = bias.shape[-1]
    padded = torch.nn.functional.pad(bias, (0, -keys % 16))[..., :keys]
    return padded.expand(query.shape[0], heads, query.shape[2], keys)


def same_start(starts: list[int], length: int) -> list[tuple[int, slice]]:
    """Runs of consecutive prompts that share their first real key (prompts of one
    length share their left padding), each run attended to in one fused call, its keys
    a view: (start, the run's prompts). Empty prompts (start at ``length``) attend to
    nothing and are left out."""
    runs: list[tuple[int, slice]] = []
    for b, start in enumerate(starts):
        if start >= length:
            continue
        if runs and runs[-1][0] == start and runs[-1][1].stop == b:
            runs[-1] = (start, slice(runs[-1][1].start, b + 1))
        else:
            runs.append((start, slice(b, b + 1)))
    return runs


class GroupAttention(torch.autograd.Function):
    """Attention of rows grouped G per prompt over the prompt's keys and their own.

    forward(query [N, H, T, D], key, value [N, kv, K, D] (the rows' own), bias (the own
    block's, ``own_bias``), scale, group_size, starts (each prompt's first real key),
    prompt_key, prompt_value [B, kv, P, D]) -> [N, H, T, D].
    """

    @staticmethod
    def forward(ctx, query, key, value, bias, scale, group_size, starts, prompt_key, prompt_value):
        heads, length = query.shape[1:3]
        kv_heads, n = key.shape[1], group_size
        own_q = fold_heads(query, kv_heads)
        own_bias_ = _cuda_aligned(bias, own_q, kv_heads)
        out_own, lse_own, extra_own = _kernel(own_q, key, value, own_bias_, scale)
        out = unfold_heads(out_own, heads, length).float()
        lse = unfold_heads(lse_own, heads, length)
        prompt_q = fold_heads(query, kv_heads, n)
        calls = same_start(starts, prompt_key.shape[2])
        outs, lses = [], []
        for i, (start, prompts) in enumerate(calls):
            o, lse_b, extra = _kernel(
                prompt_q[prompts], prompt_key[prompts, :, start:], prompt_value[prompts, :, start:], None, scale
            )
            calls[i] = (start, prompts, extra)
            outs.append(o)
            lses.append(lse_b)
        if sum(prompts.stop - prompts.start for _, prompts, _ in calls) == len(starts):
            # the runs cover every prompt in order: their outputs laid end to end, unfolded once
            prompt_out = unfold_heads(torch.cat(outs) if len(outs) > 1 else outs[0], heads, length, n).float()
            prompt_lse = unfold_heads(torch.cat(lses) if len(lses) > 1 else lses[0], heads, length, n)
        else:  # an empty prompt has no call: its rows attend to their own keys only
            prompt_lse = torch.full_like(lse, float("-inf"))
            prompt_out = torch.zeros_like(out)
            for (_, prompts, _), o, lse_b in zip(calls, outs, lses, strict=True):
                rows = slice(prompts.start * n, prompts.stop * n)  # their G completions each
                prompt_out[rows] = unfold_heads(o, heads, length, n).float()
                prompt_lse[rows] = unfold_heads(lse_b, heads, length, n)
        merged = torch.logaddexp(lse, prompt_lse)
        out = (out * (lse - merged).exp()[..., None] + prompt_out * (prompt_lse - merged).exp()[..., None]).to(
            query.dtype
        )
        ctx.save_for_backward(query, key, value, own_bias_, prompt_key, prompt_value, out, merged)
        ctx.scale, ctx.n, ctx.extra_own, ctx.calls = scale, n, extra_own, calls
        return out

    @staticmethod
    def backward(ctx, grad):
        query, key, value, bias, prompt_key, prompt_value, out, merged = ctx.saved_tensors
        heads, length = query.shape[1:3]
        kv_heads, n, scale = key.shape[1], ctx.n, ctx.scale
        grad = grad.contiguous()
        dq, dk, dv = _kernel_backward(
            fold_heads(grad, kv_heads),
            fold_heads(query, kv_heads),
            key,
            value,
            bias,
            fold_heads(out, kv_heads),
            fold_heads(merged, kv_heads),
            scale,
            ctx.extra_own,
        )
        grad_query = unfold_heads(dq, heads, length)
        grad_pk, grad_pv = torch.zeros_like(prompt_key), torch.zeros_like(prompt_value)
        folded = [fold_heads(t, kv_heads, n) for t in (grad, query, out, merged)]
        for start, prompts, extra in ctx.calls:
            g, q, o, lse = (t[prompts] for t in folded)
            keys, values = prompt_key[prompts, :, start:], prompt_value[prompts, :, start:]
            dq_b, dk_b, dv_b = _kernel_backward(g, q, keys, values, None, o, lse, scale, extra)
            grad_query[prompts.start * n : prompts.stop * n] += unfold_heads(dq_b, heads, length, n)
            grad_pk[prompts, :, start:] = dk_b
            grad_pv[prompts, :, start:] = dv_b
        return grad_query, dk, dv, None, None, None, None, grad_pk, grad_pv
