"""The vLLM batch-invariance probe (stapo.checks.batch_invariance) on the CPU: its requests, compositions and
comparison, and the whole probe over a stand-in for vLLM's engine (which needs a GPU): one that is batch-invariant
gives zeros, one whose numbers depend on the batch is caught in tokens and in log-probabilities; ``locate``'s hooks and
comparison over a stand-in model runner (a module that mixes the batch is named); the GPU scripts with a stand-in
Python. The GPU records are in evidence/ once run (issues 54, 65)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import standins

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
    assert [len(b) for b in batches["small"]] == [2, 3, 4, 5, 6]  # batches of 2-7, in turn
    assert [len(b) for b in bi.compositions(48)["small"]] == [2, 3, 4, 5, 6, 7, 2, 3, 4, 5, 7]  # no batch of one
    assert [len(b) for b in bi.compositions(28)["small"]] == [2, 3, 4, 5, 6, 6, 2]
    assert all(2 <= len(b) <= 7 for n in range(2, 60) for b in bi.compositions(n)["small"])


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
    assert found["small"]["responses"] == 2 + 4 and found["small"]["logprobs"] == 12  # batches of 2, 3, 4 and 3
    assert all(isinstance(c["seconds"], float) and c["seconds"] >= 0 for c in found.values())


def test_the_table_and_the_cli_refusals(tmp_path, monkeypatch, capsys):
    record = {"setting": "fa2", "greedy": False, "eager": True, "requests": 12, "compositions": {
        "together": {"responses": 0, "tokens": 0, "logprobs": 0, "max_logprob_gap": 0.0},
        "chunks": {"responses": 3, "tokens": 40, "logprobs": 7, "max_logprob_gap": 0.01}},
        "environment": {"CUBLASLT_WORKSPACE_SIZE": "1", "CUBLAS_WORKSPACE_CONFIG": None},
        "matmul_rows_differing": {"1": 0, "64": 5}}  # fmt: skip
    (tmp_path / "fa2.json").write_text(json.dumps(record))
    probe = [sys.executable, "-m", "stapo.checks.batch_invariance"]
    done = subprocess.run([*probe, "table", str(tmp_path / "fa2.json")], capture_output=True, text=True)
    assert done.returncode == 0
    assert (  # a record from before --norm ran vLLM's own
        "| fa2 | seeded T=1, eager, vLLM's norm, CUBLASLT_WORKSPACE_SIZE=1 | chunks | 3 / 12 | 40 | 7 | 0.01 | vLLM PR"
        in (done.stdout)
    )
    (tmp_path / "fa2.json").write_text(json.dumps({**record, "residual_norm_rows_differing": {"vllm": 8, "recipe": 0}}))
    done = subprocess.run([*probe, "table", str(tmp_path / "fa2.json")], capture_output=True, text=True)
    assert "the residual RMSNorm, of 8 rows, rows that differ inside 300: fa2: vllm 8, recipe 0" in done.stdout
    for patched, shown in ((True, "the recipe's norm"), (False, "vLLM's norm (the recipe's was asked, not applied)")):
        (tmp_path / "fa2.json").write_text(json.dumps({**record, "norm": "recipe", "norm_patched": patched}))
        done = subprocess.run([*probe, "table", str(tmp_path / "fa2.json")], capture_output=True, text=True)
        assert f"| fa2 | seeded T=1, eager, {shown}, CUBLASLT_WORKSPACE_SIZE=1 | chunks |" in done.stdout
    assert done.stdout.endswith("(after the engine): fa2: 1 rows: 0, 64 rows: 5\n")
    assert "together" not in done.stdout and "seconds" not in done.stdout  # a record from before the timing
    timed = {name: {**counts, "seconds": s} for (name, counts), s in zip(record["compositions"].items(), (1.5, 20))}
    (tmp_path / "fa2.json").write_text(json.dumps({**record, "compositions": timed, "label": "alone-fa2"}))
    done = subprocess.run([*probe, "table", str(tmp_path / "fa2.json")], capture_output=True, text=True)
    seconds = "seconds to generate each composition (comparable between engines that ran alone): fa2 (alone-fa2) "
    assert (
        seconds + "(seeded T=1, eager, vLLM's norm, CUBLASLT_WORKSPACE_SIZE=1): together 1.5, chunks 20" in done.stdout
    )
    assert "| fa2 (alone-fa2) | seeded T=1, eager, vLLM's norm, CUBLASLT_WORKSPACE_SIZE=1 | chunks |" in done.stdout
    run = ["run", "--model", str(tmp_path), "--setting", "fa2", "--out", str(tmp_path / "r.json")]
    bad = subprocess.run([*probe, *run], capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "no config.json" in bad.stderr
    assert not (tmp_path / "r.json").exists()
    (tmp_path / "config.json").write_text("{}")  # a model folder, on a machine without vLLM
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    monkeypatch.delitem(sys.modules, "vllm", raising=False)
    with pytest.raises(SystemExit) as stopped:
        bi.main(run)
    assert stopped.value.code == 2 and capsys.readouterr().err == (
        "error: batch_invariance run needs vLLM, which is not installed: `pip install -e '.[gpu]'` on a GPU machine\n"
    )
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


class Toy:
    """A stand-in for vLLM's model runner on the CPU (vLLM's needs a GPU): a model over the batch's tokens flattened
    into rows, as vLLM's are, run as a prefill pass and two decode passes, the prompt's tokens taken from its text. Its
    ops are elementwise, so a row depends on no other row, except in ``mix`` of layer 1 when ``mixing``: it adds the
    batch's row count, from ``threshold`` rows on."""

    def __init__(self, mixing: bool, threshold: int = 0):
        import torch

        class Mix(torch.nn.Module):
            def forward(self, x):
                return x + 1e-3 * x.shape[0] * (x.shape[0] >= threshold)

        class Layer(torch.nn.Module):
            def __init__(self, mix: bool):
                super().__init__()
                self.scale = torch.nn.Parameter(torch.linspace(0.5, 1.5, 32))
                self.mix = Mix() if mix else torch.nn.Identity()

            def forward(self, x):
                return self.mix(torch.tanh(x * self.scale))

        class Model(torch.nn.Module):
            def __init__(self):
                super().__init__()
                torch.manual_seed(0)
                self.embed = torch.nn.Embedding(32, 32)
                self.layers = torch.nn.ModuleList([Layer(mixing and i == 1) for i in range(2)])

            def forward(self, ids):
                x = self.embed(ids)
                for layer in self.layers:
                    x = layer(x)
                return x

        self.model = Model()

    def generate(self, batch):
        import torch

        prompts = [[ord(c) % 32 for c in r.prompt[: 2 + len(r.prompt) % 2]] for r in batch]
        with torch.no_grad():
            logits = self.model(torch.tensor([t for p in prompts for t in p]))
            ends = torch.tensor([len(p) for p in prompts]).cumsum(0) - 1
            tokens = [[int(logits[i].argmax())] for i in ends]
            for _ in range(2):
                for t, row in zip(tokens, self.model(torch.tensor([t[-1] for t in tokens]))):
                    t.append(int(row.argmax()))
        return [(t, [0.0] * len(t)) for t in tokens]


