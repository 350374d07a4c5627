"""FSDP2's weight gathers outside training: held through a generation, and counted.

A decoder layer sharded with ``reshard_after_forward=True`` frees its gathered weights
after every forward, which is what training wants (the backward gathers them again)
and what a decode loop does not: it calls the model once per token, so every token
would all-gather every layer again. ``held_gathered`` keeps each unit's weights from the
first forward in the block (the prefill) to its end, then frees them and restores the
units' settings. Every unit the engine shards is ``track``-ed: a pre-forward hook that
adds, while a count is open, the bytes the unit's gather moves into each rank.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor


@dataclass
class GatherCount:
    """Bytes all-gathered into this rank while the count was open."""

    bytes: int = 0


# unit -> its reshard_after_forward at wrap time (restored after a held block)
_UNITS: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()
_OPEN: ContextVar[GatherCount | None] = ContextVar("omni_rl_gather_count", default=None)


def own_parameters(unit: nn.Module) -> list[tuple[nn.Module, str]]:
    """(owner, name) of the parameters ``unit`` shards itself: those of its subtree that
    no inner FSDP2 unit holds."""
    from torch.distributed.fsdp import FSDPModule

    inner = [m for m in unit.modules() if m is not unit and isinstance(m, FSDPModule)]
    taken = {id(p) for m in inner for p in m.parameters()}
    return [
        (owner, name)
        for owner in unit.modules()
        for name, p in owner.named_parameters(recurse=False)
        if id(p) not in taken
    ]


def track(unit: nn.Module, reshard_after_forward: bool, compute_dtype: torch.dtype | None) -> None:
    """Remember a unit just sharded (its ``reshard_after_forward``) and count its
    gathers: call after ``fully_shard``. ``compute_dtype``: the mixed-precision policy's
    ``param_dtype`` (None: the parameters' own)."""
    params = own_parameters(unit)
    unique = {id(p): p for p in (getattr(owner, name) for owner, name in params)}  # a tied weight is gathered once
    size = sum(p.numel() * (compute_dtype or p.dtype).itemsize for p in unique.values())
    _UNITS[unit] = reshard_after_forward

    def count_gather(module, args):
        count = _OPEN.get()
        if count is None or not params:
            return
        owner, name = params[0]
        if isinstance(getattr(owner, name), DTensor):  # sharded now: this forward gathers it
            count.bytes += size

    # before FSDP2's own pre-forward hook (registered first, also in front), which gathers
    unit.register_forward_pre_hook(count_gather, prepend=True)


def tracked(module: nn.Module) -> bool:
    """Whether ``module`` is a unit ``track`` counts (one the engine sharded)."""
    return module in _UNITS


@contextmanager
def counting_gathers() -> Iterator[GatherCount]:
    """The bytes the tracked units all-gather into this rank inside the block."""
    count = GatherCount()
    token = _OPEN.set(count)
    try:
        yield count
    finally:
        _OPEN.reset(token)


@contextmanager
def held_gathered(model: nn.Module) -> Iterator[None]:
    """Within: each tracked unit of ``model`` keeps the weights its first forward gathers
    until the block ends, when they are freed and the units' settings restored. A model
    with no tracked unit (one process, DDP) runs as it is."""
    units = [m for m in model.modules() if tracked(m)]
    for unit in units:
        unit.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        for unit in units:
            unit.set_reshard_after_forward(_UNITS[unit], recurse=False)
            unit.reshard()


def full_entries(model: nn.Module, names: set[str] | None = None):
    """(name, full tensor) of every state entry, or of those in ``names``: unit by unit
    under FSDP2 (each gathered while its entries are read; a consumer copies each before
    the next; a unit holding none of ``names`` is not gathered), then what no unit shards
    (buffers); the state dict's own order without FSDP2. Every rank must ask alike (the
    gathers are collectives)."""
    wanted = (lambda name: True) if names is None else names.__contains__
    units = [m for m in model.modules() if tracked(m)]
    state = model.state_dict()
    if not units:
        yield from ((name, value) for name, value in state.items() if wanted(name))
        return
    prefixes = {id(m): name for name, m in model.named_modules()}
    done = set()
    for unit in units:
        entries = [(owner, name, f"{prefixes[id(owner)]}.{name}".lstrip(".")) for owner, name in own_parameters(unit)]
        entries = [(owner, name, full) for owner, name, full in entries if full in state and wanted(full)]
        if not entries:
            continue
        unit.unshard()
        try:
            for owner, name, full in entries:
                if full not in done:
                    done.add(full)
                    yield full, getattr(owner, name)  # the gathered tensor while the unit is unsharded
        finally:
            unit.reshard()
    for name, value in state.items():
        if name not in done and wanted(name):
            yield name, value.full_tensor() if hasattr(value, "full_tensor") else value
