"""The simulation quickstart: a flow policy learns ManiSkill's PushCube on a CPU.

It collects a few episodes from the scripted expert, clones them into a flow policy
(a partial start), measures held-out success on ``trainer.eval_episodes`` seeds, runs
Flow-Noise PPO in CPU envs, measures again, and writes ``summary.json``
(``success_bc``, ``success_rl``, ``env_steps``, ``seconds``) and curve PNGs.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from omni_rl.config import config_from_dict, save_config, to_dict
from omni_rl.demos.quickstart_sim_config import QuickstartSimConfig
from omni_rl.recipes import flow_ppo
from omni_rl.runtime import set_threads
from omni_rl.sim.experts import collect_demos

# demonstrations come from seeds that neither training nor evaluation draws
DEMO_SEED = 2_000_000


def main(cfg: QuickstartSimConfig) -> dict:
    """Run the simulation quickstart; returns (and writes) its summary."""
    started = time.perf_counter()
    out = Path(cfg.run.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_config(cfg, out / "config.yaml")
    set_threads(cfg.run.threads)
    # DEMOS: the scripted expert, acting from the state
    demos = out / "demos.safetensors"
    collect_demos(
        cfg.env.task,
        cfg.demo_episodes,
        demos,
        seed=DEMO_SEED + cfg.run.seed,
        num_envs=cfg.env.num_envs,
        backend=cfg.env.backend,
    )
    # BC + PPO: the flow recipe clones the demos, evaluates, trains, evaluates again
    train_cfg = config_from_dict(
        {
            "recipe": "flow_ppo",
            **{k: to_dict(getattr(cfg, k)) for k in ("env", "policy", "ppo", "trainer")},
            "run": {**to_dict(cfg.run), "output_dir": str(out / "flow_ppo"), "overwrite": True},
            "bc": {**to_dict(cfg.bc), "demos": str(demos)},
        },
        "quickstart sim",
    )
    result = flow_ppo.train(train_cfg)
    summary = {
        "task": cfg.env.task,
        "success_bc": result["success_bc"],
        "success_rl": result["success_rl"],
        "heldout_episodes": cfg.trainer.eval_episodes,
        "demo_episodes": cfg.demo_episodes,
        "env_steps": result["env_steps"],
        "seconds": round(time.perf_counter() - started, 1),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    from omni_rl.plots import plot_metrics

    plot_metrics(out / "flow_ppo", out / "plots")
    print(
        f"{cfg.env.task}: held-out success {summary['success_bc']:.2f} after BC, "
        f"{summary['success_rl']:.2f} after RL ({summary['env_steps']} env steps, {summary['seconds']} s)"
    )
    return summary
