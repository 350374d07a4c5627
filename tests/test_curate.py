"""``omni-rl curate text-only``: the questions asked without their media, the rows a
model answers from their wording dropped, a report per type and source, and a resume
that asks only what is left. ``omni-rl curate difficulty``: asked with their media, the
rows always or never solved dropped."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from omni_rl.cli import main
from omni_rl.evaluation import curate
from omni_rl.preprocess.motion import write_motion_qa
from omni_rl.preprocess.rows import Row, read_rows, resolve_media_path

MEDIA = ["media.fps=null", "media.nframes=16", "media.video_min_pixels=3136", "media.video_max_pixels=3136"]
SETS = [flag for m in MEDIA for flag in ("--set", m)]


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    return write_motion_qa(tmp_path_factory.mktemp("motion"), 12, seed=0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from omni_rl.models import build_tiny

    return build_tiny("qwen2_5_vl", tmp_path_factory.mktemp("tiny"), width=64)


def test_a_row_without_media_keeps_its_question_and_options():
    question, options = "In <video> which square flashes first?", ["A. red", "B. blue"]
    fields = {"id": "r1", "problem": question, "videos": ["a.mp4"], "options": options, "answer": "A"}
    row = Row("r1", question, "multiple_choice", "A", videos=("a.mp4",), fields=fields)
    record = curate.without_media(row)
    assert record == {"id": "r1", "problem": "In which square flashes first?", "options": options, "answer": "A"}


def test_a_row_without_media_keeps_its_lines():
    """Only the placeholders go (and a line they leave empty): the question's lines and
    blank lines stay as training shows them."""
    question = "<video>\nWatch the clip.\n\nQuestion: which way? <video>\n(1) left\n(2)  right"
    row = Row("r1", question, "multiple_choice", "A", videos=("a.mp4",), fields={"problem": question})
    assert curate.without_media(row)["problem"] == "Watch the clip.\n\nQuestion: which way?\n(1) left\n(2)  right"


def test_written_rows_name_their_media_from_where_they_are_written(tmp_path):
    data = tmp_path / "data"
    record = {"id": "r1", "videos": ["media/a.mp4", "/abs/b.mp4"], "images": ["c.png"], "answer": "A"}
    assert curate.moved(record, data, data) == record  # --out the data's own directory
    above = curate.moved(record, data, tmp_path)  # --out one above it: still relative
    assert above["videos"] == ["data/media/a.mp4", "/abs/b.mp4"] and above["images"] == ["data/c.png"]
    beside = curate.moved(record, data, tmp_path / "curated")  # relative ones would climb out
    assert beside["videos"] == [str(data.resolve() / "media/a.mp4"), "/abs/b.mp4"]
    assert beside["id"] == "r1" and beside["answer"] == "A"
    # one path alone, as a string (the row schema takes it as a list of one)
    assert curate.moved({"videos": "media/a.mp4"}, data, tmp_path) == {"videos": "data/media/a.mp4"}
    assert curate.media_paths({"videos": "/abs/a.mp4", "images": ["b.png", "c.png"]}) == [
        "b.png",
        "c.png",
        "/abs/a.mp4",
    ]


def test_a_progress_line_cut_short_is_left_out(tmp_path):
    path = tmp_path / curate.PASSES
    path.write_text('{"id": "a", "pass_rate": 1.0}\n{"id": "b", "pass_rate": 0.5}\n{"id": "c", "pass')
    assert set(curate.read_passes(path)) == {"a", "b"}


def test_the_report_counts_by_hand():
    rows = [
        Row("a", "q", "multiple_choice", "A", fields={"options": ["A", "B"], "data_source": "s1"}),
        Row("b", "q", "multiple_choice", "A", fields={"options": ["A", "B", "C", "D"], "data_source": "s1"}),
        Row("c", "q", "counting", "3", fields={"data_source": "s2"}),
        Row("d", "q", "counting", "4", fields={"data_source": "s2"}),
    ]
    done = {"a": {"pass_rate": 1.0}, "b": {"pass_rate": 0.25}, "c": {"pass_rate": 0.875}}  # d: not asked
    result = curate.report(rows, done, curate.TextOnly(0.875))
    mc, counting = result["per_type"]["multiple_choice"], result["per_type"]["counting"]
    assert mc == {"rows": 2, "unasked": 0, "dropped": 1, "dropped_share": 0.5, "pass_rate": 0.625, "chance": 0.375}
    assert counting == {"rows": 2, "unasked": 1, "dropped": 1, "dropped_share": 0.5, "pass_rate": 0.875, "chance": None}
    assert result["per_source"]["s1"]["dropped"] == 1 and result["overall"]["dropped"] == 2
    assert "text-only: a text-only pass rate >= 0.875 drops the row" in curate.report_table(result)
    assert result["curation"] == "text-only" and result["threshold"] == 0.875
    # the same answers under curate difficulty (0, 1): the rows always or never solved leave
    hard = curate.report(rows, done, curate.Difficulty(0.0, 1.0))
    assert hard["per_type"]["multiple_choice"]["dropped"] == 1 and hard["overall"]["dropped"] == 1
    assert "outside (0, 1), or answers that all scored alike, drop the row" in curate.report_table(hard)


def test_difficulty_drops_a_row_whose_answers_all_score_alike():
    """A continuous score (IoU here) can be the same mid-range value in every answer:
    the pass rate is inside (0, 1) but GRPO's group would get no advantage, so the row
    leaves; answers of the same mean that differ keep it. Text-only reads the rate alone."""
    fields = {"id": "t", "problem": "When?", "problem_type": "temporal_grounding", "answer": [0, 10]}
    row = Row("t", "When?", "temporal_grounding", [0, 10], fields=fields)
    same = {"t": ["<answer>0 to 5</answer>"] * 4}  # IoU 0.5 each
    spread = {"t": ["<answer>0 to 10</answer>", "<answer>20 to 30</answer>"] * 2}  # IoU 1 and 0
    (flat,) = curate.pass_records([row], same, {"t": fields}, None, {})
    (varied,) = curate.pass_records([row], spread, {"t": fields}, None, {})
    assert (flat["pass_rate"], flat["alike"]) == (0.5, True)
    assert (varied["pass_rate"], varied["alike"]) == (0.5, False)
    assert curate.Difficulty().drops(flat) and not curate.Difficulty().drops(varied)
    assert not curate.TextOnly(0.875).drops(flat)
    (single,) = curate.pass_records([row], {"t": same["t"][:1]}, {"t": fields}, None, {})
    assert not single["alike"]  # one answer is no group


def canned(check):
    """A stand-in for ``answer_rows`` that runs ``check(sample)`` on each prompt and
    answers right every time on the 'direction' rows, half the time on 'order', never
    otherwise (4 answers a row at most)."""

    def answer_rows(model, processor, dataset, sampling, samples, indices, *rest, **kw):
        out = []
        for i in indices:
            sample = dataset[i]
            check(sample)
            right, wrong = str(sample.answer), "no idea"
            kind = sample.id.rsplit("-", 1)[1]
            texts = {"direction": [right] * 4, "order": [right, wrong] * 2}.get(kind, [wrong] * 4)
            out.append((sample, texts[:samples]))
        return out, []

    return answer_rows


def test_rows_answered_from_their_wording_leave_the_set(tmp_path, clips, tiny, monkeypatch):
    """Canned answers: right on every answer for the 'direction' rows, on half of them
    for 'order', never otherwise; with the threshold at 0.75 exactly the direction rows
    leave, and no prompt carries a video."""
    asked = []

    def without_video(sample):
        assert not sample.videos and "<video>" not in json.dumps(sample.messages)
        asked.append(sample.id)

    monkeypatch.setattr(curate, "answer_rows", canned(without_video))
    out = tmp_path / "curated"
    args = ["curate", "text-only", str(clips), "--model", str(tiny), "--out", str(out), "--samples", "4"]
    assert main([*args, "--threshold", "0.75", *SETS]) == 0
    kept, dropped = (read_rows(out / name)[0] for name in ("kept.jsonl", "dropped.jsonl"))
    assert sorted(r.id.rsplit("-", 1)[1] for r in dropped) == ["direction"] * 3
    assert len(kept) == 9 and all(r.videos for r in kept)  # kept rows keep their media
    # --out lies beside the data, not above it: the media are named by absolute paths,
    # which a training run admits under media.media_root (the data's directory)
    for row in kept + dropped:
        for path in row.videos:
            assert resolve_media_path(path, out, clips.parent).samefile(clips.parent / "media" / Path(path).name)
    rates = [json.loads(line)["text_only_pass_rate"] for line in (out / "dropped.jsonl").read_text().splitlines()]
    assert rates == [1.0] * 3
    report = json.loads((out / "report.json").read_text())
    assert report["per_source"]["video_order"]["pass_rate"] == 0.5 and report["overall"]["dropped"] == 3
    assert report["per_source"]["video_direction"]["chance"] == 0.5
    assert sorted(asked) == sorted(r.id for r in read_rows(clips)[0])


def test_an_interrupted_run_asks_only_the_rest(tmp_path, clips, tiny):
    """The real tiny model: a run, then its progress file cut to 5 rows and a half line,
    and a second run that asks the 7 rows left and writes the same split."""
    out = tmp_path / "curated"
    args = ["curate", "text-only", str(clips), "--model", str(tiny), "--out", str(out), "--samples", "2", *SETS]
    assert main(args) == 0
    lines = (out / curate.PASSES).read_text().splitlines()
    assert len(lines) == 12 and all(json.loads(line)["samples"] == 2 for line in lines)
    first = json.loads((out / "report.json").read_text())
    (out / curate.PASSES).write_text("\n".join(lines[:5]) + "\n" + lines[5][:20])
    assert main(args) == 0
    again = [json.loads(line) for line in (out / curate.PASSES).read_text().splitlines()[5:]]
    assert sorted(r["id"] for r in again) == sorted(json.loads(line)["id"] for line in lines[5:])
    assert json.loads((out / "report.json").read_text())["overall"]["rows"] == first["overall"]["rows"] == 12


@pytest.fixture(scope="module")
def other_tiny(tmp_path_factory):
    from omni_rl.models import build_tiny

    return build_tiny("qwen2_5_vl", tmp_path_factory.mktemp("other_tiny"), seed=1, width=64)


def test_passes_another_model_or_seed_wrote_are_asked_again(tmp_path, clips, tiny, other_tiny, monkeypatch, caplog):
    """The progress is keyed by what asked: the same model and seed ask nothing again;
    another seed, another model (the same family, other weights) or a file that does not
    say what asked it ask every row again, with one line naming the file and what
    differed."""
    asked = []
    monkeypatch.setattr(curate, "answer_rows", canned(lambda sample: asked.append(sample.id)))
    out = tmp_path / "curated"

    def run(model, *extra):
        asked.clear()
        caplog.clear()
        with caplog.at_level("WARNING", logger="omni_rl.evaluation.curate"):
            command = ["curate", "text-only", str(clips), "--model", str(model), "--out", str(out), *SETS, *extra]
            assert main([*command, "--samples", "4"]) == 0
        lines = [r.getMessage() for r in caplog.records if "asked by another producer" in r.getMessage()]
        return len(asked), lines

    assert run(tiny) == (12, [])
    assert run(tiny) == (0, [])  # the same producer: resumed, nothing left
    count, lines = run(tiny, "--set", "run.seed=1")
    assert count == 12 and len(lines) == 1
    assert str(out / curate.PASSES) in lines[0] and "seed 0, now 1" in lines[0]
    assert run(tiny, "--set", "run.seed=1") == (0, [])
    count, lines = run(other_tiny, "--set", "run.seed=1")
    assert count == 12 and len(lines) == 1 and "weights" in lines[0] and str(other_tiny) in lines[0]
    records = [json.loads(line) for line in (out / curate.PASSES).read_text().splitlines()]
    assert len(records) == 12 and {r["model"] for r in records} == {str(other_tiny.resolve())}
    # a file from before the key: its rows were asked by a producer it does not name
    keys = ("model", "weights", "seed", "temperature", "max_new_tokens", "prompt_template")
    older = [{k: v for k, v in r.items() if k not in keys} for r in records]
    (out / curate.PASSES).write_text("".join(json.dumps(r) + "\n" for r in older))
    count, lines = run(other_tiny, "--set", "run.seed=1")
    said = "12 rows were asked by another producer (a version that did not record what asked them)"
    assert count == 12 and lines == [f"{out / curate.PASSES}: {said}: they are asked again"]


@pytest.mark.slow
def test_two_processes_curate_what_one_process_curates(tmp_path, clips, tiny):
    """Under torchrun each rank asks its share of every chunk and rank 0 writes what all
    ranks answered: greedy answers, one prompt at a time (no padding that depends on the
    share), give the progress, split and report of one process, every row asked once."""
    args = ["curate", "text-only", str(clips), "--model", str(tiny), "--samples", "1", "--batch-prompts", "1", *SETS]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMNI_RL_THREADS": "1"}
    torchrun = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc-per-node=2"]
    for name, launcher in (("one", [sys.executable]), ("two", torchrun)):
        command = [*launcher, "-m", "omni_rl", *args, "--out", str(tmp_path / name)]
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]

    def passes(name):
        lines = (tmp_path / name / curate.PASSES).read_text().splitlines()
        return {record["id"]: record for record in map(json.loads, lines)}, len(lines)

    (one, asked_one), (two, asked_two) = passes("one"), passes("two")
    assert asked_one == asked_two == len(read_rows(clips)[0]) == len(one)
    assert two == one
    for name in ("kept.jsonl", "dropped.jsonl", "report.json"):
        assert (tmp_path / "two" / name).read_text() == (tmp_path / "one" / name).read_text(), name


SLOW_REWRITE = """
import os, sys, time
from pathlib import Path

