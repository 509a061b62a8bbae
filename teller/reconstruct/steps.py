"""STEP rows and the request → step index (DESIGN.md §5.5).

A STEP node's message names its step number and request set Q(s) (``STEP id=12 reqs=req_0,req_3``).
The per-request tree C_q(s) is not copied: ``requests.parquet`` maps (request, step) to the
step's node id, and because the forest is a depth-first preorder the step's whole subtree is the
contiguous block of forest rows ``[step_id, step_id + size)`` (``size`` is in ``steps.parquet``).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

STEPS_SCHEMA = pa.schema(
    [
        ("step_id", pa.int64()),
        ("step_num", pa.int64()),
        ("node", pa.int32()),
        ("rank", pa.int32()),
        ("pid", pa.int64()),
        ("tid", pa.int64()),
        ("start_ns", pa.int64()),
        ("end_ns", pa.int64()),
        ("name", pa.string()),
        ("n_requests", pa.int32()),
        ("size", pa.int64()),
    ]
)

REQUESTS_SCHEMA = pa.schema(
    [
        ("request_id", pa.string()),
        ("step_id", pa.int64()),
        ("rank", pa.int32()),
        ("step_num", pa.int64()),
    ]
)


def split_requests(reqs: pa.Array) -> tuple[np.ndarray, pa.Array]:
    """Explode comma-separated request lists: (row index, request id), empty ids and repeats dropped."""
    lists = pc.split_pattern(pc.fill_null(reqs.cast(pa.string()), ""), ",")
    values = pc.utf8_trim_whitespace(pc.list_flatten(lists))
    rows = pc.list_parent_indices(lists).to_numpy(zero_copy_only=False).astype(np.int64)
    keep = pc.not_equal(values, "").to_numpy(zero_copy_only=False)
    rows, values = rows[keep], values.filter(pa.array(keep))
    if len(rows):
        t = pa.table({"row": rows, "req": values}).group_by(["row", "req"], use_threads=False).aggregate([])
        t = t.sort_by([("row", "ascending"), ("req", "ascending")])
        rows, values = t.column("row").to_numpy(), t.column("req").combine_chunks()
    return rows, values


def steps_tables(cols: dict[str, object]) -> tuple[pa.Table, pa.Table]:
    """Build ``steps`` and ``requests`` tables from per-STEP arrays (``cols`` keyed like STEPS_SCHEMA
    plus ``reqs``: the request-list text of each step, null when the message names none)."""
    rows, req_ids = split_requests(cols.pop("reqs"))
    n_req = np.bincount(rows, minlength=len(cols["step_id"])).astype(np.int32)
    steps = pa.table({**cols, "n_requests": n_req}).select(STEPS_SCHEMA.names).cast(STEPS_SCHEMA)
    requests = pa.table(
        {
            "request_id": req_ids,
            "step_id": np.asarray(cols["step_id"])[rows],
            "rank": np.asarray(cols["rank"])[rows],
            "step_num": np.asarray(cols["step_num"])[rows],
        }
    ).cast(REQUESTS_SCHEMA)
    return steps, requests
