"""The one-step-off rollout (``rollout.staleness: 1``): under torchrun the last process
generates step k+1's prompts with step k's weights while the others train.

On CPU processes over gloo, as users launch it: with a checkpoint after every step
every batch is generated with the weights it trains (the batch after a checkpoint is
fresh), so the run is the synchronous one-process run bit for bit; without, every
batch after the first is one step stale, which the mismatch metrics show, and the run
is the same whether one trainer or two take the batches. A run killed and resumed
repeats the uninterrupted one's metrics and weights exactly.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from test_distributed import (
    assert_same_weights,
    grpo_config,
    launch,
    launch_and_kill,
    metrics,
    on_two_ranks,
    rank_results,
    vowel_rows,
    weights,
)

from omni_rl.data.dataset import Sample
from omni_rl.engine import distributed
from omni_rl.errors import ConfigError, OmniRLError
from omni_rl.preprocess.scenes import write_video_qa
from omni_rl.recipe_loader import load_config
from omni_rl.recipes.grpo import Batch, Collected, _deal_to_trainers
from omni_rl.rollout.hf import Rollouts

OFF = {"rollout": {"n": 4, "max_new_tokens": 8, "staleness": 1}}


@pytest.fixture(scope="module")
def vowels(tmp_path_factory):
    return vowel_rows(write_video_qa(tmp_path_factory.mktemp("shapes"), videos=4, seed=0, seconds=2.0))


@pytest.fixture(scope="module")
def grpo_single(tmp_path_factory, vowels):
    """The synchronous run in one process."""
    root = tmp_path_factory.mktemp("grpo1")
    launch(grpo_config(root, vowels, "single"), 1)
    return root / "run"


def _rows(run) -> list[dict]:
    """Metrics rows without the rollout process's timings."""
    return [{k: v for k, v in r.items() if not k.startswith("rollout_process/")} for r in metrics(run)]


def test_a_checkpoint_every_step_makes_every_batch_fresh_and_the_run_the_synchronous_one(tmp_path, vowels, grpo_single):
    config = grpo_config(tmp_path, vowels, "single", algorithm={"rollout_correction": "none"}, **OFF)
    launch(config, 2)  # one trainer, one rollout process
    run = tmp_path / "run"
    rows = _rows(run)
    assert [r["rollout/staleness"] for r in rows] == [0, 0, 0]
    assert all(r["rollout_process/weights_wait_s"] >= 0 for r in metrics(run))
    assert rows == metrics(grpo_single)
    for step in (2, 3):
        assert_same_weights(weights(grpo_single, step), weights(run, step), atol=0)


@pytest.fixture(scope="module")
def stale_one_trainer(tmp_path_factory, vowels):
    root = tmp_path_factory.mktemp("stale1")
    launch(grpo_config(root, vowels, "fsdp", trainer={"save_every": 0}, **OFF), 2)
    return root / "run"


def test_without_checkpoints_every_batch_after_the_first_is_one_step_stale(stale_one_trainer):
    rows = _rows(stale_one_trainer)
    assert [r["rollout/staleness"] for r in rows] == [0, 1, 1]
    # step 1 samples with the weights it trains; later steps with the step before's (lr 1e-3 moves them)
    assert rows[0]["rollout/logp_abs_diff"] < 1e-5
    assert min(r["rollout/logp_abs_diff"] for r in rows[1:]) > 1e-3
    assert all("rollout/tis_capped_fraction" in r for r in rows)  # auto: tis weighs the stale tokens


def test_two_trainers_take_the_batches_one_trainer_takes(tmp_path, vowels, stale_one_trainer):
    launch(grpo_config(tmp_path, vowels, "fsdp", trainer={"save_every": 0}, **OFF), 3)
    run = tmp_path / "run"
    for one, two in zip(_rows(stale_one_trainer), _rows(run), strict=True):
        assert one["rollout/staleness"] == two["rollout/staleness"]
        assert one["reward/mean"] == pytest.approx(two["reward/mean"], abs=1e-6)
        assert one["loss/policy"] == pytest.approx(two["loss/policy"], abs=1e-5)
    assert_same_weights(weights(stale_one_trainer, 3), weights(run, 3))


def test_a_killed_one_step_off_run_resumes_to_the_uninterrupted_one(tmp_path, vowels):
    sections = {**OFF, "trainer": {"steps": 6, "save_every": 2}, "algorithm": {"epochs": 1}}
    straight = grpo_config(tmp_path / "a", vowels, "fsdp", **sections)
    launch(straight, 2)
    resumed = grpo_config(tmp_path / "b", vowels, "fsdp", **sections)
    log = launch_and_kill(resumed, 3)  # step 3 logged: step 2's checkpoint is written
    assert 3 <= len(log.read_text().splitlines()) < 6
    assert not (log.parent / "checkpoints" / "step-00000006").exists()  # nothing ran on after the kill
    launch(resumed, 2, "--resume", "auto")
    a, b = _rows(tmp_path / "a" / "run"), _rows(tmp_path / "b" / "run")
    assert [r["rollout/staleness"] for r in a] == [0, 1, 0, 1, 0, 1]
    assert b == a
    assert_same_weights(weights(tmp_path / "a" / "run", 6), weights(tmp_path / "b" / "run", 6), atol=0)


