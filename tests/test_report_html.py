"""The HTML report (teller.report.html): verdict first, then the timeline, the evidence of every
flagged step and a legend of what the page shows; self-contained, escaped, bounded in size.

The page is parsed here as HTML (no browser); tests/test_report_browser.py renders it in
Chromium."""

from __future__ import annotations

import re
from html.parser import HTMLParser

import pytest
from report_sample import NASTY, NASTY_MODULE, sample_diagnosis

from teller.report import html as H
from teller.report.html import render_html


class _Dom(HTMLParser):
    """Elements in document order with their attributes, text and enclosing element ids."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.elements: list[dict] = []
        self._stack: list[dict] = []

    def handle_starttag(self, tag, attrs):
        el = {"tag": tag, "attrs": dict(attrs), "text": "", "pos": len(self.elements),
              "parents": [e["attrs"].get("id") for e in self._stack]}
        self.elements.append(el)
        if tag not in ("meta", "br", "img", "input", "link"):
            self._stack.append(el)

    def handle_startendtag(self, tag, attrs):
        self.handle_starttag(tag, attrs)
        self.handle_endtag(tag)

    def handle_endtag(self, tag):
        for i in range(len(self._stack) - 1, -1, -1):
            if self._stack[i]["tag"] == tag:
                del self._stack[i:]
                break

    def handle_data(self, data):
        for el in self._stack:
            el["text"] += data

    def by_id(self, i):
        return next((e for e in self.elements if e["attrs"].get("id") == i), None)

    def by_class(self, c, tag=None):
        return [e for e in self.elements if c in (e["attrs"].get("class") or "").split() and (tag is None or e["tag"] == tag)]

    def inside(self, section_id, tag=None):
        return [e for e in self.elements if section_id in e["parents"] and (tag is None or e["tag"] == tag)]


def parse(page: str) -> _Dom:
    dom = _Dom()
    dom.feed(page)
    return dom


@pytest.fixture(scope="module")
def with_model():
    d = sample_diagnosis()
    page = render_html(d)
    return d, page, parse(page)


def test_verdict_comes_first_and_names_every_flagged_step(with_model):
    d, page, dom = with_model
    verdict, timeline, evidence, legend = (dom.by_id(i) for i in ("verdict", "timeline", "evidence", "legend"))
    assert verdict["pos"] < timeline["pos"] < evidence["pos"] < legend["pos"]
    flagged = [s for s in d["steps"] if s["flag"]]
    text = " ".join(verdict["text"].split())
    assert f"{len(flagged)} of {len(d['steps'])} steps are abnormal" in text
    # the groups: two kernel-fault steps with the same evidence share one card, the scheduling
    # step has its own, the step the model reads as normal its own
    cards = dom.by_class("card", "div")
    assert sorted(int(c["attrs"]["data-steps"]) for c in cards) == [1, 1, 2]
    kernel = next(c for c in cards if "CUDA/kernel fault" in c["text"])
    assert "0.91–0.95" in kernel["text"] and NASTY_MODULE in kernel["text"]
    assert "Cause: <slow> & late." in kernel["text"]  # the explanation sentence, unescaped as text
    assert "scheduling/software fault" in text and "reads as normal" in text
    # every flagged step is linked from the verdict to its evidence section
    links = {e["attrs"]["href"] for e in dom.inside("verdict", "a")}
    assert links == {f"#step-{s['index']}" for s in flagged}
    sections = dom.by_class("step", "details")
    assert [int(e["attrs"]["data-index"]) for e in sections] == [s["index"] for s in sorted(
        flagged, key=lambda s: (bool(s.get("model_says_normal")), -(s.get("fault_probability") or 0), -s["score"]))]
    assert all(e["attrs"]["id"] == f"step-{e['attrs']['data-index']}" for e in sections)


def test_timeline_bars_colours_titles_and_marks(with_model):
    d, _, dom = with_model
    bars = [e for e in dom.inside("timeline-svg", "rect") if "bar" in e["attrs"]["class"].split()]
    assert len(bars) == len(d["steps"])
    by_index = {int(b["attrs"]["data-index"]): b for b in bars}
    for s in d["steps"]:
        b = by_index[s["index"]]
        assert b["attrs"]["fill"] == H.score_colour(s["score"])
        assert f"step {s['step_num']}, rank {s['rank']}" in b["text"]  # the hover title
        assert ("flagged" in b["attrs"]["class"].split()) == s["flag"]
    assert H.score_colour(None) != H.score_colour(0.0) != H.score_colour(1.0)
    assert len(dom.by_class("flag-mark", "path")) == sum(s["flag"] for s in d["steps"]) + 1  # + the key's mark
    assert {e["text"].strip() for e in dom.inside("timeline-svg", "text") if "lane" in e["attrs"].get("class", "")} == {"rank 0", "rank 1"}


def test_evidence_tree_observed_vs_reference(with_model):
    d, _, dom = with_model
    s = next(s for s in d["steps"] if s["flag"])
    sec = dom.by_id(f"step-{s['index']}")
    assert sec["tag"] == "details" and "open" in sec["attrs"]
    nodes = [e for e in dom.elements if e["tag"] == "li" and sec["attrs"]["id"] in e["parents"]]
    assert {int(e["attrs"]["data-node"]) for e in nodes} == {n["id"] for n in s["slice"]["nodes"]}
    sus = [e for e in nodes if "suspect" in (e["attrs"].get("class") or "").split()]
    assert [int(e["attrs"]["data-node"]) for e in sus] == [n["id"] for n in s["slice"]["nodes"] if n["suspect"]]
    line = sus[0]["text"]
    assert "5.00 ms" in line and "100.0 µs" in line and "50.0×" in line  # observed, reference, ratio
    # nodes with children are <details>: unfolded down to the suspects, folded below them
    folds = [e for e in dom.elements if e["tag"] == "details" and sec["attrs"]["id"] in e["parents"]]
    li_of = {id(e): nodes[[n["pos"] for n in nodes].index(e["pos"] - 1)] for e in folds}
    opened = {int(li_of[id(e)]["attrs"]["data-node"]): "open" in e["attrs"] for e in folds}
    sid = sus[0]["attrs"]["data-node"]
    assert opened == {int(sid) - 3: True, int(sid) - 2: True, int(sid): True, int(sid) + 1: False}
    table = " ".join(e["text"] for e in dom.by_class("suspect-row", "tr") if sec["attrs"]["id"] in e["parents"])
    assert "GPU kernel time" in table and "+24.5 sd" in table


def test_legend_explains_every_symbol_shown(with_model):
    _, page, dom = with_model
    legend = dom.by_id("legend")
    terms = {e["attrs"]["data-term"] for e in dom.inside("legend", "dt") if "data-term" in e["attrs"]}
    layers = {e["attrs"]["data-layer"] for e in dom.inside("legend", "dt") if "data-layer" in e["attrs"]}
    features = {e["attrs"]["data-feature"] for e in dom.inside("legend", "dt") if "data-feature" in e["attrs"]}
    shown_layers = {e["text"] for e in dom.by_class("badge") if "legend" not in e["parents"]}
    assert shown_layers == {"STEP", "FE", "BE", "RT", "K"} and shown_layers <= layers
    assert {"dur_ns", "k_ns"} <= features
    for key in ("score", "flagged", "fault probability", "abnormal probability", "evidence operators", "observed",
                "reference", "ratio", "deviation", "relevance", "anomaly", "sd", "units", "no score"):
        assert key in terms, key
    # every term marked in the page has its legend entry; the cryptic symbols are gone
    key_of = {text: key for key, (_, text) in H._TERMS.items()}
    marked = {key_of[e["attrs"]["title"]] for e in dom.by_class("term")}
    assert marked and marked <= terms
    body = re.sub(r"<style>.*?</style>", "", page, flags=re.S)
    text = " ".join(" ".join(e["text"] for e in dom.elements if e["tag"] == "main").split())
    for cryptic in ("a=", "z=", "R=", "E_p", "E_t", "E_c"):
        assert cryptic not in text, cryptic
    assert legend["text"].count("standard deviations") >= 1 and "<script" not in body


def test_self_contained_no_external_urls(with_model):
    _, page, _ = with_model
    assert not re.search(r"""(?:src|href)\s*=\s*["']?\s*(?:https?:)?//""", page, re.I)
    assert not re.search(r"url\(|@import|<link|<script|<img|<iframe", page, re.I)
    assert "http://" not in page and "https://" not in page
    assert all(h.startswith("#step-") for h in re.findall(r'href="([^"]*)"', page))


