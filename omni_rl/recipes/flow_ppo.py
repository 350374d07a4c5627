"""Flow-policy RL in simulation, read top to bottom: behaviour cloning from a few
demonstrations, then PPO with Flow-Noise or Flow-SDE likelihoods (after pi_RL), in N
parallel environments, on the run lifecycle GRPO and SFT share (``recipes.common``:
resume, save cadence, ``summary.json``, ``OUTPUT_DIR/model``).

Each step (one PPO iteration) resets every env from a fresh seed and runs one
episode's worth of action chunks (the policy is queried every ``executed`` env steps),
then updates the policy on them:

    ROLLOUT   sample a chunk per env (K denoising steps, some stochastic), run its
              executed actions, sum their rewards; keep the denoising chain
    ADVANTAGE GAE over chunks with the critic (per-step gamma and lambda folded into
              chunks, bootstrapping truncated episodes), or, critic-free, each
              episode's return normalized within its group of episodes that started
              from the same state (GRPO's group advantage)
    UPDATE    epochs of mini-batches: clipped ratio per chunk or per element (GRPO's
              clipped surrogate), Huber value loss (clipped relative to the return
              scale, or not), entropy bonus, separate actor/critic rates and gradient
              clips; the first ``ppo.critic_warmup`` steps train the critic alone
    EVALUATE  success rate on held-out seeds with the deterministic (ODE) sampler,
              its start noise from a generator of its own; a 95% interval
    LOG, CHECKPOINT

Under torchrun each process steps its share of the envs (``omni_rl.sim.episodes``).
Everything random (initial weights, BC batches, sampling noise, mini-batch order) comes
from one stream seeded by the run seed, drawn alike on every process for the whole run
and sliced; mini-batches are global and losses divide by global counts: N processes
train what one process trains.
"""

from __future__ import annotations

import math
import time
from contextlib import closing
from dataclasses import dataclass

import torch
from tqdm import tqdm

from omni_rl.algorithms.advantages import grpo_advantages
from omni_rl.algorithms.flow import reduce_logprob
from omni_rl.algorithms.losses import clipped_policy_loss
from omni_rl.algorithms.ppo import chunk_discounting, explained_variance, gae, value_loss
from omni_rl.algorithms.stats import binomial_interval
from omni_rl.engine import distributed
from omni_rl.engine.config import AdamWConfig
from omni_rl.engine.engine import TrainingEngine, lr_factor
from omni_rl.errors import OmniRLError
from omni_rl.models.flow_policy import FlowPolicy, StateBackbone, VelocityBackbone, backbone_class
from omni_rl.observations import FlatLayout
from omni_rl.recipes.common import (
    MetricsLog,
    Run,
    Timer,
    finish_run,
    last_row,
    per_rank,
    resume_steps,
    save_if_due,
    say,
    start_run,
)
from omni_rl.recipes.flow_ppo_config import FlowPPOConfig
from omni_rl.sim import make_vec_env
from omni_rl.sim.episodes import (
    ChunkBuffer,
    EnvShare,
    EpisodeTotals,
    collect,
    episode_metrics,
    episode_seeds,
    evaluate_success,
)
from omni_rl.sim.experts import check_demo_seeds, demo_chunks

