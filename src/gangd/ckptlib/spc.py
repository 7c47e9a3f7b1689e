"""Single-process checkpointers (SPC): how one process's state goes to a file and back.

Paper 001's portability idea: the consistent-checkpoint machinery (agreeing
on the cut, the send gates, the generations, the fork that writes behind the
job's back) does not care *how* a process saves itself. That is a plug-in:

    class Mine(spc.SPC):
        name = "mine"

        def do_ckpt(self, values, iteration):          # write self.path (maybe in the forked snapshot)
            with open(self.path, "wb") as f:
                pickle.dump((iteration, my_state()), f)

        def restart(self):                               # read self.path back
            with open(self.path, "rb") as f:
                iteration, state = pickle.load(f)
            load_my_state(state)
            return {}, iteration

    spc.register("mine", Mine)          # or an entry point in the group "gangd.spc"
    ckpt.init(spc="mine")               # or GANGD_CKPT_SPC=mine

The hooks, in order: ``set_filename(path)`` (where this checkpoint or
restart lives), ``before_ckpt(values)`` (in the process, before the snapshot
is forked), ``do_ckpt(values, iteration)`` (write the file; return (size,
checksum) if computed on the way, else None), then on a restart
``restart()`` (read it: returns the protected values and the iteration to
resume at) and ``after_restart(values)``. The framework fsyncs the file,
checksums it for the manifest, and verifies it before ``restart`` unless the
plug-in verifies while reading (``verifies = True``).

Handing over buffers (issue 17): a plug-in that writes its own file is
opaque to gangd, so every checkpoint rewrites all of it (a full file, as
before incremental checkpoints). A plug-in that instead implements
``buffers(values)`` (name -> numpy array, or any picklable value) and, on a
restart, ``restore_buffers(buffers)`` gets gangd's block format: only the
blocks changed since the parent or base generation are written, in the
job's mode (full, incremental, differential, adaptive), restored from the
chain with every block checked, and a damaged link falls back to an older
generation -- exactly as for the registered values, which are themselves
the plug-in ``buffers(values) = values``::

    class Grid(spc.SPC):
        name = "grid"

        def buffers(self, values):              # in the writing process (the forked snapshot, maybe)
            return {"cells": self.cells, "meta": {"t": self.t}}

        def restore_buffers(self, buffers):     # a restart: the same names, the arrays rebuilt
            self.cells, self.t = buffers["cells"], buffers["meta"]["t"]
            return {}                           # the values protect() hands back (none here)

Then ``do_ckpt`` and ``restart`` are not called (a subclass whose own
``do_ckpt`` or ``restart`` is more specific than its ``buffers`` keeps
writing its own file).

Built in: ``registered`` (the default: the values given to ``protect``,
numpy arrays raw) and ``callables`` (the program's own save/load functions;
its stream is opaque, so it writes full files).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from pathlib import Path

import msgpack
import numpy as np

from .. import ckptstore, directio
from ..ckptstore import StoreError
from . import image

ENTRY_POINTS = "gangd.spc"
FRAMEWORK = "__gangd."  # names of gangd's own entries among the values (a one-rank world's network): saved beside a plug-in's buffers


class SPC:
    name = "spc"
    verifies = False  # True: restart() checks the checksum itself while reading
    expect: tuple[int, str] | None = None  # (size, checksum) read() hands one that verifies

    def set_filename(self, path: Path) -> None:
        self.path = Path(path)

    def before_ckpt(self, values: dict) -> None:
        pass

    def do_ckpt(self, values: dict, iteration: int) -> tuple[int, str] | None:
        raise NotImplementedError

    def after_restart(self, values: dict) -> None:
        pass

    def restart(self) -> tuple[dict, int]:
        raise NotImplementedError

    def buffers(self, values: dict) -> Mapping[str, object]:
        """Optional: the state to save, as name -> buffer, instead of writing a file (``do_ckpt``).

        Called where the checkpoint is written (in the forked snapshot for
        background writes), with the protected values. A numpy array is
        written raw from its memory (no copy; a memoryview is taken as a 1-D
        uint8 array) and cut into blocks, so a generation writes only the
        blocks that changed; anything else is pickled, and the pickle is
        blocked the same way. Names are strings not starting with
        ``"__gangd."``. Keep a name's dtype and shape from one checkpoint to
        the next: a changed one is written whole (a new base for it).
        Not implemented (the default): the plug-in writes its own file with
        ``do_ckpt``, a full one every time.
        """
        raise NotImplementedError

    def restore_buffers(self, buffers: dict[str, object]) -> dict:
        """On a restart, what :meth:`buffers` handed over: arrays of the same
        dtype and shape (new, writable), the other values unpickled. Put
        them back in place and return the protected values ``protect()``
        gives the program (by default: the buffers themselves)."""
        return buffers


def hands_over(spc: SPC) -> bool:
    """Whether ``spc`` hands its state over as buffers (:meth:`SPC.buffers`),
    rather than writing its own file: its ``buffers`` is its own or a
    subclass's, and no more general than its ``do_ckpt`` and ``restart``."""
    mro = type(spc).__mro__

    def owner(name: str) -> type:
        return next(cls for cls in mro if name in vars(cls))

    own = owner("buffers")
    return own is not SPC and issubclass(own, owner("do_ckpt")) and issubclass(own, owner("restart"))


