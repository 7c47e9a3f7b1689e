"""The job model shared by the daemons and the ``gang`` client.

A job record is a plain dict so it travels over msgpack and lands on disk as
is. The coordinator is its only writer; every node keeps a replica (see
:mod:`gangd.daemon.table`). Rank statuses are a list indexed by rank.
"""

from __future__ import annotations

import secrets
import signal
import time
from dataclasses import dataclass, field

from . import text

QUEUED = "QUEUED"
RUNNING = "RUNNING"
SUSPENDED = "SUSPENDED"
CHECKPOINTING = "CHECKPOINTING"
#: A node of the job was lost and the job is being restarted from its newest
#: usable checkpoint on live nodes (see :mod:`gangd.daemon.recover`): its ranks
#: are gone, its computation goes on in a new job of its lineage.
RECOVERING = "RECOVERING"
DONE = "DONE"
FAILED = "FAILED"
KILLED = "KILLED"
#: Ended by a recovery: the computation goes on in the job ``requeued_as``
#: names (`gang wait` and `gang run` follow it there).
REQUEUED = "REQUEUED"

ACTIVE_STATES = (QUEUED, RUNNING, SUSPENDED, CHECKPOINTING, RECOVERING)
TERMINAL_STATES = (DONE, FAILED, KILLED, REQUEUED)

# Exit codes of `gang run` / `gang wait` beyond the ranks' own codes.
EXIT_KILLED = 128 + signal.SIGKILL  # the job was killed by its owner or root
EXIT_FAILED_NO_RANK = 1  # failed for a reason that is not a rank's exit code


#: Bytes of a job's command line and environment together, counted as the
#: kernel counts them (each string and its NUL). Both go into etcd in the one
#: transaction that creates the job (the command line in the record, the
#: environment in a key of its own), and etcd refuses a request above 1.5 MiB
#: by default: 1 MiB leaves room for the rest and is far more than any real
#: job passes (Linux's own ARG_MAX is 2 MiB).
MAX_ARGV_ENV_BYTES = 1024 * 1024
MAX_CWD_BYTES = 4096  # PATH_MAX
MAX_NAME_CHARS = 1024  # (shown cut to text.MAX_NAME)
MAX_NRANKS = 1 << 20  # far beyond any cluster; the coordinator checks the real capacity
#: A network context (the messages a captured job had in flight, see
#: gangd.comm.context) is held by the coordinator until the job launches.
# A context handed over at submit travels in one client request (at most
# protocol.MAX_CLIENT_REQUEST, 4 MiB), so a job's contexts stay below that.
MAX_CONTEXT_RANK_BYTES = 3584 * 1024
MAX_CONTEXT_JOB_BYTES = 3584 * 1024


