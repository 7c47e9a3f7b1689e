"""The pipeline's four knobs, checked once so no stage has to distrust them.

Paper 004 (PCCR) found checkpoint time a U-shaped function of the ring
buffer size: small buffers pay a hand-off per few KiB, huge ones leave the
stages idle while the first buffer fills. Where the bottom of the U lies
depends on the machine, so the size and count are settings, not constants;
``bench/pipeline_engine.py`` measures the curve here. Writes are aggregated
into buffers of ``aggregate_bytes`` (>= 4 MiB by default: most checkpoint
writes are small, and a file system takes one large write far better than
many small ones).

``workers`` is how many threads run a *parallel* stage (a Transform made
with ``parallel=True``: compression and decompression, whose codecs release
the GIL). With one compress thread the pipeline is as slow as one core's
codec, which on a fast disk is slower than writing raw; with ``workers``
threads the stage takes up to that many cores, and the units still reach the
writer in order (:mod:`.engine`). The default is the cores less one (the
write stage's), at least 1 and at most 4 (:func:`default_workers`). The
ring in front of a parallel stage holds ``max(buffer_count, workers + 2)``
buffers (each worker holds the buffer it works on until its turn to hand on,
and the producer needs at least two more to keep going), so the memory bound
per ring is that many buffers.

The values may come from a user's file or a job's request, so
:meth:`Settings.from_mapping` refuses unknown keys, non-integers and sizes
outside the bounds below: the pool is allocated up front (count x size per
ring), and an absurd count or size must be an error, not an out-of-memory
kill.

A job names its settings as text (``gang run --ckpt-pipeline``, the
cluster's ``[checkpoint] pipeline``, ``GANGD_CKPT_PIPELINE``,
``ckptlib.init(pipeline=...)``): ``key=value`` pairs separated by commas,
sizes with a binary suffix, e.g. ``buffer_size=256KiB,workers=2``.
:func:`parse` checks such text into the overrides it names; only those travel
(a setting left out is each node's own default: ``workers`` follows the
cores where the ranks run, so :func:`parse` checks the bounds with the most
workers any node defaults to), and :func:`canonical` is the one spelling a
job record keeps.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields

KIB = 1024
MIB = 1024 * KIB

MIN_BUFFERS, MAX_BUFFERS = 2, 256
MIN_SIZE, MAX_SIZE = 4 * KIB, 256 * MIB
MAX_RING_BYTES = 1024 * MIB  # one ring's whole pool
MIN_WORKERS, MAX_WORKERS = 1, 64
MAX_TEXT = 200  # characters of a settings text (four key=value pairs fit in under 90)
SIZES = ("buffer_size", "aggregate_bytes")  # the settings that are a number of bytes (a suffix allowed)
_SUFFIX = {"": 1, "k": KIB, "kib": KIB, "m": MIB, "mib": MIB, "g": 1024 * MIB, "gib": 1024 * MIB}
_NUMBER = re.compile(r"([0-9]{1,12})\s*([a-z]*)")


DEFAULT_WORKERS_MAX = 4  # a parallel stage's threads when the settings leave them out: the cores less one, at most this


def default_workers() -> int:
    """Threads for a parallel stage by default: the cores this process may use less one, which the write
    stage (and the job) keep busy -- at least 1, at most :data:`DEFAULT_WORKERS_MAX`.

    Measured on the 2-core machine once the codecs released the GIL (``bench/pipeline.py --mib 256
    --rounds 5 --sections 1 --workers 2``): one compress worker beside the writer took 0.28 s, two 0.32 s
    (their CPU 0.23 s against 0.30 s: threads waiting for a core), and a restore 0.21 s against 0.43 s."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(cores - 1, DEFAULT_WORKERS_MAX))


class SettingsError(ValueError):
    """A pipeline setting out of its bounds or of the wrong type."""


