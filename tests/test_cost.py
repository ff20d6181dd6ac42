"""The cost model (stapo/tools/cost.py): fitted to the measured steps of docs/scale.md it reproduces them, it moves
the way the hardware does, and its command prints the table of docs/scale.md."""

import argparse

import pytest

from stapo.tools import cost


def paper(**changes):
    defaults = dict(gpu="h100", gpus_per_node=8, steps=3000, prompts=256, n=8, prompt_length=200,
                    length_start=1000.0, length_end=6000.0, max_length=15360.0)  # fmt: skip
    return argparse.Namespace(**{**defaults, **changes})


def test_the_parameter_counts_are_the_base_models():
    counts = {size: cost.model_facts(size)["parameters"] for size in ("qwen3_1.7b", "qwen3_8b", "qwen3_14b")}
    assert counts == {"qwen3_1.7b": 2_031_739_904, "qwen3_8b": 8_190_735_360, "qwen3_14b": 14_768_307_200}


def test_the_fit_reproduces_every_measured_step():
    fit = cost.fitted()
    for shape, seconds in cost.load_measured():
        model = fit.stage_seconds(shape)
        assert sum(model.values()) == pytest.approx(seconds["step"], rel=0.10), seconds["name"]
        for stage in ("old_log_prob", "update"):
            assert model[stage] == pytest.approx(seconds[stage], rel=0.10), (seconds["name"], stage)
    assert 1 < fit.k_w < 5 and 0.5 < fit.k_kv < 5  # slower than the bandwidth bound, not absurdly


def test_the_model_moves_as_the_hardware_does():
    fit = cost.fitted()
    base = cost.size_shape("qwen3_8b", 1, 8, "h100", 256, 8, 200, 4000, 15360)
    seconds = fit.stage_seconds(base)
    longer = fit.stage_seconds(cost.Shape(**{**base.__dict__, "response_length": 8000}))
    faster = fit.stage_seconds(cost.Shape(**{**base.__dict__, "gpu": "h200"}))
    assert all(longer[s] > seconds[s] for s in ("generation", "old_log_prob", "update"))
    assert faster["generation"] < seconds["generation"] and faster["update"] == seconds["update"]
    grpo, stapo = cost.step_seconds(fit, base, "grpo"), cost.step_seconds(fit, base, "stapo")
    assert grpo["old_log_prob"] == 2 * seconds["old_log_prob"] and stapo["other"] == seconds["other"] + cost.MASK_S
    runs = [cost.project(paper(), "qwen3_8b", nodes, "stapo") for nodes in (1, 2, 4)]
    assert runs[0]["hours"] > runs[1]["hours"] > runs[2]["hours"]
    assert runs[0]["gpu_hours"] < runs[2]["gpu_hours"]  # more nodes: sooner, at a worse use of each GPU
    assert sum(runs[0]["shares"].values()) == pytest.approx(1.0)


