"""A format warm-up of a pretrained chat model on worked word problems, saved after each of several step counts.

    python -m stapo.quickstart.warmup --model DIR --out DIR --steps 25 50 100 [--levels 1 2 3 4 5]
        [--problems 4000] [--exclude FILE ...] [--lr 1e-5] [--batch-size 16] [--seed 0]

SmolLM2-135M-Instruct answers the ``word`` task's problems in readable steps but almost never in the boxed form the
reward reads, so its sampled accuracy is near 0 % and GRPO has no signal. A short supervised warm-up on worked
solutions (:func:`stapo.quickstart.task.word_problem`, several wordings per sentence) teaches the form; its length
sets the starting accuracy, which the probe (:mod:`stapo.tools.probe`) measures on every saved model. Problems whose
question appears in an ``--exclude`` task file (the RL train and validation splits) are left out. Each ``OUT/step-K``
is a Hugging Face folder (the model after K steps: one-cycle rounds of the increments between the step counts,
:func:`stapo.quickstart.run.warmup`); ``OUT/warmup.json`` holds the settings and every step's loss.
"""

from __future__ import annotations

import argparse
import copy
import json
import shutil
from pathlib import Path

import torch

from stapo.quickstart import task
from stapo.quickstart.run import warmup
from stapo.tools.io import (
    DataFileError,
    follow_umask,
    model_folder_problems,
    number_problems,
    output_problem,
    parquet_columns,
    read_parquet,
    write_atomic,
)


def excluded_questions(paths: list[Path]) -> set[str]:
    """The problem texts of verl task files (the user turn up to the instruction)."""
    rows = [row for path in paths for row in read_parquet(path, "a task parquet", ["prompt"])]
    return {row["prompt"][-1]["content"].split("\n\n")[0] for row in rows}


def warmup_problems(levels: list[int], count: int, seed: int, exclude: set[str]) -> list[task.ArithProblem]:
    """``count`` distinct problems, levels in turn, none of whose question is in ``exclude``."""
    problems = task.distinct_word_problems(seed, levels, count, exclude)
    if len(problems) < count:
        raise ValueError(f"levels {levels} gave {len(problems)} new problems, fewer than --problems {count}")
    return problems


def save_bfloat16(model, tokenizer, folder: Path) -> None:
    """Save a copy of the float32 model in bfloat16, as the pretrained folder holds it (what verl and vLLM load), and
    the tokenizer; the model in memory keeps its float32 weights for the next round. The folder appears whole (written
    beside it, then renamed), so that a reader waiting for it (a probe of each saved model) never loads half of one."""
    partial = folder.with_name(f".{folder.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    copy.deepcopy(model).to(torch.bfloat16).save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    follow_umask(partial)
    shutil.rmtree(folder, ignore_errors=True)
    partial.rename(folder)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m stapo.quickstart.warmup", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="a Hugging Face model folder (a chat model)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, nargs="+", required=True, help="save after these many steps")
    parser.add_argument("--levels", type=int, nargs="+", default=sorted(task.WORD_LEVELS))
    parser.add_argument("--problems", type=int, default=4000)
    parser.add_argument("--exclude", type=Path, nargs="*", default=[], help="task files whose problems to leave out")
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    problems = model_folder_problems(args.model)
    for path in args.exclude:
        try:
            parquet_columns(path, "a task file (python -m stapo.quickstart.task)")
        except DataFileError as error:
            problems.append(f"--exclude {error}")
    problems += number_problems(args, positive=("problems", "lr", "batch_size"))
    problems += [
        f"--levels {x}: not one of {sorted(task.WORD_LEVELS)}" for x in args.levels if x not in task.WORD_LEVELS
    ]
    if sorted(set(args.steps)) != args.steps or args.steps[0] < 1:
        problems.append(f"--steps {args.steps}: give increasing positive step counts")
    problems += [p for p in [output_problem(args.out, "folder")] if p]
    if problems:
        raise SystemExit("\n".join(f"error: {p}" for p in problems))
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).to(device)
    pool = warmup_problems(args.levels, args.problems, args.seed, excluded_questions(args.exclude))
    losses, done = [], 0
    for step in args.steps:
        losses += warmup(model, tokenizer, pool, step - done, args.batch_size, args.lr, args.seed + done)
        done = step
        folder = args.out / f"step-{step}"
        save_bfloat16(model, tokenizer, folder)
        print(f"{folder}: loss over the last 10 steps {sum(losses[-10:]) / len(losses[-10:]):.4f}", flush=True)
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    settings["exclude"] = [str(p) for p in args.exclude]
    write_atomic(args.out / "warmup.json", json.dumps({**settings, "losses": losses}, indent=1) + "\n")


if __name__ == "__main__":
    main()
