"""Checkpoint redundancy on a real cluster (issue 16): generations move from
*complete* to *protected*, written behind the job.

Real daemons on 127.0.0.x, real ranks, files on each node's disk; the
redundancy is pulled from node to node over the daemons' links. What a user
relies on: a job's generation becomes *protected* (``gang ckpt ls`` says so,
with its level) and the redundancy files are where the plan says, of the
sizes it says; a write that dies halfway leaves the generation complete,
never protected; retention never drops the newest protected generation for
newer ones that are only complete; and the job runs on while the write is
under way (a next checkpoint even completes meanwhile).
"""

from __future__ import annotations

import json
import math
import os
import stat
import sys
import time
from pathlib import Path

import pytest
from ckpthelpers import checkpoint, gen_dir, generations, kill_what_is_left, submit
from conftest import tmpfs, wait_for
from test_control_plane import coordinator_seen_by

from gangd import ckptstore
from gangd.redundancy import plan as rplan
from gangd.redundancy import transfer, xor

PY = sys.executable
ROOT = Path(__file__).resolve().parent.parent
JOB = str(ROOT / "tests" / "jobs" / "ckptjob.py")
LONG = [JOB, "--steps", "100000", "--mb", "1", "--sleep", "0.02"]


def generation(cluster, job: int, gen: int) -> dict:
    return next(g for g in generations(cluster, job) if g["gen"] == gen)


def wait_gen(cluster, job: int, gen: int, predicate, what: str, timeout: float = 60) -> dict:
    def ready():
        entry = generation(cluster, job, gen)
        return entry if predicate(entry) else None

    return wait_for(ready, timeout, what)


def placement(cluster, job: int) -> list[str]:
    return list(dict.fromkeys(cluster.wait_state(job, "RUNNING")["placement"]))


def data_size(cluster, node: str, lineage: int, gen: int) -> int:
    return xor.data_size(ckptstore.read_manifest(gen_dir(cluster, node, lineage, gen)))


def test_xor_and_partner_generations_become_protected_with_the_files_the_plan_says(make_cluster):
    cluster = make_cluster(3, cores=2, time_slice=0.1)
    try:
        refused = cluster.gang("submit", "-n", 1, "--ckpt-redundancy", "xor", "--", PY, JOB)
        assert refused.returncode != 0
        assert "must span at least 2 nodes" in refused.stderr and "one rank" in refused.stderr, refused.stderr
        refused = cluster.gang("submit", "-n", 2, "-w", "n2", "--ckpt-redundancy", "partner", "--", PY, JOB)
        assert refused.returncode != 0 and "--nodelist names one node" in refused.stderr, refused.stderr

        x = submit(cluster, LONG, 3, "--per-node", 1, "--ckpt-redundancy", "xor")
        p = submit(cluster, LONG, 2, "-w", "n1,n3", "--ckpt-redundancy", "partner")
        x_nodes, p_nodes = placement(cluster, x), placement(cluster, p)
        assert sorted(x_nodes) == ["n1", "n2", "n3"] and p_nodes == ["n1", "n3"]
        time.sleep(1)
        taken = {}
        for job in (x, p):
            gen = checkpoint(cluster, job)
            assert gen["state"] == "complete", gen
            taken[job] = gen["gen"]  # (1, unless a request came before the ranks' ckpt.init(): a refused one uses its number)
        gx_n, gp_n = taken[x], taken[p]
        gx = wait_gen(cluster, x, gx_n, lambda g: g["state"] != "complete" or g.get("redundancy"), "job x's generation protected")
        gp = wait_gen(cluster, p, gp_n, lambda g: g["state"] != "complete" or g.get("redundancy"), "job p's generation protected")
        assert gx["state"] == "protected" and gx["level"] == "xor", gx.get("redundancy")
        assert gp["state"] == "protected" and gp["level"] == "partner", gp

        # XOR: every member holds its parity (1/(n-1) of the set's largest data) and the set's meta.
        plan = rplan.make_plan(x_nodes, "xor")
        sizes = {n: data_size(cluster, n, x, gx_n) for n in x_nodes}
        chunk = math.ceil(max(sizes.values()) / (len(x_nodes) - 1))
        assert min(sizes.values()) > 1 << 20  # (1 MiB of state per rank: a real parity)
        for node in x_nodes:
            directory = gen_dir(cluster, node, x, gx_n)
            assert (directory / "redundancy" / "xor.parity").stat().st_size == chunk
            meta = xor.read_meta(directory)
            assert meta.nodes == plan.set_of(node) and meta.nodes[meta.index] == node and meta.sizes == tuple(sizes[n] for n in meta.nodes)
        # Partner: each node holds a whole copy of its ring predecessor's files.
        plan = rplan.make_plan(p_nodes, "partner")
        for node in p_nodes:
            source = plan.partnered_by(node)
            copy = gen_dir(cluster, node, p, gp_n) / transfer.partner_prefix(source)
            theirs = ckptstore.read_manifest(gen_dir(cluster, source, p, gp_n))
            assert ckptstore.read_manifest(copy) == theirs
            for name, (size, _) in theirs.files.items():
                assert (copy / name).stat().st_size == size
            assert ckptstore.verify(copy) == []
            # The copy holds the job's network contexts and token: root's alone, its ranks' states too.
            for path in [copy.parent, copy, copy / "ranks", *(copy / name for name in theirs.files)]:
                info = path.lstat()
                assert (info.st_uid, stat.S_IMODE(info.st_mode)) == (0, 0o700 if path.is_dir() else 0o600), path

        listing = cluster.gang("ckpt", "ls", x, check=True).stdout
        row = next(line for line in listing.splitlines() if line.split()[:1] == [str(gx_n)])
        assert "protected" in row and "xor" in row, listing
        assert "partner" in cluster.gang("ckpt", "ls", p, check=True).stdout

        # A protected generation is what a restart uses.
        cluster.gang("kill", p, check=True)
        cluster.wait_state(p, ("KILLED", "FAILED"))
        restarted = cluster.gang("restart", p, "-q", check=True)
        again = int(restarted.stdout)
        assert cluster.wait_state(again, "RUNNING")["restart_of"]["gen"] == gp_n
    finally:
        kill_what_is_left(cluster)


