"""Paths root touches, handled through file descriptors so no user can redirect them.

The daemon runs as root and works in directories that hold files of users
(rank sockets and counters, checkpoint generations). A path string is looked
up again at every use: a user who can write to any directory on it — or who
planted a symlink there while the daemon was down — decides what root
chowns, writes, reads or removes. So every directory the daemon uses is

* reached by a walk from ``/``, one ``openat(O_DIRECTORY | O_NOFOLLOW)`` per
  component, each checked (:func:`open_trusted_dir`): owned by root (or the
  daemon's own uid), not a symlink, not writable by anyone else — a
  world-writable ancestor only with the sticky bit (``/tmp``), where
  nobody can replace the root-owned entry below it;
* then used only relative to that descriptor: ``mkdirat``, ``openat`` with
  ``O_NOFOLLOW``, ``fchown``/``fchmod`` on the opened fd, ``unlinkat``, and
  :func:`rmtree_at` (``shutil.rmtree`` with ``dir_fd``, which never follows
  a link); and
* files root *reads* from a place a user can write are opened without
  following links or blocking (``O_NOFOLLOW | O_NONBLOCK``), must be regular
  files, and are read to a size limit checked with ``fstat`` first
  (:func:`read_bounded_at`), so a sparse 64 GB file is an error, not an
  out-of-memory kill.

Failures are :class:`UnsafePath` with a sentence naming the path and what is
wrong with it; the daemon turns them into a refusal to start or a request
error. Blocking calls on file systems users can slow belong in a thread
(``trio.to_thread.run_sync``); these helpers are plain synchronous code.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class UnsafePath(Exception):
    """A path the daemon must not use (a link, not root's, writable by others, too large, not a file...)."""


def trusted_uids() -> frozenset[int]:
    return frozenset({0, os.geteuid()})


def describe_mode(mode: int) -> str:
    return f"{stat.S_IMODE(mode):04o}"


def check_dir(info: os.stat_result, path: Path | str, *, final: bool = True) -> None:
    """Raise :class:`UnsafePath` unless ``info`` is a directory root can trust.

    ``final``: the directory the daemon itself uses — no write for group or
    others at all. Otherwise an ancestor on the way there: writable by others
    only with the sticky bit (nobody but its owner may rename or remove the
    root-owned entry below it).
    """
    if not stat.S_ISDIR(info.st_mode):
        raise UnsafePath(f"{path} is not a directory")
    if info.st_uid not in trusted_uids():
        raise UnsafePath(f"{path} belongs to uid {info.st_uid}, not root: whoever owns it could redirect the daemon's files")
    writable = info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    if writable and (final or not info.st_mode & stat.S_ISVTX):
        raise UnsafePath(
            f"{path} is writable by {'its group' if writable == stat.S_IWGRP else 'other users'} "
            f"(mode {describe_mode(info.st_mode)}): they could replace what the daemon keeps there"
        )


def _open_component(dir_fd: int, name: str, path: Path) -> int:
    try:
        return os.open(name, DIR_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            try:
                info = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            except OSError:
                info = None
            if info is not None and stat.S_ISLNK(info.st_mode):
                raise UnsafePath(f"{path} is a symbolic link: the daemon uses no path through a link") from None
            raise UnsafePath(f"{path} is not a directory") from None
        raise


def open_trusted_dir(path: Path | str, *, create_mode: int | None = None, sticky_ok: bool = False) -> int:
    """An fd of the directory ``path``, reached from ``/`` without following a
    link, every component checked (see the module docstring).

    ``create_mode``: create missing components (as the daemon's, this mode).
    ``sticky_ok``: the directory itself may be a sticky world-writable one
    (a socket's directory; never one the daemon puts files of users in).
    """
    path = Path(os.path.abspath(path))
    fd = os.open("/", DIR_FLAGS)
    current = Path("/")
    try:
        parts = path.parts[1:]
        check_dir(os.fstat(fd), current, final=not parts and not sticky_ok)
        for i, name in enumerate(parts):
            current = current / name
            final = i == len(parts) - 1
            try:
                child = _open_component(fd, name, current)
            except FileNotFoundError:
                if create_mode is None:
                    raise UnsafePath(f"{current} does not exist") from None
                try:
                    os.mkdir(name, create_mode, dir_fd=fd)
                except FileExistsError:
                    pass
                child = _open_component(fd, name, current)
                info = os.fstat(child)
                if info.st_uid in trusted_uids() and stat.S_IMODE(info.st_mode) != create_mode:
                    os.fchmod(child, create_mode)  # (the umask took bits away)
            os.close(fd)
            fd = child
            check_dir(os.fstat(fd), current, final=final and not sticky_ok)
        return fd
    except UnsafePath:
        os.close(fd)
        raise
    except OSError as exc:
        os.close(fd)
        raise UnsafePath(f"{current}: {exc.strerror or exc}") from None


def open_dir_at(dir_fd: int, name: str, where: Path | str, *, create_mode: int | None = None,
                owner: int | None = None, trusted: bool = True) -> int:
    """An fd of the directory ``name`` in ``dir_fd`` (never through a link).

    ``create_mode``: create it if missing. ``trusted``: it must be the
    daemon's and writable by no one else (:func:`check_dir`); otherwise, with
    ``owner``, it must belong to that uid (a user's directory root only
    reads from).
    """
    path = Path(where) / name
    if create_mode is not None:
        try:
            os.mkdir(name, create_mode, dir_fd=dir_fd)
        except FileExistsError:
            pass
    try:
        fd = _open_component(dir_fd, name, path)
    except FileNotFoundError:
        raise UnsafePath(f"{path} does not exist") from None
    try:
        info = os.fstat(fd)
        if trusted:
            check_dir(info, path)
        elif owner is not None and info.st_uid not in (owner, *trusted_uids()):
            raise UnsafePath(f"{path} belongs to uid {info.st_uid}, not {owner}")
    except BaseException:
        os.close(fd)
        raise
    return fd


def rmtree_at(dir_fd: int, name: str) -> None:
    """Remove ``name`` in ``dir_fd`` and everything below it, never following a
    link (a link itself is unlinked, not its target)."""
    try:
        info = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(info.st_mode):
        try:
            os.unlink(name, dir_fd=dir_fd)
        except FileNotFoundError:
            pass
        return
    import shutil  # (here: its import pulls in bz2, lzma and zlib, which a rank's start-up need not pay)

    # With dir_fd, shutil.rmtree opens every level with O_NOFOLLOW and
    # compares it to its lstat: a link swapped in meanwhile is refused.
    if not shutil.rmtree.avoids_symlink_attacks:  # true on Linux; never fall back to a following rmtree
        raise RuntimeError("shutil.rmtree cannot avoid symlink attacks on this platform")
    shutil.rmtree(name, ignore_errors=True, dir_fd=dir_fd)


def clear_dir(dir_fd: int) -> None:
    """Remove everything in the directory ``dir_fd`` (link-safe)."""
    for name in os.listdir(dir_fd):
        rmtree_at(dir_fd, name)


def open_regular_at(dir_fd: int | None, name: str, where: Path | str) -> int:
    """An fd (read-only) of the regular file ``name`` — never through a
    symlink, never blocking on a FIFO. ``dir_fd`` None: ``name`` is a path."""
    path = Path(where) / name if dir_fd is not None else Path(name)
    try:
        fd = os.open(name, FILE_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        raise
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafePath(f"{path} is a symbolic link") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UnsafePath(f"{path} is not a regular file")
    return fd


def read_fd_bounded(fd: int, limit: int, path: Path | str) -> bytes:
    """The whole file ``fd`` if it holds at most ``limit`` bytes (checked before
    reading, and again while reading: it may grow meanwhile)."""
    size = os.fstat(fd).st_size
    if size > limit:
        raise UnsafePath(f"{path} is {size} bytes, more than the {limit} bytes such a file may have")
    chunks: list[bytes] = []
    total = 0
    while True:
        chunk = os.pread(fd, min(1 << 20, limit + 1 - total), total)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
        total += len(chunk)
        if total > limit:
            raise UnsafePath(f"{path} grew past the {limit} bytes such a file may have while it was read")


def read_bounded_at(dir_fd: int | None, name: str, limit: int, where: Path | str, *, owner: int | None = None) -> bytes:
    """Contents of the regular file ``name`` in ``dir_fd``, at most ``limit``
    bytes, never through a link; ``owner``: it must also belong to that uid."""
    fd = open_regular_at(dir_fd, name, where)
    try:
        if owner is not None and (uid := os.fstat(fd).st_uid) != owner:
            raise UnsafePath(f"{Path(where) / name} belongs to uid {uid}, not {owner}: it is not the daemon's file")
        return read_fd_bounded(fd, limit, Path(where) / name if dir_fd is not None else name)
    finally:
        os.close(fd)


def open_owned_regular_at(dir_fd: int, name: str, where: Path | str, *, owner: int) -> int:
    """An fd (read-only) of the regular file ``name`` in ``dir_fd`` that
    belongs to ``owner`` and has no other name (a hard link to a file
    elsewhere is not the file the daemon wrote): for files in a directory
    others may have reached, such as a shared flush directory. Never through
    a link, never blocking on a FIFO."""
    fd = open_regular_at(dir_fd, name, where)
    try:
        info = os.fstat(fd)
        if info.st_uid != owner:
            raise UnsafePath(f"{Path(where) / name} belongs to uid {info.st_uid}, not {owner}: it is not the daemon's file")
        if info.st_nlink != 1:
            raise UnsafePath(f"{Path(where) / name} has {info.st_nlink} names (hard links): it is not the daemon's file")
    except BaseException:
        os.close(fd)
        raise
    return fd