def test_locate_names_the_first_module_that_depends_on_the_batch(monkeypatch):
    """``locate`` on a stand-in engine, each request beside its partner (the same prompt, another seed): a model
    whose rows never meet finds nothing; one whose layer 1 depends on the batch is found there, in the prefill pass,
    with every module after it differing too."""
    requests = bi.make_requests(4)
    partners = [[bi.partner(r)] for r in requests]
    assert all(p.prompt == r.prompt and p.seed != r.seed for [p], r in zip(partners, requests))
    assert not {p.seed for [p] in partners} & {
        r.seed for r in requests + bi.make_requests(48) + bi.make_requests(48, 1)
    }
    for mixing in (False, True):
        toy = Toy(mixing)
        monkeypatch.setattr(bi, "RECORDER", bi.Recorder())
        assert bi.RECORDER.attach(toy.model) == 7  # the model, embed, layers (never called), 2 x (layer, mix)
        results = bi.locate(toy.generate, requests, partners)
        assert all(r["passes"] == [3, 3] and r["batch"] == 2 for r in results)
        if not mixing:
            assert all("module" not in r for r in results) and bi.summary(results) == {"none": 4}
            continue
        assert {(r["pass"], r["module"], r["aligned"]) for r in results} == {(0, "layers.1.mix", True)}
        assert results[0]["first_modules"] == ["layers.1.mix", "layers.1", "model"]
        assert results[0]["max_abs_diff"] > 0 and bi.summary(results) == {"layers.*.mix": 4}


