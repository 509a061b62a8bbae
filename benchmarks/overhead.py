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
- ``cupti_deferred``  CUPTI with ``--cupti-decode deferred`` (buffers decoded when the process stops)
- ``cupti_lean``      deferred decoding + ``--be-backend profiler`` with ``TELLER_BE_PERIOD_S=86400``
                      (the profiler session stops once, at exit: no stall while serving)
- ``cupti_lean_nobe`` deferred decoding, ``--be-depth 0``
- ``cupti_full``      CUPTI with every step in detail (``--detail-every 1``; the default before
                      step sampling)
- ``cupti_nodetail``  CUPTI detached after the first detail window and never attached again (the
                      floor of step sampling: STEP/FE/OTHER ranges on every step)
- ``cupti_notear``    the default windows, CUPTI's activity kinds only disabled between them
- ``cupti_nodetail_nonvtx``: ``cupti_nodetail`` without ``NVTX_INJECTION64_PATH`` (no NVTX call
                      of the engine's libraries goes through libcupti)
- ``cupti_nodetail_lazy``: ``cupti_nodetail`` with CUPTI first touched at the first window, after
                      the engine made its CUDA context (``TELLER_CUPTI_ATTACH=first-window``)
- ``hooks_full``      hooks with every step in detail

Long mode (``--long``, issue 16 §2): rounds of every configuration (order rotated per round),
each run appended to a JSONL file as it ends, a deadline that starts no run (or round) it cannot
finish, a warm-up run per call, GPU clocks and the CPU cores of the engine's and TELLER's threads
per run, and paired losses against ``none`` with 95% t-intervals; see :func:`long_main`.

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
    # CUPTI buffers copied in the callback, decoded when the process stops
    "cupti_deferred": {"collector": "cupti", "env": {}, "kw": {"cupti_decode": "deferred"}},
    # the cheapest setting found that keeps BE ranges: deferred decoding + the profiler BE backend
    # with a period longer than the run, so its session stops once, at exit (a bounded recording;
    # with the default 10 s period every period's stop stalls a step for ~1 s, docs/overhead.md)
    "cupti_lean": {"collector": "cupti", "env": {"TELLER_BE_PERIOD_S": "86400"},
                   "kw": {"cupti_decode": "deferred", "be_backend": "profiler"}},
    # deferred decoding without BE ranges (STEP/FE only): the floor of the CUPTI configurations
    "cupti_lean_nobe": {"collector": "cupti", "env": {}, "kw": {"cupti_decode": "deferred", "be_depth": 0}},
    # step sampling (``--detail-every K``): BE ranges and CUPTI activity on one step in K
    "cupti_full": {"collector": "cupti", "env": {}, "kw": {"detail_every": 1}},
    "cupti_nodetail": {"collector": "cupti", "env": {}, "kw": {"detail_every": 10**9, "detail_window": 8}},
    "cupti_notear": {"collector": "cupti", "env": {"TELLER_CUPTI_TEARDOWN": "0"}},
    "cupti_nodetail_nonvtx": {"collector": "cupti", "env": {"TELLER_NVTX_INJECTION": "0"},
                              "kw": {"detail_every": 10**9, "detail_window": 8}},
    "cupti_nodetail_lazy": {"collector": "cupti", "env": {"TELLER_CUPTI_ATTACH": "first-window"},
                            "kw": {"detail_every": 10**9, "detail_window": 8}},
    # the default sampling with CUPTI first touched at the first window (after the engine's context)
    "cupti_lazy": {"collector": "cupti", "env": {"TELLER_CUPTI_ATTACH": "first-window"}},
    "hooks_full": {"collector": "cpu", "env": {}, "kw": {"detail_every": 1}},
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


#: the workload's summary figures every run row takes
SUMMARY_KEYS = ("throughput_tok_s", "step_p50_s", "step_p99_s", "steps", "generated_tokens", "latency_p50_s", "wall_s")


def run_command(config: str, out: Path, tag: str, workload: list[str]) -> tuple[list[str], dict[str, str], Path, Path]:
    """One run of ``config`` named ``tag``: its command (the workload alone, or recorded), its
    environment, and where its workload JSON and run directory go under ``out``."""
    spec = CONFIGS[config]
    wjson = out / f"workload-{tag}.json"
    run_dir = out / "runs" / tag
    serve = [sys.executable, "-m", "teller.workload", "serve", *workload, "--out-json", str(wjson)]
    cmd = serve if spec["collector"] is None else record_cmd(run_dir, spec["collector"], spec.get("kw", {}), serve)
    return cmd, {**os.environ, **spec["env"]}, wjson, run_dir


def _notable(text: str) -> list[str]:
    return [ln[:300] for ln in text.splitlines() if _NOTABLE.search(ln)][:20]


def run_one(config: str, rep: int, out: Path, workload: list[str], keep: bool) -> dict[str, Any]:
    """One run of ``config``; ``out`` holds its workload JSON and run directory."""
    spec = CONFIGS[config]
    cmd, env, wjson, run_dir = run_command(config, out, f"{config}-{rep}", workload)
    t0 = time.perf_counter()
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    wall = time.perf_counter() - t0
    cpu = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
    row: dict[str, Any] = {"config": config, "rep": rep, "exit_code": p.returncode, "process_wall_s": wall,
                           "process_cpu_s": cpu}
    notable = _notable(p.stdout)
    if notable:
        row["notable_lines"] = notable
    if p.returncode != 0 or not wjson.is_file():
        row["error_tail"] = p.stdout[-2000:]
        return row
    s = json.loads(wjson.read_text())["summary"]
    row.update({k: s.get(k) for k in SUMMARY_KEYS})
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


# ---------------------------------------------------------------------------------------------
# long mode: interleaved rounds under a deadline, results appended run by run (issue 16 §2)

#: two-sided 95% Student t quantiles by degrees of freedom (larger df: interpolated towards 1.96)
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262,
         10: 2.228, 11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110,
         18: 2.101, 19: 2.093, 20: 2.086, 21: 2.080, 22: 2.074, 23: 2.069, 24: 2.064, 25: 2.060,
         26: 2.056, 27: 2.052, 28: 2.048, 29: 2.045, 30: 2.042, 40: 2.021, 60: 2.000, 120: 1.980}


