"""Episodes: stretches of flagged steps.

A fault lasts: the injected faults of dataset v2 hold for tens of steps, and a slow step of normal
operation mostly stands alone. An *episode* is a maximal run of flagged steps of one rank (one
lane: a process, a run's horizontal steps) whose step numbers lie at most ``gap`` apart (``gap``
2 lets one unflagged step sit inside). Its length is the number of flagged steps it holds.
"""

from __future__ import annotations

import numpy as np

#: largest step-number distance between two flagged steps of one episode
EPISODE_GAP = 2


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
