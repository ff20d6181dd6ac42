"""What a reproduction costs: a step-time model fitted to the recipe's measured steps, projected to the paper's runs.

    python -m stapo.tools.cost measure [--evidence evidence] [--check]
    python -m stapo.tools.cost fit
    python -m stapo.tools.cost project --size qwen3_8b --nodes 2 [--gpu h100 --gpus-per-node 8 --method stapo
        --steps 3000 --prompts 256 --n 8 --prompt-length 200 --length-start 1000 --length-end 6000 --max-length 15360]
    python -m stapo.tools.cost project --size qwen3_1.7b --mode colocate_async
    python -m stapo.tools.cost table [--nodes 1 2 4]

A step is four stages (verl's ``timing_s``), each with a small physical model and one or two constants fitted to the
steps of the project's records (``measured_steps.json``, generated from ``evidence/`` by ``cost measure``: each run
folder there with its ``scripts/train.sh`` arguments in ``args.txt``; docs/scale.md):

* **generation** (vLLM, memory-bound decoding): each rollout engine of ``tp`` GPUs decodes its share of B responses
  of mean length L after prompts of P tokens. A decode step reads the weights once, ``k_w · weights / (tp · BW)``,
  and every token's key-value cache read so far, ``k_kv · kv_bytes · context / (tp · BW)``. The engine holds
  ``c = min(B, KV capacity / (P + L))`` sequences at once, so it takes ``B·L/c + (L_max − L)`` decode steps (the
  last sequence runs to ``L_max``) and reads ``B · L · (P + L/2)`` cached tokens in all.
* **old log-probs** and **update** (FSDP, compute-bound): the step's FLOPs as verl's ``FlopsCounter`` counts them
  (forward = a third of forward + backward), over ``G · peak · MFU``, with the MFU a linear function of the log of the
  model's parameters, fitted per stage.
* **other** (weight sync to vLLM, the driver, rewards): ``c0 + c1 · parameters``.

verl's asynchronous trainers overlap these stages (:func:`mode_seconds`, docs/trainer-modes.md): ``colocate_async``
generates each batch together with the next, ``separate_async`` generates on GPUs of its own while the rest train.
Their measured steps are not fitted: ``fit`` shows the model's step against each.

A constant the records cannot tell apart is not fitted apart: runs of one shape give one generation factor for both
reads, runs of one size a flat MFU and ``other``; ``project`` and ``table`` answer only for sizes between the records'
smallest and largest (more GPUs or another GPU kind than measured are projected from the same constants).

GRPO adds a reference-policy forward (as long as the old log-probs); STAPO and 20-Entropy add the driver's mask, its
seconds a step as the records measured it (the records' batches are smaller than the paper's). ``fit`` prints every
measured stage next to the model's value; ``project`` and ``table`` take the paper's settings (3,000 steps of 256
prompts × 8) with the response length growing linearly from ``--length-start`` to ``--length-end`` (an assumption:
the paper shows its curves, not their values).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from types import MappingProxyType

import numpy as np

from stapo.config import CONFIG_DIR, QWEN3_SHAPES, TRAINER_MODES, methods, sizes
from stapo.tools.io import number_problems, output_problem, write_atomic

MEASURED = Path(__file__).with_name("measured_steps.json")
GPUS = {  # datasheet: HBM bandwidth (B/s), memory (bytes), dense bf16 (FLOP/s, verl's FlopsCounter table)
    "h100": {"bandwidth": 3.35e12, "memory": 80e9, "peak": 989e12},
    "h200": {"bandwidth": 4.8e12, "memory": 141e9, "peak": 989e12},
}
STAGES = ("generation", "old_log_prob", "update", "other")
TIMINGS = {"generation": "timing_s/gen", "old_log_prob": "timing_s/old_log_prob", "update": "timing_s/update_actor",
           "step": "timing_s/step"}  # fmt: skip
"""verl 0.9.1's step timers a row of ``measured_steps.json`` averages (each must be logged)."""
OPTIONAL = {"mask": ("timing_s/stapo_mask", "timing_s/stapo_restore"), "ref": ("timing_s/ref",)}
"""Timers summed where logged: the driver's mask (inside the update timer), GRPO's reference forward (its own)."""
SEPARABLE = 0.05
"""The smallest ratio of the column-scaled generation terms' singular values at which the fit separates the weight and
key-value factors: runs of nearly one shape (a random model writes every response to its limit) would otherwise give
factors of opposite signs that cancel, and nonsense away from that shape."""
LENGTHS = ("prompt_length/mean", "response_length/mean", "response_length/max")
UNMASKED = ("justrl", "grpo")
"""Methods without the driver's mask (their ``timing_s/stapo_mask``, where ``stapo.metrics`` logs it, observes)."""
MODES = tuple(TRAINER_MODES.values())
"""verl 0.9.1's trainer modes that the recipe's ``trainer.v1.trainer_mode`` values extend: sync first."""