def t975(df: int) -> float:
    """The 97.5% quantile of Student's t with ``df`` degrees of freedom."""
    if df < 1:
        raise ValueError("t quantile needs df >= 1")
    if df in _T975:
        return _T975[df]
    keys = sorted(_T975)
    if df > keys[-1]:
        return 1.960 + (_T975[120] - 1.960) * 120 / df
    lo = max(k for k in keys if k < df)
    hi = min(k for k in keys if k > df)
    return _T975[lo] + (_T975[hi] - _T975[lo]) * (df - lo) / (hi - lo)


def t_interval(values: list[float]) -> dict[str, Any]:
    """Mean, sd and the 95% t-interval of the mean (``half`` its half-width) of ``values``."""
    n = len(values)
    if n == 0:
        return {"n": 0}
    mean = statistics.fmean(values)
    if n == 1:
        return {"n": 1, "mean": mean}
    sd = statistics.stdev(values)
    half = t975(n - 1) * sd / n ** 0.5
    return {"n": n, "mean": mean, "sd": sd, "half": half, "lo": mean - half, "hi": mean + half}


def paired(rows: list[dict[str, Any]], config: str, key: str, sign: int) -> dict[str, Any]:
    """Paired change of ``key`` against ``none`` in the same round, in percent.

    ``sign`` +1: loss = 100·(1 − cfg/none) (throughput); −1: growth = 100·(cfg/none − 1)
    (step time). Rounds where either run failed are left out.
    """
    base = {r["round"]: r[key] for r in rows if r["config"] == "none" and r.get(key)}
    vals = []
    for r in rows:
        if r["config"] == config and r.get(key) and r["round"] in base:
            ratio = r[key] / base[r["round"]]
            vals.append(100.0 * ((1.0 - ratio) if sign > 0 else (ratio - 1.0)))
    return t_interval(vals)


def ok_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in rows if not r.get("warmup") and r.get("exit_code") == 0 and r.get("throughput_tok_s")]


def summarize_long(rows: list[dict[str, Any]], configs: list[str], min_serving_s: float = 0.0) -> dict[str, Any]:
    """Per configuration: means and sds; paired loss/growth against ``none`` by round."""
    good = [r for r in ok_rows(rows) if (r.get("serving_s") or 0) >= min_serving_s]
    out: dict[str, Any] = {}
    for c in configs:
        rs = [r for r in good if r["config"] == c]
        d: dict[str, Any] = {"runs": len(rs), "rounds": sorted({r["round"] for r in rs}),
                             "failed_runs": sum(1 for r in rows if r["config"] == c and not r.get("warmup")
                                                and r not in good)}
        if rs:
            def stat(k: str, scale: float = 1.0, rs: list = rs) -> dict[str, Any]:
                return t_interval([r[k] * scale for r in rs if r.get(k) is not None])

            d["tok_s"] = stat("throughput_tok_s")
            d["step_p50_ms"] = stat("step_p50_s", 1e3)
            d["step_p99_ms"] = stat("step_p99_s", 1e3)
            d["serving_s"] = stat("serving_s")
            d["process_wall_s"] = stat("process_wall_s")
            d["process_cpu_s"] = stat("process_cpu_s")
            for k in ("cupti_records_per_step", "ranges_per_step", "steps"):
                v = [r[k] for r in rs if r.get(k) is not None]
                if v:
                    d[k] = statistics.fmean(v)
            for when in ("before", "after"):
                for g in ("sm_mhz", "mem_mhz", "temp_c"):
                    v = [r[f"gpu_{when}"][g] for r in rs if isinstance(r.get(f"gpu_{when}"), dict)
                         and r[f"gpu_{when}"].get(g) is not None]
                    if v:
                        d[f"gpu_{g}_{when}"] = statistics.fmean(v)
            if c != "none":
                d["tok_s_loss_pct"] = paired(good, c, "throughput_tok_s", +1)
                d["step_p50_growth_pct"] = paired(good, c, "step_p50_s", -1)
        out[c] = d
    return out


def spread(rows: list[dict[str, Any]], configs: list[str], half: float = 2.0, min_serving_s: float = 0.0) -> dict[str, Any]:
    """How much runs of one configuration vary, and what that costs the protocol: the pooled
    coefficient of variation of tokens/s within configurations (those with two runs or more), the
    standard deviation of a paired loss if a round's two runs vary independently (√2·CV, in
    points), and the rounds after which the 95% interval of the mean paired loss would be
    narrower than ±``half`` points."""
    good = [r for r in ok_rows(rows) if (r.get("serving_s") or 0) >= min_serving_s]
    num = den = 0.0
    for c in configs:
        v = [r["throughput_tok_s"] for r in good if r["config"] == c]
        if len(v) >= 2:
            num += (len(v) - 1) * (statistics.stdev(v) / statistics.fmean(v)) ** 2
            den += len(v) - 1
    if not den:
        return {"configs_with_two_runs": 0}
    cv = (num / den) ** 0.5 * 100.0
    sd = 2 ** 0.5 * cv
    n = 2
    while t975(n - 1) * sd / n ** 0.5 > half and n < 100_000:
        n += 1
    return {"pooled_cv_pct": cv, "paired_sd_points": sd, "half_width_points": half, "rounds_needed": n,
            "degrees_of_freedom": int(den)}


def spread_line(sp: dict[str, Any]) -> str:
    if not sp.get("degrees_of_freedom"):
        return "Run-to-run spread: no configuration has two runs yet."
    return (f"Run-to-run spread: tokens/s varies by {sp['pooled_cv_pct']:.1f}% (pooled CV, {sp['degrees_of_freedom']} degrees of "
            f"freedom); a paired loss by ~{sp['paired_sd_points']:.1f} points, so a 95% interval of ±{sp['half_width_points']:g} "
            f"points needs ~{sp['rounds_needed']} rounds.")


