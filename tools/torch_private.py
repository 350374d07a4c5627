"""Every private PyTorch interface the memory tracers use, behind small functions.

``tools/trace_memory.py`` and ``tools/trace_flow.py`` need things PyTorch offers no public
way to do: join a process group that moves no data, read the value a fake tensor was made
from, stand aside while DTensor propagates shardings, restart a memory tracker's peak and
ask which modules ran at it, and read the profiler's raw allocation events. Each is here
and nowhere else; ``tests/test_torch_private.py`` runs every function against the
installed torch, so a release that changes one fails that test by name instead of a
trace minutes in. Written against torch 2.14.

The module's other imports are private by path only: ``no_dispatch`` (run kernels on real
tensors whatever modes are active), ``TorchDispatchMode`` (the base class PyTorch's
"extending" documentation names) and the pytree helpers.
"""

from __future__ import annotations

from collections.abc import Callable
from copy import deepcopy
from functools import partial
from unittest import mock

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._mode_utils import no_dispatch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import arg_tree_leaves, tree_flatten, tree_map, tree_map_only

__all__ = [
    "Propagation",
    "TorchDispatchMode",
    "arg_tree_leaves",
    "autograd_node",
    "fake_constant",
    "fake_tolist",
    "forget_module",
    "in_backward",
    "join_fake_process_group",
    "memory_events",
    "module_tracking_without_cycles",
    "no_dispatch",
    "peak_tracker",
    "restart_peak",
    "tolist_answered_by",
    "track_frozen_shards",
    "tree_flatten",
    "tree_map",
    "tree_map_only",
]

FAKE_TOLIST = FakeTensor.tolist


