"""Rollouts with vLLM (GPU machines; ``pip install omni-rl[vllm]``).

The same contract as the hf engine: G completions per prompt with their token ids,
sampling log-probs, lengths and finish reasons.

Prompts go to vLLM through its public API: the chat-templated text with one placeholder
per medium, ``multi_modal_data`` holding the cache's already decoded, already resized
media, and ``mm_processor_kwargs`` telling vLLM's processor to leave them as they are,
as the trainer's does. vLLM's prompt token ids are then checked against the trainer's
(a different media-token count is an error naming the row). ``SamplingParams(n=G)``
shares each prompt's prefill and encoder pass across its group; completion g of a
prompt with seed s is seeded s + g (vLLM's rule), and the recipe's seeds step by G.
Media placeholder tokens get a -100 logit bias so a sample never holds one; the
log-probs are vLLM's processed ones, the distribution the tokens were drawn from, which
the trainer compares like with like (``omni_rl.algorithms.correction``).

Colocated with the trainer on every rank: each rank runs its own engine on its own GPU
(under torchrun in vLLM's external-launcher mode). With sleep mode the engine frees its
memory after each step's rollouts (``sleep``); ``load_weights`` then wakes its weights,
copies the policy's in (gathered from FSDP2 shards bucket by bucket) or, with LoRA,
hands it the adapter alone as a LoRA request, resets the prefix and encoder caches
(their entries came from the old weights) and wakes the KV cache.

vllm is imported only when an engine is built, so this module imports everywhere.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import numpy as np
import torch

from omni_rl.data.dataset import Sample
from omni_rl.engine import distributed, gathering
from omni_rl.errors import OmniRLError
from omni_rl.models import placeholder_token_ids
from omni_rl.models.inputs import AUDIO_SAMPLE_RATE, media_processor_kwargs
from omni_rl.rollout.config import RolloutConfig
from omni_rl.rollout.hf import Rollouts, SamplingParams, max_positions, stop_token_ids

log = logging.getLogger(__name__)

# vLLM clamps logit biases to [-100, 100]; exp(-100) never gets sampled.
BAN = -100.0
# the adapter ranks vLLM 0.33 can serve (``max_lora_rank`` must be one of them)
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
FINISHED = ("stop", "length")


def request(processor, sample: Sample) -> dict:
    """One vLLM prompt: chat text with unexpanded placeholders, its media, and the
    processor arguments that keep the media as cached.

    Videos go as ``(frames [T, H, W, 3] uint8, metadata)`` so vLLM's processor sees the
    true sampled fps and frame indices; images as [H, W, 3] arrays; audio as
    ``(waveform, 16000)``.
    """
    if sample.video_audios:
        raise OmniRLError(
            f"row '{sample.id}': videos heard with their sound (use_audio_in_video) are not sent to vLLM yet; "
            "use rollout.engine=hf for them"
        )
    text = processor.apply_chat_template(sample.messages, tokenize=False, add_generation_prompt=True)
    media: dict = {}
    if sample.images:
        media["image"] = list(sample.images)
    if sample.videos:
        media["video"] = [(np.ascontiguousarray(c.frames.transpose(0, 2, 3, 1)), c.metadata()) for c in sample.videos]
    if sample.audios:
        media["audio"] = [(a, AUDIO_SAMPLE_RATE) for a in sample.audios]
    out: dict = {"prompt": text}
    if media:
        # one medium of a kind goes bare, several as a list
        out["multi_modal_data"] = {k: v[0] if len(v) == 1 else v for k, v in media.items()}
    kwargs = media_processor_kwargs(bool(sample.images), bool(sample.videos))
    if kwargs:
        out["mm_processor_kwargs"] = kwargs
    return out


def sampling_kwargs(sampling: SamplingParams, n: int, stop_ids: list[int], banned: list[int], seed: int) -> dict:
    """Keyword arguments of ``vllm.SamplingParams`` matching the hf engine's sampling:
    temperature, top-k and top-p only (no penalties, whatever the checkpoint's
    generation config says); children seeded seed + g."""
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


def check_prompts(outputs, samples: list[Sample], encoded: list[dict]) -> None:
    """Every request's prompt token ids equal the trainer's ``input_ids`` for that row:
    otherwise the trainer would score completions of a prompt the engine never saw."""
    for output, sample, inputs in zip(outputs, samples, encoded, strict=True):
        theirs = list(output.prompt_token_ids)
        ours = inputs["input_ids"][0][inputs["attention_mask"][0].bool()].tolist()
        if theirs == ours:
            continue
        first = next(
            (i for i, (a, b) in enumerate(zip(theirs, ours, strict=False)) if a != b), min(len(theirs), len(ours))
        )
        raise OmniRLError(
            f"row {sample.id}: vLLM's prompt has {len(theirs)} tokens and the trainer's {len(ours)}; they first "
            f"differ at token {first}. A different count of media tokens means vLLM processed the media "
            "differently (resized or re-sampled frames): check the processor settings of the checkpoint"
        )


def package(outputs, n: int, pad_id: int, samples: list[Sample] | None = None) -> Rollouts:
    """Rollouts from vLLM ``RequestOutput``s (one per prompt, each with n completions).

    A completion's token ids end with its stop token when it stopped; every row's mask
    covers its tokens, and log-probs are those of the sampled tokens. Finish reasons
    map exactly: a completion vLLM aborted or failed is an error, not a truncation.
    """
    if any(len(r.outputs) != n for r in outputs):
        raise OmniRLError(f"vLLM returned {[len(r.outputs) for r in outputs]} completions per prompt, expected {n}")
    for p, output in enumerate(outputs):
        for g, c in enumerate(output.outputs):
            if c.finish_reason not in FINISHED:
                row = samples[p].id if samples else p
                raise OmniRLError(
                    f"row {row}: vLLM ended completion {g} with finish_reason '{c.finish_reason}' "
                    "(neither a stop token nor the length limit): the rollout cannot be trained on"
                )
    completions = [c for request_output in outputs for c in request_output.outputs]
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
    reasons = [c.finish_reason for c in completions]
    texts = [c.text for c in completions]
    return Rollouts(ids, mask, logprobs, lengths, reasons, texts, n)


def engine_arguments(rollout: RolloutConfig, model_path: str, seed: int, lora_rank: int, launched: bool) -> dict:
    """``vllm.LLM`` keyword arguments for one rank's colocated engine.

    Args:
        lora_rank: the policy's adapter rank (0: a full fine-tune).
        launched: under torchrun (vLLM joins the launcher's processes instead of
            starting its own: external-launcher mode).
    """
    settings = rollout.vllm
    kwargs = {
        "model": str(model_path),
        "dtype": "bfloat16",
        "seed": seed,
        "gpu_memory_utilization": settings.gpu_memory_utilization,
        "max_model_len": settings.max_model_len,
        "enforce_eager": settings.enforce_eager,
        "enable_prefix_caching": True,
        "enable_sleep_mode": settings.sleep_mode,
        "logprobs_mode": "processed_logprobs",
        # sample with exactly the rollout section's parameters, never the checkpoint's defaults
        "generation_config": "vllm",
    }
    if launched:
        kwargs["distributed_executor_backend"] = "external_launcher"
    if lora_rank:
        served = next((r for r in LORA_RANKS if r >= lora_rank), None)
        if served is None:
            raise OmniRLError(f"model.lora.rank {lora_rank} exceeds vLLM's largest adapter rank {LORA_RANKS[-1]}")
        kwargs.update(enable_lora=True, max_lora_rank=served, max_loras=1)
    return kwargs


def _lora_rank(model: torch.nn.Module) -> int:
    """The rank of the policy's LoRA adapter (0 without one); adapters on the vision
    tower are refused (vLLM applies LoRA to the language model only)."""
    config = getattr(model, "peft_config", {}).get("default")
    if config is None:
        return 0
    visual = sorted(n for n, _ in model.named_parameters() if "lora_" in n and "visual" in n)
    if visual:
        raise OmniRLError(
            f"rollout.engine vllm serves LoRA adapters on the language model only, but {visual[0]} "
            "(and others) adapt the vision tower: leave its modules out of model.lora.target_modules, or use "
            "rollout.engine hf"
        )
    return int(config.r)


def full_weights(model: torch.nn.Module, bucket_bytes: int):
    """The model's full weights in bf16, ``(name, tensor)`` lists of about
    ``bucket_bytes`` each. Under FSDP2 each sharded unit is gathered once, all its
    weights in one collective (every rank iterates alike), copied, and freed again, so a
    unit and a bucket, never a second model, are held at once; ``weight_gathers`` counts
    the collectives."""
    bucket, size = [], 0
    for name, value in gathering.full_entries(model):
        tensor = value.detach().to(torch.bfloat16, copy=True) if value.is_floating_point() else value.detach()
        bucket.append((name, tensor))
        size += tensor.numel() * tensor.element_size()
        if size >= bucket_bytes:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket


def weight_gathers(model: torch.nn.Module) -> int:
    """The all-gathers one ``full_weights`` pass runs: one per FSDP2 unit (0 unsharded)."""
    return sum(gathering.tracked(m) for m in model.modules())


class _LoadWeights:
    """``apply_model`` callable: load a bucket into the engine's model and return the
    names it loaded (a module-level class, not a lambda)."""

    def __init__(self, weights: list):
        self.weights = weights

    def __call__(self, engine_model) -> set:
        return set(engine_model.load_weights(self.weights) or ())


def _parameter_names(engine_model) -> set:
    return {name for name, _ in engine_model.named_parameters()}


class VLLMRolloutEngine:
    """Sampling with vLLM on this rank's GPU, colocated with the trainer.

    Args:
        model_path: the checkpoint directory vLLM loads (the run's starting model).
        processor: the family's processor (chat template, pad/stop/placeholder tokens).
        rollout: the ``rollout`` config section (its ``vllm`` settings and limits).
        model: the policy (its position limit and LoRA adapter are checked here).
        work_dir: the run's directory; LoRA adapters are written under it for vLLM.
        seed: the engine's seed (each request carries its prompt's own sampling seed).
    """

    def __init__(
        self, model_path, processor, rollout: RolloutConfig, model: torch.nn.Module, work_dir: Path, seed: int = 0
    ):
        try:
            import vllm
        except ImportError as err:
            raise OmniRLError(
                "rollout.engine 'vllm' needs vllm (pip install 'omni-rl[vllm]', GPU machines); "
                "use rollout.engine: hf on CPUs"
            ) from err
        if not torch.cuda.is_available():
            raise OmniRLError("rollout.engine 'vllm' needs a CUDA GPU; use rollout.engine: hf on CPUs")
        settings = rollout.vllm
        limit = max_positions(model)
        if limit is not None and settings.max_model_len > limit:
            raise OmniRLError(
                f"rollout.vllm.max_model_len={settings.max_model_len} exceeds the model's {limit} positions: "
                f"set it to at most {limit} (and rollout.max_prompt_length + max_new_tokens within it)"
            )
        free, total = torch.cuda.mem_get_info()
        wanted = settings.gpu_memory_utilization * total
        if wanted > free:
            raise OmniRLError(
                f"rollout.vllm.gpu_memory_utilization={settings.gpu_memory_utilization} asks for "
                f"{wanted / 2**30:.1f} GiB, but only {free / 2**30:.1f} GiB of this GPU's {total / 2**30:.1f} GiB "
                f"are free beside the trainer: set it to at most {max(free / total - 0.02, 0.01):.2f}"
            )
        # weights are pushed from this process into the engine's model
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        self._vllm = vllm
        self.processor = processor
        self.settings = settings
        self.max_prompt = min(rollout.max_prompt_length, settings.max_model_len - rollout.max_new_tokens)
        self.pad_id = processor.tokenizer.pad_token_id
        self.stop_ids = stop_token_ids(processor, model)
        self.banned = placeholder_token_ids(processor)
        self.lora_rank = _lora_rank(model)
        self.lora_dir = Path(work_dir) / "vllm_lora" / f"rank{distributed.ranks().rank}"
        self.lora_request = None
        self.version = 0
        self.synced_gathers = 0
        launched = distributed.ranks().distributed
        self.llm = vllm.LLM(**engine_arguments(rollout, model_path, seed, self.lora_rank, launched))
        self.awake = True

    def max_prompt_tokens(self, rollout: RolloutConfig) -> int:
        """The longest prompt this engine takes: the rollout limit, and room for
        max_new_tokens within max_model_len."""
        return self.max_prompt

    def rollout(
        self, samples: list[Sample], encoded: list, n: int, sampling: SamplingParams, seeds: list[int]
    ) -> Rollouts:
        """G = ``n`` completions per sample, each prompt sampled with its own seed;
        ``encoded`` (the trainer's inputs) is what vLLM's prompts are checked against."""
        if not self.awake:
            raise OmniRLError("the vLLM engine is asleep: load_weights wakes it before a rollout")
        params = [
            self._vllm.SamplingParams(**sampling_kwargs(sampling, n, self.stop_ids, self.banned, seed))
            for seed in seeds
        ]
        prompts = [request(self.processor, s) for s in samples]
        outputs = self.llm.generate(prompts, params, use_tqdm=False, lora_request=self.lora_request)
        check_prompts(outputs, samples, encoded)
        return package(outputs, n, self.pad_id, samples)

    def metrics(self) -> dict:
        """``rollout/weight_sync_gathers``: the all-gathers this rank's weight syncs ran
        since the last call (one per FSDP2 unit a full sync; vLLM samples with its own
        copy of the weights, so a rollout gathers nothing)."""
        count, self.synced_gathers = self.synced_gathers, 0
        return {"rollout/weight_sync_gathers": count}

    def sleep(self) -> None:
        """Free the engine's GPU memory for the update (sleep mode): the KV cache is
        dropped, and the weights too (level 2), or, with LoRA, whose base never
        changes, offloaded to host memory (level 1)."""
        if self.settings.sleep_mode and self.awake:
            self.llm.sleep(level=1 if self.lora_rank else 2)
            self.awake = False

    @torch.no_grad()
    def load_weights(self, model: torch.nn.Module) -> None:
        """Bring the engine to the policy's current weights, waking it if it sleeps:
        weights first, then the sync, the cache resets, and the KV cache last."""
        asleep = not self.awake
        if asleep:
            # memory the trainer freed sits in torch's cache, out of vLLM's reach
            torch.cuda.empty_cache()
            self.llm.wake_up(tags=["weights"])
        if self.lora_rank:
            self._sync_adapter(model)
        else:
            self._sync_weights(model)
        self.llm.reset_prefix_cache()
        self.llm.reset_mm_cache()
        # vision/audio embeddings cached by media hash came from the old encoder weights
        self.llm.llm_engine.reset_encoder_cache()
        if asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self.awake = True

    def _sync_weights(self, model: torch.nn.Module) -> None:
        """Copy every weight, bucket by bucket; every parameter of vLLM's model must be
        loaded (after level-2 sleep an unloaded one would hold garbage)."""
        loaded: set = set()
        self.synced_gathers += weight_gathers(model)
        for bucket in full_weights(model, self.settings.sync_bucket_mb * 2**20):
            for names in self.llm.apply_model(_LoadWeights(bucket)):
                loaded |= names
            del bucket
        missing = sorted(set.union(*self.llm.apply_model(_parameter_names)) - loaded)
        if missing:
            raise OmniRLError(
                f"the weight sync left {len(missing)} of vLLM's parameters unloaded (first: {missing[:3]}): "
                "the model's parameter names do not map onto vLLM's for this family"
            )

    def _sync_adapter(self, model: torch.nn.Module) -> None:
        """Write the adapter alone (gathered from FSDP2 shards) and serve it as a new
        LoRA request; the engine's base weights are never modified."""
        adapter = {
            k: v.full_tensor() if hasattr(v, "full_tensor") else v
            for k, v in model.state_dict().items()
            if "lora_" in k
        }
        self.version += 1
        path = self.lora_dir / f"v{self.version}"
        model.save_pretrained(str(path), state_dict=adapter)  # peft keeps the adapter's own keys
        previous = self.lora_dir / f"v{self.version - 1}"
        if previous.exists():
            shutil.rmtree(previous)
        self.lora_request = self._vllm.lora.request.LoRARequest(f"policy-v{self.version}", self.version, str(path))
