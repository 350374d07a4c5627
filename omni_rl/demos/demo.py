"""The end-to-end demo: a model answers a question about a video it has never seen,
takes a few supervised steps on the right answer, and answers again.

It exercises every layer that exists: a tiny Qwen2.5-VL built offline and loaded back
from disk (or a real checkpoint from ``model.path``), an H.264 clip written and decoded
(decord, PyAV fallback), the family's processor and chat template, generation that
never emits media placeholders, and forward/backward/optimizer steps through the
vision tower. Outputs: ``config.yaml``, ``metrics.jsonl`` and ``summary.json``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from tqdm import tqdm

from omni_rl.config import save_config
from omni_rl.demos.demo_config import DemoConfig
from omni_rl.engine.engine import TrainingEngine, load_dtype, resolve_precision
from omni_rl.errors import OmniRLError
from omni_rl.models import build_tiny, family_of, load, placeholder_token_ids
from omni_rl.models.config import GenerationConfig
from omni_rl.models.inputs import answer_end, append_completion, encode_prompts
from omni_rl.preprocess.synthetic import moving_square, write_video
from omni_rl.preprocess.video import VideoBudget, read_video
from omni_rl.recipes.common import MetricsLog
from omni_rl.runtime import apply_run_settings, resolve_device, seed_everything

QUESTION = "Which way does the red square move? Answer with one word: left, right, up or down."


def _generate(model, processor, inputs, gen: GenerationConfig) -> list[str]:
    """Decode one answer per prompt; media placeholder tokens are never sampled."""
    sampling = {"do_sample": True, "temperature": gen.temperature, "top_p": gen.top_p, "top_k": gen.top_k}
    with torch.no_grad():
        out = model.generate(
            **inputs.to(model.device),
            max_new_tokens=gen.max_new_tokens,
            suppress_tokens=placeholder_token_ids(processor),
            pad_token_id=processor.tokenizer.pad_token_id,
            **(sampling if gen.temperature > 0 else {"do_sample": False}),
        )
    completions = out[:, inputs["input_ids"].shape[1] :]
    return [text.strip() for text in processor.tokenizer.batch_decode(completions, skip_special_tokens=True)]


def _setup_model(cfg: DemoConfig, out: Path):
    device = resolve_device(cfg.run.device)
    if cfg.model.path:
        path = Path(cfg.model.path)
    else:
        path = build_tiny(
            cfg.model.setting("tiny_family"),
            out / "tiny_model",
            cfg.run.seed,
            width=cfg.model.setting("tiny_width"),
            audio_seconds=cfg.model.setting("tiny_audio_seconds"),
        )
    family = family_of(path)
    if "video" not in family.modalities:
        raise OmniRLError(f"{path}: the demo asks about a video, and family '{family.name}' takes no video")
    dtype = load_dtype(resolve_precision(cfg.trainer.precision, device))
    model, processor = load(path, device=device, dtype=dtype)
    return model, processor, path


def main(cfg: DemoConfig) -> dict:
    """Run the demo; returns (and writes) its summary."""
    started = time.perf_counter()
    out = Path(cfg.run.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_config(cfg, out / "config.yaml")
    apply_run_settings(cfg.run)
    seed_everything(cfg.run.seed)

    # MODEL: a tiny random-init model written to disk and loaded back, or model.path
    model, processor, model_path = _setup_model(cfg, out)
    family = family_of(model_path)

    # MEDIA: write an H.264 clip with a known answer, decode it like any dataset video
    v = cfg.video
    frames = moving_square(v.direction, v.seconds, v.fps, v.width, v.height)
    budget = VideoBudget(patch_size=family.patch_size, fps=v.sample_fps, min_frames=2)
    clip = read_video(write_video(out / "clip.mp4", frames, v.fps), budget)
    messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": QUESTION}]}]
    inputs = encode_prompts(processor, [messages], videos=[clip])
    [answer_before] = _generate(model, processor, inputs, cfg.generation)

    # TEACH: supervised steps on the right answer; the loss reaches the vision tower
    target = processor.tokenizer(v.direction + answer_end(processor), return_tensors="pt")["input_ids"]
    batch, labels = append_completion(inputs, target)
    batch = {k: t.to(model.device) for k, t in batch.items()}
    labels = labels.to(model.device)
    model.train()
    engine = TrainingEngine.from_config(model, cfg.trainer, cfg.optimizer, model.device, cfg.trainer.steps)
    history = []
    log = MetricsLog(out, None, every=cfg.trainer.log_every)
    for step in (bar := tqdm(range(cfg.trainer.steps), desc="demo", unit="step")):
        t0 = time.perf_counter()
        loss = engine.model(**batch, labels=labels).loss
        engine.backward(loss)
        result = engine.step()
        row = {
            "step": step + 1,
            "train/loss": loss.item(),
            "train/grad_norm": result.grad_norm,
            "time/step": time.perf_counter() - t0,
        }
        history.append(row)
        log.log(row, force=step + 1 == cfg.trainer.steps)
        bar.set_postfix(loss=f"{row['train/loss']:.3f}")
    log.close()
    model.eval()
    [answer_after] = _generate(model, processor, inputs, cfg.generation)

    summary = {
        "model": str(model_path),
        "family": family_of(model_path).name,
        "parameters": sum(p.numel() for p in model.parameters()),
        "device": str(model.device),
        "video": {"path": str(out / "clip.mp4"), "frames": len(clip.indices), "decoder": clip.backend},
        "prompt_tokens": int(inputs["input_ids"].shape[1]),
        "question": QUESTION,
        "expected": v.direction,
        "answer_before": answer_before,
        "answer_after": answer_after,
        "correct_after": answer_after.lower().split()[:1] == [v.direction],
        "loss_first": history[0]["train/loss"],
        "loss_last": history[-1]["train/loss"],
        "seconds": round(time.perf_counter() - started, 2),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
