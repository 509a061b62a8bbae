"""Run methods on a dataset's split and write the results (JSON, markdown, PNG)."""

from __future__ import annotations

import json
import resource
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from teller.baselines import REGISTRY, make
from teller.baselines.base import Method, Prediction
from teller.baselines.features import step_features
from teller.baselines.steps import (
    CATEGORIES,
    PARTS,
    SPLITS,
    VIEWS,
    StepSet,
    load_steps,
    split_masks,
)
from teller.errors import TellerError
from teller.evaluate.scores import (
    PRIORS,
    auprc,
    auroc,
    fault_type_scores,
    low_prior_scores,
    operator_scores,
    step_scores,
)

#: the rows ``teller evaluate`` runs by default, in table order: the shipped model's recipe (``teller_mot_family``,
#: and read over time), the numeric stage on both references, the pipelines on them
#: (``teller_sustained_family`` is what ``teller diagnose`` reports, ``teller_diagnose_family`` what
#: it reports with ``--model-reads flagged``) and the classical baselines
DEFAULT_METHODS = ("teller_mot_family", "teller_mot_family_sustained", "teller_numeric", "teller_numeric_deploy",
                   "teller_episodes_family", "teller_diagnose_family", "teller_sustained_family", "kmeans", "dbscan",
                   "iforest", "gmm", "svm", "svm_names", "rf", "rf_names", "xgb", "xgb_names")


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def score_method(steps: StepSet, test: np.ndarray, pred: Prediction, seed: int = 0) -> dict[str, Any]:
    """Every metric of one method's predictions on the test steps ``test`` (indices)."""
    truth = steps.is_anomaly[test]
    out: dict[str, Any] = {"step": step_scores(truth, pred.flag)}
    out["step"]["auroc"] = auroc(truth, pred.score)
    out["step"]["auprc"] = auprc(truth, pred.score)
    if pred.operators is not None:
        out["operator"] = operator_scores([steps.labels[i] for i in test.tolist()], pred.operators)
    if pred.fault_type is not None:
        ab = truth.astype(bool)
        # fault type given that the step is abnormal: the head's answer on every truly abnormal step
        out["fault_type"] = fault_type_scores(steps.fault_type[test][ab], np.asarray(pred.fault_type)[ab])
    ft = steps.fault_type[test]
    out["recall_per_category"] = {c: float((pred.flag & (ft == c)).sum() / m)
                                  for c in CATEGORIES if (m := int((truth & (ft == c)).sum()))}
    out["low_prior"] = low_prior_scores(truth, pred.flag, pred.score, seed=seed)
    return out


def _progress(total: int, enabled: bool | None = None) -> Any:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    con = Console(stderr=True)
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=con, transient=True, disable=not (con.is_terminal if enabled is None else enabled))


