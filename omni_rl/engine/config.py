"""The training engine's config sections: the loop (``trainer:``) and the optimizer
(``optimizer:``, chosen by ``type:``). Every recipe's config holds these two."""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from omni_rl.config import Choice, ModeDefaults, require, require_unset
from omni_rl.registry import Registry

log = logging.getLogger(__name__)

Precision = Literal["auto", "fp32", "bf16-mixed", "bf16-pure"]
Strategy = Literal["auto", "fsdp", "ddp", "single"]
Schedule = Literal["constant", "linear", "cosine"]


@dataclass
class TrainerConfig(ModeDefaults):
    """The optimization loop and how the engine runs it."""

    UNSET: ClassVar[dict[str, Any]] = {"min_lr_ratio": 0.0}

    steps: int = 30
    """Optimizer steps (GRPO and SFT: training steps; each may hold several optimizer
    steps through ``algorithm.mini_batch_prompts`` and ``epochs``)."""
    log_every: int = 1
    """Write a metrics row (JSONL, TensorBoard) every this many steps, and at the last."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm (over all shards) to this; 0 disables clipping."""
    warmup_steps: int = 0
    """Linear learning-rate warm-up from 0 over this many optimizer steps; a warning
    says when it leaves a linear or cosine schedule no step to decay in, or is longer
    than the run."""
    schedule: Schedule = "constant"
    """Learning rate after warm-up: constant, linear decay or cosine decay to
    ``min_lr_ratio`` x lr at the last optimizer step."""
    min_lr_ratio: float | None = None
    """Where linear and cosine schedules end, as a fraction of the peak rate; unset: 0.
    Refused under the constant schedule."""
    save_every: int = 0
    """Write a checkpoint every this many steps (0: only at the end)."""
    keep_last: int = 2
    """Checkpoints kept on disk."""
    eval_every: int = 0
    """Evaluate the ``data.eval`` sets every this many steps (0: only at the end)."""
    best_metric: str | None = None
    """Keep the model that scored highest on this eval metric (``eval/NAME/METRIC``, as
    logged) in ``OUTPUT_DIR/best/model``; unset: keep no best."""
    precision: Precision = "auto"
    """fp32; bf16-mixed (fp32 master weights and optimizer state, bf16 compute, fp32
    gradient reduction); bf16-pure (bf16 weights stepped in place: an update smaller
    than bf16's resolution, about 0.4% of a weight, is lost, so lr 1e-6 barely moves
    a model; for memory experiments only); auto: bf16-mixed on CUDA, fp32 on CPU."""
    strategy: Strategy = "auto"
    """fsdp (FSDP2 fully_shard per decoder layer and encoder block), ddp (every rank
    holds the whole model), single (one process); auto: fsdp under torchrun with more
    than one process, else single."""
    micro_batch_size: int = 0
    """Gradient accumulation: items per forward/backward (GRPO: prompts with their G
    completions; SFT: rows; flow PPO: chunks); 0 runs each mini-batch in one pass."""
    max_tokens_per_microbatch: int = 0
    """Gradient accumulation by length: items are packed, longest first, into forwards
    of at most this many (padded) tokens (GRPO: a prompt counts once plus its G
    completions; SFT: prompt plus target), together with ``micro_batch_size`` when both
    are set; an item longer than the budget runs alone. 0: off."""
    max_bad_steps: int = 3
    """Stop the run after this many optimizer steps in a row had non-finite gradients."""
    dist_timeout_minutes: float = 30.0
    """How long a rank waits at a collective (barrier, all-gather) under torchrun before
    the run fails; covers rank 0's exports and checkpoint writes (torch's NCCL default: 10)."""

    def __post_init__(self):
        require(self.steps >= 1, "steps", "must be >= 1")
        require(self.log_every >= 1, "log_every", "must be >= 1")
        require(self.max_grad_norm >= 0, "max_grad_norm", "must be >= 0")
        require(self.warmup_steps >= 0, "warmup_steps", "must be >= 0")
        if self.schedule == "constant":
            require_unset({"min_lr_ratio": self.min_lr_ratio}, "schedule: constant")
        require(0 <= self.setting("min_lr_ratio") <= 1, "min_lr_ratio", "must be in [0, 1]")
        require(self.save_every >= 0, "save_every", "must be >= 0")
        require(self.keep_last >= 1, "keep_last", "must be >= 1")
        require(self.eval_every >= 0, "eval_every", "must be >= 0")
        require(
            self.best_metric is None or self.best_metric.startswith("eval/"),
            "best_metric",
            "an eval metric as logged: eval/NAME/METRIC",
        )
        require(self.micro_batch_size >= 0, "micro_batch_size", "must be >= 0")
        require(self.max_tokens_per_microbatch >= 0, "max_tokens_per_microbatch", "must be >= 0")
        require(self.max_bad_steps >= 1, "max_bad_steps", "must be >= 1")
        require(self.dist_timeout_minutes > 0, "dist_timeout_minutes", "must be > 0")


