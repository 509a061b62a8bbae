"""How every TELLER entry point runs its typer app (``teller``, ``python -m teller.workload``), and
what its commands share: the typer app factory, the console, progress bars, the run-directory guard.

Shared by the top-level CLI (:mod:`teller.cli`) and the stage packages' own entry points, so that
neither imports the other. rich is imported inside the functions, so ``teller --help`` stays fast.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import typer

from teller.errors import TellerError

#: the width of a console that is not a terminal: wide enough that no line (a templated kernel
#: name, a tree row) is wrapped, so output piped to a file or a log stays whole and greppable
WIDE = 8192


def new_app(help: str, **kw: Any) -> typer.Typer:
    """A typer app (group) as every TELLER command group makes it.

    Help is click's plain layout (``rich_markup_mode=None``): help texts are shown as written (a
    ``uniform:A:B`` stays that, where rich markup turns ``:a:`` into an emoji), flags show no
    metavar, and the text wraps at the terminal's width (up to 120 columns) on word boundaries,
    with no box."""
    kw.setdefault("add_completion", False)
    kw.setdefault("no_args_is_help", True)
    kw.setdefault("context_settings", {"max_content_width": 120})
    return typer.Typer(help=help, rich_markup_mode=None, **kw)


def console(stderr: bool = False) -> Any:
    """The rich console a command prints with: on a terminal, the terminal's width and colours;
    elsewhere (a pipe, a file, a CI log) no wrapping at all (:data:`WIDE`, soft wrap)."""
    from rich.console import Console

    con = Console(stderr=stderr, highlight=False)
    if not con.is_terminal:
        con.soft_wrap = True
        con.width = WIDE
    return con


def progress(con: Any = None, enabled: bool | None = None) -> Any:
    """A rich progress bar (description, bar, done/total, elapsed) on stderr that clears itself
    when done; drawn only on a terminal (``enabled`` overrides). Update it per file, chunk or run,
    never per event."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    con = con or console(stderr=True)
    show = con.is_terminal if enabled is None else enabled
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=con, transient=True, disable=not show)


def status(con: Any, what: str) -> Any:
    """A spinner with ``what`` while a single long call runs (on a terminal only; else nothing)."""
    return con.status(what) if con.is_terminal else contextlib.nullcontext()


def _is_run(p: Path) -> bool:
    return (p / "run.json").is_file() or (p / "events").is_dir()


@contextlib.contextmanager
def fresh_dir(out: Path, force: bool, *, kind: str = "run directory", is_ours: Callable[[Path], bool] = _is_run,
              sources: Iterable[Path] = ()) -> Iterator[None]:
    """Around a command that writes ``out`` from scratch (``-o OUT``): make sure it replaces
    nothing of the user's by accident.

    A missing or empty folder is fine. A folder that already holds something is refused unless
    ``force``; with ``force`` it is replaced when ``is_ours`` recognises it (a run directory: run.json
    or events/), and still refused when it holds anything else, so ``--force`` never deletes a
    folder of the user's. The old folder is moved aside while the command runs and put back when
    it fails with an error, so a failed ``--force`` loses nothing. When one of ``sources`` lies in ``out`` the
    command works on that folder itself (``teller ingest RUN -o RUN`` validates it) and nothing is
    checked or moved."""
    out = Path(out)
    aside = None
    if out.exists() and not out.is_dir():
        raise TellerError(f"{out}: exists and is not a directory; choose another -o")
    res = out.resolve()
    inside = any(Path(s).resolve() == res or res in Path(s).resolve().parents for s in sources)
    if out.is_dir() and any(out.iterdir()) and not inside:
        ours = is_ours(out)
        if not force:
            what = f"a {kind}" if ours else "files"
            raise TellerError(f"{out}: already exists and holds {what}; pass --force to replace it, "
                              "or choose another -o directory")
        if not ours:
            raise TellerError(f"{out}: holds files but no {kind}; --force replaces only a {kind}, "
                              "so choose another -o directory (or empty this one)")
        aside = out.with_name(f".{out.name}.replaced-{os.getpid()}")
        out.rename(aside)
    try:
        yield
    except Exception:  # the command failed: the old folder comes back (an interrupt keeps the new one)
        if aside is not None:
            shutil.rmtree(out, ignore_errors=True)
            aside.rename(out)
            aside = None
        raise
    finally:
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)


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
