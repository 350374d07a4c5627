"""Loading at size: under FSDP2 on several processes the model is built on the meta
device, sharded, and filled from rank 0's read (2 CPU processes over gloo, launched by
torchrun as in tests/test_distributed.py); exports are written tensor by tensor in the
dtype of the checkpoint the model was read from."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_distributed import ENV, TORCHRUN, _port
from test_distributed_waits import _json_objects

from omni_rl.engine.checkpoint import export_model
from omni_rl.engine.config import AdamWConfig
from omni_rl.engine.engine import TrainingEngine
from omni_rl.models import FAMILIES, build_tiny, load
from omni_rl.models.tokenizer import build_tokenizer

PYTHON = sys.executable


def _launch(script: str, processes: int, *args: str) -> list[dict]:
    """``script`` on ``processes`` local processes (torchrun for several, plain python
    for one); every JSON object they print, by rank."""
    path = Path(args[0]) / "script.py"
    path.write_text(script)
    command = [PYTHON, str(path)]
    if processes > 1:
        rendezvous = ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{_port()}"]
        command = [TORCHRUN, f"--nproc-per-node={processes}", *rendezvous, str(path)]
    done = subprocess.run([*command, *args], env=ENV, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return sorted(_json_objects(done.stdout), key=lambda r: (r.get("rank", 0), r.get("name", "")))


def _read_dir(directory: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob("*.safetensors")):
        tensors |= load_file(file)
    return tensors


def _tied(out: Path) -> Path:
    """A tiny qwen2_vl whose output embedding is its input embedding (as in Qwen2.5-VL-3B)."""
    spec = FAMILIES.get("qwen2_vl")
    tokenizer = build_tokenizer(spec.tokens)
    config = spec.tiny_config(tokenizer, 64)
    config.tie_word_embeddings = True
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = spec.model_cls()(config)
    model.save_pretrained(out)
    spec.tiny_processor(tokenizer).save_pretrained(out)
    return out


def _bf16(source: Path, out: Path) -> Path:
    """``source`` stored in bf16, its config.json saying so (as released checkpoints are)."""
    model, processor = load(source, dtype=torch.bfloat16)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return out


RELEASED = Path(__file__).parent.parent / "tools" / "model_configs"


def _dtype_keys(config: dict, prefix: tuple = ()) -> list[tuple[str, ...]]:
    """The key paths of every ``dtype``/``torch_dtype`` entry in a config."""
    found = []
    for key, value in config.items():
        if key in ("dtype", "torch_dtype"):
            found.append((*prefix, key))
        elif isinstance(value, dict):
            found += _dtype_keys(value, (*prefix, key))
    return found


def _released_dtype_layout(checkpoint: Path, released: str) -> Path:
    """``checkpoint``'s config.json with its dtype entries moved where the released
    config ``tools/model_configs/<released>.json`` keeps them (and spelled as it does)."""
    want = _dtype_keys(json.loads((RELEASED / f"{released}.json").read_text()))
    config = json.loads((checkpoint / "config.json").read_text())
    name = next(config[k] for k in ("dtype", "torch_dtype") if config.get(k))
    for keys in _dtype_keys(config):
        section = config
        for key in keys[:-1]:
            section = section[key]
        del section[keys[-1]]
    for keys in want:
        section = config
        for key in keys[:-1]:
            section = section.setdefault(key, {})
        section[keys[-1]] = name
    (checkpoint / "config.json").write_text(json.dumps(config, indent=2))
    return checkpoint


@pytest.mark.parametrize(
    "released", ["Qwen2.5-VL-7B-Instruct", "Qwen3-VL-8B-Instruct", "Qwen2-Audio-7B-Instruct", "pi0_base"]
)
def test_the_stored_dtype_is_read_where_each_released_config_keeps_it(tmp_path, released):
    """Qwen2.5-VL keeps ``torch_dtype`` at the top, Qwen3-VL ``dtype`` in ``text_config``
    alone, Qwen2-Audio ``torch_dtype`` in ``text_config`` alone; pi0_base names none."""
    from omni_rl.models.weights import stored_dtype

    (tmp_path / "config.json").write_text((RELEASED / f"{released}.json").read_text())
    want = torch.float32 if released == "pi0_base" else torch.bfloat16
    assert stored_dtype(tmp_path, default=torch.float32) == want


FILL_ON_RANKS = r"""
import json, sys
from pathlib import Path