@dataclass(frozen=True)
class Shape:
    """What one step's work is: model size, hardware, parallelism and the step's sequences."""

    size: str
    gpu: str
    gpus: int
    tp: int
    gpu_memory_utilization: float
    responses: int
    prompt_length: float
    response_length: float
    max_response_length: float | None = None  # the longest response of the step (default: the mean)

    @property
    def tail(self) -> float:
        return max((self.max_response_length or self.response_length) - self.response_length, 0.0)


@functools.cache
def qwen3_sizes() -> list[str]:
    """The size files of the paper's Qwen3 models (the cost model knows their shapes), e.g. not smollm2_135m."""
    return [size for size in sizes() if size in QWEN3_SHAPES]


@functools.cache
def model_facts(size: str) -> MappingProxyType:
    """Parameters (tied embeddings once), weight bytes (bfloat16), key-value bytes per token and the config of a
    Qwen3 shape; the parameters are counted on a model built on the ``meta`` device (no memory), once per size."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    shape = QWEN3_SHAPES[size]
    config = Qwen3Config(**shape)
    with torch.device("meta"):
        parameters = sum(p.numel() for p in Qwen3ForCausalLM(config).parameters())
    return MappingProxyType(
        {  # cached: read-only
            "parameters": parameters,
            "weight_bytes": 2 * parameters,
            "kv_bytes": 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * shape["head_dim"] * 2,
            "config": config,
        }
    )


def train_flops(shape: Shape) -> float:
    """Forward + backward FLOPs of the step's sequences, as verl counts them."""
    from verl.utils.flops_counter import ESTIMATE_FUNC  # FlopsCounter itself asks the GPU for its peak

    config = model_facts(shape.size)["config"]
    lengths = [round(shape.prompt_length + shape.response_length)] * shape.responses
    return ESTIMATE_FUNC[config.model_type](config, sum(lengths), lengths, 1.0) * 1e12


def generation_terms(shape: Shape) -> tuple[float, float]:
    """Seconds of weight reads and of key-value reads per engine at the datasheet bandwidth (the model's two terms
    before the fitted factors)."""
    facts, gpu = model_facts(shape.size), GPUS[shape.gpu]
    engines = shape.gpus // shape.tp
    per_engine = shape.responses / engines
    bandwidth = shape.tp * gpu["bandwidth"]
    capacity = (shape.gpu_memory_utilization * gpu["memory"] * shape.tp - facts["weight_bytes"]) / facts["kv_bytes"]
    concurrent = max(min(per_engine, capacity / (shape.prompt_length + shape.response_length)), 1.0)
    decode_steps = per_engine * shape.response_length / concurrent + shape.tail
    cached = per_engine * shape.response_length * (shape.prompt_length + shape.response_length / 2)
    return facts["weight_bytes"] / bandwidth * decode_steps, facts["kv_bytes"] / bandwidth * cached


