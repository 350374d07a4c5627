"""The training engine in one process: schedules by hand, bf16-mixed keeps fp32 master
weights that small steps move, gradient accumulation equals one big batch, and the
non-finite guard skips and counts. (N processes: tests/test_distributed.py.)"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from pytest import approx

from omni_rl.engine.config import AdamWConfig, SGDConfig
from omni_rl.engine.engine import TrainingEngine, lr_factor, schedule_warning, shard_units
from omni_rl.errors import OmniRLError
from omni_rl.models import load
from omni_rl.models.inputs import append_completion

TOOLS = Path(__file__).resolve().parents[1] / "tools"


def test_lr_schedules_by_hand():
    # warm-up over 2 steps: 1/2, 2/2; then 10 steps in all end at step 9
    assert [lr_factor(s, 2, 10, "constant") for s in (0, 1, 2, 9)] == [0.5, 1.0, 1.0, 1.0]
    # linear from step 2 (1.0) to step 9 (0.0): step 5 is 3/7 of the way
    assert lr_factor(5, 2, 10, "linear") == approx(1 - 3 / 7)
    assert lr_factor(9, 2, 10, "linear") == approx(0.0)
    assert lr_factor(9, 2, 10, "linear", min_ratio=0.1) == approx(0.1)
    # cosine: halfway (step 5.5 does not exist; 0 warm-up, 11 steps: step 5 is halfway)
    assert lr_factor(5, 0, 11, "cosine") == approx(0.5)
    assert lr_factor(0, 0, 11, "cosine") == approx(1.0)
    assert lr_factor(10, 0, 11, "cosine", min_ratio=0.2) == approx(0.2)


def test_a_warm_up_too_long_for_the_run_is_named(caplog):
    """warmup_steps >= steps - 1 leaves a decaying schedule at its peak, and
    warmup_steps > steps never reaches it: the engine says so when the schedule is set."""
    for total in range(1, 8):
        for warmup in range(0, 10):
            last = lr_factor(total - 1, warmup, total, "linear")
            warned = schedule_warning(warmup, total, "linear") is not None
            assert warned == ((last == 1.0 and warmup > 0) or (last < 1.0 and warmup > total)), (warmup, total)
            peak = max(lr_factor(s, warmup, total, "constant") for s in range(total))
            assert (schedule_warning(warmup, total, "constant") is not None) == (peak < 1.0), (warmup, total)
    net = torch.nn.Linear(2, 1)
    with caplog.at_level("WARNING", logger="omni_rl.engine.engine"):
        TrainingEngine(net, AdamWConfig(lr=0.1), torch.device("cpu"), total_steps=4, schedule="linear", warmup_steps=2)
        assert not caplog.records
        TrainingEngine(net, AdamWConfig(lr=0.1), torch.device("cpu"), total_steps=4, schedule="cosine", warmup_steps=3)
    assert [r.getMessage() for r in caplog.records] == [
        "warmup_steps=3 leaves none of the run's 4 optimizer steps to the cosine schedule: the rate never decays"
    ]


def _batch(processor, family_prompts):
    """Two video prompts with 6-token completions: every parameter gets a gradient."""
    inputs = family_prompts("qwen2_5_vl", processor)
    completion = torch.tensor([[65, 66, 67, 68, 69, 70], [71, 72, 73, 74, 75, 76]])
    batch, labels = append_completion(inputs, completion)
    return batch, labels


def _token_nll(model, batch, labels, denominator):
    logits = model(**batch).logits[:, :-1].float()
    target = labels[:, 1:]
    mask = target != -100
    nll = torch.nn.functional.cross_entropy(logits[mask], target[mask], reduction="sum")
    return nll / denominator


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-pure"])
def test_a_1e6_step_under_bf16(precision, tiny_checkpoint, family_prompts):
    """bf16-mixed: fp32 master weights and optimizer state, and one AdamW step at lr 1e-6
    moves at least 99% of the weights. Pure bf16 loses most of that step (the reason it
    is only an explicit choice)."""
    from omni_rl.engine.engine import load_dtype

    model, processor = load(tiny_checkpoint("qwen2_5_vl"), dtype=load_dtype(precision))
    model.train()
    engine = TrainingEngine(model, AdamWConfig(lr=1e-6), torch.device("cpu"), total_steps=1, precision=precision)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    batch, labels = _batch(processor, family_prompts)
    engine.backward(_token_nll(engine.model, batch, labels, int((labels != -100).sum())))
    # embedding rows of tokens absent from the batch get an exact zero gradient, and no
    # optimizer moves them: the claim is about every weight the step has a gradient for
    touched = {n: p.grad != 0 for n, p in model.named_parameters()}
    result = engine.step()
    assert not result.skipped
    changed = total = 0
    for name, param in model.named_parameters():
        changed += int(((param.detach() != before[name]) & touched[name]).sum())
        total += int(touched[name].sum())
    assert total > 0.9 * sum(p.numel() for p in model.parameters())
    fraction = changed / total
    print(f"{precision}: {fraction:.4f} of {total} weights with a gradient moved")
    if precision == "bf16-mixed":
        assert all(p.dtype == torch.float32 for p in model.parameters())
        state = engine.optimizer.state
        assert all(v.dtype == torch.float32 for s in state.values() for k, v in s.items() if k != "step")
        assert fraction >= 0.99, fraction
    else:
        assert all(p.dtype == torch.bfloat16 for p in model.parameters())
        assert fraction < 0.5, fraction  # measured 0.025: most of the step rounds away


def test_accumulated_micro_batches_equal_one_batch(tiny_checkpoint, family_prompts):
    """Two micro-batches of one prompt each (loss divided by the whole batch's token
    count) give the update of one batch of two, within 1e-5."""
    results = []
    for micro in (2, 1):
        model, processor = load(tiny_checkpoint("qwen2_5_vl"))
        model.train()
        engine = TrainingEngine(model, SGDConfig(lr=0.5, momentum=0.0), torch.device("cpu"), total_steps=1)
        batch, labels = _batch(processor, family_prompts)
        tokens = int((labels[:, 1:] != -100).sum())
        if micro == 2:
            engine.backward(_token_nll(engine.model, batch, labels, tokens))
        else:
            for i in range(2):
                part = {k: v[i : i + 1] for k, v in batch.items() if k in ("input_ids", "attention_mask")}
                part.update(_video_part(batch, i))
                engine.backward(_token_nll(engine.model, part, labels[i : i + 1], tokens))
        engine.step()
        results.append({n: p.detach().clone() for n, p in model.named_parameters()})
    for name, value in results[0].items():
        torch.testing.assert_close(results[1][name], value, atol=1e-5, rtol=1e-5)


def _video_part(batch: dict, i: int) -> dict:
    """Prompt i's media tensors of a two-video batch (pixels are stacked video by video)."""
    grid = batch["video_grid_thw"]
    sizes = grid.prod(-1).tolist()
    start = sum(sizes[:i])
    part = {
        "pixel_values_videos": batch["pixel_values_videos"][start : start + sizes[i]],
        "video_grid_thw": grid[i : i + 1],
    }
    for key in ("second_per_grid_ts", "mm_token_type_ids"):
        if key in batch:
            part[key] = batch[key][i : i + 1]
    return part


