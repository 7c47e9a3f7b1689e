"""Imports every handler module, so each registers its operations."""

from . import checkpoint, coord, jobs, net, node  # noqa: F401