from omni_rl.cli import main
from omni_rl.evaluation import curate

marker = Path(sys.argv[1])
if os.environ["RANK"] == "0":  # a slow filesystem: the progress rewritten, truncated 3 s first
    write_text = Path.write_text

    def slow(self, text, *args, **kwargs):
        if self.name != curate.PASSES:
            return write_text(self, text, *args, **kwargs)
        write_text(self, "")
        marker.touch()
        time.sleep(3)
        return write_text(self, text, *args, **kwargs)

    Path.write_text = slow
else:  # rank 1 reads the progress once rank 0 has begun rewriting it
    read_passes = curate.read_passes

    def late(*args, **kwargs):
        for _ in range(1200):
            if marker.exists():
                break
            time.sleep(0.05)
        return read_passes(*args, **kwargs)

    curate.read_passes = late
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.slow
def test_two_processes_resume_from_the_progress_rank_0_rewrote(tmp_path, clips, tiny):
    """A resume under torchrun while rank 0 rewrites the progress file slowly (a cut line
    goes): rank 1 reads it only once rank 0 has written it, so both ranks ask the same 7
    rows and the progress holds every row once, as one process's run."""
    args = ["curate", "text-only", str(clips), "--model", str(tiny), "--samples", "1", "--batch-prompts", "1", *SETS]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMNI_RL_THREADS": "1"}
    one = [sys.executable, "-m", "omni_rl", *args, "--out", str(tmp_path / "one")]
    done = subprocess.run(one, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = (tmp_path / "one" / curate.PASSES).read_text().splitlines()
    (tmp_path / "two").mkdir()
    (tmp_path / "two" / curate.PASSES).write_text("\n".join(lines[:5]) + "\n" + lines[5][:20])
    script = tmp_path / "slow_rewrite.py"
    script.write_text(SLOW_REWRITE)
    torchrun = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc-per-node=2"]
    command = [*torchrun, str(script), str(tmp_path / "truncated"), *args, "--out", str(tmp_path / "two")]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    two = (tmp_path / "two" / curate.PASSES).read_text().splitlines()
    assert len(two) == len(lines) == 12  # every row once
    assert {r["id"]: r for r in map(json.loads, two)} == {r["id"]: r for r in map(json.loads, lines)}


def test_bad_arguments_are_refused(tmp_path, clips, tiny, capsys):
    base = ["curate", "text-only", str(clips), "--model", str(tiny), "--out", str(tmp_path)]
    assert main([*base, "--threshold", "1.5"]) == 2
    assert "--threshold 1.5 is not in (0, 1]" in capsys.readouterr().err
    assert main([*base, "--samples", "0"]) == 2
    assert "--samples must be >= 1" in capsys.readouterr().err


def test_against_decoys_a_reader_of_the_wording_drops_exactly_the_decoys(tmp_path, tiny, monkeypatch):
    """Known truth: motion clips with every 4th question's answer stated in its wording,
    and a 'model' that answers only from what the wording states. Curation drops the
    decoys and nothing else: precision and recall 1."""
    from omni_rl.preprocess.motion import TELLS

    data = write_motion_qa(tmp_path / "motion", 16, seed=1, decoy_every=4)

    def reads_the_wording(model, processor, dataset, sampling, samples, indices, *rest, **kw):
        out = []
        for i in indices:
            sample, row = dataset[i], dataset.rows[i]
            kind = row.id.rsplit("-", 1)[1]
            options = row.fields["options"]
            told = [j for j, o in enumerate(options) if TELLS[kind].format(o) in row.problem]
            out.append((sample, ["ABCD"[told[0]] if told else "no idea"] * samples))
        return out, []

    monkeypatch.setattr(curate, "answer_rows", reads_the_wording)
    out = tmp_path / "curated"
    assert main(["curate", "text-only", str(data), "--model", str(tiny), "--out", str(out), *SETS]) == 0
    dropped = {r.id for r in read_rows(out / "dropped.jsonl")[0]}
    decoys = {r.id for r in read_rows(data)[0] if r.fields.get("decoy")}
    assert len(decoys) == 4 and dropped == decoys
    labelled = json.loads((out / "report.json").read_text())["labelled"]
    assert labelled == {"decoys": 4, "dropped_decoys": 4, "dropped_others": 0, "recall": 1.0, "precision": 1.0}


def test_drops_are_scored_against_the_decoy_labels():
    """4 decoys, 3 of them dropped beside 2 other rows: recall 3/4, precision 3/5; a row
    never asked is not a drop; without labels the report has no such entry."""
    rows = [Row(f"r{i}", "q", "multiple_choice", "A", fields={"decoy": i < 4}) for i in range(8)]
    rates = {"r0": 1.0, "r1": 1.0, "r2": 0.875, "r3": 0.5, "r4": 1.0, "r5": 0.875, "r6": 0.0}  # r7 unasked
    done = {k: {"pass_rate": v} for k, v in rates.items()}
    rule = curate.TextOnly(threshold=0.875)
    assert curate.report(rows, done, rule)["labelled"] == {
        "decoys": 4,
        "dropped_decoys": 3,
        "dropped_others": 2,
        "recall": 0.75,
        "precision": 0.6,
    }
    assert "recall 0.750" in curate.report_table(curate.report(rows, done, rule))
    plain = [Row(f"r{i}", "q", "multiple_choice", "A", fields={}) for i in range(8)]
    assert "labelled" not in curate.report(plain, done, rule)


def test_a_row_that_cannot_be_read_is_named_and_counted(tmp_path, clips, tiny, monkeypatch, caplog):
    data = clips.parent / "with_bad.jsonl"  # beside the clips, so the media paths resolve
    data.write_text(clips.read_text() + '{"id": "bad", "problem": "no answer"}\n')
    monkeypatch.setattr(curate, "answer_rows", lambda m, p, dataset, s, k, indices, *r, **kw: ([], []))
    out = tmp_path / "curated"
    with caplog.at_level("WARNING", logger="omni_rl.evaluation.curate"):
        assert main(["curate", "text-only", str(data), "--model", str(tiny), "--out", str(out), *SETS]) == 0
    assert "1 row cannot be read (left out of kept.jsonl and dropped.jsonl), first:" in caplog.text
    assert "with_bad.jsonl:13 bad:" in caplog.text
    report = json.loads((out / "report.json").read_text())
    assert report["refused_rows"] == 1 and report["overall"]["unasked"] == 12


def test_difficulty_keeps_the_rows_sometimes_solved(tmp_path, clips, tiny, monkeypatch):
    """Canned answers with the video: always right on 'direction', half right on
    'order', never right otherwise; with the defaults (0, 1) only the order rows stay,
    and every prompt carries its video."""

    def with_video(sample):
        assert sample.videos  # asked with the media

    monkeypatch.setattr(curate, "answer_rows", canned(with_video))
    out = tmp_path / "curated"
    args = ["curate", "difficulty", str(clips), "--model", str(tiny), "--out", str(out), "--samples", "4", *SETS]
    assert main(args) == 0
    kept = read_rows(out / "kept.jsonl")[0]
    assert sorted(r.id.rsplit("-", 1)[1] for r in kept) == ["order"] * 3
    rates = sorted(json.loads(line)["pass_rate"] for line in (out / "dropped.jsonl").read_text().splitlines())
    assert rates == [0.0] * 6 + [1.0] * 3
    report = json.loads((out / "report.json").read_text())
    assert report["curation"] == "difficulty" and (report["low"], report["high"]) == (0.0, 1.0)
    assert report["overall"]["dropped"] == 9
    # its progress file is not a text-only run's: that run into the same folder is refused
    assert main(["curate", "text-only", str(clips), "--model", str(tiny), "--out", str(out), *SETS]) == 2


def test_difficulty_bounds_are_checked(tmp_path, clips, tiny, capsys):
    base = ["curate", "difficulty", str(clips), "--model", str(tiny), "--out", str(tmp_path)]
    assert main([*base, "--low", "0.5", "--high", "0.5"]) == 2
    assert "--low 0.5 and --high 0.5 must satisfy 0 <= low < high <= 1" in capsys.readouterr().err


@pytest.mark.parametrize("given", [True, False], ids=["engine", "model"])
def test_each_row_is_answered_with_a_seed_of_its_own(clips, tiny, given):
    """With an engine (vLLM's path, here the hf engine's ``rollout``) or the model
    alone (curate's and eval's default): each row is sampled with a seed from the run's
    seed and its index, so a row's answers are the same whichever share, batch or call
    asks it, and another run seed changes them."""
    from omni_rl.data.dataset import MediaDataset
    from omni_rl.evaluation.answer import answer_rows
    from omni_rl.models import load
    from omni_rl.preprocess.pipeline import Budgets
    from omni_rl.recipe_loader import load_config
    from omni_rl.rollout.hf import HFRolloutEngine, SamplingParams

    model, processor = load(tiny)
    cfg = load_config(None, MEDIA, recipe="grpo")
    dataset = MediaDataset(clips, Budgets.from_config(cfg.media), cache_mode="no_cache")
    engine = HFRolloutEngine(model, processor) if given else None
    sampling = SamplingParams(temperature=1.0, max_new_tokens=6)

    def answers(indices, seed=0, batch=1):
        got, failures = answer_rows(model, processor, dataset, sampling, 3, indices, batch, False, engine, seed)
        assert failures == []
        return {sample.id: texts for sample, texts in got}

    whole = answers(list(range(6)))
    assert len(whole) == 6 and all(len(texts) == 3 for texts in whole.values())
    assert answers(list(range(6))) == whole  # a rerun
    assert answers([0, 2, 4]) | answers([5, 3, 1]) == whole  # two ranks' shares, any order
    assert answers([5, 3, 1], batch=3) | answers([0, 2, 4], batch=2) == whole  # other batches
    other = answers(list(range(6)), seed=1)
    assert other.keys() == whole.keys() and other != whole


def test_the_vllm_engine_says_what_it_needs(tmp_path, clips, tiny, capsys):
    """On a machine without vllm or a GPU the engine's own error comes back, before any
    row is asked."""
    base = ["curate", "text-only", str(clips), "--model", str(tiny), "--out", str(tmp_path / "out"), *SETS]
    assert main([*base, "--set", "rollout.engine=vllm"]) == 2
    assert "rollout.engine 'vllm' needs" in capsys.readouterr().err
    assert not (tmp_path / "out" / curate.PASSES).exists()


def test_a_resumed_run_says_from_how_many_rows_and_that_it_dropped_a_cut_line(
    tmp_path, clips, tiny, monkeypatch, caplog, capsys
):
    """A run, its progress file's last line cut short, a second run: one line says the
    cut line was dropped, one says the run resumed from the 11 rows left whole, and the
    table carries the unasked column the guide names."""
    monkeypatch.setattr(curate, "answer_rows", canned(lambda sample: None))
    out = tmp_path / "curated"
    args = ["curate", "text-only", str(clips), "--model", str(tiny), "--out", str(out), "--samples", "4", *SETS]
    assert main(args) == 0
    assert "unasked" in capsys.readouterr().out.splitlines()[0]
    passes = out / curate.PASSES
    lines = passes.read_text().splitlines()
    passes.write_text("\n".join(lines[:11]) + "\n" + lines[11][:20])
    with caplog.at_level("WARNING", logger="omni_rl.evaluation.curate"):
        assert main(args) == 0
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith(str(passes))]
    assert said == [
        f"{passes}:12: a line cut short (not valid JSON) is dropped; its row is asked again",
        f"{passes}: resumed: 11 of 12 rows were asked before by this model, seed and asking; 1 row left to ask",
    ]