def test_first_difference_on_recorded_passes():
    """Rows of a batch's first request against the request alone: equal rows pass; a differing first module means
    the rows were another request's (``aligned`` False); modules in another order are an error, not a finding; the
    summary counts decoder layers as one."""
    import torch

    alone = [[("embed", [torch.ones(3, 2)]), ("layers.0", [torch.ones(3, 2)]), ("logits", [torch.ones(1, 4)])]]
    pair = [[("embed", [torch.ones(5, 2)]), ("layers.0", [torch.ones(5, 2)]), ("logits", [torch.ones(2, 4)])]]
    assert bi.first_difference(alone, pair) is None
    pair[0][1] = ("layers.0", [torch.cat([torch.full((1, 2), 1.5), torch.ones(4, 2)])])
    found = bi.first_difference(alone, pair)
    assert (found["module"], found["max_abs_diff"], found["aligned"]) == ("layers.0", 0.5, True)
    assert found["modules_differing"] == 1
    pair[0][0] = ("embed", [torch.zeros(5, 2)])
    assert bi.first_difference(alone, pair)["aligned"] is False
    later = [alone[0], alone[0]], [alone[0], [("embed", [torch.zeros(1, 2)]), *alone[0][1:]]]  # a decode pass too
    assert (bi.first_difference(*later)["pass"], bi.first_difference(*later)["aligned"]) == (1, False)
    assert "another order" in bi.first_difference(alone, [[("layers.0", [torch.ones(3, 2)])]])["error"]
    counted = bi.summary([{"module": "model.layers.12"}, {"module": "model.layers.3"}, {}])
    assert counted == {"model.layers.*": 2, "none": 1}


def test_a_sampler_that_is_not_a_module_is_wrapped(monkeypatch):
    """vLLM 0.24's V2 model runner's sampler is a plain object: ``locate`` wraps it, its outputs recorded and every
    other attribute passed through; a module sampler (the V1 runner's) gets a hook."""
    import types

    import torch

    class Sampler:
        states = "kept"

        def __call__(self, logits, batch):
            return (logits.argmax(-1),)

    monkeypatch.setattr(bi, "RECORDER", bi.Recorder())
    worker = types.SimpleNamespace(model_runner=types.SimpleNamespace(sampler=Sampler()))
    assert bi._attach_sampler(worker) == "wrapper around Sampler (SimpleNamespace)"
    bi.RECORDER.on, bi.RECORDER.passes = True, [[]]
    assert worker.model_runner.sampler(torch.tensor([[0.0, 2.0]]), None)[0].tolist() == [1]
    assert worker.model_runner.sampler.states == "kept" and bi.RECORDER.passes[0][0][0] == "sampler"
    module = types.SimpleNamespace(model_runner=types.SimpleNamespace(sampler=torch.nn.Identity()))
    assert bi._attach_sampler(module) == "hook on Identity"
    assert bi._attach_sampler(types.SimpleNamespace(model_runner=object())) == "no sampler found"


