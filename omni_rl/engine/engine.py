"""The training engine: every recipe says what to optimise, the engine knows how.

A recipe computes a loss and calls ``engine.backward(loss)`` once per micro-batch and
``engine.step()`` once per optimizer step. The engine owns:

- wrapping: FSDP2 (``fully_shard`` on every decoder layer and vision/audio encoder
  block, found through the model's ``_no_split_modules``, then on the root; a model
  built on the meta device is filled from rank 0's read once sharded; with
  several processes every rank runs every encoder in every prompt forward, a
  zero-weight dummy where its batch lacks that medium: ``omni_rl.engine.encoders``),
  DDP (``find_unused_parameters``: an encoder a batch does not use gets no gradient),
  or one plain process;
- precision: fp32, or bf16-mixed (fp32 master weights and optimizer state, bf16
  compute, fp32 gradient reduction: FSDP2's MixedPrecisionPolicy, autocast otherwise),
  or an explicit pure bf16; ``forward_context`` gives calls that bypass the forward
  (a policy's sampling) the forward's parameters and precision;
- gradient accumulation: gradients of successive ``backward`` calls add up until
  ``step``; losses are already divided by the global count of what they average over
  (tokens, sequences, samples: see ``omni_rl.algorithms.losses.aggregate``), so the
  engine undoes the data-parallel mean of the gradient reduction and N ranks compute
  what one process computes;
- the global gradient-norm clip across shards (or one clip per parameter group, for
  models whose parts learn apart, such as an actor and a critic), and a non-finite
  guard: a step whose gradients hold NaN or inf is skipped (weights and optimizer state
  untouched), counted, and ``max_bad_steps`` of them in a row stop the run;
- the optimizer (a registered ``optimizer:`` section) and the learning-rate schedule,
  which moves on at every ``step``, a skipped one included, as verl's trainer steps its
  scheduler whether or not the actor skipped a non-finite update (Megatron-LM holds
  its schedule instead, for fp16 loss scaling, whose skips are routine; here a skip
  is rare and ``max_bad_steps`` in a row stop the run). The rate stays the function
  of the step index that the config describes: a run with a skipped step still ends
  its decay at ``min_lr_ratio`` on its last step. In the metrics,
  ``optim/skipped_nonfinite`` counts the skipped steps and ``optim/schedule_step`` the
  steps the schedule has taken;
- checkpoints (``omni_rl.engine.checkpoint``).
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace

import torch
from torch import nn

from omni_rl.engine import distributed, encoders, gathering
from omni_rl.engine.config import OptimizerConfig, TrainerConfig
from omni_rl.errors import OmniRLError
from omni_rl.models.forward import accumulate_in_place, tied_head
from omni_rl.models.shared_prefix import PromptBackward, gather_on_prompt_gradient

log = logging.getLogger(__name__)


def lr_factor(step: int, warmup: int, total: int, schedule: str, min_ratio: float = 0.0) -> float:
    """Multiplier of the peak learning rate at optimizer step ``step`` (0-based).

    Warm-up rises linearly, (step + 1) / warmup, over the first ``warmup`` steps; then
    ``constant`` stays at 1, ``linear`` falls to ``min_ratio`` at step ``total - 1``
    and ``cosine`` follows half a cosine to ``min_ratio`` there.
    """
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    span = max(total - 1 - warmup, 1)
    progress = min((step - warmup) / span, 1.0)
    if schedule == "linear":
        decay = 1.0 - progress
    elif schedule == "cosine":
        decay = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        raise ValueError(f"unknown schedule '{schedule}'")
    return min_ratio + (1.0 - min_ratio) * decay


def schedule_warning(warmup: int, total: int, schedule: str) -> str | None:
    """What a warm-up too long for the run's ``total`` optimizer steps takes from the
    schedule, or None: ``lr_factor`` never reaches the peak when ``warmup > total``, and
    a decaying schedule never falls below the peak when ``warmup >= total - 1``."""
    if warmup > total:
        return (
            f"warmup_steps={warmup} exceeds the run's {total} optimizer steps: "
            f"the rate ends at {total / warmup:.2f} of its peak"
        )
    if schedule != "constant" and warmup > 0 and warmup >= total - 1:
        return (
            f"warmup_steps={warmup} leaves none of the run's {total} optimizer steps to the {schedule} "
            "schedule: the rate never decays"
        )
    return None


def resolve_precision(precision: str, device: torch.device) -> str:
    """'auto' -> bf16-mixed on CUDA, fp32 elsewhere."""
    if precision == "auto":
        return "bf16-mixed" if device.type == "cuda" else "fp32"
    return precision


def resolve_strategy(strategy: str, world_size: int, in_group: bool) -> str:
    """'auto' -> fsdp with several processes, single with one. ``in_group``: this
    process has joined a process group (torchrun with several processes, or a tracer's
    fake group); FSDP2 and DDP need one."""
    if strategy == "auto":
        return "fsdp" if world_size > 1 else "single"
    if strategy == "single" and world_size > 1:
        raise OmniRLError(f"trainer.strategy: single, but torchrun started {world_size} processes; use fsdp or ddp")
    if strategy in ("fsdp", "ddp") and not in_group:
        raise OmniRLError(
            f"trainer.strategy: {strategy} needs torchrun with 2 or more processes (one process joins no "
            "process group); use single (or auto) for one process"
        )
    return strategy


def load_dtype(precision: str) -> torch.dtype:
    """The dtype a trainable model is loaded in: bf16 only for pure bf16 (master
    weights stay fp32 otherwise)."""
    return torch.bfloat16 if precision == "bf16-pure" else torch.float32


def shard_units(model: nn.Module) -> list[nn.Module]:
    """The blocks FSDP2 shards one by one: instances of the classes the model names in
    ``_no_split_modules`` (decoder layers, vision and audio encoder blocks)."""
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or ())
    return [m for m in model.modules() if type(m).__name__ in names]


def prefetch_decoder_layers(model: nn.Module, units: list[nn.Module]) -> None:
    """Have each sharded decoder layer's backward gather the layer before it in its
    stack (``set_modules_to_backward_prefetch``), in every backward call.

    FSDP2 prefetches by the order of the forward, which it forgets when a backward call
    ends: the prompt's backward, a call of its own after the completions' (``backward``),
    then gathered each layer only once the layer above was done. An order kept across
    the calls instead (``set_is_last_backward(False)``) also drives the root's and the
    encoder blocks' prefetches, which differ between ranks whose batches hold different
    media (``omni_rl.engine.encoders``): their collectives fall out of step. The layer
    of each stack that comes first keeps FSDP2's own prefetch."""
    held = {id(unit) for unit in units}
    for stack in model.modules():
        if not isinstance(stack, nn.ModuleList):
            continue
        layers = [m for m in stack if id(m) in held and any(hasattr(x, "layer_idx") for x in m.modules())]
        for later, earlier in zip(layers[1:], layers[:-1], strict=True):
            later.set_modules_to_backward_prefetch([earlier])


