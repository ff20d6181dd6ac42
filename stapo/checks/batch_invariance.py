"""Does vLLM give a request the same tokens and log-probabilities whatever else is in its batch?

    python -m stapo.checks.batch_invariance run --model DIR --setting fa2 --out fa2.json [--requests 48]
        [--max-tokens 64] [--greedy] [--eager | --graphs] [--norm recipe|vllm]
    python -m stapo.checks.batch_invariance table fa3.json fa2.json ...       # one row per setting and composition
    python -m stapo.checks.batch_invariance locate --model DIR --setting fa3 --out locate.json [--requests 8]
        [--max-tokens 16] [--greedy] [--partner same|longer|many] [--norm recipe|vllm]

``run`` starts one vLLM engine with ``VLLM_BATCH_INVARIANT=1`` and the attention backend of ``--setting``
(:data:`SETTINGS`), and generates the same seeded requests (word problems of mixed lengths, a seed each, as the recipe's
``determinism=full`` sends them) in several batch compositions (:func:`compositions`): all at once, the same again,
reversed, in chunks, one at a time, in batches of 2-7, and mixed with other requests. Each composition is compared with
the first, request by request (:func:`compare`): responses whose tokens differ, tokens that differ, and sampled-token
log-probabilities that differ at all over the positions before the first differing token; each composition's seconds are
kept too. Batch-invariant generation gives zeros everywhere; differences in ``again`` are not even run-to-run
repeatable. Then, in the same process and so under the cuBLAS settings vLLM's engine left there, :func:`matmul_rows`
asks whether a bfloat16 matrix product's rows depend on how many rows are multiplied at once (on Hopper, vLLM 0.24's
batch-invariant matmuls rest on cuBLAS: ``CUBLAS_WORKSPACE_CONFIG=:16:8`` and ``CUBLASLT_WORKSPACE_SIZE=1``, set in
``batch_invariant.py``). The record (``--out``, JSON) holds the setting, its label (the file's name), the engine's
arguments, what the engine chose (:func:`attention_facts`: the attention backend, its implementation and FlashAttention
version), the environment, the versions and the counts, and :func:`linear_rows` for the model's own projections
(``F.linear`` with its weights' shapes, the LM head included) and :func:`residual_norm_rows` for the residual RMSNorm
alone (vLLM's fused kernel and the recipe's, 8 rows against 300); ``table`` puts records side by side, with the upstream
issue each setting answers.

``locate`` asks where a request decoded alone first parts from the same request decoded beside others, the request
first in the batch. In one eager engine it records every module's output in every forward pass, and the sampler's
(:class:`Recorder`, forward hooks through vLLM's ``apply_model`` and ``collective_rpc``), for each of ``--requests``
requests alone and then beside its partners (:data:`PARTNERS`: the same prompt under another seed, a longer prompt,
or up to :data:`MANY` longer prompts, a batch as large as the probe's; ``ignore_eos``, so all run the same passes),
and compares the request's rows pass by pass in the order the modules finished (:func:`first_difference`): the first
pass and module whose output differs, the largest difference there and how many modules differ in that pass. Its
record counts the first modules over the requests (:func:`summary`).

Both run the recipe's residual RMSNorm by default (``--norm recipe``: the vLLM plugin of
:func:`stapo.train.verl_patches.batch_invariant_residual_rms_norm`, which ``determinism=full`` runs), or vLLM 0.24's
own (``--norm vllm``), whose kernel takes its block size from the batch's token count.

Size it small (48 requests × 64 tokens): batch-invariant kernels are slow, and one process per setting keeps a
backend's start-up failure from hiding the others.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from stapo.tools.io import output_problem, vllm_missing, write_atomic

SETTINGS: dict[str, dict] = {
    "fa3": {"attention_config": {"backend": "FLASH_ATTN", "flash_attn_version": 3}},
    "fa2": {"attention_config": {"backend": "FLASH_ATTN", "flash_attn_version": 2}},
    "flex": {"attention_config": {"backend": "FLEX_ATTENTION"}},
    "triton": {"attention_config": {"backend": "TRITON_ATTN"}},
}
"""Engine arguments of each setting (vLLM 0.24's ``AttentionConfig``, ``vllm/config/attention.py``)."""
UPSTREAM = {
    "fa3": "the H100 record: vLLM 0.24's residual RMSNorm, not FlashAttention 3 (whose leads are vLLM #47069, #51902)",
    "fa2": "vLLM PR #48694 (open): fall back to FlashAttention 2 on SM90 under VLLM_BATCH_INVARIANT=1",
    "flex": "one of the backends vLLM's tests/v1/determinism/test_batch_invariance.py covers",
    "triton": "one of the backends vLLM's tests/v1/determinism/test_batch_invariance.py covers",
}
"""What each setting answers upstream: the leads of issue 54, and for ``fa3`` what the H100 record of
docs/evidence/bitwise.md located (a request alone first parted at a residual RMSNorm)."""
ENVIRONMENT = {"VLLM_BATCH_INVARIANT": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
"""Set before vLLM is imported: batch-invariant kernels, and the engine in this process (one process per setting)."""
RECORDED_ENV = (
    *ENVIRONMENT,
    "CUBLAS_WORKSPACE_CONFIG",
    "CUBLASLT_WORKSPACE_SIZE",
    "VLLM_USE_FLASHINFER_SAMPLER",
    "VLLM_PLUGINS",
)
NORMS = {
    "recipe": "the recipe's vLLM plugin makes the residual RMSNorm batch-invariant (stapo.train.verl_patches)",
    "vllm": "vLLM 0.24's own norms (VLLM_PLUGINS empty: no vLLM plugin loads)",
}
"""``--norm``: which residual RMSNorm the engine runs (records without the key ran vLLM's own)."""
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


SMALL = range(2, 8)
"""The sizes of the ``small`` composition's batches, in turn: the small batches a rollout's last requests decode in."""


def compositions(count: int, chunk: int = 8, seed: int = 0) -> dict[str, list[list[int]]]:
    """Batches of request indices, each composition holding every request once: ``together`` (the reference, in
    order), ``again`` (the same batch once more), ``reversed``, ``chunks`` of ``chunk``, ``single`` (one a batch),
    ``small`` (batches of 2, 3, ..., 7 in turn, one longer or shorter where a batch of one would be left) and
    ``mixed`` (a shuffled order; the run adds as many other requests to that batch, so the batch around each request
    changes). Negative indices in ``mixed`` name the other requests."""
    order = list(range(count))
    shuffled = random.Random(seed).sample(order + [-1 - i for i in order], 2 * count)
    small, start, sizes = [], 0, itertools.cycle(SMALL)
    while start < count:
        size = next(sizes)
        if count - start - size == 1:  # no batch of one at the end
            size += 1 if size < max(SMALL) else -1
        small.append(order[start : start + size])
        start += size
    return {
        "together": [order],
        "again": [order],
        "reversed": [order[::-1]],
        "chunks": [order[i : i + chunk] for i in range(0, count, chunk)],
        "single": [[i] for i in order],
        "small": small,
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
    """Each composition's outputs compared with the first composition's (:func:`compare`), with the seconds its
    batches took to generate (``seconds``); ``others`` fill the negative indices (:func:`compositions`)."""
    outputs: dict[str, list[Output]] = {}
    seconds: dict[str, float] = {}
    for name, composition in batches.items():
        got: dict[int, Output] = {}
        start = time.perf_counter()
        for batch in composition:
            chosen = [requests[i] if i >= 0 else others[-1 - i] for i in batch]
            got.update((i, out) for i, out in zip(batch, generate(chosen), strict=True) if i >= 0)
        seconds[name] = round(time.perf_counter() - start, 2)
        outputs[name] = [got[i] for i in range(len(requests))]
    reference = outputs[next(iter(batches))]
    return {name: compare(reference, out) | {"seconds": seconds[name]} for name, out in outputs.items()}


def choose_norm(norm: str) -> None:
    """Before vLLM starts in this process: ``vllm``, no vLLM plugin loads (``VLLM_PLUGINS`` empty); ``recipe``, every
    installed one does, the recipe's RMSNorm among them (``VLLM_PLUGINS`` unset)."""
    if norm == "vllm":
        os.environ["VLLM_PLUGINS"] = ""
    else:
        os.environ.pop("VLLM_PLUGINS", None)


def norm_patched(model) -> bool:
    """Whether ``model``'s RMSNorm modules (run through ``apply_model``) reach the recipe's residual norm: each
    dispatches to ``forward_cuda`` (an eager engine's custom ops), which calls ``layernorm.rms_norm_batch_invariant``,
    the recipe's wrapper."""
    from vllm.model_executor.layers import layernorm

    norms = [m for m in model.modules() if isinstance(m, layernorm.RMSNorm)]
    wrapped = hasattr(layernorm.rms_norm_batch_invariant, "_stapo_original")
    return (
        wrapped
        and bool(norms)
        and all(getattr(m._forward_method, "__func__", None) is type(m).forward_cuda for m in norms)
    )


def start_engine(model: Path, setting: str, eager: bool, norm: str = "recipe"):
    """A vLLM engine for ``setting`` in this process with ``norm``'s RMSNorm (:data:`NORMS`), and its arguments. Its
    KV cache is given (:data:`KV_CACHE_BYTES`) instead of a share of the GPU's free memory, and vLLM 0.24's start-up
    check (``request_memory``: free memory of at least ``gpu_memory_utilization`` of the GPU) asks for a tenth, so
    that the settings can run at once on one GPU. No prefix caching: a request's second run computes its prompt
    again."""
    os.environ.update(ENVIRONMENT)
    choose_norm(norm)
    from vllm import LLM

    kwargs = {"model": str(model), "seed": 0, "enforce_eager": eager, "enable_prefix_caching": False}
    kwargs |= {"kv_cache_memory_bytes": KV_CACHE_BYTES, "gpu_memory_utilization": 0.1, **SETTINGS[setting]}
    return LLM(**kwargs), kwargs


def generator(llm, max_tokens: int, greedy: bool, ignore_eos: bool = False) -> Generate:
    """The function that runs one batch through ``llm``: seeded sampling at T = 1 (or greedy), ``max_tokens`` each."""
    from vllm import SamplingParams

    def generate(batch: list[Request]) -> list[Output]:
        params = [
            SamplingParams(temperature=0.0 if greedy else 1.0, max_tokens=max_tokens, seed=r.seed, logprobs=0,
                           ignore_eos=ignore_eos)
            for r in batch
        ]  # fmt: skip
        outputs = llm.generate([r.prompt for r in batch], params, use_tqdm=False)
        result = []
        for out in outputs:
            sample = out.outputs[0]
            lps = [step[token].logprob for token, step in zip(sample.token_ids, sample.logprobs)]
            result.append((list(sample.token_ids), lps))
        return result

    return generate


def attention_facts(model) -> dict:
    """What the engine chose for attention, read from the model's first attention layer (an ``apply_model``
    function): the backend's name, its implementation's class and the FlashAttention version it calls (None for a
    backend without one); all None where no module has vLLM's attention layer's attributes."""
    layer = next((m for m in model.modules() if hasattr(m, "attn_backend") and hasattr(m, "impl")), None)
    if layer is None:
        return {"backend": None, "implementation": None, "flash_attn_version": None}
    return {
        "backend": layer.attn_backend.get_name(),
        "implementation": type(layer.impl).__name__,
        "flash_attn_version": getattr(layer.impl, "vllm_flash_attn_version", None),
    }


def projection_shapes(config: dict) -> dict[str, tuple[int, int]]:
    """(in, out) of the decoder's linear layers as vLLM runs them (query, key and value fused, gate and up fused) and
    of the LM head, from a Hugging Face ``config.json``."""
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    kv_heads = config.get("num_key_value_heads", heads)
    return {
        "qkv_proj": (hidden, (heads + 2 * kv_heads) * head_dim),
        "o_proj": (heads * head_dim, hidden),
        "gate_up_proj": (hidden, 2 * config["intermediate_size"]),
        "down_proj": (config["intermediate_size"], hidden),
        "lm_head": (hidden, config["vocab_size"]),
    }


def linear_rows(shapes: dict[str, tuple[int, int]], rows: Sequence[int] = MATMUL_ROWS, full: int = 257,
                device: str = "cuda") -> dict[str, dict[int, int]]:  # fmt: skip
    """:func:`matmul_rows` with the model's own operation: per projection, ``F.linear`` of ``full`` seeded bfloat16
    rows with a weight of its shape (out × in, as vLLM stores it); for each row count m, how many of the first m rows
    differ bitwise when only those m are computed."""
    import torch
    import torch.nn.functional as F

    found = {}
    for name, (inputs, outputs) in shapes.items():
        generator = torch.Generator().manual_seed(0)
        x, w = (torch.randn(size, generator=generator).to(device, torch.bfloat16) for size in ((full, inputs),
                (outputs, inputs)))  # fmt: skip
        whole = F.linear(x, w)
        found[name] = {m: int((F.linear(x[:m], w) != whole[:m]).any(dim=1).sum()) for m in rows}
    return found


NORM_ROWS = (8, 300)
""":func:`residual_norm_rows`: a batch of fewer than 256 tokens and one of more (vLLM 0.24's fused kernel changes its
block size at 256)."""


def residual_norm_rows(hidden: int, rows: tuple[int, int] = NORM_ROWS, device: str = "cuda") -> dict[str, int]:
    """The residual RMSNorm alone, at the model's hidden size: of the first ``rows[0]`` of ``rows[1]`` seeded bfloat16
    rows (input and residual), how many come out otherwise when only they are normalised, with vLLM 0.24's fused
    kernel (``_custom_ops.fused_add_rms_norm``, in place) and with the recipe's (the sum, then vLLM's Triton kernel).
    On an H100 it counted 0 with both kernels while the model's own norms did differ (docs/evidence/bitwise.md):
    a 0 here does not clear vLLM's kernel."""
    import torch
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers import batch_invariant

    generator = torch.Generator().manual_seed(0)
    x, residual = (torch.randn(rows[1], hidden, generator=generator).to(device, torch.bfloat16) for _ in range(2))
    weight = (0.5 + torch.rand(hidden, generator=generator)).to(device, torch.bfloat16)

    def vllms(x, residual):
        x, residual = x.clone(), residual.clone()
        ops.fused_add_rms_norm(x, residual, weight, 1e-6)
        return x

    def recipes(x, residual):
        return batch_invariant.rms_norm_batch_invariant(x + residual, weight, 1e-6)

    few = rows[0]
    return {name: int((norm(x[:few], residual[:few]) != norm(x, residual)[:few]).any(dim=1).sum())
            for name, norm in (("vllm", vllms), ("recipe", recipes))}  # fmt: skip


def tensors_of(output, depth: int = 3) -> list:
    """The tensors in a module's output: itself, or those in its tuple, list or dataclass fields (the sampler's)."""
    import dataclasses

    import torch

    if isinstance(output, torch.Tensor):
        return [output]
    if depth == 0:
        return []
    if isinstance(output, (tuple, list)):
        return [t for item in output for t in tensors_of(item, depth - 1)]
    if dataclasses.is_dataclass(output):
        return [t for f in dataclasses.fields(output) for t in tensors_of(getattr(output, f.name), depth - 1)]
    return []


class Recorder:
    """Every module's output in every forward pass of a model, and the sampler's, on the CPU in the order the modules
    finished, while ``on``: ``passes`` is one list of (module name, tensors) per pass (a pass starts when the model's
    top module is called)."""

    def __init__(self) -> None:
        self.on = False
        self.keep: int | None = None  # rows kept of each output (all: None)
        self.widest: list[int] = []  # per pass, the most rows an output had (the pass's tokens), before keep
        self.passes: list[list[tuple[str, list]]] = []

    def _start(self, *_) -> None:
        if self.on:
            self.passes.append([])
            self.widest.append(0)

    def _hook(self, name: str):
        def record(module, inputs, output) -> None:
            if self.on and self.passes:
                tensors = tensors_of(output)
                if self.widest:
                    self.widest[-1] = max([self.widest[-1], *(t.shape[0] for t in tensors if t.dim())])
                kept = [t[: self.keep] if self.keep and t.dim() else t for t in tensors]
                self.passes[-1].append((name, [t.detach().cpu() for t in kept]))

        return record

    def attach(self, model, sampler=None) -> int:
        """Hooks on ``model``'s modules (and ``sampler``); returns how many."""
        model.register_forward_pre_hook(self._start)
        modules = [(name or "model", module) for name, module in model.named_modules()]
        modules += [("sampler", sampler)] if sampler is not None else []
        for name, module in modules:
            module.register_forward_hook(self._hook(name))
        return len(modules)

    def record(self, generate: Generate, batch: list[Request], keep: int | None = None) -> tuple[list, Output]:
        """The passes of one batch (the first ``keep`` rows of each output) and the first request's output."""
        self.passes, self.widest, self.on, self.keep = [], [], True, keep
        try:
            outputs = generate(batch)
        finally:
            self.on, self.keep = False, None
        return self.passes, outputs[0]


RECORDER = Recorder()
"""``locate``'s recorder: the hooks run in the engine's worker, which ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` keeps in
this process."""


def _attach_model(model) -> int:
    return RECORDER.attach(model)


class _RecordedSampler:
    """vLLM 0.24's V2 model runner's sampler, which is a plain object, not a module: its outputs recorded as a hook
    would, everything else passed through."""

    def __init__(self, sampler) -> None:
        self._sampler = sampler

    def __getattr__(self, name: str):
        return getattr(self._sampler, name)

    def __call__(self, *args, **kwargs):
        output = self._sampler(*args, **kwargs)
        RECORDER._hook("sampler")(self._sampler, args, output)
        return output


def _attach_sampler(worker) -> str:
    """Record the sampler's outputs: a hook on a module (the V1 runner's), a wrapper around another object (the V2
    runner's); what was done."""
    import torch

    runner = worker.model_runner
    sampler = getattr(runner, "sampler", None)
    if sampler is None:
        return "no sampler found"
    if isinstance(sampler, torch.nn.Module):
        sampler.register_forward_hook(RECORDER._hook("sampler"))
        return f"hook on {type(sampler).__name__}"
    runner.sampler = _RecordedSampler(sampler)
    return f"wrapper around {type(sampler).__name__} ({type(runner).__name__})"


PARTNER_SEED = 500_009
"""Added to a request's seed to seed its partner (no request of :func:`make_requests` has it)."""
PARTNERS = {
    "same": "the same prompt under another seed",
    "longer": "a longer prompt",
    "many": "up to 47 longer prompts",
}
"""``locate --partner``: whom each request is decoded beside (the request stays first in the batch)."""
MANY = 47
"""``--partner many``: a batch of up to 48, as the probe's ``together`` composition is."""


def longer_partners(
    requests: list[Request], pool: list[Request], tokens: Callable[[str], int], count: int = 1
) -> list[list[Request]]:
    """For each request, the first ``count`` of ``pool`` whose prompts have more tokens (``tokens``), none where none
    has: partners of other lengths, which still leave the request first in vLLM 0.24's V2 runner's batch (fewer
    scheduled tokens first, a stable sort)."""
    return [[o for o in pool if tokens(o.prompt) > tokens(r.prompt)][:count] for r in requests]


def partner(request: Request) -> Request:
    """The request ``locate`` pairs with ``request``: the same prompt under another seed, as a prompt's n responses
    in an RL rollout are. An equal prompt keeps ``request`` first in the batch: vLLM 0.24's V2 model runner orders a
    batch by each request's scheduled tokens (``prepare_inputs``: "Decode first, then prefill", a stable sort)."""
    return Request(request.prompt, request.seed + PARTNER_SEED)


def _same(a, b) -> bool:
    """Bitwise equal tensors of one shape (NaN equals NaN)."""
    import torch

    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point():
        return bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())
    return torch.equal(a, b)


def _gap(a, b) -> float:
    if a.shape != b.shape or not a.is_floating_point():
        return math.inf
    return float((a.float() - b.float()).abs().nan_to_num(nan=0.0).max()) if a.numel() else 0.0


def first_difference(alone: list[list[tuple[str, list]]], beside: list[list[tuple[str, list]]]) -> dict | None:
    """A request's passes alone against its passes first in a batch: per pass and module (in the order they
    finished), its rows of each output (the batch's first rows, as many as alone; the whole output where the shapes
    do not allow that) compared bitwise. The first pass and module that differ (``module``), the largest difference
    there, how many modules differ in that pass and the first of them; ``aligned`` is False when that module is the
    pass's first (the embedding, a lookup of tokens that were equal so far: then the rows compared were not the
    request's). None when every output is equal."""
    for index, (ours, theirs) in enumerate(zip(alone, beside)):
        differing = []
        for (name, a_tensors), (other, b_tensors) in zip(ours, theirs):
            if name != other:
                return {"pass": index, "module": name, "error": f"the modules ran in another order ({other})"}
            for a, b in zip(a_tensors, b_tensors):
                rows = b[: a.shape[0]] if a.dim() and b.dim() == a.dim() and b.shape[1:] == a.shape[1:] else b
                if not _same(a, rows):
                    differing.append((name, _gap(a, rows)))
                    break
            if len(a_tensors) != len(b_tensors) and (not differing or differing[-1][0] != name):
                differing.append((name, math.inf))
        if differing:
            return {
                "pass": index,
                "module": differing[0][0],
                "max_abs_diff": differing[0][1],
                "modules_differing": len(differing),
                "first_modules": [name for name, _ in differing[:8]],
                "aligned": differing[0][0] != ours[0][0],
            }
    return None


def locate(generate: Generate, requests: list[Request], partners: list[list[Request]]) -> list[dict]:
    """Each request alone, then first beside its partners, through :data:`RECORDER`'s hooks (beside them, only as
    many rows of each output as the request's prompt has tokens are kept: the rows compared): per request its seed,
    the batch's size, the tokens of the first (prefill) pass alone and beside, the passes of each run (an ``error``
    where their counts differ), whether its tokens differ, and :func:`first_difference`'s finding (nothing where all
    equal)."""
    results = []
    for target, others in zip(requests, partners, strict=True):
        alone, ours = RECORDER.record(generate, [target])
        rows = max((t.shape[0] for _, tensors in alone[0] for t in tensors if t.dim()), default=None)
        beside, theirs = RECORDER.record(generate, [target, *others], keep=rows)
        found = first_difference(alone, beside) or {}
        if len(alone) != len(beside):  # another pass structure (a chunked prefill): passes compared are not alike
            found = {"error": f"{len(alone)} passes alone, {len(beside)} beside", **found}
        sizes = {"batch": 1 + len(others), "prefill_tokens": [rows, RECORDER.widest[0]]}
        results.append({"seed": target.seed, **sizes, "passes": [len(alone), len(beside)],
                        "tokens_differ": ours[0] != theirs[0], **found})  # fmt: skip
    return results


def summary(results: list[dict]) -> dict[str, int]:
    """How often each module (its layer number left out: ``model.layers.N.mlp`` -> ``model.layers.*.mlp``,
    ``model.layers.N`` -> ``model.layers.*``) was the first to differ over the requests; ``none`` for a request that
    never differed."""
    import re

    counts: dict[str, int] = {}
    for result in results:
        key = re.sub(r"\.\d+(?=\.|$)", ".*", result["module"]) if result.get("module") else "none"
        counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items(), key=lambda item: -item[1]))


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
        mode = _mode(record)
        for name, counts in list(record["compositions"].items())[1:]:
            lines.append(
                f"| {_name(record)} | {mode} | {name} | {counts['responses']} / {record['requests']} | "
                f"{counts['tokens']} | {counts['logprobs']} | {counts['max_logprob_gap']:.3g} | "
                f"{UPSTREAM[record['setting']]} |"
            )
    parts = []
    if matmuls := [
        f"{r['setting']}: {_rows(r['matmul_rows_differing'])}" for r in records if "matmul_rows_differing" in r
    ]:
        parts.append("bfloat16 matmul, rows differing from the full product (after the engine): " + "; ".join(matmuls))
    linears = [
        f"{r['setting']}: "
        + "; ".join(f"{name} {_rows(counts)}" for name, counts in r["linear_rows_differing"].items())
        for r in records
        if "linear_rows_differing" in r
    ]
    if linears:
        parts.append("the model's projections (F.linear), rows differing: " + " | ".join(linears))
    if norms := [f"{r['setting']}: " + ", ".join(f"{k} {v}" for k, v in r["residual_norm_rows_differing"].items())
                 for r in records if "residual_norm_rows_differing" in r]:  # fmt: skip
        parts.append(f"the residual RMSNorm, of {NORM_ROWS[0]} rows, rows that differ inside {NORM_ROWS[1]}: "
                     + "; ".join(norms))  # fmt: skip
    if timed := [f"{_name(r)} ({_mode(r)}): " + _seconds(r["compositions"]) for r in records
                 if all("seconds" in c for c in r["compositions"].values())]:  # fmt: skip
        parts.append("seconds to generate each composition (comparable between engines that ran alone): "
                     + "; ".join(timed))  # fmt: skip
    if chosen := [f"{r['setting']}: {_chosen(r['attention'])}" for r in records if "attention" in r]:
        parts.append("the engine chose: " + "; ".join(chosen))
    return "\n\n".join(["\n".join(lines), *parts]) + "\n"


