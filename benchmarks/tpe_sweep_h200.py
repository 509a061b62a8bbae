"""TPE compression on the labelled H200 dataset (``data/h200_v2``): train on one split's steps,
encode another's, per vocabulary size, with and without ``--max-token-nodes``.

The dataset has no run directories: its steps are the DFS blocks of the dataset's subtrees
(:func:`teller.dataset.codec.read_subtrees`), whose node ids are each run's own forest row
numbers. :func:`load_steps` turns the table into one :class:`teller.tpe.serialize.Forest` (row
numbers of the whole table, parents remapped, a parent outside the table becomes -1) and
serializes every kept step with :func:`teller.tpe.serialize.serialize_steps`; a step's labels
come from its vertical records (one per request; ``is_anomaly`` and ``fault_type`` are step
labels, constant over a step's records).

Protocols (which steps train the tokenizer, which are encoded):

- ``request``: the dataset's ``split_request``: train on the distinct steps (run_id, step_id)
  with a ``train`` vertical record, encode those with a ``test`` record. It is what a model
  trained on that split would see, but not held out at the step level: ``split_request`` splits
  requests, and a step serves about 26 of them, so nearly every test step also has train records
  (the JSON counts them, and reports the few that do not as the group ``not_in_train``).
- ``run``: ``split_run``: train on the steps of the train runs, encode the steps of the test runs
  (runs never seen in training).
- ``mechanism``: mechanism-disjoint at run level: encode every step of the runs that contain a
  held-out mechanism (those whose abnormal records are all ``split_mechanism == "test"``), train
  on the steps of the other runs that have a ``split_mechanism == "train"`` record.

Each row: a tokenizer trained for that vocabulary size (a separate training, so the training
time is that size's), encoding the test steps; per group (all, normal, abnormal, each fault
category, each mechanism): mean nodes and tokens per step, mean per-step reduction
``1 - tokens / nodes`` (as in ``bench_tpe.py sweep``), the reduction of the summed lengths, and
unknown symbols (nodes whose symbol the training steps never had). ``within_run`` compares
abnormal with normal steps of the same run (runs with both in the test set), which removes the
workload differences between runs. Peak memory: ``tracemalloc`` peaks (Python and numpy
allocations) of one training and one encoding at the largest size, and the process' peak
resident set.

:func:`make_tpe_encoder` is the ``encode(records, subtrees)`` hook of
:func:`teller.dataset.build.attach_tpe`; :func:`attach_demo` fills the TPE fields of the test
split's records (vertical and horizontal; a horizontal record's sequence is its ranks' steps one
after the other, each a root) with the 1024-token tokenizer of the ``request`` protocol and
checks that the tokens decode to the steps' nodes.

    python benchmarks/tpe_sweep_h200.py                      # all of it, about 80 s on 2 cores
    python benchmarks/tpe_sweep_h200.py --protocols request --sizes 256 1024

The committed ``benchmarks/results/tpe_sweep_h200.json`` and the 80 s were measured on dataset v1
(``--data data/h200_v1``; ``git checkout 644acca -- data/h200_v1`` restores it).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import tracemalloc
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parents[1]
SIZES = (128, 192, 256, 320, 384, 512, 1024, 2048)
CAPS = (0, 16)
PROTOCOLS = ("request", "run", "mechanism")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_tpe import _peak_rss_mib  # noqa: E402  (the benchmarks folder holds the helper)

# --------------------------------------------------------------------------------------------
# the dataset's steps


@dataclass
class StepIndex:
    """Every kept step of a dataset, serialized; ``key`` (run code, step id) finds a step's row."""

    subtrees: pa.Table
    runs: list[str]  # run code -> run_id
    key: np.ndarray  # run code << 40 | step_id, one per step, in the order of ``seqs``
    run: np.ndarray  # run code per step
    step_id: np.ndarray
    seqs: object  # teller.tpe.serialize.Sequences, one sequence per step

    def find(self, run_codes: np.ndarray, step_ids: np.ndarray) -> np.ndarray:
        """Step indices of (run code, step id) pairs; -1 where the dataset has no such step."""
        k = np.asarray(run_codes, np.int64) << 40 | np.asarray(step_ids, np.int64)
        order = np.argsort(self.key, kind="stable")
        j = np.searchsorted(self.key[order], k)
        j = np.minimum(j, len(order) - 1)
        hit = self.key[order][j] == k
        return np.where(hit, order[j], -1)

    def run_codes(self, run_ids: pa.ChunkedArray | pa.Array) -> np.ndarray:
        codes = pc.index_in(run_ids.cast(pa.string()), value_set=pa.array(self.runs, pa.string()))
        return codes.fill_null(-1).to_numpy(zero_copy_only=False).astype(np.int64)


