"""N processes equal one: the real FSDP2 (and DDP) code on 2 CPU processes over gloo,
launched by torchrun as users launch it, against one process with the same global batch.

Each rank owns whole prompt groups, samples them with per-prompt seeds, divides its
losses by the global token count and steps through the engine; the exported weights
after a few steps must match one process's within 1e-5, also when one rank's batches
hold a video (or audio) and the other's none (FSDP2's dummy encoder passes). A
2-process run killed with SIGKILL and resumed continues with exactly the
uninterrupted run's metrics.
"""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from omni_rl.preprocess.scenes import write_video_qa
from omni_rl.recipe_loader import load_config

pytestmark = pytest.mark.slow

PYTHON = sys.executable
TORCHRUN = str(Path(sys.executable).parent / "torchrun")
TESTS = str(Path(__file__).parent)
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "OMNI_RL_THREADS": "1", "PYTHONPATH": TESTS}


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    return write_video_qa(tmp_path_factory.mktemp("shapes"), videos=4, seed=0, seconds=2.0)


@pytest.fixture(scope="module")
def vowels(shapes):
    return vowel_rows(shapes)


def vowel_rows(shapes: Path) -> Path:
    """The same questions rewarded by ``reward_plugins.vowel_share``, which a random tiny
    model's answers vary on (so that advantages are not all zero)."""
    rows = [json.loads(line) for line in shapes.read_text().splitlines()]
    data = shapes.with_name("vowels.jsonl")
    # two sources, for the UCB sampler
    rows = [{**row, "problem_type": "vowel_share", "data_source": "ab"[i % 2]} for i, row in enumerate(rows)]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return data


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(processes: int, config: Path) -> list[str]:
    """``torchrun -m omni_rl train CONFIG`` on ``processes`` local processes, as users launch it."""
    rendezvous = ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{_port()}"]
    return [TORCHRUN, f"--nproc-per-node={processes}", *rendezvous, "-m", "omni_rl", "train", str(config)]


