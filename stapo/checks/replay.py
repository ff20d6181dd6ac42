"""Is the training side exact on its own? Runs that train on one recording of rollouts, compared to the bit.

    python -m stapo.checks.replay run --model DIR --data DIR --out DIR [--steps 6] [--halt 2 3] [--signal K]
                                      [--deadline SECONDS] [--twin] [--twin-halt K] [-- OVERRIDE ...]
    python -m stapo.checks.replay halt --at STEP --checkpoints DIR -- COMMAND ...
    python -m stapo.checks.replay watch --metrics FILE --times FILE [--signal-at K] [--stops] -- COMMAND ...
    python -m stapo.checks.replay twins OUT

Without the recipe's vLLM plugin ``stapo_rms_norm``, vLLM 0.24's generation depends on the batch around a request
(docs/determinism.md), so two runs of one command differ from their first step whatever the trainer does. ``run``
takes vLLM out of the question: a *record*
run of the recipe's STAPO method (``determinism=full``, ``stapo.record_rollouts``) writes every response it generates;
a *replay* run (``stapo.replay_rollouts``) trains on those responses without generating, and so, for each ``--halt``
step K, does a run killed at the step boundary after its checkpoint of step K (``halt``) and then resumed. All of
them must log the same value of every metric at every step (:func:`stapo.tools.curves.every_key`: all but time
and memory) and end with the same weights (SHA-256 of the last checkpoint's actor files). The replay run and the
record run trained on the same tokens, so they must agree too.

The runs are the quickstart's tiny-model run (:func:`stapo.quickstart.tiny.tiny_run_overrides`: 16 prompts x 4
responses a step; the reward :data:`REWARD`) on ``--data``'s ``train.parquet``; with 48 prompts there an epoch is 3
steps, so ``--halt 2 3`` kills one run mid-epoch and one at the epoch's end. The replayed runs share the GPU (a Ray
cluster each, :func:`stapo.train.clusters.launch`). ``OUT/replay.md`` holds the tables, ``OUT/replay.json`` the
verdicts and digests; the exit code is 0 when every comparison is equal to the bit and the replay run's gradients
were not all zero, else 1.

A run that outlives its job (:mod:`stapo.train.deadline`): ``--signal K`` adds a replayed run sent SIGUSR1 once it
logged step K, which must save at the end of the step under way, log it, exit with status 3 and, resumed, end as the
replay run; ``--deadline SECONDS`` adds one whose ``stapo.deadline`` is SECONDS from its launch, which must do the same
before its last step. Neither may lose a step's metrics, and their checkpoint is the stop's own (``trainer.save_freq``
is the run's length). A deadline cannot be aimed at a later step from another run's pace: two launches' start-ups
differ by up to 20 s where a step of the 135M model takes 2 s, and two such tries on an H100 fell after the run's end;
``scripts/gpu/deadline.sh`` sets 60 s, before step 1 ends (~120 s after the launch), so the run must stop there. Which
step a deadline stops is :func:`stapo.train.deadline.must_stop`'s arithmetic, tested on CPU (tests/test_deadline.py).

Two real runs (``--twin``): a second record run of the same command and seed beside the record run, recording a tape
of its own; ``OUT/replay.md`` gets the two compared at every metric (as ``python -m stapo.checks.reproduce compare
--all`` does) and ``OUT/replay.json`` which metrics were equal at every step and the first step and metrics where the
two parted (:func:`stapo.tools.curves.parting`). Reported, not part of ``run``'s verdict, which is the training
side's. A twin that fails is reported as failed (``"twin": {"failed": ...}``), and the check goes on without it.
``--twin-halt K`` adds a third real run, killed after its checkpoint of step K and resumed, generating all along (no
replay), compared with the record run the same way (``"twin_halt"``), reported. ``twins OUT`` is the verdict on them
(:func:`twin_problems`, what ``scripts/gpu/bitwise.sh`` exits with): a line per twin, and status 1 unless every twin
finished and equals the record run to the bit.

``halt`` runs COMMAND in a process group of its own and kills the group once ``DIR/latest_checkpointed_iteration.txt``
says STEP (or later), as a preempted job is killed; it exits 0 then, and 1 if COMMAND ended first. ``watch`` runs
COMMAND, writes when each step appeared in the metrics FILE (seconds from the launch) to the times FILE, sends SIGUSR1
once step K appeared, as Slurm's ``--signal`` would; it exits 0 when COMMAND exits 3 (``--stops``) or 0 (without).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from stapo.checks.reproduce import to_markdown
from stapo.checks.startup import command_problem
from stapo.quickstart.experiment import KV_CACHE_BYTES, TRAINER, override_problem, state_digest
from stapo.quickstart.tiny import replace_overrides, tiny_run_overrides
from stapo.tools.curves import ReportError, compare, compared_steps, every_key, gradient_steps, parting, read_metrics
from stapo.tools.io import hold_folder, new_folder_problem, output_problem, write_atomic
from stapo.train.clusters import launch

HALT_POLL_S = 0.5
"""Seconds between two looks at the checkpoint tracker: a step of the tiny model takes several."""
STALL_S = 600.0
"""A run whose log is silent this long is stopped (:func:`stapo.train.clusters.launch`)."""


@dataclass(frozen=True)
class Leg:
    """One launch: ``name`` (its log folder, ``OUT/runs/NAME``), the run folder it trains in (checkpoints, metrics;
    a stopped run and its resumption share one), the tape key, the step of its one checkpoint before the end (0: only
    the end), how it stops early: ``kill`` at that checkpoint, ``signal`` (SIGUSR1 after step ``at``), ``deadline``
    (``stapo.deadline`` = ``deadline_s``), or not at all; and the tape's folder under OUT."""

    name: str
    folder: str
    tape: str
    halt: int = 0
    stop: str = ""
    at: int = 0
    deadline_s: float = 0.0
    tape_dir: str = "tape"


