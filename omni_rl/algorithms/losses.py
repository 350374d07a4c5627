"""Policy-gradient losses, their aggregation over tokens, KL estimators and entropy.

Shapes: N sequences (B*G), L completion tokens (padded); ``mask`` is 1 on real tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

Aggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """log p(token) under ``logits``. logits: [N, L, V]; token_ids: [N, L] -> [N, L].

    Computed as logit - logsumexp, so no [N, L, V] log-softmax is kept for backward.
    """
    logits = logits.float()
    picked = logits.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the categorical per position. logits: [N, L, V] -> [N, L]."""
    logits = logits.float()
    log_z = torch.logsumexp(logits, dim=-1, keepdim=True)
    probs = torch.exp(logits - log_z)
    return log_z.squeeze(-1) - (probs * logits).sum(-1)


def aggregate(
    values: torch.Tensor,
    mask: torch.Tensor,
    mode: Aggregation,
    norm_length: int | None = None,
    denominator: float | None = None,
):
    """Reduce per-token values to a scalar.

    Args:
        values, mask: [N, L].
        mode: ``token-mean`` (every token weighs the same), ``seq-mean-token-mean``
            (every sequence weighs the same), ``seq-mean-token-sum-norm`` (token sums
            divided by a constant length, Dr. GRPO: no length bias).
        norm_length: the constant of ``seq-mean-token-sum-norm`` (default L).
        denominator: what the sum is divided by when these N rows are one part of a
            larger batch (micro-batches, ranks): the whole batch's token count for
            ``token-mean``, its sequence count otherwise; default: this part's own.
            The parts' results then add up to the whole batch's value.
    """
    mask = mask.to(values.dtype)
    if mode == "token-mean":
        return (values * mask).sum() / (denominator or mask.sum().clamp(min=1))
    if mode == "seq-mean-token-mean":
        per_seq = (values * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        return per_seq.sum() / (denominator or values.shape[0])
    if mode == "seq-mean-token-sum-norm":
        length = norm_length or values.shape[-1]
        return (values * mask).sum(-1).div(length).sum() / (denominator or values.shape[0])
    raise ValueError(f"unknown aggregation '{mode}'")


@dataclass(frozen=True)
class PolicyLossStats:
    """Diagnostics of a policy loss (all scalars), over the valid elements (tokens,
    action elements or chunks; sequences for GSPO) of the batch."""

    clip_fraction: float
    """Fraction of valid elements whose clipped term was the active one (strictly the
    larger loss, so the element's gradient is zero): a ratio outside the clip range on
    the side its advantage pushes it away from. A ratio out of range on the other side
    keeps its gradient and does not count."""
    dual_clip_fraction: float
    """Fraction of valid elements whose loss the dual clip bounded."""
    ratio_mean: float
    """Mean importance ratio pi / pi_old."""
    ratio_max: float
    """Largest importance ratio (1 without a valid element)."""
    approx_kl: float
    """Mean of (r - 1) - log r, an estimate of KL(pi_old || pi) (Schulman's k3)."""
    elements: int
    """How many valid elements the fractions and means are over (to pool several
    batches' stats: weigh each by it)."""


def clipped_policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    dual_clip: float | None = None,
    aggregation: Aggregation = "token-mean",
    norm_length: int | None = None,
    denominator: float | None = None,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, PolicyLossStats]:
    """PPO's clipped surrogate with separate low/high clips (DAPO's clip-higher) and
    optional dual clip for negative advantages: the one clipped surrogate of every
    recipe (GRPO per token; flow PPO per action element or per chunk, L = 1).

    Args:
        logp, old_logp, mask: [N, L]; advantages: [N] (one per sequence or chunk).
        dual_clip: c > 1 bounds the loss of a negative-advantage token by -c * A.
        denominator: see ``aggregate``.
        weights: [N, L] constants each token's loss is multiplied by (a rollout
            correction's importance weights), or None.
    Returns:
        (loss [], stats).
    """
    ratio = torch.exp(logp - old_logp)
    adv = advantages[:, None].to(ratio.dtype)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1 - eps_low, 1 + eps_high)
    per_token = torch.maximum(unclipped, clipped)
    dual = torch.zeros_like(per_token, dtype=torch.bool)
    if dual_clip is not None:
        if dual_clip <= 1:
            raise ValueError("dual_clip must be > 1")
        bound = -adv * dual_clip
        dual = (adv < 0) & (per_token > bound)
        per_token = torch.where(adv < 0, torch.minimum(per_token, bound), per_token)
    if weights is not None:
        per_token = per_token * weights.detach()
    loss = aggregate(per_token, mask, aggregation, norm_length, denominator)
    m = mask.bool()
    with torch.no_grad():
        stats = PolicyLossStats(
            clip_fraction=masked_mean((clipped > unclipped).float(), m),
            dual_clip_fraction=masked_mean(dual.float(), m),
            ratio_mean=masked_mean(ratio, m),
            ratio_max=float(ratio[m].max()) if m.any() else 1.0,
            approx_kl=masked_mean((ratio - 1) - (logp - old_logp), m),
            elements=int(m.sum()),
        )
    return loss, stats


def gspo_policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
    denominator: float | None = None,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, PolicyLossStats]:
    """GSPO: one importance ratio per sequence, the geometric mean of its token ratios,
    s = exp(mean_t(logp - old_logp)), clipped, averaged over sequences (the paper's
    clips are 3e-4 and 4e-4: s moves far less than a token's ratio does).

    Args:
        logp, old_logp, mask: [N, L]; advantages: [N].
        denominator: the whole batch's sequence count when these N are a part of it;
            default: the sequences of these N that hold a token.
        weights: [N] constants each sequence's loss is multiplied by, or None.
    Returns:
        (loss [], stats); a sequence without a token (masked out) counts nowhere.
    """
    maskf = mask.to(logp.dtype)
    present = mask.bool().any(-1)
    log_ratio = ((logp - old_logp) * maskf).sum(-1) / maskf.sum(-1).clamp(min=1)
    ratio = torch.exp(log_ratio)
    adv = advantages.to(ratio.dtype)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1 - eps_low, 1 + eps_high)
    per_seq = torch.maximum(unclipped, clipped) * present.to(ratio.dtype)
    if weights is not None:
        per_seq = per_seq * weights.detach()
    loss = per_seq.sum() / (denominator or present.sum().clamp(min=1))
    with torch.no_grad():
        stats = PolicyLossStats(
            clip_fraction=masked_mean((clipped > unclipped).float(), present),
            dual_clip_fraction=0.0,
            ratio_mean=masked_mean(ratio, present),
            ratio_max=float(ratio[present].max()) if present.any() else 1.0,
            approx_kl=masked_mean((ratio - 1) - log_ratio, present),
            elements=int(present.sum()),
        )
    return loss, stats


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: Literal["k1", "k2", "k3"]) -> torch.Tensor:
    """Per-token estimators of KL(pi || ref) from samples of pi (Schulman's k1, k2, k3).

    logp, ref_logp: [N, L] -> [N, L]. k1 = log r', k2 = (log r')^2 / 2, k3 = r - 1 - log r
    with r = ref/pi (unbiased and always >= 0).
    """
    log_ratio = logp - ref_logp
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio**2
    if kind == "k3":
        return torch.exp(-log_ratio) - 1 + log_ratio
    raise ValueError(f"unknown KL estimator '{kind}'")


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> float:
    """The mean of ``values`` where ``mask`` (any dtype, [same shape]) is set; 0 where
    nothing is."""
    mask = mask.bool()
    return float(values.detach()[mask].mean()) if mask.any() else 0.0
