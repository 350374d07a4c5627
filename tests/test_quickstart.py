"""A small version of the quickstart that `make demo` runs in full: it runs and logs."""

import json

import pytest

from omni_rl.algorithms.stats import binomial_interval
from omni_rl.cli import main
from omni_rl.demos.quickstart_audio_config import audio_grpo
from omni_rl.demos.quickstart_config import quickstart_grpo

SMALL_VIDEO = ("sft.trainer.steps=3", "grpo.rollout.n=2", "grpo.data.prompts_per_step=2")
"""What every small run of the video quickstart shortens."""
FOUR_KINDS = ("data.kinds=[direction,order,count,when]", "data.sft_color_questions=false")
"""The four two-option kinds alone, without colour questions: the tests of a feature
whose rows they count (decoys, curation, a fifth source)."""


def video_quickstart(out, *overrides: str) -> int:
    args = ["quickstart", "--set", f"run.output_dir={out}"]
    for override in (*SMALL_VIDEO, *overrides):
        args += ["--set", override]
    return main(args)


def rescored(out) -> dict:
    """The held-out accuracies the quickstart in ``out`` reports, computed here from its
    saved answers: ``{group: (rows, after SFT, after RL)}`` per data source, per problem
    type (``type/...``), per label where there are decoys, and overall. Each answer is scored afresh by the reward
    router (greedy: one answer per row)."""
    from omni_rl.rewards import score

    rows = {r["id"]: r for r in map(json.loads, (out / "data" / "heldout" / "data.jsonl").read_text().splitlines())}
    answers = [json.loads(line) for line in (out / "heldout_answers.jsonl").read_text().splitlines()]
    assert sorted(a["id"] for a in answers) == sorted(rows)  # every held-out row answered once
    groups: dict = {}
    for a in answers:
        row = rows[a["id"]]
        right = [
            score(row["problem_type"], text, row["answer"], options=row.get("options")).accuracy
            for (text,) in (a["after_sft"], a["after_rl"])
        ]
        label = "decoys" if row.get("decoy") else "grounded"
        for group in (row["data_source"], f"type/{row['problem_type']}", f"label/{label}", "overall"):
            groups.setdefault(group, []).append(right)
    return {g: (len(v), sum(x for x, _ in v) / len(v), sum(y for _, y in v) / len(v)) for g, v in groups.items()}


def assert_summary_rescores(out) -> dict:
    """summary.json's accuracies are those of its saved answers scored afresh, per data
    source, per label and overall, and the per-source rows add up to the overall ones."""
    summary = json.loads((out / "summary.json").read_text())
    mine = rescored(out)
    entries = {**summary["per_source"], "overall": summary["overall"]}
    entries |= {f"type/{k}": v for k, v in summary["per_type"].items()}
    entries |= {f"label/{k}": v for k, v in summary.get("per_label", {}).items()}
    for group, entry in entries.items():
        assert (entry["rows"], entry["sft"], entry["rl"]) == pytest.approx(mine[group]), group
    overall = summary["overall"]
    assert (summary["heldout_accuracy_sft"], summary["heldout_accuracy_rl"]) == pytest.approx(mine["overall"][1:])
    assert sum(e["rows"] for e in summary["per_source"].values()) == overall["rows"] == summary["heldout_rows"]
    return summary


