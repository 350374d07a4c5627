"""Running a chunk policy in batched environments: chunk execution, rollouts for PPO
and held-out evaluation (imported as ``omni_rl.sim.episodes``; no simulator is
imported: envs are passed in).

Several processes: each steps its share of a run's envs, an :class:`EnvShare` (global
env rows ``[start, start + count)`` of ``total``). Episode seeds and sampling noise are
drawn for every global env on every process, from generators in the same state, and
sliced, so what an env does is the same however the envs are split.

Everything an iteration produces stays on the device: the buffer lives where the policy
runs, episode statistics add up in device tensors, and the sampling noise of a whole
iteration crosses to the device in one copy. The host reads the episode totals once per
iteration (and once per evaluation).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from omni_rl.sim.base import EndedEpisodes


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
    """What running one chunk's executed actions in N envs gave (on the env's device).

    Attributes:
        rewards: [N, h] each executed step's reward, 0 after the chunk's episode ended.
        alive: [N, h] bool, the step belonged to the episode the chunk started in.
        terminated, truncated: [N] bool, how that episode ended within the chunk.
        final_obs: [N, O] the ended episode's last observation (else the next one).
        next_obs: [N, O] the observation to act on next.
    """

    rewards: torch.Tensor
    alive: torch.Tensor
    terminated: torch.Tensor
    truncated: torch.Tensor
    final_obs: torch.Tensor
    next_obs: torch.Tensor


class EpisodeTotals:
    """Running sums over ended episodes of [successes, return, length, count], in a
    device tensor; ``first_only`` counts each env's first episode alone (evaluation)."""

    def __init__(self, num_envs: int, device: torch.device | str, first_only: bool = False):
        self.sums = torch.zeros(4, dtype=torch.float64, device=device)
        self.seen = torch.zeros(num_envs, dtype=torch.bool, device=device) if first_only else None

    def add(self, ended: EndedEpisodes | None, keep: torch.Tensor | None = None) -> None:
        """Count the episodes of one step (``keep``: [N] bool, envs that may count)."""
        if ended is None:
            return
        take = ended.done.to(self.sums.device)
        if self.seen is not None:
            take, self.seen = take & ~self.seen, self.seen | take
        if keep is not None:
            take = take & keep
        w = take.double()
        rows = (ended.success_once.double(), ended.ret.double(), ended.length.double(), torch.ones_like(w))
        self.sums += torch.stack([(w * x.to(w.device)).sum() for x in rows])

    def totals(self) -> list[float]:
        """[successes, summed return, summed length, count]: what adds up over processes
        (one host copy)."""
        return self.sums.tolist()


def run_chunk(
    env, actions: torch.Tensor, executed: int, totals: EpisodeTotals | None = None, keep=None
) -> ChunkOutcome:
    """Step the first ``executed`` actions of each chunk ([N, H, D]). An episode that
    ends mid-chunk counts only its own rewards; the env has already reset, and the
    chunk's leftover actions run in the new episode. Ended episodes add to ``totals``.
    An env with cameras (``renders_on_request``) renders only the chunk's last step, whose
    observation the policy reads next, and the ends of episodes."""
    n, device = actions.shape[0], env.device
    actions = actions.to(device)
    rewards = torch.zeros(n, executed, device=device)
    alive = torch.ones(n, executed, dtype=torch.bool, device=device)
    ended = torch.zeros(n, dtype=torch.bool, device=device)
    terminated = torch.zeros(n, dtype=torch.bool, device=device)
    final_obs, result = None, None
    on_request = getattr(env, "renders_on_request", False)
    for j in range(executed):
        result = env.step(actions[:, j], look=j == executed - 1) if on_request else env.step(actions[:, j])
        alive[:, j] = ~ended
        rewards[:, j] = result.reward.float() * ~ended
        now = ~ended & result.done
        terminated |= now & result.terminated
        last = result.final_obs.float()
        final_obs = last if final_obs is None else torch.where(now[:, None], last, final_obs)
        ended |= now
        if totals is not None:
            totals.add(result.ended, keep)
    next_obs = result.obs.float()
    final_obs = torch.where(ended[:, None], final_obs, next_obs)
    return ChunkOutcome(rewards, alive, terminated, ended & ~terminated, final_obs, next_obs)


@dataclass
class ChunkBuffer:
    """T chunks of N envs, h executed actions each, on the policy's device.

    obs [T, N, O]; chain [T, N, K+1, H, D]; stochastic [T, N, K]; logp [T, N, H, D];
    values, next_values [T, N]; rewards, alive [T, N, h] (per env step, see
    :class:`ChunkOutcome`); terminated, done, valid [T, N]."""

    obs: torch.Tensor
    chain: torch.Tensor
    stochastic: torch.Tensor
    logp: torch.Tensor
    values: torch.Tensor
    rewards: torch.Tensor
    alive: torch.Tensor
    next_values: torch.Tensor
    terminated: torch.Tensor
    done: torch.Tensor
    valid: torch.Tensor


