"""Per-step labels and reference explanations from the applied windows and the measured effect.

Rule (docs/design.md §10; documented in docs/faults.md). A step *overlaps* a window when its
interval [start, end] on τ meets the window's [start, end] and it ran where the mechanism acts:
the same process for in-process mechanisms, any process of the run for co-located ones and for
communication faults (the other ranks wait too). An overlapping step is **abnormal** only when
its execution shows the effect:

- ``targets`` evidence (targeted operators): the summed time of the targeted operator families
  in the step exceeds the p99 of the same sum over the reference steps, or the GPU time of the
  kernels and copies in their subtrees exceeds its own reference p99 (a host-bound engine hides
  extra device work from host ranges; the layer then includes ``K``);
- ``step`` evidence (contention, churn, stalls, KV pressure): the step's duration exceeds the
  reference p99 of step durations (its engine iteration's, schedule and untraced gap included,
  when the run has ``iterations.parquet``), or the step's GPU time exceeds its reference p99; a mechanism
  with a ``log_pattern`` also shows in a step whose aligned log lines match it (KV pressure: the
  engine's "Offloaded N requests" line; the pressure makes many small steps, not slow ones);
- ``comm`` evidence (straggler, throttling): the step's summed COMM time exceeds the reference p99;
- ``admission`` evidence (delayed admission): the step is the first step of a request whose
  admission the mechanism delayed; the window covers those steps even when they start after the
  window closed (a delay longer than the window's own steps).

Reference steps are the run's steps that overlap no window, on the same rank, less the warm-up
steps (:func:`warmup_steps`: warm-up requests only, or a process's first two steps); when there are
fewer than :data:`MIN_REF` of them the first fault-free run of the same workload in the campaign
is used instead. Steps in a window without the effect stay normal (``is_anomaly`` false,
``in_window`` true, ``effect`` "none"): the fault was present but did not show in that step.

The operator locator names the operator families the mechanism targets and actually hit (e.g.
``FE LlamaMLP``); for mechanisms without fixed targets it is measured: the FE/OTHER/COMM
families whose time in the step exceeds their own reference p99, largest excess first (at most
three). Normal steps have an empty locator.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from teller.forest import COLD_STEPS, Forest, warmup_steps  # noqa: F401 (COLD_STEPS, warmup_steps: re-exported)
from teller.inject import CATEGORY_TITLES
from teller.reconstruct.iterations import read_iterations
from teller.rundir import LAYER_CODE, RunDir

MIN_REF = 20
Q = 99.0
MEASURED_LAYERS = ("FE", "OTHER", "COMM", "GAP")

STEP_LABELS_SCHEMA = pa.schema([
    ("run_id", pa.string()), ("step_id", pa.int64()), ("step_num", pa.int64()), ("rank", pa.int32()),
    ("pid", pa.int64()), ("start_ns", pa.int64()), ("end_ns", pa.int64()), ("duration_ns", pa.int64()),
    ("is_anomaly", pa.bool_()), ("in_window", pa.bool_()), ("fault_type", pa.string()),
    ("mechanism", pa.string()), ("window_id", pa.string()), ("effect", pa.string()),
    ("effect_ms", pa.float64()), ("ref_p99_ms", pa.float64()), ("ref_median_ms", pa.float64()),
    ("operator_labels", pa.list_(pa.string())), ("layer", pa.string()), ("explanation", pa.string()),
])


class StepMeasures:
    """Per-step times of the whole step, of COMM and of every operator family (layer + name)."""

    def __init__(self, run: str | Path):
        rd = RunDir(run)
        steps = rd.read_table("steps")
        forest = Forest.read(run, columns=["step_id", "step_idx", "kind"])
        self.run = Path(run)
        self._first_step_of: dict[str, int] | None = None
        self.steps = steps
        self.step_id = steps.column("step_id").to_numpy().astype(np.int64)
        self.step_num = steps.column("step_num").to_numpy().astype(np.int64)
        self.rank = steps.column("rank").to_numpy().astype(np.int32)
        self.pid = steps.column("pid").to_numpy().astype(np.int64)
        self.start = steps.column("start_ns").to_numpy().astype(np.int64)
        self.end = steps.column("end_ns").to_numpy().astype(np.int64)
        self.duration = self.end - self.start
        self.warmup = warmup_steps(steps)
        # engine iterations (docs/design.md §5.9): a step's whole loop iteration, schedule, STEP,
        # post ranges and the untraced gap; its duration is what the served requests waited
        self.iterations = self._iterations(rd)
        if self.iterations is not None:
            self.start, self.end = self.iterations["start_ns"], self.iterations["end_ns"]
            self.duration = self.end - self.start
        sid = forest.step_id
        dur = forest.dur_ns
        # STEP ranges: a row's step is its innermost STEP (``step_id``); other rules (profiler
        # steps, fixed windows, whose steps.parquet rows are not STEP nodes) and runs with
        # iterations (schedule ranges and GAP rows belong to a step, outside its STEP): step_idx
        by_idx = bool(steps.num_rows) and (self.iterations is not None or (
            "rule" in steps.column_names and steps.column("rule")[0].as_py() != "STEP ranges"))
        if by_idx:
            pos = forest.step_idx
            ok = pos >= 0
            pos = np.maximum(pos, 0)
        else:
            pos = np.searchsorted(self.step_id, sid)
            pos = np.clip(pos, 0, max(len(self.step_id) - 1, 0))
            ok = (sid >= 0) & (len(self.step_id) > 0)
            ok &= self.step_id[pos] == sid if len(self.step_id) else ok
        # operator families (``COMM all_reduce bytes=… seq=…`` → ``COMM all_reduce``), STEP rows left out
        ok &= forest.layer != LAYER_CODE["STEP"]
        if ok.any():
            self.families, fam = np.asarray(forest.families, dtype=str), forest.family[ok].astype(np.int64)
        else:
            self.families, fam = np.zeros(0, str), np.zeros(0, np.int64)
        nf, ns = len(self.families), len(self.step_id)
        self.fam_time = np.bincount(pos[ok] * nf + fam, weights=dur[ok], minlength=ns * nf).reshape(ns, nf) if nf else np.zeros((ns, 0))
        # device time: GPU work (kernels, copies, sets) in each node's subtree
        sub_gpu = forest.subtree_sums(np.where(forest.is_gpu_work, dur, 0)).astype(np.float64)
        self.fam_gpu = (np.bincount(pos[ok] * nf + fam, weights=sub_gpu[ok], minlength=ns * nf).reshape(ns, nf)
                        if nf else np.zeros((ns, 0)))
        if by_idx:  # the rows of a step whose parent is in another step (or none): its blocks
            par = forest.parent
            top = ok & ((par < 0) | (forest.step_idx[np.maximum(par, 0)] != forest.step_idx))
            self.gpu = np.bincount(pos[top], weights=sub_gpu[top], minlength=ns) if len(sub_gpu) else np.zeros(ns)
        else:
            srow = forest.rows_of(self.step_id)
            self.gpu = np.where(srow >= 0, sub_gpu[np.maximum(srow, 0)], 0.0) if len(sub_gpu) else np.zeros(ns)
        self.fam_index = {str(f): i for i, f in enumerate(self.families)}
        is_comm = np.char.startswith(self.families.astype(str), "COMM ") if nf else np.zeros(0, bool)
        self.comm = self.fam_time[:, is_comm].sum(axis=1) if nf else np.zeros(ns)
        self.fam_layer = np.array([f.split(" ", 1)[0] for f in self.families], dtype=object)

    def _iterations(self, rd: RunDir) -> dict[str, np.ndarray] | None:
        """``iterations.parquet`` as arrays (:func:`teller.reconstruct.iterations.read_iterations`:
        one row per steps.parquet row, same order), or None when the run has none (reconstructed
        before iterations existed) or they are steps only (foreign traces)."""
        it = read_iterations(rd, self.steps) if len(self.step_id) else None
        if it is None or it.column("rule")[0].as_py() != "engine ranges":
            return None
        return {c: it.column(c).to_numpy().astype(np.int64) for c in ("start_ns", "end_ns", "gap_ns")}

    def first_steps(self, request_ids: list[str]) -> np.ndarray:
        """The step ids of the first step each named request ran in (requests that never ran are
        left out); ``requests.parquet`` is read on first use."""
        if self._first_step_of is None:
            self._first_step_of = {}
            rd = RunDir(self.run)
            if rd.has_table("requests"):
                rq = rd.read_table("requests", columns=["request_id", "step_id"])
                rid = np.asarray(rq.column("request_id").to_pylist(), dtype=object)
                rsn = rq.column("step_id").to_numpy()
                order = np.lexsort((rsn, rid))
                for r, s in zip(rid[order][::-1], rsn[order][::-1], strict=False):  # one row per (request, step)
                    self._first_step_of[str(r)] = int(s)
        got = {self._first_step_of.get(str(r)) for r in request_ids}
        return np.array(sorted(x for x in got if x is not None), dtype=np.int64)

    def family_columns(self, names: list[str], device: bool = False) -> np.ndarray:
        """Summed time per step of the named families (absent families count 0); with ``device``
        the GPU time of their subtrees (the kernels and copies they launched) instead."""
        idx = [self.fam_index[n] for n in names if n in self.fam_index]
        m = self.fam_gpu if device else self.fam_time
        return m[:, idx].sum(axis=1) if idx else np.zeros(len(self.step_id))

    def families_matching(self, suffixes: list[str]) -> list[str]:
        """Families named exactly, FE classes ending with a suffix (``MLP`` → ``FE LlamaMLP``), or
        every family of a layer named alone (``GAP`` → ``GAP untraced``; STEP excluded)."""
        out = []
        layers = {s for s in suffixes if s in LAYER_CODE and s != "STEP"}
        for f in self.families.astype(str):
            layer, _, nm = f.partition(" ")
            if f in suffixes or layer in layers or (layer == "FE" and any(nm.endswith(s) for s in suffixes)):
                out.append(f)
        return out


def _pct(x: np.ndarray, q: float) -> float:
    return float(np.percentile(x, q)) if len(x) else float("nan")


def label_run(run: str | Path, labels: dict[str, Any], reference: str | Path | None = None) -> dict[str, Any]:
    """Label every step of a reconstructed run; writes ``step_labels.parquet``, returns a summary."""
    from teller.inject.mechanisms import registry

    reg = registry()
    sm = StepMeasures(run)
    n = len(sm.step_id)
    run_id = labels.get("run_id", Path(run).name)
    wins = [w for w in labels.get("windows", []) if w.get("start_tau_ns") is not None]
    plan = {p["id"]: p for p in labels.get("plan", [])}
    for w in wins:
        if w.get("end_tau_ns") is None:
            w["end_tau_ns"] = int(sm.end.max()) if n else w["start_tau_ns"]
    # which steps each window covers
    cover = np.zeros((len(wins), n), bool)
    for i, w in enumerate(wins):
        cover[i] = window_cover(sm, w, reg)
    in_any = cover.any(axis=0) if len(wins) else np.zeros(n, bool)
    ref_ms = _reference(sm, ~in_any & ~sm.warmup, reference)

    is_anom = np.zeros(n, bool)
    fault_type = np.full(n, "", object)
    mech = np.full(n, "", object)
    win_id = np.full(n, "", object)
    effect = np.full(n, "", object)
    eff_ms = np.full(n, np.nan)
    p99_ms = np.full(n, np.nan)
    med_ms = np.full(n, np.nan)
    locs: list[list[str]] = [[] for _ in range(n)]
    layer = np.full(n, "", object)
    expl = np.full(n, "", object)
    effect[in_any] = "none"
    log_hits: dict[str, np.ndarray] = {}
    for i, w in enumerate(wins):
        m = reg.get(w["mechanism"])
        if m is None:
            continue
        if m.log_pattern and m.log_pattern not in log_hits:
            log_hits[m.log_pattern] = _log_evidence(run, sm, m.log_pattern)
        idx = np.nonzero(cover[i] & ~is_anom)[0]
        if not len(idx):
            continue
        targets = list(w.get("targets_hit") or []) or list(w.get("targets") or m.targets)
        dev = None  # the device-side measure, for evidence that can show on the GPU only
        if m.evidence == "targets":
            fams = sm.families_matching(targets)
            val, ref = sm.family_columns(fams), ref_ms("fams", fams)
            dev = (sm.family_columns(fams, device=True), ref_ms("fams_gpu", fams))
            loc = fams
        elif m.evidence == "comm":
            val, ref = sm.comm, ref_ms("comm", None)
            # COMM range names carry bytes/group/seq: the locator names the collective, not each call
            loc = [t for t in targets if t.startswith("COMM ")] or sorted(
                {" ".join(f.split(" ", 2)[:2]) for f in sm.families.astype(str) if f.startswith("COMM ")})
        elif m.evidence == "admission":
            hit = np.isin(sm.step_id, sm.first_steps((w.get("extra") or {}).get("requests", [])))
            val, ref = sm.duration.astype(float), ref_ms("step", None)
            loc = ["OTHER schedule"]
        else:
            val, ref = sm.duration.astype(float), ref_ms("step", None)
            dev = (sm.gpu.astype(float), ref_ms("step_gpu", None))
            loc = sm.families_matching([t for t in targets if t != "STEP"]) if targets else []
        p99, med = ref
        on_gpu = np.zeros(n, bool)
        on_log = np.zeros(n, bool)
        if m.evidence == "admission":
            show = idx[hit[idx]]
        else:
            over = val > p99 if np.isfinite(p99) else np.zeros(n, bool)
            if dev is not None and np.isfinite(dev[1][0]) and dev[1][0] > 0:
                # a fault that only shows on the GPU (extra or slowed kernels behind a host-bound
                # step) counts when the device time exceeds its own reference p99 and the host
                # measure did not already show it
                over_dev = dev[0] > dev[1][0]
                on_gpu = over_dev & ~over
                over = over | over_dev
            over &= ~sm.warmup  # cold steps are slow anyway: only an explicit log line can mark them
            if m.log_pattern:
                on_log = log_hits[m.log_pattern] & ~over
                over = over | on_log
            show = idx[over[idx]]
        p99v, medv = np.full(n, p99, float), np.full(n, med, float)
        val = val.astype(float).copy()
        if on_gpu.any():
            val[on_gpu], p99v[on_gpu], medv[on_gpu] = dev[0][on_gpu], dev[1][0], dev[1][1]
        eff_ms[idx], p99_ms[idx], med_ms[idx] = val[idx] / 1e6, p99v[idx] / 1e6, medv[idx] / 1e6
        mech[idx], win_id[idx] = w["mechanism"], w["id"]
        for s in show:
            sl = loc if loc or m.targets == ("STEP",) else _measured_locator(sm, s, ref_ms)
            if not sl and "STEP" in targets:
                sl = ["STEP"]
            if not sl:
                sl = _measured_locator(sm, s, ref_ms) or ["STEP"]  # no single family: the step as a whole
            is_anom[s] = True
            fault_type[s] = m.category
            effect[s] = "shown"
            locs[s] = list(sl)
            layer[s] = ",".join(sorted({x.split(" ", 1)[0] for x in sl}))
            if on_gpu[s]:
                layer[s] = ",".join(sorted(set(layer[s].split(",")) - {""} | {"K"}))
            expl[s] = explanation(m, plan.get(w["id"], w), w, sl, layer[s], float(val[s]) / 1e6,
                                  float(p99v[s]) / 1e6, float(medv[s]) / 1e6, int(sm.step_num[s]), int(sm.rank[s]),
                                  device=bool(on_gpu[s]), logged=bool(on_log[s]))
    table = pa.table({
        "run_id": pa.array([run_id] * n, pa.string()), "step_id": sm.step_id, "step_num": sm.step_num,
        "rank": sm.rank, "pid": sm.pid, "start_ns": sm.start, "end_ns": sm.end, "duration_ns": sm.duration,
        "is_anomaly": is_anom, "in_window": in_any, "fault_type": fault_type.astype(str).tolist(),
        "mechanism": mech.astype(str).tolist(), "window_id": win_id.astype(str).tolist(),
        "effect": effect.astype(str).tolist(), "effect_ms": eff_ms, "ref_p99_ms": p99_ms, "ref_median_ms": med_ms,
        "operator_labels": locs, "layer": layer.astype(str).tolist(), "explanation": expl.astype(str).tolist(),
    }, schema=STEP_LABELS_SCHEMA)
    RunDir(run).write_table(table, "step_labels")
    return {"steps": n, "abnormal": int(is_anom.sum()), "in_window": int(in_any.sum()),
            "in_window_no_effect": int((in_any & ~is_anom).sum()), "windows": len(wins),
            "reference": "own fault-free steps" if int((~in_any).sum()) >= MIN_REF or reference is None
            else str(reference), "reference_steps": int((~in_any).sum())}


def _log_evidence(run: str | Path, sm: StepMeasures, pattern: str) -> np.ndarray:
    """Steps with an aligned log line matching ``pattern`` (the engine reporting the effect)."""
    import pyarrow.compute as pc

    rd = RunDir(run)
    out = np.zeros(len(sm.step_id), bool)
    if not rd.has_table("log_alignment") or not len(sm.step_id):
        return out
    logs = rd.read_table("log_alignment", columns=["text", "step_id"])
    hit = pc.match_substring_regex(logs.column("text"), pattern).fill_null(False)
    sids = np.unique(logs.filter(hit).column("step_id").to_numpy())
    return np.isin(sm.step_id, sids[sids >= 0])


def window_cover(sm: StepMeasures, w: dict[str, Any], reg: dict[str, Any]) -> np.ndarray:
    """Steps overlapping window ``w`` where its mechanism acts (its process, or every process for
    co-located, workload-wide and communication faults); an open window ends with the run."""
    m = reg.get(w["mechanism"])
    end = w.get("end_tau_ns")
    end = int(sm.end.max()) if end is None and len(sm.end) else int(end if end is not None else w["start_tau_ns"])
    if m is not None and m.evidence == "admission":
        # the fault's effect lands when its delayed requests are admitted, which can be after the
        # window closed (a delay longer than the window's steps): the window lasts until then
        first = sm.first_steps((w.get("extra") or {}).get("requests", []))
        if len(first):
            end = max(end, int(sm.start[np.isin(sm.step_id, first)].max()))
    c = (sm.start <= end) & (sm.end >= int(w["start_tau_ns"]))
    scope_all = m is not None and (m.where in ("co_located", "workload") or m.evidence == "comm")
    if not scope_all:
        c &= sm.pid == int(w.get("pid", -1))
    return c


def _reference(sm: StepMeasures, ref_mask: np.ndarray, reference: str | Path | None):
    """A function (kind, families) → (p99, median) in ns over the reference steps."""
    src, mask = sm, ref_mask
    if int(ref_mask.sum()) < MIN_REF and reference is not None and Path(reference, "steps.parquet").is_file():
        src = StepMeasures(reference)
        mask = ~src.warmup

    def ref(kind: str, fams: list[str] | None) -> tuple[float, float]:
        if kind == "step":
            v = src.duration[mask].astype(float)
        elif kind == "step_gpu":
            v = src.gpu[mask].astype(float)
        elif kind == "fams_gpu":
            v = src.family_columns(list(fams or []), device=True)[mask]
        elif kind == "comm":
            v = src.comm[mask]
        else:
            v = src.family_columns(list(fams or []))[mask]
        return _pct(v, Q), _pct(v, 50)

    ref.src, ref.mask = src, mask  # type: ignore[attr-defined]
    return ref


def _measured_locator(sm: StepMeasures, s: int, ref: Any) -> list[str]:
    src, mask = ref.src, ref.mask
    out = []
    for f in sm.families.astype(str):
        if f.split(" ", 1)[0] not in MEASURED_LAYERS:
            continue
        v = sm.fam_time[s, sm.fam_index[f]]
        j = src.fam_index.get(f)
        rv = src.fam_time[mask, j] if j is not None else np.zeros(0)
        p99 = _pct(rv, Q) if len(rv) else 0.0
        med = _pct(rv, 50) if len(rv) else 0.0
        if v > p99 and v > 0:
            out.append((v - med, f))
    out.sort(reverse=True)
    return [f for _, f in out[:3]]


def explanation(m: Any, fault: dict[str, Any], w: dict[str, Any], loc: list[str], layer: str, val_ms: float,
                p99_ms: float, med_ms: float, step_num: int, rank: int, device: bool = False,
                logged: bool = False) -> str:
    """One or two sentences: fault type, evidence (operators, layer, numbers), cause."""
    what = {"targets": "the targeted operators took", "comm": "communication took",
            "step": "the step took", "admission": "the step took"}[m.evidence]
    if device:
        what = {"targets": "the GPU work launched by the targeted operators took",
                "step": "the step's GPU work took"}.get(m.evidence, what)
    ops = ", ".join(loc) if loc else "the whole step"
    mag = fault.get("magnitude", w.get("magnitude"))
    if logged:
        what = "the engine logged the effect in this step (an aligned line matching the mechanism's pattern); the step took"
    return (f"{CATEGORY_TITLES.get(m.category, m.category)} fault ({m.name}) in step {step_num} on rank {rank}: "
            f"evidence {ops} (layer {layer or 'STEP'}); {what} {val_ms:.2f} ms against a fault-free p99 of "
            f"{p99_ms:.2f} ms (median {med_ms:.2f} ms). Cause: {m.cause} (magnitude {mag:g}: {m.knob}).")


def read_step_labels(run: str | Path) -> pa.Table | None:
    rd = RunDir(run)
    return rd.read_table("step_labels") if rd.has_table("step_labels") else None


def load_labels(run: str | Path) -> dict[str, Any] | None:
    p = Path(run) / "labels.json"
    return json.loads(p.read_text()) if p.is_file() else None