def test_text_is_escaped():
    d = sample_diagnosis()
    page = render_html(d)
    assert NASTY not in page and "<lambda>" not in page and "Mod<&>" not in page and "<bad>" not in page
    assert "aten::&lt;lambda&gt;&amp;&quot;x&quot;" in page and "FE Mod&lt;&amp;&gt;" in page
    assert "&lt;slow&gt; &amp; late" in page
    dom = parse(page)
    assert NASTY in dom.by_id("evidence")["text"] and "runs/<bad>&run" in dom.by_id("meta")["text"]
    assert not [e for e in dom.elements if e["tag"] in ("lambda", "bad", "slow", "script")]


def test_numeric_stage_only():
    d = sample_diagnosis(model=False, ranks=1)
    dom = parse(render_html(d))
    text = " ".join(dom.by_id("verdict")["text"].split())
    assert "4 of 40 steps are abnormal" in text and "No root-cause model was applied" in text
    cards = dom.by_class("card", "div")
    assert len(cards) == 1 and cards[0]["attrs"]["data-steps"] == "4" and "fault type not named" in cards[0]["text"]
    # the why is the strongest measurement, in words
    assert "duration observed 5.00 ms vs 100.0 µs reference (50.0×, +24.5 sd)" in " ".join(cards[0]["text"].split())
    assert "rank" not in " ".join(e["text"] for e in dom.inside("verdict", "a"))  # one rank: not repeated