def first_episode(seed: int, limit: int) -> int:
    """Where run seed ``seed``'s training episodes begin in ``[0, limit)``: ``limit``
    times the seed's digits mirrored after the point (its radical inverse in base 10:
    0.1 for 1, 0.01 for 10, 0.11 for 11), so seeds 0-9 begin a tenth of ``limit``
    apart, 0-99 a hundredth, 0-999 a thousandth; plus ``3 * seed``, which keeps seeds
    0-9 where ``seed * 100_003`` put them before (that stride wrapped the default 1e6
    to 30 every ten seeds, so seed 10 replayed seed 0's episodes)."""
    digits = str(seed)
    return int(digits[::-1]) * limit // 10 ** len(digits) + 3 * seed


def episode_seeds(seed: int, iteration: int, num_envs: int, group_size: int, limit: int) -> list[int]:
    """Seeds of every global env's episode in a training iteration, below ``limit``
    (the first held-out seed), from the run's ``first_episode`` on; envs in one group
    of ``group_size`` share theirs."""
    base = first_episode(seed, limit) + iteration * num_envs
    return [(base + i // group_size) % limit for i in range(num_envs)]


@torch.no_grad()
def collect(policy, env, envs: EnvShare, obs: torch.Tensor, chunks: int, generator: torch.Generator, device):
    """``chunks`` chunks in each of this process's envs from ``obs`` (what the env's
    seeded reset returned, see :func:`episode_seeds`); the iteration's noise is drawn
    for every global env from ``generator`` (in the same state on every process) and
    moved to ``device`` once. Returns the :class:`ChunkBuffer` (on ``device``) and the
    :class:`EpisodeTotals` of each env's first episode, which the seeded reset began
    and the rollout's ``ceil(max_steps / executed)`` chunks end. Episodes an auto-reset
    began do not count: of those, the rollout ends only the ones that succeed early
    (under ``ignore_terminations: false``), which would lift ``env/success_once``."""
    noise = policy.noise(chunks * envs.total, generator).view(chunks, envs.total)[:, envs.rows].to(device)
    obs = obs.float().to(device)
    steps: dict[str, list] = {k: [] for k in ChunkBuffer.__dataclass_fields__}
    totals = EpisodeTotals(env.num_envs, env.device, first_only=True)
    ended = torch.zeros(env.num_envs, dtype=torch.bool, device=device)
    for c in range(chunks):
        sample = policy.sample(obs, noise=noise[c])
        outcome = run_chunk(env, sample.actions, policy.executed, totals)
        terminated, done = outcome.terminated.to(device), (outcome.terminated | outcome.truncated).to(device)
        for name, value in (
            ("obs", obs),
            ("chain", sample.chain),
            ("stochastic", sample.stochastic),
            ("logp", sample.logp),
            ("values", sample.value),
            ("rewards", outcome.rewards.to(device)),
            ("alive", outcome.alive.to(device)),
            ("next_values", policy.value_of(outcome.final_obs.to(device))),
            ("terminated", terminated),
            ("done", done),
            ("valid", ~ended),  # critic-free: each env's first episode only
        ):
            steps[name].append(value)
        ended = ended | done
        obs = outcome.next_obs.to(device)
    # the rollout's last chunk is cut by the iteration's end where no episode ended there
    steps["done"][-1] = torch.ones(env.num_envs, dtype=torch.bool, device=device)
    return ChunkBuffer(**{k: torch.stack(v) for k, v in steps.items()}), totals


@torch.no_grad()
def evaluate_success(policy, env, envs: EnvShare, episodes: int, first_seed: int, max_steps: int, device) -> list:
    """[successes, summed return, summed length, count] of the first episode from each
    of this process's share of ``episodes`` held-out seeds (``first_seed``,
    ``first_seed + 1``, ...), with the deterministic sampler.

    The start noise comes from a generator of its own, seeded ``first_seed`` at every
    evaluation, that draws start noise alone: what the training stream, the sampling
    method (Flow-Noise, Flow-SDE hybrid or chain) or an earlier evaluation drew never
    shifts it, so every evaluation of a run, and of runs that differ only in how they
    explore, replays the same episodes. Rounds of ``envs.total`` seeds, this process
    playing its rows of each; every round runs ``ceil(max_steps / executed)`` chunks,
    which ends every env's first episode."""
    chunks = math.ceil(max_steps / policy.executed)
    generator = torch.Generator().manual_seed(first_seed)
    totals = EpisodeTotals(env.num_envs, env.device, first_only=True)
    for start in range(0, episodes, envs.total):
        seeds = [first_seed + start + i for i in range(envs.total)][envs.rows]
        keep = torch.tensor([start + envs.start + i < episodes for i in range(envs.count)], device=env.device)
        starts = policy.start_noise(chunks * envs.total, generator).view(chunks, envs.total, *policy.chunk_shape)
        starts = starts[:, envs.rows].to(device)
        obs = env.reset(seed=seeds).float().to(device)
        totals.seen = torch.zeros_like(totals.seen)
        for c in range(chunks):
            sample = policy.sample(obs, deterministic=True, start=starts[c])
            outcome = run_chunk(env, sample.actions, policy.executed, totals, keep)
            obs = outcome.next_obs.to(device)
    return totals.totals()


def episode_metrics(totals: list[float]) -> dict:
    """Training-episode metrics from (summed) :class:`EpisodeTotals`."""
    success, ret, length, count = totals
    if not count:
        return {}
    return {
        "env/success_once": success / count,
        "env/return": ret / count,
        "env/episode_length": length / count,
        "env/episodes": int(count),
    }
