"""The checkpointer inside one rank: protected values, the loop's boundaries, the SIGQUIT handler.

A checkpoint can only be taken where the program's state is exactly its
protected values plus a loop counter (paper 002's model): at an iteration
boundary of :func:`loop`. SIGQUIT (or a timer, or :func:`request`) only
raises a flag; the loop sees it at the next boundary and hands over to the
backend, which decides *where* to save — at once when the process runs alone
(:class:`Standalone`), or at the boundary all ranks agreed on when gangd
runs the job (:class:`~gangd.ckptlib.agent.DaemonAgent`).

Incremental checkpoints (issue 17) alone: each generation is offered the
newest *complete* generation (never one a background write is still
writing) and its chain as its parent; the writer decides full, incremental,
differential or a new base (:mod:`gangd.checkpoint.delta`). Retention keeps
the newest ``keep`` complete generations and every generation they need,
and prunes in the program's process, where the writes still under way are
known (their parents are kept too). A restart restores a generation from
its chain and marks it ``DAMAGED`` when any link is unusable.
"""

from __future__ import annotations

import importlib
import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .. import ckptstore
from ..checkpoint import delta
from ..ckptstore import StoreError
from . import spc as spc_mod

if TYPE_CHECKING:
    from . import writer
    from .pace import AlonePlan

# The writer and the block format (:mod:`.writer`, :mod:`.blocks`) are
# imported at the first checkpoint or restore, not with ckptlib: a program
# pays nothing for them until it saves or loads (bench/ckpt.py Table 2).

DAMAGED = "DAMAGED"  # in a generation found unusable at a restart: why
COMM_VALUE = "__gangd.comm__"  # a one-rank world's network context, saved with the values


class CheckpointError(Exception):
    """A checkpoint or a restart could not be done; the message says why."""


DEFAULT_CODEC = "none"  # uncompressed unless a codec is asked for: every existing behaviour and figure unchanged


