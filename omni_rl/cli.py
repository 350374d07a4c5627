"""The ``omni-rl`` command: thin functions that parse arguments and call the library.

Subcommands register with ``@command("group name", ...)``; a space in the name makes a
command group (``omni-rl config check``). Heavy imports happen inside the commands,
so ``omni-rl --help`` is instant and a mistake on the line (a config that is not there,
a malformed ``--set``, a command's own ``check``) is reported before them. A user
error (``OmniRLError``) prints one line and exits 2; ``--debug``, anywhere on the line,
shows the traceback instead. A command that reads a config takes it as ``--config
FILE`` (``train`` and ``config check|show`` also as their positional), and only such a
command takes ``--set``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from omni_rl.errors import OmniRLError
from omni_rl.registry import Registry, did_you_mean


@dataclass(frozen=True)
class Command:
    """A subcommand: its words, one-line help, argparse arguments and handler."""

    name: str
    help: str
    arguments: tuple[tuple[tuple, dict], ...]
    run: Callable[[argparse.Namespace], int | None]
    check: Callable[[argparse.Namespace], None] | None = None
    """What the arguments alone can get wrong, raised as an OmniRLError before anything
    heavy is imported (``main``); the handler need not check it again."""


COMMANDS: Registry[Command] = Registry("command")


def arg(*flags: str, **kwargs) -> tuple[tuple, dict]:
    """One ``parser.add_argument`` call, for ``@command``."""
    return flags, kwargs


def command(
    name: str, help: str, *arguments: tuple[tuple, dict], check: Callable[[argparse.Namespace], None] | None = None
) -> Callable:
    """Register the decorated ``fn(args) -> exit code | None`` as ``omni-rl NAME``;
    ``check(args)``: its cheap checks of the line (``Command.check``)."""

    def decorate(fn: Callable[[argparse.Namespace], int | None]) -> Callable:
        COMMANDS.register(name)(Command(name, help, arguments, fn, check))
        return fn

    return decorate


class RegisteredNames:
    """The names in a registry, read from it when argparse first asks (parsing the
    option, or printing its command's help): importing the benchmark presets to list
    them would make ``omni-rl --help`` slow (they import the reward scorers)."""

    def __init__(self, module: str, registry: str):
        self.module, self.registry = module, registry

    def names(self) -> list[str]:
        import importlib

        return getattr(importlib.import_module(self.module), self.registry).names()

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __contains__(self, name: object) -> bool:
        return name in self.names()


# the presets of omni_rl.benchmarks, and the formats of omni_rl.data.convert (training
# sets, then the presets with rows of their own)
BENCHMARK_NAMES = RegisteredNames("omni_rl.benchmarks", "BENCHMARKS")
DATA_FORMATS = RegisteredNames("omni_rl.data.convert", "FORMATS")


def overrides(example: str) -> tuple[tuple, dict]:
    """``--set KEY=VALUE`` of a command that reads a config; ``example`` is a ``--set``
    that applies to that command (a test loads it against the command's config)."""
    return arg(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"override a config value (repeatable), e.g. {example}",
    )


def _counts(args: argparse.Namespace, name: str, *flags: str) -> None:
    """``omni-rl NAME``'s count options, those given, are >= 1 (argparse takes any int)."""
    for flag in flags:
        value = getattr(args, flag.removeprefix("--").replace("-", "_"))
        if value is not None and value < 1:
            raise OmniRLError(f"{name}: {flag} must be >= 1, got {value}")


def _check_preprocess(args: argparse.Namespace) -> None:
    """``preprocess``'s counts >= 1, and a cache that is no file."""
    _counts(args, "preprocess", "--workers", "--limit")
    _writable(args.cache, "preprocess --cache", "directory")


def _check_collect_demos(args: argparse.Namespace) -> None:
    """``sim collect-demos``' counts >= 1, and an output that is no directory."""
    _counts(args, "sim collect-demos", "--episodes", "--num-envs", "--image-size")
    _writable(args.out, "sim collect-demos --out", "file")


def _writable(path: str, flag: str, want: str) -> None:
    """Refuse an output ``path`` (given as ``flag``) that exists as the other kind of
    thing than ``want`` ("file" or "directory"), before any work is done."""
    from pathlib import Path

    there = Path(path)
    if want == "file" and (there.is_dir() or not there.name):
        raise OmniRLError(f"{flag} {path}: a directory; name the file to write")
    if want == "directory" and there.is_file():
        raise OmniRLError(f"{flag} {path}: a file; name a directory")


def config_file(metavar: str) -> tuple[tuple[tuple, dict], ...]:
    """The one config of a command, as its positional or as ``--config`` (see ``_config_file``)."""
    return (
        arg("config_file", nargs="?", metavar=metavar, help=f"the config (or --config {metavar})"),
        arg("--config", metavar=metavar, help=f"the config, as an option (instead of the positional {metavar})"),
    )


def _config_file(args: argparse.Namespace, name: str, metavar: str) -> str:
    """The config given to ``omni-rl NAME`` exactly once, as positional or ``--config``."""
    if args.config_file and args.config:
        raise OmniRLError(f"{name}: give the config once, as {metavar} or as --config {metavar}, not both")
    if not (args.config_file or args.config):
        raise OmniRLError(f"{name}: a config is required: omni-rl {name} {metavar} (or --config {metavar})")
    return args.config_file or args.config


@command(
    "config check",
    "validate config files against their recipe's schema",
    arg("files", nargs="*", metavar="FILE", help="configs to check (or --config FILE)"),
    arg("--config", dest="config_files", action="append", default=[], metavar="FILE", help="a config (repeatable)"),
    overrides("--set trainer.steps=10"),
)
def _config_check(args: argparse.Namespace) -> int:
    from omni_rl.config import recipe_name
    from omni_rl.recipe_loader import load_config

    files = [*args.files, *args.config_files]
    if not files:
        raise OmniRLError("config check: give at least one config: omni-rl config check FILE... (or --config FILE)")
    failed = 0
    for path in files:  # every file, each bad one said
        try:
            cfg = load_config(path, args.overrides)
        except OmniRLError as err:
            print(f"omni-rl: error: {err}", file=sys.stderr)
            failed += 1
            continue
        print(f"ok: {path} (recipe: {recipe_name(cfg)})")
    return 2 if failed else 0


@command(
    "config show",
    "print a config with defaults filled in and overrides applied",
    *config_file("FILE"),
    overrides("--set trainer.steps=10"),
)
def _config_show(args: argparse.Namespace) -> int:
    import yaml

    from omni_rl.config import recipe_name, to_dict
    from omni_rl.recipe_loader import load_config

    cfg = load_config(_config_file(args, "config show", "FILE"), args.overrides)
    print(yaml.safe_dump({"recipe": recipe_name(cfg), **to_dict(cfg)}, sort_keys=False), end="")
    return 0


def _check_tiny_model(args: argparse.Namespace) -> None:
    """Positive sizes, and an --out that holds no checkpoint (or --overwrite)."""
    from pathlib import Path

    _counts(args, "tiny-model", "--width", "--audio-seconds")
    out = Path(args.out)
    if out.is_file():
        raise OmniRLError(f"tiny-model --out {out}: a file; name a directory")
    held = [p.name for p in (out / "config.json", *sorted(out.glob("*.safetensors"))) if p.is_file()]
    if held and not args.overwrite:
        raise OmniRLError(
            f"tiny-model --out {out}: holds a checkpoint ({', '.join(held)}); pass --overwrite to replace it"
        )


@command(
    "tiny-model",
    "write a tiny random-init checkpoint of a model family (offline)",
    arg("--family", required=True, help="model_type, e.g. qwen2_5_vl; or pi0, pi05 (VLA backbones)"),
    arg("--out", required=True, metavar="DIR", help="output directory"),
    arg("--seed", type=int, default=0, help="initialization seed"),
    arg("--width", type=int, default=64, help="decoder width, a multiple of 32 (64: ~0.2 M params)"),
    arg("--audio-seconds", type=int, default=30, help="audio window of audio families, in seconds"),
    arg("--overwrite", action="store_true", help="replace a checkpoint already in --out"),
    check=_check_tiny_model,
)
def _tiny_model(args: argparse.Namespace) -> int:
    from omni_rl.models import FAMILIES, build_tiny
    from omni_rl.models.flow_policy import BACKBONES, backbone_class

    vla = [name for name in BACKBONES if backbone_class(name, "--family").HAS_VLM]
    if args.family in vla:  # a VLA policy's backbone
        out = backbone_class(args.family, "--family").build_tiny(args.out, seed=args.seed, width=args.width)
    else:
        if args.family not in FAMILIES:  # a one-line error listing every family it builds
            hint = did_you_mean(args.family, [*FAMILIES.names(), *vla])
            raise OmniRLError(f"unknown model family '{args.family}'{hint}; known: {', '.join([*FAMILIES, *vla])}")
        out = build_tiny(args.family, args.out, seed=args.seed, width=args.width, audio_seconds=args.audio_seconds)
    print(f"wrote tiny {args.family} to {out}")
    return 0


@command(
    "convert-policy",
    "write a LeRobot pi0 or pi05 checkpoint as the transformers one policy.path loads (offline)",
    arg("source", metavar="LEROBOT_DIR", help="LeRobot's save_pretrained directory (config.json, model.safetensors)"),
    arg("out", metavar="OUT_DIR", help="output directory"),
    arg("--tokenizer", required=True, metavar="DIR", help="a local tokenizer (PaliGemma's for a released pi0 or pi05)"),
    arg("--sizes", metavar="CONFIG", help="a transformers PI0 or PI05 config.json whose vlm/dit sizes to use"),
)
def _convert_policy(args: argparse.Namespace) -> int:
    from omni_rl.models.lerobot import convert_lerobot_policy

    out = convert_lerobot_policy(args.source, args.out, args.tokenizer, args.sizes)
    print(f"wrote {out} (transformers PI0 or PI05, its processor with LeRobot's statistics)")
    return 0


@command(
    "demo",
    "build a tiny VLM, ask it about a generated video, teach it the answer",
    arg("--config", metavar="FILE", help="a demo config (default: built-in defaults)"),
    overrides("--set trainer.steps=5"),
)
def _demo(args: argparse.Namespace) -> int:
    return _run_recipe(args, "demo")


def _run_recipe(args: argparse.Namespace, expected: str) -> int:
    """Load ``args.config`` (default: recipe ``expected``'s defaults), check that it is an
    ``expected`` config, run it through the recipe table and print its summary."""
    import json

    from omni_rl.recipe_loader import load_config, runner
    from omni_rl.recipe_table import recipe_of

    cfg = load_config(args.config, args.overrides, recipe=expected)
    recipe = recipe_of(cfg)
    if recipe.name != expected:
        raise OmniRLError(f"{args.config}: recipe '{recipe.name}' is not '{expected}' (run it with {recipe.command})")
    print(json.dumps(runner(recipe)(cfg), indent=2))
    return 0


def _no_data_without_config(config: str | None, overrides: list[str]) -> None:
    """Refuse ``--set data.*`` without ``--config``: the preprocess defaults that stand in
    have no data section."""
    if config is None and any(o.startswith("data.") for o in overrides):
        raise OmniRLError(
            "--set data.*: needs --config with a training config (its data section); "
            "without one the preprocess defaults stand in, which have media and rewards only"
        )


def _budgets(config: str | None, overrides: list[str]):
    """Media budgets from any config with a ``media`` section (default: preprocess
    defaults), and its ``data.columns`` (empty without a data section)."""
    from omni_rl.errors import ConfigError
    from omni_rl.preprocess.pipeline import Budgets
    from omni_rl.recipe_loader import load_config

    _no_data_without_config(config, overrides)
    cfg = load_config(config, overrides, recipe="preprocess")
    if not hasattr(cfg, "media"):
        raise ConfigError(f"{config}: this recipe's config has no 'media' section")
    return Budgets.from_config(cfg.media), dict(getattr(getattr(cfg, "data", None), "columns", {}) or {})


def _check_train(args: argparse.Namespace) -> None:
    """``train``'s line: one config, of a trainable recipe, an output_dir that is no
    file, and a ``--resume DIR`` that is a checkpoint (``recipes.common.start_run``
    checks it is complete)."""
    from pathlib import Path

    from omni_rl.config import apply_overrides, read_yaml
    from omni_rl.recipe_table import get_recipe, recipe_names, trainable

    path = _config_file(args, "train", "CONFIG")
    raw = read_yaml(path)
    resolved = apply_overrides(raw, args.overrides) if isinstance(raw, dict) else {}
    name = resolved.get("recipe")
    if name in recipe_names() and not get_recipe(name).trainable:  # unknown or missing: load_config says so
        raise OmniRLError(
            f"{path}: recipe '{name}' is not trainable with 'omni-rl train' "
            f"(run it with {get_recipe(name).command}); trainable: {', '.join(trainable())}"
        )
    run = resolved.get("run")
    if isinstance(run, dict) and isinstance(run.get("output_dir"), str):
        _writable(run["output_dir"], "run.output_dir", "directory")
    if args.resume and args.overwrite:
        raise OmniRLError(
            "train: --resume and --overwrite exclude each other: go on from a checkpoint, or start afresh"
        )
    if args.resume not in (None, "auto") and not (Path(args.resume) / "state.json").is_file():
        raise OmniRLError(f"{args.resume}: not a checkpoint (no state.json)")


@command(
    "train",
    "run a training recipe from a config (recipe: grpo, sft or flow_ppo)",
    *config_file("CONFIG"),
    arg("--resume", metavar="auto|DIR", help="continue from the newest checkpoint ('auto') or a given one"),
    arg("--overwrite", action="store_true", help="start afresh in an output_dir that holds a run (deletes it)"),
    overrides("--set trainer.steps=10"),
    check=_check_train,
)
def _train(args: argparse.Namespace) -> int:
    import json

    from omni_rl.recipe_loader import load_config, runner
    from omni_rl.recipe_table import recipe_of
    from omni_rl.recipes.inputs import check_inputs

    path = _config_file(args, "train", "CONFIG")
    cfg = load_config(path, [*args.overrides, *(["run.overwrite=true"] if args.overwrite else [])])
    recipe = recipe_of(cfg)  # a trainable one (_check_train)
    check_inputs(cfg, path)  # before the run loads a model or writes its output_dir
    from omni_rl.engine import distributed

    main = True
    try:
        final = runner(recipe)(cfg, resume=args.resume)
        main = distributed.ranks().is_main  # trainer 0, not a rollout process
    finally:
        distributed.shutdown()
    if main:
        print(json.dumps(final, indent=2))
    return 0


def _check_attach_talker(args: argparse.Namespace) -> None:
    """--thinker and --source are checkpoint directories (a config.json each)."""
    from pathlib import Path

    for flag, path in (("--thinker", args.thinker), ("--source", args.source)):
        if not (Path(path) / "config.json").is_file():
            raise OmniRLError(f"attach-talker {flag} {path}: not a checkpoint directory (no config.json)")


@command(
    "attach-talker",
    "a full Qwen2.5-Omni checkpoint (speech out) from a trained thinker and its released source",
    arg("--thinker", required=True, metavar="DIR", help="a trained thinker (a run's checkpoints/step-N/model)"),
    arg("--source", required=True, metavar="DIR", help="the released qwen2_5_omni checkpoint it was trained from"),
    arg("--out", required=True, metavar="DIR", help="output directory"),
    check=_check_attach_talker,
)
def _attach_talker(args: argparse.Namespace) -> int:
    from omni_rl.models.omni import attach_talker

    out = attach_talker(args.thinker, args.source, args.out)
    print(f"wrote {out}: the thinker of {args.thinker} with the talker of {args.source}")
    return 0


@command(
    "quickstart",
    "tiny VLM on synthetic video QA: data, cache, SFT, eval, GRPO, eval (CPU, minutes); "
    "--audio: a tiny Qwen2-Audio on synthetic audio QA, the same phases; "
    "--sim: a flow policy on ManiSkill PushCube: demos, BC, Flow-Noise PPO, eval; "
    "--vla: a tiny pi_0 reaching the target an instruction names in a camera image, the same phases",
    arg("--audio", action="store_true", help="run the audio quickstart instead"),
    arg("--sim", action="store_true", help="run the simulation quickstart instead"),
    arg("--vla", action="store_true", help="run the VLA (pi_0) quickstart instead"),
    arg("--config", metavar="FILE", help="a quickstart config (default: built-in defaults)"),
    overrides("--set grpo.trainer.steps=10 (--sim, --vla: --set trainer.steps=50)"),
)
def _quickstart(args: argparse.Namespace) -> int:
    chosen = [name for name in ("audio", "sim", "vla") if getattr(args, name)]
    if len(chosen) > 1:
        raise OmniRLError(f"quickstart: choose one of --audio, --sim and --vla, not {' and '.join(chosen)}")
    return _run_recipe(args, f"quickstart_{chosen[0]}" if chosen else "quickstart")


def _check_eval(args: argparse.Namespace) -> None:
    """``eval``'s line: the flags that go together, and ``--samples`` >= 1."""
    if args.benchmark and args.config:
        raise OmniRLError("eval --benchmark: --config does not apply (set the protocol with --set protocol.X=Y)")
    if not args.benchmark and args.predictions:
        raise OmniRLError("eval: --predictions needs --benchmark (the preset's parser and metric score them)")
    if not args.benchmark and not args.model:
        raise OmniRLError("eval: --model is required (or --benchmark with --predictions)")
    if args.samples is not None and args.samples < 1:
        raise OmniRLError("eval: --samples must be >= 1")
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise OmniRLError("eval: --max-new-tokens must be >= 1")
    if not args.benchmark:  # before a model loads: what the evaluation reads and writes
        from pathlib import Path

        if not Path(args.data).is_file():
            raise OmniRLError(f"{args.data}: no such dataset file")
        if args.out and Path(args.out).is_dir():
            raise OmniRLError(f"eval --out {args.out}: a directory; name the summary's JSON file")


@command(
    "eval",
    "evaluate a checkpoint on a dataset (accuracy per problem type and source) or on a benchmark preset "
    "with its published protocol (--benchmark); --predictions scores saved responses with no model",
    arg("--model", metavar="DIR", help="a checkpoint directory, or a training run's directory (its final model/)"),
    arg("--data", required=True, metavar="DATA", help="a JSONL or Parquet dataset, or the benchmark's directory"),
    arg("--benchmark", metavar="NAME", choices=BENCHMARK_NAMES, help="a benchmark preset: %(choices)s"),
    arg("--predictions", metavar="FILE", help="with --benchmark: JSONL of {id, response} to score (no model)"),
    arg("--samples", type=int, default=None, metavar="K", help="completions per row (1: greedy; K: pass@K)"),
    arg(
        "--config",
        metavar="FILE",
        help="a config whose media, data.prompt_template, rewards (with its plug-ins) and rollout "
        "(the answer length; with K > 1 temperature, top_p, top_k) sections apply",
    ),
    arg(
        "--max-new-tokens",
        type=int,
        default=None,
        help="longest answer (default: rollout.max_new_tokens of --config, else 64; --benchmark: the preset's)",
    ),
    arg("--cache", metavar="DIR", help="with --benchmark: a media cache, filled with the preset's media on first use"),
    arg(
        "--out", metavar="PATH", help="the summary JSON (a file); with --benchmark a directory (default runs/eval/NAME)"
    ),
    overrides("--set media.max_frames=16; with --benchmark only protocol fields, e.g. --set protocol.nframes=16"),
    check=_check_eval,
)
def _eval(args: argparse.Namespace) -> int:
    if args.benchmark:
        return _eval_benchmark(args)
    import json
    from pathlib import Path

    from omni_rl.data.dataset import MediaDataset
    from omni_rl.evaluation.pipeline import evaluate_rows
    from omni_rl.evaluation.summary import rows_table
    from omni_rl.models import family_of, load, require_media_family
    from omni_rl.preprocess.pipeline import Budgets
    from omni_rl.recipe_loader import load_config
    from omni_rl.rewards import load_plugins
    from omni_rl.rollout.hf import SamplingParams
    from omni_rl.runtime import resolve_device, resolve_dtype, set_threads

    family = family_of(args.model).name
    defaults = [] if args.config else [f"media.family={family}"]  # without --config: media for the model
    cfg = load_config(args.config, [*defaults, *args.overrides], recipe="preprocess")
    run, data, rollout, rewards = _sections(cfg, args.config)
    require_media_family(cfg.media.family, family)
    samples = args.samples or 1
    load_plugins(rewards.custom if rewards is not None else None)
    # a GRPO config: answers as long as its rollouts', sampled (K > 1) as they are
    sampling = SamplingParams(max_new_tokens=64)
    if rollout is not None:
        sampling = SamplingParams.of(rollout)
    set_threads(run.threads)
    device = resolve_device(run.device)
    model, processor = load(args.model, device=device, dtype=resolve_dtype("auto", device))
    dataset = MediaDataset(
        args.data,
        Budgets.from_config(cfg.media),
        strict=data.strict,
        prompt_template=data.prompt_template,
        columns=dict(data.columns),
    )
    settings = rewards.settings() if rewards is not None else None
    summary = evaluate_rows(
        model,
        processor,
        dataset,
        samples,
        args.max_new_tokens or sampling.max_new_tokens,
        temperature=sampling.temperature,
        settings=settings,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
    )
    print(rows_table(summary))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(summary, indent=2))
    if not summary["rows"]:
        print(f"omni-rl: error: {args.data}: no row was scored (see the counts above)", file=sys.stderr)
        return 1
    return 0


def _sections(cfg, config: str | None) -> tuple:
    """(run, data, rollout, rewards) of any recipe's config for eval and curate: the
    sections it has apply, the defaults stand in for the others (a data section that is
    no training data section, as the quickstarts' is, among them). One without a media
    section is refused."""
    import logging

    from omni_rl.data.config import DataConfig
    from omni_rl.errors import ConfigError
    from omni_rl.runtime import RunConfig

    if not hasattr(cfg, "media"):
        raise ConfigError(f"{config}: this recipe's config has no 'media' section")
    sections = vars(cfg)
    data = sections.get("data")
    if data is not None and not isinstance(data, DataConfig):
        logging.getLogger(__name__).warning(
            "%s: its data section is not a training config's: the data defaults (prompt template, columns) stand in",
            config,
        )
        data = None
    return sections.get("run") or RunConfig(), data or DataConfig(), sections.get("rollout"), sections.get("rewards")


def _check_curate(args: argparse.Namespace) -> None:
    """Both curations' line: counts >= 1, the dataset a file, and each rule's bounds."""
    from pathlib import Path

    if args.samples < 1:
        raise OmniRLError("curate: --samples must be >= 1")
    if args.batch_prompts < 1:
        raise OmniRLError("curate: --batch-prompts must be >= 1")
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise OmniRLError("curate: --max-new-tokens must be >= 1")
    if not Path(args.data).is_file():
        raise OmniRLError(f"{args.data}: no such dataset file")
    _writable(args.out, "curate --out", "directory")
    if hasattr(args, "threshold") and not 0 < args.threshold <= 1:
        raise OmniRLError(f"curate: --threshold {args.threshold} is not in (0, 1]")
    if hasattr(args, "low") and args.samples < 2:
        raise OmniRLError(
            f"curate difficulty: --samples {args.samples}: one answer's pass rate is 0 or 1 where answers are right "
            "or wrong, outside (low, high), so every such row would drop; ask 2 or more"
        )
    if hasattr(args, "low") and not 0 <= args.low < args.high <= 1:
        raise OmniRLError(f"curate: --low {args.low} and --high {args.high} must satisfy 0 <= low < high <= 1")


CURATE_ARGS = (
    arg("data", metavar="DATA", help="a JSONL or Parquet dataset"),
    arg("--model", required=True, metavar="DIR", help="a checkpoint directory, or a run's directory (its model/)"),
    arg("--out", required=True, metavar="DIR", help="where the kept and dropped rows and the report go"),
    arg("--samples", type=int, default=8, metavar="K", help="answers sampled per question (default: 8)"),
    arg(
        "--max-new-tokens",
        type=int,
        default=None,
        help="longest answer (default: rollout.max_new_tokens of --config, else 64)",
    ),
    arg(
        "--batch-prompts",
        type=int,
        default=8,
        metavar="B",
        help="prompts answered together (default: 8; 1 or 2 for a 7B model on long videos)",
    ),
    arg(
        "--config",
        metavar="FILE",
        help="a config whose media, data, rewards (with its plug-ins), rollout.temperature, top_p, top_k, "
        "max_new_tokens and rollout.engine (vllm: GPUs) apply",
    ),
    overrides("--set rollout.temperature=0.7"),
)


@command(
    "curate text-only",
    "drop the questions a model answers without their media: each asked K times with its media removed; "
    "a row whose pass rate reaches --threshold leaves the set (kept.jsonl, dropped.jsonl, report.json in "
    "--out; an interrupted run with the same model, seed and asking resumes)",
    *CURATE_ARGS,
    arg(
        "--threshold",
        type=float,
        default=0.875,
        metavar="P",
        help="a text-only pass rate >= P drops the row (default: 0.875, 7 of 8)",
    ),
    check=_check_curate,
)
def _curate_text_only(args: argparse.Namespace) -> int:
    from omni_rl.evaluation.curate import TextOnly

    return _curate(args, TextOnly(args.threshold))


@command(
    "curate difficulty",
    "keep the questions a model sometimes solves: each asked K times with its media (from data.cache where it "
    "holds them); a row stays while its pass rate is strictly between --low and --high (kept.jsonl, "
    "dropped.jsonl, report.json in --out; an interrupted run with the same model, seed and asking resumes)",
    *CURATE_ARGS,
    arg("--low", type=float, default=0.0, metavar="P", help="a pass rate <= P drops the row (default: 0)"),
    arg("--high", type=float, default=1.0, metavar="P", help="a pass rate >= P drops the row (default: 1)"),
    check=_check_curate,
)
def _curate_difficulty(args: argparse.Namespace) -> int:
    from omni_rl.evaluation.curate import Difficulty

    return _curate(args, Difficulty(args.low, args.high))


def _curate(args: argparse.Namespace, rule) -> int:
    """Load the model and the config, curate ``args.data`` by ``rule``, print the report."""
    from pathlib import Path

    import torch

    from omni_rl.engine import distributed
    from omni_rl.evaluation.curate import Asking, curate, report_table
    from omni_rl.models import family_of, load, require_media_family
    from omni_rl.preprocess.pipeline import Budgets
    from omni_rl.recipe_loader import load_config
    from omni_rl.rewards import load_plugins
    from omni_rl.rollout import build_rollout_engine
    from omni_rl.runtime import resolve_device, resolve_dtype, set_threads

    # without --config the grpo defaults stand in, answering at most 64 tokens, media for the model's family
    family = family_of(args.model).name
    defaults = [] if args.config else ["rollout.max_new_tokens=64", f"media.family={family}"]
    cfg = load_config(args.config, [*defaults, *args.overrides], recipe="grpo")
    run, data, rollout, rewards = _sections(cfg, args.config)
    require_media_family(cfg.media.family, family)
    set_threads(run.threads)
    device = resolve_device(run.device)
    distributed.init(device.type)
    model, processor = load(args.model, device=device, dtype=resolve_dtype("auto", device))
    engine = None
    if rollout is not None and rollout.engine != "hf":  # vllm: it answers, loaded from the same checkpoint
        engine = build_rollout_engine(cfg, model, processor, model.omni_rl_stored.path, Path(args.out))
        engine.load_weights(model)
    load_plugins(rewards.custom if rewards is not None else None)
    asking = Asking(
        samples=args.samples,
        temperature=rollout.temperature if rollout is not None else 1.0,
        max_new_tokens=args.max_new_tokens or (rollout.max_new_tokens if rollout is not None else 64),
        batch_prompts=args.batch_prompts,
        top_p=rollout.top_p if rollout is not None else 1.0,
        top_k=rollout.top_k if rollout is not None else 0,
    )
    result = curate(
        model,
        processor,
        args.data,
        args.out,
        Budgets.from_config(cfg.media),
        asking,
        rule,
        data.prompt_template,
        dict(data.columns),
        rewards.settings() if rewards is not None else None,
        cache=data.cache,
        engine=engine,
        seed=run.seed,
        # a bf16 model computes in bf16: features stored in bf16 are exact for it
        inputs=("bfloat16" if model.dtype == torch.bfloat16 else "float32") if data.cache_inputs else None,
    )
    if distributed.ranks().is_main:
        print(report_table(result))
    distributed.shutdown()
    return 0


def _protocol_overrides(args: argparse.Namespace) -> dict:
    """``--set protocol.X=Y``, ``--samples`` and ``--max-new-tokens`` as protocol fields."""
    from omni_rl.config import parse_override

    overrides = {}
    for text in args.overrides:
        keys, value = parse_override(text)
        if len(keys) != 2 or keys[0] != "protocol":
            raise OmniRLError(f"--set {text}: with --benchmark only protocol fields apply (--set protocol.nframes=16)")
        overrides[keys[1]] = value
    if args.samples is not None:
        overrides["samples"] = args.samples
    if args.max_new_tokens is not None:
        overrides["max_new_tokens"] = args.max_new_tokens
    return overrides


def _eval_benchmark(args: argparse.Namespace) -> int:
    import dataclasses
    from pathlib import Path

    from omni_rl.evaluation import benchmark
    from omni_rl.evaluation.pipeline import answer_benchmark, evaluate_benchmark
    from omni_rl.evaluation.summary import benchmark_table

    overrides = _protocol_overrides(args)
    out = Path(args.out or f"runs/eval/{args.benchmark}")
    prepared = benchmark.prepare(args.benchmark, args.data, out, overrides)
    config = {"model": args.model, "predictions": args.predictions, "overrides": overrides, "cache": args.cache}
    if args.predictions:
        answers, failures = benchmark.read_predictions(args.predictions), []
        unknown = [row_id for row_id in answers if row_id not in prepared.rows]
        if unknown:  # another preset's ids, or another copy's: said, not silently dropped
            print(
                f"eval --benchmark: {len(unknown)} of {len(answers)} ids in {args.predictions} name no row of "
                f"{args.benchmark} here (first: {unknown[0]!r}); they are not scored",
                file=sys.stderr,
            )
    elif args.model:
        from omni_rl.models import family_of, load
        from omni_rl.runtime import resolve_device, resolve_dtype

        device = resolve_device("auto")
        model, processor = load(args.model, device=device, dtype=resolve_dtype("auto", device))
        dataset, media = benchmark.media_dataset(prepared, family_of(args.model).name, args.cache)
        answers, failures = answer_benchmark(prepared, dataset, model, processor)
        config["media"] = {"settings": dataclasses.asdict(media), **dataset.run_metrics()}
    else:
        raise OmniRLError("eval --benchmark: give --model DIR or --predictions FILE")
    summary, scored = evaluate_benchmark(prepared, answers, failures, config)
    path = benchmark.write(out, summary, scored, prepared.protocol.metric)
    print(benchmark_table(summary))
    print(f"wrote {path} and {out}/samples_{args.benchmark}.jsonl")
    if not scored:
        print(f"omni-rl: error: {args.benchmark}: no row was scored (see the counts above)", file=sys.stderr)
        return 1
    return 0


@command(
    "data convert",
    "convert another dataset's training file into omni_rl rows (JSONL)",
    arg("src", metavar="IN", help="the source file; its media paths are taken relative to its folder"),
    arg(
        "--from",
        dest="format",
        required=True,
        choices=DATA_FORMATS,
        metavar="FORMAT",
        help="source format: %(choices)s",
    ),
    arg(
        "--out", required=True, metavar="OUT", help="output JSONL; also writes OUT's .failures.jsonl and .summary.json"
    ),
    arg("--strict", action="store_true", help="exit 1 when any row fails"),
    check=lambda args: _writable(args.out, "data convert --out", "file"),
)
def _data_convert(args: argparse.Namespace) -> int:
    from omni_rl.data.convert import convert, summary_table

    summary = convert(args.format, args.src, args.out)
    print(summary_table(summary))
    if summary["failed"] and not summary["written"]:  # as preprocess: nothing made is a failure
        print(f"omni-rl: error: {args.src}: every row failed (listed beside {args.out})", file=sys.stderr)
        return 1
    return 1 if args.strict and summary["failed"] else 0


@command(
    "preprocess",
    "decode, sample and resize a dataset's media once, into a cache",
    arg("data", metavar="DATA", help="a JSONL or Parquet dataset"),
    arg("--cache", required=True, metavar="DIR", help="cache directory"),
    arg(
        "--config", metavar="FILE", help="the training config (its media section and data.columns make the keys match)"
    ),
    arg("--workers", type=int, default=None, help="processes (default: the number of cores)"),
    arg(
        "--strict",
        action="store_true",
        help="refuse rows with keys that look misspelt; exit 1 when any row fails (without it: when every row does)",
    ),
    arg("--limit", type=int, default=None, metavar="K", help="only the first K valid rows"),
    overrides("--set media.fps=1"),
    check=_check_preprocess,
)
def _preprocess(args: argparse.Namespace) -> int:
    from omni_rl.preprocess.pipeline import preprocess

    budgets, columns = _budgets(args.config, args.overrides)
    if args.config is None:
        print("preprocess: no --config: the default media settings; pass the training config so its entries match")
    report = preprocess(args.data, args.cache, budgets, args.workers, args.limit, columns=columns, strict=args.strict)
    print(report.table())
    if report.failed:
        print(f"failures: {args.cache}/failures.jsonl")
    if args.config is not None:
        _cache_model_inputs(args)
    # without --strict a failed row is left out; when every row failed nothing is left
    if report.failed and (args.strict or report.failed == report.rows):
        rows = "1 row" if report.failed == 1 else f"{report.failed} rows"
        why = f"{rows} failed (listed in {args.cache}/failures.jsonl), first: {report.failures[0]}"
        print(f"preprocess: {'--strict' if args.strict else 'every row failed'}: exit 1: {why}", file=sys.stderr)
        return 1
    return 0


def _cache_model_inputs(args: argparse.Namespace) -> None:
    """After the media, the model inputs of each row as the training config's run reads
    them (its model's processor, its prompt template, its precision's feature dtype);
    a config that cannot say which says why and caches none."""
    from omni_rl.engine.engine import resolve_precision
    from omni_rl.recipe_loader import load_config
    from omni_rl.recipes.common import write_model_inputs
    from omni_rl.runtime import resolve_device

    cfg = load_config(args.config, args.overrides, recipe="preprocess")
    if not all(hasattr(cfg, name) for name in ("model", "data", "trainer")):
        return  # a media-only config: there is no processor to run
    if not cfg.data.cache_inputs:
        print("model inputs: not cached (data.cache_inputs: false)")
        return
    if not cfg.model.path:
        print("model inputs: not cached (model.path is unset: the tiny model is built at train time)")
        return
    device = resolve_device(cfg.run.device)
    dtype, counts = write_model_inputs(cfg, args.data, args.cache, device, args.limit)
    print(
        f"model inputs ({cfg.model.path}, {dtype} features for a "
        f"{resolve_precision(cfg.trainer.precision, device)} run on {device.type}): "
        f"{counts['written']} written, {counts['present']} already cached, {counts['bad']} rows failed"
    )


@command("cache stats", "entries, bytes and parameter sets of a cache", arg("cache", metavar="DIR"))
def _cache_stats(args: argparse.Namespace) -> int:
    import json

    from omni_rl.preprocess.cache import MediaCache

    print(json.dumps(MediaCache.existing(args.cache).stats(), indent=2))
    return 0


@command(
    "cache verify",
    "re-hash every entry; move corrupt ones aside (a rerun of preprocess rebuilds them); exit 1 if any",
    arg("cache", metavar="DIR"),
)
def _cache_verify(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from omni_rl.preprocess.cache import MediaCache
    from omni_rl.preprocess.inputs import inputs_made_from

    cache = MediaCache.existing(args.cache)
    keys = cache.entry_keys()
    corrupt = [(k, why) for k in tqdm(keys, desc="verify", unit="entry") if (why := cache.check(k))]
    bad = {key for key, _ in corrupt}
    # model inputs encoded from a corrupt media entry pass their own check, and a rebuilt
    # media entry (same key) would lead back to them: they go aside with it
    made = sorted(inputs_made_from(cache, bad) - bad)
    for key, why in corrupt:
        print(f"corrupt: {cache.path(key)}: {why}; moved to {cache.quarantine(key)}")
    for key in made:
        print(f"made from a corrupt entry: {cache.path(key)}; moved to {cache.quarantine(key)}")
    print(f"{len(keys) - len(corrupt) - len(made)} ok, {len(corrupt)} corrupt, {len(made)} made from them")
    if corrupt:
        print("rerun omni-rl preprocess on the datasets (with their configs) to rebuild the corrupt entries")
    return 1 if corrupt else 0


@command(
    "cache gc",
    "remove entries that no row of DATA references",
    arg("cache", metavar="DIR"),
    arg("--data", required=True, action="append", metavar="DATA", help="a dataset whose entries to keep (repeatable)"),
    arg("--config", metavar="FILE", help="the config the cache was built with"),
    arg("--dry-run", action="store_true", help="print what would be deleted and kept; delete nothing"),
    arg(
        "--force",
        action="store_true",
        help="delete even when that is more than what is kept, or when rows of DATA cannot be read",
    ),
    overrides("--set media.fps=1 (the values the cache was built with)"),
)
def _cache_gc(args: argparse.Namespace) -> int:
    from omni_rl.preprocess.cache import MediaCache
    from omni_rl.preprocess.inputs import inputs_of
    from omni_rl.preprocess.pipeline import referenced_keys
    from omni_rl.preprocess.rows import read_rows

    cache = MediaCache.existing(args.cache)
    manifest = cache.manifest()
    budgets, columns = _budgets(args.config, args.overrides)
    keep = set().union(*(referenced_keys(data, budgets, cache, columns) for data in args.data))
    plan = cache.gc_plan(keep | inputs_of(cache, keep))
    summary = (
        f"{len(plan.delete)} entries ({plan.delete_bytes} bytes) to delete, "
        f"{len(plan.keep)} entries ({plan.keep_bytes} bytes) to keep"
    )
    # rows that cannot be read name media too: their entries would go with the rest
    unread = [failure for data in args.data for failure in read_rows(data, columns)[1]]
    listed = "; ".join(f"{f.path} {f.id or ''}: {f.reason}".replace(" :", ":") for f in unread[:3])
    unread_line = f"{len(unread)} row(s) of --data could not be read ({listed}{'; ...' if len(unread) > 3 else ''})"
    if args.dry_run:
        for verb, entries in (("delete", plan.delete), ("keep", plan.keep)):
            for key, size in entries.items():
                meta = cache.meta(key) or {}
                print(f"{verb} {cache.path(key)} {size} bytes ({meta.get('kind', '?')}: {meta.get('source', '?')})")
        if unread:
            print(f"{unread_line}: the media they name count as unreferenced")
        print(f"dry run: {summary}; nothing deleted")
        return 0
    if plan.delete_bytes > plan.keep_bytes and not args.force:
        raise OmniRLError(f"{args.cache}: cache gc refused: {summary}. {_gc_hint(manifest, budgets)}")
    if unread and not args.force:
        raise OmniRLError(
            f"{args.cache}: cache gc refused: {unread_line}, and the entries of the media they name would be "
            "deleted; fix them, or pass --force to delete what the readable rows do not reference"
        )
    freed = sum(cache.remove(key) for key in plan.delete)
    print(f"removed {len(plan.delete)} entries ({freed} bytes), kept {len(plan.keep)} ({plan.keep_bytes} bytes)")
    return 0


def _gc_hint(manifest: dict, budgets) -> str:
    """Why a gc would delete most of a cache, and what to do about it."""
    from omni_rl.preprocess.cache import params_digest

    digest = params_digest(budgets.all_params())
    if digest not in manifest["param_sets"]:
        built = ", ".join(sorted(manifest["param_sets"])) or "none recorded"
        return (
            f"These media settings (params {digest}) are not among those the cache was built with ({built}): "
            "pass the --config (or --set values) it was built with; --dry-run lists the entries, --force deletes"
        )
    return "Check --data (repeat it for every dataset sharing the cache); --dry-run lists the entries, --force deletes"


@command(
    "rewards check",
    "check that every row's problem type is known and its gold answer scorable",
    arg("data", metavar="DATA", help="a JSONL or Parquet dataset"),
    arg("--config", metavar="FILE", help="a config with a 'rewards' section (plug-in scorers) and data.columns"),
    arg("--strict", action="store_true", help="rows with keys that look misspelt are failures, not warnings"),
    overrides("--set rewards.custom.my_type=my_package.rewards:score"),
)
def _rewards_check(args: argparse.Namespace) -> int:
    from collections import Counter

    from tqdm import tqdm

    from omni_rl.preprocess.rows import read_rows
    from omni_rl.rewards import check_targets

    _no_data_without_config(args.config, args.overrides)
    _rewards_config(args)  # registers the config's plug-in scorers
    columns = _data_columns(args)
    rows, failures = read_rows(args.data, columns, args.strict)
    problems = check_targets(tqdm(rows, desc="rewards check", unit="row", leave=False))
    for failure in failures:
        print(f"unreadable: {failure.path}: {failure.reason}")
    for problem in problems:
        print(f"unscorable: {problem.path}: row '{problem.id}': {problem.reason}")
    unscorable = {problem.id for problem in problems}
    counts = Counter(row.problem_type for row in rows if row.id not in unscorable)
    summary = ", ".join(f"{name} {n}" for name, n in sorted(counts.items()))
    summary = f" ({summary})" if summary else ""  # no row read: no types
    print(f"{len(rows) - len(problems)} of {len(rows) + len(failures)} rows scorable{summary}")
    if not rows and not failures:
        print(f"omni-rl: error: {args.data}: holds no row", file=sys.stderr)
    return 1 if problems or failures or not rows else 0


def _data_columns(args: argparse.Namespace) -> dict:
    """``data.columns`` of ``--config`` (empty without one)."""
    from omni_rl.recipe_loader import load_config

    cfg = load_config(args.config, args.overrides, recipe="preprocess")
    return dict(getattr(getattr(cfg, "data", None), "columns", {}) or {})


def _rewards_config(args: argparse.Namespace):
    """The ``rewards`` section of ``--config`` (default: built-in) with its plug-in
    scorers registered; None for a config with no such section."""
    from omni_rl.recipe_loader import load_config
    from omni_rl.rewards import load_plugins

    cfg = load_config(args.config, args.overrides, recipe="preprocess")
    if not hasattr(cfg, "rewards"):
        return None
    load_plugins(cfg.rewards.custom)
    return cfg.rewards


@command(
    "rewards score",
    "score one response (for debugging scorers)",
    arg("--response", required=True, metavar="TEXT", help="the response to score ('-': read it from stdin)"),
    arg("--type", required=True, dest="problem_type", help="problem type"),
    arg("--answer", required=True, help="gold answer (JSON, or plain text)"),
    arg("--options", nargs="+", default=None, metavar="OPTION", help="multiple-choice options, e.g. 'A. cat' 'B. dog'"),
    arg("--config", metavar="FILE", help="a config whose rewards section applies (template, weights, plug-ins)"),
    overrides("--set rewards.template=answer_only"),
)
def _rewards_score(args: argparse.Namespace) -> int:
    import json
    from dataclasses import asdict

    from omni_rl.preprocess.rows import Row
    from omni_rl.rewards import check_targets, score

    rewards = _rewards_config(args)
    response = sys.stdin.read() if args.response == "-" else args.response
    try:
        answer = json.loads(args.answer)
    except json.JSONDecodeError:
        answer = args.answer
    gold = Row("--answer", "", args.problem_type, answer, fields={"options": args.options})
    for problem in check_targets([gold]):  # a gold its scorer cannot read scores every response 0
        raise OmniRLError(f"rewards score: {problem.reason}")
    settings = rewards.settings() if rewards is not None else None
    result = score(args.problem_type, response, answer, options=args.options, settings=settings)
    print(json.dumps(asdict(result), indent=2, ensure_ascii=False))
    return 0


@command(
    "sim collect-demos",
    "record scripted-expert episodes of a task into a safetensors file",
    arg("--task", required=True, help="a task with a scripted expert: PushCube-v1, PickCube-v1 or PixelTargets-v0"),
    arg("--episodes", required=True, type=int, metavar="N", help="episodes to record"),
    arg("--out", required=True, metavar="FILE", help="output .safetensors file"),
    arg(
        "--seed",
        type=int,
        default=2_000_000,
        help="episode e is seeded SEED + e (default: above every training and held-out seed)",
    ),
    arg("--num-envs", type=int, default=2, metavar="K", help="envs stepped together (CPU: one process each)"),
    arg("--backend", choices=("auto", "cpu", "gpu"), default="auto", help="simulator backend (auto: gpu with CUDA)"),
    arg(
        "--action-scale",
        type=float,
        default=1.0,
        metavar="S",
        help="the expert's actions times S (below 1: a slower demonstrator, which RL can beat)",
    ),
    arg(
        "--obs-mode",
        choices=("state", "rgb"),
        default="state",
        help="ManiSkill tasks: rgb records every step's camera image too (for a pi0 policy)",
    ),
    arg("--image-size", type=int, default=None, metavar="S", help="rgb: the camera image's side (default 64)"),
    check=_check_collect_demos,
)
def _sim_collect_demos(args: argparse.Namespace) -> int:
    from omni_rl.runtime import set_threads
    from omni_rl.sim.experts import collect_demos

    set_threads()
    demos = collect_demos(
        args.task,
        args.episodes,
        args.out,
        args.seed,
        args.num_envs,
        backend=args.backend,
        progress=True,
        action_scale=args.action_scale,
        obs_mode=args.obs_mode,
        image_size=args.image_size,
    )
    rate = demos.meta["success_rate"]
    print(f"wrote {args.episodes} episodes ({len(demos.obs)} steps, success rate {rate:.2f}) to {args.out}")
    return 0


def _debug_flag(parser: argparse.ArgumentParser) -> None:
    """``--debug`` after a (sub)command word too; SUPPRESS keeps an unset one from
    resetting the value parsed before the subcommand."""
    parser.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every registered command."""
    parser = argparse.ArgumentParser(prog="omni-rl", description="RL for multimodal models and robot policies.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks for user errors (anywhere on the line)")
    top = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    groups: dict[str, argparse._SubParsersAction] = {}
    for name in COMMANDS:
        cmd = COMMANDS.get(name)
        words = name.split()
        subparsers = top
        if len(words) == 2:
            if words[0] not in groups:
                group = top.add_parser(words[0], help=f"{words[0]} commands")
                _debug_flag(group)
                groups[words[0]] = group.add_subparsers(dest="subcommand", metavar="SUBCOMMAND", required=True)
            subparsers = groups[words[0]]
        sub = subparsers.add_parser(words[-1], help=cmd.help, description=cmd.help)
        _debug_flag(sub)
        for flags, kwargs in cmd.arguments:
            sub.add_argument(*flags, **kwargs)
        sub.set_defaults(handler=cmd.run, check=cmd.check)
    return parser


def _named_configs(args: argparse.Namespace) -> list[str]:
    """The config files on the line: a positional CONFIG or FILE..., --config (once or repeated)."""
    named = []
    for name in ("config_file", "config", "files", "config_files"):
        value = getattr(args, name, None)
        named += value if isinstance(value, list) else [value] if value else []
    return named


def _check_line(args: argparse.Namespace) -> None:
    """What the line itself gets wrong, before anything heavy is imported (torch alone
    takes seconds): every config it names is readable YAML, every ``--set`` is
    KEY=VALUE, then the command's own ``check``."""
    from omni_rl.config import apply_overrides, read_yaml

    for path in _named_configs(args):
        read_yaml(path)
    apply_overrides({}, getattr(args, "overrides", []))
    if args.check is not None:
        args.check(args)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``omni-rl`` console script."""
    args = build_parser().parse_args(argv)
    try:
        _check_line(args)
        from omni_rl.runtime import use_expandable_segments

        use_expandable_segments()  # before anything touches CUDA
        return args.handler(args) or 0
    except OmniRLError as err:
        if args.debug:
            raise
        print(f"omni-rl: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:
        # a path the system refuses (read-only filesystem, a file in the way, no space)
        if args.debug or err.filename is None:
            raise
        print(f"omni-rl: error: {err.filename}: {err.strerror} (rerun with --debug for the traceback)", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("omni-rl: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
