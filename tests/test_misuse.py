"""Bad input anywhere gets one line and leaves nothing behind: a table generated from the entry points' own parsers.

Every ``python -m stapo.*`` entry point and sub-command is listed in :data:`ENTRIES` with a valid command line and the
point where its checks are done and its work begins (a tripwire: reaching it ends the case). From the parser, each
option gets the inputs that fit its kind: not a number, zero and a negative number for numbers; a missing path, a folder
where a file is meant (or a file where a folder is), an empty file and a junk file for input paths; a file in the way, a
path under a file, or a folder that cannot be written (``chattr +i``, or ``chmod 0555`` for a user other than root: the
``read_only`` fixture) for outputs. Each case runs the real entry point in-process from a working folder of its own and
must end in a non-zero exit with exactly one ``error:`` line naming the option or the value, no traceback, before the
work begins, with nothing new in the working folder; or, where :data:`MEANINGS` documents what the value means, reach
the work. A new option joins the table by itself; a new entry point fails :func:`test_every_entry_point_is_in_the_table`
until it is listed. Stand-ins: the CUDA device count for the GPU tools (``gpus``) and vLLM's presence for the tools that
generate with it (neither exists on a CPU).

``python -m stapo.train``'s typed keys are checked the same way through the trainer's checks
(:func:`test_every_typed_key_of_the_trainer_is_checked`: the keys of the preflight's ``RANGES`` table out of range,
mini-batches that do not divide, ``+KEY`` typos, training files without rows or with wrongly typed columns, a
read-only checkpoint folder); every numeric key of verl's own config, found in it, refuses text
(:func:`test_every_numeric_key_of_verl_refuses_text`); an override that Hydra cannot parse is one line that shows it
quoted.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import importlib
import pkgutil
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import stapo

FIXTURES = Path(__file__).parent / "fixtures"


class Reached(Exception):
    """The case got past the entry point's checks to its work."""


@dataclass(frozen=True)
class Entry:
    argv: tuple[str, ...]
    """A valid command line; ``{A}`` is the assets folder, ``{W}`` the case's working folder (outputs go there). Paths
    with a suffix are files, without one folders (:func:`option_kind`)."""
    work: tuple[str, ...] = ()
    """``module:attribute`` replaced by a tripwire: the work the checks guard."""
    after: tuple[str, ...] = ()
    """``module:attribute``: checks whose clean return is the tripwire (they return nothing, or no problems)."""
    gpus: int = 0
    """CUDA devices declared (torch.cuda stubbed: none exists on a CPU)."""
    kinds: dict = field(default_factory=dict)
    """Option -> ``file``, ``folder``, ``out-file``, ``out-folder`` or ``text`` where the command line does not show."""


