"""Checkpoints: sharded training state plus a Hugging Face export, written atomically.

Layout: ``OUTPUT_DIR/checkpoints/step-00000010/``
    model/            full weights, ``save_pretrained`` (transformers, peft and vLLM load it)
    sharded/          trainable weights and optimizer state as torch.distributed.checkpoint
                      safetensors shards: each rank writes its own part (FSDP2 shards,
                      or whole tensors once under DDP / one process)
    optimizer.json    the optimizer's hyper-parameters per group (no tensors)
    rng/rank-K.pt     rank K's torch RNG states (``torch.load(weights_only=True)``)
    rng/rank-K.json   rank K's Python and NumPy RNG states
    state.json        step, process count, engine counters and schedule, data position,
                      recipe extras; written last

Nothing here is read with pickle. The directory is written under a temporary name and
renamed into place by rank 0 after every rank finished, so a run killed mid-write keeps
its previous checkpoint; ``latest`` finds the newest complete one. Resuming needs the
same number of processes (each rank's RNG and data position are its own).
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from omni_rl.engine import distributed
from omni_rl.engine.engine import Engine
from omni_rl.errors import OmniRLError

PREFIX = "step-"


def _trainable_names(engine: Engine) -> set[str]:
    return {name for name, p in engine.module.named_parameters() if p.requires_grad}


def _flat_state(engine: Engine) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """Trainable weights and optimizer tensors under flat names, and the optimizer's
    parameter groups without their tensors."""
    trainable = _trainable_names(engine)
    model = get_model_state_dict(engine.model)
    flat = {f"model.{k}": v for k, v in model.items() if k in trainable}
    optim = get_optimizer_state_dict(engine.model, engine.optimizer)
    for fqn, entries in optim["state"].items():
        for key, value in entries.items():
            flat[f"optim.{fqn}.{key}"] = value if isinstance(value, torch.Tensor) else torch.tensor(value)
    return flat, optim["param_groups"]


def _rng_state() -> tuple[dict, dict]:
    """(tensors for the .pt file, JSON-able states)."""
    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        tensors["cuda"] = torch.cuda.get_rng_state_all()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    version, state, gauss = random.getstate()
    return tensors, {"numpy": [name, keys.tolist(), pos, has_gauss, cached], "python": [version, list(state), gauss]}


def _set_rng_state(tensors: dict, states: dict) -> None:
    torch.set_rng_state(tensors["torch"])
    if "cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(tensors["cuda"])
    name, keys, pos, has_gauss, cached = states["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    version, state, gauss = states["python"]
    random.setstate((version, tuple(state), gauss))


def export_model(engine: Engine, directory: Path, processor=None) -> None:
    """The full weights as a Hugging Face directory (gathered on rank 0, which writes)."""
    full = get_model_state_dict(engine.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if engine.ranks.is_main:
        from omni_rl.models.omni import write_export_note  # transformers: VLM recipes only

        engine.module.save_pretrained(directory, state_dict=full)
        write_export_note(engine.module, directory)
        if processor is not None:
            processor.save_pretrained(directory)


def save(
    engine: Engine,
    output_dir: str | Path,
    step: int,
    state: dict,
    processor=None,
    keep_last: int = 2,
    export: bool = True,
) -> Path:
    """Write the checkpoint of ``step`` (every rank calls this) and prune all but the
    newest ``keep_last``. ``state``: JSON the recipe needs back (data position, ...).
    ``export``: also write the Hugging Face directory ``model/``."""
    root = Path(output_dir) / "checkpoints"
    final = root / f"{PREFIX}{step:08d}"
    tmp = root / f".{final.name}.tmp"
    rank = engine.ranks.rank
    if engine.ranks.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / "rng").mkdir(parents=True)
    distributed.barrier()
    flat, groups = _flat_state(engine)
    writer = dcp.HuggingFaceStorageWriter(str(tmp / "sharded"), save_distributed=True)
    dcp.save(flat, storage_writer=writer, no_dist=not engine.ranks.distributed)
    rng_tensors, rng_json = _rng_state()
    torch.save(rng_tensors, tmp / "rng" / f"rank-{rank:05d}.pt")
    (tmp / "rng" / f"rank-{rank:05d}.json").write_text(json.dumps(rng_json))
    if export:
        export_model(engine, tmp / "model", processor)
    distributed.barrier()
    if engine.ranks.is_main:
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in groups]
        (tmp / "optimizer.json").write_text(json.dumps(hyper))
        record = {"step": step, "world_size": engine.ranks.world_size, "engine": engine.state(), **state}
        (tmp / "state.json").write_text(json.dumps(record))
        for path in tmp.rglob("*"):
            if path.is_file():
                with open(path, "rb") as f:
                    os.fsync(f.fileno())
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for old in sorted(p for p in root.glob(f"{PREFIX}*") if p.is_dir())[:-keep_last]:
            shutil.rmtree(old)
    distributed.barrier()
    return final


def latest(output_dir: str | Path) -> Path | None:
    """The newest complete checkpoint under ``output_dir``, or None."""
    root = Path(output_dir) / "checkpoints"
    done = sorted(p for p in root.glob(f"{PREFIX}*") if (p / "state.json").is_file())
    return done[-1] if done else None


def read_state(path: str | Path) -> dict:
    """A checkpoint's state.json."""
    return json.loads((Path(path) / "state.json").read_text())


def check_world_size(path: str | Path, world_size: int) -> None:
    """Resuming needs the process count the checkpoint was written with: say so at start-up."""
    saved = read_state(path)["world_size"]
    if saved != world_size:
        raise OmniRLError(
            f"{path}: written by {saved} process(es), resumed with {world_size}; resuming with a different "
            "process count is not supported (each rank's data position and RNG are its own): "
            f"relaunch with --nproc-per-node={saved} (times the nodes)"
        )


def load(engine: Engine, path: str | Path) -> dict:
    """Restore weights, optimizer, schedule and this rank's RNG; returns state.json."""
    path = Path(path)
    state = read_state(path)
    check_world_size(path, engine.ranks.world_size)
    flat, groups = _flat_state(engine)
    reader = dcp.HuggingFaceStorageReader(str(path / "sharded"))
    dcp.load(flat, storage_reader=reader, no_dist=not engine.ranks.distributed)
    model = {k.removeprefix("model."): v for k, v in flat.items() if k.startswith("model.")}
    set_model_state_dict(engine.model, model, options=StateDictOptions(strict=False))
    optim: dict = {"state": {}, "param_groups": groups}
    for key, value in flat.items():
        if key.startswith("optim."):
            fqn, _, name = key.removeprefix("optim.").rpartition(".")
            optim["state"].setdefault(fqn, {})[name] = value
    for group, hyper in zip(groups, json.loads((path / "optimizer.json").read_text()), strict=True):
        group.update({k: tuple(v) if isinstance(v, list) else v for k, v in hyper.items()})
    # parameters that never had a gradient (an unused encoder) have no optimizer state
    set_optimizer_state_dict(engine.model, engine.optimizer, optim, options=StateDictOptions(strict=False))
    engine.load_state(state["engine"])
    rank = engine.ranks.rank
    tensors = torch.load(path / "rng" / f"rank-{rank:05d}.pt", weights_only=True, map_location="cpu")
    _set_rng_state(tensors, json.loads((path / "rng" / f"rank-{rank:05d}.json").read_text()))
    return state
