"""What does STAPO cost over the same run without it? Two measurements (not timed tests):

python scripts/benchmark.py mask [--responses 2048 --length 15360]
    The driver-side mask alone (STAPO's default mode) on a paper-scale synthetic batch, in the jagged layout it
    arrives in from TransferQueue, on this machine's CPU: median of repeated runs, plus folding the result into
    the two masks written back.

python scripts/benchmark.py gpu --out DIR [--model tiny|qwen3_0.6b --tokenizer DIR --response-length 1024 --cycles 6]
    One real training run (verl V1 trainer, vLLM, FSDP, one GPU) that switches method every step, in --cycles
    rounds: JustRL (verl's stock loss, no mask), STAPO with policy_source=old, STAPO with policy_source=current.
    Same process, same card, same warm engines, and any drift of the machine spread over all three: per method,
    the median step and actor-update times over the rounds after the first (warm-up), and the largest peak GPU
    memory of its actor updates in those rounds. verl reports the actor's peak as a running maximum over the
    process, so the benchmark resets the CUDA peak counter in the actor worker before every update (one GPU:
    verl's ``execute_func_rank_zero`` reaches the only rank).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

PHASES = ("justrl", "stapo_old", "stapo_current")
TRAINER_MODE = "stapo_bench"


def bench_mask(responses: int, length: int, repeats: int) -> dict:
    from stapo.s2t import mask_for_update
    from stapo.trainer import fold, minibatch_rows

    gen = torch.Generator().manual_seed(0)
    offsets = torch.arange(responses + 1) * length

    def jagged(values):
        return torch.nested.nested_tensor_from_jagged(values.reshape(-1), offsets)

    n = responses * length
    log_probs = -3 * torch.rand(n, generator=gen)
    log_probs[torch.rand(n, generator=gen) < 0.003] = -8.0  # 0.3% of tokens below tau_p = 0.002
    entropy = 2 * torch.rand(n, generator=gen)
    advantages = torch.randn(responses, 1, generator=gen).expand(responses, length).reshape(-1).contiguous()
    mask = torch.ones(n, dtype=torch.int64)
    inputs = [jagged(x) for x in (log_probs, entropy, advantages, mask)]
    groups = minibatch_rows(responses, dp_size=8, mini_batch_size=responses // 4, shuffle=False, seed=42)
    mask_ms, fold_ms = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        silenced, metrics = mask_for_update("s2t", *inputs, groups)
        mask_ms.append(1000 * (time.perf_counter() - start))
        start = time.perf_counter()
        for _ in range(2):  # response_mask and loss_mask
            fold(inputs[3], silenced)
        fold_ms.append(1000 * (time.perf_counter() - start))
    return {
        "batch": f"{responses} x {length}",
        "tokens": n,
        "torch_threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "mask_ms_median": round(statistics.median(mask_ms), 1),
        "mask_ms_all": [round(x, 1) for x in mask_ms],
        "fold_two_masks_ms_median": round(statistics.median(fold_ms), 1),
        "candidates": metrics["stapo/candidate_tokens"],
        "masked": metrics["stapo/masked_tokens"],
    }


def register_bench_trainer() -> None:
    """The trainer mode ``stapo_bench``: STAPO's trainer that switches method every step (see PHASES)."""
    from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY, register_trainer
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.utils.losses import ppo_loss

    from stapo.config import StapoConfig
    from stapo.loss import stapo_loss
    from stapo.trainer import STAPOTrainer

    if TRAINER_MODE in TRAINER_REGISTRY:
        return
    configs = {
        "justrl": StapoConfig(),
        "stapo_old": StapoConfig(mask="s2t"),
        "stapo_current": StapoConfig(mask="s2t", policy_source="current"),
    }

    @register_trainer(TRAINER_MODE)
    class BenchTrainer(STAPOTrainer):
        def _update_actor(self, batch, metrics):
            phase = PHASES[(self.global_steps - 1) % len(PHASES)]
            if getattr(self, "_phase", None) != phase:
                self._phase, self.stapo = phase, configs[phase]
                actor = self.config.actor_rollout_ref.actor
                actor.calculate_entropy = self.stapo.policy_source == "current"
                loss_config = omega_conf_to_dataclass(actor)
                loss = functools.partial(stapo_loss, stapo=self.stapo) if self.stapo.active else ppo_loss
                self.actor_rollout_wg.set_loss_fn(functools.partial(loss, config=loss_config))
            metrics["bench/phase"] = PHASES.index(phase)
            self.actor_rollout_wg.execute_func_rank_zero(torch.cuda.reset_peak_memory_stats)
            return super()._update_actor(batch, metrics)


