"""``teller dataset nest SRC -o DST --fold K``: the mechanism split's training part as a dataset of
its own, with one more mechanism per category held out as its test part.

A setting of a rule that acts on faults the model never saw (the rows' and ``teller diagnose``'s
treatment of the stage's lasting departures) cannot be chosen on a val part: val holds only
kinds of fault trained on. It cannot be chosen on the mechanism split's test part either, which
is what it is then scored on. The nested hold-out gives it a part of its own: a model trained on
DST (``--split mechanism``) never sees SRC's held-out mechanisms (their records are not in DST)
nor DST's (its test part), so a setting chosen on DST's test part is chosen on faults unseen in
training without reading SRC's test part.

- ``records.parquet``: SRC's records whose ``split_mechanism`` is train or val (the held-out
  mechanisms' records, windows without effect included, are left out); in every fault category
  that still has two or more mechanisms, the ``K``-th of them in name order (categories with
  ``K`` or fewer are left whole) is held out: its records' ``split_mechanism`` is ``test``, the
  others keep their part. ``record_id`` and every other column are SRC's (the other split
  columns are SRC's too: only ``split_mechanism`` describes DST);
- ``subtrees/``, ``logs.parquet``, ``iterations.parquet``, ``comm_edges.parquet``: SRC's, linked
  (copied where the file system has no links): records point into them and a row no record
  points to is read by nothing;
- ``datasheet.json`` / ``.md``: recounted (the runs' records too), ``held_out_mechanisms`` DST's, and ``nested`` says from
  what (SRC, the fold, SRC's held-out mechanisms).

Folds ``0, 1, ...`` hold out different mechanisms, so two of them cover every mechanism of a
category of three (SRC's own held-out one aside).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from teller.dataset.datasheet import write_datasheet
from teller.dataset.merge import TABLES, _sheet, check_parts
from teller.errors import InputError, TellerError
from teller.rundir import str_array


def inner_held_out(mechanism: np.ndarray, category: np.ndarray, fold: int) -> list[str]:
    """The mechanisms fold ``fold`` holds out: in every category (of the fault records, a
    category named) with more than ``fold`` mechanisms and at least two, the ``fold``-th in name
    order."""
    if fold < 0:
        raise TellerError(f"--fold {fold}: expected 0 or more")
    mech, cat = mechanism.astype(str), category.astype(str)
    named = (mech != "") & (cat != "")
    held = []
    for c in sorted(set(cat[named].tolist())):
        ms = sorted(set(mech[named & (cat == c)].tolist()))
        if len(ms) >= 2 and fold < len(ms):
            held.append(ms[fold])
    return sorted(held)


def _link_or_copy(src: Path, dst: Path) -> None:
    if src.is_dir():
        dst.mkdir()
        for p in sorted(src.iterdir()):
            _link_or_copy(p, dst / p.name)
        return
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def nest_dataset(src: str | Path, out: str | Path, fold: int = 0) -> dict[str, Any]:
    """Write the nested dataset of ``src``'s mechanism split, fold ``fold``, to ``out`` (module
    docstring); returns its datasheet dict."""
    src, out = Path(src), Path(out)
    check_parts([src], out)
    sheet = _sheet(src)
    path = src / "records.parquet"
    try:
        records = pq.read_table(path)
    except (OSError, pa.ArrowException) as e:
        raise InputError(path, f"unreadable ({e})", "rebuild the dataset with `teller dataset build`") from None
    for c in ("split_mechanism", "mechanism", "fault_type"):
        if c not in records.column_names:
            raise InputError(path, f"lacks the column {c!r}", "rebuild the dataset with `teller dataset build`")
    part = str_array(records.column("split_mechanism"))
    outer = sorted(sheet.get("held_out_mechanisms") or [])
    if not outer:
        raise InputError(src / "datasheet.json", "its mechanism split holds no mechanism out (no category has two or more)",
                         "nest a dataset with two or more mechanisms in a category")
    kept = records.filter(pa.array(part != "test"))
    mech, cat = str_array(kept.column("mechanism")), str_array(kept.column("fault_type"))
    inner = inner_held_out(mech, cat, fold)
    if not inner:
        raise TellerError(f"{src}: fold {fold} holds out no mechanism (no category of its training part has more than "
                          f"{fold} mechanisms and at least two); use a smaller --fold")
    new = np.where(np.isin(mech, inner), "test", part[part != "test"])
    i = kept.column_names.index("split_mechanism")
    kept = kept.set_column(i, "split_mechanism", pa.array(new, pa.string()).dictionary_encode())
    out.mkdir(parents=True, exist_ok=True)
    if any(out.iterdir()):
        raise TellerError(f"{out}: not empty; write the nested dataset to a new folder (-o)")
    pq.write_table(kept, out / "records.parquet", compression="zstd")
    for name in (*TABLES, "subtrees"):
        p = src / (name if name == "subtrees" else f"{name}.parquet")
        if p.exists():
            _link_or_copy(p, out / p.name)
    rid, counts = np.unique(str_array(kept.column("run_id")), return_counts=True)
    per_run = dict(zip(rid.tolist(), counts.tolist(), strict=True))
    runs = [{**r, "records": int(per_run.get(str(r.get("run_id")), 0))} for r in sheet["runs"]]
    res = write_datasheet(kept, runs, out, seed=int(sheet.get("seed", 0)),
                          held_out={"mechanisms": inner, "workloads": sheet.get("held_out_workloads", [])},
                          sampling=sheet.get("sampling"))
    res["nested"] = {"of": str(src), "fold": fold, "outer_held_out_mechanisms": outer,
                     "records_left_out": int(records.num_rows - kept.num_rows),
                     "note": "only split_mechanism describes this dataset; its other split columns are the source's"}
    (out / "datasheet.json").write_text(json.dumps(res, indent=2, default=str))
    with open(out / "datasheet.md", "a") as f:
        f.write(f"\nNested hold-out (fold {fold}) of {src}: its held-out mechanisms ({', '.join(outer)}) left out "
                f"({res['nested']['records_left_out']} records); held out here: {', '.join(inner)}. Only split_mechanism "
                "describes this dataset.\n")
    return res

