"""The rollout section (``rollout:``, with ``vllm:``): how completions are sampled."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from omni_rl.config import require


@dataclass
class VLLMConfig:
    """The vLLM engine (rollout.engine: vllm; GPU machines with the vllm extra)."""

    gpu_memory_utilization: float = 0.5
    """Share of GPU memory vLLM may take (the trainer needs the rest)."""
    tensor_parallel_size: int = 1
    """GPUs one engine spans."""
    max_model_len: int = 32768
    """Longest prompt plus completion, in tokens."""
    enforce_eager: bool = False
    """Skip CUDA graph capture (slower decoding, faster start)."""

    def __post_init__(self):
        require(0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization", "must be in (0, 1]")
        require(self.tensor_parallel_size >= 1, "tensor_parallel_size", "must be >= 1")


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
    """Prompts longer than this (media tokens included) are skipped and counted."""

    def __post_init__(self):
        require(self.n >= 2, "n", "GRPO needs at least 2 completions per prompt")
        require(self.temperature > 0, "temperature", "must be > 0 for RL")
        require(0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        require(self.max_new_tokens >= 1, "max_new_tokens", "must be >= 1")
