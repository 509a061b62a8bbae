"""Baseline methods of the evaluation (docs/design.md §11), one small class each, in a registry.

Every method is fitted on the train steps of a :class:`~teller.baselines.steps.StepSet` and
predicts, per test step, an abnormal score and flag and, where it can, a fault type and an
operator set (:class:`~teller.baselines.base.Prediction`). ``teller evaluate`` runs the methods of
:data:`~teller.baselines.base.REGISTRY`; a new method (a neural root-cause model, a log model)
is one class decorated with :func:`~teller.baselines.base.register`.
"""

from teller.baselines.base import REGISTRY, Method, Prediction, make, register

__all__ = ["REGISTRY", "Method", "Prediction", "make", "register"]


def _load_builtin() -> None:
    from teller.baselines import classical, logs, numeric, rca  # noqa: F401  (their classes register themselves)


_load_builtin()
