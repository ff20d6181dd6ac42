"""The masking ablation's pilot reading (stapo.tools.selection, issue 66) on constructed runs written by verl's own
FileLogger: the drift and the reward's fall at their edges, the pick (the lowest learning rate that drifts in every
seed without collapsing), the power arithmetic against published t quantiles, and the script that runs the pilot."""

from __future__ import annotations

import json
import math
import shlex
from pathlib import Path

import pytest
import standins
from verl.utils.tracking import FileLogger

from stapo.quickstart import experiment as ex
from stapo.tools import evidence
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
    refused = standins.run_gpu_script(tmp_path, "selection.sh", "", "main", out)[0]
    assert refused.returncode == 2 and refused.stderr == "error: main: the stages are pilot and block\n"


def test_a_block_runs_three_arms_on_its_two_seeds(tmp_path):
    """scripts/gpu/selection.sh block as printed, the same way: the ladder once, then one block's six runs at the
    given learning rate and steps, with arguments the real parser accepts, and the block's rows by the verdict's code;
    a block outside 1-5 is refused before any work."""
    out, src = tmp_path / "new" / "sel", tmp_path / "sm.gguf"
    src.write_bytes(b"GGUF")
    done, lines = standins.run_gpu_script(tmp_path, "selection.sh", standins.LOGGING_SH, "block", 3, out, "2e-5", 40,
                                          "--src", src)  # fmt: skip
    assert done.returncode == 0, done.stderr
    args = ex.build_parser().parse_args(shlex.split(lines[3])[2:])
    assert args.methods == ["justrl", "stapo", "stapo_random"] and args.seeds == [24, 25] and args.lrs == [2e-5]
    assert args.steps == 40 and args.runs_per_gpu == 6 and args.out == out / "selection-3"
    assert [r.name for r in ex.plan(args.methods, args.seeds, lrs=args.lrs)][:4] == [
        "justrl_lr2e-05-s24", "stapo_lr2e-05-s24", "stapo_random_lr2e-05-s24", "stapo_random_lr2e-05-s25"]  # fmt: skip
    ex.check_overrides(args)
    assert lines[4] == f"-m stapo.tools.selection verdict {out}/selection-3"
    for bad, said in ((6, "error: block 6: a block is 1, 2, 3, 4 or 5"), ("x", "error: block x: a block is")):
        (tmp_path / str(bad)).mkdir()
        refused, calls = standins.run_gpu_script(
            tmp_path / str(bad), "selection.sh", standins.LOGGING_SH, "block", bad, out, "2e-5", 40
        )
        assert refused.returncode == 2 and refused.stderr.startswith(said) and calls == []


def test_tost_against_the_t_table():
    a = 3 * sel.MARGIN / 1.8331  # t(0.95, 9): ±a five times each has mean 0 and standard error a / 3
    assert sel.tost([a, -a] * 5) == pytest.approx(0.05, abs=1e-4)
    shifted = [d + 0.01 for d in [a, -a] * 5]  # the nearer bound decides: (0.02 - 0.01) / (a / 3) = 0.9166
    assert sel.tost(shifted) == pytest.approx(sel.t_sf(0.9166, 9), abs=1e-4) and sel.tost(shifted) > 0.05
    assert sel.tost([0.001] * 10) == 0.0 and sel.tost([0.03] * 10) == 1.0


def write_block(monkeypatch, folder: Path, seeds, accuracy, slope=lambda arm, seed: 0.2, silenced=lambda arm, seed: 3,
                steps: int = 10, settings: dict | None = None, lr: str = ""):  # fmt: skip
    """A block of the main runs as `experiment run` writes it: experiment.json, and per arm and seed a run whose
    entropy rises by ``slope`` a step, validated at steps 5 and 10 with ``accuracy(arm, seed)``, silencing
    ``silenced(arm, seed)`` of 4 candidates a step; a run with ``accuracy`` None stops at step 7."""
    folder.mkdir(parents=True)
    (folder / "experiment.json").write_text(json.dumps(settings or {"steps": "10", "model": str(folder)}))
    for arm in sel.ARMS:
        for seed in seeds:
            acc, rate, quiet = accuracy(arm, seed), slope(arm, seed), silenced(arm, seed)
            run = folder / "runs" / f"{arm}{lr and '_lr' + lr}-s{seed}"
            run.mkdir(parents=True)
            monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(run / "metrics.jsonl"))
            logger = FileLogger("stapo", "main")
            for step in range(1, (steps if acc is not None else 7) + 1):
                data = {"actor/entropy": 1.0 + rate * step, "critic/score/mean": 0.3, "s2t/candidate_tokens": 4.0,
                        "s2t/spurious_tokens": float(quiet), "s2t/mismatch/spurious_logp": 0.1 * (step % 2),
                        "s2t/mismatch/kept_candidate_logp": 0.05, "s2t/mismatch/spurious_is_weight": 0.9,
                        "s2t/mismatch/kept_candidate_is_weight": math.nan}  # fmt: skip
                if step % 5 == 0:
                    data["val-core/word/acc/mean@4"] = acc
                logger.log(data, step)
            logger.finish()


def main_blocks(monkeypatch, tmp_path, accuracy, **kwargs):
    blocks = [tmp_path / f"selection-{n}" for n in range(1, 6)]
    for n, block in enumerate(blocks):
        write_block(monkeypatch, block, (20 + 2 * n, 21 + 2 * n), accuracy, **kwargs)
    return blocks


def noise(seed: int) -> float:
    return ((seed * 7919) % 11 - 5) / 1000  # a fixed spread of ±0.5 points across seeds


