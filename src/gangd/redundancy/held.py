"""Whether this node holds its share of a generation's redundancy.

A generation is *protected* when every node of the job holds its share
(the coordinator collects the answers; this is one node's). A share is
whole only when its last file landed: a partner copy's MANIFEST (written
after every file, :func:`gangd.redundancy.transfer.fetch_generation`), an
XOR member's ``xor.meta`` (written after its parity,
:func:`gangd.redundancy.xor.write_parity`). A redundancy write that died
halfway leaves neither, so the generation stays *complete*, never protected.
"""

from __future__ import annotations

from pathlib import Path

from .. import ckptstore
from ..ckptstore import StoreError
from . import transfer, xor
from .plan import Plan


def missing(gen_dir: Path, plan: Plan, node: str) -> str | None:
    """None if ``node`` (this node, whose generation is ``gen_dir``) holds its
    share of ``plan``'s redundancy; otherwise a sentence saying what is missing."""
    gen_dir = Path(gen_dir)
    if plan.level == "local":
        return None
    if plan.level == "partner":
        source = plan.partnered_by(node)
        copy = gen_dir / transfer.partner_prefix(source)
        try:
            manifest = ckptstore.read_manifest(copy)
        except StoreError as exc:
            return f"node {node} holds no whole copy of node {source}'s files: {exc}"
        if manifest.node != source:
            return f"{copy} is node {manifest.node}'s, not node {source}'s"
        return None
    try:
        meta = xor.read_meta(gen_dir)
    except StoreError as exc:
        return f"node {node} holds no XOR parity: {exc}"
    members = plan.set_of(node)
    if meta.nodes != members or meta.nodes[meta.index] != node:
        return f"node {node}'s XOR parity is of the set {', '.join(meta.nodes)}, not {', '.join(members)}"
    return None
