"""How much of each denoising step's noise reaches the action, on the quickstart's
behaviour-cloned PushCube policy.

    python tools/noise_reach.py [--method flow_sde|flow_noise] [--seed 0] [--set KEY=VALUE ...]

It collects the quickstart's demonstrations for ``--seed``, clones them exactly as
``omni-rl quickstart --sim`` does (same config, same random stream), then, for each
denoising step k, samples 64 chunks per demonstrated state with noise at step k alone
(the other steps follow the ODE, every sample from the same start) and prints the
action's std across them, averaged over states and action elements. A flow cloned from
a deterministic expert contracts, so early noise is erased: the printed ratio, last
step over first, says how much more the last step explores.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from omni_rl.demos.quickstart_sim import demo_seed, train_config
from omni_rl.engine.distributed import Ranks
from omni_rl.recipe_loader import load_config
from omni_rl.recipes import flow_ppo
from omni_rl.recipes.common import MetricsLog, Run
from omni_rl.runtime import set_threads
from omni_rl.sim.experts import collect_demos, demo_chunks

SAMPLES = 64


@torch.no_grad()
def step_noise_reach(policy, obs: torch.Tensor, generator: torch.Generator) -> list[float]:
    """[K] the action std with noise at step k alone, over ``SAMPLES`` draws per state."""
    o = obs.repeat_interleave(SAMPLES, dim=0)
    features = policy.backbone.encode(o)
    start = policy.start_noise(obs.shape[0], generator).repeat_interleave(SAMPLES, dim=0)
    stds = []
    for k in range(policy.steps):
        x = start
        for j in range(policy.steps):
            t = torch.full((o.shape[0],), 1.0 - j * policy.delta)
            v, mean, std = policy._transition(x, t, features)
            x = mean + std * torch.randn(x.shape, generator=generator) if j == k else x - policy.delta * v
        stds.append(x.view(obs.shape[0], SAMPLES, -1).std(dim=1).mean().item())
    return stds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--method", default="flow_sde", choices=("flow_sde", "flow_noise"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="quickstart_sim overrides")
    args = parser.parse_args()
    set_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        overrides = [f"run.output_dir={tmp}", f"policy.method={args.method}", *args.set]
        cfg = load_config(None, overrides, recipe="quickstart_sim")
        demos = Path(tmp) / "demos.safetensors"
        collect_demos(cfg.env.task, cfg.demo_episodes, demos, seed=demo_seed(args.seed), backend="cpu")
        train_cfg = train_config(cfg, args.seed, Path(tmp) / "run", demos)
        obs, _, _ = demo_chunks(demos, cfg.policy.horizon, cfg.bc.episodes)
        stream = flow_ppo.shared_stream(train_cfg)
        policy = flow_ppo.build_policy(train_cfg, obs.shape[1], 4, stream)
        run = Run(Path(tmp), Ranks(), torch.device("cpu"), None)
        engine = flow_ppo.make_engine(policy, train_cfg, run)
        on_device = flow_ppo.load_demos(train_cfg, policy.horizon, run.device)
        log = MetricsLog(Path(tmp) / "bc", None, enabled=False)
        flow_ppo.behaviour_clone(engine, on_device, train_cfg, run, stream, log)
    stds = step_noise_reach(policy, obs, torch.Generator().manual_seed(args.seed))
    steps = ", ".join(f"{s:.3f}" for s in stds)
    print(f"{args.method} (seed {args.seed}): action std with noise at step 0..{len(stds) - 1} alone: {steps}")
    print(f"ratio (last step / first step): {stds[-1] / stds[0]:.1f}")


if __name__ == "__main__":
    main()
