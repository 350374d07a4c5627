"""The model and its inputs of a traced GRPO step (``tools/trace_memory.py``): the
architecture from a config.json, the model loaded by the recipe's own code with only
the weight reads answered under fake tensors, and a 16:9 video prompt at the media
budgets' most frames."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
from pathlib import Path
from unittest import mock

import numpy as np
import torch
from fake_values import ROOT

MODEL_CONFIGS = ROOT / "tools" / "model_configs"


@dataclasses.dataclass
class Architecture:
    """What the trace builds: the model's transformers config, its family, a processor."""

    config: object
    family: object
    processor: object
    source: str
    """Where the config came from."""
    path: Path
    """The checkpoint directory the trace loads from: config.json and the processor, no
    weights (a tiny model's: with them)."""


def model_json(path: str, model_config: Path | None) -> tuple[dict, Path]:
    """(the architecture's fields, the file they came from): ``model_config``, else
    ``path``'s config.json, else ``tools/model_configs/<name of path>.json``."""
    if model_config is None:
        for candidate in (Path(path) / "config.json", MODEL_CONFIGS / f"{Path(path).name}.json"):
            if candidate.is_file():
                model_config = candidate
                break
        else:
            raise SystemExit(f"no config.json for {path}: pass --model-config PATH")
    raw = json.loads(model_config.read_text())
    raw.pop("_source", None)
    return raw, model_config


def architecture(cfg, model_config: Path | None, work: Path) -> Architecture:
    """The config's model without its weights: a tiny model's checkpoint is written (it is
    small) and read back; a released model's config.json is ``model_config``, else the one
    at ``model.path``, else ``tools/model_configs/<name of model.path>.json``. A released
    model gets the offline tokenizer of the tiny models (its vocabulary keeps the model's
    size: only the special tokens' ids change, to that tokenizer's)."""
    from transformers import AutoConfig, AutoProcessor

    from omni_rl.models import build_tiny, family_of
    from omni_rl.models.families import FAMILIES
    from omni_rl.models.tokenizer import build_tokenizer

    if not cfg.model.path and model_config is None:
        out = build_tiny(
            cfg.model.setting("tiny_family"),
            work / "tiny_model",
            seed=cfg.run.seed,
            width=cfg.model.setting("tiny_width"),
            audio_seconds=cfg.model.setting("tiny_audio_seconds"),
        )
        config = AutoConfig.from_pretrained(out, local_files_only=True)
        processor = AutoProcessor.from_pretrained(out, local_files_only=True)
        name = cfg.model.setting("tiny_family")
        return Architecture(config, family_of(out), processor, f"tiny {name} (built here)", out)
    raw, model_config = model_json(cfg.model.path, model_config)
    family = FAMILIES.get(raw["model_type"])
    tokenizer = build_tokenizer(family.tokens)
    tiny = family.tiny_config(tokenizer, 64)
    ids = {k: v for k, v in tiny.to_dict().items() if k.endswith(("_token_id", "_token_index")) and v is not None}
    config = AutoConfig.for_model(**{**raw, **ids})
    processor = family.tiny_processor(tokenizer)
    path = work / "checkpoint"
    config.save_pretrained(path)
    processor.save_pretrained(path)
    source = model_config.resolve()
    source = source.relative_to(ROOT) if source.is_relative_to(ROOT) else source
    return Architecture(config, family, processor, str(source), path)


def load_models(cfg, trainer, arch: Architecture, device: torch.device, fake_mode, world: int) -> tuple:
    """(model, reference or None) as the recipe loads them (``setup_model``: built on the
    meta device when FSDP2 spans several ranks, the vision tower frozen and gradient
    checkpointing as configured, the reference beside), from ``arch.path``, on
    rank 0 of ``world`` (1: the whole model, for the unsharded checks); call
    ``TrainingEngine.from_config`` on them inside ``filled``. Under ``fake_mode`` the
    weights the recipe would read are made by it instead (none are there): a whole model
    is built from its config, in the fake mode (no memory, no values)."""
    import omni_rl.models as models
    from omni_rl.engine.distributed import Ranks
    from omni_rl.recipes.common import Run, setup_model

    # the architecture's directory stands for the checkpoint (a tiny model's settings built it)
    unset = dict.fromkeys(cfg.model.UNSET)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=str(arch.path), **unset), trainer=trainer)
    run = Run(arch.path, Ranks(0, world, 0), device, None)

    built = []

    def read(path, family, dtype):
        """The whole model, built on ``device`` (``load`` then moves it there: a no-op
        here, as ``Module.to`` cannot swap fake parameters)."""
        with torch.device(device):
            model = family.model_cls()._from_config(arch.config, dtype=dtype)
        model.to = lambda *args, **kwargs: model
        built.append(model)
        return model

    with fake_mode, contextlib.ExitStack() as stack:
        if not isinstance(fake_mode, contextlib.nullcontext):
            stack.enter_context(mock.patch.object(models, "_read", read))
        torch.manual_seed(cfg.run.seed)
        model, _, reference = setup_model(cfg, run, with_reference=cfg.algorithm.kl_coef > 0)
    for whole in built:
        del whole.to
    return model, reference


