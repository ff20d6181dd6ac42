"""The driver's whole-batch engine (stapo/batch_mask.py) equals the readable reference (stapo/s2t.py) applied to each
mini-batch separately, on many random batches: ties at the threshold, NaN entropies, groups without candidates,
interior zeros of the mask, bfloat16 inputs, padded and jagged layouts."""

import math

import pytest
import torch

from stapo.batch_mask import grad_bound_sums, mask_for_update
from stapo.s2t import grad_norm_lower_bound, s2t_mask, top_entropy_mask


def random_batch(seed, rows=12, width=9, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, width + 1, (rows,), generator=gen)
    mask = (torch.arange(width)[None, :] < lens[:, None]).long()
    mask[0, 0] = 0  # an interior zero, as multi-turn masks have
    log_probs = torch.log(torch.rand(rows, width, generator=gen) * 0.004)  # about half below 0.002
    # entropies on a coarse grid: many exact ties, also at the thresholds
    entropy = torch.randint(0, 6, (rows, width), generator=gen).float() / 4
    entropy[torch.rand(rows, width, generator=gen) < 0.05] = math.nan
    advantages = torch.randn(rows, 1, generator=gen).expand(rows, width) * mask
    advantages[rows // 2 :] = -advantages[rows // 2 :].abs()  # the last group has no candidate
    return [x.to(dtype) for x in (log_probs, entropy, advantages)] + [mask], lens.tolist()


GROUPS = [torch.tensor([0, 5, 3, 2]), torch.tensor([1, 4]), torch.tensor([6, 7, 8, 9, 10, 11])]


def reference(method, tensors, groups, tau_p, q, ratio, silence="low_entropy"):
    """The reference, one call per group: the silenced tokens, summed stats (S2T: with the per-group lists of
    candidates and silenced tokens), the groups' thresholds and the gradient-bound sums."""
    log_probs, entropy, advantages, mask = tensors
    silenced = torch.zeros_like(mask, dtype=torch.bool)
    totals, thresholds = {}, []
    for g, rows in enumerate(groups):
        rows = rows.sort().values  # the engine's pool order: the batch's (matters to the ablations only)
        if method == "s2t":
            args = (log_probs[rows], entropy[rows], advantages[rows], mask[rows], tau_p, q)
            keep, stats = s2t_mask(*args, silence=silence, seed=7 + g)
        else:
            keep, stats = top_entropy_mask(entropy[rows], mask[rows], ratio)
        silenced[rows] = (mask[rows] != 0) & (keep == 0)
        thresholds.append(stats.pop("entropy_threshold"))
        if method == "s2t":
            stats.update(pool_candidates=[stats["candidates"]], pool_masked=[stats["masked"]])
        totals = {k: totals.get(k, [] if k.startswith("pool_") else 0) + v for k, v in stats.items()}
    bound = grad_norm_lower_bound(log_probs, entropy, advantages).double() * (mask != 0)
    candidates = (mask != 0) & (advantages > 0) & (log_probs.float() < math.log(tau_p))
    sums = {k: float(bound[m].nansum()) for k, m in (("silenced", silenced), ("candidates", candidates))}
    sums["total"] = float(bound.nansum())
    return silenced, totals, thresholds, sums


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("method", ["s2t", "top_entropy"])
@pytest.mark.parametrize("seed", range(25))
def test_engine_equals_the_reference_per_group(seed, method, dtype):
    tensors, lens = random_batch(seed, dtype=dtype)
    tau_p, q, ratio = 0.002, [0.0, 0.5, 0.75, 1.0][seed % 4], [0.2, 0.5, 1.0][seed % 3]
    groups = GROUPS if seed % 5 else None
    silenced, totals, thresholds, sums = reference(method, tensors, groups or [torch.arange(12)], tau_p, q, ratio)
    for layout in ("padded", "nested"):
        if layout == "nested":
            inputs = [torch.nested.as_nested_tensor([x[i, :n] for i, n in enumerate(lens)], layout=torch.jagged)
                      for x in tensors]  # fmt: skip
            expected = torch.cat([silenced[i, :n] for i, n in enumerate(lens)])
        else:
            inputs, expected = tensors, silenced
        got, stats = mask_for_update(method, *inputs, groups, tau_p=tau_p, q=q, top_entropy_ratio=ratio)
        assert torch.equal(got, expected), layout
        for key, value in totals.items():
            assert stats[key] == value, (layout, key)
        finite = [t for t in thresholds if not math.isnan(t)]
        assert stats["entropy_threshold"] == pytest.approx(
            sum(finite) / len(finite) if finite else math.nan, nan_ok=True
        )
        if method == "s2t":
            bounds = grad_bound_sums(*inputs, got, tau_p=tau_p)
            for key, value in sums.items():
                assert bounds[f"bound_{key}"] == pytest.approx(value, rel=1e-5, abs=1e-9), (layout, key)


@pytest.mark.parametrize("silence", ["high_entropy", "random"])
@pytest.mark.parametrize("seed", range(10))
def test_the_ablations_equal_the_reference_per_group(seed, silence):
    """STAPO's masking-strategy ablations: per group as many silenced as S2T, the highest-entropy candidates or a
    random draw, the same as the reference's on each group (seeded 7 + g)."""
    tensors, _ = random_batch(seed)
    groups = GROUPS if seed % 3 else None
    expected, totals, _, _ = reference("s2t", tensors, groups or [torch.arange(12)], 0.002, 0.75, 1.0, silence)
    low, _, _, _ = reference("s2t", tensors, groups or [torch.arange(12)], 0.002, 0.75, 1.0)
    got, stats = mask_for_update("s2t", *tensors, groups, silence=silence, seed=7)
    assert torch.equal(got, expected) and stats["pool_masked"] == totals["pool_masked"]
    assert stats["masked"] == int(low.sum()) and stats["candidates"] == totals["candidates"]
    if silence == "high_entropy" and stats["masked"]:  # every chosen entropy >= every unchosen candidate's
        log_probs, entropy, advantages, mask = tensors
        candidates = (mask != 0) & (advantages > 0) & (log_probs < math.log(0.002)) & ~torch.isnan(entropy)
        if groups is None and (candidates & ~got).any():
            assert entropy[got].min() >= entropy[candidates & ~got].max()


def test_random_ablation_draws_differ_by_seed_and_repeat_with_it():
    tensors, _ = random_batch(3)
    draws = [mask_for_update("s2t", *tensors, None, silence="random", seed=s)[0] for s in (0, 0, 1, 2)]
    assert torch.equal(draws[0], draws[1]) and not all(torch.equal(draws[0], d) for d in draws[2:])
    assert len({int(d.sum()) for d in draws}) == 1


def test_a_group_without_candidates_has_no_threshold_and_silences_nothing():
    tensors, _ = random_batch(0)
    silenced, stats = mask_for_update("s2t", *(x[6:] for x in tensors), None, tau_p=0.002, q=0.75)  # Â <= 0 only
    assert stats["candidates"] == 0 and stats["masked"] == 0 and math.isnan(stats["entropy_threshold"])
    assert not silenced.any() and stats["low_prob"] > 0


def test_one_quantile_per_group_not_per_batch():
    # Row 0 entropies 0.1..0.5, row 1 entropies 1.1..1.5: per row the bottom three go; over the whole batch the
    # 0.75-quantile is 1.275 and all of row 0 goes.
    ent = torch.tensor([[0.1, 0.2, 0.3, 0.4, 0.5], [1.1, 1.2, 1.3, 1.4, 1.5]])
    args = ("s2t", torch.full((2, 5), math.log(0.001)), ent, torch.ones(2, 5), torch.ones(2, 5, dtype=torch.long))
    silenced, stats = mask_for_update(*args, [torch.tensor([0]), torch.tensor([1])])
    assert (~silenced).long().tolist() == [[0, 0, 0, 1, 1], [0, 0, 0, 1, 1]]
    assert stats["masked"] == 6 and stats["entropy_threshold"] == pytest.approx(0.9)
    assert stats["pool_candidates"] == [5, 5] and stats["pool_masked"] == [3, 3] and stats["expected_masked"] == 6
    silenced, stats = mask_for_update(*args, None)
    assert (~silenced).long().tolist() == [[0, 0, 0, 0, 0], [0, 0, 1, 1, 1]]
    assert stats["masked"] == stats["expected_masked"] == 7 == math.ceil(0.75 * 9)  # distinct entropies
    with pytest.raises(ValueError, match="unknown mask method"):
        mask_for_update("random", *args[1:], None)
