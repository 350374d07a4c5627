"""Peak memory per rank of one GRPO step at a config's real sizes, traced on fake tensors.

    python tools/trace_memory.py CONFIG --world N [--model-config config.json]
        [--prompt-tokens P] [--decode-steps K] [--set a.b=c ...] [--checks fail|warn|off]

(A flow_ppo config with a pi0 policy goes to ``tools/trace_flow.py``.)

No weights, no GPU. The trace joins a fake process group of N ranks and loads the model
as the recipe does (``setup_model``, then the engine's FSDP2 wrapping and fill) from a
directory holding its architecture (``model.path``'s config.json, else
``tools/model_configs/<name>.json``, else ``--model-config``). Under ``FakeTensorMode``
only the two steps that read weights are answered here (``load_models``, ``filled``).
Then the real code of one step runs as rank 0 runs it: ``HFRolloutEngine.rollout`` on
this rank's prompts (prefill and K decode steps; later steps repeat the shapes; the
prefill's activations held through them where GRPO's update reads that prefill,
``rollout.reuse_prefill``: one process without checkpointing), and
``omni_rl.recipes.grpo._update`` with every completion ``rollout.max_new_tokens`` long
(old and reference log-probs where needed, each micro-batch's forward and backward,
each optimizer step). The prompt is a 16:9 video of the media budgets' most frames
(``prompt``; other aspect ratios under the same budgets give up to 6% more video
tokens), or ``--prompt-tokens``; a rank's later prompts are a token shorter, so its batch is padded.
Rank 0 stands for every rank: collectives answer as if all ranks held its values.

The small tensors a forward steers by keep their values (``fake_values``). Memory is
``FSDPMemTracker`` (``MemTracker`` without FSDP2): live tensor storage per rank, by kind,
at each phase's peak, with the module running and the line that issued the allocation;
the optimizer state exists from the start (step 2 on), and the CUDA caching allocator's
rounding comes on top. FSDP2 needs CUDA streams, so the sharded trace runs on fake CPU
tensors; where the config trains on CUDA, a second pass runs the rollout and the
update's forwards on fake CUDA tensors, unsharded, in the compute dtype, under the
checks of ``trace_checks`` (``--checks fail``, the default, exits non-zero on a finding
that is neither deliberate nor inside transformers). The last line is ``peak per rank =
X GB`` (GB: 2**30 bytes) of the heaviest phase.

This file is the GRPO step and the command; beside it, one job each: ``trace_inputs``
(the model and the prompt), ``fake_values`` (values under fake tensors),
``trace_phases`` (the tracker and the table), ``trace_checks`` (the checks), and
``torch_private`` (every private PyTorch interface, each tested by name).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist
from fake_values import (
    KnownValues,
    TensorsFromTensors,
    eager_masks,
    fake_copy,
    merge_windows,
)
from torch._subclasses.fake_tensor import FakeTensorMode
from torch_private import (
    Propagation,
    forget_module,
    join_fake_process_group,
    memory_events,
    module_tracking_without_cycles,
    no_dispatch,
    tolist_answered_by,
    track_frozen_shards,
    tree_map_only,
)
from trace_checks import Checks, GpuAttention, classify, failures, print_checks
from trace_inputs import Architecture, architecture, filled, kernel_of, load_models, prompt
from trace_phases import T0, Phase, Phases, phases_json, print_peak, print_phases, provenance, rank0_row, tracker_for


def real_copy(encoded: dict) -> dict:
    """``encoded`` copied (inside the tracker, which then counts it as the fake copy is)."""
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in encoded.items()}


class StopDecode(Exception):
    """Raised before decode step K+1: the loop's later steps repeat the same shapes."""


def mark_phases(model, reference, engine, phases: Phases | None, checks: Checks | None, decode_steps: int) -> Callable:
    """Hooks that name the phase each forward belongs to and stop the decode loop after
    ``decode_steps`` steps; returns a function that removes them."""
    from omni_rl.models.shared_prefix import ReadPrefix

    decoded = 0
    enter = phases.enter if phases is not None else lambda name: None

    def policy(module, args, kwargs):
        nonlocal decoded
        if isinstance(kwargs.get("shared_prefix"), ReadPrefix) and kwargs.get("use_cache"):
            if decoded == decode_steps:
                raise StopDecode
            decoded += 1
            enter("rollout/decode")
            if checks is not None:
                checks.decode_step()
        elif not module.training or kwargs.get("use_cache"):
            enter("rollout/prefill")
        else:
            enter("update" if torch.is_grad_enabled() else "old_logprobs")

    handles = [model.register_forward_pre_hook(policy, prepend=True, with_kwargs=True)]
    if reference is not None:
        handles.append(reference.register_forward_pre_hook(lambda *_: enter("ref_logprobs"), prepend=True))
    if engine is not None:
        step = engine.step

        def stepped():
            phases.enter("step")
            out = step()
            phases.close()
            return out

        engine.step = stepped

    def remove():
        for handle in handles:
            handle.remove()
        if engine is not None:
            del engine.step
        if checks is not None:
            checks.end_decode()

    return remove


