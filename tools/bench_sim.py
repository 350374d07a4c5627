"""Benchmark the flow-PPO training loop against bare environment stepping.

    python tools/bench_sim.py [--task PushCube-v1 --envs 2 4 8 --rounds 5]

For each N, on the same CPU vector env, in alternating rounds (the machine's drift
then slows both sides alike):

- (a) bare stepping, the ceiling: a seeded reset and one iteration's env steps with
  uniform random actions;
- (b) one whole training iteration of the real ``omni_rl.recipes.flow_ppo`` and
  ``omni_rl.sim.episodes`` functions: seeded reset, rollout (policy sampling, chunk
  execution, bootstrap values), advantages and the PPO update.

The update keeps the config's mini-batch *size* (the chunks of an optimizer step at the
config's own ``env.num_envs``) at every N, so that every N does the same update work per
env step: the CPU config's 8 envs cut 104 chunks an iteration into 4 mini-batches of
26, so N = 2 runs 1 mini-batch an epoch and N = 4 runs 2. Where that differs from the
config's mini-batch *count*, a second loop with the count is timed too (N = 2: 4
mini-batches of about 7 chunks, 4 times the update work per env step). Prints env
steps/s of each per N, and the ratios (b)/(a), target >= 0.7, last.

With ``--camera S`` it measures the envs with a camera instead (``obs_mode: rgb``, S²
images), by random stepping in alternating rounds: the state env (no images), the
camera rendered at every step, and the camera rendered as a rollout renders it (the
last step of each executed chunk, and episode ends). Prints env steps/s of each per N.

The trainer runs on one torch thread (the env workers, one process per env, take the
cores; a second intra-op thread competes with them: at N = 2 on 2 cores the ratio reads
a few points lower with two).
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch

from omni_rl.engine.distributed import Ranks
from omni_rl.recipe_loader import load_config
from omni_rl.recipes import flow_ppo
from omni_rl.recipes.common import Run
from omni_rl.recipes.flow_ppo_config import FlowPPOConfig
from omni_rl.runtime import set_threads
from omni_rl.sim import make_vec_env
from omni_rl.sim.episodes import EnvShare, collect, episode_seeds


def minibatches_at_size(cfg: FlowPPOConfig, num_envs: int) -> int:
    """The mini-batch count that gives ``num_envs`` envs the config's mini-batch size."""
    return max(1, round(cfg.ppo.minibatches * num_envs / cfg.env.num_envs))


def chunks_per_env(cfg: FlowPPOConfig) -> int:
    """Chunks an env plays in one iteration (an episode's steps, in executed chunks)."""
    return math.ceil(cfg.env.max_episode_steps / cfg.policy.executed)


def random_round(env, vector_steps: int, seed: int, look_every: int = 0) -> float:
    """Seconds of a seeded reset and ``vector_steps`` steps with uniform random actions;
    ``look_every``: a camera env renders every this many steps (a chunk's last), 0: at
    every step."""
    low, high = env.action_low.cpu(), env.action_high.cpu()
    started = time.perf_counter()
    env.reset(seed=seed)
    for j in range(vector_steps):
        actions = low + (high - low) * torch.rand(env.num_envs, env.action_dim)
        if look_every:
            env.step(actions, look=(j + 1) % look_every == 0)
        else:
            env.step(actions)
    return time.perf_counter() - started


def camera_rows(args, shipped: FlowPPOConfig) -> None:
    """Env steps/s of random stepping per N: state, camera at every step, camera once a
    chunk (``policy.executed`` steps), in alternating rounds after a warm-up."""
    e, executed = shipped.env, shipped.policy.executed
    steps = chunks_per_env(shipped) * executed
    modes = {"obs_mode": "rgb", "image_size": args.camera}
    print(f"{args.task}: random actions, {steps}-step rounds, camera {args.camera}², chunks of {executed}")
    for n in args.envs:
        common = {"backend": "cpu", "control_mode": e.control_mode, "max_episode_steps": e.max_episode_steps}
        state = make_vec_env(args.task, n, **common)
        camera = make_vec_env(args.task, n, **common, **modes)
        seconds = [0.0, 0.0, 0.0]
        try:
            for r in range(args.rounds + 1):
                timed = [random_round(state, steps, r), random_round(camera, steps, r)]
                timed.append(random_round(camera, steps, r, look_every=executed))
                if r:
                    seconds = [a + b for a, b in zip(seconds, timed, strict=True)]
        finally:
            state.close()
            camera.close()
        rates = [args.rounds * steps * n / s for s in seconds]
        print(
            f"N={n}: state {rates[0]:.0f} env steps/s, camera every step {rates[1]:.0f}, "
            f"camera once a chunk {rates[2]:.0f} ({rates[2] / rates[1]:.1f}x every step)"
        )


