"""Runs at a model's true shape with random weights (docs/scale.md): build the model, then read a run's cost.

    python -m stapo.checks.scale model --shape qwen3_8b --tokenizer DIR --out DIR [--device cuda]
    python -m stapo.checks.scale summary METRICS.jsonl [METRICS.jsonl ...]

``model`` saves a randomly initialised Qwen3 of one of the base models' shapes (``stapo.config.QWEN3_SHAPES``)
with the given tokenizer (Qwen's real vocabulary: ``stapo.quickstart.tiny.build_qwen_tokenizer``); a random model
writes until the response limit, which stresses memory and time like the paper's long responses. ``summary`` prints,
per step of verl's file-logger JSONL, the phases' seconds, generated tokens per second, the actor's MFU and peak
memory, the driver's mask time and the mask's share of tokens.
"""

from __future__ import annotations

import argparse
from pathlib import Path

COLUMNS = (
    ("step s", "timing_s/step", "{:.1f}"),
    ("gen s", "timing_s/gen", "{:.1f}"),
    ("old log-prob s", "timing_s/old_log_prob", "{:.1f}"),
    ("update s", "timing_s/update_actor", "{:.1f}"),
    ("resp. len", "response_length/mean", "{:.0f}"),
    ("tokens", "perf/total_num_tokens", "{:.0f}"),
    ("tokens/s/GPU", "perf/throughput", "{:.0f}"),
    ("MFU actor", "perf/mfu/actor", "{:.3f}"),
    ("peak GB", "actor/perf/max_memory_allocated_gb", "{:.1f}"),
    ("driver mask s", "timing_s/stapo_mask", "{:.3f}"),
    ("masked", "stapo/masked_frac", "{:.4f}"),
)
"""(header, verl metric, format) of the summary table; a metric a run did not log shows as "–"."""


def build(shape: str, tokenizer: Path, out: Path, device: str | None) -> Path:
    from transformers import AutoTokenizer

    from stapo.config import QWEN3_SHAPES
    from stapo.quickstart.tiny import build_model

    build_model(AutoTokenizer.from_pretrained(tokenizer), out, device=device, **QWEN3_SHAPES[shape])
    return out


def build_on_gpu(shape: str, tokenizer: Path, out: Path) -> Path:
    """:func:`build` on the GPU in a process of its own (``python -m stapo.checks.scale model --device cuda``), so that
    the caller, the driver of a run on that GPU, holds no GPU memory."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "stapo.checks.scale", "model", "--shape", shape, "--tokenizer", str(tokenizer)]
    subprocess.run([*cmd, "--out", str(out), "--device", "cuda"], check=True)
    return out


def summary(paths: list[Path]) -> str:
    """A Markdown table, one row per step of each run."""
    from stapo.tools.curves import read_metrics

    lines = ["| run | step | " + " | ".join(h for h, _, _ in COLUMNS) + " |", "|---" * (len(COLUMNS) + 2) + "|"]
    for path in paths:
        metrics = read_metrics(path)
        for step in sorted(metrics.get("timing_s/step", {})):
            cells = [fmt.format(metrics[key][step]) if step in metrics.get(key, {}) else "–" for _, key, fmt in COLUMNS]
            lines.append(f"| {path.parent.name} | {step} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m stapo.checks.scale", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    model = sub.add_parser("model")
    model.add_argument("--shape", required=True, help="qwen3_0.6b, qwen3_1.7b, qwen3_8b or qwen3_14b")
    model.add_argument("--tokenizer", type=Path, required=True, help="Hugging Face tokenizer folder")
    model.add_argument("--out", type=Path, required=True)
    model.add_argument("--device", help="cuda: initialise on the GPU (saved in bfloat16)")
    table = sub.add_parser("summary")
    table.add_argument("metrics", type=Path, nargs="+", help="verl file-logger JSONL (VERL_FILE_LOGGER_PATH)")
    args = parser.parse_args(argv)
    if args.what == "model":
        import torch

        from stapo.config import QWEN3_SHAPES
        from stapo.tools.io import output_problem

        problems = [] if args.shape in QWEN3_SHAPES else [f"--shape {args.shape}: one of {', '.join(QWEN3_SHAPES)}"]
        if not (args.tokenizer / "tokenizer_config.json").is_file():
            problems.append(f"--tokenizer {args.tokenizer}: no tokenizer_config.json in it; pass a tokenizer folder")
        if args.device not in (None, "cpu", "cuda"):
            problems.append(f"--device {args.device}: cpu or cuda")
        elif args.device == "cuda" and not torch.cuda.is_available():
            problems.append("--device cuda: no CUDA GPU is visible here; leave --device out to build on the CPU")
        problems += [p for p in [output_problem(args.out, "folder")] if p]
        if problems:
            parser.exit(2, "".join(f"error: {p}\n" for p in problems))
        print(build(args.shape, args.tokenizer, args.out, args.device))
        return
    from stapo.tools.curves import ReportError

    try:
        print(summary(args.metrics))
    except ReportError as error:
        parser.exit(2, f"error: {error}\n")


if __name__ == "__main__":
    main()
