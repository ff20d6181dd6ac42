"""Where a launch spends its time before the first step, process by process.

    python -m stapo.checks.startup run --out DIR [--timeout S] [--until begins|ends] -- COMMAND ...
    python -m stapo.checks.startup phases LOG [--out JSON]
    python -m stapo.checks.startup imports --out JSON [--module KIND=MODULE[,MODULE]] ...

``run`` starts COMMAND (e.g. ``bash scripts/train.sh stapo qwen3_1.7b ...``) in a process group of its own, with
``VERL_LOGGING_LEVEL=INFO``, ``TQ_LOGGING_LEVEL=INFO`` (TransferQueue's set-up lines), ``VLLM_LOGGING_LEVEL=INFO``
(vLLM's engine phases; verl sets WARN only where the variable is unset), ``PYTHONUNBUFFERED=1``,
``RAY_DEDUP_LOGS=0`` (every process's lines, not Ray's summaries) and ``RAY_COLOR_PREFIX=0`` added to its
environment, and writes each line it prints (stdout and stderr merged) to ``DIR/train.log`` as ``  12.34 | line``,
the seconds since launch. When the first step begins (the recipe's trainer prints ``STAPO: step 1 begins``) or, with
``--until ends``, when its metrics line arrives (verl's console logger: ``step:1 - key:value - ...``,
``verl/utils/logger/aggregate_logger.py``), or at ``--timeout``, it kills the process group and writes
``DIR/phases.json`` and the phase table. Ray's own services may outlive the group: ending them (``ray stop --force``)
is the caller's business. ``phases`` reads such a log again. ``imports`` times a fresh
interpreter importing each process kind's entry modules, with no bytecode yet (as after ``pip install --no-compile``)
and again with it; docs/startup.md says what the numbers mean.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from stapo.tools.io import first_line, new_folder_problem, number_problems, output_problem, write_atomic


class StartupError(ValueError):
    """Input the tool cannot use; one line naming it."""


MARKERS = (
    ("driver: ray.init", r"^ray init kwargs:"),
    ("TaskRunner: first line", r"^\(TaskRunnerV1 pid=\d+"),
    ("TransferQueue ready", r"TransferQueue config:"),
    ("worker group created", r"create worker group"),
    ("actor engine initialized", r"actor and ref model engine initialized"),
    ("reward loop manager", r"reward loop manager initialized"),
    ("vLLM server: first line", r"^\(vLLMHttpServer pid=\d+"),
    ("vLLM engine core: first line", r"\(EngineCore(_DP\d+)? pid=\d+"),
    ("vLLM worker: first line", r"\(Worker[A-Z0-9_]* pid=\d+"),
    ("vLLM: model loaded", r"Model loading took"),
    ("vLLM: KV cache sized", r"Available KV cache memory"),
    ("vLLM: CUDA graphs captured", r"Graph capturing finished"),
    ("vLLM: engine ready", r"init engine \(profile, create kv cache, warmup model\) took"),
    ("vLLM servers up", r"LLMServerManager: \["),
    ("checkpoint engine manager", r"checkpoint engine manager initialized"),
    ("ready to fit", r"all initialize finished, ready to fit"),
    ("validation before training done", r"Initial validation metrics"),
    ("first step begins", r"STAPO: step \d+ begins"),
    ("first step ends", r"(^|\) )step:[1-9]\d* - "),
)
"""(phase, regular expression) in launch order: verl 0.9.1's ``print`` and ``logger.info`` lines
(``trainer/main_ppo.py:run_ppo``, ``trainer/ppo/v1/trainer_base.py:PPOTrainer._setup``,
``workers/rollout/llm_server.py:LLMServerManager._initialize_llm_servers``), TransferQueue 0.1.11's ``init``, the
prefix Ray puts on an actor's lines (``(ClassName pid=N)``, ``ray/_private/worker.py:print_worker_logs``), the one
vLLM 0.24 puts on its own processes' lines (``vllm/utils/system_utils.py:decorate_logs``: ``EngineCore``,
``Worker``), vLLM's INFO lines of its engine's start (``v1/worker/gpu_model_runner.py``: the model loaded, the
CUDA graphs captured; ``v1/worker/gpu_worker.py``: the KV cache sized after the profiling run, which compiles or
loads the compiled graphs; ``v1/engine/core.py``: the engine ready), the recipe's trainer
(:data:`stapo.train.trainer.FIRST_STEP_LINE`) and verl's console logger."""

