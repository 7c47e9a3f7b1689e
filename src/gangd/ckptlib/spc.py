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

Built in: ``registered`` (the default: the values given to ``protect``,
numpy arrays raw) and ``callables`` (the program's own save/load functions).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import msgpack

from .. import ckptstore
from ..ckptstore import StoreError
from . import image

ENTRY_POINTS = "gangd.spc"


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


class Registered(SPC):
    """The values registered with ``protect`` (see :mod:`gangd.ckptlib.image`)."""

    name = "registered"
    verifies = True
    expect: tuple[int, str] | None = None

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


def write(spc: SPC, path: Path, values: dict, iteration: int) -> tuple[int, str]:
    """Have ``spc`` write the file, then make it durable and checksum it."""
    spc.set_filename(path)
    try:
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


def read(spc: SPC, path: Path, expect: tuple[int, str] | None) -> tuple[dict, int]:
    """Check the file against the manifest's (size, checksum), then have ``spc`` restore it."""
    spc.set_filename(path)
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
