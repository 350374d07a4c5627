"""The flow-PPO recipe on the pure-torch point-mass task: every method learns it,
behaviour cloning starts it, a killed run resumes to the uninterrupted result, and two
processes train what one process trains."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from omni_rl.config import save_config
from omni_rl.engine import checkpoint
from omni_rl.errors import ConfigError, OmniRLError
from omni_rl.recipe_loader import config_from_dict
from omni_rl.recipes import flow_ppo
from omni_rl.runtime import AVX2_KERNELS
from omni_rl.sim.episodes import EnvShare
from omni_rl.sim.experts import demo_chunks
from omni_rl.sim.point_mass import PointMassEnv, expert_action

OMNI_RL = str(Path(sys.executable).parent / "omni-rl")
TORCHRUN = str(Path(sys.executable).parent / "torchrun")


def _config(tmp_path, **sections):
    base = {
        "recipe": "flow_ppo",
        "run": {"output_dir": str(tmp_path / "run"), "seed": 0, "device": "cpu"},
        "env": {"task": "PointMass-v0", "num_envs": 16, "max_episode_steps": 24, "ignore_terminations": False},
        "policy": {"horizon": 2, "executed": 2, "denoise_steps": 4, "width": 64},
        "ppo": {"actor_lr": 3e-4, "epochs": 1, "minibatches": 4},
        "trainer": {"steps": 100, "eval_every": 0, "eval_episodes": 48},
    }
    for name, values in sections.items():
        base[name] = {**base.get(name, {}), **values}
    if base["policy"].get("method", "flow_noise") == "flow_noise":  # the point-mass task's noise bounds
        base["policy"] = {"sigma_min": 0.2, "sigma_max": 0.4, **base["policy"]}
    return config_from_dict(base, "test")


@pytest.mark.parametrize(
    "variant",
    [
        {"policy": {"method": "flow_noise"}},
        {"policy": {"method": "flow_sde", "sde_mode": "hybrid"}},
        {"policy": {"method": "flow_sde", "sde_mode": "chain"}, "ppo": {"ratio": "element"}},
        {"policy": {"method": "flow_noise"}, "ppo": {"critic_free": True, "group_size": 4}},
    ],
    ids=["flow_noise", "flow_sde_hybrid", "flow_sde_chain_per_element", "critic_free_grpo"],
)
def test_each_method_learns_the_point_mass_task(tmp_path, variant, point_mass_demos):
    """From a behaviour-cloned start on 4 demos, 100 iterations (400 updates)."""
    variant = {**variant, "bc": {"demos": str(point_mass_demos), "steps": 150, "lr": 1e-3}}
    summary = flow_ppo.train(_config(tmp_path, **variant))
    assert summary["success_bc"] <= 0.5, summary
    assert summary["success_rl"] >= 0.6, summary
    assert summary["success_rl"] >= summary["success_bc"] + 0.2, summary
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 101 and rows[0] == {"step": 0, **{k: rows[0][k] for k in rows[0] if k.startswith("eval/")}}
    assert rows[0]["eval/success"] == summary["success_bc"] and rows[-1]["eval/success"] == summary["success_rl"]
    assert rows[-1]["env_steps"] == 100 * 16 * 12 * 2
    for key in ("env/success_once", "env/return", "loss/policy", "loss/ratio_mean", "policy/noise_std"):
        assert key in rows[-1], key
    assert "loss/value" in rows[-1] or variant.get("ppo", {}).get("critic_free")


@pytest.fixture(scope="module")
def point_mass_demos(tmp_path_factory):
    path = tmp_path_factory.mktemp("demos") / "point_mass.safetensors"
    _write_demos(path, episodes=4)
    return path


def _write_demos(path, episodes: int) -> None:
    env = PointMassEnv(episodes, seed=123, max_episode_steps=24)
    obs = env.reset()
    rows = {"obs": [], "actions": [], "episode": [], "step": []}
    active = torch.ones(episodes, dtype=torch.bool)
    for step in range(24):
        action = expert_action(obs)
        for i in torch.nonzero(active).flatten().tolist():
            rows["obs"].append(obs[i])
            rows["actions"].append(action[i])
            rows["episode"].append(torch.tensor(i))
            rows["step"].append(torch.tensor(step))
        result = env.step(action)
        active &= ~result.done
        obs = result.obs
    save_file({k: torch.stack(v) for k, v in rows.items()}, path)


def test_demo_chunks_stay_inside_their_episode(tmp_path):
    path = tmp_path / "demos.safetensors"
    save_file(
        {
            "obs": torch.arange(5.0)[:, None],
            "actions": torch.arange(5.0)[:, None],
            "episode": torch.tensor([0, 0, 0, 1, 1]),
            "step": torch.tensor([0, 1, 2, 0, 1]),
        },
        path,
    )
    obs, chunks, mask = demo_chunks(path, horizon=3)
    assert chunks[:, :, 0].tolist() == [[0, 1, 2], [1, 2, 2], [2, 2, 2], [3, 4, 4], [4, 4, 4]]
    assert mask.tolist() == [[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 0], [1, 0, 0]]
    obs, _, _ = demo_chunks(path, horizon=3, episodes=1)
    assert obs.shape[0] == 3


def test_behaviour_cloning_from_demos_gives_the_warm_start(tmp_path):
    demos = tmp_path / "demos.safetensors"
    _write_demos(demos, episodes=32)
    cfg = _config(tmp_path, bc={"demos": str(demos), "steps": 400, "lr": 2e-3}, trainer={"steps": 1})
    summary = flow_ppo.train(cfg)
    assert summary["success_bc"] >= 0.6, summary  # a random policy: about 0.1
    assert (tmp_path / "run" / "bc" / "metrics.jsonl").is_file()


def test_a_run_exports_its_policy_and_summarizes_as_grpo_does(tmp_path):
    """``OUTPUT_DIR/model`` (and each checkpoint's ``model/``) is the policy's own
    directory, safetensors and JSON, which ``FlowPolicy.from_pretrained`` loads; the
    summary has GRPO's and SFT's top-level keys, the flow results under ``results``."""
    from omni_rl.models.flow_policy import FlowPolicy

    cfg = _config(tmp_path, env={"num_envs": 8, "max_episode_steps": 12}, trainer={"steps": 2, "eval_episodes": 8})
    results = flow_ppo.train(cfg)
    out = tmp_path / "run"
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary) == {"step", "model", "data", "last_metrics", "results"} and summary["step"] == 2
    assert summary["results"] == results and results["success_rl"] == summary["last_metrics"]["eval/success"]
    # every key a step logs is listed in ``flow_ppo.METRICS``, or is the engine's or an episode's
    others = ("env/", "eval/", "time/", "optim/lr", "optim/schedule_step", "optim/skipped_nonfinite")
    logged = {k for k in summary["last_metrics"] if k != "step" and not k.startswith(others)}
    assert logged <= set(flow_ppo.METRICS), logged - set(flow_ppo.METRICS)
    assert sorted(p.name for p in (out / "model").iterdir()) == ["policy.json", "policy.safetensors"]
    assert (out / "model").resolve() == (out / "checkpoints" / "step-00000002" / "model").resolve()
    policy = FlowPolicy.from_pretrained(out / "model")
    assert policy.config == cfg.policy and (policy.backbone.obs_dim, policy.action_dim) == (6, 2)
    weights = load_file(out / "model" / "policy.safetensors")
    assert all(torch.equal(weights[k], v) for k, v in policy.state_dict().items())


def test_a_killed_run_resumes_to_the_uninterrupted_metrics(tmp_path):
    """SIGKILL after a checkpoint, ``--resume auto``: the same per-iteration metrics.

    Both runs are processes started alike, without the CPU-kernel pins an earlier test
    may have left in this process's environment: the comparison is exact, and a run
    under MKL_CBWR=AVX2 rounds its last digits differently from one without."""
    settings = {"trainer": {"steps": 30, "save_every": 1, "keep_last": 2, "eval_every": 10}}
    env = {k: v for k, v in os.environ.items() if k not in AVX2_KERNELS}

    def command_for(name: str) -> list[str]:
        path = tmp_path / f"{name}.yaml"
        save_config(_config(tmp_path / name, **settings), path)
        return [OMNI_RL, "train", str(path)]

    assert subprocess.run(command_for("a"), env=env, capture_output=True).returncode == 0
    want = (tmp_path / "a" / "run" / "metrics.jsonl").read_text().splitlines()

    command = command_for("b")
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while checkpoint.latest(tmp_path / "b" / "run") is None and time.monotonic() < deadline:
        time.sleep(0.01)
    process.send_signal(signal.SIGKILL)
    process.wait()
    killed_at = checkpoint.latest(tmp_path / "b" / "run")
    assert killed_at is not None and not killed_at.name.endswith("00000030"), "the run ended before the kill"
    assert subprocess.run([*command, "--resume", "auto"], env=env, capture_output=True).returncode == 0
    got = (tmp_path / "b" / "run" / "metrics.jsonl").read_text().splitlines()
    varying = ("time/", "throughput/")

    def values(lines):
        return [{k: v for k, v in json.loads(line).items() if not k.startswith(varying)} for line in lines]

    assert values(got) == values(want)
    assert json.loads((tmp_path / "b" / "run" / "summary.json").read_text())["results"]["success_bc"] == pytest.approx(
        json.loads((tmp_path / "a" / "run" / "summary.json").read_text())["results"]["success_bc"]
    )


@pytest.fixture(scope="module")
def one_process_run(tmp_path_factory, point_mass_demos):
    """A short run (BC, then PPO with evaluation) as one process: (config, output dir)."""
    root = tmp_path_factory.mktemp("one_process")
    cfg = _config(
        root,
        env={"num_envs": 8, "max_episode_steps": 12},
        policy={"width": 32},
        ppo={"epochs": 2, "minibatches": 3, "bc_coef": 0.5},  # 48 chunks: mini-batches of 16, split unevenly
        trainer={"steps": 3, "eval_every": 2, "eval_episodes": 10},  # 10 seeds: rounds of 8 and 2
        bc={"demos": str(point_mass_demos), "steps": 10, "batch_size": 15},  # 15 rows: 8 and 7
    )
    path = root / "config.yaml"
    save_config(cfg, path)
    _launch([sys.executable, "-m", "omni_rl"], path, root / "one", "auto")
    return path, root / "one"


def _launch(launcher: list[str], config: Path, out: Path, strategy: str) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMNI_RL_THREADS": "1"}
    command = [
        *launcher,
        "train",
        str(config),
        "--set",
        f"run.output_dir={out}",
        "--set",
        f"trainer.strategy={strategy}",
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    errors = [line for line in done.stderr.splitlines() if "it/s" not in line and "step/s" not in line]
    assert done.returncode == 0, "\n".join(errors[-60:])


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_processes_train_what_one_process_trains(tmp_path, one_process_run, strategy):
    """torchrun, 2 processes (gloo on CPU), each with half the envs and its share of
    every BC batch and PPO mini-batch: the same final weights and metrics as one."""
    config, one = one_process_run
    _launch([TORCHRUN, "--standalone", "--nproc-per-node=2", "-m", "omni_rl"], config, tmp_path / "two", strategy)
    weights = [
        load_file(run / "checkpoints" / "step-00000003" / "model" / "policy.safetensors")
        for run in (one, tmp_path / "two")
    ]
    assert weights[0].keys() == weights[1].keys()
    diff = max((weights[0][k] - weights[1][k]).abs().max().item() for k in weights[0])
    assert diff < 1e-5, diff

    def rows(run):
        lines = (run / "metrics.jsonl").read_text().splitlines()
        return [
            {k: v for k, v in json.loads(line).items() if not k.startswith(("time/", "throughput/"))} for line in lines
        ]

    want, got = rows(one), rows(tmp_path / "two")
    assert len(got) == len(want) == 4
    for row, expected in zip(got, want, strict=True):
        assert row == pytest.approx(expected, rel=1e-4, abs=1e-6)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_processes_under_bf16_mixed_score_what_the_rollout_sampled(tmp_path, strategy):
    """The first ratio is exactly 1 on two processes under bf16-mixed too (gloo on CPU,
    one mini-batch: the weights that score are the ones that sampled). FSDP2's root
    cast every float input of the forward to bf16, the stored fp32 chain among them:
    each step's log-density then read the rounded chain, ratio_max 1.25 before any
    update."""
    cfg = _config(
        tmp_path,
        ppo={"epochs": 1, "minibatches": 1},
        trainer={"steps": 1, "eval_episodes": 8, "precision": "bf16-mixed"},
    )
    path = tmp_path / "config.yaml"
    save_config(cfg, path)
    _launch([TORCHRUN, "--standalone", "--nproc-per-node=2", "-m", "omni_rl"], path, tmp_path / "two", strategy)
    row = json.loads((tmp_path / "two" / "metrics.jsonl").read_text().splitlines()[-1])
    assert row["loss/ratio_max"] == 1.0 and row["loss/ratio_mean"] == 1.0, row
    assert row["loss/approx_kl"] == 0.0


def test_the_critic_warms_up_alone_then_the_actor_learns(tmp_path):
    """``update`` without the actor leaves every actor weight as it was (the optimizer
    never sees an actor gradient) and moves the value head; with it, both move. In a
    run, the first ``ppo.critic_warmup`` iterations are the critic's."""
    cfg = _config(tmp_path, ppo={"critic_warmup": 2}, trainer={"steps": 3})
    run = flow_ppo.Run(tmp_path, flow_ppo.distributed.ranks(), torch.device("cpu"), None)
    env = PointMassEnv(cfg.env.num_envs, max_episode_steps=cfg.env.max_episode_steps)
    envs = flow_ppo.EnvShare.whole(env.num_envs)
    stream = flow_ppo.shared_stream(cfg)
    policy = flow_ppo.build_policy(cfg, env.obs_dim, env.action_dim, stream)
    engine = flow_ppo.make_engine(policy, cfg, run)
    flow_ppo.use_ppo_optimizer(engine, cfg)

    def snapshot(params):
        return [p.detach().clone() for p in params]

    for train_actor in (False, True):
        actor, critic = snapshot(policy.actor_parameters()), snapshot(policy.critic_parameters())
        obs = env.reset(seed=list(range(env.num_envs)))
        rollout, _ = flow_ppo.collect(policy, env, envs, obs, 12, stream, run.device)
        adv, returns = flow_ppo.advantages(rollout, cfg)
        flow_ppo.update(engine, rollout, adv, returns, cfg, envs, stream, train_actor)
        actor_moved = any(not torch.equal(a, b) for a, b in zip(actor, policy.actor_parameters(), strict=True))
        critic_moved = any(not torch.equal(a, b) for a, b in zip(critic, policy.critic_parameters(), strict=True))
        assert (actor_moved, critic_moved) == (train_actor, True)

    flow_ppo.train(cfg)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["update/actor_updated"] for r in rows[1:]] == [0.0, 0.0, 1.0]
    assert rows[1]["optim/actor_grad_norm"] == 0.0 and rows[3]["optim/actor_grad_norm"] > 0.0
    assert rows[1]["optim/critic_grad_norm"] > 0.0


