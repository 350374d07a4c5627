"""The config loader: typed dataclasses read from YAML, overridden with ``--set a.b=c``.

This module is only the machinery; every section lives beside what it configures
(``omni_rl/engine/config.py``: trainer and optimizer; ``omni_rl/data/config.py``: data;
``omni_rl/recipes/grpo_config.py``: the GRPO root config; ...) and it imports nothing
of the recipes: the caller gives the root dataclass (``build_config``). A config file
names its recipe at the top (``recipe: grpo``); ``omni_rl.recipe_loader``, at the top
beside the CLI, resolves that name through the recipe table (``omni_rl.recipe_table``,
plain data, which also gives ``save_config`` the name to write). Every section is a
dataclass whose fields carry a one-line docstring. A mapping given for a section
overrides only the keys it names: the rest keep that field's default (which may differ
from the section class's own defaults). Sections with several implementations
(optimizers, ...) derive from ``Choice`` and pick their class by a ``type:`` key from a
registry.

Everything a user can get wrong is a ``ConfigError`` that names the file, the dotted
key and the reason: an unknown key (with the closest valid key), a wrong type, a
value out of range (raised by a section's ``__post_init__`` through ``require``).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Iterable
from pathlib import Path
from typing import Any, ClassVar, Literal

import yaml

from omni_rl.errors import ConfigError
from omni_rl.recipe_table import recipe_of
from omni_rl.registry import Registry, did_you_mean


class FieldError(ValueError):
    """Raised inside ``__post_init__``; the loader adds the file and section to it."""

    def __init__(self, field_name: str, message: str):
        super().__init__(message)
        self.field_name = field_name


def require(condition: bool, field_name: str, message: str) -> None:
    """Validation helper for ``__post_init__``: raise FieldError unless ``condition``."""
    if not condition:
        raise FieldError(field_name, message)


def require_unset(values: dict[str, Any], mode: str) -> None:
    """Validation helper for fields that do nothing in the mode a config is in: a
    FieldError naming the first of ``values`` (field name -> value) that is set (not
    None), and listing the others set. Such fields default to None (``ModeDefaults``)."""
    given = [name for name, value in values.items() if value is not None]
    if len(given) == 1:
        raise FieldError(given[0], f"does nothing under {mode}; remove it")
    if given:
        raise FieldError(given[0], f"does nothing under {mode}, nor do {', '.join(given[1:])}; remove them")


class ModeDefaults:
    """A section whose fields count in some modes only: those default to None, which
    means "the default" (``UNSET``), read through ``setting``; set in a mode where they
    do nothing, ``require_unset`` refuses them (a dataclass default cannot tell a value
    left alone from the same value written out)."""

    UNSET: ClassVar[dict[str, Any]] = {}

    def setting(self, name: str) -> Any:
        """The field ``name`` as set, or its default when unset."""
        value = getattr(self, name)
        return self.UNSET[name] if value is None else value


class Choice:
    """Base of a section chosen by its ``type:`` key from ``registry``."""

    registry: ClassVar[Registry]
    default_type: ClassVar[str]


def choice_name(obj: Choice) -> str:
    """The ``type:`` name a Choice section's class is registered under."""
    return next(n for n in obj.registry if obj.registry.get(n) is type(obj))


# ---------------------------------------------------------------------------- loading


