"""The training-side dataset: cache modes, placeholders, and cache == raw bit for bit."""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest
import torch

from omni_rl.data.dataset import MediaDataset, build_messages, encode_sample
from omni_rl.errors import OmniRLError
from omni_rl.models import FAMILIES, load
from omni_rl.preprocess.cache import MediaCache
from omni_rl.preprocess.image import ImageBudget
from omni_rl.preprocess.index import DatasetIndex
from omni_rl.preprocess.pipeline import Budgets, preprocess
from omni_rl.preprocess.synthetic import moving_square, tone, write_image, write_video, write_wav
from omni_rl.preprocess.video import VideoBudget
from omni_rl.recipe_loader import load_config


def small_budgets(family: str, use_audio_in_video: bool = False) -> Budgets:
    patch = FAMILIES.get(family).patch_size or 14
    f2 = (2 * patch) ** 2
    return Budgets(
        VideoBudget(patch_size=patch, min_frames=2, min_pixels=4 * f2, max_pixels=16 * f2),
        ImageBudget(patch_size=patch, min_pixels=4 * f2, max_pixels=32 * f2),
        max_audio_seconds=2.0,
        use_audio_in_video=use_audio_in_video,
    )


@pytest.fixture(scope="module")
def dataset_file(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    write_video(root / "m" / "a.mp4", moving_square("right", 2.0, 10, 120, 90), 10)
    write_video(root / "m" / "b.mp4", moving_square("down", 3.0, 10, 90, 120), 10)
    write_image(root / "m" / "i.png", np.random.default_rng(1).integers(0, 255, (70, 50, 3), dtype=np.uint8))
    write_wav(root / "m" / "t.wav", tone(1.5, hz=300.0))
    rows = [
        {"id": "video", "problem": "Which way?", "videos": ["m/a.mp4"], "options": ["left", "right"]},
        {"id": "two", "problem": "First <video> then <image>. Same?", "videos": ["m/b.mp4"], "images": ["m/i.png"]},
        {"id": "audio", "problem": "What pitch?", "audios": ["m/t.wav"], "data_source": "tones"},
        {"id": "all", "problem": "Describe.", "images": ["m/i.png"], "videos": ["m/a.mp4"], "audios": ["m/t.wav"]},
    ]
    path = root / "data.jsonl"
    path.write_text("".join(json.dumps({"problem_type": "open_ended", "answer": "x", **r}) + "\n" for r in rows))
    return path


def rows_for(family: str) -> list[str]:
    modalities = set(FAMILIES.get(family).modalities)
    need = {"video": {"video"}, "two": {"video", "image"}, "audio": {"audio"}, "all": {"image", "video", "audio"}}
    return [row for row, kinds in need.items() if kinds <= modalities]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_inputs_from_cache_equal_inputs_from_raw_files(family, dataset_file, tiny_checkpoint, tmp_path):
    budgets = small_budgets(family)
    cache = tmp_path / "cache"
    report = preprocess(dataset_file, cache, budgets, workers=1, progress=False)
    assert report.failed == 0
    raw = MediaDataset(dataset_file, budgets, cache_mode="no_cache")
    cached = MediaDataset(dataset_file, budgets, cache=cache, cache_mode="cache_only")
    _, processor = load(tiny_checkpoint(family))
    wanted = rows_for(family)
    assert wanted
    for index, row in enumerate(raw.rows):
        if row.id not in wanted:
            continue
        a = encode_sample(processor, raw[index])
        b = encode_sample(processor, cached[index])
        assert set(a) == set(b)
        for name in a:
            if isinstance(a[name], torch.Tensor):
                assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), (family, row.id, name)
            else:
                assert a[name] == b[name]
    assert cached.cache_hits > 0 and cached.cache_misses == 0


@pytest.mark.parametrize("family", ["qwen2_audio", "qwen2_5_vl"])
def test_a_row_with_media_its_model_cannot_take_is_refused_not_encoded_without_them(
    family, dataset_file, tiny_checkpoint
):
    _, processor = load(tiny_checkpoint(family))
    modalities = FAMILIES.get(family).modalities
    dataset = MediaDataset(dataset_file, small_budgets(family), cache_mode="no_cache")
    taken = rows_for(family)
    for index, row in enumerate(dataset.rows):
        if row.id in taken:
            assert dataset.encoded(index, processor) is not None, row.id
            continue
        assert dataset.encoded(index, processor) is None, row.id
        media = {"images": ("image", row.images), "videos": ("video", row.videos), "audio": ("audio", row.audios)}
        untaken = " or ".join(name for name, (kind, paths) in media.items() if paths and kind not in modalities)
        assert dataset.bad[row.id].reason.startswith(f"{type(processor).__name__} takes no {untaken};")
    assert dataset.cache_metrics()["skipped/bad_rows"] == len(dataset.rows) - len(taken) > 0


