"""Qwen2.5-Omni specifics: positions of prompts that hear their videos, and the thinker
of a released (thinker + talker) checkpoint.

Positions. The Omni thinker's multimodal RoPE lays a video's sound out on the same
time axis as its frames, but transformers takes ``use_audio_in_video`` as one flag
for a whole batch. A batch mixing prompts whose videos carry sound with prompts whose
videos do not (a missing track, a row that did not ask) would get wrong positions.
``prompt_positions`` computes each prompt's positions with its own flag, through the
model's own ``get_rope_index``, and the forwards pass them explicitly.

Checkpoints. A released ``qwen2_5_omni`` checkpoint holds a thinker (text out) and a
talker with its vocoder (speech out). RL trains the thinker: ``load_thinker`` builds
only the thinker and loads only its weights, so the talker never reaches memory.
Saving it writes a thinker-only checkpoint (``qwen2_5_omni_thinker``) and
``omni_rl_export.json`` saying so; ``attach_talker`` puts the trained thinker back
beside the released talker.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from omni_rl.errors import OmniRLError

EXPORT_NOTE = "omni_rl_export.json"
THINKER_PREFIX = "thinker."


def _counts(ids: torch.Tensor, config) -> tuple[int, int, int]:
    """(images, videos, sound tracks) of one prompt's token ids [P]: a vision start
    followed by an image token opens an image; by a video token, or by an audio start
    when the video carries its sound, a video; every audio start opens a sound."""
    starts = (ids[:-1] == config.vision_start_token_id).nonzero().squeeze(-1)
    after = ids[starts + 1]
    images = int((after == config.image_token_id).sum())
    videos = int(((after == config.video_token_id) | (after == config.audio_start_token_id)).sum())
    return images, videos, int((ids == config.audio_start_token_id).sum())


def prompt_positions(rope_module: torch.nn.Module, inputs: dict, heard: torch.Tensor) -> tuple:
    """Multimodal RoPE positions [3, B, P] and offsets [B, 1] of left-padded prompts,
    each computed with its own ``use_audio_in_video`` flag (``heard`` [B]).

    ``rope_module`` is the module whose ``get_rope_index`` the model calls.
    """
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    grids = {k: inputs.get(k) for k in ("image_grid_thw", "video_grid_thw", "video_second_per_grid")}
    lengths = inputs["feature_attention_mask"].sum(-1) if "feature_attention_mask" in inputs else None
    positions, deltas = [], []
    image = video = audio = 0
    for b in range(ids.shape[0]):
        n_images, n_videos, n_audios = _counts(ids[b][mask[b].bool()], rope_module.config)

        def take(key, start, n):
            return grids[key][start : start + n] if n else None

        pos, delta = rope_module.get_rope_index(
            ids[b : b + 1],
            take("image_grid_thw", image, n_images),
            take("video_grid_thw", video, n_videos),
            mask[b : b + 1],
            bool(heard[b]),
            lengths[audio : audio + n_audios] if n_audios else None,
            take("video_second_per_grid", video, n_videos),
        )
        positions.append(pos)
        deltas.append(delta.reshape(1, 1))
        image, video, audio = image + n_images, video + n_videos, audio + n_audios
    return torch.cat(positions, dim=1), torch.cat(deltas).to(ids.device)


def load_thinker(path: str | Path, dtype: torch.dtype, thinker_class: type, empty: bool = False) -> torch.nn.Module:
    """The thinker (a ``thinker_class``) of a released Omni checkpoint, built alone:
    the talker and its vocoder are neither built nor read. ``empty``: built on the meta
    device and nothing read (``omni_rl.models.weights.fill`` fills it once sharded)."""
    from transformers import AutoConfig

    from omni_rl.models.weights import empty_model

    config = AutoConfig.from_pretrained(path, local_files_only=True)
    if empty:
        model = empty_model(thinker_class, config.thinker_config, dtype, Path(path))
    else:
        renaming = {r"^thinker\.": ""}
        model = thinker_class.from_pretrained(
            path,
            config=config.thinker_config,
            key_mapping=renaming,
            dtype=dtype,
            local_files_only=True,
            use_kernels=False,
        )
        # transformers reverts the renamings it loaded with when saving; the thinker saves
        # as a thinker (no "thinker." prefix), so that one is forgotten
        model._weight_conversions = [
            c for c in model._weight_conversions if getattr(c, "source_patterns", None) != list(renaming)
        ]
    model.omni_rl_source = str(Path(path).resolve())
    return model


def write_export_note(model: torch.nn.Module, out: Path) -> None:
    """Beside a saved thinker of a released Omni checkpoint: what the directory holds
    and how to speak with it again."""
    source = getattr(model, "omni_rl_source", None)
    if source is None:
        return
    note = {
        "holds": "the Omni thinker only (text out); the talker and vocoder were not trained or saved",
        "model_type": model.config.model_type,
        "source": source,
        "talker": f"omni-rl attach-talker --thinker {out} --source {source} --out DIR",
    }
    (out / EXPORT_NOTE).write_text(json.dumps(note, indent=2) + "\n")


def attach_talker(thinker_dir: str | Path, source_dir: str | Path, out: str | Path) -> Path:
    """A full ``qwen2_5_omni`` checkpoint under ``out``: the trained thinker of
    ``thinker_dir`` with the talker, vocoder, speakers and processor of the released
    ``source_dir``. Loads with ``Qwen2_5OmniForConditionalGeneration.from_pretrained``."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig

    thinker_dir, source_dir, out = Path(thinker_dir), Path(source_dir), Path(out)
    source_config = AutoConfig.from_pretrained(source_dir, local_files_only=True)
    thinker_config = getattr(source_config, "thinker_config", None)
    if thinker_config is None:
        raise OmniRLError(f"{source_dir}: model_type '{source_config.model_type}' has no thinker and talker")
    thinker_type = json.loads((thinker_dir / "config.json").read_text()).get("model_type")
    if thinker_type != thinker_config.model_type:
        raise OmniRLError(
            f"{thinker_dir}: model_type '{thinker_type}', not the source's thinker ({thinker_config.model_type})"
        )
    tensors = {}  # the whole model in CPU memory once (about 22 GB for the 7B in bf16)
    for shard in sorted(source_dir.glob("*.safetensors")):
        tensors |= {k: v for k, v in load_file(shard).items() if not k.startswith(THINKER_PREFIX)}
    for shard in sorted(thinker_dir.glob("*.safetensors")):
        tensors |= {THINKER_PREFIX + k: v for k, v in load_file(shard).items()}
    out.mkdir(parents=True, exist_ok=True)
    for item in source_dir.iterdir():  # config, processor, tokenizer, speakers: the source's
        if item.is_file() and item.suffix != ".safetensors" and not item.name.endswith(".safetensors.index.json"):
            shutil.copy2(item, out / item.name)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out
