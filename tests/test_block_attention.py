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


def equal_to_dense_with_gradients(starts: list[int]) -> dict[str, torch.Tensor]:
    """GroupAttention on ``inputs()`` against ``dense_reference``: outputs and every
    input's gradient equal within 1e-5; returns the gradients by input name."""
    query, key, value, pk, pv = inputs()
    bias = own_bias(None, 2, query.shape[2], key.shape[2], query.dtype, query.device)
    got = GroupAttention.apply(query, key, value, bias, 0.2, 3, starts, pk, pv)
    want = dense_reference(query, key, value, pk, pv, starts, 3)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    weights = torch.randn_like(got)
    grads = torch.autograd.grad((got * weights).sum(), (query, key, value, pk, pv))
    wanted = torch.autograd.grad((want * weights).sum(), (query, key, value, pk, pv))
    names = ["query", "key", "value", "prompt key", "prompt value"]
    for name, g, w in zip(names, grads, wanted, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5, msg=name)
    return dict(zip(names, grads, strict=True))


@pytest.mark.parametrize("starts", [[0, 0], [2, 0], [0, 7]])
def test_group_attention_equals_dense_attention_with_gradients(starts):
    """Left padding (start 2), and an empty prompt (start = P) attended by nothing."""
    grads = equal_to_dense_with_gradients(starts)
    for name in ("prompt key", "prompt value"):
        assert not grads[name][0, :, : starts[0]].any()  # no gradient into padding


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
    and gradients equal, bit for bit, one call per prompt of the run in one thread. With
    more threads the CPU flash kernel's rounding depends on how it splits the work (on a
    2-core AMD EPYC one prompt's call already differs between 1 and 2 threads, by about
    6e-8), so there they agree to within that rounding."""
    from omni_rl.models.block_attention import _kernel, _kernel_backward, same_start

    assert same_start([0, 0, 0, 0], 7) == [(0, slice(0, 4))]
    assert same_start([3, 3, 5, 7, 5, 5], 7) == [(3, slice(0, 2)), (5, slice(2, 3)), (5, slice(4, 6))]
    g = torch.Generator().manual_seed(0)
    query, keys, values = (torch.randn(3, 2, n, 8, generator=g) for n in (6, 9, 9))
    grad = torch.randn(3, 2, 6, 8, generator=g)
    threads = torch.get_num_threads()
    try:
        for count, tolerance in ((1, 0.0), (threads, 1e-6)):
            torch.set_num_threads(count)
            out, lse, extra = _kernel(query, keys, values, None, 0.2)
            grads = _kernel_backward(grad, query, keys, values, None, out, lse, 0.2, extra)
            for b in range(3):
                one = slice(b, b + 1)
                out_b, lse_b, extra_b = _kernel(query[one], keys[one], values[one], None, 0.2)
                torch.testing.assert_close(out_b, out[one], rtol=0, atol=tolerance)
                torch.testing.assert_close(lse_b, lse[one], rtol=0, atol=tolerance)
                grads_b = _kernel_backward(
                    grad[one], query[one], keys[one], values[one], None, out_b, lse_b, 0.2, extra_b
                )
                for whole, alone in zip(grads, grads_b, strict=True):
                    torch.testing.assert_close(alone, whole[one], rtol=0, atol=tolerance)
    finally:
        torch.set_num_threads(threads)


class CudaKernelContract:
    """CPU stand-ins for the CUDA memory-efficient attention kernels that the CUDA path
    calls (``aten._scaled_dot_product_efficient_attention`` and its backward), holding
    the inputs to what the CUDA kernels assume without checking, then computing with
    the CPU kernels. Read from PyTorch's ``attention_backward.cu`` and the kernel's
    parameters: the backward kernel takes ``out``'s batch and head strides but not its
    row stride, which it takes to be heads * head_dim (``o_strideM``), so ``out`` must
    be laid out [B, M, h, D] as the forward kernel returns it; the log-sum-exps are
    padded to a multiple of 32 rows, fp32, rows contiguous; q, k, v and the bias have a
    contiguous last dimension, and the bias has the query's dtype and shape [B, h, M, K].
    A violation on a GPU reads past the tensor (an illegal memory access) or the wrong
    rows (non-finite gradients); here it fails the test."""

    def __init__(self):
        self.calls = {"forward": 0, "backward": 0}

    @staticmethod
    def _check_inputs(query, key, value, bias):
        for name, t in (("query", query), ("key", key), ("value", value)):
            assert t.stride(-1) == 1, f"{name}: last dimension not contiguous"
        if bias is not None:
            assert bias.dtype == query.dtype, "bias dtype differs from the query's"
            assert bias.stride(-1) == 1, "bias: last dimension not contiguous"
            assert tuple(bias.shape) == (*query.shape[:3], key.shape[2]), f"bias shape {tuple(bias.shape)}"

    def _scaled_dot_product_efficient_attention(self, query, key, value, bias, lse_wanted, dropout, causal, scale):
        self.calls["forward"] += 1
        self._check_inputs(query, key, value, bias)
        assert lse_wanted and dropout == 0.0 and not causal
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, 0.0, False, attn_mask=bias, scale=scale
        )
        rows = query.shape[2]
        padded = torch.nn.functional.pad(lse, (0, -rows % 32), value=float("nan"))  # never to be read
        as_cuda = out.transpose(1, 2).contiguous().transpose(1, 2)  # [B, M, h, D] in memory
        return as_cuda, padded, torch.zeros((), dtype=torch.int64), torch.zeros((), dtype=torch.int64)

    def _scaled_dot_product_efficient_attention_backward(
        self, grad, query, key, value, bias, out, lse, seed, offset, dropout, wanted, causal, scale
    ):
        self.calls["backward"] += 1
        self._check_inputs(query, key, value, bias)
        rows, heads, dim = query.shape[2], out.shape[1], out.shape[3]
        assert out.stride(-1) == 1 and out.stride(2) == heads * dim, (
            f"out strides {out.stride()}: the kernel reads row m at m * {heads * dim}"
        )
        assert lse.dtype == torch.float32 and lse.stride(-1) == 1 and lse.shape[-1] == rows + (-rows % 32)
        assert dropout == 0.0 and list(wanted) == [True, True, True, False] and not causal
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad, query, key, value, out, lse[..., :rows].contiguous(), 0.0, False, attn_mask=bias, scale=scale
        )
        return dq, dk, dv, None

    def __getattr__(self, name):  # the CPU kernels the stand-ins do not replace
        return getattr(torch.ops.aten, name)


@pytest.mark.parametrize("starts", [[0, 0], [2, 0], [0, 7]])
def test_the_cuda_path_holds_the_cuda_kernels_input_contract(starts, monkeypatch):
    """The CUDA path (its kernels replaced by ``CudaKernelContract``) equals dense
    attention with gradients; a layout the CUDA kernels do not read as meant fails."""
    from omni_rl.models import block_attention

    kernels = CudaKernelContract()
    monkeypatch.setattr(block_attention, "aten", kernels)
    monkeypatch.setattr(block_attention, "_on_cuda", lambda query: True)
    equal_to_dense_with_gradients(starts)
    calls = 1 + len(block_attention.same_start(starts, inputs()[3].shape[2]))
    assert kernels.calls == {"forward": calls, "backward": calls}
