"""``teller dataset build RUNS... -o DS``: labelled step records from reconstructed runs (docs/design.md §11).

Writes, all Parquet (columnar, zstd):

- ``records.parquet``: one row per (request, step) and view. ``view`` is ``vertical`` (the step
  on one rank: its within-node stack) or ``horizontal`` (the same step number on every rank of a
  tensor-parallel run, joined by its collectives). Columns: record_id, run_id, request_id,
  step_id (the forest node id of the step; rank 0's for horizontal records), step_ids and ranks
  (every rank's step), step_num, rank, view, start_ns, end_ns, duration_ns, log_text (the
  step's aligned log lines that name this request or no request), is_anomaly, in_window,
  fault_type, mechanism, operator_labels, layer, explanation, effect_ms, ref_p99_ms,
  run_status, workload (the served model's shape, :func:`workload_shape`), provenance (JSON: run
  directory name, campaign, forest row range per rank, label rule),
  comm_edge_rows (rows of ``comm_edges.parquet``: for horizontal records the collectives
  matched between the record's ranks, i.e. each rank's COMM node and its peer's; for vertical
  records the edges touching the step),
  the TPE fields input_ids, parent_idx, duration, depth (null until a tokenizer is attached:
  :func:`attach_tpe`) and the split columns of :mod:`.splits`;
- ``subtrees/part-NNNNN.parquet``: the forest rows of every step referenced by a record: its
  iteration, i.e. the rows of its ``step_idx`` (the DFS block ``[step_id, step_id + size)`` plus
  the schedule/update ranges and GAP rows around it, and roots of other threads that joined it),
  in forest order, with ``run_id``; rows outside the STEP block have ``step_id`` -1 (or, for a
  root of another thread, that of no STEP), so readers keyed on ``step_id`` see the STEP blocks
  as before. Enough to recompute localization,
  slices and TPE without the run directories. Stored compactly in parts (:mod:`.codec`); read
  them with :func:`teller.dataset.codec.read_subtrees`;
- ``logs.parquet``: the aligned log lines of those steps (``log_alignment`` rows plus run_id);
- ``comm_edges.parquet``: the cross-rank communication edges of the runs (plus run_id);
- ``iterations.parquet``: the engine iterations of the referenced steps (the runs'
  ``iterations.parquet`` rows plus run_id; docs/design.md §5.7);
- ``datasheet.json`` / ``datasheet.md`` (:mod:`.datasheet`).

Runs are folders holding ``labels.json`` (from ``teller inject run``) or reconstructed runs
without labels (then every step is normal and ``provenance.label`` says "unlabelled"). Runs
marked skipped are listed in the datasheet and contribute no records; crashed runs contribute
what they recorded, marked ``run_status = crashed``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from teller.dataset.codec import write_subtree_parts
from teller.dataset.datasheet import write_datasheet
from teller.dataset.splits import split_table
from teller.errors import TellerError
from teller.forest import Forest, ranges
from teller.inject.labels import STEP_LABELS_SCHEMA
from teller.rundir import RunDir

TPE_FIELDS = ("input_ids", "parent_idx", "duration", "depth")


def find_runs(paths: list[str | Path]) -> list[Path]:
    """Run directories named directly or found one level below (campaign output folders)."""
    out: list[Path] = []
    for p in map(Path, paths):
        if not p.is_dir():
            raise TellerError(f"{p}: no such folder; give run directories or a `teller inject run -o` folder")
        if (p / "labels.json").is_file() or (p / "run.json").is_file():
            out.append(p)
            continue
        kids = sorted(d for d in p.iterdir() if d.is_dir() and ((d / "labels.json").is_file() or (d / "run.json").is_file()))
        if not kids:
            raise TellerError(f"{p}: holds no run directories (no labels.json or run.json); record some with `teller inject run`")
        out += kids
    return out


def sample_steps(v: pa.Table, normal_every: int, max_normal: int | None = None) -> np.ndarray:
    """Which rows of (request, step) pairs to keep: every step number that is abnormal on some
    rank, and of the others every k-th step number (``step_num % k == 0``), so a kept step keeps
    all of its ranks and requests (horizontal records stay whole). ``k`` is ``normal_every``, or
    larger when the run has more than ``max_normal`` other step numbers (then about
    ``max_normal`` of them are kept: long runs and multi-rank runs do not crowd out the rest)."""
    n = v.num_rows
    if (normal_every <= 1 and not max_normal) or not n:
        return np.ones(n, bool)
    num = v.column("step_num").to_numpy().astype(np.int64)
    ab = v.column("is_anomaly").to_numpy(zero_copy_only=False).astype(bool)
    keep_num = np.unique(num[ab])
    k = max(1, normal_every)
    if max_normal:
        n_other = len(np.setdiff1d(np.unique(num), keep_num))
        k = max(k, -(-n_other // max_normal))
    return np.isin(num, keep_num) | (num % k == 0)


def sampling_rule(normal_every: int, max_normal: int | None) -> dict[str, Any]:
    """The datasheet's ``sampling`` entry for :func:`sample_steps` with these settings."""
    return {"normal_every": normal_every, "max_normal": max_normal,
            "rule": "all steps" if normal_every == 1 and not max_normal else
            "every step number abnormal on some rank, and of the others those divisible by k, "
            f"k = {normal_every}" + (f" or more so that at most about {max_normal} per run are kept" if max_normal else "")}


