"""A daemon's resident memory under two attacks on its memory (issue 14, finding 5).

Starts a real 2-node local cluster and measures the resident set (psutil RSS)
of one daemon:

  (a) frames    N unauthenticated TCP connections (default 50) each announce
                a maximal frame (16 MiB) at node n1's peer port and push its
                payload as fast as the daemon takes it. Before the handshake
                a daemon accepts frames of at most HANDSHAKE_MAX_FRAME
                (4 KiB), so each connection is cut off after its header;
                connections beyond the per-address handshake limit are
                refused at once.
  (b) logs -f   a job on n2 writes SIZE (default 100 MB) of output while a
                client connected to n1 asks for ``gang logs -f`` of it and
                never reads: n1 relays n2's stream. Credit-based flow
                control stops n2 once n1 holds a window of it (256 KiB) and
                n1's socket to the client is full.

For each: baseline RSS, peak RSS while it lasts, the growth, and the bound
claimed for it. The bounds are generous upper bounds derived from the
limits (see below), not measured margins.

    python bench/daemon_memory.py [--connections 50] [--size-mb 100]
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import tempfile
import time
import tomllib
from pathlib import Path

import psutil

from gangd.client import cluster as local
from gangd.daemon.admission import Limits
from gangd.protocol import DEFAULT_MAX_FRAME, DEFAULT_WINDOW, HANDSHAKE_MAX_FRAME, Connection, Item, Ready, Reply, Role
from gangd.rpc import HANDSHAKE_READ_SIZE, READ_SIZE

MiB = 1024 * 1024


def say(text: str) -> None:
    print(text, flush=True)


def rss(pid: int) -> int:
    return psutil.Process(pid).memory_info().rss


def endpoint(directory: Path, node: str) -> tuple[str, int]:
    with open(directory / "cluster.toml", "rb") as fh:
        for entry in tomllib.load(fh)["nodes"]:
            if entry["name"] == node:
                host, port = entry["address"].rsplit(":", 1)
                return host, int(port)
    raise KeyError(node)


def report(name: str, baseline: int, peak: int, bound: int) -> bool:
    ok = peak - baseline <= bound
    say(f"{name}: baseline {baseline / MiB:.1f} MiB, peak {peak / MiB:.1f} MiB, growth {(peak - baseline) / MiB:.1f} MiB, "
        f"bound {bound / MiB:.1f} MiB: {'bounded' if ok else 'OVER THE BOUND'}")
    return ok


def frames(directory: Path, pid: int, count: int) -> bool:
    host, port = endpoint(directory, "n1")
    time.sleep(1)
    baseline = rss(pid)
    socks = []
    for _ in range(count):
        s = socket.create_connection((host, port))
        s.setblocking(False)
        socks.append(s)
    todo = {s: memoryview(DEFAULT_MAX_FRAME.to_bytes(4, "big") + b"\x00" * DEFAULT_MAX_FRAME) for s in socks}
    closed, pushed = set(), 0
    peak = baseline
    start = time.monotonic()
    while len(closed) < count and time.monotonic() - start < 120:
        for s in socks:
            if s in closed:
                continue
            try:
                if todo[s]:
                    sent = s.send(todo[s][: 1 << 20])
                    pushed += sent
                    todo[s] = todo[s][sent:]
                if s.recv(65536) == b"":
                    closed.add(s)
            except (BlockingIOError, InterruptedError):
                pass
            except OSError:
                closed.add(s)
        peak = max(peak, rss(pid))
        time.sleep(0.005)
    for s in socks:
        s.close()
    say(f"(a) {count} connections announced {DEFAULT_MAX_FRAME // MiB} MiB frames before the handshake; "
        f"{len(closed)} were closed by the daemon after {time.monotonic() - start:.1f} s; {pushed / MiB:.1f} MiB got into socket buffers in all")
    # Per connection in its handshake: one small read (HANDSHAKE_READ_SIZE)
    # and a frame of HANDSHAKE_MAX_FRAME at most, plus a task, a socket and
    # its Connection (~64 KiB, generously); at most handshakes_total of them
    # at once. Doubled for allocator slack. (What the kernel holds in socket
    # buffers is not the daemon's memory.)
    limits = Limits()
    bound = 2 * min(count, limits.handshakes_total) * (HANDSHAKE_READ_SIZE + HANDSHAKE_MAX_FRAME + 64 * 1024)
    return report("(a) unauthenticated maximal frames", baseline, peak, bound) and len(closed) == count


def logs(directory: Path, pid: int, size: int) -> bool:
    import subprocess

    chunk = 65536
    lines = size // chunk
    cmd = [sys.executable, "-m", "gangd.client.cli", "--cluster", str(directory), "submit", "-n", "1", "-w", "n2", "--",
           sys.executable, "-c", f"import sys, time\ntime.sleep(3)\nc = b'x' * {chunk - 1} + b'\\n'\nfor _ in range({lines}): sys.stdout.buffer.write(c)"]
    job = int(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(str(directory / "n1" / "gangd.sock"))
    conn = Connection(dialer=True, node="stalled-reader", role=Role.CLIENT)
    sock.sendall(conn.data_to_send())
    while not isinstance(conn.next_event(), Ready):
        conn.receive_data(sock.recv(65536))
    time.sleep(0.5)
    baseline = rss(pid)
    rid, frame = conn.send_request("output", {"job": job, "follow": True})
    sock.sendall(frame)  # ... and now it reads nothing
    peak = baseline
    start = time.monotonic()
    state = "?"
    while time.monotonic() - start < 300:
        peak = max(peak, rss(pid))
        rows = subprocess.run([sys.executable, "-m", "gangd.client.cli", "--cluster", str(directory), "ps", "--all", "--json"],
                              capture_output=True, text=True, check=True).stdout
        state = next(r["state"] for r in json.loads(rows) if r["id"] == job)
        if state not in ("QUEUED", "RUNNING"):
            break
        time.sleep(0.2)
    wrote = time.monotonic() - start
    for _ in range(25):  # and a while after it ended
        peak = max(peak, rss(pid))
        time.sleep(0.2)
    say(f"(b) job {job} on n2 wrote {lines * chunk / MiB:.0f} MiB (it ended {state} {wrote:.1f} s after the reader asked); the reader on n1 read nothing")
    # n1 holds per relayed stream at most a window plus one frame (items are
    # < 100 KiB here) and what its socket to the client takes; doubled for slack.
    bound = 2 * (DEFAULT_WINDOW + 2 * READ_SIZE + 4 * MiB)
    ok = report("(b) stalled gang logs -f through a relay", baseline, peak, bound)
    # The stream is intact: read it now.
    got, total = 0, 0
    sock.settimeout(60)
    while True:
        event = conn.next_event()
        if event is None:
            data = sock.recv(READ_SIZE)
            if not data:
                break
            conn.receive_data(data)
            continue
        if isinstance(event, Item):
            got += len(event.data["data"])
            total += event.size
            if total >= DEFAULT_WINDOW // 2:
                sock.sendall(conn.send_credit(rid, total))
                total = 0
        elif isinstance(event, Reply):
            break
    sock.close()
    say(f"(b) afterwards the reader read the whole stream: {got / MiB:.0f} MiB")
    return ok and got == lines * chunk


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--connections", type=int, default=50)
    parser.add_argument("--size-mb", type=int, default=100)
    args = parser.parse_args()
    directory = Path(tempfile.mkdtemp(prefix="gangd-bench-mem-")) / "cluster"
    local.up(directory, 2)
    try:
        pid = next(nf for nf in local.node_files(directory) if nf.name == "n1").pid()
        ok = frames(directory, pid, args.connections)
        ok = logs(directory, pid, args.size_mb * 1000 * 1000) and ok
    finally:
        local.down(directory)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
