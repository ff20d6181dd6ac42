"""Training runs' metrics read from their logs, and the curves drawn from them: what the report, the experiment tool
and the evidence pages share.

:func:`read_metrics` reads one run (verl's file-logger JSONL, gzipped too, a console log or a TensorBoard folder);
:func:`read_runs` an experiment's folder of runs; :func:`figure_data` and :func:`plot_runs` give the training curves
(entropy, reward, response length, the masks' shares, validation accuracy), :func:`plot_s2t` the two pictures of one
mini-batch's S2T mask.
"""

from __future__ import annotations

import gzip
import io
import json
import math
import re
import statistics
from collections.abc import Sequence
from pathlib import Path

from stapo.tools.io import segments, write_atomic

PLOTS = {
    "entropy": ("actor/entropy", "actor entropy"),
    "reward": ("critic/score/mean", "mean reward"),
    "response_length": ("response_length/mean", "mean response length (tokens)"),
    "masked_frac": ("stapo/masked_frac", "stapo/masked_frac (silenced share of tokens)"),
    "spurious_frac": ("s2t/spurious_frac", "s2t/spurious_frac (share of tokens S2T flags)"),
    "spurious_share": ("s2t/grad_bound/spurious_share", "flagged tokens' share of the gradient-norm bound"),
}
"""Figure name -> (verl metric, axis label). Validation accuracy adds one figure per ``val-core`` data source."""
VALIDATION = re.compile(r"val-core/(?P<source>.+)/acc/mean@\d+")
_CONSOLE = re.compile(r"\bstep:(\d+) - (.*)")
_WRAPPED = re.compile(r"[\w.]+\(([^,]*).*\)")  # np.float64(0.5), tensor(0.5, device='cuda:0')


class ReportError(ValueError):
    """Bad input; the message names the file at fault and the fix."""


def _number(text: str) -> float | None:
    """A console value as a float: ``0.5``, ``nan``, ``np.float64(0.5)``...; None if it is not a number."""
    wrapped = _WRAPPED.fullmatch(text.strip())
    try:
        return float(wrapped[1] if wrapped else text)
    except ValueError:
        return None


VARYING = ("timing_s/", "timing_per_token_ms/", "perf/mfu/", "perf/throughput", "perf/time_per_step", "actor/perf/")
"""Prefixes of the metrics that measure time or memory, not what was computed: never compared by ``--all``."""


def every_key(a: dict[str, dict[int, float]], b: dict[str, dict[int, float]]) -> tuple[str, ...]:
    """Every metric either run logged, except the :data:`VARYING` ones (``--all``): one logged by one run only
    differs."""
    return tuple(sorted(key for key in set(a) | set(b) if not key.startswith(VARYING)))


def compare(
    a: dict[str, dict[int, float]], b: dict[str, dict[int, float]], keys: Sequence[str], steps: range | None = None
) -> dict:
    """Per key of ``keys`` that either run logged: ``rows`` (step, A, B) at the steps both logged (within ``steps``),
    the largest absolute difference, and whether all values are bitwise equal (NaN equals NaN)."""
    result = {}
    for key in keys:
        if key not in a and key not in b:
            continue
        shared = sorted(set(a.get(key, {})) & set(b.get(key, {})))
        shared = [s for s in shared if steps is None or s in steps]
        rows = [(s, a[key][s], b[key][s]) for s in shared]
        gaps = [abs(x - y) for _, x, y in rows if not (math.isnan(x) or math.isnan(y))]
        equal = bool(rows) and all(same(x, y) for _, x, y in rows)
        result[key] = {"rows": rows, "max_diff": max(gaps, default=math.nan), "equal": equal}
    return result


def same(x: float, y: float) -> bool:
    """Bitwise equal values of one metric (NaN equals NaN)."""
    return x == y or (math.isnan(x) and math.isnan(y))


def compared_steps(result: dict, steps: int) -> tuple[list[int], list[int]]:
    """The steps of 1..``steps`` at which :func:`compare` found a value of both runs, and those at which it found
    none (a step one run did not log)."""
    logged = {step for found in result.values() for step, _, _ in found["rows"]}
    return sorted(logged), sorted(set(range(1, steps + 1)) - logged)


def parting(result: dict) -> dict:
    """Where two runs compared by :func:`compare` part: the metrics equal at every step both logged (``equal``), the
    others (``differ``), among them those no step of both runs holds (``one_sided``: logged by one run only), the first
    step at which any value differs (``first_step``, None if none does) and the metrics that differ there
    (``first_metrics``)."""
    differ = sorted(key for key, found in result.items() if not found["equal"])
    parted = [(step, key) for key in differ for step, x, y in result[key]["rows"] if not same(x, y)]
    first = min((step for step, _ in parted), default=None)
    return {
        "equal": sorted(set(result) - set(differ)),
        "differ": differ,
        "one_sided": [key for key in differ if not result[key]["rows"]],
        "first_step": first,
        "first_metrics": sorted(key for step, key in parted if step == first),
    }


