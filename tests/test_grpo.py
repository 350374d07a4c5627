"""The GRPO recipe: small runs that log and checkpoint, the update's direction, resume
after SIGKILL, and the bad-input paths (NaN losses, over-long prompts)."""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
import yaml

from omni_rl.errors import ConfigError, OmniRLError
from omni_rl.preprocess.scenes import write_video_qa
from omni_rl.recipe_loader import load_config
from omni_rl.recipes import grpo

OMNI_RL = str(Path(sys.executable).parent / "omni-rl")


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    return write_video_qa(tmp_path_factory.mktemp("shapes"), videos=6, seed=0, seconds=2.0)


def tiny_config(tmp_path: Path, train: Path, **sections) -> Path:
    config = {
        "recipe": "grpo",
        "run": {"output_dir": str(tmp_path / "run"), "seed": 0, "threads": 2},
        "model": {},  # unset path: a tiny qwen2_5_vl
        "data": {"train": str(train), "prompts_per_step": 2},
        "media": {
            "family": "qwen2_5_vl",
            "min_frames": 2,
            "max_frames": 8,
            "video_min_pixels": 3136,
            "video_max_pixels": 12544,
        },
        "rollout": {"n": 4, "max_new_tokens": 12},
        "algorithm": {"epochs": 2, "mini_batch_prompts": 1},
        "trainer": {"steps": 3, "save_every": 1},
        "optimizer": {"type": "adamw", "lr": 1.0e-4},
    }
    for name, values in sections.items():
        config[name] = {**config.get(name, {}), **values}
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_grpo_runs_logs_and_checkpoints(tmp_path, shapes):
    algorithm = {"kl_coef": 0.05, "epochs": 2, "mini_batch_prompts": 1, "rollout_correction": "tis"}
    cfg = load_config(tiny_config(tmp_path, shapes, algorithm=algorithm))
    final = grpo.train(cfg)
    run = tmp_path / "run"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and final == rows[-1]
    for key in (
        "reward/mean",
        "accuracy/mean",
        "format/mean",
        "loss/policy",
        "loss/kl",
        "loss/clip_fraction",
        "actor/entropy",
        "optim/grad_norm",
        "optim/lr",
        "time/rollout",
        "time/reward",
        "time/update",
        "response/length_mean",
        "response/clipped_fraction",
        "skipped/groups_filtered",
        "throughput/rollout_tokens_per_s",
        "data/cache_hits",
        "data/index_misses",
        "time/weight_sync",
        "rollout/kl_k3",
    ):
        assert key in rows[-1], key
    # the hf engine samples with the trainer's own weights: no mismatch, nothing capped
    assert all(r["rollout/logp_abs_diff"] < 1e-4 and r["rollout/tis_capped_fraction"] == 0 for r in rows)
    assert any(k.startswith("accuracy/source/") for k in rows[-1])
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-00000002", "step-00000003"]
    checkpoint = run / "checkpoints" / "step-00000003"
    assert (checkpoint / "model" / "config.json").is_file() and (checkpoint / "state.json").is_file()
    assert list((run / "tensorboard").glob("events.*"))
    assert load_config(run / "config.yaml") == cfg


def test_the_update_moves_probability_toward_positive_advantages(tmp_path, tiny_checkpoint, family_prompts):
    from omni_rl.models import load
    from omni_rl.models.forward import group_forward
    from omni_rl.models.inputs import collate_prompts
    from omni_rl.rollout.hf import HFRolloutEngine, SamplingParams

    model, processor = load(tiny_checkpoint("qwen2_5_vl"))
    encoded = [dict(family_prompts("qwen2_5_vl", processor, only=i)) for i in range(2)]
    inputs = collate_prompts(encoded, processor.tokenizer.pad_token_id)
    torch.manual_seed(0)
    rollouts = HFRolloutEngine(model, processor).generate(inputs, 4, SamplingParams(max_new_tokens=6))
    advantages = torch.tensor([1.0, -1, -1, 1, -1, 1, 1, -1])
    cfg = load_config(
        None, ["data.train=x", "rollout.n=4", "algorithm.epochs=1", "trainer.max_grad_norm=0"], recipe="grpo"
    )
    from omni_rl.engine.config import SGDConfig
    from omni_rl.engine.engine import TrainingEngine

    mask = rollouts.completion_mask
    with torch.no_grad():
        before = (group_forward(model, inputs, rollouts.completion_ids, mask, 4).logp * mask).sum(-1)
    model.train()
    engine = TrainingEngine(model, SGDConfig(lr=0.5, momentum=0.0), torch.device("cpu"), total_steps=1, max_grad_norm=0)
    batch = grpo.Batch(samples=[None, None], encoded=encoded, seeds=[0, 1], numbers=[0, 1])
    pad = processor.tokenizer.pad_token_id
    stats = grpo._update(engine, None, batch, rollouts, mask, advantages, pad, cfg, logged=True)
    with torch.no_grad():
        after = (group_forward(model, inputs, rollouts.completion_ids, mask, 4).logp * mask).sum(-1)
    change = after - before
    assert stats["optim/grad_norm"] > 0
    assert (change[advantages > 0].mean() > 0) and (change[advantages < 0].mean() < 0)


def test_nan_losses_skip_optimizer_steps_and_three_in_a_row_stop_the_run(tmp_path, shapes, monkeypatch):
    def nan_loss(*args, **kwargs):
        loss, stats = real(*args, **kwargs)
        return loss * float("nan"), stats

    real = grpo.clipped_policy_loss
    monkeypatch.setattr(grpo, "clipped_policy_loss", nan_loss)
    cfg = load_config(
        tiny_config(
            tmp_path,
            shapes,
            algorithm={"epochs": 1, "mini_batch_prompts": 0},
            trainer={"steps": 5, "save_every": 0},
        )
    )
    with pytest.raises(OmniRLError, match="3 optimizer steps in a row had non-finite gradients"):
        grpo.train(cfg)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    # one optimizer step per training step: steps 1 and 2 were skipped and logged, step 3 stopped the run
    assert [r["optim/skipped_nonfinite"] for r in rows] == [1, 2]


def test_prompts_longer_than_the_limit_are_skipped_and_counted(tmp_path, shapes):
    cfg = load_config(tiny_config(tmp_path, shapes, rollout={"max_prompt_length": 1}, trainer={"steps": 1}))
    with pytest.raises(
        OmniRLError,
        match=r"nearly every row drawn is skipped: \d+ prompts over the rollout engine's limit of 1 tokens "
        r"\(rollout\.max_prompt_length=1\)$",
    ):
        grpo.train(cfg)


def metrics_without_timing(path: Path) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    # wall-clock metrics differ between any two runs
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "throughput/"))} for r in rows]


