"""`teller diagnose`: the numeric stage end to end — features → localizer → slices → diagnosis.json.

``diagnose(RUN, reference=[REF...] | localizer=PATH)`` scores every step of RUN against normal
operation, names for each flagged step the candidate operator families, the suspicious instances
with their evidence (which features deviate from the reference and by how much) and the causal
slice around them, writes ``diagnosis.json`` (and with ``html=True`` the self-contained
``report.html``), and returns the diagnosis as a dict.

``diagnosis.json``::

    {"format": "teller.diagnosis", "version": 1, "run": ..., "reference": ...,
     "steps_rule": {"rule": "STEP ranges" | "profiler steps" | "fixed windows", "detail": ...},
     "localizer": {hyper-parameters, families, reference summary},
     "summary": {steps, flagged, instances, unseen families, counts that reconcile, seconds},
     "health": {"partial", "runs": [{role, path, status, partial, lost}], "lines": [...]} (what is
                wrong with the run and its references: killed or cut input, repairs, warnings,
                and the lines of "reference_match" prefixed "reference: "),
     "episodes": [{index, rank, first_step, last_step, steps, start_ns, end_ns, fault_type,
                type_votes}] (flagged steps of one rank at most 2 step numbers apart,
                teller.localize.episodes; fault_type: the type most of its steps are given, the
                model's where it keeps a step, else its evidence's; type_votes: {type: steps}),
     "reference_match": {"same_deployment": bool | null, "reference": shape, "run": shape,
                         "lines": [...]} (whether the reference was recorded on the run's
                deployment: ranks and per-step counts of the FE and COMM families;
                teller.localize.deployment),
     "steps": [ per step, in time order:
        {"index", "step_num", "rank", "node_id", "name", "start_ns", "end_ns", "instances",
         "score", "flag", "top_family", "warmup" (a warm-up step: kept out of references),
         flagged steps past warm-up: "episode" (index into "episodes"), "episode_length",
         flagged steps also: "requests", "evidence_type": {fault_type, family, feature, alternative,
         reason} (the type the stage's evidence points to, teller.localize.faulttype, and the type
         that evidence cannot rule out or null; absent when none does),
         "candidates": [{family, suspiciousness, instances, max_a, unseen}],
         "suspects": [{node_id, family, layer, name, start_ns, dur_ns, a, distance, evidence:
                       [{feature, value, reference, ratio, z}],
                       module: {node_id, family} | null (the nearest enclosing FE module; the
                       suspect itself when it is one)}],
         "modules": [family...] (the suspects lifted to their modules, in suspect order; a
                    suspect outside every FE module stands for itself),
         "operators": [family...] (the operators the stage names: the evidence's family, then
                    the candidates, framework ops lifted to their modules, at most
                    teller.localize.naming.MAX_OPERATORS; what `teller evaluate` scores),
         "explained": [{node_id, family, by}],
         "slice": {"nodes": [{id, parent, layer, name, start_ns, dur_ns, reference_dur_ns,
                             relevance, suspect}],
                   "edges": {"p": [[u, v]...], "t": [...], "c": [...]}, "dropped", "info"}} ]}

With the root-cause model (:func:`apply_model`) flagged steps also get its answer (``fault_type``,
``fault_probability``, ``abnormal_probability``, ``evidence_operators``, ``explanation``, ...;
a step it rules out is ``model_says_normal``, or ``unknown_fault`` with its closest type in
``fault_type_guess`` when it lies in an episode of :data:`EPISODE_MIN` or more (:data:`OWN_FLOOR_EPISODE_MIN` where the model keeps its own floor) and the
reference is of the run's deployment) and
``"model"`` describes it: path, training data, ``steps_eligible`` / ``steps_read`` /
``max_steps`` (it reads the highest-scored flagged steps up to the bound; those past it are
marked ``model_not_read``) and ``explanations`` (``"mechanism"``: each explanation decoded until
the mechanism the diagnosis keeps was written, ``"full"``: to its end).

Node ids are forest ``node_id`` values (``teller show RUN --step N`` prints the same tree).
A slice node's ``reference_dur_ns`` is the reference's typical duration of that operator (its
family's median duration in the reference runs, at the step's batch size; an evidence item's
``reference`` is instead the centre of the mode the instance was matched to); null for nodes that
are not scored instances (RT, DRV, K, ...) and for families the reference never saw.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from teller import __version__
from teller.errors import TellerError
from teller.inspect.tree import fmt_ns
from teller.localize import (
    SELF_REFERENCE_WARNING,
    GMMLocalizer,
    Localization,
    evidence,
    fit_self_reference,
    load_or_fit,
    localize,
    self_reference_source,
)
from teller.localize.episodes import MIN_EPISODE, STAGE_EPISODE
from teller.localize.faulttype import step_fault_types
from teller.localize.features import RunFeatures, run_features
from teller.localize.naming import named_operators, ranked_families
from teller.rca import (
    DEFAULT_MODEL,
    EPISODE_FLOOR,
    LASTING_NOVELTY,
    SCREEN_FLOOR,
    own_episode_floor,
)
from teller.reconstruct.ensure import ensure_reconstructed
from teller.reconstruct.steps import without_detail
from teller.report.html import (
    episode_words,
    fmt_value,
    longest_episodes,
    model_unsure,
    reading_words,
    write_html,
)
from teller.rundir import LAYERS, RunDir
from teller.slicing import SliceConfig, StepIndex, build_slice, comm_pairs_rows

FORMAT = "teller.diagnosis"
FORMAT_VERSION = 1


def _f(x: float, nd: int = 4) -> float | None:
    """A JSON-safe float (NaN/inf → None)."""
    x = float(x)
    return round(x, nd) if math.isfinite(x) else None


def _requests_by_step(path: Path, step_ids: list[int]) -> dict[int, list[str]]:
    """Request ids of the given STEP node ids (from ``requests.parquet``)."""
    rd = RunDir(path)
    if not rd.has_table("requests") or not step_ids:
        return {}
    import pyarrow as pa
    import pyarrow.compute as pc

    from teller.logs.ids import natural_key

    t = rd.read_table("requests")
    t = t.filter(pc.is_in(t.column("step_id"), value_set=pa.array(step_ids, pa.int64())))
    out: dict[int, list[str]] = {}
    for sid, rq in zip(t.column("step_id").to_pylist(), t.column("request_id").to_pylist(), strict=True):
        out.setdefault(int(sid), []).append(rq)
    return {sid: sorted(rq, key=natural_key) for sid, rq in out.items()}


def _reference_durations(est: GMMLocalizer, inst: Any, loc: Localization, inst_of_row: np.ndarray,
                         rows: np.ndarray) -> list[float | None]:
    """The reference's typical ``dur_ns`` of the forest ``rows`` that are scored instances (their
    family's median duration in the reference, at the step's batch size), None for the others."""
    out: list[float | None] = [None] * len(rows)
    names = list(est.feature_names_in_)
    if "dur_ns" not in names or not len(rows):
        return out
    k = inst_of_row[rows]
    has = np.flatnonzero(k >= 0)
    if not len(has):
        return out
    ki = k[has]
    fam = np.asarray(inst.families, dtype=object)[inst.family[ki]]  # these rows' names only, not every instance's
    ref = est.reference_median(fam, None if inst.batch is None else inst.batch[ki])[:, names.index("dur_ns")]
    ref = np.where(loc.unseen[ki], np.nan, ref)
    for j, v in zip(has.tolist(), ref.tolist(), strict=True):
        out[j] = _f(v, 1)
    return out


def build_diagnosis(rf: RunFeatures, est: GMMLocalizer, loc: Localization, source: str,
                    slice_config: SliceConfig | None = None, counts: bool = True) -> dict[str, Any]:
    """The diagnosis dict of one run (slices built for flagged steps only); ``counts``: whether
    the evidence's type may read the collectives' counts per step (a reference of the run's
    deployment, :func:`teller.localize.faulttype.step_fault_types`)."""
    t0 = time.perf_counter()
    fa, st, inst = rf.forest, rf.steps, rf.instances
    cfg = slice_config or SliceConfig()
    ss = loc.steps
    n_steps = st.n
    score = np.full(n_steps, np.nan)
    flag = np.zeros(n_steps, bool)
    top = np.full(n_steps, -1, np.int64)
    score[ss.steps], flag[ss.steps], top[ss.steps] = ss.score, ss.flag, ss.top_family
    n_inst = np.bincount(inst.step[inst.step >= 0], minlength=n_steps) if n_steps else np.zeros(0, np.int64)
    types = step_fault_types(est, inst, loc, flagged_only=True, counts=counts)
    reqs = _requests_by_step(rf.path, [int(st.node_id[i]) for i in loc.flagged]) if st.rule == "STEP ranges" else {}
    # per-row anomaly score for the slice builder
    row_a = np.zeros(fa.n)
    row_a[inst.rows] = np.nan_to_num(loc.a, nan=0.0)
    gpu = fa.is_gpu
    pairs = comm_pairs_rows(fa, rf.comm_edges)
    index = StepIndex(st.step_of_row)
    names = np.asarray(fa.names, dtype=object)
    fam_names = inst.families
    fe = fa.layer == LAYERS.index("FE")
    fe_of = np.where(fe, np.arange(fa.n), fa.nearest_ancestor(fe))  # the enclosing module (or itself)
    fe_family = np.asarray(fa.families, dtype=object)[fa.family] if fa.n else np.zeros(0, object)
    inst_of_row = np.full(fa.n, -1, np.int64)
    inst_of_row[inst.rows] = np.arange(inst.n)
    steps_out: list[dict[str, Any]] = []
    order = np.lexsort((st.rank, st.start))
    slice_nodes = 0
    for i in order.tolist():  # one entry per step (thousands at most); details for flagged ones
        d: dict[str, Any] = {
            "index": i, "step_num": int(st.step_num[i]), "rank": int(st.rank[i]), "node_id": int(st.node_id[i]),
            "name": st.names[i], "start_ns": int(st.start[i]), "end_ns": int(st.end[i]),
            "instances": int(n_inst[i]) if n_steps else 0, "score": _f(score[i]), "flag": bool(flag[i]),
            "top_family": fam_names[top[i]] if top[i] >= 0 else None,
            "warmup": bool(st.warmup[i]) if st.warmup is not None else False,
        }
        res = loc.flagged.get(i)
        if res is not None:
            if reqs:
                d["requests"] = reqs.get(int(st.node_id[i]), [])
            call = types.get(i)
            if call is not None and call.fault_type is not None:  # what the evidence points to, no model needed
                d["evidence_type"] = {"fault_type": call.fault_type, "family": call.family, "feature": call.feature,
                                      "alternative": call.alternative, "reason": call.reason()}
            d["candidates"] = [{"family": c["family"], "suspiciousness": _f(c["suspiciousness"]), "shift": _f(c["shift"]),
                                "instances": c["instances"], "max_a": _f(c["max_a"]), "unseen": c["unseen"]}
                               for c in res.candidates]
            sus = res.suspects
            ev = evidence(est, inst, loc, sus)
            srows = inst.rows[sus]
            d["suspects"] = [
                {"node_id": int(fa.node_id[r]), "family": fam_names[inst.family[k]], "layer": LAYERS[fa.layer[r]],
                 "name": str(names[fa.name_codes[r]]), "start_ns": int(fa.start[r]), "dur_ns": int(fa.end[r] - fa.start[r]),
                 "a": _f(loc.a[k]), "distance": _f(loc.m2[k], 2), "collective": bool(loc.collective[k]),
                 "evidence": [{kk: (_f(v) if isinstance(v, float) else v) for kk, v in item.items()} for item in e],
                 "module": ({"node_id": int(fa.node_id[fe_of[r]]), "family": str(fe_family[fe_of[r]])}
                            if fe_of[r] >= 0 else None)}
                for k, r, e in zip(sus.tolist(), srows.tolist(), ev, strict=True)
            ]
            d["modules"] = list(dict.fromkeys(x["module"]["family"] if x["module"] else x["family"]
                                              for x in d["suspects"]))
            d["operators"] = named_operators(ranked_families(res.candidates, call),
                                             [(x["family"], x["module"]["family"] if x["module"] else None) for x in d["suspects"]])
            d["explained"] = [{"node_id": int(fa.node_id[inst.rows[k]]), "family": fam_names[inst.family[k]],
                               "by": int(fa.node_id[inst.rows[b]])} for k, b in list(res.explained.items())[:50]]
            rows = index.rows(i)
            sl = build_slice(fa, rows, srows, row_a[rows], pairs, cfg, gpu)
            slice_nodes += len(sl.rows)
            par_ids = np.where(sl.parent >= 0, fa.node_id[np.maximum(sl.parent, 0)], -1)
            ref_dur = _reference_durations(est, inst, loc, inst_of_row, sl.rows)
            d["slice"] = {
                "nodes": [
                    {"id": int(fa.node_id[r]), "parent": int(p), "layer": LAYERS[fa.layer[r]],
                     "name": str(names[fa.name_codes[r]]), "start_ns": int(fa.start[r]),
                     "dur_ns": int(fa.end[r] - fa.start[r]), "reference_dur_ns": rd, "relevance": _f(rv, 3),
                     "suspect": bool(sm)}
                    for r, p, rd, rv, sm in zip(sl.rows.tolist(), par_ids.tolist(), ref_dur, sl.relevance.tolist(),
                                                sl.suspect.tolist(), strict=True)
                ],
                "edges": {k: fa.node_id[v].tolist() for k, v in (("p", sl.edges_p), ("t", sl.edges_t), ("c", sl.edges_c))},
                "dropped": int(sl.dropped),
                "info": sl.info,
            }
        steps_out.append(d)
    unseen_in_steps = sorted({fam_names[f] for f in np.unique(inst.family[loc.unseen & (inst.step >= 0)]).tolist()})
    in_steps = int((inst.step >= 0).sum())
    summary = {
        "steps": int(n_steps),
        "steps_scored": int(len(ss.steps)),
        "steps_without_instances": int(n_steps - len(ss.steps)),
        "steps_flagged": int(flag.sum()),
        "instances": int(inst.n),
        "instances_in_steps": in_steps,
        "instances_outside_steps": int(inst.n - in_steps),
        "unseen_families": unseen_in_steps,
        "unseen_instances_in_steps": int((loc.unseen & (inst.step >= 0)).sum()),
        "suspicious_instances": loc.summary["suspicious_instances"],
        "explained_away": loc.summary["explained_away"],
        "nan_feature_values": loc.summary["nan_feature_values"],
        "slice_nodes": int(slice_nodes),
        "reconciled": bool(in_steps + (inst.n - in_steps) == inst.n and int(n_inst.sum()) == in_steps),
        "build_seconds": round(time.perf_counter() - t0, 3),
    }
    if in_steps and summary["unseen_instances_in_steps"] > 0.2 * in_steps:
        summary["warning"] = (f"{summary['unseen_instances_in_steps']} of {in_steps} instances belong to families the "
                              "reference never saw: the reference does not cover this run's workload")
    return {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "tool_version": __version__,
        "run": str(rf.path),
        "reference": source,
        "steps_rule": {"rule": st.rule, "detail": st.detail},
        "instance_layers": list(inst.layers),
        "features": [str(x) for x in est.feature_names_in_],
        "localizer": {"params": est.get_params(), "families": int(len(est.families_)),
                      **{k: v for k, v in getattr(est, "extra_", {}).items()}},
        "slice_config": asdict(cfg),
        "summary": summary,
        "steps": steps_out,
    }


def diagnose(run: str | os.PathLike, reference: list[str | os.PathLike] | None = None,
             localizer: str | os.PathLike | None = None, out: str | os.PathLike | None = None,
             html: bool = False, window_ns: int | None = None, slice_config: SliceConfig | None = None,
             params: dict[str, Any] | None = None, note: Any = None,
             model: str | os.PathLike | bool | None = None, keep_warmup: bool = False,
             model_steps: int | None = None, model_explain: str = "mechanism",
             model_reads: str = "every") -> dict[str, Any]:
    """Diagnose ``run``; writes ``diagnosis.json`` (and ``report.html``) into ``out`` (default: RUN).

    ``model``: the root-cause model that names the fault type, the evidence operators and the
    explanation of every flagged step (:func:`apply_model`): None or True for the model shipped
    with the package, a path for another (``teller rca train -o PATH``), False for the numeric
    stage alone. ``model_reads``: ``"every"`` (the model reads every step and is read over time,
    the stage's lasting departures kept where it flags nothing: :func:`read_every`,
    :func:`write_reading`) or ``"flagged"`` (it reads the steps the stage flags and screens them:
    :func:`apply_model`; also what ``"every"`` does on a run of a workload shape the model was not
    trained on). ``model_steps``: at most this many steps get the model's explanation
    (``"every"``: the most probable of its verdicts) or are read at all (``"flagged"``: the
    highest-scored flagged steps) (None: :data:`MODEL_STEPS`; 0: all); ``model_explain``:
    ``"mechanism"`` (each explanation is decoded until the mechanism diagnose keeps is written)
    or ``"full"`` (to its end).

    ``run`` and the ``reference`` runs are read as ``teller reconstruct`` left them; one that was
    not reconstructed yet is reconstructed here, once, through the same public call
    (:func:`ensure_reconstructed`), so its steps are decided by the same rule either way. The
    reference runs' warm-up steps are left out of the reference unless ``keep_warmup``.
    Returns the diagnosis dict with ``"paths"`` added (the files written)."""
    t0 = time.perf_counter()
    c0 = time.process_time()
    if model_reads not in MODEL_READS:
        raise TellerError(f"--model-reads {model_reads!r}: one of {', '.join(MODEL_READS)}")
    run = ensure_reconstructed(run, note, window_ns)
    for r in reference or []:
        ensure_reconstructed(r, note, window_ns)
    own_reference = localizer is None and not reference
    if own_reference:  # no reference recording: the run's own steps (fit_self_reference)
        rf = run_features(run)
        t_feat = time.perf_counter() - t0
        est = fit_self_reference(rf, keep_warmup=keep_warmup, **(params or {}))
        source = self_reference_source(est)
        t_fit = time.perf_counter() - t0 - t_feat
    else:
        est, source = load_or_fit(reference, localizer, window_ns=window_ns, run=run, keep_warmup=keep_warmup,
                                  **(params or {}))
        t_fit = time.perf_counter() - t0
        layers = tuple(getattr(est, "extra_", {}).get("instance_layers", ())) or None
        rf = run_features(run, layers=layers)
        t_feat = time.perf_counter() - t0 - t_fit
    bound = MODEL_STEPS if model_steps is None else model_steps
    reading = None
    t_read = 0.0
    if model is not False and model_reads == "every":  # the model first: the steps it flags get suspects too
        t_m = time.perf_counter()
        reading = read_every(run, rf, None if model is True else model, note, max_steps=bound, explain=model_explain)
        t_read = time.perf_counter() - t_m
    t_l = time.perf_counter()
    loc = localize(est, rf.instances, also=reading_flags(reading))
    t_loc = time.perf_counter() - t_l
    match = reference_match(est, rf, keep_warmup)
    # the count rule of the evidence's type needs a reference of the run's deployment
    diag = build_diagnosis(rf, est, loc, source, slice_config, counts=match["same_deployment"] is not False)
    diag["health"] = input_health(run, reference or [])
    diag["reference_match"] = match
    diag["health"]["lines"] += [f"reference: {x}" for x in diag["reference_match"]["lines"]]
    if own_reference:
        diag["health"]["lines"].append(SELF_REFERENCE_WARNING)
    diag["summary"]["seconds"] = {"fit_or_load": round(t_fit, 3), "features": round(t_feat, 3),
                                  "localize": round(t_loc, 3), "slices_and_json": diag["summary"].pop("build_seconds")}
    if reading is not None and not reading.get("refused"):
        t_m = time.perf_counter()
        write_reading(diag, reading, note)
        diag["summary"]["seconds"]["model"] = round(t_read + time.perf_counter() - t_m, 3)
        mark_episodes(diag, verdicts=True)
    else:
        mark_episodes(diag)
        if model is not False and (model_reads == "flagged" or reading is not None):
            if reading is not None and note is not None:
                note(reading["refused"])
            t_m = time.perf_counter()
            info = apply_model(diag, run, None if model is True else model, note, forest=rf.forest.table,
                               max_steps=bound, explain=model_explain,
                               loaded=(reading["model"], reading["path"]) if reading is not None else None,
                               steps=rf.steps)
            if info is not None and reading is not None:
                info["every_refused"] = reading["refused"]
            diag["summary"]["seconds"]["model"] = round(t_read + time.perf_counter() - t_m, 3)
    type_episodes(diag)
    out_dir = Path(out) if out is not None else Path(run)
    if out_dir.suffix == ".json":
        json_path, out_dir = out_dir, out_dir.parent
    else:
        json_path = out_dir / "diagnosis.json"
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = json_path.with_suffix(".json.tmp")
    with open(tmp, "w") as fh:  # dumps: the C encoder (dump streams through the Python one)
        fh.write(json.dumps(diag, separators=(",", ":")))
    tmp.replace(json_path)
    paths = {"json": str(json_path)}
    if html:
        paths["html"] = str(write_html(diag, out_dir / "report.html"))
    diag["summary"]["seconds"]["total"] = round(time.perf_counter() - t0, 3)
    diag["summary"]["cpu_seconds"] = round(time.process_time() - c0, 3)
    diag["paths"] = paths
    return diag


#: flagged steps in a row (:mod:`teller.localize.episodes`) from which a stage flag the model
#: rules out stays a fault, of a kind the model was not trained on, when the reference is a
#: recording of the run's deployment (docs/results.md, "Episodes": `teller_episodes`, and "A floor
#: relative to the model")
EPISODE_MIN = MIN_EPISODE
#: the same where the model keeps its own floor (:func:`model_floor`), chosen with it
OWN_FLOOR_EPISODE_MIN = STAGE_EPISODE
#: the view whose floor (:func:`teller.rca.episode_floor`) `teller diagnose` reads: it gives the
#: model each rank's step alone, as the vertical view's units are
FLOOR_VIEW = "vertical"


def model_floor(m: Any) -> tuple[float, int]:
    """The floor under which model ``m`` rules out a lasting departure of the numeric stage and
    the episode length from which one lasts: its own floor (the quantile of its probability over
    its val part's normal units, `teller rca floor`) with :data:`OWN_FLOOR_EPISODE_MIN`, else
    :data:`teller.rca.EPISODE_FLOOR` with :data:`EPISODE_MIN` (the pair each was chosen in)."""
    own = own_episode_floor(getattr(m, "meta", None) or {}, FLOOR_VIEW)
    return (own, OWN_FLOOR_EPISODE_MIN) if own is not None else (EPISODE_FLOOR, EPISODE_MIN)


def ruled_out(d: dict[str, Any], same_deployment: bool, length: str = "episode_length",
              floor: float = EPISODE_FLOOR, min_length: int = EPISODE_MIN, novelty: float | None = None,
              min_novelty: float = LASTING_NOVELTY) -> None:
    """A flagged step the model does not flag: a fault of a kind the model was not trained on
    (``unknown_fault``, its closest known type kept in ``fault_type_guess``) when the step lies in
    an episode of ``min_length`` or more flagged steps (``d[length]``: the episode's length) and
    the reference is a recording of the run's deployment, unless the model gives it less than
    ``floor`` (:func:`model_floor` gives both: it rules the step out, a normal step unlike the
    reference, as the stage's lasting departures on steps of known kinds mostly were) or the
    step's ``novelty`` (:mod:`teller.rca.novelty`; None: unknown, no test) is at most
    ``min_novelty`` (:data:`teller.rca.LASTING_NOVELTY`: the step is like the steps the model was
    trained on, its "normal" stands; ``near_training``); else ``model_says_normal``."""
    p = d.get("abnormal_probability")
    floor = p is not None and float(p) < floor
    near = novelty is not None and bool(np.isfinite(novelty)) and float(novelty) <= min_novelty
    lasting = same_deployment and not d.get("warmup") and int(d.get(length) or 0) >= min_length and not floor
    if lasting and near:
        d["near_training"] = True
    if lasting and not near:
        d["unknown_fault"] = True
        d["fault_type_guess"] = d.get("fault_type")
        d["fault_type"] = None
    else:
        d["model_says_normal"] = True


def novel_types(steps: list[dict[str, Any]], ratio: dict[int, float]) -> int:
    """The fault type of the steps unlike every step the model was trained on
    (:mod:`teller.rca.novelty`): each read step gets ``novelty`` (``ratio``: per step index,
    above 1 novel); a step the model flags with a type (its verdict, not a lasting departure it
    does not recognise) that lies in an episode of :data:`MIN_EPISODE` or more novel steps the
    stage flags with an evidence type (warm-up out) takes the evidence's type (``fault_type``;
    ``novel_fault``, the model's in ``fault_type_model``): on faults of kinds it never saw the
    model's type was mostly wrong and the evidence's mostly right (docs/results.md, "The
    rule-out floor and novelty"). Returns how many steps changed type."""
    from teller.localize.episodes import episode_lengths

    if not ratio:
        return 0
    nov = np.zeros(len(steps), bool)
    for k, d in enumerate(steps):
        r = ratio.get(int(d["index"]))
        if r is None or not np.isfinite(r):
            continue
        d["novelty"] = round(float(r), 3)
        nov[k] = r > 1.0 and bool(d.get("stage_flag", d.get("flag"))) and bool((d.get("evidence_type") or {}).get("fault_type")) \
            and not d.get("warmup")
    _, length = episode_lengths(*_lanes(steps), nov)
    changed = 0
    for d, n in zip(steps, length.tolist(), strict=True):
        if n < MIN_EPISODE or not d.get("flag") or not d.get("fault_type") or d.get("model_says_normal"):
            continue
        et = d["evidence_type"]["fault_type"]
        d["novel_fault"] = True
        if et != d["fault_type"]:
            d["fault_type_model"] = d["fault_type"]
            d["fault_type"] = et
            d["fault_probability"] = None
            changed += 1
    return changed


def _lanes(steps: list[dict[str, Any]]) -> tuple[np.ndarray, np.ndarray]:
    """The episodes' lane (the rank) and step number of each step dict."""
    return (np.asarray([int(d["rank"]) for d in steps], np.int64),
            np.asarray([int(d["step_num"]) for d in steps], np.int64))


def mark_episodes(diag: dict[str, Any], verdicts: bool = False) -> None:
    """Group the flagged steps, warm-up steps left out, into episodes (per rank, step numbers at most
    :data:`teller.localize.episodes.EPISODE_GAP` apart): ``diag["episodes"]`` ({index, rank,
    first_step, last_step, steps, start_ns, end_ns}, in time order) and each flagged step's
    ``episode`` (its index) and ``episode_length``. ``verdicts``: the flagged steps the model does
    not read as normal only (after :func:`write_reading`)."""
    from teller.localize.episodes import episode_lengths

    steps = diag["steps"]
    lane, num = _lanes(steps)
    # warm-up steps (left out of references) depart from normal operation by design: no episode
    flag = np.asarray([bool(d.get("flag")) and not d.get("warmup") and not (verdicts and d.get("model_says_normal"))
                       for d in steps], bool)
    eid, length = episode_lengths(lane, num, flag)
    members: dict[int, list[dict[str, Any]]] = {}
    for d, e, n in zip(steps, eid.tolist(), length.tolist(), strict=True):
        if e >= 0:
            members.setdefault(e, []).append(d)
            d["episode_length"] = int(n)
    eps = sorted(members.values(), key=lambda m: min(d["start_ns"] for d in m))
    diag["episodes"] = []
    for i, m in enumerate(eps):
        for d in m:
            d["episode"] = i
        diag["episodes"].append({"index": i, "rank": int(m[0]["rank"]), "first_step": min(int(d["step_num"]) for d in m),
                                 "last_step": max(int(d["step_num"]) for d in m), "steps": len(m),
                                 "start_ns": min(int(d["start_ns"]) for d in m), "end_ns": max(int(d["end_ns"]) for d in m)})


def step_type(d: dict[str, Any]) -> str | None:
    """The fault type a flagged step is given: the model's where it keeps the step abnormal, else
    (the model did not read it, or takes it for a fault it was not trained on) the type the
    stage's evidence points to; None for a step the model rules out or none names."""
    if d.get("model_says_normal"):
        return None
    if d.get("fault_type") and not d.get("unknown_fault"):
        return str(d["fault_type"])
    et = d.get("evidence_type")
    return str(et["fault_type"]) if et else None


def type_episodes(diag: dict[str, Any]) -> None:
    """Each episode's fault type (after :func:`mark_episodes`, and the model when it ran): the type
    most of its steps are given (:func:`step_type`; ties: the larger summed step score,
    :func:`teller.localize.episodes.episode_majority`), as ``fault_type`` (None where no step
    names one), with ``type_votes`` ({type: steps}). A fault lasts, and its steps share a cause."""
    from teller.localize.episodes import episode_majority

    eps = diag.get("episodes") or []
    if not eps:
        return
    members = [d for d in diag["steps"] if "episode" in d]
    types = [step_type(d) for d in members]
    names = sorted({t for t in types if t})
    code = np.asarray([names.index(t) if t else -1 for t in types], np.int64)
    eid = np.asarray([int(d["episode"]) for d in members], np.int64)
    score = np.asarray([float(d.get("score") or 0.0) for d in members])
    win = episode_majority(eid, code, score)
    first = dict(zip(eid.tolist(), win.tolist(), strict=True))  # every step of an episode has its episode's winner
    for e in eps:
        e["fault_type"] = names[first[e["index"]]] if first.get(e["index"], -1) >= 0 else None
        e["type_votes"] = {}
    for e_i, t in zip(eid.tolist(), types, strict=True):
        if t:
            v = eps[e_i]["type_votes"]
            v[t] = v.get(t, 0) + 1


def reference_match(est: Any, rf: Any, keep_warmup: bool = False) -> dict[str, Any]:
    """Whether the reference was recorded on the run's deployment (:mod:`teller.localize.deployment`):
    ``same_deployment`` (None: the reference keeps no shape, e.g. a localizer saved before shapes
    were kept), the two shapes and the lines that say how they differ."""
    from teller.localize import run_shape
    from teller.localize.deployment import deployment_mismatch

    ref = (getattr(est, "extra_", None) or {}).get("deployment")
    mine = run_shape(rf, keep_warmup)
    lines = deployment_mismatch(ref, mine)
    return {"same_deployment": None if not ref else not lines, "reference": ref, "run": mine, "lines": lines}


def input_health(run: str | os.PathLike, reference: list[str | os.PathLike]) -> dict[str, Any]:
    """What is wrong with the diagnosed run and its references, in words
    (:func:`teller.inspect.stats.run_health`): a partial run (killed or interrupted recording, a
    cut trace), reader warnings, clock repairs, drops. ``partial`` is true when any of them is
    partial; ``lines`` are prefixed with the run they concern."""
    from teller.inspect.stats import run_health

    out: dict[str, Any] = {"partial": False, "runs": [], "lines": []}
    for role, r in [("run", run), *(("reference", x) for x in reference)]:
        h = run_health(r)
        out["runs"].append({"role": role, "path": str(r), "status": h["status"], "partial": h["partial"], "lost": h["lost"]})
        out["partial"] = out["partial"] or h["partial"]
        if h["partial"]:
            out["lines"].append(f"{role} {r} is partial ({h['status']})")
        out["lines"] += [f"{role} {r}: {ln}" for ln in h["lines"]]
    return out


# ------------------------------------------------------------------------------------------------
# the root-cause model



_MECH_WORD = re.compile(r"\(([a-z][a-z0-9_]+)\)")


def _ground(text: str, step: dict[str, Any]) -> str:
    """The model's explanation projected onto the schema (docs/design.md §9) and onto what the run
    shows. The reference explanations the model learnt from read "TYPE fault (MECHANISM) in step N
    on rank R: evidence OPS; NUMBERS. Cause: ...". Of the generated text only the mechanism is
    kept, and only when it is a registered mechanism of the type the fault head chose; the type,
    the step and rank, the evidence operators (the operator head's, nodes of this step) and the
    numbers (the numeric stage's measurement of the first suspect that is, or lies in, an evidence
    operator; else its top suspect, named as such) are filled in from the structured
    answer, the cause is the mechanism's own description, and the sentence ends with the next
    step an operator can take (the mechanism's ``action``, else the fault type's). Numbers the
    model writes are never shown: it saw them in training, not in this run."""
    from teller.inject import CATEGORY_ACTIONS, CATEGORY_TITLES
    from teller.inject.mechanisms import registry

    ft = step.get("fault_type")
    if not ft or step.get("model_says_normal"):
        return ""
    reg = registry()
    mech = next((w for w in _MECH_WORD.findall(text or "") if w in reg and reg[w].category == ft), None)
    ops = ", ".join(step.get("evidence_families") or []) or "the whole step"
    out = f"{CATEGORY_TITLES.get(ft, ft)} fault" + (f" ({mech})" if mech else "")
    out += f" in step {step['step_num']} on rank {step['rank']}: evidence {ops}"
    ev = [x for x in step.get("suspects") or [] if x.get("evidence")]
    fams = set(step.get("evidence_families") or [])
    own = next((x for x in ev if x.get("family") in fams or (x.get("module") or {}).get("family") in fams), None)
    if own is not None:  # the numbers of an operator the model names
        out += f"; measured: {suspect_name(own)} {evidence_text(own['evidence'][0])} against the reference"
    elif ev:  # the model names an operator the numeric stage does not suspect: say whose numbers these are
        out += (f"; the numeric stage's top suspect is {suspect_name(ev[0])}: "
                f"{evidence_text(ev[0]['evidence'][0])} against the reference")
    out += "."
    if mech and reg[mech].cause:
        out += f" Cause: {reg[mech].cause}."
    action = (reg[mech].action if mech else "") or CATEGORY_ACTIONS.get(ft, "")
    if action:
        out += f" Next: {action}."
    return out


def _step_logs(run: Path, step_ids: list[int], note: Any) -> dict[int, str]:
    """Aligned log text of each STEP node (``log_alignment.parquet``; aligned here when the run has
    logs but no alignment yet), lines in order, wall-clock prefixes dropped."""
    rd = RunDir(run)
    if not rd.has_table("log_alignment"):
        if not rd.log_files():
            return {}
        from teller.logs import align_run

        if note is not None:
            note(f"{rd.path}: aligning its logs for the root-cause model (`teller logs {rd.path}`)")
        align_run(rd.path)
    import pyarrow as pa
    import pyarrow.compute as pc

    from teller.rca.data import normalize_log_line

    t = rd.read_table("log_alignment", columns=["line_no", "step_id", "text"])
    t = t.filter(pc.is_in(t.column("step_id"), value_set=pa.array(step_ids, pa.int64()))).sort_by("line_no")
    out: dict[int, list[str]] = {}
    for sid, txt in zip(t.column("step_id").to_pylist(), t.column("text").to_pylist(), strict=True):
        out.setdefault(int(sid), []).append(normalize_log_line(txt or ""))
    return {k: "\n".join(v) for k, v in out.items()}


#: flagged steps the root-cause model reads by default in `teller diagnose` (``--model-steps``):
#: the highest-scored. The model's cost grows with each step it reads (benchmarks/README.md,
#: bench_diagnose_model.py), and this bound keeps it a few seconds of one core
MODEL_STEPS = 48

#: how the root-cause model reads a run (``teller diagnose --model-reads``): every step, read over
#: time (the default), or the steps the numeric stage flags
MODEL_READS = ("every", "flagged")

#: steps per forward pass of the model (in the order of their trees' sizes, so a batch pads little)
MODEL_BATCH = 16


def _step_blocks(forest: Any, step_ids: list[int], iteration: bool = False) -> tuple[np.ndarray, Any]:
    """Sizes of the STEP nodes' subtrees and a table of their rows only: a run's forest is in
    depth-first preorder with ``node_id`` the row, so a step's tree is the block of rows
    ``[node_id, node_id + size)``; the model then serializes these steps, not the whole run's.
    ``iteration`` (a model whose unit is the engine iteration): also the iteration's rows outside
    the STEP subtree (:func:`teller.forest.with_iterations`: schedule/update ranges, GAP rows), in
    row order. A table of another layout is returned whole, with sizes 0."""
    import pyarrow as pa

    ids = np.asarray(step_ids, np.int64)
    n = forest.num_rows
    whole = np.zeros(len(ids), np.int64), forest
    if "size" not in forest.column_names or not n or not len(ids) or ids.min() < 0 or ids.max() >= n:
        return whole
    if not np.array_equal(forest.column("node_id").to_numpy(), np.arange(n)):
        return whole
    size = forest.column("size").to_numpy()[ids].astype(np.int64)
    if np.any(size < 1) or np.any(ids + size > n):
        return whole
    from teller.forest import ranges, with_iterations

    rows = ranges(ids, ids + size)
    if not (iteration and "step_idx" in forest.column_names):
        return size, forest.take(pa.array(rows))
    keep = np.zeros(n, bool)
    keep[rows] = True
    is_step = np.zeros(n, bool)
    is_step[ids] = True
    six = forest.column("step_idx").combine_chunks().fill_null(-1).to_numpy(zero_copy_only=False)
    keep = with_iterations(keep, is_step, forest.column("step_id").to_numpy(), six)
    return size, forest.take(pa.array(np.flatnonzero(keep)))


def _model_rank(step: dict[str, Any]) -> tuple[float, float, int]:
    """Order in which flagged steps are given to the model: by score, highest first; scores
    saturate at 1, so ties go by the largest distance of a suspect from its reference mode, then
    by time."""
    score = step["score"] if step.get("score") is not None else -math.inf
    dist = max((s["distance"] for s in step.get("suspects") or [] if s.get("distance") is not None), default=-math.inf)
    return -score, -dist, step["start_ns"]


def mechanism_written(text: str, fault_type: str) -> bool:
    """Whether an explanation decoded so far already holds what :func:`_ground` keeps of the whole
    one: a registered mechanism of ``fault_type`` in parentheses, in its first sentence and well
    inside ``max_explanation_chars``. The rest of the text cannot change that choice (the first
    such word is kept, and the projection keeps the first sentence), so decoding can stop there.
    A mechanism written after a sentence end is not enough: the projection may drop that sentence
    only once it knows where it ends, so such a text is decoded to its end."""
    from teller.inject.mechanisms import registry
    from teller.rca.schema import _SENT_END, _WS

    t = _WS.sub(" ", (text or "").replace("\x00", " ")).strip()
    reg = registry()
    for mt in _MECH_WORD.finditer(t):
        w = mt.group(1)
        if w in reg and reg[w].category == fault_type:
            return mt.end() <= _MECH_CHARS and not _SENT_END.search(t, 0, mt.start())
    return False


#: explanation tokens decoded at most while looking for the mechanism (``explain="mechanism"``): the
#: reference sentences name it in their first words ("TYPE fault (MECHANISM)": 9 to 12 tokens
#: of the text tokenizer of the model shipped until 2026-12-03, 9 to 11 of the one shipped since),
#: so an explanation that has none by then gets none. On data/h200_v2's request test part the
#: mechanism kept was that of full decoding for all 269 typed units of the model shipped until
#: 2026-12-03, with this bound and with 16 and 32 (benchmarks/README.md)
MECHANISM_TOKENS = 24

#: the mechanism must end within this many characters for decoding to stop at it (the explanation
#: is projected onto max_explanation_chars, 480 for the shipped model)
_MECH_CHARS = 240


#: share of a step's trace tokens unknown to the model (operators it never saw in training) above
#: which its verdict on the step is marked off its training distribution
OFF_DISTRIBUTION = 0.25


def unknown_share(inp: Any, trace_tok: Any) -> np.ndarray:
    """Per unit of ``inp`` (:class:`teller.rca.data.StepInputs`), the share of its trace tokens
    that are unknown symbols (``<unk>``, ``<unk:LAYER>``) of the model's TPE vocabulary."""
    is_unk = trace_tok.is_unknown(np.asarray(inp.input_ids)).astype(np.int64)
    n = np.diff(inp.offsets)
    c = np.concatenate([[0], np.cumsum(is_unk)])
    return (c[inp.offsets[1:]] - c[inp.offsets[:-1]]) / np.maximum(n, 1)


def _check_explain(explain: str) -> None:
    """Refuse an explanation mode other than ``"mechanism"`` or ``"full"``."""
    if explain not in ("mechanism", "full"):
        raise TellerError(f"model explanation {explain!r}: 'mechanism' or 'full'")


def _load_model(model: str | os.PathLike | None, note: Any) -> tuple[Any, Path] | None:
    """The root-cause model at ``model`` (None: the one shipped with the package) and its path, or
    None, with a note, when torch / transformers are missing or the package has no default model."""
    path = Path(model) if model is not None else DEFAULT_MODEL
    try:
        from teller.rca import load
    except ImportError as e:  # torch / transformers not installed: the numeric stage alone
        if note is not None:
            note(f"root-cause model skipped ({e}); install it with `pip install 'teller[rca]'`")
        return None
    from teller.rca.api import weight_files

    if model is None and not weight_files(path / "model.safetensors"):
        if note is not None:
            note(f"root-cause model skipped: the package has no default model at {path}")
        return None
    return load(path), path


def _model_info(m: Any, path: Path, reads: str, max_steps: int | None, explain: str) -> dict[str, Any]:
    """``diag["model"]``: what the model is and how it read the run."""
    tr = m.meta.get("training", {})
    info = {"path": str(path), "variant": m.cfg.variant,
            **{k: tr[k] for k in ("dataset", "split", "seed", "steps") if k in tr}}
    info.update(reads=reads, steps_eligible=0, steps_read=0, max_steps=int(max_steps) if max_steps else None,
                explanations=explain, abnormal_floor=SCREEN_FLOOR, abnormal_cut=m.abnormal_cut)
    if getattr(m, "flag_expert", None) is not None:
        # the flag expert's share in the abnormal probability (0 where it is left out: an expert on the layer mix
        # on a run of a shape the model was not trained on, or a context the run cannot give)
        info["flag_weight"] = float(m.flag_weight)
    return info


def _step_node_ids(forest: Any) -> set[int]:
    """Node ids of the forest's STEP rows (rows that are their own step): the subtrees the model reads."""
    import pyarrow.compute as pc

    return set(forest.filter(pc.equal(forest.column("node_id"), forest.column("step_id"))).column("node_id").to_pylist())


def _bare_steps(dicts: list[dict[str, Any]], info: dict[str, Any], note: Any, what: str) -> list[dict[str, Any]]:
    """``dicts`` less the steps recorded without detail (no aten ops, no GPU activity: the model,
    which learnt from call trees that hold them, does not read them; they are marked
    ``model_no_detail``)."""
    bare = without_detail([str(d.get("name") or "") for d in dicts])
    if not bare.any():
        return dicts
    for d in (d for d, b in zip(dicts, bare.tolist(), strict=True) if b):
        d["model_no_detail"] = True
    info["steps_without_detail"] = int(bare.sum())
    if note is not None:
        note(f"{int(bare.sum())} {what} were recorded without detail (`teller record --detail-every`): "
             "the root-cause model does not read them; they have the numeric stage's verdict only")
    return [d for d, b in zip(dicts, bare.tolist(), strict=True) if not b]


def _model_inputs(m: Any, forest: Any, run: Path, dicts: list[dict[str, Any]], note: Any,
                  info: dict[str, Any]) -> tuple[list[dict[str, Any]], Any] | None:
    """The steps ``dicts`` in the order the model reads them (their trees' sizes: batches of steps
    of similar length pad little) and their inputs (trees, TPE, aligned log lines), or None, with
    ``info["skipped"]`` and a note, when the forest is one the model cannot read."""
    block, sub = _step_blocks(forest, [int(d["node_id"]) for d in dicts], iteration=m.cfg.unit == "iteration")
    dicts = [dicts[k] for k in np.argsort(block, kind="stable").tolist()]
    ids = [int(d["node_id"]) for d in dicts]
    logs = _step_logs(run, ids, note)
    try:
        return dicts, m.inputs(sub, [[i] for i in ids], [logs.get(i, "") for i in ids])
    except TellerError as e:  # a forest the model cannot read: the numeric stage's verdict stands
        info["skipped"] = f"the model could not read the steps' trees: {e}"
        if note is not None:
            note(f"root-cause model skipped: {info['skipped']}")
        return None


def _node_labels(forest: Any, ids: set[int]) -> dict[int, str]:
    """``LAYER name`` of the forest rows ``ids`` (the evidence nodes)."""
    if not ids:
        return {}
    import pyarrow as pa
    import pyarrow.compute as pc

    sel = forest.filter(pc.is_in(forest.column("node_id"), value_set=pa.array(sorted(ids), pa.int64())))
    label: dict[int, str] = {}
    for n, lay, nm in zip(sel.column("node_id").to_pylist(), sel.column("layer").to_pylist(),
                          sel.column("name").to_pylist(), strict=True):
        nm = str(nm or "")
        label[int(n)] = nm if nm.startswith(f"{lay} ") else f"{lay} {nm}"
    return label


def apply_model(diag: dict[str, Any], run: str | os.PathLike, model: str | os.PathLike | None = None,
                note: Any = None, forest: Any = None, max_steps: int | None = None,
                explain: str = "mechanism", loaded: tuple[Any, Path] | None = None,
                steps: Any = None) -> dict[str, Any] | None:
    """Run the root-cause model (docs/design.md §9) on the flagged steps of ``diag`` and add to each:
    ``abnormal_probability``, ``fault_type`` and ``fault_probability`` (the model's type given
    abnormal, also when it finds the step normal: ``model_says_normal``, an abnormal probability
    under :data:`SCREEN_FLOOR`; from the floor up the step keeps its flag), ``evidence_operators``
    (``[{node_id, name}]``, nodes of the step's own tree) and ``explanation`` (one sentence).
    This is ``--model-reads flagged``; :func:`read_every` is the model reading every step.

    The model reads each flagged step's call tree (TPE-encoded) and its aligned log lines. Schema
    projection: the type is one of the five, the operators are nodes of the step, and the
    explanation is projected by :func:`_ground` (the generated text as written is kept in
    ``explanation_model``). ``model_unknown_share``: the share of the step's trace tokens the
    model's vocabulary does not know; above :data:`OFF_DISTRIBUTION` the step is marked
    ``model_off_distribution`` (the model never saw such operators: its verdict is a guess, and
    the console and the report say so). Steps without a node (fixed windows) are left to the numeric stage.

    ``max_steps``: the model reads at most this many flagged steps, those with the highest
    numeric scores (ties: the largest suspect distance; :func:`_model_rank`) (None or 0: all). Its cost grows with each step it reads, so the default of
    ``teller diagnose`` (:data:`MODEL_STEPS`) bounds it; the others keep the numeric stage's
    verdict and are marked ``model_not_read``, and ``diag["model"]`` says how many steps were
    eligible (``steps_eligible``), read (``steps_read``) and the bound (``max_steps``).
    ``explain``: ``"mechanism"`` stops decoding an explanation once it has written what
    :func:`_ground` keeps (:func:`mechanism_written`), or after :data:`MECHANISM_TOKENS` tokens
    without it (``explanation_model`` is then the text up to there); ``"full"`` decodes it to
    its end.
    ``forest``: the run's forest table when the caller has read it; ``loaded``: (model, path) when
    the caller has loaded it (:func:`read_every`'s refused reading). ``steps``: the run's
    :class:`teller.localize.features.StepTable`, for a flag expert that reads the shape-free
    context (the flagged steps' iterations, their layer mix against every step of the run: the
    steps are then all serialized, not only the flagged ones); without it such an expert is
    left out and the head reads alone, against its own cut. Returns the model's description, also stored as ``diag["model"]``."""
    _check_explain(explain)
    # the model reads STEP subtrees: steps decided by another rule (profiler steps, fixed windows)
    # are left to the numeric stage
    by_step_ranges = diag.get("steps_rule", {}).get("rule", "STEP ranges") == "STEP ranges"
    flagged = [d for d in diag["steps"] if d.get("flag") and d.get("node_id", -1) >= 0 and by_step_ranges]
    got = loaded or _load_model(model, note)
    if got is None:
        return None
    m, path = got
    m.use_flag_expert(run_workload(run) or None, context=steps is not None and by_step_ranges)
    info = diag["model"] = _model_info(m, path, "flagged", max_steps, explain)
    if not flagged:
        return info
    rd = RunDir(run)
    if forest is None:  # the forest table the numeric stage already read, else the run's
        from teller.forest import Forest

        forest = Forest.read(rd.path).table
    step_ids = _step_node_ids(forest)
    flagged = _bare_steps([d for d in flagged if int(d["node_id"]) in step_ids], info, note, "flagged steps")
    if not flagged:
        return info
    # the highest-scored first; past ``max_steps`` the numeric verdict stands
    ranked = sorted(flagged, key=_model_rank)
    keep = ranked[:max_steps] if max_steps else ranked
    info.update(steps_eligible=len(flagged), steps_read=len(keep))
    if len(keep) < len(flagged):
        for d in ranked[len(keep):]:
            d["model_not_read"] = True
        if note is not None:
            note(f"the root-cause model read the {len(keep)} highest-scored of {len(flagged)} flagged steps "
                 "(`--model-steps N` to read more, 0 for all); the others have the numeric stage's verdict only")
    read = _model_inputs(m, forest, rd.path, keep, note, info)
    if read is None:
        return info
    flagged, inp = read
    prep = m.prepare(inp)
    whole_run = False  # the units' context against every step of the run (what the novelty reads too)
    if _reads_context(m) or _has_novelty(m):
        ctx = _flagged_context(m, forest, rd.path, steps, flagged) if steps is not None and by_step_ranges else None
        if ctx is None:  # the run's other steps unreadable: the head alone, against its own cut
            m.use_flag_expert(run_workload(run) or None, context=False)
            info["flag_weight"] = float(getattr(m, "flag_weight", 0.0))
        else:
            prep.unit_ctx, whole_run = ctx, True
    mech = explain == "mechanism"
    same_deployment = (diag.get("reference_match") or {}).get("same_deployment") is True
    info["episode_floor"], info["episode_min"] = model_floor(m)
    preds = m.predict(prep, batch_size=MODEL_BATCH, explain_done=mechanism_written if mech else None,
                      explain_tokens=MECHANISM_TOKENS if mech else None, abnormal_floor=SCREEN_FLOOR)
    unknown = unknown_share(inp, m.trace_tok)
    label = _node_labels(forest, {int(n) for p in preds for n in p["evidence_node_ids"]})
    nov = m.unit_novelty(prep) if whole_run else None
    for k, (d, p, unk) in enumerate(zip(flagged, preds, unknown.tolist(), strict=True)):
        ft = p["fault_type"] or p.get("fault_type_best", "")
        _answer(d, p, unk, label)
        d["abnormal_probability"] = _f(p["abnormal_prob"])
        d["fault_type"] = ft or None
        d["fault_probability"] = _f(p["fault_type_prob"]) if p["fault_type"] else None
        d["model_unsure"] = bool(p["fault_type"]) and p["abnormal_prob"] < m.abnormal_cut
        if not p["fault_type"]:
            ruled_out(d, same_deployment, floor=info["episode_floor"], min_length=info["episode_min"],
                      novelty=None if nov is None else float(nov[k]))
        d["explanation_model"] = p["explanation"] or None
        d["explanation"] = _ground(p["explanation"] or "", d) or None
    info["lasting_novelty"] = LASTING_NOVELTY
    if nov is not None:
        info["novel_retyped"] = novel_types(flagged, dict(zip([int(d["index"]) for d in flagged], nov.tolist(), strict=True)))
        again = [k for k, d in enumerate(flagged) if d.get("fault_type_model")]
        texts = m.explain(prep, again, [str(flagged[k]["fault_type"]) for k in again], batch_size=MODEL_BATCH,
                          explain_done=mechanism_written if mech else None, explain_tokens=MECHANISM_TOKENS if mech else None)
        for k, text in zip(again, texts, strict=True):  # written again for the evidence's type
            d = flagged[k]
            d["explanation_model"] = text or None
            d["explanation"] = _ground(text or "", d) or None
    diag["summary"]["model_abnormal"] = sum(1 for d in flagged if not d.get("model_says_normal"))
    diag["summary"]["unknown_fault_steps"] = sum(1 for d in flagged if d.get("unknown_fault"))
    return info


def _reads_context(m: Any) -> bool:
    """Whether the model (an ensemble: any member) mixes in a flag expert on the shape-free context."""
    return any(getattr(x, "flag_weight", 0.0) and x.flag_expert.reads == "context" for x in getattr(m, "members", [m]))


def _has_novelty(m: Any) -> bool:
    """Whether the model (an ensemble: any member) keeps its training units' context (:mod:`teller.rca.novelty`)."""
    return any(getattr(x, "novelty", None) is not None for x in getattr(m, "members", [m]))


def _flagged_context(m: Any, forest: Any, run: Path, st: Any, flagged: list[dict[str, Any]]) -> np.ndarray | None:
    """The shape-free context (:func:`teller.rca.context.context_features`) of the ``flagged``
    steps: their iteration rows of ``st`` and their layer mix against every step of the run that
    has a STEP node (serialized here for their statistics); None where those cannot be read."""
    from teller.rca.context import units_context
    from teller.rca.data import unit_statistics

    have = _step_node_ids(forest)
    every = [{"index": i, "node_id": int(st.node_id[i])} for i in range(st.n) if int(st.node_id[i]) in have]
    got = _model_inputs(m, forest, run, every, None, {})
    if got is None:
        return None
    every, inp = got
    idx = np.asarray([int(d["index"]) for d in every], np.int64)
    ctx = units_context(inp, unit_statistics(inp), st.iterations[idx] if st.iterations is not None else None)
    at = {int(i): k for k, i in enumerate(idx.tolist())}
    return ctx[[at[int(d["index"])] for d in flagged]]


def _answer(d: dict[str, Any], p: dict[str, Any], unk: float, label: dict[int, str]) -> None:
    """The fields of the model's answer every read step it reports on gets: how much of its trace
    the model knows, its evidence nodes and their families."""
    d["model_unknown_share"] = round(float(unk), 3)
    if unk > OFF_DISTRIBUTION:
        d["model_off_distribution"] = True
    d["evidence_operators"] = [{"node_id": int(n), "name": label.get(int(n), "?")} for n in p["evidence_node_ids"]]
    d["evidence_families"] = list(p["evidence_operators"])


def read_every(run: str | os.PathLike, rf: RunFeatures, model: str | os.PathLike | None = None,
               note: Any = None, max_steps: int | None = None,
               explain: str = "mechanism") -> dict[str, Any] | None:
    """The root-cause model reading every step of the run (``--model-reads every``, the default),
    its heads only (no explanation yet), then over time as a fault lasts
    (:func:`teller.localize.episodes.over_time`, per rank): its flags (abnormal probability from
    its cut), the steps at even odds or more next to an episode of :data:`MIN_EPISODE` or more of
    its flags (``sustained``), each episode's majority type. Returns the reading, which
    :func:`localize` (``also``: the steps it flags get candidates and suspects) and
    :func:`write_reading` take; None when there is no model to read with. A step off the model's
    training distribution (more than :data:`OFF_DISTRIBUTION` of its trace tokens unknown) is never
    the model's flag. The reading is ``refused`` (with the reason; `teller diagnose` then screens
    the stage's flags, :func:`apply_model`) for a run whose workload shape (:func:`run_workload`)
    is not among those the model was trained on (``training.workloads`` in its config.json; a model
    that records none reads every run)."""
    from teller.localize.episodes import SUSTAIN_FLOOR, over_time

    _check_explain(explain)
    got = _load_model(model, note)
    if got is None:
        return None
    m, path = got
    shape = run_workload(run)
    m.use_flag_expert(shape or None)
    info = _model_info(m, path, "every", max_steps, explain)
    reading: dict[str, Any] = {"model": m, "path": path, "info": info, "index": np.zeros(0, np.int64)}
    known = m.meta.get("training", {}).get("workloads") or []
    if known and shape not in known:  # a deployment the model never saw: its reading of every step is untested
        reading["refused"] = (f"the run's workload shape ({shape or 'not recorded'}) is not one the model was trained "
                              f"on ({'; '.join(known)}): it reads only the steps the numeric stage flags")
        return reading
    st = rf.steps
    if st.rule != "STEP ranges" or not st.n:  # profiler steps, fixed windows: the numeric stage's
        return reading
    forest = rf.forest.table
    ids = _step_node_ids(forest)
    dicts = [{"index": i, "node_id": int(st.node_id[i]), "name": st.names[i]} for i in range(st.n)
             if int(st.node_id[i]) in ids]
    every = dicts
    dicts = _bare_steps(dicts, info, note, "steps")
    reading["no_detail"] = np.asarray([d["index"] for d in every if d.get("model_no_detail")], np.int64)
    if not dicts:
        return reading
    got_inputs = _model_inputs(m, forest, rf.path, dicts, note, info)
    if got_inputs is None:
        return reading
    dicts, inp = got_inputs
    idx = np.asarray([d["index"] for d in dicts], np.int64)
    prep = m.prepare(inp, iterations=st.iterations[idx] if st.iterations is not None else None)  # every step read: the run's own
    floor = min(SUSTAIN_FLOOR, m.abnormal_cut)  # the steps that may join an episode get evidence too
    preds = m.predict(prep, batch_size=MODEL_BATCH, explain=False, abnormal_floor=floor)
    reading["novelty"] = m.unit_novelty(prep)
    p = np.asarray([float(x["abnormal_prob"]) for x in preds])
    unknown = unknown_share(inp, m.trace_tok)
    # a step whose operators the model mostly never saw is not its to flag: its verdict there is a
    # guess (the stage's flag stands, marked low confidence: write_reading)
    known = unknown <= OFF_DISTRIBUTION
    flag = (p >= m.abnormal_cut) & known
    best = np.asarray([x.get("fault_type_best") or "" for x in preds], dtype=object)
    ops = [list(x["evidence_operators"]) if f else [] for x, f in zip(preds, flag.tolist(), strict=True)]
    over = over_time(st.rank[idx], st.step_num[idx], flag, np.where(known, p, 0.0), best, ops, floor=SUSTAIN_FLOOR)
    info.update(steps_eligible=len(idx), steps_read=len(idx), model_flagged=int(flag.sum()),
                sustained=int(over["joined"].sum()), retyped=int(over["retyped"]),
                off_distribution=int((~known).sum()))
    reading.update(index=idx, preds=preds, prep=prep, unknown=unknown, flag=flag,
                   over=over, node_labels=_node_labels(forest, {int(n) for x in preds for n in x["evidence_node_ids"]}))
    return reading


def run_workload(run: str | os.PathLike) -> str:
    """The served model's shape of ``run`` as the dataset's ``workload`` column names it (run.json's
    model config, else a campaign's labels.json; "" when neither says)."""
    from teller.dataset.build import workload_shape

    rd = RunDir(run)
    labels = None
    if (rd.path / "labels.json").is_file():
        try:
            labels = json.loads((rd.path / "labels.json").read_text())
        except (OSError, ValueError):
            labels = None
    try:
        return workload_shape(rd, labels if isinstance(labels, dict) else None)
    except (OSError, ValueError, TypeError):
        return ""


def reading_flags(reading: dict[str, Any] | None) -> np.ndarray | None:
    """The steps (indices) the model's reading over time flags, for :func:`localize`'s ``also``."""
    if not reading or reading.get("refused") or not len(reading["index"]):
        return None
    return reading["index"][reading["over"]["flag"]]


def write_reading(diag: dict[str, Any], reading: dict[str, Any], note: Any = None) -> dict[str, Any]:
    """The model's reading of every step (:func:`read_every`) written into ``diag`` (built with
    its flags in ``also``): every read step gets ``abnormal_probability``; a step it flags over
    time gets ``flag``, ``flagged_by`` (``"model"``, with ``"stage"`` where the numeric stage flags
    it too), its episode's ``fault_type``, the evidence (``evidence_operators``,
    ``evidence_families``; a step that joined an episode at even odds, ``sustained``, the families
    at least half of the episode's flagged steps name) and an explanation (at most
    ``max_steps``, the most probable first; the others ``model_not_explained``). A step only the
    stage flags keeps its flag as a lasting departure (``unknown_fault``, typed by its evidence)
    when it lies in a long enough episode of stage flags against a reference of the run's
    deployment and the model gives it at least its floor (:func:`model_floor`: both), else the
    model reads it as normal (``model_says_normal``): the rule
    measured as ``teller_sustained_family`` (docs/results.md). Returns ``diag["model"]``."""
    from teller.localize.episodes import episode_lengths
    from teller.rca.schema import project_explanation

    m, info = reading["model"], reading["info"]
    diag["model"] = info
    steps = diag["steps"]
    # the stage's own episodes (warm-up steps left out), before the model's flags are added
    sflag = np.asarray([bool(d.get("flag")) and not d.get("warmup") for d in steps], bool)
    _, slen = episode_lengths(*_lanes(steps), sflag)
    for d, n in zip(steps, slen.tolist(), strict=True):
        d["stage_flag"] = bool(d.get("flag"))
        if d["stage_flag"]:
            d["flagged_by"] = ["stage"]
            if n:
                d["stage_episode_length"] = int(n)
    by_index = {int(d["index"]): d for d in steps}
    for i in reading.get("no_detail", np.zeros(0, np.int64)).tolist():
        if i in by_index:
            by_index[i]["model_no_detail"] = True
    if not len(reading["index"]):
        _stage_only(diag, same_deployment=False, read=set())
        return info
    over, preds, label = reading["over"], reading["preds"], reading["node_labels"]
    prep = reading["prep"]
    mine: list[tuple[int, dict[str, Any]]] = []  # (position in the reading, step) of the model's verdicts
    for k, (i, p, unk) in enumerate(zip(reading["index"].tolist(), preds, reading["unknown"].tolist(), strict=True)):
        d = by_index[i]
        d["abnormal_probability"] = _f(p["abnormal_prob"])
        if not over["flag"][k]:
            continue
        mine.append((k, d))
        d["flag"] = True
        d["flagged_by"] = ["model"] + (["stage"] if d["stage_flag"] else [])
        _answer(d, p, unk, label)
        ft = str(over["types"][k])
        d["fault_type"] = ft
        d["fault_probability"] = _f(p["fault_type_prob"]) if p["fault_type"] == ft else None
        if (p["fault_type"] or p.get("fault_type_best")) != ft:
            d["episode_type"] = True  # its own best type differs: it takes its episode's
        d["model_unsure"] = False
        if over["joined"][k]:  # joined its episode at even odds: the episode's operators
            d["sustained"] = True
            fams = list(over["operators"][k])
            nodes = p["evidence_nodes"]
            keep = [n for n, nd in zip(p["evidence_node_ids"], nodes, strict=True)
                    if m.node_families(prep, k, [nd])[0] in fams]
            d["evidence_operators"] = [{"node_id": int(n), "name": label.get(int(n), "?")} for n in keep]
            d["evidence_families"] = fams
    same_deployment = (diag.get("reference_match") or {}).get("same_deployment") is True
    floor = model_floor(m)
    info["episode_floor"], info["episode_min"] = floor
    info["lasting_novelty"] = LASTING_NOVELTY
    nov = reading.get("novelty")
    ratio = {} if nov is None else dict(zip(reading["index"].tolist(), nov.tolist(), strict=True))
    _stage_only(diag, same_deployment, read={int(i) for i in reading["index"].tolist()}, preds=dict(
        zip(reading["index"].tolist(), preds, strict=True)), unknown=dict(
        zip(reading["index"].tolist(), reading["unknown"].tolist(), strict=True)), label=label, floor=floor,
        novelty=ratio)
    info["novel_retyped"] = novel_types(steps, ratio)
    # explanations: the model's verdicts, the most probable first, up to the bound
    bound = info.get("max_steps")
    order = sorted(mine, key=lambda kd: (-float(kd[1]["abnormal_probability"] or 0), kd[1]["start_ns"]))
    todo = order[:bound] if bound else order
    for _, d in order[len(todo):]:
        d["model_not_explained"] = True
    if len(todo) < len(order) and note is not None:
        note(f"the root-cause model explains the {len(todo)} most probable of its {len(order)} abnormal steps "
             "(`--model-steps N` for more, 0 for all); the others have its type and evidence without a sentence")
    mech = info.get("explanations", "mechanism") == "mechanism"
    texts = m.explain(prep, [k for k, _ in todo], [str(d["fault_type"]) for _, d in todo], batch_size=MODEL_BATCH,
                      explain_done=mechanism_written if mech else None, explain_tokens=MECHANISM_TOKENS if mech else None)
    for (_, d), text in zip(todo, texts, strict=True):
        text = project_explanation(text, d["fault_type"], d.get("evidence_families") or [], m.cfg.max_explanation_chars)
        d["explanation_model"] = text or None
        d["explanation"] = _ground(text, d) or None
    info["explained"] = len(todo)
    diag["summary"]["steps_flagged"] = sum(1 for d in steps if d.get("flag"))
    diag["summary"]["stage_flagged"] = int(sum(1 for d in steps if d.get("stage_flag")))
    diag["summary"]["model_abnormal"] = len(mine)
    diag["summary"]["unknown_fault_steps"] = sum(1 for d in steps if d.get("unknown_fault"))
    return info


def _stage_only(diag: dict[str, Any], same_deployment: bool, read: set[int], preds: dict[int, Any] | None = None,
                unknown: dict[int, float] | None = None, label: dict[int, str] | None = None,
                floor: tuple[float, int] = (EPISODE_FLOOR, EPISODE_MIN), novelty: dict[int, float] | None = None) -> None:
    """The steps only the numeric stage flags, after the model read every step: a lasting
    departure (an episode of ``floor[1]`` or more stage flags, warm-up left out, against a
    reference of the run's deployment) stays, a fault of a kind the model was not trained on
    (``unknown_fault``, its closest known type in ``fault_type_guess`` where the model read it);
    the others the model reads as normal (``model_says_normal``). A step it did not read keeps the
    stage's verdict, and so does a step off its training distribution (``model_off_distribution``:
    the stage's flag and the type of its evidence, the model's guess kept in ``fault_type_guess``)."""
    for d in diag["steps"]:
        if not d.get("stage_flag") or d.get("flagged_by") != ["stage"]:
            continue
        i = int(d["index"])
        if i not in read:
            d["model_not_read"] = True
            continue
        p = (preds or {})[i]
        _answer(d, p, (unknown or {})[i], label or {})
        d["fault_type"] = p["fault_type"] or p.get("fault_type_best") or None
        d["fault_probability"] = None
        if d.get("model_off_distribution"):  # the model's answer is a guess here: the stage's verdict stands
            d["fault_type_guess"] = d["fault_type"]
            d["fault_type"] = None
        else:
            ruled_out(d, same_deployment, "stage_episode_length", *floor, novelty=(novelty or {}).get(i))


# ------------------------------------------------------------------------------------------------
# console summary


def evidence_text(item: dict[str, Any]) -> str:
    """One evidence item as text: ``self_ns 12.3 µs vs 4.1 µs (3.0×, z=+8.2)``."""
    if "note" in item:
        return item["note"]
    f = item["feature"]
    ratio = f"{item['ratio']:.1f}×, " if item.get("ratio") else ""
    return f"{f} {fmt_value(f, item['value'])} vs {fmt_value(f, item['reference'])} ({ratio}z={item['z']:+.1f})"


def suspect_name(sp: dict[str, Any]) -> str:
    """A suspect with its module: ``BE aten::t in FE LlamaMLP`` (the family alone when it is the
    module, or lies in none)."""
    mod = sp.get("module")
    if mod and mod.get("family") and mod["family"] != sp["family"]:
        return f"{sp['family']} in {mod['family']}"
    return sp["family"]


def verdict_line(x: dict[str, Any]) -> str:
    """One flagged step in a line: type, operator (with its module), why (the model's), or the
    numeric evidence."""
    head = f"step {x['step_num']} (rank {x['rank']}, {fmt_ns(x['end_ns'] - x['start_ns'])})"
    sus = x.get("suspects") or []
    ev = f"{suspect_name(sus[0])}: {evidence_text(sus[0]['evidence'][0])}" if sus and sus[0].get("evidence") else ""
    et = x.get("evidence_type")  # the type the numeric evidence points to (teller.localize.faulttype)
    typed = f"{et['fault_type']} fault by the evidence ({et['family']}, {et['feature']})" if et else ""
    if et and et.get("alternative"):  # evidence that cannot rule out another type says so
        typed += f" or {et['alternative']} (it cannot tell them apart)"
    num = " — ".join(p for p in (typed, ev) if p) or x.get("top_family") or ""
    if x.get("model_off_distribution"):  # a verdict either way, typed or normal
        head += (f" [low confidence: {x['model_unknown_share']:.0%} of the step's tree is operators the model "
                 "never saw in training]")
    if x.get("fault_type") and not x.get("model_says_normal"):
        # p: the model's probability of the named type, given a fault; an unsure step says how
        # likely a fault is at all instead (it keeps its flag from SCREEN_FLOOR up)
        p = (f"p_abnormal={x['abnormal_probability']:.2f}, the model is unsure (kept from {SCREEN_FLOOR})" if model_unsure(x)
             else f"p_abnormal={x['abnormal_probability']:.2f}, joined the episode of its neighbours' flags" if x.get("sustained")
             else f"p={x['fault_probability']:.2f}" if x.get("fault_probability") is not None
             else f"p_abnormal={x['abnormal_probability']:.2f}, the type of its episode" if x.get("episode_type")
             else f"p_abnormal={x['abnormal_probability']:.2f}")
        if x.get("fault_type_model"):
            p += (f"; unlike every step the model was trained on (novelty {x['novelty']:.1f}): the type the numeric "
                  f"evidence points to, the model's was {x['fault_type_model']}")
        # the numeric evidence pointing elsewhere is worth a look: said beside the model's answer
        other = (f" [the numeric evidence points to {et['fault_type']}: {et['family']}, {et['feature']}]"
                 if et and et["fault_type"] != x["fault_type"] else "")
        if x.get("explanation"):
            return f"{head}, {p}: {x['explanation']}{other}"
        ops = ", ".join(x.get("evidence_families") or [o["name"] for o in x.get("evidence_operators", [])[:3]]) or "?"
        return f"{head}: {x['fault_type']} fault ({p}) at {ops} — {ev}{other}"
    if x.get("model_not_read"):
        head += " [not read by the model: numeric stage only]"
    if x.get("model_no_detail"):
        head += " [recorded without detail (no aten ops, no GPU activity): numeric stage only]"
    if x.get("unknown_fault"):
        return (f"{head}: fault of a kind the model was not trained on: a sustained departure from the reference "
                f"({x.get('stage_episode_length') or x.get('episode_length')} flagged steps in a row) it does not recognise "
                f"(p_abnormal={x['abnormal_probability']:.2f}); {num}")
    if x.get("model_says_normal"):
        near = (f"; lasting ({x.get('stage_episode_length') or x.get('episode_length')} flagged steps in a row), but like the "
                f"steps it was trained on (novelty {x['novelty']:.2f})") if x.get("near_training") and x.get("novelty") is not None else ""
        return (f"{head}: numeric outlier the model reads as normal (p_abnormal={x['abnormal_probability']:.2f}: "
                f"none of the faults it was trained on{near}; the numeric evidence stands) {num}")
    return f"{head}: {num or 'abnormal'}"


def print_verdicts(diag: dict[str, Any], console: Any, top: int = 10) -> None:
    """The verdict first: one line per flagged step (worst first)."""
    flagged = sorted([x for x in diag["steps"] if x.get("flag")],
                     key=lambda x: (bool(x.get("model_says_normal")), -(x.get("abnormal_probability") or 0), -(x["score"] or 0),
                                    x["start_ns"]))
    if not flagged:
        console.print("[green]no abnormal step[/]")
        return
    m = diag.get("model")
    m = None if m and m.get("skipped") else m
    console.print(f"[bold]verdict[/] ({'root-cause model ' + m['variant'] if m else 'numeric stage only'}): "
                  f"{len(flagged)} flagged step(s)")
    if m and m.get("reads") == "every":
        console.print(f"  {reading_words(diag)}", soft_wrap=True, markup=False, highlight=False)
    elif m and m.get("steps_read", 0) < m.get("steps_eligible", 0):
        console.print(f"  the model read the {m['steps_read']} highest-scored of {m['steps_eligible']} flagged steps "
                      "(`--model-steps N` to read more, 0 for all); the others have the numeric stage's verdict")
    if eps := longest_episodes(diag):
        console.print(f"  {len(diag['episodes'])} episode(s) of flagged steps; the longest: "
                      + ", ".join(map(episode_words, eps)), soft_wrap=True, markup=False, highlight=False)
    for x in flagged[:top]:
        console.print("  " + verdict_line(x), soft_wrap=True, markup=False, highlight=False)
    if len(flagged) > top:
        console.print(f"  … {len(flagged) - top} more in diagnosis.json")


def print_summary(diag: dict[str, Any], console: Any = None, top: int = 10, detail: int = 3) -> None:
    """Readable summary: the worst steps, their suspects and the evidence."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    con = console or Console()
    s = diag["summary"]
    rule = diag["steps_rule"]
    con.print(f"[bold]diagnosis[/] of {diag['run']} against {diag['reference']}")
    con.print(f"steps: {s['steps']} ({rule['rule']}"
              + (f": {rule['detail']}" if rule["rule"] != "STEP ranges" else "") + f"), flagged [bold red]{s['steps_flagged']}[/]; "
              f"instances {s['instances_in_steps']} in steps ({', '.join(diag['instance_layers'])})")
    if s.get("unseen_families"):
        shown = ", ".join(s["unseen_families"][:6]) + (" …" if len(s["unseen_families"]) > 6 else "")
        con.print(f"[yellow]unseen in the reference[/]: {len(s['unseen_families'])} families ({shown})")
    if s.get("warning"):
        con.print(f"[yellow]warning[/]: {s['warning']}")
    for line in (diag.get("health") or {}).get("lines", []):
        con.print(f"[yellow]warning[/]: {escape(line)}", highlight=False, soft_wrap=True)
    print_verdicts(diag, con, top=top)
    steps = [x for x in diag["steps"] if x["score"] is not None]
    worst = sorted(steps, key=lambda x: (-x["score"], x["start_ns"]))[:top]
    if not worst:
        con.print("no step has operator instances to score")
        return
    t = Table(title="worst steps", show_lines=False)
    for col in ("step", "rank", "duration", "score", "flag", "candidates / top family"):
        t.add_column(col)
    for x in worst:
        fams = ", ".join(c["family"] for c in x.get("candidates", [])) or (x["top_family"] or "")
        t.add_row(str(x["step_num"]), str(x["rank"]), fmt_ns(x["end_ns"] - x["start_ns"]), f"{x['score']:.2f}",
                  "[bold red]yes[/]" if x["flag"] else "no", fams)
    con.print(t)
    for x in [w for w in worst if w["flag"]][:detail]:
        con.print(f"[bold]step {x['step_num']}[/] (rank {x['rank']}, node {x['node_id']}, score {x['score']:.2f}):")
        for sp in x.get("suspects", [])[:5]:
            con.print(f"  [red]{suspect_name(sp)}[/] node {sp['node_id']} a={sp['a']:.2f} {fmt_ns(sp['dur_ns'])}")
            for item in sp["evidence"]:
                con.print(f"      {evidence_text(item)}")
        if x.get("slice"):
            con.print(f"  slice: {len(x['slice']['nodes'])} nodes")
