"""The masking ablation's pilot reading (stapo.tools.selection, issue 66) on constructed runs written by verl's own
FileLogger: the drift and the reward's fall at their edges, the pick (the lowest learning rate that drifts in every
seed without collapsing), the power arithmetic against published t quantiles, and the script that runs the pilot."""

from __future__ import annotations

import math
import shlex
from pathlib import Path

import pytest
import standins
from verl.utils.tracking import FileLogger

from stapo.quickstart import experiment as ex
from stapo.tools import selection as sel


def write_run(monkeypatch, folder: Path, name: str, entropy, reward, accuracy=None, steps: int = 30):
    run = folder / "runs" / name
    run.mkdir(parents=True)
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(run / "metrics.jsonl"))
    logger = FileLogger("stapo", "pilot")
    for step in range(1, steps + 1):
        data = {"actor/entropy": entropy(step), "critic/score/mean": reward(step), "timing_s/step": 60.0 if step == 1
                else 30.0}  # fmt: skip
        if accuracy and step % 10 == 0:
            data["val-core/word/acc/mean@4"] = accuracy(step)
        logger.log(data, step)
    logger.finish()


def test_drift_and_fall():
    assert sel.drift({s: 1.0 + 0.1 * s for s in range(1, 31)}) == pytest.approx(2.5)  # steps 26-30 vs 1-5
    assert math.isnan(sel.drift({s: 1.0 for s in range(1, 10)}))
    fallen = sel.fall({s: 0.2 if s <= 10 else 0.05 for s in range(1, 31)})
    assert fallen.peak == pytest.approx(0.2) and fallen.last == pytest.approx(0.05) and fallen.collapsed
    assert not sel.fall({s: 0.2 for s in range(1, 31)}).collapsed


@pytest.mark.parametrize(("p", "df", "t"), [(0.025, 9, 2.262), (0.2, 9, 0.883), (0.05, 3, 2.353)])
def test_t_quantiles_match_the_tables(p, df, t):
    assert sel.t_quantile(p, df) == pytest.approx(t, abs=1e-3)


def test_the_detectable_effect():
    assert sel.detectable(1.0) == pytest.approx((2.2622 + 0.8834) / math.sqrt(10), abs=1e-3)
    assert sel.detectable(0.04) == pytest.approx(0.04 * sel.detectable(1.0))


def test_the_pilot_picks_the_lowest_rate_that_drifts_in_every_seed(monkeypatch, tmp_path, capsys):
    flat, rising, crash = (lambda s: 1.0), (lambda s: 1.0 + 0.04 * s), (lambda s: 0.3 if s < 20 else 0.01)
    steady, acc = (lambda s: 0.3), (lambda seed: lambda s: 0.40 + 0.001 * s + 0.01 * seed)
    write_run(monkeypatch, tmp_path, "justrl_lr1e-05-s30", flat, steady, acc(0))  # no drift
    write_run(monkeypatch, tmp_path, "justrl_lr1e-05-s31", rising, steady, acc(1))
    write_run(monkeypatch, tmp_path, "justrl_lr2e-05-s30", rising, steady, acc(0))
    write_run(monkeypatch, tmp_path, "justrl_lr2e-05-s31", rising, steady, acc(2))
    write_run(monkeypatch, tmp_path, "justrl_lr5e-05-s30", rising, crash, acc(0))  # drifts but collapses
    write_run(monkeypatch, tmp_path, "justrl_lr5e-05-s31", rising, steady, acc(1))
    rows = sel.pilot_rows(ex.read_runs(tmp_path))
    assert [r["lr"] for r in rows] == ["1e-05"] * 2 + ["2e-05"] * 2 + ["5e-05"] * 2
    assert rows[2]["drift"] == pytest.approx(1.0) and rows[2]["step_s"] == 30.0
    assert rows[2]["endpoint"] == pytest.approx(0.425)  # validations at 20 and 30: 0.42, 0.43
    pick, lines = sel.reading(rows)
    assert pick == "2e-05" and lines[0].endswith("does not") and lines[1].endswith("drifts")
    assert lines[2] == "lr 5e-05: drift +1.00, +1.00 nats, 1 of 2 collapsed: does not"
    spread = 0.02  # √2 × the sd of two endpoints 0.02 apart (lr 2e-5's seeds 30 and 31)
    assert f"detect about {sel.detectable(spread):.3f}" in lines[-1]
    capsys.readouterr()
    sel.main(["pilot", str(tmp_path)])
    shown = capsys.readouterr().out
    assert "| justrl_lr2e-05-s31 | 2e-05 | 31 | 30 | +1.000 | 0.300 / 0.300 | no | 30.0 |" in shown
    assert (tmp_path / "pilot.md").read_text() == shown and "- pick: lr 2e-05 (the lowest that drifts)" in shown


def test_no_rate_that_drifts_is_said(monkeypatch, tmp_path):
    write_run(monkeypatch, tmp_path, "justrl_lr2e-05-s30", lambda s: 1.0, lambda s: 0.3)
    pick, lines = sel.reading(sel.pilot_rows(ex.read_runs(tmp_path)))
    assert pick is None and lines[-1].startswith("no learning rate drifted by 0.5 nats")


def test_the_pilot_script_runs_the_ladders_model_and_four_justrl_runs(tmp_path):
    """scripts/gpu/selection.sh as printed, from a folder that does not exist yet, with a stand-in for the Python
    that would train (it needs a GPU): the ladder's conversion, task and warm-up, then `experiment run` with
    arguments the real parser accepts and a config that passes the trainer's checks, then the pilot's reading."""
    out, src = tmp_path / "new" / "sel", tmp_path / "sm.gguf"
    src.write_bytes(b"GGUF")
    done, lines = standins.run_gpu_script(tmp_path, "selection.sh", standins.LOGGING_SH, "pilot", out, "--src", src)
    assert done.returncode == 0, done.stderr
    assert [line.split()[1] for line in lines] == ["stapo.tools.pretrained", "stapo.quickstart.task",
        "stapo.quickstart.warmup", "stapo.quickstart.experiment", "stapo.tools.selection"]  # fmt: skip
    args = ex.build_parser().parse_args(shlex.split(lines[3])[2:])
    assert args.methods == ["justrl"] and args.seeds == [30, 31] and args.lrs == [2e-5, 5e-5] and args.steps == 30
    assert "actor_rollout_ref.rollout.temperature=1.2" in args.overrides
    ex.check_overrides(args)
    assert lines[4] == f"-m stapo.tools.selection pilot {out}/pilot"
    refused = standins.run_gpu_script(tmp_path, "selection.sh", "", "block", out)[0]
    assert refused.returncode == 2 and "the one stage is pilot" in refused.stderr