def test_non_finite_gradients_skip_the_step_and_stop_the_run(tiny_checkpoint, family_prompts):
    model, processor = load(tiny_checkpoint("qwen2_5_vl"))
    model.train()
    engine = TrainingEngine(model, AdamWConfig(lr=1e-3), torch.device("cpu"), total_steps=5, max_bad_steps=3)
    batch, labels = _batch(processor, family_prompts)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    poisoned = model.lm_head.weight.register_hook(lambda g: g * float("nan"))
    for attempt in range(2):
        engine.backward(_token_nll(engine.model, batch, labels, 10))
        result = engine.step()
        assert result.skipped and engine.metrics()["optim/skipped_nonfinite"] == attempt + 1
    for name, param in model.named_parameters():
        assert torch.equal(param.detach(), before[name]), name
    assert not engine.optimizer.state  # no moment was updated either
    engine.backward(_token_nll(engine.model, batch, labels, 10))
    with pytest.raises(OmniRLError, match="3 optimizer steps in a row had non-finite gradients"):
        engine.step()
    poisoned.remove()


def test_fsdp_units_are_decoder_layers_and_encoder_blocks(tiny_checkpoint):
    model, _ = load(tiny_checkpoint("qwen2_5_vl"))
    names = {type(m).__name__ for m in shard_units(model)}
    assert names == {"Qwen2_5_VLDecoderLayer", "Qwen2_5_VLVisionBlock"}
    layers = model.config.text_config.num_hidden_layers + model.config.vision_config.depth
    assert len(shard_units(model)) == layers


