"""Every place where the recipe works around verl 0.9.1 (or Ray 2.60, vLLM 0.24, transformers 5.x), in one list:
:data:`WORKAROUNDS` names each one's code, what it answers and when it can go (tests/test_verl_patches.py checks that
every named place exists). The three that patch verl or vLLM at run time live here:

* :func:`float32_fused_entropy` -- verl's fused log-probability kernel (``FusedLinearForPPO``, torch backend: what
  ``use_fused_kernels: auto`` selects when flash-attn is missing) computes the entropy in float32 and stores it in
  the hidden states' dtype, bfloat16 (``verl/utils/experimental/torch_functional.py``: ``entropy.to(orig_dtype)``
  and a ``hidden_states.new_zeros`` buffer; verl PR #5662 made the log-probs float32, not the entropy). bfloat16
  keeps 8 bits of mantissa, so the S2T candidates' entropies tie at τ_h and the strict ``H < τ_h`` silences far
  fewer than the rule's q (measured on one H100: 3.6 % of candidates instead of about 75 %). The patch keeps the
  kernel's float32 entropy; the log-probs, the gradients and the speed are verl's (tested in
  tests/test_verl_patches.py, timed by ``python -m stapo.checks.benchmark actor``). The other paths the recipe can
  select give float32 entropies already: verl's triton kernel (``fused_kernel_options.impl_backend: triton``), the
  unfused path (softmax and logsumexp run in float32 under CUDA autocast) and ``entropy_from_logits_with_chunking``;
  every run checks what reaches the mask (:func:`stapo.train.metrics.check_entropy_dtype`).
* :func:`batch_invariant_residual_rms_norm` -- a vLLM general plugin (``setup.py``: ``vllm.general_plugins``, loaded
  by every vLLM process before it builds its model). Under ``VLLM_BATCH_INVARIANT=1`` vLLM 0.24 normalises with its
  batch-invariant Triton kernel only where a norm has no residual; with one, ``RMSNorm.forward_cuda`` calls the
  ``fused_add_rms_norm`` CUDA kernel, whose block size follows the batch's token count (1,024 threads under 256
  tokens, 256 from there on), so the same token's norm sums its squares in another order in a small prefill than in
  a large one (vLLM PR #48391, merged after the 0.24 wheel was built). The plugin adds the residual and normalises
  with vLLM's own Triton ``rms_norm_batch_invariant`` (one block size for every batch). On an H100 a request alone first
  parted from the batch at such a norm, and with the plugin nowhere (docs/evidence/bitwise.md); the block size as the
  reason is read from vLLM's code, not measured.
* :func:`stapo.quiet_verl_import_notices` -- importing verl on a machine without its optional engines and
  accelerator prints 12 lines (five ``UserWarning`` "<engine> engine is not available" from
  ``verl/workers/engine/__init__.py``, two "No supported accelerator detected" / "registered but not available" log
  records from ``verl/plugin/platform/platform_manager.py``) before a tool can say anything. Importing ``stapo``
  hides them, so that every ``python -m stapo.*`` tool answers without them; an error of verl's own still prints.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Workaround:
    """One workaround: its code (``module:attribute``, or ``configs/FILE.yaml:dotted.key`` for a setting), what it
    answers, and when to remove it."""

    code: str
    answers: str
    remove_when: str


WORKAROUNDS = (
    Workaround(
        "stapo.train.main:ArmedRunner",
        "Ray 2.60's ray.init (ray/_private/worker.py) and the local node it starts (ray/_private/node.py) install "
        "SIGTERM handlers in the driver that end it at once, replacing the recipe's save-at-the-step's-end request",
        "Ray leaves a driver's own SIGTERM handler in place (tests/test_deadline.py's run_ppo test passes without it)",
    ),
    Workaround(
        "stapo.train.trainer:STAPOMixin.on_step_end",
        "verl 0.9.1's V1 trainers (trainer_base.fit) do not save before a deadline: should_save_ckpt_esi and its "
        "expiry variables serve only the older trainer",
        "verl's V1 fit saves before a deadline and on a signal itself, with a distinct exit status",
    ),
    Workaround(
        "stapo.train.verl_patches:float32_fused_entropy",
        "verl 0.9.1 FusedLinearForPPO returns bfloat16 entropies (PR #5662 fixed the log-probs only)",
        "verl's FusedLinearForPPOFunction returns float32 entropies for bfloat16 inputs (a test here fails then)",
    ),
    Workaround(
        "stapo.train.verl_patches:batch_invariant_residual_rms_norm",
        "vLLM 0.24's fused_add_rms_norm kernel, which RMSNorm with a residual calls under VLLM_BATCH_INVARIANT=1, "
        "takes its block size from the batch's token count (vLLM PR #48391, after 0.24; tracked in vLLM #27433)",
        "the recipe's vLLM includes PR #48391 (the block size pinned under batch invariance)",
    ),
    Workaround(
        "stapo:quiet_verl_import_notices",
        "verl 0.9.1 warns at import about every optional engine and accelerator it does not find",
        "verl imports quietly (test_newcomer's one-line test passes without it)",
    ),
    Workaround(
        "stapo.train.trainer:STAPOMixin._build_replay_buffer",
        "verl 0.9.1 chooses its code paths and reads trainer.v1.<mode> by the trainer mode's literal name "
        "(trainer_base compares it with 'sync'); a registered trainer mode must declare verl's own name",
        "verl keys the synchronous path on the trainer class or a flag, not the mode's name",
    ),
    Workaround(
        "stapo.train.trainer:POLL_INTERVAL_S",
        "verl 0.9.1's replay buffer looks for finished rollouts every 2 s, a fixed value: short generations round up",
        "verl makes the poll interval configurable or event-driven",
    ),
    Workaround(
        "stapo.train.trainer:file_logger_path",
        "verl 0.9.1's FileLogger opens its JSONL with 'wb', erasing earlier steps when a run resumes "
        "(the trainer sets the file aside first: STAPOTrainer._load_checkpoint)",
        "verl's FileLogger appends on resume",
    ),
    Workaround(
        "stapo.train.trainer:resume_position_problem",
        "verl 0.9.1 resumes without data.pt from the first batch, silently (the check stops such a run)",
        "verl refuses a resume whose dataloader state is missing or does not match",
    ),
    Workaround(
        "stapo.train.preflight:resume_problems",
        "verl 0.9.1 starts from step 0 over an unreadable tracker, loads incomplete checkpoints, and with "
        "max_actor_ckpt_to_keep=1 deletes the last checkpoint before the new one is complete",
        "verl validates its checkpoints before resuming and deletes old ones after the new one is written",
    ),
    Workaround(
        "stapo.train.preflight:local_cluster_problems",
        "verl 0.9.1 names the weight-transfer socket after the Ray job id (/tmp/rl-colocate-zmq-<job>-...), which "
        "every local Ray cluster starts at 01000000: two local runs on one machine share it",
        "verl makes the socket name unique per run (e.g. a random or run-named suffix)",
    ),
    Workaround(
        "stapo.train.preflight:TQ_CONTROLLER",
        "verl 0.9.1's TransferQueue is a named Ray actor per cluster: jobs of one cluster share it and take each "
        "other's rollouts (the preflight refuses a RAY_ADDRESS cluster where one lives; stapo.train.clusters "
        "gives each of several runs a cluster of its own)",
        "transfer_queue names its controller per job",
    ),
    Workaround(
        "stapo.train.clusters:one_auth_mode",
        "Ray 2.60's `ray start --head` turns token auth on when ~/.ray/auth_token exists (written by any earlier local "
        "ray.init), while clients given its address do not: the clusters of an experiment run after a train.sh run "
        "refused every driver",
        "Ray's head and clients decide the auth mode the same way",
    ),
    Workaround(
        "stapo.train.clusters:claim_job",
        "the same socket name: concurrent runs on one machine get clusters whose job ids are made distinct",
        "the socket-name workaround above can go",
    ),
    Workaround(
        "stapo.train.agent_loop:SeededSingleTurnAgentLoop",
        "verl 0.9.1 seeds every vLLM request alike under rollout.full_determinism (vllm_async_server.py, generate: "
        "replica_rank + rollout.seed): the n responses of a prompt are one response n times and GRPO's advantages "
        "zero (0-361 positive-advantage tokens a step on an H200, against 4,533-6,789 without it; verl PR #6857 "
        "names the collision for SGLang)",
        "verl seeds the responses of a group apart",
    ),
    Workaround(
        "stapo.train.trainer:submission_order",
        "verl 0.9.1's V1 replay buffer lists a step's trajectories in the order they finished, which differs from run "
        "to run (verl's docs/advance/determinism.md asks for the V0 trainer, which the recipe's trainer modes are "
        "not): with determinism=full the trainer orders each batch as its prompts were submitted",
        "verl's V1 trainer orders a batch by submission under full_determinism",
    ),
    Workaround(
        "configs/determinism/full.yaml:actor_rollout_ref.rollout.enable_prefix_caching",
        "vLLM 0.24's batch-invariant mode does not cover prefix-cache hits: a prompt resumed from a cached prefix is "
        "prefilled in another shape (vLLM PR #46592, open), and the n copies of a prompt arrive in varying order",
        "vLLM's batch invariance covers prefix caching",
    ),
    Workaround(
        "configs/determinism/full.yaml:actor_rollout_ref.rollout.enforce_eager",
        "verl 0.9.1 calls torch.use_deterministic_algorithms in vLLM's workers under full_determinism "
        "(vLLMColocateWorkerExtension); torch 2.11's Inductor then refuses the kernel benchmarking of vLLM 0.24's "
        "torch.compile ('In the deterministic mode of Inductor, we will avoid those benchmarkings') and the engine "
        "fails to start (H200, 2026-11-28)",
        "vLLM's compiled model starts under torch's deterministic algorithms",
    ),
    Workaround(
        "stapo.train.trainer:STAPOMixin.step",
        "verl 0.9.1's MetricsAggregator (verl/trainer/ppo/v1/utils.py) reduces the local updates of a separate_async "
        "step (parameter_sync_step > 1) by a sample-weighted mean for every metric it has no rule for: the mask's "
        "token counts would be per-update means and its shares means of shares",
        "verl lets a trainer declare how its metrics are reduced over a step's local updates (a sum for counts)",
    ),
    Workaround(
        "stapo.train.preflight:check_installed",
        "verl 0.9.1 swallows errors of plugins it loads from entry points (the trainer also checks that the "
        "workers can load the loss: STAPOTrainer._setup)",
        "verl reports a failing plugin",
    ),
    Workaround(
        "stapo.quickstart.experiment:KV_CACHE_BYTES",
        "vLLM 0.24 measures free GPU memory while it starts and fails when another process on the GPU frees memory "
        "meanwhile (also stapo.tools.probe:KV_CACHE); a given KV-cache size skips the measurement",
        "vLLM's start-up tolerates other processes on the GPU",
    ),
    Workaround(
        "stapo.train.attention:varlen_attention",
        "no flash-attn wheel for torch 2.11 / CUDA 13: transformers' sdpa on verl's packed sequences attends over "
        "the whole pack and verl wires Ulysses into flash_attention_2 only",
        "flash-attn installs from a wheel, or verl supports torch's varlen attention",
    ),
    Workaround(
        "configs/base.yaml:data.dataloader_num_workers",
        "verl 0.9.1's dataloader worker processes are killed before the task runner when Ray ends a run, and torch's "
        "SIGCHLD handler prints a 'DataLoader worker ... is killed by signal' traceback at the end of every run",
        "verl stops its dataloaders before its task runner exits",
    ),
    Workaround(
        "configs/base.yaml:ray_kwargs.ray_init.runtime_env.env_vars.VLLM_DISABLE_COMPILE_CACHE",
        "verl 0.9.1 turns vLLM's compile cache off for every run (vllm#31199, corrupted artifacts of concurrent "
        "engines before torch 2.10's atomic writes, pytorch#162432), so every launch compiles again",
        "verl stops setting VLLM_DISABLE_COMPILE_CACHE=1 in trainer/constants_ppo.py",
    ),
    Workaround(
        "stapo.train.startup_cuts:register_recipe_modules",
        "verl 0.9.1 imports every plugin in every process that imports verl (verl/__init__.py) and registers trainer "
        "modes and agent loops only as classes: the recipe's trainers and agent loop cost about 2 s of imports in the "
        "driver, the FSDP, reward and vLLM processes, which never use them (start-up: verl issue #384; cut "
        "lazy_plugin, STAPO_STARTUP_CUTS)",
        "verl registers plugins' trainers and agent loops by name ('module:Class') or loads plugins per role",
    ),
    Workaround(
        "stapo.train.startup_cuts:uni_executor",
        "verl 0.9.1 starts every vLLM replica with distributed_executor_backend=mp (vllm_async_server.py, "
        "launch_server), so a one-GPU replica spawns a worker process beside vLLM 0.24's engine process, and vLLM "
        "forces spawn inside a Ray actor (_maybe_force_spawn): one more Python importing torch, vLLM and verl before "
        "the first step (verl issue #384; cut uni_executor, STAPO_STARTUP_CUTS)",
        "verl leaves a one-GPU replica to vLLM's default executor (uni)",
    ),
    Workaround(
        "stapo.train.startup_cuts:precompile",
        "installs without bytecode (pip --no-compile, the GPU bundle) compile each module in the first process that "
        "imports it, and verl 0.9.1 starts its processes one generation after another, each paying its share "
        "(verl issue #384; cut bytecode, STAPO_STARTUP_CUTS)",
        "every install the recipe runs on ships bytecode (pip's default); the cut then only compares timestamps",
    ),
    Workaround(
        "configs/size/qwen3_1.7b.yaml:transfer_queue.backend.SimpleStorage.num_data_storage_units",
        "verl 0.9.1 starts 8 TransferQueue storage units on any cluster (trainer/config/transfer_queue/"
        "transfer_queue.yaml), each a process importing torch at start-up and holding one of Ray's CPUs for the run; "
        "on one node 2 (TransferQueue 0.1.11's own default, its advice: 2 per node) hold the same data (also "
        "configs/size/smollm2_135m.yaml; verl issue #384)",
        "verl sizes the storage units by the cluster's nodes",
    ),
    Workaround(
        "stapo.tools.pretrained:convert",
        "transformers 5.17 refuses save_pretrained on a GGUF-loaded model; its GGUF tokenizer import names "
        "<|im_start|> as SmolLM2's EOS; gguf 0.19 fails to import beside vLLM's mistral_common (_import_gguf)",
        "transformers saves GGUF-loaded models and maps the GGUF EOS id",
    ),
)


def _log_probs_and_entropy(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 log π(label) and entropy H = logsumexp(z) − Σ softmax(z)·z of a chunk of float32 logits, as verl's
    ``_fused_linear_for_ppo_fwd`` computes them (flash-attn's cross-entropy kernel for the log-probs where it is
    installed), without casting the entropy down."""
    from verl.utils.experimental import torch_functional as tf

    entropy = torch.logsumexp(logits, dim=-1) - torch.sum(logits.softmax(dim=-1) * logits, dim=-1)
    if tf._FLASH_ATTN_CROSS_ENTROPY_AVAILABLE:
        return -tf.cross_entropy_loss(logits, labels)[0], entropy
    return logits.log_softmax(dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1), entropy