def test_the_verdict_says_stapo_beats_random_and_justrl(monkeypatch, tmp_path, capsys):
    gains = {"justrl": 0.0, "stapo_random": 0.01, "stapo": 0.05}
    blocks = main_blocks(
        monkeypatch, tmp_path, lambda arm, seed: 0.4 + gains[arm] + (noise(seed) if arm == "stapo" else 0.0), lr="2e-05"
    )  # fmt: skip; the runs named as `experiment run --lrs` names them
    tables, lines = sel.report(blocks)
    assert lines[0].startswith(sel.VERDICT + "STAPO − random +4.0 points") and lines[0].endswith(
        "Holm significant: S2T's choice of tokens matters here"
    )
    assert lines[1].startswith(sel.VERDICT + "STAPO − JustRL +5.0 points") and "STAPO beats JustRL" in lines[1]
    assert "| selection-3 | stapo-s24 | yes | +1.000 | " in tables and "| 0.750 |" in tables
    assert "| justrl-s20 | yes | +1.000 | 40.0 | 4.0 | (observed) | 0.050 / 0.050 | 0.900 / nan |" in tables
    capsys.readouterr()
    sel.main(["verdict", *map(str, blocks)])
    assert capsys.readouterr().out.rstrip().endswith(lines[1])


def test_a_null_reads_as_equivalence_within_the_margin(monkeypatch, tmp_path):
    blocks = main_blocks(monkeypatch, tmp_path, lambda arm, seed: 0.4 + (noise(seed) if arm == "stapo" else 0.0))
    lines = sel.report(blocks)[1]
    assert lines[0].endswith("the choice does not matter here") and "within ±2 (TOST p" in lines[0]
    assert lines[1].endswith(": not shown")
    wide = main_blocks(monkeypatch, tmp_path / "wide", lambda arm, seed: 0.4 + (10 * noise(seed) if arm == "stapo"
                       else 0.0))  # fmt: skip
    assert sel.report(wide)[1][0].endswith(": inconclusive")  # ±5 points of spread: neither shown


@pytest.mark.parametrize(
    ("case", "said"),
    [
        ("unfinished", "no verdict: 9 of 10 seeds have all three arms finished"),
        ("no drift", "regime not reached: JustRL drifted by 0.5 nats in 6 of 10 seeds (7 needed)"),
        ("idle mask", "no verdict: the mask did not act in stapo_random-s25"),
    ],
)
def test_the_checks_come_before_the_contrasts(monkeypatch, tmp_path, case, said):
    accuracy = (lambda arm, seed: None if (arm, seed) == ("stapo", 27) else 0.4) if case == "unfinished" else (
        lambda arm, seed: 0.4)  # fmt: skip
    slope = (lambda arm, seed: 0.0 if seed < 24 else 0.2) if case == "no drift" else (lambda arm, seed: 0.2)
    silenced = (lambda arm, seed: 1 if (arm, seed) == ("stapo_random", 25) else 3) if case == "idle mask" else (
        lambda arm, seed: 3)  # fmt: skip
    tables, lines = sel.report(main_blocks(monkeypatch, tmp_path, accuracy, slope=slope, silenced=silenced))
    assert lines == [sel.VERDICT + said]
    assert ("| stapo-s27 | no |" in tables) == (case == "unfinished")


def test_blocks_of_other_settings_or_a_run_finished_twice_are_refused(monkeypatch, tmp_path):
    one = tmp_path / "a"
    write_block(monkeypatch, one, (20,), lambda arm, seed: 0.4)
    other = tmp_path / "b"
    write_block(monkeypatch, other, (21,), lambda arm, seed: 0.4, settings={"steps": "10", "lrs": "[5e-05]"})
    with pytest.raises(sel.ReportError, match=r"b: lrs differ from .*a; the blocks share one regime"):
        sel.report([one, other])
    faster = tmp_path / "d"
    write_block(monkeypatch, faster, (22,), lambda arm, seed: 0.4, lr="5e-05")
    with pytest.raises(sel.ReportError, match=r"learning rates the experiment's and 5e-05 in .*d and .*a; the blocks"):
        sel.report([one, faster])
    again = tmp_path / "c"
    write_block(monkeypatch, again, (20,), lambda arm, seed: 0.4)
    with pytest.raises(sel.ReportError, match=r"c: justrl-s20 finished in two blocks; keep one"):
        sel.report([one, again])


def test_the_evidence_page_shows_the_verdict_its_records_give(monkeypatch, tmp_path):
    """A page's ``selection`` block (stapo.tools.evidence) is the table and verdict lines of the blocks it names, and
    a block naming a record that contradicts the others gets one line."""
    gains = {"justrl": 0.0, "stapo_random": 0.0, "stapo": 0.03}
    blocks = main_blocks(monkeypatch, tmp_path / "evidence", lambda arm, seed: 0.4 + gains[arm] + noise(seed))
    page = tmp_path / "docs" / "evidence" / "selection.md"
    page.parent.mkdir(parents=True)
    names = " ".join(b.name for b in blocks)
    page.write_text(f"# Selection\n\n<!-- evidence:selection {names} -->\n<!-- /evidence -->\n")
    assert evidence.regenerate(tmp_path, check=False) and evidence.regenerate(tmp_path, check=True) == []
    lines = sel.report(blocks)[1]
    shown = page.read_text()
    assert all(f"**{line}**" in shown for line in lines) and "S2T's choice of tokens matters here" in lines[0]
    write_block(monkeypatch, tmp_path / "evidence" / "selection-6", (20,), lambda arm, seed: 0.9)
    page.write_text(shown.replace(names, names + " selection-6"))
    with pytest.raises(evidence.EvidenceError, match="selection-6: justrl-s20 finished in two blocks; keep one"):
        evidence.regenerate(tmp_path, check=True)
