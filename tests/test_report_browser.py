"""The HTML report in a real headless browser (Chromium): it loads without script errors and shows
the timeline, the flagged steps and, for the chosen step, the slice tree with suspects highlighted.

Skips only when no Chromium binary is installed (CI installs Debian's ``chromium``)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from html.parser import HTMLParser
from pathlib import Path

import pytest

from teller.report.diagnose import diagnose
from teller.testing.planted import Plant, write_planted_run

CHROMIUM = next((p for p in (shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome")) if p), None)
pytestmark = [pytest.mark.slow, pytest.mark.skipif(CHROMIUM is None, reason="no chromium binary on this machine")]

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-extensions", "--disable-dev-shm-usage", "--virtual-time-budget=10000"]


class _Dom(HTMLParser):
    """Elements with their attributes and text, enough to query ids and classes."""

    def __init__(self):
        super().__init__()
        self.elements: list[dict] = []
        self._stack: list[dict] = []

    def handle_starttag(self, tag, attrs):
        el = {"tag": tag, "attrs": dict(attrs), "text": "", "parents": [e["attrs"].get("id") for e in self._stack]}
        self.elements.append(el)
        if tag not in ("meta", "br", "img", "input", "link"):
            self._stack.append(el)

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


def dump_dom(url: str) -> tuple[_Dom, str]:
    with tempfile.TemporaryDirectory() as prof:
        r = subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={prof}", "--enable-logging=stderr", "--v=0",
                            "--dump-dom", url], capture_output=True, text=True, timeout=120,
                           env={**os.environ, "HOME": prof})
    assert r.returncode == 0, r.stderr[-2000:]
    dom = _Dom()
    dom.feed(r.stdout)
    return dom, r.stderr


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("browser")
    write_planted_run(tmp / "ref", 30_000, [], seed=1)
    write_planted_run(tmp / "bad", 30_000, [Plant("BE aten::mul", [15, 40], "host", 5.0)], seed=2)
    d = diagnose(tmp / "bad", reference=[tmp / "ref"], out=tmp / "out", html=True)
    return d, Path(d["paths"]["html"])


def test_report_loads_and_shows_the_worst_step(report):
    d, page = report
    dom, log = dump_dom(page.as_uri())
    body = next(e for e in dom.elements if e["tag"] == "body")
    assert body["attrs"].get("data-ready") == "1", "the page script did not finish"
    assert dom.by_id("errors")["text"].strip() == ""
    assert "Uncaught" not in log
    # timeline: one bar per step, flagged ones marked
    bars = dom.by_class("step-bar", "rect")
    assert len(bars) == len(d["steps"])
    flagged = [s for s in d["steps"] if s["flag"]]
    assert len(dom.by_class("flagged", "rect")) == len(flagged) >= 2
    assert len([e for e in dom.elements if e["tag"] == "tr" and "pick" in (e["attrs"].get("class") or "")]) == len(flagged)
    # the worst flagged step is shown, with its slice tree and highlighted suspects
    worst = max(flagged, key=lambda s: (s["score"], -s["start_ns"]))
    assert body["attrs"].get("data-step") == str(worst["index"])
    assert f"Step {worst['step_num']}" in dom.by_id("step-title")["text"]
    sus = dom.by_class("suspect", "li")
    assert sus and {int(e["attrs"]["data-node"]) for e in sus} == {x["node_id"] for x in worst["suspects"]}
    assert all("slice-tree" in e["parents"] for e in sus)
    first = worst["suspects"][0]
    assert first["family"] in dom.by_id("suspects")["text"]
    assert first["evidence"][0]["feature"] in dom.by_id("suspects")["text"]
    assert len([e for e in dom.elements if e["tag"] == "li" and "slice-tree" in e["parents"]]) == len(worst["slice"]["nodes"])


def test_a_step_chosen_by_the_url(report):
    d, page = report
    planted = next(s for s in d["steps"] if s["step_num"] == 15)
    dom, _ = dump_dom(page.as_uri() + f"#step={planted['index']}")
    assert next(e for e in dom.elements if e["tag"] == "body")["attrs"].get("data-step") == str(planted["index"])
    text = dom.by_id("suspects")["text"]
    assert "BE aten::mul" in text and "self_ns" in text
    assert dom.by_class("suspect", "li")
    calm = next(s for s in d["steps"] if not s["flag"])
    dom, _ = dump_dom(page.as_uri() + f"#step={calm['index']}")
    body = next(e for e in dom.elements if e["tag"] == "body")
    assert body["attrs"].get("data-ready") == "1" and body["attrs"].get("data-step") == str(calm["index"])
    assert dom.by_id("errors")["text"].strip() == ""
    assert "not flagged" in dom.by_id("slice-tree")["text"] and not dom.by_class("suspect", "li")
