"""The operations a daemon serves, by name: ``@op("kill", audience=CLIENT)``.

Each operation is declared once, next to its handler, with who may call it
(``CLIENT``: a local user over the Unix socket, identified by the kernel;
``PEER``: another daemon over authenticated TCP) and whether it is
*fenced* (only the coordinator commands it, and the request carries the
coordinator's term, which the node checks before the handler runs: see
:meth:`gangd.daemon.controlplane.ControlPlane.check_term`). A handler is
thin: it turns the wire's arguments into typed values (refusing bad ones
with ``bad_request``), calls the domain, and encodes the reply.
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any


class Audience(enum.Enum):
    CLIENT = "client"
    PEER = "peer"


CLIENT = Audience.CLIENT
PEER = Audience.PEER


@dataclass(frozen=True)
class Call:
    """One request as its handler sees it."""

    args: dict
    #: A local client's credentials (the kernel's uid, gid, and the user's name); None from a peer.
    cred: dict | None = None
    #: The calling node (this node's own name for a local call); None from a client.
    from_node: str | None = None
    #: The connection it came on (None for a local call), for streams and rank state.
    channel: Any = None

    @property
    def user(self) -> dict:
        """The client's credentials (client operations only)."""
        if self.cred is None:
            raise RuntimeError("a client operation called without credentials")
        return self.cred


Handler = Callable[[Any, Call], Awaitable[Any]]


@dataclass(frozen=True)
class Op:
    name: str
    audience: Audience
    fenced: bool
    handler: Handler


class Registry:
    def __init__(self) -> None:
        self.ops: dict[str, Op] = {}

    def op(self, name: str, *, audience: Audience, fenced: bool = False) -> Callable[[Handler], Handler]:
        """Declare ``name`` as served by the decorated ``async def handler(services, call)``."""
        if fenced and audience is not PEER:
            raise ValueError(f"{name}: only peer operations are fenced")

        def register(handler: Handler) -> Handler:
            if name in self.ops:
                raise ValueError(f"operation {name!r} declared twice")
            self.ops[name] = Op(name, audience, fenced, handler)
            return handler

        return register

    def get(self, name: str) -> Op | None:
        return self.ops.get(name)

    def names(self, audience: Audience) -> frozenset[str]:
        return frozenset(n for n, o in self.ops.items() if o.audience is audience)

    def fenced(self) -> frozenset[str]:
        return frozenset(n for n, o in self.ops.items() if o.fenced)


#: Every operation of the daemon (the handler modules register theirs on import).
REGISTRY = Registry()
op = REGISTRY.op
