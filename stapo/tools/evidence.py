"""Records of GPU runs (``evidence/<name>/``) and the evidence pages generated from them (``docs/evidence/``).

    python -m stapo.tools.evidence card --out DIR --commit SHA --command "..." [--note "..."]
    python -m stapo.tools.evidence collect RUNS_DIR evidence/NAME      # a run's records, small and gzipped
    python -m stapo.tools.evidence keep OUT evidence/NAME              # a GPU script's output folder's, the same way
    python -m stapo.tools.report evidence [--check]                    # the pages' tables and figures, from records

``card`` writes ``DIR/card.json`` on the machine that runs: the command as typed, the commit, the GPUs (model and
count), the CPU cores, the start time, the versions of torch, vLLM and verl, and a note of what else ran on the host.
``collect`` copies what the pages read from an experiment folder (``experiment run --out``): ``experiment.json``, and
per run its metrics (gzipped), exit code, ``args.txt`` where the run has one and the last lines of its log; nothing per
token, no checkpoints. ``keep`` does the same for any GPU script's output folder (``scripts/gpu/*.sh OUT``), folder for
folder: JSON, Markdown, text and exit codes as they are, JSON lines gzipped, logs' last lines; no models, checkpoints
or data.

A page of ``docs/evidence/`` is prose with generated blocks, each between ``<!-- evidence:KIND ARGS -->`` and
``<!-- /evidence -->`` (:data:`BLOCKS`): ``report evidence`` rewrites every block from the records it names, and with
``--check`` changes nothing and exits 1 naming each block or figure that differs from what the records give. A figure
is checked by its data: beside ``FIG.png`` lies ``FIG.json``, the plotted series, and the picture is drawn again only
when they change (matplotlib's bytes differ between versions; the data do not).
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import hashlib
import json
import os
import re
import shutil
import statistics
import subprocess
from collections.abc import Callable, Sequence
from importlib import metadata
from pathlib import Path

from stapo.s2t import DEFAULTS, distinct_silenced
from stapo.tools.curves import (
    ReportError,
    band,
    compare,
    compared_steps,
    every_key,
    figure_data,
    gradient_steps,
    mean_over,
    parting,
    plot_runs,
    read_metrics,
    read_runs,
)
from stapo.tools.decisive import report as decisive_report
from stapo.tools.io import output_problem, write_atomic
from stapo.tools.selection import report as selection_report

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


def _keep_file(source: Path, target: Path) -> Path:
    """One record file: ``*.jsonl`` gzipped (``NAME.jsonl.gz``), ``*.log`` as its last :data:`LOG_TAIL` lines
    (``NAME.log.tail``), anything else as it is; returns what was written."""
    target.parent.mkdir(parents=True, exist_ok=True)
    if source.suffix == ".jsonl":
        target = target.with_name(target.name + ".gz")
        with open(source, "rb") as data, gzip.open(target, "wb", 9) as out:
            shutil.copyfileobj(data, out)
    elif source.suffix == ".log":
        target = target.with_name(target.name + ".tail")
        write_atomic(target, "\n".join(source.read_text(errors="replace").splitlines()[-LOG_TAIL:]) + "\n")
    else:
        write_atomic(target, source.read_text())
    return target


def _within_limit(written: list[Path]) -> list[Path]:
    for path in written:
        if path.stat().st_size > MAX_FILE_BYTES:
            raise SystemExit(f"error: {path}: {path.stat().st_size} bytes, over the records' 2 MB; keep less of it")
    return written


def collect(runs: Path, dest: Path) -> list[Path]:
    """Copy the records of the experiment folder ``runs`` into ``dest`` (module docstring); returns what was written.
    A file over :data:`MAX_FILE_BYTES` stops the copy with one line."""
    written = []
    if (runs / "experiment.json").is_file():
        written.append(_keep_file(runs / "experiment.json", dest / "experiment.json"))
    for run in sorted(p for p in (runs / "runs").iterdir() if p.is_dir()):
        # args.txt: a run's scripts/train.sh arguments (stapo.tools.cost)
        for name in ("metrics.jsonl", "exit_code", "args.txt", "train.log"):
            if (run / name).is_file():
                written.append(_keep_file(run / name, dest / "runs" / run.name / name))
    return _within_limit(written)


KEPT = {".json", ".jsonl", ".md", ".txt", ".log", "exit_code"}
"""What :func:`keep` takes of a GPU script's output folder, by suffix or name; models, checkpoints, data and figures
are left."""


def keep(out: Path, dest: Path) -> list[Path]:
    """Copy the records of a GPU script's output folder ``out`` (e.g. ``scripts/gpu/bitwise.sh OUT``) into ``dest``,
    folder for folder: the files of :data:`KEPT` by :func:`_keep_file`, outside any folder that holds a
    model (``*.safetensors``) or a checkpoint (``checkpoints``, ``global_step_*``). A file over :data:`MAX_FILE_BYTES`
    stops the copy with one line."""
    written = []
    for folder, names, files in os.walk(out):
        here = Path(folder)
        if here.name == "checkpoints" or here.name.startswith("global_step_") or any(here.glob("*.safetensors")):
            names.clear()
            continue
        names.sort()
        for name in sorted(files):
            if (Path(name).suffix in KEPT or name in KEPT) and (here / name).is_file():
                written.append(_keep_file(here / name, dest / here.relative_to(out) / name))
    return _within_limit(written)


# ------------------------------------------------------------------------------------------------- the pages
RECORDS, PAGES = Path("evidence"), Path("docs/evidence")
"""Where the records and the generated pages lie, relative to the repository's root."""
BLOCK = re.compile(r"<!-- evidence:(?P<kind>\w+) (?P<args>[^>]*?) -->\n(?P<body>.*?)<!-- /evidence -->", re.DOTALL)


