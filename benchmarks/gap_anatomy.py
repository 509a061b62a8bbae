"""What the errors of the row `teller diagnose` reports (``teller_sustained_family``) are made of,
and rules against them, measured and not adopted.

    python benchmarks/gap_anatomy.py DATASET OUT --split mechanism --seed 0 [--view vertical,horizontal] \\
        [--reuse PREDICTIONS.parquet ...] [--models DIR] [--part test|val]
    python benchmarks/gap_anatomy.py --from-steps OUT    # anatomy.json again from OUT/steps.parquet

Runs `teller evaluate` on one split with the model row (``teller_mot_family``), the model read
over time (``teller_mot_family_sustained``), the deployment stage (``teller_numeric_deploy``) and
the row itself, instrumented: for every step of the test runs it keeps where each part stood
(the model's probability and flag, the over-time reading's flag, the stage's flag and the length
of its episode, the step's novelty) and what the row answered. Writes OUT/results.json (the
evaluation, as `teller evaluate` writes it), OUT/steps.parquet (those per-step columns, test
steps and the other steps of their runs) and OUT/anatomy.json:

- ``composition``: the test steps' normal ones inside a fault window (the injection ran, the
  labelling rule measured no effect: docs/faults.md) and outside every window;
- ``errors``: the row's false positives by the part that flagged them (the model, the over-time
  reading, a lasting departure of the stage) and by where they lie (in a window without effect;
  within :data:`NEAR` steps of a labelled abnormal step of the same rank; elsewhere), and its
  false negatives by whether the stage flagged them;
- ``horizontal_from_ranks``: the row's horizontal answers with a joined step also flagged where
  the row flags one of its ranks' steps in the vertical view (what `teller diagnose`, which reads
  each rank's steps, would show for it), over the horizontal test steps whose every rank step is
  a vertical test step (the others: ``uncovered``);
- ``rules``: step F1, F1 at a 10% prior (the evaluation's draws) and fault-type macro-F1 of the
  row as it is (its lasting departures before the novelty gate) and with its lasting departures
  kept only where (``novel``) the step's novelty is above 1 (:mod:`teller.rca.novelty`), or
  (``lasting_novelty``) above :data:`teller.rca.LASTING_NOVELTY` (the gate the row applies, as
  `teller diagnose` does), or (``effect``) one of :data:`EFFECT_MEASURES` (the engine
  iteration's length, the STEP, GPU-busy and collective time, the time of the families the stage
  names) exceeds the 99th percentile of the same measure over the rank's steps outside the
  stage's episodes (warm-up out): the labelling rule's test of an effect, with the stage's
  episodes in place of the fault windows the tool cannot know; its variants in
  :data:`EFFECT_VARIANTS`.

``--part val`` scores the split's val steps instead (`teller evaluate --part val`): a rule's
setting chosen there is chosen before the test part is read; the ``test`` column and the
``composition`` then describe the val steps. docs/results.md ("What the remaining gaps are made
of") reports it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from teller.baselines import REGISTRY, register
from teller.baselines.base import Prediction
from teller.baselines.numeric import warm_steps
from teller.baselines.rca import TellerSustained, step_units
from teller.evaluate.run import evaluate
from teller.evaluate.scores import fault_type_scores, low_prior_scores, step_scores
from teller.rca import LASTING_NOVELTY

#: a false positive this close (step numbers, same rank) to a labelled abnormal step lies at a window's edge
NEAR = 3
#: the step-feature columns the effect rule reads beside the engine iteration's length and the time of
#: the families the stage names (the labelling rule's measures: step, GPU, collective and targeted time)
EFFECT_COLUMNS = ("wall_ns", "gpu_busy_ns", "comm_ns")
#: every measure the effect rule reads
EFFECT_MEASURES = ("iteration_ns", *EFFECT_COLUMNS, "stage_families_ns")
ROW = "teller_gap_anatomy"
_KEPT: list[dict[str, Any]] = []


class AnatomyRow(TellerSustained):
    """``teller_sustained_family`` with its parts' standing kept for every step of the test runs,
    its lasting departures taken before the novelty gate (:data:`teller.rca.LASTING_NOVELTY`): the
    gate, the rule the row applies, is scored among the rules (``lasting_novelty``), and
    ``benchmarks/lasting_novelty.py`` chose its cut from these columns."""

    label = f"{TellerSustained.label} (instrumented: benchmarks/gap_anatomy.py)"
    lasting_novelty = None

    def predict(self, steps: Any, idx: np.ndarray) -> Prediction:
        from teller.baselines.numeric import deployments, step_lanes
        from teller.localize.episodes import episode_lengths
        from teller.localize.features import ITER_FEATURES
        from teller.rca.context import dataset_unit_iterations

        pred = super().predict(steps, idx)
        idx = np.asarray(idx)
        st = self.parts_[self.stage]
        every = np.flatnonzero(np.isin(steps.run_code, np.unique(steps.run_code[idx])))
        whole = self.stage_whole_  # the stage's answers the row read for the same steps
        warm = warm_steps(steps)[every]
        lane = step_lanes(steps)[every]
        _, length = episode_lengths(lane, steps.step_num[every], whole.flag & ~warm)
        ds, uidx = step_units(steps, every)
        ratio = self.step_novelty_  # the novelty the row computed for the same steps
        pos = np.searchsorted(every, idx)
        test = np.zeros(len(every), bool)
        test[pos] = True

        def at_test(x: Any, fill: Any, dtype: Any) -> np.ndarray:
            out = np.full(len(every), fill, dtype=dtype)
            out[pos] = np.asarray(x, dtype=dtype)
            return out

        model = self.answers_[self.mot]  # the model read over time
        raw = steps.extra["predictions"][(steps.extra["split"], "teller_mot_family")][1]
        names = steps.features.std_names
        eff = np.column_stack([steps.features.std[every, names.index(c)] for c in EFFECT_COLUMNS])
        it = _iteration_ns(steps, every)
        sops = whole.operators or [[]] * len(every)
        iters = dataset_unit_iterations(ds)[uidx]
        inside = whole.flag & (length >= getattr(self, "episode_used_", self.min_episode)) & ~warm
        row_flag = at_test(pred.flag, False, bool)
        row_ops: list[list[str]] = [[] for _ in range(len(every))]
        for p, o in zip(pos.tolist(), pred.operators or [[]] * len(pos), strict=True):
            row_ops[p] = list(o)
        row_fams = _families_ns(steps, every, row_ops, lane, row_flag, warm, reference=~row_flag & ~whole.flag, quantiles=(0.99, 0.95))
        _KEPT.append({
            "view": np.full(len(every), steps.view, dtype=object), "split": np.full(len(every), steps.extra["split"], dtype=object),
            "run": np.asarray(steps.runs, dtype=object)[steps.run_code[every]], "step": steps.step_num[every], "lane": lane,
            "test": test, "warmup": warm, "abnormal": steps.is_anomaly[every].astype(bool), "in_window": steps.in_window[every].astype(bool),
            "true_type": np.asarray(steps.fault_type[every], dtype=object),
            "model_p": at_test(model.score, np.nan, float), "model_flag": at_test(raw.flag, False, bool),
            "sustained_flag": at_test(model.flag, False, bool), "model_type": at_test(model.fault_type, "", object),
            "stage_flag": np.asarray(whole.flag, bool), "stage_type": np.asarray(whole.fault_type, dtype=object),
            "episode": length, "own_reference": np.isin(deployments(steps)[every], np.asarray(list(st.models_), np.int64)),
            "novelty": ratio, "flag": at_test(pred.flag, False, bool), "score": at_test(pred.score, np.nan, float),
            "fault_type": at_test(pred.fault_type, "", object),
            "stage_families": np.asarray(["\x1f".join(o) for o in sops], dtype=object),
            "effect.iteration_ns": it, **{f"effect.{c}": eff[:, k] for k, c in enumerate(EFFECT_COLUMNS)},
            "effect.stage_families_ns": _families_ns(steps, every, sops, lane, inside, warm)[0],
            "effect.row_families_ns": row_fams[0], "effect.row_families_ns_p95": row_fams[1],
            "effect.admit_delay_ns": iters[:, ITER_FEATURES.index("iter.admit_delay")],
            "effect.preempted": iters[:, ITER_FEATURES.index("batch.preempted")]})
        return pred


if ROW not in REGISTRY:  # the module loaded again in one process (tests) keeps the first registration
    register(ROW)(AnatomyRow)


def _iteration_ns(steps: Any, every: np.ndarray) -> np.ndarray:
    """Per step: its engine iteration's length (``iterations.parquet``: schedule, STEP, post and the
    untraced gap before it; the labelling rule's step duration), NaN where the dataset has none."""
    from teller.localize.context import keys_of

    path = Path(steps.dataset) / "iterations.parquet"
    out = np.full(len(every), np.nan)
    if not path.is_file():
        return out
    it = pq.read_table(path, columns=["run_id", "step_id", "dur_ns"])
    pos = keys_of(steps.runs, it.column("run_id").to_numpy(zero_copy_only=False).astype(str), it.column("step_id").to_numpy(),
                  steps.unit_key)
    unit = np.full(len(steps.unit_key), np.nan)
    unit[pos[pos >= 0]] = it.column("dur_ns").to_numpy(zero_copy_only=False).astype(np.float64)[pos >= 0]
    key = steps.run_code[every].astype(np.int64) << 40 | steps.step_id[every].astype(np.int64)  # the step's first rank step
    at = np.clip(np.searchsorted(steps.unit_key, key), 0, max(len(steps.unit_key) - 1, 0))
    hit = steps.unit_key[at] == key if len(steps.unit_key) else np.zeros(len(every), bool)
    out[hit] = unit[at[hit]]
    return out


