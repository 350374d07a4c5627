"""The files and directories a training config reads, checked before the run loads a
model or writes anything: a wrong path is one error naming each config field and its
path, not a traceback after the model has loaded and ``config.yaml`` has been written.

A root config's inputs are found by its sections (``model``, ``data``, ``policy``,
``bc``), which every recipe that has them means the same way; ``omni-rl train`` calls
:func:`check_inputs` on the config it loaded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from omni_rl.errors import ConfigError

Kind = Literal["file", "directory", "file or directory"]

# what makes each input, for the error
MAKES = {
    "model.path": "omni-rl tiny-model writes a tiny checkpoint",
    "policy.path": "omni-rl tiny-model --family pi0 writes a tiny one",
    "bc.demos": "omni-rl sim collect-demos writes them; --set bc.demos=null trains without cloning",
    "data.cache": "omni-rl preprocess DATA --cache DIR --config CONFIG makes it; cache_mode cache_only needs it",
}


def input_paths(cfg: Any) -> list[tuple[str, str, Kind]]:
    """(field, path, kind) of every input ``cfg`` names: ``model.path`` (when set),
    ``data.train``, each ``data.eval`` set's data (a benchmark's: a file or a
    directory), ``data.cache`` under ``cache_mode: cache_only`` (``prefer_cache``
    decodes on the fly without one), a pi0 ``policy.path`` and ``bc.demos`` (when set)."""
    sections = vars(cfg)
    found: list[tuple[str, str, Kind]] = []
    model, data = sections.get("model"), sections.get("data")
    policy, bc = sections.get("policy"), sections.get("bc")
    if model is not None and model.path:
        found.append(("model.path", model.path, "directory"))
    if data is not None:
        found.append(("data.train", data.train, "file"))
        for i, spec in enumerate(data.eval):
            found.append((f"data.eval[{i}].data", spec.data, "file or directory" if spec.benchmark else "file"))
        if data.cache_mode == "cache_only":
            found.append(("data.cache", data.cache or "", "directory"))
    if policy is not None and policy.vla:
        found.append(("policy.path", policy.path or "", "directory"))
    if bc is not None and bc.demos:
        found.append(("bc.demos", bc.demos, "file"))
    return found


def missing(path: str, kind: Kind) -> str | None:
    """Why ``path`` is not a ``kind``, or None when it is."""
    if not path:
        return "unset"
    p = Path(path)
    if kind == "file" and not p.is_file():
        return "is a directory, not a file" if p.is_dir() else "no such file"
    if kind == "directory" and not p.is_dir():
        return "is a file, not a directory" if p.exists() else "no such directory"
    if not p.exists():
        return "no such file or directory"
    return None


def check_inputs(cfg: Any, source: str) -> None:
    """Raise one ConfigError, naming ``source`` (the config file), that lists every
    input of ``cfg`` (``input_paths``) that is not there, each as ``field: path: why``."""
    problems = []
    for name, path, kind in input_paths(cfg):
        why = missing(path, kind)
        if why is not None:
            hint = f" ({MAKES[name]})" if name in MAKES else ""
            problems.append(f"{name}: {path}: {why}{hint}" if path else f"{name}: unset: must name a {kind}{hint}")
    if problems:
        raise ConfigError(f"{source}: missing inputs: {'; '.join(problems)}")