def rollout_phase(model, arch, batch, cfg, keep_prefill: bool = False):
    """This rank's prompts through ``HFRolloutEngine.rollout`` until ``StopDecode``;
    ``keep_prefill``: the prefill made under autograd and held through the decoding, as
    GRPO has it where its update reads it (``rollout.reuse_prefill``)."""
    from omni_rl.rollout.hf import HFRolloutEngine, SamplingParams

    engine = HFRolloutEngine(model, arch.processor, cfg.rollout.gather_once)
    engine.keep_prefill = keep_prefill
    r = cfg.rollout
    sampling = SamplingParams(r.temperature, r.top_p, r.top_k, r.max_new_tokens)
    with contextlib.suppress(StopDecode):
        engine.rollout(batch.samples, batch.encoded, r.n, sampling, batch.seeds)
    return engine


def full_length_rollouts(batch, cfg, pad_id: int, device, known: KnownValues | None):
    """G completions per prompt, each ``rollout.max_new_tokens`` long (the longest the
    update can meet), as ``omni_rl.rollout.hf.Rollouts``; returns (rollouts, mask, advantages)."""
    from omni_rl.rollout.hf import Rollouts

    rows, width = len(batch.samples) * cfg.rollout.n, cfg.rollout.max_new_tokens
    with no_dispatch():  # real tensors, whatever modes are on
        generator = torch.Generator().manual_seed(0)
        real = {
            "ids": torch.randint(3, 200, (rows, width), generator=generator),
            "mask": torch.ones(rows, width, dtype=torch.long),
            "logprobs": torch.full((rows, width), -1.0),
            "lengths": torch.full((rows,), width),
            "advantages": torch.randn(rows, generator=generator).sign(),
        }
    if known is None:
        t = {k: v.to(device) for k, v in real.items()}
    else:
        t = {k: known.fake_of(v, device) for k, v in real.items()}
    rollouts = Rollouts(t["ids"], t["mask"], t["logprobs"], t["lengths"], ["length"] * rows, [""] * rows, cfg.rollout.n)
    return rollouts, t["mask"], t["advantages"]


# ------------------------------------------------------------------------------- the passes


@dataclasses.dataclass
class Setup:
    """What both passes share."""

    cfg: object
    trainer: object
    arch: Architecture
    sample: object
    encoded: dict
    world: int
    decode_steps: int
    target: str
    """The device the config trains on (cuda or cpu)."""
    ragged: bool = True
    """The rank's prompts differ in length (padding, as in a real batch)."""

    @property
    def precision(self) -> str:
        return self.trainer.precision

    @property
    def bf16(self) -> bool:
        return self.precision in ("bf16-mixed", "bf16-pure")

    @property
    def prompts(self) -> int:
        """This rank's prompts per step."""
        return self.cfg.data.prompts_per_step // self.world

    def batch(self, copy: Callable[[dict], dict]):
        """This rank's prompts as ``omni_rl.recipes.grpo.Batch``, each its own ``copy`` of
        the encoded prompt (its own media); the second and later ones a token shorter (their
        first token left out), so the batch is padded as a real one is."""
        from omni_rl.models.inputs import TOKEN_KEYS
        from omni_rl.recipes import grpo

        encoded = []
        for i in range(self.prompts):
            with no_dispatch():  # the real tensors, whatever modes are on
                shorter = {k: v[:, 1:] if k in TOKEN_KEYS and i and self.ragged else v for k, v in self.encoded.items()}
            encoded.append(copy(shorter))
        seeds = [grpo.prompt_seed(self.cfg.run.seed, i, self.cfg.rollout.n) for i in range(self.prompts)]
        return grpo.Batch([self.sample] * self.prompts, encoded, seeds, list(range(self.prompts)))

    def kept(self):
        from omni_rl.models import placeholder_token_ids
        from omni_rl.models.forward import SamplingFilter

        r = self.cfg.rollout
        return SamplingFilter(tuple(placeholder_token_ids(self.arch.processor)), r.top_k, r.top_p)


