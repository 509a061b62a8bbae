"""The RCA models' inputs: one example per step, read from a labelled dataset (docs/design.md §11).

**Why per step.** A dataset record is one request in one step and view, but its labels
(``is_anomaly``, ``fault_type``, ``operator_labels``, ``explanation``) are the step's: they are
constant over the ~12 (up to ~70) records of a step (checked on dataset v1, ``data/h200_v1``, in
git history: 11,001 units, none with two label sets). The records of a step differ only in the
request id and in which of the step's log lines they carry. So an example is a *unit*: a
vertical step ``(run, step_id)`` or a horizontal step ``(run, step_num)`` over its ranks; its log
text is the ordered union of its records' lines.

**Splits per unit.** Run- and mechanism-disjoint parts are already unit-level (a step's records
share a run; a held-out mechanism's steps are all test). ``split_request`` splits requests, and
a step serves requests of every part, so a unit takes the part of one representative record: one of
its records picked by a hash (CRC-32) of the unit's key (run, view, step ids). That is the
dataset's own assignment of that request, and the pick is independent from step to step (the
lowest request id would tie long-running requests' neighbouring steps together), so parts keep
about the 80/10/10 proportions and no step is in two parts; a test step's *other* requests can be
train requests (unavoidable for a model of steps). The same rule applies to all three
protocols (it is exact for run and mechanism).

**Trace.** The unit's steps are serialized from the dataset's subtrees (DFS preorder, self
times), concatenated over ranks for horizontal units (each rank's step a root), and TPE-encoded.
The causal slice (docs/design.md §7) needs a fitted localizer per run, so training uses the whole step
subtree; when a step encodes to more than ``max_trace_tokens`` tokens it is truncated by one
rule: keep tokens in order of (depth ascending, duration descending) up to the limit, then restore
their order. A token's parent is shallower than the token, so a kept token's parent is kept:
the truncated sequence is still a tree (parents remapped). Long steps lose their deepest, shortest
tokens (kernels and runtime calls under the largest operators stay).

**Unit** (``RCAConfig.unit``, :data:`UNITS`). ``"step"``: a step's trace is its STEP subtree
(the rows with ``step_id`` the STEP's node id). ``"iteration"``: the whole engine iteration
(docs/design.md §5.7), i.e. the STEP subtree and the rows of the same run outside every STEP
subtree (``step_id < 0``) that carry the STEP row's ``step_idx``: the schedule/update ranges, GAP
rows and other threads' roots with their subtrees (an outside row keeps its parent where the
parent row is in the table). The roots (the STEP and those rows without a parent in the
iteration) follow each other in start-time order, each with its subtree in DFS order, as one
sequence; a step is still found by (run, STEP node id), so units, splits and predictions are
the same rows. A table without ``step_idx`` (older forests), or a STEP row whose ``step_idx``
is missing or shared, gives the STEP subtree. Truncation ranks the tokens outside the STEP
subtree one level deeper than their depth: the iteration's roots beside the STEP compete with
the STEP's children by duration instead of all coming first (a tensor-parallel iteration has tens
of runtime-call roots of other threads).

**Tokens and operators.** A TPE token stands for a contiguous run of nodes (a subtree
fragment). Its *anchor* is the node that names it as an operator: the first node of the most
operator-like layer (STEP, then FE/OTHER/COMM, then BE, then the rest), shallowest first. The
operator head scores tokens; a selected token's evidence is its anchor node (an index into the
unit's nodes, which :class:`StepInputs` maps to forest node ids and family names) and the other
nodes of the anchor's layer it covers when that layer is one the labels name (FE, COMM, OTHER: a
token merged from a module and its child module names both; :meth:`StepInputs.covered`). Families are
``teller.localize.features.family_names`` (``STEP`` nodes are family ``STEP``), the names the
dataset's ``operator_labels`` use.

**Durations** enter twice: ``log1p(duration / 1 µs)`` and its robust z against the reference
statistics of the token id (median and IQR / 1.349 over the tokens of normal training steps;
:class:`ReferenceStats`, saved in the model directory, refit on another engine's reference with
:meth:`ReferenceStats.fit`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from teller.dataset.splits import step_keys, step_representatives
from teller.errors import InputError, TellerError

#: Fault classes of the fault head: index 0 is "no fault", then the dataset's five categories.
FAULT_TYPES = ("normal", "communication", "kernel", "memory", "runtime", "scheduling")
#: what one unit's trace holds (``RCAConfig.unit``): the STEP subtree, or the whole engine iteration
#: (the STEP subtree and the iteration's schedule/update ranges and GAP rows beside it)
UNITS = ("step", "iteration")
PROTOCOLS = ("request", "run", "mechanism", "workload")  # workload: only datasets of two or more model shapes
SPLIT_PARTS = ("train", "val", "test")
#: anchor priority of a node's layer (lower is more operator-like)
_LAYER_PRIORITY = {"STEP": 0, "FE": 1, "OTHER": 1, "COMM": 1, "BE": 2}
_TS = re.compile(r"^\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d(?:[.,]\d+)?\s*")

_RECORD_COLUMNS = ["record_id", "run_id", "step_id", "step_ids", "step_num", "view", "log_text", "is_anomaly",
                   "fault_type", "mechanism", "operator_labels", "explanation", "split_request", "split_run",
                   "split_mechanism"]


def normalize_log_line(line: str) -> str:
    """A log line as the model reads it: the leading wall-clock timestamp dropped (it differs
    between every run and carries no cause)."""
    return _TS.sub("", line.strip())


# ----------------------------------------------------------------------------------------------
# units


@dataclass
class Units:
    """One row per unit (step and view): labels, log text, splits and the unit's steps."""

    run_id: np.ndarray  # object
    view: np.ndarray  # object
    step_num: np.ndarray  # int64
    step_ids: list[np.ndarray]  # per unit, forest node ids of its steps (one per rank)
    record_id: np.ndarray  # representative record
    n_records: np.ndarray
    is_anomaly: np.ndarray  # bool
    fault: np.ndarray  # int64 into FAULT_TYPES
    mechanism: np.ndarray  # object
    operator_labels: list[list[str]]
    explanation: list[str]
    log_text: list[str]
    splits: dict[str, np.ndarray]  # protocol -> object array of parts
    in_window: np.ndarray | None = None  # bool: a fault window overlaps the unit (None: records without the column)

    def __len__(self) -> int:
        return len(self.run_id)

    def select(self, idx: np.ndarray) -> "Units":
        idx = np.asarray(idx, np.int64)
        pick = idx.tolist()
        return Units(self.run_id[idx], self.view[idx], self.step_num[idx], [self.step_ids[i] for i in pick],
                     self.record_id[idx], self.n_records[idx], self.is_anomaly[idx], self.fault[idx],
                     self.mechanism[idx], [self.operator_labels[i] for i in pick],
                     [self.explanation[i] for i in pick], [self.log_text[i] for i in pick],
                     {k: v[idx] for k, v in self.splits.items()}, None if self.in_window is None else self.in_window[idx])

    def part(self, protocol: str, name: str) -> np.ndarray:
        """Indices of the units in part ``name`` of ``protocol``."""
        if protocol not in self.splits:
            why = (" (this dataset has one model shape, so no split_workload)" if protocol == "workload" else "")
            raise TellerError(f"--split {protocol}: expected one of {', '.join(self.splits)}{why}")
        return np.flatnonzero(self.splits[protocol] == name)