def _lane_groups(lane: np.ndarray) -> list[np.ndarray]:
    """The rows of each lane (:func:`teller.baselines.numeric.step_lanes`: one code per run and rank,
    or per run horizontally), in row order within a lane."""
    order = np.argsort(lane, kind="stable")
    cut = np.flatnonzero(np.diff(lane[order])) + 1
    return np.split(order, cut) if len(order) else []


def _families_ns(steps: Any, every: np.ndarray, ops: list[list[str]], lane: np.ndarray, inside: np.ndarray,
                 warm: np.ndarray, reference: np.ndarray | None = None, quantiles: tuple[float, ...] = (0.99,)) -> list[np.ndarray]:
    """Per step of ``inside`` (the stage's flags in a lasting episode, or a row's flags): the summed
    time of the families ``ops`` names for it over each of ``quantiles`` of the same sum on its
    lane's ``reference`` steps (default: those outside ``inside``; warm-up out; the labelling
    rule's targeted-time test with the families named); NaN elsewhere or with fewer than 20 such
    steps. One array per quantile."""
    fam = {f: k for k, f in enumerate(steps.features.families)}
    dur = steps.features.fam_dur[every].tocsr()
    refmask = (~inside if reference is None else reference) & ~warm
    out = [np.full(len(every), np.nan) for _ in quantiles]
    for m in _lane_groups(lane):
        ref = m[refmask[m]]
        if len(ref) < 20:
            continue
        sub = dur[ref]
        for i in m[inside[m]]:
            cols = [fam[f] for f in ops[i] if f in fam]
            if cols:
                tot = np.asarray(sub[:, cols].sum(axis=1)).ravel()
                own = float(dur[i][:, cols].sum())
                for k, q in enumerate(quantiles):
                    out[k][i] = own / max(float(np.quantile(tot, q)), 1e-9)
    return out


