"""verl V1 trainer modes ``stapo_sync``, ``stapo_colocate_async`` and ``stapo_separate_async``: verl's trainers of
those modes plus the STAPO (or 20-Entropy) mask (:class:`STAPOMixin`; ``stapo.config.TRAINER_MODES``).

Every recipe config selects ``stapo_sync`` (``trainer.v1.trainer_mode``), the paper's setting. verl 0.9.1 chooses its
code paths (replay buffer, dataloader fetches, TransferQueue in checkpoints) and reads its settings
(``trainer.v1.<mode>``) by the trainer mode's name, so each trainer declares verl's own name to verl's base class
(the synchronous one also has its replay buffer look for finished rollouts every :data:`POLL_INTERVAL_S`). In the
asynchronous modes the mask is built the same way, from the π_old that verl recomputed for the batch (its decoupled
mode: the weights the batch is trained from; verl's bypass mode has no old-policy entropies and is refused with
``policy_source: old``); the rollouts themselves may come from older weights, which verl's
``training/off_policy/*`` metrics count per step. Three additions to verl's trainers, and a resume check:

1. after the workers are built, the actor workers' loss becomes :func:`stapo.train.loss.stapo_loss` (verl's
   ``ppo_loss`` plus the mask of ``policy_source: current`` and an empty-mini-batch guard);
2. right before the actor update, the driver reads the old-policy log-probs and entropies verl already stored in
   TransferQueue and, with ``policy_source: old``, builds the mask with one quantile per PPO mini-batch exactly as
   the workers will split the batch (:func:`stapo.batch_mask.mask_for_update`; ``stapo.silence`` switches to the
   paper's masking-strategy ablations). The mask is folded into
   ``response_mask`` (what ``ppo_loss`` averages over) and ``loss_mask`` (what verl's engine counts for the
   ``token-mean`` denominator) for the update only; the originals are put back afterwards, so advantages, data
   metrics and logs see the rollout unchanged. verl divides by the global count of ``loss_mask`` per mini-batch, so
   the loss is renormalised over the kept tokens exactly (STAPO objective, 1 / Σ I). With ``stapo.metrics`` the
   S2T rule is also evaluated for runs that apply no S2T mask, and the paper's gradient-norm bound is summed in a
   thread while the workers run the update (``s2t/*``).
3. a run that outlives its job (:mod:`stapo.train.deadline`): at the end of a step, when the next step and a save no
   longer fit before ``stapo.deadline`` (or the Slurm job's end), or when the driver got SIGUSR1 or SIGTERM, the step
   is saved where verl saves (unless verl just did), its metrics are logged as always, and ``fit`` returns before the
   next step begins; the driver then exits with status 3.

The driver's own cost is timed every step: ``timing_s/stapo_mask`` and ``timing_s/stapo_restore``. After a resume,
the restored dataloader must stand where the checkpoint's step left it (:func:`resume_position_problem`), and the
file logger's earlier steps are kept: verl's ``FileLogger`` truncates its file when a run starts, so an existing one
is set aside first, as ``<stem>.<k>.jsonl`` when the run resumes (``stapo.tools.curves.read_metrics`` reads the parts
as one run) and as ``<stem>.previous-<k>.jsonl`` when it starts afresh. With ``determinism=full`` each batch is
trained in the order its prompts were submitted (:func:`submission_order`), not in the order its rollouts finished.
"""

from __future__ import annotations

import functools
import itertools
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import transfer_queue as tq
from tensordict import TensorDict
from transfer_queue import KVBatchMeta
from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer
from verl.trainer.ppo.v1.trainer_base import register_trainer
from verl.trainer.ppo.v1.trainer_colocate_async import PPOTrainerColocateAsync
from verl.trainer.ppo.v1.trainer_separate_async import PPOTrainerSeparateAsync
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync
from verl.utils import tensordict_utils as tu
from verl.utils.config import omega_conf_to_dataclass
from verl.utils.debug import marked_timer

