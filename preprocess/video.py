"""Video decoding, frame sampling and resizing by qwen-vl-utils' rules.

decord decodes H.264 about twice as fast as PyAV on CPUs, with identical frames; PyAV
is the fallback where decord is missing or fails on a file. transformers' own
path-based video loading needs torchcodec, which does not load on CPU-only machines,
so frames are decoded here and handed to the processors as arrays, already resized
(the processors are called with ``do_resize=False``).

The frame count (``smart_nframes``), the evenly spread indices and the per-frame pixel
budget (``smart_resize`` under min / max / total pixels) follow qwen-vl-utils'
``fetch_video``; the resize is the same bicubic antialiased torchvision call, rounded
to uint8 so that frames can be cached exactly.

Frames are spread evenly in time, not in decode order. qwen-vl-utils keeps frame
``i`` for each evenly spread index ``i``, and the processors place it at ``i / fps``:
right for a constant frame rate, but in a variable-rate video (phone recordings,
screen captures) frame ``i`` may show seconds away from that time. Here index ``i``
keeps the frame shown nearest ``i / fps`` (``frames_at``), with ``fps`` the container's
where the frames keep to it and otherwise their mean rate over their span
(``frame_rate``), so the time the model is told is the time of the frame it sees. At a
constant rate the container states, that is frame ``i`` itself, the frame qwen-vl-utils
keeps.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from qwen_vl_utils import vision_process as qvu
from torchvision.transforms import InterpolationMode
from torchvision.transforms import functional as tvf

from omni_rl.errors import OmniRLError
from omni_rl.preprocess.image import smart_size

FRAME_FACTOR = qvu.FRAME_FACTOR  # frames come in pairs: the temporal patch is 2

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class VideoBudget:
    """Resolved sampling and pixel budget of one family (see ``MediaConfig``)."""

    patch_size: int = 14
    fps: float | None = 2.0
    nframes: int | None = None
    min_frames: int = qvu.FPS_MIN_FRAMES
    max_frames: int = qvu.FPS_MAX_FRAMES
    min_pixels: int | None = None
    max_pixels: int | None = None
    total_pixels: int | None = None

    @property
    def factor(self) -> int:
        """Side of one merged vision token in pixels (patch size x spatial merge 2)."""
        return self.patch_size * qvu.SPATIAL_MERGE_SIZE

    def key(self) -> dict:
        """What changes the frames: the fields, the qwen-vl-utils limits that unset
        fields fall back to (MODEL_SEQ_LEN comes from the environment), and the rule
        that picks a frame for each index (``frames_at``)."""
        limits = ("MODEL_SEQ_LEN", "VIDEO_MIN_TOKEN_NUM", "VIDEO_MAX_TOKEN_NUM", "SPATIAL_MERGE_SIZE", "FRAME_FACTOR")
        return {
            **asdict(self),
            "qwen_vl_utils": {name: getattr(qvu, name) for name in limits},
            "frames": "shown nearest an even time grid",
        }

    def frame_pixels(self, nframes: int) -> tuple[int, int]:
        """(min, max) area of each of ``nframes`` frames, as ``fetch_video`` computes it."""
        f2 = self.factor**2
        min_pixels = self.min_pixels if self.min_pixels is not None else qvu.VIDEO_MIN_TOKEN_NUM * f2
        total = self.total_pixels if self.total_pixels is not None else qvu.MODEL_SEQ_LEN * f2 * 0.9
        cap = max(min(qvu.VIDEO_MAX_TOKEN_NUM * f2, total / nframes * FRAME_FACTOR), int(min_pixels * 1.05))
        max_pixels = min(self.max_pixels, cap) if self.max_pixels is not None else cap
        if max_pixels < min_pixels:
            raise OmniRLError(f"video max pixels per frame ({max_pixels}) is below video_min_pixels ({min_pixels})")
        return min_pixels, max_pixels


@dataclass(frozen=True)
class VideoClip:
    """Sampled, resized frames and where they came from.

    Attributes:
        frames: uint8 [T, 3, H, W] RGB frames, resized to the budget; channels first, the
            layout torchvision resizes in and the processors take without a copy.
        fps: the source's frame rate, as the processors are told it (``frame_rate``).
        total_frames: frames in the source.
        indices: grid index of each sampled frame, [T]: the frame shown nearest time
            ``index / fps`` (the source's frame ``index`` at a constant frame rate).
        original_size: (height, width) of the source.
        backend: 'decord' or 'pyav'.
    """

    frames: np.ndarray
    fps: float
    total_frames: int
    indices: list[int]
    original_size: tuple[int, int]
    backend: str = field(default="decord", compare=False)

    @property
    def timestamps(self) -> list[float]:
        """Seconds from the first frame of each sampled frame, as the processors place
        them (each kept frame is the one shown nearest its time)."""
        return [i / self.fps for i in self.indices]

    @property
    def sampled_fps(self) -> float:
        """Frames kept per second of the source."""
        return len(self.indices) / self.total_frames * self.fps

    def metadata(self) -> dict:
        """The transformers ``VideoMetadata`` fields for the processor (sampled fps,
        timestamps and temporal positions follow from them)."""
        return {
            "total_num_frames": self.total_frames,
            "fps": self.fps,
            "frames_indices": list(self.indices),
            "height": int(self.frames.shape[2]),
            "width": int(self.frames.shape[3]),
            "duration": self.total_frames / self.fps,
        }


def sample_indices(total_frames: int, fps: float, budget: VideoBudget) -> list[int]:
    """Source frame indices to keep: qwen-vl-utils' frame count spread evenly."""
    spec: dict = {"min_frames": budget.min_frames, "max_frames": min(budget.max_frames, total_frames)}
    spec |= {"nframes": budget.nframes} if budget.nframes is not None else {"fps": budget.fps}
    try:
        n = qvu.smart_nframes(spec, total_frames=total_frames, video_fps=fps)
    except (ValueError, ZeroDivisionError) as err:
        raise OmniRLError(f"cannot sample frames from a {total_frames}-frame video: {err}") from None
    return torch.linspace(0, total_frames - 1, n).round().long().tolist()


def rising(times: Sequence[float | None]) -> bool:
    """Whether frame times can place the frames: two or more, all known, each later
    than the one before."""
    return len(times) > 1 and None not in times and bool(np.all(np.diff(np.asarray(times, dtype=np.float64)) > 0))


def frame_rate(times: Sequence[float], fps: float) -> float:
    """The frame rate the processors are told: ``fps``, the container's, where every
    frame shows within half a frame of ``t[0] + i / fps``; otherwise (a variable rate,
    or a container that states another) the frames' mean rate over their span, so that
    index ``n - 1`` is the last frame's time."""
    t = np.asarray(times, dtype=np.float64) - times[0]
    if np.all(np.abs(t - np.arange(len(t)) / fps) < 0.5 / fps):
        return fps
    return float((len(t) - 1) / t[-1])  # a Python float, as a cached entry reads back


def frames_at(times: Sequence[float], grid: list[int], fps: float) -> list[int]:
    """For each index ``i`` of ``grid``, the source frame shown nearest ``t[0] + i /
    fps``, the time the processors place it at (ties: the earlier frame). ``times``:
    each frame's presentation time, rising. At a constant rate that ``fps`` states,
    frame ``i`` itself."""
    t = np.asarray(times, dtype=np.float64)
    wanted = t[0] + np.asarray(grid, dtype=np.float64) / fps
    after = np.clip(np.searchsorted(t, wanted), 1, len(t) - 1)
    nearer_before = wanted - t[after - 1] <= t[after] - wanted
    return np.where(nearer_before, after - 1, after).tolist()


def sample_frames(
    path: Path, count: int, times: Sequence[float | None] | None, fps: float, budget: VideoBudget
) -> tuple[float, list[int], list[int]]:
    """(the frame rate told, the grid indices, the source frames to keep) of ``count``
    frames shown at ``times``. Times that do not rise (missing, broken) cannot place
    the frames: the indices are then kept in decode order at the container's ``fps``
    (qwen-vl-utils' rule), and the log says so."""
    if times is None or not rising(times):
        log.warning("%s: the frame times do not rise, so frames are sampled in decode order", path)
        indices = sample_indices(count, fps, budget)
        return fps, indices, indices
    fps = frame_rate(times, fps)
    indices = sample_indices(count, fps, budget)
    return fps, indices, frames_at(times, indices, fps)


def resized_size(height: int, width: int, nframes: int, budget: VideoBudget) -> tuple[int, int]:
    """(height, width) of each frame after ``smart_resize`` under the budget."""
    min_pixels, max_pixels = budget.frame_pixels(nframes)
    try:
        return smart_size(height, width, budget.factor, min_pixels, max_pixels)
    except ValueError as err:  # extreme aspect ratios
        raise OmniRLError(f"cannot resize {width}x{height} frames: {err}") from None


def resize_frames(frames: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """uint8 [T, H, W, 3] (as decoded) -> uint8 [T, 3, h, w], bicubic with antialiasing.

    Resizing uint8 input returns uint8 already rounded and clamped by torchvision.
    """
    video = torch.from_numpy(frames).permute(0, 3, 1, 2)
    if tuple(video.shape[-2:]) != tuple(size):
        video = tvf.resize(video, list(size), interpolation=InterpolationMode.BICUBIC, antialias=True)
    return np.ascontiguousarray(video.numpy())


def _decode_decord(path: Path, budget: VideoBudget) -> tuple[np.ndarray, float, int, list[int]]:
    import decord

    reader = decord.VideoReader(str(path), num_threads=1)
    total = len(reader)
    times = reader.get_frame_timestamp(list(range(total)))[:, 0].tolist()
    hidden = sum(t < 0 for t in times)
    if hidden:  # decord counts them, but its frames are the shown ones: counts and indices would slip
        raise OmniRLError(f"{hidden} frames lie before the start (an edit list hides them)")
    fps, indices, shown = sample_frames(path, total, times, float(reader.get_avg_fps()), budget)
    return reader.get_batch(shown).asnumpy(), fps, total, indices


def keep_frames(frames: Iterable, indices: list[int]) -> tuple[list[np.ndarray], list[float | None]]:
    """The frames at ``indices`` as uint8 RGB [H, W, 3] arrays, and the presentation
    time of every frame ``frames`` yielded. Only the kept frames are converted and held
    in memory.

    Args:
        frames: decoded frames in order (objects with ``to_ndarray(format=...)`` and
            ``time``).
        indices: ordinals of the frames to keep.
    """
    wanted = set(indices)
    kept: dict[int, np.ndarray] = {}
    times: list[float | None] = []
    for frame in frames:
        if len(times) in wanted:
            kept[len(times)] = frame.to_ndarray(format="rgb24")
        times.append(frame.time)
    return [kept[i] for i in indices if i in kept], times


def _pyav_sampled(path: Path, indices: list[int]) -> tuple[list[np.ndarray], list[float | None]]:
    import av

    with av.open(str(path)) as container:
        return keep_frames(container.decode(container.streams.video[0]), indices)


def _decode_pyav(path: Path, budget: VideoBudget) -> tuple[np.ndarray, float, int, list[int]]:
    """Sample by the packets' count and times, decoding once and keeping only the
    sampled frames.

    No seeking: a frame is found by its ordinal in presentation order, as decord counts
    it, and a seek lands on a keyframe whose ordinal is known only through timestamps,
    which variable frame rates break. Where the packets were not one frame each, the
    frames are sampled again from the decoded frames' count and times in a second pass.
    """
    import av

    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        fps, time_base = float(stream.average_rate or stream.guessed_rate), stream.time_base
        pts = [packet.pts for packet in container.demux(stream) if packet.size]
    if not pts:
        raise OmniRLError("no frames decoded")
    # packets come in decode order; sorted, their times are the frames' in presentation order
    times = None if None in pts else [float(p * time_base) for p in sorted(pts)]
    told, indices, shown = sample_frames(path, len(pts), times, fps, budget)
    frames, decoded = _pyav_sampled(path, shown)
    if len(decoded) != len(pts):
        if not decoded:
            raise OmniRLError("no frames decoded")
        told, indices, shown = sample_frames(path, len(decoded), decoded, fps, budget)
        frames, _ = _pyav_sampled(path, shown)
    return np.stack(frames), told, len(decoded), indices


DECODERS = {"decord": _decode_decord, "pyav": _decode_pyav}


def read_video(path: str | Path, budget: VideoBudget | None = None, backends=("decord", "pyav")) -> VideoClip:
    """Decode, sample and resize the frames of ``path`` (decord, PyAV fallback).

    Raises:
        OmniRLError: naming the file, when no backend can decode it.
    """
    budget = budget or VideoBudget()
    path = Path(path)
    if not path.is_file():
        raise OmniRLError(f"{path}: no such video file")
    errors, failed = [], []
    for name in backends:
        try:
            frames, fps, total, indices = DECODERS[name](path, budget)
        except ImportError as err:
            errors.append(f"{name}: not installed ({err})")
            continue
        except Exception as err:  # noqa: BLE001 - each backend fails in its own way on bad files
            errors.append(f"{name}: {err}")
            failed.append(errors[-1])
            continue
        if failed:
            log.warning("%s: decoded by %s (%s)", path, name, "; ".join(failed))
        height, width = frames.shape[1:3]
        try:
            size = resized_size(height, width, len(indices), budget)
        except OmniRLError as err:
            raise OmniRLError(f"{path}: {err}") from None
        return VideoClip(resize_frames(frames, size), fps, total, indices, (height, width), name)
    raise OmniRLError(f"{path}: cannot decode video ({'; '.join(errors)})")
