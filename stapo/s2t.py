"""The S2T mask of STAPO and the 20-Entropy baseline mask, as pure tensor functions (torch only, no verl).

STAPO (arXiv 2602.15620, v4/v5), Sec. "Silencing Spurious Tokens", eq. I^S2T and Algorithm 1:

    I^S2T_{i,t} = 0  if  Â_i > 0  ∧  π(y_{i,t}) < τ_p  ∧  H_{i,t} < τ_h^(q),   else 1,

where τ_h^(q) is the q-quantile of the entropy over the *candidates* (tokens of positive-advantage responses
whose probability is below τ_p) of the mini-batch. The STAPO objective then averages the clipped surrogate over
the kept tokens only (1 / Σ I); in verl this renormalisation is obtained by folding ``keep`` into the response
mask before the update (see :mod:`stapo.trainer`).

Shapes: every tensor is ``(batch, response_len)``, right-padded, with ``response_mask`` marking real tokens.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

__all__ = [
    "entropy_quantile",
    "s2t_mask",
    "top_k_threshold",
    "top_entropy_mask",
    "mask_for_update",
    "summarize_mask_stats",
]


def _check_s2t_params(tau_p: float, q: float) -> None:
    if not 0.0 < tau_p <= 1.0:
        raise ValueError(f"tau_p must be in (0, 1], got {tau_p!r} (the paper uses 0.002)")
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q must be in [0, 1], got {q!r} (the paper uses 0.75)")


def entropy_quantile(values: torch.Tensor, q: float) -> float:
    """The q-quantile of ``values`` with linear interpolation, computed in float64.

    Same definition as ``torch.quantile(values.double(), q)`` (``interpolation="linear"``), without its 2**24
    element limit. NaN entries are ignored, so a NaN entropy never moves the threshold; the result is NaN when
    no finite value is left.
    """
    v = values.detach().reshape(-1).double()
    v = v[~torch.isnan(v)]
    n = v.numel()
    if n == 0:
        return math.nan
    v, _ = torch.sort(v)
    pos = q * (n - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, n - 1)
    frac = pos - lo
    return float(v[lo] + frac * (v[hi] - v[lo]))


def s2t_mask(
    log_probs: torch.Tensor,
    entropy: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    tau_p: float = 0.002,
    q: float = 0.75,
    *,
    quantile_fn: Callable[[torch.Tensor, float], float] = entropy_quantile,
) -> tuple[torch.Tensor, dict]:
    """The S2T mask (STAPO eq. I^S2T, Algorithm 1) of one mini-batch.

    Args:
        log_probs: log π of the sampled tokens.
        entropy: entropy H of the next-token distribution at each position (natural log).
        advantages: token-level advantages (GRPO broadcasts the sequence advantage Â_i over its tokens).
        response_mask: 1 (or True) for real response tokens.
        tau_p: absolute probability threshold τ_p in (0, 1]; p < τ_p is evaluated as log p < log τ_p.
        q: entropy quantile in [0, 1]; τ_h is the q-quantile of the candidates' entropies.
        quantile_fn: ``(candidate_entropies, q) -> τ_h``; the default is :func:`entropy_quantile`. A caller
            whose mini-batch is spread over processes passes one that gathers the candidates first.

    Returns:
        ``keep``: ``response_mask`` with the spurious tokens set to 0, same shape and dtype.
        ``stats``: ints ``tokens`` (response tokens), ``candidates``, ``masked``, ``pos_adv``, ``low_prob``,
        ``low_entropy`` (response tokens with H < τ_h), and the float ``entropy_threshold`` (τ_h; NaN when
        there is no candidate).

    Candidates are ``response_mask ∧ Â > 0 ∧ p < τ_p``; spurious tokens are candidates with ``H < τ_h``
    (strict, so ties with τ_h are kept and q = 0 masks nothing). A NaN entropy never masks its token and is
    left out of the quantile. With no candidate, ``keep == response_mask``.
    """
    _check_s2t_params(tau_p, q)
    valid = response_mask.bool()
    pos_adv = valid & (advantages > 0)
    low_prob = valid & (log_probs < math.log(tau_p))
    candidates = pos_adv & low_prob
    tau_h = quantile_fn(entropy[candidates], q)
    below = valid & (entropy < tau_h)  # all False when tau_h is NaN
    spurious = candidates & below
    keep = valid & ~spurious
    stats = {
        "tokens": int(valid.sum()),
        "candidates": int(candidates.sum()),
        "masked": int(spurious.sum()),
        "pos_adv": int(pos_adv.sum()),
        "low_prob": int(low_prob.sum()),
        "low_entropy": int(below.sum()),
        "entropy_threshold": tau_h,
    }
    return keep.to(response_mask.dtype), stats


def top_k_threshold(values: torch.Tensor, ratio: float) -> float:
    """The entropy of the ⌈ratio·n⌉-th highest of ``values`` (NaN ignored; NaN when none is left)."""
    v = values.detach().reshape(-1)
    v = v[~torch.isnan(v)]
    if v.numel() == 0:
        return math.nan
    return float(torch.topk(v, math.ceil(ratio * v.numel())).values[-1])


def top_entropy_mask(
    entropy: torch.Tensor,
    response_mask: torch.Tensor,
    ratio: float = 0.2,
    *,
    threshold_fn: Callable[[torch.Tensor, float], float] = top_k_threshold,
) -> tuple[torch.Tensor, dict]:
    """The 20-Entropy baseline mask (Wang et al., arXiv 2506.01939, "Beyond the 80/20 rule"): keep only the
    top-ρ fraction of response tokens by entropy, ρ = ``ratio``.

    It keeps the ⌈ρ·N⌉ highest-entropy response tokens of whatever set it is given (ties at the threshold are all
    kept; a NaN entropy is not ranked and its token is kept). Public implementations disagree on three points:
    the scope of the ranking (the paper's formula: the batch; the authors' verl fork: each GPU micro-batch; TRL:
    gathered over processes), the policy whose entropy is ranked (the fork and TRL: π_θ in the update) and the
    loss denominator (the formula and TRL: all tokens; the fork: the selected tokens). The recipe follows:

    * scope: one PPO mini-batch, the batch of one gradient step as in the paper's formula, and independent of how
      verl splits it over micro-batches and GPUs (per micro-batch gathered over ranks with
      ``policy_source: current``);
    * policy: π_old, whose entropies verl computes anyway (π_old = π_θ for the first mini-batch of a step, and no
      extra cost); π_θ with ``policy_source: current``;
    * denominator: the selected tokens, as in the authors' code that produced the 20-Entropy numbers; this is what
      folding the mask into verl's response mask gives.

    Returns ``keep`` (same shape/dtype as ``response_mask``) and stats with ints ``tokens``, ``kept``, ``masked``
    and the float ``entropy_threshold`` (NaN when there is no ranked token). ``threshold_fn`` ``(entropies,
    ratio) -> threshold`` defaults to :func:`top_k_threshold`; a caller spread over processes gathers first.
    """
    if not 0.0 < ratio <= 1.0:
        raise ValueError(f"ratio must be in (0, 1], got {ratio!r} (the 20-Entropy paper uses 0.2)")
    valid = response_mask.bool()
    threshold = threshold_fn(entropy[valid], ratio)
    keep = valid & ~(entropy < threshold)  # NaN entropy or NaN threshold: kept
    kept = int(keep.sum())
    stats = {
        "tokens": int(valid.sum()),
        "kept": kept,
        "masked": int(valid.sum()) - kept,
        "entropy_threshold": threshold,
    }
    return keep.to(response_mask.dtype), stats


def mask_for_update(
    method: str,
    log_probs: torch.Tensor,
    entropy: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    groups: Sequence[torch.Tensor] | None = None,
    *,
    tau_p: float = 0.002,
    q: float = 0.75,
    top_entropy_ratio: float = 0.2,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The update mask of a whole batch, computed separately on each group of rows (one PPO mini-batch each).

    Args:
        method: ``"s2t"`` (STAPO) or ``"top_entropy"`` (20-Entropy).
        groups: row-index tensors that partition the batch, one per mini-batch; ``None`` = one group of all rows.

    Returns ``keep`` for the whole batch and step metrics named ``stapo/...`` (fractions are of response
    tokens; ``stapo/entropy_threshold`` is the mean over groups that had candidates, NaN if none had).
    """
    if method not in ("s2t", "top_entropy"):
        raise ValueError(f"unknown mask method {method!r}: expected 's2t' or 'top_entropy'")
    if groups is None:
        groups = [torch.arange(response_mask.shape[0])]
    keep = response_mask.clone()
    all_stats = []
    for rows in groups:
        if method == "s2t":
            k, stats = s2t_mask(log_probs[rows], entropy[rows], advantages[rows], response_mask[rows], tau_p=tau_p, q=q)
        else:
            k, stats = top_entropy_mask(entropy[rows], response_mask[rows], ratio=top_entropy_ratio)
        keep[rows] = k
        all_stats.append(stats)
    return keep, summarize_mask_stats(all_stats)