def test_the_trainer_modes_overlap_as_verl_runs_them():
    """mode_seconds (docs/trainer-modes.md): sync is the plain step; colocate_async generates two batches at once, which
    saves where decoding is latency-bound and less where the KV cache is full; separate_async takes the longer of
    generation and training on the split that is fastest; each is within 10 % of the step measured beside sync on one
    host."""
    fit = cost.fitted()
    few = cost.Shape("qwen3_1.7b", "h200", 1, 1, 0.6, 32, 46.5, 8000, 8192)
    many = cost.size_shape("qwen3_8b", 1, 8, "h100", 256, 8, 200, 6000, 15360)
    for shape in (few, many):
        sync = cost.mode_seconds(fit, shape, "stapo")
        colocate = cost.mode_seconds(fit, shape, "stapo", "colocate_async")
        assert sync == cost.step_seconds(fit, shape, "stapo")
        assert {**colocate, "generation": sync["generation"]} == sync and colocate["generation"] < sync["generation"]
    generation = {s: [cost.mode_seconds(fit, s, "stapo", m)["generation"] for m in cost.MODES[:2]] for s in (few, many)}
    assert generation[few][1] / generation[few][0] < generation[many][1] / generation[many][0]
    two = cost.Shape(**{**few.__dict__, "gpus": 2})
    separate = cost.mode_seconds(fit, two, "stapo", "separate_async")
    train = cost.step_seconds(fit, few, "stapo")  # one trainer GPU
    generation = fit.stage_seconds(few)["generation"]  # one rollout GPU
    assert sum(separate.values()) == pytest.approx(
        max(generation, train["old_log_prob"] + train["update"]) + train["other"]
    )
    with pytest.raises(cost.NoTrainerGPUs, match="leave none to train"):
        cost.mode_seconds(fit, few, "stapo", "separate_async")
    node = cost.Shape(**{**few.__dict__, "gpus": 8})  # the split chosen is the fastest of the seven
    steps = {r: sum(cost.mode_seconds(fit, node, "stapo", "separate_async", r).values()) for r in range(1, 8)}
    assert sum(cost.mode_seconds(fit, node, "stapo", "separate_async").values()) == min(steps.values())
    assert len(set(steps.values())) == 7
    # verl places rollout GPUs as nodes × GPUs a node: TP multiples within a node, whole nodes across several
    tp4 = cost.size_shape("qwen3_14b", 1, 8, "h100", 256, 8, 200, 3000, 15360)
    assert cost.rollout_splits(tp4) == [4] and cost.rollout_splits(cost.Shape(**{**tp4.__dict__, "gpus": 32}), 8) == [
        8, 16, 24]  # fmt: skip
    run = cost.project(paper(), "qwen3_1.7b", 2, "stapo", mode="separate_async")
    assert run["rollout_gpus"] == 8  # one split for the whole run, whole nodes
    rows = cost.load_modes()
    assert {row["mode"] for _, row in rows} == set(cost.MODES)
    for shape, row in rows:
        model = sum(cost.mode_seconds(fit, shape, row["method"], row["mode"]).values())
        assert model == pytest.approx(row["step_s"], rel=0.10), row["name"]


def test_the_commands(capsys):
    cost.main(["fit"])
    out = capsys.readouterr().out
    assert "model without this step" in out
    assert sum(" | step | " in line for line in out.splitlines()) == len(cost.load_measured())
    cost.main(["table", "--nodes", "1", "--steps", "10"])
    caveat, *lines = capsys.readouterr().out.splitlines()
    assert caveat.startswith("A projection, not evidence:")  # as the README says (issue 64)
    assert lines[0].startswith("10 steps × 256 prompts × 8") and len(lines) == 3 + 3  # header, 3 sizes x 1 node
    assert "| share of STAPO's step: generation |" in lines[1]
    assert lines[1].endswith("| STAPO hours: colocate_async | separate_async |")
    assert all(len(line.split("|")) == len(lines[1].split("|")) for line in lines[2:])
    cost.main(["fit"])
    assert sum(" | colocate_async | " in line for line in capsys.readouterr().out.splitlines()) == 2  # 8,192 and 2,048
    cost.main(["project", "--size", "qwen3_1.7b", "--mode", "colocate_async", "--steps", "10"])
    assert '"mode": "colocate_async"' in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cost.main(["project", "--size", "qwen3_14b", "--mode", "separate_async", "--gpus-per-node", "4"])
    assert "error: --mode separate_async: 4 GPU(s) leave none to train" in capsys.readouterr().err
    cost.main(["table", "--nodes", "1", "--gpus-per-node", "4", "--steps", "10"])
    assert capsys.readouterr().out.splitlines()[-1].endswith(" | – |")  # 14B: TP 4 leaves no GPU to train
    with pytest.raises(SystemExit):
        cost.main(["project", "--size", "qwen3_8b", "--length-start", "20000"])
    assert "--max-length 15360: must be at least --length-start and --length-end" in capsys.readouterr().err
