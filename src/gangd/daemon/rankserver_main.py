"""The warm rank server: what a job's owner runs so that a rank skips Python's start.

A rank of a Python job spends most of its start importing (numpy ~70 ms,
gangd's ckptlib and comm ~30 ms of CPU, each rank of every start and every
restart). This program is started by the daemon AS THE JOB'S OWNER, with the
job's interpreter (``PYTHON path/to/rankserver_main.py FD``, no gangd needed),
imports those modules once, and then forks a rank per request on the
SOCK_SEQPACKET socket ``FD``: the child becomes the rank (``python
script.py ...`` or ``python -m module ...``) without an exec, the imports
already done — the zygote / forkserver idea.

It is deliberately stdlib-only and self-contained (it runs with whatever
Python the user's job names, which may not have gangd installed) and single
threaded (a fork copies one thread). Everything it says is untrusted by the
daemon (see gangd.daemon.rankserver): it runs as the user. What it must get
right for the *user's* sake is that the child is indistinguishable from an
exec'd rank: argv, ``__main__``, ``sys.path[0]``, the exact environment,
cwd, umask, rlimits, stdio, no other fds, default signal state, reseeded
random generators, and the interpreter's own exit path (atexit, flushing,
exit codes). Anything it cannot reproduce exactly, the child refuses before
the daemon lets it run ("F"), and the daemon execs the rank instead.

Protocol (one JSON object per datagram): server -> daemon ``{"hello": 1,
"pid": ...}`` once ready; daemon -> server ``{"argv", "env", "cwd",
"umask", "rlimits"}`` with five fds (stdout, stderr, ready_w, go_r,
status_w); server -> daemon ``{"pid": N}`` or ``{"error": "..."}``. The child
writes ``R`` (or ``F`` and a reason) on ready_w once set up, then waits for
``G`` on go_r — sent once the daemon has moved it into the job's cgroup. When
the child ends, the server writes its raw wait status (decimal) on status_w.
"""

from __future__ import annotations

import os
import sys

PROTOCOL = 1
IDLE_TIMEOUT = float(os.environ.get("GANGD_RANK_SERVER_IDLE", "600"))  # (read at start, before any job env exists)
_MODULES_AT_START = set(sys.modules)
#: What the interpreter itself put in the environment at start (PEP 538's
#: locale coercion sets LC_CTYPE when the locale is C): an exec'd rank's
#: os.environ has it too. The daemon keys servers by the LC_* variables, so a
#: job without LC_CTYPE got the same coercion the server did.
_LC_CTYPE_AT_START = os.environ.get("LC_CTYPE")
_PATH_AT_START = list(sys.path[1:])  # sys.path[0] is this file's directory: never the rank's
del sys.path[0]
#: What most ranks import (the stdlib ones a few ms each): a module a rank's
#: directory would shadow makes that rank exec'd (see _shadowed). The ckptlib
#: modules after ``gangd.ckptlib`` are what its ``init()`` under a job and a
#: restore import on first use (the daemon agent, the checkpoint messages'
#: dataclasses, the block format, the pacer's statistics, idna for the
#: daemon's address): 0.1-0.15 s of a restarted rank's start, four ranks on
#: two cores at once (bench/restart.py's profile), before they were here.
#: ``shutil`` is what argparse imports when a program makes its first parser
#: (its help formatter asks for the terminal's size): 7-10 ms of CPU in each
#: forked rank, with the bz2 and lzma it imports.
_WARM = ("numpy", "gangd.ckptlib", "gangd.ckptlib.agent", "gangd.checkpoint.messages", "gangd.ckptlib.blocks", "gangd.ckptlib.units", "gangd.ckptlib.pace",
         "gangd.ckptlib.writer", "gangd.comm", "encodings.idna", "argparse", "shutil", "subprocess", "json", "logging")


def _warm_up() -> list:
    # What the child itself uses, so that it imports nothing after the fork.
    import ctypes  # noqa: F401
    import importlib
    import importlib.machinery

    done = []
    for name in _WARM:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001, S112 -- not installed for this interpreter: nothing to warm
            continue
        done.append(name)
    return done


def _module_files() -> dict:
    """The files of the modules imported since start, and their mtimes: a
    rank must not get an old numpy or gangd that was upgraded on disk since."""
    found = {}
    for name in set(sys.modules) - _MODULES_AT_START:
        path = getattr(sys.modules.get(name), "__file__", None)
        if isinstance(path, str):
            try:
                found[path] = os.stat(path).st_mtime_ns
            except OSError:
                pass
    return found


def _stale(files: dict) -> str:
    for path, mtime in files.items():
        try:
            if os.stat(path).st_mtime_ns != mtime:
                return path
        except OSError:
            return path
    return ""


def _threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 0


class _Plan:
    """What the child runs once the server's frames are gone."""

    def __init__(self, request: dict, files: dict):
        self.request = request
        self.files = files


