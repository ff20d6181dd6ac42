"""End-to-end GPU smoke of the recipe: JustRL and STAPO (both policy sources) through verl's real V1 trainer,
vLLM rollouts and the FSDP engine, on a tiny random Qwen3 built here (no downloads), with audit mode on.

    python -m stapo.checks.gpu_smoke --out /tmp/smoke [--gpus 1] [--steps 4] [--methods justrl,stapo,stapo_current]
        [--nodes 2] [--shape qwen3_1.7b --tokenizer DIR] [--trainer-mode stapo_colocate_async] [-- OVERRIDE ...]

With ``--nodes N`` the runs go the multi-node way: a Ray cluster of N nodes on this machine (a head and N − 1 more
raylets, ``--gpus``/N GPUs each, :func:`stapo.train.clusters.local_cluster`), each run submitted through
scripts/ray_job.sh with ``trainer.nnodes=N``, and NCCL kept off shared memory and peer-to-peer copies, so that the
ranks talk over the network transport they would use between machines. With ``--shape`` the runs train a random
Qwen3 of that shape (built on the GPU, the tokenizer given) with the same short batch and responses. With
``--trainer-mode`` the runs use one of verl's asynchronous trainers (``stapo.config.TRAINER_MODES``);
``stapo_separate_async`` generates on one more GPU of its own (``--gpus`` train) and makes each step two local
updates of one mini-batch (``parameter_sync_step`` 2). Hydra overrides after ``--`` go to every run, e.g. verl's
rollout correction (``algorithm.rollout_correction.rollout_is=token``), or a fixed KV cache beside other GPU work
(``+actor_rollout_ref.rollout.engine_kwargs.vllm.kv_cache_memory_bytes=1073741824``).

It exits non-zero if any of these fails, for every STAPO run:
  1. masked tokens exist whenever candidates exist (and candidates exist at least once);
  2. silenced tokens get exactly zero gradient in the workers, kept ones do get gradient;
  3. the loss denominator of every mini-batch equals its kept-token count over all data-parallel ranks;
  4. the workers saw exactly the driver's silenced tokens, and the response mask is the original one after the
     update (what verl's metrics and logs read);
  5. the logged stapo/masked_tokens add up to the tokens the workers silenced;
  6. every quantile pool (a PPO mini-batch; with policy_source=current a micro-batch over all ranks) of k candidates
     had ⌈q(k−1)⌉ ± 1 of them silenced, what the rule gives with distinct entropies, and the entropies reached the
     mask in float32;
and for every run, JustRL included: 7. the s2t/* metrics (S2T rule and gradient-norm bound) are logged every step,
and no process warned that entropies arrived in another dtype than float32; 8. vLLM's and the actor's probabilities
of the sampled tokens agree (Pearson correlation ≥ :data:`MIN_PROBS_CORRELATION` in every step without policy lag,
≥ :data:`LAGGED_PROBS_CORRELATION` in a step with lag, whose rollout came from older weights by design);
9. the policy lag (verl's ``training/off_policy/trajectory_staleness/max``: how many model versions behind the
trained one the step's oldest rollout was) is logged every step, 0 in ``stapo_sync``; 10. with
``algorithm.rollout_correction.rollout_is`` set, verl logged its ``rollout_corr/rollout_is_mean`` every step and every
loss call of a STAPO run got the importance weights.
The reward is the fraction of digits in the response: continuous, so every group has positive and negative
advantages.
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
from collections import defaultdict
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path

from stapo.checks.scale import build_on_gpu
from stapo.config import QWEN3_SHAPES, TRAINER_MODES, StapoConfig
from stapo.quickstart.experiment import override_problem
from stapo.quickstart.tiny import replace_overrides, tiny_run_overrides
from stapo.s2t import distinct_silenced
from stapo.tools.io import output_problem
from stapo.tools.io import read_jsonl as _read_jsonl
from stapo.train.clusters import local_cluster, python_first_path

S2T_METRICS = ("s2t/candidate_frac", "s2t/spurious_frac", "s2t/grad_bound/spurious_share")
POLICY_LAG = "training/off_policy/trajectory_staleness/max"
ROLLOUT_IS = "rollout_corr/rollout_is_mean"
BATCH_KEYS = ("data.train_batch_size", "actor_rollout_ref.actor.ppo_mini_batch_size")

MICRO_PER_MINI = 2  # policy_source=old: two micro-batches per mini-batch and rank, to exercise accumulation
MIN_PROBS_CORRELATION = 0.999
"""Check 8's floor for ``training/rollout_actor_probs_pearson_corr`` (the smokes of docs/history.md: 0.99997)."""
LAGGED_PROBS_CORRELATION = 0.99
"""Check 8's floor in a step with policy lag: vLLM sampled with weights older than those the actor recomputes π_old
with (the asynchronous smokes of docs/history.md read 0.9941-0.99997 in such steps); only a gross disagreement fails."""
SHAPE_PROBS_CORRELATION = 0.995
"""Check 8's floor with ``--shape``: a random model of a real shape spreads its probability over 151k tokens, so the
sampled tokens' probabilities are all near 1e-5 and bfloat16 noise weighs more in their correlation (0.9988 for the
random 1.7B in the runs of docs/scale.md, mean absolute difference 4e-7)."""
RAY_JOB = Path("scripts") / "ray_job.sh"
"""The launcher of the ``--nodes`` runs, in the checkout (it is not part of the installed package)."""
FIRST_SLOT = 40
"""The ``--nodes`` runs' Ray job ids come after those of 40 runs of ``python -m stapo.quickstart.experiment``."""
NETWORK_NCCL = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"}
"""NCCL settings of the ``--nodes`` runs: the ranks of the nodes of one machine would otherwise use shared memory or
peer-to-peer copies, which nodes of a real cluster cannot."""


