"""The decisive test of docs/experiments.md section 11, pre-registered before any of its runs: does S2T keep training
from breaking down where JustRL breaks down?

Each run's primary endpoint is ρ = (mean training reward of steps 16-20) / (its highest mean reward over 5
consecutive steps); a run has **collapsed** when ρ ≤ 0.5 and that drop (peak minus last) is at least 0.03
(:func:`endpoint`). A round is two seeds of three arms (JustRL, STAPO, the random-mask control), read by
:func:`round_reading`; after two rounds the four seeds are tested paired by seed (:func:`final_reading`).
``python -m stapo.quickstart.experiment decisive ROUND1 [ROUND2]`` prints the table and the verdict line, and the
evidence page (docs/evidence/decisive.md) shows them (:mod:`stapo.tools.evidence`).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from stapo.tools.curves import VALIDATION, mean_over, read_runs, rows_markdown

ARMS = ("justrl", "stapo", "stapo_random")
"""The three arms: the baseline that breaks down, the method, and the control that silences as many candidates at
random (same count per pool)."""
STEPS = 20
"""Steps every run of a round must reach for the round to be read."""
LAST = range(16, 21)
"""The steps whose mean reward is the numerator of ρ."""
WINDOW = 5
"""Consecutive steps of the peak's mean (the denominator of ρ)."""
COLLAPSE_RATIO = 0.5
COLLAPSE_DROP = 0.03
ALPHA = 0.05
"""Family-wise level of the two contrasts (Holm)."""
EFFECT = 0.25
"""A difference in ρ below this (a quarter of the peak) counts as no effect when neither contrast is significant."""
VERDICT = "VERDICT (decisive, breakdown regime): "

READINGS = {
    "not_reproduced": "regime not reproduced",
    "no_verdict": "no verdict: a run did not reach step 20",
    "does_not_prevent": "S2T does not prevent this breakdown",
    "pending": "pending: round 1 read, round 2 (seeds 12, 13) to run",
    "prevents_choice": "S2T prevents this breakdown, and its choice of tokens matters",
    "prevents_count": "silencing this many tokens prevents it; S2T's choice is not shown to matter",
    "no_effect": "no effect where the breakdown occurs",
    "inconclusive": "inconclusive",
}
"""Every reading the verdict line can carry, as pre-registered."""


@dataclass(frozen=True)
class Endpoint:
    """One run's primary endpoint."""

    peak: float
    """Highest mean reward over :data:`WINDOW` consecutive steps within steps 1-20."""
    last: float
    """Mean reward of steps 16-20."""

    @property
    def rho(self) -> float:
        return self.last / self.peak if self.peak > 0 else math.nan

    @property
    def collapsed(self) -> bool:
        return self.peak > 0 and self.rho <= COLLAPSE_RATIO and self.peak - self.last >= COLLAPSE_DROP


def endpoint(reward: dict[int, float]) -> Endpoint:
    """ρ's parts from ``critic/score/mean`` by step (steps past 20 are ignored); raises ``ValueError`` when a step of
    1-20 is missing."""
    missing = [s for s in range(1, STEPS + 1) if s not in reward]
    if missing:
        raise ValueError(f"the reward is missing at steps {missing[:3]}{'...' if len(missing) > 3 else ''}")
    return Endpoint(peak=max(windows([reward[s] for s in range(1, STEPS + 1)])),
                    last=statistics.fmean(reward[s] for s in LAST))  # fmt: skip


def windows(values: Sequence[float]) -> list[float]:
    """The means of every :data:`WINDOW` consecutive values."""
    return [statistics.fmean(values[i : i + WINDOW]) for i in range(len(values) - WINDOW + 1)]


Round = dict[str, dict[int, Endpoint]]
"""``arm -> {seed -> endpoint}`` of one round."""


