"""Where gangd keeps what in etcd, under one prefix per gangd cluster.

``PREFIX/leader/<lease>``  the election (gangd.etcd.election): the coordinator
``PREFIX/nodes/<name>``    a node is alive while its key (on its lease) exists
``PREFIX/ids``             the last job id handed out (a counter moved by txn)
``PREFIX/jobs/<id>``       the hot job table: queued, running and recently ended jobs
``PREFIX/env/<id>``        a job's environment, apart: written once, dropped when it ends
``PREFIX/on/<node>/<id>``  a copy of job ``id``'s record for a node it is placed on
                           (written in the same transaction as the record, so
                           with the same mod revision): what that node watches,
                           instead of the whole table (see jobtable)
``PREFIX/on/+/<id>``       the one copy of a job placed on many nodes (or a large
                           record): every node watches these too, and keeps those
                           placed on it (``+`` is no node's name)
``PREFIX/past/<first id>`` ended jobs past the retention period, a block of
                           BLOCK_IDS consecutive ids in one key (see
                           jobtable.HistoryBlock): the history's key count is
                           the cluster's past divided by that, so etcd's own
                           costs do not grow with it key by key
``PREFIX/history/<id>``    an ended job alone: how gangd before the blocks
                           kept its history (still read: a cluster upgraded
                           in place keeps it), and a record too large for a block
``PREFIX/lineage/<root>/<id>``  job ``id`` of checkpoint lineage ``root`` is in the history
                           (written as it moves there: a restart finds its lineage's
                           generations without reading the whole history)
``PREFIX/names/<uid>/<hex>``  MPI's name service: a service name (hex of its bytes)
                           published by a job of user ``uid``, see daemon.names
``PREFIX/lineage-indexed``  the index above covers the whole history (older
                           gangd versions moved jobs there without it: the
                           first coordinator that finds this key missing adds
                           theirs, once, see JobTable.backfill_lineages)

Job ids are zero-padded so that etcd's byte order is id order: a page of
jobs or history is one range read.
"""

from __future__ import annotations

ID_DIGITS = 12


class Keys:
    def __init__(self, prefix: str):
        prefix = "/" + prefix.strip("/") if prefix.strip("/") else ""
        self.prefix = prefix
        self.leader = f"{prefix}/leader/"
        self.nodes = f"{prefix}/nodes/"
        self.ids = f"{prefix}/ids"
        self.jobs = f"{prefix}/jobs/"
        self.env_prefix = f"{prefix}/env/"
        self.history = f"{prefix}/history/"
        self.blocks = f"{prefix}/past/"
        self.lineages = f"{prefix}/lineage/"
        self.lineages_indexed = f"{prefix}/lineage-indexed"
        self.placed = f"{prefix}/on/"
        self.placed_on_many = f"{prefix}/on/+/"
        self.names = f"{prefix}/names/"

    def names_of(self, uid: int) -> str:
        """The prefix of the service names user ``uid`` published."""
        return f"{self.names}{uid}/"

    def name(self, uid: int, service: str) -> str:
        return self.names_of(uid) + service.encode().hex()

    def placed_on(self, node: str) -> str:
        """The prefix of the copies of the jobs placed on ``node``."""
        return f"{self.placed}{node}/"

    def copy(self, node: str | None, job_id: int) -> str:
        """Job ``job_id``'s copy for ``node`` (None: the copy every node watches)."""
        return f"{self.placed_on(node) if node is not None else self.placed_on_many}{job_id:0{ID_DIGITS}d}"

    def node(self, name: str) -> str:
        return self.nodes + name

    def job(self, job_id: int) -> str:
        return f"{self.jobs}{job_id:0{ID_DIGITS}d}"

    def env(self, job_id: int) -> str:
        return f"{self.env_prefix}{job_id:0{ID_DIGITS}d}"

    def past(self, job_id: int) -> str:
        return f"{self.history}{job_id:0{ID_DIGITS}d}"

    def block(self, first: int) -> str:
        """The history block whose first id is ``first`` (a multiple of BLOCK_IDS, see jobtable)."""
        return f"{self.blocks}{first:0{ID_DIGITS}d}"

    def lineage(self, root: int) -> str:
        """The prefix of lineage ``root``'s members in the history."""
        return f"{self.lineages}{root:0{ID_DIGITS}d}/"

    def lineage_member(self, root: int, job_id: int) -> str:
        return f"{self.lineage(root)}{job_id:0{ID_DIGITS}d}"

    @staticmethod
    def job_id(key: bytes | str, prefix: str) -> int | None:
        """The id in a job/env/history key, or None if the key is not one."""
        text = key.decode("utf-8", "replace") if isinstance(key, bytes) else key
        if not text.startswith(prefix):
            return None
        tail = text[len(prefix):]
        return int(tail) if tail.isdigit() and len(tail) == ID_DIGITS else None
