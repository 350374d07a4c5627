"""The flow-policy PPO recipe's config: the update (``ppo:``), the loop (``trainer:``),
the behaviour-cloning warm start (``bc:``) and the root config."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from omni_rl.config import FieldError, ModeDefaults, require, require_unset
from omni_rl.engine.config import Schedule, TrainerConfig
from omni_rl.models.flow_policy_config import FlowPolicyConfig
from omni_rl.recipes.logging_config import LoggingConfig
from omni_rl.runtime import RunConfig
from omni_rl.sim.config import SimEnvConfig


@dataclass
class PPOConfig(ModeDefaults):
    """PPO over action chunks (or the critic-free GRPO variant). Defaults follow RLinf's
    state-based ManiSkill settings (clip 0.2/0.2, grad clip 0.5, 8 epochs) except where
    measurement on PushCube said otherwise (docs/results/flow-ppo.md has the runs):
    gamma 0.95 per env step, not 0.8 (0.8 sees about 5 steps ahead, and a push takes 20
    to 40; the quickstart's mean gain over 3 seeds rose from +0.04 to +0.14), and
    lambda 1, not 0.9 (a critic fitted on a CPU's small batches explained 0.2 to 0.7 of
    the returns' variance, and bootstrapping on it made PPO unlearn its cloned start).

    Fields that count in some modes only (the critic's, which critic-free training never
    reads; a schedule's end, which a constant rate never reaches) are unset by default,
    meaning the default given, and refused in the modes that never read them."""

    UNSET: ClassVar[dict[str, Any]] = {
        "gamma": 0.95,
        "lam": 1.0,
        "reward_scale": 1.0,
        "value_clip_scale": "returns",
        "huber_delta": 10.0,
        "value_coef": 0.5,
        "entropy_coef": 0.005,
        "critic_lr": 1e-3,
        "min_lr_ratio": 0.0,
        "critic_max_grad_norm": 0.5,
        "group_size": 4,
        "normalize_advantages": True,
    }

    gamma: float | None = None
    """Discount per env step (a chunk of n steps discounts the next state's value by
    gamma^n); unset: 0.95. With a critic only (critic-free returns are undiscounted)."""
    lam: float | None = None
    """GAE lambda per env step (lambda^n per chunk); 1 (unset): the discounted return
    minus the value. With a critic only."""
    reward_scale: float | None = None
    """Multiplies every env reward before advantages and value targets; unset: 1. With a
    critic only (critic-free advantages are normalized within each group)."""
    clip_low: float = 0.2
    """Lower ratio clip (1 - clip_low)."""
    clip_high: float = 0.2
    """Upper ratio clip (1 + clip_high)."""
    ratio: Literal["chunk", "element"] = "chunk"
    """One ratio per chunk, or one per action element."""
    value_clip: float | None = None
    """Keep the new value within this of the old one in the loss (None: off)."""
    value_clip_scale: Literal["returns", "absolute"] | None = None
    """value_clip in units of the std of the iteration's value targets (unset), or
    absolute. With value_clip only."""
    huber_delta: float | None = None
    """Huber loss threshold of the value loss; unset: 10."""
    value_coef: float | None = None
    """Weight of the value loss; unset: 0.5."""
    entropy_coef: float | None = None
    """Weight of the entropy bonus on Flow-Noise's learned std; unset: 0.005. Refused
    under Flow-SDE, whose std is fixed (the bonus has no gradient there)."""
    normalize_advantages: bool | None = None
    """Zero-mean, unit-std advantages per mini-batch; unset: true. With a critic only:
    critic-free advantages are normalised within their groups already, and re-centring
    them over a mini-batch would give a group of equal returns a non-zero advantage."""
    actor_lr: float = 3e-4
    """Learning rate of the encoder, velocity and noise networks."""
    critic_lr: float | None = None
    """Learning rate of the value head; unset: 1e-3."""
    lr_schedule: Schedule = "constant"
    """Both rates over the run: constant, or linear or cosine decay to ``min_lr_ratio``
    of their peak at the last iteration's last optimizer step."""
    min_lr_ratio: float | None = None
    """Where a linear or cosine schedule ends, as a fraction of each peak rate; unset: 0."""
    actor_max_grad_norm: float = 0.5
    """Gradient-norm clip of the actor's parameters (0: off)."""
    critic_max_grad_norm: float | None = None
    """Gradient-norm clip of the value head's parameters, apart from the actor's (0: off);
    unset: 0.5."""
    critic_warmup: int = 0
    """Iterations at the start of RL that train the critic alone (the actor is not updated)."""
    epochs: int = 8
    """Passes over each rollout batch."""
    minibatches: int = 1
    """Mini-batches per pass (1: one step per epoch on the whole batch)."""
    target_kl: float | None = None
    """Stop an iteration's passes after the first whose mean approximate KL
    (``loss/approx_kl`` over every process's mini-batches) exceeds this; the steps not
    taken still move the learning-rate schedule. None: every pass runs."""
    bc_coef: float = 0.0
    """Weight of behaviour cloning's loss beside PPO's at every actor step, on a global
    batch of ``bc.batch_size`` demonstration chunks (``bc.demos``, its first
    ``bc.episodes``): an anchor that holds the policy near the demonstrated actions
    while RL moves it. 0: off."""
    critic_free: bool = False
    """GRPO variant: groups of episodes from one initial state, advantage = normalized
    return; the value head is neither read nor trained, so the critic's fields are refused."""
    group_size: int | None = None
    """Critic-free: episodes per initial state (num_envs must be a multiple); unset: 4."""

    def __post_init__(self):
        if self.critic_free:
            critic = ("gamma", "lam", "reward_scale", "value_clip", "value_clip_scale", "huber_delta", "value_coef")
            critic += ("critic_lr", "critic_max_grad_norm")
            require_unset({n: getattr(self, n) for n in critic}, "critic_free: true (no critic)")
            require(not self.critic_warmup, "critic_warmup", "critic-free training has no critic to warm up")
            require_unset(
                {"normalize_advantages": self.normalize_advantages},
                "critic_free: true (the group advantages are normalised already; a mini-batch's mean would give "
                "a group of equal returns a non-zero advantage)",
            )
        else:
            require_unset({"group_size": self.group_size}, "critic_free: false (one episode per initial state)")
        if self.value_clip is None:
            require_unset({"value_clip_scale": self.value_clip_scale}, "value_clip: null (no value clip)")
        if self.lr_schedule == "constant":
            require_unset({"min_lr_ratio": self.min_lr_ratio}, "lr_schedule: constant")
        require(0 < self.setting("gamma") <= 1, "gamma", "must be in (0, 1]")
        require(0 <= self.setting("lam") <= 1, "lam", "must be in [0, 1]")
        require(self.setting("reward_scale") > 0, "reward_scale", "must be > 0")
        require(self.value_clip is None or self.value_clip > 0, "value_clip", "must be > 0 (or null: off)")
        require(self.critic_warmup >= 0, "critic_warmup", "must be >= 0")
        require(0 <= self.setting("min_lr_ratio") <= 1, "min_lr_ratio", "must be in [0, 1]")
        require(
            self.actor_max_grad_norm >= 0 and self.setting("critic_max_grad_norm") >= 0,
            "actor_max_grad_norm",
            "gradient clips must be >= 0",
        )
        require(self.epochs >= 1 and self.minibatches >= 1, "epochs", "epochs and minibatches must be >= 1")
        require(self.target_kl is None or self.target_kl > 0, "target_kl", "must be > 0 (or null: off)")
        require(self.bc_coef >= 0, "bc_coef", "must be >= 0 (0: off)")
        require(self.setting("group_size") >= 2, "group_size", "must be >= 2")


def check_policy_and_ppo(policy: FlowPolicyConfig, ppo: PPOConfig) -> None:
    """Refuse the fields of one section that do nothing under the other's mode (for
    every root config holding both: flow_ppo's and the simulation quickstart's)."""
    try:
        if ppo.ratio == "element":
            require_unset({"logprob": policy.logprob}, "ppo.ratio: element (a ratio per element, none per chunk)")
        if ppo.critic_free:
            require_unset({"value_input": policy.value_input}, "ppo.critic_free: true (no critic)")
    except FieldError as err:
        raise FieldError(f"policy.{err.field_name}", str(err)) from None
    if policy.method == "flow_sde":
        mode = "policy.method: flow_sde (its std is fixed, so the entropy bonus has no gradient)"
        require_unset({"ppo.entropy_coef": ppo.entropy_coef}, mode)


# TrainerConfig's fields flow PPO never reads, each with what does their job here
NOT_FOR_FLOW = {
    "max_grad_norm": "ppo.actor_max_grad_norm and ppo.critic_max_grad_norm clip the actor and the critic apart",
    "warmup_steps": "the PPO rates have no warm-up (ppo.critic_warmup trains the critic alone first)",
    "schedule": "ppo.lr_schedule sets both PPO rates' schedule",
    "min_lr_ratio": "ppo.min_lr_ratio is where the PPO schedule ends",
    "best_metric": "flow_ppo keeps no best model (OUTPUT_DIR/model is the last one)",
    "micro_batch_size": "each PPO mini-batch runs in one forward (ppo.minibatches sets their size)",
    "max_tokens_per_microbatch": "a flow policy has no tokens",
}


@dataclass
class FlowTrainerConfig(TrainerConfig):
    """The outer loop of flow-policy RL: the engine's ``trainer:`` section, where a step
    is one rollout-and-update iteration (one episode's worth of env steps in every env,
    then ``ppo.epochs`` x ``ppo.minibatches`` optimizer steps), plus the held-out
    evaluation. ``eval_every`` counts steps and evaluates on held-out seeds;
    ``strategy: auto`` is ddp with several processes (sharding a 2-layer MLP gains
    nothing). The fields of ``NOT_FOR_FLOW`` are refused unless left at their default."""

    eval_episodes: int = 200
    """Held-out episodes per evaluation (200 give a 95% interval of about +-6 points at 0.5)."""
    eval_seed: int = 1_000_000
    """First held-out seed: training seeds lie below it, held-out ones from it up, and
    demonstrations (checked when they load) in neither range."""

    def __post_init__(self):
        super().__post_init__()
        defaults = TrainerConfig()
        for name, why in NOT_FOR_FLOW.items():
            require(getattr(self, name) == getattr(defaults, name), name, f"does nothing in flow_ppo: {why}")
        require(self.eval_episodes >= 1, "eval_episodes", "must be >= 1")


def flow_trainer(**fields) -> FlowTrainerConfig:
    """A flow ``trainer:`` section with flow's defaults: 100 steps, an evaluation every
    10, fp32 (a small MLP gains nothing from bf16; under bf16-mixed rollouts sample in
    the update's precision, so each update's first ratio is exactly 1)."""
    return FlowTrainerConfig(**{"steps": 100, "eval_every": 10, "precision": "fp32", **fields})


@dataclass
class BCConfig:
    """Behaviour cloning from demonstrations before RL (the warm start)."""

    demos: str | None = None
    """Demonstrations file (omni-rl sim collect-demos); unset: no warm start."""
    episodes: int | None = None
    """Use only the first this many demo episodes (few-shot SFT); unset: all."""
    steps: int = 1000
    """Optimizer steps of cloning, all of them before RL whatever ``trainer.steps`` says
    (that counts the PPO steps after cloning)."""
    lr: float = 1e-3
    """Learning rate."""
    batch_size: int = 256
    """Chunks per step."""


@dataclass
class FlowPPOConfig:
    """``omni-rl train``: behaviour cloning, then Flow-Noise / Flow-SDE PPO in simulation."""

    run: RunConfig = field(default_factory=lambda: RunConfig(name="flow_ppo", output_dir="runs/flow_ppo"))
    """Output directory, seed and hardware."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Metrics backends: jsonl, tensorboard, wandb."""
    env: SimEnvConfig = field(default_factory=SimEnvConfig)
    """The environments."""
    policy: FlowPolicyConfig = field(default_factory=FlowPolicyConfig)
    """The policy."""
    ppo: PPOConfig = field(default_factory=PPOConfig)
    """The update."""
    trainer: FlowTrainerConfig = field(default_factory=flow_trainer)
    """The loop."""
    bc: BCConfig = field(default_factory=BCConfig)
    """The warm start."""

    def __post_init__(self):
        check_policy_and_ppo(self.policy, self.ppo)
        if self.ppo.bc_coef and not self.bc.demos:
            raise FieldError("ppo.bc_coef", "needs bc.demos, the demonstrations it holds the policy near")
        if self.ppo.critic_free and self.env.num_envs % self.ppo.setting("group_size"):
            raise FieldError("env.num_envs", "must be a multiple of ppo.group_size with ppo.critic_free")
        if self.policy.vla and not self.policy.path:
            kind = self.policy.type
            why = f"name the {kind} checkpoint (omni-rl tiny-model --family {kind} writes a tiny one)"
            raise FieldError("policy.path", why)
