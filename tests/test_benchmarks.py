"""Benchmark presets: each reads a fixture in the benchmark's published layout, and its
parser and metric give the hand-worked scores of saved responses; a tiny model runs
each preset end to end."""

from __future__ import annotations

import json
from pathlib import Path

import bench_fixtures
import pytest

from omni_rl.benchmarks import BENCHMARKS
from omni_rl.benchmarks.base import Protocol
from omni_rl.benchmarks.videomme import frame_times, parse_srt, subtitles_at
from omni_rl.benchmarks.vsibench import mean_relative_accuracy
from omni_rl.cli import BENCHMARK_NAMES, main
from omni_rl.preprocess.config import MediaConfig
from omni_rl.preprocess.pipeline import Budgets
from omni_rl.preprocess.video import read_video


def run_eval(name, data, out, *extra):
    return main(["eval", "--benchmark", name, "--data", str(data), "--out", str(out), *extra])


def scored(tmp_path, name, responses, *extra, layout=None, code=0):
    """Score saved responses through the CLI (its exit ``code``: 1 when no row is
    scored); the results JSON and the sample records."""
    data = tmp_path / "data"
    (bench_fixtures.charades_sta(data, layout) if layout else bench_fixtures.BUILDERS[name](data))
    predictions = bench_fixtures.write_predictions(tmp_path / "predictions.jsonl", responses)
    out = tmp_path / "out"
    assert run_eval(name, data, out, "--predictions", str(predictions), *extra) == code
    results = json.loads((out / "results.json").read_text())
    samples = [json.loads(line) for line in (out / f"samples_{name}.jsonl").read_text().splitlines()]
    return results, samples


def metrics(results, name):
    return {k.removesuffix(",none"): v for k, v in results["results"][name].items() if k != "alias"}


def test_every_list_of_presets_is_the_registry():
    """eval --benchmark offers every preset and data convert every preset with rows of
    its own (Video-MME with subtitles converts as videomme), read from the registry."""
    from omni_rl.cli import DATA_FORMATS
    from omni_rl.data.convert import FORMATS

    assert list(BENCHMARK_NAMES) == BENCHMARKS.names()
    own_rows = {name for name in BENCHMARKS if BENCHMARKS.get(name).rows_of is None}
    assert {name for name in FORMATS if name in BENCHMARKS} == own_rows == set(CONVERTED)
    assert own_rows <= set(DATA_FORMATS) and "videomme_w_subtitle" not in DATA_FORMATS


def test_mvbench_accuracy_per_task_and_both_denominators(tmp_path):
    responses = bench_fixtures.mvbench(tmp_path / "unused")
    results, samples = scored(tmp_path, "mvbench", responses)
    got = metrics(results, "mvbench")
    # action_sequence: 1 of 2 right; action_antonym: 1 of 2 (one unparsable answer)
    assert got["accuracy/action_sequence"] == pytest.approx(50.0)
    assert got["accuracy/action_antonym"] == pytest.approx(50.0)
    assert got["accuracy"] == pytest.approx(50.0)
    assert got["rows"] == 4
    assert results["n-samples"]["mvbench"] == {"original": 6, "effective": 4}
    reasons = {r["id"]: r["reason"] for r in results["skipped"]["rows"]}
    assert "MISSING.mp4" in reasons["action_sequence-2"] and "not one of the candidates" in reasons["action_antonym-2"]
    assert all(":" in r["path"] and r["path"].split(":")[0].endswith(".json") for r in results["skipped"]["rows"])
    assert results["deviations"]["read_whole_despite_bounds"] == 2  # uncut videos with start/end
    by_id = {s["id"]: s for s in samples}
    assert by_id["action_sequence-0"]["target"] == "B" and by_id["action_sequence-0"]["filtered_resps"] == ["B"]
    assert by_id["action_antonym-1"]["filtered_resps"] == [None]
    prompt = by_id["action_sequence-0"]["input"]
    assert prompt.startswith("Question:What happened after the person took the food?\nOption:\n(A) Ate")

    # Video-MME's own script's denominator, no lmms-eval task's: answered rows only (antonym 1 of 1)
    answered, _ = scored(tmp_path / "b", "mvbench", responses, "--set", "protocol.metric=accuracy_answered")
    assert metrics(answered, "mvbench")["accuracy"] == pytest.approx(75.0)
    assert answered["configs"]["mvbench"]["overrides"] == {"metric": "accuracy_answered"}