def load_steps(subtrees: pa.Table, normalizer=None, duration: str = "self") -> StepIndex:
    """Serialize every step of a subtree table (``read_subtrees`` output) in one pass."""
    from teller.forest import Forest
    from teller.tpe.serialize import serialize_steps

    run = subtrees.column("run_id").combine_chunks()
    if not pa.types.is_dictionary(run.type):
        run = run.dictionary_encode()
    rcode = run.indices.to_numpy(zero_copy_only=False).astype(np.int64)
    nid = subtrees.column("node_id").to_numpy().astype(np.int64)
    par = subtrees.column("parent_id").to_numpy().astype(np.int64)
    sid = subtrees.column("step_id").to_numpy().astype(np.int64)
    row = np.arange(len(nid), dtype=np.int64)
    # a step's rows are the block [step_id, step_id + size) of its run's forest: the parent of a
    # node is `node_id - parent_id` rows above it, inside the same block (its step's root has none);
    # rows outside every step (step_id -1: schedule ranges and their calls, as data/h200_v2 keeps
    # them) find their parent the same way; node ids of several runs collide, so the table is
    # renumbered by row
    up = row - (nid - par)
    inside = (par >= 0) & (nid != sid) & (up >= 0) & (up < row)
    idx = np.flatnonzero(inside)
    inside[idx] = (nid[up[idx]] == par[idx]) & (rcode[up[idx]] == rcode[idx])
    gpar = np.where(inside, up, -1)
    table = subtrees.set_column(subtrees.column_names.index("parent_id"), "parent_id", pa.array(gpar))
    table = table.set_column(table.column_names.index("node_id"), "node_id", pa.array(row))
    forest = Forest.from_table(table, path="subtrees")
    roots = np.flatnonzero(nid == sid)
    seqs = serialize_steps(forest, roots, duration, normalizer)
    return StepIndex(
        subtrees,
        [str(x) for x in run.dictionary.to_pylist()],
        rcode[roots] << 40 | sid[roots],
        rcode[roots],
        sid[roots],
        seqs,
    )


@dataclass
class StepLabels:
    """Per step (aligned with ``StepIndex``): labels and split membership of its vertical records."""

    is_anomaly: np.ndarray
    fault_type: np.ndarray  # object
    mechanism: np.ndarray  # object
    split_run: np.ndarray  # object
    request_splits: dict[str, np.ndarray]  # split -> has a record in it
    mechanism_splits: dict[str, np.ndarray]
    heldout_run: np.ndarray  # the step's run holds a held-out mechanism
    held_out: list[str]


