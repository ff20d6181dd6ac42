"""The GPU smoke's checker (stapo/checks/gpu_smoke.py) on records written here as a 1-GPU STAPO run writes them:
it passes a run that did what the rule says and names each way a run can fail (check 6: silenced ⌈q(k−1)⌉ ± 1 of
each quantile pool's k candidates, float32 entropies, no dtype warning; check 8: vLLM agrees with the actor)."""

import json

import pytest

from stapo.checks.gpu_smoke import check, pool_problems


def write_run(out, pools, entropy_dtype="torch.float32", log="", correlation=0.99997, lag=0):
    """One STAPO step (policy_source=old, one rank, two micro-batches per mini-batch) whose mini-batches had
    ``pools`` = [(candidates, silenced)]."""
    masked = sum(s for _, s in pools)
    (out / "audit").mkdir(parents=True)
    step = {"actor/pg_loss": 0.1, "s2t/candidate_frac": 0.1, "stapo/candidate_tokens": sum(k for k, _ in pools)}
    step.update({"stapo/masked_tokens": masked, "stapo/expected_masked_tokens": masked, "stapo/masked_frac": 0.01})
    step["training/rollout_actor_probs_pearson_corr"] = correlation
    step["training/off_policy/trajectory_staleness/max"] = lag
    (out / "metrics.jsonl").write_text(json.dumps({"step": 1, "data": step}) + "\n")
    (out / "train.log").write_text(log)
    loss = [
        {"rank": 0, "batch_num_tokens": 100 - silenced, "kept_tokens": kept, "silenced_tokens": s,
         "max_grad_silenced": 0.0, "nonzero_grad_kept": 5}
        for _, silenced in pools  # two micro-batches per mini-batch: the silenced tokens in the first
        for kept, s in ((50 - silenced, silenced), (50, 0))
    ]  # fmt: skip
    (out / "audit" / "loss-1.jsonl").write_text("".join(json.dumps(r) + "\n" for r in loss))
    tokens = 100 * len(pools)
    driver = {
        "step": 1,
        "masked_tokens": masked,
        "response_tokens": tokens,
        "loss_tokens": tokens,
        "during_update": {"response_mask": tokens - masked, "loss_mask": tokens - masked},
        "after_update": {"response_mask": tokens, "loss_mask": tokens},
        "pool_candidates": [k for k, _ in pools],
        "pool_masked": [s for _, s in pools],
        "entropy_dtype": entropy_dtype,
    }
    (out / "audit" / "driver-2.jsonl").write_text(json.dumps(driver) + "\n")
    return out


GOOD = [(5, 3), (9, 6), (1, 0), (0, 0)]  # ⌈0.75·4⌉ = 3, ⌈0.75·8⌉ = 6, a lone candidate and an empty pool: 0


def test_a_run_that_follows_the_rule_passes(tmp_path):
    problems, summary = check("stapo", write_run(tmp_path / "run", GOOD), gpus=1)
    assert problems == [] and summary["pools"] == GOOD


@pytest.mark.parametrize(
    "pools, dtype, log, expected",
    [
        ([(933, 36), *GOOD[1:]], "torch.float32", "", "pool 0: 36 of 933 candidates silenced, the rule gives 699"),
        (GOOD, "torch.bfloat16", "", "entropies reached the mask as torch.bfloat16"),
        (GOOD, "torch.float32", "x\n(TaskRunner) STAPO WARNING: entropies arrive as torch.bfloat16\n", "STAPO WARNING"),
    ],
)
def test_each_failure_is_named(tmp_path, pools, dtype, log, expected):
    problems, _ = check("stapo", write_run(tmp_path / "run", pools, dtype, log), gpus=1)
    assert len(problems) == 1 and expected in problems[0]


@pytest.mark.parametrize("correlation", [0.98, float("nan"), None])
def test_vllm_and_the_actor_must_agree(tmp_path, correlation):
    """Check 8: a run whose sampler and trainer disagree (another run's weights in vLLM, a broken weight sync over
    nodes) fails, as does one that did not log the comparison or logged it as NaN (null in verl's file)."""
    problems, _ = check("stapo", write_run(tmp_path / "run", GOOD, correlation=correlation), gpus=1)
    assert len(problems) == 1 and "vLLM's and the actor's probabilities correlate" in problems[0]