def _describe(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 60 else text[:57] + '...'}"


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(tp: Any, value: Any, where: str, default: Any = None) -> Any:
    """``value`` checked and converted to the annotation ``tp``; ConfigError otherwise.
    A mapping for a section fills in the keys it leaves out from ``default``, the
    field's default value, when that is an instance of the section's class."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(arg, value, where, default)
            except ConfigError as err:
                errors.append(str(err))
        if len(errors) == 1:
            raise ConfigError(errors[0])
        raise ConfigError(f"{where}: expected {_type_name(tp)}, got {_describe(value)}")
    if origin is Literal:
        if value not in args:
            choices = ", ".join(repr(a) for a in args)
            raise ConfigError(f"{where}: must be one of {choices}, got {value!r}")
        return value
    if isinstance(tp, type) and issubclass(tp, Choice):
        return _build_choice(tp, value, where, default)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, where, default)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {_describe(value)}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {_describe(value)}")
        return value
    if tp is float:
        # YAML 1.1 reads '1e-6' (no dot) as a string; accept any numeric spelling.
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {_describe(value)}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {_describe(value)}")
        return value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {_describe(value)}")
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            if len(value) != len(args):
                raise ConfigError(f"{where}: expected {len(args)} items, got {len(value)}")
            return tuple(_coerce(a, v, f"{where}[{i}]") for i, (a, v) in enumerate(zip(args, value, strict=True)))
        item = args[0] if args else Any
        items = [_coerce(item, v, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {_describe(value)}")
        key_tp, val_tp = args or (Any, Any)
        return {_coerce(key_tp, k, where): _coerce(val_tp, v, f"{where}.{k}") for k, v in value.items()}
    raise TypeError(f"config annotation {tp!r} at {where} is not supported")


def _build_choice(base: type, value: Any, where: str, default: Any = None) -> Any:
    if isinstance(value, base):
        return value
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: expected a mapping with a 'type' key, got {_describe(value)}")
    value = dict(value)
    name = value.pop("type", choice_name(default) if isinstance(default, base) else base.default_type)
    if name not in base.registry:
        known = ", ".join(base.registry)
        raise ConfigError(
            f"{where}.type: unknown {base.registry.kind} '{name}'{did_you_mean(str(name), base.registry.names())}; "
            f"known: {known}"
        )
    return _build(base.registry.get(name), value, where, default)


def _field_default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def _refuse_keys(cls: type, value: dict, where: str) -> None:
    """The keys of a raw section that its class refuses (``REFUSED_KEYS``: dotted key ->
    why), checked before its subsections are built, so that no subsection's own check
    answers first with a reason that does not apply."""
    for dotted, why in getattr(cls, "REFUSED_KEYS", {}).items():
        node = value
        for key in dotted.split("."):
            node = node.get(key) if isinstance(node, dict) else None
        if node is not None:
            raise ConfigError(f"{where + '.' if where else ''}{dotted}: {why}")


def _build(cls: type, value: Any, where: str, default: Any = None) -> Any:
    """An instance of dataclass ``cls`` from the mapping ``value``; keys it leaves out
    come from ``default`` when that is a ``cls``, else from the class's defaults."""
    if isinstance(value, cls):
        return value
    if value is None:
        value = {}
    if not isinstance(value, dict):
        raise ConfigError(f"{where or 'config'}: expected a mapping, got {_describe(value)}")
    _refuse_keys(cls, value, where)
    if type(default) is not cls:
        default = None
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    names = list(fields)
    kwargs = {}
    for key, raw in value.items():
        if key not in fields:
            section = f"section '{where}'" if where else "the top level"
            raise ConfigError(
                f"{where + '.' if where else ''}{key}: unknown key '{key}' in {section}"
                f"{did_you_mean(str(key), names)}; valid keys: {', '.join(names)}"
            )
        base = getattr(default, key) if default is not None else _field_default(fields[key])
        kwargs[key] = _coerce(hints[key], raw, f"{where}.{key}" if where else key, base)
    if default is not None:
        kwargs = {name: kwargs[name] if name in kwargs else getattr(default, name) for name in names}
    try:
        return cls(**kwargs)
    except FieldError as err:
        name = f"{where}.{err.field_name}" if where else err.field_name
        raise ConfigError(f"{name}: {err}") from None


def build_section(cls: type, value: Any, where: str, default: Any = None) -> Any:
    """A typed section ``cls`` from a mapping (keys it leaves out come from ``default``),
    checked as a config file's sections are: unknown keys, wrong types and values
    refused by the class are ConfigErrors naming ``where``."""
    return _build(cls, value, where, default)


def parse_override(text: str) -> tuple[list[str], Any]:
    """``'a.b=c'`` -> (['a', 'b'], c) with c read as a YAML scalar (so typed)."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {text!r}: expected KEY=VALUE, e.g. trainer.steps=10")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        reason = str(getattr(e, "problem", None) or e).splitlines()[0]
        raise ConfigError(
            f"--set {text!r}: the value is not YAML ({reason}); quote a string inside the YAML, "
            f"e.g. --set \"{key.strip()}='{raw}'\""
        ) from None
    return key.strip().split("."), value


def apply_overrides(raw: dict, overrides: Iterable[str]) -> dict:
    """A copy of the raw config mapping with each ``a.b=c`` override set."""
    import copy

    out = copy.deepcopy(raw)
    for text in overrides:
        keys, value = parse_override(text)
        node = out
        for depth, key in enumerate(keys[:-1]):
            child = node.get(key)
            if child is None:
                child = node[key] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"--set {text}: '{'.'.join(keys[: depth + 1])}' is not a section")
            node = child
        node[keys[-1]] = value
    return out


def build_config(root: type, raw: dict, source: str = "config") -> Any:
    """The root config ``root`` (a dataclass) from its sections ``raw``, validated; errors
    name ``source``."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a mapping at the top level")
    try:
        return _build(root, raw, "")
    except ConfigError as err:
        raise ConfigError(f"{source}: {err}") from None


def read_yaml(path: str | Path) -> dict:
    """The mapping in a YAML file, or a ConfigError naming the file and the line."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise ConfigError(f"{path}: cannot read config: {err.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        raise ConfigError(f"{path}: invalid YAML{where}: {getattr(err, 'problem', err)}") from None
    return data if data is not None else {}


def recipe_name(cfg: Any) -> str:
    """The name of the recipe whose root config ``cfg`` is, from the recipe table."""
    return recipe_of(cfg).name


def to_dict(obj: Any) -> Any:
    """Plain data (YAML-safe) for a config; ``Choice`` sections carry their ``type``."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out = {}
        if isinstance(obj, Choice):
            out["type"] = choice_name(obj)
        for f in dataclasses.fields(obj):
            out[f.name] = to_dict(getattr(obj, f.name))
        return out
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def save_config(cfg: Any, path: str | Path) -> Path:
    """Write the resolved config (recipe first) as YAML; it loads back to an equal config."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"recipe": recipe_name(cfg), **to_dict(cfg)}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    tmp.replace(path)
    return path
