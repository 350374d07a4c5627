"""Peak memory per rank of a flow_ppo run with a pi0 or pi05 policy at its config's real sizes,
traced on fake tensors; ``tools/trace_memory.py`` runs it for a flow_ppo config:

    python tools/trace_memory.py CONFIG --world N [--model-config config.json] [--set a.b=c ...]
        [--demo-chunks M] [--json FILE]

The model (PI0 or PI05, ``policy.type``) is built from its architecture alone (``policy.path``'s config.json, else
``tools/model_configs/<name of policy.path>.json``, else ``--model-config``), loaded with
``chunk_size = policy.horizon`` as the recipe loads it, on fake CPU tensors (no weights,
no GPU); it joins a fake process group of N ranks and is wrapped by the recipe's own
engine (``flow_ppo.make_engine``: FSDP2 or DDP, the config's precision). Then rank 0 runs
the recipe's code, with the optimizer state of a run's second step on (AdamW's moments
exist):

- bc: one step of ``flow_ppo.behaviour_clone`` (``bc.batch_size / N`` rows; the VLM
  trains as ``policy.train_vlm`` says), its demonstrations (``--demo-chunks`` chunks,
  default 100 episodes of ``env.max_episode_steps``) on the device as the recipe puts them;
- rollout: ``omni_rl.sim.episodes.collect`` over this rank's ``env.num_envs / N`` envs for
  one episode's chunks, the prefix encoded once per chunk and every denoising step run;
- update: one epoch of ``flow_ppo.update`` (later epochs repeat its shapes): each
  mini-batch's forward, backward and optimizer step over the rank's share of the chunks.

What stands in for the real thing: the env answers with observations of its task's flat
layout (read from one CPU env of the task) and no values; the processor's host work
(resizing the image, tokenizing the instruction) is replaced by its output's shapes, from
the processor run once on a real image and the longest instruction (a released
checkpoint's processor at ``policy.path``, else the tiny models' byte-level one, whose
prompts run longer than SentencePiece's). The simulator's and renderer's own GPU memory
(ManiSkill's PhysX and camera buffers) is not traced. Memory is the trackers'
(``tools/trace_memory.py``): live tensor storage per rank by kind, before the CUDA
caching allocator's rounding. The last line is ``peak per rank = X GB`` (2**30 bytes).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import torch
import torch.distributed as dist
from fake_values import ROOT, KnownValues, TensorsFromTensors, eager_masks
from torch._subclasses.fake_tensor import FakeTensorMode
from torch_private import (
    Propagation,
    forget_module,
    in_backward,
    join_fake_process_group,
    module_tracking_without_cycles,
    no_dispatch,
    tolist_answered_by,
)
from trace_inputs import kernel_of, model_json
from trace_phases import Phases, phases_json, print_peak, print_phases, provenance, rank0_row, tracker_for

from omni_rl.models.flow_policy import backbone_class


@dataclasses.dataclass
class Pi0Setup:
    """What the trace builds the policy from."""

    cfg: object
    config: object
    """The PI0Config or PI05Config (chunk_size = policy.horizon)."""
    processor: object
    layout: object
    env_action_dim: int
    source: str
    world: int
    target: str
    """The device the config trains on: ``cuda`` or ``cpu``."""


def pi0_architecture(cfg, model_config: Path | None) -> tuple[object, object, str]:
    """(the PI0 or PI05 config, processor, where the config came from)."""
    import transformers
    from transformers import AutoProcessor

    backbone = backbone_class(cfg.policy.type, "policy.type")
    path = Path(cfg.policy.path or "")
    raw, model_config = model_json(str(path), model_config)
    config = getattr(transformers, backbone.CONFIG_CLASS)(**{**raw, "chunk_size": cfg.policy.horizon})
    if (path / "processor_config.json").is_file():
        processor = AutoProcessor.from_pretrained(path, local_files_only=True)
    else:
        processor = backbone.sized_processor(config, cfg.policy.horizon)
    source = model_config.resolve()
    return config, processor, str(source.relative_to(ROOT) if source.is_relative_to(ROOT) else source)


def env_layout(cfg) -> tuple[object, int]:
    """(FlatLayout, action numbers) of the config's task, from one CPU env of it."""
    from omni_rl.sim import make_vec_env

    e = cfg.env
    env = make_vec_env(e.task, 1, backend="cpu", seed=0, max_episode_steps=e.max_episode_steps, **e.options())
    try:
        return env.layout, env.action_dim
    finally:
        env.close()


