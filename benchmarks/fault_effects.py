"""Effect sizes of the fault mechanisms (docs/faults.md): step latency with vs. without.

    python benchmarks/fault_effects.py [SPEC] [-o RUNS]

Runs the campaign (default campaigns/cpu_mechanisms.toml; on the GPU pass
campaigns/h200_main.toml), then prints one Markdown row per applied window: steps in the
window, step p50 and p99 outside → inside (ms), and the families that grew most. Whole-run
mechanisms (kv_cache_pressure) are compared with the campaign's fault-free run "normal-r0".
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    from teller.inject.campaign import run_campaign
    from teller.inject.effects import window_effects

    ap = argparse.ArgumentParser()
    ap.add_argument("spec", nargs="?", default=str(ROOT / "campaigns" / "cpu_mechanisms.toml"))
    ap.add_argument("-o", "--out", default=None)
    a = ap.parse_args(argv)
    out = Path(a.out or tempfile.mkdtemp(prefix="fault_effects_"))
    s = run_campaign(a.spec, out, force=True)
    normal = next((Path(r["path"]) for r in s["results"] if r["run_id"].startswith("normal")
                   and r["status"] == "finished"), None)
    print("| mechanism | implementation | magnitude | steps in window | step p50 without → with (ms) "
          "| step p99 without → with (ms) | affected layer (largest growth) |")
    print("|---|---|---|---|---|---|---|")
    for r in s["results"]:
        if r["status"] != "finished":
            continue
        for e in window_effects(r["path"]):
            if e["mechanism"] == "kv_cache_pressure" and normal is not None:
                (e,) = [x for x in window_effects(r["path"], normal) if x["window"] == e["window"]]
            print(f"| {e['mechanism']} | {e['implementation']} | {e['magnitude']:g} | {e['in_n']} | "
                  f"{e['out_p50_ms']:.2f} → {e['in_p50_ms']:.2f} | {e['out_p99_ms']:.2f} → {e['in_p99_ms']:.2f} | "
                  f"{'; '.join(e['affected_layers']) or '-'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