@dataclass(frozen=True)
class Fit:
    k_w: float
    k_kv: float
    mfu: dict  # stage -> (a, b): MFU = a + b · ln(parameters / 1e9)
    other: tuple[float, float]  # seconds = c0 + c1 · parameters / 1e9
    mask: float  # the driver's mask and restore, seconds a step (inside verl's update timer)
    sizes: tuple[str, ...]  # the sizes of the records fitted: projections stay between their smallest and largest

    def stage_seconds(self, shape: Shape) -> dict[str, float]:
        weights, kv = generation_terms(shape)
        flops, billions = train_flops(shape), model_facts(shape.size)["parameters"] / 1e9
        peak = shape.gpus * GPUS[shape.gpu]["peak"]
        seconds = {"generation": self.k_w * weights + self.k_kv * kv}
        for stage, share in (("old_log_prob", 1 / 3), ("update", 1.0)):
            a, b = self.mfu[stage]
            seconds[stage] = share * flops / (peak * (a + b * math.log(billions)))
        seconds["other"] = self.other[0] + self.other[1] * billions
        return seconds

    def covers(self, size: str) -> bool:
        """Whether ``size`` lies between the smallest and the largest model the fit has records of."""
        counts = [model_facts(s)["parameters"] for s in self.sizes]
        return min(counts) <= model_facts(size)["parameters"] <= max(counts)


class NoRecord(ValueError):
    """What the cost model is asked has no record to rest on: no measured steps, or a size outside them."""


def gpu_kind(name: str | None) -> str:
    """The :data:`GPUS` key of a card's GPU name (``NVIDIA H100 80GB HBM3`` -> ``h100``)."""
    found = [kind for kind in GPUS if kind in str(name).lower().replace(" ", "")]
    if len(found) != 1:
        raise NoRecord(f"GPU {name!r}: the cost model knows {', '.join(GPUS)}")
    return found[0]


def run_row(folder: Path, gpu: str, evidence: Path) -> dict:
    """A row of ``measured_steps.json`` from one run folder of a record: the shape from the config its ``args.txt``
    composes (``scripts/train.sh`` METHOD SIZE OVERRIDES..., one a line), ``gpu`` from the record's card, the lengths
    and every stage's seconds averaged over the steps after the first (the first pays first use). ``gpus`` counts the
    rollout's own GPUs too in ``separate_async`` (``rollout_gpus``)."""
    from hydra import compose, initialize_config_dir

    from stapo.tools.curves import mean_over, read_metrics

    method, size, *overrides = (folder / "args.txt").read_text().splitlines()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        config = compose(method, [f"size={size}", *overrides])
    rollout = config.actor_rollout_ref.rollout
    gz = folder / "metrics.jsonl.gz"
    metrics = read_metrics(gz if gz.is_file() else folder / "metrics.jsonl")
    steps = sorted(metrics.get(TIMINGS["step"], {}))[1:]
    if not steps:
        raise NoRecord(f"{folder}: fewer than two steps logged; nothing to average")
    missing = [key for key in (*TIMINGS.values(), *LENGTHS) if not set(steps) <= set(metrics.get(key, {}))]
    if missing:
        raise NoRecord(f"{folder}: {missing[0]} is not logged at every step after the first")
    mode, gpus = (
        TRAINER_MODES[config.trainer.v1.trainer_mode],
        int(config.trainer.nnodes * config.trainer.n_gpus_per_node),
    )
    own = int(rollout.nnodes * rollout.n_gpus_per_node) if mode == "separate_async" else 0
    responses = int(config.data.train_batch_size * rollout.n)
    mean = {key: mean_over(metrics[key], steps) for key in (*TIMINGS.values(), *LENGTHS)}
    seconds = {f"{stage}_s": round(mean[key], 3) for stage, key in TIMINGS.items()}
    for stage, keys in OPTIONAL.items():
        seconds[f"{stage}_s"] = round(sum(mean_over(metrics[key], steps) for key in keys if key in metrics), 3)
    return {
        "name": f"{size}, {gpus}{f' + {own}' if own else ''} x {gpu.upper()}, {responses} x "
                f"{mean['response_length/mean']:,.0f}",
        "mode": mode, "method": config.recipe.method, "size": size, "gpu": gpu, "gpus": gpus + own,
        **({"rollout_gpus": own} if own else {}), "tp": int(rollout.tensor_model_parallel_size),
        "gpu_memory_utilization": float(rollout.gpu_memory_utilization), "responses": responses,
        "prompt_length": round(mean["prompt_length/mean"], 1),
        "response_length": round(mean["response_length/mean"], 1),
        "max_response_length": round(mean["response_length/max"], 1),
        **seconds, "steps": f"{steps[0]}-{steps[-1]}", "record": folder.relative_to(evidence).as_posix(),
    }  # fmt: skip


