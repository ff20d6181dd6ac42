"""Renormalisation over the kept tokens, through verl's real ``ppo_loss`` / ``agg_loss`` (stapo/loss.py).

``run_engine_minibatch`` does for one PPO mini-batch what verl's FSDP engine (``forward_backward_batch``) does
around the loss function: count the loss-mask tokens of the mini-batch, all-reduce that count over the
data-parallel group, split into micro-batches, call ``loss_function(model_output=..., data=..., dp_group=...)``
on each and accumulate. The FSDP model itself cannot run on CPU in verl 0.9.1, so the "model output" is a leaf
tensor of current-policy log-probs (and entropies), which makes the gradient per token directly visible.
"""

import functools
import json
import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tensordict import TensorDict
from verl.utils import tensordict_utils as tu
from verl.utils.config import omega_conf_to_dataclass
from verl.utils.metric import AggregationType, Metric
from verl.workers.utils.losses import ppo_loss

from stapo.config import CONFIG_DIR, StapoConfig
from stapo.s2t import s2t_mask
from stapo.train.clusters import free_ports
from stapo.train.loss import stapo_loss

PROMPT_LENS = [3, 2, 4, 2, 3, 5]
RESP_LENS = [5, 3, 6, 4, 2, 6]
ADV = [1.5, -0.5, 0.8, 1.2, 0.0, -1.0]


@functools.cache
def actor_config():
    """The actor section of the recipe's STAPO config, as verl's own dataclass (clip 0.8/1.28, token-mean)."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        cfg = compose(config_name="stapo")
    return omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)


def nested(rows, dtype=torch.float32):
    return torch.nested.as_nested_tensor([torch.as_tensor(r, dtype=dtype) for r in rows], layout=torch.jagged)


def make_batch(mask_rows, seed=0):
    """A mini-batch as the actor worker sees it (nested TransferQueue fields) plus the policy's outputs."""
    gen = torch.Generator().manual_seed(seed)
    old = [-3 * torch.rand(n, generator=gen) - 0.05 for n in RESP_LENS]
    cur = [o + torch.rand(n, generator=gen) - 0.5 for o, n in zip(old, RESP_LENS)]  # ratios in [0.6, 1.65]
    ent = [2 * torch.rand(n, generator=gen) for n in RESP_LENS]
    data = TensorDict(
        {
            "prompts": nested([torch.ones(p) for p in PROMPT_LENS], torch.int64),
            "responses": nested([torch.ones(r) for r in RESP_LENS], torch.int64),
            "response_mask": nested(mask_rows, torch.int64),
            "old_log_probs": nested(old),
            "advantages": nested([[a] * r for a, r in zip(ADV, RESP_LENS)]),
        },
        batch_size=[len(RESP_LENS)],
    )
    return data, cur, ent


def full_sequence(values, rows):
    """Flat per-token model output over prompt+response, as the engine returns it (response shifted by one)."""
    out = []
    for i in rows:
        seq = torch.zeros(PROMPT_LENS[i] + RESP_LENS[i])
        seq = torch.cat([seq[: PROMPT_LENS[i] - 1], values[i], seq[-1:]])
        out.append(seq)
    return torch.cat(out)


def run_engine_minibatch(loss_fn, data, cur, ent, rows, micro_splits, group=None):
    """verl's forward_backward_batch for the rows of one rank; returns (summed loss, grads of cur per row)."""
    local = tu.index_select_tensor_dict(data, torch.tensor(rows))
    count = torch.tensor(int(local["response_mask"].values().sum()))
    if group is not None:
        dist.all_reduce(count, group=group)
    dp_size = dist.get_world_size(group) if group is not None else 1
    tu.assign_non_tensor(local, batch_num_tokens=int(count), dp_size=dp_size, global_batch_size=len(RESP_LENS))
    leaves = {i: cur[i].clone().requires_grad_(True) for i in rows}
    total, metrics = torch.zeros(()), []
    for split in micro_splits:
        idx = [rows[j] for j in split]
        micro = tu.index_select_tensor_dict(local, torch.tensor(split))
        output = {
            "log_probs": full_sequence({i: leaves[i] for i in idx}, idx),
            "entropy": full_sequence({i: ent[i] for i in idx}, idx),
        }
        loss, micro_metrics = loss_fn(model_output=output, data=micro, dp_group=group)
        loss.backward()
        total = total + loss.detach()
        metrics.append(micro_metrics)
    return total, {i: leaves[i].grad for i in rows}, metrics