from stapo.batch_mask import grad_bound_sums, mask_for_update
from stapo.config import TRAINER_MODES
from stapo.tools.io import set_aside
from stapo.train import audit, deadline
from stapo.train.loss import stapo_loss
from stapo.train.metrics import (
    check_entropy_dtype,
    mask_metrics,
    mismatch_metrics,
    observed_metrics,
    s2t_metrics,
    step_metrics,
)
from stapo.train.preflight import validate_training_config

MASK_INPUTS = ["old_log_probs", "entropy", "advantages", "response_mask", "loss_mask"]
MASK_FIELDS = ("response_mask", "loss_mask")
"""verl's ``ppo_loss`` masks with ``response_mask``; the engine counts the denominator from ``loss_mask`` (a copy
the V1 agent loop stores): the mask is folded into both, or into ``response_mask`` only when the denominator is all
response tokens (``stapo.top_entropy_norm: all``)."""


POLL_INTERVAL_S = 0.2
"""How often verl's replay buffer looks in TransferQueue for the step's finished rollouts (verl 0.9.1: every 2 s, not
configurable). At 2 s a step's generation is rounded up to a multiple of 2 s: short runs measured 2.1 or 4.1 s for
the same work (docs/history.md, section 6); each look is one metadata listing, cheap at paper scale too."""

FIRST_STEP_LINE = "STAPO: step {step} begins"
"""Printed when the run's first step (after a resume: the first of this launch) begins: start-up ends here
(``python -m stapo.checks.startup`` times the launch up to this line)."""

RANDOM_SEED_STRIDE = 1000
"""``stapo.silence=random`` draws mini-batch g of step s with seed 1000·s + g: reproducible, distinct per step."""

_BACKGROUND = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stapo-s2t-metrics")
"""Computes the s2t/* gradient-bound sums and the s2t/mismatch/* means while the workers run the actor update (NumPy
and torch release the GIL)."""


def minibatch_rows(batch_size: int, dp_size: int, mini_batch_size: int, shuffle: bool, seed: int) -> list[torch.Tensor]:
    """Row indices of each PPO mini-batch of one epoch, as verl 0.9.1 forms them.

    The driver hands rank r the contiguous chunk r of the batch (``KVBatchMeta.chunk``); each rank then iterates
    its chunk with ``verl.utils.tensordict_utils.make_iterator`` (``mini_batch_size / dp_size`` rows, seed
    ``seed + r``), and mini-batch j of the update is the union over ranks of their j-th local slice. The same
    iterator is run here on row numbers, so shuffling follows verl's own code.
    """
    if batch_size % dp_size or mini_batch_size % dp_size:
        raise ValueError(f"batch ({batch_size}) and mini-batch ({mini_batch_size}) must divide by dp size {dp_size}")
    local = batch_size // dp_size
    per_rank = []
    for rank in range(dp_size):
        rows = TensorDict({"row": torch.arange(rank * local, (rank + 1) * local)}, batch_size=[local])
        it = tu.make_iterator(
            rows,
            mini_batch_size=mini_batch_size // dp_size,
            epochs=1,
            seed=seed + rank,
            dataloader_kwargs={"shuffle": shuffle},
        )
        per_rank.append([mb["row"] for mb in it])
    return [torch.cat(parts) for parts in zip(*per_rank, strict=True)]


def submission_order(keys: list[str], submitted: dict[str, int]) -> list[int]:
    """The positions that put a batch's trajectories (verl V1's keys ``{uid}_{session_id}_{index}``) in the order
    their prompts were submitted to the rollout (``submitted``: uid -> submission number), then by response and
    output: one order for a step however its responses finished. verl 0.9.1's V1 replay buffer lists them in the
    order they finished, which differs from run to run (verl's docs/advance/determinism.md: "V1 ... collects outputs
    in completion order", and asks for the V0 trainer, which the recipe's trainer modes are not). Prompts submitted
    before a resume (in flight in an asynchronous mode's checkpoint) come first, by uid."""

    def rank(i: int) -> tuple[int, str, int, int]:
        uid, session, output = keys[i].split("_")
        known = uid in submitted
        return submitted[uid] if known else -1, "" if known else uid, int(session), int(output)

    return sorted(range(len(keys)), key=rank)


