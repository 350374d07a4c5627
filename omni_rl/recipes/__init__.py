"""Training methods, one file each, read top to bottom, and the one recipe registry.

A recipe is a root config class (what a config file's ``recipe:`` key names) and the
function that runs it. Root configs register themselves with ``@register_recipe``
beside their recipe (``grpo_config.py`` beside ``grpo.py``); the loader
(``omni_rl.config``) and the CLI find them through ``get_recipe``. ``omni-rl train``
runs the trainable ones; the others are configs of their own commands (``omni-rl
demo``, ``omni-rl quickstart``, ``omni-rl preprocess``). Runners import only when run,
so reading a config never imports a training loop.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from omni_rl.registry import Registry

# the modules whose root configs register a recipe; imported on the first lookup
CONFIG_MODULES: tuple[str, ...] = (
    "omni_rl.recipes.grpo_config",
    "omni_rl.recipes.sft_config",
    "omni_rl.recipes.flow_ppo_config",
    "omni_rl.preprocess.config",
    "omni_rl.demos.demo_config",
    "omni_rl.demos.quickstart_config",
    "omni_rl.demos.quickstart_sim_config",
    "omni_rl.demos.quickstart_audio_config",
)


@dataclass(frozen=True)
class Recipe:
    """A registered recipe: its name, root config class and how it runs."""

    name: str
    """What a config file's ``recipe:`` key says."""
    config: type
    """The root config dataclass."""
    runner: str | None
    """``'module:function'`` taking the root config (trainable ones also ``resume=``);
    None for a config that several commands read (preprocess)."""
    trainable: bool
    """Whether ``omni-rl train`` runs it."""
    command: str
    """The command that takes this config, for messages."""

    def load(self) -> Callable[..., Any]:
        """The runner function (its module imported now)."""
        if self.runner is None:
            raise TypeError(f"recipe '{self.name}' has no runner; {self.command} reads its config")
        module, _, function = self.runner.partition(":")
        return getattr(importlib.import_module(module), function)

    def run(self, cfg: Any, **kwargs: Any) -> Any:
        """Run the recipe on its root config ``cfg``."""
        return self.load()(cfg, **kwargs)


RECIPES: Registry[Recipe] = Registry("recipe")
_loaded = False


def register_recipe(
    name: str, runner: str | None = None, trainable: bool = False, command: str | None = None
) -> Callable[[type], type]:
    """Class decorator registering a root config as recipe ``name``.

    Args:
        name: the ``recipe:`` key of its config files.
        runner: ``'module:function'`` that runs it, imported only when run.
        trainable: ``omni-rl train`` runs it.
        command: the command that takes it (default: ``omni-rl train`` when trainable).
    """

    def decorate(cls: type) -> type:
        where = command or ("omni-rl train" if trainable else f"omni-rl {name}")
        RECIPES.register(name)(Recipe(name, cls, runner, trainable, where))
        return cls

    return decorate


def recipes() -> Registry[Recipe]:
    """Every recipe: ``RECIPES`` after importing ``CONFIG_MODULES``."""
    global _loaded
    if not _loaded:
        for module in CONFIG_MODULES:
            importlib.import_module(module)
        _loaded = True
    return RECIPES


def get_recipe(name: str) -> Recipe:
    """The recipe ``name``; an unknown name is an OmniRLError listing the known ones
    and the closest match."""
    return recipes().get(name)


def trainable() -> list[str]:
    """The recipes ``omni-rl train`` runs."""
    return [name for name in recipes() if RECIPES.get(name).trainable]


def recipe_of(cfg: Any) -> Recipe:
    """The recipe whose root config ``cfg`` (an instance or the class) is."""
    cls = cfg if isinstance(cfg, type) else type(cfg)
    for name in recipes():
        if RECIPES.get(name).config is cls:
            return RECIPES.get(name)
    raise TypeError(f"{cls.__name__} is not a registered recipe config")