def test_the_schedule_moves_on_over_a_skipped_step():
    """A skipped non-finite step still takes its place in the schedule (as verl's
    trainer does): linear over 4 steps, 1, 2/3, 1/3, 0 of the peak, step 1 skipped,
    steps 2 and 3 run at 1/3 and 0 (holding the schedule would give 2/3 and 1/3), and
    the metrics count the schedule's steps and the skip."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    engine = TrainingEngine(
        model, SGDConfig(lr=0.3, momentum=0.0), torch.device("cpu"), total_steps=4, schedule="linear"
    )
    x = torch.randn(5, 3)
    lrs, skipped = [], []
    for step in range(4):
        loss = model(x).square().mean()
        engine.backward(loss * float("nan") if step == 1 else loss)
        result = engine.step()
        lrs.append(result.lr)
        skipped.append(result.skipped)
    assert skipped == [False, True, False, False]
    assert lrs == approx([0.3, 0.2, 0.1, 0.0])
    metrics = engine.metrics()
    assert metrics["optim/schedule_step"] == 4 and metrics["optim/skipped_nonfinite"] == 1
    assert metrics["optim/lr"] == approx(0.0)


def test_a_schedule_end_under_a_constant_rate_is_refused():
    from omni_rl.errors import ConfigError
    from omni_rl.recipe_loader import config_from_dict

    with pytest.raises(ConfigError, match=r"trainer\.min_lr_ratio: does nothing under schedule: constant"):
        config_from_dict({"recipe": "demo", "trainer": {"min_lr_ratio": 0.1}})
    cfg = config_from_dict({"recipe": "demo", "trainer": {"schedule": "cosine", "min_lr_ratio": 0.1}})
    assert cfg.trainer.setting("min_lr_ratio") == 0.1
    assert config_from_dict({"recipe": "demo"}).trainer.setting("min_lr_ratio") == 0.0


def test_a_checkpoint_resumes_weights_an_earlier_phase_trained_and_parameters_without_state(tmp_path):
    """A two-phase run: the first optimizer trains both layers, the second only the
    second layer, and one trainable parameter never gets a gradient (no optimizer
    state). Saved after the second phase and loaded into a fresh engine built for it,
    the first layer's trained weights come back though frozen now, the stateless
    parameter stays without state, and the next step equals the uninterrupted one."""
    from omni_rl.engine import checkpoint

    def model():
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
        net.unused = torch.nn.Parameter(torch.ones(3))  # trainable, never in the forward
        return net

    def step(engine):
        engine.backward(engine.model(torch.ones(5, 4)).pow(2).sum())
        engine.step()

    net = model()
    engine = TrainingEngine(net, AdamWConfig(lr=0.1), torch.device("cpu"), total_steps=4)
    step(engine)  # phase one: both layers move
    net[0].requires_grad_(False)
    engine.use_optimizer(AdamWConfig(lr=0.1), total_steps=4)
    step(engine)
    checkpoint.save(engine, tmp_path, 2, {}, export=False)
    step(engine)

    fresh = model()
    fresh[0].requires_grad_(False)
    resumed = TrainingEngine(fresh, AdamWConfig(lr=0.1), torch.device("cpu"), total_steps=4)
    checkpoint.load(resumed, tmp_path / "checkpoints" / "step-00000002")
    assert fresh.unused not in resumed.optimizer.state
    step(resumed)
    for (name, want), got in zip(net.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert torch.equal(want, got), name


def test_adamw_runs_fused_on_cuda_and_foreach_elsewhere(caplog):
    from omni_rl.engine.config import adamw_kernel

    assert adamw_kernel(torch.device("cuda", 0)) == "fused"
    assert adamw_kernel(torch.device("cpu")) == adamw_kernel(None) == "foreach"
    net = torch.nn.Linear(4, 3)
    with caplog.at_level("INFO", logger="omni_rl.engine.config"):
        engine = TrainingEngine(net, AdamWConfig(lr=1e-3), torch.device("cpu"), total_steps=1)
    assert engine.optimizer.defaults["foreach"] is True and not engine.optimizer.defaults["fused"]
    assert "AdamW: the foreach kernel" in caplog.text


def test_foreach_adamw_steps_to_the_bit_like_the_per_tensor_loop():
    """The CPU kernel the engine picks changes no documented figure: 20 AdamW steps with
    weight decay on tensors of several shapes end bitwise equal to torch's per-tensor loop."""
    torch.manual_seed(0)
    start = [torch.randn(shape) for shape in ((64, 32), (7,), (3, 5, 7))]
    ends = []
    for foreach in (False, True):
        params = [p.clone().requires_grad_() for p in start]
        optimizer = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, foreach=foreach)
        grads = torch.Generator().manual_seed(1)
        for _ in range(20):
            for p in params:
                p.grad = torch.randn(p.shape, generator=grads)
            optimizer.step()
        ends.append([p.detach() for p in params])
    assert all(torch.equal(a, b) for a, b in zip(*ends, strict=True))


