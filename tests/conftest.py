"""Fixtures that start real gangd clusters (real daemons on 127.0.0.x) for tests.

Every cluster lives in its own world-traversable temporary directory so that
tests can talk to it as a second, unprivileged uid, and has its own etcd
(``cluster.up`` starts it; ``make_cluster(etcd_members=3)`` for three
members). On teardown the cluster is stopped and the test fails if any rank,
daemon or etcd process of it is still alive.

The suite runs on two pytest-xdist workers, one test file each at a time
(pyproject's addopts: most of a test's time is spent waiting on daemons,
timers and etcd, not computing, so two halve the wall time on two cores).
Clusters pick free ports and directories of their own, so two run side by
side. The slowest files are handed out first, so the two workers end
together.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import locale
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
import trio

from gangd.client import cluster as local
from gangd.client.api import connect
from gangd.daemon.cgroup import CgroupTree
from gangd.daemon.config import EtcdSettings
from gangd.daemon.config import load as load_config
from gangd.daemon.store import Keys
from gangd.rpc import leaf_error


class LocalCluster:
    def __init__(self, directory: Path, nodes: int):
        self.dir = directory
        self.nodes = nodes
        self.files = {nf.name: nf for nf in local.node_files(directory)}

    # ------------------------------------------------------------ the CLI

    def gang(self, *args, timeout: float = 60, check: bool = False, **kwargs) -> subprocess.CompletedProcess:
        """`gang --cluster DIR ARGS`: its exit code, stdout and stderr. Run in this process when it
        can be (:func:`gang_here`: the same command, without a Python started for it), else as a
        process (``kwargs`` for subprocess.run: an environment or a directory of its own)."""
        argv = ["--cluster", str(self.dir), *map(str, args)]
        result = None if kwargs else gang_here(argv, timeout)
        if result is None:
            cmd = [sys.executable, "-m", "gangd.client.cli", *argv]
            result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False, **kwargs)
        if check and result.returncode != 0:
            raise AssertionError(f"gang {' '.join(map(str, args))} exited {result.returncode}:\n{result.stdout}\n{result.stderr}")
        return result

    def gang_json(self, *args, **kwargs):
        return json.loads(self.gang(*args, "--json", check=True, **kwargs).stdout)

    def popen_gang(self, *args, **kwargs) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "gangd.client.cli", "--cluster", str(self.dir), *map(str, args)]
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)

    def job(self, job_id: int) -> dict:
        """The job's record as `gang ps --all --json` shows it. Asked in this
        process (what the command does, without starting a Python for every
        poll of ``wait_state``: on 2 cores those starts were a good part of the
        suite's time); through the command where this runs inside trio."""
        if trio.lowlevel.in_trio_run():
            records = self.gang_json("ps", "--all")
        else:
            records = self.ps(all=True)
        for record in records:
            if record["id"] == job_id:
                return record
        raise KeyError(job_id)

    def ps(self, *, all: bool = False) -> list[dict]:
        """What `gang ps [--all] --json` prints, asked in this process (for polls)."""
        found = self.ask(lambda gang: gang.jobs(all=all), "ps --all" if all else "ps", as_json=False)
        # As the command prints them: each marked stale if the answer may be out of date.
        return _as_json([dict(r, stale=found.stale) for r in found] if found.stale else list(found))

    def node_states(self) -> dict[str, str]:
        """Each node's state as `gang nodes --json` lists it ({"n1": "up", ...}), asked in this process
        (the tests poll it while a node dies or comes back: a `gang` per poll is a Python start-up)."""
        return {row["name"]: row["state"] for row in self.ask(lambda gang: gang.nodes(), "nodes")}

    def logs(self, job_id: int) -> str:
        """What `gang logs JOB` prints on stdout (each rank's stdout, line by line, labelled with
        its rank), read in this process: for the tests' polls of a job's output."""

        async def read(gang):
            record = await gang.job(job_id)
            width = len(str(max(0, record["nranks"] - 1)))
            partial: dict = {}
            lines: list[str] = []

            def put(rank, line: bytes) -> None:
                label = f"{rank:>{width}}: " if rank is not None else ""
                lines.append(label + line.decode(errors="replace"))

            async with gang.output(job_id, follow=False) as chunks:
                async for item in chunks:
                    if item.get("stream", 1) != 1:
                        continue
                    rank = item.get("rank")
                    *done, rest = (partial.pop(rank, b"") + item.get("data", b"")).split(b"\n")
                    for line in done:
                        put(rank, line + b"\n")
                    if rest:
                        partial[rank] = rest
            for rank, rest in partial.items():
                put(rank, rest + b"\n")
            return "".join(lines)

        return self.ask(read, f"logs {job_id}", as_json=False)

    def ask(self, request, what: str = "request", *, as_json: bool = True):
        """``await request(client)`` on the cluster's first reachable daemon (as
        `gang` picks it), from this process; the answer as `gang ... --json`
        prints it. For the tests' polls: a `gang` started per poll costs a
        Python start-up, which on 2 cores slowed the whole suite."""

        async def go():
            async with connect(self.dir) as gang:
                return await request(gang)

        try:
            try:
                answer = trio.run(go)
            except BaseExceptionGroup as group:
                raise leaf_error(group) from None
        except Exception as exc:  # noqa: BLE001 -- as the command's failure would be: the test fails, saying why
            raise AssertionError(f"gang {what} failed: {type(exc).__name__}: {exc}") from None
        return _as_json(answer) if as_json else answer

    def wait_state(self, job_id: int, states, timeout: float = 20) -> dict:
        states = {states} if isinstance(states, str) else set(states)
        deadline = time.monotonic() + timeout
        while True:
            record = self.job(job_id)
            if record["state"] in states:
                return record
            if time.monotonic() > deadline:
                raise AssertionError(f"job {job_id} is {record['state']}, not {states}, after {timeout} s: {record}")
            time.sleep(0.1)

    # ------------------------------------------------------------ etcd

    @property
    def etcd(self):
        """The cluster's own etcd (a ``gangd.etcd.server.LocalEtcd``: ``kill_member(i)``, ``start_member(i)``, ``endpoints``, ``pids``)."""
        store = local.local_etcd(self.dir)
        assert store is not None, f"the cluster in {self.dir} has no etcd of its own (make_cluster(..., own_etcd=True) gives it one)"
        return store

    @property
    def etcd_settings(self) -> EtcdSettings:
        """How the daemons reach the cluster's etcd (endpoints, prefix, ``user`` and ``read_password()``: a local
        cluster's etcd answers only to its root user)."""
        return load_config(self.files["n1"].config).etcd

    # ------------------------------------------------------------ processes

    def start_daemon(self, node: str) -> None:
        """Start one node's gangd again (after a test stopped it), as `gang cluster up` does."""
        nf = self.files[node]
        with open(nf.log, "ab") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "gangd.daemon.main", "--config", str(nf.config)],
                stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
            )
        nf.pidfile.write_text(f"{proc.pid}\n")

    def kill_node(self, node: str) -> None:
        """SIGKILL the node's daemon, then end its lease (``end_lease``): a
        node that died, seen by the others 5 s sooner than at its lease's
        expiry."""
        os.kill(self.daemon_pid(node), signal.SIGKILL)
        self.end_lease(node)

    def end_lease(self, node: str) -> None:
        """Revoke the lease of a node whose daemon is dead, rather than wait
        out its TTL. etcd deletes the keys on a lease the same way whether it
        was revoked or expired (the node's key, its election key), so the
        other nodes see the same deletes and handle the loss the same way;
        only the wait for the TTL is skipped (5 s a loss). Tests of a stall or
        a partition, where the lease running out is the point, stop the
        daemon instead (SIGSTOP) and wait it out."""
        wait_for(lambda: not self.files[node].pid(), 10, f"gangd {node} to be dead (its lease is its own while it lives)")
        settings = self.etcd_settings
        key = Keys(settings.prefix).node(node)

        async def revoke():
            async with settings.client(timeout=10) as etcd:
                found = await etcd.get(key)
                if found is not None and found.lease:  # (None: its lease expired meanwhile)
                    await etcd.lease_revoke(found.lease)

        trio.run(revoke)

    def daemon_pid(self, node: str) -> int:
        pid = self.files[node].pid()
        assert pid, f"gangd {node} is not running"
        return pid

    def log(self, node: str) -> str:
        return self.files[node].log.read_text(errors="replace")

    def rank_processes(self, job_id: int | None = None, node: str | None = None) -> list[psutil.Process]:
        """Live processes started for this cluster's jobs (forks included: they inherit the env); of one ``node``'s daemon if given."""
        found = []
        prefix = str(self.dir) if node is None else f"{self.dir}/{node}/"
        for proc in psutil.process_iter():
            try:
                env = proc.environ()
                if proc.status() == psutil.STATUS_ZOMBIE:
                    continue
            except (psutil.Error, OSError):
                continue
            if env.get("GANGD_SOCKET", "").startswith(prefix) and (job_id is None or env.get("GANGD_JOB") == str(job_id)):
                found.append(proc)
        return found

    def wait_no_rank_processes(self, job_id: int | None = None, timeout: float = 10) -> None:
        deadline = time.monotonic() + timeout
        while (left := self.rank_processes(job_id)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not left, f"processes left behind: {[(p.pid, p.cmdline()) for p in left]}"

    def own_processes(self) -> list[psutil.Process]:
        """Live daemons and etcd members of this cluster: the processes whose
        command line names a file in its directory (a daemon's config, a
        member's data dir)."""
        found = []
        prefix = str(self.dir) + "/"
        for proc in psutil.process_iter():
            try:
                if proc.status() != psutil.STATUS_ZOMBIE and any(arg.startswith(prefix) for arg in proc.cmdline()):
                    found.append(proc)
            except (psutil.Error, OSError):
                continue
        return found


#: The `gang` commands :func:`gang_here` runs in this process: those that ask the daemons and print,
#: and `run` (its signal handlers are trio's, for the run: the tests of Ctrl-C, Ctrl-\\ and a closed
#: terminal start `gang run` as a process of its own, popen_gang). Not `logs -f`, nor `cluster`.
_HERE_COMMANDS = frozenset({"submit", "kill", "ps", "job", "nodes", "history", "suspend", "resume", "net", "logs", "wait",
                            "checkpoint", "restart", "ckpt", "run"})


class _GangTimeout(Exception):
    pass


def gang_here(argv: list[str], timeout: float, env: dict[str, str | None] | None = None) -> subprocess.CompletedProcess | None:
    """``gang ARGV`` run in this process (click's CliRunner on gangd.client.cli:main, the
    function the gang script calls), as a subprocess.run of it would give it: exit code,
    stdout and stderr as text with universal newlines; ``env``: variables set (None: unset)
    for the command. A `gang` started per call was a Python start-up each time (0.3 s of
    CPU, ~0.5 s on a loaded 2-core machine), for hundreds of calls a run. None where it
    cannot run here: a command not in _HERE_COMMANDS (or `logs -f`), not the main thread
    (the timeout is a SIGALRM), inside trio (the command runs its own), SIGALRM taken.
    No answer in ``timeout`` seconds raises subprocess.TimeoutExpired, as the process's
    timeout did; an exception out of the command (a traceback) fails the test."""
    import threading

    from click.testing import CliRunner

    from gangd.client.cli import main as cli_main

    command = next((a for a in argv[2:3]), None) if argv[:1] == ["--cluster"] else next(iter(argv), None)
    if (command not in _HERE_COMMANDS or (command == "logs" and ("-f" in argv or "--follow" in argv))
            or threading.current_thread() is not threading.main_thread() or trio.lowlevel.in_trio_run()
            or signal.getsignal(signal.SIGALRM) not in (signal.SIG_DFL, None)):
        return None

    def expired(_signum, _frame):
        raise _GangTimeout

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        result = CliRunner().invoke(cli_main, argv, env=env, catch_exceptions=False)
    except _GangTimeout:
        raise subprocess.TimeoutExpired(["gang", *argv], timeout) from None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)

    def text(data: bytes) -> str:  # (as subprocess.run(text=True) decodes a process's output)
        return data.decode(locale.getpreferredencoding(False)).replace("\r\n", "\n").replace("\r", "\n")

    return subprocess.CompletedProcess(["gang", *argv], result.exit_code, text(result.stdout_bytes), text(result.stderr_bytes))


