"""Every rank runs every media encoder in every prompt forward, so FSDP2 stays in step.

Under FSDP2 each vision block (and each audio block) is its own sharded unit: its
forward all-gathers the block's weights and its backward reduce-scatters the block's
gradients, collectives that every rank must issue in the same order. The Hugging Face
models skip an encoder when a batch has no input for it, so a rank whose micro-batch
holds a video runs the vision blocks' collectives while a rank with text only does
not: gloo aborts, NCCL hangs or pairs the wrong tensors. Filler micro-batches
(``distributed.lockstep``) equalise how many forwards run, not which modules run.

``EncoderLockstep`` hooks the model's forward. In every forward that takes prompts
(not a continuation: no ``ReadPrefix``, no filled KV cache), the ranks sum which
modalities their batches hold (one small all-reduce); a rank whose batch lacks one
that another rank has runs that encoder on a tiny zero input (one merged vision token,
or a short clip of silence) through the model's own ``get_*_features``. Its outputs,
times zero, are added to the decoder's input embeddings: the embeddings are unchanged
bit for bit and the encoder's gradient from the dummy is exactly zero, yet the
backward passes through every block, so its reduce-scatter happens on every rank.

Order matters as well as count. Inside a forward the models run audio, then images,
then videos, and images and videos share one vision tower. A dummy audio pass runs at
the start of the multimodal model's forward (before any real encoder), dummy image
and video passes just before the decoder (after every real one): each rank then calls
the audio tower, then the vision tower, as many times as the union of the ranks'
modalities says, whichever of those calls are real.

Only a sharded model among several processes needs this; DDP instead looks for unused
parameters (``find_unused_parameters``), and one process has no peers to wait on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch
from torch import nn

from omni_rl.engine import distributed
from omni_rl.models.shared_prefix import ReadPrefix

log = logging.getLogger(__name__)

# the order in which the models run their encoders inside one forward
MODALITIES = ("audio", "image", "video")
INPUT_KEYS = {"audio": "input_features", "image": "pixel_values", "video": "pixel_values_videos"}
# dummy audio length in mel frames (1 s; the Qwen2-Audio encoder takes only its full window)
AUDIO_FRAMES = 100


def _multimodal_module(model: nn.Module) -> nn.Module | None:
    """The module that runs the encoders and then the decoder (``language_model``)."""
    for module in model.modules():
        children = dict(module.named_children())
        if "language_model" in children and ("visual" in children or "audio_tower" in children):
            return module
    return None


def _tensors(value) -> list[torch.Tensor]:
    """Every floating-point tensor in an encoder's output (nested outputs, tuples)."""
    if isinstance(value, torch.Tensor):
        return [value] if value.is_floating_point() else []
    if isinstance(value, dict):  # ModelOutput is a dict too
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _prompt_forward(kwargs: dict) -> bool:
    """A forward that takes prompts (their media too): not the completions' forward over
    a shared prefix, nor a decoding step over a filled cache. The same on every rank,
    since every rank makes the same calls."""
    if isinstance(kwargs.get("shared_prefix"), ReadPrefix):
        return False
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if cache is not None and hasattr(cache, "get_seq_length") and cache.get_seq_length() > 0:
        return False
    return kwargs.get("input_ids") is not None or kwargs.get("inputs_embeds") is not None


