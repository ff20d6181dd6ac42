"""The reference functions of the method (stapo/s2t.py) against hand-computed cases and autograd."""

import math

import pytest
import torch

from stapo.s2t import entropy_quantile, grad_norm_lower_bound, s2t_mask, top_entropy_mask


def lp(probs):
    return torch.log(torch.tensor(probs, dtype=torch.float32))


def t(x, dtype=torch.float32):
    return torch.tensor(x, dtype=dtype)


# One positive-advantage row of 5 tokens, all with p = 0.001 < τ_p: every token is a candidate.
# Entropies 0.1 .. 0.5: the 0.75-quantile is 0.4 (linear: position 3 of 0..4), so 0.1, 0.2, 0.3 are masked.
ENT = [[0.1, 0.2, 0.3, 0.4, 0.5]]
ALL_LOW = lp([[0.001] * 5])
POS = t([[1.0] * 5])
ONES = t([[1] * 5], torch.int64)


def test_basic_case_masks_bottom_q_of_candidates():
    keep, stats = s2t_mask(ALL_LOW, t(ENT), POS, ONES)
    assert keep.tolist() == [[0, 0, 0, 1, 1]]
    assert keep.dtype == ONES.dtype
    assert stats["candidates"] == 5 and stats["masked"] == 3 and stats["tokens"] == 5
    assert stats["entropy_threshold"] == pytest.approx(0.4, abs=1e-6)


def test_each_condition_is_required():
    probs = [[0.001, 0.5, 0.001, 0.001, 0.001]]  # token 1 is not rare
    ent = [[0.1, 0.1, 0.9, 0.2, 0.3]]
    keep, stats = s2t_mask(lp(probs), t(ent), POS, ONES)
    # candidates: tokens 0, 2, 3, 4 with entropies 0.1, 0.9, 0.2, 0.3; q=0.75 -> 0.3 + 0.25*(0.9-0.3) = 0.45
    assert stats["candidates"] == 4
    assert stats["entropy_threshold"] == pytest.approx(0.45, abs=1e-6)
    assert keep.tolist() == [[0, 1, 1, 0, 0]]  # token 1 kept (p >= τ_p) although its entropy is low
    # negative and zero advantages are never masked
    for adv in (-1.0, 0.0):
        keep, stats = s2t_mask(lp(probs), t(ent), t([[adv] * 5]), ONES)
        assert keep.tolist() == ONES.tolist() and stats["candidates"] == 0 and stats["masked"] == 0


def test_no_candidates_returns_response_mask_and_nan_threshold():
    mask = t([[1, 1, 0, 0, 0]], torch.int64)
    keep, stats = s2t_mask(lp([[0.9] * 5]), t(ENT), POS, mask)
    assert torch.equal(keep, mask)
    assert stats["candidates"] == 0 and stats["masked"] == 0
    assert math.isnan(stats["entropy_threshold"])


def test_q_zero_masks_nothing_and_q_one_masks_all_but_the_maximum():
    keep0, stats0 = s2t_mask(ALL_LOW, t(ENT), POS, ONES, q=0.0)
    assert keep0.tolist() == [[1] * 5] and stats0["entropy_threshold"] == pytest.approx(0.1, abs=1e-6)
    keep1, stats1 = s2t_mask(ALL_LOW, t(ENT), POS, ONES, q=1.0)
    assert keep1.tolist() == [[0, 0, 0, 0, 1]] and stats1["entropy_threshold"] == pytest.approx(0.5, abs=1e-6)


def test_ties_at_the_threshold_are_kept():
    ent = [[0.2, 0.2, 0.2, 0.2, 0.1]]  # 0.75-quantile = 0.2: only the strict-below 0.1 is masked
    keep, stats = s2t_mask(ALL_LOW, t(ent), POS, ONES)
    assert keep.tolist() == [[1, 1, 1, 1, 0]] and stats["masked"] == 1


def test_padding_is_neither_candidate_nor_kept():
    mask = t([[1, 1, 1, 0, 0]], torch.int64)
    ent = [[0.1, 0.2, 0.3, 0.0, 0.0]]  # padded positions carry garbage that must not enter the quantile
    keep, stats = s2t_mask(ALL_LOW, t(ent), POS, mask)
    # candidates 0.1, 0.2, 0.3 -> τ_h = 0.25 -> 0.1, 0.2 masked
    assert stats["tokens"] == 3 and stats["candidates"] == 3
    assert stats["entropy_threshold"] == pytest.approx(0.25, abs=1e-6)
    assert keep.tolist() == [[0, 0, 1, 0, 0]]


def test_bool_response_mask_gives_bool_keep():
    keep, _ = s2t_mask(ALL_LOW, t(ENT), POS, ONES.bool())
    assert keep.dtype == torch.bool and keep.tolist() == [[False, False, False, True, True]]


def test_nan_entropy_never_masks_and_never_poisons_the_threshold():
    ent = [[0.1, float("nan"), 0.3, 0.4, 0.5]]
    keep, stats = s2t_mask(ALL_LOW, t(ent), POS, ONES)
    # finite candidate entropies 0.1, 0.3, 0.4, 0.5 -> 0.4 + 0.25*0.1 = 0.425
    assert stats["entropy_threshold"] == pytest.approx(0.425, abs=1e-6)
    assert keep.tolist() == [[0, 1, 0, 0, 1]]  # the NaN token is kept; 0.4 < 0.425 goes
    keep, stats = s2t_mask(ALL_LOW, t([[float("nan")] * 5]), POS, ONES)
    assert keep.tolist() == ONES.tolist() and math.isnan(stats["entropy_threshold"])


