"""Campaign specs (TOML): workload, fault schedule, repetitions. Errors name the field.

A spec::

    [campaign]
    name = "cpu_smoke"
    seed = 0            # fixes request arrivals (workload seed + repetition) and the splits
    repetitions = 1     # every run is recorded this many times (run ids get -r<k>)
    collector = "cpu"   # teller record --collector
    be_depth = 1
    timeout_s = 120     # the workload's own --timeout

    [workload]          # defaults for every run
    kind = "serve"      # serve (transformers continuous batching) | serve-tp (2-rank gloo/NCCL)
    device = "cpu"
    requests = 12
    rate = 30.0
    output_len = "12"

    [[runs]]
    name = "normal"

    [[runs]]
    name = "op_delay"
    workload = { requests = 16 }        # per-run overrides
    [[runs.faults]]
    mechanism = "targeted_op_delay"     # see `teller inject mechanisms`
    magnitude = 2000                    # the mechanism's knob (default: its default)
    start_s = 0.2                       # after the engine's first step (or start_step = N)
    duration_s = 0.6                    # omitted: until the run ends (or steps = N)
    targets = ["MLP"]                   # operator class suffixes (default: the mechanism's)
    rank = 0                            # only this rank (default: the mechanism's default_rank, every rank for most; co-located: 0)
    params = {}                         # mechanism-specific extras
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from teller.errors import InputError
from teller.inject.mechanisms import registry
from teller.record.launcher import COLLECTOR_CHOICES

WORKLOAD_KINDS = ("serve", "serve-tp")
#: workload keys accepted per kind (mapped to ``--key-with-dashes`` of `teller workload ...`)
SERVE_KEYS = {"device", "preset", "layers", "hidden", "heads", "kv_heads", "intermediate", "vocab", "dtype",
              "requests", "rate", "prompt_len", "output_len", "seed", "attn", "duration", "warmup",
              "max_batch_tokens", "num_blocks", "timeout", "threads", "max_extra_requests"}
TP_KEYS = {"device", "layers", "hidden", "heads", "intermediate", "vocab", "requests", "arrivals_per_step",
           "prompt_len", "output_len", "seed", "tp", "backend", "threads", "max_batch", "timeout"}
CAMPAIGN_KEYS = {"name", "seed", "repetitions", "collector", "be_depth", "timeout_s", "description"}
RUN_KEYS = {"name", "workload", "faults", "repetitions", "description"}
FAULT_KEYS = {"mechanism", "magnitude", "start_s", "duration_s", "start_step", "steps", "targets", "rank", "params"}


@dataclass
class FaultSpec:
    """One scheduled fault of a run."""

    mechanism: str
    category: str
    magnitude: float
    start_s: float | None = 0.0
    duration_s: float | None = None
    start_step: int | None = None
    steps: int | None = None
    targets: list[str] = field(default_factory=list)
    rank: int | None = None
    params: dict[str, Any] = field(default_factory=dict)

    def to_plan(self, fid: str) -> dict[str, Any]:
        return {"id": fid, "mechanism": self.mechanism, "category": self.category, "magnitude": self.magnitude,
                "start_s": self.start_s, "duration_s": self.duration_s, "start_step": self.start_step,
                "steps": self.steps, "targets": list(self.targets), "rank": self.rank, "params": dict(self.params)}


@dataclass
class RunSpec:
    name: str
    workload: dict[str, Any]
    faults: list[FaultSpec] = field(default_factory=list)
    repetitions: int = 1


@dataclass
class Campaign:
    name: str
    path: str
    seed: int = 0
    repetitions: int = 1
    collector: str = "cpu"
    be_depth: int = 1
    timeout_s: float = 300.0
    workload: dict[str, Any] = field(default_factory=dict)
    runs: list[RunSpec] = field(default_factory=list)
    description: str = ""


def _err(path: Any, where: str, what: str, fix: str) -> InputError:
    return InputError(path, f"{where}: {what}", fix)


def _typed(path: Any, where: str, v: Any, kinds: tuple[type, ...], what: str) -> Any:
    if isinstance(v, bool) and bool not in kinds:
        raise _err(path, where, f"expected {what}, got {v!r}", f"set {where} to {what}")
    if not isinstance(v, kinds):
        raise _err(path, where, f"expected {what}, got {type(v).__name__} {v!r}", f"set {where} to {what}")
    return v


def _unknown(path: Any, where: str, d: dict[str, Any], allowed: set[str]) -> None:
    extra = sorted(set(d) - allowed)
    if extra:
        key = f"{where}.{extra[0]}" if where else extra[0]
        raise _err(path, key, "unknown key", f"remove it or use one of: {', '.join(sorted(allowed))}")


def parse_spec(text: str, path: str | Path = "<spec>") -> Campaign:
    """Parse and validate a campaign spec; raises :class:`InputError` naming the bad field."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise InputError(path, f"not valid TOML ({e})", "fix the syntax") from None
    _unknown(path, "", doc, {"campaign", "workload", "runs"})
    c = doc.get("campaign", {})
    _typed(path, "campaign", c, (dict,), "a table")
    _unknown(path, "campaign", c, CAMPAIGN_KEYS)
    name = _typed(path, "campaign.name", c.get("name", Path(str(path)).stem), (str,), "a string")
    seed = _typed(path, "campaign.seed", c.get("seed", 0), (int,), "an integer")
    reps = _typed(path, "campaign.repetitions", c.get("repetitions", 1), (int,), "an integer ≥ 1")
    if reps < 1:
        raise _err(path, "campaign.repetitions", f"{reps} < 1", "set it to 1 or more")
    coll = _typed(path, "campaign.collector", c.get("collector", "auto"), (str,), "a collector name")
    if coll not in COLLECTOR_CHOICES:
        raise _err(path, "campaign.collector", f"unknown collector {coll!r}", f"use one of {', '.join(COLLECTOR_CHOICES)}")
    be_depth = _typed(path, "campaign.be_depth", c.get("be_depth", 1), (int,), "an integer ≥ 0")
    timeout = float(_typed(path, "campaign.timeout_s", c.get("timeout_s", 300.0), (int, float), "seconds"))
    wl = doc.get("workload", {})
    _typed(path, "workload", wl, (dict,), "a table")
    base = _workload(path, "workload", wl, None)
    runs_doc = doc.get("runs")
    if not runs_doc:
        raise _err(path, "runs", "no runs", "add at least one [[runs]] table with a name")
    _typed(path, "runs", runs_doc, (list,), "an array of tables ([[runs]])")
    reg = registry()
    runs, names = [], set()
    for i, r in enumerate(runs_doc):
        where = f"runs[{i}]"
        _typed(path, where, r, (dict,), "a table")
        _unknown(path, where, r, RUN_KEYS)
        rname = _typed(path, f"{where}.name", r.get("name", ""), (str,), "a non-empty name")
        if not rname or not all(ch.isalnum() or ch in "-_." for ch in rname):
            raise _err(path, f"{where}.name", f"{rname!r} is not a usable run name",
                       "use letters, digits, '-', '_' or '.' (it becomes a directory name)")
        if rname in names:
            raise _err(path, f"{where}.name", f"duplicate run name {rname!r}", "give every run its own name")
        names.add(rname)
        over = r.get("workload", {})
        _typed(path, f"{where}.workload", over, (dict,), "a table")
        w = _workload(path, f"{where}.workload", over, base)
        rrep = _typed(path, f"{where}.repetitions", r.get("repetitions", reps), (int,), "an integer ≥ 1")
        if rrep < 1:
            raise _err(path, f"{where}.repetitions", f"{rrep} < 1", "set it to 1 or more")
        faults = []
        fl = r.get("faults", [])
        _typed(path, f"{where}.faults", fl, (list,), "an array of tables ([[runs.faults]])")
        for j, f in enumerate(fl):
            faults.append(_fault(path, f"{where}.faults[{j}]", f, reg, w))
        runs.append(RunSpec(name=rname, workload=w, faults=faults, repetitions=rrep))
    return Campaign(name=name, path=str(path), seed=seed, repetitions=reps, collector=coll, be_depth=be_depth,
                    timeout_s=timeout, workload=base, runs=runs, description=str(c.get("description", "")))