@dataclass
class StepResult:
    """What one ``TrainingEngine.step`` did."""

    grad_norm: float
    """Global gradient norm before clipping (NaN or inf when skipped)."""
    skipped: bool
    """The gradients were not finite and the update was skipped."""
    lr: float
    """Learning rate of the first parameter group used by this step (skipped: the rate it
    would have used; the schedule moves on either way)."""
    group_norms: tuple[float, ...] = ()
    """Each parameter group's gradient norm before clipping, where groups clip apart."""


class TrainingEngine:
    """Wraps one trainable model and steps its optimizer.

    Args:
        model: the model, on ``device``, in the dtype of ``load_dtype(precision)``; under
            FSDP2 on several processes it may be on the meta device
            (``omni_rl.models.load(empty=True)``) and is filled once sharded.
        optimizer: the registered optimizer section.
        device: this rank's device.
        total_steps: optimizer steps of the whole run (for the schedule).
        precision, strategy, max_grad_norm, schedule, warmup_steps, min_lr_ratio,
            max_bad_steps: as in ``TrainerConfig``.
        param_groups: ``fn(model) -> [{"params": [...], "lr": ...}, ...]`` called after
            wrapping (FSDP2 replaces parameters); default: every trainable parameter. A
            group with a ``max_grad_norm`` key is clipped to it on its own (then every
            group needs one) instead of by the global clip.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: OptimizerConfig,
        device: torch.device,
        total_steps: int,
        precision: str = "auto",
        strategy: str = "auto",
        max_grad_norm: float = 1.0,
        schedule: str = "constant",
        warmup_steps: int = 0,
        min_lr_ratio: float = 0.0,
        max_bad_steps: int = 3,
        param_groups: Callable[[nn.Module], list] | None = None,
    ):
        self.ranks = distributed.ranks()
        self.device = device
        self.precision = resolve_precision(precision, device)
        self.strategy = resolve_strategy(strategy, self.ranks.world_size, torch.distributed.is_initialized())
        self.max_bad_steps = max_bad_steps
        self.module = model  # the model itself: generate, save_pretrained, named_parameters
        self.model = self._wrap(model)  # what training forwards call
        self.prompt_apart = self.strategy != "ddp"
        """Whether a shared prompt's backward runs after its completions' (``backward``'s
        ``prompt``): DDP's reducer takes one backward call per forward."""
        if not self.prompt_apart:
            log.info(
                "trainer.strategy=ddp: a shared prompt's backward runs in one call with its completions', "
                "which holds the completions' weight gradients until the prompt's (fsdp and single run them apart)"
            )
        self.tied_grad_in_place = self._tied_head_in_place()
        """None for an untied model; for a tied one, whether its weight gets one gradient."""
        self.trained_names: set[str] = set()
        self.use_optimizer(optimizer, total_steps, schedule, warmup_steps, min_lr_ratio, param_groups, max_grad_norm)
        if self.precision == "bf16-pure":
            log.warning(
                "trainer.precision=bf16-pure: weights are stepped in bf16; updates below bf16's resolution "
                "(about 0.4%% of a weight) are lost"
            )

    def _tied_head_in_place(self) -> bool | None:
        """Where the output head is the trained input embedding, whether that weight
        gets one full gradient (``forward.accumulate_in_place``: one process) or, under
        DDP and FSDP2, a second full [V, H] fp32 one beside it at times (said once in
        the log); None where the head is not tied."""
        embedding = tied_head(self.module)
        if embedding is None:
            return None
        if self.strategy != "single":
            log.info(
                "tied output head under trainer.strategy=%s: its weight's gradient is made twice at times "
                "(the head's fp32 buffer, the token lookup's dense gradient: each [V, H]); one process adds both "
                "in place",
                self.strategy,
            )
            return False
        accumulate_in_place(embedding)  # after wrapping: DDP reads a lookup's sparse flag when built
        log.info("tied output head: the head's and the token lookup's gradients are added in place into one")
        return True

    def use_optimizer(
        self,
        optimizer: OptimizerConfig,
        total_steps: int,
        schedule: str = "constant",
        warmup_steps: int = 0,
        min_lr_ratio: float = 0.0,
        param_groups: Callable[[nn.Module], list] | None = None,
        max_grad_norm: float | None = None,
    ) -> None:
        """A fresh optimizer and schedule over the wrapped model's parameters (a recipe
        with two phases, such as behaviour cloning then PPO, starts the second here);
        ``max_grad_norm`` replaces the clip when given."""
        if max_grad_norm is not None:
            self.max_grad_norm = max_grad_norm
        # a forward since the last step (an evaluation) leaves FSDP2's root holding its
        # gathered weights as the registered parameters: the optimizer must hold the shards
        self.reshard()
        module = self.module
        # what checkpoints save: every parameter an optimizer of this run has trained
        self.trained_names |= {name for name, p in module.named_parameters() if p.requires_grad}
        groups = param_groups(module) if param_groups else [p for p in module.parameters() if p.requires_grad]
        self.params = [p for g in groups for p in (g["params"] if isinstance(g, dict) else [g])]
        if not self.params:
            raise OmniRLError("no trainable parameters (is everything frozen?)")
        own = [isinstance(g, dict) and "max_grad_norm" in g for g in groups]
        if any(own) and not all(own):
            raise OmniRLError("param_groups: either every group has its own max_grad_norm or none has")
        # [(params, clip)] per group, or None: one global clip over every parameter
        self.clip_groups = [(list(g["params"]), g.pop("max_grad_norm")) for g in groups] if any(own) else None
        self.optimizer = optimizer.build(groups, self.device)
        if (problem := schedule_warning(warmup_steps, total_steps, schedule)) is not None:
            log.warning(problem)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(s, warmup_steps, total_steps, schedule, min_lr_ratio)
        )
        self.bad_steps = 0
        self.skipped_steps = 0
        self.last_lr: float | None = None  # the rate the latest step used (optim/lr)

    @classmethod
    def from_config(
        cls,
        model: nn.Module,
        trainer: TrainerConfig,
        optimizer: OptimizerConfig,
        device: torch.device,
        total_steps: int,
        param_groups: Callable[[nn.Module], list] | None = None,
    ) -> TrainingEngine:
        """An engine with the settings of a ``trainer:`` section."""
        return cls(
            model,
            optimizer,
            device,
            total_steps,
            precision=trainer.precision,
            strategy=trainer.strategy,
            max_grad_norm=trainer.max_grad_norm,
            schedule=trainer.schedule,
            warmup_steps=trainer.warmup_steps,
            min_lr_ratio=trainer.setting("min_lr_ratio"),
            max_bad_steps=trainer.max_bad_steps,
            param_groups=param_groups,
        )

    # ---------------------------------------------------------------- wrapping

    def _mixed(self) -> bool:
        return self.precision == "bf16-mixed"

    def _wrap(self, model: nn.Module) -> nn.Module:
        self.encoder_locksteps: list = []
        if self.strategy == "fsdp":
            self._fully_shard(model)
            return model
        if self._mixed():
            _autocast_forward(model, self.device)
        if self.strategy == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            ids = [self.device.index] if self.device.type == "cuda" else None
            # a batch without one modality leaves that encoder unused: DDP must look for it
            return DistributedDataParallel(
                model, device_ids=ids, find_unused_parameters=True, process_group=distributed.trainer_group()
            )
        return model

    def _fully_shard(self, model: nn.Module, trainable: bool = True) -> None:
        """FSDP2 on every block, then the root; a model that arrives on the meta device
        (built empty: a node holds one copy of the weights, not one per rank) is filled
        from rank 0's read once sharded. Each block frees its gathered weights after
        every forward and backward; the trainable root keeps its own (embeddings, head)
        from its forward until its backward, as FSDP2 does by default. The shared-prefix
        forward runs a decoder layer twice (prompt, then completions), and the
        completions' gradient reaches the prompt pass through its stored keys and values,
        past FSDP2's backward hooks (which sit on block outputs): those tensors gather
        their layer's weights again themselves (``shared_prefix.gather_on_prompt_gradient``).
        A root whose class sets ``CASTS_OWN_INPUTS`` gets its forward's inputs as they
        are (bf16-mixed casts every float input to bf16 by default): it computes in its
        weights' dtype itself and reads some inputs exactly (a flow policy's chain)."""
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy()
        if self._mixed():
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        # innermost first: some models name a whole encoder beside its blocks (Omni's
        # audio and vision encoders, Qwen2-Audio's encoder layer beside its attention),
        # and FSDP2 shards an outer unit only around inner ones already sharded
        units = [*reversed(shard_units(model)), model]
        mesh = distributed.trainer_mesh(self.device.type)  # None: every process
        for unit in units:
            reshard = not (trainable and unit is model)
            cast = not (unit is model and getattr(model, "CASTS_OWN_INPUTS", False))
            mixed = replace(policy, cast_forward_inputs=policy.cast_forward_inputs and cast)
            fully_shard(unit, mesh=mesh, mp_policy=mixed, reshard_after_forward=reshard)
            gathering.track(unit, reshard, policy.param_dtype)  # held through a rollout, its gathers counted
        if trainable:
            for unit in units[:-1]:
                for module in unit.modules():
                    if hasattr(module, "layer_idx"):  # a decoder layer's attention (or the layer)
                        gather_on_prompt_gradient(module, unit.unshard)
            prefetch_decoder_layers(model, units[:-1])
        if any(p.device.type == "meta" for p in model.parameters()):
            # built empty (omni_rl.models.load(empty=True)): rank 0 reads, every rank keeps its shards
            from omni_rl.models import fill_sharded

            fill_sharded(model, self.device)
        if self.ranks.distributed:  # every rank runs every encoder block (omni_rl.engine.encoders)
            hooks = encoders.install(model)
            if hooks is not None:
                self.encoder_locksteps.append(hooks)

    def wrap_frozen(self, model: nn.Module) -> nn.Module:
        """A frozen model (the KL reference) sharded and cast like the policy, so it
        costs 1/N of its weights per rank under FSDP2, and computes what the policy
        computes with the same weights. Under bf16-mixed in one process or under DDP it
        arrives in fp32, as the policy's masters: its matmul weights go to bf16, which
        autocast rounds them to anyway, and the rest (embeddings, norms) stays fp32, so
        its residual stream is fp32 as the policy's is (``matmul_weights_to``)."""
        model.requires_grad_(False)
        if self.strategy == "fsdp":
            self._fully_shard(model, trainable=False)
        elif self._mixed():
            matmul_weights_to(model, torch.bfloat16)
            _autocast_forward(model, self.device)
        return model

    @contextmanager
    def forward_context(self):
        """The parameters and the precision of the model's forward, for calls that
        bypass it (a policy's ``sample`` method), so that what a rollout samples is
        scored alike by the update: FSDP2 gathers only inside ``forward``, so this
        unshards the root's parameters around the block; bf16-mixed in one process or
        under DDP autocasts the block as ``forward`` is autocast."""
        if self.strategy != "fsdp":
            with _autocast(self.device) if self._mixed() else nullcontext():
                yield
            return
        self.module.unshard()
        try:
            yield
        finally:
            self.module.reshard()

    # ---------------------------------------------------------------- stepping

    def backward(self, loss: torch.Tensor, prompt: PromptBackward | None = None) -> None:
        """Accumulate the gradients of one micro-batch's loss.

        The loss is this rank's share of the global mini-batch loss (already divided by
        the global count of what it averages); gradient reduction averages over ranks,
        so the loss is scaled by the number of ranks to make that a sum. ``prompt``: a
        shared prompt's backward, run after the loss's (``group_forward(...,
        apart=True)``); under FSDP2 the root's weights, freed at the end of the first
        call, are gathered for it.
        """
        if self.strategy in ("fsdp", "ddp"):
            loss = loss * self.ranks.world_size
        loss.backward()
        if prompt is not None:
            if self.strategy == "fsdp":
                self.module.unshard()
            prompt.run()

    def step(self) -> StepResult:
        """Clip, check and apply the accumulated gradients, then clear them."""
        if self.clip_groups is None:
            group_norms: tuple[float, ...] = ()
            grad_norm = _clip(self.params, self.max_grad_norm)
        else:
            group_norms = tuple(_clip(params, clip) for params, clip in self.clip_groups)
            grad_norm = math.sqrt(sum(n * n for n in group_norms))
        lr = self.last_lr = self.optimizer.param_groups[0]["lr"]
        skipped = not math.isfinite(grad_norm)
        if skipped:
            self.bad_steps += 1
            self.skipped_steps += 1
            log.warning("non-finite gradient norm (%s): update skipped, the learning-rate schedule moves on", grad_norm)
            if self.bad_steps >= self.max_bad_steps:
                raise OmniRLError(
                    f"{self.bad_steps} optimizer steps in a row had non-finite gradients; "
                    "lower optimizer.lr, check the data, or use trainer.precision=fp32"
                )
        else:
            self.bad_steps = 0
            self.optimizer.step()
        with warnings.catch_warnings():
            # a skipped first step moves the schedule before any optimizer step, on purpose
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before")
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.reshard()  # free the gathered weights until the next forward
        return StepResult(grad_norm, skipped, lr, group_norms)

    def skip_steps(self, count: int) -> None:
        """Move the learning-rate schedule on by ``count`` optimizer steps the recipe
        chose not to take (a PPO iteration stopped early, a GRPO batch that dynamic
        sampling left short or empty), so the run still ends where its schedule does."""
        for _ in range(count):
            self.scheduler.step()

    def reshard(self) -> None:
        """Free the gathered weights that forwards left resident: a trainable model's
        root keeps its own from a forward until that forward's backward (see
        ``_fully_shard``), so a forward outside a training step (held-out evaluation)
        must call this, or the root's weights stay through the next rollout. A no-op in
        one process and under DDP."""
        if self.strategy != "fsdp":
            return
        from torch.distributed.fsdp import FSDPModule

        for module in self.module.modules():
            if isinstance(module, FSDPModule):  # reshard() is not recursive
                module.reshard()

    def metrics(self) -> dict:
        """Run-level counters for the metrics log (and this GPU's peak memory so far):
        skipped non-finite steps, the steps the schedule has taken (skipped ones
        included) and the rate the latest step used (before any step: the rate the
        first will use); under FSDP2 on several
        processes, the zero-weight dummy encoder passes since the last call over every
        rank (``omni_rl.engine.encoders``: then every rank must call this together)."""
        row = {
            "optim/skipped_nonfinite": self.skipped_steps,
            "optim/schedule_step": self.scheduler.last_epoch,
            "optim/lr": self.last_lr if self.last_lr is not None else self.optimizer.param_groups[0]["lr"],
        }
        if self.encoder_locksteps:  # FSDP2 on several processes with media encoders
            (passes,) = distributed.all_sum([float(sum(h.take_count() for h in self.encoder_locksteps))])
            row["update/dummy_encoder_passes"] = int(passes)
        if self.device.type == "cuda":
            row["memory/peak_allocated_gb"] = torch.cuda.max_memory_allocated(self.device) / 2**30
            row["memory/peak_reserved_gb"] = torch.cuda.max_memory_reserved(self.device) / 2**30
        return row

    def state(self) -> dict:
        """The engine's own counters and schedule position (JSON)."""
        scheduler = {k: v for k, v in self.scheduler.state_dict().items() if k != "lr_lambdas"}
        return {"bad_steps": self.bad_steps, "skipped_steps": self.skipped_steps, "scheduler": scheduler}

    def load_state(self, state: dict) -> None:
        """Counters and the schedule's position from ``state``. The next step's rate is
        this run's schedule at that position, not the saved run's: a resume that raises
        ``trainer.steps`` goes on along the longer schedule from its first step, and one
        that changes the learning rate goes on at the new one (the log says so)."""
        self.bad_steps, self.skipped_steps = state["bad_steps"], state["skipped_steps"]
        saved, ours = state["scheduler"], list(self.scheduler.base_lrs)
        if saved["base_lrs"] != ours:
            log.warning("resuming at learning rates %s where the checkpoint's run had %s", ours, saved["base_lrs"])
        self.scheduler.load_state_dict({**saved, "base_lrs": ours, "lr_lambdas": [None] * len(ours)})
        position = self.scheduler.last_epoch
        for group, base, factor in zip(
            self.optimizer.param_groups, self.scheduler.base_lrs, self.scheduler.lr_lambdas, strict=True
        ):
            group["lr"], group["initial_lr"] = base * factor(position), base