def test_a_redundancy_write_whose_source_dies_halfway_leaves_the_generation_complete(make_cluster, points):
    cluster = make_cluster(3, cores=2, time_slice=0.1)
    try:
        leader = coordinator_seen_by(cluster, "n1")
        pair = [n for n in sorted(cluster.files) if n != leader]
        job = submit(cluster, LONG, 2, "-w", ",".join(pair), "--ckpt-redundancy", "partner")
        cluster.wait_state(job, "RUNNING")
        time.sleep(1)
        (points / "ckpt_file_read").touch()  # the first node asked for a data file dies, as a crash would
        gen = checkpoint(cluster, job)
        assert gen["state"] == "complete", gen
        entry = wait_gen(cluster, job, 1, lambda g: g["state"] != "complete" or g.get("redundancy"), "the redundancy write's failure")
        assert entry["state"] == "complete" and entry["redundancy"].startswith("failed:"), entry
        dead = [n for n in pair if cluster.files[n].pid() is None or "failpoint ckpt_file_read reached" in cluster.log(n)]
        assert len(dead) == 1, dead
        assert dead[0] in entry["redundancy"] or any(n in entry["redundancy"] for n in pair), entry
        survivor = next(n for n in pair if n != dead[0])
        # Nothing there counts as the survivor's share: no copy's MANIFEST landed.
        copy = gen_dir(cluster, survivor, job, 1) / transfer.partner_prefix(dead[0])
        assert not (copy / ckptstore.MANIFEST).exists()
        time.sleep(2)  # (nothing later turns it protected)
        entry = generation(cluster, job, 1)
        assert entry["state"] == "complete", entry
        assert "stays complete, not protected" in cluster.log(leader)
    finally:
        kill_what_is_left(cluster)