def fold(mask: torch.Tensor, silenced: torch.Tensor) -> torch.Tensor:
    """A copy of the jagged ``mask`` with the ``silenced`` tokens (a bool tensor over its values) set to 0."""
    return torch.nested.nested_tensor_from_jagged(mask.values().masked_fill(silenced, 0), mask.offsets())


def file_logger_path(config) -> Path:
    """Where verl's ``FileLogger`` writes (``verl.utils.tracking.FileLogger``): ``$VERL_FILE_LOGGER_PATH``, else
    ``$VERL_FILE_LOGGER_ROOT/<project>/<experiment>.jsonl`` (root: the working directory)."""
    if os.environ.get("VERL_FILE_LOGGER_PATH"):
        return Path(os.environ["VERL_FILE_LOGGER_PATH"])
    root = Path(os.path.expanduser(os.environ.get("VERL_FILE_LOGGER_ROOT", ".")))
    return root / config.trainer.project_name / f"{config.trainer.experiment_name}.jsonl"


class _SavedToResume(Exception):
    """Raised before a step begins after :meth:`STAPOMixin.on_step_end` saved for a deadline or a signal; ends
    ``fit``."""


def resume_position_problem(state: dict | None, global_steps: int, steps_per_epoch: int, batch_size: int) -> str | None:
    """Why a resumed run at ``global_steps`` would not continue the prompt stream where the checkpoint left it, from
    the dataloader state verl restored (``StatefulDataLoader.state_dict()`` of ``data.pt``); None if it does."""
    if state is None:
        return (
            f"resumed at step {global_steps} without the checkpoint's data.pt: verl would restart the prompt stream "
            "from the first batch of epoch 0; restore data.pt or set trainer.resume_mode=disable"
        )
    main = state.get("_snapshot", {}).get("_main_snapshot", state)  # with and without dataloader workers
    yielded = (main.get("_sampler_iter_state") or {}).get("samples_yielded")
    expected = ((global_steps - 1) % steps_per_epoch + 1) * batch_size
    if yielded is not None and yielded != expected:
        return (
            f"the data.pt of step {global_steps} has yielded {yielded} prompts of the current epoch; with "
            f"{steps_per_epoch} steps of {batch_size} prompts per epoch it should be {expected}: the training set or "
            "data.train_batch_size changed since that checkpoint; restore them or start a new run"
        )
    return None


