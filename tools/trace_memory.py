"""Peak memory per rank of one GRPO step at a config's real sizes, traced on fake tensors.

    python tools/trace_memory.py CONFIG --world N [--model-config config.json]
        [--prompt-tokens P] [--decode-steps K] [--set a.b=c ...] [--checks fail|warn|off]

(A flow_ppo config with a pi0 policy goes to ``tools/trace_flow.py``: behaviour cloning,
the rollout and the PPO update, phase by phase.)

No weights, no GPU: the trace joins a fake process group of N ranks (PyTorch's ``fake``
backend) and loads the config's model as the recipe does (``setup_model``: on the meta
device when FSDP2 spans several ranks, frozen parts, gradient checkpointing, the
reference) from a directory holding its architecture (``model.path``'s config.json, else
``tools/model_configs/<name>.json``, else ``--model-config``), then shards it by the
engine's own FSDP2 wrapping (``TrainingEngine.from_config``), whose fill makes each rank's
shards. Under PyTorch's ``FakeTensorMode`` (tensors with shapes, dtypes and devices but no
data) the two steps that read weights are answered there instead: a whole model is built
from its config, and the fill runs without rank 0's broadcast (``load_models``,
``filled``). Then the real code of one training step runs as rank 0 runs it:

- rollout: ``HFRolloutEngine.rollout`` on this rank's prompts (``data.prompts_per_step /
  N``), its prefill and K decode steps (the decode loop's later steps repeat the same
  shapes; its completions' cache is allocated for ``rollout.max_new_tokens`` up front);
- the update: ``omni_rl.recipes.grpo._update`` on those prompts, with every completion
  ``rollout.max_new_tokens`` long (the worst case): old log-probs where its plan needs
  them, reference log-probs where the KL needs them, each micro-batch's forward and
  backward (gradient checkpointing as configured) and each optimizer step.

The prompt is what the config's media budgets admit at their largest: ``media.max_frames``
frames of a 1280x720 video sized by the pixel budgets, or ``media.max_audio_seconds`` of
audio, through the family's processor (the offline tokenizer of the tiny models, one token
per byte of text, so the text part runs a little longer than the real tokenizer's); or
``--prompt-tokens`` in all, the text padded to it. A rank's second and later prompts are a
token shorter, so its batch is padded as a real one is (``--same-length``: not). Rank 0
stands for every rank: the fake process group moves no data, so a collective's result is
computed here as if every rank held rank 0's values.

Fake tensors hold no values, but a forward steers by some (token ids find the media
placeholders, the video grid sizes the vision windows): the small tensors keep their real
values beside their fakes (``KnownValues``), so every branch, shape and mask is the one an
eager run takes with those inputs. A value no input determines (a sampled token, a loss) is
read as 0 and counted. A vision tower's windowed attention is traced as one call over all
its windows (``merge_windows``: the same tensors but for each window's small transient).

Memory is ``torch.distributed._tools``' ``FSDPMemTracker`` (``MemTracker`` without
FSDP2): bytes of live tensor storage per rank, by kind (sharded and gathered parameters,
gradients, optimizer state, activations, temporaries), at each phase's peak, named by the
module running at it and the line that issued its allocation (in a backward, with the
autograd node running: a backward's Python stack ends at the call of ``backward``). The
optimizer state exists from the start (the steady state of step 2 on). It is what the
program allocates, before the CUDA caching allocator's block rounding and fragmentation
(``torch.cuda.memory_reserved`` runs higher). Where the config trains on CUDA, AdamW runs
the kernel the engine picks there (``adamw_kernel``: fused).

Fake CUDA tensors need no GPU to be created, but FSDP2 needs CUDA streams and autograd's
backward a CUDA context, so the sharded trace runs on fake CPU tensors. A second pass
runs the rollout and the update's forwards on fake CUDA tensors, unsharded, with the
weights in the compute dtype FSDP2 casts them to, for the checks (``--checks``):

- device: an operation that mixes CPU tensors (other than 0-dim scalars) with CUDA ones;
- dtype, where the config computes in bf16: a matrix product or attention over fp32
  operands, or an element-wise operation that promotes bf16 activations to fp32;
- host synchronisation inside the decode loop beyond its stop test, one a step: reading
  a CUDA tensor's value on the host (``.item()``, ``.tolist()``, ``bool(t)``, ``int(t)``),
  an operation whose output shape depends on values (``nonzero``, boolean indexing,
  ``torch.equal``), a copy to the host.

Each finding names the operation, its operands and the line of omni_rl (and of the
library beneath it) that issued it. Findings made on purpose (``DELIBERATE``) and those
inside transformers are printed and labelled as such; ``--checks fail`` (the default)
exits non-zero after the tables when there is any other. Prints a table per phase; the last line is
``peak per rank = X GB`` (GB: 2**30 bytes) of the heaviest phase.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import math
import platform
import subprocess
import sys
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import numpy as np
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
)
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakTensorKeyDictionary
from torch_private import (
    Propagation,
    TorchDispatchMode,
    arg_tree_leaves,
    autograd_node,
    fake_constant,
    fake_tolist,
    forget_module,
    join_fake_process_group,
    memory_events,
    module_tracking_without_cycles,
    no_dispatch,
    peak_tracker,
    restart_peak,
    tolist_answered_by,
    track_frozen_shards,
    tree_flatten,
    tree_map,
    tree_map_only,
)

ROOT = Path(__file__).resolve().parent.parent
TOOLS = ROOT / "tools"
MODEL_CONFIGS = TOOLS / "model_configs"
GB = 2**30
T0 = time.perf_counter()
aten = torch.ops.aten
c10d = torch.ops.c10d

# Tensors up to this many elements keep their real values beside their fakes (token ids,
# masks, grids, positions); larger ones (activations, weights, attention masks) never do.
KNOWN_LIMIT = 1 << 22
# Checks ignore operands smaller than this (rotary tables, norms' statistics, scalars).
CHECK_NUMEL = 1 << 16
# products whose last two operands are the matrices [.., M, K] and [.., K, N]
INNER_PRODUCTS = {
    aten.mm.default,
    aten.addmm.default,
    aten.addmm_.default,
    aten.bmm.default,
    aten.baddbmm.default,
    aten.addbmm.default,
}
MATMULS = INNER_PRODUCTS | {
    aten.convolution.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_cudnn_attention.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
}
# casts and copies change dtypes on purpose (FSDP2's fp32 gradient reduction, ``.float()``)
COPIES = {aten._to_copy.default, aten.copy_.default, aten._foreach_copy_.default}
# factories whose values are whatever memory held: never known
UNINITIALIZED = {
    aten.empty.memory_format,
    aten.empty_like.default,
    aten.empty_strided.default,
    aten.new_empty.default,
    aten.new_empty_strided.default,
}
SCALAR_READS = {aten._local_scalar_dense.default, aten.is_nonzero.default, aten.equal.default}
DATA_DEPENDENT = (DataDependentOutputException, DynamicOutputShapeException)


def call_site(torch_parts: tuple[str, ...] = ("/torch/nn/",)) -> str:
    """``path:LINE in fn`` of the innermost project frame (omni_rl, or a test; not the
    tracers' own in tools/) issuing the current operation, after the innermost library
    frame beneath it (transformers, or torch's ``torch_parts``) where there is one:
    ``library <- project``."""
    frames = [f for f in traceback.extract_stack()[:-1] if Path(f.filename).parent != TOOLS]
    frames = [
        f for f in frames if "/site-packages/torch/" not in f.filename or any(p in f.filename for p in torch_parts)
    ]
    frames = [f for f in frames if not f.filename.endswith("/torch/nn/modules/module.py")]  # a module's call

    def project(f) -> bool:
        return f.filename.startswith(str(ROOT)) and "/site-packages/" not in f.filename

    def short(f) -> str:
        path = f.filename
        path = path.split("/site-packages/", 1)[1] if "/site-packages/" in path else str(Path(path).relative_to(ROOT))
        return f"{path}:{f.lineno} in {f.name}"

    ours = [i for i, f in enumerate(frames) if project(f)]
    below = [i for i, f in enumerate(frames) if not project(f) and (not ours or i > ours[-1])]
    sites = [short(frames[below[-1]])] if below and ours else []
    if ours:
        sites.append(short(frames[ours[-1]]))
    return " <- ".join(sites) or "(outside the project)"


def describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}@{value.device}"
    return repr(value)[:40]


# ------------------------------------------------------------------ values under fake tensors


class KnownValues(TorchDispatchMode):
    """Real values of the small tensors a forward steers by, kept beside their fakes.

    Fake tensors hold no data, but the models read some: token ids find the media
    placeholders, ``video_grid_thw.tolist()`` sizes the vision windows, the attention mask
    gives positions and padding. Every operation whose tensor inputs all have known values
    and whose outputs are small is also run on those values (on the CPU); an operation
    whose output shape depends on values (``nonzero``, boolean indexing) takes its shape
    from them. Reading an unknown value (a sampled token, a loss) answers 0, and is
    counted; collectives over the fake process group answer as if every rank held this
    rank's values.
    """

    def __init__(self, world: int):
        super().__init__()
        self.world = world
        self.real = WeakTensorKeyDictionary()
        self.unknown_reads: Counter = Counter()
        self.data_dependent = False  # the last operation needed values for its shape
        self.on_read: Callable | None = None  # told of host reads that bypass dispatch

    def known(self, t) -> bool:
        """A real tensor, or a fake whose value is known here or to the fake mode (which
        keeps the values of one-element tensors made from Python numbers)."""
        return not isinstance(t, FakeTensor) or t in self.real or fake_constant(t) is not None

    def value(self, t):
        if not isinstance(t, FakeTensor):
            return t
        if t in self.real:
            return self.real[t]
        with no_dispatch():  # the fake mode updates its own copy (AdamW's step count)
            return fake_constant(t).clone()

    def tolist(self, t: FakeTensor):
        """``FakeTensor.tolist`` reads element by element (one dispatched read each: 20,000
        for a long prompt's token types); a known tensor is read in one go."""
        if not self.known(t):
            return fake_tolist(t)
        if self.on_read is not None:
            self.on_read("tolist", [t])
        with no_dispatch():
            return self.value(t).tolist()

    def remember(self, fake: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        if isinstance(real, FakeTensor):
            raise AssertionError(f"a fake tensor given as the value of {describe(fake)}")
        if fake.numel() <= KNOWN_LIMIT:
            self.real[fake] = real
        return fake

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.data_dependent = False
        if Propagation.depth:
            return func(*args, **kwargs)
        tensors = [t for t in arg_tree_leaves(*args, **kwargs) if isinstance(t, torch.Tensor)]
        if func._schema.name.startswith("c10d::"):
            return self._collective(func, args, kwargs, tensors)
        # a random operation's values are known when it draws from a generator it is given
        seeded = torch.Tag.nondeterministic_seeded in func.tags and kwargs.get("generator") is None
        if all(self.known(t) for t in tensors) and not seeded and func not in UNINITIALIZED:
            return self._known(func, args, kwargs, tensors)
        if func is aten._local_scalar_dense.default:
            self.unknown_reads[call_site()] += 1
            return False if args[0].dtype == torch.bool else 0
        try:
            out = func(*args, **kwargs)
        except DATA_DEPENDENT:
            out = self._indexed(func, args, kwargs)
            if out is None:
                raise
        self._forget_written(func, args, kwargs)
        return out

    def _known(self, func, args, kwargs, tensors):
        """Run on the values too, when the outputs are small; take shapes from them when
        the fake kernel cannot."""
        fake_out = None
        try:
            fake_out = func(*args, **kwargs)
        except DATA_DEPENDENT:
            self.data_dependent = True
        outs = [t for t in tree_flatten(fake_out)[0] if isinstance(t, torch.Tensor)]
        if fake_out is not None and sum(t.numel() for t in outs) > KNOWN_LIMIT:
            self._forget_written(func, args, kwargs)
            return fake_out
        cpu = torch.device("cpu")
        real_args, real_kwargs = tree_map(
            lambda x: self.value(x) if isinstance(x, torch.Tensor) else (cpu if isinstance(x, torch.device) else x),
            (args, kwargs),
        )
        with no_dispatch():
            real_out = func(*real_args, **real_kwargs)
        if fake_out is None:
            if not any(isinstance(r, torch.Tensor) for r in tree_flatten(real_out)[0]):
                return real_out  # a value read on the host (item, equal)
            device = kwargs.get("device") or next((t.device for t in tensors if isinstance(t, FakeTensor)), cpu)
            fake_out = tree_map_only(torch.Tensor, lambda r: self._fake_like(r, device), real_out)
        for fake, real in zip(tree_flatten(fake_out)[0], tree_flatten(real_out)[0], strict=False):
            if isinstance(fake, FakeTensor) and isinstance(real, torch.Tensor):
                self.remember(fake, real)
        return fake_out

    def _fake_like(self, real: torch.Tensor, device) -> torch.Tensor:
        return torch.empty_strided(real.shape, real.stride(), dtype=real.dtype, device=device)

    def _indexed(self, func, args, kwargs):
        """Boolean indexing of an unknown tensor by a known mask: index by the mask's
        positions instead (the same result; its shape is known)."""
        if func not in (aten.index.Tensor, aten.index_put_.default, aten.index_put.default):
            return None
        indices = args[1]
        if not any(i is not None and i.dtype == torch.bool and self.known(i) for i in indices):
            return None
        positions = []
        for index in indices:
            if index is not None and index.dtype == torch.bool and self.known(index):
                with no_dispatch():
                    columns = self.value(index).nonzero().unbind(1)
                for column in columns:
                    positions.append(self.remember(self._fake_like(column, index.device), column))
            else:
                positions.append(index)
        self.data_dependent = True
        return func(args[0], positions, *args[2:], **kwargs)

    def _forget_written(self, func, args, kwargs) -> None:
        """An operation with unknown inputs that writes into a known tensor makes its
        value unknown."""
        for i, argument in enumerate(func._schema.arguments):
            if argument.alias_info is None or not argument.alias_info.is_write:
                continue
            value = kwargs.get(argument.name, args[i] if i < len(args) else None)
            for t in tree_flatten(value)[0]:
                if isinstance(t, FakeTensor):
                    self.real.pop(t, None)

    def _collective(self, func, args, kwargs, tensors):
        """Collectives over the fake process group, answered as if every rank held this
        rank's values: a sum is N times this rank's value, a maximum this rank's, a
        gather N copies of it."""
        out = func(*args, **kwargs)
        if not all(self.known(t) for t in tensors):
            self._forget_written(func, args, kwargs)
            return out
        name = func._schema.name
        with no_dispatch():
            if name == "c10d::allreduce_":
                op = str(args[2]).upper()
                for t in args[0]:
                    if "SUM" in op:
                        self.value(t).mul_(self.world)
                    elif "PRODUCT" in op:
                        self.value(t).pow_(self.world)
            elif name == "c10d::allgather_":
                for outputs, source in zip(args[0], args[1], strict=True):
                    for t in outputs:
                        self.real[t] = self.value(source).clone()
            elif name == "c10d::_allgather_base_":
                self.real[args[0]] = self.value(args[1]).repeat(self.world, *[1] * (args[1].dim() - 1))
        return out


class TensorsFromTensors(TorchFunctionMode):
    """``torch.tensor([t0, t1, ...])`` of 0-dim tensors reads their storage directly, which
    fake tensors lack: each one's value is read first (``.item()``, as the copy does)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.tensor, torch.as_tensor) and args and isinstance(args[0], list | tuple):
            leaves = tree_flatten(args[0])[0]
            if any(isinstance(x, FakeTensor) for x in leaves):
                args = (tree_map_only(torch.Tensor, lambda t: t.item(), args[0]), *args[1:])
        return func(*args, **kwargs)


class GpuAttention(TorchFunctionMode):
    """``scaled_dot_product_attention`` on fake CUDA tensors, as a GPU runs it. Without a GPU
    to ask, PyTorch's kernel choice falls back to the math kernel (fp32 scores [B, H, L, S]),
    which no GPU run of these shapes uses; here the call goes to the memory-efficient
    kernel, the one that takes a mask (the checks see its operands as a GPU run's)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not torch.nn.functional.scaled_dot_product_attention:
            return func(*args, **kwargs)
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
        given = {**dict(zip(names, args, strict=False)), **kwargs}
        query, key, value = given["query"], given["key"], given["value"]
        if given.get("enable_gqa") and key.shape[1] != query.shape[1]:
            repeats = query.shape[1] // key.shape[1]
            key, value = key.repeat_interleave(repeats, 1), value.repeat_interleave(repeats, 1)
        mask = given.get("attn_mask")
        if mask is not None and mask.dtype == torch.bool:  # as the composite converts it
            mask = torch.zeros_like(mask, dtype=query.dtype).masked_fill(~mask, float("-inf"))
        out = torch.ops.aten._scaled_dot_product_efficient_attention(
            query,
            key,
            value,
            mask,
            query.requires_grad,
            given.get("dropout_p", 0.0),
            bool(given.get("is_causal", False)),
            scale=given.get("scale"),
        )
        return out[0]


SPLIT = torch.split


def one_window(tensor, sizes, dim=0):
    return (tensor,) if isinstance(sizes, list) and len(sizes) > 1 else SPLIT(tensor, sizes, dim)


def merge_windows(model) -> Callable:
    """A vision tower's attention splits its patches into windows (Qwen2.5-VL: about 1,300
    of 64 patches per block at 128 frames) or frames, runs SDPA on each and concatenates
    the outputs; here each attention module runs once over all of them (``torch.split``
    answers one piece inside it, also when gradient checkpointing recomputes it). The
    inputs, the outputs and their concatenation are the same tensors; only each window's
    own transient (under a megabyte) is left out, and the trace runs a thousand times
    fewer operations. Returns the function that restores the modules."""
    patched = []
    for module in model.modules():
        if type(module).__name__.endswith("VisionAttention"):
            forward = module.forward

            def merged(*args, _forward=forward, **kwargs):
                with mock.patch.object(torch, "split", one_window):
                    return _forward(*args, **kwargs)

            module.forward = merged
            patched.append(module)

    def restore():
        for module in patched:
            del module.forward

    return restore


# ------------------------------------------------------------------------------ the checks


def promoted(out) -> bool:
    """An fp32 result large enough to check for promotion (cheap: looked at first)."""
    if isinstance(out, torch.Tensor):
        return out.dtype == torch.float32 and out.numel() >= CHECK_NUMEL
    return isinstance(out, tuple | list) and any(promoted(o) for o in out)


@dataclasses.dataclass(frozen=True)
class Finding:
    """One thing a CUDA run would do wrong, where omni_rl does it."""

    kind: str
    """``device``, ``dtype`` or ``sync``."""
    op: str
    detail: str
    where: str


# Findings made on purpose, by the project function that makes them, and why.
DELIBERATE = {
    ("omni_rl/models/forward.py", "backward"): "the vocabulary head's weight gradient, summed in fp32 over its chunks",
}
# Findings inside this library, beneath our call: not ours to change; the docs name them.
UPSTREAM = "transformers/"


def classify(finding: Finding) -> str:
    """``ours`` (a check failure), ``deliberate`` or ``upstream``."""
    if finding.where.startswith(UPSTREAM):
        return "upstream"
    path, _, rest = finding.where.partition(":")
    if (path, rest.rpartition(" in ")[2]) in DELIBERATE:
        return "deliberate"
    return "ours"


def op_name(func) -> str:
    """An operation's name (``func``: an aten overload, or a name already)."""
    return func if isinstance(func, str) else str(func.overloadpacket.__name__)


class Checks(TorchDispatchMode):
    """Device, dtype and host-synchronisation checks of every operation (module docstring).

    Args:
        values: the ``KnownValues`` mode beneath (it says which operations needed values).
        cuda: the tensors are fake CUDA tensors: check devices and synchronisations.
        bf16: the config computes in bf16: check dtypes.
    """

    def __init__(self, values: KnownValues, cuda: bool, bf16: bool):
        super().__init__()
        self.values, self.cuda, self.bf16 = values, cuda, bf16
        if cuda:
            values.on_read = self._read
        self.findings: dict[Finding, int] = {}
        self.in_decode = False
        self.step_reads: list[Finding] = []  # the host reads of the decode step running
        self.syncs: Counter = Counter()  # (op, where) -> count, outside the decode loop

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if Propagation.depth:
            return func(*args, **kwargs)
        tensors = None
        if self.cuda or func in MATMULS:
            tensors = [t for t in arg_tree_leaves(*args, **kwargs) if isinstance(t, torch.Tensor)]
        if self.cuda:
            args, kwargs = self._devices(func, args, kwargs, tensors)
        if self.bf16 and func in MATMULS:
            self._matmul_dtypes(func, tensors)
        out = func(*args, **kwargs)
        if self.cuda and self._syncs(func, args, kwargs, tensors):
            self._sync(func, tensors)
        if self.bf16 and func not in MATMULS and func not in COPIES and promoted(out):
            tensors = tensors or [t for t in arg_tree_leaves(*args, **kwargs) if isinstance(t, torch.Tensor)]
            self._promotion(func, tensors, out)
        return out

    def add(self, kind: str, func, detail: str) -> None:
        self._count(Finding(kind, op_name(func), detail, call_site()))

    def _count(self, finding: Finding) -> None:
        self.findings[finding] = self.findings.get(finding, 0) + 1

    def decode_step(self) -> None:
        """A step of the decode loop begins (and the one before it ends)."""
        self._end_step()
        self.in_decode = True

    def end_decode(self) -> None:
        """The decode loop is over."""
        self._end_step()
        self.in_decode = False

    def _end_step(self) -> None:
        """One host read a decode step is the loop's stop test; each read of a step that
        made more is a finding."""
        reads = len(self.step_reads)
        if reads > 1:
            for read in self.step_reads:
                self._count(dataclasses.replace(read, detail=f"{read.detail}, one of {reads} in a decode step"))
        self.step_reads = []

    def _devices(self, func, args, kwargs, tensors):
        """CPU tensors beside CUDA ones: a finding, then moved, so the trace goes on and
        reports every such place in one run."""
        on_cuda = any(t.device.type == "cuda" for t in tensors)
        left = [t for t in tensors if t.device.type == "cpu" and t.dim() > 0]
        if not (on_cuda and left):
            return args, kwargs
        self.add("device", func, "CPU operand(s) " + ", ".join(describe(t) for t in left) + " beside CUDA tensors")
        return tree_map_only(
            torch.Tensor, lambda t: t.to("cuda") if t.device.type == "cpu" and t.dim() > 0 else t, (args, kwargs)
        )

    def _syncs(self, func, args, kwargs, tensors) -> bool:
        if not any(t.device.type == "cuda" for t in tensors):
            return False
        if func in SCALAR_READS or func is aten.nonzero.default or self.values.data_dependent:
            return True
        to_host = func in (aten._to_copy.default, aten.copy_.default) and (
            kwargs.get("device") == torch.device("cpu") or (func is aten.copy_.default and args[0].device.type == "cpu")
        )
        return to_host

    def _read(self, name: str, tensors) -> None:
        if any(t.device.type == "cuda" for t in tensors):
            self._sync(name, tensors)

    def _sync(self, func, tensors) -> None:
        detail = "reads " + ", ".join(describe(t) for t in tensors[:3]) + " on the host"
        if self.in_decode:
            self.step_reads.append(Finding("sync", op_name(func), detail, call_site()))
        else:
            self.syncs[op_name(func), call_site()] += 1

    def _matmul_dtypes(self, func, tensors) -> None:
        if func in INNER_PRODUCTS and tensors[-2].shape[-1] < 16:
            return  # an outer product (rotary tables: positions times frequencies, fp32 on purpose)
        fp32 = [t for t in tensors if t.dtype == torch.float32 and t.numel() >= CHECK_NUMEL]
        if fp32:
            self.add("dtype", func, "fp32 operand(s) " + ", ".join(describe(t) for t in fp32) + " in a bf16 run")

    def _promotion(self, func, tensors, out) -> None:
        dtypes = {t.dtype for t in tensors if t.is_floating_point() and t.numel() >= CHECK_NUMEL}
        results = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if {torch.bfloat16, torch.float32} <= dtypes and any(
            r.dtype == torch.float32 and r.numel() >= CHECK_NUMEL for r in results
        ):
            operands = ", ".join(describe(t) for t in tensors if t.numel() >= CHECK_NUMEL)
            self.add("dtype", func, f"bf16 promoted to fp32: {operands}")


# ------------------------------------------------------------------- the model and its inputs


@dataclasses.dataclass
class Architecture:
    """What the trace builds: the model's transformers config, its family, a processor."""

    config: object
    family: object
    processor: object
    source: str
    """Where the config came from."""
    path: Path
    """The checkpoint directory the trace loads from: config.json and the processor, no
    weights (a tiny model's: with them)."""


def model_json(path: str, model_config: Path | None) -> tuple[dict, Path]:
    """(the architecture's fields, the file they came from): ``model_config``, else
    ``path``'s config.json, else ``tools/model_configs/<name of path>.json``."""
    if model_config is None:
        for candidate in (Path(path) / "config.json", MODEL_CONFIGS / f"{Path(path).name}.json"):
            if candidate.is_file():
                model_config = candidate
                break
        else:
            raise SystemExit(f"no config.json for {path}: pass --model-config PATH")
    raw = json.loads(model_config.read_text())
    raw.pop("_source", None)
    return raw, model_config


def architecture(cfg, model_config: Path | None, work: Path) -> Architecture:
    """The config's model without its weights: a tiny model's checkpoint is written (it is
    small) and read back; a released model's config.json is ``model_config``, else the one
    at ``model.path``, else ``tools/model_configs/<name of model.path>.json``. A released
    model gets the offline tokenizer of the tiny models (its vocabulary keeps the model's
    size: only the special tokens' ids change, to that tokenizer's)."""
    from transformers import AutoConfig, AutoProcessor

    from omni_rl.models import build_tiny, family_of
    from omni_rl.models.families import FAMILIES
    from omni_rl.models.tokenizer import build_tokenizer

    if not cfg.model.path and model_config is None:
        out = build_tiny(
            cfg.model.tiny_family,
            work / "tiny_model",
            seed=cfg.run.seed,
            width=cfg.model.tiny_width,
            audio_seconds=cfg.model.tiny_audio_seconds,
        )
        config = AutoConfig.from_pretrained(out, local_files_only=True)
        processor = AutoProcessor.from_pretrained(out, local_files_only=True)
        return Architecture(config, family_of(out), processor, f"tiny {cfg.model.tiny_family} (built here)", out)
    raw, model_config = model_json(cfg.model.path, model_config)
    family = FAMILIES.get(raw["model_type"])
    tokenizer = build_tokenizer(family.tokens)
    tiny = family.tiny_config(tokenizer, 64)
    ids = {k: v for k, v in tiny.to_dict().items() if k.endswith(("_token_id", "_token_index")) and v is not None}
    config = AutoConfig.for_model(**{**raw, **ids})
    processor = family.tiny_processor(tokenizer)
    path = work / "checkpoint"
    config.save_pretrained(path)
    processor.save_pretrained(path)
    source = model_config.resolve()
    source = source.relative_to(ROOT) if source.is_relative_to(ROOT) else source
    return Architecture(config, family, processor, str(source), path)


def load_models(setup: Setup, device: torch.device, fake_mode, world: int) -> tuple:
    """(model, reference or None) as the recipe loads them (``setup_model``: built on the
    meta device when FSDP2 spans several ranks, the vision tower frozen and gradient
    checkpointing as configured, the reference beside), from ``setup.arch.path``, on
    rank 0 of ``world`` (1: the whole model, for the unsharded checks); call
    ``TrainingEngine.from_config`` on them inside ``filled``. Under ``fake_mode`` the
    weights the recipe would read are made by it instead (none are there): a whole model
    is built from its config, in the fake mode (no memory, no values)."""
    import omni_rl.models as models
    from omni_rl.engine.distributed import Ranks
    from omni_rl.recipes.common import Run, setup_model

    cfg = dataclasses.replace(
        setup.cfg, model=dataclasses.replace(setup.cfg.model, path=str(setup.arch.path)), trainer=setup.trainer
    )
    run = Run(setup.arch.path, Ranks(0, world, 0), device, None)

    built = []

    def read(path, family, dtype):
        """The whole model, built on ``device`` (``load`` then moves it there: a no-op
        here, as ``Module.to`` cannot swap fake parameters)."""
        with torch.device(device):
            model = family.model_cls()._from_config(setup.arch.config, dtype=dtype)
        model.to = lambda *args, **kwargs: model
        built.append(model)
        return model

    with fake_mode, contextlib.ExitStack() as stack:
        if not isinstance(fake_mode, contextlib.nullcontext):
            stack.enter_context(mock.patch.object(models, "_read", read))
        torch.manual_seed(cfg.run.seed)
        model, _, reference = setup_model(cfg, run, with_reference=cfg.algorithm.kl_coef > 0)
    for whole in built:
        del whole.to
    return model, reference


@contextlib.contextmanager
def filled(fake_mode):
    """``omni_rl.models.weights.fill`` as every rank runs it once the engine has sharded a
    model built empty, in ``fake_mode``, without the broadcast of rank 0's weights (a fake
    process group carries no data, and there are none to read)."""
    import torch.distributed.checkpoint.state_dict as state_dict

    import omni_rl.models as models
    from omni_rl.models import weights

    def fill(model, device):
        with fake_mode, mock.patch.object(state_dict, "set_model_state_dict", lambda *args, **kwargs: None):
            weights.fill(model, None, device)

    if isinstance(fake_mode, contextlib.nullcontext):
        yield
        return
    with mock.patch.object(models, "fill_sharded", fill):
        yield


def prompt(cfg, arch: Architecture, prompt_tokens: int | None) -> tuple:
    """The sample and its encoded prompt (real CPU tensors) the config's media budgets admit at their
    largest: ``media.max_frames`` frames of a 1280x720 video resized under the pixel
    budgets, or ``media.max_audio_seconds`` of audio, and a question in the config's
    template; with ``prompt_tokens``, the question is padded to that many tokens in all."""
    from omni_rl.data.dataset import Sample, build_messages, encode_sample, render_prompt
    from omni_rl.preprocess.pipeline import Budgets
    from omni_rl.preprocess.rows import Row
    from omni_rl.preprocess.video import VideoClip, resized_size, sample_indices

    budgets = Budgets.from_config(cfg.media)
    kinds, media = [], {}
    if "video" in arch.family.modalities:
        budget = budgets.video
        fps = 30.0
        seconds = math.ceil(budget.max_frames / (budget.fps or 2.0)) + 1
        indices = sample_indices(int(fps * seconds), fps, budget)
        height, width = resized_size(720, 1280, len(indices), budget)
        frames = np.zeros((len(indices), 3, height, width), dtype=np.uint8)
        media["videos"] = [VideoClip(frames, fps, int(fps * seconds), indices, (720, 1280))]
        kinds.append("video")
    elif "audio" in arch.family.modalities:
        media["audios"] = [np.zeros(int(budgets.max_audio_seconds * 16_000), dtype=np.float32)]
        kinds.append("audio")
    options = ["left to right", "right to left", "towards the camera", "it does not move"]
    problem = "Which way does the red object move?"

    def encode(problem: str) -> tuple:
        row = Row("trace", problem, "multiple_choice", "A", fields={"options": options})
        messages = build_messages(render_prompt(cfg.data.prompt_template, row), kinds)
        sample = Sample("trace", "multiple_choice", "A", messages, options=options, **media)
        return sample, dict(encode_sample(arch.processor, sample))

    sample, encoded = encode(problem)
    if prompt_tokens:
        for _ in range(3):  # the offline tokenizer takes about one token per byte of text
            short = prompt_tokens - encoded["input_ids"].shape[1]
            if short <= 0:
                break
            problem = problem + " and" * (short // 4) + "?" * (short % 4)
            sample, encoded = encode(problem)
    return sample, encoded


def real_copy(encoded: dict) -> dict:
    """``encoded`` copied (inside the tracker, which then counts it as the fake copy is)."""
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in encoded.items()}


def fake_copy(encoded: dict, values: KnownValues) -> dict:
    """``encoded`` as fake CPU tensors, the small ones with their values known (the
    recipe keeps encoded prompts on the CPU; its forwards move them)."""
    out = {}
    for key, value in encoded.items():
        if isinstance(value, torch.Tensor):
            fake = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype)
            out[key] = values.remember(fake, value) if value.numel() <= KNOWN_LIMIT else fake
        else:
            out[key] = value
    return out


# ---------------------------------------------------------------------------- the phases


def kernel_of(optimizer, target: str) -> None:
    """AdamW's kernel set to the one the engine picks on ``target`` (the trace builds
    the engine on the CPU, where it picks another)."""
    from omni_rl.engine.config import adamw_kernel

    if isinstance(optimizer, torch.optim.AdamW):
        kernel = adamw_kernel(torch.device(target))
        for group in optimizer.param_groups:
            group["foreach"], group["fused"] = kernel == "foreach", kernel == "fused"


def tracker_for(model, optimizer, fsdp: bool):
    """The memory tracker of a trace (``torch_private.peak_tracker``), standing aside
    during DTensor's sharding propagation, and noting the line that issued each new
    peak's operation (``peak_site``)."""
    return peak_tracker(model, optimizer, fsdp, stand_aside=lambda: Propagation.depth > 0, where=peak_site)


def peak_site() -> str:
    """``call_site`` with FSDP2's frames too (its hooks allocate in a backward), and in a
    backward the autograd node running (a backward's Python stack ends at the call of
    ``backward`` or a hook)."""
    node = autograd_node()
    return call_site(("/torch/nn/", "/torch/distributed/fsdp/")) + (f", in {node}" if node else "")


def module_label(name: str | None, backward: bool) -> str:
    """``model.layers.3.mlp (backward)`` for the module ``ModTracker`` names
    ``Qwen2_5_VLForConditionalGeneration.model.layers.3.mlp`` (``tracker.running``)."""
    if name is None:
        return "outside any module" + (" (backward)" if backward else "")
    inside = name.partition(".")[2] or "the model itself"
    return f"{inside} ({'backward' if backward else 'forward'})"


class StopDecode(Exception):
    """Raised before decode step K+1: the loop's later steps repeat the same shapes."""


@dataclasses.dataclass
class Phase:
    """One phase's peak: bytes by kind at the moment of its highest total."""

    name: str
    device: str
    peak: dict[str, int] = dataclasses.field(default_factory=dict)
    start: int = 0
    """Total bytes live when the phase (its heaviest occurrence) began."""
    rise: int = 0
    """The most bytes any occurrence allocated above what was live when it began."""
    seconds: float = 0.0
    count: int = 0
    at: str | None = None
    """The module running at the peak (``module_label``)."""
    site: str | None = None
    """The line that issued the peak's operation (``peak_site``)."""

    @property
    def total(self) -> int:
        return self.peak.get("Total", 0)


class Phases:
    """Which phase of the step runs now, and the tracker's peak within each."""

    def __init__(self, tracker, device: str, marks: bool = False):
        self.tracker, self.device = tracker, device
        self.done: dict[str, Phase] = {}
        self.current: str | None = None
        self.started = 0.0
        self.start_total = 0
        self.marks = marks  # profiler ranges named after the phases (real runs)
        self.mark = None

    def _total(self, snapshot: dict) -> dict[str, int]:
        merged: Counter = Counter()
        for per_device in snapshot.values():
            merged.update({str(getattr(k, "value", k)): v for k, v in per_device.items()})
        return dict(merged)

    def enter(self, name: str) -> None:
        if name == self.current:
            return
        self.close()
        self.current, self.started = name, time.perf_counter()
        print(f"[trace] {name} ({self.device}) at {time.perf_counter() - T0:.0f} s", file=sys.stderr, flush=True)
        if self.marks:
            self.mark = torch.autograd.profiler.record_function(f"phase:{name}")
            self.mark.__enter__()
        # the trackers keep one peak since they started: start this phase's from now
        self.start_total = self._total(restart_peak(self.tracker)).get("Total", 0)

    def close(self) -> None:
        if self.current is None:
            return
        peak = self._total(self.tracker.get_tracker_snapshot("peak"))
        phase = self.done.setdefault(self.current, Phase(self.current, self.device))
        phase.seconds += time.perf_counter() - self.started
        phase.count += 1
        phase.rise = max(phase.rise, peak.get("Total", 0) - self.start_total)
        if peak.get("Total", 0) >= phase.total:
            phase.peak, phase.start = peak, self.start_total
            running = self.tracker.running
            phase.at = module_label(*running) if running else None
            phase.site = self.tracker.site
        if self.mark is not None:
            self.mark.__exit__(None, None, None)
            self.mark = None
        self.current = None


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


def rollout_phase(model, arch, batch, cfg):
    """This rank's prompts through ``HFRolloutEngine.rollout`` until ``StopDecode``."""
    from omni_rl.rollout.hf import HFRolloutEngine, SamplingParams

    engine = HFRolloutEngine(model, arch.processor)
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
        t = {}
        for k, v in real.items():
            t[k] = known.remember(torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=device), v)
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
        return grpo.Batch([self.sample] * self.prompts, encoded, seeds)

    def kept(self):
        from omni_rl.models import placeholder_token_ids
        from omni_rl.models.forward import SamplingFilter

        r = self.cfg.rollout
        return SamplingFilter(tuple(placeholder_token_ids(self.arch.processor)), r.top_k, r.top_p)


def eager_masks(values: KnownValues):
    """transformers takes a fake tensor for a compiler's trace and then always builds the
    attention masks that eager mode skips (no padding: causal SDPA, no mask); here it
    decides from the values, as in eager mode, wherever they are known."""
    import transformers.masking_utils

    def is_tracing(tensor=None) -> bool:
        return tensor is not None and not values.known(tensor)

    return mock.patch.object(transformers.masking_utils, "is_tracing", is_tracing)


def rank0_row(row: dict) -> dict:
    """``distributed.mean_metrics`` of ranks that all hold this rank's row: the row. (The
    fake process group moves no bytes, and ``all_gather_object`` unpickles what it
    gathers, which fake tensors do not hold.)"""
    return dict(row)


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
    model, reference = load_models(setup, cpu, fake_mode, setup.world)
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
        rollout_phase(engine.module, setup.arch, batch, cfg)
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
    model, _ = load_models(setup, cuda, fake_mode, world=1)
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

KINDS = (
    ("Sharded Param", "params (shard)"),
    ("Unsharded Param", "params (gathered)"),
    ("Parameter", "params"),
    ("Buffer", "buffers"),
    ("Sharded Grad", "grads (shard)"),
    ("Unsharded Grad", "grads (gathered)"),
    ("Gradient", "grads"),
    ("Grad", "grads"),
    ("OptState", "optimizer state"),
    ("Optstate", "optimizer state"),
    ("All Gather", "all-gather buffers"),
    ("Reduce Scatter", "reduce-scatter buffers"),
    ("Inputs", "inputs"),
    ("Activation", "activations"),
    ("Temp", "temporaries"),
)


def provenance() -> str:
    """When, at which commit, on what: for the results page."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True)
        commit += " (with local changes)" if dirty.stdout.strip() else ""
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    machine = f"{platform.machine()}, {platform.processor() or 'cpu'}, torch {torch.__version__}"
    return f"{when}, commit {commit}, {machine}, fake tensors (no GPU)"


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
    for phase in phases.values():
        print(
            f"\nphase {phase.name}: ran on {phase.device}, {phase.count}x, {phase.seconds:.1f} s; "
            f"live at its start {phase.start / GB:.2f} GB"
        )
        shown: Counter = Counter()
        for key, label in KINDS:
            shown[label] += phase.peak.get(key, 0)
        for label, value in shown.items():
            if value:
                print(f"  {label:<24}{value / GB:>9.2f} GB")
        print(f"  {'peak':<24}{phase.total / GB:>9.2f} GB" + (f"  at {phase.at}" if phase.at else ""))
        if phase.site:
            print(f"  {'issued by':<24}{phase.site}")
    for c in checks:
        where = "fake CUDA, unsharded" if c.cuda else "fake CPU, sharded"
        reads = sum(c.syncs.values())
        print(f"\nchecks on {where}: {len(failures(c))} finding(s); {reads} host read(s) outside the decode loop")
        for (op, site), count in sorted(c.syncs.items(), key=lambda kv: -kv[1])[:8]:
            print(f"  host read {op} x{count} at {site}")
        for f, count in c.findings.items():
            label = {"ours": "", "deliberate": " (deliberate)", "upstream": " (in transformers)"}[classify(f)]
            print(f"  [{f.kind}]{label} {f.op} x{count}: {f.detail}\n      at {f.where}")
    print(f"\ntraced in {seconds:.0f} s on fake tensors (no weights, no GPU)")
    heaviest = max(phases.values(), key=lambda p: p.total)
    print(f"heaviest phase: {heaviest.name}")
    print(f"peak per rank = {heaviest.total / GB:.2f} GB")


def failures(checks: Checks) -> list[Finding]:
    """The findings that fail the run: neither deliberate nor inside transformers."""
    return [f for f in checks.findings if classify(f) == "ours"]


def as_json(setup: Setup, phases: dict[str, Phase], checks: list[Checks], info: dict) -> dict:
    return {
        "provenance": provenance(),
        "world": setup.world,
        "prompt_tokens": int(setup.encoded["input_ids"].shape[1]),
        "phases": {
            p.name: {
                "device": p.device,
                "peak": p.peak,
                "start": p.start,
                "rise": p.rise,
                "count": p.count,
                "at": p.at,
                "site": p.site,
            }
            for p in phases.values()
        },
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
    if resolve_strategy(trainer.strategy, world) != "single":
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
