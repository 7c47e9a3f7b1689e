"""Ping-pong between two processes, three ways; run by bench/comm.py.

    pingpong.py raw-unix | raw-tcp   — a raw Python socket pair (the baseline)
    pingpong.py gangd                — two ranks of a gangd job (gangd.comm)
    pingpong.py mpi                  — two mpi4py ranks under mpiexec

Rank 0 sends a numpy buffer, rank 1 receives it into a preallocated buffer
and sends it back, for each size; rank 0 prints one JSON line per size:
{"size", "iters", "half_rtt_us", "mbps"}. Every way moves the same bytes
with the same buffers; the raw way does no framing at all.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time

import numpy as np

SIZES = [8, 1024, 16 * 1024, 128 * 1024, 1 << 20, 4 << 20, 16 << 20]


def iterations(size: int) -> int:
    return max(20, min(5000, int(200e6 / max(size, 1) / 8)))


def report(size: int, iters: int, elapsed: float) -> None:
    half = elapsed / iters / 2
    print(json.dumps({"size": size, "iters": iters, "half_rtt_us": half * 1e6, "mbps": size / half / 1e6}), flush=True)


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if not n:
            raise EOFError
        got += n


def raw(kind: str) -> None:
    if kind == "unix":
        a, b = socket.socketpair()
    else:
        listener = socket.create_server(("127.0.0.2", 0))
        a = socket.create_connection(listener.getsockname())
        b, _ = listener.accept()
        for s in (a, b):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    pid = os.fork()
    sock = b if pid == 0 else a
    (a if pid == 0 else b).close()
    for size in SIZES:
        buf = np.ones(size, dtype=np.uint8)
        view = memoryview(buf)
        iters = iterations(size)
        if pid == 0:
            for _ in range(iters + 5):
                _recv_exact(sock, view)
                sock.sendall(view)
        else:
            for i in range(iters + 5):
                if i == 5:
                    t0 = time.perf_counter()
                sock.sendall(view)
                _recv_exact(sock, view)
            report(size, iters, time.perf_counter() - t0)
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)


def gangd() -> None:
    from gangd import comm

    w = comm.world()
    for size in SIZES:
        buf = np.ones(size, dtype=np.uint8)
        iters = iterations(size)
        w.barrier()
        if w.rank == 1:
            for _ in range(iters + 5):
                w.recv_into(buf, source=0, tag=1)
                w.send(buf, 0, tag=2)
        else:
            for i in range(iters + 5):
                if i == 5:
                    t0 = time.perf_counter()
                w.send(buf, 1, tag=1)
                w.recv_into(buf, source=1, tag=2)
            report(size, iters, time.perf_counter() - t0)


def mpi() -> None:
    from mpi4py import MPI

    w = MPI.COMM_WORLD
    for size in SIZES:
        buf = np.ones(size, dtype=np.uint8)
        iters = iterations(size)
        w.Barrier()
        if w.rank == 1:
            for _ in range(iters + 5):
                w.Recv(buf, source=0, tag=1)
                w.Send(buf, 0, tag=2)
        else:
            for i in range(iters + 5):
                if i == 5:
                    t0 = time.perf_counter()
                w.Send(buf, 1, tag=1)
                w.Recv(buf, source=1, tag=2)
            report(size, iters, time.perf_counter() - t0)


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode.startswith("raw-"):
        raw(mode[4:])
    elif mode == "gangd":
        gangd()
    elif mode == "mpi":
        mpi()
    else:
        raise SystemExit(f"unknown mode {mode}")
