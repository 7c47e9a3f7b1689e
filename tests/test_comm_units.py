"""Tests of gangd.comm, the job-side messaging library, against a stand-in for the daemon.

The ranks are real processes (tests/comm_worker.py) talking over real Unix
and TCP sockets. The node daemon's side of ``comm_attach`` (rendezvous,
gate notes, peer exits, capture) is played by :class:`FakeDaemon`: a
blocking Unix-socket server speaking gangd's protocol from threads. Ranks on
different "nodes" (GANGD_NODE) talk over TCP on 127.0.0.1, ranks on the same
one over AF_UNIX.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest

from gangd.comm import wire
from gangd.protocol import Connection, Note, Ready, Reply, Request, Role

WORKER = str(Path(__file__).with_name("comm_worker.py"))
TIMEOUT = 20  # a bug must fail a test, never hang it


class _RankLink:
    """The fake daemon's end of one rank's control connection."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.conn = Connection(dialer=False, node="fake", accept=frozenset({Role.CLIENT}))
        self.write_lock = threading.Lock()
        self.rank: int | None = None
        self.args: dict = {}
        self.attach_id: int | None = None

    def write(self, data: bytes) -> None:
        if data:
            with self.write_lock:
                self.sock.sendall(data)


class FakeDaemon:
    """Plays the node daemons for one job: answers comm_attach once all ranks attached, then
    sends gate / peer_exited notes and capture requests when the test says so."""

    def __init__(self, tmp: Path, nodes: list[str], *, contexts: dict | None = None, refuse: tuple | None = None, with_reply: tuple | None = None):
        self.nodes = nodes
        self.with_reply = with_reply  # (op, args): a note written with the attach reply, in one write
        self.size = len(nodes)
        self.token = "job-token-123"
        self.epoch = 0
        self.gate_open = True
        self.contexts = contexts or {}
        self.refuse = refuse
        self.comm_dir = tmp / "comm"
        self.comm_dir.mkdir(mode=0o700)
        self.path = str(tmp / "gangd.sock")
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(self.path)
        self.listener.listen(64)
        self.cond = threading.Condition()
        self.links: dict[int, _RankLink] = {}
        self.acks: dict[int, list[int]] = {}
        self.replies: dict[tuple[int, int], Reply] = {}
        self.procs: list[subprocess.Popen] = []
        threading.Thread(target=self._accept_loop, daemon=True).start()

    # ------------------------------------------------------------ serving

    def _accept_loop(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(_RankLink(sock),), daemon=True).start()

    def _serve(self, link: _RankLink) -> None:
        try:
            while data := link.sock.recv(1 << 20):
                link.conn.receive_data(data)
                while (event := link.conn.next_event()) is not None:
                    link.write(link.conn.data_to_send())
                    self._handle(link, event)
                link.write(link.conn.data_to_send())
        except OSError:
            pass

    def _handle(self, link: _RankLink, event) -> None:
        if isinstance(event, Ready):
            return
        with self.cond:
            if isinstance(event, Request) and event.op == "comm_attach":
                if self.refuse:
                    link.write(link.conn.send_error(event.id, *self.refuse))
                    return
                link.rank, link.args, link.attach_id = event.args["rank"], event.args, event.id
                self.links[link.rank] = link
                if len(self.links) == self.size:
                    self._answer_attach()
            elif isinstance(event, Note) and event.op == "gate_closed":
                self.acks.setdefault(link.rank, []).append(event.args["epoch"])
            elif isinstance(event, Reply):
                self.replies[(link.rank, event.id)] = event
            self.cond.notify_all()

    def _answer_attach(self) -> None:
        peers = [{"node": self.nodes[r], "unix": self.links[r].args["unix"], "tcp": self.links[r].args["tcp"]} for r in range(self.size)]
        for rank, link in self.links.items():
            result = {
                "peers": peers,
                "token": self.token,
                "gate": {"open": self.gate_open, "epoch": self.epoch},
                "context": self.contexts.get(rank),
            }
            frame = link.conn.send_reply(link.attach_id, result)
            if self.with_reply:
                frame += link.conn.send_note(*self.with_reply)
            link.write(frame)

    # ------------------------------------------------------------ what the test does

    def spawn(self, scenario: str, *args, stdin: bool = False, env: dict | None = None) -> list[subprocess.Popen]:
        base = {k: v for k, v in os.environ.items() if not k.startswith("GANGD_")} | (env or {})
        for rank, node in enumerate(self.nodes):
            env = dict(
                base,
                GANGD_JOB="1",
                GANGD_RANK=str(rank),
                GANGD_SIZE=str(self.size),
                GANGD_NODE=node,
                GANGD_SOCKET=self.path,
                GANGD_COMM_DIR=str(self.comm_dir),
                GANGD_ADDRESS="127.0.0.1",
            )
            self.procs.append(
                subprocess.Popen(
                    [sys.executable, WORKER, scenario, *map(str, args)],
                    env=env,
                    stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
        return self.procs

    def wait_attached(self) -> None:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.links) == self.size, TIMEOUT), "not every rank attached"

    def note(self, to: int, op: str, **args) -> None:
        link = self.links[to]
        link.write(link.conn.send_note(op, args))

    def gate(self, open_: bool, ranks=None) -> int:
        self.epoch += 1
        for rank in self.links if ranks is None else ranks:
            self.note(rank, "gate", open=open_, epoch=self.epoch)
        return self.epoch

    def wait_acks(self, epoch: int, ranks, timeout: float) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: all(max(self.acks.get(r, [0])) >= epoch for r in ranks), timeout)

    def request(self, rank: int, op: str, **args) -> int:
        link = self.links[rank]
        rid, frame = link.conn.send_request(op, args)
        link.write(frame)
        return rid

    def wait_reply(self, rank: int, rid: int, timeout: float = TIMEOUT) -> Reply:
        with self.cond:
            assert self.cond.wait_for(lambda: (rank, rid) in self.replies, timeout), f"rank {rank} never answered"
            return self.replies[(rank, rid)]

    def counters(self, rank: int) -> np.ndarray:
        return np.fromfile(self.comm_dir / f"rank-{rank}.counters", dtype=np.uint64).reshape(3, self.size)

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        self.listener.close()
        for link in self.links.values():
            link.sock.close()


