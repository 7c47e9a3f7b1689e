"""The daemon's side of job messaging: rendezvous, send gates, network context.

Ranks exchange messages over direct sockets (:mod:`gangd.comm`), but the
node daemon owns the network the way SCore-D's did:

* **Rendezvous.** Each rank attaches to its node daemon (``comm_attach``)
  with the addresses it listens on. The daemon checks — from the socket's
  peer credentials — that the caller really is a process of that rank, waits
  until every local rank attached, sends the node's addresses to the job's
  leader (the node of rank 0), and answers every rank with the whole table
  and the job's connection token once all nodes reported.
* **The send gate.** The attach connection stays open; through it the
  daemon closes and opens the job's gate (``gate`` notes, numbered by an
  epoch). A rank answers a close with ``gate_closed`` once the send it had
  under way, if any, completed; later sends wait for the gate to open.
* **Counters.** Each rank keeps per-peer counts of messages sent, received
  from the network and delivered to the program, in a small file the daemon
  maps, so the daemon knows each channel's messages in flight even while the
  job is stopped.
* **Network context.** With the gate closed on every rank of the job, the
  daemons read the sent counters, ask each rank to drain its connections up
  to them (``capture``) and collect each rank's undelivered messages and
  channel state as bytes: the job's network context, which a restarted job
  gets back in its attach reply before any rank may send.
"""

from __future__ import annotations

import logging
import os
import stat
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import trio

from .. import jobs, safefs
from ..rpc import Channel, RemoteError
from .gather import Gathers

log = logging.getLogger("gangd.jobnet")

GATE_ACK_TIMEOUT = 10.0
GATE_NOTE_TIMEOUT = 0.1
CAPTURE_TIMEOUT = 30.0


def caller_rank(daemon, cred: dict, pid: int, args: dict, op: str) -> tuple[dict, int]:
    """(record, rank) of the process calling ``op`` for ``args["job"]``/``args["rank"]``:
    the kernel's word (SO_PEERCRED pid and uid), never the caller's — the
    pid must be a process of that rank, running here, of its owner or root.

    ``daemon``: anything with this node's ``node``, ``table`` and ``ranks``
    (a :class:`JobNet`, or the daemon)."""
    job_id, rank = args.get("job"), args.get("rank")
    if not isinstance(job_id, int) or not isinstance(rank, int):
        raise RemoteError("bad_request", f"{op} needs integer 'job' and 'rank'")
    record = daemon.table.get(job_id)
    if record is None:
        raise RemoteError("no_such_job", f"job {job_id} has no ranks on {daemon.node}")
    if not (0 <= rank < record["nranks"]) or record["placement"][rank] != daemon.node:
        raise RemoteError("bad_request", f"rank {rank} of job {job_id} does not run on {daemon.node}")
    if cred["uid"] not in (0, record["owner_uid"]) or not daemon.ranks.is_rank_process(job_id, rank, pid):
        raise RemoteError("permission_denied", f"process {pid} is not rank {rank} of job {job_id}")
    return record, rank


def expected_deliveries(counters: dict[str, dict], nranks: int) -> dict[str, list[int]]:
    """From every node's ``counters()`` ({node: {rank: [sent, received, delivered]}}):
    for each receiving rank, how many messages each rank sent it — what
    ``capture`` drains up to."""
    sent = {int(r): c[0] for per_node in counters.values() for r, c in per_node.items()}
    return {str(dst): [sent.get(src, [0] * nranks)[dst] for src in range(nranks)] for dst in range(nranks)}


@dataclass
class RankLink:
    rank: int
    channel: Channel
    addrs: dict
    counters_fd: int | None = None  # the rank's counters file: (3, size) uint64 sent, received, delivered
    acked: int = 0  # last gate epoch this rank confirmed closed

    def read_counters(self, size: int) -> list | None:
        # A copy per read (pread), never a live mapping: the file belongs to
        # the job's owner, who could truncate it under us (SIGBUS in the daemon).
        if self.counters_fd is None:
            return None
        try:
            data = os.pread(self.counters_fd, 24 * size, 0)
        except OSError:
            return None
        if len(data) < 24 * size:
            return None
        words = struct.unpack(f"={3 * size}Q", data[: 24 * size])  # (struct, not numpy: the daemon does not import numpy to start)
        return [list(words[i * size : (i + 1) * size]) for i in range(3)]

    def close(self) -> None:
        if self.counters_fd is not None:
            os.close(self.counters_fd)
            self.counters_fd = None


