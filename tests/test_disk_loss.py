"""A node that comes back with its checkpoint disk wiped has lost its files (issue 16).

A node whose daemon dies and comes back on an empty disk (a replaced disk,
a reinstalled node) is *up*, so it is not "lost" the way a node whose
lease expired is; but its files of every generation are gone just the
same. Before, only a down node counted: the restart's verification found
the wiped node's files missing, marked the generation damaged, and
neither its redundancy nor its flushed copy was used. Now the coordinator
asks every live holder whether it still holds its files (``ckpt_holds``:
absence only; a file that is there but wrong is the verification's), and a
node that does not counts as down for that generation: its files are
rebuilt from the partner's copy or the XOR set, and the restart is
bit-identical. A generation with no redundancy whose files were on the
wiped node is marked damaged, saying which node lost them.

Real daemons on a 4-node cluster; the disk loss is a SIGKILLed daemon, its
checkpoint directory deleted, the daemon started again.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import trio
from ckpthelpers import TERMINAL, checkpoint, flip_byte, gen_dir, generations, hold, kill_what_is_left, reference, result_of, submit, wait_holding
from conftest import wait_for
from test_control_plane import coordinator_seen_by, json_on
from test_rebuild import ARGV, NRANKS, assert_laid_out_as_a_checkpoint, lose, protected_and_killed
from test_restart_anywhere import restart, wait_node

from gangd import ckptstore
from gangd.daemon.controlplane import REGISTER_HOLD
from gangd.daemon.rebuild import HOLD as REBUILD_HOLD
from gangd.daemon.rebuild import holds
from gangd.daemon.store import Keys
from gangd.etcd.client import EtcdError
from gangd.redundancy.plan import make_plan


@pytest.fixture
def gc(restart_gc):
    """The module's cluster (conftest's ``restart_cluster``), with no job and every node up after each test."""
    return restart_gc


def victim_of(gc) -> str:
    """A node of the job (n1-n3) that is not the coordinator (its loss is a takeover, tested elsewhere)."""
    leader = coordinator_seen_by(gc, "n1")
    return next(n for n in ("n3", "n2", "n1") if n != leader)


def wiped_and_back(gc, node: str) -> None:
    """The node's daemon SIGKILLed, its checkpoint disk emptied, the daemon started again."""
    os.kill(gc.daemon_pid(node), signal.SIGKILL)
    checkpoints = gc.dir / node / "state" / "checkpoints" / node
    shutil.rmtree(checkpoints)
    deadline = time.monotonic() + 30
    while gc.files[node].pid():
        assert time.monotonic() < deadline, f"{node}'s daemon did not die"
        time.sleep(0.1)
    gc.start_daemon(node)
    wait_node(gc, node, "up", timeout=60)
    # Up in etcd, and every node's link to it up again (the coordinator asks it about its files).
    for other in sorted(gc.files):
        if other == node:
            continue
        deadline = time.monotonic() + 60
        while (row := next(r for r in json_on(gc, other, "nodes")["nodes"] if r["name"] == node))["why"] or row["state"] != "up":
            assert time.monotonic() < deadline, f"{other} does not see {node} up: {row['why']}"
            time.sleep(0.2)


@pytest.mark.parametrize("level", ["partner", "xor"])
def test_a_node_back_with_a_wiped_disk_has_its_files_rebuilt_and_the_restart_is_bit_identical(gc, level):
    expected = reference(gc, ARGV, NRANKS)
    job, entry = protected_and_killed(gc, level)
    victim = victim_of(gc)
    wiped_and_back(gc, victim)
    answer = restart(gc, job)
    # The newest generation is used (not marked damaged, not skipped), the
    # wiped node's files rebuilt on the node outside the job, as for a node that is down.
    assert answer["gen"] == entry["gen"] and answer["rebuilt"] == {victim: "n4"} and not answer["skipped"], answer
    assert answer["placement"] == ["n4" if n == victim else n for n in entry["placement"]], answer
    assert result_of(gc, answer["record"]["id"], timeout=180) == expected
    lost_ranks = [r for r, n in enumerate(entry["placement"]) if n == victim]
    assert_laid_out_as_a_checkpoint(gen_dir(gc, "n4", job, entry["gen"]), "n4", lost_ranks, entry["iteration"])
    recorded = next(g for g in generations(gc, job) if g["gen"] == entry["gen"])
    assert recorded["state"] == "protected", recorded


