import json
import os
import platform
import subprocess
import sys

import pytest
import torch

from omni_rl.errors import OmniRLError
from omni_rl.runtime import resolve_device, resolve_dtype, seed_everything, set_threads


def test_set_threads_from_argument_and_environment(monkeypatch):
    before = torch.get_num_threads()
    try:
        assert set_threads(1) == 1
        monkeypatch.setenv("OMNI_RL_THREADS", "2")
        assert set_threads() == 2
        monkeypatch.setenv("OMNI_RL_THREADS", "two")
        with pytest.raises(OmniRLError, match="OMNI_RL_THREADS='two'"):
            set_threads()
    finally:
        torch.set_num_threads(before)


def test_device_and_dtype_resolution():
    cpu = torch.device("cpu")
    assert resolve_dtype("auto", cpu) == torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("bfloat16", cpu) == torch.bfloat16
    assert resolve_device("cpu") == cpu
    if not torch.cuda.is_available():
        assert resolve_device("auto") == cpu
        with pytest.raises(OmniRLError, match="no CUDA device"):
            resolve_device("cuda")


def test_seed_everything_repeats_draws():
    seed_everything(3)
    a = torch.rand(4)
    seed_everything(3)
    assert torch.equal(a, torch.rand(4))


# A softmax row of 513 floats: ATen's AVX2 and AVX-512 kernels sum it in another order,
# so its bits tell which kernel level ran.
KERNEL_PROBE = """
import hashlib, json, logging, sys, torch
from omni_rl.runtime import RunConfig, apply_run_settings
logging.basicConfig(level=logging.WARNING)
if sys.argv[2] == "compute-first":
    torch.softmax(torch.randn(3, 513), -1)
settings = apply_run_settings(RunConfig(threads=1, cpu_kernels=sys.argv[1]))
torch.manual_seed(0)
x = torch.softmax(torch.randn(257, 513), -1)
print(json.dumps({**settings, "bits": hashlib.sha256(x.numpy().tobytes()).hexdigest()}))
"""


X86 = platform.machine().lower() in ("x86_64", "amd64")


def _probe(kernels: str, order: str = "pin-first", **env) -> tuple[dict, str]:
    clean = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_CBWR")}
    done = subprocess.run(
        [sys.executable, "-c", KERNEL_PROBE, kernels, order],
        env={**clean, **env},
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def test_avx2_kernels_give_the_numbers_of_a_cpu_without_avx512():
    if not X86:
        pytest.skip("kernel levels are an x86-64 matter")
    pinned, log = _probe("avx2")
    assert pinned["cpu_kernels"] == "AVX2" and pinned["threads"] == 1 and "cpu_kernels" not in log
    # a process whose CPU offers no more than AVX2 from its start (what ATEN_CPU_CAPABILITY emulates)
    avx2_machine, _ = _probe("native", ATEN_CPU_CAPABILITY="avx2")
    assert avx2_machine["cpu_kernels"] == "AVX2" and avx2_machine["bits"] == pinned["bits"]
    native, _ = _probe("native")
    if native["cpu_kernels"] != "AVX2":  # a CPU with AVX-512: the wider kernels round otherwise
        assert native["bits"] != pinned["bits"]


def test_a_pin_that_comes_too_late_is_said():
    if not X86:
        pytest.skip("kernel levels are an x86-64 matter")
    native, _ = _probe("native")
    if native["cpu_kernels"] == "AVX2":
        pytest.skip("this CPU has no kernel level above AVX2, so no pin can come too late")
    late, log = _probe("avx2", "compute-first")
    assert late["cpu_kernels"] == native["cpu_kernels"]
    assert "run.cpu_kernels=avx2: torch's CPU kernels run at" in log


def test_a_pin_that_comes_too_late_leaves_the_environment_of_later_processes_alone(monkeypatch):
    from omni_rl.runtime import AVX2_KERNELS, pin_cpu_kernels

    for name in AVX2_KERNELS:
        monkeypatch.delenv(name, raising=False)
    torch.softmax(torch.randn(2, 8), -1)  # this process computes at its level from now on
    if pin_cpu_kernels("avx2") != "AVX2":
        assert not any(name in os.environ for name in AVX2_KERNELS)
    else:  # the process already ran AVX2 kernels: its children are pinned the same way
        assert all(os.environ.get(name) == value for name, value in AVX2_KERNELS.items())


def test_expandable_segments_on_cuda_unless_the_user_chose(monkeypatch):
    from omni_rl import runtime

    monkeypatch.setenv(runtime.ALLOC_CONF, "")  # so that teardown restores the variable as it was
    monkeypatch.delenv(runtime.ALLOC_CONF)
    monkeypatch.delenv(runtime.ALLOC_CONF_NEW, raising=False)
    monkeypatch.setattr(runtime.torch.cuda, "is_available", lambda: False)
    assert runtime.use_expandable_segments() is None and runtime.ALLOC_CONF not in os.environ
    monkeypatch.setattr(runtime.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(runtime.torch.cuda, "is_initialized", lambda: False)
    assert runtime.use_expandable_segments() == "expandable_segments:True" == os.environ[runtime.ALLOC_CONF]
    monkeypatch.setenv(runtime.ALLOC_CONF, "max_split_size_mb:128")
    assert runtime.use_expandable_segments() == "max_split_size_mb:128"  # the user's setting stands
    monkeypatch.delenv(runtime.ALLOC_CONF)
    monkeypatch.setenv(runtime.ALLOC_CONF_NEW, "")  # torch's newer name, set to nothing: an opt-out
    assert runtime.use_expandable_segments() == "" and runtime.ALLOC_CONF not in os.environ
