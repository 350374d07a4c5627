"""tools/trace_memory.py on a flow_ppo config with a pi0 policy (tools/trace_flow.py): a
tiny pi0 on PixelTargets over a fake process group of 2, its phases, its shards and the
demonstrations it counts on the device."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from omni_rl.models.pi0 import build_tiny_pi0

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "trace_memory.py"


@pytest.fixture(scope="module")
def tiny_pi0(tmp_path_factory):
    return build_tiny_pi0(tmp_path_factory.mktemp("pi0"), seed=0)


@pytest.fixture(scope="module")
def pi0_trace(tmp_path_factory, tiny_pi0):
    """The tiny pi0 config traced with 1,000 demonstration chunks: (lines, figures)."""
    return trace(tmp_path_factory.mktemp("pi0_trace"), tiny_pi0, "--demo-chunks", "1000")


def trace(tmp_path: Path, pi0: Path, *args: str) -> tuple[list[str], dict]:
    """(stdout lines, --json figures) of the tiny pi0 config traced over 2 ranks."""
    out = tmp_path / f"trace{len(list(tmp_path.iterdir()))}.json"
    config = ["configs/pixel_targets_pi0_tiny.yaml", "--set", f"policy.path={pi0}", "--set", "bc.demos=demos"]
    sharded = ["--set", "trainer.strategy=fsdp", "--world", "2"]
    command = [sys.executable, str(TOOL), *config, *sharded, "--json", str(out), *args]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines(), json.loads(out.read_text())


def test_a_pi0_run_is_traced_phase_by_phase(tmp_path, tiny_pi0, pi0_trace):
    """BC's step, the rollout and the PPO update each have a peak; a rank holds half the
    fp32 weights; the demonstrations sit on the device in BC: 3,000 more chunks of
    PixelTargets' 3,081-number observations (and 8x2 actions) raise BC's peak by their
    bytes."""
    lines, few = pi0_trace
    assert lines[-1].startswith("peak per rank = ") and lines[-1].endswith(" GB")
    phases = few["phases"]
    assert set(phases) == {"bc", "bc/step", "rollout", "update", "update/step"}
    assert all(p["peak"]["Total"] > 0 for p in phases.values())
    params = few["info"]["params"]
    assert phases["update/step"]["peak"]["Sharded Param"] == pytest.approx(params * 4 / 2, rel=0.02)
    assert few["info"]["trainable_bc"] > few["info"]["trainable_ppo"]  # the VLM trains in BC only

    _, many = trace(tmp_path, tiny_pi0, "--demo-chunks", "4000")
    obs_numbers = 3 * 32 * 32 + 1 + 2 + 6  # image, instruction, state, privileged
    demo_bytes = 3000 * (obs_numbers * 4 + 8 * 2 * 4 + 8)
    rise = many["phases"]["bc"]["peak"]["Total"] - phases["bc"]["peak"]["Total"]
    assert rise == pytest.approx(demo_bytes, rel=0.02)


def test_a_pi05_run_is_traced_with_its_state_in_the_prompt(tmp_path, pi0_trace):
    """``policy.type: pi05`` traces PI05 (built from its own config class) through the
    same phases; its prefix is longer than pi_0's by the state written into the prompt."""
    from omni_rl.models.pi05 import build_tiny_pi05

    pi05 = build_tiny_pi05(tmp_path / "pi05", seed=0)
    lines, figures = trace(tmp_path, pi05, "--demo-chunks", "1000", "--set", "policy.type=pi05")
    assert any(line.startswith("model: PI05 from ") for line in lines)
    assert set(figures["phases"]) == {"bc", "bc/step", "rollout", "update", "update/step"}
    params = figures["info"]["params"]
    assert figures["phases"]["update/step"]["peak"]["Sharded Param"] == pytest.approx(params * 4 / 2, rel=0.02)
    _, pi0 = pi0_trace
    assert figures["info"]["prefix_tokens"] > pi0["info"]["prefix_tokens"]
