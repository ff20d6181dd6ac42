"""The multi-seed experiment (stapo.quickstart.experiment) on the CPU: the run plan, each run's Hydra overrides
composed and validated against verl's and the recipe's configs, the checks before any work, and the summary (table
and curves) from metrics written by verl's own FileLogger. The training runs themselves need GPUs
(docs/experiments.md)."""

from __future__ import annotations

import json
import statistics

import pytest
from hydra import compose, initialize_config_dir
from verl.utils.tracking import FileLogger

from stapo.config import CONFIG_DIR
from stapo.quickstart import experiment as ex
from stapo.train.main import validate


def test_plan_puts_every_method_once_on_each_gpu():
    runs = ex.plan(["justrl", "stapo", "grpo"], [0, 1, 2], ["0", "1", "2"])
    assert len({r.name for r in runs}) == 9
    for gpu in "012":
        mine = [r for r in runs if r.gpu == gpu]
        assert sorted(r.method for r in mine) == ["grpo", "justrl", "stapo"]
        assert sorted(r.wave for r in mine) == [0, 1, 2]
    uneven = ex.plan(["justrl", "stapo"], [0, 1, 2], ["0", "1", "2", "3"])
    assert sorted(sum(r.gpu == g for r in uneven) for g in "0123") == [1, 1, 2, 2]


@pytest.mark.parametrize("method", ["justrl", "stapo", "grpo", "entropy20"])
def test_run_overrides_compose_and_validate(method, tmp_path):
    args = ex.build_parser().parse_args(
        ["run", "--out", str(tmp_path), "--tau-p", "0.002", "--steps", "150", "--test-freq", "25", "--val-n", "4"]
    )
    paths = {"train": tmp_path / "train.parquet", "validation": tmp_path / "validation.parquet"}
    run = ex.Run(method, 7, "2", 1)
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        cfg = compose(config_name=method, overrides=ex.run_overrides(run, tmp_path / "warmup", paths, args, 3))
    stapo = validate(cfg, environment=False)
    assert (cfg.data.seed, cfg.actor_rollout_ref.rollout.seed) == (7, 7)
    assert (cfg.trainer.total_training_steps, cfg.trainer.test_freq, cfg.trainer.save_freq) == (150, 25, 50)
    assert cfg.trainer.val_before_train and cfg.actor_rollout_ref.rollout.val_kwargs.n == 4
    assert cfg.actor_rollout_ref.rollout.gpu_memory_utilization == 0.2  # three runs share the GPU
    assert cfg.trainer.experiment_name == f"experiment_{method}-s7"
    assert cfg.trainer.default_local_dir == str(tmp_path / "runs" / f"{method}-s7" / "ckpt")
    assert stapo.tau_p == 0.002 and stapo.metrics  # the s2t/* metrics observe the same rule in every method
    assert stapo.mask == {"stapo": "s2t", "entropy20": "top_entropy"}.get(method, "none")


def test_bad_options_stop_before_any_work(tmp_path):
    out = tmp_path / "exp"
    for options, message in (
        (["--methods", "ppo"], "error: --methods: unknown ppo"),
        (["--seeds", "1", "1"], "error: --methods and --seeds must not repeat"),
        (["--steps", "0"], "error: --steps=0: must be a positive integer"),
        (["--tau-p", "0"], "error: --tau-p=0.0 is out of range"),
        (["--tokenizer", str(tmp_path)], f"error: --tokenizer={tmp_path}: no tokenizer_config.json"),
        ([], "error: the experiment trains with verl and needs CUDA GPUs"),  # this machine has none
    ):
        with pytest.raises(SystemExit) as stop:
            ex.main(["run", "--out", str(out), *options])
        assert str(stop.value).startswith(message), stop.value
    assert not out.exists()


def test_continuing_with_other_model_options_is_refused(tmp_path):
    args = ex.build_parser().parse_args(["run", "--out", str(tmp_path), "--warmup-steps", "300"])
    (tmp_path / "experiment.json").write_text(json.dumps({**ex.model_options(args), "warmup_steps": "200"}))
    with pytest.raises(SystemExit, match="other --warmup_steps"):
        ex.warm_model(args)
    (tmp_path / "experiment.json").write_text(json.dumps(ex.model_options(args)))
    assert ex.warm_model(args) == tmp_path / "warmup"  # the same options: the model from before, no warm-up


def log_run(monkeypatch, folder, method, seed, val, entropy, masked=None):
    """A run's metrics through verl's FileLogger: validation at steps 0 and 4, training metrics at steps 1-4."""
    path = folder / "runs" / f"{method}-s{seed}" / "metrics.jsonl"
    path.parent.mkdir(parents=True)
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(path))
    logger = FileLogger("experiment", method)
    logger.log({"val-core/arith/acc/mean@4": val[0]}, step=0)
    for step in range(1, 5):
        data = {"critic/score/mean": 0.1 * step, "actor/entropy": entropy[step - 1], "response_length/mean": 30.0}
        data |= {"s2t/spurious_frac": 0.01, "s2t/grad_bound/spurious_share": 0.05}
        if masked is not None:
            data["stapo/masked_frac"] = masked
        if step == 4:
            data["val-core/arith/acc/mean@4"] = val[1]
        logger.log(data, step=step)
    logger.finish()


def test_summary_table_and_curves_from_verls_file_logger(tmp_path, monkeypatch):
    log_run(monkeypatch, tmp_path, "justrl", 0, (0.25, 0.50), [1.0, 1.2, 1.4, 1.6])
    log_run(monkeypatch, tmp_path, "justrl", 1, (0.30, 0.60), [1.0, 1.1, 1.2, 1.3])
    log_run(monkeypatch, tmp_path, "stapo", 0, (0.25, 0.70), [1.0, 1.0, 1.0, 1.0], masked=0.002)
    table = ex.summarize(tmp_path, tmp_path / "plots")
    rows = {line.split(" | ")[0].strip("| "): line for line in table.splitlines()[2:]}
    header = [c.strip() for c in table.splitlines()[0].strip("|").split("|")]
    justrl = [c.strip() for c in rows["justrl"].strip("|").split("|")]
    cell = dict(zip(header, justrl))
    assert cell["seeds"] == "0,1" and cell["steps"] == "4"
    assert cell["val acc @ step 0"] == f"27.5 ± {statistics.stdev([25, 30]):.2g}"
    assert cell["val acc @ step 4"] == f"55 ± {statistics.stdev([50, 60]):.2g}"
    assert cell["entropy (last 10)"].startswith(f"{statistics.fmean([1.3, 1.15]):.4g} ±")
    assert cell["silenced % (last 10)"] == "-"  # JustRL silences nothing and logs no stapo/masked_frac
    stapo = dict(zip(header, [c.strip() for c in rows["stapo"].strip("|").split("|")]))
    assert stapo["silenced % (last 10)"] == "0.2" and stapo["val acc @ step 4"] == "70"
    assert (tmp_path / "summary.md").read_text() == table
    for name in ("entropy", "reward", "masked_frac", "spurious_share", "val_arith"):
        assert (tmp_path / "plots" / f"{name}.png").stat().st_size > 1000
