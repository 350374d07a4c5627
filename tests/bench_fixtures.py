"""Small benchmark directories in each benchmark's published layout (file names,
columns, option formats and answer encodings), with real media, and saved responses
whose scores are worked out by hand in tests/test_benchmarks.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from omni_rl.preprocess.synthetic import tone, write_video, write_wav


def video(path: Path, frames: int = 8, fps: int = 4) -> Path:
    """A real H.264 mp4: ``frames`` 32x32 frames of a moving bright square."""
    pixels = np.zeros((frames, 32, 32, 3), dtype=np.uint8)
    for t in range(frames):
        pixels[t, 8:16, 2 * t : 2 * t + 8] = 255
    return write_video(path, pixels, fps)


def parquet(path: Path, records: list[dict]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(records), path)
    return path


def mvbench(root: Path) -> dict[str, str]:
    """Two tasks: action_sequence in the main branch's layout (uncut video with start
    and end), action_antonym in the video branch's (lmms-eval's folders); one missing
    video and one answer that is not a candidate. Returns responses by row id."""
    video(root / "video/star/Charades_v1_480/ZS9XR.mp4")
    video(root / "ssv2_video_mp4/1234.webm.mp4")
    sequence = [
        {"video": "ZS9XR.mp4", "question": "What happened after the person took the food?",
         "candidates": ["Ate the medicine.", "Tidied up the blanket.", "Put down the cup."],
         "answer": "Tidied up the blanket.", "start": 1.0, "end": 2.0},
        {"video": "ZS9XR.mp4", "question": "What did the person do first?",
         "candidates": ["Sat down.", "Stood up."], "answer": "Sat down.", "start": 0.0, "end": 1.5},
        {"video": "MISSING.mp4", "question": "Where?", "candidates": ["Here.", "There."], "answer": "Here."},
    ]  # fmt: skip
    antonym = [
        {"video": "1234.webm.mp4", "question": "What is the action?",
         "candidates": ["Pushing something left", "Pushing something right", "not sure"],
         "answer": "Pushing something right"},
        {"video": "1234.webm.mp4", "question": "What is the action now?",
         "candidates": ["Opening", "Closing"], "answer": "Opening"},
        {"video": "1234.webm.mp4", "question": "Broken?", "candidates": ["yes", "no"], "answer": "maybe"},
    ]  # fmt: skip
    (root / "json").mkdir(parents=True)
    (root / "json/action_sequence.json").write_text(json.dumps(sequence))
    (root / "json/action_antonym.json").write_text(json.dumps(antonym))
    return {
        "action_sequence-0": "(B) Tidied up the blanket.",  # right
        "action_sequence-1": "B",  # wrong
        "action_antonym-0": "Pushing something right",  # right, by the option's text
        "action_antonym-1": "I cannot tell.",  # no answer
    }


def videomme(root: Path) -> dict[str, str]:
    """Three questions on two videos (one missing), the subtitles of one video."""
    video(root / "data/fFjv93ACGo8.mp4")
    records = [
        {"video_id": "001", "duration": "short", "domain": "Knowledge", "sub_category": "Humanity & History",
         "url": "https://www.youtube.com/watch?v=fFjv93ACGo8", "videoID": "fFjv93ACGo8", "question_id": "001-1",
         "task_type": "Counting Problem", "question": "Which decoration has the largest number?",
         "options": ["A. Apples.", "B. Candles.", "C. Berries.", "D. The same number."], "answer": "C"},
        {"video_id": "001", "duration": "short", "domain": "Knowledge", "sub_category": "Humanity & History",
         "url": "https://www.youtube.com/watch?v=fFjv93ACGo8", "videoID": "fFjv93ACGo8", "question_id": "001-2",
         "task_type": "OCR Problems", "question": "What is written on the sign?",
         "options": ["A. Stop.", "B. Go.", "C. Wait.", "D. Exit."], "answer": "A"},
        {"video_id": "002", "duration": "long", "domain": "Sports Competition", "sub_category": "Football",
         "url": "https://www.youtube.com/watch?v=missing0000", "videoID": "missing0000", "question_id": "002-1",
         "task_type": "Action Reasoning", "question": "Why?",
         "options": ["A. a", "B. b", "C. c", "D. d"], "answer": "B"},
    ]  # fmt: skip
    parquet(root / "videomme/test-00000-of-00001.parquet", records)
    (root / "subtitle").mkdir()
    (root / "subtitle/fFjv93ACGo8.srt").write_text(
        '1\n00:00:00,000 --> 00:00:00,400\n<font color="white" size=".72c">hello</font>\n\n'
        "2\n00:00:00,600 --> 00:00:01,000\nhidden\n\n"
        "3\n00:00:01,200 --> 00:00:01,300\nworld\n"
    )
    return {"001-1": "The best answer is C.", "001-2": "B"}


def vsibench(root: Path) -> dict[str, str]:
    """Numeric and multiple-choice questions; an unknown type and a missing video."""
    video(root / "arkitscenes/41069025.mp4")
    video(root / "scannet/scene0011_00.mp4")
    base = {"dataset": "arkitscenes", "scene_name": "41069025", "options": None}
    choice = {"dataset": "scannet", "scene_name": "scene0011_00", "options": ["A. chair", "B. table", "C. sofa"]}
    records = [
        {**base, "id": 0, "question_type": "object_counting", "question": "How many tables?", "ground_truth": "4"},
        {**base, "id": 1, "question_type": "room_size_estimation", "question": "How big (m2)?", "ground_truth": "20"},
        {**choice, "id": 2, "question_type": "object_rel_direction_easy", "question": "Left?", "ground_truth": "A"},
        {**choice, "id": 3, "question_type": "object_rel_direction_hard", "question": "Behind?", "ground_truth": "B"},
        {**choice, "id": 4, "question_type": "route_planning", "question": "Which turn?", "ground_truth": "C"},
        {**base, "id": 5, "question_type": "object_weight", "question": "How heavy?", "ground_truth": "3"},
        {**base, "id": 6, "scene_name": "gone", "question_type": "object_counting", "question": "?",
         "ground_truth": "1"},
    ]  # fmt: skip
    parquet(root / "test-00000-of-00001.parquet", records)
    return {"0": "5", "1": "21", "2": "A", "3": "C", "4": "C."}


def charades_sta(root: Path, layout: str = "txt") -> dict[str, str]:
    """Three queries (one on a missing video), as the original text file or as
    lmms-lab's Parquet."""
    video(root / "Charades_v1_480/3MSZA.mp4")
    queries = [("3MSZA", 0.0, 1.0, "person opens a door."), ("3MSZA", 0.5, 2.0, "person sits down."),
               ("GONE1", 0.0, 1.0, "person runs.")]  # fmt: skip
    if layout == "txt":
        lines = [f"{v} {s} {e}##{text}" for v, s, e, text in queries]
        (root / "charades_sta_test.txt").write_text("\n".join(lines) + "\n")
    else:
        records = [{"video": f"{v}.mp4", "caption": text, "timestamp": [s, e]} for v, s, e, text in queries]
        parquet(root / "data/test-00000-of-00001.parquet", records)
    return {"3MSZA-0": "The event happens in the 0.0 - 1.0 seconds.", "3MSZA-1": "It happens in 0.5 - 1.0 seconds."}


