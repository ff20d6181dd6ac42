"""Multi-seed experiment on the quickstart's task: does S2T change training?

    python -m stapo.quickstart.experiment run --out DIR [--methods justrl stapo grpo] [--seeds 0 1 2] [--steps 150]
        [--gpus 0,1,2] [quickstart options: --tokenizer DIR --tau-p 0.002 --val 200 ...]
    python -m stapo.quickstart.experiment summary DIR [--plots DIR]

``run`` builds the task and a tiny Qwen3 and warms it up once (:func:`stapo.quickstart.run.prepare`, on the first
GPU), then trains every (method, seed) from that one warmed-up model through the real trainer (``python -m
stapo.train --config-name=METHOD``: verl V1, vLLM, FSDP), all runs at once, spread over the GPUs (several per GPU:
a tiny model leaves the GPU idle most of the time). A run's seed sets the order of the prompts (``data.seed``) and
vLLM's sampling (``actor_rollout_ref.rollout.seed``); every run validates on the task's validation split every
``--test-freq`` steps, checkpoints every ``--save-freq`` steps, and logs verl's metrics with the recipe's ``stapo/*``
and ``s2t/*`` (the S2T rule observed at the old policy in every run, applied only by STAPO). Each run writes
``DIR/runs/METHOD-sSEED/{train.log,metrics.jsonl,exit_code}``. The same command again continues: finished runs are
kept, the others resume from their latest checkpoint (verl's ``resume_mode: auto``).

``summary`` reads the runs' metrics and writes ``summary.md`` (per method: mean ± standard deviation over seeds of the
validation accuracy before and after training, the training reward, the actor entropy, the response length, the
silenced share and the gradient-norm bound of the tokens S2T flags) and, with matplotlib, the curves of each method as
the mean over seeds with a min-max band (:func:`stapo.tools.report.plot_runs`). docs/experiments.md reports a run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from stapo.config import methods
from stapo.quickstart.run import (
    PROMPTS,
    ROLLOUTS,
    add_model_options,
    check_model_args,
    mean,
    prepare,
    sample,
    score_responses,
    train_overrides,
    warmup,
)
from stapo.quickstart.tiny import replace_overrides
from stapo.tools.io import write_atomic
from stapo.tools.report import VALIDATION, ReportError, band, plot_runs, read_metrics

MODEL_OPTIONS = (
    "seed",
    "train",
    "val",
    "hidden_size",
    "layers",
    "tokenizer",
    "warmup_steps",
    "batch_size",
    "lr",
    "warmup_target",
)
"""Options that define the warmed-up model: a continued experiment must be given the same ones."""
MAX_WARMUP_ROUNDS = 4
"""Warm-up rounds (of ``--warmup-steps`` each) at most while the sampled accuracy is below ``--warmup-target``."""
LAST = 10
"""Steps at the end of a run whose training metrics are averaged for the table."""


@dataclass(frozen=True)
class Run:
    """One training run of the experiment: a method, a seed, the GPU it runs on and its place in that GPU's queue of
    starts (``wave``)."""

    method: str
    seed: int
    gpu: str
    wave: int

    @property
    def name(self) -> str:
        return f"{self.method}-s{self.seed}"


def plan(method_names: Sequence[str], seeds: Sequence[int], gpus: Sequence[str]) -> list[Run]:
    """Every (method, seed) on a GPU, diagonally: run ``i`` (seed-major order) goes to GPU ``(i + i // G) % G``, so
    that with as many methods as GPUs each GPU holds every method once and no method shares a GPU with itself."""
    runs, count = [], {gpu: 0 for gpu in gpus}
    for i, (seed, method) in enumerate((s, m) for s in seeds for m in method_names):
        gpu = gpus[(i + i // len(gpus)) % len(gpus)]
        runs.append(Run(method, seed, gpu, count[gpu]))
        count[gpu] += 1
    return runs


def run_overrides(run: Run, warm: Path, paths: dict[str, Path], args: argparse.Namespace, per_gpu: int) -> list[str]:
    """Hydra overrides of one run: the quickstart's run (:func:`stapo.quickstart.run.train_overrides`) with the run's
    seed, ``--steps``, validation every ``--test-freq`` steps (``--val-n`` samples per problem), checkpoints every
    ``--save-freq`` steps, the same S2T thresholds in every method (observed by the ``s2t/*`` metrics where not
    applied) and vLLM's share of the GPU divided among the runs that share it."""
    out = args.out / "runs" / run.name
    changes = {
        "trainer.experiment_name": f"experiment_{run.name}",
        "data.seed": run.seed,
        "actor_rollout_ref.rollout.seed": run.seed,
        "trainer.test_freq": args.test_freq,
        "trainer.save_freq": args.save_freq,
        "trainer.max_actor_ckpt_to_keep": 2,
        "actor_rollout_ref.actor.checkpoint.save_contents": "[model,optimizer,extra]",
        "actor_rollout_ref.rollout.val_kwargs.n": args.val_n,
        "actor_rollout_ref.rollout.gpu_memory_utilization": round(min(0.3, 0.6 / per_gpu), 3),
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": PROMPTS // 4 * ROLLOUTS,  # GRPO's KL reference
        "stapo.tau_p": args.tau_p,
        "stapo.q": args.q,
    }
    return replace_overrides(train_overrides(run.method, warm, paths, args.steps, out, args.tau_p), changes)


def launch(runs: Sequence[Run], warm: Path, paths: dict[str, Path], args: argparse.Namespace) -> dict[str, int]:
    """Start every unfinished run (a GPU's later runs ``--stagger`` seconds apart, so that their vLLM engines do not
    measure memory at the same moment), wait for all, and return each run's exit code (0 for runs kept from before).
    """
    per_gpu = max(sum(r.gpu == gpu for r in runs) for gpu in {r.gpu for r in runs})
    codes, started = {}, []
    start = last = time.monotonic() - 5
    for run in sorted(runs, key=lambda r: r.wave):
        out = args.out / "runs" / run.name
        if (out / "exit_code").is_file() and (out / "exit_code").read_text().strip() == "0":
            print(f"{run.name}: finished before, kept")
            codes[run.name] = 0
            continue
        out.mkdir(parents=True, exist_ok=True)
        # a GPU's later runs wait their turn; any two starts are 5 s apart (each starts its own Ray cluster)
        time.sleep(max(run.wave * args.stagger - (time.monotonic() - start), last + 5 - time.monotonic(), 0))
        last = time.monotonic()
        cmd = [sys.executable, "-m", "stapo.train", f"--config-name={run.method}"]
        cmd += run_overrides(run, warm, paths, args, per_gpu)
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": run.gpu, "VERL_FILE_LOGGER_PATH": str(out / "metrics.jsonl")}
        with open(out / "train.log", "a") as log:
            process = subprocess.Popen(list(map(str, cmd)), stdout=log, stderr=subprocess.STDOUT, env=env)
        print(f"{run.name}: started on GPU {run.gpu} (log: {out / 'train.log'})", flush=True)
        started.append((run, process))
    for run, process in started:
        codes[run.name] = process.wait()
        write_atomic(args.out / "runs" / run.name / "exit_code", f"{codes[run.name]}\n")
        print(f"{run.name}: exit {codes[run.name]}", flush=True)
    return codes


# ---------------------------------------------------------------------------------------------------- summary
def read_runs(folder: Path) -> dict[str, dict[int, dict[str, dict[int, float]]]]:
    """``method -> {seed -> metrics}`` of the runs under ``folder/runs`` that logged anything."""
    runs: dict[str, dict[int, dict[str, dict[int, float]]]] = {}
    for log in sorted((folder / "runs").glob("*-s*/metrics.jsonl")):
        method, _, seed = log.parent.name.rpartition("-s")
        try:
            runs.setdefault(method, {})[int(seed)] = read_metrics(log)
        except ReportError as error:
            print(f"skipped: {error}")
    if not runs:
        raise SystemExit(f"error: no metrics under {folder / 'runs'}; run `python -m stapo.quickstart.experiment run`")
    return runs


def _mean_sd(values: Sequence[float]) -> str:
    """``mean ± sd`` over seeds (sd: sample standard deviation), or ``mean`` for one value, or ``-``."""
    values = [v for v in values if not math.isnan(v)]
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.4g}"
    return f"{statistics.fmean(values):.4g} ± {statistics.stdev(values):.2g}"


def _last(series: dict[int, float], steps: int = LAST) -> float:
    """Mean of a training metric over its last ``steps`` logged steps (NaN if it was never logged)."""
    values = [series[s] for s in sorted(series)[-steps:]]
    return statistics.fmean(values) if values else math.nan


def summary_rows(runs: dict[str, dict[int, dict[str, dict[int, float]]]]) -> list[dict[str, str]]:
    """One row per method: seeds, steps every seed reached, validation accuracy at the first and at the last step all
    seeds validated, and the last :data:`LAST` steps' mean of the training metrics (± sd over seeds)."""
    rows = []
    for method in sorted(runs, key=lambda m: methods().index(m) if m in methods() else len(methods())):
        seeds = runs[method]
        group = list(seeds.values())
        val_key = next((k for k in sorted(group[0]) if VALIDATION.fullmatch(k)), None)
        row = {"method": method, "seeds": ",".join(map(str, sorted(seeds)))}
        row["steps"] = str(min(max(m.get("critic/score/mean", {0: 0})) for m in group))
        if val_key and all(val_key in m for m in group):
            steps = band([m[val_key] for m in group])[0]
            if steps:
                first, last = steps[0], steps[-1]
                row[f"val acc @ step {first}"] = _mean_sd([100 * m[val_key][first] for m in group])
                row[f"val acc @ step {last}"] = _mean_sd([100 * m[val_key][last] for m in group])
        for label, key, scale in (
            ("reward", "critic/score/mean", 1),
            ("entropy", "actor/entropy", 1),
            ("response length", "response_length/mean", 1),
            ("silenced %", "stapo/masked_frac", 100),
            ("S2T-flagged %", "s2t/spurious_frac", 100),
            ("flagged share of bound %", "s2t/grad_bound/spurious_share", 100),
        ):
            row[f"{label} (last {LAST})"] = _mean_sd([scale * _last(m.get(key, {})) for m in group])
        rows.append(row)
    return rows


def to_markdown(rows: Sequence[dict[str, str]]) -> str:
    """The rows as one Markdown table per method (validation columns differ when the runs reached different steps)."""
    columns = list(dict.fromkeys(k for row in rows for k in row))
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(row.get(c, "-") for c in columns) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def summarize(folder: Path, plots: Path | None) -> str:
    """Write ``folder/summary.md`` and, where matplotlib is installed, the curves into ``plots``; return the table."""
    runs = read_runs(folder)
    table = to_markdown(summary_rows(runs))
    write_atomic(folder / "summary.md", table)
    if plots is not None:
        try:
            written, _ = plot_runs({m: list(seeds.values()) for m, seeds in runs.items()}, plots)
            print("wrote " + ", ".join(map(str, written)))
        except ReportError as error:
            print(f"plots skipped: {error}")
    return table


# ---------------------------------------------------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m stapo.quickstart.experiment", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="warm up once, then train every method and seed in parallel")
    add_model_options(run)
    run.set_defaults(out=Path("outputs/experiment"))
    run.add_argument(
        "--warmup-target",
        type=float,
        default=0.2,
        help=f"more warm-up rounds (at most {MAX_WARMUP_ROUNDS} in all) while the sampled accuracy is below this",
    )
    run.add_argument("--methods", nargs="+", default=["justrl", "stapo", "grpo"], help="recipe methods (configs/)")
    run.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2], help="RL seeds (prompt order, sampling)")
    run.add_argument("--steps", type=int, default=150, help="RL steps per run")
    run.add_argument("--test-freq", type=int, default=25, help="validate every this many steps (and before)")
    run.add_argument("--val-n", type=int, default=4, help="validation samples per problem")
    run.add_argument("--save-freq", type=int, default=50, help="checkpoint every this many steps")
    run.add_argument("--gpus", help="comma-separated GPU indices (default: every visible GPU)")
    run.add_argument("--stagger", type=float, default=45.0, help="seconds between starts on one GPU")
    summary = commands.add_parser("summary", help="table and curves of the runs under DIR")
    summary.add_argument("folder", type=Path, metavar="DIR")
    summary.add_argument("--plots", type=Path, help="folder for the curves (default: DIR/plots)")
    return parser


