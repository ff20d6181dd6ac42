"""Multi-seed experiment on the quickstart's task: does S2T change training?

    python -m stapo.quickstart.experiment run --out DIR [--methods justrl stapo grpo] [--seeds 0 1 2] [--steps 150]
        [--prompts 32] [--gpus 0,1,2,3] [--runs-per-gpu 3] [--save-freq 0] [--warmup-only]
        [quickstart options: --tokenizer DIR --tau-p 0.002 --val 200 ...] [-- KEY=VALUE ...]
    python -m stapo.quickstart.experiment summary DIR [--plots DIR]
    python -m stapo.quickstart.experiment decisive ROUND1 [ROUND2]

``run`` builds the task and a tiny Qwen3 and warms it up once (:func:`stapo.quickstart.run.prepare`, on this
process's first visible GPU), then trains every (method, seed) from that one warmed-up model through the real
trainer (``python -m stapo.train --config-name=METHOD``: verl V1, vLLM, FSDP), ``--runs-per-gpu`` runs a GPU at a
time, each in a Ray cluster of its own on its GPU (:mod:`stapo.train.clusters` says why, and how their job ids
differ). A run's seed sets the order of the prompts (``data.seed``) and vLLM's sampling
(``actor_rollout_ref.rollout.seed``); every run validates on the task's validation split every ``--test-freq`` steps,
checkpoints every ``--save-freq`` steps (none for 0), and logs verl's metrics with the recipe's ``stapo/*`` and
``s2t/*`` (the S2T rule observed at the old policy in every run, applied only by STAPO). Hydra overrides after ``--``
apply to every run (checked before any work). Each run writes ``DIR/runs/METHOD-sSEED/{train.log,metrics.jsonl,
exit_code}``. The same command again continues: finished runs are kept, the others resume from their latest
checkpoint (verl's ``resume_mode: auto``; from step 0 with ``--save-freq 0``).

``summary`` reads the runs' metrics and writes ``stability.md`` (each run against the pre-registered gate of an
unstable run, :func:`stability`) and ``summary.md`` (per method, at the steps every run reached: mean ±
standard deviation over seeds of the validation accuracy before and after training, the training reward, the actor
entropy, the response length, the silenced share and the gradient-norm bound of the tokens S2T flags; then the
differences between methods paired by seed, :func:`paired_rows`) and, with
matplotlib, the curves of each method as the mean over seeds with a min-max band
(:func:`stapo.tools.curves.plot_runs`). docs/experiments.md reports a run.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import signal
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from stapo.config import methods
from stapo.quickstart.run import (
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
from stapo.quickstart.task import task_paths
from stapo.quickstart.tiny import replace_overrides
from stapo.tools.curves import VALIDATION, ReportError, band, mean_over, plot_runs, read_runs, rows_markdown
from stapo.tools.inspect_tokens import group_advantages
from stapo.tools.io import follow_umask, hold_folder, model_folder_problems, output_problem, write_atomic
from stapo.train.clusters import launch
from stapo.train.preflight import local_cluster_problems

RECORDED_OPTIONS = (
    *("seed", "train", "val", "hidden_size", "layers", "tokenizer", "warmup_steps", "batch_size", "lr"),
    *("eval_problems", "samples", "warmup_target", "steps", "prompts", "test_freq", "val_n", "tau_p", "q", "overrides"),
    *("model", "data"),
)
"""Options that define the warmed-up model and the runs: a continued experiment must be given the same ones (more
methods and seeds may be added)."""
RUN_KEYS = {
    **dict.fromkeys(("data.seed", "actor_rollout_ref.rollout.seed"), "--seeds"),
    "trainer.total_training_steps": "--steps",
    "trainer.test_freq": "--test-freq",
    "trainer.save_freq": "--save-freq",
    "actor_rollout_ref.rollout.val_kwargs.n": "--val-n",
    "stapo.tau_p": "--tau-p",
    "stapo.q": "--q",
    **dict.fromkeys(("trainer.experiment_name", "trainer.default_local_dir"), "the run's name"),
    **dict.fromkeys(("actor_rollout_ref.model.path", "data.train_files", "data.val_files"), "the warm-up and the task"),
}
"""Keys the experiment sets for each run, and what sets them: overrides after ``--`` may not change them (two runs
would share a seed or a checkpoint folder, or an option would not mean what it says)."""
TRAINER = [sys.executable, "-m", "stapo.train"]
"""The program that trains one run (its Hydra overrides follow); tests/standins.py puts a stand-in here on a CPU."""
MAX_WARMUP_ROUNDS = 4
"""Warm-up rounds (of ``--warmup-steps`` each) at most while the sampled accuracy is below ``--warmup-target``."""
LAST = 10
"""Steps at the end (of the steps every run reached) over which the table averages the training metrics."""
KV_CACHE_BYTES = 1 << 30
"""vLLM's KV cache in each run: at 2 KiB a token (the tiny model's 2 layers x 4 KV heads of 64, bfloat16 keys and
values) 1 GiB holds about 500,000 tokens, far more than the 256 sequences of at most 128 tokens that vLLM runs at a
time, or one 32,768-token sequence (vLLM's ``max_model_len``)."""


@dataclass(frozen=True)
class Run:
    """One training run of the experiment."""

    method: str
    seed: int
    lr: float | None = None
    """The actor's learning rate where it differs from the experiment's (a sweep run, or a cell of ``--lrs``)."""
    temperature: float | None = None
    """The rollout's temperature where it differs from the experiment's (a cell of ``--temperatures``)."""

    @property
    def name(self) -> str:
        """``METHOD-sSEED``, with ``_lrLR`` and ``_TTEMPERATURE`` after the method where set (its own row in the
        summary)."""
        lr = "" if self.lr is None else f"_lr{self.lr:g}"
        temperature = "" if self.temperature is None else f"_T{self.temperature:g}"
        return f"{self.method}{lr}{temperature}-s{self.seed}"


def plan(
    method_names: Sequence[str],
    seeds: Sequence[int],
    sweep_lrs: Sequence[float] = (),
    lrs: Sequence[float] = (),
    temperatures: Sequence[float] = (),
) -> list[Run]:
    """Every (method, seed), seed-major: the runs start in this order, so that every method has as many finished
    seeds as the others at any time, the methods reversed at every other seed (A B C, C B A: over two seeds no
    method starts earlier on average); with ``lrs`` and ``temperatures``, every cell of those too (a grid, e.g. the
    ladder of docs/history.md, section 10); then the first method and seed at each learning rate of
    ``sweep_lrs``."""
    cells = [(lr, t) for lr in (lrs or [None]) for t in (temperatures or [None])]
    grid = [
        Run(method, seed, lr, t)
        for i, seed in enumerate(seeds)
        for lr, t in cells
        for method in (method_names[::-1] if i % 2 else method_names)
    ]
    return grid + [Run(method_names[0], seeds[0], lr) for lr in sweep_lrs]


def run_overrides(run: Run, warm: Path, paths: dict[str, Path], args: argparse.Namespace) -> list[str]:
    """Hydra overrides of one run: the quickstart's run (:func:`stapo.quickstart.run.train_overrides`) with the run's
    seed, ``--steps``, ``--prompts`` prompts per step (x 8 responses, in four PPO mini-batches as in the paper),
    validation every ``--test-freq`` steps (``--val-n`` samples per problem), checkpoints every ``--save-freq`` steps
    (none for 0) and the same S2T thresholds in every method (observed by the ``s2t/*`` metrics where not applied).

    The other settings leave the algorithm alone. A run of this tiny model is bound by per-call overheads, not by the
    GPU (docs/history.md, section 6), so: vLLM keeps its weights and KV cache between steps
    (``free_cache_engine=False``; verl still clears the prefix cache after each weight update), the old and reference
    log-probabilities are computed in two micro-batches, and four agent-loop workers instead of eight send the
    prompts to vLLM. vLLM is given its KV cache's size (:data:`KV_CACHE_BYTES`) instead of measuring the GPU's free
    memory, which fails when another run on the same GPU frees memory meanwhile (``--runs-per-gpu``)."""
    out = args.out / "runs" / run.name
    mini, log_prob_batch = args.prompts // 4, args.prompts // 2 * ROLLOUTS
    changes = {
        "trainer.experiment_name": f"experiment_{run.name}",
        "data.seed": run.seed,
        "actor_rollout_ref.rollout.seed": run.seed,
        "data.train_batch_size": args.prompts,
        "actor_rollout_ref.actor.ppo_mini_batch_size": mini,
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": mini * ROLLOUTS,
        "trainer.test_freq": args.test_freq,
        "trainer.save_freq": args.save_freq or -1,
        "trainer.max_actor_ckpt_to_keep": 2,
        "actor_rollout_ref.actor.checkpoint.save_contents": "[model,optimizer,extra]",
        "actor_rollout_ref.rollout.val_kwargs.n": args.val_n,
        "actor_rollout_ref.rollout.free_cache_engine": False,
        "actor_rollout_ref.rollout.agent.num_workers": 4,
        "+actor_rollout_ref.rollout.engine_kwargs.vllm.kv_cache_memory_bytes": KV_CACHE_BYTES,
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": log_prob_batch,
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": log_prob_batch,  # GRPO's KL reference
        "stapo.tau_p": args.tau_p,
        "stapo.q": args.q,
        **dict(override.split("=", 1) for override in args.overrides),
        **({} if run.lr is None else {"actor_rollout_ref.actor.optim.lr": run.lr}),
        **({} if run.temperature is None else {"actor_rollout_ref.rollout.temperature": run.temperature}),
    }
    return replace_overrides(train_overrides(run.method, warm, paths, args.steps, out, args.tau_p), changes)


# ---------------------------------------------------------------------------------------------------- summary
def _mean_sd(values: Sequence[float]) -> str:
    """``mean ± sd`` over seeds (sd: sample standard deviation), or ``mean`` for one value, or ``-``."""
    values = [v for v in values if not math.isnan(v)]
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.4g}"
    return f"{statistics.fmean(values):.4g} ± {statistics.stdev(values):.2g}"


