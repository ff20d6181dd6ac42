"""Step metrics of the masks, as logged by the trainer and the workers (README, "Metrics"), and the check that the
entropies reaching them are float32."""

from __future__ import annotations

import math
import sys

import torch
from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_weights

_WARNED: set[str] = set()


def check_entropy_dtype(entropy: torch.Tensor, where: str) -> None:
    """One line on stderr, once per process and place, if ``entropy`` is not float32. The S2T rule compares
    entropies with a quantile of themselves: in bfloat16 they tie at τ_h and the strict ``H < τ_h`` silences fewer
    than the rule's q (:mod:`stapo.train.verl_patches`)."""
    if entropy.dtype != torch.float32 and where not in _WARNED:
        _WARNED.add(where)
        print(
            f"STAPO WARNING: {where}: entropies arrive as {entropy.dtype}, not float32; ties at the entropy quantile "
            "make the mask silence fewer tokens than the rule (compare s2t/silenced_share with s2t/expected_share)",
            file=sys.stderr,
            flush=True,
        )


def mask_metrics(stats: dict) -> dict[str, float]:
    """``stapo/*``: what the applied mask (S2T or 20-Entropy) did, from the stats of :mod:`stapo.s2t` /
    :mod:`stapo.batch_mask`: counts, and fractions of all response tokens of the step."""
    tokens = max(stats["tokens"], 1)
    metrics = {
        "stapo/masked_tokens": float(stats["masked"]),
        "stapo/masked_frac": stats["masked"] / tokens,
        "stapo/kept_frac": 1.0 - stats["masked"] / tokens,
        "stapo/entropy_threshold": stats["entropy_threshold"],
    }
    if "candidates" in stats:
        metrics["stapo/candidate_tokens"] = float(stats["candidates"])
        metrics["stapo/candidate_frac"] = stats["candidates"] / tokens
        metrics["stapo/expected_masked_tokens"] = float(stats["expected_masked"])
        for name in ("pos_adv", "low_prob", "low_entropy"):
            metrics[f"stapo/{name}_frac"] = stats[name] / tokens
    return metrics


def s2t_metrics(stats: dict) -> dict[str, float]:
    """``s2t/*``: the S2T rule at the old policy on the step's batch, applied (STAPO) or only observed (the
    baselines), and the paper's gradient-norm lower bound (:func:`stapo.s2t.grad_norm_lower_bound`) over three sets
    of response tokens: the spurious ones (those S2T silences), all candidates (Â > 0, p < τ_p; they include the
    spurious ones) and the other tokens. ``spurious_share`` is the spurious tokens' part of the step's summed bound.
    ``silenced_share`` is the spurious tokens' share of the candidates, ``expected_share`` the share the rule gives
    when the entropies are distinct (Σ ⌈q(k−1)⌉ over the step's quantile pools, about q): the two differ by ties at
    τ_h. ``pos_adv_tokens`` counts the tokens of positive-advantage responses and ``spurious_per_pos_adv`` is the
    spurious tokens' share of them, comparable between the arms of an experiment (issue 39). A mean or share over an
    empty set is NaN."""
    tokens, candidates, spurious = stats["tokens"], stats["candidates"], stats["masked"]
    total, cand, spur = stats["bound_total"], stats["bound_candidates"], stats["bound_silenced"]
    return {
        "s2t/pos_adv_tokens": float(stats["pos_adv"]),
        "s2t/candidate_tokens": float(candidates),
        "s2t/spurious_tokens": float(spurious),
        "s2t/spurious_per_pos_adv": _ratio(spurious, stats["pos_adv"]),
        "s2t/candidate_frac": candidates / max(tokens, 1),
        "s2t/spurious_frac": spurious / max(tokens, 1),
        "s2t/silenced_share": _ratio(spurious, candidates),
        "s2t/expected_share": _ratio(stats["expected_masked"], candidates),
        "s2t/grad_bound/spurious_mean": _ratio(spur, spurious),
        "s2t/grad_bound/candidate_mean": _ratio(cand, candidates),
        # a sum of non-negative terms: the float32 total minus the float64 candidates can round below 0 where the
        # other tokens' advantages are all 0 (late in a run), which made the candidate/other ratio negative
        "s2t/grad_bound/other_mean": _ratio(max(total - cand, 0.0), tokens - candidates),
        "s2t/grad_bound/spurious_share": _ratio(spur, total),
    }


def observed_metrics(stats: dict) -> dict[str, float]:
    """``s2t/observed/*``: the S2T rule's counts at ``stapo.observe_tau_p`` (its candidates and the tokens it would
    silence), beside ``s2t/*`` at ``stapo.tau_p``; with ``s2t/pos_adv_tokens`` they give the spurious share among
    positive-advantage tokens at the second threshold. Counts only, so that several local updates add up
    (:func:`step_metrics`)."""
    return {
        "s2t/observed/candidate_tokens": float(stats["candidates"]),
        "s2t/observed/spurious_tokens": float(stats["masked"]),
    }


