"""Flow-policy RL in simulation: behaviour cloning from a few demonstrations, then PPO
with Flow-Noise or Flow-SDE likelihoods (after pi_RL), in N parallel environments.

Each iteration resets every env from a fresh seed and runs one episode's worth of
action chunks (the policy is queried every ``executed`` env steps), then updates the
policy on them:

    ROLLOUT   sample a chunk per env (K denoising steps, some stochastic), run its
              executed actions, sum their rewards; keep the denoising chain
    ADVANTAGE GAE over chunks with the critic (bootstrapping truncated episodes), or,
              critic-free, each episode's return normalized within its group of
              episodes that started from the same state
    UPDATE    epochs of mini-batches: clipped ratio per chunk or per element,
              clipped Huber value loss, entropy bonus, separate actor/critic rates
    EVALUATE  success rate on held-out seeds with the deterministic (ODE) sampler
    LOG, CHECKPOINT
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from omni_rl import checkpoint
from omni_rl.algorithms.flow import reduce_logprob
from omni_rl.algorithms.ppo import clipped_surrogate, gae, group_advantages, normalize, value_loss
from omni_rl.config import FlowPPOConfig
from omni_rl.errors import OmniRLError
from omni_rl.models.flow_policy import FlowPolicy
from omni_rl.recipes.common import MetricsLog, Timer, start_run
from omni_rl.runtime import resolve_device
from omni_rl.sim import make_vec_env

# ------------------------------------------------------------------------------ pieces


def build_policy(cfg: FlowPPOConfig, obs_dim: int, action_dim: int) -> FlowPolicy:
    p = cfg.policy
    return FlowPolicy(
        obs_dim,
        action_dim,
        horizon=p.horizon,
        executed=p.executed,
        steps=p.denoise_steps,
        width=p.width,
        encoder=p.encoder,
        method=p.method,
        sigma_min=p.sigma_min,
        sigma_max=p.sigma_max,
        noise_level=p.noise_level,
        sde_mode=p.sde_mode,
    )


def demo_chunks(path: str | Path, horizon: int, episodes: int | None = None):
    """Expert chunks from a demonstrations file: obs [M, O], actions [M, H, D] (the
    next H actions of the same episode, the last one repeated past its end) and a
    mask [M, H] that is 1 on real actions."""
    path = Path(path)
    if not path.is_file():
        raise OmniRLError(f"{path}: demonstrations file not found (omni-rl sim collect-demos writes one)")
    with safe_open(str(path), "pt") as f:
        obs, actions, episode = f.get_tensor("obs"), f.get_tensor("actions"), f.get_tensor("episode")
    if episodes is not None:  # episodes are numbered 0, 1, ... in the file
        keep = episode < episodes
        obs, actions, episode = obs[keep], actions[keep], episode[keep]
    count = obs.shape[0]
    index = torch.arange(count)
    chunks, mask = [], []
    last = index.clone()
    for j in range(horizon):
        ahead = (index + j).clamp(max=count - 1)
        real = (index + j < count) & (episode[ahead] == episode)
        last = torch.where(real, ahead, last)
        chunks.append(actions[last])
        mask.append(real)
    return obs.float(), torch.stack(chunks, dim=1).float(), torch.stack(mask, dim=1).float()


def behaviour_clone(policy: FlowPolicy, cfg: FlowPPOConfig, device: torch.device, log: MetricsLog) -> float:
    """Fit the velocity field to the demonstrations; returns the last logged loss."""
    obs, actions, mask = demo_chunks(cfg.bc.demos, policy.horizon, cfg.bc.episodes)
    obs, actions, mask = obs.to(device), actions.to(device), mask.to(device)
    optimizer = torch.optim.Adam(policy.actor_parameters(), lr=cfg.bc.lr)
    running = 0.0
    for step in tqdm(range(1, cfg.bc.steps + 1), desc="bc", unit="step"):
        batch = torch.randint(obs.shape[0], (min(cfg.bc.batch_size, obs.shape[0]),), device=device)
        loss = policy.bc_loss(obs[batch], actions[batch], mask[batch])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        running = 0.9 * running + 0.1 * loss.item() if step > 1 else loss.item()
        if step % 50 == 0 or step == cfg.bc.steps:
            log.log({"step": step, "bc/loss": running, "bc/chunks": obs.shape[0]})
    return running


@dataclass
class ChunkOutcome:
    """What running one chunk's executed actions in N envs gave."""

    reward: torch.Tensor  # [N] summed over the executed actions (until the episode ended)
    terminated: torch.Tensor  # [N]
    truncated: torch.Tensor  # [N]
    final_obs: torch.Tensor  # [N, O] the ended episode's last observation (else the next one)
    next_obs: torch.Tensor  # [N, O]
    episodes: list


