"""MPI's dynamic processes (``MPI_Comm_spawn``, ``MPI_Comm_spawn_multiple``) as child jobs.

Why a child job and not more ranks of the spawning job: MPI gives the
spawned processes a ``MPI_COMM_WORLD`` of their own, so they need their own
key-value space, ranks numbered from 0 and their own PMI barriers, which
is what a job already is in gangd. As a job of its own (``spawned_by``
names its parent, the parent's ``children`` lists it) it gets everything a
job gets without new code paths: placement by the coordinator, ``gang ps``,
``gang logs CHILD``, its exit codes in its own record, ``gang kill``.

What ties it to its parent:

* it is submitted by gangd for the parent's owner (uid, gid, rlimits),
  with the parent's environment and working directory (or MPI's ``wdir``
  info key); its ranks get ``PMI_SPAWNED=1`` and a key-value space that
  holds the spawn's ``preput`` keys from the start (MPICH's
  ``PARENT_ROOT_PORT_NAME``: how the children find the parent's port);
  each command of a ``spawn_multiple`` is a *segment* of its ranks, with
  its own argv and appnum (:func:`gangd.jobs.segment_of`);
* it runs in its parent's gang time slot (:func:`admit`), or the spawn is
  refused: a child stopped while its parent runs (or the reverse) would
  leave either side blocked in MPI every other slice. Free cores of that
  slot are used; when there are too few, every free core and the rest on
  the parent's own nodes, sharing its cores — a job that fills the cluster
  (the usual ``gang run --mpi -n ALL``) can still spawn, as under
  ``mpiexec``, which oversubscribes freely. That is bounded: a node runs
  at most its cores plus as many processes as the parent has ranks
  there (so at most twice its cores), over all the parent's children;
  past it the spawn is refused with the counts. MPI's ``host``/``hosts``
  info key (parsed in :mod:`gangd.protocol.pmi`) limits both to the nodes
  it names (:func:`resolve_hosts`: a node's name or configured address;
  unknown or down is refused, naming it), as the child's ``nodelist``;
  ``hostfile`` is refused, unknown keys ignored (Hydra's way). A parent and its
  children are never moved apart by the matrix's compaction
  (:attr:`gangd.daemon.gang.Matrix.tied`);
* a spawn is made once: the rank's node gives it a token (as a
  submission's) and retries it with the next coordinator when the
  coordinator changes; a retry whose child job the old coordinator had
  made gets that child (:meth:`.coordinator.Coordinator.spawn_job`);
* the parent's rank gets its ``spawn_result`` once the child job is
  RUNNING, or an error with the reason when it cannot be (no room, a
  bound, a command the user cannot run, not started within
  :data:`SPAWN_TIMEOUT`): never a hang;
* when the parent is killed or fails, every child still running is
  killed; when it ends well (DONE), its children have
  :data:`CHILD_GRACE` seconds to end by themselves, then they are killed;
  when a child that started fails (not killed), the parent fails with the
  child's message (:func:`family_ended`); one that could not be placed
  fails the spawn only;
* a checkpoint of a job with children (or of a child) is refused
  (:mod:`.ckptcoord`): the intercommunicators between them are not in
  any rank's image.

The bounds: :data:`MAX_SPAWNS_PER_JOB` spawns per job and
:data:`MAX_SPAWNED_PER_JOB` processes spawned per job, over its life; one
spawn's own bounds are in :mod:`gangd.protocol.pmi`.
"""

from __future__ import annotations

import os
import pwd
import stat

import trio

from .. import jobs, text
from ..protocol import pmi
from ..rpc import RemoteError
from .peers import natural_key

MAX_SPAWNS_PER_JOB = 16
MAX_SPAWNED_PER_JOB = 256
#: Seconds from a spawn's request to its children RUNNING (queued behind a
#: commit, placed, launched on every node); past it the spawn fails.
SPAWN_TIMEOUT = 60.0
#: Seconds the children of a parent that ended well (DONE) have to end by
#: themselves before they are killed: MPI lets them outlive a parent that
#: disconnected from them, gangd does not let them linger.
CHILD_GRACE = 30.0
DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin"


# ---------------------------------------------------------------- the spawning rank's node


