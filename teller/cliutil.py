"""How every TELLER entry point runs its typer app (``teller``, ``python -m teller.workload``).

Shared by the top-level CLI (:mod:`teller.cli`) and the stage packages' own entry points, so that
neither imports the other.
"""

from __future__ import annotations

import sys

import typer

from teller.errors import TellerError


def run_app(typer_app: typer.Typer, argv: list[str] | None = None) -> int:
    """Run a typer app the way every TELLER entry point does: the command's exit code passes
    through, a :class:`TellerError` is one line on stderr (exit 2), a usage error is click's own
    message (never a traceback)."""
    try:
        rc = typer_app(args=argv, standalone_mode=False)
    except TellerError as e:
        print(f"teller: error: {e}", file=sys.stderr)
        return 2
    except (typer.Abort, KeyboardInterrupt):
        print("teller: aborted", file=sys.stderr)
        return 130
    except SystemExit as e:  # a command calling sys.exit (teller record passes the child's code on)
        return int(e.code or 0) if not isinstance(e.code, str) else 2
    except Exception as e:
        # usage errors: typer ships its own copy of click, so match click's exception by shape
        if hasattr(e, "show") and isinstance(getattr(e, "exit_code", None), int):
            e.show()
            return e.exit_code
        raise
    # without standalone mode, `raise typer.Exit(n)` comes back as the return value
    return rc if isinstance(rc, int) else 0
