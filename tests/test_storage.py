"""What a run leaves on disk when the disk fills or a checkpoint is damaged: a full disk
stops preprocess, cache writes and checkpoints at once with one line (path and bytes),
leaving no temporary file and the earlier cache or checkpoint whole; ``--resume auto``
passes over a damaged checkpoint to the newest complete one; the best model is replaced
only by a whole export.

A full disk is simulated by making the writer raise what the OS raises: an ``OSError``
with ENOSPC or EDQUOT, or safetensors' own error carrying that message (its Rust writer
does not raise ``OSError``), after writing part of the file, as a real full disk does.
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import SafetensorError

from omni_rl.cli import main
from omni_rl.config import save_config
from omni_rl.engine import checkpoint
from omni_rl.engine.config import AdamWConfig
from omni_rl.engine.engine import TrainingEngine
from omni_rl.errors import OmniRLError
from omni_rl.evaluation.during_training import HeldOut
from omni_rl.models.flow_policy import FlowPolicy, StateBackbone
from omni_rl.models.flow_policy_config import FlowPolicyConfig
from omni_rl.preprocess import cache as cache_module
from omni_rl.preprocess.cache import MediaCache
from omni_rl.preprocess.image import ImageBudget
from omni_rl.preprocess.pipeline import Budgets, preprocess
from omni_rl.preprocess.scenes import write_video_qa
from omni_rl.preprocess.video import VideoBudget
from omni_rl.recipe_loader import config_from_dict, load_config
from omni_rl.recipes import flow_ppo

# the one line a full disk gives: the path, what the OS said and the bytes the write needed
FULL = r"out of disk space \(No space left on device\) writing about [\d,]+ bytes; free space there"
ENOSPC_RUST = "Error while serializing: I/O error: No space left on device (os error 28)"


def _snapshot(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` (but the lock), by relative path."""
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file() and p.name != ".lock"}


def _temps(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.name.endswith((".tmp", ".old"))]


def _fill_disk(monkeypatch, error: BaseException, calls: list | None = None) -> None:
    """Entry writes write half their bytes, then fail with ``error``."""
    real = cache_module.save_file

    def full(tensors, filename, metadata=None):
        real(tensors, filename, metadata=metadata)
        Path(filename).write_bytes(Path(filename).read_bytes()[: Path(filename).stat().st_size // 2])
        if calls is not None:
            calls.append(filename)
        raise error

    monkeypatch.setattr(cache_module, "save_file", full)


# ------------------------------------------------------------------ preprocess and the cache


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    """4 short videos, 4 rows each (rows in video order)."""
    return write_video_qa(tmp_path_factory.mktemp("shapes"), videos=4, seed=0, seconds=1.0)


def _budgets() -> Budgets:
    return Budgets(VideoBudget(min_frames=2, max_frames=4, min_pixels=3136, max_pixels=12544), ImageBudget())


@pytest.mark.parametrize("workers", [1, 2])
def test_preprocess_stops_at_a_full_disk_and_keeps_the_cache(tmp_path, shapes, monkeypatch, workers):
    """The first row whose entry finds the disk full stops the run: no later row is
    decoded, nothing is recorded as a row failure, no temporary file stays, and what
    an earlier run cached (entries, index, failures.jsonl, manifest) is unchanged."""
    cache_dir = tmp_path / "cache"
    first = preprocess(shapes, cache_dir, _budgets(), workers=1, limit=4, progress=False)  # the first video
    assert first.cached == 1 and first.shared == 3 and not first.failed  # 4 questions on one video
    before = _snapshot(cache_dir)
    calls: list[str] = []
    _fill_disk(monkeypatch, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), calls)
    with pytest.raises(OmniRLError, match=rf"{cache_dir}/entries/.*\.safetensors: {FULL}"):
        preprocess(shapes, cache_dir, _budgets(), workers=workers, progress=False)
    if workers == 1:
        assert len(calls) == 1  # three videos were left to cache: it stopped at the first
    assert not _temps(cache_dir)
    assert _snapshot(cache_dir) == before
    cache = MediaCache(cache_dir)
    assert all(cache.check(key) is None for key in cache.entry_keys())


@pytest.mark.parametrize(
    ("writer", "error"),
    [
        ("entry", OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))),
        ("entry", SafetensorError(ENOSPC_RUST)),
        ("manifest", OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))),
    ],
    ids=["entry-enospc", "entry-safetensors-enospc", "manifest-edquot"],
)
def test_a_cache_write_on_a_full_disk_names_the_file_and_its_bytes(tmp_path, monkeypatch, writer, error):
    cache = MediaCache(tmp_path / "cache")
    old = cache.write("a" * 64, {"frames": np.zeros((2, 3, 8, 8), np.uint8)}, {"kind": "video"})
    cache.record_params({"video": {"fps": 2.0}})
    before = _snapshot(cache.root)
    frames = np.ones((2, 3, 64, 64), np.uint8)
    if writer == "entry":
        _fill_disk(monkeypatch, error)
        with pytest.raises(OmniRLError, match=rf"{cache.path('b' * 64)}: {FULL}") as raised:
            cache.write("b" * 64, {"frames": frames}, {"kind": "video"})
        needed = int(str(raised.value).split("about ")[1].split(" bytes")[0].replace(",", ""))
        assert frames.nbytes < needed < frames.nbytes + 1000  # the tensors and their metadata
    else:

        def quota(fd):
            raise error

        monkeypatch.setattr(cache_module.os, "fsync", quota)
        with pytest.raises(OmniRLError, match=rf"{cache.manifest_path}: out of disk space \(Disk quota exceeded\)"):
            cache.record_params({"video": {"fps": 1.0}})
    assert not _temps(cache.root)
    assert _snapshot(cache.root) == before and old == cache.path("a" * 64).stat().st_size


