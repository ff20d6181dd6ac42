"""A synthetic math task that ships with the package, for the quickstart: ``a + b * c`` with small integers.

Every problem has a short worked solution ending in ``\\boxed{N}`` (what the warm-up imitates) and an integer
answer graded by :mod:`stapo.tools.reward`. Problems are distinct triples ``(a, b, c)``, shuffled by the seed and cut
into disjoint train and validation splits, and written in the same verl parquet schema and prompt template as the real
data (:func:`stapo.tools.data.make_prompt`, :func:`stapo.tools.data.write_parquet`).
"""

from __future__ import annotations

import itertools
import random
from pathlib import Path
from typing import NamedTuple

from stapo.tools.data import make_prompt, write_parquet

DATA_SOURCE = "stapo_arith"
"""``data_source`` of the task's rows."""


class ArithProblem(NamedTuple):
    """One problem: its text, worked solution (ending in the boxed answer) and integer answer."""

    question: str
    solution: str
    answer: int


def make_problem(a: int, b: int, c: int) -> ArithProblem:
    """The problem ``a + b * c``, solved in two steps."""
    product = b * c
    answer = a + product
    return ArithProblem(
        f"What is {a} + {b} * {c}?",
        f"First {b} * {c} = {product}. Then {a} + {product} = {answer}. The answer is \\boxed{{{answer}}}.",
        answer,
    )


def generate(seed: int = 0, n_train: int = 600, n_val: int = 100, max_int: int = 9) -> dict[str, list[ArithProblem]]:
    """Disjoint ``train`` and ``validation`` splits of distinct problems with operands in ``[1, max_int]``."""
    triples = list(itertools.product(range(1, max_int + 1), repeat=3))
    if n_train + n_val > len(triples):
        raise ValueError(f"max_int={max_int} gives {len(triples)} problems, fewer than {n_train} + {n_val} requested")
    random.Random(seed).shuffle(triples)
    problems = [make_problem(*t) for t in triples[: n_train + n_val]]
    return {"train": problems[:n_train], "validation": problems[n_train:]}


def to_rows(problems: list[ArithProblem], split: str, seed: int) -> list[dict]:
    """verl rows (the :data:`stapo.tools.data.SCHEMA` layout) of one split."""
    return [
        {
            "data_source": DATA_SOURCE,
            "prompt": make_prompt(p.question),
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(p.answer)},
            "extra_info": {
                "split": split,
                "index": i,
                "original_id": None,
                "source_file": f"stapo.quickstart.task(seed={seed})",
            },
        }
        for i, p in enumerate(problems)
    ]


def task_paths(out_dir: str | Path, splits=("train", "validation")) -> dict[str, Path]:
    """``out_dir/<split>.parquet`` by split: where :func:`write_task` writes the task."""
    return {split: Path(out_dir) / f"{split}.parquet" for split in splits}


def write_task(splits: dict[str, list[ArithProblem]], out_dir: str | Path, seed: int) -> dict[str, Path]:
    """Write ``out_dir/<split>.parquet`` for every split; returns the paths by split."""
    paths = task_paths(out_dir, splits)
    for split, problems in splits.items():
        write_parquet(to_rows(problems, split, seed), paths[split])
    return paths
