"""The ``omni-rl`` command: thin functions that parse arguments and call the library.

Subcommands register with ``@command("group name", ...)``; a space in the name makes a
command group (``omni-rl config check``). Heavy imports happen inside the commands,
so ``omni-rl --help`` is instant. A user error (``OmniRLError``) prints one line and
exits 2; ``--debug`` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass

from omni_rl.errors import OmniRLError
from omni_rl.registry import Registry


@dataclass(frozen=True)
class Command:
    """A subcommand: its words, one-line help, argparse arguments and handler."""

    name: str
    help: str
    arguments: tuple[tuple[tuple, dict], ...]
    run: Callable[[argparse.Namespace], int | None]


COMMANDS: Registry[Command] = Registry("command")


def arg(*flags: str, **kwargs) -> tuple[tuple, dict]:
    """One ``parser.add_argument`` call, for ``@command``."""
    return flags, kwargs


def command(name: str, help: str, *arguments: tuple[tuple, dict]) -> Callable:
    """Register the decorated ``fn(args) -> exit code | None`` as ``omni-rl NAME``."""

    def decorate(fn: Callable[[argparse.Namespace], int | None]) -> Callable:
        COMMANDS.register(name)(Command(name, help, arguments, fn))
        return fn

    return decorate


OVERRIDE = arg(
    "--set",
    dest="overrides",
    action="append",
    default=[],
    metavar="KEY=VALUE",
    help="override a config value, e.g. --set trainer.steps=10 (repeatable)",
)


@command(
    "config check",
    "validate config files against their recipe's schema",
    arg("files", nargs="+", metavar="FILE"),
    OVERRIDE,
)
def _config_check(args: argparse.Namespace) -> int:
    from omni_rl.config import load_config, recipe_name

    for path in args.files:
        cfg = load_config(path, args.overrides)
        print(f"ok: {path} (recipe: {recipe_name(cfg)})")
    return 0


@command(
    "config show", "print a config with defaults filled in and overrides applied", arg("file", metavar="FILE"), OVERRIDE
)
def _config_show(args: argparse.Namespace) -> int:
    import yaml

    from omni_rl.config import load_config, recipe_name, to_dict

    cfg = load_config(args.file, args.overrides)
    print(yaml.safe_dump({"recipe": recipe_name(cfg), **to_dict(cfg)}, sort_keys=False), end="")
    return 0


@command(
    "tiny-model",
    "write a tiny random-init checkpoint of a model family (offline)",
    arg("--family", required=True, help="model_type, e.g. qwen2_5_vl"),
    arg("--out", required=True, metavar="DIR", help="output directory"),
    arg("--seed", type=int, default=0, help="initialization seed"),
)
def _tiny_model(args: argparse.Namespace) -> int:
    from omni_rl.models import FAMILIES, build_tiny

    FAMILIES.canonical(args.family)  # unknown family: a one-line error listing the known ones
    out = build_tiny(args.family, args.out, seed=args.seed)
    print(f"wrote tiny {args.family} to {out}")
    return 0


@command(
    "demo",
    "build a tiny VLM, ask it about a generated video, teach it the answer",
    arg("--config", metavar="FILE", help="a demo config (default: built-in defaults)"),
    OVERRIDE,
)
def _demo(args: argparse.Namespace) -> int:
    import json

    from omni_rl.config import load_config
    from omni_rl.recipes import demo

    cfg = load_config(args.config, args.overrides, recipe="demo")
    summary = demo.main(cfg)
    print(json.dumps(summary, indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every registered command."""
    parser = argparse.ArgumentParser(prog="omni-rl", description="RL for multimodal models and robot policies.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks for user errors")
    top = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    groups: dict[str, argparse._SubParsersAction] = {}
    for name in COMMANDS:
        cmd = COMMANDS.get(name)
        words = name.split()
        subparsers = top
        if len(words) == 2:
            if words[0] not in groups:
                group = top.add_parser(words[0], help=f"{words[0]} commands")
                groups[words[0]] = group.add_subparsers(dest="subcommand", metavar="SUBCOMMAND", required=True)
            subparsers = groups[words[0]]
        sub = subparsers.add_parser(words[-1], help=cmd.help, description=cmd.help)
        for flags, kwargs in cmd.arguments:
            sub.add_argument(*flags, **kwargs)
        sub.set_defaults(handler=cmd.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``omni-rl`` console script."""
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args) or 0
    except OmniRLError as err:
        if args.debug:
            raise
        print(f"omni-rl: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("omni-rl: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