def fault_code(types: Sequence[str], where: str = "records") -> np.ndarray:
    """FAULT_TYPES index of each fault type ('' = normal); an unknown type is an error."""
    lut = {t: i for i, t in enumerate(FAULT_TYPES)}
    lut[""] = 0
    out = np.zeros(len(types), np.int64)
    for i, t in enumerate(types):
        c = lut.get(t or "")
        if c is None:
            raise TellerError(f"{where}: record {i} has fault_type {t!r}; the models know {', '.join(FAULT_TYPES[1:])}"
                              " (rebuild the dataset or extend FAULT_TYPES)")
        out[i] = c
    return out


def read_units(ds: str | Path, records: pa.Table | None = None, runs: Sequence[str] | None = None) -> Units:
    """The units of a dataset folder (``records.parquet``; ``runs``: of these runs only), labels
    checked constant per unit."""
    ds = Path(ds)
    if records is None:
        p = ds / "records.parquet"
        if not p.is_file():
            raise InputError(p, "missing", "give a dataset folder written by `teller dataset build`")
        have = pq.read_schema(p).names
        missing = [c for c in _RECORD_COLUMNS if c not in have]
        if missing:
            raise InputError(p, f"lacks the columns {missing}", "rebuild it with `teller dataset build`")
        cols = _RECORD_COLUMNS + [c for c in ("split_workload", "in_window") if c in have]
        records = pq.read_table(p, columns=cols, filters=[("run_id", "in", list(runs))] if runs else None)
        if not records.num_rows:
            raise TellerError(f"{p}: no records" + (f" of the runs {list(runs)}" if runs else ""))
    t = records.sort_by("record_id")
    run = np.asarray(t.column("run_id").to_pylist(), dtype=object)
    view = np.asarray(t.column("view").to_pylist(), dtype=object)
    sids = t.column("step_ids").combine_chunks()
    s_off = sids.offsets.to_numpy().astype(np.int64)
    s_val = sids.values.to_numpy().astype(np.int64)
    keys = step_keys(run, view, sids)  # unit key: run, view, step ids (one per rank)
    first, inv, counts, rep = step_representatives(keys)
    ab = t.column("is_anomaly").to_numpy(zero_copy_only=False).astype(bool)
    ftype = t.column("fault_type").to_pylist()
    expl = t.column("explanation").to_pylist()
    ops = t.column("operator_labels").to_pylist()
    # labels are step labels: check them constant over each unit
    for name, col in (("is_anomaly", ab), ("fault_type", np.asarray(ftype, dtype=object)),
                      ("explanation", np.asarray(expl, dtype=object))):
        bad = np.flatnonzero(col != col[first][inv])
        if bad.size:
            i = int(bad[0])
            raise TellerError(f"{ds}/records.parquet: record {int(t.column('record_id')[i].as_py())} has a {name} that differs "
                              f"from the other records of its step ({keys[i]!r}); the models read step labels")
    # log text: ordered union of the unit's lines
    logs = t.column("log_text").to_pylist()
    lines: list[list[str]] = [[] for _ in range(len(first))]
    seen: list[set[str]] = [set() for _ in range(len(first))]
    for i in np.flatnonzero(np.asarray([bool(x) for x in logs])).tolist():  # records with lines: few
        u = int(inv[i])
        for ln in logs[i].split("\n"):
            if ln and ln not in seen[u]:
                seen[u].add(ln)
                lines[u].append(ln)
    fi = first.tolist()
    splits = {p: np.asarray(t.column(f"split_{p}").cast(pa.string()).to_pylist(), dtype=object)[rep]
              for p in PROTOCOLS if f"split_{p}" in t.column_names}
    in_window = None
    if "in_window" in t.column_names:  # a unit is in a window when one of its records is
        in_window = np.zeros(len(first), bool)
        np.logical_or.at(in_window, inv, t.column("in_window").to_numpy(zero_copy_only=False).astype(bool))
    return Units(
        run_id=run[first], view=view[first], step_num=t.column("step_num").to_numpy()[first].astype(np.int64),
        step_ids=[s_val[s_off[i]:s_off[i + 1]].copy() for i in fi],
        record_id=t.column("record_id").to_numpy()[rep].astype(np.int64), n_records=counts.astype(np.int64),
        is_anomaly=ab[first], fault=fault_code([ftype[i] for i in fi], f"{ds}/records.parquet"),
        mechanism=np.asarray([t.column("mechanism")[i].as_py() or "" for i in fi], dtype=object),
        operator_labels=[list(ops[i] or []) if ab[i] else [] for i in fi],
        explanation=[expl[i] or "" for i in fi],
        log_text=["\n".join(normalize_log_line(x) for x in ls) for ls in lines],
        splits=splits,
        in_window=in_window,
    )


# ----------------------------------------------------------------------------------------------
# steps of a forest table


@dataclass
class StepForest:
    """The steps of a forest table (a dataset's subtrees, or one run's ``forest.parquet``),
    serialized once: find a step by (run, step node id); per node its family and layer code.
    ``unit``: what a step's sequence holds (:data:`UNITS`, :func:`step_forest`)."""

    seqs: Any  # teller.tpe.serialize.Sequences, one per step
    key: np.ndarray  # run code << 40 | step_id, per step
    runs: list[str]
    node_family: np.ndarray  # int32 per table row, into families
    node_priority: np.ndarray  # int8 per table row (anchor priority of its layer)
    families: list[str]
    node_id: np.ndarray  # int64 per table row (the run's forest node id)
    unit: str = "step"
    #: bool per table row: in a STEP subtree (``step_id >= 0``); empty: every row is
    node_in_step: np.ndarray = field(default_factory=lambda: np.zeros(0, bool))
    #: int64 per table row: its span (end - start, children included; the time the operator labels
    #: sum per family, :mod:`teller.inject.labels`); empty where not known
    node_span: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))

    def find(self, run_ids: Sequence[str], step_ids: np.ndarray) -> np.ndarray:
        lut = {r: i for i, r in enumerate(self.runs)}
        codes = np.asarray([lut.get(r, -1) for r in run_ids], np.int64)
        k = codes << 40 | np.asarray(step_ids, np.int64)
        if not len(self.key):  # a forest without serialized steps: nothing to find
            return np.full(len(k), -1, np.int64)
        order = np.argsort(self.key, kind="stable")
        j = np.minimum(np.searchsorted(self.key[order], k), len(order) - 1)
        hit = (codes >= 0) & (self.key[order][j] == k)
        return np.where(hit, order[j], -1)


def check_unit(unit: str) -> str:
    if unit not in UNITS:
        raise TellerError(f"--unit {unit}: expected one of {', '.join(UNITS)}")
    return unit