def workload_shape(rd: RunDir, labels: dict[str, Any] | None) -> str:
    """The served model's shape, as the ``workload`` column names it (``"2 layers, hidden 1024"``):
    from run.json's ``model_config`` (what the recorder saw), else the campaign's workload spec in
    labels.json (tensor-parallel workloads record no config of their own); "" when neither says."""
    mc = rd.read_info().model_config or {}
    wl = (labels or {}).get("workload") or {}
    layers = mc.get("num_hidden_layers", wl.get("layers"))
    hidden = mc.get("hidden_size", wl.get("hidden"))
    if layers is None:
        return ""
    return f"{int(layers)} layers" + (f", hidden {int(hidden)}" if hidden is not None else "")


def _run_records(run: Path, labels: dict[str, Any] | None, normal_every: int = 1,
                 max_normal: int | None = None) -> dict[str, Any] | None:
    rd = RunDir(run)
    if not (rd.has_table("steps") and rd.has_table("forest")):
        return None
    run_id = (labels or {}).get("run_id") or run.name
    status = (labels or {}).get("status", "unlabelled")
    steps = rd.read_table("steps")
    reqs = rd.read_table("requests")
    sl = rd.read_table("step_labels") if rd.has_table("step_labels") else None
    if sl is None:
        n = steps.num_rows
        sl = pa.table({"step_id": steps.column("step_id"), "is_anomaly": np.zeros(n, bool),
                       "in_window": np.zeros(n, bool), "fault_type": [""] * n, "mechanism": [""] * n,
                       "operator_labels": pa.array([[]] * n, pa.list_(pa.string())), "layer": [""] * n,
                       "explanation": [""] * n, "effect_ms": np.full(n, np.nan), "ref_p99_ms": np.full(n, np.nan)})
    sl = sl.select(["step_id", "is_anomaly", "in_window", "fault_type", "mechanism", "operator_labels", "layer",
                    "explanation", "effect_ms", "ref_p99_ms"])
    st = steps.select(["step_id", "step_num", "rank", "start_ns", "end_ns", "size"])
    v = _take_by_step(reqs.select(["request_id", "step_id"]), [st, sl])
    v = v.sort_by([("rank", "ascending"), ("step_num", "ascending"), ("request_id", "ascending")])
    _ = STEP_LABELS_SCHEMA
    n_steps = len(np.unique(v.column("step_id").to_numpy()))
    v = v.filter(pa.array(sample_steps(v, normal_every, max_normal)))
    # logs of the referenced steps
    logs = rd.read_table("log_alignment") if rd.has_table("log_alignment") else None
    log_text = _log_text(v, logs)
    n = v.num_rows
    sid = v.column("step_id").to_numpy()
    size = v.column("size").to_numpy()
    prov = [json.dumps({"run": Path(run).name, "campaign": (labels or {}).get("campaign"), "forest_rows": [int(a), int(a + b)],
                        "label": "labels.json + step_labels.parquet" if rd.has_table("step_labels") else "unlabelled"})
            for a, b in zip(sid, size, strict=False)]
    rec = {
        "run_id": [run_id] * n, "request_id": v.column("request_id"), "step_id": v.column("step_id"),
        "step_ids": pa.array([[int(x)] for x in sid], pa.list_(pa.int64())),
        "ranks": pa.array([[int(x)] for x in v.column("rank").to_numpy()], pa.list_(pa.int32())),
        "step_num": v.column("step_num"), "rank": v.column("rank"), "view": ["vertical"] * n,
        "start_ns": v.column("start_ns"), "end_ns": v.column("end_ns"),
        "duration_ns": pc.subtract(v.column("end_ns"), v.column("start_ns")),
        "log_text": log_text, "is_anomaly": v.column("is_anomaly"), "in_window": v.column("in_window"),
        "fault_type": v.column("fault_type"), "mechanism": v.column("mechanism"),
        "operator_labels": v.column("operator_labels"), "layer": v.column("layer"),
        "explanation": v.column("explanation"), "effect_ms": v.column("effect_ms"), "ref_p99_ms": v.column("ref_p99_ms"),
        "run_status": [status] * n, "workload": [workload_shape(rd, labels)] * n, "provenance": prov,
    }
    vert = pa.table(rec)
    horiz = _horizontal(vert) if len(np.unique(v.column("rank").to_numpy())) > 1 else None
    comm = rd.read_table("comm_edges") if rd.has_table("comm_edges") else None
    run_forest = rd.read_table("forest")
    f = Forest.from_table(run_forest, str(rd.path / "forest.parquet"))
    vert = _attach_edges(vert, comm, f)
    if horiz is not None:
        horiz = _attach_edges(horiz, comm, f)
    # subtrees and logs of the referenced steps (each step once): the row blocks [row, row + size)
    us, first = np.unique(sid, return_index=True)
    srow = f.rows_of(us)
    if (srow < 0).any():
        raise TellerError(f"{f.path}: steps.parquet names node {int(us[srow < 0][0])}, which the forest lacks; "
                          f"re-run `teller reconstruct {rd.path}`")
    rows = _iteration_rows(run_forest, steps, us, ranges(srow, srow + size[first]))
    forest = run_forest.take(pa.array(rows))
    forest = forest.append_column("run_id", pa.array([run_id] * forest.num_rows, pa.string()).dictionary_encode())
    if logs is not None and logs.num_rows:
        keep = np.isin(logs.column("step_id").to_numpy(), us)
        logs = logs.filter(pa.array(keep))
        logs = logs.append_column("run_id", pa.array([run_id] * logs.num_rows, pa.string()))
    if comm is not None:
        comm = comm.append_column("run_id", pa.array([run_id] * comm.num_rows, pa.string()))
    iters = None
    if rd.has_table("iterations"):
        iters = rd.read_table("iterations")
        iters = iters.filter(pc.is_in(iters.column("step_id"), value_set=pa.array(us, pa.int64())))
        iters = iters.append_column("run_id", pa.array([run_id] * iters.num_rows, pa.string()))
    return {"records": [t for t in (vert, horiz) if t is not None], "subtrees": forest, "logs": logs, "comm": comm,
            "iterations": iters, "steps": n_steps, "steps_kept": len(us)}