M, T, S = "{A}/model", "{A}/task", "{A}/samples.jsonl"
ENTRIES = {
    "stapo.tools.evaluate": Entry(
        ("--model", M, "--data", "{A}/evaldata", "--benchmarks", "aime24", "--out", "{W}/eval"),
        work=("stapo.tools.evaluate:evaluate",),
        kinds={
            "--model": "folder",
            "--benchmarks": "text",
            "--verifier": "text",
            "--label": "text",
            "--shard": "text",
            "--n": "text",
        },
    ),
    "stapo.tools.inspect_tokens": Entry(
        ("--model", M, "--rollouts", S, "--device", "cpu", "--out", "{W}/silenced.jsonl"),
        work=("stapo.tools.inspect_tokens:token_stats",),
        kinds={"--device": "text"},
    ),
    "stapo.tools.probe": Entry(
        (
            "--model",
            M,
            "--data",
            f"{T}/train.parquet",
            "--out",
            "{W}/probe.json",
            "--prompts",
            "4",
            "--mini-batch",
            "2",
        ),
        work=("transformers:AutoTokenizer.from_pretrained",),
    ),
    "stapo.tools.data train": Entry(("train", "--local", "{A}/dapo.jsonl", "--out", "{W}/data", "--partial")),
    "stapo.tools.data eval": Entry(("eval", "--src", "{A}/aime24.jsonl", "--out", "{W}/data", "--partial")),
    "stapo.tools.report table": Entry(("table", "{A}/summaries", "--out", "{W}/report")),
    "stapo.tools.report plot": Entry(
        ("plot", "stapo={A}/metrics.jsonl", "--out", "{W}/report"), kinds={"runs": "text"}
    ),
    "stapo.tools.pretrained": Entry(
        ("--out", "{W}/smollm2", "--src", "{A}/small.gguf"), work=("stapo.tools.pretrained:convert",)
    ),
    "stapo.tools.cost measure": Entry(
        ("measure", "--evidence", "{A}/repo", "--out", "{W}/measured.json"), work=("stapo.tools.cost:measure",)
    ),
    "stapo.tools.cost fit": Entry(("fit",), work=("stapo.tools.cost:fitted",)),
    "stapo.tools.cost project": Entry(("project", "--size", "qwen3_1.7b"), work=("stapo.tools.cost:project",)),
    "stapo.tools.cost table": Entry(("table",), work=("stapo.tools.cost:table",)),
    "stapo.quickstart.task": Entry(("word", "--out", "{W}/task", "--train", "20", "--val", "5")),
    "stapo.quickstart.warmup": Entry(
        ("--model", M, "--out", "{W}/warm", "--steps", "1", "--problems", "40", "--exclude", f"{T}/train.parquet"),
        work=("stapo.quickstart.warmup:warmup",),
    ),
    "stapo.quickstart.run": Entry(
        ("cpu", "--out", "{W}/quickstart"),
        after=("stapo.quickstart.run:check_args",),
        kinds={"--tokenizer": "folder", "--src": "file"},
    ),
    "stapo.quickstart.experiment run": Entry(
        ("run", "--out", "{W}/experiment", "--model", M, "--data", T, "--methods", "justrl", "--seeds", "0"),
        after=("stapo.quickstart.experiment:check_run_args",),
        gpus=1,
        kinds={"--tokenizer": "folder", "--gpus": "text", "--methods": "text", "overrides": "text"},
    ),
    "stapo.quickstart.experiment summary": Entry(("summary", "{A}/experiment", "--plots", "{W}/plots")),
    "stapo.tools.selection pilot": Entry(("pilot", "{A}/experiment"), work=("stapo.tools.selection:pilot_rows",)),
    "stapo.tools.selection verdict": Entry(
        ("verdict", "{A}/experiment"), work=("stapo.tools.selection:verdict",), kinds={"folders": "folder"}
    ),
    "stapo.checks.gpu_smoke": Entry(
        (
            "--out",
            "{W}/smoke",
        ),
        work=("stapo.checks.gpu_smoke:build_assets",),
        gpus=2,
        kinds={"--tokenizer": "folder", "--methods": "text", "overrides": "text"},
    ),  # fmt: skip
    "stapo.checks.benchmark mask": Entry(
        ("mask", "--responses", "8", "--length", "16", "--repeats", "1"), work=("stapo.checks.benchmark:bench_mask",)
    ),
    "stapo.checks.benchmark attention": Entry(("attention",), work=("stapo.checks.benchmark:check_attention",), gpus=1),
    "stapo.checks.benchmark actor": Entry(
        ("actor", "--out", "{W}/bench"), work=("stapo.checks.benchmark:bench_actor",), gpus=1, kinds={"--shape": "text"}
    ),
    "stapo.checks.benchmark gpu": Entry(
        ("gpu", "--out", "{W}/bench"),
        work=("stapo.checks.benchmark:bench_gpu",),
        gpus=1,
        kinds={"--model": "text", "--tokenizer": "folder", "--weights": "folder", "overrides": "text"},
    ),  # fmt: skip
    "stapo.checks.benchmark vllm": Entry(
        ("vllm", "--model", M, "--data", f"{T}/train.parquet", "--out", "{W}/bench"),
        work=("stapo.checks.benchmark:bench_vllm",),
        gpus=1,
    ),
    "stapo.checks.scale model": Entry(
        ("model", "--shape", "qwen3_0.6b", "--tokenizer", M, "--out", "{W}/model"),
        work=("stapo.checks.scale:build",),
        kinds={"--shape": "text", "--device": "text"},
    ),
    "stapo.checks.scale summary": Entry(("summary", "{A}/metrics.jsonl")),
    "stapo.checks.reproduce compare": Entry(
        ("compare", "{A}/metrics.jsonl", "{A}/metrics.jsonl", "--out", "{W}/table.md"), kinds={"--steps": "text"}
    ),
    "stapo.checks.batch_invariance run": Entry(
        ("run", "--model", M, "--setting", "fa2", "--out", "{W}/probe.json"),
        work=("stapo.checks.batch_invariance:start_engine",),
        kinds={"--setting": "text"},
    ),
    "stapo.checks.batch_invariance locate": Entry(
        ("locate", "--model", M, "--setting", "fa2", "--out", "{W}/locate.json"),
        work=("stapo.checks.batch_invariance:start_engine",),
        kinds={"--setting": "text"},
    ),
    "stapo.checks.batch_invariance table": Entry(
        ("table", "{A}/invariance.json"), work=("stapo.checks.batch_invariance:table",)
    ),
    "stapo.checks.replay run": Entry(
        ("run", "--model", M, "--data", T, "--out", "{W}/replay"),
        work=("stapo.checks.replay:run",),
        gpus=1,
        kinds={"overrides": "text"},
    ),
    "stapo.checks.replay halt": Entry(
        ("halt", "true", "--at", "2", "--checkpoints", "{W}/ckpt"),
        work=("stapo.checks.replay:halt",),
        kinds={"cmd": "text", "--checkpoints": "out-folder"},
    ),
    "stapo.checks.replay watch": Entry(
        ("watch", "true", "--metrics", "{W}/metrics.jsonl", "--times", "{W}/times.json"),
        work=("stapo.checks.replay:watch",),
        kinds={"cmd": "text", "--metrics": "out-file", "--times": "out-file"},
    ),
    "stapo.checks.replay twins": Entry(("twins", "{A}/replayed"), work=("stapo.checks.replay:twin_problems",)),
    "stapo.checks.startup run": Entry(
        ("run", "true", "--out", "{W}/startup"), work=("stapo.checks.startup:launch",), kinds={"command": "text"}
    ),
    "stapo.checks.startup phases": Entry(("phases", str(FIXTURES / "startup_train.log"), "--out", "{W}/phases.json")),
    "stapo.checks.startup imports": Entry(
        ("imports", "--out", "{W}/imports.json"),
        work=("stapo.checks.startup:time_imports",),
        kinds={"--module": "text"},
    ),
    "stapo.tools.evidence card": Entry(
        ("card", "--out", "{W}/record", "--commit", "abc1234", "--command", "true"),
        work=("stapo.tools.evidence:card",),
        kinds={"--commit": "text", "--command": "text", "--note": "text"},
    ),
    "stapo.tools.evidence collect": Entry(
        ("collect", "{A}/experiment", "{W}/record"),
        work=("stapo.tools.evidence:collect",),
        kinds={"dest": "out-folder"},
    ),
    "stapo.tools.evidence keep": Entry(
        ("keep", "{A}/experiment", "{W}/record"), work=("stapo.tools.evidence:keep",), kinds={"dest": "out-folder"}
    ),
    "stapo.tools.report evidence": Entry(
        ("evidence", "--check", "--root", "{A}/repo"), work=("stapo.tools.evidence:regenerate",)
    ),
    "stapo.quickstart.experiment decisive": Entry(
        ("decisive", "{A}/experiment"), work=("stapo.tools.decisive:report",), kinds={"folders": "folder"}
    ),
    "stapo.train.clusters wait": Entry(
        ("wait", "127.0.0.1:6390", "5", "node1"),
        work=("stapo.train.clusters:wait_for_nodes",),
        kinds={"address": "text", "nodes": "text"},
    ),  # fmt: skip
}