def step_labels(records: pa.Table, idx: StepIndex) -> StepLabels:
    vert = records.filter(pc.equal(records.column("view"), "vertical"))
    st = idx.find(idx.run_codes(vert.column("run_id")), vert.column("step_id").to_numpy())
    if (st < 0).any():
        raise SystemExit(
            f"{int((st < 0).sum())} vertical records name a step that the subtrees lack"
        )
    n = len(idx.key)
    first = np.full(n, -1, np.int64)
    first[st[::-1]] = np.arange(len(st))[::-1]
    if (first < 0).any():
        print(f"note: {int((first < 0).sum())} kept steps have no vertical record", file=sys.stderr)

    def col(c: str) -> np.ndarray:
        return np.asarray(
            vert.column(c).cast(pa.string()).to_pylist()
            if c.startswith("split")
            else vert.column(c).to_pylist(),
            dtype=object,
        )

    def at_first(x: np.ndarray, fill) -> np.ndarray:
        out = np.full(n, fill, dtype=x.dtype)
        out[first >= 0] = x[first[first >= 0]]
        return out

    def membership(c: np.ndarray) -> dict[str, np.ndarray]:
        out = {}
        for s in ("train", "val", "test"):
            m = np.zeros(n, bool)
            m[st[c == s]] = True
            out[s] = m
        return out

    is_ab = vert.column("is_anomaly").to_numpy(zero_copy_only=False).astype(bool)
    ab = np.zeros(n, bool)
    np.logical_or.at(ab, st, is_ab)
    mech, smech = col("mechanism"), col("split_mechanism")
    # held-out mechanisms: every abnormal record of theirs is in split_mechanism's test
    held = sorted(
        m for m in set(mech[is_ab].tolist()) if m and np.all(smech[is_ab & (mech == m)] == "test")
    )
    run_held = np.zeros(len(idx.runs), bool)
    rc = idx.run[st]
    run_held[np.unique(rc[np.isin(mech, held)])] = True
    return StepLabels(
        ab,
        at_first(col("fault_type"), ""),
        at_first(mech, ""),
        at_first(col("split_run"), ""),
        membership(col("split_request")),
        membership(smech),
        run_held[idx.run],
        held,
    )


def protocol_masks(name: str, lab: StepLabels) -> tuple[np.ndarray, np.ndarray, str]:
    if name == "request":
        return (
            lab.request_splits["train"],
            lab.request_splits["test"],
            (
                "train: steps with a split_request=train vertical record; test: steps with a split_request=test record"
            ),
        )
    if name == "run":
        return (
            lab.split_run == "train",
            lab.split_run == "test",
            "train: steps of split_run=train runs; test: steps of split_run=test runs",
        )
    if name == "mechanism":
        return (
            (~lab.heldout_run) & lab.mechanism_splits["train"],
            lab.heldout_run,
            (
                "test: every step of the runs holding a held-out mechanism; train: steps of the other runs with a "
                "split_mechanism=train record"
            ),
        )
    raise SystemExit(f"unknown protocol {name!r}; pick from {PROTOCOLS}")


# --------------------------------------------------------------------------------------------
# statistics


def group_stats(tokens: np.ndarray, nodes: np.ndarray, unknown: np.ndarray) -> dict:
    if not len(nodes):
        return {"steps": 0}
    return {
        "steps": int(len(nodes)),
        "mean_nodes": float(nodes.mean()),
        "mean_tokens": float(tokens.mean()),
        "reduction": float(np.mean(1 - tokens / nodes)),
        "reduction_of_total": float(1 - tokens.sum() / nodes.sum()),
        "unknown_nodes": int(unknown.sum()),
        "unknown_share": float(unknown.sum() / nodes.sum()),
        "steps_with_unknown": int((unknown > 0).sum()),
    }


def groups_of(
    lab: StepLabels, test: np.ndarray, extra: dict[str, np.ndarray] | None = None
) -> dict[str, np.ndarray]:
    """Boolean masks over the test steps (in their order)."""
    ab, ft, mech = lab.is_anomaly[test], lab.fault_type[test], lab.mechanism[test]
    g = {"all": np.ones(len(ab), bool), "normal": ~ab, "abnormal": ab}
    for c in sorted(set(ft[ab].tolist())):
        g[f"fault:{c}"] = ab & (ft == c)
    for m in sorted(set(mech[ab].tolist())):
        g[f"mechanism:{m}"] = ab & (mech == m)
    for k, v in (extra or {}).items():
        g[k] = v
    return g