@pytest.mark.slow
def test_sigkill_and_resume_gives_the_uninterrupted_metrics(tmp_path, shapes):
    steps = 5
    straight = tiny_config(tmp_path / "a", shapes, trainer={"steps": steps, "save_every": 1})
    subprocess.run([OMNI_RL, "train", str(straight)], check=True, capture_output=True, timeout=600)

    resumed = tiny_config(tmp_path / "b", shapes, trainer={"steps": steps, "save_every": 1})
    metrics = tmp_path / "b" / "run" / "metrics.jsonl"
    process = subprocess.Popen(
        [OMNI_RL, "train", str(resumed)], start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and process.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 2:
            break
        time.sleep(0.02)
    assert process.poll() is None, "the run ended before it could be killed"
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    done = len(metrics.read_text().splitlines())
    assert 2 <= done < steps
    subprocess.run([OMNI_RL, "train", str(resumed), "--resume", "auto"], check=True, capture_output=True, timeout=600)
    assert metrics_without_timing(metrics) == metrics_without_timing(tmp_path / "a" / "run" / "metrics.jsonl")


def test_the_update_reads_the_rollouts_prefill_and_trains_as_without_it(tmp_path, shapes, caplog):
    """``rollout.reuse_prefill``: every step's update reads the prompts' prefill the
    rollout made, and the run logs every value it logs without (3 steps: the later
    rollouts sample with the weights the reused updates made); where the update is not
    one forward of the batch (two epochs), the log says why and no step reads it."""
    one_forward = {"algorithm": {"epochs": 1, "mini_batch_prompts": 0}, "trainer": {"steps": 3, "save_every": 0}}
    runs = {}
    for reuse in (True, False):
        path = tiny_config(tmp_path / str(reuse), shapes, rollout={"reuse_prefill": reuse}, **one_forward)
        grpo.train(load_config(path))
        runs[reuse] = metrics_without_timing(tmp_path / str(reuse) / "run" / "metrics.jsonl")
    assert [r.pop("update/prefill_reused") for r in runs[True]] == [1.0, 1.0, 1.0]
    assert [r.pop("update/prefill_reused") for r in runs[False]] == [0.0, 0.0, 0.0]
    assert runs[True] == runs[False]

    caplog.set_level(logging.INFO, logger="omni_rl")
    grpo.train(load_config(tiny_config(tmp_path / "epochs", shapes, trainer={"steps": 1, "save_every": 0})))
    assert "rollout.reuse_prefill: the update runs the prompts again: algorithm.epochs > 1" in caplog.text
    assert metrics_without_timing(tmp_path / "epochs" / "run" / "metrics.jsonl")[0]["update/prefill_reused"] == 0.0


@pytest.mark.parametrize(
    ("sections", "strategy", "reason"),
    [
        ({}, "single", None),
        ({"trainer": {"micro_batch_size": 1}}, "single", "the update splits the batch"),
        ({"trainer": {"max_tokens_per_microbatch": 4096}}, "single", "the update splits the batch"),
        ({"algorithm": {"mini_batch_prompts": 1}}, "single", "the update splits the batch"),
        ({"algorithm": {"dynamic_sampling": True}}, "single", "algorithm.dynamic_sampling"),
        ({"algorithm": {"rollout_correction": "mask"}}, "single", "rollout_correction mask"),
        ({"model": {"gradient_checkpointing": True}}, "single", "model.gradient_checkpointing"),
        ({}, "ddp", "trainer.strategy ddp"),
        ({}, "dropout", "drops activations in training (1 (p=0.1))"),
    ],
)
def test_what_keeps_the_update_from_reading_the_rollouts_prefill(tmp_path, sections, strategy, reason):
    one_forward = {"epochs": 1, "mini_batch_prompts": 0, **sections.pop("algorithm", {})}
    cfg = load_config(tiny_config(tmp_path, tmp_path / "train.jsonl", algorithm=one_forward, **sections))
    module = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.1 if strategy == "dropout" else 0.0))
    engine = SimpleNamespace(strategy="ddp" if strategy == "ddp" else "single", module=module)
    blocker = grpo._prefill_blocker(cfg, engine)
    assert blocker == reason if reason is None else reason in blocker


def test_dynamic_sampling_refills_the_batch_with_informative_groups(tmp_path, shapes, monkeypatch):
    from omni_rl.rewards import RewardResult

    calls = []

    def fake_score(samples, texts, n, cfg):
        # first round: prompt 0 informative (rewards differ), prompt 1 all equal;
        # later rounds: every group informative
        calls.append(len(samples))
        results = []
        for p in range(len(samples)):
            flat = len(calls) == 1 and p == 1
            results += [RewardResult(0.0 if flat else float(g % 2), 0.0, 0.0) for g in range(n)]
        return results

    monkeypatch.setattr(grpo, "_score", fake_score)
    cfg = load_config(
        tiny_config(
            tmp_path,
            shapes,
            algorithm={"dynamic_sampling": True, "max_resample_rounds": 2},
            trainer={"steps": 1, "save_every": 0},
        )
    )
    final = grpo.train(cfg)
    assert calls == [2, 1]  # one prompt dropped, one more drawn
    assert final["skipped/groups_filtered"] == 1 and final["skipped/sampling_rounds"] == 2
    assert (
        final["count/multiple_choice"] + final.get("count/counting", 0) + final.get("count/temporal_grounding", 0) == 8
    )  # 2 prompts x 4 completions trained on


def test_a_short_or_empty_batch_still_moves_the_schedule_its_whole_step(tmp_path, shapes, monkeypatch):
    """The learning-rate schedule counts epochs x mini-batches per step. When dynamic
    sampling leaves a batch short (one prompt of two: one mini-batch of two) or empty
    (no update), the steps not taken still move it, so a cosine schedule ends at
    min_lr_ratio on the run's last step as its docs say."""
    from omni_rl.rewards import RewardResult

    firsts = []

    def one_informative_prompt(samples, texts, n, cfg):
        # a step's first round (2 prompts): prompt 0 informative but at the third step;
        # every other group scores alike
        if len(samples) == 2:
            firsts.append(1)
        informative = len(samples) == 2 and len(firsts) < 3
        return [
            RewardResult(float(informative and p == 0 and g % 2), 0.0, 0.0)
            for p in range(len(samples))
            for g in range(n)
        ]

    monkeypatch.setattr(grpo, "_score", one_informative_prompt)
    algorithm = {"dynamic_sampling": True, "max_resample_rounds": 1, "epochs": 2, "mini_batch_prompts": 1}
    trainer = {"steps": 3, "save_every": 0, "schedule": "cosine", "min_lr_ratio": 0.1}
    cfg = load_config(tiny_config(tmp_path, shapes, algorithm=algorithm, trainer=trainer))
    final = grpo.train(cfg)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["optim/schedule_step"] for r in rows] == [4, 8, 12]  # 2 epochs x 2 mini-batches a step
    assert final["skipped_update"] == 1 and [r["update/micro_batches"] for r in rows[:2]] == [1, 1]