def _as_json(obj):
    """``obj`` as the CLI's --json prints it (bytes as text, tuples as lists)."""
    return json.loads(json.dumps(obj, default=lambda b: b.decode(errors="replace")))


async def tried_on(gang, job: int, actions=("job", "wait")) -> dict:
    """What ``gang`` gets doing each of ``actions`` (``kill``, ``job``, ``wait``) and reading the output of ``job``:
    "allowed", or the refusal as [code, message] (a stranger's view of someone else's job, run under :func:`as_uid`)."""
    from gangd.errors import RemoteError

    calls = {"kill": lambda: gang.kill(job), "job": lambda: gang.job(job), "wait": lambda: gang.wait_done(job)}
    outcome: dict = {}
    for action in actions:
        try:
            await calls[action]()
            outcome[action] = "allowed"
        except RemoteError as exc:
            outcome[action] = [exc.code, exc.message]
    try:
        async with gang.output(job, follow=False) as chunks:
            async for _ in chunks:
                pass
        outcome["output"] = "allowed"
    except RemoteError as exc:
        outcome["output"] = [exc.code, exc.message]
    return outcome


def as_uid(uid: int, fn):
    """Run ``fn()`` in a forked child that has dropped to ``uid``; return its JSON result."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        os.close(read_fd)
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            result = fn()
        except BaseException as exc:  # noqa: BLE001 -- report, never fall back into pytest
            result = {"exception": f"{type(exc).__name__}: {exc}"}
        with os.fdopen(write_fd, "w") as out:
            json.dump(result, out)
        os._exit(0)
    os.close(write_fd)
    with os.fdopen(read_fd) as inp:
        data = inp.read()
    os.waitpid(pid, 0)
    return json.loads(data)


def _remove_cgroups(cluster: LocalCluster) -> None:
    """Daemons killed with SIGKILL in a test never remove their cgroups (a
    restarted daemon would sweep them); do it for them."""
    for nf in cluster.files.values():
        tag = hashlib.sha1(str(nf.state.resolve()).encode(), usedforsecurity=False).hexdigest()[:8]
        CgroupTree(f"gangd-{nf.name}-{tag}").close()


def wait_for(predicate, timeout: float, what: str):
    """``predicate()``'s first true value, polled until ``timeout`` seconds passed."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