def test_difficulty_prints_no_line_against_the_decoy_labels():
    """The decoy recall and precision score a text-only curation; a difficulty run on the
    same labelled rows neither reports nor prints them."""
    rows = [Row(f"r{i}", "q", "multiple_choice", "A", fields={"decoy": i < 2}) for i in range(4)]
    done = {f"r{i}": {"pass_rate": 1.0} for i in range(4)}
    result = curate.report(rows, done, curate.Difficulty(0.0, 1.0))
    assert "labelled" not in result and "decoy" not in curate.report_table(result)
    assert "labelled" in curate.report(rows, done, curate.TextOnly(0.875))


GHOST = {
    "id": "ghost-1",
    "problem": "<video> Which way does the square move?",
    "problem_type": "multiple_choice",
    "answer": "A",
    "options": ["left", "right"],
    "videos": ["media/no_such_clip.mp4"],
}


@pytest.mark.parametrize("kind", ["text-only", "difficulty"])
def test_a_row_whose_media_are_missing_goes_to_dropped_with_its_reason(
    tmp_path, clips, tiny, monkeypatch, caplog, kind
):
    """A row naming a clip that is not there is not asked; it goes to dropped.jsonl with
    the reason under 'unusable' (training would refuse it), one log line says so, and
    the report counts it apart from the rows asked."""
    data = clips.parent / f"ghost_{kind}.jsonl"  # beside the clips, so the other media paths resolve
    data.write_text(clips.read_text() + json.dumps(GHOST) + "\n")
    asked = []
    monkeypatch.setattr(curate, "answer_rows", canned(lambda sample: asked.append(sample.id)))
    out = tmp_path / "curated"
    with caplog.at_level("WARNING"):
        assert main(["curate", kind, str(data), "--model", str(tiny), "--out", str(out), "--samples", "4", *SETS]) == 0
    assert "ghost-1" not in asked and len(asked) == 12
    assert "ghost-1" not in (out / "kept.jsonl").read_text()
    dropped = {r["id"]: r for r in map(json.loads, (out / "dropped.jsonl").read_text().splitlines())}
    assert dropped["ghost-1"]["unusable"] == f"{clips.parent / 'media' / 'no_such_clip.mp4'}: no such file"
    ghost_lines = [r.getMessage() for r in caplog.records if "ghost-1" in r.getMessage()]
    assert ghost_lines == [
        f"{data}: 1 row cannot be used for training (not asked; written to dropped.jsonl, each with its reason "
        f"under 'unusable'), first: {data}:13 ghost-1: {clips.parent / 'media' / 'no_such_clip.mp4'}: no such file"
    ]
    report = json.loads((out / "report.json").read_text())
    assert report["unusable_rows"] == 1 and report["overall"]["rows"] == 12 and report["overall"]["unasked"] == 0