def test_mvbench_divides_by_non_empty_responses_as_lmms_eval_does(tmp_path):
    """lmms-eval's MVBench drops empty responses only: an empty one leaves the
    denominator, an unparsable one stays in it, and so does a blank one (its
    ``pred_answer != ""`` test reads the response as decoded, unstripped)."""
    responses = bench_fixtures.mvbench(tmp_path / "unused") | {"action_sequence-1": ""}
    by_metric = {}
    for metric in ("accuracy_responded", "accuracy", "accuracy_answered"):
        results, _ = scored(tmp_path / metric, "mvbench", responses, "--set", f"protocol.metric={metric}")
        by_metric[metric] = metrics(results, "mvbench")
        follows = results["configs"]["mvbench"]["follows"]
        assert follows["same_denominator"] == (metric == "accuracy_responded")
    # sequence: 1 right of 1 non-empty (2 in all); antonym: 1 of 2 ("I cannot tell." counts), 1 of 1 answered
    assert by_metric["accuracy_responded"]["accuracy/action_sequence"] == pytest.approx(100.0)
    assert by_metric["accuracy_responded"]["accuracy/action_antonym"] == pytest.approx(50.0)
    assert by_metric["accuracy"]["accuracy/action_sequence"] == pytest.approx(50.0)
    assert by_metric["accuracy_answered"]["accuracy"] == pytest.approx(100.0)
    assert BENCHMARKS.get("mvbench").protocol.metric == "accuracy_responded"
    blank, _ = scored(tmp_path / "blank", "mvbench", responses | {"action_sequence-1": "\n"})
    assert metrics(blank, "mvbench")["accuracy/action_sequence"] == pytest.approx(50.0)


@pytest.mark.parametrize("name", BENCHMARKS.names())
def test_results_name_the_lmms_eval_release_each_preset_follows(tmp_path, name):
    """Each preset's docs and results name lmms-eval 0.7.2, its parser and its
    denominator; the default metric divides as that release does."""
    import sys

    from omni_rl.benchmarks.base import LMMS_EVAL

    assert LMMS_EVAL == "0.7.2"
    assert "lmms-eval 0.7.2" in sys.modules[BENCHMARKS.get(name).read.__module__].__doc__
    builder = bench_fixtures.charades_sta if name == "charades_sta" else bench_fixtures.BUILDERS[name]
    # videomme_w_subtitle samples 32 frames, more than the fixture's 8-frame clips hold: it
    # scores no row and exits 1, and its results still name what they follow
    results, _ = scored(tmp_path, name, builder(tmp_path / "unused"), code=int(name == "videomme_w_subtitle"))
    follows = results["configs"][name]["follows"]
    assert follows["variant"] == "lmms-eval" and follows["follows"].startswith("lmms-eval 0.7.2, lmms_eval/tasks/")
    assert follows["parser"] and follows["denominator"] and follows["same_denominator"]
    assert results["configs"][name]["protocol"]["metric"] == follows["metric"]


def test_videomme_accuracy_and_breakdowns(tmp_path):
    results, samples = scored(tmp_path, "videomme", bench_fixtures.videomme(tmp_path / "unused"))
    got = metrics(results, "videomme")
    assert got["accuracy"] == pytest.approx(50.0)  # "The best answer is C." right, "B" wrong
    assert got["accuracy/duration/short"] == pytest.approx(50.0)
    assert got["accuracy/task_type/Counting Problem"] == pytest.approx(100.0)
    assert got["accuracy/task_type/OCR Problems"] == pytest.approx(0.0)
    assert results["skipped"]["count"] == 1 and "missing0000" in results["skipped"]["rows"][0]["reason"]
    prompt = samples[0]["input"]
    assert "\nWhich decoration has the largest number?\nA. Apples.\nB. Candles." in prompt
    assert prompt.endswith("D. The same number.\n\nAnswer with the option's letter from the given choices directly.")
    assert "A. A. " not in prompt


