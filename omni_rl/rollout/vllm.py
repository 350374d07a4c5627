"""Rollouts with vLLM (GPU machines; ``pip install omni-rl[vllm]``).

The same contract as the hf engine: G completions per prompt with their token ids,
sampling log-probs, lengths and finish reasons. Prompts go to vLLM through its public
API: the chat-templated text with one placeholder per medium plus ``multi_modal_data``
holding the already decoded, already resized media of the cache (vLLM expands the
placeholders itself); ``SamplingParams(n=G)`` shares each prompt's prefill and encoder
pass across its group. Media placeholder tokens get a -100 logit bias so a sample can
never hold one, and log-probs are vLLM's *processed* ones (after temperature and
top-k/top-p), the distribution the tokens were drawn from. After each optimizer step
``load_weights`` copies the policy's weights into the engine and clears its prefix
cache.

vllm is imported only when an engine is built, so this module imports everywhere.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from omni_rl.data.dataset import Sample
from omni_rl.errors import OmniRLError
from omni_rl.models import placeholder_token_ids
from omni_rl.models.inputs import AUDIO_SAMPLE_RATE
from omni_rl.rollout.config import VLLMConfig
from omni_rl.rollout.hf import Rollouts, SamplingParams

# vLLM clamps logit biases to [-100, 100]; exp(-100) never gets sampled.
BAN = -100.0


def request(processor, sample: Sample) -> dict:
    """One vLLM prompt: chat text with unexpanded placeholders, plus its media.

    Videos go as ``(frames [T, H, W, 3] uint8, metadata)`` so vLLM's processor sees the
    true sampled fps and frame indices; images as [H, W, 3] arrays; audio as
    ``(waveform, 16000)``.
    """
    text = processor.apply_chat_template(sample.messages, tokenize=False, add_generation_prompt=True)
    media: dict = {}
    if sample.images:
        media["image"] = list(sample.images)
    if sample.videos:
        media["video"] = [(np.ascontiguousarray(c.frames.transpose(0, 2, 3, 1)), c.metadata()) for c in sample.videos]
    if sample.audios:
        media["audio"] = [(a, AUDIO_SAMPLE_RATE) for a in sample.audios]
    out = {"prompt": text}
    if media:
        # one medium of a kind goes bare, several as a list
        out["multi_modal_data"] = {k: v[0] if len(v) == 1 else v for k, v in media.items()}
    return out


def sampling_kwargs(sampling: SamplingParams, n: int, stop_ids: list[int], banned: list[int], seed: int) -> dict:
    """Keyword arguments of ``vllm.SamplingParams`` matching the hf engine's sampling."""
    greedy = sampling.temperature == 0
    return {
        "n": n,
        "temperature": sampling.temperature,
        "top_p": 1.0 if greedy else sampling.top_p,
        "top_k": 0 if greedy else sampling.top_k,
        "max_tokens": sampling.max_new_tokens,
        "stop_token_ids": list(stop_ids),
        "logit_bias": {int(t): BAN for t in banned},
        "logprobs": 0,
        "seed": seed,
        "skip_special_tokens": True,
    }


def package(outputs, n: int, pad_id: int, stop_ids: list[int]) -> Rollouts:
    """Rollouts from vLLM ``RequestOutput``s (one per prompt, each with n completions).

    A completion's token ids end with its stop token when it stopped; every row's
    mask covers its tokens, and log-probs are those of the sampled tokens.
    """
    completions = [c for request_output in outputs for c in request_output.outputs]
    if any(len(r.outputs) != n for r in outputs):
        raise OmniRLError(f"vLLM returned {[len(r.outputs) for r in outputs]} completions per prompt, expected {n}")
    width = max([len(c.token_ids) for c in completions] + [1])
    ids = torch.full((len(completions), width), pad_id, dtype=torch.long)
    logprobs = torch.zeros(len(completions), width)
    lengths = torch.zeros(len(completions), dtype=torch.long)
    for row, c in enumerate(completions):
        tokens = list(c.token_ids)
        ids[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        sampled = [step[t].logprob for t, step in zip(tokens, c.logprobs, strict=True)]
        logprobs[row, : len(tokens)] = torch.tensor(sampled)
        lengths[row] = len(tokens)
    mask = (torch.arange(width)[None, :] < lengths[:, None]).long()
    reasons = ["stop" if c.finish_reason == "stop" else "length" for c in completions]
    texts = [c.text for c in completions]
    return Rollouts(ids, mask, logprobs, lengths, reasons, texts, n)


class VLLMRolloutEngine:
    """Sampling with vLLM on GPUs; the policy's weights are copied in by ``load_weights``.

    Args:
        model_path: the checkpoint directory vLLM loads (the run's starting model).
        processor: the family's processor (chat template, pad/stop/placeholder tokens).
        settings: the ``rollout.vllm`` config section.
        seed: the engine's seed (each request carries its prompt's own sampling seed).
    """

    def __init__(self, model_path: str, processor, settings: VLLMConfig, seed: int = 0):
        try:
            import vllm
        except ImportError as err:
            raise OmniRLError(
                "rollout.engine 'vllm' needs vllm (pip install 'omni-rl[vllm]', GPU machines); "
                "use rollout.engine: hf on CPUs"
            ) from err
        # weights are pushed from this process into the engine's model
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        self._vllm = vllm
        self.processor = processor
        tokenizer = processor.tokenizer
        self.pad_id = tokenizer.pad_token_id
        self.stop_ids = sorted({tokenizer.eos_token_id, *([self.pad_id] if self.pad_id is not None else [])})
        self.banned = placeholder_token_ids(processor)
        self.seed = seed
        self.llm = vllm.LLM(
            model=str(model_path),
            dtype="bfloat16",
            seed=seed,
            gpu_memory_utilization=settings.gpu_memory_utilization,
            tensor_parallel_size=settings.tensor_parallel_size,
            max_model_len=settings.max_model_len,
            enforce_eager=settings.enforce_eager,
            enable_prefix_caching=True,
            logprobs_mode="processed_logprobs",
        )

    def rollout(
        self, samples: list[Sample], encoded: list, n: int, sampling: SamplingParams, seeds: list[int]
    ) -> Rollouts:
        """G = ``n`` completions per sample (``encoded`` is unused: vLLM encodes itself),
        each prompt sampled with its own seed."""
        params = [
            self._vllm.SamplingParams(**sampling_kwargs(sampling, n, self.stop_ids, self.banned, seed))
            for seed in seeds
        ]
        outputs = self.llm.generate([request(self.processor, s) for s in samples], params, use_tqdm=False)
        return package(outputs, n, self.pad_id, self.stop_ids)

    @torch.no_grad()
    def load_weights(self, model: torch.nn.Module) -> None:
        """Copy the policy's weights into the engine (LoRA adapters merged for the copy
        and unmerged after), then clear the prefix cache, whose entries came from the
        old weights."""
        lora = hasattr(model, "merge_adapter")
        if lora:
            model.merge_adapter()
        try:
            base = model.get_base_model() if lora else model
            weights = [
                (name.replace(".base_layer", ""), p.detach())
                for name, p in base.state_dict().items()
                if "lora_" not in name
            ]
            self.llm.apply_model(lambda engine_model: engine_model.load_weights(weights))
        finally:
            if lora:
                model.unmerge_adapter()
        self.llm.reset_prefix_cache()