def within_run(
    run: np.ndarray, ab: np.ndarray, red: np.ndarray, nodes: np.ndarray, unknown: np.ndarray
) -> dict:
    """Abnormal minus normal steps of the same run, averaged over runs that have both."""
    d_red, d_nodes, d_unk, worse = [], [], [], 0
    for r in np.unique(run):
        m = run == r
        a, n = m & ab, m & ~ab
        if a.any() and n.any():
            d_red.append(red[a].mean() - red[n].mean())
            d_nodes.append(nodes[a].mean() - nodes[n].mean())
            d_unk.append(unknown[a].sum() / nodes[a].sum() - unknown[n].sum() / nodes[n].sum())
            worse += int(red[a].mean() < red[n].mean())
    if not d_red:
        return {"runs": 0}
    return {
        "runs": len(d_red),
        "runs_abnormal_compress_worse": worse,
        "reduction_diff": float(np.mean(d_red)),
        "reduction_diff_min": float(np.min(d_red)),
        "reduction_diff_max": float(np.max(d_red)),
        "mean_nodes_diff": float(np.mean(d_nodes)),
        "unknown_share_diff": float(np.mean(d_unk)),
    }


def unknown_symbols(tok, seqs, lab: StepLabels, test: np.ndarray, top: int = 12) -> list[dict]:
    """The test steps' symbols the tokenizer does not know, most frequent first."""
    unk = np.array([tok.is_unknown(np.array([tok.id_of(s)]))[0] for s in seqs.symbols], bool)
    step = np.repeat(np.arange(len(seqs)), seqs.lengths())
    hit = unk[seqs.codes]
    if not hit.any():
        return []
    codes, ab = seqs.codes[hit], lab.is_anomaly[test][step[hit]]
    out = []
    for c in np.argsort(-np.bincount(codes, minlength=len(seqs.symbols)))[:top]:
        m = codes == c
        if not m.any():
            break
        steps = np.unique(step[hit][m])
        out.append(
            {
                "symbol": seqs.symbols[c],
                "nodes": int(m.sum()),
                "steps": int(len(steps)),
                "abnormal_steps": int(lab.is_anomaly[test][steps].sum()),
                "fault_types": sorted(
                    set(lab.fault_type[test][steps][lab.is_anomaly[test][steps]].tolist())
                ),
                "nodes_in_abnormal_steps": int(ab[m].sum()),
            }
        )
    return out


# --------------------------------------------------------------------------------------------
# the attach_tpe hook


def make_tpe_encoder(tok, index: StepIndex | None = None):
    """``encode(records, subtrees)`` for :func:`teller.dataset.build.attach_tpe`: one row per record
    with ``input_ids``, ``parent_idx``, ``duration``, ``depth``. A record's sequence is its steps
    (``step_ids``: one for a vertical record, every rank's for a horizontal one) one after the
    other, each a root (``parent_idx`` -1). Distinct steps are encoded once."""
    from teller.tpe.serialize import ranges

    def encode(records: pa.Table, subtrees: pa.Table) -> pa.Table:
        idx = (
            index
            if index is not None and index.subtrees is subtrees
            else load_steps(subtrees, tok.normalizer, tok.duration)
        )
        lists = records.column("step_ids").combine_chunks()
        per_rec = np.diff(lists.offsets.to_numpy()).astype(np.int64)
        flat = lists.values.to_numpy().astype(np.int64)
        rec = np.repeat(np.arange(records.num_rows, dtype=np.int64), per_rec)
        st = idx.find(idx.run_codes(records.column("run_id"))[rec], flat)
        if (st < 0).any():
            j = int(np.flatnonzero(st < 0)[0])
            raise SystemExit(
                f"record {int(rec[j])}: step {int(flat[j])} of {records.column('run_id')[int(rec[j])]} is not in subtrees"
            )
        uniq, inv = np.unique(st, return_inverse=True)
        enc = tok.encode_batch(idx.seqs.select(uniq))
        n = enc.lengths()[inv]  # tokens of each (record, step) piece
        rows = ranges(enc.offsets[inv], enc.offsets[inv + 1])
        rec_tok = np.bincount(rec, weights=n, minlength=records.num_rows).astype(np.int64)
        offsets = np.zeros(records.num_rows + 1, np.int64)
        np.cumsum(rec_tok, out=offsets[1:])
        before = np.cumsum(n) - n - offsets[rec]  # tokens of the record's earlier pieces
        p = enc.parent_idx[rows].astype(np.int64)
        p = np.where(p >= 0, p + np.repeat(before, n), -1)
        off = pa.array(offsets.astype(np.int32))
        return pa.table(
            {
                "input_ids": pa.ListArray.from_arrays(
                    off, pa.array(enc.input_ids[rows].astype(np.int32))
                ),
                "parent_idx": pa.ListArray.from_arrays(off, pa.array(p.astype(np.int32))),
                "duration": pa.ListArray.from_arrays(
                    off, pa.array(enc.duration[rows].astype(np.int64))
                ),
                "depth": pa.ListArray.from_arrays(off, pa.array(enc.depth[rows].astype(np.int32))),
            }
        )

    return encode