def _ci(d: dict[str, Any] | None) -> str:
    if not d or not d.get("n"):
        return ""
    if d["n"] == 1:
        return f"{d['mean']:.1f} (1 round)"
    return f"{d['mean']:.1f} [{d['lo']:.1f}, {d['hi']:.1f}] (±{d['half']:.1f}, {d['n']} rounds)"


def _ms(d: dict[str, Any] | None, fmt: str = ".0f") -> str:
    if not d or not d.get("n"):
        return ""
    return f"{d['mean']:{fmt}}" + (f" ± {d['sd']:{fmt}}" if d.get("sd") is not None else "")


def table_long(summary: dict[str, Any]) -> str:
    """Markdown: one row per configuration (losses are paired against ``none`` by round)."""
    lines = ["| configuration | runs | tokens/s mean ± sd | tokens/s loss % vs none, mean [95% CI] | "
             "step p50 ms mean ± sd | step p50 growth % vs none, mean [95% CI] | step p99 ms | "
             "serving s | CUPTI records/step | ranges/step | process wall s | process CPU s | "
             "SM MHz before → after | °C before → after |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c, d in summary.items():
        if not d.get("runs"):
            lines.append(f"| {c} | 0 ({d.get('failed_runs', 0)} failed) |" + " |" * 12)
            continue
        clk = (f"{d.get('gpu_sm_mhz_before', float('nan')):.0f} → {d.get('gpu_sm_mhz_after', float('nan')):.0f}"
               if "gpu_sm_mhz_before" in d else "")
        tmp = (f"{d.get('gpu_temp_c_before', float('nan')):.0f} → {d.get('gpu_temp_c_after', float('nan')):.0f}"
               if "gpu_temp_c_before" in d else "")
        rps = f"{d['cupti_records_per_step']:.0f}" if "cupti_records_per_step" in d else ""
        rng = f"{d['ranges_per_step']:.0f}" if "ranges_per_step" in d else ""
        lines.append(f"| {c} | {d['runs']} | {_ms(d['tok_s'])} | {_ci(d.get('tok_s_loss_pct')) or '—'} | "
                     f"{_ms(d['step_p50_ms'], '.1f')} | {_ci(d.get('step_p50_growth_pct')) or '—'} | "
                     f"{_ms(d['step_p99_ms'], '.1f')} | {_ms(d['serving_s'], '.1f')} | {rps} | {rng} | "
                     f"{_ms(d['process_wall_s'], '.1f')} | {_ms(d['process_cpu_s'], '.1f')} | {clk} | {tmp} |")
    return "\n".join(lines)


# ---- what a run saw: GPU clocks, CPU cores of the engine's threads -----------------------------

_GPU_FIELDS = ("index", "clocks.sm", "clocks.mem", "temperature.gpu", "power.draw", "clocks.max.sm")


def gpu_query() -> list[dict[str, Any]] | None:
    """Clocks, temperature and power of every GPU (``nvidia-smi --query-gpu``), None without one.
    A driver that rejects one of the fields gets the basic ones (index, SM/memory clock, °C)."""
    if shutil.which("nvidia-smi") is None:
        return None
    for fields in (_GPU_FIELDS, _GPU_FIELDS[:4]):
        out = _gpu_rows(fields)
        if out:
            return out
    return None


def _gpu_rows(fields: tuple[str, ...]) -> list[dict[str, Any]]:
    try:
        p = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return []
    if p.returncode != 0:
        return []
    out = []
    for line in p.stdout.strip().splitlines():
        v = [x.strip() for x in line.split(",")] + [""] * (len(_GPU_FIELDS) - len(fields))
        if len(v) != len(_GPU_FIELDS) or not v[0].isdigit():
            continue

        def num(x: str) -> float | None:
            try:
                return float(x)
            except ValueError:
                return None

        out.append({"index": int(v[0]), "sm_mhz": num(v[1]), "mem_mhz": num(v[2]), "temp_c": num(v[3]),
                    "power_w": num(v[4]), "sm_max_mhz": num(v[5])})
    return out


def _gpu_of(query: list[dict[str, Any]] | None, gpu: int | None) -> dict[str, Any] | None:
    if not query:
        return None
    for g in query:
        if g["index"] == (gpu or 0):
            return g
    return query[0]


def _stat(pid: int, tid: int) -> tuple[str, int, int] | None:
    """(comm, last CPU, utime + stime ticks) of one thread, from /proc/PID/task/TID/stat."""
    try:
        text = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
    except OSError:
        return None
    i, j = text.find("("), text.rfind(")")
    rest = text[j + 2:].split()
    try:  # fields after the comm start at field 3: utime 14, stime 15, processor 39
        return text[i + 1:j], int(rest[36]), int(rest[11]) + int(rest[12])
    except (IndexError, ValueError):
        return None


def _children(pid: int) -> list[int]:
    """Child pids (``/proc/PID/task/*/children``, else a scan of every process's parent)."""
    out: list[int] = []
    found = False
    for t in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(x) for x in (t / "children").read_text().split()]
            found = True
        except (OSError, ValueError):
            pass
    if found:
        return out
    for d in Path("/proc").glob("[0-9]*"):
        try:
            if int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(d.name))
        except (OSError, ValueError, IndexError):
            pass
    return out


def _compress(cores: list[int]) -> str:
    """[0, 1, 2, 5] → "0-2,5"."""
    out, cs = [], sorted(cores)
    i = 0
    while i < len(cs):
        j = i
        while j + 1 < len(cs) and cs[j + 1] == cs[j] + 1:
            j += 1
        out.append(f"{cs[i]}" if i == j else f"{cs[i]}-{cs[j]}")
        i = j + 1
    return ",".join(out)