def overrides(leg: Leg, args: argparse.Namespace) -> list[str]:
    """Hydra overrides of one leg: the tiny-model run with ``determinism=full``, prompts of up to 192 tokens and
    responses of up to 128, the tape, a checkpoint at the halt steps (or only at the end) and the KV cache given (runs
    share the GPU: vLLM must not measure its free memory)."""
    folder = args.out / leg.folder
    changes = {
        "trainer.experiment_name": f"replay_{leg.folder}",
        "trainer.save_freq": leg.halt or args.steps,
        "trainer.max_actor_ckpt_to_keep": args.steps,
        "actor_rollout_ref.actor.checkpoint.save_contents": "[model,optimizer,extra]",
        "+actor_rollout_ref.rollout.engine_kwargs.vllm.kv_cache_memory_bytes": KV_CACHE_BYTES,
        "stapo.tau_p": args.tau_p,
        "data.max_prompt_length": 192,  # SmolLM2's chat template and a word problem: no prompt filtered out
        "data.max_response_length": 128,
        leg.tape: args.out / leg.tape_dir,
        **({"stapo.deadline": f"{leg.deadline_s:.1f}", "stapo.deadline_margin": 0} if leg.stop == "deadline" else {}),
        **dict(override.split("=", 1) for override in args.overrides),
    }
    base = tiny_run_overrides(args.model, args.data / "train.parquet", folder, steps=args.steps, reward=REWARD)
    return ["--config-name=stapo", "determinism=full", *replace_overrides(base, changes)]


REWARD = "pkg://stapo.checks.gpu_smoke:smoke_reward"
"""The share of digits in a response: it differs within a group, so every step has nonzero advantages, gradients and
S2T candidates. With the task's own reward a 135M model scores 0 on every response, every advantage is 0 and no
gradient moves a weight, and equal runs would show nothing of the update or of a resumed optimizer (the records of
2026-11-29 and 2026-12-06, made that way, say so: :func:`weights_moved`)."""