def build_policy(setup: Pi0Setup, dtype: torch.dtype):
    """The recipe's VLA policy (``flow_ppo.vla_backbone``) on the meta device, in ``dtype``
    (no memory, no initialisation); ``to_empty`` under a fake mode gives it fake storage."""
    import transformers

    from omni_rl.models.flow_policy import FlowPolicy

    kind = backbone_class(setup.cfg.policy.type, "policy.type")
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = getattr(transformers, kind.MODEL_CLASS)(setup.config)
    finally:
        torch.set_default_dtype(default)
    with torch.device("meta"):
        backbone = kind(model, setup.processor, setup.layout, setup.env_action_dim)
        if setup.cfg.policy.vlm_lora is not None:
            backbone.add_vlm_lora(setup.cfg.policy.vlm_lora)
        backbone.train_vlm(False)
        return FlowPolicy(setup.cfg.policy, backbone)


def processed(setup: Pi0Setup, backbone):
    """The processor's output for one observation (real tensors), as ``backbone`` makes
    it: a blank image, the layout's longest instruction and a zero state (pi05 writes it
    into the prompt, three digits a number)."""
    layout = setup.layout
    image = torch.zeros(1, 3, layout.image_size, layout.image_size, dtype=torch.uint8)
    longest = max(layout.instructions, key=lambda s: len(setup.processor.tokenizer(s)["input_ids"]))
    return backbone.inputs(image, [longest], torch.zeros(1, layout.state_dim))


def fake_observations(one, values: KnownValues):
    """``Pi0Backbone.observation`` with the processor's host work replaced by its output:
    ``one`` repeated over the batch, on the batch's device; the token ids and masks keep
    their values (positions and padding steer the forward), the pixels and states none."""
    from omni_rl.models.pi0 import Pi0Observation

    def observation(self, obs):
        n, device = obs.shape[0], obs.device
        parts = {}
        for field in dataclasses.fields(Pi0Observation):
            real = getattr(one, field.name)
            if field.name == "privileged":
                parts[field.name] = obs[:, obs.shape[1] - self.layout.privileged_dim :]
                continue
            with no_dispatch():
                real = real.expand(n, *real.shape[1:]).contiguous()
            fake = torch.empty(real.shape, dtype=real.dtype, device=device)
            parts[field.name] = values.remember(fake, real) if real.dtype != torch.float32 else fake
        return Pi0Observation(**parts)

    return observation


class StubEnv:
    """N envs that answer any action with an observation of ``size`` numbers (no values),
    no reward and no termination; episodes are truncated after ``max_steps`` steps."""

    def __init__(self, n: int, size: int, max_steps: int, values: KnownValues):
        self.num_envs, self.device, self.size, self.max_steps = n, torch.device("cpu"), size, max_steps
        self.values, self.steps = values, 0

    def observe(self) -> torch.Tensor:
        return torch.empty(self.num_envs, self.size)

    def step(self, action):
        self.steps += 1
        with no_dispatch():  # real tensors, whatever modes are on
            real = {
                "done": torch.full((self.num_envs,), self.steps % self.max_steps == 0),
                "reward": torch.zeros(self.num_envs),
                "terminated": torch.zeros(self.num_envs, dtype=torch.bool),
            }
        known = {k: self.values.remember(torch.empty(v.shape, dtype=v.dtype), v) for k, v in real.items()}
        return SimpleNamespace(obs=self.observe(), final_obs=self.observe(), ended=None, **known)


def fake_demos(setup: Pi0Setup, chunks: int, values: KnownValues) -> tuple:
    """``flow_ppo.demo_chunks``' result for ``chunks`` chunks: observations (no values),
    actions (none) and a mask of real steps (every step real)."""
    horizon = setup.cfg.policy.horizon
    obs = torch.empty(chunks, setup.layout.size)
    actions = torch.empty(chunks, horizon, setup.env_action_dim)
    with no_dispatch():
        real = torch.ones(chunks, horizon, dtype=torch.bool)
    return obs, actions, values.remember(torch.empty(real.shape, dtype=torch.bool), real)


def seed_optimizer(engine, target: str) -> None:
    """The state a run carries from its second optimizer step on: AdamW's moments exist,
    stepped by the kernel the engine picks on ``target``."""
    kernel_of(engine.optimizer, target)
    for p in engine.params:
        p.grad = torch.zeros_like(p)
    engine.optimizer.step()
    engine.optimizer.zero_grad(set_to_none=True)