def _iteration_rows(forest: pa.Table, steps: pa.Table, step_ids: np.ndarray, blocks: np.ndarray) -> np.ndarray:
    """Forest rows of the steps ``step_ids`` (node ids, ascending): their STEP blocks ``blocks``
    plus every other row of their iterations, i.e. of the same ``step_idx`` (schedule and update
    ranges, GAP rows, roots of other threads that joined the step; whole root blocks, so the
    rows stay a preorder forest). Forests without ``step_idx``: the blocks alone."""
    if "step_idx" not in forest.column_names or "step_idx" not in steps.column_names or not len(step_ids):
        return blocks
    sid = steps.column("step_id").to_numpy().astype(np.int64)
    sidx = steps.column("step_idx").to_numpy().astype(np.int64)
    want = np.unique(sidx[np.isin(sid, step_ids)])
    row_idx = forest.column("step_idx").to_numpy().astype(np.int64)
    extra = np.flatnonzero(np.isin(row_idx, want))
    return np.union1d(blocks, extra).astype(blocks.dtype)


def _attach_edges(recs: pa.Table, comm: pa.Table | None, forest: Forest) -> pa.Table:
    """Add ``comm_edge_rows``: the rows of the run's ``comm_edges`` that join two of the record's
    steps (horizontal records: a collective of one rank matched to the peer rank's COMM node) or
    that touch its step (vertical records). Row numbers are made dataset-wide in :func:`build_dataset`."""
    n = recs.num_rows
    if comm is None or not comm.num_rows or not n:
        return recs.append_column("comm_edge_rows", pa.array([[] for _ in range(n)], pa.list_(pa.int64())))
    src = forest.step_of(comm.column("src_node_id").to_numpy())
    dst = forest.step_of(comm.column("dst_node_id").to_numpy())
    e = np.arange(comm.num_rows, dtype=np.int64)
    lists = recs.column("step_ids").combine_chunks()
    nsteps = pc.list_value_length(lists).to_numpy(zero_copy_only=False).astype(np.int64)
    rec_of = np.repeat(np.arange(n), nsteps)
    flat = pc.list_flatten(lists).to_numpy()
    # (step, edge) pairs: every edge under both of its endpoint steps
    ps = np.concatenate([src, dst])
    pe = np.concatenate([e, e])
    order = np.lexsort((pe, ps))
    ps, pe = ps[order], pe[order]
    lo, hi = np.searchsorted(ps, flat, "left"), np.searchsorted(ps, flat, "right")
    cand = ranges(lo, hi)
    cand_rec = np.repeat(rec_of, hi - lo)
    edge = pe[cand]
    # an edge of a multi-step record must join two of its steps; keep it once per record
    key = np.stack([cand_rec, edge], 1)
    uk, cnt = np.unique(key, axis=0, return_counts=True) if len(key) else (np.zeros((0, 2), np.int64), np.zeros(0, np.int64))
    keep = (cnt >= 2) | (nsteps[uk[:, 0]] == 1) if len(uk) else np.zeros(0, bool)
    uk = uk[keep]
    offsets = np.concatenate([[0], np.cumsum(np.bincount(uk[:, 0], minlength=n))]).astype(np.int32)
    return recs.append_column("comm_edge_rows", pa.ListArray.from_arrays(pa.array(offsets), pa.array(uk[:, 1].astype(np.int64))))


