"""The SFT recipe and the evaluator: small runs on synthetic shapes."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from omni_rl.cli import main
from omni_rl.errors import OmniRLError
from omni_rl.models import forward, load
from omni_rl.models.forward import explicit_positions, reset_rope_deltas
from omni_rl.models.inputs import append_completion
from omni_rl.preprocess.scenes import write_video_qa
from omni_rl.recipe_loader import load_config
from omni_rl.recipes import sft

MEDIA = ["media.min_frames=2", "media.max_frames=8", "media.video_min_pixels=3136", "media.video_max_pixels=12544"]


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    return write_video_qa(tmp_path_factory.mktemp("shapes"), videos=4, seed=1, seconds=2.0)


def test_sft_memorizes_a_small_set(tmp_path, shapes):
    cfg = load_config(
        None,
        [
            f"data.train={shapes}",
            f"run.output_dir={tmp_path}",
            "run.threads=2",
            "trainer.steps=40",
            "trainer.save_every=20",
            "data.prompts_per_step=8",
            "optimizer.lr=3e-3",
            *MEDIA,
        ],
        recipe="sft",
    )
    final = sft.train(cfg)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 40 and final == rows[-1]
    assert rows[-1]["loss/sft"] < 0.5 * rows[0]["loss/sft"]
    assert (tmp_path / "checkpoints" / "step-00000040" / "model" / "config.json").is_file()


def test_eval_cli_reports_accuracy_per_type(tmp_path, shapes, capsys):
    cfg = load_config(
        None,
        [
            f"data.train={shapes}",
            f"run.output_dir={tmp_path / 'run'}",
            "run.threads=2",
            "trainer.steps=60",
            "data.prompts_per_step=16",
            "optimizer.lr=3e-3",
            *MEDIA,
        ],
        recipe="sft",
    )
    sft.train(cfg)
    model = tmp_path / "run" / "checkpoints" / "step-00000060" / "model"
    summary_file = tmp_path / "eval.json"
    args = [
        "eval",
        "--model",
        str(model),
        "--data",
        str(shapes),
        "--config",
        str(tmp_path / "run" / "config.yaml"),
        "--max-new-tokens",
        "24",
        "--out",
        str(summary_file),
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "overall" in out and "multiple_choice" in out
    summary = json.loads(summary_file.read_text())
    assert summary["rows"] == 16 and summary["samples"] == 1
    assert set(summary["per_type"]) == {"multiple_choice", "counting", "temporal_grounding"}
    # trained on exactly these rows: greedy answers reproduce most of them
    assert summary["accuracy"] > 0.5
    assert main([*args, "--samples", "2"]) == 0
    out = capsys.readouterr().out
    assert "pass@2" in out and "one sampled answer" in out
    summary = json.loads(summary_file.read_text())
    assert summary["samples"] == 2 and 0 <= summary["sampled_accuracy"] <= summary["accuracy"]


def test_rows_eval_and_training_eval_score_alike(tmp_path, shapes, monkeypatch):
    """``omni-rl eval`` on rows and a ``data.eval`` rows set during training answer and
    score on one path: the same answers (right on every other row) give the same
    summary, and the training metrics are that summary's."""
    import torch

    from omni_rl.data.config import EvalSetConfig
    from omni_rl.data.dataset import MediaDataset
    from omni_rl.evaluation import pipeline
    from omni_rl.evaluation.during_training import HeldOut
    from omni_rl.preprocess.pipeline import Budgets

    def canned(model, processor, dataset, sampling, samples, indices, *rest):
        rows = [dataset.rows[i] for i in indices]
        return [(row, [str(row.answer) if k % 2 == 0 else "no idea"]) for k, row in enumerate(rows)], []

    monkeypatch.setattr(pipeline, "answer_rows", canned)
    cfg = load_config(None, [f"data.train={shapes}", f"run.output_dir={tmp_path}", *MEDIA], recipe="sft")
    cfg.data.eval = [EvalSetConfig(data=str(shapes), name="held")]
    metrics = HeldOut(cfg, tmp_path, "qwen2_5_vl")(torch.nn.Linear(1, 1), None, step=3)
    during = json.loads((tmp_path / "eval" / "held" / "step-3" / "results.json").read_text())

    dataset = MediaDataset(shapes, Budgets.from_config(cfg.media), prompt_template=cfg.data.prompt_template)
    rows = pipeline.evaluate_rows(None, None, dataset)
    assert rows["accuracy"] == 0.5 and rows["rows"] == 16
    assert {k: v for k, v in during.items() if k not in ("step", "skipped_rows")} == {
        k: v for k, v in rows.items() if k not in ("rows_read", "refused_rows", "skipped_rows")
    }
    assert during["step"] == 3 and during["skipped_rows"] == 0
    assert metrics["eval/held/accuracy"] == rows["accuracy"] and metrics["eval/held/rows"] == 16
    per_type = {k.removeprefix("eval/held/accuracy/"): v for k, v in metrics.items() if "accuracy/" in k}
    per_source = {k.removeprefix("source/"): per_type.pop(k) for k in list(per_type) if k.startswith("source/")}
    assert per_type == rows["per_type"] and per_source == rows["per_source"] == {"synthetic_shapes": 0.5}


