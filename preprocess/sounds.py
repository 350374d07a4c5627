"""Synthetic audio-QA clips with known ground truth.

``write_audio_qa`` renders short WAV clips of sine tones and writes one
multiple-choice row per clip, cycling through four kinds of question whose answers
need the sound: which of two tones is higher, how many beeps there are, whether the
high or the low tone comes first, and whether the second tone is louder or softer
than the first. Answers cycle through every option, so each kind is balanced and
chance is known: 1/2 for the two-option kinds, 1/4 for the count.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from omni_rl.preprocess.synthetic import balanced_choices, choice_row, tone, write_wav

SAMPLE_RATE = 16_000
KINDS = ("higher", "count", "order", "louder")
QUESTIONS = {
    "higher": ("Which tone is higher, the first or the second?", ["first", "second"]),
    "count": ("How many beeps do you hear?", ["1", "2", "3", "4"]),
    "order": ("Which comes first, the high tone or the low tone?", ["high", "low"]),
    "louder": ("Is the second tone louder or softer than the first?", ["louder", "softer"]),
}
# every clip lasts this long (silence after the sound), so that its length, which the
# number of audio tokens follows, tells nothing about the answer
CLIP_SECONDS = 1.6
# log-spaced pitches; "higher" pairs differ by at least two steps (a factor of 1.59)
PITCHES = 300.0 * 1.26 ** np.arange(8)


def _silence(seconds: float) -> np.ndarray:
    return np.zeros(round(seconds * SAMPLE_RATE), dtype=np.float32)


def _faded(seconds: float, hz: float, amplitude: float) -> np.ndarray:
    """A tone with 10 ms ramps, so onsets are clean."""
    wave = tone(seconds, hz=hz, amplitude=amplitude)
    ramp = min(160, wave.size // 2)
    envelope = np.ones_like(wave)
    envelope[:ramp] = np.linspace(0, 1, ramp)
    envelope[-ramp:] = np.linspace(1, 0, ramp)
    return wave * envelope


def _two_tones(first: tuple[float, float], second: tuple[float, float], rng: np.random.Generator) -> np.ndarray:
    """Two 0.4 s tones, (hz, amplitude) each, with a short random lead-in and gap."""
    return np.concatenate(
        [
            _silence(rng.uniform(0.05, 0.2)),
            _faded(0.4, *first),
            _silence(rng.uniform(0.15, 0.3)),
            _faded(0.4, *second),
        ]
    )


def clip(kind: str, answer: int, rng: np.random.Generator) -> np.ndarray:
    """The waveform of one question of ``kind`` whose correct option is ``answer``,
    ``CLIP_SECONDS`` long."""
    sound = _sound(kind, answer, rng)
    return np.concatenate([sound, _silence(CLIP_SECONDS - sound.size / SAMPLE_RATE)])


def _sound(kind: str, answer: int, rng: np.random.Generator) -> np.ndarray:
    amplitude = rng.uniform(0.15, 0.4)
    if kind == "higher":
        low = int(rng.integers(0, len(PITCHES) - 2))
        high = int(rng.integers(low + 2, len(PITCHES)))
        pair = [(PITCHES[high], amplitude), (PITCHES[low], amplitude)]
        return _two_tones(*(pair if answer == 0 else pair[::-1]), rng)
    if kind == "count":
        parts = [_silence(rng.uniform(0.05, 0.15))]
        for _ in range(answer + 1):
            parts += [_faded(0.12, 1000.0, amplitude), _silence(rng.uniform(0.12, 0.2))]
        return np.concatenate(parts)
    if kind == "order":
        pair = [(1760.0, amplitude), (220.0, amplitude)]
        return _two_tones(*(pair if answer == 0 else pair[::-1]), rng)
    hz = float(rng.choice(PITCHES))
    quiet, loud = amplitude / 8, amplitude
    return _two_tones((hz, quiet), (hz, loud), rng) if answer == 0 else _two_tones((hz, loud), (hz, quiet), rng)


def write_audio_qa(out: str | Path, clips: int, seed: int = 0, silent: bool = False) -> Path:
    """Render ``clips`` WAVs under ``out/media`` and write ``out/data.jsonl`` (one
    multiple-choice row per clip; kinds and answers cycle so both are balanced).
    Returns the dataset path.

    ``silent`` writes the same rows over silence of the same length: a control showing
    how much of a model's accuracy needs the sound.
    """
    out = Path(out)
    rng = np.random.default_rng(seed)
    rows = []
    for i, kind, question, options, answer in balanced_choices(clips, KINDS, QUESTIONS):
        wave = clip(kind, answer, rng)
        name = f"media/clip_{i:05d}.wav"
        write_wav(out / name, np.zeros_like(wave) if silent else wave)
        rows.append(choice_row(f"clip{i:05d}-{kind}", question, options, answer, "audios", name, f"audio_{kind}"))
    (out / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out / "data.jsonl"
