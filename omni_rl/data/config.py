"""The data section (``data:``): the training rows and how they become prompts."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

from omni_rl.config import ModeDefaults, require, require_unset


@dataclass
class EvalSetConfig:
    """One held-out set evaluated during training: omni_rl rows, or a benchmark preset
    run with its protocol (``omni_rl.evaluation.during_training`` evaluates them, on the
    path of ``omni-rl eval``). The YAML key is ``data.eval``; its checks ask the
    benchmark registry, a lower layer."""

    data: str = ""
    """A JSONL/Parquet file of rows, or (with ``benchmark``) the benchmark's directory."""
    benchmark: str | None = None
    """A preset of ``omni-rl eval --benchmark`` (a name in ``omni_rl.benchmarks.BENCHMARKS``); unset: rows."""
    name: str = ""
    """The metrics' prefix (``eval/NAME/...``); default: the preset's name or the file's stem."""
    protocol: dict[str, Any] = field(default_factory=dict)
    """Protocol overrides of the preset (nframes, max_new_tokens, ...)."""
    samples: int = 1
    """Rows: completions per row (1: greedy; K: pass@K at rollout temperature, and the
    accuracy of one sampled answer as ``sampled_accuracy``). List a file twice, greedy
    and sampled, to watch the two part."""
    max_new_tokens: int | None = None
    """Rows: the longest answer (default: GRPO's ``rollout.max_new_tokens``, what its
    rollouts answer with; SFT's 64)."""
    limit: int = 0
    """Evaluate this many rows, spread evenly over the set (and a benchmark's tasks);
    0: all."""
    batch_prompts: int = 8
    """Prompts answered together; each rank prefills them at once (a 7B model on long
    videos wants 1 or 2: a prompt of the 7B configs' 128 frames, 64 temporal patches,
    is about 20k tokens)."""

    def __post_init__(self):
        require(bool(self.data), "data", "name the rows file or the benchmark's directory")
        require(self.samples >= 1, "samples", "must be >= 1")
        require(self.limit >= 0, "limit", "must be >= 0")
        require(self.batch_prompts >= 1, "batch_prompts", "must be >= 1")
        require(self.max_new_tokens is None or self.max_new_tokens >= 1, "max_new_tokens", "must be >= 1")
        if self.benchmark is not None:
            from omni_rl.benchmarks import BENCHMARKS

            require(self.benchmark in BENCHMARKS, "benchmark", f"known presets: {', '.join(BENCHMARKS.names())}")
            BENCHMARKS.get(self.benchmark).protocol.overridden(self.protocol)
            require(self.samples == 1, "samples", "rows only: a benchmark preset answers by its protocol")
            require(
                self.max_new_tokens is None,
                "max_new_tokens",
                "rows only: a benchmark preset's is protocol.max_new_tokens",
            )
        else:
            require(not self.protocol, "protocol", "applies to a benchmark preset only")
        if not self.name:
            self.name = self.benchmark or Path(self.data).stem


@dataclass
class SamplerConfig(ModeDefaults):
    """How training prompts are drawn (``data.sampler``): ``uniform`` visits the rows in
    seeded epochs; ``ucb`` picks each prompt's ``data_source`` by how much that source
    still teaches (DUMP's upper confidence bound over recent absolute advantages), then
    a row of it. The UCB fields are refused under ``uniform``."""

    UNSET: ClassVar[dict[str, Any]] = {"window": 300, "c": 1.0, "temperature": 0.1}

    type: Literal["uniform", "ucb"] = "uniform"
    """``uniform`` or ``ucb`` (GRPO only: it learns from the step's advantages)."""
    window: int | None = None
    """UCB: the last this many absolute advantages of each source (one per completion);
    unset: 300."""
    c: float | None = None
    """UCB: weight of the exploration bonus sqrt(2 ln(N + 1) / (n_source + 1)); unset: 1."""
    temperature: float | None = None
    """UCB: sampling probabilities are softmax(score / temperature) over the sources;
    unset: 0.1."""

    def __post_init__(self):
        if self.type == "uniform":
            require_unset({"window": self.window, "c": self.c, "temperature": self.temperature}, "type: uniform")
        require(self.setting("window") >= 1, "window", "must be >= 1")
        require(self.setting("c") >= 0, "c", "must be >= 0")
        require(self.setting("temperature") > 0, "temperature", "must be > 0")


@dataclass
class DataConfig:
    """The training (and evaluation) rows and how they become prompts."""

    train: str = ""
    """A JSONL or Parquet dataset (media paths relative to its folder)."""
    eval: list[EvalSetConfig] = field(default_factory=list)
    """Held-out sets evaluated every ``trainer.eval_every`` steps and at the end (rows
    or benchmark presets, by ``omni_rl.evaluation``); each logs ``eval/NAME/METRIC``
    beside the training metrics."""
    cache: str | None = None
    """A cache made by ``omni-rl preprocess`` with the same media settings."""
    cache_mode: Literal["prefer_cache", "cache_only", "no_cache"] = "prefer_cache"
    """How the cache is used (see omni_rl.data.dataset)."""
    cache_inputs: bool = True
    """Read each row's model inputs (the processor's output: token ids, pixel patches,
    audio features) from the cache, where ``omni-rl preprocess`` with this config wrote
    them, instead of running the processor on every read; media features are stored in
    bf16 for a run that computes in bf16, which rounds them so anyway (exact). A row
    without its entry is encoded from its media and counted in ``data/inputs_misses``.
    false: the processor runs on every read."""
    prompt_template: str = "{problem}{options}"
    """The question shown to the model; fields: {problem}, {options} and any row field."""
    prompts_per_step: int = 4
    """Prompts sampled per step (each gets rollout.n completions)."""
    balance_tolerance: float | None = 0.05
    """Under several processes, each step's rows are dealt to ranks by their prompt
    tokens (media included): rows are swapped between ranks, each rank keeping its
    count, until the rank with the most tokens is within this fraction of the mean; a
    row that moves is encoded again on its new rank (``balance/moved_rows``). null: each
    rank keeps the slice of the draw it encoded (``balance/*`` still log the imbalance)."""
    shuffle: bool = True
    """Visit the rows in a seeded random order, reshuffled every epoch (under the UCB
    sampler: each source's rows)."""
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    """How prompts are drawn: uniform epochs, or a curriculum over ``data_source``."""
    strict: bool = False
    """A row that cannot be used is an error instead of a reported skip: at load (schema,
    answer, media paths, a key that looks misspelt, a row preprocess could not cache)
    and when it is read (media that do not decode, a prompt that does not encode)."""
    columns: dict[str, str] = field(default_factory=dict)
    """The dataset's own keys renamed to the row schema's, e.g. {question: problem,
    video: videos}; applies to data.train, data.eval rows and preprocess --config."""

    def __post_init__(self):
        require(self.prompts_per_step >= 1, "prompts_per_step", "must be >= 1")
        require(self.balance_tolerance is None or self.balance_tolerance >= 0, "balance_tolerance", "must be >= 0")
        names = [e.name for e in self.eval]
        require(len(names) == len(set(names)), "eval", f"two eval sets share a name ({names}); set name:")


def check_eval(data: DataConfig, trainer) -> None:
    """``trainer.best_metric`` must name one of ``data.eval``'s sets."""
    best = trainer.best_metric
    if best is None:
        return
    names = [e.name for e in data.eval]
    name = best.split("/")[1] if best.count("/") >= 2 else ""
    require(
        name in names,
        "trainer.best_metric",
        f"'{best}' names no eval set; data.eval has {names or 'none'} (eval/NAME/METRIC)",
    )