def weights_moved(metrics: Path) -> bool:
    """Whether the run of ``metrics`` had a nonzero ``actor/grad_norm`` at some step: otherwise only the weight decay
    changed its weights, and runs equal to it show nothing of the update."""
    return gradient_steps(metrics)[0] > 0


def weights_digest(checkpoints: Path, step: int) -> str | None:
    """SHA-256 of the actor's weights in the model files of ``global_step_STEP`` (:func:`state_digest`, rank by
    rank; the files' bytes differ between equal runs: they pickle the process groups' names), or None without
    them."""
    import torch

    files = sorted((checkpoints / f"global_step_{step}" / "actor").glob("model_*.pt"))
    # weights_only=False: verl pickles DTensors and their device mesh; these files are the check's own runs'
    return state_digest([torch.load(f, map_location="cpu", weights_only=False) for f in files]) if files else None


def comparisons(out: Path, legs: dict[str, int], steps: int) -> tuple[dict, str]:
    """Each run folder of ``legs`` (folder -> its halt step, 0 for none) compared with the replay run at every metric
    (:func:`stapo.tools.curves.every_key`) and step: per folder, whether every value is equal, the metrics and
    steps compared, those that differ and the steps missing. A halted run may miss its halt step (verl 0.9.1 writes a
    step's checkpoint before it logs the step's metrics: a kill in between loses that line, not the step); any other
    missing step fails. The verdicts (JSON-ready) and the tables (Markdown)."""
    reference = read_metrics(out / "replay" / "metrics.jsonl")
    found, tables = {}, []
    for folder, halt_step in legs.items():
        other = read_metrics(out / folder / "metrics.jsonl")
        result = compare(reference, other, keys=every_key(reference, other))
        differ = sorted(key for key, values in result.items() if not values["equal"])
        logged, missing = compared_steps(result, steps)
        found[folder] = {
            "equal": not differ and set(missing) <= {halt_step},
            "metrics": len(result),
            "steps": logged,
            "missing": missing,
            "differ": differ,
        }
        tables.append(f"## replay against {folder}\n\n{to_markdown(result, ('replay', folder))}")
    return found, "\n".join(tables)


def verdicts(out: Path, legs: dict[str, int], steps: int) -> tuple[dict, str]:
    """:func:`comparisons` and the last checkpoint's weights of every run (:func:`weights_digest`), which must be
    equal too, after steps that moved them (:func:`weights_moved`); the verdicts (JSON-ready) and the tables
    (Markdown)."""
    found, tables = comparisons(out, legs, steps)
    digests = {folder: weights_digest(out / folder / "ckpt", steps) for folder in ("replay", *legs)}
    weights_equal = len(set(digests.values())) == 1 and None not in digests.values()
    moved = weights_moved(out / "replay" / "metrics.jsonl")
    equal = moved and weights_equal and all(c["equal"] for c in found.values())
    record = {"steps": steps, "comparisons": found, "weights_sha256": digests, "weights_equal": weights_equal,
              "weights_moved": moved}  # fmt: skip
    return record | {"equal": equal}, tables


TWIN = Leg("twin", "twin", "stapo.record_rollouts", tape_dir="tape-twin")
"""``--twin``'s run: the record run again, recording a tape of its own."""


def twin_halt(at: int) -> Leg:
    """``--twin-halt``'s run: the record run again, killed after its checkpoint of step ``at`` (then resumed)."""
    return Leg("twin-halt", "twin-halt", "stapo.record_rollouts", at, "kill", tape_dir="tape-twin-halt")


