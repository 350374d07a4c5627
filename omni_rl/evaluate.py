"""Evaluation of a checkpoint on a dataset: accuracy overall, per problem type and per
data source; greedy (one sample) or pass@k over k samples."""

from __future__ import annotations

import json
from collections import defaultdict

import torch
from tqdm import tqdm

from omni_rl.data.dataset import MediaDataset, Sample
from omni_rl.engine import distributed
from omni_rl.errors import OmniRLError
from omni_rl.models.inputs import collate_prompts
from omni_rl.preprocess.rows import RowFailure
from omni_rl.rewards import RewardSettings, Target, score_batch
from omni_rl.rollout.hf import HFRolloutEngine, SamplingParams


def generate_answers(
    model,
    processor,
    dataset: MediaDataset,
    sampling: SamplingParams,
    samples: int = 1,
    indices: list[int] | None = None,
    batch_prompts: int = 8,
    progress: bool = True,
) -> tuple[list[tuple[Sample, list[str]]], list[RowFailure]]:
    """``samples`` completions for each row of ``dataset`` (or of ``indices``, this
    rank's share under torchrun), and a failure (file, row, reason) for every bad row:
    media that do not decode, a prompt that does not encode, a row the config says to
    skip (``MediaDataset.encoded`` reports each once and counts it; ``data.strict``
    makes the first an error).

    Under torchrun every rank runs as many batches as the busiest one (sharded forwards
    run in step): a rank with nothing left answers a copy of an earlier batch and
    drops the answers."""
    engine = HFRolloutEngine(model, processor)
    pad = processor.tokenizer.pad_token_id
    indices = list(range(len(dataset))) if indices is None else indices
    batches = [indices[s : s + batch_prompts] for s in range(0, len(indices), batch_prompts)]
    synced = distributed.ranks().distributed
    rounds = distributed.all_max(len(batches)) if synced else len(batches)
    answered, failures, filler = [], [], None
    for k in tqdm(range(rounds), desc="eval", unit="batch", disable=not progress):
        rows, encoded = [], []
        for i in batches[k] if k < len(batches) else []:
            got = dataset.encoded(i, processor)
            if got is None:
                failures.append(dataset.bad[dataset.rows[i].id])
                continue
            rows.append(got[0])
            encoded.append(got[1])
        if rows:
            inputs = filler = collate_prompts(encoded, pad)
        elif synced:
            inputs = filler if filler is not None else _any_prompt(dataset, processor)
        else:
            continue
        with torch.no_grad():
            texts = engine.generate(inputs, samples, sampling).texts
        answered += [(s, texts[i * samples : (i + 1) * samples]) for i, s in enumerate(rows)]
    return answered, failures


def _any_prompt(dataset: MediaDataset, processor) -> dict:
    """The inputs of the first usable row (a filler batch)."""
    for i in range(len(dataset)):
        got = dataset.encoded(i, processor)
        if got is not None:
            return collate_prompts([got[1]], processor.tokenizer.pad_token_id)
    raise OmniRLError(f"{dataset.data}: no row of the eval set can be used")


def evaluate(
    model,
    processor,
    dataset: MediaDataset,
    samples: int = 1,
    max_new_tokens: int = 64,
    temperature: float = 1.0,
    batch_prompts: int = 8,
    settings: RewardSettings | None = None,
    progress: bool = True,
) -> dict:
    """Score ``samples`` completions per row (greedy when 1); a row's accuracy is its
    best completion's (pass@k for k > 1). Returns accuracy, per_type, per_source, rows."""
    sampling = SamplingParams(temperature=0.0 if samples == 1 else temperature, max_new_tokens=max_new_tokens)
    answered, failures = generate_answers(
        model, processor, dataset, sampling, samples, batch_prompts=batch_prompts, progress=progress
    )
    rows = [sample for sample, _ in answered]
    texts = [text for _, group in answered for text in group]
    targets = [Target(s.answer, s.options, s.fields) for s in rows for _ in range(samples)]
    types = [s.problem_type for s in rows for _ in range(samples)]
    results = score_batch(types, texts, targets, settings)
    per_row = []
    for i, sample in enumerate(rows):
        best = max(r.accuracy for r in results[i * samples : (i + 1) * samples])
        per_row.append((sample.problem_type, sample.data_source or "unknown", best))
    # rows read = scored + refused when the dataset loaded + skipped while reading media
    return {
        **summarize(per_row, samples),
        "rows_read": dataset.read,
        "refused_rows": len(dataset.failures),
        "skipped_rows": len(failures),
    }


def summarize(per_row: list[tuple[str, str, float]], samples: int) -> dict:
    """Mean accuracy overall and grouped by problem type and data source."""
    by_type, by_source = defaultdict(list), defaultdict(list)
    for problem_type, source, accuracy in per_row:
        by_type[problem_type].append(accuracy)
        by_source[source].append(accuracy)

    def mean(values):
        return sum(values) / len(values) if values else 0.0

    return {
        "accuracy": mean([a for _, _, a in per_row]),
        "samples": samples,
        "rows": len(per_row),
        "per_type": {k: mean(v) for k, v in sorted(by_type.items())},
        "per_source": {k: mean(v) for k, v in sorted(by_source.items())},
        "count_per_type": {k: len(v) for k, v in sorted(by_type.items())},
    }


def table(summary: dict) -> str:
    """A plain-text table of an evaluation summary."""
    label = "accuracy" if summary["samples"] == 1 else f"pass@{summary['samples']}"
    lines = [f"{'problem type':<28}{'rows':>6}{label:>12}"]
    for name, value in summary["per_type"].items():
        lines.append(f"{name:<28}{summary['count_per_type'][name]:>6}{value:>12.3f}")
    lines.append(f"{'overall':<28}{summary['rows']:>6}{summary['accuracy']:>12.3f}")
    if "rows_read" in summary:
        lines.append(
            f"{summary['rows_read']} rows read: {summary['rows']} scored, {summary['refused_rows']} refused when "
            f"loading, {summary['skipped_rows']} skipped (the log says which and why)"
        )
    return "\n".join(lines)


def dumps(summary: dict) -> str:
    return json.dumps(summary, indent=2)