def hand_loss(keep_rows, cur, data, cfg, weights=None):
    """STAPO objective: Σ_kept clipped surrogate / #kept (paper eq. J_STAPO, dual clip as in verl); with ``weights``
    (verl's rollout correction, token-level IS) each kept token's term is multiplied by its weight."""
    old = [r for r in data["old_log_probs"].unbind()]
    num, kept = 0.0, 0
    for i, keep in enumerate(keep_rows):
        for t, k in enumerate(keep):
            if not k:
                continue
            r, a = math.exp(cur[i][t] - old[i][t]), ADV[i]
            loss = max(-r * a, -min(max(r, 1 - cfg.clip_ratio_low), 1 + cfg.clip_ratio_high) * a)
            if a < 0:
                loss = min(loss, -cfg.clip_ratio_c * a)
            num, kept = num + loss * (1.0 if weights is None else float(weights[i][t])), kept + 1
    return num / kept


def folded_mask():
    """Response mask with some interior tokens silenced (as the driver folds the S2T mask)."""
    rows = [[1] * n for n in RESP_LENS]
    for i, t in [(0, 1), (0, 3), (2, 0), (2, 5), (3, 2)]:
        rows[i][t] = 0
    return rows


OLD = functools.partial(stapo_loss, stapo=StapoConfig(mask="s2t"))


@pytest.mark.parametrize("splits", [[[0, 1, 2, 3, 4, 5]], [[0], [1, 2], [3, 4, 5]], [[0, 5], [1, 2, 3, 4]]])
@pytest.mark.parametrize("loss", ["ppo_loss", "stapo_loss"])
def test_token_mean_over_kept_tokens_for_any_micro_split(splits, loss):
    cfg = actor_config()
    fn = functools.partial(ppo_loss if loss == "ppo_loss" else OLD, config=cfg)
    mask = folded_mask()
    data, cur, ent = make_batch(mask)
    total, grads, _ = run_engine_minibatch(fn, data, cur, ent, list(range(6)), splits)
    assert total.item() == pytest.approx(hand_loss(mask, cur, data, cfg), rel=1e-5)
    for i, row in enumerate(mask):
        for t, k in enumerate(row):
            if not k:
                assert grads[i][t] == 0.0  # a silenced token contributes nothing to the update
    assert any(g.abs().sum() > 0 for g in grads.values())


def test_rollout_correction_weights_multiply_the_kept_tokens_and_the_silenced_stay_out():
    """verl's rollout correction (``algorithm.rollout_correction.rollout_is=token``: truncated importance weights
    ``rollout_is_weights``) with the folded S2T mask: a silenced token stays out of the sum and of the denominator
    whatever its weight, a kept one enters weighted, for any micro-batch split."""
    cfg = actor_config()
    mask = folded_mask()
    data, cur, ent = make_batch(mask)
    gen = torch.Generator().manual_seed(7)
    weights = [torch.rand(n, generator=gen) * 2 for n in RESP_LENS]  # truncated at 2, as rollout_is_threshold
    for i, t in [(0, 1), (2, 5)]:
        weights[i][t] = 1e6  # a silenced token's weight, however large, must not count
    data["rollout_is_weights"] = nested(weights)
    fn = functools.partial(OLD, config=cfg)
    for splits in ([[0, 1, 2, 3, 4, 5]], [[0], [1, 2], [3, 4, 5]]):
        total, grads, _ = run_engine_minibatch(fn, data, cur, ent, list(range(6)), splits)
        assert total.item() == pytest.approx(hand_loss(mask, cur, data, cfg, weights), rel=1e-5)
        assert total.item() != pytest.approx(hand_loss(mask, cur, data, cfg), rel=1e-3)  # the weights acted
        assert all(grads[i][t] == 0.0 for i, row in enumerate(mask) for t, k in enumerate(row) if not k)


def test_the_recipe_accepts_verls_rollout_correction_keys():
    """The preflight takes verl's own rollout-correction settings (token-level truncated IS, rejection sampling) with
    the S2T mask; only bypass_mode, which drops the old policy's entropies, is refused (tests/test_preflight.py)."""
    from hydra import compose, initialize_config_dir

    from stapo.train.main import validate

    settings = ("rollout_is=token", "rollout_is_threshold=2.0", "rollout_rs=token_k1", "rollout_rs_threshold=2.0")
    keys = [f"algorithm.rollout_correction.{setting}" for setting in settings]
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        config = compose(config_name="stapo", overrides=keys)
    assert validate(config, environment=False).mask == "s2t"
    assert config.algorithm.rollout_correction.rollout_is == "token"


