"""verl V1 trainer mode ``stapo_sync``: verl's synchronous PPO trainer plus the STAPO (or 20-Entropy) mask.

Selected with ``trainer.v1.trainer_mode=stapo_sync`` (the STAPO configs do this). Two additions to
``PPOTrainerSync``, nothing else is overridden:

1. after the workers are built, the actor workers' loss becomes :func:`stapo.loss.stapo_loss` (verl's
   ``ppo_loss`` plus the mask of ``policy_source: current`` and an empty-mini-batch guard);
2. ``policy_source: old``: right before the actor update, the mask is computed on the driver from the old-policy
   log-probs and entropies verl already stored in TransferQueue, one quantile per PPO mini-batch exactly as the
   workers will split the batch (or one per step with ``quantile_scope: batch``); it is folded into
   ``response_mask`` for the update only and the original mask is put back afterwards, so advantages, data metrics
   and logs see the rollout unchanged. verl's ``token-mean`` divides by the global count of ``response_mask`` per
   mini-batch, so the loss is renormalised over the kept tokens exactly (STAPO objective, 1 / Σ I). The driver's
   share of this is timed every step: ``timing_s/stapo_mask`` and ``timing_s/stapo_restore``.
"""

from __future__ import annotations

import functools
import time

import torch
import transfer_queue as tq
from tensordict import TensorDict
from transfer_queue import KVBatchMeta
from verl.trainer.ppo.v1.trainer_base import register_trainer
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync
from verl.utils import tensordict_utils as tu
from verl.utils.config import omega_conf_to_dataclass

from stapo import audit
from stapo.config import TRAINER_MODE, validate_training_config
from stapo.loss import stapo_loss
from stapo.s2t import mask_for_update

MASK_INPUTS = ["old_log_probs", "entropy", "advantages", "response_mask", "loss_mask"]
# verl's ppo_loss masks with response_mask, while the engine counts the denominator from loss_mask (a separate
# TransferQueue field the V1 agent loop copies from response_mask): the mask is folded into both.
MASKS = ("response_mask", "loss_mask")


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


def fold(mask: torch.Tensor, silenced: torch.Tensor) -> torch.Tensor:
    """A copy of the jagged ``mask`` with the ``silenced`` tokens (a bool tensor over its values) set to 0."""
    return torch.nested.nested_tensor_from_jagged(mask.values().masked_fill(silenced, 0), mask.offsets())


@register_trainer(TRAINER_MODE)
class STAPOTrainer(PPOTrainerSync):
    """``PPOTrainerSync`` with the STAPO mask; see the module docstring."""

    def __init__(self, config):
        self.stapo = validate_training_config(config)
        super().__init__(config)

    def _setup(self):
        super()._setup()
        if not self.stapo.active:
            return
        actor_config = omega_conf_to_dataclass(self.config.actor_rollout_ref.actor)
        try:
            self.actor_rollout_wg.set_loss_fn(functools.partial(stapo_loss, config=actor_config, stapo=self.stapo))
        except Exception as err:  # Ray wraps the worker's unpickling error
            raise RuntimeError(
                "STAPO: the actor workers could not load the STAPO loss (stapo.loss.stapo_loss). The `stapo` package "
                "must be importable in every Ray worker: `pip install` this repository on every node (or use "
                "docker/Dockerfile), and keep ray_kwargs.ray_init.runtime_env.env_vars.VERL_USE_EXTERNAL_MODULES="
                f"stapo.plugin from the STAPO configs. Worker error: {err}"
            ) from err

    def _update_actor(self, batch: KVBatchMeta, metrics: dict) -> KVBatchMeta:
        if not self.stapo.active:
            return super()._update_actor(batch, metrics)
        if self.stapo.policy_source == "current":
            batch = super()._update_actor(batch, metrics)
            # The workers' mask metrics come back as "actor/stapo/*", counts summed per mini-batch and then
            # averaged over the step's mini-batches by verl: report them like the driver does, per step.
            actor = self.config.actor_rollout_ref.actor
            minibatches = len(batch) // (actor.ppo_mini_batch_size * self.config.actor_rollout_ref.rollout.n)
            for key in [k for k in metrics if k.startswith("actor/stapo/")]:
                value = metrics.pop(key)
                metrics[key.removeprefix("actor/")] = (
                    value * minibatches * actor.ppo_epochs if key.endswith("_tokens") else value
                )
            return batch

        start = time.perf_counter()
        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=MASK_INPUTS)
        originals = data.select(*MASKS)
        silenced, mask_metrics = mask_for_update(
            self.stapo.mask,
            data["old_log_probs"],
            data["entropy"],
            data["advantages"],
            data["response_mask"],
            self._mask_groups(len(batch)),
            tau_p=self.stapo.tau_p,
            q=self.stapo.q,
            top_entropy_ratio=self.stapo.top_entropy_ratio,
        )
        folded = TensorDict({name: fold(originals[name], silenced) for name in MASKS}, batch_size=len(batch))
        self._put_masks(batch, folded)
        mask_seconds = time.perf_counter() - start
        if audit.enabled():
            during = self._mask_tokens(batch)
        try:
            batch = super()._update_actor(batch, metrics)
        finally:
            start = time.perf_counter()
            self._put_masks(batch, originals)
        metrics.update(mask_metrics)
        # the driver's whole cost of the mask (inside verl's timing_s/update_actor): read the inputs from
        # TransferQueue, build the mask, write the folded masks; then write the original masks back
        metrics.update({"timing_s/stapo_mask": mask_seconds, "timing_s/stapo_restore": time.perf_counter() - start})
        if audit.enabled():
            audit.write(
                "driver",
                {
                    "step": self.global_steps,
                    "masked_tokens": int(mask_metrics["stapo/masked_tokens"]),
                    "response_tokens": int(originals["response_mask"].values().sum()),
                    "loss_tokens": int(originals["loss_mask"].values().sum()),
                    "during_update": during,
                    "after_update": self._mask_tokens(batch),
                },
            )
        return batch

    @staticmethod
    def _mask_tokens(batch: KVBatchMeta) -> dict[str, int]:
        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=list(MASKS))
        return {name: int(data[name].values().sum()) for name in MASKS}

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
