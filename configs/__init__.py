"""Hydra configs of the recipe, installed as the package ``stapo.configs`` (``pkg://stapo.configs``)."""