def twins(out: Path, steps: int, leg: Leg) -> tuple[dict, str]:
    """The record run against a real run of the same command (``leg``: the twin, or the halted twin) at every metric
    (:func:`stapo.tools.curves.every_key`) and step: the steps compared and those missing (a halted twin may miss its
    halt step, as in :func:`comparisons`: ``halt``), where they part (:func:`stapo.tools.curves.parting`) and whether
    their last weights are equal (JSON-ready), and the table (Markdown). Unreadable metrics or weights make it
    ``{"failed": why}``: it is reported, never the check's end."""
    try:
        a, b = (read_metrics(out / name / "metrics.jsonl") for name in ("record", leg.folder))
        digests = [weights_digest(out / name / "ckpt", steps) for name in ("record", leg.folder)]
    except (ReportError, OSError, RuntimeError) as error:
        return {"failed": str(error)}, ""
    result = compare(a, b, keys=every_key(a, b))
    logged, missing = compared_steps(result, steps)
    found = {"metrics": len(result), "steps": logged, "missing": missing, "halt": leg.halt, **parting(result)}
    found["weights_equal"] = None not in digests and digests[0] == digests[1]
    title = f"## record against {leg.folder} (two real runs of one seed: reported, not part of the verdict)"
    return found, f"{title}\n\n{to_markdown(result, ('record', leg.folder))}"


def twin_problems(record: dict) -> dict[str, str | None]:
    """Per twin of a ``replay.json`` (``twin``, ``twin_halt``): what keeps it from equalling the record run to the bit
    (it failed; a metric differs, or one run alone logged it; a step is missing other than a halted twin's own, whose
    line the kill can take; the last weights differ), or None where it equals it. No twin at all is a problem too."""
    found = {key: record[key] for key in ("twin", "twin_halt") if key in record}
    if not found:
        return {"twins": "none in replay.json: run the check with --twin or --twin-halt K"}
    problems = {}
    for key, twin in found.items():
        allowed = [twin.get("halt")] if twin.get("halt") else []
        problems[key] = (
            f"failed: {twin['failed']}" if "failed" in twin
            else f"parts at step {twin['first_step']} in {len(twin['first_metrics'])} metrics, first "
                 f"{', '.join(twin['first_metrics'][:3])}" if twin["first_step"]
            else f"logged by one run only: {', '.join(twin['one_sided'])}" if twin["one_sided"]
            else f"steps not compared: {twin['missing']}" if [s for s in twin["missing"] if s not in allowed]
            else "last weights differ" if not twin["weights_equal"]
            else None
        )  # fmt: skip
    return problems


def halt(at: int, checkpoints: Path, command: Sequence[str]) -> int:
    """Run ``command`` in a process group of its own; kill the group once ``checkpoints``' tracker says ``at``."""
    tracker = checkpoints / "latest_checkpointed_iteration.txt"
    process = subprocess.Popen(list(command), start_new_session=True)
    while process.poll() is None:
        step = tracker.read_text().strip() if tracker.is_file() else ""
        if step.isdigit() and int(step) >= at:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            print(f"halted at the checkpoint of step {at}", flush=True)
            return 0
        time.sleep(HALT_POLL_S)
    print(f"error: the run ended (exit {process.returncode}) before its checkpoint of step {at}", flush=True)
    return 1


def config_problem(args: argparse.Namespace) -> str | None:
    """Why a leg's config would not pass the trainer's checks (:func:`stapo.train.main.validate`, without files or
    GPUs), or None: every leg is the record or the replay leg's config but for the tape and the checkpoints."""
    from stapo.train.main import config_problem as problem

    runs = {}
    for leg in (Leg("record", "record", "stapo.record_rollouts"), Leg("replay", "replay", "stapo.replay_rollouts")):
        method, *rest = overrides(leg, args)
        runs[leg.name] = (method.split("=", 1)[1], rest)
    found = problem(runs, args.overrides)
    return found and f"the {found[0]} run's config with the overrides: {found[1]}"


