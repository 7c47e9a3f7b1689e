"""A node reports why a restore failed before it reports the exit of the rank that failed.

A rank that cannot restore its state says so on its checkpoint connection
(``ckpt_restored`` with the error) and exits. A loaded node may see the
exit (the rank's pidfd) before it has read those last bytes; reported
first, the exit would end the job FAILED with "exit 1", and a job a
recovery started would not be recovered again from an older generation
(issue 16). The node therefore holds the exits of a job being restored
until the exited rank's connection has been read to its end, and then, if
a rank said the restore failed, until the coordinator has answered that.

Which of two ready file descriptors trio serves first cannot be forced from
outside a daemon, so this drives :class:`gangd.daemon.checkpoint.NodeCheckpoints`
itself, in that order: the exit, then the note, then the connection's end.
Everything else (the real ranks, the coordinator's side) is
tests/test_restart21.py.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import trio

from gangd.daemon.checkpoint import NodeCheckpoints, RankAgent


class Coordinator:
    """What the node's reports reach: each in order."""

    def __init__(self):
        self.heard: list[tuple] = []
        self.first = trio.Event()

    async def to_coordinator(self, op: str, **args):
        self.heard.append((op, args.get("job"), args.get("error")))
        self.first.set()
        return True


def node_for(tmp_path, coordinator=None, spawn=None) -> NodeCheckpoints:
    """A node's checkpoint part, given only what the restore's reports use (the rest is never reached)."""
    return NodeCheckpoints(node="n1", calls=coordinator, spawn=spawn, jobnet=SimpleNamespace(states={}),
                           config=SimpleNamespace(checkpoint_root=tmp_path, checkpoint_max_rank_bytes=1 << 30, checkpoint_timeout=600.0),
                           table=None, peers=None, secret=b"", job_env=lambda _job: {})


def restoring(node: NodeCheckpoints, job: int, ranks: list[int]) -> dict[int, SimpleNamespace]:
    """``job`` being restored on ``node``, each rank attached: their checkpoint connections."""
    node.restarts[job] = {"gen": 3, "ranks": ranks, "failed": None, "restored": set(), "heard": trio.Event()}
    channels = {rank: SimpleNamespace(closed=False, context={"ckpt_of": (job, rank)}) for rank in ranks}
    for rank, channel in channels.items():
        node.agents[(job, rank)] = RankAgent(job, rank, 0, os.open(os.devnull, os.O_RDONLY), channel)
    return channels


async def test_a_failed_restore_is_reported_before_the_exit_of_the_rank_that_said_so(tmp_path):
    coordinator = Coordinator()
    async with trio.open_nursery() as nursery:
        node = node_for(tmp_path, coordinator, nursery.start_soon)
        channels = restoring(node, 7, [0, 1])

        node.rank_exited(7, 0, "rank 0 on n1 exit 1")  # seen first; its note is still unread
        assert node.exits_held(7)
        delivered = trio.Event()

        async def deliver():
            await node.exits_after_report(7)
            coordinator.heard.append(("exits", 7, None))
            delivered.set()

        nursery.start_soon(deliver)
        await trio.sleep(0.1)
        assert not delivered.is_set()  # (the connection has not been read to its end)
        node.on_note(channels[0], "ckpt_restored", {"gen": 3, "error": "cannot restore rank 0: damaged"})
        channels[0].closed = True
        node.detached(channels[0])
        with trio.fail_after(10):
            await delivered.wait()
        assert [h[0] for h in coordinator.heard][:2] == ["coord_ckpt_restored", "exits"], coordinator.heard
        assert "damaged" in coordinator.heard[0][2]
        nursery.cancel_scope.cancel()  # (the node repeats its report until the gates open: not here)


async def test_an_exit_waits_only_a_moment_for_a_connection_that_does_not_end(tmp_path, monkeypatch):
    """A snapshot child the rank forked can hold its connection open: the exit is reported after the grace anyway."""
    monkeypatch.setattr("gangd.daemon.checkpoint.EXIT_REPORT_GRACE", 0.3)
    async with trio.open_nursery() as nursery:
        node = node_for(tmp_path, Coordinator(), nursery.start_soon)
        restoring(node, 7, [0])
        node.rank_exited(7, 0, "rank 0 on n1 exit 1")
        with trio.fail_after(5):
            await node.exits_after_report(7)
        assert not node.exits_held(7)  # (forgotten: later exits of the job are not held)
        nursery.cancel_scope.cancel()


def test_exits_of_a_job_not_being_restored_are_not_held(tmp_path):
    node = node_for(tmp_path)
    restoring(node, 8, [0])
    node.restarts.pop(8)  # (a job that is running, not being restored)
    node.rank_exited(8, 0, "rank 0 on n1 exit 1")
    assert not node.exits_held(8)


async def test_a_rank_that_restored_and_exited_at_once_counts_as_restored(tmp_path):
    """Its note that it restored may be read after its exit (its agent dropped by then): the node still reports the restore."""
    coordinator = Coordinator()
    async with trio.open_nursery() as nursery:
        node = node_for(tmp_path, coordinator, nursery.start_soon)
        channel = restoring(node, 7, [0])[0]
        node.rank_exited(7, 0, "rank 0 on n1 exit 0")
        node.on_note(channel, "ckpt_restored", {"gen": 3})
        node.detached(channel)
        with trio.fail_after(10):
            await coordinator.first.wait()
        assert coordinator.heard[0] == ("coord_ckpt_restored", 7, None), coordinator.heard
        nursery.cancel_scope.cancel()


async def test_each_exit_waits_for_its_own_rank_s_connection(tmp_path, monkeypatch):
    """Two ranks exit a moment apart: the first one's wait ending (its connection held open past the
    grace) does not drop the second one's, whose note is then still heard before its exit."""
    monkeypatch.setattr("gangd.daemon.checkpoint.EXIT_REPORT_GRACE", 0.5)
    coordinator = Coordinator()
    async with trio.open_nursery() as nursery:
        node = node_for(tmp_path, coordinator, nursery.start_soon)
        channels = restoring(node, 7, [0, 1])
        order: list[str] = []
        both = trio.Event()

        async def deliver(rank):
            await node.exits_after_report(7)
            order.append(f"exit {rank}")
            if len(order) == 2:
                both.set()

        node.rank_exited(7, 0, "rank 0 on n1 exit 1")  # (its connection never ends: a child holds it)
        nursery.start_soon(deliver, 0)
        await trio.sleep(0.45)
        node.rank_exited(7, 1, "rank 1 on n1 exit 1")
        await trio.sleep(0.1)  # (rank 0's wait is over before rank 1's exit is taken up)
        nursery.start_soon(deliver, 1)
        await trio.sleep(0.1)
        assert order == ["exit 0"], order
        node.on_note(channels[1], "ckpt_restored", {"gen": 3, "error": "cannot restore rank 1: damaged"})
        node.detached(channels[1])
        with trio.fail_after(10):
            await both.wait()
        assert coordinator.heard and coordinator.heard[0][0] == "coord_ckpt_restored", coordinator.heard
        nursery.cancel_scope.cancel()


def test_a_job_that_ends_or_opens_its_gates_stops_holding_exits(tmp_path):
    node = node_for(tmp_path, spawn=lambda *a: None)
    for job in (7, 8):
        restoring(node, job, [0])
        node.rank_exited(job, 0, "rank 0 on n1 exit 1")
        assert node.exits_held(job)
    node.forget(7)
    trio.run(node.open_restarted, {"job": 8})
    assert not node.exits_held(7) and not node.exits_held(8)
