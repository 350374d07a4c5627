"""Shared fixtures: pinned torch threads and tiny checkpoints built once per session."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("OMNI_RL_THREADS", "2")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from omni_rl.runtime import set_threads

set_threads()


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """``tiny_checkpoint(family)`` -> directory of a seed-0 tiny model, built once."""
    from omni_rl.models import build_tiny

    built: dict[str, object] = {}

    def get(family: str):
        if family not in built:
            built[family] = build_tiny(family, tmp_path_factory.mktemp(family), seed=0)
        return built[family]

    return get