def trace(setup: Pi0Setup, demo_chunks: int) -> tuple[dict, dict]:
    """BC's step, the rollout and one PPO epoch on rank 0 of ``setup.world``, on fake CPU
    tensors; returns (phases by name, facts for the report)."""
    from omni_rl.engine import distributed
    from omni_rl.engine.engine import load_dtype
    from omni_rl.models.pi0 import Pi0Backbone
    from omni_rl.recipes import flow_ppo
    from omni_rl.sim.episodes import collect

    cfg, cpu, world = setup.cfg, torch.device("cpu"), setup.world
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    values = KnownValues(world)
    ranks = SimpleNamespace(distributed=world > 1, world_size=world, rank=0, is_main=False)
    run = SimpleNamespace(device=cpu, ranks=ranks)
    cloning = bool(cfg.bc.demos)
    policy = build_policy(setup, load_dtype(cfg.trainer.precision))
    with fake_mode:
        policy.to_empty(device=cpu)
    policy.backbone.train_vlm(flow_ppo.vlm_trains(cfg, "bc" if cloning else "ppo"))
    # outside the fake mode: FSDP2's device mesh reads the ranks' list, a real tensor
    engine = flow_ppo.make_engine(policy, cfg, run)
    envs = flow_ppo.env_share(cfg, run)
    chunks = math.ceil(cfg.env.max_episode_steps / policy.executed)
    info = {
        "params": sum(p.numel() for p in policy.parameters()),
        "strategy": engine.strategy,
        "envs": envs.count,
        "chunks": chunks,
        "prefix_tokens": int(processed(setup, policy.backbone).input_ids.shape[1]),
    }
    done: dict = {}
    phases = None
    label = "bc"
    step = engine.step

    def stepped():
        phases.enter(f"{label}/step")
        out = step()
        phases.enter(label)
        return out

    engine.step = stepped

    def forget_repeat(module, args):
        """The trackers take a second call of a module outside the root's forward for a
        new iteration and refuse it: each mini-batch calls the root, and sampling calls
        the model's parts once per denoising step. Only the global peak is read here."""
        if not in_backward(phases.tracker):
            forget_module(phases.tracker, module)

    def tracked(name: str):
        """The tracker of a phase's optimizer, its state seeded (outside the modes)."""
        nonlocal phases, label
        with fake_mode:
            seed_optimizer(engine, setup.target)
        tracker = tracker_for(policy, engine.optimizer, fsdp=engine.strategy == "fsdp")
        phases, label = Phases(tracker, "cpu (fake)"), name
        return tracker

    one = processed(setup, policy.backbone)

    @contextlib.contextmanager
    def recipe_code(tracker):
        """The modes and patches the recipe's code runs under, and ``tracker``."""
        with contextlib.ExitStack() as stack:
            stack.enter_context(fake_mode)
            stack.enter_context(values)
            stack.enter_context(TensorsFromTensors())
            stack.enter_context(eager_masks(values))
            stack.enter_context(tolist_answered_by(values.tolist))
            stack.enter_context(mock.patch.object(Pi0Backbone, "observation", fake_observations(one, values)))
            stack.callback(torch.nn.modules.module.register_module_forward_pre_hook(forget_repeat).remove)
            if world > 1:  # every rank holds rank 0's objects
                stack.enter_context(mock.patch.object(distributed, "mean_metrics", rank0_row))
                stack.enter_context(mock.patch.object(distributed, "gather_objects", lambda items: list(items) * world))
            stack.enter_context(module_tracking_without_cycles())
            stack.enter_context(tracker)
            stack.enter_context(Propagation.hidden())
            yield
        phases.close()
        done.update(phases.done)

    stream = torch.Generator().manual_seed(cfg.run.seed)
    if cloning:
        info["trainable_bc"] = sum(p.numel() for p in engine.params)
        one_step = dataclasses.replace(cfg, bc=dataclasses.replace(cfg.bc, steps=1))
        # the demonstrations are made where the recipe reads them, so that they count
        demos = mock.patch.object(flow_ppo, "demo_chunks", lambda *a: fake_demos(setup, demo_chunks, values))
        with recipe_code(tracked("bc")), demos:
            phases.enter("bc")
            on_device = flow_ppo.load_demos(one_step, policy.horizon, run.device)
            flow_ppo.behaviour_clone(engine, on_device, one_step, run, stream, SimpleNamespace(log=lambda row: None))
        with fake_mode:
            engine.reshard()
    policy.backbone.train_vlm(flow_ppo.vlm_trains(cfg, "ppo"))
    with fake_mode:
        flow_ppo.use_ppo_optimizer(engine, cfg)
    info["trainable_ppo"] = sum(p.numel() for p in engine.params)
    policy.noise_level = flow_ppo.noise_level_at(0, cfg)
    env = StubEnv(envs.count, setup.layout.size, cfg.env.max_episode_steps, values)
    one_epoch = dataclasses.replace(cfg, ppo=dataclasses.replace(cfg.ppo, epochs=1))
    with recipe_code(tracked("update")):
        phases.enter("rollout")
        with engine.forward_context():
            rollout, _ = collect(policy, env, envs, env.observe(), chunks, stream, cpu)
        phases.enter("update")
        adv, returns = flow_ppo.advantages(rollout, cfg)
        flow_ppo.update(engine, rollout, adv, returns, one_epoch, envs, stream)
    del engine.step
    info["unknown_reads"] = dict(values.unknown_reads)
    return done, info


