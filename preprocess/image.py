"""Image decoding and resizing by qwen-vl-utils' rules (``fetch_image``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError
from qwen_vl_utils import vision_process as qvu

from omni_rl.errors import OmniRLError

RGB_RULES = 2
"""The version of ``to_rgb``'s rules, in the cache key (2: every kind of transparency
over white, 16-bit grey scaled; 1 put only RGBA over white and clipped 16-bit grey)."""


@dataclass(frozen=True)
class ImageBudget:
    """Resolved pixel budget for images of one family."""

    patch_size: int = 14
    min_pixels: int | None = None
    max_pixels: int | None = None

    @property
    def factor(self) -> int:
        return self.patch_size * qvu.SPATIAL_MERGE_SIZE

    def key(self) -> dict:
        """What changes the images: the fields, the qwen-vl-utils limits that unset
        fields fall back to, and the version of ``to_rgb``'s rules."""
        limits = ("IMAGE_MIN_TOKEN_NUM", "IMAGE_MAX_TOKEN_NUM", "SPATIAL_MERGE_SIZE")
        return {**asdict(self), "qwen_vl_utils": {name: getattr(qvu, name) for name in limits}, "rgb": RGB_RULES}

    def pixels(self) -> tuple[int, int]:
        """(min, max) area; unset values are qwen-vl-utils' defaults for the factor."""
        f2 = self.factor**2
        return (
            self.min_pixels if self.min_pixels is not None else qvu.IMAGE_MIN_TOKEN_NUM * f2,
            self.max_pixels if self.max_pixels is not None else qvu.IMAGE_MAX_TOKEN_NUM * f2,
        )


@dataclass(frozen=True)
class DecodedImage:
    """uint8 [H, W, 3] RGB pixels resized to the budget, and the source size (h, w)."""

    pixels: np.ndarray
    original_size: tuple[int, int]


def smart_size(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """qwen-vl-utils' ``smart_resize`` with each side at least ``factor``: where
    ``max_pixels`` binds on an image wider (or taller) than ``max_pixels / factor**2``
    to 1, it floors the short side to 0, and transformers' Qwen processors keep one
    patch row there (a 40x6000 image under 128 x 28 x 28 pixels: 28 x 3864)."""
    new_h, new_w = qvu.smart_resize(height, width, factor=factor, min_pixels=min_pixels, max_pixels=max_pixels)
    return max(factor, new_h), max(factor, new_w)


def to_rgb(image: Image.Image, path: Path) -> Image.Image:
    """RGB pixels of ``image``: any transparency (an alpha band, a palette's transparent
    entry) over white, as qwen-vl-utils puts RGBA and transformers' ``convert_to_rgb``
    every mode; 16-bit grey scaled to 8 bits (Pillow clips it). Samples of 32 bits
    (modes I and F) have no range to scale by: refused."""
    if image.mode in ("I", "F"):
        raise OmniRLError(f"{path}: an image of 32-bit samples (mode {image.mode}); convert it to 8 or 16 bits")
    if image.mode.startswith("I;16"):
        grey = (np.asarray(image).astype(np.uint32) * 255 + 32767) // 65535
        image = Image.fromarray(grey.astype(np.uint8))
    if image.mode != "RGBA" and ("A" in image.getbands() or "transparency" in image.info):
        image = image.convert("RGBA")
    return qvu.to_rgb(image)


def read_image(path: str | Path, budget: ImageBudget | None = None) -> DecodedImage:
    """Open an image, apply its EXIF orientation, convert to RGB (``to_rgb``) and resize
    under the budget with PIL's bicubic filter."""
    budget = budget or ImageBudget()
    path = Path(path)
    if not path.is_file():
        raise OmniRLError(f"{path}: no such image file")
    try:
        with Image.open(path) as opened:
            image = to_rgb(ImageOps.exif_transpose(opened), path)
    except (UnidentifiedImageError, Image.DecompressionBombError, OSError, ValueError, SyntaxError, EOFError) as err:
        # SyntaxError: Pillow's PNG reader on a broken chunk
        raise OmniRLError(f"{path}: cannot decode image ({err})") from None
    width, height = image.size
    min_pixels, max_pixels = budget.pixels()
    try:
        new_h, new_w = smart_size(height, width, budget.factor, min_pixels, max_pixels)
    except ValueError as err:
        raise OmniRLError(f"{path}: cannot resize {width}x{height} image: {err}") from None
    resized = image.resize((new_w, new_h), Image.Resampling.BICUBIC)
    return DecodedImage(np.asarray(resized, dtype=np.uint8).copy(), (height, width))