FIRST_STEP_END = MARKERS[-1][1]
UNTIL = {"begins": MARKERS[-2][1], "ends": FIRST_STEP_END}
"""``run --until``: stop when the first step begins (start-up is over: the default) or when its metrics arrive."""
LINE = re.compile(r"^\s*(\d+\.\d+) \| (.*)$")
PREFIX = re.compile(r"^(?:\((\w+) pid=(\d+)(?:, ip=[^)]*)?\) )+")
INNERMOST = re.compile(r"\((\w+) pid=(\d+)(?:, ip=[^)]*)?\) $")
ANSI = re.compile(r"\x1b\[[0-9;]*m")
ADDED_ENV = {
    "VERL_LOGGING_LEVEL": "INFO",
    "TQ_LOGGING_LEVEL": "INFO",
    "VLLM_LOGGING_LEVEL": "INFO",
    "PYTHONUNBUFFERED": "1",
    "RAY_DEDUP_LOGS": "0",
    "RAY_COLOR_PREFIX": "0",
}
"""What ``run`` adds to the command's environment (module docstring)."""
RECORDED_ENV = ("STAPO_STARTUP_CUTS", "PYTHONDONTWRITEBYTECODE", "PYTHONPYCACHEPREFIX", "CUDA_VISIBLE_DEVICES")
"""The launching environment's settings that change start-up, kept in ``phases.json``."""


# ---------------------------------------------------------------------------------------------------------- phases
def read_log(path: Path) -> list[tuple[float, str]]:
    """The (seconds, line) pairs of a log written by ``run``; :class:`StartupError` naming the file when it cannot
    be read or has no such line."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (FileNotFoundError, IsADirectoryError):
        raise StartupError(f"{path}: no such file; expected a train.log written by `startup run`") from None
    except UnicodeDecodeError:
        raise StartupError(f"{path}: not a text file; expected a train.log written by `startup run`") from None
    lines = [(float(m[1]), ANSI.sub("", m[2])) for m in map(LINE.match, text.splitlines()) if m]
    if not lines:
        raise StartupError(f"{path}: no line has the `  12.34 | ` time prefix of `startup run`")
    return lines


def process_kind(line: str) -> tuple[str, str]:
    """(kind, pid) of a log line: the innermost ``(Name pid=N)`` prefix (Ray's, then vLLM's for the processes an
    actor starts), or ("driver", "") for a line without one."""
    head = PREFIX.match(line)
    if not head:
        return "driver", ""
    inner = INNERMOST.search(head[0])
    return inner[1], inner[2]


def find_markers(lines: list[tuple[float, str]]) -> list[dict]:
    """Each marker of :data:`MARKERS`: the first time it appears (None when it does not) and the seconds since the
    marker found before it in the list (since launch for the first one found)."""
    found, previous = [], 0.0
    for name, pattern in MARKERS:
        regex = re.compile(pattern)
        at = next((t for t, line in lines if regex.search(line)), None)
        phase = None if at is None else round(at - previous, 2)
        found.append({"phase": name, "pattern": pattern, "at_s": at, "phase_s": phase})
        previous = previous if at is None else at
    return found


def find_processes(lines: list[tuple[float, str]]) -> list[dict]:
    """Per process kind, in order of its first line: how many processes (pids), the first and last line's time."""
    kinds: dict[str, dict] = {}
    for t, line in lines:
        kind, pid = process_kind(line)
        entry = kinds.setdefault(kind, {"kind": kind, "pids": set(), "first_s": t, "last_s": t, "lines": 0})
        entry["pids"].add(pid)
        entry["last_s"], entry["lines"] = t, entry["lines"] + 1
    return [{**k, "pids": len(k["pids"] - {""}) or None} for k in kinds.values()]


