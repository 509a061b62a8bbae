"""The steps of a labelled dataset (``teller dataset build``), as the evaluation scores them.

One *step* is what the labels are attached to (docs/design.md §11), as in
``benchmarks/eval_localize_h200.py``:

- ``vertical`` view: one rank's step, one ``(run_id, step_id)`` of ``records.parquet``; its
  request rows are collapsed (the labels are per step);
- ``horizontal`` view: one step number of a tensor-parallel run on all its ranks, one
  ``(run_id, step_id)`` of the horizontal records (``step_id`` is rank 0's step; ``step_ids``
  lists every rank's step, the *units* whose features are combined).

Splits are per record; a step takes the part of one representative record, picked by a hash of
the step's key (:func:`teller.dataset.splits.step_representatives`, the rule the root-cause models
split their units by, so every method is scored on the same test steps as the models).
Labels: ``is_anomaly``, ``fault_type``, ``mechanism`` and ``operator_labels`` of the step's first
record, operator labels renamed with :func:`teller.localize.features.family_names` (the
labeller's own naming: a no-op, kept so the two sides cannot drift) and empty on normal steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from teller.dataset.splits import representatives_of
from teller.errors import InputError, TellerError
from teller.localize.features import family_names
from teller.rundir import str_array

VIEWS = ("vertical", "horizontal")
SPLITS = ("request", "run", "mechanism", "workload")
CATEGORIES = ("communication", "kernel", "memory", "runtime", "scheduling")
#: split codes of :attr:`StepSet.split`
TRAIN, VAL, TEST = 0, 1, 2

_RECORD_COLUMNS = ["record_id", "run_id", "request_id", "step_id", "step_ids", "step_num", "rank", "view", "is_anomaly",
                   "in_window", "fault_type", "mechanism", "operator_labels", "explanation", "log_text"]


def norm_label(label: str) -> str:
    """An operator label renamed with ``family_names`` (``STEP`` has no name and stays)."""
    layer, _, name = label.partition(" ")
    return family_names(layer, [name])[0] if name else label


@dataclass
class StepSet:
    """Steps of one view with their labels, splits and units (vertical rank steps).

    ``unit_key`` (sorted, ``run_code << 40 | step_id``) lists every rank step the view needs;
    step ``i`` is made of the units ``unit_idx[unit_ptr[i]:unit_ptr[i + 1]]`` (one unit per
    vertical step). ``features`` is filled by :func:`teller.baselines.features.step_features`."""

    view: str
    runs: np.ndarray  # run names; run_code indexes them
    run_code: np.ndarray
    step_id: np.ndarray
    step_num: np.ndarray
    is_anomaly: np.ndarray
    in_window: np.ndarray
    fault_type: np.ndarray
    mechanism: np.ndarray
    labels: list[list[str]]
    explanation: list[str]
    n_requests: np.ndarray
    split: dict[str, np.ndarray]  # split column → code per step (TRAIN/VAL/TEST)
    unit_key: np.ndarray
    unit_ptr: np.ndarray
    unit_idx: np.ndarray
    records: int
    dataset: str
    held_out_mechanisms: list[str] = field(default_factory=list)
    features: Any = None
    extra: dict[str, Any] = field(default_factory=dict)  # inputs of other methods (numeric: instances)
    rank: np.ndarray | None = None  # the rank of the step's representative record (vertical: the step's rank)

    @property
    def n(self) -> int:
        return len(self.step_id)

    def subset(self, idx: np.ndarray) -> "StepSet":
        """The steps ``idx`` (units renumbered; features kept only if already computed for them)."""
        idx = np.asarray(idx, np.int64)
        lens = np.diff(self.unit_ptr)[idx]
        units = _ranges(self.unit_ptr[idx], lens)
        old = self.unit_idx[units]
        keep_units, inv = np.unique(old, return_inverse=True)
        return StepSet(
            self.view, self.runs, self.run_code[idx], self.step_id[idx], self.step_num[idx], self.is_anomaly[idx],
            self.in_window[idx], self.fault_type[idx], self.mechanism[idx], [self.labels[i] for i in idx.tolist()],
            [self.explanation[i] for i in idx.tolist()], self.n_requests[idx],
            {k: v[idx] for k, v in self.split.items()}, self.unit_key[keep_units],
            np.concatenate([[0], np.cumsum(lens)]).astype(np.int64), inv.reshape(-1).astype(np.int64), self.records,
            self.dataset, self.held_out_mechanisms, None, rank=None if self.rank is None else self.rank[idx])


def _ranges(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    lens = np.asarray(lens, np.int64)
    if not len(lens) or not lens.sum():
        return np.zeros(0, np.int64)
    offs = np.repeat(np.asarray(starts, np.int64) - np.concatenate([[0], np.cumsum(lens)[:-1]]), lens)
    return offs + np.arange(int(lens.sum()), dtype=np.int64)


def load_steps(ds: str | Path, view: str = "vertical", limit_steps: int | None = None, seed: int = 0) -> StepSet:
    """The steps of ``view`` in dataset ``ds`` (module docstring); ``limit_steps`` keeps a random
    sample of that many steps (drawn with ``seed``)."""
    ds = Path(ds)
    if view not in VIEWS:
        raise TellerError(f"--view {view!r}: expected one of {', '.join(VIEWS)}")
    path = ds / "records.parquet"
    if not path.is_file():
        raise InputError(path, "no such file", "give a dataset folder written by `teller dataset build`")
    names = pq.ParquetFile(path).schema_arrow.names
    splits = [c for c in names if c.startswith("split_")]
    missing = [c for c in _RECORD_COLUMNS if c not in names]
    if missing:
        raise InputError(path, f"lacks columns {missing}", "rebuild the dataset with `teller dataset build`")
    t = pq.read_table(path, columns=_RECORD_COLUMNS + splits)
    t = t.filter(pc.equal(t.column("view"), view)).sort_by("record_id")
    if not t.num_rows:
        raise TellerError(f"{path}: no {view} records; this dataset has no {view} view"
                          + (" (horizontal records need tensor-parallel runs)" if view == "horizontal" else ""))
    run = str_array(t.column("run_id"))
    runs, run_code = np.unique(run, return_inverse=True)
    sid = t.column("step_id").to_numpy().astype(np.int64)
    key = run_code.astype(np.int64) << 40 | sid
    ukey, first, inv = np.unique(key, return_index=True, return_inverse=True)
    inv = inv.reshape(-1)
    n = len(ukey)
    ab = t.column("is_anomaly").to_numpy(zero_copy_only=False).astype(bool)
    if (np.bincount(inv, weights=ab, minlength=n) % np.bincount(inv, minlength=n)).any():
        raise InputError(path, "is_anomaly differs between the request rows of one step", "rebuild the dataset")
    # each step's part is its representative record's (the models' rule, dataset.splits)
    try:
        rep_of = representatives_of(t, inv, n)
    except ValueError:
        raise InputError(path, "the step ids of a step differ between its request rows", "rebuild the dataset") from None
    split = {}
    for s in splits:
        x = str_array(t.column(s))[rep_of]
        split[s] = np.where(x == "test", TEST, np.where(x == "train", TRAIN, VAL)).astype(np.int8)
    is_ab = ab[first]
    raw = t.column("operator_labels").take(pa.array(first)).to_pylist()
    labels = [sorted({norm_label(x) for x in (lab or [])}) if a else [] for lab, a in zip(raw, is_ab, strict=True)]
    # units: the rank steps of every step (vertical: the step itself)
    ids = t.column("step_ids").take(pa.array(first)).combine_chunks()
    lens = pc.list_value_length(ids).to_numpy(zero_copy_only=False).astype(np.int64)
    flat = pc.list_flatten(ids).to_numpy().astype(np.int64)
    ukeys_all = np.repeat(ukey >> 40, lens) << 40 | flat
    unit_key, unit_idx = np.unique(ukeys_all, return_inverse=True)
    held = []
    sheet = ds / "datasheet.json"
    if sheet.is_file():
        import json

        held = json.loads(sheet.read_text()).get("held_out_mechanisms", []) or []
    steps = StepSet(
        view=view, runs=runs, run_code=(ukey >> 40).astype(np.int64), step_id=ukey & ((1 << 40) - 1),
        step_num=t.column("step_num").to_numpy()[first].astype(np.int64), is_anomaly=is_ab,
        in_window=t.column("in_window").to_numpy(zero_copy_only=False)[first].astype(bool),
        fault_type=np.where(is_ab, str_array(t.column("fault_type"))[first], ""),
        mechanism=str_array(t.column("mechanism"))[first], labels=labels,
        explanation=[x if a else "" for x, a in zip(str_array(t.column("explanation"))[first].tolist(), is_ab, strict=True)],
        n_requests=np.bincount(inv, minlength=n).astype(np.int64), split=split, unit_key=unit_key,
        unit_ptr=np.concatenate([[0], np.cumsum(lens)]).astype(np.int64), unit_idx=unit_idx.reshape(-1).astype(np.int64),
        records=int(t.num_rows), dataset=str(ds), held_out_mechanisms=list(held),
        rank=t.column("rank").to_numpy(zero_copy_only=False)[first].astype(np.int64))
    if limit_steps is not None and limit_steps < n:
        if limit_steps < 1:
            raise TellerError(f"--limit-steps {limit_steps}: expected a number of steps ≥ 1")
        pick = np.sort(np.random.default_rng(seed).choice(n, limit_steps, replace=False))
        steps = steps.subset(pick)
    return steps


#: the parts a split can be scored on: ``test``, or ``val`` (to choose a rule's setting on held-out
#: steps before the test part is read)
PARTS = ("test", "val")


def split_masks(steps: StepSet, split: str, part: str = "test") -> tuple[np.ndarray, np.ndarray, str]:
    """Train and scored masks of ``split`` (request, run, mechanism, workload; scored: its
    ``part``, test or val) and a line saying what it holds; a split the dataset cannot provide
    raises a :class:`TellerError` naming why."""
    if split not in SPLITS:
        raise TellerError(f"--split {split!r}: expected one of {', '.join(SPLITS)}")
    if part not in PARTS:
        raise TellerError(f"--part {part!r}: expected one of {', '.join(PARTS)}")
    col = f"split_{split}"
    if col not in steps.split:
        have = sorted(k.removeprefix("split_") for k in steps.split)
        why = ("the dataset has one workload shape (one model and request mix), so there is no workload to hold out; "
               "build a dataset from runs of two or more workloads" if split == "workload" else "rebuild the dataset")
        raise TellerError(f"{steps.dataset}: no {col} column ({why}); this dataset provides the splits {', '.join(have)}")
    code = steps.split[col]
    train, test = code == TRAIN, code == (TEST if part == "test" else VAL)
    if not test.any() or not train.any():
        raise TellerError(f"{steps.dataset}: split {split!r} leaves {int(train.sum())} train and {int(test.sum())} {part} "
                          f"{steps.view} steps; nothing to evaluate" + (" (try without --limit-steps)" if steps.n < 50 else ""))
    return train, test, f"{int(train.sum())} train / {int(test.sum())} {part} steps ({int((test & steps.is_anomaly).sum())} abnormal)"
