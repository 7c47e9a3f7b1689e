"""Redundant checkpoints: what partner copies and XOR parity cost against local writes.

Issue 16's bench, first part: the write bandwidth of one checkpoint
generation of ``--nodes`` nodes (default 8) x ``--mib`` MiB each (default
128: 1 GiB in all), at three redundancy levels, all measured in the same
run, alternating:

  local    every node writes its files (rank states + the daemon's small
           files), fsyncs them, writes its MANIFEST — what gangd does today;
  partner  local, then every node pulls its ring predecessor's generation
           (gangd.redundancy.transfer.fetch_generation: chunked,
           checksummed, fsynced) into its own disk;
  xor      local, then every node pulls one slice of each other member of
           its XOR set and writes the XOR (gangd.redundancy.xor; the sets
           as gangd forms them, of at most ``--set-size`` k nodes, default
           8 as gangd's and SCR's default: B/(k-1) parity per node).

What is timed, and why: from a common start to the moment the last node's
generation is *protected* (its partner copy or parity fsynced, its MANIFEST
or xor.meta written), not merely *complete* (every node's own files
fsynced: the 'local s' column). Bandwidth = the checkpoint's bytes (N x B)
/ that time: SCR's figure, the bandwidth of a checkpoint including its
redundancy encoding (SCR measured XOR ≈ 0.8x and PARTNER ≈ 0.5x of SINGLE,
with its default XOR set of 8; the issue's targets: xor ≥ 0.75x, partner ≥ 0.5x).

The set size matters: xor writes k/(k-1) bytes per byte of checkpoint
(partner 2), on one shared disk as on each node's own, so on a disk-bound
machine xor cannot exceed (k-1)/k of local: 0.75x with k = 4 (the target
itself, with no room for any other cost), 0.875x with k = 8. The table
prints each level's bytes and that bound; compare with SCR at k = 8.

Each node is a process of its own (its own GIL and event loop), the links
between them socket pairs carrying gangd's own rpc Channels with the peer
handshake. ``--transport bulk`` (default): the control on the channel, the
bytes on a bulk TCP connection per transfer (gangd.redundancy.bulk, HMAC
handshake keyed by the secret); ``channel``: the bytes in the channel's
stream items (the path before the bulk one); ``both``: partner and xor
over each, in the same run. Ratios are against ``local`` of the same run.

HONEST CAVEAT, printed with the figures: here every "node" is a directory
on the same disk of one machine, and the links are local sockets. On a
cluster each node has its own disk, so redundancy writes would add to each
disk what that node stores (B/(k-1) for xor, B for partner) while the
others write in parallel; here all of it queues on one disk, and the
peers' data read for the parity comes from this machine's page cache.
And the links cost CPU here that a cluster's NICs do not: a byte between
two "nodes" is copied by this machine's kernel at both ends of a loopback
TCP connection (measured here: ~0.2-0.3 ms/MiB to send, ~0.25 to receive,
~0.3 to read it from the page cache first, against ~0.3 ms/MiB for a
local write). xor and partner move B per node, so their redundancy phase
costs about as much CPU as the local write: on a machine whose CPUs are
busy (2 here, shared), that and not the disk bounds them.

``--alone`` (default): each level again with only node n0 working, timed
(the others' generations written before, and they only serve): one node's
work with the machine to itself, as each node of a cluster has its own disk
and CPUs. The table gives both phases' seconds and their CPU per MiB.

``--profile DIR``: cProfile of node n0's redundancy phase in each mode, the
top functions printed (where the CPU of the redundancy write goes).

    python bench/recovery.py [--mib 128] [--nodes 8] [--set-size 8] [--repeats 3] [--transport bulk|channel|both] [--no-alone]
                             [--profile DIR] [--dir DIR] [--json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import trio

from gangd import ckptstore
from gangd.protocol import Connection, Role
from gangd.redundancy import bulk, transfer, xor
from gangd.redundancy.plan import DEFAULT_SET_SIZE, make_plan
from gangd.rpc import Channel, RemoteError

LINEAGE, GEN = 1, 1
#: A mode's suffix: only node n0 writes its generation and its redundancy, timed (see --alone).
ALONE = "@1"
SECRET = b"bench-secret-bench-secret-bench!"


def node_name(i: int) -> str:
    return f"n{i}"


def write_local(root: Path, i: int, mib: int) -> ckptstore.Manifest:
    """One node's generation as the daemon writes it: rank files, then sync, then MANIFEST."""
    directory = ckptstore.gen_dir(root, LINEAGE, GEN)
    directory.mkdir(parents=True)
    (directory / "ranks").mkdir(mode=0o700)
    half = (mib << 20) // 2
    block = os.urandom(8 << 20)
    files = {}
    for r in range(2):
        data = (memoryview(block)[: min(len(block), half - off)] for off in range(0, half, len(block)))
        files[ckptstore.cluster_rank_file(2 * i + r)] = list(ckptstore.write_atomic(directory / ckptstore.cluster_rank_file(2 * i + r), data, durable=False))
    files["job.msgpack"] = list(ckptstore.write_atomic(directory / "job.msgpack", [b"j" * 4000], durable=False))
    ckptstore.sync(directory, list(files))
    manifest = ckptstore.Manifest(LINEAGE, GEN, node_name(i), 100, files, [2 * i, 2 * i + 1], time.time())
    ckptstore.write_manifest(directory, manifest)
    return manifest


