"""What ranks wait for under torchrun: the process group's timeout
(``trainer.dist_timeout_minutes``), a benchmark's media preprocessed by every rank in
shares rather than by rank 0 while the others wait at a barrier, and the weights a
held-out evaluation gathered under FSDP2 freed before the next rollout."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import yaml

from omni_rl.engine import distributed
from omni_rl.engine.config import TrainerConfig
from omni_rl.errors import ConfigError
from omni_rl.preprocess.cache import MediaCache
from omni_rl.preprocess.image import ImageBudget
from omni_rl.preprocess.index import DatasetIndex
from omni_rl.preprocess.pipeline import Budgets, preprocess
from omni_rl.preprocess.rows import read_rows
from omni_rl.preprocess.synthetic import write_image
from omni_rl.preprocess.video import VideoBudget
from omni_rl.recipe_loader import config_from_dict, load_config
from omni_rl.recipes import common

TORCHRUN = str(Path(sys.executable).parent / "torchrun")
TESTS = str(Path(__file__).parent)


def _env() -> dict:
    import os

    return {**os.environ, "OMP_NUM_THREADS": "1", "OMNI_RL_THREADS": "1", "PYTHONPATH": TESTS}


def _torchrun(script: Path, *args: str) -> list[dict]:
    """Run ``script`` on 2 processes; every JSON line they print, by rank."""
    from test_distributed import _port

    command = [TORCHRUN, "--nproc-per-node=2", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{_port()}"]
    done = subprocess.run([*command, str(script), *args], env=_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return sorted(_json_objects(done.stdout), key=lambda r: r.get("rank", 0))


def _json_objects(text: str) -> list[dict]:
    """Every JSON object printed in ``text``: two ranks' prints can land on one line
    (each is one write, but their newlines may follow the other's object)."""
    decoder, found, at = json.JSONDecoder(), [], text.find("{")
    while at >= 0:
        obj, end = decoder.raw_decode(text, at)
        found.append(obj)
        at = text.find("{", end)
    return found


# ---------------------------------------------------------------- the timeout


def test_dist_timeout_minutes_defaults_to_30_and_must_be_positive():
    assert TrainerConfig().dist_timeout_minutes == 30.0
    grpo = {"recipe": "grpo", "data": {"train": "x"}}
    assert config_from_dict({**grpo, "trainer": {"dist_timeout_minutes": 90}}).trainer.dist_timeout_minutes == 90
    for bad in (0, -1):
        with pytest.raises(ConfigError, match=r"trainer\.dist_timeout_minutes: must be > 0"):
            config_from_dict({**grpo, "trainer": {"dist_timeout_minutes": bad}})


def test_init_gives_the_process_group_the_configured_timeout(monkeypatch):
    """Under torchrun's environment (2 processes) ``init`` passes the timeout to
    ``init_process_group`` (recorded here instead of joining a group)."""
    calls = []
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(distributed.dist, "init_process_group", lambda *a, **k: calls.append((a, k)))
    monkeypatch.setattr(distributed.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(distributed.dist, "get_world_size", lambda: 2)
    assert distributed.init("cpu", timeout_minutes=45).world_size == 2
    assert distributed.init("cpu").world_size == 2
    assert calls == [(("gloo",), {"timeout": timedelta(minutes=45)}), (("gloo",), {"timeout": timedelta(minutes=30)})]


def test_start_run_joins_with_the_trainer_timeout(monkeypatch, tmp_path):
    seen = []

    def init(device_type, timeout_minutes, rollout_processes):
        seen.append((device_type, timeout_minutes, rollout_processes))
        raise SystemExit("joined")

    monkeypatch.setattr(common.distributed, "init", init)
    overrides = ["trainer.dist_timeout_minutes=75", f"run.output_dir={tmp_path}", "run.device=cpu", "data.train=x"]
    cfg = load_config(None, overrides, "grpo")
    with pytest.raises(SystemExit, match="joined"):
        common.start_run(cfg, None)
    assert seen == [("cpu", 75.0, 0)]  # no rollout process outside GRPO's rollout.staleness: 1


TIMEOUT_ON_RANKS = """
import json, os, sys, time
from omni_rl.engine import distributed

ranks = distributed.init("cpu", timeout_minutes=float(sys.argv[1]))
if ranks.rank == 1:  # busy on its own for longer than the timeout
    time.sleep(12)
    os._exit(0)
start = time.monotonic()
try:
    distributed.barrier()
    failed = False
except RuntimeError:
    failed = True
print(json.dumps({"rank": 0, "failed": failed, "waited": time.monotonic() - start}), flush=True)
os._exit(0)  # the group is broken: no clean shutdown
"""


@pytest.mark.slow
def test_a_rank_waits_at_a_barrier_as_long_as_the_timeout_says(tmp_path):
    """2 processes over gloo with a 2-second timeout: rank 0 gives up on rank 1 (busy
    for 12 s) after about 2 s, not torch's default 10 minutes."""
    script = tmp_path / "timeout.py"
    script.write_text(TIMEOUT_ON_RANKS)
    (found,) = _torchrun(script, str(2 / 60))
    assert found["failed"] and 1.5 < found["waited"] < 10, found


# ---------------------------------------------------------------- preprocessing in shares


def _image_rows(root: Path, images: int, questions: int = 1, broken: bool = False) -> Path:
    """``images`` images with ``questions`` rows each (and a row of an undecodable image)."""
    rows = []
    for i in range(images):
        write_image(root / "media" / f"{i}.png", np.full((40, 60, 3), 20 * i, np.uint8))
        rows += [{"id": f"img{i}-q{q}", "images": [f"media/{i}.png"]} for q in range(questions)]
    if broken:
        (root / "media" / "broken.png").write_text("not an image")
        rows.append({"id": "broken", "images": ["media/broken.png"]})
    path = root / "rows.jsonl"
    path.write_text(
        "".join(json.dumps({"problem": "p", "problem_type": "counting", "answer": 1, **r}) + "\n" for r in rows)
    )
    return path


BUDGETS = Budgets(VideoBudget(), ImageBudget())


def test_shares_keep_the_rows_of_one_medium_together_and_add_up(tmp_path):
    """2 shares of 3 images x 2 questions: disjoint, every row in one, a medium's
    questions in the same share (one decode, one writer per entry); each share writes
    no failures.jsonl (its caller merges every share's), and the shares' index updates
    add up to every row."""
    data = _image_rows(tmp_path, images=3, questions=2, broken=True)
    cache = tmp_path / "cache"
    reports = [preprocess(data, cache, BUDGETS, workers=1, progress=False, shard=(k, 2)) for k in range(2)]
    assert sum(r.cached for r in reports) == 3 and all(r.cached for r in reports)
    assert [f.id for r in reports for f in r.failures] == ["broken"]
    assert not (cache / "failures.jsonl").exists()
    index = DatasetIndex(MediaCache(cache), data)
    rows, _ = read_rows(data)
    assert set(index.rows) == {r.id for r in rows} - {"broken"}
    by_row = {row_id: media[0].keys for row_id, media in index.rows.items()}
    assert by_row["img0-q0"] == by_row["img0-q1"] != by_row["img1-q0"]


PREPROCESS_ON_RANKS = """
import json, sys
from pathlib import Path
from omni_rl.engine import distributed
from omni_rl.evaluation import benchmark
from omni_rl.preprocess.image import ImageBudget
from omni_rl.preprocess.pipeline import Budgets
from omni_rl.preprocess.video import VideoBudget

ranks = distributed.init("cpu", timeout_minutes=5)
reports = []
real = benchmark.preprocess
def spy(*args, **kwargs):
    reports.append(real(*args, **kwargs))
    return reports[-1]
benchmark.preprocess = spy
benchmark.preprocess_shared(Path(sys.argv[1]), sys.argv[2], Budgets(VideoBudget(), ImageBudget()), progress=False)
(report,) = reports
print(json.dumps({"rank": ranks.rank, "cached": report.cached, "failed": [f.id for f in report.failures]}))
distributed.shutdown()
"""


@pytest.mark.slow
def test_benchmark_media_are_preprocessed_by_every_rank_in_shares(tmp_path):
    """2 ranks preprocess 4 images into one cache: each decodes its share (neither all
    of them), the shared index holds every row, and failures.jsonl holds the broken row
    whichever rank met it."""
    data = _image_rows(tmp_path, images=4, broken=True)
    script = tmp_path / "preprocess.py"
    script.write_text(PREPROCESS_ON_RANKS)
    cache = tmp_path / "cache"
    got = _torchrun(script, str(data), str(cache))
    assert [r["cached"] for r in got] == [2, 2]
    assert sorted(f for r in got for f in r["failed"]) == ["broken"]
    assert set(DatasetIndex(MediaCache(cache), data).rows) == {f"img{i}-q0" for i in range(4)}
    listed = [json.loads(line)["id"] for line in (cache / "failures.jsonl").read_text().splitlines()]
    assert listed == ["broken"]


# ---------------------------------------------------------------- resharding after evaluation

RESHARD_ON_RANKS = """
import json
from types import SimpleNamespace
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor, Shard
from omni_rl.engine import distributed
from omni_rl.engine.config import AdamWConfig
from omni_rl.engine.engine import TrainingEngine
from omni_rl.evaluation.during_training import HeldOut


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return torch.relu(self.lin(x))


class Toy(nn.Module):
    _no_split_modules = ["Block"]

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class Eval(HeldOut):
    # one set, evaluated by a no-grad forward (what generation does)
    def __init__(self):
        self.cfg = SimpleNamespace(trainer=SimpleNamespace(eval_every=1, steps=1, best_metric=None))
        self.sets, self.best = [None], None

    def __call__(self, model, processor, step):
        with torch.no_grad():
            model(torch.ones(2, 8))
        return {"eval/toy/accuracy": 1.0}


def sharded(model):
    return all(isinstance(p, DTensor) and p.placements == (Shard(0),) for p in model.parameters())


ranks = distributed.init("cpu", timeout_minutes=5)
torch.manual_seed(0)
engine = TrainingEngine(Toy(), AdamWConfig(), torch.device("cpu"), 1, precision="fp32", strategy="fsdp")
found = {"rank": ranks.rank, "at_start": sharded(engine.module)}
with torch.no_grad():
    engine.model(torch.ones(2, 8))
found["after_forward"] = sharded(engine.module)
engine.reshard()
found["after_reshard"] = sharded(engine.module)
Eval().add_to({"step": 1}, engine, None)
found["after_add_to"] = sharded(engine.module)
# what checkpoint.export_model gathers: FSDP2 reshards before a state dict is taken
with torch.no_grad():
    engine.model(torch.ones(2, 8))
get_model_state_dict(engine.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
found["after_full_state_dict"] = sharded(engine.module)
print(json.dumps(found))
distributed.shutdown()
"""


@pytest.mark.slow
def test_held_out_evaluation_leaves_the_fsdp2_weights_sharded(tmp_path):
    """A no-grad forward of a trainable FSDP2 model (2 processes over gloo) leaves its
    blocks' weights gathered (reshard_after_forward=False until step()); reshard()
    frees them, and so does HeldOut.add_to after its evaluation; the best model's
    export (a full state dict) leaves them sharded by itself."""
    script = tmp_path / "reshard.py"
    script.write_text(RESHARD_ON_RANKS)
    for found in _torchrun(script):
        assert found["at_start"] and not found["after_forward"], found
        assert found["after_reshard"] and found["after_add_to"] and found["after_full_state_dict"], found


def test_reshard_is_a_no_op_in_one_process():
    import torch

    from omni_rl.engine.config import AdamWConfig
    from omni_rl.engine.engine import TrainingEngine

    engine = TrainingEngine(torch.nn.Linear(2, 2), AdamWConfig(), torch.device("cpu"), 1, precision="fp32")
    engine.reshard()
    assert engine.strategy == "single"


@pytest.mark.slow
def test_two_process_grpo_evaluates_a_cached_benchmark_and_keeps_the_best(tmp_path):
    """The pieces together under torchrun (FSDP2, 2 processes): a benchmark preset in
    data.eval preprocessed into data.cache by both ranks, evaluated at every step, and
    the best model exported."""
    import bench_fixtures
    from test_distributed import grpo_config, launch

    from omni_rl.preprocess.scenes import write_video_qa

    shapes = write_video_qa(tmp_path / "shapes", videos=4, seed=0, seconds=2.0)
    bench_fixtures.mvbench(tmp_path / "mvbench")
    cache = tmp_path / "cache"
    evals = [{"benchmark": "mvbench", "data": str(tmp_path / "mvbench"), "protocol": {"nframes": 4}}]
    trainer = {"steps": 2, "save_every": 0, "eval_every": 1, "best_metric": "eval/mvbench/accuracy"}
    config = grpo_config(tmp_path, shapes, "fsdp", trainer=trainer)
    raw = yaml.safe_load(config.read_text())
    raw["data"] |= {"eval": evals, "cache": str(cache)}
    config.write_text(yaml.safe_dump(raw))
    launch(config, 2)
    run = tmp_path / "run"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["eval/mvbench/rows"] for r in rows if "eval/mvbench/rows" in r] == [4, 4]
    index = DatasetIndex(MediaCache(cache), run / "eval" / "mvbench" / "rows.jsonl")
    assert len(index.rows) == 4
    assert (run / "best" / "model" / "config.json").is_file()