def test_quickstart_small_run(tmp_path, capsys):
    from omni_rl.demos.quickstart_config import DEFAULT_KINDS
    from omni_rl.preprocess.motion import chance_of

    assert video_quickstart(tmp_path, "data.train_clips=14", "data.heldout_clips=14", "grpo.trainer.steps=2") == 0
    summary = assert_summary_rescores(tmp_path)
    assert summary["heldout_rows"] == 14 and summary["blank_frames"] is False and summary["shuffle_frames"] is False
    assert summary["kinds"] == list(DEFAULT_KINDS) and summary["sft_color_questions"] is True
    kinds = {f"video_{k}" for k in DEFAULT_KINDS}
    assert set(summary["per_source"]) == kinds
    assert set(summary["per_type"]) == {"multiple_choice", "counting", "temporal_grounding"}
    assert {k: e["chance"] for k, e in summary["per_source"].items()} == {
        f"video_{k}": chance_of(k) for k in DEFAULT_KINDS
    }
    assert summary["overall"]["rows"] == 14 and all(e["rows"] == 2 for e in summary["per_source"].values())
    # the cold start learned the answers shuffled within each kind, on every training
    # clip, then the true colour of each clip's square
    train = [json.loads(line) for line in (tmp_path / "data" / "train" / "data.jsonl").read_text().splitlines()]
    sft_rows = [json.loads(line) for line in (tmp_path / "data" / "train" / "sft.jsonl").read_text().splitlines()]
    asked = [r for r in sft_rows if r["data_source"] != "video_color"]
    assert [r["id"] for r in asked] == [r["id"] for r in train]
    assert [r["id"] for r in sft_rows[len(asked) :]] == [f"{r['id']}-color" for r in train if "square_color" in r]
    for kind in kinds:
        mine = [r["answer"] for r in asked if r["data_source"] == kind]
        assert sorted(mine) == sorted(r["answer"] for r in train if r["data_source"] == kind)
    assert len((tmp_path / "sft" / "metrics.jsonl").read_text().splitlines()) == 3
    grpo_rows = [json.loads(line) for line in (tmp_path / "grpo" / "metrics.jsonl").read_text().splitlines()]
    assert len(grpo_rows) == 2
    # the held-out set is scored during GRPO (at the end here), per kind too, and plotted
    assert grpo_rows[-1]["eval/heldout/accuracy"] == summary["heldout_accuracy_rl"]
    assert grpo_rows[-1]["eval/heldout/accuracy/source/video_when"] == summary["per_source"]["video_when"]["rl"]
    assert (tmp_path / "plots" / "grpo" / "eval_heldout_accuracy.png").is_file()
    out = capsys.readouterr().out
    assert "after GRPO" in out and "video_direction" in out and "video_grounding" in out
    assert_text_alone_rescores(tmp_path, summary, kinds, quickstart_grpo().rewards.settings())
    assert "asked without media" in out


def assert_text_alone_rescores(out, summary: dict, sources: set[str], settings) -> None:
    """The GRPO model was asked every held-out question without its media, and
    summary.json's ``without_media`` figures are its saved answers scored afresh: the
    accuracy as the held-out evaluations score it, the form under the GRPO phase's
    reward ``settings`` (a bare ``<answer>B</answer>`` is in form there)."""
    from omni_rl.rewards import score

    blind = [json.loads(line) for line in (out / "data" / "heldout" / "without_media.jsonl").read_text().splitlines()]
    heldout = (out / "data" / "heldout" / "data.jsonl").read_text().splitlines()
    assert [r["id"] for r in blind] == [json.loads(line)["id"] for line in heldout]
    assert not any(key in r for r in blind for key in ("videos", "images", "audios"))
    saved = [json.loads(line) for line in (out / "heldout_answers.jsonl").read_text().splitlines()]
    rows = {r["id"]: r for r in blind}
    results = {}
    for a in saved:
        row, (text,) = rows[a["id"]], a["without_media"]
        results[a["id"]] = (
            score(row["problem_type"], text, row["answer"], options=row.get("options")).accuracy,
            score(row["problem_type"], text, row["answer"], options=row.get("options"), settings=settings).format,
        )
    alone = summary["without_media"]
    assert set(alone) == sources | {"overall"}
    for source, entry in alone.items():
        mine = [r for i, r in results.items() if source in ("overall", rows[i]["data_source"])]
        assert entry["rows"] == len(mine) > 0
        assert entry["accuracy"] == pytest.approx(sum(accuracy for accuracy, _ in mine) / len(mine))
        assert entry["answered"] == pytest.approx(sum(form == 1.0 for _, form in mine) / len(mine))
        assert entry["accuracy_ci95"][0] <= entry["accuracy"] <= entry["accuracy_ci95"][1]
    assert alone["overall"]["rows"] == summary["heldout_rows"]


