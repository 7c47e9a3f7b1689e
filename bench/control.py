"""The control plane's costs: submit throughput against history size, failover, listing.

On a local cluster with its own etcd (real fsyncs, the daemons' real code):

  submit       one-rank jobs (``true``) submitted through the Python API by
               ``--clients`` concurrent clients spread over the nodes
               (client i connects to node i mod nodes; all to the coordinator
               with --clients-to coordinator), jobs/s accepted, with 0,
               10 000 and 100 000 ended jobs in the history (written into
               etcd's history keys beforehand, as a long-lived cluster's
               would be, in batches). The jobs run too; the time until all
               of them ended is printed beside.
  baseline     in the same run, the same transaction a submit commits
               (counter + record + environment), sent straight to etcd by
               one client: what no submit can beat. Printed as a ratio, and
               measured again before each round (the machine is shared:
               the load average is printed beside each round too).
  failover     SIGKILL to the coordinator's daemon, then submits through
               another node until one is accepted: the time between.
  listing      wall time of `gang ps`, `gang ps --all` and `gang ps --all
               -n 100` (a subprocess each) with the history at its largest:
               until the first row printed (pages are printed as they
               arrive) and until the end.

Targets (issue 15): >= 300 jobs/s, the rate at 100 000 within 10 % of the
rate at 0, failover within the lease TTL + 1 s.

    python bench/control.py [--jobs 1500] [--clients 16] [--history 0,10000,100000] [--nodes 2] [--clients-to spread|coordinator]
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import trio

from gangd import jobs
from gangd.client import cluster as local
from gangd.client.api import connect
from gangd.daemon import config as cfg
from gangd.daemon.store import Keys
from gangd.daemon.store.jobtable import HistoryBlock, block_first, pack
from gangd.etcd.client import Compare, Etcd, Op

ENV = {"PATH": "/usr/bin:/bin", "HOME": "/root", "LANG": "C.UTF-8"}
OLD_HISTORY = False  # (--old-history: seed the history as gangd before the blocks kept it)


def etcd_of(directory: Path) -> tuple[Etcd, Keys]:
    settings = cfg.load(directory / "n1" / "gangd.toml").etcd
    etcd = Etcd(list(settings.endpoints), user=settings.user, password=settings.read_password())
    return etcd, Keys(settings.prefix)


async def seed_history(directory: Path, total: int, say) -> None:
    """Make the history hold ``total`` ended jobs (ids after the counter's), and move the counter past them.

    As the daemons' own retirement keeps them: blocks of BLOCK_IDS ids, one
    key each (``--old-history``: one key per job, as gangd before the blocks did)."""
    etcd, keys = etcd_of(directory)
    async with etcd:
        counter = await etcd.get(keys.ids)
        first = (int(counter.value) if counter else 0) + 1
        hot = (await etcd.range(keys.jobs, prefix=True, count_only=True)).count
        have = first - 1 - hot  # (every earlier id is in the history: the previous rounds' jobs have all retired)
        todo = total - have
        if todo <= 0:
            return
        began = time.monotonic()
        ops: list[Op] = []
        block = HistoryBlock(block_first(first))
        kv = await etcd.get(keys.block(block.first))
        if kv is not None:  # (the previous round's jobs retired into it: they stay)
            block = HistoryBlock.unpack(block.first, kv.value, kv.mod_revision)
        for job_id in range(first, first + todo):
            record = jobs.new_record(job_id=job_id, spec={"argv": ["true"], "nranks": 1, "name": "history"}, owner_uid=0, owner_name="root", owner_gid=0)
            record.pop("env", None)
            record.update(state=jobs.DONE, placement=["n1"], ranks=[{"code": 0}], started=time.time() - 60, ended=time.time() - 30)
            if OLD_HISTORY:
                ops.append(Op.put(keys.past(job_id), pack(record)))
            else:
                if block_first(job_id) != block.first:
                    ops.append(Op.put(keys.block(block.first), block.pack()))
                    block = HistoryBlock(block_first(job_id))
                block.members[job_id] = pack(record)
            if len(ops) >= (100 if OLD_HISTORY else 10):  # (etcd takes requests up to 1.5 MiB)
                await etcd.txn([], ops)
                ops = []
        if block.members:  # (a block the next round's retirements append to: as a live cluster's last one)
            ops.append(Op.put(keys.block(block.first), block.pack()))
        if ops:
            await etcd.txn([], ops)
        last = first + todo - 1
        current = await etcd.get(keys.ids)
        await etcd.txn([Compare.mod_revision(keys.ids) == (current.mod_revision if current else 0)], [Op.put(keys.ids, str(last))])
        keys_now = (await etcd.range(keys.prefix + "/", prefix=True, count_only=True)).count
        say(f"  seeded {todo} history records in {time.monotonic() - began:.1f} s ({keys_now} keys in gangd's etcd prefix now)")


async def baseline_txn_rate(directory: Path, count: int) -> float:
    """The submit's own transaction, straight to etcd, one client: txn/s."""
    etcd, keys = etcd_of(directory)
    base = Keys(keys.prefix + "-baseline")
    async with etcd:
        record = jobs.new_record(job_id=1, spec={"argv": ["true"], "nranks": 1}, owner_uid=0, owner_name="root", owner_gid=0)
        record.pop("env", None)
        last, counted_at = 0, 0
        began = time.monotonic()
        for _ in range(count):
            job_id = last + 1
            result = await etcd.txn(
                [Compare.mod_revision(base.ids) == counted_at, Compare.version(base.job(job_id)) == 0],
                [Op.put(base.ids, str(job_id)), Op.put(base.job(job_id), pack(dict(record, id=job_id))), Op.put(base.env(job_id), pack(ENV))],
            )
            assert result.succeeded
            last, counted_at = job_id, result.revision
        rate = count / (time.monotonic() - began)
        await etcd.delete(base.prefix + "/", prefix=True)
    return rate


async def submit_rate(directory: Path, total: int, clients: int, to: str) -> tuple[float, float, list[tuple[dict, dict]]]:
    """jobs/s accepted, seconds until every one of them ended, and what each
    part of the cluster had used (:func:`cpu_by_role`, :func:`etcd_counters`)
    before, when the last was accepted, and when all had ended."""
    ids: list[int] = []
    remaining = [total]
    nodes = local.node_files(directory)
    leader = await coordinator_of(directory)
    if to == "coordinator":
        nodes = [n for n in nodes if n.name == leader] or nodes  # (none yet: an election under way)

    def sample() -> tuple[dict, dict]:
        return cpu_by_role(directory, leader), etcd_counters(directory)

    async def client(i: int):
        # "spread": over the nodes, as a cluster's users are: each node serves
        # its clients' connections and forwards their submits to the
        # coordinator. "coordinator": all to it (no forwarding: the best case).
        async with connect(sockets=[str(nodes[i % len(nodes)].socket)]) as gang:
            while remaining[0] > 0:
                remaining[0] -= 1
                ids.append((await gang.submit(["true"], 1, cwd="/", env=ENV))["id"])

    samples = [sample()]
    began = time.monotonic()
    async with trio.open_nursery() as nursery:
        for i in range(clients):
            nursery.start_soon(client, i)
    accepted = time.monotonic() - began
    samples.append(sample())
    async with connect(directory) as gang:
        # Until none of them is in the hot table unended (a job leaves it only
        # ended, for the history): a listing a second, not a wait per job, so
        # the CPU measured after the last accept is the jobs' own.
        mine = set(ids)
        await gang.wait_done(max(ids))  # (jobs end about in id order: the listings below are few)
        while any(r["id"] in mine and r["state"] in jobs.ACTIVE_STATES for r in await gang.jobs()):  # noqa: ASYNC110 -- polling another process
            await trio.sleep(1)
        failed = [r["id"] for r in await gang.jobs() if r["id"] in mine and r["state"] != jobs.DONE]
        assert not failed, f"jobs {failed[:10]} did not end DONE"
    finished = time.monotonic() - began
    samples.append(sample())
    assert len(set(ids)) == len(ids) == total, "a job id was handed out twice"
    return total / accepted, finished, samples


async def coordinator_of(directory: Path) -> str:
    async with connect(directory) as gang:
        return next((r["name"] for r in await gang.nodes() if r["coordinator"]), "none")


async def failover(directory: Path, ttl: int) -> tuple[float, str, str]:
    async with connect(directory) as gang:
        leader = next(r["name"] for r in await gang.nodes() if r["coordinator"])
    other = next(n for n in local.node_files(directory) if n.name != leader)
    pid = next(n for n in local.node_files(directory) if n.name == leader).pid()
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    while True:
        try:
            async with connect(sockets=[str(other.socket)]) as gang:
                with trio.fail_after(ttl + 10):
                    await gang.submit(["true"], 1, cwd="/", env=ENV)
            break
        except Exception:  # noqa: BLE001 -- not yet: the election is still under way
            await trio.sleep(0.05)
    return time.monotonic() - killed, leader, other.name


ETCD_COUNTERS = {
    # what etcd did: its own counters (GET /metrics), summed over their labels
    "txn": ('grpc_server_handled_total', 'grpc_method="Txn"'),
    "range": ('grpc_server_handled_total', 'grpc_method="Range"'),
    "put": ("etcd_mvcc_put_total", ""),
    "delete": ("etcd_mvcc_delete_total", ""),
    "watch events": ("etcd_debugging_mvcc_events_total", ""),
    "fsync": ("etcd_disk_wal_fsync_duration_seconds_count", ""),
}


def etcd_counters(directory: Path) -> dict[str, float]:
    """etcd's request and event counters (from its /metrics), to count what one job costs it."""
    import httpx

    endpoint = cfg.load(directory / "n1" / "gangd.toml").etcd.endpoints[0]
    try:
        text = httpx.get(endpoint.rstrip("/") + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return {}
    out = dict.fromkeys(ETCD_COUNTERS, 0.0)
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        for what, (name, label) in ETCD_COUNTERS.items():
            if line.startswith(name) and line[len(name):len(name) + 1] in ("{", " ") and label in line:
                out[what] += float(line.rsplit(" ", 1)[1])
    return out


def cpu_by_role(directory: Path, coordinator: str) -> dict[str, float]:
    """CPU seconds used so far by each part of the cluster: the coordinator's
    daemon, the other daemons, the ranks (the daemons' reaped children),
    etcd, and this process (the clients)."""
    out = dict.fromkeys(("coordinator", "other daemons", "ranks", "etcd", "clients"), 0.0)
    for n in local.node_files(directory):
        try:
            times = psutil.Process(n.pid()).cpu_times()
        except (psutil.Error, ValueError):
            continue
        out["coordinator" if n.name == coordinator else "other daemons"] += times.user + times.system
        out["ranks"] += times.children_user + times.children_system
    out["etcd"] = cpu_seconds(directory)[1]
    me = psutil.Process().cpu_times()
    out["clients"] = me.user + me.system
    return out


def breakdown(before: tuple[dict, dict], after: tuple[dict, dict], jobs_: int) -> str:
    """What one job cost, by process (CPU ms) and in etcd requests and events."""
    cpu = {k: 1000 * (after[0][k] - before[0][k]) / jobs_ for k in after[0]}
    parts = ", ".join(f"{k} {v:.1f}" for k, v in cpu.items())
    etcd = ", ".join(f"{k} {(after[1].get(k, 0) - before[1].get(k, 0)) / jobs_:.1f}" for k in ETCD_COUNTERS if k in after[1])
    return f"CPU ms per job: {parts} (total {sum(cpu.values()):.1f}); etcd per job: {etcd}"


def cpu_seconds(directory: Path) -> tuple[float, float]:
    """CPU time used so far by the cluster's daemons and by its etcd: what a
    round costs, whatever else the (shared) machine is doing meanwhile."""
    def used(pid: int | None) -> float:
        try:
            times = psutil.Process(pid).cpu_times()
        except (psutil.Error, ValueError):
            return 0.0
        return times.user + times.system

    daemons = sum(used(n.pid()) for n in local.node_files(directory))
    etcd = sum(used(p.pid) for p in psutil.process_iter(["name", "cmdline"])
               if p.info["name"] == "etcd" and str(directory) in " ".join(p.info["cmdline"] or []))
    return daemons, etcd


def timed(argv: list[str]) -> tuple[float, float, int]:
    """Seconds until the command printed its first job row, until it ended, and the rows it printed."""
    began = time.monotonic()
    first = None
    rows = 0
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.split(" ", 1)[0].isdigit():
                rows += 1
                if first is None:
                    first = time.monotonic() - began
    if proc.returncode != 0:
        raise RuntimeError(f"{argv} exited {proc.returncode}")
    took = time.monotonic() - began
    return (first if first is not None else took), took, rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=1500)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--history", default="0,10000,100000")
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--clients-to", choices=("spread", "coordinator"), default="spread",
                        help="spread: client i connects to node i mod nodes; coordinator: all to the coordinator")
    parser.add_argument("--baseline", type=int, default=1000, help="transactions of the baseline")
    parser.add_argument("--old-history", action="store_true",
                        help="seed the history with one key per job, as gangd before the history blocks kept it")
    args = parser.parse_args()
    global OLD_HISTORY
    OLD_HISTORY = args.old_history
    sizes = [int(x) for x in args.history.split(",")]
    directory = Path(tempfile.mkdtemp(prefix="gangd-bench-control-")) / "cluster"
    say = print
    # Short retention: each round's jobs leave the hot table before the next round.
    local.up(directory, args.nodes, cores=8, job_retention=3.0)
    ttl = cfg.load(directory / "n1" / "gangd.toml").etcd.lease_ttl
    try:
        print(f"{args.nodes}-node local cluster, etcd at {', '.join(cfg.load(directory / 'n1' / 'gangd.toml').etcd.endpoints)}, lease TTL {ttl} s")
        where = "the coordinator" if args.clients_to == "coordinator" else ", ".join(n.name for n in local.node_files(directory))
        print(f"coordinator: {trio.run(coordinator_of, directory)}; the clients connect to {where}")
        baseline = trio.run(baseline_txn_rate, directory, args.baseline)
        print(f"baseline: the submit's transaction straight to etcd, one client: {baseline:.0f} txn/s")
        rates = {}
        for size in sizes:
            trio.run(seed_history, directory, size, say)
            time.sleep(5)  # the previous round's jobs retire (job_retention 3 s)
            # etcd itself, now (the machine is shared, and etcd's own costs may change with its size).
            here = trio.run(baseline_txn_rate, directory, max(100, args.baseline // 4))
            rate, finished, (before, accepting, ended) = trio.run(submit_rate, directory, args.jobs, args.clients, args.clients_to)
            rates[size] = rate
            print(f"history {size:>7}: {rate:7.0f} jobs/s accepted ({rate / baseline:.2f}x the baseline txn rate, "
                  f"{rate / here:.2f}x this round's {here:.0f} txn/s); "
                  f"all {args.jobs} ended after {finished:.1f} s ({args.jobs / finished:.0f} jobs/s end to end); "
                  f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cpus")
            print(f"    until the last was accepted: {breakdown(before, accepting, args.jobs)}")
            print(f"    until all had ended:         {breakdown(before, ended, args.jobs)}")
        if 0 in rates and sizes[-1] != 0:
            print(f"rate at {sizes[-1]} / rate at 0: {rates[sizes[-1]] / rates[0]:.2f}")
        gang = [sys.executable, "-m", "gangd.client.cli", "--cluster", str(directory)]
        for what in (["ps"], ["ps", "--all"], ["ps", "--all", "-n", "100"]):
            first, took, rows = timed([*gang, *what])
            print(f"gang {' '.join(what)}: {rows} rows, the first after {first:.2f} s, all after {took:.2f} s")
        took, leader, other = trio.run(failover, directory, ttl)
        print(f"failover: SIGKILL to the coordinator ({leader}) -> next submit accepted through {other}: {took:.2f} s "
              f"(lease TTL {ttl} s; target <= {ttl + 1} s)")
    finally:
        local.down(directory)


if __name__ == "__main__":
    main()