def print_report(setup: Pi0Setup, phases: dict, info: dict, seconds: float) -> None:
    cfg, p = setup.cfg, setup.cfg.policy
    print(f"provenance: {provenance()}")
    family = type(setup.config).__name__.removesuffix("Config")
    print(f"model: {family} from {setup.source}, {info['params'] / 1e9:.2f} B parameters (heads included)")
    print(
        f"world {setup.world} ({info['strategy']}), precision {cfg.trainer.precision}; trains: "
        + (f"bc {info['trainable_bc'] / 1e9:.2f} B, " if "trainable_bc" in info else "")
        + f"ppo {info['trainable_ppo'] / 1e9:.2f} B parameters"
    )
    chunks_per_rank = info["envs"] * info["chunks"]
    print(
        f"per rank: {info['envs']} envs x {info['chunks']} chunks (horizon {p.horizon}, executed {p.executed}, "
        f"{p.denoise_steps} denoising steps), prefix {info['prefix_tokens']} tokens with a "
        f"{setup.layout.image_size}x{setup.layout.image_size} image; PPO mini-batches of about "
        f"{math.ceil(chunks_per_rank / cfg.ppo.minibatches)} chunks; BC "
        f"{cfg.bc.batch_size // setup.world} rows"
    )
    print_phases(phases)
    if info["unknown_reads"]:
        print(f"\nvalues read that no input determines (read as 0): {sum(info['unknown_reads'].values())}")
    print(f"\ntraced in {seconds:.0f} s on fake tensors (no weights, no GPU); the simulator's own memory not included")
    print_peak(phases)


def main(cfg, args) -> None:
    """``tools/trace_memory.py``'s entry for a flow_ppo config (its parsed ``args``)."""
    from omni_rl.engine.engine import resolve_precision

    started = time.perf_counter()
    if not cfg.policy.vla:
        raise SystemExit("tools/trace_memory.py traces flow_ppo configs with policy.type pi0 or pi05 (an MLP is small)")
    world = args.world or 8
    strategy = cfg.trainer.strategy
    if world > 1 and strategy != "fsdp":
        raise SystemExit(f"{world} ranks: FSDP2 only (DDP needs a real process group): --set trainer.strategy=fsdp")
    if world == 1 and strategy not in ("single", "auto"):
        raise SystemExit("one rank: --set trainer.strategy=single (as a one-process run needs)")
    target = args.device or ("cuda" if cfg.run.device == "cuda" else "cpu")
    trainer = dataclasses.replace(cfg.trainer, precision=resolve_precision(cfg.trainer.precision, torch.device(target)))
    cfg = dataclasses.replace(cfg, trainer=trainer)
    config, processor, source = pi0_architecture(cfg, args.model_config)
    layout, action_dim = env_layout(cfg)
    setup = Pi0Setup(cfg, config, processor, layout, action_dim, source, world, target)
    if world > 1:
        join_fake_process_group(world)
    demo_chunks = args.demo_chunks or 100 * cfg.env.max_episode_steps
    phases, info = trace(setup, demo_chunks)
    print_report(setup, phases, info, time.perf_counter() - started)
    if args.json:
        figures = {
            "provenance": provenance(),
            "world": world,
            "phases": phases_json(phases),
            "info": {k: v for k, v in info.items() if k != "unknown_reads"},
        }
        args.json.write_text(json.dumps(figures, indent=1, default=str) + "\n")
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
