"""Issue 14, finding 9: rank-to-rank connections prove the job's key without sending it.

Real daemons, real ranks of real jobs, real TCP and Unix connections to a
rank's gangd.comm listener, a real second uid (nobody). The contract a user
relies on: nothing that crosses the network between two ranks lets a reader
into the job (the token never crosses it, and a recorded handshake replays
nowhere); a process that does not hold the job's token gets nothing into
the job (no message, and above all no pickle unpickled), whatever it sends;
and the job goes on as if it had never been there.

Also here, because it is what made the handshake fail now and then:
gangd.ckptlib's reader thread outlived ``ckpt.fini()`` and read the fd
numbers fini had just closed, which gangd.comm's next connections reuse.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import pickle
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from ckpthelpers import kill_what_is_left
from conftest import as_uid, shared_cluster

from gangd.comm import handshake, wire

PY = sys.executable
NOBODY = 65534
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (a second uid)")

#: The job: rank 0 (node n1) listens and prints its addresses and the job's
#: token (the test's own job: the test may know it); it then takes every
#: message that arrives until it gets b"done" from rank 1 and, once the file
#: ``end`` exists, prints them and its counters.
#: Rank 1 (node n2, so TCP) waits for the file ``go`` (if ``route`` exists,
#: it first sends its messages to rank 0 through the address in it: the
#: test's recording proxy), sends b"legit" and b"done".
JOB = r"""
import json, os, socket, sys, time
from pathlib import Path
from gangd.comm import engine as E
start = E.Engine.start
def recording_start(self, peers, token, gate):
    self.test_token = token
    start(self, peers, token, gate)
E.Engine.start = recording_start
from gangd import comm
w = comm.world()
d = Path(sys.argv[1])
if w.rank == 0:
    e = w._engine
    tcp = [s for s in e._listeners if s.family != socket.AF_UNIX][0]
    print("LISTEN " + json.dumps({"tcp": list(tcp.getsockname()[:2]), "unix": e.unix_path,
                                  "token": e.test_token.hex(), "key": getattr(e, "key", b"").hex()}), flush=True)
    got = []
    while True:
        obj, st = w.recv(status=True)
        got.append([repr(obj), st.source])
        if obj == b"done":
            break
    while not (d / "end").exists():  # (busy elsewhere: the handshakes below are answered meanwhile)
        time.sleep(0.05)
    print("GOT " + json.dumps({"got": got, "counters": w.counters(), "refused": getattr(getattr(e, "doorman", None), "refused", -1)}), flush=True)
else:
    while not (d / "go").exists():
        time.sleep(0.05)
    route = d / "route"
    if route.exists():
        host, port = json.loads(route.read_text())
        w._engine.peers[0] = {"node": None, "tcp": [host, port]}
    w.send(b"legit", 0)
    w.send(b"done", 0)
"""


@pytest.fixture(scope="module")
def ac():
    with shared_cluster(2, cores=2) as cluster:
        yield cluster


@pytest.fixture(autouse=True)
def _leave_it_empty(request):
    yield
    if "ac" in request.fixturenames:
        kill_what_is_left(request.getfixturevalue("ac"))


class Evil:
    """Unpickling this creates a file: proof that nothing was unpickled."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


class Job:
    """The JOB above, running on the cluster; ``info`` is what rank 0 printed."""

    def __init__(self, cluster, tmp: Path):
        os.chmod(tmp, 0o755)
        self.dir = tmp
        self.proc = cluster.popen_gang("run", "-n", 2, "-N", 2, "--no-label", "--", PY, "-c", JOB, str(tmp))
        line = self.proc.stdout.readline()
        assert line.startswith("LISTEN "), (line, self.proc.stderr.read() if self.proc.poll() is not None else "")
        self.info = json.loads(line[7:])
        self.token = bytes.fromhex(self.info["token"])
        self.key = bytes.fromhex(self.info["key"])
        self.tcp = (self.info["tcp"][0], self.info["tcp"][1])

    def addresses(self):
        return ((socket.AF_INET, self.tcp), (socket.AF_UNIX, self.info["unix"]))

    def finish(self) -> dict:
        (self.dir / "go").touch()
        (self.dir / "end").touch()
        try:
            out, err = self.proc.communicate(timeout=90)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.communicate()
        assert self.proc.returncode == 0, err
        return json.loads(out.split("GOT ", 1)[1])