def forget_cluster(cluster: LocalCluster) -> None:
    """After ``local.down``: fail if a rank, a daemon or an etcd member of the
    cluster lives on; remove its cgroups and its directory either way."""
    try:
        cluster.wait_no_rank_processes(timeout=5)
        deadline = time.monotonic() + 5
        while (left := cluster.own_processes()) and time.monotonic() < deadline:
            time.sleep(0.05)
        if left:
            seen = []
            for proc in left:  # started by this test: not left to disturb the next one
                with contextlib.suppress(psutil.Error):
                    seen.append((proc.pid, " ".join(proc.cmdline())))
                    proc.kill()
            raise AssertionError(f"daemon or etcd processes of the cluster left behind after down: {seen}")
    finally:
        _remove_cgroups(cluster)
        if not os.environ.get("GANGD_TEST_KEEP_CLUSTERS"):  # (to read a failed test's logs)
            shutil.rmtree(cluster.dir.parent, ignore_errors=True)


@contextlib.contextmanager
def tmpfs(directory: Path, size: str, mode: str | None = None):
    """A real file system of ``size`` (tmpfs; root only) mounted on ``directory``
    for the block, unmounted after: the disk that fills up in a test."""
    options = f"size={size}" + (f",mode={mode}" if mode else "")
    subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(directory)], check=True)
    try:
        yield directory
    finally:  # (lazily: a daemon of the test may still hold a file there)
        subprocess.run(["umount", "-l", str(directory)], check=True)


