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

    [cluster]
    secret_file = "/etc/gangd/secret"  # same bytes on every node, mode 0600
    master = "n1"                    # coordinator; default: the lowest-named live node
    heartbeat_interval = 1.0
    heartbeat_timeout = 5.0
    time_slice = 0.3                 # seconds each gang slot runs before the next
    switch_lead = 0.01               # a slice's end is announced this early (0: switch on decision)
    max_slots = 4                    # multiprogramming degree: jobs beyond it wait
    checkpoint_keep = 2              # complete generations kept per job
    checkpoint_timeout = 600         # seconds ranks may take to reach the cut / write their state
    checkpoint_max_rank_bytes = 68719476736  # largest state file one rank may commit (a restart checksums it)
    max_queued_per_user = 1000       # jobs one user may have waiting to start (root: no limit)

    [limits]                         # optional; what no job may exceed (per job and node)
    pids_max = 4096                  # processes+threads (cgroup pids controller)
    memory_max = "64G"               # bytes, or with K/M/G/T (cgroup memory controller)
    nofile = 65536                   # caps on the submitting user's own rlimits, which ranks
    core = 0                         # get instead of the daemon's: any RLIMIT_<NAME> lower case

    [[nodes]]
    name = "n1"
    address = "10.0.0.1"
    port = 7450
    cores = 16

The cgroup limits go in the v2 tree where the controller is enabled there,
else in its v1 hierarchy; with neither they are not enforced and the daemon
logs a warning at start.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from .limits import NAMES as RLIMIT_NAMES

DEFAULT_PORT = 7450
DEFAULT_SOCKET = "/run/gangd/gangd.sock"
DEFAULT_STATE_DIR = "/var/lib/gangd"


class ConfigError(Exception):
    pass


@dataclass(frozen=True)
class NodeSpec:
    name: str
    address: str
    port: int = DEFAULT_PORT
    cores: int = field(default_factory=lambda: os.cpu_count() or 1)

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
    output_dir: Path | None = None  # rank output (default: state_dir/output)
    runtime_dir: Path | None = None  # rank sockets and counters, in memory (default: the socket's directory/jobs)
    output_limit: int = 1 << 30  # bytes of output a job may leave on this node; the rest is dropped with a notice
    output_reserve: int = 64 << 20  # bytes rank output leaves free on its file system (room for the job table)
    max_queued_per_user: int = 1000  # jobs a user (not root) may have queued, not yet started: every node keeps each
    limits: tuple[tuple[str, int], ...] = ()  # [limits]: pids_max, memory_max, rlimit caps (name, value)

    @property
    def cgroup_limits(self) -> dict[str, int]:
        return {k: v for k, v in self.limits if k in ("pids_max", "memory_max")}

    @property
    def rlimit_caps(self) -> dict[str, int]:
        return {k: v for k, v in self.limits if k in RLIMIT_NAMES}

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
        me = os.geteuid()
        who = "root" if me == 0 else f"uid {me} (the user gangd runs as)"
        fix = f"(chown {'root' if me == 0 else me} {path} && chmod 600 {path})"
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY)
        except FileNotFoundError:
            raise ConfigError(f"cluster secret file {path} does not exist") from None
        except PermissionError:
            raise ConfigError(f"cannot read cluster secret file {path}: permission denied") from None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise ConfigError(f"cluster secret file {path} is a symbolic link; refusing it: point secret_file at the file itself") from None
            raise ConfigError(f"cannot open cluster secret file {path}: {exc.strerror}") from None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise ConfigError(f"cluster secret file {path} is not a regular file")
            if info.st_uid != me:
                raise ConfigError(
                    f"cluster secret file {path} is owned by uid {info.st_uid}, not {who}: its owner could impersonate any node; refusing it {fix}"
                )
            if info.st_mode & 0o077:
                raise ConfigError(
                    f"cluster secret file {path} has mode {stat.S_IMODE(info.st_mode):04o}: other users can read or change it; refusing it {fix}"
                )
            if info.st_size > MAX_SECRET:
                raise ConfigError(f"cluster secret file {path} is {info.st_size} bytes; a secret is at most {MAX_SECRET}")
            data = os.read(fd, MAX_SECRET + 1)
        finally:
            os.close(fd)
        parent = path.absolute().parent
        try:
            up = os.stat(parent)
        except OSError as exc:
            raise ConfigError(f"cannot check the directory of the cluster secret {parent}: {exc.strerror}") from None
        if up.st_uid not in (0, me) or up.st_mode & 0o022:
            raise ConfigError(
                f"the directory {parent} of the cluster secret can be changed by others (owner uid {up.st_uid}, "
                f"mode {stat.S_IMODE(up.st_mode):04o}): they could replace the secret; refusing it"
            )
        secret = data.strip()
        if len(secret) < 16:
            raise ConfigError(f"cluster secret in {path} is too short (need at least 16 bytes)")
        return secret


#: A cluster secret is a few dozen bytes; a larger file is not one.
MAX_SECRET = 4096


def load(path: str | os.PathLike | None, **overrides) -> Config:
    """Read a config file (if any) and apply non-None ``overrides``."""
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
        "output_dir": Path(node["output_dir"]) if node.get("output_dir") else None,
        "output_limit": int(node.get("output_limit", 1 << 30)),
        "output_reserve": int(node.get("output_reserve", 64 << 20)),
        "runtime_dir": Path(node["runtime_dir"]) if node.get("runtime_dir") else None,
        "max_queued_per_user": int(cluster.get("max_queued_per_user", 1000)),
    }
    settings["limits"] = _limits(data.get("limits", {}))
    for key, value in overrides.items():
        if value is not None:
            settings[key] = Path(value) if key in ("state_dir", "socket", "secret_file", "checkpoint_dir", "output_dir", "runtime_dir") else value
    if not settings["node_name"]:
        raise ConfigError("this node has no name: set [node] name in the config or pass --name")
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
    if config.checkpoint_max_rank_bytes < 0:
        raise ConfigError(f"checkpoint_max_rank_bytes is a byte count and cannot be negative, not {config.checkpoint_max_rank_bytes}")
    if config.output_limit < 0 or config.output_reserve < 0:
        raise ConfigError("output_limit and output_reserve are byte counts and cannot be negative")
    if config.max_slots < 1:
        raise ConfigError(f"max_slots must be at least 1, not {config.max_slots}")
    if config.max_queued_per_user < 1:
        raise ConfigError(f"max_queued_per_user must be at least 1, not {config.max_queued_per_user}")
    if config.heartbeat_timeout <= config.heartbeat_interval:
        raise ConfigError("heartbeat_timeout must be larger than heartbeat_interval")
    return config



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
    ]
    if config.limits:
        lines += ["", "[limits]"] + [f"{key} = {value}" for key, value in config.limits]
    for spec in config.nodes:
        lines += ["", "[[nodes]]", f"name = {toml_str(spec.name)}", f"address = {toml_str(spec.address)}", f"port = {spec.port}", f"cores = {spec.cores}"]
    return "\n".join(lines) + "\n"