def test_the_models_projections_and_their_rows(monkeypatch):
    """The shapes ``linear_rows`` multiplies, from a Qwen3 config (head_dim given) and a Llama one (derived); rows
    that depend on how many are computed are counted per projection."""
    import torch.nn.functional as F

    qwen = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
            "intermediate_size": 96, "vocab_size": 500}  # fmt: skip
    assert bi.projection_shapes(qwen) == {"qkv_proj": (64, 256), "o_proj": (128, 64), "gate_up_proj": (64, 192),
                                          "down_proj": (96, 64), "lm_head": (64, 500)}  # fmt: skip
    llama = {"hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 96, "vocab_size": 500}
    assert bi.projection_shapes(llama)["qkv_proj"] == (64, 192)
    counts = bi.linear_rows({"o_proj": (16, 8)}, rows=(1, 4), full=9, device="cpu")
    assert set(counts["o_proj"]) == {1, 4} and all(0 <= n <= m for m, n in counts["o_proj"].items())
    real = F.linear
    monkeypatch.setattr(F, "linear", lambda x, w: real(x, w) + (x.shape[0] < 9) * 2.0**-6)
    assert bi.linear_rows({"lm_head": (16, 8)}, rows=(1, 4), full=9, device="cpu") == {"lm_head": {1: 1, 4: 4}}
    chosen = {"backend": "FLASH_ATTN", "implementation": "FlashAttentionImpl", "flash_attn_version": 3}
    record = {"setting": "fa3", "greedy": True, "eager": True, "requests": 2, "compositions": {"together": {}},
              "linear_rows_differing": {"lm_head": {"1": 1}}, "attention": chosen}  # fmt: skip
    shown = bi.table([record])
    assert "rows differing: fa3: lm_head 1 rows: 1" in shown
    assert shown.endswith("the engine chose: fa3: FLASH_ATTN (FlashAttentionImpl, FlashAttention 3)\n")


LOCATE_STANDIN = """#!{python}
import json, sys
with open({calls!r}, "a") as calls:
    calls.write(" ".join(sys.argv[1:]) + "\\n")
if sys.argv[2:4] == ["stapo.checks.batch_invariance", "table"]:
    from stapo.checks.batch_invariance import main
    main(sys.argv[3:])
elif sys.argv[2] == "stapo.checks.batch_invariance":
    record = {{"setting": sys.argv[sys.argv.index("--setting") + 1], "greedy": False, "eager": True, "requests": 48,
              "compositions": {{"together": {{}}}}, "attention": {{"backend": "FLASH_ATTN",
              "implementation": "FlashAttentionImpl", "flash_attn_version": 3}}}}
    open(sys.argv[sys.argv.index("--out") + 1], "w").write(json.dumps(record))
"""


def test_the_locate_script_runs_the_probes_and_the_locates_with_each_norm(tmp_path):
    """scripts/gpu/locate.sh as printed, from a folder that does not exist yet, with a stand-in for the Python that
    needs a GPU (it records each command and writes a record): the model converted from --src, the probe with vLLM's
    norm and the recipe's (FA3) and TRITON's with the recipe's, locate beside many partners with each norm, each with
    arguments the real parser accepts, and the probes' table."""
    out, gguf = tmp_path / "new" / "loc", tmp_path / "sm.gguf"
    gguf.write_bytes(b"GGUF")
    done, lines = standins.run_gpu_script(tmp_path, "locate.sh", LOCATE_STANDIN, out, "--src", gguf)
    assert done.returncode == 0, done.stderr
    assert lines[0].startswith(f"-m stapo.tools.pretrained --out {out}/smollm2/raw --src {gguf}")
    jobs = sorted(line.split()[2:] for line in lines if line.split()[2] in ("run", "locate"))
    model, many = f"{out}/smollm2/raw", ["--partner", "many", "--max-tokens", "64"]
    assert jobs == sorted([
        ["run", "--model", model, "--setting", "fa3", "--norm", "vllm", "--out", f"{out}/locate/probe-fa3-vllm.json"],
        ["run", "--model", model, "--setting", "fa3", "--out", f"{out}/locate/probe-fa3.json"],
        ["run", "--model", model, "--setting", "triton", "--out", f"{out}/locate/probe-triton.json"],
        ["locate", "--model", model, "--setting", "fa3", *many, "--norm", "vllm", "--out",
         f"{out}/locate/fa3-many-vllm.json"],
        ["locate", "--model", model, "--setting", "fa3", *many, "--out", f"{out}/locate/fa3-many.json"],
    ])  # fmt: skip
    [table] = [line.split()[2:] for line in lines if line.split()[2] == "table"]
    assert sorted(table[1:]) == sorted(f"{out}/locate/probe-{n}.json" for n in ("fa3-vllm", "fa3", "triton"))
    for job in jobs:  # the real parser takes each (it stops at the model folder, which the stand-in did not write)
        found = subprocess.run([sys.executable, "-m", "stapo.checks.batch_invariance", *job[:-1], str(tmp_path / "x")],
                               capture_output=True, text=True)  # fmt: skip
        assert found.returncode == 2 and "no config.json there" in found.stderr, found.stderr
    assert (out / "locate" / "table.md").read_text().endswith("FLASH_ATTN (FlashAttentionImpl, FlashAttention 3)\n")
    usage = standins.run_gpu_script(tmp_path, "locate.sh", "", "--help")[0]
    assert usage.returncode == 0 and "decoded alone" in usage.stdout


def test_what_the_engine_chose_is_read_from_its_attention_layer():
    """vLLM's attention layers carry ``attn_backend`` (the class, with ``get_name``) and ``impl``; a model without one
    gives Nones rather than failing after the engine started."""
    import torch

    class FlashAttentionImpl:
        vllm_flash_attn_version = 3

    class Backend:
        @staticmethod
        def get_name():
            return "FLASH_ATTN"

    layer = torch.nn.Module()
    layer.attn_backend, layer.impl = Backend, FlashAttentionImpl()
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Sequential(layer))
    assert bi.attention_facts(model) == {"backend": "FLASH_ATTN", "implementation": "FlashAttentionImpl",
                                         "flash_attn_version": 3}  # fmt: skip
    assert bi.attention_facts(torch.nn.Linear(2, 2)) == dict.fromkeys(("backend", "implementation",
                                                                       "flash_attn_version"))  # fmt: skip


