"""Evaluation harness: sample the six benchmarks with vLLM, grade with :mod:`stapo.tools.reward`, summarise.

    python -m stapo.tools.evaluate --model DIR [DIR ...] [--data DIR] [--out DIR] [--benchmarks B ...] [--n N | B=N ...]
                         [--preset train|justrl] [--max-tokens 20480] [--tp 1] [--shard I/N] [--enforce-eager] ...

The paper (arXiv 2602.15620, "Experiments") reports avg@32 on AIME24, AIME25 and AMC23 and avg@4 on MATH500,
Minerva and OlympiadBench, under the training decoding (T = 1.0, top-p = 1.0) and JustRL's (T = 0.7, top-p = 0.9),
with up to 20,480 new tokens. Prompts are the parquet's chat messages rendered with the model's chat template and
``add_generation_prompt=True``, then tokenized without extra special tokens, as verl does in training.

Each model gets ``OUT/<label>/<preset>/`` holding ``run.json`` (the settings), ``samples*.jsonl`` (one line per
sample) and ``summary.json``. Samples are appended one finished problem group at a time; on restart, cut-off lines
and incomplete groups are dropped and only the missing problems are generated, so no sample is lost or duplicated.
docs/evaluation.md describes the outputs, the data-parallel sharding and the verifier hook.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import importlib
import json
import math
import re
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NamedTuple

from stapo.config import methods, sizes
from stapo.tools.checkpoint import CheckpointError, find_model
from stapo.tools.data import BENCHMARKS, DEFAULT_OUT
from stapo.tools.io import (
    DataFileError,
    append_atomic,
    number_problems,
    output_problem,
    read_parquet,
    vllm_missing,
    write_atomic,
)
from stapo.tools.reward import grade_many


class Decoding(NamedTuple):
    temperature: float
    top_p: float


PRESETS = {"train": Decoding(1.0, 1.0), "justrl": Decoding(0.7, 0.9)}
"""The paper's two evaluation settings: training-aligned, and JustRL's (reported in parentheses)."""
DEFAULT_N = {"aime24": 32, "aime25": 32, "amc23": 32, "math500": 4, "minerva": 4, "olympiadbench": 4}
"""Samples per problem in the paper: avg@32 on the small competition sets, avg@4 on the others."""
OTHER_N = 4
"""Samples per problem of any other benchmark (a ``DATA/<name>.parquet`` in the same schema, e.g. the quickstart's)."""
DEFAULT_MAX_TOKENS = 20480
DEFAULT_RESULTS = Path("outputs/eval")
RUN_FILE, SUMMARY_FILE = "run.json", "summary.json"
_SAMPLE_SETTINGS = ("model", "preset", "temperature", "top_p", "max_tokens", "seed")
_EXPERIMENT = re.compile(rf"({'|'.join(methods())})_({'|'.join(map(re.escape, sizes()))})(?![\w.])")


class EvalError(ValueError):
    """Bad input; the message names the file or option at fault and the fix."""


class Completion(NamedTuple):
    """One sampled response."""

    text: str
    finish_reason: str  # vLLM's: "stop" (EOS or stop token) or "length" (hit max_tokens)
    tokens: int


Generate = Callable[[Sequence[Sequence[int]], int], list[list[Completion]]]
"""``(prompt token ids, n) -> n completions per prompt``: the only step that needs vLLM (tests pass a stub)."""
Verifier = Callable[[list[dict]], list[float]]
"""Optional model-verifier hook: graded sample records in, final scores out (see :func:`load_verifier`)."""


@dataclass(frozen=True)
class Problem:
    benchmark: str
    problem_id: int  # extra_info.index of the prepared parquet
    messages: list
    ground_truth: str
    prompt: str = ""  # the chat-templated prompt, set by render_prompts
    prompt_ids: tuple = ()


# ---------------------------------------------------------------------------------------------------------- inputs
def read_benchmark(data_dir: Path, benchmark: str) -> list[Problem]:
    """The problems of ``data_dir/<benchmark>.parquet`` (verl schema), checked row by row."""
    path = Path(data_dir) / f"{benchmark}.parquet"
    if not path.is_file():
        other = "" if benchmark in BENCHMARKS else f" (the paper's benchmarks are {', '.join(BENCHMARKS)})"
        raise EvalError(
            f"{path}: not found; write it with `python -m stapo.tools.data eval --out {data_dir}` "
            f"or leave {benchmark} out of --benchmarks{other}"
        )
    expected = "a verl parquet written by `python -m stapo.tools.data eval`"
    rows = read_parquet(path, expected, columns=("prompt", "reward_model", "extra_info"))
    problems, seen = [], set()
    for number, row in enumerate(rows):
        where = f"{path}: row {number}: field"
        messages = row["prompt"]
        if not messages or not all(isinstance(m, dict) and m.get("role") and m.get("content") for m in messages):
            raise EvalError(f"{where} 'prompt': expected chat messages [{{'role': ..., 'content': ...}}]")
        truth = (row["reward_model"] or {}).get("ground_truth")
        if not truth:
            raise EvalError(f"{where} 'reward_model.ground_truth': missing or empty")
        index = (row["extra_info"] or {}).get("index")
        if not isinstance(index, int) or index in seen:
            raise EvalError(f"{where} 'extra_info.index': missing or repeated ({index!r}); re-write the file")
        seen.add(index)
        problems.append(Problem(benchmark, index, messages, str(truth)))
    if not problems:
        raise EvalError(f"{path}: no rows")
    return problems


def fingerprint(problems: Iterable[Problem]) -> str:
    """A short hash of the problems' ids, messages and answers (a resumed run must see the same data)."""
    content = json.dumps([[p.problem_id, p.messages, p.ground_truth] for p in problems], sort_keys=True)
    return hashlib.sha256(content.encode()).hexdigest()[:16]


def render_prompts(tokenizer, problems: Sequence[Problem], source: str) -> list[Problem]:
    """Problems with the chat-templated prompt and its token ids, as verl builds rollout prompts."""
    if not getattr(tokenizer, "chat_template", None):
        raise EvalError(
            f"{source}: the tokenizer has no chat template, but training applied one; copy the base model's "
            "tokenizer_config.json (with its chat_template) into the checkpoint"
        )
    rendered = []
    for problem in problems:
        text = tokenizer.apply_chat_template(problem.messages, add_generation_prompt=True, tokenize=False)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        rendered.append(replace(problem, prompt=text, prompt_ids=tuple(ids)))
    return rendered


def default_label(model: Path) -> str:
    """Run name of a checkpoint: ``<experiment>_step<N>`` for verl's ``<experiment>/global_step_N/...`` layout,
    else the folder name."""
    parts = Path(model).resolve().parts
    steps = [i for i, part in enumerate(parts) if re.fullmatch(r"global_step_\d+", part) and i > 0]
    if steps:
        i = steps[-1]
        return f"{parts[i - 1]}_step{parts[i].removeprefix('global_step_')}"
    return parts[-1]


def infer_method_size(model: Path) -> tuple[str | None, str | None]:
    """``(method, size)`` from an experiment name ``<method>_<size>`` in the path (the configs' naming)."""
    found = _EXPERIMENT.findall(str(Path(model).resolve()))
    return found[-1] if found else (None, None)


def parse_n(values: Sequence[str] | None, benchmarks: Sequence[str]) -> dict[str, int]:
    """Samples per problem: :data:`DEFAULT_N`, then ``N`` (all benchmarks) or ``BENCH=N`` overrides in order."""
    counts = {b: DEFAULT_N.get(b, OTHER_N) for b in benchmarks}
    for value in values or ():
        name, _, count = value.rpartition("=")
        if not count.isdigit() or int(count) < 1:
            raise EvalError(f"--n {value!r}: expected a positive integer N or BENCH=N")
        if name and name not in counts:
            raise EvalError(f"--n {value!r}: {name!r} is not among the benchmarks run ({', '.join(benchmarks)})")
        counts.update({name: int(count)} if name else dict.fromkeys(counts, int(count)))
    return counts


def parse_shard(value: str) -> tuple[int, int]:
    """``"I/N"`` -> ``(I, N)`` with 0 <= I < N."""
    match = re.fullmatch(r"(\d+)/(\d+)", value)
    if not match or not int(match[1]) < int(match[2]):
        raise EvalError(f"--shard {value!r}: expected I/N with 0 <= I < N, e.g. 0/4")
    return int(match[1]), int(match[2])


def load_verifier(spec: str) -> Verifier:
    """The callable ``module:function`` of ``--verifier``.

    It is called with the graded records of each generated chunk (``prompt``, ``response``, ``ground_truth``,
    ``pred``, ``score``, ...) and returns their final scores; the rule-based score is kept as ``rule_score``.
    The paper graded with a model verifier (CompassVerifier-3B) besides the rules; none ships here.
    """
    module, _, name = spec.partition(":")
    try:
        function = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as error:
        raise EvalError(f"--verifier {spec!r}: cannot load it ({error}); expected an importable module:function")
    if not callable(function):
        raise EvalError(f"--verifier {spec!r}: {name} is not callable")
    return function


# ------------------------------------------------------------------------------------------------------ generation
class VLLMGenerator:
    """:data:`Generate` with vLLM's offline ``LLM``, started on the first call (a finished run never starts it).

    The seed is the engine's (``LLM(seed=...)``): per-request seeds would make vLLM sample request by request.
    """

    def __init__(self, model: Path, decoding: Decoding, max_tokens: int, seed: int, **engine_args) -> None:
        self.model, self.decoding, self.max_tokens, self.seed = str(model), decoding, max_tokens, seed
        self.engine_args = {key: value for key, value in engine_args.items() if value is not None}
        self.llm = None

    @staticmethod
    def check() -> None:
        """Stop before any output is written where vLLM is not installed."""
        if problem := vllm_missing("generation"):
            raise EvalError(problem)

    def __call__(self, prompt_ids: Sequence[Sequence[int]], n: int) -> list[list[Completion]]:
        from vllm import LLM, SamplingParams

        if self.llm is None:
            self.llm = LLM(model=self.model, seed=self.seed, **self.engine_args)
        params = SamplingParams(
            n=n, temperature=self.decoding.temperature, top_p=self.decoding.top_p, max_tokens=self.max_tokens
        )
        outputs = self.llm.generate([{"prompt_token_ids": list(ids)} for ids in prompt_ids], params)
        return [[Completion(o.text, o.finish_reason or "", len(o.token_ids)) for o in out.outputs] for out in outputs]

    def close(self) -> None:
        """Drop the engine; vLLM frees the GPU when it is garbage-collected."""
        self.llm = None
        gc.collect()


# ---------------------------------------------------------------------------------------------------------- a run
@dataclass
class Run:
    """One model under one preset: its folder, settings and labels."""

    dir: Path
    settings: dict  # what determines the samples (compared on resume)
    labels: dict  # label, method, size (may change between invocations)
    problems: list[Problem]
    shard: tuple[int, int] = (0, 1)

    @property
    def samples_file(self) -> Path:
        index, count = self.shard
        return self.dir / ("samples.jsonl" if count == 1 else f"samples.{index}of{count}.jsonl")


def open_run(run: Run) -> dict:
    """Check ``run.json`` against ``run.settings`` and return the merged settings (benchmarks accumulate)."""
    path = run.dir / RUN_FILE
    merged = {**run.settings, "benchmarks": dict(run.settings["benchmarks"])}
    if path.exists():
        old = json.loads(path.read_text(encoding="utf-8"))
        conflicts = [
            f"{key} (was {old.get(key)!r}, now {run.settings[key]!r})"
            for key in _SAMPLE_SETTINGS
            if old.get(key) != run.settings[key]
        ]
        for bench, info in run.settings["benchmarks"].items():
            before = old.get("benchmarks", {}).get(bench)
            if before and before != info:
                conflicts.append(f"{bench} samples/data (was {before}, now {info})")
        if conflicts:
            raise EvalError(
                f"{path}: this folder holds a run with other settings: {'; '.join(conflicts)}. "
                "Use another --out or --label, or delete the folder to start over"
            )
        merged["benchmarks"] = {**old.get("benchmarks", {}), **run.settings["benchmarks"]}
    return merged


def load_samples(run_dir: Path, own_file: Path, n_by_bench: dict[str, int]) -> dict[tuple[str, int], list[dict]]:
    """Complete problems of the run: ``(benchmark, problem_id) -> records`` ordered by sample index, without text.

    Every ``samples*.jsonl`` of the folder is read (other shards' too); a problem counts once it has exactly its n
    samples in one file. Lines cut off by a kill, incomplete problems and repeats are ignored, and removed from
    ``own_file`` (the only file this process writes) by an atomic rewrite.
    """
    done: dict[tuple[str, int], list[dict]] = {}
    for path in sorted(run_dir.glob("samples*.jsonl")):
        groups: dict[tuple[str, int], dict[int, dict]] = {}
        dirty = False
        with path.open(encoding="utf-8") as lines:
            for line in lines:
                try:
                    record = json.loads(line)
                    key, sample = (record["benchmark"], record["problem_id"]), record["sample"]
                except (json.JSONDecodeError, KeyError, TypeError):
                    dirty = True
                    continue
                group = groups.setdefault(key, {})
                if sample in group:
                    dirty = True
                else:
                    group[sample] = {k: record[k] for k in ("score", "tokens", "finish_reason")}
        accepted = set()
        for key, samples in groups.items():
            if key in done or sorted(samples) != list(range(n_by_bench.get(key[0], -1))):
                dirty = True
            else:
                done[key] = [samples[i] for i in range(len(samples))]
                accepted.add(key)
        if dirty and path == own_file:
            _rewrite_complete(path, accepted)
    return done


def _rewrite_complete(path: Path, keep: set[tuple[str, int]]) -> None:
    """Rewrite ``path`` with the first record of each (problem, sample) of the ``keep`` problems only."""
    seen, kept = set(), []
    with path.open(encoding="utf-8") as lines:
        for line in lines:
            try:
                record = json.loads(line)
                key = (record["benchmark"], record["problem_id"])
            except (json.JSONDecodeError, KeyError, TypeError):
                continue
            if key in keep and (key, record["sample"]) not in seen:
                seen.add((key, record["sample"]))
                kept.append(line)
    write_atomic(path, "".join(kept))


def grade(
    problems: Sequence[Problem],
    completions: Sequence[Sequence[Completion]],
    grade_workers: int | None = None,
    verifier: Verifier | None = None,
) -> list[dict]:
    """Sample records of ``problems`` (in order), scored by :func:`stapo.tools.reward.grade_many` and the verifier."""
    records = [
        {
            "benchmark": problem.benchmark,
            "problem_id": problem.problem_id,
            "sample": index,
            "finish_reason": completion.finish_reason,
            "tokens": completion.tokens,
            "ground_truth": problem.ground_truth,
            "prompt": problem.prompt,
            "response": completion.text,
        }
        for problem, group in zip(problems, completions, strict=True)
        for index, completion in enumerate(group)
    ]
    results = grade_many([(r["response"], r["ground_truth"]) for r in records], num_workers=grade_workers)
    for record, result in zip(records, results, strict=True):
        record.update(score=result["score"], pred=result["pred"])
    if verifier is not None:
        scores = list(verifier(records))
        if len(scores) != len(records):
            raise EvalError(f"--verifier returned {len(scores)} scores for {len(records)} samples")
        for record, score in zip(records, scores, strict=True):
            record.update(rule_score=record["score"], score=float(score))
    return records


def evaluate(
    run: Run,
    generate: Generate,
    chunk_samples: int = 2048,
    grade_workers: int | None = None,
    verifier: Verifier | None = None,
    progress: bool = True,
) -> dict | None:
    """Generate, grade and append the missing samples of ``run``'s shard; return the summary once every shard is
    done (also written to ``summary.json``), else None.

    ``generate`` is called with up to ``chunk_samples`` samples' worth of prompts of one benchmark at a time.
    """
    from tqdm import tqdm

    settings = open_run(run)
    run.dir.mkdir(parents=True, exist_ok=True)
    write_atomic(run.dir / RUN_FILE, json.dumps({**settings, **run.labels}, indent=2) + "\n")
    n_by_bench = {bench: info["n"] for bench, info in settings["benchmarks"].items()}
    done = load_samples(run.dir, run.samples_file, n_by_bench)
    index, count = run.shard
    mine = [p for i, p in enumerate(run.problems) if i % count == index]
    todo = [p for p in mine if (p.benchmark, p.problem_id) not in done]
    total = sum(n_by_bench[p.benchmark] for p in mine)
    left = sum(n_by_bench[p.benchmark] for p in todo)
    bar = tqdm(total=total, initial=total - left, unit="sample", desc=run.labels["label"], disable=not progress)
    tokens, seconds = 0, 0.0
    for bench in dict.fromkeys(p.benchmark for p in todo):
        n = n_by_bench[bench]
        pending = [p for p in todo if p.benchmark == bench]
        size = max(1, chunk_samples // n)
        for start in range(0, len(pending), size):
            chunk = pending[start : start + size]
            began = time.monotonic()
            completions = generate([p.prompt_ids for p in chunk], n)
            seconds += time.monotonic() - began
            if [len(group) for group in completions] != [n] * len(chunk):
                raise RuntimeError(f"generation returned {[len(g) for g in completions]} samples, expected {n} each")
            records = grade(chunk, completions, grade_workers, verifier)
            append_atomic(run.samples_file, [json.dumps(r, ensure_ascii=False) + "\n" for r in records])
            tokens += sum(r["tokens"] for r in records)
            bar.set_postfix_str(f"{tokens / max(seconds, 1e-9):.0f} gen tok/s")
            bar.update(len(records))
    bar.close()
    summary = summarize(settings, run.labels, load_samples(run.dir, run.samples_file, n_by_bench))
    if summary is not None:
        write_atomic(run.dir / SUMMARY_FILE, json.dumps(summary, indent=2) + "\n")
    return summary


# ------------------------------------------------------------------------------------------------------- metrics
def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct: 1 - C(n-c, k) / C(n, k) (Chen et al. 2021, arXiv 2107.03374)."""
    if not 0 < k <= n:
        raise ValueError(f"pass@k needs 0 < k <= n, got k={k}, n={n}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def benchmark_metrics(groups: Sequence[Sequence[dict]]) -> dict:
    """Metrics of one benchmark from its problems' n records each (percentages where accuracies).

    ``avg`` is avg@n, the mean score over all samples; ``std`` the sample standard deviation, over the n sample
    indices j, of the accuracy of the j-th samples; ``pass`` pass@k for k = 1, 2, 4, ... and n (pass@1 = avg);
    ``mean_tokens`` the mean response length and ``truncated`` the percentage of responses that hit max_tokens.
    """
    n = len(groups[0])
    scores = [[record["score"] for record in group] for group in groups]
    per_index = [100 * statistics.fmean(row[j] for row in scores) for j in range(n)]
    ks = sorted({2**i for i in range(n.bit_length()) if 2**i <= n} | {n})
    correct = [sum(1 for s in row if s > 0) for row in scores]
    records = [record for group in groups for record in group]
    return {
        "problems": len(groups),
        "n": n,
        "avg": statistics.fmean(per_index),
        "std": statistics.stdev(per_index) if n > 1 else 0.0,
        "pass": {str(k): 100 * statistics.fmean(pass_at_k(n, c, k) for c in correct) for k in ks},
        "mean_tokens": statistics.fmean(r["tokens"] for r in records),
        "truncated": 100 * statistics.fmean(r["finish_reason"] == "length" for r in records),
    }


def summarize(settings: dict, labels: dict, done: dict[tuple[str, int], list[dict]]) -> dict | None:
    """The run summary, or None while some problem of some benchmark has no complete samples yet.

    ``average`` is the mean avg@n over the six benchmarks (the paper's Avg column), None unless all six are in.
    """
    benchmarks = {}
    for bench, info in settings["benchmarks"].items():
        groups = [records for (name, _), records in sorted(done.items()) if name == bench]
        if len(groups) != info["problems"]:
            return None
        benchmarks[bench] = benchmark_metrics(groups)
    paper = [b for b in BENCHMARKS if b in benchmarks]
    average = statistics.fmean(benchmarks[b]["avg"] for b in BENCHMARKS) if len(paper) == len(BENCHMARKS) else None
    order = paper + [b for b in benchmarks if b not in BENCHMARKS]
    return {
        **labels,
        **{k: settings[k] for k in _SAMPLE_SETTINGS},
        "average": average,
        "benchmarks": {b: benchmarks[b] for b in order},
    }


def format_summary(summary: dict) -> str:
    """A plain-text table of a summary."""
    lines = [
        f"{summary['label']} ({summary['preset']}: T={summary['temperature']}, top-p={summary['top_p']})",
        f"{'benchmark':<14} {'n':>3} {'avg@n':>7} {'std':>6} {'pass@n':>7} {'tokens':>8} {'trunc%':>7}",
    ]
    for bench, m in summary["benchmarks"].items():
        lines.append(
            f"{bench:<14} {m['n']:>3} {m['avg']:>7.2f} {m['std']:>6.2f} {m['pass'][str(m['n'])]:>7.2f} "
            f"{m['mean_tokens']:>8.0f} {m['truncated']:>7.2f}"
        )
    if summary["average"] is not None:
        lines.append(f"{'average':<14} {'':>3} {summary['average']:>7.2f}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------------------ CLI
def plan_runs(args: argparse.Namespace) -> list[Run]:
    """Check every input (models, labels, data, settings of existing runs) and build the runs; nothing heavy yet."""
    from transformers import AutoTokenizer

    shard, counts = parse_shard(args.shard), parse_n(args.n, args.benchmarks)
    sources = [find_model(Path(m)) for m in args.model]  # a training checkpoint is merged below, after the checks
    for option in ("label", "method", "size"):
        given = getattr(args, option)
        if given is not None and len(given) != len(sources):
            raise EvalError(f"--{option}: give one value per --model ({len(sources)}), got {len(given)}")
    if problem := output_problem(args.out, "folder"):
        raise EvalError(problem)
    labels = args.label or [default_label(s.folder) for s in sources]
    if len(set(labels)) != len(labels):
        raise EvalError(f"runs would share an output folder ({', '.join(labels)}); name them with --label")
    problems = [p for bench in args.benchmarks for p in read_benchmark(args.data, bench)]
    benchmarks = {
        bench: {
            "n": counts[bench],
            "problems": sum(p.benchmark == bench for p in problems),
            "data": fingerprint(p for p in problems if p.benchmark == bench),
        }
        for bench in args.benchmarks
    }
    runs = []
    for i, source in enumerate(sources):
        model = source.folder
        method, size = infer_method_size(model)
        method = args.method[i] if args.method else method
        size = args.size[i] if args.size else size
        settings = {
            "model": str(model.resolve()),
            "preset": args.preset,
            **PRESETS[args.preset]._asdict(),
            "max_tokens": args.max_tokens,
            "seed": args.seed,
            "benchmarks": benchmarks,
        }
        run = Run(
            Path(args.out) / labels[i] / args.preset,
            settings,
            {"label": labels[i], "method": method, "size": size},
            [],
            shard,
        )
        open_run(run)  # settings conflict with an earlier run: stop before any model loads or merges
        runs.append(run)
    VLLMGenerator.check()  # the last check: inputs first, then whether this machine can generate
    for run, source in zip(runs, sources):
        tokenizer = AutoTokenizer.from_pretrained(source.ready())
        run.problems = render_prompts(tokenizer, problems, str(source.folder))
    return runs


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m stapo.tools.evaluate", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", nargs="+", required=True,
        help="Hugging Face model folder(s), or checkpoints of scripts/train.sh: the run folder (its newest step), a "
        "global_step_N folder or its actor/ (merged once into actor/huggingface_merged; stapo/tools/checkpoint.py)",
    )  # fmt: skip
    parser.add_argument("--data", type=Path, default=DEFAULT_OUT, help=f"prepared parquet folder ({DEFAULT_OUT})")
    parser.add_argument("--out", type=Path, default=DEFAULT_RESULTS, help=f"results folder ({DEFAULT_RESULTS})")
    parser.add_argument(
        "--benchmarks", nargs="+", default=list(BENCHMARKS), metavar="BENCH",
        help="names of DATA/<BENCH>.parquet files (default: the paper's six benchmarks)",
    )  # fmt: skip
    parser.add_argument("--n", nargs="+", metavar="N|BENCH=N", help="samples per problem (default 32 / 4; others 4)")
    parser.add_argument("--preset", choices=PRESETS, default="train", help="train: T=1, top-p=1; justrl: 0.7, 0.9")
    parser.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS, help="max new tokens per sample")
    parser.add_argument("--seed", type=int, default=0, help="vLLM engine seed")
    parser.add_argument("--label", nargs="+", help="run name per model (default: from the path)")
    parser.add_argument("--method", nargs="+", choices=methods(), help="method label per model (default: from path)")
    parser.add_argument("--size", nargs="+", choices=sizes(), help="size label per model (default: from the path)")
    parser.add_argument("--tp", type=int, default=1, help="vLLM tensor_parallel_size")
    parser.add_argument("--shard", default="0/1", help="I/N: do problems I, I+N, ... (one process per GPU group)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--max-model-len", type=int, help="vLLM max_model_len (default: the model's)")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (faster start for small tests)")
    parser.add_argument("--chunk-samples", type=int, default=2048, help="samples per vLLM call (resume granularity)")
    parser.add_argument("--grade-workers", type=int, help="parallel grading processes (default: CPU count)")
    parser.add_argument("--verifier", help="module:function model-verifier hook (off by default)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    """Command-line entry point (``python -m stapo.tools.evaluate``)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        positive = ("max_tokens", "tp", "chunk_samples", "grade_workers", "max_model_len")
        for problem in number_problems(args, positive=positive, fractions=("gpu_memory_utilization",)):
            raise EvalError(problem)
        verifier = load_verifier(args.verifier) if args.verifier else None
        runs = plan_runs(args)
        for run in runs:
            generator = VLLMGenerator(
                Path(run.settings["model"]),
                PRESETS[args.preset],
                args.max_tokens,
                args.seed,
                tensor_parallel_size=args.tp,
                gpu_memory_utilization=args.gpu_memory_utilization,
                max_model_len=args.max_model_len,
                enforce_eager=args.enforce_eager,
            )
            try:
                summary = evaluate(
                    run, generator, args.chunk_samples, args.grade_workers, verifier, progress=not args.no_progress
                )
            finally:
                generator.close()
            if summary is None:
                print(f"{run.dir}: shard {args.shard} done; the summary is written when every shard has finished")
            else:
                print(format_summary(summary) + f"\n-> {run.dir / SUMMARY_FILE}")
    except (EvalError, DataFileError, CheckpointError) as error:
        parser.exit(2, f"error: {error}\n")


if __name__ == "__main__":
    main()
