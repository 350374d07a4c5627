"""The media section (``media:``: decoding, sampling, resizing budgets) and the
``preprocess`` recipe's root config, read by ``omni-rl preprocess``, ``eval``,
``rewards check`` and ``cache gc``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from omni_rl.config import require
from omni_rl.models.config import require_family
from omni_rl.rewards.config import RewardsConfig


@dataclass
class MediaConfig:
    """How media are decoded, sampled and resized (qwen-vl-utils' rules), and where they
    may live. Every field that changes the output is part of the cache key; unset pixel
    budgets take qwen-vl-utils' defaults for the family's patch size."""

    family: str = "qwen2_5_vl"
    """Model family; fixes the patch size (14 for Qwen2/2.5-VL and Omni, 16 for Qwen3-VL)."""
    fps: float | None = 2.0
    """Frames sampled per second of video (unset: use ``nframes``)."""
    nframes: int | None = None
    """A fixed number of frames per video instead of ``fps``."""
    min_frames: int = 4
    """Fewest frames sampled by ``fps``."""
    max_frames: int = 768
    """Most frames sampled by ``fps``."""
    video_min_pixels: int | None = None
    """Smallest frame area after resizing."""
    video_max_pixels: int | None = None
    """Largest frame area after resizing."""
    video_total_pixels: int | None = None
    """Budget over all frames of a video; caps each frame's area at total / frames * 2."""
    image_min_pixels: int | None = None
    """Smallest image area after resizing."""
    image_max_pixels: int | None = None
    """Largest image area after resizing."""
    max_audio_seconds: float = 30.0
    """Audio is cut to this length: 30 s is Qwen2-Audio's window, Qwen2.5-Omni's is
    300 s (25 audio tokens a second in both); a clip or a heard video's sound that goes
    on past it is counted in data/audio_cut, the first logged."""
    use_audio_in_video: bool = False
    """Also decode each video's own audio track, heard with its frames (Omni models);
    a row can ask for it alone with ``"use_audio_in_video": true``."""
    missing_video_audio: Literal["skip", "video_only"] = "skip"
    """A row that asks for a video's sound when the video has none: ``skip`` reports
    and skips the row; ``video_only`` reports it and uses the video without sound."""
    media_root: str | None = None
    """The only directory absolute media paths may point into."""

    def __post_init__(self):
        require_family(self.family, "family")
        require(self.fps is not None or self.nframes is not None, "fps", "set fps or nframes")
        require(self.fps is None or self.nframes is None, "nframes", "set fps or nframes, not both")
        require(self.fps is None or self.fps > 0, "fps", "must be > 0")
        require(self.nframes is None or self.nframes >= 2, "nframes", "must be >= 2")
        require(2 <= self.min_frames <= self.max_frames, "min_frames", "need 2 <= min_frames <= max_frames")
        require(self.max_audio_seconds > 0, "max_audio_seconds", "must be > 0")
        require(self.missing_video_audio in ("skip", "video_only"), "missing_video_audio", "must be skip or video_only")
        from omni_rl.models.families import FAMILIES

        hears = {"video", "audio"} <= set(FAMILIES.get(self.family).modalities)
        require(
            not self.use_audio_in_video or hears,
            "use_audio_in_video",
            f"family '{self.family}' does not hear a video's sound; an Omni family does",
        )
        for name in (
            "video_min_pixels",
            "video_max_pixels",
            "video_total_pixels",
            "image_min_pixels",
            "image_max_pixels",
        ):
            value = getattr(self, name)
            require(value is None or value > 0, name, "must be > 0")
        for kind in ("video", "image"):
            low, high = getattr(self, f"{kind}_min_pixels"), getattr(self, f"{kind}_max_pixels")
            require(low is None or high is None or low <= high, f"{kind}_max_pixels", f"must be >= {kind}_min_pixels")


@dataclass
class PreprocessConfig:
    """Offline caching of a dataset's media (``omni-rl preprocess``)."""

    media: MediaConfig = field(default_factory=MediaConfig)
    """Decoding, sampling and resizing parameters."""
    rewards: RewardsConfig = field(default_factory=RewardsConfig)
    """Scoring, for checking that every row's problem type and answer can be scored."""