# the keys of a step's metrics row besides ``env/`` (training episodes, ``episode_metrics``),
# ``eval/`` (held-out episodes, ``evaluate_policy``), ``time/`` (``Timer``) and the
# engine's ``optim/`` counters (``TrainingEngine.metrics``); sums over a mini-batch's
# chunks are divided by its global count, then averaged over the step's mini-batches.
# Behaviour cloning logs ``bc/loss`` (running mean) and ``bc/chunks`` to ``bc/metrics.jsonl``.
METRICS = {
    "loss/policy": "the clipped surrogate (per chunk or per action element, ``ppo.ratio``)",
    "loss/value": "the Huber value loss (with a critic)",
    "loss/clip_fraction": "fraction of ratios whose clipped term was the active one (``clipped_policy_loss``)",
    "loss/ratio_mean": "mean importance ratio pi / pi_old",
    "loss/ratio_max": "largest importance ratio over every process's chunks",
    "loss/approx_kl": "mean (r - 1) - log r, an estimate of KL(pi_old || pi)",
    "loss/bc": "the cloning loss on the demonstrations beside PPO's (``ppo.bc_coef``), mean over the step's updates",
    "actor/entropy": "mean entropy of the stochastic denoising steps' Gaussians (executed actions)",
    "optim/grad_norm": "gradient norm before clipping, over actor and critic",
    "optim/actor_grad_norm": "the actor's gradient norm before its clip (``ppo.actor_max_grad_norm``)",
    "optim/critic_grad_norm": "the critic's gradient norm before its clip (``ppo.critic_max_grad_norm``)",
    "update/epochs": "passes over the rollout this step (``ppo.epochs``, fewer where ``ppo.target_kl`` stopped it)",
    "update/actor_updated": "1 once the critic's warm-up is over (``ppo.critic_warmup``), else 0",
    "update/value_clip": "the value loss's clip this step (``ppo.value_clip``, scaled by the targets' std)",
    "update/explained_variance": "1 - Var(target - value) / Var(target) of the rollout's values",
    "policy/noise_std": "the Gaussian std whose entropy is ``actor/entropy``",
    "policy/noise_level": "Flow-SDE's a this step (``policy.noise_level``, annealed to ``noise_level_end``)",
    "env_steps": "env steps of the run so far, over every process",
    "throughput/env_steps_per_s": "env steps of the step per second of it",
    "throughput/rollout_env_steps_per_s": "env steps of the step per second of its rollout",
}
"""One line per metric a flow_ppo step logs (the docs cite this dict)."""

# ------------------------------------------------------------------------------ SETUP


def env_share(cfg: FlowPPOConfig, run: Run) -> EnvShare:
    """This process's envs; critic-free groups stay within one process."""
    count, group = per_rank(cfg.env.num_envs, run.ranks, "env.num_envs"), cfg.ppo.setting("group_size")
    if cfg.ppo.critic_free and count % group:
        raise OmniRLError(
            f"env.num_envs={cfg.env.num_envs} over {run.ranks.world_size} processes gives {count} envs each, "
            f"not a multiple of ppo.group_size={group} (a group must not straddle processes)"
        )
    return EnvShare(run.ranks.rank * count, count, cfg.env.num_envs)


def make_env(cfg: FlowPPOConfig, envs: EnvShare):
    """This process's vectorized envs (``envs.count`` of them)."""
    e = cfg.env
    return make_vec_env(
        e.task,
        envs.count,
        backend=e.backend,
        seed=cfg.run.seed + envs.start,
        max_episode_steps=e.max_episode_steps,
        ignore_terminations=e.ignore_terminations,
        **e.options(),
    )


def shared_stream(cfg: FlowPPOConfig) -> torch.Generator:
    """The run's randomness, in the same state on every process: each draws what the
    whole run needs and keeps its part."""
    return torch.Generator().manual_seed(cfg.run.seed)


class Progress:
    """What a resumed run needs back beside the engine's state: the shared stream's
    position and the results so far (held-out success after BC, env steps). Restored by
    ``resume_steps`` from the checkpoint state's ``sampler`` entry, where GRPO and SFT
    keep their data position."""

    def __init__(self, stream: torch.Generator):
        self.stream = stream
        self.results: dict = {"env_steps": 0}

    def state_dict(self) -> dict:
        return {"stream": self.stream.get_state().tolist(), "results": self.results}

    def load_state_dict(self, state: dict) -> None:
        self.stream.set_state(torch.tensor(state["stream"], dtype=torch.uint8))
        self.results = state["results"]


def build_policy(cfg: FlowPPOConfig, obs_dim: int, action_dim: int, stream: torch.Generator, env=None) -> FlowPolicy:
    """The policy, its initial weights drawn from ``stream``; a pi0 policy reads its
    observations' layout from ``env``, and an MLP policy is refused on an env that has
    one (an image, an instruction and privileged state, which the MLP would read)."""
    if not cfg.policy.vla and isinstance(getattr(env, "layout", None), FlatLayout):
        raise OmniRLError(
            f"policy.type mlp reads the whole observation, and {cfg.env.task}'s holds a camera image beside the "
            "privileged state only the critic may see: use policy.type pi0 or pi05 (they read the image and "
            "the instruction), or a task that observes state vectors"
        )
    with torch.random.fork_rng(devices=[]):
        torch.set_rng_state(stream.get_state())
        vla = cfg.policy.vla
        backbone = vla_backbone(cfg, env) if vla else StateBackbone(cfg.policy, obs_dim, action_dim)
        policy = FlowPolicy(cfg.policy, backbone)
        stream.set_state(torch.get_rng_state())
    return policy