def test_restarted_with_w_on_the_wiped_node_itself_it_takes_its_own_files_back(gc):
    """No other node asked for: the wiped node rebuilds its own files (it holds no manifest of them)."""
    expected = reference(gc, ARGV, NRANKS)
    job, entry = protected_and_killed(gc, "partner")
    victim = victim_of(gc)
    wiped_and_back(gc, victim)
    answer = restart(gc, job, "-w", "n1,n2,n3")
    assert answer["gen"] == entry["gen"] and answer["rebuilt"] == {victim: victim}, answer
    assert result_of(gc, answer["record"]["id"], timeout=180) == expected
    lost_ranks = [r for r, n in enumerate(entry["placement"]) if n == victim]
    assert_laid_out_as_a_checkpoint(gen_dir(gc, victim, job, entry["gen"]), victim, lost_ranks, entry["iteration"])


def test_a_rebuild_under_way_when_the_node_back_takes_its_key_from_its_previous_life_goes_on(gc, points):
    """A daemon started again while its previous life's lease still runs
    revokes that lease before it puts its key (the others see the node
    "down", then "up" a moment later). Before, that "down" closed the
    coordinator's connection to the node's *new* life too, and a rebuild
    under way on it failed ("connection to node n3 closed before
    'ckpt_rebuild' was answered"): a restart that came within ~30 ms of a
    node's return failed, and worked when run again. Now only a connection
    to the life that ended is closed. The new daemon (the only one started
    with this test's hold points) holds before it takes its key, then in
    the rebuild, so the call is under way across the down and up."""
    expected = reference(gc, ARGV, NRANKS)
    job, entry = protected_and_killed(gc, "partner")
    victim = victim_of(gc)
    leader = coordinator_seen_by(gc, "n1")
    (points / REGISTER_HOLD).touch()
    (points / REBUILD_HOLD).touch()
    with previous_lease_kept(gc, victim) as kept:
        wiped_and_back(gc, victim)  # (up: its previous life's key; its links: to the new life)
        wait_for(lambda: f"hold point {REGISTER_HOLD} reached" in gc.log(victim), 60, f"{victim}'s new daemon to hold before its key")
        with ThreadPoolExecutor(1) as pool:
            restarting = pool.submit(restart, gc, job, "-w", "n1,n2,n3")
            wait_for(lambda: f"hold point {REBUILD_HOLD} reached" in gc.log(victim), 120, f"the rebuild on {victim} to begin")
            downs = gc.log(leader).count(f"node {victim} is down")
            kept.set()  # (its previous lease is the new daemon's to revoke now)
            (points / REGISTER_HOLD).unlink()
            wait_for(lambda: gc.log(leader).count(f"node {victim} is down") > downs, 60, f"{leader} to see {victim}'s previous life end")
            wait_node(gc, victim, "up", timeout=60)
            (points / REBUILD_HOLD).unlink()
            answer = restarting.result(timeout=180)
    assert answer["gen"] == entry["gen"] and answer["rebuilt"] == {victim: victim}, answer
    assert result_of(gc, answer["record"]["id"], timeout=180) == expected


def test_a_node_back_whose_new_life_stalls_before_it_registers_fails_the_rebuild_rather_than_hang_it(gc, points):
    """The other side of the test above: a "down" keeps a connection to the
    node's new life, so one that then stalls before it takes its key (its
    disk hanging, say) must still be dropped once its heartbeats stop: the
    node is down in etcd and silent. The rebuild under way on it fails,
    naming the node, instead of waiting out the rebuild's timeout (10
    minutes). The new daemon holds before its key and in the rebuild; its
    previous lease is left to run out; then it is stopped (SIGSTOP)."""
    job, _ = protected_and_killed(gc, "partner")
    victim = victim_of(gc)
    leader = coordinator_seen_by(gc, "n1")
    (points / REGISTER_HOLD).touch()
    (points / REBUILD_HOLD).touch()
    try:
        with previous_lease_kept(gc, victim) as kept:
            wiped_and_back(gc, victim)
            wait_for(lambda: f"hold point {REGISTER_HOLD} reached" in gc.log(victim), 60, f"{victim}'s new daemon to hold before its key")
            with ThreadPoolExecutor(1) as pool:
                restarting = pool.submit(restart, gc, job, "-w", "n1,n2,n3", check=False)
                wait_for(lambda: f"hold point {REBUILD_HOLD} reached" in gc.log(victim), 120, f"the rebuild on {victim} to begin")
                downs = gc.log(leader).count(f"node {victim} is down")
                kept.set()  # (its previous lease runs out: the node is down, its new life not yet up)
                wait_for(lambda: gc.log(leader).count(f"node {victim} is down") > downs, 60, f"{leader} to see {victim}'s previous life end")
                os.kill(gc.daemon_pid(victim), signal.SIGSTOP)
                try:
                    answer = restarting.result(timeout=120)
                finally:
                    os.kill(gc.daemon_pid(victim), signal.SIGCONT)
        assert answer["returncode"] != 0, answer
        assert f"{victim}: connection to node {victim}" in answer["stderr"] and "closed before 'ckpt_rebuild' was answered" in answer["stderr"], answer
    finally:
        for name in (REGISTER_HOLD, REBUILD_HOLD):
            (points / name).unlink(missing_ok=True)
    wait_node(gc, victim, "up", timeout=60)