def test_on_cuda_the_metrics_carry_peak_allocated_and_reserved_memory(monkeypatch):
    engine = TrainingEngine(torch.nn.Linear(4, 3), AdamWConfig(lr=1e-3), torch.device("cpu"), total_steps=1)
    assert not any(k.startswith("memory/") for k in engine.metrics())  # a CPU run has no such figure
    engine.device = torch.device("cuda", 0)  # what a CUDA run reads, without a GPU
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: 3 * 2**30)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device: 4.5 * 2**30)
    row = engine.metrics()
    assert row["memory/peak_allocated_gb"] == 3.0 and row["memory/peak_reserved_gb"] == 4.5


def _tied(tiny_checkpoint, checkpointing: bool = False):
    """The tiny Qwen2.5-VL with its output head tied to its input embedding (as the 3B
    model's is), in train mode."""
    model, processor = load(tiny_checkpoint("qwen2_5_vl"))
    model.get_output_embeddings().weight = model.get_input_embeddings().weight
    if checkpointing:
        model.gradient_checkpointing_enable({"use_reentrant": False})
    model.train()
    return model, processor


@pytest.mark.parametrize("checkpointing", [False, True])
def test_a_tied_weights_gradients_added_in_place_equal_the_plain_ones(
    checkpointing, tiny_checkpoint, family_prompts, monkeypatch
):
    """Three micro-batches of two video prompts of different lengths (left padding),
    G = 2 completions each, one stopped early and one at once, the prompt's backward
    apart: every gradient, the tied weight's included, is the plain path's (the head's
    buffer, the dense lookup) within float rounding, and dense; what the in-place path
    saves: ``test_a_tied_weight_never_has_two_full_gradients``."""
    from test_forward import completions

    from omni_rl.models import forward
    from omni_rl.models.forward import group_forward

    def accumulated(model, backward):
        inputs = family_prompts("qwen2_5_vl", processor)
        for seed in (1, 2, 3):  # micro-batches of other completions
            ids, mask = completions(4, 5, seed=seed)
            out = group_forward(model, inputs, ids, mask, 2, entropy="grad", apart=True)
            backward((out.logp * mask).sum(), out.prompt)
        return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    plain_model, processor = _tied(tiny_checkpoint, checkpointing)
    in_place, _ = _tied(tiny_checkpoint, checkpointing)

    def plain(loss, prompt):
        loss.backward()
        prompt.run()

    reference = accumulated(plain_model, plain)
    engine = TrainingEngine(in_place, AdamWConfig(lr=1e-3), torch.device("cpu"), 1, precision="fp32")
    assert engine.tied_grad_in_place is True and in_place.get_input_embeddings().sparse
    taken, choose = [], forward._in_place_grad
    monkeypatch.setattr(forward, "_in_place_grad", lambda weight: taken.append(choose(weight)) or taken[-1])
    got = accumulated(in_place, engine.backward)
    assert [t is None for t in taken] == [True, False, False]  # from the second micro-batch on
    assert got.keys() == reference.keys() and "model.language_model.embed_tokens.weight" in got
    assert all(g.layout == torch.strided for g in got.values())
    for name in got:
        torch.testing.assert_close(got[name], reference[name], atol=1e-6, rtol=1e-6, msg=name)