class ThreadSampler:
    """Samples, every ``interval`` s, which core each thread of the engine process last ran on.

    The engine is the process under ``root`` whose command line runs ``teller.workload`` (the
    root itself for ``none``). A thread counts a sample on its core only when it used CPU since
    the previous sample, so idle threads do not pile up counts. Read from
    ``/proc/PID/task/*/stat`` (field 39, the CPU last run on; fields 14 + 15, CPU time).
    """

    def __init__(self, root: int, interval: float = 0.5, marker: str = "teller.workload") -> None:
        self.root, self.interval, self.marker = root, interval, marker
        self.pid: int | None = None
        self.affinity: list[int] | None = None
        self.threads: dict[int, dict[str, Any]] = {}
        self.samples = 0
        self._stop = __import__("threading").Event()
        self._t = __import__("threading").Thread(target=self._loop, name="overhead-sampler", daemon=True)

    def start(self) -> "ThreadSampler":
        self._t.start()
        return self

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        self._t.join(timeout=5)
        return self.result()

    def _find(self) -> int | None:
        """The process running ``python -m <marker>`` at or below the root (not the launcher,
        whose ``-c`` command line names the workload too)."""
        todo = [self.root]
        while todo:
            p = todo.pop()
            try:
                argv = Path(f"/proc/{p}/cmdline").read_bytes().decode("utf-8", "replace").split("\0")
                if len(argv) > 2 and argv[1] == "-m" and argv[2] == self.marker:
                    return p
            except OSError:
                pass
            todo += _children(p)
        return None

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            if self.pid is None:
                self.pid = self._find()
                if self.pid is None:
                    continue
                try:
                    self.affinity = sorted(os.sched_getaffinity(self.pid))
                except OSError:
                    pass
            try:
                tids = [int(t.name) for t in Path(f"/proc/{self.pid}/task").iterdir()]
            except OSError:
                return  # the engine exited
            self.samples += 1
            for tid in tids:
                st = _stat(self.pid, tid)
                if st is None:
                    continue
                comm, core, ticks = st
                th = self.threads.setdefault(tid, {"comm": comm, "ticks0": ticks, "ticks": ticks, "cores": {}})
                th["comm"] = comm
                if ticks > th["ticks"]:
                    th["cores"][core] = th["cores"].get(core, 0) + 1
                th["ticks"] = ticks

    def result(self, roles: dict[int, str] | None = None, top: int = 6) -> dict[str, Any]:
        hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        roles = dict(roles or {})
        if self.pid is not None:
            roles.setdefault(self.pid, "main")
        rows = []
        for tid, th in self.threads.items():
            role = roles.get(tid) or ("teller-flush" if th["comm"].startswith("teller") else "")
            rows.append({"tid": tid, "comm": th["comm"], "role": role,
                         "cpu_s": round((th["ticks"] - th["ticks0"]) / hz, 3),
                         "cores": _compress(list(th["cores"])), "samples_on_core": th["cores"]})
        rows.sort(key=lambda r: -r["cpu_s"])
        keep = [r for i, r in enumerate(rows) if i < top or r["role"]]
        return {"engine_pid": self.pid, "affinity": _compress(self.affinity) if self.affinity else None,
                "samples": self.samples, "threads_seen": len(rows),
                "engine_threads_cpu_s": round(sum(r["cpu_s"] for r in rows), 3), "threads": keep}


def _roles_from_run(run_dir: Path) -> dict[int, str]:
    """Thread ids TELLER itself ran on: its flusher and the threads CUPTI's callbacks came on."""
    roles: dict[int, str] = {}
    for pf in sorted((run_dir / "proc").glob("*.json")):
        try:
            d = json.loads(pf.read_text())
        except (OSError, ValueError):
            continue
        tid = (d.get("threads") or {}).get("flush")
        for t in ((d.get("collectors") or {}).get("cupti") or {}).get("callback_tids") or []:
            roles[int(t)] = "cupti-callback"
        if tid:
            roles[int(tid)] = roles.get(int(tid), "") + ("+" if int(tid) in roles else "") + "teller-flush"
    return roles


def _kernel_names(run_dir: Path) -> dict[str, Any] | None:
    """KERNEL rows, their distinct names and empty names (deferred decoding reads names late)."""
    try:
        import pyarrow.compute as pc
        import pyarrow.parquet as pq
    except ImportError:
        return None
    n = empty = 0
    names: set[str] = set()
    for f in sorted((run_dir / "events").glob("*.parquet")):
        try:
            t = pq.read_table(f, columns=["kind", "name"])
        except Exception:
            continue
        k = t.filter(pc.equal(t.column("kind").cast("string"), "KERNEL")).column("name").cast("string")
        n += len(k)
        vals = [v for v in pc.unique(k).to_pylist() if v is not None]
        names.update(vals)
        empty += int(pc.sum(pc.equal(k, "")).as_py() or 0)
    return {"kernels": n, "distinct_names": len(names), "empty_names": empty}


def _physical_groups(cores: list[int]) -> list[list[int]]:
    """Allowed logical CPUs grouped by physical core (hyperthread siblings together)."""
    seen: dict[tuple[int, ...], list[int]] = {}
    allowed = set(cores)
    for c in cores:
        try:
            sib = Path(f"/sys/devices/system/cpu/cpu{c}/topology/thread_siblings_list").read_text().strip()
            key = tuple(sorted(x for x in _expand(sib) if x in allowed))
        except OSError:
            key = (c,)
        seen.setdefault(key, list(key))
    return sorted(seen.values(), key=min)


def _expand(spec: str) -> list[int]:
    out: list[int] = []
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part:
            a, b = part.split("-")
            out += list(range(int(a), int(b) + 1))
        else:
            out.append(int(part))
    return out


