"""The HTML report of a diagnosis: one static, self-contained page (inline CSS and SVG; no script,
font, image or style sheet fetched from anywhere), readable opened from a file with no network.

The page reads top to bottom:

1. **Verdict**: how many steps are abnormal and, per group of flagged steps with the same verdict
   (fault type, evidence operators), the fault type with its probability, the evidence operators
   and the one-sentence explanation (the root-cause model's, else the numeric stage's strongest
   measurement).
2. **Timeline**: every step of the run as a bar on one lane per rank, coloured by its score,
   flagged steps outlined and marked; hovering a bar names the step, its duration and score, and a
   flagged bar links to its evidence.
3. **Evidence** of each flagged step (in the verdict's order, worst first within a group; a
   collapsible section each, anchored ``#step-INDEX`` with ``index`` as in diagnosis.json): the
   suspects with what was measured against the reference, and the causal slice as a collapsible
   tree of its most relevant operators, each with its observed duration next to the reference's
   typical one (``reference_dur_ns``).
4. **Legend**: every term, abbreviation and layer tag the page shows, in words.

Big runs stay readable: the timeline bins steps when a lane holds more than
:data:`MAX_BARS_PER_LANE`, at most :data:`MAX_DETAILED_STEPS` flagged steps get an evidence
section (the others a row in a table of at most :data:`MAX_TABLE_ROWS`), trees show at most
:data:`MAX_TREE_NODES` nodes; every cut is said where it happens and in the page's last section.
All text taken from the diagnosis is HTML-escaped.
"""

from __future__ import annotations

import math
import os
import re
from html import escape
from pathlib import Path
from typing import Any

from teller.inspect.tree import fmt_ns
from teller.localize.episodes import EPISODE_GAP
from teller.localize.features import ITER_FEATURES
from teller.rca import SCREEN_FLOOR
from teller.rca.schema import ABNORMAL_CUT

#: steps drawn one bar each per rank lane; beyond that, neighbouring steps share a bar
MAX_BARS_PER_LANE = 1500
#: rank lanes drawn in the timeline
MAX_LANES = 32
#: flagged steps marked individually on the timeline
MAX_MARKERS = 400
#: flagged steps with a full evidence section (in the order of the verdict)
MAX_DETAILED_STEPS = 25
#: rows of the table of the other flagged steps
MAX_TABLE_ROWS = 500
#: lines about the input (partial run, repairs, reader warnings) shown above the verdict
MAX_HEALTH_LINES = 8
#: verdict groups shown; steps named per group
MAX_GROUPS = 12
#: cards of the numeric stage's own verdict groups (steps with the same first suspect); the other
#: steps it flags share one card
MAX_NUMERIC_CARDS = 4
MAX_STEPS_PER_GROUP = 30
#: suspects listed per step; nodes per evidence tree
MAX_SUSPECTS = 8
MAX_TREE_NODES = 40
MAX_REQUESTS = 20
#: a suspect's calls are shown folded when it has more than this many
FOLD_OVER = 12

#: iteration features that are durations in ns (the ``iter.*`` ones; the ``batch.*`` ones are counts)
_ITER_NS = tuple(f for f in ITER_FEATURES if f.startswith("iter."))
#: operator names longer than this are shortened on the page (in full in their hover title)
MAX_NAME = 72

#: layer tags (docs/design.md §4) in words
LAYER_WORDS = {
    "STEP": "engine step (one scheduler iteration)",
    "FE": "framework module (e.g. a model layer such as LlamaMLP)",
    "BE": "backend operator (an aten:: op or a library call)",
    "COMM": "collective communication (NCCL / gloo)",
    "RT": "CUDA runtime call",
    "DRV": "CUDA driver call",
    "K": "GPU kernel",
    "MEM": "GPU memory copy or memset",
    "SYNC": "synchronisation (stream, event or device)",
    "OTHER": "other traced range (scheduling, batch update, ...)",
    "GAP": "untraced time inside an iteration",
}

#: features of the numeric stage (teller.localize.features) in words
FEATURE_WORDS = {
    "dur_ns": "duration",
    "self_ns": "self time (not spent in traced children)",
    "rt_ns": "time in CUDA runtime calls",
    "rt_n": "number of CUDA runtime calls",
    "drv_ns": "time in CUDA driver calls",
    "drv_n": "number of CUDA driver calls",
    "k_n": "number of GPU kernels launched",
    "k_ns": "GPU kernel time",
    "mem_bytes": "bytes copied or set on the GPU",
    "mem_ns": "GPU copy and memset time",
    "sync_ns": "time waiting in synchronisations",
    "overlap": "share of GPU time overlapped with other work",
    "comm_bytes": "bytes moved by collectives",
    "memcpy_sync_n": "synchronous copies",
    "memcpy_sync_ns": "time in synchronous copies",
    "memcpy_async_n": "asynchronous copies",
    "memcpy_async_ns": "time in asynchronous copies",
    "pageable_n": "copies from pageable host memory",
    "stream_sync_n": "stream synchronisations",
    "stream_sync_ns": "time in stream synchronisations",
    "device_sync_n": "device synchronisations",
    "device_sync_ns": "time in device synchronisations",
    "alloc_n": "device memory allocations",
    "alloc_ns": "time in device memory allocations",
    "iter.dur": "iteration duration",
    "iter.gap": "idle gap before the iteration",
    "iter.schedule": "scheduling time of the iteration",
    "iter.post": "post-processing time of the iteration",
    "iter.host_busy": "host busy time of the iteration",
    "iter.gpu_busy": "GPU busy time of the iteration",
    "batch.n_requests": "requests in the batch",
    "batch.prefill": "prefill requests in the batch",
    "batch.decode": "decode requests in the batch",
    "batch.waiting": "requests waiting",
    "batch.kv_frac": "share of the KV cache in use",
    "batch.preempted": "preempted requests",
    "iter.admit_delay": "time a newly admitted request had arrived but was not queued",
    "family": "operator family",
}

_TERMS = {
    "score": ("score", "the numeric stage's anomaly score of a step, 0 (like the reference) to 1 "
                       "(far outside it), from how far its operators lie from the reference"),
    "flagged": ("flagged", "an abnormal step: one the root-cause model flags (its abnormal probability from its cut, "
                           "or at even odds next to an episode of its flags), or whose score passed the numeric stage's "
                           "threshold"),
    "fault probability": ("fault probability", "the root-cause model's probability of the fault type it "
                                               "names, given that the step is abnormal"),
    "abnormal probability": ("abnormal probability", "the root-cause model's probability that the step is "
                                                     "abnormal at all"),
    "novelty": ("novelty", "how unlike every step the root-cause model was trained on a step is: its distance "
                           "to the 5th nearest training step over what 99 in 100 held-out steps reach (above 1: "
                           "a kind of step the model never saw, whose fault type is then the numeric evidence's "
                           "where such steps last)"),
    "evidence operators": ("evidence operators", "the operators of the step the root-cause model names as "
                                                 "the fault's location (else the numeric stage's suspects, "
                                                 "lifted to their framework module)"),
    "suspect": ("suspect", "an operator instance of the step that the reference cannot explain"),
    "anomaly": ("anomaly", "how unexplained a suspect is, 0 to 1 (1: outside every normal mode of its "
                           "operator family in the reference)"),
    "observed": ("observed", "the value measured in this run"),
    "reference": ("reference", "the typical value of the same operator in the fault-free reference runs, at "
                               "the step's batch size: for a suspect's measures the centre of the normal mode "
                               "it lies nearest to, in the evidence tree the operator's median duration"),
    "ratio": ("ratio", "observed divided by reference (×)"),
    "deviation": ("deviation", "distance from the reference in its standard deviations (sd); "
                               "+ slower or larger, − faster or smaller"),
    "relevance": ("relevance", "how strongly a node of the evidence tree is tied to the suspects: its own "
                               "anomaly, plus being called by a suspect, running just before or after one, or "
                               "waiting for one in a collective, each weighted (0 to about 3; the slice keeps "
                               "the nodes at 0.5 or more and their callers, which may be at 0)"),
    "suspiciousness": ("suspiciousness", "how far an operator family as a whole deviates in the step, "
                                         "0 to 1"),
    "unseen": ("unseen", "an operator family the reference runs never executed"),
    "no score": ("no score", "a step with no operator instance to score (grey)"),
    "units": ("ns, µs, ms, s", "nanoseconds, microseconds, milliseconds, seconds"),
    "sd": ("sd", "standard deviations"),
    "z": ("z=", "in an explanation: the deviation from the reference in its standard deviations "
                "(the same number as “deviation”)"),
}