def test_a_set_listed_greedy_and_sampled_logs_both_accuracies(tmp_path, shapes, monkeypatch):
    """The same rows as two ``data.eval`` sets, greedy and with 4 samples (sampled as
    the rollouts are): the greedy accuracy, the pass@4 and the accuracy of one sampled
    answer (the mean over the 4), side by side in the metrics and in the sampled set's
    results."""
    import torch

    from omni_rl.data.config import EvalSetConfig
    from omni_rl.evaluation import pipeline
    from omni_rl.evaluation.during_training import HeldOut
    from omni_rl.rollout.hf import SamplingParams

    asked = []

    def canned(model, processor, dataset, sampling, samples, indices, *rest):
        asked.append(sampling)
        rows = [dataset.rows[i] for i in indices]
        # even rows: right first, then wrong; odd rows: always wrong
        answers = [
            [str(row.answer) if k % 2 == 0 and s == 0 else "no idea" for s in range(samples)]
            for k, row in enumerate(rows)
        ]
        return list(zip(rows, answers, strict=True)), []

    monkeypatch.setattr(pipeline, "answer_rows", canned)
    cfg = load_config(None, [f"data.train={shapes}", f"run.output_dir={tmp_path}", *MEDIA], recipe="sft")
    cfg.data.eval = [
        EvalSetConfig(data=str(shapes), name="greedy"),
        EvalSetConfig(data=str(shapes), name="sampled", samples=4),
    ]
    rollouts = SamplingParams(0.7, top_p=0.9, top_k=20, max_new_tokens=40)  # GRPO's rollout section
    metrics = HeldOut(cfg, tmp_path, "qwen2_5_vl", sampling=rollouts)(torch.nn.Linear(1, 1), None, step=2)
    greedy, sampled = asked
    assert (greedy.temperature, greedy.max_new_tokens) == (0.0, 40)
    assert (sampled.temperature, sampled.top_p, sampled.top_k, sampled.max_new_tokens) == (0.7, 0.9, 20, 40)
    assert metrics["eval/greedy/accuracy"] == 0.5 and "eval/greedy/sampled_accuracy" not in metrics
    assert metrics["eval/sampled/accuracy"] == 0.5 and metrics["eval/sampled/sampled_accuracy"] == 0.125
    results = json.loads((tmp_path / "eval" / "sampled" / "step-2" / "results.json").read_text())
    assert results["samples"] == 4 and results["sampled_accuracy"] == 0.125


def _labels_loss(model, batch: dict, labels, tokens: float):
    """The reference: transformers' own ``labels=`` loss over full-vocabulary logits."""
    reset_rope_deltas(model)
    batch = dict(batch)
    positions, _ = explicit_positions(model, batch)
    extra = {"position_ids": positions} if positions is not None else {}
    return model(**batch, labels=labels, num_items_in_batch=tokens, **extra).loss


def _whole_aux(model, batch: dict):
    """The MoE load-balancing term transformers adds whole to a ``labels=`` loss (0
    without one); SFT weights it by the micro-batch's share of the step's targets."""
    reset_rope_deltas(model)
    batch = dict(batch)
    positions, _ = explicit_positions(model, batch)
    extra = {"position_ids": positions} if positions is not None else {}
    aux = getattr(model(**batch, **extra), "aux_loss", None)
    return 0.0 if aux is None else model.router_aux_loss_coef * aux