def _finished_at_qwen3(run: Path) -> bool:
    """Whether a run folder ended with exit code 0 at a Qwen3 size (its ``args.txt``'s second line)."""
    code, args = run / "exit_code", (run / "args.txt").read_text().splitlines()
    return code.is_file() and code.read_text().strip() == "0" and len(args) > 1 and args[1] in QWEN3_SHAPES


def measure(evidence: Path) -> dict:
    """``measured_steps.json`` from the records in ``evidence``: a row per run folder with ``args.txt`` and exit code 0
    below a record's ``card.json``, at a Qwen3 shape (the model knows no other)."""
    rows = []
    for card in sorted(evidence.glob("*/card.json")):
        runs = [args.parent for args in sorted(card.parent.rglob("args.txt")) if _finished_at_qwen3(args.parent)]
        if runs:
            try:
                gpu = gpu_kind(json.loads(card.read_text()).get("gpu"))
            except NoRecord as error:
                raise NoRecord(f"{card}: {error}") from None
            rows += [run_row(run, gpu, evidence) for run in runs]
    about = (
        "Generated by `python -m stapo.tools.cost measure` from the records in evidence/ (each row's `record`); do "
        "not edit. Seconds a step, averaged over each run's steps after the first; `mask_s`: the driver's mask and "
        "restore, inside `update_s`. The cost model fits the `sync` rows and shows the others against it."
    )
    return {"about": about, "runs": rows}


def load_runs(path: Path | None = None) -> list[tuple[Shape, dict]]:
    """Every measured run: its shape and its row; the stages' seconds as the model splits them (``update`` without
    the driver's mask, which :func:`step_seconds` adds for the methods that mask; ``other``: step − the three, the
    mask and GRPO's reference forward, which :func:`step_seconds` models as a second old-log-prob pass)."""
    out = []
    for row in json.loads((path or MEASURED).read_text())["runs"]:
        seconds = {"generation": row["generation_s"], "old_log_prob": row["old_log_prob_s"],
                   "update": row["update_s"] - row["mask_s"]}  # fmt: skip
        seconds["other"] = row["step_s"] - row["mask_s"] - row["ref_s"] - sum(seconds.values())
        out.append((row_shape(row), {**row, **seconds, "step": row["step_s"]}))
    return out


def load_measured(path: Path | None = None) -> list[tuple[Shape, dict]]:
    """The runs the model is fitted to: those of verl's synchronous trainer."""
    return [(shape, row) for shape, row in load_runs(path) if row["mode"] == "sync"]


def load_modes(path: Path | None = None) -> list[tuple[Shape, dict]]:
    """The runs of verl's asynchronous trainers, not fitted (``fit`` shows the model's step against each)."""
    return [(shape, row) for shape, row in load_runs(path) if row["mode"] != "sync"]


def row_shape(row: dict) -> Shape:
    """The shape of a row of ``measured_steps.json``."""
    return Shape(**{k: row[k] for k in Shape.__dataclass_fields__ if k in row})