def test_cache_modes(dataset_file, tmp_path):
    budgets = small_budgets("qwen2_5_vl")
    cache = tmp_path / "cache"
    preprocess(dataset_file, cache, budgets, workers=1, limit=1, progress=False)
    prefer = MediaDataset(dataset_file, budgets, cache=cache)
    prefer[0]
    assert (prefer.cache_hits, prefer.cache_misses) == (1, 0)
    prefer[1]  # not preprocessed: decoded from the raw files
    assert prefer.cache_misses == 2
    # cache_only: rows the index cannot name are refused when the dataset loads (file, row, reason)
    only = MediaDataset(dataset_file, budgets, cache=cache, cache_mode="cache_only")
    assert [r.id for r in only.rows] == ["video"] and only[0].videos
    refused = {f.id: (f.path, f.reason) for f in only.failures}
    assert refused["two"][0] == f"{dataset_file}:2" and "i.png: not in the cache index" in refused["two"][1]
    assert only.load_report() == {"data/rows_read": 4, "data/rows_used": 1, "data/rows_refused": 3}
    other = small_budgets("qwen3_vl")  # a different patch size is a different key: the miss names it
    stale = MediaDataset(dataset_file, other, cache=cache, cache_mode="cache_only")
    reason = next(f.reason for f in stale.failures if f.id == "video")
    assert "a.mp4: not preprocessed with these media settings: " in reason
    assert "video.patch_size: cached 14, this run 16" in reason
    assert "--config CONFIG" in reason
    with pytest.raises(OmniRLError, match="needs a cache directory"):
        MediaDataset(dataset_file, budgets, cache_mode="cache_only")


def copy_dataset(dataset_file, out):
    import shutil

    shutil.copytree(dataset_file.parent, out)
    return out / "data.jsonl"


def test_cache_only_reads_every_sample_with_the_raw_media_deleted(dataset_file, tmp_path):
    import shutil

    data = copy_dataset(dataset_file, tmp_path / "copy")
    budgets = small_budgets("qwen2_5_omni_thinker")  # every row's media: video, image and audio
    report = preprocess(data, tmp_path / "cache", budgets, workers=1, progress=False)
    assert report.failed == 0
    raw = MediaDataset(data, budgets, cache_mode="no_cache")
    expected = [raw[i] for i in range(len(raw))]
    shutil.rmtree(data.parent / "m")
    cached = MediaDataset(data, budgets, cache=tmp_path / "cache", cache_mode="cache_only")
    for want, got in zip(expected, (cached[i] for i in range(len(cached))), strict=True):
        assert [c.frames.tobytes() for c in got.videos] == [c.frames.tobytes() for c in want.videos]
        assert [i.tobytes() for i in got.images] == [i.tobytes() for i in want.images]
        assert [a.tobytes() for a in got.audios] == [a.tobytes() for a in want.audios]
    assert cached.cache_hits == 7 and cached.cache_misses == 0
    # prefer_cache needs no raw file either once a medium is indexed
    assert MediaDataset(data, budgets, cache=tmp_path / "cache")[3].videos


def refusal(dataset, row_id):
    """(where, reason) of a row the dataset refused when it loaded."""
    return next((f.path, f.reason) for f in dataset.failures if f.id == row_id)