def memory_pass(setup: Setup, fake: bool, checks_on: bool) -> tuple[dict[str, Phase], Checks | None, dict]:
    """The sharded trace: the step on rank 0 of ``setup.world`` under the engine's wrapping,
    on fake CPU tensors (``fake``) or real ones (tiny models: to check the trace)."""
    from omni_rl.engine import distributed
    from omni_rl.engine.engine import TrainingEngine
    from omni_rl.recipes import grpo

    cfg, cpu = setup.cfg, torch.device("cpu")
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext()
    values = KnownValues(setup.world) if fake else None
    checks = Checks(values, cuda=False, bf16=setup.bf16) if fake and checks_on else None
    info = {}
    model, reference = load_models(cfg, setup.trainer, setup.arch, cpu, fake_mode, setup.world)
    # outside the fake mode: FSDP2's device mesh reads the ranks' list, a real tensor
    total = cfg.trainer.steps * grpo._updates_per_step(cfg)
    with filled(fake_mode):
        engine = TrainingEngine.from_config(model, setup.trainer, cfg.optimizer, cpu, total)
        if reference is not None:
            reference = engine.wrap_frozen(reference)
    with fake_mode:
        kernel_of(engine.optimizer, setup.target)
        # the state a run carries from its second step on: AdamW's moments exist
        for p in engine.params:
            p.grad = torch.zeros_like(p)
        engine.optimizer.step()
        engine.optimizer.zero_grad(set_to_none=True)
        info["params"] = sum(p.numel() for p in model.parameters())
        info["strategy"] = engine.strategy
        tracker = tracker_for(model, engine.optimizer, fsdp=engine.strategy == "fsdp")
        if reference is not None and engine.strategy == "fsdp":  # the frozen reference's shards
            track_frozen_shards(tracker, reference.parameters())
        elif reference is not None:
            tracker.track_external(reference)
    device = "cpu (fake)" if fake else "cpu"
    phases = Phases(tracker, device, marks=not fake)
    profiler = None
    with contextlib.ExitStack() as stack:
        if not fake:  # the allocator's own account of every allocation, to check the tracker by
            activities = [torch.profiler.ProfilerActivity.CPU]
            profiler = stack.enter_context(torch.profiler.profile(activities=activities, profile_memory=True))
        stack.enter_context(fake_mode)
        for mode in (values, checks):
            if mode is not None:
                stack.enter_context(mode)
        if fake:
            stack.enter_context(TensorsFromTensors())
            stack.enter_context(eager_masks(values))
            for m in (model, reference):
                if m is not None:
                    stack.callback(merge_windows(m))
            stack.enter_context(tolist_answered_by(values.tolist))
        # the trackers take a second call of the root module for a new iteration and refuse it;
        # the shared-prefix forward calls it twice per micro-batch (prompt, then completions)
        roots = [m for m in (model, reference) if m is not None]

        def forget_root(module, args):
            if any(module is root for root in roots):
                forget_module(tracker, module)

        stack.callback(torch.nn.modules.module.register_module_forward_pre_hook(forget_root).remove)
        stack.enter_context(module_tracking_without_cycles())
        stack.enter_context(tracker)
        stack.enter_context(Propagation.hidden())
        if setup.world > 1:
            stack.enter_context(mock.patch.object(distributed, "mean_metrics", rank0_row))
        batch = setup.batch((lambda e: fake_copy(e, values)) if fake else real_copy)
        remove = mark_phases(engine.model, reference, engine, phases, checks, setup.decode_steps)
        rollout_phase(engine.module, setup.arch, batch, cfg, grpo._prefill_blocker(cfg, engine) is None)
        phases.close()
        if checks is not None:
            checks.end_decode()
        pad = setup.arch.processor.tokenizer.pad_token_id
        rollouts, mask, advantages = full_length_rollouts(batch, cfg, pad, cpu, values)
        grpo._update(engine, reference, batch, rollouts, mask, advantages, pad, cfg, True, setup.kept())
        phases.close()
        remove()
    if values is not None:
        info["unknown_reads"] = dict(values.unknown_reads)
    if profiler is not None:
        info["allocator_rise"] = allocator_rises(profiler)
    return phases.done, checks, info


