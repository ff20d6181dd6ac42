"""The recipe's packed-sequence attention (stapo/train/attention.py) inside a real transformers Qwen3.

PyTorch's variable-length FlashAttention kernel needs a CUDA GPU: here ``varlen_attn`` is replaced by a stand-in
that runs torch's SDPA on each sequence (what the kernel computes), so that what the test checks is the glue:
sequence boundaries from position_ids, the head layout, grouped-query heads, causality, the returned shape.
``python -m stapo.checks.benchmark attention`` checks the real kernel on a GPU."""

import copy

import pytest
import torch
import torch.nn.functional as F

from stapo.train import attention


def sdpa_per_sequence(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=None, is_causal=None,
                      enable_gqa=False):  # fmt: skip
    assert torch.equal(cu_q, cu_k) and cu_q.dtype == torch.int32 and int(max_q) == int((cu_q[1:] - cu_q[:-1]).max())
    assert is_causal is True or window_size == (-1, 0)
    out = []
    for a, b in zip(cu_q[:-1].tolist(), cu_q[1:].tolist()):
        x = F.scaled_dot_product_attention(
            *(t[a:b].transpose(0, 1) for t in (q, k, v)),
            is_causal=True,
            scale=scale,
            enable_gqa=k.shape[1] != q.shape[1],
        )
        out.append(x.transpose(0, 1))
    return torch.cat(out)


@pytest.fixture
def tiny_qwen(monkeypatch):
    import torch.nn.attention.varlen as varlen
    from transformers import AutoModelForCausalLM, Qwen3Config

    monkeypatch.setattr(varlen, "varlen_attn", sdpa_per_sequence)
    attention.register()
    config = Qwen3Config(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16)  # fmt: skip
    torch.manual_seed(0)
    packed = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=attention.NAME).eval()
    padded = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="sdpa").eval()
    padded.load_state_dict(packed.state_dict())
    return packed, padded


def test_packed_sequences_equal_each_sequence_alone(tiny_qwen):
    packed, padded = tiny_qwen
    lengths = [5, 1, 9, 3]
    ids = [torch.randint(0, 97, (n,)) for n in lengths]
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.no_grad():
        logits = packed(input_ids=torch.cat(ids)[None], position_ids=position_ids).logits[0]
        alone = torch.cat([padded(input_ids=x[None]).logits[0] for x in ids])
    assert torch.allclose(logits, alone, atol=1e-5)


def test_options_it_cannot_honour_are_refused():
    q = torch.zeros(1, 2, 4, 8)
    position_ids = torch.arange(4)[None]
    for options in ({"sliding_window": 2}, {"softcap": 30.0}, {"is_causal": False}):
        with pytest.raises(ValueError, match="full causal attention only"):
            attention.varlen_attention(None, q, q, q, None, position_ids=position_ids, **options)


def test_only_packed_inputs_are_accepted(tiny_qwen):
    packed, _ = tiny_qwen
    ids = torch.randint(0, 97, (2, 6))
    with pytest.raises(ValueError, match="runs packed sequences only"):
        packed(input_ids=ids, attention_mask=torch.ones_like(ids))
