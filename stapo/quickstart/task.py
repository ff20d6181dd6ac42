"""Synthetic math tasks that ship with the package, written in the same verl parquet schema and prompt template as
the real data (:func:`stapo.tools.data.make_prompt`, :func:`stapo.tools.data.write_parquet`), graded by
:mod:`stapo.tools.reward`:

* ``arith`` (the quickstart's tiny models): ``a + b * c`` with small integers, each with a short worked solution
  ending in ``\\boxed{N}`` (what the warm-up imitates). Problems are distinct triples ``(a, b, c)``, shuffled by the
  seed and cut into disjoint train and validation splits.
* ``word`` (a pretrained chat model such as SmolLM2-135M): arithmetic word problems in one to three steps, with a
  difficulty from 1 to 5 (:data:`WORD_LEVELS`), distinct question texts, disjoint splits.
"""

from __future__ import annotations

import itertools
import random
from pathlib import Path
from typing import NamedTuple

from stapo.tools.data import make_prompt, write_parquet
from stapo.tools.io import output_problem

DATA_SOURCE = "stapo_arith"
"""``data_source`` of the ``arith`` task's rows."""
WORD_DATA_SOURCE = "stapo_word"
"""``data_source`` of the ``word`` task's rows."""


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


PROBLEMS = 9**3
"""Distinct problems of :func:`generate` with its default operands (1 to 9)."""


def generate(seed: int = 0, n_train: int = 600, n_val: int = 100, max_int: int = 9) -> dict[str, list[ArithProblem]]:
    """Disjoint ``train`` and ``validation`` splits of distinct problems with operands in ``[1, max_int]``."""
    triples = list(itertools.product(range(1, max_int + 1), repeat=3))
    if n_train + n_val > len(triples):
        raise ValueError(f"max_int={max_int} gives {len(triples)} problems, fewer than {n_train} + {n_val} requested")
    random.Random(seed).shuffle(triples)
    problems = [make_problem(*t) for t in triples[: n_train + n_val]]
    return {"train": problems[:n_train], "validation": problems[n_train:]}


NAMES = ("Mia", "Leo", "Ava", "Sam", "Noah", "Zoe", "Omar", "Lily", "Ravi", "Emma", "Kai", "Nina")
ITEMS = ("apples", "marbles", "stickers", "books", "coins", "pencils", "shells", "cards", "cookies", "stamps")
WORD_LEVELS = {
    1: "one addition or subtraction, numbers up to 20",
    2: "one addition or subtraction, numbers up to 100",
    3: "two additions or subtractions, numbers up to 50",
    4: "a multiplication and an addition or subtraction, factors up to 12",
    5: "a multiplication and two additions or subtractions, factors up to 12, numbers up to 50",
}
"""Difficulty of the ``word`` task: what each level asks."""


def word_problem(rng: random.Random, difficulty: int) -> ArithProblem:
    """One word problem of the given difficulty (:data:`WORD_LEVELS`); no count ever goes below 0. The worked
    solution is phrased in one of a few ways per sentence, so that a model warmed up on such solutions still
    chooses between wordings (entropy at the forks), as a pretrained model does."""
    if difficulty not in WORD_LEVELS:
        raise ValueError(f"difficulty must be one of {sorted(WORD_LEVELS)}, got {difficulty!r}")
    name, item = rng.choice(NAMES), rng.choice(ITEMS)

    def noun(n: int) -> str:
        return item if n != 1 else item[:-1]

    def things(n: int) -> str:
        return f"{n} {noun(n)}"

    if difficulty <= 3:
        top = {1: 20, 2: 100, 3: 50}[difficulty]
        total = rng.randint(2, top)
        sentences = [f"{name} has {things(total)}."]
        work = [rng.choice((f"{name} starts with {things(total)}.", f"At first {name} has {things(total)}."))]
    else:
        top, boxes, per_box = 50, rng.randint(2, 12), rng.randint(2, 12)
        total = boxes * per_box
        sentences = [f"{name} has {boxes} boxes with {things(per_box)} in each box."]
        work = [f"{boxes} boxes of {per_box} make {boxes} * {per_box} = {things(total)}."]
    for _ in range({1: 1, 2: 1, 3: 2, 4: 1, 5: 2}[difficulty]):
        before = total
        if total > 1 and rng.random() < 0.5:
            amount = rng.randint(1, min(total - 1, top))
            total -= amount
            sentences.append(f"{name} gives away {things(amount)}.")
            step = f"{before} - {amount} = {total}"
            work.append(rng.choice((f"After giving away {amount}, {name} has {step}.", f"Giving away {amount} "
                                    f"leaves {step}.", f"{name} gives away {amount}, so {step}.")))  # fmt: skip
        else:
            amount = rng.randint(1, top)
            total += amount
            sentences.append(f"{name} finds {amount} more {noun(amount)}.")
            step = f"{before} + {amount} = {total}"
            work.append(rng.choice((f"After finding {amount} more, {name} has {step}.", f"Finding {amount} more "
                                    f"makes {step}.", f"{name} finds {amount} more, so {step}.")))  # fmt: skip
    question = " ".join([*sentences, f"How many {item} does {name} have now?"])
    ending = rng.choice(
        (f"The answer is \\boxed{{{total}}}.", f"So {name} has \\boxed{{{total}}} {item} now.",
         f"Therefore, the final answer is \\boxed{{{total}}}.")
    )  # fmt: skip
    return ArithProblem(question, " ".join([*work, ending]), total)