STATE = (
    ("reward", "critic/score/mean", 1),
    ("entropy", "actor/entropy", 1),
    ("response length", "response_length/mean", 1),
)
"""Training metrics the table averages over the last :data:`LAST` steps that every run reached: (label, key, scale)."""
EVENTS = (
    ("silenced %", "stapo/masked_frac", 100),
    ("S2T-flagged %", "s2t/spurious_frac", 100),
    ("candidates %", "s2t/candidate_frac", 100),
    ("flagged share of bound %", "s2t/grad_bound/spurious_share", 100),
)
"""S2T metrics (rare events) the table averages over every step that every run reached."""


def _bound_ratio(metrics: dict[str, dict[int, float]], steps: range) -> float:
    """Mean over ``steps`` (those with candidates) of the candidates' mean gradient-norm bound over the other
    tokens'."""
    candidate, other = metrics.get("s2t/grad_bound/candidate_mean", {}), metrics.get("s2t/grad_bound/other_mean", {})
    ratios = [candidate[s] / other[s] for s in steps if s in candidate and other.get(s)]
    return statistics.fmean(ratios) if ratios else math.nan


Runs = dict[str, dict[int, dict[str, dict[int, float]]]]
"""``method -> {seed -> metrics}`` (:func:`read_runs`)."""


