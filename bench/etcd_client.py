"""Throughput of gangd's etcd client: txns/s serial and with N concurrent tasks, against a local etcd it starts.

``txn``: a create-if-absent txn. ``submit``: what a submit costs done naively (get the counter, then a txn comparing its
mod_revision that puts the counter and a job key). ``sequence``: the same with gangd.etcd.sequence (one txn per id). Printed next
to etcd's own tool (``etcdctl txn`` driven serially is a process per txn, so the baseline is ``etcdctl put``
with many keys in one process: ``etcdctl check perf`` is too heavy for a shared 2-core machine).

    python bench/etcd_client.py [--seconds 5] [--concurrency 8] [--busy N] [--priority NICE|none]

``--client-priority NICE`` runs this process at that nice value (as gangd would run). ``--busy N`` runs N
busy-looping processes meanwhile (a loaded node); ``--priority`` is etcd's nice value
(LocalEtcd raises it to -10 where root can; ``none`` leaves it).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import trio

from gangd.etcd import Compare, Etcd, Op, open_lease
from gangd.etcd.sequence import Sequence
from gangd.etcd.server import LocalEtcd, find_binary


def spin() -> None:
    os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
    os.setpriority(os.PRIO_PROCESS, 0, 0)  # a user's busy rank
    while True:
        pass


async def submit_like(etcd: Etcd, counter: str, i: int) -> None:
    while True:
        kv = await etcd.get(counter)
        n = int(kv.value) if kv else 0
        cond = Compare.version(counter) == 0 if kv is None else Compare.mod_revision(counter) == kv.mod_revision
        r = await etcd.txn([cond], [Op.put(counter, str(n + 1)), Op.put(f"/bench/job/{n + 1}", b"x" * 300)])
        if r.succeeded:
            return


async def plain_txn(etcd: Etcd, i: int) -> None:
    key = f"/bench/txn/{i}"
    await etcd.txn([Compare.version(key) == 0], [Op.put(key, b"x" * 300)], [Op.get(key)])


async def rate(etcd: Etcd, seconds: float, concurrency: int, kind: str) -> tuple[float, list[float]]:
    done = 0
    latencies: list[float] = []
    start = time.perf_counter()
    deadline = start + seconds
    ids = iter(range(10**9))
    sequence = Sequence(etcd, "/bench/sequence")

    async def worker(w: int) -> None:
        nonlocal done
        while time.perf_counter() < deadline:
            t = time.perf_counter()
            if kind == "submit":
                await submit_like(etcd, f"/bench/counter/{w}", next(ids))
            elif kind == "sequence":
                await sequence.next(lambda n: [Op.put(f"/bench/seqjob/{n}", b"x" * 300)])
            else:
                await plain_txn(etcd, next(ids) + int(start * 1000) * 10**6)
            latencies.append(time.perf_counter() - t)
            done += 1

    async with trio.open_nursery() as nursery:
        for w in range(concurrency):
            nursery.start_soon(worker, w)
    return done / (time.perf_counter() - start), latencies


async def keepalive_latency(etcd: Etcd, seconds: float) -> list[float]:
    out = []
    async with open_lease(etcd, 10) as lease:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            t = time.perf_counter()
            await etcd.lease_keepalive(lease.id)
            await etcd.put("/bench/alive", b"1", lease=lease.id)
            out.append(time.perf_counter() - t)
            await trio.sleep(0.05)
    return out


def etcdctl_rate(endpoint: str, n: int = 300) -> float:
    etcdctl = find_binary().with_name("etcdctl")
    if not etcdctl.exists():
        return float("nan")
    script = "".join(f"put /bench/ctl/{i} {'x' * 300}\n" for i in range(n))
    # `etcdctl txn` reads one txn from stdin; many puts in one process: a pipe into a loop of `etcdctl put` costs a
    # process each. Use the interactive-free path: one etcdctl per 'put', measured, and report per-process cost apart.
    t = time.perf_counter()
    for line in script.splitlines()[:50]:
        _, k, v = line.split(" ", 2)
        subprocess.run([str(etcdctl), "--endpoints", endpoint, "put", k, v], capture_output=True, check=True)
    return 50 / (time.perf_counter() - t)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1000


async def main_async(args: argparse.Namespace, endpoints: list[str]) -> None:
    async with Etcd(endpoints) as etcd:
        for kind in () if args.keepalive_only else ("txn", "submit", "sequence"):
            for conc in (1, args.concurrency):
                r, lat = await rate(etcd, args.seconds, conc, kind)
                print(f"{kind:6s} concurrency {conc:2d}: {r:7.0f}/s  latency p50 {pct(lat, .5):6.2f} ms  p99 {pct(lat, .99):6.2f} ms")
        lat = await keepalive_latency(etcd, args.seconds)
        print(f"keepalive+put while idle-or-busy: n={len(lat)} p50 {pct(lat, .5):.2f} ms  p99 {pct(lat, .99):.2f} ms  "
              f"max {max(lat) * 1000:.1f} ms  mean {statistics.mean(lat) * 1000:.2f} ms")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=float, default=5)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--busy", type=int, default=0)
    p.add_argument("--priority", default="-10")
    p.add_argument("--members", type=int, default=1)
    p.add_argument("--keepalive-only", action="store_true", help="only the keepalive+put latency")
    p.add_argument("--realtime", type=int, default=None, help="run etcd SCHED_RR at this priority")
    p.add_argument("--client-realtime", type=int, default=None, help="run this process SCHED_RR at this priority")
    p.add_argument("--client-priority", type=int, default=None, help="nice value of this process (as a daemon would have)")
    p.add_argument("--baseline", action="store_true", help="also time etcdctl put (one process per put)")
    args = p.parse_args()
    priority = None if args.priority == "none" else int(args.priority)
    directory = Path(tempfile.mkdtemp(prefix="gangd-bench-etcd-"))
    server = LocalEtcd(directory, members=args.members, priority=priority, realtime=args.realtime)
    busy = [multiprocessing.Process(target=spin, daemon=True) for _ in range(args.busy)]
    if args.client_priority is not None:
        os.setpriority(os.PRIO_PROCESS, 0, args.client_priority)  # before the busy processes fork: they get nice 0 below
    if args.client_realtime is not None:
        os.sched_setscheduler(0, os.SCHED_RR, os.sched_param(args.client_realtime))
    try:
        endpoints = server.start()
        print(f"etcd {find_binary()} members={args.members} priority={priority} realtime={args.realtime} busy={args.busy} "
              f"client-priority={args.client_priority} client-realtime={args.client_realtime}", file=sys.stderr)
        for b in busy:
            b.start()
        trio.run(main_async, args, endpoints)
        if args.baseline:
            print(f"etcdctl put (a process each): {etcdctl_rate(endpoints[0]):.0f}/s")
    finally:
        for b in busy:
            b.kill()
        server.stop()
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