def test_no_flagged_step():
    d = sample_diagnosis(flagged=())
    dom = parse(render_html(d))
    assert "No abnormal step" in dom.by_id("verdict")["text"] and dom.by_id("evidence") is None
    assert len(dom.by_class("bar", "rect")) == len(d["steps"])


def test_big_runs_are_cut_and_say_so():
    n = 4000
    d = sample_diagnosis(n_steps=n, flagged=tuple(range(0, 3000, 7)), ranks=1)
    page = render_html(d)
    dom = parse(page)
    flagged = [s for s in d["steps"] if s["flag"]]
    assert len(dom.by_class("step", "details")) == H.MAX_DETAILED_STEPS
    assert len(dom.by_class("bar", "rect")) <= H.MAX_BARS_PER_LANE + 1
    assert len(dom.by_class("flag-mark", "path")) == H.MAX_MARKERS + 1
    rows = dom.by_id("other-flagged")
    assert rows is not None and len([e for e in dom.elements if e["tag"] == "tr" and "other-flagged" in e["parents"]]) == \
        len(flagged) - H.MAX_DETAILED_STEPS + 1
    notes = " ".join(dom.by_id("notes")["text"].split())
    assert "Left out of this page" in notes and f"{len(flagged) - H.MAX_DETAILED_STEPS} more flagged steps" in notes
    assert f"more than {H.MAX_BARS_PER_LANE:,} steps" in notes and "not marked" in notes
    # every link points at an anchor of the page
    anchors = {e["attrs"]["id"] for e in dom.elements if e["attrs"].get("id", "").startswith("step-")}
    hrefs = {e["attrs"]["href"][1:] for e in dom.elements if e["tag"] == "a"}
    assert hrefs and hrefs <= anchors
    # binned bars still name their steps and the highest score
    assert any("steps 0–" in e["text"] and "flagged" in e["text"] for e in dom.by_class("bin", "rect"))
    assert len(page) < 3_000_000