def test_preprocess_on_a_full_disk_exits_non_zero_with_one_line(tmp_path, shapes, monkeypatch, capsys):
    _fill_disk(monkeypatch, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
    args = ["preprocess", str(shapes), "--cache", str(tmp_path / "cache"), "--workers", "1"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len([line for line in err if "omni-rl: error:" in line]) == 1
    assert err[-1].startswith("omni-rl: error: ") and "out of disk space" in err[-1] and "Traceback" not in err
    assert not (tmp_path / "cache" / "failures.jsonl").exists()


# ------------------------------------------------------------------ checkpoints


def _flow_config(out: Path, steps: int, **trainer):
    """A flow-PPO run on the point-mass task small enough to take a second or two."""
    return config_from_dict(
        {
            "recipe": "flow_ppo",
            "run": {"output_dir": str(out / "run"), "seed": 0, "device": "cpu", "threads": 1},
            "env": {"task": "PointMass-v0", "num_envs": 4, "max_episode_steps": 8},
            "policy": {"horizon": 2, "executed": 2, "denoise_steps": 2, "width": 16},
            "ppo": {"epochs": 1, "minibatches": 2},
            "trainer": {"steps": steps, "save_every": 1, "keep_last": 2, "eval_every": 0}
            | {"eval_episodes": 4}
            | trainer,
        },
        "test",
    )


def _steps(out: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]


def _fail_shards(monkeypatch) -> None:
    def full(self, plan, planner):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(checkpoint.dcp.HuggingFaceStorageWriter, "write_data", full)


def _fail_export(monkeypatch) -> None:
    def full(self, directory, state_dict=None):
        Path(directory).mkdir(parents=True, exist_ok=True)
        (Path(directory) / "policy.safetensors").write_bytes(b"\0" * 100)
        raise SafetensorError(ENOSPC_RUST)

    monkeypatch.setattr(FlowPolicy, "save_pretrained", full)


@pytest.mark.parametrize("where", ["shards", "export"])
def test_a_checkpoint_save_on_a_full_disk_keeps_the_previous_one(tmp_path, monkeypatch, where):
    flow_ppo.train(_flow_config(tmp_path, 1))
    checkpoints = tmp_path / "run" / "checkpoints"
    before = _snapshot(checkpoints)
    {"shards": _fail_shards, "export": _fail_export}[where](monkeypatch)
    part = {"shards": r"sharded", "export": r"model"}[where]
    with pytest.raises(OmniRLError, match=rf"{checkpoints}/\.step-00000002\.tmp/{part}: {FULL}"):
        flow_ppo.train(_flow_config(tmp_path, 2), resume="auto")
    assert not _temps(checkpoints) and _snapshot(checkpoints) == before
    assert checkpoint.latest(tmp_path / "run") == checkpoints / "step-00000001"


def _damage(shard: Path, how: str) -> None:
    if how == "truncated":
        os.truncate(shard, shard.stat().st_size // 2)
    else:  # the header's JSON overwritten
        with open(shard, "r+b") as f:
            f.seek(8)
            f.write(b"\xff" * 16)


@pytest.mark.parametrize("how", ["truncated", "corrupt"])
def test_resume_auto_passes_over_a_damaged_checkpoint(tmp_path, capsys, how):
    """The newest of two checkpoints has a damaged shard: ``--resume auto`` says so,
    resumes from the other and ends where the uninterrupted run ends."""
    flow_ppo.train(_flow_config(tmp_path / "a", 3))
    flow_ppo.train(_flow_config(tmp_path / "b", 2))
    checkpoints = tmp_path / "b" / "run" / "checkpoints"
    shard = next((checkpoints / "step-00000002" / "sharded").glob("*.safetensors"))
    _damage(shard, how)
    capsys.readouterr()
    flow_ppo.train(_flow_config(tmp_path / "b", 3), resume="auto")
    err = capsys.readouterr().err
    reason = "bytes where" if how == "truncated" else "unreadable (SafetensorError"
    assert f"omni-rl: passing over a damaged checkpoint: {shard}: " in err and reason in err
    assert f"omni-rl: resuming from {checkpoints / 'step-00000001'} (the newest complete checkpoint)" in err
    assert _steps(tmp_path / "b") == [0, 1, 2, 3]
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-00000002", "step-00000003"]
    assert all(checkpoint.damage(p) is None for p in checkpoints.iterdir())
    varying = ("time/", "throughput/")

    def values(out: Path) -> list[dict]:
        lines = (out / "run" / "metrics.jsonl").read_text().splitlines()
        return [{k: v for k, v in json.loads(line).items() if not k.startswith(varying)} for line in lines]

    assert values(tmp_path / "b") == values(tmp_path / "a")


def test_a_damaged_checkpoint_is_refused_in_one_line(tmp_path, capsys):
    """``--resume PATH`` to a damaged checkpoint, and ``--resume auto`` where every
    checkpoint is damaged: exit 2 with one line naming the file."""
    flow_ppo.train(_flow_config(tmp_path, 2))
    config = tmp_path / "run.yaml"
    save_config(_flow_config(tmp_path, 3), config)
    checkpoints = tmp_path / "run" / "checkpoints"
    shards = {p.name: next((p / "sharded").glob("*.safetensors")) for p in checkpoints.iterdir()}
    _damage(shards["step-00000002"], "truncated")
    capsys.readouterr()
    assert main(["train", str(config), "--resume", str(checkpoints / "step-00000002")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"omni-rl: error: cannot resume from {checkpoints / 'step-00000002'}: ")
    assert f"{shards['step-00000002']}: " in err[-1] and "(truncated or overwritten)" in err[-1]
    assert not any("Traceback" in line for line in err)

    (checkpoints / "step-00000001" / "rng" / "rank-00000.pt").unlink()
    assert main(["train", str(config), "--resume", "auto"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (
        f"omni-rl: error: {checkpoints}: no complete checkpoint to resume from (the lines above say why); "
        "start afresh with --overwrite, or give --resume PATH"
    )
    assert any(f"{checkpoints / 'step-00000001' / 'rng' / 'rank-00000.pt'}: missing" in line for line in err)


# ------------------------------------------------------------------ the best model


def _heldout(tmp_path: Path, shapes: Path) -> HeldOut:
    cfg = load_config(
        None,
        [
            f"data.train={shapes}",
            f"run.output_dir={tmp_path}",
            f"data.eval=[{{data: {shapes}, name: held}}]",
            "trainer.best_metric=eval/held/accuracy",
        ],
        recipe="sft",
    )
    return HeldOut(cfg, tmp_path, "qwen2_5_vl")


def test_a_failed_best_model_export_keeps_the_previous_one(tmp_path, shapes, monkeypatch):
    """An export that dies inside ``save_pretrained`` (a kill, a full disk) leaves the
    previous ``best/model`` and ``best.json`` as they were; the next export replaces it."""
    config = FlowPolicyConfig(horizon=2, executed=2, width=8)
    policy = FlowPolicy(config, StateBackbone(config, obs_dim=4, action_dim=2))
    engine = TrainingEngine(policy, AdamWConfig(lr=1e-3), torch.device("cpu"), total_steps=1)
    heldout = _heldout(tmp_path, shapes)
    heldout.keep_best({"eval/held/accuracy": 0.25}, 1, engine, None)
    best = tmp_path / "best"
    before = _snapshot(best)
    assert "model/policy.safetensors" in before

    real = FlowPolicy.save_pretrained

    def killed(self, directory, state_dict=None):
        Path(directory).mkdir(parents=True, exist_ok=True)
        (Path(directory) / "policy.safetensors").write_bytes(b"\0" * 100)  # a partial weights file
        raise KeyboardInterrupt

    monkeypatch.setattr(FlowPolicy, "save_pretrained", killed)
    with torch.no_grad():
        policy.backbone.velocity_net[0].weight.add_(1.0)
    with pytest.raises(KeyboardInterrupt):
        heldout.keep_best({"eval/held/accuracy": 0.5}, 2, engine, None)
    assert _snapshot(best) == before and not _temps(best)
    assert json.loads((best / "best.json").read_text())["step"] == 1

    monkeypatch.setattr(FlowPolicy, "save_pretrained", real)
    heldout.keep_best({"eval/held/accuracy": 0.5}, 3, engine, None)
    assert json.loads((best / "best.json").read_text())["step"] == 3
    again = FlowPolicy.from_pretrained(best / "model")
    assert again.backbone.velocity_net[0].weight.equal(policy.backbone.velocity_net[0].weight)
    assert not _temps(best)


def test_a_kill_between_the_export_renames_keeps_the_previous_best_model(tmp_path, shapes, monkeypatch):
    """The export moves the old directory aside, then renames the new one into place:
    killed in between, the next run's start puts the old one back."""
    config = FlowPolicyConfig(horizon=2, executed=2, width=8)
    policy = FlowPolicy(config, StateBackbone(config, obs_dim=4, action_dim=2))
    engine = TrainingEngine(policy, AdamWConfig(lr=1e-3), torch.device("cpu"), total_steps=1)
    heldout = _heldout(tmp_path, shapes)
    heldout.keep_best({"eval/held/accuracy": 0.25}, 1, engine, None)
    before = _snapshot(tmp_path / "best")
    real, renames = os.replace, []

    def killed_at_the_second(src, dst):
        renames.append((Path(src).name, Path(dst).name))
        if len(renames) == 2:
            raise KeyboardInterrupt
        real(src, dst)

    monkeypatch.setattr(checkpoint.os, "replace", killed_at_the_second)
    with pytest.raises(KeyboardInterrupt):
        heldout.keep_best({"eval/held/accuracy": 0.5}, 2, engine, None)
    monkeypatch.setattr(checkpoint.os, "replace", real)
    assert renames == [("model", ".model.old"), (".model.tmp", "model")]
    assert not (tmp_path / "best" / "model").exists()
    _heldout(tmp_path, shapes)
    assert _snapshot(tmp_path / "best") == before


# ------------------------------------------------------------------ a checkpoint before any update


def _first_updates(tmp_path: Path, save_first: bool) -> tuple[torch.Tensor, TrainingEngine]:
    """The weight change of two AdamW steps after a skipped one (GRPO: dynamic sampling
    kept no group), with or without a checkpoint between the skip and the steps."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    engine = TrainingEngine(model, AdamWConfig(lr=0.1), torch.device("cpu"), total_steps=3, max_grad_norm=0.0)
    engine.skip_steps(1)
    if save_first:
        checkpoint.save(engine, tmp_path, 1, {"sampler": {}}, export=False)
        assert not engine.optimizer.state  # saving took no optimizer step
    before = model.weight.detach().clone()
    for _ in range(2):
        engine.backward(model(torch.ones(2, 4)).square().sum())
        engine.step()
    return model.weight.detach() - before, engine


def test_a_checkpoint_before_the_first_update_leaves_the_optimizer_as_it_was(tmp_path):
    """torch's optimizer state dict fills an empty optimizer's state by a step at lr 0
    (AdamW's count at 1, zero moments), which shrank the next update by a quarter. A
    checkpoint saved before any update leaves it empty, and resuming from it trains as
    the run that saved it."""
    plain, _ = _first_updates(tmp_path / "a", save_first=False)
    saved, _ = _first_updates(tmp_path / "b", save_first=True)
    assert torch.equal(saved, plain)

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    engine = TrainingEngine(model, AdamWConfig(lr=0.1), torch.device("cpu"), total_steps=3, max_grad_norm=0.0)
    checkpoint.load(engine, tmp_path / "b" / "checkpoints" / "step-00000001")
    assert not engine.optimizer.state
    before = model.weight.detach().clone()
    for _ in range(2):
        engine.backward(model(torch.ones(2, 4)).square().sum())
        engine.step()
    assert torch.equal(model.weight.detach() - before, plain)


def test_a_resumed_run_drops_the_best_model_exported_after_its_checkpoint(tmp_path, shapes):
    """The killed run exported a best model after the checkpoint the run resumes from:
    its evaluation is trained again, so that best (and ``OUTPUT_DIR/model``'s target) is
    removed and chosen again; a best from before the checkpoint stays."""
    from types import SimpleNamespace

    from omni_rl.engine import distributed
    from omni_rl.recipes.common import Run, resume_steps

    config = FlowPolicyConfig(horizon=2, executed=2, width=8)
    policy = FlowPolicy(config, StateBackbone(config, obs_dim=4, action_dim=2))
    engine = TrainingEngine(policy, AdamWConfig(lr=1e-3), torch.device("cpu"), total_steps=4)
    sampler = SimpleNamespace(load_state_dict=lambda state: None)
    heldout = _heldout(tmp_path, shapes)
    heldout.keep_best({"eval/held/accuracy": 0.25}, 1, engine, None)
    checkpoint.save(engine, tmp_path, 2, {"sampler": {}}, export=False)
    run = Run(tmp_path, distributed.ranks(), torch.device("cpu"), tmp_path / "checkpoints" / "step-00000002")

    resumed = _heldout(tmp_path, shapes)  # a best from before the checkpoint
    resume_steps(resumed.cfg, run, engine, sampler, "sft", resumed)[0].close()
    assert resumed.best == {"metric": "eval/held/accuracy", "value": 0.25, "step": 1}

    heldout.keep_best({"eval/held/accuracy": 0.9}, 3, engine, None)  # the killed run's, after it
    resumed = _heldout(tmp_path, shapes)
    resume_steps(resumed.cfg, run, engine, sampler, "sft", resumed)[0].close()
    assert resumed.best is None and not (tmp_path / "best").exists()
    resumed.keep_best({"eval/held/accuracy": 0.5}, 3, engine, None)
    assert json.loads((tmp_path / "best" / "best.json").read_text())["value"] == 0.5