def run_chunk(env, actions: torch.Tensor, executed: int) -> ChunkOutcome:
    """Step the first ``executed`` actions of each chunk ([N, H, D]). An episode that
    ends mid-chunk counts only its own rewards; the env has already reset, and the
    chunk's leftover actions run in the new episode."""
    n = actions.shape[0]
    reward = torch.zeros(n)
    terminated = torch.zeros(n, dtype=torch.bool)
    truncated = torch.zeros(n, dtype=torch.bool)
    final_obs, episodes, result = None, [], None
    for j in range(executed):
        result = env.step(actions[:, j].to(env.device))
        alive = ~(terminated | truncated)
        reward += result.reward.cpu().float() * alive
        ended = alive & result.done.cpu()
        terminated |= ended & result.terminated.cpu()
        truncated |= ended & ~result.terminated.cpu()
        last = result.final_obs.cpu().float()
        final_obs = last if final_obs is None else torch.where(ended[:, None], last, final_obs)
        episodes += result.episodes
    next_obs = result.obs.cpu().float()
    final_obs = torch.where((terminated | truncated)[:, None], final_obs, next_obs)
    return ChunkOutcome(reward, terminated, truncated, final_obs, next_obs, episodes)


@dataclass
class Rollout:
    """T chunks of N envs. obs [T, N, O]; chain [T, N, K+1, H, D]; stochastic [T, N, K];
    logp [T, N, H, D]; values, rewards, next_values [T, N]; terminated, done, valid [T, N]."""

    obs: torch.Tensor
    chain: torch.Tensor
    stochastic: torch.Tensor
    logp: torch.Tensor
    values: torch.Tensor
    rewards: torch.Tensor
    next_values: torch.Tensor
    terminated: torch.Tensor
    done: torch.Tensor
    valid: torch.Tensor


