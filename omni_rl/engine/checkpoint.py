"""Checkpoints: sharded training state plus a Hugging Face export, written atomically.

Layout: ``OUTPUT_DIR/checkpoints/step-00000010/``
    model/            full weights in the source checkpoint's dtype, safetensors files of
                      about 5 GiB with an index when several, config.json naming the dtype
                      (transformers, peft and vLLM load it; see ``export_model``)
    sharded/          trainable weights and optimizer state as torch.distributed.checkpoint
                      safetensors shards: each rank writes its own part (FSDP2 shards,
                      or whole tensors once under DDP / one process)
    optimizer.json    the optimizer's hyper-parameters per group (no tensors)
    rng/rank-K.pt     rank K's torch RNG states (``torch.load(weights_only=True)``)
    rng/rank-K.json   rank K's Python and NumPy RNG states
    state.json        step, process count, engine counters and schedule, data position,
                      recipe extras, and every other file's size; written last

Nothing here is read with pickle. The directory is written under a temporary name and
renamed into place by rank 0 after every rank finished, so a run killed mid-write keeps
its previous checkpoint, and a full disk (``DiskFull``) leaves no temporary directory.
``damage`` says which file of a checkpoint is missing, truncated or unreadable;
``latest`` finds the newest complete one. Resuming needs the same number of processes
(each rank's RNG and data position are its own).
"""

from __future__ import annotations

import io
import json
import logging
import os
import random
import shutil
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from omni_rl.engine import distributed
from omni_rl.engine.engine import TrainingEngine
from omni_rl.errors import OmniRLError, stop_on_disk_full
from omni_rl.runtime import umask_files

PREFIX = "step-"
# what a resume takes from this run, not the checkpoint, without a word: the kernel the
# engine chose for this machine, and the rates the schedule sets (``load_state`` names
# a changed one)
_NOT_COMPARED = frozenset({"params", "lr", "initial_lr", "foreach", "fused", "capturable", "differentiable"})

log = logging.getLogger(__name__)


def _flat_state(engine: TrainingEngine, names: set[str] | None = None) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """The weights of ``names`` (default: every parameter any of the engine's optimizers
    trained, ``TrainingEngine.trained_names``) and the optimizer's tensors under flat
    names, and the optimizer's parameter groups without their tensors."""
    names = engine.trained_names if names is None else names
    model = get_model_state_dict(engine.model)
    flat = {f"model.{k}": v for k, v in model.items() if k in names}
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


def _nbytes(tensors: Iterable[torch.Tensor]) -> int:
    """The bytes this process holds of ``tensors`` (a DTensor: its local shard)."""
    return sum((t.to_local() if isinstance(t, DTensor) else t).nbytes for t in tensors)


def _write(path: Path, data: bytes) -> None:
    """One small file of a checkpoint (a full disk raises ``DiskFull`` naming it)."""
    with stop_on_disk_full(path, len(data)):
        path.write_bytes(data)


def _fsync_tree(directory: Path) -> None:
    """Flush every file under ``directory`` to disk (before it is renamed into place)."""
    with stop_on_disk_full(directory):  # a network file system may report a full disk only here
        for path in directory.rglob("*"):
            if path.is_file():
                with open(path, "rb") as f:
                    os.fsync(f.fileno())


def _aside(directory: Path) -> Path:
    return directory.with_name(f".{directory.name}.old")


def _replace_dir(tmp: Path, directory: Path) -> None:
    """Rename the finished ``tmp`` onto ``directory``. A directory cannot be renamed over
    a non-empty one, so an existing one is renamed aside first and deleted after: a kill
    between the two renames (no data is written there) leaves it whole beside, where
    ``restore_interrupted`` puts it back."""
    old = _aside(directory)
    shutil.rmtree(old, ignore_errors=True)
    if directory.exists():
        os.replace(directory, old)
    os.replace(tmp, directory)
    shutil.rmtree(old, ignore_errors=True)


def restore_interrupted(directory: str | Path) -> None:
    """Put back the previous ``directory`` when a kill came between ``_replace_dir``'s
    two renames (it is missing and its copy aside is whole)."""
    directory = Path(directory)
    if not directory.exists() and _aside(directory).is_dir():
        os.replace(_aside(directory), directory)


