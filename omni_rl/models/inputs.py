"""Model inputs from chat messages and decoded media, through the family's processor."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from transformers import BatchFeature

from omni_rl.preprocess.video import VideoClip

AUDIO_SAMPLE_RATE = 16_000
IGNORE_INDEX = -100


def media_processor_kwargs(images: bool, videos: bool) -> dict:
    """What the processor is told about media that ``omni_rl.preprocess`` already
    resized (and, for videos, sampled): leave them as they are. The trainer and the vLLM
    engine pass the same, so both see the same pixels and the same number of media
    tokens (Qwen3-VL's video processor would otherwise sample frames again)."""
    kwargs: dict = {"do_resize": False} if images or videos else {}
    if videos:
        kwargs["do_sample_frames"] = False
    return kwargs


def encode_prompts(
    processor,
    conversations: Sequence[list[dict]],
    *,
    images: Sequence[np.ndarray] = (),
    videos: Sequence[VideoClip] = (),
    audios: Sequence[np.ndarray] = (),
) -> BatchFeature:
    """Model inputs for a batch of prompts, each ending in the assistant turn's header.

    Prompts are left-padded to the longest, so completions can be appended or generated.

    Args:
        processor: the family's processor (its chat template places the media).
        conversations: chat messages per prompt; content parts have a ``type`` of
            ``text``, ``image``, ``video`` or ``audio``.
        images: uint8 [H, W, 3] arrays, in the order the prompts mention them.
        videos: decoded clips, in order; their metadata gives the processor the true
            sampled fps and timestamps.
        audios: mono float32 waveforms at 16 kHz, in order.

    Images and frames arrive resized by ``omni_rl.preprocess`` (qwen-vl-utils' budgets,
    aligned to the patch grid), so the processor does not resize them again.
    """
    texts = [processor.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in conversations]
    kwargs = media_processor_kwargs(bool(images), bool(videos))
    if images:
        kwargs["images"] = list(images)
    if videos:
        kwargs["videos"] = [torch.from_numpy(clip.frames) for clip in videos]  # [T, 3, H, W], no copy
        kwargs["video_metadata"] = [clip.metadata() for clip in videos]
    if audios:
        kwargs["audio"] = list(audios)
        kwargs["sampling_rate"] = AUDIO_SAMPLE_RATE
    return processor(text=texts, return_tensors="pt", padding=True, padding_side="left", **kwargs)


def append_completion(
    inputs: BatchFeature, completion_ids: torch.Tensor, completion_mask: torch.Tensor | None = None
) -> tuple[dict, torch.Tensor]:
    """Prompt inputs extended by completion tokens, with labels on the completions only.

    Args:
        inputs: prompts from ``encode_prompts``; ``input_ids``: [B, P].
        completion_ids: [B, C] token ids, right-padded.
        completion_mask: [B, C], 1 on real completion tokens; None means all real.

    Returns:
        (model inputs with ids [B, P + C], labels [B, P + C]: -100 on prompts and padding).
    """
    device = inputs["input_ids"].device
    completion_ids = completion_ids.to(device)
    mask = torch.ones_like(completion_ids) if completion_mask is None else completion_mask.to(device)
    batch = dict(inputs)
    batch["input_ids"] = torch.cat([inputs["input_ids"], completion_ids], dim=1)
    batch["attention_mask"] = torch.cat([inputs["attention_mask"], mask], dim=1)
    if "mm_token_type_ids" in inputs:
        # Completion tokens are text (type 0); without this Qwen2.5-VL falls back to 1-D positions.
        batch["mm_token_type_ids"] = torch.cat([inputs["mm_token_type_ids"], torch.zeros_like(completion_ids)], dim=1)
    labels = torch.full_like(batch["input_ids"], IGNORE_INDEX)
    labels[:, inputs["input_ids"].shape[1] :] = completion_ids.masked_fill(mask == 0, IGNORE_INDEX)
    return batch, labels


# Per-medium tensors: concatenated over the prompts of a batch, in order.
MEDIA_KEYS = (
    "pixel_values",
    "image_grid_thw",
    "pixel_values_videos",
    "video_grid_thw",
    "second_per_grid_ts",
    "video_second_per_grid",
    "input_features",
    "feature_attention_mask",
)
TOKEN_KEYS = ("input_ids", "attention_mask", "mm_token_type_ids")


def collate_prompts(prompts: Sequence[dict], pad_id: int) -> dict:
    """One batch from prompts encoded one by one: token tensors left-padded to the
    longest, media tensors concatenated in prompt order.

    Encoding each prompt once and collating any subset of them (a mini-batch, the
    prompts that survive filtering) gives the same inputs as encoding that subset
    together, without running the processor again.
    """
    width = max(p["input_ids"].shape[1] for p in prompts)
    batch: dict = {}
    for key in TOKEN_KEYS:
        if key not in prompts[0]:
            continue
        fill = pad_id if key == "input_ids" else 0
        rows = []
        for p in prompts:
            t = p[key]
            pad = torch.full((t.shape[0], width - t.shape[1]), fill, dtype=t.dtype, device=t.device)
            rows.append(torch.cat([pad, t], dim=1))
        batch[key] = torch.cat(rows, dim=0)
    for key in MEDIA_KEYS:
        present = [p[key] for p in prompts if key in p]
        if present:
            batch[key] = torch.cat([torch.as_tensor(x) for x in present], dim=0)
    return batch