def _workload(path: Any, where: str, d: dict[str, Any], base: dict[str, Any] | None) -> dict[str, Any]:
    out = dict(base or {"kind": "serve"})
    kind = d.get("kind", out.get("kind", "serve"))
    if base is not None and kind != base.get("kind", "serve"):  # another workload: keep only its keys
        keys = SERVE_KEYS if kind == "serve" else TP_KEYS
        out = {k: v for k, v in out.items() if k in keys}
    out.update(d)
    out["kind"] = kind
    if kind not in WORKLOAD_KINDS:
        raise _err(path, f"{where}.kind", f"unknown workload {kind!r}", f"use one of {', '.join(WORKLOAD_KINDS)}")
    allowed = (SERVE_KEYS if kind == "serve" else TP_KEYS) | {"kind", "args"}
    _unknown(path, where, {k: v for k, v in out.items() if k in d or base is None}, allowed)
    bad = sorted(set(out) - allowed)
    if bad:
        raise _err(path, f"{where}.{bad[0]}", f"not a key of the {kind} workload",
                   f"remove it or use one of: {', '.join(sorted(allowed))}")
    for k, v in out.items():
        if k == "args":
            if not (isinstance(v, list) and all(isinstance(a, str) for a in v)):
                raise _err(path, f"{where}.args", "expected a list of strings", 'write e.g. args = ["--attn", "eager"]')
        elif not isinstance(v, (str, int, float)) or isinstance(v, bool):
            raise _err(path, f"{where}.{k}", f"expected a string or number, got {v!r}", "use a scalar value")
    if "requests" in out and (not isinstance(out["requests"], int) or out["requests"] < 1):
        raise _err(path, f"{where}.requests", f"{out['requests']!r} is not a positive integer", "set it to 1 or more")
    if "rate" in out and (not isinstance(out["rate"], (int, float)) or out["rate"] < 0):
        raise _err(path, f"{where}.rate", f"{out['rate']!r} is negative", "use requests/s ≥ 0")
    return out


