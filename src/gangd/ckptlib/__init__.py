"""Checkpoint and restart for iterative programs — under gangd or alone.

::

    from gangd import ckptlib as ckpt

    ckpt.init()                                        # SIGQUIT handler; loads the saved state on a restart
    u = ckpt.protect("u", lambda: np.zeros((n, n)))    # built only on a fresh start; saved by reference
    stats = ckpt.protect("stats", lambda: {"residual": 0.0})   # any picklable object (a dict for scalars)
    for it in ckpt.loop(range(steps)):                 # every boundary can be a checkpoint; resumes after the saved one
        ...
    ckpt.fini()

The idiom: give :func:`protect` a *factory* — a function that builds the
initial state — rather than the state. On a fresh start it is called once;
on a restart it is not called at all, and the saved value comes back
instead, read from the checkpoint straight into a new array of its dtype
and shape. A program that builds its state and then protects it
(``u = ckpt.protect("u", build())``) pays for building what the restart
throws away — time before its first iteration, and twice the memory for a
moment. ``protect(name, value)`` still works (the saved value is returned
on a restart; an array given must then have the dtype and shape of the
saved one, else :class:`CheckpointError` says both), and a callable that is
itself the state is protected through a factory: ``protect("f", lambda: f)``.

Under ``gang run`` every rank of the job saves at the same iteration, with
the job's messages in flight saved by the daemons (a consistent checkpoint);
``gang checkpoint JOB``, Ctrl-\\ on ``gang run``, SIGUSR1 to a gangd or
``--ckpt-every`` trigger one, and ``gang restart JOB`` resumes the job after
the saved iteration. Run alone (``python app.py``) the same program saves to
a directory (``directory=``, ``$GANGD_CKPT_DIR``, default ``<script>.ckpt``)
on SIGQUIT (Ctrl-\\), :func:`request` or every ``every`` seconds, and
restarts with ``restart=`` (or ``GANGD_RESTART=latest|auto|<generation>``).

Values come back bit-identical: numpy arrays as raw memory with their dtype
and shape, everything else through pickle. Protect what the loop needs to
continue; rebinding a protected name (``x = x + 1``) does not update what is
saved — mutate in place, keep scalars in a dict, or call ``protect`` again
with the new object.

By default the state is written behind the program's back: at the
checkpoint the rank forks a copy-on-write snapshot that writes and fsyncs
while the job runs on (``background=False`` writes before continuing).
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
from pathlib import Path

from ..client.runtime import job_info
from . import (
    spc as spc_mod,  # (also makes `from gangd.ckptlib import spc` work, for plug-ins)
)
from .core import Checkpointer, CheckpointError, DeltaSettings, Standalone

__all__ = ["CheckpointError", "fini", "generation", "init", "loop", "protect", "request", "restarted"]

_cp: Checkpointer | None = None


def init(*, directory: str | os.PathLike | None = None, restart=None, background: bool | None = None,
         every: float | str | None = None, keep: int = 2, spc=None, mode: str | None = None, block_kib: int | None = None,
         chain_max: int | None = None, threshold: float | None = None, codec: str | None = None,
         pipeline: str | dict | None = None) -> Checkpointer:
    """Set up checkpointing for this process; call once, before :func:`protect`.

    ``restart`` (alone only; gangd decides under ``gang restart``): ``"latest"``
    (or True) restarts from the newest complete generation and fails if there
    is none, ``"auto"`` restarts if there is one, a number picks a generation.
    ``every`` (alone only; gangd has ``--ckpt-every``): seconds between checkpoints,
    or ``"auto"``: at the interval that minimises lost time (paper 002), planned
    from this process's measured checkpoint cost and pace of iterations and
    the mean time between failures in ``GANGD_MTBF`` (a duration such as
    ``7d``; default 30 days) — the first checkpoint at once, to measure it.
    ``keep``: complete generations kept (alone; the daemons have their own setting).
    ``spc``: how this process's state is written — a name (``"registered"``,
    the default; ``GANGD_CKPT_SPC``; anything :func:`spc.register`-ed or in
    the ``gangd.spc`` entry points) or an instance such as
    ``spc.Callables(save=..., load=...)``. See :mod:`gangd.ckptlib.spc`.
    ``mode`` (``GANGD_CKPT_MODE``): ``"adaptive"`` (the default),
    ``"incremental"``, ``"differential"`` or ``"full"``; ``block_kib``
    (``GANGD_CKPT_BLOCK_KIB``, 16), ``chain_max`` (8 generations a restore
    reads at most), ``threshold`` (adaptive's new-base rule, 0.10 of the
    state): how generations are written alone (issue 17).
    ``codec`` (``GANGD_CKPT_CODEC``, which ``gang run --ckpt-codec`` sets):
    how the blocks are compressed -- ``"none"`` (the default: uncompressed,
    exactly as without this setting), ``"lz4"``, ``"zstd[:LEVEL]"``,
    ``"blosc2[:INNER][:LEVEL][:FILTER]"``, ``"auto"`` (per value, from a
    sample; raw where it would not shrink) or a plug-in's name; checked here
    (a :class:`CheckpointError` names a bad one). Compressed generations are
    written through a compress/write pipeline and recorded per unit of
    blocks, so a restart never guesses (issue 18). The codec is loaded here:
    one that is not installed is refused at start, not at the first
    checkpoint, which then does not pay its import.
    ``pipeline`` (``GANGD_CKPT_PIPELINE``, which ``gang run --ckpt-pipeline``
    sets): that pipeline's buffers and threads, as text
    (``"buffer_size=256KiB,workers=2"``) or a dict; keys ``buffer_count``,
    ``buffer_size``, ``aggregate_bytes``, ``workers`` (see
    :mod:`gangd.pipeline.settings`); used for writes and restores alike.
    """
    global _cp
    if _cp is not None and not _cp.closed:
        return _cp
    if threading.current_thread() is not threading.main_thread():
        raise CheckpointError("ckpt.init() must be called from the main thread (it installs a signal handler)")
    if background is None:
        background = os.environ.get("GANGD_CKPT_BACKGROUND", "1") not in ("0", "no", "false")
    if restart is None:
        restart = os.environ.get("GANGD_RESTART") or None
        if restart in ("true", "yes"):
            restart = "latest"
        elif restart in ("0", "no", "false"):
            restart = None
    if restart is True:
        restart = "latest"
    info = job_info()
    try:
        settings = DeltaSettings.from_options(mode, block_kib, chain_max, threshold, codec, pipeline)
    except CheckpointError as exc:
        if info.under_gangd and info.socket:  # (its node hears why: the job's reason says it, not "exit 1")
            from .agent import refused

            refused(info, str(exc))
        raise
    cp = Checkpointer(None, background=background, spc=spc_mod.select(spc), settings=settings)
    # The handler first: once the daemon knows this rank takes checkpoints it
    # may send SIGQUIT at any moment, and SIGQUIT's default action kills.
    previous = signal.signal(signal.SIGQUIT, cp.signal_handler)
    try:
        if info.under_gangd and info.socket:
            from .agent import DaemonAgent

            cp.backend = DaemonAgent(info)
        else:
            where = directory or os.environ.get("GANGD_CKPT_DIR") or f"{Path(sys.argv[0] or 'program').stem}.ckpt"
            cp.backend = Standalone(Path(where), keep=keep, every=every)
        if restart is not None or info.under_gangd:
            cp.backend.restore(cp, restart)
        cp.backend.attach(cp)
    except BaseException:
        signal.signal(signal.SIGQUIT, previous)
        link = getattr(cp.backend, "link", None)
        if link is not None:  # (registered with the daemon, then failed to restore)
            link.close()
        raise
    atexit.register(cp.fini)
    _cp = cp
    return cp


def _current() -> Checkpointer:
    if _cp is None or _cp.closed:
        raise CheckpointError("call ckpt.init() first")
    return _cp


def protect(name: str, value):
    """Register state to be saved under ``name`` and return it.

    ``value`` is the state itself or, better, a factory that builds it (any
    callable, e.g. ``lambda: np.zeros(n)``): the factory runs only on a
    fresh start. On a restart the saved value is returned instead — the
    factory is not called; an array given directly must match the saved
    one's dtype and shape (:class:`CheckpointError` otherwise).
    """
    return _current().protect(name, value)


def loop(iterable):
    """Iterate like ``for x in iterable``, with a checkpoint candidate point before each item.
    After a restart the items already done are skipped."""
    return _current().loop(iterable)


def request() -> None:
    """Ask for a checkpoint at the next boundary (what SIGQUIT does)."""
    _current().request()


def restarted() -> bool:
    """True when this run continues from a checkpoint."""
    return _current().restarted_from is not None


def generation() -> int | None:
    """The generation restarted from, or the last one this process took part in."""
    return _current().generation


def fini() -> None:
    """Wait for checkpoint writes still under way; later SIGQUITs are ignored."""
    global _cp
    if _cp is not None:
        _cp.fini()
        _cp = None
