"""The masks of :mod:`stapo.s2t` for a whole PPO batch at once, with one threshold per mini-batch: the fast path
the trainer runs on the driver before every actor update.

The batch arrives from verl's TransferQueue as jagged nested tensors (or padded ones); it is flattened once into
NumPy arrays and scanned in chunks on two threads (NumPy releases the GIL), so no batch-sized temporary is made: a
paper-scale batch of 2,048 × 15,360 tokens takes tens of milliseconds. Everything per candidate then works on small
index arrays. Same semantics as :func:`stapo.s2t.s2t_mask` / :func:`stapo.s2t.top_entropy_mask` applied to each
group of rows separately (float32 comparisons, strict ``<``, NaN handling); ``tests/test_batch_mask.py`` checks the
equality on random batches with ties, NaN, empty groups and bfloat16 inputs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from stapo.s2t import (
    DEFAULTS,
    ablation_choice,
    check_ratio,
    check_s2t_params,
    distinct_silenced,
    entropy_quantile,
    top_k_threshold,
)

__all__ = ["mask_for_update", "grad_bound_sums"]

_CHUNK = 1 << 20  # tokens per piece of the batch-wide scans


def mask_for_update(
    method: str,
    log_probs: torch.Tensor,
    entropy: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    groups: Sequence[torch.Tensor] | None = None,
    *,
    tau_p: float = DEFAULTS.tau_p,
    q: float = DEFAULTS.q,
    top_entropy_ratio: float = DEFAULTS.top_entropy_ratio,
    silence: str = DEFAULTS.silence,
    seed: int = 0,
) -> tuple[torch.Tensor, dict]:
    """Which tokens of a batch to silence, one threshold per group of rows (one PPO mini-batch each).

    Args:
        method: ``"s2t"`` (STAPO) or ``"top_entropy"`` (20-Entropy).
        log_probs, entropy, advantages, response_mask: padded ``(batch, response_len)`` or jagged nested tensors,
            all in the same layout (``log_probs``/``advantages`` are not read by ``top_entropy``).
        groups: row-index tensors that partition the batch, one per mini-batch; ``None`` = one group of all rows.
        silence, seed: ``s2t`` only: STAPO (``low_entropy``) or an ablation, as :func:`stapo.s2t.s2t_mask` applied
            to each group's rows in batch order, group g with ``seed + g``.

    Returns:
        ``silenced``: a bool tensor shaped like ``response_mask`` (padded) or like its ``values()`` (nested), and the
        stats of the single-mask functions summed over the groups (``entropy_threshold``: the mean of the groups'
        finite thresholds; NaN if none); for ``s2t`` also ``pool_candidates`` and ``pool_masked``, the lists of
        candidates and silenced tokens per group.
    """
    if method not in ("s2t", "top_entropy"):
        raise ValueError(f"unknown mask method {method!r}: expected 's2t' or 'top_entropy'")
    rows = _Rows.build(response_mask, entropy, log_probs, advantages)
    row_group = np.zeros(rows.n_rows, dtype=np.int64)
    for g, members in enumerate(groups or []):
        row_group[members.numpy()] = g
    n_groups = max(len(groups or []), 1)
    if method == "s2t":
        check_s2t_params(tau_p, q)
        index, stats = rows.s2t(row_group, n_groups, tau_p, q, silence, seed)
    else:
        check_ratio(top_entropy_ratio)
        index, stats = rows.top_entropy(row_group, n_groups, top_entropy_ratio)
    silenced = np.zeros(rows.entropy.size, dtype=bool)
    silenced[index] = True
    shape = response_mask.values().shape if response_mask.is_nested else response_mask.shape
    return torch.from_numpy(silenced).reshape(shape), stats


def grad_bound_sums(
    log_probs: torch.Tensor,
    entropy: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    silenced: torch.Tensor,
    tau_p: float = DEFAULTS.tau_p,
) -> dict[str, float]:
    """Σ of :func:`stapo.s2t.grad_norm_lower_bound` over the ``silenced`` tokens (a bool tensor as
    :func:`mask_for_update` returns it), over the S2T candidates (Â > 0, p < τ_p) and over all response tokens:
    ``bound_silenced``, ``bound_candidates``, ``bound_total``. Tokens with a NaN entropy are left out of the sums.
    Two exponentials per token: the trainer runs this beside the actor update, off the driver's critical path."""
    check_s2t_params(tau_p, 0.5)
    rows = _Rows.build(response_mask, entropy, log_probs, advantages)
    low_prob = np.concatenate(rows._flags(np.less, rows.log_probs, math.log(tau_p), _indices) or [_NONE])
    return {
        "bound_silenced": rows._bound(np.flatnonzero(silenced.reshape(-1).numpy())),
        "bound_candidates": rows._bound(low_prob[rows.advantages[low_prob] > 0]),
        "bound_total": sum(rows._scan(rows._bound_chunk, 0, rows.entropy.size)),
    }


