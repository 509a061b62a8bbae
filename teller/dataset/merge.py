"""``teller dataset merge DS1 DS2... -o DS``: one dataset from datasets built from disjoint runs.

A campaign recorded in several parts (on different machines, or at different times) is built
part by part with ``teller dataset build``; merging the parts gives exactly the dataset that one
``teller dataset build`` over all their runs, in the order of the parts, would have written
(``tests/test_dataset_merge.py``):

- ``records.parquet``: the parts' records one after the other, with ``record_id`` renumbered and
  the split columns recomputed over the whole (:func:`teller.dataset.splits.split_table`: a
  request, run or mechanism split depends on every run); ``comm_edge_rows`` shifted by the rows
  of the preceding parts' ``comm_edges.parquet``, as the builder shifts a run's;
- ``subtrees/``: every part's rows (read back exactly, whatever the format of their files:
  :mod:`.codec`) cut into new parts in the current format;
- ``logs.parquet``, ``comm_edges.parquet``, ``iterations.parquet``: the parts' tables one after
  the other (a part without one contributes nothing);
- ``datasheet.json`` / ``datasheet.md``: recounted, with the parts' ``runs`` rows in order.

The split seed is the parts' (``seed`` overrides it, and is needed when they differ). Parts must
agree on the step sampling (``--normal-every``/``--max-normal``), hold no run twice and carry no
TPE fields: a tokenizer is attached to the merged dataset (:func:`teller.dataset.build.attach_tpe`),
since its encoder sees the whole dataset.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from teller.dataset.build import TPE_FIELDS, _shift_edges, write_dataset
from teller.dataset.codec import read_subtrees
from teller.dataset.splits import SPLIT_COLUMNS
from teller.errors import InputError, TellerError

#: the records' columns a merge recomputes (the builder adds them after the runs' records)
DERIVED = ("record_id", *TPE_FIELDS, *SPLIT_COLUMNS)
#: the tables concatenated as they are (each optional in a part)
TABLES = ("logs", "comm_edges", "iterations")
_NOT_A_DATASET = "give dataset folders written by `teller dataset build`"


def check_parts(parts: list[str | Path], out: str | Path) -> list[Path]:
    """The parts as paths, checked to be dataset folders, each given once, none of them ``out``
    nor inside it (nor ``out`` inside one): errors name the folder and the fix."""
    paths = [Path(p) for p in parts]
    if not paths:
        raise TellerError("teller dataset merge: no datasets given; " + _NOT_A_DATASET)
    res = Path(out).resolve()
    seen: dict[Path, Path] = {}
    for p in paths:
        for f in ("datasheet.json", "records.parquet"):
            if not (p / f).is_file():
                raise InputError(p, f"not a dataset (no {f})", _NOT_A_DATASET)
        if not (p / "subtrees").is_dir() and not (p / "subtrees.parquet").is_file():
            raise InputError(p, "not a dataset (no subtrees/ folder)", _NOT_A_DATASET)
        r = p.resolve()
        if r in seen:
            raise InputError(p, f"given twice (also as {seen[r]})", "name every dataset once")
        seen[r] = p
        if r == res or r in res.parents:
            raise InputError(out, f"is the dataset {p} or lies inside it",
                             "write the merged dataset to a folder of its own (-o)")
        if res in r.parents:
            raise InputError(out, f"holds the dataset {p}", "write the merged dataset to a folder outside the parts (-o)")
    return paths


def _sheet(p: Path) -> dict[str, Any]:
    f = p / "datasheet.json"
    try:
        sheet = json.loads(f.read_text())
    except (OSError, ValueError) as e:
        raise InputError(f, f"unreadable ({e})", "rebuild this part with `teller dataset build`") from None
    if not isinstance(sheet, dict) or not isinstance(sheet.get("runs"), list):
        raise InputError(f, "no `runs` list: not a datasheet of `teller dataset build`", "rebuild this part with `teller dataset build`")
    return sheet


def _seed(paths: list[Path], sheets: list[dict[str, Any]], seed: int | None) -> int:
    if seed is not None:
        return seed
    seeds = [s.get("seed", 0) for s in sheets]
    for p, s in zip(paths[1:], seeds[1:], strict=True):
        if s != seeds[0]:
            raise InputError(p / "datasheet.json", f"split seed {s}, but {paths[0]} has seed {seeds[0]}",
                             "pass --seed to split the merged dataset with one seed")
    return int(seeds[0])


def _sampling(paths: list[Path], sheets: list[dict[str, Any]]) -> dict[str, Any] | None:
    rules = [s.get("sampling") for s in sheets]
    for p, r in zip(paths[1:], rules[1:], strict=True):
        if r != rules[0]:
            raise InputError(p / "datasheet.json", f"sampled steps by {json.dumps(r)}, but {paths[0]} by {json.dumps(rules[0])}",
                             "rebuild the parts with the same --normal-every/--max-normal")
    return rules[0]


def _check_runs(paths: list[Path], sheets: list[dict[str, Any]]) -> list[dict[str, Any]]:
    owner: dict[str, Path] = {}
    rows: list[dict[str, Any]] = []
    for p, s in zip(paths, sheets, strict=True):
        mine = {str(r.get("run_id")) for r in s["runs"]}
        for rid in sorted(mine):
            if rid in owner:
                raise InputError(p, f"holds run {rid!r}, which {owner[rid]} holds too (the parts overlap)",
                                 "rebuild one of them without that run (`teller dataset build` on the runs of one part only)")
        owner.update(dict.fromkeys(mine, p))
        rows += s["runs"]
    return rows


def _records(p: Path, columns: list[str] | None) -> pa.Table:
    f = p / "records.parquet"
    try:
        t = pq.read_table(f)
    except (OSError, pa.ArrowException) as e:
        raise InputError(f, f"unreadable ({e})", "rebuild this part with `teller dataset build`") from None
    # every column a build writes (split_workload only for datasets of two or more model shapes)
    need = [c for c in ("run_id", "request_id", "mechanism", "fault_type", "comm_edge_rows", *DERIVED) if c != "split_workload"]
    missing = [c for c in need if c not in t.column_names]
    if missing:
        raise InputError(f, f"no column {missing[0]!r}: not written by this version of `teller dataset build`",
                         "rebuild this part with `teller dataset build`")
    for c in TPE_FIELDS:
        if t.column(c).null_count != t.num_rows:
            raise InputError(f, f"has TPE fields ({c!r} is filled)",
                             "merge before attaching a tokenizer: merge the parts built without one, then attach it "
                             "to the merged dataset (teller.dataset.build.attach_tpe)")
    t = t.drop_columns([c for c in DERIVED if c in t.column_names])
    if columns is not None and t.column_names != columns:
        raise InputError(f, f"has the record columns {t.column_names}, the first part {columns}",
                         "rebuild the parts with the same version of `teller dataset build`")
    return t


def _table(p: Path, name: str) -> pa.Table | None:
    f = p / f"{name}.parquet"
    if not f.is_file():
        return None
    try:
        return pq.read_table(f)
    except (OSError, pa.ArrowException) as e:
        raise InputError(f, f"unreadable ({e})", "rebuild this part with `teller dataset build`") from None


def merge_datasets(parts: list[str | Path], out: str | Path, seed: int | None = None,
                   progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Merge datasets built from disjoint runs into ``out``, as one build over all their runs in
    the order of ``parts`` would have written it (module docstring); returns the datasheet dict.
    ``progress(done, total)`` is called after each part."""
    paths = check_parts(parts, out)
    out = Path(out)
    sheets = [_sheet(p) for p in paths]
    seed = _seed(paths, sheets, seed)
    sampling = _sampling(paths, sheets)
    run_rows = _check_runs(paths, sheets)
    recs: list[pa.Table] = []
    subs: list[pa.Table] = []
    tables: dict[str, list[pa.Table]] = {k: [] for k in TABLES}
    shift = 0
    for k, p in enumerate(paths):
        if progress is not None:
            progress(k, len(paths))
        r = _records(p, recs[0].column_names if recs else None)
        comm = _table(p, "comm_edges")
        n_comm = comm.num_rows if comm is not None else 0
        rows = r.column("comm_edge_rows").combine_chunks()
        flat = rows.flatten().to_numpy() if len(rows) else np.zeros(0, np.int64)
        if len(flat) and (flat.min() < 0 or flat.max() >= n_comm):
            raise InputError(p / "records.parquet", f"comm_edge_rows names row {int(flat.max())} of comm_edges.parquet, "
                             f"which holds {n_comm} rows", "rebuild this part with `teller dataset build`")
        recs.append(_shift_edges(r, shift))
        shift += n_comm
        try:
            subs.append(read_subtrees(p))
        except (OSError, pa.ArrowException) as e:
            raise InputError(p / "subtrees", f"unreadable ({e})", "rebuild this part with `teller dataset build`") from None
        for name in TABLES:
            t = comm if name == "comm_edges" else _table(p, name)
            if t is not None and (t.num_rows or name != "comm_edges"):
                tables[name].append(t)
    if progress is not None:
        progress(len(paths), len(paths))
    return write_dataset(recs, subs, tables, out, run_rows, seed, sampling)