def test_cache_only_errors_name_the_file_the_row_and_the_reason(dataset_file, tmp_path):
    budgets = small_budgets("qwen2_5_vl")
    cache = tmp_path / "cache"
    data = copy_dataset(dataset_file, tmp_path / "copy")
    # found when the dataset loads: the row is refused with its file, row and reason
    where, reason = refusal(MediaDataset(data, budgets, cache=cache, cache_mode="cache_only"), "video")
    assert where == f"{data}:1" and re.search(r"a\.mp4: the cache .* has no index of", reason)
    preprocess(data, cache, budgets, workers=1, progress=False)
    rows = data.read_text().splitlines()
    (data.parent / "more.jsonl").write_text("\n".join(rows) + "\n")  # another dataset file shares the media
    only = MediaDataset(data, budgets, cache=cache, cache_mode="cache_only")
    where, reason = refusal(
        MediaDataset(data.parent / "more.jsonl", budgets, cache=cache, cache_mode="cache_only"), "video"
    )
    assert where.endswith("more.jsonl:1") and "a.mp4: the cache" in reason and "has no index of" in reason
    # a file changed after the dataset loaded: reading the row says so
    write_video(data.parent / "m" / "b.mp4", moving_square("left", 3.0, 10, 90, 120), 10)
    with pytest.raises(OmniRLError, match=r"data\.jsonl:2: row 'two': .*b\.mp4: the file changed since it was"):
        only[1]
    data.write_text(rows[0].replace("m/a.mp4", "m/b.mp4") + "\n" + "\n".join(rows[1:]) + "\n")
    where, reason = refusal(MediaDataset(data, budgets, cache=cache, cache_mode="cache_only"), "video")
    assert where == f"{data}:1" and "b.mp4: the row's media changed" in reason
    MediaCache(cache).remove(next(iter(DatasetIndex(MediaCache(cache), data).rows["audio"][0].keys.values())))
    gone = MediaDataset(data, budgets, cache=cache, cache_mode="cache_only")
    with pytest.raises(OmniRLError, match=r"data\.jsonl:3: row 'audio': .*t\.wav: its entry \w+ is not in the cache"):
        gone[[r.id for r in gone.rows].index("audio")]


def test_a_changed_source_file_is_redecoded_and_unchanged_ones_are_not_hashed(dataset_file, tmp_path, monkeypatch):
    from omni_rl.preprocess import pipeline

    data = copy_dataset(dataset_file, tmp_path / "copy")
    budgets = small_budgets("qwen2_5_omni_thinker")
    preprocess(data, tmp_path / "cache", budgets, workers=1, progress=False)
    write_video(data.parent / "m" / "a.mp4", moving_square("left", 2.0, 10, 120, 90), 10)
    hashed = []
    digest = pipeline.file_digest
    monkeypatch.setattr(pipeline, "file_digest", lambda path: hashed.append(path.name) or digest(path))
    ds = MediaDataset(data, budgets, cache=tmp_path / "cache")
    samples = [ds[i] for i in range(len(ds))]
    assert sorted(hashed) == ["a.mp4", "a.mp4"]  # rows 'video' and 'all'; b.mp4, i.png, t.wav only stat'ed
    assert (ds.cache_hits, ds.cache_misses) == (5, 2)
    assert ds.cache_metrics()["data/index_misses"] == 2  # the changed file, counted and logged once
    clip = samples[0].videos[0]
    red_x = np.nonzero(clip.frames[:, 0] > 128)
    first = red_x[2][red_x[0] == 0].mean()
    last = red_x[2][red_x[0] == len(clip.frames) - 1].mean()
    assert last < first  # the new file's content (moving left), not the cached clip


def test_samples_carry_row_fields(dataset_file):
    ds = MediaDataset(dataset_file, small_budgets("qwen2_5_omni_thinker", use_audio_in_video=False))
    video, two, audio = ds[0], ds[1], ds[2]
    assert video.options == ["left", "right"] and video.problem_type == "open_ended"
    assert audio.data_source == "tones" and audio.audios[0].dtype == np.float32
    assert [p["type"] for p in two.messages[0]["content"]] == ["text", "video", "text", "image", "text"]


def test_build_messages_places_media():
    assert build_messages("Why?", ["image", "video"])[0]["content"] == [
        {"type": "image"},
        {"type": "video"},
        {"type": "text", "text": "Why?"},
    ]
    content = build_messages("<video>image<image>", ["image", "video"])[0]["content"]
    assert content == [{"type": "video"}, {"type": "text", "text": "image"}, {"type": "image"}]
    with pytest.raises(OmniRLError, match="more <audio> placeholders"):
        build_messages("<audio>", ["image"])