def vla_backbone(cfg: FlowPPOConfig, env) -> VelocityBackbone:
    """A pi_0 or pi_0.5 backbone (``policy.type``) from ``policy.path`` for an env with
    a camera image and an instruction in its flat observations (``FlatLayout``); its VLM
    frozen until a phase that trains it (``vlm_trains``)."""
    from transformers import AutoProcessor

    layout = getattr(env, "layout", None)
    if not isinstance(layout, FlatLayout):
        raise OmniRLError(
            f"policy.type {cfg.policy.type} reads a camera image and an instruction; {cfg.env.task} observes "
            "state vectors (PixelTargets-v0 has both)"
        )
    # the weights do not depend on the chunk's length: the checkpoint predicts policy.horizon actions
    processor = AutoProcessor.from_pretrained(cfg.policy.path)
    backbone = backbone_class(cfg.policy.type, "policy.type").from_pretrained(
        cfg.policy.path, processor, layout, env.action_dim, chunk_size=cfg.policy.horizon
    )
    if cfg.policy.vlm_lora is not None:
        backbone.add_vlm_lora(cfg.policy.vlm_lora)
    backbone.train_vlm(False)
    return backbone


def vlm_trains(cfg: FlowPPOConfig, phase: str) -> bool:
    """Whether a VLA policy's VLM trains in ``phase`` (bc or ppo): ``policy.train_vlm``."""
    when = cfg.policy.setting("train_vlm")
    return when == "always" or when == phase


def make_engine(policy: FlowPolicy, cfg: FlowPPOConfig, run: Run) -> TrainingEngine:
    """The engine, first with behaviour cloning's optimizer: Adam (AdamW without decay)
    over the actor, no clipping. ``strategy: auto`` is DDP with several processes."""
    t = cfg.trainer
    strategy = "ddp" if t.strategy == "auto" and run.ranks.distributed else t.strategy

    def actor(model: FlowPolicy) -> list[dict]:
        return [{"params": model.actor_parameters()}]

    return TrainingEngine(
        policy,
        AdamWConfig(lr=cfg.bc.lr),
        run.device,
        total_steps=max(cfg.bc.steps, 1),
        precision=t.precision,
        strategy=strategy,
        max_grad_norm=0.0,
        param_groups=actor,
        max_bad_steps=t.max_bad_steps,
    )


# ------------------------------------------------------------------------------ WARM START


@dataclass
class Demos:
    """Demonstration chunks on the device (``demo_chunks``): observations [N, obs],
    action chunks [N, H, D] and the mask of their real steps [N, H]."""

    obs: torch.Tensor
    actions: torch.Tensor
    mask: torch.Tensor


def load_demos(cfg: FlowPPOConfig, horizon: int, device: torch.device) -> Demos:
    """``bc.demos`` (its first ``bc.episodes``) cut into chunks of ``horizon``, on ``device``."""
    return Demos(*(x.to(device) for x in demo_chunks(cfg.bc.demos, horizon, cfg.bc.episodes)))


def cloning_loss(engine: TrainingEngine, demos: Demos, size: int, stream: torch.Generator) -> torch.Tensor:
    """The flow-matching loss of one global batch of ``size`` demo chunks (rows, times
    and noise drawn from ``stream`` alike on every process): this process's slice,
    divided by the global batch's count of real action elements. The noise covers the
    policy's whole chunk, a pi0 checkpoint's numbers past the env's too, as sampling's."""
    ranks, device = engine.ranks, engine.device
    mine = torch.tensor_split(torch.arange(size), ranks.world_size)[ranks.rank]
    batch = torch.randint(demos.obs.shape[0], (size,), generator=stream)
    t = torch.rand(size, generator=stream)
    eps = torch.randn((size, *engine.module.chunk_shape), generator=stream)
    count = float(demos.mask[batch].sum()) * demos.actions.shape[-1]
    rows = batch[mine].to(device)
    args = demos.obs[rows], demos.actions[rows], demos.mask[rows], t[mine].to(device), eps[mine].to(device)
    return engine.model(*args, count, bc=True)


