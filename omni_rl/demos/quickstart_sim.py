"""The simulation quickstart: a flow policy learns ManiSkill's PushCube on a CPU.

For each of ``seeds`` training seeds (``run.seed``, ``run.seed + 1``, ...) it collects a
few episodes from the scripted expert, clones them into a flow policy (a partial
start), measures held-out success on ``trainer.eval_episodes`` seeds, runs flow-policy
PPO (Flow-Noise by default, ``policy.method=flow_sde`` for Flow-SDE) in CPU envs, and
measures again; each seed's run lies in ``seed_S/``. ``summary.json`` holds every seed's
success after BC and after RL with 95% intervals, the lowest held-out success along
the way, and the mean, spread and range of the gain over seeds.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from omni_rl.config import build_config, save_config, to_dict
from omni_rl.demos.quickstart_sim_config import QuickstartSimConfig
from omni_rl.recipes import flow_ppo
from omni_rl.recipes.flow_ppo_config import FlowPPOConfig
from omni_rl.runtime import apply_run_settings
from omni_rl.sim.experts import DEMO_SEED, collect_demos

# seed S's demonstrations start at DEMO_SEED + DEMO_SEED_STRIDE * S
DEMO_SEED_STRIDE = 10_000


def main(cfg: QuickstartSimConfig) -> dict:
    """Run the simulation quickstart; returns (and writes) its summary."""
    return run_seeds(cfg, run_seed)


def run_seeds(cfg: QuickstartSimConfig, one_seed: Callable[[QuickstartSimConfig, int, Path], dict]) -> dict:
    """``one_seed`` for each training seed, in ``seed_S/``; the summary over them."""
    started = time.perf_counter()
    out = Path(cfg.run.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_config(cfg, out / "config.yaml")
    runtime = apply_run_settings(cfg.run)
    runs = []
    for seed in range(cfg.run.seed, cfg.run.seed + cfg.seeds):
        runs.append(one_seed(cfg, seed, out / f"seed_{seed}"))
        print(
            f"{cfg.env.task} seed {seed}: held-out success {runs[-1]['success_bc']:.3f} after BC, "
            f"{runs[-1]['success_rl']:.3f} after RL (lowest on the way {runs[-1]['lowest_eval']:.3f})"
        )
    summary = {
        "task": cfg.env.task,
        "method": cfg.policy.method
        if cfg.policy.method == "flow_noise"
        else f"flow_sde_{cfg.policy.setting('sde_mode')}",
        "heldout_episodes": cfg.trainer.eval_episodes,
        "demo_episodes": cfg.demo_episodes,
        "seeds": runs,
        **spread(runs),
        "runtime": runtime,
        "seconds": round(time.perf_counter() - started, 1),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(
        f"{cfg.env.task}, {len(runs)} seed(s): gain {summary['gain_mean']:+.3f} "
        f"(std {summary['gain_std']:.3f}, range {summary['gain_min']:+.3f} to {summary['gain_max']:+.3f}); "
        f"success {summary['success_bc_mean']:.3f} after BC, {summary['success_rl_mean']:.3f} after RL "
        f"({summary['seconds']} s)"
    )
    return summary


def run_seed(cfg: QuickstartSimConfig, seed: int, out: Path, policy: dict | None = None) -> dict:
    """Demos, BC and PPO with training seed ``seed`` in ``out``; that run's results.
    ``policy``: fields that replace the config's ``policy:`` ones."""
    demos = out / "demos.safetensors"
    collect_demos(
        cfg.env.task,
        cfg.demo_episodes,
        demos,
        seed=demo_seed(seed),
        num_envs=cfg.env.num_envs,
        backend=cfg.env.backend,
        controls=cfg.env.controls(),
        action_scale=cfg.demo_action_scale,
    )
    result = flow_ppo.train(train_config(cfg, seed, out / "flow_ppo", demos, policy))
    rows = [json.loads(line) for line in (out / "flow_ppo" / "metrics.jsonl").read_text().splitlines() if line]
    from omni_rl.plots import plot_metrics

    plot_metrics(out / "flow_ppo", out / "plots")
    keys = ("success_bc", "success_bc_ci95", "success_rl", "success_rl_ci95", "env_steps", "seconds")
    return {
        "seed": seed,
        **{k: result[k] for k in keys},
        "gain": round(result["success_rl"] - result["success_bc"], 4),
        "lowest_eval": min(r["eval/success"] for r in rows if "eval/success" in r),
        "eval_curve": [[r["step"], r["eval/success"]] for r in rows if "eval/success" in r],
    }


def demo_seed(seed: int) -> int:
    """The first demonstration seed of training seed ``seed``."""
    return DEMO_SEED + DEMO_SEED_STRIDE * seed


def train_config(
    cfg: QuickstartSimConfig, seed: int, out: Path, demos: Path, policy: dict | None = None
) -> FlowPPOConfig:
    """The flow_ppo recipe's config of training seed ``seed``: the quickstart's sections,
    ``policy`` replacing fields of its ``policy:``."""
    return build_config(
        FlowPPOConfig,
        {
            **{k: to_dict(getattr(cfg, k)) for k in ("env", "ppo", "trainer")},
            "policy": {**to_dict(cfg.policy), **(policy or {})},
            "run": {**to_dict(cfg.run), "seed": seed, "output_dir": str(out), "overwrite": True},
            "bc": {**to_dict(cfg.bc), "demos": str(demos)},
        },
        "quickstart sim",
    )


def spread(runs: list[dict]) -> dict:
    """Mean, (sample) std, min and max over seeds of success after BC and RL and the gain."""
    stats = {}
    for key in ("success_bc", "success_rl", "gain"):
        values = [r[key] for r in runs]
        stats[f"{key}_mean"] = round(statistics.fmean(values), 4)
        stats[f"{key}_std"] = round(statistics.stdev(values), 4) if len(values) > 1 else 0.0
        stats[f"{key}_min"] = min(values)
        stats[f"{key}_max"] = max(values)
    return stats
