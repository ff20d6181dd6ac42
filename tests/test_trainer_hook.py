"""The driver-side hook in verl's real V1 trainer, with a real Ray + TransferQueue and verl's data classes.

Stand-in: only the actor worker group (``actor_rollout_wg``), whose FSDP workers need GPUs. It does what verl's
dispatch and ``TrainingWorker.train_mini_batch`` do with the batch (``KVBatchMeta.chunk`` over data-parallel ranks,
``tensordict_utils.make_iterator`` per rank), reads the response mask from TransferQueue as the workers would, and
records each mini-batch it would train on.
"""

import functools
import itertools
import json
import math
import time

import pytest
import ray
import torch
import transfer_queue as tq
from omegaconf import OmegaConf
from tensordict import TensorDict
from transfer_queue import KVBatchMeta
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync
from verl.utils import tensordict_utils as tu

from stapo.config import CONFIG_DIR
from stapo.s2t import s2t_mask
from stapo.train.loss import stapo_loss
from stapo.train.preflight import DETERMINISM, validate_training_config
from stapo.train.trainer import POLL_INTERVAL_S, STAPOTrainer, minibatch_rows, submission_order

N_ROWS, DP = 16, 2
MINI_PROMPTS, ROLLOUT_N = 2, 2  # PPO mini-batch of 4 responses: 4 mini-batches, 2 rows per rank each


@pytest.fixture(scope="module")
def transfer_queue():
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)  # never a running cluster
    tq.init(OmegaConf.create({"backend": {"SimpleStorage": {"num_data_storage_units": 1, "total_storage_size": 1000}}}))
    yield
    tq.close()
    ray.shutdown()


def compose(*overrides):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return hydra_compose(
            config_name="stapo",
            overrides=[
                f"actor_rollout_ref.actor.ppo_mini_batch_size={MINI_PROMPTS}",
                f"actor_rollout_ref.rollout.n={ROLLOUT_N}",
                "actor_rollout_ref.actor.shuffle=True",
                *overrides,
            ],
        )


class StandInActorWorkerGroup:
    """Replaces the GPU worker group: splits like verl and records what each mini-batch would train on."""

    def __init__(self, update_metrics=None):
        self._dispatch_info = {"actor": list(range(DP))}
        self.seen = []
        self.loss_fn = None
        self.update_metrics = update_metrics or {}

    UPDATE_SECONDS = 0.3  # what the "update" takes here: the trainer's mask timers must leave it out

    def update_actor(self, batch):
        time.sleep(self.UPDATE_SECONDS)
        info = batch.extra_info
        per_rank = []
        for rank, chunk in enumerate(batch.chunk(DP)):
            data = tq.kv_batch_get(keys=chunk.keys, partition_id=chunk.partition_id)
            it = tu.make_iterator(
                data,
                mini_batch_size=info["mini_batch_size"] // DP,
                epochs=info["epochs"],
                seed=info["seed"] + rank,
                dataloader_kwargs=info["dataloader_kwargs"],
            )
            per_rank.append(list(it))
        for parts in zip(*per_rank):  # mini-batch j = the j-th local mini-batch of every rank
            self.seen.append([p.to_padded_tensor() for p in parts])
        return {"metrics": {"mfu": 0.0, "pg_loss": 0.5, **self.update_metrics}}

    def set_loss_fn(self, fn):
        self.loss_fn = fn


def put_batch(seed=0, entropy_dtype=torch.float32, entropy_range=(0.0, 3.0)):
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(3, 9, (N_ROWS,), generator=gen).tolist()
    adv = torch.randn(N_ROWS, generator=gen)
    old = [-4.6 - 2.3 * torch.rand(n, generator=gen) for n in lens]
    noise = torch.Generator().manual_seed(1000 + seed)  # apart: the other fields draw as before
    fields = TensorDict(
        {
            "response_mask": nested([torch.ones(n, dtype=torch.int64) for n in lens]),
            # the V1 agent loop stores a copy as loss_mask: the engine's denominator counts it
            "loss_mask": nested([torch.ones(n, dtype=torch.int64) for n in lens]),
            # p ~ 1e-3 .. 1e-2: about half of the tokens are below tau_p = 0.002
            "old_log_probs": nested(old),
            # vLLM's log-probs of the same tokens (rollout.calculate_log_probs, verl's default): close, not equal
            "rollout_log_probs": nested([lp + 0.05 * torch.randn(len(lp), generator=noise) for lp in old]),
            "entropy": nested([uniform(n, *entropy_range, gen).to(entropy_dtype) for n in lens]),
            "advantages": nested([torch.full((n,), float(a)) for n, a in zip(lens, adv)]),
            "row": torch.arange(N_ROWS),
        },
        batch_size=[N_ROWS],
    )
    keys = [f"s{seed}_{i}" for i in range(N_ROWS)]
    return tq.kv_batch_put(keys=keys, partition_id="train", fields=fields, tags=[{"seq_len": n} for n in lens])


