"""The shared-prefix group forward equals the full B*G forward, in values and gradients."""

from __future__ import annotations

import pytest
import torch

from omni_rl.algorithms.losses import entropy_from_logits, token_logprobs
from omni_rl.models import FAMILIES, forward, load, shared_prefix
from omni_rl.models.forward import TOKEN_ALIGNED, group_forward, reset_rope_deltas
from omni_rl.models.inputs import append_completion

MEDIA_BY_GRID = {"pixel_values": "image_grid_thw", "pixel_values_videos": "video_grid_thw"}
PER_PROMPT = ("second_per_grid_ts", "video_second_per_grid", "input_features", "feature_attention_mask")


def repeat_everything(inputs: dict, n: int) -> dict:
    """The naive layout: every prompt and its media copied n times."""
    out = {k: v.repeat_interleave(n, dim=0) for k, v in inputs.items() if k in TOKEN_ALIGNED or k in PER_PROMPT}
    for key, grid in MEDIA_BY_GRID.items():
        if key in inputs:
            chunks = torch.split(inputs[key], inputs[grid].prod(-1).tolist())
            out[key] = torch.cat([c for c in chunks for _ in range(n)])
            out[grid] = inputs[grid].repeat_interleave(n, dim=0)
    return out


def full_logp(model, inputs, completion_ids, completion_mask, n):
    batch, _ = append_completion(repeat_everything(inputs, n), completion_ids, completion_mask)
    if not any(hasattr(m, "rope_deltas") for m in model.modules()):
        # generation's positions: attention-mask cumsum (left padding not counted)
        batch["position_ids"] = (batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    reset_rope_deltas(model)
    logits = model(**batch).logits[:, inputs["input_ids"].shape[1] - 1 : -1]
    return token_logprobs(logits, completion_ids)


def completions(n_rows: int, length: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (n_rows, length), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, 3:] = 0  # a completion that stopped early
    mask[-1, 1:] = 0  # and one that stopped at once
    return ids, mask


def in_setting(family: str, setting: str, tiny_checkpoint, family_prompts):
    """The family's tiny model in ``setting`` (eval or train mode, with or without
    gradient checkpointing), two prompts and their G = 2 completions each: (model,
    inputs, completion ids, their mask, G)."""
    model, processor = load(tiny_checkpoint(family))
    if "checkpointing" in setting:
        model.gradient_checkpointing_enable({"use_reentrant": False})
    model.train(setting != "eval")
    ids, mask = completions(4, 5, seed=1)
    return model, family_prompts(family, processor), ids, mask, 2


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_group_forward_equals_full_forward(family, tiny_checkpoint, family_prompts):
    model, processor = load(tiny_checkpoint(family))
    inputs = family_prompts(family, processor)
    n = 3
    ids, mask = completions(2 * n, 6)
    with torch.no_grad():
        shared = group_forward(model, inputs, ids, mask, n, entropy="metric")
        reference = full_logp(model, inputs, ids, mask, n)
    torch.testing.assert_close(shared.logp * mask, reference * mask, atol=1e-5, rtol=1e-5)
    assert shared.entropy.shape == ids.shape and (shared.entropy >= 0).all()


@pytest.mark.parametrize(
    "setting", ["eval", "train", "train+checkpointing", "train+apart", "train+checkpointing+apart"]
)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_group_forward_gradients_equal_full_forward(family, setting, tiny_checkpoint, family_prompts):
    """The same gradient in every parameter as the full B*G forward, for every family,
    in eval and train mode, and with non-reentrant gradient checkpointing (which keeps
    the shared prompt: it runs once per group either way); ``apart``: the prompt's
    backward run after the completions' (``group_forward(..., apart=True)``)."""
    model, inputs, ids, mask, n = in_setting(family, setting, tiny_checkpoint, family_prompts)

    def grads(fn):
        model.zero_grad(set_to_none=True)
        (fn() * mask).sum().backward()
        return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    def shared_grads():
        model.zero_grad(set_to_none=True)
        out = group_forward(model, inputs, ids, mask, n, entropy="grad", apart="apart" in setting)
        assert (out.prompt is not None) == ("apart" in setting)
        (out.logp * mask).sum().backward()
        if out.prompt is not None:  # the prompt's backward, after the completions'
            out.prompt.run()
        return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    shared = shared_grads()
    reference = grads(lambda: full_logp(model, inputs, ids, mask, n))
    assert shared.keys() == reference.keys()
    encoders = [name for name in shared if "visual" in name or "audio" in name]
    assert encoders and all(shared[name].abs().sum() > 0 for name in encoders)  # media encoders reached
    for name in shared:
        torch.testing.assert_close(shared[name], reference[name], atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.parametrize("setting", ["eval", "train", "train+checkpointing"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_group_forward_under_bf16_autocast_matches_the_full_forward(family, setting, tiny_checkpoint, family_prompts):
    """bf16-mixed in one process (or DDP) autocasts fp32 weights to bf16: there the
    rotary-embedded queries and keys come out fp32 and the values bf16, and the grouped
    attention's fused kernels take one dtype (sdpa's autocast casts them to bf16). Its
    log-probs and gradients stay those of the full forward under the same autocast, to
    bf16's precision: log-probs within 0.05 (bf16 keeps 8 bits, 0.4% a rounding, on
    log-probs near -5.5; 0.0014 at most measured), the whole gradient within 5% of its
    norm (0.5% at most), and each tensor's within 10% of its own norm (5% at most
    measured, on layer norms) or 1% of the whole's (0.3%): a tensor whose true gradient is
    about 0, such as a key bias, is rounding alone."""
    model, inputs, ids, mask, n = in_setting(family, setting, tiny_checkpoint, family_prompts)

    def run(fn):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logp = fn()
        (logp.float() * mask).sum().backward()
        return logp.detach().float(), {
            name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None
        }

    shared_logp, shared = run(lambda: group_forward(model, inputs, ids, mask, n).logp)
    full_logp_, reference = run(lambda: full_logp(model, inputs, ids, mask, n))
    torch.testing.assert_close(shared_logp * mask, full_logp_ * mask, atol=0.05, rtol=0)
    assert shared.keys() == reference.keys()
    size = sum(float(g.square().sum()) for g in reference.values()) ** 0.5
    apart = {k: float((shared[k] - reference[k]).norm()) for k in shared}
    assert sum(d * d for d in apart.values()) ** 0.5 <= 0.05 * size
    for k, d in apart.items():  # each tensor: within 10% of its own gradient, or 1% of the whole
        assert d <= max(0.1 * float(reference[k].norm()), 0.01 * size), k


@pytest.mark.parametrize("checkpointing", [False, True])
def test_apart_the_completions_weight_gradients_are_complete_before_the_prompts_backward(
    checkpointing, tiny_checkpoint, family_prompts, monkeypatch
):
    """Why ``apart`` exists: in one backward call the completions' weight gradients wait
    for the prompt's (the first decoder layer has no gradient when the prompt's backward
    begins); apart, the completions' call leaves every decoder weight with its gradient
    and the media encoder none, and the prompt's call adds the rest."""
    model, processor = load(tiny_checkpoint("qwen2_5_vl"))
    if checkpointing:
        model.gradient_checkpointing_enable({"use_reentrant": False})
    model.train()
    inputs = family_prompts("qwen2_5_vl", processor)
    ids, mask = completions(4, 5, seed=1)
    first = [p for name, p in model.named_parameters() if "language_model.layers.0." in name]
    decoder = [p for name, p in model.named_parameters() if "language_model.layers." in name]
    encoder = [p for name, p in model.named_parameters() if "visual" in name]
    assert first and encoder
    real_prefill, seen = forward.prefill, []

    def watched_prefill(model, inputs):  # notes what the first layer holds when the prompt's backward begins
        prefix = real_prefill(model, inputs)
        last_keys = prefix.store.layers[max(prefix.store.layers)][0]
        last_keys.register_hook(lambda grad: seen.append([p.grad is not None for p in first]))
        return prefix

    monkeypatch.setattr(forward, "prefill", watched_prefill)
    (group_forward(model, inputs, ids, mask, 2).logp * mask).sum().backward()
    assert seen == [[False] * len(first)]  # one call: held until the prompt's part
    model.zero_grad(set_to_none=True)
    seen.clear()
    out = group_forward(model, inputs, ids, mask, 2, apart=True)
    (out.logp * mask).sum().backward()
    assert not seen and all(p.grad is not None for p in decoder) and all(p.grad is None for p in encoder)
    out.prompt.run()
    assert seen == [[True] * len(first)] and all(p.grad is not None for p in encoder)
    assert not out.prompt.pairs  # the prompt's backward ran once and let its tensors go


@pytest.mark.parametrize("apart", [False, True])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_rollouts_kept_prefill_gives_the_update_its_own_numbers(
    family, apart, tiny_checkpoint, family_prompts, monkeypatch
):
    """``rollout.reuse_prefill``: the update's forward reading the prefill the rollout
    made (eval mode, under autograd) instead of running its own gives the log-probs and
    every gradient of the forward that runs its own in training mode, bit for bit, with
    or without ``apart``; and keeping it changes nothing the rollout samples."""
    from omni_rl.rollout.hf import HFRolloutEngine, SamplingParams

    real_prefill, prefills = forward.prefill, []
    monkeypatch.setattr(forward, "prefill", lambda *args: prefills.append(1) or real_prefill(*args))
    model, processor = load(tiny_checkpoint(family))
    inputs = family_prompts(family, processor)
    ids, mask = completions(4, 5, seed=1)
    engine, sampling = HFRolloutEngine(model, processor), SamplingParams(max_new_tokens=4)

    def update(prefix):
        model.train()
        model.zero_grad(set_to_none=True)
        out = group_forward(model, inputs, ids, mask, 2, entropy="grad", apart=apart, prefix=prefix)
        ((out.logp + 0.1 * out.entropy) * mask).sum().backward()
        if out.prompt is not None:
            out.prompt.run()
        return out.logp.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    plain = engine.generate(inputs, 2, sampling, seeds=[3, 4])
    kept = engine.generate(inputs, 2, sampling, seeds=[3, 4], keep_prefill=True)
    assert plain.prefill is None and kept.prefill is not None
    assert torch.equal(plain.completion_ids, kept.completion_ids) and torch.equal(plain.logprobs, kept.logprobs)
    own_logp, own_grads = update(None)
    assert len(prefills) == 1
    read_logp, read_grads = update(kept.prefill)
    assert len(prefills) == 1  # read, not run again
    assert torch.equal(read_logp, own_logp)
    assert read_grads.keys() == own_grads.keys() and any("visual" in n or "audio" in n for n in own_grads)
    assert all(torch.equal(read_grads[name], own_grads[name]) for name in own_grads)


def test_training_dropout_finds_a_config_rate_or_a_module(tiny_checkpoint):
    model, _ = load(tiny_checkpoint("qwen2_5_vl"))
    assert forward.training_dropout(model) is None
    model.config.text_config.attention_dropout = 0.1
    assert forward.training_dropout(model).endswith("text_config.attention_dropout=0.1")
    model.config.text_config.attention_dropout = 0.0
    model.model.visual.blocks[0].mlp.add_module("drop", torch.nn.Dropout(0.2))
    assert forward.training_dropout(model) == "model.visual.blocks.0.mlp.drop (p=0.2)"


@pytest.mark.parametrize(
    "fault",
    [
        "a completion token sees the next one",  # one position of the own block's causal bias flipped
        "a prompt's padding key is read",  # one left-padded prompt starts a key early
    ],
)
def test_the_parity_check_finds_one_wrong_attention_position(fault, tiny_checkpoint, family_prompts, monkeypatch):
    """The log-prob and gradient comparisons above fail when the block attention is
    wrong in a single position: what they guard against is within their reach."""
    from omni_rl.models import block_attention

    if fault.startswith("a completion"):
        real_bias = block_attention.causal_bias

        def leaky(groups, queries, keys, dtype, device):
            bias = real_bias(groups, queries, keys, dtype, device).clone()
            bias[..., 1, 2] = 0.0  # query 1 attends to key 2, its successor
            return bias

        monkeypatch.setattr(block_attention, "causal_bias", leaky)
    else:
        real_padding = shared_prefix.left_padding

        def early(key_mask):
            starts = real_padding(key_mask)
            padded = max(range(len(starts)), key=starts.__getitem__)
            starts[padded] -= 1
            return starts

        monkeypatch.setattr(shared_prefix, "left_padding", early)
    model, processor = load(tiny_checkpoint("qwen2_5_vl"))
    inputs = family_prompts("qwen2_5_vl", processor)
    ids, mask = completions(4, 5, seed=1)
    with torch.no_grad():
        shared = group_forward(model, inputs, ids, mask, 2).logp
        reference = full_logp(model, inputs, ids, mask, 2)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(shared * mask, reference * mask, atol=1e-5, rtol=1e-5)


TEXT_ONLY = ["Hi.", "Which fruit is red? A. apple B. lime", "Name a colour you like, in one word, then stop."]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_text_only_prompts_score_and_decode_as_each_alone(family, tiny_checkpoint):
    """Three prompts without media, of different lengths (left-padded): the group
    forward's log-probs and gradients, and the rollout's greedy tokens, equal each
    prompt's own forward and transformers' generate on it alone, unpadded. (Qwen2-VL,
    Qwen2.5-VL and Qwen3-VL compute their positions only for a batch with media; left
    to themselves, they count a text-only batch's left padding.)"""
    from omni_rl.models.inputs import encode_prompts
    from omni_rl.rollout.hf import HFRolloutEngine, SamplingParams

    model, processor = load(tiny_checkpoint(family))
    model.train()
    conversations = [[{"role": "user", "content": [{"type": "text", "text": t}]}] for t in TEXT_ONLY]
    inputs = encode_prompts(processor, conversations)
    assert len(set((inputs["attention_mask"] == 0).sum(-1).tolist())) == 3  # three paddings
    n = 2
    ids, mask = completions(len(TEXT_ONLY) * n, 5, seed=2)

    def grads(loss):
        model.zero_grad(set_to_none=True)
        loss.backward()
        return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    shared_logp = group_forward(model, inputs, ids, mask, n).logp
    shared = grads((shared_logp * mask).sum())
    alone_logp, total = [], 0
    for p, conversation in enumerate(conversations):
        alone = encode_prompts(processor, [conversation])
        rows = slice(p * n, (p + 1) * n)
        batch, _ = append_completion(repeat_everything(alone, n), ids[rows], mask[rows])
        reset_rope_deltas(model)
        logits = model(**batch).logits[:, alone["input_ids"].shape[1] - 1 : -1]
        logp = token_logprobs(logits, ids[rows])
        alone_logp.append(logp.detach())
        total = total + (logp * mask[rows]).sum()
    reference = grads(total)
    torch.testing.assert_close(shared_logp.detach() * mask, torch.cat(alone_logp) * mask, atol=1e-5, rtol=1e-5)
    for name in shared:
        torch.testing.assert_close(shared[name], reference[name], atol=1e-5, rtol=1e-5, msg=name)

    model.eval()
    engine = HFRolloutEngine(model, processor)
    rollouts = engine.generate(inputs, n=1, sampling=SamplingParams(temperature=0.0, max_new_tokens=8))
    for p, conversation in enumerate(conversations):
        alone = encode_prompts(processor, [conversation])
        with torch.no_grad():
            want = model.generate(
                **alone,
                do_sample=False,
                max_new_tokens=8,
                suppress_tokens=engine.banned,
                eos_token_id=engine.stop_ids,
                pad_token_id=engine.pad_id,
            )[0, alone["input_ids"].shape[1] :]
        length = int(rollouts.lengths[p])
        assert rollouts.completion_ids[p, :length].tolist() == want[:length].tolist(), (family, p)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_group_forward_runs_the_vision_tower_once_per_batch(checkpointing, tiny_checkpoint, family_prompts):
    model, processor = load(tiny_checkpoint("qwen2_5_vl"))
    if checkpointing:
        model.gradient_checkpointing_enable({"use_reentrant": False})
    model.train()
    inputs = family_prompts("qwen2_5_vl", processor)
    seen = []
    hook = model.model.visual.register_forward_hook(lambda module, args, out: seen.append(args[0].shape[0]))
    ids, mask = completions(8, 4)
    group_forward(model, inputs, ids, mask, 4).logp.sum().backward()
    hook.remove()
    assert seen == [inputs["pixel_values_videos"].shape[0]]  # the patches of 2 prompts, not 8


def test_the_prompt_keys_are_held_once_not_per_completion(tiny_checkpoint, family_prompts, monkeypatch):
    """The completions' attention reads B prompts' stored keys and only their own new
    keys: no [B*G, heads, P, dim] copy exists anywhere."""
    model, processor = load(tiny_checkpoint("qwen2_5_vl"))
    inputs = family_prompts("qwen2_5_vl", processor)
    seen = []
    real = shared_prefix.grouped_attention

    def spy(module, query, key, value, attention_mask, store, scaling):
        seen.append((store.layers[module.layer_idx][0].shape, key.shape))
        return real(module, query, key, value, attention_mask, store, scaling)

    monkeypatch.setattr(shared_prefix, "grouped_attention", spy)
    ids, mask = completions(8, 4)
    with torch.no_grad():
        group_forward(model, inputs, ids, mask, 4)
    batch, prompt = inputs["input_ids"].shape
    assert len(seen) == model.config.text_config.num_hidden_layers
    for prefix_keys, own_keys in seen:
        assert prefix_keys[0] == batch and prefix_keys[2] == prompt - 1
        assert own_keys[0] == 8 and own_keys[2] == 4  # the tail only


def test_left_padded_prompts_are_prefilled_without_a_mask(tiny_checkpoint, family_prompts, monkeypatch):
    """The prompts' forward builds no [B, 1, P, P] mask: its attention runs prompt by
    prompt over the real tokens (what the log-prob tests above check for exactness)."""
    from omni_rl.models.forward import prefill

    model, processor = load(tiny_checkpoint("qwen2_5_vl"))
    inputs = family_prompts("qwen2_5_vl", processor)
    assert not inputs["attention_mask"].all()  # the two prompts differ in length
    masks, real = [], shared_prefix.shared_prefix_attention

    def spy(module, query, key, value, attention_mask, shared_prefix=None, **kwargs):
        masks.append(attention_mask)
        return real(module, query, key, value, attention_mask, shared_prefix=shared_prefix, **kwargs)

    monkeypatch.setitem(shared_prefix.AttentionInterface._global_mapping, shared_prefix.NAME, spy)
    with torch.no_grad():
        store = prefill(model, inputs).store
    assert masks == [None] * model.config.text_config.num_hidden_layers
    assert store.starts == (inputs["attention_mask"].shape[1] - inputs["attention_mask"].sum(-1)).tolist()


def test_chunked_logprobs_equal_the_whole_logits_with_exact_gradients(monkeypatch):
    """Log-probs and entropies a few tokens at a time equal those of the whole [N, L, V]
    logits, and so do their gradients (each chunk is recomputed in backward)."""
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=False)
    hidden = torch.randn(3, 7, 16, requires_grad=True)
    ids = torch.randint(0, 50, (3, 7))
    mask = torch.ones_like(ids)
    mask[0, 4:] = 0
    monkeypatch.setattr(forward, "CHUNK_BYTES", 4 * 50 * 3)  # three tokens per chunk
    out = forward.completion_logprobs(hidden, head, ids, mask, temperature=0.7, entropy="grad")
    logits = head(hidden) / 0.7
    want_logp = token_logprobs(logits, ids) * mask
    want_entropy = entropy_from_logits(logits) * mask
    torch.testing.assert_close(out[..., 0], want_logp, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(out[..., 1], want_entropy, atol=1e-6, rtol=1e-6)
    weights = torch.randn(3, 7)
    got = torch.autograd.grad(((out[..., 0] - 0.1 * out[..., 1]) * weights).sum(), [hidden, head.weight])
    want = torch.autograd.grad(((want_logp - 0.1 * want_entropy) * weights).sum(), [hidden, head.weight])
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-5)
    detached = forward.completion_logprobs(hidden, head, ids, mask, entropy="metric")
    (through_entropy,) = torch.autograd.grad(detached[..., 1].sum(), hidden, allow_unused=True)
    assert through_entropy is None or not through_entropy.any()  # a metric: no gradient
    assert forward.completion_logprobs(hidden, head, ids, mask).shape == (3, 7, 1)


def test_the_prompt_forward_projects_no_position_onto_the_vocabulary(tiny_checkpoint, family_prompts):
    model, processor = load(tiny_checkpoint("qwen2_5_vl"))
    inputs = family_prompts("qwen2_5_vl", processor)
    shapes = []
    hook = model.lm_head.register_forward_hook(lambda module, args, out: shapes.append(tuple(out.shape)))
    ids, mask = completions(4, 5)
    with torch.no_grad():
        group_forward(model, inputs, ids, mask, 2)
    hook.remove()
    vocab = model.config.text_config.vocab_size
    assert all(vocab not in shape for shape in shapes), shapes


def test_the_chunked_head_adds_up_a_bf16_weight_gradient_in_fp32(monkeypatch):
    """Under FSDP2 bf16-mixed the gathered vocabulary weight is bf16. Its gradient over
    38 chunks (a 7B model's count per micro-batch) adds up in fp32 and is rounded to
    bf16 once: as close to the fp64 gradient of the same bf16 numbers as rounding that
    gradient to bf16 is (weight 0.171% against one rounding's 0.165%; bias 0.153%
    against 0.146%). A bf16 buffer rounds the running sum per chunk: 0.59% and 1.15%."""
    g = torch.Generator().manual_seed(0)
    vocab, width, positions = 512, 64, 152
    head = torch.nn.Linear(width, vocab, dtype=torch.bfloat16)
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, width, generator=g) * 0.1)
        head.bias.copy_(torch.randn(vocab, generator=g))
    hidden = torch.randn(1, positions, width, generator=g).bfloat16()
    ids = torch.randint(0, vocab, (1, positions), generator=g)
    monkeypatch.setattr(forward, "CHUNK_BYTES", 4 * vocab * 4)  # four positions per chunk: 38 chunks
    forward.completion_logprobs(hidden, head, ids, torch.ones_like(ids))[..., 0].sum().backward()
    assert head.weight.grad.dtype == torch.bfloat16
    weight, bias = (p.detach().double().requires_grad_() for p in (head.weight, head.bias))
    logits = hidden[0].double() @ weight.t() + bias
    torch.log_softmax(logits, -1).gather(-1, ids[0, :, None]).sum().backward()
    for got, want in ((head.weight.grad, weight.grad), (head.bias.grad, bias.grad)):
        error = (got.double() - want).norm() / want.norm()
        one_rounding = (want.bfloat16().double() - want).norm() / want.norm()
        assert error < 1.2 * one_rounding, (error.item(), one_rounding.item())