def _value_and_grads(model, loss_fn):
    params = [p for p in model.parameters() if p.requires_grad]
    loss = loss_fn()
    return loss.detach(), torch.autograd.grad(loss, params, allow_unused=True)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen2_audio", "qwen2_5_omni_thinker", "qwen3_omni_moe_thinker"])
def test_the_chunked_target_loss_equals_the_labels_loss(family, tiny_checkpoint, family_prompts, monkeypatch):
    """SFT's loss through the chunked head equals transformers' ``labels=`` loss over the
    whole logits, in value and in every parameter's gradient, within 1e-5 relative:
    the shift by one, -100 on prompts and padding, the division by the step's count,
    and an MoE's load-balancing term where its config asks for it."""
    model, processor = load(tiny_checkpoint(family))
    if family == "qwen3_omni_moe_thinker":
        model.config.text_config.output_router_logits = True
    inputs = family_prompts(family, processor)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (2, 7), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, 4:] = 0  # a shorter target, right-padded
    batch, labels = append_completion(inputs, ids, mask)
    tokens = float(mask.sum()) + 5  # the step's count: other micro-batches and ranks too
    vocab = forward.output_head(model).weight.shape[0]
    monkeypatch.setattr(forward, "CHUNK_BYTES", 4 * vocab * 3)  # three positions per chunk
    # transformers' Qwen2-Audio head ignores num_items_in_batch and takes the mean over
    # the micro-batch's targets: its sum is that mean times their count
    share = float(mask.sum()) / tokens
    scale = share if family == "qwen2_audio" else 1.0
    want, want_grads = _value_and_grads(
        model, lambda: _labels_loss(model, batch, labels, tokens) * scale - _whole_aux(model, batch) * (1 - share)
    )
    got, got_grads = _value_and_grads(model, lambda: sft._target_nll(model, batch, labels, tokens))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    assert [g is None for g in got_grads] == [w is None for w in want_grads]
    pairs = [(g, w) for g, w in zip(got_grads, want_grads, strict=True) if w is not None]
    # relative to the gradient's scale: some tensors' gradients are rounding noise (1e-13)
    scale = max(float(w.abs().max()) for _, w in pairs)
    for g, w in pairs:
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5 * scale)


def test_an_moe_balancing_term_counts_once_a_step_however_the_rows_are_split(tiny_checkpoint, family_prompts):
    """Two copies of one row in one micro-batch or in two: the same loss. The balancing
    term was added whole to each micro-batch, so two micro-batches counted it twice."""
    model, processor = load(tiny_checkpoint("qwen3_omni_moe_thinker"))
    model.config.text_config.output_router_logits = True
    one = family_prompts("qwen3_omni_moe_thinker", processor, only=0)
    ids = torch.randint(0, 256, (1, 5), generator=torch.Generator().manual_seed(0))
    batch, labels = append_completion(one, ids, torch.ones_like(ids))
    tokens = 2.0 * int((labels != -100).sum())
    with torch.no_grad():
        apart = sum(float(sft._target_nll(model, batch, labels, tokens)) for _ in range(2))
        pair = {k: torch.cat([v, v]) for k, v in batch.items()}  # rows, media patches and grids alike
        together = float(sft._target_nll(model, pair, torch.cat([labels, labels]), tokens))
        aux = float(_whole_aux(model, batch))
    assert aux > 1e-4  # the term is there to count
    assert apart == pytest.approx(together, rel=1e-6)


def _peak_bytes(loss_fn, model, *args) -> int:
    """Peak bytes of the tensors alive during ``loss_fn(model, *args)`` and its backward
    (parameters included), as torch's ``MemTracker`` counts them on CPU."""
    from torch.distributed._tools.mem_tracker import MemTracker

    model.zero_grad(set_to_none=True)
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        loss_fn(model, *args).backward()
    return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