def uniform(n, low, high, gen):
    return low + (high - low) * torch.rand(n, generator=gen)


def nested(rows):
    return torch.nested.as_nested_tensor(rows, layout=torch.jagged)


def make_trainer(config, wg):
    trainer = STAPOTrainer.__new__(STAPOTrainer)  # no __init__: it would start Ray worker groups on GPUs
    trainer.config = config
    trainer.stapo = validate_training_config(config)
    trainer._submitted, trainer._submissions = {}, itertools.count()  # what STAPOMixin.__init__ sets
    trainer.actor_rollout_wg = wg
    trainer.global_steps = 1
    return trainer


def test_mask_reaches_the_update_per_minibatch_and_is_restored(transfer_queue, tmp_path, monkeypatch):
    monkeypatch.setenv("STAPO_AUDIT_DIR", str(tmp_path))
    config = compose()
    wg = StandInActorWorkerGroup()
    trainer = make_trainer(config, wg)
    batch = put_batch()
    before = tq.kv_batch_get(keys=batch.keys, partition_id="train").to_padded_tensor()
    metrics = {}
    start = time.perf_counter()
    trainer._update_actor(batch, metrics)
    wall = time.perf_counter() - start

    assert len(wg.seen) == N_ROWS // (MINI_PROMPTS * ROLLOUT_N)
    masked_total, pool_candidates, pool_masked = 0, [], []
    for parts in wg.seen:
        rows = torch.cat([p["row"] for p in parts])
        trained = torch.cat([pad_to(p["response_mask"]) for p in parts])
        # what the workers train on == S2T over exactly this mini-batch, from the rollout's own mask
        expected, stats = s2t_mask(
            *(pad_to(before[k])[rows] for k in ("old_log_probs", "entropy", "advantages", "response_mask"))
        )
        assert torch.equal(trained, expected)
        # the engine's denominator (loss_mask summed over the mini-batch on all ranks) is the kept count
        assert sum(int(p["loss_mask"].sum()) for p in parts) == int(expected.sum())
        masked_total += stats["masked"]
        pool_candidates.append(stats["candidates"])
        pool_masked.append(stats["masked"])
    assert masked_total > 0

    after = tq.kv_batch_get(keys=batch.keys, partition_id="train").to_padded_tensor()
    assert torch.equal(after["response_mask"], before["response_mask"])  # restored for metrics and logging
    assert torch.equal(after["loss_mask"], before["loss_mask"])
    assert metrics["stapo/masked_tokens"] == masked_total
    driver = metrics["timing_s/stapo_mask"] + metrics["timing_s/stapo_restore"]  # the mask's work, not the update's
    assert metrics["timing_s/stapo_mask"] > 0 and metrics["timing_s/stapo_restore"] > 0
    assert driver <= wall - StandInActorWorkerGroup.UPDATE_SECONDS
    (record,) = [json.loads(line) for line in next(tmp_path.glob("driver-*.jsonl")).read_text().splitlines()]
    tokens = int(before["response_mask"].sum())
    assert record["masked_tokens"] == masked_total and record["response_tokens"] == record["loss_tokens"] == tokens
    assert record["during_update"] == {"response_mask": tokens - masked_total, "loss_mask": tokens - masked_total}
    assert record["after_update"] == {"response_mask": tokens, "loss_mask": tokens}
    assert record["pool_masked"] == pool_masked and record["entropy_dtype"] == "torch.float32"
    assert record["pool_candidates"] == pool_candidates and sum(pool_candidates) == metrics["stapo/candidate_tokens"]
    assert metrics["stapo/masked_frac"] == pytest.approx(masked_total / int(before["response_mask"].sum()))
    assert {
        "stapo/candidate_frac",
        "stapo/entropy_threshold",
        "stapo/pos_adv_frac",
        "stapo/low_prob_frac",
        "stapo/low_entropy_frac",
        "actor/pg_loss",
    } <= set(metrics)


def pad_to(x, width=8):
    return torch.nn.functional.pad(x, (0, width - x.shape[1]))


def test_minibatch_rows_follows_verl_split():
    rows = minibatch_rows(16, dp_size=2, mini_batch_size=4, shuffle=False, seed=42)
    assert [r.tolist() for r in rows] == [[0, 1, 8, 9], [2, 3, 10, 11], [4, 5, 12, 13], [6, 7, 14, 15]]
    shuffled = minibatch_rows(16, dp_size=2, mini_batch_size=4, shuffle=True, seed=42)
    assert sorted(torch.cat(shuffled).tolist()) == list(range(16))
    assert all(sum(r < 8 for r in g.tolist()) == 2 for g in shuffled)  # two rows from each rank's chunk
    assert [r.tolist() for r in shuffled] != [r.tolist() for r in rows]
    with pytest.raises(ValueError, match="dp size"):
        minibatch_rows(15, dp_size=2, mini_batch_size=4, shuffle=False, seed=0)