def test_the_learning_rates_decay_over_the_run(tmp_path):
    """``ppo.lr_schedule`` moves the rates once per optimizer step (iterations x epochs
    x minibatches of them): the logged actor rate, that of each iteration's last
    optimizer step, falls to ``min_lr_ratio`` of its peak at the run's last step."""
    cfg = _config(
        tmp_path,
        ppo={"lr_schedule": "linear", "min_lr_ratio": 0.25, "minibatches": 2},
        trainer={"steps": 4},
    )
    flow_ppo.train(cfg)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    # each iteration's second step (0-based 1, 3, 5, 7 of 8) ran at 0.25 + 0.75 * (1 - s / 7)
    expected = [3e-4 * (0.25 + 0.75 * (1 - s / 7)) for s in (1, 3, 5, 7)]
    assert [r["optim/lr"] for r in rows[1:]] == pytest.approx(expected, rel=1e-6)


def test_target_kl_stops_an_iterations_passes_and_the_schedule_still_ends(tmp_path):
    """``ppo.target_kl``: after the first pass whose mean approximate KL exceeds it, the
    iteration's other passes are skipped and their steps still move the schedule to
    its end; a bound no pass reaches changes nothing."""

    def run(name, target_kl):
        ppo = {"epochs": 4, "minibatches": 2, "lr_schedule": "linear", "min_lr_ratio": 0.25, "target_kl": target_kl}
        flow_ppo.train(_config(tmp_path / name, ppo=ppo, trainer={"steps": 3}))
        rows = [json.loads(line) for line in (tmp_path / name / "run" / "metrics.jsonl").read_text().splitlines()]
        return [{k: v for k, v in r.items() if not k.startswith(("time/", "throughput/"))} for r in rows]

    stopped, loose, plain = run("stopped", 1e-9), run("loose", 1e3), run("plain", None)
    # the first pass's second mini-batch is scored after one step: its KL is above 1e-9
    assert [r["update/epochs"] for r in stopped[1:]] == [1, 1, 1]
    assert [r["update/epochs"] for r in plain[1:]] == [4, 4, 4]
    assert stopped[-1]["optim/schedule_step"] == plain[-1]["optim/schedule_step"] == 3 * 4 * 2
    # the rate of the last step taken: stopped, the last iteration's second (0-based 17
    # of 24); plain, the run's last, at the schedule's end
    assert stopped[-1]["optim/lr"] == pytest.approx(3e-4 * (0.25 + 0.75 * (1 - 17 / 23)))
    assert plain[-1]["optim/lr"] == pytest.approx(0.25 * 3e-4)
    assert stopped[1]["loss/approx_kl"] < plain[1]["loss/approx_kl"]
    assert loose == plain