def on_two_ranks(tmp_path: Path, source: str, *args: str) -> subprocess.CompletedProcess:
    """Run the script ``source`` under torchrun on 2 local processes with ``args``; it
    must exit 0."""
    script = tmp_path / "on_ranks.py"
    script.write_text(source)
    command = [TORCHRUN, "--nproc-per-node=2", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{_port()}"]
    done = subprocess.run([*command, str(script), *args], env=ENV, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def rank_results(tmp_path: Path) -> list:
    """What each rank's script wrote to ``tmp_path/rank{r}.json``, in rank order."""
    return [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]


def launch(config: Path, processes: int, *extra: str, wait: bool = True):
    """``python -m omni_rl train`` in one process, or torchrun with ``processes``."""
    single = [PYTHON, "-m", "omni_rl", "train", str(config)]
    command = [*(single if processes == 1 else _torchrun(processes, config)), *extra]
    if not wait:
        return subprocess.Popen(
            command, env=ENV, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
    done = subprocess.run(command, env=ENV, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def launch_and_kill(config: Path, rows: int, processes: int = 2) -> Path:
    """Launch the run of ``config`` and SIGKILL it once its metrics log holds ``rows``
    rows; returns the log."""
    log = config.parent / "run" / "metrics.jsonl"
    process = launch(config, processes, wait=False)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and process.poll() is None:
        if log.exists() and len(log.read_text().splitlines()) >= rows:
            break
        time.sleep(0.05)
    assert process.poll() is None, "the run ended before it could be killed"
    kill_run(process, config)
    return log


def kill_run(process: subprocess.Popen, config: Path) -> None:
    """SIGKILL a run ``launch`` started without waiting: torchrun's process group, and
    its training processes, which it starts in sessions of their own."""
    os.killpg(process.pid, signal.SIGKILL)
    for entry in Path("/proc").iterdir():
        try:
            command = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:  # not a process, or one that just ended
            continue
        if str(config).encode() in command:
            os.kill(int(entry.name), signal.SIGKILL)
    process.wait()


def initial_weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(run / "tiny_model" / "model.safetensors")


def grpo_config(root: Path, rows: Path, strategy: str, **sections) -> Path:
    config = {
        "recipe": "grpo",
        "run": {"output_dir": str(root / "run"), "seed": 0},
        "model": {"tiny_family": "qwen2_5_vl"},
        "data": {"train": str(rows), "prompts_per_step": 2},
        "media": {
            "family": "qwen2_5_vl",
            "min_frames": 2,
            "max_frames": 4,
            "video_min_pixels": 3136,
            "video_max_pixels": 6272,
        },
        "rollout": {"n": 4, "max_new_tokens": 8},
        "algorithm": {"epochs": 2, "mini_batch_prompts": 2},
        "trainer": {"steps": 3, "save_every": 1, "strategy": strategy, "precision": "fp32"},
        "optimizer": {"type": "adamw", "lr": 1.0e-3},
        "rewards": {"custom": {"vowel_share": "reward_plugins:vowel_share"}},
    }
    for name, values in sections.items():
        config[name] = {**config.get(name, {}), **values}
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.yaml").write_text(yaml.safe_dump(config))
    return root / "config.yaml"


def weights(run: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(run / "checkpoints" / f"step-{step:08d}" / "model" / "model.safetensors")


def assert_same_weights(a: dict, b: dict, atol: float = 1e-5) -> float:
    assert a.keys() == b.keys()
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert worst <= atol, worst
    return worst


def metrics(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "throughput/"))} for r in rows]


@pytest.fixture(scope="module")
def grpo_single(tmp_path_factory, vowels):
    root = tmp_path_factory.mktemp("grpo1")
    launch(grpo_config(root, vowels, "single"), 1)
    return root / "run"


@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_grpo_on_two_processes_equals_one(tmp_path, vowels, grpo_single, strategy):
    launch(grpo_config(tmp_path, vowels, strategy), 2)
    # the starting weights are the same seeded tiny model; every update after that is
    # computed from rank-local groups and global token counts
    start, one_proc = initial_weights(grpo_single), weights(grpo_single, 3)
    assert max(float((one_proc[k] - start[k]).abs().max()) for k in start) > 1e-3  # the runs did train
    assert_same_weights(one_proc, weights(tmp_path / "run", 3))
    one, two = metrics(grpo_single), metrics(tmp_path / "run")
    assert [r["step"] for r in two] == [1, 2, 3]
    for a, b in zip(one, two, strict=True):
        assert a["reward/mean"] == pytest.approx(b["reward/mean"], abs=1e-9)
        assert a["loss/policy"] == pytest.approx(b["loss/policy"], abs=1e-5)
        assert a["response/length_mean"] == b["response/length_mean"]
        # the ratio diagnostics pool every rank's tokens (not a mean of the ranks' means)
        for key in ("loss/clip_fraction", "loss/ratio_mean", "loss/ratio_max"):
            assert a[key] == pytest.approx(b[key], abs=1e-5), key
        # ddp runs the prompt's backward in one call with the completions', and says so
        assert (a["update/prompt_backward_apart"], b["update/prompt_backward_apart"]) == (1.0, float(strategy != "ddp"))


def test_grpo_with_gradient_checkpointing_on_two_processes_equals_one(tmp_path, vowels):
    """FSDP2 frees each layer's gathered weights after forward and backward; under
    checkpointing a layer's backward replays its prompt and completion passes, and the
    prompt's keys and values gather the layer again for the prompt pass's backward: the
    result is still one process's (with checkpointing too)."""
    checkpointing = {"model": {"tiny_family": "qwen2_5_vl", "gradient_checkpointing": True}}
    launch(grpo_config(tmp_path / "one", vowels, "single", **checkpointing), 1)
    launch(grpo_config(tmp_path / "two", vowels, "fsdp", **checkpointing), 2)
    one, two = tmp_path / "one" / "run", tmp_path / "two" / "run"
    start = initial_weights(one)
    assert max(float((weights(one, 3)[k] - start[k]).abs().max()) for k in start) > 1e-3
    assert_same_weights(weights(one, 3), weights(two, 3))
    for a, b in zip(metrics(one), metrics(two), strict=True):
        assert a["loss/policy"] == pytest.approx(b["loss/policy"], abs=1e-5)


def test_sft_on_two_processes_equals_one(tmp_path, shapes):
    runs = {}
    for processes, strategy in ((1, "single"), (2, "fsdp")):
        root = tmp_path / strategy
        raw = yaml.safe_load(grpo_config(root, shapes, strategy).read_text())
        del raw["rollout"], raw["algorithm"], raw["rewards"]
        raw["recipe"] = "sft"
        raw["trainer"].update(steps=3, save_every=0, micro_batch_size=1, eval_every=2)  # accumulation too
        raw["data"]["eval"] = [{"data": str(shapes), "name": "held", "max_new_tokens": 4}]  # split across ranks
        (root / "config.yaml").write_text(yaml.safe_dump(raw))
        launch(root / "config.yaml", processes)
        runs[strategy] = root / "run"
    start = initial_weights(runs["single"])
    assert max(float((weights(runs["single"], 3)[k] - start[k]).abs().max()) for k in start) > 1e-3
    assert_same_weights(weights(runs["single"], 3), weights(runs["fsdp"], 3))
    assert metrics(runs["single"])[-1]["loss/sft"] == pytest.approx(metrics(runs["fsdp"])[-1]["loss/sft"], abs=1e-5)
    # the eval set is split across the ranks and gathered: every row answered once
    rows = len(shapes.read_text().splitlines())
    for strategy in runs:
        evaluated = [r for r in metrics(runs[strategy]) if "eval/held/rows" in r]
        assert [(r["step"], r["eval/held/rows"]) for r in evaluated] == [(2, rows), (3, rows)]


def test_ucb_sampler_on_two_processes_draws_what_one_process_draws(tmp_path, vowels):
    """Every rank observes every rank's advantages: the source probabilities, the rows
    drawn and so the rewards are those of one process."""
    ucb = {"data": {"sampler": {"type": "ucb", "window": 8}}}
    launch(grpo_config(tmp_path / "one", vowels, "single", **ucb), 1)
    launch(grpo_config(tmp_path / "two", vowels, "fsdp", **ucb), 2)
    one, two = metrics(tmp_path / "one" / "run"), metrics(tmp_path / "two" / "run")
    probs = [{k: v for k, v in r.items() if k.startswith("sampler/prob/")} for r in one]
    assert all(set(p) == {"sampler/prob/a", "sampler/prob/b"} and sum(p.values()) == pytest.approx(1) for p in probs)
    assert probs[-1]["sampler/prob/a"] != pytest.approx(0.5)  # the advantages moved them
    for a, b in zip(one, two, strict=True):
        assert {k: v for k, v in a.items() if k.startswith("sampler/")} == pytest.approx(
            {k: v for k, v in b.items() if k.startswith("sampler/")}, abs=1e-9
        )
        assert a["reward/mean"] == pytest.approx(b["reward/mean"], abs=1e-9)


def test_two_process_sigkill_and_resume_gives_the_uninterrupted_metrics(tmp_path, vowels):
    """With dynamic sampling and the UCB sampler too: the sampling rounds, the sources'
    windows and the draw position must come back the same on every rank."""
    steps = 4
    sections = {
        "data": {"sampler": {"type": "ucb", "window": 8}},
        "trainer": {"steps": steps, "save_every": 1},
        "algorithm": {"epochs": 1, "mini_batch_prompts": 0, "dynamic_sampling": True},
    }
    straight = grpo_config(tmp_path / "a", vowels, "fsdp", **sections)
    launch(straight, 2)

    resumed = grpo_config(tmp_path / "b", vowels, "fsdp", **sections)
    log = launch_and_kill(resumed, 2)
    done = len(log.read_text().splitlines())
    assert 2 <= done < steps
    assert not (log.parent / "checkpoints" / f"step-{steps:08d}").exists()  # nothing ran on after the kill
    launch(resumed, 2, "--resume", "auto")
    assert metrics(tmp_path / "b" / "run") == metrics(tmp_path / "a" / "run")
    assert_same_weights(weights(tmp_path / "a" / "run", steps), weights(tmp_path / "b" / "run", steps), atol=0)


ADVANTAGES_ON_RANKS = """
import json, sys
from types import SimpleNamespace
import torch
from omni_rl.recipe_loader import load_config
from omni_rl.engine import distributed
from omni_rl.recipes import grpo

ranks = distributed.init("cpu")
groups = torch.tensor(json.loads(sys.argv[1]))
cfg = load_config(None, ["data.train=x", f"rollout.n={groups.shape[1]}", "algorithm.advantage=reinforce_pp"], "grpo")
half = len(groups) // ranks.world_size
own = groups[ranks.rank * half : (ranks.rank + 1) * half].flatten()  # each rank owns whole groups
split = distributed.gather_objects(grpo._advantages(own, False, cfg).tolist())
# rank 1 keeps no group of its own (dynamic sampling) and trains on a filler with zero weight
filler = distributed.gather_objects(grpo._advantages(own, ranks.rank == 1, cfg).tolist())
# rank 0 trains groups of lengths 40, 40 (cut) and 10, 10; rank 1 a filler copy of the first
mine = torch.tensor([40, 40, 10, 10] if ranks.rank == 0 else [40, 40])
lengths = grpo._rollout_metrics(SimpleNamespace(lengths=mine, truncated=mine == 40), filler=ranks.rank == 1)
if ranks.is_main:
    print(json.dumps({"split": split, "filler": filler, "lengths": lengths}))
distributed.shutdown()
"""


def test_reinforce_pp_advantages_on_two_processes_equal_one(tmp_path):
    """REINFORCE++ whitens over the global batch: 2 ranks holding 2 groups each give
    one process's advantages of the 4 groups within 1e-5; a filler group on a rank
    counts in no statistic (rank 0's groups then whiten as one process's 2 would), and
    in no response length (it was counted beside the original: 30, 0.667, 180)."""
    from omni_rl.recipes import grpo

    torch.manual_seed(0)
    groups = torch.rand(4, 3)
    done = on_two_ranks(tmp_path, ADVANTAGES_ON_RANKS, json.dumps(groups.tolist()))
    result = json.loads(done.stdout.strip().splitlines()[-1])
    cfg = load_config(None, ["data.train=x", "rollout.n=3", "algorithm.advantage=reinforce_pp"], recipe="grpo")
    one = grpo._advantages(groups.flatten(), False, cfg)
    torch.testing.assert_close(torch.tensor(result["split"]), one, atol=1e-5, rtol=0)
    first, second = (grpo._advantages(half.flatten(), False, cfg) for half in (groups[:2], groups[2:]))
    assert float((torch.cat([first, second]) - one).abs().max()) > 1e-2  # what whitening per rank gives
    torch.testing.assert_close(torch.tensor(result["filler"]), torch.cat([first, torch.zeros(6)]), atol=1e-5, rtol=0)
    assert result["lengths"] == {
        "response/length_mean": 25.0,
        "response/length_max": 40,
        "response/clipped_fraction": 0.5,
        "rollout/tokens": 100,
    }


LOCKSTEP_ON_RANKS = """
import json, sys
from pathlib import Path
import torch
from omni_rl.engine import distributed

ranks = distributed.init("cpu")
work = [["a", "b", "c"], ["d"]][ranks.rank]
padded = distributed.lockstep(work)
empty = distributed.lockstep([] if ranks.rank else ["x", "y"], filler=lambda: "filler")
try:
    distributed.lockstep([] if ranks.rank else ["x"])
    refused = False
except ValueError:
    refused = True
flags = [distributed.all_ranks(torch.tensor(ranks.rank == 1)), distributed.all_ranks(torch.tensor(True))]
result = {"padded": padded, "empty": empty, "refused": refused, "all_ranks": flags}
Path(sys.argv[1], f"rank{ranks.rank}.json").write_text(json.dumps(result))  # one file a rank: no interleaved prints
distributed.shutdown()
"""


def test_lockstep_pads_every_rank_to_the_busiest_with_zero_weight_copies(tmp_path):
    """Rank 0 with 3 items and rank 1 with 1 both run 3: rank 1 repeats its own first
    item marked not real; a rank with none runs the filler it is given, and without
    one it is refused (not left to hang its peers). ``all_ranks`` (the decode loop's
    stop test) is false on both ranks while one rank's flag is."""
    on_two_ranks(tmp_path, LOCKSTEP_ON_RANKS, str(tmp_path))
    got = dict(enumerate(rank_results(tmp_path)))
    assert got[0]["padded"] == [["a", True], ["b", True], ["c", True]]
    assert got[1]["padded"] == [["d", True], ["d", False], ["d", False]]
    assert got[0]["empty"] == [["x", True], ["y", True]]
    assert got[1]["empty"] == [["filler", False], ["filler", False]]
    assert (got[0]["refused"], got[1]["refused"]) == (False, True)
    assert got[0]["all_ranks"] == got[1]["all_ranks"] == [False, True]


GATHERED_ON_RANKS = """
import json, os, sys
from pathlib import Path
import torch
from torch.distributed.tensor import DTensor
from omni_rl.engine import distributed
from omni_rl.engine.config import AdamWConfig
from omni_rl.engine.engine import TrainingEngine, shard_units
from omni_rl.models import build_tiny, load
from omni_rl.models.forward import group_forward
from omni_rl.models.inputs import encode_prompts

out = Path(sys.argv[1])
# before joining the group: save_pretrained writes on rank 0 only inside one
tiny = build_tiny("qwen2_5_vl", out / f"tiny{os.environ['RANK']}", seed=0)
ranks = distributed.init("cpu")
model, processor = load(tiny)
model.train()
if sys.argv[2] == "checkpointing":
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
layers = [u for u in shard_units(model) if any(hasattr(m, "layer_idx") for m in u.modules())]  # FSDP2 renames them
engine = TrainingEngine(model, AdamWConfig(lr=1e-3), torch.device("cpu"), 1, precision="fp32", strategy="fsdp")

def gathered():
    # FSDP2 registers a block's gathered weights as its parameters while it holds them, its shards (DTensors) else
    return sum(not isinstance(next(u.parameters()), DTensor) for u in layers)

texts = [["Hi.", "Which fruit is red? A. apple B. lime"], ["Name a colour you like, in one word.", "Stop."]]
conversations = [[{"role": "user", "content": [{"type": "text", "text": t}]}] for t in texts[ranks.rank]]
inputs = encode_prompts(processor, conversations)
ids = torch.randint(0, 256, (4, 5), generator=torch.Generator().manual_seed(ranks.rank))
mask = torch.ones_like(ids)
logp = group_forward(engine.model, inputs, ids, mask, 2).logp
after_forward = gathered()
engine.backward((logp * mask).sum() / 40)
after_backward = gathered()
grad_norm = engine.step().grad_norm
result = {"layers": len(layers), "after_forward": after_forward, "after_backward": after_backward}
result["grad_norm"] = grad_norm
Path(out, f"rank{ranks.rank}.json").write_text(json.dumps(result))
distributed.shutdown()
"""


@pytest.mark.parametrize("checkpointing", ["plain", "checkpointing"])
def test_decoder_layers_hold_no_gathered_weights_after_forward_or_backward(tmp_path, checkpointing):
    """Under FSDP2 a trainable decoder layer frees its gathered weights after the
    shared-prefix forward (prompt pass, then completions) and after its backward, which
    reaches the prompt pass through the stored keys and values and gathers the layer
    again for it; with and without gradient checkpointing."""
    on_two_ranks(tmp_path, GATHERED_ON_RANKS, str(tmp_path), checkpointing)
    for got in rank_results(tmp_path):
        assert got["layers"] >= 2 and (got["after_forward"], got["after_backward"]) == (0, 0), got
        assert math.isfinite(got["grad_norm"]) and got["grad_norm"] > 0, got


PREFETCH_ON_RANKS = """
import json, os, sys
from pathlib import Path
import torch
import torch.distributed as dist
from omni_rl.engine import distributed
from omni_rl.engine.config import AdamWConfig
from omni_rl.engine.engine import TrainingEngine
from omni_rl.models import build_tiny, load
from omni_rl.models.forward import group_forward
from omni_rl.models.inputs import encode_prompts

out = Path(sys.argv[1])
tiny = build_tiny("qwen2_5_vl", out / f"tiny{os.environ['RANK']}", seed=0)
config = json.loads((tiny / "config.json").read_text())
for section in (config, config.get("text_config", {})):  # 4 decoder layers, the 2 new ones drawn at load
    if "num_hidden_layers" in section:
        section["num_hidden_layers"] = 4
    if "layer_types" in section:
        section["layer_types"] = section["layer_types"][:1] * 4
(tiny / "config.json").write_text(json.dumps(config))
ranks = distributed.init("cpu")
model, processor = load(tiny)
model.train()
engine = TrainingEngine(model, AdamWConfig(lr=1e-3), torch.device("cpu"), 1, precision="fp32", strategy="fsdp")
calls = []
for name in ("all_gather_single", "reduce_scatter_single"):
    def counted(*args, _collective=getattr(dist, name), _name=name[:6], **kwargs):
        calls[-1].append(_name)
        return _collective(*args, **kwargs)
    setattr(dist, name, counted)
texts = [["Hi.", "Which fruit is red? A. apple B. lime"], ["Name a colour you like, in one word.", "Stop."]]
conversations = [[{"role": "user", "content": [{"type": "text", "text": t}]}] for t in texts[ranks.rank]]
inputs = encode_prompts(processor, conversations)
ids = torch.randint(0, 256, (4, 5), generator=torch.Generator().manual_seed(ranks.rank))
mask = torch.ones_like(ids)
calls.append([])
out_ = group_forward(engine.model, inputs, ids, mask, 2, apart=True)
prompt_run = out_.prompt.run
def run():
    calls.append([])
    prompt_run()
out_.prompt.run = run
calls.append([])
engine.backward((out_.logp * mask).sum() / 40, out_.prompt)
Path(out, f"rank{ranks.rank}.json").write_text(json.dumps(calls[1:]))
distributed.shutdown()
"""


def gathered_ahead(calls: list[str]) -> int:
    """Reduce-scatters issued while more layers had been gathered than reduced: each
    means the next layer's all-gather was already under way (a prefetch)."""
    gathered = reduced = ahead = 0
    for call in calls:
        if call == "all_ga":
            gathered += 1
        else:
            reduced += 1
            ahead += gathered > reduced
    return ahead


def test_the_prompts_backward_prefetches_each_layer_as_the_completions_backward_does(tmp_path):
    """FSDP2 prefetches the next layer's weights in backward by the order of the
    forward, which it clears at the end of a backward call: the prompt's call, after
    the completions', gathered its layers one by one, each only once the layer above
    was done. With 4 decoder layers both calls now gather one layer ahead: the
    completions' call while layers 3, 2 and 1 are reduced, the prompt's while 2 and 1
    are (the last layer's prompt output gets no gradient, so the keys' gradient hook
    gathers it, with no layer before it to prefetch by)."""
    on_two_ranks(tmp_path, PREFETCH_ON_RANKS, str(tmp_path))
    for completions, prompt in rank_results(tmp_path):
        assert gathered_ahead(completions) == 3, completions
        assert gathered_ahead(prompt) == 2, prompt
        assert prompt.count("reduce") == 5, prompt  # 4 layers and the root, each reduced once


def test_resuming_with_another_process_count_is_refused_at_start(tmp_path, shapes):
    config = grpo_config(tmp_path, shapes, "auto", trainer={"steps": 1, "save_every": 1})
    launch(config, 1)
    raw = yaml.safe_load(config.read_text())
    raw["trainer"]["steps"] = 2
    config.write_text(yaml.safe_dump(raw))
    command = [TORCHRUN, "--nproc-per-node=2", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{_port()}"]
    done = subprocess.run(
        [*command, "-m", "omni_rl", "train", str(config), "--resume", "auto"],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode != 0
    assert "written by 1 process(es), resumed with 2" in done.stderr


def _alternating(data: Path, name: str) -> Path:
    """``data``'s rows in an unshuffled order that alternates a row with its video and
    one without: at 2 prompts a step on 2 ranks, rank 0 draws every video row and
    rank 1 only text (``draw_rows`` hands each rank its slice of each draw)."""
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    mixed = [row if i % 2 == 0 else {k: v for k, v in row.items() if k != "videos"} for i, row in enumerate(rows)]
    out = data.with_name(name)
    out.write_text("".join(json.dumps(row) + "\n" for row in mixed))
    return out


@pytest.fixture(scope="module")
def half_videos(vowels):
    """The vowel questions (GRPO), half of them without their video."""
    return _alternating(vowels, "half_videos.jsonl")


def _mixed_config(root: Path, data: Path, strategy: str, **sections) -> Path:
    """``grpo_config`` with the rows visited in file order, each kept on the rank that
    drew it (no dealing by tokens)."""
    config = grpo_config(root, data, strategy, **sections)
    raw = yaml.safe_load(config.read_text())
    raw["data"]["shuffle"] = False
    raw["data"]["balance_tolerance"] = None
    config.write_text(yaml.safe_dump(raw))
    return config


def _launch_within(config: Path, processes: int, seconds: int):
    """``launch`` under a hard limit: a run whose ranks fall out of step (a collective
    that one rank waits on forever) fails here instead of hanging the suite."""
    command = _torchrun(processes, config)
    process = subprocess.Popen(
        command, env=ENV, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        _, stderr = process.communicate(timeout=seconds)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        _, stderr = process.communicate()
        pytest.fail(f"the 2-process run did not finish within {seconds} s:\n{stderr[-3000:]}")
    assert process.returncode == 0, stderr[-3000:]
    return stderr


def launch_bounded(config: Path, processes: int) -> None:
    """One process as ``launch`` runs it, or 2 under ``_launch_within``'s time limit."""
    if processes == 1:
        launch(config, 1)
    else:
        _launch_within(config, 2, 300)


MICRO = {"trainer": {"micro_batch_size": 1}}


@pytest.fixture(scope="module")
def half_videos_single(tmp_path_factory, half_videos):
    # micro-batches of one prompt in one process too: a batch of a video prompt and a
    # text prompt left-pads the text by the video's tokens, whose rounding Adam amplifies
    root = tmp_path_factory.mktemp("half_videos_single")
    launch(_mixed_config(root, half_videos, "single", **MICRO), 1)
    return root / "run"


@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_video_on_one_rank_and_text_on_the_other_equals_one_process(
    tmp_path, half_videos, half_videos_single, strategy
):
    """Rank 0's micro-batches all hold a video and rank 1's none. Under FSDP2 each
    vision block is its own sharded unit, so rank 1 runs a zero-weight dummy video
    through them in every prompt forward (rollout prefill, old log-probs, the gradient
    forward) to keep all-gathers and reduce-scatters in step, and the run counts those
    passes; DDP finds the unused vision parameters itself. Either way the result is
    one process's within 1e-5, under a hard time limit (out of step, gloo aborts or
    NCCL hangs)."""
    _launch_within(_mixed_config(tmp_path, half_videos, strategy, **MICRO), 2, 300)
    one, two = half_videos_single, tmp_path / "run"
    start = initial_weights(one)
    visual = [k for k in start if "visual" in k]
    assert visual and max(float((weights(one, 3)[k] - start[k]).abs().max()) for k in visual) > 1e-4  # video trains
    assert_same_weights(weights(one, 3), weights(two, 3))
    rows = metrics(two)
    if strategy == "fsdp":  # rank 1's rollout prefill, old log-probs and gradient forward: 2 epochs of 1 micro-batch
        assert [r["update/dummy_encoder_passes"] for r in rows] == [4, 4, 4]
    else:
        assert all("update/dummy_encoder_passes" not in r for r in rows)
    for a, b in zip(metrics(one), rows, strict=True):
        assert a["reward/mean"] == pytest.approx(b["reward/mean"], abs=1e-9)
        assert a["loss/policy"] == pytest.approx(b["loss/policy"], abs=1e-5)


@pytest.fixture(scope="module")
def videos_then_texts(vowels):
    """The vowel questions in pairs: two rows with their video, then the same two
    without: unshuffled at 4 prompts a step on 2 ranks, rank 0 draws both videos."""
    rows = [json.loads(line) for line in vowels.read_text().splitlines()]
    paired = []
    for i in range(0, len(rows), 2):
        pair = rows[i : i + 2]
        texts = [{k: v for k, v in row.items() if k != "videos"} for row in pair]
        paired += pair + [{**row, "id": f"{row['id']}-text"} for row in texts]
    out = vowels.with_name("videos_then_texts.jsonl")
    out.write_text("".join(json.dumps(row) + "\n" for row in paired))
    return out


def test_rows_dealt_by_tokens_train_as_one_process_does(tmp_path, videos_then_texts):
    """Dealt by prompt tokens (the default), a video row swaps with a text row, so that
    each rank holds one of each; the completions, rewards and weights are one
    process's, and the step's tokens per rank are nearer their mean than with
    ``data.balance_tolerance: null``, where rank 0 keeps both videos."""
    sections = {
        "data": {"prompts_per_step": 4, "shuffle": False},
        # frames large enough that 2 videos against 2 texts are well past the 5% bound
        "media": {"max_frames": 8, "video_min_pixels": 12544, "video_max_pixels": 12544},
        **MICRO,
    }
    runs = {}
    for name, processes, strategy, tolerance in (
        ("single", 1, "single", 0.05),
        ("dealt", 2, "fsdp", 0.05),
        ("kept", 2, "fsdp", None),
    ):
        config = grpo_config(tmp_path / name, videos_then_texts, strategy, **sections)
        raw = yaml.safe_load(config.read_text())
        raw["data"]["balance_tolerance"] = tolerance
        config.write_text(yaml.safe_dump(raw))
        launch_bounded(config, processes)
        runs[name] = tmp_path / name / "run"
    assert_same_weights(weights(runs["single"], 3), weights(runs["dealt"], 3))
    one, dealt, kept = (metrics(runs[name]) for name in ("single", "dealt", "kept"))
    for a, b in zip(one, dealt, strict=True):
        assert a["reward/mean"] == pytest.approx(b["reward/mean"], abs=1e-9)
        assert a["response/length_mean"] == b["response/length_mean"]
        assert a["loss/policy"] == pytest.approx(b["loss/policy"], abs=1e-5)
    for d, k in zip(dealt, kept, strict=True):
        assert d["balance/moved_rows"] == 2 and k["balance/moved_rows"] == 0
        drawn = d["balance/prompt_max_over_mean_drawn"]
        assert drawn == k["balance/prompt_max_over_mean_drawn"] == k["balance/prompt_max_over_mean"] > 1.08
        assert d["balance/prompt_max_over_mean"] < 1.01
        assert d["balance/max_over_mean"] < k["balance/max_over_mean"]
    assert all(r["balance/moved_rows"] == 0 and r["balance/prompt_max_over_mean"] == 1.0 for r in one)


def test_sft_with_video_on_one_rank_and_text_on_the_other_equals_one_process(tmp_path, shapes):
    """SFT's forward takes whole prompts too: rank 1's text rows run the dummy video."""
    data = _alternating(shapes, "half_videos_sft.jsonl")
    runs = {}
    for processes, strategy in ((1, "single"), (2, "fsdp")):
        config = _mixed_config(tmp_path / strategy, data, strategy)
        raw = yaml.safe_load(config.read_text())
        del raw["rollout"], raw["algorithm"], raw["rewards"]
        raw["recipe"] = "sft"
        raw["trainer"].update(steps=3, save_every=0, micro_batch_size=1)
        config.write_text(yaml.safe_dump(raw))
        launch_bounded(config, processes)
        runs[strategy] = tmp_path / strategy / "run"
    assert_same_weights(weights(runs["single"], 3), weights(runs["fsdp"], 3))
    assert [r["update/dummy_encoder_passes"] for r in metrics(runs["fsdp"])] == [1, 1, 1]


@pytest.fixture(scope="module")
def audio_or_image(tmp_path_factory):
    """Omni rows that alternate an audio clip and an image: unshuffled, at 2 prompts a
    step on 2 ranks, rank 0 draws every audio row and rank 1 every image row."""
    import numpy as np

    from omni_rl.preprocess.sounds import write_audio_qa
    from omni_rl.preprocess.synthetic import write_image

    data = write_audio_qa(tmp_path_factory.mktemp("audio_or_image"), 4, seed=0)
    rows = []
    for i, row in enumerate(json.loads(line) for line in data.read_text().splitlines()):
        image = f"media/image_{i}.png"
        write_image(data.parent / image, np.random.default_rng(i).integers(0, 255, (56, 84, 3), dtype=np.uint8))
        rows.append({**row, "problem_type": "vowel_share"})
        rows.append({**row, "id": f"{row['id']}-image", "problem_type": "vowel_share", "audios": [], "images": [image]})
    for row in rows:
        if not row["audios"]:
            del row["audios"]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return data


def test_omni_with_audio_on_one_rank_and_images_on_the_other_equals_one_process(tmp_path, audio_or_image):
    """An Omni thinker has two sharded encoders, run audio first: rank 0 (audio) runs a
    dummy image through the vision blocks after its audio, rank 1 (images) a dummy
    clip through the audio blocks before its images, so both ranks call the encoders
    in the same order; with a KL reference too (frozen: resharded after every forward,
    so gathered again in each)."""
    sections = {
        "model": {"tiny_family": "qwen2_5_omni_thinker", "tiny_audio_seconds": 2},
        "media": {"family": "qwen2_5_omni_thinker", "max_audio_seconds": 2.0},
        "algorithm": {"kl_coef": 0.04},
        "trainer": {"steps": 2, "micro_batch_size": 1},
    }
    runs = {}
    for processes, strategy in ((1, "single"), (2, "fsdp")):
        config = _mixed_config(tmp_path / strategy, audio_or_image, strategy, **sections)
        launch_bounded(config, processes)
        runs[strategy] = tmp_path / strategy / "run"
    one, two = runs["single"], runs["fsdp"]
    start = initial_weights(one)
    for part in ("visual", "audio_tower"):  # both encoders trained
        assert max(float((weights(one, 2)[k] - start[k]).abs().max()) for k in start if part in k) > 1e-4, part
    assert_same_weights(weights(one, 2), weights(two, 2))
    assert all(r["update/dummy_encoder_passes"] > 0 for r in metrics(two))
    for a, b in zip(metrics(one), metrics(two), strict=True):
        assert a["reward/mean"] == pytest.approx(b["reward/mean"], abs=1e-9)
        assert a["loss/policy"] == pytest.approx(b["loss/policy"], abs=1e-5)


def update_of(run: Path, step: int = 1) -> torch.Tensor:
    """Every weight's change over ``step`` steps, flattened into one vector (fp32)."""
    start, end = initial_weights(run), weights(run, step)
    return torch.cat([(end[k].float() - start[k].float()).flatten() for k in sorted(start)])


def test_bf16_mixed_fsdp_on_two_processes_matches_one_within_bf16(tmp_path, vowels):
    """bf16-mixed (bf16 compute, fp32 master weights, fp32 gradient reduction): FSDP2 on
    two processes against one process (autocast), one unclipped SGD step without
    momentum, so the update is -lr times the gradient. What bf16 leaves the same and
    what it bounds:

    - the rollouts: the sampled tokens, so the rewards and lengths, are the same
      (rounding that flipped a sampled token would show here first);
    - the gradient's norm, to 2%, and the update, whose two runs differ by at most 5% of
      its norm (bf16 keeps 8 bits of mantissa, 0.4% a rounding; 0.5% measured on this
      machine). A wrong reduction misses by far more: a missing 1/N doubles the norm, a
      rank's gradient lost is about half the update."""
    sections = {
        "trainer": {"steps": 1, "save_every": 1, "precision": "bf16-mixed", "max_grad_norm": 0.0},
        "optimizer": {"type": "sgd", "lr": 0.1, "momentum": 0.0},
        "algorithm": {"epochs": 1, "mini_batch_prompts": 0},
    }
    launch(grpo_config(tmp_path / "one", vowels, "single", **sections), 1)
    launch(grpo_config(tmp_path / "two", vowels, "fsdp", **sections), 2)
    one, two = tmp_path / "one" / "run", tmp_path / "two" / "run"
    (a,), (b,) = metrics(one), metrics(two)
    assert a["reward/mean"] == b["reward/mean"] and a["response/length_mean"] == b["response/length_mean"]
    assert b["optim/grad_norm"] == pytest.approx(a["optim/grad_norm"], rel=0.02)
    first, second = update_of(one), update_of(two)
    assert first.norm() == pytest.approx(0.1 * a["optim/grad_norm"], rel=0.02)  # SGD: -lr times the gradient
    assert float((second - first).norm() / first.norm()) <= 0.05


def test_a_rollout_gathers_the_sharded_weights_once_not_per_token(tmp_path, vowels):
    """FSDP2 on 2 processes: with ``rollout.gather_once`` (the default) the decode loop
    gathers nothing after the prefill; without it, every decoded token gathers every
    decoder layer's weights again (their full fp32 size into each rank, counted by hand
    from the checkpoint), and the run is the same to the bit either way."""
    sections = {"trainer": {"steps": 2, "save_every": 1}, "algorithm": {"epochs": 1, "mini_batch_prompts": 0}}
    launch(grpo_config(tmp_path / "once", vowels, "fsdp", **sections), 2)
    launch(grpo_config(tmp_path / "per_token", vowels, "fsdp", rollout={"gather_once": False}, **sections), 2)
    once, per_token = tmp_path / "once" / "run", tmp_path / "per_token" / "run"
    # the decoder layers (saved under the legacy names model.layers.N; the vision blocks are visual.blocks.N)
    layers = sum(t.numel() * 4 for k, t in initial_weights(once).items() if k.startswith("model.layers."))
    assert layers > 0
    for a, b in zip(metrics(once), metrics(per_token), strict=True):
        assert a["rollout/gathered_bytes_per_token"] == 0 and a["rollout/gathered_bytes"] > 0
        assert a["rollout/inference_mode"] == b["rollout/inference_mode"] == 0  # no_grad on FSDP2 units
        assert b["rollout/gathered_bytes_per_token"] == layers
        assert b["rollout/gathered_bytes"] > a["rollout/gathered_bytes"]
        strip = ("rollout/gathered_bytes", "rollout/gathered_bytes_per_token")
        assert {k: v for k, v in a.items() if k not in strip} == {k: v for k, v in b.items() if k not in strip}
    assert_same_weights(weights(once, 2), weights(per_token, 2), atol=0)


SYNC_ON_RANKS = """
import json, os, sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from omni_rl.engine import distributed
from omni_rl.engine.config import AdamWConfig
from omni_rl.engine.engine import TrainingEngine
from omni_rl.models import build_tiny, load
from omni_rl.rollout.vllm import full_weights, weight_gathers

out = Path(sys.argv[1])
tiny = build_tiny("qwen2_5_vl", out / f"tiny{os.environ['RANK']}", seed=0)
ranks = distributed.init("cpu")
reference = {k: v.to(torch.bfloat16) for k, v in load(tiny)[0].state_dict().items()}
model, _ = load(tiny)
engine = TrainingEngine(model, AdamWConfig(lr=1e-3), torch.device("cpu"), 1, precision="fp32", strategy="fsdp")
calls = {"all_gathers": 0, "full_tensor": 0}
gather, full = dist.all_gather_single, DTensor.full_tensor  # FSDP2's unshard calls the first

def counted_gather(*args, **kwargs):
    calls["all_gathers"] += 1
    return gather(*args, **kwargs)

def counted_full(self, *args, **kwargs):
    calls["full_tensor"] += 1
    return full(self, *args, **kwargs)

dist.all_gather_single, DTensor.full_tensor = counted_gather, counted_full
synced = {name: t for bucket in full_weights(engine.module, 64 * 1024) for name, t in bucket}
result = {
    **calls,
    "units": weight_gathers(engine.module),
    "same_names": sorted(synced) == sorted(reference),
    "max_difference": max(float((synced[k].float() - reference[k].float()).abs().max()) for k in reference),
    "bf16": all(t.dtype == torch.bfloat16 for t in synced.values() if t.is_floating_point()),
    "sharded_after": all(isinstance(p, DTensor) for p in engine.module.parameters()),
}
Path(out, f"rank{ranks.rank}.json").write_text(json.dumps(result))
distributed.shutdown()
"""


def test_the_vllm_weight_sync_gathers_each_fsdp_unit_once(tmp_path):
    """The weights pushed to vLLM from an FSDP2 model on 2 processes: every state entry,
    in bf16, equal to the unsharded model's, with one all-gather per FSDP2 unit (before:
    one per tensor, 57 here and about 730 at 7B) and every unit sharded again afterwards."""
    on_two_ranks(tmp_path, SYNC_ON_RANKS, str(tmp_path))
    for got in rank_results(tmp_path):
        assert got["units"] >= 4 and got["all_gathers"] == got["units"] and got["full_tensor"] == 0, got
        assert got["same_names"] and got["max_difference"] == 0 and got["bf16"] and got["sharded_after"], got


def test_model_inputs_from_the_cache_on_two_processes_train_as_one_process(tmp_path, tiny_checkpoint):
    """Both FSDP2 ranks read their prompts' model inputs from the cache that
    ``omni-rl preprocess --config`` wrote (the counts summed over ranks), and the run
    logs one process's rewards and losses."""
    from test_grpo import tiny_config

    from omni_rl.cli import main

    train = write_video_qa(tmp_path / "data", videos=4, seed=0, seconds=2.0)
    cache = str(tmp_path / "cache")

    def config(name: str, strategy: str) -> Path:
        return tiny_config(
            tmp_path / name,
            train,
            run={"device": "cpu", "threads": 1},
            model={"path": str(tiny_checkpoint("qwen2_5_vl"))},
            data={"cache": cache, "shuffle": False},
            algorithm={"epochs": 1, "mini_batch_prompts": 2},
            trainer={"strategy": strategy, "micro_batch_size": 1, "save_every": 0, "log_every": 1},
        )

    one, two = config("one", "single"), config("two", "fsdp")
    assert main(["preprocess", str(train), "--cache", cache, "--config", str(one), "--workers", "1"]) == 0
    launch(one, 1)
    _launch_within(two, 2, 300)
    rows_one, rows_two = metrics(tmp_path / "one" / "run"), metrics(tmp_path / "two" / "run")
    assert [(r["data/inputs_hits"], r["data/inputs_misses"]) for r in rows_two] == [(2, 0), (4, 0), (6, 0)]
    for a, b in zip(rows_one, rows_two, strict=True):
        assert a["data/inputs_hits"] == b["data/inputs_hits"]
        assert a["reward/mean"] == pytest.approx(b["reward/mean"], abs=1e-9)
        assert a["loss/policy"] == pytest.approx(b["loss/policy"], abs=1e-5)


SKIPPED_ON_RANKS = """
import json, sys
from pathlib import Path
from omni_rl.engine import distributed
from omni_rl.recipes import grpo

ranks = distributed.init("cpu")
mine = [{"prompt_too_long": 3, "groups_filtered": 1, "sampling_rounds": 2},
        {"prompt_too_long": 0, "groups_filtered": 4, "sampling_rounds": 1}][ranks.rank]
shares = {"prompt_too_long": 5 / 3, "groups_filtered": 2 / 3, "sampling_rounds": 3}  # a rollout process's, dealt
result = {"counted": grpo._skipped_metrics(mine), "dealt": grpo._skipped_metrics(shares)}
Path(sys.argv[1], f"rank{ranks.rank}.json").write_text(json.dumps(result))
distributed.shutdown()
"""


def test_skipped_work_is_counted_over_every_rank(tmp_path):
    """skipped/prompt_too_long and skipped/groups_filtered are the step's counts over
    every rank (they were averaged over ranks: half the count at 2); the sampling rounds
    are a rank's, averaged. A rollout process's counts dealt to trainers in shares sum
    back to the whole."""
    on_two_ranks(tmp_path, SKIPPED_ON_RANKS, str(tmp_path))
    for result in rank_results(tmp_path):
        assert result["counted"] == {
            "skipped/prompt_too_long": 3,
            "skipped/groups_filtered": 5,
            "skipped/sampling_rounds": 1.5,
        }
        dealt = {"skipped/prompt_too_long": 3, "skipped/groups_filtered": 1, "skipped/sampling_rounds": 3}
        assert result["dealt"] == dealt