import torch

from omni_rl.engine import distributed
from omni_rl.engine.checkpoint import export_model
from omni_rl.engine.config import AdamWConfig
from omni_rl.engine.engine import TrainingEngine
from omni_rl.models import load

ranks = distributed.init("cpu", timeout_minutes=5)
root = Path(sys.argv[1])
ids = torch.tensor([[1, 5, 9, 13, 17, 21, 25, 29]])
for path in sorted(p for p in (root / "models").iterdir()):
    plain, processor = load(path)  # the plain single-process load
    model, _ = load(path, empty=True)
    built_empty = all(p.device.type == "meta" for p in model.parameters())
    engine = TrainingEngine(model, AdamWConfig(), torch.device("cpu"), 1, precision="fp32", strategy="fsdp")
    full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
    want = plain.state_dict()
    buffers, want_buffers = dict(model.named_buffers()), dict(plain.named_buffers())
    persistent = set(want)
    with torch.no_grad():
        logits = engine.model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
        want_logits = plain(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    export_model(engine, root / "exports" / path.name, processor, shard_bytes=200_000)
    tied = plain.get_output_embeddings().weight is plain.get_input_embeddings().weight
    row = {
        "rank": ranks.rank,
        "name": path.name,
        "built_empty": built_empty,
        "sharded": all(hasattr(p, "full_tensor") for p in model.parameters()),
        "same_keys": sorted(full) == sorted(want),
        "weights": max(float((full[k] - want[k]).abs().max()) for k in want),
        "dtypes": sorted({str(v.dtype) for v in full.values()}),
        "stored": str(model.omni_rl_stored.dtype),  # what rank 0 reads, broadcasts and exports in
        "buffers": sorted(k for k in want_buffers if k not in persistent),
        "buffer_diff": max(float((buffers[k] - want_buffers[k]).abs().max()) for k in want_buffers),
        "logits": float((logits - want_logits).abs().max()),
        "tied": tied,
        "still_tied": model.get_output_embeddings().weight is model.get_input_embeddings().weight,
    }
    if ranks.is_main:
        plain.save_pretrained(root / "saved" / path.name)
    print(json.dumps(row), flush=True)
distributed.shutdown()
"""


@pytest.fixture(scope="module")
def fill_rows(tmp_path_factory):
    """Every tiny family ``build_tiny`` builds, a tied-embedding model and a bf16-stored
    one, each loaded through the FSDP2 path on 2 processes and exported there."""
    root = tmp_path_factory.mktemp("fill")
    models = root / "models"
    for family in FAMILIES:
        build_tiny(family, models / family)
    _tied(models / "tied_qwen2_vl")
    _bf16(models / "qwen2_5_vl", models / "bf16_qwen2_5_vl")
    # bf16 checkpoints whose config.json keeps the dtype where the released one does
    _released_dtype_layout(_bf16(models / "qwen3_vl", models / "bf16_qwen3_vl"), "Qwen3-VL-8B-Instruct")
    _released_dtype_layout(_bf16(models / "qwen2_audio", models / "bf16_qwen2_audio"), "Qwen2-Audio-7B-Instruct")
    return root, _launch(FILL_ON_RANKS, 2, str(root))


@pytest.mark.slow
def test_fsdp2_load_on_two_processes_equals_a_plain_load_for_every_family(fill_rows):
    """Each rank's sharded model, built on the meta device and filled from rank 0's read,
    holds the plain load's weights (transformers' key mapping applied: qwen2_vl's
    ``model.layers`` under ``model.language_model``, Qwen3-Omni's fused experts, an Omni
    thinker out of its released layout), recomputes its non-persistent buffers (RoPE's
    inv_freq, the audio encoder's sinusoids) and gives the same logits; tied embeddings
    stay tied."""
    _, rows = fill_rows
    names = {*FAMILIES, "tied_qwen2_vl", "bf16_qwen2_5_vl", "bf16_qwen3_vl", "bf16_qwen2_audio"}
    assert {(r["rank"], r["name"]) for r in rows} == {(rank, name) for rank in (0, 1) for name in names}
    for row in rows:
        assert row["built_empty"] and row["sharded"] and row["same_keys"], row
        assert row["weights"] == 0.0 and row["buffer_diff"] == 0.0, row
        assert row["logits"] <= 1e-5, row
        assert row["dtypes"] == ["torch.float32"], row  # a bf16 checkpoint fills fp32 master weights
        assert row["stored"] == ("torch.bfloat16" if row["name"].startswith("bf16") else "torch.float32"), row
        assert "inv_freq" in " ".join(row["buffers"]), row
        assert row["still_tied"] == row["tied"] == (row["name"] == "tied_qwen2_vl"), row
    omni = next(r for r in rows if r["name"] == "qwen2_5_omni")
    assert any("positional_embedding" in b for b in omni["buffers"])


@pytest.mark.slow
def test_an_fsdp2_export_equals_save_pretrained_in_the_checkpoints_dtype(fill_rows):
    """What 2 FSDP2 processes export, gathered tensor by tensor into several files with an
    index, is what ``save_pretrained`` of the plain load writes (the checkpoint's key
    names), in the dtype the checkpoint stores, and loads back equal."""
    root, _ = fill_rows
    for name in sorted(p.name for p in (root / "models").iterdir()):
        export, saved = root / "exports" / name, root / "saved" / name
        assert (export / "model.safetensors.index.json").is_file(), name
        index = json.loads((export / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"].values()) == {p.name for p in export.glob("*.safetensors")}, name
        got, want = _read_dir(export), _read_dir(saved)
        stored = torch.bfloat16 if name.startswith("bf16") else torch.float32
        assert got.keys() == want.keys(), name
        assert all(torch.equal(got[k], want[k].to(stored)) for k in got), name
        assert json.loads((export / "config.json").read_text())["dtype"] == str(stored).removeprefix("torch.")
        back, _ = load(export)
        plain, _ = load(root / "models" / name)
        assert all(torch.equal(v, plain.state_dict()[k]) for k, v in back.state_dict().items()), name


MEMORY_ON_RANKS = r"""
import json, sys
from pathlib import Path

import torch

from omni_rl.engine import distributed
from omni_rl.engine.config import AdamWConfig
from omni_rl.engine.engine import TrainingEngine
from omni_rl.models import load


def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024


def load_and_shard(path):
    model, _ = load(path, empty=empty)
    TrainingEngine(model, AdamWConfig(), torch.device("cpu"), 1, precision="fp32", strategy=strategy)
    # what the engine keeps, resident (a plain load's weights may still be pages of the file)
    local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    assert all(bool(torch.isfinite(t).all()) for t in local)
    return model, sum(t.nbytes for t in local)


small, wide, empty = Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4] == "empty"
ranks = distributed.init("cpu", timeout_minutes=5)
strategy = "fsdp" if ranks.distributed else "single"
load_and_shard(small)  # the baseline: every module, collective and code path of loading, once
distributed.barrier()
before = status("VmRSS")
open("/proc/self/clear_refs", "w").write("5")  # VmHWM from here: the loading phase's peak
model, held = load_and_shard(wide)
row = {"rank": ranks.rank, "before": before, "peak": status("VmHWM"), "held": held}
print(json.dumps(row), flush=True)
distributed.shutdown()
"""


@pytest.mark.slow
def test_fsdp2_loading_holds_no_full_copy_on_other_ranks(tmp_path):
    """Peak resident memory of loading a bf16 checkpoint into fp32 master weights and
    sharding them (VmHWM reset at its start; the baseline is the same process's resident
    memory there, after loading a tiny model of the family the same way). One process
    peaks above its fp32 copy, which it keeps; two reading it whole peak so each. Built
    empty on two processes, rank 1 peaks at its own fp32 half and no copy of the weights,
    rank 0 at its half plus the bf16 copy it reads: no process of two peaks above one
    process alone. (``-s`` prints the figures: docs/results/loading-memory.md.)"""
    small = build_tiny("qwen2_vl", tmp_path / "small")
    wide = _bf16(build_tiny("qwen2_vl", tmp_path / "wide32", width=1536), tmp_path / "wide")
    fp32 = 2 * sum(t.nbytes for t in _read_dir(wide).values())  # the weights in fp32: about 270 MB
    args = (str(tmp_path), str(small), str(wide))
    runs = {"one": _launch(MEMORY_ON_RANKS, 1, *args, "whole"), "whole": _launch(MEMORY_ON_RANKS, 2, *args, "whole")}
    empty = runs["empty"] = _launch(MEMORY_ON_RANKS, 2, *args, "empty")
    growth = {name: [r["peak"] - r["before"] for r in rows] for name, rows in runs.items()}
    held = {name: [r["held"] for r in rows] for name, rows in runs.items()}
    print(json.dumps({"fp32_weights": fp32, "peak_growth": growth, "held": held}))
    assert all(g > fp32 for g in growth["one"] + growth["whole"]), growth
    assert empty[1]["held"] <= 0.5 * fp32 + 2**20
    assert growth["empty"][1] < 0.75 * fp32, growth  # its half, never a copy (the bf16 one is 0.5)
    assert max(growth["empty"]) < growth["one"][0], growth


def test_exports_are_written_in_the_checkpoints_dtype_and_load_back_the_trained_weights(tmp_path, tiny_checkpoint):
    """One training step, then the export: a checkpoint whose config.json says bfloat16
    exports bf16 safetensors (its config.json saying so) that load back as the trained
    weights cast to bf16; the fp32 tiny model exports fp32, equal to the trained weights."""
    for name, source in (
        ("fp32", tiny_checkpoint("qwen2_5_vl")),
        ("bf16", _bf16(tiny_checkpoint("qwen2_5_vl"), tmp_path / "bf16")),
    ):
        model, processor = load(source)
        model.train()
        engine = TrainingEngine(model, AdamWConfig(lr=1e-2), torch.device("cpu"), 1, precision="fp32")
        ids = torch.tensor([[1, 5, 9, 13, 17, 21, 25, 29]])
        engine.backward(engine.model(input_ids=ids, labels=ids).loss)
        engine.step()
        out = tmp_path / f"export-{name}"
        export_model(engine, out, processor)
        stored = torch.bfloat16 if name == "bf16" else torch.float32
        assert [p.name for p in out.glob("*.safetensors")] == ["model.safetensors"]
        assert {t.dtype for t in load_file(out / "model.safetensors").values()} == {stored}
        assert json.loads((out / "config.json").read_text())["dtype"] == str(stored).removeprefix("torch.")
        back, _ = load(out)
        trained = {k: v.detach().to(stored).float() for k, v in model.state_dict().items()}
        assert back.state_dict().keys() == trained.keys()
        assert all(torch.equal(v, trained[k]) for k, v in back.state_dict().items()), name
        start = load(source)[0].state_dict()
        assert any(not torch.equal(v, start[k]) for k, v in back.state_dict().items())  # the step moved them


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen2_5_omni"])
def test_a_loaded_model_keeps_transformers_own_layers_through_train_and_eval(tiny_checkpoint, family, monkeypatch):
    """transformers 5.25 loads with hub kernels on by default and swaps layers for
    downloaded ones whenever the mode flips (``model.train()``) on a device that has
    some: a GPU run would fetch code at run time and train other numerics than the tests
    check. The loader turns them off, so no mode switch ever reaches ``kernelize``."""
    import transformers.modeling_utils

    def no_kernelize(*args, **kwargs):
        raise AssertionError("kernelize was called")

    monkeypatch.setattr(transformers.modeling_utils, "kernelize", no_kernelize)
    model, _ = load(tiny_checkpoint(family))
    assert model.use_kernels is False
    model.train()
    model.eval()
    model.train()
