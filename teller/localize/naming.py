"""The operators the numeric stage names for a flagged step (docs/design.md §6).

The stage ranks a flagged step's families (its candidates, by suspiciousness) and its evidence
decides a fault type through one of them (:mod:`teller.localize.faulttype`), which `teller
diagnose`'s verdict names first. The operators it names are those families in that order, the
evidence's first, each framework op (``BE``) lifted to the modules (``FE``) that enclose the
step's suspects of it (the labels, like a user, name modules, collectives, the engine's ranges
and the step, never an op inside a module; a ``BE`` family none of whose suspects a module
encloses stays), at most :data:`MAX_OPERATORS`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["MAX_OPERATORS", "named_operators", "ranked_families"]

#: the most operators the stage names for a step: the labelling rule's locator names at most three
#: families (docs/faults.md); on the nested mechanism hold-outs, where every lasting departure is
#: the stage's, the first three name the labels' operators as well as every candidate does on one
#: fold and better on the other (docs/results.md, "The operators a stage flag names")
MAX_OPERATORS = 3


def ranked_families(candidates: Iterable[dict[str, Any]], call: Any = None) -> list[str]:
    """A flagged step's families in the order the stage names them: the family its evidence's type
    was decided by (``call``: a :class:`teller.localize.faulttype.TypeCall`, or None), then its
    ``candidates`` (``{"family": ...}``, by suspiciousness)."""
    first = [call.family] if call is not None and call.fault_type is not None and call.family else []
    return first + [c["family"] for c in candidates]


def named_operators(
    families: Iterable[str],
    suspects: Sequence[tuple[str, str | None]],
    limit: int | None = MAX_OPERATORS,
) -> list[str]:
    """``families`` (a flagged step's: the evidence's first, then its candidates) lifted to
    modules: a ``BE`` family becomes the module families (``suspects``: (family, enclosing
    module's family or None) in suspect order) enclosing its suspects, or stays where none
    does; order kept, duplicates out, at most ``limit`` (None: all)."""
    out: list[str] = []
    for f in families:
        f = str(f)
        if not f.startswith("BE "):
            out.append(f)
            continue
        mods = [m for fam, m in suspects if fam == f and m is not None]
        out.extend(mods or [f])
    named = list(dict.fromkeys(out))
    return named if limit is None else named[:limit]