class BadSpec(Exception):
    """A job spec that cannot be a job: ``code`` (bad_request) and a sentence for the user."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


def _encoded(value: str) -> int:
    return len(value.encode("utf-8", "surrogatepass"))


def _positive(spec: dict, key: str, what: str) -> int | None:
    value = spec.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise BadSpec("bad_request", f"{what} must be a positive integer, not {value!r}")
    return value


def _number(spec: dict, key: str, low: float, high: float, message: str) -> float | None:
    value = spec.get(key)
    if value is None:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not low <= value <= high:
        raise BadSpec("bad_request", message.format(value=value))
    return value


def _flag(spec: dict, key: str, default: bool) -> bool:
    value = spec.get(key)
    if value is None:
        return default
    if not isinstance(value, (bool, int)):
        raise BadSpec("bad_request", f"{key!r} must be true or false, not {value!r}")
    return bool(value)


@dataclass(frozen=True)
class JobSpec:
    """What a client asks to run, checked once where it comes in (the coordinator's submit).

    Everything here is bounded: a record is kept by every node, on disk and in
    memory, for as long as the cluster keeps the job, and travels whole in
    the table's replication; its size must not be the submitter's choice."""

    argv: tuple[str, ...]
    nranks: int
    name: str | None = None
    cwd: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    per_node: int | None = None
    nodes: int | None = None
    nodelist: tuple[str, ...] | None = None
    kill_on_bad_exit: bool = True
    priority: int | None = None
    slice: float | None = None
    ckpt_every: float | str | None = None  # seconds, or "auto": the interval planned from measurements (issue 19)
    mpi: bool = False
    ckpt_redundancy: str | None = None  # local, partner, xor; None: the cluster's [checkpoint] redundancy
    ckpt_mode: str | None = None  # full, incremental, differential, adaptive; None: the cluster's [checkpoint] mode
    ckpt_codec: str | None = None  # a canonical codec spec (zstd:3, blosc2:zstd:1:shuffle, auto...); None: the cluster's [checkpoint] codec
    ckpt_pipeline: str | None = None  # canonical pipeline settings (buffer_size=256KiB,workers=2); None: the cluster's [checkpoint] pipeline
    requeue: bool | None = None  # restarted by itself when a node is lost; None: when it has checkpoints (see gangd.daemon.recover)
    net_context: dict[str, bytes] | None = None

    @classmethod
    def from_wire(cls, spec: object, node_names: list[str]) -> JobSpec:
        """``spec`` as it came over the wire, checked; raises :class:`BadSpec` saying what is wrong."""
        if not isinstance(spec, dict):
            raise BadSpec("bad_request", "submit needs a job spec (a map)")
        argv = spec.get("argv")
        if not isinstance(argv, (list, tuple)) or not argv or not all(isinstance(a, str) for a in argv):
            raise BadSpec("bad_request", "a job needs a command to run (a list of strings)")
        if not argv[0]:
            raise BadSpec("bad_request", "the job's command is empty")
        if any("\0" in a for a in argv):
            raise BadSpec("bad_request", "the job's command line holds a NUL character, which no program can be given")
        env = spec.get("env")
        if env is None:
            env = {}
        if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
            raise BadSpec("bad_request", "the environment must map strings to strings")
        for key, value in env.items():
            if not key or "=" in key or "\0" in key or "\0" in value:
                raise BadSpec("bad_request", f"bad environment variable {text.printable(key, 64)!r}: a name must be non-empty, without '=' or NUL")
        size = sum(_encoded(a) + 1 for a in argv) + sum(_encoded(k) + _encoded(v) + 2 for k, v in env.items())
        if size > MAX_ARGV_ENV_BYTES:
            raise BadSpec(
                "bad_request",
                f"the job's command line and environment take {size} bytes; at most {MAX_ARGV_ENV_BYTES} are allowed "
                "(as Linux allows a program: pass large inputs in a file)",
            )
        for key, limit in (("name", MAX_NAME_CHARS), ("cwd", MAX_CWD_BYTES)):
            value = spec.get(key)
            if value is not None and not isinstance(value, str):
                raise BadSpec("bad_request", f"{key!r} must be a string")
            if value is not None and (len(value) > limit or _encoded(value) > limit):
                raise BadSpec("bad_request", f"the job's {key} is longer than {limit} characters")
        cwd = spec.get("cwd")
        if cwd is not None and "\0" in cwd:
            raise BadSpec("bad_request", "the working directory holds a NUL character")
        nranks = spec.get("nranks")
        if not isinstance(nranks, int) or isinstance(nranks, bool) or not 1 <= nranks <= MAX_NRANKS:
            raise BadSpec("bad_request", f"the number of ranks must be a positive integer (at most {MAX_NRANKS}), not {nranks!r}")
        per_node = _positive(spec, "per_node", "'per_node'")
        nodes = _positive(spec, "nodes", "'nodes'")
        if nodes is not None and nodes > len(node_names):
            raise BadSpec("bad_request", f"--nodes must be between 1 and {len(node_names)}, not {nodes}")
        nodelist = spec.get("nodelist")
        if nodelist is not None:
            if not isinstance(nodelist, (list, tuple)) or not all(isinstance(n, str) for n in nodelist):
                raise BadSpec("bad_request", "'nodelist' must be a list of node names")
            if len(nodelist) > len(node_names) or len(set(nodelist)) != len(nodelist):
                raise BadSpec("bad_request", f"--nodelist names {len(nodelist)} nodes, some twice or more: the cluster has {len(node_names)}")
            for name in nodelist:
                if name not in node_names:
                    raise BadSpec("bad_request", f"unknown node {text.printable(name, 64)!r} in --nodelist (nodes: {', '.join(node_names)})")
            nodelist = tuple(nodelist)
        if nodes and per_node and nodes * per_node < nranks:
            raise BadSpec("bad_request", f"{nranks} ranks do not fit on {nodes} node(s) with {per_node} per node")
        priority = spec.get("priority")
        if priority is not None and (not isinstance(priority, int) or isinstance(priority, bool) or abs(priority) > 1 << 31):
            raise BadSpec("bad_request", f"'priority' must be an integer, not {priority!r}")
        slice_ = _number(spec, "slice", 0.001, 3600, "the time slice must be between 0.001 and 3600 seconds, not {value!r}")
        every: float | str | None = "auto" if spec.get("ckpt_every") == "auto" else _number(
            spec, "ckpt_every", 1, 10**7, "the checkpoint period must be 'auto' or between 1 second and 115 days, not {value!r}")
        redundancy = _redundancy(spec, nranks, nodelist, nodes, node_names)
        mode = _ckpt_mode(spec)
        codec = ckpt_codec(spec.get("ckpt_codec"))
        pipeline = ckpt_pipeline(spec.get("ckpt_pipeline"))
        contexts = spec.get("net_context")
        if contexts is not None:
            if not isinstance(contexts, dict) or not all(
                isinstance(k, str) and k.isdigit() and int(k) < nranks and isinstance(v, bytes) for k, v in contexts.items()
            ):
                raise BadSpec(
                    "bad_request", "'net_context' must map rank numbers (as strings, below the number of ranks) to the bytes of their network context"
                )
            biggest = max((len(v) for v in contexts.values()), default=0)
            if biggest > MAX_CONTEXT_RANK_BYTES:
                raise BadSpec("bad_request", f"a rank's network context may hold at most {MAX_CONTEXT_RANK_BYTES} bytes, not {biggest}")
            total = sum(len(v) for v in contexts.values())
            if total > MAX_CONTEXT_JOB_BYTES:
                raise BadSpec("bad_request", f"a job's network context may hold at most {MAX_CONTEXT_JOB_BYTES} bytes, not {total}")
        return cls(
            argv=tuple(argv),
            nranks=nranks,
            name=spec.get("name"),
            cwd=cwd,
            env=dict(env),
            per_node=per_node,
            nodes=nodes,
            nodelist=nodelist,
            kill_on_bad_exit=_flag(spec, "kill_on_bad_exit", True),
            priority=priority,
            slice=slice_,
            ckpt_every=every,
            mpi=_flag(spec, "mpi", False),
            ckpt_redundancy=redundancy,
            ckpt_mode=mode,
            ckpt_codec=codec,
            ckpt_pipeline=pipeline,
            requeue=None if spec.get("requeue") is None else _flag(spec, "requeue", True),
            net_context=dict(contexts) if contexts else None,
        )

    @property
    def context_bytes(self) -> int:
        return sum(len(v) for v in (self.net_context or {}).values())

    def as_spec(self) -> dict:
        """The spec as :func:`new_record` and placement read it (no network context: it is not kept in records)."""
        return {
            "argv": list(self.argv), "nranks": self.nranks, "name": self.name, "cwd": self.cwd, "env": dict(self.env),
            "per_node": self.per_node, "nodes": self.nodes, "nodelist": list(self.nodelist) if self.nodelist is not None else None,
            "kill_on_bad_exit": self.kill_on_bad_exit, "priority": self.priority, "slice": self.slice,
            "ckpt_every": self.ckpt_every, "mpi": self.mpi, "ckpt_redundancy": self.ckpt_redundancy,
            "ckpt_mode": self.ckpt_mode, "ckpt_codec": self.ckpt_codec, "ckpt_pipeline": self.ckpt_pipeline, "requeue": self.requeue,
        }


#: What ``--ckpt-redundancy`` may ask for (:data:`gangd.redundancy.plan.LEVELS`).
REDUNDANCY_LEVELS = ("local", "partner", "xor")


def _redundancy(spec: dict, nranks: int, nodelist, nodes: int | None, node_names: list[str]) -> str | None:
    """The job's checkpoint redundancy level, refused where the job can never
    span the two nodes ``partner`` and ``xor`` need."""
    level = spec.get("ckpt_redundancy")
    if level is None:
        return None
    _one_of(level, REDUNDANCY_LEVELS, "the checkpoint redundancy")
    if level == "local":
        return level
    span = min(nranks, len(nodelist) if nodelist else nodes if nodes else len(node_names))
    if span < 2:
        where = (
            "it has one rank" if nranks < 2 else "--nodelist names one node" if nodelist else "--nodes is 1" if nodes else "the cluster has one node"
        )
        raise BadSpec(
            "bad_request",
            f"--ckpt-redundancy {level} keeps each node's checkpoint on other nodes, so the job must span at least 2 nodes; "
            f"this one never can ({where}): use --ckpt-redundancy local",
        )
    return level


#: What ``--ckpt-mode`` may ask for (:data:`gangd.checkpoint.messages.MODES`).
CKPT_MODES = ("full", "incremental", "differential", "adaptive")


def _ckpt_mode(spec: dict) -> str | None:
    """The job's checkpoint mode (None: the cluster's ``[checkpoint] mode``)."""
    mode = spec.get("ckpt_mode")
    if mode is None:
        return None
    _one_of(mode, CKPT_MODES, "the checkpoint mode")
    return mode


def ckpt_codec(value: object) -> str | None:
    """The job's checkpoint codec (``--ckpt-codec``) in its canonical form
    (``zstd`` -> ``zstd:3``), or None: the cluster's ``[checkpoint] codec``.

    Parsed, never loaded: a plug-in codec this node lacks is accepted (the
    ranks may run on nodes that have it; a rank that lacks it says so when
    it writes), but its text is bounded and well-formed like any spec.
    (gangd.codecs is imported here, for a job that names a codec: every
    `gang` command imports this module, and the package cost it 12-17 ms.)"""
    if value is None:
        return None
    from .codecs.errors import CodecError
    from .codecs.spec import ACCEPTED as CODECS_ACCEPTED
    from .codecs.spec import MAX_TEXT as MAX_CODEC_CHARS
    from .codecs.spec import CodecSpec

    try:
        canonical = str(CodecSpec.parse(value))
    except CodecError as exc:
        shown = text.printable(text.brief(value, 40, quote=False), 40)
        why = text.printable(exc.message, 200).split(" (accepted:", 1)[0]
        raise BadSpec("bad_request", f"the checkpoint codec {shown!r} is not accepted: {why}; accepted: {CODECS_ACCEPTED}") from None
    if len(canonical) > MAX_CODEC_CHARS:  # (parse keeps a spec's text; never longer than what it was given)
        raise BadSpec("bad_request", f"the checkpoint codec is longer than {MAX_CODEC_CHARS} characters")
    return canonical


def ckpt_pipeline(value: object) -> str | None:
    """The job's checkpoint pipeline settings (``--ckpt-pipeline``) in their canonical spelling
    (``buffer_size=256KiB,workers=2``), or None: the cluster's ``[checkpoint] pipeline``. Only the
    settings named travel; the others are each node's defaults (workers follow the node's cores)."""
    if value is None:
        return None
    from .pipeline.settings import SettingsError, canonical, parse

    try:
        return canonical(parse(value)) or None
    except SettingsError as exc:
        raise BadSpec("bad_request", f"--ckpt-pipeline: {text.printable(str(exc), 200)}") from None


def _one_of(value: object, allowed: tuple[str, ...], what: str) -> None:
    """BadSpec unless ``value`` is one of ``allowed`` (quoted briefly: a huge value is not rendered whole)."""
    if value not in allowed:
        shown = text.printable(text.brief(value, 40, quote=False), 40)
        raise BadSpec("bad_request", f"{what} must be one of {', '.join(allowed)}, not {shown!r}")


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
        "held_uid": None,  # their uid: a job root suspended only root resumes
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
        "ckpt_redundancy": spec.get("ckpt_redundancy"),  # local/partner/xor; None: the cluster's default
        "ckpt_mode": spec.get("ckpt_mode"),  # full/incremental/differential/adaptive; None: the lineage's, else the cluster's
        "ckpt_codec": spec.get("ckpt_codec"),  # canonical codec spec (zstd:3...); None: the lineage's, else the cluster's
        "ckpt_pipeline": spec.get("ckpt_pipeline"),  # canonical pipeline settings; None: the lineage's, else the cluster's
        "checkpoints": [],  # generations this job took: see gangd.daemon.ckptcoord
        "requeue": spec.get("requeue"),  # True/False: --requeue/--no-requeue; None: requeue when it has checkpoints
        "lineage": job_id,  # the first job of a restart chain: its checkpoints are the chain's
        "restart_of": None,  # {"job", "gen", "iteration"} this job continues from
        "pinned": None,  # placement a restart must have (where its checkpoint is)
        "seq": 0,
    }


def segment_of(record: dict, rank: int) -> tuple[list[str], int]:
    """(the command rank ``rank`` runs, its MPI appnum). A job spawned by
    ``MPI_Comm_spawn_multiple`` runs one command per segment, in rank order
    (its record's ``segments``: ``[argv, nprocs]`` each); any other job its ``argv``."""
    first = 0
    for appnum, (argv, nprocs) in enumerate(record.get("segments") or ()):
        if rank < first + nprocs:
            return list(argv), appnum
        first += nprocs
    return record["argv"], 0


def is_terminal(record: dict) -> bool:
    return record["state"] in TERMINAL_STATES


def successor(record: dict) -> int | None:
    """The job a recovery requeued this one as (its computation goes on there), or None."""
    new = record.get("requeued_as") if record.get("state") == REQUEUED else None
    return new if isinstance(new, int) and not isinstance(new, bool) and new > record.get("id", 0) else None


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


#: Characters of an exit's reason a node records and a status shows (a peer's status is cut again here).
MAX_EXIT_WHY = 500
#: Ranks of one job whose exits keep their reason: the record stays small however many ranks fail saying why.
MAX_EXIT_WHYS = 16


def record_exits(ranks: list, exits) -> None:
    """Put each ``(rank, status)`` of ``exits`` whose rank has none yet into a job
    record's ``ranks``, as the record keeps it: its reason cut to
    :data:`MAX_EXIT_WHY` characters, or dropped once :data:`MAX_EXIT_WHYS` ranks
    have one (a job of thousands of ranks failing with a sentence each stays a
    small record; the job's reason is the first culprit's). The reasons already
    kept are counted once per batch, not once per exit."""
    kept = sum(1 for s in ranks if s and "why" in s)
    for rank, status in exits:
        if ranks[rank] is not None:
            continue
        why = status.get("why")
        if why is None:
            ranks[rank] = status
        elif kept >= MAX_EXIT_WHYS or not isinstance(why, str):
            ranks[rank] = {k: v for k, v in status.items() if k != "why"}
        else:
            ranks[rank] = {**status, "why": why[:MAX_EXIT_WHY]}
            kept += 1


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
    why = status.get("why")
    if isinstance(why, str) and why:  # (a rank that could not start; one whose ckpt.init() refused its settings)
        return f"exit {status.get('code', 0)} ({text.printable(why)[:MAX_EXIT_WHY]})"
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
    for prefix, found in groups.items():
        numbers = sorted(set(found))
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