def iteration_roots(table: pa.Table, rcode: np.ndarray, gpar: np.ndarray, step_rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The roots of each STEP row's engine iteration outside its STEP subtree (module docstring):
    rows with ``step_id < 0`` and the STEP row's ``step_idx`` (same run) whose parent row is not
    such a row of the same iteration. Returns (root rows, index into ``step_rows`` of each); none
    when the table has no ``step_idx`` or a STEP row's ``step_idx`` is missing or shared."""
    none = np.zeros(0, np.int64), np.zeros(0, np.int64)
    if "step_idx" not in table.column_names or not len(step_rows):
        return none
    six = table.column("step_idx").combine_chunks().fill_null(-1).to_numpy(zero_copy_only=False).astype(np.int64)
    sid = table.column("step_id").to_numpy().astype(np.int64)
    k_step = rcode[step_rows] << 40 | np.maximum(six[step_rows], 0)
    order = np.argsort(k_step, kind="stable")
    ks = k_step[order]
    dup = np.zeros(len(ks), bool)
    dup[1:] = ks[1:] == ks[:-1]
    dup[:-1] |= dup[1:]
    usable = np.ones(len(step_rows), bool)
    usable[order[dup]] = False  # two STEP rows of one iteration: neither gets outside rows
    usable &= six[step_rows] >= 0
    cand = np.flatnonzero((sid < 0) & (six >= 0))
    kc = rcode[cand] << 40 | six[cand]
    pos = np.clip(np.searchsorted(ks, kc), 0, len(ks) - 1)
    hit = ks[pos] == kc
    cand, unit = cand[hit], order[pos[hit]]
    keep = usable[unit]
    cand, unit = cand[keep], unit[keep]
    member = np.full(len(sid), -1, np.int64)
    member[cand] = unit
    p = gpar[cand]
    top = (p < 0) | (member[np.maximum(p, 0)] != unit)
    return cand[top], unit[top]


def step_forest(table: pa.Table, run_id: str | None = None, normalizer: Any = None, unit: str = "step") -> StepForest:
    """Serialize every step (rows with ``node_id == step_id``) of a forest table.

    ``table`` holds whole step blocks ``[step_id, step_id + size)`` in DFS order, each with its
    ``run_id`` (a dataset's subtrees) or, for one run's forest, ``run_id`` names the run.
    ``unit="iteration"``: each step's sequence is its engine iteration, the STEP subtree and the
    subtrees of the iteration's rows outside it (:func:`iteration_roots`), roots in start-time
    order; a table without ``step_idx`` gives the STEP subtrees."""
    from teller.forest import Forest, family_names
    from teller.tpe.serialize import serialize_steps

    check_unit(unit)
    if "run_id" in table.column_names:
        run = table.column("run_id").combine_chunks()
        if not pa.types.is_dictionary(run.type):
            run = run.dictionary_encode()
        rcode = run.indices.to_numpy(zero_copy_only=False).astype(np.int64)
        runs = [str(x) for x in run.dictionary.to_pylist()]
    else:
        rcode = np.zeros(table.num_rows, np.int64)
        runs = [run_id or "run"]
    nid = table.column("node_id").to_numpy().astype(np.int64)
    par = table.column("parent_id").to_numpy().astype(np.int64)
    sid = table.column("step_id").to_numpy().astype(np.int64)
    row = np.arange(len(nid), dtype=np.int64)
    inside = (par >= sid) & (nid != sid) & (sid >= 0)
    # a row outside the steps keeps its parent where the parent's row is in the table: the block
    # layout puts it (node id difference) rows above, in the same run
    prow = row - (nid - par)
    pc_ = np.clip(prow, 0, max(len(nid) - 1, 0))
    outside = (sid < 0) & (par >= 0) & (prow >= 0) & (prow < row)
    if len(nid):
        outside &= (nid[pc_] == par) & (rcode[pc_] == rcode)
    gpar = np.where(inside | outside, prow, -1)
    # node ids repeat across runs: the forest is numbered by row (parents as rows)
    t2 = table.set_column(table.column_names.index("parent_id"), "parent_id", pa.array(gpar))
    t2 = t2.set_column(t2.column_names.index("node_id"), "node_id", pa.array(row))
    forest = Forest.from_table(t2, path="subtrees")
    roots = np.flatnonzero((nid == sid) & (sid >= 0))
    extra, extra_of = (iteration_roots(table, rcode, gpar, roots) if unit == "iteration"
                       else (np.zeros(0, np.int64), np.zeros(0, np.int64)))
    if not len(extra):
        seqs = serialize_steps(forest, roots, "self", normalizer)
    else:
        seqs = _iteration_sequences(forest, roots, extra, extra_of, normalizer)
    # families per row from the distinct (layer, name) pairs
    lay = table.column("layer").combine_chunks()
    nam = table.column("name").combine_chunks()
    lay = lay if pa.types.is_dictionary(lay.type) else lay.dictionary_encode()
    nam = nam if pa.types.is_dictionary(nam.type) else nam.dictionary_encode()
    li = lay.indices.fill_null(len(lay.dictionary)).to_numpy(zero_copy_only=False).astype(np.int64)
    ni = nam.indices.fill_null(len(nam.dictionary)).to_numpy(zero_copy_only=False).astype(np.int64)
    ld = [str(x) for x in lay.dictionary.to_pylist()] + ["OTHER"]
    nd = [str(x) if x is not None else "" for x in nam.dictionary.to_pylist()] + [""]
    pair = li * (len(nd) + 1) + ni
    present = np.bincount(pair, minlength=len(ld) * (len(nd) + 1)) > 0  # dense: the dictionaries are small
    up = np.flatnonzero(present)
    lut = np.zeros(len(present), np.int64)
    lut[up] = np.arange(len(up))
    pinv = lut[pair]
    fam = []
    prio = []
    for p in up.tolist():
        L, N = ld[p // (len(nd) + 1)], nd[p % (len(nd) + 1)]
        fam.append("STEP" if L == "STEP" else family_names(L, [N])[0])
        prio.append(_LAYER_PRIORITY.get(L, 3))
    families, fcode = np.unique(np.asarray(fam, dtype=object).astype(str), return_inverse=True)
    return StepForest(seqs, rcode[roots] << 40 | sid[roots], runs, fcode[pinv].astype(np.int32),
                      np.asarray(prio, np.int8)[pinv], [str(f) for f in families], nid, unit, sid >= 0,
                      forest.dur_ns.astype(np.int64))


def _iteration_sequences(forest: Any, step_rows: np.ndarray, extra: np.ndarray, extra_of: np.ndarray,
                         normalizer: Any) -> Any:
    """One sequence per STEP row: the subtrees of its iteration's roots (``extra``, of STEP
    ``extra_of``) and its own, roots in (start time, row) order, each root's subtree in DFS order."""
    from teller.tpe.serialize import Sequences, check_preorder, serialize_steps

    n = len(step_rows)
    piece_root = np.concatenate([step_rows, extra])
    piece_unit = np.concatenate([np.arange(n, dtype=np.int64), extra_of])
    pieces = serialize_steps(forest, piece_root, "self", normalizer)
    order = np.lexsort((piece_root, forest.start[piece_root], piece_unit))
    seqs = pieces.select(order)
    del pieces  # held once: a node per row of every iteration
    pu = piece_unit[order]
    plen = seqs.lengths()
    # parents: local to the piece -> local to the unit (each piece starts a root)
    u_len = np.bincount(pu, weights=plen, minlength=n).astype(np.int64)
    offsets = np.zeros(n + 1, np.int64)
    np.cumsum(u_len, out=offsets[1:])
    shift = np.cumsum(plen) - plen - offsets[pu]  # piece start within its unit
    par = seqs.parent.astype(np.int64)
    par += np.repeat(shift, plen)
    par[seqs.parent < 0] = -1
    check_preorder(par, seqs.depth, offsets, "iteration units")
    return Sequences(seqs.symbols, seqs.codes, par.astype(np.int32), seqs.depth, seqs.duration, offsets,
                     seqs.node_id, step_rows.astype(np.int64), checked=True)


# ----------------------------------------------------------------------------------------------
# model inputs


#: layers whose nodes a token names together (:meth:`StepInputs.covered`): those the operator labels name
COVER_LAYERS = ("FE", "COMM", "OTHER")


@dataclass
class StepInputs:
    """TPE-encoded steps and their log text, columnar: unit ``i`` is tokens
    ``offsets[i]:offsets[i+1]`` of the flat arrays and nodes ``node_offsets[i]:node_offsets[i+1]``.

    Per token: ``input_ids``, ``parent_idx`` (local, -1 root), ``depth``, ``duration`` (ns),
    ``anchor`` (index of its anchor node among the unit's nodes) and ``family`` (index into
    ``families``, the anchor's operator family). Per node: ``node_id`` (forest node id) and
    ``node_family``. ``log_text`` per unit. ``keys``: run, view, step ids (provenance)."""

    input_ids: np.ndarray
    parent_idx: np.ndarray
    depth: np.ndarray
    duration: np.ndarray
    anchor: np.ndarray
    family: np.ndarray
    offsets: np.ndarray
    node_id: np.ndarray
    node_family: np.ndarray
    node_offsets: np.ndarray
    families: list[str]
    log_text: list[str]
    run_id: list[str] = field(default_factory=list)
    view: list[str] = field(default_factory=list)
    step_ids: list[list[int]] = field(default_factory=list)
    truncated: np.ndarray = field(default_factory=lambda: np.zeros(0, bool))
    full_tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # per unit, before truncation
    #: per token: its first node (index among the unit's nodes) and how many nodes it covers (a
    #: token is a contiguous run of its step's nodes); empty where not known
    first_node: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    span: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    #: per node: its self time (ns), for the family slots (:func:`family_slots`); empty where not known
    node_duration: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    #: per node: its span (ns, children included), for the family slots; empty where not known
    node_span: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def tokens(self, i: int) -> slice:
        return slice(int(self.offsets[i]), int(self.offsets[i + 1]))

    def candidates(self, i: int) -> list[str]:
        """The operator families of the nodes the unit's tokens name (:meth:`covered`: their
        anchors, and the nodes of a label layer a token covers beside its anchor): what evidence
        may name."""
        s = self.tokens(i)
        out = {self.families[j] for j in np.unique(self.family[s]).tolist()}
        if len(self.span):
            no = int(self.node_offsets[i])
            label_layer = np.isin(self.family_layer, COVER_LAYERS)[self.family[s]]
            for t in np.flatnonzero(label_layer & (self.span[s] > 1)).tolist():
                out.update(self.families[int(self.node_family[no + n])] for n in self.covered(i, t))
        return sorted(out)

    @cached_property
    def family_layer(self) -> np.ndarray:
        """Per family, its layer (the name's first word), computed once."""
        return np.asarray([f.split(" ", 1)[0] for f in self.families], dtype=object)

    def select(self, idx: np.ndarray) -> "StepInputs":
        from teller.tpe.serialize import ranges

        idx = np.asarray(idx, np.int64)
        rows = ranges(self.offsets[idx], self.offsets[idx + 1])
        nrows = ranges(self.node_offsets[idx], self.node_offsets[idx + 1])
        off = np.concatenate([[0], np.cumsum(self.offsets[idx + 1] - self.offsets[idx])]).astype(np.int64)
        noff = np.concatenate([[0], np.cumsum(self.node_offsets[idx + 1] - self.node_offsets[idx])]).astype(np.int64)
        pick = idx.tolist()

        def sub(x: list) -> list:
            return [x[i] for i in pick] if x else []

        return StepInputs(self.input_ids[rows], self.parent_idx[rows], self.depth[rows], self.duration[rows],
                          self.anchor[rows], self.family[rows], off, self.node_id[nrows], self.node_family[nrows], noff,
                          self.families, sub(self.log_text), sub(self.run_id), sub(self.view), sub(self.step_ids),
                          self.truncated[idx] if len(self.truncated) else self.truncated,
                          self.full_tokens[idx] if len(self.full_tokens) else self.full_tokens,
                          self.first_node[rows] if len(self.first_node) else self.first_node,
                          self.span[rows] if len(self.span) else self.span,
                          self.node_duration[nrows] if len(self.node_duration) else self.node_duration,
                          self.node_span[nrows] if len(self.node_span) else self.node_span)

    def covered(self, i: int, token: int) -> list[int]:
        """The nodes (indices among unit ``i``'s nodes) token ``token`` of the unit covers whose
        layer is its anchor's (a token merged from a module and its first child module names
        both), the anchor first; the anchor alone where spans are not known or the anchor is not of
        a layer the operator labels name (FE, COMM, OTHER)."""
        t = int(self.offsets[i]) + int(token)
        a = int(self.anchor[t])
        if not len(self.span):
            return [a]
        no = int(self.node_offsets[i])
        layer = self.family_layer[int(self.node_family[no + a])]
        if layer not in COVER_LAYERS:
            return [a]
        f0 = int(self.first_node[t])
        n = np.arange(f0, f0 + int(self.span[t]))
        return [a] + n[(self.family_layer[self.node_family[no + n]] == layer) & (n != a)].tolist()


def truncate_order(depth: np.ndarray, duration: np.ndarray, limit: int, outside: np.ndarray | None = None) -> np.ndarray:
    """Positions kept by the truncation rule (module docstring): the first ``limit`` tokens in
    order of (depth ascending, duration descending, position), returned in position order.
    ``outside`` (iteration units): tokens outside the STEP subtree rank one level deeper (an
    iteration's roots beside the STEP compete with the STEP's children)."""
    if len(depth) <= limit:
        return np.arange(len(depth))
    d = np.asarray(depth, np.int64)
    if outside is not None:
        d = d + np.asarray(outside, bool)
    order = np.lexsort((np.arange(len(depth)), -np.asarray(duration, np.int64), d))
    return np.sort(order[:limit])


def encode_units(sf: StepForest, tok: Any, run_ids: Sequence[str], step_ids: Sequence[np.ndarray],
                 log_text: Sequence[str], max_trace_tokens: int, views: Sequence[str] | None = None) -> StepInputs:
    """TPE-encode units (each a list of step node ids, one per rank) into :class:`StepInputs`."""
    from teller.tpe.serialize import ranges

    n = len(step_ids)
    per = np.asarray([len(s) for s in step_ids], np.int64)
    unit_of_piece = np.repeat(np.arange(n), per)
    flat = np.concatenate([np.asarray(s, np.int64) for s in step_ids]) if n else np.zeros(0, np.int64)
    st = sf.find(np.asarray(run_ids, dtype=object)[unit_of_piece].tolist(), flat)
    if (st < 0).any():
        j = int(np.flatnonzero(st < 0)[0])
        raise TellerError(f"unit {int(unit_of_piece[j])}: step {int(flat[j])} of run {run_ids[int(unit_of_piece[j])]!r} "
                          "is not in the subtrees/forest; rebuild the dataset with `teller dataset build`")
    uniq, inv = np.unique(st, return_inverse=True)
    seqs = sf.seqs.select(uniq)
    enc = tok.encode_batch(seqs)
    # node rows (table rows) of each distinct step, and per token its node range within the step
    s_nodes = seqs.lengths()
    tl = tok.token_length(enc.input_ids.astype(np.int64))
    tok_seq = np.repeat(np.arange(len(uniq)), enc.lengths())
    cs = np.cumsum(tl) - tl  # token start, counted over the whole batch
    start_in_step = cs - (np.cumsum(s_nodes) - s_nodes)[tok_seq]
    # anchor of each token: min (priority, depth, position) over its nodes
    node_rows = seqs.node_id  # table rows of the distinct steps' nodes, concatenated
    n_prio = sf.node_priority[node_rows].astype(np.int64)
    n_pos = np.arange(len(node_rows)) - np.repeat(seqs.offsets[:-1], s_nodes)
    key = (n_prio << 40) | (seqs.depth.astype(np.int64) << 24) | n_pos
    tok_first_node = seqs.offsets[:-1][tok_seq] + start_in_step
    best = np.minimum.reduceat(key, tok_first_node) if len(key) else np.zeros(0, np.int64)
    anchor_in_step = best & ((1 << 24) - 1)
    # assemble units: pieces one after the other
    piece_tok = enc.lengths()[inv]
    piece_nodes = s_nodes[inv]
    rows = ranges(enc.offsets[inv], enc.offsets[inv + 1])
    nrows = ranges(seqs.offsets[:-1][inv], seqs.offsets[1:][inv])
    u_tok = np.bincount(unit_of_piece, weights=piece_tok, minlength=n).astype(np.int64)
    u_nodes = np.bincount(unit_of_piece, weights=piece_nodes, minlength=n).astype(np.int64)
    toff = np.concatenate([[0], np.cumsum(u_tok)]).astype(np.int64)
    noff = np.concatenate([[0], np.cumsum(u_nodes)]).astype(np.int64)
    tok_before = np.cumsum(piece_tok) - piece_tok - toff[unit_of_piece]
    node_before = np.cumsum(piece_nodes) - piece_nodes - noff[unit_of_piece]
    p = enc.parent_idx[rows].astype(np.int64)
    p = np.where(p >= 0, p + np.repeat(tok_before, piece_tok), -1)
    anchor = anchor_in_step[rows] + np.repeat(node_before, piece_tok)
    first_node = start_in_step[rows] + np.repeat(node_before, piece_tok)
    span = tl[rows].astype(np.int64)
    ids = enc.input_ids[rows].astype(np.int64)
    dep = enc.depth[rows].astype(np.int64)
    dur = enc.duration[rows].astype(np.int64)
    node_tab = node_rows[nrows]
    node_dur = seqs.duration[nrows].astype(np.int64)
    node_fam = sf.node_family[node_tab].astype(np.int64)
    tok_node = node_tab[anchor + np.repeat(noff[:-1], u_tok)]  # table row of each token's anchor
    fam = node_fam[anchor + np.repeat(noff[:-1], u_tok)]
    out_tok = ~sf.node_in_step[tok_node] if sf.unit == "iteration" and len(sf.node_in_step) else None
    # truncation (few units: the long multi-rank and communication steps)
    full = u_tok.copy()
    trunc = np.zeros(n, bool)
    keep_mask = np.ones(len(ids), bool)
    new_par = p.copy()
    for i in np.flatnonzero(u_tok > max_trace_tokens).tolist():
        a, b = int(toff[i]), int(toff[i + 1])
        kept = truncate_order(dep[a:b], dur[a:b], max_trace_tokens, out_tok[a:b] if out_tok is not None else None)
        remap = np.full(b - a, -1, np.int64)
        remap[kept] = np.arange(len(kept))
        lp = p[a:b]
        new_par[a:b] = np.where(lp >= 0, remap[np.maximum(lp, 0)], -1)
        m = np.zeros(b - a, bool)
        m[kept] = True
        keep_mask[a:b] = m
        trunc[i] = True
    if trunc.any():
        unit_of_tok = np.repeat(np.arange(n), u_tok)
        u_tok = np.bincount(unit_of_tok[keep_mask], minlength=n).astype(np.int64)
        toff = np.concatenate([[0], np.cumsum(u_tok)]).astype(np.int64)
        ids, dep, dur, anchor, fam, new_par, first_node, span = (
            x[keep_mask] for x in (ids, dep, dur, anchor, fam, new_par, first_node, span))
    return StepInputs(ids.astype(np.int32), new_par.astype(np.int32), dep.astype(np.int32), dur, anchor.astype(np.int64),
                      fam.astype(np.int32), toff, sf.node_id[node_tab], node_fam.astype(np.int32), noff, sf.families,
                      list(log_text), list(run_ids), list(views) if views is not None else [""] * n,
                      [np.asarray(s).tolist() for s in step_ids], trunc, full, first_node.astype(np.int64), span,
                      node_dur, sf.node_span[node_tab] if len(sf.node_span) else np.zeros(0, np.int64))


#: layers whose families a unit's family slots hold (:func:`family_slots`): those the operator labels name
LABEL_LAYERS = ("FE", "COMM", "OTHER", "GAP", "STEP")


@dataclass
class FamilySlots:
    """Per unit, the operator families it may be blamed on (the families of its nodes in
    :data:`LABEL_LAYERS`), columnar: unit ``i``'s slots are ``offsets[i]:offsets[i+1]``, each with
    its family (index into :attr:`StepInputs.families`), the summed self time of its nodes (ns),
    their count and their summed span (ns, children included: the time the operator labels compare
    with the family's reference p99; empty where the inputs carry no node spans). ``member_tok``/``member_slot`` (unit ``i``'s pairs at
    ``member_offsets[i]:member_offsets[i+1]``, both local to the unit) say which of the unit's
    tokens stand for which slot: a token for its anchor's family and for every family of a label
    layer among the nodes it covers."""

    offsets: np.ndarray
    family: np.ndarray
    duration: np.ndarray
    count: np.ndarray
    member_tok: np.ndarray
    member_slot: np.ndarray
    member_offsets: np.ndarray
    span: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))

    def slots(self, i: int) -> slice:
        return slice(int(self.offsets[i]), int(self.offsets[i + 1]))

    def members(self, i: int) -> slice:
        return slice(int(self.member_offsets[i]), int(self.member_offsets[i + 1]))