def test_ucb_hears_from_the_groups_dynamic_sampling_drops(tmp_path, shapes, monkeypatch):
    """Two sources under the UCB sampler with dynamic sampling: every group of source
    'flat' scores alike (it teaches nothing) and is dropped, every group of 'teaching'
    differs. Each drawn 'flat' group still reaches the sampler, as |A| = 0 per
    completion, so its window holds zeros rather than staying empty (or keeping an old
    mean) while it keeps being drawn."""
    from omni_rl.data.sampler import SourceUCBSampler
    from omni_rl.rewards import RewardResult

    rows = [json.loads(line) for line in shapes.read_text().splitlines()]
    data = shapes.with_name("two_sources.jsonl")  # beside the clips
    data.write_text(
        "".join(json.dumps({**r, "data_source": ("flat", "teaching")[i % 2]}) + "\n" for i, r in enumerate(rows))
    )

    def flat_or_teaching(samples, texts, n, cfg):
        return [RewardResult(float(s.data_source == "teaching" and g % 2), 0.0, 0.0) for s in samples for g in range(n)]

    heard, samplers = [], []
    observe, init = SourceUCBSampler.observe, SourceUCBSampler.__init__

    def spy_observe(self, sources, magnitudes):
        heard.extend(zip(sources, magnitudes, strict=True))
        return observe(self, sources, magnitudes)

    def spy_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        samplers.append(self)

    monkeypatch.setattr(grpo, "_score", flat_or_teaching)
    monkeypatch.setattr(SourceUCBSampler, "observe", spy_observe)
    monkeypatch.setattr(SourceUCBSampler, "__init__", spy_init)
    algorithm = {"dynamic_sampling": True, "max_resample_rounds": 1, "epochs": 1, "mini_batch_prompts": 0}
    sections = {"algorithm": algorithm, "trainer": {"steps": 3, "save_every": 0}}
    grpo.train(load_config(tiny_config(tmp_path, data, data={"sampler": {"type": "ucb", "window": 64}}, **sections)))
    (sampler,) = samplers
    drawn = dict(zip(sampler.names, sampler.counts, strict=True))
    flat = [magnitude for source, magnitude in heard if source == "flat"]
    assert drawn["flat"] > 0 and len(flat) == 4 * drawn["flat"] and set(flat) == {0.0}
    teaching = [magnitude for source, magnitude in heard if source == "teaching"]
    assert teaching and all(m > 0 for m in teaching)


def test_shipped_tiny_config_runs_a_few_steps(tmp_path, shapes):
    config = Path(__file__).parent.parent / "configs" / "grpo_tiny_shapes.yaml"
    cfg = load_config(
        config,
        [
            f"data.train={shapes}",
            f"run.output_dir={tmp_path}",
            "trainer.steps=2",
            "data.prompts_per_step=2",
            "rollout.n=2",
        ],
    )
    final = grpo.train(cfg)
    assert final["step"] == 2 and (tmp_path / "checkpoints" / "step-00000002").is_dir()


def test_kl_in_the_reward_and_the_dual_clip_are_logged(tmp_path, shapes, monkeypatch):
    """With the KL in the reward there is no KL loss term, and the per-token KL to the
    reference is logged as actor/kl all the same (0 at the first step, whose policy is
    the reference; above it once the policy has moved); the dual clip logs its share."""
    from omni_rl.rewards import RewardResult

    def alternating(samples, texts, n, cfg):  # every group informative: the policy moves
        return [RewardResult(float(g % 2), 0.0, 0.0) for _ in samples for g in range(n)]

    monkeypatch.setattr(grpo, "_score", alternating)
    algorithm = {"kl_coef": 0.1, "kl_in_reward": True, "dual_clip": 3.0, "epochs": 2, "mini_batch_prompts": 1}
    grpo.train(load_config(tiny_config(tmp_path, shapes, algorithm=algorithm, trainer={"steps": 2, "save_every": 0})))
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["actor/kl"] == 0.0 and rows[1]["actor/kl"] > 0
    assert all("loss/kl" not in r and 0 <= r["loss/dual_clip_fraction"] <= 1 for r in rows)


@pytest.mark.parametrize("kl_in_reward", [False, True])
def test_under_bf16_mixed_the_reference_computes_what_the_policy_does_at_the_start(tmp_path, shapes, kl_in_reward):
    """One process, bf16-mixed (CPU autocast): the policy's masters are fp32, and a
    reference stored whole in bf16 ran its embeddings, norms and residual stream in
    bf16, so the KL to it was above 0 before any update (k3 1.3e-6, |logp - ref| up to
    0.004 on a tiny model; more over 28 layers and long answers). Stored as the policy
    is, its matmul weights in bf16 (what autocast rounds them to), it is exact."""
    algorithm = {"kl_coef": 0.05, "kl_in_reward": kl_in_reward, "epochs": 1}
    trainer = {"steps": 1, "save_every": 0, "precision": "bf16-mixed"}
    final = grpo.train(load_config(tiny_config(tmp_path, shapes, algorithm=algorithm, trainer=trainer)))
    assert final["actor/kl"] == 0.0


def test_lora_with_kl_trains_adapters_and_resumes(tmp_path, shapes):
    config = tiny_config(
        tmp_path,
        shapes,
        model={"lora": {"rank": 4, "alpha": 8}},
        algorithm={"kl_coef": 0.1, "epochs": 2, "mini_batch_prompts": 1},
        trainer={"steps": 2, "save_every": 1},
    )
    final = grpo.train(load_config(config))
    assert "loss/kl" in final
    adapter = tmp_path / "run" / "checkpoints" / "step-00000002" / "model"
    assert (adapter / "adapter_config.json").is_file()
    resumed = grpo.train(load_config(config, ["trainer.steps=3"]), resume="auto")
    assert resumed["step"] == 3


def test_gradient_checkpointing_and_frozen_vision_tower(tmp_path, shapes):
    config = tiny_config(
        tmp_path,
        shapes,
        model={"gradient_checkpointing": True, "freeze_vision_tower": True},
        trainer={"steps": 1, "save_every": 0},
    )
    final = grpo.train(load_config(config))
    assert final["step"] == 1 and "loss/policy" in final