def _near_abnormal(t: dict[str, np.ndarray]) -> np.ndarray:
    """Per step: whether a labelled abnormal step of the same lane lies within :data:`NEAR` step numbers."""
    out = np.zeros(len(t["step"]), bool)
    for m in _lane_groups(t["lane"]):
        ab = np.sort(t["step"][m][t["abnormal"][m]])
        if len(ab):
            s = t["step"][m]
            j = np.searchsorted(ab, s)
            left = np.abs(s - ab[np.clip(j - 1, 0, len(ab) - 1)])
            right = np.abs(ab[np.clip(j, 0, len(ab) - 1)] - s)
            out[m] = np.minimum(left, right) <= NEAR
    return out


def _effect(t: dict[str, np.ndarray], q: float = 0.99, reference: str = "outside_episodes",
            measures: tuple[str, ...] = EFFECT_MEASURES) -> np.ndarray:
    """Per step: one of ``measures`` above the ``q`` quantile of the same measure over its lane's
    reference steps (warm-up out; a lane with fewer than 20: True, nothing to test against).
    ``reference``: the steps outside the stage's lasting episodes (``outside_episodes``) or every
    step the stage does not flag (``unflagged``). ``stage_families_ns`` is kept as the ratio to its
    own 99th percentile (:func:`_families_ns`)."""
    inside = t["stage_flag"] & (t["episode"] >= TellerSustained.min_episode) & ~t["warmup"]
    refmask = (~inside if reference == "outside_episodes" else ~t["stage_flag"]) & ~t["warmup"]
    return _lane_effect(t, refmask, q, measures)


