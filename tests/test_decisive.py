"""The pre-registered decisive test (docs/experiments.md section 11) on constructed runs: the endpoint ρ and the
collapse rule at their edges, the statistics against published values, each reading, and the verdict line from
metrics written by verl's own FileLogger and read back by ``experiment decisive``."""

from __future__ import annotations

import pytest
import standins
from verl.utils.tracking import FileLogger

from stapo.quickstart import experiment as ex
from stapo.tools import decisive as dv


def rewards(peak: float, last: float) -> dict[int, float]:
    """20 steps: rising to ``peak`` over steps 1-5 (held through 10), then falling linearly to ``last`` (16-20)."""
    series = {s: peak for s in range(1, 11)}
    series |= {s: peak + (last - peak) * (s - 10) / 6 for s in range(11, 16)}
    return series | {s: last for s in range(16, 21)}


def test_rho_is_the_last_five_steps_over_the_highest_five_step_mean():
    e = dv.endpoint(rewards(0.12, 0.03))
    assert e.peak == pytest.approx(0.12) and e.last == pytest.approx(0.03) and e.rho == pytest.approx(0.25)
    assert e.collapsed


@pytest.mark.parametrize(
    ("peak", "last", "collapsed"),
    [
        (0.12, 0.06, True),  # ρ = 0.5 exactly, drop 0.06
        (0.12, 0.0601, False),  # ρ just above 0.5
        (0.05, 0.02, True),  # drop 0.03 exactly
        (0.04, 0.011, False),  # ρ < 0.5 but a drop of 0.029: too small to call
        (0.5, 0.45, False),
    ],
)
def test_the_collapse_rule_at_its_edges(peak, last, collapsed):
    assert dv.endpoint(rewards(peak, last)).collapsed is collapsed


def test_a_missing_step_is_refused_and_steps_past_20_are_ignored():
    with pytest.raises(ValueError, match=r"missing at steps \[7\]"):
        dv.endpoint({s: 0.1 for s in range(1, 21) if s != 7})
    assert dv.endpoint(rewards(0.1, 0.1) | {21: 0.9}).peak == pytest.approx(0.1)


@pytest.mark.parametrize(
    ("t", "df", "p"),
    [(2.353, 3, 0.05), (4.541, 3, 0.01), (1.0, 1, 0.25), (2.920, 2, 0.05), (2.132, 4, 0.05), (0.0, 3, 0.5)],
)
def test_the_t_tail_matches_the_tables(t, df, p):
    assert dv.t_sf(t, df) == pytest.approx(p, abs=2e-4)
    assert dv.t_sf(-t, df) == pytest.approx(1 - p, abs=2e-4)


def test_fisher_and_holm():
    assert dv.fisher_less(0, 4, 4) == pytest.approx(1 / 70)  # all four collapses in the other arm
    assert dv.fisher_less(2, 2, 4) == pytest.approx(53 / 70)
    assert dv.holm([0.02, 0.04]) == [True, True]
    assert dv.holm([0.03, 0.04]) == [False, False]  # 0.03 > 0.05 / 2
    assert dv.holm([0.01, 0.2]) == [True, False]


def arm(*pairs):
    return {seed: dv.endpoint(rewards(*pair)) for seed, pair in zip((10, 11), pairs)}


BROKEN, HELD = (0.12, 0.02), (0.12, 0.11)


def test_the_readings_of_round_one():
    not_reproduced = {"justrl": arm(BROKEN, HELD), "stapo": arm(BROKEN, BROKEN), "stapo_random": arm(BROKEN, BROKEN)}
    assert dv.reading([not_reproduced]) == "not_reproduced"
    fails = {"justrl": arm(BROKEN, BROKEN), "stapo": arm(BROKEN, BROKEN), "stapo_random": arm(HELD, HELD)}
    assert dv.reading([fails]) == "does_not_prevent"
    one_held = {"justrl": arm(BROKEN, BROKEN), "stapo": arm(BROKEN, HELD), "stapo_random": arm(BROKEN, BROKEN)}
    assert dv.reading([one_held]) == "pending"


def second(*stapo, random=(BROKEN, BROKEN)):
    return {
        "justrl": {s + 2: e for s, e in arm(BROKEN, BROKEN).items()},
        "stapo": {s + 2: e for s, e in arm(*stapo).items()},
        "stapo_random": {s + 2: e for s, e in arm(*random).items()},
    }