def dense_grouped_attention(module, query, key, value, attention_mask, store, scaling):
    """The plain attention the block attention replaces: each completion row over its
    prompt's real keys concatenated with its own, heads expanded, a dense mask (causal
    over its own keys; a decoding step's cache mask as transformers built it)."""
    from transformers.integrations.sdpa_attention import repeat_kv

    prefix_key, prefix_value = store.layers[module.layer_idx]
    rows, heads, queries, dim = query.shape
    kv_heads, own = key.shape[1], key.shape[2]
    group = rows // prefix_key.shape[0]
    outs = []
    for r in range(rows):
        b = r // group
        start = store.starts[b]
        keys = repeat_kv(torch.cat([prefix_key[b : b + 1, :, start:], key[r : r + 1]], 2), heads // kv_heads)
        values = repeat_kv(torch.cat([prefix_value[b : b + 1, :, start:], value[r : r + 1]], 2), heads // kv_heads)
        if queries == 1 and attention_mask is not None:
            row = attention_mask[r, 0, -1]
            visible = (row if row.dtype == torch.bool else row == 0)[None, :]
        else:
            visible = torch.arange(own)[None, :] <= torch.arange(queries)[:, None] + own - queries
        prompt = torch.ones(queries, prefix_key.shape[2] - start, dtype=torch.bool)
        mask = torch.cat([prompt, visible.expand(queries, own)], dim=1)
        scale = dim**-0.5 if scaling is None else scaling
        outs.append(F.scaled_dot_product_attention(query[r : r + 1], keys, values, attn_mask=mask, scale=scale))
    return torch.cat(outs).transpose(1, 2)


def test_block_attention_trains_as_the_dense_attention_does(tmp_path, shapes, monkeypatch):
    """Three GRPO steps (two epochs of two mini-batches each) with the block attention
    and with the dense one it replaces, from the same start: the same completions and
    rewards, losses, entropies and gradient norms within 1e-5, and final weights within
    1e-5. What a change to the attention must pass before any long run."""
    from omni_rl.models import load, shared_prefix

    def run(name: str) -> tuple[list[dict], dict]:
        config = tiny_config(tmp_path / name, shapes, trainer={"steps": 3, "save_every": 0})
        grpo.train(load_config(config))
        out = tmp_path / name / "run"
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        return rows, dict(load(out / "model")[0].named_parameters())

    block_rows, block_weights = run("block")
    monkeypatch.setattr(shared_prefix, "grouped_attention", dense_grouped_attention)
    dense_rows, dense_weights = run("dense")
    for block, dense in zip(block_rows, dense_rows, strict=True):
        for key in ("reward/mean", "response/length_mean", "response/clipped_fraction"):
            assert block[key] == dense[key], (block["step"], key)
        for key in ("loss/policy", "actor/entropy", "optim/grad_norm"):
            assert block[key] == pytest.approx(dense[key], rel=1e-5, abs=1e-7), (block["step"], key)
        assert block["rollout/logp_abs_diff"] < 1e-5 and dense["rollout/logp_abs_diff"] < 1e-5
    for name, weight in block_weights.items():
        torch.testing.assert_close(weight, dense_weights[name], atol=1e-5, rtol=1e-5, msg=name)


def test_image_and_video_rows_train_together_under_their_own_budgets(tmp_path):
    data = write_video_qa(tmp_path / "mixed", videos=2, images=4, seed=2, seconds=2.0)
    kinds = {json.loads(line)["data_source"] for line in data.read_text().splitlines()}
    assert kinds == {"synthetic_shapes", "synthetic_images"}
    cfg = load_config(
        tiny_config(
            tmp_path,
            data,
            rollout={"n": 2, "max_new_tokens": 8},
            media={"image_max_pixels": 4 * 784, "video_max_pixels": 8 * 784},
            trainer={"steps": 3, "save_every": 0},
        )
    )
    grpo.train(cfg)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    seen = {key.split("/")[-1] for row in rows for key in row if key.startswith("reward/source/")}
    assert seen == {"synthetic_shapes", "synthetic_images"}, seen
    from omni_rl.data.dataset import MediaDataset
    from omni_rl.preprocess.pipeline import Budgets

    dataset = MediaDataset(data, Budgets.from_config(cfg.media), cache_mode="no_cache")
    image = next(dataset[i] for i in range(len(dataset)) if dataset[i].images)
    video = next(dataset[i] for i in range(len(dataset)) if dataset[i].videos)
    assert image.images[0].shape[0] * image.images[0].shape[1] <= 4 * 784
    assert video.videos[0].frames.shape[2] * video.videos[0].frames.shape[3] <= 8 * 784


def test_pack_by_tokens_fills_each_micro_batch_under_its_budget():
    from omni_rl.recipes.common import pack_by_tokens

    # (prompt tokens, completion tokens) per item; a batch costs count * (max + max)
    lengths = [(100, 40), (20, 10), (100, 80), (30, 10), (500, 10)]
    batches = pack_by_tokens(lengths, budget=400)
    assert sorted(i for b in batches for i in b) == [0, 1, 2, 3, 4]
    assert [4] in batches  # over the budget alone: a batch of its own
    for batch in batches:
        if len(batch) > 1:
            cost = len(batch) * (max(lengths[i][0] for i in batch) + max(lengths[i][1] for i in batch))
            assert cost <= 400
    assert len(batches) == 3  # {2, 0}, {1, 3}, {4}: longest first, first fit
    assert all(len(b) <= 1 for b in pack_by_tokens(lengths, budget=10_000, max_items=1))


def _update_in_one_and_two_forwards(tiny_checkpoint, family_prompts, overrides, lr, short_second_group=False):
    """grpo._update of two prompts' groups of 4 rollouts (6 new tokens) from the same
    start, in one forward and then one group per forward (trainer.max_tokens_per_
    microbatch): each run's (stats, parameters after). ``short_second_group``: the
    loss mask keeps 3 tokens of the second group's completions and all 6 of the first's."""
    from omni_rl.engine.config import SGDConfig
    from omni_rl.engine.engine import TrainingEngine
    from omni_rl.models import load
    from omni_rl.models.inputs import collate_prompts
    from omni_rl.rollout.hf import HFRolloutEngine, SamplingParams

    model, processor = load(tiny_checkpoint("qwen2_5_vl"))
    pad = processor.tokenizer.pad_token_id
    encoded = [dict(family_prompts("qwen2_5_vl", processor, only=i)) for i in range(2)]
    rollouts = HFRolloutEngine(model, processor).generate(
        collate_prompts(encoded, pad), 4, SamplingParams(max_new_tokens=6), seeds=[3, 4]
    )
    mask = rollouts.completion_mask
    if short_second_group:
        mask = torch.ones_like(mask)
        mask[4:, 3:] = 0
    advantages = torch.tensor([1.0, -1, -1, 1, -1, 1, 1, -1])
    batch = grpo.Batch(samples=[None, None], encoded=encoded, seeds=[3, 4], numbers=[0, 1])
    prompt = max(e["input_ids"].shape[-1] for e in encoded)
    results = []
    for budget in (0, prompt + 4 * 6):  # the second fits one group per forward
        model, _ = load(tiny_checkpoint("qwen2_5_vl"))
        model.train()
        settings = ["data.train=x", "rollout.n=4", "rollout.max_new_tokens=6", "trainer.max_grad_norm=0", *overrides]
        cfg = load_config(None, [*settings, f"trainer.max_tokens_per_microbatch={budget}"], recipe="grpo")
        steps = cfg.algorithm.epochs
        engine = TrainingEngine(
            model, SGDConfig(lr=lr, momentum=0.0), torch.device("cpu"), total_steps=steps, max_grad_norm=0
        )
        stats = grpo._update(engine, None, batch, rollouts, mask, advantages, pad, cfg, True)
        assert stats["update/micro_batches"] == (2 if budget else 1) and stats["update/prompt_backward_apart"] == 1.0
        results.append((stats, {n: p.detach().clone() for n, p in model.named_parameters()}))
    return results


def test_token_budget_micro_batches_give_the_update_of_one_batch(tiny_checkpoint, family_prompts):
    """Packed under trainer.max_tokens_per_microbatch, the two groups run as two
    accumulated forwards and give the one-forward update within 1e-5."""
    from omni_rl.models import load

    (_, one), (_, two) = _update_in_one_and_two_forwards(tiny_checkpoint, family_prompts, ["algorithm.epochs=1"], 0.5)
    moved = sum(float((one[n] - p).abs().sum()) for n, p in load(tiny_checkpoint("qwen2_5_vl"))[0].named_parameters())
    assert moved > 0
    for name, value in one.items():
        torch.testing.assert_close(two[name], value, atol=1e-5, rtol=1e-5)


def test_update_diagnostics_pool_every_token_whatever_the_micro_batches(tiny_checkpoint, family_prompts):
    """loss/clip_fraction, ratio_mean and ratio_max are over the update's valid tokens:
    split into micro-batches of 24 and 12 tokens, the same update logs what one
    forward logs (the micro-batches' own means, averaged alike, weighed 12 tokens as
    24; the maxima were averaged)."""
    (one, _), (two, _) = _update_in_one_and_two_forwards(
        tiny_checkpoint, family_prompts, ["algorithm.epochs=2"], 2.0, short_second_group=True
    )
    assert one["loss/ratio_max"] > 1.01 and one["loss/clip_fraction"] > 0  # the second epoch moved
    for key in ("loss/clip_fraction", "loss/ratio_mean", "loss/ratio_max"):
        assert two[key] == pytest.approx(one[key], abs=1e-5), key


def test_eval_sets_run_every_n_steps_and_keep_the_best(tmp_path, shapes):
    """data.eval with a rows file and a benchmark preset: eval rows at steps 2 and 4
    (eval_every 2), written even where log_every would skip them, results per step,
    the best model kept, and the scores in the plots."""
    import bench_fixtures

    from omni_rl.plots import plot_metrics

    bench_fixtures.mvbench(tmp_path / "mvbench")
    data = {
        "eval": [
            {"data": str(shapes), "name": "held", "limit": 3, "max_new_tokens": 6, "batch_prompts": 2},
            {"benchmark": "mvbench", "data": str(tmp_path / "mvbench"), "protocol": {"nframes": 4}},
        ]
    }
    trainer = {"steps": 4, "save_every": 0, "log_every": 3, "eval_every": 2, "best_metric": "eval/held/accuracy"}
    cfg = load_config(tiny_config(tmp_path, shapes, data=data, trainer=trainer))
    grpo.train(cfg)
    run = tmp_path / "run"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [2, 3, 4]
    evaluated = {r["step"]: r for r in rows if "eval/held/accuracy" in r}
    assert sorted(evaluated) == [2, 4]
    for row in evaluated.values():
        assert row["eval/held/rows"] == 3
        assert row["eval/mvbench/rows"] == 4 and row["eval/mvbench/skipped"] == 2
        assert 0.0 <= row["eval/mvbench/accuracy"] <= 100.0 and row["time/eval"] > 0
    for step in (2, 4):
        results = json.loads((run / "eval" / "mvbench" / f"step-{step}" / "results.json").read_text())
        assert results["results"]["mvbench"]["accuracy,none"] == evaluated[step]["eval/mvbench/accuracy"]
        assert (run / "eval" / "held" / f"step-{step}" / "results.json").is_file()
    best = json.loads((run / "best" / "best.json").read_text())
    scores = [evaluated[s]["eval/held/accuracy"] for s in (2, 4)]
    assert best["value"] == max(scores) and best["step"] == (2 if scores[0] >= scores[1] else 4)
    assert (run / "best" / "model" / "config.json").is_file()
    plots = [p.name for p in plot_metrics(run)]
    assert set(plots) >= {"eval_held_accuracy.png", "eval_mvbench_accuracy.png", "loss_policy.png"}
    assert len(plots) == len(set(plots))  # loss/policy was drawn twice


class _LogProbs(torch.nn.Module):
    """A policy whose parameters are its completions' log-probs [N, L]: the update's
    gradient and step can be worked out by hand."""

    def __init__(self, logp: torch.Tensor):
        super().__init__()
        self.logp = torch.nn.Parameter(logp.clone())


def _fake_forwards(monkeypatch, ref: torch.Tensor, entropy: torch.Tensor):
    from omni_rl.models.forward import GroupOutput

    def logprobs(model, batch, chunk, ids, mask, pad_id, cfg, entropy_mode="off", kept=None, apart=False, prefix=None):
        rows = grpo._rows(chunk, cfg.rollout.n)
        width = grpo._width(mask, rows)
        measured = None if entropy_mode == "off" else entropy[rows, :width]
        return GroupOutput(model.logp[rows, :width], measured)

    def reference(engine, reference, batch, chunk, ids, mask, pad_id, cfg):
        rows = grpo._rows(chunk, cfg.rollout.n)
        return ref[rows, : grpo._width(mask, rows)]

    monkeypatch.setattr(grpo, "_logprobs", logprobs)
    monkeypatch.setattr(grpo, "_reference_logp", reference)


def test_gspo_update_divides_by_sequences_and_equals_the_hand_computation(monkeypatch):
    """GSPO through the recipe's update: 2 prompts x 2 completions of 2, 1, 3 and 2
    tokens, the default aggregation (token-mean, 8 tokens) left unset. Every term is
    divided by the 4 sequences, the KL and entropy as each sequence's token mean."""
    from types import SimpleNamespace

    from omni_rl.engine.config import SGDConfig
    from omni_rl.engine.engine import TrainingEngine

    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 0], [1, 1, 0, 0]])
    # k1 = logp - ref per token: [0.1, 0.3], [0.4], [0, 0.3, 0.6], [0.2, 0.2]
    ref = -torch.tensor([[0.1, 0.3, 0, 0], [0.4, 0, 0, 0], [0, 0.3, 0.6, 0], [0.2, 0.2, 0, 0]])
    entropy = torch.tensor([[1.0, 3, 0, 0], [0.5, 0, 0, 0], [1, 1, 4, 0], [0, 2, 0, 0]])
    advantages = torch.tensor([1.0, -0.5, 2.0, 0.5])
    _fake_forwards(monkeypatch, ref, entropy)
    model = _LogProbs(torch.zeros(4, 4))
    engine = TrainingEngine(model, SGDConfig(lr=1.0, momentum=0.0), torch.device("cpu"), total_steps=1, max_grad_norm=0)
    cfg = load_config(
        None,
        [
            "data.train=x",
            "rollout.n=2",
            "rollout.max_new_tokens=4",
            "algorithm.loss=gspo",
            "algorithm.kl_coef=0.1",
            "algorithm.kl_estimator=k1",
            "algorithm.epochs=1",
        ],
        recipe="grpo",
    )
    batch = grpo.Batch(
        samples=[None, None], encoded=[{"input_ids": torch.zeros(1, 3)}] * 2, seeds=[0, 1], numbers=[0, 1]
    )
    rollouts = SimpleNamespace(
        completion_ids=torch.zeros(4, 4, dtype=torch.long),
        logprobs=torch.zeros(4, 4),
        replaced=torch.zeros(4, dtype=bool),
        prefill=None,
    )
    stats = grpo._update(engine, None, batch, rollouts, mask, advantages, 0, cfg, logged=True)
    # one epoch: s = 1 for every sequence, nothing clipped; policy -(1 - 0.5 + 2 + 0.5) / 4
    # (the token count would give -3 / 8 = -0.375)
    assert stats["loss/policy"] == pytest.approx(-0.75, abs=1e-6)
    assert stats["loss/clip_fraction"] == 0
    # KL: sequence means 0.2, 0.4, 0.3, 0.2 -> 1.1 / 4 (token-mean: 2.1 / 8 = 0.2625)
    assert stats["loss/kl"] == pytest.approx(0.275, abs=1e-6)
    # entropy: sequence means 2, 0.5, 2, 1 -> 5.5 / 4 (token-mean: 12.5 / 8 = 1.5625)
    assert stats["loss/entropy"] == pytest.approx(1.375, abs=1e-6)
    # the actor's entropy and KL are per-token means whatever the loss's aggregation
    assert stats["actor/entropy"] == pytest.approx(1.5625, abs=1e-6)
    assert stats["actor/kl"] == pytest.approx(0.2625, abs=1e-6)
    assert stats["loss/approx_kl"] == 0 and "loss/dual_clip_fraction" not in stats
    # d/dlogp_it = (-A_i s_i + kl_coef) / (4 |y_i|) at s_i = 1; SGD at lr 1 steps by minus that:
    # (1 - 0.1) / 8 = 0.1125, (-0.5 - 0.1) / 4 = -0.15, (2 - 0.1) / 12 = 0.158333, (0.5 - 0.1) / 8 = 0.05
    step = torch.tensor([0.1125, -0.15, 0.158333, 0.05])[:, None] * mask
    torch.testing.assert_close(model.logp.detach(), step, atol=1e-6, rtol=0)
    # sqrt(2 * 0.1125^2 + 0.15^2 + 3 * 0.158333^2 + 2 * 0.05^2)
    assert stats["optim/grad_norm"] == pytest.approx(0.357800, abs=1e-6)