def round_reading(rnd: Round) -> str:
    """The key in :data:`READINGS` of one round (two seeds): ``not_reproduced`` unless both JustRL runs collapsed
    (the manipulation check); then ``does_not_prevent`` when both STAPO runs collapsed (final), else ``pending``."""
    if not all(e.collapsed for e in rnd["justrl"].values()):
        return "not_reproduced"
    return "does_not_prevent" if all(e.collapsed for e in rnd["stapo"].values()) else "pending"


def t_sf(t: float, df: int) -> float:
    """P(T ≥ t) for Student's t with ``df`` degrees of freedom (the closed form for integer df, Abramowitz & Stegun
    26.7.3-4)."""
    if math.isnan(t):
        return math.nan
    theta = math.atan(abs(t) / math.sqrt(df))
    c2, s = math.cos(theta) ** 2, math.sin(theta)
    if df % 2:  # odd
        term, total = math.cos(theta), 0.0
        for k in range(1, (df - 1) // 2 + 1):
            total += term
            term *= c2 * (2 * k) / (2 * k + 1)
        inside = 2 / math.pi * (theta + s * total) if df > 1 else 2 / math.pi * theta
    else:
        term, total = 1.0, 0.0
        for k in range(df // 2):
            total += term
            term *= c2 * (2 * k + 1) / (2 * k + 2)
        inside = s * total
    upper = (1 - inside) / 2
    return upper if t >= 0 else 1 - upper


def paired_t(differences: Sequence[float]) -> tuple[float, float, float]:
    """(mean, t, one-sided p for mean > 0) of paired differences, df = n - 1."""
    n, mean = len(differences), statistics.fmean(differences)
    sd = statistics.stdev(differences)
    t = mean / (sd / math.sqrt(n)) if sd else math.copysign(math.inf, mean) if mean else 0.0
    return mean, t, (0.0 if t == math.inf else 1.0 if t == -math.inf else t_sf(t, n - 1))


def fisher_less(collapsed_a: int, collapsed_b: int, n: int) -> float:
    """One-sided Fisher exact p that arm A collapses less often than arm B, each run ``n`` times: the chance of
    ``collapsed_a`` or fewer of the ``collapsed_a + collapsed_b`` collapses falling in A."""
    k = collapsed_a + collapsed_b
    return sum(math.comb(k, x) * math.comb(2 * n - k, n - x) for x in range(collapsed_a + 1)) / math.comb(2 * n, n)


def holm(p_values: Sequence[float], alpha: float = ALPHA) -> list[bool]:
    """Which hypotheses Holm's step-down procedure rejects at family-wise ``alpha``."""
    order = sorted(range(len(p_values)), key=lambda i: p_values[i])
    rejected = [False] * len(p_values)
    for rank, i in enumerate(order):
        if not p_values[i] <= alpha / (len(p_values) - rank):
            break
        rejected[i] = True
    return rejected


@dataclass(frozen=True)
class Contrast:
    """STAPO minus another arm over the seeds both ran."""

    other: str
    mean: float
    t: float
    p: float
    significant: bool
    fisher_p: float


def contrasts(rounds: Sequence[Round]) -> list[Contrast]:
    """STAPO - JustRL and STAPO - random on ρ, paired by seed over every round, one-sided (STAPO higher), Holm over
    the two; Fisher's exact test on the collapse counts beside each (secondary)."""
    pooled = {arm: {seed: e for rnd in rounds for seed, e in rnd[arm].items()} for arm in ARMS}
    stats = []
    for other in ("justrl", "stapo_random"):
        seeds = sorted(pooled["stapo"].keys() & pooled[other].keys())
        differences = [pooled["stapo"][s].rho - pooled[other][s].rho for s in seeds]
        collapsed = [sum(pooled[arm][s].collapsed for s in seeds) for arm in ("stapo", other)]
        stats.append((other, *paired_t(differences), fisher_less(*collapsed, len(seeds))))
    significant = holm([p for _, _, _, p, _ in stats])
    return [Contrast(o, m, t, p, sig, f) for (o, m, t, p, f), sig in zip(stats, significant)]


def final_reading(rounds: Sequence[Round]) -> str:
    """The key in :data:`READINGS` after both rounds: ``not_reproduced`` unless the manipulation check passed in both;
    then by the two contrasts (section 11)."""
    if any(round_reading(r) == "not_reproduced" for r in rounds):
        return "not_reproduced"
    versus_justrl, versus_random = contrasts(rounds)
    if versus_justrl.significant and versus_random.significant:
        return "prevents_choice"
    if versus_justrl.significant:
        return "prevents_count"
    if not versus_random.significant and max(abs(versus_justrl.mean), abs(versus_random.mean)) < EFFECT:
        return "no_effect"
    return "inconclusive"


def reading(rounds: Sequence[Round]) -> str:
    """The verdict's key for the rounds run so far: round 1 is final when it reads ``not_reproduced`` or
    ``does_not_prevent``, else ``pending`` until round 2 gives :func:`final_reading`."""
    first = round_reading(rounds[0])
    return first if first != "pending" or len(rounds) == 1 else final_reading(rounds)


SECONDARY = (
    ("entropy 16-20", "actor/entropy", 1),
    ("cut at the length limit % 16-20", "response_length/clip_ratio", 100),
    ("grad norm 16-20", "actor/grad_norm", 1),
    ("S2T-flagged % of Â>0 tokens 16-20", "s2t/spurious_per_pos_adv", 100),
)
"""The secondary endpoints: (label, verl's or the recipe's metric, scale), each a mean over steps 16-20."""


def report(folders: Sequence) -> tuple[str, str]:
    """(the Markdown tables, the verdict line) of the rounds under ``folders`` (each an experiment folder with
    ``runs/ARM-sSEED/metrics.jsonl[.gz]``, as ``experiment run`` writes it and evidence/ keeps it)."""
    rounds, rows, short = [], [], []
    for number, folder in enumerate(folders, 1):
        runs = read_runs(folder)
        missing = sorted(set(ARMS) - set(runs))
        if missing:
            raise SystemExit(f"error: {folder}: no runs of {', '.join(missing)} (the decisive test has {ARMS})")
        rnd: Round = {}
        for arm in ARMS:
            for seed, metrics in sorted(runs[arm].items()):
                row = {"round": str(number), "run": f"{arm}-s{seed}"}
                try:
                    e = endpoint(metrics["critic/score/mean"])
                except ValueError as error:
                    short.append(f"{folder}: {arm}-s{seed}: {error}")
                    continue
                rnd.setdefault(arm, {})[seed] = e
                row |= {"peak 5-step reward": f"{e.peak:.3f}", "reward 16-20": f"{e.last:.3f}", "ρ": f"{e.rho:.3f}"}
                row["collapsed"] = "yes" if e.collapsed else "no"
                for label, key, scale in SECONDARY:
                    row[label] = f"{scale * mean_over(metrics.get(key, {}), LAST):.3g}"
                val = next((metrics[k] for k in sorted(metrics) if VALIDATION.fullmatch(k)), {})
                row["val acc % @ 20"] = f"{100 * val[STEPS]:.1f}" if STEPS in val else "-"
                rows.append(row)
        rounds.append(rnd)
    tables = rows_markdown(rows)
    if short:
        return tables + "\n" + "\n".join(short) + "\n", VERDICT + READINGS["no_verdict"]
    key = reading(rounds)
    if len(rounds) > 1:
        cells = [
            {
                "contrast": f"stapo - {c.other}",
                "mean Δρ": f"{c.mean:+.3f}",
                "t": f"{c.t:.3g}",
                "one-sided p": f"{c.p:.3g}",
                "Holm at 0.05": "significant" if c.significant else "not significant",
                "Fisher p (collapses)": f"{c.fisher_p:.3g}",
            }
            for c in contrasts(rounds)
        ]
        tables += "\n" + rows_markdown(cells)
    return tables, VERDICT + READINGS[key]
