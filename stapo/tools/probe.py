"""Design by counts, before any RL run: what S2T would see and do on a model's own samples.

    python -m stapo.tools.probe --model DIR --data FILE [FILE ...] --out probe.json
        [--prompts 256] [--n 8] [--max-tokens 256] [--mini-batch 16] [--tau-p 0.002 0.005 0.01 0.02] [--q 0.75]
        [--gradients 16] [--engine vllm|hf] [--seed 0]

For each task file (a verl parquet, e.g. one per difficulty), ``--prompts`` prompts are sampled ``--n`` times at
temperature 1 (vLLM on a GPU, or transformers with ``--engine hf``), graded by the recipe's reward, given GRPO
advantages (verl's estimator), and scored token by token in float32 by the model itself (log π of the sampled token
and the entropy of its distribution). The prompts are then cut into PPO mini-batches of ``--mini-batch`` prompts
(the quantile pools of :func:`stapo.s2t.s2t_mask`), and for every τ_p the probe reports the candidates per pool and
what S2T silences; ``chosen_tau_p`` is the smallest τ_p whose median pool holds at least 20 candidates (STAPO's rule
cannot silence a lone candidate: a pool of k silences ⌈q(k−1)⌉).

With ``--gradients B`` (first file, chosen τ_p) it also runs the paired, noise-free test of the mechanism on B
pools: the policy gradient g of the JustRL loss at the old policy (ratio 1: −Σ Â ∇log π / N over the pool's tokens),
the same with S2T's tokens silenced (renormalised over the kept ones) and with as many random candidates silenced
(:func:`stapo.s2t.ablation_choice`), and per pool ``‖g_mask − g‖ / ‖g‖``, the first-order change of the mean response
entropy per unit learning rate of a plain gradient step ``−⟨∇H̄, g⟩``, and the silenced tokens' share of the paper's
gradient-norm bound (:func:`stapo.s2t.grad_norm_lower_bound`).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from stapo.s2t import grad_norm_lower_bound, s2t_mask
from stapo.tools.io import (
    DataFileError,
    model_folder_problems,
    number_problems,
    output_problem,
    parquet_columns,
    read_parquet,
    vllm_missing,
    write_atomic,
)
from stapo.tools.reward import grade_many

TAU_PS = (0.002, 0.005, 0.01, 0.02)
KV_CACHE = 4 << 30
"""vLLM's KV cache for the probe's samples (bytes): about 180k tokens of SmolLM2 (23 KB a token), a few hundred
sequences at once."""
MIN_POOL = 20
"""The median quantile pool must hold this many candidates for a τ_p to be chosen."""


@dataclass
class Samples:
    """The sampled responses of one task file, ``n`` consecutive ones per prompt, and their per-token statistics."""

    prompts: list[list[int]]  # one per response (repeated n times)
    responses: list[list[int]]
    scores: list[float]
    truncated: list[bool]
    advantages: torch.Tensor  # (responses,)
    log_probs: list[torch.Tensor]  # float32, one per response
    entropy: list[torch.Tensor]


def read_prompts(path: Path, count: int, seed: int) -> list[dict]:
    """``count`` rows of a verl parquet, in a seeded random order."""
    rows = read_parquet(path, "a verl parquet with prompt and reward_model", ["data_source", "prompt", "reward_model"])
    if len(rows) < count:
        raise DataFileError(f"{path}: {len(rows)} rows, fewer than --prompts {count}")
    random.Random(seed).shuffle(rows)
    return rows[:count]


@functools.cache
def _vllm(model: Path, seed: int):
    """One vLLM engine for the whole probe (its files sampled one after the other from the engine's seeded stream)."""
    from vllm import LLM

    # eager: starts in seconds. A given KV-cache size: vLLM skips its free-memory profiling, which fails when another
    # process on the GPU frees memory meanwhile (seen on an H200 beside a finishing verl run, vLLM 0.24)
    return LLM(
        model=str(model), seed=seed, gpu_memory_utilization=0.3, enforce_eager=True, kv_cache_memory_bytes=KV_CACHE
    )


def sample_vllm(model: Path, prompts: list[list[int]], n: int, max_tokens: int, seed: int) -> list[list[tuple]]:
    """``n`` samples of each prompt at temperature 1 with vLLM: lists of (token ids, truncated)."""
    from vllm import SamplingParams

    params = SamplingParams(n=n, temperature=1.0, top_p=1.0, max_tokens=max_tokens)
    outputs = _vllm(model, seed).generate([{"prompt_token_ids": p} for p in prompts], params)
    return [[(list(o.token_ids), o.finish_reason == "length") for o in out.outputs] for out in outputs]


def sample_hf(model, tokenizer, prompts: list[list[int]], n: int, max_tokens: int, seed: int) -> list[list[tuple]]:
    """The same with transformers (CPU tests, or no vLLM): samples end at the EOS token, which is kept."""
    torch.manual_seed(seed)
    device = next(model.parameters()).device
    result = []
    for prompt in prompts:
        ids = torch.tensor([prompt], device=device)
        out = model.generate(ids, do_sample=True, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=max_tokens,
                             num_return_sequences=n, pad_token_id=tokenizer.pad_token_id)  # fmt: skip
        rows = []
        for row in out[:, len(prompt) :].tolist():
            end = row.index(tokenizer.eos_token_id) + 1 if tokenizer.eos_token_id in row else len(row)
            rows.append((row[:end], end == max_tokens and tokenizer.eos_token_id not in row[:end]))
        result.append(rows)
    return result


@torch.no_grad()
def token_stats(model, samples: Samples) -> None:
    """Fill ``samples.log_probs`` and ``samples.entropy``: float32 log π of each response token given what precedes
    it, and the entropy of that distribution (micro-batches of padded sequences)."""
    rows = list(range(len(samples.responses)))
    samples.log_probs, samples.entropy = [None] * len(rows), [None] * len(rows)
    for batch in _micro_batches(samples, rows):
        for i, logits, targets in _response_logits(model, samples, rows, *batch):
            log_probs = logits.log_softmax(-1)
            samples.log_probs[i] = log_probs.gather(-1, targets[:, None])[:, 0].cpu()
            samples.entropy[i] = -(log_probs.exp() * log_probs).sum(-1).cpu()


def collect(model, tokenizer, rows: list[dict], sampled: list[list[tuple]]) -> Samples:
    from stapo.tools.inspect_tokens import group_advantages

    prompts, responses, truncated, items, groups = [], [], [], [], []
    for i, (row, outs) in enumerate(zip(rows, sampled)):
        for ids, cut in outs:
            prompts.append(row["prompt_ids"])
            responses.append(ids)
            truncated.append(cut)
            text = tokenizer.decode(ids, skip_special_tokens=True)
            items.append({"solution_str": text, "ground_truth": row["reward_model"]["ground_truth"],
                          "data_source": row["data_source"]})  # fmt: skip
            groups.append(i)
    scores = [float(r["score"]) for r in grade_many(items)]
    samples = Samples(prompts, responses, scores, truncated, group_advantages(scores, groups), [], [])
    token_stats(model, samples)
    return samples


def pools(samples: Samples, n: int, mini_batch: int) -> list[list[int]]:
    """Response indices of each PPO mini-batch (``mini_batch`` prompts, in order); a short last one is dropped."""
    size = mini_batch * n
    return [list(range(start, start + size)) for start in range(0, len(samples.responses) - size + 1, size)]


def padded(samples: Samples, rows: Sequence[int]) -> tuple[torch.Tensor, ...]:
    """(log π, entropy, advantages, mask) of ``rows`` as padded (rows, longest) tensors."""
    width = max(len(samples.responses[r]) for r in rows)
    out = torch.zeros(4, len(rows), width)
    for i, r in enumerate(rows):
        k = len(samples.responses[r])
        out[0, i, :k], out[1, i, :k] = samples.log_probs[r], samples.entropy[r]
        out[2, i, :k], out[3, i, :k] = samples.advantages[r], 1.0
    return out[0], out[1], out[2], out[3].long()


def count_report(samples: Samples, groups: list[list[int]], tau_ps: Sequence[float], q: float) -> dict:
    """Per τ_p: candidates per pool (median, mean, min, 10th percentile), the share of pools with at least
    :data:`MIN_POOL`, and what S2T silences (share of tokens, of candidates, and the rule's share)."""
    tokens = sum(len(samples.responses[r]) for g in groups for r in g)
    report = {}
    for tau_p in tau_ps:
        per_pool = [s2t_mask(*padded(samples, g), tau_p, q)[1] for g in groups]
        counts = sorted(s["candidates"] for s in per_pool)
        masked = sum(s["masked"] for s in per_pool)
        expected = sum(s["expected_masked"] for s in per_pool)
        candidates = sum(counts)
        report[str(tau_p)] = {
            "candidates_per_pool_median": statistics.median(counts),
            "candidates_per_pool_mean": round(statistics.mean(counts), 2),
            "candidates_per_pool_min": counts[0],
            "candidates_per_pool_p10": counts[len(counts) // 10],
            "pools_with_min": round(sum(c >= MIN_POOL for c in counts) / len(counts), 3),
            "candidate_frac": candidates / tokens,
            "silenced_frac": masked / tokens,
            "silenced_of_candidates": masked / candidates if candidates else math.nan,
            "expected_of_candidates": expected / candidates if candidates else math.nan,
        }
    return report


def choose_tau_p(report: dict) -> float | None:
    """The smallest τ_p whose median pool holds at least :data:`MIN_POOL` candidates (None if none does)."""
    ok = [float(t) for t, r in report.items() if r["candidates_per_pool_median"] >= MIN_POOL]
    return min(ok) if ok else None


def gradient_test(model, samples: Samples, groups: list[list[int]], tau_p: float, q: float, seed: int) -> dict:
    """The paired test of the module docstring, per pool; float32 gradients over all parameters."""
    per_pool = []
    for index, rows in enumerate(groups):
        log_probs, entropy, advantages, mask = padded(samples, rows)
        keep, _ = s2t_mask(log_probs, entropy, advantages, mask, tau_p, q)
        s2t = (mask != 0) & (keep == 0)
        keep_r, _ = s2t_mask(log_probs, entropy, advantages, mask, tau_p, q, silence="random", seed=seed + index)
        rand = (mask != 0) & (keep_r == 0)
        n_tokens = int(mask.sum())
        # G(set) = Σ_{t in set} Â_t ∇log π_t: the pool's, and the two silenced sets'
        weights = {"all": advantages * mask, "s2t": advantages * s2t, "random": advantages * rand}
        sums = {name: _weighted_grad(model, samples, rows, w) for name, w in weights.items()}
        grad_h = _entropy_grad(model, samples, rows) / n_tokens
        g = {"none": -sums["all"] / n_tokens}
        g["s2t"] = -(sums["all"] - sums["s2t"]) / max(n_tokens - int(s2t.sum()), 1)
        g["random"] = -(sums["all"] - sums["random"]) / max(n_tokens - int(rand.sum()), 1)
        bound = grad_norm_lower_bound(log_probs, entropy, advantages).double() * mask
        norm = float(g["none"].norm()) or math.nan  # a pool whose groups all scored alike has no gradient
        per_pool.append(
            {
                "silenced": int(s2t.sum()),
                "tokens": n_tokens,
                "rel_change_s2t": float((g["s2t"] - g["none"]).norm()) / norm,
                "rel_change_random": float((g["random"] - g["none"]).norm()) / norm,
                **{f"entropy_rate_{k}": -float(grad_h @ v) for k, v in g.items()},
                "bound_share_s2t": float(bound[s2t].sum() / bound.sum()),
                "bound_share_random": float(bound[rand].sum() / bound.sum()),
            }
        )
    return {"pools": per_pool, "summary": _summary(per_pool)}


def _summary(per_pool: list[dict]) -> dict:
    """Mean and standard deviation of each quantity over pools with something silenced, and the paired S2T−random
    difference of the entropy rate (mean, sd, t = mean / (sd / √n))."""
    used = [p for p in per_pool if p["silenced"]]
    out = {"pools": len(per_pool), "pools_with_silenced": len(used)}
    if len(used) < 2:
        return out
    for key in used[0]:
        values = [p[key] for p in used]
        out[key] = {"mean": statistics.mean(values), "sd": statistics.stdev(values)}
    diffs = [p["entropy_rate_s2t"] - p["entropy_rate_random"] for p in used]
    sd = statistics.stdev(diffs)
    out["entropy_rate_s2t_minus_random"] = {
        "mean": statistics.mean(diffs),
        "sd": sd,
        "t": statistics.mean(diffs) / (sd / math.sqrt(len(diffs))) if sd else math.nan,
    }
    return out


def _flat_grad(model) -> torch.Tensor:
    grads = [p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel(), device=p.device)
             for p in model.parameters()]  # fmt: skip
    model.zero_grad(set_to_none=True)
    return torch.cat(grads).float()


def _micro_batches(samples: Samples, rows: Sequence[int], size: int = 16):
    """(row positions, input ids, attention mask, response start per row) of padded micro-batches."""
    for start in range(0, len(rows), size):
        part = list(range(start, min(start + size, len(rows))))
        seqs = [samples.prompts[rows[i]] + samples.responses[rows[i]] for i in part]
        width = max(map(len, seqs))
        ids = torch.zeros(len(seqs), width, dtype=torch.long)
        attention = torch.zeros(len(seqs), width, dtype=torch.long)
        for j, seq in enumerate(seqs):
            ids[j, : len(seq)], attention[j, : len(seq)] = torch.tensor(seq), 1
        yield part, ids, attention, [len(samples.prompts[rows[i]]) for i in part]


def _response_logits(model, samples, rows, part, ids, attention, starts):
    device = next(model.parameters()).device
    logits = model(input_ids=ids.to(device), attention_mask=attention.to(device)).logits.float()
    for j, (i, start) in enumerate(zip(part, starts)):
        k = len(samples.responses[rows[i]])
        yield i, logits[j, start - 1 : start - 1 + k], torch.tensor(samples.responses[rows[i]], device=device)


def _weighted_grad(model, samples: Samples, rows: Sequence[int], weights: torch.Tensor) -> torch.Tensor:
    """Σ_t w_t ∇log π_t over the response tokens of ``rows`` (``weights``: padded like :func:`padded`)."""
    for part, ids, attention, starts in _micro_batches(samples, rows):
        if not weights[part].any():
            continue
        total = 0.0
        for i, logits, targets in _response_logits(model, samples, rows, part, ids, attention, starts):
            log_probs = logits.log_softmax(-1).gather(-1, targets[:, None])[:, 0]
            total = total + (weights[i, : len(targets)].to(log_probs.device) * log_probs).sum()
        total.backward()
    return _flat_grad(model)


def _entropy_grad(model, samples: Samples, rows: Sequence[int]) -> torch.Tensor:
    """∇ Σ_t H_t over the response tokens of ``rows``."""
    for part, ids, attention, starts in _micro_batches(samples, rows):
        total = 0.0
        for _, logits, _ in _response_logits(model, samples, rows, part, ids, attention, starts):
            log_probs = logits.log_softmax(-1)
            total = total - (log_probs.exp() * log_probs).sum()
        total.backward()
    return _flat_grad(model)


def probe_file(model, tokenizer, path: Path, args: argparse.Namespace, generate) -> tuple[dict, Samples, list]:
    rows = read_prompts(path, args.prompts, args.seed)
    for row in rows:
        row["prompt_ids"] = tokenizer.apply_chat_template(list(row["prompt"]), add_generation_prompt=True,
                                                          tokenize=True, return_dict=False)  # fmt: skip
    start = time.time()
    sampled = generate([row["prompt_ids"] for row in rows], args.n, args.max_tokens, args.seed)
    samples = collect(model, tokenizer, rows, sampled)
    groups = pools(samples, args.n, args.mini_batch)
    by_prompt = [samples.scores[i : i + args.n] for i in range(0, len(samples.scores), args.n)]
    counts = count_report(samples, groups, args.tau_p, args.q)
    report = {
        "file": str(path),
        "responses": len(samples.responses),
        "accuracy": statistics.mean(samples.scores),
        "mixed_groups": sum(0 < sum(s) < len(s) for s in by_prompt) / len(by_prompt),
        "mean_length": statistics.mean(len(r) for r in samples.responses),
        "truncated": statistics.mean(samples.truncated),
        "pools": len(groups),
        "tau_p": counts,
        "chosen_tau_p": choose_tau_p(counts),
        "seconds": round(time.time() - start, 1),
    }
    return report, samples, groups


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m stapo.tools.probe", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="a Hugging Face model folder")
    parser.add_argument("--data", type=Path, nargs="+", required=True, help="verl parquet task files")
    parser.add_argument("--out", type=Path, required=True, help="the JSON report to write")
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--n", type=int, default=8, help="samples per prompt (GRPO group)")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--mini-batch", type=int, default=16, help="prompts per PPO mini-batch (a quantile pool)")
    parser.add_argument("--tau-p", type=float, nargs="+", default=list(TAU_PS))
    parser.add_argument("--q", type=float, default=0.75)
    parser.add_argument("--gradients", type=int, default=0, metavar="B", help="pools of the paired gradient test")
    parser.add_argument("--engine", choices=("vllm", "hf"), default="vllm", help="sampler (hf: transformers)")
    parser.add_argument("--seed", type=int, default=0)
    return parser