def _common_steps(runs: Runs) -> tuple[range, str | None, list[int]]:
    """(the last :data:`LAST` steps that every run reached, the validation accuracy's key, the steps every run
    validated)."""
    everyone = [m for seeds in runs.values() for m in seeds.values()]
    end = min(max(m["critic/score/mean"]) for m in everyone)
    val_key = next((k for m in everyone for k in sorted(m) if VALIDATION.fullmatch(k)), None)
    last = range(max(end - LAST, 0) + 1, end + 1)
    return last, val_key, band([m.get(val_key, {}) for m in everyone])[0] if val_key else []


def _ordered(runs: Runs) -> list[str]:
    """The methods of ``runs`` in the recipe's order (others, e.g. sweep runs, last)."""
    return sorted(runs, key=lambda m: methods().index(m) if m in methods() else len(methods()))


def summary_rows(runs: Runs) -> list[dict[str, str]]:
    """One row per method, every number the mean ± sd over its seeds, all at steps that every run reached (so that
    methods are compared at the same point even when some runs stopped early): validation accuracy at the first and
    the last step all runs validated, the :data:`STATE` metrics over the last :data:`LAST` such steps, the
    :data:`EVENTS` metrics and the candidates' gradient-norm bound relative to the other tokens' over all of them."""
    last, val_key, val_steps = _common_steps(runs)
    end, whole = last.stop - 1, range(1, last.stop)
    rows = []
    for method in _ordered(runs):
        group = [runs[method][seed] for seed in sorted(runs[method])]
        row = {"method": method, "seeds": ",".join(map(str, sorted(runs[method])))}
        row["steps run"] = "/".join(str(max(m["critic/score/mean"])) for m in group)
        for step in sorted({*val_steps[:1], *val_steps[-1:]}):
            row[f"val acc % @ {step}"] = _mean_sd([100 * m[val_key][step] for m in group])
        for label, key, scale in STATE:
            row[f"{label} @ {last.start}-{end}"] = _mean_sd([scale * mean_over(m.get(key, {}), last) for m in group])
        for label, key, scale in EVENTS:
            row[f"{label} @ 1-{end}"] = _mean_sd([scale * mean_over(m.get(key, {}), whole) for m in group])
        row[f"candidate / other bound @ 1-{end}"] = _mean_sd([_bound_ratio(m, whole) for m in group])
        rows.append(row)
    return rows


PAIRED = (("entropy", "actor/entropy"), ("gradient norm", "actor/grad_norm"))
"""Training metrics the paired table compares over the last :data:`LAST` steps that every run reached."""


def _paired_cell(differences: Sequence[float]) -> str:
    """``mean ± sd (t T)`` of per-seed differences, t = mean / (sd / √n), and ``, N seeds`` where a seed without the
    metric (NaN) was left out; ``-`` for fewer than two."""
    kept = [d for d in differences if not math.isnan(d)]
    if len(kept) < 2:
        return "-"
    mean, sd = statistics.fmean(kept), statistics.stdev(kept)
    t = mean / (sd / math.sqrt(len(kept))) if sd else math.copysign(math.inf, mean) if mean else math.nan
    return f"{mean:+.3g} ± {sd:.2g} (t {t:.3g}{'' if len(kept) == len(differences) else f', {len(kept)} seeds'})"


