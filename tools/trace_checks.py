"""The device, dtype and host-synchronisation checks of ``tools/trace_memory.py``.

They watch every operation of a step run on fake CUDA tensors (``Checks``, a dispatch
mode above ``fake_values.KnownValues``):

- device: an operation that mixes CPU tensors (other than 0-dim scalars) with CUDA ones;
- dtype, where the config computes in bf16: a matrix product or attention over fp32
  operands, or an element-wise operation that promotes bf16 activations to fp32;
- host synchronisation inside the decode loop beyond its stop test, one a step: reading
  a CUDA tensor's value on the host (``.item()``, ``.tolist()``, ``bool(t)``, ``int(t)``),
  an operation whose output shape depends on values (``nonzero``, boolean indexing,
  ``torch.equal``), a copy to the host.

Each finding names the operation, its operands and the line of omni_rl (and of the
library beneath it) that issued it. Findings made on purpose (``DELIBERATE``) and those
inside transformers are labelled as such; only the others fail a trace (``failures``).
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import torch
from fake_values import KnownValues, call_site, describe
from torch.overrides import TorchFunctionMode
from torch_private import Propagation, TorchDispatchMode, arg_tree_leaves, tree_flatten, tree_map_only

aten = torch.ops.aten

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
SCALAR_READS = {aten._local_scalar_dense.default, aten.is_nonzero.default, aten.equal.default}


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


def failures(checks: Checks) -> list[Finding]:
    """The findings that fail the run: neither deliberate nor inside transformers."""
    return [f for f in checks.findings if classify(f) == "ours"]


def print_checks(checks: Checks) -> None:
    """The findings, each labelled with its class, and the host reads outside the decode loop."""
    where = "fake CUDA, unsharded" if checks.cuda else "fake CPU, sharded"
    reads = sum(checks.syncs.values())
    print(f"\nchecks on {where}: {len(failures(checks))} finding(s); {reads} host read(s) outside the decode loop")
    for (op, site), count in sorted(checks.syncs.items(), key=lambda kv: -kv[1])[:8]:
        print(f"  host read {op} x{count} at {site}")
    for f, count in checks.findings.items():
        label = {"ours": "", "deliberate": " (deliberate)", "upstream": " (in transformers)"}[classify(f)]
        print(f"  [{f.kind}]{label} {f.op} x{count}: {f.detail}\n      at {f.where}")