def test_the_bc_anchor_adds_its_weight_times_the_cloning_gradient(tmp_path, point_mass_demos, monkeypatch):
    """``ppo.bc_coef``: each actor step's gradient is PPO's plus bc_coef times the
    gradient of the cloning loss on a global batch of demonstrations drawn from the
    stream after the mini-batch order, and the step logs that loss as ``loss/bc``."""
    bc = {"demos": str(point_mass_demos), "batch_size": 12}
    cfg = {"ppo": {"minibatches": 1, "actor_max_grad_norm": 0.0, "critic_max_grad_norm": 0.0}, "bc": bc}
    plain, anchored = _config(tmp_path, **cfg), _config(tmp_path, **{**cfg, "ppo": {**cfg["ppo"], "bc_coef": 2.5}})
    run = flow_ppo.Run(tmp_path, flow_ppo.distributed.ranks(), torch.device("cpu"), None)
    env = PointMassEnv(plain.env.num_envs, max_episode_steps=plain.env.max_episode_steps)
    envs = flow_ppo.EnvShare.whole(env.num_envs)
    stream = flow_ppo.shared_stream(plain)
    policy = flow_ppo.build_policy(plain, env.obs_dim, env.action_dim, stream)
    rollout, _ = flow_ppo.collect(policy, env, envs, env.reset(seed=list(range(env.num_envs))), 12, stream, run.device)
    adv, returns = flow_ppo.advantages(rollout, plain)
    demos = flow_ppo.load_demos(plain, policy.horizon, run.device)
    start = {k: v.clone() for k, v in policy.state_dict().items()}

    def gradient_and_metrics(cfg, state):
        policy.load_state_dict(start)
        engine = flow_ppo.make_engine(policy, cfg, run)
        flow_ppo.use_ppo_optimizer(engine, cfg)
        seen = []
        step = engine.step
        monkeypatch.setattr(engine, "step", lambda: seen.append([p.grad.clone() for p in engine.params]) or step())
        stream.set_state(state)
        metrics = flow_ppo.update(engine, rollout, adv, returns, cfg, envs, stream, True, demos)
        return seen[0], metrics

    state = stream.get_state()
    ppo_grad, plain_metrics = gradient_and_metrics(plain, state)
    both_grad, metrics = gradient_and_metrics(anchored, state)
    # by hand: the same draws after the mini-batch order, the cloning loss's own gradient
    policy.load_state_dict(start)
    engine = flow_ppo.make_engine(policy, plain, run)
    flow_ppo.use_ppo_optimizer(engine, plain)
    stream.set_state(state)
    torch.randperm(int(rollout.valid.sum()), generator=stream)  # the epoch's mini-batch order
    loss = flow_ppo.cloning_loss(engine, demos, 12, stream)
    loss.backward()
    bc_grad = [p.grad if p.grad is not None else torch.zeros_like(p) for p in engine.params]
    assert any(g.abs().sum() > 0 for g in bc_grad)
    for both, ppo, cloning in zip(both_grad, ppo_grad, bc_grad, strict=True):
        torch.testing.assert_close(both, ppo + 2.5 * cloning, rtol=1e-5, atol=1e-7)
    assert metrics["loss/bc"] == pytest.approx(loss.item(), rel=1e-6) and "loss/bc" not in plain_metrics
    assert metrics["loss/policy"] == pytest.approx(plain_metrics["loss/policy"], rel=1e-6)