def phases(lines: list[tuple[float, str]], stopped: str = "") -> dict:
    """The markers and process kinds of a log (``phases.json``)."""
    return {
        "stopped": stopped,
        "last_line_s": lines[-1][0] if lines else None,
        "markers": find_markers(lines),
        "processes": find_processes(lines),
    }


def _cell(value) -> str:
    return "-" if value is None else f"{value:.1f}" if isinstance(value, float) else str(value)


def table(result: dict) -> str:
    """The phase table and the process table, as Markdown (a marker not found shows ``-``)."""
    rows = ["| phase | at s | phase s |", "|---|---:|---:|"]
    rows += [f"| {m['phase']} | {_cell(m['at_s'])} | {_cell(m['phase_s'])} |" for m in result["markers"]]
    rows += ["", "| process kind | pids | first line s | last line s | lines |", "|---|---:|---:|---:|---:|"]
    rows += [
        f"| {p['kind']} | {_cell(p['pids'])} | {_cell(p['first_s'])} | {_cell(p['last_s'])} | {p['lines']} |"
        for p in result["processes"]
    ]
    if result.get("stopped"):
        rows += ["", f"stopped: {result['stopped']}"]
    return "\n".join(rows) + "\n"


# ------------------------------------------------------------------------------------------------------------- run
def _reader(stream, lines: queue.Queue) -> None:
    """Put each line of ``stream`` (bytes) into ``lines`` as text, then None at its end."""
    for raw in iter(stream.readline, b""):
        lines.put(raw.decode("utf-8", errors="replace").rstrip("\r\n"))
    lines.put(None)


def _stop(process: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM to the command's process group, twice (the recipe's driver takes a first one as a request to save at
    the end of the step, :mod:`stapo.train.deadline`, and ends at a second); SIGKILL to what is left of it after
    ``grace_s``."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
        time.sleep(0.5)
        os.killpg(process.pid, signal.SIGTERM)
    except ProcessLookupError:
        process.wait()
        return
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        process.poll()  # reap the leader, or the group never looks empty
        try:
            os.killpg(process.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    process.wait()


def _follow(process: subprocess.Popen, log, timeout_s: float, start: float, until: str) -> str:
    """Copy the command's lines into ``log`` with their times until the first step begins or ends (``until``), the
    command exits or ``timeout_s`` passes; returns which."""
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_reader, args=(process.stdout, lines), daemon=True).start()
    end_of_step = re.compile(UNTIL[until])
    while (left := start + timeout_s - time.monotonic()) > 0:
        try:
            line = lines.get(timeout=min(left, 1.0))
        except queue.Empty:
            continue
        if line is None:
            return f"the command exited ({process.wait()})"
        log.write(f"{time.monotonic() - start:8.2f} | {line}\n")
        log.flush()
        if end_of_step.search(ANSI.sub("", line)):
            return f"the first step {'began' if until == 'begins' else 'ended'}"
    return f"timeout after {timeout_s:g} s"


def launch(command: Sequence[str], out: Path, timeout_s: float, until: str = "begins") -> dict:
    """Run ``command`` as the module docstring says; returns the phases (also in ``out/phases.json``)."""
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **ADDED_ENV}
    start = time.monotonic()
    process = subprocess.Popen(
        list(command), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )
    try:
        with (out / "train.log").open("w", encoding="utf-8") as log:
            stopped = _follow(process, log, timeout_s, start, until)
    finally:
        _stop(process)
    try:
        lines = read_log(out / "train.log")
    except StartupError:  # the command printed nothing
        lines = []
    shown = {name: os.environ.get(name) for name in RECORDED_ENV}
    result = {"command": list(command), "environment": shown, **phases(lines, stopped)}
    write_atomic(out / "phases.json", json.dumps(result, indent=1) + "\n")
    return result