def test_tree_is_capped_to_the_most_relevant_nodes():
    d = sample_diagnosis(ranks=1, flagged=(3,))
    s = next(s for s in d["steps"] if s["flag"])
    base = s["slice"]["nodes"]
    extra = [{"id": 90_000 + i, "parent": base[0]["id"], "layer": "OTHER", "name": f"OTHER filler {i}", "start_ns": 0,
              "dur_ns": 10, "reference_dur_ns": 12.0, "relevance": 0.5 + i / 1000, "suspect": False} for i in range(200)]
    s["slice"]["nodes"] = base + extra
    dom = parse(render_html(d))
    ids = {int(e["attrs"]["data-node"]) for e in dom.elements if e["tag"] == "li" and "data-node" in e["attrs"]}
    assert len(ids) == H.MAX_TREE_NODES
    assert {n["id"] for n in base if n["suspect"]} <= ids  # suspects and their callers always kept
    assert 90_199 in ids and 90_000 not in ids  # the most relevant fillers
    assert f"{len(base) + 200 - H.MAX_TREE_NODES} nodes of lower relevance left out" in dom.by_id("evidence")["text"]


def test_symbols_inside_explanations_get_legend_entries():
    d = sample_diagnosis(ranks=1)
    for s in d["steps"]:
        if s.get("explanation"):
            s["explanation"] = (f"CUDA/kernel fault in step {s['step_num']} on rank 0: evidence FE LlamaMLP; measured: "
                                "FE LlamaMLP k_ns 1.53 ms vs 22.7 µs (67.7×, z=+24.5) against the reference.")
    dom = parse(render_html(d))
    assert "z=+24.5" in dom.by_id("verdict")["text"]
    legend = dom.inside("legend", "dt")
    assert "z" in {e["attrs"].get("data-term") for e in legend}
    assert "k_ns" in {e["attrs"].get("data-feature") for e in legend}
    assert "GPU kernel time" in dom.by_id("legend")["text"]


@pytest.mark.parametrize("span", [1, 3, 999, 10**6 + 7, 3 * 10**10])
def test_time_ticks_are_round_and_cover_the_run(span):
    ticks = H._ticks(span)
    assert ticks[0] == 0 and ticks[-1] <= span and 1 <= len(ticks) <= 11
    assert span == 1 or len(ticks) >= 2


def test_many_numeric_verdicts_share_a_card():
    flagged = tuple(range(1, 40, 2))
    d = sample_diagnosis(model=False, ranks=1, flagged=flagged)
    for k, s in enumerate(x for x in d["steps"] if x["flag"]):  # two steps each for 4 modules, the rest alone
        s["modules"] = [f"FE M{k // 2}" if k < 8 else f"FE Solo{k}"]
    dom = parse(render_html(d))
    cards = dom.by_class("card", "div")
    assert len(cards) == H.MAX_NUMERIC_CARDS + 1
    assert [int(c["attrs"]["data-steps"]) for c in cards] == [2, 2, 2, 2, len(flagged) - 8]
    assert "12 other abnormal steps" in cards[-1]["text"] and "and 4 more" in cards[-1]["text"]
    linked = {e["attrs"]["href"] for e in dom.inside("verdict", "a")}
    assert linked == {f"#step-{s['index']}" for s in d["steps"] if s["flag"]}


def test_a_step_the_model_is_unsure_of_keeps_its_type_and_says_so():
    """`teller diagnose` keeps the stage's flag where the model gives the step from 0.1 up
    (teller.rca.SCREEN_FLOOR): under 0.5 the page names the type and says the model is unsure;
    a step the model reads as normal says that instead."""
    d = sample_diagnosis(ranks=1)
    typed = [s for s in d["steps"] if s.get("flag") and s.get("fault_type") and not s.get("model_says_normal")]
    typed[0]["abnormal_probability"] = 0.3
    page = " ".join(render_html(d).split())
    assert "0.30 — the model is unsure" in page  # the step's evidence
    assert page.count("(the model is unsure)") == 1  # its one-line verdict, without the type's probability
    assert "the model reads this step as normal" in page  # the sample's step under the floor
    assert "(1 with an abnormal probability under 0.5, kept because the model does not rule them out" in page  # the verdict


