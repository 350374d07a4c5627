"""Completions for rows of a dataset: this rank's share, in batches, every rank running
as many batches as the busiest one (sharded forwards run in step)."""

from __future__ import annotations

import torch
from tqdm import tqdm

from omni_rl.data.dataset import MediaDataset, Sample
from omni_rl.engine import distributed
from omni_rl.errors import OmniRLError, RowFailure
from omni_rl.rollout import prompt_seed
from omni_rl.rollout.hf import HFRolloutEngine, SamplingParams


def answer_rows(
    model,
    processor,
    dataset: MediaDataset,
    sampling: SamplingParams,
    samples: int = 1,
    indices: list[int] | None = None,
    batch_prompts: int = 8,
    progress: bool = True,
    engine=None,
    seed: int = 0,
) -> tuple[list[tuple[Sample, list[str]]], list[RowFailure]]:
    """``samples`` completions for each row of ``dataset`` (or of ``indices``), and a
    failure (file, row, reason) for every bad row: media that do not decode, a prompt
    that does not encode, a row the config says to skip (``MediaDataset.encoded``
    reports each once and counts it; ``data.strict`` makes the first an error).

    Args:
        sampling: greedy (temperature 0) or sampled, and the longest answer.
        indices: the rows to answer (under torchrun: this rank's share); None: all.
        batch_prompts: prompts generated together (one left-padded batch).
        engine: a rollout engine (``omni_rl.rollout``, loaded with the model's weights)
            that answers instead of the model itself (vLLM); None: the hf engine on
            ``model``. Each row is sampled with its own seed, from ``seed`` and the
            row's index (``prompt_seed``), so its answers do not depend on the rank or
            batch it falls in, and a rerun with the same seed repeats them.

    Returns:
        ``(sample, its samples completions)`` per answered row in ``indices`` order,
        and the bad rows' failures.

    Under torchrun a rank short of batches answers filler batches (``lockstep``), and a
    batch of bad rows answers a usable row instead; their answers are dropped."""
    engine = HFRolloutEngine(model, processor) if engine is None else engine
    indices = list(range(len(dataset))) if indices is None else indices
    batches = [indices[s : s + batch_prompts] for s in range(0, len(indices), batch_prompts)]
    synced = distributed.ranks().distributed
    answered, failures = [], []
    work = distributed.lockstep(batches, filler=lambda: [usable_row(dataset, processor)])
    for batch, real in tqdm(work, desc="eval", unit="batch", disable=not progress):
        rows, encoded, asked = [], [], []
        for i in batch:
            got = dataset.encoded(i, processor)
            if got is None:
                failures.append(dataset.bad[dataset.rows[i].id])
                continue
            rows.append(got[0])
            encoded.append(got[1])
            asked.append(i)
        prompts = rows
        if not encoded and synced:  # the other ranks generate now: so does this one (answers dropped)
            asked = [usable_row(dataset, processor)]
            filler, inputs = dataset.encoded(asked[0], processor)
            prompts, encoded = [filler], [inputs]
        if not encoded:
            continue
        with torch.no_grad():
            seeds = [prompt_seed(seed, i, samples) for i in asked]
            texts = engine.rollout(prompts, encoded, samples, sampling, seeds).texts
        if real:
            answered += [(s, texts[i * samples : (i + 1) * samples]) for i, s in enumerate(rows)]
    return answered, failures


def usable_row(dataset: MediaDataset, processor) -> int:
    """The index of the first row that encodes (a filler's prompt)."""
    for i in range(len(dataset)):
        if dataset.encoded(i, processor) is not None:
            return i
    raise OmniRLError(f"{dataset.data}: no row of the eval set can be used")


def my_share(dataset: MediaDataset) -> list[int]:
    """The row indices this rank answers: every ``world_size``-th, from its rank."""
    where = distributed.ranks()
    return list(range(where.rank, len(dataset), where.world_size))


def gathered(
    answered: list[tuple[Sample, list[str]]], failures: list[RowFailure]
) -> tuple[dict, dict, list[RowFailure]]:
    """Every rank's answers as {row id: completions}, the fields each answered row is
    scored with ({row id: its sample's fields}: the row's, and what its media added,
    such as the image sizes a box converts with, as in training), and every rank's
    failures (the samples' decoded media stay on their rank)."""
    everyone = distributed.gather_objects([(sample.id, texts, sample.fields) for sample, texts in answered])
    answers = {row_id: texts for row_id, texts, _ in everyone}
    fields = {row_id: row_fields for row_id, _, row_fields in everyone}
    return answers, fields, distributed.gather_objects(failures)