def _out(logp: torch.Tensor, entropy: torch.Tensor | None = None):
    from omni_rl.models.forward import GroupOutput

    return GroupOutput(logp, entropy)


def test_gspo_clips_at_its_own_defaults_unless_set():
    # s = 1.001 with A = +1: GSPO's 1 + 4e-4 clips it to -1.0004; s = 0.999 with A = -1: 1 - 3e-4 -> 0.9997
    cfg = load_config(None, ["data.train=x", "algorithm.loss=gspo"], recipe="grpo")
    up, down, mask = torch.full((1, 2), math.log(1.001)), torch.full((1, 2), math.log(0.999)), torch.ones(1, 2)
    loss, _, stats, _ = grpo._policy_loss(_out(up), torch.zeros(1, 2), None, torch.tensor([1.0]), mask, 1.0, cfg)
    assert loss.item() == pytest.approx(-1.0004, abs=1e-7) and stats.clip_fraction == 1.0
    loss, *_ = grpo._policy_loss(_out(down), torch.zeros(1, 2), None, torch.tensor([-1.0]), mask, 1.0, cfg)
    assert loss.item() == pytest.approx(0.9997, abs=1e-7)
    assert cfg.algorithm.clip_range == (3e-4, 4e-4)
    # set explicitly, PPO's 0.28 leaves 1.001 alone
    cfg = load_config(None, ["data.train=x", "algorithm.loss=gspo", "algorithm.eps_high=0.28"], recipe="grpo")
    assert cfg.algorithm.clip_range == (3e-4, 0.28)
    loss, _, stats, _ = grpo._policy_loss(_out(up), torch.zeros(1, 2), None, torch.tensor([1.0]), mask, 1.0, cfg)
    assert loss.item() == pytest.approx(-1.001, abs=1e-7) and stats.clip_fraction == 0.0
    # the clipped loss keeps PPO's clips with clip-higher
    assert load_config(None, ["data.train=x"], recipe="grpo").algorithm.clip_range == (0.2, 0.28)