@pytest.fixture
def daemon_factory(tmp_path):
    made = []

    def make(nodes, **kwargs) -> FakeDaemon:
        directory = tmp_path / f"d{len(made)}"
        directory.mkdir()
        daemon = FakeDaemon(directory, nodes, **kwargs)
        made.append(daemon)
        return daemon

    yield make
    for daemon in made:
        daemon.close()


def readline(proc: subprocess.Popen, expect: str) -> str:
    """The next stdout line of a rank (which must start with ``expect``), without hanging."""
    box = []
    reader = threading.Thread(target=lambda: box.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(TIMEOUT)
    line = box[0] if box else ""
    assert line.startswith(expect), f"expected {expect!r} from the rank, got {line!r}; stderr: {_stderr(proc)}"
    return line.strip()


def _stderr(proc: subprocess.Popen) -> str:
    if proc.poll() is None:
        return "(still running)"
    return proc.stderr.read()[-3000:]


def finish(procs, timeout: float = TIMEOUT, codes=None) -> list[dict]:
    """Wait for the ranks; their RESULT dicts, after checking the exit codes."""
    results = []
    deadline = time.monotonic() + timeout
    for rank, proc in enumerate(procs):
        try:
            out, err = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            out, err = proc.communicate()
            raise AssertionError(f"rank {rank} hung; stdout {out[-2000:]!r}; stderr {err[-3000:]}") from None
        want = 0 if codes is None else codes[rank]
        assert proc.returncode == want, f"rank {rank} exited {proc.returncode}, not {want}:\n{err[-3000:]}"
        found = [json.loads(line[7:]) for line in out.splitlines() if line.startswith("RESULT ")]
        results.append(found[-1] if found else None)
    return results


# ====================================================================== data path


def test_ordering_and_exactly_once_across_unix_and_tcp(daemon_factory):
    # Ranks 0,1 on node a and 2,3 on node b: both transports, 12 channels of
    # random kinds and sizes up to 4 MiB, received by ANY source and per source.
    daemon = daemon_factory(["a", "a", "b", "b"])
    count = 12
    results = finish(daemon.spawn("ordering", count), timeout=60)
    for rank, res in enumerate(results):
        others = [r for r in range(4) if r != rank]
        assert res["received"] == {str(r): count for r in others}
        counters = daemon.counters(rank)
        # every message sent, received and delivered exactly once (barrier messages included)
        assert counters.tolist() == [res["counters"]["sent"], res["counters"]["received"], res["counters"]["delivered"]]
        assert all(counters[0][r] >= count for r in others) and counters[0][rank] == 0
        assert (counters[1] == counters[2]).all()
    for src in range(4):
        for dst in range(4):
            assert daemon.counters(src)[0][dst] == daemon.counters(dst)[1][src]


def test_capture_under_live_traffic(daemon_factory):
    # While four ranks exchange random messages, the daemon repeatedly closes
    # the gate, waits for every rank to confirm, captures and reopens: each
    # capture must drain exactly what the counters say was sent, and the
    # traffic must go on undisturbed.
    daemon = daemon_factory(["a", "a", "b", "b"])
    procs = daemon.spawn("ordering", 16, "linger", stdin=True)
    daemon.wait_attached()
    for _ in range(4):
        time.sleep(0.05)
        epoch = daemon.gate(False)
        assert daemon.wait_acks(epoch, range(4), timeout=TIMEOUT), f"acks: {daemon.acks}"
        sent = [daemon.counters(r)[0] for r in range(4)]
        expect = {r: [int(sent[src][r]) for src in range(4)] for r in range(4)}
        rids = {r: daemon.request(r, "capture", expect=expect[r]) for r in range(4)}
        for rank, rid in rids.items():
            reply = daemon.wait_reply(rank, rid)
            assert reply.ok, reply.error
            ctx = msgpack.unpackb(reply.result["context"], raw=False)
            assert ctx["received"] == expect[rank]
            assert len(ctx["messages"]) == sum(ctx["received"]) - sum(ctx["delivered"])
        daemon.gate(True)
    for proc in procs:
        proc.stdin.write("exit\n")
        proc.stdin.flush()
    for res in finish(procs, timeout=60):
        assert sorted(res["received"].values()) == [16, 16, 16]


def test_arrays_objects_and_recv_into_round_trip(daemon_factory):
    daemon = daemon_factory(["a", "a"])
    results = finish(daemon.spawn("arrays"))
    assert results[0]["cases"] > 20
    st1, st2, st3, st4, errors = results[1]["statuses"]
    assert st1 == [0, 1, 8 << 20] and st2 == [0, 2, 12] and st3 == [0, 6, 10] and st4 == [0, 7, 10]
    assert "80 bytes" in errors[0] and "only 32" in errors[0]
    assert "pickled object" in errors[1]


@pytest.mark.parametrize(("gate", "spin"), [("1", "50"), ("0", "0")])
def test_large_messages_both_ways_do_not_deadlock(daemon_factory, gate, spin):
    # GANGD_COMM_GATE=0 compiles the gate out (the other send function), GANGD_COMM_SPIN_US=0
    # makes receives sleep at once: same results.
    daemon = daemon_factory(["a", "b"])
    env = {"GANGD_COMM_GATE": gate, "GANGD_COMM_SPIN_US": spin}
    assert finish(daemon.spawn("bidir", env=env)) == [{"ok": True, "gated": gate == "1"}] * 2


def test_collectives(daemon_factory):
    daemon = daemon_factory(["a", "a", "b", "b", "b"])
    results = finish(daemon.spawn("collectives"))
    for k in range(3):  # nobody leaves a barrier before everybody entered it
        assert min(r["left"][k] for r in results) >= max(r["entered"][k] for r in results)
    expected_bcasts = [{"root": root, "data": list(range(root + 3))} for root in range(5)]
    for res in results:
        assert res["bcasts"] == expected_bcasts
        assert res["unchanged"]
        # identical results on every rank, bit for bit
        assert res["reductions"] == results[0]["reductions"]
        assert res["user"] == ["user", 0, 9] and res["tree"] == "tree"
    red = results[0]["reductions"]
    assert [red[op][2] for op in ("sum", "prod", "min", "max")] == [15, 120, 1, 5]
    assert [red[op][3] for op in ("sum", "prod", "min", "max")] == [5.0, 0.0, 0.0, 2.0]


# ====================================================================== the daemon's controls


def test_a_note_that_arrives_with_the_attach_reply_is_applied(daemon_factory):
    """The daemon opens a gate the attach reply said was closed, and the note
    comes in the same read as the reply: the ranks must see it at once (it
    was left in the link's buffer until the next note, so a restarted job,
    whose gate opens right after its ranks attach, could hang)."""
    daemon = daemon_factory(["a", "b"], with_reply=("gate", {"open": True, "epoch": 2}))
    daemon.gate_open, daemon.epoch = False, 1
    results = finish(daemon.spawn("arrays"))
    assert results[0]["cases"] > 20


def test_the_link_hands_over_what_came_around_a_reply():
    """DaemonLink.request keeps what arrives before the reply, and what comes
    in the same read after it stays in the protocol machine: take_pending
    returns both, in order, once."""
    from gangd.comm.control import DaemonLink

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "d.sock")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(path)
        listener.listen(1)

        def serve():
            sock, _ = listener.accept()
            conn = Connection(dialer=False, node="fake", accept=frozenset({Role.CLIENT}))
            while True:
                conn.receive_data(sock.recv(65536))
                sock.sendall(conn.data_to_send())
                while (event := conn.next_event()) is not None:
                    if isinstance(event, Request):
                        sock.sendall(conn.send_note("before", {"n": 1}) + conn.send_reply(event.id, "ok") + conn.send_note("after", {"n": 2}))
                        time.sleep(5)  # (keeps the socket open; nothing else comes)
                        return
                sock.sendall(conn.data_to_send())

        threading.Thread(target=serve, daemon=True).start()
        link = DaemonLink(path, "test")
        assert link.request("x", {}) == "ok"
        pending = link.take_pending()
        assert [(e.op, e.args) for e in pending] == [("before", {"n": 1}), ("after", {"n": 2})]
        assert link.take_pending() == []
        link.close()
        listener.close()


