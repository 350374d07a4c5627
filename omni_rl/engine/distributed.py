"""Processes and collectives: one process, or N launched by torchrun (several nodes
through torchrun's rendezvous flags).

``init()`` reads torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK) and joins the
process group: NCCL on CUDA, gloo on CPU. Every helper here is a no-op in one process,
so recipes call them unconditionally.

With a rollout process (GRPO's ``rollout.staleness: 1``) the last of torchrun's
processes generates while the others train: the trainers form a group of their own,
which every helper here, FSDP2's mesh, DDP and checkpoints use, so they see N - 1
trainers as they would see N - 1 processes; ``ranks()`` on the rollout process is a
process of its own (its helpers are no-ops), and it meets the trainers only through
``omni_rl.rollout.remote``'s point-to-point messages.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist

from omni_rl.errors import OmniRLError


@dataclass(frozen=True)
class Ranks:
    """This process's place among the N training processes."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    rollout_process: bool = False
    """This process generates for the trainers (``init(rollout_processes=1)``)."""

    @property
    def is_main(self) -> bool:
        """Trainer rank 0 writes logs, TensorBoard and the shared files of checkpoints."""
        return self.rank == 0 and not self.rollout_process

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


_TRAINERS: dist.ProcessGroup | None = None  # the trainers' group beside a rollout process; None: every process


def init(device_type: str, timeout_minutes: float = 30.0, rollout_processes: int = 0) -> Ranks:
    """Join the process group torchrun describes (idempotent); one process without it.

    Args:
        device_type: "cuda" (NCCL, one GPU per local rank) or another (gloo).
        timeout_minutes: how long a collective waits for every rank before failing
            (``trainer.dist_timeout_minutes``); the work one rank does alone while the
            others wait (an export, a checkpoint's fsync) must fit in it.
        rollout_processes: 0, or 1: the last process generates for the others, which
            train in a group of their own (it needs at least 2 processes).
    """
    global _TRAINERS
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if rollout_processes and world < 2:
        raise OmniRLError(
            "a rollout process beside the trainers needs torchrun with one process more than the trainers: "
            "torchrun --nproc-per-node 2 ... trains on one process and generates on the other"
        )
    if world == 1:
        return Ranks()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if not dist.is_initialized():
        backend = "gloo"
        if device_type == "cuda":
            torch.cuda.set_device(device_index(local))
            # a rollout process may share a GPU with a trainer, which NCCL refuses: the
            # messages between them go over gloo, the trainers' collectives over NCCL
            backend = "cpu:gloo,cuda:nccl" if rollout_processes else "nccl"
        dist.init_process_group(backend, timeout=timedelta(minutes=timeout_minutes))
        if rollout_processes:  # every process takes part in making the group
            _TRAINERS = dist.new_group(list(range(world - 1)))
    return _joined()


def device_index(local_rank: int) -> int:
    """This process's GPU: its local rank, or, for a rollout process beyond the node's
    GPUs, the one its local rank wraps around to (it shares it with a trainer)."""
    return local_rank % max(torch.cuda.device_count(), 1)


def ranks() -> Ranks:
    """The current process's ranks among the trainers (one process when no group was
    joined; the rollout process is a process of its own)."""
    if not (dist.is_available() and dist.is_initialized()):
        return Ranks()
    return _joined()


def _joined() -> Ranks:
    """The ranks of a process that joined torchrun's group."""
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if _TRAINERS is None:
        return Ranks(dist.get_rank(), dist.get_world_size(), local)
    if dist.get_rank() == rollout_rank():
        return Ranks(0, 1, local, rollout_process=True)
    return Ranks(dist.get_rank(_TRAINERS), dist.get_world_size(_TRAINERS), local)


def rollout_rank() -> int | None:
    """The global rank of the rollout process (the last one), or None without one."""
    return dist.get_world_size() - 1 if _TRAINERS is not None else None


def trainer_group() -> dist.ProcessGroup | None:
    """The trainers' process group for FSDP2, DDP and checkpoints (None: the default
    group, every process)."""
    return _TRAINERS


def trainer_mesh(device_type: str):
    """FSDP2's mesh over the trainers (None: its default, every process)."""
    if _TRAINERS is None:
        return None
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(_TRAINERS, device_type)