@pytest.mark.parametrize("setting", ["aggregation=token-mean", "aggregation=seq-mean-token-sum-norm", "dual_clip=3"])
def test_settings_gspo_ignores_are_refused_at_load(setting):
    from omni_rl.errors import ConfigError

    field = setting.split("=")[0]
    with pytest.raises(ConfigError, match=rf"algorithm\.{field}: does nothing under loss: gspo"):
        load_config(None, ["data.train=x", "algorithm.loss=gspo", f"algorithm.{setting}"], recipe="grpo")
    load_config(None, ["data.train=x", f"algorithm.{setting}"], recipe="grpo")  # the clipped loss uses it


def test_sum_norm_kl_and_entropy_divide_by_the_fixed_length():
    """seq-mean-token-sum-norm: each sequence's sums over max_new_tokens = 8, whatever
    the micro-batch's trimmed width (3 here), for the KL and entropy as for the policy."""
    overrides = ["data.train=x", "rollout.max_new_tokens=8", "algorithm.aggregation=seq-mean-token-sum-norm"]
    cfg = load_config(None, [*overrides, "algorithm.kl_coef=0.1", "algorithm.kl_estimator=k1"], recipe="grpo")
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    ref = -torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.4, 5.0]])  # k1 = -ref; the padded 5.0 counts nowhere
    entropy = torch.tensor([[1.0, 2, 3], [0.5, 0.5, 7]])
    loss, sums, _, means = grpo._policy_loss(
        _out(torch.zeros(2, 3), entropy), torch.zeros(2, 3), ref, torch.tensor([1.0, -1.0]), mask, 2.0, cfg
    )
    # policy: -A per token, sums -3 and +2 -> (-3/8 + 2/8) / 2
    assert sums["loss/policy"] == pytest.approx(-0.0625, abs=1e-6)
    # KL: sums 0.6 and 0.8 -> (0.6/8 + 0.8/8) / 2 (the width would give 0.233333)
    assert sums["loss/kl"] == pytest.approx(0.0875, abs=1e-6)
    # entropy: sums 6 and 1 -> (6/8 + 1/8) / 2 (the width would give 1.166667)
    assert sums["loss/entropy"] == pytest.approx(0.4375, abs=1e-6)
    # what the actor's entropy and KL are, per token: 7 / 5 and 1.4 / 5, not the terms' 0.4375 and 0.0875
    assert means == pytest.approx({"actor/entropy": 1.4, "actor/kl": 0.28}, abs=1e-6)
    # entropy_coef is 0: the loss is the policy term plus 0.1 x the KL
    assert loss.item() == pytest.approx(-0.0625 + 0.1 * 0.0875, abs=1e-6)


def test_an_offline_answer_joins_its_group_and_the_loss_adds_up(tmp_path, shapes, monkeypatch):
    """algorithm.offline_responses=always: each group's last completion is its row's
    offline answer, scored 1 against the sampled ones' 0, so it carries the group's
    largest advantage. The first pass's loss is the hand computation
    -sum_i A_i L_i / sum_i L_i (every ratio 1: the offline answer's behaviour log-prob is
    the trainer's own), and the rollout/trainer mismatch counts sampled tokens only (the
    hf engine's own weights: none), though the offline rows hold no sampler log-probs."""
    from omni_rl.rewards import RewardResult

    rows = [json.loads(line) for line in shapes.read_text().splitlines()]
    data = shapes.with_name("offline.jsonl")  # beside the clips
    data.write_text("".join(json.dumps({**r, "offline_response": str(r["answer"])}) + "\n" for r in rows))

    def right_if_offline(samples, texts, n, cfg):
        right = [float(t == samples[i // n].fields["offline_response"]) for i, t in enumerate(texts)]
        return [RewardResult(x, x, 1.0) for x in right]

    seen = []
    update = grpo._update

    def spy(engine, reference, batch, rollouts, mask, advantages, *rest):
        stats = update(engine, reference, batch, rollouts, mask, advantages, *rest)
        seen.append((batch, rollouts, mask.cpu().float(), advantages.cpu(), stats))
        return stats

    monkeypatch.setattr(grpo, "_score", right_if_offline)
    monkeypatch.setattr(grpo, "_update", spy)
    # TIS weighs each token by min(pi/mu, 2): an offline answer's weight must be 1
    algorithm = {"epochs": 1, "mini_batch_prompts": 0, "offline_responses": "always", "rollout_correction": "tis"}
    grpo.train(load_config(tiny_config(tmp_path, data, algorithm=algorithm, trainer={"steps": 2})))
    for batch, rollouts, mask, adv, stats in seen:
        assert rollouts.replaced.tolist() == [False, False, False, True] * 2
        offline = [3, 7]
        assert [rollouts.texts[r] for r in offline] == [s.fields["offline_response"] for s in batch.samples]
        assert [rollouts.finish_reasons[r] for r in offline] == ["stop", "stop"]
        for g in (0, 1):  # the offline answer, right alone, has its group's largest advantage
            group = adv[4 * g : 4 * g + 4]
            assert group[3] > 0 and group[3] == group.max() and (group[:3] == group[0]).all()
        lengths = mask.sum(-1)
        assert stats["loss/policy"] == pytest.approx(float(-(adv * lengths).sum() / lengths.sum()), rel=1e-5)
        assert stats["rollout/logp_abs_diff"] < 1e-4 and stats["rollout/tis_capped_fraction"] == 0
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["offline/groups_share"], r["offline/reward_mean"]) for r in rows] == [(1.0, 1.0)] * 2
    # the policy's scores are its own samples' (every one wrong): the offline answers' 1s
    # made them 0.25
    assert [(r["accuracy/mean"], r["reward/mean"]) for r in rows] == [(0.0, 0.0)] * 2


def test_offline_answers_replace_completions_cut_to_the_limit():
    from omni_rl.rollout.hf import Rollouts, replace_completions

    ids = torch.tensor([[5, 2, 0], [6, 6, 2], [7, 2, 0], [8, 8, 8]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 1, 0], [1, 1, 1]])
    sampled = Rollouts(
        ids, mask, -torch.ones(4, 3), torch.tensor([2, 3, 2, 3]), ["stop"] * 3 + ["length"], ["a", "b", "c", "d"], 2
    )

    def decode(tokens):
        return "".join(chr(ord("a") + t) for t in tokens if t != 2)

    mixed = replace_completions(sampled, {1: [9, 9, 9, 9, 2]}, decode, pad_id=0, limit=6)
    assert mixed.completion_ids.tolist() == [[5, 2, 0, 0, 0], [9, 9, 9, 9, 2], [7, 2, 0, 0, 0], [8, 8, 8, 0, 0]]
    assert mixed.completion_mask[1].tolist() == [1] * 5 and mixed.lengths.tolist() == [2, 5, 2, 3]
    assert mixed.logprobs[1].tolist() == [0.0] * 5 and mixed.logprobs[0, :2].tolist() == [-1.0, -1.0]
    assert mixed.replaced.tolist() == [False, True, False, False] and mixed.texts[1] == "jjjj"
    assert mixed.finish_reasons == ["stop", "stop", "stop", "length"]
    cut = replace_completions(sampled, {2: [9, 9, 9, 9, 2]}, decode, pad_id=0, limit=3)
    assert cut.completion_ids[2].tolist() == [9, 9, 9] and cut.finish_reasons[2] == "length"
    assert cut.texts[2] == "jjj"  # the text of the tokens kept
    assert sampled.replaced.tolist() == [False] * 4  # nothing replaced: all sampled


