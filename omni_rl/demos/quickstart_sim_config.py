"""The simulation quickstart's config (``omni-rl quickstart --sim``): flow_ppo's
sections with CPU-sized defaults, plus the demonstrations it collects."""

from __future__ import annotations

from dataclasses import dataclass, field

from omni_rl.config import require
from omni_rl.models.flow_policy_config import FlowPolicyConfig
from omni_rl.recipes.flow_ppo_config import BCConfig, FlowTrainerConfig, PPOConfig, check_policy_and_ppo, flow_trainer
from omni_rl.runtime import RunConfig
from omni_rl.sim.config import SimEnvConfig


@dataclass
class QuickstartSimConfig:
    """``omni-rl quickstart --sim``: scripted demos, behaviour cloning to a partial start,
    Flow-Noise PPO on CPU ManiSkill envs, held-out success before and after."""

    run: RunConfig = field(
        default_factory=lambda: RunConfig(
            name="quickstart_sim", output_dir="runs/quickstart_sim", threads=2, cpu_kernels="avx2"
        )
    )
    """Output directory, seed and hardware."""
    seeds: int = 3
    """Training seeds, run one after another: run.seed, run.seed + 1, ..."""
    demo_episodes: int = 10
    """Expert episodes collected for the warm start (from seeds the evaluation never uses;
    10 clone to about half the held-out episodes solved)."""
    demo_action_scale: float = 1.0
    """The scripted expert's actions times this (below 1: a demonstrator slower than the
    task allows, whose clone RL can beat)."""
    env: SimEnvConfig = field(default_factory=lambda: SimEnvConfig(task="PushCube-v1", num_envs=16, backend="cpu"))
    """The environments: 16 episodes an iteration (208 chunks), 250 iterations
    (``trainer.steps``), 208,000 env steps. Batches twice the size of 8 envs' climbed on
    3 seeds of the Flow-SDE hybrid where 8 envs peaked early and fell; 150 iterations
    left 3 of 6 runs on a second machine under a gain of 0.15, and 250 lifted all six
    (docs/results/flow-ppo.md)."""
    policy: FlowPolicyConfig = field(default_factory=FlowPolicyConfig)
    """The policy."""
    ppo: PPOConfig = field(
        default_factory=lambda: PPOConfig(
            actor_lr=5e-5,
            lr_schedule="cosine",
            min_lr_ratio=0.1,
            ratio="element",
            minibatches=4,
            critic_warmup=20,
        )
    )
    """The update: a ratio per action element, 4 mini-batches per epoch, a small actor
    rate that keeps the cloned policy from drifting and decays (cosine, to a tenth) so
    the late steps refine rather than wander, and 20 steps that fit the critic
    before the actor moves."""
    trainer: FlowTrainerConfig = field(default_factory=lambda: flow_trainer(steps=250, eval_every=25))
    """The loop: 250 iterations, held-out success on ``eval_episodes`` seeds every 25."""
    bc: BCConfig = field(default_factory=lambda: BCConfig(steps=500))
    """Behaviour cloning (its ``demos`` is the collected file)."""

    def __post_init__(self):
        require(self.bc.demos is None, "bc.demos", "the quickstart clones the demonstrations it collects")
        require(self.demo_episodes >= 1, "demo_episodes", "must be >= 1")
        require(0 < self.demo_action_scale <= 1, "demo_action_scale", "must be in (0, 1]")
        require(self.seeds >= 1, "seeds", "must be >= 1")
        check_policy_and_ppo(self.policy, self.ppo)