def read_metrics(path: Path) -> dict[str, dict[int, float]]:
    """``metric -> {step: value}`` of one training run (a later value of a step wins, as after a resume).

    ``path`` is verl's file-logger JSONL (``{"step": N, "data": {...}}`` lines; with the earlier segments a resumed
    run set aside, ``<stem>.1.jsonl``...; gzipped as ``.jsonl.gz``, as evidence/ keeps it), a saved console log (lines
    ``step:N - key:value - ...``) or a TensorBoard run folder / event file.
    """
    path = Path(path)
    if not path.exists() and not segments(path):
        raise ReportError(f"{path}: no such file or folder")
    metrics: dict[str, dict[int, float]] = {}
    if path.is_dir() or path.name.startswith("events.out.tfevents"):
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        accumulator = EventAccumulator(str(path), size_guidance={"scalars": 0})
        accumulator.Reload()
        for tag in accumulator.Tags()["scalars"]:
            metrics[tag] = {event.step: event.value for event in accumulator.Scalars(tag)}
    else:
        for part in segments(path):
            opener = gzip.open if part.suffix == ".gz" else open
            with opener(part, "rt", encoding="utf-8", errors="replace") as file:
                lines = file.read().splitlines()
            for number, line in enumerate(lines, 1):
                parsed = _parse_log_line(line)
                if parsed is None and number < len(lines):  # a kill mid-write cuts off the last line only
                    raise ReportError(
                        f"{part}: line {number} is not a complete JSON record (only a last line cut off by a kill is "
                        "skipped); repair or delete that line"
                    )
                for key, step, value in parsed or []:
                    metrics.setdefault(key, {})[step] = value
    if not metrics:
        raise ReportError(
            f"{path}: no metrics found; pass verl's file-logger JSONL, a console log with 'step:N - key:value' lines, "
            "or a TensorBoard run folder (tensorboard_log/<project>/<experiment>)"
        )
    return metrics


def _parse_log_line(line: str) -> list[tuple[str, int, float]] | None:
    """``(metric, step, value)`` of one file-logger or console line; [] for any other line, None for a file-logger
    line that is not JSON (cut off or damaged)."""
    if line.startswith("{"):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            return None
        try:
            return [
                (k, int(record["step"]), float(v)) for k, v in record["data"].items() if isinstance(v, (int, float))
            ]
        except (KeyError, TypeError, ValueError, AttributeError):
            return []
    match = _CONSOLE.search(line)
    if not match:
        return []
    items = (item.rpartition(":") for item in match[2].split(" - "))
    values = ((key.strip(), _number(text)) for key, _, text in items)
    return [(key, int(match[1]), value) for key, value in values if key and value is not None]


def read_runs(folder: Path) -> dict[str, dict[int, dict[str, dict[int, float]]]]:
    """``method -> {seed -> metrics}`` of the runs under ``folder/runs`` that logged anything."""
    runs: dict[str, dict[int, dict[str, dict[int, float]]]] = {}
    logs = [*(folder / "runs").glob("*-s*/metrics.jsonl"), *(folder / "runs").glob("*-s*/metrics.jsonl.gz")]
    for log in sorted(logs):  # gzipped: a run's record in evidence/
        method, _, seed = log.parent.name.rpartition("-s")
        try:
            metrics = read_metrics(log)
        except ReportError as error:
            print(f"skipped: {error}")
            continue
        if "critic/score/mean" in metrics:
            runs.setdefault(method, {})[int(seed)] = metrics
        else:
            print(f"skipped: {log} has no training step yet")
    if not runs:
        raise SystemExit(f"error: no metrics under {folder / 'runs'}; run `python -m stapo.quickstart.experiment run`")
    return runs


def gradient_steps(metrics: Path) -> tuple[int, int]:
    """Of a run's steps (its ``metrics``), how many had a nonzero ``actor/grad_norm``, and how many logged it: a run
    whose gradients were all 0 changed its weights by the weight decay alone, and runs equal to it show nothing of the
    update or of a resumed optimizer."""
    norms = read_metrics(metrics).get("actor/grad_norm", {})
    return sum(value != 0 for value in norms.values()), len(norms)


def mean_over(series: dict[int, float], steps: Sequence[int]) -> float:
    """Mean of a metric over the ``steps`` it logged a number at (NaN if none)."""
    values = [series[s] for s in steps if s in series and not math.isnan(series[s])]
    return statistics.fmean(values) if values else math.nan


