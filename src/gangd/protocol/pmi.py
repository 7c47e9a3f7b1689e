"""PMI-1, the wire protocol MPICH's ranks speak to their process manager — sans-I/O.

One command per line, ``key=value`` pairs separated by spaces, the first
being ``cmd=<name>``::

    cmd=init pmi_version=1 pmi_subversion=1      ->  cmd=response_to_init pmi_version=1 pmi_subversion=1 rc=0
    cmd=put kvsname=K key=k value=v               ->  cmd=put_result rc=0
    cmd=barrier_in                                ->  cmd=barrier_out rc=0
    cmd=get kvsname=K key=k                       ->  cmd=get_result rc=0 value=v
    cmd=publish_name service=S port=P             ->  cmd=publish_result rc=0
    cmd=lookup_name service=S                     ->  cmd=lookup_result rc=0 port=P

except ``spawn``, which is several lines (``mcmd=spawn``, then one
``key=value`` per line, values may hold spaces, ``endcmd`` closing each of
``totspawns`` segments) — MPICH's ``PMIU_cmd_output_v1_mcmd``; the reader
keeps every segment (:class:`Multi`), :func:`spawn` makes it a typed
:class:`Spawn` within the bounds below. (PMI-1 has no escaping: an argument
holding a newline cannot be spawned; its lines read as commands of their
own, the connection breaks, as it does under Hydra.)

(The de-facto standard; Flux RFC 13 documents it; MPICH's own list is
``src/pmi/maint/pmi-1.2.txt``.) Every query a rank may send gets an answer
under the response name MPICH waits for (:data:`RESPONSES`), an error one
for what gangd does not serve: MPICH compares the name before it looks at
``rc``, and a reply under another name (or a dropped connection) is not an
error it reports cleanly to the program. :class:`Reader` turns
bytes into field dicts; :func:`command` turns one into a typed, validated
:data:`Command` — or raises :class:`Refused` carrying the error reply the
rank gets. Everything a rank sends is hostile until it passed here: the
handlers in :mod:`gangd.daemon.pmi` only ever see checked values. No
sockets here.

The limits are the ones the process manager announces in ``cmd=maxes``
(Hydra's: a kvsname of 256 bytes, keys of 64, values of 1024), so a
well-behaved MPICH never hits them: it splits longer business cards
itself.
"""

from __future__ import annotations

from dataclasses import dataclass

#: What ``cmd=get_maxes`` announces, and what ``put``/``get`` enforce (Hydra's values).
KVSNAME_MAX = 256
KEYLEN_MAX = 64
VALLEN_MAX = 1024
#: A line is at most a put of the longest kvsname, key and value, and then some.
MAX_LINE = 4096
#: The name service's limits: a service name as long as a kvsname; a port as
#: MPICH's PMI_MAX_PORT_NAME (1024, with its NUL: PMI_Lookup_name copies the
#: answer into a buffer that size).
SERVICE_MAX = 256
PORT_MAX = 1023
#: A ``spawn`` (many lines) is kept up to this many bytes; past it, its lines
#: are only counted until its end, and it is refused.
MAX_MCMD = 65536
#: What one ``spawn`` may ask for: segments (``spawn_multiple``'s commands),
#: processes in all, arguments per command, keys the parent puts in the
#: children's key-value space (MPICH puts one: ``PARENT_ROOT_PORT_NAME``),
#: info keys per command. The job-wide bounds (spawns per job, processes
#: spawned per job) are the coordinator's (:mod:`gangd.daemon.spawns`).
SPAWN_SEGMENTS_MAX = 16
SPAWN_NPROCS_MAX = 256
SPAWN_ARGS_MAX = 256
SPAWN_PREPUT_MAX = 16
SPAWN_INFO_MAX = 16
#: Nodes a spawn's ``host`` info key may name, and the longest name (a host name's limit).
SPAWN_HOSTS_MAX = 64
SPAWN_HOST_BYTES = 255
#: An executable's name or an argument (each came as one line of the spawn, at most MAX_LINE).
SPAWN_ARG_BYTES = 4000