@contextlib.contextmanager
def previous_lease_kept(gc, node: str):
    """The node's lease in etcd kept alive from here (its daemon about to be
    killed: the test's time then cannot outlast the lease's TTL) until the
    event is set or the lease is revoked."""
    settings, key, done = gc.etcd_settings, Keys(gc.etcd_settings.prefix).node(node), threading.Event()

    async def keep():
        async with settings.client(timeout=10) as etcd:
            found = await etcd.get(key)
            assert found is not None and found.lease, f"{node} has no key in etcd"
            while not done.is_set():
                try:
                    await etcd.lease_keepalive(found.lease)
                except EtcdError:
                    return  # (revoked)
                await trio.sleep(0.5)

    with ThreadPoolExecutor(1) as pool:
        keeping = pool.submit(trio.run, keep)
        try:
            yield done
        finally:
            done.set()
            keeping.result(timeout=30)


def test_a_generation_without_redundancy_on_a_wiped_node_is_marked_lost_naming_the_node(gc):
    job, entry = protected_and_killed(gc, "local")
    victim = victim_of(gc)
    wiped_and_back(gc, victim)
    refused = restart(gc, job, check=False)
    assert refused["returncode"] != 0, refused
    assert f"node {victim} no longer holds its files" in refused["stderr"], refused["stderr"]
    recorded = next(g for g in generations(gc, job) if g["gen"] == entry["gen"])
    assert recorded["state"] == "damaged" and f"node {victim} no longer holds" in recorded["reason"], recorded


def test_a_damaged_partner_copy_leaves_the_generation_complete_not_protected_saying_why(gc):
    """The rebuild reads the partner's copy (over the bulk path, from the
    holder), finds it does not match: recorded in etcd, so no later restart
    counts on that redundancy again."""
    job, entry = protected_and_killed(gc, "partner")
    victim = victim_of(gc)
    holder = make_plan(list(dict.fromkeys(entry["placement"])), "partner").partner_of(victim)
    copy = gen_dir(gc, holder, job, entry["gen"]) / "redundancy" / f"partner-{victim}" / ckptstore.cluster_rank_file(
        next(r for r, n in enumerate(entry["placement"]) if n == victim))
    flip_byte(copy, 500)
    lose(gc, victim)
    refused = restart(gc, job, check=False)
    assert refused["returncode"] != 0 and f"partner-{victim}" in refused["stderr"], refused["stderr"]
    recorded = next(g for g in generations(gc, job) if g["gen"] == entry["gen"])
    assert recorded["state"] == "complete", recorded
    assert recorded["redundancy"].startswith("damaged: ") and f"partner-{victim}" in recorded["redundancy"], recorded
    listing = gc.gang("ckpt", "ls", job, check=True).stdout
    row = next(line for line in listing.splitlines() if line.split()[:1] == [str(entry["gen"])])
    assert "partner (damaged)" in row and f"partner-{victim}" in row, listing


