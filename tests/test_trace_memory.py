"""tools/trace_memory.py: its fake-tensor trace of a tiny GRPO step against the same step run
on real CPU tensors, and its checks on fake CUDA tensors."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "trace_memory.py"
# a tiny Qwen2.5-VL 256 wide (its activations in megabytes, not kilobytes) and a 1,024-token
# prompt with the config's video: 4 prompts x 8 completions x 16 tokens, 2 decode steps
TINY = ["configs/grpo_tiny_shapes.yaml", "--set", "model.tiny_width=256", "--prompt-tokens", "1024"]
MB = 2**20


def trace(tmp_path: Path, *args: str) -> tuple[list[str], dict]:
    """Run the tool on the tiny config; (stdout lines, its --json figures)."""
    out = tmp_path / f"trace{len(list(tmp_path.iterdir()))}.json"
    command = [sys.executable, str(TOOL), *TINY, "--json", str(out), *args]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines(), json.loads(out.read_text())


def test_the_trace_matches_the_step_on_real_tensors(tmp_path):
    """The fake trace against the same step run on real CPU tensors. What each phase
    allocates above what it started with, against the CPU allocator's own account (the
    profiler's memory events, independent of the tracker): within 5%, and 256 KiB or 1% of
    the phase's peak; the phases' peaks, against the tracker on the real tensors: within 8%.
    (The rollout's phases agree to the byte with the tracker and within 1% with the
    allocator; in the update and the step the real tensors keep one more 8 MB activation of
    the prompt's last layer alive, 3% of the update's peak and 7% of the step's. The step
    allocates 2 MB above what it starts with, 2% of its peak: under torch 2.14 the fake
    tensors free an activation while the gradients are clipped, so the trace's rise is
    0.9 MB short of the allocator's, and its peak still within 8% of the real one.)"""
    lines, fake = trace(tmp_path, "--world", "1")
    assert lines[-1].startswith("peak per rank = ") and lines[-1].endswith(" GB")
    _, real = trace(tmp_path, "--world", "1", "--real")
    allocator = real["info"]["allocator_rise"]
    assert set(fake["phases"]) == set(real["phases"]) >= {"rollout/prefill", "rollout/decode", "update", "step"}
    for name, phase in fake["phases"].items():
        assert phase["device"] == "cpu (fake)" and real["phases"][name]["device"] == "cpu"
        measured, total = allocator[name], real["phases"][name]["peak"]["Total"]
        assert abs(phase["rise"] - measured) <= 0.05 * measured + max(MB / 4, 0.01 * total), (
            name,
            phase["rise"],
            measured,
        )
        assert abs(phase["peak"]["Total"] - total) <= 0.08 * total, (name, phase["peak"]["Total"], total)
    heaviest = max(phase["peak"]["Total"] for phase in fake["phases"].values())
    assert lines[-1] == f"peak per rank = {heaviest / 2**30:.2f} GB"


def test_the_trace_shards_over_two_ranks(tmp_path):
    """Under FSDP2 over a fake process group of 2, a rank holds half of each parameter."""
    _, one = trace(tmp_path, "--world", "1", "--set", "trainer.strategy=fsdp")
    _, two = trace(tmp_path, "--world", "2")
    for figures in (one, two):
        assert figures["info"]["strategy"] == "fsdp"
    shard = {n: f["phases"]["step"]["peak"]["Sharded Param"] for n, f in (("1", one), ("2", two))}
    assert shard["2"] == pytest.approx(shard["1"] / 2, rel=0.02)  # (each shard is padded to whole rows)


def test_a_cuda_config_is_checked_on_fake_cuda_tensors(tmp_path):
    """A CUDA config's step runs again unsharded on fake CUDA tensors under the checks:
    the hf rollout's decoding there runs in inference mode, where ``torch.tensor(...,
    device='cuda')`` reaches the modes as ``aten.to.dtype_layout`` (the tracer must not
    run it on a real GPU, which this machine lacks)."""
    lines, _ = trace(tmp_path, "--world", "2", "--set", "run.device=cuda")
    assert any(line.startswith("checks on fake CUDA, unsharded: 0 finding(s);") for line in lines), lines[-4:]
    assert lines[-1].startswith("peak per rank = ")


@pytest.fixture(scope="module")
def tool():
    """The tracer's modules beside it in tools/ (checks, values, phases), as one namespace."""
    sys.path.insert(0, str(TOOL.parent))
    try:
        modules = [importlib.import_module(name) for name in ("fake_values", "trace_checks", "trace_phases")]
    finally:
        sys.path.remove(str(TOOL.parent))
    return SimpleNamespace(**{k: v for m in modules for k, v in vars(m).items() if not k.startswith("_")})


def run_checked(tool, fn, bf16: bool = False, decode: bool = False):
    """``fn()`` on fake CUDA tensors under the tool's checks; returns the findings."""
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    values = tool.KnownValues(world=1)
    checks = tool.Checks(values, cuda=True, bf16=bf16)
    with fake_mode, values, checks:
        if decode:
            checks.decode_step()
        fn()
        checks.end_decode()
    return list(checks.findings)


def test_a_tensor_left_on_the_cpu_is_found(tool):
    def step():
        logits = torch.zeros(4, 1000, device="cuda")
        banned = torch.zeros(1000)  # left on the CPU: a CUDA run fails or copies here
        logits + banned

    (finding,) = run_checked(tool, step)
    assert finding.kind == "device" and finding.op == "add"
    assert "float32[1000]@cpu" in finding.detail
    assert finding.where.startswith("tests/test_trace_memory.py:")  # the line that did it
    # a 0-dim CPU tensor is a scalar, which CUDA kernels take: no finding
    assert run_checked(tool, lambda: torch.zeros(4, device="cuda") * torch.tensor(2.0)) == []


def test_a_second_host_read_in_a_decode_step_is_found(tool):
    def stop_test():
        finished = torch.zeros(16, dtype=torch.bool, device="cuda")
        bool(finished.all())

    def two_reads():
        stop_test()
        int(torch.zeros(1, dtype=torch.int64, device="cuda").max())

    assert run_checked(tool, stop_test, decode=True) == []  # the loop's one read a step
    found = run_checked(tool, two_reads, decode=True)
    assert len(found) == 2 and all(f.kind == "sync" and "one of 2 in a decode step" in f.detail for f in found)
    assert run_checked(tool, two_reads, decode=False) == []  # outside the loop: counted, not a finding


def test_a_finding_under_the_memory_tracker_names_the_line_that_issued_it(tool):
    """The tracker's dispatch (in tools/torch_private.py) sits between the line and the
    checks: the finding still names the line, so deliberate ones are recognised."""
    model = torch.nn.Linear(8, 8)
    tracker = tool.tracker_for(model, torch.optim.AdamW(model.parameters()), fsdp=False)

    def step():
        with tracker:
            torch.zeros(4, 1000, device="cuda") + torch.zeros(1000)

    (finding,) = run_checked(tool, step)
    assert finding.where.startswith("tests/test_trace_memory.py:"), finding.where


def test_an_fp32_matmul_in_a_bf16_run_is_found(tool):
    def step():
        weight = torch.zeros(512, 512, device="cuda", dtype=torch.bfloat16)
        hidden = torch.zeros(256, 512, device="cuda")
        hidden.to(torch.bfloat16) @ weight  # as the run means it
        hidden @ weight.float()  # an fp32 product of a 512 x 512 weight

    (finding,) = run_checked(tool, step, bf16=True)
    assert finding.kind == "dtype" and finding.op == "mm" and "fp32" in finding.detail


def test_only_our_own_unintended_findings_fail_a_trace(tool):
    """The fp32 head-gradient sum is deliberate, what transformers does beneath our call
    is upstream; anything else in omni_rl fails the trace."""
    head = tool.Finding("dtype", "addmm_", "fp32 operand(s)", "omni_rl/models/forward.py:255 in backward")
    window = tool.Finding(
        "device",
        "index",
        "CPU operand(s)",
        "transformers/models/qwen2_5_vl/m.py:424 in f <- omni_rl/models/forward.py:318 in prefill",
    )
    ours = tool.Finding("dtype", "mm", "fp32 operand(s)", "omni_rl/models/forward.py:300 in completion_logprobs")
    assert [tool.classify(f) for f in (head, window, ours)] == ["deliberate", "upstream", "ours"]


def test_the_module_at_a_peak_is_labelled_from_the_root_down(tool):
    name = "Qwen2_5_VLForConditionalGeneration.model.layers.3.mlp"
    assert tool.module_label(name, backward=True) == "model.layers.3.mlp (backward)"
    assert tool.module_label("Qwen2_5_VLForConditionalGeneration", backward=False) == "the model itself (forward)"
    assert tool.module_label(None, backward=False) == "outside any module"
    assert tool.module_label(None, backward=True) == "outside any module (backward)"