def episode_seeds(cfg: FlowPPOConfig, iteration: int) -> list[int]:
    """Training seeds of an iteration; critic-free groups share theirs."""
    n, group = cfg.env.num_envs, cfg.ppo.group_size if cfg.ppo.critic_free else 1
    base = cfg.run.seed * 100_003 + iteration * n
    return [(base + i // group) % cfg.trainer.eval_seed for i in range(n)]


def collect(policy: FlowPolicy, env, cfg: FlowPPOConfig, iteration: int, device) -> tuple[Rollout, list]:
    """One episode's worth of chunks in every env, from this iteration's seeds."""
    chunks = math.ceil(cfg.env.max_episode_steps / policy.executed)
    obs = env.reset(seed=episode_seeds(cfg, iteration)).cpu().float()
    steps: dict[str, list] = {k: [] for k in Rollout.__dataclass_fields__}
    episodes = []
    ended = torch.zeros(env.num_envs, dtype=torch.bool)
    for _ in range(chunks):
        sample = policy.sample(obs.to(device))
        outcome = run_chunk(env, sample.actions, policy.executed)
        done = outcome.terminated | outcome.truncated
        with torch.no_grad():
            bootstrap = policy.value(policy.encoder(outcome.final_obs.to(device))).cpu()
        for key, value in (
            ("obs", obs),
            ("chain", sample.chain.cpu()),
            ("stochastic", sample.stochastic.cpu()),
            ("logp", sample.logp.cpu()),
            ("values", sample.value.cpu()),
            ("rewards", outcome.reward),
            ("next_values", bootstrap),
            ("terminated", outcome.terminated),
            ("done", done),
            ("valid", ~ended),  # critic-free: each env's first episode only
        ):
            steps[key].append(value)
        ended |= done
        episodes += outcome.episodes
        obs = outcome.next_obs
    # the rollout's last chunk is cut by the iteration's end where no episode ended there
    steps["done"][-1] = torch.ones(env.num_envs, dtype=torch.bool)
    return Rollout(**{k: torch.stack(v) for k, v in steps.items()}), episodes


def advantages(rollout: Rollout, cfg: FlowPPOConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, N] advantages and value targets."""
    if not cfg.ppo.critic_free:
        return gae(
            rollout.rewards,
            rollout.values,
            rollout.next_values,
            rollout.terminated,
            rollout.done,
            cfg.ppo.gamma,
            cfg.ppo.lam,
        )
    returns = (rollout.rewards * rollout.valid).sum(dim=0)
    groups = torch.arange(returns.shape[0]) // cfg.ppo.group_size
    adv = group_advantages(returns, groups)[None, :].expand_as(rollout.rewards)
    return adv.clone(), returns[None, :].expand_as(rollout.rewards).clone()


def update(policy: FlowPolicy, optimizer, rollout: Rollout, adv, returns, cfg: FlowPPOConfig, device) -> dict:
    """PPO epochs over mini-batches of valid chunks; returns averaged diagnostics."""
    p = cfg.ppo
    index = torch.nonzero(rollout.valid.flatten()).flatten()
    flat = {
        "obs": rollout.obs.flatten(0, 1),
        "chain": rollout.chain.flatten(0, 1),
        "stochastic": rollout.stochastic.flatten(0, 1),
        "logp": rollout.logp.flatten(0, 1),
        "values": rollout.values.flatten(),
        "adv": adv.flatten(),
        "returns": returns.flatten(),
    }
    mask = policy.action_mask.bool()
    totals: dict[str, float] = {}
    updates = 0
    for _ in range(p.epochs):
        order = index[torch.randperm(index.numel())]
        for batch in order.chunk(p.minibatches):
            b = {k: v[batch].to(device) for k, v in flat.items()}
            logp, entropy, value = policy.evaluate(b["obs"], b["chain"], b["stochastic"])
            a = normalize(b["adv"]) if p.normalize_advantages and batch.numel() > 1 else b["adv"]
            if p.ratio == "element":
                policy_loss, stats = clipped_surrogate(logp[:, mask], b["logp"][:, mask], a, p.clip_low, p.clip_high)
            else:
                new = reduce_logprob(logp, policy.action_mask, cfg.policy.logprob)
                old = reduce_logprob(b["logp"], policy.action_mask, cfg.policy.logprob)
                policy_loss, stats = clipped_surrogate(new, old, a, p.clip_low, p.clip_high)
            loss = policy_loss - p.entropy_coef * entropy.mean()
            if not p.critic_free:
                v_loss = value_loss(value, b["values"], b["returns"], p.value_clip, p.huber_delta)
                loss = loss + p.value_coef * v_loss
                stats["value_loss"] = v_loss.item()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), p.max_grad_norm or float("inf"))
            optimizer.step()
            stats.update(policy_loss=policy_loss.item(), entropy=entropy.mean().item(), grad_norm=grad_norm.item())
            for key, value_ in stats.items():
                totals[key] = totals.get(key, 0.0) + value_
            updates += 1
    return {f"train/{k}": v / max(updates, 1) for k, v in totals.items()}


@torch.no_grad()
def evaluate_success(policy: FlowPolicy, env, episodes: int, first_seed: int, max_steps: int, device) -> dict:
    """Success rate, return and length of the first episode from each of ``episodes``
    held-out seeds, with the deterministic sampler (fixed start noise per seed)."""
    n = env.num_envs
    chunks = math.ceil(max_steps / policy.executed)
    first: dict[int, object] = {}
    generator = torch.Generator(device=device).manual_seed(first_seed)
    for start in range(0, episodes, n):
        seeds = [first_seed + start + i for i in range(n)]
        obs = env.reset(seed=seeds).float()
        seen: dict[int, object] = {}
        for _ in range(chunks):
            sample = policy.sample(obs.to(device), deterministic=True, generator=generator)
            outcome = run_chunk(env, sample.actions, policy.executed)
            for ep in outcome.episodes:
                seen.setdefault(ep.env, ep)
            obs = outcome.next_obs
            if len(seen) == n:
                break
        for i in range(min(n, episodes - start)):
            if i in seen:
                first[start + i] = seen[i]
    stats = list(first.values())
    return {
        "success": sum(ep.success_once for ep in stats) / max(episodes, 1),
        "return": sum(ep.ret for ep in stats) / max(len(stats), 1),
        "length": sum(ep.length for ep in stats) / max(len(stats), 1),
    }


def _episode_metrics(episodes: list) -> dict:
    if not episodes:
        return {}
    return {
        "env/success_once": sum(e.success_once for e in episodes) / len(episodes),
        "env/return": sum(e.ret for e in episodes) / len(episodes),
        "env/episode_length": sum(e.length for e in episodes) / len(episodes),
        "env/episodes": len(episodes),
    }


# ------------------------------------------------------------------------------ train


def train(cfg: FlowPPOConfig, resume: str | None = None) -> dict:
    """Run BC (when demos are given) and PPO; returns the summary (also written to
    ``summary.json``): held-out success after BC and after RL, env steps, seconds."""
    started = time.perf_counter()
    out, resume_from = start_run(cfg, resume)
    device = resolve_device(cfg.run.device)
    env = make_vec_env(
        cfg.env.task,
        cfg.env.num_envs,
        backend=cfg.env.backend,
        obs_mode=cfg.env.obs_mode,
        control_mode=cfg.env.control_mode,
        seed=cfg.run.seed,
        max_episode_steps=cfg.env.max_episode_steps,
        ignore_terminations=cfg.env.ignore_terminations,
    )
    try:
        return _train(cfg, out, resume_from, env, device, started)
    finally:
        env.close()


def _train(cfg: FlowPPOConfig, out: Path, resume_from: Path | None, env, device, started: float) -> dict:
    t, p = cfg.trainer, cfg.ppo
    if resume_from is not None:
        policy = FlowPolicy.from_pretrained(resume_from / "model").to(device)
    else:
        policy = build_policy(cfg, env.obs_dim, env.action_dim).to(device)
    optimizer = torch.optim.Adam(
        [
            {"params": policy.actor_parameters(), "lr": p.actor_lr},
            {"params": policy.critic_parameters(), "lr": p.critic_lr},
        ]
    )
    start, summary = 0, {}
    if resume_from is not None:
        state = checkpoint.load_state(resume_from, optimizer, None)
        start, summary = state["step"], state["extra"]
    log = MetricsLog(out, start if resume_from is not None else None)

    def evaluate() -> dict:
        return evaluate_success(policy, env, t.eval_episodes, t.eval_seed, cfg.env.max_episode_steps, device)

    # WARM START: behaviour cloning, then the held-out success RL starts from
    if resume_from is None:
        if cfg.bc.demos:
            bc_log = MetricsLog(out / "bc", None)
            summary["bc_loss"] = behaviour_clone(policy, cfg, device, bc_log)
            bc_log.close()
        start_eval = evaluate()
        summary["success_bc"] = start_eval["success"]
        summary["env_steps"] = 0
        log.log({"step": 0, **{f"eval/{k}": v for k, v in start_eval.items()}})
    bar = tqdm(range(start, t.iterations), initial=start, total=t.iterations, desc="flow_ppo")
    row: dict = {}
    for iteration in bar:
        timer = Timer()
        # ROLLOUT: one episode's worth of chunks per env
        with timer("rollout"):
            rollout, episodes = collect(policy, env, cfg, iteration, device)
        env_steps = rollout.rewards.numel() * policy.executed
        summary["env_steps"] = summary.get("env_steps", 0) + env_steps
        # ADVANTAGE + UPDATE
        with timer("update"):
            adv, returns = advantages(rollout, cfg)
            metrics = update(policy, optimizer, rollout, adv, returns, cfg, device)
        # LOG
        row = {
            "step": iteration + 1,
            **_episode_metrics(episodes),
            **metrics,
            **timer.metrics(),
            "policy/noise_std": math.exp(metrics.get("train/entropy", 0.0) - 0.5 * (math.log(2 * math.pi) + 1)),
            "throughput/env_steps_per_s": env_steps / max(timer.total, 1e-9),
            "throughput/rollout_env_steps_per_s": env_steps / max(timer.seconds["rollout"], 1e-9),
            "env_steps": summary["env_steps"],
        }
        # EVALUATE
        last = iteration + 1 == t.iterations
        if last or (t.eval_every and (iteration + 1) % t.eval_every == 0):
            row.update({f"eval/{k}": v for k, v in evaluate().items()})
        log.log(row)
        bar.set_postfix(
            success=f"{row.get('env/success_once', 0):.2f}", steps_s=f"{row['throughput/env_steps_per_s']:.0f}"
        )
        # CHECKPOINT
        if last or (t.save_every and (iteration + 1) % t.save_every == 0):
            checkpoint.save(out, iteration + 1, policy, None, optimizer, None, {}, summary, keep_last=t.keep_last)
    log.close()
    summary.update(
        success_rl=row.get("eval/success", summary.get("success_rl")),
        iterations=t.iterations,
        seconds=round(time.perf_counter() - started, 1),
    )
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
