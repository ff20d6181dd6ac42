"""verl plugin: registers the ``stapo_sync`` trainer mode in every process that imports verl.

Loaded automatically through the ``verl.plugins`` entry point once the package is installed, and explicitly
through ``VERL_USE_EXTERNAL_MODULES=stapo.plugin`` (set in the STAPO configs' Ray runtime environment, so it
reaches every Ray process even where entry points are disabled). verl swallows entry-point errors, so the
training entry point checks that the package and its entry point are installed (:func:`stapo.train.check_installed`)
and the trainer checks that the actor workers can load the STAPO loss.
"""

from stapo import trainer  # noqa: F401  (registers TRAINER_MODE)
