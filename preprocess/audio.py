"""Audio decoding to mono float32 at 16 kHz with FFmpeg's resampler (PyAV).

torchaudio and torchcodec wheels are CUDA builds that fail to load on CPU-only
machines, so PyAV does the decoding and resampling everywhere.

Any channel layout (mono, stereo, 5.1, ...) is mixed down to mono, the mean of its
channels, and any rate resampled to 16 kHz. Bad samples are normalized and reported,
never passed on: NaN and infinite samples become silence, samples beyond full scale
are clipped, and a clip shorter than ``MIN_SECONDS`` is padded with silence so that
the audio encoders get at least one frame to pool.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from omni_rl.errors import OmniRLError

SAMPLE_RATE = 16_000
MIN_SECONDS = 0.05
# sound past max_seconds that does not count as cut: AAC's priming and end padding
# (two 1024-sample frames: 0.13 s at 16 kHz), a resampler's tail
CUT_TOLERANCE_SECONDS = 0.25

log = logging.getLogger(__name__)


class NoAudioStream(OmniRLError):
    """The file has no audio stream (a silent video)."""


@dataclass(frozen=True)
class Sound:
    """A decoded audio stream.

    Attributes:
        wave: mono float32 [N] at the decoder's sample rate, at most ``max_seconds`` long.
        cut: the stream goes on past ``max_seconds`` (by more than
            ``CUT_TOLERANCE_SECONDS``): that part was not decoded and is not in ``wave``.
    """

    wave: np.ndarray
    cut: bool


def read_audio(path: str | Path, max_seconds: float = 30.0, sample_rate: int = SAMPLE_RATE) -> np.ndarray:
    """The waveform of ``decode_audio`` (see there)."""
    return decode_audio(path, max_seconds, sample_rate).wave


def decode_audio(
    path: str | Path, max_seconds: float = 30.0, sample_rate: int = SAMPLE_RATE, *, from_video_start: bool = False
) -> Sound:
    """The first audio stream of ``path`` (an audio file or a video's own track) as a
    mono float32 [N] waveform at ``sample_rate``, cut to ``max_seconds``, and whether
    the stream was longer (decoding stops there: a 3-hour file costs what 30 s do).

    With ``from_video_start`` the wave's first sample stands for the video stream's
    first frame, the timeline the frames' timestamps are on: a track that starts later
    is preceded by that much silence, sound before the first frame is dropped. Without
    it (an audio item) the wave starts at the track's first sample.

    Raises:
        OmniRLError: naming the file, when it has no decodable audio.
    """
    import av

    path = Path(path)
    if not path.is_file():
        raise OmniRLError(f"{path}: no such audio file")
    limit = int(max_seconds * sample_rate)
    chunks, have, past = [], 0, 0.0
    try:
        with av.open(str(path)) as container:
            if not container.streams.audio:
                raise NoAudioStream(f"{path}: no audio stream")
            stream = container.streams.audio[0]
            # the channels kept through the resampler, then averaged (as librosa's mono
            # reading, which the Qwen audio models' own loaders use): FFmpeg's downmix to
            # mono sums them at 0.707 each, 3 dB hot for stereo and clipping for 5.1
            resampler = av.AudioResampler(format="fltp", layout=None, rate=sample_rate)
            video_start = _video_start(container) if from_video_start else None
            frames = container.decode(stream)
            skip = 0  # samples still to drop: sound before the video's first frame
            for i, frame in enumerate(frames):
                if i == 0 and video_start is not None:
                    lead = round(((frame.time or 0.0) - video_start) * sample_rate)  # > 0: silence first
                    chunks.append(np.zeros(max(lead, 0), np.float32))
                    have, skip = chunks[-1].size, max(-lead, 0)
                for out in resampler.resample(frame):
                    chunk = out.to_ndarray().mean(axis=0)
                    chunks.append(chunk[skip:])
                    skip -= min(skip, chunk.size)
                    have += chunks[-1].size
                if have >= limit:
                    break
            else:
                for out in resampler.resample(None):  # flush the resampler's delay line
                    chunks.append(out.to_ndarray().mean(axis=0))
                    have += chunks[-1].size
            # how far the stream goes on past the limit, looked at only as far as it takes to tell
            past = max(have - limit, 0) / sample_rate
            for frame in frames:
                if past > CUT_TOLERANCE_SECONDS:
                    break
                past += frame.samples / frame.sample_rate
    except OmniRLError:
        raise
    except Exception as err:  # noqa: BLE001 - FFmpeg reports bad files through many error types
        raise OmniRLError(f"{path}: cannot decode audio ({err})") from None
    if not chunks:
        raise OmniRLError(f"{path}: no audio samples decoded")
    wave = np.concatenate(chunks).astype(np.float32)[:limit]
    return Sound(normalize(wave, path, sample_rate), cut=past > CUT_TOLERANCE_SECONDS)


def _video_start(container) -> float | None:
    """Seconds of the first video frame on the file's timeline (0 when the stream does
    not say), or None for a file without video."""
    if not container.streams.video:
        return None
    video = container.streams.video[0]
    return float(video.start_time * video.time_base) if video.start_time is not None else 0.0


def normalize(wave: np.ndarray, path: str | Path, sample_rate: int = SAMPLE_RATE) -> np.ndarray:
    """``wave`` (float32 [N], changed in place) with NaN and infinite samples silenced,
    samples clipped to [-1, 1] and, if shorter than ``MIN_SECONDS``, silence appended;
    each change is logged with the file's name."""
    bad = ~np.isfinite(wave)
    if bad.any():
        log.warning("%s: %d NaN or infinite audio samples set to 0", path, int(bad.sum()))
        wave[bad] = 0.0
    loud = np.abs(wave) > 1.0
    if loud.any():
        log.warning("%s: %d audio samples beyond full scale clipped to [-1, 1]", path, int(loud.sum()))
        np.clip(wave, -1.0, 1.0, out=wave)
    shortest = round(MIN_SECONDS * sample_rate)
    if wave.size < shortest:
        log.warning("%s: %.3f s of audio padded with silence to %.2f s", path, wave.size / sample_rate, MIN_SECONDS)
        wave = np.concatenate([wave, np.zeros(shortest - wave.size, np.float32)])
    return np.ascontiguousarray(wave)