def check_run_args(args: argparse.Namespace) -> list[str]:
    """Every option of ``run`` before any work; returns the GPUs as ``CUDA_VISIBLE_DEVICES`` entries."""
    check_model_args(args)
    unknown = sorted(set(args.methods) - set(methods()))
    if unknown:
        raise SystemExit(f"error: --methods: unknown {', '.join(unknown)}; choose from {', '.join(methods())}")
    if len(set(args.methods)) < len(args.methods) or len(set(args.seeds)) < len(args.seeds):
        raise SystemExit("error: --methods and --seeds must not repeat a value")
    for name in ("steps", "test_freq", "val_n", "save_freq"):
        if getattr(args, name) < 1:
            raise SystemExit(f"error: --{name.replace('_', '-')}={getattr(args, name)}: must be a positive integer")
    if args.stagger < 0:
        raise SystemExit(f"error: --stagger={args.stagger}: must not be negative")
    visible = torch.cuda.device_count()
    if visible == 0:
        raise SystemExit("error: the experiment trains with verl and needs CUDA GPUs (none visible)")
    gpus = args.gpus.split(",") if args.gpus else [str(i) for i in range(visible)]
    bad = [g for g in gpus if not g.isdigit() or int(g) >= visible]
    if bad or len(set(gpus)) < len(gpus):
        raise SystemExit(f"error: --gpus={args.gpus}: pass distinct indices below {visible} (the visible GPUs)")
    if not 0 <= args.warmup_target <= 1:
        raise SystemExit(f"error: --warmup-target={args.warmup_target}: must be a fraction in [0, 1]")
    ids = os.environ.get("CUDA_VISIBLE_DEVICES")  # each run sees one GPU: name it as this process's list does
    return [ids.split(",")[int(g)] for g in gpus] if ids else gpus