MEANINGS = {
    **dict.fromkeys(
        ("--seed", "--seeds"),
        {"0": "a seed", "-1": "a seed"},
    ),
    "--save-freq": {"0": "no checkpoints"},
    "--context": {"0": "no context around a silenced token"},
    "--gradients": {"0": "no paired gradient test"},
    "--standalone": {"0": "no standalone vLLM run"},
    "--q": {"0": "q = 0 silences nothing (the paper's range is [0, 1])"},
    "--warmup-target": {"0": "no accuracy target: one warm-up round"},
    "--deadline": {"0": "no run stopped by a deadline"},
    "--signal-at": {"0": "no signal"},
    "--twin-halt": {"0": "no halted twin"},
    "--label": {"junk!": "any name of the run's folder"},
    "--command": {"junk!": "the command as typed, whatever it is"},
    "--note": {"junk!": "what else ran on the host, in words"},
    "nodes": {"junk!": "a host name"},
}
"""Option -> {bad-looking value: what it means}: values that are valid there."""


# ------------------------------------------------------------------------------------------------------ the cases
INPUTS = {
    "int": ("abc", "0", "-1"),
    "float": ("abc", "0", "-1", "nan"),
    "file": ("<missing>", "<folder>", "<empty>", "<junk>"),
    "folder": ("<missing>", "<file>"),
    "out-folder": ("<file>", "<under-file>", "<read-only>"),
    "out-file": ("<folder>", "<under-file>", "<read-only>"),
    "text": ("junk!",),
}