def distinct_word_problems(seed: int, levels: list[int], count: int, exclude=frozenset()) -> list[ArithProblem]:
    """Up to ``count`` word problems with distinct questions, none in ``exclude``, the ``levels`` in turn, drawn with
    ``random.Random(seed)`` (fewer when 50 draws per problem find no more)."""
    rng, seen, problems = random.Random(seed), set(exclude), []
    for i in range(50 * count):
        problem = word_problem(rng, levels[i % len(levels)])
        if problem.question not in seen:
            seen.add(problem.question)
            problems.append(problem)
            if len(problems) == count:
                break
    return problems


def generate_word(seed: int = 0, n_train: int = 2000, n_val: int = 500, difficulty: int | list[int] = 2) -> dict:
    """Disjoint ``train`` and ``validation`` splits of distinct ``word`` problems (no question text in both), of one
    level or of several in turn (a task that does not saturate as fast as one easy level)."""
    levels = difficulty if isinstance(difficulty, list) else [difficulty]
    problems = distinct_word_problems(seed, levels, n_train + n_val)
    if len(problems) < n_train + n_val:
        raise ValueError(
            f"difficulty {difficulty} gave {len(problems)} distinct problems, fewer than {n_train} + {n_val}"
        )
    return {"train": problems[:n_train], "validation": problems[n_train:]}


def to_rows(problems: list[ArithProblem], split: str, seed: int, data_source: str = DATA_SOURCE) -> list[dict]:
    """verl rows (the :data:`stapo.tools.data.SCHEMA` layout) of one split."""
    return [
        {
            "data_source": data_source,
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


def write_task(
    splits: dict[str, list[ArithProblem]], out_dir: str | Path, seed: int, data_source: str = DATA_SOURCE
) -> dict[str, Path]:
    """Write ``out_dir/<split>.parquet`` for every split; returns the paths by split."""
    paths = task_paths(out_dir, splits)
    for split, problems in splits.items():
        write_parquet(to_rows(problems, split, seed, data_source), paths[split])
    return paths


def main(argv: list[str] | None = None) -> None:
    """``python -m stapo.quickstart.task word --difficulty 2 --out DIR``: write a task's train and validation
    parquet files."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m stapo.quickstart.task", description=main.__doc__.split(":")[0])
    parser.add_argument("task", choices=("arith", "word"))
    parser.add_argument("--out", type=Path, required=True, help="folder for train.parquet and validation.parquet")
    parser.add_argument(
        "--difficulty", type=int, nargs="+", default=[2], choices=sorted(WORD_LEVELS),
        help="word task only: one level, or several mixed in turn",
    )  # fmt: skip
    parser.add_argument("--train", type=int, default=2000)
    parser.add_argument("--val", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if problem := output_problem(args.out, "folder"):
        parser.exit(2, f"error: {problem}\n")
    for name in ("train", "val"):
        if getattr(args, name) < 1:
            parser.exit(2, f"error: --{name} {getattr(args, name)}: must be a positive number of problems\n")
    try:
        if args.task == "word":
            splits = generate_word(args.seed, args.train, args.val, args.difficulty)
        else:
            splits = generate(args.seed, args.train, args.val)
    except ValueError as error:
        parser.exit(2, f"error: {error}\n")
    source = WORD_DATA_SOURCE if args.task == "word" else DATA_SOURCE
    for split, path in write_task(splits, args.out, args.seed, source).items():
        print(f"{path}: {len(splits[split])} problems")


if __name__ == "__main__":
    main()
