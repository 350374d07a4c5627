"""Reward plug-ins that tests load by module path (``rewards.custom``): a tiny random
model never answers the synthetic questions, so multi-process tests reward something
it does vary on, to give the update non-zero advantages; others return values outside
[0, 1] or non-finite ones, for the reward-range tests."""

from __future__ import annotations

from omni_rl.rewards import RewardResult


def vowel_share(response: str, target) -> float:
    """The share of the response's characters that are ASCII vowels."""
    return sum(c in "aeiouAEIOU" for c in response) / max(len(response), 1)


def signed(response: str, target) -> float:
    """A plug-in with its own range: -1 for a refusal, 2 for an answer in bold, else 0."""
    if "sorry" in response.lower():
        return -1.0
    return 2.0 if "**" in response else 0.0


def unstable(response: str, target) -> float:
    """A buggy plug-in: the response read as a float ("nan", "inf"...), 1 when it is none."""
    try:
        return float(response)
    except ValueError:
        return 1.0


def nan_format(response: str, target) -> RewardResult:
    """A buggy plug-in returning a full result whose format alone is nan."""
    return RewardResult(0.5, 1.0, float("nan"), {"why": "format left undefined"})
