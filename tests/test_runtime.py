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