def test_a_lookup_gradient_that_lands_alone_is_made_dense(tiny_checkpoint):
    """A tied weight whose head is not used in a backward (only the lookup is): its
    sparse gradient has nothing to be added into, and reaches the optimizer dense."""
    model, _ = _tied(tiny_checkpoint)
    engine = TrainingEngine(model, AdamWConfig(lr=1e-3), torch.device("cpu"), 1, precision="fp32")
    embedding = model.get_input_embeddings()
    engine.backward(embedding(torch.tensor([[3, 4, 4, 9]])).square().sum())
    grad = embedding.weight.grad
    assert grad.layout == torch.strided and torch.equal(grad[4], 4 * embedding.weight[4].detach())
    assert grad[5].abs().sum() == 0
    before = embedding.weight.detach().clone()
    engine.step()
    assert not torch.equal(embedding.weight, before)


def test_untied_heads_and_other_strategies_keep_the_buffer(tiny_checkpoint, caplog):
    """Untied (the tiny models, Qwen2.5-VL 7B) and frozen heads are not marked; a tied
    head under DDP or FSDP2 keeps its buffer, said in the log."""
    from omni_rl.models.forward import tied_head

    untied, _ = load(tiny_checkpoint("qwen2_5_vl"))
    assert tied_head(untied) is None
    assert TrainingEngine(untied, AdamWConfig(lr=1e-3), torch.device("cpu"), 1).tied_grad_in_place is None
    frozen, _ = _tied(tiny_checkpoint)
    frozen.get_input_embeddings().weight.requires_grad_(False)
    assert tied_head(frozen) is None
    tied, _ = _tied(tiny_checkpoint)
    engine = TrainingEngine.__new__(TrainingEngine)
    engine.module, engine.strategy = tied, "fsdp"
    with caplog.at_level("INFO", logger="omni_rl.engine.engine"):
        assert engine._tied_head_in_place() is False
    assert "its weight's gradient is made twice at times" in caplog.text and not tied.get_input_embeddings().sparse


class _Tied(torch.nn.Module):
    """A token lookup and a vocabulary head that share one [V, H] weight."""

    def __init__(self, vocab: int, width: int):
        super().__init__()
        self.embed, self.head = torch.nn.Embedding(vocab, width), torch.nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight

    def get_input_embeddings(self):
        return self.embed

    def get_output_embeddings(self):
        return self.head


def _second_backward_peak(in_place: bool, monkeypatch) -> float:
    """MiB allocated and still held at the peak of a second micro-batch's backward
    through a tied [200,000 x 256] weight, as the allocator saw it (the profiler's
    memory events: every allocation counts whole, touched or not)."""
    import weakref

    from omni_rl.models import forward

    sys.path.insert(0, str(TOOLS))
    try:
        import torch_private
    finally:
        sys.path.remove(str(TOOLS))
    torch.manual_seed(0)
    model = _Tied(200_000, 256)
    engine = TrainingEngine(model, SGDConfig(lr=0.1), torch.device("cpu"), 1, precision="fp32")
    if not in_place:  # the head's buffer, the dense lookup
        monkeypatch.setattr(forward, "_IN_PLACE", weakref.WeakValueDictionary())
        model.embed.sparse = False
    ids = torch.randint(0, 200_000, (2, 8))  # few tokens: the head's chunks stay small

    def backward():
        hidden = torch.tanh(model.embed(ids))
        engine.backward(forward.completion_logprobs(hidden, model.head, ids, torch.ones_like(ids)).sum())

    backward()  # the first micro-batch makes the gradient
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as profiler:
        backward()
    held = peak = 0
    for _, size in torch_private.memory_events(profiler, "")[0]:
        held += size
        peak = max(peak, held)
    return peak / 2**20


