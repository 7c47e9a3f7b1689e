"""Each node's lives in etcd: when it joined, when it left, and whether it left cleanly.

Why: the failure rate λ of a node (what the optimal checkpoint interval is
computed from, and what a scheduler shows its users about a node) has to
come from the cluster's own history, and that history must not depend on
which node happened to coordinate when a node was lost, nor vanish with
the node's disk. So every *life* of a node (one etcd session: one lease)
is a key of its own, written by the node when the session starts::

    PREFIX/lives/<node>/<started, ns since the epoch, 20 digits>
        {"lease": id, "started": t, "ended": t | None, "clean": bool | None, "reason": str}

A life ends in one of two ways:

* **clean** -- the daemon was stopped: it writes ``clean = True`` itself
  before giving its lease up;
* **lost** -- its lease expired (a crash, a stall, a partition): whoever
  sees it first closes it (the coordinator, when it sees the node's key go;
  else the node itself when its next life starts, dating the end at the
  start of the new life, or the next coordinator when it takes over).

Closing is a compare-and-swap on the key's revision, so a life is closed
once, by one writer, whatever races. A node keeps its newest ``KEEP_LIVES``
lives as keys; older ones are folded into ``PREFIX/lifesum/<node>`` (counts
and seconds) in the same transaction that deletes them, so the record is
bounded and nothing counted is lost.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import msgpack

from ...etcd.client import Compare, Etcd, EtcdError, KeyValue, Op
from .keys import Keys

log = logging.getLogger("gangd.nodelog")

#: Lives kept as keys per node; older ones are folded into the node's sums.
KEEP_LIVES = 64
#: Lives folded in one transaction (etcd takes at most 128 operations and comparisons).
FOLD_BATCH = 60
#: Largest value accepted back for a life or a sum (they are a few dozen bytes).
MAX_VALUE_BYTES = 4096


@dataclass(frozen=True)
class Life:
    key: bytes
    mod_revision: int
    lease: int
    started: float
    ended: float | None
    clean: bool | None
    reason: str

    @classmethod
    def from_kv(cls, kv: KeyValue) -> Life | None:
        """A life read back from etcd, or None if the value is not one (never trusted blindly)."""
        if len(kv.value) > MAX_VALUE_BYTES:
            return None
        try:
            d = msgpack.unpackb(kv.value, raw=False)
        except Exception:  # noqa: BLE001 -- a damaged value is skipped, not fatal
            return None
        if not isinstance(d, dict):
            return None
        lease, started, ended, clean, reason = d.get("lease"), d.get("started"), d.get("ended"), d.get("clean"), d.get("reason", "")
        if not isinstance(lease, int) or not isinstance(started, (int, float)) or not _number(started):
            return None
        if ended is not None and not (isinstance(ended, (int, float)) and _number(ended)):
            return None
        if clean is not None and not isinstance(clean, bool):
            return None
        return cls(kv.key, kv.mod_revision, lease, float(started), None if ended is None else float(ended), clean,
                   reason if isinstance(reason, str) else "")

    @property
    def lost(self) -> bool:
        return self.ended is not None and self.clean is False

    def seconds(self, now: float) -> float:
        return max(0.0, (self.ended if self.ended is not None else now) - self.started)


@dataclass(frozen=True)
class NodeHistory:
    """What the cluster knows of one node's reliability."""

    node: str
    first_seen: float | None
    lives: int
    losses: int
    exposure: float  # seconds the node was up, over every life counted
    last_loss: float | None
    last_reason: str

    @property
    def mtbf(self) -> float | None:
        """Mean time between losses, from this history alone (None before the first loss)."""
        return self.exposure / self.losses if self.losses else None

    def to_wire(self) -> dict:
        return {
            "node": self.node, "first_seen": self.first_seen, "lives": self.lives, "losses": self.losses,
            "exposure": round(self.exposure, 3), "last_loss": self.last_loss, "last_reason": self.last_reason,
            "mtbf": None if self.mtbf is None else round(self.mtbf, 3),
        }