# ------------------------------------------------------------------------------------------------
# formatting


def _e(x: Any) -> str:
    """Escaped text (also for attribute values)."""
    return escape("" if x is None else str(x), quote=True)


def fmt_value(feature: str, v: float | None) -> str:
    """A feature value in its unit."""
    if v is None:
        return "?"
    if feature.endswith("_ns") or feature in _ITER_NS:
        return fmt_ns(v)
    if feature.endswith("bytes"):
        for unit, k in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
            if v >= k:
                return f"{v / k:.1f} {unit}"
        return f"{v:.0f} B"
    if feature in ("overlap", "batch.kv_frac"):
        return f"{100 * v:.0f}%"
    return f"{v:.3g}"


def _ratio(r: float | None) -> str:
    if r is None or not math.isfinite(r):
        return "—"
    return f"{r:.1f}×" if r < 100 else f"{r:,.0f}×"


def score_colour(s: float | None) -> str:
    """Green (0) through yellow to red (1); grey without a score."""
    if s is None:
        return "#c9ced6"
    s = min(1.0, max(0.0, float(s)))
    return f"hsl({120 * (1 - s):.0f},72%,{48 if s > 0.5 else 52}%)"


def _low_confidence(steps: list[dict[str, Any]]) -> str:
    """The warning of a card whose steps are mostly operators the model never saw (its verdict,
    typed or normal, is then a guess), or ""."""
    off = [x for x in steps if x.get("model_off_distribution")]
    if not off:
        return ""
    share = max(x.get("model_unknown_share") or 0 for x in off)
    return (f' <span class="warning">low confidence: up to {share:.0%} of the tree of '
            f'{"this step" if len(off) == 1 else f"{len(off):,} of these steps"} is operators the '
            "model never saw in training</span>")


def _fault_title(ft: str | None) -> str:
    try:
        from teller.inject import CATEGORY_TITLES
    except ImportError:  # pragma: no cover - the inject stage ships with the package
        CATEGORY_TITLES = {}
    return f"{CATEGORY_TITLES.get(ft, ft)} fault" if ft else "fault"


def _dur(step: dict[str, Any]) -> int:
    return int(step["end_ns"]) - int(step["start_ns"])


# ------------------------------------------------------------------------------------------------
# the page



def reading_words(diag: dict[str, Any]) -> str:
    """How the flagged steps came about when the model read every step (``--model-reads every``),
    in one sentence (console and report)."""
    m = diag.get("model") or {}
    steps = diag["steps"]
    model = sum(1 for d in steps if "model" in (d.get("flagged_by") or ()))
    both = sum(1 for d in steps if "model" in (d.get("flagged_by") or ()) and d.get("stage_flag"))
    lasting = sum(1 for d in steps if d.get("unknown_fault"))
    normal = sum(1 for d in steps if d.get("model_says_normal"))
    out = f"the root-cause model read {m.get('steps_read', 0):,} steps and flags {model:,}"
    if model:
        out += (f" ({m.get('sustained', 0):,} of them joined an episode of its flags at even odds; the numeric stage "
                f"flags {both:,} of them too)")
    if m.get("off_distribution"):
        out += (f"; {m['off_distribution']:,} steps are mostly operators it never saw in training, where the numeric "
                "stage's verdicts stand")
    if lasting:
        out += (f"; {lasting:,} more {'is a lasting departure' if lasting == 1 else 'are lasting departures'} of the "
                "numeric stage it does not recognise")
    if normal:
        out += f"; it reads {normal:,} of the numeric stage's other flags as normal"
    if m.get("explained", 0) < model:
        out += (f"; the {m.get('explained', 0):,} most probable have an explanation (`--model-steps N` for more, "
                "0 for all)")
    return out


def longest_episodes(diag: dict[str, Any], top: int = 3) -> list[dict[str, Any]]:
    """The ``top`` longest episodes of a diagnosis (ties: the earlier first)."""
    return sorted(diag.get("episodes") or [], key=lambda e: (-e["steps"], e["start_ns"]))[:top]


def episode_words(e: dict[str, Any]) -> str:
    """One episode in words: its steps, rank, length and the type most of its steps are given."""
    t = e.get("fault_type")
    where = f"step {e['first_step']}" if e["first_step"] == e["last_step"] else f"steps {e['first_step']}–{e['last_step']}"
    return (f"{where} on rank {e['rank']} ({e['steps']} flagged"
            + (f"; {t}, {e['type_votes'][t]} of them" if t else "") + ")")


def model_unsure(x: dict[str, Any]) -> bool:
    """Whether the root-cause model typed flagged step ``x`` while giving it less than its own cut
    (:attr:`teller.rca.api.RCA.abnormal_cut`; ``model_unsure``, or before it was written
    :data:`teller.rca.schema.ABNORMAL_CUT`): `teller diagnose` keeps such a step from the screen
    floor (:data:`teller.rca.SCREEN_FLOOR`) up, and says the model is unsure of it."""
    if "model_unsure" in x:
        return bool(x["model_unsure"])
    p = x.get("abnormal_probability")
    return bool(x.get("fault_type")) and not x.get("model_says_normal") and p is not None and p < ABNORMAL_CUT

