"""`omni-rl data convert`: other datasets' training files into rows the loader accepts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from omni_rl.cli import DATA_FORMATS, main
from omni_rl.data.convert import FORMATS, Conversion, convert, write_conversion
from omni_rl.errors import OmniRLError
from omni_rl.preprocess.rows import read_rows, resolve_media_path
from omni_rl.rewards import check_targets

CLIP = "./LLaVA-Video-178K/liwei_youtube_videos/videos/youtube_video_2024/ytb_7nRmsEw7nsE.mp4"
OPTIONS = [
    "A. A YouTube subscription notification",
    "B. A military command",
    "C. A warning message",
    "D. A weather update",
]


def touch(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"")


def video_r1_record(problem_id, problem_type="multiple choice", **changes) -> dict:
    record = {
        "problem_id": problem_id,
        "problem": "What appears on the screen in Russian during the missile's ascent?",
        "data_type": "video",
        "problem_type": problem_type,
        "options": OPTIONS if problem_type == "multiple choice" else [],
        "process": "<think>The banner in the corner asks to subscribe.</think>",
        "solution": "<answer>A</answer>",
        "path": CLIP,
        "data_source": "LLaVA-Video-178K/30_60_s_youtube_v0_1",
    }
    return {**record, **changes}


@pytest.fixture
def video_r1(tmp_path) -> Path:
    """Video-R1-data/Video-R1-COT-165k.json with its media beside it; bad rows at 5-10."""
    root = tmp_path / "Video-R1-data"
    touch(root / CLIP)
    touch(root / "CLEVR-Math/images/CLEVR_train_000001.png")
    records = [
        video_r1_record(2),
        video_r1_record(3, "numerical", solution="<answer>3</answer>", problem="How many cars pass?"),
        video_r1_record(
            4,
            "OCR",
            data_type="image",
            path="./CLEVR-Math/images/CLEVR_train_000001.png",
            solution="<answer>STOP</answer>",
        ),
        video_r1_record(5, "free-form", solution="<answer> The man opens the door. </answer>"),
        video_r1_record(6, "regression", solution="<answer>12.5</answer>", path="./missing/clip.mp4"),
        video_r1_record(7, "yes/no"),
        video_r1_record(8, solution="A"),
        {key: value for key, value in video_r1_record(9).items() if key != "path"},
        video_r1_record(10, data_type="audio"),
        video_r1_record(2, solution="<answer>B</answer>"),
        video_r1_record(11, solution="<answer>E</answer>"),
        {key: value for key, value in video_r1_record(None).items() if key != "problem_id"},
    ]
    path = root / "Video-R1-COT-165k.json"
    path.write_text(json.dumps(records))
    return path


def test_video_r1_rows_types_answers_and_kept_fields(video_r1):
    conversion = FORMATS.get("video-r1")(video_r1)
    rows = {row["id"]: row for row in conversion.rows}
    assert list(rows) == ["video-r1-2", "video-r1-3", "video-r1-4", "video-r1-5", "video-r1-6", "video-r1-11"]
    mc = rows["video-r1-2"]
    assert (mc["problem_type"], mc["answer"]) == ("multiple_choice", "A")
    # labels dropped: the prompt template letters the options itself
    assert mc["options"] == [o[3:] for o in OPTIONS]
    assert mc["videos"] == [CLIP] and "path" not in mc
    assert mc["process"].startswith("<think>") and mc["problem_id"] == 2 and mc["solution"] == "<answer>A</answer>"
    assert mc["data_source"] == "LLaVA-Video-178K/30_60_s_youtube_v0_1"
    assert mc["source_problem_type"] == "multiple choice"
    assert {i: (rows[i]["problem_type"], rows[i]["answer"]) for i in ("video-r1-3", "video-r1-4", "video-r1-5")} == {
        "video-r1-3": ("numerical", "3"),
        "video-r1-4": ("ocr", "STOP"),
        "video-r1-5": ("open_ended", "The man opens the door."),
    }
    assert rows["video-r1-4"]["images"] == ["./CLEVR-Math/images/CLEVR_train_000001.png"]
    assert "videos" not in rows["video-r1-4"] and "options" not in rows["video-r1-3"]
    assert rows["video-r1-6"]["problem_type"] == "regression"
    assert conversion.counts == {
        "multiple choice": {"multiple_choice": 2},
        "numerical": {"numerical": 1},
        "OCR": {"ocr": 1},
        "free-form": {"open_ended": 1},
        "regression": {"regression": 1},
    }
    failures = {f.path: (f.id, f.reason) for f in conversion.failures}
    assert list(failures) == [f"{video_r1}:{i}" for i in (5, 6, 7, 8, 9, 10)]
    assert "unknown problem_type 'yes/no'" in failures[f"{video_r1}:5"][1]
    assert failures[f"{video_r1}:6"][1].startswith("no <answer>...</answer> in solution 'A'")
    assert failures[f"{video_r1}:7"] == ("video-r1-9", "missing 'path'")
    assert "data_type 'audio'" in failures[f"{video_r1}:8"][1]
    assert failures[f"{video_r1}:9"] == ("video-r1-2", f"duplicate id (first at {video_r1}:0)")
    assert failures[f"{video_r1}:10"][0] == "video-r1-11"
    assert "not an option letter" in failures[f"{video_r1}:10"][1]


def test_video_r1_output_beside_the_data_is_relative_and_loads(video_r1):
    out = video_r1.parent / "train.jsonl"
    summary = convert("video-r1", video_r1, out)
    assert (summary["read"], summary["written"], summary["failed"]) == (12, 6, 6)
    assert summary["read"] == summary["written"] + summary["failed"] == summary["records"]
    assert sum(n for by_type in summary["counts"].values() for n in by_type.values()) == summary["written"]
    assert summary["problem_types"] == {
        "multiple_choice": 2,
        "numerical": 1,
        "ocr": 1,
        "open_ended": 1,
        "regression": 1,
    }
    assert summary["media_root"] is None and summary["note"] is None
    assert summary["missing_media"] == 1 and summary["missing_media_example"].endswith("missing/clip.mp4")
    assert json.loads((video_r1.parent / "train.summary.json").read_text()) == summary

    rows, failures = read_rows(out)
    assert failures == [] and check_targets(rows) == []
    assert [row.id for row in rows][:2] == ["video-r1-2", "video-r1-3"]
    assert rows[0].videos == (CLIP[2:],) and rows[2].images == ("CLEVR-Math/images/CLEVR_train_000001.png",)
    assert resolve_media_path(rows[0].videos[0], out.parent) == (video_r1.parent / CLIP).resolve()

    written = [json.loads(line) for line in (video_r1.parent / "train.failures.jsonl").read_text().splitlines()]
    assert summary["failures_file"] == str(video_r1.parent / "train.failures.jsonl")
    first_two = [(f["id"], f["path"]) for f in written][:2]
    assert first_two == [("video-r1-7", f"{video_r1}:5"), ("video-r1-8", f"{video_r1}:6")]
    assert len(written) == summary["failed"]


def test_output_elsewhere_writes_absolute_paths_under_a_media_root(video_r1, tmp_path):
    out = tmp_path / "converted" / "train.jsonl"
    summary = convert("video-r1", video_r1, out)
    root = video_r1.parent.resolve()
    assert summary["media_root"] == str(root)
    assert summary["note"] == f"media outside {out.parent.resolve()} are written as absolute paths: " + (
        f"set media.media_root to {root}"
    )
    rows, failures = read_rows(out)
    assert failures == [] and check_targets(rows) == []
    assert rows[0].videos == (str(root / CLIP[2:]),)
    for row in rows:
        for path in (*row.videos, *row.images):
            assert Path(path).is_absolute()
            assert resolve_media_path(path, out.parent, media_root=Path(summary["media_root"])).is_relative_to(root)
        with pytest.raises(OmniRLError, match="needs a configured media_root"):
            resolve_media_path((*row.videos, *row.images)[0], out.parent)


LLAVA_MC = (
    "<image>\nWhat is the person doing at the start?\n"
    "A. Cooking.\nB. Reading a book.\nC. Sleeping.\nD. Dancing.\n"
    "Answer with the option's letter from the given choices directly."
)


@pytest.fixture
def llava(tmp_path) -> Path:
    """LLaVA-Video-178K/0_30_s_academic_v0_1/*.json with its academic_source/ videos."""
    root = tmp_path / "LLaVA-Video-178K" / "0_30_s_academic_v0_1"
    touch(root / "academic_source/Charades/RW587.mp4")
    touch(root / "academic_source/Charades/ZZ001.mp4")
    touch(root / "images/cat.jpg")
    source = {"data_source": "0_30_s_academic_v0_1"}
    records = [
        {
            "id": "RW587",
            "video": "academic_source/Charades/RW587.mp4",
            "conversations": [{"from": "human", "value": LLAVA_MC}, {"from": "gpt", "value": "B."}],
            **source,
        },
        {
            "id": "ZZ001",
            "video": "academic_source/Charades/ZZ001.mp4",
            "conversations": [
                {"from": "human", "value": "<video>\nWhat color is the car?"},
                {"from": "gpt", "value": "Red."},
                {"from": "human", "value": "How many wheels?\nOptions:\n(A) Two\n(B) Four\n(C) Three"},
                {"from": "gpt", "value": "C. Three"},
                {"from": "human", "value": "Anything else?"},
            ],
            "duration": 28.5,
            **source,
        },
        {"id": "img1", "image": "images/cat.jpg", "conversations": [{"from": "human", "value": "<image>\nAnimal?"}]},
        {
            "id": "img2",
            "image": "images/cat.jpg",
            "conversations": [{"from": "human", "value": "<image>\nAnimal?"}, {"from": "gpt", "value": " "}],
        },
        {"id": "nomedia", "conversations": [{"from": "human", "value": "Hi?"}, {"from": "gpt", "value": "Hello."}]},
        {
            "id": "RW588",
            "video": "academic_source/Charades/RW587.mp4",
            "conversations": [{"from": "human", "value": LLAVA_MC}, {"from": "gpt", "value": "A. Dancing"}],
        },
        {
            "id": "RW589",
            "video": "academic_source/Charades/RW587.mp4",
            "conversations": [{"from": "human", "value": LLAVA_MC}, {"from": "gpt", "value": "E"}],
        },
    ]
    path = root / "0_30_s_academic_mc_v0_1_qa_processed.json"
    path.write_text(json.dumps(records))
    return path


def test_a_bracketed_letter_then_its_text_answers_by_letter():
    """ "(A) left" names option A as "A. left" does (it became an open_ended row, scored
    by exact match with its option lines left in the question)."""
    from omni_rl.data.convert import _llava_row

    row = _llava_row("Which way?\nOptions:\n(A) left\n(B) right", "(A) left")
    assert (row["problem"], row["problem_type"], row["answer"]) == ("Which way?", "multiple_choice", "A")
    assert row["options"] == ["left", "right"]
    assert "contradicts option A" in _llava_row("Which way?\n(A) left\n(B) right", "(A) right")


def test_llava_video_turns_become_rows(llava):
    conversion = FORMATS.get("llava-video")(llava)
    rows = {row["id"]: row for row in conversion.rows}
    assert list(rows) == ["RW587-0", "ZZ001-0", "ZZ001-1", "nomedia-0"]
    mc = rows["RW587-0"]
    assert mc["problem_type"] == "multiple_choice" and mc["answer"] == "B"
    assert mc["options"] == ["Cooking.", "Reading a book.", "Sleeping.", "Dancing."]
    assert mc["problem"] == (
        "What is the person doing at the start?\nAnswer with the option's letter from the given choices directly."
    )
    assert mc["videos"] == ["academic_source/Charades/RW587.mp4"]
    assert mc["data_source"] == "0_30_s_academic_v0_1" and "conversations" not in mc
    assert rows["ZZ001-0"] == {
        "id": "ZZ001-0",
        "problem": "What color is the car?",
        "problem_type": "open_ended",
        "answer": "Red.",
        "videos": ["academic_source/Charades/ZZ001.mp4"],
        "duration": 28.5,
        "data_source": "0_30_s_academic_v0_1",
    }
    # "(A) ..." options with an "Options:" header; "C. Three" names option C by letter and text
    second = rows["ZZ001-1"]
    assert (second["problem"], second["answer"]) == ("How many wheels?", "C")
    assert second["options"] == ["Two", "Four", "Three"]
    assert conversion.counts == {"conversation": {"multiple_choice": 2, "open_ended": 2}}
    assert rows["nomedia-0"]["problem"] == "Hi?" and not {"videos", "images"} & set(rows["nomedia-0"])  # text only
    failures = [(f.id, f.path, f.reason) for f in conversion.failures]
    assert failures == [
        ("ZZ001-2", f"{llava}:1", "turn 2: no gpt reply"),
        ("img1-0", f"{llava}:2", "turn 0: no gpt reply"),
        ("img2-0", f"{llava}:3", "turn 0: empty answer"),
        ("RW588-0", f"{llava}:5", "turn 0: answer 'A. Dancing' contradicts option A 'Cooking.'"),
        ("RW589-0", f"{llava}:6", "turn 0: answer 'E' is beyond options A-D"),
    ]


def test_llava_video_records_without_a_human_turn_are_failures_not_lost(tmp_path):
    """Speakers are matched without case ("Human"/"GPT"); a record with no human or
    user turn (OpenAI-style role/content turns) is a failure naming the speakers seen,
    where it gave no row and no failure."""
    touch(tmp_path / "v.mp4")
    records = [
        {
            "id": "caps",
            "video": "v.mp4",
            "conversations": [{"from": "Human", "value": "<video>\nColour?"}, {"from": "GPT", "value": "Red."}],
        },
        {
            "id": "roles",
            "video": "v.mp4",
            "conversations": [{"role": "user", "content": "Colour?"}, {"role": "assistant", "content": "Red."}],
        },
    ]
    path = tmp_path / "llava.json"
    path.write_text(json.dumps(records))
    conversion = FORMATS.get("llava-video")(path)
    assert [(r["id"], r["answer"]) for r in conversion.rows] == [("caps-0", "Red.")]
    assert [(f.id, f.path, f.reason) for f in conversion.failures] == [
        ("roles", f"{path}:1", "no turn from 'human' or 'user' (the turns' 'from': None, None)")
    ]
    assert conversion.records == 2


def test_llava_video_jsonl_names_lines_and_loads(llava, tmp_path):
    records = json.loads(llava.read_text())
    jsonl = llava.with_suffix(".jsonl")
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in records[:3]) + "{not json\n")
    out = llava.parent / "rows.jsonl"
    summary = convert("llava-video", jsonl, out)
    assert (summary["records"], summary["read"], summary["written"], summary["failed"]) == (4, 6, 3, 3)
    failures = [json.loads(line) for line in Path(summary["failures_file"]).read_text().splitlines()]
    assert [(f["id"], f["path"]) for f in failures] == [
        ("ZZ001-2", f"{jsonl}:2"),
        ("img1-0", f"{jsonl}:3"),
        (None, f"{jsonl}:4"),
    ]
    assert failures[-1]["reason"].startswith("invalid JSON line")
    rows, read_failures = read_rows(out)
    assert read_failures == [] and check_targets(rows) == []
    assert [row.problem_type for row in rows] == ["multiple_choice", "open_ended", "multiple_choice"]
    assert rows[0].videos == ("academic_source/Charades/RW587.mp4",) and summary["missing_media"] == 0


def test_write_conversion_relocates_relative_and_absolute_paths(tmp_path):
    src_root, media = tmp_path / "src", tmp_path / "elsewhere" / "clips"
    touch(src_root / "out" / "v/a.mp4")
    touch(media / "b.mp4")
    conversion = Conversion()
    base = {"problem": "Which?", "problem_type": "multiple_choice", "answer": "A", "options": ["x", "y"]}
    conversion.add({**base, "id": "rel", "videos": ["out/v/a.mp4"]}, "in:0", "mc")
    conversion.add({**base, "id": "abs-in", "videos": [str(src_root / "out/v/a.mp4")]}, "in:1", "mc")
    conversion.add({**base, "id": "abs-out", "videos": [str(media / "b.mp4")], "audios": ["../x.wav"]}, "in:2", "mc")
    conversion.add({**base, "id": "bad", "answer": "C"}, "in:3", "mc")
    (src_root / "out" / "linked").symlink_to(media)  # the loader follows it out of out/
    conversion.add({**base, "id": "link", "videos": ["out/linked/b.mp4"]}, "in:4", "mc")
    out = src_root / "out" / "rows.jsonl"
    summary = write_conversion(conversion, src_root, out)
    written = {row["id"]: row for row in map(json.loads, out.read_text().splitlines())}
    assert written["rel"]["videos"] == written["abs-in"]["videos"] == ["v/a.mp4"]
    assert written["abs-out"]["videos"] == written["link"]["videos"] == [str((media / "b.mp4").resolve())]
    assert written["abs-out"]["audios"] == [str((tmp_path / "x.wav").resolve())]  # src/../x.wav: outside out/
    assert summary["media_root"] == str(tmp_path.resolve())  # holds x.wav and elsewhere/clips/
    assert summary["missing_media"] == 1 and summary["failed"] == 1

    # a clean rerun removes the failures file of the earlier one
    conversion.failures.clear()
    assert write_conversion(conversion, src_root, out)["failures_file"] is None
    assert not (src_root / "out" / "rows.failures.jsonl").exists()


def test_cli_prints_the_table_and_strict_fails_on_bad_rows(video_r1, tmp_path, capsys):
    out = tmp_path / "converted" / "train.jsonl"
    assert main(["data", "convert", "--from", "video-r1", str(video_r1), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    table = [line.split() for line in printed.splitlines()]
    assert ["multiple", "choice", "multiple_choice", "2"] in table and ["OCR", "ocr", "1"] in table
    assert "read 12, written 6, failed 6" in printed
    assert f"failures: {tmp_path / 'converted' / 'train.failures.jsonl'}" in printed
    assert f"set media.media_root to {video_r1.parent.resolve()}" in printed
    assert "media files not found: 1" in printed
    assert main(["data", "convert", "--from", "video-r1", str(video_r1), "--out", str(out), "--strict"]) == 1
    clean = tmp_path / "clean.json"
    clean.write_text(json.dumps(json.loads(video_r1.read_text())[:5]))
    assert main(["data", "convert", "--from", "video-r1", str(clean), "--out", str(out), "--strict"]) == 0
    # every row failing (here: the wrong format named) exits 1, as preprocess does, strict or not
    capsys.readouterr()
    assert main(["data", "convert", "--from", "llava-video", str(video_r1), "--out", str(out)]) == 1
    assert f"{video_r1}: every row failed" in capsys.readouterr().err
    # an --out that is a directory is refused before converting (it raised IsADirectoryError after)
    for folder in (str(tmp_path), "."):
        assert main(["data", "convert", "--from", "video-r1", str(video_r1), "--out", folder]) == 2
        assert f"data convert --out {folder}: a directory; name the file to write" in capsys.readouterr().err


def test_cli_rejects_unknown_formats_and_bad_files(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["data", "convert", "--from", "video_r1", "x.json", "--out", str(tmp_path / "o.jsonl")])
    error = capsys.readouterr().err
    assert "invalid choice: 'video_r1'" in error and "'video-r1'" in error and "'llava-video'" in error
    assert set(FORMATS) <= set(DATA_FORMATS)  # every registered format is offered by --from
    bad = tmp_path / "bad.json"
    bad.write_text('{"problem_id": 1}')
    assert main(["data", "convert", "--from", "video-r1", str(bad), "--out", str(tmp_path / "o.jsonl")]) == 2
    assert "expected a JSON list of records, got dict" in capsys.readouterr().err
    assert main(["data", "convert", "--from", "video-r1", str(bad), "--out", str(bad)]) == 2
    assert "would overwrite the input" in capsys.readouterr().err


def test_llava_video_media_tokens_place_the_records_videos(tmp_path):
    """LLaVA writes <image> for a video too. Only a leading token left the question, so
    a trailing one, or a second video's, stayed as an <image> placeholder the row had no
    image for: convert and rewards check passed it, and every draw of the row failed.
    In a record of videos the token now names a video; one more than the record's media
    is a failure; a record with no media, or an empty list beside an image, converts."""
    touch(tmp_path / "a.mp4")
    touch(tmp_path / "b.mp4")
    touch(tmp_path / "c.png")

    def record(rid, question, **media):
        return {
            "id": rid,
            **media,
            "conversations": [{"from": "human", "value": question}, {"from": "gpt", "value": "Red."}],
        }

    records = [
        record("trail", "Describe the video.\n<image>", video="a.mp4"),
        record("two", "<image>\n<image>\nWhich is longer?", video=["a.mp4", "b.mp4"]),
        record("three", "<image>\n<image>\nWhich?", video="a.mp4"),
        record("text", "Say hello."),
        record("empty", "<image>\nWhat is shown?", video=[], image="c.png"),
    ]
    path = tmp_path / "llava.json"
    path.write_text(json.dumps(records))
    conversion = FORMATS.get("llava-video")(path)
    rows = {row["id"]: row for row in conversion.rows}
    assert rows["trail-0"]["problem"] == "Describe the video.\n<video>"
    assert rows["two-0"]["problem"] == "<video>\nWhich is longer?"
    assert "videos" not in rows["text-0"] and "images" not in rows["text-0"]
    assert rows["empty-0"]["images"] == ["c.png"] and "videos" not in rows["empty-0"]
    assert [(f.id, f.reason) for f in conversion.failures] == [
        ("three-0", "turn 0: the problem has 2 <video> placeholder(s) and the row 1 video(s): each places one of them")
    ]
    out = tmp_path / "rows.jsonl"
    write_conversion(conversion, tmp_path, out)
    loaded, failures = read_rows(out)
    assert {r.id for r in loaded} == set(rows) and not failures


def test_a_row_with_more_placeholders_than_media_is_refused_as_it_loads(tmp_path):
    """A hand-written row whose problem holds an <image> it has no image for passed
    the loader and `rewards check --strict`, and failed at every draw."""
    path = tmp_path / "rows.jsonl"
    good = {
        "id": "g",
        "problem": "<video>\nWhich way?",
        "problem_type": "open_ended",
        "answer": "left",
        "videos": ["v.mp4"],
    }
    bad = {**good, "id": "b", "problem": "Describe it.\n<image>"}
    two = {**good, "id": "t", "problem": "<video> then <video>?"}
    path.write_text("".join(json.dumps(r) + "\n" for r in (good, bad, two)))
    rows, failures = read_rows(path)
    assert [r.id for r in rows] == ["g"]
    assert [(f.id, f.path, f.reason) for f in failures] == [
        ("b", f"{path}:2", "the problem has 1 <image> placeholder(s) and the row 0 image(s): each places one of them"),
        ("t", f"{path}:3", "the problem has 2 <video> placeholder(s) and the row 1 video(s): each places one of them"),
    ]


def test_llava_video_options_across_blank_lines_and_an_answer_phrase_stay_multiple_choice():
    """Options with blank lines between them, or an answer written "Answer: B", became
    open_ended rows with gold "B" (or "Answer: B"), which no answer but that exact
    string scored. Options written on one line are not read: such a turn with a letter
    answer is a failure saying so, not an open_ended row."""
    from omni_rl.data.convert import _llava_row

    spaced = _llava_row("Which way?\n\nA. left\n\nB. right\n\nC. up", "B")
    assert (spaced["problem_type"], spaced["answer"], spaced["problem"]) == ("multiple_choice", "B", "Which way?")
    assert spaced["options"] == ["left", "right", "up"]
    for answer in ("Answer: B", "The answer is B.", "Answer: (B) right"):
        row = _llava_row("Which way?\nA. left\nB. right", answer)
        assert (row["problem_type"], row["answer"]) == ("multiple_choice", "B"), answer
    inline = _llava_row("Which way? A. left B. right C. up", "B")
    assert inline == "answer 'B' is a letter, but the options are not one to a line (A. ..., B. ...): none was read"
    assert _llava_row("Which letter is on the sign?", "A")["problem_type"] == "open_ended"  # no options at all