def test_holds_answers_only_absence(tmp_path):
    """The node side, without a cluster: gone is said, present (even damaged) is not."""
    root = tmp_path / "ckpt"
    root.mkdir(mode=0o711)
    assert "is gone" in holds(root, 3, 2)
    directory = ckptstore.gen_dir(root, 3, 2)
    (directory / ckptstore.RANKS_DIR).mkdir(parents=True)
    os.chmod(directory.parent, 0o711)
    os.chmod(directory, 0o711)
    os.chmod(directory / ckptstore.RANKS_DIR, 0o700)
    assert holds(root, 3, 2).endswith(f"{ckptstore.MANIFEST} is gone")
    state = directory / ckptstore.cluster_rank_file(0)
    state.write_bytes(b"x" * 100)
    manifest = ckptstore.Manifest(lineage=3, gen=2, node="n1", iteration=7, ranks=[0], committed=0.0,
                                  files={ckptstore.cluster_rank_file(0): list(ckptstore.checksum_file(state))})
    ckptstore.write_manifest(directory, manifest)
    assert holds(root, 3, 2) == ""
    state.write_bytes(b"y" * 100)  # damaged, not gone: verification's business
    assert holds(root, 3, 2) == ""
    state.unlink()
    assert holds(root, 3, 2).endswith(f"{ckptstore.cluster_rank_file(0)} is gone")
    os.symlink("/etc/passwd", state)  # a link is not the file: present, and verification refuses it
    assert holds(root, 3, 2) == ""


def local_generation(cluster, nodes: str) -> tuple[str, int, dict, Path]:
    """A 4-rank job on ``nodes`` without redundancy, running (holding at step
    125), with a complete generation taken in the hold: (its uninterrupted
    result, its id, the generation, the file whose creation ends the hold).
    Its restart holds too until that file exists, then runs at full speed (a
    job slowed down to be mid-run at the checkpoint, 0.05 s a step, made its
    restart run 14 s of the test)."""
    expected = reference(cluster, ARGV, 4)
    held, release = hold(cluster, 125)
    job = submit(cluster, [*ARGV, *held], 4, "-w", nodes, "--ckpt-redundancy", "local")
    wait_holding(cluster, job)
    gen = checkpoint(cluster, job)
    assert gen["state"] == "complete", gen
    return expected, job, gen, release


def test_a_node_back_with_a_wiped_disk_takes_its_files_back_from_the_flush_directory(make_cluster, tmp_path):
    """No redundancy (level local), but the generation was flushed: the
    wiped node's ranks' files come from the flush directory, onto the node
    itself, and the restart is bit-identical."""
    shared = tmp_path / "shared"
    cluster = make_cluster(3, cores=2, time_slice=0.1, flush_dir=shared)
    try:
        expected, job, gen, release = local_generation(cluster, "n2,n3")
        deadline = time.monotonic() + 60
        while not next(g for g in generations(cluster, job) if g["gen"] == gen["gen"]).get("flushed"):
            assert time.monotonic() < deadline, "the generation was not flushed"
            time.sleep(0.2)
        cluster.gang("kill", job, check=True)
        cluster.wait_state(job, TERMINAL)
        release.touch()
        victim = "n3" if coordinator_seen_by(cluster, "n1") != "n3" else "n2"
        wiped_and_back(cluster, victim)
        answer = restart(cluster, job)
        assert answer["gen"] == gen["gen"] and not answer["skipped"], answer
        assert result_of(cluster, answer["record"]["id"], timeout=180) == expected
        recorded = next(g for g in generations(cluster, job) if g["gen"] == gen["gen"])
        assert recorded["state"] == "complete", recorded
    finally:
        kill_what_is_left(cluster)


# ---------------------------------------------------------------- staging moves files over the bulk path, the channel if that fails


def test_a_restart_elsewhere_stages_over_the_bulk_path_and_over_the_channel_when_bulk_fails(make_cluster, points):
    cluster = make_cluster(3, cores=4, time_slice=0.1)
    try:
        expected, job, gen, release = local_generation(cluster, "n1,n2")
        cluster.gang("kill", job, check=True)
        cluster.wait_state(job, TERMINAL)
        release.touch()
        (points / "ckpt_bulk_read").touch()  # the first bulk read a source serves is refused
        answer = restart(cluster, job, "-w", "n3")
        assert answer["placement"] == ["n3"] * 4 and answer["gen"] == gen["gen"], answer
        assert not (points / "ckpt_bulk_read").exists()  # (the staging asked for the bulk path: the point was reached)
        log = cluster.log("n3")
        assert "the bulk path failed" in log and "pulling it over the peer channel instead" in log, log[-3000:]
        assert result_of(cluster, answer["record"]["id"], timeout=180) == expected
        assert ckptstore.verify(gen_dir(cluster, "n3", job, gen["gen"])) == []
    finally:
        kill_what_is_left(cluster)
