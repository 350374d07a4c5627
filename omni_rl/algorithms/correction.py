"""The rollout/trainer mismatch: how far the engine that sampled the completions is from
the trainer that scores them, and the corrections for it.

A rollout engine (vLLM in bf16 with its own kernels, or a stale copy of the weights)
samples from a distribution mu that differs from the trainer's pi even at the same
weights. Both log-probs are of the same processed distribution (temperature, top-k,
top-p, banned tokens), so the per-token log ratio ``log pi - log mu`` measures only the
mismatch. Shapes: N sequences, L completion tokens; ``mask`` is 1 on real tokens.
"""

from __future__ import annotations

import math
from dataclasses import astuple, dataclass

import torch


def log_ratio(trainer_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log pi(y) - log mu(y) per token, zero off the mask. [N, L] -> [N, L]."""
    return torch.where(mask.bool(), trainer_logp.float() - rollout_logp.float(), 0.0)


@dataclass
class MismatchSums:
    """Sums over real tokens (add them over micro-batches and ranks, then divide by
    ``tokens``): |log pi - log mu|; k3 = r - 1 - log r with r = pi/mu, the estimator
    of KL(mu || pi) from samples of mu (unbiased, never negative); how many tokens
    have r above the correction's cap; and of the sequences holding a real token, how
    many have their geometric-mean r above it (what GSPO's per-sequence truncation caps)."""

    abs_diff: float = 0.0
    k3: float = 0.0
    tokens: float = 0.0
    over_cap: float = 0.0
    sequences: float = 0.0
    sequences_over_cap: float = 0.0

    def __add__(self, other: MismatchSums) -> MismatchSums:
        return MismatchSums(*(a + b for a, b in zip(astuple(self), astuple(other), strict=True)))


def mismatch_sums(ratio_log: torch.Tensor, mask: torch.Tensor, cap: float) -> MismatchSums:
    """Sums of the mismatch diagnostics. ratio_log, mask: [N, L]."""
    m, ratio_log = mask.float(), ratio_log.detach()
    k3 = (torch.exp(ratio_log) - 1 - ratio_log) * m
    over = ((ratio_log > math.log(cap)).float() * m).sum()
    present = mask.bool().any(-1)
    mean_log = (ratio_log * m).sum(-1) / m.sum(-1).clamp(min=1)
    sequences_over = ((mean_log > math.log(cap)) & present).sum()
    return MismatchSums(
        float((ratio_log.abs() * m).sum()),
        float(k3.sum()),
        float(m.sum()),
        float(over),
        float(present.sum()),
        float(sequences_over),
    )


def tis_weights(ratio_log: torch.Tensor, mask: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated importance sampling: per-token weights min(pi/mu, cap), zero off the
    mask, without gradient. [N, L] -> [N, L]."""
    return torch.exp(ratio_log.detach()).clamp(max=cap) * mask.float()


def sequence_tis_weights(ratio_log: torch.Tensor, mask: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated importance sampling for sequence-level losses (GSPO): each completion's
    weight is its geometric-mean token ratio, capped, the same length normalisation as
    GSPO's own ratio. [N, L] -> [N]."""
    m = mask.float()
    mean_log = (ratio_log.detach() * m).sum(-1) / m.sum(-1).clamp(min=1)
    return torch.exp(mean_log).clamp(max=cap)


def sequence_keep(ratio_log: torch.Tensor, mask: torch.Tensor, cap: float) -> torch.Tensor:
    """Sequence masking: keep a completion whose sequence ratio prod_t pi/mu lies in
    [1/cap, cap]; bool [N]. A completion without tokens is kept (it has no loss)."""
    bound = math.log(cap)
    total = (ratio_log * mask.float()).sum(-1)
    return total.abs() <= bound