def cannot_run(argv0: str, path_var: str | None, cwd: str, uid: int, gid: int, user: str) -> str | None:
    """Why the job's owner could not exec ``argv0`` (looked up as execvp
    would, in the parent's ``PATH``), or None. Only metadata is read (no file
    is opened): the rank's exec, as the user, is the final word; this is
    for a spawn to fail with a reason instead of children that exit 127."""
    if "/" in argv0:
        candidates = [argv0 if argv0.startswith("/") else os.path.join(cwd, argv0)]
    else:
        candidates = [os.path.join(d or ".", argv0) for d in (path_var or DEFAULT_PATH).split(":")[:64]]
    try:
        groups = set(os.getgrouplist(user, gid))
    except (KeyError, OSError):
        groups = {gid}
    for path in candidates:
        try:
            st = os.stat(path)
        except (OSError, ValueError):
            continue
        if not stat.S_ISREG(st.st_mode):
            continue
        if uid == 0:
            bits = stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH
        elif st.st_uid == uid:
            bits = stat.S_IXUSR
        elif st.st_gid in groups:
            bits = stat.S_IXGRP
        else:
            bits = stat.S_IXOTH
        if st.st_mode & bits:
            return None
        return f"{argv0}: permission denied"
    return f"{argv0}: command not found"


def check_commands(record: dict, command: pmi.Spawn) -> str | None:
    env = record.get("env") or {}
    try:
        user = pwd.getpwuid(record["owner_uid"]).pw_name
    except KeyError:
        user = str(record.get("owner") or "")
    for segment in command.segments:
        cwd = segment.wdir or record.get("cwd") or "/"
        why = cannot_run(segment.argv[0], env.get("PATH"), cwd, record["owner_uid"], record["owner_gid"], user)
        if why:
            return why
    return None


# ---------------------------------------------------------------- the coordinator


def bounds_check(parent: dict, children: list[dict], nprocs: int) -> None:
    if len(children) >= MAX_SPAWNS_PER_JOB:
        raise RemoteError("too_many_spawns", f"job {parent['id']} has spawned {len(children)} times, the most gangd allows one job")
    spawned = sum(c["nranks"] for c in children)
    if spawned + nprocs > MAX_SPAWNED_PER_JOB:
        raise RemoteError(
            "too_many_spawns",
            f"job {parent['id']} has spawned {spawned} processes; {nprocs} more would pass the {MAX_SPAWNED_PER_JOB} one job may spawn",
        )


def resolve_hosts(hosts: list[str], nodes, parent_id: int, is_up) -> list[str]:
    """The gangd nodes a spawn's ``host`` info key names, or a refusal naming
    the one that is not usable. A host is a node's name or its address in the
    cluster's configuration (an address shared by several nodes names them
    all: they are one machine); it must be up. (The parent's ``--nodelist``
    does not limit its children: it says where the parent runs, and
    children without a host key are placed anywhere too.)"""
    names = [n.name for n in nodes]
    chosen: list[str] = []
    for host in hosts:
        matched = [n.name for n in nodes if host in (n.name, n.address)]
        shown = text.printable(host, 64)
        if not matched:
            raise RemoteError("no_such_node", f"host {shown!r} (the spawn's host info key) is not a node of this cluster (nodes: {', '.join(names)})")
        up = [m for m in matched if is_up(m)]
        if not up:
            raise RemoteError("node_down", f"host {shown!r} (the spawn's host info key): {', '.join(matched)} is down (job {parent_id}'s spawn)")
        chosen.extend(m for m in up if m not in chosen)
    return chosen


def child_request(
    parent: dict, env: dict[str, str], segments: list, preput: dict[str, str], rank: int, nodelist: list[str] | None = None,
) -> tuple[dict, dict, dict]:
    """(spec, cred, internal fields) of the child job a spawn asks for; ``nodelist``: its hosts."""
    argvs = [[str(a) for a in argv] for argv, _, _ in segments]
    nprocs = [int(n) for _, n, _ in segments]
    wdir = next((w for _, _, w in segments if w), "")
    spec = {
        "argv": argvs[0],
        "nranks": sum(nprocs),
        "cwd": wdir or parent.get("cwd") or "/",
        "env": env,
        "mpi": True,
        "name": f"{parent['name']}.spawn{len(parent.get('children') or []) + 1}",
        "kill_on_bad_exit": True,
    }
    if parent.get("slice"):
        spec["slice"] = parent["slice"]
    if nodelist:
        spec["nodelist"] = nodelist
    cred = {"uid": parent["owner_uid"], "user": parent["owner"], "gid": parent["owner_gid"], "rlimits": parent.get("rlimits")}
    internal = {
        "spawned_by": parent["id"],
        "spawned_from_rank": rank,
        "segments": [[a, n] for a, n in zip(argvs, nprocs, strict=True)] if len(argvs) > 1 else None,
        "pmi_preput": dict(preput),
    }
    return spec, cred, internal