def test_the_bc_anchor_needs_demonstrations(tmp_path):
    with pytest.raises(ConfigError, match=r"ppo\.bc_coef: needs bc\.demos"):
        _config(tmp_path, ppo={"bc_coef": 0.1})


def test_the_flow_sde_noise_level_anneals_over_the_run(tmp_path):
    """``policy.noise_level_end``: a moves linearly to it by the last iteration, and the
    update scores each rollout at the level that sampled it (one epoch of one
    mini-batch: every ratio is 1). Flow-Noise, which learns its noise, refuses the field."""
    policy = {"method": "flow_sde", "noise_level": 0.6, "noise_level_end": 0.3}
    cfg = _config(tmp_path, policy=policy, ppo={"minibatches": 1}, trainer={"steps": 4})
    flow_ppo.train(cfg)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["policy/noise_level"] for r in rows[1:]] == pytest.approx([0.6, 0.5, 0.4, 0.3])
    assert [r["loss/ratio_max"] for r in rows[1:]] == pytest.approx([1.0] * 4, abs=1e-4)
    with pytest.raises(ConfigError, match="noise_level_end"):
        _config(tmp_path, policy={"method": "flow_noise", "noise_level_end": 0.3})


@pytest.mark.parametrize(
    ("precision", "steps"),
    [("bf16-mixed", 4), ("fp32", 5)],
    ids=["bf16_mixed_cpu_autocast", "fp32_five_steps"],
)
@pytest.mark.parametrize("method", ["flow_noise", "flow_sde"])
def test_the_first_epoch_scores_what_the_rollout_sampled(tmp_path, precision, steps, method):
    """The update's first mini-batch sees the weights that sampled the rollout, so its
    ratio is exactly 1: under bf16-mixed (CPU autocast) sampling runs in bf16 as the
    update's forward does (sampling in fp32 gave ratios up to 1.039), and at K = 5 both
    read one fp32 time grid (``1 - k * delta`` from Python floats gave 1 + 2.9e-6)."""
    cfg = _config(
        tmp_path,
        policy={"denoise_steps": steps, "method": method},
        ppo={"epochs": 1, "minibatches": 1},
        trainer={"steps": 1, "eval_episodes": 8, "precision": precision},
    )
    flow_ppo.train(cfg)
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert row["loss/ratio_max"] == 1.0 and row["loss/ratio_mean"] == 1.0, row
    assert row["loss/approx_kl"] == 0.0


