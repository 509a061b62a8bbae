"""One `teller evaluate` table per split × view from several runs of it on the same dataset, seed
and test steps (the baselines on the CPU, the root-cause models on the GPU where they were
trained), every row marked with the run it comes from:

    python benchmarks/evaluate_merge.py -o docs/evaluate_v2 --json benchmarks/results/evaluate_all_h200_v2.json \\
        benchmarks/results/evaluate_h200_v2.json \\
        benchmarks/results/evaluate_numeric_h200_v2.json \\
        'benchmarks/results/evaluate_rca_h200_v2.json#mot' \\
        'benchmarks/results/evaluate_rca_h200_v2.json#single=teller_single' \\
        benchmarks/results/evaluate_rca_ablations_h200_v2.json

A source is ``PATH[#KEY][=METHOD,...]``: the results JSON (``KEY``: the entry of a file holding
several), and optionally the methods taken from it; ``OLD:NEW`` takes the rows of method ``OLD``
as method ``NEW`` (a model row measured before its method was renamed). Later sources add rows,
and replace the row of a method an earlier source has (an error row included). Every row's
label, kind and features are those of its method in the current code. Blocks must agree on their split,
view, seed and test steps (checked). Writes ``results.md`` and the plots into ``-o`` with
`teller evaluate`'s own writer, and the merged JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def read_source(spec: str) -> tuple[dict, dict[str, str] | None, str]:
    """The results, ``{method in the file: method in the merge}`` (None: every method as it is)
    and the spec."""
    path, _, methods = spec.partition("=")
    path, _, key = path.partition("#")
    res = json.loads(Path(path).read_text())
    if key:
        res = res[key]
    names = dict((m.partition(":")[0], m.partition(":")[2] or m.partition(":")[0]) for m in methods.split(",") if m)
    return res, names or None, spec


def _current(row: dict) -> dict:
    """The row with its method's label, kind and features as the current code describes them."""
    from teller.baselines import REGISTRY, make

    if row["method"] not in REGISTRY:
        return row
    m = make(row["method"])  # a factory of some methods, so an instance
    return {**row, "label": m.label, "kind": m.kind, "features": m.features}


def merge(sources: list[tuple[dict, dict[str, str] | None, str]]) -> dict:
    blocks: dict[tuple[str, str], dict] = {}
    order: list[tuple[str, str]] = []
    listed = []
    for n, (res, methods, spec) in enumerate(sources, 1):
        listed.append({"source": n, "spec": spec, "command": res.get("command", ""), "seconds": res.get("seconds"),
                       "models": res.get("models"), "model_device": res.get("model_device", "cpu")})
        for b in res["results"]:
            key = (b["split"], b["view"])
            if "skipped" in b:
                if key not in blocks:
                    blocks[key] = dict(b)
                    order.append(key)
                continue
            if key not in blocks or "skipped" in blocks[key]:
                if key not in order:
                    order.append(key)
                blocks[key] = {**b, "methods": []}
            base = blocks[key]
            for k in ("seed", "test_steps", "test_abnormal"):
                if base.get(k) != b.get(k):
                    raise SystemExit(f"{spec}: split {key[0]}, view {key[1]}: {k} {b.get(k)} differs from {base.get(k)}")
            for r in b["methods"]:
                if methods is not None and r["method"] not in methods:
                    continue
                r = _current({**r, "method": methods[r["method"]] if methods else r["method"], "source": n,
                              "fit_on": f"{r['fit_on']} [source {n}]"})
                at = [k for k, x in enumerate(base["methods"]) if x["method"] == r["method"]]
                if at:  # replaced in place
                    base["methods"][at[0]] = r
                else:
                    base["methods"].append(r)
    rank = {"teller": 0, "prompt": 1}
    for b in blocks.values():  # TELLER's rows first, then the prompt-style one, then the baselines as listed
        if "methods" in b:
            b["methods"].sort(key=lambda r: rank.get(r.get("kind"), 2))
    first = sources[0][0]
    return {"dataset": first["dataset"], "seed": first["seed"], "limit_steps": first.get("limit_steps"),
            "reference": first.get("reference"), "priors": first.get("priors"), "sources": listed,
            "command": "several runs of teller evaluate, one per source (listed at the top)",
            "results": [blocks[k] for k in order], "seconds": sum(s["seconds"] or 0 for s in listed),
            "peak_rss_mib": max(src[0].get("peak_rss_mib", 0) for src in sources)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sources", nargs="+")
    ap.add_argument("-o", "--out", type=Path, required=True, help="folder for results.md and the plots")
    ap.add_argument("--json", type=Path, required=True, help="the merged results JSON")
    a = ap.parse_args()
    from teller.evaluate.run import write_results

    res = merge([read_source(s) for s in a.sources])
    write_results(res, a.out)
    md = (a.out / "results.md").read_text()
    head = ["", "Sources (a row's `fit on` cell ends with its source number):", ""]
    head += [f"{s['source']}. `{s['spec']}`: `{s['command']}`" + (f" (model rows on {s['model_device']})"
                                                                   if s["model_device"] != "cpu" else "")
             for s in res["sources"]]
    lines = [("Seed {}; run times and peak memory: each source's results JSON.".format(res["seed"]) if x.startswith("Seed ") else x)
             for x in md.split("\n")]
    (a.out / "results.md").write_text("\n".join(lines[:3] + head + lines[3:]))
    a.json.write_text((a.out / "results.json").read_text())
    (a.out / "results.json").unlink()
    print(f"{sum(len(b.get('methods', [])) for b in res['results'])} rows in {len(res['results'])} blocks → {a.out}/results.md, {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