def test_sft_keeps_no_full_vocabulary_logits_over_its_tokens():
    """At Qwen's 152k vocabulary, a forward and backward of SFT's loss peaks at the same
    bytes whatever the target count (one chunk of logits at a time), where the
    ``labels=`` loss's peak grows with [positions, V] fp32 logits and more."""
    config = transformers.Qwen2Config(
        vocab_size=151936,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config)
    prompt, peaks = 256, {}
    for targets in (256, 1024):
        ids = torch.randint(0, config.vocab_size, (1, prompt + targets))
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        labels = ids.masked_fill(torch.arange(ids.shape[1]) < prompt, -100)
        peaks["new", targets] = _peak_bytes(sft._target_nll, model, batch, labels, float(targets))
        peaks["old", targets] = _peak_bytes(_labels_loss, model, batch, labels, float(targets))
    logits_growth = (1024 - 256) * config.vocab_size * 4  # [768 more positions, V] fp32
    assert peaks["old", 1024] - peaks["old", 256] >= logits_growth, peaks  # the tracker sees logits
    assert peaks["new", 1024] - peaks["new", 256] < 0.05 * logits_growth, peaks  # [M, H] states only
    assert peaks["new", 1024] < 0.3 * peaks["old", 1024], peaks


def test_eval_and_curate_ask_as_the_configs_rollouts(tmp_path, shapes, tiny_checkpoint, monkeypatch):
    """With a GRPO ``--config``, eval and curate answer up to its rollout.max_new_tokens
    (not 64 tokens), sample K > 1 answers at its temperature, top_p and top_k, and score
    with its plug-in scorers."""
    from omni_rl.config import save_config
    from omni_rl.evaluation import curate, pipeline

    rows = [json.loads(line) for line in shapes.read_text().splitlines()][:2]
    data = shapes.with_name("vowels.jsonl")  # beside the clips its rows name
    data.write_text("".join(json.dumps({**row, "problem_type": "vowel_share"}) + "\n" for row in rows))
    rollout = ["rollout.max_new_tokens=5", "rollout.temperature=0.7", "rollout.top_p=0.9", "rollout.top_k=20"]
    plugin = "rewards.custom={vowel_share: 'reward_plugins:vowel_share'}"
    config = save_config(
        load_config(None, [f"data.train={data}", *rollout, plugin, *MEDIA], recipe="grpo"), tmp_path / "grpo.yaml"
    )
    asked = []
    for module in (pipeline, curate):
        real = module.answer_rows

        def answer(model, processor, dataset, sampling, *rest, real=real, **kw):
            asked.append(sampling)
            return real(model, processor, dataset, sampling, *rest, **kw)

        monkeypatch.setattr(module, "answer_rows", answer)
    model = str(tiny_checkpoint("qwen2_5_vl"))
    common = ["--data", str(data), "--model", model, "--config", str(config)]
    assert main(["eval", *common, "--out", str(tmp_path / "greedy.json")]) == 0
    assert main(["eval", *common, "--samples", "2", "--out", str(tmp_path / "sampled.json")]) == 0
    out = str(tmp_path / "curated")
    assert (
        main(
            [
                "curate",
                "text-only",
                str(data),
                "--model",
                model,
                "--config",
                str(config),
                "--out",
                out,
                "--samples",
                "2",
            ]
        )
        == 0
    )
    greedy, sampled, curated = asked
    assert (greedy.temperature, greedy.max_new_tokens) == (0.0, 5)
    for sampling in (sampled, curated):
        assert (sampling.temperature, sampling.top_p, sampling.top_k, sampling.max_new_tokens) == (0.7, 0.9, 20, 5)
    assert json.loads((tmp_path / "greedy.json").read_text())["per_type"].keys() == {"vowel_share"}


def test_sft_skips_and_counts_rows_longer_than_its_limit(tmp_path, shapes):
    """A row longer than ``sft.max_length`` (its prompt with the clip's tokens, and its
    target) is skipped and counted, as GRPO skips prompts over its limit; when every row
    is, the run stops saying why. Under a limit no row reaches, none is."""
    common = [f"data.train={shapes}", "trainer.steps=1", "data.prompts_per_step=2", *MEDIA]
    cfg = load_config(None, [*common, f"run.output_dir={tmp_path / 'short'}", "sft.max_length=8"], recipe="sft")
    with pytest.raises(OmniRLError, match=r"nearly every row drawn is skipped: \d+ rows over sft.max_length=8"):
        sft.train(cfg)
    cfg = load_config(None, [*common, f"run.output_dir={tmp_path / 'long'}", "sft.max_length=100000"], recipe="sft")
    assert sft.train(cfg)["skipped/row_too_long"] == 0