def rows_markdown(rows: Sequence[dict[str, str]]) -> str:
    """The rows as a Markdown table."""
    columns = list(rows[0])
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(row.get(c, "-") for c in columns) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def band(series: Sequence[dict[int, float]]) -> tuple[list[int], list[float], list[float], list[float]]:
    """Steps every series has a (non-NaN) value at, and the mean, minimum and maximum over the series there."""
    if not series:
        return [], [], [], []
    steps = sorted(set.intersection(*({s for s, v in one.items() if not math.isnan(v)} for one in series)))
    values = [[one[s] for one in series] for s in steps]
    return steps, [statistics.fmean(v) for v in values], [min(v) for v in values], [max(v) for v in values]


Figures = dict[str, tuple[str, dict[str, list[dict[int, float]]]]]
"""Figure name -> (axis label, label -> the series of its runs), what :func:`plot_runs` draws."""


def figure_data(runs: dict[str, Sequence[dict[str, dict[int, float]]]]) -> Figures:
    """The figures :func:`plot_runs` draws from ``runs`` (label -> its runs' metrics): one per :data:`PLOTS` metric and
    per validation source that every run of a label logged; a figure no label has is left out."""
    figures: dict[str, dict[str, list[dict[int, float]]]] = {name: {} for name in PLOTS}
    titles = {name: title for name, (_, title) in PLOTS.items()}
    for label, group in runs.items():
        for name, (key, _) in PLOTS.items():
            if all(key in m for m in group):
                figures[name][label] = [m[key] for m in group]
        for key in group[0]:
            match = VALIDATION.fullmatch(key)
            if match and all(key in m for m in group):
                name = f"val_{re.sub(r'[^A-Za-z0-9_.-]', '_', match['source'])}"
                figures.setdefault(name, {})[label] = [m[key] for m in group]
                titles[name] = f"validation accuracy, {match['source']} ({key.rpartition('/')[2]})"
    return {name: (titles[name], lines) for name, lines in figures.items() if lines}


def plot_runs(
    runs: dict[str, Sequence[dict[str, dict[int, float]]]], out_dir: Path, only: Sequence[str] | None = None
) -> tuple[list[Path], list[str]]:
    """One PNG per metric with one line per label (``only``: these figures of :func:`figure_data`); returns the
    files written and the metrics no run has.

    A label holds one run (its curve) or several, e.g. the seeds of one method: then the line is their mean over the
    steps all of them logged, and a shaded band spans their minimum to maximum.
    """
    try:
        import matplotlib
    except ImportError:
        raise ReportError("plots need matplotlib: pip install 'stapo-verl[plot]' (or pip install matplotlib)") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures = figure_data(runs)
    written, missing = [], [name for name in PLOTS if name not in figures]
    for name, (label_text, lines) in figures.items():
        if only is not None and name not in only:
            continue
        figure, axes = plt.subplots(figsize=(6.4, 4.0))
        for label, series in lines.items():
            steps, mean, low, high = band(series)
            marker = "o" if len(steps) <= 60 else None  # sparse series (validation) stay visible
            line = axes.plot(steps, mean, label=label, linewidth=1.2, marker=marker, markersize=3)[0]
            if len(series) > 1:
                axes.fill_between(steps, low, high, color=line.get_color(), alpha=0.2, linewidth=0)
        axes.set(xlabel="step", ylabel=label_text, title=label_text)
        axes.grid(alpha=0.3)
        axes.legend()
        written.append(_save(figure, Path(out_dir) / f"{name}.png", plt))
    return written, missing


SILENCED, KEPT = "#d62728", "#ff9f1c"
"""Colours of the tokens S2T silences and of the candidates it keeps, in both pictures of :func:`plot_s2t`."""


