"""Tracing-cost matrix: the workload with no recording, hooks only, hooks + CUPTI, Kineto.

    python benchmarks/overhead.py --out DIR [--reps 3] [--configs none,hooks,cupti,kineto]
        [-- WORKLOAD SERVE ARGS...]

Each configuration runs the real workload (``teller workload serve``) in a fresh process, ``reps``
times, interleaved (none, hooks, cupti, kineto, none, ...) so slow drift of the machine spreads
over all configurations (process CPU time, launcher and children together, is kept too: it includes
the work a recording defers to the end of the run). Throughput and step latency p50/p99 come from the workload's own
``--out-json`` summary (measured after its warm-up request); the recording's own figures (CUPTI
records, decode time, records per step, events written, run size) from the run directory.

Configurations (names are free to combine with ``--configs``):

- ``none``            the workload alone
- ``hooks``           ``teller record --collector cpu``: STEP/FE/BE ranges from the hooks (default
                      BE backend)
- ``hooks_profiler``  hooks, BE ranges from the profiler backend (``--be-backend profiler``)
- ``hooks_dispatch``  hooks, BE ranges from the dispatch backend (``--be-backend dispatch``)
- ``hooks_nobe``      hooks without the aten-level BE ranges (``--be-depth 0``)
- ``cupti``           ``teller record --collector cupti``: hooks + CUPTI activity (default settings)
- ``cupti_profiler``  / ``cupti_dispatch``: CUPTI with the named BE backend
- ``cupti_nobe``      CUPTI with STEP/FE hooks only (``--be-depth 0``)
- ``cupti_nodecode``  CUPTI records taken but not decoded (CUPTI's own cost, for the breakdown)
- ``cupti_nofilter``  CUPTI with the query-API filter off (every runtime/driver call recorded)
- ``cupti_nvtx``      CUPTI with the hooks' ranges sent through NVTX (MARKER records) instead of
                      TELLER's CPU range recorder
- ``kineto``          ``teller record --collector kineto``: hooks + torch.profiler

Writes ``DIR/overhead.json`` (every run and a summary) and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

CONFIGS: dict[str, dict[str, Any]] = {
    "none": {"collector": None, "env": {}},
    "hooks": {"collector": "cpu", "env": {}},
    "hooks_profiler": {"collector": "cpu", "env": {}, "kw": {"be_backend": "profiler"}},
    "hooks_dispatch": {"collector": "cpu", "env": {}, "kw": {"be_backend": "dispatch"}},
    "hooks_nobe": {"collector": "cpu", "env": {}, "kw": {"be_depth": 0}},
    "cupti": {"collector": "cupti", "env": {}},
    "cupti_profiler": {"collector": "cupti", "env": {}, "kw": {"be_backend": "profiler"}},
    "cupti_dispatch": {"collector": "cupti", "env": {}, "kw": {"be_backend": "dispatch"}},
    "cupti_nobe": {"collector": "cupti", "env": {}, "kw": {"be_depth": 0}},
    "cupti_nodecode": {"collector": "cupti", "env": {"TELLER_CUPTI_SKIP_DECODE": "1"}},
    "cupti_nofilter": {"collector": "cupti", "env": {"TELLER_CUPTI_API_FILTER": "0"}},
    "cupti_nvtx": {"collector": "cupti", "env": {"TELLER_CUPTI_RANGES": "nvtx"}},
    "kineto": {"collector": "kineto", "env": {}},
}

DEFAULT_WORKLOAD = ["--device", "cuda", "--preset", "gpu", "--requests", "64", "--rate", "200",
                    "--prompt-len", "uniform:32:128", "--output-len", "32", "--warmup", "2"]


#: output lines worth keeping (TELLER's own messages, profiler/CUPTI complaints)
_NOTABLE = re.compile(r"\[teller\]|ERROR|Error|WARN|unknown buffer|CUPTI|Traceback")

#: ``teller record`` through the launcher's Python API (independent of the ``teller`` entry point)
_RECORD = ("import json, sys; from teller.record.launcher import record; "
           "kw = json.loads(sys.argv[1]); out = kw.pop('out'); "
           "sys.exit(record(out, sys.argv[3:], **kw)['exit_code'])")


def record_cmd(run_dir: Path, collector: str, kw: dict[str, Any], serve: list[str]) -> list[str]:
    """The command that records ``serve`` into ``run_dir`` (like ``teller record -o RUN ... -- SERVE``)."""
    return [sys.executable, "-c", _RECORD, json.dumps({"out": str(run_dir), "collector": collector, **kw}),
            "--", *serve]


def run_one(config: str, rep: int, out: Path, workload: list[str], keep: bool) -> dict[str, Any]:
    """One run of ``config``; ``out`` holds its workload JSON and run directory."""
    spec = CONFIGS[config]
    tag = f"{config}-{rep}"
    wjson = out / f"workload-{tag}.json"
    run_dir = out / "runs" / tag
    serve = [sys.executable, "-m", "teller.workload", "serve", *workload, "--out-json", str(wjson)]
    if spec["collector"] is None:
        cmd = serve
    else:
        cmd = record_cmd(run_dir, spec["collector"], spec.get("kw", {}), serve)
    env = {**os.environ, **spec["env"]}
    t0 = time.perf_counter()
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    wall = time.perf_counter() - t0
    cpu = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
    row: dict[str, Any] = {"config": config, "rep": rep, "exit_code": p.returncode, "process_wall_s": wall,
                           "process_cpu_s": cpu}
    notable = [ln[:300] for ln in p.stdout.splitlines() if _NOTABLE.search(ln)]
    if notable:
        row["notable_lines"] = notable[:20]
    if p.returncode != 0 or not wjson.is_file():
        row["error_tail"] = p.stdout[-2000:]
        return row
    s = json.loads(wjson.read_text())["summary"]
    row.update({k: s.get(k) for k in ("throughput_tok_s", "step_p50_s", "step_p99_s", "steps",
                                      "generated_tokens", "latency_p50_s", "wall_s")})
    if spec["collector"] is not None and run_dir.is_dir():
        row.update(_run_figures(run_dir, s.get("steps") or 0))
        if not keep:
            shutil.rmtree(run_dir, ignore_errors=True)
    return row


def _run_figures(run_dir: Path, steps: int) -> dict[str, Any]:
    """What the recording itself says: events, CUPTI records and decode cost, size on disk."""
    fig: dict[str, Any] = {"run_mb": sum(f.stat().st_size for f in run_dir.rglob("*") if f.is_file()) / 2**20}
    rows = 0
    for pf in sorted((run_dir / "proc").glob("*.json")):
        d = json.loads(pf.read_text())
        rows += (d.get("sink") or {}).get("rows_written", 0)
        cols = d.get("collectors") or {}
        cpu = cols.get("cpu") or {}
        fig["ranges"] = fig.get("ranges", 0) + cpu.get("ranges_emitted", 0)
        fig["range_backend"] = (d.get("collector") or {}).get("range_backend")
        fig["be_backend"] = (d.get("collector") or {}).get("be_backend")
        be = d.get("be") or {}
        if be:
            fig["be_stop_export_s"] = (be.get("stop_s") or 0) + (be.get("export_s") or 0)
            fig["be_cycles"] = be.get("cycles")
            fig["be_errors"] = (be.get("errors") or [])[:3]
            fig["be_cupti"] = be.get("cupti")
        cu = cols.get("cupti")
        if cu:
            fig["cupti_records"] = cu.get("records")
            fig["cupti_decode_s"] = cu.get("decode_s")
            fig["cupti_decode_cpu_s"] = cu.get("decode_cpu_s")
            fig["cupti_decode_cpu_us_per_record"] = cu.get("decode_cpu_us_per_record")
            fig["cupti_callback_s"] = cu.get("callback_s")
            fig["cupti_decode_us_per_record"] = cu.get("decode_us_per_record")
            fig["cupti_dropped"] = cu.get("dropped_records")
            fig["cupti_buffers"] = cu.get("buffers")
            fig["cupti_records_in"] = cu.get("records_in")
            fig["cupti_events_out"] = cu.get("events_out")
            if cu.get("ranges") == "nvtx":
                fig["ranges"] = fig.get("ranges", 0) + (cu.get("events_out") or {}).get("RANGE", 0)
            fig["cupti_errors"] = (cu.get("errors") or [])[:5]
            fig["cupti_kernels"] = (cu.get("events_out") or {}).get("KERNEL")
            fig["cupti_runtime"] = (cu.get("events_out") or {}).get("RUNTIME")
            fig["cupti_lost_buffers"] = cu.get("lost_buffers")
            fig["cupti_unwalked_bytes"] = cu.get("unwalked_bytes")
            fig["cupti_skipped"] = cu.get("skipped_records")
            if steps and cu.get("records"):
                fig["cupti_records_per_step"] = cu["records"] / steps
        ki = cols.get("kineto")
        if ki:
            fig["kineto_events"] = ki.get("events")
            fig["kineto_errors"] = (ki.get("errors") or [])[:5]
    try:
        info = json.loads((run_dir / "run.json").read_text())
        conv = (info.get("extra") or info).get("be_conversion")
        if conv:
            fig["be_ranges"] = conv.get("kept", 0)
            rows += conv.get("kept", 0)
            fig["be_conversion"] = {k: conv.get(k) for k in ("kept", "aten_rows", "outside_steps", "too_deep",
                                                            "windows", "windows_matched", "failed",
                                                            "bracket_len_diff_max_ns", "convert_us")}
    except (OSError, ValueError):
        pass
    fig["event_rows"] = rows
    if steps and fig.get("ranges"):
        fig["ranges_per_step"] = (fig["ranges"] + fig.get("be_ranges", 0)) / steps
    return fig


def summarize(runs: list[dict[str, Any]], configs: list[str]) -> dict[str, Any]:
    base = [r["throughput_tok_s"] for r in runs if r["config"] == "none" and r.get("throughput_tok_s")]
    base_mean = statistics.fmean(base) if base else None
    out: dict[str, Any] = {}
    for c in configs:
        rs = [r for r in runs if r["config"] == c and r.get("throughput_tok_s")]
        if not rs:
            out[c] = {"ok_runs": 0}
            continue
        tput = [r["throughput_tok_s"] for r in rs]
        d: dict[str, Any] = {
            "ok_runs": len(rs),
            "tok_s_mean": statistics.fmean(tput),
            "tok_s_std": statistics.stdev(tput) if len(tput) > 1 else 0.0,
            "step_p50_ms": statistics.median(r["step_p50_s"] * 1e3 for r in rs),
            "step_p99_ms": statistics.median(r["step_p99_s"] * 1e3 for r in rs),
        }
        if base_mean:
            d["tput_loss_pct"] = 100.0 * (1.0 - d["tok_s_mean"] / base_mean)
        if base:
            d["tput_loss_median_pct"] = 100.0 * (1.0 - statistics.median(tput) / statistics.median(base))
        d["tok_s_median"] = statistics.median(tput)
        d["process_wall_s_median"] = statistics.median(r["process_wall_s"] for r in rs)
        if all(r.get("process_cpu_s") is not None for r in rs):
            d["process_cpu_s_median"] = statistics.median(r["process_cpu_s"] for r in rs)
        for k in ("cupti_records_per_step", "cupti_decode_us_per_record", "cupti_decode_cpu_us_per_record",
                  "ranges_per_step", "run_mb", "be_ranges", "be_stop_export_s", "cupti_kernels",
                  "cupti_runtime", "event_rows", "cupti_dropped"):
            vals = [r[k] for r in rs if r.get(k) is not None]
            if vals:
                d[k] = statistics.median(vals)
        dec = [r["cupti_decode_s"] / r["wall_s"] for r in rs if r.get("cupti_decode_s") and r.get("wall_s")]
        if dec:
            d["decode_share_of_wall_pct"] = 100.0 * statistics.median(dec)
        out[c] = d
    return out


def table(summary: dict[str, Any]) -> str:
    lines = ["| configuration | runs | tokens/s median (mean ± sd) | loss vs none (median; mean) | step p50 ms | "
             "step p99 ms | ranges/step | CUPTI records/step | process wall s | process CPU s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for c, d in summary.items():
        if not d.get("ok_runs"):
            lines.append(f"| {c} | 0 | failed | | | | | | | |")
            continue
        loss = (f"{d['tput_loss_median_pct']:.1f}%; {d['tput_loss_pct']:.1f}%"
                if "tput_loss_pct" in d and "tput_loss_median_pct" in d else "")
        rps = f"{d['cupti_records_per_step']:.0f}" if "cupti_records_per_step" in d else ""
        rng = f"{d['ranges_per_step']:.0f}" if "ranges_per_step" in d else ""
        lines.append(f"| {c} | {d['ok_runs']} | {d['tok_s_median']:.0f} ({d['tok_s_mean']:.0f} ± {d['tok_s_std']:.0f}) | "
                     f"{loss} | {d['step_p50_ms']:.2f} | {d['step_p99_ms']:.2f} | {rng} | {rps} | "
                     f"{d['process_wall_s_median']:.1f} | {d.get('process_cpu_s_median', float('nan')):.1f} |")
    return "\n".join(lines)


def main() -> None:
    argv = sys.argv[1:]
    workload = DEFAULT_WORKLOAD
    if "--" in argv:
        i = argv.index("--")
        argv, workload = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--configs", default="none,hooks,cupti,kineto")
    ap.add_argument("--work", help="scratch folder for per-run files (default: OUT)")
    ap.add_argument("--keep-runs", action="store_true", help="keep the run directories")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work) if args.work else out
    work.mkdir(parents=True, exist_ok=True)
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        sys.exit(f"unknown configurations {unknown}; choose from {', '.join(CONFIGS)}")
    runs: list[dict[str, Any]] = []
    res: dict[str, Any] = {"workload": workload, "configs": configs, "reps": args.reps, "runs": runs}
    try:
        import torch

        res["env"] = {"torch": torch.__version__,
                      "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}
    except Exception:
        res["env"] = {}
    for rep in range(args.reps):
        for c in configs:
            r = run_one(c, rep, work, workload, args.keep_runs)
            runs.append(r)
            print(json.dumps({k: r.get(k) for k in ("config", "rep", "exit_code", "throughput_tok_s",
                                                     "step_p50_s", "step_p99_s", "cupti_records_per_step",
                                                     "cupti_decode_us_per_record", "process_wall_s")}),
                  flush=True)
            res["summary"] = summarize(runs, configs)
            (out / "overhead.json").write_text(json.dumps(res, indent=1, default=str))
    print(table(res["summary"]))


if __name__ == "__main__":
    main()