def _float32_entropy_function():
    """A subclass of verl's ``FusedLinearForPPOFunction`` whose forward returns float32 entropies; its backward is
    verl's (it reads the same saved tensors and context attributes)."""
    from verl.utils.experimental.torch_functional import FusedLinearForPPOFunction

    class FusedLinearForPPOFloat32Entropy(FusedLinearForPPOFunction):
        @staticmethod
        def forward(ctx, hidden_states, vocab_weights, input_ids, temperature=1.0, chunk_size=512):
            ctx.set_materialize_grads(False)
            ndim = hidden_states.ndim
            if ndim not in (2, 3):
                raise ValueError(f"hidden_states must be 2-D or 3-D, got shape {tuple(hidden_states.shape)}")
            shape = input_ids.shape
            if ndim == 3:  # as verl: a flat (tokens, hidden) view that keeps requires_grad for the backward
                requires_grad = hidden_states.requires_grad
                hidden_states = hidden_states.flatten(0, 1)
                hidden_states.requires_grad_(requires_grad)
                input_ids = input_ids.flatten(0, 1)
            tokens = hidden_states.shape[0]
            log_probs = torch.empty(tokens, device=hidden_states.device, dtype=torch.float32)
            entropy = torch.empty_like(log_probs)
            for start in range(0, tokens, chunk_size):
                end = min(start + chunk_size, tokens)
                logits = ((hidden_states[start:end] @ vocab_weights.t()) / temperature).float()
                log_probs[start:end], entropy[start:end] = _log_probs_and_entropy(logits, input_ids[start:end])
            ctx.save_for_backward(hidden_states, vocab_weights, input_ids)
            ctx.orig_batch_size = shape[0] if ndim == 3 else -1
            ctx.orig_ndim = ndim
            ctx.temperature = temperature
            ctx.chunk_size = chunk_size
            return log_probs.view(shape), entropy.view(shape)

    return FusedLinearForPPOFloat32Entropy