def handed_over(spc: SPC, values: dict) -> Mapping[str, object] | None:
    """The values to write block by block for ``spc``: its buffers, with
    gangd's own entries; None when ``spc`` writes its own file."""
    if not hands_over(spc):
        return None
    given = spc.buffers(values)
    if given is values:  # (the registered values as they are)
        return values
    if not isinstance(given, Mapping):
        raise TypeError(f"the {spc.name!r} checkpointer's buffers() gave {type(given).__name__}, not a mapping of names to buffers")
    handed: dict[str, object] = {}
    for name, buffer in given.items():
        if not isinstance(name, str) or not name or name.startswith(FRAMEWORK):
            raise TypeError(f"the {spc.name!r} checkpointer's buffers() named a buffer {name!r}: names are strings "
                            f"not starting with {FRAMEWORK!r}")
        handed[name] = _raw(buffer)
    handed.update((name, value) for name, value in values.items() if name.startswith(FRAMEWORK))
    return handed


def _raw(buffer: object) -> object:
    """A memoryview as the 1-D uint8 array of its bytes (a view when it is contiguous); anything else as it is."""
    if type(buffer) is not memoryview:
        return buffer
    return np.frombuffer(buffer if buffer.c_contiguous else buffer.tobytes(), dtype=np.uint8)


def _given_back(spc: SPC, values: dict) -> dict:
    """What a restore of a plug-in that hands over buffers returns: its
    ``restore_buffers`` of its own names, gangd's entries as they were."""
    if type(spc).restore_buffers is SPC.restore_buffers:  # (the registered values: nothing to split)
        return values
    ours = {name: values.pop(name) for name in [name for name in values if name.startswith(FRAMEWORK)]}
    restored = spc.restore_buffers(values)
    if restored is None:
        restored = {}
    if not isinstance(restored, dict):
        raise TypeError(f"the {spc.name!r} checkpointer's restore_buffers() gave {type(restored).__name__}, not a dict of protected values")
    return {**restored, **ours}


class Registered(SPC):
    """The values registered with ``protect`` (see :mod:`gangd.ckptlib.image`): the buffers handed over are the values."""

    name = "registered"
    verifies = True
    expect: tuple[int, str] | None = None

    def buffers(self, values: dict) -> dict:
        return values

    def do_ckpt(self, values: dict, iteration: int) -> tuple[int, str]:
        return ckptstore.write_atomic(self.path, image.chunks(values, iteration), durable=False)

    def restart(self) -> tuple[dict, int]:
        values, iteration, _ = image.load(self.path, self.expect)
        return values, iteration


class Callables(SPC):
    """The program saves and restores itself: ``save(file)`` writes its state,
    ``load(file)`` reads it back into the program."""

    name = "callables"

    def __init__(self, save: Callable | None = None, load: Callable | None = None):
        if save is None or load is None:
            raise TypeError("the callables checkpointer needs save= and load= (e.g. spc.Callables(save=..., load=...))")
        self.save, self.load = save, load

    def do_ckpt(self, values: dict, iteration: int) -> None:
        with open(self.path, "wb") as fh:
            header = msgpack.packb({"iteration": iteration})
            fh.write(len(header).to_bytes(4, "little") + header)
            self.save(fh)

    def restart(self) -> tuple[dict, int]:
        with open(self.path, "rb") as fh:
            length = int.from_bytes(fh.read(4), "little")
            iteration = msgpack.unpackb(fh.read(length))["iteration"]
            self.load(fh)
        return {}, iteration