def first_difference(got: bytes, want: bytes) -> str | None:
    """None if the bytes are equal, else where they first differ: what an assertion on
    megabytes should say (pytest's own diff of two large bytes objects takes minutes)."""
    if got == want:
        return None
    at = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want)))
    return f"{len(got)} bytes against {len(want)} wanted, first difference at offset {at}"


#: The system's Python 3.11: what a second uid can run (the venv's interpreter is under root's home).
SYSTEM_PY = "/usr/bin/python3.11"


def mpi_job_through_api(cluster, argv: list, nodelist: list[str] | None = None) -> list:
    """A one-rank ``--mpi`` job of ``argv`` (a script and its arguments) submitted through the
    client API and run by :data:`SYSTEM_PY` with this venv's packages (mpi4py, and MPICH's libmpi
    beside them): what a second uid, in :func:`as_uid`'s child, can run. [final state, its output]."""
    venv = Path(sys.prefix)

    async def main():
        async with connect(cluster.dir) as gang:
            env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(venv / "lib" / "python3.11" / "site-packages"),
                   "LD_LIBRARY_PATH": str(venv / "lib")}
            record = await gang.submit([SYSTEM_PY, *map(str, argv)], 1, cwd="/", env=env, mpi=True, **({"nodelist": nodelist} if nodelist else {}))
            final = await gang.wait_done(record["id"])
            text = b""
            async with gang.output(record["id"], follow=False) as chunks:
                async for item in chunks:
                    text += item["data"]
            return [final["state"], text.decode()]

    return trio.run(main)