def test_no_mask_for_baselines_and_current_policy_metrics_renamed(transfer_queue):
    config = compose("stapo.mask=none")
    wg = StandInActorWorkerGroup()
    batch = put_batch(seed=1)
    metrics = {}
    make_trainer(config, wg)._update_actor(batch, metrics)
    assert not any(k.startswith("stapo/") for k in metrics)
    original = pad_to(tq.kv_batch_get(keys=batch.keys, partition_id="train").to_padded_tensor()["response_mask"])
    assert all(torch.equal(pad_to(p["response_mask"]), original[p["row"]]) for parts in wg.seen for p in parts)

    config = compose("stapo.policy_source=current", "actor_rollout_ref.actor.calculate_entropy=True")
    wg = StandInActorWorkerGroup(update_metrics={"stapo/masked_frac": 0.25, "stapo/masked_tokens": 3.0})
    metrics = {}
    make_trainer(config, wg)._update_actor(put_batch(seed=2), metrics)
    assert metrics["stapo/masked_frac"] == 0.25 and "actor/stapo/masked_frac" not in metrics
    assert metrics["stapo/masked_tokens"] == 3.0 * 4  # per mini-batch (verl's mean) -> per step, 4 mini-batches


def test_setup_installs_the_stapo_loss_and_fails_fast(monkeypatch):
    monkeypatch.setattr(PPOTrainerSync, "_setup", lambda self: None)  # builds the GPU worker groups
    wg = StandInActorWorkerGroup()
    trainer = make_trainer(compose(), wg)
    trainer._setup()
    assert isinstance(wg.loss_fn, functools.partial) and wg.loss_fn.func is stapo_loss
    assert wg.loss_fn.keywords["stapo"].mask == "s2t"
    assert wg.loss_fn.keywords["config"].clip_ratio_high == pytest.approx(0.28)

    def broken(fn):
        raise ModuleNotFoundError("No module named 'stapo'")

    wg.set_loss_fn = broken
    with pytest.raises(RuntimeError, match="pip install"):
        trainer._setup()


def reference_s2t_metrics(before, groups):
    """s2t/* of a step from the reference functions: S2T per mini-batch and the gradient-norm bound per token."""
    from stapo.s2t import grad_norm_lower_bound

    keys = ("old_log_probs", "entropy", "advantages", "response_mask", "rollout_log_probs")
    padded = {k: pad_to(before[k]) for k in keys}
    valid = padded["response_mask"] != 0
    spurious = torch.zeros_like(valid)
    expected = 0
    for rows in groups:
        keep, stats = s2t_mask(*(padded[k][rows] for k in ("old_log_probs", "entropy", "advantages", "response_mask")))
        spurious[rows] = valid[rows] & (keep == 0)
        expected += math.ceil(0.75 * (stats["candidates"] - 1)) if stats["candidates"] else 0
    candidates = valid & (padded["advantages"] > 0) & (padded["old_log_probs"] < torch.log(torch.tensor(0.002)))
    bound = grad_norm_lower_bound(padded["old_log_probs"], padded["entropy"], padded["advantages"]).double()
    tokens, positive = int(valid.sum()), int((valid & (padded["advantages"] > 0)).sum())
    gap = (padded["old_log_probs"].double() - padded["rollout_log_probs"].double()).abs()
    p_gap = (padded["old_log_probs"].double().exp() - padded["rollout_log_probs"].double().exp()).abs()
    weight = (padded["old_log_probs"].double() - padded["rollout_log_probs"].double()).exp().clamp(max=2.0)  # TIS
    kept = candidates & ~spurious
    return {
        "s2t/pos_adv_tokens": positive,
        "s2t/candidate_tokens": int(candidates.sum()),
        "s2t/spurious_tokens": int(spurious.sum()),
        "s2t/spurious_per_pos_adv": int(spurious.sum()) / positive,
        "s2t/mismatch/candidate_logp": float(gap[candidates].mean()),
        "s2t/mismatch/other_logp": float(gap[valid & ~candidates].mean()),
        "s2t/mismatch/candidate_p": float(p_gap[candidates].mean()),
        "s2t/mismatch/spurious_logp": float(gap[spurious].mean()),
        "s2t/mismatch/kept_candidate_logp": float(gap[kept].mean()),
        "s2t/mismatch/spurious_is_weight": float(weight[spurious].mean()),
        "s2t/mismatch/kept_candidate_is_weight": float(weight[kept].mean()),
        "s2t/candidate_frac": int(candidates.sum()) / tokens,
        "s2t/spurious_frac": int(spurious.sum()) / tokens,
        "s2t/silenced_share": int(spurious.sum()) / int(candidates.sum()),
        "s2t/expected_share": expected / int(candidates.sum()),
        "s2t/grad_bound/spurious_mean": float(bound[spurious].mean()),
        "s2t/grad_bound/candidate_mean": float(bound[candidates].mean()),
        "s2t/grad_bound/other_mean": float(bound[valid & ~candidates].mean()),
        "s2t/grad_bound/spurious_share": float(bound[spurious].sum() / bound[valid].sum()),
    }


