"""Tables and the TPE trade-off plot of the root-cause models trained side by side on the H200
(``scripts/gpu/rca_matrix.py``), from the results committed under ``benchmarks/results``:

    python benchmarks/rca_matrix_report.py --plot docs/evaluate_v2/tpe_tradeoff.png

prints, as markdown: the modality ablations and the prompt-style baseline per split (test part of
that split, ``all`` / vertical / horizontal units), the TPE vocabulary sweep (per-step length
reduction of the test steps against step F1, operator Macro₊ F1 and fault-type macro-F1, per
seed and their mean), the unit of the model (the STEP subtree against the whole engine iteration,
at 256 and 512 trace tokens), and the `teller evaluate` rows of the models beside the best
baseline of ``benchmarks/results/evaluate_h200_v2.json``; writes the trade-off plot (PNG).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"

INPUT_ROWS = (("trace+log (MoT)", "mot_{s}"), ("w/o log: trace only (MoT)", "mot_trace_{s}"),
              ("w/o trace: log only (MoT)", "mot_log_{s}"), ("prompt-style: step summary + log (single-stream)", "prompt_{s}"))
VOCABS = (0, 256, 512, 1024, 2048, 4096, 8192)


def jobs_by_seed(matrix: dict) -> dict[int, dict[str, dict]]:
    """``{seed: {job: result}}`` over the calls whose jobs ran their epochs (call 1's MoT jobs were
    re-planned: left out; its single-stream jobs ran theirs)."""
    out: dict[int, dict[str, dict]] = {}
    for c in matrix["calls"]:
        seed = int(c["protocol"]["seed"])
        for name, j in c["jobs"].items():
            if c["call"] == 1 and j["job"]["variant"] == "mot":
                continue
            if "test" in j:
                out.setdefault(seed, {})[name] = j
    return out


def _name(job: str, split: str) -> str:
    """Job names of the request split carry no suffix (``mot_request`` aside)."""
    if split == "request":
        return {"mot_{s}": "mot_request"}.get(job, job.replace("_{s}", ""))
    return job.format(s=split)


def metrics(j: dict, view: str) -> tuple[float, float, float]:
    m = j["test"].get(view)
    if not m:
        return (float("nan"),) * 3
    return m["step"]["f1"], m["fault_type"]["macro_f1"], m["operator"]["macro_plus_f1"]


def _f(x: float) -> str:
    return "–" if x != x else f"{x:.3f}"


def ablation_table(by_seed: dict[int, dict[str, dict]]) -> str:
    lines = ["| split | inputs | seed | test units (abnormal) | step F1 all / vert / horiz | fault-type macro-F1 all / vert / horiz "
             "| op Macro₊ F1 all / vert / horiz |", "|---|---|---:|---:|---|---|---|"]
    for split in ("request", "run", "mechanism", "workload"):
        for label, job in INPUT_ROWS:
            name = _name(job, split)
            for seed in sorted(by_seed):
                j = by_seed[seed].get(name)
                if j is None:
                    continue
                a = j["test"]["all"]
                cells = [metrics(j, v) for v in ("all", "vertical", "horizontal")]
                lines.append(f"| {split} | {label} | {seed} | {a['units']:,} ({a['step']['abnormal']}) | "
                             + " | ".join(" / ".join(_f(c[k]) for c in cells) for k in range(3)) + " |")
    return "\n".join(lines)


def tpe_rows(by_seed: dict[int, dict[str, dict]]) -> list[dict]:
    rows = []
    for v in VOCABS:
        name = "mot_request" if v == 512 else f"tpe{v}"
        for seed in sorted(by_seed):
            j = by_seed[seed].get(name)
            if j is None:
                continue
            r = {"vocab": v, "seed": seed, **j["tpe"]}
            for view in ("all", "vertical", "horizontal"):
                r[view] = metrics(j, view)
            rows.append(r)
    return rows


def tpe_table(rows: list[dict]) -> str:
    lines = ["| TPE vocabulary (asked / fitted) | seed | nodes per test step | tokens per step (before the 256-token cut) "
             "| length reduction per step | steps cut at 256 | step F1 vert / horiz | fault-type macro-F1 vert / horiz "
             "| op Macro₊ F1 vert / horiz |", "|---|---:|---:|---:|---:|---:|---|---|---|"]
    for r in rows:
        v, h = r["vertical"], r["horizontal"]
        lines.append(f"| {r['vocab']} / {r['trace_vocab']} | {r['seed']} | {r['nodes_per_step']:.0f} | {r['tokens_per_step']:.0f} | "
                     f"{100 * r['length_reduction']:.1f}% | {100 * r['truncated_share']:.1f}% | {_f(v[0])} / {_f(h[0])} | "
                     f"{_f(v[1])} / {_f(h[1])} | {_f(v[2])} / {_f(h[2])} |")
    return "\n".join(lines)


UNIT_ROWS = (("STEP subtree, 256 tokens", "mot_{s}"), ("engine iteration, 256 tokens", "it_{s}"),
             ("engine iteration, 512 tokens", "it512_{s}"))


def _index(res: dict) -> dict[tuple[str, str, str], dict]:
    """A `teller evaluate` results JSON's rows by (split, view, method), error rows left out."""
    return {(b["split"], b["view"], r["method"]): r for b in res["results"] for r in b.get("methods", []) if "error" not in r}