def test_longer_partners_keep_the_request_first():
    """``--partner longer``: each request's partner is the first of the pool with more tokens (a count given here by
    words), so that vLLM 0.24's V2 runner, fewer scheduled tokens first, still puts the request first; a request no
    prompt of the pool outgrows gets None (``locate`` leaves it out and records its seed)."""
    words = lambda prompt: len(prompt.split())  # noqa: E731
    requests, pool = bi.make_requests(6), bi.make_requests(48, seed=1)
    partners = bi.longer_partners(requests, pool, words)
    found = [(r, p) for r, [*p] in zip(requests, partners, strict=True) if p]
    assert len(found) >= 4 and all(
        len(p) == 1 and words(p[0].prompt) > words(r.prompt) and p[0] in pool for r, p in found
    )
    longest = max(pool, key=lambda r: words(r.prompt))
    assert bi.longer_partners([longest], pool, words) == [[]]
    many = bi.longer_partners(requests, pool, words, bi.MANY)  # --partner many: every longer prompt, up to 47
    assert all(len(p) <= bi.MANY and all(words(o.prompt) > words(r.prompt) for o in p) for r, p in zip(requests, many))
    assert max(len(p) for p in many) > 1 and [p[:1] for p in many] == partners


def test_many_partners_find_what_one_partner_cannot():
    """A batch dependence that starts at 8 rows: beside one partner (the same prompt) nothing differs; beside up to 47
    longer prompts the request's own rows are kept (no more rows than it has tokens) and layer 1's mix is found, in
    the prefill pass, aligned."""
    requests, pool = bi.make_requests(3), bi.make_requests(48, seed=1)
    toy = Toy(mixing=True, threshold=8)
    recorder = bi.Recorder()
    recorder.attach(toy.model)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(bi, "RECORDER", recorder)
        one = bi.locate(toy.generate, requests, [[bi.partner(r)] for r in requests])
        many = [[o for o in pool if len(o.prompt) % 2 == len(r.prompt) % 2][:10] for r in requests]  # same toy length
        found = bi.locate(toy.generate, requests, many)
    assert max(t.shape[0] for step in recorder.passes for _, tensors in step for t in tensors) <= 3  # toy prompts
    assert all("module" not in r for r in one) and all(r["batch"] == 2 for r in one)
    assert [(r["batch"], r["pass"], r["module"], r["aligned"]) for r in found] == [(11, 0, "layers.1.mix", True)] * 3
    for r, request, others in zip(found, requests, many):  # the toy's prompts: 2 or 3 tokens each
        toy_tokens = lambda prompt: 2 + len(prompt) % 2  # noqa: E731
        assert r["prefill_tokens"] == [toy_tokens(request.prompt), sum(map(toy_tokens, [request.prompt, *(o.prompt
                                       for o in others)]))]  # fmt: skip


def test_the_norm_switch_decides_whether_vllm_loads_the_recipes_plugin(monkeypatch):
    """``--norm vllm``: VLLM_PLUGINS empty, so vLLM 0.24 (vllm/plugins/__init__.py: a plugin loads when the variable is
    unset or names it) loads none; ``--norm recipe``: unset, so every installed plugin loads, the recipe's RMSNorm
    among them (its entry point: tests/test_verl_patches.py)."""
    monkeypatch.setenv("VLLM_PLUGINS", "someone_else")
    bi.choose_norm("vllm")
    assert os.environ["VLLM_PLUGINS"] == "" and "stapo_rms_norm" not in os.environ["VLLM_PLUGINS"].split(",")
    bi.choose_norm("recipe")
    assert "VLLM_PLUGINS" not in os.environ
    assert set(bi.NORMS) == {"recipe", "vllm"}