def _take_by_step(left: pa.Table, tables: list[pa.Table]) -> pa.Table:
    """Left join on ``step_id`` by sorted lookup (Arrow's join cannot carry list columns)."""
    sid = left.column("step_id").to_numpy()
    out = left
    for t in tables:
        ts = t.column("step_id").to_numpy()
        order = np.argsort(ts, kind="stable")
        pos = order[np.clip(np.searchsorted(ts[order], sid), 0, max(len(ts) - 1, 0))]
        if len(ts) and not np.array_equal(ts[pos], sid):
            keep = ts[pos] == sid
            left, sid, pos = left.filter(pa.array(keep)), sid[keep], pos[keep]
            out = out.filter(pa.array(keep))
        taken = t.take(pa.array(pos))
        for c in taken.column_names:
            if c != "step_id":
                out = out.append_column(c, taken.column(c))
    return out


def _log_text(v: pa.Table, logs: pa.Table | None) -> list[str]:
    n = v.num_rows
    if logs is None or not logs.num_rows:
        return [""] * n
    lsid = logs.column("step_id").to_numpy()
    lrid = logs.column("request_id").to_pylist()
    ltext = logs.column("text").to_pylist()
    by_step: dict[int, list[tuple[Any, str]]] = {}
    for s, r, t in zip(lsid.tolist(), lrid, ltext, strict=False):  # one entry per aligned log line (few per step)
        if s >= 0:
            by_step.setdefault(s, []).append((r, t))
    out = []
    for s, q in zip(v.column("step_id").to_pylist(), v.column("request_id").to_pylist(), strict=False):
        out.append("\n".join(t for r, t in by_step.get(s, ()) if r is None or r == q))
    return out