def _number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x and 0 <= x < 1e11


def _pack(d: dict) -> bytes:
    return msgpack.packb(d, use_bin_type=True)


class NodeLog:
    def __init__(self, etcd: Etcd, keys: Keys):
        self.etcd = etcd
        self.keys = keys

    def _lives(self, node: str) -> str:
        return f"{self.keys.prefix}/lives/{node}/"

    def _sum(self, node: str) -> str:
        return f"{self.keys.prefix}/lifesum/{node}"

    async def lives(self, node: str) -> list[Life]:
        page = await self.etcd.range(self._lives(node), prefix=True)
        return [life for kv in page.kvs if (life := Life.from_kv(kv)) is not None]

    async def begin(self, node: str, lease: int, *, now: float | None = None) -> None:
        """A new life of ``node`` on ``lease``; an earlier life still open was lost (its lease is gone)."""
        now = time.time() if now is None else now
        for life in await self.lives(node):
            if life.ended is None and life.lease != lease:
                await self.close(life, clean=False, at=now, reason="the node came back: its previous session ended without a clean stop", own=True)
        key = f"{self._lives(node)}{int(now * 1e9):020d}"
        await self.etcd.put(key, _pack({"lease": lease, "started": now, "ended": None, "clean": None, "reason": ""}))
        await self._fold(node, now)

    async def close(self, life: Life, *, clean: bool, at: float | None = None, reason: str = "", own: bool = False) -> bool:
        """End ``life`` once (compare-and-swap on its revision); False if
        someone else ended it first, or (a loss seen from elsewhere) if the
        node is still alive on that life's lease. ``own``: the node itself
        closes a life of its own, which it knows is over."""
        if life.ended is not None:
            return False
        at = time.time() if at is None else at
        value = _pack({"lease": life.lease, "started": life.started, "ended": max(at, life.started), "clean": clean, "reason": reason[:500]})
        compares = [Compare.mod_revision(life.key) == life.mod_revision]
        node = self._node_of(life.key)
        if not clean and not own and node is not None:
            # Lost only if the node's key is not alive on that life's lease
            # (gone, or on a newer lease): a lagging observer -- a deposed
            # coordinator, a stale sweep -- cannot close a live node's life.
            compares.append(Compare.lease(self.keys.node(node)) != life.lease)
            # Nor while the lease itself lives: a node begins its life before
            # it puts its key (it reads the job table in between), and a new
            # coordinator's sweep in that gap saw no key and counted a loss.
            if await self.etcd.lease_ttl(life.lease) >= 0:
                return False
        result = await self.etcd.txn(compares, [Op.put(life.key, value)])
        if result.succeeded and not clean:
            log.warning("recorded the loss of a node (lease %x): %s", life.lease, reason)
        return result.succeeded

    async def end(self, node: str, lease: int, *, clean: bool, reason: str, at: float | None = None) -> None:
        """End the open life of ``node`` on ``lease`` (no-op if there is none or it is already ended)."""
        for life in await self.lives(node):
            if life.lease == lease and life.ended is None:
                await self.close(life, clean=clean, at=at, reason=reason)

    async def sweep(self, alive: dict[str, int], *, now: float | None = None) -> None:
        """Close every open life whose lease is not the node's live one (``alive``: node -> lease)."""
        now = time.time() if now is None else now
        page = await self.etcd.range(f"{self.keys.prefix}/lives/", prefix=True)
        for kv in page.kvs:
            life = Life.from_kv(kv)
            if life is None or life.ended is not None:
                continue
            node = self._node_of(kv.key)
            if node is not None and alive.get(node) != life.lease:
                await self.close(life, clean=False, at=now, reason="its lease in etcd expired while no coordinator was watching")

    def _node_of(self, key: bytes) -> str | None:
        text = key.decode("utf-8", "replace")[len(f"{self.keys.prefix}/lives/"):]
        node, _, _ = text.partition("/")
        return node or None

    async def _fold(self, node: str, now: float) -> None:
        """Keep the newest KEEP_LIVES ended lives as keys; fold the rest into the node's sums, atomically."""
        lives = await self.lives(node)
        old = [life for life in lives[:-KEEP_LIVES] if life.ended is not None][:FOLD_BATCH]
        if not old:
            return
        sum_kv = await self.etcd.get(self._sum(node))
        totals = _sums(sum_kv)
        totals["lives"] += len(old)
        totals["losses"] += sum(1 for life in old if life.lost)
        totals["exposure"] += sum(life.seconds(now) for life in old)
        totals["first_seen"] = min([old[0].started] + ([totals["first_seen"]] if totals["first_seen"] is not None else []))
        last = [life for life in old if life.lost]
        if last and (totals["last_loss"] is None or last[-1].ended > totals["last_loss"]):
            totals["last_loss"], totals["last_reason"] = last[-1].ended, last[-1].reason
        compares = [Compare.mod_revision(life.key) == life.mod_revision for life in old]
        compares.append(Compare.mod_revision(self._sum(node)) == (sum_kv.mod_revision if sum_kv else 0))
        ops = [Op.delete(life.key) for life in old] + [Op.put(self._sum(node), _pack(totals))]
        try:
            await self.etcd.txn(compares, ops)
        except EtcdError as exc:  # folding is housekeeping: the next life tries again
            log.info("folding %s's old lives: %s", node, exc.message)

    async def histories(self, nodes: list[str], *, now: float | None = None) -> dict[str, NodeHistory]:
        """Every named node's history, in two range reads whatever the cluster's size."""
        now = time.time() if now is None else now
        sums = await self.etcd.range(f"{self.keys.prefix}/lifesum/", prefix=True)
        page = await self.etcd.range(f"{self.keys.prefix}/lives/", prefix=True)
        totals = {kv.key.decode("utf-8", "replace").rsplit("/", 1)[-1]: _sums(kv) for kv in sums.kvs}
        lives: dict[str, list[Life]] = {}
        for kv in page.kvs:
            node, life = self._node_of(kv.key), Life.from_kv(kv)
            if node is not None and life is not None:
                lives.setdefault(node, []).append(life)
        return {n: _history(n, totals.get(n, _sums(None)), lives.get(n, []), now) for n in nodes}

    async def history(self, node: str, *, now: float | None = None) -> NodeHistory:
        now = time.time() if now is None else now
        return _history(node, _sums(await self.etcd.get(self._sum(node))), await self.lives(node), now)


