"""Likelihoods of stochastic flow-matching samplers (Flow-Noise and Flow-SDE, after pi_RL).

Convention (openpi): ``x_t = t * eps + (1 - t) * a`` and the network predicts the
velocity ``v ~ eps - a``; sampling runs t from 1 (noise) to 0 (action) in K steps of
``delta = 1 / K``. The deterministic (ODE) step is ``x_{t-delta} = x_t - delta * v``.

A stochastic step draws ``x_{t-delta} ~ N(mean, std^2)``:
  - Flow-Noise: mean is the ODE step, std comes from a learned noise head, bounded in
    [sigma_min, sigma_max];
  - Flow-SDE: the ODE turned into an SDE with the same marginals,
    ``mean = x_t - delta * v - sigma_t^2 * delta / (2 t) * (x_t + (1 - t) * v)``,
    ``std = sqrt(delta) * sigma_t``, ``sigma_t = a * sqrt(t / (1 - t))``.

Shapes: ``x``, ``v``: [N, H, D] (N chunks, H actions per chunk, D action dims);
``t``: a float or [N, 1, 1].
"""

from __future__ import annotations

import math

import torch

LOG_2PI = math.log(2 * math.pi)


def _exact(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """The tensors in their common dtype, fp32 at least: a bf16 mean or std (a noise
    head under FSDP2 bf16-mixed, with no autocast) is the one a sample was drawn with,
    and its density is computed exactly, as autocast computes ``log`` on CUDA."""
    dtype = torch.float32
    for t in tensors:
        dtype = torch.promote_types(dtype, t.dtype)
    return [t.to(dtype) for t in tensors]


def gaussian_logpdf(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """Elementwise log N(x; mean, std^2), in fp32 at least."""
    x, mean, std = _exact(x, mean, std)
    return -0.5 * ((x - mean) / std) ** 2 - torch.log(std) - 0.5 * LOG_2PI


def gaussian_entropy(std: torch.Tensor) -> torch.Tensor:
    """Elementwise entropy of N(., std^2), in fp32 at least."""
    (std,) = _exact(std)
    return 0.5 * (LOG_2PI + 1.0) + torch.log(std)


def ode_step(x: torch.Tensor, v: torch.Tensor, delta: float) -> torch.Tensor:
    """The deterministic Euler step from t to t - delta."""
    return x - delta * v


def bounded_std(raw: torch.Tensor, sigma_min: float, sigma_max: float) -> torch.Tensor:
    """A noise head's raw output mapped into [sigma_min, sigma_max]."""
    return sigma_min + (sigma_max - sigma_min) * torch.sigmoid(raw)


def sde_sigma(t: torch.Tensor | float, delta: float, noise_level: float) -> torch.Tensor:
    """``sigma_t = a * sqrt(t / (1 - t))``; at t = 1, where it is infinite, the
    denominator uses the next time 1 - delta instead."""
    t = torch.as_tensor(t, dtype=torch.float32)
    below_one = torch.where(t >= 1.0, torch.full_like(t, 1.0 - delta), t)
    return noise_level * torch.sqrt(t / (1.0 - below_one))


def sde_step(
    x: torch.Tensor, v: torch.Tensor, t: torch.Tensor | float, delta: float, noise_level: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and std of the Flow-SDE transition from t to t - delta."""
    t = torch.as_tensor(t, dtype=x.dtype, device=x.device)
    sigma = sde_sigma(t, delta, noise_level).to(x.dtype)
    mean = x - delta * v - sigma**2 * delta / (2 * t) * (x + (1 - t) * v)
    return mean, torch.sqrt(torch.as_tensor(delta, dtype=x.dtype)) * sigma * torch.ones_like(x)


def chain_logprob(
    chain: torch.Tensor, means: torch.Tensor, stds: torch.Tensor, stochastic: torch.Tensor, include_start: bool
) -> torch.Tensor:
    """Log-likelihood of a denoising chain, per action element.

    Args:
        chain: [N, K+1, H, D], x at t = 1 (the start noise), then after each step.
        means, stds: [N, K, H, D], each step's transition distribution.
        stochastic: [N, K] bool, which steps were sampled (the others were the ODE and
            add nothing).
        include_start: add log N(x_start; 0, I) (Flow-Noise's full chain likelihood).

    Returns:
        [N, H, D]: the summed log-probabilities of the stochastic transitions (and start).
    """
    steps = gaussian_logpdf(chain[:, 1:], means, stds) * stochastic[:, :, None, None]
    total = steps.sum(dim=1)
    if include_start:
        start = chain[:, 0]
        total = total + gaussian_logpdf(start, torch.zeros_like(start), torch.ones_like(start))
    return total


def reduce_logprob(elementwise: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """A chunk's log-prob from per-element ones over the executed actions and real
    action dims (``mask``: [H, D] or [N, H, D], 1 where counted).

    mode 'sum' gives the chain's likelihood; 'mean' averages it per counted element,
    which divides the PPO ratio's log by their count (the steps of the chain are summed
    either way)."""
    mask = mask.to(elementwise.dtype).expand_as(elementwise)
    total = (elementwise * mask).sum(dim=(1, 2))
    if mode == "sum":
        return total
    if mode == "mean":
        return total / mask.sum(dim=(1, 2)).clamp(min=1.0)
    raise ValueError(f"log-prob reduction '{mode}': use 'sum' or 'mean'")