def _clip(params: list[nn.Parameter], max_norm: float) -> float:
    """Clip ``params``' gradients to ``max_norm`` in total (0: no clip); returns their
    norm before clipping, across shards."""
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"))
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return float(norm)


def _autocast(device: torch.device) -> torch.autocast:
    """bf16-mixed's compute outside FSDP2: bf16 autocast over fp32 weights."""
    return torch.autocast(device.type, dtype=torch.bfloat16)


MATMUL_MODULES = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
"""The layers whose weights autocast casts to bf16 on every forward."""


def matmul_weights_to(model: nn.Module, dtype: torch.dtype) -> None:
    """Store in ``dtype`` the weights of ``model``'s ``MATMUL_MODULES`` that no other
    kind of module shares (a head tied to the token embedding stays: the embedding reads
    it in fp32). Under ``dtype`` autocast the model computes exactly what it computes
    with those weights in fp32 (autocast rounds them to ``dtype`` the same way), in about
    half the memory."""
    shared = {id(p) for m in model.modules() if not isinstance(m, MATMUL_MODULES) for p in m.parameters(recurse=False)}
    for module in model.modules():
        if isinstance(module, MATMUL_MODULES):
            for param in module.parameters(recurse=False):
                if id(param) not in shared:
                    param.data = param.data.to(dtype)


def _autocast_forward(model: nn.Module, device: torch.device) -> None:
    """bf16-mixed in one process or under DDP: the model's forward (also when
    ``generate`` calls it) runs under bf16 autocast while its weights stay fp32."""
    forward = model.forward
    model.forward = _autocast(device)(forward)
