"""Model inputs entries: the processor's output for a row, cached beside its media."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch
from test_dataset import small_budgets

from omni_rl.data.dataset import MediaDataset, encode_sample
from omni_rl.models import FAMILIES, load
from omni_rl.preprocess.cache import MediaCache
from omni_rl.preprocess.inputs import inputs_dtype, pack, unpack
from omni_rl.preprocess.pipeline import preprocess
from omni_rl.preprocess.synthetic import moving_square, tone, write_image, write_video, write_wav

ROWS = {  # row id -> the modalities it needs
    "video": {"video"},
    "image": {"image"},
    "audio": {"audio"},
    "both": {"video", "image"},
}


@pytest.fixture(scope="module")
def rows_file(tmp_path_factory):
    root = tmp_path_factory.mktemp("inputs")
    write_video(root / "m" / "a.mp4", moving_square("right", 2.0, 10, 120, 90), 10)
    write_image(root / "m" / "i.png", np.random.default_rng(1).integers(0, 255, (70, 50, 3), dtype=np.uint8))
    write_wav(root / "m" / "t.wav", tone(1.5, hz=300.0))
    rows = [
        {"id": "video", "problem": "Which way?", "videos": ["m/a.mp4"], "options": ["left", "right"]},
        {"id": "image", "problem": "What is it?", "images": ["m/i.png"]},
        {"id": "audio", "problem": "What pitch?", "audios": ["m/t.wav"]},
        {"id": "both", "problem": "First <video> then <image>. Same?", "videos": ["m/a.mp4"], "images": ["m/i.png"]},
    ]
    path = root / "data.jsonl"
    path.write_text("".join(json.dumps({"problem_type": "open_ended", "answer": "x", **r}) + "\n" for r in rows))
    return path


def usable(family: str) -> list[str]:
    return [row for row, kinds in ROWS.items() if kinds <= set(FAMILIES.get(family).modalities)]


def assert_same_inputs(a: dict, b: dict, where) -> None:
    assert set(a) == set(b), where
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), (where, name)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_cached_model_inputs_are_the_processors_bit_for_bit(family, rows_file, tiny_checkpoint, tmp_path):
    budgets, cache = small_budgets(family), tmp_path / "cache"
    assert preprocess(rows_file, cache, budgets, workers=1, progress=False).failed == 0
    _, processor = load(tiny_checkpoint(family))
    wanted = usable(family)
    writer = MediaDataset(rows_file, budgets, cache, inputs="float32")
    counts = writer.cache_inputs(processor, progress=False)
    # rows of media the family lacks are bad, unless its processor passes over them
    assert counts["written"] >= len(wanted) and counts["written"] + counts["bad"] == len(ROWS)
    rerun = writer.cache_inputs(processor, progress=False)
    assert rerun == {**counts, "written": 0, "present": counts["written"]}  # a rerun writes nothing

    raw = MediaDataset(rows_file, budgets, cache_mode="no_cache")
    cached = MediaDataset(rows_file, budgets, cache, "cache_only", inputs="float32")
    for index, row in enumerate(raw.rows):
        if row.id in wanted:
            _, inputs = cached.encoded(index, processor)
            assert_same_inputs(inputs, dict(encode_sample(processor, raw[index])), (family, row.id))
    assert (cached.inputs_hits, cached.inputs_misses) == (len(wanted), 0)
    stats = MediaCache(cache).stats()["by_kind"]
    assert stats["inputs"]["entries"] == counts["written"]


def test_a_changed_processor_prompt_or_dtype_is_a_miss_never_stale_inputs(rows_file, tiny_checkpoint, tmp_path, caplog):
    family = "qwen2_5_vl"
    budgets, cache = small_budgets(family), tmp_path / "cache"
    preprocess(rows_file, cache, budgets, workers=1, progress=False)
    _, processor = load(tiny_checkpoint(family))
    MediaDataset(rows_file, budgets, cache, inputs="float32").cache_inputs(processor, progress=False)

    _, changed = load(tiny_checkpoint(family))
    changed.video_processor.image_mean = [0.5, 0.5, 0.5]
    changed.image_processor.image_mean = [0.5, 0.5, 0.5]
    cases = {
        "processor settings": (MediaDataset(rows_file, budgets, cache, inputs="float32"), changed),
        "prompt template": (
            MediaDataset(rows_file, budgets, cache, prompt_template="Q: {problem}", inputs="float32"),
            processor,
        ),
        "stored dtype": (MediaDataset(rows_file, budgets, cache, inputs="bfloat16"), processor),
    }
    for why, (dataset, proc) in cases.items():
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            for index in range(len(dataset)):
                if dataset.rows[index].id in usable(family):
                    _, inputs = dataset.encoded(index, proc)
                    assert_same_inputs(inputs, dict(encode_sample(proc, dataset[index])), why)
        assert (dataset.inputs_hits, dataset.inputs_misses) == (0, len(usable(family))), why
        misses = [r for r in caplog.records if "data/inputs_misses" in r.getMessage()]
        assert len(misses) == 1 and "omni-rl preprocess" in misses[0].getMessage(), why  # said once, with the fix


def test_a_damaged_entry_is_reported_and_the_processor_runs_instead(rows_file, tiny_checkpoint, tmp_path, caplog):
    family = "qwen2_5_vl"
    budgets, cache = small_budgets(family), tmp_path / "cache"
    preprocess(rows_file, cache, budgets, workers=1, progress=False)
    _, processor = load(tiny_checkpoint(family))
    dataset = MediaDataset(rows_file, budgets, cache, inputs="float32")
    dataset.cache_inputs(processor, progress=False)
    key = dataset.inputs_key(dataset[0], processor)
    path = MediaCache(cache).path(key)
    path.write_bytes(path.read_bytes()[:100])
    assert MediaCache(cache).check(key) is not None  # omni-rl cache verify finds it
    with caplog.at_level(logging.WARNING):
        _, inputs = dataset.encoded(0, processor)
    assert_same_inputs(inputs, dict(encode_sample(processor, dataset[0])), "damaged")
    assert dataset.inputs_misses == 1 and "unreadable cache entry" in caplog.text


def test_cache_verify_moves_the_inputs_made_from_a_corrupt_media_entry_aside(
    rows_file, tiny_checkpoint, tmp_path, capsys
):
    """A media entry rots, then model inputs are encoded from it: their own bytes check
    out, and once preprocess rebuilds the media entry (same key) they would be read
    again. verify moves them aside with the media entry, so they are made afresh."""
    from omni_rl.cli import main

    family = "qwen2_5_vl"
    budgets, cache = small_budgets(family), tmp_path / "cache"
    preprocess(rows_file, cache, budgets, workers=1, progress=False)
    _, processor = load(tiny_checkpoint(family))
    dataset = MediaDataset(rows_file, budgets, cache, inputs="float32")
    store = MediaCache(cache)
    (media,) = dataset[0].media_keys
    path = store.path(media)
    rotten = bytearray(path.read_bytes())
    rotten[-1] ^= 0xFF  # the last byte of the tensors
    path.write_bytes(bytes(rotten))
    dataset.cache_inputs(processor, progress=False)
    key = dataset.inputs_key(dataset[0], processor)
    assert store.check(key) is None and store.check(media) is not None
    assert main(["cache", "verify", str(cache)]) == 1
    out = capsys.readouterr().out
    assert f"made from a corrupt entry: {store.path(key)}" in out and ", 1 corrupt, " in out
    assert not store.has(key) and not store.has(media)
    preprocess(rows_file, cache, budgets, workers=1, progress=False)  # rebuilds the media entry
    assert store.check(media) is None and not store.has(key)  # no stale inputs to come back to


@pytest.mark.parametrize(
    "family", ["qwen2_5_vl", "qwen3_vl", "qwen2_audio", "qwen2_5_omni_thinker", "qwen3_omni_moe_thinker"]
)
def test_bf16_features_give_a_bf16_run_the_same_log_probs_and_gradients(family, rows_file, tiny_checkpoint):
    """A run that computes in bf16 rounds the media features to bf16 in its first layer
    over them, so features stored in bf16 change nothing it computes; in an fp32 run the
    same rounding would change the log-probs (so the check can fail)."""
    assert inputs_dtype("bf16-mixed") == "bfloat16" and inputs_dtype("fp32") == "float32"
    budgets = small_budgets(family)
    model, processor = load(tiny_checkpoint(family))
    model.train()
    dataset = MediaDataset(rows_file, budgets, cache_mode="no_cache")
    rows = [i for i, row in enumerate(dataset.rows) if row.id in usable(family)]
    for index in rows:
        exact = dict(encode_sample(processor, dataset[index]))
        tensors, meta = pack(exact, "bfloat16", [])
        rounded = unpack(_entry(tensors, meta))
        features = [name for name in meta["stored"]]
        assert features and any(not torch.equal(exact[n], rounded[n]) for n in features)

        def run(inputs, autocast: bool):
            model.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                logits = model(**inputs).logits
            logp = torch.log_softmax(logits.float(), -1)
            logp[..., :7].sum().backward()
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
            return logp.detach(), grads

        logp, grads = run(exact, autocast=True)
        logp_cached, grads_cached = run(rounded, autocast=True)
        assert torch.equal(logp, logp_cached), (family, index)
        assert grads.keys() == grads_cached.keys() and all(torch.equal(grads[n], grads_cached[n]) for n in grads)
        assert not torch.equal(run(exact, autocast=False)[0], run(rounded, autocast=False)[0])


def test_any_bf16_input_comes_back_as_it_went_in():
    """A bf16 tensor outside the compact features (none of today's processors returns
    one) is stored as its bit pattern too, and read back as that pattern, not as the
    pattern's integer value (1.5 came back as 16320.0)."""
    inputs = {
        "video_second_per_grid": torch.tensor([0.25, 1.5], dtype=torch.bfloat16),
        "pixel_values": torch.tensor([[0.1, -2.0]]),
        "input_ids": torch.tensor([[1, 2]]),
    }
    for dtype in ("float32", "bfloat16"):
        back = unpack(_entry(*pack(inputs, dtype, [])))
        assert torch.equal(back["video_second_per_grid"], inputs["video_second_per_grid"])
        assert back["video_second_per_grid"].dtype == torch.bfloat16 and torch.equal(
            back["input_ids"], inputs["input_ids"]
        )