@dataclass(frozen=True)
class DeltaSettings:
    """How a rank's generations are written: mode, block size, chain bound, adaptive threshold, codec."""

    mode: str = delta.DEFAULT_MODE
    block_kib: int = delta.DEFAULT_BLOCK_KIB
    chain_max: int = delta.DEFAULT_CHAIN_MAX
    threshold: float = delta.DEFAULT_THRESHOLD
    given: frozenset[str] = frozenset()  # the settings the program (init, GANGD_CKPT_BLOCK_KIB) chose: they win over a daemon's offer
    codec: str = DEFAULT_CODEC  # a canonical gangd.codecs spec (CodecSpec.parse checked it): the job's, whoever runs it
    pipeline: str = ""  # canonical gangd.pipeline settings text (the job's --ckpt-pipeline); "": the defaults
    map_restore: bool = True  # a restore maps large arrays' files rather than copying them (GANGD_CKPT_RESTORE, .mapped)

    @classmethod
    def from_options(cls, mode: str | None = None, block_kib: int | None = None, chain_max: int | None = None,
                     threshold: float | None = None, codec: str | None = None, pipeline: object = None) -> DeltaSettings:
        """From ``init()``'s arguments, else ``GANGD_CKPT_MODE`` / ``GANGD_CKPT_BLOCK_KIB`` /
        ``GANGD_CKPT_CODEC`` / ``GANGD_CKPT_PIPELINE``, else the defaults (codec ``none``); checked."""
        given = frozenset(name for name, value in (("mode", mode), ("block_kib", block_kib), ("chain_max", chain_max), ("threshold", threshold))
                          if value is not None) | (frozenset({"block_kib"}) if os.environ.get("GANGD_CKPT_BLOCK_KIB") else frozenset())
        mode = mode or os.environ.get("GANGD_CKPT_MODE") or delta.DEFAULT_MODE
        if mode not in delta.MODES:
            raise CheckpointError(f"checkpoint mode {mode!r} is not one of {', '.join(delta.MODES)}")
        if block_kib is None:
            env = os.environ.get("GANGD_CKPT_BLOCK_KIB")
            try:
                block_kib = int(env) if env else delta.DEFAULT_BLOCK_KIB
            except ValueError:
                raise CheckpointError(f"GANGD_CKPT_BLOCK_KIB={env!r} is not a number of KiB") from None
        if type(block_kib) is not int or not 1 <= block_kib <= delta.MAX_BLOCK_KIB:
            raise CheckpointError(f"a checkpoint block is 1 to {delta.MAX_BLOCK_KIB} KiB, not {block_kib!r}")
        chain_max = delta.DEFAULT_CHAIN_MAX if chain_max is None else chain_max
        if type(chain_max) is not int or not 1 <= chain_max <= delta.MAX_CHAIN:
            raise CheckpointError(f"chain_max is 1 to {delta.MAX_CHAIN} generations, not {chain_max!r}")
        threshold = delta.DEFAULT_THRESHOLD if threshold is None else threshold
        if not isinstance(threshold, int | float) or not 0 <= threshold <= 1:
            raise CheckpointError(f"the adaptive threshold is a share of the state from 0 to 1, not {threshold!r}")
        from . import mapped  # (not at import: ckptlib's start-up stays small)

        try:
            map_restore = mapped.wanted()
        except mapped.RestoreSettingError as exc:
            raise CheckpointError(str(exc)) from None
        return cls(mode, block_kib, chain_max, float(threshold), given, checked_codec(codec), checked_pipeline(pipeline), map_restore)

    def under(self, offer) -> DeltaSettings:
        """The settings a rank under a daemon writes with, given its offer
        (:class:`gangd.checkpoint.messages.DeltaOffer`): the program's own
        choices, else the job's (the offer's); the chain never longer than the
        daemon accepts."""
        return DeltaSettings(self.mode if "mode" in self.given else offer.mode,
                             self.block_kib if "block_kib" in self.given else offer.block_kib,
                             min(self.chain_max, offer.chain_max) if "chain_max" in self.given else offer.chain_max,
                             self.threshold if "threshold" in self.given else offer.threshold, self.given, self.codec, self.pipeline,
                             self.map_restore)

    def plan(self, gen: int, offered, force_full: bool = False) -> dict:
        """What :func:`writer.write` takes as ``delta``."""
        return {"gen": gen, "mode": self.mode, "block": self.block_kib << 10, "chain_max": self.chain_max,
                "threshold": self.threshold, "force_full": force_full, "offered": offered, "codec": self.codec,
                "pipeline": self.pipeline}

    def pipeline_settings(self):
        """The :class:`gangd.pipeline.Settings` compressed generations are written and read with
        (None: the defaults; gangd.pipeline is imported only for settings that were given)."""
        from .units import settings_of

        return settings_of(self.pipeline)


def checked_codec(codec: object = None) -> str:
    """The canonical codec spec of ``codec``, else of ``GANGD_CKPT_CODEC``, else ``none``, its
    codec loaded; a CheckpointError naming the bad value and what is accepted, or the codec
    that is not installed on this node and how to install it. (gangd.codecs is imported only
    for a codec other than none: a program that does not compress pays nothing.)"""
    where = "init(codec=...)"
    if codec is None:
        codec, where = os.environ.get("GANGD_CKPT_CODEC") or DEFAULT_CODEC, "GANGD_CKPT_CODEC"
    if codec == DEFAULT_CODEC:
        return DEFAULT_CODEC
    from ..codecs import CodecError, CodecSpec, registry

    try:
        spec = CodecSpec.parse(codec)
        registry.load(spec)
    except CodecError as exc:
        node = os.environ.get("GANGD_NODE")
        here = f" on node {node[:64]}" if node else ""
        raise CheckpointError(f"{where}: checkpoint codec {str(codec)[:140]!r} is refused{here}: {exc}") from None
    return str(spec)


def checked_pipeline(settings: object = None) -> str:
    """The canonical pipeline settings text of ``settings`` (text such as ``"workers=2"`` or a
    mapping {"workers": 2}), else of ``GANGD_CKPT_PIPELINE``, else "" (the defaults); a
    CheckpointError naming the bad value and what is accepted."""
    where = "init(pipeline=...)"
    if settings is None:
        settings, where = os.environ.get("GANGD_CKPT_PIPELINE") or "", "GANGD_CKPT_PIPELINE"
    if settings == "":
        return ""
    from ..pipeline.settings import SettingsError, canonical, parse

    try:
        if isinstance(settings, dict):
            settings = ",".join(f"{k}={v}" for k, v in settings.items())
        return canonical(parse(settings))
    except SettingsError as exc:
        raise CheckpointError(f"{where}: {exc}") from None


