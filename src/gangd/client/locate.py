"""Which daemon a client talks to: the local cluster directory, else the system daemon's socket.

Apart from :mod:`gangd.client.api` so that a client that does not use trio
(the ``gang`` command's one-shot requests, :mod:`gangd.client.oneshot`)
finds its daemon without importing it.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

CLUSTER_FILE = "cluster.toml"
#: Handshake refusals that mean "reached, but not now / not you" rather than "not there".
REFUSALS = frozenset({"too_many_connections", "busy"})


class ClusterNotFound(Exception):
    """No daemon could be reached; the message says where we looked."""


def default_cluster_dir() -> Path:
    return Path.home() / ".gangd" / "cluster"


def cluster_dir(explicit: str | os.PathLike | None = None) -> Path:
    """The local cluster directory a command refers to (``--cluster``, then
    ``$GANGD_CLUSTER``, then ``~/.gangd/cluster``)."""
    if explicit:
        return Path(explicit)
    if os.environ.get("GANGD_CLUSTER"):
        return Path(os.environ["GANGD_CLUSTER"])
    return default_cluster_dir()


def read_cluster_file(directory: Path) -> dict:
    with open(directory / CLUSTER_FILE, "rb") as fh:
        return tomllib.load(fh)


def locate(cluster: str | os.PathLike | None = None) -> list[str]:
    """Sockets to try, in order.

    ``cluster`` (or ``$GANGD_CLUSTER``) names a local cluster directory; else
    ``$GANGD_SOCKET`` (set inside jobs) names a daemon socket; else the default
    local cluster if one was brought up; else the system daemon's socket.
    """
    explicit = cluster or os.environ.get("GANGD_CLUSTER")
    if explicit:
        directory = Path(explicit)
        try:
            info = read_cluster_file(directory)
        except FileNotFoundError:
            raise ClusterNotFound(f"no cluster in {directory} (no {CLUSTER_FILE}); start one with `gang cluster up --dir {directory}`") from None
        return [node["socket"] for node in info.get("nodes", [])]
    if os.environ.get("GANGD_SOCKET"):
        return [os.environ["GANGD_SOCKET"]]
    default = default_cluster_dir()
    if (default / CLUSTER_FILE).exists():
        return [node["socket"] for node in read_cluster_file(default).get("nodes", [])]
    from ..daemon.config import DEFAULT_SOCKET  # (only here: the daemon's configuration module is not a client's concern otherwise)

    return [DEFAULT_SOCKET]


def unreachable(errors: list[str]) -> ClusterNotFound:
    """What a client says when no candidate socket answered (``errors``: one line per socket tried)."""
    where = "; ".join(errors) or "no sockets configured"
    return ClusterNotFound(f"cannot reach a gangd daemon ({where}). Is the cluster up? Try `gang cluster up`.")