def family_slots(inp: StepInputs) -> FamilySlots:
    """The family slots of every unit of ``inp`` (:class:`FamilySlots`), from its nodes (their
    families and self times, every node, also those of truncated tokens) and its tokens."""
    from teller.tpe.serialize import ranges

    n, F = len(inp), max(1, len(inp.families))
    label = np.isin(inp.family_layer, LABEL_LAYERS) if len(inp.families) else np.zeros(0, bool)
    n_nodes = np.diff(inp.node_offsets)
    node_unit = np.repeat(np.arange(n, dtype=np.int64), n_nodes)
    nf = inp.node_family.astype(np.int64)
    keep = label[nf] if len(nf) else np.zeros(0, bool)
    key = node_unit[keep] * F + nf[keep]
    dur = inp.node_duration[keep] if len(inp.node_duration) else np.zeros(int(keep.sum()), np.int64)
    skey, inv = np.unique(key, return_inverse=True)
    sdur = np.bincount(inv, weights=dur.astype(np.float64), minlength=len(skey)).astype(np.int64)
    scnt = np.bincount(inv, minlength=len(skey)).astype(np.int64)
    sspan = (np.bincount(inv, weights=inp.node_span[keep].astype(np.float64), minlength=len(skey)).astype(np.int64)
             if len(inp.node_span) else np.zeros(0, np.int64))
    sunit = skey // F
    offsets = np.searchsorted(sunit, np.arange(n + 1)).astype(np.int64)
    # token -> slot pairs: each token's anchor family, and the label-layer families of the nodes it covers
    n_tok = np.diff(inp.offsets)
    tok_unit = np.repeat(np.arange(n, dtype=np.int64), n_tok)
    tok_local = np.arange(len(inp.input_ids), dtype=np.int64) - np.repeat(inp.offsets[:-1], n_tok)
    pu, pt, pk = [tok_unit], [tok_local], [tok_unit * F + inp.family.astype(np.int64)]
    if len(inp.span):
        multi = np.flatnonzero(inp.span > 1)
        if len(multi):
            first = inp.first_node[multi] + inp.node_offsets[tok_unit[multi]]
            rows = ranges(first, first + inp.span[multi])
            rep = np.repeat(multi, inp.span[multi])
            pu.append(tok_unit[rep])
            pt.append(tok_local[rep])
            pk.append(tok_unit[rep] * F + nf[rows])
    pu_, pt_, pk_ = np.concatenate(pu), np.concatenate(pt), np.concatenate(pk)
    j = np.clip(np.searchsorted(skey, pk_), 0, max(len(skey) - 1, 0))
    hit = (skey[j] == pk_) if len(skey) else np.zeros(len(pk_), bool)
    pair = np.unique(np.stack([pu_[hit], pt_[hit], j[hit]], 1), axis=0) if hit.any() else np.zeros((0, 3), np.int64)
    moff = np.searchsorted(pair[:, 0], np.arange(n + 1)).astype(np.int64)
    return FamilySlots(offsets, (skey % F).astype(np.int64), sdur, scnt, pair[:, 1].astype(np.int64),
                       (pair[:, 2] - offsets[pair[:, 0]]).astype(np.int64), moff, sspan)


