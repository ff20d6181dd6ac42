"""Experiment tools around the recipe: data preparation (:mod:`~stapo.tools.data`), the reward
(:mod:`~stapo.tools.reward`), evaluation (:mod:`~stapo.tools.evaluate`), paper tables and plots
(:mod:`~stapo.tools.report`), the spurious-token inspector (:mod:`~stapo.tools.inspect_tokens`) and shared file I/O
(:mod:`~stapo.tools.io`). Each module with a command line runs as ``python -m stapo.tools.<module>``."""
