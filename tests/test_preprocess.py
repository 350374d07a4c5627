"""The offline media pipeline: qwen-vl-utils' rules, audio, rows, the cache and its CLI."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import torch
from PIL import Image
from qwen_vl_utils import vision_process as qvu

from omni_rl.cli import main
from omni_rl.errors import OmniRLError
from omni_rl.preprocess.audio import read_audio
from omni_rl.preprocess.cache import MediaCache, entry_key
from omni_rl.preprocess.image import ImageBudget, read_image
from omni_rl.preprocess.pipeline import Budgets, decode_medium
from omni_rl.preprocess.rows import read_rows, resolve_media_path
from omni_rl.preprocess.synthetic import moving_square, tone, write_image, write_video, write_wav
from omni_rl.preprocess.video import VideoBudget, read_video


@pytest.mark.parametrize(
    ("width", "height", "budget"),
    [
        (160, 120, {}),
        (640, 480, {"max_pixels": 128 * 28 * 28}),
        (100, 300, {"min_pixels": 4 * 28 * 28, "max_pixels": 64 * 28 * 28}),
        (320, 180, {"total_pixels": 2 * 96 * 28 * 28}),
        (320, 180, {"patch_size": 16, "min_pixels": 16 * 32 * 32, "max_pixels": 96 * 32 * 32}),
    ],
)
def test_video_frames_equal_qwen_vl_utils(tmp_path, width, height, budget):
    path = write_video(tmp_path / "v.mp4", moving_square("left", 3.0, 10, width, height), 10)
    budget = VideoBudget(**budget)
    clip = read_video(path, budget)
    ele = {"video": str(path), "fps": 2.0}
    ele |= {
        k: v
        for k, v in (
            ("min_pixels", budget.min_pixels),
            ("max_pixels", budget.max_pixels),
            ("total_pixels", budget.total_pixels),
        )
        if v is not None
    }
    reference, meta = qvu.fetch_video(ele, image_patch_size=budget.patch_size, return_video_metadata=True)
    assert clip.indices == meta["frames_indices"]
    ours = torch.from_numpy(clip.frames).float()
    assert ours.shape == reference.shape
    assert torch.equal(ours, reference)
    assert clip.original_size == (height - height % 2, width - width % 2)


def test_8k_frames_are_clamped_by_the_budget(tmp_path):
    frames = np.zeros((4, 4320, 7680, 3), dtype=np.uint8)
    frames[:, ::2] = 200
    path = write_video(tmp_path / "8k.mp4", frames, 2)
    clip = read_video(path, VideoBudget(max_pixels=256 * 28 * 28))
    h, w = clip.frames.shape[2:4]
    assert h * w <= 256 * 28 * 28 and h % 28 == 0 and w % 28 == 0
    assert clip.original_size == (4320, 7680)


def test_images_follow_exif_and_the_budget(tmp_path):
    pixels = np.zeros((60, 200, 3), dtype=np.uint8)
    pixels[:, :100] = 255
    image = Image.fromarray(pixels)
    exif = image.getexif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise on display
    path = tmp_path / "rotated.jpg"
    image.save(path, exif=exif)
    decoded = read_image(path, ImageBudget(min_pixels=4 * 28 * 28, max_pixels=64 * 28 * 28))
    h, w = decoded.pixels.shape[:2]
    assert decoded.original_size == (200, 60)  # portrait once the orientation is applied
    assert h > w and h % 28 == 0 and w % 28 == 0 and h * w <= 64 * 28 * 28
    plain_path = write_image(tmp_path / "plain.png", pixels)
    reference = qvu.fetch_image({"image": str(plain_path), "min_pixels": 4 * 28 * 28, "max_pixels": 64 * 28 * 28})
    plain = read_image(plain_path, ImageBudget(min_pixels=4 * 28 * 28, max_pixels=64 * 28 * 28))
    np.testing.assert_array_equal(plain.pixels, np.asarray(reference))


def test_a_panorama_keeps_one_patch_row_as_the_qwen_processors_do(tmp_path):
    """A 40x6000 image under 128 x 28 x 28 pixels: qwen-vl-utils' smart_resize floors
    its height to 0 (PIL then raised a bare ValueError that stopped training);
    transformers' Qwen2-VL smart_resize keeps 28 rows, and so does read_image. A video
    of that shape gets its frames the same way."""
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

    from omni_rl.preprocess.video import resized_size

    path = write_image(tmp_path / "pano.png", np.full((40, 6000, 3), 128, np.uint8))
    budget = ImageBudget(patch_size=14, max_pixels=128 * 28 * 28)
    want = smart_resize(40, 6000, factor=28, min_pixels=budget.pixels()[0], max_pixels=128 * 28 * 28)
    assert want == (28, 3864)
    assert read_image(path, budget).pixels.shape == (*want, 3)
    video = VideoBudget(max_frames=4, max_pixels=128 * 28 * 28, total_pixels=4 * 128 * 28 * 28)
    assert resized_size(40, 6000, 4, video) == want


def test_rgba_images_are_composited_on_white(tmp_path):
    rgba = np.zeros((56, 56, 4), dtype=np.uint8)
    path = tmp_path / "clear.png"
    Image.fromarray(rgba, "RGBA").save(path)
    assert read_image(path).pixels.min() == 255


def test_every_transparent_mode_is_composited_on_white(tmp_path):
    """Grey with alpha (LA), and palette images with a transparent entry (what PNG
    optimisers and GIFs write), lost their alpha in the RGB conversion: black strokes
    on a clear background became an all-black image."""
    grey = Image.fromarray(np.zeros((56, 56, 2), dtype=np.uint8), "LA")
    grey.save(tmp_path / "la.png")
    palette = Image.new("P", (56, 56), 0)
    palette.putpalette([0, 0, 0, 200, 0, 0])
    palette.save(tmp_path / "p.png", transparency=0)
    palette.save(tmp_path / "p.gif", transparency=0)
    for name in ("la.png", "p.png", "p.gif"):
        assert read_image(tmp_path / name).pixels.min() == 255, name


def test_sixteen_bit_grey_is_scaled_to_eight_bits_and_wider_samples_are_refused(tmp_path):
    """A 16-bit grey PNG (mode I;16) was clipped to 255: mid-grey 32768 read white. A
    32-bit integer or float image has no range to scale by: refused, naming the file."""
    for value, grey in ((0, 0), (257, 1), (32768, 128), (65535, 255)):
        Image.fromarray(np.full((56, 56), value, np.uint16)).save(tmp_path / "grey16.png")
        assert Image.open(tmp_path / "grey16.png").mode == "I;16"
        assert (read_image(tmp_path / "grey16.png").pixels == grey).all(), value
    Image.fromarray(np.full((56, 56), 0.5, np.float32)).save(tmp_path / "float.tif")
    with pytest.raises(OmniRLError, match=r"float\.tif: an image of 32-bit samples \(mode F\)"):
        read_image(tmp_path / "float.tif")


def test_a_file_pillow_fails_on_in_any_way_is_a_clear_error(tmp_path, monkeypatch):
    """An image over Pillow's pixel limit (DecompressionBombError) or with a broken PNG
    chunk (SyntaxError) escaped as itself: a no-cache run stopped instead of skipping
    the row."""
    import zlib

    path = write_image(tmp_path / "big.png", (np.arange(200 * 200 * 3) % 251).astype(np.uint8).reshape(200, 200, 3))
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)  # 40,000 pixels: over twice the limit
    with pytest.raises(OmniRLError, match=r"big\.png: cannot decode image \(.*exceeds limit"):
        read_image(path)
    monkeypatch.undo()
    # the pixel data in two chunks, the second's type bytes not letters
    data = path.read_bytes()
    start = data.index(b"IDAT") - 4
    size = int.from_bytes(data[start : start + 4], "big")
    pixels, half = data[start + 8 : start + 8 + size], size // 2

    def chunk(kind: bytes, body: bytes) -> bytes:
        return len(body).to_bytes(4, "big") + kind + body + zlib.crc32(kind + body).to_bytes(4, "big")

    broken = chunk(b"IDAT", pixels[:half]) + chunk(b"\x00\x01\x02\x03", pixels[half:])
    (tmp_path / "broken.png").write_bytes(data[:start] + broken + data[start + 12 + size :])
    with pytest.raises(OmniRLError, match=r"broken\.png: cannot decode image \(broken PNG file"):
        read_image(tmp_path / "broken.png")


@pytest.mark.parametrize(("seconds", "rate", "channels"), [(1.0, 44_100, 2), (0.1, 16_000, 1), (3.0, 8_000, 1)])
def test_audio_is_mono_16k_float32(tmp_path, seconds, rate, channels):
    path = write_wav(tmp_path / "t.wav", tone(seconds, sample_rate=rate), sample_rate=rate, channels=channels)
    wave = read_audio(path)
    assert wave.dtype == np.float32 and wave.ndim == 1
    assert abs(wave.size - seconds * 16_000) <= 64
    # the channels' mean: equal channels keep the tone's own level
    assert 0.3 * 0.9 < np.abs(wave).max() <= 0.3 * 1.03


def test_long_audio_is_clamped(tmp_path):
    path = write_wav(tmp_path / "long.wav", tone(12.0))
    assert read_audio(path, max_seconds=5.0).size == 5 * 16_000


def test_rows_report_bad_lines_and_keep_the_rest(tmp_path):
    path = tmp_path / "data.jsonl"
    good = {"id": "a", "problem": "p", "problem_type": "counting", "answer": 3, "extra": {"k": 1}}
    path.write_bytes(
        (json.dumps(good) + "\n").encode()
        + b'{"id": "b\xff", "problem": "p"}\n'
        + (json.dumps(good) + "\n").encode()
        + b'{"id": "c", "problem": "p", "problem_type": "x"}\n'
        + b"[1, 2]\n"
    )
    rows, failures = read_rows(path)
    assert [r.id for r in rows] == ["a"]
    assert rows[0].fields["extra"] == {"k": 1}
    reasons = {f.path.rsplit(":", 1)[1]: f.reason for f in failures}
    assert "not valid UTF-8" in reasons["2"]
    assert reasons["3"].startswith("duplicate id")
    assert reasons["4"] == "'answer' is missing"
    assert reasons["5"].startswith("expected a JSON object")


def test_media_fields_that_name_no_path_are_refused_not_read_as_none(tmp_path):
    """Only a missing field, null or a list (empty included) says "no media": an empty
    string (a CSV's empty cell), an object, 0 or false is refused with its reason,
    where it read as a row without media and trained as a text question."""
    base = {"problem": "p", "problem_type": "counting", "answer": 3}
    values = {"a": None, "b": [], "c": "v/c.mp4", "d": "", "e": {}, "f": 0, "g": False, "h": [""]}
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps({"id": k, **base, "videos": v}) + "\n" for k, v in values.items()))
    rows, failures = read_rows(path)
    assert {r.id: r.videos for r in rows} == {"a": (), "b": (), "c": ("v/c.mp4",)}
    reasons = {f.id: f.reason for f in failures}
    assert reasons == {
        "d": "'videos' must be a list of paths, got ''",
        "e": "'videos' must be a list of paths, got {}",
        "f": "'videos' must be a list of paths, got 0",
        "g": "'videos' must be a list of paths, got False",
        "h": "'videos' must be a list of paths, got ['']",
    }


def test_options_that_are_not_a_list_are_refused_not_read_letter_by_letter(tmp_path):
    """A string of options ("left,right") was accepted, even under --strict, and read a
    character an option: "A. l", "B. e", ... Options are a list of texts (or numbers)."""
    base = {"problem": "p", "problem_type": "multiple_choice", "answer": "B"}
    values = {"a": ["left", "right"], "b": [1, 2], "c": None, "d": "left,right", "e": {"A": "left"}, "f": [["x"], "y"]}
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps({"id": k, **base, "options": v}) + "\n" for k, v in values.items()))
    rows, failures = read_rows(path)
    assert [r.id for r in rows] == ["a", "b", "c"]
    assert {f.id: f.reason for f in failures} == {
        "d": "'options' must be a list of the options' texts, got 'left,right'",
        "e": "'options' must be a list of the options' texts, got {'A': 'left'}",
        "f": "'options' must be a list of the options' texts, got [['x'], 'y']",
    }


def test_parquet_rows(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_pylist([{"id": "a", "problem": "p", "problem_type": "ocr", "answer": "x", "videos": []}])
    pq.write_table(table, tmp_path / "d.parquet")
    rows, failures = read_rows(tmp_path / "d.parquet")
    assert [r.id for r in rows] == ["a"] and not failures


def test_media_paths_stay_inside_their_roots(tmp_path):
    data_root = tmp_path / "data"
    data_root.mkdir()
    assert resolve_media_path("v/a.mp4", data_root) == (data_root / "v/a.mp4").resolve()
    with pytest.raises(OmniRLError, match="escapes"):
        resolve_media_path("../secret.mp4", data_root)
    with pytest.raises(OmniRLError, match="needs a configured media_root"):
        resolve_media_path("/etc/passwd", data_root)
    media_root = tmp_path / "media"
    assert resolve_media_path(str(media_root / "x.mp4"), data_root, media_root) == (media_root / "x.mp4").resolve()
    with pytest.raises(OmniRLError, match="escapes"):
        resolve_media_path(str(media_root / ".." / "x.mp4"), data_root, media_root)


def test_cache_keys_change_with_content_and_parameters(tmp_path):
    assert entry_key("video", "abc", {"fps": 2}) != entry_key("video", "abc", {"fps": 1})
    assert entry_key("video", "abc", {"fps": 2}) != entry_key("video", "abd", {"fps": 2})
    assert entry_key("video", "abc", {"fps": 2}) != entry_key("image", "abc", {"fps": 2})
    a = Budgets(VideoBudget(patch_size=14), ImageBudget())
    b = Budgets(VideoBudget(patch_size=16), ImageBudget())
    assert a.params("video") != b.params("video")


def test_cache_round_trip_and_verify(tmp_path):
    cache = MediaCache(tmp_path / "cache")
    frames = np.random.default_rng(0).integers(0, 255, (4, 56, 84, 3), dtype=np.uint8)
    cache.write("k" * 64, {"frames": frames}, {"kind": "video", "fps": 10.0})
    entry = cache.read("k" * 64)
    np.testing.assert_array_equal(entry.tensors["frames"].numpy(), frames)
    assert entry.meta["fps"] == 10.0 and entry.meta["kind"] == "video"
    assert cache.check("k" * 64) is None
    assert not list((tmp_path / "cache").rglob("*.tmp"))
    # flip one byte of tensor data: verify notices
    path = cache.path("k" * 64)
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF
    path.write_bytes(bytes(data))
    assert cache.check("k" * 64) == "tensor bytes do not match their digest"
    # change the metadata in place (the header stays as long, the file still parses):
    # an entry's fps, frame indices or sizes drive the model's inputs, so verify notices
    cache.write("m" * 64, {"frames": frames}, {"kind": "video", "fps": 10.0})
    path = cache.path("m" * 64)
    data = path.read_bytes()
    assert data.count(b'\\"fps\\": 10.0') == 1
    path.write_bytes(data.replace(b'\\"fps\\": 10.0', b'\\"fps\\": 19.0'))
    assert cache.read("m" * 64).meta["fps"] == 19.0
    assert cache.check("m" * 64) == "metadata does not match its digest"


def test_foreign_manifest_is_refused(tmp_path):
    (tmp_path / "manifest.json").write_text(json.dumps({"format": "other", "format_version": 9}))
    with pytest.raises(OmniRLError, match=r"is not omni_rl\.media_cache v1"):
        MediaCache(tmp_path).manifest()


def test_decode_medium_of_a_video_with_its_own_audio_track(tmp_path):
    frames = np.stack([np.full((64, 64, 3), i * 20, np.uint8) for i in range(10)])
    path = write_video(tmp_path / "av.mp4", frames, 10, audio=tone(1.0))
    budgets = Budgets(VideoBudget(), ImageBudget(), use_audio_in_video=True)
    tensors, meta = decode_medium("video_audio", path, budgets)
    assert tensors["audio"].dtype == np.float32 and abs(meta["seconds"] - 1.0) < 0.1


@pytest.fixture
def dataset(tmp_path):
    media = tmp_path / "media"
    write_video(media / "a.mp4", moving_square("right", 2.0, 10, 96, 64), 10)
    write_video(media / "b.mp4", moving_square("up", 2.0, 10, 96, 64), 10)
    write_image(media / "i.png", np.full((40, 60, 3), 128, np.uint8))
    write_wav(media / "t.wav", tone(1.0))
    valid = write_video(media / "c.mp4", moving_square("down", 4.0, 10, 96, 64), 10).read_bytes()
    (media / "truncated.mp4").write_bytes(valid[: len(valid) // 3])
    (media / "zero.mp4").write_bytes(b"")
    (media / "text.mp4").write_text("hello")
    write_video(media / "one.mp4", moving_square("down", 0.1, 10, 96, 64)[:1], 10)
    rows = [
        {"id": "two-videos", "videos": ["media/a.mp4", "media/b.mp4"]},
        {"id": "image-audio", "images": ["media/i.png"], "audios": ["media/t.wav"]},
        {"id": "missing", "videos": ["media/nope.mp4"]},
        {"id": "zero", "videos": ["media/zero.mp4"]},
        {"id": "text", "videos": ["media/text.mp4"]},
        {"id": "truncated", "videos": ["media/truncated.mp4"]},
        {"id": "one-frame", "videos": ["media/one.mp4"]},
        {"id": "escape", "videos": ["../outside.mp4"]},
        {"id": "two-videos", "videos": ["media/a.mp4"]},
    ]
    path = tmp_path / "data.jsonl"
    with open(path, "wb") as f:
        for row in rows:
            f.write((json.dumps({"problem": "p", "problem_type": "counting", "answer": 1, **row}) + "\n").encode())
        f.write(b'{"id": "bytes\xfe"}\n')
    return path


def test_preprocess_cli_caches_good_rows_and_reports_bad_ones(dataset, tmp_path, capsys):
    cache_dir = tmp_path / "cache"
    args = ["preprocess", str(dataset), "--cache", str(cache_dir), "--workers", "1", "--set", "media.min_frames=2"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "cached                   2" in out
    failures = [json.loads(line) for line in (cache_dir / "failures.jsonl").read_text().splitlines()]
    by_id = {f["id"]: f for f in failures}
    assert set(by_id) == {"missing", "zero", "text", "truncated", "one-frame", "escape", "two-videos", None}
    assert "no such file" in by_id["missing"]["reason"]
    assert "cannot decode video" in by_id["zero"]["reason"] and "cannot decode video" in by_id["text"]["reason"]
    assert "escapes" in by_id["escape"]["reason"]
    assert "1-frame video" in by_id["one-frame"]["reason"]
    assert by_id["two-videos"]["path"].endswith(":9") and "duplicate id" in by_id["two-videos"]["reason"]
    assert "UTF-8" in by_id[None]["reason"]
    stats = MediaCache(cache_dir).stats()
    assert "cannot decode video" in by_id["truncated"]["reason"]  # cut off before its moov atom
    assert stats["by_kind"]["video"]["entries"] == 2
    assert stats["by_kind"]["image"]["entries"] == 1 and stats["by_kind"]["audio"]["entries"] == 1
    assert main(["cache", "verify", str(cache_dir)]) == 0

    # a rerun does only what is missing; --strict turns failures into exit 1
    assert main([*args, "--strict"]) == 1
    assert "cached                   0" in capsys.readouterr().out

    # a changed parameter is a miss, never old data
    assert main([*args[:-1], "media.min_frames=2", "--set", "media.video_max_pixels=3136"]) == 0
    assert MediaCache(cache_dir).stats()["param_sets"] == 2


def test_cache_gc_and_verify_cli(dataset, tmp_path, capsys):
    cache_dir = tmp_path / "cache"
    assert main(["preprocess", str(dataset), "--cache", str(cache_dir), "--workers", "2"]) == 0
    cache = MediaCache(cache_dir)
    before = len(cache.entry_keys())
    small = tmp_path / "small.jsonl"
    small.write_text(
        json.dumps({"id": "x", "problem": "p", "problem_type": "c", "answer": 1, "images": ["media/i.png"]}) + "\n"
    )
    capsys.readouterr()
    # keeping one image and deleting three clips is more deleted than kept: refused without --force
    assert main(["cache", "gc", str(cache_dir), "--data", str(small)]) == 2
    assert "cache gc refused: 3 entries" in capsys.readouterr().err
    assert len(cache.entry_keys()) == before
    # two of dataset's rows cannot be read (a duplicate id, bytes that are not UTF-8): refused without
    # --force, since the media they name would go (it deleted them, saying nothing)
    assert main(["cache", "gc", str(cache_dir), "--data", str(small), "--data", str(dataset)]) == 2
    err = capsys.readouterr().err
    assert "cache gc refused: 2 row(s) of --data could not be read" in err and f"{dataset}:9 two-videos: dup" in err
    assert main(["cache", "gc", str(cache_dir), "--data", str(small), "--data", str(dataset), "--force"]) == 0
    assert len(cache.entry_keys()) == before  # both datasets' entries are kept
    assert main(["cache", "gc", str(cache_dir), "--data", str(small), "--force"]) == 0
    assert len(cache.entry_keys()) == 1 < before
    key = cache.entry_keys()[0]
    path = cache.path(key)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))
    capsys.readouterr()
    assert main(["cache", "verify", str(cache_dir)]) == 1
    assert "corrupt:" in capsys.readouterr().out


def test_cache_gc_dry_run_deletes_nothing_and_other_budgets_are_refused(dataset, tmp_path, capsys):
    cache_dir = tmp_path / "cache"
    built_with = ["--set", "media.video_min_pixels=3136", "--set", "media.video_max_pixels=6272"]
    built_with += ["--set", "media.image_max_pixels=6272", "--set", "media.max_audio_seconds=5"]
    assert main(["preprocess", str(dataset), "--cache", str(cache_dir), "--workers", "1", *built_with]) == 0
    cache = MediaCache(cache_dir)
    entries = sorted(cache.entry_keys())
    sizes = sum(cache.path(k).stat().st_size for k in entries)
    capsys.readouterr()
    # default budgets reference none of these entries: a gc would delete everything
    assert main(["cache", "gc", str(cache_dir), "--data", str(dataset), "--dry-run"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert sum(line.startswith("delete ") for line in out) == len(entries) == 4
    assert out[-1] == f"dry run: 4 entries ({sizes} bytes) to delete, 0 entries (0 bytes) to keep; nothing deleted"
    assert main(["cache", "gc", str(cache_dir), "--data", str(dataset)]) == 2
    err = capsys.readouterr().err
    assert "cache gc refused" in err and "not among those the cache was built with" in err
    assert sorted(cache.entry_keys()) == entries
    # with the budgets it was built with, nothing is deleted, even with the raw media gone
    for name in ("a.mp4", "b.mp4", "i.png", "t.wav"):
        (dataset.parent / "media" / name).unlink()
    assert main(["cache", "gc", str(cache_dir), "--data", str(dataset), "--dry-run", *built_with]) == 0
    out = capsys.readouterr().out.splitlines()
    assert sum(line.startswith("keep ") for line in out) == 4 and "0 entries (0 bytes) to delete" in out[-1]
    assert "2 row(s) of --data could not be read" in out[-2]  # the dry run says so too
    assert main(["cache", "gc", str(cache_dir), "--data", str(dataset), *built_with]) == 2
    assert main(["cache", "gc", str(cache_dir), "--data", str(dataset), "--force", *built_with]) == 0
    assert sorted(cache.entry_keys()) == entries


def test_the_index_maps_rows_to_keys_per_dataset_and_reruns_hash_nothing(dataset, tmp_path, monkeypatch):
    from omni_rl.preprocess import pipeline
    from omni_rl.preprocess.index import DatasetIndex

    cache_dir = tmp_path / "cache"
    budgets = Budgets(VideoBudget(min_frames=2), ImageBudget())
    pipeline.preprocess(dataset, cache_dir, budgets, workers=1, progress=False)
    index = DatasetIndex(MediaCache(cache_dir), dataset)
    assert sorted(index.rows) == ["image-audio", "two-videos"]  # failed rows are not indexed
    video = dataset.parent / "media" / "a.mp4"
    a = index.rows["two-videos"][0]
    assert (a.kind, a.path, a.size, a.mtime_ns) == ("video", str(video), video.stat().st_size, video.stat().st_mtime_ns)
    assert list(a.keys) == [budgets.params_digest("video")]
    assert MediaCache(cache_dir).has(a.keys[budgets.params_digest("video")])

    hashed = []
    digest = pipeline.file_digest
    monkeypatch.setattr(pipeline, "file_digest", lambda path: hashed.append(path.name) or digest(path))
    report = pipeline.preprocess(dataset, cache_dir, budgets, workers=1, progress=False)
    cached_files = {"a.mp4", "b.mp4", "i.png", "t.wav"}
    assert report.already_cached == 2
    assert not cached_files & set(hashed)  # unchanged files are only stat'ed (failed rows' files are retried)

    # other budgets add keys; another dataset sharing the cache gets its own index file
    other = Budgets(VideoBudget(min_frames=2, min_pixels=3136, max_pixels=6272), ImageBudget())
    pipeline.preprocess(dataset, cache_dir, other, workers=1, progress=False)
    keys = DatasetIndex(MediaCache(cache_dir), dataset).rows["two-videos"][0].keys
    assert set(keys) == {budgets.params_digest("video"), other.params_digest("video")}
    assert {"a.mp4", "b.mp4"} <= set(hashed)  # a key under new budgets needs the content digest
    second = dataset.parent / "second.jsonl"
    second.write_bytes(dataset.read_bytes().splitlines()[1] + b"\n")
    pipeline.preprocess(second, cache_dir, budgets, workers=1, progress=False)
    assert len(list((cache_dir / "index").glob("*.json"))) == 2
    assert sorted(DatasetIndex(MediaCache(cache_dir), second).rows) == ["image-audio"]
    assert sorted(DatasetIndex(MediaCache(cache_dir), dataset).rows) == ["image-audio", "two-videos"]


def test_video_with_corrupt_bytes_in_the_middle_never_crashes(tmp_path):
    path = write_video(tmp_path / "v.mp4", moving_square("right", 4.0, 10, 160, 120), 10)
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 2000] = bytes(random_bytes(2000))
    (tmp_path / "corrupt.mp4").write_bytes(bytes(data))
    rows = tmp_path / "data.jsonl"
    rows.write_text(
        json.dumps({"id": "c", "problem": "p", "problem_type": "x", "answer": 1, "videos": ["corrupt.mp4"]}) + "\n"
    )
    cache_dir = tmp_path / "cache"
    code = main(["preprocess", str(rows), "--cache", str(cache_dir), "--workers", "1"])
    failures = (cache_dir / "failures.jsonl").read_text().splitlines()
    cached = MediaCache(cache_dir).entry_keys()
    # Either the decoder conceals the damage and the clip is cached whole, or the row
    # fails cleanly (the only row: preprocess exits 1)
    assert len(failures) + len(cached) == 1 and code == len(failures)
    assert main(["cache", "verify", str(cache_dir)]) == 0


def random_bytes(n: int) -> bytes:
    return np.random.default_rng(7).integers(0, 256, n, dtype=np.uint8).tobytes()


def test_a_two_hour_audio_file_is_read_only_up_to_the_limit(tmp_path):
    """A sparse 2-hour WAV (16 kHz mono, 16-bit): decoding stops at max_audio_seconds."""
    import struct

    seconds, rate = 2 * 3600, 16_000
    data_bytes = seconds * rate * 2
    path = tmp_path / "long.wav"
    with open(path, "wb") as f:
        f.write(b"RIFF" + struct.pack("<I", 36 + data_bytes) + b"WAVEfmt ")
        f.write(struct.pack("<IHHIIHH", 16, 1, 1, rate, rate * 2, 2, 16))
        f.write(b"data" + struct.pack("<I", data_bytes))
        f.truncate(44 + data_bytes)  # sparse: no disk blocks for the silence
    started = time.perf_counter()
    wave = read_audio(path, max_seconds=30.0)
    assert wave.size == 30 * 16_000
    assert time.perf_counter() - started < 5


def test_preprocess_strict_says_why_it_exits_1(dataset, tmp_path, capsys):
    """--strict exits 1 when a row failed, and a line says so: how many, the first, and
    where the rest are listed."""
    cache_dir = tmp_path / "cache"
    args = ["preprocess", str(dataset), "--cache", str(cache_dir), "--workers", "1", "--set", "media.min_frames=2"]
    assert main([*args, "--strict"]) == 1
    err = capsys.readouterr().err
    assert (
        f"preprocess: --strict: exit 1: 8 rows failed (listed in {cache_dir / 'failures.jsonl'}), "
        f"first: {dataset}:9 two-videos: duplicate id (first at {dataset}:1)"
    ) in err


def test_preprocess_counts_rows_without_media_and_rows_sharing_a_clip(tmp_path, capsys):
    """Three questions on one clip and a row with no media: one row caches the clip, two
    share it, one has nothing to cache; none of them is 'already cached' until a rerun."""
    from omni_rl.preprocess.pipeline import preprocess

    write_video(tmp_path / "media" / "a.mp4", moving_square("right", 2.0, 10, 96, 64), 10)
    rows = [{"id": f"q{i}", "videos": ["media/a.mp4"]} for i in range(3)] + [{"id": "text"}]
    data = tmp_path / "data.jsonl"
    data.write_text(
        "".join(json.dumps({"problem": "p", "problem_type": "counting", "answer": 1, **r}) + "\n" for r in rows)
    )
    budgets = Budgets(VideoBudget(min_frames=2), ImageBudget())
    first = preprocess(data, tmp_path / "cache", budgets, workers=1, progress=False)
    assert (first.cached, first.shared, first.no_media, first.already_cached) == (1, 2, 1, 0)
    table = first.table()
    assert "shared media             2" in table and "no media                 1" in table
    again = preprocess(data, tmp_path / "cache", budgets, workers=1, progress=False)
    assert (again.cached, again.shared, again.no_media, again.already_cached) == (0, 0, 1, 3)


def test_the_cache_key_holds_the_qwen_vl_utils_limits_the_budgets_read(monkeypatch):
    """Unset pixel budgets come from qwen-vl-utils' constants, MODEL_SEQ_LEN among them
    (read from the environment): a different value makes other frames, so it must make
    another key, never a hit on the old entries."""
    from omni_rl.preprocess.config import MediaConfig

    budgets = Budgets.from_config(MediaConfig(family="qwen2_5_vl"))
    video, image = budgets.params_digest("video"), budgets.params_digest("image")
    pixels, image_pixels = budgets.video.frame_pixels(128), budgets.image.pixels()
    monkeypatch.setattr(qvu, "MODEL_SEQ_LEN", qvu.MODEL_SEQ_LEN // 4)
    assert budgets.video.frame_pixels(128) != pixels
    assert budgets.params_digest("video") != video
    monkeypatch.setattr(qvu, "IMAGE_MAX_TOKEN_NUM", qvu.IMAGE_MAX_TOKEN_NUM // 2)
    assert budgets.image.pixels() != image_pixels
    assert budgets.params_digest("image") != image


def test_preprocess_exits_1_when_every_row_failed(tmp_path, capsys):
    """Without --strict a failed row is listed and left out, and preprocess exits 0; when
    every row failed (a wrong media root) nothing is cached, and it exits 1 saying so."""
    data = tmp_path / "rows.jsonl"
    rows = [{"id": f"r{i}", "problem": "<video>Where?", "answer": "A", "videos": [f"nope{i}.mp4"]} for i in (1, 2)]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    cache_dir = tmp_path / "cache"
    assert main(["preprocess", str(data), "--cache", str(cache_dir), "--workers", "1"]) == 1
    err = capsys.readouterr().err
    assert f"preprocess: every row failed: exit 1: 2 rows failed (listed in {cache_dir / 'failures.jsonl'}), " in err


def test_cache_gc_reads_the_rows_under_their_config_columns(dataset, tmp_path):
    """gc read --data without the config's data.columns: rows that name their question
    another way were unreadable to it, and their media counted as unreferenced."""
    from omni_rl.preprocess.pipeline import preprocess, referenced_keys

    renamed = tmp_path / "renamed.jsonl"
    rows = [json.loads(line) for line in dataset.read_text(errors="replace").splitlines()[:2]]
    renamed.write_text("".join(json.dumps({"question": r.pop("problem"), **r}) + "\n" for r in rows))
    columns = {"question": "problem"}
    budgets = Budgets(VideoBudget(min_frames=2), ImageBudget())
    cache = MediaCache(tmp_path / "cache")
    preprocess(renamed, cache.root, budgets, workers=1, progress=False, columns=columns)
    assert len(referenced_keys(renamed, budgets, cache, columns)) == 4 == len(cache.entry_keys())
    assert referenced_keys(renamed, budgets, cache) == set()  # read as training would not


def test_an_image_budget_whose_smallest_area_is_above_its_largest_is_refused_before_any_work():
    """media.image_max_pixels below the family's default minimum (Qwen3-VL: 4,096 at
    patch 16) loaded, and every image then failed on qwen-vl-utils' bare assert."""
    from omni_rl.preprocess.config import MediaConfig

    with pytest.raises(
        OmniRLError, match=r"media\.image_min_pixels \(4096\) is above media\.image_max_pixels \(3136\)"
    ):
        Budgets.from_config(MediaConfig(family="qwen3_vl", image_max_pixels=3136))
    with pytest.raises(
        OmniRLError, match=r"image_min_pixels \(16000000\) is above media\.image_max_pixels \(12845056\)"
    ):
        Budgets.from_config(MediaConfig(image_min_pixels=16_000_000))