def float32_fused_entropy(enable: bool = True) -> None:
    """Make verl's torch ``FusedLinearForPPO`` return float32 entropies; ``enable=False`` puts verl's own function
    back (the actor benchmark times the two side by side). Idempotent."""
    from verl.utils.experimental import torch_functional as tf

    current = tf.FusedLinearForPPOFunction
    original = getattr(current, "_stapo_original", current)
    if not enable:
        tf.FusedLinearForPPOFunction = original
    elif current is original:
        patched = _float32_entropy_function()
        patched._stapo_original = original
        tf.FusedLinearForPPOFunction = patched


VLLM_PLUGIN = "stapo_rms_norm"
"""The name of :func:`batch_invariant_residual_rms_norm` among vLLM's general plugins (setup.py)."""


def batch_invariant_residual_rms_norm() -> None:
    """The vLLM plugin of the module docstring: with ``VLLM_BATCH_INVARIANT`` on, the batch-invariant norm that vLLM
    0.24's ``RMSNorm.forward_cuda`` calls (``layernorm.rms_norm_batch_invariant``, looked up at each call, so modules
    built before the plugin ran are covered too) gets a residual handled by the recipe: ``(norm(x + residual),
    x + residual)``, the pair vLLM's fused kernel returns, from vLLM's Triton kernel alone, whose reduction does not
    depend on the batch. Without a residual the call is vLLM's own. Only the eager path (``forward_cuda``), which
    ``determinism=full`` runs, is covered. Idempotent (vLLM may load a plugin more than once in a process). A vLLM
    without these names gets a warning, not a failed engine (vLLM calls its plugins unguarded)."""
    import vllm.envs as envs

    if not envs.VLLM_BATCH_INVARIANT:
        return
    try:
        from vllm.model_executor.layers import batch_invariant, layernorm

        original = layernorm.rms_norm_batch_invariant
        kernel = batch_invariant.rms_norm_batch_invariant
    except (ImportError, AttributeError) as error:
        import warnings

        warnings.warn(f"stapo: vLLM's residual RMSNorm left as it is ({error}); runs may depend on the batch")
        return
    if getattr(original, "_stapo_original", None):
        return

    def rms_norm_batch_invariant(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, residual=None):
        if residual is None or residual.shape != x.shape:  # vLLM's own (which asserts equal shapes)
            return original(x, weight, eps, residual=residual)
        total = x + residual
        return kernel(total, weight, eps), total

    rms_norm_batch_invariant._stapo_original = original
    layernorm.rms_norm_batch_invariant = rms_norm_batch_invariant