def evaluate_view(ds: str | Path, view: str, splits: Sequence[str], methods: Sequence[str], seed: int = 0,
                  limit_steps: int | None = None, log: Callable[[str], None] = lambda s: None,
                  models: str | Path | None = None, device: str = "cpu",
                  predictions: list[pa.Table] | None = None, reuse: pa.Table | None = None,
                  reuse_from: str = "", part: str = "test", shared: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Load the steps of ``view`` once and run ``methods`` on each split; one result block per split.
    ``models``: a folder of trained root-cause models the ``teller_*`` model rows pick from;
    ``device``: where those rows predict (cpu | cuda); ``predictions``: a list the per-step
    predictions of every row are appended to (:func:`prediction_table`); ``reuse``: such rows from
    an earlier run (``reuse_from`` names its file): a method the table holds for this view and
    split is taken from it, not fitted (:func:`reused_prediction`). ``part``: the part of each
    split scored (test; val to choose a rule's setting before the test part is read: its rows of
    ``predictions.parquet`` name the split ``SPLIT/val``, :func:`split_label`). ``shared``: what
    the views of one evaluation read alike (the root-cause model's dataset, which holds every
    view's units, and the stage's operator instances, :func:`teller.baselines.numeric.shared_unit_instances`),
    kept from one view to the next."""
    from teller.baselines.features import feature_table
    from teller.dataset.codec import read_subtrees

    t0 = time.perf_counter()
    steps = load_steps(ds, view, limit_steps=limit_steps, seed=seed)
    if models is not None:
        steps.extra["rca_models"] = str(models)
    steps.extra["rca_device"] = device
    if shared is not None:  # read once for every view (teller.baselines.rca.step_units)
        steps.extra["rca_datasets"] = shared.setdefault("rca_datasets", {})
    masks: dict[str, Any] = {}
    for s in splits:
        try:
            masks[s] = split_masks(steps, s, part)
        except TellerError as e:
            masks[s] = str(e)
    blocks: list[dict[str, Any]] = []
    usable = [s for s in splits if not isinstance(masks[s], str)]
    for s in splits:
        if isinstance(masks[s], str):
            log(f"{view} / {s}: skipped: {masks[s]}")
    if not usable:
        return [{"split": s, "view": view, "seed": seed, "skipped": masks[s]} for s in splits]
    sub = read_subtrees(ds)
    if any(getattr(REGISTRY[m], "needs_instances", False) for m in methods):  # the stage's instances, CUPTI memory kinds included
        from teller.baselines.numeric import shared_unit_instances

        steps.extra["instances"] = shared_unit_instances(steps, sub, shared)
    sub = feature_table(sub)  # what the step features read: the other columns are freed before their rows are copied
    logs = None
    if (Path(ds) / "logs.parquet").is_file():
        logs = pq.read_table(Path(ds) / "logs.parquet", columns=["run_id", "step_id"])
        logs = logs.filter(pc.greater_equal(logs.column("step_id"), 0))
    steps.features = step_features(steps, sub, logs)
    del sub
    t_load = time.perf_counter() - t0
    log(f"{view}: {steps.n} steps ({int(steps.is_anomaly.sum())} abnormal), features {steps.features.std.shape[1]} "
        f"standard + {len(steps.features.families)} families, loaded in {t_load:.0f} s")
    for s in splits:
        if isinstance(masks[s], str):
            blocks.append({"split": s, "view": view, "seed": seed, "skipped": masks[s]})
            continue
        train, test, desc = masks[s]
        tr, te = np.flatnonzero(train), np.flatnonzero(test)
        steps.extra["split"] = s  # a method trained beforehand (teller_mot) checks it was trained on this split
        rows = []
        with _progress(len(methods)) as bar:
            task = bar.add_task(f"{view}/{s}", total=len(methods))
            for name in methods:
                bar.update(task, description=f"{view}/{s}: {name}")
                m: Method = make(name, seed)
                row: dict[str, Any] = m.describe()
                try:
                    a = time.perf_counter()
                    got = reused_prediction(reuse, steps, te, split_label(s, part), name, reuse_from) if reuse is not None else None
                    if got is None:
                        m.fit(steps, tr)
                    b = time.perf_counter()
                    pred = got if got is not None else m.predict(steps, te)
                    c = time.perf_counter()
                    if got is not None:
                        row["predictions_from"] = reuse_from
                        row["fit_on"] = f"{row.get('fit_on', '')}; answers read from {reuse_from}"
                    steps.extra.setdefault("predictions", {})[(s, name)] = (te, pred)  # the fused row reuses them
                    if predictions is not None:
                        predictions.append(prediction_table(steps, te, pred, split_label(s, part), name))
                    row.update(score_method(steps, te, pred, seed=seed))
                    row["seconds"] = {"fit": round(b - a, 2), "predict": round(c - b, 2)}
                    if got is None:  # what the fit read (a trained model's path, an ensemble's seeds)
                        row.update({k: v for k, v in m.describe().items() if k not in row})
                    for k in ("fitted_steps_", "threshold_", "eps_", "n_clusters_", "reference_"):
                        if hasattr(m, k):
                            v = getattr(m, k)
                            row[k.rstrip("_")] = (v if isinstance(v, str) else float(v) if isinstance(v, (float, np.floating))
                                                  else int(v))
                except ValueError as e:  # a method that cannot fit this train part (e.g. no normal step)
                    row["error"] = str(e)
                rows.append(row)
                log(f"{view}/{s} {name}: " + (f"step F1 {row['step']['f1']:.3f}" if "step" in row else row.get("error", "")))
                bar.advance(task)
        blocks.append({
            "split": s, "part": part, "view": view, "seed": seed, "steps": desc, "train_steps": int(train.sum()),
            "test_steps": int(test.sum()), "test_abnormal": int((test & steps.is_anomaly).sum()),
            "test_prior": float(steps.is_anomaly[test].mean()),
            "test_fault_types": {c: int((test & (steps.fault_type == c)).sum()) for c in CATEGORIES},
            "limit_steps": limit_steps, "methods": rows,
            "features": {"standard": steps.features.std_names, "families": len(steps.features.families),
                         **steps.features.info},
            "load_seconds": round(t_load, 1)})
    return blocks


def split_label(split: str, part: str = "test") -> str:
    """The ``split`` column ``predictions.parquet`` gives rows of ``part``: the split's name for the
    test part, ``SPLIT/val`` for the val part (so one is never reused as the other)."""
    return split if part == "test" else f"{split}/{part}"


def step_keys(steps: StepSet, test: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The key ``predictions.parquet`` gives each step ``test``: its run and its first rank step."""
    first = steps.unit_key[steps.unit_idx[steps.unit_ptr[test]]] & ((1 << 40) - 1)
    return steps.runs[steps.run_code[test]].astype(str), first.astype(np.int64)


def prediction_table(steps: StepSet, test: np.ndarray, pred: Prediction, split: str, method: str) -> pa.Table:
    """One row per test step of what ``method`` said about it, beside the labels: the rows of
    ``predictions.parquet`` (:func:`step_keys`)."""
    n = len(test)
    run, first = step_keys(steps, test)
    ops = pred.operators
    return pa.table({
        "view": pa.array([steps.view] * n, pa.string()), "split": pa.array([split] * n, pa.string()),
        "method": pa.array([method] * n, pa.string()),
        "run_id": pa.array(run, pa.string()),
        "step_id": pa.array(first), "step": pa.array(steps.step_num[test].astype(np.int64)),
        "is_anomaly": pa.array(steps.is_anomaly[test].astype(bool)),
        "true_fault_type": pa.array([str(x) for x in steps.fault_type[test].tolist()], pa.string()),
        "score": pa.array(np.asarray(pred.score, np.float64)), "flag": pa.array(np.asarray(pred.flag, bool)),
        "fault_type": (pa.array([str(x) if x else None for x in np.asarray(pred.fault_type).tolist()], pa.string())
                       if pred.fault_type is not None else pa.nulls(n, pa.string())),
        "operators": pa.array(ops, pa.list_(pa.string())) if ops is not None else pa.nulls(n, pa.list_(pa.string())),
    })


def reused_prediction(table: pa.Table, steps: StepSet, test: np.ndarray, split: str, method: str,
                      source: str = "") -> Prediction | None:
    """``method``'s answers on the test steps ``test`` of ``split`` from a ``predictions.parquet``
    table (None when it holds none for this view, split and method). Its steps must be exactly
    the test steps, else the file was written for another dataset or split rule: an error."""
    t = table.filter(pc.and_(pc.and_(pc.equal(table.column("view"), steps.view), pc.equal(table.column("split"), split)),
                             pc.equal(table.column("method"), method)))
    if t.num_rows == 0:
        return None
    run, first = step_keys(steps, test)
    want = {(r, x): i for i, (r, x) in enumerate(zip(run.tolist(), first.tolist(), strict=True))}
    got = list(zip(t.column("run_id").to_pylist(), t.column("step_id").to_pylist(), strict=True))
    if len(got) != len(want) or len(set(got)) != len(got) or any(k not in want for k in got):
        miss = sum(k not in want for k in got)
        raise TellerError(f"--reuse {source}: {method} on {steps.view}/{split} answers {len(got)} steps, {miss} of them not "
                          f"test steps here, where the split has {len(want)}: the file was written for another dataset or split "
                          "rule; evaluate without --reuse")
    order = np.empty(len(got), np.int64)
    order[[want[k] for k in got]] = np.arange(len(got))
    ft = t.column("fault_type")
    ops = t.column("operators")
    opl = ops.to_pylist()
    return Prediction(
        score=np.asarray(t.column("score").to_numpy(zero_copy_only=False), float)[order],
        flag=np.asarray(t.column("flag").to_numpy(zero_copy_only=False), bool)[order],
        fault_type=None if ft.null_count == t.num_rows else np.asarray([x or "" for x in ft.to_pylist()], dtype=object)[order],
        operators=None if ops.null_count == t.num_rows else [list(opl[j] or []) for j in order.tolist()])


def read_predictions(paths: Sequence[str | Path]) -> pa.Table:
    """The ``predictions.parquet`` files of earlier ``teller evaluate`` runs, as one table (for
    ``--reuse``); a method, split and view in two of them is an error (which to read would be a guess)."""
    need = ["view", "split", "method", "run_id", "step_id", "score", "flag", "fault_type", "operators"]
    tables, seen = [], {}
    for path in paths:
        try:
            t = pq.read_table(path)
        except (OSError, pa.ArrowInvalid) as e:
            raise TellerError(f"--reuse {path}: not a readable predictions.parquet ({e}); pass the file `teller evaluate -o DIR` "
                              "wrote as DIR/predictions.parquet") from None
        if missing := set(need) - set(t.column_names):
            raise TellerError(f"--reuse {path}: no column {', '.join(sorted(missing))}; pass the predictions.parquet of "
                              "`teller evaluate -o DIR`")
        t = t.select(need)
        keys = t.select(["method", "split", "view"]).group_by(["method", "split", "view"]).aggregate([]).to_pylist()
        for k in keys:
            key = (k["method"], k["split"], k["view"])
            if key in seen:
                raise TellerError(f"--reuse: {key[0]} on {key[2]}/{key[1]} is in both {seen[key]} and {path}; pass one of them")
            seen[key] = path
        tables.append(t)
    return pa.concat_tables(tables, promote_options="permissive")


def evaluate(ds: str | Path, splits: Sequence[str], views: Sequence[str], methods: Sequence[str] | None = None,
             seed: int = 0, limit_steps: int | None = None, out: str | Path | None = None, command: str = "",
             log: Callable[[str], None] = lambda s: None, models: str | Path | None = None,
             device: str = "cpu", reuse: str | Path | Sequence[str | Path] | None = None, part: str = "test") -> dict[str, Any]:
    """Run ``methods`` (default :data:`DEFAULT_METHODS`) on every split × view; write the results
    into ``out`` (``results.json``, ``results.md``, PNG plots, and every row's per-step predictions
    in ``predictions.parquet``) when given. ``reuse``: earlier runs' ``predictions.parquet`` (one
    or several), whose rows are taken instead of fitting those methods (e.g. a model's rows scored
    on the GPU beside the other methods here); a method, split and view held by two of them is an
    error."""
    methods = list(methods or DEFAULT_METHODS)
    if models is not None and not Path(models).is_dir():
        raise TellerError(f"--models {models}: not a folder (expected one trained model per sub-folder, `teller rca train -o DIR/NAME`)")
    bad = [m for m in methods if m not in REGISTRY]
    if bad:
        raise TellerError(f"--methods: unknown {', '.join(bad)}; known: {', '.join(REGISTRY)}")
    for s in splits:
        if s not in SPLITS:
            raise TellerError(f"--split {s!r}: expected one of {', '.join(SPLITS)}")
    for v in views:
        if v not in VIEWS:
            raise TellerError(f"--view {v!r}: expected one of {', '.join(VIEWS)}")
    if part not in PARTS:
        raise TellerError(f"--part {part!r}: expected one of {', '.join(PARTS)}")
    reuse = [] if reuse is None else [reuse] if isinstance(reuse, (str, Path)) else list(reuse)
    rt = read_predictions(reuse) if reuse else None
    w0 = time.perf_counter()
    blocks: list[dict[str, Any]] = []
    preds: list[pa.Table] = []
    shared: dict[str, Any] = {}
    for i, v in enumerate(views):
        shared["last"] = i == len(views) - 1  # what the views share is let go in the last one
        blocks += evaluate_view(ds, v, splits, methods, seed=seed, limit_steps=limit_steps, log=log, models=models, device=device,
                                predictions=preds, reuse=rt, reuse_from=", ".join(str(r) for r in reuse), part=part,
                                shared=shared)
    done = [b for b in blocks if "skipped" not in b]
    if not done:
        raise TellerError("nothing to evaluate: " + "; ".join(f"{b['view']}/{b['split']}: {b['skipped']}" for b in blocks))
    res = {"dataset": str(ds), "command": command, "seed": seed, "part": part, "limit_steps": limit_steps,
           "reference": "docs/design.md §11; step and operator metrics of teller.evaluate.metrics (benchmarks/eval_localize_h200.py)",
           "priors": list(PRIORS), "results": blocks, "models": str(models) if models is not None else None,
           "model_device": device, "reused": [str(r) for r in reuse] or None,
           "seconds": round(time.perf_counter() - w0, 1), "peak_rss_mib": round(_peak_mib())}
    if out is not None:
        write_results(res, out)
        if preds:
            pq.write_table(pa.concat_tables(preds), Path(out) / "predictions.parquet", compression="zstd")
    return res


# ------------------------------------------------------------------------------------------------
# output


def _f(x: Any, nd: int = 3) -> str:
    if x is None or (isinstance(x, float) and not np.isfinite(x)):
        return "–"
    return f"{x:.{nd}f}"


def main_table(block: dict[str, Any], command: str = "") -> str:
    """The markdown table of one split × view: one row per method, one column per metric."""
    hdr = ("| method | kind | features | fit on | step acc | step P | step R | step F1 | AUROC | AUPRC | op F1 (all) "
           "| op Macro₊ P | op Macro₊ R | op Macro₊ F1 | op Macro₊ J | fault acc | fault macro-R | fault macro-F1 | fit s |")
    part = block.get("part", "test")
    lines = [f"**split `{block['split']}`" + (f" ({part} part)" if part != "test" else "") + f", view `{block['view']}`, "
             f"seed {block['seed']}**: {block['steps']}, {part} prior {block['test_prior']:.2f}" + (f"; sample of {block['limit_steps']} steps" if block.get("limit_steps") else "")
             + (f". Reproduce: `{command}`" if command else ""), "", hdr, "|" + "---|" * 4 + "---:|" * 15]
    for r in block["methods"]:
        if "error" in r:
            lines.append(f"| {_name(r)} | {r['kind']} | {r['features']} | {r['fit_on']} | " + " | ".join(["–"] * 14)
                         + f" | ({r['error']}) |")
            continue
        s, o, ft = r["step"], r.get("operator"), r.get("fault_type")
        cells = [_f(s["accuracy"]), _f(s["precision"]), _f(s["recall"]), _f(s["f1"]), _f(s["auroc"]), _f(s["auprc"])]
        cells += ([_f(o["f1"]), _f(o["macro_plus_precision"]), _f(o["macro_plus_recall"]), _f(o["macro_plus_f1"]),
                   _f(o["macro_plus_jaccard"])] if o else ["n/a"] * 5)
        cells += [_f(ft["accuracy"]), _f(ft["macro_recall"]), _f(ft["macro_f1"])] if ft else ["n/a"] * 3
        cells.append(f"{r['seconds']['fit']:.1f}")
        lines.append(f"| {_name(r)} | {r['kind']} | {r['features']} | {r['fit_on']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def low_prior_table(block: dict[str, Any]) -> str:
    """Recall, F1, AUPRC, AUROC at each prior (mean ± std over the repeats)."""
    priors = [k for k in next((r["low_prior"] for r in block["methods"] if "low_prior" in r), {})]
    hdr = "| method | " + " | ".join(f"{float(p):.0%}: {m}" for p in priors for m in ("R", "F1", "AUPRC", "AUROC")) + " |"
    lines = [f"**low priors, split `{block['split']}`, view `{block['view']}`, seed {block['seed']}** "
             "(all normal test steps, abnormal ones downsampled; 50 repeats, mean ± std)", "", hdr,
             "|---|" + "---:|" * (4 * len(priors))]
    for r in block["methods"]:
        if "low_prior" not in r:
            continue
        cells = []
        for p in priors:
            d = r["low_prior"][p]
            if "note" in d:
                cells += ["–"] * 4
                continue
            cells += [f"{d[f'{m}_mean']:.3f} ± {d[f'{m}_std']:.3f}" for m in ("recall", "f1", "auprc", "auroc")]
        lines.append(f"| {_name(r)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _name(row: dict[str, Any]) -> str:
    """A row's label with its method's id (what ``--methods`` and the plots name it)."""
    return f"{row['label']} (`{row['method']}`)" if row.get("method") else row["label"]


def _plots(block: dict[str, Any], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in block["methods"] if "step" in r]
    tag = f"{block['split']}_{block['view']}"
    files = []
    labels = [r.get("method") or r["label"] for r in rows]  # the tables give each id's label
    x = np.arange(len(rows))
    series = {"step F1": [r["step"]["f1"] for r in rows],
              "op Macro₊ F1": [r["operator"]["macro_plus_f1"] if r.get("operator") else np.nan for r in rows],
              "fault macro-F1": [r["fault_type"]["macro_f1"] if r.get("fault_type") else np.nan for r in rows]}
    fig, ax = plt.subplots(figsize=(max(6, 0.8 * len(rows) + 2), 4))
    w = 0.27
    for k, (name, vals) in enumerate(series.items()):
        ax.bar(x + (k - 1) * w, np.nan_to_num(vals, nan=0.0), w, label=name)
    ax.set_xticks(x, labels, rotation=35, ha="right", fontsize=8)
    ax.set_ylim(0, 1)
    ax.set_title(f"split {block['split']}, view {block['view']}, seed {block['seed']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    p = out / f"f1_{tag}.png"
    fig.savefig(p, dpi=110, bbox_inches="tight")
    plt.close(fig)
    files.append(p.name)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    colors = plt.get_cmap("tab20").colors
    dark = ("black", "tab:blue", "tab:red", "tab:green", "tab:purple", "tab:brown")  # TELLER's rows: thick, each its own
    marks, nt = ("o", "s", "^", "D", "v", "P"), 0
    for i, r in enumerate(rows):
        if r["kind"] == "teller":
            style = {"color": dark[nt % len(dark)], "linewidth": 2.5, "marker": marks[nt % len(marks)],
                     "linestyle": ("-", "--")[nt // len(dark) % 2]}
            nt += 1
        else:
            style = {"color": colors[i % len(colors)], "linewidth": 1.0, "marker": ".", "alpha": 0.8}
        lp = r["low_prior"]
        ps = [block["test_prior"]] + [float(k) for k in lp if "note" not in lp[k]]
        for ax, m in zip(axes, ("f1", "auprc"), strict=True):
            full = r["step"][m]
            mean = [full] + [lp[k][f"{m}_mean"] for k in lp if "note" not in lp[k]]
            sd = [0.0] + [lp[k][f"{m}_std"] for k in lp if "note" not in lp[k]]
            ax.errorbar(ps, mean, yerr=sd, capsize=3, label=labels[i], **style)
    ticks = sorted({round(block["test_prior"], 2), *(float(k) for k in PRIORS)})
    for ax, m in zip(axes, ("step F1", "AUPRC"), strict=True):
        ax.set_xscale("log")
        ax.set_xticks(ticks, [f"{t:.0%}" for t in ticks])
        ax.minorticks_off()
        ax.set_xlabel("fault prior")
        ax.set_ylabel(m)
        ax.set_ylim(0, 1)
    axes[1].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.02, 0.5), ncol=1 + len(rows) // 16)
    fig.suptitle(f"low priors: split {block['split']}, view {block['view']} (50 repeats, ± std)")
    fig.tight_layout()
    p = out / f"low_prior_{tag}.png"
    fig.savefig(p, dpi=110, bbox_inches="tight")
    plt.close(fig)
    files.append(p.name)
    return files


def write_results(res: dict[str, Any], out: str | Path) -> None:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    md = [f"# teller evaluate: {res['dataset']}", "", f"Command: `{res['command']}`", "",
          f"Seed {res['seed']}; {res['seconds']} s; peak RSS {res['peak_rss_mib']} MiB.", ""]
    for b in res["results"]:
        if "skipped" in b:
            md += [f"**split `{b['split']}`, view `{b['view']}`**: not evaluated: {b['skipped']}", ""]
            continue
        b["plots"] = _plots(b, out)
        md += [main_table(b, res["command"]), "", low_prior_table(b), ""]
        md += [f"![{p}]({p})" for p in b["plots"]] + [""]
    (out / "results.md").write_text("\n".join(md))
    with open(out / "results.json", "w") as fh:
        json.dump(res, fh, indent=1, default=lambda o: o.item() if hasattr(o, "item") else str(o))