def talk(family, address, data: bytes, then: bytes = b"") -> bytes:
    """Connect, send ``data`` (and ``then`` once the rank answered a challenge);
    all the rank sent before it closed the connection."""
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.settimeout(30)
        sock.connect(address)
        sock.sendall(data)
        got = b""
        try:
            while chunk := sock.recv(4096):
                got += chunk
                if then and len(got) >= handshake.CHALLENGE:
                    sock.sendall(then)
                    then = b""
        except (ConnectionResetError, BrokenPipeError):
            pass
        except TimeoutError:
            return got + b" <the rank kept the connection open>"
        return got


def evil_frame(path: Path) -> bytes:
    evil = pickle.dumps(Evil(str(path)))
    return wire.HEADER.pack(wire.PICKLE, 1, 0, 0, len(evil)) + evil


def assert_only_the_legit_messages(result: dict) -> None:
    assert result["got"] == [["b'legit'", 1], ["b'done'", 1]], result
    assert result["counters"]["received"] == [0, 2], result


# ---------------------------------------------------------------- strangers' bytes


def test_old_token_hellos_garbage_and_wrong_proofs_are_refused_and_the_job_completes(ac, tmp_path):
    job = Job(ac, tmp_path)
    unpickled = tmp_path / "unpickled"
    frame = evil_frame(unpickled)
    token = job.token
    wrong_key = handshake.derive_key(b"not the job token")
    # A hello that never finishes (one byte at a time, then nothing) is cut off, not waited on forever:
    # sent first, so that the rank's wait for the rest (handshake.TIMEOUT) passes while the other checks run.
    with ThreadPoolExecutor(2) as pool:
        unfinished = [pool.submit(talk, family, address, handshake.hello_frame(1, os.urandom(handshake.NONCE))[:30])
                      for family, address in job.addresses()]
        for family, address in job.addresses():
            _refused_but_answered(family, address, token, frame, wrong_key, job)
        assert [cut.result() for cut in unfinished] == [b"", b""]
    result = job.finish()
    assert_only_the_legit_messages(result)
    assert not unpickled.exists(), "a stranger's pickle was unpickled"
    assert result["refused"] >= 2 * 8


def _refused_but_answered(family, address, token: bytes, frame: bytes, wrong_key: bytes, job: Job) -> None:
    """The rank refuses what a stranger sends at ``address``, but answers a well-formed hello (with proof that it holds the key)."""
    # The old hello: the job's token in the clear (even the right one), then a pickle as rank 1.
    assert talk(family, address, wire.HEADER.pack(wire.HELLO, 1, 0, len(token), 0) + token + frame) == b""
    # No hello at all; garbage; a hello claiming to be rank 0 itself, or a rank the job does not have.
    assert talk(family, address, frame) == b""
    assert talk(family, address, os.urandom(200)) == b""
    nonce = os.urandom(handshake.NONCE)
    assert talk(family, address, handshake.hello_frame(0, nonce)) == b""
    assert talk(family, address, handshake.hello_frame(7, nonce)) == b""
    # The new handshake, keyed wrong: the rank answers the hello, refuses the proof.
    answer = talk(family, address, handshake.hello_frame(1, nonce), handshake.proof_frame(1, os.urandom(handshake.MAC)) + frame)
    assert len(answer) == handshake.CHALLENGE
    nonce_l = answer[: handshake.NONCE]
    wrong = handshake.mac(wrong_key, b"dialer", 1, 0, nonce, nonce_l)
    answer = talk(family, address, handshake.hello_frame(1, nonce), handshake.proof_frame(1, wrong) + frame)
    assert len(answer) == handshake.CHALLENGE
    # ...and its answer proves it holds the key, without showing the token or the key.
    nonce_l, theirs = answer[: handshake.NONCE], answer[handshake.NONCE :]
    assert hmac.compare_digest(theirs, handshake.mac(job.key, b"listener", 1, 0, nonce, nonce_l))
    assert token not in answer and job.key not in answer


def test_connections_held_open_by_a_stranger_do_not_lock_the_ranks_out(ac, tmp_path):
    """More idle connections than a rank keeps handshakes for: the oldest give way, the real rank 1 gets in."""
    job = Job(ac, tmp_path)
    held = []
    try:
        for i in range(handshake.MAX_PENDING + 20):
            sock = socket.create_connection(job.tcp, timeout=30)
            if i % 2:
                sock.sendall(handshake.hello_frame(1, os.urandom(handshake.NONCE))[:20])  # a hello begun, never finished
            held.append(sock)
        result = job.finish()  # rank 1 dials rank 0 over TCP while all of them are held open
    finally:
        for sock in held:
            sock.close()
    assert_only_the_legit_messages(result)
    assert result["refused"] >= 20


