"""What the shipped root-cause model adds to `teller diagnose`, on one CPU core, phase by phase.

    python benchmarks/bench_diagnose_model.py                           # 1M-event synthetic pair, 3 repeats
    python benchmarks/bench_diagnose_model.py --pair /tmp/pair1m        # generate once, reuse
    python benchmarks/bench_diagnose_model.py --example                 # the bundled H200 op-delay run
    python benchmarks/bench_diagnose_model.py --example --model-reads flagged   # the model reads the stage's flags only
    python benchmarks/bench_diagnose_model.py --example --model-steps 0 --explain full
    python benchmarks/bench_diagnose_model.py --pair /tmp/pair1m --worst-decode --no-baseline
    python benchmarks/bench_diagnose_model.py --pair /tmp/pair1m --plant-every 7   # ~570 flagged steps
    python benchmarks/bench_diagnose_model.py --agreement data/h200_v2     # stopped vs full explanations

The run pair is :func:`bench_diagnose.make_pair`'s (a fault-free reference and a run with planted
anomalies, about 1M canonical events each, STEP ranges from :mod:`teller.testing.synth`), or with
``--example`` ``examples/h200_faulty_op_delay`` against ``examples/h200_normal_a`` and
``examples/h200_normal_b``. The synthetic pair is diagnosed with a localizer fitted once on its
reference (``--localizer``, not timed); the example with ``--reference`` as the README runs it.

Each measurement is a fresh subprocess pinned to one core (``sched_setaffinity``, OMP / OpenBLAS /
MKL threads 1, ``torch.set_num_threads(1)``, Arrow pools 1 thread) running ``diagnose(...)``: the
numeric stage, then the model step as ``teller diagnose`` runs it (:func:`teller.report.diagnose.read_every` and
:func:`~teller.report.diagnose.write_reading` when the model reads every step, the default; :func:`~teller.report.diagnose.apply_model`
with ``--model-reads flagged``).
Inside the model step the phases are timed (wall and this process's CPU):

- ``import``: importing torch and :mod:`teller.rca.api` (the numeric stage imports neither);
- ``weights``: :meth:`RCA.load` (config, tokenizers, building the net, reading the safetensors);
- ``encode``: the flagged steps' aligned log lines, :meth:`RCA.inputs` (their subtrees of the
  forest, TPE) and :meth:`RCA.prepare` (prompt ids, duration features);
- ``heads``: the forward pass over [prompt | trace | <expl>] for the fault and operator heads;
- ``decode``: the greedy explanation of every step the fault head types (prompt and trace
  re-run once to fill the key/value cache, then one position per token);
- ``other``: the rest of ``apply_model`` (the forest's STEP rows and, now, the flagged steps' own
  rows taken from it; evidence names, grounding).

Peak memory: the kernel's resident high-water mark is reset when the model step starts
(``/proc/self/clear_refs``), so ``model_peak_growth`` is the model's own growth over the
resident size the numeric stage left. ``diagnose`` is also run with ``model=False`` in its own
fresh processes: ``end_to_end_added`` is the difference of the two commands' wall and CPU
times (best of the repeats each). Best of ``--repeat`` by the model step's wall time.

The shipped model reads the synthetic runs' steps as normal (their operators are not the H200
recordings' it learnt from), so it decodes no explanation there. Two worst cases stand in for a
run it types: ``--all-typed`` (its fault head's best type on every step it reads, so each gets an
explanation; the model then mostly writes <eos> at once) and ``--worst-decode`` (also <eos> never
chosen and no mechanism recognised: every explanation runs to the token bound of the diagnose
mode, or to ``max_expl_tokens`` with ``--explain full`` and on code without the bound).
``--plant-every N`` generates the run with a planted anomaly every N steps (make_pair's three
mechanisms; every 97 there), for more flagged steps than the model reads by default.

``--agreement DATA``: the model's predictions on DATA's split part (default: request test) with
explanations decoded to their end and stopped as ``teller diagnose`` stops them; the heads must
agree, and the mechanism diagnose keeps from each is compared unit by unit.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SINGLE = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "NUMEXPR_NUM_THREADS": "1"}

CHILD = r"""
import json, os, sys, time
os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
import pyarrow as pa
pa.set_cpu_count(1)
pa.set_io_thread_count(1)
import teller.report.diagnose as D
spec = json.loads(sys.argv[1])

