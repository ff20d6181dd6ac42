"""The actor workers' loss for STAPO runs: verl's own ``ppo_loss`` on a response mask with the silenced tokens
folded in.

Installed on every actor worker by :class:`stapo.train.trainer.STAPOTrainer` through verl's ``set_loss_fn`` RPC, as
``functools.partial(stapo_loss, config=<ActorConfig>, stapo=<StapoConfig>)``. verl's FSDP engine calls it once
per micro-batch as ``loss_function(model_output=..., data=..., dp_group=...)``.

* ``policy_source: old`` (default): the driver has already folded the mask into ``response_mask``, so verl's
  global kept-token count (``batch_num_tokens``) is the exact STAPO denominator 1 / Σ I for any micro-batch split,
  dynamic batch size or data-parallel layout. The only addition here is a guard: a mini-batch whose every token is
  silenced gives a zero loss (no gradient) instead of 0/0 = NaN.
* ``policy_source: current`` (the paper's Algorithm 1): the mask is built here from π_θ's log-probs and entropies
  of the micro-batch being trained, detached. Two approximations, both exact when each rank trains a mini-batch in
  one micro-batch (e.g. ``use_dynamic_bsz`` with a large ``ppo_max_token_len_per_gpu``):
  - scope of the quantile: the candidates of this micro-batch on all data-parallel ranks (gathered), not the whole
    mini-batch, which never exists in one place during the update;
  - denominator: verl fixes ``batch_num_tokens`` (the mini-batch's response tokens) before the first forward, when
    the mask is unknown, so it is scaled by the kept fraction of this micro-batch over all ranks,
    ``N_kept ≈ N · kept_mb / tokens_mb``. The relative error is at most the spread of the masked fraction across
    micro-batches (the paper reports ~0.01 % masked). 20-Entropy with ``stapo.top_entropy_norm: all`` keeps the
    all-token denominator.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from tensordict import TensorDict

from stapo.config import StapoConfig
from stapo.s2t import distinct_silenced, entropy_quantile, s2t_mask, top_entropy_mask, top_k_threshold
from stapo.train import audit
from stapo.train.metrics import check_entropy_dtype, mask_metrics


def stapo_loss(config, model_output, data: TensorDict, dp_group=None, *, stapo: StapoConfig):
    """verl ``ppo_loss`` with the STAPO / 20-Entropy mask (see the module docstring). Returns ``(loss, metrics)``."""
    from verl.utils import tensordict_utils as tu
    from verl.utils.metric import AggregationType, Metric
    from verl.workers.utils.losses import ppo_loss

    data = data.copy()  # shallow: the engine keeps using the original micro-batch
    metrics, pool = {}, {}
    ranks = dist.get_world_size(dp_group) if _distributed(dp_group) else 1
    if stapo.policy_source == "current":
        metrics, pool = _fold_current_policy_mask(model_output, data, dp_group, stapo, ranks)
    if data["batch_num_tokens"] == 0:
        # Every token of the mini-batch is silenced: Σ I = 0, the objective is empty; 0 (no gradient), not NaN.
        tu.assign_non_tensor(data, batch_num_tokens=1)
    loss, loss_metrics = ppo_loss(config, model_output, data, dp_group)
    if audit.enabled():
        audit.write("loss", {**audit.loss_record(loss, model_output, data, dp_group), **pool})
    # verl sums a SUM metric over micro-batches but averages it over data-parallel ranks (Metric.aggregate_dp):
    # a rank's token count times the number of ranks makes that average the count over all ranks.
    loss_metrics.update(
        {
            key: Metric(value=value * ranks, aggregation=AggregationType.SUM)
            if key.endswith("_tokens")
            else Metric(value=value, aggregation=AggregationType.MEAN)
            for key, value in metrics.items()
        }
    )
    return loss, loss_metrics


def _fold_current_policy_mask(
    model_output, data: TensorDict, dp_group, stapo: StapoConfig, ranks: int
) -> tuple[dict[str, float], dict[str, int]]:
    """Fold the mask of π_θ into ``data``; returns the mask metrics and, for S2T, the quantile pool of this
    micro-batch over all ranks: ``pool_candidates`` (finite entropies) and ``pool_expected`` (what the rule silences
    with distinct entropies)."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import no_padding_2_padding, response_to_nested

    if model_output.get("entropy") is None:
        raise RuntimeError(
            "stapo.policy_source=current: the update computed no entropy; "
            "set actor_rollout_ref.actor.calculate_entropy=True"
        )
    check_entropy_dtype(model_output["entropy"], "the actor's entropies (stapo.policy_source=current)")
    log_probs = no_padding_2_padding(model_output["log_probs"], data).detach()
    entropy = no_padding_2_padding(model_output["entropy"], data).detach()
    padded = data.select("response_mask", "advantages").to_padded_tensor()
    response_mask = padded["response_mask"]
    pool = {}

    def gathered(fn):  # the threshold over this micro-batch's tokens on every data-parallel rank
        def threshold(values, arg):
            values = _all_gather_1d(values.to(log_probs.device), dp_group).cpu()
            pool["pool_candidates"] = int((~torch.isnan(values)).sum())
            return fn(values, arg)

        return threshold

    if stapo.mask == "s2t":
        keep, stats = s2t_mask(
            log_probs,
            entropy,
            padded["advantages"],
            response_mask,
            stapo.tau_p,
            stapo.q,
            quantile_fn=gathered(entropy_quantile),
        )
        pool["pool_expected"] = distinct_silenced(pool["pool_candidates"], stapo.q)
        stats["expected_masked"] = pool["pool_expected"] / ranks  # the pool's count: stapo_loss multiplies by ranks
    else:
        keep, stats = top_entropy_mask(
            entropy, response_mask, stapo.top_entropy_ratio, threshold_fn=gathered(top_k_threshold)
        )

    tokens, masked = _all_reduce_counts([stats["tokens"], stats["masked"]], dp_group, response_mask.device)
    if tokens > 0 and (stapo.mask == "s2t" or stapo.top_entropy_norm == "selected"):
        tu.assign_non_tensor(data, batch_num_tokens=round(data["batch_num_tokens"] * (tokens - masked) / tokens))
    data["response_mask"] = response_to_nested(keep, data["response_mask"])

    metrics = mask_metrics(stats)
    if math.isnan(metrics["stapo/entropy_threshold"]):
        del metrics["stapo/entropy_threshold"]  # a NaN would poison the mean over micro-batches
    return metrics, pool if stapo.mask == "s2t" else {}


def _distributed(group) -> bool:
    return group is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def _all_gather_1d(values: torch.Tensor, group) -> torch.Tensor:
    """Concatenate a 1-D float tensor over the ranks of ``group``; shorter tensors are padded with NaN, which the
    threshold functions ignore."""
    if not _distributed(group):
        return values
    values = values.float().reshape(-1)
    size = torch.tensor([values.numel()], device=values.device)
    sizes = [torch.empty_like(size) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, size, group=group)
    longest = int(max(s.item() for s in sizes))
    padded = torch.full((longest,), math.nan, device=values.device)
    padded[: values.numel()] = values
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded, group=group)
    return torch.cat(parts)


def _all_reduce_counts(counts: list[int], group, device) -> list[int]:
    if not _distributed(group):
        return counts
    t = torch.tensor(counts, dtype=torch.int64, device=device)
    dist.all_reduce(t, group=group)
    return t.tolist()
