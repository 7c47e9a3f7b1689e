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

The daemons are ordinary processes in their own sessions; they outlive the
``gang cluster up`` that started them until ``gang cluster down``.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import trio

from ..daemon.config import Config, NodeSpec, render, toml_str
from .api import CLUSTER_FILE, connect, read_cluster_file


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


def pick_port(addresses: list[str], tries: int = 200) -> int:
    """A TCP port free on every address (the nodes share a port number)."""
    rng = random.Random()  # noqa: S311 -- spreads the port picks of parallel local clusters; no secret in it
    for _ in range(tries):
        port = rng.randrange(20000, 45000)
        socks = []
        try:
            for address in addresses:
                sock = socket.socket()
                socks.append(sock)
                sock.bind((address, port))
            return port
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise ClusterError("could not find a free TCP port on the loopback addresses")


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
    limits: tuple[tuple[str, int], ...] = (),
    checkpoint_dir: Path | None = None,
    log_level: str = "info",
    output_limit: int | None = None,
    output_dir: Path | None = None,
    checkpoint_max_rank_bytes: int | None = None,
    timeout: float = 30.0,
    progress=None,
) -> list[NodeFiles]:
    """Start ``nodes`` daemons and wait until every one sees all the others.

    ``checkpoint_dir``: one directory for every node's checkpoints (each
    keeps its own in ``checkpoint_dir/<node>``), as a shared file system
    would be; default: each node's state directory."""
    if not 1 <= nodes <= 250:
        raise ClusterError(f"--nodes must be between 1 and 250, not {nodes}")
    directory = Path(directory).absolute()
    running = [n.name for n in node_files(directory) if n.pid()]
    if running:
        raise ClusterError(f"a cluster is already up in {directory} (nodes {', '.join(running)}); run `gang cluster down` first")
    directory.mkdir(parents=True, exist_ok=True)
    # Traversable by everyone so other users can reach the sockets; the
    # state directories below are private.
    os.chmod(directory, 0o755)  # noqa: S103 -- traversable by other uids (and tests' second uid) to reach the sockets
    secret = write_secret(directory / "secret")
    addresses = [f"127.0.0.{i}" for i in range(1, nodes + 1)]
    port = pick_port(addresses)
    specs = tuple(NodeSpec(f"n{i}", address, port, cores) for i, address in enumerate(addresses, 1))
    files = [NodeFiles(spec.name, directory / spec.name) for spec in specs]
    lines = [f'# written by gang cluster up; `gang --cluster {directory}` reads it', f"secret_file = {toml_str(secret)}", ""]
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
            output_limit=output_limit if output_limit is not None else Config.output_limit,
            checkpoint_max_rank_bytes=Config.checkpoint_max_rank_bytes if checkpoint_max_rank_bytes is None else checkpoint_max_rank_bytes,
            output_dir=Path(output_dir).absolute() if output_dir else None,
            limits=tuple(limits),
            checkpoint_dir=Path(checkpoint_dir).absolute() if checkpoint_dir else None,
            runtime_dir=nf.runtime,
        )
        nf.config.write_text(render(config))
        lines += ["[[nodes]]", f"name = {toml_str(spec.name)}", f"address = {toml_str(spec.endpoint)}"]
        lines += [f"socket = {toml_str(nf.socket)}", f"dir = {toml_str(nf.dir)}", ""]
    (directory / CLUSTER_FILE).write_text("\n".join(lines))
    for nf in files:
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
        if progress:
            progress(f"started gangd {nf.name} on {specs[files.index(nf)].endpoint} (pid {proc.pid})")
    try:
        trio.run(_wait_all_up, files, timeout)
    except ClusterError:
        down(directory)
        raise
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
            if down:
                problems[nf.name] = f"sees {', '.join(down)} down"
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
    """Stop every daemon of the cluster (SIGTERM, then SIGKILL); returns the nodes stopped."""
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
    return [name for name, pid in pids.items() if pid]


def status(directory: Path) -> list[tuple[str, int | None]]:
    return [(nf.name, nf.pid()) for nf in node_files(Path(directory))]
