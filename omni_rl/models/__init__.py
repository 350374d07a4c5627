"""Model families: one loader for tiny and released checkpoints, and tiny builders.

``load(path)`` reads ``model_type`` from the checkpoint's config.json, finds its family
and returns ``(model, processor)``; ``load(path, empty=True)`` builds the model on the
meta device instead, for FSDP2 to shard and ``fill_sharded`` to fill from rank 0's read
(``omni_rl.models.weights``). ``build_tiny(family, out)`` writes a seeded,
random-init checkpoint of at most 2 M parameters that plain transformers loads too.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from omni_rl.errors import OmniRLError
from omni_rl.models import weights
from omni_rl.models.families import FAMILIES, Family
from omni_rl.models.tokenizer import build_tokenizer
from omni_rl.runtime import umask_files

__all__ = [
    "FAMILIES",
    "Family",
    "build_tiny",
    "family_of",
    "fill_sharded",
    "load",
    "load_processor",
    "placeholder_token_ids",
]


def checkpoint_dir(path: str | Path) -> Path:
    """The checkpoint directory ``path`` names: itself, or a training run's exported
    ``model/``; anything else is an error saying where a run keeps its models."""
    path = Path(path)
    for candidate in (path, path / "model"):
        if (candidate / "config.json").is_file():
            return candidate
    raise OmniRLError(
        f"{path}: not a checkpoint directory (no config.json); a training run keeps its final model in "
        "OUTPUT_DIR/model and each checkpoint's in OUTPUT_DIR/checkpoints/step-N/model"
    )


def require_media_family(media_family: str, model_family: str) -> None:
    """Refuse media sized for ``media_family``'s patches (``media.family``) where the
    model, of ``model_family``, has patches of another size: its processor cannot cut
    the frames into its patches."""
    ours, theirs = FAMILIES.get(media_family).patch_size, FAMILIES.get(model_family).patch_size
    if theirs and ours != theirs:
        raise OmniRLError(
            f"media.family '{media_family}' sizes frames for {ours}-pixel patches; the model is "
            f"{FAMILIES.canonical(model_family)}, with {theirs}-pixel patches: set media.family: {model_family}"
        )


def family_of(path: str | Path) -> Family:
    """The family of the checkpoint at ``path`` (or a run's ``model/``), from its
    config.json's ``model_type``."""
    config_file = checkpoint_dir(path) / "config.json"
    try:
        model_type = json.loads(config_file.read_text())["model_type"]
    except FileNotFoundError:
        raise OmniRLError(f"{path}: not a checkpoint directory (no config.json)") from None
    except (json.JSONDecodeError, KeyError):
        raise OmniRLError(f"{config_file}: unreadable or without 'model_type'") from None
    if model_type not in FAMILIES:
        raise OmniRLError(f"{config_file}: model_type '{model_type}' is not supported; known: {', '.join(FAMILIES)}")
    return FAMILIES.get(model_type)


def load(
    path: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    empty: bool = False,
) -> tuple[torch.nn.Module, object]:
    """Load a local checkpoint (tiny or released) and its processor.

    Args:
        path: a directory written by ``save_pretrained`` (or a training run's
            directory, whose ``model/`` is loaded); nothing is downloaded.
        device: where the model's parameters go (ignored when ``empty``).
        dtype: parameter dtype (bfloat16 on GPUs, float32 on CPUs).
        empty: build the model on the meta device without reading its weights, for
            FSDP2 on several processes: the engine shards it, then ``fill_sharded``
            gives every rank its shards from rank 0's read (``omni_rl.models.weights``).

    Returns:
        (model, processor), the model in eval mode; ``model.omni_rl_stored`` names the
        checkpoint and the dtype it stores (what exports are written in).
    """
    from transformers import AutoConfig

    from omni_rl.models import shared_prefix

    path = checkpoint_dir(path)
    family = family_of(path)
    if not empty:
        model = _read(path, family, dtype).to(device)
    elif family.loader is not None:
        model = family.loader(path, dtype, empty=True)
    else:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        model = weights.empty_model(family.model_cls(), config, dtype, path)
    model.omni_rl_stored = weights.StoredWeights(path, weights.stored_dtype(path, default=dtype))
    shared_prefix.install(model)
    return model.eval(), load_processor(path)


def load_processor(path: str | Path):
    """The processor of a local checkpoint (or a run's ``model/``), without its model."""
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(checkpoint_dir(path), local_files_only=True)


def fill_sharded(model: torch.nn.Module, device: torch.device) -> None:
    """Give a model that ``load(empty=True)`` built, now sharded by FSDP2, its weights
    (every rank calls this): rank 0 reads its checkpoint whole, in the dtype it stores,
    and broadcasts it; every rank keeps its shards (``omni_rl.models.weights.fill``)."""
    stored = model.omni_rl_stored
    whole = None
    if torch.distributed.get_rank() == 0:
        whole = _read(stored.path, family_of(stored.path), stored.dtype)
    weights.fill(model, whole, device)


def _read(path: Path, family: Family, dtype: torch.dtype) -> torch.nn.Module:
    """The whole model of the checkpoint at ``path``, read by its family's loader.

    Every loader passes ``use_kernels=False``: transformers would otherwise swap layers
    for kernels fetched from the Hub whenever the mode flips (``model.train()``) on a
    GPU, which downloads code at run time and trains other numerics than the tests check.
    """
    if family.loader is not None:
        return family.loader(path, dtype)
    return family.model_cls().from_pretrained(path, dtype=dtype, local_files_only=True, use_kernels=False)


def build_tiny(family: str, out: str | Path, seed: int = 0, width: int = 64, audio_seconds: int = 30) -> Path:
    """Write a tiny random-init checkpoint of ``family`` (model, processor, tokenizer)
    with a ``width``-wide decoder (64: about 0.2 M params; 128: about 0.6 M).

    ``audio_seconds`` is the audio window of audio families (the feature extractor pads
    to it, the encoder's positions cover it); released checkpoints have 30 s.
    The same ``seed`` gives the same weights, byte for byte.
    """
    if width < 32 or width % 32:
        raise OmniRLError(f"tiny model width {width}: must be a multiple of 32")
    if audio_seconds < 1:
        raise OmniRLError(f"tiny model audio window {audio_seconds} s: must be >= 1")
    spec = FAMILIES.get(family)
    tokenizer = build_tokenizer(spec.tokens)
    config = spec.tiny_config(tokenizer, width)
    processor = spec.tiny_processor(tokenizer)
    if "audio" in spec.modalities:
        _set_audio_window(config, processor, audio_seconds)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = spec.model_cls()(config)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    umask_files(out)  # safetensors writes 600
    return out


def _set_audio_window(config, processor, seconds: int) -> None:
    """Size a tiny audio encoder and its feature extractor for ``seconds`` of audio
    (100 mel frames per second, halved by the encoder's strided convolution)."""
    from transformers import WhisperFeatureExtractor

    thinker = getattr(config, "thinker_config", config)
    thinker.audio_config.max_source_positions = 50 * seconds
    extractor = processor.feature_extractor
    processor.feature_extractor = WhisperFeatureExtractor(feature_size=extractor.feature_size, chunk_length=seconds)


def placeholder_token_ids(processor) -> list[int]:
    """Ids of the media placeholder tokens (image, video, audio pads) of a processor's
    tokenizer: a sampler must never emit them."""
    tokenizer = processor.tokenizer
    ids = []
    for attr in ("image_token", "video_token", "audio_token"):
        token = getattr(processor, attr, None) or getattr(tokenizer, attr, None)
        if token is not None:
            ids.append(tokenizer.convert_tokens_to_ids(token))
    return sorted(set(ids))