def capture_parser(module: str, argv: list[str]) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    """The (sub)parser that takes ``argv``'s options in ``module``'s ``main``, and the namespace it makes."""
    original = argparse.ArgumentParser.parse_args

    def stop(parser, args=None, namespace=None):
        raise Reached(parser, original(parser, args, namespace))

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(argparse.ArgumentParser, "parse_args", stop)
        try:
            importlib.import_module(module).main(argv)
        except Reached as reached:
            top, namespace = reached.args
        else:
            raise AssertionError(f"{module} did not parse its arguments")
    sub = next((a for a in top._actions if isinstance(a, argparse._SubParsersAction)), None)
    return (sub.choices[getattr(namespace, sub.dest)] if sub else top), namespace


def resolve(target: str) -> tuple[object, str]:
    """``module:attribute`` or ``module:Class.attribute`` -> (the owner, the attribute's name)."""
    path, _, dotted = target.partition(":")
    owner = importlib.import_module(path)
    *parents, name = dotted.split(".")
    for parent in parents:
        owner = getattr(owner, parent)
    return owner, name


def option_kind(entry: Entry, action: argparse.Action, value) -> str | None:
    """The kind of inputs an option takes (:data:`INPUTS`), or None for flags and choices (argparse checks those)."""
    name = action.option_strings[0] if action.option_strings else action.dest
    if name in entry.kinds:
        return entry.kinds[name]
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse._HelpAction)):
        return None
    if action.choices is not None:
        return None
    if action.type in (int, float):
        return action.type.__name__
    first = value[0] if isinstance(value, list) and value else value
    if isinstance(first, Path) or action.type is Path:
        if action.dest in ("out", "plots"):
            return "out-file" if Path(str(first)).suffix else "out-folder"
        if first is None:
            raise AssertionError(f"{name}: a path option the command line does not show: declare its kind in ENTRIES")
        return "file" if Path(str(first)).suffix else "folder"  # the assets' files have suffixes, folders none
    raise AssertionError(f"{name}: declare its kind in ENTRIES (text, file, folder, ...)")


