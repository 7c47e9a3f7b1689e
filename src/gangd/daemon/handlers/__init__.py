"""The daemon's request handlers: thin, declared with ``@op`` (see :mod:`.registry`)."""

from . import ops_all  # noqa: F401 -- every handler module registers its operations
from .dispatch import Dispatcher, Services
from .registry import CLIENT, PEER, REGISTRY, Audience, Call, op

__all__ = ["CLIENT", "PEER", "REGISTRY", "Audience", "Call", "Dispatcher", "Services", "op"]
