"""GPU integration checks and benchmarks, run on a GPU host (docs/history.md, docs/scale.md):
``python -m stapo.checks.gpu_smoke`` (audited end-to-end runs) and ``python -m stapo.checks.benchmark``
(the mask's CPU cost, the actor's forward/backward pieces, STAPO against JustRL in one training run)."""