def test_videomme_subtitles_are_those_at_the_sampled_frames(tmp_path):
    srt = '1\n00:00:00,000 --> 00:00:00,400\n<font color="white">hello</font>\n\n'
    cues = parse_srt(srt + "2\n00:00:00,600 --> 00:00:01,000\nhidden\n")
    assert cues == [(0.0, 0.4, "hello"), (0.6, 1.0, "hidden")]
    # 8 frames at 4 fps, 4 sampled: frames 0, 2, 5, 7 -> 0, 0.5, 1.25, 1.75 s
    assert frame_times(8, 4.0, Protocol(nframes=4)) == [0.0, 0.5, 1.25, 1.75]
    # the frames the decoder samples, whatever the protocol asks (an odd count is made
    # even, fps is clamped to the frame limits): the subtitles are those the model sees
    clip = bench_fixtures.video(tmp_path / "clip.mp4", frames=24, fps=4)
    for protocol in (Protocol(nframes=5), Protocol(nframes=None, fps=0.5), Protocol(nframes=None, fps=3.0)):
        budget = Budgets.from_config(MediaConfig(**protocol.media("qwen2_5_vl"))).video
        assert frame_times(24, 4.0, protocol) == read_video(clip, budget).timestamps, protocol
    assert subtitles_at([*cues, (1.2, 1.3, "world")], [0.0, 0.5, 1.25, 1.75]) == "hello\nworld"
    results, samples = scored(tmp_path, "videomme_w_subtitle", {"001-1": "C"}, "--set", "protocol.nframes=4")
    prompt = samples[0]["input"]
    assert prompt.startswith("This video's subtitles are listed below: \nhello\nworld\nSelect the best answer")
    assert prompt.endswith("D. The same number.\nThe best answer is:")
    assert results["configs"]["videomme_w_subtitle"]["protocol"]["nframes"] == 4


def test_vsibench_mra_and_accuracy(tmp_path):
    # |5 - 4| / 4 = 0.25 <= 1 - t for t = 0.50 ... 0.75: 6 of 10 thresholds
    assert mean_relative_accuracy(5.0, 4.0) == pytest.approx(0.6)
    assert mean_relative_accuracy(21.0, 20.0) == pytest.approx(1.0)  # 0.05 <= 1 - 0.95
    assert mean_relative_accuracy(40.0, 20.0) == 0.0
    results, samples = scored(tmp_path, "vsibench", bench_fixtures.vsibench(tmp_path / "unused"))
    got = metrics(results, "vsibench")
    assert got["object_counting_mra"] == pytest.approx(0.6)
    assert got["room_size_estimation_mra"] == pytest.approx(1.0)
    assert got["object_rel_direction_accuracy"] == pytest.approx(0.5)  # easy right, hard wrong: mean of the two
    assert got["route_planning_accuracy"] == pytest.approx(1.0)
    assert got["overall"] == pytest.approx((0.6 + 1.0 + 0.5 + 1.0) / 4)
    reasons = " ".join(r["reason"] for r in results["skipped"]["rows"])
    assert "unknown question_type 'object_weight'" in reasons and "arkitscenes/gone.mp4" in reasons
    numeric = next(s for s in samples if s["id"] == "0")
    post = "Please answer the question using a single word or phrase."
    assert numeric["input"] == f"These are frames of a video.\nHow many tables?\n{post}"
    choice = next(s for s in samples if s["id"] == "2")
    post = "Answer with the option's letter from the given choices directly."
    assert choice["input"].endswith(f"Left?\nOptions:\nA. chair\nB. table\nC. sofa\n{post}")


@pytest.mark.parametrize("layout", ["txt", "parquet"])
def test_charades_sta_miou_and_recall(tmp_path, layout):
    responses = bench_fixtures.charades_sta(tmp_path / "unused")
    results, samples = scored(tmp_path, "charades_sta", responses, layout=layout)
    got = metrics(results, "charades_sta")
    # IoUs: 1.0, and [0.5, 1.0] against [0.5, 2.0] = 0.5 / 1.5
    assert got["mIoU"] == pytest.approx(100 * (1.0 + 1 / 3) / 2)
    assert got["R@0.3"] == pytest.approx(100.0)
    assert got["R@0.5"] == pytest.approx(50.0)
    assert got["R@0.7"] == pytest.approx(50.0)
    assert results["skipped"]["count"] == 1 and "GONE1" in results["skipped"]["rows"][0]["reason"]
    # lmms-eval 0.7.2's prompt: f"{pre_prompt}{caption}. {post_prompt}", the caption as
    # written (its period kept: "... opens a door.. Please return ...")
    first = next(s for s in samples if s["id"] == "3MSZA-0")["input"]
    assert first.endswith("textual sentence: person opens a door.. Please return its start time and end time.")