def test_the_readings_after_two_rounds():
    first = {"justrl": arm(BROKEN, BROKEN), "stapo": arm(HELD, HELD), "stapo_random": arm(BROKEN, BROKEN)}
    held = [first, second((0.12, 0.10), (0.12, 0.115))]
    assert dv.reading(held) == "prevents_choice"
    c = dv.contrasts(held)
    assert [x.other for x in c] == ["justrl", "stapo_random"] and all(x.significant for x in c)
    assert c[0].fisher_p == pytest.approx(1 / 70)
    like_random = [first | {"stapo_random": arm(HELD, HELD)}, second(HELD, (0.12, 0.10), random=(HELD, (0.12, 0.1)))]
    assert dv.reading(like_random) == "prevents_count"
    mixed = {"justrl": arm(BROKEN, BROKEN), "stapo": arm(BROKEN, (0.12, 0.07)), "stapo_random": arm(BROKEN, BROKEN)}
    assert dv.reading([mixed]) == "pending"
    assert dv.reading([mixed, second(BROKEN, (0.12, 0.025))]) == "no_effect"
    assert dv.reading([mixed, second(HELD, BROKEN)]) == "inconclusive"
    relapse = second(HELD, HELD) | {"justrl": {12: dv.endpoint(rewards(*HELD)), 13: dv.endpoint(rewards(*BROKEN))}}
    assert dv.reading([mixed, relapse]) == "not_reproduced"


def write_round(monkeypatch, folder, arms: dict[str, tuple], steps: int = 20) -> None:
    """Each run's metrics through verl's FileLogger, as a real run writes them (experiment's run folders)."""
    for name, (peak, last) in arms.items():
        run = folder / "runs" / name
        run.mkdir(parents=True)
        monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(run / "metrics.jsonl"))
        logger = FileLogger("stapo", name)
        for step, value in rewards(peak, last).items():
            if step <= steps:
                data = {"critic/score/mean": value, "actor/entropy": 1.5, "response_length/clip_ratio": 0.25}
                data |= {"val-core/word/acc/mean@4": 0.02} if step == 20 else {}
                logger.log(data, step)
        logger.finish()


def test_the_verdict_line_from_verls_files(tmp_path, monkeypatch, capsys):
    runs = {"justrl-s10": BROKEN, "justrl-s11": BROKEN, "stapo-s10": BROKEN, "stapo-s11": (0.12, 0.07)}
    write_round(monkeypatch, tmp_path / "r1", runs | {"stapo_random-s10": BROKEN, "stapo_random-s11": BROKEN})
    ex.main(["decisive", str(tmp_path / "r1")])
    out = capsys.readouterr().out
    assert out.rstrip().endswith(dv.VERDICT + dv.READINGS["pending"])
    assert "| 1 | stapo-s11 | 0.120 | 0.070 | 0.583 | no | 1.5 | 25 |" in out and "| 2 |" not in out
    write_round(monkeypatch, tmp_path / "r2", {n.replace("s10", "s12").replace("s11", "s13"): BROKEN for n in runs}
                | {"stapo_random-s12": BROKEN, "stapo_random-s13": BROKEN}, steps=19)  # fmt: skip
    tables, verdict = dv.report([tmp_path / "r1", tmp_path / "r2"])
    assert verdict == dv.VERDICT + dv.READINGS["no_verdict"] and "missing at steps [20]" in tables


def test_the_round_script_runs_the_pre_registered_commands(tmp_path):
    """scripts/gpu/decisive.sh as printed, from a folder that does not exist yet, with a stand-in for the Python
    that would train (it needs a GPU): the four commands in order, round 1's seeds, and the `experiment run`
    arguments accepted by the real parser and composed with each method's real config."""
    import shlex
    import subprocess
    from pathlib import Path

    calls = tmp_path / "calls"
    standin = tmp_path / "python"
    standin.write_text(f'#!/bin/sh\nprintf "%s\\n" "$*" >> {calls}\n')
    standin.chmod(0o755)
    script = Path(__file__).parents[1] / "scripts" / "gpu" / "decisive.sh"
    out = tmp_path / "new" / "decisive"
    done = subprocess.run(
        ["bash", str(script), "1", str(out), "--src", str(standin)],
        env={"PATH": standins.gpu_path(tmp_path), "STAPO_PYTHON": str(standin)},
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    lines = calls.read_text().splitlines()
    modules = [line.split()[1] for line in lines]
    assert modules == [
        "stapo.tools.pretrained",
        "stapo.quickstart.task",
        "stapo.quickstart.warmup",
        "stapo.quickstart.experiment",
        "stapo.quickstart.experiment",
    ]
    args = ex.build_parser().parse_args(shlex.split(lines[3])[2:])
    assert args.seeds == [10, 11] and args.steps == 20 and args.tau_p == 0.02 and args.runs_per_gpu == 6
    assert args.methods == list(dv.ARMS) and "actor_rollout_ref.actor.optim.lr=1e-4" in args.overrides
    ex.check_overrides(args)  # every arm's config composes and passes the trainer's checks
    assert lines[4].endswith(f"decisive {out}/round1")
    for bad, message in ((["3", "x"], "rounds 1 and 2"), (["1", "x", "--srcx", "y"], "unknown option")):
        refused = subprocess.run(["bash", str(script), *bad], capture_output=True, text=True)
        assert refused.returncode == 2 and message in refused.stderr
    usage = subprocess.run(["bash", str(script), "--help"], capture_output=True, text=True)
    assert usage.returncode == 0 and "ROUND 1 trains seeds 10 11" in usage.stdout
