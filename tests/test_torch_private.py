"""tools/torch_private.py: each private PyTorch interface the memory tracers use, run
against the installed torch, so that a release that changes one fails here by name."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

TOOLS = Path(__file__).resolve().parents[1] / "tools"


@pytest.fixture(scope="module")
def private():
    sys.path.insert(0, str(TOOLS))
    try:
        import torch_private
    finally:
        sys.path.remove(str(TOOLS))
    return torch_private


def test_a_fake_tensor_keeps_the_value_it_was_made_from(private):
    with FakeTensorMode():
        made = torch.tensor(7)
        computed = torch.zeros(3)
    assert private.fake_constant(made).item() == 7
    assert private.fake_constant(computed) is None


def test_tolist_is_answered_by_the_given_function_and_the_stock_one_still_reads(private):
    with FakeTensorMode():
        t = torch.tensor([4])
        with private.tolist_answered_by(lambda _: ["answered"]):
            assert t.tolist() == ["answered"]
        assert private.fake_tolist(t) == [4]  # one element: the fake mode keeps its value


def test_no_dispatch_runs_kernels_on_real_tensors_under_a_fake_mode(private):
    real = torch.arange(4.0)
    with FakeTensorMode(allow_non_fake_inputs=True):
        assert type(real.sum()) is not torch.Tensor  # the fake mode answers with a fake
        with private.no_dispatch():
            total = real.sum()
    assert type(total) is torch.Tensor and total.item() == 6.0


def model_and_optimizer(frozen: bool = False):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 8))
    if frozen:
        model[0].requires_grad_(False)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    return model, optimizer


def one_step(model, optimizer):
    model(torch.randn(32, 64)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def test_the_peak_tracker_records_the_peak_and_the_module_at_it(private):
    model, optimizer = model_and_optimizer()
    sites = iter(range(1_000_000))
    tracker = private.peak_tracker(model, optimizer, fsdp=False, where=lambda: f"site {next(sites)}")
    with private.module_tracking_without_cycles(), tracker:
        one_step(model, optimizer)
        peak = tracker.get_tracker_snapshot("peak")
        assert max(s["Total"] for s in peak.values()) > 0 and tracker.running is not None
        current = private.restart_peak(tracker)
        assert tracker.get_tracker_snapshot("peak") == current and tracker.running is None
        assert tracker.site is None
        private.forget_module(tracker, model)  # else the tracker refuses a second iteration
        asked = next(sites)
        with torch.no_grad():
            model(torch.randn(4, 64))
        # the new peak: in the ReLU, its input and its output both live
        assert tracker.running == ("Sequential.1", False)
        # ``where`` is asked at each new peak only, and its last answer kept
        last = int(tracker.site.split()[1])
        assert asked < last < next(sites) and last - asked <= 4
        assert not private.in_backward(tracker)


class Spike(torch.autograd.Function):
    """The identity, whose backward holds 32 MB for a moment."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        torch.ones(1 << 23).sum()
        return grad


class Spiky(nn.Module):
    def forward(self, x):
        return Spike.apply(x)