def _entry(tensors, meta):
    from omni_rl.preprocess.cache import Entry

    return Entry({name: torch.from_numpy(array) for name, array in tensors.items()}, meta)


def test_preprocess_with_the_training_config_caches_what_grpo_reads_and_the_run_is_the_same(
    tmp_path, tiny_checkpoint, capsys
):
    from test_grpo import tiny_config

    from omni_rl.cli import main
    from omni_rl.preprocess.scenes import write_video_qa
    from omni_rl.recipe_loader import load_config
    from omni_rl.recipes import grpo

    train = write_video_qa(tmp_path / "data", videos=4, seed=0, seconds=2.0)
    cache = tmp_path / "cache"

    def config(name: str, cache_inputs: bool):
        return tiny_config(
            tmp_path / name,
            train,
            run={"device": "cpu"},
            model={"path": str(tiny_checkpoint("qwen2_5_vl"))},
            data={"cache": str(cache), "cache_inputs": cache_inputs},
            trainer={"save_every": 0, "log_every": 1},
        )

    cached, plain = config("cached", True), config("plain", False)
    assert main(["preprocess", str(train), "--cache", str(cache), "--config", str(cached), "--workers", "1"]) == 0
    rows = len(train.read_text().splitlines())
    assert (
        f"float32 features for a fp32 run on cpu): {rows} written, 0 already cached, 0 rows failed"
        in capsys.readouterr().out
    )

    metrics = {}
    for name, path in (("cached", cached), ("plain", plain)):
        grpo.train(load_config(path))
        metrics[name] = [
            json.loads(line) for line in (tmp_path / name / "run" / "metrics.jsonl").read_text().splitlines()
        ]
    last = metrics["cached"][-1]  # the counts add up over the run
    assert (last["data/inputs_hits"], last["data/inputs_misses"]) == (3 * 2, 0)
    assert (metrics["plain"][-1]["data/inputs_hits"], metrics["plain"][-1]["data/inputs_misses"]) == (0, 0)

    def computed(row: dict) -> dict:  # what the run computed, without timings and the cache's own counts
        return {k: v for k, v in row.items() if not k.startswith(("time/", "throughput/", "data/inputs", "rollout_s"))}

    assert [computed(r) for r in metrics["cached"]] == [computed(r) for r in metrics["plain"]]