def test_gate_waits_for_the_send_under_way_and_blocks_new_sends(daemon_factory):
    daemon = daemon_factory(["a", "a"])
    procs = daemon.spawn("gate", stdin=True)
    readline(procs[1], "ready")
    readline(procs[0], "sending")
    time.sleep(0.3)
    assert daemon.counters(0)[0][1] == 0  # 32 MiB still under way: rank 1 is not reading
    epoch = daemon.gate(False, ranks=[0])
    # No confirmation while the send is under way.
    assert not daemon.wait_acks(epoch, [0], timeout=0.7)
    procs[1].stdin.write("recv\n")
    procs[1].stdin.flush()
    assert daemon.wait_acks(epoch, [0], timeout=TIMEOUT)
    acked = time.monotonic()
    assert daemon.counters(0)[0][1] == 1  # confirmed only once the message was all handed over
    receiving = float(readline(procs[1], "receiving").split()[1])
    sent1 = float(readline(procs[0], "sent1").split()[1])
    assert receiving < acked and receiving < sent1
    # The next send started after the close: it waits for the gate to open.
    time.sleep(0.5)
    assert daemon.counters(0)[0][1] == 1 and procs[0].poll() is None
    opened = time.monotonic()
    daemon.gate(True, ranks=[0])
    sent2 = float(readline(procs[0], "sent2").split()[1])
    assert sent2 >= opened
    finish(procs)