def join_fake_process_group(world: int) -> None:
    """Join, as rank 0, a process group of ``world`` ranks whose collectives move no data
    (the ``fake`` backend, registered by importing its module from PyTorch's tests)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())


def fake_constant(t: FakeTensor) -> torch.Tensor | None:
    """The real value the fake mode keeps for a one-element fake tensor made from Python
    numbers (AdamW's step count), or None."""
    return t.constant


def fake_tolist(t: FakeTensor):
    """The stock ``FakeTensor.tolist`` (one dispatched read per element)."""
    return FAKE_TOLIST(t)


def tolist_answered_by(answer: Callable[[FakeTensor], list]):
    """A context in which ``FakeTensor.tolist`` is ``answer``."""
    return mock.patch.object(FakeTensor, "tolist", lambda t: answer(t))


class Propagation:
    """DTensor's sharding propagation runs each operation once more on fake tensors of
    the whole (unsharded) shapes, in the active fake mode: metadata only, which on a GPU
    costs no memory. ``depth`` is above 0 while it runs (inside ``hidden()``), so that
    trackers and modes can stand aside."""

    depth = 0

    @classmethod
    def hidden(cls):
        from torch.distributed.tensor._sharding_prop import ShardingPropagator

        original = ShardingPropagator._propagate_tensor_meta_non_cached

        def propagate(self, *args, **kwargs):
            cls.depth += 1
            try:
                return original(self, *args, **kwargs)
            finally:
                cls.depth -= 1

        return mock.patch.object(ShardingPropagator, "_propagate_tensor_meta_non_cached", propagate)


def module_tracking_without_cycles():
    """The trackers' ``ModTracker`` without the reference cycle its backward hooks make.

    It hooks the inputs of every module's forward with ``register_multi_grad_hook`` in
    its "all" mode, whose hook keeps a list of the inputs' graph nodes that the nodes'
    own hooks refer to: each forward's graph then lives until the garbage collector
    happens to run, not until its last tensor dies as in the step without trackers (the
    7B trace's peak moved by 4 GB with the collector's timing). The "any" mode keeps no
    such list; the module's backward is then marked done at its first input's gradient
    instead of its last (the same for a module of one input), which moves no byte."""
    from torch.autograd.graph import register_multi_grad_hook
    from torch.distributed._tools import mod_tracker

    return mock.patch.object(mod_tracker, "register_multi_grad_hook", partial(register_multi_grad_hook, mode="any"))


class _NoHook:
    """The handle of a gradient hook never installed."""

    def remove(self) -> None:
        pass


def peak_tracker(
    model,
    optimizer,
    fsdp: bool,
    stand_aside: Callable[[], bool] = lambda: False,
    where: Callable[[], str] | None = None,
):
    """``FSDPMemTracker`` (``MemTracker`` without FSDP2) that keeps the global peak only
    (the stock ones also update every module's peak at every operation, which costs more
    than a 7B trace itself) and records, at each new peak, the module running and the
    pass: ``tracker.running = (its name, in backward)`` (None before a peak), the name (``ModTracker``'s, from
    the root's class) of the module entered last, by its forward or its backward, and not
    left yet; None outside every module. (``ModTracker.parents`` is no such answer: it
    is a set, and in a backward it keeps modules whose inputs need no gradient, and a
    module the shared-prefix forward ran twice, until the backward ends.) With ``where``,
    ``tracker.site`` is what it says at each new peak (the line that issued the
    operation). An operation issued while ``stand_aside()`` is true is not counted."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker

    base = FSDPMemTracker if fsdp else MemTracker

    class Tracker(base):
        running: tuple[str | None, bool] | None = None
        site: str | None = None

        def __enter__(self):
            super().__enter__()
            if self._depth == 1:
                self.entered = _follow_modules(self._mod_tracker)
            return self

        def __exit__(self, *args) -> None:
            super().__exit__(*args)
            if self._depth == 0:
                self._mod_tracker.clear_user_hooks()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if stand_aside():
                return func(*args, **(kwargs or {}))
            return super().__torch_dispatch__(func, types, args, kwargs)

        # A sparse tensor (a tied weight's lookup gradient, ``forward.accumulate_in_place``)
        # has no storage of its own: its indices' and its values' are what it holds. The
        # stock tracker asks every tensor an operation makes (``_track``) and every
        # gradient a parameter is sent (``_update_and_maybe_create_winfos``) for one.
        def _track(self, reftype, t) -> None:
            for part in (t._indices(), t._values()) if t.is_sparse else (t,):
                super()._track(reftype, part)

        def _update_and_maybe_create_winfos(self, t, reftype, update_existing=False):
            parts = (t._indices(), t._values()) if t.is_sparse else (t,)
            return set().union(
                *(
                    super(Tracker, self)._update_and_maybe_create_winfos(part, reftype, update_existing)
                    for part in parts
                )
            )

        def _update_peak_stats(self, peak_state) -> None:
            for device, snapshot in self._curr_mem_snap.items():
                if self._peak_mem.get(device, 0) < snapshot["Total"]:
                    self._peak_mem[device] = snapshot["Total"]
                    self._peak_mem_snap[device] = dict(snapshot)
                    backward = self._mod_tracker.is_bw
                    self.running = (_running(self.entered, backward), backward)
                    self.site = where() if where is not None else None

    if fsdp:
        return Tracker(model, optimizer)
    tracker = Tracker()
    tracker.track_external(model, optimizer)
    # MemTracker hooks every parameter's gradient at its module's first forward, and a
    # frozen one refuses the hook: those take a hook that is never called
    for p in model.parameters():
        if not p.requires_grad:
            tracker._param_to_grad_hook_handles[p] = (_NoHook(), _NoHook())
    return tracker


def _follow_modules(modules) -> list[tuple[str, bool]]:
    """The modules a ``ModTracker`` sees entered and not left, in the order entered, as
    (name, by its backward): its user hooks (``MemTracker`` installs its own,
    ``FSDPMemTracker`` none) chained with ones that keep the list. A backward's entries
    can outlive it (``ModTracker`` closes a module whose inputs need no gradient by a
    callback at the end of the first backward after its forward: a second backward
    call never closes it), so a forward outside any backward drops them."""
    entered: list[tuple[str, bool]] = []

    def enter(backward: bool):
        def hook(module, *_):
            if module is None:
                return
            if not backward and not modules.is_bw:
                entered[:] = [e for e in entered if not e[1]]
            entered.append((modules.get_known_fqn(module), backward))

        return hook

    def leave(backward: bool):
        def hook(module, *_):
            name = modules.get_known_fqn(module) if module is not None else None
            for i in range(len(entered) - 1, -1, -1):
                if entered[i] == (name, backward):
                    del entered[i]
                    break

        return hook

    def chained(step, inner):
        if inner is None:
            return step

        def both(*args):
            step(*args)
            inner(*args)

        return both

    names = ("_user_pre_fw_hook", "_user_post_fw_hook", "_user_pre_bw_hook", "_user_post_bw_hook")
    hooks = [getattr(modules, name) for name in names]
    ours = (enter(False), leave(False), enter(True), leave(True))
    modules.clear_user_hooks()
    modules.register_user_hooks(*(chained(step, hook) for step, hook in zip(ours, hooks, strict=True)))
    return entered


def _running(entered: list[tuple[str, bool]], backward: bool) -> str | None:
    """The module entered last and not left: in a backward, by either pass (a
    checkpointed block's recompute is a forward inside it); outside one, by a forward."""
    names = [name for name, by_backward in entered if backward or not by_backward]
    return names[-1] if names else None


def autograd_node() -> str | None:
    """The name of the autograd node whose backward is running (``MmBackward0``), or None
    outside a backward."""
    node = torch._C._current_autograd_node()
    return None if node is None else node.name()


def restart_peak(tracker) -> dict:
    """Start the tracker's peak again from what is live now (the trackers keep one peak
    since they started); returns the current snapshot."""
    current = tracker.get_tracker_snapshot("current")
    tracker._peak_mem = {d: s.get("Total", 0) for d, s in current.items()}
    tracker._peak_mem_snap = deepcopy(current)
    tracker.running = tracker.site = None
    return current


def track_frozen_shards(tracker, params) -> None:
    """Count ``params`` (a frozen FSDP2 model's, which the tracker was not built on) as
    sharded parameters."""
    from torch.distributed._tools.fsdp2_mem_tracker import _FSDPRefType

    for p in params:
        tracker._update_and_maybe_create_winfos(p, _FSDPRefType.SHARDED_PARAM)


def in_backward(tracker) -> bool:
    """Whether the tracker's module tracking is inside a backward pass."""
    return tracker._mod_tracker.is_bw


def forget_module(tracker, module) -> None:
    """Let ``module`` run again in the tracker's iteration: the trackers take a second
    call of a module for a new iteration and refuse it (only the global peak is read
    here, so nothing is lost)."""
    if module in tracker.memory_tracking:
        del tracker.memory_tracking[module]


def memory_events(profiler, prefix: str) -> tuple[list[tuple[int, int]], list[tuple[str, int, int]]]:
    """From a finished ``torch.profiler.profile(profile_memory=True)``: every allocation
    and free as (time in ns, bytes: negative when freed), in time order, and the ranges
    ``record_function`` opened with a name starting with ``prefix`` as (the name after
    the prefix, start, end)."""
    events = profiler.profiler.kineto_results.events()
    allocations = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    ranges = [
        (e.name().removeprefix(prefix), e.start_ns(), e.start_ns() + e.duration_ns())
        for e in events
        if e.name().startswith(prefix)
    ]
    return allocations, ranges
