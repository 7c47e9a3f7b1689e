"""Writing a rank's state: inline, or behind the program's back from a forked snapshot.

``fork()`` gives a copy-on-write snapshot of the whole process in the time it
takes to copy its page tables; the child writes the protected values from
that snapshot while the parent — the job — runs on. Pages the job modifies
meanwhile are copied by the kernel, so the child still sees the state of the
cut. The child reports (size, checksum) or the error through a pipe and
leaves with ``os._exit`` (no atexit handlers, no flushing of the parent's
buffers, no touching the parent's sockets).
The parent takes the report as soon as it is whole, not at the
child's exit: tearing down the child's copy of a large address space
would otherwise lengthen every checkpoint (the child is reaped later).

Incremental checkpoints (issue 17): given a ``delta`` plan (mode, block
size, chain bound, threshold, this generation's number and the offered
parent with its chain), the default checkpointer's values are written by
:func:`.blocks.save_generation` -- hashed, compared with the parent's and
the base's signatures (read from their indexes here, in the writing process:
the job never holds them) and only the blocks chosen written. The result
then also says "role", "parent", "base", "links", "state" and "restore".
So are a plug-in's buffers (:meth:`.spc.SPC.buffers`); a plug-in with its
own ``do_ckpt`` always writes a full file.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import msgpack

from ..ckptstore import StoreError
from . import blocks, letgo, mapped, units
from . import spc as spc_mod


class Written:
    """A write under way (or already done, for inline writes)."""

    def __init__(self, *, pid: int | None = None, fd: int | None = None, result: dict | None = None, go: socket.socket | None = None):
        self.pid, self.fd, self.result = pid, fd, result
        self._go = go  # a held snapshot's word to write or not (see write's ``hold``)
        self._going = threading.Lock()  # (the reader thread's wait and the rank's own release may meet)

    def release(self, write: bool = True) -> None:
        """Tell a held snapshot to write, or (``write=False``: its checkpoint was abandoned) to leave
        without writing; once, and nothing for one that was not held. Never a SIGPIPE, if it died."""
        with self._going:
            go, self._go = self._go, None
        if go is not None:
            try:
                go.send(b"g" if write else b"x", socket.MSG_NOSIGNAL)
            except OSError:  # (the writer is gone: its report, or its death, says why)
                pass
            go.close()

    @property
    def done(self) -> bool:
        return self.result is not None

    @property
    def pipe(self) -> int:
        """The pipe a background write's result comes through."""
        if self.fd is None:
            raise RuntimeError("an inline write has no result pipe")
        return self.fd

    def wait(self) -> dict:
        """Block until the write finished; returns {"size", "digest", "seconds"} or {"error"}.

        The answer is the child's report as soon as it is whole: the child
        wrote it after its file was on disk, and what is left -- its exit,
        which tears down its copy of the job's address space (milliseconds
        for a large state) -- is not waited for here; the child is reaped
        later (:func:`reap`). A child that dies before its report is whole
        is waited for, and its exit status is the error."""
        self.release()  # (a held writer would never report)
        if self.result is None:
            if self.fd is None or self.pid is None:
                raise RuntimeError("a write has neither its result nor a writer process")
            unpacker = msgpack.Unpacker(raw=False, max_buffer_size=MAX_REPORT)
            report: Any = None
            whole = False
            try:
                while chunk := os.read(self.fd, 65536):
                    unpacker.feed(chunk)
                    try:
                        report, whole = unpacker.unpack(), True
                        break
                    except msgpack.OutOfData:
                        continue
            except Exception:  # noqa: BLE001 -- whatever a dying writer left half-written, the report is how it died
                whole = False
            os.close(self.fd)
            if whole:
                self.result = report
                _unreaped.append(self.pid)
                reap()
            else:
                try:
                    _, status = os.waitpid(self.pid, 0)
                    how = _describe(status)
                except ChildProcessError:  # (the program ignores SIGCHLD, or reaped it itself: no status to tell)
                    how = "its exit status was collected elsewhere"
                self.result = {"error": f"the writer process died ({how})"}
        return self.result


