"""The method: the S2T mask of STAPO, the 20-Entropy baseline mask and the paper's gradient-norm bound, as short
pure torch functions whose bodies are the formulas. This is the reference; :mod:`stapo.batch_mask` computes the
same masks for a whole batch at once (what the trainer uses) and is tested to equal these functions.

STAPO (Liu et al., arXiv 2602.15620, v4/v5), "Silencing Spurious Tokens", eq. I^S2T and Algorithm 1::

    I^S2T_{i,t} = 0  if  Â_i > 0  ∧  π(y_{i,t}) < τ_p  ∧  H_{i,t} < τ_h^(q),   else 1,

with τ_h^(q) the q-quantile of the entropy over the *candidates* (tokens of positive-advantage responses whose
probability is below τ_p) of the PPO mini-batch. The STAPO objective averages the clipped surrogate over the kept
tokens only (1 / Σ I); the trainer gets this by folding ``keep`` into verl's response and loss masks.

Conventions (the paper is silent on them):

* every tensor is ``(batch, response_len)``, right-padded, ``response_mask`` marking real tokens; a padded position
  is never a candidate and never enters a threshold;
* p < τ_p is evaluated as ``log p < log τ_p``; comparisons are made in float32 (bfloat16 inputs are upcast exactly);
* ``H < τ_h`` is strict: ties with τ_h are kept, and q = 0 silences nothing;
* a NaN entropy never silences its token and is left out of the quantile; with no candidate nothing is silenced
  and τ_h is NaN.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from stapo.config import StapoConfig

DEFAULTS = StapoConfig()
"""The paper's values (STAPO v4; 20-Entropy's ρ), kept in one place: :class:`stapo.config.StapoConfig`."""

__all__ = [
    "entropy_quantile",
    "distinct_silenced",
    "ablation_choice",
    "top_k_threshold",
    "s2t_mask",
    "top_entropy_mask",
    "grad_norm_lower_bound",
    "check_s2t_params",
    "check_ratio",
]


def entropy_quantile(values: torch.Tensor, q: float) -> float:
    """The q-quantile of ``values`` with linear interpolation (``torch.quantile``'s default), in float64.

    NaN entries are ignored; NaN when nothing is left. Unlike ``torch.quantile`` it has no 2**24-element limit.
    """
    v = values.detach().reshape(-1).double()
    v = torch.sort(v[~torch.isnan(v)]).values
    if v.numel() == 0:
        return math.nan
    pos = q * (v.numel() - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, v.numel() - 1)
    return float(v[lo] + (pos - lo) * (v[hi] - v[lo]))


def distinct_silenced(k: int, q: float) -> int:
    """How many of ``k`` candidates the S2T rule silences when their entropies are distinct: ⌈q(k − 1)⌉ (0 without
    candidates). τ_h^(q) lies at position q(k − 1) of the sorted entropies (linear interpolation), and the strict
    ``H < τ_h`` silences the entropies below that position; ties at τ_h silence fewer, which is how low-precision
    entropies show in a run (``s2t/expected_share``)."""
    return math.ceil(q * (k - 1)) if k > 0 else 0


def ablation_choice(pool: torch.Tensor, count: int, silence: str, seed: int = 0) -> torch.Tensor:
    """Positions in ``pool`` (the candidates' entropies, in token order) of the ``count`` candidates that a
    masking-strategy ablation silences instead of STAPO's low-entropy ones (STAPO v4, "Ablation and Sensitivity
    Analysis": "high-entropy masking" and "random masking" of the positive-advantage, low-probability tokens):
    ``high_entropy`` the ``count`` highest entropies (ties by position), ``random`` ``count`` drawn without replacement
    by ``torch.randperm`` seeded with ``seed``. Candidates with a NaN entropy are never chosen, as in STAPO."""
    finite = (~torch.isnan(pool)).nonzero().reshape(-1)
    count = min(count, finite.numel())
    if silence == "high_entropy":
        order = torch.sort(pool[finite].double(), descending=True, stable=True).indices
    elif silence == "random":
        order = torch.randperm(finite.numel(), generator=torch.Generator().manual_seed(seed))
    else:
        raise ValueError(f"unknown ablation {silence!r}: expected 'high_entropy' or 'random'")
    return finite[order[:count].to(finite.device)]


def top_k_threshold(values: torch.Tensor, ratio: float) -> float:
    """The ⌈ratio·n⌉-th highest of ``values`` (NaN ignored; NaN when nothing is left)."""
    v = values.detach().reshape(-1)
    v = v[~torch.isnan(v)]
    if v.numel() == 0:
        return math.nan
    return float(torch.topk(v, math.ceil(ratio * v.numel())).values[-1])


def check_s2t_params(tau_p: float, q: float) -> None:
    if not 0.0 < tau_p <= 1.0:
        raise ValueError(f"tau_p must be in (0, 1], got {tau_p!r} (the paper uses 0.002)")
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q must be in [0, 1], got {q!r} (the paper uses 0.75)")


def check_ratio(ratio: float) -> None:
    if not 0.0 < ratio <= 1.0:
        raise ValueError(f"ratio must be in (0, 1], got {ratio!r} (the 20-Entropy paper uses 0.2)")


def s2t_mask(
    log_probs: torch.Tensor,
    entropy: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    tau_p: float = DEFAULTS.tau_p,
    q: float = DEFAULTS.q,
    *,
    quantile_fn: Callable[[torch.Tensor, float], float] = entropy_quantile,
    silence: str = DEFAULTS.silence,
    seed: int = 0,
) -> tuple[torch.Tensor, dict]:
    """The S2T mask of one mini-batch (STAPO eq. I^S2T, Algorithm 1), or one of the paper's masking-strategy
    ablations (v4, "Ablation and Sensitivity Analysis").

    Args:
        log_probs: log π of the sampled tokens.
        entropy: entropy H of the next-token distribution at each position (natural log).
        advantages: token-level advantages (GRPO broadcasts the response's Â_i over its tokens).
        response_mask: 1 (or True) for real response tokens.
        tau_p: absolute probability threshold τ_p in (0, 1].
        q: entropy quantile in [0, 1]; τ_h is the q-quantile of the candidates' entropies.
        quantile_fn: ``(candidate entropies, q) -> τ_h``; a caller whose mini-batch is spread over processes
            passes one that gathers the candidates first.
        silence: ``low_entropy`` (STAPO); ``high_entropy`` or ``random`` silence as many candidates as STAPO would,
            chosen by :func:`ablation_choice` (``seed`` for ``random``).

    Returns:
        ``keep``: ``response_mask`` with the spurious tokens set to 0 (same shape, dtype and device), and ``stats``:
        ints ``tokens``, ``candidates``, ``masked``, ``pos_adv``, ``low_prob``, ``low_entropy`` (response tokens with
        H < τ_h), ``expected_masked`` (what the rule silences with distinct entropies, :func:`distinct_silenced` of
        the candidates with a finite entropy) and the float ``entropy_threshold`` (τ_h).
    """
    check_s2t_params(tau_p, q)
    valid = response_mask != 0
    entropy = entropy.float()
    pos_adv = valid & (advantages > 0)
    low_prob = valid & (log_probs.float() < math.log(tau_p))
    candidates = pos_adv & low_prob
    pool = entropy[candidates]
    tau_h = quantile_fn(pool, q)
    low_entropy = valid & (entropy < tau_h)  # NaN τ_h or H: False
    spurious = candidates & low_entropy
    if silence != "low_entropy":  # as many candidates, chosen otherwise
        chosen = ablation_choice(pool, int(spurious.sum()), silence, seed)
        spurious = torch.zeros_like(candidates)
        spurious[tuple(w[chosen] for w in candidates.nonzero(as_tuple=True))] = True
    stats = {
        "tokens": int(valid.sum()),
        "candidates": int(candidates.sum()),
        "masked": int(spurious.sum()),
        "pos_adv": int(pos_adv.sum()),
        "low_prob": int(low_prob.sum()),
        "low_entropy": int(low_entropy.sum()),
        "expected_masked": distinct_silenced(int((~torch.isnan(pool)).sum()), q),
        "entropy_threshold": tau_h,
    }
    return response_mask.masked_fill(spurious, 0), stats


def top_entropy_mask(
    entropy: torch.Tensor,
    response_mask: torch.Tensor,
    ratio: float = DEFAULTS.top_entropy_ratio,
    *,
    threshold_fn: Callable[[torch.Tensor, float], float] = top_k_threshold,
) -> tuple[torch.Tensor, dict]:
    """The 20-Entropy baseline mask (Wang et al., arXiv 2506.01939, "Beyond the 80/20 rule"): keep the ⌈ρ·N⌉
    highest-entropy response tokens, ρ = ``ratio`` (ties at the threshold are all kept; a NaN entropy is not ranked
    and its token is kept).

    Public implementations disagree on three points; the recipe follows the paper's formula for the scope (one
    ranking per PPO mini-batch, independent of micro-batches and GPUs), π_old for the entropy (``policy_source:
    current`` switches to π_θ) and, by default, the authors' code for the loss denominator (the selected tokens;
    ``stapo.top_entropy_norm: all`` gives the formula's all-token denominator).

    Returns ``keep`` (like ``response_mask``) and stats with ints ``tokens``, ``kept``, ``masked`` and the float
    ``entropy_threshold``. ``threshold_fn`` ``(entropies, ratio) -> threshold``: a caller spread over processes
    gathers first.
    """
    check_ratio(ratio)
    valid = response_mask != 0
    entropy = entropy.float()
    threshold = threshold_fn(entropy[valid], ratio)
    silenced = valid & (entropy < threshold)  # NaN threshold or H: kept
    tokens, masked = int(valid.sum()), int(silenced.sum())
    stats = {"tokens": tokens, "kept": tokens - masked, "masked": masked, "entropy_threshold": threshold}
    return response_mask.masked_fill(silenced, 0), stats


def grad_norm_lower_bound(log_probs: torch.Tensor, entropy: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
    """Per-token lower bound of the squared gradient norm of the policy-gradient term with respect to the logits.

    STAPO, Theorem "Policy Gradient Norm Bounds" (after Yang et al., arXiv 2505.12929): for a token with weight w and
    probability π under a softmax policy of entropy H,

        ‖∇_a J‖² = |w|² (1 − 2π + Σ_v π_v²)  ≥  |w|² (1 − 2π + e^{−H}),

    since the collision probability Σ_v π_v² = e^{−H_2} ≥ e^{−H} (Rényi-2 entropy H_2 ≤ H). Evaluated at the old
    policy, where the importance ratio is 1 and w = Â. Low π and low H both raise the bound: the paper's argument
    that spurious tokens (low p, low H, Â > 0) carry disproportionately large gradients.
    """
    w2 = advantages.float().square()
    return w2 * (1.0 - 2.0 * log_probs.float().exp() + torch.exp(-entropy.float()))