def test_a_step_unlike_the_models_training_says_its_type_is_the_evidences():
    """A step `teller diagnose` retyped by the numeric evidence (novel_fault: unlike every step
    the model was trained on) says so in its evidence, its one-line verdict and its group's card,
    with the model's own type; the legend explains the novelty. Other steps say nothing of it."""
    d = sample_diagnosis(ranks=1)
    typed = [s for s in d["steps"] if s.get("flag") and s.get("fault_type") and not s.get("model_says_normal")]
    x = typed[0]
    x.update(novel_fault=True, novelty=2.4, fault_type_model="memory", fault_probability=None)
    dom = parse(render_html(d))
    text = " ".join(dom.by_id(f"step-{x['index']}")["text"].split())
    assert "named by the numeric evidence: the step is unlike every step the model was trained on (novelty 2.4" in text
    assert "the model named memory/resource fault" in text
    summary = next(e for e in dom.inside(f"step-{x['index']}", "summary"))
    assert "(by the evidence: unlike the model's training)" in summary["text"]
    page = " ".join(render_html(d).split())
    assert "1 of these steps typed by the numeric evidence" in page
    assert "how unlike every step the root-cause model was trained on" in " ".join(dom.by_id("legend")["text"].split())
    for other in typed[1:]:
        assert "unlike every step" not in dom.by_id(f"step-{other['index']}")["text"]


def test_numeric_stage_only_shows_the_type_its_evidence_points_to():
    d = sample_diagnosis(model=False, ranks=1)
    flagged = [x for x in d["steps"] if x["flag"]]
    et = {"fault_type": "runtime", "family": "BE aten::item", "feature": "family",
          "reason": "runtime: BE aten::item (a family not in the reference): the time went to CUDA runtime/driver calls"}
    flagged[0]["evidence_type"] = et
    dom = parse(render_html(d))
    step = dom.by_id(f"step-{flagged[0]['index']}")
    summary = next(e for e in dom.inside(f"step-{flagged[0]['index']}", "summary"))
    assert "runtime by the evidence" in summary["text"]
    text = " ".join(step["text"].split())
    assert "Fault type by the evidence" in text and "a family not in the reference" in text
    other = dom.by_id(f"step-{flagged[1]['index']}")  # a step without one says nothing of a type
    assert "by the evidence" not in other["text"]


def test_numeric_verdicts_are_carded_by_the_type_their_evidence_points_to():
    d = sample_diagnosis(model=False, ranks=1)
    flagged = [x for x in d["steps"] if x["flag"]]
    et = {"fault_type": "runtime", "family": "BE aten::item", "feature": "family",
          "reason": "runtime: BE aten::item (a family not in the reference): the time went to CUDA runtime/driver calls"}
    for x in flagged:
        x["evidence_type"] = dict(et)
    cards = parse(render_html(d)).by_class("card", "div")
    assert len(cards) == 1 and cards[0]["attrs"]["data-steps"] == str(len(flagged))
    text = " ".join(cards[0]["text"].split())
    assert "named by the numeric evidence, no model" in text and "fault type not named" not in text
    assert H._fault_title("runtime") in text
    flagged[0]["evidence_type"]["fault_type"] = "kernel"  # another type: a card of its own
    cards = parse(render_html(d)).by_class("card", "div")
    assert sorted(c["attrs"]["data-steps"] for c in cards) == sorted(["1", str(len(flagged) - 1)])


def test_verdict_names_the_longest_episodes_and_their_types():
    from teller.report.diagnose import mark_episodes, type_episodes

    d = sample_diagnosis(model=False, ranks=1)
    flagged = [x for x in d["steps"] if x["flag"]]
    for x in flagged:
        x["evidence_type"] = {"fault_type": "kernel", "family": "FE x", "feature": "k_ns", "reason": "kernel: FE x"}
    mark_episodes(d)
    type_episodes(d)
    assert d["episodes"] and all(e["fault_type"] == "kernel" for e in d["episodes"])
    text = " ".join(parse(render_html(d)).by_id("verdict")["text"].split())
    longest = H.longest_episodes(d)[0]
    assert f"{len(d['episodes'])} episode(s) of flagged steps" in text
    assert H.episode_words(longest) in text and f"kernel, {longest['steps']} of them" in text
    d.pop("episodes")
    assert "episode(s) of flagged steps" not in parse(render_html(d)).by_id("verdict")["text"]