def admit(matrix, record: dict, place, up: set[str]) -> tuple[int, list[str]] | str:
    """(slot, placement) of a child job in its parent's time slot, or why it has no room there.

    Free cores of the slot if they are enough (on any node, or the spawn's
    hosts: ``record["nodelist"]``, placed as any job); else every free core
    and the rest on the parent's own nodes, sharing its cores
    (:func:`shared_room`, :func:`fill`)."""
    parent = record["spawned_by"]
    slot = matrix.slot_of(parent)
    if slot is None:
        return f"its parent job {parent} holds no time slot (it is not running)"
    free_all = matrix.free(slot, up)
    free = {n: c for n, c in free_all.items() if c > 0}
    hosts = record.get("nodelist")
    if hosts:
        free = {n: c for n, c in free.items() if n in hosts}
    placement = place(record, free)
    if placement is None:
        shared = shared_room(free_all, matrix.usage.get(parent) or {})
        if hosts:
            shared = {n: c for n, c in shared.items() if n in hosts}
        placement = fill(record["nranks"], free, shared)
        if placement is None:
            return no_room(record, free, shared)
    matrix.add(record["id"], slot, placement)
    matrix.tied.update((parent, record["id"]))
    return slot, placement


def shared_room(free: dict[str, int], parent_usage) -> dict[str, int]:
    """Processes each of the parent's (up) nodes may take past its cores: as
    many as the parent has ranks there, less what earlier children already
    took past them (``free`` is negative by that much). Over all of a
    parent's children a node runs at most its cores plus the parent's ranks
    there: at most twice its cores, whatever a program spawns."""
    room = {n: k + min(free[n], 0) for n, k in parent_usage.items() if n in free}
    return {n: c for n, c in room.items() if c > 0}


def fill(nprocs: int, free: dict[str, int], shared: dict[str, int]) -> list[str] | None:
    """Every free core, then the rest of ``nprocs`` spread over ``shared``
    (one more per node in turn), ranks in node order; None past the room."""
    if nprocs > sum(free.values()) + sum(shared.values()):
        return None
    counts: dict[str, int] = {}
    rest = nprocs
    for node in sorted(free, key=natural_key):
        counts[node] = min(free[node], rest)
        rest -= counts[node]
    left = dict(shared)
    while rest > 0:
        for node in sorted(left, key=natural_key):
            if rest and left[node] > 0:
                left[node] -= 1
                counts[node] = counts.get(node, 0) + 1
                rest -= 1
    return [node for node in sorted(counts, key=natural_key) for _ in range(counts[node])]


def no_room(record: dict, free: dict[str, int], shared: dict[str, int]) -> str:
    hosts = record.get("nodelist")
    where = f" on {', '.join(hosts)} (its host info key)" if hosts else ""
    return (
        f"no room for {record['nranks']} spawned processes beside job {record['spawned_by']}{where}: "
        f"{sum(free.values())} cores free in its time slot, and {sum(shared.values())} more processes its own nodes "
        "may run on its cores (a node takes at most as many spawned processes past its cores as the job has ranks there)"
    )


async def end_child(co, child_id: int, reason: str, grace: float) -> None:
    if grace:
        with trio.move_on_after(grace):
            while (child := co.table.get(child_id)) is not None and not jobs.is_terminal(child):
                await co.table.wait_changed()
    child = co.table.get(child_id)
    if child is not None and not jobs.is_terminal(child):
        await co.kill_for(child_id, reason)


def family_ended(co, record: dict) -> None:
    """``record`` just ended: its children go with it; a failed child fails its parent."""
    for child_id in record.get("children") or ():
        child = co.table.get(child_id)
        if child is not None and not jobs.is_terminal(child):
            # (a parent that is DONE disconnected from its children first: they get a moment to finish too)
            grace = CHILD_GRACE if record["state"] == jobs.DONE else 0.0
            co.spawn(end_child, co, child_id, f"its parent job {record['id']} ended ({record['state']})", grace)
    parent_id = record.get("spawned_by")
    if parent_id is not None and record["state"] == jobs.FAILED and record.get("started"):  # (never started: the spawn failed instead)
        parent = co.table.get(parent_id)
        if parent is not None and not jobs.is_terminal(parent):
            co.spawn(co.fail, parent_id, f"spawned job {record['id']} failed: {record['reason'] or 'a process failed'}")