def test_sft_counts_rows_too_long_per_step(tmp_path, shapes, monkeypatch):
    """``skipped/row_too_long`` is the step's count, as GRPO's ``prompt_too_long`` is
    (it was the run's running total)."""
    real = sft._encode

    def skipping_two(dataset, sampler, count, processor, cfg, balance, limit, skipped):
        skipped["row_too_long"] += 2  # as if two rows were over the limit this step
        return real(dataset, sampler, count, processor, cfg, balance, limit, skipped)

    monkeypatch.setattr(sft, "_encode", skipping_two)
    out = tmp_path / "run"
    common = [f"data.train={shapes}", "trainer.steps=3", "data.prompts_per_step=2", *MEDIA]
    sft.train(load_config(None, [*common, f"run.output_dir={out}"], recipe="sft"))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["skipped/row_too_long"] for row in rows if "skipped/row_too_long" in row] == [2, 2, 2]


def test_media_sized_for_another_familys_patches_are_refused_or_follow_the_model(tmp_path, shapes, tiny_checkpoint):
    """Frames are sized for ``media.family``'s patches (14 px by default, Qwen3-VL's are
    16): a run whose model has other patches is refused before anything is built,
    naming the setting (it crashed in the processor with a reshape error); ``omni-rl
    eval`` without a config sizes the media for its model's family."""
    from omni_rl.recipes.common import setup_data

    cfg = load_config(None, [f"data.train={shapes}", "model.tiny_family=qwen3_vl"], recipe="sft")
    with pytest.raises(
        OmniRLError, match=r"media.family 'qwen2_5_vl' sizes .*16-pixel patches.*media.family: qwen3_vl"
    ):
        setup_data(cfg, torch.device("cpu"))
    model = tiny_checkpoint("qwen3_vl")
    settings = ["--max-new-tokens", "2", "--set", "media.max_frames=4"]
    assert main(["eval", "--model", str(model), "--data", str(shapes), *settings]) == 0


def test_an_sft_target_ends_as_the_chat_template_ends_an_answer(shapes, tiny_checkpoint):
    """The target closes with what the chat template writes after an answer
    (``<|im_end|>`` in Qwen's), not the tokenizer's ``eos_token``, which released
    Qwen2-Audio sets to ``<|endoftext|>``: its fine-tuned answers ended with a token
    the chat never closes a turn with."""
    from omni_rl.data.dataset import MediaDataset
    from omni_rl.data.sampler import PromptSampler
    from omni_rl.models import load_processor
    from omni_rl.preprocess.pipeline import Budgets
    from omni_rl.recipes.common import Balance

    processor = load_processor(tiny_checkpoint("qwen2_5_vl"))
    processor.tokenizer.eos_token = "<|endoftext|>"  # as released Qwen2-Audio's tokenizer has it
    cfg = load_config(None, [f"data.train={shapes}", *MEDIA], recipe="sft")
    dataset = MediaDataset(shapes, Budgets.from_config(cfg.media))
    skipped = {"row_too_long": 0}
    encoded = sft._encode(dataset, PromptSampler(len(dataset), 0), 2, processor, cfg, Balance(None), None, skipped)
    end = processor.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert [target[-1] for _, target in encoded] == [end, end]


def test_a_finished_sft_run_resumed_keeps_its_summary(tmp_path):
    """As GRPO's: a resume of a finished run wrote last_metrics {} into summary.json."""
    import json

    from omni_rl.preprocess.scenes import write_video_qa
    from omni_rl.recipes import sft

    shapes = write_video_qa(tmp_path / "shapes", videos=2, seed=0, seconds=1.0)
    overrides = [f"data.train={shapes}", f"run.output_dir={tmp_path / 'run'}", "trainer.steps=1"]
    config = load_config(None, overrides, recipe="sft")
    sft.train(config)
    summary = tmp_path / "run" / "summary.json"
    before = json.loads(summary.read_text())["last_metrics"]
    assert before and before["step"] == 1
    sft.train(config, resume="auto")
    assert json.loads(summary.read_text())["last_metrics"] == before
