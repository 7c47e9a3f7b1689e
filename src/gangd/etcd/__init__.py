"""gangd's infrastructure layer for etcd, where the cluster's state lives: a trio client of etcd's JSON gateway
(client), leases kept alive with a deadline the holder can trust (lease), leader election (election), and the
embedded etcd of local clusters (server). No daemon logic here: the daemon's domain code calls this, never
the other way round."""

from gangd.etcd.client import (
    Compacted,
    Compare,
    Etcd,
    EtcdError,
    Indeterminate,
    KeyValue,
    Op,
    Range,
    TxnResult,
    Unavailable,
    WatchBatch,
    WatchEvent,
)
from gangd.etcd.lease import Lease, open_lease

__all__ = [
    "Compacted", "Compare", "Etcd", "EtcdError", "Indeterminate", "KeyValue", "Op", "Range", "TxnResult", "Unavailable",
    "WatchBatch", "WatchEvent", "Lease", "open_lease",
]