LORA = {"model": {"tiny_family": "qwen2_5_vl", "lora": {"rank": 4, "alpha": 8}}}


def test_a_lora_run_pushes_its_adapters_and_equals_the_synchronous_run(tmp_path, vowels):
    """The rollout process builds the same adapters and takes the trained ones after each
    step: with a checkpoint every step, the run is the synchronous one bit for bit."""
    launch(grpo_config(tmp_path / "sync", vowels, "single", algorithm={"rollout_correction": "none"}, **LORA), 1)
    config = grpo_config(tmp_path / "off", vowels, "fsdp", algorithm={"rollout_correction": "none"}, **LORA, **OFF)
    launch(config, 2)
    sync, off = tmp_path / "sync" / "run", tmp_path / "off" / "run"
    rows = _rows(off)
    assert [r["rollout/staleness"] for r in rows] == [0, 0, 0]
    assert rows == metrics(sync)
    adapters = "checkpoints/step-00000003/model/adapter_model.safetensors"
    assert_same_weights(load_file(sync / adapters), load_file(off / adapters), atol=0)


PUSH_ON_RANKS = """
import json, os, sys
from pathlib import Path

import torch
import torch.distributed as dist
from peft import get_peft_model

from omni_rl.engine import distributed, gathering
from omni_rl.engine.config import AdamWConfig
from omni_rl.engine.engine import TrainingEngine
from omni_rl.models import build_tiny, load
from omni_rl.models.config import LoRAConfig
from omni_rl.rollout.remote import trainable_names

out = Path(sys.argv[1])
tiny = build_tiny("qwen2_5_vl", out / f"tiny{os.environ['RANK']}", seed=0)
ranks = distributed.init("cpu")
model, _ = load(tiny)
torch.manual_seed(0)
model = get_peft_model(model, LoRAConfig(rank=4, alpha=8).peft_config())
engine = TrainingEngine(model, AdamWConfig(lr=1e-3), torch.device("cpu"), 1, precision="fp32", strategy="fsdp")
names = trainable_names(engine.module)
every = {name: value.detach().clone() for name, value in gathering.full_entries(engine.module)}
holding = [
    unit for unit in engine.module.modules() if gathering.tracked(unit)
    and any(p.requires_grad for owner, name in gathering.own_parameters(unit) for p in [getattr(owner, name)])
]
gathers = {"count": 0}
gather = dist.all_gather_single

def counted(*args, **kwargs):
    gathers["count"] += 1
    return gather(*args, **kwargs)

dist.all_gather_single = counted
pushed = {name: value.detach().clone() for name, value in gathering.full_entries(engine.module, names)}
result = {
    "gathers": gathers["count"],
    "units": sum(gathering.tracked(m) for m in engine.module.modules()),
    "holding": len(holding),
    "pushed": sorted(pushed),
    "trainable": sorted(names),
    "same": all(torch.equal(pushed[k], every[k]) for k in pushed),
}
Path(out, f"rank{ranks.rank}.json").write_text(json.dumps(result))
distributed.shutdown()
"""


def test_a_lora_push_gathers_only_the_units_that_hold_adapters(tmp_path):
    """Under FSDP2 on 2 processes with adapters on the language model's attention: the
    push reads exactly the trainable weights, gathering each unit that holds one once and
    no other (the vision tower's blocks hold none)."""
    on_two_ranks(tmp_path, PUSH_ON_RANKS, str(tmp_path))
    for got in rank_results(tmp_path):
        assert got["pushed"] == got["trainable"] and got["same"], got
        assert all(".lora_" in name for name in got["pushed"]), got["pushed"][:3]
        assert 0 < got["gathers"] == got["holding"] < got["units"], got


# ------------------------------------------------------------------ without processes


def _collected(prompt_tokens: list[int], n: int = 2) -> Collected:
    count = len(prompt_tokens)
    samples = [Sample(str(i), "multiple_choice", "A", []) for i in range(count)]
    encoded = [{"input_ids": torch.zeros(1, t, dtype=torch.long)} for t in prompt_tokens]
    rollouts = Rollouts(
        torch.arange(count * n)[:, None],
        torch.ones(count * n, 1),
        torch.zeros(count * n, 1),
        torch.ones(count * n, dtype=torch.long),
        ["stop"] * count * n,
        [str(r) for r in range(count * n)],
        n,
    )
    return Collected(
        Batch(samples, encoded, list(range(count)), list(range(count))),
        rollouts,
        [f"result{r}" for r in range(count * n)],
        torch.arange(count * n, dtype=torch.float),
        ["ab"],
        {"prompt_too_long": 4, "groups_filtered": 2, "sampling_rounds": 3},
        {"groups": count, "offline": 0, "offline_reward": 0.0, "offline_cut": 0},
        {},
        version=5,
        sampler={"drawn": count},
    )


