"""One node's share of a generation's redundancy: from *complete* to *protected*.

After every node of a job committed a generation on its own disk, the
coordinator (:mod:`gangd.daemon.ckptcoord`, executing the round's
``WriteRedundancy``) asks each node of the job, with the fenced peer op
``ckpt_protect``, to write its share of the level's redundancy
(:mod:`gangd.redundancy.plan`), behind the job — its ranks already resumed:

``partner``  pull the ring predecessor's files (its MANIFEST first, then
             every file it lists, each checked against it) into
             ``gen-G/redundancy/partner-<node>/``; its MANIFEST lands last.
``xor``      pull every other member's manifest, then compute this node's
             parity from their data streams (a reduce-scatter: each node
             stores ``1/(n - 1)`` of its set's largest data) into
             ``gen-G/redundancy/xor.parity``; ``xor.meta`` lands last.

Then the node checks its share with :func:`gangd.redundancy.held.missing`
and answers; a share that is not whole is an error naming what is missing.
The coordinator records the generation *protected* only when every node
answered whole. Everything lives inside the generation's own directory, so a
prune removes a generation's redundancy with it, and a write for generation
G can never touch generation G+1 (another directory, another request).

The bytes move on the bulk path (:mod:`gangd.redundancy.bulk`: the request
on the peer channel, ``ckpt_bulk_read``, the bytes on a TCP connection of
their own opened with an HMAC handshake keyed by the cluster secret; the
listener, :class:`BulkService`, starts on the first request for it), not
through the daemons' event loops; every op that reads a generation is
peer-only (the files hold the job's network contexts).
Only one write per generation runs on a node at a time, and at most
:data:`MAX_WRITES` generations at once. A test may hold a write before it
starts (:func:`gangd.failpoint.hold`), armed like a failpoint (:mod:`gangd.failpoint`).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import trio

from .. import ckptstore, safefs
from ..ckptstore import StoreError
from ..failpoint import hold
from ..redundancy import held, transfer, xor
from ..redundancy.bulk import Bulk, BulkServer
from ..redundancy.plan import NODE_NAME, Plan, PlanError, make_plan
from ..rpc import RemoteError, leaf_error

log = logging.getLogger("gangd.protect")

MAX_WRITES = 2  # generations whose redundancy one node writes at once
MAX_NODES = 4096
HOLD = "protect.hold"  # (a test's hold point: see gangd.failpoint.hold)


@dataclass(frozen=True)
class ProtectRequest:
    """``ckpt_protect``'s arguments, checked (they come from a peer)."""

    job: int
    lineage: int
    gen: int
    plan: Plan

    @classmethod
    def from_wire(cls, args: dict) -> ProtectRequest:
        numbers = {}
        for key in ("job", "lineage", "gen"):
            value = args.get(key)
            if type(value) is not int or not 0 < value < 2**62:
                raise RemoteError("bad_request", f"'{key}' must be a positive integer")
            numbers[key] = value
        level, nodes, set_size = args.get("level"), args.get("members"), args.get("set_size")
        if level not in ("partner", "xor"):
            raise RemoteError("bad_request", "'level' must be partner or xor")
        if not isinstance(nodes, list) or not 2 <= len(nodes) <= MAX_NODES or not all(isinstance(n, str) and NODE_NAME.match(n) for n in nodes):
            raise RemoteError("bad_request", "'members' must list the job's node names, in order")
        if set_size is not None and type(set_size) is not int:
            raise RemoteError("bad_request", "'set_size' must be an integer")
        try:
            plan = make_plan(nodes, level, set_size)
        except PlanError as exc:
            raise RemoteError("bad_request", str(exc)) from None
        return cls(numbers["job"], numbers["lineage"], numbers["gen"], plan)