OPTIMIZERS: Registry[type] = Registry("optimizer")


@dataclass
class OptimizerConfig(Choice, ABC):
    """An optimizer, chosen by ``type:``."""

    registry: ClassVar[Registry] = OPTIMIZERS
    default_type: ClassVar[str] = "adamw"

    lr: float = 1e-5
    """Learning rate."""
    weight_decay: float = 0.0
    """Weight decay, on every trained parameter (norm weights, biases and embeddings
    too, as verl's; transformers' Trainer spares biases and norms). Decoupled under
    ``adamw``; under ``sgd`` an L2 term added to the gradient, which passes through the
    momentum (about 10x the decoupled shrink at momentum 0.9)."""

    def __post_init__(self):
        require(self.lr > 0, "lr", "must be > 0")
        require(self.weight_decay >= 0, "weight_decay", "must be >= 0")

    @abstractmethod
    def build(self, params: Iterable, device: Any = None) -> Any:
        """The torch optimizer over ``params`` (tensors or param-group dicts) on
        ``device`` (a torch.device; None: the CPU)."""


@OPTIMIZERS.register("adamw")
@dataclass
class AdamWConfig(OptimizerConfig):
    """torch.optim.AdamW."""

    betas: tuple[float, float] = (0.9, 0.999)
    """Adam's moment decay rates."""
    eps: float = 1e-8
    """Adam's denominator epsilon."""

    def __post_init__(self):
        super().__post_init__()
        require(all(0 <= b < 1 for b in self.betas), "betas", "each must be in [0, 1)")
        require(self.eps >= 0, "eps", "must be >= 0")

    def build(self, params: Iterable, device: Any = None) -> Any:
        import torch

        kernel = adamw_kernel(device)
        log.info("AdamW: the %s kernel", kernel)
        return torch.optim.AdamW(
            params, lr=self.lr, betas=self.betas, eps=self.eps, weight_decay=self.weight_decay, **{kernel: True}
        )


def adamw_kernel(device: Any) -> str:
    """``fused`` on CUDA (one kernel over every tensor, no fp32 copy of the shard for
    the update), ``foreach`` elsewhere (on a CPU it gives the per-tensor loop's values,
    to the bit)."""
    return "fused" if device is not None and device.type == "cuda" else "foreach"


@OPTIMIZERS.register("sgd")
@dataclass
class SGDConfig(OptimizerConfig):
    """torch.optim.SGD with momentum."""

    momentum: float = 0.9
    """Momentum factor."""

    def __post_init__(self):
        super().__post_init__()
        require(0 <= self.momentum < 1, "momentum", "must be in [0, 1)")

    def build(self, params: Iterable, device: Any = None) -> Any:
        import torch

        return torch.optim.SGD(params, lr=self.lr, momentum=self.momentum, weight_decay=self.weight_decay)