def test_a_cut_offline_answer_is_scored_as_the_tokens_kept(monkeypatch, tiny_checkpoint):
    """An offline answer longer than max_new_tokens is trained on its first tokens only:
    it is scored on the text of those tokens (a prefix without ``</answer>``), not on the
    whole answer, and counted as cut."""
    from omni_rl.data.dataset import Sample
    from omni_rl.models import load_processor
    from omni_rl.rewards import RewardResult
    from omni_rl.rollout.hf import Rollouts

    processor = load_processor(tiny_checkpoint("qwen2_5_vl"))  # a byte-level tokenizer: a token a byte
    scored_texts = []

    def whole_answers_score(samples, texts, n, cfg):
        scored_texts.extend(texts)
        return [RewardResult(float(t.endswith("</answer>")), 0.0, 0.0) for t in texts]

    monkeypatch.setattr(grpo, "_score", whole_answers_score)
    overrides = ["data.train=x", "rollout.n=2", "rollout.max_new_tokens=12", "algorithm.offline_responses=always"]
    cfg = load_config(None, overrides, recipe="grpo")
    fields = {"offline_response": "<answer>B</answer>"}  # 18 bytes: cut at 12
    samples = [Sample("a", "multiple_choice", "B", [], fields=fields), Sample("b", "multiple_choice", "B", [])]
    sampled = Rollouts(
        torch.zeros(4, 2, dtype=torch.long),
        torch.ones(4, 2),
        torch.zeros(4, 2),
        torch.full((4,), 2),
        ["stop"] * 4,
        ["x"] * 4,
        2,
    )
    before = [RewardResult(0.0, 0.0, 0.0)] * 4
    mixed = {"groups": 0, "offline": 0, "offline_reward": 0.0, "offline_cut": 0}
    rollouts, scored = grpo._mix_offline(samples, sampled, before, processor, cfg, mixed)
    assert rollouts.texts[1] == "<answer>B</a" and scored_texts == ["<answer>B</a"]
    assert scored[1].score == 0.0 and rollouts.finish_reasons[1] == "length"
    assert mixed == {"groups": 2, "offline": 1, "offline_reward": 0.0, "offline_cut": 1}
    metrics = grpo._offline_metrics(mixed, "always")
    assert metrics["offline/cut_share"] == 1.0 and metrics["offline/reward_mean"] == 0.0


@pytest.mark.parametrize(
    ("mode", "below", "accuracy", "takes"),
    [("always", None, 1.0, True), ("never", None, 0.0, False), ("below", 0.5, 0.25, True), ("below", 0.5, 0.5, False)],
)
def test_which_groups_take_an_offline_answer(mode, below, accuracy, takes):
    assert grpo.takes_offline(accuracy, mode, below) is takes


def test_offline_below_belongs_to_its_mode():
    with pytest.raises(ConfigError, match="offline_below: does nothing under offline_responses: always"):
        load_config(None, ["data.train=x", "algorithm.offline_responses=always", "algorithm.offline_below=0.5"], "grpo")
    with pytest.raises(ConfigError, match="offline_responses: below needs it in"):
        load_config(None, ["data.train=x", "algorithm.offline_responses=below"], "grpo")


def test_a_filler_group_adds_nothing_to_the_response_lengths():
    """A rank left without a group trains a zero-weight copy of group 0; its completions
    were counted beside the real ones (lengths 40, 40 and 10, 10 dealt to 3 ranks:
    length_mean 30, clipped 0.667, 180 tokens, where the batch trained is 25, 0.5, 100)."""
    from types import SimpleNamespace

    def part(lengths, truncated):
        return SimpleNamespace(lengths=torch.tensor(lengths), truncated=torch.tensor(truncated))

    real = part([40, 40], [True, True])
    assert grpo._rollout_metrics(real, filler=True) == {}
    assert grpo._rollout_metrics(real, filler=False) == {
        "response/length_mean": 40.0,
        "response/length_max": 40,
        "response/clipped_fraction": 1.0,
        "rollout/tokens": 80,
    }


def test_kl_in_the_reward_covers_the_answers_overlong_masking_leaves_out_of_the_loss(tmp_path, shapes, monkeypatch):
    """``overlong: mask`` leaves answers cut at ``max_new_tokens`` out of the loss, yet
    their rewards set their group's baseline: the KL in the reward is theirs too (it was
    taken over the loss's mask, so a cut answer paid no KL and moved the others'
    advantages by kl_coef x its KL / G)."""
    masks = []

    def sequence_kl(engine, reference, batch, rollouts, mask, pad, cfg):
        masks.append((mask.cpu(), rollouts.completion_mask.clone(), rollouts.truncated.clone()))
        return torch.zeros(mask.shape[0])

    monkeypatch.setattr(grpo, "_sequence_kl", sequence_kl)
    algorithm = {"kl_coef": 0.1, "kl_in_reward": True, "overlong": "mask", "epochs": 1}
    trainer = {"steps": 1, "save_every": 0}
    grpo.train(
        load_config(tiny_config(tmp_path, shapes, algorithm=algorithm, rollout={"max_new_tokens": 3}, trainer=trainer))
    )
    ((mask, completion, truncated),) = masks
    assert truncated.any()  # a tiny random model seldom stops within 3 tokens
    assert torch.equal(mask, completion.to(mask.dtype))


