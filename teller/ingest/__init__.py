"""Readers: turn traces users already have into a run directory (docs/design.md §2–4, §14).

``ingest(src, out)`` picks the reader by content, not by name alone:

- Kineto / PyTorch profiler Chrome-trace JSON (``.json``, ``.json.gz``, or a folder of per-rank
  files) → :mod:`teller.ingest.kineto`
- Nsight Systems SQLite export (``.sqlite``) → :mod:`teller.ingest.nsys`
- a canonical run directory or a folder of canonical ``*.parquet`` → :mod:`teller.ingest.canonical`
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from teller.errors import InputError, TellerError
from teller.ingest.canonical import ingest_canonical
from teller.ingest.kineto import ingest_kineto
from teller.ingest.nsys import ingest_nsys

FORMATS = ("kineto", "nsys", "canonical")


def detect_format(src: Path) -> str:
    """Guess the reader for ``src`` from its content."""
    if src.is_dir():
        if (src / "run.json").is_file() or (src / "events").is_dir() or any(src.glob("*.parquet")):
            return "canonical"
        if any(src.glob("*.json")) or any(src.glob("*.json.gz")):
            return "kineto"
        raise InputError(src, "folder holds no Kineto JSON, Parquet or run.json", "point at a trace file or a run directory")
    if not src.exists():
        raise InputError(src, "no such file", "check the path")
    with open(src, "rb") as f:
        head = f.read(16)
    if head.startswith(b"SQLite format 3"):
        return "nsys"
    if head.startswith(b"PAR1"):
        return "canonical"
    if head[:2] == b"\x1f\x8b" or head.lstrip()[:1] in (b"{", b"["):
        return "kineto"
    name = src.name.lower()
    if name.endswith((".sqlite", ".db")):
        return "nsys"
    if name.endswith((".json", ".json.gz")):
        return "kineto"
    raise InputError(src, "unrecognised trace format", "pass --format kineto|nsys|canonical")


def ingest(src: str | os.PathLike, out: str | os.PathLike, fmt: str = "auto", **options: Any) -> dict[str, Any]:
    """Read ``src`` and write the run directory ``out``; returns a summary of counts."""
    src, out = Path(src), Path(out)
    fmt = detect_format(src) if fmt == "auto" else fmt
    if fmt == "kineto":
        reader = ingest_kineto
    elif fmt == "nsys":
        reader = ingest_nsys
    elif fmt == "canonical":
        reader = ingest_canonical
    else:
        raise TellerError(f"unknown format {fmt!r}; use one of auto, {', '.join(FORMATS)}")
    return reader(src, out, **options)