@contextlib.contextmanager
def filled(fake_mode):
    """``omni_rl.models.weights.fill`` as every rank runs it once the engine has sharded a
    model built empty, in ``fake_mode``, without the broadcast of rank 0's weights (a fake
    process group carries no data, and there are none to read)."""
    import torch.distributed.checkpoint.state_dict as state_dict

    import omni_rl.models as models
    from omni_rl.models import weights

    def fill(model, device):
        with fake_mode, mock.patch.object(state_dict, "set_model_state_dict", lambda *args, **kwargs: None):
            weights.fill(model, None, device)

    if isinstance(fake_mode, contextlib.nullcontext):
        yield
        return
    with mock.patch.object(models, "fill_sharded", fill):
        yield


def prompt(cfg, arch: Architecture, prompt_tokens: int | None) -> tuple:
    """The sample and its encoded prompt (real CPU tensors): ``media.max_frames`` frames of
    a 1280x720 video resized under the pixel budgets (a square or wider-than-16:9 clip
    would give up to 6% more tokens), or ``media.max_audio_seconds`` of audio, and a question in the config's
    template; with ``prompt_tokens``, the question is padded to that many tokens in all."""
    from omni_rl.data.dataset import Sample, build_messages, encode_sample, render_prompt
    from omni_rl.preprocess.pipeline import Budgets
    from omni_rl.preprocess.rows import Row
    from omni_rl.preprocess.video import VideoClip, resized_size, sample_indices

    budgets = Budgets.from_config(cfg.media)
    kinds, media = [], {}
    if "video" in arch.family.modalities:
        budget = budgets.video
        fps = 30.0
        seconds = math.ceil(budget.max_frames / (budget.fps or 2.0)) + 1
        indices = sample_indices(int(fps * seconds), fps, budget)
        height, width = resized_size(720, 1280, len(indices), budget)
        frames = np.zeros((len(indices), 3, height, width), dtype=np.uint8)
        media["videos"] = [VideoClip(frames, fps, int(fps * seconds), indices, (720, 1280))]
        kinds.append("video")
    elif "audio" in arch.family.modalities:
        media["audios"] = [np.zeros(int(budgets.max_audio_seconds * 16_000), dtype=np.float32)]
        kinds.append("audio")
    options = ["left to right", "right to left", "towards the camera", "it does not move"]
    problem = "Which way does the red object move?"

    def encode(problem: str) -> tuple:
        row = Row("trace", problem, "multiple_choice", "A", fields={"options": options})
        messages = build_messages(render_prompt(cfg.data.prompt_template, row), kinds)
        sample = Sample("trace", "multiple_choice", "A", messages, options=options, **media)
        return sample, dict(encode_sample(arch.processor, sample))

    sample, encoded = encode(problem)
    if prompt_tokens:
        for _ in range(3):  # the offline tokenizer takes about one token per byte of text
            short = prompt_tokens - encoded["input_ids"].shape[1]
            if short <= 0:
                break
            problem = problem + " and" * (short // 4) + "?" * (short % 4)
            sample, encoded = encode(problem)
    return sample, encoded


def kernel_of(optimizer, target: str) -> None:
    """AdamW's kernel set to the one the engine picks on ``target`` (the trace builds
    the engine on the CPU, where it picks another)."""
    from omni_rl.engine.config import adamw_kernel

    if isinstance(optimizer, torch.optim.AdamW):
        kernel = adamw_kernel(torch.device(target))
        for group in optimizer.param_groups:
            group["foreach"], group["fused"] = kernel == "foreach", kernel == "fused"
