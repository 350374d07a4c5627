"""The VLA quickstart: a tiny pi_0 (``--set policy.type=pi05``: pi_0.5) learns, from a
camera image and an instruction, to reach the named one of two targets
(PixelTargets-v0) on a CPU.

For each training seed it writes a tiny random one seeded by it (unless
``policy.path`` names a checkpoint), collects scripted demonstrations, clones them
(VLM included, ``policy.train_vlm: bc``) to a partial start, runs Flow-Noise PPO on the
action expert and heads, and measures held-out success after each; then it shows the
trained policy the other target's name on the same held-out episodes
(``success_rl_swapped``: a policy that follows the instruction goes to the wrong target
and fails). ``env.blank_images=true`` is the no-vision control: the whole run (demos
included) sees blank images. The summary is the simulation quickstart's
(``omni_rl.demos.quickstart_sim``) plus ``success_rl_swapped`` per seed.
"""

from __future__ import annotations

from pathlib import Path

from omni_rl.algorithms.stats import binomial_interval
from omni_rl.demos import quickstart_sim
from omni_rl.demos.quickstart_vla_config import QuickstartVLAConfig
from omni_rl.models.flow_policy import FlowPolicy, backbone_class
from omni_rl.recipes.flow_ppo import interval_summary
from omni_rl.sim import make_vec_env
from omni_rl.sim.episodes import EnvShare, evaluate_success


def main(cfg: QuickstartVLAConfig) -> dict:
    """Run the VLA quickstart; returns (and writes) its summary."""
    return quickstart_sim.run_seeds(cfg, run_seed)


def run_seed(cfg: QuickstartVLAConfig, seed: int, out: Path) -> dict:
    """The simulation quickstart's seed with a pi_0 policy, then the swapped-instruction
    evaluation of the trained policy."""
    kind = cfg.policy.type
    tiny = backbone_class(kind, "policy.type").build_tiny
    path = cfg.policy.path or tiny(out / f"{kind}_tiny", seed=seed, width=cfg.tiny_width())
    result = quickstart_sim.run_seed(cfg, seed, out, policy={"path": str(path)})
    policy = FlowPolicy.from_pretrained(out / "flow_ppo" / "model").eval()
    swapped = heldout_success(policy, cfg, swap_instructions=True)
    result.update(interval_summary("success_rl_swapped", swapped))
    print(
        f"seed {seed}: shown the other target's name, the trained policy reaches the named one in "
        f"{swapped['success']:.3f} of the held-out episodes"
    )
    return result


def heldout_success(policy: FlowPolicy, cfg: QuickstartVLAConfig, **controls) -> dict:
    """``policy``'s held-out success (and its 95% interval) on the training run's
    evaluation episodes, in envs with ``controls`` beside the config's own."""
    e, t = cfg.env, cfg.trainer
    options = {**e.options(), **controls}
    env = make_vec_env(e.task, e.num_envs, backend=e.backend, max_episode_steps=e.max_episode_steps, **options)
    try:
        totals = evaluate_success(
            policy, env, EnvShare.whole(e.num_envs), t.eval_episodes, t.eval_seed, e.max_episode_steps, env.device
        )
    finally:
        env.close()
    low, high = binomial_interval(totals[0], t.eval_episodes)
    return {"success": totals[0] / t.eval_episodes, "success_low": low, "success_high": high}
