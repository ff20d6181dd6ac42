"""The vLLM batch-invariance probe (stapo.checks.batch_invariance) on the CPU: its requests, compositions and
comparison, and the whole probe over a stand-in for vLLM's engine (which needs a GPU): one that is batch-invariant
gives zeros, one whose numbers depend on the batch is caught in tokens and in log-probabilities. The GPU records are
in evidence/ once run (issue 54)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from stapo.checks import batch_invariance as bi


def test_requests_are_seeded_word_problems_of_mixed_lengths():
    requests = bi.make_requests(48)
    assert requests == bi.make_requests(48) and len({r.seed for r in requests}) == 48
    assert len({len(r.prompt) for r in requests}) > 10
    assert {r.seed for r in requests}.isdisjoint(r.seed for r in bi.make_requests(48, seed=1))


def test_every_composition_holds_every_request_once():
    for name, batches in bi.compositions(20, chunk=8).items():
        ours = sorted(i for batch in batches for i in batch if i >= 0)
        assert ours == list(range(20)), name
    batches = bi.compositions(20)
    assert [len(b) for b in batches["chunks"]] == [8, 8, 4] and len(batches["single"]) == 20
    assert len(batches["mixed"][0]) == 40 and sum(i < 0 for i in batches["mixed"][0]) == 20


def test_compare_counts_tokens_and_logprobs_before_the_first_difference():
    ref = [([1, 2, 3], [-0.5, -1.0, -2.0]), ([4, 5], [-0.1, -0.2])]
    assert bi.compare(ref, ref) == {"responses": 0, "tokens": 0, "logprobs": 0, "max_logprob_gap": 0.0}
    other = [([1, 2, 9, 9], [-0.5, -1.0 + 2**-20, -3.0, -1.0]), ([4, 5], [-0.1, -0.2])]
    counts = bi.compare(ref, other)
    assert counts["responses"] == 1 and counts["tokens"] == 2  # from position 2 to the end of the longer
    assert counts["logprobs"] == 1 and counts["max_logprob_gap"] == pytest.approx(2**-20)
    same_tokens = [([1, 2, 3], [-0.5, -1.0, -2.0000001]), ([4, 5], [-0.1, -0.2])]
    assert bi.compare(ref, same_tokens)["responses"] == 0 and bi.compare(ref, same_tokens)["logprobs"] == 1


def invariant(batch):
    return [([r.seed % 7, len(r.prompt) % 11], [-0.25, -0.5]) for r in batch]


def batch_dependent(batch):
    """Numbers that change with the batch's size, as a split reduction would change them."""
    return [([r.seed % 7, len(batch) % 3], [-0.25 - 1e-7 * len(batch), -0.5]) for r in batch]


def test_the_probe_finds_batch_dependence_and_only_that():
    requests, others = bi.make_requests(12), bi.make_requests(12, seed=1)
    batches = bi.compositions(12, chunk=4)
    assert all(c["responses"] == c["logprobs"] == 0 for c in bi.probe(invariant, requests, others, batches).values())
    found = bi.probe(batch_dependent, requests, others, batches)
    assert found["again"]["responses"] == 0 and found["reversed"]["logprobs"] == 0  # same size: same numbers
    assert found["chunks"]["responses"] == 12 and found["chunks"]["logprobs"] == 12
    assert found["mixed"]["logprobs"] == 12  # 24 in that batch


def test_the_table_and_the_cli_refusals(tmp_path):
    record = {"setting": "fa2", "greedy": False, "eager": True, "requests": 12, "compositions": {
        "together": {"responses": 0, "tokens": 0, "logprobs": 0, "max_logprob_gap": 0.0},
        "chunks": {"responses": 3, "tokens": 40, "logprobs": 7, "max_logprob_gap": 0.01}},
        "environment": {"CUBLASLT_WORKSPACE_SIZE": "1", "CUBLAS_WORKSPACE_CONFIG": None},
        "matmul_rows_differing": {"1": 0, "64": 5}}  # fmt: skip
    (tmp_path / "fa2.json").write_text(json.dumps(record))
    probe = [sys.executable, "-m", "stapo.checks.batch_invariance"]
    done = subprocess.run([*probe, "table", str(tmp_path / "fa2.json")], capture_output=True, text=True)
    assert done.returncode == 0
    assert (
        "| fa2 | seeded T=1, eager, CUBLASLT_WORKSPACE_SIZE=1 | chunks | 3 / 12 | 40 | 7 | 0.01 | vLLM PR #48694"
        in (done.stdout)
    )
    assert done.stdout.endswith("(after the engine): fa2: 1 rows: 0, 64 rows: 5\n")
    assert "together" not in done.stdout
    run = ["run", "--model", str(tmp_path), "--setting", "fa2", "--out", str(tmp_path / "r.json")]
    bad = subprocess.run([*probe, *run], capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "no config.json" in bad.stderr
    assert not (tmp_path / "r.json").exists()
    assert set(bi.SETTINGS) == set(bi.UPSTREAM)


def test_matmul_rows_counts_rows_that_depend_on_the_batch(monkeypatch):
    """On the CPU (no cuBLAS) the product of fewer rows may or may not match; the count is what it is. A product whose
    rows depend on how many are multiplied is caught row by row."""
    import torch

    counts = bi.matmul_rows(rows=(1, 4, 8), shape=(9, 16, 8), device="cpu")
    assert set(counts) == {1, 4, 8} and all(0 <= n <= m for m, n in counts.items())
    real = torch.Tensor.__matmul__
    monkeypatch.setattr(torch.Tensor, "__matmul__", lambda a, b: real(a, b) + (a.shape[0] < 9) * 2.0**-6)
    assert bi.matmul_rows(rows=(1, 4), shape=(9, 16, 8), device="cpu") == {1: 1, 4: 4}