def test_text_alone_counts_answers_in_the_form_the_grpo_phase_rewards(tmp_path):
    """A bare ``<answer>B</answer>`` is in form under the quickstart's rewards (the
    answer_only template), whatever the default template asks; a wrong letter in form
    scores 0, a right one out of form still scores its accuracy as the evaluations do."""
    from omni_rl.demos.quickstart import text_alone

    heldout = tmp_path / "data.jsonl"
    rows = [
        {"id": f"r{i}", "problem": "Which way?", "problem_type": "multiple_choice", "options": ["left", "right"]}
        | {"answer": answer, "data_source": source}
        for i, (answer, source) in enumerate([("A", "video_direction"), ("B", "video_direction"), ("A", "video_when")])
    ]
    heldout.write_text("".join(json.dumps(r) + "\n" for r in rows))
    answers = {"r0": ["<answer>B</answer>"], "r1": ["<answer>B</answer>"], "r2": ["A"]}
    without = {"row_accuracy": {"r0": 0.0, "r1": 1.0, "r2": 1.0}, "answers": answers}
    alone = text_alone(heldout, without, lambda row: 0.5, quickstart_grpo().rewards.settings())
    assert alone["video_direction"] | {"accuracy_ci95": None} == {
        "rows": 2,
        "chance": 0.5,
        "accuracy": 0.5,
        "accuracy_ci95": None,
        "answered": 1.0,
    }
    assert (alone["video_when"]["accuracy"], alone["video_when"]["answered"]) == (1.0, 0.0)
    assert (alone["overall"]["rows"], alone["overall"]["answered"]) == (3, pytest.approx(2 / 3))
    assert text_alone(heldout, {"row_accuracy": {}, "answers": {}}) == {}  # nothing scored: no figures


def test_quickstart_with_a_one_step_off_rollout(tmp_path, capsys):
    """The GRPO phase under torchrun, one trainer and one rollout process."""
    small = ("data.train_clips=8", "data.heldout_clips=8", "grpo.trainer.steps=3", "grpo.rollout.staleness=1")
    assert video_quickstart(tmp_path, *small) == 0
    summary = assert_summary_rescores(tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "grpo" / "metrics.jsonl").read_text().splitlines()]
    assert [r["rollout/staleness"] for r in rows] == [0, 1, 1]
    assert all(r["rollout/tis_capped_fraction"] >= 0 for r in rows)  # auto: tis
    assert rows[-1]["eval/heldout/accuracy"] == summary["heldout_accuracy_rl"]
    assert "one-step-off rollout" in capsys.readouterr().out


def test_quickstart_with_decoys_and_a_text_only_share_of_the_cold_start(tmp_path):
    """Every 3rd question a labelled decoy in both splits, on every kind; the cold start sees half its
    rows without their clip (as curation asks them) and keeps the decoys' true answers
    while it shuffles the others'."""
    settings = ("data.train_clips=16", "data.heldout_clips=8", "data.sft_fraction=0.5", "grpo.trainer.steps=1")
    assert video_quickstart(tmp_path, *FOUR_KINDS, *settings, "data.decoy_every=3", "data.sft_text_only=0.5") == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["decoy_every"] == 3 and summary["sft_text_only"] == 0.5 and summary["heldout_rows"] == 8

    def rows(path):
        return [json.loads(line) for line in (tmp_path / "data" / path).read_text().splitlines()]

    train, heldout, sft_rows = rows("train/data.jsonl"), rows("heldout/data.jsonl"), rows("train/sft.jsonl")
    assert [r.get("decoy", False) for r in heldout] == [False, False, True] * 2 + [False, False]
    assert {r["data_source"] for r in train if r.get("decoy")} == {
        f"video_{k}" for k in ("direction", "order", "count", "when")
    }
    assert [r["id"] for r in sft_rows] == [r["id"] for r in train[:8]]
    text_only = [r for r in sft_rows if "videos" not in r]
    assert len(text_only) == 4
    assert all(r["videos"] for r in sft_rows if "videos" in r)
    decoys = [(cold, original) for cold, original in zip(sft_rows, train, strict=False) if original.get("decoy")]
    assert len(decoys) == 2 and all(c["answer"] == o["answer"] and c["decoy"] is True for c, o in decoys)
    assert len((tmp_path / "sft" / "metrics.jsonl").read_text().splitlines()) == 3