@dataclass
class JobNetState:
    job_id: int
    gate_open: bool = True
    want_open: bool = True  # what the gang scheduler wants; holds override it
    holds: set[str] = field(default_factory=set)  # "checkpoint", "restart": keep the gate closed
    epoch: int = 0
    links: dict[int, RankLink] = field(default_factory=dict)
    peers: list | None = None  # the full address table once every node reported
    ready: trio.Event = field(default_factory=trio.Event)
    changed: trio.Event = field(default_factory=trio.Event)
    exited: dict[int, str] = field(default_factory=dict)  # rank -> why, as told to the ranks
    context: dict[int, bytes] = field(default_factory=dict)  # to restore at attach (restart)
    stopped: bool = False  # gang-scheduled out: SIGSTOPped right now
    reported: bool = False  # this node's addresses went to the leader

    def poke(self) -> None:
        self.changed.set()
        self.changed = trio.Event()


class JobNet:
    """Also owns the runtime directory: ``runtime_dir`` (root's, 0711, checked
    and opened once at start-up by :meth:`open_runtime`) holds one directory
    per job, ``job-<id>`` (the owner's, 0700), with its ranks' sockets and
    counters. Every use goes through the directory's fd (:mod:`gangd.safefs`):
    no link planted anywhere makes root chown, open or remove another file."""

    def __init__(self, *, node: str, address: str, runtime_dir: Path, table, ranks, tasks, call, on_job_gone: Callable[[int], None]):
        """``tasks``: the daemon's (:class:`.tasks.Tasks`); ``call``: a peer
        operation on a node (:meth:`.calls.Calls.call`); ``on_job_gone``: what
        else forgets an ended job once its ranks here are gone."""
        self.node = node
        self.address = address
        self.table = table
        self.ranks = ranks
        self.tasks = tasks
        self.call = call
        self.on_job_gone = on_job_gone
        self.runtime_dir = runtime_dir
        self.runtime_fd: int | None = None
        self.states: dict[int, JobNetState] = {}
        self._gathers = Gathers()  # leader side of the rendezvous: job -> {node: addrs}

    def state(self, job_id: int) -> JobNetState:
        if job_id not in self.states:
            self.states[job_id] = JobNetState(job_id)
        return self.states[job_id]

    # ------------------------------------------------------------ launch and cleanup

    def open_runtime(self) -> None:
        """At start-up: the runtime directory, checked (raises
        :class:`safefs.UnsafePath` saying why it cannot be trusted) and
        emptied of the sockets of ranks that died with a previous life."""
        fd = safefs.open_trusted_dir(self.runtime_dir, create_mode=0o711)
        try:
            os.fchmod(fd, 0o711)  # traversable by job owners; each job's directory is theirs alone
            safefs.clear_dir(fd)
        except OSError as exc:
            os.close(fd)
            raise safefs.UnsafePath(f"{self.runtime_dir}: {exc.strerror or exc}") from None
        self.runtime_fd = fd

    def close_runtime(self) -> None:
        """At shutdown: remove every job's directory (the runtime directory stays)."""
        if self.runtime_fd is not None:
            try:
                safefs.clear_dir(self.runtime_fd)
            except OSError as exc:
                log.warning("could not empty %s: %s", self.runtime_dir, exc.strerror)
            os.close(self.runtime_fd)
            self.runtime_fd = None

    def comm_dir(self, job_id: int) -> Path:
        return self.runtime_dir / f"job-{job_id}"

    def _runtime(self) -> int:
        if self.runtime_fd is None:
            raise RemoteError("not_ready", f"the runtime directory of {self.node} is not open")
        return self.runtime_fd

    def prepare(self, record: dict, drop: bool) -> dict[str, str]:
        """Create the job's directory for sockets and counters; the env ranks need."""
        name = f"job-{record['id']}"
        runtime = self._runtime()
        try:
            os.mkdir(name, 0o700, dir_fd=runtime)
        except FileExistsError:
            pass  # (a relaunch here: only the daemon creates entries in the runtime directory)
        fd = safefs.open_dir_at(runtime, name, self.runtime_dir, trusted=False, owner=record["owner_uid"])
        try:
            if drop:
                os.fchown(fd, record["owner_uid"], record["owner_gid"])
            os.fchmod(fd, 0o700)
        finally:
            os.close(fd)
        self.state(record["id"])
        return {"GANGD_COMM_DIR": str(self.comm_dir(record["id"])), "GANGD_ADDRESS": self.address}

    def forget(self, job_id: int) -> None:
        state = self.states.pop(job_id, None)
        if state is not None:
            for link in state.links.values():
                link.close()
            state.ready.set()  # attaches still waiting get an answer, not a hang
        self._gathers.forget(lambda key: key == job_id)
        if self.runtime_fd is not None:
            # In a thread: the directory is the owner's, who may have filled it.
            if self.tasks.running:
                self.tasks.spawn(trio.to_thread.run_sync, safefs.rmtree_at, self.runtime_fd, f"job-{job_id}")
            else:
                safefs.rmtree_at(self.runtime_fd, f"job-{job_id}")

    def on_record(self, record: dict) -> None:
        """A job record changed: tell attached ranks about peers that exited; clean up ended jobs."""
        state = self.states.get(record["id"])
        if state is None:
            return
        for rank, status in enumerate(record["ranks"]):
            if status is not None and rank not in state.exited:
                self.rank_exited(record["id"], rank, f"rank {rank} on {status.get('node', '?')} {jobs.describe_status(status)}")
        if jobs.is_terminal(record) and not any(r.status is None for r in self.ranks.of_job(record["id"])):
            self.forget(record["id"])
            self.on_job_gone(record["id"])

    def rank_exited(self, job_id: int, rank: int, why: str) -> None:
        state = self.states.get(job_id)
        if state is None or rank in state.exited:
            return
        state.exited[rank] = why
        link = state.links.pop(rank, None)
        if link is not None:
            link.close()
        state.poke()
        record = self.table.get(job_id)
        if record is not None and record["placement"]:
            self._maybe_report(record, state)
        for link in list(state.links.values()):
            self.tasks.spawn(self._note, link, "peer_exited", {"rank": rank, "why": why})

    async def _note(self, link: RankLink, op: str, args: dict) -> None:
        try:
            await link.channel.note(op, **args)
        except RemoteError:
            pass  # the rank is gone; its exit is reported elsewhere

    # ------------------------------------------------------------ rendezvous

    async def attach(self, cred: dict, pid: int, args: dict, channel: Channel) -> dict:
        record, rank = caller_rank(self, cred, pid, args, "comm_attach")
        job_id = record["id"]
        if job_id not in self.states:
            raise RemoteError("no_such_job", f"job {job_id} has no ranks on {self.node}")
        state = self.states[job_id]
        counters_fd = self._open_counters(record, rank)
        addrs = {"node": self.node, "unix": args.get("unix"), "tcp": args.get("tcp")}
        old = state.links.get(rank)
        if old is not None:
            old.close()
        state.links[rank] = RankLink(rank, channel, addrs, counters_fd, acked=state.epoch)
        channel.context["rank_of"] = (job_id, rank)
        state.poke()
        self._maybe_report(record, state)
        await state.ready.wait()
        if state.peers is None or rank not in state.links:
            raise RemoteError("job_ended", f"job {job_id} ended (or its rendezvous failed) before every rank attached")
        # An exit that happened before this rank attached.
        for gone, why in state.exited.items():
            self.tasks.spawn(self._note, state.links[rank], "peer_exited", {"rank": gone, "why": why})
        return {
            "peers": state.peers,
            "token": record["token"],
            "gate": {"open": state.gate_open, "epoch": state.epoch},
            "context": state.context.pop(rank, None),
        }

    def _open_counters(self, record: dict, rank: int) -> int | None:
        """The rank's counters file — only the one in the job's directory, a
        regular file of the job's owner, large enough; never a path the
        client names (the daemon may be root)."""
        directory = self.comm_dir(record["id"])
        path = directory / f"rank-{rank}.counters"
        try:
            job_fd = safefs.open_dir_at(self._runtime(), directory.name, self.runtime_dir, trusted=False, owner=record["owner_uid"])
            try:
                fd = safefs.open_regular_at(job_fd, path.name, directory)
            finally:
                os.close(job_fd)
        except safefs.UnsafePath as exc:
            raise RemoteError("bad_request", f"cannot use the counters file: {exc}") from None
        except OSError as exc:
            raise RemoteError("bad_request", f"cannot open the counters file {path}: {exc.strerror}") from None
        info = os.fstat(fd)
        # As root: the owner's own file, with no other name — where hard links
        # to others' files are allowed (fs.protected_hardlinks=0) the owner
        # could link a file of root's here, and `gang net` would show its
        # first bytes. (A daemon that is not root reads only what it may anyway.)
        owners = (record["owner_uid"],) if os.geteuid() == 0 else (record["owner_uid"], os.geteuid())
        if (not stat.S_ISREG(info.st_mode) or info.st_uid not in owners or info.st_size < 24 * record["nranks"]
                or (os.geteuid() == 0 and info.st_nlink != 1)):
            os.close(fd)
            raise RemoteError("bad_request",
                              f"{path} is not a counters file of job {record['id']} "
                              f"(a regular file of its owner with one name, {24 * record['nranks']} bytes)")
        return fd

    def _maybe_report(self, record: dict, state: JobNetState) -> None:
        """Once every local rank attached (or exited), report the node's addresses to the leader."""
        if state.peers is not None or state.reported:
            return
        if all(r in state.links or r in state.exited for r in jobs.ranks_on(record, self.node)):
            state.reported = True
            self.tasks.spawn(self._report_to_leader, record, state)

    async def _report_to_leader(self, record: dict, state: JobNetState) -> None:
        leader = record["placement"][0]
        mine = {str(r): link.addrs for r, link in state.links.items()}
        try:
            peers = await self.call(leader, "comm_gather", job=record["id"], reporter=self.node, addrs=mine)
        except Exception as exc:  # noqa: BLE001 -- whatever broke the rendezvous, the ranks get an error instead of waiting forever
            log.warning("job %d: rendezvous through %s failed: %s", record["id"], leader, exc)
            for link in state.links.values():
                await link.channel.aclose()
            return
        state.peers = peers
        state.ready.set()

    async def gather(self, job_id: int, node: str, addrs: dict) -> list:
        """Leader side of the rendezvous: wait for every node of the job, return the table."""
        record = self.table.get(job_id)
        if record is None:
            raise RemoteError("no_such_job", f"no job {job_id}")
        table = await self._gathers.gather(job_id, node, addrs, jobs.nodes_of(record))
        peers: list[object] = [None] * record["nranks"]
        for per_node in table.values():
            if not isinstance(per_node, dict):  # always one: each node's ``addrs`` map (see comm_gather)
                continue
            for rank, entry in per_node.items():
                peers[int(rank)] = entry
        return peers

    def on_client_note(self, channel: Channel, op: str, args: dict) -> None:
        if op != "gate_closed" or "rank_of" not in channel.context:
            return
        job_id, rank = channel.context["rank_of"]
        state = self.states.get(job_id)
        if state is None:
            return
        link = state.links.get(rank)
        if link is not None and isinstance(args.get("epoch"), int):
            link.acked = max(link.acked, args["epoch"])
            state.poke()

    def detached(self, channel: Channel) -> None:
        """The rank's connection closed (it exited): stop waiting for it."""
        if "rank_of" not in channel.context:
            return
        job_id, rank = channel.context["rank_of"]
        state = self.states.get(job_id)
        if state and rank in state.links and state.links[rank].channel is channel:
            state.links.pop(rank).close()
            state.poke()

    # ------------------------------------------------------------ the gate

    async def set_gate(self, job_id: int, open_: bool) -> int:
        """The gang scheduler opens or closes the job's gate on this node; a
        hold (a checkpoint, a restart) keeps it closed whatever is asked.
        Returns the epoch (0: no ranks here)."""
        state = self.states.get(job_id)
        if state is None:  # ended, or never launched here
            return 0
        state.want_open = open_
        return await self._apply_gate(state)

    async def hold_gate(self, job_id: int, reason: str, held: bool) -> int:
        """Keep the gate closed for ``reason`` (or stop doing so)."""
        state = self.state(job_id)
        if held:
            state.holds.add(reason)
        else:
            state.holds.discard(reason)
        return await self._apply_gate(state)

    async def _apply_gate(self, state: JobNetState) -> int:
        open_ = state.want_open and not state.holds
        if open_ == state.gate_open and (open_ or state.epoch):
            return state.epoch  # already so (and every attached rank was told)
        state.gate_open = open_
        state.epoch += 1
        job_id = state.job_id
        for link in list(state.links.values()) if state.links else ():
            # Bounded: a rank that stopped reading its connection must not
            # hold up a gang switch of the whole cluster; it loses its link.
            with trio.move_on_after(GATE_NOTE_TIMEOUT) as scope:
                try:
                    await link.channel.note("gate", open=open_, epoch=state.epoch)
                except RemoteError:
                    pass
            if scope.cancelled_caught:
                log.warning("job %d rank %d does not read its daemon connection; dropping it", job_id, link.rank)
                self.tasks.spawn(link.channel.aclose)
        state.poke()
        return state.epoch

    def set_stopped(self, job_id: int, stopped: bool) -> None:
        state = self.states.get(job_id)
        if state is not None:
            state.stopped = stopped

    def is_stopped(self, job_id: int) -> bool:
        state = self.states.get(job_id)
        return state is not None and state.stopped

    async def wait_gate_closed(self, job_id: int, timeout: float = GATE_ACK_TIMEOUT) -> None:
        """Until every attached rank confirmed the current close (its send under way completed)."""
        state = self.states.get(job_id)
        if state is None:
            raise RemoteError("no_such_job", f"job {job_id} has no ranks on {self.node}")
        with trio.move_on_after(timeout):
            while True:
                if state.gate_open:
                    raise RemoteError("gate_open", f"the gate of job {job_id} was opened again")
                if all(link.acked >= state.epoch for link in state.links.values()):
                    return
                await state.changed.wait()
        late = sorted(r for r, link in state.links.items() if link.acked < state.epoch)
        raise RemoteError("timeout", f"ranks {late} of job {job_id} did not confirm the closed gate within {timeout:.0f} s")

    # ------------------------------------------------------------ counters and context

    def counters(self, job_id: int) -> dict[str, list]:
        """{rank: [sent[], received[], delivered[]]} for this node's attached ranks."""
        state = self.states.get(job_id)
        record = self.table.get(job_id)
        if state is None or record is None:
            return {}
        rows = {str(r): link.read_counters(record["nranks"]) for r, link in state.links.items()}
        return {r: c for r, c in rows.items() if c is not None}

    async def capture(self, job_id: int, expect: dict) -> dict[str, bytes]:
        state = self.states.get(job_id)
        if state is None:
            raise RemoteError("no_such_job", f"job {job_id} has no ranks on {self.node}")
        if state.gate_open:
            raise RemoteError("gate_open", f"close the gate of job {job_id} before capturing its network context")
        if state.stopped:
            raise RemoteError("job_suspended", f"job {job_id} is stopped on {self.node}; its ranks cannot answer")
        result: dict[str, bytes] = {}

        async def one(rank: int, link: RankLink) -> None:
            reply = await link.channel.request("capture", expect=expect.get(str(rank)) or [])
            if not isinstance(reply, dict):  # the rank's answer is as hostile as anything it sends
                raise RemoteError("bad_reply", f"rank {rank} of job {job_id} answered the capture with a {type(reply).__name__}, not a map")
            result[str(rank)] = reply["context"]

        with trio.fail_after(CAPTURE_TIMEOUT):
            async with trio.open_nursery() as nursery:
                for rank, link in list(state.links.items()):
                    nursery.start_soon(one, rank, link)
        return result

    def set_context(self, job_id: int, contexts: dict) -> None:
        """Network context each rank gets back when it attaches (restart)."""
        self.state(job_id).context = {int(r): bytes(b) for r, b in contexts.items()}