class Protector:
    """This node's redundancy writer. ``checkpoints``: the node's
    :class:`gangd.daemon.checkpoint.NodeCheckpoints` (its root, its safe
    opening of generation directories); ``peers``: the links to the others."""

    def __init__(self, *, node: str, checkpoints, peers, bulk: Bulk | None = None):
        self.node = node
        self.checkpoints = checkpoints
        self.peers = peers
        self.bulk = bulk
        self.writing: set[tuple[int, int]] = set()
        self._limit: trio.Semaphore | None = None

    @property
    def root(self) -> Path:
        return self.checkpoints.root

    async def protect(self, args: dict) -> dict:
        request = ProtectRequest.from_wire(args)
        plan, key = request.plan, (request.lineage, request.gen)
        if self.node not in plan.nodes:
            raise RemoteError("bad_request", f"{self.node} is not a node of job {request.job} ({', '.join(plan.nodes)})")
        if key in self.writing:
            raise RemoteError("busy", f"{self.node} is already writing the redundancy of job-{request.lineage}/gen-{request.gen}")
        if self._limit is None:
            self._limit = trio.Semaphore(MAX_WRITES)
        self.writing.add(key)
        try:
            async with self._limit:
                await hold(HOLD)
                started = time.monotonic()
                directory = ckptstore.gen_dir(self.root, request.lineage, request.gen)
                try:
                    await trio.to_thread.run_sync(self._own_manifest, directory)
                    if plan.level == "partner":
                        written = await self._partner(request, directory)
                    else:
                        written = await self._xor(request, directory)
                    missing = await trio.to_thread.run_sync(held.missing, directory, plan, self.node)
                except (StoreError, safefs.UnsafePath) as exc:
                    raise RemoteError("redundancy_failed", f"{self.node}: {exc}") from None
                except OSError as exc:
                    raise RemoteError("redundancy_failed", f"{self.node}: {ckptstore.describe_os_error(exc, directory)}") from None
                except RemoteError as exc:
                    message = exc.message if self.node in exc.message else f"{self.node}: {exc.message}"
                    raise RemoteError("redundancy_failed", message) from None
                if missing:
                    raise RemoteError("redundancy_failed", f"{self.node}: {missing}")
                seconds = time.monotonic() - started
                log.info("job %d: %s redundancy of generation %d written (%d bytes in %.3f s)", request.job, plan.level, request.gen, written, seconds)
                return {"node": self.node, "level": plan.level, "bytes": written, "seconds": round(seconds, 6)}
        finally:
            self.writing.discard(key)

    def _own_manifest(self, directory: Path) -> ckptstore.Manifest:
        """This node's committed generation (no redundancy for one it does not have)."""
        fd = self.checkpoints._gen_fd(directory)
        try:
            return ckptstore.read_manifest(directory, dir_fd=fd, owner=os.geteuid())
        finally:
            os.close(fd)

    def _room(self, directory: Path, incoming: int) -> None:
        """Refuse a redundancy write the disk cannot take and still keep its
        reserve (``output_reserve``, as a commit and a restart's staging do):
        another user's large checkpoints must not fill this node's disk."""
        fd = self.checkpoints._gen_fd(directory)
        try:
            enough, free, reserve = ckptstore.room_for(fd, incoming, self.checkpoints.config.output_reserve)
        finally:
            os.close(fd)
        if not enough:
            raise StoreError(f"the checkpoint disk ({self.root}) has {free} bytes free; the redundancy needs {incoming} "
                         f"and gangd keeps {reserve} free there (output_reserve)")

    def _fresh_subdir(self, directory: Path, name: str | None) -> None:
        """``gen-G/redundancy/`` (root's, 0700), and in it an empty ``name``
        (a leftover of an earlier attempt removed); no link followed."""
        gen = self.checkpoints._gen_fd(directory)
        try:
            red = safefs.open_dir_at(gen, xor.REDUNDANCY_DIR, directory, create_mode=0o700)
        finally:
            os.close(gen)
        try:
            os.fchmod(red, 0o700)
            if name is not None:
                safefs.rmtree_at(red, name)
                os.mkdir(name, 0o700, dir_fd=red)
        finally:
            os.close(red)

    async def _partner(self, request: ProtectRequest, directory: Path) -> int:
        source = request.plan.partnered_by(self.node)
        channel = self.peers.channel(source)
        manifest = await transfer.fetch_manifest(channel, lineage=request.lineage, gen=request.gen, node=source)
        prefix = transfer.partner_prefix(source)
        await trio.to_thread.run_sync(self._room, directory, sum(size for size, _ in manifest.files.values()))
        await trio.to_thread.run_sync(self._fresh_subdir, directory, prefix.split("/")[1])
        await transfer.fetch_generation(channel, manifest, directory / prefix, bulk=self.bulk)
        return sum(size for size, _ in manifest.files.values())

    async def _xor(self, request: ProtectRequest, directory: Path) -> int:
        members = request.plan.set_of(self.node)
        index = members.index(self.node)
        mine = await trio.to_thread.run_sync(self._own_manifest, directory)
        manifests: list = [None] * len(members)
        manifests[index] = mine

        async def fetch(i: int, member: str) -> None:
            manifests[i] = await transfer.fetch_manifest(self.peers.channel(member), lineage=request.lineage, gen=request.gen, node=member)

        try:
            async with trio.open_nursery() as nursery:
                for i, member in enumerate(members):
                    if i != index:
                        nursery.start_soon(fetch, i, member)
        except BaseExceptionGroup as group:
            raise leaf_error(group) from None
        meta = xor.meta_for(manifests, members, index)
        await trio.to_thread.run_sync(self._room, directory, meta.parity_size)
        await trio.to_thread.run_sync(self._fresh_subdir, directory, None)
        async with trio.open_nursery() as nursery:
            sources: list = [
                None if i == index else transfer.RemoteData(nursery, self.peers.channel(member), request.lineage, request.gen, bulk=self.bulk)
                for i, member in enumerate(members)
            ]
            try:
                written = await trio.to_thread.run_sync(xor.write_parity, directory, meta, sources)
            finally:
                nursery.cancel_scope.cancel()  # (pumps of a failed parity stop with it)
        return written.parity_size


class BulkService:
    """This node's bulk listener (:class:`gangd.redundancy.bulk.BulkServer`)
    on its peer address, started by the first ``ckpt_bulk_read`` and kept
    for the daemon's life (``spawn``: a task of the daemon's root nursery)."""

    def __init__(self, *, secret: bytes, host: str, spawn):
        self.secret, self.host, self.spawn = secret, host, spawn
        self._server: BulkServer | None = None
        self._ready: trio.Event | None = None
        self._error = ""

    async def server(self) -> BulkServer:
        if self._server is None:
            if self._ready is None:
                self._ready = trio.Event()
                self.spawn(self._run, self._ready)
            await self._ready.wait()
        if self._server is None:
            raise RemoteError("transfer_failed", f"no bulk listener on {self.host}: {self._error}")
        return self._server

    async def _run(self, ready: trio.Event) -> None:
        server = BulkServer(self.secret, host=self.host)
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(server.run)
                self._server = server
                ready.set()
        except OSError as exc:
            self._error = exc.strerror or str(exc)
            log.warning("the checkpoint bulk listener on %s failed: %s", self.host, self._error)
        finally:
            self._server = None
            if self._ready is ready:
                self._ready = None  # (the next request tries again)
            ready.set()