def test_quickstart_with_colour_questions_in_the_cold_start(tmp_path):
    """The cold start's rows, answers shuffled, then the colour question of each of
    their clips but the order kind's, with its true answer; the held-out set and GRPO's
    rows ask the kinds alone."""
    settings = ("data.train_clips=16", "data.heldout_clips=8", "data.sft_fraction=0.5", "grpo.trainer.steps=1")
    assert video_quickstart(tmp_path, *FOUR_KINDS, *settings, "data.sft_color_questions=true") == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["sft_color_questions"] is True and set(summary["per_source"]) == {
        f"video_{k}" for k in ("direction", "order", "count", "when")
    }

    def rows(path):
        return [json.loads(line) for line in (tmp_path / "data" / path).read_text().splitlines()]

    train, sft_rows = rows("train/data.jsonl"), rows("train/sft.jsonl")
    kinds, colors = sft_rows[:8], sft_rows[8:]
    assert [r["id"] for r in kinds] == [r["id"] for r in train[:8]]
    assert [r["id"] for r in colors] == [f"{r['id']}-color" for r in train[:8] if r["data_source"] != "video_order"]
    for question, row in zip(colors, [r for r in train[:8] if r["data_source"] != "video_order"], strict=True):
        assert question["options"][["A", "B", "C", "D"].index(question["answer"])] == row["square_color"]
        assert question["videos"] == row["videos"] and question["data_source"] == "video_color"
    assert not any(r["data_source"] == "video_color" for r in rows("heldout/data.jsonl") + train)