def _device() -> torch.device:
    """Where collectives' tensors live: NCCL needs CUDA tensors, gloo takes CPU ones."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_sum(values: list[float]) -> list[float]:
    """Element-wise sums of ``values`` over ranks (float64)."""
    if not ranks().distributed:
        return list(values)
    tensor = torch.tensor(values, dtype=torch.float64, device=_device())
    dist.all_reduce(tensor, group=_TRAINERS)
    return tensor.tolist()


def all_max(value: int | float) -> int | float:
    """The largest ``value`` of any rank (an int or a float, as given)."""
    if not ranks().distributed:
        return value
    kind = int if isinstance(value, int) else float
    tensor = torch.tensor([value], dtype=torch.int64 if kind is int else torch.float64, device=_device())
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=_TRAINERS)
    return kind(tensor.item())


def all_ranks(flag: torch.Tensor) -> bool:
    """Whether the 0-dim ``flag`` (on this rank's device) is true on every rank: one
    all-reduce on the device, then one read on the host."""
    if ranks().distributed:
        flag = flag.to(torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=_TRAINERS)
    return bool(flag)


T = TypeVar("T")


def lockstep(work: Sequence[T], filler: Callable[[], T] | None = None) -> list[tuple[T, bool]]:
    """This rank's ``work`` padded to the longest list of any rank, so that every rank
    runs as many sharded forwards and collectives (FSDP2 all-gathers, reductions): the
    rule for a rank short of work, in every loop that can leave one short.

    Returns ``(item, real)`` pairs: this rank's items with ``real`` True, then copies of
    a filler with ``real`` False, which the caller runs with zero weight and whose
    results it drops. The filler is ``filler()`` when given (called only when needed),
    else this rank's first item; a rank with neither and a shortfall is a ValueError.
    Every rank must call it at the same point (it is a collective)."""
    longest = all_max(len(work))
    own = [(item, True) for item in work]
    if longest == len(work):
        return own
    if filler is not None:
        pad = filler()
    elif work:
        pad = work[0]
    else:
        raise ValueError("a rank with no work of its own needs a filler to stay in step")
    return own + [(pad, False)] * (longest - len(work))


def all_gather_ints(value: int) -> list[int]:
    """``value`` of every rank, in rank order."""
    if not ranks().distributed:
        return [value]
    tensor = torch.tensor([value], dtype=torch.int64, device=_device())
    out = [torch.zeros_like(tensor) for _ in range(ranks().world_size)]
    dist.all_gather(out, tensor, group=_TRAINERS)
    return [int(t.item()) for t in out]


def gather_objects(items: list) -> list:
    """The concatenation of every rank's ``items`` in rank order (in-memory objects
    such as reward results; nothing is read from files)."""
    if not ranks().distributed:
        return list(items)
    out: list = [None] * ranks().world_size
    dist.all_gather_object(out, items, group=_TRAINERS)
    return [item for part in out for item in part]


def sum_counts(counts: dict[str, int]) -> dict[str, int]:
    """Integer counters summed over ranks (every rank has the same keys)."""
    keys = sorted(counts)
    return {k: int(v) for k, v in zip(keys, all_sum([float(counts[k]) for k in keys]), strict=True)}


def mean_metrics(row: dict) -> dict:
    """Numeric metrics averaged over ranks (keys missing on a rank count only where
    present); non-numeric values are rank 0's."""
    if not ranks().distributed:
        return dict(row)
    rows: list = [None] * ranks().world_size
    dist.all_gather_object(rows, row, group=_TRAINERS)
    out = dict(row)
    for key in {k for r in rows for k in r}:
        values = [r[key] for r in rows if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)]
        if values and len(values) == sum(key in r for r in rows):
            out[key] = sum(values) / len(values)
    return out


def barrier() -> None:
    if ranks().distributed:
        dist.barrier(group=_TRAINERS)


def broadcast_int(value: int) -> int:
    """Rank 0's ``value`` on every rank."""
    if not ranks().distributed:
        return value
    tensor = torch.tensor([value], dtype=torch.int64, device=_device())
    dist.broadcast(tensor, src=0, group=_TRAINERS)  # trainer 0 is global rank 0
    return int(tensor.item())


def shutdown() -> None:
    """Leave the process group (end of a torchrun run)."""
    global _TRAINERS
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _TRAINERS = None