# ---------------------------------------------------------------- a real handshake, recorded


class RecordingProxy:
    """Listens on 127.0.0.1; relays one connection to ``target``, recording both directions."""

    def __init__(self, target):
        self.target = target
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = self.listener.getsockname()[:2]
        self.sent: list[bytes] = []  # dialer -> listener
        self.answered: list[bytes] = []  # listener -> dialer
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        dialer, _ = self.listener.accept()
        upstream = socket.create_connection(self.target)
        pumps = [
            threading.Thread(target=self._pump, args=(dialer, upstream, self.sent), daemon=True),
            threading.Thread(target=self._pump, args=(upstream, dialer, self.answered), daemon=True),
        ]
        for pump in pumps:
            pump.start()
        for pump in pumps:
            pump.join()
        dialer.close()
        upstream.close()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket, record: list[bytes]) -> None:
        try:
            while data := src.recv(65536):
                record.append(data)
                dst.sendall(data)
        except OSError:
            pass
        for s in (dst, src):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def test_a_real_handshake_shows_neither_token_nor_key_and_replays_nowhere(ac, tmp_path):
    job = Job(ac, tmp_path)
    proxy = RecordingProxy(job.tcp)
    (tmp_path / "route").write_text(json.dumps(list(proxy.address)))
    result = job.finish()  # rank 1 -> rank 0 through the proxy
    assert_only_the_legit_messages(result)
    proxy.thread.join(timeout=30)
    sent, answered = b"".join(proxy.sent), b"".join(proxy.answered)
    # What crossed the wire: the hello, the listener's challenge, the proof, then the messages.
    assert sent.startswith(wire.HEADER.pack(wire.HELLO, 1, 0, handshake.HELLO_META, 0) + handshake.MAGIC)
    assert len(answered) == handshake.CHALLENGE
    for secret in (job.token, job.key, job.token.hex().encode(), job.key.hex().encode()):
        assert secret not in sent and secret not in answered
    hello, proof = sent[: handshake.FRAME], sent[handshake.FRAME : 2 * handshake.FRAME]
    nonce_d = hello[-handshake.NONCE :]
    nonce_l = answered[: handshake.NONCE]
    assert proof[wire.HEADER_SIZE :] == handshake.mac(job.key, b"dialer", 1, 0, nonce_d, nonce_l)  # (the spec, independently)


def test_a_recorded_handshake_replayed_or_reflected_is_refused(ac, tmp_path):
    job = Job(ac, tmp_path)
    proxy = RecordingProxy(job.tcp)
    (tmp_path / "route").write_text(json.dumps(list(proxy.address)))
    (tmp_path / "go").touch()  # rank 1's real messages go through the proxy first
    deadline = time.monotonic() + 60
    while len(b"".join(proxy.sent)) < 2 * handshake.FRAME + 2 * wire.HEADER_SIZE and time.monotonic() < deadline:
        time.sleep(0.05)
    recorded = b"".join(proxy.sent)
    hello, proof, messages = recorded[: handshake.FRAME], recorded[handshake.FRAME : 2 * handshake.FRAME], recorded[2 * handshake.FRAME :]
    assert messages, "rank 1's messages did not go through the proxy"
    unpickled = tmp_path / "unpickled"
    for family, address in job.addresses():
        # The whole recorded stream again: the rank answers with a fresh nonce, so the old proof fails.
        answer = talk(family, address, hello, proof + messages + evil_frame(unpickled))
        assert len(answer) == handshake.CHALLENGE and answer[: handshake.NONCE] != b"".join(proxy.answered)[: handshake.NONCE]
        # The rank's own MAC reflected back as the dialer's proof.
        nonce = os.urandom(handshake.NONCE)
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.settimeout(30)
            sock.connect(address)
            sock.sendall(handshake.hello_frame(1, nonce))
            answer = b""
            while len(answer) < handshake.CHALLENGE and (chunk := sock.recv(handshake.CHALLENGE - len(answer))):
                answer += chunk
            sock.sendall(handshake.proof_frame(1, answer[handshake.NONCE :]) + evil_frame(unpickled))
            try:
                assert sock.recv(100) == b""
            except ConnectionResetError:
                pass
    assert_only_the_legit_messages(job.finish())
    assert not unpickled.exists()


# ---------------------------------------------------------------- another user