@pytest.mark.parametrize("tau_p", [0.0, -0.1, 1.5, float("nan")])
def test_bad_tau_p(tau_p):
    with pytest.raises(ValueError, match="tau_p"):
        s2t_mask(ALL_LOW, t(ENT), POS, ONES, tau_p=tau_p)


@pytest.mark.parametrize("q", [-0.01, 1.01, float("nan")])
def test_bad_q(q):
    with pytest.raises(ValueError, match="q must be"):
        s2t_mask(ALL_LOW, t(ENT), POS, ONES, q=q)


def test_tau_p_one_makes_every_positive_token_a_candidate():
    _, stats = s2t_mask(lp([[0.999] * 5]), t(ENT), POS, ONES, tau_p=1.0)
    assert stats["candidates"] == 5


def test_quantile_matches_torch_quantile():
    gen = torch.Generator().manual_seed(0)
    for n in (1, 2, 7, 1000):
        values = torch.rand(n, generator=gen)
        for q in (0.0, 0.1, 0.5, 0.75, 1.0):
            assert entropy_quantile(values, q) == pytest.approx(torch.quantile(values.double(), q).item(), abs=1e-12)


def test_top_entropy_keeps_top_ratio():
    ent = t([[0.5, 0.1, 0.9, 0.3, 0.7], [0.2, 0.8, 0.4, 0.6, 0.0]])
    mask = t([[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]], torch.int64)  # 9 tokens: ceil(0.2*9) = 2 kept
    keep, stats = top_entropy_mask(ent, mask, ratio=0.2)
    assert keep.tolist() == [[0, 0, 1, 0, 0], [0, 1, 0, 0, 0]]
    assert stats == {"tokens": 9, "kept": 2, "masked": 7, "entropy_threshold": pytest.approx(0.8)}
    keep, _ = top_entropy_mask(ent, mask, ratio=1.0)
    assert torch.equal(keep, mask)
    with pytest.raises(ValueError, match="ratio"):
        top_entropy_mask(ent, mask, ratio=0.0)


@pytest.mark.parametrize("vocab", [2, 17, 1000])
def test_grad_norm_bound_against_autograd(vocab):
    """The paper's Theorem "Policy Gradient Norm Bounds": ‖∇_a (w · log π(y))‖² = w²(1 − 2π + Σπ²)
    ≥ w²(1 − 2π + e^{−H}), checked with autograd on random logits (peaked and flat), sampled tokens and advantages."""
    gen = torch.Generator().manual_seed(vocab)
    for scale in (0.1, 1.0, 8.0):
        logits = (scale * torch.randn(64, vocab, generator=gen, dtype=torch.float64)).requires_grad_()
        tokens = torch.randint(vocab, (64,), generator=gen)
        w = torch.randn(64, generator=gen, dtype=torch.float64)
        log_pi = torch.log_softmax(logits, -1)
        (grad,) = torch.autograd.grad((w * log_pi[torch.arange(64), tokens]).sum(), logits)
        exact = grad.square().sum(-1)  # each row's objective depends on its own logits only
        pi = log_pi.exp()
        entropy = -(pi * log_pi).sum(-1)
        chosen = log_pi[torch.arange(64), tokens]
        assert torch.allclose(exact, w**2 * (1 - 2 * chosen.exp() + pi.square().sum(-1)))  # the decomposition
        bound = grad_norm_lower_bound(chosen.detach(), entropy.detach(), w)
        assert bound.dtype == torch.float32 and bound.shape == (64,)
        assert torch.all(bound.double() <= exact * (1 + 1e-5) + 1e-6)
    # equality for a flat distribution, where Σπ² = e^{-H} = 1/V
    bound = grad_norm_lower_bound(
        torch.tensor([-math.log(vocab)]), torch.tensor([math.log(vocab)]), torch.tensor([2.0])
    )
    assert bound.item() == pytest.approx(4 * (1 - 2 / vocab + 1 / vocab), rel=1e-5)


def test_ablations_silence_as_many_candidates_chosen_otherwise():
    """STAPO v4, "Ablation and Sensitivity Analysis": high-entropy and random masking silence as many candidates as
    S2T (here 3 of 5)."""
    from stapo.s2t import ablation_choice

    keep, stats = s2t_mask(ALL_LOW, t(ENT), POS, ONES, silence="high_entropy")
    assert (
        keep.tolist() == [[1, 1, 0, 0, 0]] and stats["masked"] == 3 and stats["entropy_threshold"] == pytest.approx(0.4)
    )
    draws = {tuple(s2t_mask(ALL_LOW, t(ENT), POS, ONES, silence="random", seed=s)[0][0].tolist()) for s in range(20)}
    assert len(draws) > 1 and all(sum(d) == 2 for d in draws)
    pool = t([0.1, 0.5, math.nan, 0.3])
    assert ablation_choice(pool, 2, "high_entropy").tolist() == [1, 3]  # NaN never chosen
    assert sorted(ablation_choice(pool, 5, "random", seed=1).tolist()) == [0, 1, 3]
    with pytest.raises(ValueError, match="unknown ablation"):
        ablation_choice(pool, 1, "low")