#: layers whose nodes a unit's statistics count and sum (:func:`unit_statistics`)
UNIT_STAT_LAYERS = ("STEP", "FE", "BE", "COMM", "RT", "DRV", "K", "MEM", "SYNC", "OTHER", "GAP")
#: the columns of :func:`unit_statistics`: per layer the mean self time and mean span of its nodes,
#: its share of the unit's nodes and of their summed self time; then the unit's rank count
UNIT_STAT_COLUMNS = tuple(f"{k}_{lay}" for k in ("self_mean", "span_mean", "n_share", "self_share")
                          for lay in UNIT_STAT_LAYERS) + ("ranks",)


def unit_statistics(inp: StepInputs) -> np.ndarray:
    """Per unit (float64, :data:`UNIT_STAT_COLUMNS`): for each layer of :data:`UNIT_STAT_LAYERS`,
    ``log1p`` of its nodes' mean self time and mean span (µs, children included; 0 without
    nodes), its share of the unit's nodes and its share of their summed self time; then ``log1p``
    of the rank count. Every node of the unit counts, also those of truncated tokens: the layer
    mix the numeric stage and the statistical baselines read, which the tokens' durations spread
    over the sequence. Means and shares, not sums: a model with twice the decoder layers has twice
    the nodes of each repeated layer at the same means and in the same proportions, so the
    statistics of one model shape mostly read on another (the workload split), and a horizontal
    unit's ranks read on a one-rank scale."""
    n, L = len(inp), len(UNIT_STAT_LAYERS)
    if len(inp.node_family) and (len(inp.node_duration) != len(inp.node_family) or len(inp.node_span) != len(inp.node_family)):
        raise TellerError("the units carry no node times (a forest without node spans); rebuild the inputs with "
                          "teller.rca.data.encode_units")
    lut = {lay: k for k, lay in enumerate(UNIT_STAT_LAYERS)}
    fam_layer = np.asarray([lut.get(str(x), -1) for x in inp.family_layer.tolist()], np.int64)
    node_unit = np.repeat(np.arange(n, dtype=np.int64), np.diff(inp.node_offsets))
    layer = fam_layer[inp.node_family.astype(np.int64)] if len(inp.node_family) else np.zeros(0, np.int64)
    ok = layer >= 0
    key = node_unit[ok] * L + layer[ok]
    size = n * L
    cnt = np.bincount(key, minlength=size).astype(np.float64).reshape(n, L)
    own = np.bincount(key, weights=np.maximum(inp.node_duration[ok], 0).astype(np.float64), minlength=size).reshape(n, L)
    span = np.bincount(key, weights=np.maximum(inp.node_span[ok], 0).astype(np.float64), minlength=size).reshape(n, L)
    ranks = np.asarray([max(1, len(s)) for s in inp.step_ids] if inp.step_ids else [1] * n, np.float64)
    per = np.maximum(cnt, 1.0)
    cols = [np.log1p(own / per / 1e3), np.log1p(span / per / 1e3), cnt / np.maximum(cnt.sum(1, keepdims=True), 1.0),
            own / np.maximum(own.sum(1, keepdims=True), 1.0), np.log1p(ranks)[:, None]]
    return np.concatenate(cols, 1)