def test_cache_gc_keeps_the_inputs_of_the_media_it_keeps(rows_file, tiny_checkpoint, tmp_path):
    from omni_rl.preprocess.inputs import inputs_of
    from omni_rl.preprocess.pipeline import referenced_keys

    family = "qwen2_5_vl"
    budgets, cache = small_budgets(family), MediaCache(tmp_path / "cache")
    preprocess(rows_file, cache.root, budgets, workers=1, progress=False)
    _, processor = load(tiny_checkpoint(family))
    dataset = MediaDataset(rows_file, budgets, cache.root, inputs="float32")
    dataset.cache_inputs(processor, progress=False)
    inputs = {dataset.rows[i].id: dataset.inputs_key(dataset[i], processor) for i in range(len(dataset))}
    taken = {row: key for row, key in inputs.items() if row in usable(family)}
    assert set(inputs) - set(taken) == {"audio"}  # refused: the VL processor takes no audio

    keep = referenced_keys(rows_file, budgets, cache)
    assert inputs_of(cache, keep) == set(taken.values())  # every row's inputs beside its media
    only_image = rows_file.parent / "only_image.jsonl"
    only_image.write_text(
        "".join(line + "\n" for line in rows_file.read_text().splitlines() if '"id": "image"' in line)
    )
    preprocess(only_image, cache.root, budgets, workers=1, progress=False)  # its own index
    keep = referenced_keys(only_image, budgets, cache)
    plan = cache.gc_plan(keep | inputs_of(cache, keep))
    assert inputs["image"] in plan.keep and inputs["video"] in plan.delete and inputs["both"] in plan.delete


def test_which_inputs_a_run_reads(tmp_path):
    from omni_rl.recipe_loader import config_from_dict
    from omni_rl.recipes.common import model_inputs

    def cfg(**sections):
        return config_from_dict({"recipe": "grpo", "data": {"train": "x.jsonl"}, **sections}, "test")

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    path = {"model": {"path": str(tmp_path)}}
    assert model_inputs(cfg(**path), cpu) == "float32"  # precision auto: fp32 on a CPU
    assert model_inputs(cfg(**path), cuda) == "bfloat16"  # and bf16-mixed on a GPU
    assert model_inputs(cfg(**path, trainer={"precision": "fp32"}), cuda) == "float32"
    assert model_inputs(cfg(**path, trainer={"precision": "bf16-mixed"}), cpu) == "bfloat16"
    assert model_inputs(cfg(), cpu) is None  # a tiny model built at train time: no processor before the run
    assert model_inputs(cfg(**path, data={"train": "x.jsonl", "cache_inputs": False}), cpu) is None