def test_the_job_runs_on_during_the_write_and_retention_keeps_the_newest_protected(make_cluster, points):
    cluster = make_cluster(2, cores=2, time_slice=0.1)
    try:
        job = submit(cluster, LONG, 2, "-N", 2)  # the default (auto) on two nodes: partner
        nodes = placement(cluster, job)
        time.sleep(1)
        # Through the command, as before ckpthelpers asked in-process: the command's start-up is part of
        # the time this test gives the ranks to reach ckpt.init() (generation 1 must be this one).
        first = json.loads(cluster.gang("checkpoint", job, "--json", timeout=90).stdout)
        assert first["state"] == "complete", first
        g1 = wait_gen(cluster, job, 1, lambda g: g["state"] == "protected", "generation 1 protected")
        assert g1["level"] == "partner"

        (points / "protect.hold").touch()  # the next writes wait before they start
        second, third = checkpoint(cluster, job), checkpoint(cluster, job)
        # Both completed while generation 2's redundancy write was pending: the
        # job was not blocked by it, and computed on (later iterations).
        assert second["state"] == third["state"] == "complete", (second, third)
        assert first["iteration"] < second["iteration"] < third["iteration"]
        states = {g["gen"]: g["state"] for g in generations(cluster, job)}
        assert states == {1: "protected", 2: "complete", 3: "complete"}  # keep = 2, and the protected one stays too
        ls = cluster.gang("ckpt", "ls", job, check=True).stdout
        assert "partner (writing)" in ls, ls
        fourth = checkpoint(cluster, job)
        assert fourth["state"] == "complete", fourth
        states = {g["gen"]: g["state"] for g in generations(cluster, job)}
        assert states == {1: "protected", 2: "removed", 3: "complete", 4: "complete"}, states
        for node in nodes:
            assert (gen_dir(cluster, node, job, 1) / "redundancy").is_dir()
            assert not gen_dir(cluster, node, job, 2).exists()

        os.unlink(points / "protect.hold")
        wait_for(lambda: {g["gen"]: g["state"] for g in generations(cluster, job)} == {1: "removed", 2: "removed", 3: "protected", 4: "protected"},
                 60, "generations 3 and 4 protected, and then 1 removed with its redundancy")
        for node in nodes:
            assert not gen_dir(cluster, node, job, 1).exists()  # the generation went, its partner copy with it
            assert (gen_dir(cluster, node, job, 4) / "redundancy").is_dir()
        assert generation(cluster, job, 2).get("state") == "removed"  # its write found it gone: never protected
    finally:
        kill_what_is_left(cluster)



# ---------------------------------------------------------------- the level: per job, per cluster


def test_the_level_is_checked_where_it_comes_in(tmp_path):
    from gangd import jobs
    from gangd.daemon import config as cfg

    nodes = ["n1", "n2", "n3"]
    spec = {"argv": ["x"], "nranks": 3}
    assert jobs.JobSpec.from_wire(spec, nodes).ckpt_redundancy is None  # the cluster's default
    assert jobs.JobSpec.from_wire({**spec, "ckpt_redundancy": "xor"}, nodes).as_spec()["ckpt_redundancy"] == "xor"
    for bad, says in [({"ckpt_redundancy": "raid6"}, "one of local, partner, xor"),
                      ({"ckpt_redundancy": "xor", "nodes": 1}, "--nodes is 1"),
                      ({"ckpt_redundancy": "partner", "nranks": 1}, "one rank")]:
        with pytest.raises(jobs.BadSpec, match=says):
            jobs.JobSpec.from_wire({**spec, **bad}, nodes)
    with pytest.raises(jobs.BadSpec, match="the cluster has one node"):
        jobs.JobSpec.from_wire({**spec, "ckpt_redundancy": "xor"}, ["n1"])
    assert jobs.JobSpec.from_wire({**spec, "ckpt_redundancy": "local", "nranks": 1}, ["n1"]).ckpt_redundancy == "local"

    base = cfg.load(None, node_name="n1", nodes=(cfg.NodeSpec("n1", "127.0.0.1", 1, 1),), etcd_endpoints="http://127.0.0.1:1")
    assert base.checkpoint_redundancy == "auto"
    path = tmp_path / "gangd.toml"
    path.write_text(cfg.render(base).replace("[etcd]", '[checkpoint]\nredundancy = "partner"\n\n[etcd]'))
    assert cfg.load(path).checkpoint_redundancy == "partner"
    assert 'redundancy = "partner"' in cfg.render(cfg.load(path))
    path.write_text(cfg.render(base).replace("[etcd]", '[checkpoint]\nredundancy = "mirror"\n\n[etcd]'))
    with pytest.raises(cfg.ConfigError, match=r"\[checkpoint\] redundancy must be one of auto, local, partner, xor"):
        cfg.load(path)


