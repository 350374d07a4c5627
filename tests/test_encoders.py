"""The zero-weight dummy encoder passes that keep FSDP2's collectives in step when ranks'
batches hold different media (``omni_rl.engine.encoders``), in one process: a text-only
forward that is told another rank has every medium runs every encoder, changes no
output bit and gives every encoder parameter a gradient of exactly zero.
(Two processes: tests/test_distributed.py.)"""

from __future__ import annotations

import logging

import pytest
import torch

from omni_rl.engine.encoders import EncoderLockstep, install
from omni_rl.models import FAMILIES, load
from omni_rl.models.forward import group_forward
from omni_rl.models.inputs import encode_prompts

FAMILIES_WITH_MEDIA = [
    "qwen2_vl",
    "qwen2_5_vl",
    "qwen3_vl",
    "qwen2_audio",
    "qwen2_5_omni_thinker",
    "qwen3_omni_moe_thinker",
]


def _text_prompts(processor) -> dict:
    conversations = [
        [{"role": "user", "content": [{"type": "text", "text": question}]}]
        for question in ("Which way?", "What moves in this clip, and where does it go?")
    ]
    return dict(encode_prompts(processor, conversations))


def _encoder_parameters(model) -> dict[str, torch.nn.Parameter]:
    return {
        name: p
        for name, p in model.named_parameters()
        if any(k in name for k in ("visual", "audio_tower", "projector"))
    }


@pytest.mark.parametrize("family", FAMILIES_WITH_MEDIA)
def test_a_text_batch_runs_every_encoder_with_zero_weight(family, tiny_checkpoint, caplog):
    model, processor = load(tiny_checkpoint(family))
    model.train()
    inputs = _text_prompts(processor)
    completion = torch.randint(0, 20, (4, 3))
    mask = torch.ones_like(completion)
    plain = group_forward(model, inputs, completion, mask, 2).logp
    calls = []

    def everywhere(flags):  # another rank holds every medium
        calls.append(list(flags))
        return [1.0] * len(flags)

    hooks = EncoderLockstep(model, union=everywhere)
    try:
        with caplog.at_level(logging.INFO, logger="omni_rl.engine.encoders"):
            out = group_forward(model, inputs, completion, mask, 2).logp
            assert torch.equal(out, plain)  # bit for bit
            out.sum().backward()
            with torch.no_grad():  # logged once
                group_forward(model, inputs, completion, mask, 2)
    finally:
        hooks.remove()
    assert caplog.text.count("zero-weight dummy encoder pass") == 1
    # one exchange per call, in the prompts' forward only (not the completions' over the prefix)
    modalities = FAMILIES.get(family).modalities
    assert calls == [[0.0] * len(hooks.modalities)] * 2
    assert set(hooks.modalities) == set(modalities)
    assert hooks.take_count() == 2 * len(modalities) and hooks.take_count() == 0
    encoder = _encoder_parameters(model)
    assert encoder
    blocks = [name for name in encoder if ".blocks." in name or ".layers." in name]
    assert blocks
    for name in blocks:  # the sharded units: the backward went through every one
        assert encoder[name].grad is not None, name
    for name, param in encoder.items():  # with exactly zero weight
        assert param.grad is None or not param.grad.any(), name


def test_no_dummy_where_no_rank_lacks_a_medium(tiny_checkpoint, family_prompts):
    """A batch with its video runs no dummy; nor does a text batch when no rank has media."""
    model, processor = load(tiny_checkpoint("qwen2_5_vl"))
    hooks = EncoderLockstep(model, union=lambda flags: list(flags))
    try:
        with torch.no_grad():
            model(**family_prompts("qwen2_5_vl", processor))
            model(**_text_prompts(processor))
    finally:
        hooks.remove()
    assert hooks.take_count() == 0


def test_install_skips_models_without_encoders():
    assert install(torch.nn.Linear(2, 2)) is None