def test_audit_records_zero_gradient_at_silenced_tokens(tmp_path, monkeypatch):
    monkeypatch.setenv("STAPO_AUDIT_DIR", str(tmp_path))
    mask = folded_mask()
    data, cur, ent = make_batch(mask)
    run_engine_minibatch(
        functools.partial(OLD, config=actor_config()), data, cur, ent, list(range(6)), [[0, 1, 2], [3, 4, 5]]
    )
    (log,) = tmp_path.glob("loss-*.jsonl")
    records = [json.loads(line) for line in log.read_text().splitlines()]
    kept = sum(map(sum, mask))
    assert [r["batch_num_tokens"] for r in records] == [kept, kept]
    assert sum(r["kept_tokens"] for r in records) == kept and sum(r["silenced_tokens"] for r in records) == 5
    assert all(r["max_grad_silenced"] == 0.0 for r in records)
    # kept tokens with a non-zero advantage get gradient unless PPO clipping stops it
    movable = sum(1 for i, row in enumerate(mask) for k in row if k and ADV[i] != 0)
    assert 0 < sum(r["nonzero_grad_kept"] for r in records) <= movable
    assert not any(r["rollout_is_weights"] for r in records)  # what the GPU smoke's check 10 reads
    data["rollout_is_weights"] = nested([torch.ones(n) for n in RESP_LENS])
    log.unlink()
    run_engine_minibatch(
        functools.partial(OLD, config=actor_config()), data, cur, ent, list(range(6)), [[0, 1, 2, 3, 4, 5]]
    )
    assert [json.loads(line)["rollout_is_weights"] for line in log.read_text().splitlines()] == [True]


def test_all_masked_minibatch_gives_finite_zero_loss():
    cfg = actor_config()
    data, cur, ent = make_batch([[0] * n for n in RESP_LENS])
    raw, _, _ = run_engine_minibatch(
        functools.partial(ppo_loss, config=cfg), data, cur, ent, list(range(6)), [[0, 1, 2], [3, 4, 5]]
    )
    assert torch.isnan(raw)  # what verl alone does: 0 / 0
    total, grads, _ = run_engine_minibatch(
        functools.partial(OLD, config=cfg), data, cur, ent, list(range(6)), [[0, 1, 2], [3, 4, 5]]
    )
    assert torch.isfinite(total) and total.item() == 0.0
    assert all(torch.all(g == 0) for g in grads.values())


def test_current_policy_mask_single_micro_batch_is_exact():
    """policy_source=current with one micro-batch: the S2T mask of π_θ and an exact denominator."""
    cfg = actor_config()
    data, cur, ent = make_batch([[1] * n for n in RESP_LENS])
    keep_rows = current_policy_keep(cur, ent)
    fn = functools.partial(stapo_loss, config=cfg, stapo=CURRENT)
    total, grads, _ = run_engine_minibatch(fn, data, cur, ent, list(range(6)), [[0, 1, 2, 3, 4, 5]])
    assert total.item() == pytest.approx(hand_loss(keep_rows, cur, data, cfg), rel=1e-5)
    for i, row in enumerate(keep_rows):
        assert all(grads[i][t] == 0 for t, k in enumerate(row) if not k)


CURRENT = StapoConfig(mask="s2t", policy_source="current", tau_p=0.2, q=0.5)


def current_policy_keep(cur, ent):
    """The S2T mask of the whole mini-batch from π_θ's log-probs and entropies, as rows of kept flags."""
    ones = [[1] * n for n in RESP_LENS]
    adv = [[a] * n for a, n in zip(ADV, RESP_LENS)]
    keep, stats = s2t_mask(pad(cur), pad(ent), pad(adv), pad(ones), tau_p=CURRENT.tau_p, q=CURRENT.q)
    assert stats["masked"] > 0
    return [keep[i, :n].tolist() for i, n in enumerate(RESP_LENS)]


def pad(rows):
    width = max(len(r) for r in rows)
    return torch.stack(
        [torch.nn.functional.pad(torch.as_tensor(r, dtype=torch.float32), (0, width - len(r))) for r in rows]
    )


