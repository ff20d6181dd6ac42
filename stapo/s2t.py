"""The S2T mask of STAPO and the 20-Entropy baseline mask, as pure functions of torch tensors (no verl; NumPy
inside, for speed on the CPU).

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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
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
        ``keep``: ``response_mask`` with the spurious tokens set to 0, same shape, dtype and device.
        ``stats``: ints ``tokens`` (response tokens), ``candidates``, ``masked``, ``pos_adv``, ``low_prob``,
        ``low_entropy`` (response tokens with H < τ_h), and the float ``entropy_threshold`` (τ_h; NaN when
        there is no candidate).

    Candidates are ``response_mask ∧ Â > 0 ∧ p < τ_p``; spurious tokens are candidates with ``H < τ_h``
    (strict, so ties with τ_h are kept and q = 0 masks nothing). A NaN entropy never masks its token and is
    left out of the quantile. With no candidate, ``keep == response_mask``.
    """
    _check_s2t_params(tau_p, q)
    rows = _Rows.build(response_mask, entropy, log_probs, advantages)
    spurious, stats = rows.s2t(np.zeros(rows.n_rows, dtype=np.int64), 1, tau_p, q, quantile_fn)
    return _zeroed(response_mask, spurious), stats


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
    _check_ratio(ratio)
    rows = _Rows.build(response_mask, entropy)
    silenced, stats = rows.top_entropy(np.zeros(rows.n_rows, dtype=np.int64), 1, ratio, threshold_fn)
    return _zeroed(response_mask, silenced), stats


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
    """Which tokens of a whole batch to silence, with one threshold per group of rows (one PPO mini-batch each).

    The tensors are either padded ``(batch, response_len)`` or jagged nested tensors (verl's TransferQueue
    layout), all laid out alike. The work is done once over the whole batch on the CPU (a 2,048 × 15,360 batch
    takes tens of milliseconds), with the same semantics as :func:`s2t_mask` / :func:`top_entropy_mask` applied
    to each group separately.

    Args:
        method: ``"s2t"`` (STAPO) or ``"top_entropy"`` (20-Entropy).
        groups: row-index tensors that partition the batch, one per mini-batch; ``None`` = one group of all rows.

    Returns:
        ``silenced``: a bool tensor over the tokens, shaped like ``response_mask`` when padded and like its
        ``values()`` when nested.
        Step metrics named ``stapo/...`` (see :func:`summarize_mask_stats`).
    """
    if method not in ("s2t", "top_entropy"):
        raise ValueError(f"unknown mask method {method!r}: expected 's2t' or 'top_entropy'")
    rows = _Rows.build(response_mask, entropy, log_probs, advantages)
    row_group = np.zeros(rows.n_rows, dtype=np.int64)
    for g, members in enumerate(groups or []):
        row_group[members.numpy()] = g
    n_groups = max(len(groups or []), 1)
    if method == "s2t":
        _check_s2t_params(tau_p, q)
        index, stats = rows.s2t(row_group, n_groups, tau_p, q, entropy_quantile)
    else:
        _check_ratio(top_entropy_ratio)
        index, stats = rows.top_entropy(row_group, n_groups, top_entropy_ratio, top_k_threshold)
    silenced = np.zeros(rows.entropy.size, dtype=bool)
    silenced[index] = True
    shape = response_mask.values().shape if response_mask.is_nested else response_mask.shape
    return torch.from_numpy(silenced).reshape(shape), summarize_mask_stats(stats)


def _zeroed(response_mask: torch.Tensor, index: np.ndarray) -> torch.Tensor:
    """A copy of ``response_mask`` (same dtype and device) with the tokens at flat ``index`` set to 0."""
    keep = response_mask.clone(memory_format=torch.contiguous_format)
    keep.view(-1)[torch.from_numpy(index).to(keep.device)] = 0
    return keep


def _check_ratio(ratio: float) -> None:
    if not 0.0 < ratio <= 1.0:
        raise ValueError(f"ratio must be in (0, 1], got {ratio!r} (the 20-Entropy paper uses 0.2)")


def _numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach().reshape(-1).cpu()
    return (t.float() if t.dtype == torch.bfloat16 else t).numpy()  # NumPy has no bfloat16


_CHUNK = 1 << 20  # tokens per piece of the batch-wide comparisons: temporaries that stay small


