"""STAPO on verl 0.9.1: the layer between the method (:mod:`stapo.s2t`, :mod:`stapo.batch_mask`,
:mod:`stapo.config`) and verl's own trainer, engine and loss.

* :mod:`stapo.train.main` (``python -m stapo.train``): compose the recipe's YAML, check it, start verl's V1 run;
* :mod:`stapo.train.preflight`: the checks that run on the driver before Ray starts;
* :mod:`stapo.train.trainer`: trainer mode ``stapo_sync``, the driver-side mask before each actor update;
* :mod:`stapo.train.loss`: the actor workers' loss (verl's ``ppo_loss`` on the folded mask);
* :mod:`stapo.train.attention`: fast packed-sequence attention for the actor when flash-attn is not installed;
* :mod:`stapo.train.metrics`, :mod:`stapo.train.audit`, :mod:`stapo.train.plugin` (verl's plugin hook).
"""