def _line(x: list[float], y: list[float]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line, flat (the mean) where ``x`` has one value only."""
    if len(set(x)) < 2:
        return float(np.mean(y)), 0.0
    slope, intercept = np.polyfit(x, y, 1)
    return float(intercept), float(slope)


def fit(measured: list[tuple[Shape, dict]]) -> Fit:
    """Least squares: the two generation factors on relative error (one factor for both unless the runs' two terms
    are far from proportional, :data:`SEPARABLE`, and both factors come out positive), the MFU lines on the MFUs the
    measured times imply, the ``other`` line on seconds, the mask as the mean of the runs that mask."""
    if not measured:
        raise NoRecord("no measured steps of verl's synchronous trainer")
    terms = np.array([generation_terms(s) for s, _ in measured])
    relative = terms / np.array([m["generation"] for _, m in measured])[:, None]
    k_w = k_kv = float(np.mean(1 / relative.sum(axis=1)))  # one factor, unless the runs tell the two apart:
    if len(measured) > 1:
        singular = np.linalg.svd(relative / np.linalg.norm(relative, axis=0), compute_uv=False)
        both = np.linalg.lstsq(relative, np.ones(len(relative)), rcond=None)[0]
        if singular[-1] / singular[0] > SEPARABLE and both.min() > 0:
            k_w, k_kv = (float(k) for k in both)
    billions = [model_facts(s.size)["parameters"] / 1e9 for s, _ in measured]
    mfu = {}
    for stage, share in (("old_log_prob", 1 / 3), ("update", 1.0)):
        implied = [share * train_flops(s) / (s.gpus * GPUS[s.gpu]["peak"] * m[stage]) for s, m in measured]
        mfu[stage] = _line([math.log(b) for b in billions], implied)
    masks = [m["mask_s"] for _, m in measured if m["method"] not in UNMASKED]
    sizes = sorted({s.size for s, _ in measured}, key=lambda size: model_facts(size)["parameters"])
    other = _line(billions, [m["other"] for _, m in measured])
    return Fit(k_w, k_kv, mfu, other, float(np.mean(masks)) if masks else 0.0, tuple(sizes))


@functools.cache
def fitted() -> Fit:
    return fit(load_measured())


def step_seconds(fit_: Fit, shape: Shape, method: str) -> dict[str, float]:
    """One step of ``method``: the stages, GRPO's reference forward and the masks' driver time included."""
    seconds = fit_.stage_seconds(shape)
    if method == "grpo":
        seconds["old_log_prob"] *= 2  # the reference policy's forward, as long as the old policy's
    if method not in ("justrl", "grpo"):
        seconds["update"] += fit_.mask
    return seconds


class NoTrainerGPUs(ValueError):
    """``separate_async`` on no more GPUs than its rollout's TP: none would be left to train."""


def rollout_splits(shape: Shape, gpus_per_node: int | None = None) -> list[int]:
    """The numbers R of rollout GPUs ``separate_async`` can have beside G − R trainer GPUs, as verl places them
    (``actor_rollout_ref.rollout.nnodes`` × ``n_gpus_per_node``): multiples of the rollout's TP within one node, whole
    nodes across several (``gpus_per_node``; default: all of G on one node)."""
    per_node = gpus_per_node or shape.gpus
    step = shape.tp if shape.gpus <= per_node else per_node
    splits = list(range(step, shape.gpus, step))
    if not splits:
        raise NoTrainerGPUs(
            f"separate_async: {shape.gpus} GPU(s) leave none to train beside a rollout of TP {shape.tp}"
        )
    return splits


def mode_seconds(fit_: Fit, shape: Shape, method: str, mode: str = "sync", rollout: int | None = None) -> dict:
    """One step of ``method`` in verl's trainer ``mode``, as stages that add up to the step (docs/trainer-modes.md):

    * ``sync``: generation, old log-probs, update and the rest, one after another;
    * ``colocate_async``: vLLM generates each batch together with the next (verl's ``num_warmup_batches`` 1 with
      partial rollouts), so a step's generation is half of generating 2B responses at once: shorter where decoding
      is latency-bound (few sequences an engine), no shorter where the KV cache already holds all it can;
    * ``separate_async``: ``rollout`` of the G GPUs generate while the other G − R train, so a step takes the longer
      of the two plus the rest (``generation`` is the part the training does not hide); without ``rollout``, the R of
      :func:`rollout_splits` that makes this step shortest. The rollout GPUs keep the size file's memory share.

    The measured steps of each mode (``cost fit``) are not fitted; the two asynchronous forms were written with them
    in view (one shape, one cycle or step each).
    """
    if mode == "separate_async":
        if rollout is None:
            splits = [mode_seconds(fit_, shape, method, mode, r) for r in rollout_splits(shape)]
            return min(splits, key=lambda split: sum(split.values()))
        seconds = step_seconds(fit_, replace(shape, gpus=shape.gpus - rollout), method)
        generation = fit_.stage_seconds(replace(shape, gpus=rollout))["generation"]
        seconds["generation"] = max(0.0, generation - seconds["old_log_prob"] - seconds["update"])
        return seconds
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}: one of {', '.join(MODES)}")
    seconds = step_seconds(fit_, shape, method)
    if mode == "colocate_async":
        seconds["generation"] = fit_.stage_seconds(replace(shape, responses=2 * shape.responses))["generation"] / 2
    return seconds


