"""Messages between the trainers and a rollout process (GRPO's ``rollout.staleness: 1``),
point to point over gloo in the run's own torch.distributed process group, on GPUs too
(a rollout process beyond the node's GPUs shares one with a trainer, which NCCL
refuses; ``omni_rl.engine.distributed`` keeps the trainers' collectives, NCCL on GPUs,
to their own group).

Weights go from the trainers to the rollout process after each optimizer step: every
trainer walks the model's trainable weights unit by unit (under FSDP2 each unit that
holds one is gathered once, ``gathering.full_entries``: under LoRA or a frozen vision
tower the others are not), and trainer 0 sends them in buckets of about
``bucket_bytes``, each a small header (names and shapes) then one flat tensor in the
dtype the rollout samples in. Batches go the other way as one object per trainer
(pickled in memory by torch.distributed, never written to a file).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from omni_rl.engine import distributed, gathering

CPU = torch.device("cpu")  # messages go over gloo: a rollout process may share its GPU with a trainer


def send_object(obj, dst: int) -> None:
    """``obj`` to global rank ``dst`` (its tensors must be on the CPU)."""
    dist.send_object_list([obj], dst=dst, device=CPU)


def receive_object(src: int):
    """The object global rank ``src`` sends next."""
    box = [None]
    dist.recv_object_list(box, src=src, device=CPU)
    return box[0]


def trainable_names(model: nn.Module) -> set[str]:
    """The weights an update changes: what a push sends."""
    return {name for name, param in model.named_parameters() if param.requires_grad}


def push_weights(model: nn.Module, dst: int, dtype: torch.dtype, bucket_bytes: int) -> int:
    """Send the trainable weights of ``model`` to global rank ``dst`` in ``dtype``. Every
    trainer calls this (FSDP2's gathers are collectives); trainer 0 sends. Returns the
    bytes sent (0 on the other trainers)."""
    names, main = trainable_names(model), distributed.ranks().is_main
    header, parts, size, sent = [], [], 0, 0

    def flush() -> int:
        if not main or not parts:
            return 0
        send_object(header, dst)
        flat = torch.cat(parts).to(CPU)
        dist.send(flat, dst=dst)
        return flat.numel() * flat.element_size()

    for name, value in gathering.full_entries(model, names):  # a unit with nothing trainable is not gathered
        if main:
            header.append((name, tuple(value.shape)))
            parts.append(value.detach().reshape(-1).to(dtype, copy=True))  # copied before the unit reshards
            size += parts[-1].numel() * parts[-1].element_size()
        if size >= bucket_bytes:
            sent += flush()
            header, parts, size = [], [], 0
    sent += flush()
    if main:
        send_object(None, dst)  # the end of this push
    return sent


@torch.no_grad()
def receive_weights(model: nn.Module, src: int, dtype: torch.dtype) -> int:
    """Copy the weights global rank ``src`` pushes (``push_weights``) into ``model``;
    returns the bytes received."""
    params = dict(model.named_parameters())
    received = 0
    while (header := receive_object(src)) is not None:
        flat = torch.empty(sum(math.prod(shape) for _, shape in header), dtype=dtype, device=CPU)
        dist.recv(flat, src=src)
        received += flat.numel() * flat.element_size()
        offset = 0
        for name, shape in header:
            count = math.prod(shape)
            params[name].copy_(flat[offset : offset + count].view(shape))
            offset += count
    return received
