"""Prompt samplers: the UCB curriculum over data sources (probabilities, windows,
epochs per source, exact resume) and the config that chooses it."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from omni_rl.config import FieldError
from omni_rl.data.config import SamplerConfig
from omni_rl.data.sampler import PromptSampler, SourceUCBSampler, ucb_probabilities
from omni_rl.errors import ConfigError, OmniRLError
from omni_rl.recipe_loader import config_from_dict


def test_ucb_probabilities_match_a_hand_computation():
    # source a: mean |A| 0.5 over 3 draws; b: 0.1 over 1; N = 4 draws, c = 1, tau = 0.1
    # bonus a = sqrt(2 ln 5 / 4) = 0.897061, b = sqrt(2 ln 5 / 2) = 1.268636
    # scores 1.397061 and 1.368636; p_a = 1 / (1 + exp((1.368636 - 1.397061) / 0.1)) = 0.570588
    p = ucb_probabilities([0.5, 0.1], [3, 1], 4, c=1.0, temperature=0.1)
    assert p.tolist() == pytest.approx([0.570588, 0.429412], abs=1e-6)
    # without the bonus the softmax of the means alone: exp(5) / (exp(5) + exp(1))
    assert ucb_probabilities([0.5, 0.1], [3, 1], 4, c=0.0, temperature=0.1)[0] == pytest.approx(0.982014, abs=1e-6)
    # no draws yet, empty windows: every source alike
    assert ucb_probabilities([0.0, 0.0, 0.0], [0, 0, 0], 0, 1.0, 0.1).tolist() == pytest.approx([1 / 3] * 3)


def test_the_sampler_reads_its_windows_and_counts():
    sampler = SourceUCBSampler(["a", "b", "a", "b"], seed=0, shuffle=True, window=2, c=1.0, temperature=0.1)
    sampler.counts = [3, 1]
    sampler.observe(["a", "a", "a", "b"], [9.0, 0.4, 0.6, 0.1])  # a's window keeps its last 2: mean 0.5
    assert sampler.probabilities().tolist() == pytest.approx([0.570588, 0.429412], abs=1e-6)
    assert sampler.metrics() == pytest.approx({"sampler/prob/a": 0.570588, "sampler/prob/b": 0.429412}, abs=1e-6)


def drive(sampler: SourceUCBSampler, sources: list[str], steps: int, teaches: dict[str, float]) -> list[list[int]]:
    """``steps`` draws of 8 prompts; each completion's |advantage| is its source's value."""
    batches = []
    for _ in range(steps):
        batch = sampler.next_batch(8)
        batches.append(batch)
        drawn = [sources[i] for i in batch for _ in range(4)]  # 4 completions a prompt
        sampler.observe(drawn, [teaches[s] for s in drawn])
    return batches


def test_a_source_that_teaches_nothing_is_drawn_less_and_less():
    sources = ["solved"] * 20 + ["learnable"] * 20
    sampler = SourceUCBSampler(sources, seed=3, shuffle=True, window=300, c=1.0, temperature=0.1)
    start = sampler.metrics()["sampler/prob/solved"]
    batches = drive(sampler, sources, 40, {"solved": 0.0, "learnable": 0.8})
    assert start == pytest.approx(0.5)
    assert sampler.metrics()["sampler/prob/solved"] < 0.1  # the exploration bonus keeps some
    late = Counter(sources[i] for batch in batches[20:] for i in batch)
    assert late["learnable"] > 10 * late["solved"]


def test_each_source_visits_all_its_rows_before_repeating_one():
    sources = ["a"] * 5 + ["b"] * 3
    sampler = SourceUCBSampler(sources, seed=1, shuffle=True, window=10, c=1.0, temperature=0.1)
    seen: dict[str, list[int]] = {"a": [], "b": []}
    for _ in range(6):
        for i in sampler.next_batch(4):
            seen[sources[i]].append(i)
    for name, size in (("a", 5), ("b", 3)):
        drawn = seen[name]
        for start in range(0, len(drawn) - size + 1, size):  # whole epochs: each a permutation
            assert sorted(drawn[start : start + size]) == [i for i, s in enumerate(sources) if s == name]
    unshuffled = SourceUCBSampler(sources, seed=1, shuffle=False, window=10, c=1.0, temperature=0.1)
    order = [i for i in unshuffled.next_batch(16) if sources[i] == "a"]
    assert order[:5] == [0, 1, 2, 3, 4]


def test_a_resumed_sampler_draws_what_the_uninterrupted_one_draws():
    sources = ["x"] * 7 + ["y"] * 5 + ["z"] * 9
    teaches = {"x": 0.1, "y": 0.7, "z": 0.3}
    straight = SourceUCBSampler(sources, seed=5, shuffle=True, window=16, c=1.0, temperature=0.1)
    expected = drive(straight, sources, 12, teaches)
    first = SourceUCBSampler(sources, seed=5, shuffle=True, window=16, c=1.0, temperature=0.1)
    head = drive(first, sources, 6, teaches)
    saved = json.loads(json.dumps(first.state_dict()))  # checkpoints keep it as JSON
    resumed = SourceUCBSampler(sources, seed=5, shuffle=True, window=16, c=1.0, temperature=0.1)
    resumed.load_state_dict(saved)
    assert head + drive(resumed, sources, 6, teaches) == expected
    assert resumed.state_dict() == straight.state_dict() and resumed.drawn == 12 * 8


def test_a_checkpoint_of_another_sampler_or_dataset_is_refused():
    ucb = SourceUCBSampler(["a", "b"], seed=0, shuffle=True, window=4, c=1.0, temperature=0.1)
    uniform = PromptSampler(2, seed=0)
    with pytest.raises(ValueError, match="uniform sampler, not ucb"):
        ucb.load_state_dict(uniform.state_dict())
    with pytest.raises(ValueError, match="ucb sampler, not the uniform one"):
        uniform.load_state_dict(ucb.state_dict())
    other = SourceUCBSampler(["a", "b", "b"], seed=0, shuffle=True, window=4, c=1.0, temperature=0.1)
    with pytest.raises(ValueError, match="different dataset"):
        other.load_state_dict(ucb.state_dict())


def test_ucb_fields_are_refused_under_the_uniform_sampler():
    assert SamplerConfig(type="ucb").setting("window") == 300
    with pytest.raises(FieldError, match="does nothing under type: uniform"):
        SamplerConfig(window=50)
    with pytest.raises(FieldError, match="must be > 0"):
        SamplerConfig(type="ucb", temperature=0.0)


def test_sft_refuses_the_ucb_sampler():
    with pytest.raises(ConfigError, match=r"data\.sampler\.type: ucb learns from GRPO's advantages"):
        config_from_dict({"recipe": "sft", "data": {"train": "x.jsonl", "sampler": {"type": "ucb"}}}, "test")


def test_a_row_without_a_source_is_named(tmp_path):
    from omni_rl.recipes.common import setup_data

    data = tmp_path / "rows.jsonl"
    rows = [{"id": "r0", "problem": "1+1?", "problem_type": "numeric", "answer": "2", "data_source": "math"}]
    rows.append({"id": "r1", "problem": "2+2?", "problem_type": "numeric", "answer": "4"})
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = config_from_dict({"recipe": "grpo", "data": {"train": str(data), "sampler": {"type": "ucb"}}}, "test")
    with pytest.raises(OmniRLError, match=r"rows\.jsonl:2: row 'r1' has no data_source; data\.sampler\.type=ucb"):
        setup_data(cfg, torch.device("cpu"))


def test_the_source_probabilities_are_plotted_together(tmp_path):
    from omni_rl.plots import plot_metrics

    rows = [{"step": s, "sampler/prob/a": 0.5 - 0.1 * s, "sampler/prob/b": 0.5 + 0.1 * s} for s in range(1, 4)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    written = plot_metrics(tmp_path)
    assert [p.name for p in written] == ["sampler_prob.png"] and written[0].stat().st_size > 1000


def test_ranks_that_were_dealt_rows_by_length_feed_the_windows_in_draw_order():
    """One step's four prompts of source a, drawn long, long, short, short: dealing by
    prompt tokens gives rank 0 draws 1 and 3 and rank 1 draws 0 and 2, so the gathered
    advantages come in the order 1, 3, 0, 2. Fed in draw order, the window (which
    keeps the latest values) and the next draw's probabilities are one process's."""
    from omni_rl.recipes.common import balance_by_swaps
    from omni_rl.recipes.grpo import observe_in_draw_order

    dealt = balance_by_swaps([900, 850, 100, 120], [0, 0, 1, 1], 2, 0.05)
    assert dealt == [1, 0, 1, 0]
    ranked = [d for rank in (0, 1) for d in range(4) if dealt[d] == rank]  # gathered in rank order
    magnitude = {0: 0.9, 1: 0.1, 2: 0.5, 3: 0.0}  # |A| of each prompt's two completions
    sources = ["a"] * 6 + ["b"] * 6

    def fed(order: list[int]) -> SourceUCBSampler:
        sampler = SourceUCBSampler(sources, 0, True, window=5, c=1.0, temperature=0.1)
        sampler.next_batch(4)
        drawn = [d for d in order for _ in range(2)]
        observe_in_draw_order(sampler, ["a"] * 8, [magnitude[d] for d in drawn], drawn, ["b", "b"])
        return sampler

    one, two = fed([0, 1, 2, 3]), fed(ranked)
    assert list(one.recent[0]) == [0.1, 0.5, 0.5, 0.0, 0.0] == list(two.recent[0])
    assert list(two.recent[1]) == [0.0, 0.0]
    assert two.probabilities() == pytest.approx(one.probabilities(), abs=0)