def test_a_step_without_spurious_tokens_is_summarised(tmp_path):
    """A step whose pools silenced nothing has NaN shares, which verl's file logger writes as null (the random 1.7B
    over two nodes, 2026-11-27: no correct answer in step 2): the summary keeps them as null instead of failing."""
    run = write_run(tmp_path / "run", GOOD)
    record = json.loads((run / "metrics.jsonl").read_text())
    record["data"]["s2t/grad_bound/spurious_share"] = None
    (run / "metrics.jsonl").write_text(json.dumps(record) + "\n")
    problems, summary = check("stapo", run, gpus=1)
    assert problems == [] and summary["s2t"] == [{"s2t/candidate_frac": 0.1, "s2t/grad_bound/spurious_share": None}]


def test_one_token_of_slack_per_pool():
    assert pool_problems([(101, 75), (101, 74), (101, 76)], 0.75) == []
    assert len(pool_problems([(101, 73), (101, 77)], 0.75)) == 2
    assert pool_problems([], 0.75) == ["no quantile pool was recorded"]


def test_multi_node_overrides_size_vllm_to_the_run_not_the_model(tmp_path):
    """The --nodes runs give vLLM a fixed 1 GiB KV cache; it holds one sequence of the run's prompt + response limits
    (a random 1.7B shape's 32,768-token context needs 3.5 GiB: the --shape run of 2026-11-27 stopped there)."""
    from stapo.checks.gpu_smoke import multi_node_overrides, overrides

    args = overrides("stapo", tmp_path / "model", tmp_path / "train.parquet", 2, 2, tmp_path)
    nodes = dict(a.split("=", 1) for a in multi_node_overrides(args, 2, 1))
    assert nodes["actor_rollout_ref.rollout.max_model_len"] == str(
        int(nodes["data.max_prompt_length"]) + int(nodes["data.max_response_length"])
    )
    assert nodes["trainer.nnodes"] == "2" and nodes["trainer.n_gpus_per_node"] == "1"
    assert nodes["+ray_kwargs.ray_init.runtime_env.env_vars.NCCL_P2P_DISABLE"] == '"1"'


@pytest.mark.parametrize(
    "lag, correlation, floor",
    [(0, 0.994, 0.999), (1, 0.994, None), (1, 0.9, 0.99), (1, float("nan"), 0.99)],
)
def test_a_lagged_step_has_a_looser_floor(tmp_path, lag, correlation, floor):
    """Check 8 after a policy lag: the rollout came from older weights (asynchronous trainers), so 0.994 is no
    disagreement of the kernels there (it is where vLLM had the actor's weights); 0.9, or none logged, still is."""
    problems, _ = check(
        "stapo", write_run(tmp_path / "run", GOOD, correlation=correlation, lag=lag), gpus=1,
        trainer_mode="stapo_separate_async",
    )  # fmt: skip
    expected = f"step 1: vLLM's and the actor's probabilities correlate {correlation:.6f} (< {floor})"
    assert problems == ([expected] if floor else [])


def test_a_real_shape_run_has_its_own_correlation_floor(tmp_path):
    """A random 1.7B's 0.9988 (docs/scale.md) passes with --shape's floor and fails the tiny model's."""
    from stapo.checks.gpu_smoke import MIN_PROBS_CORRELATION, SHAPE_PROBS_CORRELATION

    run = write_run(tmp_path / "run", GOOD, correlation=0.9988)
    assert check("stapo", run, gpus=1, min_correlation=SHAPE_PROBS_CORRELATION)[0] == []
    assert len(check("stapo", run, gpus=1, min_correlation=MIN_PROBS_CORRELATION)[0]) == 1


@pytest.mark.parametrize(
    "mode, lag, expected",
    [
        ("stapo_sync", 0, None),
        ("stapo_sync", 1, "step 1: policy lag 1 in the synchronous trainer"),
        ("stapo_separate_async", 1, None),
        ("stapo_colocate_async", None, "step 1: no training/off_policy/trajectory_staleness/max (the policy lag)"),
    ],
)
def test_the_policy_lag_is_logged_every_step(tmp_path, mode, lag, expected):
    """Check 9: verl's policy lag is in every step's metrics, and 0 in the synchronous trainer."""
    problems, summary = check("stapo", write_run(tmp_path / "run", GOOD, lag=lag), gpus=1, trainer_mode=mode)
    assert problems == ([expected] if expected else []) and summary["policy_lag"] == [lag]