def test_lora_adapters_are_drawn_from_the_run_seed_whatever_the_process(tmp_path, shapes):
    """Each process seeds its own stream (run.seed + rank); LoRA's A matrices were drawn
    from it, so under FSDP2 (which keeps each process's shard, broadcasting nothing) the
    adapters started as a patchwork of the ranks' draws, unlike one process's."""
    from omni_rl.engine import distributed
    from omni_rl.recipes.common import Run, setup_model
    from omni_rl.runtime import seed_everything

    cfg = load_config(tiny_config(tmp_path, shapes, model={"lora": {"rank": 4, "alpha": 8}}))
    run = Run(tmp_path / "run", distributed.ranks(), torch.device("cpu"), None)
    adapters = []
    for rank in (0, 1):
        seed_everything(cfg.run.seed + rank)  # what start_run seeds on this rank
        model, _, _ = setup_model(cfg, run)
        adapters.append({k: v.clone() for k, v in model.state_dict().items() if "lora_A" in k})
    assert adapters[0] and all(torch.equal(adapters[0][k], adapters[1][k]) for k in adapters[0])


def test_a_full_rank_counts_nothing_it_draws_only_to_stay_in_step(monkeypatch):
    """Under dynamic sampling every rank draws the largest shortfall of any rank, so a
    rank that is full, or fills partway through a round, rolls out groups only to stay
    in step. Those groups are neither filtered (the UCB windows took them as |A| = 0,
    and never saw the informative ones dropped beside them) nor counted in
    skipped/groups_filtered: a rank scans its groups in draw order until it is full."""
    import contextlib

    from omni_rl.data.dataset import Sample
    from omni_rl.data.sampler import PromptSampler

    informative = {0, 2, 3, 5}  # rows whose two completions score apart

    class Rows:
        data = "fake.jsonl"

        def encoded(self, i, processor):
            sample = Sample(id=f"row{i}", problem_type="x", answer=0, messages=[], data_source="src")
            return sample, {"input_ids": torch.zeros(1, 5)}

    class Engine:
        def max_prompt_tokens(self, rollout):
            return 1000

        def rollout(self, samples, encoded, n, sampling, seeds):
            return SimpleNamespace(texts=[None] * len(samples) * n, ids=samples)

    def score(samples, texts, n, cfg):
        return [SimpleNamespace(score=float(k * (int(s.id[3:]) in informative))) for s in samples for k in range(n)]

    monkeypatch.setattr(grpo, "select_groups", lambda rollouts, keep: [rollouts.ids[i] for i in keep])
    monkeypatch.setattr(grpo, "concat_rollouts", lambda parts, pad: parts)
    monkeypatch.setattr(grpo, "_score", score)
    # another rank is always 3 prompts short: this one draws 3 a round
    monkeypatch.setattr(grpo.distributed, "all_max", lambda value: max(value, 3))
    algorithm = SimpleNamespace(
        dynamic_sampling=True, max_resample_rounds=1, offline_responses="never", overlong="none"
    )
    cfg = SimpleNamespace(
        algorithm=algorithm,
        rollout=SimpleNamespace(n=2, max_prompt_length=1000),
        data=SimpleNamespace(prompts_per_step=2),
    )
    cfg.run = SimpleNamespace(seed=0)
    skipped = {"prompt_too_long": 0, "groups_filtered": 0, "sampling_rounds": 0}
    processor = SimpleNamespace(tokenizer=SimpleNamespace(pad_token_id=0))
    batch, _, _, _, filtered = grpo._collect(
        Rows(),
        PromptSampler(8, 0, shuffle=False),
        Engine(),
        processor,
        None,
        cfg,
        skipped,
        {},
        None,
        lambda name: contextlib.nullcontext(),
    )
    # round 1 draws rows 0-2: 0 kept, 1 filtered, 2 kept and the rank is full; round 2's
    # rows 3-5 (4 alike) only keep it in step
    assert [s.id for s in batch.samples] == ["row0", "row2"]
    assert (filtered, skipped["groups_filtered"], skipped["sampling_rounds"]) == (["src", "src"], 1, 2)


def test_an_offline_answer_ends_as_the_chat_template_ends_an_answer(tiny_checkpoint, monkeypatch):
    """An offline answer closes with the chat template's end of an answer
    (``<|im_end|>``), not the tokenizer's ``eos_token`` (released Qwen2-Audio's is
    ``<|endoftext|>``), as the sampled completions beside it end."""
    from omni_rl.data.dataset import Sample
    from omni_rl.models import load_processor
    from omni_rl.rewards import RewardResult
    from omni_rl.rollout.hf import Rollouts

    processor = load_processor(tiny_checkpoint("qwen2_5_vl"))
    processor.tokenizer.eos_token = "<|endoftext|>"
    monkeypatch.setattr(grpo, "_score", lambda samples, texts, n, cfg: [RewardResult(1.0, 1.0, 1.0)] * len(texts))
    sample = Sample(id="r", problem_type="counting", answer=2, messages=[], fields={"offline_response": "2"})
    sampled = Rollouts(
        torch.ones(2, 3, dtype=torch.long),
        torch.ones(2, 3),
        torch.zeros(2, 3),
        torch.tensor([3, 3]),
        ["length"] * 2,
        ["x", "x"],
        2,
    )
    algorithm = SimpleNamespace(offline_responses="always", offline_below=1.0)
    cfg = SimpleNamespace(algorithm=algorithm, rollout=SimpleNamespace(n=2, max_new_tokens=8))
    mixed = {"groups": 0, "offline": 0, "offline_reward": 0.0, "offline_cut": 0}
    scored = [RewardResult(0.0, 0.0, 1.0)] * 2
    rollouts, _ = grpo._mix_offline([sample], sampled, scored, processor, cfg, mixed)
    end = processor.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert int(rollouts.completion_ids[1, rollouts.lengths[1] - 1]) == end


def test_a_finished_run_resumed_keeps_its_summary(tmp_path, shapes):
    """Resuming a run that had reached trainer.steps ran no step and wrote summary.json
    with last_metrics {} (the flow recipe kept the last logged row)."""
    config = load_config(tiny_config(tmp_path, shapes, algorithm={"epochs": 1}, trainer={"steps": 1}))
    final = grpo.train(config)
    summary = tmp_path / "run" / "summary.json"
    before = json.loads(summary.read_text())["last_metrics"]
    assert before and before["step"] == 1
    assert grpo.train(config, resume="auto")["step"] == 1
    assert json.loads(summary.read_text())["last_metrics"] == before == json.loads(json.dumps(final))


def test_a_row_logged_for_an_evaluation_has_the_entropy(tmp_path, shapes):
    """A step off the logging schedule logs its row when it evaluates; the entropy was
    left out of it (computed only on scheduled logging steps)."""
    held = tmp_path / "held.jsonl"
    held.write_text("".join(shapes.read_text().splitlines(keepends=True)[:2]))
    sections = {"algorithm": {"epochs": 1}, "trainer": {"steps": 2, "log_every": 2, "eval_every": 1, "save_every": 0}}
    config = load_config(tiny_config(tmp_path, shapes, **sections), [f"data.eval=[{{data: {held}}}]"])
    grpo.train(config)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all("eval/held/accuracy" in r for r in rows)
    assert ["actor/entropy" in r for r in rows] == [True, True]