def _same(a: pa.ChunkedArray, b: pa.ChunkedArray) -> bool:
    """Column equality with NaN equal to NaN (``effect_ms`` is NaN for normal steps)."""
    if pa.types.is_floating(a.type) and a.type == b.type:
        return bool(np.array_equal(a.to_numpy(), b.to_numpy(), equal_nan=True))
    return a.equals(b)


def attach_demo(ds: Path, tok, index: StepIndex) -> dict:
    """Fill the test split's TPE fields through ``attach_tpe`` and check them against the steps."""
    from teller.dataset.build import TPE_FIELDS, attach_tpe

    records = pq.read_table(ds / "records.parquet")
    test = records.filter(pc.equal(records.column("split_request").cast(pa.string()), "test"))
    t0 = time.perf_counter()
    out = attach_tpe(test, index.subtrees, make_tpe_encoder(tok, index))
    secs = time.perf_counter() - t0
    checks: dict = {
        "records": out.num_rows,
        "seconds": round(secs, 2),
        "schema_unchanged": out.schema == test.schema,
        "other_columns_unchanged": all(
            _same(out.column(c), test.column(c)) for c in test.column_names if c not in TPE_FIELDS
        ),
        "null_tpe_fields": {f: int(out.column(f).null_count) for f in TPE_FIELDS},
    }
    ids = out.column("input_ids").combine_chunks()
    dep = out.column("depth").combine_chunks()
    par = out.column("parent_idx").combine_chunks()
    tok_off = ids.offsets.to_numpy().astype(np.int64)
    flat_ids = ids.values.to_numpy().astype(np.int64)
    # nodes the tokens stand for, per record, against the sizes of the record's steps
    nodes_dec = (
        np.add.reduceat(tok.token_length(flat_ids), tok_off[:-1]) if len(flat_ids) else np.zeros(0)
    )
    nodes_dec[np.diff(tok_off) == 0] = 0
    lists = out.column("step_ids").combine_chunks()
    per_rec = np.diff(lists.offsets.to_numpy()).astype(np.int64)
    rec = np.repeat(np.arange(out.num_rows), per_rec)
    st = index.find(index.run_codes(out.column("run_id"))[rec], lists.values.to_numpy())
    nodes_true = np.bincount(rec, weights=index.seqs.lengths()[st], minlength=out.num_rows).astype(
        np.int64
    )
    checks["decoded_node_count_matches"] = int((nodes_dec == nodes_true).sum())
    checks["tokens"] = int(len(flat_ids))
    checks["nodes"] = int(nodes_true.sum())
    # every parent index points earlier in its own record
    pos = np.arange(len(flat_ids)) - np.repeat(tok_off[:-1], np.diff(tok_off))
    p = par.values.to_numpy().astype(np.int64)
    checks["parent_idx_valid"] = bool(np.all((p == -1) | ((p >= 0) & (p < pos))))
    # one vertical and one horizontal record, symbol by symbol and node-level tree
    examples = []
    view = np.asarray(out.column("view").to_pylist(), dtype=object)
    for v in ("vertical", "horizontal"):
        cand = np.flatnonzero(view == v)
        if not cand.size:
            continue
        r = int(cand[0])
        lo, hi = lists.offsets.to_numpy()[r : r + 2]
        sts = index.find(
            np.full(hi - lo, index.run_codes(out.column("run_id"))[r]),
            lists.values.to_numpy()[lo:hi],
        )
        seq = index.seqs.select(sts)
        want = [seq.symbols[c] for c in seq.codes.tolist()]
        # the record's node-level tree: its steps one after the other, parents shifted to match
        shift = np.repeat(seq.offsets[:-1], seq.lengths())
        want_par = np.where(seq.parent >= 0, seq.parent + shift, -1)
        a, b = tok_off[r], tok_off[r + 1]
        got = tok.decode(flat_ids[a:b])
        tree = tok.decode_tree(flat_ids[a:b], dep.values.to_numpy()[a:b])
        examples.append(
            {
                "record": r,
                "view": v,
                "steps": len(sts),
                "nodes": len(want),
                "tokens": int(b - a),
                "decode_equals_symbols": got == want,
                "decode_tree_equals_parents": bool(
                    np.array_equal(tree.parent, want_par) and np.array_equal(tree.depth, seq.depth)
                ),
            }
        )
    checks["examples"] = examples
    return checks