def test_actor_and_critic_gradients_clip_apart(tmp_path):
    """Each part's gradient norm is clipped to its own limit: the gradients the
    optimizer steps with have norm min(limit, norm before the clip) per part. The
    actor's (12.2 before) is cut to its 1e-3; the critic's (497, far above
    the actor's limit) stays whole under its 1e6, so a global clip fails this, and so
    does a clip that ignores its limit."""
    cfg = _config(tmp_path, ppo={"actor_max_grad_norm": 1e-3, "critic_max_grad_norm": 1e6})
    run = flow_ppo.Run(tmp_path, flow_ppo.distributed.ranks(), torch.device("cpu"), None)
    policy = flow_ppo.build_policy(cfg, 6, 2, flow_ppo.shared_stream(cfg))
    engine = flow_ppo.make_engine(policy, cfg, run)
    flow_ppo.use_ppo_optimizer(engine, cfg)
    g = torch.Generator().manual_seed(0)
    obs = torch.randn(4, 6, generator=g)
    every_step = torch.ones(4, policy.steps, dtype=torch.bool)
    _, _, value = policy.chain_logprob_value(obs, policy.sample(obs, generator=g).chain, every_step)
    logp, _, _ = policy.chain_logprob_value(obs, policy.sample(obs, generator=g).chain, every_step)
    engine.backward(-logp.sum() + 100.0 * value.sum())

    def norm(params) -> float:
        return torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params if p.grad is not None])).item()

    before = [norm(policy.actor_parameters()), norm(policy.critic_parameters())]
    stepped = []  # each optimizer group's gradient norm as the optimizer steps with it
    hook = engine.optimizer.register_step_pre_hook(
        lambda optimizer, args, kwargs: stepped.extend(norm(group["params"]) for group in optimizer.param_groups)
    )
    step = engine.step()
    hook.remove()
    assert before[0] > 1.0 and 100.0 < before[1] < 1e6, before
    assert step.group_norms == pytest.approx(before, rel=1e-5)
    assert step.grad_norm == pytest.approx(math.hypot(*step.group_norms), rel=1e-6)
    assert stepped == pytest.approx([min(1e-3, before[0]), min(1e6, before[1])], rel=1e-5)