def _horizontal(vert: pa.Table) -> pa.Table:
    """One record per (request, step number) served by several ranks: their steps joined."""
    g = vert.group_by(["run_id", "request_id", "step_num"], use_threads=False).aggregate([
        ("step_id", "list"), ("rank", "list"), ("start_ns", "min"), ("end_ns", "max"), ("is_anomaly", "max"),
        ("in_window", "max"), ("log_text", "list")])
    g = g.filter(pc.greater(pc.list_value_length(g.column("rank_list")), 1))
    n = g.num_rows
    if not n:
        return None  # type: ignore[return-value]
    # labels of the first abnormal rank (else rank 0's)
    key = pc.binary_join_element_wise(vert.column("run_id"), vert.column("request_id"),
                                      pc.cast(vert.column("step_num"), pa.string()), "\x1f")
    gkey = pc.binary_join_element_wise(g.column("run_id"), g.column("request_id"),
                                       pc.cast(g.column("step_num"), pa.string()), "\x1f")
    order = np.lexsort((vert.column("rank").to_numpy(), ~vert.column("is_anomaly").to_numpy(zero_copy_only=False)))
    k_sorted = np.asarray(key.to_pylist(), dtype=object)[order]
    _, first = np.unique(k_sorted, return_index=True)
    pick_keys = k_sorted[first]
    idx = order[first][np.searchsorted(pick_keys, np.asarray(gkey.to_pylist(), dtype=object))]
    src = vert.take(pa.array(idx))
    start, end = g.column("start_ns_min"), g.column("end_ns_max")
    rec = {c: src.column(c) for c in vert.column_names}
    rec.update({
        "run_id": g.column("run_id"), "request_id": g.column("request_id"), "step_num": g.column("step_num"),
        "step_ids": pc.cast(g.column("step_id_list"), pa.list_(pa.int64())),
        "ranks": pc.cast(g.column("rank_list"), pa.list_(pa.int32())),
        "view": ["horizontal"] * n, "start_ns": start, "end_ns": end, "duration_ns": pc.subtract(end, start),
        "is_anomaly": g.column("is_anomaly_max"), "in_window": g.column("in_window_max"),
        "log_text": ["\n".join(x for x in lst if x) for lst in g.column("log_text_list").to_pylist()],
    })
    return pa.table({c: rec[c] for c in vert.column_names})


def _shift_edges(t: pa.Table, shift: int) -> pa.Table:
    if not shift:
        return t
    col = t.column("comm_edge_rows").combine_chunks()
    vals = pc.add(col.values, pa.scalar(shift, pa.int64()))
    i = t.column_names.index("comm_edge_rows")
    return t.set_column(i, "comm_edge_rows", pa.ListArray.from_arrays(col.offsets, vals))


