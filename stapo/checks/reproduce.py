"""Do two training runs compute the same numbers? A step-by-step comparison of their metrics.

    python -m stapo.checks.reproduce compare RUN_A RUN_B [--steps 4-6] [--all] [--out TABLE.md]

``RUN_A`` and ``RUN_B`` are what :func:`stapo.tools.curves.read_metrics` reads (verl's file-logger JSONL with the
segments a resumed run set aside, a console log, or a TensorBoard folder): the same command twice with
``determinism=full``, or a run against the same run killed after a checkpoint and resumed (``--steps`` then names the
steps after the checkpoint). For each of :data:`KEYS` (``--all``: every metric either logged but time and memory) the
table shows both values at every step both logged and the largest absolute difference; the verdict says whether every
value is equal to the bit. The exit code is 0 when they are, 1 when they differ (for scripts), 2 on bad input.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Sequence
from pathlib import Path

from stapo.tools.curves import ReportError, compare, every_key, read_metrics
from stapo.tools.io import output_problem, write_atomic

KEYS = (
    "critic/score/mean",
    "actor/entropy",
    "actor/pg_loss",
    "actor/grad_norm",
    "response_length/mean",
    "s2t/pos_adv_tokens",
    "s2t/candidate_tokens",
    "s2t/spurious_tokens",
    "stapo/masked_tokens",
    "timing_s/step",
)
"""What two runs of one command must share, step by step (the step time is shown, never compared)."""
TIMING = "timing_s/step"


def parse_steps(text: str | None) -> range | None:
    """``"4-6"`` -> steps 4 to 6; None for all."""
    if text is None:
        return None
    match = re.fullmatch(r"(\d+)-(\d+)", text)
    if not match or int(match[1]) > int(match[2]) or int(match[1]) < 1:
        raise ReportError(f"--steps {text}: give FIRST-LAST, e.g. 4-6")
    return range(int(match[1]), int(match[2]) + 1)


def to_markdown(result: dict, names: tuple[str, str]) -> str:
    """A table per key and the verdict (the step time is not part of it)."""
    lines = [f"| metric | step | {names[0]} | {names[1]} |", "|---|---:|---:|---:|"]
    for key, found in result.items():
        lines += [f"| {key} | {step} | {x:.10g} | {y:.10g} |" for step, x, y in found["rows"]]
    compared = {k: v for k, v in result.items() if k != TIMING}
    differ = [f"{k} (max |diff| {v['max_diff']:.3g})" for k, v in compared.items() if not v["equal"]]
    verdict = "identical to the bit" if compared and not differ else "differ: " + ", ".join(differ or ["no metric"])
    return "\n".join(lines) + f"\n\nverdict: {verdict}\n"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m stapo.checks.reproduce", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    pair = commands.add_parser("compare", help="two runs' metrics, step by step")
    pair.add_argument("runs", type=Path, nargs=2, metavar="RUN", help="metrics of each run (JSONL, log or TB folder)")
    pair.add_argument("--steps", help="FIRST-LAST: compare only these steps (after a resume's checkpoint)")
    pair.add_argument("--out", type=Path, help="write the table here too")
    pair.add_argument("--all", action="store_true", help="every metric either run logged, not only the main ones")
    args = parser.parse_args(argv)
    try:
        if args.out is not None and (problem := output_problem(args.out, "file")):
            raise ReportError(problem)
        steps = parse_steps(args.steps)
        a, b = (read_metrics(path) for path in args.runs)
        result = compare(a, b, every_key(a, b) if args.all else KEYS, steps)
        if not result:
            raise ReportError(
                "neither run logged any metric" if args.all else f"neither run logged any of {', '.join(KEYS)}"
            )
    except ReportError as error:
        parser.exit(2, f"error: {error}\n")
    table = to_markdown(result, tuple(str(path) for path in args.runs))
    if args.out is not None:
        write_atomic(args.out, table)
    print(table, end="")
    raise SystemExit(0 if table.endswith("identical to the bit\n") else 1)


if __name__ == "__main__":
    main()
