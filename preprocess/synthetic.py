"""Synthetic media with known ground truth, for tests, benchmarks and demos."""

from __future__ import annotations

from collections.abc import Sequence
from fractions import Fraction
from pathlib import Path

import numpy as np

MILLISECOND = Fraction(1, 1000)
DIRECTIONS = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}


def moving_square(
    direction: str, seconds: float, fps: int, width: int, height: int, color=(230, 40, 40), background=(20, 20, 60)
) -> np.ndarray:
    """Frames of a square crossing the frame in ``direction``: uint8 [T, H, W, 3].

    The square travels from one side's quarter line to the other's, so its motion is
    visible in any two frames sampled far enough apart.
    """
    dx, dy = DIRECTIONS[direction]
    n = max(2, round(seconds * fps))
    side = max(4, min(width, height) // 5)
    frames = np.empty((n, height, width, 3), dtype=np.uint8)
    frames[:] = np.asarray(background, dtype=np.uint8)
    cx0, cy0 = (width - side) / 2, (height - side) / 2
    for t in range(n):
        progress = t / (n - 1) - 0.5  # -0.5 .. 0.5
        x = round(cx0 + dx * progress * width / 2)
        y = round(cy0 + dy * progress * height / 2)
        frames[t, y : y + side, x : x + side] = np.asarray(color, dtype=np.uint8)
    return frames


# BT.601 limited range, the matrix H.264 decoders assume for video without colour tags
_YUV = np.array([[65.481, 128.553, 24.966], [-37.797, -74.203, 112.0], [112.0, -93.786, -18.214]]) / 255
_YUV_OFFSET = np.array([16.0, 128.0, 128.0])


def yuv420(frame: np.ndarray) -> np.ndarray:
    """uint8 RGB [H, W, 3] (H and W even) -> planar YUV 4:2:0 [H * 3 / 2, W] (FFmpeg's
    yuv420p layout): chroma averaged over each 2x2 block. Done here rather than
    by FFmpeg's scaler, so the pixels do not depend on its threads or version."""
    h, w = frame.shape[:2]
    yuv = frame.astype(np.float64) @ _YUV.T + _YUV_OFFSET
    chroma = yuv[..., 1:].reshape(h // 2, 2, w // 2, 2, 2).mean(axis=(1, 3))
    planes = np.concatenate([yuv[..., 0].ravel(), chroma[..., 0].ravel(), chroma[..., 1].ravel()])
    return np.clip(np.rint(planes), 0, 255).astype(np.uint8).reshape(-1, w)


def write_video(
    path: str | Path,
    frames: np.ndarray,
    fps: int,
    crf: int = 0,
    audio: np.ndarray | None = None,
    sample_rate: int = 16_000,
    times: Sequence[float] | None = None,
) -> Path:
    """Encode uint8 [T, H, W, 3] frames as H.264 (yuv420p) in an mp4 (or the container
    ``path``'s suffix names), atomically; with ``audio`` (mono float32 [N]) also an AAC
    track. ``times``: each frame's presentation time in seconds (to the millisecond),
    for a variable frame rate; unset, frame ``i`` shows at ``i / fps``.

    ``crf=0`` (the default) is lossless: the decoded frames are the frames' YUV to the
    bit, however the encoder chose to code them (libx264 does not choose alike from one
    run to the next, so a lossy clip's pixels, and a seeded run on them, would vary)."""
    import av

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{path.suffix or '.mp4'}")
    height, width = frames.shape[1:3]
    with av.open(str(tmp), mode="w") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height = width - width % 2, height - height % 2
        stream.pix_fmt = "yuv420p"
        stream.options = {"crf": str(crf), "preset": "veryfast"}
        if times is not None:
            stream.codec_context.time_base = MILLISECOND
        sound = None
        if audio is not None:
            sound = container.add_stream("aac", rate=sample_rate)
            sound.layout = "mono"
        for i, frame in enumerate(frames):
            image = av.VideoFrame.from_ndarray(yuv420(frame[: stream.height, : stream.width]), format="yuv420p")
            if times is not None:
                image.pts, image.time_base = round(times[i] * 1000), MILLISECOND
            container.mux(stream.encode(image))
        if sound is not None:
            chunk = av.AudioFrame.from_ndarray(audio.astype(np.float32)[None, :], format="flt", layout="mono")
            # a timed first frame: the muxer then writes the edit list that hides the
            # encoder's priming samples (without it the sound is heard 1,024 samples late)
            chunk.sample_rate, chunk.time_base, chunk.pts = sample_rate, Fraction(1, sample_rate), 0
            container.mux(sound.encode(chunk))
            container.mux(sound.encode(None))
        container.mux(stream.encode(None))
    tmp.replace(path)
    return path


def tone(seconds: float, hz: float = 440.0, sample_rate: int = 16_000, amplitude: float = 0.3) -> np.ndarray:
    """A sine tone: float32 [N] in [-amplitude, amplitude]."""
    t = np.arange(round(seconds * sample_rate)) / sample_rate
    return (amplitude * np.sin(2 * np.pi * hz * t)).astype(np.float32)


def write_wav(path: str | Path, wave: np.ndarray, sample_rate: int = 16_000, channels: int = 1) -> Path:
    """Write a float waveform as 16-bit PCM WAV (the mono signal copied to each channel)."""
    import wave as wavefile

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pcm = (np.clip(wave, -1, 1) * 32767).astype("<i2")
    pcm = np.repeat(pcm[:, None], channels, axis=1)
    with wavefile.open(str(path), "wb") as out:
        out.setnchannels(channels)
        out.setsampwidth(2)
        out.setframerate(sample_rate)
        out.writeframes(pcm.tobytes())
    return path


def write_image(path: str | Path, pixels: np.ndarray) -> Path:
    """Write uint8 [H, W, 3] pixels as PNG (or any format PIL infers from the suffix)."""
    from PIL import Image

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels).save(path)
    return path


def balanced_choices(count: int, kinds: tuple[str, ...], questions: dict[str, tuple[str, list[str]]]):
    """Yield ``(index, kind, question, options, answer index)`` for ``count``
    multiple-choice questions: the kinds cycle and, within each kind, so do the answers,
    so both are balanced and chance is known. ``questions``: kind -> (text, options)."""
    for i in range(count):
        kind = kinds[i % len(kinds)]
        question, options = questions[kind]
        yield i, kind, question, options, (i // len(kinds)) % len(options)


def choice_row(row_id: str, question: str, options: list[str], answer: int, media: str, path: str, source: str):
    """A multiple-choice dataset row whose answer is option ``answer``'s letter, with
    one file under ``media`` (``videos``, ``audios``)."""
    return {
        "id": row_id,
        "problem": question,
        "problem_type": "multiple_choice",
        "options": options,
        "answer": "ABCDEFGH"[answer],
        media: [path],
        "data_source": source,
    }