#: Each PMI-1 query a rank may send, with the name of the response MPICH waits for
#: (``abort`` has none). From MPICH's pmi-1.2.txt, plus the KVS commands of the
#: older simple PMI (create_kvs, destroy_kvs, getbyidx).
RESPONSES = {
    "init": "response_to_init",
    "initack": "initack",
    "finalize": "finalize_ack",
    "get_maxes": "maxes",
    "get_universe_size": "universe_size",
    "get_appnum": "appnum",
    "get_my_kvsname": "my_kvsname",
    "get_rank": "my_rank",
    "get_size": "my_size",
    "put": "put_result",
    "get": "get_result",
    "barrier_in": "barrier_out",
    "publish_name": "publish_result",
    "unpublish_name": "unpublish_result",
    "lookup_name": "lookup_result",
    "spawn": "spawn_result",
    "singinit": "singinit_info",
    "create_kvs": "newkvs",
    "destroy_kvs": "kvs_destroyed",
    "getbyidx": "getbyidx_results",
}
#: What one job's key-value space may hold, per rank (with a floor for small jobs).
KVS_BYTES_PER_RANK = 16 * 1024
KVS_KEYS_PER_RANK = 64
KVS_BYTES_MIN = 1024 * 1024
KVS_KEYS_MIN = 1024


class PMIError(Exception):
    """A line that is not PMI-1: the connection is beyond repair."""


class Refused(PMIError):
    """A well-formed line the process manager will not do: the rank gets ``reply``."""

    def __init__(self, reply_cmd: str, msg: str):
        super().__init__(msg)
        self.reply_cmd = reply_cmd
        self.msg = msg

    def reply(self) -> bytes:
        return line(self.reply_cmd, rc=-1, msg=token(self.msg))


def token(text: str) -> str:
    """``text`` as one PMI-1 value (no quoting exists: spaces become underscores)."""
    return "".join(c if c.isprintable() and not c.isspace() and c != "=" else "_" for c in text)[:200]


def parse(text: str) -> dict[str, str]:
    fields: dict[str, str] = {}
    for item in text.split():
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise PMIError(f"not a key=value pair: {item[:80]!r}")
        fields[key] = value
    if "cmd" not in fields and "mcmd" not in fields:
        raise PMIError(f"no cmd= in {text[:80]!r}")
    return fields


def line(cmd: str, **fields: object) -> bytes:
    """A reply line; values must not contain spaces or newlines (PMI-1 has no quoting)."""
    parts = [f"cmd={cmd}"]
    for key, given in fields.items():
        value = str(given)
        if any(c in value for c in " \n"):
            raise PMIError(f"PMI-1 cannot carry {key}={value[:40]!r}: it has a space or a newline")
        parts.append(f"{key}={value}")
    return (" ".join(parts) + "\n").encode()


class Multi(dict[str, str]):
    """A multi-line command: the fields of its first segment (a dict, as any
    command), and :attr:`segments`, every segment's fields in order."""

    segments: list[dict[str, str]]