@pytest.mark.parametrize("method", ["justrl", "stapo", "entropy20"])
def test_s2t_metrics_are_logged_for_every_method(transfer_queue, method):
    """The paper's gradient analysis, every step: the same s2t/* values whether S2T is applied (STAPO) or only
    observed (JustRL, 20-Entropy), computed from the reference functions here: among them the count of
    positive-advantage tokens (so that the spurious share among them compares across arms) and vLLM's mismatch with
    the trainer on the candidates (issue 39)."""
    config = compose(*([] if method == "stapo" else [f"stapo.mask={'none' if method == 'justrl' else 'top_entropy'}"]))
    wg = StandInActorWorkerGroup()
    batch = put_batch(seed=3)
    before = tq.kv_batch_get(keys=batch.keys, partition_id="train").to_padded_tensor()
    metrics = {}
    trainer = make_trainer(config, wg)
    trainer._update_actor(batch, metrics)
    expected = reference_s2t_metrics(before, trainer._mask_groups(N_ROWS))
    assert {k: v for k, v in metrics.items() if k.startswith("s2t/")} == pytest.approx(expected, rel=1e-5)
    assert expected["s2t/spurious_frac"] > 0 and expected["s2t/grad_bound/spurious_mean"] > 0
    assert metrics["s2t/silenced_share"] == metrics["s2t/expected_share"]  # float32 entropies from a uniform draw
    assert metrics["timing_s/stapo_mask"] > 0
    if method == "justrl":  # observed only: the workers trained on the rollout's own mask
        original = pad_to(before["response_mask"])
        assert all(torch.equal(pad_to(p["response_mask"]), original[p["row"]]) for parts in wg.seen for p in parts)
        assert not any(k.startswith("stapo/") for k in metrics)
    else:
        assert metrics["stapo/masked_tokens"] > 0


def test_a_second_tau_p_is_counted_beside_the_first(transfer_queue):
    """stapo.observe_tau_p: the S2T rule's candidates and silenced tokens at a second threshold (the paper's 0.002
    beside a small model's 0.02, docs/experiments.md section 11), from the reference mask per mini-batch; the s2t/*
    metrics at stapo.tau_p are unchanged."""
    batch = put_batch(seed=5)
    before = tq.kv_batch_get(keys=batch.keys, partition_id="train").to_padded_tensor()
    padded = {k: pad_to(before[k]) for k in ("old_log_probs", "entropy", "advantages", "response_mask")}
    metrics, plain = {}, {}
    trainer = make_trainer(compose("stapo.tau_p=0.02", "stapo.observe_tau_p=0.002"), StandInActorWorkerGroup())
    trainer._update_actor(batch, metrics)
    expected = {"candidates": 0, "silenced": 0}
    for rows in trainer._mask_groups(N_ROWS):
        keep, stats = s2t_mask(*(padded[k][rows] for k in padded), tau_p=0.002)
        expected["candidates"] += stats["candidates"]
        expected["silenced"] += int(((keep == 0) & (padded["response_mask"][rows] != 0)).sum())
    assert metrics["s2t/observed/candidate_tokens"] == expected["candidates"] > 0
    assert metrics["s2t/observed/spurious_tokens"] == expected["silenced"] > 0
    assert metrics["s2t/observed/candidate_tokens"] < metrics["s2t/candidate_tokens"]  # fewer below 0.002 than 0.02
    make_trainer(compose("stapo.tau_p=0.02"), StandInActorWorkerGroup())._update_actor(put_batch(seed=5), plain)
    assert not any(k.startswith("s2t/observed/") for k in plain)
    first = {k: v for k, v in metrics.items() if k.startswith(("s2t/", "stapo/")) and "observed" not in k}
    assert first == pytest.approx({k: v for k, v in plain.items() if k.startswith(("s2t/", "stapo/"))}, rel=1e-6)