def model_options(args: argparse.Namespace) -> dict[str, str]:
    """The options of :data:`MODEL_OPTIONS`, as strings (for ``DIR/experiment.json``)."""
    return {name: str(getattr(args, name)) for name in MODEL_OPTIONS}


def warm_model(args: argparse.Namespace) -> Path:
    """The warmed-up model's folder: made by :func:`stapo.quickstart.run.prepare` on the first GPU, or, when
    ``args.out`` holds one from the same model options (``experiment.json``), that one."""
    record = args.out / "experiment.json"
    if record.is_file():
        before = json.loads(record.read_text())
        changed = sorted(k for k, v in model_options(args).items() if before.get(k) != v)
        if changed:
            raise SystemExit(
                f"error: {args.out} holds an experiment with other {', '.join('--' + k for k in changed)} "
                f"({record}); pass the same options to continue it, or a new --out"
            )
        print(f"warmed-up model from before: {args.out / 'warmup'}")
        return args.out / "warmup"
    warm = prepare(args, "cuda")
    accuracy, rounds = mean(warm.scores), 1
    while accuracy < args.warmup_target and rounds < MAX_WARMUP_ROUNDS:
        # another one-cycle round from the current weights (the first round's seed, shifted per round)
        split = warm.splits["train"]
        warmup(warm.model, warm.tokenizer, split, args.warmup_steps, args.batch_size, args.lr, args.seed + rounds)
        rounds += 1
        accuracy = mean(score_responses(warm.problems, sample(warm.model, warm.tokenizer, warm.problems, args.samples)))
        print(f"warm-up round {rounds}: sampled accuracy {100 * accuracy:.1f}% (target {100 * args.warmup_target:g}%)")
        warm.model.save_pretrained(warm.folder)
    write_atomic(record, json.dumps({**model_options(args), "warmup_rounds": rounds}, indent=1) + "\n")
    folder = warm.folder
    del warm  # the runs' vLLM engines measure the GPU's free memory: this process keeps none
    torch.cuda.empty_cache()
    return folder


def main(argv: Sequence[str] | None = None) -> None:
    """Command-line entry point (``python -m stapo.quickstart.experiment``)."""
    args = build_parser().parse_args(argv)
    if args.command == "summary":
        print(summarize(args.folder, args.plots or args.folder / "plots"))
        return
    gpus = check_run_args(args)
    runs = plan(args.methods, args.seeds, gpus)
    folder = warm_model(args)
    paths = {split: args.out / "data" / f"{split}.parquet" for split in ("train", "validation")}
    codes = launch(runs, folder, paths, args)
    print(summarize(args.out, args.out / "plots"))
    failed = sorted(name for name, code in codes.items() if code)
    if failed:
        raise SystemExit(f"error: {len(failed)} run(s) failed: {', '.join(failed)} (logs: {args.out / 'runs'})")


if __name__ == "__main__":
    main()