def smoke_reward(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    """verl custom reward: share of digit characters in the response (0 for an empty one)."""
    return sum(c.isdigit() for c in solution_str) / max(len(solution_str), 1)


def build_assets(out: Path, tokenizer: Path | None = None, build: bool = True, **shape) -> tuple[Path, Path]:
    """A random Qwen3 (``shape``: Qwen3Config fields) with a BPE trained on the prompts, or with the tokenizer
    saved in ``tokenizer`` (``build=False``: the model is made elsewhere); and a parquet of 256 prompts."""
    import pandas as pd
    from transformers import AutoTokenizer

    from stapo.quickstart.tiny import build_model, build_tokenizer

    problems = [f"Compute {a} * {b} + {a + b}." for a in range(2, 40) for b in range(3, 30)]
    texts = [p + f" The answer is \\boxed{{{i}}}." for i, p in enumerate(problems)]
    model_dir = out / "model"
    if build:
        tok = AutoTokenizer.from_pretrained(tokenizer) if tokenizer else build_tokenizer(texts, model_dir)
        build_model(tok, model_dir, **shape)
    rows = [
        {
            "data_source": "smoke",
            "prompt": [{"role": "user", "content": p}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": "0"},
            "extra_info": {"index": i},
        }
        for i, p in enumerate(problems[:256])
    ]
    data = out / "train.parquet"
    pd.DataFrame(rows).to_parquet(data)
    return model_dir, data


METHODS = ("justrl", "stapo", "stapo_current")
"""The smoke's runs: JustRL, STAPO (mask from the old policy) and STAPO with ``policy_source: current``."""


def overrides(
    method: str, model: Path, data: Path, gpus: int, steps: int, out: Path, audit: bool = True,
    trainer_mode: str = "stapo_sync", extra: Sequence[str] = (),
) -> list[str]:  # fmt: skip
    """The tiny-model run of ``method`` (justrl, stapo, stapo_current) with this file's reward, on the trainer of
    ``trainer_mode``, and the ``extra`` overrides last."""
    current = method == "stapo_current"
    args = tiny_run_overrides(
        model, data, out, steps=steps, gpus=gpus, reward="pkg://stapo.checks.gpu_smoke:smoke_reward",
        micro_batches=1 if current else MICRO_PER_MINI,
    )  # fmt: skip
    args.append(f"trainer.v1.trainer_mode={trainer_mode}")
    if TRAINER_MODES[trainer_mode] == "separate_async":  # verl's conditions: stapo.train.preflight
        values = dict(a.split("=", 1) for a in args)
        batch, mini = (int(values[k]) for k in BATCH_KEYS)
        args += [
            "actor_rollout_ref.rollout.nnodes=1",
            "actor_rollout_ref.rollout.n_gpus_per_node=1",
            "actor_rollout_ref.rollout.checkpoint_engine.backend=nccl",
            f"trainer.v1.separate_async.parameter_sync_step={batch // mini}",
        ]
    if audit:
        args.append(f"+ray_kwargs.ray_init.runtime_env.env_vars.STAPO_AUDIT_DIR={out / 'audit'}")
    if current:
        args += [
            "stapo.policy_source=current",
            "actor_rollout_ref.actor.calculate_entropy=True",
            "actor_rollout_ref.actor.entropy_checkpointing=True",
        ]
    return [*args, *extra]


def config_problem(methods: Sequence[str], gpus: int, trainer_mode: str, extra: Sequence[str]) -> str | None:
    """Why a run's config with the ``extra`` overrides would not pass the trainer's checks
    (:func:`stapo.train.main.validate`, without files or GPUs), or None."""
    from stapo.train.main import config_problem as problem

    runs = {
        method: ("stapo" if method.startswith("stapo") else method,
                 overrides(method, Path("m"), Path("train.parquet"), gpus, 1, Path("out"), True, trainer_mode, extra))
        for method in methods
    }  # fmt: skip
    found = problem(runs, list(extra))
    return found and f"the {found[0]} run's config with the overrides: {found[1]}"


def rollout_is(extra: Sequence[str]) -> bool:
    """Whether the ``extra`` overrides turn on verl's importance weights (check 10)."""
    values = {key.lstrip("+~"): value for key, value in (o.split("=", 1) for o in extra)}
    value = values.get("algorithm.rollout_correction.rollout_is", "null")
    return value.strip("'\"").lower() not in ("null", "none", "")


def run(
    method: str, model: Path, data: Path, gpus: int, steps: int, root: Path, nodes: int = 1,
    trainer_mode: str = "stapo_sync", extra: Sequence[str] = (),
) -> tuple[Path, float]:  # fmt: skip
    """Train ``method`` in ``root/method`` (log, metrics, audit) on the trainer of ``trainer_mode``; on ``nodes`` Ray
    nodes through scripts/ray_job.sh when more than one."""
    out = root / method
    out.mkdir(parents=True, exist_ok=True)
    config = "stapo" if method.startswith("stapo") else method
    env = {**os.environ, "VERL_FILE_LOGGER_PATH": str(out / "metrics.jsonl"), "STAPO_AUDIT_DIR": str(out / "audit")}
    args = overrides(method, model, data, gpus, steps, out, trainer_mode=trainer_mode, extra=extra)
    start = time.time()
    with open(out / "train.log", "w") as log, ExitStack() as cluster:
        if nodes == 1:
            cmd = [sys.executable, "-m", "stapo.train", f"--config-name={config}", *args]
        else:
            per_node = gpus // nodes
            args = multi_node_overrides(args, nodes, per_node)
            visible = os.environ.get("CUDA_VISIBLE_DEVICES", ",".join(map(str, range(gpus)))).split(",")
            node_gpus = [",".join(visible[i * per_node : (i + 1) * per_node]) for i in range(nodes)]
            _, dashboard = cluster.enter_context(local_cluster(node_gpus, out / "ray.log", first_slot=FIRST_SLOT))
            env["RAY_ADDRESS"] = dashboard
            env["PATH"] = python_first_path()  # ray_job.sh's `ray`, as the nodes'
            cmd = ["bash", str(ray_job()), config, "qwen3_1.7b", *args]  # the tiny model's overrides replace the size's
        proc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        tail = (out / "train.log").read_text()[-4000:]
        raise SystemExit(f"{method}: training failed (exit {proc.returncode}); last log lines:\n{tail}")
    return out, time.time() - start


def multi_node_overrides(args: list[str], nodes: int, per_node: int) -> list[str]:
    """``args`` of a run on ``nodes`` Ray nodes of this machine: the node layout, NCCL over the network transport
    (NETWORK_NCCL), and a fixed 1 GiB vLLM KV cache (beside other runs, whose memory changes under vLLM's profiling)
    that must hold one sequence of the longest length vLLM is told of: the run's prompt and response limits, not the
    model's context (a 1.7B shape's 32,768 tokens need 3.5 GiB; found by the ``--shape`` run of 2026-11-27)."""
    limits = ("data.max_prompt_length=", "data.max_response_length=")
    lengths = dict(a.split("=", 1) for a in args if a.startswith(limits))
    if len(lengths) != len(limits):
        raise ValueError(f"multi_node_overrides: the run's overrides must set {' and '.join(limits)}")
    return replace_overrides(args, {"trainer.nnodes": nodes, "trainer.n_gpus_per_node": per_node}) + [
        *(f'+ray_kwargs.ray_init.runtime_env.env_vars.{k}="{v}"' for k, v in NETWORK_NCCL.items()),
        f"+actor_rollout_ref.rollout.engine_kwargs.vllm.kv_cache_memory_bytes={1 << 30}",
        f"actor_rollout_ref.rollout.max_model_len={sum(int(v) for v in lengths.values())}",
    ]


def ray_job() -> Path:
    """scripts/ray_job.sh of the checkout this module comes from, or of the working directory (where the package is
    installed elsewhere)."""
    for root in (Path(__file__).resolve().parents[2], Path.cwd()):
        if (root / RAY_JOB).is_file():
            return root / RAY_JOB
    raise SystemExit(f"error: --nodes submits through {RAY_JOB}: run from the repository's checkout")


def read_jsonl(paths) -> list[dict]:
    """The records of several JSON-lines files (verl's file logger, the audit files), in order."""
    return [record for path in paths for record in _read_jsonl(Path(path), "JSON lines")]


def check(
    method: str, out: Path, gpus: int, min_correlation: float = MIN_PROBS_CORRELATION, trainer_mode: str = "stapo_sync",
    weighted: bool = False,
) -> tuple[list[str], dict]:  # fmt: skip
    """Violations of the properties of the module docstring for one run, and a summary."""
    problems = []
    steps = [r["data"] for r in read_jsonl([out / "metrics.jsonl"])]
    steps = [s for s in steps if "actor/pg_loss" in s]
    # a step without candidates has NaN shares (stapo.train.metrics.s2t_metrics), which verl writes as null
    s2t = [{k: s[k] if s[k] is None else round(s[k], 6) for k in S2T_METRICS if k in s} for s in steps]
    summary = {"steps": len(steps), "s2t": s2t}
    problems += [f"step {i + 1}: no {', '.join(S2T_METRICS)}" for i, s in enumerate(steps) if S2T_METRICS[0] not in s]
    warnings = [line for line in (out / "train.log").read_text().splitlines() if "STAPO WARNING" in line]
    problems += [f"train.log: {line.strip()[:300]}" for line in warnings[:3]]
    pearson = "training/rollout_actor_probs_pearson_corr"  # absent: not logged; null: logged as NaN
    correlation = [math.nan if s.get(pearson) is None else s[pearson] for s in steps]
    summary["probs_correlation"] = [round(c, 6) if c == c else None for c in correlation]  # NaN: not logged
    lag = [s.get(POLICY_LAG) for s in steps]
    floors = [min(min_correlation, LAGGED_PROBS_CORRELATION) if g else min_correlation for g in lag]
    problems += [
        f"step {i + 1}: vLLM's and the actor's probabilities correlate {c:.6f} (< {floor})"
        for i, (c, floor) in enumerate(zip(correlation, floors))
        if not c >= floor
    ]
    summary["policy_lag"] = lag
    problems += [f"step {i + 1}: no {POLICY_LAG} (the policy lag)" for i, g in enumerate(lag) if g is None]
    if trainer_mode == "stapo_sync":
        problems += [f"step {i + 1}: policy lag {g} in the synchronous trainer" for i, g in enumerate(lag) if g]
    if weighted:
        summary["rollout_is_mean"] = [s.get(ROLLOUT_IS) for s in steps]
        missing = [i + 1 for i, s in enumerate(steps) if ROLLOUT_IS not in s]
        problems += [f"step {i}: no {ROLLOUT_IS} (rollout correction)" for i in missing]
    if method == "justrl":
        if any(k.startswith("stapo/") for s in steps for k in s):
            problems.append("justrl logged stapo/* metrics: the mask ran in a baseline")
        return problems, summary

    cand = [s.get("stapo/candidate_tokens", 0) for s in steps]
    masked = [s.get("stapo/masked_tokens", 0) for s in steps]
    summary.update(
        candidates=cand,
        masked=masked,
        expected=[s.get("stapo/expected_masked_tokens") for s in steps],
        masked_frac=[round(s.get("stapo/masked_frac", 0), 4) for s in steps],
    )
    if not any(c > 0 for c in cand):
        problems.append("no step had S2T candidates: the smoke proves nothing")
    problems += [
        f"step {i + 1}: {c} candidates but nothing masked"
        for i, (c, m) in enumerate(zip(cand, masked))
        if c > 0 and m == 0
    ]

    by_rank = defaultdict(list)
    for r in read_jsonl(sorted((out / "audit").glob("loss-*.jsonl"))):
        by_rank[r["rank"]].append(r)
    if sorted(by_rank) != list(range(gpus)):
        return problems + [f"loss audit from ranks {sorted(by_rank)}, expected {gpus}"], summary
    records = [r for rs in by_rank.values() for r in rs]
    if any(r["max_grad_silenced"] != 0.0 for r in records):
        problems.append("a silenced token received gradient")
    if not any(r["nonzero_grad_kept"] > 0 for r in records):
        problems.append("no kept token received gradient")
    if weighted and (unweighted := sum(not r.get("rollout_is_weights") for r in records)):
        problems.append(f"{unweighted} of {len(records)} loss calls got no rollout_is_weights (rollout correction)")
    # mini-batches: consecutive records of each rank, micro-batches per mini-batch as configured
    per_mini = 1 if method == "stapo_current" else MICRO_PER_MINI
    groups = zip(*[[rs[i : i + per_mini] for i in range(0, len(rs), per_mini)] for rs in by_rank.values()])
    pools = []  # (candidates, silenced) of each quantile pool
    for j, group in enumerate(groups):
        rows = [r for part in group for r in part]
        kept = sum(r["kept_tokens"] for r in rows)
        denominators = {r["batch_num_tokens"] for r in rows}
        if denominators != {kept}:
            problems.append(f"mini-batch {j}: denominators {sorted(denominators)} != kept tokens {kept}")
        if method == "stapo_current":  # one micro-batch per rank and mini-batch: the pool is the mini-batch
            pools.append((rows[0]["pool_candidates"], sum(r["silenced_tokens"] for r in rows)))
    silenced = sum(r["silenced_tokens"] for r in records)
    summary["worker_silenced"] = silenced
    if round(sum(masked)) != silenced:  # policy_source=current logs verl's mean over mini-batches times their number
        problems.append(f"stapo/masked_tokens sums to {sum(masked)} over the steps, the workers silenced {silenced}")
    if method == "stapo":
        driver = read_jsonl(sorted((out / "audit").glob("driver-*.jsonl")))
        pools = [pool for d in driver for pool in zip(d["pool_candidates"], d["pool_masked"])]
        problems += [f"step {d['step']}: entropies reached the mask as {d['entropy_dtype']}"
                     for d in driver if d["entropy_dtype"] != "torch.float32"]  # fmt: skip
        if silenced != sum(d["masked_tokens"] for d in driver):
            problems.append(f"workers silenced {silenced} tokens, the driver {sum(d['masked_tokens'] for d in driver)}")
        for d in driver:
            original = {"response_mask": d["response_tokens"], "loss_mask": d["loss_tokens"]}
            if d["during_update"] != {k: v - d["masked_tokens"] for k, v in original.items()}:
                problems.append(
                    f"step {d['step']}: workers saw {d['during_update']}, expected {original} "
                    f"minus {d['masked_tokens']}"
                )
            if d["after_update"] != original:
                problems.append(f"step {d['step']}: masks not restored: {d['after_update']} != {original}")
    problems += pool_problems(pools, StapoConfig().q)
    summary["pools"] = pools
    return problems, summary


def pool_problems(pools: list[tuple[int, int]], q: float) -> list[str]:
    """Check 6: each pool of k candidates had ⌈q(k−1)⌉ ± 1 silenced (ties at τ_h silence fewer)."""
    if not pools:
        return ["no quantile pool was recorded"]
    return [
        f"pool {i}: {silenced} of {k} candidates silenced, the rule gives {distinct_silenced(k, q)} (± 1)"
        for i, (k, silenced) in enumerate(pools)
        if abs(silenced - distinct_silenced(k, q)) > 1
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m stapo.checks.gpu_smoke", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--gpus", type=int, default=1)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--methods", default="justrl,stapo,stapo_current")
    parser.add_argument("--nodes", type=int, default=1, help="Ray nodes on this machine (--gpus/N GPUs each)")
    parser.add_argument("--shape", choices=sorted(QWEN3_SHAPES), help="a random Qwen3 of this shape, not the tiny one")
    parser.add_argument("--tokenizer", type=Path, help="with --shape: the tokenizer folder (Qwen's vocabulary)")
    parser.add_argument(
        "--trainer-mode", choices=sorted(TRAINER_MODES), default="stapo_sync",
        help="verl's trainer to run on (stapo_separate_async: one more GPU generates)",
    )  # fmt: skip
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every run, after --")
    args = parser.parse_args(argv)
    if (args.shape is None) != (args.tokenizer is None):
        parser.exit(2, "error: --shape and --tokenizer go together (python -m stapo.checks.scale model --help)\n")
    for name in ("gpus", "steps"):
        if getattr(args, name) < 1:
            parser.exit(2, f"error: --{name} {getattr(args, name)}: must be a positive integer\n")
    methods = args.methods.split(",")
    if unknown := [m for m in methods if m not in METHODS]:
        parser.exit(
            2, f"error: --methods {args.methods}: {', '.join(unknown)} unknown; choose from {', '.join(METHODS)}\n"
        )
    if args.tokenizer is not None and not (args.tokenizer / "tokenizer_config.json").is_file():
        parser.exit(
            2, f"error: --tokenizer {args.tokenizer}: no tokenizer_config.json in it; pass a tokenizer folder\n"
        )
    if args.nodes < 1 or args.gpus % args.nodes:
        parser.exit(2, f"error: --nodes {args.nodes}: must be a positive divisor of --gpus {args.gpus}\n")
    if args.nodes > 1 and args.trainer_mode != "stapo_sync":
        parser.exit(2, f"error: --trainer-mode {args.trainer_mode} runs on one node here: leave out --nodes\n")
    if problem := override_problem(args.overrides) or (
        args.overrides and config_problem(methods, args.gpus, args.trainer_mode, args.overrides)
    ):
        parser.exit(2, f"error: {problem}\n")
    rollout_gpus = int(TRAINER_MODES[args.trainer_mode] == "separate_async")
    import torch

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a kill stops the runs' Ray clusters too (--nodes)
    if torch.cuda.device_count() < args.gpus + rollout_gpus:
        needs = f" (+ 1 for the rollout of --trainer-mode {args.trainer_mode})" if rollout_gpus else ""
        visible = torch.cuda.device_count()
        parser.exit(2, f"error: --gpus {args.gpus}{needs}: {visible} CUDA GPU(s) visible; the smoke trains with "
                       "verl, vLLM and FSDP on GPUs (without one: bash scripts/quickstart.sh)\n")  # fmt: skip
    if problem := output_problem(args.out, "folder"):
        parser.exit(2, f"error: {problem}\n")
    if args.nodes > 1:
        ray_job()
        args.out = args.out.resolve()  # the job runs in the Ray head's working directory
    args.out.mkdir(parents=True, exist_ok=True)
    if args.shape:  # built on the GPU by another process: this driver must hold no GPU memory during the runs
        model, data = build_assets(args.out, tokenizer=args.tokenizer, build=False)
        build_on_gpu(args.shape, args.tokenizer, model)
    else:
        model, data = build_assets(args.out)
    failed = False
    floor = SHAPE_PROBS_CORRELATION if args.shape else MIN_PROBS_CORRELATION
    for method in methods:
        out, seconds = run(
            method, model, data, args.gpus, args.steps, args.out, args.nodes, args.trainer_mode, args.overrides
        )
        problems, summary = check(method, out, args.gpus, floor, args.trainer_mode, rollout_is(args.overrides))
        head = {"method": method, "trainer_mode": args.trainer_mode, "gpus": args.gpus, "nodes": args.nodes}
        head |= {"overrides": args.overrides} if args.overrides else {}
        head["seconds"] = round(seconds)
        print(json.dumps({**head, **summary, "problems": problems}), flush=True)
        failed |= bool(problems)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
