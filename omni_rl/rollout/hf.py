"""Rollouts with transformers: each prompt prefilled once, its cache shared by G samples.

``model.generate(num_return_sequences=G)`` copies every prompt G times before the
prefill, so the vision/audio encoder and the language model run G times over the same
prompt. Here the prompt (all but its last token) is prefilled once per prompt, the KV
cache and multimodal RoPE offsets are repeated G times, and ``generate`` continues
from the last prompt token for all B*G sequences. The sampling distribution
(temperature, top-k, top-p, with media placeholder tokens removed) is built by our
own logits processors; the next records the log-probability of each sampled token
under exactly that distribution.

Sampling is seeded per completion, not per batch: the token at each step is the
argmax of the log-probabilities plus Gumbel noise that a counter-based hash draws
from (the prompt's seed, the completion's index in its group, the step, the token id).
That is an exact draw from the distribution, and a completion comes out the same
whatever else shares its batch, on any device: a prompt rolled out on rank 1 of 2
gets the tokens it gets in one process with the whole batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from omni_rl.engine import distributed
from omni_rl.models import placeholder_token_ids
from omni_rl.models.forward import TOKEN_ALIGNED, prefix_inputs, repeat_rope_deltas, reset_rope_deltas
from omni_rl.models.inputs import collate_prompts


@dataclass(frozen=True)
class SamplingParams:
    """How completions are sampled; temperature 0 decodes greedily."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 256


@dataclass
class Rollouts:
    """G completions per prompt, grouped: rows g*0..G-1 belong to prompt 0, and so on.

    Attributes:
        completion_ids: [N, L] right-padded with the pad id (N = B*G).
        completion_mask: [N, L], 1 on generated tokens up to and including the stop token.
        logprobs: [N, L], log-probability of each token under the sampling distribution.
        lengths: [N] completion lengths.
        finish_reasons: 'stop' (end token) or 'length' (hit max_new_tokens), per completion.
        texts: decoded completions without special tokens.
    """

    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    logprobs: torch.Tensor
    lengths: torch.Tensor
    finish_reasons: list[str]
    texts: list[str]
    group_size: int

    @property
    def truncated(self) -> torch.Tensor:
        """bool [N]: completions cut off at max_new_tokens."""
        return torch.tensor([r == "length" for r in self.finish_reasons], device=self.lengths.device)


class _RecordLogprobs(LogitsProcessor):
    """Last processor: keeps log-softmax of the final scores of the previous step and,
    once the next step shows which token was sampled, stores its log-probability."""

    def __init__(self):
        self.pending: torch.Tensor | None = None
        self.steps: list[torch.Tensor] = []

    def collect(self, sampled: torch.Tensor) -> None:
        if self.pending is not None:
            self.steps.append(self.pending.gather(-1, sampled[:, None]).squeeze(-1))
            self.pending = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.pending is not None:
            self.collect(input_ids[:, -1])
        self.pending = torch.log_softmax(scores.float(), dim=-1)
        return scores


MASK32 = 0xFFFFFFFF


def hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mix of each element (int64 tensors; the result is in [0, 2^32)).
    Products stay below 2^63, so int64 arithmetic is exact on every device."""
    x = x & MASK32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & MASK32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & MASK32
    return (x >> 16) ^ x


def gumbel_noise(row_seeds: torch.Tensor, step: int, vocab: int) -> torch.Tensor:
    """Standard Gumbel noise [N, V], a pure function of each row's seed, the decoding
    step and the token id. row_seeds: [N] int64."""
    row = hash32(hash32(row_seeds) ^ step)
    tokens = hash32(torch.arange(vocab, device=row_seeds.device, dtype=torch.int64) * 2 + 1)
    bits = hash32(row[:, None] ^ tokens[None, :])
    uniform = (bits.double() + 0.5) / 2.0**32
    return -torch.log(-torch.log(uniform)).float()


def completion_seeds(prompt_seeds: list[int], n: int, device) -> torch.Tensor:
    """[B*G] seeds of the G completions of each prompt (grouped prompt by prompt)."""
    seeds = torch.tensor(prompt_seeds, dtype=torch.int64, device=device) & MASK32
    return hash32(seeds.repeat_interleave(n) * 1_000_003 + torch.arange(n, device=device).repeat(len(prompt_seeds)))


class _GumbelSample(LogitsProcessor):
    """After the recorder: adds each row's seeded Gumbel noise, so that the argmax that
    greedy decoding takes is a sample from the recorded distribution."""

    def __init__(self, row_seeds: torch.Tensor):
        self.row_seeds = row_seeds
        self.step = 0

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        noise = gumbel_noise(self.row_seeds, self.step, scores.shape[-1])
        self.step += 1
        return torch.log_softmax(scores.float(), dim=-1) + noise


def _repeat_prompt_inputs(inputs: dict, n: int) -> dict:
    """Token-aligned prompt tensors repeated n times (row i -> rows i*n .. i*n+n-1)."""
    return {k: inputs[k].repeat_interleave(n, dim=0) for k in TOKEN_ALIGNED if k in inputs}


class HFRolloutEngine:
    """Sampling on the training model itself (CPU or GPU).

    Args:
        model: a loaded family model (shares its weights with the trainer).
        processor: its processor (for the pad, stop and placeholder tokens).
    """

    def __init__(self, model: torch.nn.Module, processor):
        self.model = model
        self.processor = processor
        tokenizer = processor.tokenizer
        self.pad_id = tokenizer.pad_token_id
        self.stop_ids = sorted({tokenizer.eos_token_id, *([tokenizer.pad_token_id] if self.pad_id is not None else [])})
        self.banned = placeholder_token_ids(processor)

    def load_weights(self, model: torch.nn.Module | None = None) -> None:
        """Nothing to copy: this engine samples with the training model's own weights."""

    def rollout(self, samples: list, encoded: list, n: int, sampling: SamplingParams, seeds: list[int]) -> Rollouts:
        """G = ``n`` completions for each prompt; ``encoded`` holds the samples' processor
        inputs (``samples`` itself is not needed here); ``seeds``: one per prompt."""
        return self.generate(collate_prompts(encoded, self.pad_id), n, sampling, seeds)

    def _processors(self, sampling: SamplingParams, recorder: _RecordLogprobs, row_seeds) -> LogitsProcessorList:
        processors: list[LogitsProcessor] = [SuppressTokensLogitsProcessor(self.banned, device=self.model.device)]
        if sampling.temperature > 0:
            if sampling.temperature != 1.0:
                processors.append(TemperatureLogitsWarper(sampling.temperature))
            if sampling.top_k > 0:
                processors.append(TopKLogitsWarper(sampling.top_k))
            if sampling.top_p < 1.0:
                processors.append(TopPLogitsWarper(sampling.top_p))
        processors.append(recorder)
        if sampling.temperature > 0:
            processors.append(_GumbelSample(row_seeds))
        return LogitsProcessorList(processors)

    @torch.no_grad()
    def generate(self, inputs: dict, n: int, sampling: SamplingParams, seeds: list[int] | None = None) -> Rollouts:
        """G = ``n`` completions for each of the B left-padded prompts in ``inputs``.

        Args:
            inputs: a processor batch (``input_ids`` [B, P] plus its media tensors).
            seeds: one sampling seed per prompt (default: drawn from torch's generator).
        """
        model = self.model
        inputs = {k: v.to(model.device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
        batch, prompt_length = inputs["input_ids"].shape
        if seeds is None:
            seeds = torch.randint(0, 2**31 - 1, (batch,)).tolist()
        row_seeds = completion_seeds(seeds, n, model.device)
        was_training = model.training
        model.eval()
        try:
            # PREFILL: every token but the last, media encoders included, once per prompt
            reset_rope_deltas(model)
            cache = model(**prefix_inputs(model, inputs), use_cache=True).cache
            cache.batch_repeat_interleave(n)
            repeat_rope_deltas(model, batch, n)
            # DECODE: all B*G sequences continue from their prompt's last token
            recorder = _RecordLogprobs()
            # our processors shape and sample the distribution (the argmax of seeded
            # Gumbel-perturbed log-probs); transformers' own warpers and penalties stay off
            output = model.generate(
                **_repeat_prompt_inputs(inputs, n),
                cache=cache,
                do_sample=False,
                repetition_penalty=1.0,
                max_new_tokens=sampling.max_new_tokens,
                logits_processor=self._processors(sampling, recorder, row_seeds),
                synced_gpus=distributed.ranks().distributed,
                eos_token_id=self.stop_ids,
                pad_token_id=self.pad_id,
            )
        finally:
            model.train(was_training)
        completions = output[:, prompt_length:]
        if completions.shape[1]:
            recorder.collect(completions[:, -1])
        return self._package(completions, recorder.steps, n)

    def _package(self, completions: torch.Tensor, steps: list[torch.Tensor], n: int) -> Rollouts:
        count, width = completions.shape
        stops = torch.isin(completions, torch.tensor(self.stop_ids, device=completions.device))
        no_stop = torch.full((count,), width - 1, device=stops.device)
        lengths = torch.where(stops.any(1), stops.float().argmax(1), no_stop) + 1
        positions = torch.arange(width, device=completions.device)[None, :]
        mask = (positions < lengths[:, None]).long()
        logprobs = torch.stack(steps, dim=1) if steps else torch.zeros(count, 0, device=completions.device)
        logprobs = logprobs[:, :width] * mask
        ids = completions.masked_fill(mask == 0, self.pad_id)
        reasons = ["stop" if bool(s) else "length" for s in stops.any(1)]
        texts = self.processor.tokenizer.batch_decode(ids, skip_special_tokens=True)
        return Rollouts(ids, mask, logprobs, lengths, reasons, texts, n)


def select_groups(rollouts: Rollouts, prompts: list[int]) -> Rollouts:
    """The completions of the given prompts (by index within the batch), still grouped."""
    n = rollouts.group_size
    rows = [p * n + g for p in prompts for g in range(n)]
    index = torch.tensor(rows, dtype=torch.long, device=rollouts.completion_ids.device)
    return Rollouts(
        rollouts.completion_ids[index],
        rollouts.completion_mask[index],
        rollouts.logprobs[index],
        rollouts.lengths[index],
        [rollouts.finish_reasons[r] for r in rows],
        [rollouts.texts[r] for r in rows],
        n,
    )


def concat_rollouts(parts: list[Rollouts], pad_id: int) -> Rollouts:
    """Rollouts of several sampling rounds as one batch (right-padded to the widest)."""
    width = max(p.completion_ids.shape[1] for p in parts)

    def pad(t: torch.Tensor, value) -> torch.Tensor:
        return torch.nn.functional.pad(t, (0, width - t.shape[1]), value=value)

    return Rollouts(
        torch.cat([pad(p.completion_ids, pad_id) for p in parts]),
        torch.cat([pad(p.completion_mask, 0) for p in parts]),
        torch.cat([pad(p.logprobs, 0.0) for p in parts]),
        torch.cat([p.lengths for p in parts]),
        [r for p in parts for r in p.finish_reasons],
        [t for p in parts for t in p.texts],
        parts[0].group_size,
    )