def _lane_effect(t: dict[str, np.ndarray], refmask: np.ndarray, q: float, measures: tuple[str, ...],
                 row_families: str = "effect.row_families_ns") -> np.ndarray:
    """Per step: whether one of ``measures`` shows an effect, lane by lane against the lane's
    ``refmask`` steps (fewer than 20: True): a measured time above their ``q`` quantile; the
    families' time (``stage_families_ns``, ``row_families_ns``: column ``row_families``) as a ratio
    over 1; any preemption."""
    out = np.ones(len(t["lane"]), bool)
    for m in _lane_groups(t["lane"]):
        ref = m[refmask[m]]
        if len(ref) < 20:
            continue
        hit = np.zeros(len(m), bool)
        for c in measures:
            if c in ("stage_families_ns", "row_families_ns"):
                hit |= t["effect.stage_families_ns" if c == "stage_families_ns" else row_families][m] > 1.0
            elif c == "preempted":
                hit |= t["effect.preempted"][m] > 0
            else:
                x = t[f"effect.{c}"]
                r = x[ref][np.isfinite(x[ref])]
                if len(r):
                    hit |= x[m] > np.quantile(r, q)
        out[m] = hit
    return out


#: the measures the effect test on every flag of the row reads (:func:`_effect_flags`): the lasting
#: departures' ones, the admission delay of the requests the step serves first (the labelling
#: rule's admission evidence) and the time of the families the row names
FLAG_EFFECT_MEASURES = ("iteration_ns", *EFFECT_COLUMNS, "admit_delay_ns", "preempted", "stage_families_ns", "row_families_ns")


def _effect_flags(t: dict[str, np.ndarray], q: float = 0.99, measures: tuple[str, ...] = FLAG_EFFECT_MEASURES) -> np.ndarray:
    """Per step: whether it shows an effect the way the labelling rule looks for one, for every flag
    of the row (not only its lasting departures): one of ``measures`` above the ``q`` quantile of
    the same measure over its lane's steps that neither the row nor the stage flags (warm-up out;
    a lane with fewer than 20: True), any preemption, or the families the stage (in a lasting
    episode) or the row names above the quantile of their summed time (ratio over 1; the row's at
    0.99 or 0.95 as ``q``)."""
    refmask = ~t["flag"] & ~t["stage_flag"] & ~t["warmup"]
    return _lane_effect(t, refmask, q, measures, "effect.row_families_ns" if q >= 0.99 else "effect.row_families_ns_p95")


