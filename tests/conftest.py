"""Shared fixtures: pinned torch threads and tiny checkpoints built once per session."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("OMNI_RL_THREADS", "2")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from omni_rl.runtime import AVX2_KERNELS, set_threads

set_threads()


@pytest.fixture(autouse=True)
def _no_inherited_kernel_pins():
    """A quickstart run in this process pins the CPU kernels of the processes it starts
    through the environment; later tests start theirs as the session began."""
    yield
    for name in AVX2_KERNELS:
        if name in _KERNEL_ENV:
            os.environ[name] = _KERNEL_ENV[name]
        else:
            os.environ.pop(name, None)


_KERNEL_ENV = {name: os.environ[name] for name in AVX2_KERNELS if name in os.environ}


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """``tiny_checkpoint(family)`` -> directory of a seed-0 tiny model, built once."""
    from omni_rl.models import build_tiny

    built: dict[str, object] = {}

    def get(family: str):
        if family not in built:
            built[family] = build_tiny(family, tmp_path_factory.mktemp(family), seed=0)
        return built[family]

    return get


@pytest.fixture(scope="session")
def family_prompts(tmp_path_factory):
    """``family_prompts(family, processor)`` -> two encoded prompts with the family's media
    (different clips and questions, so different lengths and left padding)."""
    import numpy as np

    from omni_rl.models import FAMILIES
    from omni_rl.models.inputs import encode_prompts
    from omni_rl.preprocess.image import ImageBudget, read_image
    from omni_rl.preprocess.synthetic import moving_square, tone, write_image, write_video
    from omni_rl.preprocess.video import VideoBudget, read_video

    root = tmp_path_factory.mktemp("prompts")
    write_video(root / "a.mp4", moving_square("up", 2.0, 10, 96, 64), 10)
    write_video(root / "b.mp4", moving_square("left", 3.0, 10, 64, 96), 10)
    write_image(root / "i.png", np.random.default_rng(0).integers(0, 255, (60, 90, 3), dtype=np.uint8))

    def build(family: str, processor, only: int | None = None):
        spec = FAMILIES.get(family)
        patch = spec.patch_size or 14
        f2 = (2 * patch) ** 2
        conversations, media = [], {"images": [], "videos": [], "audios": []}
        for i, question in enumerate(["Which way?", "What moves in this clip, and where does it go?"]):
            content = []
            if "video" in spec.modalities and family != "qwen2_5_omni_thinker":
                content.append({"type": "video"})
                clip = root / ("a.mp4" if i == 0 else "b.mp4")
                media["videos"].append(
                    read_video(clip, VideoBudget(patch_size=patch, min_pixels=4 * f2, max_pixels=8 * f2))
                )
            elif "image" in spec.modalities:
                content.append({"type": "image"})
                media["images"].append(
                    read_image(root / "i.png", ImageBudget(patch_size=patch, max_pixels=16 * f2)).pixels
                )
            if "audio" in spec.modalities:
                content.append({"type": "audio"})
                media["audios"].append(tone(1.0 + i, hz=300.0 * (i + 1)))
            content.append({"type": "text", "text": question})
            conversations.append([{"role": "user", "content": content}])
        if only is not None:
            conversations = conversations[only : only + 1]
            media = {k: v[only : only + 1] for k, v in media.items()}
        return encode_prompts(processor, conversations, **media)

    return build