def _numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach().reshape(-1).cpu()
    return (t.float() if t.dtype == torch.bfloat16 else t).numpy()  # NumPy has no bfloat16


@dataclass
class _Rows:
    """A batch as rows laid end to end (flat NumPy arrays plus row offsets), on the CPU."""

    log_probs: np.ndarray | None
    entropy: np.ndarray
    advantages: np.ndarray | None
    valid: np.ndarray | None  # None: every token is a response token (verl's jagged single-turn masks)
    offsets: np.ndarray

    @classmethod
    def build(cls, response_mask, entropy, log_probs, advantages) -> _Rows:
        tensors = (response_mask, entropy, log_probs, advantages)
        if response_mask.is_nested:
            offsets = response_mask.offsets().cpu().numpy().astype(np.int64)
            mask, entropy, log_probs, advantages = [_numpy(t.values()) for t in tensors]
        else:
            n_rows = response_mask.shape[0] if response_mask.dim() else 1
            offsets = np.arange(n_rows + 1, dtype=np.int64) * (response_mask.numel() // max(n_rows, 1))
            mask, entropy, log_probs, advantages = [_numpy(t) for t in tensors]
        valid = None if mask.size and mask.min() > 0 else mask != 0
        as32 = [None if x is None else x.astype(np.float32, copy=False) for x in (log_probs, entropy)]  # as s2t.py
        return cls(as32[0], as32[1], advantages, valid, offsets)

    @property
    def n_rows(self) -> int:
        return len(self.offsets) - 1

    def _scan(self, chunk_fn, start: int, stop: int) -> list:
        """``chunk_fn(a, b, valid[a:b] or None)`` for each chunk of tokens ``start:stop``, on two threads."""

        def chunk(a: int):
            b = min(a + _CHUNK, stop)
            return chunk_fn(a, b, None if self.valid is None else self.valid[a:b])

        chunks = range(start, stop, _CHUNK)
        if len(chunks) <= 1:
            return [chunk(a) for a in chunks]
        with ThreadPoolExecutor(max_workers=2) as pool:
            return list(pool.map(chunk, chunks))

    def _flags(self, op, values: np.ndarray, threshold: float, reduce, start: int = 0, stop: int | None = None):
        """``reduce(first token, op(values, threshold) ∧ valid)`` per chunk; ``threshold`` compares in the array's
        dtype (a Python float, as torch compares a float32 tensor with a scalar)."""

        def chunk_fn(a, b, valid):
            flags = op(values[a:b], threshold)
            if valid is not None:
                flags &= valid
            return reduce(a, flags)

        return self._scan(chunk_fn, start, values.size if stop is None else stop)

    def _tokens(self) -> int:
        return self.entropy.size if self.valid is None else int(np.count_nonzero(self.valid))

    def _runs(self, row_group: np.ndarray):
        """``(first token, end token, group)`` of each run of consecutive rows in the same group."""
        starts = np.flatnonzero(np.diff(row_group, prepend=-1))
        ends = np.append(starts[1:], self.n_rows)
        return [(self.offsets[a], self.offsets[b], row_group[a]) for a, b in zip(starts, ends)]

    def _below(self, row_group: np.ndarray, thresholds: list[float], reduce) -> list:
        """:meth:`_flags` of "entropy below the threshold of the token's group" (a NaN threshold: none)."""
        return [
            part
            for start, stop, g in self._runs(row_group)
            for part in self._flags(np.less, self.entropy, thresholds[g], reduce, start, stop)
        ]

    def s2t(self, row_group, n_groups, tau_p, q, silence, seed) -> tuple[np.ndarray, dict]:
        """Flat indices of the spurious tokens (or of an ablation's choice) and the summed stats."""
        low_prob = np.concatenate(self._flags(np.less, self.log_probs, math.log(tau_p), _indices) or [_NONE])
        pos_adv = sum(self._flags(np.greater, self.advantages, 0.0, _count))
        candidates = low_prob[self.advantages[low_prob] > 0]  # few: the rest works on index arrays
        cand_group = row_group[np.searchsorted(self.offsets, candidates, side="right") - 1]
        cand_entropy = self.entropy[candidates]
        pools = [torch.from_numpy(cand_entropy[cand_group == g]) for g in range(n_groups)]
        thresholds = [entropy_quantile(pool, q) for pool in pools]
        below = cand_entropy < np.array(thresholds, dtype=np.float32)[cand_group]
        if silence != "low_entropy":  # as many per group, chosen by the ablation
            counts, below = np.bincount(cand_group[below], minlength=n_groups), np.zeros_like(below)
            for g, pool in enumerate(pools):
                members = np.flatnonzero(cand_group == g)
                below[members[ablation_choice(pool, int(counts[g]), silence, seed + g).numpy()]] = True
        spurious = candidates[below]
        stats = {
            "tokens": self._tokens(),
            "candidates": int(candidates.size),
            "masked": int(spurious.size),
            "pos_adv": pos_adv,
            "low_prob": int(low_prob.size),
            "low_entropy": sum(self._below(row_group, thresholds, _count)),
            "expected_masked": sum(distinct_silenced(int((~torch.isnan(pool)).sum()), q) for pool in pools),
            "entropy_threshold": _mean_finite(thresholds),
            "pool_candidates": [pool.numel() for pool in pools],
            "pool_masked": np.bincount(cand_group[below], minlength=n_groups).tolist(),
        }
        return spurious, stats

    def _bound(self, index: np.ndarray) -> float:
        """Σ of :func:`stapo.s2t.grad_norm_lower_bound` over the tokens at ``index`` (NaN terms left out)."""
        lp, h, a = (x[index].astype(np.float64) for x in (self.log_probs, self.entropy, self.advantages))
        return float(np.nansum(a * a * (1.0 - 2.0 * np.exp(lp) + np.exp(-h))))

    def _bound_chunk(self, a: int, b: int, valid) -> float:
        """Σ a²(1 − 2p + e^{−H}) over the response tokens of ``a:b``, in place on two temporaries."""
        adv = self.advantages[a:b]
        if not adv.any():  # e.g. groups whose responses were all right or all wrong
            return 0.0
        terms = np.exp(self.log_probs[a:b])
        terms *= -2.0
        terms += 1.0
        decay = np.negative(self.entropy[a:b])
        np.exp(decay, out=decay)
        terms += decay
        np.multiply(adv, adv, out=decay)
        terms *= decay
        if valid is not None:
            terms[~valid] = 0.0
        total = float(terms.sum(dtype=np.float64))
        return total if not math.isnan(total) else float(np.nansum(terms, dtype=np.float64))  # NaN entropies

    def top_entropy(self, row_group, n_groups, ratio) -> tuple[np.ndarray, dict]:
        """Flat indices of the tokens outside each group's top-ρ entropy, and the summed stats."""
        values = [[] for _ in range(n_groups)]
        for a, b, g in self._runs(row_group):
            values[g].append(self.entropy[a:b] if self.valid is None else self.entropy[a:b][self.valid[a:b]])
        thresholds = [
            top_k_threshold(torch.from_numpy(np.concatenate(v) if v else np.empty(0, np.float32)), ratio)
            for v in values
        ]
        silenced = np.concatenate(self._below(row_group, thresholds, _indices) or [_NONE])
        tokens = self._tokens()
        stats = {
            "tokens": tokens,
            "kept": tokens - silenced.size,
            "masked": int(silenced.size),
            "entropy_threshold": _mean_finite(thresholds),
        }
        return silenced, stats


_NONE = np.empty(0, dtype=np.int64)


def _indices(start: int, flags: np.ndarray) -> np.ndarray:
    return np.flatnonzero(flags) + start


def _count(start: int, flags: np.ndarray) -> int:
    return int(np.count_nonzero(flags))


def _mean_finite(values: list[float]) -> float:
    finite = [v for v in values if not math.isnan(v)]
    return sum(finite) / len(finite) if finite else math.nan