class Checkpointer:
    def __init__(self, backend, *, background: bool, spc=None, settings: DeltaSettings | None = None):
        self.settings = settings if settings is not None else DeltaSettings()
        self.backend = backend
        self.background = background
        self.spc = spc if spc is not None else spc_mod.Registered()  # how this process's state is written
        self.values: dict[str, object] = {}
        self.restored: dict[str, object] = {}
        self.start = 0  # first iteration the loop runs (the saved one after a restart)
        self.iteration = -1  # the boundary passed last (-1: the loop has not started)
        self.in_loop = False
        self.loop_done = False
        self.requested = False  # set by the signal handler, a timer or request()
        self.watch = sys.maxsize  # the backend sees every boundary from this one on (an interval plan: issue 19)
        self.generation: int | None = None  # of the restart, then of the last checkpoint taken
        self.restarted_from: int | None = None
        self.writes: list[writer.Written] = []
        self.points: str | None = None  # "loop" or "mpi": where this program's checkpoints can happen
        self.closed = False

    # ------------------------------------------------------------ program side

    def protect(self, name: str, value):
        """``value``, or a factory (any callable) called only when there is
        no saved value: on a restart the saved one is returned instead."""
        if not isinstance(name, str) or not name:
            raise TypeError("protect() needs a name: ckpt.protect('u', lambda: np.zeros(n))")
        if name in self.restored:
            saved = self.restored[name]
            if not callable(value):
                check_same_kind(name, saved, value)
            value = self.restored.pop(name)
        elif callable(value):
            value = value()
        self.values[name] = value
        return value

    def loop(self, iterable):
        if self.in_loop:
            raise CheckpointError("ckpt.loop() is already running: a program has one checkpointed loop")
        self.use_points("loop")
        self.in_loop = True
        start = self.start
        if isinstance(iterable, range):
            items = iter(iterable[start:])
        else:
            items = iter(iterable)
            for _ in range(start):  # skip what the saved run already did
                if next(items, _END) is _END:
                    break
        k = start
        try:
            for item in items:
                self.iteration = k
                if self.requested or k >= self.watch:
                    self.backend.at_boundary(self, k)
                yield item
                k += 1
            self.iteration = k
            if self.requested or k >= self.watch:  # after the last item: a candidate point too (a rank may have reported it)
                self.backend.at_boundary(self, k)
        finally:
            self.in_loop = False
            self.loop_done = True

    def use_points(self, kind: str) -> None:
        """A program counts its checkpoint points one way: ``ckpt.loop()``
        iterations or ``ckptlib.mpi.checkpoint()`` calls (both restart from
        the same saved counter)."""
        if self.points not in (None, kind):
            raise CheckpointError("a program checkpoints either in ckpt.loop() or at ckptlib.mpi.checkpoint(comm) calls, not both")
        self.points = kind

    def request(self) -> None:
        """Checkpoint at the next boundary (the signal handler does the same)."""
        self.requested = True
        if self.backend is not None:  # (else the backend sees the flag when it attaches)
            self.backend.on_request(self)

    def signal_handler(self, signum, frame) -> None:
        if not self.closed:  # (after fini the handler stays, harmless: a late SIGQUIT must not kill)
            self.request()

    # ------------------------------------------------------------ saving

    def snapshot(self, path: Path, iteration: int, then=None, extra: dict | None = None, *, gen: int | None = None,
                 offered=None, settings: DeltaSettings | None = None, force_full: bool = False, hold: bool = False) -> writer.Written:
        """Write the protected values; ``iteration`` is the boundary a restart resumes at.

        With ``gen`` and ``offered`` (the parent generation's file and its chain,
        or a function giving them in the writing process), the generation is
        written in this checkpointer's mode (:class:`DeltaSettings`), or in
        ``settings`` (a daemon's offer); ``force_full``: no delta this time; ``hold``: a forked snapshot
        waits for :meth:`writer.Written.release` to write (:func:`writer.write`)."""
        values = {**self.values, **(extra or {})}
        self.spc.before_ckpt(values)
        settings = settings if settings is not None else self.settings
        plan = settings.plan(gen, offered, force_full) if gen is not None and offered is not None else None
        from . import writer

        written = writer.write(path, values, iteration, background=self.background, then=then, spc=self.spc, delta=plan, hold=hold)
        self.writes.append(written)
        return written

    def finish_writes(self) -> list[dict]:
        results = [w.wait() for w in self.writes]
        self.writes.clear()
        return results

    def fini(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.backend.fini(self)


_END = object()


def _describe_array(arr) -> str:
    return f"a {arr.dtype} array of shape {tuple(arr.shape)}"


def check_same_kind(name: str, saved, given) -> None:
    """A restart hands back the saved value for ``name``; when the program
    gives an array, the saved one must be an array of the same dtype and
    shape — else the program was restarted with other parameters than it
    was checkpointed with, and would run on state it does not expect."""
    np = sys.modules.get("numpy")
    if np is None or type(given) is not np.ndarray:  # (no numpy imported: given is no array)
        return
    if isinstance(saved, np.ndarray) and saved.dtype == given.dtype and saved.shape == given.shape:
        return
    what = _describe_array(saved) if isinstance(saved, np.ndarray) else f"a {type(saved).__name__}"
    raise CheckpointError(
        f"protect({name!r}): the checkpoint holds {what}, the program gives {_describe_array(given)}; "
        "restart with the parameters the job was checkpointed with, or protect the new state under another name"
    )


def codec_missing(exc: BaseException) -> bool:
    """Whether ``exc`` is :class:`gangd.codecs.CodecMissing`: a generation written with a codec this
    machine lacks. It is not damaged (neither marked nor skipped for an older one: installing the
    codec restores it), so a restart stops with its message (which codec, how to install it). The
    class is looked up only if codecs were loaded: a restart of raw files never imports them."""
    missing = getattr(sys.modules.get("gangd.codecs.errors"), "CodecMissing", None)
    return missing is not None and isinstance(exc, missing)


def warn(message: str) -> None:
    print(f"gangd.ckptlib: {message}", file=sys.stderr, flush=True)


class Standalone:
    """One process, no daemon: generations in a directory, a checkpoint at the next boundary."""

    def __init__(self, directory: Path, *, keep: int = 2, every: float | str | None = None):
        self.directory = Path(directory)
        self.keep = max(1, keep)
        self.auto: AlonePlan | None = None  # every="auto": the interval planned from this process's measurements (issue 19)
        if every == "auto":
            from .pace import AlonePlan

            try:
                self.auto = AlonePlan.from_environment(os.environ.get("GANGD_MTBF"))
            except ValueError as exc:
                raise CheckpointError(str(exc)) from None
            every = None
        elif every is not None and (isinstance(every, bool) or not isinstance(every, int | float) or not every > 0):
            raise CheckpointError(f"every is seconds between checkpoints or \"auto\", not {every!r}")
        self.every = every
        self._timer: threading.Timer | None = None
        self._cp: Checkpointer | None = None
        self._links: dict[int, list[int]] = {}  # a complete generation's links (they never change): read once
        self._inflight: dict[int, set[int]] = {}  # id of a write under way -> the generations it was offered
        self._newest: int | None = None  # the last generation this run started

    def complete(self) -> list[int]:
        return [
            g for g in ckptstore.generations(self.directory, 0)
            if (self._dir(g) / ckptstore.MANIFEST).exists() and not (self._dir(g) / DAMAGED).exists()
        ]

    def _dir(self, gen: int) -> Path:
        return ckptstore.gen_dir(self.directory, 0, gen)

    def _file(self, gen: int) -> Path:
        return self._dir(gen) / ckptstore.rank_file(0)

    def links(self, gen: int, expect: tuple[int, str] | None = None) -> list[int]:
        """The generations a restore of ``gen`` reads besides it (none for a full or a version 1 file);
        ``expect``: the manifest's (size, checksum) of its file (the size is checked first)."""
        known = self._links.get(gen)
        if known is None:
            from . import blocks

            path = self._file(gen)
            try:
                fd = ckptstore.open_regular(path)  # (no symlink; a FIFO is refused, never waited on)
                try:
                    v2 = os.pread(fd, len(blocks.MAGIC), 0) in (blocks.MAGIC, blocks.MAGIC3)
                finally:
                    os.close(fd)
            except OSError as exc:
                raise StoreError(f"cannot read {path}: {exc.strerror or exc}") from None
            known = self._links[gen] = list(blocks.read_index(path, expect).links) if v2 else []
        return known

    def chain(self, gen: int) -> list[tuple[int, Path, tuple[int, str]]]:
        """``gen``'s file and every link's, each with its manifest's (size, checksum); StoreError naming what is unusable."""
        name = ckptstore.rank_file(0)

        def listed(g: int) -> tuple[int, Path, tuple[int, str]]:
            directory = self._dir(g)
            if g != gen and (directory / DAMAGED).exists():
                raise StoreError(f"generation {gen} needs generation {g}, which is damaged ({directory / DAMAGED})")
            manifest = ckptstore.read_manifest(directory)
            if name not in manifest.files:
                raise StoreError(f"{directory / name} is not in the manifest")
            size, digest = manifest.files[name]
            return g, directory / name, (size, digest)

        first = listed(gen)
        return [first, *(listed(g) for g in self.links(gen, first[2]))]

    def restore(self, cp: Checkpointer, restart) -> None:
        """Load the generation asked for (``restart``: True/"latest", "auto", or a number)."""
        complete = self.complete()
        if restart == "auto" and not complete:
            return
        explicit = isinstance(restart, int) or str(restart).isdigit()
        candidates = [int(restart)] if explicit else sorted(complete, reverse=True)
        if not candidates:
            raise CheckpointError(f"no complete checkpoint in {ckptstore.job_dir(self.directory, 0)} to restart from")
        problems = []
        for gen in candidates:
            directory = self._dir(gen)
            try:
                chain = self.chain(gen)
                values, iteration = spc_mod.read(cp.spc, chain[0][1], chain[0][2], chain[1:], cp.settings.pipeline_settings(),
                                                 cp.settings.map_restore)
            except StoreError as exc:
                problems.append(str(exc))
                if explicit:
                    break
                warn(f"generation {gen} is unusable ({exc}); trying an older one")
                # Marked (not deleted: evidence), so retention never keeps it over intact ones.
                (directory / DAMAGED).write_text(f"{exc}\n")
                continue
            except Exception as exc:
                if codec_missing(exc):
                    raise CheckpointError(f"cannot restart from generation {gen}: {exc}") from None
                raise
            network = values.pop(COMM_VALUE, None)
            if network is not None:
                importlib.import_module("gangd.comm.world").restore_alone_context(network)
            cp.restored, cp.start, cp.generation = values, iteration, gen
            cp.restarted_from = gen
            return
        raise CheckpointError("cannot restart: " + "; ".join(problems))

    def attach(self, cp: Checkpointer) -> None:
        self._cp = cp
        if self.auto is not None:
            cp.watch = 0  # every boundary: the pace is measured, the planned iteration recognised
        if self.every:
            self._arm()

    def _arm(self) -> None:
        if not self.every:
            return
        self._timer = threading.Timer(self.every, self._tick)
        self._timer.daemon = True
        self._timer.start()

    def _tick(self) -> None:
        if self._cp is not None and not self._cp.closed:
            self._cp.requested = True
            self._arm()

    def on_request(self, cp: Checkpointer) -> None:
        pass

    def agree(self, cp: Checkpointer, k: int, force: bool = False) -> int | None:
        """At ``ckptlib.mpi.checkpoint()`` call ``k``: save here? (Alone: when asked.)"""
        cp.iteration = k
        if self.auto is not None and self.auto.due(k, time.monotonic()):
            cp.requested = True
        return 0 if cp.requested else None

    def decline(self, cp: Checkpointer, gen: int, why: str) -> None:
        cp.requested = False

    def save(self, cp: Checkpointer, gen: int, k: int, resume: int) -> int | None:
        began = time.monotonic()
        self._save(cp, k, resume)
        if self.auto is not None:
            self.auto.saved(k, time.monotonic() - began)
        return cp.generation

    def _offer(self) -> tuple[int | None, set[int]]:
        """The parent a new generation is offered: the newest complete generation
        whose chain is intact (None: write a full one), and the generations it names."""
        for gen in sorted(self.complete(), reverse=True):
            try:
                return gen, {gen, *self.links(gen)}
            except StoreError:
                continue
        return None, set()

    def at_boundary(self, cp: Checkpointer, k: int, resume: int | None = None) -> None:
        """Save at boundary ``k``; a restart resumes at ``resume`` (default ``k``: the loop runs item k again).
        Under ``every="auto"`` every boundary comes here: only the planned ones (or a request) save."""
        if self.auto is None:
            self._save(cp, k, resume)
            return
        began = time.monotonic()
        if not (self.auto.due(k, began) or cp.requested):
            return
        self._save(cp, k, resume)
        self.auto.saved(k, time.monotonic() - began)

    def _save(self, cp: Checkpointer, k: int, resume: int | None) -> None:
        cp.requested = False
        gen = max(ckptstore.generations(self.directory, 0), default=cp.generation or 0) + 1
        directory = self._dir(gen)
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        name = ckptstore.rank_file(0)

        def commit(result: dict) -> None:  # runs where the state was written (the snapshot child)
            manifest = ckptstore.Manifest(0, gen, os.uname().nodename, k, {name: [result["size"], result["digest"]]}, [0], time.time())
            ckptstore.write_manifest(directory, manifest)

        self._reap(cp)
        parent, named = self._offer()

        def offered() -> list:  # in the writing process: the parent's and its links' manifests
            if parent is None:
                return []
            try:
                return self.chain(parent)
            except StoreError:
                return []

        # Alone, nobody else saves the messages a one-rank world sent itself and did not receive yet.
        comm_world = sys.modules.get("gangd.comm.world")
        network = comm_world.alone_context() if comm_world is not None else None
        written = cp.snapshot(directory / name, k if resume is None else resume, then=commit, extra={COMM_VALUE: network} if network else None,
                              gen=gen, offered=offered)
        self._inflight[id(written)] = named
        cp.generation = self._newest = gen
        self._reap(cp)
        self.prune(gen)

    def _reap(self, cp: Checkpointer) -> None:
        """Report the writes that finished and forget what they were offered."""
        for done in [w for w in cp.writes if w.done or _exited(w)]:
            self._report(done.wait())
            cp.writes.remove(done)
            self._inflight.pop(id(done), None)

    def _report(self, result: dict) -> None:
        if "error" in result:
            warn(f"checkpoint failed: {result['error']}")

    def prune(self, newest: int) -> None:
        """Keep the newest ``keep`` complete generations up to ``newest`` and
        every generation they need (their chains), and the chains offered to
        writes still under way; drop the other complete ones. Uncommitted ones
        are left alone: an older snapshot may still be writing (writes can
        finish out of order)."""
        complete = sorted((g for g in self.complete() if g <= newest), reverse=True)
        needs: dict[int, list[int]] = {}
        for gen in complete:
            try:
                needs[gen] = self.links(gen)
            except StoreError:
                needs[gen] = []  # unreadable: it restores nothing, and needs nothing kept
        seeds = set(complete[: self.keep])
        for named in self._inflight.values():
            seeds |= named
        keep = delta.needed(needs, seeds)
        for gen in complete:
            if gen not in keep:
                ckptstore.remove(self._dir(gen))
                self._links.pop(gen, None)

    def fini(self, cp: Checkpointer) -> None:
        if self._timer is not None:
            self._timer.cancel()
        for result in cp.finish_writes():
            self._report(result)
        self._inflight.clear()
        if self._newest is not None:  # (this run wrote generations: retention catches up with the last)
            self.prune(self._newest)


def _exited(written: writer.Written) -> bool:
    """The background write finished (its pipe has the result, or EOF)."""
    import select

    return written.done or bool(select.select([written.pipe], [], [], 0)[0])