@dataclass
class _Rows:
    """A batch as rows laid end to end (flat NumPy arrays plus row offsets), on the CPU.

    NumPy's comparisons and index search are several times faster than torch's on CPU for the few passes over the
    batch that the masks need; everything per candidate then works on small index arrays, and everything per group
    on runs of consecutive rows of that group (a handful unless verl shuffles the mini-batches).
    """

    log_probs: np.ndarray | None
    entropy: np.ndarray
    advantages: np.ndarray | None
    valid: np.ndarray | None  # None: every token is a response token (verl's jagged single-turn masks)
    offsets: np.ndarray

    @classmethod
    def build(cls, response_mask, entropy, log_probs=None, advantages=None) -> _Rows:
        """From padded ``(batch, length)`` tensors or jagged nested tensors (all in the same layout)."""
        tensors = (response_mask, entropy, log_probs, advantages)
        if response_mask.is_nested:
            offsets = response_mask.offsets().cpu().numpy().astype(np.int64)
            mask, entropy, log_probs, advantages = [None if t is None else _numpy(t.values()) for t in tensors]
        else:
            n_rows = response_mask.shape[0] if response_mask.dim() else 1
            offsets = np.arange(n_rows + 1, dtype=np.int64) * (response_mask.numel() // max(n_rows, 1))
            mask, entropy, log_probs, advantages = [None if t is None else _numpy(t) for t in tensors]
        valid = None if mask.size and mask.min() > 0 else mask != 0
        return cls(log_probs, entropy, advantages, valid, offsets)

    @property
    def n_rows(self) -> int:
        return len(self.offsets) - 1

    def _scan(self, op, values: np.ndarray, threshold: float, start: int, stop: int, reduce) -> list:
        """``reduce(first token, flags)`` per chunk of tokens ``start:stop``, where ``flags`` is
        ``op(values, threshold)`` restricted to response tokens. Chunks keep the temporaries small and run on
        two threads (NumPy releases the GIL), so no batch-sized array is allocated."""

        def chunk(a: int):
            b = min(a + _CHUNK, stop)
            flags = op(values[a:b], threshold)
            if self.valid is not None:
                flags &= self.valid[a:b]
            return reduce(a, flags)

        chunks = range(start, stop, _CHUNK)
        if len(chunks) <= 1:
            return [chunk(a) for a in chunks]
        with ThreadPoolExecutor(max_workers=2) as pool:
            return list(pool.map(chunk, chunks))

    def _tokens(self) -> int:
        return self.entropy.size if self.valid is None else int(np.count_nonzero(self.valid))

    def _runs(self, row_group: np.ndarray):
        """``(first token, end token, group)`` of each run of consecutive rows in the same group."""
        starts = np.flatnonzero(np.diff(row_group, prepend=-1))
        ends = np.append(starts[1:], self.n_rows)
        return [(self.offsets[a], self.offsets[b], row_group[a]) for a, b in zip(starts, ends)]

    def _below(self, row_group: np.ndarray, thresholds: np.ndarray, reduce) -> list:
        """:meth:`_scan` of "entropy below the threshold of the token's group" (a NaN threshold: none)."""
        return [
            part
            for start, stop, g in self._runs(row_group)
            for part in self._scan(np.less, self.entropy, thresholds[g], start, stop, reduce)
        ]

    def s2t(self, row_group, n_groups, tau_p, q, quantile_fn) -> tuple[np.ndarray, dict]:
        """Flat indices of the spurious tokens and the summed stats (``entropy_threshold``: mean over groups)."""
        n = self.entropy.size
        rare = self._scan(np.less, self.log_probs, math.log(tau_p), 0, n, _indices)
        rare = np.concatenate(rare) if rare else np.empty(0, dtype=np.int64)  # few: the rest works on indices
        pos_adv = sum(self._scan(np.greater, self.advantages, 0.0, 0, n, _count))
        candidates = rare[self.advantages[rare] > 0]
        cand_group = row_group[np.searchsorted(self.offsets, candidates, side="right") - 1]
        cand_entropy = self.entropy[candidates]
        thresholds = np.array(
            [quantile_fn(torch.from_numpy(cand_entropy[cand_group == g]), q) for g in range(n_groups)], dtype=float
        )
        spurious = candidates[cand_entropy < thresholds[cand_group]]  # NaN threshold or entropy: kept
        stats = {
            "tokens": self._tokens(),
            "candidates": int(candidates.size),
            "masked": int(spurious.size),
            "pos_adv": pos_adv,
            "low_prob": int(rare.size),
            "low_entropy": sum(self._below(row_group, thresholds, _count)),
            "entropy_threshold": _mean_finite(thresholds),
        }
        return spurious, stats

    def top_entropy(self, row_group, n_groups, ratio, threshold_fn) -> tuple[np.ndarray, dict]:
        """Flat indices of the tokens outside each group's top-ρ entropy, and the summed stats."""
        values = [[] for _ in range(n_groups)]
        for a, b, g in self._runs(row_group):
            values[g].append(self.entropy[a:b] if self.valid is None else self.entropy[a:b][self.valid[a:b]])
        thresholds = np.array(
            [threshold_fn(torch.from_numpy(np.concatenate(v) if v else np.empty(0)), ratio) for v in values],
            dtype=float,
        )
        silenced = self._below(row_group, thresholds, _indices)  # NaN entropy: kept
        silenced = np.concatenate(silenced) if silenced else np.empty(0, dtype=np.int64)
        tokens = self._tokens()
        stats = {
            "tokens": tokens,
            "kept": tokens - silenced.size,
            "masked": int(silenced.size),
            "entropy_threshold": _mean_finite(thresholds),
        }
        return silenced, stats


def _indices(start: int, flags: np.ndarray) -> np.ndarray:
    return np.flatnonzero(flags) + start


def _count(start: int, flags: np.ndarray) -> int:
    return int(np.count_nonzero(flags))


def _mean_finite(values: np.ndarray) -> float:
    finite = values[~np.isnan(values)]
    return float(finite.mean()) if finite.size else math.nan


def summarize_mask_stats(stats: dict) -> dict[str, float]:
    """Step metrics ``stapo/...`` from the stats of a mask: counts, and fractions of all response tokens."""
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
        for name in ("pos_adv", "low_prob", "low_entropy"):
            metrics[f"stapo/{name}_frac"] = stats[name] / tokens
    return metrics