def behaviour_clone(
    engine: TrainingEngine, demos: Demos, cfg: FlowPPOConfig, run: Run, stream: torch.Generator, log: MetricsLog
) -> float:
    """Fit the velocity field to the demonstrations for ``bc.steps`` optimizer steps
    (``trainer.steps`` counts the PPO steps after them); returns the last logged loss.
    Each step's loss averages over a global batch (``cloning_loss``)."""
    size = min(cfg.bc.batch_size, demos.obs.shape[0])
    say(
        run.ranks,
        f"behaviour cloning: {cfg.bc.steps} optimizer steps (bc.steps, whatever trainer.steps says: its "
        f"{cfg.trainer.steps} are the PPO steps after cloning) on {demos.obs.shape[0]} chunks of {cfg.bc.demos}",
    )
    running = 0.0
    for step in tqdm(range(1, cfg.bc.steps + 1), desc="bc", unit="step", disable=not run.ranks.is_main):
        loss = cloning_loss(engine, demos, size, stream)
        engine.backward(loss)
        engine.step()
        (total,) = distributed.all_sum([loss.item()])
        running = 0.9 * running + 0.1 * total if step > 1 else total
        if step % 50 == 0 or step == cfg.bc.steps:
            log.log({"step": step, "bc/loss": running, "bc/chunks": demos.obs.shape[0]})
    return running


def evaluate_policy(engine: TrainingEngine, env, envs: EnvShare, cfg: FlowPPOConfig) -> dict:
    """Held-out success (with its 95% interval), return and length: each process plays
    its share of the seeds with the full policy; the totals add up over processes."""
    t = cfg.trainer
    with engine.forward_context():
        totals = evaluate_success(
            engine.module, env, envs, t.eval_episodes, t.eval_seed, cfg.env.max_episode_steps, engine.device
        )
    success, ret, length, count = distributed.all_sum(totals)
    low, high = binomial_interval(success, t.eval_episodes)
    return {
        "success": success / t.eval_episodes,
        "success_low": low,
        "success_high": high,
        "return": ret / max(count, 1),
        "length": length / max(count, 1),
    }


def interval_summary(name: str, result: dict) -> dict:
    """``{name: success, name_ci95: [low, high]}`` of an :func:`evaluate_policy` result."""
    return {
        name: result["success"],
        f"{name}_ci95": [round(result["success_low"], 4), round(result["success_high"], 4)],
    }


# ------------------------------------------------------------------------------ PPO OPTIMIZER


def use_ppo_optimizer(engine: TrainingEngine, cfg: FlowPPOConfig) -> None:
    """PPO's optimizer: Adam with separate actor and critic rates, each part's gradient
    norm clipped on its own (the critic's large early gradients never shrink the actor's
    step)."""
    p = cfg.ppo

    def actor_and_critic(model: FlowPolicy) -> list[dict]:
        return [
            {"params": model.actor_parameters(), "lr": p.actor_lr, "max_grad_norm": p.actor_max_grad_norm},
            {
                "params": model.critic_parameters(),
                "lr": p.setting("critic_lr"),
                "max_grad_norm": p.setting("critic_max_grad_norm"),
            },
        ]

    steps = cfg.trainer.steps * p.epochs * p.minibatches
    engine.use_optimizer(
        AdamWConfig(lr=p.actor_lr),
        steps,
        schedule=p.lr_schedule,
        min_lr_ratio=p.setting("min_lr_ratio"),
        param_groups=actor_and_critic,
    )


# ------------------------------------------------------------------------------ ROLLOUT


def noise_level_at(step: int, cfg: FlowPPOConfig) -> float:
    """Flow-SDE's a at step ``step`` (from 0): ``policy.noise_level``, or linear
    from it to ``policy.noise_level_end`` at the last step (the engine's linear
    schedule, counted in steps)."""
    p = cfg.policy
    start = p.setting("noise_level")
    if p.noise_level_end is None:
        return start
    return start * lr_factor(step, 0, cfg.trainer.steps, "linear", p.noise_level_end / start)


