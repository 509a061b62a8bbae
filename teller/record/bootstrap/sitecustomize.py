"""TELLER's bootstrap: put this folder first on PYTHONPATH and every Python process records.

``teller record`` prepends this folder (which has no ``__init__``) to ``PYTHONPATH``. At start-up
Python imports it as ``sitecustomize``; it then

1. chain-loads the ``sitecustomize`` that would have run without TELLER (the next one on
   ``sys.path``), so a site's own customisation still happens, and leaves that module in
   ``sys.modules["sitecustomize"]``;
2. when ``TELLER_RUN_DIR`` is set, activates :mod:`teller.record.runtime`, which only registers
   post-import hooks: nothing heavy is imported, torch is not imported and CUDA is not touched;
3. then calls the extensions named in ``TELLER_EXTENSIONS`` (``module:function`` entries,
   comma-separated; a fault campaign names its in-engine applier, ``teller.inject.agent:install``,
   there) with the runtime, after the recorder's own hooks so their wrappers sit outside the
   recorder's. The recorder itself knows nothing of them.

It runs once per process (idempotent per pid) and never raises: a failure prints one
``[teller]`` line and the program runs unrecorded.
"""

import os
import sys


def _chain_load(here):
    import importlib.machinery
    import importlib.util

    paths = []
    for p in sys.path:
        try:
            if os.path.samefile(p or os.getcwd(), here):
                continue
        except OSError:
            pass
        paths.append(p)
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", paths)
    if spec is None or spec.loader is None:
        return
    if spec.origin and os.path.abspath(spec.origin) == os.path.abspath(__file__):
        return
    mod = importlib.util.module_from_spec(spec)
    ours = sys.modules.get("sitecustomize")
    sys.modules["sitecustomize"] = mod
    try:
        spec.loader.exec_module(mod)
    except Exception as e:  # what site.py does for a failing sitecustomize
        sys.modules["sitecustomize"] = ours
        sys.stderr.write(f"Error in sitecustomize; set PYTHONVERBOSE for traceback:\n{type(e).__name__}: {e}\n")


def _activate():
    if not os.environ.get("TELLER_RUN_DIR"):
        return
    try:  # teller is imported only into processes that are recorded
        from teller.record import runtime
    except ImportError:
        home = os.environ.get("TELLER_HOME")
        if not home or home in sys.path:
            raise
        sys.path.append(home)  # at the end: never shadows the program's own modules
        from teller.record import runtime
    if runtime.activate() is not None:
        _load_extensions(runtime)


def _load_extensions(runtime):
    """Call each ``module:function`` of ``TELLER_EXTENSIONS`` with the runtime; a failing one is
    one ``[teller]`` line and the others still load."""
    import importlib

    for entry in os.environ.get(runtime.ENV_EXTENSIONS, "").split(","):
        entry = entry.strip()
        if not entry:
            continue
        try:
            mod_name, _, fn_name = entry.partition(":")
            getattr(importlib.import_module(mod_name), fn_name or "install")(runtime)
        except Exception as e:
            runtime.log(f"extension {entry} not loaded ({type(e).__name__}: {e})")


def _main():
    if getattr(sys, "_teller_bootstrap_pid", None) == os.getpid():
        return
    sys._teller_bootstrap_pid = os.getpid()
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        _chain_load(here)
    except Exception as e:
        sys.stderr.write(f"[teller] could not chain-load the next sitecustomize ({type(e).__name__}: {e})\n")
    try:
        _activate()
    except Exception as e:
        sys.stderr.write(f"[teller] recording disabled in pid {os.getpid()} ({type(e).__name__}: {e})\n")


_main()