def allocator_rises(profiler) -> dict[str, int]:
    """Per phase, the most bytes the CPU allocator handed out above what it held when
    the phase began (the profiler's memory events, within each phase's range)."""
    allocations, ranges = memory_events(profiler, "phase:")
    rises: dict[str, int] = {}
    for name, begin, end in ranges:
        held = sum(n for t, n in allocations if t < begin)
        live = peak = held
        for t, n in allocations:
            if begin <= t <= end:
                live += n
                peak = max(peak, live)
        rises[name] = max(rises.get(name, 0), peak - held)
    return rises


def check_pass(setup: Setup) -> Checks:
    """The rollout and the update's forwards on fake CUDA tensors, unsharded, for the device,
    dtype and synchronisation checks. The weights are in the dtype FSDP2's mixed precision
    gathers them in, and a root hook casts floating inputs to it as FSDP2 does; collectives
    take CUDA tensors, as over NCCL. No backward: autograd needs a CUDA context for it."""
    from omni_rl.algorithms.losses import clipped_policy_loss
    from omni_rl.engine import distributed
    from omni_rl.recipes import grpo

    cfg, cuda = setup.cfg, torch.device("cuda")
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    values = KnownValues(setup.world)
    checks = Checks(values, cuda=True, bf16=setup.bf16)
    compute = torch.bfloat16 if setup.bf16 else torch.float32
    model, _ = load_models(cfg, setup.trainer, setup.arch, cuda, fake_mode, world=1)
    with fake_mode:
        for p in model.parameters():
            p.data = p.data.to(compute)

    def cast_inputs(module, args, kwargs):
        def cast(t):
            return t.to(compute) if t.is_floating_point() else t

        return tree_map_only(torch.Tensor, cast, (args, kwargs))

    model.register_forward_pre_hook(cast_inputs, with_kwargs=True)
    with contextlib.ExitStack() as stack:
        for context in (fake_mode, values, checks):
            stack.enter_context(context)
        stack.enter_context(TensorsFromTensors())
        stack.enter_context(GpuAttention())
        stack.enter_context(eager_masks(values))
        stack.callback(merge_windows(model))
        stack.enter_context(tolist_answered_by(values.tolist))
        stack.enter_context(mock.patch.object(distributed, "_device", lambda: cuda))
        batch = setup.batch(lambda e: fake_copy(e, values))
        remove = mark_phases(model, None, None, None, checks, setup.decode_steps)
        rollout_phase(model, setup.arch, batch, cfg)
        checks.end_decode()
        pad = setup.arch.processor.tokenizer.pad_token_id
        rollouts, mask, advantages = full_length_rollouts(batch, cfg, pad, cuda, values)
        ids, n = rollouts.completion_ids, cfg.rollout.n
        with torch.no_grad():
            grpo._logprobs(model, batch, [0], ids, mask, pad, cfg, kept=setup.kept())
        out = grpo._logprobs(model, batch, [0], ids, mask, pad, cfg, "metric")
        width = out.logp.shape[1]
        clipped_policy_loss(out.logp, out.logp.detach(), advantages[:n], mask[:n, :width])
        remove()
    return checks


# ------------------------------------------------------------------------------ the report


def print_report(setup: Setup, phases: dict[str, Phase], checks: list[Checks], info: dict, seconds: float) -> None:
    cfg = setup.cfg
    tokens = setup.encoded["input_ids"].shape[1]
    media = {k: list(v.shape) for k, v in setup.encoded.items() if k in ("pixel_values_videos", "input_features")}
    print(f"provenance: {provenance()}")
    name = type(setup.arch.config).__name__
    print(f"model: {name} from {setup.arch.source}, {info['params'] / 1e9:.2f} B parameters")
    print(
        f"world {setup.world} ({info['strategy']}), precision {setup.precision}, "
        f"gradient checkpointing {'on' if cfg.model.gradient_checkpointing else 'off'}, "
        f"trained on {setup.target}"
    )
    print(
        f"per rank: {setup.prompts} prompt(s) of {tokens} tokens {media or ''} "
        f"(rollout.max_prompt_length {cfg.rollout.max_prompt_length}), G = {cfg.rollout.n} completions of "
        f"{cfg.rollout.max_new_tokens} tokens, micro-batch {cfg.trainer.micro_batch_size or 'all'} prompt(s), "
        f"{setup.decode_steps} decode step(s) traced"
    )
    print_phases(phases)
    for c in checks:
        print_checks(c)
    print(f"\ntraced in {seconds:.0f} s on fake tensors (no weights, no GPU)")
    print_peak(phases)