def build_dataset(runs: list[str | Path], out: str | Path, seed: int = 0,
                  tpe: Callable[[pa.Table, pa.Table], pa.Table] | None = None, normal_every: int = 1,
                  max_normal: int | None = None, progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Build the dataset from run directories; returns the datasheet dict.

    ``normal_every`` > 1 or ``max_normal`` samples steps (:func:`sample_steps`): abnormal steps
    are all kept, other steps one step number in k; the datasheet records the rule and the counts.
    ``progress(done, total)`` is called after each run (a progress bar's hook)."""
    if normal_every < 1:
        raise TellerError(f"--normal-every {normal_every}: expected 1 (keep every step) or more")
    if max_normal is not None and max_normal < 1:
        raise TellerError(f"--max-normal {max_normal}: expected a number of step numbers ≥ 1 per run")
    paths = find_runs(runs)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    recs, subs, logs, comms, iters, run_rows = [], [], [], [], [], []
    for k, p in enumerate(paths):
        if progress is not None:
            progress(k, len(paths))
        labels = RunDir(p).read_labels()
        status = (labels or {}).get("status", "unlabelled")
        row = {"run_id": (labels or {}).get("run_id") or p.name, "path": p.name, "status": status,
               "skipped": (labels or {}).get("skipped", []), "records": 0}
        r = _run_records(p, labels, normal_every, max_normal) if status != "skipped" else None
        if r is not None:
            shift = sum(c.num_rows for c in comms)
            recs += [_shift_edges(t, shift) for t in r["records"]]
            subs.append(r["subtrees"])
            if r["logs"] is not None:
                logs.append(r["logs"])
            if r["comm"] is not None and r["comm"].num_rows:
                comms.append(r["comm"])
            if r["iterations"] is not None:
                iters.append(r["iterations"])
            row["records"] = sum(t.num_rows for t in r["records"])
            row["steps"], row["steps_kept"] = r["steps"], r["steps_kept"]
        elif status != "skipped":
            row["note"] = "not reconstructed (no steps.parquet/forest.parquet)"
        run_rows.append(row)
    if progress is not None:
        progress(len(paths), len(paths))
    if not recs:
        raise TellerError(f"{', '.join(map(str, runs))}: no step records (no reconstructed, labelled runs); "
                          "run `teller inject run SPEC -o RUNS` first")
    return write_dataset(recs, subs, {"logs": logs, "comm_edges": comms, "iterations": iters}, out, run_rows,
                         seed, sampling_rule(normal_every, max_normal), tpe)


def write_dataset(recs: list[pa.Table], subs: list[pa.Table], tables: dict[str, list[pa.Table]], out: Path,
                  run_rows: list[dict[str, Any]], seed: int, sampling: dict[str, Any] | None,
                  tpe: Callable[[pa.Table, pa.Table], pa.Table] | None = None) -> dict[str, Any]:
    """Write a dataset from its runs' (or parts') record, subtree and side tables, in order:
    record ids, empty TPE fields (or ``tpe``'s), the splits of ``seed``, then the files and the
    datasheet; returns the datasheet dict (shared by :func:`build_dataset` and
    :func:`teller.dataset.merge.merge_datasets`, so a merge writes what one build would)."""
    records = pa.concat_tables(recs, promote_options="permissive")
    records = records.append_column("record_id", pa.array(np.arange(records.num_rows, dtype=np.int64)))
    for f in TPE_FIELDS:
        records = records.append_column(f, pa.nulls(records.num_rows, pa.list_(pa.int64() if f == "duration" else pa.int32())))
    records, held = split_table(records, seed)
    subtrees = pa.concat_tables([s.cast(subs[0].schema) if s.schema != subs[0].schema else s for s in subs],
                                promote_options="permissive").unify_dictionaries()
    if tpe is not None:
        records = attach_tpe(records, subtrees, tpe)
    out.mkdir(parents=True, exist_ok=True)
    pq.write_table(records, out / "records.parquet", compression="zstd")
    write_subtree_parts(subtrees, out / "subtrees")
    for name, ts in tables.items():
        if ts:
            pq.write_table(pa.concat_tables(ts, promote_options="permissive"), out / f"{name}.parquet", compression="zstd")
    return write_datasheet(records, run_rows, out, seed=seed, held_out=held, sampling=sampling)


def attach_tpe(records: pa.Table, subtrees: pa.Table, encode: Callable[[pa.Table, pa.Table], pa.Table]) -> pa.Table:
    """Fill the TPE fields: ``encode(records, subtrees)`` returns a table with one row per record
    and the columns of :data:`TPE_FIELDS` (the hook for ``teller.tpe``)."""
    enc = encode(records, subtrees)
    if enc.num_rows != records.num_rows:
        raise TellerError(f"TPE encoder returned {enc.num_rows} rows for {records.num_rows} records")
    for f in TPE_FIELDS:
        i = records.column_names.index(f)
        want = records.schema.field(f).type
        try:
            col = enc.column(f).cast(want)
        except (KeyError, pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
            raise TellerError(f"TPE encoder: column {f!r} missing or not castable to {want} ({e}); "
                              "return the columns input_ids, parent_idx, depth as list<int32> and duration as list<int64>") from None
        records = records.set_column(i, f, col)
    return records
