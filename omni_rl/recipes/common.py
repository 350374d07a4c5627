"""Pieces every training recipe shares: run setup (processes, device, seeds), model and
data setup, phase timers and the metrics log. The loops themselves stay in their recipe
files; optimizing goes through ``omni_rl.engine``."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from omni_rl.config import save_config
from omni_rl.engine import checkpoint, distributed
from omni_rl.engine.distributed import Ranks
from omni_rl.engine.engine import load_dtype, resolve_precision, resolve_strategy
from omni_rl.errors import OmniRLError
from omni_rl.runtime import apply_run_settings, resolve_device, seed_everything

_log = logging.getLogger(__name__)


@dataclass
class Run:
    """Where a run writes, which process this is, and what it resumes from."""

    out: Path
    ranks: Ranks
    device: torch.device
    resume_from: Path | None


def start_run(cfg, resume: str | None, rollout_processes: int = 0) -> Run:
    """Join the torchrun process group (if any), pick this rank's device, create the
    output directory and write the resolved config (rank 0), pin threads, seed (each
    rank its own stream), and find the checkpoint to resume from ('auto': the newest
    complete one, passing over damaged ones with a line each; or a path). A damaged
    checkpoint, or one written by another process count, is refused here.
    ``rollout_processes``: 1 makes the last process a rollout process
    (``distributed.init``), whose ``Run`` has ``ranks.rollout_process`` set."""
    device = resolve_device(cfg.run.device)
    ranks = distributed.init(device.type, cfg.trainer.dist_timeout_minutes, rollout_processes)
    if device.type == "cuda":
        device = torch.device("cuda", distributed.device_index(ranks.local_rank))
    out = Path(cfg.run.output_dir)
    previous = RUN_FILES & {p.name for p in out.iterdir()} if out.is_dir() else set()
    if previous and not resume:
        if not cfg.run.overwrite:
            raise OmniRLError(
                f"{out} holds a run ({', '.join(sorted(previous))}): continue it with --resume auto, start afresh "
                "with --overwrite (deletes them), or set another run.output_dir"
            )
        distributed.barrier()
        if ranks.is_main:
            clear_run(out)
    if ranks.is_main:
        out.mkdir(parents=True, exist_ok=True)
        save_config(cfg, out / "config.yaml")
    distributed.barrier()
    apply_run_settings(cfg.run)
    seed_everything(cfg.run.seed + ranks.rank)
    resume_from = None
    if resume == "auto":
        resume_from, passed = checkpoint.newest_complete(out)
        for problem in passed:
            say(ranks, f"passing over a damaged checkpoint: {problem}")
        if resume_from is None and passed:
            raise OmniRLError(
                f"{out / 'checkpoints'}: no complete checkpoint to resume from (the lines above say why); "
                "start afresh with --overwrite, or give --resume PATH"
            )
        if resume_from is None:
            say(ranks, f"nothing to resume in {out}: starting at step 0")
        else:
            say(ranks, f"resuming from {resume_from}" + (" (the newest complete checkpoint)" if passed else ""))
    elif resume:
        resume_from = Path(resume)
        if not (resume_from / "state.json").is_file():
            raise OmniRLError(f"{resume_from}: not a checkpoint (no state.json)")
        checkpoint.check_complete(resume_from)
        say(ranks, f"resuming from {resume_from}")
    if resume_from is not None and not ranks.rollout_process:
        checkpoint.check_world_size(resume_from, ranks.world_size)
    say(ranks, f"writing to {out} (config.yaml, metrics.jsonl, checkpoints/)")
    return Run(out, ranks, device, resume_from)


# what a training run writes into its output_dir (a rerun without --resume refuses them)
RUN_FILES = {
    "metrics.jsonl",
    "checkpoints",
    "tensorboard",
    "eval",
    "best",
    "model",
    "summary.json",
    "wandb",
    "wandb_run_id",
}


def clear_run(out: Path) -> None:
    """Delete what a previous run wrote into ``out`` (``run.overwrite``)."""
    import shutil

    for name in RUN_FILES:
        path = out / name
        if path.is_symlink() or path.is_file():
            path.unlink()
        elif path.is_dir():
            shutil.rmtree(path)


def last_row(out: Path) -> dict:
    """The last metrics row a run wrote (what a finished run returns when resumed)."""
    path = out / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return json.loads(lines[-1]) if lines else {}


def say(ranks: Ranks, message: str) -> None:
    """A line for the user on stderr (rank 0 only)."""
    if ranks.is_main:
        print(f"omni-rl: {message}", file=sys.stderr, flush=True)


def finish_run(run: Run, step: int, datasets: dict, row: dict, results: dict | None = None) -> dict:
    """Link ``OUTPUT_DIR/model`` to the final model (the best one when
    ``trainer.best_metric`` kept one, else the last checkpoint's), write
    ``summary.json`` (the step reached, the model, each dataset's rows read, used,
    refused and left out by an eval set's limit, which add up, with its cache use, and
    the last metrics row) and say where
    the model is. ``results``: what a recipe measures of the whole run (flow_ppo:
    held-out success before and after RL), kept under ``results`` when given."""
    best, last = run.out / "best" / "model", checkpoint.latest(run.out)
    final = best if best.is_dir() else (last / "model" if last is not None else None)
    summary = {"step": step, "model": None, "data": {}, "last_metrics": row}
    if results is not None:
        summary["results"] = results
    for name, dataset in datasets.items():
        # every rank loads all rows, and reads only its share of the media
        summary["data"][name] = {**dataset.load_report(), **dataset.run_metrics()}
    if run.ranks.is_main and final is not None:
        # a new link renamed over the old one: the model link is never missing
        link, tmp = run.out / "model", run.out / ".model.tmp"
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(final.relative_to(run.out), target_is_directory=True)
        os.replace(tmp, link)
        summary["model"] = str(link)
    if run.ranks.is_main:
        (run.out / "summary.json").write_text(json.dumps(summary, indent=2))
        say(run.ranks, f"final model: {summary['model']} (-> {final}); summary: {run.out / 'summary.json'}")
    return summary


def freeze_vision_tower(model: torch.nn.Module) -> int:
    """Fix the vision encoder's weights (the parameters named ``visual``); how many
    tensors it froze. A model without one is refused: the setting would do nothing."""
    frozen = 0
    for name, param in model.named_parameters():
        if "visual" in name:
            param.requires_grad_(False)
            frozen += 1
    if not frozen:
        raise OmniRLError(
            f"model.freeze_vision_tower: {type(model).__name__} has no vision tower (no parameter named 'visual'); "
            "remove the setting"
        )
    return frozen


def setup_model(cfg, run: Run, with_reference: bool = False):
    """The trainable model (in the dtype its precision keeps master weights in) and its
    processor, plus a frozen reference copy when asked (and not using LoRA, whose
    reference is the base with adapters disabled). A tiny model is built under
    ``out/tiny_model`` when ``model.path`` is unset. A resumed run's weights come from
    its checkpoint when the engine loads it."""
    from omni_rl.models import build_tiny, load  # transformers: only recipes with a VLM pay for it

    precision = resolve_precision(cfg.trainer.precision, run.device)
    base = model_dir(cfg, run.out)
    if not cfg.model.path and run.ranks.is_main and not (base / "config.json").is_file():
        build_tiny(
            cfg.model.setting("tiny_family"),
            base,
            seed=cfg.run.seed,
            width=cfg.model.setting("tiny_width"),
            audio_seconds=cfg.model.setting("tiny_audio_seconds"),
        )
    distributed.barrier()
    # FSDP2 on several processes: built on the meta device, sharded by the engine, then
    # filled from rank 0's read, so a node holds one copy of the weights, not one per rank
    # (LoRA wraps the model before the engine shards it: its adapters need values first)
    strategy = resolve_strategy(cfg.trainer.strategy, run.ranks.world_size, torch.distributed.is_initialized())
    empty = strategy == "fsdp" and run.ranks.distributed
    empty = empty and cfg.model.lora is None
    if empty and distributed.rollout_rank() is not None:
        # filling shards broadcasts over every process, the rollout process included
        _log.info("beside a rollout process every trainer reads the whole checkpoint (not built empty)")
        empty = False
    if run.ranks.is_main:
        how = "built empty, filled from rank 0's read once sharded" if empty else "read whole by every process"
        _log.info("loading %s on %d process(es): %s", base, run.ranks.world_size, how)
    model, processor = load(base, device=run.device, dtype=load_dtype(precision), empty=empty)
    if cfg.model.freeze_vision_tower:
        freeze_vision_tower(model)
    lora = cfg.model.lora
    if lora is not None:
        from peft import get_peft_model

        # the adapters' random start from the run's seed, not this process's stream
        # (seed + rank): FSDP2 keeps each process's shard of them and broadcasts nothing
        with torch.random.fork_rng(devices=[run.device] if run.device.type == "cuda" else []):
            torch.manual_seed(cfg.run.seed)
            model = get_peft_model(model, lora.peft_config())
    if cfg.model.gradient_checkpointing:
        # non-reentrant: the shared-prefix forward reads the prompt's keys, recorded inside
        # checkpointed layers, from outside them (transformers >= 5.x names it activation
        # checkpointing; older 5.x releases do not)
        enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        enable({"use_reentrant": False})
    reference = None
    if with_reference and lora is None:
        # as the policy's weights (wrap_frozen stores its matmul weights in bf16 under
        # bf16-mixed); FSDP2's bf16-mixed computes both from bf16 copies: bf16 is enough
        mixed_fsdp = strategy == "fsdp" and precision == "bf16-mixed"
        dtype = torch.bfloat16 if mixed_fsdp else load_dtype(precision)
        reference, _ = load(base, device=run.device, dtype=dtype, empty=empty)
    model.train()
    return model, processor, reference


def model_dir(cfg, out: Path) -> Path:
    """The checkpoint a run starts from: ``model.path``, or the tiny model it builds."""
    return Path(cfg.model.path) if cfg.model.path else out / "tiny_model"


def model_inputs(cfg, device: torch.device) -> str | None:
    """The dtype of the cached model inputs a run on ``device`` reads
    (``omni_rl.preprocess.inputs``: bfloat16 where it computes in bf16), or None: under
    ``data.cache_inputs: false``, and for a tiny model built at train time (``model.path``
    unset), whose processor does not exist before the run."""
    from omni_rl.preprocess.inputs import inputs_dtype

    if not cfg.data.cache_inputs or not cfg.model.path:
        return None
    return inputs_dtype(resolve_precision(cfg.trainer.precision, device))


def write_model_inputs(
    cfg, data: str | Path, cache: str | Path, device: torch.device, limit: int | None = None, progress: bool = True
):
    """Cache the model inputs of ``data``'s rows (the first ``limit``) in ``cache`` as a
    run of ``cfg`` on ``device`` reads them: its model's processor, its prompt template,
    its feature dtype. Returns the dtype and ``MediaDataset.cache_inputs``' counts, or
    None when such a run reads none (``model_inputs``)."""
    from omni_rl.data.dataset import MediaDataset
    from omni_rl.models import load_processor, require_media_family
    from omni_rl.preprocess.pipeline import Budgets

    dtype = model_inputs(cfg, device)
    if dtype is None:
        return None
    require_media_family(cfg.media.family, cfg.model.family())
    dataset = MediaDataset(
        data,
        Budgets.from_config(cfg.media),
        cache,
        "prefer_cache",
        prompt_template=cfg.data.prompt_template,
        columns=dict(cfg.data.columns),
        report_refused=False,
        inputs=dtype,
    )
    return dtype, dataset.cache_inputs(load_processor(cfg.model.path), progress, limit)


def setup_data(cfg, device: torch.device):
    """The training rows (routed and checked against the reward registry) and a
    resumable sampler over them, ``data.sampler``'s (the same on every rank: ranks take
    their share of each global draw); their cached model inputs are read as a run on
    ``device`` computes (``model_inputs``)."""
    from omni_rl.data.dataset import MediaDataset
    from omni_rl.data.sampler import PromptSampler, SourceUCBSampler
    from omni_rl.models import require_media_family
    from omni_rl.preprocess.pipeline import Budgets

    data = cfg.data
    if not data.train:
        raise OmniRLError("data.train must name a dataset file")
    require_media_family(cfg.media.family, cfg.model.family())
    dataset = MediaDataset(
        data.train,
        Budgets.from_config(cfg.media),
        data.cache,
        data.cache_mode,
        data.strict,
        data.prompt_template,
        data.columns,
        inputs=model_inputs(cfg, device),
    )
    if not len(dataset):
        raise OmniRLError(f"{data.train}: no usable rows ({len(dataset.failures)} refused; the log lists why)")
    if data.sampler.type == "uniform":
        return dataset, PromptSampler(len(dataset), cfg.run.seed, data.shuffle)
    unlabelled = next((row for row in dataset.rows if not row.fields.get("data_source")), None)
    if unlabelled is not None:
        raise OmniRLError(
            f"{unlabelled.source}: row '{unlabelled.id}' has no data_source; data.sampler.type=ucb draws by "
            "source, so every row needs one"
        )
    u = data.sampler
    sources = [row.fields["data_source"] for row in dataset.rows]
    sampler = SourceUCBSampler(
        sources, cfg.run.seed, data.shuffle, u.setting("window"), u.setting("c"), u.setting("temperature")
    )
    return dataset, sampler


@dataclass
class Balance:
    """How a step's rows are dealt to ranks (``data.balance_tolerance``: None keeps each
    rank's slice of the draw) and what the dealing did, summed over the step's draws."""

    tolerance: float | None
    moved: int = 0
    drawn: list[float] = field(default_factory=list)
    dealt: list[float] = field(default_factory=list)

    def metrics(self) -> dict:
        """The same on every rank: rows encoded again on another rank, and the prompt
        tokens of the heaviest rank over the mean, as drawn and as dealt (mean of the
        step's draws)."""
        if not self.drawn:
            return {}
        return {
            "balance/moved_rows": self.moved,
            "balance/prompt_max_over_mean_drawn": sum(self.drawn) / len(self.drawn),
            "balance/prompt_max_over_mean": sum(self.dealt) / len(self.dealt),
        }


def draw_rows(dataset, sampler, count: int, processor, refuse=None, balance: Balance | None = None) -> list[tuple]:
    """This rank's next ``count`` usable rows, as (draw number in the run, sample,
    model inputs). Every rank draws the same global indices from the shared sampler and
    takes its own slice, refilling together until every rank has its count; then, with
    ``balance``, rows are swapped between ranks by their prompt tokens (``_deal``).

    A bad row is skipped (reported once and counted by ``MediaDataset.encoded``), and so
    is a row for which ``refuse(sample, inputs)`` gives a reason (the caller counts
    those). Draws that are nearly all skipped stop the run, saying why.
    """
    rank = distributed.ranks().rank
    rows, bad, refused = [], 0, {}
    while True:
        needs = distributed.all_gather_ints(count - len(rows))
        if not sum(needs):
            break
        first = sampler.drawn
        indices = sampler.next_batch(sum(needs))
        start = sum(needs[:rank])
        for drawn, index in enumerate(indices[start : start + needs[rank]], start=first + start):
            got = dataset.encoded(index, processor)
            if got is None:
                bad += 1
                continue
            reason = refuse(*got) if refuse is not None else None
            if reason is not None:
                refused[reason] = refused.get(reason, 0) + 1
                continue
            rows.append((drawn, index, *got))
        if bad + sum(refused.values()) > 100 * max(count, 1):
            why = [f"{n} {reason}" for reason, n in refused.items()]
            if bad:
                why.append(f"{bad} draws of bad rows (the log names them)")
            raise OmniRLError(f"{dataset.data}: nearly every row drawn is skipped: {'; '.join(why)}")
    if balance is not None:
        rows = _deal(rows, dataset, processor, balance)
    return [(drawn, sample, inputs) for drawn, _, sample, inputs in rows]


def _deal(rows: list[tuple], dataset, processor, balance: Balance) -> list[tuple]:
    """This rank's rows once every rank's (draw number, row index, sample, inputs) are
    dealt by prompt tokens (``balance_by_swaps``, each rank keeping its count); a row
    that comes from another rank is encoded again here. In draw order."""
    ranks = distributed.ranks()
    every = distributed.gather_objects([(ranks.rank, d, i, inputs["input_ids"].shape[-1]) for d, i, _, inputs in rows])
    owners, tokens = [o for o, *_ in every], [t for *_, t in every]
    dealt = owners
    if balance.tolerance is not None:
        dealt = balance_by_swaps(tokens, owners, ranks.world_size, balance.tolerance)
    balance.drawn.append(max_over_mean(rank_loads(tokens, owners, ranks.world_size)))
    balance.dealt.append(max_over_mean(rank_loads(tokens, dealt, ranks.world_size)))
    balance.moved += sum(a != b for a, b in zip(owners, dealt, strict=True))
    own = {row[0]: row for row in rows}
    out = []
    for (owner, drawn, index, _), new in zip(every, dealt, strict=True):
        if new != ranks.rank:
            continue
        if owner == ranks.rank:
            out.append(own[drawn])
            continue
        got = dataset.encoded(index, processor)
        if got is None:
            raise OmniRLError(
                f"{dataset.data}: row {index} encoded on rank {owner} but not on rank {ranks.rank}, "
                "where balancing moved it: do the ranks read the same files? (data.balance_tolerance: null "
                "keeps each row on the rank that drew it)"
            )
        out.append((drawn, index, *got))
    return sorted(out, key=lambda row: row[0])


def per_rank(count: int, ranks: Ranks, name: str) -> int:
    """This rank's share of a global count, which must divide evenly."""
    if count % ranks.world_size:
        raise OmniRLError(f"{name}={count} must be a multiple of the number of processes ({ranks.world_size})")
    return count // ranks.world_size


def resume_steps(cfg, run: Run, engine, sampler, desc: str, heldout=None):
    """Restore a resumed run's engine state and data position, then return the metrics
    log and the progress bar over the steps left (rank 0 writes and shows them).
    ``sampler``: what holds the data position (``state_dict``/``load_state_dict``),
    saved under the checkpoint state's ``sampler``: GRPO's and SFT's prompt sampler,
    flow_ppo's random stream and results so far. ``heldout``: the run's eval sets
    (``HeldOut``), whose best model from after the checkpoint is dropped with the
    metrics rows."""
    start = 0
    if run.resume_from is not None:
        state = checkpoint.load(engine, run.resume_from)
        sampler.load_state_dict(state["sampler"])
        start = state["step"]
        if heldout is not None:
            heldout.forget_after(start)
    log = MetricsLog(run.out, start if run.resume_from else None, run.ranks.is_main, cfg.trainer.log_every, cfg)
    steps = cfg.trainer.steps
    if start >= steps:
        say(
            run.ranks,
            f"the run finished at step {start} (trainer.steps={steps}): nothing to train; raise trainer.steps to go on",
        )
    bar = tqdm(range(start, steps), initial=start, total=steps, desc=desc, disable=not run.ranks.is_main)
    return log, bar


def save_if_due(cfg, run: Run, step: int, engine, processor, state: dict) -> None:
    """Checkpoint after ``step`` (1-based) every ``trainer.save_every`` steps and at the end."""
    every = cfg.trainer.save_every
    if step == cfg.trainer.steps or (every and step % every == 0):
        checkpoint.save(engine, run.out, step, state, processor, keep_last=cfg.trainer.keep_last)


def pack_by_tokens(lengths: list[tuple[int, int]], budget: int, max_items: int = 0) -> list[list[int]]:
    """Items packed into micro-batches of at most ``budget`` padded tokens (and at most
    ``max_items`` items when > 0), longest first, each into the first batch it fits.

    Args:
        lengths: per item, (shared tokens, per-item tokens): a micro-batch costs
            count * max(shared) + count * max(per-item) tokens once padded (GRPO: the
            prompt, then G completions; SFT: the prompt, then the target).
    Returns:
        lists of item indices, in ascending order within each batch; an item over the
        budget on its own gets a batch of its own.
    """
    order = sorted(range(len(lengths)), key=lambda i: -sum(lengths[i]))
    batches: list[list[int]] = []

    def cost(items: list[int]) -> int:
        return len(items) * (max(lengths[i][0] for i in items) + max(lengths[i][1] for i in items))

    for item in order:
        for batch in batches:
            if (not max_items or len(batch) < max_items) and cost([*batch, item]) <= budget:
                batch.append(item)
                break
        else:
            batches.append([item])
    return [sorted(b) for b in batches]


def rank_loads(tokens: list[int], owners: list[int], world: int) -> list[int]:
    """Tokens per rank, of items held by ``owners``."""
    out = [0] * world
    for count, owner in zip(tokens, owners, strict=True):
        out[owner] += count
    return out


def max_over_mean(loads: list[float]) -> float:
    """The heaviest rank's load over the mean load (1.0 when all are equal or empty)."""
    mean = sum(loads) / len(loads) if loads else 0.0
    return max(loads) / mean if mean else 1.0


def balance_by_swaps(tokens: list[int], owners: list[int], world: int, tolerance: float) -> list[int]:
    """Owners (ranks) of items after swapping items between ranks until the heaviest
    rank's tokens are within ``tolerance`` of the mean, each rank keeping its count.

    Each swap trades an item of the heaviest rank for a shorter one of the lightest rank
    it can improve, the pair whose difference comes nearest half their gap: the sum of
    squared loads falls with every swap, so it ends, and few items move (none when the
    ranks are already within the bound).

    Args:
        tokens: per item, its token count.
        owners: per item, the rank that holds it now (0 <= owner < world).
    """
    owners = list(owners)
    loads = rank_loads(tokens, owners, world)
    mean = sum(loads) / world
    while max(loads) > (1 + tolerance) * mean:
        heavy = max(range(world), key=lambda r: (loads[r], -r))
        swap = None
        for light in sorted(range(world), key=lambda r: (loads[r], r)):
            gap = loads[heavy] - loads[light]
            if gap <= 0:
                break
            best = gap  # |gap - 2d| < gap exactly when 0 < d < gap
            for a in (i for i, o in enumerate(owners) if o == heavy):
                for b in (j for j, o in enumerate(owners) if o == light):
                    d = tokens[a] - tokens[b]
                    if 0 < d < gap and abs(gap - 2 * d) < best:
                        best, swap = abs(gap - 2 * d), (a, b, light, d)
            if swap is not None:
                break
        if swap is None:
            return owners
        a, b, light, d = swap
        owners[a], owners[b] = light, heavy
        loads[heavy] -= d
        loads[light] += d
    return owners


class Timer:
    """Seconds per phase of a step: ``with timer("rollout"): ...``."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    def __call__(self, phase: str):
        timer = self

        class _Phase:
            def __enter__(self):
                self.start = time.perf_counter()

            def __exit__(self, *exc):
                timer.seconds[phase] = timer.seconds.get(phase, 0.0) + time.perf_counter() - self.start

        return _Phase()

    @property
    def total(self) -> float:
        return sum(self.seconds.values())

    def metrics(self) -> dict:
        return {**{f"time/{k}": v for k, v in self.seconds.items()}, "time/step": self.total}


def scalar_summary(scalars: dict[str, float]):
    """One TensorBoard summary holding every scalar of a row (tag -> value)."""
    from tensorboard.compat.proto.summary_pb2 import Summary
    from torch.utils.tensorboard.summary import scalar

    return Summary(value=[value for tag, x in scalars.items() for value in scalar(tag, x).value])


class MetricsLog:
    """Per-step metrics, written by rank 0 only, every ``every`` steps and whenever
    ``force`` is set (the last step), to each backend ``cfg.logging`` enables:
    ``metrics.jsonl`` (always), TensorBoard events under ``tensorboard/`` and a wandb run.

    Resuming from step k keeps the JSONL rows of steps <= k and drops later ones (the
    resumed run redoes them), so the file ends up as the uninterrupted run's; TensorBoard
    hides the dropped steps' events too (``purge_step``). wandb cannot drop logged rows: a
    resumed run appends to the same wandb run (its id is kept in ``wandb_run_id``), plotted
    against the ``step`` key, so steps a killed run logged past its checkpoint show twice.

    Args:
        cfg: the run's root config, whose ``logging`` section picks the backends and
            which wandb records (resolved, with ``run.name`` as the run's name); None
            writes JSONL and TensorBoard only.
    """

    def __init__(self, out: Path, resumed_step: int | None, enabled: bool = True, every: int = 1, cfg=None):
        self.path = out / "metrics.jsonl"
        self.enabled, self.every = enabled, every
        self.writer = self.wandb = None
        backends = cfg.logging.backends if cfg is not None else ["jsonl", "tensorboard"]
        if "wandb" in backends:
            # every rank checks, so a missing package stops them all before training
            try:
                import wandb
            except ImportError:
                raise OmniRLError(
                    "logging.backends lists 'wandb' but the wandb package is not installed: "
                    "pip install -e '.[wandb]' (or drop wandb from logging.backends)"
                ) from None
        if not enabled:
            return
        out.mkdir(parents=True, exist_ok=True)
        if resumed_step is None:
            self.path.unlink(missing_ok=True)
        elif self.path.exists():
            kept = [
                line for line in self.path.read_text().splitlines() if line and json.loads(line)["step"] <= resumed_step
            ]
            self.path.write_text("".join(line + "\n" for line in kept))
        if "tensorboard" in backends:
            from torch.utils.tensorboard import SummaryWriter

            purge = resumed_step + 1 if resumed_step is not None else None
            self.writer = SummaryWriter(str(out / "tensorboard"), purge_step=purge)
        if "wandb" in backends:
            self.wandb = self._wandb_run(wandb, cfg, out, resumed=resumed_step is not None)

    def due(self, step: int, force: bool = False) -> bool:
        """Whether step ``step``'s row is written (the same answer on every rank)."""
        return force or step % self.every == 0

    def log(self, row: dict, force: bool = False) -> None:
        if not self.enabled or not self.due(row["step"], force):
            return
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        scalars = {k: v for k, v in row.items() if k != "step" and isinstance(v, (int, float))}
        if self.writer is not None:  # one event holding the row's scalars, not an event each
            self.writer.file_writer.add_summary(scalar_summary(scalars), row["step"])
        if self.wandb is not None:
            self.wandb.log({"step": row["step"], **scalars})

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None

    @staticmethod
    def _wandb_run(wandb, cfg, out: Path, resumed: bool):
        """A wandb run for ``cfg`` under ``out``: a fresh run gets a new id, saved to
        ``out/wandb_run_id``; a resumed one reuses the saved id, so wandb appends to it (an
        offline run writes a second folder with that id, and ``wandb sync`` merges them)."""
        import uuid

        from omni_rl.config import recipe_name, to_dict

        section = cfg.logging
        id_file = out / "wandb_run_id"
        run_id = id_file.read_text().strip() if resumed and id_file.is_file() else ""
        if not run_id:
            run_id = uuid.uuid4().hex[:8]  # wandb's own id format: 8 of [0-9a-z]
            tmp = id_file.with_name(id_file.name + ".tmp")
            tmp.write_text(run_id + "\n")
            tmp.replace(id_file)
        root = Path(section.wandb_dir) if section.wandb_dir else out
        root.mkdir(parents=True, exist_ok=True)
        run = wandb.init(
            project=section.wandb_project,
            name=cfg.run.name,
            id=run_id,
            resume="allow",
            dir=str(root),
            mode=section.wandb_mode,
            config={"recipe": recipe_name(cfg), **to_dict(cfg)},
        )
        # x axis: the trainer's step, not wandb's own counter (which a resumed run continues)
        run.define_metric("step")
        run.define_metric("*", step_metric="step")
        return run
