"""The quickstart's video-QA clips: each answer is what the frames show, every kind is
balanced, and the controls keep the questions while removing the frames or their order."""

import json

import numpy as np
import pytest

from omni_rl.preprocess.motion import FRAMES, KINDS, QUESTIONS, SQUARE, clip, write_motion_qa
from omni_rl.preprocess.scenes import BACKGROUND, COLORS
from omni_rl.preprocess.video import VideoBudget, read_video

# every frame at its size: what the quickstart's media settings sample
ALL_FRAMES = VideoBudget(fps=None, nframes=FRAMES, min_pixels=56 * 56, max_pixels=56 * 56)


def decoded(path) -> np.ndarray:
    """A clip's frames as uint8 [T, H, W, 3]."""
    return np.asarray(read_video(path, ALL_FRAMES).frames).transpose(0, 2, 3, 1)


def lit(frames: np.ndarray, color: str | None = None) -> np.ndarray:
    """[T, H, W] mask of square pixels (of ``color``, or of any colour)."""
    if color is None:
        return np.any(np.abs(frames.astype(int) - BACKGROUND) > 40, axis=-1)
    return np.all(np.abs(frames.astype(int) - COLORS[color]) <= 40, axis=-1)


def read_answer(kind: str, frames: np.ndarray) -> int:
    """The option index the frames show, read back from the pixels."""
    on = lit(frames).any(axis=(1, 2))
    if kind == "direction":
        xs = [np.argwhere(lit(frames[t : t + 1])[0])[:, 1].mean() for t in (0, len(frames) - 1)]
        return int(xs[1] > xs[0])
    if kind == "order":
        first = {c: int(np.argmax(lit(frames, c).any(axis=(1, 2)))) for c in ("red", "blue")}
        return int(first["blue"] < first["red"])
    if kind == "count":
        flashes = int(on[0]) + int(np.sum(on[1:] & ~on[:-1]))
        return flashes - 1
    shown = np.flatnonzero(on)
    assert shown.max() < len(frames) // 2 or shown.min() >= len(frames) // 2  # wholly in one half
    return int(shown.min() >= len(frames) // 2)


@pytest.mark.parametrize("kind", KINDS)
def test_each_clip_shows_its_answer(kind):
    rng = np.random.default_rng(7)
    for answer in (0, 1) * 20:
        frames = clip(kind, answer, rng)
        assert frames.shape == (FRAMES, 56, 56, 3)
        assert read_answer(kind, frames) == answer
        # a flash covers whole frame pairs (the vision tower's temporal patch)
        if kind != "direction":
            on = lit(frames).any(axis=(1, 2))
            assert np.array_equal(on[0::2], on[1::2])
        assert lit(frames[lit(frames).any(axis=(1, 2))]).sum(axis=(1, 2)).min() >= SQUARE * SQUARE


def test_no_single_frame_tells_the_direction():
    """The square's place in any one frame is spread alike for both directions: the
    path's start is random, so position alone gives the answer in few clips."""
    rng = np.random.default_rng(0)
    middle = {0: [], 1: []}
    for answer in (0, 1) * 200:
        frames = clip("direction", answer, rng)
        middle[answer].append(np.argwhere(lit(frames[FRAMES // 2 : FRAMES // 2 + 1])[0])[:, 1].mean())
    assert abs(np.mean(middle[0]) - np.mean(middle[1])) < 2.0


def test_rows_are_balanced_and_agree_with_the_decoded_clips(tmp_path):
    data = write_motion_qa(tmp_path / "qa", 16, seed=3)
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    assert [r["data_source"] for r in rows[:4]] == [f"video_{k}" for k in KINDS]
    for kind in KINDS:
        mine = [r for r in rows if r["data_source"] == f"video_{kind}"]
        assert [r["answer"] for r in mine] == ["A", "B", "A", "B"]
        assert {r["problem"] for r in mine} == {QUESTIONS[kind][0]} and all(len(r["options"]) == 2 for r in mine)
    for row in rows:
        kind = row["data_source"].removeprefix("video_")
        assert read_answer(kind, decoded(tmp_path / "qa" / row["videos"][0])) == "AB".index(row["answer"])


def test_controls_keep_the_rows_and_remove_the_frames_or_their_order(tmp_path):
    plain = write_motion_qa(tmp_path / "plain", 8, seed=1)
    blank = write_motion_qa(tmp_path / "blank", 8, seed=1, blank=True)
    shuffled = write_motion_qa(tmp_path / "shuffled", 8, seed=1, shuffle=True)
    assert plain.read_text() == blank.read_text() == shuffled.read_text()
    moved = 0
    for row in map(json.loads, plain.read_text().splitlines()):
        video = row["videos"][0]
        frames = decoded(tmp_path / "plain" / video)
        assert not lit(decoded(tmp_path / "blank" / video)).any()
        mixed = decoded(tmp_path / "shuffled" / video)
        # the same frames (the same scene), in another order
        key = lambda f: f.flatten().tolist()  # noqa: E731
        assert sorted(map(key, frames)) == sorted(map(key, mixed))
        moved += not bool((frames == mixed).all())
    assert moved >= 6


def test_decoys_state_their_answer_and_change_nothing_else(tmp_path):
    from omni_rl.preprocess.motion import TELLS

    plain = write_motion_qa(tmp_path / "plain", 12, seed=2)
    mixed = write_motion_qa(tmp_path / "decoys", 12, seed=2, decoy_every=3)
    rows = [json.loads(line) for line in mixed.read_text().splitlines()]
    assert [r.get("decoy", False) for r in rows] == [i % 3 == 2 for i in range(12)]
    for before, after in zip(plain.read_text().splitlines(), rows, strict=True):
        before = json.loads(before)
        if not after.get("decoy"):
            assert after == before
            continue
        kind = after["id"].rsplit("-", 1)[1]
        told = TELLS[kind].format(after["options"]["ABCD".index(after["answer"])])
        assert after["problem"] == f"{told} {before['problem']}"
        assert {k: v for k, v in after.items() if k not in ("problem", "decoy")} == {
            k: v for k, v in before.items() if k != "problem"
        }
    for video in sorted((tmp_path / "plain" / "media").iterdir()):  # the same clips, byte for byte
        assert video.read_bytes() == (tmp_path / "decoys" / "media" / video.name).read_bytes()