def test_a_tied_weight_never_has_two_full_gradients(monkeypatch):
    """What a second micro-batch's backward through a tied [200,000 x 256] weight (195
    MiB in fp32) allocates: the plain path makes the head's full fp32 buffer and the
    lookup's dense gradient beside the weight's; in place, nothing of that size. Counted
    by the allocator, not the resident set, whose lazily mapped zero pages made an earlier
    version of this test pass or fail with the machine's memory state."""
    full = 200_000 * 256 * 4 / 2**20
    plain, in_place = _second_backward_peak(False, monkeypatch), _second_backward_peak(True, monkeypatch)
    assert plain >= 1.9 * full and in_place <= 0.3 * full, (plain, in_place)


@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_a_data_parallel_strategy_in_one_process_is_refused_with_the_fix(strategy):
    """One process joins no process group, so FSDP2 and DDP failed deep inside torch
    (no RANK in the environment, no default group); the choice is refused before the
    model loads, naming what works."""
    from omni_rl.engine.engine import resolve_strategy

    with pytest.raises(OmniRLError, match=rf"trainer.strategy: {strategy} needs torchrun with 2 or more processes"):
        resolve_strategy(strategy, 1, in_group=False)
    assert resolve_strategy(strategy, 2, in_group=True) == strategy
    assert resolve_strategy(strategy, 1, in_group=True) == strategy  # a tracer's fake group of one
    assert resolve_strategy("auto", 1, in_group=False) == "single" and resolve_strategy("auto", 2, True) == "fsdp"


def _linear_engine(total_steps: int, lr: float = 1.0) -> TrainingEngine:
    torch.manual_seed(0)
    return TrainingEngine(
        torch.nn.Linear(4, 2), SGDConfig(lr=lr, momentum=0.0), torch.device("cpu"), total_steps, schedule="linear"
    )


def _steps(engine: TrainingEngine, count: int) -> list[tuple[float, float]]:
    """(the rate each step used, optim/lr as logged after it)."""
    out = []
    for _ in range(count):
        engine.backward(engine.model(torch.ones(3, 4)).sum())
        used = engine.step().lr
        out.append((used, engine.metrics()["optim/lr"]))
    return out


def test_optim_lr_is_the_rate_the_step_used():
    """It was the next step's rate: warm-up over 4 steps logged 0.5, 0.75, 1.0 for steps
    that ran at 0.25, 0.5, 0.75."""
    engine = TrainingEngine(
        torch.nn.Linear(4, 2), SGDConfig(lr=1.0, momentum=0.0), torch.device("cpu"), 10, warmup_steps=4
    )
    assert engine.metrics()["optim/lr"] == approx(0.25)  # before any step: the first step's
    steps = _steps(engine, 3)
    assert [used for used, _ in steps] == approx([0.25, 0.5, 0.75])
    assert [logged for _, logged in steps] == approx([0.25, 0.5, 0.75])


def test_a_resume_with_more_steps_goes_on_along_the_longer_schedule(tmp_path):
    """Saved after 4 of 4 linear steps (1, 2/3, 1/3, 0) and resumed with 8: the next
    steps run at lr_factor(4..7, 0, 8): 3/7, 2/7, 1/7, 0 (the first ran at the saved
    run's next rate, 0, before), and a resume with the same steps goes on exactly."""
    from omni_rl.engine import checkpoint

    first = _linear_engine(4)
    assert [used for used, _ in _steps(first, 4)] == approx([1.0, 2 / 3, 1 / 3, 0.0])
    checkpoint.save(first, tmp_path, 4, {}, export=False)
    saved = tmp_path / "checkpoints" / "step-00000004"
    longer = _linear_engine(8)
    checkpoint.load(longer, saved)
    want = [lr_factor(s, 0, 8, "linear") for s in range(4, 8)]
    assert [used for used, _ in _steps(longer, 4)] == approx(want)
    half = _linear_engine(8)
    _steps(half, 2)
    checkpoint.save(half, tmp_path / "half", 2, {}, export=False)
    again, through = _linear_engine(8), _steps(half, 2)
    checkpoint.load(again, tmp_path / "half" / "checkpoints" / "step-00000002")
    assert _steps(again, 2) == through  # bit for bit


