"""STAPO (arXiv 2602.15620) on pip-installed verl 0.9.1.

Importing the package hides verl 0.9.1's import-time notices about what a run does not use
(:func:`quiet_verl_import_notices`), so that every ``python -m stapo.*`` tool answers without them.
"""

import logging
import warnings

__version__ = "0.1.0"

_ENGINES = r"(torchtitan|veomni|automodel|mindspeed|megatron) engine is not available"
_PLATFORM_LOGGER = "verl.plugin.platform.platform_manager"


def quiet_verl_import_notices() -> None:
    """Hide the 12 lines verl 0.9.1 prints when it is imported on a machine without its optional engines or an
    accelerator: five ``UserWarning`` "<engine> engine is not available" (``verl/workers/engine/__init__.py``) and
    the "No supported accelerator detected" / "registered but not available" records of
    ``verl/plugin/platform/platform_manager.py``. Its logger resets its own level on import, so a filter does the
    work; verl's errors still print. Listed in :data:`stapo.train.verl_patches.WORKAROUNDS`."""
    warnings.filterwarnings("ignore", message=_ENGINES, category=UserWarning)
    logging.getLogger(_PLATFORM_LOGGER).addFilter(lambda record: record.levelno >= logging.ERROR)


quiet_verl_import_notices()  # before any tool imports verl
