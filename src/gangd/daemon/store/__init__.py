"""The cluster's state in etcd: the job table, job ids, history, the keys they live under.

Infrastructure for the domain (the coordinator and what one node does): it
knows etcd and the key layout, nothing about scheduling. The etcd client
itself is :mod:`gangd.etcd`.
"""

from .jobtable import Deposed, Fence, JobTable
from .keys import Keys
from .nodelog import NodeHistory, NodeLog

__all__ = ["Deposed", "Fence", "JobTable", "Keys", "NodeHistory", "NodeLog"]