def paired_rows(runs: Runs) -> list[dict[str, str]]:
    """Differences between methods paired by seed: a run's seed sets its prompt order and vLLM's sampling, so the arms
    of one seed share that part of the noise and their difference does not. One row per pair of methods (the later
    minus the earlier, in the recipe's order) over the seeds both ran, at the steps every run reached: the validation
    accuracy at the last step all runs validated and the :data:`PAIRED` metrics over the last :data:`LAST` such steps.
    Each cell is ``mean ± sd (t)`` of the per-seed differences, with n - 1 degrees of freedom for n seeds: the
    two-sided 5 % level is |t| ≥ 12.7, 4.30, 3.18, 2.78 for 2, 3, 4, 5 seeds (docs/history.md, section 9.3)."""
    last, val_key, val_steps = _common_steps(runs)
    order, rows = _ordered(runs), []
    for i, first in enumerate(order):
        for second in order[i + 1 :]:
            seeds = sorted(runs[first].keys() & runs[second].keys())
            pair = [(runs[second][seed], runs[first][seed]) for seed in seeds]
            row = {"difference": f"{second} - {first}", "seeds": ",".join(map(str, seeds))}
            if val_steps:
                step = val_steps[-1]
                row[f"val acc points @ {step}"] = _paired_cell(
                    [100 * (b[val_key][step] - a[val_key][step]) for b, a in pair]
                )
            for label, key in PAIRED:
                row[f"{label} @ {last.start}-{last.stop - 1}"] = _paired_cell(
                    [mean_over(b.get(key, {}), last) - mean_over(a.get(key, {}), last) for b, a in pair]
                )
            rows.append(row)
    return rows


GATE = {"window": 10, "after": 5, "rise": 0.05, "rise_share": 0.5, "grad_norm": 2.0, "grad_steps": 5, "drop": 0.15}
"""The gate that calls a run unstable, pre-registered in docs/history.md, section 10 (2026-11-28), before any run of
the ladder: entropy rise, gradient-norm spikes or a reward drop (:func:`stability`)."""


def stability(metrics: dict[str, dict[int, float]]) -> dict[str, float | bool]:
    """The gate of :data:`GATE` on one run's metrics, with W = 10-step windows:

    * ``entropy_rise`` R = (mean ``actor/entropy`` of the last W steps) − (the lowest mean of W consecutive steps
      that start after step 5); the entropy gate passes when R ≥ 0.05 nats and R ≥ 0.5 of that lowest mean;
    * ``grad_spikes``: steps whose ``actor/grad_norm`` (verl's, before clipping) exceeds 2; passes at 5 or more;
    * ``reward_drop``: the highest W-step mean of ``critic/score/mean`` minus the last one; passes at 0.15 or more.

    ``unstable`` is whether any passes; NaN where the run is shorter than the windows need."""
    w = GATE["window"]

    def windows(key: str) -> list[tuple[int, float]]:
        series = metrics.get(key, {})
        steps = sorted(series)
        return [(steps[i], statistics.fmean(series[s] for s in steps[i : i + w])) for i in range(len(steps) - w + 1)]

    entropy, reward = windows("actor/entropy"), windows("critic/score/mean")
    lows = [mean for start, mean in entropy if start > GATE["after"]]
    rise = entropy[-1][1] - min(lows) if lows else math.nan
    drop = max(m for _, m in reward) - reward[-1][1] if reward else math.nan
    spikes = sum(v > GATE["grad_norm"] for v in metrics.get("actor/grad_norm", {}).values())
    rise_gate = bool(lows) and rise >= GATE["rise"] and rise >= GATE["rise_share"] * min(lows)
    return {
        "entropy_rise": rise,
        "lowest_entropy": min(lows) if lows else math.nan,
        "grad_spikes": spikes,
        "reward_drop": drop,
        "unstable": rise_gate or spikes >= GATE["grad_steps"] or (bool(reward) and drop >= GATE["drop"]),
    }


def stability_rows(runs: Runs) -> list[dict[str, str]]:
    """One row per run: :func:`stability`'s numbers and verdict (docs/history.md, section 10)."""
    rows = []
    for method in _ordered(runs):
        for seed in sorted(runs[method]):
            gate = stability(runs[method][seed])
            rows.append(
                {
                    "run": f"{method}-s{seed}",
                    "entropy rise R": f"{gate['entropy_rise']:.4g}",
                    "lowest 10-step entropy": f"{gate['lowest_entropy']:.4g}",
                    "grad norm > 2 (steps)": str(gate["grad_spikes"]),
                    "reward drop": f"{gate['reward_drop']:.4g}",
                    "unstable": "yes" if gate["unstable"] else "no",
                }
            )
    return rows