# --------------------------------------------------------------------------------------------------------- imports
IMPORT_KINDS = {
    "driver": ("stapo.train.main", "verl.trainer.main_ppo"),
    "TaskRunner": ("stapo.train.trainer", "verl.trainer.ppo.v1"),
    "TransferQueue storage unit": ("transfer_queue.storage.simple_storage",),
    "actor worker (FSDP)": ("verl.workers.engine_workers", "verl.workers.engine.fsdp.transformer_impl"),
    "reward loop worker": ("verl.experimental.reward_loop.reward_loop", "stapo.tools.reward"),
    "agent loop worker": ("verl.trainer.ppo.v1.agent_loop_tq",),
    "vLLM server": ("verl.workers.rollout.vllm_rollout.vllm_async_server",),
    "vLLM engine core": ("vllm.v1.engine.core",),
    "vLLM worker": ("vllm.v1.worker.gpu_worker", "verl.workers.rollout.vllm_rollout.utils"),
}
"""Process kind -> the modules its process imports before it works (verl 0.9.1: ``TaskRunnerV1.run``, the
``ActorRolloutRefWorker`` of ``engine_workers.py`` with the FSDP engine, ``RewardLoopWorker``,
``AgentLoopWorkerTQ``, ``vLLMHttpServer``; vLLM 0.24: ``EngineCoreProc.run_engine_core``, the ``WorkerProc`` of
its ``mp`` executor with verl's worker extension)."""
IMPORT_ENV = {"VERL_USE_EXTERNAL_MODULES": "stapo.train.plugin"}
"""What every Ray process of a run has (configs/base.yaml's runtime environment): the recipe's verl plugin."""
IMPORT_LINE = re.compile(r"^import time:\s+(\d+) \|\s+(\d+) \| ( *)(\S+)$")


def parse_importtime(stderr: str) -> dict:
    """Seconds of import per top-level package (the sum of ``-X importtime``'s self times, which add up to the
    whole), the total, the standard library's share, and the last other line (an import error)."""
    per_package: dict[str, int] = {}
    other = []
    for line in stderr.splitlines():
        match = IMPORT_LINE.match(line)
        if match is None:
            if line.strip() and not line.startswith("import time: self"):
                other.append(line)
            continue
        package = match[4].split(".")[0]
        per_package[package] = per_package.get(package, 0) + int(match[1])
    stdlib = sum(us for name, us in per_package.items() if name in sys.stdlib_module_names or name.startswith("_"))
    top = sorted(per_package.items(), key=lambda item: -item[1])[:10]
    return {
        "import_s": round(sum(per_package.values()) / 1e6, 3),
        "stdlib_s": round(stdlib / 1e6, 3),
        "top": [[name, round(us / 1e6, 3)] for name, us in top],
        "last_other_line": other[-1] if other else None,
    }


def time_import(modules: Sequence[str], prefix: Path) -> dict:
    """One fresh ``python -X importtime`` importing ``modules``, bytecode cached under ``prefix``: wall seconds,
    :func:`parse_importtime`'s figures, and the error line when an import failed (recorded, not raised)."""
    code = "; ".join(f"import {module}" for module in modules)
    env = {**os.environ, **IMPORT_ENV, "PYTHONPYCACHEPREFIX": str(prefix)}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-X", "importtime", "-c", code], capture_output=True, text=True, env=env)
    seconds = round(time.perf_counter() - start, 3)
    parsed = parse_importtime(done.stderr)
    error = (parsed.pop("last_other_line") or f"exit {done.returncode}") if done.returncode else None
    parsed.pop("last_other_line", None)
    return {"seconds": seconds, **parsed, "error": error}


def time_imports(kinds: dict[str, Sequence[str]]) -> dict:
    """Each kind's modules imported cold (an empty ``PYTHONPYCACHEPREFIX``: every module, the standard library's
    too, compiles its bytecode) and then warm (the same prefix, bytecode present)."""
    result = {"python": sys.version.split()[0], "executable": sys.executable, "env": IMPORT_ENV, "kinds": {}}
    for kind, modules in kinds.items():
        with tempfile.TemporaryDirectory(prefix="stapo-pycache-") as prefix:
            cold = time_import(modules, Path(prefix))
            warm = time_import(modules, Path(prefix))
        result["kinds"][kind] = {"modules": list(modules), "cold": cold, "warm": warm}
    return result