def size_shape(size: str, nodes: int, gpus_per_node: int, gpu: str, prompts: int, n: int, prompt_length: float,
               response_length: float, max_length: float) -> Shape:  # fmt: skip
    """The shape of a paper step at ``size`` with its size file's rollout parallelism and memory share."""
    from omegaconf import OmegaConf

    rollout = OmegaConf.load(CONFIG_DIR / "size" / f"{size}.yaml").actor_rollout_ref.rollout
    tp, share = int(rollout.tensor_model_parallel_size), float(rollout.gpu_memory_utilization)
    return Shape(size, gpu, nodes * gpus_per_node, tp, share, prompts * n, prompt_length, response_length, max_length)


def project(
    args: argparse.Namespace, size: str, nodes: int, method: str, samples: int = 25, mode: str = "sync"
) -> dict:
    """Hours, GPU-hours and stage shares of a run in trainer ``mode`` whose mean response length grows linearly over
    its steps (the step time averaged over ``samples`` points of the run)."""
    fit_ = fitted()
    if not fit_.covers(size):
        raise NoRecord(f"{size}: no record at or beyond this size (records: {', '.join(fit_.sizes)})")
    lengths = np.linspace(args.length_start, args.length_end, samples)
    shapes = [size_shape(size, nodes, args.gpus_per_node, args.gpu, args.prompts, args.n, args.prompt_length,
                         float(length), max(args.max_length, float(length))) for length in lengths]  # fmt: skip
    # separate_async: one split of the GPUs for the whole run, the one with the shortest mean step
    splits = rollout_splits(shapes[0], args.gpus_per_node) if mode == "separate_async" else [None]
    runs = {r: [mode_seconds(fit_, s, method, mode, r) for s in shapes] for r in splits}
    rollout = min(runs, key=lambda r: sum(sum(step.values()) for step in runs[r]))
    per_step = runs[rollout]
    mean = {stage: float(np.mean([p[stage] for p in per_step])) for stage in STAGES}
    step = sum(mean.values())
    hours = step * args.steps / 3600
    return {
        "size": size, "method": method, "mode": mode, "nodes": nodes, "gpus": shapes[0].gpus, "gpu": args.gpu,
        **({"rollout_gpus": rollout} if rollout else {}),
        "step_s_first": sum(per_step[0].values()), "step_s_last": sum(per_step[-1].values()), "step_s_mean": step,
        "hours": hours, "gpu_hours": hours * shapes[0].gpus,
        "shares": {stage: mean[stage] / step for stage in STAGES},
    }  # fmt: skip


