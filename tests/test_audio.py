"""Audio in: bad files normalized or reported, the synthetic audio-QA set, and videos
whose sound a row asks for but that have none."""

from __future__ import annotations

import json
import logging
import struct
import time

import numpy as np
import pytest
import torch

from omni_rl.data.dataset import BadRow, MediaDataset, encode_sample
from omni_rl.errors import OmniRLError
from omni_rl.models import build_tiny, load
from omni_rl.models.inputs import encode_prompts
from omni_rl.preprocess.audio import MIN_SECONDS, read_audio
from omni_rl.preprocess.pipeline import Budgets
from omni_rl.preprocess.sounds import CLIP_SECONDS, KINDS, clip, write_audio_qa
from omni_rl.preprocess.synthetic import moving_square, tone, write_video, write_wav
from omni_rl.preprocess.video import VideoBudget


def write_float_wav(path, samples: np.ndarray, rate: int = 16_000):
    """A 32-bit float WAV (format 3), which can hold NaN, infinities and samples beyond 1."""
    data = samples.astype("<f4").tobytes()
    with open(path, "wb") as f:
        f.write(b"RIFF" + struct.pack("<I", 36 + len(data)) + b"WAVEfmt ")
        f.write(struct.pack("<IHHIIHH", 16, 3, 1, rate, rate * 4, 4, 32))
        f.write(b"data" + struct.pack("<I", len(data)) + data)
    return path


@pytest.mark.parametrize(("rate", "channels"), [(8_000, 1), (44_100, 2), (48_000, 6)])
def test_any_rate_and_layout_becomes_16k_mono(tmp_path, rate, channels):
    path = write_wav(tmp_path / "t.wav", tone(1.0, sample_rate=rate), sample_rate=rate, channels=channels)
    wave = read_audio(path)
    assert wave.dtype == np.float32 and wave.ndim == 1 and abs(wave.size - 16_000) <= 64
    assert np.isfinite(wave).all() and 0.1 < np.abs(wave).max() <= 1.0


@pytest.mark.parametrize("channels", [2, 6])
def test_every_layout_mixes_down_to_the_mean_of_its_channels(tmp_path, caplog, channels):
    """The same sound in every channel comes out at its own level: FFmpeg's mono
    downmix summed the channels at 0.707 each (a 0.9 stereo tone came out at 1.27 and
    was clipped, 5.1 at 3.1 times the level)."""
    signal = tone(1.0, amplitude=0.9, sample_rate=44_100)
    mono = read_audio(write_wav(tmp_path / "mono.wav", signal, sample_rate=44_100))
    with caplog.at_level(logging.WARNING):
        mixed = read_audio(write_wav(tmp_path / "many.wav", signal, sample_rate=44_100, channels=channels))
    assert not caplog.records, [r.getMessage() for r in caplog.records]  # nothing clipped
    np.testing.assert_allclose(mixed, mono, atol=1e-6)


def test_nan_infinite_and_clipped_samples_are_normalized_and_reported(tmp_path, caplog):
    samples = tone(1.0, amplitude=3.0)  # three times full scale
    samples[100:110] = np.nan
    samples[200] = np.inf
    path = write_float_wav(tmp_path / "bad.wav", samples)
    with caplog.at_level(logging.WARNING):
        wave = read_audio(path)
    assert np.isfinite(wave).all() and np.abs(wave).max() <= 1.0
    assert (wave[100:110] == 0).all()
    assert "bad.wav: 11 NaN or infinite" in caplog.text and "clipped" in caplog.text


def test_silence_is_kept_as_silence(tmp_path):
    wave = read_audio(write_wav(tmp_path / "quiet.wav", np.zeros(16_000, np.float32)))
    assert wave.size == 16_000 and not wave.any()


