"""The design-by-counts probe (stapo/tools/probe.py) on a tiny random Qwen3 sampled with transformers on the CPU:
the report's counts are S2T's, the chosen τ_p follows the rule, and the paired gradient test's masked gradients
equal autograd's gradient of the masked token-mean loss."""

import json
import math

import pytest
import torch

from stapo.quickstart.task import WORD_DATA_SOURCE, generate_word, write_task
from stapo.quickstart.tiny import build_model, build_tokenizer
from stapo.s2t import s2t_mask
from stapo.tools import probe


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("probe")
    splits = generate_word(seed=0, n_train=40, n_val=4, difficulty=1)
    paths = write_task(splits, root / "data", seed=0, data_source=WORD_DATA_SOURCE)
    texts = [p.question + " " + p.solution for p in splits["train"]]
    tok = build_tokenizer(texts, root / "model", vocab_size=400)
    build_model(tok, root / "model", hidden_size=64, num_layers=2)
    return root, paths["train"]


def run(setup, *extra):
    root, data = setup
    out = root / f"probe{len(extra)}.json"
    args = ["--model", str(root / "model"), "--data", str(data), "--out", str(out), "--engine", "hf"]
    probe.main([*args, "--prompts", "8", "--n", "4", "--max-tokens", "12", "--mini-batch", "2", *extra])
    return json.loads(out.read_text())


def test_the_report_counts_what_s2t_sees(setup):
    """A random model over a 400-token vocabulary puts most tokens near p = 1/400 (above 0.002) or below it: the
    counts per pool and the silenced share must be S2T's on the same samples, and the chosen τ_p the smallest with a
    median pool of 20 candidates."""
    result = run(setup, "--tau-p", "0.002", "0.01")
    (report,) = result["files"]
    assert report["responses"] == 32 and report["pools"] == 4 and 0 <= report["accuracy"] <= 1
    for tau_p, counts in report["tau_p"].items():
        assert counts["candidates_per_pool_min"] <= counts["candidates_per_pool_median"]
        if counts["candidates_per_pool_mean"]:
            assert 0 <= counts["silenced_of_candidates"] <= counts["expected_of_candidates"] + 1e-9
    medians = {float(t): r["candidates_per_pool_median"] for t, r in report["tau_p"].items()}
    expected = min((t for t, m in medians.items() if m >= probe.MIN_POOL), default=None)
    assert report["chosen_tau_p"] == expected


def small_samples():
    """Two prompts x two responses with hand-set statistics; prompt 0's responses differ in score."""
    lp = [torch.tensor([-7.0, -0.1, -8.0]), torch.tensor([-9.0, -6.5]), torch.tensor([-0.2]), torch.tensor([-7.5])]
    ent = [torch.tensor([0.5, 2.0, 0.1]), torch.tensor([0.3, 1.0]), torch.tensor([1.0]), torch.tensor([0.2])]
    responses = [[5, 6, 7], [8, 9], [5], [6]]
    return probe.Samples(
        prompts=[[1, 2]] * 4,
        responses=responses,
        scores=[1.0, 0.0, 1.0, 1.0],
        truncated=[False] * 4,
        advantages=torch.tensor([0.7071, -0.7071, 0.0, 0.0]),
        log_probs=lp,
        entropy=ent,
    )


def test_token_stats_in_micro_batches_equal_one_sequence_at_a_time(setup):
    """Padded micro-batches (right padding, attention mask) give each response's own log π and entropy."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(setup[0] / "model", dtype=torch.float32)
    samples = small_samples()
    probe.token_stats(model, samples)
    for r, response in enumerate(samples.responses):
        ids = torch.tensor([samples.prompts[r] + response])
        log_probs = model(input_ids=ids).logits[0, len(samples.prompts[r]) - 1 : -1].float().log_softmax(-1)
        expected = log_probs.gather(-1, torch.tensor(response)[:, None])[:, 0]
        assert torch.allclose(samples.log_probs[r], expected.detach(), atol=1e-5)
        assert torch.allclose(samples.entropy[r], -(log_probs.exp() * log_probs).sum(-1).detach(), atol=1e-5)


def test_counts_per_pool_on_hand_set_statistics():
    samples = small_samples()
    groups = probe.pools(samples, n=2, mini_batch=1)
    assert groups == [[0, 1], [2, 3]]
    report = probe.count_report(samples, groups, [0.002], 0.75)["0.002"]
    # pool 0: response 0 has Â > 0 and p < 0.002 at tokens 0 and 2 (H 0.5, 0.1): τ_h = 0.4, one silenced
    assert report["candidates_per_pool_median"] == 1.0 and report["candidates_per_pool_min"] == 0
    assert report["silenced_of_candidates"] == 0.5 == report["expected_of_candidates"]
    assert report["silenced_frac"] == pytest.approx(1 / 7)
    assert probe.choose_tau_p({"0.002": {"candidates_per_pool_median": 19}}) is None
    assert probe.choose_tau_p({"0.01": {"candidates_per_pool_median": 20}, "0.02": {"candidates_per_pool_median": 40}})


def test_masked_gradients_equal_autograd_of_the_masked_loss(setup):
    """g_S2T from the decomposition −(G_all − G_S)/(N − |S|) is the gradient of −Σ_kept Â log π / N_kept."""
    from transformers import AutoModelForCausalLM

    root, _ = setup
    model = AutoModelForCausalLM.from_pretrained(root / "model", dtype=torch.float32)
    samples = small_samples()
    probe.token_stats(model, samples)  # the model's own statistics of these tokens
    samples.log_probs[0][0] = samples.log_probs[0][2] = -9.0  # two candidates in pool 0 whatever the model says
    rows = [0, 1, 2, 3]
    result = probe.gradient_test(model, samples, [rows], tau_p=0.002, q=0.75, seed=0)["pools"][0]
    log_probs, entropy, advantages, mask = probe.padded(samples, rows)
    keep, stats = s2t_mask(log_probs, entropy, advantages, mask, 0.002, 0.75)
    assert result["silenced"] == stats["masked"] >= 1

    def direct(kept):
        model.zero_grad(set_to_none=True)
        total = 0.0
        for r in rows:
            ids = torch.tensor([samples.prompts[r] + samples.responses[r]])
            lp = model(input_ids=ids).logits[0, 1:-1].float().log_softmax(-1)
            lp = lp.gather(-1, torch.tensor(samples.responses[r])[:, None])[:, 0]
            total = total - (kept[r, : len(lp)] * advantages[r, : len(lp)] * lp).sum()
        (total / kept.sum()).backward()
        return torch.cat([p.grad.reshape(-1) for p in model.parameters()])

    g_none, g_s2t = direct(mask.float()), direct(keep.float())
    assert result["rel_change_s2t"] == pytest.approx(float((g_s2t - g_none).norm() / g_none.norm()), rel=1e-4)
    assert math.isfinite(result["entropy_rate_none"]) and result["bound_share_s2t"] > 0


def test_bad_arguments_stop_before_any_work(tmp_path):
    with pytest.raises(SystemExit) as stop:
        probe.main(["--model", str(tmp_path), "--data", str(tmp_path / "x.parquet"), "--out", str(tmp_path),
                    "--n", "1", "--tau-p", "0"])  # fmt: skip
    message = str(stop.value)
    for expected in ("x.parquet: no such file", "no config.json", "a folder is in the way", "--n 1: must be at least 2",
                     "--tau-p 0.0: must be a fraction in (0, 1]"):  # fmt: skip
        assert expected in message
