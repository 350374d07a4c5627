"""Rollouts with transformers: each prompt prefilled once, its keys held once for G samples.

``model.generate(num_return_sequences=G)`` copies every prompt G times before the
prefill, so the vision/audio encoder and the language model run G times over the same
prompt, and repeating a prefilled cache G times still keeps G copies of its keys and
values. Here the prompt (all but its last token) is prefilled once per prompt, each
decoder layer keeps its keys and values once (``omni_rl.models.shared_prefix``), and
a decode loop continues all B*G sequences from the prompt's last token: each step
attends to the prompt's keys where they lie (no copy, no head expansion:
``omni_rl.models.block_attention``) and to the sequences' own keys in a cache of
completion tokens only, allocated once per rollout and written in place. The sampling distribution (temperature,
top-k, top-p, with media placeholder tokens removed) is shaped by transformers'
logits processors, and the log-probability of each sampled token under exactly that
distribution is recorded.

Sampling is seeded per completion, not per batch: the token at each step is the
argmax of the log-probabilities plus Gumbel noise that a counter-based hash draws
from (the prompt's seed, the completion's index in its group, the step, the token id).
That is an exact draw from the distribution, and a completion comes out the same
whatever else shares its batch, on any device: a prompt rolled out on rank 1 of 2
gets the tokens it gets in one process with the whole batch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from transformers import (
    LogitsProcessor,
    StaticCache,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from omni_rl.engine import distributed, gathering
from omni_rl.errors import OmniRLError
from omni_rl.models import placeholder_token_ids
from omni_rl.models.forward import Prefix, prefill, tail_positions
from omni_rl.models.inputs import answer_end, collate_prompts
from omni_rl.models.shared_prefix import ReadPrefix, decoder_config

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SamplingParams:
    """How completions are sampled; temperature 0 decodes greedily."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 256

    @classmethod
    def of(cls, rollout) -> SamplingParams:
        """How a ``rollout`` config section samples."""
        return cls(rollout.temperature, rollout.top_p, rollout.top_k, rollout.max_new_tokens)


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
        offline: bool [N], completions a row's ``offline_response`` replaced (their
            ``logprobs`` are not a sampler's: the trainer takes its own at rollout
            time); None: every completion was sampled.
        prefill: the prompts' prefill with its autograd graph, for the update's
            forward to read instead of running the prompts again (``HFRolloutEngine``'s
            ``keep_prefill``); None otherwise, and once a selection drops a prompt.
    """

    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    logprobs: torch.Tensor
    lengths: torch.Tensor
    finish_reasons: list[str]
    texts: list[str]
    group_size: int
    offline: torch.Tensor | None = None
    prefill: Prefix | None = None

    @property
    def truncated(self) -> torch.Tensor:
        """bool [N]: completions cut off at max_new_tokens."""
        return torch.tensor([r == "length" for r in self.finish_reasons], device=self.lengths.device)

    @property
    def replaced(self) -> torch.Tensor:
        """bool [N]: ``offline``, all False where nothing was replaced."""
        if self.offline is not None:
            return self.offline
        return torch.zeros(len(self.texts), dtype=torch.bool, device=self.lengths.device)


MASK32 = 0xFFFFFFFF


def hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mix of each element (int64 tensors; the result is in [0, 2^32)).
    Products stay below 2^63, so int64 arithmetic is exact on every device."""
    x = x & MASK32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & MASK32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & MASK32
    return (x >> 16) ^ x


def token_keys(vocab: int, device) -> torch.Tensor:
    """[V] int64: each token id's key in ``gumbel_noise``, made once per rollout."""
    return hash32(torch.arange(vocab, device=device, dtype=torch.int64) * 2 + 1)


