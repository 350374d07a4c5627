"""The VLA quickstart's config (``omni-rl quickstart --vla``): the simulation
quickstart's sections with a tiny pi_0 on PixelTargets-v0."""

from __future__ import annotations

from dataclasses import dataclass, field

from omni_rl.config import require
from omni_rl.demos.quickstart_sim_config import QuickstartSimConfig
from omni_rl.models.flow_policy_config import FlowPolicyConfig
from omni_rl.recipes.flow_ppo_config import BCConfig, FlowTrainerConfig, PPOConfig, flow_trainer
from omni_rl.runtime import RunConfig
from omni_rl.sim.config import SimEnvConfig

CLONING_STEPS = {"pi0": 1500, "pi05": 3000}
"""Behaviour cloning's steps per policy type when ``bc.steps`` is unset: each past where
that type's clone starts to follow the instruction (docs/getting-started/quickstart-vla.md).
pi_0.5 reads the point's position as digits in its prompt and needs the longer one: at
1,500 steps one seed of three cloned to a policy that ignores the instruction."""


@dataclass
class QuickstartBCConfig(BCConfig):
    """Behaviour cloning, its length chosen per policy type unless set."""

    steps: int | None = None
    """Optimizer steps of cloning; unset: the policy type's (``CLONING_STEPS``: 1,500
    for pi_0, 3,000 for pi_0.5)."""


@dataclass
class QuickstartVLAConfig(QuickstartSimConfig):
    """``omni-rl quickstart --vla``: scripted demos with images and instructions, behaviour
    cloning of a tiny pi_0 to a partial start (its VLM fine-tuned too), Flow-Noise PPO
    of the action expert and heads, held-out success before and after, and the trained
    policy shown the other target's name (``success_rl_swapped``)."""

    run: RunConfig = field(
        default_factory=lambda: RunConfig(name="quickstart_vla", output_dir="runs/quickstart_vla", threads=2)
    )
    """Output directory, seed and hardware."""
    demo_episodes: int = 2048
    """Expert episodes collected for the warm start (under a minute; behaviour cloning's
    ``bc.steps`` sets how far the start gets)."""
    demo_action_scale: float = 0.25
    """The expert moves at a quarter of the speed the task allows: its clone reaches the
    named target too slowly for the time limit about half the time, and RL, which
    sees the limit, learns to go faster."""
    model_width: int | None = None
    """Hidden width of the tiny pi_0 written per seed when ``policy.path`` is unset (a
    multiple of 32; unset: 64); refused beside a ``policy.path``."""
    env: SimEnvConfig = field(
        default_factory=lambda: SimEnvConfig(
            task="PixelTargets-v0", num_envs=16, backend="cpu", max_episode_steps=30, ignore_terminations=False
        )
    )
    """The environments (``env.blank_images=true``: the no-vision control)."""
    policy: FlowPolicyConfig = field(
        default_factory=lambda: FlowPolicyConfig(type="pi0", horizon=8, executed=5, width=64, value_input="obs")
    )
    """The policy: pi_0 (``type: pi05``: pi_0.5; unset ``path``: a tiny random one per
    seed, seeded by it), its critic on the env's privileged state (point and goal),
    which the actor never sees."""
    ppo: PPOConfig = field(
        default_factory=lambda: PPOConfig(actor_lr=1e-4, critic_lr=1e-3, critic_warmup=5, epochs=2, minibatches=4)
    )
    """The update."""
    trainer: FlowTrainerConfig = field(default_factory=lambda: flow_trainer(steps=100, eval_every=20))
    """The loop (held-out success on ``eval_episodes`` seeds)."""
    bc: QuickstartBCConfig = field(default_factory=QuickstartBCConfig)
    """Behaviour cloning (its ``demos`` is the collected file), for the policy type's
    ``CLONING_STEPS`` unless ``bc.steps`` is set."""

    def __post_init__(self):
        super().__post_init__()
        require(self.policy.vla, "policy.type", "the VLA quickstart trains a VLA policy: pi0 or pi05")
        if self.bc.steps is None:
            self.bc.steps = CLONING_STEPS[self.policy.type]
        require(self.env.task == "PixelTargets-v0", "env.task", "the VLA quickstart runs PixelTargets-v0")
        if self.policy.path is not None:
            require(self.model_width is None, "model_width", "sizes the tiny pi_0 written when policy.path is unset")
        width = self.tiny_width()
        require(width >= 32 and width % 32 == 0, "model_width", "must be a multiple of 32")

    def tiny_width(self) -> int:
        """The tiny pi_0's width: ``model_width``, unset: 64."""
        return 64 if self.model_width is None else self.model_width