def export_model(engine: TrainingEngine, directory: Path, processor=None, shard_bytes: int | None = None) -> None:
    """The full weights as a Hugging Face directory (every rank calls this; rank 0 writes).

    A transformers model is written in the dtype of the checkpoint it was read from (bf16
    for released checkpoints, fp32 for the tiny ones), gathered one tensor at a time and
    written in safetensors files of about ``shard_bytes`` (default 5 GiB) with an index
    when there are several (``omni_rl.models.weights.write_export``), so rank 0 never
    holds a second model. A LoRA adapter or a flow policy is gathered whole and written
    by its own ``save_pretrained``. Written under a temporary name beside ``directory``
    and renamed into place, so a run killed or stopped mid-export keeps the previous
    export whole; a full disk raises ``DiskFull``."""
    from omni_rl.models import weights  # transformers: VLM recipes only
    from omni_rl.models.omni import write_export_note

    module, main = engine.module, engine.ranks.is_main
    directory = Path(directory)
    tmp = directory.with_name(f".{directory.name}.tmp")
    if main:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a killed export
    try:
        if weights.writes_tensor_by_tensor(module):
            with stop_on_disk_full(directory, weights.export_bytes(module)):
                weights.write_export(module, tmp if main else None, shard_bytes or weights.EXPORT_SHARD_BYTES)
        else:
            full = get_model_state_dict(engine.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            if main:
                with stop_on_disk_full(directory, _nbytes(full.values())):
                    module.save_pretrained(tmp, state_dict=full)
        if main:
            with stop_on_disk_full(directory):
                write_export_note(module, tmp)
                if processor is not None:
                    processor.save_pretrained(tmp)
            umask_files(tmp)  # safetensors writes 600
            _fsync_tree(tmp)
            _replace_dir(tmp, directory)
    finally:
        if main:
            shutil.rmtree(tmp, ignore_errors=True)


def _rank_failure(err: CheckpointException) -> BaseException:
    """The first failing rank's own exception (dcp wraps each with its traceback)."""
    return min(err.failures.items())[1][0]


def save(
    engine: TrainingEngine,
    output_dir: str | Path,
    step: int,
    state: dict,
    processor=None,
    keep_last: int = 2,
    export: bool = True,
) -> Path:
    """Write the checkpoint of ``step`` (every rank calls this) and prune all but the
    newest ``keep_last`` up to it (and any of later steps, left by the history this run
    resumed before). ``state``: JSON the recipe needs back (data position, ...).
    ``export``: also write the Hugging Face directory ``model/``.

    Raises:
        DiskFull: a write found the disk full; the temporary directory is deleted and
            the earlier checkpoints are untouched.
    """
    root = Path(output_dir) / "checkpoints"
    final = root / f"{PREFIX}{step:08d}"
    tmp = root / f".{final.name}.tmp"
    rank = engine.ranks.rank
    try:
        if engine.ranks.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            with stop_on_disk_full(tmp):
                (tmp / "rng").mkdir(parents=True)
        distributed.barrier()
        fresh = not engine.optimizer.state  # no update yet (every step so far skipped)
        flat, groups = _flat_state(engine)
        if fresh:
            # torch's optimizer state dict fills an empty state by a step at lr 0 (AdamW's
            # count at 1, zero moments), which would change every later update: the run
            # goes on without it, and the checkpoint holds none (load reads it as such)
            engine.optimizer.state.clear()
            flat = {k: v for k, v in flat.items() if not k.startswith("optim.")}
        with stop_on_disk_full(tmp / "sharded", _nbytes(flat.values())):
            writer = dcp.HuggingFaceStorageWriter(str(tmp / "sharded"), save_distributed=True)
            try:
                dcp.save(
                    flat,
                    storage_writer=writer,
                    no_dist=not engine.ranks.distributed,
                    process_group=distributed.trainer_group(),
                )
            except CheckpointException as err:
                raise _rank_failure(err) from err
        rng_tensors, rng_json = _rng_state()
        buffer = io.BytesIO()
        torch.save(rng_tensors, buffer)  # to memory: torch's file writer hides a full disk's errno
        _write(tmp / "rng" / f"rank-{rank:05d}.pt", buffer.getvalue())
        _write(tmp / "rng" / f"rank-{rank:05d}.json", json.dumps(rng_json).encode())
        if export:
            export_model(engine, tmp / "model", processor)
        distributed.barrier()
        if engine.ranks.is_main:
            hyper = [{k: v for k, v in g.items() if k != "params"} for g in groups]
            _write(tmp / "optimizer.json", json.dumps(hyper).encode())
            files = {str(p.relative_to(tmp)): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()}
            record = {"step": step, "world_size": engine.ranks.world_size, "engine": engine.state(), **state}
            _write(tmp / "state.json", json.dumps({**record, "files": files}).encode())
            _fsync_tree(tmp)
            _replace_dir(tmp, final)
            # later steps than this one are another history (a run that resumed before
            # them, e.g. past a damaged checkpoint): --resume auto must not go back there
            steps = sorted(p for p in root.glob(f"{PREFIX}*") if p.is_dir())
            kept = [p for p in steps if p.name <= final.name][-keep_last:]
            for old in steps:
                if old not in kept:
                    shutil.rmtree(old)
    finally:
        if engine.ranks.is_main:
            shutil.rmtree(tmp, ignore_errors=True)  # a failed save leaves nothing half-written
    distributed.barrier()
    return final


def _unreadable(file: Path) -> str | None:
    """Why ``file`` does not parse as its kind (safetensors header, JSON, tensors), or None."""
    try:
        if file.suffix == ".safetensors":
            with safe_open(str(file), framework="pt"):
                pass  # opening reads the header and checks it covers the file
        elif file.suffix == ".json":
            json.loads(file.read_text(encoding="utf-8"))
        elif file.suffix == ".pt":
            torch.load(file, weights_only=True, map_location="cpu")
    except Exception as err:  # noqa: BLE001 - a damaged file fails in its reader's own ways
        return f"unreadable ({type(err).__name__}: {err})"
    return None


def damage(path: str | Path) -> str | None:
    """Why the checkpoint ``path`` cannot be resumed from, as "FILE: reason", or None
    when it is complete: state.json (written last) reads, every file it lists is there
    at the size it was written with, every safetensors header, JSON file and RNG state
    reads. (A flipped bit inside tensor data is not seen: nothing is hashed.)"""
    path = Path(path)
    state_file = path / "state.json"
    if not state_file.is_file():
        return f"{state_file}: missing (it is written last: the save did not finish)"
    try:
        state = json.loads(state_file.read_text())
        world_size = int(state["world_size"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"{state_file}: unreadable ({type(err).__name__}: {err})"
    rng = [path / "rng" / f"rank-{r:05d}.{ext}" for r in range(world_size) for ext in ("pt", "json")]
    for file in [path / "optimizer.json", *rng, *(path / name for name in state.get("files", {}))]:
        if not file.is_file():
            return f"{file}: missing"
    if not any((path / "sharded").glob("*.safetensors")):
        return f"{path / 'sharded'}: no shards"
    for name, size in state.get("files", {}).items():  # checkpoints before omni_rl recorded sizes have none
        actual = (path / name).stat().st_size
        if actual != size:
            return f"{path / name}: {actual:,} bytes where {size:,} were written (truncated or overwritten)"
    for file in sorted(p for p in path.rglob("*") if p.is_file() and p != state_file):
        reason = _unreadable(file)
        if reason is not None:
            return f"{file}: {reason}"
    return None


def check_complete(path: str | Path) -> None:
    """Refuse to resume from a damaged checkpoint, in one line naming the file."""
    problem = damage(path)
    if problem is not None:
        raise OmniRLError(f"cannot resume from {path}: {problem}")


def newest_complete(output_dir: str | Path) -> tuple[Path | None, list[str]]:
    """The newest complete checkpoint under ``output_dir`` (None when there is none) and,
    for each newer one passed over, why (see ``damage``)."""
    root = Path(output_dir) / "checkpoints"
    passed = []
    for path in sorted((p for p in root.glob(f"{PREFIX}*") if p.is_dir()), reverse=True):
        problem = damage(path)
        if problem is None:
            return path, passed
        passed.append(problem)
    return None, passed


def latest(output_dir: str | Path) -> Path | None:
    """The newest complete checkpoint under ``output_dir``, or None."""
    return newest_complete(output_dir)[0]


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


def changed_settings(saved: list[dict], groups: list[dict]) -> list[str]:
    """This run's optimizer settings (weight decay, betas, eps, momentum, ...) that
    differ from a checkpoint's ``optimizer.json``, one ``"name ours (the checkpoint's
    theirs)"`` each."""
    changed = []
    for ours, theirs in zip(groups, saved, strict=True):
        for key in sorted((ours.keys() & theirs.keys()) - _NOT_COMPARED):
            old = tuple(theirs[key]) if isinstance(theirs[key], list) else theirs[key]
            if ours[key] != old:
                changed.append(f"{key} {ours[key]} (the checkpoint's {old})")
    return changed


def load(engine: TrainingEngine, path: str | Path) -> dict:
    """Restore weights, optimizer state, schedule and this rank's RNG; returns
    state.json. The optimizer's settings are this run's config's (the log names each
    that differs from the checkpoint's). A damaged checkpoint is an ``OmniRLError``
    naming the file (see ``damage``)."""
    path = Path(path)
    check_complete(path)
    state = read_state(path)
    check_world_size(path, engine.ranks.world_size)
    reader = dcp.HuggingFaceStorageReader(str(path / "sharded"))
    try:
        saved = set(reader.read_metadata().state_dict_metadata)
    except Exception:  # noqa: BLE001 - a damaged index, which dcp.load names below
        saved = None
    # the weights an earlier phase trained are there though frozen now (pi0's VLM after
    # behaviour cloning), and saved again from here on
    names = engine.trained_names
    if saved is not None:
        names = names | {k.removeprefix("model.") for k in saved if k.startswith("model.")}
    flat, groups = _flat_state(engine, names)
    # parameters that never had a gradient (an unused encoder) were saved without
    # optimizer state: read only what is there
    missing = {k for k in flat if k.startswith("optim.") and saved is not None and k not in saved}
    stateless = {k.removeprefix("optim.").rpartition(".")[0] for k in missing}
    flat = {k: v for k, v in flat.items() if k not in missing}
    try:
        dcp.load(
            flat, storage_reader=reader, no_dist=not engine.ranks.distributed, process_group=distributed.trainer_group()
        )
    except CheckpointException as err:  # e.g. shards of another model
        cause = _rank_failure(err)
        raise OmniRLError(f"cannot resume from {path}: {path / 'sharded'}: {type(cause).__name__}: {cause}") from err
    model = {k.removeprefix("model."): v for k, v in flat.items() if k.startswith("model.")}
    set_model_state_dict(engine.model, model, options=StateDictOptions(strict=False))
    optim: dict = {"state": {}, "param_groups": groups}
    for key, value in flat.items():
        if key.startswith("optim."):
            fqn, _, name = key.removeprefix("optim.").rpartition(".")
            optim["state"].setdefault(fqn, {})[name] = value
    changed = changed_settings(json.loads((path / "optimizer.json").read_text()), groups)
    if changed:
        log.warning("resuming with this run's optimizer settings: %s", "; ".join(changed))
    set_optimizer_state_dict(engine.model, engine.optimizer, optim, options=StateDictOptions(strict=False))
    engine.trained_names |= names
    if stateless:  # and stay without it, as in the run that saved them
        for name, param in engine.module.named_parameters():
            if name in stateless:
                engine.optimizer.state.pop(param, None)
    engine.load_state(state["engine"])
    rank = engine.ranks.rank
    tensors = torch.load(path / "rng" / f"rank-{rank:05d}.pt", weights_only=True, map_location="cpu")
    _set_rng_state(tensors, json.loads((path / "rng" / f"rank-{rank:05d}.json").read_text()))
    return state