@dataclass(frozen=True)
class Settings:
    buffer_count: int = 4  # buffers per ring (the bound on items in flight between two stages)
    buffer_size: int = 1 * MIB  # capacity of a buffer between two transform stages
    aggregate_bytes: int = 4 * MIB  # capacity of a buffer the writer takes: the size of one write
    workers: int = field(default_factory=default_workers)  # threads of a parallel stage (compress, decompress)

    def __post_init__(self) -> None:
        for name, low, high in (("buffer_count", MIN_BUFFERS, MAX_BUFFERS), ("buffer_size", MIN_SIZE, MAX_SIZE),
                                ("aggregate_bytes", MIN_SIZE, MAX_SIZE), ("workers", MIN_WORKERS, MAX_WORKERS)):
            value = getattr(self, name)
            if type(value) is not int:
                raise SettingsError(f"pipeline setting {name} must be an integer, not {type(value).__name__}")
            if not low <= value <= high:
                raise SettingsError(f"pipeline setting {name}={value} is outside {low}..{high}")
        for name in ("buffer_size", "aggregate_bytes"):
            if self.parallel_count * getattr(self, name) > MAX_RING_BYTES:
                raise SettingsError(f"pipeline settings max(buffer_count, workers + 2) x {name} = "
                                    f"{self.parallel_count * getattr(self, name)} bytes exceed {MAX_RING_BYTES} per ring")

    @classmethod
    def from_mapping(cls, values: Mapping[str, object]) -> Settings:
        """Settings from a decoded file or request: unknown keys are refused, missing ones take the defaults."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(str(k) for k in values if k not in known)
        if unknown:
            raise SettingsError(f"unknown pipeline settings: {', '.join(unknown)[:200]}")
        return cls(**values)  # type: ignore[arg-type]  # __post_init__ checks every type

    @property
    def parallel_count(self) -> int:
        """Buffers of the ring in front of a parallel stage (each worker holds one until its turn)."""
        return max(self.buffer_count, self.workers + 2)

    def ring_bytes(self, capacity: int) -> int:
        return self.buffer_count * capacity


def parse(text: object) -> dict[str, int]:
    """The settings ``text`` names (``buffer_size=256KiB,workers=2``), checked as :class:`Settings`
    checks them against the defaults (workers: :data:`DEFAULT_WORKERS_MAX` if left out); a
    SettingsError saying what is wrong and what is accepted.
    An empty text names nothing (every setting its default)."""
    if not isinstance(text, str):
        raise SettingsError(f"pipeline settings are text such as 'buffer_size=256KiB,workers=2', not {type(text).__name__}")
    if len(text) > MAX_TEXT:
        raise SettingsError(f"pipeline settings are longer than {MAX_TEXT} characters")
    known = [f.name for f in fields(Settings)]
    values: dict[str, int] = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        key, sep, raw = (x.strip() for x in part.partition("="))
        if not sep or key not in known:
            raise SettingsError(f"pipeline setting {part[:40]!r} is not key=value with a key of: {', '.join(known)}")
        if key in values:
            raise SettingsError(f"pipeline setting {key} is given twice")
        match = _NUMBER.fullmatch(raw.lower())
        if match is None or match.group(2) not in _SUFFIX or (match.group(2) and key not in SIZES):
            unit = " (a size: 256KiB, 4MiB, 1048576)" if key in SIZES else " (a whole number)"
            raise SettingsError(f"pipeline setting {key}={raw[:40]!r} is not a number{unit}")
        values[key] = int(match.group(1)) * _SUFFIX[match.group(2)]
    # Every bound, with the defaults for what is left out -- workers at the most any node defaults to, so
    # that settings accepted where the job is submitted are accepted on every node its ranks start on.
    Settings.from_mapping({"workers": DEFAULT_WORKERS_MAX, **values})
    return values


def canonical(values: Mapping[str, int]) -> str:
    """The one spelling of ``values`` (as :func:`parse` returns them): keys in field order, sizes in
    the largest binary unit that divides them. ``parse(canonical(v)) == v``."""
    out = []
    for f in fields(Settings):
        if f.name in values:
            value = values[f.name]
            if f.name in SIZES:
                unit = next(u for u in ("GiB", "MiB", "KiB", "") if value % _SUFFIX[u.lower()] == 0)
                out.append(f"{f.name}={value // _SUFFIX[unit.lower()]}{unit}")
            else:
                out.append(f"{f.name}={value}")
    return ",".join(out)


def from_text(text: object) -> Settings:
    """The :class:`Settings` that ``text`` names, the defaults for the rest."""
    return Settings.from_mapping(parse(text))
