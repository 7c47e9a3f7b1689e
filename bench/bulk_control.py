"""What one checkpoint transfer costs in CPU, apart from its bytes: the control.

Issue 16's redundancy writes move a generation in transfers of one slice
or one file each (an XOR parity of a set of k pulls k - 1 slices and serves
k - 1: 14 transfers per node and generation with k = 8). Each has a fixed
cost — a channel request and its items, a ticket, the HMAC handshake, a
TCP connection, hand-offs between the event loop and worker threads —
that ``bench/recovery.py`` shows only as CPU per MiB growing at small
sizes. Here it is alone: one process holds both daemons' ends (two real
rpc Channels over a socket pair, a real bulk listener), and a worker
thread reads ``--parallel`` slices of ``--kib`` KiB at once, as the parity
code does (``gangd.redundancy.transfer.RemoteData``), ``--transfers`` times,
on the bulk path and on the channel path, alternating; printed: CPU time
of the process (both ends, every thread) per transfer and per MiB. With
small slices the figure is the fixed cost; with large ones (``--kib
8192``), the cost of the bytes. Report the load average with it: on a
shared machine CPU per operation grows with the load.

    python bench/bulk_control.py [--transfers 60] [--kib 64] [--parallel 7] [--rounds 2]
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).parent))
import recovery  # (the bench's node generations and secret)

from gangd.protocol import Connection, Role
from gangd.redundancy import bulk, transfer
from gangd.rpc import Channel, RemoteError


async def measure(args) -> None:
    base = Path(tempfile.mkdtemp(prefix="gangd-bulk-control-"))
    root = base / "n1"
    root.mkdir()
    try:
        await trio.to_thread.run_sync(recovery.write_local, root, 1, (args.kib >> 10) + 1)  # (a slice from its start)
        server = bulk.BulkServer(recovery.SECRET)
        key = bulk.Bulk.from_secret(recovery.SECRET)

        async def handler(channel, request):
            if request.op == "ckpt_bulk_read":
                return await transfer.handle_bulk_read(server, root, request.args)
            if request.op == "ckpt_data_read":
                return await transfer.handle_data_read(root, request.args)
            raise RemoteError("unsupported", request.op)

        a, b = socket.socketpair()
        ours = Channel(trio.SocketStream(trio.socket.from_stdlib_socket(a)),
                       Connection(dialer=True, node="n0", role=Role.PEER, secret=recovery.SECRET), label="node n1")
        theirs = Channel(trio.SocketStream(trio.socket.from_stdlib_socket(b)),
                         Connection(dialer=False, node="n1", secret=recovery.SECRET), label="node n0")
        length = args.kib << 10
        async with trio.open_nursery() as nursery:
            await nursery.start(server.run)
            async with trio.open_nursery() as hs:
                hs.start_soon(ours.handshake)
                hs.start_soon(theirs.handshake)
            nursery.start_soon(theirs.run, handler)
            nursery.start_soon(ours.run, None)

            async def run(times: int, use_bulk: bool) -> None:
                async with trio.open_nursery() as inner:
                    sources = [transfer.RemoteData(inner, ours, recovery.LINEAGE, recovery.GEN, bulk=key if use_bulk else None)
                               for _ in range(args.parallel)]

                    def read_all() -> None:
                        streams = [iter(s.blocks(0, length)) for s in sources]
                        for stream in streams:
                            for _ in stream:
                                pass

                    for _ in range(times):
                        await trio.to_thread.run_sync(read_all)

            for _ in range(args.rounds):
                for use_bulk in (True, False):
                    await run(3, use_bulk)  # (warm: threads, buffers, page cache)
                    cpu, wall = time.process_time(), time.perf_counter()
                    await run(args.transfers, use_bulk)
                    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
                    n = args.transfers * args.parallel
                    print(f"{'bulk' if use_bulk else 'channel':8s} {n} transfers of {args.kib} KiB, {args.parallel} at once: "
                          f"{1000 * cpu / n:7.2f} ms CPU per transfer, {1000 * cpu / (n * length / (1 << 20)):7.3f} ms CPU per MiB "
                          f"({1000 * wall / n:.2f} ms wall each)", flush=True)
            nursery.cancel_scope.cancel()
    finally:
        shutil.rmtree(base, ignore_errors=True)
    load = os.getloadavg()
    print(f"load average at the end {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} CPUs")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--transfers", type=int, default=60, help="rounds of --parallel transfers, per path and round")
    parser.add_argument("--kib", type=int, default=64, help="slice size (KiB)")
    parser.add_argument("--parallel", type=int, default=7, help="slices read at once (an XOR set of k: k - 1)")
    parser.add_argument("--rounds", type=int, default=2, help="alternations of the bulk and the channel path")
    trio.run(measure, parser.parse_args())


if __name__ == "__main__":
    main()