def _name(record: dict) -> str:
    """A record's setting, and its label (its file's name) where that says more."""
    label = record.get("label")
    return record["setting"] + (f" ({label})" if label and label != record["setting"] else "")


def _mode(record: dict) -> str:
    """How a record's engine generated: sampling, eager or graphs, whose residual norm ran, cuBLAS presets."""
    mode = ("greedy" if record["greedy"] else "seeded T=1") + (", eager" if record["eager"] else ", graphs")
    if record.get("norm_patched"):
        mode += ", the recipe's norm"
    else:  # records from before --norm ran vLLM's own
        mode += ", vLLM's norm" + (" (the recipe's was asked, not applied)" if record.get("norm") == "recipe" else "")
    preset = {k: v for k, v in record.get("environment", {}).items() if k.startswith("CUBLAS") and v}
    return mode + "".join(f", {k}={v}" for k, v in preset.items())


def _seconds(compositions: dict) -> str:
    return ", ".join(f"{name} {counts['seconds']:g}" for name, counts in compositions.items())


def _rows(counts: dict) -> str:
    return ", ".join(f"{m} rows: {n}" for m, n in counts.items())


def _chosen(attention: dict) -> str:
    return f"{attention['backend']} ({attention['implementation']}, FlashAttention {attention['flash_attn_version']})"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m stapo.checks.batch_invariance", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    engine = argparse.ArgumentParser(add_help=False)  # what run and locate share
    engine.add_argument("--model", type=Path, required=True, help="a Hugging Face model folder")
    engine.add_argument("--setting", choices=sorted(SETTINGS), required=True)
    engine.add_argument("--out", type=Path, required=True, help="the record (JSON)")
    engine.add_argument("--seed", type=int, default=0, help="the requests' problems and seeds")
    engine.add_argument("--greedy", action="store_true", help="temperature 0 instead of seeded sampling at T = 1")
    engine.add_argument("--norm", choices=tuple(NORMS), default="recipe",
                        help="; ".join(f"{k}: {v}" for k, v in NORMS.items()))  # fmt: skip
    run = commands.add_parser("run", parents=[engine], help="probe one setting in one engine; write its record")
    run.add_argument("--requests", type=int, default=48)
    run.add_argument("--max-tokens", type=int, default=64)
    graphs = run.add_mutually_exclusive_group()
    graphs.add_argument("--eager", dest="eager", action="store_true", default=True, help="no CUDA graphs (default)")
    graphs.add_argument("--graphs", dest="eager", action="store_false", help="CUDA graphs and torch.compile")
    find = commands.add_parser(
        "locate", parents=[engine], help="the first module where a request alone parts from a batch of two"
    )
    find.add_argument("--requests", type=int, default=8)
    find.add_argument("--max-tokens", type=int, default=16)
    find.add_argument("--partner", choices=tuple(PARTNERS), default="same",
                      help="beside whom: " + "; ".join(f"{k}: {v}" for k, v in PARTNERS.items()))  # fmt: skip
    find.set_defaults(eager=True)
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
    if problem := vllm_missing(f"batch_invariance {args.command}"):
        parser.exit(2, f"error: {problem}\n")
    choose_norm(args.norm)  # before the environment is recorded: VLLM_PLUGINS as the engine sees it
    start, environment = time.time(), {**{k: os.environ.get(k) for k in RECORDED_ENV}, **ENVIRONMENT}
    llm, engine = start_engine(args.model, args.setting, args.eager, args.norm)
    record = {
        "setting": args.setting,
        "label": args.out.stem,
        "engine": engine,
        "attention": llm.apply_model(attention_facts)[0],
        "environment": environment,
        "versions": versions(),
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "greedy": args.greedy,
        "eager": args.eager,
        "norm": args.norm,
        "norm_patched": llm.apply_model(norm_patched)[0],
    }
    requests = make_requests(args.requests, args.seed)
    if args.command == "locate":  # eager (no --graphs here): torch.compile would trace through the hooks
        record |= {"hooks": llm.apply_model(_attach_model)[0], "sampler": llm.collective_rpc(_attach_sampler)[0]}
        generate = generator(llm, args.max_tokens, args.greedy, ignore_eos=True)
        if args.partner == "same":
            partners = [[partner(r)] for r in requests]
        else:  # other lengths; the pool's prompts are other problems of the same levels
            tokenizer = llm.get_tokenizer()
            pool = make_requests(max(8 * args.requests, 4 * MANY), args.seed + 1)
            count = MANY if args.partner == "many" else 1
            partners = longer_partners(requests, pool, lambda prompt: len(tokenizer.encode(prompt)), count)
            record["no_longer_partner"] = [r.seed for r, p in zip(requests, partners) if not p]  # left out
            kept = [(r, p) for r, p in zip(requests, partners) if p]
            if not kept:
                parser.exit(2, f"error: --partner {args.partner}: no prompt of the pool is longer than any request's\n")
            requests, partners = [r for r, _ in kept], [p for _, p in kept]
        record["partner"] = args.partner
        results = locate(generate, requests, partners)
        record |= {"seconds": round(time.time() - start, 1), "first_modules": summary(results)}
        write_atomic(args.out, json.dumps(record | {"requests_located": results}, indent=1) + "\n")
        print(json.dumps(record["first_modules"]))
        return
    others = make_requests(args.requests, args.seed + 1)
    counts = probe(
        generator(llm, args.max_tokens, args.greedy), requests, others, compositions(args.requests, seed=args.seed)
    )
    config = json.loads((args.model / "config.json").read_text())
    record |= {
        "seconds": round(time.time() - start, 1),
        "compositions": counts,
        "matmul_rows_differing": matmul_rows(),
        "linear_rows_differing": linear_rows(projection_shapes(config)),
        "residual_norm_rows_differing": residual_norm_rows(config["hidden_size"]),
    }
    write_atomic(args.out, json.dumps(record, indent=1) + "\n")
    print(table([record]), end="")


if __name__ == "__main__":
    main()