def _fault(path: Any, where: str, f: Any, reg: dict[str, Any], workload: dict[str, Any]) -> FaultSpec:
    _typed(path, where, f, (dict,), "a table")
    _unknown(path, where, f, FAULT_KEYS)
    mech = f.get("mechanism")
    if mech is None:
        raise _err(path, f"{where}.mechanism", "missing", f"name one of: {', '.join(sorted(reg))}")
    if mech not in reg:
        raise _err(path, f"{where}.mechanism", f"unknown mechanism {mech!r}", f"use one of: {', '.join(sorted(reg))}")
    m = reg[mech]
    mag = f.get("magnitude", m.default_magnitude)
    _typed(path, f"{where}.magnitude", mag, (int, float), f"a number ({m.knob})")
    if mag <= 0:
        raise _err(path, f"{where}.magnitude", f"{mag} ≤ 0", f"give a positive {m.knob}")
    start_s = f.get("start_s")
    start_step = f.get("start_step")
    if start_s is not None and start_step is not None:
        raise _err(path, f"{where}.start_step", "given together with start_s", "anchor the window in seconds or in steps, not both")
    if start_s is not None:
        _typed(path, f"{where}.start_s", start_s, (int, float), "seconds ≥ 0")
        if start_s < 0:
            raise _err(path, f"{where}.start_s", f"{start_s} < 0", "use seconds ≥ 0 after the first step")
    if start_step is not None:
        _typed(path, f"{where}.start_step", start_step, (int,), "a step index ≥ 0")
        if start_step < 0:
            raise _err(path, f"{where}.start_step", f"{start_step} < 0", "use a step index ≥ 0")
    dur, steps = f.get("duration_s"), f.get("steps")
    if dur is not None:
        _typed(path, f"{where}.duration_s", dur, (int, float), "seconds > 0")
        if dur <= 0 or start_step is not None:
            raise _err(path, f"{where}.duration_s", f"{dur} not usable here",
                       "give seconds > 0 with start_s (with start_step use steps = N)")
    if steps is not None:
        _typed(path, f"{where}.steps", steps, (int,), "a step count ≥ 1")
        if steps < 1 or start_step is None:
            raise _err(path, f"{where}.steps", f"{steps} not usable here", "give steps ≥ 1 together with start_step")
    if mech == "throttled_collective" and start_step is None:
        raise _err(path, f"{where}.start_step", "missing for throttled_collective",
                   "anchor it in steps (start_step, steps) so every rank chunks the same collectives")
    if m.where == "workload" and (start_s not in (None, 0) or dur is not None or start_step is not None):
        raise _err(path, f"{where}.start_s", f"{mech} acts through the workload's configuration for the whole run",
                   "drop start_s/duration_s/start_step/steps for it")
    targets = f.get("targets", list(m.targets))
    if not (isinstance(targets, list) and all(isinstance(t, str) and t for t in targets)):
        raise _err(path, f"{where}.targets", f"expected a list of operator names, got {targets!r}", 'write e.g. targets = ["MLP"]')
    rank = f.get("rank")
    if rank is not None:
        _typed(path, f"{where}.rank", rank, (int,), "a rank ≥ 0")
        tp = int(workload.get("tp", 2)) if workload.get("kind") == "serve-tp" else 1
        if not 0 <= rank < tp:
            raise _err(path, f"{where}.rank", f"rank {rank} does not exist (world size {tp})", f"use 0..{tp - 1}")
    elif m.where == "co_located":
        rank = 0
    else:
        rank = m.default_rank
    params = f.get("params", {})
    _typed(path, f"{where}.params", params, (dict,), "a table")
    if start_s is None and start_step is None:
        start_s = 0.0
    return FaultSpec(mechanism=mech, category=m.category, magnitude=float(mag), start_s=start_s, duration_s=dur,
                     start_step=start_step, steps=steps, targets=list(targets), rank=rank, params=dict(params))


def load_spec(path: str | Path) -> Campaign:
    """Read and validate a campaign spec file."""
    p = Path(path)
    if not p.is_file():
        raise InputError(p, "no such campaign spec", "give the path of a .toml spec (see campaigns/)")
    return parse_spec(p.read_text(encoding="utf-8"), p)
