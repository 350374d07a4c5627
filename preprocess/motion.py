"""Synthetic video-QA clips whose answers need the frames.

``write_motion_qa`` renders short clips of coloured squares and writes one row per
clip, cycling through kinds of question. The four ``KINDS`` are two-option multiple
choice: which way a square moves, which of two squares flashes first, how many times a
square flashes, and whether a square shows in the first or the second half of the
clip; their answers alternate, so each kind is balanced, chance is 1/2, and the
question's wording tells nothing. They need the frames and where each falls in time,
not motion between frames: one frame known to be frame t tells the direction exactly
(the first and last frames), the order and the half about 85% of the time, the count
about 68% (``tests/test_motion.py``).

The ``FRAMELESS_KINDS`` ask the direction, order and count questions of clips that one
frame does not answer: ``wrap_direction``'s square moves left or right on a torus from
anywhere, so no frame tells its way; ``adjacent_order``'s red and blue flash back to
back and ``equal_count``'s one or two flashes show two frame pairs either way, so one
frame known to be frame t tells them about 57% of the time (the clip's first and last
pairs, when a flash falls there).

``quarter`` asks the ``when`` question with four options (multiple choice A-D,
balanced, chance 1/4): in which quarter of the clip a square shows for one or two frame
pairs. One frame known to be frame t tells it about 44% of the time.

The ``ROUTED_KINDS`` each go to a reward of their own by ``problem_type``: ``heading``,
which of four ways a square moves (multiple choice A-D, balanced, chance 1/4);
``counting``, how many times a square flashes, 0 to 4, answered as a number (the
``counting`` reward, balanced, chance 1/5); ``grounding``, when a square shows, as a
[start, end] span in seconds (the ``temporal_grounding`` reward, IoU; the best answer
that ignores the clip scores ``grounding_baseline()``).

Timings are laid out on pairs of frames, the temporal patch of the Qwen-VL vision
towers: a flash covers whole pairs, so the tokens of a pair either show it or do not.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Collection
from pathlib import Path

import numpy as np

from omni_rl.preprocess.scenes import BACKGROUND, COLORS
from omni_rl.preprocess.synthetic import balanced_choices, choice_row, write_video
from omni_rl.rewards.parsing import interval_iou

KINDS = ("direction", "order", "count", "when")
ROUTED_KINDS = ("heading", "counting", "grounding")
FRAMELESS = {"wrap_direction": "direction", "adjacent_order": "order", "equal_count": "count"}
"""Direction, order and count laid out so that one frame tells (almost) nothing: each
asks its default kind's question, with its options."""
FRAMELESS_KINDS = tuple(FRAMELESS)
QUESTIONS = {
    "direction": ("Which way does the square move?", ["left", "right"]),
    "order": ("Which square appears first?", ["red", "blue"]),
    "count": ("How many times does the square flash?", ["1", "2"]),
    "when": ("When does the square show, in the first or the second half?", ["first", "second"]),
    "quarter": ("In which quarter of the clip does the square show?", ["first", "second", "third", "fourth"]),
    "heading": ("Which way does the square move?", ["up", "down", "left", "right"]),
    "counting": ("How many times does the square flash? Answer with a number.", ["0", "1", "2", "3", "4"]),
    # answers are drawn (``_span``), not options: one placeholder keeps the cycle simple
    "grounding": ("When does the square show? Answer with its start and end in seconds, as [start, end].", [""]),
}
PROBLEM_TYPES = {"counting": "counting", "grounding": "temporal_grounding"}
"""The reward of each kind that is not multiple choice."""
# a decoy's wording states its answer: a question the text alone answers
TELLS = {
    "direction": "The square moves {}.",
    "order": "The {} square appears first.",
    "count": "The square flashes {} time(s).",
    "when": "The square shows in the {} half.",
    "quarter": "The square shows in the {} quarter.",
    "heading": "The square moves {}.",
    "counting": "The square flashes {} time(s).",
    "grounding": "The square shows at {} seconds.",
}
QUESTIONS.update({kind: QUESTIONS[asks] for kind, asks in FRAMELESS.items()})
TELLS.update({kind: TELLS[asks] for kind, asks in FRAMELESS.items()})
FRAMES = 16
"""Frames per clip (8 pairs)."""
FPS = 8
SIZE = 56
"""Frame side in pixels: 4 x 4 patches of 14 (2 x 2 tokens after the 2 x 2 merge)."""
SQUARE = 14
"""Square side in pixels."""
TRAVEL = 24
"""Pixels a ``heading`` or ``wrap_direction`` square travels over the clip, wrapping
around the frame."""
SPAN_PAIRS = (1, 2, 3)
"""The lengths, in frame pairs, a ``grounding`` square may show for (drawn alike)."""
LIT_PAIRS = 4
"""Frame pairs a ``counting`` square shows in all, whatever its count (1 to 4)."""
MOVES = {"wrap_direction": ((-1, 0), (1, 0)), "heading": ((0, -1), (0, 1), (-1, 0), (1, 0))}
"""Each option's step (dx, dy) of the kinds that move on a torus, in their options' order."""
# the colours a square of the direction, count and when kinds may have (red and blue
# belong to the order kind's question)
OTHER_COLORS = [c for c in COLORS if c not in ("red", "blue")]
TWO_COLORED = ("order", "adjacent_order")
"""The kinds whose clip shows a red and a blue square, not one square of another colour."""
COLOR_QUESTION = "What colour is the square?"
"""What a ``color`` row asks of a clip of one square (``color_rows``): its options are
``OTHER_COLORS``, which no kind's answer depends on."""


