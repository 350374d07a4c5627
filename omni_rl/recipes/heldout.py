"""Evaluation during training: the ``data.eval`` sets, every ``trainer.eval_every``
steps and at the end, with the metrics logged beside the training ones and the best
model kept when ``trainer.best_metric`` is set.

Each rank answers its share of every set's rows; rank 0 scores, logs and writes
``OUTPUT_DIR/eval/NAME/step-N/results.json`` (benchmarks: lmms-eval's layout).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from omni_rl.benchmarks.base import spread
from omni_rl.data.config import EvalSetConfig
from omni_rl.engine import checkpoint, distributed
from omni_rl.preprocess.cache import atomic_write_bytes
from omni_rl.rollout.hf import SamplingParams

log = logging.getLogger(__name__)


@dataclass
class _Set:
    spec: EvalSetConfig
    dataset: object
    prepared: object = None  # a benchmark's rows and protocol (omni_rl.benchmarks.run.Prepared)


class HeldOut:
    """The eval sets of a run, loaded (and checked) before training starts."""

    def __init__(self, cfg, out: Path, family: str):
        from omni_rl.data.dataset import MediaDataset
        from omni_rl.preprocess.pipeline import Budgets

        self.cfg, self.out = cfg, out
        self.best = self._read_best()
        self.sets: list[_Set] = []
        for spec in cfg.data.eval:
            if spec.benchmark is None:
                budgets = Budgets.from_config(cfg.media)
                data = cfg.data
                dataset = MediaDataset(
                    spec.data, budgets, data.cache, data.cache_mode, data.strict, data.prompt_template, data.columns
                )
                self.sets.append(_Set(spec, dataset))
            else:
                self.sets.append(self._benchmark(spec, family))
        for s in self.sets:
            if s.prepared is None:
                s.dataset.rows = spread(s.dataset.rows, s.spec.limit)
            log.info("eval set %s: %d rows (%s)", s.spec.name, len(s.dataset.rows), s.spec.data)

    def _benchmark(self, spec: EvalSetConfig, family: str) -> _Set:
        from omni_rl.benchmarks import run
        from omni_rl.data.dataset import MediaDataset
        from omni_rl.preprocess.config import MediaConfig
        from omni_rl.preprocess.pipeline import Budgets, preprocess

        ranks = distributed.ranks()
        where = self.out / "eval" / spec.name
        if ranks.is_main:
            prepared = run.prepare(spec.benchmark, spec.data, where, spec.protocol, limit=spec.limit)
        distributed.barrier()
        if not ranks.is_main:  # the same rows, from the file rank 0 wrote
            prepared = run.prepare(spec.benchmark, spec.data, where, spec.protocol, write=False, limit=spec.limit)
        media = MediaConfig(**prepared.protocol.media(family), media_root=str(prepared.root))
        budgets, cache = Budgets.from_config(media), self.cfg.data.cache
        if cache is not None and ranks.is_main:  # the preset's media, decoded once for every evaluation
            preprocess(prepared.rows_file, cache, budgets)
        distributed.barrier()
        dataset = MediaDataset(prepared.rows_file, budgets, cache, prompt_template="{benchmark_prompt}")
        return _Set(spec, dataset, prepared)

    @classmethod
    def for_run(cls, cfg, out: Path) -> HeldOut:
        """The run's eval sets, for its model's family (read before the model is built)."""
        from omni_rl.models import family_of

        return cls(cfg, out, family_of(cfg.model.path).name if cfg.model.path else cfg.model.tiny_family)

    def datasets(self) -> dict:
        """Each set's dataset, by ``eval/NAME`` (for the run's summary)."""
        return {f"eval/{s.spec.name}": s.dataset for s in self.sets}

    def due(self, step: int) -> bool:
        every, last = self.cfg.trainer.eval_every, self.cfg.trainer.steps
        return bool(self.sets) and (step == last or (every > 0 and step % every == 0))

    def add_to(self, row: dict, engine, processor) -> bool:
        """When due at ``row["step"]``, evaluate every set into ``row`` (with the time
        it took) and keep the best model; returns whether it ran (the row is then
        logged whatever ``trainer.log_every`` says)."""
        step = row["step"]
        if not self.due(step):
            return False
        start = time.perf_counter()
        row |= self(engine.module, processor, step)
        row["time/eval"] = time.perf_counter() - start
        self.keep_best(row, step, engine, processor)
        return True

    def __call__(self, model, processor, step: int) -> dict:
        """Every set's metrics at ``step`` as ``eval/NAME/METRIC`` (the same on every rank)."""
        metrics: dict = {}
        was_training = model.training
        model.eval()
        for s in self.sets:
            metrics |= {f"eval/{s.spec.name}/{k}": v for k, v in self._evaluate(s, model, processor, step).items()}
        model.train(was_training)
        return metrics

    def _evaluate(self, s: _Set, model, processor, step: int) -> dict:
        from omni_rl.evaluate import generate_answers

        ranks = distributed.ranks()
        if s.prepared is not None:
            protocol = s.prepared.protocol
            samples = protocol.samples
            sampling = SamplingParams(protocol.temperature, max_new_tokens=protocol.max_new_tokens)
        else:
            samples = s.spec.samples
            temperature = 0.0 if samples == 1 else self.cfg.rollout.temperature if hasattr(self.cfg, "rollout") else 1.0
            sampling = SamplingParams(temperature, max_new_tokens=s.spec.max_new_tokens)
        mine = list(range(ranks.rank, len(s.dataset), ranks.world_size))
        with torch.no_grad():
            answered, failures = generate_answers(
                model, processor, s.dataset, sampling, samples, mine, s.spec.batch_prompts, progress=False
            )
        answered = distributed.gather_objects([(sample.id, texts) for sample, texts in answered])
        failures = distributed.gather_objects(failures)
        if s.prepared is not None:
            return self._score_benchmark(s, dict(answered), failures, step)
        return self._score_rows(s, dict(answered), failures, step)

    def _score_benchmark(self, s: _Set, answers: dict, failures: list, step: int) -> dict:
        from omni_rl.benchmarks import run

        scored = run.score(s.prepared, answers)
        summary = run.results(s.prepared, scored, failures, {"step": step, "overrides": s.spec.protocol})
        if distributed.ranks().is_main:
            where = self.out / "eval" / s.spec.name / f"step-{step}"
            where.mkdir(parents=True, exist_ok=True)
            run.write(where, summary, scored, s.prepared.protocol.metric)
        scores = summary["results"][s.prepared.benchmark.name]
        return {k.removesuffix(",none"): v for k, v in scores.items() if k != "alias"} | {
            "skipped": summary["skipped"]["count"]
        }

    def _score_rows(self, s: _Set, answers: dict, failures: list, step: int) -> dict:
        from omni_rl.evaluate import summarize
        from omni_rl.rewards import Target, score_batch

        rows = [r for r in s.dataset.rows if r.id in answers]
        flat = [(row, text) for row in rows for text in answers[row.id]]
        results = score_batch(
            [row.problem_type for row, _ in flat],
            [text for _, text in flat],
            [Target(row.answer, row.fields.get("options"), row.fields) for row, _ in flat],
            self.cfg.rewards.settings() if hasattr(self.cfg, "rewards") else None,
        )
        best: dict[str, tuple] = {}
        for (row, _), result in zip(flat, results, strict=True):
            source = row.fields.get("data_source") or "unknown"
            if row.id not in best or result.accuracy > best[row.id][2]:
                best[row.id] = (row.problem_type, source, result.accuracy)
        skipped = len(failures) + len(s.dataset.failures)  # unreadable media, and rows refused at load
        summary = summarize(list(best.values()), s.spec.samples) | {"skipped_rows": skipped, "step": step}
        if distributed.ranks().is_main:
            where = self.out / "eval" / s.spec.name / f"step-{step}"
            where.mkdir(parents=True, exist_ok=True)
            (where / "results.json").write_text(json.dumps(summary, indent=2))
        flat_metrics = {"accuracy": summary["accuracy"], "rows": summary["rows"], "skipped": skipped}
        return flat_metrics | {f"accuracy/{k}": v for k, v in summary["per_type"].items()}

    # ------------------------------------------------------------------ best model

    def _read_best(self) -> dict | None:
        if distributed.ranks().is_main:
            checkpoint.restore_interrupted(self.out / "best" / "model")
        path = self.out / "best" / "best.json"
        return json.loads(path.read_text()) if path.is_file() else None

    def keep_best(self, metrics: dict, step: int, engine, processor) -> None:
        """Export the model to ``OUTPUT_DIR/best/model`` when ``trainer.best_metric``
        improved (every rank calls this: the export gathers sharded weights). The export
        is renamed into place whole, then ``best.json``: a run killed mid-export keeps
        the previous best model."""
        name = self.cfg.trainer.best_metric
        if name is None or name not in metrics:
            if name is not None:
                log.warning("trainer.best_metric %s is not among the eval metrics %s", name, sorted(metrics))
            return
        value = metrics[name]
        if self.best is not None and value <= self.best["value"]:
            return
        directory = self.out / "best" / "model"
        checkpoint.export_model(engine, directory, processor)
        self.best = {"metric": name, "value": value, "step": step}
        if distributed.ranks().is_main:
            atomic_write_bytes(self.out / "best" / "best.json", json.dumps(self.best).encode())
            log.info("best %s = %.4f at step %d: %s", name, value, step, directory)