class STAPOMixin:
    """The STAPO mask and metrics on one of verl's V1 trainers (module docstring); ``VERL_MODE`` is that trainer's
    mode name."""

    VERL_MODE: str

    def __init__(self, config):
        self.stapo = validate_training_config(config)
        self._submitted: dict[str, int] = {}  # uid -> submission number, with full_determinism (_balance_batch)
        self._submissions = itertools.count()
        self._clock = deadline.StepClock.of(self.stapo.deadline, self.stapo.deadline_margin, time.time())
        self._stop_reason: str | None = None
        super().__init__(config)

    # A deadline or a signal (stapo.train.deadline): at the end of a step, save where verl saves; before the next
    # step begins (the step's metrics are logged by then), stop; fit returns and the driver exits with status 3.
    def fit(self, agent_loop_manager):
        try:
            super().fit(agent_loop_manager)
        except _SavedToResume:
            self._shutdown_dump_executor()

    def on_step_begin(self):
        if self._stop_reason is not None:
            deadline.answer(Path(self.config.trainer.default_local_dir), self.global_steps - 1, self._stop_reason)
            raise _SavedToResume
        self._clock.began(time.time())
        super().on_step_begin()

    def on_step_end(self):
        if self.global_steps < self.total_training_steps:  # the last step ends the run anyway
            folder = Path(self.config.trainer.default_local_dir)
            reason = deadline.requested(folder) or self._clock.ended(time.time())
            if reason is not None:
                if "save_checkpoint" not in self.timing_raw:  # verl did not save this step itself
                    with marked_timer("save_checkpoint", self.timing_raw, color="green"):
                        self._save_checkpoint()
                print(f"STAPO: saved step {self.global_steps}: {reason}; stopping before the next step", flush=True)
                self._stop_reason = reason
        super().on_step_end()

    def _save_checkpoint(self):
        start = time.time()
        super()._save_checkpoint()
        self._clock.saved(time.time() - start)

    def _build_replay_buffer(self):
        # verl 0.9.1 tests for its own mode names (module docstring); its base class read parameter_sync_step from
        # trainer.v1.<mode> just before this call
        self.trainer_mode = self.VERL_MODE
        self.parameter_sync_step = self.config.trainer.v1.get(self.VERL_MODE, {}).get("parameter_sync_step", 1)
        buffer = super()._build_replay_buffer()
        if type(buffer) is ReplayBuffer:  # verl's own synchronous one (a custom sampler keeps its interval)
            buffer.poll_interval = POLL_INTERVAL_S
        return buffer

    def _submit_batch_to_rollout(self, batch: TensorDict) -> int:
        if self.config.actor_rollout_ref.rollout.full_determinism:  # numbered for the batch's order (_balance_batch)
            self._submitted.update({uid: next(self._submissions) for uid in batch["uid"]})
        return super()._submit_batch_to_rollout(batch)

    def _balance_batch(self, batch: KVBatchMeta, metrics, **kwargs) -> KVBatchMeta:
        """verl's balancing of the batch over data-parallel ranks; with ``full_determinism``, of the batch in the
        order its prompts were submitted (:func:`submission_order`), so that the ranks' shares and the PPO
        mini-batches (and with them the S2T quantile pools) are those of any other run of the same command."""
        if self.config.actor_rollout_ref.rollout.full_determinism:
            submitted = self._submitted
            batch.reorder(submission_order(batch.keys, submitted))
            numbers = [submitted.pop(uid) for uid in {key.split("_")[0] for key in batch.keys} if uid in submitted]
            first = min(numbers, default=-1)  # prompts submitted before this batch's and not in it: dropped by verl
            for uid in [uid for uid, number in submitted.items() if number < first]:
                del submitted[uid]
        return super()._balance_batch(batch, metrics, **kwargs)

    def _load_checkpoint(self):
        super()._load_checkpoint()
        if self.global_steps and self.train_dataloader.batch_size == self.config.data.train_batch_size:
            # one fetch of train_batch_size prompts per step (not so with DAPO-style refills: no check then)
            problem = resume_position_problem(
                self.train_dataloader.next_iter_state,
                self.global_steps,
                len(self.train_dataloader),
                self.config.data.train_batch_size,
            )
            if problem:
                raise RuntimeError(f"STAPO resume check: {problem}")
        if "file" in self.config.trainer.logger:  # verl opens its FileLogger ("wb") later, in fit()
            path = file_logger_path(self.config)
            kept = set_aside(path, segment=bool(self.global_steps))
            if kept is not None:
                what = "the steps before the checkpoint" if self.global_steps else "an earlier run's log"
                print(f"STAPO: kept {what} as {kept} (verl's FileLogger starts {path} anew)")

    def _setup(self):
        super()._setup()
        if not self.stapo.active:
            return
        actor_config = omega_conf_to_dataclass(self.config.actor_rollout_ref.actor)
        try:
            self.actor_rollout_wg.set_loss_fn(functools.partial(stapo_loss, config=actor_config, stapo=self.stapo))
        except Exception as err:  # Ray wraps the worker's unpickling error
            raise RuntimeError(
                "STAPO: the actor workers could not load the STAPO loss (stapo.train.loss.stapo_loss). The `stapo` "
                "package must be importable in every Ray worker: `pip install` this repository on every node (or use "
                "docker/Dockerfile), and keep ray_kwargs.ray_init.runtime_env.env_vars.VERL_USE_EXTERNAL_MODULES="
                f"stapo.train.plugin from the recipe's configs. Worker error: {err}"
            ) from err

    def step(self, metrics: dict, timing_raw: dict) -> KVBatchMeta:
        """verl's step; when it made several local updates (``parameter_sync_step`` > 1, ``separate_async``), the
        mask's counts and shares are logged for the whole step (:func:`stapo.train.metrics.step_metrics`), not as
        verl's mean over the updates."""
        if not getattr(self, "_started", False):
            print(FIRST_STEP_LINE.format(step=self.global_steps), flush=True)
            self._started = True
        self._updates: list[dict] = []
        batch = super().step(metrics, timing_raw)
        if len(self._updates) > 1:
            metrics.update(step_metrics(self._updates))
        return batch

    def _record(self, metrics: dict, mask: dict | None, s2t: dict | None) -> None:
        """Keep one local update's stats for :meth:`step` (not within a step, e.g. in a test: nothing to keep)."""
        counts = {k: v for k, v in metrics.items() if k.startswith(("stapo/", "s2t/")) and k.endswith("_tokens")}
        if hasattr(self, "_updates"):
            self._updates.append({"mask": mask, "s2t": s2t, "counts": counts})

    def _update_actor(self, batch: KVBatchMeta, metrics: dict) -> KVBatchMeta:
        stapo = self.stapo
        on_driver = stapo.active and stapo.policy_source == "old"
        if not (on_driver or stapo.metrics):
            batch = self._update_on_workers(batch, metrics)
            self._record(metrics, None, None)
            return batch

        start = time.perf_counter()
        rollout = stapo.metrics and self.config.actor_rollout_ref.rollout.get("calculate_log_probs", False)
        fields = MASK_INPUTS + ["rollout_log_probs"] * bool(rollout)  # vLLM's log-probs, for s2t/mismatch/*
        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=fields)
        inputs = [data[k] for k in MASK_INPUTS[:4]]
        check_entropy_dtype(data["entropy"], "the old-policy entropies in TransferQueue")
        groups = self._mask_groups(len(batch))
        observed = bounds = None
        if stapo.metrics:  # the S2T rule at π_old, applied or not; its gradient-norm bounds beside the update
            spurious, observed = mask_for_update("s2t", *inputs, groups, tau_p=stapo.tau_p, q=stapo.q)
            bounds = _BACKGROUND.submit(grad_bound_sums, *inputs, spurious, tau_p=stapo.tau_p)
            if stapo.observe_tau_p:  # the rule at a second threshold, counted only
                _, second = mask_for_update("s2t", *inputs, groups, tau_p=stapo.observe_tau_p, q=stapo.q)
                metrics.update(observed_metrics(second))
        mismatch = None
        if rollout:  # beside the update too
            args = (data["old_log_probs"], data["rollout_log_probs"], *inputs[2:], stapo.tau_p, spurious)
            mismatch = _BACKGROUND.submit(mismatch_metrics, *args)
        if not on_driver:
            mask_seconds = time.perf_counter() - start
            batch = self._update_on_workers(batch, metrics)
            observed.update(bounds.result())
            metrics.update(s2t_metrics(observed))
            metrics.update(mismatch.result() if mismatch else {})
            metrics["timing_s/stapo_mask"] = mask_seconds
            self._record(metrics, None, observed)
            return batch

        if stapo.mask == "s2t" and stapo.silence == "low_entropy" and observed is not None:
            silenced, stats = spurious, observed
        else:
            silenced, stats = mask_for_update(
                stapo.mask,
                *inputs,
                groups,
                tau_p=stapo.tau_p,
                q=stapo.q,
                top_entropy_ratio=stapo.top_entropy_ratio,
                silence=stapo.silence,
                seed=RANDOM_SEED_STRIDE * self.global_steps,  # a fresh draw every step (stapo_random)
            )
        fields = MASK_FIELDS if stapo.mask == "s2t" or stapo.top_entropy_norm == "selected" else MASK_FIELDS[:1]
        originals = data.select(*fields)
        folded = TensorDict({name: fold(originals[name], silenced) for name in fields}, batch_size=len(batch))
        self._put_masks(batch, folded)
        mask_seconds = time.perf_counter() - start
        if audit.enabled():
            during = self._mask_tokens(batch)
        try:
            batch = self._update_on_workers(batch, metrics)
        finally:
            start = time.perf_counter()
            self._put_masks(batch, originals)
            restore_seconds = time.perf_counter() - start
        metrics.update(mask_metrics(stats))
        if bounds is not None:
            observed.update(bounds.result())
            metrics.update(s2t_metrics(observed))
        metrics.update(mismatch.result() if mismatch else {})
        # the driver's critical path (inside verl's timing_s/update_actor): read the inputs from TransferQueue, build
        # the mask, write the folded masks; then write the original masks back
        metrics.update({"timing_s/stapo_mask": mask_seconds, "timing_s/stapo_restore": restore_seconds})
        if audit.enabled():
            audit.write(
                "driver",
                {
                    "step": self.global_steps,
                    "masked_tokens": stats["masked"],
                    "pool_candidates": stats.get("pool_candidates"),
                    "pool_masked": stats.get("pool_masked"),
                    "entropy_dtype": str(data["entropy"].dtype),
                    "response_tokens": int(data["response_mask"].values().sum()),
                    "loss_tokens": int(data["loss_mask"].values().sum()),
                    "folded": list(fields),
                    "during_update": during,
                    "after_update": self._mask_tokens(batch),
                },
            )
        self._record(metrics, stats, observed)
        return batch

    def _update_on_workers(self, batch: KVBatchMeta, metrics: dict) -> KVBatchMeta:
        """verl's actor update; with ``policy_source: current`` the workers' mask metrics come back as
        ``actor/stapo/*``, their counts summed per mini-batch and then averaged over the step's mini-batches by
        verl: they are reported like the driver's, per step."""
        batch = super()._update_actor(batch, metrics)
        if self.stapo.active and self.stapo.policy_source == "current":
            actor = self.config.actor_rollout_ref.actor
            minibatches = len(batch) // (actor.ppo_mini_batch_size * self.config.actor_rollout_ref.rollout.n)
            for key in [k for k in metrics if k.startswith("actor/stapo/")]:
                value = metrics.pop(key)
                metrics[key.removeprefix("actor/")] = (
                    value * minibatches * actor.ppo_epochs if key.endswith("_tokens") else value
                )
        return batch

    @staticmethod
    def _mask_tokens(batch: KVBatchMeta) -> dict[str, int]:
        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=list(MASK_FIELDS))
        return {name: int(data[name].values().sum()) for name in MASK_FIELDS}

    def _mask_groups(self, batch_size: int) -> list[torch.Tensor] | None:
        """The rows of each PPO mini-batch of this update (``None`` = the whole batch, ``quantile_scope: batch``)."""
        if self.stapo.quantile_scope == "batch":
            return None
        actor = self.config.actor_rollout_ref.actor
        wg = self.actor_rollout_wg
        if "actor" not in wg._dispatch_info:
            wg._dispatch_info["actor"] = wg._query_dispatch_info("actor")
        return minibatch_rows(
            batch_size,
            dp_size=max(wg._dispatch_info["actor"]) + 1,
            mini_batch_size=actor.ppo_mini_batch_size * self.config.actor_rollout_ref.rollout.n,
            shuffle=actor.shuffle,
            seed=actor.data_loader_seed,
        )

    @staticmethod
    def _put_masks(batch: KVBatchMeta, masks: TensorDict) -> None:
        tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id, fields=masks)


@register_trainer("stapo_sync")
class STAPOTrainer(STAPOMixin, PPOTrainerSync):
    """``PPOTrainerSync`` with the STAPO mask (the paper's setting, every recipe config's default)."""

    VERL_MODE = TRAINER_MODES["stapo_sync"]


@register_trainer("stapo_colocate_async")
class STAPOColocateAsyncTrainer(STAPOMixin, PPOTrainerColocateAsync):
    """``PPOTrainerColocateAsync`` (rollout and training share GPUs, partial rollouts) with the STAPO mask."""

    VERL_MODE = TRAINER_MODES["stapo_colocate_async"]


@register_trainer("stapo_separate_async")
class STAPOSeparateAsyncTrainer(STAPOMixin, PPOTrainerSeparateAsync):
    """``PPOTrainerSeparateAsync`` (rollout on GPUs of its own, ``parameter_sync_step``) with the STAPO mask."""

    VERL_MODE = TRAINER_MODES["stapo_separate_async"]