def test_a_line_that_cannot_be_read_is_reported_once(tmp_path, clips, tiny, monkeypatch, caplog):
    """curate difficulty reads the rows twice (to split them, and with their media to ask
    them): an invalid line is still reported in one line, '1 row', with no stray space."""
    data = clips.parent / "cut.jsonl"
    data.write_text(clips.read_text() + '{"id": "x", "problem"\n')
    monkeypatch.setattr(curate, "answer_rows", canned(lambda sample: None))
    out = tmp_path / "curated"
    with caplog.at_level("WARNING"):
        assert main(["curate", "difficulty", str(data), "--model", str(tiny), "--out", str(out), *SETS]) == 0
    said = [r.getMessage() for r in caplog.records if f"{data}:13" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith(f"{data}: 1 row cannot be read (left out of kept.jsonl and ")
    assert f"{data}:13: invalid JSON" in said[0]


def test_a_refused_row_is_told_from_its_duplicate_by_where_it_was_read(tmp_path, clips, tiny, monkeypatch, caplog):
    """A row with a missing clip and a later copy of its id (a line that cannot be read):
    one row unusable, one line unreadable, each counted once."""
    data = clips.parent / "ghost_twice.jsonl"
    data.write_text(clips.read_text() + json.dumps(GHOST) + "\n" + json.dumps(GHOST) + "\n")
    monkeypatch.setattr(curate, "answer_rows", canned(lambda sample: None))
    out = tmp_path / "curated"
    with caplog.at_level("WARNING", logger="omni_rl.evaluation.curate"):
        assert main(["curate", "text-only", str(data), "--model", str(tiny), "--out", str(out), *SETS]) == 0
    assert f"{data}: 1 row cannot be used for training" in caplog.text
    assert f"{data}: 1 row cannot be read" in caplog.text and f"{data}:14 ghost-1: duplicate id" in caplog.text
    report = json.loads((out / "report.json").read_text())
    assert (report["unusable_rows"], report["refused_rows"]) == (1, 1)