def test_demos_that_share_held_out_seeds_are_refused(tmp_path):
    from omni_rl.errors import OmniRLError
    from omni_rl.sim.experts import Demos, check_demo_seeds, save_demos

    def demos_at(first: int, count: int) -> Path:
        path = tmp_path / f"demos_{first}.safetensors"
        tensors = {name: torch.zeros(1) for name in Demos.TENSORS}
        save_demos(Demos(**tensors, meta={"episode_seeds": [first, first + count]}), path)
        return path

    check_demo_seeds(demos_at(2_000_000, 100), eval_seed=1_000_000, eval_episodes=200)
    check_demo_seeds(demos_at(0, 100), eval_seed=1_000_000, eval_episodes=200)  # training seeds: no leak
    with pytest.raises(OmniRLError, match=r"demo seeds \[1000150, 1000250\) overlap the held-out seeds"):
        check_demo_seeds(demos_at(1_000_150, 100), eval_seed=1_000_000, eval_episodes=200)


# (sections, the refusal): each field set in a mode that never reads it
UNUSED_IN_MODE = {
    "logprob_per_element": (
        {"ppo": {"ratio": "element"}, "policy": {"logprob": "mean"}},
        r"policy\.logprob: .* ppo\.ratio: element",
    ),
    "hybrid_step_chain": (
        {"policy": {"method": "flow_sde", "sde_mode": "chain", "hybrid_step": "uniform"}},
        r"policy\.hybrid_step: .* sde_mode: chain",
    ),
    "sigma_min_flow_sde": (
        {"policy": {"method": "flow_sde", "sigma_min": 0.2}},
        r"policy\.sigma_min: .* method: flow_sde",
    ),
    "sigma_max_flow_sde": (
        {"policy": {"method": "flow_sde", "sigma_max": 0.4}},
        r"policy\.sigma_max: .* method: flow_sde",
    ),
    "noise_steps_flow_sde": (
        {"policy": {"method": "flow_sde", "noise_steps": "all"}},
        r"policy\.noise_steps: .* method: flow_sde",
    ),
    "noise_level_flow_noise": ({"policy": {"noise_level": 0.5}}, r"policy\.noise_level: .* method: flow_noise"),
    "sde_mode_flow_noise": ({"policy": {"sde_mode": "hybrid"}}, r"policy\.sde_mode: .* method: flow_noise"),
    "hybrid_step_flow_noise": ({"policy": {"hybrid_step": "last"}}, r"policy\.hybrid_step: .* method: flow_noise"),
    "entropy_coef_flow_sde": (
        {"policy": {"method": "flow_sde"}, "ppo": {"entropy_coef": 0.005}},
        r"ppo\.entropy_coef: .* policy\.method: flow_sde",
    ),
    "critic_fields_critic_free": (
        {"ppo": {"critic_free": True, "gamma": 0.95, "critic_lr": 1e-3}},
        r"ppo\.gamma: does nothing under critic_free: true \(no critic\), nor do critic_lr; remove them",
    ),
    "value_input_critic_free": (
        {"ppo": {"critic_free": True}, "policy": {"value_input": "obs"}},
        r"policy\.value_input: .* ppo\.critic_free: true",
    ),
    "group_size_with_critic": ({"ppo": {"group_size": 4}}, r"ppo\.group_size: .* critic_free: false"),
    "normalize_advantages_critic_free": (
        {"ppo": {"critic_free": True, "normalize_advantages": True}},
        r"ppo\.normalize_advantages: does nothing under critic_free: true \(the group advantages",
    ),
    "value_clip_scale_unclipped": (
        {"ppo": {"value_clip_scale": "absolute"}},
        r"ppo\.value_clip_scale: .* value_clip: null",
    ),
    "min_lr_ratio_constant": ({"ppo": {"min_lr_ratio": 0.1}}, r"ppo\.min_lr_ratio: .* lr_schedule: constant"),
    "trainer_grad_clip": (
        {"trainer": {"max_grad_norm": 0.5}},
        r"trainer\.max_grad_norm: does nothing in flow_ppo: ppo\.actor_max_grad_norm",
    ),
    "trainer_schedule": ({"trainer": {"schedule": "cosine"}}, r"trainer\.schedule: does nothing in flow_ppo"),
}


