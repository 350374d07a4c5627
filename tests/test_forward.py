"""The shared-prefix group forward equals the full B*G forward, in values and gradients."""

from __future__ import annotations

import pytest
import torch

from omni_rl.algorithms.losses import token_logprobs
from omni_rl.models import FAMILIES, load
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


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_group_forward_equals_full_forward(family, tiny_checkpoint, family_prompts):
    model, processor = load(tiny_checkpoint(family))
    inputs = family_prompts(family, processor)
    n = 3
    ids, mask = completions(2 * n, 6)
    with torch.no_grad():
        shared = group_forward(model, inputs, ids, mask, n, with_entropy=True)
        reference = full_logp(model, inputs, ids, mask, n)
    torch.testing.assert_close(shared.logp * mask, reference * mask, atol=1e-5, rtol=1e-5)
    assert shared.entropy.shape == ids.shape and (shared.entropy >= 0).all()


def test_group_forward_gradients_equal_full_forward(tiny_checkpoint, family_prompts):
    model, processor = load(tiny_checkpoint("qwen2_5_vl"))
    model.train()
    inputs = family_prompts("qwen2_5_vl", processor)
    n = 2
    ids, mask = completions(2 * n, 5, seed=1)
    watched = {"vision": model.model.visual.patch_embed.proj.weight, "head": model.lm_head.weight}

    def grads(fn):
        model.zero_grad(set_to_none=True)
        (fn() * mask).sum().backward()
        return {name: p.grad.clone() for name, p in watched.items()}

    shared = grads(lambda: group_forward(model, inputs, ids, mask, n).logp)
    reference = grads(lambda: full_logp(model, inputs, ids, mask, n))
    for name in watched:
        assert shared[name].abs().sum() > 0
        torch.testing.assert_close(shared[name], reference[name], atol=1e-5, rtol=1e-4)


def test_group_forward_runs_the_vision_tower_once_per_batch(tiny_checkpoint, family_prompts):
    model, processor = load(tiny_checkpoint("qwen2_5_vl"))
    inputs = family_prompts("qwen2_5_vl", processor)
    seen = []
    hook = model.model.visual.register_forward_hook(lambda module, args, out: seen.append(args[0].shape[0]))
    ids, mask = completions(8, 4)
    group_forward(model, inputs, ids, mask, 4)
    hook.remove()
    assert seen == [inputs["pixel_values_videos"].shape[0]]  # the patches of 2 prompts, not 8
