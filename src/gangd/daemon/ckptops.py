"""Requests about checkpoints: from users (``gang checkpoint/restart/ckpt``), from
ranks (:mod:`gangd.ckptlib`), and between daemons (the rounds of
:mod:`gangd.daemon.ckptcoord`, served by :mod:`gangd.daemon.checkpoint`)."""

from __future__ import annotations

from ..rpc import RemoteError
from .ops import _int


class CheckpointOps:
    def __init__(self, ops):
        self.ops = ops
        self.daemon = ops.daemon
        self.client_ops = {
            "checkpoint": self.checkpoint,
            "restart": self.restart,
            "ckpt_list": self.ckpt_list,
            "ckpt_attach": self.ckpt_attach,
            "ckpt_start": self.ckpt_start,
            "ckpt_end": self.ckpt_end,
        }
        node = self.daemon.checkpoints
        self.peer_ops = {
            "coord_checkpoint": self.coord_checkpoint,
            "coord_checkpoint_all": self.coord_checkpoint_all,
            "coord_restart": self.coord_restart,
            "coord_ckpt_restored": self.coord_ckpt_restored,
            "ckpt_begin": self._node(node.begin),
            "ckpt_cut": self._node(node.cut),
            "ckpt_capture": self._node(node.capture),
            "ckpt_resume": self._node(node.resume),
            "ckpt_commit": self._node(node.commit),
            "ckpt_abort": self._node(node.abort),
            "ckpt_prune": self._node(node.prune),
            "ckpt_verify": self._node(node.verify),
            "ckpt_open": self._node(node.open_restarted),
            "ckpt_abort_all": self._node(node.abort_all),
        }

    @staticmethod
    def _node(method):
        async def handler(args, from_node, channel):
            return await method(args)

        return handler

    # ------------------------------------------------------------ users

    async def checkpoint(self, cred, args, channel):
        """Checkpoint a job now; with ``wait`` (default) answer when the generation is complete or aborted."""
        job_id = _int(args, "job")
        return await self.ops.to_coordinator(
            "coord_checkpoint", job=job_id, cred=cred, wait=bool(args.get("wait", True)),
            trigger=str(args.get("trigger") or f"requested by {cred['user']}"),
        )

    async def restart(self, cred, args, channel):
        gen = args.get("gen")
        if gen is not None and (not isinstance(gen, int) or isinstance(gen, bool)):
            raise RemoteError("bad_request", f"'gen' must be a generation number, not {gen!r}")
        return await self.ops.to_coordinator("coord_restart", job=_int(args, "job"), cred=cred, gen=gen)

    async def ckpt_list(self, cred, args, channel):
        """The generations of a job's lineage (every job restarted from it), oldest first."""
        record = await self.ops._record(args, cred, "inspect")
        coordinator = self.daemon.coordinator
        generations = coordinator.ckpt.generations(record)
        live = None
        if coordinator.active and record["id"] in coordinator.ckpt.live:
            entry = coordinator.ckpt.live[record["id"]]
            live = {"gen": entry["gen"], "phase": entry["phase"], "trigger": entry["trigger"], "started": entry["started"]}
        return {"job": record["id"], "lineage": record.get("lineage") or record["id"], "generations": generations, "under_way": live}

    # ------------------------------------------------------------ ranks

    async def ckpt_attach(self, cred, args, channel):
        return await self.daemon.checkpoints.attach(cred, channel.context.get("pid"), args, channel)

    async def ckpt_start(self, cred, args, channel):
        return await self.daemon.checkpoints.rank_start(channel, args)

    async def ckpt_end(self, cred, args, channel):
        return await self.daemon.checkpoints.rank_end(channel, args)

    # ------------------------------------------------------------ coordinator

    async def coord_checkpoint(self, args, from_node, channel):
        return await self.ops._coordinator().ckpt.request(_int(args, "job"), args["cred"], str(args.get("trigger")), bool(args.get("wait", True)))

    async def coord_checkpoint_all(self, args, from_node, channel):
        return await self.ops._coordinator().ckpt.request_all(str(args.get("trigger") or "SIGUSR1"))

    async def coord_restart(self, args, from_node, channel):
        return await self.ops._coordinator().ckpt.restart(_int(args, "job"), args["cred"], args.get("gen"))

    async def coord_ckpt_restored(self, args, from_node, channel):
        await self.ops._coordinator().ckpt.on_restored(_int(args, "job"), str(args.get("reporter")), args.get("error"))
        return True
