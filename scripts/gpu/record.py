"""``teller record`` through the launcher's Python API (the device call does not rely on the CLI).

    python3 scripts/gpu/record.py RUN_DIR COLLECTOR [key=value ...] -- CMD ARGS...

key=value pairs are passed to :func:`teller.record.launcher.record` (be_depth=0,
be_backend=dispatch, ...; integers are converted).
"""

from __future__ import annotations

import sys

from teller.record.launcher import record


def main() -> None:
    argv = sys.argv[1:]
    i = argv.index("--")
    head, cmd = argv[:i], argv[i + 1:]
    out, collector, *pairs = head
    kw = {}
    for p in pairs:
        k, v = p.split("=", 1)
        kw[k] = int(v) if v.lstrip("-").isdigit() else v
    sys.exit(record(out, cmd, collector=collector, force=True, **kw)["exit_code"])


if __name__ == "__main__":
    main()