#: the effect test on every flag of the row: name -> (quantile, whether the lasting departures are tested too)
FLAG_EFFECT_VARIANTS = {
    "flags_effect": (0.99, True),
    "flags_effect_p95": (0.95, True),
    "model_flags_effect": (0.99, False),
    "model_flags_effect_p95": (0.95, False),
}


#: the effect rule's variants measured beside it: name -> (quantile, reference, measures)
EFFECT_VARIANTS = {
    "effect": (0.99, "outside_episodes", EFFECT_MEASURES),
    "effect_reference_unflagged": (0.99, "unflagged", EFFECT_MEASURES),
    "effect_p95": (0.95, "outside_episodes", EFFECT_MEASURES),
    "effect_without_families": (0.99, "outside_episodes", tuple(c for c in EFFECT_MEASURES if c != "stage_families_ns")),
    "effect_iteration_only": (0.99, "outside_episodes", ("iteration_ns",)),
}


def _scores(truth: np.ndarray, flag: np.ndarray, score: np.ndarray, ftype: np.ndarray, ttype: np.ndarray, seed: int) -> dict[str, Any]:
    s = step_scores(truth, flag)
    lp = low_prior_scores(truth, flag, score, seed=seed)
    ab = truth.astype(bool)
    return {"step_f1": float(s["f1"]), "tp": int(s["tp"]), "fp": int(s["fp"]), "fn": int(s["fn"]),
            "prior_0.1_f1": float(lp["0.1"]["f1_mean"]), "fault_type_macro_f1": float(fault_type_scores(ttype[ab], ftype[ab])["macro_f1"])}


def novelty_gate(t: dict[str, np.ndarray], cut: float) -> np.ndarray:
    """The row's flags with its lasting departures kept only where the step's novelty is above
    ``cut`` (the others dropped)."""
    kept = t["flag"] & ~t["sustained_flag"]
    return t["flag"] & ~(kept & ~(t["novelty"] > cut))


def rule_scores(t: dict[str, np.ndarray], flag: np.ndarray, seed: int) -> dict[str, Any]:
    """A rule's answers ``flag`` (a subset of the row's) scored on the block's test steps: a step
    the rule drops takes the model's answer again (its type and probability); with the faults and
    normal steps dropped."""
    te = t["test"]
    dropped = t["flag"] & ~flag
    ft = np.where(dropped, t["model_type"], t["fault_type"]).astype(str)
    sc = np.where(dropped, t["model_p"], t["score"])
    r = _scores(t["abnormal"][te], flag[te], sc[te], ft[te], t["true_type"][te].astype(str), seed)
    r.update({"dropped_abnormal": int((te & dropped & t["abnormal"]).sum()),
              "dropped_normal": int((te & dropped & ~t["abnormal"]).sum())})
    return r


