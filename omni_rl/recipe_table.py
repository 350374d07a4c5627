"""The recipe registry: one table of plain data, a row per recipe.

A recipe is a root config class (what a config file's ``recipe:`` key names) and the
function that runs it. A row names both as import strings (``'module:Class'``,
``'module:function'``), so this module imports nothing of what it lists and sits at the
bottom, under the config loader: ``omni_rl.config`` finds a root config's name here by
its class's ``module:qualname`` (to write ``recipe: NAME``), and only the top layer
(``omni_rl.recipe_loader``) imports the modules a row names. ``omni-rl train`` runs the
trainable recipes; the others are configs of their own commands. A new recipe is a new
row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omni_rl.errors import OmniRLError
from omni_rl.registry import did_you_mean


@dataclass(frozen=True)
class Recipe:
    """A recipe: its name, root config class and how it runs."""

    name: str
    """What a config file's ``recipe:`` key says."""
    config: str
    """The root config dataclass, ``'module:Class'`` (the class's module and qualname)."""
    runner: str | None
    """``'module:function'`` taking the root config (trainable ones also ``resume=``);
    None for a config that several commands read (preprocess)."""
    trainable: bool
    """Whether ``omni-rl train`` runs it."""
    command: str
    """The command that takes this config, for messages."""


RECIPES: tuple[Recipe, ...] = (
    Recipe(
        name="grpo",
        config="omni_rl.recipes.grpo_config:GRPOConfig",
        runner="omni_rl.recipes.grpo:train",
        trainable=True,
        command="omni-rl train",
    ),
    Recipe(
        name="sft",
        config="omni_rl.recipes.sft_config:SFTConfig",
        runner="omni_rl.recipes.sft:train",
        trainable=True,
        command="omni-rl train",
    ),
    Recipe(
        name="flow_ppo",
        config="omni_rl.recipes.flow_ppo_config:FlowPPOConfig",
        runner="omni_rl.recipes.flow_ppo:train",
        trainable=True,
        command="omni-rl train",
    ),
    Recipe(
        name="preprocess",
        config="omni_rl.preprocess.config:PreprocessConfig",
        runner=None,
        trainable=False,
        command="omni-rl preprocess, eval, rewards check and cache gc (--config)",
    ),
    Recipe(
        name="demo",
        config="omni_rl.demos.demo_config:DemoConfig",
        runner="omni_rl.demos.demo:main",
        trainable=False,
        command="omni-rl demo --config",
    ),
    Recipe(
        name="quickstart",
        config="omni_rl.demos.quickstart_config:QuickstartConfig",
        runner="omni_rl.demos.quickstart:main",
        trainable=False,
        command="omni-rl quickstart --config",
    ),
    Recipe(
        name="quickstart_sim",
        config="omni_rl.demos.quickstart_sim_config:QuickstartSimConfig",
        runner="omni_rl.demos.quickstart_sim:main",
        trainable=False,
        command="omni-rl quickstart --sim --config",
    ),
    Recipe(
        name="quickstart_vla",
        config="omni_rl.demos.quickstart_vla_config:QuickstartVLAConfig",
        runner="omni_rl.demos.quickstart_vla:main",
        trainable=False,
        command="omni-rl quickstart --vla --config",
    ),
    Recipe(
        name="quickstart_audio",
        config="omni_rl.demos.quickstart_audio_config:AudioQuickstartConfig",
        runner="omni_rl.demos.quickstart_audio:main",
        trainable=False,
        command="omni-rl quickstart --audio --config",
    ),
)

_BY_NAME = {recipe.name: recipe for recipe in RECIPES}
_BY_CONFIG = {recipe.config: recipe for recipe in RECIPES}


def recipe_names() -> list[str]:
    """Every recipe's name, sorted."""
    return sorted(_BY_NAME)


def trainable() -> list[str]:
    """The recipes ``omni-rl train`` runs, sorted."""
    return [name for name in recipe_names() if _BY_NAME[name].trainable]


def get_recipe(name: str) -> Recipe:
    """The recipe ``name``; an unknown name is an OmniRLError listing the known ones
    and the closest match."""
    if name not in _BY_NAME:
        known = recipe_names()
        raise OmniRLError(f"unknown recipe '{name}'{did_you_mean(name, known)}; known: {', '.join(known)}")
    return _BY_NAME[name]


def class_path(cls: type) -> str:
    """``'module:qualname'`` of ``cls``, as a row's ``config`` names it."""
    return f"{cls.__module__}:{cls.__qualname__}"


def recipe_of(cfg: Any) -> Recipe:
    """The recipe whose root config ``cfg`` (an instance or the class) is."""
    cls = cfg if isinstance(cfg, type) else type(cfg)
    if class_path(cls) not in _BY_CONFIG:
        raise TypeError(f"{class_path(cls)} is not the root config of a recipe in omni_rl.recipe_table.RECIPES")
    return _BY_CONFIG[class_path(cls)]
