"""PMI-1, the wire protocol MPICH's ranks speak to their process manager — sans-I/O.

One command per line, ``key=value`` pairs separated by spaces, the first
being ``cmd=<name>``::

    cmd=init pmi_version=1 pmi_subversion=1      ->  cmd=response_to_init pmi_version=1 pmi_subversion=1 rc=0
    cmd=put kvsname=K key=k value=v               ->  cmd=put_result rc=0
    cmd=barrier_in                                ->  cmd=barrier_out rc=0
    cmd=get kvsname=K key=k                       ->  cmd=get_result rc=0 value=v

(The de-facto standard; Flux RFC 13 documents it.) :class:`Reader` turns
bytes into commands; :func:`line` builds replies. No sockets here.
"""

from __future__ import annotations

MAX_LINE = 64 * 1024  # a longer line is a broken client, not a business card


class PMIError(Exception):
    """A line that is not PMI-1."""


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


def line(cmd: str, **fields) -> bytes:
    """A reply line; values must not contain spaces or newlines (PMI-1 has no quoting)."""
    parts = [f"cmd={cmd}"]
    for key, value in fields.items():
        value = str(value)
        if any(c in value for c in " \n"):
            raise PMIError(f"PMI-1 cannot carry {key}={value[:40]!r}: it has a space or a newline")
        parts.append(f"{key}={value}")
    return (" ".join(parts) + "\n").encode()


class Reader:
    """Bytes in, commands out."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[dict[str, str]]:
        self._buf += data
        commands = []
        while (end := self._buf.find(b"\n")) >= 0:
            raw = bytes(self._buf[:end])
            del self._buf[: end + 1]
            text = raw.decode("utf-8", errors="replace").strip()
            if text:
                commands.append(parse(text))
        if len(self._buf) > MAX_LINE:
            raise PMIError(f"a line longer than {MAX_LINE} bytes")
        return commands
