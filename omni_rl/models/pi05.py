"""pi_0.5 as a flow policy's backbone: transformers' ``PI05ForConditionalGeneration``.

pi_0.5 is pi_0's layout (a PaliGemma prefix over camera images and a prompt, an action
expert attending to the prefix's keys and values) with two changes that matter here:
the robot state is not a token of the expert's but text in the prompt ("State: " and
each number discretized into 256 bins over [-1, 1], ``PI05Processor.build_prompts``),
and the expert reads the time through adaptive norms (``timestep_embeds``) rather than
mixed into the action tokens. So the prefix, encoded once per observation, already
holds everything the observation says, and pi_RL's critic for pi_0.5 reads the VLM's
features of it (the masked mean of its last hidden states), not the expert's.
Everything else (the chain, the noise head on the expert's tokens, cloning, the
processor's statistics, quantiles included, saving) is ``Pi0Backbone``'s.
"""

from __future__ import annotations

from pathlib import Path

import torch

from omni_rl.errors import OmniRLError
from omni_rl.models.pi0 import (
    Pi0Backbone,
    Pi0Context,
    Pi0Observation,
    Pi0Prefix,
    check_images,
    normalize,
    save_seeded,
    sized_pi0_processor,
    tiny_pi0_processor,
    tiny_vlm_and_expert,
)


def tiny_pi05_config(
    vocab: int, image_token_id: int, width: int = 64, image_size: int = 32, chunk: int = 8, dims: int = 8
):
    """A PI05 config a CPU test runs in milliseconds: the tiny pi_0's VLM and expert
    (``tiny_vlm_and_expert``), ``chunk`` actions of ``dims`` numbers, 4 denoising steps."""
    from transformers import PI05Config

    vlm, expert = tiny_vlm_and_expert(vocab, image_token_id, width, image_size)
    return PI05Config(vlm_config=vlm, dit_config=expert, chunk_size=chunk, max_action_dim=dims, num_inference_steps=4)


def tiny_pi05_processor(image_size: int = 32, chunk: int = 8, dims: int = 8, image_tokens: int = 16):
    """``tiny_pi0_processor``'s byte-level processor as transformers' ``PI05Processor``.
    No statistics: ``pi05_inputs`` discretizes the state as it is."""
    return tiny_pi0_processor(image_size, chunk, dims, image_tokens, "PI05Processor")


def build_tiny_pi05(out: str | Path, seed: int = 0, width: int = 64) -> Path:
    """Write a tiny random-init PI05 checkpoint (``tiny_pi05_config``) with its processor
    (``tiny_pi05_processor``), which transformers' ``from_pretrained`` loads; the same
    seed gives the same weights."""
    processor = tiny_pi05_processor()
    config = tiny_pi05_config(len(processor.tokenizer), processor.image_token_id, width)
    return save_seeded("PI05ForConditionalGeneration", config, processor, out, seed)


def pi05_inputs(processor, images: torch.Tensor, instructions: list[str], state: torch.Tensor, max_tokens: int = 200):
    """A ``Pi0Observation`` from one camera's uint8 images [N, 3, H, W], N instructions
    and N states, through ``processor`` (a ``PI05Processor``): the state normalized by
    the processor's statistics when it has them (quantiles, or mean and std: its own
    ``normalize``'s rule, ``omni_rl.models.pi0.normalize``), then written into the prompt by the
    processor's own ``build_prompts`` (its 256 bins over [-1, 1]); prompts padded to
    the longest. ``state`` stays in the observation for its batch size and device; the
    model reads it from the prompt alone. A prompt whose text (its tokens but the
    image's) is longer than ``max_tokens`` (openpi's 200 for pi_0.5) is refused, naming
    its row."""
    check_images(images, instructions, state, "pi05")
    state = normalize(processor, "state", state.float())
    cameras = [[image] for image in images]
    prompts = processor.build_prompts(list(instructions), cameras, state.cpu())
    text = processor.tokenizer(prompts, padding="longest", padding_side="right", return_tensors="pt")
    lengths = (text["attention_mask"] * (text["input_ids"] != processor.image_token_id)).sum(-1)
    if int(lengths.max()) > max_tokens:
        row = int(lengths.argmax())
        raise OmniRLError(
            f"pi05 observations: env {row}'s prompt ({instructions[row]!r} and its state) is "
            f"{int(lengths[row])} tokens besides the image's, over the limit of {max_tokens}"
        )
    pixels = processor.image_processor(list(images), return_tensors="pt")["pixel_values"]
    present = torch.ones(len(instructions), 1, dtype=torch.bool)
    return Pi0Observation(text["input_ids"], text["attention_mask"], pixels[:, None], present, state)


class Pi05Backbone(Pi0Backbone):
    """A PI05 checkpoint as a flow policy's velocity field (``Pi0Backbone``'s, with the
    state in the prompt and the time in the expert's norms). A critic on features reads
    the masked mean of the VLM's last hidden states over the prefix, detached."""

    KIND = "pi05"
    MODEL_CLASS = "PI05ForConditionalGeneration"
    CONFIG_CLASS = "PI05Config"

    @staticmethod
    def build_tiny(out: str | Path, seed: int = 0, width: int = 64) -> Path:
        """Write a tiny random checkpoint of this family (``build_tiny_pi05``)."""
        return build_tiny_pi05(out, seed, width)

    @staticmethod
    def sized_processor(config, chunk: int):
        """``tiny_pi05_processor`` sized for a PI05 ``config`` (``sized_pi0_processor``)."""
        return sized_pi0_processor(config, chunk, tiny_pi05_processor)

    def __init__(self, model, processor=None, layout=None, env_action_dim=None, privileged_dim=0):
        super().__init__(model, processor, layout, env_action_dim, privileged_dim)
        self.feature_dim = model.config.vlm_config.text_config.hidden_size

    def inputs(self, images: torch.Tensor, instructions: list[str], state: torch.Tensor) -> Pi0Observation:
        return pi05_inputs(self.processor, images, instructions, state)

    def expert(
        self, prefix: Pi0Prefix, state: torch.Tensor, x: torch.Tensor, t: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(velocity [B, chunk, dims], the expert's output tokens [B, chunk, width]) at
        the noisy chunk ``x`` and times ``t`` [B]; ``state`` is in the prompt, unread here."""
        model = self.model
        embeds, time = model.embed_action_time(x, t)
        try:
            out = model.model(
                action_embeds=embeds, timestep_embeds=time, attention_mask=prefix.attention_mask, cache=prefix.cache
            )
        finally:
            prefix.cache.crop(prefix.length - prefix.cache.get_seq_length())  # drop the chunk's keys
        tokens = out.last_hidden_state[:, -self.horizon :]
        return model.action_out_proj(tokens), tokens

    def prefix_features(self, hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """The masked mean over the prompt, detached [B, width], kept with the prefix: the
        hidden states themselves are not held past the VLM's pass."""
        mask = attention_mask[..., None].to(hidden.dtype)
        return (hidden.detach() * mask).sum(1) / mask.sum(1).clamp(min=1.0)

    def critic_features(self, context: Pi0Context) -> torch.Tensor:
        return context.prefix.features