class EvidenceError(ValueError):
    """A page names a record or a block that does not exist; the message names the page and the fix."""


def _cell(value) -> str:
    return "-" if value is None else str(value).replace("|", "\\|")


def card_block(root: Path, name: str) -> str:
    """The record's ``card.json`` as a table (with what was noted after the run, where the card has it)."""
    fields = json.loads((root / RECORDS / name / "card.json").read_text())
    versions = ", ".join(f"{k} {v}" for k, v in fields.get("versions", {}).items() if v)
    rows = [
        ("command", f"`{fields['command']}`"),
        ("commit", f"`{fields['commit'][:10]}`"),
        ("machine", f"{fields['gpu_count']} × {fields['gpu']}, {fields['cpu_cores']} CPU cores"),
        ("started", fields["started"]),
        ("versions", versions),
        ("else on the host", fields.get("host_note") or "-"),
        *([("noted after the run", fields["host_note_after"])] if fields.get("host_note_after") else []),
    ]
    return "| card | |\n|---|---|\n" + "".join(f"| {k} | {_cell(v)} |\n" for k, v in rows)


def decisive_block(root: Path, *names: str) -> str:
    """The decisive test's table and verdict line (:func:`stapo.tools.decisive.report`)."""
    tables, verdict = decisive_report([root / RECORDS / name for name in names])
    return f"{tables}\n**{verdict}**\n"


def selection_block(root: Path, *names: str) -> str:
    """The masking ablation's main runs, their contrasts and one verdict line per contrast
    (:func:`stapo.tools.selection.report`)."""
    tables, lines = selection_report([root / RECORDS / name for name in names])
    return tables + "".join(f"\n**{line}**\n" for line in lines)


def smoke_block(root: Path, name: str) -> str:
    """Each run of an audited GPU smoke (``summary.jsonl``, one line per run as ``stapo.checks.gpu_smoke`` prints
    it): its time, the mask's counts per step against the rule's, the quantile pools that silenced exactly
    ⌈q(k − 1)⌉ of their k candidates, vLLM's agreement with the actor and the problems found; under the table, a
    run's overrides after ``--`` (:func:`_overrides_line`)."""
    rows, runs = [], [json.loads(line) for line in (root / RECORDS / name / "summary.jsonl").read_text().splitlines()]
    for run in runs:
        pools = run.get("pools") or []
        exact = sum(silenced == distinct_silenced(k, DEFAULTS.q) for k, silenced in pools)
        rows.append(
            [
                run["method"],
                run["trainer_mode"],
                f"{run['gpus']} × {run['nodes']} node",
                run["seconds"],
                run["steps"],
                " / ".join(f"{m:g}" for m in run.get("masked", [])) or "-",
                " / ".join(f"{m:g}" for m in run.get("expected", [])) or "-",
                f"{exact} of {len(pools)}" if pools else "-",
                f"{min(run['probs_correlation']):.6f}",
                "; ".join(run["problems"]) or "none",
            ]
        )
    head = ["run", "trainer", "GPUs", "seconds", "steps", "silenced per step", "rule's count per step",
            "pools with exactly ⌈q(k−1)⌉", "lowest vLLM–actor correlation", "problems"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    table = "\n".join(lines + ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]) + "\n"
    return table + "".join(_overrides_line(run) for run in runs)


