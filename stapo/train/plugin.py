"""verl plugin: in every process that imports verl, registers the trainer modes (``stapo_sync`` and the asynchronous
ones), the attention implementation ``torch_varlen`` (:mod:`stapo.train.attention`) and the agent loop of
``determinism=full`` (:mod:`stapo.train.agent_loop`), and makes verl's fused log-probability kernel return float32
entropies (:mod:`stapo.train.verl_patches`).

Loaded through the ``verl.plugins`` entry point once the package is installed, and explicitly through
``VERL_USE_EXTERNAL_MODULES=stapo.train.plugin`` (set in the recipe configs' Ray runtime environment, so it reaches
every Ray process even where entry points are disabled). verl swallows plugin errors, so the entry point checks that
the package is installed (:func:`stapo.train.preflight.check_installed`) and the trainer checks that the actor
workers can load the STAPO loss. With the start-up cut ``lazy_plugin`` (:mod:`stapo.train.startup_cuts`, on unless
``STAPO_STARTUP_CUTS`` says otherwise) the trainer modes and the agent loop are registered when verl imports its V1
trainers and its agent-loop package, not in every process that imports verl.
"""

from stapo.train import attention, startup_cuts, verl_patches

attention.register()
verl_patches.float32_fused_entropy()
startup_cuts.register_recipe_modules()