def test_a_resume_with_another_learning_rate_goes_on_at_it_and_says_so(tmp_path, caplog):
    """The checkpoint's base rate won silently: resumed with lr 2 after 2 of 8 linear
    steps at lr 1, the next step ran at 1 * 5/7. It runs at 2 * 5/7 now, with a line."""
    from omni_rl.engine import checkpoint

    first = _linear_engine(8)
    _steps(first, 2)
    checkpoint.save(first, tmp_path, 2, {}, export=False)
    doubled = _linear_engine(8, lr=2.0)
    with caplog.at_level("WARNING", logger="omni_rl.engine.engine"):
        checkpoint.load(doubled, tmp_path / "checkpoints" / "step-00000002")
    assert "resuming at learning rates [2.0] where the checkpoint's run had [1.0]" in caplog.text
    assert [used for used, _ in _steps(doubled, 2)] == approx([2 * lr_factor(s, 0, 8, "linear") for s in (2, 3)])


def test_a_resume_with_other_optimizer_settings_goes_on_with_them_and_says_so(tmp_path, caplog):
    """The checkpoint's weight decay, betas and eps won silently over the config's (and
    its kernel flags over the ones this machine's engine chose). This run's own settings
    hold now, beside the saved moments, and the log names each that changed."""
    from omni_rl.engine import checkpoint

    def engine(config: AdamWConfig) -> TrainingEngine:
        torch.manual_seed(0)
        return TrainingEngine(torch.nn.Linear(4, 2), config, torch.device("cpu"), 8)

    first = engine(AdamWConfig(lr=0.1, weight_decay=0.0))
    _steps(first, 1)
    checkpoint.save(first, tmp_path, 1, {}, export=False)
    asked = AdamWConfig(lr=0.1, weight_decay=0.5, betas=(0.5, 0.9), eps=1e-3)
    resumed = engine(asked)
    built = {k: v for k, v in resumed.optimizer.param_groups[0].items() if k != "params"}
    with caplog.at_level("WARNING", logger="omni_rl.engine.checkpoint"):
        checkpoint.load(resumed, tmp_path / "checkpoints" / "step-00000001")
    group = resumed.optimizer.param_groups[0]
    assert {k: v for k, v in group.items() if k != "params"} == built
    assert resumed.optimizer.state[resumed.module.weight]["exp_avg"].abs().sum() > 0  # the moments are the saved ones
    for line in ("weight_decay 0.5 (the checkpoint's 0.0)", "betas (0.5, 0.9) (the checkpoint's (0.9, 0.999))"):
        assert line in caplog.text
    assert "eps 0.001 (the checkpoint's 1e-08)" in caplog.text and "foreach" not in caplog.text
    caplog.clear()
    same = engine(AdamWConfig(lr=0.1, weight_decay=0.0))
    with caplog.at_level("WARNING", logger="omni_rl.engine.checkpoint"):
        checkpoint.load(same, tmp_path / "checkpoints" / "step-00000001")
    assert "checkpoint's" not in caplog.text


def test_matmul_weights_go_to_bf16_but_a_head_tied_to_the_embedding_stays():
    """A frozen copy under bf16-mixed keeps its matmul weights in bf16 (autocast rounds
    them so anyway) and everything else in fp32; a head tied to the token embedding
    stays fp32 (the embedding reads it); under autocast the copy computes exactly what
    its fp32 twin does."""
    from omni_rl.engine.engine import matmul_weights_to

    torch.manual_seed(0)

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(11, 8)
            self.proj = torch.nn.Linear(8, 8)
            self.norm = torch.nn.LayerNorm(8)
            self.head = torch.nn.Linear(8, 11, bias=False)
            self.head.weight = self.embed.weight

        def forward(self, ids):
            return self.head(self.norm(self.embed(ids) + self.proj(self.embed(ids))))

    twin, frozen = Tiny(), Tiny()
    frozen.load_state_dict(twin.state_dict())
    matmul_weights_to(frozen, torch.bfloat16)
    dtypes = {name: p.dtype for name, p in frozen.named_parameters()}
    assert dtypes == {
        "embed.weight": torch.float32,
        "proj.weight": torch.bfloat16,
        "proj.bias": torch.bfloat16,
        "norm.weight": torch.float32,
        "norm.bias": torch.float32,
    }
    ids = torch.tensor([[1, 5, 7, 10]])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(frozen(ids), twin(ids))
