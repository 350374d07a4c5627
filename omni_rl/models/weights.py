"""Model weights at size: a model built empty and filled once it is sharded, and exports
written tensor by tensor in the dtype its checkpoint stores.

Loading. One process (or DDP) reads the whole checkpoint. Under FSDP2 on N processes that
would hold N full copies in host memory, and one per GPU, before sharding; there
``omni_rl.models.load(..., empty=True)`` builds the model on the meta device instead
(``empty_model``: no memory, no values), the engine shards it, and ``fill`` gives each rank
its shards: rank 0 reads the whole model through the family's own loader, so transformers'
checkpoint key mapping (renamed prefixes, fused experts, an Omni thinker's ``thinker.``
prefix) applies as it does in one process, and broadcasts it one tensor at a time. A node
then holds one copy of the weights, rank 0's, in the checkpoint's dtype.

Exports. ``write_export`` gathers the weights one tensor at a time (a collective under
FSDP2), casts them to the checkpoint's dtype (bf16 for released checkpoints; the tiny
models are fp32), and rank 0 writes safetensors files of about ``shard_bytes`` under the
checkpoint's key names (transformers' mapping reverted), an index when there are several,
and config.json naming the dtype: what ``from_pretrained`` and vLLM load.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn
from torch.distributed.tensor import DTensor
from transformers import GenerationConfig, PreTrainedModel
from transformers.core_model_loading import revert_weight_conversion

EXPORT_SHARD_BYTES = 5 * 2**30
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"


@dataclass(frozen=True)
class StoredWeights:
    """The checkpoint a model was read from; ``omni_rl.models.load`` records it on the
    model as ``omni_rl_stored``."""

    path: Path
    """The checkpoint directory."""
    dtype: torch.dtype
    """The dtype its weights are stored in (its config.json's); exports are written in it."""


def stored_dtype(path: Path, default: torch.dtype) -> torch.dtype:
    """The dtype the checkpoint's config.json names (``dtype``, or ``torch_dtype`` as
    transformers 4 wrote it), else ``default``. Released configs keep it at the top
    (Qwen2.5-VL), in ``text_config`` alone (Qwen3-VL, Qwen2-Audio), or in an Omni
    model's thinker section; the first found in that order counts."""
    config = json.loads((path / "config.json").read_text())
    thinker = config.get("thinker_config") or {}
    for section in (config, config.get("text_config") or {}, thinker, thinker.get("text_config") or {}):
        name = section.get("dtype") or section.get("torch_dtype")
        if isinstance(name, str) and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
    return default


def empty_model(model_class: type, config, dtype: torch.dtype, path: Path) -> nn.Module:
    """``model_class`` built from ``config`` on the meta device (parameters and buffers
    without storage), with the checkpoint's generation config, as ``from_pretrained``
    would give it before reading the weights."""
    with torch.device("meta"):
        model = model_class._from_config(config, dtype=dtype)
    if model.can_generate() and (path / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(path, local_files_only=True)
    return model.eval()


def is_empty(model: nn.Module) -> bool:
    """Whether ``model`` was built on the meta device and not yet filled."""
    return any(p.device.type == "meta" for p in model.parameters())


@torch.no_grad()
def fill(model: nn.Module, whole: nn.Module | None, device: torch.device) -> None:
    """Give a model built by ``empty_model`` and sharded by FSDP2 its weights (every rank
    calls this): rank 0 passes the whole model read from the checkpoint, the others None;
    each rank keeps its shards, in the dtype the model was built in.

    Non-persistent buffers (RoPE's ``inv_freq``, an audio encoder's sinusoids) are in no
    state dict: transformers' own initialisation recomputes them on ``device``, as
    ``from_pretrained`` does after reading into a model it also builds on the meta device.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    model.to_empty(device=device)
    full = whole.state_dict() if whole is not None else {}
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    for tensor in model.state_dict(keep_vars=True).values():
        tensor._is_hf_initialized = True  # loaded: the initialisation below leaves it alone
    model.initialize_weights()
    if whole is not None:
        # the key mapping rank 0's read used: exports (written by rank 0) revert it
        model._weight_conversions = getattr(whole, "_weight_conversions", None)


def writes_tensor_by_tensor(model: nn.Module) -> bool:
    """A transformers model is exported by ``write_export``; a LoRA adapter (peft) or a
    flow policy by its own ``save_pretrained``."""
    return isinstance(model, PreTrainedModel)


def export_dtype(model: nn.Module) -> torch.dtype:
    """The dtype an export of ``model`` is written in: its checkpoint's (``omni_rl_stored``),
    or its own for a model not read from one."""
    stored = getattr(model, "omni_rl_stored", None)
    return stored.dtype if stored is not None else model.dtype


def export_bytes(model: nn.Module) -> int:
    """The bytes of the weights ``write_export`` writes."""
    state, dtype = _export_state(model), export_dtype(model)
    return sum(_size(tensor, dtype) for tensor in state.values())


def write_export(model: nn.Module, out: Path | None, shard_bytes: int = EXPORT_SHARD_BYTES) -> None:
    """Write ``model`` as a Hugging Face checkpoint under ``out`` (rank 0; None on the
    other ranks, which only take part in the gathers): every rank calls this.

    Weights are gathered one tensor at a time, cast to ``export_dtype(model)``, and
    written a file of about ``shard_bytes`` at a time (a decoder layer is never split
    over two files: transformers' reverse mapping may need all of a layer's tensors
    together), with ``model.safetensors.index.json`` when there are several files.
    Rank 0 holds one file's tensors at a time.
    """
    dtype = export_dtype(model)
    groups = list(_groups(_export_state(model), dtype, shard_bytes))
    names = (
        [WEIGHTS_NAME]
        if len(groups) == 1
        else [f"model-{i:05d}-of-{len(groups):05d}.safetensors" for i in range(1, len(groups) + 1)]
    )
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    weight_map, total = {}, 0
    for name, group in zip(names, groups, strict=True):
        tensors = {key: _gathered(tensor, dtype, keep=out is not None) for key, tensor in group.items()}
        if out is None:
            continue
        tensors = {k: v.contiguous() for k, v in revert_weight_conversion(model, tensors).items()}
        save_file(tensors, out / name, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(tensors, name)
        total += sum(t.nbytes for t in tensors.values())
        del tensors
    if out is None:
        return
    if len(names) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    config = copy.deepcopy(model.config)
    config.dtype = str(dtype).removeprefix("torch.")
    # FSDP2 renames the class it shards (FSDPQwen2VL...): the checkpoint names the model's own
    config.architectures = [type(model).__name__.removeprefix("FSDP")]
    config.save_pretrained(out)
    if model.can_generate():
        model.generation_config.save_pretrained(out)


def _export_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict an export writes: tied weights once (under the first name, the
    input embedding's, as ``save_pretrained`` keeps it), without the keys the model
    declines to save."""
    ignored = set(getattr(model, "_keys_to_ignore_on_save", None) or ())
    state, seen = {}, set()
    for key, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen or key in ignored:
            continue
        seen.add(id(tensor))
        state[key] = tensor
    return state


def _size(tensor: torch.Tensor, dtype: torch.dtype) -> int:
    itemsize = dtype.itemsize if tensor.is_floating_point() else tensor.dtype.itemsize
    return tensor.numel() * itemsize


def _layer(key: str) -> str:
    """The block a key belongs to (``model.layers.3`` of ``model.layers.3.mlp.up_proj.weight``),
    or the key itself outside numbered blocks."""
    match = re.match(r"(.*?\.\d+)\.", key)
    return match.group(1) if match else key


def _groups(state: dict[str, torch.Tensor], dtype: torch.dtype, shard_bytes: int) -> Iterator[dict]:
    """``state`` in consecutive groups of about ``shard_bytes`` (in ``dtype``), cut only
    between blocks."""
    group, size, layer = {}, 0, None
    for key, tensor in state.items():
        nbytes = _size(tensor, dtype)
        if group and _layer(key) != layer and size + nbytes > shard_bytes:
            yield group
            group, size = {}, 0
        group[key], size, layer = tensor, size + nbytes, _layer(key)
    if group:
        yield group


def _gathered(tensor: torch.Tensor, dtype: torch.dtype, keep: bool) -> torch.Tensor | None:
    """The full ``tensor`` (a collective for an FSDP2 shard), floating point cast to
    ``dtype`` before the gather; on the CPU where ``keep``, else dropped (None)."""
    value = tensor.detach()
    if value.is_floating_point():
        value = value.to(dtype)
    if isinstance(value, DTensor):
        value = value.full_tensor()
    return value.cpu() if keep else None
