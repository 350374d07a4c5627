"""Generation engines, chosen by ``rollout.engine``: hf (CPU and GPU; samples with the
policy's own weights) and vllm (GPU, optional extra; weights copied in after updates).

Every engine offers ``rollout(samples, encoded, n, sampling) -> Rollouts`` and
``load_weights(model)``, called after each optimizer step.
"""

from __future__ import annotations

from pathlib import Path

from omni_rl.registry import Registry

ENGINES: Registry = Registry("rollout engine")


@ENGINES.register("hf")
def _hf(cfg, model, processor, model_dir: Path):
    from omni_rl.rollout.hf import HFRolloutEngine

    return HFRolloutEngine(model, processor)


@ENGINES.register("vllm")
def _vllm(cfg, model, processor, model_dir: Path):
    from omni_rl.rollout.vllm import VLLMRolloutEngine

    engine = VLLMRolloutEngine(model_dir, processor, cfg.rollout.vllm, seed=cfg.run.seed)
    engine.load_weights(model)  # a resumed or LoRA policy differs from model_dir's weights
    return engine


def build_engine(cfg, model, processor, model_dir: Path):
    """The configured engine for a policy loaded from ``model_dir``."""
    return ENGINES.get(cfg.rollout.engine)(cfg, model, processor, model_dir)