def plot_s2t(batch, tokens: Sequence[Sequence[str]], names: Sequence[str], out_dir: Path, shown: int = 4) -> list[Path]:
    """Two pictures of the S2T mask over one mini-batch (``batch``: :class:`stapo.tools.inspect_tokens.MaskedBatch`,
    ``tokens``: each row's token texts, ``names``: each row's label), written to ``out_dir``:

    * ``s2t_scatter.png``: every token of the responses with Â > 0, probability against entropy, τ_p and τ_h drawn:
      the candidates lie left of τ_p; S2T silences those below τ_h (STAPO, arXiv 2602.15620, eq. I^S2T);
    * ``s2t_tokens.png``: up to ``shown`` responses with the most silenced tokens, the silenced tokens and the kept
      candidates highlighted (rows with candidates first).
    """
    try:
        import matplotlib
    except ImportError:
        raise ReportError(
            "pictures need matplotlib: pip install 'stapo-verl[plot]' (or pip install matplotlib)"
        ) from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tau_p, tau_h = batch.stats["tau_p"], batch.stats["entropy_threshold"]
    positive = batch.mask.bool() & (batch.advantages[:, None] > 0)
    candidates, silenced = batch.candidates, batch.silenced
    probs, entropy = batch.log_probs.exp(), batch.entropy
    figure, axes = plt.subplots(figsize=(6.4, 4.4))
    for label, chosen, colour, size in (
        (f"Â > 0, p ≥ τ_p ({int((positive & ~candidates).sum())})", positive & ~candidates, "#9e9e9e", 6),
        (f"candidate kept, H ≥ τ_h ({int((candidates & ~silenced).sum())})", candidates & ~silenced, KEPT, 18),
        (f"silenced by S2T ({int(silenced.sum())})", silenced, SILENCED, 18),
    ):
        axes.scatter(
            probs[chosen], entropy[chosen], s=size, color=colour, label=label, alpha=0.9, zorder=3 if size > 6 else 2
        )
    axes.set_xscale("log")
    axes.axvline(tau_p, color="black", linestyle="--", linewidth=1)
    axes.text(tau_p, axes.get_ylim()[0], f" τ_p = {tau_p:g}", va="bottom", fontsize=8)
    if not math.isnan(tau_h):
        axes.plot([axes.get_xlim()[0], tau_p], [tau_h, tau_h], color="black", linestyle=":", linewidth=1)
        axes.text(axes.get_xlim()[0], tau_h, f" τ_h = {tau_h:.3f} (q = {batch.stats['q']:g} of the candidates)",
                  va="bottom", fontsize=8)  # fmt: skip
    axes.set(xlabel="probability p of the sampled token", ylabel="entropy H (nats)")
    axes.set_title("S2T: tokens of responses with a positive advantage", fontsize=10)
    axes.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2, frameon=False)
    axes.grid(alpha=0.3)
    written = [_save(figure, Path(out_dir) / "s2t_scatter.png", plt)]

    order = sorted(range(len(tokens)), key=lambda r: (-int(silenced[r].sum()), -int(candidates[r].sum())))
    rows = [r for r in order if candidates[r].any()][:shown] or order[:1]
    size, columns = 8, 130
    lines: list[list[tuple[str, str | None]]] = []  # per line: (text, highlight colour)
    for row in rows:
        lines.append([(f"{names[row]}   Â = {float(batch.advantages[row]):+.2f}", "header")])
        line, used = [], 0
        for position, text in enumerate(tokens[row]):
            text = "".join(c if c.isprintable() else "·" for c in text.replace("\n", "↵"))  # no font draws \x1e
            if used + len(text) > columns and line:
                lines.append(line)
                line, used = [], 0
            colour = SILENCED if silenced[row, position] else KEPT if candidates[row, position] else None
            line.append((text, colour))
            used += len(text)
        lines += [line, []]
    step, char = 1.7 * size / 72, 0.6 * size / 72  # DejaVu Sans Mono's advance is 0.6 em
    width_in = 0.4 + char * max(40, *(sum(len(text) for text, _ in line) for line in lines))
    figure = plt.figure(figsize=(width_in, step * (len(lines) + 3)))
    axes = figure.add_axes((0, 0, 1, 1))
    axes.set(xlim=(0, width_in), ylim=(step * (len(lines) + 3), 0))
    axes.axis("off")
    axes.text(0.2, step, "silenced by S2T", fontsize=size, family="monospace", va="center",
              bbox={"facecolor": SILENCED, "alpha": 0.6, "pad": 1, "linewidth": 0})  # fmt: skip
    axes.text(0.2 + 17 * char, step, "candidate kept (H ≥ τ_h)", fontsize=size, family="monospace", va="center",
              bbox={"facecolor": KEPT, "alpha": 0.6, "pad": 1, "linewidth": 0})  # fmt: skip
    for number, line in enumerate(lines, start=3):
        x = 0.2
        for text, colour in line:
            style = (
                {"bbox": {"facecolor": colour, "alpha": 0.6, "pad": 1, "linewidth": 0}}
                if colour not in (None, "header")
                else {}
            )
            weight = "bold" if colour == "header" else "normal"
            axes.text(x, number * step, text, fontsize=size, family="monospace", va="center", weight=weight, **style)
            x += len(text) * char
    written.append(_save(figure, Path(out_dir) / "s2t_tokens.png", plt))
    return written


def _save(figure, path: Path, plt) -> Path:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=120, bbox_inches="tight")
    plt.close(figure)
    write_atomic(path, buffer.getvalue())
    return path