class EncoderLockstep:
    """The hooks on one model (see the module docstring).

    Args:
        model: the model (FSDP2-sharded or about to be); found inside LoRA wrappers.
        union: element-wise sum over ranks of a list of floats (``distributed.all_sum``;
            a test passes its own).
    """

    def __init__(self, model: nn.Module, union: Callable[[list[float]], list[float]] = distributed.all_sum):
        inner = _multimodal_module(model)
        if inner is None:
            raise ValueError("no multimodal module (language_model beside visual or audio_tower) in this model")
        self.inner = inner
        self.union = union
        children = dict(inner.named_children())
        self.modalities = tuple(m for m in MODALITIES if ("audio_tower" if m == "audio" else "visual") in children)
        self.passes = 0  # dummy encoder passes of this process since ``take_count``
        self._logged = False
        self._todo: list[str] = []
        self._outputs: list[torch.Tensor] = []
        self._device: torch.device | None = None
        self._handles = [
            inner.register_forward_pre_hook(self._before_encoders, with_kwargs=True),
            inner.language_model.register_forward_pre_hook(self._before_decoder, with_kwargs=True),
        ]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()

    def take_count(self) -> int:
        """Dummy passes of this process since the last call."""
        passes, self.passes = self.passes, 0
        return passes

    # ---------------------------------------------------------------- hooks

    def _before_encoders(self, module, args, kwargs):
        self._todo, self._outputs = [], []
        if args or not _prompt_forward(kwargs):
            return None
        local = [kwargs.get(INPUT_KEYS[m]) is not None for m in self.modalities]
        anywhere = self.union([float(here) for here in local])
        self._todo = [m for m, here, n in zip(self.modalities, local, anywhere, strict=True) if n > 0 and not here]
        if not self._todo:
            return None
        reference = kwargs.get("input_ids")
        if reference is None:
            reference = kwargs["inputs_embeds"]
        self._device = reference.device
        if "audio" in self._todo:  # audio runs first in the models' forwards
            self._run("audio")
        return None

    def _before_decoder(self, module, args, kwargs):
        if not self._todo:
            return None
        for modality in ("image", "video"):
            if modality in self._todo:
                self._run(modality)
        todo, outputs = self._todo, self._outputs
        self._todo, self._outputs = [], []
        embeds = kwargs.get("inputs_embeds")
        if embeds is None:
            raise RuntimeError("the decoder was called without inputs_embeds; the dummy encoder pass has nowhere to go")
        zero = sum((t * 0).sum().to(embeds.dtype) for t in outputs)
        kwargs["inputs_embeds"] = embeds + zero
        self._note(todo)
        return args, kwargs

    # ---------------------------------------------------------------- dummies

    def _run(self, modality: str) -> None:
        out = getattr(self, f"_dummy_{modality}")(self._device)
        self._outputs.extend(_tensors(out))
        self.passes += 1

    def _vision_input(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """One merged token's worth of zero patches and its grid ([1, m, m])."""
        config = self.inner.visual.config
        merge = config.spatial_merge_size
        channels = getattr(config, "in_channels", None) or getattr(config, "in_chans", 3)
        width = channels * config.temporal_patch_size * config.patch_size**2
        dtype = next(self.inner.visual.parameters()).dtype
        pixels = torch.zeros(merge * merge, width, dtype=dtype, device=device)
        return pixels, torch.tensor([[1, merge, merge]], device=device)

    def _dummy_image(self, device):
        return self.inner.get_image_features(*self._vision_input(device))

    def _dummy_video(self, device):
        return self.inner.get_video_features(*self._vision_input(device))

    def _dummy_audio(self, device):
        tower = self.inner.audio_tower
        dtype = next(tower.parameters()).dtype
        mels = tower.config.num_mel_bins
        if hasattr(self.inner, "get_audio_features"):  # Omni: any length, with its mask
            features = torch.zeros(1, mels, AUDIO_FRAMES, dtype=dtype, device=device)
            mask = torch.ones(1, AUDIO_FRAMES, dtype=torch.long, device=device)
            return self.inner.get_audio_features(features, mask)
        # Qwen2-Audio: the encoder takes exactly its window, then the projector
        frames = tower.config.max_source_positions * tower.conv1.stride[0] * tower.conv2.stride[0]
        features = torch.zeros(1, mels, frames, dtype=dtype, device=device)
        hidden = tower(features).last_hidden_state
        return self.inner.multi_modal_projector(hidden)

    def _note(self, modalities: Sequence[str]) -> None:
        if self._logged:
            return
        self._logged = True
        log.warning(
            "rank %d: a prompt batch without %s while another rank's has it; ran a zero-weight dummy "
            "encoder pass so the sharded encoder blocks' collectives stay in step (counted in "
            "update/dummy_encoder_passes; logged once)",
            distributed.ranks().rank,
            " or ".join(modalities),
        )


def install(model: nn.Module) -> EncoderLockstep | None:
    """Hook ``model`` (see ``EncoderLockstep``); None for a model without media encoders."""
    if _multimodal_module(model) is None:
        return None
    return EncoderLockstep(model)
