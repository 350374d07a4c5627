"""RL math against values worked out by hand (each comment shows the arithmetic)."""

import math

import pytest
import torch

from omni_rl.algorithms.advantages import (
    ADVANTAGES,
    compute_advantages,
    dr_grpo_advantages,
    grpo_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
)
from omni_rl.algorithms.losses import (
    aggregate,
    clipped_policy_loss,
    entropy_from_logits,
    gspo_policy_loss,
    kl_estimate,
    token_logprobs,
)
from omni_rl.algorithms.sampling import informative_groups, mask_truncated, overlong_penalty

approx = lambda x: pytest.approx(x, abs=1e-5)  # noqa: E731


def test_grpo_advantages():
    # group 1: mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = 0.57735 -> +-0.5 / 0.57735 = +-0.866025
    # group 2: all equal -> 0
    adv = grpo_advantages(torch.tensor([1.0, 0, 0, 1, 2, 2, 2, 2]), group_size=4)
    assert adv.tolist() == approx([0.866025, -0.866025, -0.866025, 0.866025, 0, 0, 0, 0])


@pytest.mark.parametrize("method", ["grpo", "dr_grpo", "rloo", "reinforce_pp"])
@pytest.mark.parametrize("group_size", [4, 5, 6, 8, 12, 16])
def test_a_group_of_equal_rewards_gets_exactly_zero_advantage(method, group_size):
    """Rewards like 0.1 (wrong but well formatted) or 0.7 have no exact float32 mean:
    the members sat one rounding step off it, which GRPO's division by a std of the
    same size blew up (G = 12, all 0.7: +0.106 each). An equal group says nothing."""
    for value in (0.1, 0.7, 0.9):
        equal = torch.full((group_size,), value)
        assert compute_advantages(method, equal, group_size).tolist() == [0.0] * group_size
        # beside an informative group, the equal one is still exactly 0
        mixed = torch.cat([equal, torch.tensor([1.0, 0.0] * (group_size // 2) + [0.5] * (group_size % 2))])
        adv = compute_advantages(method, mixed, group_size)
        assert adv[:group_size].tolist() == [0.0] * group_size
        assert adv[group_size:].abs().max() > 0.1


def test_dr_grpo_advantages_skip_the_std():
    adv = dr_grpo_advantages(torch.tensor([1.0, 0, 0, 1, 2, 2, 2, 2]), group_size=4)
    assert adv.tolist() == approx([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0])


def test_rloo_advantages():
    # r1 = 1: others (0 + 0 + 1) / 3 = 1/3 -> 2/3;  r2 = 0: others (1 + 0 + 1) / 3 = 2/3 -> -2/3
    adv = rloo_advantages(torch.tensor([1.0, 0, 0, 1]), group_size=4)
    assert adv.tolist() == approx([2 / 3, -2 / 3, -2 / 3, 2 / 3])
    with pytest.raises(ValueError):
        rloo_advantages(torch.tensor([1.0]), group_size=1)


def test_reinforce_pp_advantages():
    # centered by group: [0.5, -0.5, 1, -1]; batch mean 0, unbiased std sqrt(2.5 / 3) = 0.912871
    adv = reinforce_pp_advantages(torch.tensor([1.0, 0, 3, 1]), group_size=2)
    assert adv.tolist() == approx([0.547723, -0.547723, 1.095445, -1.095445])


def test_reinforce_pp_whitens_over_the_whole_batch_when_given_in_parts():
    """Two parts of the batch above, each told the other's sums (as ranks are by a
    collective): each part gets the whole batch's advantages, not its own whitening
    (one group alone would give +-0.707107 in both parts)."""
    rewards = torch.tensor([1.0, 0, 3, 1])
    parts = rewards[:2], rewards[2:]

    def plus_sums_of(other):
        centered = dr_grpo_advantages(other, group_size=2).double()
        theirs = [float(centered.numel()), float(centered.sum()), float(centered.pow(2).sum())]
        return lambda ours: [a + b for a, b in zip(ours, theirs, strict=True)]

    first = reinforce_pp_advantages(parts[0], group_size=2, batch_sum=plus_sums_of(parts[1]))
    second = compute_advantages("reinforce_pp", parts[1], 2, batch_sum=plus_sums_of(parts[0]))
    assert [*first.tolist(), *second.tolist()] == approx([0.547723, -0.547723, 1.095445, -1.095445])
    # a part with no groups still sums (a collective stays in step) and gets none
    calls = []
    empty = reinforce_pp_advantages(torch.tensor([]), group_size=2, batch_sum=lambda v: calls.append(v) or v)
    assert empty.tolist() == [] and calls == [[0.0, 0.0, 0.0]]


def test_advantage_registry():
    assert sorted(ADVANTAGES) == ["dr_grpo", "grpo", "reinforce_pp", "rloo"]
    assert compute_advantages("rloo", torch.tensor([1.0, 0]), 2).tolist() == [1.0, -1.0]
    with pytest.raises(ValueError, match="rewards must be"):
        grpo_advantages(torch.tensor([1.0, 0, 1]), group_size=2)


def logs(*ratios):
    return torch.log(torch.tensor([list(ratios)]))


def test_clipped_policy_loss_positive_advantage():
    # ratios 1.5, 0.5, 1.0 with A = +1, clip 0.8..1.2:
    # -A*r = -1.5, -0.5, -1.0; -A*clip(r) = -1.2, -0.8, -1.0; max = -1.2, -0.5, -1.0; mean -0.9
    loss, stats = clipped_policy_loss(logs(1.5, 0.5, 1.0), torch.zeros(1, 3), torch.tensor([1.0]), torch.ones(1, 3))
    assert loss.item() == approx(-0.9)
    assert stats.clip_fraction == approx(1 / 3)  # only the 1.5 token is clipped
    assert stats.ratio_mean == approx(1.0) and stats.ratio_max == approx(1.5)


def test_clipped_policy_loss_negative_advantage_and_dual_clip():
    # A = -1: A*r... -A*r = 1.5, 0.5, 1.0; -A*clip(r) = 1.2, 0.8, 1.0; max = 1.5, 0.8, 1.0; mean 1.1
    loss, stats = clipped_policy_loss(logs(1.5, 0.5, 1.0), torch.zeros(1, 3), torch.tensor([-1.0]), torch.ones(1, 3))
    assert loss.item() == approx(1.1)
    assert stats.clip_fraction == approx(1 / 3)  # the 0.5 token
    # dual clip c = 1.3 bounds the 1.5 token at -A*c = 1.3: (1.3 + 0.8 + 1.0) / 3
    loss, stats = clipped_policy_loss(
        logs(1.5, 0.5, 1.0), torch.zeros(1, 3), torch.tensor([-1.0]), torch.ones(1, 3), dual_clip=1.3
    )
    assert loss.item() == approx(3.1 / 3)
    assert stats.dual_clip_fraction == approx(1 / 3)


def test_clip_higher():
    # eps_high 0.28: ratio 1.5 with A = +1 is clipped at 1.28 -> -1.28
    loss, _ = clipped_policy_loss(logs(1.5), torch.zeros(1, 1), torch.tensor([1.0]), torch.ones(1, 1), 0.2, 0.28)
    assert loss.item() == approx(-1.28)


def test_clipped_policy_loss_as_flow_ppo_uses_it_per_chunk_and_per_element():
    # flow PPO: 2 chunks of 2 action elements, A = +2 and -1, clip 0.8..1.28, each chunk's
    # mean over its elements summed over chunks (denominator 1):
    #   chunk 1, A = +2: r = 1.5, 1.0: -A*r = -3.0, -2.0; -A*clip(r) = -2.56, -2.0; max = -2.56, -2.0
    #   chunk 2, A = -1: r = 0.5, 2.0: -A*r = 0.5, 2.0; -A*clip(r) = 0.8, 1.28; max = 0.8, 2.0
    #   loss = (-2.56 - 2.0) / 2 + (0.8 + 2.0) / 2 = -2.28 + 1.4 = -0.88
    logp, old = logs(1.5, 1.0, 0.5, 2.0).view(2, 2), torch.zeros(2, 2)
    adv, mask = torch.tensor([2.0, -1.0]), torch.ones(2, 2)
    loss, stats = clipped_policy_loss(
        logp, old, adv, mask, 0.2, 0.28, aggregation="seq-mean-token-mean", denominator=1.0
    )
    assert loss.item() == approx(-0.88)
    # the clipped term is active for 1.5 (A > 0, above 1.28) and 0.5 (A < 0, below 0.8);
    # 2.0 lies outside the range too, but with A < 0 its unclipped term is the larger: 2 of 4
    assert stats.clip_fraction == approx(0.5)
    # (r - 1) - log r: 1.5: 0.5 - 0.405465 = 0.094535; 1.0: 0; 0.5: -0.5 + 0.693147 = 0.193147;
    # 2.0: 1 - 0.693147 = 0.306853; mean 0.594535 / 4 = 0.148634
    assert stats.approx_kl == approx(0.148634)
    assert stats.ratio_mean == approx(1.25) and stats.ratio_max == approx(2.0)
    # one ratio per chunk is a row of one element: chunk ratios 1.5 (A = +2) and 0.5 (A = -1):
    # max(-3.0, -2.56) + max(0.5, 0.8) = -2.56 + 0.8 = -1.76, both clipped
    loss, stats = clipped_policy_loss(
        logs(1.5, 0.5).view(2, 1),
        torch.zeros(2, 1),
        adv,
        torch.ones(2, 1),
        0.2,
        0.28,
        aggregation="seq-mean-token-mean",
    )
    assert loss.item() == approx(-1.76 / 2)  # denominator unset: the chunks' own count
    assert stats.clip_fraction == approx(1.0)


def test_policy_loss_gradient_vanishes_when_clipped():
    logp = logs(1.5, 0.9).requires_grad_()
    loss, _ = clipped_policy_loss(logp, torch.zeros(1, 2), torch.tensor([1.0]), torch.ones(1, 2))
    loss.backward()
    # d/dlogp of -A*r/2 at r = 0.9 is -0.45; the clipped 1.5 token gets no gradient
    assert logp.grad.tolist() == [approx([0.0, -0.45])]


def test_aggregations():
    values = torch.tensor([[1.0, 2, 3], [4, 0, 0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    assert aggregate(values, mask, "token-mean").item() == approx(2.5)  # (1+2+3+4) / 4
    assert aggregate(values, mask, "seq-mean-token-mean").item() == approx(3.0)  # (2 + 4) / 2
    assert aggregate(values, mask, "seq-mean-token-sum-norm").item() == approx(5 / 3)  # (6/3 + 4/3) / 2
    assert aggregate(values, mask, "seq-mean-token-sum-norm", norm_length=4).item() == approx(1.25)
    with pytest.raises(ValueError):
        aggregate(values, mask, "mean")


def test_aggregations_of_parts_add_up_to_the_whole():
    """Micro-batches and ranks divide by the whole batch's count: their sum is the whole's."""
    values = torch.tensor([[1.0, 2, 3], [4, 0, 0], [5, 6, 0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0]])
    # token-mean: 6 tokens in all; parts 6/6 and (4+5+6)/6 add up to 21/6
    assert aggregate(values[:1], mask[:1], "token-mean", denominator=6).item() == approx(1.0)
    assert aggregate(values[1:], mask[1:], "token-mean", denominator=6).item() == approx(2.5)
    assert aggregate(values, mask, "token-mean").item() == approx(3.5)
    for mode in ("seq-mean-token-mean", "seq-mean-token-sum-norm"):
        whole = aggregate(values, mask, mode).item()
        parts = sum(aggregate(values[i : i + 1], mask[i : i + 1], mode, denominator=3).item() for i in range(3))
        assert parts == approx(whole)
    # seq-mean-token-mean by hand: (2 + 4 + 5.5) / 3
    assert aggregate(values, mask, "seq-mean-token-mean").item() == approx(11.5 / 3)


def test_gspo_sequence_ratio():
    # log ratios ln 1.5, ln 0.5 -> mean -0.143841 -> s = sqrt(0.75) = 0.866025
    logp, old, mask = logs(1.5, 0.5), torch.zeros(1, 2), torch.ones(1, 2)
    loss, stats = gspo_policy_loss(logp, old, torch.tensor([1.0]), mask, 0.2, 0.2)
    assert loss.item() == approx(-0.866025) and stats.clip_fraction == 0
    # A = -1 with clip 0.9..1.1: max(0.866, 0.9) = 0.9, clipped
    loss, stats = gspo_policy_loss(logp, old, torch.tensor([-1.0]), mask, 0.1, 0.1)
    assert loss.item() == approx(0.9) and stats.clip_fraction == 1.0
    # padding does not count toward the geometric mean
    padded, _ = gspo_policy_loss(
        logs(1.5, 0.5, 9.0), torch.zeros(1, 3), torch.tensor([1.0]), torch.tensor([[1, 1, 0]]), 0.2, 0.2
    )
    assert padded.item() == approx(-0.866025)
    # a sequence with no token left (masked out) counts nowhere, nor in the default count
    loss, stats = gspo_policy_loss(
        logs(1.5, 0.5).repeat(2, 1),
        torch.zeros(2, 2),
        torch.tensor([1.0, 5.0]),
        torch.tensor([[1, 1], [0, 0]]),
        0.2,
        0.2,
    )
    assert loss.item() == approx(-0.866025) and stats.ratio_mean == approx(0.866025)


def test_kl_estimators():
    # pi = 0.5, ref = 0.25: log(pi/ref) = ln 2 = 0.693147
    logp, ref = torch.log(torch.tensor([[0.5]])), torch.log(torch.tensor([[0.25]]))
    assert kl_estimate(logp, ref, "k1").item() == approx(0.693147)
    assert kl_estimate(logp, ref, "k2").item() == approx(0.5 * 0.693147**2)  # 0.240227
    assert kl_estimate(logp, ref, "k3").item() == approx(0.5 - 1 + 0.693147)  # ref/pi - 1 - log(ref/pi)


def test_k3_is_an_unbiased_nonnegative_estimate():
    torch.manual_seed(0)
    p = torch.tensor([0.7, 0.2, 0.1])
    q = torch.tensor([0.4, 0.4, 0.2])
    samples = torch.multinomial(p, 200_000, replacement=True)
    k3 = kl_estimate(torch.log(p[samples]), torch.log(q[samples]), "k3")
    exact = float((p * (p / q).log()).sum())  # 0.1838
    assert (k3 >= 0).all()
    assert k3.mean().item() == pytest.approx(exact, abs=3e-3)


def test_token_logprobs_and_entropy():
    logits = torch.tensor([[[0.0, math.log(3)]]])  # softmax = 0.25, 0.75
    assert token_logprobs(logits, torch.tensor([[1]])).item() == approx(math.log(0.75))
    assert token_logprobs(logits, torch.tensor([[0]])).item() == approx(math.log(0.25))
    # -(0.25 ln 0.25 + 0.75 ln 0.75) = 0.346574 + 0.215762
    assert entropy_from_logits(logits).item() == approx(0.562335)


def test_informative_groups():
    keep = informative_groups(torch.tensor([1.0, 1, 0, 1, 2, 2]), group_size=2)
    assert keep.tolist() == [False, True, False]


def test_overlong_penalty_and_truncation_mask():
    # max 20, buffer 5: free up to 15, then -(len - 15) / 5, capped at -1
    penalty = overlong_penalty(torch.tensor([10, 15, 18, 20, 25]), max_length=20, buffer=5)
    assert penalty.tolist() == approx([0, 0, -0.6, -1, -1])
    mask = mask_truncated(torch.ones(2, 3), torch.tensor([False, True]))
    assert mask.tolist() == [[1, 1, 1], [0, 0, 0]]


def test_advantages_of_an_empty_batch():
    assert grpo_advantages(torch.tensor([]), group_size=4).tolist() == []
    assert dr_grpo_advantages(torch.tensor([]), group_size=4).tolist() == []
