"""Evaluation (docs/design.md §11): ``teller evaluate`` runs every method on the same split and seed and
scores it with every metric.

- :mod:`.metrics`: step and operator-set metrics (the empty-set rule, Macro₊) used by the
  benchmarks and the root-cause models;
- :mod:`.scores`: the rest of the metrics (fault type, low priors, AUROC/AUPRC, BLEU);
- :mod:`.run`: loading a dataset's steps and features once, fitting and scoring each method of
  :data:`teller.baselines.REGISTRY`, writing ``results.json``, markdown tables and plots;
- :mod:`.cli`: the ``teller evaluate`` command.
"""