def test_the_random_ablation_silences_as_many_as_s2t_in_each_minibatch(transfer_queue):
    """stapo_random: each mini-batch loses as many candidates as S2T would silence there, drawn at random, so the
    control differs from STAPO in which tokens, not how many; s2t/* still report the S2T rule."""
    wg = StandInActorWorkerGroup()
    batch = put_batch(seed=8)
    before = tq.kv_batch_get(keys=batch.keys, partition_id="train").to_padded_tensor()
    metrics = {}
    make_trainer(compose("stapo.silence=random"), wg)._update_actor(batch, metrics)
    differs = False
    for parts in wg.seen:
        rows = torch.cat([p["row"] for p in parts])
        trained = torch.cat([pad_to(p["response_mask"]) for p in parts])
        keep, stats = s2t_mask(
            *(pad_to(before[k])[rows] for k in ("old_log_probs", "entropy", "advantages", "response_mask"))
        )
        original = pad_to(before["response_mask"])[rows]
        assert int((original - trained).sum()) == stats["masked"]
        candidates = (original != 0) & (pad_to(before["advantages"])[rows] > 0)
        candidates &= pad_to(before["old_log_probs"])[rows] < math.log(0.002)
        assert not ((trained == 0) & (original != 0) & ~candidates).any()  # only candidates are silenced
        differs |= not torch.equal(trained, keep)
    assert differs and metrics["stapo/masked_frac"] == pytest.approx(metrics["s2t/spurious_frac"])


def test_entropies_in_another_dtype_than_float32_are_reported_once(transfer_queue, capsys):
    """bfloat16 entropies (verl 0.9.1's fused kernel without the recipe's patch) tie at τ_h: one line on stderr
    for the whole run, and the step's s2t/silenced_share falls below s2t/expected_share (entropies in [2.0, 2.03)
    take two bfloat16 values)."""
    from stapo.train import metrics as metrics_module

    metrics_module._WARNED.clear()
    trainer = make_trainer(compose(), StandInActorWorkerGroup())
    for seed in (5, 6):
        metrics = {}
        trainer._update_actor(put_batch(seed, torch.bfloat16, (2.0, 2.03)), metrics)
    lines = [line for line in capsys.readouterr().err.splitlines() if "STAPO WARNING" in line]
    assert len(lines) == 1 and "torch.bfloat16" in lines[0] and "float32" in lines[0]
    assert metrics["s2t/silenced_share"] < metrics["s2t/expected_share"]


@pytest.mark.parametrize("norm", ["selected", "all"])
def test_top_entropy_denominator_follows_the_knob(transfer_queue, norm):
    """20-Entropy: ``selected`` folds the mask into loss_mask (the engine's denominator counts the kept tokens),
    ``all`` leaves loss_mask whole (every response token counts), response_mask silences in both."""
    config = compose("stapo.mask=top_entropy", f"stapo.top_entropy_norm={norm}")
    wg = StandInActorWorkerGroup()
    batch = put_batch(seed=4)
    before = tq.kv_batch_get(keys=batch.keys, partition_id="train").to_padded_tensor()
    metrics = {}
    make_trainer(config, wg)._update_actor(batch, metrics)
    for parts in wg.seen:
        rows = torch.cat([p["row"] for p in parts])
        kept = sum(int(p["response_mask"].sum()) for p in parts)
        denominator = sum(int(p["loss_mask"].sum()) for p in parts)
        assert kept < int(pad_to(before["response_mask"])[rows].sum())
        assert denominator == (kept if norm == "selected" else int(pad_to(before["loss_mask"])[rows].sum()))
    after = tq.kv_batch_get(keys=batch.keys, partition_id="train").to_padded_tensor()
    assert torch.equal(after["response_mask"], before["response_mask"]) and metrics["stapo/kept_frac"] < 1


def test_the_trainer_is_verls_sync_trainer():
    """verl 0.9.1 runs any trainer mode not named "sync" on its asynchronous paths (replay buffer, one-prompt
    dataloader fetches); the recipe's mode must not."""
    from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer, ReplayBufferAsync

    trainer = STAPOTrainer(compose())  # builds no workers: those come with _setup
    assert trainer.trainer_mode == "sync" and type(trainer.replay_buffer) is ReplayBuffer
    assert not isinstance(trainer.replay_buffer, ReplayBufferAsync) and trainer.parameter_sync_step == 1
    assert trainer.replay_buffer.poll_interval == POLL_INTERVAL_S < 2.0  # verl's 2 s rounded generation up


def test_resume_position_check_on_a_real_dataloader():
    from torchdata.stateful_dataloader import StatefulDataLoader

    from stapo.train.trainer import resume_position_problem

    loader = StatefulDataLoader(
        list(range(20)), batch_size=4, drop_last=True, shuffle=True, generator=torch.Generator().manual_seed(0)
    )
    steps_per_epoch = len(loader)
    it = iter(loader)
    for step in range(1, 13):  # two epochs and a bit, as verl's persistent iterator does
        try:
            next(it)
        except StopIteration:
            it = iter(loader)
            next(it)
        state = loader.state_dict()
        assert resume_position_problem(state, step, steps_per_epoch, 4) is None, step
    assert "it should be 12" in resume_position_problem(state, 13, steps_per_epoch, 4)  # one step off
    assert "without the checkpoint's data.pt" in resume_position_problem(None, 12, steps_per_epoch, 4)


