"""Synthetic video-QA clips whose answers need several frames.

``write_motion_qa`` renders short clips of coloured squares and writes one
multiple-choice row per clip, cycling through four kinds of question that no single
frame answers: which way a square moves, which of two squares flashes first, how many
times a square flashes, and whether a square shows in the first or the second half of
the clip. Each kind has two options and its answers alternate, so each kind is
balanced, chance is 1/2, and the question's wording tells nothing.

Timings are laid out on pairs of frames, the temporal patch of the Qwen-VL vision
towers: a flash covers whole pairs, so the tokens of a pair either show it or do not.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from omni_rl.preprocess.scenes import BACKGROUND, COLORS
from omni_rl.preprocess.synthetic import balanced_choices, choice_row, write_video

KINDS = ("direction", "order", "count", "when")
QUESTIONS = {
    "direction": ("Which way does the square move?", ["left", "right"]),
    "order": ("Which square appears first?", ["red", "blue"]),
    "count": ("How many times does the square flash?", ["1", "2"]),
    "when": ("When does the square show, in the first or the second half?", ["first", "second"]),
}
# a decoy's wording states its answer: a question the text alone answers
TELLS = {
    "direction": "The square moves {}.",
    "order": "The {} square appears first.",
    "count": "The square flashes {} time(s).",
    "when": "The square shows in the {} half.",
}
FRAMES = 16
"""Frames per clip (8 pairs)."""
FPS = 8
SIZE = 56
"""Frame side in pixels: 4 x 4 patches of 14 (2 x 2 tokens after the 2 x 2 merge)."""
SQUARE = 14
"""Square side in pixels."""
# the colours a square of the direction, count and when kinds may have (red and blue
# belong to the order kind's question)
OTHER_COLORS = [c for c in COLORS if c not in ("red", "blue")]


def _corner(rng: np.random.Generator) -> tuple[int, int]:
    """A random top-left corner that keeps a square in frame."""
    return int(rng.integers(0, SIZE - SQUARE + 1)), int(rng.integers(0, SIZE - SQUARE + 1))


def _flash(frames: np.ndarray, pairs: range, corner: tuple[int, int], color: str) -> None:
    """Draw a still square on the frames of ``pairs`` (frame pairs)."""
    x, y = corner
    for p in pairs:
        frames[2 * p : 2 * p + 2, y : y + SQUARE, x : x + SQUARE] = COLORS[color]


def clip(kind: str, answer: int, rng: np.random.Generator) -> np.ndarray:
    """The frames (uint8 [FRAMES, SIZE, SIZE, 3]) of one question of ``kind`` whose
    correct option is ``answer``."""
    frames = np.empty((FRAMES, SIZE, SIZE, 3), dtype=np.uint8)
    frames[:] = np.asarray(BACKGROUND, dtype=np.uint8)
    pairs = FRAMES // 2
    color = str(rng.choice(OTHER_COLORS))
    if kind == "direction":
        # the square crosses half the frame; the path's place is random, so any one
        # frame's position is alike for both directions
        travel = SIZE // 2
        x0 = int(rng.integers(0, SIZE - SQUARE - travel + 1))
        y = int(rng.integers(0, SIZE - SQUARE + 1))
        for t in range(FRAMES):
            step = round(travel * t / (FRAMES - 1))
            x = x0 + (step if answer == 1 else travel - step)
            frames[t, y : y + SQUARE, x : x + SQUARE] = COLORS[color]
    elif kind == "order":
        # two flashes of two pairs each, apart; red first for answer 0
        first = int(rng.integers(0, pairs - 5))
        second = int(rng.integers(first + 3, pairs - 1))
        colors = ("red", "blue") if answer == 0 else ("blue", "red")
        _flash(frames, range(first, first + 2), _corner(rng), colors[0])
        _flash(frames, range(second, second + 2), _corner(rng), colors[1])
    elif kind == "count":
        # one or two flashes of one pair, at least one dark pair between them
        corner = _corner(rng)
        if answer == 0:
            starts = [int(rng.integers(0, pairs))]
        else:
            a = int(rng.integers(0, pairs - 2))
            starts = [a, int(rng.integers(a + 2, pairs))]
        for p in starts:
            _flash(frames, range(p, p + 1), corner, color)
    else:
        # a flash of one to three pairs wholly inside one half of the clip
        length = int(rng.integers(1, 4))
        half = pairs // 2
        start = int(rng.integers(0, half - length + 1)) + (half if answer == 1 else 0)
        _flash(frames, range(start, start + length), _corner(rng), color)
    return frames


def write_motion_qa(
    out: str | Path, clips: int, seed: int = 0, blank: bool = False, shuffle: bool = False, decoy_every: int = 0
) -> Path:
    """Render ``clips`` videos under ``out/media`` and write ``out/data.jsonl`` (one
    multiple-choice row per clip; kinds cycle, and so do answers within a kind, so both
    are balanced). Returns the dataset path.

    Controls: ``blank`` writes the same rows over empty frames (how much accuracy needs
    the pixels); ``shuffle`` writes each clip's frames in a random order (how much
    needs their order: direction, order and when do; a count can still be read from
    how many frames show the square, 2 or 4).

    ``decoy_every`` = k > 0 makes every k-th row a decoy, labelled ``"decoy": true``: its
    question opens with a sentence that states the answer (``TELLS``), so the text alone
    answers it; the clips, and every other row, are those of ``decoy_every=0``. The
    truth to check ``omni-rl curate text-only`` against.
    """
    out = Path(out)
    rng = np.random.default_rng(seed)
    rows = []
    for i, kind, question, options, answer in balanced_choices(clips, KINDS, QUESTIONS):
        frames = clip(kind, answer, rng)
        if blank:
            frames[:] = np.asarray(BACKGROUND, dtype=np.uint8)
        if shuffle:  # its own generator, so the shuffled set has the same scenes
            frames = frames[np.random.default_rng([seed, i]).permutation(FRAMES)]
        name = f"media/clip_{i:05d}.mp4"
        write_video(out / name, frames, FPS)
        decoy = decoy_every > 0 and i % decoy_every == decoy_every - 1
        if decoy:
            question = f"{TELLS[kind].format(options[answer])} {question}"
        row = choice_row(f"clip{i:05d}-{kind}", question, options, answer, "videos", name, f"video_{kind}")
        rows.append({**row, "decoy": True} if decoy else row)
    out.mkdir(parents=True, exist_ok=True)
    (out / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out / "data.jsonl"
