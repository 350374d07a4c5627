"""pi_0 as a flow policy's backbone: transformers' ``PI0ForConditionalGeneration`` (a
PaliGemma prefix over camera images and an instruction, and a Gemma action expert that
attends to the prefix's keys and values layer by layer).

The prefix is encoded once per observation (``encode_prefix``) and every denoising step
runs only the action expert over its cache (``Pi0Backbone.velocity``), which also returns
the expert's output tokens: what a noise head and a critic read. The time convention
is the project's (t from 1 at noise to 0 at data, x_t = t·ε + (1-t)·a, velocity ε - a),
so ``omni_rl.algorithms.flow`` steps it unchanged. By default the VLM is frozen and the
expert, its state and action projections train (``Pi0Backbone.freeze_vlm``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from omni_rl.errors import OmniRLError


def tiny_pi0_config(width: int = 64, image_size: int = 32, chunk: int = 8, dims: int = 8):
    """A PI0 config a CPU test runs in milliseconds: a 2-layer ``width``-wide Gemma
    prefix over a 1-layer SigLIP on ``image_size``² images (16 tokens an image), a
    2-layer expert half as wide, ``chunk`` actions of ``dims`` numbers, 4 denoising
    steps, a 300-token vocabulary (the last id is the image placeholder)."""
    from transformers import PI0Config

    if width < 32 or width % 32:
        raise OmniRLError(f"tiny pi0 width {width}: must be a multiple of 32")
    vocab = 300
    return PI0Config(
        vlm_config={
            "model_type": "paligemma",
            "text_config": {
                "model_type": "gemma",
                "hidden_size": width,
                "num_hidden_layers": 2,
                "intermediate_size": 2 * width,
                "num_attention_heads": 2,
                "num_key_value_heads": 1,
                "head_dim": 32,
                "vocab_size": vocab,
            },
            "vision_config": {
                "model_type": "siglip_vision_model",
                "hidden_size": 32,
                "intermediate_size": 64,
                "patch_size": image_size // 4,
                "image_size": image_size,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "vision_use_head": False,
            },
            "projection_dim": width,
            "image_token_id": vocab - 1,
        },
        dit_config={
            "model_type": "gemma",
            "hidden_size": width // 2,
            "num_hidden_layers": 2,
            "intermediate_size": width,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 32,
        },
        chunk_size=chunk,
        max_state_dim=dims,
        max_action_dim=dims,
        num_inference_steps=4,
    )


def build_tiny_pi0(out: str | Path, seed: int = 0, width: int = 64) -> Path:
    """Write a tiny random-init PI0 checkpoint (``tiny_pi0_config``) that
    ``PI0ForConditionalGeneration.from_pretrained`` loads; the same seed gives the same
    weights."""
    from transformers import PI0ForConditionalGeneration

    config = tiny_pi0_config(width)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = PI0ForConditionalGeneration(config)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    return out


@dataclass
class Pi0Prefix:
    """One batch of observations' prefix, encoded once: every layer's keys and values
    (``cache``, holding only the prefix between denoising steps) and its token mask."""

    cache: object
    attention_mask: torch.Tensor
    length: int


class Pi0Backbone(nn.Module):
    """A PI0 checkpoint as a velocity field over action chunks.

    Observations are what ``PI0Processor`` prepares: ``input_ids`` and ``attention_mask``
    [B, P] (instruction tokens, image placeholders first), ``pixel_values``
    [B, cameras, 3, H, W], ``pixel_attention_mask`` [B, cameras] and ``state``
    [B, max_state_dim].
    """

    def __init__(self, model):
        super().__init__()
        self.model = model
        config = model.config
        self.chunk, self.action_dim = config.chunk_size, config.max_action_dim
        self.state_dim, self.steps = config.max_state_dim, config.num_inference_steps
        self.feature_dim = config.dit_config.hidden_size

    @classmethod
    def from_pretrained(cls, path: str | Path, **kwargs) -> Pi0Backbone:
        from transformers import PI0ForConditionalGeneration

        return cls(PI0ForConditionalGeneration.from_pretrained(path, **kwargs))

    def freeze_vlm(self) -> None:
        """Only the action expert and its projections train (pi_RL's setting)."""
        self.model.model.vlm.requires_grad_(False)

    def encode_prefix(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        pixel_values: torch.Tensor,
        pixel_attention_mask: torch.Tensor,
    ) -> Pi0Prefix:
        """Run the VLM over the images and instruction once: its cache is what every
        denoising step of these observations attends to."""
        core = self.model.model
        if pixel_values.shape[:2] != pixel_attention_mask.shape:
            raise OmniRLError(
                f"pi0 observations: pixel_values {tuple(pixel_values.shape)} does not match "
                f"pixel_attention_mask {tuple(pixel_attention_mask.shape)} (batch, cameras)"
            )
        embeds = core.embed_prefix(input_ids, pixel_values, pixel_attention_mask)
        cache = core.vlm(
            inputs_embeds=embeds,
            attention_mask=attention_mask,
            position_ids=attention_mask.cumsum(-1) - 1,
            token_type_ids=torch.zeros_like(input_ids),
            use_cache=True,
        ).cache
        return Pi0Prefix(cache, attention_mask, cache.get_seq_length())

    def velocity(
        self, prefix: Pi0Prefix, state: torch.Tensor, x: torch.Tensor, t: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(velocity [B, chunk, dims], the expert's output tokens [B, chunk, width]) at
        the noisy chunk ``x`` and times ``t`` [B]; the prefix's cache is left as it was."""
        model = self.model
        embeds = model.embed_action_time(state, x, t)
        try:
            out = model.model(action_embeds=embeds, attention_mask=prefix.attention_mask, cache=prefix.cache)
        finally:
            prefix.cache.crop(prefix.length - prefix.cache.get_seq_length())  # drop the chunk's keys
        tokens = out.last_hidden_state[:, -self.chunk :]
        return model.action_out_proj(tokens), tokens