class TrainingLoop:
    """Flow-PPO training in one process on ``env``: one iteration per call, timed."""

    def __init__(self, env, cfg: FlowPPOConfig):
        self.env, self.cfg = env, cfg
        self.run = Run(Path("."), Ranks(), torch.device("cpu"), None)
        self.envs = EnvShare.whole(env.num_envs)
        self.stream = flow_ppo.shared_stream(cfg)
        self.policy = flow_ppo.build_policy(cfg, env.obs_dim, env.action_dim, self.stream)
        self.engine = flow_ppo.make_engine(self.policy, cfg, self.run)
        flow_ppo.use_ppo_optimizer(self.engine, cfg)
        self.chunks = chunks_per_env(cfg)

    def iteration(self, iteration: int) -> tuple[int, float]:
        """(env steps, seconds) of training iteration ``iteration``."""
        cfg, env = self.cfg, self.env
        started = time.perf_counter()
        seeds = episode_seeds(cfg.run.seed, iteration, env.num_envs, 1, cfg.trainer.eval_seed)
        obs = env.reset(seed=seeds)
        batch, _ = collect(self.policy, env, self.envs, obs, self.chunks, self.stream, self.run.device)
        adv, returns = flow_ppo.advantages(batch, cfg)
        flow_ppo.update(self.engine, batch, adv, returns, cfg, self.envs, self.stream)
        return batch.rewards.numel(), time.perf_counter() - started  # rewards: [T, N, h]


def bench(env, loops: list[TrainingLoop], rounds: int) -> tuple[float, list[float]]:
    """Env steps/s of random stepping and of each loop, over ``rounds`` alternating
    rounds after one untimed warm-up round."""
    bare_seconds, seconds, steps = 0.0, [0.0] * len(loops), 0
    for r in range(rounds + 1):
        bare = random_round(env, loops[0].chunks * loops[0].policy.executed, seed=r)
        timed = [loop.iteration(r) for loop in loops]
        if r:
            bare_seconds += bare
            seconds = [s + t for s, (_, t) in zip(seconds, timed, strict=True)]
            steps += timed[0][0]
    return steps / bare_seconds, [steps / s for s in seconds]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", default="PushCube-v1")
    parser.add_argument("--envs", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--config", default="configs/maniskill_pushcube_flow_noise.yaml")
    parser.add_argument("--camera", type=int, default=None, metavar="S", help="time S² camera envs instead")
    args = parser.parse_args()
    set_threads(1)
    base = [f"env.task={args.task}", "env.backend=cpu", "bc.demos=null"]
    shipped = load_config(args.config, base)
    if args.camera is not None:
        camera_rows(args, shipped)
        return
    size = shipped.env.num_envs * chunks_per_env(shipped)
    print(
        f"{args.config}: {shipped.env.num_envs} envs, {shipped.ppo.epochs} epochs of "
        f"{shipped.ppo.minibatches} mini-batches of about {size / shipped.ppo.minibatches:.0f} chunks"
    )
    ratios = []
    for n in args.envs:
        counts = list(dict.fromkeys([minibatches_at_size(shipped, n), shipped.ppo.minibatches]))
        env = make_vec_env(
            args.task,
            n,
            backend="cpu",
            obs_mode=shipped.env.obs_mode,
            control_mode=shipped.env.control_mode,
            reward_mode=shipped.env.reward_mode,
            max_episode_steps=shipped.env.max_episode_steps,
            ignore_terminations=shipped.env.ignore_terminations,
        )
        try:
            loops = [
                TrainingLoop(env, load_config(args.config, [*base, f"env.num_envs={n}", f"ppo.minibatches={m}"]))
                for m in counts
            ]
            bare, trained = bench(env, loops, args.rounds)
        finally:
            env.close()
        ratios.append([t / bare for t in trained])
        loops_text = ", ".join(f"{t:.0f} (ppo.minibatches={m})" for t, m in zip(trained, counts, strict=True))
        print(f"N={n}: random actions {bare:.0f} env steps/s, training loop {loops_text}")
    pairs = ", ".join(
        f"N={n} {r[0]:.2f}" + (f" ({r[1]:.2f} at ppo.minibatches={shipped.ppo.minibatches})" if len(r) > 1 else "")
        for n, r in zip(args.envs, ratios, strict=True)
    )
    print(f"ratio (training loop / random stepping), the config's mini-batch size: {pairs}")


if __name__ == "__main__":
    main()