def mmau(root: Path) -> dict[str, str]:
    """Three questions (sound, music, speech) and one whose clip is missing."""
    ids = ["3fe64f3d", "7a1b2c3d", "9e8d7c6b"]
    for i, clip in enumerate(ids):
        write_wav(root / f"test-mini-audios/{clip}.wav", tone(0.5, 300 + 200 * i))
    common = {"split": "test-mini", "category": "Reasoning", "sub-category": "Acoustic Source Inference"}
    records = [
        {**common, "id": ids[0], "audio_id": f"./test-mini-audios/{ids[0]}.wav", "task": "sound",
         "question": "Identify the source of the voice.", "choices": ["Man", "Woman", "Child", "Robot"],
         "answer": "Man", "dataset": "AudioSet", "difficulty": "medium"},
        {**common, "id": ids[1], "audio_id": f"./test-mini-audios/{ids[1]}.wav", "task": "music",
         "question": "Which instrument?", "choices": ["Piano", "Guitar"], "answer": "Guitar",
         "dataset": "musicbench", "difficulty": "easy", "category": ["Reasoning"]},
        {**common, "id": ids[2], "audio_id": f"./test-mini-audios/{ids[2]}.wav", "task": "speech",
         "question": "What emotion?", "choices": ["Happy", "Sad", "Angry", "Calm", "Afraid"], "answer": "Sad",
         "dataset": "meld", "difficulty": "hard"},
        {**common, "id": "lost", "audio_id": "./test-mini-audios/lost.wav", "task": "sound",
         "question": "?", "choices": ["x", "y"], "answer": "x", "dataset": "AudioSet", "difficulty": "easy"},
    ]  # fmt: skip
    (root / "mmau-test-mini.json").write_text(json.dumps(records))
    return {ids[0]: "A", ids[1]: "guitar", ids[2]: "(C)"}


BUILDERS = {
    "mvbench": mvbench,
    "videomme": videomme,
    "videomme_w_subtitle": videomme,
    "vsibench": vsibench,
    "charades_sta": charades_sta,
    "mmau_test_mini": mmau,
}


def write_predictions(path: Path, responses: dict[str, str]) -> Path:
    path.write_text("".join(json.dumps({"id": k, "response": v}) + "\n" for k, v in responses.items()))
    return path
