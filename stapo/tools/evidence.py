"""Records of GPU runs (``evidence/<name>/``) and what is derived from them.

    python -m stapo.tools.evidence card --out DIR --commit SHA --command "..." [--note "..."]
    python -m stapo.tools.evidence collect RUNS_DIR evidence/NAME      # a run's records, small and gzipped

``card`` writes ``DIR/card.json`` on the machine that runs: the command as typed, the commit, the GPUs (model and
count), the CPU cores, the start time, the versions of torch, vLLM and verl, and a note of what else ran on the host.
``collect`` copies what the pages read from an experiment folder (``experiment run --out``): ``experiment.json``, and
per run its metrics (gzipped), exit code and the last lines of its log; nothing per token, no checkpoints.
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import json
import os
import shutil
import subprocess
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path

from stapo.tools.io import write_atomic

LOG_TAIL = 200
"""Lines kept of each run's log."""
MAX_FILE_BYTES = 2 << 20
"""No record file over 2 MB (issue 52): per-token dumps and checkpoints stay out."""


def gpus() -> list[str]:
    """The GPUs' names as ``nvidia-smi`` gives them (none where it is absent)."""
    try:
        done = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in done.stdout.splitlines() if line.strip()] if done.returncode == 0 else []


def card(command: str, commit: str, note: str = "") -> dict:
    """What a record's ``card.json`` holds about its run (module docstring)."""
    versions = {}
    for package in ("torch", "vllm", "verl", "stapo-verl"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = None
    found = gpus()
    return {
        "command": command,
        "commit": commit,
        "gpu": found[0] if found else None,
        "gpu_count": len(found),
        "cpu_cores": os.cpu_count(),
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": versions,
        "host_note": note,
    }


def collect(runs: Path, dest: Path) -> list[Path]:
    """Copy the records of the experiment folder ``runs`` into ``dest`` (module docstring); returns what was written.
    A file over :data:`MAX_FILE_BYTES` stops the copy with one line."""
    written = []
    if (runs / "experiment.json").is_file():
        written.append(dest / "experiment.json")
        write_atomic(written[-1], (runs / "experiment.json").read_text())
    for run in sorted(p for p in (runs / "runs").iterdir() if p.is_dir()):
        target = dest / "runs" / run.name
        target.mkdir(parents=True, exist_ok=True)
        if (run / "metrics.jsonl").is_file():
            with open(run / "metrics.jsonl", "rb") as source, gzip.open(target / "metrics.jsonl.gz", "wb", 9) as out:
                shutil.copyfileobj(source, out)
            written.append(target / "metrics.jsonl.gz")
        if (run / "exit_code").is_file():
            written.append(target / "exit_code")
            write_atomic(written[-1], (run / "exit_code").read_text())
        if (run / "train.log").is_file():
            lines = (run / "train.log").read_text(errors="replace").splitlines()[-LOG_TAIL:]
            written.append(target / "train.log.tail")
            write_atomic(written[-1], "\n".join(lines) + "\n")
    for path in written:
        if path.stat().st_size > MAX_FILE_BYTES:
            raise SystemExit(f"error: {path}: {path.stat().st_size} bytes, over the records' 2 MB; keep less of it")
    return written


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m stapo.tools.evidence", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    make = commands.add_parser("card", help="write DIR/card.json for a run starting now")
    make.add_argument("--out", type=Path, required=True)
    make.add_argument("--commit", required=True, help="the commit the run uses")
    make.add_argument("--command", dest="typed", required=True, help="the command as typed")
    make.add_argument("--note", default="", help="what else ran on the host (e.g. 'nothing')")
    copy = commands.add_parser("collect", help="copy an experiment folder's records into evidence/NAME")
    copy.add_argument("runs", type=Path, metavar="RUNS_DIR")
    copy.add_argument("dest", type=Path, metavar="DEST")
    args = parser.parse_args(argv)
    if args.command == "card":
        args.out.mkdir(parents=True, exist_ok=True)
        write_atomic(args.out / "card.json", json.dumps(card(args.typed, args.commit, args.note), indent=1) + "\n")
        print(args.out / "card.json")
    else:
        if not (args.runs / "runs").is_dir():
            raise SystemExit(f"error: {args.runs}: no runs/ folder; pass the folder `experiment run --out` wrote")
        for path in collect(args.runs, args.dest):
            print(path)


if __name__ == "__main__":
    main()