class _Page:
    """Renders one diagnosis; remembers which legend terms, layers and features it used and what
    it cut."""

    def __init__(self, diag: dict[str, Any]):
        self.d = diag
        self.steps: list[dict[str, Any]] = list(diag.get("steps", []))
        self.flagged = sorted((s for s in self.steps if s.get("flag")), key=_worst_first)
        self.has_model = bool(diag.get("model")) and not diag["model"].get("skipped")
        self.groups = self._groups()
        # the evidence follows the verdict: group by group, worst first within each
        self.flagged = [x for g in self.groups for x in g["steps"]]
        self.terms: set[str] = set()
        self.layers: set[str] = set()
        self.features: set[str] = set()
        self.cuts: list[str] = []

    def term(self, key: str, text: str | None = None) -> str:
        """A term of the legend, marked as used (shown as ``text`` or its own name)."""
        self.terms.add(key)
        return f'<span class="term" title="{_e(_TERMS[key][1])}">{_e(text or _TERMS[key][0])}</span>'

    def layer(self, lay: str) -> str:
        self.layers.add(lay)
        return f'<span class="badge L-{_e(lay)}" title="{_e(LAYER_WORDS.get(lay, lay))}">{_e(lay)}</span>'

    def feature(self, f: str) -> str:
        self.features.add(f)
        return f'<span class="feature" title="{_e(f)}">{_e(FEATURE_WORDS.get(f, f))}</span>'

    # -- verdict ----------------------------------------------------------------------------------

    def verdict(self) -> str:
        s = self.d.get("summary", {})
        n, nf = int(s.get("steps", len(self.steps))), len(self.flagged)
        out = ['<section id="verdict"><h2>Verdict</h2>']
        if not nf:
            out.append(f'<p class="headline ok">No abnormal step: all {n:,} steps are within the reference\'s '
                       "normal range.</p>")
        else:
            every = self.has_model and (self.d.get("model") or {}).get("reads") == "every"
            by = "the root-cause model, read over time, or the numeric stage" if every else "the numeric stage"
            na = sum(1 for x in self.flagged if not x.get("model_says_normal")) if every else nf  # the others: read as normal
            out.append(f'<p class="headline bad"><b>{na:,}</b> of {n:,} steps {"is" if na == 1 else "are"} '
                       f"abnormal ({self.term('flagged')} by {by})</p>")
            if every:
                line = reading_words(self.d)
                out.append(f'<p class="sub">{_e(line[0].upper() + line[1:])}.</p>')
            elif self.has_model:
                named = [x for x in self.flagged if x.get("fault_type") and not x.get("model_says_normal")]
                normal = [x for x in self.flagged if x.get("model_says_normal")]
                m = self.d.get("model") or {}
                unsure = sum(map(model_unsure, named))
                line = f"The root-cause model names a fault type for {len(named):,} of them"
                if unsure:
                    line += (f" ({unsure:,} with an abnormal probability under {m.get('abnormal_cut', ABNORMAL_CUT)}, kept because the model does "
                             f"not rule them out: {m.get('abnormal_floor', SCREEN_FLOOR)} or more)")
                unknown = [x for x in self.flagged if x.get("unknown_fault")]
                if unknown:
                    line += (f"; {len(unknown):,} more lie in sustained episodes against a reference of this deployment "
                             "and are kept as faults of a kind it was not trained on")
                if normal:
                    line += f" and reads {len(normal):,} as normal"
                unread = m.get("steps_eligible", 0) - m.get("steps_read", 0)
                if unread > 0:  # past the bound the numeric stage's verdict stands
                    line += (f"; it read the {m['steps_read']:,} highest-scored of {m['steps_eligible']:,} flagged steps "
                             f"(bound {m.get('max_steps')}, `teller diagnose --model-steps N`), the other {unread:,} "
                             "have the numeric stage's verdict only")
                out.append(f'<p class="sub">{_e(line)}.</p>')
            else:
                skipped = (self.d.get("model") or {}).get("skipped")
                why = f" ({_e(skipped)})" if skipped else ""
                out.append(f'<p class="sub">No root-cause model was applied{why}: the fault types are not named; '
                           "the evidence is the numeric stage's.</p>")
        eps = longest_episodes(self.d)
        if nf and eps:
            out.append(f'<p class="sub">{len(self.d["episodes"]):,} episode(s) of flagged steps (a rank\'s flagged steps '
                       f"at most {EPISODE_GAP} step numbers apart); the longest: {_e('; '.join(map(episode_words, eps)))}.</p>")
        if s.get("warning"):
            out.append(f'<p class="warning">Warning: {_e(s["warning"])}</p>')
        health = self.d.get("health") or {}
        if health.get("lines"):
            head = "The input is partial: " if health.get("partial") else "About the input: "
            items = "".join(f"<li>{_e(x)}</li>" for x in health["lines"][:MAX_HEALTH_LINES])
            more = len(health["lines"]) - MAX_HEALTH_LINES
            items += f"<li>{more:,} more in diagnosis.json (health)</li>" if more > 0 else ""
            out.append(f'<div class="warning"><p>{head}what the diagnosis reads may be incomplete.</p><ul>{items}</ul></div>')
        groups = self.groups
        for g in groups[:MAX_GROUPS]:
            out.append(self._group_card(g))
        if len(groups) > MAX_GROUPS:
            rest = sum(len(g["steps"]) for g in groups[MAX_GROUPS:])
            msg = f"{len(groups) - MAX_GROUPS} more verdict groups ({rest:,} steps) are not shown here"
            self.cuts.append(msg)
            out.append(f'<p class="cut">{_e(msg)}; they are in the tables below and in diagnosis.json.</p>')
        out.append("</section>")
        return "\n".join(out)

    def _groups(self) -> list[dict[str, Any]]:
        """Flagged steps grouped by verdict, worst first: the steps with a fault type by (type, first
        evidence operator), the numeric stage's alone by their first evidence operator, and the
        steps the model reads as normal in one group."""
        groups: dict[tuple, dict[str, Any]] = {}
        for x in self.flagged:
            kind = ("fault" if x.get("fault_type") and not x.get("model_says_normal")
                    else "unknown" if x.get("unknown_fault")
                    else "normal" if x.get("model_says_normal") else "numeric")
            ops = _evidence_ops(x)
            # the numeric stage's verdicts by the type their evidence points to (none: not named)
            ev = (x.get("evidence_type") or {}).get("fault_type") if kind == "numeric" else None
            key = (kind, x.get("fault_type") if kind == "fault" else None, ops[0] if ops and kind != "normal" else None, ev)
            groups.setdefault(key, {"kind": kind, "fault_type": key[1], "evidence_type": ev, "steps": []})["steps"].append(x)
        order = {"fault": 0, "unknown": 1, "numeric": 2, "rest": 3, "normal": 4}
        out = sorted(groups.values(), key=lambda g: (order[g["kind"]], -len(g["steps"]), _worst_first(g["steps"][0])))
        # the numeric stage's verdicts beyond the largest few groups share one card, a line per step
        numeric = [g for g in out if g["kind"] == "numeric"]
        rest = [g for i, g in enumerate(numeric) if i >= MAX_NUMERIC_CARDS or len(g["steps"]) == 1]
        if len(rest) > 1:
            out = [g for g in out if not any(g is r for r in rest)]
            steps = sorted((x for g in rest for x in g["steps"]), key=_worst_first)
            out.append({"kind": "rest", "fault_type": None, "steps": steps})
            out.sort(key=lambda g: order[g["kind"]])
        return out

    def _group_card(self, g: dict[str, Any]) -> str:
        steps = g["steps"]
        rep = steps[0]  # the worst step of the group
        if g["kind"] == "fault":
            ps = [x["fault_probability"] for x in steps if x.get("fault_probability") is not None]
            prob = ""
            if ps:
                lo, hi = min(ps), max(ps)
                prob = f"{lo:.2f}" if f"{lo:.2f}" == f"{hi:.2f}" else f"{lo:.2f}–{hi:.2f}"
                prob = f' <span class="prob">{self.term("fault probability")} {prob}</span>'
            title = f'<span class="fault">{_e(_fault_title(g["fault_type"]))}</span>{prob}'
            novel = [x for x in steps if x.get("fault_type_model")]
            if novel:
                title += (f' <span class="prob">{len(novel):,} of these steps typed by the numeric evidence: unlike every '
                          f'step the model was trained on ({self.term("novelty")} above 1), where it named '
                          f'{_e(", ".join(sorted({_fault_title(x["fault_type_model"]) for x in novel})))}</span>')
            title += _low_confidence(steps)
            cls = "card fault-card"
        elif g["kind"] == "normal":
            ps = [x["abnormal_probability"] for x in steps if x.get("abnormal_probability") is not None]
            pr = f' <span class="prob">{self.term("abnormal probability")} at most {max(ps):.2f}</span>' if ps else ""
            what = "Numeric outlier" if len(steps) == 1 else f"{len(steps):,} numeric outliers"
            title = f'<span class="fault">{what} the root-cause model reads as normal</span>{pr}' + _low_confidence(steps)
            cls = "card normal-card"
        elif g["kind"] == "unknown":
            n = max(int(x.get("episode_length") or 0) for x in steps)
            title = ('<span class="fault">Fault of a kind the root-cause model was not trained on</span> '
                     f'<span class="prob">a sustained departure from a reference of this deployment (up to {n:,} '
                     "flagged steps in a row) that the model does not recognise</span>")
            cls = "card fault-card"
        elif g["kind"] == "rest":
            title = (f'<span class="fault">{len(steps):,} other abnormal steps</span> '
                     '<span class="prob">fault type not named; each with its own evidence</span>')
            cls = "card numeric-card"
        elif g.get("evidence_type"):
            title = (f'<span class="fault">{_e(_fault_title(g["evidence_type"]))}</span> '
                     f'<span class="prob">named by the numeric evidence, no model: {_e(rep["evidence_type"]["reason"])}</span>')
            cls = "card numeric-card"
        else:
            title = '<span class="fault">Abnormal step</span> <span class="prob">fault type not named</span>'
            cls = "card numeric-card"
        rows = [f'<div class="{cls}" data-steps="{len(steps)}"><h3>{title}</h3><dl>']
        shown = steps[:MAX_STEPS_PER_GROUP]
        links = ", ".join(self._step_link(x) for x in sorted(shown, key=lambda x: (x["start_ns"], x["rank"])))
        if len(steps) > len(shown):
            links += f' <span class="cut">and {len(steps) - len(shown):,} more</span>'
        rows.append(f"<dt>{'Step' if len(steps) == 1 else f'{len(steps):,} steps'}</dt><dd>{links}</dd>")
        if g["kind"] in ("normal", "rest"):  # one line per step: what the numeric stage measured
            lines = [f"<li>step {int(x['step_num'])}: {self._numeric_why(x)}</li>" for x in steps[:8]]
            if len(steps) > 8:
                lines.append(f'<li class="cut">and {len(steps) - 8:,} more</li>')
            rows.append(f"<dt>Measured</dt><dd><ul class=\"plain\">{''.join(lines)}</ul></dd></dl></div>")
            return "\n".join(rows)
        count: dict[str, int] = {}
        for x in steps:
            for o in _evidence_ops(x):
                count[o] = count.get(o, 0) + 1
        ops = sorted(count, key=lambda o: -count[o])[:8]
        rows.append(f"<dt>{self.term('evidence operators', 'Evidence operators')}</dt><dd>"
                    + (", ".join(_op(o)
                                 + (f' <span class="muted">({count[o]} of {len(steps)} steps)</span>' if count[o] < len(steps) else "")
                                 for o in ops) if ops else '<span class="muted">the whole step</span>') + "</dd>")
        if g["kind"] == "fault" and rep.get("explanation"):
            why = self._explained(rep["explanation"])
        else:
            why = self._numeric_why(rep)
        label = "Why" if len(steps) == 1 else f"Why (step {rep['step_num']})"
        rows.append(f'<dt>{_e(label)}</dt><dd class="why">{why}</dd>')
        rows.append("</dl></div>")
        return "\n".join(rows)

    def _explained(self, text: str) -> str:
        """An explanation sentence, escaped, its feature names and ``z=`` registered for the legend."""
        for f in FEATURE_WORDS:
            if f != "family" and re.search(rf"(?<![\w.]){re.escape(f)}(?![\w.])", text):
                self.features.add(f)
        if re.search(r"\bz=", text):
            self.terms.add("z")
        if "×" in text:
            self.terms.add("ratio")
        self.terms.add("units")
        return _e(text)

    def _numeric_why(self, x: dict[str, Any]) -> str:
        """The strongest measurement of a flagged step in words (HTML)."""
        sus = [sp for sp in x.get("suspects") or [] if sp.get("evidence")]
        if not sus:
            fam = x.get("top_family")
            return (f"the step's score is {x['score']:.2f}" if x.get("score") is not None else "abnormal") + (
                f"; most deviating family {_e(fam)}" if fam else "")
        sp, it = sus[0], sus[0]["evidence"][0]
        where = _op(_suspect_name(sp))
        if "note" in it:
            return f"{where}: {_e(it['note'])}"
        return f"{where}: {self._measure(it)}"

    def _measure(self, it: dict[str, Any]) -> str:
        """``duration 1.53 ms observed vs 22.7 µs reference (67.7×, +24.5 sd)``."""
        f = it["feature"]
        z = it.get("z")
        dev = f", {z:+.1f} {self.term('sd')}" if z is not None else ""
        r = it.get("ratio")
        paren = ", ".join(p for p in ((_e(_ratio(r)) if r else ""), dev.lstrip(", ")) if p)
        return (f"{self.feature(f)} {self.term('observed', 'observed')} <b>{_e(fmt_value(f, it.get('value')))}</b> vs "
                f"{_e(fmt_value(f, it.get('reference')))} {self.term('reference')}" + (f" ({paren})" if paren else ""))

    def _step_link(self, x: dict[str, Any]) -> str:
        rank = f" (rank {x['rank']})" if self._multi_rank() else ""
        if x["index"] in self.anchored:
            return f'<a href="#step-{int(x["index"])}">{int(x["step_num"])}{rank}</a>'
        return f"{int(x['step_num'])}{rank}"


    def _multi_rank(self) -> bool:
        if not hasattr(self, "_mr"):
            self._mr = len({s["rank"] for s in self.steps}) > 1
        return self._mr

    # -- timeline ---------------------------------------------------------------------------------

    def timeline(self) -> str:
        out = ['<section id="timeline"><h2>Steps over time</h2>']
        if not self.steps:
            out.append('<p class="muted">The run has no steps.</p></section>')
            return "\n".join(out)
        ranks = sorted({int(s["rank"]) for s in self.steps})
        if len(ranks) > MAX_LANES:
            msg = f"timeline: {len(ranks) - MAX_LANES} of {len(ranks)} rank lanes left out (the first {MAX_LANES} shown)"
            self.cuts.append(msg)
            ranks = ranks[:MAX_LANES]
        lane_of = {r: i for i, r in enumerate(ranks)}
        t0 = min(int(s["start_ns"]) for s in self.steps)
        t1 = max(int(s["end_ns"]) for s in self.steps)
        span = max(1, t1 - t0)
        left, width, lane_h, top = 64, 1100, 26, 14
        height = top + len(ranks) * lane_h + 26
        x_of = lambda t: left + width * (t - t0) / span  # noqa: E731
        svg = [f'<svg id="timeline-svg" viewBox="0 0 {left + width + 10} {height}" '
               f'width="100%" role="img" aria-label="steps over time, coloured by score">']
        for r, i in lane_of.items():
            y = top + i * lane_h
            svg.append(f'<text x="{left - 6}" y="{y + lane_h / 2 + 4:.1f}" class="lane">rank {r}</text>')
            svg.append(f'<line x1="{left}" x2="{left + width}" y1="{y + lane_h - 2}" y2="{y + lane_h - 2}" class="lane-line"/>')
        by_lane: dict[int, list[dict[str, Any]]] = {}
        for s in self.steps:
            if int(s["rank"]) in lane_of:
                by_lane.setdefault(int(s["rank"]), []).append(s)
        binned = 0
        for r, ss in by_lane.items():
            y = top + lane_of[r] * lane_h
            ss.sort(key=lambda s: s["start_ns"])
            if len(ss) <= MAX_BARS_PER_LANE:
                for s in ss:
                    svg.append(self._bar(s, x_of, y, lane_h))
            else:
                binned += len(ss)
                per = math.ceil(len(ss) / MAX_BARS_PER_LANE)
                for j in range(0, len(ss), per):
                    svg.append(self._bin(ss[j:j + per], x_of, y, lane_h))
        if binned:
            self.cuts.append(f"timeline: lanes with more than {MAX_BARS_PER_LANE:,} steps drawn as bars of several "
                             f"neighbouring steps each ({binned:,} steps), coloured by their highest score")
        marked = [s for s in self.flagged if int(s["rank"]) in lane_of][:MAX_MARKERS]
        if len(marked) < len(self.flagged):
            self.cuts.append(f"timeline: {len(self.flagged) - len(marked):,} flagged steps not marked (at most "
                             f"{MAX_MARKERS} marks)")
        for s in marked:
            xm = (x_of(int(s["start_ns"])) + x_of(int(s["end_ns"]))) / 2
            y = top + lane_of[int(s["rank"])] * lane_h
            svg.append(f'<path class="flag-mark" d="M{xm - 4:.1f},{y - 6} L{xm + 4:.1f},{y - 6} L{xm:.1f},{y + 1} Z">'
                       f"<title>{_e(self._bar_title(s))}</title></path>")
        # time axis
        ya = top + len(ranks) * lane_h + 4
        svg.append(f'<line x1="{left}" x2="{left + width}" y1="{ya}" y2="{ya}" class="axis"/>')
        for tv in _ticks(span):
            x = x_of(t0 + tv)
            svg.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{ya}" y2="{ya + 4}" class="axis"/>'
                       f'<text x="{x:.1f}" y="{ya + 16}" class="tick">{_e(fmt_ns(tv))}</text>')
        svg.append("</svg>")
        out.append("\n".join(svg))
        self.terms.update({"score", "flagged", "units"})
        if any(s.get("score") is None for s in self.steps):
            self.terms.add("no score")
        out.append('<div class="scale"><span>'
                   f'{self.term("score", "Score")}: 0 <span class="ramp"></span> 1</span>'
                   '<span><svg width="14" height="12" viewBox="0 0 14 12"><path class="flag-mark" d="M2,1 L12,1 L7,10 Z"/></svg> '
                   f'{self.term("flagged")} step (outlined; click to jump to its evidence)</span>'
                   f'<span><span class="swatch" style="background:{score_colour(None)}"></span> '
                   f'{self.term("no score")}</span>'
                   f'<span class="muted">time since the first step; hover a bar for its step</span></div>')
        rule = self.d.get("steps_rule", {})
        if rule.get("rule") and rule.get("rule") != "STEP ranges":
            out.append(f'<p class="muted" id="steps-rule-note">Steps are {_e(rule["rule"])}: {_e(rule.get("detail", ""))}</p>')
        out.append("</section>")
        return "\n".join(out)

    def _bar_title(self, s: dict[str, Any]) -> str:
        t = f"step {s['step_num']}, rank {s['rank']}: {fmt_ns(_dur(s))}, score " + (
            "none" if s.get("score") is None else f"{s['score']:.2f}")
        if s.get("flag"):
            t += " — flagged"
            if s.get("fault_type") and not s.get("model_says_normal"):
                t += f": {_fault_title(s['fault_type'])}"
                if s.get("fault_probability") is not None:
                    t += f" (probability {s['fault_probability']:.2f})"
            ops = _evidence_ops(s)
            if ops:
                t += " at " + ", ".join(ops[:3])
        return t

    def _bar(self, s: dict[str, Any], x_of: Any, y: float, lane_h: int) -> str:
        x0, x1 = x_of(int(s["start_ns"])), x_of(int(s["end_ns"]))
        w = max(1.0, x1 - x0 - 0.4)
        cls = "bar flagged" if s.get("flag") else "bar"
        rect = (f'<rect class="{cls}" data-index="{int(s["index"])}" x="{x0:.2f}" y="{y}" width="{w:.2f}" '
                f'height="{lane_h - 4}" fill="{score_colour(s.get("score"))}"><title>{_e(self._bar_title(s))}</title></rect>')
        if s.get("flag") and s["index"] in self.anchored:
            return f'<a href="#step-{int(s["index"])}">{rect}</a>'
        return rect

    def _bin(self, ss: list[dict[str, Any]], x_of: Any, y: float, lane_h: int) -> str:
        sc = [s["score"] for s in ss if s.get("score") is not None]
        hi = max(sc) if sc else None
        nf = sum(1 for s in ss if s.get("flag"))
        x0, x1 = x_of(int(ss[0]["start_ns"])), x_of(int(ss[-1]["end_ns"]))
        title = (f"steps {ss[0]['step_num']}–{ss[-1]['step_num']}, rank {ss[0]['rank']}: {len(ss)} steps, highest score "
                 + ("none" if hi is None else f"{hi:.2f}") + (f", {nf} flagged" if nf else ""))
        cls = "bar bin flagged" if nf else "bar bin"
        return (f'<rect class="{cls}" x="{x0:.2f}" y="{y}" width="{max(1.0, x1 - x0):.2f}" height="{lane_h - 4}" '
                f'fill="{score_colour(hi)}"><title>{_e(title)}</title></rect>')

    # -- evidence ---------------------------------------------------------------------------------

    def evidence(self) -> str:
        if not self.flagged:
            return ""
        out = ['<section id="evidence"><h2>Evidence of the flagged steps</h2>',
               '<p class="muted">In the order of the verdict, worst first within a group. Each tree is the causal slice of the step: the operators most '
               f"tied to its {self.term('suspect')}s, with the {self.term('observed')} duration next to the "
               f"{self.term('reference')}'s typical one.</p>"]
        for i, x in enumerate(self.flagged[:MAX_DETAILED_STEPS]):
            out.append(self._step_section(x, open_=i < 3))
        rest = self.flagged[MAX_DETAILED_STEPS:]
        if rest:
            msg = (f"{len(rest):,} more flagged steps without an evidence section (at most {MAX_DETAILED_STEPS}, "
                   "in the order of the verdict)")
            self.cuts.append(msg)
            out.append(f'<h3>Other flagged steps</h3><p class="cut">{_e(msg)}; their evidence is in diagnosis.json.</p>')
            rows = rest[:MAX_TABLE_ROWS]
            out.append('<table id="other-flagged"><tr><th>step</th><th>rank</th><th>duration</th>'
                       f"<th>{self.term('score')}</th><th>verdict</th></tr>")
            for x in rows:
                out.append(f"<tr id=\"step-{int(x['index'])}\"><td>{int(x['step_num'])}</td><td>{int(x['rank'])}</td><td>{_e(fmt_ns(_dur(x)))}</td>"
                           f"<td>{_score(x)}</td><td>{self._short_verdict(x)}</td></tr>")
            out.append("</table>")
            if len(rest) > len(rows):
                msg = f"{len(rest) - len(rows):,} flagged steps left out of the table (at most {MAX_TABLE_ROWS:,} rows)"
                self.cuts.append(msg)
                out.append(f'<p class="cut">{_e(msg)}.</p>')
        out.append("</section>")
        return "\n".join(out)

    def _short_verdict(self, x: dict[str, Any]) -> str:
        ops = ", ".join(_evidence_ops(x)[:3])
        if x.get("fault_type") and not x.get("model_says_normal"):
            p = x.get("fault_probability")
            unsure = model_unsure(x)
            return _e(_fault_title(x["fault_type"]) + (f" ({p:.2f})" if p is not None and not unsure else "")
                      + (f" at {ops}" if ops else "") + (" (the model is unsure)" if unsure else "")
                      + (" (by the evidence: unlike the model's training)" if x.get("fault_type_model") else ""))
        et = x.get("evidence_type")  # the type the numeric evidence points to (teller.localize.faulttype)
        typed = f"; the evidence points to {et['fault_type']}" if et else ""
        if x.get("unknown_fault"):
            return _e(f"fault of a kind the model was not trained on ({x.get('episode_length')} flagged steps in a row)"
                      + typed + (f"; suspects {ops}" if ops else ""))
        if x.get("model_says_normal"):
            near = "; lasting, but like the steps it was trained on" if x.get("near_training") else ""
            return _e("read as normal by the root-cause model" + near + typed + (f"; suspects {ops}" if ops else ""))
        return _e((f"{et['fault_type']} by the evidence" + (f"; suspects {ops}" if ops else "")) if et
                  else f"suspects {ops}" if ops else "abnormal")

    def _step_section(self, x: dict[str, Any], open_: bool) -> str:
        head = (f"Step {int(x['step_num'])}" + (f" · rank {int(x['rank'])}" if self._multi_rank() else "")
                + f" · {fmt_ns(_dur(x))} · score {_score(x)} · ")
        self.terms.add("score")
        out = [f'<details class="step" id="step-{int(x["index"])}" data-index="{int(x["index"])}"{" open" if open_ else ""}>'
               f'<summary><b>{_e(head)}</b>{self._short_verdict(x)}</summary><div class="step-body">']
        dl = ["<dl>"]
        if x.get("fault_type") and not x.get("model_says_normal"):
            p = x.get("fault_probability")
            dl.append(f"<dt>Fault type</dt><dd><b>{_e(_fault_title(x['fault_type']))}</b>"
                      + (f", {self.term('fault probability')} {p:.2f}" if p is not None else "")
                      + (f" — named by the numeric evidence: the step is unlike every step the model was trained on "
                         f"({self.term('novelty')} {x['novelty']:.1f}, in a lasting run of such steps); the model "
                         f"named {_e(_fault_title(x['fault_type_model']))}" if x.get("fault_type_model") else "") + "</dd>")
        elif x.get("evidence_type"):
            et = x["evidence_type"]
            dl.append(f"<dt>Fault type by the evidence</dt><dd><b>{_e(_fault_title(et['fault_type']))}</b>: "
                      f"{_e(et['reason'])}</dd>")
        if x.get("abnormal_probability") is not None:
            dl.append(f"<dt>{self.term('abnormal probability', 'Abnormal probability')}</dt>"
                      f"<dd>{x['abnormal_probability']:.2f}" + (" — the model reads this step as normal: it "
                                                               "recognises none of the faults it was trained on here. "
                                                               "The numeric stage's evidence stands: a fault of a kind "
                                                               "the model never saw looks like this too"
                                                               if x.get("model_says_normal") else
                                                               " — the model recognises none of the faults it was "
                                                               f"trained on, but the step lies in {x.get('episode_length')} "
                                                               "flagged steps in a row against a reference of this "
                                                               "deployment: kept as a fault of another kind"
                                                               if x.get("unknown_fault") else
                                                               " — the model is unsure; the step keeps its flag "
                                                               "because the model does not rule it out"
                                                               if model_unsure(x) else "") + "</dd>")
        ops = x.get("evidence_operators") or []
        if ops:
            dl.append(f"<dt>{self.term('evidence operators', 'Evidence operators')}</dt><dd>"
                      + ", ".join(f'{_op(o.get("name"))} <span class="muted">node {int(o["node_id"])}</span>'
                                  for o in ops[:8]) + "</dd>")
        if x.get("explanation") and not x.get("model_says_normal"):
            dl.append(f'<dt>Why</dt><dd class="why">{self._explained(x["explanation"])}</dd>')
        else:
            dl.append(f'<dt>Strongest measurement</dt><dd class="why">{self._numeric_why(x)}</dd>')
        rq = x.get("requests") or []
        if rq:
            more = f" and {len(rq) - MAX_REQUESTS} more" if len(rq) > MAX_REQUESTS else ""
            dl.append(f"<dt>Requests</dt><dd>{_e(', '.join(rq[:MAX_REQUESTS]) + more)}</dd>")
        cands = x.get("candidates") or []
        if cands:
            items = []
            for c in cands[:6]:
                bits = []
                if c.get("suspiciousness") is not None:
                    bits.append(f"{self.term('suspiciousness')} {c['suspiciousness']:.2f}")
                if c.get("unseen"):
                    bits.append(self.term("unseen"))
                items.append(f'<code>{_e(c["family"])}</code>' + (f" ({', '.join(bits)})" if bits else ""))
            more = f" and {len(cands) - 6} more" if len(cands) > 6 else ""
            dl.append(f"<dt>Deviating families</dt><dd>{', '.join(items)}{more}</dd>")
        dl.append("</dl>")
        out.append("".join(dl))
        out.append(self._suspects(x))
        out.append(self._tree(x))
        out.append("</div></details>")
        return "\n".join(out)

    def _suspects(self, x: dict[str, Any]) -> str:
        sus = x.get("suspects") or []
        if not sus:
            return '<p class="muted">No suspect operator.</p>'
        out = [f'<h4>{self.term("suspect", "Suspects")}: what was measured</h4><table class="suspects"><tr>'
               f"<th>operator</th><th>{self.term('anomaly')}</th><th>measure</th><th>{self.term('observed')}</th>"
               f"<th>{self.term('reference')}</th><th>{self.term('ratio')}</th><th>{self.term('deviation')}</th></tr>"]
        for sp in sus[:MAX_SUSPECTS]:
            ev = sp.get("evidence") or [{"feature": "dur_ns", "value": sp.get("dur_ns"), "reference": None}]
            mod = sp.get("module") or {}
            where = (f'<br><span class="muted">in <code>{_e(mod["family"])}</code></span>'
                     if mod.get("family") and mod["family"] != sp.get("family") else "")
            label = _strip_layer(sp.get("family") or sp.get("name"))
            if label == sp.get("layer"):  # a STEP or OTHER range: its own name says more
                label = _strip_layer(sp.get("name")) or label
            name = (f'{self.layer(sp.get("layer", "OTHER"))}{_op(label, 40)} <span class="muted">node {int(sp["node_id"])}</span>{where}')
            a = sp.get("a")
            for j, it in enumerate(ev):
                first = f'<td rowspan="{len(ev)}">{name}</td><td rowspan="{len(ev)}">{"—" if a is None else f"{a:.2f}"}</td>' if j == 0 else ""
                if "note" in it:
                    out.append(f'<tr class="suspect-row">{first}<td colspan="5">{_e(it["note"])}</td></tr>')
                    continue
                f, z = it["feature"], it.get("z")
                if z is not None:
                    self.terms.add("sd")
                out.append(f'<tr class="suspect-row">{first}<td>{self.feature(f)}</td><td class="num"><b>{_e(fmt_value(f, it.get("value")))}</b></td>'
                           f'<td class="num">{_e(fmt_value(f, it.get("reference")))}</td><td class="num">{_e(_ratio(it.get("ratio")))}</td>'
                           f'<td class="num">{"—" if z is None else f"{z:+.1f} sd"}</td></tr>')
        out.append("</table>")
        if len(sus) > MAX_SUSPECTS:
            out.append(f'<p class="cut">{len(sus) - MAX_SUSPECTS} more suspects in diagnosis.json.</p>')
        return "\n".join(out)

    def _tree(self, x: dict[str, Any]) -> str:
        sl = x.get("slice") or {}
        nodes = sl.get("nodes") or []
        if not nodes:
            return '<p class="muted">No evidence tree for this step.</p>'
        by_id = {n["id"]: n for n in nodes}
        keep = _top_nodes(nodes, by_id, MAX_TREE_NODES)
        kids: dict[int, list[dict[str, Any]]] = {}
        roots = []
        for n in nodes:
            if n["id"] not in keep:
                continue
            p = n.get("parent", -1)
            while p in by_id and p not in keep:  # attach to the nearest kept ancestor
                p = by_id[p].get("parent", -1)
            if p in by_id:
                kids.setdefault(p, []).append(n)
            else:
                roots.append(n)
        has_suspect: dict[int, bool] = {}

        def sus_below(n: dict[str, Any]) -> bool:
            if n["id"] not in has_suspect:
                has_suspect[n["id"]] = bool(n.get("suspect")) or any(sus_below(c) for c in kids.get(n["id"], []))
            return has_suspect[n["id"]]

        def render(n: dict[str, Any], depth: int) -> str:
            line = self._node_line(n)
            ch = sorted(kids.get(n["id"], []), key=lambda c: c["start_ns"])
            cls = ' class="suspect"' if n.get("suspect") else ""
            if not ch:
                return f'<li{cls} data-node="{int(n["id"])}"><div class="node leaf">{line}</div></li>'
            # unfolded down to the suspects; a suspect's (or the root's) own calls only when few
            below = any(sus_below(c) for c in ch)
            opened = " open" if below or ((n.get("suspect") or depth < 1) and len(ch) <= FOLD_OVER) else ""
            inner = "".join(render(c, depth + 1) for c in ch)
            return (f'<li{cls} data-node="{int(n["id"])}"><details{opened}><summary><div class="node">{line}</div>'
                    f'</summary><ul>{inner}</ul></details></li>')

        self.terms.update({"relevance", "observed", "reference", "ratio"})
        out = [f'<h4>Evidence tree <span class="muted">({len(keep)} of {len(nodes)} nodes of the slice; '
               "suspects highlighted; click a node to fold it)</span></h4>",
               '<div class="tree-head"><span>operator</span><span>observed</span><span>reference</span>'
               '<span>ratio</span><span>relevance</span></div>',
               '<ul class="tree">' + "".join(render(r, 0) for r in sorted(roots, key=lambda r: r["start_ns"])) + "</ul>"]
        cut = len(nodes) - len(keep)
        dropped = int(sl.get("dropped") or 0)
        if cut or dropped:
            parts = []
            if cut:
                parts.append(f"{cut} nodes of lower relevance left out of this tree (at most {MAX_TREE_NODES})")
            if dropped:
                parts.append(f"{dropped} more relevant nodes were left out of the slice itself")
            out.append(f'<p class="cut">{_e("; ".join(parts))}.</p>')
        return "\n".join(out)

    def _node_line(self, n: dict[str, Any]) -> str:
        ref = n.get("reference_dur_ns")
        dur = n.get("dur_ns")
        ratio = (dur / ref) if (ref and dur is not None and ref > 0) else None
        rel = n.get("relevance")
        relw = 0 if rel is None else max(0.0, min(1.0, rel / 2))
        hot = " hot" if ratio is not None and ratio >= 2 else ""
        tag = ' <span class="tag">suspect</span>' if n.get("suspect") else ""
        if n.get("suspect"):
            self.terms.add("suspect")
        return (f'<span class="name" title="{_e(n.get("name"))} (node {int(n["id"])})">{self.layer(n.get("layer", "OTHER"))}'
                f'{tag}{_e(_strip_layer(n.get("name")))}</span>'
                f'<span class="num obs">{_e(fmt_ns(dur))}</span>'
                f'<span class="num ref">{_e(fmt_ns(ref)) if ref is not None else "—"}</span>'
                f'<span class="num ratio{hot}">{_e(_ratio(ratio))}</span>'
                f'<span class="rel" title="relevance {"—" if rel is None else f"{rel:.2f}"}">'
                f'<span class="relbar" style="width:{40 * relw:.0f}px"></span>{"—" if rel is None else f"{rel:.2f}"}</span>')

    # -- legend and notes -------------------------------------------------------------------------

    def legend(self) -> str:
        out = ['<section id="legend"><h2>Legend</h2><dl class="legend">']
        for key in _TERMS:
            if key in self.terms:
                name, text = _TERMS[key]
                out.append(f'<dt data-term="{_e(key)}">{_e(name)}</dt><dd>{_e(text)}</dd>')
        out.append("</dl>")
        if self.layers:
            out.append('<h3>Layers</h3><dl class="legend">')
            for lay in sorted(self.layers, key=lambda v: list(LAYER_WORDS).index(v) if v in LAYER_WORDS else 99):
                out.append(f'<dt data-layer="{_e(lay)}">{self.layer(lay)}</dt><dd>{_e(LAYER_WORDS.get(lay, "layer " + lay))}</dd>')
            out.append("</dl>")
        if self.features:
            out.append('<h3>Measures</h3><dl class="legend">')
            for f in sorted(self.features):
                out.append(f'<dt data-feature="{_e(f)}"><code>{_e(f)}</code></dt><dd>{_e(FEATURE_WORDS.get(f, f))} '
                           '<span class="muted">(the numeric stage\'s feature of this name in diagnosis.json)</span></dd>')
            out.append("</dl>")
        out.append("</section>")
        return "\n".join(out)

    def notes(self) -> str:
        d = self.d
        m = d.get("model")
        items = [f"Run <code>{_e(d.get('run'))}</code>, scored against {_e(d.get('reference'))}."]
        if m:
            tr = ", ".join(f"{k} {_e(m[k])}" for k in ("dataset", "split") if m.get(k))
            items.append(f"Root-cause model <code>{_e(m.get('path'))}</code> ({_e(m.get('variant'))}"
                         + (f"; trained on {tr}" if tr else "") + ").")
        else:
            items.append("No root-cause model was applied (numeric stage only).")
        if self.cuts:
            items.append("Left out of this page to keep it readable: " + "; ".join(_e(c) for c in self.cuts)
                         + ". Everything is in diagnosis.json.")
        else:
            items.append("Nothing was left out of this page.")
        return ('<section id="notes"><h2>About this report</h2><ul>'
                + "".join(f"<li>{i}</li>" for i in items) + "</ul></section>")

    def render(self) -> str:
        self.detailed = {x["index"] for x in self.flagged[:MAX_DETAILED_STEPS]}
        self.anchored = {x["index"] for x in self.flagged[:MAX_DETAILED_STEPS + MAX_TABLE_ROWS]}  # have an #step-INDEX
        d = self.d
        s = d.get("summary", {})
        rule = d.get("steps_rule", {}).get("rule", "")
        verdict = self.verdict()
        timeline = self.timeline()
        evidence = self.evidence()
        legend = self.legend()
        notes = self.notes()
        meta = (f"{_e(d.get('run'))} · against {_e(d.get('reference'))} · {int(s.get('steps', len(self.steps))):,} steps"
                + (f" ({_e(rule)})" if rule else ""))
        return (_PAGE.replace("@@CSS@@", _CSS).replace("@@META@@", meta)
                .replace("@@BODY@@", "\n".join(x for x in (verdict, timeline, evidence, legend, notes) if x)))


