"""The grouped attention's block merge against dense attention over the concatenated keys."""

import pytest
import torch
from transformers.integrations.sdpa_attention import repeat_kv

from omni_rl.models.block_attention import GroupAttention, fold_heads, own_bias, unfold_heads


def dense_reference(query, key, value, prompt_key, prompt_value, starts, group, causal_keys=None):
    """Attention of each row over [its prompt's real keys, its own keys], dense and with
    expanded heads: what GroupAttention must equal. ``causal_keys``: for one query per
    row, how many own keys each row sees (else causal, queries last)."""
    rows, heads, length, _ = query.shape
    kv = key.shape[1]
    outs = []
    for r in range(rows):
        b = r // group
        k = torch.cat([prompt_key[b, :, starts[b] :], key[r]], dim=1)[None]
        v = torch.cat([prompt_value[b, :, starts[b] :], value[r]], dim=1)[None]
        prompt = prompt_key.shape[2] - starts[b]
        own = key.shape[2]
        q_pos = torch.arange(length)[:, None] + own - length
        visible = torch.arange(own)[None, :] <= q_pos
        if causal_keys is not None:
            visible = torch.arange(own)[None, :] < causal_keys[r]
        mask = torch.cat([torch.ones(length, prompt, dtype=torch.bool), visible], dim=1)
        outs.append(
            torch.nn.functional.scaled_dot_product_attention(
                query[r : r + 1], repeat_kv(k, heads // kv), repeat_kv(v, heads // kv), attn_mask=mask, scale=0.2
            )
        )
    return torch.cat(outs)


def inputs(batch=2, group=3, heads=4, kv=2, length=5, prompt=7, dim=8, seed=0):
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float32, requires_grad=True)

    return (
        rand(batch * group, heads, length, dim),
        rand(batch * group, kv, length, dim),
        rand(batch * group, kv, length, dim),
        rand(batch, kv, prompt, dim),
        rand(batch, kv, prompt, dim),
    )


def test_fold_heads_is_undone_by_unfold_heads():
    x = torch.randn(6, 4, 5, 8)
    for n in (1, 3):
        folded = fold_heads(x, 2, n)
        assert folded.shape == (6 // n, 2, 2 * n * 5, 8)
        torch.testing.assert_close(unfold_heads(folded, 4, 5, n), x, rtol=0, atol=0)
    # head h of row r reads key head h // 2: folded row block (kv 0) holds heads 0 and 1
    torch.testing.assert_close(fold_heads(x, 2)[0, 0, 5:10], x[0, 1], rtol=0, atol=0)


@pytest.mark.parametrize("starts", [[0, 0], [2, 0], [0, 7]])
def test_group_attention_equals_dense_attention_with_gradients(starts):
    """Left padding (start 2), and an empty prompt (start = P) attended by nothing."""
    query, key, value, pk, pv = inputs()
    bias = own_bias(None, 2, query.shape[2], key.shape[2], query.dtype, query.device)
    got = GroupAttention.apply(query, key, value, bias, 0.2, 3, starts, pk, pv)
    want = dense_reference(query, key, value, pk, pv, starts, 3)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    weights = torch.randn_like(got)
    grads = torch.autograd.grad((got * weights).sum(), (query, key, value, pk, pv))
    wanted = torch.autograd.grad((want * weights).sum(), (query, key, value, pk, pv))
    for name, g, w in zip(["query", "key", "value", "prompt key", "prompt value"], grads, wanted, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5, msg=name)
        if name.startswith("prompt"):
            assert not g[0, :, : starts[0]].any()  # no gradient into padding


def test_a_decoding_step_reads_only_the_cache_slots_its_mask_allows():
    query, key, value, pk, pv = inputs(length=1)
    key, value = (torch.randn(6, 2, 4, 8) for _ in range(2))  # a 4-slot cache
    filled = torch.tensor([1, 2, 3, 4, 2, 1])
    mask = (torch.arange(4)[None, :] < filled[:, None])[:, None, None, :]
    bias = own_bias(mask, 2, 1, 4, query.dtype, query.device)
    with torch.no_grad():
        got = GroupAttention.apply(query, key, value, bias, 0.2, 3, [1, 0], pk, pv)
        want = dense_reference(query, key, value, pk, pv, [1, 0], 3, causal_keys=filled)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_bf16_inputs_give_bf16_outputs_close_to_fp32():
    query, key, value, pk, pv = inputs()
    bias = own_bias(None, 2, 5, 5, torch.bfloat16, query.device)
    with torch.no_grad():
        low_q, low_k, low_v, low_pk, low_pv = (t.bfloat16() for t in (query, key, value, pk, pv))
        low = GroupAttention.apply(low_q, low_k, low_v, bias, 0.2, 3, [0, 1], low_pk, low_pv)
        high = dense_reference(query, key, value, pk, pv, [0, 1], 3)
    assert low.dtype == torch.bfloat16
    torch.testing.assert_close(low.float(), high, atol=3e-2, rtol=3e-2)


def test_prompts_of_one_padding_share_one_call_whose_rows_equal_a_call_each():
    """Runs of consecutive prompts with the same first real key (an empty prompt, start
    at the length, in none), and the fused call over a run: its outputs, log-sum-exps
    and gradients equal, bit for bit, one call per prompt of the run."""
    from omni_rl.models.block_attention import _kernel, _kernel_backward, same_start

    assert same_start([0, 0, 0, 0], 7) == [(0, slice(0, 4))]
    assert same_start([3, 3, 5, 7, 5, 5], 7) == [(3, slice(0, 2)), (5, slice(2, 3)), (5, slice(4, 6))]
    g = torch.Generator().manual_seed(0)
    query, keys, values = (torch.randn(3, 2, n, 8, generator=g) for n in (6, 9, 9))
    out, lse, extra = _kernel(query, keys, values, None, 0.2)
    grad = torch.randn_like(out)
    grads = _kernel_backward(grad, query, keys, values, None, out, lse, 0.2, extra)
    for b in range(3):
        one = slice(b, b + 1)
        out_b, lse_b, extra_b = _kernel(query[one], keys[one], values[one], None, 0.2)
        torch.testing.assert_close(out_b, out[one], rtol=0, atol=0)
        torch.testing.assert_close(lse_b, lse[one], rtol=0, atol=0)
        grads_b = _kernel_backward(grad[one], query[one], keys[one], values[one], None, out_b, lse_b, 0.2, extra_b)
        for whole, alone in zip(grads, grads_b, strict=True):
            torch.testing.assert_close(alone, whole[one], rtol=0, atol=0)