@pytest.mark.parametrize("seconds", [0.05, 0.01])
def test_very_short_clips_reach_the_model(tmp_path, tiny_checkpoint, seconds):
    """0.05 s and 0.01 s clips: the shorter is padded to MIN_SECONDS; both give audio
    tokens and finite log-probs in Qwen2-Audio and the Omni thinker."""
    wave = read_audio(write_wav(tmp_path / "blip.wav", tone(seconds)))
    assert wave.size == max(round(seconds * 16_000), round(MIN_SECONDS * 16_000))
    for family in ("qwen2_audio", "qwen2_5_omni_thinker", "qwen3_omni_moe_thinker"):
        model, processor = load(tiny_checkpoint(family))
        messages = [{"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": "What?"}]}]
        inputs = encode_prompts(processor, [messages], audios=[wave])
        audio_id = processor.tokenizer.convert_tokens_to_ids(processor.audio_token)
        assert (inputs["input_ids"] == audio_id).sum() >= 1
        with torch.no_grad():
            assert torch.isfinite(model(**inputs).logits).all()


def test_sound_longer_than_the_processors_window_is_refused_not_cut(tmp_path):
    """Qwen2-Audio's and Qwen2.5-Omni's feature extractors keep the first 30 s (2 s in
    this tiny build) and drop the rest without a word: a longer sound (media.max_audio_
    seconds above the window) is refused, naming the window and the setting; a sound
    that fits goes through, whatever its length in samples (Qwen3-Omni's extractor,
    padding to the longest sound, drops a last part-frame of under 160 samples: no cut).
    Qwen3-Omni's processor takes longer sound whole."""
    messages = [{"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": "What?"}]}]
    for family in ("qwen2_audio", "qwen2_5_omni_thinker", "qwen3_omni_moe_thinker"):
        _, processor = load(build_tiny(family, tmp_path / family, audio_seconds=2))
        encode_prompts(processor, [messages], audios=[tone(2.0)])
        for samples in (16_050, 19_708, 31_999):  # 1.0, 1.2 and 2.0 s, not whole 10 ms frames
            encode_prompts(processor, [messages], audios=[tone(2.0)[:samples]])
        if family == "qwen3_omni_moe_thinker":
            features = encode_prompts(processor, [messages], audios=[tone(3.0)])["input_features"]
            assert features.shape[-1] == 300  # 3 s of 10 ms frames, whole
            continue
        with pytest.raises(OmniRLError, match=r"3 s .*2 s audio window.*media\.max_audio_seconds"):
            encode_prompts(processor, [messages], audios=[tone(3.0)])
        # a sound just past the window reads longer than it (it read "2.0 s ... 2 s")
        with pytest.raises(OmniRLError, match=r"a sound of 2\.01 s is longer than .*'s 2 s audio window"):
            encode_prompts(processor, [messages], audios=[tone(3.0)[:32_160]])


def test_a_three_hour_file_is_read_only_up_to_the_budget(tmp_path):
    """A sparse 3-hour 48 kHz stereo WAV: decoding stops at max_audio_seconds."""
    seconds, rate, channels = 3 * 3600, 48_000, 2
    data_bytes = seconds * rate * 2 * channels
    path = tmp_path / "long.wav"
    with open(path, "wb") as f:
        f.write(b"RIFF" + struct.pack("<I", 36 + data_bytes) + b"WAVEfmt ")
        f.write(struct.pack("<IHHIIHH", 16, 1, channels, rate, rate * 2 * channels, 2 * channels, 16))
        f.write(b"data" + struct.pack("<I", data_bytes))
        f.truncate(44 + data_bytes)  # sparse: no disk blocks for the silence
    started = time.perf_counter()
    assert read_audio(path, max_seconds=20.0).size == 20 * 16_000
    assert time.perf_counter() - started < 5


