"""What do STAPO and the actor cost? Three measurements (not tests; docs/history.md has the
results):

python -m stapo.checks.benchmark mask [--responses 2048 --length 15360]
    The driver's work in STAPO's default mode on a paper-scale synthetic batch, in the jagged layout it arrives in
    from TransferQueue, on this machine's CPU: the mask, folding it into the two masks written back, and the s2t/*
    gradient-bound sums (which the trainer computes while the workers update; median of repeated runs).

python -m stapo.checks.benchmark actor --out DIR [--shape qwen3_1.7b --tokens 32768 --seq 2048 --rounds 6]
python -m stapo.checks.benchmark actor --out DIR --variants recipe --checkpointing on off --tokens 16384 32768
    One actor micro-batch as verl's FSDP engine computes it (packed sequences, gradient checkpointing, bfloat16, the
    log-probabilities of the sampled tokens, forward and backward), on one GPU, for each attention implementation
    (packed sdpa, flex_attention, the recipe's torch_varlen; padded sdpa) and each log-probability path (verl's
    fallback without flash-attn, ``logprobs_from_logits``, and its fused kernel ``use_fused_kernels`` with the
    recipe's float32 entropies); plus the no-grad old-log-prob pass with entropy. Seconds (median of the timed
    repeats) and MFU as verl counts it (``FlopsCounter``). Last, ``float32_entropy``: the recipe's patch of the fused
    kernel (:mod:`stapo.train.verl_patches`) against verl's own kernel on the recipe's attention, alternating in
    ``--rounds`` rounds after a warm-up round: median times, their ratios and each one's peak memory. With
    ``--variants recipe``, only the recipe's path, with and without gradient checkpointing at each token budget:
    what a size file can choose per GPU count (MFU of the update and of the old-log-prob pass, peak memory).

python -m stapo.checks.benchmark attention
    The recipe's ``torch_varlen`` attention against ``sdpa`` run on each sequence alone (forward and backward,
    grouped-query heads, causal), on one GPU; exits non-zero when they differ beyond bfloat16 rounding.

python -m stapo.checks.benchmark gpu --out DIR [--model tiny|qwen3_1.7b ... --cycles 6 --standalone 3]
    One real training run (verl V1 trainer, vLLM, FSDP; --gpus of one node, default 1) that switches method every
    step, in --cycles rounds: JustRL (verl's stock update: no mask, no s2t/* metrics), STAPO with policy_source=old
    (mask and metrics), STAPO with policy_source=current. Same process, same card, same warm engines, and any drift
    of the machine spread over all three: per method, the median step and actor-update times over the rounds after
    the first (warm-up; so with ``--cycles`` 2 or more), and the largest peak GPU memory of its actor updates in
    those rounds. verl reports the actor's peak as a running maximum over the process, so the benchmark resets the
    CUDA peak counter in the actor worker before every update (verl's ``execute_func_rank_zero``: on one GPU the
    only rank; with more, verl reports the largest rank's, and the other ranks keep running maxima). Also: the start-up
    (seconds from launch to each of verl's set-up log lines, STARTUP_EVENTS; ``train.log`` carries the seconds on
    every line), the per-stage table of the JustRL and STAPO steps after the first (:func:`warm_rows`), the
    rollout's generated tokens per second in every step and, with ``--standalone R``, vLLM's own speed on the same
    GPU after the run (``vllm`` below) and the ratio of each step's to it.

python -m stapo.checks.benchmark vllm --model DIR --data PARQUET --out DIR [--prompts 16 --response-length 2048]
    Standalone vLLM (``LLM.generate``) on the same prompts and sampling as the recipe's rollout: tokens per second of
    ``--repeats`` timed repeats (:func:`bench_vllm`).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from stapo.config import QWEN3_SHAPES
from stapo.tools.io import (
    DataFileError,
    model_folder_problems,
    number_problems,
    output_problem,
    parquet_columns,
    vllm_missing,
    write_atomic,
)

PHASES = ("justrl", "stapo_old", "stapo_current")
TRAINER_MODE = "stapo_bench"
PLUGINS = "stapo.train.plugin,stapo.checks.benchmark"  # the bench trainer mode registers in every Ray process
ACTOR_VARIANTS = (
    ("sdpa", True, False),  # what a run without flash-attn used before the recipe chose: packed sdpa, verl's loop
    ("torch_varlen", True, False),
    ("sdpa", True, True),
    ("flex_attention", True, True),
    ("torch_varlen", True, True),  # the recipe's choice without flash-attn
    ("sdpa", False, True),  # padded batch (use_remove_padding=False)
)
"""(attention, packed, fused log-probs) of the ``actor`` measurement; the fused ones last (verl's patch of the
model's forward for them is not undone)."""


# ------------------------------------------------------------------------------------------------------------ mask
def bench_mask(responses: int, length: int, repeats: int) -> dict:
    from stapo.batch_mask import grad_bound_sums, mask_for_update
    from stapo.train.trainer import fold, minibatch_rows

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
    times = {"mask_ms": [], "fold_two_masks_ms": [], "grad_bounds_ms": []}
    for _ in range(repeats):
        start = time.perf_counter()
        silenced, stats = mask_for_update("s2t", *inputs, groups)
        times["mask_ms"].append(1000 * (time.perf_counter() - start))
        start = time.perf_counter()
        for _ in range(2):  # response_mask and loss_mask
            fold(inputs[3], silenced)
        times["fold_two_masks_ms"].append(1000 * (time.perf_counter() - start))
        start = time.perf_counter()
        grad_bound_sums(*inputs, silenced)  # the trainer runs this beside the actor update
        times["grad_bounds_ms"].append(1000 * (time.perf_counter() - start))
    result = {"batch": f"{responses} x {length}", "tokens": n, "torch_threads": torch.get_num_threads()}
    result["cpus"] = os.cpu_count()
    for key, values in times.items():
        result[f"{key}_median"] = round(statistics.median(values), 1)
        result[f"{key}_all"] = [round(x, 1) for x in values]
    result.update(candidates=stats["candidates"], masked=stats["masked"])
    return result


# ----------------------------------------------------------------------------------------------------------- actor
def bench_actor(args) -> dict:
    """The ``actor`` measurement (module docstring)."""
    from transformers import AutoModelForCausalLM, Qwen3Config
    from verl.models.transformers.monkey_patch import apply_monkey_patch
    from verl.utils.flops_counter import FlopsCounter
    from verl.utils.torch_functional import entropy_from_logits, logprobs_from_logits

    from stapo.train import attention, verl_patches

    attention.register()
    verl_patches.float32_fused_entropy()  # as the plugin does in every worker
    torch.manual_seed(0)
    config = Qwen3Config(**QWEN3_SHAPES[args.shape], max_position_embeddings=40960, torch_dtype="bfloat16")
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.train()
    counter = FlopsCounter(config)
    results = {"shape": args.shape, "tokens": args.tokens, "seq": args.seq, "gpu": torch.cuda.get_device_name()}
    variants = ACTOR_VARIANTS if args.variants == "all" else ((attention.NAME, True, True),)
    patched = False
    for (attn, packed, fused), checkpointing, tokens in itertools.product(variants, args.checkpointing, args.tokens):
        name = f"{attn}{'' if packed else '_padded'}{'+fused' if fused else '+logprobs_loop'}"
        if args.variants != "all":
            name += f"+{'checkpointing' if checkpointing == 'on' else 'no_checkpointing'}@{tokens}"
        n_seq = tokens // args.seq
        seqlens = [args.seq] * n_seq
        ids = torch.randint(0, config.vocab_size, (n_seq, args.seq), device="cuda")
        try:
            if checkpointing == "on":
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            else:
                model.gradient_checkpointing_disable()
            model.set_attn_implementation(attn)
            if fused and not patched:
                apply_monkey_patch(
                    model, use_remove_padding=True, use_fused_kernels=True, fused_kernels_backend="torch"
                )
                patched = True
            step = functools.partial(_actor_step, model, ids, packed, fused, logprobs_from_logits, entropy_from_logits)
            torch.cuda.reset_peak_memory_stats()
            update = _timed(lambda: step(train=True), args.repeats)
            old = _timed(lambda: step(train=False), args.repeats)
            mfu = counter.estimate_flops(seqlens, update["median_s"])
            old_mfu = counter.estimate_flops(seqlens, old["median_s"])  # counts 3x a forward: divided below
            results[name] = {
                "update_s": update,
                "old_log_prob_s": old,
                "update_tflops": round(mfu[0], 1),
                "update_mfu": round(mfu[0] / mfu[1], 4),
                "old_log_prob_mfu": round(old_mfu[0] / 3 / old_mfu[1], 4),
                "peak_gb": round(torch.cuda.max_memory_allocated() / 2**30, 2),
                "mean_log_prob": step(train=False, check=True),
            }
        except Exception as error:  # noqa: BLE001 - a variant that fails (out of memory) is a result too
            results[name] = {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"}
        model.zero_grad(set_to_none=True)
        del ids
        torch.cuda.empty_cache()
        print(name, json.dumps(results[name]), flush=True)
    if args.variants != "all":
        return results
    model.set_attn_implementation(attention.NAME)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = torch.randint(0, config.vocab_size, (args.tokens[0] // args.seq, args.seq), device="cuda")
    step = functools.partial(_actor_step, model, ids, True, True, logprobs_from_logits, entropy_from_logits)
    results["float32_entropy"] = _entropy_patch_cost(model, ids, step, args.rounds)
    print("float32_entropy", json.dumps(results["float32_entropy"]), flush=True)
    return results


def _entropy_patch_cost(model, ids, step, rounds: int) -> dict:
    """verl's fused kernel (bfloat16 entropies) against the recipe's patch (float32), same micro-batch and model,
    alternating which goes first in each round; the first round is warm-up. The update and the old-log-prob pass
    are timed and their peak memory taken separately for each."""
    from stapo.train import verl_patches

    variants = ("verl", "float32")
    times = {f"{v}_{kind}_s": [] for v in variants for kind in ("update", "old_log_prob")}
    peaks = dict.fromkeys(variants, 0)
    checks = {}
    for r in range(rounds + 1):
        for variant in variants if r % 2 else variants[::-1]:
            verl_patches.float32_fused_entropy(variant == "float32")
            for kind, train in (("update", True), ("old_log_prob", False)):
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                start = time.perf_counter()
                step(train=train)
                torch.cuda.synchronize()
                if r:
                    times[f"{variant}_{kind}_s"].append(time.perf_counter() - start)
                peaks[variant] = max(peaks[variant], torch.cuda.max_memory_allocated())
            if not r:
                one = {"input_ids": ids[:1], "position_ids": torch.arange(ids.shape[1], device="cuda")[None]}
                with torch.no_grad():
                    out = model(**one, shift_labels=torch.roll(ids[:1], -1, -1), return_dict=True)
                checks[variant] = {"entropy_dtype": str(out.entropy.dtype), "log_prob_sum": float(out.log_probs.sum())}
    verl_patches.float32_fused_entropy()
    result = {"rounds": rounds, **checks}
    for key, values in times.items():
        result[key] = round(statistics.median(values), 4)
        result[f"{key}_all"] = [round(x, 4) for x in values]
    for kind in ("update", "old_log_prob"):
        result[f"{kind}_ratio"] = round(result[f"float32_{kind}_s"] / result[f"verl_{kind}_s"], 4)
    result.update({f"{v}_peak_gib": round(peaks[v] / 2**30, 3) for v in variants})
    result["peak_ratio"] = round(peaks["float32"] / peaks["verl"], 5)
    return result


def _actor_step(model, ids, packed, fused, logprobs_from_logits, entropy_from_logits, train, check=False):
    """One micro-batch: log-probs of the sampled tokens (and, without grad, the entropy) from packed or padded
    inputs, as verl's engine calls the model; backward of their mean when ``train``. With ``check``, the mean
    log-prob (the variants must agree up to bfloat16 noise)."""
    n_seq, seq = ids.shape
    if packed:
        inputs = {"input_ids": ids.reshape(1, -1), "position_ids": torch.arange(seq, device="cuda").repeat(1, n_seq)}
    else:
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    labels = torch.roll(inputs["input_ids"], shifts=-1, dims=-1)
    with torch.set_grad_enabled(train):
        if fused:
            out = model(**inputs, shift_labels=labels, temperature=1.0, return_dict=True)
            log_probs, entropy = out.log_probs, out.entropy
        else:
            logits = model(**inputs).logits.reshape(-1, model.config.vocab_size)
            log_probs = logprobs_from_logits(logits=logits, labels=labels.reshape(-1))
            entropy = None if train else entropy_from_logits(logits)
        if check:
            return round(float(log_probs.float().mean()), 4)
        if train:
            log_probs.float().mean().backward()
            model.zero_grad(set_to_none=True)
        elif entropy is not None:
            entropy.float().sum().item()


def _timed(fn, repeats: int) -> dict:
    fn()  # warm-up: compilation, autotuning, allocator
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return {"median_s": round(statistics.median(times), 3), "all_s": [round(t, 3) for t in times]}


def check_attention(heads: int = 16, kv_heads: int = 8, dim: int = 128, lengths=(300, 1, 2048, 77)) -> dict:
    """``torch_varlen`` on packed sequences == ``sdpa`` on each sequence alone, outputs and input gradients."""
    import torch.nn.functional as F

    from stapo.train.attention import varlen_attention

    gen = torch.Generator(device="cuda").manual_seed(0)
    total = sum(lengths)
    q, k, v = (
        torch.randn(1, h, total, dim, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
        for h in (heads, kv_heads, kv_heads)
    )
    position_ids = torch.cat([torch.arange(n, device="cuda") for n in lengths])[None]
    out, _ = varlen_attention(None, q, k, v, None, scaling=dim**-0.5, position_ids=position_ids)
    grad = torch.randn_like(out)
    fast = [out, *torch.autograd.grad(out, (q, k, v), grad)]
    parts, start = [], 0
    for n in lengths:
        sl = slice(start, start + n)
        parts.append(
            F.scaled_dot_product_attention(
                q[:, :, sl], k[:, :, sl], v[:, :, sl], is_causal=True, scale=dim**-0.5, enable_gqa=True
            ).transpose(1, 2)
        )
        start += n
    ref_out = torch.cat(parts, dim=1)
    reference = [ref_out, *torch.autograd.grad(ref_out, (q, k, v), grad)]
    errors = {
        name: float((a.float() - b.float()).norm() / b.float().norm())
        for name, a, b in zip(("out", "dq", "dk", "dv"), fast, reference)
    }
    return {"relative_errors": errors, "ok": all(e < 2e-2 for e in errors.values()), "torch": torch.__version__}


# ------------------------------------------------------------------------------------------------ rotating training
def register_bench_trainer() -> None:
    """The trainer mode ``stapo_bench``: STAPO's trainer that switches method every step (see PHASES)."""
    from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY, register_trainer
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.utils.losses import ppo_loss

    from stapo.config import StapoConfig
    from stapo.train.loss import stapo_loss
    from stapo.train.trainer import STAPOTrainer

    if TRAINER_MODE in TRAINER_REGISTRY:
        return
    configs = {
        "justrl": StapoConfig(metrics=False),
        "stapo_old": StapoConfig(mask="s2t"),
        "stapo_current": StapoConfig(mask="s2t", policy_source="current", metrics=False),
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


def shape_run_overrides(
    model: Path, data: Path, out: Path, *, steps: int, prompts: int, response_length: int, gpus: int = 1
) -> list:
    """Overrides of a run of a model at its true shape on ``gpus`` GPUs of one node: the size config's own token
    budgets and parallelism, with the batch, steps, response length, data and reward (the smoke's digit share, so that
    every group has positive and negative advantages) of a benchmark."""
    from stapo.quickstart.tiny import short_run_overrides

    return [
        f"actor_rollout_ref.model.path={model}",
        f"data.train_files={data}",
        f"data.val_files={data}",
        f"data.train_batch_size={prompts}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={max(prompts // 4, 1)}",
        "data.max_prompt_length=256",
        f"data.max_response_length={response_length}",
        "reward.custom_reward_function.path=pkg://stapo.checks.gpu_smoke",
        "reward.custom_reward_function.name=smoke_reward",
        "trainer.nnodes=1",
        f"trainer.n_gpus_per_node={gpus}",
        *short_run_overrides(out, steps),
    ]


READY_LINE = "agent loop workers ready"
"""The line :class:`stapo.checks.ready_agents.ReadyAgentLoopManager` logs once verl's agent-loop workers are up."""

STARTUP_EVENTS = (
    ("driver_ready", "ray init kwargs"),
    ("ray_up", "Started a local Ray instance"),
    ("worker_group", "create worker group"),
    ("actor_ready", "actor and ref model engine initialized"),
    ("vllm_server", "['serve',"),
    ("vllm_engine_spawned", "We must use the `spawn` multiprocessing start method"),
    ("ready_to_fit", "ready to fit"),
    ("agents_ready", READY_LINE),
)
"""(name, text of a log line of verl 0.9.1, Ray 2.60, vLLM 0.24 or the benchmark) of the start-up phases, in order:
the driver's imports and checks until ``ray.init``; a local Ray cluster; the TaskRunner, TransferQueue, the trainer
and datasets until the worker group; the actor's FSDP engine; vLLM's server process (with verl's reward-loop
workers); vLLM's engine process; its weights, compilation, CUDA graphs and the first weight sync until verl's "ready to
fit"; then verl's agent-loop workers (:mod:`stapo.checks.ready_agents`), which the first step needs. A line that
does not come (a cluster given by ``RAY_ADDRESS`` starts none) is left out."""


def run_logged(cmd: list[str], env: dict, log_path: Path, linger_s: float = 30) -> tuple[int, dict]:
    """Run ``cmd`` with its output in ``log_path``, each line prefixed with the seconds since launch; the return code
    and the seconds at which each of STARTUP_EVENTS first appeared. The output is read in a thread, so a process the
    command left behind holding its output open delays the return by at most ``linger_s`` after the command ends."""
    events, start = {}, time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                errors="replace")  # fmt: skip

        def read():
            for line in proc.stdout:
                seconds = time.monotonic() - start
                log.write(f"[{seconds:8.1f}] {line}")
                for name, text in STARTUP_EVENTS:
                    if name not in events and text in line:
                        events[name] = round(seconds, 1)
                        log.flush()

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        returncode = proc.wait()
        reader.join(linger_s)
    return returncode, dict(events)


def rollout_config(overrides: list[str]):
    """The ``actor_rollout_ref.rollout`` section of a run's config as Hydra composes it: the recipe's STAPO config
    (base.yaml over verl's defaults, the size file) with ``overrides`` (``size=...`` among them), the last winning."""
    from hydra import compose, initialize_config_dir

    from stapo.config import CONFIG_DIR

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return compose(config_name="stapo", overrides=overrides).actor_rollout_ref.rollout


def generated_tokens(row: dict) -> float:
    """Response tokens of a step: verl's token count (prompts and responses) split by the mean lengths."""
    return (
        row["perf/total_num_tokens"]
        * row["response_length/mean"]
        / (row["prompt_length/mean"] + row["response_length/mean"])
    )


def warm_rows(rows: list[dict]) -> list[dict]:
    """The steps of a rotating run that show the recipe's default path warm: JustRL's and STAPO's (driver's mask),
    after the launch's first step (which carries one-time work: the first weight sync, kernel compilation)."""
    return [r for r in rows[1:] if r["bench/phase"] != PHASES.index("stapo_current")]


def step_tflop(model_config, row: dict) -> float:
    """verl's count (``FlopsCounter``'s function for the model type, TFLOP) of one forward and backward pass over a
    step's sequences, each taken at the step's mean prompt + response length (the attention term needs each length;
    a benchmark's barely vary)."""
    from verl.utils.flops_counter import ESTIMATE_FUNC

    length = round(row["prompt_length/mean"] + row["response_length/mean"])
    sequences = round(row["perf/total_num_tokens"] / length)
    return ESTIMATE_FUNC[model_config.model_type](model_config, length * sequences, [length] * sequences, 1.0)


def stage_table(rows: list[dict], model_config=None, peak_tflops: float | None = None) -> dict:
    """Medians over ``rows`` (verl's step metrics) of the per-stage figures NeMo RL reports: generated tokens per
    second and GPU, old-log-prob and update tokens per second and GPU (prompt + response tokens), step time, the
    actor's MFU and peak memory. verl 0.9.1's V1 trainer reports the update's MFU (on the workers' clock) but not the
    old-log-prob pass's; with the model's ``model_config`` and the GPU's ``peak_tflops`` both are added on the
    driver's clock (:func:`step_tflop`; a forward-only pass counts a third of it, as verl counts one)."""
    gpus = rows[0]["perf/total_num_tokens"] / rows[0]["perf/throughput"] / rows[0]["timing_s/step"]

    def median(fn):
        return round(statistics.median(fn(r) for r in rows), 3)

    def peak_seconds(row):  # the step's forward and backward FLOPs in seconds of the GPUs' peak
        return step_tflop(model_config, row) / peak_tflops / gpus

    mfu = {}
    if model_config is not None and peak_tflops:
        mfu = {
            "mfu_update_driver": median(lambda r: peak_seconds(r) / r["timing_s/update_actor"]),
            "mfu_old_log_prob_driver": median(lambda r: peak_seconds(r) / 3 / r["timing_s/old_log_prob"]),
        }
    return {
        "steps": len(rows),
        "gpus": round(gpus),
        "step_s": median(lambda r: r["timing_s/step"]),
        "gen_s": median(lambda r: r["timing_s/gen"]),
        "gen_tokens_per_s_per_gpu": median(lambda r: generated_tokens(r) / r["timing_s/gen"] / gpus),
        "old_log_prob_s": median(lambda r: r["timing_s/old_log_prob"]),
        "old_log_prob_tokens_per_s_per_gpu": median(
            lambda r: r["perf/total_num_tokens"] / r["timing_s/old_log_prob"] / gpus
        ),
        "update_s": median(lambda r: r["timing_s/update_actor"]),
        "update_tokens_per_s_per_gpu": median(lambda r: r["perf/total_num_tokens"] / r["timing_s/update_actor"] / gpus),
        "update_weights_s": median(lambda r: r.get("timing_s/update_weights", float("nan"))),
        "mfu_actor": median(lambda r: r["perf/mfu/actor"]),
        **mfu,
        "peak_actor_gb": round(max(r["actor/perf/max_memory_allocated_gb"] for r in rows), 2),
    }


def phase_comparison(rows: list[dict]) -> dict:
    """Per method of the rotation (PHASES): medians over the rounds after the first (warm-up) of the step and update
    times, the largest peak memory, every round's values, the share of tokens silenced and the driver's mask time;
    then each STAPO variant's ratios to JustRL."""
    result = {}
    for i, phase in enumerate(PHASES):
        runs = [r for r in rows if r["bench/phase"] == i]
        timed = runs[1:]
        result[phase] = {
            "steps": len(timed),
            "step_s": statistics.median(r["timing_s/step"] for r in timed),
            "update_actor_s": statistics.median(r["timing_s/update_actor"] for r in timed),
            "step_s_all": [round(r["timing_s/step"], 3) for r in runs],
            "update_actor_s_all": [round(r["timing_s/update_actor"], 3) for r in runs],
            "peak_mem_gb": max(r["actor/perf/max_memory_allocated_gb"] for r in timed),
            "peak_mem_gb_all": [round(r["actor/perf/max_memory_allocated_gb"], 4) for r in runs],
            "mfu_actor_all": [round(r.get("perf/mfu/actor", float("nan")), 4) for r in runs],
            "response_length": statistics.mean(r["response_length/mean"] for r in timed),
            "masked_frac": statistics.mean(r.get("stapo/masked_frac", 0.0) for r in timed),
            "masked_frac_all": [round(r.get("stapo/masked_frac", 0.0), 5) for r in runs],
        }
        if "timing_s/stapo_mask" in timed[0]:  # the driver's own work (policy_source=old), in update_actor
            driver = [r["timing_s/stapo_mask"] + r.get("timing_s/stapo_restore", 0.0) for r in timed]
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


def standalone_speeds(args, model: Path, data: Path, config: list, run: list, recipe: list, out: Path) -> dict:
    """vLLM's own ``LLM.generate`` (``vllm`` below) on this GPU after the run, for each of ``--standalone-variants``:
    vLLM's defaults with the run's memory share, and the run's rollout settings (VLLM_SETTINGS of its composed
    config: ``config`` and ``run`` as given to ``stapo.train``, then the ``--`` overrides); and the ratio of each of
    the run's steps (``recipe``, generated tokens per second) to the median of its timed repeats. Each has its own
    compile cache, so that the recipe's cold and warm start-ups stay the recipe's own."""
    rollout = rollout_config([*config[1:], *run, *args.overrides])
    settings = {key: rollout[key] for key in VLLM_SETTINGS}
    variants = {"vllm_defaults": {"gpu_memory_utilization": settings["gpu_memory_utilization"]}, "recipe": settings}
    speeds = {}
    for name in args.standalone_variants:
        vllm_out = out / f"vllm-{name}"
        cmd = [sys.executable, "-m", "stapo.checks.benchmark", "vllm", "--model", str(model), "--data", str(data),
               "--prompts", str(args.prompts), "--n", str(rollout.n),
               "--response-length", str(args.response_length), "--repeats", str(args.standalone),
               "--out", str(vllm_out)]  # fmt: skip
        cmd += [f"--{key.replace('_', '-')}={value}" for key, value in variants[name].items() if value is not None]
        subprocess.run(cmd, env={**os.environ, "VLLM_CACHE_ROOT": str(out / "vllm-cache")}, check=True)
        standalone = json.loads((vllm_out / "vllm.json").read_text())
        speed = statistics.median(standalone["tokens_per_s_all"])
        speeds[name] = {
            **standalone,
            "recipe_over_standalone_all": [round(x / speed, 4) for x in recipe],
            "recipe_over_standalone_min": round(min(recipe) / speed, 4),
        }
    return speeds


def bench_run_args(args, model: Path, data: Path, out: Path) -> tuple[list[str], list[str]]:
    """The rotating run's config choice (``--config-name``, ``size=``) and overrides: the size file's budgets and
    parallelism for a Qwen3 shape (:func:`shape_run_overrides`), the smoke's tiny run otherwise; the bench trainer
    mode in every Ray process, no mask or metrics of the method's own (each phase sets them), and an agent-loop manager
    that waits for its workers (:mod:`stapo.checks.ready_agents`), so that their start-up is not the first step's."""
    from stapo.checks.gpu_smoke import overrides
    from stapo.quickstart.tiny import replace_overrides

    steps = args.cycles * len(PHASES)
    changes = {
        "stapo.mask": "none",
        "stapo.metrics": "false",  # each phase sets its own (PHASES); the bench mode is not stapo_sync
        "trainer.v1.trainer_mode": TRAINER_MODE,
        "ray_kwargs.ray_init.runtime_env.env_vars.VERL_USE_EXTERNAL_MODULES": f"'{PLUGINS}'",
        "+ray_kwargs.ray_init.runtime_env.env_vars.STAPO_BENCH": "'1'",  # env vars must be strings
        "actor_rollout_ref.actor.entropy_checkpointing": True,
        "+actor_rollout_ref.rollout.agent.agent_loop_manager_class": "stapo.checks.ready_agents.ReadyAgentLoopManager",
    }
    if args.model in QWEN3_SHAPES:
        config = ["--config-name=stapo", f"size={args.model}"]
        run = shape_run_overrides(
            model, data, out, steps=steps, prompts=args.prompts, response_length=args.response_length, gpus=args.gpus
        )
    else:
        config = ["--config-name=stapo"]
        run = overrides("stapo", model, data, args.gpus, steps, out, audit=False)
        changes.update(
            {
                "data.max_response_length": args.response_length,
                "data.train_batch_size": args.prompts,
                "actor_rollout_ref.actor.ppo_mini_batch_size": args.prompts // 2,
                "actor_rollout_ref.actor.optim.lr": 1e-6,
            }
        )
    return config, replace_overrides(run, changes)


def bench_gpu(args) -> dict:
    """The ``gpu`` measurement (module docstring): the rotating run, its start-up, per-stage table and rollout speed,
    the methods' comparison (with ``--cycles`` of 2 or more) and, with ``--standalone``, vLLM's own speed."""
    from stapo.checks.gpu_smoke import build_assets, read_jsonl
    from stapo.checks.scale import build_on_gpu

    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.model in QWEN3_SHAPES:
        model = args.weights.resolve() if args.weights else build_on_gpu(args.model, args.tokenizer, out / "model")
        data = build_assets(out, tokenizer=args.tokenizer, build=False)[1]
    else:
        model, data = build_assets(out, tokenizer=args.tokenizer)
    config, run = bench_run_args(args, model, data, out)
    cmd = [sys.executable, "-m", "stapo.train", *config, *run, *args.overrides]
    env = {**os.environ, "VERL_FILE_LOGGER_PATH": str(out / "metrics.jsonl"), "STAPO_BENCH": "1"}
    start = time.time()
    returncode, startup = run_logged(cmd, env, out / "train.log")
    result = {"model": args.model, "response_length": args.response_length, "startup_s": startup}
    write_atomic(out / "gpu.json", json.dumps(result, indent=1) + "\n")  # the start-up survives a failed run
    if returncode != 0:
        raise SystemExit(f"training failed; see {out / 'train.log'}:\n{(out / 'train.log').read_text()[-3000:]}")
    result["wall_s"] = round(time.time() - start)
    rows = [r["data"] for r in read_jsonl([out / "metrics.jsonl"]) if "bench/phase" in r["data"]]
    if args.cycles > 1:
        result.update(phase_comparison(rows))
    from transformers import AutoConfig
    from verl.utils.flops_counter import get_device_flops

    peak = get_device_flops()
    peak = None if peak == float("inf") else peak  # a card verl does not know: no MFU columns rather than 0
    result["stages"] = stage_table(warm_rows(rows), AutoConfig.from_pretrained(model), peak)
    recipe = [round(generated_tokens(r) / r["timing_s/gen"]) for r in rows]
    result["rollout"] = {"recipe_tokens_per_s_all": recipe}
    write_atomic(out / "gpu.json", json.dumps(result, indent=1) + "\n")
    if args.standalone:
        result["rollout"].update(standalone_speeds(args, model, data, config, run, recipe, out))
    return result


VLLM_SETTINGS = ("gpu_memory_utilization", "max_num_seqs", "max_num_batched_tokens")
"""Rollout settings that set vLLM's batch and KV cache; ``gpu --standalone`` runs vLLM with the run's memory share
and its own defaults for the rest, then with the run's values of all three."""


def bench_vllm(args) -> dict:
    """Standalone vLLM (``LLM.generate``) on the prompts the recipe's run draws from: the first ``--prompts`` rows of
    the parquet through the chat template (as verl's agent loop sends them), ``--n`` samples each at temperature 1, up
    to ``--response-length`` tokens, with the log-probability of each sampled token (as the recipe's rollout asks for
    it). A first call, then ``--repeats`` timed ones: generated tokens per second of each, the first call's apart
    (``first_call_tokens_per_s``: vLLM's one-time work at the first requests falls in it)."""
    import pandas as pd
    from transformers import AutoTokenizer

    # vLLM forks its engine process by default, and this process has touched CUDA (main's check): spawn instead
    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    from vllm import LLM, SamplingParams

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    rows = pd.read_parquet(args.data).head(args.prompts)
    prompts = [
        {"prompt_token_ids": tokenizer.apply_chat_template(list(p), add_generation_prompt=True, tokenize=True,
                                                           return_dict=False)}
        for p in rows["prompt"]
    ]  # fmt: skip
    settings = {k: getattr(args, k) for k in VLLM_SETTINGS if getattr(args, k) is not None}
    start = time.time()
    llm = LLM(model=str(args.model), dtype="bfloat16", seed=0, **settings)
    result = {"engine_start_s": round(time.time() - start, 1), "settings": settings, "tokens_all": [],
              "tokens_per_s_all": []}  # fmt: skip
    params = SamplingParams(n=args.n, temperature=1.0, top_p=1.0, max_tokens=args.response_length, logprobs=0)
    for repeat in range(args.repeats + 1):
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        tokens = sum(len(o.token_ids) for out in outputs for o in out.outputs)
        if repeat:
            result["tokens_all"].append(tokens)
            result["tokens_per_s_all"].append(round(tokens / seconds))
        else:
            result["first_call_tokens_per_s"] = round(tokens / seconds)
    return result


POSITIVE = {
    "mask": ("responses", "length", "repeats"),
    "actor": ("tokens", "seq", "repeats", "rounds"),
    "gpu": ("cycles", "prompts", "response_length", "gpus"),
    "vllm": ("prompts", "n", "response_length", "repeats", "max_num_seqs", "max_num_batched_tokens"),
}
"""The counts of each benchmark, whole numbers of at least 1."""


def argument_problems(args: argparse.Namespace) -> list[str]:
    """The benchmark's options that cannot work, one line each, before any GPU work."""
    found = number_problems(args, positive=POSITIVE.get(args.what, ()))
    if args.what == "vllm":
        found += number_problems(args, fractions=("gpu_memory_utilization",))
        found += [f"--model {p}" for p in model_folder_problems(args.model, str(args.model))]
        try:
            parquet_columns(args.data, "a verl parquet with a prompt column")
        except DataFileError as error:
            found.append(f"--data {error}")
    if args.what == "gpu":
        found += number_problems(args, non_negative=("standalone",))
        if args.model != "tiny" and args.model not in QWEN3_SHAPES:
            found.append(f"--model {args.model}: tiny, or one of {', '.join(QWEN3_SHAPES)}")
        found += [f"override {o}: write it as KEY=VALUE" for o in args.overrides if "=" not in o or o.startswith("=")]
        if args.tokenizer is not None and not (args.tokenizer / "tokenizer_config.json").is_file():
            found.append(f"--tokenizer {args.tokenizer}: no tokenizer_config.json in it; pass a tokenizer folder")
        elif args.model in QWEN3_SHAPES and args.tokenizer is None:
            found.append("--model with a Qwen3 shape needs --tokenizer (Qwen's vocabulary: stapo.quickstart.tiny)")
        if args.weights and args.model not in QWEN3_SHAPES:
            found.append(f"--weights is for a Qwen3 shape (--model one of {', '.join(QWEN3_SHAPES)}); the tiny model "
                         "is built by the run")  # fmt: skip
        elif args.weights:
            hint = "python -m stapo.checks.scale model --shape SHAPE --tokenizer DIR --out DIR"
            found += [f"{p} ({hint})" for p in model_folder_problems(args.weights, f"--weights {args.weights}")]
        if args.standalone and args.gpus != 1:
            found.append("--standalone compares the rollout with vLLM on one GPU; run it with --gpus 1")
    if args.what == "actor":
        if args.shape not in QWEN3_SHAPES:
            found.append(f"--shape {args.shape}: one of {', '.join(QWEN3_SHAPES)}")
        if args.variants == "all" and (len(args.tokens) > 1 or args.checkpointing != ["on"]):
            found.append("several --tokens or --checkpointing need --variants recipe ('all' makes one table)")
    if args.what in ("actor", "gpu", "vllm"):
        found += [p for p in [output_problem(args.out, "folder")] if p]
    return found


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m stapo.checks.benchmark", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    mask = sub.add_parser("mask")
    mask.add_argument("--responses", type=int, default=2048)
    mask.add_argument("--length", type=int, default=15360)
    mask.add_argument("--repeats", type=int, default=7)
    sub.add_parser("attention")
    actor = sub.add_parser("actor")
    actor.add_argument("--out", type=Path, required=True)
    actor.add_argument("--shape", default="qwen3_1.7b", help="a key of stapo.config.QWEN3_SHAPES")
    actor.add_argument(
        "--tokens",
        type=int,
        nargs="+",
        default=[32768],
        help="tokens per micro-batch (the size config's budget); several with --variants recipe",
    )
    actor.add_argument(
        "--variants",
        choices=("all", "recipe"),
        default="all",
        help="all: the table of docs/history.md and the float32-entropy cost; recipe: only "
        "the recipe's path (torch_varlen, fused), for each --checkpointing and --tokens",
    )
    actor.add_argument(
        "--checkpointing",
        nargs="+",
        choices=("on", "off"),
        default=["on"],
        help="gradient checkpointing of the update (verl's enable_gradient_checkpointing)",
    )
    actor.add_argument("--seq", type=int, default=2048, help="tokens per sequence")
    actor.add_argument("--repeats", type=int, default=2, help="timed repeats after one warm-up")
    actor.add_argument("--rounds", type=int, default=6, help="timed rounds of the float32-entropy comparison")
    gpu = sub.add_parser("gpu")
    gpu.add_argument("--out", type=Path, required=True)
    gpu.add_argument("--model", default="tiny", help="tiny, or a key of QWEN3_SHAPES (the size config's settings)")
    gpu.add_argument("--tokenizer", type=Path, help="HF tokenizer dir (default: a small BPE trained on the prompts)")
    gpu.add_argument("--cycles", type=int, default=6, help="rounds of the three methods; the first is warm-up")
    gpu.add_argument("--prompts", type=int, default=16, help="prompts per step")
    gpu.add_argument("--response-length", type=int, default=64)
    gpu.add_argument("--gpus", type=int, default=1, help="GPUs of this node (trainer.n_gpus_per_node)")
    gpu.add_argument("--weights", type=Path, help="a model folder of --model's shape to use instead of building one")
    gpu.add_argument(
        "--standalone",
        type=int,
        default=0,
        metavar="REPEATS",
        help="after the run, time vLLM's own LLM.generate on the same GPU, prompts and settings",
    )
    gpu.add_argument(
        "--standalone-variants",
        nargs="+",
        choices=("vllm_defaults", "recipe"),
        default=["vllm_defaults", "recipe"],
        help="vLLM's defaults (with the run's memory share), and the run's rollout settings",
    )
    gpu.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="further Hydra overrides of the run")
    standalone = sub.add_parser("vllm")
    standalone.add_argument("--model", type=Path, required=True)
    standalone.add_argument("--data", type=Path, required=True, help="a verl parquet (prompt column)")
    standalone.add_argument("--out", type=Path, required=True)
    standalone.add_argument("--prompts", type=int, default=16)
    standalone.add_argument("--n", type=int, default=8, help="samples per prompt (the run's rollout.n)")
    standalone.add_argument("--response-length", type=int, default=2048)
    standalone.add_argument("--repeats", type=int, default=3)
    for key in VLLM_SETTINGS:
        standalone.add_argument(f"--{key.replace('_', '-')}", type=float if "utilization" in key else int)
    args = parser.parse_args(argv)
    for problem in argument_problems(args):
        parser.exit(2, f"error: {problem}\n")
    if args.what != "mask" and not torch.cuda.is_available():
        parser.exit(2, f"error: benchmark {args.what} runs on a CUDA GPU and none is visible; `mask` runs on the CPU\n")
    if args.what == "vllm" and (missing := vllm_missing("benchmark vllm")):  # the inputs first, then the machine
        parser.exit(2, f"error: {missing}\n")
    if args.what == "mask":
        result = bench_mask(args.responses, args.length, args.repeats)
    elif args.what == "attention":
        result = check_attention()
        print(json.dumps(result))
        sys.exit(0 if result["ok"] else 1)
    elif args.what == "actor":
        result = bench_actor(args)
    elif args.what == "vllm":
        result = bench_vllm(args)
    else:
        result = bench_gpu(args)
    text = json.dumps(result, indent=1)
    if args.what != "mask":
        write_atomic(args.out / f"{args.what}.json", text + "\n")
    print(text)


if os.environ.get("STAPO_BENCH"):  # imported by verl in the Ray processes of a `gpu` run
    register_bench_trainer()

if __name__ == "__main__":
    main()