def test_mmau_letter_or_text_and_the_text_only_parser(tmp_path):
    responses = bench_fixtures.mmau(tmp_path / "unused")
    results, _ = scored(tmp_path, "mmau_test_mini", responses)
    got = metrics(results, "mmau_test_mini")
    # "A" (Man) right, "guitar" (the text of B) right, "(C)" (Angry; gold Sad) wrong
    assert got["accuracy"] == pytest.approx(200 / 3)
    assert got["accuracy/task/sound"] == 100.0 and got["accuracy/task/music"] == 100.0
    assert got["accuracy/task/speech"] == 0.0 and got["accuracy/difficulty/hard"] == 0.0
    assert "lost.wav" in results["skipped"]["rows"][0]["reason"]
    text_only, _ = scored(tmp_path / "b", "mmau_test_mini", responses, "--set", "protocol.answer_parser=choice_text")
    assert metrics(text_only, "mmau_test_mini")["accuracy"] == pytest.approx(100 / 3)


def test_mmau_official_protocol_scores_as_mmaus_evaluation_script(tmp_path):
    """``protocol.variant=official``: MMAU's evaluation.py rule (every word of the right
    choice, none of the words only the others have), a prompt asking for the text, and
    the gold stored as the choice's text."""
    ids = ["3fe64f3d", "7a1b2c3d", "9e8d7c6b"]
    responses = {ids[0]: "The speaker is a man.", ids[1]: "B", ids[2]: "Sad or angry"}
    results, samples = scored(tmp_path, "mmau_test_mini", responses, "--set", "protocol.variant=official")
    got = metrics(results, "mmau_test_mini")
    # "a man" holds Man's word and no other choice's; a letter holds no choice's words; "angry" is another's
    assert got["accuracy"] == pytest.approx(100 / 3)
    assert [s["accuracy"] for s in samples] == [1.0, 0.0, 0.0]
    assert [s["target"] for s in samples] == ["Man", "Guitar", "Sad"]
    assert samples[1]["input"].endswith(
        "Which instrument?\nChoices:\n- Piano\n- Guitar\nAnswer with the text of the correct choice."
    )
    config = results["configs"]["mmau_test_mini"]
    assert config["protocol"]["answer_parser"] == "choice_words" and config["protocol"]["variant"] == "official"
    assert config["follows"]["follows"].startswith("MMAU's evaluation.py") and config["follows"]["same_denominator"]
    # the lmms-eval protocol reads letters (and whole choice texts): a sentence holding "man" names no choice,
    # reasoning opening with the article and stating B does
    stated = responses | {ids[1]: "A person strums, so the best option is B."}
    _, letters = scored(tmp_path / "b", "mmau_test_mini", stated)
    assert [s["accuracy"] for s in letters] == [0.0, 1.0, 0.0]
    assert [s["filtered_resps"] for s in letters] == [[None], ["B"], [None]]  # no random guess


def test_an_unknown_protocol_variant_lists_the_known_ones(tmp_path, capsys):
    data = tmp_path / "data"
    bench_fixtures.mmau(data)
    predictions = bench_fixtures.write_predictions(tmp_path / "p.jsonl", {"3fe64f3d": "Man"})
    base = ["eval", "--benchmark", "mmau_test_mini", "--data", str(data), "--predictions", str(predictions)]
    assert main([*base, "--out", str(tmp_path / "out"), "--set", "protocol.variant=mmau"]) == 2
    assert "mmau_test_mini has the protocols lmms-eval, official, not 'mmau'" in capsys.readouterr().err


def test_several_responses_per_id_score_pass_at_k(tmp_path):
    data = tmp_path / "data"
    responses = bench_fixtures.mmau(data)
    lines = [{"id": k, "response": v} for k, v in responses.items()] + [{"id": "9e8d7c6b", "response": "Sad"}]
    predictions = tmp_path / "p.jsonl"
    predictions.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "out"
    assert run_eval("mmau_test_mini", data, out, "--predictions", str(predictions)) == 0
    got = metrics(json.loads((out / "results.json").read_text()), "mmau_test_mini")
    assert got["accuracy"] == pytest.approx(100.0)


