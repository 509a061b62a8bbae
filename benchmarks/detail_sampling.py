"""What step sampling (``teller record --detail-every K``) keeps, per step, on a real recording.

    python benchmarks/detail_sampling.py RUN [RUN ...] [--json OUT]

For each reconstructed run: the steps marked ``detail=0`` and the others, and per class the
kernels, memory copies, runtime calls and BE ranges bound to the step (medians and totals), so a
sampled recording can be set beside one with every step in detail (``--detail-every 1``): a
detailed step of a sampled run should hold what every step of the full run holds, a sampled-out
step none of it. Also the detail gate's own figures from ``run.json`` (steps, detailed, collector
switches and their time).

``--pace`` adds what a detailed step costs the engine, measured inside the one run (issue 16 §2:
whole runs of one configuration differ in pace by more than recording costs, docs/overhead.md):
each engine iteration's time per token (prefill + decode tokens of its batch), the detailed
windows' median against the light (``detail=0``) iterations on either side of each window, over
the same number of iterations, per process in time order. Iterations that hold a collector switch
(``OTHER detail_switch``) are set apart and reported as the switches' own excess; warm-up
iterations are left out. A recording with long windows (e.g. ``--detail-every 16 --detail-window
8`` on a saturated queue) pairs many windows with their neighbours, so the engine's drift over
the run cancels. A run recorded with ``TELLER_DETAIL_QUIET=alternate`` (every other block of
light steps records nothing inside its STEP range; their messages carry ``quiet=1``) also gets
``light_cost_*``: each light block's median time per token against the quiet iterations on
either side of it, i.e. what the light recording (the STEP, FE, COMM and OTHER ranges that every
step keeps) costs against almost none, inside the one run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from teller.forest import Forest
from teller.reconstruct.steps import without_detail
from teller.rundir import LAYER_CODE, RunDir


def step_counts(run: str | Path) -> dict[str, Any]:
    rd = RunDir(run).require()
    fa = Forest.read(rd.path)
    steps = rd.read_table("steps")
    names = [x or "" for x in steps.column("name").to_pylist()]
    detailed = ~without_detail(names)
    n = len(names)
    sidx = fa.step_idx
    inside = sidx >= 0
    kinds = {
        "kernels": fa.kind_or_layer("KERNEL", "K") & fa.is_gpu,
        "copies": (fa.kind_or_layer("MEMCPY", "MEM") | fa.kind_or_layer("MEMSET", "MEM")) & fa.is_gpu,
        "runtime_calls": fa.kind_or_layer("RUNTIME", "RT") & ~fa.is_gpu,
        "be_ranges": fa.layer == LAYER_CODE["BE"],
        "fe_ranges": fa.layer == LAYER_CODE["FE"],
    }
    out: dict[str, Any] = {"run": str(rd.path), "steps": n, "detailed": int(detailed.sum())}
    for cls, mask in (("detailed", detailed), ("sampled_out", ~detailed)):
        row: dict[str, Any] = {"steps": int(mask.sum())}
        for name, m in kinds.items():
            c = np.bincount(sidx[m & inside], minlength=n)[:n]
            v = c[mask]
            row[name] = {"median": float(np.median(v)) if len(v) else None, "total": int(v.sum()),
                         "steps_with_none": int((v == 0).sum())}
        out[cls] = row
    info = json.loads((rd.path / "run.json").read_text())
    gates = []
    for p in info.get("processes", []) or []:
        coll = p.get("collector") or {}
        if coll.get("detail"):
            gates.append(coll["detail"])
    out["gates"] = gates
    out["cupti_switches"] = [c.get("detail_switches") for p in info.get("processes", []) or []
                             for c in (p.get("collectors") or []) if isinstance(c, dict) and c.get("name") == "cupti"]
    return out


def _blocks(member: np.ndarray):
    """Each run of consecutive members ``[a, b)`` with the positions of as many iterations on
    either side of it (``around``)."""
    edges = np.flatnonzero(np.diff(np.r_[0, member.astype(np.int8), 0]))
    for a, b in zip(edges[::2].tolist(), edges[1::2].tolist(), strict=True):
        w = b - a
        yield a, b, np.r_[np.arange(max(0, a - w), a), np.arange(b, min(len(member), b + w))]


def _finite(x: np.ndarray) -> np.ndarray:
    return x[np.isfinite(x)]


def _mean_ci(ratios: list[float], name: str) -> dict[str, float]:
    """``NAME_mean``, ``NAME_ci95`` (half-width of the t interval; NaN for one ratio) and
    ``NAME_median`` of the ratios minus one."""
    from scipy import stats

    r = np.asarray(ratios) - 1.0
    half = float(stats.t.ppf(0.975, len(r) - 1) * r.std(ddof=1) / np.sqrt(len(r))) if len(r) > 1 else float("nan")
    return {f"{name}_mean": float(r.mean()), f"{name}_ci95": half, f"{name}_median": float(np.median(r))}


def _pair_light(lanes, keep: np.ndarray, quiet: np.ndarray, x: np.ndarray, both_sides: bool = False) -> list[float]:
    """Per lane (the iterations ``keep`` selects, in time order): each light block's median of
    ``x`` over the median of its quiet neighbours' (NaN left out); with ``both_sides`` only blocks
    with quiet neighbours before and after."""
    r: list[float] = []
    for o in lanes:
        o = o[keep[o]]
        q, xo = quiet[o], x[o]
        for a, b, around in _blocks(~q):
            if both_sides and not (q[around[around < a]].any() and q[around[around >= b]].any()):
                continue
            xl, xq = _finite(xo[a:b]), _finite(xo[around[q[around]]])
            if len(xl) and len(xq):
                r.append(float(np.median(xl) / np.median(xq)))
    return r


def _steady(lanes, keep: np.ndarray, tok: np.ndarray) -> list[np.ndarray]:
    """Per lane, the iterations ``keep`` selects that serve at least half the median tokens of
    those (the run's start and its drain left out); empty lanes dropped."""
    sel = [o[keep[o]] for o in lanes]
    return [o[tok[o] >= 0.5 * np.median(tok[o])] for o in sel if len(o)]


def pace(run: str | Path, iterations: list | None = None) -> dict[str, Any]:
    """The in-run cost of detail (module docstring): per window, its median time per token over
    that of its light neighbours; their mean and 95% interval (t), and the switch iterations'."""
    import pyarrow.parquet as pq

    rd = RunDir(run).require()
    it = rd.read_table("iterations")
    st = rd.read_table("steps")
    names = dict(zip(st.column("step_id").to_pylist(), st.column("name").to_pylist(), strict=True))
    f = pq.read_table(rd.path / "forest.parquet", columns=["name", "step_idx", "pid", "start_ns", "end_ns"])
    sw_name = np.asarray([str(x or "") for x in f.column("name").to_pylist()], dtype=object)
    six = f.column("step_idx").to_numpy(zero_copy_only=False)
    fpid = f.column("pid").to_numpy(zero_copy_only=False)
    sw = (sw_name == "detail_switch") | (sw_name == "OTHER detail_switch")
    switch_keys = set(zip(fpid[sw].tolist(), six[sw].tolist(), strict=True))
    sid = it.column("step_id").to_numpy()
    pid = it.column("pid").to_numpy()
    idx = it.column("step_idx").to_numpy()
    start = it.column("start_ns").to_numpy()
    dur = it.column("dur_ns").to_numpy().astype(float)
    pre = it.column("prefill").to_numpy().astype(float)
    dec = it.column("decode").to_numpy().astype(float)
    tok = pre + dec
    warm = it.column("warmup").to_numpy(zero_copy_only=False).astype(bool)
    detailed = ~without_detail([names.get(int(s), "") or "" for s in sid])
    is_switch = np.asarray([(int(p), int(i)) in switch_keys for p, i in zip(pid, idx, strict=True)], bool)
    with np.errstate(all="ignore"):
        per_tok = np.where(tok > 0, dur / np.where(tok > 0, tok, 1), np.nan)
    quiet = np.asarray([" quiet=1" in (names.get(int(q), "") or "") for q in sid], bool)
    if iterations is not None:  # one row per iteration (--iterations-out)
        import pyarrow as pa

        cls = np.where(detailed, "D", np.where(quiet, "Q", "L"))
        iterations.append(pa.table({"run": [str(rd.path)] * len(sid), "pid": pid, "cls": cls.tolist(),
                                    "switch": is_switch, "warmup": warm, "start_ns": start,
                                    "dur_ns": it.column("dur_ns").to_numpy(), "prefill": pre.astype(np.int64),
                                    "decode": dec.astype(np.int64)}))
    ratios: list[float] = []
    sw_excess: list[float] = []
    lanes = [o[np.argsort(start[o], kind="stable")] for o in (np.flatnonzero(pid == p) for p in np.unique(pid))]
    for o in lanes:  # per process, in time order
        o = o[~warm[o]]
        d, x, s = detailed[o], per_tok[o], is_switch[o]
        for a, b, around in _blocks(d):  # detailed windows [a, b)
            inside = np.arange(a, b)
            xi, xa = _finite(x[inside[~s[inside]]]), _finite(x[around[~d[around] & ~s[around]]])
            if len(xi) and len(xa):
                ratios.append(float(np.median(xi) / np.median(xa)))
            xs = _finite(x[around[s[around]]])
            if len(xs) and len(xa):
                sw_excess += (xs / np.median(xa) - 1.0).tolist()
    out: dict[str, Any] = {"run": str(rd.path), "iterations": int(len(sid)), "detailed": int(detailed.sum()),
                           "switch_iterations": int(is_switch.sum()), "windows_paired": len(ratios)}
    if ratios:
        out.update(_mean_ci(ratios, "detail_cost"))
    if sw_excess:
        out["switch_excess_median"] = float(np.median(sw_excess))
    # TELLER_DETAIL_QUIET=alternate: light blocks against the quiet blocks beside them
    if quiet.any() and (~quiet & ~detailed).any():
        lr: list[float] = []
        first: list[bool] = []  # the block is the first light one after a detail window
        for o in lanes:
            o = o[~warm[o]]
            # per iteration of the lane: light blocks seen since the last detailed iteration
            after = np.zeros(len(o), np.int64)
            last_detail, blocks_since, prev_light = -1, 0, False
            for j, k in enumerate(o.tolist()):
                light = not detailed[k] and not quiet[k] and not is_switch[k]
                if detailed[k]:
                    last_detail, blocks_since = j, 0
                elif light and not prev_light and last_detail >= 0:
                    blocks_since += 1
                after[j] = blocks_since if last_detail >= 0 else 0
                prev_light = light
            keep = ~detailed[o] & ~is_switch[o]
            o, after = o[keep], after[keep]
            q, x = quiet[o], per_tok[o]
            for a, b, around in _blocks(~q):  # light blocks [a, b)
                xl, xq = _finite(x[a:b]), _finite(x[around[q[around]]])
                if len(xl) and len(xq):
                    lr.append(float(np.median(xl) / np.median(xq)))
                    first.append(bool(after[a] == 1))
        out["light_blocks_paired"] = len(lr)
        out["quiet_iterations"] = int(quiet.sum())
        if len(lr) > 1:
            out.update(_mean_ci(lr, "light_cost"))
        # the batch's make-up: a prefill costs less per token than a decode, so blocks that admit
        # requests read faster per token; the same pairing over decode-only iterations (time per
        # decode token) takes that out
        with np.errstate(all="ignore"):
            per_dec = np.where((pre == 0) & (dec > 0), dur / np.where(dec > 0, dec, 1), np.nan)
        plain = ~warm & ~detailed & ~is_switch
        ld = _pair_light(lanes, plain, quiet, per_dec)
        out["light_blocks_paired_decode_only"] = len(ld)
        if len(ld) > 1:
            out.update(_mean_ci(ld, "light_cost_decode_only"))
        keep_ = ~warm & ~is_switch
        for cls, m in (("light", ~quiet & ~detailed & keep_), ("quiet", quiet & keep_)):
            if m.any():
                out[f"{cls}_batch"] = {"iterations": int(m.sum()), "with_prefill": float((pre[m] > 0).mean()),
                                       "prefill_tokens_mean": float(pre[m].mean()),
                                       "decode_tokens_mean": float(dec[m].mean())}
        # steady state: the run's start and its drain, when the queue has emptied and batches
        # shrink to a few tokens, make time per token climb steeply (a fixed cost per iteration
        # over fewer tokens), and a block with quiet neighbours on one side only (the run's last)
        # then reads as several times slower. Only iterations serving at least half the lane's
        # median tokens, and blocks with quiet neighbours on both sides, are paired here.
        x_steady = np.full(len(per_tok), np.nan)
        for o in _steady(lanes, plain, tok):
            x_steady[o] = per_tok[o]
        ls = _pair_light(lanes, plain, quiet, x_steady, both_sides=True)
        out["light_blocks_paired_steady"] = len(ls)
        if len(ls) > 1:
            out.update(_mean_ci(ls, "light_cost_steady"))
            out["light_cost_steady_ratios"] = ls
        out["light_cost_ratios"] = lr
        out.update(_regime_pairs(lanes, warm, detailed, is_switch, quiet, tok, dur))
        f1 = np.asarray(first, bool)
        r = np.asarray(lr)
        for name, m in (("first_after_window", f1), ("later", ~f1)):
            out[f"light_blocks_{name}"] = int(m.sum())
            if m.sum() > 1:
                out.update(_mean_ci(r[m].tolist(), f"light_cost_{name}"))
    marks = _pause_marks(sw_name, fpid, f.column("start_ns").to_numpy(), f.column("end_ns").to_numpy(),
                         pid, start, dur)
    if marks is not None:
        out["pauses"] = _pause_effect(marks, lanes, warm, detailed, is_switch, quiet, per_tok, dur)
    return out


def _otsu(x: np.ndarray) -> float:
    """The cut of ``x`` that maximises the between-class variance of the two sides."""
    x = np.sort(x)
    n = len(x)
    c = np.cumsum(x)
    i = np.arange(1, n)
    m0, m1 = c[:-1] / i, (c[-1] - c[:-1]) / (n - i)
    k = int(np.argmax(i * (n - i) * (m0 - m1) ** 2))
    return float((x[k] + x[k + 1]) / 2)


def _regime_pairs(lanes, warm, detailed, is_switch, quiet, tok, dur) -> dict[str, Any]:
    """Light blocks against their quiet neighbours within each of the engine's two paces.

    On the H200 workload the engine's iterations of one batch shape take either about 20 ms or
    about 70 ms, in runs of a few iterations, whatever is recorded (docs/overhead.md, session l):
    a block's median then depends on how many of its iterations fell in the slow pace, and the
    pairs' spread is that of the pace, not of the recording. Here the steady iterations (at least
    half the lane's median tokens; warm-up, switch and detailed iterations out) are split at the
    Otsu cut of log duration, and each light block's median duration is paired with its quiet
    neighbours' within the fast pace (``light_cost_fast_*``) and within the slow one
    (``light_cost_slow_*``); ``pace_fast_share_*`` says whether recording moves iterations from one
    pace to the other."""
    out: dict[str, Any] = {}
    sel = _steady(lanes, ~warm & ~detailed & ~is_switch, tok)
    allo = np.concatenate(sel) if sel else np.zeros(0, np.int64)
    if len(allo) < 20 or not quiet[allo].any() or quiet[allo].all():
        return out
    cut = float(np.exp(_otsu(np.log(dur[allo].astype(float)))))
    fast = dur < cut
    out["pace_cut_ms"] = cut / 1e6
    for cls, m in (("light", ~quiet[allo]), ("quiet", quiet[allo])):
        out[f"pace_fast_share_{cls}"] = float(fast[allo][m].mean())
        out[f"mean_iteration_ms_{cls}"] = float(dur[allo][m].mean() / 1e6)
    dq = dur[allo][quiet[allo]].astype(float)
    out["quiet_time_share_fast"] = float(dq[dq < cut].sum() / dq.sum())
    for name, want in (("fast", True), ("slow", False)):
        r = _pair_light(sel, np.ones(len(dur), bool), quiet, np.where(fast == want, dur.astype(float), np.nan))
        out[f"light_blocks_paired_{name}"] = len(r)
        if len(r) > 1:
            out.update(_mean_ci(r, f"light_cost_{name}"))
            out[f"light_cost_{name}_ratios"] = r
    return out


#: the ranges ``TELLER_MARK_PAUSES=1`` records (teller.record.runtime.ENV_MARK_PAUSES)
_MARKS = {"gc0": "gc gen=0", "gc1": "gc gen=1", "gc2": "gc gen=2", "flush": "teller_flush",
          "cupti": "teller_cupti_buffer"}


def _pause_marks(names, fpid, fstart, fend, pid, start, dur) -> dict[str, Any] | None:
    """Per iteration, the ns of each kind of pause mark overlapping it (any thread of its
    process: a collection or a flush holds the GIL the engine thread needs), and per kind the
    marks' count and total ms. None when the run has no marks."""
    out: dict[str, Any] = {"overlap": {}, "marks": {}}
    end = start + dur.astype(np.int64)
    found = False
    for kind, nm in _MARKS.items():
        m = (names == nm) | (names == "OTHER " + nm)
        found |= bool(m.any())
        ms, me, mp = fstart[m], fend[m], fpid[m]
        ov = np.zeros(len(start))
        for p in np.unique(mp):
            a, b = ms[mp == p], me[mp == p]
            o = np.flatnonzero(pid == p)
            for lo in range(0, len(a), 4096):  # (iterations × marks) in blocks
                s_, e_ = a[lo:lo + 4096], b[lo:lo + 4096]
                ov[o] += np.clip(np.minimum(end[o, None], e_[None]) - np.maximum(start[o, None], s_[None]),
                                 0, None).sum(1)
        out["overlap"][kind] = ov
        d = (me - ms) / 1e6
        out["marks"][kind] = {"count": int(m.sum()), "total_ms": float(d.sum()),
                              "median_ms": float(np.median(d)) if len(d) else None,
                              "p99_ms": float(np.percentile(d, 99)) if len(d) else None}
    return out if found else None


def _pause_effect(marks, lanes, warm, detailed, is_switch, quiet, per_tok, dur) -> dict[str, Any]:
    """How the marked pauses fall on light, quiet and detailed iterations, and the light blocks'
    cost against the quiet ones again with the iterations a pause touched left out on both sides
    (``light_cost_without_*``): if the pauses are what makes some light blocks slow, their mean
    falls and its interval narrows."""
    ov = marks["overlap"]
    gc_any = ov["gc0"] + ov["gc1"] + ov["gc2"]
    out: dict[str, Any] = {"marks": marks["marks"]}
    keep = ~warm & ~is_switch
    for cls, m in (("light", ~quiet & ~detailed), ("quiet", quiet), ("detailed", detailed)):
        m = m & keep
        if not m.any():
            continue
        out[cls] = {"iterations": int(m.sum()),
                    "median_iteration_ms": float(np.median(dur[m]) / 1e6),
                    "gc_ms_per_iteration": float(gc_any[m].mean() / 1e6),
                    "gc2_ms_per_iteration": float(ov["gc2"][m].mean() / 1e6),
                    "flush_ms_per_iteration": float(ov["flush"][m].mean() / 1e6),
                    "cupti_ms_per_iteration": float(ov["cupti"][m].mean() / 1e6),
                    "share_touched_by_cupti": float((ov["cupti"][m] > 0).mean()),
                    "share_touched_by_gc1_or_gc2": float(((ov["gc1"] + ov["gc2"])[m] > 0).mean()),
                    "share_touched_by_flush": float((ov["flush"][m] > 0).mean())}
    if not (quiet.any() and (~quiet & ~detailed).any()):
        return out
    for name, bad in (("gc", gc_any > 0), ("gc12", (ov["gc1"] + ov["gc2"]) > 0), ("flush", ov["flush"] > 0),
                      ("cupti", ov["cupti"] > 0), ("any", (gc_any + ov["flush"] + ov["cupti"]) > 0)):
        lr = _pair_light(lanes, keep & ~detailed, quiet, np.where(bad, np.nan, per_tok))
        out[f"light_blocks_paired_without_{name}"] = len(lr)
        if len(lr) > 1:
            out.update(_mean_ci(lr, f"light_cost_without_{name}"))
    return out


def pool(tables: list[str]) -> dict[str, Any]:
    """The light blocks' cost within each pace (:func:`_regime_pairs`) over the iteration tables
    of several runs (``--iterations-out``), each run cut at its own pace: per run and pooled.
    A table without the ``switch`` column (written before it existed) takes as switch iterations
    the quiet one before each detail window and each window's last."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    per_run, pooled = [], {"fast": [], "slow": []}
    for path in tables:
        t = pq.read_table(path)
        for run in sorted(set(t.column("run").to_pylist())):
            r = t.filter(pc.equal(t.column("run"), run))
            o = np.argsort(r.column("start_ns").to_numpy(), kind="stable")
            cls = np.asarray(r.column("cls").to_pylist())[o]
            if "switch" in r.column_names:
                sw = r.column("switch").to_numpy(zero_copy_only=False)[o].astype(bool)
            else:
                nxt = np.append(cls[1:], "")
                sw = ((cls == "Q") & (nxt == "D")) | ((cls == "D") & (nxt != "D"))
            pid = r.column("pid").to_numpy()[o]
            lanes = [np.flatnonzero(pid == p) for p in np.unique(pid)]
            tok = (r.column("prefill").to_numpy() + r.column("decode").to_numpy())[o].astype(float)
            res = _regime_pairs(lanes, r.column("warmup").to_numpy(zero_copy_only=False)[o].astype(bool),
                                cls == "D", sw, cls == "Q", tok, r.column("dur_ns").to_numpy()[o])
            for k in pooled:
                pooled[k] += res.pop(f"light_cost_{k}_ratios", [])
            per_run.append({"table": path, "run": run, "switch_column": "switch" in r.column_names, **res})
    out: dict[str, Any] = {"runs": per_run}
    for k, v in pooled.items():
        out[f"light_blocks_paired_{k}"] = len(v)
        if len(v) > 1:
            out.update(_mean_ci(v, f"light_cost_{k}"))
    # the two paces weighted by their share of the quiet iterations' time (the intervals taken as
    # independent): what the light recording costs the engine's time as a whole
    w = [r.get("quiet_time_share_fast") for r in per_run]
    if all(x is not None for x in w) and "light_cost_fast_mean" in out and "light_cost_slow_mean" in out:
        wf = float(np.mean(w))
        out["quiet_time_share_fast"] = wf
        out["light_cost_time_weighted_mean"] = wf * out["light_cost_fast_mean"] + (1 - wf) * out["light_cost_slow_mean"]
        out["light_cost_time_weighted_ci95"] = float(np.hypot(wf * out["light_cost_fast_ci95"],
                                                              (1 - wf) * out["light_cost_slow_ci95"]))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--json")
    ap.add_argument("--pace", action="store_true", help="add the in-run cost of a detailed step (module docstring)")
    ap.add_argument("--iterations-out", help="with --pace: write each run's iterations (class, times, tokens) to "
                    "this Parquet file (several runs: a column names the run)")
    ap.add_argument("--pool", action="store_true", help="RUNS are iteration tables (--iterations-out): the "
                    "light blocks' cost within each engine pace, per run and pooled")
    a = ap.parse_args(argv)
    tables: list | None = [] if a.iterations_out else None
    if a.pool:
        res: Any = pool(a.runs)
    else:
        res = [dict(step_counts(r), **({"pace": pace(r, tables)} if a.pace else {})) for r in a.runs]
    if tables:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.concat_tables(tables), a.iterations_out, compression="zstd")
    text = json.dumps(res, indent=1)
    if a.json:
        Path(a.json).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
