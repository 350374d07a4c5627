"""Pieces every training recipe shares: run setup, model and optimizer setup, phase
timers and the metrics log. The loops themselves stay in their recipe files."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from omni_rl import checkpoint
from omni_rl.config import save_config
from omni_rl.errors import OmniRLError
from omni_rl.models import build_tiny, load
from omni_rl.runtime import resolve_device, resolve_dtype, seed_everything, set_threads


def start_run(cfg, resume: str | None) -> tuple[Path, Path | None]:
    """Create the output directory, write the resolved config, pin threads, seed, and
    find the checkpoint to resume from ('auto': the newest one; or a path)."""
    out = Path(cfg.run.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_config(cfg, out / "config.yaml")
    set_threads(cfg.run.threads)
    seed_everything(cfg.run.seed)
    if resume == "auto":
        return out, checkpoint.latest(out)
    if resume:
        path = Path(resume)
        if not (path / "state.json").is_file():
            raise OmniRLError(f"{path}: not a checkpoint (no state.json)")
        return out, path
    return out, None


def setup_model(cfg, out: Path, resume_from: Path | None, with_reference: bool = False):
    """The trainable model and its processor, plus a frozen reference copy when asked
    (and not using LoRA, whose reference is the base with adapters disabled).

    A tiny model is built under ``out/tiny_model`` when ``model.path`` is unset; a
    resumed run loads the checkpoint's weights.
    """
    device = resolve_device(cfg.run.device)
    dtype = resolve_dtype(cfg.run.dtype, device)
    base = Path(cfg.model.path) if cfg.model.path else out / "tiny_model"
    if not cfg.model.path and not (base / "config.json").is_file():
        build_tiny(cfg.model.tiny_family, base, seed=cfg.run.seed, width=cfg.model.tiny_width)
    lora = cfg.model.lora
    source = resume_from / "model" if resume_from is not None and lora is None else base
    model, processor = load(source, device=device, dtype=dtype)
    if cfg.model.freeze_vision_tower:
        for name, param in model.named_parameters():
            if "visual" in name:
                param.requires_grad_(False)
    if lora is not None:
        from peft import LoraConfig, PeftModel, get_peft_model

        if resume_from is not None:
            model = PeftModel.from_pretrained(model, resume_from / "model", is_trainable=True)
        else:
            targets = "|".join(lora.target_modules)
            spec = LoraConfig(
                r=lora.rank,
                lora_alpha=lora.alpha,
                lora_dropout=lora.dropout,
                target_modules=rf".*language_model.*\.({targets})",
            )
            model = get_peft_model(model, spec)
    if cfg.model.gradient_checkpointing:
        # transformers >= 5.x names it activation checkpointing; older 5.x releases do not
        enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        enable()
    reference = None
    if with_reference and lora is None:
        reference, _ = load(base, device=device, dtype=dtype)
        reference.requires_grad_(False)
    model.train()
    return model, processor, reference


def setup_data(cfg):
    """The training rows (routed and checked against the reward registry) and a
    resumable sampler over them."""
    from omni_rl.data.dataset import MediaDataset
    from omni_rl.data.sampler import PromptSampler
    from omni_rl.preprocess.pipeline import Budgets

    data = cfg.data
    dataset = MediaDataset(
        data.train, Budgets.from_config(cfg.media), data.cache, data.cache_mode, data.strict, data.prompt_template
    )
    return dataset, PromptSampler(len(dataset), cfg.run.seed, data.shuffle)


def setup_optimizer(cfg, model):
    """The configured optimizer over trainable parameters, with linear warm-up."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise OmniRLError("no trainable parameters (is everything frozen?)")
    optimizer = cfg.optimizer.build(params)
    warmup = cfg.trainer.warmup_steps
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup) if warmup else 1.0)
    return optimizer, scheduler


def resume_state(resume_from: Path | None, optimizer, scheduler, sampler) -> int:
    """Restore optimizer, scheduler, RNG and sampler from a checkpoint; returns its step
    (0 for a fresh run)."""
    if resume_from is None:
        return 0
    state = checkpoint.load_state(resume_from, optimizer, scheduler)
    sampler.load_state_dict(state["sampler"])
    return state["step"]


def save_if_due(cfg, out: Path, step: int, model, processor, optimizer, scheduler, sampler) -> None:
    """Checkpoint after ``step`` (1-based) every ``trainer.save_every`` steps and at the end."""
    every = cfg.trainer.save_every
    if step == cfg.trainer.steps or (every and step % every == 0):
        checkpoint.save(
            out, step, model, processor, optimizer, scheduler, sampler.state_dict(), keep_last=cfg.trainer.keep_last
        )


class Timer:
    """Seconds per phase of a step: ``with timer("rollout"): ...``."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    def __call__(self, phase: str):
        timer = self

        class _Phase:
            def __enter__(self):
                self.start = time.perf_counter()

            def __exit__(self, *exc):
                timer.seconds[phase] = timer.seconds.get(phase, 0.0) + time.perf_counter() - self.start

        return _Phase()

    @property
    def total(self) -> float:
        return sum(self.seconds.values())

    def metrics(self) -> dict:
        return {**{f"time/{k}": v for k, v in self.seconds.items()}, "time/step": self.total}


class MetricsLog:
    """Per-step metrics as JSONL (``metrics.jsonl``) and TensorBoard events.

    Resuming from step k keeps the rows of steps <= k and drops later ones (the resumed
    run redoes them), so the file ends up as the uninterrupted run's.
    """

    def __init__(self, out: Path, resumed_step: int | None):
        self.path = out / "metrics.jsonl"
        if resumed_step is None:
            self.path.unlink(missing_ok=True)
        elif self.path.exists():
            kept = [
                line for line in self.path.read_text().splitlines() if line and json.loads(line)["step"] <= resumed_step
            ]
            self.path.write_text("".join(line + "\n" for line in kept))
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(out / "tensorboard"))

    def log(self, row: dict) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        for key, value in row.items():
            if key != "step" and isinstance(value, (int, float)):
                self.writer.add_scalar(key, value, row["step"])

    def close(self) -> None:
        self.writer.close()