def _corner(rng: np.random.Generator) -> tuple[int, int]:
    """A random top-left corner that keeps a square in frame."""
    return int(rng.integers(0, SIZE - SQUARE + 1)), int(rng.integers(0, SIZE - SQUARE + 1))


def _flash(frames: np.ndarray, pairs: range, corner: tuple[int, int], color: str) -> None:
    """Draw a still square on the frames of ``pairs`` (frame pairs)."""
    x, y = corner
    for p in pairs:
        frames[2 * p : 2 * p + 2, y : y + SQUARE, x : x + SQUARE] = COLORS[color]


def _wrapped(frame: np.ndarray, x: int, y: int, color: str) -> None:
    """Draw a square at (x, y) on a torus: what leaves one edge comes in at the other."""
    rows, cols = (y + np.arange(SQUARE)) % SIZE, (x + np.arange(SQUARE)) % SIZE
    frame[np.ix_(rows, cols)] = COLORS[color]


def _composition(total: int, parts: int, rng: np.random.Generator) -> list[int]:
    """``total`` as ``parts`` positive integers, each such split alike likely."""
    cuts = np.sort(rng.choice(np.arange(1, total), size=parts - 1, replace=False))
    return np.diff([0, *cuts.tolist(), total]).tolist()


def _flash_starts(lengths: list[int], pairs: int, rng: np.random.Generator) -> list[int]:
    """First pairs of flashes of ``lengths`` (in pairs) laid out in order over ``pairs``
    with at least one dark pair between two: the spare dark pairs are spread over the
    gaps before, between and after them, each such spread alike likely."""
    spare = pairs - sum(lengths) - (len(lengths) - 1)
    slots = len(lengths) + 1
    extra = [n - 1 for n in _composition(spare + slots, slots, rng)]
    starts, at = [], extra[0]
    for i, length in enumerate(lengths):
        starts.append(at)
        at += length + 1 + extra[i + 1]
    return starts


