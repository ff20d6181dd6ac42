"""Paper-style result tables and training curves (STAPO, arXiv 2602.15620).

    python -m stapo.tools.report table [SUMMARY|DIR ...] [--paper] [--method stapo] [--out DIR]
    python -m stapo.tools.report plot [LABEL=]LOG [[LABEL=]LOG ...] [--out DIR]
    python -m stapo.tools.report evidence [--check] [--root DIR]

``table`` reads the ``summary.json`` files of ``python -m stapo.tools.evaluate`` (each labelled with its method and
size) and writes the paper's main table as ``table.md``, ``table.tex`` and ``table.csv``: avg@n on the six benchmarks,
their mean (Avg) and the relative gain of ``--method`` over the strongest other method at the same size and preset.
``--paper`` adds the published table of the paper's v1-v3 (stapo/tools/paper_table.json), alone or side by side with the
runs; the recipe follows v4, whose per-benchmark table is not public in a form this project has.

``plot`` draws actor entropy, mean reward, response length, validation accuracy, ``stapo/masked_frac`` and the
``s2t/*`` share of flagged tokens and of their gradient-norm bound against the step, one line per run, from verl's file
logger (JSONL), its console output or a TensorBoard run folder. docs/evaluation.md shows examples.

``evidence`` regenerates the tables and figures of the evidence pages (docs/evidence/) from the GPU runs' records
(evidence/); ``--check`` writes nothing and exits 1 if a page or figure differs from them (:mod:`stapo.tools.evidence`).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from stapo.config import methods, sizes, title
from stapo.tools.curves import PLOTS, ReportError, plot_runs, read_metrics
from stapo.tools.data import BENCHMARKS
from stapo.tools.evaluate import PRESETS, SUMMARY_FILE
from stapo.tools.io import output_problem, write_atomic

BENCHMARK_TITLES = ("AIME24", "AIME25", "AMC23", "MATH500", "Minerva", "Olympiad")
SOURCES = ("paper", "ours")
DEFAULT_REPORT = Path("outputs/report")


@dataclass(frozen=True)
class Entry:
    """One table row under one decoding preset: the six benchmark scores, then Avg (None where missing)."""

    source: str  # "paper" or "ours"
    size: str
    method: str
    preset: str
    scores: tuple[float | None, ...]

    @property
    def average(self) -> float | None:
        return self.scores[-1]


# ---------------------------------------------------------------------------------------------------------- tables
def paper_table() -> dict:
    """The published v1-v3 table with its headline numbers and notes (stapo/tools/paper_table.json)."""
    return json.loads(resources.files("stapo.tools").joinpath("paper_table.json").read_text(encoding="utf-8"))


def method_order() -> list[str]:
    """The configs' methods in the paper's table order (then any other method)."""
    paper = list(dict.fromkeys(row["method"] for row in paper_table()["rows"]))
    return [m for m in paper if m in methods()] + [m for m in methods() if m not in paper]


def paper_entries() -> list[Entry]:
    """The published table as entries (Avg as published)."""
    return [
        Entry("paper", row["size"], row["method"], preset, tuple(row[preset]))
        for row in paper_table()["rows"]
        for preset in PRESETS
    ]


def find_summaries(paths: Iterable[Path]) -> list[Path]:
    """``summary.json`` files given directly or found below the given folders."""
    found = []
    for path in map(Path, paths):
        if path.is_dir():
            found += sorted(path.rglob(SUMMARY_FILE))
        elif path.is_file():
            found.append(path)
        else:
            raise ReportError(f"{path}: no such file or folder")
    return found


def summary_entry(path: Path) -> Entry:
    """The entry of one eval summary; it must carry known method, size and preset labels."""
    try:
        summary = json.loads(Path(path).read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ReportError(
            f"{path}: not a summary.json of `python -m stapo.tools.evaluate` ({type(error).__name__}); pass its "
            "summary.json files or the folders holding them"
        ) from None
    if not isinstance(summary, dict) or not isinstance(summary.get("benchmarks"), dict):
        raise ReportError(f"{path}: not a summary.json of `python -m stapo.tools.evaluate` (no benchmarks in it)")
    for field, allowed in (("method", methods()), ("size", sizes()), ("preset", tuple(PRESETS))):
        if summary.get(field) not in allowed:
            raise ReportError(
                f"{path}: field {field!r} is {summary.get(field)!r}, expected one of {', '.join(allowed)}; re-run "
                f"`python -m stapo.tools.evaluate` with --{field} (finished samples are reused) or set it in the file"
            )
    scores = [summary["benchmarks"].get(bench, {}).get("avg") for bench in BENCHMARKS]
    return Entry("ours", summary["size"], summary["method"], summary["preset"], (*scores, summary.get("average")))


def load_entries(paths: Iterable[Path]) -> list[Entry]:
    """Entries of all summaries under ``paths``; two runs with the same method, size and preset are an error."""
    entries, origin = [], {}
    for path in find_summaries(paths):
        entry = summary_entry(path)
        key = (entry.size, entry.method, entry.preset)
        if key in origin:
            raise ReportError(f"{path} and {origin[key]} are both {' '.join(key)}; pass only one of them")
        origin[key] = path
        entries.append(entry)
    return entries


def relative_gains(entries: Sequence[Entry], method: str) -> dict[tuple[str, str], dict[str, float]]:
    """``(source, preset) -> {size: gain %}``: the relative gain in Avg of ``method`` over the strongest other method
    at that size, source and preset (the paper's definition), where both exist."""
    gains: dict[tuple[str, str], dict[str, float]] = {}
    for target in entries:
        if target.method != method or target.average is None:
            continue
        others = [
            e.average
            for e in entries
            if (e.source, e.size, e.preset) == (target.source, target.size, target.preset)
            and e.method != method
            and e.average is not None
        ]
        if others:
            gains.setdefault((target.source, target.preset), {})[target.size] = 100 * (target.average / max(others) - 1)
    return gains


def headline(gains: dict[str, float]) -> float:
    """The paper's headline number: the mean over sizes of the relative gains."""
    return statistics.fmean(gains.values())


@dataclass
class Table:
    """A rendered table: header, rows of cell strings, and the lines printed under it."""

    header: list[str]
    rows: list[list[str]]
    sizes: list[str]  # size of each row, for rules between sizes
    notes: list[str]


def _cell(values: Sequence[float | None], suffix: str = "") -> str:
    """``"a (b)"``: the first preset's value, the second's in parentheses (the paper's layout)."""
    texts = ["–" if v is None else f"{v:.2f}{suffix}" for v in values]
    return texts[0] if len(texts) == 1 else f"{texts[0]} ({', '.join(texts[1:])})"


def build_table(entries: Sequence[Entry], method: str = "stapo") -> Table:
    """The paper-style table of ``entries``; with both sources, each paper row is followed by the run's row."""
    presets = [p for p in PRESETS if any(e.preset == p for e in entries)]
    sources = [s for s in SOURCES if any(e.source == s for e in entries)]
    by_key = {(e.source, e.size, e.method, e.preset): e for e in entries}
    gains = relative_gains(entries, method)
    size_order, methods_order = sizes(), method_order()
    keys = sorted(
        {(e.size, e.method, e.source) for e in entries},
        key=lambda k: (size_order.index(k[0]), methods_order.index(k[1]), SOURCES.index(k[2])),
    )
    header = ["Size", "Method"] + (["Source"] if len(sources) > 1 else []) + [*BENCHMARK_TITLES, "Avg"]
    header.append(f"Gain of {title(method)}")
    rows, row_sizes = [], []
    for size, name, source in keys:
        found = [by_key.get((source, size, name, preset)) for preset in presets]
        cells = [_cell([e.scores[i] if e else None for e in found]) for i in range(len(BENCHMARKS) + 1)]
        gain = _cell([gains.get((source, p), {}).get(size) for p in presets], "%") if name == method else ""
        label = [title(size), title(name)] + ([source] if len(sources) > 1 else [])
        rows.append(label + cells + [gain])
        row_sizes.append(size)
    notes = [_presets_note(presets)]
    for source in sources:
        means = [f"{headline(gains[(source, p)]):.2f}% ({p})" for p in presets if gains.get((source, p))]
        if means:
            notes.append(f"{source}: mean relative gain of {title(method)} over sizes: {', '.join(means)}")
    if "paper" in sources:
        table = paper_table()
        published = table["headline"]
        notes += [
            "paper, published: "
            + ", ".join(
                f"{v.replace('_', '-')} {g['train']['mean']}% / {g['justrl']['mean']}%" for v, g in published.items()
            )
            + " (train / justrl)",
            *table["notes"],
        ]
    return Table(header, rows, row_sizes, notes)


def _presets_note(presets: Sequence[str]) -> str:
    described = [f"{p} (T={PRESETS[p].temperature}, top-p={PRESETS[p].top_p})" for p in presets]
    return "Cells: " + described[0] + "".join(f", in parentheses: {d}" for d in described[1:]) + "."


def to_markdown(table: Table) -> str:
    left = len(table.header) - len(BENCHMARKS) - 2
    lines = ["| " + " | ".join(table.header) + " |", "|" + "---|" * left + "--:|" * (len(BENCHMARKS) + 2)]
    lines += ["| " + " | ".join(row) + " |" for row in table.rows]
    return "\n".join(lines + [""] + [f"- {note}" for note in table.notes]) + "\n"


def _latex(text: str) -> str:
    for plain, escaped in (("\\", "\\textbackslash{}"), ("%", "\\%"), ("&", "\\&"), ("_", "\\_"), ("–", "--")):
        text = text.replace(plain, escaped)
    return text


def to_latex(table: Table) -> str:
    spec = "l" * (len(table.header) - len(BENCHMARKS) - 2) + "r" * (len(BENCHMARKS) + 2)
    lines = [f"\\begin{{tabular}}{{{spec}}}", "\\toprule", " & ".join(map(_latex, table.header)) + " \\\\", "\\midrule"]
    for i, row in enumerate(table.rows):
        if i and table.sizes[i] != table.sizes[i - 1]:
            lines.append("\\midrule")
        lines.append(" & ".join(map(_latex, row)) + " \\\\")
    lines += ["\\bottomrule", "\\end{tabular}"] + [f"% {note}" for note in table.notes]
    return "\n".join(lines) + "\n"


def _entry_order() -> Callable[[Entry], tuple[int, ...]]:
    """The sort key of entries: preset, source, size, then method in the paper's order."""
    presets, size_order, methods_order = list(PRESETS), sizes(), method_order()
    return lambda e: (
        presets.index(e.preset),
        SOURCES.index(e.source),
        size_order.index(e.size),
        methods_order.index(e.method),
    )


def to_csv(entries: Sequence[Entry], method: str = "stapo") -> str:
    """One line per entry and preset (long form), with the gain on ``method``'s lines."""
    gains = relative_gains(entries, method)
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(["source", "size", "method", "preset", *BENCHMARKS, "avg", f"gain_of_{method}_pct"])
    for e in sorted(entries, key=_entry_order()):
        gain = gains.get((e.source, e.preset), {}).get(e.size) if e.method == method else None
        values = ["" if v is None else f"{v:.4f}" for v in (*e.scores, gain)]
        writer.writerow([e.source, e.size, e.method, e.preset, *values])
    return buffer.getvalue()


def write_tables(entries: Sequence[Entry], out_dir: Path, method: str = "stapo") -> list[Path]:
    """Write table.md, table.tex and table.csv to ``out_dir``."""
    table = build_table(entries, method)
    texts = {"table.md": to_markdown(table), "table.tex": to_latex(table), "table.csv": to_csv(entries, method)}
    for name, text in texts.items():
        write_atomic(Path(out_dir) / name, text)
    return [Path(out_dir) / name for name in texts]


# ----------------------------------------------------------------------------------------------------------- plots
def parse_run_arg(value: str) -> tuple[str, Path]:
    """``LABEL=PATH`` or ``PATH`` (label: the file stem or folder name, i.e. verl's experiment name)."""
    label, sep, path = value.partition("=")
    if not sep:
        label, path = Path(value).stem if Path(value).is_file() else Path(value).name, value
    return label, Path(path)


# ------------------------------------------------------------------------------------------------------------- CLI
def main(argv: Sequence[str] | None = None) -> None:
    """Command-line entry point (``python -m stapo.tools.report``)."""
    parser = argparse.ArgumentParser(prog="python -m stapo.tools.report", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    table = commands.add_parser("table", help="paper-style table from eval summaries and/or the published one")
    table.add_argument("summaries", nargs="*", type=Path, help="summary.json files or folders holding them")
    table.add_argument(
        "--paper", action="store_true", help="add the paper's published table (v1-v3; v4's is not public)"
    )
    table.add_argument("--method", choices=methods(), default="stapo", help="method whose relative gain is shown")
    plot = commands.add_parser("plot", help="training curves from verl logs")
    plot.add_argument("runs", nargs="+", metavar="[LABEL=]LOG", help="file-logger JSONL, console log or TB folder")
    for command in (table, plot):
        command.add_argument("--out", type=Path, default=DEFAULT_REPORT, help=f"output folder ({DEFAULT_REPORT})")
    evidence = commands.add_parser("evidence", help="the evidence pages' tables and figures from the runs' records")
    evidence.add_argument("--check", action="store_true", help="write nothing; exit 1 if a page differs from them")
    evidence.add_argument("--root", type=Path, default=Path("."), help="the repository's root (default: here)")
    args = parser.parse_args(argv)
    if args.command == "evidence":
        from stapo.tools.evidence import PAGES, EvidenceError, regenerate

        if not (args.root / PAGES).is_dir():
            parser.exit(2, f"error: --root {args.root}: no {PAGES} folder there; run from the repository's root\n")
        try:
            differs = regenerate(args.root, args.check)
        except EvidenceError as error:
            parser.exit(2, f"error: {error}\n")
        for item in differs:
            print(f"{'differs from the records' if args.check else 'regenerated'}: {item}")
        if args.check and differs:
            parser.exit(1, f"error: {len(differs)} item(s) differ; run python -m stapo.tools.report evidence\n")
        print("evidence pages equal their records" if not differs else f"{len(differs)} item(s) regenerated")
        return
    try:
        if problem := output_problem(args.out, "folder"):
            raise ReportError(problem)
        if args.command == "table":
            if not args.summaries and not args.paper:
                raise ReportError("nothing to tabulate: pass summary files/folders, --paper, or both")
            entries = (paper_entries() if args.paper else []) + load_entries(args.summaries)
            if not entries:
                raise ReportError(f"no {SUMMARY_FILE} under {', '.join(map(str, args.summaries))}")
            paths = write_tables(entries, args.out, args.method)
            print(to_markdown(build_table(entries, args.method)))
        else:
            runs = dict(map(parse_run_arg, args.runs))
            if len(runs) != len(args.runs):
                raise ReportError("two logs share a label; name them LABEL=PATH")
            paths, missing = plot_runs({label: [read_metrics(path)] for label, path in runs.items()}, args.out)
            if missing:
                print(f"no run logged: {', '.join(PLOTS[name][0] for name in missing)}")
    except ReportError as error:
        parser.exit(2, f"error: {error}\n")
    print("wrote " + ", ".join(map(str, paths)))


if __name__ == "__main__":
    main()