def check_args(args: argparse.Namespace) -> list[str]:
    problems = []
    for path in args.data:
        try:
            parquet_columns(path, "a verl parquet task file (python -m stapo.quickstart.task)")
        except DataFileError as error:
            problems.append(f"--data {error}")
    problems += model_folder_problems(args.model)
    problems += [p for p in [output_problem(args.out, "file")] if p]
    problems += number_problems(args, positive=("prompts", "max_tokens", "mini_batch"), non_negative=("gradients",))
    problems += number_problems(args, fractions=("tau_p",))
    if args.n < 2:
        problems.append(f"--n {args.n}: must be at least 2 (GRPO advantages need a group)")
    if args.prompts >= 1 and args.mini_batch >= 1 and args.prompts < args.mini_batch:
        problems.append(f"--prompts {args.prompts} is fewer than one mini-batch (--mini-batch {args.mini_batch})")
    if not 0 <= args.q <= 1:
        problems.append(f"--q {args.q}: must be in [0, 1]")
    if args.engine == "vllm" and (missing := vllm_missing("--engine vllm")):
        problems.append(f"{missing} (or --engine hf: transformers)")
    return problems


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    problems = check_args(args)
    if problems:
        raise SystemExit("\n".join(f"error: {p}" for p in problems))
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).to(device).eval()
    if args.engine == "vllm":
        generate = functools.partial(sample_vllm, args.model)
    else:
        generate = functools.partial(sample_hf, model, tokenizer)
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "data"}
    result = {"model": str(args.model), "settings": settings, "files": []}
    first = None
    for path in args.data:
        try:
            report, samples, groups = probe_file(model, tokenizer, path, args, generate)
        except DataFileError as error:
            raise SystemExit(f"error: {error}") from None
        result["files"].append(report)
        print(json.dumps({k: v for k, v in report.items() if k != "tau_p"}), flush=True)
        first = first or (report, samples, groups)
    if args.gradients:
        report, samples, groups = first
        tau_p = report["chosen_tau_p"] or max(args.tau_p)
        start = time.time()
        test = gradient_test(model, samples, groups[: args.gradients], tau_p, args.q, args.seed)
        result["gradients"] = {"file": report["file"], "tau_p": tau_p, **test}
        result["gradients"]["seconds"] = round(time.time() - start, 1)
    write_atomic(args.out, json.dumps(result, indent=1) + "\n")
    print(format_report(result))