def cases():
    for command, entry in ENTRIES.items():
        module = command.split()[0]
        argv = [a.replace("{A}", "/ASSETS").replace("{W}", "/WORK") for a in entry.argv]
        yield command, module, entry, argv


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """The files the valid command lines name (tiny model, task, benchmark, samples, metrics, summaries, GGUF)."""
    import json

    from test_inspect import eval_samples
    from test_pretrained import write_gguf
    from verl.utils.tracking import FileLogger

    from stapo.quickstart import task
    from stapo.quickstart.tiny import build_model, build_tokenizer

    root = tmp_path_factory.mktemp("assets")
    tokenizer = build_tokenizer(["What is 6 times 7? \\boxed{42}"] * 20, root / "model", vocab_size=300)
    build_model(tokenizer, root / "model", hidden_size=64, num_layers=1)
    splits = task.generate_word(seed=0, n_train=20, n_val=5, difficulty=1)
    task.write_task(splits, root / "task", seed=0, data_source=task.WORD_DATA_SOURCE)
    (root / "evaldata").mkdir()
    shutil.copy(root / "task" / "validation.parquet", root / "evaldata" / "aime24.parquet")
    eval_samples(tokenizer, root / "samples.jsonl")
    shutil.copy(FIXTURES / "dapo_math_17k_sample.jsonl", root / "dapo.jsonl")
    rows = [{"problem": f"What is {i} + {i}?", "answer": str(2 * i), "id": i} for i in range(3)]
    (root / "aime24.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    shutil.copytree(FIXTURES / "report_runs", root / "summaries")
    write_gguf(root / "small.gguf")
    invariance = {"setting": "fa2", "greedy": False, "eager": True, "requests": 2, "compositions": {}}
    (root / "invariance.json").write_text(json.dumps(invariance))
    (root / "replayed").mkdir()  # what `replay run --twin --out replayed` leaves: its verdicts
    (root / "replayed" / "replay.json").write_text(json.dumps({"twin": {"failed": "see replayed/runs/twin"}}))
    (root / "repo" / "docs" / "evidence").mkdir(parents=True)
    (root / "repo" / "docs" / "evidence" / "page.md").write_text("# a page without generated blocks\n")
    for path in (root / "metrics.jsonl", root / "experiment" / "runs" / "justrl-s0" / "metrics.jsonl"):
        path.parent.mkdir(parents=True, exist_ok=True)
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("VERL_FILE_LOGGER_PATH", str(path))
            logger = FileLogger("stapo", "misuse")
            for step in (1, 2):
                logger.log({"critic/score/mean": 0.5, "actor/entropy": 0.3, "timing_s/step": 4.0}, step=step)
            logger.finish()
    (root / "experiment" / "experiment.json").write_text(json.dumps({"steps": "2"}))
    return root


def bad_value(kind: str, token: str, work: Path) -> str:
    """The input ``token`` of :data:`INPUTS` made real in ``work``."""
    bad = work.parent / "bad"
    bad.mkdir(exist_ok=True)
    (bad / "a-file").write_text("x")
    (bad / "a-folder").mkdir(exist_ok=True)
    (bad / "empty.jsonl").write_text("")
    (bad / "junk.bin").write_bytes(b"\x00\xffjunk\x13")
    return {
        "<missing>": str(bad / "missing"),
        "<folder>": str(bad / "a-folder"),
        "<file>": str(bad / "a-file"),
        "<empty>": str(bad / "empty.jsonl"),
        "<junk>": str(bad / "junk.bin"),
        "<under-file>": str(bad / "a-file" / "under"),
    }.get(token, token)


def generated_cases():
    """(command, option, kind, input) for every option of every entry point, from the parsers."""
    found = []
    for command, module, entry, argv in cases():
        parser, namespace = capture_parser(module, argv)
        for action in parser._actions:
            kind = option_kind(entry, action, getattr(namespace, action.dest, None)) if action.dest != "help" else None
            for token in INPUTS.get(kind, ()):
                name = action.option_strings[0] if action.option_strings else action.dest
                found.append(pytest.param(command, name, kind, token, id=f"{command} {name} {token}"))
    return found


def with_value(command: str, parser: argparse.ArgumentParser, argv: list[str], name: str, value: str) -> list[str]:
    """``argv`` with option (or positional) ``name`` given ``value`` alone."""
    action = next(a for a in parser._actions if name in a.option_strings or (not a.option_strings and a.dest == name))
    if action.option_strings:
        out, i = [], 0
        while i < len(argv):
            if argv[i] in action.option_strings:  # drop the option and its values
                i += 1
                while i < len(argv) and not argv[i].startswith("--"):
                    i += 1
                continue
            out.append(argv[i])
            i += 1
        return [*out, name, value]
    if action.nargs == "*" and action.dest == "overrides":  # Hydra overrides, after '--'
        return [*argv, "--", value]
    positionals = [a for a in parser._actions if not a.option_strings and a.dest != "help"]
    start = 1 if " " in command else 0  # after the sub-command
    end = next((i for i in range(start, len(argv)) if argv[i].startswith("--")), len(argv))
    given, index = argv[start:end], positionals.index(action)
    given[index:] = [value, *given[index + 1 :]] if action.nargs not in ("+", "*") else [value]
    return [*argv[:start], *given, *argv[end:]]


def tree(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*")}


def run_case(command: str, argv: list[str], monkeypatch, capsys, work: Path, vllm: bool = True) -> tuple[str, str]:
    """Run the entry point (with vLLM taken as installed, unless ``vllm`` is False); ("reached" | "returned" | "exit
    CODE", what it printed)."""
    entry = ENTRIES[command]
    module = importlib.import_module(command.split()[0])

    def tripwire(*args, **kwargs):
        raise Reached

    for target in entry.work:
        monkeypatch.setattr(*resolve(target), tripwire)
    for target in entry.after:
        owner, name = resolve(target)

        def checked(*args, _original=getattr(owner, name), **kwargs):
            _original(*args, **kwargs)  # stops the entry point on a problem
            raise Reached

        monkeypatch.setattr(owner, name, checked)
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: entry.gpus)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: entry.gpus > 0)
    from stapo.checks import batch_invariance, benchmark
    from stapo.tools import evaluate, probe
    from stapo.train import preflight

    if vllm:  # vLLM cannot exist here
        monkeypatch.setattr(evaluate.VLLMGenerator, "check", staticmethod(lambda: None))
        for tool in (batch_invariance, benchmark, probe):
            monkeypatch.setattr(tool, "vllm_missing", lambda what: None)
    monkeypatch.setattr(preflight, "_gcs_servers", lambda: [])  # other processes' Ray clusters
    monkeypatch.chdir(work)
    try:
        module.main(argv)
        outcome, message = "returned", ""
    except Reached:
        outcome, message = "reached", ""
    except SystemExit as stop:
        code = stop.code
        outcome = f"exit {0 if code is None else 1 if isinstance(code, str) else code}"
        message = code if isinstance(code, str) else ""
    printed = capsys.readouterr()
    return outcome, "\n".join(filter(None, [printed.err, printed.out, message]))