def node_main(i: int, n: int, k: int, mode: str, base: str, mib: int, socks: dict, barrier, results, profile: str | None) -> None:
    try:
        results.put((i, trio.run(node_async, i, n, k, mode, Path(base), mib, socks, barrier, profile)))
    except BaseException as exc:  # noqa: BLE001 -- reported to the parent
        results.put((i, f"{type(exc).__name__}: {exc}"))


def profiled(path: str | None, fn, *args):
    """``fn(*args)``, under cProfile into ``path`` if given (the redundancy's thread: where its CPU goes)."""
    if path is None:
        return fn(*args)
    import cProfile

    prof = cProfile.Profile()
    try:
        return prof.runcall(fn, *args)
    finally:
        prof.dump_stats(path)


async def node_async(i: int, n: int, k: int, mode: str, base: Path, mib: int, socks: dict, barrier, profile: str | None) -> dict:
    root = base / node_name(i)
    root.mkdir(parents=True, exist_ok=True)
    alone = mode.endswith(ALONE)
    level, _, transport = mode.removesuffix(ALONE).partition("/")
    works = not alone or i == 0  # (alone: only n0 writes and protects, timed; the others' generations are there before, and they serve)
    if level == "xor":
        xor.warm()  # (what a daemon does at the generation's begin: the parity's numpy is loaded before the timed start)
    server = bulk.BulkServer(SECRET)
    key = bulk.Bulk.from_secret(SECRET) if transport != "channel" else None

    async def handler(channel, request):
        if request.op == "ckpt_bulk_read":
            return await transfer.handle_bulk_read(server, root, request.args)
        if request.op == "ckpt_file_read":
            return await transfer.handle_file_read(root, request.args)
        if request.op == "ckpt_data_read":
            return await transfer.handle_data_read(root, request.args)
        raise RemoteError("unsupported", request.op)

    clients: dict[int, Channel] = {}
    servers: list[Channel] = []
    for (puller, source), (fd_puller, fd_source) in socks.items():
        if puller == i:
            sock = socket.socket(fileno=fd_puller)
            clients[source] = Channel(trio.SocketStream(trio.socket.from_stdlib_socket(sock)),
                                      Connection(dialer=True, node=node_name(i), role=Role.PEER, secret=SECRET), label=f"node {node_name(source)}")
        elif source == i:
            sock = socket.socket(fileno=fd_source)
            servers.append(Channel(trio.SocketStream(trio.socket.from_stdlib_socket(sock)),
                                   Connection(dialer=False, node=node_name(i), secret=SECRET), label=f"node {node_name(puller)}"))
    async with trio.open_nursery() as nursery:
        await nursery.start(server.run)
        async with trio.open_nursery() as hs:
            for ch in (*clients.values(), *servers):
                hs.start_soon(ch.handshake)
        for ch in servers:
            nursery.start_soon(ch.run, handler)
        for ch in clients.values():
            nursery.start_soon(ch.run, None)
        if not works:
            await trio.to_thread.run_sync(write_local, root, i, mib)
            await trio.to_thread.run_sync(os.sync)
        await trio.to_thread.run_sync(barrier.wait)
        start, cpu0 = time.perf_counter(), time.process_time()
        if works:
            await trio.to_thread.run_sync(write_local, root, i, mib)
        local_done, cpu1 = time.perf_counter(), time.process_time()
        await trio.to_thread.run_sync(barrier.wait)  # the generation is complete: redundancy starts behind it
        gen = ckptstore.gen_dir(root, LINEAGE, GEN)
        if not works:
            pass
        elif level == "partner":
            prev = (i - 1) % n
            manifest = ckptstore.read_manifest(ckptstore.gen_dir(base / node_name(prev), LINEAGE, GEN))  # (handed over with the request in gangd)
            dest = gen / xor.REDUNDANCY_DIR / f"partner-{node_name(prev)}"
            dest.mkdir(parents=True)
            if profile is not None and i == 0:
                import cProfile

                prof = cProfile.Profile()  # (the event loop's thread: the transfer's threads are not in it)
                prof.enable()
            await transfer.fetch_generation(clients[prev], manifest, dest, bulk=key)
            if profile is not None and i == 0:
                prof.disable()
                prof.dump_stats(profile)
        elif level == "xor":
            members = [int(name[1:]) for name in xor_set(n, k, i)]
            manifests = [ckptstore.read_manifest(ckptstore.gen_dir(base / node_name(j), LINEAGE, GEN)) for j in members]
            sources: list = [transfer.RemoteData(nursery, clients[j], LINEAGE, GEN, bulk=key) if j != i else None for j in members]
            meta = xor.meta_for(manifests, [node_name(j) for j in members], members.index(i))
            await trio.to_thread.run_sync(profiled, profile if i == 0 else None, xor.write_parity, gen, meta, sources)
        end, cpu2 = time.perf_counter(), time.process_time()
        await trio.to_thread.run_sync(barrier.wait)  # nobody stops serving before everyone is done
        nursery.cancel_scope.cancel()
    return {"start": start, "local": local_done, "end": end, "local_cpu": cpu1 - cpu0, "redundancy_cpu": cpu2 - cpu1}