def _worst_first(x: dict[str, Any]) -> tuple:
    return (bool(x.get("model_says_normal")), -(x.get("fault_probability") or 0) if x.get("fault_type") else 0,
            -(x.get("score") or 0), x["start_ns"], x["rank"])


def _score(x: dict[str, Any]) -> str:
    return "none" if x.get("score") is None else f"{x['score']:.2f}"


def _op(name: Any, limit: int = MAX_NAME) -> str:
    """An operator name as a code chip, shortened past ``limit`` characters (in full on hover)."""
    name = str(name or "?")
    if len(name) <= limit:
        return f'<code class="op">{_e(name)}</code>'
    return f'<code class="op" title="{_e(name)}">{_e(name[:limit - 1])}…</code>'


def _strip_layer(name: Any) -> str:
    """``FE LlamaMLP`` → ``LlamaMLP`` (the layer is shown as a badge)."""
    name = str(name or "")
    head, _, rest = name.partition(" ")
    return rest if rest and head in LAYER_WORDS else name


def _suspect_name(sp: dict[str, Any]) -> str:
    mod = sp.get("module") or {}
    if mod.get("family") and mod["family"] != sp.get("family"):
        return f"{sp.get('family')} in {mod['family']}"
    return str(sp.get("family") or sp.get("name"))


