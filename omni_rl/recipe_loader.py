"""Configs that name their recipe, and the recipes they run: the recipe table resolved.

The one place that imports what ``omni_rl.recipe_table`` names by string (root config
classes and runners, from the recipes, preprocess and the demos), so it sits in the top
layer beside the CLI; everything below it imports only down. A root config's module is
imported when a config names its recipe, a runner's module only when it runs, so reading
a config never imports a training loop.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from omni_rl.config import apply_overrides, build_config, read_yaml
from omni_rl.errors import ConfigError, OmniRLError
from omni_rl.recipe_table import Recipe, get_recipe, recipe_names


def _resolve(target: str) -> Any:
    """The object a ``'module:name'`` string names (its module imported now)."""
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def root_config(recipe: Recipe) -> type:
    """The root config class of ``recipe``."""
    return _resolve(recipe.config)


def runner(recipe: Recipe) -> Callable[..., Any]:
    """The function that runs ``recipe`` (its module imported now)."""
    if recipe.runner is None:
        raise TypeError(f"recipe '{recipe.name}' has no runner; {recipe.command} reads its config")
    return _resolve(recipe.runner)


def config_from_dict(raw: dict, source: str = "config") -> Any:
    """The root config of ``raw['recipe']`` built from the other keys, validated; errors
    name ``source``."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a mapping at the top level")
    raw = dict(raw)
    name = raw.pop("recipe", None)
    if name is None:
        raise ConfigError(f"{source}: missing 'recipe' key; known recipes: {', '.join(recipe_names())}")
    try:
        recipe = get_recipe(str(name))
    except OmniRLError as err:
        raise ConfigError(f"{source}: recipe: {err}") from None
    return build_config(root_config(recipe), raw, source)


def load_config(path: str | Path | None, overrides: Iterable[str] = (), recipe: str | None = None) -> Any:
    """Load, override and validate a config file.

    Args:
        path: a YAML file naming its recipe; None starts from ``recipe``'s defaults.
        overrides: ``a.b=c`` strings applied before validation.
        recipe: the recipe of a config built from defaults alone.
    """
    raw = read_yaml(path) if path is not None else {"recipe": recipe}
    raw = apply_overrides(raw, overrides)
    return config_from_dict(raw, str(path) if path is not None else f"<{recipe} defaults>")