# ---------------------------------------------------------------------------------------------------------- tests
def test_every_entry_point_is_in_the_table():
    """Every module of the package with a command-line ``main`` (and each of its sub-commands) has a row."""
    listed = {command.split()[0] for command in ENTRIES}
    found = set()
    for info in pkgutil.walk_packages(stapo.__path__, "stapo."):
        if info.ispkg or info.name in ("stapo.train.main", "stapo.train.__main__", "stapo.quickstart.__main__"):
            continue
        source = Path(importlib.util.find_spec(info.name).origin).read_text()
        if "def main(" in source and "argparse" in source:
            found.add(info.name)
    assert found == listed
    for command, module, entry, argv in cases():
        parser, _ = capture_parser(module, argv)
        top = parser if " " not in command else None
        assert top is not None or parser.prog.endswith(command.split()[1]), command


@pytest.mark.parametrize("command", list(ENTRIES))
def test_each_valid_command_line_reaches_its_work(command, assets, tmp_path, monkeypatch, capsys):
    """The rows' command lines are valid, so that each bad input below is the only thing wrong with its case."""
    argv = [a.replace("{A}", str(assets)).replace("{W}", str(tmp_path)) for a in ENTRIES[command].argv]
    outcome, printed = run_case(command, argv, monkeypatch, capsys, tmp_path)
    assert outcome in ("reached", "returned", "exit 0"), printed[-2000:]


@pytest.mark.parametrize("command", [c for c in ENTRIES if c.startswith(("stapo.tools.evaluate", "stapo.tools.probe",
                                     "stapo.checks.benchmark vllm", "stapo.checks.batch_invariance run",
                                     "stapo.checks.batch_invariance locate"))])  # fmt: skip
def test_a_tool_that_generates_with_vllm_says_so_in_one_line_where_it_is_missing(
    command, assets, tmp_path, monkeypatch, capsys
):
    """A valid command line on a machine without vLLM: one line that names vLLM and how to install it, before the work
    and with nothing written."""
    import sys

    monkeypatch.setitem(sys.modules, "vllm", None)  # as after a failed import of it
    argv = [a.replace("{A}", str(assets)).replace("{W}", str(tmp_path)) for a in ENTRIES[command].argv]
    before = tree(tmp_path)
    outcome, printed = run_case(command, argv, monkeypatch, capsys, tmp_path, vllm=False)
    errors = [line for line in printed.splitlines() if "error:" in line]
    assert outcome.startswith("exit") and outcome != "exit 0" and "Traceback" not in printed, printed[-2000:]
    assert len(errors) == 1 and "needs vLLM, which is not installed" in errors[0] and "pip install" in errors[0]
    assert tree(tmp_path) == before


GPU_TOOLS = [(c, []) for c in ENTRIES if ENTRIES[c].gpus] + [("stapo.checks.scale model", ["--device", "cuda"])]
"""The table's GPU tools, and a command line that asks for a GPU: (command, options added to its valid line)."""


@pytest.mark.parametrize("command, extra", GPU_TOOLS)
def test_a_gpu_tool_where_no_gpu_is_visible_says_so_in_one_line(command, extra, assets, tmp_path, monkeypatch, capsys):
    """A valid command line of a tool that runs on GPUs, on a machine without one (the device count's stand-in is
    0): one line that says so, before the work and with nothing written."""
    monkeypatch.setitem(ENTRIES, command, dataclasses.replace(ENTRIES[command], gpus=0))
    argv = [a.replace("{A}", str(assets)).replace("{W}", str(tmp_path)) for a in [*ENTRIES[command].argv, *extra]]
    before = tree(tmp_path)
    outcome, printed = run_case(command, argv, monkeypatch, capsys, tmp_path)
    errors = [line for line in printed.splitlines() if "error:" in line]
    assert outcome.startswith("exit") and outcome != "exit 0" and "Traceback" not in printed, printed[-2000:]
    assert len(errors) == 1 and "GPU" in errors[0], printed[-2000:]
    assert tree(tmp_path) == before


