"""Episodes: stretches of flagged steps.

A fault lasts: the injected faults of dataset v2 hold for tens of steps, and a slow step of normal
operation mostly stands alone. An *episode* is a maximal run of flagged steps of one rank (one
lane: a process, a run's horizontal steps) whose step numbers lie at most ``gap`` apart (``gap``
2 lets one unflagged step sit inside). Its length is the number of flagged steps it holds.

Two readings follow from a fault lasting. A step next to a long episode needs less evidence to
belong to it (:func:`sustain`: hysteresis, as an edge detector keeps a weak edge pixel joined to
a strong one), and the steps of one episode share one cause, so the episode's type is the one
most of its steps are given (:func:`episode_majority`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

#: largest step-number distance between two flagged steps of one episode
EPISODE_GAP = 2
#: flagged steps an episode holds from which it is taken as a lasting fault (:func:`sustain`, the
#: model's flags read over time; novel steps retyped; the stage's lasting departures with the
#: absolute floor)
MIN_EPISODE = 5
#: numeric-stage flags an episode holds from which a stage flag the model does not flag stays, a
#: fault of a kind the model was not trained on, where the model keeps its own floor and gives the
#: step at least that (``teller_episodes`` rows, `teller diagnose`'s unknown faults; with the
#: absolute floor :data:`MIN_EPISODE`): chosen with that floor on the nested datasets' folds
#: (docs/results.md, "The floor relative to the model, adopted")
STAGE_EPISODE = 4
#: the model's abnormal probability from which a step next to a lasting episode of its flags joins
#: it (:func:`over_time`): even odds, below the abnormal cut each trained model chose for a 10% prior
SUSTAIN_FLOOR = 0.5


def episode_lengths(lane: np.ndarray, step_num: np.ndarray, flag: np.ndarray, gap: int = EPISODE_GAP) -> tuple[np.ndarray, np.ndarray]:
    """Per step (``lane``: its rank's or run's code; ``step_num``; ``flag``): the id of its episode
    (-1 for an unflagged step) and the episode's length (0 unflagged)."""
    lane = np.asarray(lane, np.int64)
    num = np.asarray(step_num, np.int64)
    flag = np.asarray(flag, bool)
    n = len(flag)
    eid = np.full(n, -1, np.int64)
    length = np.zeros(n, np.int64)
    f = np.flatnonzero(flag)
    if not len(f):
        return eid, length
    o = f[np.lexsort((num[f], lane[f]))]
    new = np.r_[True, (lane[o][1:] != lane[o][:-1]) | (num[o][1:] - num[o][:-1] > gap)]
    ids = np.cumsum(new) - 1
    eid[o] = ids
    length[o] = np.bincount(ids)[ids]
    return eid, length


def sustain(lane: np.ndarray, step_num: np.ndarray, flag: np.ndarray, weak: np.ndarray,
            min_flagged: int = MIN_EPISODE, gap: int = EPISODE_GAP) -> np.ndarray:
    """Hysteresis on episodes: the steps ``weak`` (some evidence, not enough to be flagged alone)
    that join a lasting fault. The episodes are drawn over ``flag | weak``; a weak step joins when
    its episode holds at least ``min_flagged`` flagged steps. Returns the joined steps (a mask; a
    flagged step is never among them)."""
    flag = np.asarray(flag, bool)
    weak = np.asarray(weak, bool) & ~flag
    eid, _ = episode_lengths(lane, step_num, flag | weak, gap)
    if not (eid >= 0).any():
        return np.zeros(len(flag), bool)
    strong = np.bincount(eid[flag], minlength=int(eid.max()) + 1)  # flagged steps are all in some episode
    return weak & (strong[np.maximum(eid, 0)] >= min_flagged)


def episode_majority(eid: np.ndarray, code: np.ndarray, weight: np.ndarray | None = None) -> np.ndarray:
    """Per step: the code most of its episode's steps have (``eid`` from :func:`episode_lengths`,
    ``code`` >= 0 a step's answer, -1 none: it does not vote), ties going to the larger summed
    ``weight`` (then the smaller code); -1 outside episodes and in episodes where no step votes."""
    eid = np.asarray(eid, np.int64)
    code = np.asarray(code, np.int64)
    w = np.zeros(len(eid)) if weight is None else np.asarray(weight, float)
    out = np.full(len(eid), -1, np.int64)
    v = np.flatnonzero((eid >= 0) & (code >= 0))
    if not len(v):
        return out
    k = int(code[v].max()) + 1
    pair, inv = np.unique(eid[v] * k + code[v], return_inverse=True)
    count = np.bincount(inv)
    wsum = np.bincount(inv, weights=w[v])
    pe, pc = pair // k, pair % k
    order = np.lexsort((pc, -wsum, -count, pe))  # per episode: most votes, then weight, then code
    head = order[np.r_[True, pe[order][1:] != pe[order][:-1]]]
    win = np.full(int(eid.max()) + 1, -1, np.int64)
    win[pe[head]] = pc[head]
    m = eid >= 0
    out[m] = win[eid[m]]
    return out


def over_time(lane: np.ndarray, step_num: np.ndarray, flag: np.ndarray, score: np.ndarray,
              types: np.ndarray | None = None, operators: list[list[str]] | None = None,
              floor: float = SUSTAIN_FLOOR, min_flagged: int = MIN_EPISODE) -> dict[str, Any]:
    """A model's answers on consecutive steps read over time, as a fault lasts (the rows
    ``teller_mot_family_sustained`` and `teller diagnose` share it). Per step: ``lane`` (its rank's
    or run's code), ``step_num``, the model's ``flag`` and abnormal probability ``score``, its best
    fault type ``types`` ("" none) and the operators it names ``operators`` (those of a flagged step
    count). A step the model gives at least ``floor`` joins an episode holding ``min_flagged`` or
    more of its flags (:func:`sustain`) and takes the operators at least half of that episode's
    flagged steps name; every step of an episode takes the type most of its steps are given (ties:
    the larger summed probability, :func:`episode_majority`); steps outside episodes keep theirs.

    Returns ``flag`` (flagged or joined), ``joined``, ``episode`` (the episode ids over the new
    flags), ``types`` and ``operators`` (None where not given) and ``retyped`` (steps whose type
    changed)."""
    flag = np.asarray(flag, bool)
    score = np.asarray(score, float)
    joined = sustain(lane, step_num, flag, score >= floor, min_flagged)
    now = flag | joined
    eid, _ = episode_lengths(lane, step_num, now)
    ops = None
    if operators is not None:
        ops = [list(o) for o in operators]
        by_ep: dict[int, list[int]] = {}
        for i in np.flatnonzero(flag & np.isin(eid, eid[joined])).tolist():
            by_ep.setdefault(int(eid[i]), []).append(i)
        for i in np.flatnonzero(joined).tolist():
            members = by_ep[int(eid[i])]
            count: dict[str, int] = {}
            for j in members:
                for f in set(ops[j]):
                    count[f] = count.get(f, 0) + 1
            ops[i] = sorted(f for f, c in count.items() if 2 * c >= len(members))
    ft, retyped = types, 0
    if types is not None:
        ft = np.asarray(types, dtype=object)
        names, code = np.unique(ft.astype(str), return_inverse=True)
        code = np.where(ft.astype(str) == "", -1, code)
        win = episode_majority(eid, code, score)
        new = np.where(win >= 0, names[np.maximum(win, 0)], ft).astype(object)
        retyped = int((new != ft).sum())
        ft = new
    return {"flag": now, "joined": joined, "episode": eid, "types": ft, "operators": ops, "retyped": retyped}