def anatomy(t: dict[str, np.ndarray], seed: int) -> dict[str, Any]:
    """The anatomy of one view's block (the columns :class:`AnatomyRow` keeps)."""
    te = t["test"]
    ab, norm = t["abnormal"], ~t["abnormal"]
    kept = t["flag"] & ~t["sustained_flag"]  # the lasting departures the row kept
    joined = t["sustained_flag"] & ~t["model_flag"]
    near = _near_abnormal(t)
    fp = te & t["flag"] & norm
    fn = te & ~t["flag"] & ab

    def where(m: np.ndarray) -> dict[str, int]:
        return {"in_window_no_effect": int((m & t["in_window"]).sum()),
                f"outside_windows_within_{NEAR}_steps_of_a_fault": int((m & ~t["in_window"] & near).sum()),
                "outside_windows_elsewhere": int((m & ~t["in_window"] & ~near).sum())}

    out: dict[str, Any] = {
        "composition": {"test_steps": int(te.sum()), "abnormal": int((te & ab).sum()),
                        "normal_in_window_no_effect": int((te & norm & t["in_window"]).sum()),
                        "normal_outside_windows": int((te & norm & ~t["in_window"]).sum())},
        "errors": {"false_positives": {"total": int(fp.sum()), "by_model": where(fp & t["model_flag"]),
                                       "by_over_time_reading": where(fp & joined), "by_lasting_departure": where(fp & kept)},
                   "false_negatives": {"total": int(fn.sum()), "stage_flagged": int((fn & t["stage_flag"]).sum()),
                                       "stage_flagged_in_5plus_episode": int((fn & t["stage_flag"] & (t["episode"] >= 5)).sum())},
                   "lasting_departures_kept": {"abnormal": int((te & kept & ab).sum()), "normal": int((te & kept & norm).sum())}},
    }
    rules = {"as_is": t["flag"], "novel": novelty_gate(t, 1.0), "lasting_novelty": novelty_gate(t, LASTING_NOVELTY)}
    for name, (q, ref, ms) in EFFECT_VARIANTS.items():
        rules[name] = t["flag"] & ~(kept & ~_effect(t, q, ref, ms))
    if "effect.row_families_ns" in t:  # steps kept by a run of this script since the effect test on every flag
        for name, (q, lasting) in FLAG_EFFECT_VARIANTS.items():
            tested = t["flag"] if lasting else t["flag"] & ~kept
            rules[name] = t["flag"] & ~(tested & ~_effect_flags(t, q))
    out["rules"] = {name: rule_scores(t, flag, seed) for name, flag in rules.items()}
    return out


def horizontal_from_ranks(out: str | Path, seed: int) -> dict[str, Any] | None:
    """The row's horizontal answers or'ed with its vertical answers on the same run and step
    number (OUT/predictions.parquet), on the horizontal test steps all of whose rank steps are
    vertical test steps (module docstring); None without both views."""
    path = Path(out) / "predictions.parquet"
    if not path.is_file():
        return None
    t = pq.read_table(path, columns=["view", "method", "run_id", "step", "is_anomaly", "score", "flag"])
    t = t.filter(pc.equal(t.column("method"), ROW)).to_pydict()
    vert: dict[tuple[str, int], list[tuple[bool, float]]] = {}
    hor: list[tuple[str, int, bool, float, bool]] = []
    for v, r, s, a, sc, f in zip(t["view"], t["run_id"], t["step"], t["is_anomaly"], t["score"], t["flag"], strict=True):
        if v == "vertical":
            vert.setdefault((r, int(s)), []).append((bool(f), float(sc)))
        else:
            hor.append((r, int(s), bool(a), float(sc), bool(f)))
    if not vert or not hor:
        return None
    ranks = _rank_counts(out, {(r, s) for r, s, *_ in hor})
    keep = [h for h in hor if len(vert.get((h[0], h[1]), [])) == ranks.get((h[0], h[1]), -1)]
    truth = np.asarray([h[2] for h in keep], bool)
    own = np.asarray([h[4] for h in keep], bool)
    own_score = np.asarray([h[3] for h in keep], float)
    anyv = np.asarray([any(f for f, _ in vert[(h[0], h[1])]) for h in keep], bool)
    vscore = np.asarray([max(sc for _, sc in vert[(h[0], h[1])]) for h in keep], float)
    out_d: dict[str, Any] = {"covered": len(keep), "uncovered": len(hor) - len(keep)}
    for name, flag, score in (("as_is", own, own_score), ("or_ranks", own | anyv, np.maximum(own_score, vscore))):
        st = step_scores(truth, flag)
        lp = low_prior_scores(truth, flag, score, seed=seed)
        out_d[name] = {"step_f1": float(st["f1"]), "tp": int(st["tp"]), "fp": int(st["fp"]), "fn": int(st["fn"]),
                       "prior_0.1_f1": float(lp["0.1"]["f1_mean"])}
    return out_d


