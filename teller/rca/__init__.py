"""Multimodal root-cause models (docs/design.md §9): which steps are abnormal, which of five fault
types, which operators are the evidence, and why, in a sentence.

- :mod:`.data`: units (a step and view) from a labelled dataset, their TPE-encoded trace and log
  text (:class:`StepInputs`), duration reference statistics;
- :mod:`.text`: the byte-level BPE text tokenizer;
- :mod:`.model`: the trace encoder, variant A ``mot`` (shared attention, two feed-forward
  streams, dual head) and variant B ``single`` (one backbone input, generated target);
- :mod:`.schema`: projection onto valid outputs; :mod:`.metrics`: evaluation;
- :mod:`.train`: fitting, checkpoints, evaluation; :mod:`.api`: :class:`RCA`;
- :mod:`.novelty`: how unlike every training step a unit is (:class:`~teller.rca.novelty.Novelty`);
- :mod:`.ensemble`: several trainings of one recipe answering as one (:class:`Ensemble`) and
  :func:`load`, which reads a model or an ensemble folder.

    model = teller.rca.load("models/rca")
    inputs = model.inputs(forest_table, [[step_id], ...], log_text=[...])
    for p in model.predict(inputs): print(p["fault_type"], p["evidence_operators"], p["explanation"])

torch, transformers and tokenizers load on first use of ``load``/``RCA`` (the ``teller`` command
registers ``teller rca`` without importing them).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["DEFAULT_MODEL", "FAULT_TYPES", "RCA", "Ensemble", "EPISODE_FLOOR", "LASTING_NOVELTY", "SCREEN_FLOOR", "StepInputs", "episode_floor", "load", "own_episode_floor"]

#: the model shipped with the package (the family-head MoT trained on the request split of the
#: union of dataset v2's four parts, ``runs/h200_v2_all``; docs/results.md)
DEFAULT_MODEL = Path(__file__).resolve().parent / "default"

#: the model's abnormal probability from which it keeps a step the numeric stage flagged (its own
#: flags start at :data:`teller.rca.schema.ABNORMAL_CUT`): chosen among 0.001-0.1 on the answers of the model shipped until
#: 2026-12-03 on data/h200_v2's
#: request split, then measured on the union of dataset v2 (docs/results.md, `teller_screened`);
#: `teller diagnose` and the `teller_confirm` / `teller_screened` rows of `teller evaluate` use it
SCREEN_FLOOR = 0.1
#: the model's abnormal probability under which it rules out even a lasting departure of the
#: numeric stage (an episode of 5+ stage flags it does not flag itself) where the model keeps no
#: floor of its own (:func:`episode_floor`: one calibrated before it was kept, an ensemble):
#: `teller diagnose` and the `teller_diagnose*` / `teller_sustained*` rows of `teller evaluate`.
#: One hundredth: a fault of a kind the model never saw mostly got more from it, the normal steps
#: a stage flags against a reference unlike them mostly less (docs/results.md, "The rule-out
#: floor and novelty"); a threshold that does not carry from one training to another, hence the
#: models' own ("A floor relative to the model")
EPISODE_FLOOR = 0.01
#: a lasting departure of the stage stays only where its step's novelty
#: (:mod:`teller.rca.novelty`: its distance to the model's training steps over the 99th
#: percentile of that distance on held-out steps of the kinds trained on) is above this; nearer,
#: the step is of a kind the model was trained on and its "normal" stands. On the request and
#: run splits the stage's lasting departures were mostly normal steps near the training steps,
#: on held-out mechanisms mostly faults far from them; chosen among 0-1 on the nested mechanism
#: folds and the request split's val part, no test part read (docs/results.md, "Lasting
#: departures where the model has not seen the kind"). Where a step's novelty is unknown (a model
#: without one, the run's context unreadable) the departure is not gated
LASTING_NOVELTY = 0.25


def own_episode_floor(meta: dict[str, Any], view: str) -> float | None:
    """The floor a model (its ``config.json`` metadata ``meta``) keeps for lasting departures on
    units of ``view``, the quantile of its probability over its val part's normal units
    (``calibration.episode_floor``, :func:`teller.rca.train.calibrate_episode_floor`); None where
    it keeps none (calibrated before the floor was kept with it, an ensemble, no normal val unit
    of that view)."""
    views = ((meta.get("calibration") or {}).get("episode_floor") or {}).get("views") or {}
    got = (views.get(view) or {}).get("floor")
    return None if got is None else float(got)


def episode_floor(meta: dict[str, Any], view: str) -> float:
    """The floor under which a model (its ``config.json`` metadata ``meta``) rules out a lasting
    departure of the numeric stage on units of ``view``: its own (:func:`own_episode_floor`), else
    :data:`EPISODE_FLOOR`."""
    own = own_episode_floor(meta, view)
    return EPISODE_FLOOR if own is None else own


def __getattr__(name: str) -> Any:
    if name == "RCA":
        from teller.rca import api

        return api.RCA
    if name in ("Ensemble", "load"):
        from teller.rca import ensemble

        return getattr(ensemble, name)
    if name in ("FAULT_TYPES", "StepInputs"):
        from teller.rca import data

        return getattr(data, name)
    raise AttributeError(f"module 'teller.rca' has no attribute {name!r}")