def test_the_synthetic_audio_set_is_balanced_and_needs_the_sound(tmp_path):
    data = write_audio_qa(tmp_path / "qa", 32, seed=0)
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    assert [r["data_source"] for r in rows[:4]] == [f"audio_{k}" for k in KINDS]
    for kind in KINDS:
        answers = [r["answer"] for r in rows if r["data_source"] == f"audio_{kind}"]
        assert len(set(answers)) == len(rows[KINDS.index(kind)]["options"])  # every option is an answer
        assert max(answers.count(a) for a in set(answers)) - min(answers.count(a) for a in set(answers)) <= 1
    silent = write_audio_qa(tmp_path / "silent", 32, seed=0, silent=True)
    assert silent.read_text() == data.read_text().replace(str(tmp_path / "qa"), str(tmp_path / "silent"))
    assert not read_audio(tmp_path / "silent" / rows[0]["audios"][0]).any()
    rng = np.random.default_rng(0)
    clips = [clip(kind, answer, rng) for kind in KINDS for answer in range(2)]
    assert {c.size for c in clips} == {round(CLIP_SECONDS * 16_000)}  # the length tells nothing
    beeps = [clip("count", answer, rng) for answer in range(4)]
    sounding = [np.convolve(np.abs(b), np.ones(160) / 160, mode="same") > 0.01 for b in beeps]  # 10 ms envelope
    assert [int((s[1:] & ~s[:-1]).sum()) for s in sounding] == [1, 2, 3, 4]  # n + 1 beeps for answer index n


def silent_video_rows(tmp_path):
    frames = moving_square("up", 1.0, 10, 64, 64)
    write_video(tmp_path / "silent.mp4", frames, 10)
    write_video(tmp_path / "loud.mp4", frames, 10, audio=tone(1.0))
    rows = [
        {"id": "silent", "problem": "Sound?", "problem_type": "counting", "answer": 1, "videos": ["silent.mp4"]},
        {"id": "loud", "problem": "Sound?", "problem_type": "counting", "answer": 1, "videos": ["loud.mp4"]},
    ]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({**r, "use_audio_in_video": True}) + "\n" for r in rows))
    return data


def budgets(missing: str) -> Budgets:
    video = VideoBudget(patch_size=14, min_frames=2, max_frames=4, min_pixels=3136, max_pixels=6272)
    return Budgets(video, Budgets.from_config(_media()).image, max_audio_seconds=2.0, missing_video_audio=missing)


def _media():
    from omni_rl.preprocess.config import MediaConfig

    return MediaConfig(family="qwen2_5_omni_thinker")


def test_a_video_without_the_sound_its_row_asks_for_is_skipped_and_named(tmp_path):
    data = silent_video_rows(tmp_path)
    dataset = MediaDataset(data, budgets("skip"))
    with pytest.raises(BadRow, match=r"data\.jsonl:1: row 'silent': .*silent\.mp4: .*has no audio track"):
        dataset[0]
    assert len(dataset[1].video_audios) == 1


def test_a_video_without_sound_can_be_heard_as_video_only(tmp_path, tiny_checkpoint, caplog):
    data = silent_video_rows(tmp_path)
    dataset = MediaDataset(data, budgets("video_only"))
    with caplog.at_level(logging.WARNING):
        silent = dataset[0]
    assert silent.video_audios == [] and "using it without sound" in caplog.text
    assert dataset.cache_metrics()["data/videos_without_sound"] == 1
    _, processor = load(tiny_checkpoint("qwen2_5_omni_thinker"))
    assert "use_audio_in_video" not in encode_sample(processor, silent)
    assert encode_sample(processor, dataset[1])["use_audio_in_video"].all()


def test_the_r1_aqa_recipe_asks_and_scores_as_r1_aqa(tmp_path):
    from omni_rl.data.dataset import render_prompt
    from omni_rl.preprocess.rows import read_rows
    from omni_rl.recipe_loader import load_config
    from omni_rl.rewards import score

    cfg = load_config("configs/qwen2_audio_r1_aqa.yaml")
    assert (cfg.rollout.n, cfg.rollout.temperature, cfg.optimizer.lr) == (8, 1.0, 1e-6)
    assert (cfg.algorithm.kl_coef, cfg.algorithm.kl_estimator, cfg.rewards.template) == (0.04, "k3", "answer_only")
    row = {
        "id": "183",
        "problem": "What happened in the audio?",
        "options": ["motorboat", "Yacht consignment", "Sailboat set sail", "Consignment car"],
        "answer": "Yacht consignment",
        "problem_type": "choice_text",
        "audios": ["a.wav"],
    }
    (tmp_path / "rows.jsonl").write_text(json.dumps(row) + "\n")
    (parsed,), _ = read_rows(tmp_path / "rows.jsonl")
    assert render_prompt(cfg.data.prompt_template, parsed) == (
        "What happened in the audio? Please choose the answer from the following options: "
        "['motorboat', 'Yacht consignment', 'Sailboat set sail', 'Consignment car']. "
        "Output the final answer in <answer> </answer>."
    )
    settings = cfg.rewards.settings()

    def scored(response):
        return score("choice_text", response, row["answer"], options=row["options"], settings=settings)

    right, letter, other = scored("<answer>Yacht consignment</answer>"), scored("<answer>B</answer>"), scored("x")
    assert (right.accuracy, right.format, right.score) == (1.0, 1.0, 1.0)
    assert letter.accuracy == 0.0 and letter.score == 0.5  # (accuracy + format) / 2: R1-AQA's sum, halved
    assert other.accuracy == 0.0