def check(args: argparse.Namespace) -> str | None:
    if args.steps < 2:
        return f"--steps {args.steps}: a replay needs at least 2 steps"
    if not 0 < args.tau_p <= 1:
        return f"--tau-p {args.tau_p}: a probability in (0, 1]"
    if bad := [k for k in args.halt if not 0 < k < args.steps]:
        return f"--halt {bad[0]}: halt between step 1 and step {args.steps - 1} (--steps {args.steps})"
    # a signal after step K is acted on at the end of step K + 1, which must not be the last
    if bad := [k for k in args.signal if not 0 < k < args.steps - 1]:
        return f"--signal {bad[0]}: signal after a step between 1 and {args.steps - 2} (--steps {args.steps})"
    if not 0 <= args.twin_halt < args.steps:
        return f"--twin-halt {args.twin_halt}: halt between step 1 and step {args.steps - 1} (0: no such run)"
    if not (math.isfinite(args.deadline) and args.deadline >= 0):
        return f"--deadline {args.deadline:g}: seconds from a run's launch, more than 0 (0: no deadline run)"
    if not (args.model / "config.json").is_file():
        return f"--model {args.model}: no config.json there; name a Hugging Face model folder"
    if not (args.data / "train.parquet").is_file():
        return f"--data {args.data}: no train.parquet there (python -m stapo.quickstart.task word --out DIR)"
    return (
        override_problem(args.overrides)
        or config_problem(args)
        or new_folder_problem(args.out)
        or gpu_problem()
        or hold_folder(args.out)
    )


def gpu_problem() -> str | None:
    """Why the runs cannot train here: no CUDA GPU visible."""
    from stapo.train.preflight import local_gpus

    if local_gpus() == 0:
        return "replay run trains on a CUDA GPU, and none is visible (torch.cuda.device_count() is 0): use a GPU node"
    return None


def watch(command: Sequence[str], metrics: Path, times: Path, signal_at: int = 0, stops: bool = False) -> int:
    """Run ``command``; note when each step appears in ``metrics`` (seconds from the launch, into ``times``), send it
    SIGUSR1 once step ``signal_at`` did; 0 if it exits with status 3 (``stops``) or 0 (without), else 1."""
    from stapo.train.deadline import RESUME_EXIT

    start, seen, signalled = time.time(), {}, False
    process = subprocess.Popen(list(command))
    while True:
        ended = process.poll() is not None
        for step in logged_steps(metrics):
            seen.setdefault(step, round(time.time() - start, 1))
        if signal_at and signal_at in seen and not signalled and not ended:
            process.send_signal(signal.SIGUSR1)
            print(f"SIGUSR1 sent after step {signal_at}", flush=True)
            signalled = True
        if ended:
            break
        time.sleep(HALT_POLL_S)
    write_atomic(times, json.dumps(seen) + "\n")
    expected = RESUME_EXIT if stops else 0
    if process.returncode != expected:
        print(f"error: the run exited {process.returncode}, not {expected}", flush=True)
        return 1
    return 0


def logged_steps(metrics: Path) -> list[int]:
    """The steps of the lines verl's FileLogger wrote whole to ``metrics`` so far."""
    try:
        lines = metrics.read_text().splitlines()
    except FileNotFoundError:
        return []
    steps = []
    for line in lines:
        try:
            steps.append(int(json.loads(line)["step"]))
        except (ValueError, KeyError, TypeError):
            continue  # a line being written
    return steps