def _world_traversable_tmpdir() -> Path:
    path = Path(tempfile.mkdtemp(prefix="gangd-test-"))
    os.chmod(path, 0o755)
    return path


@pytest.fixture
def points(tmp_path, monkeypatch):
    """The failpoint directory the daemons this test starts are given
    (GANGD_FAILPOINTS): a file named after a failpoint or hold point in it
    arms it (:mod:`gangd.failpoint`)."""
    directory = tmp_path / "failpoints"
    directory.mkdir()
    monkeypatch.setenv("GANGD_FAILPOINTS", str(directory))
    return directory


#: Test files by decreasing duration, handed out first (largest first, the two workers end within
#: about the last small file of each other; pyproject's --no-loadscope-reorder keeps this order). From
#: the durations of a whole run (`--durations=0`, per file: call + setup + teardown, here the run at
#: 5056481 plus this list's branch, 18 min 36 s); every file that took 10 s or more is listed, the rest
#: come after in collection order. Update it when a file grows a lot (a new file of minutes left out runs last).
_SLOW_FILES = (
    "test_checkpoint", "test_recovery", "test_control_plane", "test_security_wire", "test_disk_loss", "test_mpi_checkpoint", "test_flush",
    "test_delta_cluster", "test_gang", "test_etcd", "test_rebuild", "test_cluster_etcd", "test_interval_cluster", "test_security_fs",
    "test_rank_server", "test_mpi_spawn", "test_messaging", "test_security_values", "test_restart_anywhere", "test_history_blocks", "test_failures",
    "test_security_procs", "test_submit_path", "test_security_interval", "test_protect", "test_ckcodec", "test_mpi_names", "test_comm_auth",
    "test_restart_speed", "test_mpi", "test_xor_paths", "test_delta_wire", "test_delta_units", "test_mpi_delta21", "test_security_jobs",
    "test_checkpoint_machines", "test_live_nodes", "test_comm_units", "test_security_review", "test_ckptlib_units", "test_cluster",
    "test_disk_replaced", "test_spc21", "test_delta_hostile", "test_codecs", "test_jobtable", "test_security_disk", "test_nodelog",
    "test_node_watch", "test_protocol",
)