def bench_gpu(args) -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from gpu_smoke import build_assets, overrides, read_jsonl

    from stapo.tiny import QWEN3_0_6B, replace_overrides

    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    shape = QWEN3_0_6B if args.model == "qwen3_0.6b" else {}
    model, data = build_assets(out, tokenizer=args.tokenizer, **shape)
    steps = args.cycles * len(PHASES)
    changes = {
        "stapo.mask": "none",
        "trainer.v1.trainer_mode": TRAINER_MODE,
        "data.max_response_length": args.response_length,
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": args.micro_batch,
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": args.micro_batch,
        "actor_rollout_ref.actor.entropy_checkpointing": True,
        "actor_rollout_ref.actor.optim.lr": 1e-6,
        "ray_kwargs.ray_init.runtime_env.env_vars.VERL_USE_EXTERNAL_MODULES": "'stapo.plugin,benchmark'",
        "+ray_kwargs.ray_init.runtime_env.env_vars.STAPO_BENCH": "'1'",  # env vars must be strings
        "data.train_batch_size": args.prompts,
        "actor_rollout_ref.actor.ppo_mini_batch_size": args.prompts // 2,
    }
    run = replace_overrides(overrides("stapo", model, data, 1, steps, out, audit=False), changes)
    cmd = [sys.executable, "-m", "stapo.train", "--config-name=stapo", *run]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parent), os.environ.get("PYTHONPATH", "")]),
        "VERL_FILE_LOGGER_PATH": str(out / "metrics.jsonl"),
        "STAPO_BENCH": "1",
    }
    start = time.time()
    with open(out / "train.log", "w") as log:
        proc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise SystemExit(f"training failed; see {out / 'train.log'}:\n{(out / 'train.log').read_text()[-3000:]}")
    rows = [r["data"] for r in read_jsonl([out / "metrics.jsonl"]) if "bench/phase" in r["data"]]
    result = {"model": args.model, "response_length": args.response_length, "wall_s": round(time.time() - start)}
    for i, phase in enumerate(PHASES):
        runs = [r for r in rows if r["bench/phase"] == i]
        timed = runs[1:]  # the first round is warm-up
        result[phase] = {
            "steps": len(timed),
            "step_s": statistics.median(r["timing_s/step"] for r in timed),
            "update_actor_s": statistics.median(r["timing_s/update_actor"] for r in timed),
            "step_s_all": [round(r["timing_s/step"], 3) for r in runs],
            "update_actor_s_all": [round(r["timing_s/update_actor"], 3) for r in runs],
            "peak_mem_gb": max(r["actor/perf/max_memory_allocated_gb"] for r in timed),
            "peak_mem_gb_all": [round(r["actor/perf/max_memory_allocated_gb"], 4) for r in runs],
            "response_length": statistics.mean(r["response_length/mean"] for r in timed),
            "masked_frac": statistics.mean(r.get("stapo/masked_frac", 0.0) for r in timed),
        }
        if "timing_s/stapo_mask" in timed[0]:  # the driver's own mask time (policy_source=old), in update_actor
            driver = [r["timing_s/stapo_mask"] + r["timing_s/stapo_restore"] for r in timed]
            result[phase]["driver_mask_s"] = statistics.median(driver)
            result[phase]["driver_mask_s_all"] = [round(x, 4) for x in driver]
    for phase in PHASES[1:]:
        for key in ("step_s", "update_actor_s", "peak_mem_gb"):
            result[phase][f"{key}_ratio"] = round(result[phase][key] / result["justrl"][key], 4)
    if "driver_mask_s" in result["stapo_old"]:
        result["stapo_old"]["driver_mask_share_of_justrl_step"] = round(
            result["stapo_old"]["driver_mask_s"] / result["justrl"]["step_s"], 5
        )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description="STAPO cost benchmarks (see the module docstring)")
    sub = parser.add_subparsers(dest="what", required=True)
    mask = sub.add_parser("mask")
    mask.add_argument("--responses", type=int, default=2048)
    mask.add_argument("--length", type=int, default=15360)
    mask.add_argument("--repeats", type=int, default=7)
    gpu = sub.add_parser("gpu")
    gpu.add_argument("--out", type=Path, required=True)
    gpu.add_argument("--model", choices=["tiny", "qwen3_0.6b"], default="tiny")
    gpu.add_argument("--tokenizer", type=Path, help="HF tokenizer dir (default: a small BPE trained on the prompts)")
    gpu.add_argument("--cycles", type=int, default=6, help="rounds of the three methods; the first is warm-up")
    gpu.add_argument("--prompts", type=int, default=16, help="prompts per step (4 responses each)")
    gpu.add_argument("--response-length", type=int, default=64)
    gpu.add_argument("--micro-batch", type=int, default=16)
    args = parser.parse_args()
    result = bench_mask(args.responses, args.length, args.repeats) if args.what == "mask" else bench_gpu(args)
    print(json.dumps(result, indent=1))


if os.environ.get("STAPO_BENCH"):  # imported by verl in the Ray processes of a `gpu` run
    register_bench_trainer()

if __name__ == "__main__":
    main()