@pytest.mark.parametrize("resumed", [True, False])
def test_the_file_loggers_earlier_steps_are_kept(tmp_path, monkeypatch, resumed):
    """verl's FileLogger truncates its file when a run starts. A resumed run sets the old file aside as an earlier
    segment, which read_metrics reads with the new one (a later value of a step wins); a fresh run sets it aside
    under a name read_metrics leaves alone."""
    from types import SimpleNamespace

    from verl.utils.tracking import FileLogger

    from stapo.tools.curves import read_metrics

    path = tmp_path / "metrics.jsonl"
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(path))
    first = FileLogger("p", "e")
    for step in (1, 2, 3):
        first.log({"stapo/masked_frac": step / 10}, step)  # killed during step 3, after its metrics
    first.finish()
    trainer = STAPOTrainer(compose('trainer.logger=["console","file"]'))

    def load(self):  # stands in for loading the checkpoint into the (GPU) actor workers
        self.global_steps = 2 if resumed else 0

    monkeypatch.setattr(PPOTrainerSync, "_load_checkpoint", load)
    trainer.train_dataloader = SimpleNamespace(batch_size=1)  # one-prompt fetches: no position check
    trainer._load_checkpoint()
    second = FileLogger("p", "e")  # what fit() opens next
    for step in (3, 4) if resumed else (1,):
        second.log({"stapo/masked_frac": step / 100}, step)
    second.finish()
    if resumed:
        assert read_metrics(path)["stapo/masked_frac"] == {1: 0.1, 2: 0.2, 3: 0.03, 4: 0.04}
    else:
        assert read_metrics(path)["stapo/masked_frac"] == {1: 0.01}
        assert read_metrics(tmp_path / "metrics.previous-1.jsonl")["stapo/masked_frac"] == {1: 0.1, 2: 0.2, 3: 0.3}


ASYNC = {"stapo_colocate_async": "colocate_async", "stapo_separate_async": "separate_async"}


@pytest.mark.parametrize("mode", ASYNC)
def test_the_asynchronous_modes_are_verls_trainers_with_the_same_mask(transfer_queue, mode):
    """``stapo_colocate_async`` and ``stapo_separate_async``: verl's own trainer of each mode (its class, its replay
    buffer, its settings section), registered where verl looks trainers up, and the same mask in the update: on the
    same batch the workers train on exactly what ``stapo_sync``'s would."""
    from verl.trainer.ppo.v1.replay_buffer import ReplayBufferAsync
    from verl.trainer.ppo.v1.trainer_base import get_trainer_cls

    from stapo.train.trainer import STAPOColocateAsyncTrainer, STAPOSeparateAsyncTrainer

    cls = get_trainer_cls(mode)
    verl_cls = get_trainer_cls(ASYNC[mode])
    assert cls in (STAPOColocateAsyncTrainer, STAPOSeparateAsyncTrainer) and issubclass(cls, verl_cls)
    section = f"trainer.v1.{ASYNC[mode]}"
    config = compose(f"trainer.v1.trainer_mode={mode}", f"{section}.num_warmup_batches=3")
    if mode == "stapo_separate_async":  # verl's conditions (stapo.train.preflight.separate_async_problems)
        config = compose(f"trainer.v1.trainer_mode={mode}", f"{section}.num_warmup_batches=3",
                         f"data.train_batch_size={4 * MINI_PROMPTS}", "actor_rollout_ref.rollout.nnodes=1",
                         "actor_rollout_ref.rollout.n_gpus_per_node=1",
                         "actor_rollout_ref.rollout.checkpoint_engine.backend=nccl")  # fmt: skip
    validate_training_config(config)
    trainer = cls(config)  # builds no workers: those come with _setup
    assert trainer.trainer_mode == ASYNC[mode] and isinstance(trainer.replay_buffer, ReplayBufferAsync)
    assert trainer.replay_buffer.trainer_config.num_warmup_batches == 3  # verl's own section of the mode was read
    assert trainer.parameter_sync_step == (4 if mode == "stapo_separate_async" else 1)

    seen = {}
    for name, trainer_cls in (("sync", STAPOTrainer), ("async", cls)):
        wg = StandInActorWorkerGroup()
        trainer = trainer_cls.__new__(trainer_cls)  # as make_trainer: no workers
        trainer.config, trainer.stapo, trainer.actor_rollout_wg, trainer.global_steps = config, trainer_stapo(), wg, 1
        metrics = {}
        trainer._update_actor(put_batch(seed=7), metrics)
        seen[name] = (
            [[pad_to(p["response_mask"]) for p in parts] for parts in wg.seen],
            metrics["stapo/masked_tokens"],
        )
    assert seen["sync"][1] == seen["async"][1] > 0
    assert all(torch.equal(a, b) for pa, pb in zip(seen["sync"][0], seen["async"][0]) for a, b in zip(pa, pb))


CURRENT = ["stapo.policy_source=current", "actor_rollout_ref.actor.calculate_entropy=True"]


def trainer_stapo():
    return validate_training_config(compose())


