"""Scheduling counts the nodes that are alive, and forgets those the configuration drops.

A cluster loses nodes: to a crash for a while, or for good when the operator
takes one out of the configuration. Neither may stop the cluster serving
the jobs it can still run: a job that cannot fit because a node is down
waits without holding up the smaller jobs behind it, and a coordinator
that takes over with records naming a node it no longer knows ends those
jobs with the reason and goes on.
"""

from __future__ import annotations

import os
import re
import signal

from conftest import wait_for

from gangd.daemon import config as cfg


def submit(cluster, *args) -> int:
    result = cluster.gang("submit", *args, check=True)
    return int(re.search(r"\d+", result.stdout).group())


def test_a_job_waiting_for_a_dead_node_does_not_block_the_jobs_behind_it(make_cluster):
    cluster = make_cluster(3, cores=2, lease_ttl=3)
    cluster.kill_node("n3")
    wait_for(lambda: not any(n["name"] == "n3" and n["state"] == "up" for n in cluster.ask(lambda gang: gang.nodes(), "nodes")), 30, "n3 to be down")
    pinned = submit(cluster, "-n", 2, "-w", "n3", "--", "true")  # needs the dead node itself
    wide = submit(cluster, "-n", 6, "--", "true")  # needs every node's cores: n3's too
    small = submit(cluster, "-n", 2, "--", "true")  # fits on the live nodes
    cluster.wait_state(small, "DONE", timeout=30)
    assert cluster.job(pinned)["state"] == "QUEUED" and cluster.job(wide)["state"] == "QUEUED"
    # The node comes back: the waiting jobs run.
    cluster.start_daemon("n3")
    cluster.wait_state(pinned, "DONE", timeout=60)
    cluster.wait_state(wide, "DONE", timeout=60)


def test_a_node_dropped_from_the_configuration_is_forgotten_cleanly(make_cluster):
    cluster = make_cluster(3, cores=2, lease_ttl=3)
    on_n3 = submit(cluster, "-n", 1, "-w", "n3", "--", "sleep", "300")
    on_n1 = submit(cluster, "-n", 1, "-w", "n1", "--", "sleep", "300")
    for job in (on_n3, on_n1):
        cluster.wait_state(job, "RUNNING")
    # The whole cluster goes down hard, and comes back without n3.
    for node in ("n1", "n2", "n3"):
        os.kill(cluster.daemon_pid(node), signal.SIGKILL)
    for node in ("n1", "n2"):
        path = cluster.files[node].config
        config = cfg.load(path)
        text = cfg.render(config.__class__(**{**config.__dict__, "nodes": tuple(n for n in config.nodes if n.name != "n3")}))
        path.write_text(text)
        cluster.start_daemon(node)
    wait_for(lambda: cluster.gang("nodes").returncode == 0, 30, "the daemons to answer again")
    # (until the dropped n3's lease runs out, etcd may still name it the coordinator: wait for one of the others)
    wait_for(lambda: any(r["coordinator"] and r["name"] in ("n1", "n2") for r in cluster.ask(lambda gang: gang.nodes(), "nodes")), 30,
             "a coordinator among the nodes left")
    record = cluster.wait_state(on_n3, "FAILED", timeout=60)
    assert "n3" in record["reason"] and "configuration" in record["reason"], record
    assert [n["name"] for n in cluster.gang_json("nodes")["nodes"]] == ["n1", "n2"]
    later = submit(cluster, "-n", 4, "--", "true")
    cluster.wait_state(later, "DONE", timeout=60)
    cluster.gang("kill", on_n1)
    cluster.wait_no_rank_processes(timeout=30)