PAIRED_NOTE = (
    "Differences between methods are taken seed by seed and need two or more seeds that every method ran (e.g. "
    "`--seeds 0 1 2`): one seed cannot separate a method from the noise of its sampling."
)
"""What the summary says instead of the table of :func:`paired_rows` when no pair of methods shares two seeds."""


def summarize(folder: Path, plots: Path | None) -> str:
    """Write ``folder/summary.md`` and, where matplotlib is installed, the curves into ``plots``; return the tables:
    per method, then the differences paired by seed (or :data:`PAIRED_NOTE` where no pair shares two seeds)."""
    runs = read_runs(folder)
    pairs = paired_rows(runs)
    table = rows_markdown(summary_rows(runs))
    if any("," in row["seeds"] for row in pairs):
        table += "\n" + rows_markdown(pairs)
    elif pairs:  # a table of dashes would look like a failure (the quickstart runs one seed)
        table += f"\n{PAIRED_NOTE}\n"
    write_atomic(folder / "summary.md", table)
    write_atomic(folder / "stability.md", rows_markdown(stability_rows(runs)))
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
    run.add_argument(
        "--warmup-only",
        action="store_true",
        help="stop after the warm-up, which prints and records each round's accuracy and S2T shares (to choose "
        "--warmup-target: docs/history.md, section 5); use another --out for the experiment itself",
    )
    run.add_argument(
        "--model",
        type=Path,
        help="start every run from this Hugging Face folder instead of warming up the tiny model (e.g. SmolLM2 after "
        "python -m stapo.quickstart.warmup); with --data",
    )
    run.add_argument(
        "--data",
        type=Path,
        help="the task's folder (train.parquet, validation.parquet; python -m stapo.quickstart.task)",
    )
    run.add_argument("--methods", nargs="+", default=["justrl", "stapo", "grpo"], help="recipe methods (configs/)")
    run.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2], help="RL seeds (prompt order, sampling)")
    run.add_argument(
        "--sweep-lrs",
        nargs="+",
        type=float,
        default=[],
        metavar="LR",
        help="also run the first method and seed at each of these learning rates, beside the grid (a learning-rate "
        "sweep in the same launch: one Ray job numbering, so no run shares another's weight-transfer socket)",
    )
    run.add_argument(
        "--lrs", nargs="+", type=float, default=[], metavar="LR",
        help="a grid dimension: every method and seed at each of these learning rates",
    )  # fmt: skip
    run.add_argument(
        "--temperatures", nargs="+", type=float, default=[], metavar="T",
        help="a grid dimension: every method and seed at each of these rollout temperatures (validation keeps its own)",
    )  # fmt: skip
    run.add_argument("--steps", type=int, default=150, help="RL steps per run")
    run.add_argument(
        "--prompts",
        type=int,
        default=32,
        help=f"prompts per step (x {ROLLOUTS} responses; a multiple of 4: four PPO mini-batches)",
    )
    run.add_argument("--test-freq", type=int, default=25, help="validate every this many steps (and before)")
    run.add_argument("--val-n", type=int, default=4, help="validation samples per problem")
    run.add_argument("--save-freq", type=int, default=50, help="checkpoint every this many steps (0: never)")
    run.add_argument("--gpus", help="comma-separated GPU indices (default: every visible GPU)")
    run.add_argument(
        "--runs-per-gpu", type=int, default=1, help="runs at a time on each GPU (each with its Ray cluster and vLLM)"
    )
    run.add_argument("--stall-minutes", type=float, default=15.0, help="stop a run whose log is silent this long")
    run.add_argument(
        "overrides", nargs="*", metavar="KEY=VALUE", help="Hydra overrides for every run, after '--' (as stapo.train's)"
    )
    summary = commands.add_parser("summary", help="table and curves of the runs under DIR")
    summary.add_argument("folder", type=Path, metavar="DIR")
    summary.add_argument("--plots", type=Path, help="folder for the curves (default: DIR/plots)")
    decisive = commands.add_parser(
        "decisive", help="the pre-registered decisive test (docs/experiments.md section 11): table and verdict line"
    )
    decisive.add_argument("folders", type=Path, nargs="+", metavar="ROUND", help="round 1's folder, then round 2's")
    return parser


