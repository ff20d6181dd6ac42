"""Does vLLM give a request the same tokens and log-probabilities whatever else is in its batch?

    python -m stapo.checks.batch_invariance run --model DIR --setting fa2 --out fa2.json [--requests 48]
        [--max-tokens 64] [--greedy] [--eager | --graphs]
    python -m stapo.checks.batch_invariance table fa3.json fa2.json ...       # one row per setting and composition

``run`` starts one vLLM engine with ``VLLM_BATCH_INVARIANT=1`` and the attention backend of ``--setting``
(:data:`SETTINGS`), and generates the same seeded requests (word problems of mixed lengths, a seed each, as the
recipe's ``determinism=full`` sends them) in several batch compositions (:func:`compositions`): all at once, the same
again, reversed, in chunks, one at a time, and mixed with other requests. Each composition is compared with the first,
request by request (:func:`compare`): responses whose tokens differ, tokens that differ, and sampled-token
log-probabilities that differ at all over the positions before the first differing token. Batch-invariant generation
gives zeros everywhere; differences in ``again`` are not even run-to-run repeatable. Then, in the same process and so
under the cuBLAS settings vLLM's engine left there, :func:`matmul_rows` asks whether a bfloat16 matrix product's rows
depend on how many rows are multiplied at once (on Hopper, vLLM 0.24's batch-invariant matmuls rest on cuBLAS:
``CUBLAS_WORKSPACE_CONFIG=:16:8`` and ``CUBLASLT_WORKSPACE_SIZE=1``, set in ``batch_invariant.py``). The record
(``--out``, JSON) holds the setting, the engine's arguments, the environment, the versions and the counts; ``table``
puts records side by side, with the upstream issue each setting answers.

Size it small (48 requests × 64 tokens): batch-invariant kernels are slow, and one process per setting keeps a
backend's start-up failure from hiding the others.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from stapo.tools.io import output_problem, write_atomic

SETTINGS: dict[str, dict] = {
    "fa3": {"attention_config": {"backend": "FLASH_ATTN", "flash_attn_version": 3}},
    "fa2": {"attention_config": {"backend": "FLASH_ATTN", "flash_attn_version": 2}},
    "flex": {"attention_config": {"backend": "FLEX_ATTENTION"}},
    "triton": {"attention_config": {"backend": "TRITON_ATTN"}},
}
"""Engine arguments of each setting (vLLM 0.24's ``AttentionConfig``, ``vllm/config/attention.py``)."""
UPSTREAM = {
    "fa3": "vLLM #47069, #51902: FlashAttention 3's SM90 tile scheduler breaks batch invariance on Hopper",
    "fa2": "vLLM PR #48694 (open): fall back to FlashAttention 2 on SM90 under VLLM_BATCH_INVARIANT=1",
    "flex": "one of the backends vLLM's tests/v1/determinism/test_batch_invariance.py covers",
    "triton": "one of the backends vLLM's tests/v1/determinism/test_batch_invariance.py covers",
}
"""What each setting answers upstream (leads from issue 54, to be confirmed by the records)."""
ENVIRONMENT = {"VLLM_BATCH_INVARIANT": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
"""Set before vLLM is imported: batch-invariant kernels, and the engine in this process (one process per setting)."""
RECORDED_ENV = (*ENVIRONMENT, "CUBLAS_WORKSPACE_CONFIG", "CUBLASLT_WORKSPACE_SIZE", "VLLM_USE_FLASHINFER_SAMPLER")
"""The environment a record keeps (as the process started: the cuBLAS variables set in the shell, or not)."""
KV_CACHE_BYTES = 2 << 30
"""Each engine's KV cache: far more than 96 requests of a few hundred tokens need, in a small share of an H200."""
MATMUL_ROWS = (1, 2, 7, 64, 128)
"""Row counts at which :func:`matmul_rows` multiplies, against all :data:`MATMUL_SHAPE` rows at once."""
MATMUL_SHAPE = (257, 2048, 2048)
"""Rows, inner and output size of :func:`matmul_rows`'s product (a 1.7B model's hidden size)."""


@dataclass(frozen=True)
class Request:
    prompt: str
    seed: int


def make_requests(count: int, seed: int = 0) -> list[Request]:
    """``count`` word problems of levels 1-4 in turn (prompts of mixed lengths), each with a seed of its own."""
    from stapo.quickstart.task import distinct_word_problems

    problems = distinct_word_problems(seed, [1, 2, 3, 4], count)
    return [Request(f"{p.question} Put the answer in \\boxed{{}}.", seed * 100_003 + i) for i, p in enumerate(problems)]


def compositions(count: int, chunk: int = 8, seed: int = 0) -> dict[str, list[list[int]]]:
    """Batches of request indices, each composition holding every request once: ``together`` (the reference, in
    order), ``again`` (the same batch once more), ``reversed``, ``chunks`` of ``chunk``, ``single`` (one a batch) and
    ``mixed`` (a shuffled order; the run adds as many other requests to that batch, so the batch around each request
    changes). Negative indices in ``mixed`` name the other requests."""
    order = list(range(count))
    shuffled = random.Random(seed).sample(order + [-1 - i for i in order], 2 * count)
    return {
        "together": [order],
        "again": [order],
        "reversed": [order[::-1]],
        "chunks": [order[i : i + chunk] for i in range(0, count, chunk)],
        "single": [[i] for i in order],
        "mixed": [shuffled],
    }


Output = tuple[list[int], list[float]]
"""A response: its token ids and the log-probability of each sampled token."""


def compare(reference: Sequence[Output], other: Sequence[Output]) -> dict[str, float]:
    """Counts over requests: ``responses`` whose tokens differ, ``tokens`` that differ (positions from the first
    differing one to the end of the longer response), ``logprobs`` that differ bitwise before the first differing
    token, and the largest such difference."""
    responses = tokens = logprobs = 0
    largest = 0.0
    for (ref_ids, ref_lp), (ids, lp) in zip(reference, other, strict=True):
        first = next((i for i, (a, b) in enumerate(zip(ref_ids, ids)) if a != b), min(len(ref_ids), len(ids)))
        if ref_ids != ids:
            responses += 1
            tokens += max(len(ref_ids), len(ids)) - first
        gaps = [abs(a - b) for a, b in zip(ref_lp[:first], lp[:first])]
        logprobs += sum(g != 0 for g in gaps)
        largest = max([largest, *gaps])
    return {"responses": responses, "tokens": tokens, "logprobs": logprobs, "max_logprob_gap": largest}


Generate = Callable[[list[Request]], list[Output]]
"""One batch through the engine: the requests in, their outputs out, in order."""


def probe(
    generate: Generate, requests: list[Request], others: list[Request], batches: dict[str, list[list[int]]]
) -> dict[str, dict]:
    """Each composition's outputs compared with the first composition's (:func:`compare`); ``others`` fill the
    negative indices (:func:`compositions`)."""
    outputs: dict[str, list[Output]] = {}
    for name, composition in batches.items():
        got: dict[int, Output] = {}
        for batch in composition:
            chosen = [requests[i] if i >= 0 else others[-1 - i] for i in batch]
            got.update((i, out) for i, out in zip(batch, generate(chosen), strict=True) if i >= 0)
        outputs[name] = [got[i] for i in range(len(requests))]
    reference = outputs[next(iter(batches))]
    return {name: compare(reference, out) for name, out in outputs.items()}


def vllm_generate(model: Path, setting: str, max_tokens: int, greedy: bool, eager: bool) -> tuple[Generate, dict]:
    """An engine for ``setting`` and the function that runs one batch through it; the engine's arguments. Its KV cache
    is given (:data:`KV_CACHE_BYTES`) instead of a share of the GPU's free memory, and vLLM 0.24's start-up check
    (``request_memory``: free memory of at least ``gpu_memory_utilization`` of the GPU) asks for a tenth, so that
    the settings can run at once on one GPU."""
    os.environ.update(ENVIRONMENT)
    from vllm import LLM, SamplingParams

    kwargs = {"model": str(model), "seed": 0, "enforce_eager": eager, "enable_prefix_caching": False}
    kwargs |= {"kv_cache_memory_bytes": KV_CACHE_BYTES, "gpu_memory_utilization": 0.1, **SETTINGS[setting]}
    llm = LLM(**kwargs)

    def generate(batch: list[Request]) -> list[Output]:
        params = [
            SamplingParams(temperature=0.0 if greedy else 1.0, max_tokens=max_tokens, seed=r.seed, logprobs=0)
            for r in batch
        ]
        outputs = llm.generate([r.prompt for r in batch], params, use_tqdm=False)
        result = []
        for out in outputs:
            sample = out.outputs[0]
            lps = [step[token].logprob for token, step in zip(sample.token_ids, sample.logprobs)]
            result.append((list(sample.token_ids), lps))
        return result

    return generate, kwargs


def matmul_rows(rows: Sequence[int] = MATMUL_ROWS, shape: tuple[int, int, int] = MATMUL_SHAPE, device: str = "cuda"):
    """For each row count m: how many of the first m rows of a seeded bfloat16 product ``A @ W`` differ bitwise when
    only those m rows are multiplied, against all of ``A``'s rows at once (0 everywhere: batch-invariant)."""
    import torch

    generator = torch.Generator().manual_seed(0)
    a, w = (torch.randn(size, generator=generator).to(device, torch.bfloat16) for size in (shape[:2], shape[1:]))
    full = a @ w
    return {m: int((a[:m] @ w != full[:m]).any(dim=1).sum()) for m in rows}


def versions() -> dict[str, str | None]:
    from importlib import metadata

    found = {}
    for package in ("vllm", "torch"):
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            found[package] = None
    return found


def table(records: Sequence[dict]) -> str:
    """Markdown: one row per setting and composition (the reference composition left out), with the upstream
    issue of each setting."""
    lines = [
        "| setting | mode | composition | responses differing | tokens differing | log-probs differing | largest "
        "log-prob gap | upstream |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for record in records:
        mode = ("greedy" if record["greedy"] else "seeded T=1") + (", eager" if record["eager"] else ", graphs")
        preset = {k: v for k, v in record.get("environment", {}).items() if k.startswith("CUBLAS") and v}
        mode += "".join(f", {k}={v}" for k, v in preset.items())
        for name, counts in list(record["compositions"].items())[1:]:
            lines.append(
                f"| {record['setting']} | {mode} | {name} | {counts['responses']} / {record['requests']} | "
                f"{counts['tokens']} | {counts['logprobs']} | {counts['max_logprob_gap']:.3g} | "
                f"{UPSTREAM[record['setting']]} |"
            )
    matmuls = [
        f"{r['setting']}: " + ", ".join(f"{m} rows: {n}" for m, n in r["matmul_rows_differing"].items())
        for r in records
        if "matmul_rows_differing" in r
    ]
    shown = "\n\nbfloat16 matmul, rows differing from the full product (after the engine): " + "; ".join(matmuls)
    return "\n".join(lines) + (shown if matmuls else "") + "\n"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m stapo.checks.batch_invariance", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="probe one setting in one engine; write its record")
    run.add_argument("--model", type=Path, required=True, help="a Hugging Face model folder")
    run.add_argument("--setting", choices=sorted(SETTINGS), required=True)
    run.add_argument("--out", type=Path, required=True, help="the record (JSON)")
    run.add_argument("--requests", type=int, default=48)
    run.add_argument("--max-tokens", type=int, default=64)
    run.add_argument("--seed", type=int, default=0, help="the requests' problems and seeds")
    run.add_argument("--greedy", action="store_true", help="temperature 0 instead of seeded sampling at T = 1")
    graphs = run.add_mutually_exclusive_group()
    graphs.add_argument("--eager", dest="eager", action="store_true", default=True, help="no CUDA graphs (default)")
    graphs.add_argument("--graphs", dest="eager", action="store_false", help="CUDA graphs and torch.compile")
    show = commands.add_parser("table", help="the records side by side (Markdown)")
    show.add_argument("records", type=Path, nargs="+")
    args = parser.parse_args(argv)
    if args.command == "table":
        try:
            records = [json.loads(path.read_text()) for path in args.records]
        except (OSError, ValueError) as error:
            parser.exit(2, f"error: {error}; pass records written by `batch_invariance run`\n")
        print(table(records), end="")
        return
    if args.requests < 2 or args.max_tokens < 1:
        parser.exit(2, "error: --requests must be at least 2 and --max-tokens at least 1\n")
    if problem := output_problem(args.out, "file", "--out") or (
        None if (args.model / "config.json").is_file() else f"--model {args.model}: no config.json there"
    ):
        parser.exit(2, f"error: {problem}\n")
    start, environment = time.time(), {**{k: os.environ.get(k) for k in RECORDED_ENV}, **ENVIRONMENT}
    generate, engine = vllm_generate(args.model, args.setting, args.max_tokens, args.greedy, args.eager)
    requests, others = (make_requests(args.requests, seed) for seed in (args.seed, args.seed + 1))
    counts = probe(generate, requests, others, compositions(args.requests, seed=args.seed))
    record = {
        "setting": args.setting,
        "engine": engine,
        "environment": environment,
        "versions": versions(),
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "greedy": args.greedy,
        "eager": args.eager,
        "seconds": round(time.time() - start, 1),
        "compositions": counts,
        "matmul_rows_differing": matmul_rows(),
    }
    write_atomic(args.out, json.dumps(record, indent=1) + "\n")
    print(table([record]), end="")


if __name__ == "__main__":
    main()