def test_protocol_overrides_are_checked(tmp_path, capsys):
    data = tmp_path / "data"
    bench_fixtures.mmau(data)
    base = ["eval", "--benchmark", "mmau_test_mini", "--data", str(data), "--predictions", str(tmp_path / "none.jsonl")]
    assert main([*base, "--set", "protocol.nframez=4"]) == 2
    assert "did you mean 'nframes'" in capsys.readouterr().err
    assert main([*base, "--samples", "4"]) == 2
    assert "temperature" in capsys.readouterr().err
    assert main([*base, "--set", "media.fps=1"]) == 2
    assert "only protocol fields apply" in capsys.readouterr().err
    assert main(["eval", "--benchmark", "mvbench", "--data", str(data), "--predictions", "x"]) == 2
    assert "no mvbench files found" in capsys.readouterr().err


VIDEO_PRESETS = ["mvbench", "videomme", "videomme_w_subtitle", "vsibench", "charades_sta"]


@pytest.mark.parametrize("name", [*VIDEO_PRESETS, "mmau_test_mini"])
def test_a_tiny_model_runs_each_preset(tmp_path, tiny_checkpoint, name):
    """The model path end to end: media decoded by the training path, answers
    generated, results written; the aggregate equals the per-sample scores worked
    through by hand, and re-scoring the saved answers gives the same results."""
    data, out = tmp_path / "data", tmp_path / "out"
    bench_fixtures.BUILDERS[name](data)
    model = tiny_checkpoint("qwen2_audio" if name == "mmau_test_mini" else "qwen2_5_vl")
    args = ["eval", "--benchmark", name, "--data", str(data), "--model", str(model), "--out", str(out)]
    assert main([*args, "--set", "protocol.nframes=4", "--max-new-tokens", "6"]) == 0
    results = json.loads((out / "results.json").read_text())
    samples = [json.loads(line) for line in (out / f"samples_{name}.jsonl").read_text().splitlines()]
    metric = results["configs"][name]["protocol"]["metric"]
    assert results["n-samples"][name]["effective"] == len(samples) > 0
    assert all(len(s["resps"][0]) == 1 for s in samples)
    scores = [s[metric] for s in samples]
    got = metrics(results, name)
    if name == "mvbench":
        per_task = {}
        for s in samples:
            per_task.setdefault(s["task"], []).append(s[metric])
        assert got["accuracy"] == pytest.approx(sum(100 * sum(v) / len(v) for v in per_task.values()) / len(per_task))
    elif name == "charades_sta":
        assert got["mIoU"] == pytest.approx(100 * sum(scores) / len(scores))
    elif name == "vsibench":
        by_type = {}
        for s in samples:
            kind = "object_rel_direction" if s["task"].startswith("object_rel_direction") else s["task"]
            by_type.setdefault(kind, {}).setdefault(s["task"], []).append(s[metric])
        # directions: the mean of each direction type's mean; the rest: each type's mean
        per_kind = [sum(sum(v) / len(v) for v in t.values()) / len(t) for t in by_type.values()]
        assert got["overall"] == pytest.approx(sum(per_kind) / len(per_kind))
    else:
        assert got["accuracy"] == pytest.approx(100 * sum(scores) / len(scores))
    saved = bench_fixtures.write_predictions(tmp_path / "saved.jsonl", {s["id"]: s["resps"][0][0] for s in samples})
    again = tmp_path / "again"
    assert run_eval(name, data, again, "--predictions", str(saved), "--set", "protocol.nframes=4") == 0
    assert json.loads((again / "results.json").read_text())["results"] == results["results"]


CONVERTED = {"mvbench": 4, "videomme": 2, "vsibench": 5, "charades_sta": 2, "mmau_test_mini": 3}


@pytest.mark.parametrize("name", sorted(CONVERTED))
def test_data_convert_turns_each_benchmark_into_training_rows(tmp_path, name):
    from omni_rl.preprocess.rows import read_rows
    from omni_rl.rewards import check_targets

    data, out = tmp_path / "data", tmp_path / "rows" / "train.jsonl"
    bench_fixtures.BUILDERS[name](data)
    assert main(["data", "convert", "--from", name, str(data), "--out", str(out)]) == 0
    summary = json.loads((tmp_path / "rows" / "train.summary.json").read_text())
    assert summary["written"] == CONVERTED[name] and summary["read"] == summary["written"] + summary["failed"] > 0
    assert summary["media_root"] == str(data.resolve())  # media stay where the benchmark keeps them
    rows, failures = read_rows(out)
    assert len(rows) == CONVERTED[name] and not failures and not check_targets(rows)
    assert all("benchmark_prompt" not in r.fields for r in rows)  # training renders its own prompt
    assert all(Path(p).is_absolute() for r in rows for p in r.videos + r.audios)
    failed = [json.loads(line) for line in (tmp_path / "rows" / "train.failures.jsonl").read_text().splitlines()]
    assert len(failed) == summary["failed"] and all(f["reason"] and ":" in f["path"] for f in failed)
    assert main(["rewards", "check", str(out)]) == 0


