"""A benchmark preset, ready to evaluate: its rows from the files as distributed, their
media read by the training path, and results shaped like lmms-eval's (aggregate scores
per task plus one record per sample).

Media go through the training path: the preset's rows are written as omni_rl rows
(``rows.jsonl``) and read by ``MediaDataset`` with the protocol's media settings, the
same decoder and, when given, the same cache.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from omni_rl.benchmarks.base import BENCHMARKS, Benchmark, Protocol, Reading, Scored, spread
from omni_rl.data.dataset import MediaDataset
from omni_rl.engine import distributed
from omni_rl.errors import OmniRLError, RowFailure
from omni_rl.preprocess.cache import MediaCache
from omni_rl.preprocess.config import MediaConfig
from omni_rl.preprocess.pipeline import Budgets, preprocess, write_failures
from omni_rl.preprocess.rows import read_rows
from omni_rl.rewards import check_targets

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Prepared:
    """A benchmark's rows, ready to answer: the rows file, the usable rows (by id) and
    the rows that could not be used."""

    benchmark: Benchmark
    protocol: Protocol
    root: Path
    rows_file: Path
    rows: dict[str, dict]
    failures: list[RowFailure]
    deviations: dict[str, int]


def prepare(
    name: str,
    data: str | Path,
    out: Path,
    overrides: dict[str, Any] | None = None,
    write: bool = True,
    limit: int = 0,
) -> Prepared:
    """Read benchmark ``name`` from ``data`` with the protocol's ``overrides`` and write
    its usable rows to ``out/rows.jsonl`` (``write=False``: another process of the run
    wrote the same file). ``limit``: keep that many rows, spread evenly over the
    benchmark (and its tasks)."""
    benchmark = BENCHMARKS.get(name)
    protocol = benchmark.protocol_for(overrides or {})
    root = Path(data).resolve()
    reading: Reading = benchmark.load(root, protocol)
    reading.rows = spread(reading.rows, limit)
    if protocol.answer_parser != "auto":
        for row in reading.rows:
            row["problem_type"] = protocol.answer_parser
    rows_file = out / "rows.jsonl"
    if write:
        out.mkdir(parents=True, exist_ok=True)
        rows_file.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in reading.rows))
    failures = list(reading.failures)
    parsed, bad = read_rows(rows_file)
    failures += bad
    unscorable = {p.id: p for p in check_targets(parsed)}
    failures += [
        RowFailure(p.id, p.path, f"{p.reason} (answer_parser {protocol.answer_parser})") for p in unscorable.values()
    ]
    refused = set(unscorable) | {b.id for b in bad}
    rows = {r["id"]: r for r in reading.rows if r["id"] not in refused}
    if failures:
        first = failures[0]
        log.warning("%s: %d rows cannot be used, first: %s: %s", name, len(failures), first.path, first.reason)
    deviations = {"read_whole_despite_bounds": sum(bool(r.get("read_whole_despite_bounds")) for r in rows.values())}
    return Prepared(benchmark, protocol, root, rows_file, rows, failures, deviations)


def prepare_on_every_rank(
    name: str, data: str | Path, out: Path, overrides: dict[str, Any] | None = None, limit: int = 0
) -> Prepared:
    """``prepare`` under torchrun: rank 0 writes the rows file, the other ranks read the
    same rows from it."""
    main = distributed.ranks().is_main
    if main:
        prepared = prepare(name, data, out, overrides, limit=limit)
    distributed.barrier()
    if not main:
        prepared = prepare(name, data, out, overrides, write=False, limit=limit)
    return prepared


def media_dataset(
    prepared: Prepared, family: str, cache: str | None = None, progress: bool = True
) -> tuple[MediaDataset, MediaConfig]:
    """The usable rows of ``prepared`` as a ``MediaDataset`` decoding with the protocol's
    media settings for ``family`` (the rows' prompt is the preset's), and those
    settings. With ``cache``, the rows' media are first preprocessed into it (entries
    already there are kept), as for training, so every evaluation reads them decoded;
    under torchrun each rank preprocesses its share of the rows (see ``preprocess_shared``).
    Rows the dataset refuses as it loads (media the cache could not decode) move from
    ``prepared.rows`` to ``prepared.failures``, so the results list them as skipped."""
    media = MediaConfig(**prepared.protocol.media(family), media_root=str(prepared.root))
    budgets = Budgets.from_config(media)
    if cache is not None:
        preprocess_shared(prepared.rows_file, cache, budgets, progress)
    dataset = MediaDataset(prepared.rows_file, budgets, cache=cache, prompt_template="{benchmark_prompt}")
    dataset.rows = [r for r in dataset.rows if r.id in prepared.rows]
    for failure in dataset.failures:
        if prepared.rows.pop(failure.id, None) is not None:
            prepared.failures.append(failure)
    return dataset, media


def preprocess_shared(rows_file: Path, cache: str, budgets: Budgets, progress: bool = True) -> None:
    """Preprocess ``rows_file`` into ``cache``, every rank its share of the rows (every
    rank calls this; one process does it all).

    Shared rather than done by rank 0 alone: the run's process group exists by now (a
    held-out set is loaded after ``start_run``), and a benchmark's videos can take
    longer to decode than ``trainer.dist_timeout_minutes``, which the other ranks would
    spend at the barrier. Preprocessing before the group is joined would need ranks to
    wait for rank 0 without a collective. Each rank decodes 1/N of the rows on
    1/N of its node's CPUs; concurrent writers are safe (see ``preprocess``'s ``shard``)."""
    ranks = distributed.ranks()
    if not ranks.distributed:
        preprocess(rows_file, cache, budgets, progress=progress)
        return
    store = MediaCache(cache)
    store.manifest()  # a foreign cache: every rank raises here, none is left at the barrier
    if ranks.is_main:
        store.remove_stale_temps()  # before any share writes: no temporary file is live yet
    distributed.barrier()
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    workers = max(1, (os.cpu_count() or 1) // per_node)
    shard = (ranks.rank, ranks.world_size)
    report = preprocess(rows_file, cache, budgets, workers, progress=progress and ranks.is_main, shard=shard)
    failures = distributed.gather_objects(report.failures)
    if ranks.is_main:
        write_failures(store, failures)
    distributed.barrier()  # failures.jsonl written before any rank's dataset reads it


def read_predictions(path: str | Path) -> dict[str, list[str]]:
    """{id: [response]} from a JSONL file of ``{"id", "response"}`` (several lines with
    one id are several samples, scored as pass@K)."""
    path = Path(path)
    if not path.is_file():
        raise OmniRLError(f"{path}: no such predictions file")
    out: dict[str, list[str]] = {}
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            out.setdefault(str(record["id"]), []).append(str(record["response"]))
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise OmniRLError(f'{path}:{number}: expected {{"id": ..., "response": ...}} ({err})') from None
    return out


def results(prepared: Prepared, scored: list[Scored], failures: list[RowFailure], config: dict) -> dict:
    """lmms-eval's results layout (results, configs, n-samples, higher_is_better,
    config) plus the rows that could not be scored and why. ``configs.<task>.follows``
    names the scorer the protocol follows (the lmms-eval release, its parser and its
    denominator) and whether ``protocol.metric`` divides by the same rows."""
    name, protocol = prepared.benchmark.name, prepared.protocol
    aggregate = prepared.benchmark.aggregate(scored, protocol.metric)
    failed = prepared.failures + failures
    original = len(prepared.rows) + len(prepared.failures)
    unanswered = len(prepared.rows) - len(scored) - len(failures)
    return {
        "results": {name: {"alias": name, **{f"{k},none": v for k, v in aggregate.items()}, "rows,none": len(scored)}},
        "configs": {
            name: {
                "task": name,
                "dataset_path": str(prepared.root),
                "layout": prepared.benchmark.layout,
                "protocol": dataclasses.asdict(protocol),
                "overrides": config.get("overrides", {}),
                "follows": _follows(prepared),
            }
        },
        "n-samples": {name: {"original": original, "effective": len(scored)}},
        "higher_is_better": {name: {k: True for k in aggregate}},
        "config": config,
        "skipped": {
            "count": len(failed),
            "unanswered": unanswered,
            "rows": [{"id": f.id, "path": f.path, "reason": f.reason} for f in failed],
        },
        "deviations": prepared.deviations,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


def _follows(prepared: Prepared) -> dict:
    """The protocol's reference scorer, as the results record it."""
    variant = prepared.benchmark.variants[prepared.protocol.variant]
    return {
        "variant": prepared.protocol.variant,
        "follows": variant.follows,
        "parser": variant.parser,
        "denominator": variant.denominator,
        "metric": variant.metric,
        "same_denominator": prepared.protocol.metric == variant.metric,
    }


def sample_records(scored: list[Scored], metric: str) -> list[dict]:
    """One lmms-eval-like record per scored row."""
    return [
        {
            "doc_id": i,
            "id": s.row["id"],
            "task": s.row.get("task"),
            "target": s.row["answer"],
            "input": s.row.get("benchmark_prompt"),
            "resps": [s.responses],
            "filtered_resps": [s.parsed],
            metric: s.score,
        }
        for i, s in enumerate(scored)
    ]


def write(out: Path, summary: dict, scored: list[Scored], metric: str) -> Path:
    """``out/results.json`` and ``out/samples_<task>.jsonl``; returns the results path."""
    name = next(iter(summary["results"]))
    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.json"
    path.write_text(json.dumps(summary, indent=2, default=str))
    lines = [json.dumps(r, ensure_ascii=False, default=str) for r in sample_records(scored, metric)]
    (out / f"samples_{name}.jsonl").write_text("".join(line + "\n" for line in lines))
    return path
