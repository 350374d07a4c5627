"""The quickstart: a tiny VLM learns a synthetic video-QA task on a CPU, SFT then GRPO.

It generates short clips of coloured squares, each with a two-option question that
needs several frames (which way a square moves, which of two appears first, how many
times one flashes, in which half one shows), with a held-out split; caches the media,
builds a tiny Qwen2.5-VL, runs a short SFT cold start on part of the training set,
evaluates on the held-out split, runs GRPO from the SFT checkpoint, evaluates again
(and once more with the held-out questions asked without their clips), and writes
``summary.json`` (held-out accuracy after SFT and after RL, per kind of question, the
text alone's, seconds) and curve PNGs. The two phases are the sft and grpo recipes run on
the config's ``sft`` and ``grpo`` sections, filled with what the quickstart generates.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path

import torch

from omni_rl.algorithms.stats import above_baseline, mean_interval, paired_gain, score_interval
from omni_rl.config import save_config
from omni_rl.data.config import EvalSetConfig
from omni_rl.data.dataset import MediaDataset
from omni_rl.demos.quickstart_config import QuickstartConfig
from omni_rl.engine import checkpoint
from omni_rl.errors import OmniRLError
from omni_rl.evaluation.curate import LABEL, moved, without_media
from omni_rl.evaluation.pipeline import evaluate_rows
from omni_rl.evaluation.summary import chance
from omni_rl.models import load
from omni_rl.preprocess.motion import QUESTIONS, chance_of, color_rows, scene_digests, write_motion_qa
from omni_rl.preprocess.pipeline import Budgets, preprocess
from omni_rl.preprocess.rows import read_rows
from omni_rl.recipes import grpo, sft
from omni_rl.recipes.common import write_model_inputs
from omni_rl.rewards import RewardSettings, Target, score_batch
from omni_rl.runtime import apply_run_settings, resolve_device


def split_rows(data: Path, fraction: float, out: Path, kinds: int = 4) -> Path:
    """The first ``fraction`` of the rows, in whole cycles of the ``kinds`` kinds of
    question (which cycle row by row: one of each kind a cycle)."""
    rows = data.read_text().splitlines()
    keep = max(kinds, int(len(rows) * fraction) // kinds * kinds)
    out.write_text("\n".join(rows[:keep]) + "\n")
    return out


def shuffle_answers(data: Path, seed: int) -> Path:
    """Rewrite ``data`` with its answers permuted among the rows of each data source
    (so each kind keeps its balance of answers, and no answer says what its clip shows);
    a decoy keeps its answer, which its wording states. Returns ``data``."""
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    rng = random.Random(seed)
    for source in sorted({r["data_source"] for r in rows}):
        mine = [r for r in rows if r["data_source"] == source and not r.get("decoy")]
        answers = [r["answer"] for r in mine]
        rng.shuffle(answers)
        for row, answer in zip(mine, answers, strict=True):
            row["answer"] = answer
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return data


def add_color_rows(data: Path) -> Path:
    """Append to ``data`` the colour question of each of its rows' clips that shows one
    square (``color_rows``), the true answer; returns ``data``."""
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows + color_rows(rows)))
    return data


def drop_clips(data: Path, share: float, seed: int) -> Path:
    """Rewrite ``data`` with a seeded ``share`` of its rows asked without their media
    (``without_media``: as ``omni-rl curate text-only`` asks); returns ``data``."""
    rows = read_rows(data)[0]
    chosen = set(random.Random(seed).sample(range(len(rows)), round(share * len(rows))))
    records = [without_media(row) if i in chosen else row.fields for i, row in enumerate(rows)]
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    return data


UNREACHABLE = "Which six-digit number is written under this clip?"


def add_unreachable(data: Path, count: int, seed: int) -> Path:
    """Append ``count`` rows of the source ``unreachable`` to ``data``: its clips in turn,
    each asked ``UNREACHABLE`` with a seeded random six-digit answer (numerical), which
    no clip shows and no completion reaches. Returns ``data``."""
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    rng = random.Random(seed)
    added = []
    for i in range(count):
        clip = rows[i % len(rows)]
        answer = str(rng.randrange(100_000, 1_000_000))
        row = {"id": f"unreachable{i:05d}", "problem": UNREACHABLE, "problem_type": "numerical", "answer": answer}
        added.append({**row, "videos": clip["videos"], "data_source": "unreachable"})
    with data.open("a") as f:
        f.writelines(json.dumps(r) + "\n" for r in added)
    return data


def scored_on_accuracy_alone(grpo_cfg, problem_type: str):
    """``grpo_cfg`` with ``problem_type``'s format term weighted 0 (a row of it then scores
    its accuracy alone)."""
    weights = {**grpo_cfg.rewards.weights, problem_type: (1.0, 0.0)}
    return replace(grpo_cfg, rewards=replace(grpo_cfg.rewards, weights=weights))


def _held_out(cfg, model_dir: Path, dataset: MediaDataset) -> dict:
    model, processor = load(model_dir)
    return evaluate_rows(
        model, processor, dataset, samples=1, max_new_tokens=cfg.grpo.rollout.max_new_tokens, progress=False
    )


def _filled(cfg, recipe_cfg, run_dir: Path, rows: Path, model_path: str | None = None, heldout=None, **tiny):
    """A recipe's config (``cfg.sft`` or ``cfg.grpo``) with what the quickstart generates
    filled in: its run and media, the tiny model (or ``model_path``; ``tiny``: more
    ``model.tiny_*`` settings), the rows and cache, and ``heldout`` (rows) as its
    evaluation set (``trainer.eval_every`` sets how often)."""
    tiny = {"tiny_family": cfg.media.family, "tiny_width": cfg.model.width, **tiny} if model_path is None else {}
    model = replace(recipe_cfg.model, path=model_path, **tiny)
    cache = str(Path(cfg.run.output_dir) / "cache")
    data = replace(recipe_cfg.data, train=str(rows), cache=cache, prompt_template=cfg.data.prompt_template)
    if heldout is not None:
        tokens = cfg.grpo.rollout.max_new_tokens
        data = replace(data, eval=[EvalSetConfig(data=str(heldout), name="heldout", max_new_tokens=tokens)])
    run = replace(cfg.run, output_dir=str(run_dir), overwrite=True)  # a rerun of the quickstart starts afresh
    return replace(recipe_cfg, run=run, media=cfg.media, model=model, data=data)


def train_grpo(grpo_cfg) -> None:
    """The GRPO phase in this process; with ``rollout.staleness: 1`` under torchrun, as
    one trainer and one rollout process that split the run's threads (its config is
    written beside its output directory, ``grpo.yaml``)."""
    if not grpo_cfg.rollout.staleness:
        grpo.train(grpo_cfg)
        return
    threads = max(1, torch.get_num_threads() // 2)  # the quickstart's run settings are in force
    path = save_config(replace(grpo_cfg, run=replace(grpo_cfg.run, threads=threads)), f"{grpo_cfg.run.output_dir}.yaml")
    torchrun = Path(sys.executable).parent / "torchrun"
    command = [str(torchrun), "--standalone", "--nproc-per-node=2", "-m", "omni_rl", "train", str(path)]
    print(f"GRPO with a one-step-off rollout: {' '.join(command)} ({threads} thread(s) a process)", flush=True)
    done = subprocess.run(command, env={**os.environ, "OMP_NUM_THREADS": str(threads)}, check=False)
    if done.returncode:
        raise OmniRLError(f"the GRPO phase under torchrun failed (exit {done.returncode}); its output is above")


def without_clips(heldout: Path) -> Path:
    """The rows of ``heldout`` each asked without its media (``without_media``, as
    ``omni-rl curate text-only`` asks them), written beside it as
    ``without_media.jsonl``; returns that file."""
    out = heldout.parent / "without_media.jsonl"
    out.write_text("".join(json.dumps(without_media(row)) + "\n" for row in read_rows(heldout)[0]))
    return out


def run_phases(
    cfg, train: Path, sft_rows: Path, heldout: Path, grpo_rows: Callable[[Path], Path] | None = None, **tiny
) -> tuple[dict, dict, dict]:
    """Cache every split, SFT on ``sft_rows``, evaluate on ``heldout``, GRPO on
    ``train`` (or on ``grpo_rows(the SFT model)``) from the SFT checkpoint, evaluate
    again, with and without the held-out rows' media (``without_clips``: the text
    alone). Returns the three evaluations. ``cfg`` is a quickstart config (run, media,
    model, data, sft and grpo sections)."""
    out = Path(cfg.run.output_dir)
    budgets = Budgets.from_config(cfg.media)
    for data in (train, sft_rows, heldout):  # each split gets its cache index (sft's media are train's)
        preprocess(data, out / "cache", budgets, workers=1, progress=False)
    template = cfg.data.prompt_template
    heldout_set = MediaDataset(heldout, budgets, out / "cache", "prefer_cache", prompt_template=template)

    # SFT: a short cold start on part of the training set
    sft.train(_filled(cfg, cfg.sft, out / "sft", sft_rows, **tiny))
    sft_model = checkpoint.latest(out / "sft") / "model"
    after_sft = _held_out(cfg, sft_model, heldout_set)

    # GRPO: from the SFT checkpoint, on the whole training set or the rows chosen
    rows = train if grpo_rows is None else grpo_rows(sft_model)
    grpo_cfg = _filled(cfg, cfg.grpo, out / "grpo", rows, model_path=str(sft_model), heldout=heldout, **tiny)
    for data in (rows, heldout):  # what omni-rl preprocess --config caches: the processor's output, once
        write_model_inputs(grpo_cfg, data, out / "cache", resolve_device(cfg.run.device))
    train_grpo(grpo_cfg)
    grpo_model = checkpoint.latest(out / "grpo") / "model"
    after_rl = _held_out(cfg, grpo_model, heldout_set)
    blind = MediaDataset(without_clips(heldout), budgets, out / "cache", "prefer_cache", prompt_template=template)
    return after_sft, after_rl, _held_out(cfg, grpo_model, blind)


def by_source(row: dict) -> str:
    return row.get("data_source") or "unknown"


def by_type(row: dict) -> str:
    return row.get("problem_type") or "unknown"


def by_label(row: dict) -> str:
    """``decoys`` (a question its wording answers) or ``grounded``."""
    return "decoys" if row.get(LABEL) else "grounded"


def scored_rows(heldout: Path, after_sft: dict, after_rl: dict) -> list[dict]:
    """The rows of the dataset file ``heldout`` that both evaluations scored."""
    before, after = after_sft["row_accuracy"], after_rl["row_accuracy"]
    rows = [json.loads(line) for line in heldout.read_text().splitlines() if line.strip()]
    return [r for r in rows if r["id"] in before and r["id"] in after]


def compare(
    heldout: Path,
    after_sft: dict,
    after_rl: dict,
    group: Callable[[dict], str] = by_source,
    baseline: Callable[[dict], float | None] = chance,
) -> dict:
    """Per group of rows (``group``: by data source) and ``overall``: held-out rows,
    chance (the mean of ``baseline`` over its rows: a row's score without its media),
    accuracy after SFT and after RL with 95% intervals (``*_ci95``), and the gain with
    the 95% interval of the paired difference over the same questions. Rows scored in
    only one of the two evaluations are left out of both."""
    before, after = after_sft["row_accuracy"], after_rl["row_accuracy"]
    groups: dict[str, list[dict]] = {"overall": []}
    for row in scored_rows(heldout, after_sft, after_rl):
        groups.setdefault(group(row), []).append(row)
        groups["overall"].append(row)
    result = {}
    for name, mine in sorted(groups.items(), key=lambda kv: kv[0] == "overall"):
        sft_scores, rl_scores = [before[r["id"]] for r in mine], [after[r["id"]] for r in mine]
        chances = [baseline(r) for r in mine]
        gain, low, high = paired_gain(sft_scores, rl_scores) if mine else (0.0, 0.0, 0.0)
        entry = {"rows": len(mine), "chance": None if None in chances or not mine else sum(chances) / len(mine)}
        for phase, scores in (("sft", sft_scores), ("rl", rl_scores)):
            entry[phase] = sum(scores) / max(len(scores), 1)
            entry[f"{phase}_ci95"] = [round(x, 4) for x in score_interval(scores)]
        result[name] = entry | {"gain": gain, "gain_ci95": [round(low, 4), round(high, 4)]}
    return result


def text_alone(
    heldout: Path,
    without: dict,
    baseline: Callable[[dict], float | None] = chance,
    settings: RewardSettings | None = None,
) -> dict:
    """The GRPO model asked the held-out questions without their media (``without``: its
    evaluation on ``without_clips``), per data source and ``overall``: rows, the
    baseline (the mean of ``baseline``), the accuracy with its 95% interval (scored as
    the other evaluations are), and ``answered``, the share of answers in the form the
    GRPO phase rewarded (format 1 under its reward ``settings``). Empty where the
    evaluation scored no row."""
    rows = [json.loads(line) for line in heldout.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r["id"] in without["row_accuracy"]]
    if not rows:
        return {}
    formed = score_batch(
        [r["problem_type"] for r in rows],
        [without["answers"][r["id"]][0] for r in rows],
        [Target(r["answer"], r.get("options"), r) for r in rows],
        settings,
    )
    groups: dict[str, list[tuple[dict, float]]] = {"overall": []}
    for row, result in zip(rows, formed, strict=True):
        groups.setdefault(by_source(row), []).append((row, result.format))
        groups["overall"].append((row, result.format))
    summary = {}
    for name, mine in sorted(groups.items(), key=lambda kv: kv[0] == "overall"):
        right = [without["row_accuracy"][r["id"]] for r, _ in mine]
        chances = [baseline(r) for r, _ in mine]
        summary[name] = {
            "rows": len(mine),
            "chance": None if None in chances else sum(chances) / len(mine),
            "accuracy": sum(right) / len(mine),
            "accuracy_ci95": [round(x, 4) for x in score_interval(right)],
            "answered": sum(f == 1.0 for _, f in mine) / len(mine),
        }
    return summary


def text_alone_table(entries: dict) -> str:
    """``text_alone``'s result as a plain-text table."""
    width = max(22, *(len(name) + 1 for name in entries))
    lines = [f"{'asked without media':<{width}}{'rows':>6}{'chance':>8}   {'after GRPO':<21}answered in form"]
    for name, e in entries.items():
        odds = "-" if e["chance"] is None else f"{e['chance']:.2f}"
        low, high = e["accuracy_ci95"]
        cell = f"{e['accuracy']:.2f} [{low:.2f}, {high:.2f}]"
        lines.append(f"{name:<{width}}{e['rows']:>6}{odds:>8}   {cell:<21}{e['answered']:.2f}")
    return "\n".join(lines)


NORMALISED = "each row's score s with its baseline b as (s - b) / (1 - b), 0 at the baseline, 1 right; their mean"


def normalised_overall(
    heldout: Path, after_sft: dict, after_rl: dict, baseline: Callable[[dict], float | None] = chance
) -> dict | None:
    """The held-out rows scored on one scale whatever their kind's baseline
    (``above_baseline``): rows, the mean after SFT and after RL with normal 95%
    intervals, and the gain with its paired interval. None where a row has no baseline."""
    before, after = after_sft["row_accuracy"], after_rl["row_accuracy"]
    rows = scored_rows(heldout, after_sft, after_rl)
    baselines = [baseline(r) for r in rows]
    if not rows or None in baselines:
        return None
    sft_scores = [above_baseline(before[r["id"]], b) for r, b in zip(rows, baselines, strict=True)]
    rl_scores = [above_baseline(after[r["id"]], b) for r, b in zip(rows, baselines, strict=True)]
    gain, low, high = paired_gain(sft_scores, rl_scores)
    entry = {"rows": len(rows), "chance": 0.0, "how": NORMALISED}
    for phase, scores in (("sft", sft_scores), ("rl", rl_scores)):
        entry[phase] = sum(scores) / len(scores)
        entry[f"{phase}_ci95"] = [round(x, 4) for x in mean_interval(scores)]
    return entry | {"gain": gain, "gain_ci95": [round(low, 4), round(high, 4)]}


def compare_table(compared: dict) -> str:
    """``compare``'s result as a plain-text table."""

    def cell(entry, phase):
        low, high = entry[f"{phase}_ci95"]
        return f"{entry[phase]:.2f} [{low:.2f}, {high:.2f}]"

    width = max(22, *(len(name) + 1 for name in compared))
    lines = [f"{'held out':<{width}}{'rows':>6}{'chance':>8}   {'after SFT':<21}{'after GRPO':<21}gain [95%]"]
    for name, e in compared.items():
        odds = "-" if e["chance"] is None else f"{e['chance']:.2f}"
        low, high = e["gain_ci95"]
        gain = f"{e['gain']:+.2f} [{low:+.2f}, {high:+.2f}]"
        lines.append(f"{name:<{width}}{e['rows']:>6}{odds:>8}   {cell(e, 'sft'):<21}{cell(e, 'rl'):<21}{gain}")
    return "\n".join(lines)


def write_summary(
    out: Path,
    heldout: Path,
    after_sft: dict,
    after_rl: dict,
    started: float,
    baseline: Callable[[dict], float | None] = chance,
    without: dict | None = None,
    settings: RewardSettings | None = None,
    **extra,
) -> dict:
    """``summary.json`` (held-out accuracy after SFT and after RL, overall, per problem
    type and per data source with chance, 95% intervals and the gain, and overall on one
    scale over unlike baselines, ``normalised_overall``; where some held-out rows
    are decoys, the same for them and for the others, ``per_label``; ``without``: the
    RL model's evaluation on the rows without their media, as ``text_alone`` under the
    GRPO phase's reward ``settings``; ``extra``, seconds), ``heldout_answers.jsonl``
    (each held-out row's answers after SFT and after RL, and without its media, which
    the accuracies score), curve PNGs, and the comparisons printed. ``heldout``: the
    held-out rows' dataset file; ``baseline``: a row's score without its media
    (``compare``)."""
    compared = compare(heldout, after_sft, after_rl, baseline=baseline)
    typed = compare(heldout, after_sft, after_rl, by_type, baseline)
    typed.pop("overall")
    normalised = normalised_overall(heldout, after_sft, after_rl, baseline)
    labelled = compare(heldout, after_sft, after_rl, by_label, baseline)
    if "decoys" in labelled:
        labelled.pop("overall")
        extra = {"per_label": labelled, **extra}
    alone = text_alone(heldout, without, baseline, settings) if without is not None else None
    if alone:
        extra = {"without_media": alone, **extra}
    summary = {
        "heldout_accuracy_sft": after_sft["accuracy"],
        "heldout_accuracy_rl": after_rl["accuracy"],
        "overall": compared.pop("overall"),
        **({"overall_normalised": normalised} if normalised else {}),
        "per_type": typed,
        "per_source": compared,
        "heldout_rows": after_rl["rows"],
        **extra,
        "seconds": round(time.perf_counter() - started, 1),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    answers = [
        {"id": row_id, "after_sft": after_sft["answers"].get(row_id), "after_rl": texts}
        | ({"without_media": without["answers"].get(row_id)} if without is not None else {})
        for row_id, texts in after_rl["answers"].items()
    ]
    (out / "heldout_answers.jsonl").write_text("".join(json.dumps(a) + "\n" for a in answers))
    _plots(out)
    shown = compared | ({f"type/{t}": e for t, e in typed.items()} if len(typed) > 1 else {})
    shown |= summary.get("per_label", {})
    shown |= {"overall": summary["overall"]} | ({"overall, normalised": normalised} if normalised else {})
    print(compare_table(shown))
    if alone:
        print(text_alone_table(alone))
    return summary


def begin(cfg) -> tuple[float, Path, dict]:
    """(start time, output directory, runtime settings in force) of a quickstart run:
    the directory made, the resolved config saved in it, threads and CPU kernels set."""
    started = time.perf_counter()
    out = Path(cfg.run.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_config(cfg, out / "config.yaml")
    return started, out, apply_run_settings(cfg.run)


def main(cfg: QuickstartConfig) -> dict:
    """Run the quickstart; returns (and writes) its summary."""
    started, out, runtime = begin(cfg)
    d = cfg.data
    # DATA: synthetic clips with known answers; the held-out split draws other scenes
    kinds = tuple(d.kinds)
    controls = {"blank": d.blank_frames, "shuffle": d.shuffle_frames, "decoy_every": d.decoy_every, "kinds": kinds}
    train = write_motion_qa(
        out / "data" / "train", d.train_clips, cfg.run.seed, colors=d.sft_color_questions, **controls
    )
    seen = scene_digests(d.train_clips, cfg.run.seed, kinds)  # no held-out clip repeats a training one
    heldout = write_motion_qa(out / "data" / "heldout", d.heldout_clips, cfg.run.seed + 10_000, avoid=seen, **controls)
    sft_rows = split_rows(train, d.sft_fraction, train.parent / "sft.jsonl", len(kinds))
    if d.sft_shuffled_answers:
        shuffle_answers(sft_rows, cfg.run.seed)
    if d.sft_color_questions:
        add_color_rows(sft_rows)
    if d.sft_text_only:
        drop_clips(sft_rows, d.sft_text_only, cfg.run.seed)
    if d.unreachable_rows:  # after the cold start's rows are taken: GRPO's alone
        add_unreachable(train, d.unreachable_rows, cfg.run.seed)
        cfg = replace(cfg, grpo=scored_on_accuracy_alone(cfg.grpo, "numerical"))
    chosen = partial(curated, cfg, train, d.curate_model) if d.curate == "text-only" else None
    grpo_rows = without_decoys(train) if d.curate == "labels" else train
    after_sft, after_rl, without = run_phases(cfg, grpo_rows, sft_rows, heldout, chosen)
    controls = {"blank_frames": d.blank_frames, "shuffle_frames": d.shuffle_frames, "kinds": list(kinds)}
    if d.sft_color_questions:
        controls |= {"sft_color_questions": True}
    if d.decoy_every or d.sft_text_only:
        controls |= {"decoy_every": d.decoy_every, "sft_text_only": d.sft_text_only}
    if d.unreachable_rows:
        controls |= {"unreachable_rows": d.unreachable_rows, "sampler": cfg.grpo.data.sampler.type}
    if d.curate == "text-only":
        report = json.loads((train.parent.parent / "report.json").read_text())
        controls |= {"curation": {"model": d.curate_model or "the cold start's", **_curation_figures(report)}}
    if d.curate == "labels":
        kept = len((train.parent.parent / "kept.jsonl").read_text().splitlines())
        rows = len(train.read_text().splitlines())
        controls |= {"curation": {"model": "the decoy labels", "rows": rows, "dropped": rows - kept}}
    return write_summary(
        out,
        heldout,
        after_sft,
        after_rl,
        started,
        motion_chance,
        without,
        cfg.grpo.rewards.settings(),
        **controls,
        runtime=runtime,
    )


def motion_chance(row: dict) -> float | None:
    """A held-out row's score without its clip: its kind's (``chance_of``), or a uniform
    guess among its options for a row of no kind."""
    kind = by_source(row).removeprefix("video_")
    return chance_of(kind) if kind in QUESTIONS else chance(row)


def curated(cfg, train: Path, model_dir: str | None, sft_model: Path) -> Path:
    """``omni-rl curate text-only`` of the GRPO training rows ``train`` by the model in
    ``model_dir`` (None: ``sft_model``), written into the data directory above ``train``
    (so the kept rows name their clips by relative paths), and the kept rows cached.
    Returns their file."""
    from omni_rl.evaluation.curate import Asking, TextOnly, curate, report_table

    budgets = Budgets.from_config(cfg.media)
    out = train.parent.parent
    model, processor = load(Path(model_dir) if model_dir else sft_model)
    asking = Asking(temperature=cfg.grpo.rollout.temperature, max_new_tokens=cfg.grpo.rollout.max_new_tokens)
    settings = cfg.grpo.rewards.settings()
    # the run's seed keys the progress in data/: a re-run with another seed asks every row again
    result = curate(
        model,
        processor,
        train,
        out,
        budgets,
        asking,
        TextOnly(),
        cfg.data.prompt_template,
        settings=settings,
        seed=cfg.run.seed,
    )
    print(report_table(result))
    kept = out / "kept.jsonl"
    preprocess(kept, Path(cfg.run.output_dir) / "cache", budgets, workers=1, progress=False)
    return kept


def without_decoys(train: Path) -> Path:
    """The GRPO training rows ``train`` less those labelled decoys, written into the data
    directory above it as ``kept.jsonl`` (their clips named from there); returns it."""
    out = train.parent.parent / "kept.jsonl"
    rows = [json.loads(line) for line in train.read_text().splitlines()]
    kept = [moved(r, train.parent, out.parent) for r in rows if not r.get(LABEL)]
    out.write_text("".join(json.dumps(r) + "\n" for r in kept))
    return out


def _curation_figures(report: dict) -> dict:
    """What the summary keeps of a curation report: rows asked and dropped, and the
    drops against the decoy labels where there are any."""
    overall = report["overall"]
    return {"rows": overall["rows"], "dropped": overall["dropped"], "labelled": report.get("labelled")}


def _plots(out: Path) -> None:
    from omni_rl.plots import plot_metrics

    for run in ("sft", "grpo"):
        plot_metrics(out / run, out / "plots" / run)
