"""Checkpoints: a Hugging Face model directory plus the trainer's state, written atomically.

Layout: ``OUTPUT_DIR/checkpoints/step-00000010/``
    model/               save_pretrained (transformers, peft adapters and vLLM load it)
    trainer_state.pt     optimizer, scheduler and torch RNG tensors (torch.load weights_only)
    state.json           step, sampler position, Python/NumPy RNG, run metrics so far

The directory is written under a temporary name and renamed into place last, so a run
killed mid-write leaves either the previous checkpoint or a complete new one. Resuming
loads the model from ``model/`` (transformers maps its saved key names) and the rest
from the two state files; ``latest`` finds the newest complete checkpoint.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch

PREFIX = "step-"


def _rng_state() -> tuple[dict, dict]:
    """(tensors for the .pt file, JSON-able states)."""
    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        tensors["cuda"] = torch.cuda.get_rng_state_all()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    version, state, gauss = random.getstate()
    return tensors, {
        "numpy": [name, keys.tolist(), pos, has_gauss, cached],
        "python": [version, list(state), gauss],
    }


def _set_rng_state(tensors: dict, states: dict) -> None:
    torch.set_rng_state(tensors["torch"])
    if "cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(tensors["cuda"])
    name, keys, pos, has_gauss, cached = states["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    version, state, gauss = states["python"]
    random.setstate((version, tuple(state), gauss))


def save(
    output_dir: str | Path,
    step: int,
    model: torch.nn.Module,
    processor,
    optimizer: torch.optim.Optimizer,
    scheduler,
    sampler_state: dict,
    extra: dict | None = None,
    keep_last: int = 2,
) -> Path:
    """Write the checkpoint of ``step`` and prune all but the newest ``keep_last``.

    ``model`` needs ``save_pretrained(dir)``; ``processor`` and ``scheduler`` may be None.
    """
    root = Path(output_dir) / "checkpoints"
    final = root / f"{PREFIX}{step:08d}"
    tmp = root / f".{final.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp / "model")
    if processor is not None:
        processor.save_pretrained(tmp / "model")
    rng_tensors, rng_json = _rng_state()
    torch.save(
        {
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict() if scheduler is not None else {},
            "rng": rng_tensors,
        },
        tmp / "trainer_state.pt",
    )
    state = {"step": step, "sampler": sampler_state, "rng": rng_json, "extra": extra or {}}
    (tmp / "state.json").write_text(json.dumps(state))
    for path in tmp.rglob("*"):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    for old in sorted(p for p in root.glob(f"{PREFIX}*") if p.is_dir())[:-keep_last]:
        shutil.rmtree(old)
    return final


def latest(output_dir: str | Path) -> Path | None:
    """The newest complete checkpoint under ``output_dir``, or None."""
    root = Path(output_dir) / "checkpoints"
    done = sorted(p for p in root.glob(f"{PREFIX}*") if (p / "state.json").is_file())
    return done[-1] if done else None


def load_state(path: str | Path, optimizer: torch.optim.Optimizer, scheduler) -> dict:
    """Restore optimizer, scheduler and RNGs from a checkpoint; returns its state.json."""
    path = Path(path)
    trainer = torch.load(path / "trainer_state.pt", weights_only=True, map_location="cpu")
    optimizer.load_state_dict(trainer["optimizer"])
    if scheduler is not None:
        scheduler.load_state_dict(trainer["scheduler"])
    state = json.loads((path / "state.json").read_text())
    _set_rng_state(trainer["rng"], state["rng"])
    return state
