"""Reward plug-ins that tests load by module path (``rewards.custom``): a tiny random
model never answers the synthetic questions, so multi-process tests reward something
it does vary on, to give the update non-zero advantages."""

from __future__ import annotations


def vowel_share(response: str, target) -> float:
    """The share of the response's characters that are ASCII vowels."""
    return sum(c in "aeiouAEIOU" for c in response) / max(len(response), 1)
