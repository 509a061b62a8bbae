"""Run a command in a private network namespace whose loopback is up:

    python -m teller.inject.netns -- CMD [ARG...]
    python -m teller.inject.netns --probe      # JSON: what this machine allows (see probe())

The command replaces this process (``exec``), so the recorder sees it as the process it started;
its children (the tensor-parallel ranks) inherit the namespace. Inside, the ranks reach each other
over a loopback of their own, on which a link fault (``link_throttle``, ``netem_link``) installs
its queueing discipline without touching the machine's network. Needs root (``CAP_SYS_ADMIN`` and
``CAP_NET_ADMIN``); when the namespace cannot be made the command is not run and the exit code is
3, with the reason on stderr.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from typing import Any

from teller.inject import netlink

EXIT_NO_NAMESPACE = 3
#: set for the command: "PARENT:OWN", the inodes of the namespace it was started from and of its own
ENV_NETNS = "TELLER_NETNS"


def namespace_inode() -> int:
    """The inode of this process's network namespace."""
    return os.stat("/proc/self/ns/net").st_ino


def _probe_here() -> dict[str, Any]:
    """Try, in this process (which it moves into a new namespace: a process of its own), to make a
    private namespace, bring its loopback up and add and remove a ``tbf`` and a ``netem``
    discipline; each answer is ``"ok"`` or the error."""
    res: dict[str, Any] = {}
    try:
        netlink.unshare_net()
        res["namespace"] = "ok"
        netlink.link_up()
        res["loopback_up"] = "ok"
    except OSError as e:
        res["namespace" if "namespace" not in res else "loopback_up"] = f"{type(e).__name__}: {e}"
        return res
    for kind, add in (("tbf", lambda: netlink.tbf_add(25_000_000, 256 * 1024)), ("netem", lambda: netlink.netem_add(0.001))):
        try:
            add()
            netlink.root_qdisc_del()
            res[kind] = "ok"
        except OSError as e:
            res[kind] = f"{type(e).__name__}: {e}"
    return res


def probe() -> dict[str, Any]:
    """What :func:`_probe_here` finds, from a child process (this one is left as it is)."""
    if os.geteuid() != 0:
        return {"namespace": "not root"}
    try:
        r = subprocess.run([sys.executable, "-m", "teller.inject.netns", "--probe"], capture_output=True, text=True, timeout=60)
        return json.loads(r.stdout.strip().splitlines()[-1])
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired) as e:
        return {"namespace": f"the probe process gave no answer ({type(e).__name__}: {e})"}


@functools.cache
def cached_probe() -> dict[str, Any]:
    """:func:`probe`, run once per process."""
    return probe()


def unavailable(kind: str) -> str | None:
    """Why a ``kind`` (tbf | netem) discipline on a private loopback cannot be used here, or None."""
    p = cached_probe()
    if p.get("namespace") != "ok":
        return f"no private network namespace here ({p.get('namespace')})"
    if p.get("loopback_up") != "ok":
        return f"the namespace's loopback cannot be brought up ({p.get('loopback_up')})"
    if p.get(kind) != "ok":
        why = p.get(kind)
        if kind == "netem" and "No such file" in str(why):
            why = "the kernel has no netem qdisc (sch_netem not built or loaded)"
        return f"no {kind} qdisc on a private loopback: {why}"
    return None


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--probe"]:
        print(json.dumps(_probe_here() if os.geteuid() == 0 else {"namespace": "not root"}))
        return 0
    if args[:1] == ["--"]:
        args = args[1:]
    if not args:
        print("usage: python -m teller.inject.netns -- CMD [ARG...]", file=sys.stderr)
        return 2
    try:
        parent = namespace_inode()
        netlink.unshare_net()
        netlink.link_up()
        os.environ[ENV_NETNS] = f"{parent}:{namespace_inode()}"
    except OSError as e:
        print(f"teller.inject.netns: cannot make a private network namespace for {args[0]} ({e}); "
              "run as root, or leave network faults out of the campaign", file=sys.stderr)
        return EXIT_NO_NAMESPACE
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvp(args[0], args)
    except OSError as e:
        print(f"teller.inject.netns: cannot run {args[0]}: {e}", file=sys.stderr)
        return 127
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
