"""The resource limits (rlimits) a rank runs with: the submitting user's, capped by the admin's.

A rank forked by the daemon would inherit the daemon's limits — root's, often
raised by the service manager (``LimitNOFILE=65536``, no core size limit,
no process limit) — and so get what its user's own shell does not. Instead,
at submit the daemon reads the client's limits from the kernel
(``/proc/<pid>/limits`` of the SO_PEERCRED pid; never from the wire), keeps
them in the job's record, and each rank sets ``min(user's, admin cap)`` for
every resource before it drops privileges (:mod:`gangd.daemon.ranks`).

A limit read from a process of the same uid is one that user could have set
themselves (an unprivileged process can only lower its hard limits), so a
client that exits and leaves its pid to another process gains nothing: if
that process is not the user's, the limits are not taken. Jobs with no
limits recorded (submitted by an older daemon) get the limits of pid 1, the
system's defaults, under the same caps.
"""

from __future__ import annotations

import logging
import resource

log = logging.getLogger("gangd.limits")

#: /proc/<pid>/limits row -> our name (RLIMIT_<NAME> lower case)
PROC_NAMES = {
    "Max cpu time": "cpu",
    "Max file size": "fsize",
    "Max data size": "data",
    "Max stack size": "stack",
    "Max core file size": "core",
    "Max resident set": "rss",
    "Max processes": "nproc",
    "Max open files": "nofile",
    "Max locked memory": "memlock",
    "Max address space": "as",
    "Max file locks": "locks",
    "Max pending signals": "sigpending",
    "Max msgqueue size": "msgqueue",
    "Max nice priority": "nice",
    "Max realtime priority": "rtprio",
    "Max realtime timeout": "rttime",
}
NAMES = {name: getattr(resource, f"RLIMIT_{name.upper()}") for name in PROC_NAMES.values() if hasattr(resource, f"RLIMIT_{name.upper()}")}
UNLIMITED = -1  # how the record spells RLIM_INFINITY
MAX_LIMITS_FILE = 8192


def _value(text: str) -> int:
    return UNLIMITED if text == "unlimited" else int(text)


def read_process_limits(pid: int, uid: int | None = None) -> dict[str, list[int]] | None:
    """{name: [soft, hard]} of a live process (-1 = unlimited), or None if it
    is gone, unreadable, or (with ``uid``) not that user's process.
    Blocking (procfs): call through ``trio.to_thread``."""
    try:
        if uid is not None:
            with open(f"/proc/{pid}/status", "rb") as fh:
                status = fh.read(MAX_LIMITS_FILE).decode(errors="replace")
            real = next((line.split()[1:] for line in status.splitlines() if line.startswith("Uid:")), None)
            if not real or int(real[0]) != uid:
                return None
        with open(f"/proc/{pid}/limits", "rb") as fh:
            text = fh.read(MAX_LIMITS_FILE).decode(errors="replace")
    except (OSError, ValueError):
        return None
    found: dict[str, list[int]] = {}
    for line in text.splitlines()[1:]:
        label = line[:26].strip()
        name = PROC_NAMES.get(label)
        fields = line[26:].split()
        if name is None or len(fields) < 2:
            continue
        try:
            found[name] = [_value(fields[0]), _value(fields[1])]
        except ValueError:
            continue
    return found or None


def _min(a: int, b: int) -> int:
    if a == UNLIMITED:
        return b
    if b == UNLIMITED:
        return a
    return min(a, b)


def effective(recorded: dict | None, caps: dict[str, int], fallback: dict[str, list[int]] | None) -> list[tuple[int, int, int]]:
    """[(RLIMIT_x, soft, hard)] for a rank: the recorded user limits (else
    ``fallback``), each value capped by ``caps`` (admin's, per name)."""
    source = recorded if isinstance(recorded, dict) else (fallback or {})
    result = []
    for name, number in NAMES.items():
        pair = source.get(name)
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and all(isinstance(v, int) and not isinstance(v, bool) and v >= UNLIMITED for v in pair)):
            pair = [UNLIMITED, UNLIMITED] if name in caps else None
        if pair is None:
            continue
        hard = _min(pair[1], caps.get(name, UNLIMITED))
        soft = _min(_min(pair[0], hard), caps.get(name, UNLIMITED))
        if name == "nofile":
            nr_open = _nr_open()
            hard, soft = _min(hard, nr_open), _min(soft, nr_open)
        result.append((number, _rlim(soft), _rlim(hard)))
    return result


def _rlim(value: int) -> int:
    return resource.RLIM_INFINITY if value == UNLIMITED else value


def _nr_open() -> int:
    try:
        with open("/proc/sys/fs/nr_open") as fh:
            return int(fh.read().strip())
    except (OSError, ValueError):
        return 1 << 20
