"""Model inputs from chat messages and decoded media, through the family's processor."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch
from transformers import BatchFeature

from omni_rl.errors import OmniRLError

AUDIO_SAMPLE_RATE = 16_000
IGNORE_INDEX = -100


class SampledVideo(Protocol):
    """What encoding reads of a decoded clip. ``omni_rl.preprocess.video.VideoClip`` is
    one; the decoder sits a layer above the models, so they name only what they read."""

    @property
    def frames(self) -> np.ndarray:
        """uint8 [T, 3, H, W] RGB frames, resized to the budget."""
        ...

    @property
    def sampled_fps(self) -> float:
        """Frames kept per second of the source."""
        ...

    def metadata(self) -> dict:
        """The transformers ``VideoMetadata`` fields for the processor."""
        ...


def media_processor_kwargs(images: bool, videos: bool) -> dict:
    """What the processor is told about media that ``omni_rl.preprocess`` already
    resized (and, for videos, sampled): leave them as they are. The trainer and the vLLM
    engine pass the same, so both see the same pixels and the same number of media
    tokens (Qwen3-VL's video processor would otherwise sample frames again)."""
    kwargs: dict = {"do_resize": False} if images or videos else {}
    if videos:
        kwargs["do_sample_frames"] = False
    return kwargs


def interleaves_video_audio(processor) -> bool:
    """Whether the processor lays a video's own sound out with its frames (Omni)."""
    from transformers.processing_utils import OmniModalProcessorMixin

    method = getattr(type(processor), "replace_video_with_audio_token", None)
    return method is not None and method is not OmniModalProcessorMixin.replace_video_with_audio_token


def audio_slots(
    conversations: Sequence[list[dict]], audios: Sequence[np.ndarray], video_audios: Sequence[np.ndarray | None]
) -> tuple[list[np.ndarray], list[int | None]]:
    """Every waveform the prompts hear, in the order their tokens appear: standalone
    audio parts, and each video's own sound at its video's place. Returns the waveforms
    and, per waveform, the index of the video it belongs to (None: standalone), as the
    Omni processor's ``audio_from_video_indices`` wants them."""
    standalone, tracks = iter(audios), iter(enumerate(video_audios))
    waves, owners = [], []
    for messages in conversations:
        for message in messages:
            for part in message["content"] if isinstance(message["content"], list) else ():
                if part["type"] == "audio":
                    waves.append(next(standalone))
                    owners.append(None)
                elif part["type"] == "video":
                    index, wave = next(tracks)
                    if wave is not None:
                        waves.append(wave)
                        owners.append(index)
    return waves, owners


ANSWER_MARK = "omni-rl-answer-mark"


def answer_end(processor) -> str:
    """What the chat template closes an assistant's answer with, up to its line break:
    ``<|im_end|>`` in Qwen's templates, whatever the tokenizer's ``eos_token`` (released
    Qwen2-Audio's is ``<|endoftext|>``, a token the chat never closes a turn with). The
    tokenizer's ``eos_token`` where the template writes nothing after an answer."""
    question, answer = [{"type": "text", "text": "?"}], [{"type": "text", "text": ANSWER_MARK}]
    messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    rendered = processor.apply_chat_template(messages, tokenize=False)
    end = rendered[rendered.rindex(ANSWER_MARK) + len(ANSWER_MARK) :].split("\n")[0].strip()
    return end or processor.tokenizer.eos_token


def encode_prompts(
    processor,
    conversations: Sequence[list[dict]],
    *,
    images: Sequence[np.ndarray] = (),
    videos: Sequence[SampledVideo] = (),
    audios: Sequence[np.ndarray] = (),
    video_audios: Sequence[np.ndarray | None] = (),
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
        video_audios: one entry per video: its own sound track (16 kHz mono), or None
            for a video heard without sound. Only Omni processors take them: each
            sound's tokens are interleaved with its video's frames, 2-second chunk by
            chunk, as the model was trained.

    Images and frames arrive resized by ``omni_rl.preprocess`` (qwen-vl-utils' budgets,
    aligned to the patch grid), so the processor does not resize them again.

    When a video is heard, the inputs also hold ``use_audio_in_video`` [B] (bool):
    whether each prompt's videos carry their sound, which the model's positions depend
    on. The forwards here take it per prompt (``omni_rl.models.forward.prefill``);
    transformers' own forward takes one flag per batch.
    """
    _refuse_untaken(processor, images=images, videos=videos, audio=audios)
    texts = [processor.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in conversations]
    kwargs = media_processor_kwargs(bool(images), bool(videos))
    interleaved = interleaves_video_audio(processor)
    heard = [wave for wave in video_audios if wave is not None]
    if heard and not interleaved:
        raise OmniRLError(f"{type(processor).__name__} takes no sound with a video (use_audio_in_video needs Omni)")
    if video_audios and len(video_audios) != len(videos):
        raise OmniRLError(f"{len(video_audios)} video sound tracks for {len(videos)} videos")
    if images:
        kwargs["images"] = list(images)
    if videos:
        kwargs["videos"] = [torch.from_numpy(clip.frames) for clip in videos]  # [T, 3, H, W], no copy
        kwargs["video_metadata"] = [clip.metadata() for clip in videos]
        if interleaved:
            kwargs["fps"] = _shared_fps(videos, interleave=bool(heard))
    if heard:
        waves, owners = audio_slots(conversations, audios, video_audios)
        kwargs |= {"audio": waves, "audio_from_video_indices": owners, "load_audio_from_video": True}
    elif audios:
        kwargs["audio"] = list(audios)
    if "audio" in kwargs:
        kwargs["sampling_rate"] = AUDIO_SAMPLE_RATE
    out = processor(text=texts, return_tensors="pt", padding=True, padding_side="left", **kwargs)
    if "audio" in kwargs:
        _refuse_cut_sound(processor, kwargs["audio"], out)
    if interleaved and videos:  # the processor takes one fps for all; each video's own, for positions
        tps = processor.video_processor.temporal_patch_size
        out["video_second_per_grid"] = torch.tensor([tps / clip.sampled_fps for clip in videos])
    if heard:
        out["use_audio_in_video"] = torch.tensor(_heard_per_prompt(conversations, video_audios))
    return out


def _refuse_cut_sound(processor, waves: list, out) -> None:
    """Refuse a sound the processor cut: the Whisper feature extractors of Qwen2-Audio
    and Qwen2.5-Omni keep their window (released: 30 s and 300 s) and drop the rest
    without a word; each sound's frames (``feature_attention_mask``, one row a sound)
    must cover it, up to a last part-frame of under one hop (Qwen3-Omni's extractor,
    padding to the longest sound, drops that one: no cut). Processors that take longer
    sound whole pass."""
    mask, extractor = out.get("feature_attention_mask"), getattr(processor, "feature_extractor", None)
    if mask is None or extractor is None:
        return
    if len(mask) != len(waves):
        raise OmniRLError(f"{type(processor).__name__} returned {len(mask)} sound feature rows for {len(waves)} sounds")
    for wave, frames in zip(waves, mask.sum(-1).tolist(), strict=True):
        if frames < len(wave) // extractor.hop_length:
            window = extractor.n_samples / extractor.sampling_rate
            raise OmniRLError(
                f"a sound of {round(len(wave) / AUDIO_SAMPLE_RATE, 3):g} s is longer than {type(processor).__name__}'s "
                f"{window:g} s audio window (its feature extractor would drop the rest): set "
                f"media.max_audio_seconds to at most {window:g}"
            )


# The processor part that turns each medium into features; a processor without it
# would drop the medium from the prompt without a word.
_MEDIUM_PROCESSORS = {"images": "image_processor", "videos": "video_processor", "audio": "feature_extractor"}


def _refuse_untaken(processor, **media: Sequence) -> None:
    """An error when a prompt holds media the processor has no part for."""
    untaken = [
        name for name, items in media.items() if items and getattr(processor, _MEDIUM_PROCESSORS[name], None) is None
    ]
    if untaken:
        raise OmniRLError(f"{type(processor).__name__} takes no {' or '.join(untaken)}; use a model family that does")


def _shared_fps(videos: Sequence[SampledVideo], interleave: bool) -> float:
    """The sampled frame rate the Omni processor is given. It takes one for all videos,
    and interleaving a video's sound chunk by chunk needs the true one."""
    rates = {round(clip.sampled_fps, 6) for clip in videos}
    if interleave and len(rates) > 1:
        raise OmniRLError(
            f"videos sampled at different rates ({', '.join(map(str, sorted(rates)))} fps) cannot have their "
            "sound interleaved in one processor call; encode their prompts one by one"
        )
    return videos[0].sampled_fps


def _heard_per_prompt(conversations: Sequence[list[dict]], video_audios: Sequence[np.ndarray | None]) -> list[bool]:
    """Per prompt: whether its videos carry their sound (all of them, or none)."""
    tracks, heard = iter(video_audios), []
    for i, messages in enumerate(conversations):
        parts = [p for m in messages if isinstance(m["content"], list) for p in m["content"] if p["type"] == "video"]
        flags = {next(tracks, None) is not None for _ in parts}
        if len(flags) > 1:
            raise OmniRLError(f"prompt {i}: some of its videos have sound and some do not; use all or none")
        heard.append(flags == {True})
    return heard


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
# Audio features padded to the longest of the batch by some processors (Qwen3-Omni):
# right-padded with zeros (masked out) to the longest before concatenation.
RAGGED_KEYS = ("input_features", "feature_attention_mask")
# Per-prompt flags: one value per prompt, False where a prompt lacks it.
FLAG_KEYS = ("use_audio_in_video",)


def collate_prompts(prompts: Sequence[dict], pad_id: int) -> dict:
    """One batch from prompts encoded one by one: token tensors left-padded to the
    longest, media tensors concatenated in prompt order.

    Encoding each prompt once and collating any subset of them (a mini-batch, the
    prompts that survive filtering) gives the same inputs as encoding that subset
    together, without running the processor again; but for Qwen3-Omni's sound features,
    which its processor computes over sounds padded to the longest of a call (a shorter
    sound's last frame differs, 0.009 at most for a 1 s sound beside a 2 s one). Here
    each prompt keeps the features of its sound alone, as a per-request engine (vLLM)
    computes them, whatever batch it lands in.
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
        present = [torch.as_tensor(p[key]) for p in prompts if key in p]
        if present and key in RAGGED_KEYS:
            longest = max(x.shape[-1] for x in present)
            present = [torch.nn.functional.pad(x, (0, longest - x.shape[-1])) for x in present]
        if present:
            batch[key] = torch.cat(present, dim=0)
    for key in FLAG_KEYS:
        if any(key in p for p in prompts):
            empty = torch.zeros(0, dtype=torch.bool)
            flags = [p[key] if key in p else empty.new_zeros(p["input_ids"].shape[0]) for p in prompts]
            batch[key] = torch.cat(flags)
    return batch