_registry: dict[str, Callable[..., SPC]] = {"registered": Registered, "callables": Callables}


def register(name: str, factory: Callable[..., SPC]) -> None:
    """Make a checkpointer selectable by name (``ckpt.init(spc=name)``, ``GANGD_CKPT_SPC``)."""
    _registry[name] = factory


def _entry_points():
    # Imported here: importlib.metadata costs a rank tens of milliseconds at
    # start-up (more than the rest of gangd.ckptlib), and only a plug-in
    # asked for by a name not registered needs it.
    from importlib import metadata

    return metadata.entry_points(group=ENTRY_POINTS)


def names() -> list[str]:
    found = set(_registry)
    found.update(ep.name for ep in _entry_points())
    return sorted(found)


def select(choice, **options) -> SPC:
    """An SPC instance from an instance, a registered name or an entry point."""
    if isinstance(choice, SPC):
        return choice
    name = choice or os.environ.get("GANGD_CKPT_SPC") or "registered"
    factory = _registry.get(name)
    if factory is None:
        for ep in _entry_points():
            if ep.name == name:
                factory = ep.load()
                break
    if factory is None:
        raise ValueError(f"no single-process checkpointer named {name!r} (known: {', '.join(names())})")
    return factory(**options)


# ------------------------------------------------------------ the framework's side


def write(spc: SPC, path: Path, values: dict, iteration: int, let_go: bool = False) -> tuple[int, str]:
    """Have ``spc`` write the file, then make it durable and checksum it. ``let_go`` (a forked
    snapshot only, never the job): let go of the buffers' pages as they are written, and of what is
    left once all are (:mod:`.letgo`; not for a plug-in that writes its file itself)."""
    spc.set_filename(path)
    try:
        handed = handed_over(spc, values)
        computed: tuple[int, str] | None
        if handed is not None:
            copied = after_copy = None
            if let_go:
                from . import letgo

                copied, after_copy = letgo.AsCopied(handed), partial(letgo.let_go, handed)
            computed = ckptstore.write_atomic(path, image.chunks(dict(handed), iteration), durable=False, copied=copied,
                                              after_copy=after_copy, direct=directio.wanted())
        else:
            computed = spc.do_ckpt(values, iteration)
        fd = ckptstore.open_regular(path)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        ckptstore.fsync_dir(Path(path).parent)
        if computed:
            size, digest = computed  # (a plugin may hand back a list)
            return size, digest
        return ckptstore.checksum_file(path)
    except OSError as exc:
        raise StoreError(ckptstore.describe_os_error(exc, path)) from None


def read(spc: SPC, path: Path, expect: tuple[int, str] | None, chain: Sequence = (), pipeline: object = None,
         map_values: bool | None = None) -> tuple[dict, int]:
    """Check the file against the manifest's (size, checksum), then have ``spc`` restore it.

    ``chain``: the older generations an incremental file needs, newest first
    (as :func:`.blocks.read_chain` takes them); only a checkpointer that
    hands over buffers writes such files, and restores them. ``pipeline``: the
    :class:`gangd.pipeline.Settings` a compressed file is read with (None: the defaults); ``map_values``: large
    arrays are mappings of their files (:mod:`.mapped`; None: as ``GANGD_CKPT_RESTORE`` says)."""
    spc.set_filename(path)
    if hands_over(spc):
        if chain:
            from . import blocks  # (the block format loads at the first restore that needs it: ckptlib's start-up stays small)

            values, iteration, _ = blocks.read_chain(path, chain, expect, pipeline=pipeline, map_values=map_values)
        else:
            values, iteration, _ = image.load(path, expect, pipeline, map_values)
        values = _given_back(spc, values)
        spc.after_restart(values)
        return values, iteration
    if chain:
        raise StoreError(f"{path} is an incremental file, which only a checkpointer that hands over buffers restores "
                         f"(the {spc.name!r} checkpointer writes its own files)")
    if spc.verifies:
        spc.expect = expect
    elif expect is not None:
        try:
            found = ckptstore.checksum_file(path)
        except OSError as exc:
            raise StoreError(f"cannot read {path}: {exc.strerror}") from None
        if found[0] != expect[0]:
            raise StoreError(f"{path} is truncated or grew: {found[0]} bytes, the manifest says {expect[0]}")
        if found[1] != expect[1]:
            raise StoreError(f"{path} is corrupted: its checksum does not match the manifest")
    values, iteration = spc.restart()
    spc.after_restart(values)
    return values, iteration