def imports_table(result: dict) -> str:
    """One row per kind: cold and warm seconds, the cold standard library's share, the slowest packages warm."""
    rows = ["| process kind | cold s | warm s | stdlib cold s | slowest packages (warm s) |"]
    rows.append("|---|---:|---:|---:|---|")
    for kind, entry in result["kinds"].items():
        cold, warm = entry["cold"], entry["warm"]
        slow = ", ".join(f"{name} {s:.2f}" for name, s in warm["top"][:5])
        note = f"error: {warm['error']}" if warm["error"] else slow
        rows.append(f"| {kind} | {cold['seconds']:.1f} | {warm['seconds']:.1f} | {cold['stdlib_s']:.1f} | {note} |")
    return "\n".join(rows) + "\n"


def parse_modules(values: Sequence[str] | None) -> dict[str, tuple[str, ...]]:
    """``KIND=MODULE[,MODULE]`` options -> kinds (:data:`IMPORT_KINDS` when none are given)."""
    if not values:
        return dict(IMPORT_KINDS)
    kinds = {}
    for value in values:
        kind, _, modules = value.partition("=")
        names = tuple(m for m in modules.split(",") if m)
        if not kind or not names or not all(re.fullmatch(r"[A-Za-z_][\w.]*", m) for m in names):
            raise StartupError(f"--module {value}: give KIND=MODULE[,MODULE], e.g. driver=stapo.train.main")
        kinds[kind] = names
    return kinds


# ------------------------------------------------------------------------------------------------------------ main
def command_problem(command: Sequence[str]) -> str | None:
    """Why ``command`` cannot be started: its program is not found; one line, or None."""
    program = command[0]
    if shutil.which(program) is None:
        return f"{program}: no such program (the command to start goes after --, e.g. -- bash scripts/train.sh ...)"
    return None


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="python -m stapo.checks.startup", description=__doc__.split("\n\n")[0])
    commands = top.add_subparsers(dest="what", required=True)
    run = commands.add_parser("run", help="launch a command and time its start-up")
    run.add_argument("command", nargs="+", help="the launch, after --: e.g. -- bash scripts/train.sh stapo ...")
    run.add_argument("--out", type=Path, required=True, help="a new folder: train.log, phases.json")
    run.add_argument("--timeout", type=float, default=1800.0, help="seconds before the command is stopped")
    run.add_argument("--until", choices=sorted(UNTIL), default="begins", help="stop when the first step begins or ends")
    read = commands.add_parser("phases", help="the phase table of a train.log written by run")
    read.add_argument("log", type=Path)
    read.add_argument("--out", type=Path, help="write the phases as JSON here too")
    timing = commands.add_parser("imports", help="import time of each process kind's modules, cold and warm")
    timing.add_argument("--out", type=Path, required=True, help="JSON file")
    timing.add_argument("--module", action="append", help="KIND=MODULE[,MODULE] instead of the built-in kinds")
    return top


def _run(args: argparse.Namespace) -> str:
    problems = number_problems(args, positive=["timeout"]) + [
        p for p in (command_problem(args.command), new_folder_problem(args.out)) if p
    ]
    if problems:
        raise StartupError(problems[0])
    return table(launch(args.command, args.out, args.timeout, args.until))


def _phases(args: argparse.Namespace) -> str:
    if args.out is not None and (problem := output_problem(args.out, "file")):
        raise StartupError(problem)
    result = phases(read_log(args.log))
    if args.out is not None:
        write_atomic(args.out, json.dumps(result, indent=1) + "\n")
    return table(result)


def _imports(args: argparse.Namespace) -> str:
    if problem := output_problem(args.out, "file"):
        raise StartupError(problem)
    result = time_imports(parse_modules(args.module))
    write_atomic(args.out, json.dumps(result, indent=1) + "\n")
    return imports_table(result)


def main(argv: Sequence[str] | None = None) -> None:
    top = parser()
    args = top.parse_args(argv)
    try:
        print({"run": _run, "phases": _phases, "imports": _imports}[args.what](args), end="")
    except (StartupError, OSError) as error:
        top.exit(2, f"error: {first_line(error) if isinstance(error, OSError) else error}\n")


if __name__ == "__main__":
    main()