class Reader:
    """Bytes in, commands (field dicts) out.

    A ``spawn`` comes as one :class:`Multi`: the fields of its first segment, with
    ``mcmd=spawn``, its ``totspawns``, and ``oversized=1`` when it passed
    :data:`MAX_MCMD` (then only what fit is kept); each segment's fields in
    its ``segments`` (at most :data:`SPAWN_SEGMENTS_MAX`: past that the
    command is marked ``oversized`` too)."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._mcmd: Multi | None = None  # the spawn being read
        self._mcmd_bytes = 0
        self._segment = 1  # which of its segments
        self._segments = 1  # how many it announced

    def feed(self, data: bytes) -> list[dict[str, str]]:
        self._buf += data
        commands = []
        while (end := self._buf.find(b"\n")) >= 0:
            if end > MAX_LINE:
                raise PMIError(f"a line longer than {MAX_LINE} bytes")
            raw = bytes(self._buf[:end])
            del self._buf[: end + 1]
            text = raw.decode("utf-8", errors="replace")
            if self._mcmd is not None:
                done = self._mcmd_line(self._mcmd, text)
                if done is not None:
                    commands.append(done)
                continue
            text = text.strip()
            if text.startswith("mcmd="):
                self._mcmd, self._mcmd_bytes, self._segment, self._segments = Multi(mcmd=text[5:]), len(raw), 1, 1
                self._mcmd.segments = [self._mcmd]
            elif text:
                commands.append(parse(text))
        if len(self._buf) > MAX_LINE:
            raise PMIError(f"a line longer than {MAX_LINE} bytes")
        return commands

    def _mcmd_line(self, fields: Multi, text: str) -> dict[str, str] | None:
        """One line of the multi-line command ``fields``; the command once its last segment ended."""
        self._mcmd_bytes += len(text) + 1
        if text.strip() == "endcmd":
            if self._segment >= self._segments:
                self._mcmd = None
                return fields
            return None
        key, sep, value = text.partition("=")
        key = key.strip()
        if not sep or not key:
            raise PMIError(f"not a key=value line in a multi-line command: {text[:80]!r}")
        if key == "mcmd":  # the next segment begins
            if len(fields.segments) < SPAWN_SEGMENTS_MAX:
                fields.segments.append({"mcmd": value.strip()})
            else:
                fields["oversized"] = "1"
            return None
        if key in ("totspawns", "spawnssofar"):
            number = value.strip()
            if not (number.isascii() and number.isdigit() and len(number) <= 6):  # ('¹'.isdigit(), and int() refuses it)
                raise PMIError(f"{key}={value[:20]!r} is not a count")
            if key == "totspawns":
                self._segments = int(number)
            else:
                self._segment = int(number)
        if self._mcmd_bytes > MAX_MCMD:
            fields["oversized"] = "1"
        else:
            fields.segments[-1].setdefault(key, value)
        return None


# ---------------------------------------------------------------- typed commands


def clamp_exit_code(raw: str) -> tuple[int, bool]:
    """(the exit code a job ends with, whether it is what the rank asked for).

    A process's exit status is 8 bits and 0 means success: a job that was
    aborted ends with 1..255, whatever the rank said (0, 256, -3, 10**30, "x" → 1).
    """
    text = raw.strip()
    if 0 < len(text) <= 4 and text.isdigit() and 1 <= int(text) <= 255:
        return int(text), True
    return 1, False


@dataclass(frozen=True)
class Init:
    version: str
    subversion: str


@dataclass(frozen=True)
class Query:
    """A question with a fixed answer: get_maxes, get_appnum, get_my_kvsname, get_universe_size, get_rank, get_size."""

    what: str


@dataclass(frozen=True)
class Put:
    kvsname: str
    key: str
    value: str

    @property
    def size(self) -> int:
        return len(self.key) + len(self.value)


@dataclass(frozen=True)
class Get:
    kvsname: str
    key: str


@dataclass(frozen=True)
class BarrierIn:
    pass


@dataclass(frozen=True)
class Finalize:
    pass


@dataclass(frozen=True)
class Abort:
    code: int  # 1..255
    asked: str  # what the rank sent, shortened and printable, for the message
    in_range: bool


@dataclass(frozen=True)
class Publish:
    service: str
    port: str


@dataclass(frozen=True)
class Lookup:
    service: str


@dataclass(frozen=True)
class Unpublish:
    service: str


@dataclass(frozen=True)
class Segment:
    """One command of a spawn: ``nprocs`` copies of ``argv``; ``wdir``: MPI's
    ``wdir`` info key (where they start), or ""; ``hosts``: the nodes its
    ``host``/``hosts`` info key names (as the rank wrote them: the
    coordinator resolves them), or none."""

    argv: tuple[str, ...]
    nprocs: int
    wdir: str = ""
    hosts: tuple[str, ...] = ()


@dataclass(frozen=True)
class Spawn:
    """``MPI_Comm_spawn`` / ``MPI_Comm_spawn_multiple``: one segment per command;
    ``preput``: what the children's key-value space holds from the start."""

    segments: tuple[Segment, ...]
    preput: tuple[tuple[str, str], ...]

    @property
    def nprocs(self) -> int:
        return sum(s.nprocs for s in self.segments)

    @property
    def hosts(self) -> tuple[str, ...]:
        """The nodes the spawn's children may run on (none: wherever gangd
        places them): every segment's, in order, once each. One list for the
        whole spawn, as under Hydra (the children are one job)."""
        return tuple(dict.fromkeys(h for s in self.segments for h in s.hosts))