def step_metrics(updates: list[dict]) -> dict[str, float]:
    """The ``stapo/*`` and ``s2t/*`` metrics of a step made of several local updates, as one update of the whole
    batch would log them. ``updates``: per local update, the stats behind :func:`mask_metrics` (``"mask"``) and
    :func:`s2t_metrics` (``"s2t"``), either absent when not computed, and the update's logged token counts
    (``"counts"``, e.g. the workers' ``stapo/masked_tokens`` with ``policy_source: current``).

    Why: with ``parameter_sync_step`` > 1 (``separate_async``) verl 0.9.1 runs that many local updates per step, one
    mini-batch each, and its ``MetricsAggregator`` reduces every key it does not know by a sample-weighted mean: the
    counts would be per-update means, and shares a mean of per-update shares. Here counts add up and shares are taken
    of the sums; ``stapo/entropy_threshold`` is the mean of the updates' finite thresholds (one pool each)."""
    found: dict[str, float] = {}
    for key, metrics in (("mask", mask_metrics), ("s2t", s2t_metrics)):
        parts = [u[key] for u in updates if u.get(key)]
        if parts:
            found.update(metrics(sum_stats(parts)))
    counts = [u.get("counts", {}) for u in updates]
    for key in {k for c in counts for k in c} - found.keys():
        found[key] = float(sum(c.get(key, 0.0) for c in counts))
    return found


def sum_stats(parts: list[dict]) -> dict:
    """Stats of several mask computations (:func:`stapo.batch_mask.mask_for_update` and ``grad_bound_sums``) as one:
    counts and sums added, per-pool lists joined, ``entropy_threshold`` the mean of the finite ones (NaN if none)."""
    total = {}
    for key in parts[0]:
        values = [part[key] for part in parts]
        if key == "entropy_threshold":
            finite = [v for v in values if math.isfinite(v)]
            total[key] = sum(finite) / len(finite) if finite else math.nan
        elif isinstance(values[0], list):
            total[key] = [x for v in values for x in v]
        else:
            total[key] = sum(values)
    return total


def _ratio(a: float, b: float) -> float:
    return a / b if b else math.nan


MISMATCH_KEYS = (
    "s2t/mismatch/candidate_logp",
    "s2t/mismatch/other_logp",
    "s2t/mismatch/candidate_p",
    "s2t/mismatch/spurious_logp",
    "s2t/mismatch/kept_candidate_logp",
    "s2t/mismatch/spurious_is_weight",
    "s2t/mismatch/kept_candidate_is_weight",
)


def mismatch_metrics(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    tau_p: float,
    spurious: torch.Tensor,
) -> dict[str, float]:
    """``s2t/mismatch/*``: how far vLLM's log-probability of each sampled token (the rollout's) is from the trainer's
    (π_old, which S2T compares with τ_p), as the mean of |log π_old − log π_rollout| over the S2T candidates
    (Â > 0, p < τ_p) and over the other response tokens, and the candidates' mean |π_old − π_rollout|. S2T silences
    exactly the low-probability tokens, where a bfloat16 rollout is least exact: the mismatch there is a rival
    explanation of any effect of the mask (issue 39). Split by the S2T rule (``spurious``: the tokens it silences, or
    would silence in a baseline): the mean log-probability gap over the spurious tokens and over the candidates it
    keeps, and the mean weight verl's token-level truncated importance sampling would give each set (π_old / π_rollout
    capped at verl 0.9.1's default ``rollout_is_threshold``, 2: :func:`verl.trainer.ppo.rollout_corr_helper.
    compute_rollout_correction_weights`): whether the tokens S2T silences are those rollout correction down-weights.
    Jagged or padded tensors of one layout (``spurious`` like ``response_mask``, or its ``values()``); NaN over an
    empty set."""
    flat = [t.values() if t.is_nested else t.reshape(-1) for t in (old_log_probs, rollout_log_probs, advantages)]
    valid = (response_mask.values() if response_mask.is_nested else response_mask.reshape(-1)) != 0
    flagged = spurious.reshape(-1)
    if len({t.numel() for t in flat} | {valid.numel(), flagged.numel()}) > 1:  # a layout it does not know: no crash
        if "mismatch" not in _WARNED:
            _WARNED.add("mismatch")
            print("STAPO WARNING: rollout_log_probs and old_log_probs differ in layout; s2t/mismatch/* are NaN",
                  file=sys.stderr, flush=True)  # fmt: skip
        return dict.fromkeys(MISMATCH_KEYS, math.nan)
    old, rollout, adv = (t.double() for t in flat)
    candidates = valid & (adv > 0) & (old < math.log(tau_p))
    flagged, kept = flagged & candidates, candidates & ~flagged
    log_ratio = old - rollout
    gap = log_ratio.abs()
    spurious_weight = kept_weight = math.nan
    if candidates.any():  # the candidates' weights only (token-level: each its own); verl refuses an empty set
        ratio = log_ratio[candidates][None]
        weights, among = compute_rollout_correction_weights(ratio, torch.ones_like(ratio))[0][0], flagged[candidates]
        spurious_weight, kept_weight = _mean(weights[among]), _mean(weights[~among])
    return dict(zip(MISMATCH_KEYS, (
        _mean(gap[candidates]),
        _mean(gap[valid & ~candidates]),
        _mean((old.exp() - rollout.exp()).abs()[candidates]),
        _mean(gap[flagged]),
        _mean(gap[kept]),
        spurious_weight,
        kept_weight,
    )))  # fmt: skip


def _mean(values: torch.Tensor) -> float:
    return float(values.mean()) if values.numel() else math.nan