def grpo_on(tmp_path, rows_file, family, **sections):
    """Two GRPO steps on ``data``'s rows, rewarded by ``reward_plugins.vowel_share``
    (a random tiny model's answers vary on it, so advantages are not all zero)."""
    from omni_rl.recipe_loader import config_from_dict
    from omni_rl.recipes import grpo

    rows = [json.loads(line) for line in rows_file.read_text().splitlines()]
    rows_file.write_text("".join(json.dumps({**row, "problem_type": "vowel_share"}) + "\n" for row in rows))
    config = {
        "recipe": "grpo",
        "run": {"output_dir": str(tmp_path / "run"), "seed": 0, "threads": 2},
        "model": {"tiny_family": family, "tiny_audio_seconds": 2},
        "data": {"train": str(rows_file), "prompts_per_step": 3},
        "media": {"family": family, "max_audio_seconds": 2.0, "min_frames": 2, "max_frames": 4},
        "rollout": {"n": 4, "max_new_tokens": 6},
        "algorithm": {"kl_coef": 0.04},
        "rewards": {"custom": {"vowel_share": "reward_plugins:vowel_share"}},
        "trainer": {"steps": 2},
        "optimizer": {"type": "adamw", "lr": 1.0e-3},
    }
    for name, values in sections.items():
        config[name] = {**config.get(name, {}), **values}
    final = grpo.train(config_from_dict(config))
    assert final["step"] == 2 and np.isfinite(final["loss/policy"])
    return [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("lora", [False, True])
def test_grpo_trains_a_tiny_qwen2_audio_fully_and_with_lora(tmp_path, lora):
    from omni_rl.models import load as load_model

    data = write_audio_qa(tmp_path / "qa", 8, seed=0)
    model = {"lora": {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}} if lora else {}
    steps = grpo_on(tmp_path, data, "qwen2_audio", model=model)
    assert all(s["skipped/bad_rows"] == 0 for s in steps)
    trained = sorted((tmp_path / "run" / "checkpoints").iterdir())[-1] / "model"
    if lora:  # the adapter alone, on the language model only, and trained (lora_B starts at zero)
        from safetensors.torch import load_file

        adapter = load_file(trained / "adapter_model.safetensors")
        assert adapter and all("language_model" in k and "lora_" in k for k in adapter)
        assert any(v.abs().sum() > 0 for k, v in adapter.items() if "lora_B" in k)
        return
    base, _ = load_model(tmp_path / "run" / "tiny_model")
    after, _ = load_model(trained)
    changed = {n for n, p in after.named_parameters() if not torch.equal(p, base.state_dict()[n])}
    assert any("audio_tower" in n for n in changed) and any("language_model" in n for n in changed)


def test_grpo_on_an_omni_thinker_mixes_audio_image_and_heard_video_rows(tmp_path):
    """Audio, image, heard-video and plain-video rows in one run; a row asking for the
    sound of a video that has none is reported and skipped, and the run goes on."""
    from omni_rl.preprocess.synthetic import write_image

    data = write_audio_qa(tmp_path / "qa", 4, seed=0)
    write_video(tmp_path / "qa" / "v.mp4", moving_square("up", 1.0, 8, 64, 64), 8, audio=tone(1.0))
    write_video(tmp_path / "qa" / "mute.mp4", moving_square("left", 1.0, 8, 64, 64), 8)
    write_image(tmp_path / "qa" / "i.png", np.full((56, 56, 3), 90, np.uint8))
    extra = [
        {"id": "video", "videos": ["v.mp4"], "use_audio_in_video": True, "problem": "Which way?"},
        {"id": "plain", "videos": ["v.mp4"], "problem": "Which way?"},
        {"id": "mute", "videos": ["mute.mp4"], "use_audio_in_video": True, "problem": "Which way?"},
        {"id": "image", "images": ["i.png"], "problem": "What colour?"},
    ]
    with open(data, "a") as f:
        for row in extra:
            f.write(json.dumps({**row, "problem_type": "counting", "answer": 1}) + "\n")
    steps = grpo_on(tmp_path, data, "qwen2_5_omni_thinker", data={"prompts_per_step": 6})
    assert steps[-1]["skipped/bad_rows"] == 1  # 8 rows, 12 draws or more: 'mute' is drawn, and counted once
    assert all(s["data/videos_without_sound"] == 0 and s["data/audio_cut"] == 0 for s in steps)


def test_sound_past_max_audio_seconds_is_cut_reported_once_and_counted(tmp_path, caplog):
    """A heard video or a clip longer than media.max_audio_seconds (2 s here) loses its
    sound past that point: the first is logged (file, row), each is counted in
    data/audio_cut, from the raw files and from the cache alike. AAC's padding past an
    exactly 2-second track is not a cut."""
    for name, seconds in (("long", 3.0), ("exact", 2.0)):
        write_video(tmp_path / f"{name}.mp4", moving_square("up", seconds, 10, 64, 64), 10, audio=tone(seconds))
        write_wav(tmp_path / f"{name}.wav", tone(seconds + 0.5 if name == "long" else seconds))
    rows = [
        {"id": "long", "videos": ["long.mp4"], "use_audio_in_video": True},
        {"id": "long-again", "videos": ["long.mp4"], "use_audio_in_video": True},
        {"id": "exact", "videos": ["exact.mp4"], "use_audio_in_video": True},
        {"id": "clip", "audios": ["long.wav"]},
        {"id": "exact-clip", "audios": ["exact.wav"]},
    ]
    data = tmp_path / "data.jsonl"
    data.write_text(
        "".join(json.dumps({"problem": "Sound?", "problem_type": "counting", "answer": 1, **r}) + "\n" for r in rows)
    )
    with caplog.at_level(logging.WARNING):
        dataset = MediaDataset(data, budgets("skip"))
        samples = [dataset[i] for i in range(len(dataset))]
    assert [s.video_audios[0].size for s in samples[:3]] == [32_000, 32_000, 32_000]
    assert dataset.cache_metrics()["data/audio_cut"] == 3  # long, long-again, clip
    cuts = [r.getMessage() for r in caplog.records if "max_audio_seconds" in r.getMessage()]
    assert cuts == [
        f"{data}:1: row 'long': {(tmp_path / 'long.mp4').resolve()}: the sound is cut at media.max_audio_seconds "
        "(2 s) and the video's later frames are seen without it (raise media.max_audio_seconds to keep it; "
        "counted in data/audio_cut)"
    ]
    from omni_rl.preprocess.pipeline import preprocess

    preprocess(data, tmp_path / "cache", budgets("skip"), workers=1, progress=False)
    cached = MediaDataset(data, budgets("skip"), tmp_path / "cache")
    for i in range(len(cached)):
        cached[i]
    metrics = cached.cache_metrics()
    assert metrics["data/audio_cut"] == 3 and metrics["data/cache_hits"] == 2 * 3 + 2
    from omni_rl.preprocess.audio import decode_audio

    assert decode_audio(tmp_path / "long.wav", 2.0).cut and not decode_audio(tmp_path / "exact.wav", 2.0).cut


def write_late_sound_video(path, sound_start: float, sound: np.ndarray, seconds: float = 2.0, first_frame: int = 0):
    """A 10 fps mp4 whose AAC track starts at ``sound_start`` seconds and whose first
    frame at ``first_frame`` / 10 seconds."""
    import fractions

    import av

    with av.open(str(path), mode="w") as container:
        video = container.add_stream("libx264", rate=10)
        video.width, video.height, video.pix_fmt = 64, 64, "yuv420p"
        audio = container.add_stream("aac", rate=16_000)
        audio.layout = "mono"
        for i in range(round(seconds * 10)):
            black = av.VideoFrame.from_ndarray(np.zeros((64, 64, 3), np.uint8), format="rgb24")
            black.pts, black.time_base = first_frame + i, fractions.Fraction(1, 10)
            container.mux(video.encode(black))
        chunk = av.AudioFrame.from_ndarray(sound[None, :], format="flt", layout="mono")
        chunk.sample_rate, chunk.time_base = 16_000, fractions.Fraction(1, 16_000)
        chunk.pts = round(sound_start * 16_000)
        container.mux(audio.encode(chunk))
        container.mux(audio.encode(None))
        container.mux(video.encode(None))
    return path


def onset(wave: np.ndarray) -> float:
    """Seconds to the first sample above a tenth of full scale."""
    return float(np.flatnonzero(np.abs(wave) > 0.1)[0]) / 16_000


def test_a_videos_sound_is_placed_on_the_videos_timeline(tmp_path):
    """A track that starts 1 s after the first frame is heard 1 s in, as the frames show
    it (it was heard from 0); the same file read as an audio item starts at its sound."""
    from omni_rl.preprocess.pipeline import decode_medium

    path = write_late_sound_video(tmp_path / "late.mp4", 1.0, tone(0.5))
    media = budgets("skip")
    heard, _ = decode_medium("video_audio", path, media)
    assert onset(heard["audio"]) == pytest.approx(1.0, abs=0.005)
    alone, _ = decode_medium("audio", path, media)
    assert onset(alone["audio"]) < 0.1
    on_time = write_late_sound_video(tmp_path / "on_time.mp4", 0.0, tone(0.5))
    assert onset(decode_medium("video_audio", on_time, media)[0]["audio"]) < 0.005
    # sound before the first frame is not heard: the frames start 0.3 s into the tone
    early = write_late_sound_video(tmp_path / "early.mp4", 0.0, tone(0.5), first_frame=3)
    heard, whole = (decode_medium(kind, early, media)[0]["audio"] for kind in ("video_audio", "audio"))
    assert whole.size - heard.size == pytest.approx(0.3 * 16_000, abs=16)
    assert np.array_equal(heard, whole[-heard.size :])


def test_a_rows_use_audio_in_video_must_be_true_or_false(tmp_path):
    """A row's "use_audio_in_video": "false" (or "no", "0") was read as true, and its
    videos were heard with their sound."""
    from omni_rl.preprocess.rows import read_rows

    path = tmp_path / "rows.jsonl"
    base = {"problem": "<video>\nWhat?", "problem_type": "open_ended", "answer": "a", "videos": ["v.mp4"]}
    flags = {"yes": True, "no": False, "unset": None, "text": "false", "zero": 0}
    path.write_text("".join(json.dumps({**base, "id": k, "use_audio_in_video": v}) + "\n" for k, v in flags.items()))
    rows, failures = read_rows(path)
    assert [r.id for r in rows] == ["yes", "no", "unset"]
    assert [(f.id, f.reason) for f in failures] == [
        ("text", "'use_audio_in_video' must be true or false, got 'false'"),
        ("zero", "'use_audio_in_video' must be true or false, got 0"),
    ]


def test_write_videos_sound_starts_with_its_first_frame(tmp_path):
    """write_video's AAC track carried the encoder's 1,024 priming samples: the sound
    of a synthetic clip was heard 64 ms late and 1,024 samples long."""
    from omni_rl.preprocess.pipeline import decode_medium

    sound = np.concatenate([np.zeros(8_000, np.float32), tone(1.0)])
    path = write_video(tmp_path / "av.mp4", moving_square("up", 1.5, 10, 64, 64), 10, audio=sound)
    heard = decode_medium("video_audio", path, budgets("skip"))[0]["audio"]
    assert onset(heard) == pytest.approx(0.5, abs=0.005)
    assert 0 <= heard.size - sound.size < 1_024  # the last AAC frame's padding, no more
