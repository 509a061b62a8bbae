"""One lane of a parallel campaign (``teller inject run --parallel N``): a process pinned to its
CPU cores that records the named runs one after another (:func:`teller.inject.campaign.run_campaign`).

    python -m teller.inject.lane SPEC OUT --cpus 0,1 --refs '{...}' --only RUN ... [--force] [--verbose]
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m teller.inject.lane")
    ap.add_argument("spec")
    ap.add_argument("out")
    ap.add_argument("--cpus", default="")
    ap.add_argument("--refs", default="{}")
    ap.add_argument("--only", nargs="+", required=True)
    ap.add_argument("--force", action="store_true")
    ap.add_argument("--verbose", action="store_true")
    a = ap.parse_args(argv)
    if a.cpus and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, [int(c) for c in a.cpus.split(",")])
    from teller.inject.campaign import run_campaign

    run_campaign(a.spec, a.out, only=a.only, force=a.force, quiet=not a.verbose, refs=json.loads(a.refs), lane=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