@pytest.mark.parametrize("command, name, kind, token", generated_cases())
def test_bad_input_is_one_line_and_leaves_nothing(
    command, name, kind, token, assets, tmp_path, monkeypatch, capsys, read_only
):
    work = tmp_path / "work"
    work.mkdir()
    value = str(read_only(tmp_path / "read-only") / "out") if token == "<read-only>" else bad_value(kind, token, work)
    argv = [a.replace("{A}", str(assets)).replace("{W}", str(work)) for a in ENTRIES[command].argv]
    parser, _ = capture_parser(command.split()[0], argv)
    argv = with_value(command, parser, argv, name, value)
    before = tree(work)
    outcome, printed = run_case(command, argv, monkeypatch, capsys, work)
    meaning = MEANINGS.get(name, {}).get(token)
    if meaning:
        assert outcome in ("reached", "returned", "exit 0"), f"{name} {token} means {meaning}: {printed[-1500:]}"
        return
    errors = [line for line in printed.splitlines() if "error:" in line]
    assert outcome not in ("reached", "returned", "exit 0"), f"{' '.join(argv)} was accepted: {printed[-1500:]}"
    assert "Traceback" not in printed and len(errors) == 1, printed[-3000:]
    names = {name, name.lstrip("-"), name.lstrip("-").replace("-", "_"), value, Path(value).name}
    assert any(n in errors[0] for n in names), f"the line names neither {name} nor its value: {errors[0]}"
    assert tree(work) == before, f"left behind: {sorted(tree(work) - before)}"


# ---------------------------------------------------------------------------------------------- the trainer's keys
OUT_OF_RANGE = {
    "count": ("abc", "0", "-1", "1.5"),
    "frequency": ("abc", "1.5", "-2"),
    "positive": ("abc", "0", "-1", "nan"),
    "share": ("abc", "0", "1.5"),
    "fraction": ("abc", "-0.1", "1.5"),
}
"""Rule of :data:`stapo.train.preflight.RANGES` -> values outside it."""
DATA_FILES = ("<no-rows>", "<int-prompt>", "<text-reward>")
"""Training parquets that verl would fail on after start-up (:func:`bad_parquet`)."""


def trainer_cases():
    from stapo.config import StapoConfig
    from stapo.train.preflight import RANGES

    found = [(key, value) for key, (rule, _) in RANGES.items() for value in OUT_OF_RANGE[rule]]
    for option in StapoConfig.__dataclass_fields__:
        found.append((f"stapo.{option}", "junk"))
    found += [("stapo.tau_p", "0"), ("stapo.tau_p", "5"), ("stapo.q", "-1"), ("stapo.top_entropy_ratio", "0")]
    found += [(key, token) for key in ("data.train_files", "data.val_files") for token in INPUTS["file"] + DATA_FILES]
    found += [("actor_rollout_ref.model.path", token) for token in ("<missing>", "<file>", "<folder>")]
    found += [("data.train_files", "[]"), ("trainer.default_local_dir", "<read-only>")]
    found += [("actor_rollout_ref.actor.ppo_mini_batch_size", "48"), ("trainer.n_gpus_per_node", "3")]
    found += [("+trainer.totl_training_steps", "5"), ("+actor_rollout_ref.actor.optim.lrr", "1e-6")]
    return [pytest.param(key, value, id=f"{key}={value}") for key, value in found]