def run(args: argparse.Namespace) -> int:
    def command(leg: Leg) -> list:
        train = [*TRAINER, *overrides(leg, args)]
        if leg.stop == "kill":
            stop = [sys.executable, "-m", "stapo.checks.replay", "halt", "--at", leg.halt]
            return [*stop, "--checkpoints", args.out / leg.folder / "ckpt", "--", *train]
        watcher = [sys.executable, "-m", "stapo.checks.replay", "watch", "--metrics", args.out / leg.folder /
                   "metrics.jsonl", "--times", args.out / "runs" / leg.name / "times.json"]  # fmt: skip
        # (every run but a halted one is watched: when each step appeared goes into the record)
        if leg.stop == "signal":
            watcher += ["--signal-at", leg.at]
        return [*watcher, *["--stops"] * bool(leg.stop), "--", *train]

    def run_stage(stage: list[Leg]) -> set[str]:
        """The names of the stage's runs that failed."""
        for leg in stage:  # verl's FileLogger opens its file there and makes no folder
            (args.out / leg.folder).mkdir(exist_ok=True)
        codes = launch(stage, command, ["0"] * len(stage), args.out, STALL_S)
        if failed := sorted(name for name, code in codes.items() if code):
            print(f"error: {', '.join(failed)} failed (logs: {args.out / 'runs'})", file=sys.stderr)
        return set(failed)

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a kill stops the runs and their clusters too
    real = [*[TWIN] * args.twin, *[twin_halt(args.twin_halt)] * bool(args.twin_halt)]
    first = run_stage([Leg("record", "record", "stapo.record_rollouts"), *real])
    if "record" in first:  # the twin is reported, not part of the verdict: its failure stops nothing
        return 2
    stopped = [Leg(f"halt{k}", f"halt{k}", "stapo.replay_rollouts", k, "kill") for k in args.halt]
    stopped += [Leg(f"signal{k}", f"signal{k}", "stapo.replay_rollouts", 0, "signal", at=k) for k in args.signal]
    if args.deadline:
        stopped.append(Leg("deadline", "deadline", "stapo.replay_rollouts", 0, "deadline", deadline_s=args.deadline))
    if run_stage([Leg("replay", "replay", "stapo.replay_rollouts"), *stopped]):
        return 2
    halted = [leg for leg in real if leg.stop and leg.name not in first]  # the halted twin, reported
    resumed = run_stage([Leg(f"{leg.name}-resumed", leg.folder, leg.tape, leg.halt, tape_dir=leg.tape_dir)
                         for leg in stopped + halted])  # fmt: skip
    if resumed - {f"{leg.name}-resumed" for leg in halted}:
        return 2
    record, tables = verdicts(args.out, {"record": 0, **{leg.folder: leg.halt for leg in stopped}}, args.steps)
    record["stopped_at"] = {leg.folder: saved_step(args.out / leg.folder / "ckpt", args.steps) for leg in stopped}
    record["deadline_s"] = next((leg.deadline_s for leg in stopped if leg.stop == "deadline"), None)
    record["equal"] = record["equal"] and None not in record["stopped_at"].values()
    for leg in real:  # each under its folder's name: twin, twin_halt
        key = leg.folder.replace("-", "_")
        if leg.name in first or f"{leg.name}-resumed" in resumed:  # a halted twin's logs: its run and its resumption
            record[key] = {"failed": f"see {args.out / 'runs'}/{leg.name}{'*' * bool(leg.stop)}/train.log"}
        else:
            record[key], table = twins(args.out, args.steps, leg)
            tables += f"\n{table}"
    verdict = "identical to the bit" if record["equal"] else "differ"
    if not record["weights_moved"]:
        verdict = "not shown: the replay run's actor/grad_norm was 0 at every step (a reward that never varied)"
    write_atomic(args.out / "replay.json", json.dumps(record, indent=1) + "\n")
    write_atomic(args.out / "replay.md", f"{tables}\nweights: {record['weights_sha256']}\n\nverdict: {verdict}\n")
    print(f"replayed runs: {verdict} (tables: {args.out / 'replay.md'})")
    return 0 if record["equal"] else 1