def check_run_args(args: argparse.Namespace) -> list[str]:
    """Every option of ``run`` before any work; returns the GPUs as ``CUDA_VISIBLE_DEVICES`` entries."""
    check_model_args(args)
    if problem := output_problem(args.out, "folder"):
        raise SystemExit(f"error: {problem}")
    unknown = sorted(set(args.methods) - set(methods()))
    if unknown:
        raise SystemExit(f"error: --methods: unknown {', '.join(unknown)}; choose from {', '.join(methods())}")
    if len(set(args.methods)) < len(args.methods) or len(set(args.seeds)) < len(args.seeds):
        raise SystemExit("error: --methods and --seeds must not repeat a value")
    for name in ("sweep_lrs", "lrs", "temperatures"):
        values = getattr(args, name)
        if len(set(values)) < len(values) or not all(v > 0 for v in values):
            raise SystemExit(
                f"error: --{name.replace('_', '-')} {' '.join(map(str, values))}: distinct positive numbers"
            )
    gridded = {"actor_rollout_ref.actor.optim.lr": args.lrs, "actor_rollout_ref.rollout.temperature": args.temperatures}
    for override in args.overrides:
        if gridded.get(override.split("=", 1)[0].lstrip("+~")):
            raise SystemExit(f"error: override {override}: --lrs or --temperatures sets it for each run")
    for name in ("steps", "test_freq", "val_n", "runs_per_gpu"):
        if getattr(args, name) < 1:
            raise SystemExit(f"error: --{name.replace('_', '-')}={getattr(args, name)}: must be a positive integer")
    if args.save_freq < 0:
        raise SystemExit(f"error: --save-freq={args.save_freq}: must be a non-negative integer (0: no checkpoints)")
    if args.prompts < 4 or args.prompts % 4:
        raise SystemExit(f"error: --prompts={args.prompts}: must be a positive multiple of 4 (four PPO mini-batches)")
    if not args.stall_minutes > 0:
        raise SystemExit(f"error: --stall-minutes={args.stall_minutes}: must be positive")
    if not 0 <= args.warmup_target <= 1:
        raise SystemExit(f"error: --warmup-target={args.warmup_target}: must be a fraction in [0, 1]")
    if (args.model is None) != (args.data is None):
        raise SystemExit("error: --model and --data go together: a prepared model and the task it trains on")
    if args.model is not None:
        problems = model_folder_problems(args.model)
        problems += [f"--data {path}: no such file" for path in task_paths(args.data).values() if not path.is_file()]
        if args.warmup_only:
            problems.append("--warmup-only warms up the tiny model; with --model the model is prepared already")
        for problem in problems:
            raise SystemExit(f"error: {problem}")
    check_overrides(args)
    visible = torch.cuda.device_count()
    if visible == 0:
        raise SystemExit("error: the experiment trains with verl and needs CUDA GPUs (none visible)")
    gpus = args.gpus.split(",") if args.gpus else [str(i) for i in range(visible)]
    bad = [g for g in gpus if not g.isdigit() or int(g) >= visible]
    if bad or len(set(gpus)) < len(gpus):
        raise SystemExit(f"error: --gpus={args.gpus}: pass distinct indices below {visible} (the visible GPUs)")
    for problem in local_cluster_problems():  # its jobs' ids could equal those of the runs' clusters
        raise SystemExit(f"error: {problem}")
    ids = os.environ.get("CUDA_VISIBLE_DEVICES")  # the Ray head is started with these: name them as this process does
    return [ids.split(",")[int(g)] if ids else g for _ in range(args.runs_per_gpu) for g in gpus]


def override_problem(overrides: Sequence[str]) -> str | None:
    """The Hydra overrides after ``--`` that are not ``KEY=VALUE``, as one line, or None."""
    malformed = [o for o in overrides if "=" not in o or o.startswith("=")]
    return f"overrides {' '.join(malformed)}: write each as KEY=VALUE, after '--'" if malformed else None


def check_overrides(args: argparse.Namespace) -> None:
    """Each method's config composed with the runs' overrides (those after ``--`` included) must pass the trainer's
    checks (:func:`stapo.train.main.validate`, without looking at files or GPUs)."""
    from stapo.train.main import config_problem

    if problem := override_problem(args.overrides):
        raise SystemExit(f"error: {problem}")
    for override in args.overrides:
        key = override.split("=", 1)[0].lstrip("+~")
        if key in RUN_KEYS:
            raise SystemExit(f"error: override {override}: {key} is set for each run by {RUN_KEYS[key]}")
    paths = task_paths(args.data or args.out / "data")
    model = args.model or args.out / "warmup"
    runs = {method: (method, run_overrides(Run(method, 0), model, paths, args)) for method in args.methods}
    if found := config_problem(runs, args.overrides):
        raise SystemExit(f"error: --methods {found[0]} with the overrides: {found[1]}")


def recorded_options(args: argparse.Namespace) -> dict[str, str]:
    """The options of :data:`RECORDED_OPTIONS`, as strings (for ``DIR/experiment.json``)."""
    return {
        name: str(sorted(args.overrides) if name == "overrides" else getattr(args, name)) for name in RECORDED_OPTIONS
    }


def weights_digest(model) -> str:
    """SHA-256 of a model's weights (names and float32 values, in name order): equal digests, equal models."""
    return state_digest([model.state_dict()])


