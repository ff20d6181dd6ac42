"""Report: the paper's headline numbers from its Avg column, tables from fixture summaries, plots from fixture logs."""

import json
import shutil
import statistics
from pathlib import Path

import pytest

from stapo.tools import report
from stapo.tools.report import headline, relative_gains

FIXTURES = Path(__file__).parent / "fixtures"
RUNS = FIXTURES / "report_runs"


def test_paper_headline_from_published_averages():
    gains = relative_gains(report.paper_entries(), "stapo")
    train, justrl = gains[("paper", "train")], gains[("paper", "justrl")]
    # STAPO's Avg over the strongest other method: 20-Entropy at 1.7B/8B/14B (train); JustRL, 20-Entropy, JustRL
    assert train == pytest.approx(
        {
            "qwen3_1.7b": 100 * (38.18 / 33.64 - 1),
            "qwen3_8b": 100 * (58.76 / 57.63 - 1),
            "qwen3_14b": 100 * (64.38 / 60.77 - 1),
        }
    )
    paper_sizes = list(train)
    assert [round(train[s], 2) for s in paper_sizes] == [13.50, 1.96, 5.94]
    assert round(headline(train), 2) == 7.13
    assert [round(justrl[s], 2) for s in paper_sizes] == [5.21, 3.61, 2.31]
    assert round(headline(justrl), 2) == 3.71  # the paper states 3.69%
    published = report.paper_table()["headline"]
    assert published["v1_v3"]["train"]["mean"] == 7.13 and published["v1_v3"]["justrl"]["mean"] == 3.69
    v4 = published["v4_v5"]["train"]
    assert round(statistics.fmean(v4["per_size"].values()), 2) == v4["mean"] == 11.49
    assert published["v4_v5"]["justrl"]["mean"] == 3.73


def test_paper_table_averages_and_the_flagged_row():
    off = [
        (entry.size, entry.method, entry.preset)
        for entry in report.paper_entries()
        if abs(statistics.fmean(entry.scores[:6]) - entry.average) > 0.01
    ]
    assert off == [("qwen3_14b", "stapo", "train")]  # cells average 64.91, published Avg 64.38 (kept)
    assert any("64.91" in note and "64.38" in note for note in report.paper_table()["notes"])