def _evidence_ops(x: dict[str, Any]) -> list[str]:
    """The operators a verdict names: the root-cause model's evidence operators (families), else
    the numeric stage's (``operators``; a diagnosis written before it: the suspects lifted to
    their modules)."""
    own = not x.get("model_says_normal") and not x.get("unknown_fault")  # the model names this fault
    if x.get("evidence_families") and own:
        return list(x["evidence_families"])[:6]
    if x.get("evidence_operators") and own:
        return list(dict.fromkeys(o.get("name", "?") for o in x["evidence_operators"]))[:6]
    return list(x.get("operators") or x.get("modules") or [])[:6]


def _top_nodes(nodes: list[dict[str, Any]], by_id: dict[int, dict[str, Any]], cap: int) -> set[int]:
    """Ids of at most ``cap`` nodes (more only for the suspects' ancestors): the suspects, then the
    most relevant, each with its ancestors in the slice so the tree stays connected."""
    keep: set[int] = set()

    def add(n: dict[str, Any]) -> None:
        while n is not None and n["id"] not in keep:
            keep.add(n["id"])
            n = by_id.get(n.get("parent", -1))

    for n in nodes:
        if n.get("suspect"):
            add(n)
    for n in sorted(nodes, key=lambda n: -(n.get("relevance") or 0)):
        if len(keep) >= cap:
            break
        add(n)
    return keep


