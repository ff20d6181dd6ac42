"""Does S2T's choice of tokens matter? The paper's masking ablation (v4, "Ablation and Sensitivity Analysis") at 135M,
where JustRL drifts: docs/experiments.md section 12. This module reads its pilot, which picks the regime on the
baseline alone so that the choice cannot favour an arm.

    python -m stapo.tools.selection pilot DIR

``pilot`` reads the runs of ``scripts/gpu/selection.sh pilot`` (JustRL, ``justrl_lrLR-sSEED``) under ``DIR/runs``.
Per run it prints the entropy drift (:func:`drift`), the reward's fall by the decisive test's rule
(:func:`stapo.tools.decisive.Endpoint`, over all steps logged), the mean step time after the first, and the
validation accuracy at each validation. A learning rate **drifts** when every one of its seeds drifted by
:data:`DRIFT_NATS` or more and none collapsed; the pick is the lowest such rate, the one closest to the paper's 1e-6.
For it, the pilot's seeds give the spread of the planned endpoint (the mean of the last two validations) and the
effect a 10-seed paired test would detect (:func:`detectable`). The pilot is exploratory: its numbers size the
pre-registered runs, they are not evidence for or against an arm.
"""

from __future__ import annotations

import argparse
import math
import re
import statistics
from collections.abc import Sequence
from pathlib import Path

from stapo.tools.curves import VALIDATION, ReportError, read_runs, rows_markdown
from stapo.tools.decisive import WINDOW, Endpoint, t_sf, windows
from stapo.tools.io import write_atomic

DRIFT_NATS = 0.5
"""The pilot's bar (issue 66): JustRL's entropy rises by at least this much over a run."""
EDGE = 5
"""Steps averaged at each end of a run for its drift."""
SEEDS = 10
"""Seeds of the main runs: the paired tests have ``SEEDS - 1`` degrees of freedom."""
ALPHA = 0.025
"""One-sided level of the first of Holm's two steps at family-wise 0.05: what the detectable effect is sized at."""
POWER = 0.8
LAST_VALIDATIONS = 2
"""The planned endpoint: validation accuracy averaged over a run's last two validations."""
_LR = re.compile(r"_lr(?P<lr>[0-9.e+-]+)$")


def drift(entropy: dict[int, float]) -> float:
    """Mean ``actor/entropy`` of the last :data:`EDGE` steps minus that of the first :data:`EDGE` (NaN with fewer
    than twice as many steps)."""
    steps = sorted(entropy)
    if len(steps) < 2 * EDGE:
        return math.nan
    return statistics.fmean(entropy[s] for s in steps[-EDGE:]) - statistics.fmean(entropy[s] for s in steps[:EDGE])


def fall(reward: dict[int, float]) -> Endpoint:
    """The decisive test's endpoint over every step logged: the highest mean over :data:`WINDOW` consecutive steps,
    and the mean of the last :data:`WINDOW`."""
    steps = sorted(reward)
    if len(steps) < WINDOW:
        raise ReportError(f"{len(steps)} steps logged; the reward's fall needs {WINDOW}")
    means = windows([reward[s] for s in steps])
    return Endpoint(peak=max(means), last=means[-1])


def accuracy(metrics: dict[str, dict[int, float]]) -> dict[int, float]:
    """Validation accuracy by step, averaged over the data sources validated (``val-core/<source>/acc/mean@N``)."""
    series = [values for key, values in metrics.items() if VALIDATION.fullmatch(key)]
    steps = sorted({s for values in series for s in values})
    return {s: statistics.fmean(v[s] for v in series if s in v) for s in steps}


def endpoint(metrics: dict[str, dict[int, float]]) -> float:
    """The planned primary endpoint: the mean of the last :data:`LAST_VALIDATIONS` validations (NaN without them)."""
    found = accuracy(metrics)
    last = sorted(found)[-LAST_VALIDATIONS:]
    return statistics.fmean(found[s] for s in last) if len(last) == LAST_VALIDATIONS else math.nan


def t_quantile(p: float, df: int) -> float:
    """The t with ``P(T ≥ t) = p`` (Student's t, ``df`` degrees of freedom), by bisection on
    :func:`stapo.tools.decisive.t_sf`."""
    low, high = -60.0, 60.0
    for _ in range(200):
        middle = (low + high) / 2
        low, high = (middle, high) if t_sf(middle, df) > p else (low, middle)
    return (low + high) / 2


def detectable(spread: float, seeds: int = SEEDS, alpha: float = ALPHA, power: float = POWER) -> float:
    """The mean paired difference a one-sided paired t test over ``seeds`` detects with ``power`` at ``alpha``, for
    paired differences of standard deviation ``spread`` (the usual approximation (t_{1−α} + t_{power}) · sd / √n,
    df = n − 1)."""
    df = seeds - 1
    return (t_quantile(alpha, df) + t_quantile(1 - power, df)) * spread / math.sqrt(seeds)


