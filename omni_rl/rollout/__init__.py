"""Generation engines, chosen by ``rollout.engine``: hf (CPU and GPU; samples with the
policy's own weights) and vllm (GPU, optional extra; weights copied in after updates).

Every engine offers ``rollout(samples, encoded, n, sampling, seeds) -> Rollouts``;
``sleep()``, called when a step's rollouts are done (its GPU memory goes to the
update); ``load_weights(model)``, called after each optimizer step (it wakes a sleeping
engine with the new weights); ``max_prompt_tokens(rollout_config)``; and ``banned``,
the token ids its sampling never draws.
"""

from __future__ import annotations

from pathlib import Path

from omni_rl.registry import Registry

ENGINES: Registry = Registry("rollout engine")


@ENGINES.register("hf")
def _hf(cfg, model, processor, model_dir: Path, work_dir: Path):
    from omni_rl.rollout.hf import HFRolloutEngine

    return HFRolloutEngine(model, processor)


@ENGINES.register("vllm")
def _vllm(cfg, model, processor, model_dir: Path, work_dir: Path):
    from omni_rl.rollout.vllm import VLLMRolloutEngine

    return VLLMRolloutEngine(model_dir, processor, cfg.rollout, model, work_dir, seed=cfg.run.seed)


def build_rollout_engine(cfg, model, processor, model_dir: Path, work_dir: Path):
    """The configured engine for a policy loaded from ``model_dir``; ``work_dir`` (the
    run's directory) holds what an engine writes (vLLM's LoRA adapters). Call
    ``load_weights(model)`` before the first rollout."""
    return ENGINES.get(cfg.rollout.engine)(cfg, model, processor, model_dir, work_dir)