def _trio(r: dict | None) -> str:
    """Step F1 / op Macro₊ F1 / fault-type macro-F1 of a row ("–" without one)."""
    if r is None:
        return "–"
    return f"{r['step']['f1']:.3f} / {r['operator']['macro_plus_f1']:.3f} / {r['fault_type']['macro_f1']:.3f}"


def unit_table(by_seed: dict[int, dict[str, dict]]) -> str:
    """What a unit's trace holds (``RCAConfig.unit``) and how many of its tokens are read, per
    split, on the split's test part (seed 0)."""
    lines = ["| split | unit, trace tokens read | tokens per unit (before the cut) | units cut | step F1 all / vert / horiz "
             "| fault-type macro-F1 all / vert / horiz | op Macro₊ F1 all / vert / horiz |",
             "|---|---|---:|---:|---|---|---|"]
    jobs = by_seed.get(0, {})
    for split in ("request", "run", "mechanism", "workload"):
        for label, job in UNIT_ROWS:
            j = jobs.get("mot_request" if job == "mot_{s}" and split == "request" else job.format(s=split))
            if j is None:
                continue
            t = j.get("tpe") or {}
            cells = [metrics(j, v) for v in ("all", "vertical", "horizontal")]
            lines.append(f"| {split} | {label} | {t.get('tokens_per_step', float('nan')):.0f} | "
                         f"{100 * t.get('truncated_share', float('nan')):.1f}% | "
                         + " | ".join(" / ".join(_f(c[k]) for c in cells) for k in range(3)) + " |")
    return "\n".join(lines)


def unit_evaluate_table(step: dict, iteration: dict, baselines: dict) -> str:
    """``teller evaluate`` rows of the MoT models of both units, beside the best baseline on each
    metric (cells: step F1 / op Macro₊ F1 / fault-type macro-F1)."""
    st, it, base = _index(step), _index(iteration), _index(baselines)
    counts = {(b["split"], b["view"]): (b["test_steps"], b["test_abnormal"]) for b in iteration["results"] if "methods" in b}

    lines = ["| split, view | test steps (abnormal) | MoT, engine iteration | MoT, STEP subtree | best baseline step F1 "
             "| best baseline op Macro₊ | best baseline fault macro-F1 |", "|---|---:|---|---|---|---|---|"]
    for view in ("vertical", "horizontal"):
        for split in ("request", "run", "mechanism", "workload"):
            others = [r for k, r in base.items() if k[:2] == (split, view) and not k[2].startswith("teller")]
            cells = []
            for get in (lambda r: r["step"]["f1"], lambda r: (r.get("operator") or {}).get("macro_plus_f1"),
                        lambda r: (r.get("fault_type") or {}).get("macro_f1")):
                rows = [r for r in others if get(r) is not None]
                b = max(rows, key=get) if rows else None
                cells.append(f"{get(b):.3f} ({b['label']})" if b else "–")
            n, a = counts.get((split, view), (0, 0))
            lines.append(f"| {split}, {view} | {n:,} ({a}) | {_trio(it.get((split, view, 'teller_mot')))} | "
                         f"{_trio(st.get((split, view, 'teller_mot')))} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    """Scores against the TPE vocabulary (categorical axis; each tick also gives the per-step
    length reduction and the fitted vocabulary), vertical and horizontal, seeds as dots."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = sorted({r["vocab"] for r in rows})
    pos = {v: k for k, v in enumerate(xs)}
    ticks = []
    for v in xs:
        rr = [r for r in rows if r["vocab"] == v]
        ticks.append(f"{v}\n(fit {rr[0]['trace_vocab']})\n-{100 * np.mean([r['length_reduction'] for r in rr]):.1f}%")
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6), sharey=True)
    names = ("step F1", "fault-type macro-F1", "operator Macro₊ F1")
    for ax, view in zip(axes, ("vertical", "horizontal"), strict=True):
        for k, (nm, mk) in enumerate(zip(names, ("o", "s", "^"), strict=True)):
            mean = [np.nanmean([r[view][k] for r in rows if r["vocab"] == v]) for v in xs]
            line, = ax.plot(range(len(xs)), mean, marker=mk, label=f"{nm} (mean of seeds)")
            ax.scatter([pos[r["vocab"]] for r in rows], [r[view][k] for r in rows], s=14, color=line.get_color(), alpha=0.45)
        ax.set_xticks(range(len(xs)), ticks, fontsize=7)
        ax.set_title(f"{view} test units, request split", fontsize=10)
        ax.set_xlabel("TPE vocabulary asked (fitted) and per-step length reduction")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("score")
    axes[0].legend(fontsize=8, loc="lower right")
    fig.suptitle("TPE compression against accuracy: MoT model on data/h200_v2, seeds 0 and 1 (dots), 8 epochs, "
                 "at most 256 trace tokens read per step", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)