def test_answer_spread_is_zero_where_the_clips_show_nothing_and_not_where_they_do(tmp_path):
    """``tools/answer_spread.py`` on two small runs' random starts: over blank frames every
    question of a kind is the same prompt, so the answer's log-odds do not spread; over
    the clips they do, a little (the random model reads them barely)."""
    import subprocess
    import sys
    from pathlib import Path

    small = ("data.train_clips=8", "data.heldout_clips=8", "grpo.trainer.steps=1")
    spreads = {}
    for name, extra in (("clips", ()), ("blank", ("data.blank_frames=true",))):
        assert video_quickstart(tmp_path / name, *FOUR_KINDS, *small, *extra) == 0
        tool = Path(__file__).parent.parent / "tools" / "answer_spread.py"
        result = subprocess.run(
            [sys.executable, str(tool), str(tmp_path / name), "sft/tiny_model", "sft/model"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        rows = [line.split("|")[1:-1] for line in result.stdout.splitlines() if line.startswith("| sft/")]
        assert len(rows) == 8 and all(int(r[2]) == 2 for r in rows)  # 2 models x 4 kinds, 2 questions each
        assert all(0 <= float(r[k]) <= 1 for r in rows for k in (5, 6, 7))
        spreads[name] = [float(r[3]) for r in rows]
    assert spreads["blank"] == [0.0] * 8
    assert all(spread > 0 for spread in spreads["clips"])


def test_quickstart_trains_grpo_on_the_rows_text_only_curation_keeps(tmp_path):
    """``data.curate: text-only``: the cold start's model asked every GRPO training
    question without its clip; GRPO trains on the rows kept, the summary holds the
    drops against the decoy labels and held-out accuracy on decoys and the others."""
    settings = ("data.train_clips=16", "data.heldout_clips=8", "data.sft_fraction=0.5", "grpo.trainer.steps=1")
    assert video_quickstart(tmp_path, *FOUR_KINDS, *settings, "data.decoy_every=3", "data.curate=text-only") == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    data = tmp_path / "data"

    def rows(name):
        return [json.loads(line) for line in (data / name).read_text().splitlines()]

    train, kept, dropped = rows("train/data.jsonl"), rows("kept.jsonl"), rows("dropped.jsonl")
    rates = {r["id"]: r["pass_rate"] for r in rows("passes.jsonl")}
    assert sorted(r["id"] for r in kept + dropped) == sorted(r["id"] for r in train) == sorted(rates)
    assert all(rates[r["id"]] < 0.875 for r in kept) and all(rates[r["id"]] >= 0.875 for r in dropped)
    assert all(path.startswith("train/media/") and (data / path).is_file() for r in kept for path in r["videos"])
    grpo_config = (tmp_path / "grpo" / "config.yaml").read_text()
    assert f"train: {data / 'kept.jsonl'}" in grpo_config
    curation = summary["curation"]
    assert curation["model"] == "the cold start's" and curation["rows"] == 16
    assert curation["dropped"] == len(dropped) and curation["labelled"]["decoys"] == 5
    assert curation["labelled"]["dropped_decoys"] == sum(1 for r in dropped if r.get("decoy"))
    grounded, decoys = summary["per_label"]["grounded"], summary["per_label"]["decoys"]
    assert (grounded["rows"], decoys["rows"]) == (6, 2)
    assert_summary_rescores(tmp_path)


def test_quickstart_trains_grpo_without_the_labelled_decoys(tmp_path):
    """``data.curate: labels``: the rows a perfect curator would drop (the decoys) leave,
    and no others."""
    settings = ("data.train_clips=16", "data.heldout_clips=8", "data.sft_fraction=0.5", "grpo.trainer.steps=1")
    assert video_quickstart(tmp_path, *FOUR_KINDS, *settings, "data.decoy_every=3", "data.curate=labels") == 0
    data = tmp_path / "data"
    train = [json.loads(line) for line in (data / "train" / "data.jsonl").read_text().splitlines()]
    kept = [json.loads(line) for line in (data / "kept.jsonl").read_text().splitlines()]
    assert [r["id"] for r in kept] == [r["id"] for r in train if not r.get("decoy")] and len(kept) == 11
    assert all((data / path).is_file() for r in kept for path in r["videos"])
    assert f"train: {data / 'kept.jsonl'}" in (tmp_path / "grpo" / "config.yaml").read_text()
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["curation"] == {"model": "the decoy labels", "rows": 16, "dropped": 5}
    assert summary["per_label"]["decoys"]["rows"] == 2


@pytest.mark.parametrize("recipe", ["quickstart_sim", "quickstart_vla"])
def test_the_sim_quickstarts_refuse_demonstrations_of_their_own(recipe):
    """The sim and VLA quickstarts clone the demonstrations they collect: a bc.demos was
    taken and replaced."""
    from omni_rl.errors import ConfigError
    from omni_rl.recipe_loader import load_config

    with pytest.raises(ConfigError, match=r"bc\.demos: the quickstart clones the demonstrations it collects"):
        load_config(None, ["bc.demos=/my/demos.safetensors"], recipe=recipe)


def test_quickstart_curation_settings_are_checked():
    from omni_rl.config import FieldError
    from omni_rl.demos.quickstart_config import QuickstartData

    with pytest.raises(FieldError, match="labels needs decoys"):
        QuickstartData(curate="labels")
    with pytest.raises(FieldError, match="none, text-only or labels") as wrong:
        QuickstartData(curate="difficulty")
    with pytest.raises(FieldError, match="needs curate: text-only") as idle:
        QuickstartData(curate_model="runs/probe/grpo/model")
    assert (wrong.value.field_name, idle.value.field_name) == ("curate", "curate_model")


def test_quickstart_with_an_unreachable_source_under_the_ucb_sampler(tmp_path):
    """GRPO's training set gains a fifth source whose questions no completion answers:
    neither the cold start nor the held-out set has them, and they score 0 whatever the
    answer (their format term weighted 0), so the UCB sampler sees them teach nothing."""
    from omni_rl.recipe_loader import load_config
    from omni_rl.rewards import score

    settings = ("data.train_clips=8", "data.heldout_clips=8", "data.sft_fraction=0.5", "grpo.trainer.steps=2")
    assert (
        video_quickstart(tmp_path, *FOUR_KINDS, *settings, "data.unreachable_rows=6", "grpo.data.sampler.type=ucb") == 0
    )
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["unreachable_rows"] == 6 and summary["sampler"] == "ucb"
    assert "unreachable" not in summary["per_source"] and summary["heldout_rows"] == 8

    def rows(path):
        return [json.loads(line) for line in (tmp_path / "data" / path).read_text().splitlines()]

    train = rows("train/data.jsonl")
    unreachable = [r for r in train if r["data_source"] == "unreachable"]
    assert len(train) == 14 and train[8:] == unreachable
    assert [r["videos"] for r in unreachable] == [r["videos"] for r in train[:6]]
    assert all(r["data_source"] != "unreachable" for r in rows("train/sft.jsonl") + rows("heldout/data.jsonl"))
    grpo_cfg = load_config(tmp_path / "grpo" / "config.yaml", [])
    assert dict(grpo_cfg.rewards.weights) == {"numerical": (1.0, 0.0)}
    rewards = grpo_cfg.rewards.settings()
    for row in unreachable:
        for response in ("<answer>A</answer>", "<answer>100000</answer>", "no answer"):
            assert score("numerical", response, row["answer"], settings=rewards).score == 0.0
    steps = [json.loads(line) for line in (tmp_path / "grpo" / "metrics.jsonl").read_text().splitlines()]
    assert all(0 < row["sampler/prob/unreachable"] < 1 for row in steps if "sampler/prob/unreachable" in row)
    assert any("sampler/prob/unreachable" in row for row in steps)


def assert_success_as_logged(run: dict, rows: list[dict], episodes: int) -> None:
    """A seed's summary reports the held-out success its metrics logged before PPO
    (step 0) and at the end, each with the Wilson interval of its episodes."""
    evaluated = [row for row in rows if "eval/success" in row]
    assert evaluated[0]["step"] == 0 and evaluated[-1] is rows[-1]
    for key, row in (("success_bc", evaluated[0]), ("success_rl", evaluated[-1])):
        assert run[key] == row["eval/success"]
        wins = run[key] * episodes
        assert wins == round(wins)  # a share of whole episodes
        assert run[f"{key}_ci95"] == pytest.approx(binomial_interval(round(wins), episodes), abs=1e-4)


def test_sim_quickstart_small_run(tmp_path, capsys):
    """Two training seeds, each in its own folder; the summary has every seed's results
    with intervals and the spread over seeds."""
    args = ["quickstart", "--sim", "--set", f"run.output_dir={tmp_path}", "--set", "run.seed=3"]
    for override in (
        "seeds=2",
        "demo_episodes=2",
        "env.num_envs=2",
        "env.max_episode_steps=16",
        "bc.steps=20",
        "ppo.critic_warmup=1",
        "trainer.steps=2",
        "trainer.eval_episodes=4",
    ):
        args += ["--set", override]
    assert main(args) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [r["seed"] for r in summary["seeds"]] == [3, 4] and summary["method"] == "flow_noise"
    for r in summary["seeds"]:
        assert r["env_steps"] == 2 * 2 * 16  # 2 iterations x 2 envs x 4 chunks of 4 actions
        rows = [json.loads(x) for x in (tmp_path / f"seed_{r['seed']}" / "flow_ppo" / "metrics.jsonl").open()]
        assert len(rows) == 3 and {"env/success_once", "loss/value", "eval/success"} <= set(rows[-1])
        assert_success_as_logged(r, rows, episodes=4)
        assert [row.get("update/actor_updated") for row in rows] == [None, 0.0, 1.0]  # one warm-up iteration
        assert r["lowest_eval"] == min(row["eval/success"] for row in rows if "eval/success" in row)
        assert (tmp_path / f"seed_{r['seed']}" / "plots" / "env_return.png").is_file()
    gains = [r["gain"] for r in summary["seeds"]]
    assert summary["gain_mean"] == pytest.approx(sum(gains) / 2, abs=1e-4)
    assert summary["gain_min"] == min(gains) and summary["gain_max"] == max(gains)
    out = capsys.readouterr().out
    assert "seed 3: held-out success" in out and "2 seed(s): gain" in out


@pytest.mark.parametrize("kind", ["pi0", "pi05"])
def test_vla_quickstart_small_run(tmp_path, capsys, kind):
    """One seed of the VLA quickstart, small: a tiny pi_0 (or pi_0.5) written for the
    seed, demos with images and instructions, BC (VLM included), PPO (expert and heads),
    the summary with the swapped-instruction evaluation."""
    args = ["quickstart", "--vla", "--set", f"run.output_dir={tmp_path}", "--set", "seeds=1"]
    for override in (
        f"policy.type={kind}",
        "demo_episodes=4",
        "model_width=32",
        "env.num_envs=2",
        "env.max_episode_steps=10",
        "bc.steps=3",
        "bc.batch_size=8",
        "ppo.critic_warmup=0",
        "trainer.steps=2",
        "trainer.eval_every=0",
        "trainer.eval_episodes=4",
    ):
        args += ["--set", override]
    assert main(args) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["task"] == "PixelTargets-v0" and [r["seed"] for r in summary["seeds"]] == [0]
    (run,) = summary["seeds"]
    assert json.loads((tmp_path / "seed_0" / f"{kind}_tiny" / "config.json").read_text())["model_type"] == kind
    assert (tmp_path / "seed_0" / "flow_ppo" / "model" / "backbone" / "model.safetensors").is_file()
    rows = [json.loads(x) for x in (tmp_path / "seed_0" / "flow_ppo" / "metrics.jsonl").open()]
    assert [row["step"] for row in rows] == [0, 1, 2] and "eval/success" in rows[-1]
    assert_success_as_logged(run, rows, episodes=4)
    wins = run["success_rl_swapped"] * 4  # the swapped evaluation plays the same 4 held-out episodes
    assert wins == round(wins) and run["success_rl_swapped_ci95"] == pytest.approx(
        binomial_interval(round(wins), 4), abs=1e-4
    )
    assert "shown the other target's name" in capsys.readouterr().out


def test_the_vla_quickstart_sizes_only_the_model_it_writes():
    from omni_rl.errors import ConfigError
    from omni_rl.recipe_loader import load_config

    assert load_config(None, [], recipe="quickstart_vla").tiny_width() == 64
    with pytest.raises(ConfigError, match="model_width: sizes the tiny pi_0"):
        load_config(None, ["policy.path=some/pi0", "model_width=128"], recipe="quickstart_vla")


def test_the_vla_quickstart_clones_each_policy_type_for_its_own_length():
    """pi_0.5 clones longer than pi_0 unless bc.steps says otherwise, and the run's config
    records the length it used."""
    from omni_rl.config import to_dict
    from omni_rl.recipe_loader import load_config

    assert load_config(None, [], recipe="quickstart_vla").bc.steps == 1500
    assert to_dict(load_config(None, ["policy.type=pi05"], recipe="quickstart_vla"))["bc"]["steps"] == 3000
    assert load_config(None, ["policy.type=pi05", "bc.steps=700"], recipe="quickstart_vla").bc.steps == 700
    assert load_config(None, ["bc.lr=0.01"], recipe="quickstart_vla").bc.steps == 1500


def test_audio_quickstart_small_run(tmp_path, capsys):
    args = ["quickstart", "--audio", "--set", f"run.output_dir={tmp_path}"]
    for override in (
        "data.train_clips=8",
        "data.heldout_clips=8",
        "sft.trainer.steps=3",
        "grpo.trainer.steps=2",
        "grpo.rollout.n=2",
        "grpo.data.prompts_per_step=2",
    ):
        args += ["--set", override]
    assert main(args) == 0
    summary = assert_summary_rescores(tmp_path)
    assert summary["heldout_rows"] == 8 and summary["silent"] is False
    sources = {"audio_higher", "audio_count", "audio_order", "audio_louder"}
    assert set(summary["per_source"]) == sources
    assert_text_alone_rescores(tmp_path, summary, sources, audio_grpo().rewards.settings())
    rows = [json.loads(line) for line in (tmp_path / "grpo" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and rows[-1]["data/cache_misses"] == 0  # the audio came from the cache
    assert (tmp_path / "plots" / "grpo" / "reward_mean.png").is_file()
    assert "after GRPO" in capsys.readouterr().out


def test_quickstart_with_the_kinds_each_routed_to_its_reward(tmp_path):
    """The heading, counting and grounding kinds: each goes to its own reward (four-way
    choice, a number, a span by IoU), the cold start learns their answers shuffled
    within each kind, and the summary gives each kind its chance (1/4, 1/5, the best
    constant span's mean IoU) and rescoring the saved answers gives its figures."""
    from omni_rl.preprocess.motion import ROUTED_KINDS, grounding_baseline
    from omni_rl.rewards import score

    kinds = "data.kinds=[" + ",".join(ROUTED_KINDS) + "]"
    steps = ("data.train_clips=12", "data.heldout_clips=6", "grpo.trainer.steps=2", "grpo.rollout.max_new_tokens=32")
    assert video_quickstart(tmp_path, kinds, *steps) == 0
    summary = assert_summary_rescores(tmp_path)
    assert summary["kinds"] == list(ROUTED_KINDS)
    assert set(summary["per_type"]) == {"multiple_choice", "counting", "temporal_grounding"}
    chances = {k: e["chance"] for k, e in summary["per_source"].items()}
    expected = {"video_heading": 0.25, "video_counting": 0.2, "video_grounding": grounding_baseline()[1]}
    assert chances == pytest.approx(expected)
    assert summary["overall"]["chance"] == pytest.approx(sum(chances.values()) / 3)
    # overall on one scale: each answer rescored, less its kind's chance, over 1 - chance
    heldout = {
        r["id"]: r for r in map(json.loads, (tmp_path / "data" / "heldout" / "data.jsonl").read_text().splitlines())
    }
    answers = [json.loads(line) for line in (tmp_path / "heldout_answers.jsonl").read_text().splitlines()]
    for phase, column in (("sft", "after_sft"), ("rl", "after_rl")):
        mine = []
        for a in answers:
            row, b = heldout[a["id"]], chances[heldout[a["id"]]["data_source"]]
            s = score(row["problem_type"], a[column][0], row["answer"], options=row.get("options")).accuracy
            mine.append((s - b) / (1 - b))
        assert summary["overall_normalised"][phase] == pytest.approx(sum(mine) / len(mine))
    assert summary["overall_normalised"]["rows"] == 6 and summary["overall_normalised"]["chance"] == 0.0
    sft_rows = [json.loads(line) for line in (tmp_path / "data" / "train" / "sft.jsonl").read_text().splitlines()]
    asked = [r for r in sft_rows if r["data_source"] != "video_color"]  # the colour questions are four-way
    assert len(asked) % 3 == 0 and {r["problem_type"] for r in asked} == set(summary["per_type"])


def test_quickstart_kinds_are_checked():
    from omni_rl.config import FieldError
    from omni_rl.demos.quickstart_config import QuickstartData

    with pytest.raises(FieldError, match=r"\['spin'\]: no such kind"):
        QuickstartData(kinds=["heading", "spin"])
    with pytest.raises(FieldError, match="prime to the 3 kinds"):
        QuickstartData(kinds=["heading", "counting", "grounding"], decoy_every=3)
    QuickstartData(kinds=["heading", "counting", "grounding"], decoy_every=7)
    # counting's five answers cycle too: every fifth row of a kind is a decoy on one answer
    with pytest.raises(FieldError, match=r"number of answers \(1, 2, 4, 5\)"):
        QuickstartData(decoy_every=5)  # the seven default kinds
    with pytest.raises(FieldError, match="number of answers"):
        QuickstartData(kinds=["heading", "counting", "grounding"], decoy_every=4)  # heading's four
    QuickstartData(decoy_every=3)


def test_decoys_leave_every_kinds_other_answers_balanced():
    """Where decoy_every passes the check, the rows that are not decoys keep every
    answer of every kind equally often (a guess from the text alone stays at chance);
    with the seven default kinds, 5 would leave counting's non-decoys without the
    answer 2, which is why the check refuses it."""
    from collections import Counter

    from omni_rl.demos.quickstart_config import QuickstartData
    from omni_rl.preprocess.motion import QUESTIONS, is_decoy
    from omni_rl.preprocess.synthetic import balanced_choices

    kinds = tuple(QuickstartData().kinds)

    def answers(k: int) -> dict[str, list[int]]:
        kept = Counter(
            (kind, answer)
            for i, kind, _, _, answer in balanced_choices(7 * 5 * 4 * 3, kinds, QUESTIONS)
            if not is_decoy(i, k)
        )
        return {kind: [kept[(kind, a)] for a in range(len(QUESTIONS[kind][1]))] for kind in kinds}

    assert all(len(set(counts)) == 1 for counts in answers(3).values())
    assert answers(5)["counting"][2] == 0  # no non-decoy row answers "2"


def test_held_out_intervals_of_iou_scores_are_intervals_of_a_mean(tmp_path):
    """A kind scored by IoU (grounding) gets the normal interval of its mean, not
    Wilson's interval for a success rate, which assumes p(1 - p) and is far too wide
    (a constant IoU of 0.3 has no spread); a right-or-wrong kind keeps Wilson's."""
    from omni_rl.algorithms.stats import mean_interval
    from omni_rl.demos.quickstart import compare, text_alone

    heldout = tmp_path / "data.jsonl"
    rows = [{"id": f"g{i}", "data_source": "video_grounding"} for i in range(50)]
    rows += [{"id": f"c{i}", "data_source": "video_count"} for i in range(50)]
    heldout.write_text("".join(json.dumps(r | {"problem_type": "counting", "answer": 1}) + "\n" for r in rows))
    ious = [0.3 + 0.004 * i for i in range(50)]
    scores = {f"g{i}": iou for i, iou in enumerate(ious)} | {f"c{i}": float(i % 2) for i in range(50)}
    run = {"row_accuracy": scores}
    compared = compare(heldout, run, run, baseline=lambda row: 0.5)
    low, high = mean_interval(ious)
    assert compared["video_grounding"]["sft_ci95"] == [round(low, 4), round(high, 4)]
    assert compared["video_count"]["rl_ci95"] == [round(x, 4) for x in binomial_interval(25, 50)]
    mixed = mean_interval(ious + [float(i % 2) for i in range(50)])
    assert compared["overall"]["sft_ci95"] == [round(x, 4) for x in mixed]
    alone = text_alone(heldout, {"row_accuracy": scores, "answers": {r["id"]: ["1"] for r in rows}})
    assert alone["video_grounding"]["accuracy_ci95"] == [round(low, 4), round(high, 4)]