def xor_set(n: int, k: int, i: int) -> tuple[str, ...]:
    """Node ``i``'s XOR set as gangd forms them (:func:`gangd.redundancy.plan.xor_sets`, sets of at most k)."""
    return make_plan([node_name(j) for j in range(n)], "xor", k).set_of(node_name(i))


def run_mode(mode: str, n: int, k: int, mib: int, workdir: Path, profile: str | None = None) -> dict:
    base = workdir / f"run-{mode.replace('/', '-')}"
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(mode=0o711)
    pairs = []
    if mode.startswith("partner"):
        pairs = [(i, (i - 1) % n) for i in range(n)]
    elif mode.startswith("xor"):
        pairs = [(i, int(m[1:])) for i in range(n) for m in xor_set(n, k, i) if m != node_name(i)]
    socks = {}
    for p in pairs:
        a, b = socket.socketpair()
        socks[p] = (a.detach(), b.detach())
    os.sync()  # the previous run's dirty pages are not this run's to write back
    ctx = mp.get_context("fork")
    barrier = ctx.Barrier(n)
    results = ctx.Queue()
    procs = [ctx.Process(target=node_main, args=(i, n, k, mode, str(base), mib, socks, barrier, results, profile)) for i in range(n)]
    for p in procs:
        p.start()
    for a, b in socks.values():
        os.close(a)
        os.close(b)
    out = dict(results.get(timeout=1800) for _ in procs)
    for p in procs:
        p.join()
    errors = [v for v in out.values() if isinstance(v, str)]
    if errors:
        raise SystemExit(f"{mode}: {errors[0]}")
    timed = [out[0]] if mode.endswith(ALONE) else list(out.values())
    start = min(v["start"] for v in timed)
    local = max(v["local"] for v in timed) - start
    total = max(v["end"] for v in timed) - start
    stored = sum(f.stat().st_size for f in base.rglob("*") if f.is_file())
    shutil.rmtree(base, ignore_errors=True)
    mibs = mib * len(timed)
    data = mibs << 20
    return {"mode": mode, "seconds": total, "local_seconds": local, "redundancy_seconds": total - local,
            "bandwidth_mib_s": data / total / (1 << 20), "in_run_ratio": local / total,
            "stored_over_data": stored / (n * (mib << 20)) if len(timed) == n else float("nan"),
            # CPU of the node processes (all their threads, the serving ones too; not the kernel's writeback) per MiB of checkpoint
            "local_cpu_ms_per_mib": 1000 * sum(v["local_cpu"] for v in out.values()) / mibs,
            "redundancy_cpu_ms_per_mib": 1000 * sum(v["redundancy_cpu"] for v in out.values()) / mibs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=128, help="checkpoint size per node (MiB)")
    parser.add_argument("--nodes", type=int, default=8)
    parser.add_argument("--set-size", type=int, default=DEFAULT_SET_SIZE,
                        help=f"XOR set size k (default {DEFAULT_SET_SIZE}, gangd's and SCR's; capped at --nodes)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where the nodes' directories go (default: a temporary directory in $TMPDIR or /tmp)")
    parser.add_argument("--transport", choices=["bulk", "channel", "both"], default="bulk",
                        help="how redundancy bytes move: a bulk TCP connection, the rpc channel, or each in turn")
    parser.add_argument("--alone", action=argparse.BooleanOptionalAction, default=True,
                        help="also each level with one node working and the others only serving (default: yes)")
    parser.add_argument("--profile", default=None, metavar="DIR",
                        help="cProfile node n0's redundancy phase (xor: its parity thread; partner: its event loop) into DIR/<mode>-<run>.prof "
                             "and print the top functions of the last run")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    out = sys.stderr if args.json else sys.stdout
    k = min(args.set_size, args.nodes)
    sets = make_plan([node_name(j) for j in range(args.nodes)], "xor", k).sets
    workdir = Path(tempfile.mkdtemp(prefix="gangd-recovery-", dir=args.dir))
    transports = ["bulk", "channel"] if args.transport == "both" else [args.transport]
    shared = ["local"] + [f"{level}/{t}" for t in transports for level in ("partner", "xor")]
    modes = shared + ([m + ALONE for m in shared] if args.alone else [])
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    profiles: dict[str, str] = {}
    if args.profile:
        Path(args.profile).mkdir(parents=True, exist_ok=True)
    try:
        for rep in range(args.repeats):
            for mode in modes if rep % 2 == 0 else modes[::-1]:
                prof = None
                if args.profile and not mode.startswith("local"):
                    prof = profiles[mode] = str(Path(args.profile) / f"{mode.replace('/', '-')}-{rep + 1}.prof")
                r = run_mode(mode, args.nodes, k, args.mib, workdir, prof)
                runs[mode].append(r)
                print(f"  run {rep + 1} {mode:18s} {r['seconds']:7.2f} s  {r['bandwidth_mib_s']:8.1f} MiB/s", file=out, flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    def median(m: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[m])

    med = {m: median(m, "bandwidth_mib_s") for m in modes}
    ratio = {m: med[m] / med["local" + (ALONE if m.endswith(ALONE) else "")] for m in modes}
    in_run = {m: median(m, "in_run_ratio") for m in modes}
    # What each level writes per byte of checkpoint (the same on one shared disk as on a node's own): its bound on a disk-bound machine.
    stored = {level: median(level, "stored_over_data") for level in shared}
    bound = {m: stored["local"] / stored[m.removesuffix(ALONE)] for m in modes}
    load = os.getloadavg()
    print(f"\nOne generation of {args.nodes} nodes x {args.mib} MiB; XOR sets of k = {k} ({len(sets)} set{'s' if len(sets) > 1 else ''}: "
          f"{' | '.join(','.join(s) for s in sets)}); medians of {args.repeats} runs, alternating; "
          f"load average at the end {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} CPUs.", file=out)
    print("HOW: bandwidth = the checkpoint's bytes (nodes x MiB) / seconds from a common start until the last node's generation", file=out)
    print("     is PROTECTED (its partner copy or parity fsynced and its MANIFEST / xor.meta written) — SCR's figure: the", file=out)
    print("     checkpoint's bandwidth including its redundancy encoding. 'local s' is the time until COMPLETE (every node's", file=out)
    print("     own files fsynced), 'redund. s' the rest.", file=out)
    print("NOTE: every 'node' is a directory on this one machine's disk (all writes queue on one disk), its CPUs shared", file=out)
    print("      by all the nodes, and the links are local socket pairs; on a cluster each node has its own disk and CPUs.", file=out)
    print("'bytes x': what the level writes per byte local writes (stored/B over local's): xor k/(k-1), partner 2. On a", file=out)
    print("      disk-bound machine — one shared disk, or a node's own — a level's ratio cannot exceed 1/that ('bound'):", file=out)
    print(f"      xor with k = {k} at most {bound[shared[2]]:.3f}x, partner 0.5x; SCR's 0.8x is XOR with its default k = 8 (bound 0.875).", file=out)
    print("'x local': median bandwidth over the median of the local runs; 'in run': median over runs of the run's own", file=out)
    print("local phase time / its total time (the same generation, local then redundancy: robust to a noisy machine).", file=out)
    print("'cpu ms/MiB': CPU time of the node processes per MiB of checkpoint, local phase + redundancy phase, serving", file=out)
    print("threads included (the work, whatever CPU a run gets).", file=out)
    if args.alone:
        print(f"'{ALONE}': only node n0 writes its generation and then its redundancy (timed), the others' generations there", file=out)
        print("before and the others only serving: one node's work with the machine to itself, as each node of a cluster", file=out)
        print("has its own disk and CPUs (n0 then does not serve its own data to the others, which a cluster node does at", file=out)
        print("the same time).", file=out)
    print(f"{'level':18s} {'MiB/s':>9s} {'x local':>8s} {'in run':>7s} {'bound':>6s} {'target':>8s} {'local s':>8s} {'redund. s':>9s} {'bytes x':>8s} "
          f"{'cpu ms/MiB':>15s}", file=out)
    targets = {"local": "", "partner": ">= 0.50", "xor": ">= 0.75"}
    for m in modes:
        print(f"{m:18s} {med[m]:9.1f} {ratio[m]:8.2f} {in_run[m]:7.2f} {bound[m]:6.3f} {targets[m.partition('/')[0].removesuffix(ALONE)]:>8s} "
              f"{median(m, 'local_seconds'):8.2f} {median(m, 'redundancy_seconds'):9.2f} {stored[m.removesuffix(ALONE)] / stored['local']:8.3f} "
              f"{median(m, 'local_cpu_ms_per_mib'):6.2f} + {median(m, 'redundancy_cpu_ms_per_mib'):5.2f}", file=out)
    if profiles:
        import pstats

        for mode, path in profiles.items():
            print(f"\n--- cProfile of n0's redundancy phase, {mode}, last run ({path}); by own time:", file=out)
            pstats.Stats(path, stream=out).sort_stats("tottime").print_stats(12)
    if args.json:
        print(json.dumps({"nodes": args.nodes, "mib": args.mib, "set_size": k, "load": load, "runs": runs, "median_mib_s": med,
                          "ratio": ratio, "in_run_ratio": in_run, "bound": bound}))


if __name__ == "__main__":
    main()
