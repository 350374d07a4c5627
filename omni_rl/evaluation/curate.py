"""Curation by what a model answers, K sampled answers per question. ``TextOnly``: each
question asked without its media; one whose pass rate reaches the threshold is answered
by its wording and leaves the set. ``Difficulty``: asked with its media; a row stays
only while its pass rate is strictly between the bounds (one the model always or never
solves gives GRPO's groups nothing to compare). Progress is written row by row, each
row with what asked it (the model's weights, the seed, the asking), so an interrupted
run resumes where it stopped and a run with another model or seed asks every row
again; under torchrun each rank answers its share of each chunk."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from omni_rl.data.dataset import PLACEHOLDER, MediaDataset
from omni_rl.engine import distributed
from omni_rl.errors import OmniRLError, RowFailure
from omni_rl.evaluation.answer import answer_rows, gathered
from omni_rl.evaluation.score import row_accuracies
from omni_rl.evaluation.summary import chance
from omni_rl.preprocess.cache import file_digest
from omni_rl.preprocess.pipeline import Budgets
from omni_rl.preprocess.rows import MEDIA_FIELDS, Row, read_rows
from omni_rl.rewards import RewardSettings
from omni_rl.rollout.hf import SamplingParams

log = logging.getLogger(__name__)

PASSES = "passes.jsonl"  # one line per answered row: {id, pass_rate, answers, what asked it}
LABEL = "decoy"  # a generator's label of a row its wording answers (the report scores drops against it)


@dataclass(frozen=True)
class Asking:
    """How each question is asked: K answers sampled at a temperature (top-p and top-k
    as training's rollouts filter), up to a length."""

    samples: int = 8
    temperature: float = 1.0
    max_new_tokens: int = 64
    top_p: float = 1.0
    top_k: int = 0
    batch_prompts: int = 8
    chunk_rows: int = 64
    """Rows answered between two writes of the progress file."""


@dataclass(frozen=True)
class TextOnly:
    """Ask without the media; a pass rate >= ``threshold`` drops the row."""

    threshold: float = 0.875
    name = "text-only"
    rate_key = "text_only_pass_rate"
    scores_decoys = True
    """Its drops are scored against the decoy labels (a decoy is a row its wording answers)."""

    def drops(self, record: dict) -> bool:
        """Whether the row of a progress record (``pass_records``) leaves."""
        return record["pass_rate"] >= self.threshold

    def describe(self) -> str:
        return f"a text-only pass rate >= {self.threshold:g} drops the row"

    def as_dict(self) -> dict:
        return {"curation": self.name, "threshold": self.threshold}


@dataclass(frozen=True)
class Difficulty:
    """Ask with the media; a row stays while ``low`` < pass rate < ``high`` and its
    answers did not all score alike (a continuous score, IoU or MRA, can be the same
    mid-range value in every answer: GRPO's group would get no advantage)."""

    low: float = 0.0
    high: float = 1.0
    name = "difficulty"
    rate_key = "pass_rate"
    scores_decoys = False
    """A decoy is as easy with its media as without: the labels say nothing of these drops."""

    def drops(self, record: dict) -> bool:
        """Whether the row of a progress record (``pass_records``) leaves (a record
        written before ``alike`` was recorded counts as not alike)."""
        return not self.low < record["pass_rate"] < self.high or record.get("alike", False)

    def describe(self) -> str:
        bounds = f"({self.low:g}, {self.high:g})"
        return f"a pass rate with the media outside {bounds}, or answers that all scored alike, drop the row"

    def as_dict(self) -> dict:
        return {"curation": self.name, "low": self.low, "high": self.high}


def without_media(row: Row) -> dict:
    """``row`` as a record with its media taken out: no images, videos or audios, the
    problem's ``<image>``/``<video>``/``<audio>`` placeholders removed (with the spaces
    around them, and their line when nothing else is on it), the rest as it was."""
    record = {k: v for k, v in row.fields.items() if k not in (*MEDIA_FIELDS, "use_audio_in_video")}
    record["problem"] = _placeholders_removed(row.problem)
    return record


def _placeholders_removed(problem: str) -> str:
    """``problem`` without its media placeholders; lines without one are kept as written."""
    lines = []
    for line in problem.split("\n"):
        if PLACEHOLDER.search(line):
            line = " ".join(PLACEHOLDER.sub(" ", line).split())
            if not line:
                continue
        lines.append(line)
    return "\n".join(lines).strip()


def read_passes(path: Path, curation: str = "text-only") -> dict[str, dict]:
    """{row id: its record} of a progress file. A line cut short by a kill (not valid
    JSON) is left out, and one log line says so. A file another kind of curation wrote
    is refused (its pass rates mean another thing)."""
    done, cut = {}, []
    if path.is_file():
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                cut.append(number)
                continue
            if isinstance(record, dict) and "id" in record and "pass_rate" in record:
                if record.get("curation", "text-only") != curation:
                    raise OmniRLError(
                        f"{path}:{number}: written by curate {record.get('curation', 'text-only')}, not {curation}: "
                        "give this run another --out"
                    )
                done[record["id"]] = record
    if len(cut) == 1:
        log.warning("%s:%d: a line cut short (not valid JSON) is dropped; its row is asked again", path, cut[0])
    elif cut:
        log.warning(
            "%s: %d lines are not valid JSON (cut short), first at line %d: dropped; their rows are asked again",
            path,
            len(cut),
            cut[0],
        )
    return done


def weights_digest(path: Path) -> str:
    """SHA-256 over the names and bytes of a checkpoint directory's weight and config
    files (``*.safetensors``, ``*.json``): another training run or step, another digest."""
    digest = hashlib.sha256()
    for file in sorted(p for p in path.iterdir() if p.suffix in (".safetensors", ".json")):
        digest.update(f"{file.name}|{file_digest(file)}|".encode())
    return digest.hexdigest()


def asked_by(
    model, rule: TextOnly | Difficulty, sampling: SamplingParams, samples: int, prompt_template: str, seed: int
) -> dict:
    """What a pass rate depends on, recorded with each row: the curation, the checkpoint
    ``model`` was loaded from (``omni_rl.models.load``) and its ``weights_digest``, the
    seed, and how the question was asked."""
    path = model.omni_rl_stored.path.resolve()
    start = time.perf_counter()
    weights = weights_digest(path)
    if time.perf_counter() - start > 5 and distributed.ranks().is_main:
        log.info("%s: weights digest in %.0f s", path, time.perf_counter() - start)
    return {
        "curation": rule.name,
        "model": str(path),
        "weights": weights,
        "seed": seed,
        "samples": samples,
        "temperature": sampling.temperature,
        "max_new_tokens": sampling.max_new_tokens,
        "prompt_template": prompt_template,
        # recorded only when they filter: records from before they were are reused
        **({"top_p": sampling.top_p} if sampling.top_p < 1 else {}),
        **({"top_k": sampling.top_k} if sampling.top_k > 0 else {}),
    }


def reusable(done: dict[str, dict], key: dict, path: Path) -> dict[str, dict]:
    """The records of ``done`` (read from ``path``) that ``key`` (``asked_by``) asked;
    the others, asked by another model, seed or asking (or by a version that did not
    record it), are asked again, and one line says so and what differed."""
    same = {i: r for i, r in done.items() if all(r.get(k) == v for k, v in key.items())}
    others = [r for r in done.values() if r["id"] not in same]
    if others and distributed.ranks().is_main:
        differed = {k: {_shown(k, r.get(k)) for r in others} - {_shown(k, now)} for k, now in key.items()}
        differed = {k: before for k, before in differed.items() if before}
        if all(before == {"unrecorded"} for before in differed.values()):
            what = "a version that did not record what asked them"
        else:
            what = "; ".join(f"{k} {' or '.join(sorted(b))}, now {_shown(k, key[k])}" for k, b in differed.items())
        log.warning("%s: %d rows were asked by another producer (%s): they are asked again", path, len(others), what)
    return same


def _shown(field: str, value) -> str:
    """A key's value as the log line gives it: a digest shortened, the template quoted."""
    if value is None:
        return "unrecorded"
    if field == "weights":
        return value[:12]
    return json.dumps(value) if field == "prompt_template" else str(value)


def as_training_reads(
    data: str | Path,
    budgets: Budgets,
    cache: str | None,
    rule: TextOnly | Difficulty,
    prompt_template: str,
    columns: dict[str, str] | None,
    inputs: str | None = None,
) -> MediaDataset:
    """``data`` as training reads it, from ``cache`` where it holds a row's media and
    (``inputs``: their dtype) model inputs (the rows ``Difficulty`` asks); its
    ``failures`` name the rows training would refuse
    (media missing, a gold answer no scorer can match, a row preprocess could not
    cache), which curate reports itself. ``TextOnly`` decodes nothing, so a cache that
    was never made is no help to it and goes unmentioned."""
    if isinstance(rule, TextOnly) and cache is not None and not Path(cache).is_dir():
        cache = None
    mode = "prefer_cache" if cache else "no_cache"
    return MediaDataset(
        data,
        budgets,
        cache,
        mode,
        prompt_template=prompt_template,
        columns=columns,
        report_refused=False,
        inputs=inputs,
    )


def refused_at_load(rows: list[Row], as_trained: MediaDataset) -> list[RowFailure]:
    """The failures of ``as_trained`` (read from the file ``rows`` came from) that refused
    one of ``rows`` as it loaded. Its other failures are lines that are not rows at all
    (``read_rows`` refused them too): a refused row is matched by where it was read, so
    a duplicate id's refused copy is not taken for its first row."""
    sources = {row.source for row in rows}
    return [failure for failure in as_trained.failures if failure.path in sources]


def say_left_out(data: str | Path, refused: list[RowFailure], unusable: list[RowFailure]) -> None:
    """One log line for the lines that cannot be read (in neither output file) and one
    for the rows training would refuse (in ``dropped.jsonl``), each naming the first."""
    if refused:
        log.warning(
            "%s: %s cannot be read (left out of kept.jsonl and dropped.jsonl), first: %s",
            data,
            count(len(refused), "row"),
            refused[0],
        )
    if unusable:
        log.warning(
            "%s: %s cannot be used for training (not asked; written to dropped.jsonl, each with its reason under "
            "'unusable'), first: %s",
            data,
            count(len(unusable), "row"),
            unusable[0],
        )


def curate(
    model,
    processor,
    data: str | Path,
    out: str | Path,
    budgets: Budgets,
    asking: Asking,
    rule: TextOnly | Difficulty,
    prompt_template: str,
    columns: dict[str, str] | None = None,
    settings: RewardSettings | None = None,
    cache: str | None = None,
    progress: bool = True,
    engine=None,
    seed: int = 0,
    inputs: str | None = None,
) -> dict:
    """Ask every row of ``data`` as ``rule`` says (without its media for ``TextOnly``;
    with them, from ``cache`` where it holds them, for ``Difficulty``); write to
    ``out``: ``kept.jsonl`` (the rows the rule keeps, media and all), ``dropped.jsonl``
    (the others, each with its pass rate under ``rule.rate_key``, and the rows training
    would refuse, not asked, each with the reason under ``unusable``), ``passes.jsonl``
    (the progress, one line per row) and ``report.json``; returns the report
    (``report`` below). Rows already in ``passes.jsonl`` are not asked again when the
    same model, seed and asking answered them (``asked_by``); the others are.
    ``engine``: a rollout engine that answers instead of the model (vLLM), each row
    sampled with a seed from ``seed`` and its index (``answer_rows``). ``inputs``: the
    dtype of the cached model inputs the rows asked with their media are read with
    (None: the processor runs on each)."""
    out = Path(out)
    where = distributed.ranks()
    rows, refused = read_rows(data, columns)
    as_trained = as_training_reads(data, budgets, cache, rule, prompt_template, columns, inputs)
    refused_rows = refused_at_load(rows, as_trained)
    unusable = {failure.id: failure.reason for failure in refused_rows}
    if where.is_main:
        say_left_out(data, refused, refused_rows)
    usable = [row for row in rows if row.id not in unusable]
    sampling = (
        SamplingParams(asking.temperature, asking.top_p, asking.top_k, asking.max_new_tokens)
        if asking.samples > 1
        else SamplingParams(temperature=0.0, max_new_tokens=asking.max_new_tokens)
    )
    key = asked_by(model, rule, sampling, asking.samples, prompt_template, seed)
    prompts = out / "text_only_prompts.jsonl"
    if where.is_main:
        done = reusable(read_passes(out / PASSES, rule.name), key, out / PASSES)
        out.mkdir(parents=True, exist_ok=True)
        if isinstance(rule, TextOnly):
            prompts.write_text("".join(json.dumps(without_media(row)) + "\n" for row in usable), encoding="utf-8")
        # the progress as read: a line a kill cut short, or another producer's, goes before new lines follow it
        (out / PASSES).write_text("".join(json.dumps(r) + "\n" for r in done.values()), encoding="utf-8")
    distributed.barrier()
    if not where.is_main:  # only once rank 0 has rewritten it: every rank then asks the same rows
        done = reusable(read_passes(out / PASSES, rule.name), key, out / PASSES)
    if isinstance(rule, TextOnly):
        dataset = MediaDataset(prompts, budgets, cache_mode="no_cache", prompt_template=prompt_template)
    else:
        dataset = as_trained
    todo = [i for i, row in enumerate(dataset.rows) if row.id not in done]
    if len(todo) < len(dataset.rows) and where.is_main:
        log.warning(
            "%s: resumed: %d of %d rows were asked before by this model, seed and asking; %s left to ask",
            out / PASSES,
            len(dataset.rows) - len(todo),
            len(dataset.rows),
            count(len(todo), "row"),
        )
    chunks = [todo[s : s + asking.chunk_rows] for s in range(0, len(todo), asking.chunk_rows)]
    shown = progress and where.is_main
    bar = tqdm(total=len(dataset.rows), initial=len(done), desc=rule.name, unit="row", disable=not shown)
    for chunk in chunks:
        mine = chunk[where.rank :: where.world_size]
        # a row whose prompt or media do not encode is logged by the dataset, kept and counted unasked
        answered, failures = answer_rows(
            model, processor, dataset, sampling, asking.samples, mine, asking.batch_prompts, False, engine, seed
        )
        answers, fields, _ = gathered(answered, failures)
        asked = [dataset.rows[i] for i in chunk if dataset.rows[i].id in answers]
        records = pass_records(asked, answers, fields, settings, key)
        if where.is_main:
            with (out / PASSES).open("a", encoding="utf-8") as f:
                f.write("".join(json.dumps(r) + "\n" for r in records))
        done.update({r["id"]: r for r in records})
        bar.update(len(chunk))
    bar.close()
    result = report(usable, done, rule, refused_rows=len(refused), unusable_rows=len(unusable))
    if where.is_main:
        _write_split(out, rows, done, rule, Path(data).parent, unusable)
        (out / "report.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return result


def pass_records(
    rows: list[Row], answers: dict[str, list[str]], fields: dict[str, dict], settings, key: dict
) -> list[dict]:
    """A progress record of each answered row: its id, its pass rate (the mean accuracy
    of its answers: the share right where accuracy is 0 or 1), whether every answer
    scored alike (of two or more), its answers, and ``key`` (what asked it). Scored
    with ``fields`` (``row_accuracies``)."""
    return [
        {
            "id": row.id,
            "pass_rate": sum(scores) / len(scores),
            "alike": len(scores) > 1 and len(set(scores)) == 1,
            "answers": answers[row.id],
            **key,
        }
        for row, scores in row_accuracies(rows, answers, fields, settings)
    ]


def _write_split(
    out: Path,
    rows: list[Row],
    done: dict[str, dict],
    rule: TextOnly | Difficulty,
    root: Path,
    unusable: dict[str, str],
) -> None:
    """``kept.jsonl`` and ``dropped.jsonl``, their media named from ``out`` (``moved``):
    a row ``unusable`` names is dropped with its reason, a row ``rule`` drops with its
    pass rate, and every other row is kept."""
    kept, dropped = [], []
    for row in rows:
        asked = done.get(row.id)
        record = moved(row.fields, root, out)
        if row.id in unusable:
            dropped.append({**record, "unusable": unusable[row.id]})
        elif asked is not None and rule.drops(asked):
            dropped.append({**record, rule.rate_key: asked["pass_rate"]})
        else:
            kept.append(record)
    usable = [r for r in kept + dropped if "unusable" not in r]
    outside = {p for r in usable for p in media_paths(r) if Path(p).is_absolute()}
    if outside:
        log.warning(
            "%s: kept.jsonl and dropped.jsonl name %d media files outside %s by absolute paths (relative ones "
            "would climb out of it): train on them with media.media_root: %s",
            out,
            len(outside),
            out,
            root.resolve(),
        )
    for name, records in (("kept.jsonl", kept), ("dropped.jsonl", dropped)):
        (out / name).write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")


def moved(record: dict, root: Path, out: Path) -> dict:
    """``record``, a row of a dataset in ``root``, written into ``out``: each relative
    media path rewritten to name the same file from there, relative where the file lies
    under ``out`` (the dataset's own directory, or one above it), else absolute (a
    dataset may name files outside its directory only by absolute paths under
    ``media.media_root``). Absolute paths stay as they are."""
    root, out = root.resolve(), out.resolve()

    def path(p: str) -> str:
        if Path(p).is_absolute():
            return p
        file = Path(os.path.normpath(root / p))
        return str(file.relative_to(out)) if file.is_relative_to(out) else str(file)

    def paths(v):  # one path alone may be a string
        return path(v) if isinstance(v, str) else [path(p) for p in v]

    return {k: paths(v) if k in MEDIA_FIELDS and v is not None else v for k, v in record.items()}


def media_paths(record: dict) -> list[str]:
    """Every media path ``record`` names (one path alone may be a string)."""
    values = [record.get(field) or [] for field in MEDIA_FIELDS]
    return [p for v in values for p in ([v] if isinstance(v, str) else v)]


def report(
    rows: list[Row],
    done: dict[str, dict],
    rule: TextOnly | Difficulty,
    refused_rows: int = 0,
    unusable_rows: int = 0,
) -> dict:
    """Counts and rates per ``problem_type`` and per ``data_source`` of ``rows`` (the
    rows training can use): rows, dropped, the share dropped, the mean pass rate and
    the chance level (a uniform guess among the options; None without options). Rows
    the model could not be asked (their prompt or media did not encode) are kept and
    counted as ``unasked``. ``refused_rows``: lines that cannot be read;
    ``unusable_rows``: rows training would refuse (in ``dropped.jsonl``)."""
    groups: dict[str, dict[str, list]] = {"per_type": defaultdict(list), "per_source": defaultdict(list)}
    for row in rows:
        entry = (done.get(row.id), chance(row.fields))
        groups["per_type"][row.problem_type].append(entry)
        groups["per_source"][row.fields.get("data_source") or "unknown"].append(entry)
    everything = [e for entries in groups["per_type"].values() for e in entries]
    result = {
        **rule.as_dict(),
        "rule": rule.describe(),
        "refused_rows": refused_rows,
        "unusable_rows": unusable_rows,
        "overall": _group(everything, rule),
        **{name: {k: _group(v, rule) for k, v in sorted(g.items())} for name, g in groups.items()},
    }
    if rule.scores_decoys and any(LABEL in row.fields for row in rows):
        result["labelled"] = against_labels(rows, done, rule)
    return result


def against_labels(rows: list[Row], done: dict[str, dict], rule: TextOnly | Difficulty) -> dict:
    """How the drops match rows labelled ``"decoy": true`` (a generator's known truth):
    recall, the share of decoys dropped; precision, the share of drops that are decoys
    (None with no decoys or no drops)."""
    decoys = {row.id for row in rows if row.fields.get(LABEL) is True}
    dropped = {row.id for row in rows if row.id in done and rule.drops(done[row.id])}
    hits = len(decoys & dropped)
    return {
        "decoys": len(decoys),
        "dropped_decoys": hits,
        "dropped_others": len(dropped - decoys),
        "recall": hits / len(decoys) if decoys else None,
        "precision": hits / len(dropped) if dropped else None,
    }


def _group(entries: list[tuple[dict | None, float | None]], rule: TextOnly | Difficulty) -> dict:
    """The report's counts over (progress record or None when unasked, chance) entries."""
    asked = [record for record, _ in entries if record is not None]
    rates = [record["pass_rate"] for record in asked]
    chances = [c for _, c in entries if c is not None]
    dropped = sum(rule.drops(record) for record in asked)
    return {
        "rows": len(entries),
        "unasked": len(entries) - len(rates),
        "dropped": dropped,
        "dropped_share": dropped / len(entries) if entries else 0.0,
        "pass_rate": sum(rates) / len(rates) if rates else None,
        "chance": sum(chances) / len(chances) if len(chances) == len(entries) and chances else None,
    }


def report_table(result: dict) -> str:
    """The report as plain text: a line per problem type and per data source."""
    lines = [f"{'':<30}{'rows':>6}{'unasked':>9}{'dropped':>9}{'share':>8}{'pass rate':>11}{'chance':>8}"]

    def line(name: str, g: dict) -> str:
        rate = "-" if g["pass_rate"] is None else f"{g['pass_rate']:.3f}"
        odds = "-" if g["chance"] is None else f"{g['chance']:.2f}"
        counts = f"{g['rows']:>6}{g['unasked']:>9}{g['dropped']:>9}{g['dropped_share']:>8.2f}"
        return f"{name:<30}{counts}{rate:>11}{odds:>8}"

    for title, key in (("problem type", "per_type"), ("data source", "per_source")):
        lines.append(f"{title}:")
        lines += [line("  " + name, g) for name, g in result[key].items()]
    lines.append(line("overall", result["overall"]))
    if "labelled" in result:
        lab = result["labelled"]
        lines.append(
            f"against the decoy labels: {lab['dropped_decoys']} of {lab['decoys']} decoys dropped "
            f"(recall {_ratio(lab['recall'])}), {lab['dropped_others']} other rows dropped "
            f"(precision {_ratio(lab['precision'])})"
        )
    if result.get("unusable_rows"):
        lines.append(f"unusable rows (not asked; in dropped.jsonl with their reason): {result['unusable_rows']}")
    if result.get("refused_rows"):
        lines.append(f"unreadable rows (in neither kept.jsonl nor dropped.jsonl): {result['refused_rows']}")
    lines.append(f"{result['curation']}: {result['rule']}")
    return "\n".join(lines)


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def count(n: int, noun: str) -> str:
    """``n`` and ``noun``, plural unless ``n`` is 1: "1 row", "2 rows"."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"
