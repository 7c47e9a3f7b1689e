"""What a client asks the daemons, over either transport: :class:`Client`.

Apart from :mod:`gangd.client.api` (which dials with trio) so that the
``gang`` commands that only send requests and read their answers can use the
same methods over :mod:`gangd.client.oneshot`'s blocking socket without
importing trio (~0.1 s of CPU, half of such a command's). A channel here is
anything with ``async def request(op, **args)``, ``remote_node`` and (for
:meth:`Client.wait` and :meth:`Client.output`, which follow streams and need
:func:`gangd.client.api.connect`) ``stream(op, **args)``.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from typing import Any

from .. import jobs
from ..errors import RemoteError

#: Recoveries a wait follows at most (each lineage's are bounded by [checkpoint] max_recoveries anyway).
MAX_FOLLOW = 1000


class JobList(list):
    """Job summaries, and ``stale``: None, or ``{"node", "seconds", "why"}``
    when the node that answered had no session with etcd for that long (it
    answered from its cache, which may be out of date)."""

    stale: dict | None = None


def stale_warning(stale: dict | None) -> str | None:
    """The sentence a user sees when a listing came from a node cut off from etcd."""
    if not stale:
        return None
    return (f"warning: node {stale.get('node')} has not reached etcd for {float(stale.get('seconds') or 0):.0f} s "
            f"({stale.get('why')}): this list may be out of date")


class Client:
    def __init__(self, channel: Any):
        self.channel = channel

    @property
    def node(self) -> str:
        node = self.channel.remote_node
        if node is None:  # a Client is only made from a channel whose handshake is done
            raise RuntimeError("the channel to gangd has not completed its handshake")
        return node

    async def request(self, op: str, **args):
        return await self.channel.request(op, **args)

    async def info(self) -> dict:
        return await self.request("info")

    async def submit(
        self,
        argv: list[str],
        nranks: int,
        *,
        name: str | None = None,
        per_node: int | None = None,
        nodes: int | None = None,
        nodelist: list[str] | None = None,
        cwd: str | None = None,
        env: dict | None = None,
        kill_on_bad_exit: bool = True,
        priority: int | None = None,
        time_slice: float | None = None,
        network_context: dict[int, bytes] | None = None,
        ckpt_every: float | str | None = None,
        mpi: bool = False,
        ckpt_redundancy: str | None = None,
        requeue: bool | None = None,
        ckpt_mode: str | None = None,
        ckpt_codec: str | None = None,
        ckpt_pipeline: str | None = None,
    ) -> dict:
        """Submit a job. ``network_context`` ({rank: bytes}, as returned by
        :meth:`capture_network`) is handed to the ranks when they attach, so
        they receive the captured in-flight messages before anything else."""
        spec = {
            "argv": list(argv),
            "nranks": nranks,
            "name": name,
            "per_node": per_node,
            "nodes": nodes,
            "nodelist": nodelist,
            "cwd": cwd if cwd is not None else os.getcwd(),
            "env": dict(os.environ) if env is None else env,
            "kill_on_bad_exit": kill_on_bad_exit,
            "priority": priority,
            "slice": time_slice,
            "ckpt_every": ckpt_every,
            "mpi": mpi,
        }
        if ckpt_redundancy is not None:  # (None: the cluster's [checkpoint] redundancy)
            spec["ckpt_redundancy"] = ckpt_redundancy
        if ckpt_mode is not None:  # (None: the cluster's [checkpoint] mode; full, incremental, differential, adaptive)
            spec["ckpt_mode"] = ckpt_mode
        if ckpt_codec is not None:  # (None: the cluster's [checkpoint] codec; a spec such as zstd:9, checked by the coordinator)
            spec["ckpt_codec"] = ckpt_codec
        if ckpt_pipeline is not None:  # (None: the cluster's [checkpoint] pipeline; buffer_size=256KiB,workers=2, checked by the coordinator)
            spec["ckpt_pipeline"] = ckpt_pipeline
        if requeue is not None:  # (None: requeued when it checkpoints, see gangd.daemon.recover)
            spec["requeue"] = requeue
        if network_context:
            spec["net_context"] = {str(rank): bytes(blob) for rank, blob in network_context.items()}
        return await self.request("submit", spec=spec)

    async def jobs(self, all: bool = False) -> JobList:
        """Every job (with ``all``) or the active and recent ones, in id order, page by page
        (a page may be short of the limit when its jobs have many ranks: the last one is empty).
        Its ``stale`` says whether the node that answered has lost etcd (see :class:`JobList`)."""
        found = JobList()
        async for page in self.job_pages(all=all):
            found.stale = found.stale or page.stale
            found += page
        return found

    async def job_pages(self, all: bool = False, page: int = 2000) -> AsyncIterator[JobList]:
        """:meth:`jobs` a page at a time, as each arrives (``gang ps`` prints
        the first rows at once, whatever the history holds)."""
        after = 0
        while True:
            reply = await self.request("jobs", all=all, after=after, limit=page, freshness=True)
            found = JobList()
            if isinstance(reply, dict):
                found += reply.get("jobs") or []
                found.stale = reply.get("stale")
            else:  # a daemon from before the freshness flag
                found += reply
            if not found:
                return
            yield found
            after = found[-1]["id"]

    async def history(self, limit: int = 50, before: int | None = None, uid: int | None = None) -> list[dict]:
        """Ended jobs, newest first (the cluster's history): up to ``limit`` with ids below ``before``."""
        found: list[dict] = []
        while len(found) < limit:
            want = min(500, limit - len(found))
            batch = await self.request("history", limit=want, before=before, uid=uid)
            found += batch
            if len(batch) < want:
                break
            before = batch[-1]["id"]
        return found

    async def job(self, job_id: int) -> dict:
        return await self.request("job", job=job_id)

    async def nodes(self) -> list[dict]:
        return await self.request("nodes")

    async def kill(self, job_id: int) -> dict:
        return await self.request("kill", job=job_id)

    async def suspend(self, job_id: int) -> dict:
        return await self.request("suspend", job=job_id)

    async def resume(self, job_id: int) -> dict:
        return await self.request("resume", job=job_id)

    async def schedule(self, switches: bool = False) -> dict:
        """The gang matrix; with ``switches`` the measured recent switches too."""
        return await self.request("schedule", switches=switches)

    async def net(self, job_id: int) -> dict:
        return await self.request("net", job=job_id)

    async def capture_network(self, job_id: int, reopen: bool = True) -> dict:
        """Close the job's gates, return {rank: network context bytes}, open them again."""
        return await self.request("net_capture", job=job_id, reopen=reopen)

    async def checkpoint(self, job_id: int, *, wait: bool = True, trigger: str | None = None) -> dict:
        """Take a consistent checkpoint of the job; with ``wait``, return the
        generation once complete or aborted (``state`` says which)."""
        return await self.request("checkpoint", job=job_id, wait=wait, trigger=trigger)

    async def restart(self, job_id: int, generation: int | None = None, *, nodelist: list[str] | None = None,
                      nodes: int | None = None) -> dict:
        """Restart an ended job from its newest intact complete checkpoint (or
        ``generation``), on its checkpoint's nodes, on ``nodelist`` or on
        ``nodes`` live nodes (the files of ranks that move are copied there
        first); returns {"record": the new job, "gen", "iteration", "skipped", "placement"}."""
        return await self.request("restart", job=job_id, gen=generation, nodelist=nodelist, nodes=nodes)

    async def interval_plan(self, job_id: int) -> dict:
        """The job's checkpoint interval plan: C, R, L, λ, the optimal interval and the next planned iteration."""
        return await self.request("ckpt_interval", job=job_id)

    async def checkpoints(self, job_id: int) -> dict:
        """The checkpoint generations of the job's lineage and the one under way."""
        return await self.request("ckpt_list", job=job_id)

    def wait(self, job_id: int, *, kill_on_disconnect: bool = False):
        """``async with gang.wait(id) as updates``: the record at every change, until it ends."""
        return self.channel.stream("wait", job=job_id, kill_on_disconnect=kill_on_disconnect)

    async def wait_done(self, job_id: int, *, follow: bool = True) -> dict:
        """The job's final record; with ``follow``, a job a recovery requeued
        as a new one (REQUEUED, ``requeued_as``) is followed to the job that
        carries its computation on, and that one's final record returned."""
        for _ in range(MAX_FOLLOW):
            record = None
            async with self.wait(job_id) as updates:
                async for update in updates:
                    record = update
            if record is None:  # the daemon streams the record at least once, before any change
                raise RemoteError("malformed", f"the wait for job {job_id} ended without the job's record")
            following = jobs.successor(record)
            if not follow or following is None:
                return record
            job_id = following
        raise RemoteError("malformed", f"job {job_id} was requeued more than {MAX_FOLLOW} times")

    def output(self, job_id: int, *, follow: bool = True, ranks: list[int] | None = None):
        """``async with gang.output(id) as chunks``: ``{"rank", "stream", "data"}`` items."""
        return self.channel.stream("output", job=job_id, follow=follow, ranks=ranks)
