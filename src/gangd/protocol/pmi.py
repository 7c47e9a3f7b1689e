"""PMI-1, the wire protocol MPICH's ranks speak to their process manager — sans-I/O.

One command per line, ``key=value`` pairs separated by spaces, the first
being ``cmd=<name>``::

    cmd=init pmi_version=1 pmi_subversion=1      ->  cmd=response_to_init pmi_version=1 pmi_subversion=1 rc=0
    cmd=put kvsname=K key=k value=v               ->  cmd=put_result rc=0
    cmd=barrier_in                                ->  cmd=barrier_out rc=0
    cmd=get kvsname=K key=k                       ->  cmd=get_result rc=0 value=v

(The de-facto standard; Flux RFC 13 documents it.) :class:`Reader` turns
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
        return line(self.reply_cmd, rc=-1, msg=_token(self.msg))


def _token(text: str) -> str:
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


class Reader:
    """Bytes in, commands (field dicts) out."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[dict[str, str]]:
        self._buf += data
        commands = []
        while (end := self._buf.find(b"\n")) >= 0:
            if end > MAX_LINE:
                raise PMIError(f"a line longer than {MAX_LINE} bytes")
            raw = bytes(self._buf[:end])
            del self._buf[: end + 1]
            text = raw.decode("utf-8", errors="replace").strip()
            if text:
                commands.append(parse(text))
        if len(self._buf) > MAX_LINE:
            raise PMIError(f"a line longer than {MAX_LINE} bytes")
        return commands


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
class Unsupported:
    cmd: str


Command = Init | Query | Put | Get | BarrierIn | Finalize | Abort | Unsupported

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
    cmd = fields.get("cmd") or fields.get("mcmd") or ""
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
        asked = _token(raw)[:24] + ("..." if len(raw) > 24 else "")
        return Abort(code, asked, ok)
    return Unsupported(_token(cmd)[:64] or "unknown")


def kvs_budget(nranks: int) -> tuple[int, int]:
    """(bytes, keys) one job's key-value space may hold."""
    return max(KVS_BYTES_MIN, nranks * KVS_BYTES_PER_RANK), max(KVS_KEYS_MIN, nranks * KVS_KEYS_PER_RANK)
