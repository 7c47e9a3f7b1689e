"""From a message on a channel to its handler.

Client requests run only client operations (a peer operation from a client
is refused, never run); peer requests only peer operations, fenced ones
after the term check. Notes (one-way messages) from ranks go to the job
network or the checkpoint agent. Every handler raises
:class:`~gangd.rpc.RemoteError` with a specific code for anything the
caller got wrong; nothing a caller sends can stop the daemon.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ...protocol import Note, Request
from ...rpc import Channel, RemoteError
from .registry import CLIENT, PEER, REGISTRY, Call, Registry


@dataclass
class Services:
    """What handlers call: the domain objects of this node, wired in server.py.

    A unit test builds one with only the parts its handlers use."""

    node: str
    config: Any = None
    table: Any = None
    membership: Any = None
    calls: Any = None  # .calls.Calls
    coordinator: Any = None  # .coordinator.Coordinator (acts only while this node leads)
    node_jobs: Any = None  # .node.NodeJobs
    listing: Any = None  # .jobs.Listing
    jobnet: Any = None
    pmi: Any = None
    names: Any = None  # .names.NameService (serves only while this node leads)
    checkpoints: Any = None  # .checkpoint.NodeCheckpoints
    flusher: Any = None  # .flush.Flusher
    peers: Any = None
    ranks: Any = None
    spawn: Callable[..., None] | None = None
    heartbeat_info: Callable[[], dict] | None = None
    resend_exits: Callable[[], int] | None = None


class Dispatcher:
    def __init__(self, services: Services, *, check_term: Callable[[object, str, str | None], None], registry: Registry = REGISTRY):
        self.services = services
        self.check_term = check_term
        self.registry = registry

    async def handle(self, channel: Channel, message):
        """A channel's handler: every request and note of a connection comes here."""
        s = self.services
        if isinstance(message, Note):
            if not channel.context.get("peer"):
                if message.op.startswith("ckpt_"):
                    s.checkpoints.on_note(channel, message.op, message.args)
                else:
                    s.jobnet.on_client_note(channel, message.op, message.args)
            return None
        request: Request = message
        if channel.context.get("peer"):
            return await self.dispatch_peer(request.op, request.args, from_node=channel.context.get("node"), channel=channel)
        entry = self.registry.get(request.op)
        if entry is None or entry.audience is not CLIENT:
            if entry is not None:
                raise RemoteError("permission_denied", f"{request.op!r} is a daemon-to-daemon operation")
            raise RemoteError("unknown_op", f"unknown operation {request.op!r}")
        return await entry.handler(s, Call(request.args, cred=channel.context["cred"], channel=channel))

    async def dispatch_peer(self, op: str, args: dict, *, from_node: str | None, channel: Channel | None = None):
        """A peer operation, from another node or (``calls``) from this one."""
        entry = self.registry.get(op)
        if entry is None or entry.audience is not PEER:
            raise RemoteError("unknown_op", f"unknown peer operation {op!r}")
        if entry.fenced:
            args = dict(args)
            self.check_term(args.pop("term", None), op, from_node)
        return await entry.handler(self.services, Call(args, from_node=from_node, channel=channel))