def _gpu_local_cpus(gpu: int) -> set[int] | None:
    """The CPUs of the NUMA node nearest GPU ``gpu`` (sysfs, through its PCI bus id)."""
    try:
        p = subprocess.run(["nvidia-smi", "-i", str(gpu), "--query-gpu=pci.bus_id", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=20)
        bus = p.stdout.strip().lower()
        if len(bus) > 12:
            bus = bus[-12:]
        return set(_expand(Path(f"/sys/bus/pci/devices/{bus}/local_cpulist").read_text()))
    except (OSError, subprocess.TimeoutExpired, ValueError):
        return None


def make_slots(gpus: list[int | None], pin: bool, cores: int | None = None) -> list[dict[str, Any]]:
    """One slot per GPU: the GPU and, with ``pin``, a disjoint set of whole physical cores,
    taken from the GPU's NUMA node where it has enough free ones (at most ``cores`` each)."""
    slots: list[dict[str, Any]] = [{"gpu": g, "cpus": None} for g in gpus]
    if not pin:
        return slots
    groups = _physical_groups(sorted(os.sched_getaffinity(0)))
    per = max(1, len(groups) // len(slots))
    if cores:
        per = min(per, cores)
    free = list(groups)
    for s in slots:
        local = _gpu_local_cpus(s["gpu"]) if s["gpu"] is not None else None
        near = [g for g in free if local and set(g) <= local]
        take = (near if len(near) >= per else free)[:per]
        for g in take:
            free.remove(g)
        s["cpus"] = sorted(c for g in take for c in g)
    return slots


def rotation(configs: list[str], rnd: int) -> list[str]:
    """Round ``rnd``'s order: the configuration list rotated by ``rnd``."""
    k = rnd % len(configs)
    return configs[k:] + configs[:k]


def round_todo(configs: list[str], rnd: int, done: set[str], left_s: float, run_s: float) -> list[str]:
    """The runs round ``rnd`` still needs, in its rotated order; when the time left cannot hold
    them all (one run takes ~``run_s``), ``none`` comes first, so the runs the deadline leaves in
    the round pair with a baseline of the same round."""
    todo = [c for c in rotation(configs, rnd) if c not in done]
    if "none" in todo and todo[0] != "none" and left_s < run_s * len(todo):
        todo.remove("none")
        todo.insert(0, "none")
    return todo


def run_long_one(config: str, rnd: int, out: Path, workload: list[str], slot: dict[str, Any],
                 timeout_s: float, warmup: bool = False, keep: bool = False) -> dict[str, Any]:
    """One run for the long matrix: :func:`run_one`'s figures plus clocks, cores and serving time."""
    spec = CONFIGS[config]
    tag = f"{'warmup' if warmup else 'r'}{rnd}-{config}-g{slot.get('gpu')}"
    cmd, env, wjson, run_dir = run_command(config, out, tag, workload)
    shutil.rmtree(run_dir, ignore_errors=True)
    if slot.get("gpu") is not None:  # nvidia-smi's index order is the PCI bus order
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        env["CUDA_VISIBLE_DEVICES"] = str(slot["gpu"])
    cpus = slot.get("cpus")
    pre = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
    row: dict[str, Any] = {"config": config, "round": rnd, "warmup": warmup, "gpu": slot.get("gpu"),
                           "pinned_cpus": _compress(cpus) if cpus else None, "workload": workload,
                           "started_unix": time.time()}
    row["gpu_before"] = _gpu_of(gpu_query(), slot.get("gpu"))
    logf = out / f"log-{tag}.txt"
    t0 = time.perf_counter()
    with open(logf, "w") as lf:
        p = subprocess.Popen(cmd, env=env, stdout=lf, stderr=subprocess.STDOUT, preexec_fn=pre)
    sampler = ThreadSampler(p.pid).start()
    rc, ru = _wait(p, timeout_s)
    wall = time.perf_counter() - t0
    if rc is None:
        row["timed_out"] = True
    text = logf.read_text(errors="replace")
    row["gpu_after"] = _gpu_of(gpu_query(), slot.get("gpu"))
    # wait4: CPU of this child and the descendants it waited for (the recorded engine, for
    # `teller record`), per run even when runs overlap
    row.update({"exit_code": rc, "process_wall_s": wall,
                "process_cpu_s": (ru.ru_utime + ru.ru_stime) if ru is not None else None})
    notable = _notable(text)
    if notable:
        row["notable_lines"] = notable
    roles = _roles_from_run(run_dir) if run_dir.is_dir() else {}
    sampler.stop()
    row["cores"] = sampler.result(roles)
    if p.returncode != 0 or not wjson.is_file():
        row["error_tail"] = text[-2000:]
        return row
    res = json.loads(wjson.read_text())
    s = res["summary"]
    row.update({k: s.get(k) for k in (*SUMMARY_KEYS, "requests_finished", "ok")})
    if s.get("throughput_tok_s"):
        row["serving_s"] = s["generated_tokens"] / s["throughput_tok_s"]
        row["steady_tok_s"] = steady_throughput(res.get("requests") or [])
    if spec["collector"] is not None and run_dir.is_dir():
        row.update(_run_figures(run_dir, s.get("steps") or 0))
        cu = _cupti_info(run_dir)
        if cu:
            row["cupti_decode_at"] = cu.get("decode_at")
            row["cupti_deferred"] = cu.get("deferred")
            row["cupti_callback_tids"] = cu.get("callback_tids")
            row["kernel_names"] = _kernel_names(run_dir)
        if not keep:
            shutil.rmtree(run_dir, ignore_errors=True)
    return row


def _wait(p: subprocess.Popen, timeout_s: float) -> tuple[int | None, Any]:
    """Wait for ``p`` with ``os.wait4`` (its own resource usage); kill it past ``timeout_s``.
    Returns (exit code, or None when killed for time; rusage)."""
    end = time.monotonic() + max(1.0, timeout_s)
    killed = False
    while True:
        pid, status, ru = os.wait4(p.pid, os.WNOHANG)
        if pid == p.pid:
            p.returncode = os.waitstatus_to_exitcode(status)
            return (None if killed else p.returncode), ru
        if time.monotonic() > end and not killed:
            p.kill()
            killed = True
        time.sleep(0.2)


def _cupti_info(run_dir: Path) -> dict[str, Any] | None:
    for pf in sorted((run_dir / "proc").glob("*.json")):
        try:
            cu = (json.loads(pf.read_text()).get("collectors") or {}).get("cupti")
        except (OSError, ValueError):
            continue
        if cu:
            return cu
    return None


def load_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if line:
            try:
                out.append(json.loads(line))
            except ValueError:
                pass  # a line cut by a kill: the run is lost, the rest stands
    return out


def _append(path: Path, row: dict[str, Any]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row, default=str) + "\n")
        f.flush()
        os.fsync(f.fileno())


def estimate_run_s(rows: list[dict[str, Any]], default: float) -> float:
    """Wall time to allow for one run: 1.15 × the longest counted run so far (+10 s), else ``default``."""
    walls = [r["process_wall_s"] for r in rows if not r.get("warmup") and r.get("exit_code") == 0
             and r.get("process_wall_s")]
    return 1.15 * max(walls) + 10.0 if walls else default


def steady_throughput(requests: list[dict[str, Any]], lo: float = 0.2, hi: float = 0.8) -> float | None:
    """Tokens/s between the ``lo`` and ``hi`` quantiles of the finish times (no ramp, no tail)."""
    done = sorted((r["finish_s"], r.get("generated", 0)) for r in requests if "finish_s" in r)
    if len(done) < 10:
        return None
    i, j = int(lo * (len(done) - 1)), int(hi * (len(done) - 1))
    toks = sum(g for _, g in done[i + 1:j + 1])
    dt = done[j][0] - done[i][0]
    return toks / dt if dt > 0 else None


def serving_model(runs: list[dict[str, Any]]) -> tuple[float, float] | None:
    """(fixed s, s per token) of serving time against tokens served, from runs of several sizes
    (least squares), or from one size: its steady throughput between the 20% and 80% finish
    times, the rest of its serving time counted as fixed (ramp and tail)."""
    ok = [r for r in runs if r.get("throughput_tok_s") and r.get("serving_s") and r.get("generated_tokens")]
    if not ok:
        return None
    xs = [float(r["generated_tokens"]) for r in ok]
    ys = [float(r["serving_s"]) for r in ok]
    if len(set(xs)) >= 2:
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
        if slope > 0:
            return max(0.0, my - slope * mx), slope
    steady = statistics.median(r.get("steady_tok_s") or r["throughput_tok_s"] for r in ok)
    fixed = statistics.median(max(0.0, r["serving_s"] - r["generated_tokens"] / steady) for r in ok)
    return fixed, 1.0 / steady


def calibrate_requests(runs: list[dict[str, Any]], serve_s: float, mean_out: float,
                       max_requests: int = 10**9) -> int | None:
    """Requests (a multiple of 50) for ``serve_s`` of serving under :func:`serving_model`."""
    m = serving_model(runs)
    if m is None:
        return None
    fixed, per_token = m
    n = max(1.0, serve_s - fixed) / per_token / mean_out
    return min(int(-(-n // 50) * 50), max_requests)


def _set_arg(workload: list[str], flag: str, value: str) -> list[str]:
    w = list(workload)
    if flag in w:
        w[w.index(flag) + 1] = value
    else:
        w += [flag, value]
    return w


#: the long workload (requests set by calibration or --requests): every request queued before the
#: loop starts (``--rate 0``: the same batches in every run, the engine saturated throughout)
LONG_WORKLOAD = ["--device", "cuda", "--preset", "gpu", "--rate", "0", "--prompt-len", "uniform:32:128",
                 "--output-len", "32", "--seed", "0", "--timeout", "400"]


def long_main(argv: list[str], workload: list[str] | None) -> None:
    """``--long``: the interleaved matrix under a deadline (see the module docstring)."""
    ap = argparse.ArgumentParser(description="long overhead matrix (issue 16 §2)")
    ap.add_argument("--long", action="store_true")
    ap.add_argument("--out", required=True, help="summary folder (overhead_long.{json,md}, a copy of the JSONL)")
    ap.add_argument("--state", required=True, help="folder kept between calls: runs.jsonl, workload.json")
    ap.add_argument("--configs", default="none,hooks,cupti,cupti_deferred,cupti_lean")
    ap.add_argument("--rounds", type=int, default=10, help="stop after this many rounds in all")
    ap.add_argument("--deadline", type=float, required=True, help="Unix time by which every run has ended")
    ap.add_argument("--gpus", default="auto", help="auto | none | comma list. Two GPUs or more: runs at once, "
                    "one per GPU, slots rotated per round (a whole round at once with a GPU per configuration, "
                    "else in waves); one: one run after another")
    ap.add_argument("--serial-cores", type=int, default=0,
                    help="one run at a time: pin each run to this many whole physical cores near the GPU, the same ones in "
                         "every run (0: not pinned)")
    ap.add_argument("--pin", action=argparse.BooleanOptionalAction, default=True,
                    help="parallel rounds: each run on its own physical cores")
    ap.add_argument("--requests", type=int, help="requests per run (default: calibrated by the first warm-up)")
    ap.add_argument("--serve-s", type=float, default=66.0, help="serving seconds the calibration aims at")
    ap.add_argument("--probe-requests", type=int, default=600, help="requests of the warm-up run")
    ap.add_argument("--max-requests", type=int, default=16000,
                    help="calibration's upper bound (every request's KV cache is resident: ~32 kB per token on the GPU preset)")
    ap.add_argument("--min-serving-s", type=float, default=0.0, help="runs serving less are left out of the summary")
    ap.add_argument("--run-estimate-s", type=float, default=110.0, help="run length assumed before one is measured")
    ap.add_argument("--no-warmup", action="store_true")
    ap.add_argument("--work", default="/tmp/teller_overhead_long")
    ap.add_argument("--keep-runs", action="store_true")
    args = ap.parse_args(argv)
    out, state, work = Path(args.out), Path(args.state), Path(args.work)
    for d in (out, state, work):
        d.mkdir(parents=True, exist_ok=True)
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown or "none" not in configs:
        sys.exit(f"configurations {unknown or configs}: unknown or no 'none' (choose from {', '.join(CONFIGS)})")
    jsonl = state / "runs.jsonl"
    rows = load_jsonl(jsonl)
    call = 1 + max((r.get("call", 0) for r in rows), default=0)
    base = list(workload or LONG_WORKLOAD)
    from teller.workload.serve import mean_length

    mean_out = mean_length(_get_arg(base, "--output-len") or "32", "output-len")

    # GPUs: parallel rounds when there is one per configuration
    if args.gpus == "none":
        gpus: list[int | None] = [None]
    elif args.gpus == "auto":
        q = gpu_query()
        gpus = [g["index"] for g in q] if q else [None]
    else:
        gpus = [int(x) for x in args.gpus.split(",") if x.strip()]
    # two GPUs or more: runs at once, one per GPU (a round in waves when GPUs < configurations)
    parallel = len(gpus) >= 2 and gpus[0] is not None
    slots = make_slots(gpus[:len(configs)] if parallel else gpus[:1], pin=(args.pin and parallel) or bool(args.serial_cores),
                       cores=args.serial_cores if not parallel else None)
    log = {"call": call, "started_unix": time.time(), "deadline_unix": args.deadline, "parallel": parallel,
           "slots": [{"gpu": s["gpu"], "cpus": _compress(s["cpus"]) if s["cpus"] else None} for s in slots],
           "cpus_allowed": _compress(sorted(os.sched_getaffinity(0)))}
    print(json.dumps({"call": log}), flush=True)

    # the workload: fixed once (workload.json), then the same in every run of every call
    wfile = state / "workload.json"
    fixed = json.loads(wfile.read_text())["workload"] if wfile.is_file() else None
    if fixed is None:
        prev = [r["workload"] for r in rows if not r.get("warmup") and r.get("workload")]
        fixed = prev[-1] if prev else None
    if args.requests:  # given: it wins (runs on another count stay out of the summary)
        fixed = _set_arg(fixed or base, "--requests", str(args.requests))
        if not wfile.is_file() or json.loads(wfile.read_text())["workload"] != fixed:
            # no recalibration either: the count is the caller's
            wfile.write_text(json.dumps({"workload": fixed, "checked": True, "set_by": "--requests"}, indent=1))
    with open(state / "calls.jsonl", "a") as f:
        f.write(json.dumps(log) + "\n")

    def run_parallel(items: list[tuple[str, dict[str, Any]]], rnd: int, w: list[str], warmup: bool,
                     timeout: float) -> list[dict[str, Any]]:
        import concurrent.futures as cf

        with cf.ThreadPoolExecutor(max_workers=len(items)) as ex:
            futs = [ex.submit(run_long_one, c, rnd, work, w, s, timeout, warmup, args.keep_runs) for c, s in items]
            return [f.result() for f in futs]

    def run_parallel_sized(items: list[tuple[str, dict[str, Any]]], sizes: list[int], w: list[str],
                           timeout: float) -> list[dict[str, Any]]:
        import concurrent.futures as cf

        with cf.ThreadPoolExecutor(max_workers=len(items)) as ex:
            futs = [ex.submit(run_long_one, c, 0, work, _set_arg(w, "--requests", str(n)), s, timeout, True,
                              args.keep_runs) for (c, s), n in zip(items, sizes, strict=True)]
            return [f.result() for f in futs]

    def left() -> float:
        return args.deadline - time.time()

    if not args.no_warmup:
        # the warm-up (every call; warms the GPUs, calibrates the first time) is probe-sized
        w = _set_arg(fixed or base, "--requests", str(args.probe_requests))
        est = estimate_run_s([dict(r, warmup=False) for r in rows if r.get("warmup")], args.run_estimate_s)
        if left() > est:
            items = [("none", s) for s in slots]
            if fixed is None and len(slots) > 1:  # several sizes at once: a line to calibrate on
                sizes = [max(10, int(args.probe_requests * (0.5 + i / (len(slots) - 1)))) for i in range(len(slots))]
                warm = run_parallel_sized(items, sizes, w, left() - 5)
            else:
                warm = run_parallel(items, 0, w, True, left() - 5)
            for r in warm:
                r["call"] = call
                _append(jsonl, r)
                rows.append(r)
                print(json.dumps({k: r.get(k) for k in ("config", "warmup", "gpu", "exit_code", "throughput_tok_s",
                                                         "serving_s", "process_wall_s")}), flush=True)
            if fixed is None:
                n = calibrate_requests(warm, args.serve_s, mean_out, args.max_requests)
                if n is None:
                    sys.exit("warm-up failed: no throughput to calibrate the workload on; see runs.jsonl")
                fixed = _set_arg(base, "--requests", str(n))
                wfile.write_text(json.dumps({"workload": fixed, "calibrated": {
                    "probe_requests": args.probe_requests, "serve_s": args.serve_s,
                    "warmup_tok_s": [r.get("throughput_tok_s") for r in warm],
                    "warmup_steady_tok_s": [r.get("steady_tok_s") for r in warm],
                    "warmup_serving_s": [r.get("serving_s") for r in warm]}}, indent=1))
    if fixed is None:
        sys.exit("no workload: pass --requests, or let a warm-up calibrate it")
    if not wfile.is_file():
        wfile.write_text(json.dumps({"workload": fixed}, indent=1))

    def recalibrate(w: list[str], rows: list[dict[str, Any]], rnd: int) -> list[str]:
        """Once: when the first ``none`` run of the fixed workload served outside 0.95–1.4 ×
        ``--serve-s``, refit the serving model with it and fix a new request count; the runs of
        the old one stay in the JSONL and are left out of the summary (other workload)."""
        meta = json.loads(wfile.read_text())
        if meta.get("checked"):
            return w
        first = [r for r in rows if r["config"] == "none" and not r.get("warmup") and r.get("workload") == w
                 and r.get("serving_s")]
        if not first:
            return w
        meta["checked"] = True
        s0 = first[0]["serving_s"]
        if 0.95 * args.serve_s <= s0 <= 1.4 * args.serve_s:
            wfile.write_text(json.dumps(meta, indent=1))
            return w
        n = calibrate_requests([r for r in rows if r["config"] == "none" and r.get("serving_s")],
                               args.serve_s, mean_out, args.max_requests)
        if n is None:
            wfile.write_text(json.dumps(meta, indent=1))
            return w
        meta["recalibrated"] = {"after_round": rnd, "old_workload": w, "old_serving_s": s0}
        meta["workload"] = _set_arg(w, "--requests", str(n))
        wfile.write_text(json.dumps(meta, indent=1))
        print(f"[overhead] round {rnd}: none served {s0:.1f} s; requests now {n}", flush=True)
        return meta["workload"]

    def write_summary() -> None:
        same = [r for r in rows if r.get("workload") == fixed]
        summ = summarize_long(same, configs, args.min_serving_s)
        sp = spread(same, configs, min_serving_s=args.min_serving_s)
        (out / "overhead_long.json").write_text(json.dumps(
            {"workload": fixed, "configs": configs, "calls": load_jsonl(state / "calls.jsonl"),
             "workload_meta": json.loads(wfile.read_text()), "summary": summ, "spread": sp}, indent=1, default=str))
        (out / "overhead_long.md").write_text(table_long(summ) + "\n\n" + spread_line(sp) + "\n")
        shutil.copy(jsonl, out / "runs.jsonl")
        shutil.copy(wfile, out / "workload.json")

    counted = [r for r in rows if not r.get("warmup")]
    rnd = max((r["round"] for r in counted), default=0)
    while rnd < args.rounds:
        done = {r["config"] for r in counted if r["round"] == rnd and r.get("exit_code") is not None}
        est = estimate_run_s(rows, args.run_estimate_s)
        todo = round_todo(configs, rnd, done, left() if not parallel else float("inf"), est)
        if not todo:
            rnd += 1
            continue
        if parallel:
            if left() < est:
                print(f"[overhead] stop: round {rnd} needs ~{est:.0f} s, {left():.0f} s left", flush=True)
                break
            wave = todo[:len(slots)]  # all of the round when there is a GPU per configuration
            items = [(c, slots[(configs.index(c) + rnd) % len(slots)]) for c in wave]
            if len({id(sl) for _, sl in items}) < len(items):  # a wave of a round: slots in order
                items = [(c, slots[(i + rnd) % len(slots)]) for i, c in enumerate(wave)]
            new = run_parallel(items, rnd, fixed, False, left() - 2)
        else:
            if left() < est:
                print(f"[overhead] stop: a run needs ~{est:.0f} s, {left():.0f} s left", flush=True)
                break
            new = [run_long_one(todo[0], rnd, work, fixed, slots[0], left() - 2, False, args.keep_runs)]
        for r in new:
            r["call"] = call
            _append(jsonl, r)
            rows.append(r)
            counted.append(r)
            print(json.dumps({k: r.get(k) for k in ("config", "round", "gpu", "exit_code", "throughput_tok_s",
                                                     "step_p50_s", "serving_s", "cupti_records_per_step",
                                                     "process_wall_s")}), flush=True)
        new_w = recalibrate(fixed, rows, rnd)
        if new_w != fixed:  # the rest of this round would pair with nothing: next round
            fixed = new_w
            rnd += 1
        write_summary()
    write_summary()
    print((out / "overhead_long.md").read_text(), flush=True)


def _get_arg(workload: list[str], flag: str) -> str | None:
    return workload[workload.index(flag) + 1] if flag in workload and workload.index(flag) + 1 < len(workload) else None


def summarize_main(argv: list[str]) -> None:
    """``--summarize JSONL... [--configs ...]``: the table of one or several calls' runs."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--summarize", nargs="+", required=True)
    ap.add_argument("--configs", default="none,hooks,cupti,cupti_deferred,cupti_lean")
    ap.add_argument("--min-serving-s", type=float, default=0.0)
    ap.add_argument("--json", help="also write the summary and the runs it read here")
    args = ap.parse_args(argv)
    rows: list[dict[str, Any]] = []
    seen: set[tuple] = set()
    for k, f in enumerate(args.summarize):
        for r in load_jsonl(Path(f)):
            key = (r.get("config"), r.get("round"), r.get("started_unix"))
            if key not in seen:
                seen.add(key)
                # each file's rounds are its own (separate states count rounds from 0): pair within a file
                rows.append(r if len(args.summarize) == 1 else {**r, "round": f"{k}.{r.get('round')}"})
    configs = [c for c in args.configs.split(",") if c]
    counted = [r for r in rows if not r.get("warmup") and r.get("workload")]
    if counted:  # the workload of the last run (a recalibration leaves earlier runs on another)
        rows = [r for r in rows if r.get("workload") == counted[-1]["workload"]]
    summ = summarize_long(rows, configs, args.min_serving_s)
    sp = spread(rows, configs, min_serving_s=args.min_serving_s)
    print(table_long(summ))
    print("\n" + spread_line(sp))
    if args.json:
        Path(args.json).write_text(json.dumps({"sources": args.summarize, "configs": configs, "summary": summ,
                                               "spread": sp, "runs": rows}, indent=1, default=str))


def main() -> None:
    argv = sys.argv[1:]
    workload = DEFAULT_WORKLOAD
    if "--" in argv:
        i = argv.index("--")
        argv, workload = argv[:i], argv[i + 1:]
    if "--summarize" in argv:
        return summarize_main(argv)
    if "--long" in argv:
        return long_main(argv, workload if workload is not DEFAULT_WORKLOAD else None)
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