def format_report(result: dict) -> str:
    lines = ["| file | accuracy | mixed groups | length | τ_p | candidates/pool (median, min) | silenced/candidates |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for f in result["files"]:
        for tau_p, r in f["tau_p"].items():
            lines.append(
                f"| {Path(f['file']).name} | {f['accuracy']:.3f} | {f['mixed_groups']:.2f} | {f['mean_length']:.0f} | "
                f"{tau_p} | {r['candidates_per_pool_median']}, {r['candidates_per_pool_min']} | "
                f"{r['silenced_of_candidates']:.3f} |"
            )
    if "gradients" in result and "entropy_rate_none" in result["gradients"]["summary"]:
        s = result["gradients"]["summary"]
        lines.append(
            f"gradients (τ_p {result['gradients']['tau_p']}, {s['pools_with_silenced']} pools): ‖Δg‖/‖g‖ S2T "
            f"{s['rel_change_s2t']['mean']:.4f}, random {s['rel_change_random']['mean']:.4f}; entropy rate none "
            f"{s['entropy_rate_none']['mean']:.4g}, S2T {s['entropy_rate_s2t']['mean']:.4g}, random "
            f"{s['entropy_rate_random']['mean']:.4g} (S2T−random t = {s['entropy_rate_s2t_minus_random']['t']:.2f})"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