def _rank_main(rank, port, mode, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        cfg = actor_config()
        if mode == "old":
            mask = folded_mask()
            fn = functools.partial(OLD, config=cfg)
            splits = [[0], [1, 2]] if rank == 0 else [[0, 1], [2]]
        else:
            mask = [[1] * n for n in RESP_LENS]
            fn = functools.partial(stapo_loss, config=cfg, stapo=CURRENT)
            splits = [[0, 1, 2]]  # one micro-batch per rank: the gathered quantile is the mini-batch's
        data, cur, ent = make_batch(mask)
        rows = [0, 1, 2] if rank == 0 else [3, 4, 5]  # verl hands each rank a contiguous chunk
        total, grads, metrics = run_engine_minibatch(fn, data, cur, ent, rows, splits, group=dist.group.WORLD)
        dist.all_reduce(total)  # FSDP averages over ranks; the loss is pre-scaled by dp_size
        counts = {
            key: [m[key].values for m in metrics if key in m]
            for key in ("stapo/masked_tokens", "stapo/expected_masked_tokens")
        }
        queue.put((rank, total.item() / 2, {i: g.tolist() for i, g in grads.items()}, counts))
    finally:
        dist.destroy_process_group()


def run_two_ranks(mode):
    ctx = mp.get_context("spawn")
    queue, (port,) = ctx.Queue(), free_ports(1)
    procs = [ctx.Process(target=_rank_main, args=(r, port, mode, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=240) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    return results


def test_two_gloo_ranks_old_policy_mask_matches_single_process():
    cfg = actor_config()
    mask = folded_mask()
    data, cur, _ = make_batch(mask)
    expected = hand_loss(mask, cur, data, cfg)
    for _, loss, grads, _ in run_two_ranks("old"):
        assert loss == pytest.approx(expected, rel=1e-5)
        for i, g in grads.items():
            assert all(g[t] == 0 for t, k in enumerate(mask[i]) if not k)


def test_two_gloo_ranks_current_policy_mask_uses_the_gathered_quantile():
    cfg = actor_config()
    data, cur, ent = make_batch([[1] * n for n in RESP_LENS])
    keep_rows = current_policy_keep(cur, ent)
    expected = hand_loss(keep_rows, cur, data, cfg)
    results = run_two_ranks("current")
    for _, loss, grads, _ in results:
        assert loss == pytest.approx(expected, rel=1e-5)
        for i, g in grads.items():
            assert all(g[t] == 0 for t, k in enumerate(keep_rows[i]) if not k)
    # the token counts as verl aggregates them over ranks (a mean) are the mini-batch's: silenced over both ranks,
    # and what the rule silences in the gathered pool with distinct entropies, ⌈q(k−1)⌉
    adv, ones = [[a] * n for a, n in zip(ADV, RESP_LENS)], [[1] * n for n in RESP_LENS]
    _, stats = s2t_mask(pad(cur), pad(ent), pad(adv), pad(ones), CURRENT.tau_p, CURRENT.q)
    expected = {
        "stapo/masked_tokens": sum(not k for row in keep_rows for k in row),
        "stapo/expected_masked_tokens": math.ceil(CURRENT.q * (stats["candidates"] - 1)),
    }
    assert expected["stapo/masked_tokens"] == stats["masked"] == expected["stapo/expected_masked_tokens"]
    for key, value in expected.items():
        per_rank = [Metric(AggregationType.SUM) for _ in results]
        for metric, (*_, counts) in zip(per_rank, results):
            metric.extend([v for micro in counts[key] for v in micro])
        assert Metric.aggregate_dp(per_rank) == pytest.approx(value)


@pytest.mark.parametrize("norm", ["selected", "all"])
def test_current_policy_top_entropy_denominator_follows_the_knob(norm):
    """20-Entropy inside the update: the loss is the clipped surrogate of the kept (top-ρ entropy) tokens, divided by
    their count (``selected``, the authors' code) or by all response tokens (``all``, the 80/20 paper's formula)."""
    from stapo.s2t import top_entropy_mask

    cfg = actor_config()
    data, cur, ent = make_batch([[1] * n for n in RESP_LENS])
    ones = [[1] * n for n in RESP_LENS]
    keep, _ = top_entropy_mask(pad(ent), pad(ones), 0.5)
    keep_rows = [keep[i, :n].tolist() for i, n in enumerate(RESP_LENS)]
    kept, tokens = sum(map(sum, keep_rows)), sum(RESP_LENS)
    assert 0 < kept < tokens
    stapo = StapoConfig(mask="top_entropy", policy_source="current", top_entropy_ratio=0.5, top_entropy_norm=norm)
    fn = functools.partial(stapo_loss, config=cfg, stapo=stapo)
    total, _, _ = run_engine_minibatch(fn, data, cur, ent, list(range(6)), [[0, 1, 2, 3, 4, 5]])
    expected = hand_loss(keep_rows, cur, data, cfg) * (1 if norm == "selected" else kept / tokens)
    assert total.item() == pytest.approx(expected, rel=1e-5)
