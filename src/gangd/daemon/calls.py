"""Calls to other daemons: one node, many nodes, the coordinator.

What every part that talks to another node needs, in one place: a call to
one node (on this node it is a direct call into the local dispatcher, the
same path, term check included, as a peer's request); the same call on many
nodes at once, with one error naming every node that failed; and a call to
whoever is coordinator right now, riding out an election. Infrastructure:
it knows the links (:class:`.peers.Peers`) and who leads
(:class:`.controlplane.ControlPlane`), nothing about what the operations do.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import trio

from .. import jobs
from ..rpc import RemoteError

log = logging.getLogger("gangd.calls")

#: Runs a peer operation on this node: (op, args, from_node=...) -> result.
LocalDispatch = Callable[..., Awaitable[Any]]


class Calls:
    def __init__(self, *, node: str, peers, membership, patience: float, local: LocalDispatch | None = None):
        self.node = node
        self.peers = peers
        self.membership = membership
        #: How long to_coordinator waits out a cluster without a coordinator.
        self.patience = patience
        #: The dispatcher's entry for peer operations (plugged in once it is built).
        self.local = local

    async def call(self, node: str, op: str, **args):
        """Run a peer operation on ``node``; on this node it is a direct call."""
        if node == self.node:
            if self.local is None:
                raise RemoteError("not_ready", f"{self.node} is not serving requests yet")
            return await self.local(op, args, from_node=self.node)
        return await self.peers.call(node, op, **args)

    async def on_nodes(self, nodes: Iterable[str], op: str, **args) -> dict[str, Any]:
        """Peer ``op`` on every one of ``nodes`` at once, {node: result}; any
        failure raises one error naming the nodes (``not_ready`` wins: a
        checkpoint refused before it began is not a failure)."""
        results: dict[str, object] = {}
        errors: list[tuple[str, str]] = []

        async def one(node: str) -> None:
            try:
                results[node] = await self.call(node, op, **args)
            except RemoteError as exc:
                errors.append((exc.code, exc.message if node in exc.message else f"{node}: {exc.message}"))
            except Exception as exc:  # a bug or this node's own disk: still one clear error
                log.exception("%s on %s failed", op, node)
                errors.append(("internal", f"{node}: {type(exc).__name__}: {exc}"))

        async with trio.open_nursery() as nursery:
            for node in nodes:
                nursery.start_soon(one, node)
        if errors:
            codes = [code for code, _ in errors]
            code = "not_ready" if "not_ready" in codes else codes[0]
            raise RemoteError(code, "; ".join(sorted({m for _, m in errors})))
        return results

    async def on_job_nodes(self, record: dict, op: str, **args) -> dict[str, Any]:
        """Peer ``op`` on every node of the job (see :meth:`on_nodes`)."""
        return await self.on_nodes(jobs.nodes_of(record), op, **args)

    async def first_of(self, nodes: Iterable[str], op: str, *, code: str, empty: str, **args):
        """Peer ``op`` on each of ``nodes`` in turn until one answers; else one ``code`` error naming every failure."""
        errors = []
        for node in dict.fromkeys(nodes):
            try:
                return await self.call(node, op, **args)
            except RemoteError as exc:
                errors.append(exc.message)
        raise RemoteError(code, "; ".join(errors) or empty)

    async def checkpoint_env(self, lineage: int, placement: list[str], gen: int) -> dict[str, str]:
        """The saved environment of a generation, from the first of its nodes that has it."""
        return await self.first_of(placement, "ckpt_job_env", code="restart_failed", empty="the generation has no nodes", lineage=lineage, gen=gen)

    async def to_coordinator(self, op: str, **args):
        """Run ``op`` on the coordinator, riding out a coordinator change
        (an election takes up to the lease TTL when the coordinator died)."""
        membership = self.membership
        membership.refuse_if_isolated()
        patience = self.patience
        deadline = trio.current_time() + patience
        while True:
            leader = membership.coordinator()
            if leader is None:
                if trio.current_time() > deadline:
                    raise RemoteError("no_coordinator", f"the cluster has had no coordinator for {patience:g} s (see `gang nodes`)")
            else:
                try:
                    return await self.call(leader, op, **args)
                except RemoteError as exc:
                    if exc.code not in ("not_coordinator", "node_down", "disconnected") or trio.current_time() > deadline:
                        raise
            membership.refuse_if_isolated()
            await trio.sleep(0.1)
