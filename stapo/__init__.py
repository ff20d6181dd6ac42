"""STAPO (arXiv 2602.15620) on pip-installed verl 0.9.1."""

__version__ = "0.1.0"