@dataclass(frozen=True)
class Unsupported:
    """A query gangd does not serve: ``reply`` is the error MPICH reports for it."""

    cmd: str
    reply_cmd: str

    def reply(self) -> bytes:
        return line(self.reply_cmd, rc=-1, msg=f"{self.cmd}_is_not_supported_by_gangd")


Command = Init | Query | Put | Get | BarrierIn | Finalize | Abort | Publish | Lookup | Unpublish | Spawn | Unsupported

QUERIES = ("get_maxes", "get_appnum", "get_my_kvsname", "get_universe_size", "get_rank", "get_size")


def _field(fields: dict[str, str], name: str, limit: int, reply_cmd: str, *, required: bool = True) -> str:
    value = fields.get(name, "")
    if required and not value:
        raise Refused(reply_cmd, f"{name} missing")
    if len(value.encode()) > limit:
        raise Refused(reply_cmd, f"{name} longer than {limit} bytes")
    return value


def command(fields: dict[str, str]) -> Command:
    """The typed command of one parsed line; :class:`Refused` if its values break PMI-1's limits."""
    if "mcmd" in fields:
        # A multi-line command is a spawn, or not served. Its values may hold
        # spaces and it may carry any key, ``cmd`` included: none of it is taken
        # as another command (a put whose value has a space could not be answered).
        if fields["mcmd"] == "spawn" and isinstance(fields, Multi):
            return spawn(fields)
        name = token(fields["mcmd"])[:64] or "unknown"
        return Unsupported(name, RESPONSES.get(fields["mcmd"], name))
    cmd = fields.get("cmd") or ""
    if cmd == "init":
        return Init(fields.get("pmi_version", ""), fields.get("pmi_subversion", ""))
    if cmd in QUERIES:
        return Query(cmd)
    if cmd == "put":
        return Put(
            _field(fields, "kvsname", KVSNAME_MAX, "put_result", required=False),
            _field(fields, "key", KEYLEN_MAX, "put_result"),
            _field(fields, "value", VALLEN_MAX, "put_result", required=False),
        )
    if cmd == "get":
        return Get(_field(fields, "kvsname", KVSNAME_MAX, "get_result", required=False), _field(fields, "key", KEYLEN_MAX, "get_result"))
    if cmd == "barrier_in":
        return BarrierIn()
    if cmd == "finalize":
        return Finalize()
    if cmd == "abort":
        raw = fields.get("exitcode", "1")
        code, ok = clamp_exit_code(raw)
        asked = token(raw)[:24] + ("..." if len(raw) > 24 else "")
        return Abort(code, asked, ok)
    if cmd == "publish_name":
        return Publish(_field(fields, "service", SERVICE_MAX, "publish_result"), _field(fields, "port", PORT_MAX, "publish_result"))
    if cmd == "lookup_name":
        return Lookup(_field(fields, "service", SERVICE_MAX, "lookup_result"))
    if cmd == "unpublish_name":
        return Unpublish(_field(fields, "service", SERVICE_MAX, "unpublish_result"))
    name = token(cmd)[:64] or "unknown"
    # (a query outside PMI-1 has no response MPICH waits for: it gets its own name back, as an error)
    return Unsupported(name, RESPONSES.get(cmd, name))


def _count(fields: dict[str, str], name: str, low: int, high: int) -> int:
    text = fields.get(name, "").strip()
    if not (text.isascii() and text.isdigit() and len(text) <= 9 and low <= int(text) <= high):
        raise Refused("spawn_result", f"{name}={text[:20]} is not a number from {low} to {high}")
    return int(text)


def _text(fields: dict[str, str], name: str, limit: int, *, empty: bool = False) -> str:
    value = fields.get(name)
    if value is None or (not value and not empty):
        raise Refused("spawn_result", f"{name} missing")
    if len(value.encode()) > limit or "\0" in value:
        raise Refused("spawn_result", f"{name} is longer than {limit} bytes or holds a NUL")
    return value


