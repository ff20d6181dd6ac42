"""Training and evaluation data as verl parquet, with the paper's prompt template.

    python -m stapo.tools.data train [--local PATH] [--out DIR] [--skip-invalid] [--partial]
    python -m stapo.tools.data eval [--src PATH ...] [--name NAME] [--out DIR] [--skip-invalid] [--partial]

``train`` turns DAPO-Math-17k (hub copy by default) into ``DIR/dapo_math_17k.parquet``: deduplicated by
problem, DAPO's "Answer:" template replaced by :data:`INSTRUCTION`. ``eval`` turns the six benchmarks,
in any of their public shapes, into ``DIR/<benchmark>.parquet``. ``DIR`` defaults to ``$STAPO_DATA``,
else ``~/data/stapo``. Both print what they wrote. docs/data.md explains the sources, counts and template.

Nothing is written unless every output converts, and an output never replaces good data with less: an output with
no rows, or (without ``--partial``) with fewer rows than the benchmark's known size or than the file it would
replace, is an error.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import pyarrow as pa
import pyarrow.parquet as pq

from stapo.tools.io import DataFileError, output_problem, parquet_columns, write_atomic
from stapo.tools.reward import extract_boxed, normalize_answer

INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
"""Appended to every problem, for training and evaluation alike."""


def make_prompt(problem: str) -> list[dict]:
    """The chat prompt for one problem: a single user turn, problem then :data:`INSTRUCTION`."""
    return [{"role": "user", "content": f"{problem.strip()}\n\n{INSTRUCTION}"}]


TRAIN_DATA_SOURCE = "dapo_math_boxed"
"""``data_source`` of training rows; deliberately not ``math_dapo`` (see docs/data.md)."""
TRAIN_FILENAME = "dapo_math_17k.parquet"
REQUIRED_COLUMNS = ("data_source", "prompt", "reward_model")
"""Columns that training (verl's dataset and reward) and evaluation read; :data:`SCHEMA` has all of them."""
DEFAULT_OUT = Path(os.environ.get("STAPO_DATA", Path.home() / "data" / "stapo"))
"""Default output folder of both sub-commands: ``$STAPO_DATA``, else ``~/data/stapo`` (what configs/base.yaml reads)."""
BENCHMARKS = ("aime24", "aime25", "amc23", "math500", "minerva", "olympiadbench")


class HubSource(NamedTuple):
    """A pinned Hugging Face copy: dataset id, split (or file for train) and expected row count."""

    repo: str
    split: str
    rows: int


HUB_TRAIN = HubSource("BytedTsinghua-SIA/DAPO-Math-17k", "data/dapo-math-17k.parquet", 17398)
HUB_EVAL = {
    "aime24": HubSource("math-ai/aime24", "test", 30),
    "aime25": HubSource("math-ai/aime25", "test", 30),
    "amc23": HubSource("math-ai/amc23", "test", 40),
    "math500": HubSource("HuggingFaceH4/MATH-500", "test", 500),
    "minerva": HubSource("math-ai/minervamath", "test", 272),
    "olympiadbench": HubSource("math-ai/olympiadbench", "test", 674),
}
KNOWN_SIZES = {
    "aime24": (30,),
    "aime25": (30,),
    "amc23": (40, 83),  # 83 = AMC 2022+2023 (AI-MO/aimo-validation-amc), not the paper's AMC23
    "math500": (500,),
    "minerva": (272,),
    "olympiadbench": (675, 674),  # Qwen2.5-Math copy vs math-ai / JustRL copy
}

# Benchmark aliases, matched as substrings of a lower-cased, alphanumeric-only file or folder name.
_ALIASES = {
    "aime24": ("aime24", "aime2024"),
    "aime25": ("aime25", "aime2025"),
    "amc23": ("amc",),
    "math500": ("math500",),
    "minerva": ("minerva",),
    "olympiadbench": ("olympiad",),
}
_SUFFIXES = (".jsonl", ".json", ".parquet")

_DAPO_PREFIX = re.compile(
    r"^\s*Solve the following math problem step by step\. The last line of your response should be of the form "
    r"Answer: \$Answer \(without quotes\) where \$Answer is the answer to the problem\.\s*"
)
_DAPO_SUFFIX = re.compile(r"\s*Remember to put your answer on its own line after \"Answer:\"\.?\s*$")
_BOXED_SUFFIX = re.compile(
    r"\s*(?:Please reason step by step, and put your final answer within|"
    r"Let's think step by step and output the final answer within) \\boxed\{\}\.?\s*$"
)
_UNESCAPED_DOLLAR = re.compile(r"(?<!\\)\$")
_PROBLEM_FIELDS = ("problem", "question", "Problem", "prompt")
_ANSWER_FIELDS = ("answer", "final_answer", "Answer", "reward_model", "ground_truth", "solution")
_ID_FIELDS = ("id", "unique_id", "idx", "ID")

SCHEMA = pa.schema(
    [
        ("data_source", pa.string()),
        ("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
        ("ability", pa.string()),
        ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
        (
            "extra_info",
            pa.struct(
                [
                    ("split", pa.string()),
                    ("index", pa.int64()),
                    ("original_id", pa.string()),
                    ("source_file", pa.string()),
                ]
            ),
        ),
    ]
)


class InvalidRowError(ValueError):
    """A source row without a usable problem or answer; the message names file, row and field."""


class SourceError(ValueError):
    """A source or an output that cannot be used as a whole (empty, too short, unreachable); the message says why."""


class _BadField(Exception):
    """A field of one row that cannot be used; :func:`build_rows` adds the file and row."""

    def __init__(self, field_name: str, reason: str) -> None:
        super().__init__(f"field {field_name!r}: {reason}")


@dataclass
class Report:
    """What one output file holds and where it came from."""

    name: str
    path: Path
    sources: list[str]
    rows: int = 0
    duplicates: int = 0
    skipped: list[str] = field(default_factory=list)


def strip_template(text: str) -> str:
    """The bare problem: DAPO's "Answer:" prefix/suffix and known boxed instructions removed."""
    for pattern in (_DAPO_PREFIX, _DAPO_SUFFIX, _BOXED_SUFFIX):
        text = pattern.sub("", text)
    return text.strip()


def _problem(record: dict) -> str:
    name = next((f for f in _PROBLEM_FIELDS if record.get(f) is not None), None)
    if name is None:
        raise _BadField("problem", f"missing (looked for {', '.join(_PROBLEM_FIELDS)})")
    value = record[name]
    if isinstance(value, list):  # chat prompt: the last user turn
        value = next(
            (m.get("content") for m in reversed(value) if isinstance(m, dict) and m.get("role") == "user"), None
        )
    problem = strip_template(value) if isinstance(value, str) else ""
    if not problem:
        raise _BadField(name, "empty or not text")
    return problem


def _answer(record: dict) -> str:
    name = next((f for f in _ANSWER_FIELDS if record.get(f) is not None), None)
    if name is None:
        raise _BadField("answer", f"missing (looked for {', '.join(_ANSWER_FIELDS)})")
    value = record[name]
    if name == "reward_model":
        value = value.get("ground_truth") if isinstance(value, dict) else None
        name = "reward_model.ground_truth"
    if isinstance(value, str) and re.fullmatch(r"\[\s*'.*'\s*\]", value.strip(), re.S):
        try:
            value = ast.literal_eval(value.strip())  # OlympiadBench's "['2']" list strings
        except (ValueError, SyntaxError):
            raise _BadField(name, f"unparseable list string {value!r}") from None
    if isinstance(value, list) and all(isinstance(v, (str, int, float)) for v in value):
        value = ", ".join(str(v) for v in value)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = str(int(value)) if float(value).is_integer() else str(value)  # AMC's 27.0 is the answer 27
    if not isinstance(value, str):
        raise _BadField(name, f"unparseable ground truth {value!r}")
    if name == "solution":  # worked solution (MATH, Minerva) or a bare answer (open-r1)
        boxed = extract_boxed(value)
        if boxed is None and "\n" in value.strip():
            raise _BadField(name, "no \\boxed{} answer in the solution")
        value = value if boxed is None else boxed
    answer = normalize_answer(_clean_gold(value))
    if not answer:
        raise _BadField(name, "empty ground truth")
    if answer.count("{") != answer.count("}"):
        raise _BadField(name, f"unbalanced braces in ground truth {answer!r}")
    return answer


def _clean_gold(value: str) -> str:
    """A ground truth reduced to the answer as the copies write it: a whole-string ``\\boxed{}`` unwrapped (verl
    parquet copies store ``\\boxed{204}``) and ``$`` delimiters dropped (``$69$,$84$``)."""
    value = value.strip()
    if value.startswith(("\\boxed", "\\fbox")) and value.endswith("}"):
        value = extract_boxed(value) or ""
    return _UNESCAPED_DOLLAR.sub("", value).strip()


def _original_id(record: dict) -> str | None:
    extra = record.get("extra_info")
    value = next((record[f] for f in _ID_FIELDS if record.get(f) is not None), None)
    if value is None and isinstance(extra, dict):
        value = extra.get("index")
    return None if value is None else str(value)


def read_records(path: Path) -> Iterator[dict]:
    """Rows of a JSONL, JSON (list of objects) or parquet file, as dicts.

    A JSONL line that does not parse is yielded as its ``JSONDecodeError`` so that it is reported as a bad row.
    """
    if path.suffix == ".jsonl":
        with path.open(encoding="utf-8", errors="strict") as lines:
            try:
                for line in lines:
                    if line.strip():
                        try:
                            yield json.loads(line)
                        except json.JSONDecodeError as error:
                            yield error  # reported as a bad row by build_rows
            except UnicodeDecodeError:
                raise DataFileError(f"{path}: not a text file; expected JSON lines") from None
    elif path.suffix == ".json":
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise DataFileError(f"{path}: not a JSON file ({error}); expected a JSON list of objects") from None
        if not isinstance(data, list):
            raise InvalidRowError(f"{path}: expected a JSON list of objects, got {type(data).__name__}")
        yield from data
    elif path.suffix == ".parquet":
        parquet_columns(path, "a parquet copy of the dataset")  # names the file if it is damaged
        for batch in pq.ParquetFile(path).iter_batches(batch_size=10_000):
            yield from batch.to_pylist()
    else:
        raise ValueError(f"{path}: unsupported file type (use {', '.join(_SUFFIXES)})")


def build_rows(
    sources: Iterable[tuple[str, Iterable[dict]]], data_source: str, split: str, skip_invalid: bool, report: Report
) -> list[dict]:
    """verl rows from ``(source label, records)`` pairs, deduplicated by problem text.

    Invalid rows raise :class:`InvalidRowError`, or with ``skip_invalid`` are listed in ``report``.
    """
    rows: list[dict] = []
    seen: set[str] = set()
    for label, records in sources:
        for number, record in enumerate(records):
            try:
                if isinstance(record, json.JSONDecodeError):
                    raise _BadField("<line>", f"not valid JSON ({record})")
                if not isinstance(record, dict):
                    raise _BadField("<row>", f"expected an object, got {type(record).__name__}")
                problem, answer = _problem(record), _answer(record)
            except _BadField as error:
                message = f"{label}: row {number}: {error}"
                if not skip_invalid:
                    raise InvalidRowError(message) from None
                report.skipped.append(message)
                continue
            if problem in seen:
                report.duplicates += 1
                continue
            seen.add(problem)
            rows.append(
                {
                    "data_source": data_source,
                    "prompt": make_prompt(problem),
                    "ability": "math",
                    "reward_model": {"style": "rule", "ground_truth": answer},
                    "extra_info": {
                        "split": split,
                        "index": len(rows),
                        "original_id": _original_id(record),
                        "source_file": label,
                    },
                }
            )
    report.rows = len(rows)
    return rows


def write_parquet(rows: list[dict], path: Path) -> None:
    """Write rows in :data:`SCHEMA` atomically (:func:`write_atomic`)."""
    buffer = pa.BufferOutputStream()
    pq.write_table(pa.Table.from_pylist(rows, schema=SCHEMA), buffer)
    write_atomic(path, buffer.getvalue().to_pybytes())


def benchmark_from_path(path: Path, root: Path | None = None, prefix: bool = False) -> str | None:
    """The benchmark a file belongs to, from its name or a folder name up to ``root``: a name that contains one of the
    benchmark's aliases, or with ``prefix`` begins with one.

    ``aime24.jsonl``, ``MATH-500/test.parquet``, ``minerva_math.jsonl`` and ``Olympiad-Bench/test.parquet``
    are all recognised; None if no name (or more than one benchmark) matches.
    """
    names = [path.stem]
    for folder in path.parents:
        names.append(folder.name)
        if folder == (root or path.parent):
            break
    for name in names:
        key = re.sub(r"[^a-z0-9]", "", name.lower())
        matches = {bench for bench, aliases in _ALIASES.items()
                   if any(key.startswith(alias) if prefix else alias in key for alias in aliases)}  # fmt: skip
        if len(matches) == 1:
            return matches.pop()
    return None


def _input_files(src: Path) -> list[Path]:
    """``src`` itself, or the JSONL/JSON/parquet files below it."""
    if not src.exists():
        raise FileNotFoundError(f"{src}: no such file or folder")
    files = sorted(p for p in src.rglob("*") if p.suffix in _SUFFIXES) if src.is_dir() else [src]
    if not files:
        raise FileNotFoundError(f"{src}: no {', '.join(_SUFFIXES)} files")
    return files


def _local_eval_sources(srcs: Sequence[Path], name: str | None) -> tuple[dict[str, list[Path]], list[Path]]:
    """Files per benchmark, and files in folders that match no benchmark (ignored, reported)."""
    found: dict[str, list[Path]] = {}
    ignored: list[Path] = []
    for src in map(Path, srcs):
        for file in _input_files(src):
            bench = name or benchmark_from_path(file, src if src.is_dir() else None)
            if bench is None and not src.is_dir():
                raise ValueError(
                    f"{file}: cannot tell the benchmark from the name; pass --name ({', '.join(BENCHMARKS)})"
                )
            if bench is None:
                ignored.append(file)
            else:
                found.setdefault(bench, []).append(file)
    if not found:
        raise FileNotFoundError(f"no benchmark files among {', '.join(map(str, ignored))}; pass --name")
    return found, ignored


def _hub_records(source: HubSource) -> list[dict]:
    from datasets import load_dataset

    return load_dataset(source.repo, split=source.split).to_list()


def check_verl_parquet(path: Path, expected: str, prompt_key: str = "prompt", source_key: str = "data_source") -> None:
    """What verl's dataset and reward read from a training or validation file, from its footer only (a 17k-row file
    is not loaded): at least one row, the columns ``source_key``, ``prompt_key`` and ``reward_model``, and their types
    (a string source, chat messages, a struct with ``ground_truth``). :class:`DataFileError` naming the file, the
    column and ``expected`` otherwise."""
    names = parquet_columns(path, expected)
    columns = dict.fromkeys([source_key, prompt_key, *REQUIRED_COLUMNS[2:]])
    missing = [c for c in columns if c not in names]
    if missing:
        raise DataFileError(f"{path}: missing column(s) {', '.join(missing)}; expected {expected}")
    file = pq.ParquetFile(path)
    if file.metadata.num_rows == 0:
        raise DataFileError(f"{path}: no rows; expected {expected}")
    schema = file.schema_arrow
    types = {name: schema.field(name).type for name in columns}
    message = types[prompt_key]
    if not (pa.types.is_list(message) or pa.types.is_large_list(message)) or not (
        pa.types.is_struct(message.value_type) and {"role", "content"} <= {f.name for f in message.value_type}
    ):
        raise DataFileError(
            f"{path}: column '{prompt_key}' holds {message}, not chat messages (a list of {{role, content}}); "
            f"expected {expected}"
        )
    reward = types["reward_model"]
    if not (pa.types.is_struct(reward) and "ground_truth" in {f.name for f in reward}):
        raise DataFileError(
            f"{path}: column 'reward_model' holds {reward}, not a struct with ground_truth; expected {expected}"
        )
    if not (pa.types.is_string(types[source_key]) or pa.types.is_large_string(types[source_key])):
        raise DataFileError(f"{path}: column '{source_key}' holds {types[source_key]}, not text; expected {expected}")


def hub_unreachable() -> str | None:
    """Why the Hugging Face hub cannot be asked at all (its host name is not found, and no proxy is set that would
    resolve it), or None: the hub clients would retry for about 25 s, a line each, before they fail. With
    HF_HUB_OFFLINE they read their cache without asking, so nothing is probed."""
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants

    proxies = ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")
    if constants.HF_HUB_OFFLINE or any(os.environ.get(name) for name in proxies):
        return None
    host = urlparse(constants.ENDPOINT).hostname
    try:
        socket.getaddrinfo(host, 443)
    except OSError as error:
        return f"{host}: {error.strerror or error}"
    return None


def _from_hub(what: str, fetch, option: str):
    """``fetch()``, with a download failure (offline, no access) turned into one line that says what to pass."""
    if reason := hub_unreachable():
        raise SourceError(
            f"could not download {what}: the Hugging Face hub cannot be reached ({reason}); without hub access, pass "
            f"a local copy with {option}"
        )
    try:
        return fetch()
    except Exception as error:  # noqa: BLE001 - requests, huggingface_hub and datasets raise many types
        raise SourceError(
            f"could not download {what} from the Hugging Face hub ({type(error).__name__}: "
            f"{str(error).splitlines()[0] if str(error) else 'no detail'}); without hub access, pass a local copy "
            f"with {option}"
        ) from None


def _check_rows(report: Report, known: Sequence[int], partial: bool) -> None:
    """An output with no rows or more than the benchmark's known size (another data set under its name), or (unless
    ``partial``) with fewer rows than the benchmark's known size or than the file it would replace, is an error: good
    data is never replaced by less."""
    if report.rows == 0:
        skipped = f" ({len(report.skipped)} invalid rows skipped)" if report.skipped else ""
        raise SourceError(f"{', '.join(report.sources)}: no usable rows{skipped}; {report.path} is left as it was")
    if known and report.rows > max(known):
        raise SourceError(
            f"{report.name}: {report.rows} rows from {', '.join(report.sources)}, more than the benchmark's "
            f"{'/'.join(map(str, known))}: another data set under its name? Name the file after its benchmark or "
            f"pass --name ({report.path} is left as it was)"
        )
    if partial:
        return
    if known and report.rows < min(known):
        raise SourceError(
            f"{report.name}: {report.rows} rows from {', '.join(report.sources)}, but the benchmark has "
            f"{'/'.join(map(str, known))}; pass --partial to write a subset ({report.path} is left as it was)"
        )
    if report.path.exists():
        try:
            before = pq.ParquetFile(report.path).metadata.num_rows
        except Exception:  # noqa: BLE001 - a damaged old file may be replaced
            return
        if before > report.rows:
            raise SourceError(
                f"{report.path} holds {before} rows and would be replaced by {report.rows}; pass --partial to "
                "replace it anyway, or write to another --out"
            )


def prepare_eval(
    srcs: Sequence[Path] | None,
    out_dir: Path,
    name: str | None = None,
    skip_invalid: bool = False,
    partial: bool = False,
) -> tuple[list[Report], list[Path]]:
    """Write ``out_dir/<benchmark>.parquet`` from local files (or the pinned hub copies if ``srcs`` is empty).

    Returns one report per benchmark and the files that were ignored. Nothing is written unless every benchmark
    converts and passes :func:`_check_rows`.
    """
    if name is not None and name not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {name!r}; choose from {', '.join(BENCHMARKS)}")
    ignored: list[Path] = []
    if srcs:
        found, ignored = _local_eval_sources(srcs, name)
        inputs = {bench: [(str(f), read_records(f)) for f in files] for bench, files in found.items()}
    else:
        wanted = [name] if name else list(BENCHMARKS)
        inputs = {
            bench: [
                (
                    f"hf://datasets/{HUB_EVAL[bench].repo} ({HUB_EVAL[bench].split})",
                    _from_hub(HUB_EVAL[bench].repo, lambda b=bench: _hub_records(HUB_EVAL[b]), "--src PATH"),
                )
            ]
            for bench in wanted
        }
    outputs = []
    for bench in sorted(inputs, key=BENCHMARKS.index):
        report = Report(bench, Path(out_dir) / f"{bench}.parquet", [label for label, _ in inputs[bench]])
        rows = build_rows(inputs[bench], bench, "test", skip_invalid, report)
        _check_rows(report, KNOWN_SIZES[bench], partial)
        outputs.append((report, rows))
    for report, rows in outputs:
        write_parquet(rows, report.path)
    return [report for report, _ in outputs], ignored


def prepare_train(local: Path | None, out_dir: Path, skip_invalid: bool = False, partial: bool = False) -> Report:
    """Write ``out_dir/dapo_math_17k.parquet`` from a local DAPO-Math-17k copy or the hub."""
    if local is None:
        from huggingface_hub import hf_hub_download

        path = _from_hub(
            HUB_TRAIN.repo,
            lambda: Path(hf_hub_download(HUB_TRAIN.repo, HUB_TRAIN.split, repo_type="dataset")),
            "--local PATH",
        )
        sources = [(f"hf://datasets/{HUB_TRAIN.repo}/{HUB_TRAIN.split}", read_records(path))]
    else:
        files, local = _input_files(Path(local)), Path(local)
        for f in files:  # the benchmarks' own problems would leak into training and inflate the tables
            if bench := benchmark_from_path(f, local if local.is_dir() else f.parent, prefix=True):
                raise SourceError(
                    f"--local {f}: a file of the benchmark {bench}, which the evaluation scores (by its name or its "
                    "folder's); train on a copy of DAPO-Math-17k, or rename it if it holds no benchmark's problems"
                )
        sources = [(str(f), read_records(f)) for f in files]
    report = Report("train", Path(out_dir) / TRAIN_FILENAME, [label for label, _ in sources])
    rows = build_rows(sources, TRAIN_DATA_SOURCE, "train", skip_invalid, report)
    _check_rows(report, (HUB_TRAIN.rows,) if local is None else (), partial)
    write_parquet(rows, report.path)
    return report


def format_report(reports: Sequence[Report], ignored: Sequence[Path] = ()) -> str:
    """A table of rows, duplicates dropped, skipped rows and sources, then the skipped rows themselves."""
    lines = [f"{'output':<40} {'rows':>6} {'known':>8} {'dups':>6} {'skipped':>7}  sources"]
    for report in reports:
        known = "/".join(map(str, KNOWN_SIZES.get(report.name, (HUB_TRAIN.rows,))))
        lines.append(
            f"{str(report.path):<40} {report.rows:>6} {known:>8} {report.duplicates:>6} {len(report.skipped):>7}  "
            + ", ".join(report.sources)
        )
    lines += [f"skipped: {message}" for report in reports for message in report.skipped]
    lines += [f"ignored (no benchmark in the name): {path}" for path in ignored]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    """Command-line entry point (``python -m stapo.tools.data``)."""
    parser = argparse.ArgumentParser(prog="python -m stapo.tools.data", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser("train", help="DAPO-Math-17k -> verl parquet")
    train.add_argument("--local", type=Path, help="local DAPO-Math-17k file or folder (default: download from the hub)")
    train.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output folder (default: {DEFAULT_OUT})")
    evaluation = commands.add_parser("eval", help="the six benchmarks -> verl parquet")
    evaluation.add_argument(
        "--src", type=Path, nargs="+", help="files or folders (default: download pinned hub copies)"
    )
    evaluation.add_argument("--name", choices=BENCHMARKS, help="benchmark of all --src files (default: from the names)")
    evaluation.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output folder (default: {DEFAULT_OUT})")
    for command in (train, evaluation):
        command.add_argument("--skip-invalid", action="store_true", help="skip and list bad rows instead of stopping")
        command.add_argument(
            "--partial", action="store_true",
            help="allow fewer rows than the benchmark's known size or than the file replaced",
        )  # fmt: skip
    args = parser.parse_args(argv)
    if problem := output_problem(args.out, "folder"):
        parser.exit(2, f"error: {problem}\n")
    try:
        if args.command == "train":
            reports, ignored = [prepare_train(args.local, args.out, args.skip_invalid, args.partial)], []
        else:
            reports, ignored = prepare_eval(args.src, args.out, args.name, args.skip_invalid, args.partial)
    except (InvalidRowError, FileNotFoundError, ValueError) as error:  # DataFileError, SourceError are ValueErrors
        parser.exit(2, f"error: {error}\n")
    print(format_report(reports, ignored))


if __name__ == "__main__":
    main()