def _span(rng: np.random.Generator) -> tuple[int, int]:
    """A ``grounding`` flash as (first pair, pairs): its length from ``SPAN_PAIRS``,
    then its start anywhere it fits."""
    length = int(rng.choice(SPAN_PAIRS))
    return int(rng.integers(0, FRAMES // 2 - length + 1)), length


def span_seconds(first: int, length: int) -> list[float]:
    """A flash over ``length`` pairs from pair ``first`` as [start, end] in seconds."""
    return [2 * first / FPS, 2 * (first + length) / FPS]


def grounding_baseline() -> tuple[list[float], float]:
    """The answer that scores best without the clip (one span, on an eighth-of-a-second
    grid) and its mean IoU over the spans ``_span`` draws, weighted as it draws them."""
    pairs = FRAMES // 2
    drawn = [
        (span_seconds(first, length), 1 / len(SPAN_PAIRS) / (pairs - length + 1))
        for length in SPAN_PAIRS
        for first in range(pairs - length + 1)
    ]
    grid = [i / 8 for i in range(FRAMES // FPS * 8 + 1)]

    def mean_iou(guess: list[float]) -> float:
        return sum(w * interval_iou(guess, span) for span, w in drawn)

    best = max(([a, b] for a in grid for b in grid if b > a), key=mean_iou)
    return best, mean_iou(best)


def clip(kind: str, answer: int, rng: np.random.Generator) -> np.ndarray:
    """The frames (uint8 [FRAMES, SIZE, SIZE, 3]) of one question of ``kind`` whose
    correct option is ``answer``."""
    return colored_clip(kind, answer, rng)[0]


def colored_clip(kind: str, answer: int, rng: np.random.Generator) -> tuple[np.ndarray, str | None]:
    """``clip``'s frames and the colour of its one square, or None for the kinds whose
    squares are red and blue (``order``, ``adjacent_order``) and for a clip that shows
    no square (a ``counting`` answer of 0)."""
    frames = np.empty((FRAMES, SIZE, SIZE, 3), dtype=np.uint8)
    frames[:] = np.asarray(BACKGROUND, dtype=np.uint8)
    pairs = FRAMES // 2
    color = str(rng.choice(OTHER_COLORS))
    if kind == "direction":
        # the square crosses half the frame from a random start; the middle frames'
        # positions are alike for both directions, the first and last frames' are not
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
    elif kind == "when":
        # a flash of one to three pairs wholly inside one half of the clip
        length = int(rng.integers(1, 4))
        half = pairs // 2
        start = int(rng.integers(0, half - length + 1)) + (half if answer == 1 else 0)
        _flash(frames, range(start, start + length), _corner(rng), color)
    elif kind == "quarter":
        # a flash of one or two pairs wholly inside one quarter (two pairs) of the clip
        length = int(rng.integers(1, 3))
        quarter = pairs // 4
        start = answer * quarter + int(rng.integers(0, quarter - length + 1))
        _flash(frames, range(start, start + length), _corner(rng), color)
    elif kind in MOVES:
        # from anywhere on a torus, so that any one frame's square is alike for every
        # way it may move: only the motion between frames tells them apart
        x, y = int(rng.integers(0, SIZE)), int(rng.integers(0, SIZE))
        dx, dy = MOVES[kind][answer]
        for t in range(FRAMES):
            step = round(TRAVEL * t / (FRAMES - 1))
            _wrapped(frames[t], x + dx * step, y + dy * step, color)
    elif kind == "adjacent_order":
        # red and blue one pair each, back to back at one corner, anywhere in the clip
        # (red first for answer 0): a frame shows one colour or none, and only the
        # clip's first and last pairs can tell which came first
        first = int(rng.integers(0, pairs - 1))
        corner = _corner(rng)
        for p, name in zip((first, first + 1), ("red", "blue") if answer == 0 else ("blue", "red"), strict=True):
            _flash(frames, range(p, p + 1), corner, name)
    elif kind == "equal_count":
        # one flash of two pairs, or two of one pair with a dark pair or more between:
        # two pairs shown either way, laid out as the counting kind lays its flashes
        corner = _corner(rng)
        lengths = [2] if answer == 0 else [1, 1]
        for first, length in zip(_flash_starts(lengths, pairs, rng), lengths, strict=True):
            _flash(frames, range(first, first + length), corner, color)
    elif kind == "counting":
        # 0 to 4 flashes that show LIT_PAIRS pairs in all (a count of 1 is one long
        # flash, 4 are four short ones), at least one dark pair between two
        corner = _corner(rng)
        lengths = _composition(LIT_PAIRS, answer, rng) if answer else []
        for first, length in zip(_flash_starts(lengths, pairs, rng), lengths, strict=True):
            _flash(frames, range(first, first + length), corner, color)
    else:
        raise ValueError(f"no motion clip of kind {kind!r} (grounding clips come from grounding_clip)")
    shown = bool((frames != np.asarray(BACKGROUND, dtype=np.uint8)).any())  # a count of 0 shows no square
    return frames, None if kind in TWO_COLORED or not shown else color


def grounding_clip(rng: np.random.Generator) -> tuple[np.ndarray, list[float]]:
    """The frames of a ``grounding`` question and its answer, [start, end] in seconds:
    one flash whose length and place are drawn (``_span``)."""
    frames = np.empty((FRAMES, SIZE, SIZE, 3), dtype=np.uint8)
    frames[:] = np.asarray(BACKGROUND, dtype=np.uint8)
    first, length = _span(rng)
    _flash(frames, range(first, first + length), _corner(rng), str(rng.choice(OTHER_COLORS)))
    return frames, span_seconds(first, length)


def chance_of(kind: str) -> float:
    """What answering a ``kind`` question without its clip scores: a uniform guess among
    its options, or for ``grounding`` the best constant span's mean IoU."""
    if kind == "grounding":
        return grounding_baseline()[1]
    return 1 / len(QUESTIONS[kind][1])


def is_decoy(index: int, decoy_every: int) -> bool:
    """Whether row ``index`` is a decoy: every ``decoy_every``-th row (0: none)."""
    return decoy_every > 0 and index % decoy_every == decoy_every - 1


SCENE_DRAWS = 1000
"""How many times ``write_motion_qa`` draws a scene again that repeats an ``avoid`` one
before it gives up."""


def scene_digest(frames: np.ndarray) -> str:
    """A rendered scene's identity: the SHA-1 of its frames' bytes."""
    return hashlib.sha1(np.ascontiguousarray(frames).tobytes()).hexdigest()


def _scene(kind: str, answer: int, options: list[str], rng: np.random.Generator):
    """(frames, options, colour of its one square or None) of one clip; a
    ``grounding`` clip's one option is the span it draws."""
    if kind == "grounding":
        frames, span = grounding_clip(rng)
        return frames, [json.dumps(span)], None
    frames, color = colored_clip(kind, answer, rng)
    return frames, options, color


def _scenes(clips: int, seed: int, kinds: tuple[str, ...], avoid: Collection[str] = ()):
    """Yield ``(index, kind, question, options, answer, frames, colour)`` of the clips
    ``write_motion_qa`` draws, before its controls touch the frames. A scene whose
    digest is in ``avoid`` is drawn again from a generator of its own (``[seed, index,
    draw]``), so every other scene stays as it was; except a scene that shows no square
    (a count of 0), the one clip its answer has."""
    unknown = sorted(set(kinds) - set(QUESTIONS))
    if unknown:
        raise ValueError(f"no motion kind {unknown}; the kinds are {list(QUESTIONS)}")
    rng = np.random.default_rng(seed)
    blank = np.asarray(BACKGROUND, dtype=np.uint8)
    for i, kind, question, options, answer in balanced_choices(clips, kinds, QUESTIONS):
        frames, drawn, color = _scene(kind, answer, options, rng)
        draw = 0
        while avoid and (frames != blank).any() and scene_digest(frames) in avoid:
            if draw == SCENE_DRAWS:
                raise ValueError(
                    f"clip {i} ({kind}, answer {answer}): {SCENE_DRAWS} draws all repeat a scene to avoid;"
                    f" {kind} has too few scenes for sets this large"
                )
            frames, drawn, color = _scene(kind, answer, options, np.random.default_rng([seed, i, draw]))
            draw += 1
        yield i, kind, question, drawn, answer, frames, color


def scene_digests(clips: int, seed: int = 0, kinds: tuple[str, ...] = KINDS) -> set[str]:
    """The digests of the scenes ``write_motion_qa(out, clips, seed, kinds=kinds)``
    draws (whatever its controls): what a held-out set passes as ``avoid``."""
    return {scene_digest(frames) for *_, frames, _ in _scenes(clips, seed, kinds)}


def write_motion_qa(
    out: str | Path,
    clips: int,
    seed: int = 0,
    blank: bool = False,
    shuffle: bool = False,
    decoy_every: int = 0,
    kinds: tuple[str, ...] = KINDS,
    colors: bool = False,
    avoid: Collection[str] = (),
) -> Path:
    """Render ``clips`` videos under ``out/media`` and write ``out/data.jsonl`` (one row
    per clip; ``kinds`` cycle, and so do answers within a kind, so both are balanced; a
    grounding span is drawn). Returns the dataset path.

    Controls: ``blank`` writes the same rows over empty frames (how much accuracy needs
    the pixels); ``shuffle`` writes each clip's frames in a random order (how much
    needs their order: direction, order and when do; a count can still be read from
    how many frames show the square, 2 or 4).

    ``decoy_every`` = k > 0 makes every k-th row a decoy, labelled ``"decoy": true``: its
    question opens with a sentence that states the answer (``TELLS``), so the text alone
    answers it; the clips, and every other row, are those of ``decoy_every=0``. The
    truth to check ``omni-rl curate text-only`` against.

    ``colors`` records in each row whose clip shows one square its colour
    (``square_color``), for ``color_rows`` (over ``blank`` frames too: the colour it
    would have shown, so that the control asks the same rows).

    ``avoid``: scene digests (``scene_digests`` of a training set) no clip may repeat,
    but for the one clip a count of 0 has (``_scenes``); the controls keep the scenes,
    so a held-out set avoids the same ones with or without them.
    """
    out = Path(out)
    rows = []
    for i, kind, question, options, answer, frames, color in _scenes(clips, seed, kinds, avoid):
        if blank:
            frames[:] = np.asarray(BACKGROUND, dtype=np.uint8)
        if shuffle:  # its own generator, so the shuffled set has the same scenes
            frames = frames[np.random.default_rng([seed, i]).permutation(FRAMES)]
        name = f"media/clip_{i:05d}.mp4"
        write_video(out / name, frames, FPS)
        decoy = is_decoy(i, decoy_every)
        if decoy:
            question = f"{TELLS[kind].format(options[answer])} {question}"
        row = choice_row(f"clip{i:05d}-{kind}", question, options, answer, "videos", name, f"video_{kind}")
        if kind in PROBLEM_TYPES:  # answered as a number or a span, not a letter
            del row["options"]
            row.update(problem_type=PROBLEM_TYPES[kind], answer=options[answer])
        if colors and color is not None:
            row["square_color"] = color
        rows.append({**row, "decoy": True} if decoy else row)
    out.mkdir(parents=True, exist_ok=True)
    (out / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out / "data.jsonl"


def color_rows(rows: list[dict]) -> list[dict]:
    """A ``color`` question (``COLOR_QUESTION``, four options, the true answer) of the
    clip of each row in ``rows`` that records its square's colour (``square_color``),
    with the row's clip and the id ``<id>-color``: what a cold start can learn of the
    clips, to look at them, without learning any kind's answer."""
    asked = []
    for row in rows:
        if "square_color" in row:
            answer = OTHER_COLORS.index(row["square_color"])
            media = row["videos"][0]
            asked.append(
                choice_row(f"{row['id']}-color", COLOR_QUESTION, OTHER_COLORS, answer, "videos", media, "video_color")
            )
    return asked
