"""Benchmark the flow-PPO training loop against bare environment stepping.

    python tools/bench_sim.py [--task PushCube-v1 --envs 2 4 8 --iterations 3]

For each N, on the same vector env: (a) env steps/s of stepping it with random actions
(the ceiling), (b) env steps/s of the training loop, rollout (policy sampling, chunk
execution, bootstrap values) plus the PPO update, amortized over whole iterations of
the real ``omni_rl.recipes.flow_ppo`` and ``omni_rl.sim.rollout`` functions. Prints both per N and the ratio
(b)/(a), target >= 0.7, last.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch

from omni_rl.config import load_config
from omni_rl.engine.distributed import Ranks
from omni_rl.recipes import flow_ppo
from omni_rl.recipes.common import Run
from omni_rl.runtime import set_threads
from omni_rl.sim import make_vec_env
from omni_rl.sim.rollout import EnvShare, collect, episode_seeds


def random_steps_per_s(env, steps: int) -> float:
    """Env steps/s stepping ``env`` with uniform random actions."""
    env.reset(seed=0)
    low, high = env.action_low.cpu(), env.action_high.cpu()
    started = time.perf_counter()
    for _ in range(steps):
        env.step(low + (high - low) * torch.rand(env.num_envs, env.action_dim))
    return steps * env.num_envs / (time.perf_counter() - started)


def training_steps_per_s(env, cfg, iterations: int) -> float:
    """Env steps/s of whole training iterations (rollout + update), one process."""
    run = Run(Path("."), Ranks(), torch.device("cpu"), None)
    envs = EnvShare.whole(env.num_envs)
    stream = flow_ppo.shared_stream(cfg)
    policy = flow_ppo.build_policy(cfg, env.obs_dim, env.action_dim, stream)
    engine = flow_ppo.make_engine(policy, cfg, run)
    flow_ppo.use_ppo_optimizer(engine, cfg)
    chunks = math.ceil(cfg.env.max_episode_steps / policy.executed)

    def rollout(iteration: int):
        seeds = episode_seeds(cfg.run.seed, iteration, env.num_envs, 1, cfg.trainer.eval_seed)
        return collect(policy, env, envs, env.reset(seed=seeds), chunks, stream, run.device)

    rollout(0)  # warm-up
    steps, started = 0, time.perf_counter()
    for iteration in range(1, iterations + 1):
        batch, _ = rollout(iteration)
        adv, returns = flow_ppo.advantages(batch, cfg)
        flow_ppo.update(engine, batch, adv, returns, cfg, envs, stream)
        steps += batch.rewards.numel()  # [T, N, h]: one entry per env step
    return steps / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", default="PushCube-v1")
    parser.add_argument("--envs", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--config", default="configs/maniskill_pushcube_flow_noise.yaml")
    args = parser.parse_args()
    set_threads(1)
    ratios = []
    for n in args.envs:
        overrides = [f"env.task={args.task}", f"env.num_envs={n}", "env.backend=cpu", "bc.demos=null"]
        cfg = load_config(args.config, overrides)
        env = make_vec_env(
            args.task,
            n,
            backend="cpu",
            obs_mode=cfg.env.obs_mode,
            control_mode=cfg.env.control_mode,
            max_episode_steps=cfg.env.max_episode_steps,
            ignore_terminations=cfg.env.ignore_terminations,
        )
        try:
            bare = random_steps_per_s(env, cfg.env.max_episode_steps * 2)
            loop = training_steps_per_s(env, cfg, args.iterations)
        finally:
            env.close()
        ratios.append(loop / bare)
        print(f"N={n}: random actions {bare:.0f} env steps/s, training loop {loop:.0f} env steps/s")
    pairs = ", ".join(f"N={n} {r:.2f}" for n, r in zip(args.envs, ratios, strict=True))
    print(f"ratio (training loop / random stepping): {pairs}")


if __name__ == "__main__":
    main()