# ----------------------------------------------------------------------------------------------
# targets


def label_targets(family: np.ndarray, offsets: np.ndarray, families: Sequence[str],
                  labels: Sequence[Sequence[str]]) -> np.ndarray:
    """Per row (unit ``i``'s rows are ``offsets[i]:offsets[i+1]``): 1 when its family (an index
    into ``families``) is one of the unit's operator labels."""
    fam_idx = {f: i for i, f in enumerate(families)}
    out = np.zeros(len(family), np.float32)
    for i, lab in enumerate(labels):
        if not lab:
            continue
        codes = [fam_idx[f] for f in lab if f in fam_idx]
        if codes:
            s = slice(int(offsets[i]), int(offsets[i + 1]))
            out[s] = np.isin(family[s], codes)
    return out


def operator_targets(inp: StepInputs, labels: Sequence[Sequence[str]]) -> np.ndarray:
    """Per token: 1 when its anchor's family is one of the unit's operator labels."""
    return label_targets(inp.family, inp.offsets, inp.families, labels)


def slot_targets(slots: FamilySlots, families: Sequence[str], labels: Sequence[Sequence[str]]) -> np.ndarray:
    """Per family slot: 1 when its family is one of its unit's operator labels."""
    return label_targets(slots.family, slots.offsets, families, labels)


# ----------------------------------------------------------------------------------------------
# reference statistics


def median_scale(x: np.ndarray, floor: float = 0.05, axis: int | None = None) -> tuple[Any, Any]:
    """The median of ``x`` and its robust scale, IQR/1.349 and at least ``floor`` (over ``axis``;
    floats for ``axis=None``): the reference statistics' one rule."""
    q1, q2, q3 = np.percentile(x, [25, 50, 75], axis=axis)
    return q2, np.maximum((q3 - q1) / 1.349, floor)