def test_paper_cli_prints_the_headline(tmp_path, capsys):
    report.main(["table", "--paper", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "| 14B | STAPO | 46.98 (54.27) | 35.21 (41.67) | 87.11 (90.62) | 92.45 (93.85) | 59.47 (59.93) |" in out
    assert "paper: mean relative gain of STAPO over sizes: 7.13% (train), 3.71% (justrl)" in out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["table.csv", "table.md", "table.tex"]


def test_tables_from_fixture_summaries(tmp_path):
    entries = report.load_entries([RUNS])
    gains = relative_gains(entries, "stapo")  # by hand: Avg 220/6 vs 185/6, 351/6 vs 334/6; justrl 216/6 vs 206/6
    assert gains[("ours", "train")] == pytest.approx(
        {"qwen3_1.7b": 100 * (220 / 185 - 1), "qwen3_8b": 100 * (351 / 334 - 1)}
    )
    assert gains[("ours", "justrl")] == pytest.approx({"qwen3_1.7b": 100 * (216 / 206 - 1)})
    paths = report.write_tables(entries, tmp_path)
    for path in paths:
        assert path.read_text() == (FIXTURES / f"report_expected_{path.name}").read_text(), path.name


def test_runs_side_by_side_with_the_paper(tmp_path, capsys):
    report.main(["table", str(RUNS), "--paper", "--out", str(tmp_path)])
    lines = capsys.readouterr().out.splitlines()
    paper = lines.index(
        "| 8B | STAPO | paper | 33.44 (39.48) | 28.65 (29.37) | 79.92 (80.23) | 90.40 (91.40) | "
        "57.17 (55.70) | 62.98 (63.32) | 58.76 (59.92) | 1.96% (3.61%) |"
    )
    assert lines[paper + 1] == (
        "| 8B | STAPO | ours | 33.00 (–) | 28.00 (–) | 80.00 (–) | 90.00 (–) | 57.00 (–) | 63.00 (–) | 58.50 (–) "
        "| 5.09% (–) |"
    )
    assert "- ours: mean relative gain of STAPO over sizes: 12.00% (train), 4.85% (justrl)" in lines


def test_summary_without_labels_names_the_fix(tmp_path):
    summary = json.loads((RUNS / "grpo_qwen3_8b_step100" / "train" / "summary.json").read_text())
    (tmp_path / "summary.json").write_text(json.dumps({**summary, "method": None}))
    with pytest.raises(report.ReportError, match=r"field 'method' is None.*--method"):
        report.load_entries([tmp_path])
    shutil.copytree(RUNS / "grpo_qwen3_8b_step100", tmp_path / "copy")
    (tmp_path / "summary.json").unlink()
    with pytest.raises(report.ReportError, match="are both qwen3_8b grpo train; pass only one"):
        report.load_entries([RUNS, tmp_path])


def write_tensorboard_run(folder):
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(folder))
    for step in range(1, 31):
        writer.add_scalar("actor/entropy", 0.6 + 0.05 * step, step)
        writer.add_scalar("critic/score/mean", 0.1 + 0.01 * step, step)
        if step % 10 == 0:
            writer.add_scalar("val-core/aime24/acc/mean@32", 0.03 * step / 10, step)
    writer.close()


def test_log_formats(tmp_path):
    jsonl = report.read_metrics(FIXTURES / "report_log_stapo_qwen3_1.7b.jsonl")
    assert jsonl["actor/entropy"][1] == 0.6068 and len(jsonl["stapo/masked_frac"]) == 30
    assert jsonl["val-core/aime24/acc/mean@32"] == {0: 0.05, 10: 0.09, 20: 0.13, 30: 0.17}
    console = report.read_metrics(FIXTURES / "report_log_justrl_qwen3_1.7b.log")
    assert console["val-core/aime24/acc/mean@32"][10] == 0.08  # printed as np.float64(0.0800)
    assert console["actor/entropy"][30] == 1.2 and "stapo/masked_frac" not in console
    write_tensorboard_run(tmp_path / "grpo_qwen3_1.7b")
    tensorboard = report.read_metrics(tmp_path / "grpo_qwen3_1.7b")
    assert tensorboard["critic/score/mean"][30] == pytest.approx(0.4)
    with pytest.raises(report.ReportError, match="no metrics found"):
        report.read_metrics(FIXTURES / "report_expected_table.md")


def test_a_resumed_runs_earlier_segment_is_read_also_gzipped_as_evidence_keeps_it(tmp_path):
    """A stopped and resumed run's log is two files (the trainer set the first aside); evidence/ keeps both
    gzipped, ``metrics.1.jsonl.gz`` and ``metrics.jsonl.gz``, and both are read, the earlier first."""
    import gzip

    from stapo.tools.io import set_aside

    lines = (FIXTURES / "report_log_stapo_qwen3_1.7b.jsonl").read_text().splitlines()
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines[:10]) + "\n")
    set_aside(tmp_path / "metrics.jsonl")
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines[10:]) + "\n")
    whole = report.read_metrics(tmp_path / "metrics.jsonl")
    for name in ("metrics.1.jsonl", "metrics.jsonl"):
        with gzip.open(tmp_path / f"{name}.gz", "wt") as file:
            file.write((tmp_path / name).read_text())
    assert report.read_metrics(tmp_path / "metrics.jsonl.gz") == whole
    assert sorted(whole["actor/entropy"]) == list(range(1, 31))


def test_a_damaged_jsonl_line_is_named_unless_it_is_the_last(tmp_path, capsys):
    """A kill mid-write cuts off the last line only, which is skipped; a damaged line before it was skipped silently
    (and a step's metrics with it): ``report plot`` now names the file and line, writing nothing."""
    lines = (FIXTURES / "report_log_stapo_qwen3_1.7b.jsonl").read_text().splitlines()
    cut = tmp_path / "cut.jsonl"
    cut.write_text("\n".join([*lines, lines[-1][:20]]) + "\n")
    assert len(report.read_metrics(cut)["actor/entropy"]) == 30
    damaged = tmp_path / "damaged.jsonl"
    damaged.write_text("\n".join([*lines[:5], lines[5][:20], *lines[6:]]) + "\n")
    with pytest.raises(SystemExit) as stopped:
        report.main(["plot", f"stapo={damaged}", "--out", str(tmp_path / "plots")])
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert stopped.value.code and line.startswith(f"error: {damaged}: line 6 is not a complete JSON record")
    assert not (tmp_path / "plots").exists()


def test_plots_one_line_per_method(tmp_path, capsys):
    write_tensorboard_run(tmp_path / "tb" / "grpo_qwen3_1.7b")
    report.main(
        [
            "plot",
            f"stapo={FIXTURES / 'report_log_stapo_qwen3_1.7b.jsonl'}",
            f"justrl={FIXTURES / 'report_log_justrl_qwen3_1.7b.log'}",
            str(tmp_path / "tb" / "grpo_qwen3_1.7b"),
            "--out",
            str(tmp_path / "plots"),
        ]
    )
    written = sorted(p.name for p in (tmp_path / "plots").iterdir())
    assert written == ["entropy.png", "masked_frac.png", "reward.png", "val_aime24.png"]
    for name in written:
        data = (tmp_path / "plots" / name).read_bytes()
        assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 10_000, name
    assert "wrote" in capsys.readouterr().out
