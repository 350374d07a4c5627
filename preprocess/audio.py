"""Audio decoding to mono float32 at 16 kHz with FFmpeg's resampler (PyAV).

torchaudio and torchcodec wheels are CUDA builds that fail to load on CPU-only
machines, so PyAV does the decoding and resampling everywhere.

Any channel layout (mono, stereo, 5.1, ...) is mixed down to mono and any rate
resampled to 16 kHz. Bad samples are normalized and reported, never passed on:
NaN and infinite samples become silence, samples beyond full scale are clipped, and
a clip shorter than ``MIN_SECONDS`` is padded with silence so that the audio
encoders get at least one frame to pool.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from omni_rl.errors import OmniRLError

SAMPLE_RATE = 16_000
MIN_SECONDS = 0.05

log = logging.getLogger(__name__)


class NoAudioStream(OmniRLError):
    """The file has no audio stream (a silent video)."""


def read_audio(path: str | Path, max_seconds: float = 30.0, sample_rate: int = SAMPLE_RATE) -> np.ndarray:
    """The first audio stream of ``path`` (an audio file or a video's own track) as a
    mono float32 [N] waveform at ``sample_rate``, cut to ``max_seconds``.

    Raises:
        OmniRLError: naming the file, when it has no decodable audio.
    """
    import av

    path = Path(path)
    if not path.is_file():
        raise OmniRLError(f"{path}: no such audio file")
    limit = int(max_seconds * sample_rate)
    chunks, have = [], 0
    try:
        with av.open(str(path)) as container:
            if not container.streams.audio:
                raise NoAudioStream(f"{path}: no audio stream")
            stream = container.streams.audio[0]
            resampler = av.AudioResampler(format="flt", layout="mono", rate=sample_rate)
            for frame in container.decode(stream):
                for out in resampler.resample(frame):
                    chunks.append(out.to_ndarray().reshape(-1))
                    have += chunks[-1].size
                if have >= limit:
                    break
            else:
                for out in resampler.resample(None):  # flush the resampler's delay line
                    chunks.append(out.to_ndarray().reshape(-1))
    except OmniRLError:
        raise
    except Exception as err:  # noqa: BLE001 - FFmpeg reports bad files through many error types
        raise OmniRLError(f"{path}: cannot decode audio ({err})") from None
    if not chunks:
        raise OmniRLError(f"{path}: no audio samples decoded")
    wave = np.concatenate(chunks).astype(np.float32)[:limit]
    return normalize(wave, path, sample_rate)


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