def _config(tmp_path, **data):
    rows = tmp_path / "rows.jsonl"
    rows.write_text("")
    return load_config(
        grpo_config(tmp_path, rows, "fsdp", data={"prompts_per_step": 4, **data}, rollout={"n": 2}),
        [],
    )


def test_groups_are_dealt_to_trainers_by_prompt_tokens_with_their_rows(tmp_path):
    cfg = _config(tmp_path)
    parts = _deal_to_trainers(_collected([100, 90, 10, 20]), 2, cfg)
    # drawn: [100, 90] and [10, 20] (190 against 30); 100 and 20 swap: 110 each
    assert [[s.id for s in p.batch.samples] for p in parts] == [["1", "3"], ["0", "2"]]
    assert parts[0].results == ["result2", "result3", "result6", "result7"]
    assert parts[1].rewards.tolist() == [0.0, 1.0, 4.0, 5.0]
    assert parts[1].rollouts.texts == ["0", "1", "4", "5"]
    assert parts[0].balance["balance/moved_rows"] == 2
    assert parts[0].balance["balance/prompt_max_over_mean_drawn"] == pytest.approx(190 / 110)
    assert parts[0].balance["balance/prompt_max_over_mean"] == 1.0
    # counts summed over ranks: rank 0 carries them; counts averaged over ranks: each its share
    assert parts[0].filtered == ["ab"] and parts[1].filtered == []
    assert parts[0].mixed["groups"] == 4 and parts[1].mixed["groups"] == 0
    assert parts[1].skipped == {"prompt_too_long": 2, "groups_filtered": 1, "sampling_rounds": 3}
    assert all(p.version == 5 and p.sampler == {"drawn": 4} and not p.batch.filler for p in parts)


def test_a_trainer_without_a_group_trains_a_zero_weight_copy(tmp_path):
    cfg = _config(tmp_path, balance_tolerance=None)
    parts = _deal_to_trainers(_collected([30]), 2, cfg)
    assert [p.batch.filler for p in parts] == [False, True]
    assert [s.id for s in parts[1].batch.samples] == ["0"] and parts[1].results == []
    assert parts[1].rewards.shape == (2,)


def test_a_rollout_process_needs_a_process_beside_the_trainers(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(OmniRLError, match="torchrun --nproc-per-node 2"):
        distributed.init("cpu", rollout_processes=1)


@pytest.mark.parametrize(
    ("override", "says"),
    [
        ("rollout.engine=vllm", "hf engine in its own process"),
        ("data.sampler.type=ucb", "UCB sampler"),
        ("rollout.staleness=2", "must be one of 0, 1"),
    ],
)
def test_settings_a_one_step_off_rollout_cannot_take_are_refused(tmp_path, override, says):
    rows = tmp_path / "rows.jsonl"
    rows.write_text("")
    config = grpo_config(tmp_path, rows, "fsdp", **OFF)
    with pytest.raises(ConfigError, match=says):
        load_config(config, [override])


def test_the_rollout_process_samples_in_bf16_with_fp32_rotary_frequencies(tiny_checkpoint):
    """Under a bf16 precision the rollout process holds its weights in bf16, as the
    trainer's forward computes; its rotary frequencies stay fp32, as they are in the
    trainer's model and in a checkpoint loaded in bf16 (module.to(bf16) rounded them,
    a position-dependent error the trainer's model does not have)."""
    from omni_rl.models import load
    from omni_rl.recipes.grpo import cast_weights

    model, _ = load(tiny_checkpoint("qwen2_5_vl"))
    frequencies = {name: b.clone() for name, b in model.named_buffers() if name.endswith("inv_freq")}
    assert frequencies and all(b.dtype == torch.float32 for b in frequencies.values())
    cast_weights(model, torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    after = dict(model.named_buffers())
    for name, before in frequencies.items():
        assert after[name].dtype == torch.float32 and torch.equal(after[name], before), name
    loaded, _ = load(tiny_checkpoint("qwen2_5_vl"), dtype=torch.bfloat16)  # what from_pretrained keeps
    assert {b.dtype for n, b in loaded.named_buffers() if n.endswith("inv_freq")} == {torch.float32}


def test_a_bf16_mixed_one_step_off_run_samples_what_its_trainer_scores(tmp_path, vowels):
    """bf16-mixed on two processes over gloo: the rollout process samples in bf16 (its
    weights cast, its rotary frequencies fp32), the trainer scores under bf16 autocast
    over fp32 masters; with a checkpoint every step each batch is fresh, so the
    logged mismatch is precision's alone, a bf16 rounding's size, not staleness."""
    config = grpo_config(tmp_path, vowels, "single", trainer={"precision": "bf16-mixed"}, **OFF)
    launch(config, 2)
    rows = _rows(tmp_path / "run")
    assert [r["rollout/staleness"] for r in rows] == [0, 0, 0]
    assert all(0 < r["rollout/logp_abs_diff"] < 0.05 for r in rows), [r["rollout/logp_abs_diff"] for r in rows]
