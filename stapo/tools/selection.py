"""Does S2T's choice of tokens matter? The paper's masking ablation (v4, "Ablation and Sensitivity Analysis") at 135M,
where JustRL drifts: docs/experiments.md section 12. This module reads its pilot, which picks the regime on the
baseline alone so that the choice cannot favour an arm.

    python -m stapo.tools.selection pilot DIR
    python -m stapo.tools.selection verdict BLOCK [BLOCK ...]

``pilot`` reads the runs of ``scripts/gpu/selection.sh pilot`` (JustRL, ``justrl_lrLR-sSEED``) under ``DIR/runs``.
Per run it prints the entropy drift (:func:`drift`), the reward's fall by the decisive test's rule
(:func:`stapo.tools.decisive.Endpoint`, over all steps logged), the mean step time after the first, and the
validation accuracy at each validation. A learning rate **drifts** when every one of its seeds drifted by
:data:`DRIFT_NATS` or more and none collapsed; the pick is the lowest such rate, the one closest to the paper's 1e-6.
For it, the pilot's seeds give the spread of the planned endpoint (the mean of the last two validations) and the
effect a 10-seed paired test would detect (:func:`detectable`). The pilot is exploratory: its numbers size the
pre-registered runs, they are not evidence for or against an arm.

``verdict`` reads the main runs (``ARM-sSEED`` of JustRL, STAPO and ``stapo_random``, seeds 20-29, in blocks) by the
rules fixed in docs/experiments.md before the first of them (:func:`report`): each run's endpoint is its validation
accuracy averaged over its last two validations, counted only where the run reached the blocks' planned last step; the
regime is reached when JustRL drifted by :data:`DRIFT_NATS` in at least :data:`REACHED` seeds; the mask must act in
every STAPO and random run (:func:`mask_acts`). Then STAPO − random (primary) and STAPO − JustRL, one-sided paired t
by seed, Holm over the two at :data:`stapo.tools.decisive.ALPHA`, and the two one-sided tests of equivalence on STAPO −
random within ±:data:`MARGIN` (:func:`tost`): one verdict line per contrast.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
from collections.abc import Sequence
from pathlib import Path

from stapo.tools.curves import VALIDATION, ReportError, mean_over, read_runs, rows_markdown
from stapo.tools.decisive import ALPHA as FAMILY_ALPHA
from stapo.tools.decisive import ARMS, WINDOW, Endpoint, holm, paired_t, t_sf, windows
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
MAIN_SEEDS = tuple(range(20, 30))
"""The main runs' seeds, two a block (none of the pilot's)."""
REACHED = 7
"""The manipulation check: JustRL drifts by :data:`DRIFT_NATS` or more in at least this many of the ten seeds."""
MARGIN = 0.02
"""The equivalence margin of STAPO − random: ±2 points of validation accuracy (a fraction here)."""
ACTS_SHARE = 0.5
"""The mask acts in a run that silenced tokens and at least this share of its candidates over the run (the rule's
⌈q(k−1)⌉ of k gives about q = 0.75 in large pools, 0 in pools of one)."""
VERDICT = "VERDICT (selection, drift regime): "
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


def tost(differences: Sequence[float], margin: float = MARGIN) -> float:
    """The p of equivalence within ±``margin``: the larger p of the one-sided paired t tests of H0 mean ≤ −margin
    and of H0 mean ≥ +margin (Schuirmann's two one-sided tests, df = n − 1); below :data:`FAMILY_ALPHA` the mean
    difference is shown to lie within the margin."""
    n, mean = len(differences), statistics.fmean(differences)
    se = statistics.stdev(differences) / math.sqrt(n)
    if not se:
        return 0.0 if abs(mean) < margin else 1.0
    return max(t_sf((mean + margin) / se, n - 1), t_sf((margin - mean) / se, n - 1))


def mask_acts(metrics: dict[str, dict[int, float]]) -> tuple[float, float, bool]:
    """(mean candidates per step, silenced share of all the run's candidates, whether the mask acted): it acted when
    it silenced tokens and at least :data:`ACTS_SHARE` of its candidates (``s2t/candidate_tokens``,
    ``s2t/spurious_tokens``)."""
    candidates, silenced = (metrics.get(k, {}) for k in ("s2t/candidate_tokens", "s2t/spurious_tokens"))
    total = sum(candidates.values())
    share = sum(silenced.values()) / total if total else math.nan
    return statistics.fmean(candidates.values()) if candidates else math.nan, share, share >= ACTS_SHARE


def finished(metrics: dict[str, dict[int, float]], steps: int) -> bool:
    """Whether a run reached the planned last step, its reward and a validation logged there."""
    return steps in metrics.get("critic/score/mean", {}) and steps in accuracy(metrics)


def _settings(folder: Path) -> dict:
    """A block's ``experiment.json`` without the paths of its host (the model's weights are in it by digest)."""
    path = folder / "experiment.json"
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        why = error.strerror if isinstance(error, OSError) else f"not JSON ({error})"
        raise ReportError(f"{path}: {why}; give a block's folder, as `experiment run` wrote it") from None
    return {k: v for k, v in found.items() if k not in ("model", "data")}


def exploratory(metrics: dict[str, dict[int, float]]) -> dict[str, str]:
    """Issue 66's exploratory columns, each a mean over the run's steps, spurious (the S2T rule's tokens) / kept
    candidates: vLLM's log-probability gap to the trainer's, and the weight verl's truncated IS would give them
    (``s2t/mismatch/*``, :func:`stapo.train.metrics.mismatch_metrics`)."""

    def pair(what: str) -> str:
        series = [metrics.get(f"s2t/mismatch/{who}_{what}", {}) for who in ("spurious", "kept_candidate")]
        return " / ".join(f"{mean_over(values, sorted(values)):.3f}" for values in series)

    return {"exploratory: log-p gap": pair("logp"), "exploratory: IS weight": pair("is_weight")}


def main_runs(folders: Sequence[Path]) -> tuple[int, dict[str, dict[int, dict[str, dict[int, float]]]], list[dict]]:
    """(the planned steps, ``arm -> {seed -> metrics}`` of the finished runs, a row per run found) of the blocks.
    The blocks must share their settings (``experiment.json``); a run finished in two blocks is refused, one that
    did not finish is shown and left out (it is re-run with its seed)."""
    settings = [_settings(f) for f in folders]
    for folder, other in zip(folders[1:], settings[1:]):
        differ = sorted(k for k in settings[0].keys() | other.keys() if settings[0].get(k) != other.get(k))
        if differ:
            raise ReportError(f"{folder}: {', '.join(differ)} differ from {folders[0]}; the blocks share one regime")
    steps, done, rows, rates = int(settings[0]["steps"]), {}, [], {}
    for folder in folders:
        for method, by_seed in read_runs(folder).items():
            arm, rate = _LR.sub("", method), _LR.search(method)
            if arm not in ARMS:
                raise ReportError(f"{folder}: runs of {method}; the main runs' arms are {', '.join(ARMS)}")
            rates.setdefault(rate["lr"] if rate else "the experiment's", folder)
            if len(rates) > 1:
                raise ReportError(f"learning rates {' and '.join(rates)} in {folder} and {rates[next(iter(rates))]}; "
                                  "the blocks share one regime")  # fmt: skip
            for seed, metrics in sorted(by_seed.items()):
                ok = finished(metrics, steps)
                if ok and seed in done.get(arm, {}):
                    raise ReportError(f"{folder}: {arm}-s{seed} finished in two blocks; keep one")
                if ok:
                    done.setdefault(arm, {})[seed] = metrics
                candidates, share, acts = mask_acts(metrics)
                rows.append({"block": folder.name, "run": f"{arm}-s{seed}", "finished": "yes" if ok else "no",
                    "drift (nats)": f"{drift(metrics.get('actor/entropy', {})):+.3f}",
                    "val acc %, last two": f"{100 * endpoint(metrics):.1f}" if ok else "-",
                    "candidates / step": f"{candidates:.1f}", "silenced share": f"{share:.3f}" if arm != "justrl"
                    else "(observed)", **exploratory(metrics)})  # fmt: skip
    return steps, done, rows


def verdict(done: dict[str, dict[int, dict[str, dict[int, float]]]]) -> tuple[list[str], list[dict]]:
    """The verdict lines (:data:`VERDICT`, one per contrast, or one saying why there is none) and the contrasts'
    table, by the pre-registered rules (module docstring), from the finished runs of :func:`main_runs`."""
    seeds = [s for s in MAIN_SEEDS if all(s in done.get(arm, {}) for arm in ARMS)]
    if len(seeds) < len(MAIN_SEEDS):
        return [VERDICT + f"no verdict: {len(seeds)} of {len(MAIN_SEEDS)} seeds have all three arms finished"], []
    drifted = sum(drift(done["justrl"][s].get("actor/entropy", {})) >= DRIFT_NATS for s in seeds)
    if drifted < REACHED:
        return [VERDICT + f"regime not reached: JustRL drifted by {DRIFT_NATS} nats in {drifted} of {len(seeds)} "
                f"seeds ({REACHED} needed)"], []  # fmt: skip
    idle = [f"{arm}-s{s}" for arm in ARMS[1:] for s in seeds if not mask_acts(done[arm][s])[2]]
    if idle:
        return [VERDICT + f"no verdict: the mask did not act in {', '.join(idle)}"], []
    tests = []
    for other in ("stapo_random", "justrl"):
        differences = [endpoint(done["stapo"][s]) - endpoint(done[other][s]) for s in seeds]
        tests.append((other, differences, *paired_t(differences)))
    significant = holm([p for *_, p in tests], FAMILY_ALPHA)
    lines, table = [], []
    for (other, differences, mean, t, p), shown in zip(tests, significant):
        name = "random" if other == "stapo_random" else "JustRL"
        said = f"STAPO − {name} {100 * mean:+.1f} points of validation accuracy, one-sided p {p:.3g}"
        equivalence = tost(differences) if other == "stapo_random" else math.nan
        if shown:
            said += ", Holm significant: " + ("S2T's choice of tokens matters here" if other == "stapo_random"
                                              else "STAPO beats JustRL here")  # fmt: skip
        elif equivalence < FAMILY_ALPHA:
            said += f", within ±{100 * MARGIN:.0f} (TOST p {equivalence:.3g}): the choice does not matter here"
        else:
            said += ": inconclusive" if other == "stapo_random" else ": not shown"
        lines.append(VERDICT + said)
        table.append({"contrast": f"stapo − {other}", "mean (points)": f"{100 * mean:+.2f}", "t": f"{t:.3g}",
            "one-sided p": f"{p:.3g}", f"Holm at {FAMILY_ALPHA}": "significant" if shown else "not significant",
            f"TOST ±{100 * MARGIN:.0f} p": "-" if math.isnan(equivalence) else f"{equivalence:.3g}"})  # fmt: skip
    return lines, table


def report(folders: Sequence[Path]) -> tuple[str, list[str]]:
    """(the Markdown tables, the verdict lines) of the main runs' blocks ``folders`` (experiment folders with
    ``experiment.json`` and ``runs/ARM-sSEED/metrics.jsonl[.gz]``, as ``experiment run`` writes them and evidence/
    keeps them)."""
    steps, done, rows = main_runs([Path(f) for f in folders])
    lines, table = verdict(done)
    text = f"Planned steps: {steps}.\n\n" + rows_markdown(rows)
    return text + ("\n" + rows_markdown(table) if table else ""), lines


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m stapo.tools.selection", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    read = commands.add_parser("pilot", help="the pilot's runs: drift, fall, pace, validation; the pick")
    read.add_argument("folder", type=Path, metavar="DIR", help="the pilot's experiment folder (DIR/runs/...)")
    judge = commands.add_parser("verdict", help="the main runs' blocks: endpoints, checks, contrasts, verdict lines")
    judge.add_argument("folders", type=Path, nargs="+", metavar="BLOCK", help="a block's experiment folder")
    args = parser.parse_args(argv)
    try:
        if args.command == "pilot":
            print(pilot(args.folder), end="")
        else:
            tables, lines = report(args.folders)
            print(tables + "\n" + "\n".join(lines))
    except ReportError as error:
        parser.exit(2, f"error: {error}\n")


if __name__ == "__main__":
    main()
