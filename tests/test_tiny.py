"""``stapo.quickstart.tiny.build_model`` takes every field of the base models' shapes (``QWEN3_SHAPES``): the 8B and
14B shapes untie the LM head from the embeddings, as Qwen's own configs do (a duplicated keyword once stopped
``python -m stapo.checks.scale model --shape qwen3_8b`` before it built anything)."""

import pytest
from transformers import AutoConfig

from stapo.config import QWEN3_SHAPES
from stapo.quickstart.tiny import build_model, build_tokenizer

SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tokenizer(["1 + 2 = 3", "Please reason step by step"] * 20, tmp_path_factory.mktemp("tok"))


@pytest.mark.parametrize("shape", sorted(QWEN3_SHAPES))
def test_every_shape_builds_with_its_own_fields(shape, tokenizer, tmp_path):
    fields = {**QWEN3_SHAPES[shape], **SMALL, "head_dim": 8, "vocab_size": len(tokenizer)}  # the shape, scaled down
    model = build_model(tokenizer, tmp_path, **fields)
    saved = AutoConfig.from_pretrained(tmp_path)
    assert saved.tie_word_embeddings is QWEN3_SHAPES[shape].get("tie_word_embeddings", True)
    assert (model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()) is saved.tie_word_embeddings
    assert (saved.num_hidden_layers, saved.num_key_value_heads, saved.head_dim) == (1, 2, 8)


def test_the_shapes_are_qwen3_base_models():
    tied = {name: shape.get("tie_word_embeddings", True) for name, shape in QWEN3_SHAPES.items()}
    assert tied == {"qwen3_0.6b": True, "qwen3_1.7b": True, "qwen3_8b": False, "qwen3_14b": False}
    assert [QWEN3_SHAPES[s]["num_hidden_layers"] for s in ("qwen3_1.7b", "qwen3_8b", "qwen3_14b")] == [28, 36, 40]