def evaluate_table(ev: dict, baselines: dict) -> str:
    def rows_of(res: dict) -> dict[tuple[str, str], list[dict]]:
        out: dict[tuple[str, str], list[dict]] = {}
        for b in res["results"]:
            if "methods" in b:
                out[(b["split"], b["view"])] = [r for r in b["methods"] if "error" not in r]
        return out

    mot, single, base = rows_of(ev["mot"]), rows_of(ev["single"]), rows_of(baselines)
    lines = ["| split, view | test steps (abnormal) | TELLER MoT step F1 / op Macro₊ / fault macro-F1 | TELLER single-stream | "
             "best baseline step F1 | best baseline op Macro₊ | best baseline fault macro-F1 |", "|---|---:|---|---|---|---|---|"]
    counts = {(b["split"], b["view"]): (b["test_steps"], b["test_abnormal"]) for b in ev["mot"]["results"] if "methods" in b}

    for view in ("vertical", "horizontal"):
        for split in ("request", "run", "mechanism", "workload"):
            key = (split, view)
            m = next((r for r in mot.get(key, []) if r["method"] == "teller_mot"), None)
            s = next((r for r in single.get(key, []) if r["method"] == "teller_single"), None)
            others = [r for r in base.get(key, []) if not r["method"].startswith("teller")]

            def best(get, rows=others):
                rows = [r for r in rows if get(r) is not None]
                r = max(rows, key=get)
                return f"{get(r):.3f} ({r['label']})"

            def op(r):
                return (r.get("operator") or {}).get("macro_plus_f1")

            def ft(r):
                return (r.get("fault_type") or {}).get("macro_f1")

            n, a = counts.get(key, (0, 0))
            lines.append(f"| {split}, {view} | {n:,} ({a}) | {_trio(m)} | {_trio(s)} | "
                         f"{best(lambda r: r['step']['f1'])} | {best(op)} | {best(ft)} |")
    return "\n".join(lines)


def low_prior_table(ev: dict, baselines: dict) -> str:
    """F1 and AUPRC at 10% and 5% fault priors (test steps downsampled, 50 repeats) of the model
    rows, beside the best baseline's F1 at that prior."""
    lines = ["| split, view | TELLER MoT F1 at 10% / 5% | MoT AUPRC at 10% | single-stream F1 at 10% / 5% | "
             "best baseline F1 at 10% |", "|---|---|---|---|---|"]

    mot, single, base = _index(ev["mot"]), _index(ev["single"]), _index(baselines)

    def lp(r: dict | None, prior: str, key: str = "f1") -> str:
        x = (r or {}).get("low_prior", {}).get(prior)
        return "–" if not x else f"{x[key + '_mean']:.3f} ± {x[key + '_std']:.3f}"

    for view in ("vertical", "horizontal"):
        for split in ("request", "run", "mechanism", "workload"):
            m, sg = mot.get((split, view, "teller_mot")), single.get((split, view, "teller_single"))
            others = [(k[2], r) for k, r in base.items() if k[0] == split and k[1] == view and not k[2].startswith("teller")
                      and r.get("low_prior", {}).get("0.1")]
            bname, br = max(others, key=lambda t: t[1]["low_prior"]["0.1"]["f1_mean"]) if others else ("", None)
            lines.append(f"| {split}, {view} | {lp(m, '0.1')} / {lp(m, '0.05')} | {lp(m, '0.1', 'auprc')} | "
                         f"{lp(sg, '0.1')} / {lp(sg, '0.05')} | {lp(br, '0.1')} ({br['label'] if br else ''}) |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--matrix", type=Path, default=RESULTS / "rca_matrix_h200_v2.json")
    ap.add_argument("--evaluate", type=Path, default=RESULTS / "evaluate_rca_h200_v2.json")
    ap.add_argument("--evaluate-iteration", type=Path, default=RESULTS / "evaluate_rca_iteration_h200_v2.json")
    ap.add_argument("--baselines", type=Path, default=RESULTS / "evaluate_h200_v2.json")
    ap.add_argument("--plot", type=Path, default=None)
    a = ap.parse_args()
    by_seed = jobs_by_seed(json.loads(a.matrix.read_text()))
    print("## Inputs: modality ablations and the prompt-style baseline\n")
    print(ablation_table(by_seed))
    rows = tpe_rows(by_seed)
    print("\n## TPE vocabulary sweep (request split, MoT)\n")
    print(tpe_table(rows))
    print("\n## The unit: STEP subtree or engine iteration (MoT, seed 0)\n")
    print(unit_table(by_seed))
    print("\n## teller evaluate rows of the MoT models of both units\n")
    print(unit_evaluate_table(json.loads(a.evaluate.read_text())["mot"], json.loads(a.evaluate_iteration.read_text()),
                              json.loads(a.baselines.read_text())))
    print("\n## teller evaluate rows of the models\n")
    print(evaluate_table(json.loads(a.evaluate.read_text()), json.loads(a.baselines.read_text())))
    print("\n## Low priors\n")
    print(low_prior_table(json.loads(a.evaluate.read_text()), json.loads(a.baselines.read_text())))
    if a.plot:
        plot(rows, a.plot)
        print(f"\nwrote {a.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