def as_json(setup: Setup, phases: dict[str, Phase], checks: list[Checks], info: dict) -> dict:
    return {
        "provenance": provenance(),
        "world": setup.world,
        "prompt_tokens": int(setup.encoded["input_ids"].shape[1]),
        "phases": phases_json(phases),
        "findings": [{**dataclasses.asdict(f), "class": classify(f)} for c in checks for f in c.findings],
        "info": {k: v for k, v in info.items() if k != "unknown_reads"},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", type=Path)
    parser.add_argument("--world", type=int, default=None, help="ranks (default: 8, or 1 for a tiny model)")
    parser.add_argument("--model-config", type=Path, help="the model's config.json (architecture only)")
    parser.add_argument("--prompt-tokens", type=int, help="prompt length in tokens (default: the media budgets')")
    parser.add_argument("--decode-steps", type=int, default=2, help="decode steps traced")
    parser.add_argument("--set", action="append", default=[], metavar="A.B=C", help="config override")
    parser.add_argument("--device", choices=("cuda", "cpu"), help="the device it trains on (default: run.device)")
    parser.add_argument("--checks", choices=("fail", "warn", "off"), default="fail")
    parser.add_argument("--real", action="store_true", help="real tensors on the CPU (tiny models: checks the trace)")
    parser.add_argument("--same-length", action="store_true", help="a rank's prompts all of one length (no padding)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--demo-chunks", type=int, help="flow_ppo: demonstration chunks (default: 100 episodes)")
    args = parser.parse_args()

    import tempfile

    from omni_rl.engine.engine import resolve_precision, resolve_strategy
    from omni_rl.recipe_loader import load_config
    from omni_rl.recipes.flow_ppo_config import FlowPPOConfig

    torch.set_num_threads(args.threads)
    # the decode loop stops by an exception raised in the root's pre-forward hook: the
    # trackers' post-forward hooks then see a forward that did not run, and say so
    warnings.filterwarnings("ignore", message="module forward hook with ``always_call=True``")
    started = time.perf_counter()
    cfg = load_config(args.config, args.set)
    if isinstance(cfg, FlowPPOConfig):  # a pi0 policy's run: tools/trace_flow.py
        import trace_flow

        trace_flow.main(cfg, args)
        return
    world = args.world or (8 if cfg.model.path else 1)
    target = args.device or ("cuda" if cfg.run.device == "cuda" else "cpu")
    trainer = dataclasses.replace(cfg.trainer, precision=resolve_precision(cfg.trainer.precision, torch.device(target)))
    if cfg.data.prompts_per_step % world:
        raise SystemExit(f"data.prompts_per_step={cfg.data.prompts_per_step} does not divide among {world} ranks")
    if resolve_strategy(trainer.strategy, world, in_group=True) != "single":  # the fake group it joins next
        join_fake_process_group(world)
    if cfg.model.lora is not None:
        raise SystemExit("model.lora: the trace covers full fine-tunes only")
    with tempfile.TemporaryDirectory() as work:
        arch = architecture(cfg, args.model_config, Path(work))
        sample, encoded = prompt(cfg, arch, args.prompt_tokens)
        tokens = encoded["input_ids"].shape[1]
        print(f"[trace] prompt of {tokens} tokens at {time.perf_counter() - T0:.0f} s", file=sys.stderr)
        setup = Setup(cfg, trainer, arch, sample, encoded, world, args.decode_steps, target, not args.same_length)
        checks_on = args.checks != "off" and not args.real
        phases, memory_checks, info = memory_pass(setup, fake=not args.real, checks_on=checks_on)
        checks = [c for c in (memory_checks,) if c is not None]
        if checks_on and target == "cuda":
            checks.append(check_pass(setup))
    print_report(setup, phases, checks, info, time.perf_counter() - started)
    if args.json:
        args.json.write_text(json.dumps(as_json(setup, phases, checks, info), indent=1, default=str) + "\n")
    if dist.is_initialized():
        dist.destroy_process_group()
    found = sum(len(failures(c)) for c in checks)
    if found and args.checks == "fail":
        print(f"{found} check finding(s) (listed above); --checks warn reports them without failing", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
