"""Runs longer than a job: a checkpoint before the job's time limit or on a signal, then exit status 3, "saved, run
me again" (scripts/slurm.sbatch requeues itself on it; docs/scale.md, "A run longer than your cluster's time limit").

The paper's runs take 5-7 days; Slurm ends a job at its time limit and preempts jobs for others, so a reproduction is
a chain of jobs. verl 0.9.1's V1 trainers save only every ``trainer.save_freq`` steps (its older trainer's
``should_save_ckpt_esi`` is gone from them), so a job ended between two saves loses every step since the last one.

**The deadline.** Where it comes from, first found wins (:func:`find_deadline`): ``stapo.deadline`` (seconds from the
launch, or a time), Slurm's job end time (``SLURM_JOB_END_TIME``, else ``squeue``), verl's two expiry variables
(:data:`EXPIRY_VARIABLES`). At the end of every step the trainer asks whether the next step and a save still fit
before it (:func:`must_stop`, as verl's ``should_save_ckpt_esi`` reasons: the longest step so far, the longest save
so far or :data:`SAVE_GUESS_S`, and ``stapo.deadline_margin``); when they do not, it saves at once.

**A signal.** SIGUSR1 (Slurm's ``--signal=B:USR1@...``), or SIGTERM, sent to the driver (``python -m stapo.train``)
writes :data:`REQUEST_FILE` into the run's checkpoint folder (:func:`arm`); the trainer, which may run on another
node, reads it at the end of every step and saves. A user may write the file by hand to the same effect
(``echo stop > CHECKPOINT_DIR/stop_request``). A second SIGTERM ends the driver at once.

**The stop.** The save is verl's own ``_save_checkpoint`` at the place verl saves (after the step's update, before
its weights go to the rollout), skipped when verl saved that step itself. The step's validation and metrics are then
logged as always, and the trainer stops before the next step begins, writing :data:`SAVED_FILE`; the driver reads it
and exits with :data:`RESUME_EXIT`. The same command resumes from that checkpoint (``trainer.resume_mode=auto``).
Without a deadline and without a signal nothing here acts, and a run behaves exactly as before.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from stapo.config import parse_deadline
from stapo.tools.io import write_atomic

RESUME_EXIT = 3
"""The exit status of a run that saved before its deadline or on a signal: "saved, run me again"."""
SAVE_GUESS_S = 60.0
"""A save's duration before one was measured in this launch (verl's ``should_save_ckpt_esi`` default)."""
REQUEST_FILE = "stop_request"
"""In the run's checkpoint folder: "save at the end of this step and stop" (its text says why)."""
SAVED_FILE = "stop_saved.json"
"""In the run's checkpoint folder: the trainer saved step N and stopped before the next one (``{"step", "reason"}``)."""
EXPIRY_VARIABLES = (
    "MLP_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP",
    "SAGEMAKER_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP",
)
"""verl 0.9.1's ``should_save_ckpt_esi`` (``verl/utils/checkpoint/checkpoint_manager.py``): Unix times at which a
Volcano Engine MLP or SageMaker capacity block ends."""
NO_LIMIT_S = 366 * 86400.0
"""An end time further away than this is no limit (Slurm reports a job without one as ending in years)."""
SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


def launched_at() -> float:
    """When this process started (Unix time): "the launch" of ``stapo.deadline``'s seconds."""
    import psutil  # installed with verl 0.9.1 (TransferQueue's)

    return psutil.Process().create_time()


def slurm_end(env: dict, run=subprocess.run) -> float | None:
    """The Slurm job's end time (Unix time): ``SLURM_JOB_END_TIME`` where Slurm sets it, else ``squeue``'s end time
    for ``SLURM_JOB_ID`` (local time); None outside a job, without a time limit, or when squeue cannot tell."""
    if env.get("SLURM_JOB_END_TIME", "").strip().isdigit():
        end = float(env["SLURM_JOB_END_TIME"])
    elif env.get("SLURM_JOB_ID") and shutil.which("squeue"):
        try:
            out = run(
                ["squeue", "-h", "-j", env["SLURM_JOB_ID"], "-o", "%e"], capture_output=True, text=True, timeout=30
            )
            end = datetime.fromisoformat(out.stdout.strip()).timestamp()  # "NONE", "N/A": no end
        except (subprocess.SubprocessError, OSError, ValueError):
            return None
    else:
        return None
    return end if end - time.time() < NO_LIMIT_S else None