def bad_parquet(token: str, valid: Path, folder: Path) -> Path:
    """The training file ``valid`` with no rows, integer prompts, or text where ``reward_model`` is a struct."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pq.read_table(valid)
    rows = table.num_rows
    if token == "<no-rows>":
        table = table.slice(0, 0)
    elif token == "<int-prompt>":
        table = table.set_column(table.schema.get_field_index("prompt"), "prompt", pa.array(range(rows)))
    else:
        column = table.schema.get_field_index("reward_model")
        table = table.set_column(column, "reward_model", pa.array(["42"] * rows))
    folder.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, folder / f"{token.strip('<>')}.parquet")
    return folder / f"{token.strip('<>')}.parquet"


@pytest.fixture(scope="module")
def trainer_overrides(assets, tmp_path_factory):
    """Overrides that make the STAPO config valid on this machine (files of the assets, a new checkpoint folder)."""
    valid = [f"data.train_files={assets}/task/train.parquet", f"data.val_files={assets}/task/validation.parquet"]
    return valid + [
        f"actor_rollout_ref.model.path={assets}/model",
        f"trainer.default_local_dir={tmp_path_factory.mktemp('ckpt')}",
    ]


@pytest.fixture
def trainer_checks(monkeypatch):
    """:func:`stapo.train.main.validate` of the STAPO config with overrides, as the entry point runs it before Ray;
    the GPU count is stubbed (the machine has none) and other processes' Ray clusters are not looked at."""
    from hydra import compose, initialize_config_dir

    from stapo.config import CONFIG_DIR
    from stapo.train import preflight
    from stapo.train.main import validate

    monkeypatch.setattr(preflight, "local_gpus", lambda: 8)
    monkeypatch.setattr(preflight, "_gcs_servers", lambda: [])
    monkeypatch.delenv("RAY_ADDRESS", raising=False)

    def check(overrides):
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
            validate(compose("stapo", overrides), environment=True, overrides=overrides)

    return check


def test_the_valid_trainer_config_passes(trainer_checks, trainer_overrides):
    trainer_checks(trainer_overrides)


@pytest.mark.parametrize("key, token", trainer_cases())
def test_every_typed_key_of_the_trainer_is_checked(
    key, token, trainer_checks, trainer_overrides, assets, tmp_path, read_only
):
    """``python -m stapo.train``'s checks refuse each bad value with one line naming its key."""
    from stapo.train.main import ConfigError

    value = token
    if token == "<read-only>":
        value = str(read_only(tmp_path / "read-only") / "ckpt")
    elif token in DATA_FILES:
        value = str(bad_parquet(token, assets / "task" / "train.parquet", tmp_path / "data"))
    elif token.startswith("<"):
        value = bad_value("file", token, tmp_path / "work")
    with pytest.raises(ConfigError) as refused:
        trainer_checks([*trainer_overrides, f"{key}={value}"])
    lines = str(refused.value).splitlines()
    assert len(lines) == 1 and (key in lines[0] or value in lines[0]), lines


@pytest.fixture(scope="module")
def valid_trainer_config(trainer_overrides):
    from hydra import compose, initialize_config_dir

    from stapo.config import CONFIG_DIR

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return compose("stapo", trainer_overrides)


def verl_numeric_keys() -> list[str]:
    from stapo.train.preflight import verl_numbers

    return sorted(verl_numbers())


@pytest.mark.parametrize("key", verl_numeric_keys())
def test_every_numeric_key_of_verl_refuses_text(key, valid_trainer_config):
    """Each int or float key of verl's own config (found in it, so that a key verl adds is covered too) set to text
    is refused with one line naming it, before anything else is checked."""
    from omegaconf import OmegaConf

    from stapo.train.main import ConfigError, validate

    config = copy.deepcopy(valid_trainer_config)
    OmegaConf.update(config, key, "abc")
    with pytest.raises(ConfigError) as refused:
        validate(config, environment=False)
    lines = str(refused.value).splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{key}=abc: must be"), lines


@pytest.mark.parametrize(
    "argv, quoted",
    [
        (["data.train_files=outputs/ü/train.parquet"], """'data.train_files="outputs/ü/train.parquet"'"""),
        (["data.train_files=my", "data/train.parquet"], """'data.train_files="my data/train.parquet"'"""),
    ],
    ids=["non-ascii", "space"],
)
def test_an_override_hydra_cannot_parse_is_one_line_showing_the_quoting(argv, quoted, tmp_path, monkeypatch, capsys):
    """A value with a non-ASCII letter, or one the shell split at a space (``$STAPO_DATA`` holding one): one line that
    shows the override quoted, before Hydra (``LexerNoViableAltException``) and before anything is written."""
    from stapo.train import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.argv", ["stapo.train", "--config-name=stapo", "stapo.mask=s2t", *argv])
    with pytest.raises(SystemExit) as stopped:
        main.main()
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert stopped.value.code == 2 and line.startswith("error: ") and f"quote the value: {quoted}" in line
    assert list(tmp_path.iterdir()) == []