def status(key):
    return [int(x.split()[1]) * 1024 for x in open("/proc/self/status") if x.startswith(key)][0]

clock = lambda: (time.perf_counter(), time.process_time())
phases = {}
def add(name, t0):
    w, c = clock()
    p = phases.setdefault(name, {"wall": 0.0, "cpu": 0.0})
    p["wall"] += w - t0[0]
    p["cpu"] += c - t0[1]

def timed(name, fn):
    def wrap(*a, **k):
        t0 = clock()
        try:
            return fn(*a, **k)
        finally:
            add(name, t0)
    return wrap

mem = {}
counts = {"decode_turns": 0, "decoded_rows": 0}
ready = []
def setup():
    # once, at the model step's start: the memory mark, torch imported, the model's phases timed
    with open("/proc/self/clear_refs", "w") as fh:  # reset VmHWM: the model's own peak from here
        fh.write("5")
    mem["rss_before_model"] = status("VmRSS:")
    t0 = clock()
    import torch
    torch.set_num_threads(1)
    import teller.rca.api as api
    add("import", t0)
    R = api.RCA
    if spec.get("worst_decode"):  # every typed step decodes to the token bound: no <eos>, no mechanism found
        _ft = R._free_token
        def no_eos(self, logits, history, *a, **k):
            lg = logits.copy()
            lg[api.EOS] = -float("inf")
            return _ft(self, lg, history, *a, **k)
        R._free_token = no_eos
        D.mechanism_written = lambda text, fault_type: False
    if spec.get("all_typed"):  # worst case for decoding: every step the model reads is typed
        _pf = api.project_fault
        def typed(probs, *a, **k):
            p_ab, ft, tp = _pf(probs, *a, **k)
            return max(p_ab, 0.5), ft or api.FAULT_TYPES[1 + int(probs[1:].argmax())], tp
        api.project_fault = typed
    R.load = classmethod(timed("weights", R.load.__func__))
    R.inputs = timed("encode", R.inputs)
    R.prepare = timed("encode", R.prepare)
    D._step_logs = timed("encode", D._step_logs)
    _fwd, _dec, _free = R._forward, R._decode_cached, R._free_token
    def fwd(self, *a, **k):
        t0 = clock()
        try:
            return _fwd(self, *a, **k)
        finally:
            add("heads", t0)
    def dec(self, prep, idx, *a, **k):
        counts["decoded_rows"] += len(idx)
        t0 = clock()
        try:
            return _dec(self, prep, idx, *a, **k)
        finally:
            add("decode", t0)
    def free(self, *a, **k):
        counts["decode_turns"] += 1
        return _free(self, *a, **k)
    R._forward, R._decode_cached, R._free_token = fwd, dec, free

def model_step(fn):
    # fn (apply_model, or read_every and write_reading when the model reads every step) timed as the model step
    def wrap(*a, **k):
        t_all = clock()
        if not ready:
            ready.append(True)
            setup()
        try:
            return fn(*a, **k)
        finally:
            add("model", t_all)
            mem["model_hwm"] = status("VmHWM:")
    return wrap

D.apply_model, D.read_every, D.write_reading = map(model_step, (D.apply_model, D.read_every, D.write_reading))

kw = dict(spec["kw"])
w0, c0 = clock()
d = D.diagnose(spec["run"], out=spec["out"], **kw)
wall, cpu = time.perf_counter() - w0, time.process_time() - c0
s = d["summary"]
out = {"wall": wall, "cpu": cpu, "steps": s["steps"], "steps_flagged": s["steps_flagged"],
       "seconds": s["seconds"], "hwm": status("VmHWM:"), **mem, **counts}
if kw.get("model") is not False:
    ph = {k: v for k, v in phases.items()}
    inner = sum(ph[k]["wall"] for k in ph if k != "model")
    ph["other"] = {"wall": ph["model"]["wall"] - inner,
                   "cpu": ph["model"]["cpu"] - sum(ph[k]["cpu"] for k in ph if k != "model")}
    out["phases"] = ph
    out["model_info"] = d.get("model")
    out["model_read"] = (d.get("model") or {}).get("steps_read", 0)
    out["model_typed"] = sum(1 for x in d["steps"] if x.get("fault_type") and not x.get("model_says_normal"))
    out["mechanisms"] = {str(x["step_num"]) + "/" + str(x["rank"]): x.get("explanation_model")
                         for x in d["steps"] if "model_unknown_share" in x}