def test_the_mismatch_diagnostic_never_stops_a_run(capsys):
    """s2t/mismatch/* is a diagnostic: rollout log-probs in a layout it does not know give NaN and one warning, not a
    failed step."""
    from stapo.train.metrics import mismatch_metrics

    rows = nested([torch.tensor([-7.0, -1.0]), torch.tensor([-8.0])])
    adv, mask = (
        nested([torch.ones(2), -torch.ones(1)]),
        nested([torch.ones(2, dtype=torch.long)] * 1 + [torch.ones(1, dtype=torch.long)]),
    )
    flagged = torch.tensor([True, False, False])  # the first token (a candidate) spurious
    same = mismatch_metrics(rows, nested([torch.tensor([-7.5, -1.0]), torch.tensor([-8.2])]), adv, mask, 0.002, flagged)
    assert same["s2t/mismatch/candidate_logp"] == pytest.approx(0.5) and same[
        "s2t/mismatch/other_logp"
    ] == pytest.approx(0.1)
    assert same["s2t/mismatch/spurious_logp"] == pytest.approx(0.5) and math.isnan(
        same["s2t/mismatch/kept_candidate_logp"]
    )
    assert same["s2t/mismatch/spurious_is_weight"] == pytest.approx(math.exp(0.5))  # π_old / π_vLLM, under the cap
    none = mismatch_metrics(rows, rows, -adv, mask, 0.002, flagged)  # no candidate: NaN, no error from verl's weights
    assert math.isnan(none["s2t/mismatch/spurious_is_weight"]) and none["s2t/mismatch/other_logp"] == 0
    other = mismatch_metrics(rows, torch.zeros(4, 5), adv, mask, 0.002, flagged)
    assert all(math.isnan(v) for v in other.values()) and "differ in layout" in capsys.readouterr().err


@pytest.mark.parametrize("mask", ["s2t", "baseline", "current"])
def test_a_step_of_several_local_updates_logs_the_whole_steps_counts(transfer_queue, monkeypatch, mask):
    """``separate_async`` with ``parameter_sync_step`` = 2: verl's own ``step`` runs two local updates, one half of the
    batch each, and its ``MetricsAggregator`` averages their metrics. The mask's counts must add up over the step and
    its shares be taken of the sums (what one update of the whole batch gives), for STAPO (``stapo/*`` and ``s2t/*``)
    and for a baseline (``s2t/*`` observed only); with ``policy_source: current`` the workers' counts add up too.
    Stand-ins: the body of verl's local update (``_step_once``: replay buffer, reward, old log-probs on GPUs) is the
    actor update of a prepared half, and the GPU worker group is :class:`StandInActorWorkerGroup`."""
    from stapo.train.trainer import STAPOSeparateAsyncTrainer

    overrides = {"s2t": [], "baseline": ["stapo.mask=none"]}.get(mask, CURRENT)
    config = compose(*overrides)
    workers = {"update_metrics": {"stapo/masked_tokens": 3.0}} if mask == "current" else {}
    halves = put_batch(seed=11).chunk(2)
    alone = []
    for half in halves:  # each half updated on its own, as a step of its own would log it
        trainer = make_trainer(config, StandInActorWorkerGroup(**workers))
        alone.append({})
        trainer._update_actor(half, alone[-1])

    def local_update(self, metrics, timing_raw, sample_batch_size):
        return self._update_actor(halves[self.local_trigger_step], metrics)

    monkeypatch.setattr(STAPOSeparateAsyncTrainer, "_step_once", local_update)
    monkeypatch.setattr(STAPOSeparateAsyncTrainer, "prepare_step", lambda self: {})  # waits for rollouts
    trainer = STAPOSeparateAsyncTrainer.__new__(STAPOSeparateAsyncTrainer)  # as make_trainer: no workers
    trainer.config, trainer.stapo, trainer.global_steps = config, validate_training_config(config), 1
    trainer.actor_rollout_wg, trainer.parameter_sync_step = StandInActorWorkerGroup(**workers), 2
    metrics = {}
    trainer.step(metrics, {})

    counts = ["s2t/candidate_tokens", "s2t/spurious_tokens", "s2t/pos_adv_tokens"]
    if mask == "s2t":
        counts += ["stapo/masked_tokens", "stapo/candidate_tokens", "stapo/expected_masked_tokens"]
    elif mask == "current":
        counts.append("stapo/masked_tokens")  # the workers' 3 per mini-batch, two mini-batches per half
        assert metrics["stapo/masked_tokens"] == 12
    else:
        assert not any(k.startswith("stapo/") for k in metrics)
    for key in counts:
        assert metrics[key] == alone[0][key] + alone[1][key], key
    assert alone[0]["s2t/spurious_tokens"] != alone[1]["s2t/spurious_tokens"]  # verl's mean would differ from the sum
    tokens = int(tq.kv_batch_get(keys=[k for h in halves for k in h.keys], partition_id="train")["response_mask"]
                 .values().sum())  # fmt: skip
    assert metrics["s2t/spurious_frac"] == pytest.approx(metrics["s2t/spurious_tokens"] / tokens)
    assert metrics["s2t/silenced_share"] == pytest.approx(
        metrics["s2t/spurious_tokens"] / metrics["s2t/candidate_tokens"]
    )
    assert metrics["s2t/grad_bound/spurious_share"] == pytest.approx(
        sum(a["s2t/grad_bound/spurious_mean"] * a["s2t/spurious_tokens"] for a in alone)
        / sum(a["s2t/grad_bound/spurious_mean"] * a["s2t/spurious_tokens"] / a["s2t/grad_bound/spurious_share"]
              for a in alone)
    )  # fmt: skip
    if mask == "s2t":
        assert metrics["stapo/masked_frac"] == pytest.approx(metrics["stapo/masked_tokens"] / tokens)
        thresholds = [a["stapo/entropy_threshold"] for a in alone]
        assert metrics["stapo/entropy_threshold"] == pytest.approx(sum(thresholds) / 2)
    assert metrics["timing_s/stapo_mask"] == pytest.approx(sum(a["timing_s/stapo_mask"] for a in alone), rel=1)