class TwoPasses(nn.Module):
    """Its block runs twice a forward (a prompt pass and a completion pass), and the
    spike is in the block's second layer's backward. A side branch on the input (which
    needs no gradient) runs its backward first and stays among ``ModTracker.parents``
    until the backward ends, deeper than the block by name ("side.0" > "block.1")."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(16, 16)
        self.block = nn.Sequential(nn.Linear(16, 16), Spiky(), nn.Linear(16, 16))
        self.side = nn.Sequential(nn.Linear(16, 16))

    def forward(self, x):
        prompt = self.block(self.stem(x))
        return self.block(prompt.detach() + prompt).sum() + self.side(x).sum()


def test_the_module_at_a_backward_peak_is_the_one_whose_backward_runs(private):
    model = TwoPasses()
    tracker = private.peak_tracker(model, torch.optim.SGD(model.parameters()), fsdp=False)
    with private.module_tracking_without_cycles(), tracker:
        loss = model(torch.randn(4, 16))
        private.restart_peak(tracker)
        loss.backward()
    assert tracker.running == ("TwoPasses.block.1", True)


def test_a_module_a_second_backward_leaves_open_is_not_running_after_it(private):
    """As the shared prefix's update runs: a prompt pass and a completion pass through a
    module whose input needs no gradient, then two backward calls (the completions', the
    prompt's). The second leaves the module open in ModTracker; the next peak, outside
    any module, is labelled so."""
    model = nn.Sequential(nn.Linear(16, 16))
    tracker = private.peak_tracker(model, torch.optim.SGD(model.parameters()), fsdp=False)
    with private.module_tracking_without_cycles(), tracker:
        prompt = model(torch.randn(4, 16))
        leaf = prompt.detach().requires_grad_()
        private.forget_module(tracker, model)
        model(leaf).sum().backward()
        prompt.backward(leaf.grad)
        assert any(backward for _, backward in tracker.entered)  # the case: left open
        private.restart_peak(tracker)
        torch.ones(1 << 22)
    assert tracker.running == (None, False)


def test_the_profilers_memory_events_cover_an_allocation_in_a_named_range(private):
    activities = [torch.profiler.ProfilerActivity.CPU]
    with (
        torch.profiler.profile(activities=activities, profile_memory=True) as profiler,
        torch.autograd.profiler.record_function("phase:here"),
    ):
        kept = torch.empty(1 << 20)
    allocations, ranges = private.memory_events(profiler, "phase:")
    ((name, begin, end),) = ranges
    assert name == "here"
    assert any(begin <= t <= end and n == kept.numel() * 4 for t, n in allocations)


FAKE_GROUP = """
import sys
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
sys.path.insert(0, sys.argv[1])
import torch_private as private

private.join_fake_process_group(4)
assert dist.get_world_size() == 4 and dist.get_rank() == 0
t = torch.ones(3)
dist.all_reduce(t)  # moves nothing
assert t.tolist() == [1.0, 1.0, 1.0]
trained, frozen = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64).requires_grad_(False)
fully_shard(trained), fully_shard(frozen)
seen = []


def watch():
    seen.append(private.Propagation.depth)
    return False


tracker = private.peak_tracker(trained, None, fsdp=True, stand_aside=watch)
with tracker:
    private.track_frozen_shards(tracker, frozen.parameters())
    shards = tracker.get_tracker_snapshot("current")
    with private.Propagation.hidden():
        loss = trained(torch.randn(2, 64)).sum()
        private.restart_peak(tracker)
        loss.backward()
        assert tracker.running == ("FSDPLinear", True), tracker.running
        weight = frozen.weight
        assert type(weight).__name__ == "DTensor"
        weight * 3  # an operation on a DTensor: its output's sharding is propagated
assert max(seen) > 0, "DTensor's sharding propagation was not seen"
sharded = sum(s.get("Sharded Param", 0) for s in shards.values())
assert sharded == 2 * (64 * 64 + 64) * 4 // 4, sharded  # both models' quarter
print("ok")
"""


def test_the_fake_process_group_shards_and_the_propagation_is_seen(private):
    """In a process of its own: the fake group is this process's default group."""
    done = subprocess.run([sys.executable, "-c", FAKE_GROUP, str(TOOLS)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_the_autograd_node_running_is_named_in_a_backward_only(private):
    x = torch.randn(3, 3, requires_grad=True)
    names = []

    class Names(private.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            names.append((func, private.autograd_node()))
            return func(*args, **(kwargs or {}))

    loss = (x @ x).sum()
    with Names():
        torch.mm(x, x)
        loss.backward()
    assert names[0] == (torch.ops.aten.mm.default, None)
    assert (torch.ops.aten.mm.default, "MmBackward0") in names


def test_the_peak_tracker_counts_a_sparse_gradient_by_its_indices_and_values(private):
    """A tied weight's token lookup sends a sparse gradient (``forward.accumulate_in_place``):
    the tracker follows it as it arrives at the parameter and as the backward makes it,
    as its indices and values, where the stock tracker stops at its missing storage."""

    class Lookup(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(1000, 64, sparse=True)

        def forward(self, ids):
            return self.embed(ids).square().sum()

    model = Lookup()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    tracker = private.peak_tracker(model, optimizer, fsdp=False)
    with private.module_tracking_without_cycles(), tracker:
        model(torch.tensor([[3, 4, 4, 9]])).backward()
    grad = model.embed.weight.grad
    assert grad.is_sparse and grad._values().shape == (4, 64)
    peak = tracker.get_tracker_snapshot("peak")
    # at least the parameter and the gradient's values: 1000 x 64 and 4 x 64 floats
    assert max(s["Total"] for s in peak.values()) >= (1000 + 4) * 64 * 4
