"""Fast attention for the actor and the reference policy when flash-attn is not installed.

verl trains on packed sequences (``use_remove_padding: true``: the responses of a micro-batch laid end to end in
one row, positions restarting at 0). For that layout transformers' ``sdpa`` builds a dense block-diagonal mask over
the whole pack, so attention costs the square of the pack (32k tokens) instead of the sum of each response's square;
flash-attn's variable-length kernel avoids this, but flash-attn ships no binary wheel and needs a CUDA toolchain to
build. PyTorch (2.10 and later) bundles the same FlashAttention-2 variable-length kernels as
``torch.nn.attention.varlen.varlen_attn``: :func:`varlen_attention` registers them with transformers as the
attention implementation ``torch_varlen``, with verl's Ulysses sequence parallelism (which verl wires into
``flash_attention_2`` only).

The recipe's configs say ``attn_implementation: auto``; :func:`resolve` turns it into ``flash_attention_2`` when
flash-attn is importable, else ``torch_varlen``. Without flash-attn verl's log-probabilities also lose flash-attn's
cross-entropy kernel and fall back to a Python loop over the tokens of a micro-batch, so ``use_fused_kernels: auto``
turns on verl's fused linear-plus-log-prob kernel (``FusedLinearForPPO``) instead. docs/scale.md has the measurements.
"""

from __future__ import annotations

import importlib.util
import inspect

import torch

NAME = "torch_varlen"
"""The ``attn_implementation`` this module registers."""
AUTO = "auto"


def flash_attn_installed() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def varlen_supported() -> bool:
    """PyTorch has ``torch.nn.attention.varlen`` (2.10 and later); the kernel itself needs a CUDA GPU."""
    return importlib.util.find_spec("torch.nn.attention.varlen") is not None


def resolve(attn_implementation: str, use_fused_kernels) -> tuple[str, bool]:
    """The attention implementation and ``use_fused_kernels`` setting a run uses, ``auto`` resolved (module
    docstring). Raises ``RuntimeError`` with what to install or override when no fast attention exists."""
    flash = flash_attn_installed()
    if attn_implementation == AUTO:
        if flash:
            attn_implementation = "flash_attention_2"
        elif varlen_supported():
            attn_implementation = NAME
        else:
            raise RuntimeError(
                f"actor_rollout_ref.model.override_config.attn_implementation=auto: flash-attn is not installed and "
                f"torch {torch.__version__} has no torch.nn.attention.varlen (PyTorch >= 2.10). Install flash-attn "
                "(`pip install flash-attn --no-build-isolation`, needs the CUDA toolkit) or PyTorch >= 2.10, or set "
                "attn_implementation=sdpa with actor_rollout_ref.model.use_remove_padding=False"
            )
    if use_fused_kernels == AUTO:
        use_fused_kernels = not flash
    return attn_implementation, bool(use_fused_kernels)


def varlen_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention function over packed sequences: ``query`` ``(1, heads, tokens, dim)``, ``key`` and
    ``value`` ``(1, kv_heads, tokens, dim)``, one causal attention per sequence, sequences found from
    ``position_ids`` restarting at 0 (as verl packs them). Returns ``(output (1, tokens, heads, dim), None)``."""
    from torch.nn.attention.varlen import varlen_attn
    from transformers.modeling_flash_attention_utils import prepare_fa_kwargs_from_position_ids
    from verl.utils.ulysses import (
        gather_heads_scatter_seq,
        gather_seq_scatter_heads,
        get_ulysses_sequence_parallel_group,
        get_ulysses_sequence_parallel_world_size,
    )

    position_ids = kwargs.get("position_ids")
    if attention_mask is not None or position_ids is None or query.shape[0] != 1 or dropout:
        raise ValueError(
            f"attn_implementation={NAME} runs packed sequences only (actor_rollout_ref.model.use_remove_padding=True, "
            "no attention mask, no dropout)"
        )
    causal = kwargs.get("is_causal", getattr(module, "is_causal", True))
    if kwargs.get("sliding_window") or kwargs.get("softcap") or not causal:
        raise ValueError(f"attn_implementation={NAME} computes full causal attention only (no sliding window, softcap)")
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # (tokens, heads, dim)
    sp = get_ulysses_sequence_parallel_world_size()
    if sp > 1:  # Ulysses: gather the sequence, scatter the heads (verl does this inside flash_attention_2 only)
        repeats = max(sp // k.shape[1], 1)
        k, v = (x.repeat_interleave(repeats, dim=1) for x in (k, v))
        q, k, v = (gather_seq_scatter_heads(x, seq_dim=0, head_dim=1) for x in (q, k, v))
        parts = [torch.empty_like(position_ids) for _ in range(sp)]
        torch.distributed.all_gather(parts, position_ids, group=get_ulysses_sequence_parallel_group())
        position_ids = torch.cat(parts, dim=-1)
    (cu_q, cu_k), (max_q, max_k) = prepare_fa_kwargs_from_position_ids(position_ids)
    if k.shape[1] != q.shape[1] and "enable_gqa" not in _VARLEN_PARAMETERS:
        k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
    options = {"scale": scaling}
    options.update({"is_causal": True} if "is_causal" in _VARLEN_PARAMETERS else {"window_size": (-1, 0)})
    if k.shape[1] != q.shape[1]:
        options["enable_gqa"] = True
    out = varlen_attn(q, k, v, cu_q, cu_k, int(max_q), int(max_k), **options)
    if sp > 1:
        out = gather_heads_scatter_seq(out, seq_dim=0, head_dim=1)
    return out.unsqueeze(0), None


def _varlen_parameters() -> frozenset[str]:
    if not varlen_supported():
        return frozenset()
    from torch.nn.attention.varlen import varlen_attn

    return frozenset(inspect.signature(varlen_attn).parameters)


_VARLEN_PARAMETERS = _varlen_parameters()


def register() -> None:
    """Make ``attn_implementation="torch_varlen"`` known to transformers (no attention mask is built for it)."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, varlen_attention)
