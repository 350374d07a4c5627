"""Audio decoding to mono float32 at 16 kHz with FFmpeg's resampler (PyAV).

torchaudio and torchcodec wheels are CUDA builds that fail to load on CPU-only
machines, so PyAV does the decoding and resampling everywhere.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from omni_rl.errors import OmniRLError

SAMPLE_RATE = 16_000


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
                raise OmniRLError(f"{path}: no audio stream")
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
    wave = np.concatenate(chunks).astype(np.float32, copy=False)[:limit]
    return np.ascontiguousarray(wave)
