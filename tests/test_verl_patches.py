"""verl's fused log-probability kernel under the recipe's plugin: float32 entropies (stapo/train/verl_patches.py),
the same log-probs and gradients as verl's own function, and a mask that silences what the rule says on entropies
that tie in bfloat16."""

import math
import sys

import pytest
import torch
from omegaconf import OmegaConf
from verl.utils.experimental import torch_functional as tf

import stapo.train.plugin  # noqa: F401  (applies the patch, as in every Ray process of a run)
from stapo.config import CONFIG_DIR
from stapo.s2t import s2t_mask
from stapo.train import verl_patches

VERLS = tf.FusedLinearForPPOFunction._stapo_original


def inputs(tokens=1300, hidden=16, vocab=1024, batch=None, seed=0, spread=0.03):
    """bfloat16 hidden states and vocabulary weights whose logits are nearly uniform over ``vocab`` tokens (every
    p near 1/vocab < τ_p, entropies within a few hundredths of ln vocab), and sampled token ids."""
    gen = torch.Generator().manual_seed(seed)
    h = (spread * torch.randn(tokens, hidden, generator=gen)).bfloat16()
    w = torch.randn(vocab, hidden, generator=gen).bfloat16()
    ids = torch.randint(0, vocab, (tokens,), generator=gen)
    if batch:
        h, ids = h.reshape(batch, tokens // batch, hidden), ids.reshape(batch, -1)
    return h, w, ids


def test_verls_own_kernel_still_returns_bfloat16_entropies():
    """The reason for the patch (verl 0.9.1). When this fails, verl returns float32 entropies itself: remove
    stapo.train.verl_patches.float32_fused_entropy."""
    h, w, ids = inputs(tokens=8)
    log_probs, entropy = VERLS.apply(h, w, ids, 1.0, 512)
    assert log_probs.dtype == torch.float32 and entropy.dtype == torch.bfloat16


@pytest.mark.parametrize("batch", [None, 4])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_plugin_makes_verls_module_return_float32_entropies(batch, temperature):
    h, w, ids = inputs(batch=batch)
    log_probs, entropy = tf.FusedLinearForPPO(chunk_size=512)(h, w, ids, temperature)  # 3 chunks, a ragged last
    ref_lp, ref_h = VERLS.apply(h, w, ids, temperature, 512)
    assert entropy.dtype == torch.float32 and entropy.shape == ids.shape
    assert torch.equal(log_probs, ref_lp)
    assert torch.equal(entropy.bfloat16(), ref_h)  # verl's values are these, rounded
    logits = ((h @ w.t()) / temperature).float()
    expected = -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)
    assert torch.allclose(entropy, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("batch", [None, 4])
def test_gradients_are_verls(batch):
    """Backward is verl's own (inherited): the gradients through the log-probs, and through the entropy, agree with
    verl's function (its entropy gradient arrives in bfloat16, ours in float32: equal up to that rounding)."""
    h, w, ids = inputs(tokens=1040, batch=batch)
    grads = []
    for function in (tf.FusedLinearForPPOFunction, VERLS):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        log_probs, entropy = function.apply(hh, ww, ids, 1.0, 512)
        (log_probs.sum() + 0.1 * entropy.float().sum()).backward()
        grads.append((hh.grad, ww.grad))
    for ours, verls in zip(*grads):
        assert ours.dtype == verls.dtype == torch.bfloat16
        assert torch.allclose(ours.float(), verls.float(), rtol=2e-2, atol=1e-3)
    hh = h.clone().requires_grad_()
    log_probs, _ = tf.FusedLinearForPPOFunction.apply(hh, w, ids, 1.0, 512)
    log_probs.sum().backward()
    hv = h.clone().requires_grad_()
    VERLS.apply(hv, w, ids, 1.0, 512)[0].sum().backward()
    assert torch.equal(hh.grad, hv.grad)  # no entropy term: bit for bit


def test_switching_back_restores_verls_function():
    patched = tf.FusedLinearForPPOFunction
    try:
        verl_patches.float32_fused_entropy(False)
        assert tf.FusedLinearForPPOFunction is VERLS
        verl_patches.float32_fused_entropy()
        verl_patches.float32_fused_entropy()  # idempotent: no patch of the patch
        assert tf.FusedLinearForPPOFunction._stapo_original is VERLS
    finally:
        tf.FusedLinearForPPOFunction = patched


def test_entropies_that_tie_in_bfloat16_are_silenced_as_the_rule_says():
    """All tokens are candidates (Â > 0, p ≈ 1/1024 < τ_p) with entropies within a hundredth of ln 1024 (the
    random model of the GPU smoke): in float32 nearly all distinct, and the rule silences ⌈q(k−1)⌉ of k; rounded to
    bfloat16, as verl 0.9.1 returned them, they take two values, tie with τ_h and are kept."""
    h, w, ids = inputs(tokens=933, hidden=64, spread=0.02)
    log_probs, entropy = tf.FusedLinearForPPO()(h, w, ids)
    k = entropy.numel()
    assert entropy.unique().numel() > 0.9 * k and entropy.bfloat16().unique().numel() <= 2
    assert (log_probs < math.log(0.002)).all()
    args = (torch.ones(1, k), torch.ones(1, k, dtype=torch.int64))
    _, stats = s2t_mask(log_probs[None], entropy[None], *args)
    assert stats["candidates"] == k and stats["masked"] == math.ceil(0.75 * (k - 1)) == stats["expected_masked"]
    verls_log_probs, verls_entropy = VERLS.apply(h, w, ids, 1.0, 512)
    _, tied = s2t_mask(verls_log_probs[None], verls_entropy[None], *args)
    assert tied["candidates"] == k and tied["masked"] < 0.1 * stats["masked"]


def test_every_listed_workaround_names_code_that_exists():
    """The list of workarounds cannot rot: each entry's code is importable, and says what it answers and when to
    remove it."""
    import importlib

    assert len({w.code for w in verl_patches.WORKAROUNDS}) == len(verl_patches.WORKAROUNDS)
    for workaround in verl_patches.WORKAROUNDS:
        module, attribute = workaround.code.split(":")
        if module.endswith(".yaml"):  # a setting of the recipe's configs
            target = OmegaConf.select(OmegaConf.load(CONFIG_DIR.parent / module), attribute)
            assert target is not None, workaround.code
        else:
            target = importlib.import_module(module)
            for part in attribute.split("."):
                target = getattr(target, part)
        assert workaround.answers and workaround.remove_when


def test_vllm_compile_cache_is_on_and_a_string():
    """verl turns vLLM's compile cache off in its runtime env; the recipe's base config turns it back on, with a
    string (Ray refuses other env-var types), and the composed config of a method keeps it."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        config = compose(config_name="stapo")
    env = OmegaConf.to_container(config.ray_kwargs.ray_init.runtime_env.env_vars)
    assert env["VLLM_DISABLE_COMPILE_CACHE"] == "0"
    # what verl's run_ppo gives ray.init: its own runtime env (the cache off) merged with the config's
    from verl.trainer.constants_ppo import get_ppo_ray_runtime_env

    verls = get_ppo_ray_runtime_env(config)
    assert verls["env_vars"]["VLLM_DISABLE_COMPILE_CACHE"] == "1"  # verl 0.9.1's; this workaround goes when it is not
    merged = OmegaConf.merge(verls, config.ray_kwargs.ray_init.runtime_env)
    assert merged.env_vars.VLLM_DISABLE_COMPILE_CACHE == "0"


def vllm_stand_in(monkeypatch, batch_invariant: bool):
    """The names of vLLM 0.24 the RMSNorm plugin uses, as stand-in modules: vLLM's wheel is a CUDA build, not installed
    on the project's CPU machines. ``batch_invariant.rms_norm_batch_invariant`` is, as in vLLM, one function imported
    into ``layernorm`` too: without a residual its Triton kernel (here torch's per-row RMS norm), with one the fused
    CUDA kernel (here a marker); ``RMSNorm.forward_cuda`` looks it up in ``layernorm`` at each call, as 0.24 does."""
    import types

    names = ("vllm", "vllm.envs", "vllm.model_executor", "vllm.model_executor.layers",
             "vllm.model_executor.layers.batch_invariant", "vllm.model_executor.layers.layernorm")  # fmt: skip
    modules = {name: types.ModuleType(name) for name in names}
    layers, layernorm = modules["vllm.model_executor.layers"], modules["vllm.model_executor.layers.layernorm"]

    def rms_norm_batch_invariant(x, weight, eps=1e-6, residual=None):
        if residual is None:
            return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)
        return "vllm's fused kernel", x, residual

    class RMSNorm(torch.nn.Module):
        def __init__(self, hidden: int):
            super().__init__()
            self.variance_epsilon = 1e-6
            self.weight = torch.nn.Parameter(torch.linspace(0.5, 1.5, hidden))

        def forward_cuda(self, x, residual=None):
            return layernorm.rms_norm_batch_invariant(x, self.weight.data, self.variance_epsilon, residual=residual)

    modules["vllm.envs"].VLLM_BATCH_INVARIANT = batch_invariant
    modules["vllm.model_executor.layers.batch_invariant"].rms_norm_batch_invariant = rms_norm_batch_invariant
    layernorm.rms_norm_batch_invariant, layernorm.RMSNorm = rms_norm_batch_invariant, RMSNorm
    layers.batch_invariant, layers.layernorm = modules["vllm.model_executor.layers.batch_invariant"], layernorm
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    return RMSNorm, layernorm


def test_the_vllm_plugin_routes_the_residual_norm_to_the_batch_invariant_kernel(monkeypatch):
    """Installed as a vLLM general plugin; without VLLM_BATCH_INVARIANT it changes nothing; with it, a norm with a
    residual, even one built before the plugin ran, returns the batch-invariant kernel's norm of the sum and the sum as
    the new residual (the pair vLLM's fused kernel returns), and a norm without one is vLLM's own; loading it twice
    wraps once."""
    from importlib.metadata import entry_points

    [plugin] = [e for e in entry_points(group="vllm.general_plugins") if e.name == "stapo_rms_norm"]
    assert plugin.load() is verl_patches.batch_invariant_residual_rms_norm
    _, untouched = vllm_stand_in(monkeypatch, batch_invariant=False)
    original = untouched.rms_norm_batch_invariant
    verl_patches.batch_invariant_residual_rms_norm()
    assert untouched.rms_norm_batch_invariant is original
    RMSNorm, layernorm = vllm_stand_in(monkeypatch, batch_invariant=True)
    original, norm = layernorm.rms_norm_batch_invariant, RMSNorm(8)  # built before the plugin runs
    x, residual = torch.randn(5, 8).bfloat16(), torch.randn(5, 8).bfloat16()
    assert norm.forward_cuda(x, residual)[0] == "vllm's fused kernel"
    for _ in range(2):
        verl_patches.batch_invariant_residual_rms_norm()
    assert layernorm.rms_norm_batch_invariant._stapo_original is original
    out, new_residual = norm.forward_cuda(x, residual)
    assert torch.equal(new_residual, x + residual)
    assert torch.equal(out, torch.nn.functional.rms_norm(x + residual, (8,), norm.weight.data, norm.variance_epsilon))
    assert torch.equal(norm.forward_cuda(x), torch.nn.functional.rms_norm(x, (8,), norm.weight.data, 1e-6))


def test_a_vllm_without_the_kernel_gets_a_warning_not_a_failed_engine(monkeypatch):
    """vLLM calls its general plugins unguarded: a vLLM whose batch_invariant module lacks the kernel leaves the norm
    as it is and warns, naming what is missing."""
    _, layernorm = vllm_stand_in(monkeypatch, batch_invariant=True)
    original = layernorm.rms_norm_batch_invariant
    monkeypatch.delattr(sys.modules["vllm.model_executor.layers.batch_invariant"], "rms_norm_batch_invariant")
    with pytest.warns(UserWarning, match="residual RMSNorm left as it is .*rms_norm_batch_invariant"):
        verl_patches.batch_invariant_residual_rms_norm()
    assert layernorm.rms_norm_batch_invariant is original