@root_only
def test_a_stranger_cannot_get_a_message_into_another_users_job(ac, tmp_path):
    job = Job(ac, tmp_path)
    unpickled = tmp_path / "unpickled"
    frame = evil_frame(unpickled)
    tcp, unix = job.tcp, job.info["unix"]

    def attack():
        said = {}
        guesses = [b"", b"0" * 32, os.urandom(16).hex().encode()]
        for family, address in ((socket.AF_INET, tcp), (socket.AF_UNIX, unix)):
            name = "tcp" if family == socket.AF_INET else "unix"
            try:
                for i, guess in enumerate(guesses):
                    said[f"{name} old hello {i}"] = talk(family, address, wire.HEADER.pack(wire.HELLO, 1, 0, len(guess), 0) + guess + frame).hex()
                nonce = os.urandom(handshake.NONCE)
                key = handshake.derive_key(guesses[2])
                answer = talk(family, address, handshake.hello_frame(1, nonce), handshake.proof_frame(1, key[: handshake.MAC]) + frame)
                said[f"{name} handshake"] = len(answer)
            except PermissionError as exc:  # the job's Unix socket is not the stranger's to connect to
                said[f"{name} refused"] = str(exc)
        return said

    said = as_uid(NOBODY, attack)
    assert "exception" not in said, said
    assert all(v == "" for k, v in said.items() if "old hello" in k), said
    assert all(v == handshake.CHALLENGE for k, v in said.items() if k.endswith("handshake")), said
    assert "tcp handshake" in said  # (TCP is open to anyone who can reach the node: the handshake is the guard)
    result = job.finish()
    assert_only_the_legit_messages(result)
    assert not unpickled.exists(), "a stranger's pickle was unpickled"


# ---------------------------------------------------------------- the cause of the flaky handshake


CKPT_FINI_THEN_CONNECT = r"""
import sys, threading, numpy as np
from gangd import ckptlib as ckpt
from gangd import comm
ckpt.init()
w = comm.world()
for _ in ckpt.loop(range(3)):
    pass
ckpt.fini()
left = [t.name for t in threading.enumerate() if t.name.startswith("gangd-ckpt")]
# New connections at once (every rank to every other), as ring.py's allreduce after ckpt.fini():
# they get the fd numbers fini just closed.
for step in range(3):
    for dest in range(w.size):
        if dest != w.rank:
            w.send(np.full(64, w.rank * 100 + step), dest, tag=step)
    for src in range(w.size):
        if src != w.rank:
            got = w.recv(source=src, tag=step)
            assert (got == src * 100 + step).all(), got
total = w.allreduce(w.rank)
print(f"RANK {w.rank} LEFT {left} TOTAL {total}", flush=True)
"""


def test_ckpt_fini_leaves_no_thread_reading_the_fds_it_closed(ac):
    """ckptlib's reader thread selects on its daemon link and wake eventfd by
    number; fini closed both and returned while the thread still ran, so the
    thread went on to select on (and eventfd_read 8 bytes from) whatever got
    those numbers next: the job's next gangd.comm connections, which lost a
    hello's or a message's first bytes (the handshake's "flaky" failures)."""
    for _ in range(3):
        run = ac.gang("run", "-n", 4, "--no-label", "--", PY, "-c", CKPT_FINI_THEN_CONNECT, timeout=60)
        assert run.returncode == 0, run.stderr
        lines = sorted(line for line in run.stdout.splitlines() if line.startswith("RANK "))
        assert lines == [f"RANK {r} LEFT [] TOTAL 6" for r in range(4)], run.stdout


def test_the_handshake_mac_is_the_one_the_module_documents():
    """Computed here from the docstring's description: MAGIC, role, both ranks, both nonces."""
    key = handshake.derive_key(b"some job token")
    assert key == hmac.new(b"some job token", b"gangd.comm rank-to-rank handshake", hashlib.sha256).digest()
    nd, nl = b"d" * 16, b"l" * 16
    expected = hmac.new(key, handshake.MAGIC + b"\0dialer\0" + (3).to_bytes(4, "little") + (5).to_bytes(4, "little") + nd + nl, hashlib.sha256).digest()
    assert handshake.mac(key, b"dialer", 3, 5, nd, nl) == expected
    assert handshake.mac(key, b"listener", 3, 5, nd, nl) != expected  # no reflection
    assert handshake.mac(key, b"dialer", 5, 3, nd, nl) != expected  # bound to the direction
    assert handshake.mac(key, b"dialer", 3, 5, nl, nd) != expected  # and to whose nonce is whose