class StandInAgentLoopManager:
    """Replaces verl's agent-loop manager, whose vLLM servers need GPUs: the trainer's submission ends there."""

    def generate_sequences(self, batch):
        pass


def test_with_determinism_a_batch_is_trained_in_the_order_its_prompts_were_submitted(transfer_queue):
    """verl's V1 replay buffer lists a step's trajectories in the order they finished; with ``determinism=full``
    the trainer puts them in the order their prompts were submitted before verl balances them over the ranks, so
    that two runs of one command train on the same mini-batches. Two finishing orders of one step's responses, through
    the trainer's submission and verl's own ``_balance_batch``: one order after it, and verl's alone gives two."""
    prompts, n = 4, ROLLOUT_N
    uids = [f"prompt-{i}" for i in (3, 0, 2, 1)]  # submission order: not the keys' sorted order
    keys = [f"{uid}_{s}_0" for uid in uids for s in range(n)]
    lengths = dict(zip(keys, [5, 9, 9, 5, 7, 7, 6, 8]))  # ties: verl's balancing then keeps the order it is given
    finished = [keys, list(reversed(keys))]

    def trained_order(determinism: bool, order: list[str]) -> list[str]:
        config = compose(*[f"{key}={str(determinism).lower()}" for key in DETERMINISM])
        trainer = make_trainer(config, StandInActorWorkerGroup())
        trainer.trainer_mode, trainer.agent_loop_manager = "sync", StandInAgentLoopManager()
        trainer.tokenizer, trainer.use_critic = type("Tokenizer", (), {"eos_token_id": 0})(), False
        batch = TensorDict({"raw_prompt": torch.zeros(prompts + 1)}, batch_size=[prompts + 1])
        batch["uid"] = ["prompt-9", *uids]  # the first: a prompt verl's buffer drops (e.g. DAPO's filter)
        trainer._submit_batch_to_rollout(batch)
        meta = KVBatchMeta(partition_id="train", keys=order, tags=[{"seq_len": lengths[k]} for k in order])
        trained = trainer._balance_batch(meta, metrics={}).keys
        assert trainer._submitted == {}  # nothing kept of the trained and the dropped prompts
        return trained

    assert trained_order(True, finished[0]) == trained_order(True, finished[1])
    assert trained_order(False, finished[0]) != trained_order(False, finished[1])  # verl's: the finishing order
    assert submission_order(finished[1], {uid: i for i, uid in enumerate(uids)}) == [7, 6, 5, 4, 3, 2, 1, 0]
    # prompts submitted before a resume (no number here): first, by uid, whatever order they finished in
    assert [finished[1][i] for i in submission_order(finished[1], {})] == sorted(keys)


def test_the_other_tokens_bound_never_rounds_below_zero():
    """Late in a run almost every token has Â = 0: the other tokens' bound is 0, and the float32 total minus the float64
    candidates' sum rounded below it (round 1 of the decisive test logged a candidate/other ratio of -4602)."""
    from stapo.train.metrics import s2t_metrics

    stats = {"tokens": 1000, "candidates": 10, "masked": 7, "pos_adv": 40, "expected_masked": 7}
    stats |= {"bound_total": 48.2999992, "bound_candidates": 48.3, "bound_silenced": 30.0}
    metrics = s2t_metrics(stats)
    assert metrics["s2t/grad_bound/other_mean"] == 0.0
    assert metrics["s2t/grad_bound/candidate_mean"] == pytest.approx(4.83)
    stats["bound_total"] = 58.3
    assert s2t_metrics(stats)["s2t/grad_bound/other_mean"] == pytest.approx(10.0 / 990)