# ------------------------------------------------------------------------------ ADVANTAGE


def advantages(rollout: ChunkBuffer, cfg: FlowPPOConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, N] advantages and value targets (per env: this process's envs suffice)."""
    p = cfg.ppo
    if not p.critic_free:
        rewards = rollout.rewards * p.setting("reward_scale")
        reward, discount, lam = chunk_discounting(rewards, rollout.alive, p.setting("gamma"), p.setting("lam"))
        return gae(reward, rollout.values, rollout.next_values, rollout.terminated, rollout.done, discount, lam)
    returns = (rollout.rewards * rollout.alive).sum(dim=-1)
    returns = (returns * rollout.valid).sum(dim=0)
    # envs are grouped consecutively by initial state (``episode_seeds``)
    adv = grpo_advantages(returns, p.setting("group_size"))[None, :].expand_as(rollout.valid)
    return adv.float().clone(), returns[None, :].expand_as(rollout.valid).float().clone()


# ------------------------------------------------------------------------------ UPDATE


def value_clip(returns: torch.Tensor, cfg: FlowPPOConfig) -> float | None:
    """The value loss's clip for this iteration: ``ppo.value_clip`` times the std of
    every process's value targets (``returns`` [T, N], valid chunks), or as set."""
    p = cfg.ppo
    if p.value_clip is None or p.setting("value_clip_scale") == "absolute":
        return p.value_clip
    x = returns.double()
    n, total, squares = distributed.all_sum([x.numel(), x.sum().item(), x.square().sum().item()])
    std = math.sqrt(max(squares - total * total / n, 0.0) / max(n - 1, 1))
    return p.value_clip * max(std, 1e-6)


def minibatches(rollout: ChunkBuffer, envs: EnvShare, cfg: FlowPPOConfig, stream: torch.Generator):
    """One epoch's global mini-batches: a permutation (from ``stream``) of the valid
    chunks of every process (global index ``t * total + env``), cut in
    ``ppo.minibatches``. Yields (global size, this process's members as local indices
    ``t * count + i``)."""
    # the mask crosses to the host (once an update) to be gathered; indices stay there
    valid = torch.cat(distributed.gather_objects([rollout.valid.cpu()]), dim=1)  # [T, total]
    index = torch.nonzero(valid.flatten()).flatten()
    order = index[torch.randperm(index.numel(), generator=stream)]
    for batch in order.chunk(cfg.ppo.minibatches):
        t, env = batch // envs.total, batch % envs.total
        here = (env >= envs.start) & (env < envs.start + envs.count)
        yield batch.numel(), t[here] * envs.count + env[here] - envs.start


def advantage_scales(batches: list, adv: torch.Tensor) -> list[tuple[float, float]]:
    """(mean, std + 1e-8) of each global mini-batch's advantages, from every process's
    sums; (0, 1) for a mini-batch of one."""
    local = [[m.numel(), adv[m].double().sum().item(), adv[m].double().square().sum().item()] for _, m in batches]
    summed = distributed.all_sum([x for moments in local for x in moments])
    scales = []
    for j in range(len(batches)):
        n, total, squares = summed[3 * j : 3 * j + 3]
        if n <= 1:
            scales.append((0.0, 1.0))
            continue
        mean = total / n
        scales.append((mean, math.sqrt(max(squares - n * mean * mean, 0.0) / (n - 1)) + 1e-8))
    return scales


def ppo_loss(
    engine: TrainingEngine, b: dict, adv: torch.Tensor, cfg: FlowPPOConfig, train_actor: bool, clip: float | None
) -> tuple[torch.Tensor, dict]:
    """The PPO loss of chunks ``b`` summed over them (the caller divides by the global
    mini-batch size), and their diagnostics (``METRICS`` keys): sums, and the largest
    ratio. Without ``train_actor`` (the critic's warm-up) only the value loss is
    optimized; ``clip``: the value clip."""
    p, policy = cfg.ppo, engine.module
    logp, entropy, value = engine.model(b["obs"], b["chain"], b["stochastic"])
    if p.ratio == "element":
        mask = policy.action_mask.bool()
        new, old = logp[:, mask], b["logp"][:, mask]
    else:
        how = cfg.policy.setting("logprob")
        new, old = (reduce_logprob(x, policy.action_mask, how) for x in (logp, b["logp"]))
    if new.dim() == 1:  # one ratio per chunk: a row of one element
        new, old = new[:, None], old[:, None]
    # each chunk's mean over its elements, summed over chunks (denominator 1): the caller
    # divides by the global mini-batch size
    every = torch.ones_like(new)  # each chunk's elements are all real ones
    policy_loss, stats = clipped_policy_loss(
        new, old, adv, every, p.clip_low, p.clip_high, aggregation="seq-mean-token-mean", denominator=1.0
    )
    # the warm-up's loss leaves the actor's gradients unset: the optimizer skips it
    bonus = p.setting("entropy_coef") * entropy.sum()
    loss = policy_loss - bonus if train_actor else torch.zeros((), device=value.device)
    n = adv.shape[0]
    record = {"n": n, "loss/policy": policy_loss.item(), "actor/entropy": entropy.sum().item()}
    record.update({f"loss/{k}": getattr(stats, k) * n for k in ("ratio_mean", "clip_fraction", "approx_kl")})
    record["loss/ratio_max"] = stats.ratio_max
    if not p.critic_free:
        v_loss = value_loss(value, b["values"], b["returns"], clip, p.setting("huber_delta"), reduction="sum")
        loss = loss + p.setting("value_coef") * v_loss
        record["loss/value"] = v_loss.item()
    return loss, record


def first_chunk() -> torch.Tensor:
    """The filler of a process without members in a mini-batch: its first chunk."""
    return torch.zeros(1, dtype=torch.long)


def mean_diagnostics(records: list[dict], grad_norms: list[float]) -> dict:
    """Every process's diagnostics of each mini-batch combined (sums over the global
    count), then averaged over mini-batches; ``loss/ratio_max`` is the largest ratio
    of them all."""
    totals, largest = {"optim/grad_norm": sum(grad_norms)}, {}
    for batch in zip(*distributed.gather_objects([records]), strict=True):
        count = sum(r["n"] for r in batch)
        for key in sorted({k for r in batch for k in r} - {"n"}):
            if key == "loss/ratio_max":
                largest[key] = max(largest.get(key, -math.inf), *(r.get(key, -math.inf) for r in batch))
            else:
                totals[key] = totals.get(key, 0.0) + sum(r.get(key, 0.0) for r in batch) / count
    return {k: v / max(len(grad_norms), 1) for k, v in totals.items()} | largest


def epoch_kl(records: list[dict], batches: int) -> float:
    """The mean approximate KL of one pass's ``batches`` mini-batches (``records``:
    this process's, one per mini-batch) over every process's chunks: the same on
    every rank."""
    return mean_diagnostics(records, [0.0] * batches)["loss/approx_kl"]


def update(
    engine: TrainingEngine,
    rollout: ChunkBuffer,
    adv,
    returns,
    cfg: FlowPPOConfig,
    envs: EnvShare,
    stream: torch.Generator,
    train_actor: bool = True,
    demos: Demos | None = None,
) -> dict:
    """PPO epochs over global mini-batches of valid chunks, one optimizer step each;
    returns the diagnostics (``METRICS`` keys) averaged over mini-batches.
    ``train_actor`` False: the critic alone learns (warm-up). With ``ppo.bc_coef``,
    each actor step adds that times the cloning loss on a global batch of ``demos``."""
    p = cfg.ppo
    anchored = train_actor and p.bc_coef > 0
    anchor_size = min(cfg.bc.batch_size, demos.obs.shape[0]) if anchored else 0
    anchor_total = 0.0
    clip = None if p.critic_free else value_clip(returns[rollout.valid], cfg)
    flat = {
        "obs": rollout.obs.flatten(0, 1),
        "chain": rollout.chain.flatten(0, 1),
        "stochastic": rollout.stochastic.flatten(0, 1),
        "logp": rollout.logp.flatten(0, 1),
        "values": rollout.values.flatten(),
        "adv": adv.flatten(),
        "returns": returns.flatten(),
    }
    records, grad_norms, group_norms = [], [], []
    for epoch in range(p.epochs):
        first = len(records)
        batches = list(minibatches(rollout, envs, cfg, stream))
        normalize = not p.critic_free and p.setting("normalize_advantages")
        scales = advantage_scales(batches, flat["adv"]) if normalize else [(0.0, 1.0)] * len(batches)
        for (size, members), (mean, std) in zip(batches, scales, strict=True):
            # a process without members still runs a forward and backward of its first
            # chunk (weight 0): data-parallel wrappers reduce gradients in every process together
            for mine, real in distributed.lockstep([members] if members.numel() else [], filler=first_chunk):
                b = {k: v[mine].to(engine.device) for k, v in flat.items()}
                loss, record = ppo_loss(engine, b, (b["adv"] - mean) / std, cfg, train_actor, clip)
                engine.backward(loss * ((1.0 if real else 0.0) / size))
                records.append(record if real else {"n": 0})
            if anchored:
                anchor = cloning_loss(engine, demos, anchor_size, stream)
                engine.backward(p.bc_coef * anchor)
                anchor_total += anchor.item()
            result = engine.step()
            grad_norms.append(result.grad_norm)
            group_norms.append(result.group_norms)
        if p.target_kl is not None and epoch_kl(records[first:], len(batches)) > p.target_kl:
            engine.skip_steps((p.epochs - epoch - 1) * len(batches))
            break
    diagnostics = mean_diagnostics(records, grad_norms)
    diagnostics["update/epochs"] = epoch + 1
    if anchored:  # each process's slices add up to each step's global-batch loss
        diagnostics["loss/bc"] = distributed.all_sum([anchor_total])[0] / len(grad_norms)
    for name, norms in zip(("actor_grad_norm", "critic_grad_norm"), zip(*group_norms, strict=True), strict=True):
        diagnostics[f"optim/{name}"] = sum(norms) / len(norms)
    if clip is not None:
        diagnostics["update/value_clip"] = clip
    if not p.critic_free:  # of the values the rollout used, over every process's envs
        pairs = distributed.gather_objects([torch.stack([rollout.values, returns])[:, rollout.valid].cpu()])
        values, targets = torch.cat(pairs, dim=1)
        diagnostics["update/explained_variance"] = explained_variance(values, targets)
    return diagnostics


# ------------------------------------------------------------------------------ LOG


def step_row(
    step: int,
    episodes: EpisodeTotals,
    metrics: dict,
    timer: Timer,
    env_steps: int,
    progress: Progress,
    cfg: FlowPPOConfig,
    engine: TrainingEngine,
) -> dict:
    """The metrics row of ``step`` (1-based): training episodes' totals added up over
    processes, the update's diagnostics, timings averaged over processes (``METRICS``)."""
    timing = distributed.mean_metrics(
        {
            **timer.metrics(),
            "throughput/env_steps_per_s": env_steps / max(timer.total, 1e-9),
            "throughput/rollout_env_steps_per_s": env_steps / max(timer.seconds["rollout"], 1e-9),
        }
    )
    policy = engine.module
    return {
        "step": step,
        **episode_metrics(distributed.all_sum(episodes.totals())),
        **metrics,
        **engine.metrics(),
        **timing,
        # the entropy of a Gaussian of std s is log s + (log 2 pi + 1) / 2
        "policy/noise_std": math.exp(metrics.get("actor/entropy", 0.0) - 0.5 * (math.log(2 * math.pi) + 1)),
        **({"policy/noise_level": policy.noise_level} if cfg.policy.method == "flow_sde" else {}),
        "env_steps": progress.results["env_steps"],
    }


# ------------------------------------------------------------------------------ train


def train(cfg: FlowPPOConfig, resume: str | None = None) -> dict:
    """Run BC (when demos are given) and PPO; returns the results (also in
    ``summary.json``'s ``results``): held-out success after BC and after RL with their
    95% intervals, env steps, seconds. ``resume``: None, 'auto' or a checkpoint directory."""
    started = time.perf_counter()
    t, p = cfg.trainer, cfg.ppo
    run = start_run(cfg, resume)
    envs = env_share(cfg, run)
    with closing(make_env(cfg, envs)) as env:
        progress = Progress(shared_stream(cfg))
        policy = build_policy(cfg, env.obs_dim, env.action_dim, progress.stream, env).to(run.device)
        cloning = run.resume_from is None and bool(cfg.bc.demos)
        demos = load_demos(cfg, policy.horizon, run.device) if cloning or p.bc_coef else None
        if policy.backbone.HAS_VLM:  # what trains: the phase's parameters
            policy.backbone.train_vlm(vlm_trains(cfg, "bc" if cloning else "ppo"))
        engine = make_engine(policy, cfg, run)

        # WARM START: behaviour cloning, then the held-out success RL starts from
        if run.resume_from is None:
            if cloning:
                progress.results["trainable_parameters_bc"] = sum(p.numel() for p in engine.params)
                check_demo_seeds(cfg.bc.demos, t.eval_seed, t.eval_episodes)
                bc_log = MetricsLog(run.out / "bc", None, enabled=run.ranks.is_main)
                progress.results["bc_loss"] = behaviour_clone(engine, demos, cfg, run, progress.stream, bc_log)
                bc_log.close()
            start_eval = evaluate_policy(engine, env, envs, cfg)
            progress.results.update(interval_summary("success_bc", start_eval), backend=env.backend)
        # PPO's optimizer; a resumed run restores it, the weights, the stream and the results
        if policy.backbone.HAS_VLM:
            # FSDP2 copies what its shards require to the gathered weights at each gather:
            # the shards must be the registered parameters when the VLM is switched
            engine.reshard()
            policy.backbone.train_vlm(vlm_trains(cfg, "ppo"))
        if not p.bc_coef:  # the demos were behaviour cloning's alone: off the device before the rollouts
            demos = None
        use_ppo_optimizer(engine, cfg)
        if run.resume_from is None:
            progress.results["trainable_parameters_ppo"] = sum(p.numel() for p in engine.params)
        log, bar = resume_steps(cfg, run, engine, progress, "flow_ppo")
        if run.resume_from is None:
            log.log({"step": 0, **{f"eval/{k}": v for k, v in start_eval.items()}}, force=True)

        chunks = math.ceil(cfg.env.max_episode_steps / policy.executed)
        group = p.setting("group_size") if p.critic_free else 1
        row: dict = {}
        for step in bar:
            timer = Timer()
            # ROLLOUT: one episode's worth of chunks per env, this process's share of them
            policy.noise_level = noise_level_at(step, cfg)  # the rollout's and the update's
            with timer("reset"):
                seeds = episode_seeds(cfg.run.seed, step, envs.total, group, t.eval_seed)
                obs = env.reset(seed=seeds[envs.rows])
            with timer("rollout"), engine.forward_context():
                rollout, episodes = collect(policy, env, envs, obs, chunks, progress.stream, run.device)
            # the critic's warm-up: its first steps fit the value head alone
            train_actor = step >= p.critic_warmup
            env_steps = chunks * envs.total * policy.executed
            progress.results["env_steps"] += env_steps
            # ADVANTAGE + UPDATE
            with timer("update"):
                adv, returns = advantages(rollout, cfg)
                metrics = update(engine, rollout, adv, returns, cfg, envs, progress.stream, train_actor, demos)
            # LOG
            row = step_row(step + 1, episodes, metrics, timer, env_steps, progress, cfg, engine)
            row["update/actor_updated"] = float(train_actor)
            # EVALUATE
            last = step + 1 == t.steps
            evaluated = last or bool(t.eval_every and (step + 1) % t.eval_every == 0)
            if evaluated:
                row.update({f"eval/{k}": v for k, v in evaluate_policy(engine, env, envs, cfg).items()})
            log.log(row, force=evaluated)
            bar.set_postfix(
                success=f"{row.get('env/success_once', 0):.2f}", steps_s=f"{row['throughput/env_steps_per_s']:.0f}"
            )
            # CHECKPOINT
            save_if_due(cfg, run, step + 1, engine, None, {"sampler": progress.state_dict()})
        log.close()
        results, final = progress.results, row or last_row(run.out)  # a finished run resumed trains no step
        if "eval/success" in final:
            held_out = {k[5:]: v for k, v in final.items() if k.startswith("eval/")}
            results.update(interval_summary("success_rl", held_out))
        results.update(heldout_episodes=t.eval_episodes, steps=t.steps, seconds=round(time.perf_counter() - started, 1))
        finish_run(run, t.steps, {}, final, results)
        return results