def find_deadline(value, env: dict, start: float, run=subprocess.run) -> tuple[float, str] | None:
    """The run's deadline (Unix time) and where it came from, first found wins: ``stapo.deadline`` (``value``;
    empty: not set), the Slurm job's end time (:func:`slurm_end`), verl's expiry variables; None without any."""
    if value not in (None, ""):
        return parse_deadline(value, start), "stapo.deadline"
    end = slurm_end(env, run)
    if end is not None:
        return end, "the Slurm job's end time"
    for name in EXPIRY_VARIABLES:
        try:
            return float(env[name]), name
        except (KeyError, ValueError):
            continue
    return None


def must_stop(now: float, deadline: float, longest_step: float, longest_save: float, margin: float) -> bool:
    """Whether a step and a save no longer fit before ``deadline``: time left < longest step + save + margin, the save
    taken as the longest measured one, or :data:`SAVE_GUESS_S` before any (as verl's ``should_save_ckpt_esi``)."""
    return deadline - now < longest_step + (longest_save or SAVE_GUESS_S) + margin


@dataclass
class StepClock:
    """What the trainer knows of its pace: the longest step of this launch (from one step's start to the next's, so
    its validation and logging count too; the step under way counts as far as it went) and the longest save."""

    deadline: float | None
    margin: float
    longest_step: float = 0.0
    longest_save: float = 0.0
    _began: float | None = None

    @classmethod
    def of(cls, value, margin: float, start: float) -> StepClock:
        """The clock of a run whose ``stapo.deadline`` is ``value`` (empty: none) and margin ``margin``."""
        return cls(parse_deadline(value, start) if value not in (None, "") else None, margin)

    def began(self, now: float) -> None:
        if self._began is not None:
            self.longest_step = max(self.longest_step, now - self._began)
        self._began = now

    def saved(self, seconds: float) -> None:
        self.longest_save = max(self.longest_save, seconds)

    def ended(self, now: float) -> str | None:
        """At the end of a step: why to stop now ("the deadline ..."), or None while the next step still fits."""
        if self.deadline is None or self._began is None:
            return None
        step = max(self.longest_step, now - self._began)
        if not must_stop(now, self.deadline, step, self.longest_save, self.margin):
            return None
        save = f"{self.longest_save:.0f} s save" if self.longest_save else f"a save (guessed {SAVE_GUESS_S:.0f} s)"
        return (
            f"the deadline is {self.deadline - now:.0f} s away, less than a {step:.1f} s step, {save} and "
            f"{self.margin:.0f} s margin"
        )


def request(folder: Path, reason: str) -> bool:
    """Ask the trainer of ``folder`` to save and stop (:data:`REQUEST_FILE`); False if a request is already there."""
    folder.mkdir(parents=True, exist_ok=True)
    try:
        descriptor = os.open(folder / REQUEST_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(descriptor, "w") as file:
        file.write(reason + "\n")
    return True


def requested(folder: Path) -> str | None:
    """The reason of a request in ``folder``, or None."""
    try:
        return (folder / REQUEST_FILE).read_text().strip() or "a stop request"
    except FileNotFoundError:
        return None


def answer(folder: Path, step: int, reason: str) -> None:
    """The trainer saved ``step`` and stops (:data:`SAVED_FILE`)."""
    write_atomic(folder / SAVED_FILE, json.dumps({"step": step, "reason": reason}) + "\n")


def clear(folder: Path) -> dict | None:
    """Remove a request and an answer from ``folder`` (a launch starts without them); the answer, if there was one."""
    (folder / REQUEST_FILE).unlink(missing_ok=True)
    try:
        saved = json.loads((folder / SAVED_FILE).read_text())
    except (FileNotFoundError, ValueError):
        saved = None
    (folder / SAVED_FILE).unlink(missing_ok=True)
    return saved


_armed: dict = {"folder": None, "pending": None, "terms": 0}


def _on_signal(signum, frame) -> None:
    name = signal.Signals(signum).name
    if signum == signal.SIGTERM:
        _armed["terms"] += 1
        if _armed["terms"] > 1:  # a second SIGTERM: now
            raise SystemExit(128 + signum)
    reason = f"{name} at {datetime.now(timezone.utc).isoformat(timespec='seconds')}"
    if _armed["folder"] is None:
        _armed["pending"] = _armed["pending"] or reason
    elif request(_armed["folder"], reason):
        os.write(2, f"STAPO: {name}: the run saves at the end of this step and exits {RESUME_EXIT}\n".encode())


def arm(folder: Path | None = None) -> None:
    """In the driver: SIGUSR1 and SIGTERM request a save at the end of the step (in ``folder``, the run's checkpoint
    folder, once known: a signal before that is kept until then); a second SIGTERM ends the driver."""
    if folder is None:
        for signum in SIGNALS:
            signal.signal(signum, _on_signal)
        return
    _armed["folder"] = Path(folder)
    if _armed["pending"]:
        request(_armed["folder"], _armed["pending"])
        _armed["pending"] = None