def test_benchmark_media_go_through_the_training_cache(tmp_path, tiny_checkpoint):
    """With --cache the preset's media are preprocessed into the cache first (the
    training path), and a second run reads every medium from it."""
    data, cache = tmp_path / "data", tmp_path / "cache"
    bench_fixtures.vsibench(data)
    model = str(tiny_checkpoint("qwen2_5_vl"))
    used = []
    for attempt in ("first", "second"):
        out = tmp_path / attempt
        extra = ["--model", model, "--cache", str(cache), "--set", "protocol.nframes=4", "--max-new-tokens", "2"]
        assert run_eval("vsibench", data, out, *extra) == 0
        used.append(json.loads((out / "results.json").read_text())["config"]["media"])
    assert used[1]["data/cache_hits"] == 5 and used[1]["data/cache_misses"] == 0
    assert used[1]["settings"]["nframes"] == 4 and used[1]["settings"]["media_root"] == str(data.resolve())


def test_a_limit_spreads_over_the_whole_set():
    from omni_rl.benchmarks.base import spread

    assert spread(list(range(10)), 4) == [0, 2, 5, 7]
    assert spread(list(range(10)), 0) == list(range(10)) == spread(list(range(10)), 20)
    tasks = [f"task{t}" for t in range(20) for _ in range(200)]  # MVBench's shape
    assert set(spread(tasks, 400)) == set(tasks) and len(spread(tasks, 400)) == 400


def test_rows_a_cache_could_not_decode_are_reported_as_skipped(tmp_path):
    """A video the cache could not decode refuses its row when the dataset loads: the
    results list it under ``skipped`` with the reason, as without a cache (where it
    fails as it is read), not only as an unanswered count."""
    from omni_rl.evaluation import benchmark
    from omni_rl.evaluation.pipeline import evaluate_benchmark

    data = tmp_path / "data"
    bench_fixtures.charades_sta(data)
    (data / "Charades_v1_480" / "BROKEN.mp4").write_bytes(b"not a video" * 100)
    with (data / "charades_sta_test.txt").open("a") as f:
        f.write("BROKEN 0.0 1.0##person waves.\n")
    prepared = benchmark.prepare("charades_sta", data, tmp_path / "out", {"nframes": 4})
    dataset, _ = benchmark.media_dataset(prepared, "qwen2_5_vl", str(tmp_path / "cache"), progress=False)
    answers = {row.id: ["[0.0, 1.0]"] for row in dataset.rows}
    summary, _ = evaluate_benchmark(prepared, answers, [], {})
    skipped = summary["skipped"]
    assert skipped["unanswered"] == 0 and skipped["count"] == 2  # the missing video and the broken one
    broken = [r for r in skipped["rows"] if r["id"].startswith("BROKEN")]
    assert len(broken) == 1 and "BROKEN.mp4: cannot decode video" in broken[0]["reason"]
    assert summary["n-samples"]["charades_sta"] == {"original": 4, "effective": 2}


def test_predictions_for_no_row_are_said_and_nothing_scored_fails(tmp_path, capsys):
    """Prediction ids that match no row of the preset were dropped silently, and a run
    that scored no row exited 0."""
    data = tmp_path / "data"
    responses = bench_fixtures.mmau(data)
    first = next(iter(responses))
    mixed = bench_fixtures.write_predictions(tmp_path / "mixed.jsonl", {first: responses[first], "md-0": "Man"})
    assert run_eval("mmau_test_mini", data, tmp_path / "a", "--predictions", str(mixed)) == 0
    assert "1 of 2 ids in" in capsys.readouterr().err
    foreign = bench_fixtures.write_predictions(tmp_path / "foreign.jsonl", {"md-0": "Man", "md-1": "Woman"})
    assert run_eval("mmau_test_mini", data, tmp_path / "b", "--predictions", str(foreign)) == 1
    err = capsys.readouterr().err
    assert "2 of 2 ids in" in err and "(first: 'md-0')" in err and "mmau_test_mini: no row was scored" in err