@pytest.mark.parametrize(("sections", "message"), UNUSED_IN_MODE.values(), ids=UNUSED_IN_MODE.keys())
def test_a_field_that_does_nothing_in_its_mode_is_refused(tmp_path, sections, message):
    """A field set where its mode never reads it is refused at load, naming the field
    and the mode (unset, each such field means its default in the mode it counts in)."""
    with pytest.raises(ConfigError, match=message):
        _config(tmp_path, **sections)


def test_critic_free_advantages_reach_the_loss_as_their_groups_gave_them(tmp_path, monkeypatch):
    """Each env's advantage is its return normalised within its group, 0 for a group of
    equal returns. Re-centring them over a mini-batch (whose episodes that succeed early
    hold fewer chunks, so its mean is not 0) gave such a group -mean/std: an all-failed
    group was pushed up. Critic-free advantages reach the loss as they are."""
    seen = []

    def spy(engine, b, adv, *rest):
        seen.append((b["adv"].clone(), adv.clone()))
        return real(engine, b, adv, *rest)

    real = flow_ppo.ppo_loss
    monkeypatch.setattr(flow_ppo, "ppo_loss", spy)
    flow_ppo.train(_config(tmp_path, ppo={"critic_free": True}, trainer={"steps": 2, "eval_episodes": 16}))
    assert len(seen) == 2 * 4  # 2 iterations of 4 mini-batches
    assert all(torch.equal(stored, used) for stored, used in seen)


