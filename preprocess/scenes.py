"""Synthetic video-QA scenes with known ground truth.

A scene is a few coloured shapes on a plain background; each enters at a known time
and moves in a known direction until the clip ends. ``write_video_qa`` renders scenes
to H.264 clips and writes dataset rows asking four kinds of question whose answers
need the video: which way an object moves (multiple_choice), how many objects appear
(counting), which colour appears (multiple_choice) and when an object enters
(temporal_grounding). Tones (WAV) and still images (PNG) get rows of their own.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from omni_rl.preprocess.synthetic import DIRECTIONS, tone, write_image, write_video, write_wav

COLORS = {
    "red": (230, 40, 40),
    "green": (40, 200, 60),
    "blue": (50, 90, 240),
    "yellow": (240, 220, 40),
    "white": (245, 245, 245),
    "magenta": (220, 50, 220),
}
# Close to the CLIP normalization mean the Qwen processors subtract, so a background
# patch normalizes to about zero and the shapes carry the visual signal.
BACKGROUND = (122, 116, 104)
LETTERS = "ABCDEFGH"


@dataclass(frozen=True)
class MovingObject:
    """A shape visible from ``enter`` seconds on, moving from ``start`` in ``direction``.

    ``start`` is its top-left corner in pixels at ``enter``; it travels ``travel``
    pixels by the end of the clip.
    """

    color: str
    shape: str
    direction: str
    enter: float
    size: int
    start: tuple[float, float]
    travel: float


def render(objects: list[MovingObject], seconds: float, fps: int, width: int, height: int) -> np.ndarray:
    """Frames of a scene: uint8 [T, H, W, 3]."""
    n = max(2, round(seconds * fps))
    frames = np.empty((n, height, width, 3), dtype=np.uint8)
    frames[:] = np.asarray(BACKGROUND, dtype=np.uint8)
    yy, xx = np.mgrid[0:height, 0:width]
    for t in range(n):
        now = t / fps
        for obj in objects:
            if now < obj.enter:
                continue
            progress = (now - obj.enter) / max(seconds - obj.enter, 1e-6)
            dx, dy = DIRECTIONS[obj.direction]
            x = obj.start[0] + dx * obj.travel * progress
            y = obj.start[1] + dy * obj.travel * progress
            if obj.shape == "circle":
                r = obj.size / 2
                mask = (xx - (x + r)) ** 2 + (yy - (y + r)) ** 2 <= r * r
            else:
                mask = (xx >= x) & (xx < x + obj.size) & (yy >= y) & (yy < y + obj.size)
            frames[t][mask] = COLORS[obj.color]
    return frames


def random_scene(
    rng: np.random.Generator, seconds: float, width: int, height: int, max_objects: int = 3, uniform: bool = False
) -> list[MovingObject]:
    """1..max_objects shapes of distinct colours, each moving its own way; with
    ``uniform``, shapes of one colour all moving the same way. The first is there from
    the start, the others enter during the first half of the clip. Every object stays
    in frame."""
    count = int(rng.integers(1, max_objects + 1))
    colors = [str(rng.choice(list(COLORS)))] * count if uniform else rng.choice(list(COLORS), count, replace=False)
    directions = [str(rng.choice(list(DIRECTIONS)))] * count if uniform else rng.choice(list(DIRECTIONS), count)
    size = max(6, min(width, height) // 4)
    objects = []
    for i, (color, direction) in enumerate(zip(colors, directions, strict=True)):
        direction = str(direction)
        dx, dy = DIRECTIONS[direction]
        travel = (width if dx else height) * 0.4
        # start where the whole path stays inside the frame
        lo_x = travel if dx < 0 else 0
        hi_x = width - size - (travel if dx > 0 else 0)
        lo_y = travel if dy < 0 else 0
        hi_y = height - size - (travel if dy > 0 else 0)
        start = (float(rng.uniform(lo_x, hi_x)), float(rng.uniform(lo_y, hi_y)))
        enter = 0.0 if i == 0 else round(float(rng.uniform(0.2, 0.5)) * seconds, 2)
        objects.append(
            MovingObject(str(color), str(rng.choice(["square", "circle"])), direction, enter, size, start, travel)
        )
    return objects


def _choice_row(question: str, options: list[str], answer: str, rng: np.random.Generator, shuffle: bool) -> dict:
    """A multiple-choice row; with ``shuffle`` the options come in a random order (the
    model must match its answer to the option text), else in a fixed order."""
    if shuffle:
        options = [options[i] for i in rng.permutation(len(options))]
    return {"problem": question, "options": list(options), "answer": LETTERS[options.index(answer)]}


def scene_rows(
    video: str,
    objects: list[MovingObject],
    seconds: float,
    rng: np.random.Generator,
    shuffle_options: bool = True,
    uniform: bool = False,
) -> list[dict]:
    """The four questions about one scene, as dataset rows (without ids); ``uniform``
    scenes (see ``random_scene``) are asked about all their shapes at once."""
    questions = _uniform_questions if uniform else _varied_questions
    rows = questions(objects, seconds, rng, shuffle_options)
    for row in rows:
        row["videos"] = [video]
        row["data_source"] = "synthetic_shapes"
    return rows


def _varied_questions(objects, seconds, rng, shuffle_options) -> list[dict]:
    """Questions about one named shape of a scene whose shapes differ."""
    target = objects[int(rng.integers(len(objects)))]
    present = {o.color for o in objects}
    absent = [c for c in COLORS if c not in present]
    appear = str(rng.choice(sorted(present)))
    late = [o for o in objects if o.enter > 0] or objects
    entering = late[int(rng.integers(len(late)))]
    return [
        {
            "problem_type": "multiple_choice",
            **_choice_row(
                f"Which way does the {target.color} {target.shape} move?",
                list(DIRECTIONS),
                target.direction,
                rng,
                shuffle_options,
            ),
        },
        {"problem_type": "counting", "problem": "How many shapes appear in the video?", "answer": len(objects)},
        {
            "problem_type": "multiple_choice",
            **_choice_row(
                "Which colour appears in the video?",
                # unshuffled, the options keep the palette's order, so the letter still
                # depends on which colour is on screen
                sorted([appear, *rng.choice(absent, 3, replace=False)], key=list(COLORS).index),
                appear,
                rng,
                shuffle_options,
            ),
        },
        {
            "problem_type": "temporal_grounding",
            "problem": f"When is the {entering.color} {entering.shape} visible? Answer with start and end seconds.",
            "answer": [entering.enter, seconds],
        },
    ]


def _uniform_questions(objects, seconds, rng, shuffle_options) -> list[dict]:
    """Questions about a scene whose shapes share one colour and one direction: the
    options are the whole palette and all four directions."""
    first = objects[0]
    return [
        {
            "problem_type": "multiple_choice",
            **_choice_row("Which way do the shapes move?", list(DIRECTIONS), first.direction, rng, shuffle_options),
        },
        {"problem_type": "counting", "problem": "How many shapes appear in the video?", "answer": len(objects)},
        {
            "problem_type": "multiple_choice",
            **_choice_row("What colour are the shapes?", list(COLORS), first.color, rng, shuffle_options),
        },
        {
            "problem_type": "temporal_grounding",
            "problem": "When is the last shape to appear visible? Answer with start and end seconds.",
            "answer": [max(o.enter for o in objects), seconds],
        },
    ]


def write_video_qa(
    out: str | Path,
    videos: int,
    seed: int = 0,
    seconds: float = 4.0,
    fps: int = 10,
    width: int = 160,
    height: int = 120,
    tones: int = 0,
    images: int = 0,
    blank: bool = False,
    shuffle_options: bool = True,
    uniform: bool = False,
) -> Path:
    """Render ``videos`` scenes (plus ``tones`` WAVs and ``images`` PNGs) under ``out``
    and write ``out/data.jsonl`` (4 rows per video, 1 per tone and image) and
    ``out/truth.jsonl`` (each scene's objects). Returns the dataset path.

    ``blank`` writes the same rows over videos of the empty background: a control
    showing how much of a model's accuracy needs the pixels. ``shuffle_options=False``
    keeps multiple-choice options in a fixed order (the letter is the class), a task a
    tiny model can learn without matching answers to option text. ``uniform`` scenes
    have shapes of one colour moving one way, asked about with the whole palette and
    all four directions as options.
    """
    out = Path(out)
    rng = np.random.default_rng(seed)
    rows, truth = [], []
    for i in range(videos):
        objects = random_scene(rng, seconds, width, height, uniform=uniform)
        name = f"media/scene_{i:05d}.mp4"
        write_video(out / name, render([] if blank else objects, seconds, fps, width, height), fps)
        for kind, row in zip(
            ("direction", "count", "colour", "enter"),
            scene_rows(name, objects, seconds, rng, shuffle_options, uniform),
            strict=True,
        ):
            rows.append({"id": f"scene{i:05d}-{kind}", **row})
        truth.append({"video": name, "seconds": seconds, "objects": [asdict(o) for o in objects]})
    for i in range(tones):
        pitch = str(rng.choice(["low", "high"]))
        name = f"media/tone_{i:05d}.wav"
        write_wav(out / name, tone(1.0, hz=220.0 if pitch == "low" else 1760.0))
        rows.append(
            {
                "id": f"tone{i:05d}",
                "problem_type": "multiple_choice",
                "audios": [name],
                "data_source": "synthetic_tones",
                **_choice_row("Is this tone low or high?", ["low", "high"], pitch, rng, shuffle_options),
            }
        )
    for i in range(images):
        objects = random_scene(rng, 1.0, width, height)
        still = [MovingObject(o.color, o.shape, o.direction, 0.0, o.size, o.start, 0.0) for o in objects]
        name = f"media/image_{i:05d}.png"
        write_image(out / name, render(still, 1.0, 1, width, height)[0])
        rows.append(
            {
                "id": f"image{i:05d}",
                "problem_type": "counting",
                "images": [name],
                "problem": "How many shapes are in the image?",
                "answer": len(objects),
                "data_source": "synthetic_images",
            }
        )
    out.mkdir(parents=True, exist_ok=True)
    (out / "truth.jsonl").write_text("".join(json.dumps(t) + "\n" for t in truth))
    data = out / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return data
