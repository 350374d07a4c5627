"""Running a chunk policy in batched environments: chunk execution, rollouts for PPO
and held-out evaluation (imported as ``omni_rl.sim.rollout``; no simulator is
imported: envs are passed in).

Several processes: each steps its share of a run's envs, an :class:`EnvShare` (global
env rows ``[start, start + count)`` of ``total``). Episode seeds and sampling noise are
drawn for every global env on every process, from generators in the same state, and
sliced, so what an env does is the same however the envs are split.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from omni_rl.engine import distributed
from omni_rl.sim.base import EpisodeStats


@dataclass(frozen=True)
class EnvShare:
    """This process's envs among all of a run's: global rows [start, start + count)."""

    start: int
    count: int
    total: int

    @property
    def rows(self) -> slice:
        return slice(self.start, self.start + self.count)

    @classmethod
    def whole(cls, total: int) -> EnvShare:
        """Every env in one process."""
        return cls(0, total, total)


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


def episode_seeds(seed: int, iteration: int, num_envs: int, group_size: int, limit: int) -> list[int]:
    """Seeds of every global env's episode in a training iteration, below ``limit``
    (the first held-out seed); envs in one group of ``group_size`` share theirs."""
    base = seed * 100_003 + iteration * num_envs
    return [(base + i // group_size) % limit for i in range(num_envs)]


@torch.no_grad()
def collect(policy, env, envs: EnvShare, seeds: list[int], chunks: int, generator: torch.Generator, device):
    """``chunks`` chunks in each of this process's envs, reset from their rows of the
    global ``seeds``; each chunk's noise is drawn for every global env from
    ``generator`` (in the same state on every process). Returns the :class:`Rollout`
    and the episodes that ended."""
    obs = env.reset(seed=seeds[envs.rows]).cpu().float()
    steps: dict[str, list] = {k: [] for k in Rollout.__dataclass_fields__}
    episodes = []
    ended = torch.zeros(env.num_envs, dtype=torch.bool)
    for _ in range(chunks):
        sample = policy.sample(obs.to(device), noise=policy.noise(envs.total, generator)[envs.rows])
        outcome = run_chunk(env, sample.actions, policy.executed)
        done = outcome.terminated | outcome.truncated
        bootstrap = policy.value_of(outcome.final_obs.to(device)).cpu()
        for name, value in (
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
            steps[name].append(value)
        ended |= done
        episodes += outcome.episodes
        obs = outcome.next_obs
    # the rollout's last chunk is cut by the iteration's end where no episode ended there
    steps["done"][-1] = torch.ones(env.num_envs, dtype=torch.bool)
    return Rollout(**{k: torch.stack(v) for k, v in steps.items()}), episodes


@torch.no_grad()
def evaluate_success(policy, env, envs: EnvShare, episodes: int, first_seed: int, max_steps: int, device) -> list:
    """The first episode from each of this process's share of ``episodes`` held-out
    seeds (``first_seed``, ``first_seed + 1``, ...), with the deterministic sampler from
    start noise drawn for every global env from a generator seeded ``first_seed``.
    Rounds of ``envs.total`` seeds, this process playing its rows of each; a round ends
    when every env of every process has finished an episode."""
    chunks = math.ceil(max_steps / policy.executed)
    generator = torch.Generator().manual_seed(first_seed)
    first: list[EpisodeStats] = []
    for start in range(0, episodes, envs.total):
        seeds = [first_seed + start + i for i in range(envs.total)][envs.rows]
        obs = env.reset(seed=seeds).float()
        seen: dict[int, EpisodeStats] = {}
        for _ in range(chunks):
            noise = policy.noise(envs.total, generator)[envs.rows]
            sample = policy.sample(obs.to(device), deterministic=True, noise=noise)
            outcome = run_chunk(env, sample.actions, policy.executed)
            for ep in outcome.episodes:
                seen.setdefault(ep.env, ep)
            obs = outcome.next_obs
            if distributed.all_sum([len(seen)])[0] == envs.total:
                break
        first += [seen[i] for i in range(envs.count) if start + envs.start + i < episodes and i in seen]
    return first


def episode_totals(episodes: list) -> list[float]:
    """[successes, summed return, summed length, count] of ``episodes``: what adds up
    over processes."""
    return [
        float(sum(e.success_once for e in episodes)),
        float(sum(e.ret for e in episodes)),
        float(sum(e.length for e in episodes)),
        float(len(episodes)),
    ]


def episode_metrics(totals: list[float]) -> dict:
    """Training-episode metrics from (summed) :func:`episode_totals`."""
    success, ret, length, count = totals
    if not count:
        return {}
    return {
        "env/success_once": success / count,
        "env/return": ret / count,
        "env/episode_length": length / count,
        "env/episodes": int(count),
    }
