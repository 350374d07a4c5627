"""Synthetic scenes: the ground truth written to the rows is what the frames show."""

import json

import numpy as np
import pytest

from omni_rl.preprocess.scenes import COLORS, LETTERS, random_scene, render, write_video_qa
from omni_rl.preprocess.synthetic import DIRECTIONS
from omni_rl.preprocess.video import read_video


def color_mask(frame: np.ndarray, color: str) -> np.ndarray:
    return np.all(np.abs(frame.astype(int) - COLORS[color]) <= 40, axis=-1)


@pytest.mark.parametrize("seed", range(6))
def test_rendered_scenes_match_their_objects(seed):
    rng = np.random.default_rng(seed)
    seconds, fps = 4.0, 10
    objects = random_scene(rng, seconds, 160, 120)
    frames = render(objects, seconds, fps, 160, 120)
    assert frames.shape == (40, 120, 160, 3)
    for obj in objects:
        visible = [t for t in range(len(frames)) if color_mask(frames[t], obj.color).sum() > 0]
        # enters at its time, stays in frame until the end
        assert visible[0] == int(np.ceil(obj.enter * fps - 1e-9)) and visible[-1] == len(frames) - 1
        first = np.argwhere(color_mask(frames[visible[0]], obj.color)).mean(axis=0)
        last = np.argwhere(color_mask(frames[-1], obj.color)).mean(axis=0)
        dx, dy = DIRECTIONS[obj.direction]
        moved = last - first  # (row, col); shapes may overlap, so allow some sideways drift
        along, across = (moved[1], moved[0]) if dx else (moved[0], moved[1])
        assert np.sign(along) == (dx or dy) and abs(across) < abs(along) / 2
    present = [c for c in COLORS if color_mask(frames[-1], c).sum() > 0]
    assert sorted(present) == sorted(o.color for o in objects)


def test_rows_agree_with_the_truth_and_the_decoded_clip(tmp_path):
    data = write_video_qa(tmp_path, videos=3, seed=3, seconds=3.0)
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    truth = {t["video"]: t for t in map(json.loads, (tmp_path / "truth.jsonl").read_text().splitlines())}
    assert len(rows) == 12
    for row in rows:
        scene = truth[row["videos"][0]]
        objects = scene["objects"]
        colors = {o["color"] for o in objects}
        kind = row["id"].rsplit("-", 1)[1]
        if kind == "count":
            assert row["answer"] == len(objects)
        elif kind == "colour":
            answer = row["options"][LETTERS.index(row["answer"])]
            assert answer in colors and sum(o in colors for o in row["options"]) == 1
        elif kind == "direction":
            color, shape = row["problem"].split()[4:6]
            [obj] = [o for o in objects if o["color"] == color]
            assert row["options"][LETTERS.index(row["answer"])] == obj["direction"] and obj["shape"] == shape
        else:
            color = row["problem"].split()[3]
            [obj] = [o for o in objects if o["color"] == color]
            assert row["answer"] == [obj["enter"], 3.0]
    clip = read_video(tmp_path / rows[0]["videos"][0])
    assert clip.total_frames == 30


def test_uniform_scenes_ask_about_all_shapes_with_the_whole_palette(tmp_path):
    data = write_video_qa(tmp_path, videos=6, seed=5, seconds=2.0, shuffle_options=False, uniform=True)
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    truth = [json.loads(line) for line in (tmp_path / "truth.jsonl").read_text().splitlines()]
    for scene, group in zip(truth, [rows[i : i + 4] for i in range(0, len(rows), 4)], strict=True):
        objects = scene["objects"]
        assert len({(o["color"], o["direction"]) for o in objects}) == 1
        direction, count, colour, enter = group
        assert direction["options"] == list(DIRECTIONS) and colour["options"] == list(COLORS)
        assert direction["options"][LETTERS.index(direction["answer"])] == objects[0]["direction"]
        assert colour["options"][LETTERS.index(colour["answer"])] == objects[0]["color"]
        assert count["answer"] == len(objects)
        assert enter["answer"] == [max(o["enter"] for o in objects), 2.0]


def test_a_clip_decodes_to_its_frames_yuv_in_every_process(tmp_path):
    """The synthetic clips are lossless H.264: decoded, a clip is its frames' YUV 4:2:0 to
    the bit, in this process and in a fresh one (libx264's lossy choices differ from run
    to run, which made a seeded quickstart on re-rendered clips end elsewhere)."""
    import subprocess
    import sys

    import av

    from omni_rl.preprocess.synthetic import write_video, yuv420

    frames = render(random_scene(np.random.default_rng(3), 2.0, 96, 72), 2.0, 8, 96, 72)
    script = (
        "import sys, numpy as np; from omni_rl.preprocess.synthetic import write_video; "
        "write_video(sys.argv[1], np.load(sys.argv[2]), 8)"
    )
    np.save(tmp_path / "frames.npy", frames)
    write_video(tmp_path / "here.mp4", frames, 8)
    subprocess.run([sys.executable, "-c", script, tmp_path / "there.mp4", tmp_path / "frames.npy"], check=True)
    for name in ("here.mp4", "there.mp4"):
        with av.open(str(tmp_path / name)) as clip:
            decoded = [frame.to_ndarray() for frame in clip.decode(video=0)]
        assert len(decoded) == len(frames)
        for got, frame in zip(decoded, frames, strict=True):
            np.testing.assert_array_equal(got, yuv420(frame))