def fit_report(fit_: Fit) -> str:
    """The fitted constants, and each measured stage against the model fitted to all runs (in-sample) and to the
    other runs only (leave one out: how far the model is from a run it has not seen; where there are two or more);
    then each asynchronous run's step against the model's."""
    measured = load_measured()
    held_out = [fit(measured[:i] + measured[i + 1 :]) if len(measured) > 1 else None for i in range(len(measured))]
    lines = [
        f"Fitted to {len(measured)} run(s) of verl's synchronous trainer, sizes {', '.join(fit_.sizes)} "
        f"({MEASURED.name}, generated from evidence/ by `cost measure`).",
        f"generation: k_w {fit_.k_w:.3f}, k_kv {fit_.k_kv:.3f} (times the datasheet-bandwidth bound); MFU "
        + ", ".join(f"{stage} {a:.3f} + {b:.3f}·ln(B params)" for stage, (a, b) in fit_.mfu.items())
        + f"; other {fit_.other[0]:.2f} s + {fit_.other[1]:.3f} s per B params; the driver's mask {fit_.mask:.3f} s",
        "| run | record | stage | measured (s) | model (s) | error | model without this run (s) | error |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for (shape, seconds), other in zip(measured, held_out):
        models = [{**f.stage_seconds(shape), "step": sum(step_seconds(f, shape, seconds["method"]).values())}
                  if f else None for f in (fit_, other)]  # fmt: skip
        for stage in (*STAGES, "step"):
            cells = " | ".join(
                f"{m[stage]:.1f} | {(m[stage] - seconds[stage]) / seconds[stage]:+.0%}" if m else "– | –"
                for m in models
            )
            lines.append(f"| {seconds['name']} | {seconds['record']} | {stage} | {seconds[stage]:.1f} | {cells} |")
    lines += ["", "verl's asynchronous trainers, measured (not fitted):"]
    lines += ["| run | record | mode | measured (s) | model (s) | error |", "|---|---|---|---:|---:|---:|"]
    for shape, row in load_modes():
        model = sum(mode_seconds(fit_, shape, row["method"], row["mode"], row.get("rollout_gpus")).values())
        lines.append(f"| {row['name']} | {row['record']} | {row['mode']} | {row['step_s']:.1f} | {model:.1f} | "
                     f"{(model - row['step_s']) / row['step_s']:+.0%} |")  # fmt: skip
    return "\n".join(lines)


def mode_hours(args: argparse.Namespace, size: str, nodes: int, mode: str) -> str:
    """STAPO's hours in trainer ``mode`` as a table cell; "–" where the mode cannot run (separate_async on no more
    GPUs than the rollout's TP)."""
    try:
        return f"{project(args, size, nodes, 'stapo', mode=mode)['hours']:.0f}"
    except NoTrainerGPUs:
        return "–"


def table(args: argparse.Namespace) -> str:
    """Rows: size × nodes; hours of each method of the paper's main table, and STAPO's step, GPU-hours and stages."""
    order = ("grpo", "entropy20", "justrl", "stapo")
    fit_ = fitted()
    measured = sorted({(s.gpu, s.gpus) for s, _ in load_measured()})
    lines = [
        f"A projection from records: the step model is fitted to runs of {', '.join(fit_.sizes)} on "
        + ", ".join(f"{gpus} x {gpu.upper()}" for gpu, gpus in measured)
        + " (cost fit); other GPU counts and kinds are projected, not measured.",
        f"{args.steps} steps × {args.prompts} prompts × {args.n}; mean response {args.length_start:g} → "
        f"{args.length_end:g} tokens, longest {args.max_length:g} every step, prompts {args.prompt_length:g}; "
        f"{args.gpus_per_node} × {args.gpu.upper()} a node",
        "| size | nodes | STAPO step (s), first → last | hours: GRPO | 20-Entropy | JustRL | STAPO | STAPO GPU-hours "
        "| share of STAPO's step: generation | old log-probs | update | STAPO hours: colocate_async | separate_async |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for size in filter(fit_.covers, qwen3_sizes()):
        for nodes in args.nodes:
            runs = {method: project(args, size, nodes, method) for method in order}
            stapo = runs["stapo"]
            hours = " | ".join(f"{runs[m]['hours']:.0f}" for m in order)
            shares = " | ".join(f"{100 * stapo['shares'][s]:.0f} %" for s in STAGES[:3])
            modes = " | ".join(mode_hours(args, size, nodes, mode) for mode in MODES[1:])
            lines.append(
                f"| {size} | {nodes} | {stapo['step_s_first']:.0f} → {stapo['step_s_last']:.0f} | {hours} | "
                f"{stapo['gpu_hours']:,.0f} | {shares} | {modes} |"
            )
    missing = [size for size in qwen3_sizes() if not fit_.covers(size)]
    if missing:
        lines.append(f"Not projected: {', '.join(missing)}, no record at or beyond these sizes (docs/scale.md says how "
                     "to add one).")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m stapo.tools.cost", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    measure_ = commands.add_parser("measure", help=f"write {MEASURED.name} from the records in --evidence")
    measure_.add_argument("--evidence", type=Path, default=Path("evidence"), help="the records' folder")
    measure_.add_argument("--out", type=Path, default=None, help=f"default: {MEASURED} (the package's)")
    measure_.add_argument("--check", action="store_true", help="write nothing; exit 1 if --out differs")
    commands.add_parser("fit", help="the measured steps against the fitted model")
    project_ = commands.add_parser("project", help="one run: step time, hours, GPU-hours, stage shares")
    table_ = commands.add_parser("table", help="every method and size of the paper's main table")
    project_.add_argument("--size", choices=qwen3_sizes(), required=True)
    project_.add_argument("--nodes", type=int, default=1)
    project_.add_argument("--method", choices=methods(), default="stapo")
    project_.add_argument("--mode", choices=MODES, default="sync", help="verl's trainer mode (docs/trainer-modes.md)")
    table_.add_argument("--nodes", type=int, nargs="+", default=[1, 2, 4])
    for command in (project_, table_):
        command.add_argument("--gpu", choices=sorted(GPUS), default="h100")
        command.add_argument("--gpus-per-node", type=int, default=8)
        command.add_argument("--steps", type=int, default=3000, help="paper: 3,000")
        command.add_argument("--prompts", type=int, default=256, help="prompts a step (paper: 256)")
        command.add_argument("--n", type=int, default=8, help="responses a prompt (paper: 8)")
        command.add_argument("--prompt-length", type=float, default=200, help="mean prompt tokens (assumed)")
        command.add_argument("--length-start", type=float, default=1000, help="mean response tokens at step 1")
        command.add_argument("--length-end", type=float, default=6000, help="mean response tokens at the last step")
        command.add_argument("--max-length", type=float, default=15360, help="longest response a step (paper: 15,360)")
    args = parser.parse_args(argv)
    try:
        run(parser, args)
    except NoRecord as error:
        parser.exit(2, f"error: {error}; the model rests on records: run scripts/gpu/modes.sh (or any run folder with "
                       "its args.txt) on a GPU, keep it in evidence/ and run `python -m stapo.tools.cost measure` "
                       "(docs/scale.md)\n")  # fmt: skip


def run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.command == "measure":
        if not args.evidence.is_dir():
            parser.exit(2, f"error: --evidence {args.evidence}: not a folder; the records' folder (evidence/)\n")
        args.out = args.out or MEASURED
        if problem := output_problem(args.out, "file"):
            parser.exit(2, f"error: {problem}\n")
        text = json.dumps(measure(args.evidence), indent=1) + "\n"
        if args.check:
            if not args.out.is_file() or args.out.read_text() != text:
                parser.exit(1, f"error: {args.out} is not what the records give; run without --check to write it\n")
            print(f"{args.out}: as the records give ({len(json.loads(text)['runs'])} runs)")
            return
        write_atomic(args.out, text)
        print(f"{args.out}: {len(json.loads(text)['runs'])} runs")
        return
    if args.command == "fit":
        print(fit_report(fitted()))
        return
    lengths = ("prompt_length", "length_start", "length_end", "max_length")
    bad = number_problems(args, positive=("nodes", "steps", "prompts", "n", "gpus_per_node", *lengths))
    if not bad and args.max_length < max(args.length_start, args.length_end):
        bad.append(f"--max-length {args.max_length:g}: must be at least --length-start and --length-end")
    if bad:
        parser.exit(2, "".join(f"error: {problem}\n" for problem in bad))
    if args.command == "project":
        try:
            result = project(args, args.size, args.nodes, args.method, mode=args.mode)
        except NoTrainerGPUs as error:
            parser.exit(2, f"error: --mode {error}; give more --gpus-per-node or --nodes\n")
        print(json.dumps(result, indent=1))
    else:
        print(table(args))


if __name__ == "__main__":
    main()