#: Bytes of a writer's report (a few hundred: sizes, a checksum, the links up to the chain bound).
MAX_REPORT = 1 << 20
_unreaped: list[int] = []  # writers whose report came, reaped once they are gone


def reap() -> None:
    """Collect the writers that reported and have exited since (never blocks; a zombie left
    here is collected by the next write, wait or checkpoint)."""
    for pid in list(_unreaped):
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:  # (someone else reaped it)
            done = pid
        if done:
            _unreaped.remove(pid)


def _describe(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"killed by {signal.Signals(os.WTERMSIG(status)).name}"
    return f"exit {os.WEXITSTATUS(status)}"


def write(path: Path, values: dict, iteration: int, *, background: bool, then: Callable[[dict], None] | None = None, spc=None,
          delta: dict | None = None, hold: bool = False) -> Written:
    """Save ``values`` to ``path``; in the background (forked snapshot) or now.

    ``hold``: the forked snapshot waits for :meth:`Written.release` before it
    writes anything. A rank under gangd holds it until the job resumes:
    between its fork and the end sync the job is blocked, and a snapshot
    writing meanwhile takes the cores the job's ranks and daemons need to get
    through that sync (with 4 ranks on 2 cores, the snapshots' copying into
    the page cache stretched the job's blocked time by tens of milliseconds
    per checkpoint). It only starts writing that much later: its work is the
    same. Released with ``write=False`` (the end sync failed: the generation
    is aborted), or left by a job that is gone (its report could never reach
    the daemons, which fail the generation), it leaves without writing, and
    its report says so.

    ``then(result)`` runs after a successful write, in whichever process
    wrote (the child, for background writes): committing a manifest, say.
    ``delta``: {"gen", "mode", "block", "chain_max", "threshold",
    "force_full", "offered"} for an incremental checkpoint (see the module
    docstring); "offered" is the parent and its chain as
    :func:`.blocks.read_chain` takes them, or a function returning them
    (called in the writing process).
    """
    reap()
    mapped.settle()  # (a restart's arrays still mappings of their files: anonymous memory again, before the cut)
    if delta is not None and delta.get("mode") != "full":
        _cut(delta, values)
    if not background:
        return Written(result=_write_now(path, values, iteration, then, spc, delta))
    if delta is not None:
        _preload(delta.get("codec"))
    pipes: list[int] = []
    go: tuple[socket.socket, socket.socket] | None = None
    try:
        read_end, write_end = os.pipe()
        pipes += [read_end, write_end]
        go = socket.socketpair() if hold else None  # (a socket: the release's send can refuse SIGPIPE)
    except OSError:  # out of fds: write now rather than not at all
        for fd in pipes:
            os.close(fd)
        return Written(result=_write_now(path, values, iteration, then, spc, delta))
    try:
        pid = os.fork()
    except OSError as exc:  # out of memory or processes: the job must not die of a checkpoint
        for fd in pipes:
            os.close(fd)
        for end in go or ():
            end.close()
        print(f"gangd.ckptlib: cannot fork a snapshot ({exc.strerror}); writing before continuing", file=sys.stderr, flush=True)
        return Written(result=_write_now(path, values, iteration, then, spc, delta))
    if pid == 0:  # the snapshot: write, report, vanish
        try:
            signal.signal(signal.SIGQUIT, signal.SIG_IGN)
            os.close(read_end)
            if go is not None:
                go[0].close()
                said = go[1].recv(1)  # "g": write; "x" (abandoned) or nothing (the job is gone): leave
                go[1].close()
                if said != b"g":
                    os.write(write_end, msgpack.packb({"error": "the checkpoint was abandoned before its snapshot wrote it"}))
                    os._exit(0)
            result = _write_now(path, values, iteration, then, spc, delta, let_go=True)
            os.write(write_end, msgpack.packb(result))
        finally:
            os._exit(0)
    os.close(write_end)
    if go is not None:
        go[1].close()
    return Written(pid=pid, fd=read_end, go=go[0] if go is not None else None)


def _cut(delta: dict, values: dict) -> None:
    """Record, in the job at the cut, which blocks of the protected arrays were
    written since the recent cuts (:mod:`.dirty`): the writing process then
    hashes only those (ctypes is imported for it only when a delta is cut)."""
    from . import dirty

    watch = dirty.watch()
    if watch is None:
        return
    try:
        watch.cut(int(delta["gen"]), values, int(delta["block"]))
    except Exception:  # noqa: BLE001 -- never fail a checkpoint for it: forget every mask, every block is hashed
        watch.tracked.clear()


def _watch(delta: dict):
    """The write watch a cut in this process (or in the job this snapshot was forked from) made, if any."""
    if delta.get("mode") == "full":
        return None
    from . import dirty

    return dirty.current()


def _preload(text: object) -> None:
    """Load the codec a forked snapshot will compress with, here in the job, once (ckptlib.init
    has, under a job: this is for a plan whose codec init did not see).

    A snapshot is a fresh fork of the job each time: what it imports dies
    with it. blosc2's import alone is 0.4-0.6 s of CPU (httpx and numpy
    submodules it pulls in; ``python -X importtime``), which every
    background checkpoint paid again in its child, on a 16 MiB state 3x
    the compression itself. Loaded here, the job pays it at its first
    compressed checkpoint and every snapshot inherits it. A codec that
    cannot be loaded is left for the snapshot to report as its error.
    """
    if text in (None, "none"):
        return
    from ..codecs import registry

    try:
        registry.load(str(text))
    except Exception:  # noqa: BLE001,S110 -- the snapshot reports it (the job must not die of a checkpoint)
        pass


def _codec(text: object):
    """The spec a plan's codec names (None for none: the uncompressed path, gangd.codecs not imported)."""
    if text in (None, "none"):
        return None
    from ..codecs import CodecSpec

    return CodecSpec.parse(text)


def _write_now(path: Path, values: dict, iteration: int, then, spc, delta: dict | None = None, let_go: bool = False) -> dict:
    """Write the file here and now. ``let_go`` (a forked snapshot only, never the job): once the file's
    bytes are all copied, drop this process's pages of the arrays (:mod:`.letgo`)."""
    started = time.monotonic()
    try:
        handed = None if delta is None else spc_mod.handed_over(spc or spc_mod.Registered(), values)
        if delta is not None and handed is not None:  # (the registered values, or a plug-in's buffers: block by block)
            offered = delta.get("offered") or ()
            result = blocks.save_generation(path, handed, gen=delta["gen"], iteration=iteration, mode=delta["mode"],
                                            offered=offered() if callable(offered) else offered, block=delta["block"],
                                            chain_max=delta["chain_max"], threshold=delta["threshold"],
                                            force_full=bool(delta.get("force_full")), codec=_codec(delta.get("codec")),
                                            pipeline=units.settings_of(delta.get("pipeline")), watch=_watch(delta),
                                            after_copy=partial(letgo.let_go, handed) if let_go else None)
            result["seconds"] = time.monotonic() - started
        else:
            size, digest = spc_mod.write(spc or spc_mod.Registered(), path, values, iteration, let_go=let_go)
            result = {"size": size, "digest": digest, "seconds": time.monotonic() - started}
        if then is not None:
            then(result)
        return result
    except (StoreError, TypeError) as exc:
        return {"error": str(exc)}
    except Exception as exc:  # noqa: BLE001 -- whatever it was, the job must hear it, not die of it
        return {"error": f"{type(exc).__name__}: {exc}"}
