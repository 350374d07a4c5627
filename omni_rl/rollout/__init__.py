"""Generation engines, chosen by ``rollout.engine``: hf (CPU and GPU; samples with the
policy's own weights) and vllm (GPU, optional extra; weights copied in after updates).

Every engine offers ``rollout(samples, encoded, n, sampling, seeds) -> Rollouts``;
``sleep()``, called when a step's rollouts are done (its GPU memory goes to the
update); ``load_weights(model)``, called after each optimizer step (it wakes a sleeping
engine with the new weights); ``max_prompt_tokens(rollout_config)``; ``metrics()``, what its rollouts cost since the
last call; and ``banned``, the token ids its sampling never draws.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from omni_rl.registry import Registry

ENGINES: Registry = Registry("rollout engine")


@ENGINES.register("hf")
def _hf(cfg, model, processor, model_dir: Path, work_dir: Path):
    from omni_rl.rollout.hf import HFRolloutEngine

    return HFRolloutEngine(model, processor, cfg.rollout.gather_once)


@ENGINES.register("vllm")
def _vllm(cfg, model, processor, model_dir: Path, work_dir: Path):
    from omni_rl.rollout.vllm import VLLMRolloutEngine

    return VLLMRolloutEngine(model_dir, processor, cfg.rollout, model, work_dir, seed=cfg.run.seed)


def build_rollout_engine(cfg, model, processor, model_dir: Path, work_dir: Path):
    """The configured engine for a policy loaded from ``model_dir``; ``work_dir`` (the
    run's directory) holds what an engine writes (vLLM's LoRA adapters). Call
    ``load_weights(model)`` before the first rollout."""
    return ENGINES.get(cfg.rollout.engine)(cfg, model, processor, model_dir, work_dir)


def prompt_seed(seed: int, drawn: int, n: int) -> int:
    """The sampling seed of the prompt that is the run's ``drawn``-th draw (GRPO: the
    sampler's counter, saved in checkpoints; curation: the row's index): the same on
    whichever rank rolls it out, and distinct for every draw, also for a row drawn twice
    in one call or after a resume. Engines seed completion g of the group with seed + g (vLLM's rule for its
    child requests), so seeds step by the group size ``n`` and no two completions of a
    run share one (below 2**62 draws)."""
    offset = int.from_bytes(hashlib.blake2b(f"omni_rl-seed-{seed}".encode(), digest_size=8).digest(), "little")
    return (offset % 2**61 + drawn * n) % 2**62
