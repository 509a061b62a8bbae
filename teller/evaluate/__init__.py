"""``teller evaluate``: every method on the same split and seed, every metric of DESIGN.md §11.

- :mod:`.scores`: the metrics (step, operator set, fault type, low priors, BLEU);
- :mod:`.run`: loading a dataset's steps and features once, fitting and scoring each method of
  :data:`teller.baselines.REGISTRY`, writing ``results.json``, markdown tables and plots;
- :mod:`.cli`: the ``teller evaluate`` command.
"""
