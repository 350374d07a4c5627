"""Answer, score, summarize: the one path of every evaluation, on rows (``omni-rl
eval``, a rows set of ``data.eval``) and on a benchmark preset (``omni-rl eval
--benchmark``, a preset of ``data.eval``). Under torchrun each rank answers its share
of the rows and every rank gets the same scores."""

from __future__ import annotations

from omni_rl.benchmarks.base import Scored
from omni_rl.data.dataset import MediaDataset
from omni_rl.errors import RowFailure
from omni_rl.evaluation.answer import answer_rows, gathered, my_share
from omni_rl.evaluation.benchmark import Prepared, results
from omni_rl.evaluation.score import score_benchmark, score_rows
from omni_rl.evaluation.summary import summarize
from omni_rl.rewards import RewardSettings
from omni_rl.rollout.hf import SamplingParams


def evaluate_rows(
    model,
    processor,
    dataset: MediaDataset,
    samples: int = 1,
    max_new_tokens: int = 64,
    temperature: float = 1.0,
    batch_prompts: int = 8,
    settings: RewardSettings | None = None,
    progress: bool = True,
    top_p: float = 1.0,
    top_k: int = 0,
) -> dict:
    """Score ``samples`` completions per row (greedy when 1, else sampled at
    ``temperature``, ``top_p`` and ``top_k``, as training's rollouts are); a row's
    accuracy is its best completion's (pass@k for k > 1).

    Returns ``summarize``'s summary (accuracy, per_type, per_source, rows, ...) with
    row_accuracy ({row id: accuracy}), answers ({row id: its completions}), rows_read,
    refused_rows (when the dataset loaded) and skipped_rows (media that did not decode)."""
    sampling = (
        SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens)
        if samples == 1
        else SamplingParams(temperature, top_p, top_k, max_new_tokens)
    )
    answered, failures = answer_rows(
        model, processor, dataset, sampling, samples, my_share(dataset), batch_prompts, progress
    )
    answers, fields, failures = gathered(answered, failures)
    scored = score_rows(dataset.rows, answers, fields, settings)
    ids = [row.id for row in dataset.rows if row.id in answers]  # score_rows' order
    # rows read = scored + refused when the dataset loaded + skipped while reading media
    return {
        **summarize(scored, samples),
        "row_accuracy": {row_id: best for row_id, (_, _, best, _) in zip(ids, scored, strict=True)},
        "answers": {row_id: answers[row_id] for row_id in ids},
        "rows_read": dataset.read,
        "refused_rows": len(dataset.failures),
        "skipped_rows": len(failures),
    }


def answer_benchmark(
    prepared: Prepared, dataset: MediaDataset, model, processor, batch_prompts: int = 8, progress: bool = True
) -> tuple[dict[str, list[str]], list[RowFailure]]:
    """{row id: responses} from the model under the protocol (its temperature, answer
    length and samples), and the rows whose media could not be read."""
    protocol = prepared.protocol
    sampling = SamplingParams(temperature=protocol.temperature, max_new_tokens=protocol.max_new_tokens)
    answered, failures = answer_rows(
        model, processor, dataset, sampling, protocol.samples, my_share(dataset), batch_prompts, progress
    )
    answers, _, failures = gathered(answered, failures)
    return answers, failures


def evaluate_benchmark(
    prepared: Prepared, answers: dict[str, list[str]], failures: list[RowFailure], config: dict
) -> tuple[dict, list[Scored]]:
    """``answers`` ({row id: responses}, from ``answer_benchmark`` or a predictions
    file) scored by the preset, and the results in lmms-eval's layout (``config``
    recorded in them) with the scored rows."""
    scored = score_benchmark(prepared, answers)
    return results(prepared, scored, failures, config), scored