def state_digest(states: Sequence[dict]) -> str:
    """SHA-256 of state dicts' tensors (each dict's names and float32 values in name order; a DTensor's local shard,
    as a checkpoint file of one rank holds it)."""
    digest = hashlib.sha256()
    for state in states:
        for name, tensor in sorted(state.items()):
            tensor = tensor.to_local() if hasattr(tensor, "to_local") else tensor
            digest.update(name.encode())
            digest.update(tensor.detach().float().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


class TailMass:
    """A logits processor for ``generate`` that leaves the logits alone and records, at each step of each response,
    the probability mass of the tokens below ``tau_p`` (0 once the response has ended): the chance that the token
    sampled there meets S2T's low-probability condition. :meth:`share` turns that into the expected share of such
    tokens among the sampled ones, without the noise of drawing them at each position."""

    def __init__(self, tau_p: float, eos_token_id: int):
        self.tau_p, self.eos = tau_p, eos_token_id
        self.start: int | None = None
        self.mass: list[torch.Tensor] = []
        self.live: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.start = input_ids.shape[1] if self.start is None else self.start  # the first call sees the prompts only
        live = ~(input_ids[:, self.start :] == self.eos).any(dim=1)
        probs = scores.float().softmax(dim=-1)
        self.mass.append(torch.where(live, torch.where(probs < self.tau_p, probs, 0.0).sum(dim=-1), 0.0).cpu())
        self.live.append(live.cpu())
        return scores

    def share(self, rows: torch.Tensor | None = None) -> float:
        """Expected share of the sampled tokens with p < tau_p; with ``rows`` (one bool per response), of those that
        lie in the chosen responses, e.g. the ones with Â > 0 (:func:`positive_advantage`): S2T's candidates."""
        mass = torch.stack(self.mass, dim=1)  # (responses, steps)
        return (mass[rows].sum() if rows is not None else mass.sum()).item() / torch.stack(self.live).sum().item()


def positive_advantage(scores: Sequence[Sequence[float]]) -> torch.Tensor:
    """One bool per response (problem-major, as ``generate`` orders ``num_return_sequences``): whether its GRPO
    advantage Â within its problem's group is positive (verl's estimator, :func:`group_advantages`)."""
    groups = [problem for problem, group in enumerate(scores) for _ in group]
    return group_advantages([score for group in scores for score in group], groups) > 0


def prepared_model(args: argparse.Namespace) -> Path:
    """``--model``, recorded in ``experiment.json`` with the options and the SHA-256 of its weight files; an
    experiment continued in ``args.out`` must have the same options and weights."""
    record = args.out / "experiment.json"
    digest = hashlib.sha256()
    for path in sorted(args.model.glob("*.safetensors")):
        with path.open("rb") as file:
            for block in iter(lambda: file.read(1 << 24), b""):
                digest.update(block)
    fields = {**recorded_options(args), "weights_sha256": digest.hexdigest()}
    if record.is_file():
        before = json.loads(record.read_text())
        changed = [k for k, v in fields.items() if before.get(k) != v]
        if changed:
            raise SystemExit(
                f"error: {args.out} holds an experiment with other {', '.join(changed)} ({record}); pass the same "
                "options and model to continue it, or a new --out"
            )
    write_atomic(record, json.dumps(fields, indent=1) + "\n")
    print(f"prepared model {args.model} (weights sha256 {fields['weights_sha256'][:12]}), task {args.data}")
    return args.model


def warm_model(args: argparse.Namespace, device: str = "cuda") -> Path:
    """The warmed-up model's folder, made by :func:`stapo.quickstart.run.prepare` on ``device`` (this process's first
    visible GPU), in deterministic mode, with more rounds while below ``--warmup-target``; each round's sampled accuracy
    and :class:`TailMass` shares are printed and recorded in ``experiment.json`` (docs/history.md, section 5).

    When ``args.out`` holds an experiment (``experiment.json``), its options must be the same. Its ``warmup/`` is
    used if present; if not (the experiment's metrics and record carried to a new machine), the warm-up runs again
    and must give the recorded weights (``weights_sha256``), else the runs kept from before started from another
    model and the experiment stops."""
    record = args.out / "experiment.json"
    before = None
    if record.is_file():
        before = json.loads(record.read_text())
        before.setdefault("overrides", "[]")  # recorded since the overrides after '--' exist
        before.setdefault("prompts", "64")  # recorded since --prompts exists; the experiments before it used 64
        before.setdefault("model", "None")  # recorded since --model and --data exist
        before.setdefault("data", "None")
        changed = ", ".join(
            "overrides after '--'" if k == "overrides" else f"--{k.replace('_', '-')}"
            for k, v in recorded_options(args).items()
            if before.get(k) != v
        )
        if changed:
            raise SystemExit(
                f"error: {args.out} holds an experiment with other {changed} "
                f"({record}); pass the same options to continue it (more --methods and --seeds may be added), or a "
                "new --out"
            )
        if (args.out / "warmup" / "config.json").is_file():
            print(f"warmed-up model from before: {args.out / 'warmup'}")
            return args.out / "warmup"
        print(f"{args.out / 'warmup'} is missing: warming up again, to the weights {record} records")
    torch.use_deterministic_algorithms(True, warn_only=True)  # the same weights on another machine of the same kind
    warm = prepare(args, device)
    rounds, accuracies, low_prob, candidates = 0, [], [], []
    while True:
        rounds += 1
        tail = TailMass(args.tau_p, warm.tokenizer.eos_token_id)  # on the same samples as the accuracy (same seed)
        responses = sample(warm.model, warm.tokenizer, warm.problems, args.samples, args.seed, observe=tail)
        scores = score_responses(warm.problems, responses)
        accuracy = mean(scores)
        accuracies.append(accuracy)
        low_prob.append(tail.share())
        candidates.append(tail.share(positive_advantage(scores)))
        print(
            f"warm-up round {rounds}: sampled accuracy {100 * accuracy:.1f}% (target {100 * args.warmup_target:g}%); "
            f"expected share of sampled tokens with p < {args.tau_p:g}: {100 * low_prob[-1]:.4f}%, "
            f"in responses with advantage > 0 (S2T's candidates): {100 * candidates[-1]:.4f}%"
        )
        if accuracy >= args.warmup_target or rounds == MAX_WARMUP_ROUNDS:
            break
        # another one-cycle round from the current weights (the first round's seed, shifted per round)
        split = warm.splits["train"]
        warmup(warm.model, warm.tokenizer, split, args.warmup_steps, args.batch_size, args.lr, args.seed + rounds)
        warm.model.save_pretrained(warm.folder)
        follow_umask(warm.folder)
    torch.use_deterministic_algorithms(False)
    digest, folder = weights_digest(warm.model), warm.folder
    del warm  # the runs' vLLM engines measure the GPU's free memory: this process keeps none
    if device == "cuda":
        torch.cuda.empty_cache()
    if before is not None and before.get("weights_sha256") != digest:
        shutil.rmtree(folder)  # never to be taken for the experiment's model by a later call
        raise SystemExit(
            f"error: the warm-up here gave other weights than {record} records (sha256 {digest[:12]}, recorded "
            f"{str(before.get('weights_sha256'))[:12]}): the runs kept in {args.out / 'runs'} started from another "
            "model; bring that experiment's warmup/ folder along, or pass a new --out"
        )
    fields = {**recorded_options(args), "warmup_rounds": rounds, "weights_sha256": digest}
    per_round = {"accuracy": accuracies, "low_prob_share": low_prob, "candidate_share": candidates}
    fields |= {f"warmup_{name}": [round(x, 8) for x in values] for name, values in per_round.items()}
    write_atomic(record, json.dumps(fields, indent=1) + "\n")
    return folder


def main(argv: Sequence[str] | None = None) -> None:
    """Command-line entry point (``python -m stapo.quickstart.experiment``)."""
    args = build_parser().parse_args(argv)
    if args.command == "decisive":
        from stapo.tools.decisive import report

        for folder in args.folders:
            if not (folder / "runs").is_dir():
                raise SystemExit(f"error: {folder}: no runs/ folder; pass a round's folder (`experiment run --out`)")

        tables, verdict = report(args.folders)
        print(tables + "\n" + verdict)
        return
    if args.command == "summary":
        if args.plots is not None and (problem := output_problem(args.plots, "folder", "--plots")):
            raise SystemExit(f"error: {problem}")
        print(summarize(args.folder, args.plots or args.folder / "plots"))
        return
    gpus = check_run_args(args)
    if problem := hold_folder(args.out):
        raise SystemExit(f"error: {problem}")
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS for the warm-up
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a kill stops the runs and their clusters too
    folder = prepared_model(args) if args.model else warm_model(args)
    if args.warmup_only:
        print(f"warm-up only: {args.out / 'experiment.json'} records each round")
        return
    paths = task_paths(args.data or args.out / "data")

    def command(run: Run) -> list:
        return [*TRAINER, f"--config-name={run.method}", *run_overrides(run, folder, paths, args)]

    runs = plan(args.methods, args.seeds, args.sweep_lrs, args.lrs, args.temperatures)
    codes = launch(runs, command, gpus, args.out, 60 * args.stall_minutes)
    print(summarize(args.out, args.out / "plots"))
    failed = sorted(name for name, code in codes.items() if code)
    if failed:
        raise SystemExit(f"error: {len(failed)} run(s) failed: {', '.join(failed)} (logs: {args.out / 'runs'})")


if __name__ == "__main__":
    main()