def test_a_redundancy_write_the_disk_cannot_take_is_refused_and_the_generation_stays_complete(make_cluster):
    """A partner copy is as large as the partner's own files: on a disk that
    takes this node's generation but not a copy of the other's beside it (and
    the reserve gangd keeps), the write is refused before a byte lands."""
    cluster = make_cluster(2, cores=2)
    directory = cluster.dir / "n2" / "state" / "checkpoints" / "n2"  # (each node its own, see checkpoint_dir)
    os.makedirs(directory, exist_ok=True)
    with tmpfs(directory, "14m", "0711"):
        # 6 MiB of state per node: n2's own generation fits (14 MiB), a copy of n1's beside it does not with the reserve (3.5 MiB)
        job = submit(cluster, [JOB, "--steps", "100000", "--mb", "6", "--sleep", "0.02"], 2, "--per-node", 1, "--ckpt-redundancy", "partner")
        assert placement(cluster, job) == ["n1", "n2"]
        time.sleep(1)
        gen = checkpoint(cluster, job)
        assert gen["state"] in ("complete", "protected"), gen
        entry = wait_gen(cluster, job, gen["gen"], lambda e: str(e.get("redundancy", "")).startswith("failed") or e["state"] != "complete",
                         "the redundancy write to end", 60)
        assert entry["state"] == "complete", entry
        assert "bytes free" in entry["redundancy"] and "the redundancy needs" in entry["redundancy"] and "n2" in entry["redundancy"], entry
        assert not (gen_dir(cluster, "n2", job, gen["gen"]) / "redundancy" / "partner-n1" / "MANIFEST").exists()
        kill_what_is_left(cluster)


def _numpy_loaded(pid: int) -> bool:
    """Whether the process has numpy's core extension mapped (it imported numpy)."""
    return "_multiarray_umath" in Path(f"/proc/{pid}/maps").read_text()


def test_a_daemon_loads_the_parity_code_while_an_xor_generation_is_taken_not_after(make_cluster, points):
    """The daemon starts without numpy; the XOR needs it. A node of a job that
    may be XOR-protected loads it when the generation begins, so the redundancy
    phase (held here before it starts) does not pay the import; a job that
    will never XOR does not load it."""
    cluster = make_cluster(3, cores=2, time_slice=0.1)
    try:
        daemons = {n: cluster.files[n].pid() for n in ("n1", "n2", "n3")}
        assert all(daemons.values()) and not any(_numpy_loaded(pid) for pid in daemons.values())
        (points / "protect.hold").touch()  # no redundancy write starts: whatever loads numpy, it is not the parity
        p = submit(cluster, LONG, 3, "--per-node", 1, "--ckpt-redundancy", "partner")
        time.sleep(1)
        assert checkpoint(cluster, p)["state"] == "complete"
        assert not any(_numpy_loaded(pid) for pid in daemons.values())
        cluster.gang("kill", p, check=True)

        x = submit(cluster, LONG, 3, "--per-node", 1, "--ckpt-redundancy", "xor")
        time.sleep(1)
        gen = checkpoint(cluster, x)
        assert gen["state"] == "complete", gen
        wait_for(lambda: all(_numpy_loaded(pid) for pid in daemons.values()), 30, "numpy loaded on every node of the XOR job")
        assert generation(cluster, x, gen["gen"])["state"] == "complete"  # (the redundancy write is still held)
        (points / "protect.hold").unlink()
        assert wait_gen(cluster, x, gen["gen"], lambda g: g["state"] == "protected", "the XOR generation protected")["level"] == "xor"
    finally:
        (points / "protect.hold").unlink(missing_ok=True)
        kill_what_is_left(cluster)
