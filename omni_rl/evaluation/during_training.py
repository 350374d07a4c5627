"""Evaluation during training: the ``data.eval`` sets, every ``trainer.eval_every``
steps and at the end, with the metrics logged beside the training ones and the best
model kept when ``trainer.best_metric`` is set.

Each rank answers its share of every set's rows; rank 0 scores, logs and writes
``OUTPUT_DIR/eval/NAME/step-N/results.json`` (benchmarks: lmms-eval's layout). The
recipe passes what differs between recipes: the reward settings and how pass@K rows
sets sample (GRPO: as its rollouts do).
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from omni_rl.benchmarks.base import spread
from omni_rl.data.config import EvalSetConfig
from omni_rl.data.dataset import MediaDataset
from omni_rl.engine import checkpoint, distributed
from omni_rl.evaluation import benchmark
from omni_rl.evaluation.benchmark import Prepared
from omni_rl.evaluation.pipeline import answer_benchmark, evaluate_benchmark, evaluate_rows
from omni_rl.evaluation.summary import benchmark_metrics
from omni_rl.preprocess.cache import atomic_write_bytes
from omni_rl.preprocess.pipeline import Budgets
from omni_rl.rewards import RewardSettings
from omni_rl.rollout.hf import SamplingParams

log = logging.getLogger(__name__)


@dataclass
class _Set:
    spec: EvalSetConfig
    dataset: MediaDataset
    prepared: Prepared | None = None  # a benchmark's rows and protocol; None: rows


class HeldOut:
    """The eval sets of a run, loaded (and checked) before training starts.

    Args:
        cfg: the run's config; its ``data``, ``media``, ``model`` and ``trainer``
            sections are read.
        out: the run's output directory.
        family: the model family, whose media defaults a benchmark's protocol uses.
        settings: the reward settings rows sets are scored with (None: the defaults).
        sampling: the answer length of rows sets that set none, and the temperature,
            top-p and top-k of those with ``samples`` > 1 (GRPO: its rollout section's;
            None: 64 tokens, temperature 1, no filter).
        inputs: the dtype of the cached model inputs rows sets read (None: none;
            ``omni_rl.data.dataset.MediaDataset``).
    """

    def __init__(
        self,
        cfg,
        out: Path,
        family: str,
        settings: RewardSettings | None = None,
        sampling: SamplingParams | None = None,
        inputs: str | None = None,
    ):
        self.cfg, self.out, self.inputs = cfg, out, inputs
        self.settings, self.sampling = settings, sampling or SamplingParams(max_new_tokens=64)
        self.best = self._read_best()
        self.sets = [self._benchmark(spec, family) if spec.benchmark else self._rows(spec) for spec in cfg.data.eval]
        for s in self.sets:
            log.info("eval set %s: %d rows (%s)", s.spec.name, len(s.dataset.rows), s.spec.data)

    def _rows(self, spec: EvalSetConfig) -> _Set:
        data = self.cfg.data
        budgets = Budgets.from_config(self.cfg.media)
        dataset = MediaDataset(
            spec.data,
            budgets,
            data.cache,
            data.cache_mode,
            data.strict,
            data.prompt_template,
            data.columns,
            inputs=self.inputs,
        )
        dataset.use_only(spread(dataset.rows, spec.limit))
        return _Set(spec, dataset)

    def _benchmark(self, spec: EvalSetConfig, family: str) -> _Set:
        where = self.out / "eval" / spec.name
        prepared = benchmark.prepare_on_every_rank(spec.benchmark, spec.data, where, spec.protocol, spec.limit)
        # the preset's media, decoded into the cache once for every evaluation
        dataset, _ = benchmark.media_dataset(prepared, family, self.cfg.data.cache)
        return _Set(spec, dataset, prepared)

    @classmethod
    def for_run(
        cls,
        cfg,
        out: Path,
        settings: RewardSettings | None = None,
        sampling: SamplingParams | None = None,
        inputs: str | None = None,
    ) -> HeldOut:
        """The run's eval sets, for its model's family (read before the model is built);
        ``inputs``: the dtype of the cached model inputs the run reads (None: none)."""
        return cls(cfg, out, cfg.model.family(), settings, sampling, inputs)

    def datasets(self) -> dict:
        """Each set's dataset, by ``eval/NAME`` (for the run's summary)."""
        return {f"eval/{s.spec.name}": s.dataset for s in self.sets}

    def due(self, step: int) -> bool:
        every, last = self.cfg.trainer.eval_every, self.cfg.trainer.steps
        return bool(self.sets) and (step == last or (every > 0 and step % every == 0))

    def add_to(self, row: dict, engine, processor) -> bool:
        """When due at ``row["step"]``, evaluate every set into ``row`` (with the time
        it took) and keep the best model; returns whether it ran (the row is then
        logged whatever ``trainer.log_every`` says). Under FSDP2 the weights the
        evaluation gathered are freed before the best model's export (whose state dict
        leaves the modules sharded: FSDP2 reshards before every ``state_dict``), so the
        next rollout starts from sharded weights."""
        step = row["step"]
        if not self.due(step):
            return False
        start = time.perf_counter()
        row |= self(engine.module, processor, step)
        engine.reshard()  # blocks keep gathered weights after a forward until step(): free them now
        row["time/eval"] = time.perf_counter() - start
        self.keep_best(row, step, engine, processor)
        return True

    def __call__(self, model, processor, step: int) -> dict:
        """Every set's metrics at ``step`` as ``eval/NAME/METRIC`` (the same on every rank)."""
        metrics: dict = {}
        was_training = model.training
        model.eval()
        for s in self.sets:
            evaluate = self._evaluate_rows if s.prepared is None else self._evaluate_benchmark
            metrics |= {f"eval/{s.spec.name}/{k}": v for k, v in evaluate(s, model, processor, step).items()}
        model.train(was_training)
        return metrics

    def _results_dir(self, s: _Set, step: int) -> Path:
        return self.out / "eval" / s.spec.name / f"step-{step}"

    def _evaluate_benchmark(self, s: _Set, model, processor, step: int) -> dict:
        answers, failures = answer_benchmark(s.prepared, s.dataset, model, processor, s.spec.batch_prompts, False)
        config = {"step": step, "overrides": s.spec.protocol}
        summary, scored = evaluate_benchmark(s.prepared, answers, failures, config)
        if distributed.ranks().is_main:
            benchmark.write(self._results_dir(s, step), summary, scored, s.prepared.protocol.metric)
        return benchmark_metrics(summary)

    def _evaluate_rows(self, s: _Set, model, processor, step: int) -> dict:
        spec = s.spec
        summary = evaluate_rows(
            model,
            processor,
            s.dataset,
            spec.samples,
            spec.max_new_tokens or self.sampling.max_new_tokens,
            temperature=self.sampling.temperature,
            top_p=self.sampling.top_p,
            top_k=self.sampling.top_k,
            batch_prompts=spec.batch_prompts,
            settings=self.settings,
            progress=False,
        )
        # training's results count every row not scored as skipped: unreadable media and rows refused at load
        skipped = summary.pop("skipped_rows") + summary.pop("refused_rows")
        del summary["rows_read"]
        summary |= {"skipped_rows": skipped, "step": step}
        if distributed.ranks().is_main:
            where = self._results_dir(s, step)
            where.mkdir(parents=True, exist_ok=True)
            (where / "results.json").write_text(json.dumps(summary, indent=2))
        flat_metrics = {"accuracy": summary["accuracy"], "rows": summary["rows"], "skipped": skipped}
        if "sampled_accuracy" in summary:
            flat_metrics["sampled_accuracy"] = summary["sampled_accuracy"]
        return (
            flat_metrics
            | {f"accuracy/{k}": v for k, v in summary["per_type"].items()}
            | {f"accuracy/source/{k}": v for k, v in summary["per_source"].items()}
        )

    # ------------------------------------------------------------------ best model

    def _read_best(self) -> dict | None:
        if distributed.ranks().is_main:
            checkpoint.restore_interrupted(self.out / "best" / "model")
        path = self.out / "best" / "best.json"
        return json.loads(path.read_text()) if path.is_file() else None

    def forget_after(self, step: int) -> None:
        """Resuming from the checkpoint of ``step``: a best model exported after it came
        from the steps the resumed run trains again (their metrics rows are dropped too),
        so it is removed. Its export replaced any earlier best's weights, so the best is
        chosen again from the evaluations to come."""
        if self.best is None or self.best["step"] <= step:
            return
        log.warning(
            "best/model is the %s of step %d, after the checkpoint of step %d this run resumes from: "
            "it is removed, and the best is chosen again from the evaluations after step %d",
            self.best["metric"],
            self.best["step"],
            step,
            step,
        )
        if distributed.ranks().is_main:
            shutil.rmtree(self.out / "best")
        self.best = None

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