def _capture_all(daemon, sent: dict) -> dict:
    """Every rank's network context (the gate closed, ``sent``: each rank's sent counters)."""
    ranks = range(len(sent))
    rids = {r: daemon.request(r, "capture", expect=[int(sent[src][r]) for src in ranks]) for r in ranks}
    contexts = {}
    for rank, rid in rids.items():
        reply = daemon.wait_reply(rank, rid)
        assert reply.ok, reply.error
        contexts[rank] = reply.result["context"]
    return contexts


def test_capture_returns_undelivered_messages_and_restore_delivers_them(daemon_factory):
    # Ranks 0 and 2 (node b: TCP) send rank 1 six messages each, 6 MiB ones
    # among them; rank 1 takes the first of each and goes on "computing".
    # Closing the gate must still let the big sends finish (rank 1's control
    # thread drains), and the capture must hold exactly the other ten.
    nodes = ["a", "a", "b"]
    daemon = daemon_factory(nodes)
    procs = daemon.spawn("capture", stdin=True)
    readline(procs[1], "ready")
    time.sleep(0.2)
    epoch = daemon.gate(False)
    assert daemon.wait_acks(epoch, range(3), timeout=TIMEOUT), f"acks: {daemon.acks}"
    readline(procs[0], "sent")
    readline(procs[2], "sent")
    sent = {r: daemon.counters(r)[0] for r in range(3)}
    assert sent[0].tolist() == [0, 6, 0] and sent[2].tolist() == [0, 6, 0]
    contexts = _capture_all(daemon, sent)
    ctx = msgpack.unpackb(contexts[1], raw=False)
    assert (ctx["v"], ctx["rank"], ctx["size"]) == (1, 1, 3)
    assert ctx["received"] == [6, 0, 6] and ctx["delivered"] == [1, 0, 1] and ctx["sent"] == [0, 0, 0]
    messages = ctx["messages"]
    assert sorted((m[0], m[2]) for m in messages) == [(src, seq) for src in (0, 2) for seq in range(1, 6)]
    for src in (0, 2):
        from_src = [m for m in messages if m[0] == src]
        assert [m[2] for m in from_src] == [1, 2, 3, 4, 5]  # arrival order within a channel
        assert [m[1] for m in from_src] == [1, 2, 3, 4, 5]
        kinds = [m[3] for m in from_src]
        assert kinds == [wire.NDARRAY, wire.PICKLE, wire.BYTEARRAY, wire.NDARRAY, wire.NDARRAY]
        assert len(from_src[4][5]) == 6 << 20
    for rank in (0, 2):
        other = msgpack.unpackb(contexts[rank], raw=False)
        assert other["sent"] == [0, 6, 0] and other["messages"] == []
    for proc in procs:
        proc.send_signal(signal.SIGKILL)
        proc.wait()

    # A restarted job gets the contexts back at attach.
    again = daemon_factory(nodes, contexts=contexts)
    results = finish(again.spawn("restored"))
    assert results[1]["order"] == [[m[0], m[1]] for m in messages]
    assert results[1]["counters"]["received"][0] >= 7 and results[1]["counters"]["delivered"][0] >= 7
    assert results[0]["counters"]["sent"][1] >= 7


