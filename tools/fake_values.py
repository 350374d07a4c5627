"""Fake tensors that keep the values a forward steers by: the value half of the memory
tracers (``tools/trace_memory.py``, ``tools/trace_flow.py``).

Fake tensors hold no data, but a model's forward reads some: token ids find the media
placeholders, the video grid sizes the vision windows, the attention mask gives positions
and padding. ``KnownValues`` keeps the real values of the small tensors beside their
fakes and runs every operation on known inputs on those values too, so each branch, shape
and mask is the one an eager run takes with those inputs. A value no input determines (a
sampled token, a loss) reads as 0 and is counted. The other helpers here close the gaps
where transformers or PyTorch look at values another way (``torch.tensor`` of 0-dim
tensors, the masks' tracing test, a vision tower's per-window attention).
"""

from __future__ import annotations

import traceback
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException, FakeTensor
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakTensorKeyDictionary
from torch_private import (
    Propagation,
    TorchDispatchMode,
    arg_tree_leaves,
    fake_constant,
    fake_tolist,
    no_dispatch,
    tree_flatten,
    tree_map,
    tree_map_only,
)

ROOT = Path(__file__).resolve().parent.parent
TOOLS = ROOT / "tools"
aten = torch.ops.aten

# Tensors up to this many elements keep their real values beside their fakes (token ids,
# masks, grids, positions); larger ones (activations, weights, attention masks) never do.
KNOWN_LIMIT = 1 << 22
# factories whose values are whatever memory held: never known
UNINITIALIZED = {
    aten.empty.memory_format,
    aten.empty_like.default,
    aten.empty_strided.default,
    aten.new_empty.default,
    aten.new_empty_strided.default,
}
DATA_DEPENDENT = (DataDependentOutputException, DynamicOutputShapeException)
# reads of one element on the host (``is_nonzero`` reaches the modes as itself, not as
# ``_local_scalar_dense``, when it runs in inference mode, as the hf rollout's decoding does)
HOST_READS = {aten._local_scalar_dense.default, aten.is_nonzero.default, aten.item.default}
# ``Tensor.to``'s composite overloads: in inference mode they reach the modes as
# themselves, and the fake mode would run one that moves a value it keeps (a
# ``torch.tensor(..., device='cuda')``) on the real device; decomposed, it is the
# ``_to_copy`` no_grad gives, which the fake mode answers without the device
DEVICE_MOVES = {aten.to.dtype_layout, aten.to.device, aten.to.dtype, aten.to.other}


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
        if func in DEVICE_MOVES:
            with self:
                return func.decompose(*args, **kwargs)
        tensors = [t for t in arg_tree_leaves(*args, **kwargs) if isinstance(t, torch.Tensor)]
        if func._schema.name.startswith("c10d::"):
            return self._collective(func, args, kwargs, tensors)
        # a random operation's values are known when it draws from a generator it is given
        seeded = torch.Tag.nondeterministic_seeded in func.tags and kwargs.get("generator") is None
        if all(self.known(t) for t in tensors) and not seeded and func not in UNINITIALIZED:
            return self._known(func, args, kwargs, tensors)
        if func in HOST_READS:
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

    def fake_of(self, real: torch.Tensor, device=None) -> torch.Tensor:
        """A fake tensor like ``real`` (on ``device``), its value known when it is small;
        call in the fake mode."""
        return self.remember(self._fake_like(real, device or real.device), real)


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


def eager_masks(values: KnownValues):
    """transformers takes a fake tensor for a compiler's trace and then always builds the
    attention masks that eager mode skips (no padding: causal SDPA, no mask); here it
    decides from the values, as in eager mode, wherever they are known."""
    import transformers.masking_utils

    def is_tracing(tensor=None) -> bool:
        return tensor is not None and not values.known(tensor)

    return mock.patch.object(transformers.masking_utils, "is_tracing", is_tracing)


def fake_copy(encoded: dict, values: KnownValues) -> dict:
    """``encoded`` as fake CPU tensors, the small ones with their values known (the
    recipe keeps encoded prompts on the CPU; its forwards move them)."""
    return {k: values.fake_of(v) if isinstance(v, torch.Tensor) else v for k, v in encoded.items()}