def spawn(fields: Multi) -> Spawn:
    """The typed spawn of a multi-line command; :class:`Refused` (a ``spawn_result``
    with rc=-1) for anything past the bounds above, the rank's own command too long
    (``oversized``), or a field missing."""
    if fields.get("oversized"):
        raise Refused("spawn_result", f"the spawn command is longer than {MAX_MCMD} bytes or has more than {SPAWN_SEGMENTS_MAX} commands")
    total = _count(fields, "totspawns", 1, SPAWN_SEGMENTS_MAX)
    if len(fields.segments) != total:
        raise Refused("spawn_result", f"totspawns={total} but {len(fields.segments)} commands came")
    segments = []
    for seg in fields.segments:
        nprocs = _count(seg, "nprocs", 1, SPAWN_NPROCS_MAX)
        execname = _text(seg, "execname", SPAWN_ARG_BYTES).strip()
        argc = _count(seg, "argcnt", 0, SPAWN_ARGS_MAX)
        argv = (execname, *(_text(seg, f"arg{i}", SPAWN_ARG_BYTES, empty=True) for i in range(1, argc + 1)))
        wdir, path = "", ""
        hosts: tuple[str, ...] = ()
        for i in range(_count(seg, "info_num", 0, SPAWN_INFO_MAX) if "info_num" in seg else 0):
            key = _text(seg, f"info_key_{i}", KEYLEN_MAX).strip()
            if key == "wdir":
                wdir = _text(seg, f"info_val_{i}", SPAWN_ARG_BYTES).strip()
            elif key == "path":
                path = _text(seg, f"info_val_{i}", SPAWN_ARG_BYTES).strip()
            elif key in ("host", "hosts"):
                hosts = _hosts(_text(seg, f"info_val_{i}", SPAWN_ARG_BYTES))
            elif key == "hostfile":
                raise Refused("spawn_result", "the hostfile info key is not served by gangd: name the nodes with the host info key")
            # (any other key is ignored, as Hydra and MPI's own rule for info keys do)
        if path and "/" not in argv[0]:  # (Hydra's: the command is looked for in that directory)
            argv = (f"{path.rstrip('/')}/{argv[0]}", *argv[1:])
        segments.append(Segment(argv, nprocs, wdir, hosts))
    if sum(s.nprocs for s in segments) > SPAWN_NPROCS_MAX:
        raise Refused("spawn_result", f"a spawn may start at most {SPAWN_NPROCS_MAX} processes")
    first = fields.segments[0]
    preput = tuple(
        (_text(first, f"preput_key_{i}", KEYLEN_MAX), _text(first, f"preput_val_{i}", VALLEN_MAX, empty=True))
        for i in range(_count(first, "preput_num", 0, SPAWN_PREPUT_MAX) if "preput_num" in first else 0)
    )
    return Spawn(tuple(segments), preput)


def _hosts(value: str) -> tuple[str, ...]:
    """The ``host``/``hosts`` info key's nodes: names separated by commas (or
    spaces); Hydra's ``name:count`` form is taken as ``name`` (gangd places
    the processes over the nodes named)."""
    names = [part.strip().rpartition(":")[0] if _counted(part.strip()) else part.strip() for part in value.replace(" ", ",").split(",")]
    names = [n for n in names if n]
    if not names:
        raise Refused("spawn_result", "the host info key names no node")
    if len(names) > SPAWN_HOSTS_MAX:
        raise Refused("spawn_result", f"the host info key names {len(names)} nodes, more than the {SPAWN_HOSTS_MAX} gangd reads")
    if any(len(n.encode()) > SPAWN_HOST_BYTES for n in names):
        raise Refused("spawn_result", f"the host info key names a node longer than {SPAWN_HOST_BYTES} bytes")
    return tuple(dict.fromkeys(names))


def _counted(part: str) -> bool:
    head, colon, count = part.rpartition(":")
    return bool(colon and head and count.isascii() and count.isdigit())


def kvs_budget(nranks: int) -> tuple[int, int]:
    """(bytes, keys) one job's key-value space may hold."""
    return max(KVS_BYTES_MIN, nranks * KVS_BYTES_PER_RANK), max(KVS_KEYS_MIN, nranks * KVS_KEYS_PER_RANK)