def test_loading_routes_problem_types_and_checks_gold_answers(tmp_path):
    path = tmp_path / "d.jsonl"
    rows = [
        {"id": "ok", "problem": "p", "problem_type": "counting", "answer": 2},
        {"id": "bad-gold", "problem": "p", "problem_type": "multiple_choice", "answer": "Z", "options": ["a", "b"]},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    budgets = small_budgets("qwen2_5_vl")
    ds = MediaDataset(path, budgets)
    assert [r.id for r in ds.rows] == ["ok"]
    assert [(f.id, f.path) for f in ds.failures] == [("bad-gold", f"{path}:2")]
    with pytest.raises(OmniRLError, match=r"d\.jsonl:2 bad-gold: multiple_choice answer 'Z'"):
        MediaDataset(path, budgets, strict=True)
    rows = [{"id": f"x{i}", "problem": "p", "problem_type": "countin", "answer": 1} for i in range(4)]
    path.write_text("".join(json.dumps(r) + "\n" for r in [*rows, {**rows[0], "id": "y", "problem_type": "mcq2"}]))
    with pytest.raises(OmniRLError) as err:  # every unknown type, its count and rows, before anything is built
        MediaDataset(path, budgets)
    assert "unknown problem type 'countin' (did you mean 'counting'?); known: " in str(err.value)
    assert f"in 4 rows: {path}:1 x0, {path}:2 x1, {path}:3 x2 ..." in str(err.value)
    assert "unknown problem type 'mcq2'" in str(err.value) and f"in 1 rows: {path}:5 y" in str(err.value)


def test_an_eval_sets_limit_is_reported_as_rows_left_out(dataset_file, tmp_path):
    """The run's summary adds an eval set's rows up: read = used + refused + left out by
    ``limit`` (the limit's rows were missing from every count)."""
    from omni_rl.evaluation.during_training import HeldOut

    limited = f"data.eval=[{{data: {dataset_file}, limit: 2}}]"
    cfg = load_config(None, [f"data.train={dataset_file}", limited, "media.max_frames=4"], recipe="sft")
    (dataset,) = HeldOut(cfg, tmp_path, "qwen2_5_vl").datasets().values()
    report = dataset.load_report()
    assert (report["data/rows_read"], report["data/rows_used"], report["data/rows_left_out"]) == (4, 2, 2)
    assert report["data/rows_read"] == report["data/rows_used"] + report["data/rows_refused"] + 2


def test_image_rows_carry_the_recorded_sizes_for_box_scoring(tmp_path):
    from omni_rl.rewards import score

    write_image(tmp_path / "i.png", np.zeros((100, 200, 3), dtype=np.uint8))
    path = tmp_path / "d.jsonl"
    path.write_text(
        json.dumps(
            {
                "id": "box",
                "problem": "Where?",
                "problem_type": "spatial_grounding",
                "answer": [0, 0, 100, 50],
                "images": ["i.png"],
                "box_space": "pixel",
                "prediction_space": "resized",
            }
        )
        + "\n"
    )
    sample = MediaDataset(path, small_budgets("qwen2_5_vl"))[0]
    assert sample.fields["image_size"] == [100, 200]
    h, w = sample.fields["resized_size"]
    assert (h, w) == tuple(sample.images[0].shape[:2])
    # the top-left quarter in the resized image's pixels is the gold box
    fields = {k: sample.fields[k] for k in ("box_space", "prediction_space", "image_size", "resized_size")}
    result = score("spatial_grounding", f"<answer>[0, 0, {w / 2}, {h / 2}]</answer>", sample.answer, **fields)
    assert result.accuracy == pytest.approx(1.0)


def test_evaluation_scores_boxes_with_the_sizes_training_scores_them_with(tmp_path, monkeypatch):
    """A box in another space than the gold's converts through the image's recorded
    sizes, which the dataset adds to a sample, not to its row: evaluation scores each
    answer with its sample's fields (it read 0, a conversion error, where training 1)."""
    from omni_rl.evaluation import pipeline

    write_image(tmp_path / "i.png", np.zeros((100, 200, 3), dtype=np.uint8))
    path = tmp_path / "d.jsonl"
    row = {"id": "box", "problem": "Where?", "problem_type": "spatial_grounding", "answer": [0, 0, 100, 50]}
    path.write_text(json.dumps({**row, "images": ["i.png"], "box_space": "pixel", "prediction_space": "resized"}))

    def answer_rows(model, processor, dataset, sampling, samples, indices, *rest):
        # the top-left quarter, in the resized image's pixels: the gold box
        answered = [(dataset[i], dataset[i].fields["resized_size"]) for i in indices]
        return [(sample, [f"<answer>[0, 0, {w / 2}, {h / 2}]</answer>"]) for sample, (h, w) in answered], []

    monkeypatch.setattr(pipeline, "answer_rows", answer_rows)
    summary = pipeline.evaluate_rows(None, None, MediaDataset(path, small_budgets("qwen2_5_vl")), progress=False)
    assert summary["row_accuracy"] == {"box": pytest.approx(1.0)}


def test_a_row_can_ask_for_its_videos_audio_track(tmp_path):
    frames = np.stack([np.full((64, 64, 3), i * 20, np.uint8) for i in range(10)])
    write_video(tmp_path / "av.mp4", frames, 10, audio=tone(1.0))
    path = tmp_path / "d.jsonl"
    rows = [
        {"id": "plain", "videos": ["av.mp4"]},
        {"id": "with-audio", "videos": ["av.mp4"], "use_audio_in_video": True},
    ]
    path.write_text(
        "".join(json.dumps({"problem": "p", "problem_type": "counting", "answer": 1, **r}) + "\n" for r in rows)
    )
    ds = MediaDataset(path, small_budgets("qwen2_5_omni_thinker"))
    assert ds[0].video_audios == [] and len(ds[1].video_audios) == 1


def bad_rows_file(tmp_path):
    """Rows: a good video (line 1); one whose mp4 is cut off half way (line 2); one that
    asks for its video's sound, which Qwen2.5-VL's processor cannot take (line 3)."""
    write_video(tmp_path / "m" / "a.mp4", moving_square("right", 1.0, 10, 64, 64), 10, audio=tone(1.0))
    whole = (tmp_path / "m" / "a.mp4").read_bytes()
    (tmp_path / "m" / "cut.mp4").write_bytes(whole[: len(whole) // 2])
    rows = [
        {"id": "good", "videos": ["m/a.mp4"]},
        {"id": "undecodable", "videos": ["m/cut.mp4"]},
        {"id": "heard", "videos": ["m/a.mp4"], "use_audio_in_video": True},
    ]
    path = tmp_path / "data.jsonl"
    path.write_text(
        "".join(json.dumps({"problem": "p", "problem_type": "counting", "answer": 1, **r}) + "\n" for r in rows)
    )
    return path


def test_a_bad_row_is_reported_once_counted_and_skipped_and_a_bug_is_not(
    tmp_path, tiny_checkpoint, caplog, monkeypatch
):
    path = bad_rows_file(tmp_path)
    budgets = small_budgets("qwen2_5_vl")
    _, processor = load(tiny_checkpoint("qwen2_5_vl"))
    dataset = MediaDataset(path, budgets)
    assert len(dataset) == 3  # every file is there: nothing is refused at load
    with caplog.at_level("WARNING", logger="omni_rl.data.dataset"):
        sample, inputs = dataset.encoded(0, processor)
        assert sample.id == "good" and inputs["input_ids"].shape[0] == 1
        assert dataset.encoded(1, processor) is None and dataset.encoded(2, processor) is None
        assert dataset.encoded(1, processor) is None  # drawn again: skipped without a second report
    reported = [r.getMessage() for r in caplog.records if r.name == "omni_rl.data.dataset"]
    cut = (tmp_path / "m" / "cut.mp4").resolve()
    assert len(reported) == 2
    assert reported[0].startswith(f"{path}:2: row 'undecodable': {cut}: cannot decode video (")
    assert reported[1].startswith(f"{path}:3: row 'heard': ") and "use_audio_in_video needs Omni" in reported[1]
    assert all(m.endswith(" (row skipped; counted in skipped/bad_rows)") for m in reported)
    assert dataset.cache_metrics()["skipped/bad_rows"] == 2
    assert [(f.id, f.path) for f in dataset.bad.values()] == [("undecodable", f"{path}:2"), ("heard", f"{path}:3")]
    # data.strict: the first bad row is an error naming it
    strict = MediaDataset(path, budgets, strict=True)
    with pytest.raises(
        OmniRLError, match=rf"^{re.escape(str(path))}:2: row 'undecodable': .*cannot decode video.*data\.strict"
    ):
        strict.encoded(1, processor)
    # a processor refusing its inputs (ValueError) is a bad row; any other error is a bug and is raised
    import omni_rl.data.dataset as module

    def refuses(*args, **kwargs):
        raise ValueError("image features and image tokens do not match")

    monkeypatch.setattr(module, "encode_prompts", refuses)
    assert dataset.encoded(0, processor) is None
    assert dataset.bad["good"].reason.endswith("cannot encode it: image features and image tokens do not match")

    def bug(*args, **kwargs):
        raise TypeError("unexpected keyword argument")

    monkeypatch.setattr(module, "encode_prompts", bug)
    fresh = MediaDataset(path, budgets)
    with pytest.raises(TypeError):
        fresh.encoded(0, processor)
    assert fresh.cache_metrics()["skipped/bad_rows"] == 0


def test_rows_listed_in_the_caches_failures_are_refused_at_load(tmp_path):
    path = bad_rows_file(tmp_path)
    with open(path, "a") as f:  # line 4: a second 'good', refused as a duplicate id (not its first row)
        f.write(json.dumps({"id": "good", "problem": "p", "problem_type": "counting", "answer": 1}) + "\n")
    budgets = small_budgets("qwen2_5_vl")
    cache = tmp_path / "cache"
    preprocess(path, cache, budgets, workers=1, progress=False)
    listed = [json.loads(line) for line in (cache / "failures.jsonl").read_text().splitlines()]
    assert {(f["id"], f["path"]) for f in listed} == {("good", f"{path}:4"), ("undecodable", f"{path}:2")}
    dataset = MediaDataset(path, budgets, cache)
    assert [r.id for r in dataset.rows] == ["good", "heard"]
    refused = {f.path: f.reason for f in dataset.failures}
    assert refused[f"{path}:4"].startswith("duplicate id")
    why = refused[f"{path}:2"]
    assert "cannot decode video" in why and f"preprocess could not cache it, {cache / 'failures.jsonl'}" in why
    assert dataset.load_report() == {"data/rows_read": 4, "data/rows_used": 2, "data/rows_refused": 2}
    with pytest.raises(OmniRLError, match=r"data\.strict: 2 rows refused"):
        MediaDataset(path, budgets, cache, strict=True)
    # another dataset sharing the cache, with a row of the same id on the same line, is not refused
    other = tmp_path / "other" / "data.jsonl"
    shutil.copytree(tmp_path / "m", other.parent / "m")
    other.write_text(path.read_text())
    assert "undecodable" in [r.id for r in MediaDataset(other, budgets, cache).rows]
    # no_cache reads no cache, nor its failures: the row fails when read, and is skipped then
    assert "undecodable" in [r.id for r in MediaDataset(path, budgets, cache, "no_cache").rows]


def test_a_bad_row_found_on_two_ranks_counts_once(tmp_path, monkeypatch):
    """Rows are dealt afresh every epoch, so a row one rank found bad can be read again
    on another: ``skipped/bad_rows`` counts the rows, not the finds (two ranks, a row
    found by both and one by rank 1: 2, where the ranks' counts sum to 3). The other
    rank is stood in for by what the collectives return."""
    from omni_rl.data import dataset as dataset_module
    from omni_rl.errors import RowFailure
    from omni_rl.preprocess.config import MediaConfig

    data = tmp_path / "rows.jsonl"
    rows = [{"id": f"bad-{i}", "problem": "Which way?", "problem_type": "free_form", "answer": "left"} for i in (0, 1)]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    here = MediaDataset(data, Budgets.from_config(MediaConfig()), cache_mode="no_cache")
    here.bad["bad-0"] = RowFailure("bad-0", str(data), "its clip does not decode")
    other = {"bad-0": None, "bad-1": None}  # what the other rank found
    distributed = dataset_module.distributed
    monkeypatch.setattr(distributed, "gather_objects", lambda items: [*items, *other])
    theirs = {"skipped/bad_rows": len(other)}  # the other rank's counters (its reads: none)
    monkeypatch.setattr(distributed, "sum_counts", lambda counts: {k: v + theirs.get(k, 0) for k, v in counts.items()})
    assert here.cache_metrics()["skipped/bad_rows"] == 1
    assert here.run_metrics()["skipped/bad_rows"] == 2


def test_options_written_with_their_letters_are_lettered_once():
    """Options given as "A. chair", "B. table" (raw Video-R1 or LLaVA-Video style rows)
    became "A. A. chair" in the prompt, where the scorer and data convert drop the
    labels; options that only look labelled keep their text, and {option_list} (R1-AQA's
    Python list) shows them as given."""
    from omni_rl.data.dataset import render_prompt
    from omni_rl.preprocess.rows import check_row

    def prompt(options, template="{problem}{options}"):
        row = check_row(
            {"id": "r", "problem": "Which?", "problem_type": "multiple_choice", "answer": "B", "options": options}
        )
        return render_prompt(template, row)

    assert prompt(["A. chair", "B. table", "C. lamp"]) == "Which?\nOptions:\nA. chair\nB. table\nC. lamp"
    assert prompt(["(A) chair", "(B) table"]) == "Which?\nOptions:\nA. chair\nB. table"
    assert prompt(["(A) chair", "(B) table"], "{option_list}") == "['(A) chair', '(B) table']"  # as given
    assert prompt(["F. Scott Fitzgerald", "B. Shaw"]) == "Which?\nOptions:\nA. F. Scott Fitzgerald\nB. B. Shaw"