print(json.dumps(out))
"""


def agreement(args: argparse.Namespace) -> int:
    """The mechanism diagnose keeps, from explanations decoded to their end and from explanations
    stopped once it is written (``explain="mechanism"``: :func:`mechanism_written`, at most
    :data:`MECHANISM_TOKENS` tokens), on a labelled dataset's split part: how often they agree,
    and the decoding time of each (one thread)."""
    import re

    import numpy as np
    import torch

    torch.set_num_threads(1)
    from teller.inject.mechanisms import registry
    from teller.rca import DEFAULT_MODEL, load
    from teller.rca.data import load_dataset
    from teller.rca.train import prepare_units
    from teller.report.diagnose import _MECH_WORD, MECHANISM_TOKENS, MODEL_BATCH, mechanism_written

    m = load(DEFAULT_MODEL)
    ds = load_dataset(args.agreement)
    idx = ds.units.part(args.split, args.part)
    prep, _ = prepare_units(ds, idx, m.cfg, m.text_tok, m.trace_tok, m.ref, labels=False)
    reg = registry()

    def mech(p: dict) -> str | None:  # what teller.report.diagnose._ground keeps
        return next((w for w in _MECH_WORD.findall(p["explanation"] or "") if w in reg and reg[w].category == p["fault_type"]),
                    None) if p["fault_type"] else None

    out = {}
    bound = args.mechanism_tokens or MECHANISM_TOKENS
    for name, kw in (("full", {}), ("mechanism", {"explain_done": mechanism_written, "explain_tokens": bound})):
        t0, c0 = time.perf_counter(), time.process_time()
        pred = m.predict(prep, batch_size=MODEL_BATCH, **kw)
        out[name] = {"pred": pred, "wall": time.perf_counter() - t0, "cpu": time.process_time() - c0}
    a, b = out["full"]["pred"], out["mechanism"]["pred"]
    same_heads = all(x["fault_type"] == y["fault_type"] and x["evidence_node_ids"] == y["evidence_node_ids"]
                     for x, y in zip(a, b, strict=True))
    typed = [k for k, x in enumerate(a) if x["fault_type"]]
    ma, mb = [mech(a[k]) for k in typed], [mech(b[k]) for k in typed]
    agree = sum(x == y for x, y in zip(ma, mb, strict=True))
    words = [len(re.findall(r"\S+", a[k]["explanation"])) for k in typed]
    res = {"data": str(args.agreement), "split": args.split, "part": args.part, "explain_tokens": bound,
           "units": len(a), "typed": len(typed),
           "same_heads": same_heads, "with_mechanism_full": sum(x is not None for x in ma),
           "with_mechanism_stopped": sum(x is not None for x in mb), "mechanism_agrees": agree,
           "disagreements": [{"unit": int(idx[typed[k]]), "full": ma[k], "stopped": mb[k]}
                             for k in range(len(typed)) if ma[k] != mb[k]][:20],
           "full_explanation_words_median": float(np.median(words)) if words else 0.0,
           "seconds": {k: {"wall": round(v["wall"], 2), "cpu": round(v["cpu"], 2)} for k, v in out.items()}}
    print(json.dumps(res, indent=1))
    if args.out:
        args.out.write_text(json.dumps(res, indent=1))
    return 0


def dense_pair(where: Path, n_events: int, every: int) -> tuple[Path, Path]:
    """``where/ref`` (reused when it is there) and ``where/dense{every}``: make_pair's run with the
    same three mechanisms planted every ``every`` steps instead of every 97."""
    from teller.reconstruct import reconstruct
    from teller.testing.planted import Plant, write_planted_run

    ref, bad = where / "ref", where / f"dense{every}"
    scale = 1.31  # as make_pair
    if not (ref / "reconstruct.json").is_file():
        write_planted_run(ref, int(n_events * scale), [], seed=1)
        reconstruct(ref)
    if not (bad / "reconstruct.json").is_file():
        n = json.loads((ref / "reconstruct.json").read_text())["steps"]
        steps = list(range(50, n - 50, every))
        plants = [Plant("BE aten::mul", steps[0::3], "host", 4.0), Plant("BE aten::linear", steps[1::3], "kernel", 4.0),
                  Plant("BE aten::silu", steps[2::3], "churn", 4.0)]
        write_planted_run(bad, int(n_events * scale), plants, seed=2)
        reconstruct(bad)
    return ref, bad


def child(spec: dict) -> dict:
    env = {**os.environ, **SINGLE, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run([sys.executable, "-c", CHILD, json.dumps(spec)], env=env, capture_output=True, text=True)
    if r.returncode:
        sys.stderr.write(r.stderr)
        raise SystemExit(f"child failed ({r.returncode})")
    return json.loads(r.stdout.strip().splitlines()[-1])


def model_kw(args: argparse.Namespace) -> dict:
    """Options of the model step (those ``diagnose`` has in this version)."""
    import inspect

    from teller.report.diagnose import diagnose

    kw = {}
    params = inspect.signature(diagnose).parameters
    if args.model_steps is not None and "model_steps" in params:
        kw["model_steps"] = args.model_steps
    if args.explain is not None and "model_explain" in params:
        kw["model_explain"] = args.explain
    if args.model_reads is not None and "model_reads" in params:
        kw["model_reads"] = args.model_reads
    return kw


def best(rows: list[dict], key) -> dict:
    return min(rows, key=key)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--example", action="store_true", help="the bundled H200 op-delay run against the two normal ones")
    ap.add_argument("--events", type=float, default=1e6)
    ap.add_argument("--pair", type=Path, default=None, help="keep / reuse the generated pair in this folder")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=None)
    ap.add_argument("--model-steps", type=int, default=None,
                    help="diagnose(model_steps=K): the model reads the K highest-scored flagged steps (0: all)")
    ap.add_argument("--model-reads", default=None, choices=("every", "flagged"),
                    help="diagnose(model_reads=...): the model reads every step (the default) or the flagged ones")
    ap.add_argument("--explain", default=None, choices=("mechanism", "full"),
                    help="diagnose(model_explain=...): 'mechanism' (stop at what diagnose keeps) or 'full'")
    ap.add_argument("--all-typed", action="store_true",
                    help="worst case for decoding: the fault head's verdict replaced by its best type on every step "
                         "(an explanation decoded for each; the synthetic runs are off the model's training data, "
                         "which reads them as normal)")
    ap.add_argument("--worst-decode", action="store_true",
                    help="worst case for decoding: --all-typed, <eos> never chosen and no mechanism recognised, so "
                         "every read step decodes its explanation to the token bound")
    ap.add_argument("--plant-every", type=int, default=None,
                    help="generate the run with a planted anomaly every N steps (more flagged steps than the bound)")
    ap.add_argument("--no-baseline", action="store_true", help="skip the model=False runs")
    ap.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    ap.add_argument("--agreement", type=Path, default=None, metavar="DATA",
                    help="instead: the mechanism kept from full and from stopped explanations on DATA's split part")
    ap.add_argument("--mechanism-tokens", type=int, default=None, help="with --agreement: the token bound (default diagnose's)")
    ap.add_argument("--split", default="request")
    ap.add_argument("--part", default="test")
    args = ap.parse_args(argv)
    if args.agreement is not None:
        return agreement(args)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    sys.path.insert(0, str(ROOT))
    t_start = time.perf_counter()
    load0 = os.getloadavg()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmpd:
        tmp = Path(tmpd)
        if args.example:
            ex = ROOT / "examples"
            run = tmp / "h200_faulty_op_delay"
            import shutil

            for n in ("h200_faulty_op_delay", "h200_normal_a", "h200_normal_b"):
                shutil.copytree(ex / n, tmp / n)
            base = {"reference": [str(tmp / "h200_normal_a"), str(tmp / "h200_normal_b")]}
            # reconstruct once (not timed): diagnose would do it in the first child only
            from teller.reconstruct.ensure import ensure_reconstructed

            for n in ("h200_faulty_op_delay", "h200_normal_a", "h200_normal_b"):
                ensure_reconstructed(tmp / n, None, None)
            what = "examples/h200_faulty_op_delay --reference examples/h200_normal_a --reference examples/h200_normal_b"
            events = None
        else:
            from bench_diagnose import make_pair

            if args.plant_every:
                ref, run = dense_pair(args.pair or tmp, int(args.events), args.plant_every)
            elif args.pair is not None and (args.pair / "bad" / "reconstruct.json").is_file():
                ref, run = args.pair / "ref", args.pair / "bad"
            else:
                where = args.pair or tmp
                where.mkdir(parents=True, exist_ok=True)
                print(f"generating and reconstructing two runs of {args.events:g} events", file=sys.stderr)
                ref, run, _, _ = make_pair(where, int(args.events))
            from teller.localize import fit_localizer

            art = tmp / "loc.npz"
            fit_localizer([ref]).save(art)
            base = {"localizer": str(art)}
            events = json.loads((run / "reconstruct.json").read_text())["events_in"]
            what = f"synthetic pair ({events:,} events; {run}) --localizer (fitted on its reference)"
        extra = model_kw(args)
        rows_m, rows_n = [], []
        for i in range(args.repeat):
            print(f"model run {i + 1}/{args.repeat}", file=sys.stderr)
            rows_m.append(child({"run": str(run), "out": str(tmp / "out_m"), "kw": {**base, "model": None, **extra},
                                 "all_typed": args.all_typed or args.worst_decode, "worst_decode": args.worst_decode}))
            if not args.no_baseline:
                rows_n.append(child({"run": str(run), "out": str(tmp / "out_n"), "kw": {**base, "model": False}}))
    m = best(rows_m, lambda r: r["phases"]["model"]["wall"])
    res = {"what": what, "events": events, "options": extra, "all_typed": args.all_typed, "worst_decode": args.worst_decode, "repeat": args.repeat,
           "loadavg": {"start": load0, "end": os.getloadavg()}, "model": m,
           "model_wall_all": [round(r["phases"]["model"]["wall"], 3) for r in rows_m]}
    if rows_n:
        bm, bn = best(rows_m, lambda r: r["wall"]), best(rows_n, lambda r: r["wall"])
        res["numeric"] = bn
        res["end_to_end_added"] = {"wall": bm["wall"] - bn["wall"], "cpu": best(rows_m, lambda r: r["cpu"])["cpu"]
                                   - best(rows_n, lambda r: r["cpu"])["cpu"]}
    print(json.dumps({k: v for k, v in res.items()}, indent=1))
    if args.out:
        args.out.write_text(json.dumps(res, indent=1))
    g = 2**30
    ph = m["phases"]
    print(f"\n{what}; options {extra or 'default'}{'; every read step typed (--all-typed)' if args.all_typed else ''}{'; every read step typed and decoded to the token bound (--worst-decode)' if args.worst_decode else ''}; best of {args.repeat} (model step wall: {res['model_wall_all']})")
    print(f"flagged {m['steps_flagged']} of {m['steps']} steps; the model read {m['model_read']}, typed {m['model_typed']}, "
          f"decoded {m['decoded_rows']} explanations in {m['decode_turns']} token turns")
    print("\n| phase | wall s | CPU s |\n|---|---:|---:|")
    for k in ("import", "weights", "encode", "heads", "decode", "other", "model"):
        if k in ph:
            print(f"| {'model step, total' if k == 'model' else k} | {ph[k]['wall']:.2f} | {ph[k]['cpu']:.2f} |")
    print(f"\nmodel step peak RSS growth {(m['model_hwm'] - m['rss_before_model']) / g:.3f} GiB "
          f"(resident {m['rss_before_model'] / g:.2f} GiB before it, process peak {m['hwm'] / g:.2f} GiB)")
    if "end_to_end_added" in res:
        e = res["end_to_end_added"]
        print(f"diagnose with the model {res['model']['wall']:.2f} s wall / without {res['numeric']['wall']:.2f} s: "
              f"adds {e['wall']:.2f} s wall, {e['cpu']:.2f} s CPU (best of each)")
    print(f"load average {load0[0]:.1f} at the start, {os.getloadavg()[0]:.1f} at the end "
          f"({time.perf_counter() - t_start:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
