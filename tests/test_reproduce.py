"""``python -m stapo.checks.reproduce compare``: two runs' metrics step by step, through verl's own file logger, as a
resumed run leaves them (the steps before the checkpoint set aside as an earlier segment)."""

import pytest
from verl.utils.tracking import FileLogger

from stapo.checks import reproduce
from stapo.tools import curves
from stapo.tools.io import set_aside


def log(monkeypatch, path, steps, entropy=lambda step: 0.5 - 0.01 * step):
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(path))
    logger = FileLogger("stapo", "reproduce")
    for step in steps:
        logger.log({"critic/score/mean": 0.1 * step, "actor/entropy": entropy(step), "timing_s/step": 3.0 + step}, step)
    logger.finish()


def test_identical_runs_and_a_resumed_run_compare_equal(tmp_path, monkeypatch, capsys):
    log(monkeypatch, tmp_path / "a.jsonl", range(1, 7))
    log(monkeypatch, tmp_path / "resumed.jsonl", range(1, 4))  # killed after the step-3 checkpoint
    set_aside(tmp_path / "resumed.jsonl")  # what the trainer does on resume: resumed.1.jsonl
    log(monkeypatch, tmp_path / "resumed.jsonl", range(4, 7), entropy=lambda step: 0.5 - 0.01 * step)
    capsys.readouterr()  # verl's logger prints where it writes
    with pytest.raises(SystemExit) as done:
        reproduce.main(["compare", str(tmp_path / "a.jsonl"), str(tmp_path / "resumed.jsonl"), "--steps", "4-6",
                        "--out", str(tmp_path / "table.md")])  # fmt: skip
    printed = capsys.readouterr().out
    assert done.value.code == 0 and printed.endswith("verdict: identical to the bit\n")
    assert printed.count("| actor/entropy |") == 3 and "| actor/entropy | 1 |" not in printed  # steps 4-6 only
    assert (tmp_path / "table.md").read_text() == printed


def test_a_difference_is_named_with_its_size(tmp_path, monkeypatch, capsys):
    log(monkeypatch, tmp_path / "a.jsonl", range(1, 5))
    log(
        monkeypatch,
        tmp_path / "b.jsonl",
        range(1, 5),
        entropy=lambda step: 0.5 - 0.01 * step + (1e-6 if step == 3 else 0),
    )
    with pytest.raises(SystemExit) as done:
        reproduce.main(["compare", str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")])
    verdict = capsys.readouterr().out.splitlines()[-1]
    assert done.value.code == 1 and verdict.startswith("verdict: differ: actor/entropy (max |diff| 1e-06)")
    assert "timing_s/step" not in verdict and "critic/score/mean" not in verdict  # the step time is never compared
    with pytest.raises(SystemExit) as refused:
        reproduce.main(["compare", str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl"), "--steps", "6-4"])
    assert refused.value.code == 2 and "--steps 6-4: give FIRST-LAST" in capsys.readouterr().err


def test_all_compares_every_metric_but_time_and_memory(tmp_path, monkeypatch, capsys):
    """``--all``: a metric outside the main ones (here the learning rate) is compared too; time and memory never."""
    for name, lr in (("a", 1e-6), ("b", 2e-6)):
        monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(tmp_path / f"{name}.jsonl"))
        logger = FileLogger("stapo", "reproduce")
        for step in (1, 2):
            extra = {"actor/perf/max_memory_allocated_gb": step + lr, "perf/throughput": lr}
            logger.log({"actor/entropy": 0.5, "actor/lr": lr, "timing_s/gen": lr, **extra}, step)
        logger.finish()
    runs = [str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")]
    with pytest.raises(SystemExit) as main_keys:
        reproduce.main(["compare", *runs])
    assert main_keys.value.code == 0  # the main keys agree
    capsys.readouterr()
    with pytest.raises(SystemExit) as every:
        reproduce.main(["compare", *runs, "--all"])
    verdict = capsys.readouterr().out.splitlines()[-1]
    assert every.value.code == 1 and verdict == "verdict: differ: actor/lr (max |diff| 1e-06)"
    assert curves.every_key({"a": {}, "timing_s/x": {}}, {"b": {}}) == ("a", "b")  # one run's metric: compared


def test_where_two_runs_part(tmp_path, monkeypatch):
    """:func:`stapo.tools.curves.parting`: the first step at which any metric differs and which metrics do there; a
    NaN on both sides is equal, a metric one run alone logged differs without a step."""
    nan = float("nan")
    log(monkeypatch, tmp_path / "a.jsonl", range(1, 5), entropy=lambda step: nan if step == 1 else 0.5)
    log(monkeypatch, tmp_path / "b.jsonl", range(1, 5), entropy=lambda step: {1: nan, 3: 0.6}.get(step, 0.5))
    a, b = curves.read_metrics(tmp_path / "a.jsonl"), curves.read_metrics(tmp_path / "b.jsonl")
    b["actor/grad_norm"] = {1: 1.0}
    found = curves.parting(curves.compare(a, b, curves.every_key(a, b)))
    assert found == {"equal": ["critic/score/mean"], "differ": ["actor/entropy", "actor/grad_norm"],
                     "one_sided": ["actor/grad_norm"], "first_step": 3, "first_metrics": ["actor/entropy"]}  # fmt: skip
    same = curves.parting(curves.compare(a, a, curves.every_key(a, a)))
    assert same["first_step"] is None and same["first_metrics"] == [] and same["differ"] == []
