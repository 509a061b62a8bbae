"""The HTML report in a real headless browser (Chromium), opened from a file with the network off:
the page the browser builds has the verdict before the timeline, every step as a bar, every
flagged step's evidence section and the legend, no element injected by operator names, and it
renders to a non-blank screenshot of the window's size.

Skips only when no Chromium binary is installed (CI has Debian's ``chromium``)."""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import tempfile
from pathlib import Path

import pytest
from report_sample import NASTY, sample_diagnosis
from test_report_html import parse

from teller.report.html import write_html

CHROMIUM = next((p for p in (shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome")) if p), None)
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(CHROMIUM is None, reason="no chromium, chromium-browser or google-chrome on PATH")]

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-extensions", "--disable-dev-shm-usage", "--proxy-server=127.0.0.1:9",
         "--proxy-bypass-list=<-loopback>"]


def chromium(*args: str) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory() as prof:
        r = subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={prof}", "--enable-logging=stderr", "--v=0", *args],
                           capture_output=True, text=True, timeout=120, env={**os.environ, "HOME": prof})
    assert r.returncode == 0, r.stderr[-2000:]
    return r


@pytest.fixture(scope="module")
def page(tmp_path_factory) -> tuple[dict, Path]:
    d = sample_diagnosis()
    return d, write_html(d, tmp_path_factory.mktemp("browser") / "report.html")


def test_the_browser_builds_the_page(page):
    d, path = page
    r = chromium("--dump-dom", path.as_uri())
    dom = parse(r.stdout)
    assert "Uncaught" not in r.stderr and "ERR_" not in r.stderr
    ids = [e["attrs"].get("id") for e in dom.elements]
    assert ids.index("verdict") < ids.index("timeline") < ids.index("evidence") < ids.index("legend")
    assert len(dom.by_class("bar", "rect")) == len(d["steps"])
    flagged = [s for s in d["steps"] if s["flag"]]
    assert {int(e["attrs"]["data-index"]) for e in dom.by_class("step", "details")} == {s["index"] for s in flagged}
    assert not [e for e in dom.elements if e["tag"] in ("script", "lambda", "bad", "slow")]
    assert NASTY in dom.by_id("evidence")["text"]


def test_screenshot_is_drawn(page, tmp_path):
    _, path = page
    out = tmp_path / "report.png"
    chromium(f"--screenshot={out}", "--window-size=1280,1600", "--hide-scrollbars", path.as_uri())
    png = out.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert struct.unpack(">II", png[16:24]) == (1280, 1600)
    try:
        from PIL import Image
    except ImportError:  # the size check above stands
        return
    img = Image.open(out).convert("RGB")
    colours = img.getcolors(maxcolors=1 << 20)
    assert colours is not None and len(colours) > 50  # text, bars, badges: not a blank page
    # the header band is the page's dark header, the verdict's red card border shows below it
    assert img.getpixel((640, 10))[0] < 60
    reds = sum(n for n, (r, g, b) in colours if r > 150 and g < 60 and b < 60)
    assert reds > 200