def _serve(sock, files: dict) -> _Plan | None:
    import json
    import selectors
    import socket

    sel = selectors.DefaultSelector()
    sel.register(sock, selectors.EVENT_READ, None)
    children: dict = {}  # pidfd -> (pid, status_w)
    accepting = True
    while accepting or children:
        events = sel.select(None if children or not accepting else IDLE_TIMEOUT)
        if not events and not children:
            return None  # idle: nothing to serve
        for key, _ in events:
            if key.data is not None:  # a child ended
                pidfd = key.fd
                pid, status_w = children.pop(pidfd)
                sel.unregister(pidfd)
                os.close(pidfd)
                try:
                    _, status = os.waitpid(pid, 0)
                    os.write(status_w, b"%d" % status)
                except OSError:
                    pass
                os.close(status_w)
                continue
            try:
                data, ancdata, _, _ = sock.recvmsg(1 << 20, socket.CMSG_SPACE(5 * 4))
            except OSError:
                data, ancdata = b"", []
            fds = []
            for level, kind, payload in ancdata:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds += list(memoryview(payload).cast("i")[: len(payload) // 4])
            if not data:  # the daemon is gone: serve no more, wait for the ranks
                sel.unregister(sock)
                accepting = False
                for fd in fds:
                    os.close(fd)
                continue
            try:
                request = json.loads(data)
                if len(fds) != 5 or not isinstance(request, dict):
                    raise ValueError("a request has five fds")
            except ValueError as exc:
                for fd in fds:
                    os.close(fd)
                sock.send(json.dumps({"error": str(exc)}).encode())
                continue
            if _threads() != 1:
                for fd in fds:
                    os.close(fd)
                sock.send(json.dumps({"error": "the server has threads; it cannot fork"}).encode())
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                # The child: nothing of the server may stay open in it.
                children_fds = list(children) + [w for _, w in children.values()]
                sel.close()
                sock.close()
                for fd in children_fds:
                    try:
                        os.close(fd)
                    except OSError:
                        pass
                request["_fds"] = fds
                return _Plan(request, files)
            stdout_w, stderr_w, ready_w, go_r, status_w = fds
            for fd in (stdout_w, stderr_w, ready_w, go_r):
                os.close(fd)
            try:
                pidfd = os.pidfd_open(pid)
            except OSError:
                pidfd = -1
            if pidfd >= 0:
                children[pidfd] = (pid, status_w)
                sel.register(pidfd, selectors.EVENT_READ, pid)
            else:
                os.close(status_w)
            sock.send(json.dumps({"pid": pid}).encode())
    return None


def _fail(ready_w: int, why: str) -> None:
    try:
        os.write(ready_w, b"F" + why.encode(errors="replace")[:200])
    finally:
        os._exit(1)


def _shadowed(path0: str) -> str:
    """A module the server imported that the rank would find in ``path0``
    instead (the script's directory comes first on its path): the exec'd
    rank would import that one, so this rank cannot be forked."""
    from importlib.machinery import PathFinder

    tops = {name.partition(".")[0] for name in set(sys.modules) - _MODULES_AT_START}
    for name in sorted(tops):
        try:
            if PathFinder.find_spec(name, [path0]) is not None:
                return name
        except (ImportError, ValueError, OSError):
            return name
    return ""


def _child(plan: _Plan, server_pid: int) -> None:
    import ctypes
    import resource
    import signal

    request = plan.request
    stdout_w, stderr_w, ready_w, go_r, _status_w_unused = request["_fds"]
    os.close(_status_w_unused)
    os.setsid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG: dies with the server
    except (OSError, AttributeError):
        pass
    if os.getppid() != server_pid:
        os._exit(1)
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(stdout_w, 1)
    os.dup2(stderr_w, 2)
    keep = {0, 1, 2, ready_w, go_r}
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass
    try:
        argv = [str(a) for a in request["argv"]]
        env = {str(k): str(v) for k, v in request["env"].items()}
        for res, soft, hard in request["rlimits"]:
            resource.setrlimit(int(res), (int(soft), int(hard)))
        os.umask(int(request["umask"]))
        cwd = request["cwd"]
        if cwd:
            os.chdir(cwd)
    except (OSError, ValueError, TypeError, KeyError) as exc:
        _fail(ready_w, f"setup: {exc}")
    module = None
    code = None
    path0: str | None
    if len(argv) >= 3 and argv[1] == "-m":
        module = argv[2]
        path0 = os.getcwd()
    elif len(argv) >= 2 and not argv[1].startswith("-"):
        script = argv[1]
        path0 = os.path.dirname(os.path.realpath(script))
        try:
            import stat

            if not stat.S_ISREG(os.stat(script).st_mode) or script.endswith((".pyc", ".pyo", ".zip")):
                _fail(ready_w, "not a plain script")
            with open(script, "rb") as f:
                source = f.read()
            # What Python would run as a zip application: the end record's signature in the last 64 KiB +
            # 22 bytes (zipfile.is_zipfile's search, without importing zipfile: 11-14 ms in a forked child).
            # Any occurrence refuses: a script that merely contains those bytes is exec'd, which is always right.
            if source[:2] == b"PK" or b"PK\x05\x06" in source[-(65535 + 22):]:
                _fail(ready_w, "a zip application")
            code = compile(source, os.path.abspath(script), "exec", dont_inherit=True)
        except (OSError, SyntaxError, ValueError) as exc:
            _fail(ready_w, f"script: {exc}")  # the exec'd rank will say it the interpreter's way
    else:
        _fail(ready_w, "not python SCRIPT or python -m MODULE")
    if getattr(sys.flags, "safe_path", False):
        path0 = None
    shadow = _shadowed(path0) if path0 else ""
    if shadow:
        _fail(ready_w, f"{shadow} would come from {path0}")
    changed = _stale(plan.files)
    if changed:
        _fail(ready_w, f"stale: {changed} changed since the server imported it")
    # The job's environment: os.environ (and C's environ, through putenv),
    # and what /proc/PID/environ shows (ps e, psutil): the area the kernel
    # reads is the server's own start environment, padded so that it has room.
    os.environ.clear()
    os.environ.update(env)
    if "LC_CTYPE" not in env and _LC_CTYPE_AT_START is not None:
        os.environ["LC_CTYPE"] = _LC_CTYPE_AT_START
    block = b"".join(os.fsencode(k) + b"=" + os.fsencode(v) + b"\0" for k, v in env.items())
    try:
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        start, end = int(fields[47]), int(fields[48])  # env_start, env_end (fields 50, 51)
    except (OSError, ValueError, IndexError):
        start = end = 0
    if end - start < len(block):
        _fail(ready_w, "the environment does not fit in the server's")
    ctypes.memmove(start, block + b"\0" * (end - start - len(block)), end - start)
    os.write(ready_w, b"R")
    os.close(ready_w)
    # Wait until the daemon has moved this process into the job's cgroup.
    if os.read(go_r, 1) != b"G":
        os._exit(1)
    os.close(go_r)
    # Become the rank.
    sys.path[:] = ([path0] if path0 else []) + _PATH_AT_START
    if hasattr(sys, "orig_argv"):
        sys.orig_argv[:] = argv
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()  # numpy's global RandomState, as a fresh import seeds it (random reseeds itself at fork)
    import builtins
    import types

    main = types.ModuleType("__main__")
    from importlib.machinery import BuiltinImporter, SourceFileLoader

    main.__dict__.update(__builtins__=builtins, __annotations__={}, __package__=None, __spec__=None, __loader__=BuiltinImporter)
    sys.modules["__main__"] = main
    if module is not None:
        import runpy

        sys.argv[:] = ["-m", *argv[3:]]  # (runpy puts the module's path in sys.argv[0], as for `python -m`)
        _run(lambda: runpy._run_module_as_main(module, alter_argv=True))  # type: ignore[attr-defined]  # what `python -m` runs
    else:
        sys.argv[:] = argv[1:]
        file = os.path.abspath(argv[1])
        main.__dict__.update(__file__=file, __cached__=None, __loader__=SourceFileLoader("__main__", file))
        _run(lambda: exec(code, main.__dict__))  # type: ignore[arg-type]  # noqa: S102 -- the user's own program, as the user: running it is the point
    raise SystemExit(0)


def _run(body) -> None:
    try:
        body()
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as exc:  # noqa: BLE001 -- reported as the interpreter does, without this file's frames
        tb = exc.__traceback__.tb_next if exc.__traceback__ else None  # (this frame)
        tb = tb.tb_next if tb else None  # (the lambda)
        exc.__traceback__ = tb  # (the interpreter prints the exception's own traceback)
        sys.excepthook(type(exc), exc, tb)
        raise SystemExit(1) from None


def main() -> None:
    import json
    import socket

    fd = int(sys.argv[1])
    sock = socket.socket(fileno=fd)
    if not hasattr(os, "pidfd_open"):  # (Python < 3.9: no way to watch the children without signals)
        sock.send(json.dumps({"error": "this Python has no os.pidfd_open"}).encode())
        return
    warm = _warm_up()
    if _threads() != 1:  # e.g. a BLAS with a thread pool: forking it is not safe
        sock.send(json.dumps({"error": f"{_threads()} threads after importing {', '.join(warm)}"}).encode())
        return
    sock.send(json.dumps({"hello": PROTOCOL, "pid": os.getpid(), "warm": warm, "executable": sys.executable}).encode())
    server_pid = os.getpid()
    plan = _serve(sock, _module_files())
    if plan is None:
        return
    _child(plan, server_pid)


if __name__ == "__main__":
    main()
