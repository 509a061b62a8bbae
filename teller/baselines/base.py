"""The method contract of the evaluation and its registry."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from teller.baselines.steps import StepSet
from teller.errors import TellerError


@dataclass
class Prediction:
    """What a method says about each of the steps it was asked about (same order).

    ``score``: higher is more abnormal (any scale; used for AUROC/AUPRC); ``flag``: the method's
    own decision; ``fault_type``: a category per step (None: the method has no fault-type head);
    ``operators``: the predicted operator families of each step, empty for a step not flagged
    (None: the method names no operators); ``alternative``: per step, the other type its
    evidence cannot rule out ("" none; None: the method does not say, as all but the numeric stage)."""

    score: np.ndarray
    flag: np.ndarray
    fault_type: np.ndarray | None = None
    operators: list[list[str]] | None = None
    alternative: np.ndarray | None = None


class Method:
    """A scikit-learn-style method: hyper-parameters in ``__init__``, ``fit`` returns self,
    learned state in attributes ending with ``_``.

    ``kind`` is ``unsupervised`` (fitted without labels, except that a one-class method is
    fitted on the normal train steps: ``fit_on``), ``supervised`` or ``teller``; ``features`` says
    which inputs it reads (shown in the results); ``needs_instances``: it reads the numeric
    stage's operator instances (``steps.extra["instances"]``, built once per view by
    ``teller evaluate`` when a method asks for them)."""

    name = "?"
    label = "?"
    kind = "?"
    features = "?"
    fit_on = "train steps"
    needs_instances = False

    def fit(self, steps: StepSet, idx: np.ndarray) -> "Method":
        raise NotImplementedError

    def predict(self, steps: StepSet, idx: np.ndarray) -> Prediction:
        raise NotImplementedError

    def describe(self) -> dict[str, Any]:
        return {"method": self.name, "label": self.label, "kind": self.kind, "features": self.features,
                "fit_on": self.fit_on}


#: method name → factory taking ``seed``
REGISTRY: dict[str, Callable[..., Method]] = {}


def register(name: str) -> Callable[[Callable[..., Method]], Callable[..., Method]]:
    """Decorator adding a method class (or factory of ``seed=``) to :data:`REGISTRY`."""

    def deco(factory: Callable[..., Method]) -> Callable[..., Method]:
        if name in REGISTRY:
            raise ValueError(f"method {name!r} registered twice")
        REGISTRY[name] = factory
        return factory

    return deco


def make(name: str, seed: int = 0) -> Method:
    """A fresh instance of the registered method ``name``."""
    if name not in REGISTRY:
        raise TellerError(f"--methods: unknown method {name!r}; known: {', '.join(REGISTRY)}")
    m = REGISTRY[name](seed=seed)
    m.name = name
    return m