def _overrides_line(run: dict) -> str:
    """A smoke run's overrides after ``--`` and, with verl's rollout correction, its weights' mean per step (check
    10 passed only if every loss call got the weights: the run's problems say)."""
    if not run.get("overrides"):
        return ""
    line = f"\n`{run['method']}` ran with {', '.join(f'`{o}`' for o in run['overrides'])}"
    if "rollout_is_mean" in run:
        means = " / ".join("-" if m is None else f"{m:.6f}" for m in run["rollout_is_mean"])
        line += f"; verl's `rollout_corr/rollout_is_mean` per step: {means}"
    return line + ".\n"


def image_block(root: Path, name: str) -> str:
    """A container image's record (``docker/build.sh`` run twice from one commit and lock): each build's time, image
    digest, revision label and ``STAPO_COMMIT``, the SHA-256 of ``pip freeze --all`` inside each image (equal sets,
    equal hashes), and the test suite's closing line inside the second."""
    folder = root / RECORDS / name
    fields = json.loads((folder / "card.json").read_text())
    rows = []
    for n in (1, 2):
        build, freeze = fields[f"build_{n}"], folder / f"freeze{n}.txt"
        image = build["image"]
        commit = next(e.split("=", 1)[1] for e in image["env"] if e.startswith("STAPO_COMMIT="))
        rows.append(
            [
                f"build {n}",
                f"{build['wall_seconds']:.0f}",
                f"`{image['manifest_digest'][:19]}…`",
                f"`{image['labels']['org.opencontainers.image.revision'][:10]}`",
                f"`{commit[:10]}`",
                " ".join(image["cmd"]),
                f"`{hashlib.sha256(freeze.read_bytes()).hexdigest()[:12]}…` ({len(freeze.read_bytes().splitlines())})",
            ]
        )
    head = [
        "",
        "seconds",
        "image digest",
        "revision label",
        "STAPO_COMMIT",
        "default command",
        "pip freeze --all (lines)",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    tests = re.findall(r"=+ (.*(?:passed|failed).*) in [\d.]+s", (folder / "pytest.out").read_text())
    same = (folder / "freeze1.txt").read_bytes() == (folder / "freeze2.txt").read_bytes()
    return "\n".join(lines) + (
        f"\n\nThe two images' installed package sets are {'equal' if same else 'NOT equal'}; the test suite inside "
        f"build 2: {tests[-1] if tests else 'no closing line'} (`pytest.out`).\n"
    )


def markdown_block(root: Path, name: str, path: str) -> str:
    """A Markdown file of the record as it is (e.g. the batch-invariance probe's table, written on the GPU host by
    ``stapo.checks.batch_invariance table``)."""
    return (root / RECORDS / name / path).read_text()


def update_line(metrics: Path, run: str) -> str:
    """Whether the updates of ``run`` (its ``metrics``) moved its weights: equal runs show the update and a resumed
    optimizer only when its ``actor/grad_norm`` was nonzero (:func:`stapo.tools.curves.gradient_steps`)."""
    moved, steps = gradient_steps(metrics)
    if moved:
        return f"The `{run}` run's `actor/grad_norm` was nonzero at {moved} of its {steps} steps."
    return (
        f"**The `{run}` run's `actor/grad_norm` was 0 at all {steps} steps**: every reward of a group was the "
        "same, every advantage 0, and only the weight decay changed the weights. The runs' equality shows the forward "
        "passes, the data order and where a resumed run goes on; it does not show the update or a resumed optimizer."
    )


def replay_block(root: Path, name: str, path: str = "replay/replay.json") -> str:
    """The replay check's verdicts (``stapo.checks.replay``'s ``replay.json``): per run compared with the replay run,
    the metrics and steps compared, the steps not compared (a run halted at step K may lack step K's line: verl
    0.9.1 writes the checkpoint before it logs the step), what differs; the last checkpoint's weights of every run."""
    record = json.loads((root / RECORDS / name / path).read_text())
    head = ["run against `replay`", "metrics compared", "steps compared", "steps not compared", "differing", "verdict"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for run, found in record["comparisons"].items():
        missing = sorted(set(range(1, record["steps"] + 1)) - set(found["steps"]))
        lost = [f"{k} (its line lost at the kill)" if run == f"halt{k}" else str(k) for k in missing]
        verdict = "equal to the bit" if found["equal"] else "DIFFERENT"
        steps = ", ".join(map(str, found["steps"]))
        cells = [run, found["metrics"], steps, ", ".join(lost) or "none", ", ".join(found["differ"]) or "none", verdict]
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    digests = sorted(set(record["weights_sha256"].values()), key=str)
    weights = (
        f"all {len(record['weights_sha256'])} runs `{digests[0][:16]}…`"
        if record["weights_equal"]
        else "; ".join(f"{run} `{str(d)[:16]}`" for run, d in record["weights_sha256"].items())
    )
    overall = "identical to the bit" if record["equal"] else "differ"
    update = update_line((root / RECORDS / name / path).parent / "replay" / "metrics.jsonl.gz", "replay")
    return "\n".join(lines) + f"\n\nWeights after step {record['steps']}: {weights}. Verdict: **{overall}**. {update}\n"


def twin_block(root: Path, name: str, first: str, second: str, verdicts: str = "replay.json") -> str:
    """Two real runs of one command and seed (``stapo.checks.replay --twin`` or ``--twin-halt``, the second then killed
    and resumed: ``determinism=full``, vLLM generating) compared at every metric but time and memory, at every step
    both logged, from their ``metrics.jsonl.gz``: the steps compared and those not (a halted twin may lack its halt
    step's line), the metrics equal at every step, the first step where any differs and what differs there
    (:func:`stapo.tools.curves.parting`), and whether the last weights are equal (the check's ``verdicts``, under the
    second run's name: ``twin`` or ``twin_halt``). A second run that failed is shown as failed."""
    folder = root / RECORDS / name
    verdict = json.loads((folder / verdicts).read_text())[second.replace("-", "_")]
    head = "| two runs of one seed | |\n|---|---|\n"
    if "failed" in verdict:
        return head + f"| `{second}` | failed: {_cell(verdict['failed'])} |\n"
    a, b = (read_metrics(folder / run / "metrics.jsonl.gz") for run in (first, second))
    found = compare(a, b, keys=every_key(a, b))
    where = parting(found)
    logged, missing = compared_steps(found, max((s for v in (*a.values(), *b.values()) for s in v), default=0))
    lost = " (its line lost at the kill)" if missing == [verdict.get("halt")] else ""
    rows = [("metrics compared", len(found)),
            ("steps compared", ", ".join(map(str, logged)) or "none"),
            ("steps not compared", ", ".join(map(str, missing)) + lost if missing else "none"),
            (f"equal at every step ({len(where['equal'])})", ", ".join(f"`{k}`" for k in where["equal"]) or "none"),
            ("first step where they part", where["first_step"] or "none"),
            ("logged by one run only", ", ".join(f"`{k}`" for k in where["one_sided"]) or "none")]  # fmt: skip
    if where["first_step"]:
        step = where["first_step"]
        shown = [
            k for k in ("critic/score/mean", "response_length/mean", "actor/grad_norm") if k in where["first_metrics"]
        ]
        values = "; ".join(f"`{k}` {a[k][step]:.6g} / {b[k][step]:.6g}" for k in shown)
        among = f", among them {values} ({first} / {second})" if values else ""
        rows.append((f"metrics that differ at step {step}", f"{len(where['first_metrics'])} of {len(found)}{among}"))
    rows.append(("last weights", "equal" if verdict["weights_equal"] else "different"))
    return head + "".join(f"| {k} | {_cell(v)} |\n" for k, v in rows)


MODE_PHASES = (("step", "timing_s/step"), ("generation", "timing_s/gen"), ("old log-probs", "timing_s/old_log_prob"),
               ("update", "timing_s/update_actor"))  # fmt: skip
"""The phases :func:`modes_block` shows, as verl 0.9.1 times them."""


def modes_block(root: Path, name: str, *runs: str) -> str:
    """Runs of ``scripts/gpu/modes.sh`` side by side (run folders ``MODE-N``, each with ``exit_code`` and
    ``metrics.jsonl.gz``): per run the mean seconds of each phase over its steps after the first (the first pays
    vLLM's and the kernels' first use; ``colocate_async`` generates the next batch while one trains, so a mean over
    whole cycles is what compares) and the mean response length; then each mode's mean step over its runs, and its
    ratio to ``sync``'s."""
    folder, steps_of = root / RECORDS / name, {}
    head = ["run", "exit", "steps averaged", *(f"{phase} s" for phase, _ in MODE_PHASES), "response length"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for run in runs:
        metrics = read_metrics(folder / run / "metrics.jsonl.gz")
        steps = sorted(metrics.get("timing_s/step", {}))[1:]
        if not steps:
            raise EvidenceError(f"{name}/{run}: fewer than two steps logged; nothing to average")
        mean = {
            key: mean_over(metrics.get(key, {}), steps) for key in (*dict(MODE_PHASES).values(), "response_length/mean")
        }
        steps_of.setdefault(run.rsplit("-", 1)[0], []).append(mean["timing_s/step"])
        cells = [run, (folder / run / "exit_code").read_text().strip(), f"{steps[0]}-{steps[-1]}",
                 *(f"{mean[key]:.1f}" for _, key in MODE_PHASES), f"{mean['response_length/mean']:.0f}"]  # fmt: skip
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    sync = statistics.fmean(steps_of["sync"]) if "sync" in steps_of else None
    shown = []
    for mode, steps in steps_of.items():
        ratio = f", {statistics.fmean(steps) / sync:.2f} × sync" if sync and mode != "sync" else ""
        shown.append(f"{mode} {statistics.fmean(steps):.1f} s ({len(steps)} run{'s' * (len(steps) != 1)}{ratio})")
    return "\n".join(lines) + "\n\nMean step after the first, per mode: " + "; ".join(shown) + ".\n"


def locate_block(root: Path, name: str, path: str = "locate.json") -> str:
    """A ``stapo.checks.batch_invariance locate`` record: what the engine chose and how the outputs were recorded,
    then per request the batch it was decoded in beside its partners (records before ``--partner many``: 2), the passes
    alone and beside them, whether its tokens differ, and the first module whose output differed (with the pass and
    the largest difference), or none."""
    record = json.loads((root / RECORDS / name / path).read_text())
    chosen = record["attention"]
    version = f", FlashAttention {chosen['flash_attn_version']}" if chosen["flash_attn_version"] else ""
    lines = [
        f"Engine: {chosen['backend']} ({chosen['implementation']}{version}), "
        f"{'seeded T = 1' if not record['greedy'] else 'greedy'}, {record['max_tokens']} tokens a request, "
        f"`--partner {record.get('partner', 'same')}`, {'the recipe' if record.get('norm_patched') else 'vLLM'}'s "
        f"residual norm; {record['hooks']} modules hooked, sampler: {record['sampler']}.",
        "",
        "| request seed | batch beside (prefill tokens) | passes alone / beside | tokens differ | first module that "
        "differs | pass | largest gap |",
        "|---|---|---|---|---|---|---|",
    ]
    for found in record["requests_located"]:
        module = found.get("module")
        where = [found.get("pass", "-"), found.get("max_abs_diff", "-")]
        passes, differ = " / ".join(map(str, found["passes"])), "yes" if found["tokens_differ"] else "no"
        batch = f"{found.get('batch', 2)}" + (f" ({found['prefill_tokens'][1]})" if "prefill_tokens" in found else "")
        cells = [found["seed"], batch, passes, differ, f"`{module}`" if module else "none", *where]
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    counts = ", ".join(f"{module} {n}" for module, n in record["first_modules"].items())
    return "\n".join(lines) + f"\n\nFirst modules over the requests: {counts}.\n"


def runs_block(root: Path, name: str, reference: str, *runs: str) -> str:
    """Runs of one recording compared with the ``reference`` run at every metric but time and memory
    (:func:`stapo.tools.curves.every_key`), at the steps both logged, from each run folder's ``metrics.jsonl.gz``:
    its exit code (``exit_code``), the steps it logged, the step it saved at on a signal or a deadline (the trainer's
    ``STAPO: saved step N`` line in ``train.log.tail``), and whether every value is equal to the bit."""
    import re as regex

    folder = root / RECORDS / name
    base = read_metrics(folder / reference / "metrics.jsonl.gz")
    head = [f"run against `{reference}`", "watcher (0: exit as expected)", "steps logged", "saved, stopped",
            "metrics compared", "differing", "verdict"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for run in runs:
        other = read_metrics(folder / run / "metrics.jsonl.gz")
        found = compare(base, other, keys=every_key(base, other))
        differ = sorted(key for key, values in found.items() if not values["equal"])
        steps = sorted({step for values in found.values() for step, _, _ in values["rows"]})
        log = (folder / run / "train.log.tail").read_text()
        saved = regex.search(r"^STAPO: saved step (\d+) in \S+ \(([^;)]*)", log, regex.M)
        reason = saved and ("the deadline" if saved[2].startswith("the deadline") else saved[2].split(" at ")[0])
        stop = f"step {saved[1]} ({reason})" if saved else "no"
        verdict = "equal to the bit at the steps compared" if not differ else "DIFFERENT"
        cells = [run, (folder / run / "exit_code").read_text().strip(), ", ".join(map(str, steps)), stop, len(found),
                 ", ".join(differ) or "none", verdict]  # fmt: skip
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(lines) + f"\n\n{update_line(folder / reference / 'metrics.jsonl.gz', reference)}\n"


def startup_block(root: Path, name: str, *runs: str) -> str:
    """Launches side by side (``stapo.checks.startup run``'s ``phases.json`` of each run folder): when each phase's
    marker line appeared, seconds since launch and since the phase before, and each process kind's count and first
    line."""
    found = {run: json.loads((root / RECORDS / name / run / "phases.json").read_text()) for run in runs}
    cuts = " | ".join(
        f"{run} (`STAPO_STARTUP_CUTS={r['environment'].get('STAPO_STARTUP_CUTS')}`)" for run, r in found.items()
    )
    lines = [
        f"| phase: first line, s since launch (+ s since the phase before) | {cuts} |",
        "|---|" + "---:|" * len(runs),
    ]
    for i, marker in enumerate(next(iter(found.values()))["markers"]):
        marks = [r["markers"][i] for r in found.values()]
        cells = ["-" if m["at_s"] is None else f"{m['at_s']:.1f} (+{m['phase_s']:.1f})" for m in marks]
        lines.append(f"| {marker['phase']} | " + " | ".join(cells) + " |")
    kinds = list(dict.fromkeys(k["kind"] for r in found.values() for k in r["processes"]))
    lines += ["", "| process kind: processes, first line s | " + " | ".join(runs) + " |", "|---|" + "---:|" * len(runs)]
    for kind in kinds:
        cells = []
        for r in found.values():
            row = next((k for k in r["processes"] if k["kind"] == kind), None)
            cells.append("-" if row is None else f"{row['pids'] or 1} at {row['first_s']}")
        lines.append(f"| {kind} | " + " | ".join(cells) + " |")
    stopped = "; ".join(f"{run}: {r['stopped']}" for run, r in found.items())
    return "\n".join(lines) + f"\n\nStopped: {stopped}.\n\n{first_steps(found)}\n"


def first_steps(found: dict[str, dict]) -> str:
    """When the first step began, per kind of launch (a run folder's name without its ``-N``): each launch in order
    and the median, the issue's measure (issue 55)."""
    kinds: dict[str, list[float | None]] = {}
    for run, record in found.items():
        began = next(m["at_s"] for m in record["markers"] if m["phase"] == "first step begins")
        kinds.setdefault(re.sub(r"-\d+$", "", run), []).append(began)
    parts = []
    for kind, times in kinds.items():
        shown = ", ".join("-" if t is None else f"{t:.1f}" for t in times)
        middle = "-" if None in times else f"{statistics.median(times):.1f}"
        parts.append(f"{kind}: {shown} (median {middle})")
    return "First step began, s since launch: " + "; ".join(parts) + "."


def record_runs(folder: Path) -> dict[str, list[dict[str, dict[int, float]]]]:
    """``label -> [metrics of each run]`` of a record: an experiment's runs grouped by method (``runs/METHOD-sSEED``),
    or one run per folder holding ``metrics.jsonl.gz``."""
    if (folder / "runs").is_dir():
        return {method: [seeds[s] for s in sorted(seeds)] for method, seeds in read_runs(folder).items()}
    logs = sorted(folder.glob("*/metrics.jsonl.gz"))
    return {log.parent.name: [read_metrics(log)] for log in logs}


def curves_block(root: Path, name: str, *figures: str, check: bool = False) -> tuple[str, list[str]]:
    """Links to the record's figures (``docs/evidence/img/NAME/FIG.png``, mean over seeds with a min-max band,
    :func:`stapo.tools.curves.plot_runs`) and the figures that differ from their data (drawn again unless
    ``check``)."""
    runs = record_runs(root / RECORDS / name)
    data = figure_data(runs)
    unknown = [f for f in figures if f not in data]
    if unknown:
        raise EvidenceError(f"{name}: no figure {', '.join(unknown)}; the record has {', '.join(data)}")
    folder, stale = root / PAGES / "img" / name, []
    for figure in figures:
        title, lines = data[figure]
        series = {label: dict(zip(("steps", "mean", "min", "max"), band(runs))) for label, runs in lines.items()}
        text = json.dumps({"title": title, "lines": series}, indent=1) + "\n"
        sidecar = folder / f"{figure}.json"
        if not (sidecar.is_file() and sidecar.read_text() == text and sidecar.with_suffix(".png").is_file()):
            stale.append(str(sidecar.with_suffix(".png").relative_to(root)))
            if not check:
                plot_runs(runs, folder, only=[figure])
                write_atomic(sidecar, text)
    return " ".join(f"![{f}](img/{name}/{f}.png)" for f in figures) + "\n", stale


BLOCKS: dict[str, Callable[..., str]] = {
    "card": card_block,
    "decisive": decisive_block,
    "selection": selection_block,
    "smoke": smoke_block,
    "image": image_block,
    "markdown": markdown_block,
    "replay": replay_block,
    "runs": runs_block,
    "modes": modes_block,
    "locate": locate_block,
    "twin": twin_block,
    "startup": startup_block,
}
"""Block kinds and what writes them (``curves``, which also draws, is :func:`curves_block`)."""


def regenerate(root: Path, check: bool) -> list[str]:
    """Rewrite every generated block of ``root/docs/evidence/*.md`` (and its figures) from the records; with
    ``check``, write nothing. Returns what differed (pages and figures), empty when everything equals the records."""
    differs = []
    pages = sorted((root / PAGES).glob("*.md"))
    if not pages:
        raise EvidenceError(f"{root / PAGES}: no pages; run from the repository's root or pass --root")
    for page in pages:
        text = page.read_text()

        def fill(match: re.Match) -> str:
            kind, args = match["kind"], match["args"].split()
            try:
                if kind == "curves":
                    body, stale = curves_block(root, *args, check=check)
                    differs.extend(stale)
                elif kind in BLOCKS:
                    body = BLOCKS[kind](root, *args)
                else:
                    raise EvidenceError(f"unknown block kind {kind!r}; use one of curves, {', '.join(BLOCKS)}")
            except (OSError, TypeError, EvidenceError, ReportError, SystemExit) as error:
                raise EvidenceError(f"{page.relative_to(root)}: block '{kind} {' '.join(args)}': {error}") from None
            if body != match["body"]:
                differs.append(f"{page.relative_to(root)}: block '{kind} {' '.join(args)}'")
            return match.group(0)[: match.start("body") - match.start()] + body + "<!-- /evidence -->"

        new = BLOCK.sub(fill, text)
        if new != text and not check:
            write_atomic(page, new)
    return differs


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
    take = commands.add_parser("keep", help="copy a GPU script's output folder's records into evidence/NAME")
    take.add_argument("source", type=Path, metavar="OUT", help="the folder the script wrote (e.g. bitwise.sh OUT)")
    take.add_argument("dest", type=Path, metavar="DEST")
    args = parser.parse_args(argv)
    out = args.out if args.command == "card" else args.dest
    if problem := output_problem(out, "folder", "--out" if args.command == "card" else "DEST"):
        parser.exit(2, f"error: {problem}\n")
    if args.command == "card":
        if not re.fullmatch(r"[0-9a-f]{7,40}", args.commit):
            parser.exit(2, f"error: --commit {args.commit}: not a commit hash; pass `git rev-parse HEAD`\n")
        args.out.mkdir(parents=True, exist_ok=True)
        write_atomic(args.out / "card.json", json.dumps(card(args.typed, args.commit, args.note), indent=1) + "\n")
        print(args.out / "card.json")
    elif args.command == "collect":
        if not (args.runs / "runs").is_dir():
            raise SystemExit(f"error: {args.runs}: no runs/ folder; pass the folder `experiment run --out` wrote")
        for path in collect(args.runs, args.dest):
            print(path)
    else:
        if not args.source.is_dir():
            raise SystemExit(f"error: OUT {args.source}: not a folder; pass the folder the GPU script wrote")
        for path in keep(args.source, args.dest):
            print(path)


if __name__ == "__main__":
    main()