def test_a_message_taken_by_tag_before_earlier_ones_still_restores(daemon_factory):
    # Rank 1 takes rank 0's tag-4 message before its tags 1-3 (by tag, as MPI
    # allows): the undelivered messages from rank 0 are then seqs 1, 2, 3 and 5,
    # not a run from `delivered` on. The restore took that for a damaged context
    # and refused it, so such a job's checkpoint could never be restarted.
    nodes = ["a", "a", "b"]
    daemon = daemon_factory(nodes)
    procs = daemon.spawn("capture", "out-of-order", stdin=True)
    readline(procs[1], "ready")
    epoch = daemon.gate(False)  # (the 6 MiB sends finish once it is closed: rank 1's control thread drains)
    assert daemon.wait_acks(epoch, range(3), timeout=TIMEOUT), f"acks: {daemon.acks}"
    readline(procs[0], "sent")
    readline(procs[2], "sent")
    sent = {r: daemon.counters(r)[0] for r in range(3)}
    contexts = _capture_all(daemon, sent)
    ctx = msgpack.unpackb(contexts[1], raw=False)
    assert ctx["received"] == [6, 0, 6] and ctx["delivered"] == [2, 0, 1]
    assert [m[2] for m in ctx["messages"] if m[0] == 0] == [1, 2, 3, 5]
    for proc in procs:
        proc.send_signal(signal.SIGKILL)
        proc.wait()

    again = daemon_factory(nodes, contexts=contexts)
    results = finish(again.spawn("restored", "out-of-order"))
    assert results[1]["order"] == [[m[0], m[1]] for m in ctx["messages"]]


def test_peer_exit_raises_instead_of_hanging(daemon_factory):
    daemon = daemon_factory(["a", "a", "b"])
    procs = daemon.spawn("peer_exit")
    daemon.wait_attached()
    assert procs[2].wait(TIMEOUT) == 3
    why = "rank 2 on b exited with code 3"
    daemon.note(0, "peer_exited", rank=2, why=why)
    daemon.note(1, "peer_exited", rank=2, why=why)
    result = finish(procs, codes=[0, 0, 3])[0]
    caught = result["caught"]
    assert caught["recv_from_2"][0] == 2 and why in caught["recv_from_2"][1]
    assert caught["send_to_2"][0] == 2 and why in caught["send_to_2"][1]
    assert caught["big_send_to_1"][0] == 1 and "rank 1" in caught["big_send_to_1"][1]
    assert caught["send_again_to_1"] == caught["big_send_to_1"]
    assert caught["recv_any"][0] is None and "every other rank" in caught["recv_any"][1]
    assert result["seconds"] < 10


