"""Checkpoints of MPI programs at a collective call (paper 001's user-level model, STFT's ``MPI_Ckpt``).

::

    from mpi4py import MPI
    from gangd import ckptlib as ckpt
    from gangd.ckptlib import mpi as ckpt_mpi

    comm = MPI.COMM_WORLD
    ckpt.init()                                   # on a restart: loads this rank's saved values
    u = ckpt.protect("u", lambda: np.zeros(n))           # built on a fresh start only
    state = ckpt.protect("state", lambda: {"step": 0})
    while state["step"] < steps:
        ...                                       # compute and communicate
        state["step"] += 1
        ckpt_mpi.checkpoint(comm)                 # every rank, at the same program point

Run it with ``gang run --mpi``. ``checkpoint(comm)`` is a collective call
that saves the job when a checkpoint is due — asked for by ``gang
checkpoint JOB``, Ctrl-\\ on ``gang run``, SIGUSR1 to a gangd,
``--ckpt-every``, a rank's SIGQUIT or :func:`gangd.ckptlib.request` — and
otherwise costs one small allreduce. ``checkpoint(comm, force=True)`` on
every rank saves at this call (STFT's ``MPI_Ckpt``).

The rule (paper 001): **a send and its matching receive must both come
before the call or both after it**, and non-blocking operations must be
complete. MPI's own messages are never saved, so before saving every rank
checks that nothing is in flight to it on ``comm``: each rank sends a marker
(the largest tag, ``MPI.TAG_UB``, reserved inside the call) to every rank and
probes each source; a message found ahead of its sender's marker breaks the
rule, and the checkpoint fails (:class:`~gangd.ckptlib.CheckpointError`,
naming its source, tag and size; the markers are consumed and the message
stays queued, so a program may catch it and go on without that checkpoint).
Only ``comm`` is checked: messages on other communicators, and receives
posted before the call, are the program's to finish. Then each rank's
protected values are saved through the daemons' two-phase sync (the same
generations and storage as any gangd job); the end sync is the closing
barrier.

``gang restart JOB`` starts fresh ranks: MPI is initialised afresh (new
connections, a new PMI key space), ``ckpt.init()`` loads each rank's own
file by rank, and the program goes on after the call that saved — its
protected values (``state["step"]`` above) say where it was. Calls are
counted from 0 (``gang ckpt ls`` shows the saving call as the iteration);
a restarted program counts on from the saved one, so the next checkpoint
lines up on every rank again.

Incremental checkpoints (issue 17) need nothing more here: the save goes
through the same start and end syncs as a loop boundary's, so with
``gang run --mpi --ckpt-mode adaptive`` (or incremental, differential) each
rank writes the blocks changed since the parent generation the daemon
offered it, against its own chain (ranks may start a new base at different
generations). A generation is still one cut of the whole job -- every rank's
file of it holds the same call -- and a restart restores that generation on
every rank, each from its own chain (tests/test_mpi_delta21.py).

A rank that waits long in the call (``$GANGD_CKPT_MPI_WARN`` s, default 60)
says why it may be stuck; a program cannot mix ``ckpt.loop()`` and this call.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time

import numpy as np
from mpi4py import MPI

from ..client.runtime import job_info
from . import _current
from .core import CheckpointError, warn

__all__ = ["checkpoint"]


def _seconds(name: str, default: float) -> float:
    try:
        value = float(os.environ.get(name, default))
    except ValueError:
        value = default
    return value if value >= 1 else default


SLOW_WARNING = _seconds("GANGD_CKPT_MPI_WARN", 60.0)  # s of waiting in the call before saying why (>= 1)


def checkpoint(comm: MPI.Intracomm, *, force: bool = False) -> int | None:
    """Collective checkpoint point: every rank of the job calls it at the same place.

    Saves when a checkpoint is due (or with ``force=True`` on every rank:
    here, unless one already under way is cut at a later call) and returns
    the generation saved; returns None when none was due or the checkpoint
    failed (the daemons say why; the job goes on). Raises
    :class:`~gangd.ckptlib.CheckpointError` when the program breaks the rule
    (a message in flight on ``comm``) or the calls are not collective.
    """
    cp = _current()
    _check_comm(comm)
    cp.use_points("mpi")
    k = max(cp.iteration + 1, cp.start)  # this call's number (a restart counts on from the saved one)
    if force:
        cp.request()
    gen = cp.backend.agree(cp, k, force)
    g = -1 if gen is None else gen
    try:
        low_at_cut, low_k, minus_high_k, low_gen, minus_high_gen = _vote(comm, np.array([gen is not None, k, -k, g, -g], dtype=np.int64), k)
        if low_k != -minus_high_k:  # (calls pair up by their count; a safeguard against a rank restarted apart)
            raise CheckpointError(
                f"checkpoint(comm) is not called collectively: the ranks are at calls {low_k} to {-minus_high_k} "
                f"(this rank: {k}); every rank must call it at the same program point"
            )
        if not low_at_cut or low_gen != -minus_high_gen:
            # Another rank lost the cut (the daemons aborted it), or holds
            # another generation's: nobody saves here.
            if gen is not None:
                cp.backend.decline(cp, gen, f"the ranks did not all stop at checkpoint(comm) call {k} for checkpoint {gen}")
            return None
        _check_nothing_in_flight(comm, k)
    except BaseException as exc:
        if gen is not None:
            cp.backend.decline(cp, gen, str(exc) or type(exc).__name__)
        raise
    return cp.backend.save(cp, gen, k, resume=k + 1)  # the restarted program goes on after this call


def _check_comm(comm) -> None:
    if not isinstance(comm, MPI.Intracomm) or comm == MPI.COMM_NULL:
        raise TypeError(f"checkpoint() needs an mpi4py intracommunicator such as MPI.COMM_WORLD, not {comm!r}")
    info = job_info()
    size = comm.Get_size()
    if info.under_gangd and size != info.size:
        raise CheckpointError(
            f"checkpoint(comm) needs a communicator with every rank of the job ({info.size}), "
            f"this one has {size}" + (": run the job with `gang run --mpi`" if size == 1 else "")
        )
    if not info.under_gangd and size > 1:
        raise CheckpointError(
            "checkpoints of a multi-rank MPI program need gangd's daemons (they save it consistently): "
            "run it with `gang run --mpi`, not mpiexec"
        )


def _vote(comm, mine: np.ndarray, k: int) -> np.ndarray:
    """Element-wise minimum over the ranks (MPI's blocking allreduce: ~0.1 ms
    over TCP, where polling a non-blocking one from Python costs ~1 ms)."""
    result = np.empty_like(mine)
    with _watch.waiting(lambda: _slow(comm, k)):
        comm.Allreduce(mine, result, op=MPI.MIN)
    return result


def _slow(comm, k: int) -> str:
    """Why a rank may wait long for the others in the call. While some rank
    has not come, none has left: a message waiting here was sent before the call."""
    waiting = ""
    status = MPI.Status()
    if MPI.Query_thread() == MPI.THREAD_MULTIPLE and comm.Iprobe(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=status):
        waiting = (f" A message from rank {status.Get_source()} (tag {status.Get_tag()}, {status.Get_count(MPI.BYTE)} bytes) "
                   "waits here: its sender may be blocked sending before the call what this rank receives after it.")
    return (f"rank {comm.Get_rank()} has waited {SLOW_WARNING:.0f} s in checkpoint(comm) call {k} for the other ranks.{waiting} "
            "A rank blocked in a send or receive whose match comes after the call deadlocks the program: "
            "a send and its matching receive must both come before checkpoint() or both after it")


def _check_nothing_in_flight(comm, k: int) -> None:
    """Every rank is in call ``k``: prove that no message on ``comm`` is on its way to this rank.

    Each rank sends a marker to every rank (itself included), after all its
    sends from before the call. MPI does not let messages between one pair
    overtake each other, so the first message from each source that a probe
    sees is that source's marker, unless a message sent before the call was
    never received — the rule broken.
    """
    size, me = comm.Get_size(), comm.Get_rank()
    tag = MPI.COMM_WORLD.Get_attr(MPI.TAG_UB)  # the largest tag, reserved for the marker inside the call
    out = np.array([k], dtype=np.int64)
    sends = [comm.Isend(out, dest=peer, tag=tag) for peer in range(size)]
    got = np.empty(1, dtype=np.int64)
    status = MPI.Status()
    problems = []
    for source in range(size):
        # Every rank is in the call (the vote), so its marker comes, unless a
        # receive the program left pending on ``comm`` takes it.
        with _watch.waiting(lambda source=source: (
            f"checkpoint(comm) call {k}: rank {me} has waited {SLOW_WARNING:.0f} s for the marker of rank {source}; "
            "a non-blocking receive (Irecv) the program left pending on this communicator may have taken it: "
            "complete non-blocking operations before checkpoint()"
        )):
            comm.Probe(source=source, tag=MPI.ANY_TAG, status=status)
        if status.Get_tag() != tag:
            problems.append(f"a message from rank {source} (tag {status.Get_tag()}, {status.Get_count(MPI.BYTE)} bytes)")
        # The marker itself, by its tag: a program's message ahead of it stays where it is.
        comm.Recv(got, source=source, tag=tag)
    MPI.Request.Waitall(sends)
    if problems:
        raise CheckpointError(
            f"checkpoint(comm) call {k}: {'; '.join(problems)} {'is' if len(problems) == 1 else 'are'} in flight to rank {me}: "
            "sent before the call and received after it. A send and its matching receive must both come before "
            "checkpoint() or both after it; MPI messages are not saved"
        )


class _Watchdog:
    """Says so, once, when this rank waits long in a blocking MPI call of the
    checkpoint: a thread that looks every few seconds, so that the waits
    themselves stay MPI's own blocking calls. Only time the process ran
    counts: a job gang-suspended meanwhile is not stuck."""

    def __init__(self):
        self.current: list | None = None  # [waited so far, describe] of the wait under way
        self.warned: list | None = None
        self.thread: threading.Thread | None = None

    @contextlib.contextmanager
    def waiting(self, describe):
        if self.thread is None:
            self.thread = threading.Thread(target=self._run, name="gangd-ckpt-mpi-watchdog", daemon=True)
            self.thread.start()
        self.current = [0.0, describe]
        try:
            yield
        finally:
            self.current = None

    def _run(self) -> None:
        tick = min(5.0, SLOW_WARNING / 4)
        while True:
            before = time.monotonic()
            time.sleep(tick)
            slept = time.monotonic() - before
            current = self.current
            if current is None or current is self.warned:
                continue
            if slept < 2 * tick + 0.5:  # (a longer nap: the process was stopped, not waiting)
                current[0] += slept
            if current[0] > SLOW_WARNING:
                self.warned = current
                try:
                    warn(current[1]())
                except Exception as exc:  # noqa: BLE001 -- a hint must never take the program down
                    warn(f"a wait in checkpoint(comm) is long ({exc!r} while looking why)")


_watch = _Watchdog()