def summarize_mask_stats(all_stats: Sequence[dict]) -> dict[str, float]:
    """Step metrics ``stapo/...`` from the stats of one or more masks (one per mini-batch).

    Counts are summed, fractions are of all response tokens, and ``stapo/entropy_threshold`` is the mean of the
    thresholds that exist (NaN when no group had one).
    """
    totals = {key: sum(st[key] for st in all_stats) for key in all_stats[0] if key != "entropy_threshold"}
    thresholds = [st["entropy_threshold"] for st in all_stats if not math.isnan(st["entropy_threshold"])]
    tokens = max(totals["tokens"], 1)
    metrics = {
        "stapo/masked_tokens": float(totals["masked"]),
        "stapo/masked_frac": totals["masked"] / tokens,
        "stapo/kept_frac": 1.0 - totals["masked"] / tokens,
        "stapo/entropy_threshold": sum(thresholds) / len(thresholds) if thresholds else math.nan,
    }
    if "candidates" in totals:
        metrics["stapo/candidate_tokens"] = float(totals["candidates"])
        metrics["stapo/candidate_frac"] = totals["candidates"] / tokens
        for name in ("pos_adv", "low_prob", "low_entropy"):
            metrics[f"stapo/{name}_frac"] = totals[name] / tokens
    return metrics
