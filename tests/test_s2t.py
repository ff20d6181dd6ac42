"""The pure mask functions against hand-computed cases (stapo/s2t.py)."""

import math

import pytest
import torch

from stapo.s2t import entropy_quantile, mask_for_update, s2t_mask, top_entropy_mask


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


def test_mask_for_update_uses_one_quantile_per_group():
    # Row 0 entropies 0.1..0.5, row 1 entropies 1.1..1.5: per row the bottom three are masked,
    # over the whole batch the 0.75-quantile is 1.275 and every token of row 0 goes.
    ent = t([[0.1, 0.2, 0.3, 0.4, 0.5], [1.1, 1.2, 1.3, 1.4, 1.5]])
    args = ("s2t", lp([[0.001] * 5] * 2), ent, t([[1.0] * 5] * 2), t([[1] * 5] * 2, torch.int64))
    silenced, metrics = mask_for_update(*args, [torch.tensor([0]), torch.tensor([1])])
    assert (~silenced).long().tolist() == [[0, 0, 0, 1, 1], [0, 0, 0, 1, 1]]
    assert metrics["stapo/masked_tokens"] == 6 and metrics["stapo/masked_frac"] == pytest.approx(0.6)
    assert metrics["stapo/candidate_frac"] == 1.0 and metrics["stapo/entropy_threshold"] == pytest.approx(0.9)
    silenced, metrics = mask_for_update(*args, None)
    assert (~silenced).long().tolist() == [[0, 0, 0, 0, 0], [0, 0, 1, 1, 1]]
    assert metrics["stapo/low_entropy_frac"] == pytest.approx(0.7)
    assert set(metrics) >= {
        "stapo/masked_frac",
        "stapo/candidate_frac",
        "stapo/masked_tokens",
        "stapo/entropy_threshold",
        "stapo/pos_adv_frac",
        "stapo/low_prob_frac",
        "stapo/low_entropy_frac",
        "stapo/kept_frac",
    }
    _, metrics = mask_for_update("top_entropy", *args[1:], None)
    assert metrics["stapo/kept_frac"] == pytest.approx(0.2)
    with pytest.raises(ValueError, match="unknown mask method"):
        mask_for_update("random", *args[1:], None)


def random_batch(seed, rows=12, width=9):
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, width + 1, (rows,), generator=gen)
    mask = (torch.arange(width)[None, :] < lens[:, None]).long()
    mask[0, 0] = 0  # an interior zero, as multi-turn masks have
    log_probs = torch.log(torch.rand(rows, width, generator=gen) * 0.004)  # about half below 0.002
    entropy = torch.rand(rows, width, generator=gen)
    advantages = torch.randn(rows, 1, generator=gen).expand(rows, width) * mask
    return log_probs, entropy, advantages, mask, lens.tolist()


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("method", ["s2t", "top_entropy"])
def test_batch_path_equals_the_single_mask_on_each_group(seed, method):
    """mask_for_update (whole batch at once, padded or nested) == s2t_mask / top_entropy_mask per group."""
    log_probs, entropy, advantages, mask, lens = random_batch(seed)
    groups = [torch.tensor([0, 5, 7, 2]), torch.tensor([1, 3, 4, 6]), torch.tensor([8, 9, 10, 11])]
    silenced, metrics = mask_for_update(method, log_probs, entropy, advantages, mask, groups, tau_p=0.002, q=0.6)
    expected, masked, thresholds = mask.clone(), 0, []
    for rows in groups:
        if method == "s2t":
            keep, stats = s2t_mask(log_probs[rows], entropy[rows], advantages[rows], mask[rows], 0.002, 0.6)
        else:
            keep, stats = top_entropy_mask(entropy[rows], mask[rows], 0.2)
        expected[rows] = keep
        masked += stats["masked"]
        thresholds.append(stats["entropy_threshold"])
    assert torch.equal(mask * ~silenced, expected)
    assert metrics["stapo/masked_tokens"] == masked > 0
    finite = [x for x in thresholds if not math.isnan(x)]  # a group without candidates has no threshold
    assert metrics["stapo/entropy_threshold"] == pytest.approx(sum(finite) / len(finite))

    as_nested = [
        torch.nested.as_nested_tensor([x[i, :n] for i, n in enumerate(lens)], layout=torch.jagged)
        for x in (log_probs, entropy, advantages, mask)
    ]
    flat_silenced, flat_metrics = mask_for_update(method, *as_nested, groups, tau_p=0.002, q=0.6)
    assert torch.equal(flat_silenced, torch.cat([silenced[i, :n] for i, n in enumerate(lens)]))
    assert flat_metrics == pytest.approx(metrics, nan_ok=True)


@pytest.mark.parametrize("nested", [False, True])
def test_mask_for_update_takes_bfloat16_inputs(nested):
    """verl can store old log-probs and entropies in bfloat16 (seen with the FSDP engine on CPU): same mask as
    their float32 values."""
    log_probs, entropy, advantages, mask, lens = random_batch(3)
    low = [x.bfloat16() for x in (log_probs, entropy, advantages)]
    wide = [x.float() for x in low]
    if nested:

        def jagged(x):
            return torch.nested.as_nested_tensor([x[i, :n] for i, n in enumerate(lens)], layout=torch.jagged)

        low, wide, mask = [jagged(x) for x in low], [jagged(x) for x in wide], jagged(mask)
    groups = [torch.arange(6), torch.arange(6, 12)]
    silenced, metrics = mask_for_update("s2t", *low, mask, groups, tau_p=0.002, q=0.6)
    expected, expected_metrics = mask_for_update("s2t", *wide, mask, groups, tau_p=0.002, q=0.6)
    assert torch.equal(silenced, expected) and metrics == pytest.approx(expected_metrics, nan_ok=True)
    assert metrics["stapo/masked_tokens"] > 0