def _rank_counts(out: str | Path, keys: set[tuple[str, int]]) -> dict[tuple[str, int], int]:
    """Per (run, step number) of ``keys``: how many rank steps the vertical view holds there
    (OUT/steps.parquet: every step of the test runs)."""
    t = pq.read_table(Path(out) / "steps.parquet", columns=["view", "run", "step"]).to_pydict()
    n: dict[tuple[str, int], int] = {}
    for v, r, s in zip(t["view"], t["run"], t["step"], strict=True):
        if v == "vertical" and (r, int(s)) in keys:
            n[(r, int(s))] = n.get((r, int(s)), 0) + 1
    return n


def read_steps(out: str | Path) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The per-step columns a run of this script kept (OUT/steps.parquet) and its evaluation's
    OUT/results.json (empty where absent)."""
    if not (Path(out) / "steps.parquet").is_file():
        raise SystemExit(f"{Path(out) / 'steps.parquet'}: not found; run this script on the dataset with OUT {out} first")
    ev = json.loads((Path(out) / "results.json").read_text()) if (Path(out) / "results.json").is_file() else {}
    t = pq.read_table(Path(out) / "steps.parquet")
    cols = {c: t.column(c).to_numpy(zero_copy_only=False) for c in t.column_names}
    for c in ("view", "split", "run", "true_type", "model_type", "stage_type", "fault_type", "stage_families"):
        cols[c] = cols[c].astype(object)
    return cols, ev


def from_steps(out: str | Path, seed: int | None = None, command: str | None = None) -> dict[str, Any]:
    """anatomy.json from the per-step columns a run of this script kept (OUT/steps.parquet); the
    seed (of the low-prior draws) and the command are those of its OUT/results.json unless given."""
    cols, ev = read_steps(out)
    seed = int(ev.get("seed", 0)) if seed is None else seed
    command = ev.get("command", "") if command is None else command
    res: dict[str, Any] = {"command": command, "split": str(cols["split"][0]) if len(cols["split"]) else "", "seed": seed,
                           "part": ev.get("part", "test"),
                           "near": NEAR, "effect_measures": list(EFFECT_MEASURES), "views": {}}
    for v in dict.fromkeys(cols["view"].tolist()):
        m = cols["view"] == v
        res["views"][str(v)] = anatomy({k: x[m] for k, x in cols.items()}, seed)
    res["horizontal_from_ranks"] = horizontal_from_ranks(out, seed)
    (Path(out) / "anatomy.json").write_text(json.dumps(res, indent=1))
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dataset", nargs="?")
    ap.add_argument("out", nargs="?")
    ap.add_argument("--from-steps", default=None, metavar="OUT")
    ap.add_argument("--split", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--view", default="vertical,horizontal")
    ap.add_argument("--reuse", action="append", default=[])
    ap.add_argument("--models", default=None)
    ap.add_argument("--part", default="test", choices=["test", "val"])
    a = ap.parse_args()
    if a.from_steps:
        print(json.dumps(from_steps(a.from_steps), indent=1))
        return
    if not (a.dataset and a.out and a.split):
        ap.error("DATASET, OUT and --split are needed (or --from-steps OUT)")
    assert ROW in REGISTRY
    methods = ["teller_mot_family", "teller_mot_family_sustained", "teller_numeric_deploy", ROW]
    cmd = " ".join(["python benchmarks/gap_anatomy.py", a.dataset, a.out, "--split", a.split, "--seed", str(a.seed), "--view", a.view,
                    *(f"--reuse {r}" for r in a.reuse), *([f"--models {a.models}"] if a.models else []),
                    *([f"--part {a.part}"] if a.part != "test" else [])])
    evaluate(a.dataset, [a.split], a.view.split(","), methods, seed=a.seed, out=a.out, reuse=a.reuse or None,
             models=a.models, command=cmd, log=lambda s: print(s, flush=True), part=a.part)
    tables = [pa.table({k: (v.astype(str) if v.dtype == object else v) for k, v in blk.items()}) for blk in _KEPT]
    pq.write_table(pa.concat_tables(tables), Path(a.out) / "steps.parquet")
    print(json.dumps(from_steps(a.out, a.seed, cmd), indent=1))


if __name__ == "__main__":
    main()
