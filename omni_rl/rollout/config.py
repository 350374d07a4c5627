"""The rollout section (``rollout:``, with ``vllm:``): how completions are sampled."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from omni_rl.config import require


@dataclass
class VLLMConfig:
    """The vLLM engine (rollout.engine: vllm; GPU machines with the vllm extra)."""

    gpu_memory_utilization: float = 0.5
    """Share of this GPU's whole memory that vLLM's weights, activations and KV cache
    may take while it samples; it must be free when the engine starts, beside the
    trainer's weights and optimizer state (checked, with the figures, at start)."""
    tensor_parallel_size: int = 1
    """GPUs one engine spans. Only 1: every rank runs its own engine on its own GPU
    (data-parallel rollout under torchrun)."""
    max_model_len: int = 32768
    """Longest prompt plus completion, in tokens: at least rollout.max_prompt_length
    + rollout.max_new_tokens, and at most the model's position limit."""
    enforce_eager: bool = False
    """Skip CUDA graph capture (slower decoding, faster start)."""
    sleep_mode: bool = True
    """Free vLLM's GPU memory while the trainer updates: after each rollout the engine
    sleeps (KV cache dropped; weights dropped too, or offloaded to host memory with
    LoRA, whose base weights never change) and wakes for the next one."""
    sync_bucket_mb: int = 1024
    """Weights are gathered (from FSDP2 shards) and copied into the engine in buckets
    of this many megabytes, so the copy never holds a second full model."""

    def __post_init__(self):
        require(0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization", "must be in (0, 1]")
        require(
            self.tensor_parallel_size == 1,
            "tensor_parallel_size",
            "tensor-parallel rollout is not supported: each rank runs its own vLLM engine on its own GPU "
            "(launch with torchrun for data-parallel rollout); for a model whose weights do not fit one GPU "
            "beside the trainer, use rollout.engine: hf with trainer.strategy: fsdp",
        )
        require(self.max_model_len >= 2, "max_model_len", "must be >= 2")
        require(self.sync_bucket_mb >= 1, "sync_bucket_mb", "must be >= 1")


@dataclass
class RolloutConfig:
    """How completions are sampled during training."""

    engine: Literal["hf", "vllm"] = "hf"
    """Generation engine: hf (CPUs and GPUs, samples with the policy itself) or vllm
    (GPUs, ``pip install omni-rl[vllm]``; weights copied in after each update)."""
    vllm: VLLMConfig = field(default_factory=VLLMConfig)
    """vLLM engine settings (used when engine is vllm)."""
    n: int = 8
    """Completions per prompt (the group size G)."""
    temperature: float = 1.0
    """Sampling temperature (> 0)."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    top_k: int = 0
    """Sample among the k most likely tokens; 0 disables."""
    max_new_tokens: int = 256
    """Longest completion."""
    max_prompt_length: int = 16384
    """Prompts longer than this (media tokens included) are skipped and counted, and so
    are prompts that leave max_new_tokens no room within the model's positions (hf) or
    vllm.max_model_len (vllm)."""
    staleness: Literal[0, 1] = 0
    """0: each step's prompts are generated with the weights being trained, then the
    update runs. 1 (one-step-off): the last of torchrun's processes generates step k+1's
    prompts with step k's weights while the others train on step k's (launch one
    process more than the trainers); weights are pushed to it after every step, and the
    correction of ``algorithm.rollout_correction`` (auto: tis) weighs the stale tokens.
    The batch after each checkpoint is generated with the checkpoint's weights, so a
    resumed run is the uninterrupted one."""
    gather_once: bool = True
    """hf engine under FSDP2: each sharded layer's weights are gathered once per rollout
    and held to its last token (a 7B model's bf16 weights, about 15 GB a rank, for the
    rollout's length); false gathers them again for every decoded token, as training's
    forwards do, and logs it (``rollout/gathered_bytes_per_token``)."""
    reuse_prefill: bool = True
    """hf engine: the update's forward reads the rollout's prefill of the prompts (made
    under autograd and held through the decoding) instead of running the prompts and
    their media again; the same numbers, one prompt forward a step fewer. Taken where
    the update's forward is the rollout's: one process (trainer.strategy single), no
    gradient checkpointing, no dropout, one update of the whole batch in one forward
    (epochs 1, no mini- or micro-batches), no dynamic sampling, no mask correction;
    otherwise the log says once why not. ``update/prefill_reused`` is 1 on steps that
    read it."""

    def __post_init__(self):
        require(self.n >= 2, "n", "GRPO needs at least 2 completions per prompt")
        require(self.temperature > 0, "temperature", "must be > 0 for RL")
        require(0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        require(self.top_k >= 0, "top_k", "must be >= 0 (0 disables)")
        require(self.max_new_tokens >= 1, "max_new_tokens", "must be >= 1")
        require(self.max_prompt_length >= 1, "max_prompt_length", "must be >= 1")
        if self.engine == "vllm":
            require(
                self.staleness == 0,
                "staleness",
                "the one-step-off rollout runs the hf engine in its own process; with vllm use staleness: 0",
            )
            require(self.gather_once, "gather_once", "belongs to the hf engine: vLLM holds its own copy of the weights")
            longest = self.max_prompt_length + self.max_new_tokens
            require(
                self.vllm.max_model_len >= longest,
                "vllm.max_model_len",
                f"{self.vllm.max_model_len} is less than max_prompt_length + max_new_tokens = {longest}: "
                f"a prompt of the allowed length would abort the rollout; raise vllm.max_model_len or lower "
                f"max_prompt_length to {self.vllm.max_model_len - self.max_new_tokens}",
            )