def pilot_rows(runs: dict[str, dict[int, dict[str, dict[int, float]]]]) -> list[dict]:
    """One row per run: learning rate, seed, steps, drift, the reward's peak and last mean, whether it collapsed,
    mean step seconds after the first, the validations, and the planned endpoint."""
    rows = []
    for method in sorted(runs, key=lambda m: float(_LR.search(m)["lr"]) if _LR.search(m) else math.inf):
        for seed, metrics in sorted(runs[method].items()):
            reward, steps = fall(metrics["critic/score/mean"]), metrics.get("timing_s/step", {})
            later = [steps[s] for s in sorted(steps)[1:]]
            rows.append({
                "run": f"{method}-s{seed}",
                "lr": _LR.search(method)["lr"] if _LR.search(method) else "-",
                "seed": seed,
                "steps": len(metrics["critic/score/mean"]),
                "drift": drift(metrics.get("actor/entropy", {})),
                "peak": reward.peak,
                "last": reward.last,
                "collapsed": reward.collapsed,
                "step_s": statistics.fmean(later) if later else math.nan,
                "validations": accuracy(metrics),
                "endpoint": endpoint(metrics),
            })  # fmt: skip
    return rows


def reading(rows: Sequence[dict]) -> tuple[str | None, list[str]]:
    """The pick (the lowest learning rate whose every seed drifted by :data:`DRIFT_NATS` or more without
    collapsing; None if none did) and the lines that say why, and what the pick's seeds give for the main runs."""
    by_lr: dict[str, list[dict]] = {}
    for row in rows:
        by_lr.setdefault(row["lr"], []).append(row)
    lines, pick = [], None
    for lr, group in by_lr.items():
        ok = all(r["drift"] >= DRIFT_NATS and not r["collapsed"] for r in group)
        drifts = ", ".join(f"{r['drift']:+.2f}" for r in group)
        collapsed = sum(r["collapsed"] for r in group)
        lines.append(f"lr {lr}: drift {drifts} nats, {collapsed} of {len(group)} collapsed: "
                     + ("drifts" if ok else "does not"))  # fmt: skip
        pick = pick or (lr if ok else None)
    if pick is None:
        return None, [*lines, f"no learning rate drifted by {DRIFT_NATS} nats in every seed without collapsing"]
    ends = [r["endpoint"] for r in by_lr[pick]]
    lines.append(f"pick: lr {pick} (the lowest that drifts)")
    if len(ends) >= 2 and not any(math.isnan(e) for e in ends):
        spread = statistics.stdev(ends) * math.sqrt(2)  # two arms' independent noise in a paired difference
        lines.append(f"its endpoints {', '.join(f'{e:.3f}' for e in ends)}: paired-difference sd about {spread:.3f} "
                     f"(√2 × the seeds' sd, {len(ends) - 1} df); {SEEDS} seeds detect about "
                     f"{detectable(spread):.3f} at {POWER:.0%} power, one-sided α {ALPHA}")  # fmt: skip
    else:
        lines.append(f"its seeds have no {LAST_VALIDATIONS} validations each: no spread for the power calculation")
    return pick, lines


def pilot(folder: Path) -> str:
    """The pilot's table and reading (Markdown), also written to ``folder/pilot.md``."""
    rows = pilot_rows(read_runs(folder))
    shown = [{
        "run": r["run"], "lr": r["lr"], "seed": str(r["seed"]), "steps": str(r["steps"]), "drift": f"{r['drift']:+.3f}",
        "reward peak / last": f"{r['peak']:.3f} / {r['last']:.3f}", "collapsed": "yes" if r["collapsed"] else "no",
        "s per step": f"{r['step_s']:.1f}",
        "validation": ", ".join(f"{s}: {a:.3f}" for s, a in r["validations"].items()) or "-",
    } for r in rows]  # fmt: skip
    _, lines = reading(rows)
    text = rows_markdown(shown) + "\n" + "\n".join(f"- {line}" for line in lines) + "\n"
    write_atomic(folder / "pilot.md", text)
    return text


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m stapo.tools.selection", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    read = commands.add_parser("pilot", help="the pilot's runs: drift, fall, pace, validation; the pick")
    read.add_argument("folder", type=Path, metavar="DIR", help="the pilot's experiment folder (DIR/runs/...)")
    args = parser.parse_args(argv)
    try:
        print(pilot(args.folder), end="")
    except ReportError as error:
        parser.exit(2, f"error: {error}\n")


if __name__ == "__main__":
    main()
