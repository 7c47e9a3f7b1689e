"""Text a user or a job chose, made safe to print on someone else's terminal.

Job names, abort messages and exit reasons are written by one user and read
by others (``gang ps`` lists everyone's jobs). A name holding ``ESC ]`` or
``ESC [`` sequences could retitle, recolour, clear or scroll another user's
terminal, or forge lines of output; a ``\\r`` or ``\\n`` could forge table
rows. :func:`printable` keeps every printable character (any script) and
turns escape sequences and other control characters into nothing or ``?``.
The daemon applies it where such text enters (job names, reasons a rank
caused) and the client again where it prints (a record from an older
daemon, or a field this module never saw).
"""

from __future__ import annotations

import itertools
import re

#: ESC-introduced sequences (CSI, OSC, DCS, and two-byte ones), and their 8-bit C1 forms.
_ESCAPES = re.compile(
    r"""
    (?:\x1b\[|\x9b)[0-?]*[ -/]*[@-~]?                           # CSI ... final byte
  | (?:\x1b[\]PX^_]|[\x90\x98\x9d\x9e\x9f]).*?(?:\x07|\x1b\\|\x9c|$)  # OSC/DCS/SOS/PM/APC ... terminator
  | \x1b[ -/]*[0-~]?                                        # other ESC sequences
    """,
    re.VERBOSE | re.DOTALL,
)

#: Longest a name or a reason is shown (a megabyte of "reason" is an attack, not a reason).
MAX_NAME = 256
MAX_REASON = 2048


def printable(text: object, limit: int = MAX_REASON) -> str:
    """``text`` without terminal escapes or control characters, at most ``limit`` characters."""
    if not isinstance(text, str):
        text = "" if text is None else str(text)
    # Only the start can be shown: a hostile 16 MiB reason is not scanned whole for escapes to keep it.
    text = _ESCAPES.sub("", text[: 4 * limit])
    out = []
    for ch in text:
        out.append(" " if ch == "\t" else ch if ch.isprintable() else "?")
        if len(out) >= limit:
            out.append("...")
            break
    return "".join(out)


def name(text: object) -> str:
    """A job name as shown to everyone: printable, at most :data:`MAX_NAME` characters."""
    return printable(text, MAX_NAME)


def brief(value: object, limit: int = 40, *, quote: bool = True, _depth: int = 0) -> str:
    """A decoded message's ``value`` (str, bytes, numbers, lists, maps, nested)
    rendered in about ``limit`` characters per string and a few items per
    container, for quoting it in an error: the work is bounded too, whatever
    the value's size (``repr`` renders a 16 MiB frame's list whole before it
    can be cut). ``quote``: a string in quotes, as ``repr`` shows it."""
    if isinstance(value, str):
        return repr(value[: limit + 1]) if quote else value[: limit + 1]
    if isinstance(value, bytes | bytearray | memoryview):
        return repr(bytes(value[: limit + 1]))
    if isinstance(value, bool | float) or value is None:
        return repr(value)
    if isinstance(value, int):
        return repr(value) if value.bit_length() <= 256 else f"<an integer of {value.bit_length()} bits>"
    if isinstance(value, list | tuple | dict | set | frozenset):
        opening, closing = ("{", "}") if isinstance(value, dict | set | frozenset) else ("(", ")") if isinstance(value, tuple) else ("[", "]")
        if _depth >= 3:
            return f"{opening}...{closing}"
        if isinstance(value, dict):
            parts = [f"{brief(k, limit, _depth=_depth + 1)}: {brief(v, limit, _depth=_depth + 1)}" for k, v in itertools.islice(value.items(), 4)]
        else:
            parts = [brief(item, limit, _depth=_depth + 1) for item in itertools.islice(value, 4)]
        return opening + ", ".join(parts) + (", ..." if len(value) > len(parts) else "") + closing
    return f"<{type(value).__name__}>"
