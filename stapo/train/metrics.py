"""Step metrics of the masks, as logged by the trainer and the workers (README, "Metrics"), and the check that the
entropies reaching them are float32."""

from __future__ import annotations

import math
import sys

import torch

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
    τ_h. A mean or share over an empty set is NaN."""
    tokens, candidates, spurious = stats["tokens"], stats["candidates"], stats["masked"]
    total, cand, spur = stats["bound_total"], stats["bound_candidates"], stats["bound_silenced"]
    return {
        "s2t/candidate_frac": candidates / max(tokens, 1),
        "s2t/spurious_frac": spurious / max(tokens, 1),
        "s2t/silenced_share": _ratio(spurious, candidates),
        "s2t/expected_share": _ratio(stats["expected_masked"], candidates),
        "s2t/grad_bound/spurious_mean": _ratio(spur, spurious),
        "s2t/grad_bound/candidate_mean": _ratio(cand, candidates),
        "s2t/grad_bound/other_mean": _ratio(total - cand, tokens - candidates),
        "s2t/grad_bound/spurious_share": _ratio(spur, total),
    }


def _ratio(a: float, b: float) -> float:
    return a / b if b else math.nan