# --------------------------------------------------------------------------------------------


def sweep(args: argparse.Namespace) -> dict:
    from teller.dataset.codec import read_subtrees
    from teller.tpe.trainer import train

    ds = Path(args.data)
    t0 = time.perf_counter()
    subtrees = read_subtrees(ds)
    t_read = time.perf_counter() - t0
    t0 = time.perf_counter()
    index = load_steps(subtrees)
    t_ser = time.perf_counter() - t0
    seqs = index.seqs
    records = pq.read_table(
        ds / "records.parquet",
        columns=[
            "run_id",
            "step_id",
            "view",
            "is_anomaly",
            "fault_type",
            "mechanism",
            "split_request",
            "split_run",
            "split_mechanism",
        ],
    )
    lab = step_labels(records, index)
    lens = seqs.lengths()
    print(
        f"{len(seqs):,} steps, {seqs.n_nodes:,} nodes ({len(seqs.symbols)} symbols); read {t_read:.1f} s, "
        f"serialized {t_ser:.1f} s; peak RSS {_peak_rss_mib():.0f} MiB",
        file=sys.stderr,
    )
    result: dict = {
        "dataset": str(ds.relative_to(REPO) if ds.resolve().is_relative_to(REPO) else ds),
        "steps": len(seqs),
        "nodes": int(seqs.n_nodes),
        "mean_step_nodes": float(lens.mean()),
        "abnormal_steps": int(lab.is_anomaly.sum()),
        "symbols": len(seqs.symbols),
        "sampled": False,
        "held_out_mechanisms": lab.held_out,
        "read_seconds": round(t_read, 2),
        "serialize_seconds": round(t_ser, 2),
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "numpy": np.__version__,
            "pyarrow": pa.__version__,
        },
        "protocols": {},
        "rows": [],
    }
    tok_attach = None
    for proto in args.protocols:
        tr, te, desc = protocol_masks(proto, lab)
        tr_i, te_i = np.flatnonzero(tr), np.flatnonzero(te)
        train_seqs, test_seqs = seqs.select(tr_i), seqs.select(te_i)
        extra = {"not_in_train": ~tr[te_i]} if proto == "request" else {}
        groups = groups_of(lab, te_i, extra)
        info = {
            "description": desc,
            "train_steps": int(len(tr_i)),
            "train_nodes": int(train_seqs.n_nodes),
            "test_steps": int(len(te_i)),
            "test_nodes": int(test_seqs.n_nodes),
            "test_steps_also_in_train": int((tr & te).sum()),
            "test_abnormal_steps": int(lab.is_anomaly[te_i].sum()),
        }
        result["protocols"][proto] = info
        print(
            f"\n{proto}: {desc}\n  train {len(tr_i):,} steps ({train_seqs.n_nodes:,} nodes), test {len(te_i):,} "
            f"({info['test_steps_also_in_train']:,} of them also train steps)",
            file=sys.stderr,
        )
        for cap in args.caps:
            for v in args.sizes:
                t0 = time.perf_counter()
                try:
                    tok = train(
                        train_seqs, v, min_frequency=args.min_frequency, max_token_nodes=cap or None
                    )
                except Exception as e:  # below the base vocabulary
                    if "smaller than the base vocabulary" not in str(e):
                        raise
                    result["rows"].append(
                        {
                            "protocol": proto,
                            "max_token_nodes": cap or None,
                            "vocab_requested": v,
                            "below_base": True,
                        }
                    )
                    continue
                t_train = time.perf_counter() - t0
                t0 = time.perf_counter()
                enc = tok.encode_batch(test_seqs)
                t_enc = time.perf_counter() - t0
                ntok, nn, unk = enc.lengths(), enc.n_nodes, enc.n_unknown
                red = 1 - ntok / nn
                row = {
                    "protocol": proto,
                    "max_token_nodes": cap or None,
                    "vocab_requested": v,
                    "vocab": len(tok),
                    "base_vocab": tok.n_base,
                    "stop": tok.meta["training"]["stop"],
                    "train_seconds": round(t_train, 3),
                    "encode_seconds": round(t_enc, 3),
                    "encode_nodes_per_second": float(nn.sum() / t_enc),
                    "train_distinct_steps": tok.meta["training"]["distinct_sequences"],
                    "groups": {g: group_stats(ntok[m], nn[m], unk[m]) for g, m in groups.items()},
                    "within_run": within_run(index.run[te_i], lab.is_anomaly[te_i], red, nn, unk),
                }
                result["rows"].append(row)
                a = row["groups"]
                print(
                    f"  cap {cap or '-':>2} vocab {v:>5} ({len(tok):>4}): {a['all']['reduction']:.1%} "
                    f"(normal {a['normal']['reduction']:.1%}, abnormal {a['abnormal']['reduction']:.1%}), "
                    f"{a['all']['mean_tokens']:.0f} tokens/step, unknown {a['all']['unknown_share']:.2%}; "
                    f"train {t_train:.1f} s, encode {t_enc:.1f} s",
                    file=sys.stderr,
                )
                if proto == "request" and not cap and v == 1024:
                    tok_attach = tok
        info["unknown_symbols"] = unknown_symbols(tok, test_seqs, lab, te_i)
        if proto == args.protocols[0]:
            # peak memory of one training and one encoding at the largest size (tracemalloc)
            cap, v = (args.caps[0] or None), max(args.sizes)
            tracemalloc.start()
            tracemalloc.reset_peak()
            base = tracemalloc.get_traced_memory()[0]
            tok = train(train_seqs, v, min_frequency=args.min_frequency, max_token_nodes=cap)
            peak_train = tracemalloc.get_traced_memory()[1] - base
            tracemalloc.reset_peak()
            base = tracemalloc.get_traced_memory()[0]
            tok.encode_batch(test_seqs)
            peak_enc = tracemalloc.get_traced_memory()[1] - base
            tracemalloc.stop()
            result["memory"] = {
                "protocol": proto,
                "max_token_nodes": cap,
                "vocab_requested": v,
                "train_peak_mib": round(peak_train / 2**20, 1),
                "encode_peak_mib": round(peak_enc / 2**20, 1),
                "how": "tracemalloc peak above the memory held before the call (numpy and Python allocations)",
            }
    if tok_attach is not None and not args.no_attach:
        checks = attach_demo(ds, tok_attach, index)
        result["attach_tpe"] = {
            "tokenizer": "request protocol, vocabulary 1024, no token cap",
            **checks,
        }
        print(
            f"\nattach_tpe on the test split: {checks['records']:,} records, {checks['tokens']:,} tokens for "
            f"{checks['nodes']:,} nodes in {checks['seconds']} s; decoded node count matches on "
            f"{checks['decoded_node_count_matches']:,} of {checks['records']:,} records; parent_idx valid: "
            f"{checks['parent_idx_valid']}; schema unchanged: {checks['schema_unchanged']}; other columns unchanged: "
            f"{checks['other_columns_unchanged']}; nulls left: {checks['null_tpe_fields']}"
        )
        for e in checks["examples"]:
            print(
                f"  {e['view']} record {e['record']}: {e['steps']} step(s), {e['nodes']} nodes -> {e['tokens']} tokens; "
                f"decode == symbols: {e['decode_equals_symbols']}; decode_tree == parents and depths: {e['decode_tree_equals_parents']}"
            )
    result["peak_rss_mib"] = round(_peak_rss_mib(), 0)
    return result