def _ticks(span: int) -> list[int]:
    """5–10 round time ticks from 0 to ``span`` ns."""
    step = 10 ** math.floor(math.log10(max(1, span) / 5))
    for m in (1, 2, 5, 10):
        if span / (step * m) <= 10:
            step *= m
            break
    return list(range(0, int(span) + 1, max(1, int(step))))


_CSS = """
*{box-sizing:border-box}
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,"Helvetica Neue",Arial,sans-serif;margin:0;color:#1d2330;background:#f4f5f7}
header{background:#1d2330;color:#fff;padding:14px 24px}header h1{font-size:19px;margin:0 0 2px}header .meta{opacity:.8;font-size:12px;word-break:break-all}
main{padding:14px 24px;max-width:1280px}
section{background:#fff;border:1px solid #dde1e7;border-radius:6px;padding:14px 16px;margin-bottom:14px}
h2{font-size:16px;margin:0 0 10px}h3{font-size:15px;margin:0 0 6px}h4{font-size:13px;margin:12px 0 4px}
.headline{font-size:20px;margin:0 0 4px}.headline.bad b{color:#b91c1c}.headline.ok{color:#15803d}
.sub{margin:0 0 10px;color:#444}.muted{color:#6b7280}.cut{color:#92400e;font-size:12px}
.warning{background:#fef3c7;border:1px solid #f59e0b;padding:6px 10px;border-radius:4px}
.card{border-left:5px solid #b91c1c;background:#fdf6f6;padding:8px 12px;margin:8px 0;border-radius:0 4px 4px 0}
.card.normal-card{border-color:#9ca3af;background:#f7f7f8}.card.numeric-card{border-color:#d97706;background:#fffbeb}
.card h3 .fault{font-size:16px}.prob{font-weight:normal;color:#444;margin-left:8px}
dl{display:grid;grid-template-columns:max-content 1fr;gap:3px 12px;margin:4px 0}dt{font-weight:600;color:#374151}dd{margin:0}
code{font:12.5px ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;background:#eef0f3;padding:0 3px;border-radius:3px}
code.op{background:#fde2e2}
.why{max-width:95ch}.term{border-bottom:1px dotted #888;cursor:help}.feature{border-bottom:1px dotted #888;cursor:help}
a{color:#1d4ed8}
#timeline-svg{display:block;font-size:11px}#timeline-svg .lane{text-anchor:end;fill:#374151}
#timeline-svg .lane-line{stroke:#eceef1}#timeline-svg .axis{stroke:#9ca3af}#timeline-svg .tick{text-anchor:middle;fill:#6b7280;font-size:10px}
.bar{stroke:none}.bar.flagged{stroke:#111;stroke-width:1.6}.flag-mark{fill:#b91c1c}
a .bar:hover{stroke:#1d4ed8;stroke-width:2.5}
.scale{display:flex;flex-wrap:wrap;gap:18px;font-size:12px;margin-top:6px;align-items:center}
.ramp{display:inline-block;width:120px;height:10px;vertical-align:middle;border-radius:2px;
background:linear-gradient(90deg,hsl(120,72%,52%),hsl(60,72%,52%),hsl(0,72%,48%))}
.swatch{display:inline-block;width:12px;height:10px;vertical-align:middle;border-radius:2px}
details.step{border:1px solid #e5e7eb;border-radius:5px;margin:8px 0;background:#fff}
details.step>summary{padding:7px 10px;cursor:pointer;background:#f9fafb;border-radius:5px}
details.step[open]>summary{border-bottom:1px solid #e5e7eb}.step-body{padding:8px 12px}
table{border-collapse:collapse;font-size:13px}td,th{border-bottom:1px solid #eee;padding:3px 8px;text-align:left;vertical-align:top}
th{background:#f9fafb;font-weight:600}.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
.badge{display:inline-block;font:600 10.5px/1.5 system-ui,sans-serif;padding:0 4px;border-radius:3px;margin-right:5px;color:#fff;min-width:30px;text-align:center}
.L-STEP{background:#7e3fb5}.L-FE{background:#0e7490}.L-BE{background:#0891b2}.L-COMM{background:#b45309}.L-RT{background:#15803d}
.L-DRV{background:#166534}.L-K{background:#b91c1c}.L-MEM{background:#c2410c}.L-SYNC{background:#9f1239}.L-OTHER{background:#6b7280}.L-GAP{background:#9ca3af}
.tree-head,.node{display:grid;grid-template-columns:minmax(0,1fr) 84px 84px 64px 96px;gap:6px;align-items:center}
.tree-head{font-size:11px;color:#6b7280;border-bottom:1px solid #e5e7eb;padding:2px 0 2px 18px}
ul.tree,ul.tree ul{list-style:none;margin:0;padding-left:0}ul.tree ul{margin-left:14px;border-left:1px dotted #c7cbd1}
ul.tree li{margin:0}ul.tree summary{cursor:pointer;list-style:none;position:relative;padding-left:14px}
ul.tree summary::-webkit-details-marker{display:none}ul.tree summary::before{content:"\\25B8";position:absolute;left:1px;top:1px;color:#6b7280}
ul.tree details[open]>summary::before{content:"\\25BE"}ul.tree .leaf{margin-left:14px}
.node{padding:1px 0;font-size:12.5px}.node .name{overflow:hidden;text-overflow:ellipsis;white-space:nowrap}
.node .obs{font-weight:600}.node .ref{color:#4b5563}.node .ratio.hot{color:#b91c1c;font-weight:700}
.rel{font-size:11px;color:#6b7280;white-space:nowrap}.relbar{display:inline-block;height:7px;background:#93c5fd;margin-right:4px;vertical-align:middle}
li.suspect>.node,li.suspect>details>summary>.node{background:#fee2e2;outline:1px solid #ef4444;border-radius:3px}
.tag{font-size:10px;background:#b91c1c;color:#fff;border-radius:3px;padding:0 4px;margin-right:6px}
dl.legend{grid-template-columns:minmax(120px,max-content) 1fr;font-size:13px}
ul.plain{margin:0;padding-left:0;list-style:none}#notes ul{margin:0;padding-left:18px;font-size:13px}
"""

_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width,initial-scale=1">
<title>TELLER diagnosis</title><style>@@CSS@@</style></head>
<body>
<header><h1>TELLER diagnosis</h1><div class="meta" id="meta">@@META@@</div></header>
<main>
@@BODY@@
</main>
</body></html>
"""


def render_html(diag: dict[str, Any]) -> str:
    """The report page of a diagnosis dict (as :func:`teller.report.diagnose.diagnose` returns it
    or diagnosis.json holds it) as one HTML string."""
    return _Page(diag).render()


def write_html(diag: dict[str, Any], path: str | os.PathLike) -> Path:
    """Write the report page (atomically) and return its path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".html.tmp")
    tmp.write_text(render_html(diag), encoding="utf-8")
    tmp.replace(path)
    return path
