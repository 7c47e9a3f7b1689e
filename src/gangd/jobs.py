"""The job model shared by the daemons and the ``gang`` client.

A job record is a plain dict so it travels over msgpack and lands on disk as
is. The coordinator is its only writer; every node keeps a replica (see
:mod:`gangd.daemon.table`). Rank statuses are a list indexed by rank.
"""

from __future__ import annotations

import secrets
import signal
import time

from . import text

QUEUED = "QUEUED"
RUNNING = "RUNNING"
SUSPENDED = "SUSPENDED"
CHECKPOINTING = "CHECKPOINTING"
DONE = "DONE"
FAILED = "FAILED"
KILLED = "KILLED"

ACTIVE_STATES = (QUEUED, RUNNING, SUSPENDED, CHECKPOINTING)
TERMINAL_STATES = (DONE, FAILED, KILLED)

# Exit codes of `gang run` / `gang wait` beyond the ranks' own codes.
EXIT_KILLED = 128 + signal.SIGKILL  # the job was killed by its owner or root
EXIT_FAILED_NO_RANK = 1  # failed for a reason that is not a rank's exit code


def new_record(*, job_id: int, spec: dict, owner_uid: int, owner_name: str, owner_gid: int) -> dict:
    return {
        "id": job_id,
        "name": text.name(spec.get("name") or spec["argv"][0].rsplit("/", 1)[-1]),  # everyone sees it
        "owner_uid": owner_uid,
        "owner_gid": owner_gid,
        "owner": owner_name,
        "argv": list(spec["argv"]),
        "cwd": spec.get("cwd") or "/",
        "env": dict(spec.get("env") or {}),  # the submitter's secrets too: dropped when the job ends (see at_rest)
        "nranks": int(spec["nranks"]),
        "per_node": spec.get("per_node"),
        "nodes_wanted": spec.get("nodes"),
        "nodelist": spec.get("nodelist"),
        "kill_on_bad_exit": bool(spec.get("kill_on_bad_exit", True)),
        "priority": int(spec.get("priority") or 0),  # higher goes first in the queue
        "slice": spec.get("slice"),  # seconds per gang time slice, None: the cluster's
        "held": None,  # who suspended it (gang suspend), while suspended
        "token": secrets.token_hex(16),  # ranks present it to each other: no stranger joins the job's network
        "placement": [],  # node name of each rank
        "state": QUEUED,
        "reason": "",
        "submitted": time.time(),
        "started": None,
        "ended": None,
        "ranks": [None] * int(spec["nranks"]),  # rank status once it exited
        "kill_requested": None,  # who asked, if the job was killed
        "mpi": bool(spec.get("mpi")),  # ranks get PMI-1 from their daemons (MPICH's process manager)
        "ckpt_every": spec.get("ckpt_every"),  # seconds between checkpoints, None: only on request
        "checkpoints": [],  # generations this job took: see gangd.daemon.ckptcoord
        "lineage": job_id,  # the first job of a restart chain: its checkpoints are the chain's
        "restart_of": None,  # {"job", "gen", "iteration"} this job continues from
        "pinned": None,  # placement a restart must have (where its checkpoint is)
        "seq": 0,
    }


def is_terminal(record: dict) -> bool:
    return record["state"] in TERMINAL_STATES


#: Fields of a record only its running ranks need: the submitter's environment
#: (tokens, credentials). Every node holds the table, on disk, for as long as
#: it keeps the job: these leave the record when the job ends (a restart takes
#: them from the checkpoint, readable by root and the owner only).
PRIVATE_FIELDS = ("env",)


def at_rest(record: dict) -> dict:
    """``record`` as a node keeps it: an ended job's private fields dropped (in place)."""
    if record.get("state") in TERMINAL_STATES:
        for key in PRIVATE_FIELDS:
            record.pop(key, None)
    return record


def nodes_of(record: dict) -> list[str]:
    """Distinct nodes of a placed job, in rank order."""
    return list(dict.fromkeys(record["placement"]))


def ranks_on(record: dict, node: str) -> list[int]:
    return [rank for rank, where in enumerate(record["placement"]) if where == node]


def describe_status(status: dict | None) -> str:
    if status is None:
        return "running"
    if status.get("lost"):
        return f"lost ({status.get('why', 'node down')})"
    if status.get("unkillable"):
        return f"killed by gangd but {status.get('why', 'unkillable')}"
    if status.get("signal"):
        name = _signal_name(status["signal"])
        how = " by gangd" if status.get("killed") else ""
        return f"killed by {name}{how}"
    return f"exit {status.get('code', 0)}"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def exit_code(record: dict) -> int:
    """The exit code `gang run` and `gang wait` return for a finished job.

    The worst rank that ended on its own decides: a signal death counts as
    128+N (the shell's convention) and beats any exit code. Ranks that gangd
    killed as a consequence (the job was killed, or another rank failed) do
    not count — they did nothing wrong.

    Whatever a rank or a record says, a job that did not end DONE never
    returns 0 (a shell sees only the low 8 bits: 256 would read as success).
    """
    if record["state"] == DONE:
        return 0
    worst = 0
    for status in record["ranks"]:
        if not status or status.get("killed") or status.get("lost"):
            continue
        code = 128 + _small(status.get("signal")) if status.get("signal") else _small(status.get("code", 0))
        worst = max(worst, code)
    if "abort_code" in record:
        # An MPI rank called MPI_Abort(comm, code): 1..255 (checked where it came in, and here).
        worst = max(worst, _exit_status(record.get("abort_code")))
    if 0 < worst <= 255:
        return worst
    if worst:
        return EXIT_FAILED_NO_RANK
    if record["state"] == KILLED:
        return EXIT_KILLED
    return EXIT_FAILED_NO_RANK


def _small(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 255 else 1


def _exit_status(value: object) -> int:
    """An exit code a job may end with: 1..255, anything else (0, None, 256, junk) is 1."""
    return value if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 255 else 1


def elapsed(record: dict, now: float | None = None) -> float:
    if not record.get("started"):
        return 0.0
    end = record.get("ended") or (now or time.time())
    return max(0.0, end - record["started"])


def format_duration(seconds: float) -> str:
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}:{minutes:02d}:{secs:02d}"
    return f"{minutes}:{secs:02d}"


def compress_nodes(names: list[str]) -> str:
    """n1,n2,n3,n5 -> n[1-3,5] (Slurm's hostlist notation) for tables."""
    if not names:
        return ""
    groups: dict[str, list[int]] = {}
    plain: list[str] = []
    for name in names:
        prefix = name.rstrip("0123456789")
        digits = name[len(prefix):]
        if digits and not (len(digits) > 1 and digits.startswith("0")):
            groups.setdefault(prefix, []).append(int(digits))
        else:
            plain.append(name)
    parts = list(plain)
    for prefix, numbers in groups.items():
        numbers = sorted(set(numbers))
        if len(numbers) == 1:
            parts.append(f"{prefix}{numbers[0]}")
            continue
        spans = []
        start = prev = numbers[0]
        for n in numbers[1:] + [None]:
            if n is not None and n == prev + 1:
                prev = n
                continue
            spans.append(f"{start}" if start == prev else f"{start}-{prev}")
            if n is not None:
                start = prev = n
        parts.append(f"{prefix}[{','.join(spans)}]")
    return ",".join(parts)
