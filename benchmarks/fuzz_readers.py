"""Damaged real traces through ``ingest → reconstruct → stats → diagnose → tpe``: how many are handled, and how.

For every external trace (``tests/data/external``) and every damage family of ``tests/damage.py``
(Kineto JSON, Nsight SQLite, recorder log lines, run-directory files) it builds ``--n`` damaged
variants and runs the commands on each in a child process under ``--timeout`` seconds: ``ingest``,
``reconstruct``, ``stats``, then ``diagnose --reference INTACT --html`` with the shipped root-cause
model (the intact trace, ingested and reconstructed once, is the reference) and ``tpe train`` +
``tpe encode`` on the damaged run (``--stages 3`` stops after ``stats``). Then it sorts the
outcome into:

- ``correct``: every command exits 0, the reader's counts balance (Kineto: events_in =
  events_out + skipped) and what was planted shows up in the counts (duplicates flagged, absurd
  durations repaired, rows with text times rejected, bad log lines counted), and the later
  stages agree with ``reconstruct`` (diagnosis steps = reconstructed steps, its counts reconcile;
  one TPE row per step);
- ``clear error``: a command exits 2 with one ``teller: error:`` line naming the file;
- ``traceback``, ``hang`` (the child ran past the timeout) and ``wrong`` (exit 0 but unbalanced
  counts, or planted damage not reported).

``recorded``: the families of ``damage.RECORDED_DAMAGE`` on copies of the bundled recording
(no host side, nulls, a copied chunk, corrupt pages, missing columns or ``events/``, a thread an
hour off), judged against the intact run.

Usage::

    python benchmarks/fuzz_readers.py --n 2 [--only kineto|nsys|logs|rundir|recorded] [--timeout 120]

Also times the hang case of issue 15 (one byte flipped mid-stream in a multi-MB ``.json.gz``)
against the intact file with ``--salvage-timing``.
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
import damage  # noqa: E402

OUTCOMES = ("correct", "clear error", "traceback", "hang", "wrong")


# --------------------------------------------------------------------------------------------
# child: run the commands, report what happened as JSON on stdout


def _stage(argv: list[str]) -> dict:
    from teller.cli import main

    err = io.StringIO()
    try:
        with redirect_stderr(err), redirect_stdout(io.StringIO()):
            rc = main(argv)
    except BaseException as e:  # noqa: BLE001 - the point is to see what escapes
        import traceback

        tb = traceback.extract_tb(e.__traceback__)
        where = f"{Path(tb[-1].filename).name}:{tb[-1].lineno}" if tb else "?"
        return {"rc": -1, "exc": f"{type(e).__name__}: {str(e)[:200]} ({where})"}
    lines = [ln for ln in err.getvalue().splitlines() if ln.strip()]
    errs = [ln for ln in lines if ln.startswith("teller: error:")]
    return {"rc": rc, "err": errs[-1][:400] if errs else "", "n_err_lines": len(errs), "tail": lines[-6:]}


def child(src: str, run: str, skip_ingest: bool, reference: str | None = None) -> None:
    res: dict = {}
    if not skip_ingest:
        res["ingest"] = _stage(["ingest", src, "-o", run])
        if res["ingest"]["rc"] != 0:
            print(json.dumps(res))
            return
    res["reconstruct"] = _stage(["reconstruct", run])
    if res["reconstruct"]["rc"] == 0:
        res["stats"] = _stage(["stats", run])
    try:
        from teller.rundir import RunDir

        info = RunDir(run).read_info()
        res["counts"] = info.counts
        res["warnings"] = info.extra.get("warnings", [])
        res["clock"] = info.clock
    except Exception as e:  # noqa: BLE001
        res["info_error"] = repr(e)
    rj = Path(run) / "reconstruct.json"
    if rj.is_file():
        r = json.loads(rj.read_text())
        res["reconstruct_summary"] = {k: r.get(k) for k in ("events_in", "nodes", "steps", "max_depth", "binding_coverage",
                                                            "requests", "gpu_bound", "dropped_copied_events", "reconciled")}
        res["reconstruct_summary"]["clocks"] = r.get("clocks")
    la = Path(run) / "log_alignment.parquet"
    if la.is_file():
        import pyarrow.parquet as pq

        flags = pq.read_table(la, columns=["flags"]).column("flags").to_pylist()
        res["log_bad_records"] = sum(1 for f in flags if f & 8)
    if reference and res.get("reconstruct", {}).get("rc") == 0 and res.get("stats", {}).get("rc") == 0:
        later(res, Path(run), reference)
    print(json.dumps(res, default=str))


def later(res: dict, run: Path, reference: str) -> None:
    """The user's next commands on the damaged run: a diagnosis against the intact trace (with the
    shipped model and the HTML report), then a TPE vocabulary learned from it and its steps encoded."""
    out = run / "fuzz_diagnosis"
    res["diagnose"] = _stage(["diagnose", str(run), "--reference", reference, "-o", str(out), "--html", "-q"])
    dj = out / "diagnosis.json"
    if res["diagnose"]["rc"] == 0 and dj.is_file():
        d = json.loads(dj.read_text())
        s = d.get("summary", {})
        res["diagnose_summary"] = {"steps": s.get("steps"), "flagged": s.get("steps_flagged"),
                                   "reconciled": s.get("reconciled"), "html": (out / "report.html").is_file(),
                                   "typed": sum(1 for st in d.get("steps", []) if st.get("fault_type"))}
    tok = run / "fuzz_tpe"
    res["tpe_train"] = _stage(["tpe", "train", str(run), "-o", str(tok), "--vocab-size", "300", "--max-steps", "400"])
    if res["tpe_train"]["rc"] == 0:
        enc = run / "fuzz_tpe.parquet"
        res["tpe_encode"] = _stage(["tpe", "encode", str(tok), str(run), "-o", str(enc)])
        if res["tpe_encode"]["rc"] == 0 and enc.is_file():
            import pyarrow.parquet as pq

            res["tpe_rows"] = pq.read_metadata(enc).num_rows


# --------------------------------------------------------------------------------------------
# parent: build variants, run children, judge


def judge(res: dict | None, planted: dict, names: list[str]) -> tuple[str, str]:
    if res is None:
        return "hang", ""
    for stage in ("ingest", "reconstruct", "stats", "diagnose", "tpe_train", "tpe_encode"):
        r = res.get(stage)
        if r is None:
            continue
        if r["rc"] == -1:
            return "traceback", f"{stage}: {r['exc']}"
        if r["rc"] != 0:
            clear = r["rc"] == 2 and r["n_err_lines"] == 1 and any(n in r["err"] for n in names)
            return ("clear error" if clear else "traceback"), f"{stage}: {r['err'] or r['tail']}"
    c = res.get("counts") or {}
    if "events_in" in c and c["events_in"] != c["events_out"] + c["skipped"]:
        return "wrong", f"events_in {c['events_in']} != out {c['events_out']} + skipped {c['skipped']}"
    expect, k = planted.get("expect"), planted.get("planted", 0)
    if expect == "error":
        return "wrong", "exit 0 on input that must be refused"
    rs = res.get("reconstruct_summary") or {}
    ds = res.get("diagnose_summary")
    if res.get("diagnose", {}).get("rc") == 0:
        if not ds:
            return "wrong", "diagnose exit 0 without diagnosis.json"
        if ds["steps"] != rs.get("steps") or not ds["reconciled"] or not ds["html"]:
            return "wrong", f"diagnosis {ds} disagrees with reconstruct (steps {rs.get('steps')})"
    if res.get("tpe_encode", {}).get("rc") == 0 and res.get("tpe_rows") != rs.get("steps"):
        return "wrong", f"tpe encode wrote {res.get('tpe_rows')} rows for {rs.get('steps')} steps"
    if planted.get("ref") is not None and not rs.get("reconciled", True):
        return "wrong", "reconstruct counts do not reconcile"
    if expect in ("same", "error_or_same"):
        diff = {k: (rs.get(k), v) for k, v in planted["ref"].items() if rs.get(k) != v}
        if diff:
            return "wrong", f"differs from the intact run: {diff}"
    if expect == "copies" and (rs.get("dropped_copied_events") != k or rs.get("steps") != planted["ref"]["steps"]):
        return "wrong", f"copied chunk of {k} events: dropped {rs.get('dropped_copied_events')}, steps {rs.get('steps')}"
    if expect in ("no_host", "unbound_all") and rs.get("gpu_bound"):
        return "wrong", f"{rs.get('gpu_bound')} GPU rows bound without a launch call"
    if expect == "skew_repaired":
        c = rs.get("clocks") or {}
        if c.get("threads_repaired") != 1 or c.get("after_repair_gpu_before_launch") or rs.get("steps") != planted["ref"]["steps"]:
            return "wrong", f"thread shifted by 1 h: clocks {c}"
    if expect == "duplicates":
        got = c.get("repaired_by_reason", {}).get("exact_duplicate", 0) + c.get("skipped_by_reason", {}).get("exact_duplicate", 0)
        if got < k:
            return "wrong", f"{k} exact duplicates planted, {got} counted"
    if expect == "repaired":
        got = sum(v for r, v in c.get("repaired_by_reason", {}).items() if "duration" in r)
        got += sum(v for r, v in c.get("skipped_by_reason", {}).items() if "duration" in r)
        if got < k:
            return "wrong", f"{k} absurd durations planted, {got} flagged"
    if expect == "rejected_rows":
        got = sum(v for r, v in (c.get("skipped") or {}).items() if "not an integer" in r) if isinstance(c.get("skipped"), dict) else 0
        if got < k:
            return "wrong", f"{k} rows with text times planted, {got} rejected"
    if expect == "log_lines":
        got = res.get("log_bad_records", 0)
        if got < k:
            return "wrong", f"{k} bad log lines planted, {got} counted"
    if expect == "no_epoch":
        t0 = (res.get("clock") or {}).get("t0_unix_ns")
        if t0 is not None and not (0 <= int(t0) < 4_102_444_800 * 10**9):
            return "wrong", f"implausible t0_unix_ns {t0} kept"
    return "correct", ""


def run_child(src: Path, run: Path, timeout: float, skip_ingest: bool = False,
              reference: Path | None = None) -> dict | None:
    cmd = [sys.executable, __file__, "--child", str(src), str(run)] + (["--skip-ingest"] if skip_ingest else [])
    cmd += ["--reference", str(reference)] if reference else []
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=os.environ)
    except subprocess.TimeoutExpired:
        return None
    try:
        return json.loads(p.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return {"ingest": {"rc": -1, "exc": f"child died rc={p.returncode}: {p.stderr[-300:]}"}}


def _reference_run(tmp: Path, timeout: float) -> tuple[Path, int]:
    """An ingested Kineto run with a wall clock, the base for log and run-directory damage."""
    src = damage.EXTERNAL / "kineto" / "h200_torch211_matmul.json.gz"
    run = tmp / "reference_run"
    res = run_child(src, run, timeout)
    assert res and res["ingest"]["rc"] == 0, res
    t0 = json.loads((run / "run.json").read_text())["clock"]["t0_unix_ns"]
    return run, int(t0)


def _copy_run(ref: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(ref, dst, ignore=shutil.ignore_patterns("*.parquet.tmp"))
    for p in dst.glob("*.parquet"):  # only what ingest wrote
        p.unlink()
    for p in ("reconstruct.json",):
        (dst / p).unlink(missing_ok=True)
    return dst


def rundir_variants(ref: Path, tmp: Path, rng: random.Random) -> list[tuple[str, Path, dict]]:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = []
    for name, body in (("run_json_list", "[]"), ("run_json_string", '"x"'), ("run_json_number", "3"),
                       ("run_json_cut", '{"schema_version": 1, "clock": {"t0_u'),
                       ("run_json_bad_version", '{"schema_version": "one"}')):
        d = _copy_run(ref, tmp / name)
        (d / "run.json").write_text(body)
        out.append((name, d, {}))
    ev = sorted((ref / "events").glob("*.parquet"))[0]
    t = pq.read_table(ev)
    d = _copy_run(ref, tmp / "no_args_column")
    pq.write_table(t.drop_columns(["args"]), d / "events" / ev.name)
    out.append(("no_args_column", d, {}))
    d = _copy_run(ref, tmp / "null_start")
    start = t.column("start_ns").to_numpy().copy()
    mask = np.zeros(len(start), bool)
    mask[rng.sample(range(len(start)), 5)] = True
    t2 = t.set_column(t.schema.get_field_index("start_ns"), "start_ns", pa.array(start, mask=mask))
    pq.write_table(t2, d / "events" / ev.name)
    out.append(("null_start", d, {"expect": "error"}))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=2, help="damaged variants per family and trace")
    ap.add_argument("--seed", type=int, default=15)
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--only", choices=("kineto", "nsys", "logs", "rundir", "recorded"), action="append")
    ap.add_argument("--traces", nargs="*", help="substrings of the trace file names to use")
    ap.add_argument("--salvage-timing", action="store_true")
    ap.add_argument("--child", nargs=2, metavar=("SRC", "RUN"))
    ap.add_argument("--skip-ingest", action="store_true")
    ap.add_argument("--reference", help=argparse.SUPPRESS)
    ap.add_argument("--stages", type=int, choices=(3, 5), default=5,
                    help="3: ingest, reconstruct, stats; 5: also diagnose and tpe (default)")
    ap.add_argument("--jobs", type=int, default=1, help="children run side by side")
    ap.add_argument("-v", "--verbose", action="store_true")
    a = ap.parse_args()
    if a.child:
        child(a.child[0], a.child[1], a.skip_ingest, a.reference)
        return 0
    if a.salvage_timing:
        return salvage_timing(a.timeout)
    rng = random.Random(a.seed)
    only = set(a.only or ("kineto", "nsys", "logs", "rundir", "recorded"))
    tally: dict[str, Counter] = defaultdict(Counter)
    bad: list[str] = []
    t_start = time.time()
    with tempfile.TemporaryDirectory(prefix="fuzz_readers_") as tmp_s:
        tmp = Path(tmp_s)
        jobs: list[tuple[str, Path, dict, bool, Path | None]] = []  # (label, src or run, planted, skip_ingest, reference)
        intact: dict[Path, Path | None] = {}

        def reference_of(f: Path) -> Path | None:
            """The intact trace ingested and reconstructed once: the reference of its damaged copies."""
            if a.stages == 3:
                return None
            if f not in intact:
                run = tmp / f"intact_{f.name.split('.')[0]}"
                res = run_child(f, run, a.timeout)
                ok = bool(res) and all((res.get(s) or {}).get("rc") == 0 for s in ("ingest", "reconstruct"))
                intact[f] = run if ok else None
            return intact[f]

        def pick(files: list[Path]) -> list[Path]:
            return [f for f in files if not a.traces or any(s in f.name for s in a.traces)]

        if "kineto" in only:
            for f in pick(damage.KINETO_FILES):
                for fam, build in damage.KINETO_DAMAGE.items():
                    for i in range(a.n):
                        p, planted = build(f, tmp / f"{f.name.split('.')[0]}_{fam}_{i}", rng)
                        jobs.append((f"kineto/{fam}", p, planted, False, reference_of(f)))
        if "nsys" in only:
            for f in pick(damage.NSYS_FILES):
                for fam, build in damage.NSYS_DAMAGE.items():
                    for i in range(a.n):
                        p, planted = build(f, tmp / f"{f.stem}_{fam}_{i}", rng)
                        jobs.append((f"nsys/{fam}", p, planted, False, reference_of(f)))
        if only & {"logs", "rundir"}:
            ref, t0 = _reference_run(tmp, a.timeout)
            ref_ref = ref if a.stages == 5 else None
            if "logs" in only:
                for i in range(a.n * 3):
                    d = _copy_run(ref, tmp / f"logs_{i}")
                    (d / "logs").mkdir(exist_ok=True)
                    body, k = damage.log_lines(rng, t0)
                    (d / "logs" / "damaged.jsonl").write_bytes(body)
                    jobs.append(("logs/jsonl", d, {"planted": k, "expect": "log_lines"}, True, ref_ref))
            if "rundir" in only:
                for name, d, planted in rundir_variants(ref, tmp, rng):
                    jobs.append((f"rundir/{name}", d, planted, True, ref_ref))
        if "recorded" in only:  # damaged copies of the bundled recording (reconstruct + stats only)
            ref_run = damage.recorded_copy(tmp / "recorded_ref")
            ref = (run_child(ref_run, ref_run, a.timeout, True) or {}).get("reconstruct_summary") or {}
            ref = {k: ref.get(k) for k in ("events_in", "nodes", "steps", "max_depth", "binding_coverage", "requests")}
            for fam, build in damage.RECORDED_DAMAGE.items():
                for i in range(a.n):
                    d = damage.recorded_copy(tmp / f"recorded_{fam}_{i}")
                    planted = {**build(d, rng), "ref": ref}
                    jobs.append((f"recorded/{fam}", d, planted, True, ref_run if a.stages == 5 else None))
        from concurrent.futures import ThreadPoolExecutor

        def one(k: int) -> tuple[int, str, str, float]:
            label, p, planted, skip, reference = jobs[k]
            run = p if skip else tmp / f"run_{k}"
            t = time.time()
            res = run_child(p, run, a.timeout, skip, reference)
            outcome, why = judge(res, planted, [p.name, str(p), run.name])
            return k, outcome, why, time.time() - t

        with ThreadPoolExecutor(max(1, a.jobs)) as pool:
            for done, (k, outcome, why, dt) in enumerate(pool.map(one, range(len(jobs)))):
                label, p = jobs[k][0], jobs[k][1]
                tally[label][outcome] += 1
                if outcome not in ("correct", "clear error"):
                    bad.append(f"{outcome:9s} {label:24s} {p.name}: {why}")
                if a.verbose:
                    print(f"[{done + 1}/{len(jobs)}] {outcome:11s} {label} {p.name} {dt:.1f}s {why}", flush=True)
    total: Counter = Counter()
    print(f"{'family':26s} " + " ".join(f"{o:>11s}" for o in OUTCOMES))
    for label in sorted(tally):
        total.update(tally[label])
        print(f"{label:26s} " + " ".join(f"{tally[label][o]:11d}" for o in OUTCOMES))
    print(f"{'TOTAL':26s} " + " ".join(f"{total[o]:11d}" for o in OUTCOMES))
    print(f"{sum(total.values())} variants in {time.time() - t_start:.0f} s")
    for b in bad:
        print("  " + b)
    return 0


def _big_trace() -> bytes:
    """About 30 MB of Kineto JSON: the ns-resolution sample twice, the copy shifted in time
    (and its ids offset) so that nothing in it is a duplicate."""
    doc = json.loads(damage.kineto_text(damage.EXTERNAL / "kineto" / "hta_ns_resolution_rank0.json.gz"))
    evs = doc["traceEvents"]
    ts = [e["ts"] for e in evs if isinstance(e.get("ts"), (int, float))]
    shift = (max(ts) - min(ts)) + 1000
    copy = []
    for e in json.loads(json.dumps(evs)):
        if e.get("ph") == "M":
            continue
        if isinstance(e.get("ts"), (int, float)):
            e["ts"] += shift
        a = e.get("args")
        if isinstance(a, dict):
            for k in ("correlation", "External id"):
                if isinstance(a.get(k), int):
                    a[k] += 10**7
        copy.append(e)
    doc["traceEvents"] = evs + copy
    return json.dumps(doc, indent=1).encode()


def _garble(text: bytes, every: int = 2, start: float = 0.1) -> bytes:
    """From ``start`` on, one byte of every ``every``-th event replaced by ``#``: thousands of
    unreadable objects in a row, as a mid-stream gzip corruption that zlib does not catch
    leaves them (issue 15's hang)."""
    import re

    rng = random.Random(0)
    i0 = int(len(text) * start)
    out = bytearray(text[:i0])
    for k, piece in enumerate(re.split(rb"(?<=\}),\s*(?=\{)", text[i0:])):
        marks = [m.start() for m in re.finditer(rb'[":,]', piece)] if k % every == 0 else []
        if marks:  # a quote, colon or comma: the object no longer parses
            j = rng.choice(marks)
            piece = piece[:j] + b"#" + piece[j + 1 :]
        out += piece + b",\n"
    return bytes(out)


def salvage_timing(timeout: float) -> int:
    """Ingest time of an intact ~30 MB trace and of damaged copies (one byte flipped in the
    compressed stream or in the text; every other event garbled from 10% on), each in a child
    process under ``timeout``; the damaged ones must stay within a small multiple of intact."""
    text = _big_trace()
    with tempfile.TemporaryDirectory(prefix="salvage_") as tmp_s:
        tmp = Path(tmp_s)
        intact = tmp / "big.json.gz"
        data = gzip.compress(text, 6)
        intact.write_bytes(data)
        rows = [("intact", intact)]
        for frac in (0.3, 0.7):
            b = bytearray(data)
            b[int(len(b) * frac)] ^= 0x10
            p = tmp / f"flip_{int(frac * 100)}.json.gz"
            p.write_bytes(bytes(b))
            rows.append((f"gzip byte flipped at {frac:.0%}", p))
        b = bytearray(text)
        b[len(b) // 2] ^= 0x01
        p = tmp / "flip_text.json.gz"
        p.write_bytes(gzip.compress(bytes(b), 6))
        rows.append(("JSON byte flipped at 50%", p))
        p = tmp / "garbled.json.gz"
        p.write_bytes(gzip.compress(_garble(text), 6))
        rows.append(("every 2nd event garbled", p))
        print(f"{len(text) / 1e6:.1f} MB of JSON, {len(data) / 1e6:.1f} MB gzip")
        base = None
        for label, p in rows:
            t = time.time()
            cmd = [sys.executable, "-m", "teller.cli", "ingest", str(p), "-o", str(tmp / ("run_" + p.stem))]
            try:
                r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=tmp)
                dt = time.time() - t
                base = base or dt
                last = (r.stderr.strip().splitlines() or [""])[-1][:120]
                print(f"{label:26s} {dt:7.1f} s  ({dt / base:4.1f}x intact)  rc={r.returncode}  {last}")
            except subprocess.TimeoutExpired:
                print(f"{label:26s} > {timeout:.0f} s  (hang)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