def _history(node: str, totals: dict, lives: list[Life], now: float) -> NodeHistory:
    losses = [life for life in lives if life.lost]
    first = [t for t in ([totals["first_seen"]] + [life.started for life in lives[:1]]) if t is not None]
    last_loss, last_reason = totals["last_loss"], totals["last_reason"]
    if losses:
        last_loss, last_reason = losses[-1].ended, losses[-1].reason
    return NodeHistory(
        node=node, first_seen=min(first) if first else None, lives=totals["lives"] + len(lives),
        losses=totals["losses"] + len(losses), exposure=totals["exposure"] + sum(life.seconds(now) for life in lives),
        last_loss=last_loss, last_reason=last_reason,
    )


def _sums(kv: KeyValue | None) -> dict:
    blank = {"lives": 0, "losses": 0, "exposure": 0.0, "first_seen": None, "last_loss": None, "last_reason": ""}
    if kv is None or len(kv.value) > MAX_VALUE_BYTES:
        return blank
    try:
        d = msgpack.unpackb(kv.value, raw=False)
    except Exception:  # noqa: BLE001
        return blank
    if not isinstance(d, dict):
        return blank
    out = dict(blank)
    for k in ("lives", "losses"):
        if isinstance(d.get(k), int) and not isinstance(d.get(k), bool) and d[k] >= 0:
            out[k] = d[k]
    for k in ("exposure", "first_seen", "last_loss"):
        if _number(d.get(k)):
            out[k] = float(d[k])
    if isinstance(d.get("last_reason"), str):
        out["last_reason"] = d["last_reason"][:500]
    return out