def saved_step(checkpoints: Path, steps: int) -> int | None:
    """The step of the checkpoint a stopped run saved before its end (its only one before the last step)."""
    found = sorted(int(p.name.removeprefix("global_step_")) for p in checkpoints.glob("global_step_*"))
    return next((step for step in found if step < steps), None)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m stapo.checks.replay", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    start = commands.add_parser("run", help="record, replay, halt and resume; compare them to the bit")
    start.add_argument("--model", type=Path, required=True, help="a Hugging Face model folder")
    start.add_argument("--data", type=Path, required=True, help="a task folder with train.parquet")
    start.add_argument("--out", type=Path, required=True, help="a new folder for the runs and the verdicts")
    start.add_argument("--steps", type=int, default=6)
    start.add_argument("--halt", type=int, nargs="*", default=[2, 3], help="steps to kill a replayed run after")
    start.add_argument("--signal", type=int, nargs="*", default=[], help="steps to send a replayed run SIGUSR1 after")
    start.add_argument("--deadline", type=float, default=0, help="stapo.deadline of a replayed run, s from its launch")
    start.add_argument("--tau-p", type=float, default=0.02, help="stapo.tau_p (a 135M model's vocabulary is small)")
    start.add_argument("--twin", action="store_true", help="a second record run beside the first, compared, reported")
    start.add_argument(
        "--twin-halt",
        type=int,
        default=0,
        metavar="K",
        help="a real run killed after its checkpoint of step K, resumed, compared, reported",
    )
    start.add_argument("overrides", nargs="*", help="Hydra overrides for every run, after --")
    stop = commands.add_parser("halt", help="run COMMAND; kill it at the checkpoint of step --at")
    stop.add_argument("--at", type=int, required=True)
    stop.add_argument("--checkpoints", type=Path, required=True, help="the run's trainer.default_local_dir")
    stop.add_argument("cmd", nargs="+", metavar="COMMAND")
    watching = commands.add_parser("watch", help="run COMMAND, time its steps, send it SIGUSR1 after step K")
    watching.add_argument("--metrics", type=Path, required=True, help="the run's metrics file (verl's FileLogger)")
    watching.add_argument("--times", type=Path, required=True, help="where to write when each step appeared")
    watching.add_argument("--signal-at", type=int, default=0, help="send SIGUSR1 once this step appeared")
    watching.add_argument("--stops", action="store_true", help="the run must exit with status 3 (saved, stopped)")
    watching.add_argument("cmd", nargs="+", metavar="COMMAND")
    pair = commands.add_parser("twins", help="exit 0 only if every twin run of OUT equals the record run to the bit")
    pair.add_argument("out", type=Path, metavar="OUT", help="the folder `run --out` wrote (its replay.json)")
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "halt":
        if problem := (
            (f"--at {args.at}: a step, 1 or more" if args.at < 1 else None)
            or output_problem(args.checkpoints, "folder", "--checkpoints")
            or command_problem(args.cmd)
        ):
            parser.exit(2, f"error: {problem}\n")
        raise SystemExit(halt(args.at, args.checkpoints, args.cmd))
    if args.command == "watch":
        if problem := (
            (f"--signal-at {args.signal_at}: a step, 1 or more" if args.signal_at < 0 else None)
            or output_problem(args.metrics, "file", "--metrics")
            or output_problem(args.times, "file", "--times")
            or command_problem(args.cmd)
        ):
            parser.exit(2, f"error: {problem}\n")
        raise SystemExit(watch(args.cmd, args.metrics, args.times, args.signal_at, args.stops))
    if args.command == "twins":
        try:
            record = json.loads((args.out / "replay.json").read_text())
        except (OSError, ValueError) as error:
            why = "no such file" if isinstance(error, FileNotFoundError) else str(error)
            parser.exit(2, f"error: {args.out / 'replay.json'}: {why}; pass the folder `replay run --out` wrote\n")
        problems = twin_problems(record)
        for key, problem in problems.items():
            print(
                f"error: {key}: {problem}" if problem else f"{key}: equal to the bit",
                file=sys.stderr if problem else sys.stdout,
            )
        raise SystemExit(1 if any(problems.values()) else 0)
    if problem := check(args):
        parser.exit(2, f"error: {problem}\n")
    raise SystemExit(run(args))


if __name__ == "__main__":
    main()