def pytest_collection_modifyitems(config, items):
    """The slowest files first (a stable sort: each file's tests keep their
    order): the workers take files in this order, and a long one taken last
    would leave the other worker idle meanwhile."""
    rank = {name: i for i, name in enumerate(_SLOW_FILES)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Keep each phase's report on the test item, for fixtures that explain a failure."""
    outcome = yield
    report = outcome.get_result()
    setattr(item, f"report_{report.when}", report)


def _print_cluster_logs(cluster: LocalCluster, lines: int = 60) -> None:
    """The tail of every daemon's log (and etcd's), printed into a failed test's report."""
    for name, nf in sorted(cluster.files.items()):
        with contextlib.suppress(OSError):
            tail = nf.log.read_text(errors="replace").splitlines()[-lines:]
            print(f"----- {name} log (last {len(tail)} lines) -----", *tail, sep="\n")
    for path in sorted(cluster.dir.glob("etcd/**/*.log")):
        with contextlib.suppress(OSError):
            tail = path.read_text(errors="replace").splitlines()[-20:]
            print(f"----- {path.relative_to(cluster.dir)} (last {len(tail)} lines) -----", *tail, sep="\n")


# ------------------------------------------------------------ one etcd for the test clusters

#: Options that make ``local.up`` start an etcd of the cluster's own (or use a given one).
_OWN_ETCD_OPTIONS = frozenset({"etcd", "etcd_members", "etcd_binary", "etcd_local", "etcd_user", "etcd_password_file"})
_shared_etcd_home: Path | None = None


def _shared_etcd() -> dict:
    """``local.up`` options for the etcd the test clusters share (each under its
    own key prefix, as `gang cluster up --etcd` puts several clusters on one etcd):
    started, as a local cluster's own is (authentication on, root's password
    in a 0600 file), at the first cluster and stopped at the end of the
    session. Starting an etcd for each cluster was a third of its start-up."""
    global _shared_etcd_home
    if _shared_etcd_home is None:
        home = Path(tempfile.mkdtemp(prefix="gangd-test-etcd-"))
        local.start_local_etcd(home, 1, lambda _message: None)
        _shared_etcd_home = home
    etcd = local.local_etcd(_shared_etcd_home)
    assert etcd is not None
    if not all(_runs(m.pid, m.data_dir) for m in etcd.members):  # (no test should stop it; if one did, the next ones get it back)
        local.start_local_etcd(_shared_etcd_home, None, lambda _message: None)
        etcd = local.local_etcd(_shared_etcd_home)
        assert etcd is not None
    return {"etcd": etcd.endpoints, "etcd_local": True, "etcd_user": "root",
            "etcd_password_file": _shared_etcd_home / local.ETCD_DIR / local.PASSWORD_FILE}


def shared_etcd() -> dict:
    """How to reach the etcd the test clusters share (``local.up``'s options
    ``etcd``, ``etcd_local``, ``etcd_user``, ``etcd_password_file``), started
    if it is not yet: for a test that brings a cluster up with `gang cluster up`."""
    return _shared_etcd()


def _runs(pid: int, data_dir: str) -> bool:
    with contextlib.suppress(psutil.Error):
        proc = psutil.Process(pid)
        return proc.status() != psutil.STATUS_ZOMBIE and data_dir in proc.cmdline()
    return False


def pytest_unconfigure(config):
    if _shared_etcd_home is not None:
        local.stop_local_etcd(_shared_etcd_home)
        shutil.rmtree(_shared_etcd_home, ignore_errors=True)


def _up(directory: Path, nodes: int, own_etcd: bool, options: dict) -> None:
    if not own_etcd and not _OWN_ETCD_OPTIONS & options.keys() and not os.environ.get("GANGD_TEST_OWN_ETCD"):  # (=1: every cluster its own)
        options = {**_shared_etcd(), **options}
    local.up(directory, nodes, **options)


def up(directory: Path, nodes: int, **options) -> None:
    """``local.up`` on the etcd the test clusters share (as ``make_cluster``'s
    clusters are), for a test that brings a cluster up itself (in a directory
    it prepared, or to see it refused): starting an etcd of its own took
    seconds of each such test."""
    _up(directory, nodes, False, options)


@pytest.fixture
def make_cluster(request):
    """Factory: ``make_cluster(nodes=4)`` starts a fresh cluster for this test
    (whose daemons' logs are printed if the test fails). Its state is in the
    etcd the test clusters share, under a prefix of its own; ``own_etcd=True``
    (or any ``etcd_*`` option) gives it an etcd of its own in its directory,
    as `gang cluster up` does: for a test that stops etcd, reads
    ``cluster.etcd``, or brings the cluster down and up again."""
    started: list[LocalCluster] = []

    def make(nodes: int = 4, *, own_etcd: bool = False, **options) -> LocalCluster:
        directory = _world_traversable_tmpdir() / "cluster"
        _up(directory, nodes, own_etcd, options)
        cluster = LocalCluster(directory, nodes)
        started.append(cluster)
        return cluster

    yield make
    report = getattr(request.node, "report_call", None)
    if report is not None and report.failed:
        for cluster in started:
            _print_cluster_logs(cluster)
    for cluster in started:
        local.down(cluster.dir)
    for cluster in started:
        forget_cluster(cluster)


@contextlib.contextmanager
def shared_cluster(nodes: int = 4, *, own_etcd: bool = False, **options):
    """A cluster for several tests (a module-scoped fixture's body); checks
    on the way out that no rank process is left behind. Its etcd: as
    ``make_cluster``'s."""
    directory = _world_traversable_tmpdir() / "cluster"
    _up(directory, nodes, own_etcd, options)
    cluster = LocalCluster(directory, nodes)
    try:
        yield cluster
    finally:
        local.down(directory)
        forget_cluster(cluster)


@pytest.fixture(scope="module")
def restart_cluster():
    """A 4-node cluster of 2 cores and 2 slots for one module's restart tests
    (restart anywhere, rebuilds, wiped disks): see ``restart_gc``."""
    with shared_cluster(4, cores=2, time_slice=0.1, max_slots=2) as cluster:
        yield cluster


def kernel_watch():
    """A :class:`gangd.ckptlib.dirty.WriteWatch` of the caller's own; the test is skipped, saying why,
    where the kernel cannot track writes (userfaultfd asynchronous write protection, PAGEMAP_SCAN)."""
    from gangd.ckptlib import dirty

    try:
        return dirty.WriteWatch(dirty._Kernel())
    except OSError as exc:
        pytest.skip(f"this kernel cannot track writes (userfaultfd WP_ASYNC, PAGEMAP_SCAN): {exc}")


@pytest.fixture
def watch():
    """:func:`kernel_watch`, closed after the test (closing its userfaultfd unregisters every range)."""
    w = kernel_watch()
    yield w
    w.close()


@pytest.fixture
def restart_gc(restart_cluster, request):
    """``restart_cluster``, left after each test with no job and every node up again (a test may lose one);
    a failed test's report gets the daemons' logs, as ``make_cluster``'s do."""
    from ckpthelpers import kill_what_is_left

    yield restart_cluster
    report = getattr(request.node, "report_call", None)
    if report is not None and report.failed:
        _print_cluster_logs(restart_cluster)
    kill_what_is_left(restart_cluster)
    for node in sorted(restart_cluster.files):
        if not restart_cluster.files[node].pid():
            restart_cluster.start_daemon(node)
    wait_for(lambda: all(state == "up" for state in restart_cluster.node_states().values()), 60, "every node up again")


@pytest.fixture(scope="module")
def cluster4():
    """A 4-node cluster shared by the tests of one module (they must not break it)."""
    with shared_cluster(4) as cluster:
        yield cluster


# ------------------------------------------------------------ a real etcd for unit tests of the store

_key_prefixes = iter(range(1, 1 << 30))


@pytest.fixture(scope="module")
def etcd_endpoints():
    """A real single-member etcd for one test module (its client URLs); stopped and removed after."""
    from gangd.etcd.server import LocalEtcd

    directory = Path(tempfile.mkdtemp(prefix="gangd-etcd-unit-"))
    server = LocalEtcd(directory / "etcd")
    try:
        yield server.start()
    finally:
        server.stop()
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def keys(request):
    """A fresh key prefix for one test, so tests sharing one etcd never see each other's keys."""
    from gangd.daemon.store import Keys

    return Keys(f"/test-{request.module.__name__.removeprefix('test_')}/{next(_key_prefixes)}")