def gumbel_noise(row_seeds: torch.Tensor, step: int, tokens: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel noise [N, V], a pure function of each row's seed, the decoding
    step and the token id. row_seeds: [N] int64; tokens: ``token_keys(V, device)``."""
    row = hash32(hash32(row_seeds) ^ step)
    bits = hash32(row[:, None] ^ tokens[None, :])
    uniform = (bits.double() + 0.5) / 2.0**32
    return -torch.log(-torch.log(uniform)).float()


def completion_seeds(prompt_seeds: list[int], n: int, device) -> torch.Tensor:
    """[B*G] seeds of the G completions of each prompt (grouped prompt by prompt):
    completion g of a prompt with seed s is seeded s + g, as vLLM seeds its child
    requests, then mixed (a bijection on 32 bits, so distinct seeds stay distinct)."""
    seeds = torch.tensor([s % 2**32 for s in prompt_seeds], dtype=torch.int64, device=device)
    return hash32(seeds.repeat_interleave(n) + torch.arange(n, device=device).repeat(len(prompt_seeds)))


def stop_token_ids(processor, model: torch.nn.Module) -> list[int]:
    """The tokens that end a completion: the tokenizer's end and pad tokens, the token
    the chat template ends an answer with (``answer_end``: what SFT and offline answers
    end with, ``<|im_end|>`` where the tokenizer's end is ``<|endoftext|>``) and the
    checkpoint's generation-config end tokens (vLLM stops at those too, whatever
    sampling parameters it is given), so both engines stop alike."""
    tokenizer = processor.tokenizer
    ids = {tokenizer.eos_token_id, tokenizer.pad_token_id}
    end = tokenizer(answer_end(processor), add_special_tokens=False)["input_ids"]
    ids |= set(end) if len(end) == 1 else set()  # a stop is one token
    config = getattr(model, "generation_config", None)
    eos = getattr(config, "eos_token_id", None)
    ids |= set(eos) if isinstance(eos, (list, tuple)) else {eos}
    return sorted(i for i in ids if i is not None)


def max_positions(model: torch.nn.Module) -> int | None:
    """The decoder's position limit (``max_position_embeddings``), if it has one."""
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(text, "max_position_embeddings", None)


class HFRolloutEngine:
    """Sampling on the training model itself (CPU or GPU).

    Args:
        model: a loaded family model (shares its weights with the trainer).
        processor: its processor (for the pad, stop and placeholder tokens).

    Attributes:
        keep_prefill: ``rollout`` prefills its prompts under autograd and returns the
            prefill, graph and all, in ``Rollouts.prefill``: a trainer whose next forward
            over these prompts has the same weights, mode and batch reads it instead of
            running the prompts and their media again (set by GRPO, which checks that).
            The values are those of the plain prefill; its activations are held through
            the decoding.
    """

    def __init__(self, model: torch.nn.Module, processor, gather_once: bool = True):
        self.model = model
        self.keep_prefill = False
        self.processor = processor
        self.pad_id = processor.tokenizer.pad_token_id
        self.stop_ids = stop_token_ids(processor, model)
        self.banned = placeholder_token_ids(processor)
        self.gather_once = gather_once
        sharded = any(gathering.tracked(m) for m in model.modules())
        if not gather_once and sharded:
            _log.warning("rollout.gather_once: false: every decoded token gathers every sharded layer's weights again")
        # the rollout's forwards run in inference mode (the same kernels, fewer dispatch
        # steps an operation) except on FSDP2 units: weights gathered there would be
        # inference tensors that training's next all-gather may not write into
        self.inference_mode = not sharded
        if sharded:
            _log.info("hf rollout: FSDP2-sharded model: prefill and decoding run under no_grad, not inference mode")
        self._gathers = {"bytes": 0, "decode_bytes": 0, "decode_steps": 0}
        self._capped = False  # whether the log has said that the positions limit prompts

    def load_weights(self, model: torch.nn.Module | None = None) -> None:
        """Nothing to copy: this engine samples with the training model's own weights."""

    def sleep(self) -> None:
        """Nothing to free: the engine's only memory is the training model's."""

    def metrics(self) -> dict:
        """What this rank's rollouts gathered since the last call, and reset:
        ``rollout/gathered_bytes`` (FSDP2's all-gathers of weights into this rank, the
        prefills' included) and ``rollout/gathered_bytes_per_token`` (those after the
        prefills, per decoded token position): 0 with ``gather_once``, the whole model's
        sharded weights without it, and 0 for a model FSDP2 does not shard; and
        ``rollout/inference_mode``: 1 where the rollout's forwards run in inference mode,
        0 under no_grad (FSDP2-sharded models)."""
        g, self._gathers = self._gathers, {"bytes": 0, "decode_bytes": 0, "decode_steps": 0}
        return {
            "rollout/gathered_bytes": g["bytes"],
            "rollout/gathered_bytes_per_token": g["decode_bytes"] / max(g["decode_steps"], 1),
            "rollout/inference_mode": float(self.inference_mode),
        }

    def max_prompt_tokens(self, rollout) -> int:
        """The longest prompt this engine takes: the ``rollout`` section's limit, and
        room for ``max_new_tokens`` within the model's positions (beyond them a rotary
        model decodes on untrained positions without a word)."""
        limit = max_positions(self.model)
        if limit is None or rollout.max_prompt_length + rollout.max_new_tokens <= limit:
            return rollout.max_prompt_length
        room = limit - rollout.max_new_tokens
        if room < 1:
            raise OmniRLError(
                f"rollout.max_new_tokens={rollout.max_new_tokens} leaves no room for a prompt "
                f"within the model's {limit} positions"
            )
        if not self._capped:
            self._capped = True
            _log.info(
                "hf rollout: prompts over %d tokens are skipped: the model's %d positions less "
                "rollout.max_new_tokens=%d (rollout.max_prompt_length=%d)",
                room,
                limit,
                rollout.max_new_tokens,
                rollout.max_prompt_length,
            )
        return room

    def rollout(self, samples: list, encoded: list, n: int, sampling: SamplingParams, seeds: list[int]) -> Rollouts:
        """G = ``n`` completions for each prompt; ``encoded`` holds the samples' processor
        inputs (``samples`` itself is not needed here); ``seeds``: one per prompt."""
        return self.generate(collate_prompts(encoded, self.pad_id), n, sampling, seeds, self.keep_prefill)

    def _warpers(self, sampling: SamplingParams) -> list[LogitsProcessor]:
        """The sampling distribution's shaping: placeholders banned, then temperature,
        top-k and top-p (transformers' processors; none of them reads the token history)."""
        warpers: list[LogitsProcessor] = [SuppressTokensLogitsProcessor(self.banned, device=self.model.device)]
        if sampling.temperature > 0:
            if sampling.temperature != 1.0:
                warpers.append(TemperatureLogitsWarper(sampling.temperature))
            if sampling.top_k > 0:
                warpers.append(TopKLogitsWarper(sampling.top_k))
            if sampling.top_p < 1.0:
                warpers.append(TopPLogitsWarper(sampling.top_p))
        return warpers

    @torch.no_grad()
    def generate(
        self,
        inputs: dict,
        n: int,
        sampling: SamplingParams,
        seeds: list[int] | None = None,
        keep_prefill: bool = False,
    ) -> Rollouts:
        """G = ``n`` completions for each of the B left-padded prompts in ``inputs``.

        Args:
            inputs: a processor batch (``input_ids`` [B, P] plus its media tensors).
            seeds: one sampling seed per prompt (default: drawn from torch's generator).
            keep_prefill: prefill under autograd and return it (``Rollouts.prefill``).
        """
        model = self.model
        inputs = {k: v.to(model.device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
        batch = inputs["input_ids"].shape[0]
        if seeds is None:
            seeds = torch.randint(0, 2**31 - 1, (batch,)).tolist()
        row_seeds = completion_seeds(seeds, n, model.device)
        was_training = model.training
        model.eval()
        held = gathering.held_gathered(model) if self.gather_once else nullcontext()
        try:
            with held, gathering.counting_gathers() as gathered:
                # PREFILL: every token but the last, media encoders included, once per prompt;
                # each layer keeps the prompt's keys and values once for its G samples (and,
                # sharded, its gathered weights to the last token: ``gather_once``)
                with torch.enable_grad() if keep_prefill else self._no_autograd():
                    prefix = prefill(model, inputs)
                prefilled = gathered.bytes
                with self._no_autograd():
                    sampled, logprobs = self._decode(prefix, inputs, n, sampling, row_seeds)
        finally:
            model.train(was_training)
        self._gathers["bytes"] += gathered.bytes
        self._gathers["decode_bytes"] += gathered.bytes - prefilled
        self._gathers["decode_steps"] += len(sampled)
        completions = torch.stack(sampled, 1) if sampled else torch.zeros(batch * n, 0, dtype=torch.long)
        return self._package(completions, logprobs, n, prefix if keep_prefill else None)

    def _no_autograd(self):
        return torch.inference_mode() if self.inference_mode else torch.no_grad()

    def _decode(self, prefix: Prefix, inputs: dict, n: int, sampling: SamplingParams, row_seeds: torch.Tensor):
        """The decode loop: all B*G sequences, one token each per step, from each prompt's
        last token, until every one stopped (on every rank: sharded forwards run in
        step). Returns the sampled tokens [N] and their log-probs [N] of each step."""
        model, warpers = self.model, self._warpers(sampling)
        stop_ids = torch.tensor(self.stop_ids, device=model.device)
        reader = ReadPrefix(prefix.store)
        tokens = inputs["input_ids"][:, -1].repeat_interleave(n)
        first = tail_positions(prefix, torch.ones_like(tokens)[:, None], n)
        extra = {"mm_token_type_ids": torch.zeros_like(tokens)[:, None]} if "mm_token_type_ids" in inputs else {}
        finished = torch.zeros_like(tokens, dtype=torch.bool)
        # the completions' own keys: allocated once, written in place step by step; step s
        # sees the first s + 1 slots (the mask handed over as it is, so none is built)
        slots = max(1, sampling.max_new_tokens)
        cache = StaticCache(config=decoder_config(model), max_cache_len=slots)
        slot = torch.arange(slots, device=model.device)
        sampled, logprobs = [], []
        for step in range(sampling.max_new_tokens):
            out = model(
                input_ids=tokens[:, None],
                attention_mask=(slot <= step).expand(len(tokens), 1, 1, slots),
                position_ids=first + step,
                cache=cache,
                use_cache=True,
                shared_prefix=reader,
                **extra,
            )
            scores = out.logits[:, -1].float()
            for warp in warpers:
                scores = warp(None, scores)
            logp = torch.log_softmax(scores, dim=-1)
            if sampling.temperature > 0:
                if step == 0:  # fixed for the rollout
                    keys = token_keys(logp.shape[-1], logp.device)
                noisy = logp + gumbel_noise(row_seeds, step, keys)
            else:
                noisy = logp
            tokens = torch.where(finished, self.pad_id, noisy.argmax(-1))
            sampled.append(tokens)
            logprobs.append(logp.gather(-1, tokens[:, None]).squeeze(-1))
            finished |= torch.isin(tokens, stop_ids)
            # the one host read of a step: whether every sequence of every rank stopped
            if distributed.all_ranks(finished.all()):
                break
        return sampled, logprobs

    def _package(self, completions: torch.Tensor, steps: list[torch.Tensor], n: int, kept: Prefix | None) -> Rollouts:
        count, width = completions.shape
        stops = torch.isin(completions, torch.tensor(self.stop_ids, device=completions.device))
        no_stop = torch.full((count,), width - 1, device=stops.device)
        lengths = torch.where(stops.any(1), stops.float().argmax(1), no_stop) + 1
        positions = torch.arange(width, device=completions.device)[None, :]
        mask = (positions < lengths[:, None]).long()
        logprobs = torch.stack(steps, dim=1) if steps else torch.zeros(count, 0, device=completions.device)
        # a finished row's padding may fall outside top-k/top-p (-inf): zero, not NaN
        logprobs = logprobs[:, :width].masked_fill(mask == 0, 0.0)
        ids = completions.masked_fill(mask == 0, self.pad_id)
        reasons = ["stop" if s else "length" for s in stops.any(1).tolist()]
        texts = self.processor.tokenizer.batch_decode(ids, skip_special_tokens=True)
        return Rollouts(ids, mask, logprobs, lengths, reasons, texts, n, prefill=kept)


def select_groups(rollouts: Rollouts, prompts: list[int]) -> Rollouts:
    """The completions of the given prompts (by index within the batch), still grouped;
    the prefill goes with them only if they are every prompt, in order."""
    n = rollouts.group_size
    rows = [p * n + g for p in prompts for g in range(n)]
    every = prompts == list(range(len(rollouts.texts) // n))
    index = torch.tensor(rows, dtype=torch.long, device=rollouts.completion_ids.device)
    return Rollouts(
        rollouts.completion_ids[index],
        rollouts.completion_mask[index],
        rollouts.logprobs[index],
        rollouts.lengths[index],
        [rollouts.finish_reasons[r] for r in rows],
        [rollouts.texts[r] for r in rows],
        n,
        None if rollouts.offline is None else rollouts.offline[index],
        rollouts.prefill if every else None,
    )


def _widen(t: torch.Tensor, width: int, value) -> torch.Tensor:
    """[N, L] right-padded with ``value`` to [N, width]."""
    return torch.nn.functional.pad(t, (0, width - t.shape[1]), value=value)


def concat_rollouts(parts: list[Rollouts], pad_id: int) -> Rollouts:
    """Rollouts of several sampling rounds as one batch (right-padded to the widest);
    one round's keeps its prefill."""
    width = max(p.completion_ids.shape[1] for p in parts)
    return Rollouts(
        torch.cat([_widen(p.completion_ids, width, pad_id) for p in parts]),
        torch.cat([_widen(p.completion_mask, width, 0) for p in parts]),
        torch.cat([_widen(p.logprobs, width, 0.0) for p in parts]),
        torch.cat([p.lengths for p in parts]),
        [r for p in parts for r in p.finish_reasons],
        [t for p in parts for t in p.texts],
        parts[0].group_size,
        torch.cat([p.replaced for p in parts]) if any(p.offline is not None for p in parts) else None,
        parts[0].prefill if len(parts) == 1 else None,
    )


def replace_completions(
    rollouts: Rollouts, ids: dict[int, list[int]], decode: Callable[[list[int]], str], pad_id: int, limit: int
) -> Rollouts:
    """``rollouts`` with the completions of rows ``ids`` (row -> token ids ending in the
    stop token) in place of the sampled ones, cut at ``limit`` tokens (finish reason
    'length' where cut) and marked ``offline``; each one's text is ``decode`` of the
    tokens kept, so a cut answer is scored as the prefix it is trained on. Their
    behaviour log-probs are unknown, left 0 here, and taken as the trainer's own."""
    cut = {row: tokens[:limit] for row, tokens in ids.items()}
    width = max([rollouts.completion_ids.shape[1], *map(len, cut.values())])
    completion_ids = _widen(rollouts.completion_ids, width, pad_id)
    mask, logprobs = _widen(rollouts.completion_mask, width, 0), _widen(rollouts.logprobs, width, 0.0)
    lengths = rollouts.lengths.clone()
    reasons, texts, offline = list(rollouts.finish_reasons), list(rollouts.texts), rollouts.replaced.clone()
    for row, tokens in cut.items():
        completion_ids[row] = pad_id
        completion_ids[row, : len(tokens)] = torch.tensor(tokens, device=completion_ids.device)
        mask[row] = 0
        mask[row, : len(tokens)] = 1
        logprobs[row] = 0.0
        lengths[row] = len(tokens)
        reasons[row] = "stop" if len(tokens) == len(ids[row]) else "length"
        texts[row] = decode(tokens)
        offline[row] = True
    return Rollouts(
        completion_ids, mask, logprobs, lengths, reasons, texts, rollouts.group_size, offline, rollouts.prefill
    )