def test_wrong_token_is_rejected(daemon_factory):
    daemon = daemon_factory(["a", "b"])
    procs = daemon.spawn("wrong_token", stdin=True)
    readline(procs[0], "ready")
    args = daemon.links[0].args
    evil = wire.HEADER.pack(wire.BYTES, 0, 0, 0, 4) + b"evil"
    for family, address in ((socket.AF_UNIX, args["unix"]), (socket.AF_INET, tuple(args["tcp"]))):
        for hello in (
            wire.HEADER.pack(wire.HELLO, 1, 0, 5, 0) + b"wrong",  # wrong token, claiming rank 1
            wire.HEADER.pack(wire.BYTES, 0, 0, 4, 0) + b"evil",  # no hello at all
        ):
            with socket.socket(family, socket.SOCK_STREAM) as sock:
                sock.settimeout(TIMEOUT)
                sock.connect(address)
                sock.sendall(hello + evil)
                try:
                    assert sock.recv(100) == b"", "the rank must close a stranger's connection"
                except ConnectionResetError:
                    pass
    procs[1].stdin.write("go\n")
    procs[1].stdin.flush()
    res = finish(procs)[0]
    assert res["obj"] == "legit" and res["source"] == 1
    assert res["counters"]["received"] == [0, 1]


def test_attach_refused_is_a_clear_error(daemon_factory):
    daemon = daemon_factory(["a"], refuse=("permission_denied", "process 42 is not rank 0 of job 1"))
    res = finish(daemon.spawn("attach_refused"))[0]
    assert res["code"] == "permission_denied" and "process 42 is not rank 0 of job 1" in res["error"]


def test_one_rank_world_without_gangd():
    env = {k: v for k, v in os.environ.items() if not k.startswith("GANGD_")}
    proc = subprocess.run([sys.executable, WORKER, "solo"], check=False, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    res = json.loads(next(line for line in lines if line.startswith("RESULT "))[7:])
    assert res["bcast"] == [1, 2] and res["allreduce"] == [[0, 1, 2], True, 2.5]
    assert len(res["errors"]) == 4 and "reserved for collectives" in res["errors"][0]
    assert "wait forever" in res["errors"][3]
    assert res["counters"] == {"sent": [2], "received": [2], "delivered": [2]}
    assert lines[-1].startswith("closed:")


def _entry(src: int, seq: int) -> list:
    return [src, 7, seq, wire.BYTES, b"", b"payload"]


def test_a_restored_context_keeps_holes_left_by_messages_taken_out_of_order():
    from gangd.comm.context import undelivered_messages

    # Rank 0 sent 5, rank 1 took 3 of them (seqs 0, 2 and 4): 1 and 3 wait.
    messages = undelivered_messages([_entry(0, 1), _entry(0, 3)], 2, [5, 0], [3, 0])
    assert [(m.src, m.seq, m.tag) for m in messages] == [(0, 1, 7), (0, 3, 7)]


@pytest.mark.parametrize(("entries", "received", "delivered", "why"), [
    ([_entry(0, 1), _entry(0, 1)], [3, 0], [1, 0], "out of order"),  # the same message twice
    ([_entry(0, 2), _entry(0, 1)], [3, 0], [1, 0], "out of order"),  # against the arrival order
    ([_entry(0, 3)], [3, 0], [2, 0], "out of order"),  # a message never received
    ([_entry(2, 0)], [1, 0], [0, 0], "out of order"),  # from no rank of the job
    ([[0, 7, "1", wire.BYTES, b"", b""]], [2, 0], [1, 0], "out of order"),  # a sequence number that is not one
    ([_entry(0, 1)], [3, 0], [1, 0], "do not add up"),  # one of two undelivered missing
    ([[0, 7]], [1, 0], [0, 0], "malformed"),
    ([None], [1, 0], [0, 0], "malformed"),
])
def test_a_damaged_context_is_refused_saying_why(entries, received, delivered, why):
    from gangd.comm.context import undelivered_messages
    from gangd.comm.errors import CommError

    with pytest.raises(CommError, match=why):
        undelivered_messages(entries, 2, received, delivered)