@dataclass
class ReferenceStats:
    """Per trace token id: median and robust scale of ``log1p(duration / 1 µs)`` over the tokens
    of normal reference steps (ids seen fewer than ``min_count`` times use the pooled values)."""

    median: np.ndarray
    scale: np.ndarray
    count: np.ndarray
    pooled: tuple[float, float] = (0.0, 1.0)
    source: str = ""
    #: per operator family (by name; :meth:`fit_families`): median and robust scale of the log
    #: summed self time and of the log node count of its slot, and with ``span`` of its log summed
    #: span, over the normal units holding it (4 or 6 columns); ``family_pooled`` for a family not
    #: seen there
    family_names: list[str] = field(default_factory=list)
    family_stats: np.ndarray = field(default_factory=lambda: np.zeros((0, 4)))
    family_pooled: tuple[float, ...] = (0.0, 1.0, 0.0, 1.0)
    #: per column of :data:`UNIT_STAT_COLUMNS` (:meth:`fit_units`): median and robust scale over
    #: the normal units; empty: the model reads no unit statistics
    unit_stats: np.ndarray = field(default_factory=lambda: np.zeros((0, 2)))

    @staticmethod
    def log_duration(duration_ns: np.ndarray) -> np.ndarray:
        return np.log1p(np.maximum(np.asarray(duration_ns, np.float64), 0.0) / 1e3)

    @classmethod
    def fit(cls, input_ids: np.ndarray, duration_ns: np.ndarray, vocab_size: int, min_count: int = 5,
            source: str = "") -> "ReferenceStats":
        ids = np.asarray(input_ids, np.int64)
        x = cls.log_duration(duration_ns)
        med = np.zeros(vocab_size)
        sc = np.ones(vocab_size)
        cnt = np.bincount(ids, minlength=vocab_size)[:vocab_size] if len(ids) else np.zeros(vocab_size, np.int64)
        if len(x):
            pooled = tuple(float(v) for v in median_scale(x, 0.1))
        else:
            pooled = (0.0, 1.0)
        med[:] = pooled[0]
        sc[:] = pooled[1]
        if len(ids):
            order = np.lexsort((x, ids))
            si, sx = ids[order], x[order]
            u, start, c = np.unique(si, return_index=True, return_counts=True)
            ok = c >= min_count
            for q, dst in ((0.5, med),):
                dst[u[ok]] = sx[start[ok] + np.floor(q * (c[ok] - 1)).astype(np.int64)]
            lo = sx[start[ok] + np.floor(0.25 * (c[ok] - 1)).astype(np.int64)]
            hi = sx[start[ok] + np.floor(0.75 * (c[ok] - 1)).astype(np.int64)]
            sc[u[ok]] = np.maximum((hi - lo) / 1.349, 0.05)
        return cls(med, sc, cnt.astype(np.int64), pooled, source)

    def z(self, input_ids: np.ndarray, duration_ns: np.ndarray) -> np.ndarray:
        ids = np.clip(np.asarray(input_ids, np.int64), 0, len(self.median) - 1)
        return np.clip((self.log_duration(duration_ns) - self.median[ids]) / self.scale[ids], -20.0, 20.0)

    @property
    def family_span(self) -> bool:
        """The family statistics include the slots' summed span (:meth:`fit_families` with ``span``)."""
        return len(self.family_pooled) == 6

    @staticmethod
    def _slot_logs(slots: "FamilySlots", span: bool = False) -> list[np.ndarray]:
        out = [np.log1p(np.maximum(slots.duration.astype(np.float64), 0.0) / 1e3),
               np.log1p(slots.count.astype(np.float64))]
        if span:
            if len(slots.span) != len(slots.duration):
                raise TellerError("the family slots carry no spans (a forest without node spans); "
                                  "rebuild the inputs with teller.rca.data.encode_units")
            out.append(np.log1p(np.maximum(slots.span.astype(np.float64), 0.0) / 1e3))
        return out

    def fit_families(self, slots: "FamilySlots", families: Sequence[str], min_count: int = 5,
                     span: bool = False) -> "ReferenceStats":
        """Per family of ``families`` (``slots.family`` indexes it), the median and robust scale
        (IQR/1.349, at least 0.05) of its slots' log summed self time and log node count, and with
        ``span`` of their log summed span; slots of normal units only are given. Families with fewer
        than ``min_count`` slots are left out (they take the pooled values)."""
        logs = self._slot_logs(slots, span)
        fam = slots.family.astype(np.int64)

        def robust(x: np.ndarray) -> tuple[float, float]:
            return tuple(float(v) for v in median_scale(x))

        width = 2 * len(logs)
        self.family_pooled = (tuple(v for x in logs for v in robust(x)) if len(fam)
                              else (0.0, 1.0) * len(logs))
        names, stats = [], []
        for f in np.unique(fam).tolist():
            m = fam == f
            if m.sum() >= min_count:
                names.append(str(families[f]))
                stats.append([v for x in logs for v in robust(x[m])])
        self.family_names, self.family_stats = names, np.asarray(stats, np.float64).reshape(-1, width)
        return self

    def family_rows(self, families: Sequence[str]) -> np.ndarray:
        """Per family name of ``families``, its row in :attr:`family_names` (−1: never seen)."""
        lut = {f: k for k, f in enumerate(self.family_names)}
        return np.asarray([lut.get(str(f), -1) for f in families], np.int64)

    def family_features(self, slots: "FamilySlots", families: Sequence[str]) -> np.ndarray:
        """Per slot (float32, 4 or 6 columns): log summed self time / 8, its robust z / 4, log node
        count / 4 and its robust z / 4, and where the statistics hold spans (:attr:`family_span`)
        log summed span / 8 and its robust z / 4, against :meth:`fit_families`' statistics of the
        slot's family."""
        logs = self._slot_logs(slots, self.family_span)
        r = self.family_rows(families)[slots.family.astype(np.int64)] if len(slots.family) else np.zeros(0, np.int64)
        st = np.vstack([self.family_stats, np.asarray(self.family_pooled, np.float64)[None]])[r]  # -1: the pooled row
        cols = []
        for k, (x, scale) in enumerate(zip(logs, (8.0, 4.0, 8.0)[:len(logs)], strict=True)):
            z = np.clip((x - st[:, 2 * k]) / st[:, 2 * k + 1], -20.0, 20.0)
            cols += [x / scale, z / 4.0]
        return np.stack(cols, 1).astype(np.float32)

    def fit_units(self, stats: np.ndarray) -> "ReferenceStats":
        """Per column of ``stats`` (:func:`unit_statistics` of normal units), the median and robust
        scale (IQR/1.349, at least 0.05); no units: the pooled values 0 and 1."""
        x = np.asarray(stats, np.float64).reshape(-1, len(UNIT_STAT_COLUMNS))
        if not len(x):
            self.unit_stats = np.tile([0.0, 1.0], (len(UNIT_STAT_COLUMNS), 1))
            return self
        self.unit_stats = np.stack(median_scale(x, axis=0), 1)
        return self

    def unit_features(self, stats: np.ndarray) -> np.ndarray:
        """Per unit (float32, two columns per column of :data:`UNIT_STAT_COLUMNS`): the value / 8
        and its robust z / 4 (clipped at ±20 before) against :meth:`fit_units`' statistics."""
        if not len(self.unit_stats):
            raise TellerError("the reference holds no unit statistics; fit them with ReferenceStats.fit_units")
        x = np.asarray(stats, np.float64)
        z = np.clip((x - self.unit_stats[:, 0]) / self.unit_stats[:, 1], -20.0, 20.0)
        return np.stack([x / 8.0, z / 4.0], 2).reshape(len(x), -1).astype(np.float32)

    def to_json(self) -> dict:
        d = {"format": "teller-rca-reference", "version": 1, "source": self.source,
             "what": "per trace token id: median and IQR/1.349 of log1p(duration / 1 us) in normal reference steps",
             "pooled": list(self.pooled), "median": np.round(self.median, 6).tolist(),
             "scale": np.round(self.scale, 6).tolist(), "count": self.count.tolist()}
        if self.family_names:
            d["families"] = {"what": "per operator family: median and IQR/1.349 of log1p(summed self time / 1 us), of "
                                     "log1p(node count) and, with a third pair of columns, of log1p(summed span / 1 us) of "
                                     "the family in normal reference units",
                             "names": list(self.family_names), "stats": np.round(self.family_stats, 6).tolist(),
                             "pooled": list(self.family_pooled)}
        if len(self.unit_stats):
            d["units"] = {"what": "per unit statistic (per layer: log1p mean self time / 1 us and mean span / 1 us "
                                  "of its nodes, its share of the nodes and of their summed self time; then log1p rank "
                                  "count): median and IQR/1.349 in normal reference units",
                          "columns": list(UNIT_STAT_COLUMNS), "stats": np.round(self.unit_stats, 6).tolist()}
        return d

    @classmethod
    def from_json(cls, d: dict, where: str = "reference.json") -> "ReferenceStats":
        if d.get("format") != "teller-rca-reference":
            raise InputError(where, "not a TELLER RCA reference file", "retrain the model with `teller rca train`")
        ref = cls(np.asarray(d["median"], np.float64), np.asarray(d["scale"], np.float64),
                  np.asarray(d["count"], np.int64), tuple(d["pooled"]), d.get("source", ""))
        fam = d.get("families")
        if fam:
            ref.family_names = [str(x) for x in fam["names"]]
            ref.family_pooled = tuple(float(x) for x in fam["pooled"])
            if len(ref.family_pooled) not in (4, 6):
                raise InputError(where, f"families: {len(ref.family_pooled)} pooled statistics, expected 4 or 6",
                                 "retrain the model with `teller rca train`")
            stats = np.asarray(fam["stats"], np.float64)
            if stats.size and (stats.ndim != 2 or stats.shape[1] != len(ref.family_pooled)):
                raise InputError(where, f"families: statistics of shape {stats.shape}, expected rows of "
                                 f"{len(ref.family_pooled)}", "retrain the model with `teller rca train`")
            ref.family_stats = stats.reshape(-1, len(ref.family_pooled))
            if len(ref.family_names) != len(ref.family_stats):
                raise InputError(where, f"families: {len(ref.family_names)} names but {len(ref.family_stats)} rows of statistics",
                                 "retrain the model with `teller rca train`")
        units = d.get("units")
        if units:
            stats = np.asarray(units.get("stats", []), np.float64)
            if list(units.get("columns", [])) != list(UNIT_STAT_COLUMNS) or stats.shape != (len(UNIT_STAT_COLUMNS), 2):
                raise InputError(where, f"units: columns {units.get('columns')} with statistics of shape {stats.shape}, "
                                 f"expected the {len(UNIT_STAT_COLUMNS)} columns {list(UNIT_STAT_COLUMNS)} with two "
                                 "values each", "retrain the model with `teller rca train`")
            ref.unit_stats = stats
        return ref

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json()))

    @classmethod
    def load(cls, path: str | Path) -> "ReferenceStats":
        p = Path(path)
        if not p.is_file():
            raise InputError(p, "missing", "retrain the model with `teller rca train`")
        return cls.from_json(json.loads(p.read_text()), str(p))