def print_tables(res: dict) -> None:
    for proto in res["protocols"]:
        for cap in sorted(
            {r["max_token_nodes"] or 0 for r in res["rows"] if r["protocol"] == proto}
        ):
            rows = [
                r
                for r in res["rows"]
                if r["protocol"] == proto and (r["max_token_nodes"] or 0) == cap
            ]
            print(
                f"\n{proto}, max_token_nodes = {cap or 'none'} (mean per-step reduction; * = training stopped below the size asked)\n"
            )
            print(
                "| vocabulary | all | normal | abnormal | communication | kernel | memory | runtime | scheduling | tokens/step | unknown nodes | train s | encode s |"
            )
            print("|---|" + "---|" * 12)
            for r in rows:
                if r.get("below_base"):
                    print(f"| {r['vocab_requested']} | (below base) |" + " |" * 11)
                    continue
                g = r["groups"]

                def pct(k: str, g: dict = g) -> str:
                    return f"{g[k]['reduction']:.1%}" if k in g else ""

                star = "*" if r["vocab"] < r["vocab_requested"] else ""
                print(
                    f"| {r['vocab_requested']}{star} | {pct('all')} | {pct('normal')} | {pct('abnormal')} | "
                    + " | ".join(
                        pct(f"fault:{c}")
                        for c in ("communication", "kernel", "memory", "runtime", "scheduling")
                    )
                    + f" | {g['all']['mean_tokens']:.0f} | {g['all']['unknown_share']:.3%} | {r['train_seconds']:.1f} | {r['encode_seconds']:.1f} |"
                )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default=str(REPO / "data" / "h200_v2"))
    ap.add_argument(
        "--out", type=Path, default=REPO / "benchmarks" / "results" / "tpe_sweep_h200.json"
    )
    ap.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    ap.add_argument(
        "--caps", type=int, nargs="+", default=list(CAPS), help="max token nodes; 0: no cap"
    )
    ap.add_argument("--protocols", nargs="+", default=list(PROTOCOLS), choices=PROTOCOLS)
    ap.add_argument("--min-frequency", type=int, default=2)
    ap.add_argument("--no-attach", action="store_true", help="skip the attach_tpe check")
    args = ap.parse_args()
    t0 = time.perf_counter()
    res = sweep(args)
    res["total_seconds"] = round(time.perf_counter() - t0, 1)
    if args.out:
        args.out.write_text(json.dumps(res, indent=1) + "\n")
        print(f"\nwrote {args.out}", file=sys.stderr)
    print_tables(res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