@pytest.mark.parametrize("mode", ["stapo_sync", "stapo_colocate_async", "stapo_separate_async"])
def test_each_trainer_mode_runs_the_recipes_checks(tmp_path, monkeypatch, mode):
    """``--trainer-mode``: the smoke's runs compose with the recipe's config and pass its checks before Ray (verl's
    conditions of ``separate_async`` included), on the trainer of that mode; ``separate_async`` counts its rollout
    GPU."""
    from hydra import compose, initialize_config_dir

    from stapo.checks.gpu_smoke import overrides
    from stapo.config import CONFIG_DIR
    from stapo.train import preflight
    from stapo.train.main import validate

    for method in ("justrl", "stapo", "stapo_current"):
        args = overrides(method, tmp_path / "model", tmp_path / "train.parquet", 1, 2, tmp_path, trainer_mode=mode)
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
            config = compose(config_name="stapo" if method.startswith("stapo") else method, overrides=args)
        validate(config, environment=False)
        assert config.trainer.v1.trainer_mode == mode
    if mode == "stapo_separate_async":
        batch, mini = config.data.train_batch_size, config.actor_rollout_ref.actor.ppo_mini_batch_size
        assert config.trainer.v1.separate_async.parameter_sync_step * mini == batch
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(preflight, "local_gpus", lambda: 1)  # one GPU: enough for a trainer, not for a rollout too
    monkeypatch.setattr(preflight, "local_ray_clusters", lambda: [])  # another process's cluster is not checked here
    gpus = preflight._gpu_problems(config)
    assert gpus == ([] if mode != "stapo_separate_async" else [gpus[0]])
    assert mode != "stapo_separate_async" or "needs 2 GPUs; this machine has 1 visible" in gpus[0]


def test_rollout_correction_must_reach_every_loss_call(tmp_path):
    """Check 10: with ``algorithm.rollout_correction.rollout_is`` among the overrides, verl's IS metric is logged every
    step and every loss call got the weights (the audit's ``rollout_is_weights``); without it nothing is asked."""
    from stapo.checks.gpu_smoke import ROLLOUT_IS, rollout_is

    assert rollout_is(["algorithm.rollout_correction.rollout_is=token", "a.b=1"])
    assert rollout_is(["++algorithm.rollout_correction.rollout_is=sequence"])
    assert not rollout_is(["algorithm.rollout_correction.rollout_is=null"]) and not rollout_is([])
    out = write_run(tmp_path / "run", GOOD)
    assert check("stapo", out, gpus=1)[0] == []
    problems, _ = check("stapo", out, gpus=1, weighted=True)
    assert problems == [f"step 1: no {ROLLOUT_IS} (rollout correction)", "8 of 8 loss calls got no rollout_is_weights "
                        "(rollout correction)"]  # fmt: skip
    step = json.loads((out / "metrics.jsonl").read_text())
    step["data"][ROLLOUT_IS] = 0.98
    (out / "metrics.jsonl").write_text(json.dumps(step) + "\n")
    loss = out / "audit" / "loss-1.jsonl"
    records = [json.loads(line) | {"rollout_is_weights": True} for line in loss.read_text().splitlines()]
    loss.write_text("".join(json.dumps(r) + "\n" for r in records))
    problems, summary = check("stapo", out, gpus=1, weighted=True)
    assert problems == [] and summary["rollout_is_mean"] == [0.98]


def test_overrides_after_the_dashes_reach_every_run_and_are_checked_first(tmp_path, capsys):
    """``-- KEY=VALUE ...`` go last into every run's overrides (verl's rollout correction composes with the recipe);
    a key the config lacks, or a setting the recipe refuses, stops the smoke before it looks for a GPU."""
    from hydra import compose, initialize_config_dir

    from stapo.checks.gpu_smoke import main, overrides
    from stapo.config import CONFIG_DIR

    extra = ["algorithm.rollout_correction.rollout_is=token"]
    args = overrides("stapo", tmp_path / "m", tmp_path / "t.parquet", 1, 2, tmp_path, extra=extra)
    assert args[-1] == extra[0]
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        assert compose(config_name="stapo", overrides=args).algorithm.rollout_correction.rollout_is == "token"
    for bad, message in [
        (
            "algorithm.rollout_correction.rollout_isx=token",
            "Could not override 'algorithm.rollout_correction.rollout_is",
        ),
        ("algorithm.rollout_correction.bypass_mode=True", "bypass_mode=True: verl then takes"),
        ("rollout_is", "overrides rollout_is: write each as KEY=VALUE"),
    ]:
        with pytest.raises(SystemExit) as done:
            main(["--out", str(tmp_path / "new"), "--methods", "stapo", "--", bad])
        assert done.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "new").exists()