# ----------------------------------------------------------------------------------------------
# the whole dataset


@dataclass
class Dataset:
    """A dataset's units and their steps, serialized once (shared by every split's training);
    ``forest.unit`` says whether a step's trace is its STEP subtree or its engine iteration."""

    path: Path
    units: Units
    forest: StepForest
    #: what is computed once per loaded dataset (the units' shape-free context:
    #: :func:`teller.rca.context.dataset_context_features`)
    cache: dict = field(default_factory=dict, repr=False)

    @property
    def unit(self) -> str:
        return self.forest.unit

    def explanations_and_logs(self, idx: np.ndarray) -> list[str]:
        return [self.units.explanation[i] for i in idx.tolist() if self.units.explanation[i]] + \
               [self.units.log_text[i] for i in idx.tolist() if self.units.log_text[i]]


def require_unit(ds: Dataset, unit: str, what: str = "the model") -> None:
    """Raise unless ``ds`` was serialized with ``unit`` (a model reads the units it was trained on)."""
    if ds.unit != unit:
        raise TellerError(f"{ds.path}: loaded with unit {ds.unit!r}, but {what} reads unit {unit!r}; "
                          f"load it with load_dataset(..., unit={unit!r})")


#: the subtree columns :func:`step_forest` reads (the serialized sequences, families, spans and
#: iterations; ``kind``, ``tid`` and ``device`` tell GPU rows from host calls for the self times):
#: :func:`load_dataset` keeps only these, decoded part by part
STEP_COLUMNS = ("run_id", "node_id", "parent_id", "step_id", "step_idx", "layer", "name", "start_ns", "end_ns",
                "depth", "size", "kind", "tid", "device")


def read_steps(ds: str | Path, runs: Sequence[str] | None = None, columns: Sequence[str] | None = None) -> pa.Table:
    """A dataset's subtrees (forest rows of its steps); with ``runs``, only the parts that hold
    those runs are decoded (each part is encoded on its own) and only their rows kept; with
    ``columns``, only those of them (each part projected once decoded, so the whole table is never
    held with every column)."""
    from teller.dataset.codec import decode, read_subtrees

    ds = Path(ds)
    parts = sorted((ds / "subtrees").glob("part-*.parquet")) if (ds / "subtrees").is_dir() else []

    def keep(t: pa.Table) -> pa.Table:
        return t if columns is None else t.select([c for c in columns if c in t.column_names])

    if not parts:
        t = keep(read_subtrees(ds))
    else:
        want = pa.array(sorted(set(runs)), pa.string()) if runs else None
        tabs = []
        for f in parts:
            if want is not None:
                rid = pq.read_table(f, columns=["run_id"]).column("run_id").cast(pa.string())
                if not pc.any(pc.is_in(rid, value_set=want)).as_py():
                    continue
            tabs.append(keep(decode(pq.read_table(f), str(f))))
        if not tabs:
            raise TellerError(f"{ds}/subtrees: no rows of the runs {sorted(set(runs or []))}")
        t = pa.concat_tables(tabs)
        if want is not None:
            t = t.unify_dictionaries()
    if runs:
        t = t.filter(pc.is_in(t.column("run_id").cast(pa.string()), value_set=pa.array(sorted(set(runs)), pa.string())))
    return t


def training_workloads(ds: "Dataset", idx: np.ndarray) -> list[str]:
    """The workload shapes (the records' ``workload``, e.g. ``"2 layers, hidden 1024"``) of the runs
    of units ``idx``: what a model trained on them knows (`teller diagnose` lets it read every step
    of runs of these shapes only). Empty when the dataset records none."""
    by_run = run_workloads(ds)
    runs = set(np.asarray(ds.units.run_id, dtype=object)[np.asarray(idx, np.int64)].tolist())
    return sorted({by_run[r] for r in runs if by_run.get(r)})


def run_workloads(ds: "Dataset") -> dict[str, str]:
    """Each run's workload shape as the dataset's records name it (empty where they record none)."""
    path = Path(ds.path) / "records.parquet"
    if not path.is_file() or "workload" not in pq.ParquetFile(path).schema_arrow.names:
        return {}
    t = pq.read_table(path, columns=["run_id", "workload"])
    return {r: str(w) for r, w in zip(t.column("run_id").cast(pa.string()).to_pylist(), t.column("workload").to_pylist(),
                                       strict=True) if w}


def load_dataset(ds: str | Path, runs: Sequence[str] | None = None, max_units: int | None = None,
                 seed: int = 0, unit: str = "step") -> Dataset:
    """Read a dataset folder. ``runs``: keep these runs only; ``max_units``: a random sample of
    that many units (drawn with ``seed``; for tests and smoke runs); ``unit``: what a step's trace
    holds (:data:`UNITS`, :func:`step_forest`)."""
    check_unit(unit)
    ds = Path(ds)
    units = read_units(ds, runs=runs)
    idx = np.arange(len(units))
    if max_units is not None and max_units < len(idx):
        idx = np.sort(np.random.default_rng(seed).choice(idx, size=max_units, replace=False))
        units = units.select(idx)
    sub = read_steps(ds, runs, columns=STEP_COLUMNS)
    if max_units is not None:
        # keep only the blocks of the sampled units' steps (a block's rows carry its step_id)
        key = np.unique(np.asarray([f"{r}\x1f{s}" for r, ss in zip(units.run_id.tolist(), units.step_ids, strict=True)
                                    for s in ss.tolist()], dtype=object))
        run_s = sub.column("run_id").cast(pa.string())
        rk = pc.binary_join_element_wise(run_s, pc.cast(sub.column("step_id"), pa.string()), "\x1f")
        keep = pc.is_in(rk, value_set=pa.array(key.tolist(), pa.string())).to_numpy(zero_copy_only=False)
        if unit == "iteration" and "step_idx" in sub.column_names:
            # and the rows of their iterations outside the STEP subtrees (same run and step_idx)
            from teller.forest import with_iterations

            sid = sub.column("step_id").to_numpy()
            six = sub.column("step_idx").combine_chunks().fill_null(-1).to_numpy(zero_copy_only=False)
            run = run_s.combine_chunks().dictionary_encode().indices.to_numpy(zero_copy_only=False)
            keep = with_iterations(keep, sid == sub.column("node_id").to_numpy(), sid, six, run)
        sub = sub.filter(pa.array(keep))
    return Dataset(ds, units, step_forest(sub, unit=unit))