def test_fields_left_unset_take_their_modes_defaults(tmp_path):
    from omni_rl.recipe_loader import load_config

    noise = flow_ppo.build_policy(_config(tmp_path), 6, 2, torch.Generator())
    assert (noise.sigma_min, noise.sigma_max, noise.noise_steps) == (0.2, 0.4, "all")
    sde = flow_ppo.build_policy(_config(tmp_path, policy={"method": "flow_sde"}), 6, 2, torch.Generator())
    assert (sde.noise_level, sde.sde_mode, sde.hybrid_step, sde.value_input) == (0.5, "hybrid", "last", "obs")
    cfg = _config(tmp_path, ppo={"critic_free": True})
    assert cfg.ppo.setting("group_size") == 4 and cfg.ppo.setting("gamma") == 0.95
    # the quickstart's composite config: a method switched on the command line is valid
    cfg = load_config(None, ["policy.method=flow_sde", "run.output_dir=x"], recipe="quickstart_sim")
    assert cfg.policy.sigma_min is None and cfg.ppo.setting("entropy_coef") == 0.005
    with pytest.raises(ConfigError, match=r"ppo\.entropy_coef: does nothing under policy\.method: flow_sde"):
        load_config(None, ["policy.method=flow_sde", "ppo.entropy_coef=0.01"], recipe="quickstart_sim")


def test_cloning_says_it_runs_bc_steps_whatever_trainer_steps_says(tmp_path, point_mass_demos, capsys):
    """``bc.steps`` counts cloning's optimizer steps and ``trainer.steps`` PPO's iterations:
    the line that starts cloning says both, so a short ``trainer.steps`` is not mistaken
    for a short run."""
    cfg = _config(tmp_path, bc={"demos": str(point_mass_demos), "steps": 3}, trainer={"steps": 1, "eval_episodes": 16})
    flow_ppo.train(cfg)
    err = capsys.readouterr().err
    said = "behaviour cloning: 3 optimizer steps (bc.steps, whatever trainer.steps says: its 1 are the PPO steps after"
    assert said in err, err
    assert (tmp_path / "run" / "bc" / "metrics.jsonl").read_text().count("\n") == 1  # its last step, 3


def test_a_demonstrations_file_takes_the_users_umask(tmp_path):
    """safetensors creates its file with mode 600; demonstrations are readable as every
    other output is (644 under umask 022, 640 under 027)."""
    from omni_rl.sim.experts import Demos, save_demos

    tensors = {name: torch.zeros(2, 1) for name in Demos.TENSORS}
    for umask, mode in ((0o022, 0o644), (0o027, 0o640)):
        previous = os.umask(umask)
        try:
            path = save_demos(Demos(**tensors, meta={}), tmp_path / f"demos_{umask:o}.safetensors")
        finally:
            os.umask(previous)
        assert path.stat().st_mode & 0o777 == mode, oct(path.stat().st_mode)


def test_the_largest_ratio_is_the_largest_of_the_steps_mini_batches():
    """``loss/ratio_max`` over an iteration's updates: the largest of them, not the
    mean of each update's largest (1.0, 1.1, 1.9 gave 1.333); the other diagnostics
    stay the mean over updates."""
    pairs = ((1.0, 1.0), (1.1, 1.05), (1.9, 1.2))  # (largest ratio, mean ratio) of each update
    records = [{"n": 4, "loss/ratio_max": m, "loss/ratio_mean": 4 * r} for m, r in pairs]
    out = flow_ppo.mean_diagnostics(records, [0.5, 0.5, 0.5])
    assert out["loss/ratio_max"] == 1.9
    assert out["loss/ratio_mean"] == pytest.approx((1.0 + 1.05 + 1.2) / 3)
    assert out["optim/grad_norm"] == pytest.approx(0.5)


def test_an_mlp_policy_on_an_image_env_is_refused(tmp_path):
    """An MLP actor read PixelTargets-v0's whole flat observation, the privileged point
    and goal the critic alone may see among it: ``env.blank_images`` was no blind
    control, since the goal came in as numbers. Refused, naming the policies that read
    the image and the instruction."""
    cfg = _config(tmp_path, env={"task": "PixelTargets-v0", "num_envs": 2})
    env = flow_ppo.make_env(cfg, EnvShare.whole(2))
    try:
        with pytest.raises(OmniRLError, match=r"policy.type mlp reads the whole observation.*pi0 or pi05"):
            flow_ppo.build_policy(cfg, env.obs_dim, env.action_dim, flow_ppo.shared_stream(cfg), env)
    finally:
        env.close()
