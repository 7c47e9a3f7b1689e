"""The Ousterhout matrix (gangd.daemon.gang.Matrix), without daemons.

Placement goes through ``gangd.daemon.coordinator.place``, exactly as the
coordinator does it, so these tests exercise the pair the scheduler uses.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gangd import jobs
from gangd.daemon.coordinator import place
from gangd.daemon.gang import Matrix


def rec(job_id: int, nranks: int, *, nodelist=None, per_node=None, nodes=None) -> dict:
    return jobs.new_record(
        job_id=job_id,
        spec={"argv": ["x"], "nranks": nranks, "nodelist": nodelist, "per_node": per_node, "nodes": nodes},
        owner_uid=0,
        owner_name="root",
        owner_gid=0,
    )


def cluster(count: int = 4, cores: int = 1) -> dict[str, int]:
    return {f"n{i}": cores for i in range(1, count + 1)}


def admit(matrix: Matrix, record: dict, up=None):
    return matrix.admit(record, place, set(matrix.cores) if up is None else set(up))


ALL4 = ["n1", "n2", "n3", "n4"]

# ---------------------------------------------------------------- admission


def test_jobs_side_by_side_share_a_slot():
    m = Matrix(cluster(4, cores=1), max_slots=4)
    assert admit(m, rec(1, 2, nodelist=["n1", "n2"])) == (0, ["n1", "n2"])
    assert admit(m, rec(2, 2, nodelist=["n3", "n4"])) == (0, ["n3", "n4"])
    assert m.slots == [[1, 2]]
    assert m.slot_of(1) == m.slot_of(2) == 0
    assert m.free(0) == {"n1": 0, "n2": 0, "n3": 0, "n4": 0}


def test_a_job_takes_the_free_cores_beside_another_without_a_nodelist():
    m = Matrix(cluster(4, cores=2), max_slots=4)
    assert admit(m, rec(1, 4)) == (0, ALL4)
    # one core left on every node of slot 0: the next 4-rank job fits beside
    assert admit(m, rec(2, 4)) == (0, ALL4)
    # now slot 0 is full
    assert admit(m, rec(3, 1)) == (1, ["n1"])
    assert m.slots == [[1, 2], [3]]


def test_overlapping_jobs_get_different_slots():
    m = Matrix(cluster(4, cores=1), max_slots=4)
    assert admit(m, rec(1, 2, nodelist=["n1", "n2"])) == (0, ["n1", "n2"])
    assert admit(m, rec(2, 2, nodelist=["n2", "n3"])) == (1, ["n2", "n3"])  # overlaps on n2 only
    assert admit(m, rec(3, 1, nodelist=["n3"])) == (0, ["n3"])  # free in slot 0
    assert admit(m, rec(4, 1, nodelist=["n2"])) == (2, ["n2"])  # n2 is busy in slots 0 and 1
    assert m.slots == [[1, 3], [2], [4]]
    assert [m.slot_of(j) for j in (1, 2, 3, 4, 99)] == [0, 1, 0, 2, None]


def test_placement_in_a_slot_uses_only_the_cores_free_in_that_slot():
    m = Matrix({"n1": 4, "n2": 4}, max_slots=4)
    assert admit(m, rec(1, 6)) == (0, ["n1"] * 3 + ["n2"] * 3)
    assert m.free(0) == {"n1": 1, "n2": 1}
    assert admit(m, rec(2, 2)) == (0, ["n1", "n2"])
    assert admit(m, rec(3, 3)) == (1, ["n1", "n1", "n2"])
    assert m.usage[1] == Counter({"n1": 3, "n2": 3})
    assert m.usage[3] == Counter({"n1": 2, "n2": 1})


def test_max_slots_limits_admission_and_a_refusal_leaves_no_trace():
    m = Matrix(cluster(4, cores=1), max_slots=2)
    assert admit(m, rec(1, 4))[0] == 0
    assert admit(m, rec(2, 4))[0] == 1
    before = ([list(s) for s in m.slots], dict(m.usage))
    assert admit(m, rec(3, 1)) is None
    assert ([list(s) for s in m.slots], dict(m.usage)) == before
    assert m.slot_of(3) is None and 3 not in m.usage
    # once a slot frees up, the waiting job gets in
    m.remove(1)
    assert admit(m, rec(3, 1)) == (1, ["n1"])


def test_max_slots_is_at_least_one():
    m = Matrix(cluster(2), max_slots=0)
    assert m.max_slots == 1
    assert admit(m, rec(1, 2)) == (0, ["n1", "n2"])
    assert admit(m, rec(2, 1)) is None


def test_a_job_larger_than_the_cluster_is_never_admitted():
    m = Matrix(cluster(4, cores=1), max_slots=4)
    assert admit(m, rec(1, 5)) is None
    assert m.slots == [] and m.usage == {}


def test_admission_only_uses_nodes_that_are_up():
    m = Matrix(cluster(4, cores=1), max_slots=2)
    assert admit(m, rec(1, 2), up={"n2", "n4"}) == (0, ["n2", "n4"])
    assert admit(m, rec(2, 3), up={"n2", "n4"}) is None  # only 2 cores up in any slot
    assert admit(m, rec(3, 3), up={"n1", "n2", "n3"}) == (1, ["n1", "n2", "n3"])


# ---------------------------------------------------------------- queries


def test_free_counts_cores_per_slot_and_filters_nodes_that_are_up():
    m = Matrix({"n1": 2, "n2": 3}, max_slots=4)
    m.add(1, 0, ["n1", "n2", "n2"])
    m.add(2, 1, ["n1"])
    assert m.free(0) == {"n1": 1, "n2": 1}
    assert m.free(1) == {"n1": 1, "n2": 3}
    assert m.free(7) == {"n1": 2, "n2": 3}  # a slot that does not exist yet is empty
    assert m.free(0, up={"n2"}) == {"n2": 1}
    assert m.fits(2, 0) and m.fits(1, 1)
    m.add(3, 1, ["n2", "n2"])
    assert m.free(1) == {"n1": 1, "n2": 1}
    assert m.fits(2, 0) and not m.fits(1, 1) and not m.fits(3, 0)


def test_table_shape():
    m = Matrix(cluster(3, cores=2), max_slots=4)
    admit(m, rec(1, 4, nodelist=["n1", "n2"]))  # two ranks on each: listed once per node
    admit(m, rec(2, 2, nodelist=["n3"]))
    admit(m, rec(3, 1, nodelist=["n1"]))
    table = m.table()
    assert table == [
        {"n1": [1], "n2": [1], "n3": [2]},
        {"n1": [3], "n2": [], "n3": []},
    ]
    assert all(list(row) == ["n1", "n2", "n3"] for row in table)  # every node, in order, every row
    assert Matrix(cluster(2), 2).table() == []


# ---------------------------------------------------------------- remove and compaction


def test_remove_pulls_jobs_into_earlier_slots_and_drops_empty_ones():
    m = Matrix(cluster(4, cores=1), max_slots=4)
    admit(m, rec(1, 4))  # slot 0, every node
    admit(m, rec(2, 2, nodelist=["n1", "n2"]))  # slot 1
    admit(m, rec(3, 2, nodelist=["n3", "n4"]))  # slot 1, beside 2
    admit(m, rec(4, 1, nodelist=["n1"]))  # slot 2
    assert m.slots == [[1], [2, 3], [4]]
    moved = m.remove(1)
    assert m.slots == [[2, 3], [4]]
    assert moved == {2: 0, 3: 0, 4: 1}
    assert 1 not in m.usage
    assert m.table() == [{"n1": [2], "n2": [2], "n3": [3], "n4": [3]}, {"n1": [4], "n2": [], "n3": [], "n4": []}]


def test_remove_of_the_last_job_leaves_an_empty_matrix():
    m = Matrix(cluster(2), max_slots=2)
    admit(m, rec(1, 2))
    m.active = 0
    assert m.remove(1) == {}
    assert m.slots == [] and m.usage == {} and m.active == 0
    assert m.table() == []


def test_remove_of_an_unknown_job_changes_nothing():
    m = Matrix(cluster(2), max_slots=2)
    admit(m, rec(1, 2))
    assert m.remove(42) == {}
    assert m.slots == [[1]]


def test_removing_a_job_that_others_do_not_fit_beside_only_drops_its_slot():
    m = Matrix(cluster(2, cores=1), max_slots=4)
    for j in (1, 2, 3):
        admit(m, rec(j, 2))
    assert m.slots == [[1], [2], [3]]
    m.active = 0
    assert m.remove(1) == {2: 0, 3: 1}
    assert m.slots == [[2], [3]]


def test_compaction_keeps_active_on_the_running_slot_when_an_earlier_slot_goes():
    m = Matrix(cluster(4, cores=1), max_slots=4)
    admit(m, rec(1, 2, nodelist=["n1", "n2"]))  # slot 0
    admit(m, rec(2, 4))  # slot 1
    m.active = 1  # job 2 runs now
    m.remove(1)
    assert m.slots == [[2]]
    assert m.active == 0 and m.slots[m.active] == [2]


def test_compaction_keeps_active_on_the_running_slot_when_a_later_slot_goes():
    m = Matrix(cluster(2, cores=1), max_slots=4)
    for j in (1, 2, 3):
        admit(m, rec(j, 2))
    m.active = 0
    m.remove(3)
    assert m.slots == [[1], [2]] and m.active == 0


def test_compaction_keeps_active_pointing_at_the_jobs_that_were_running():
    """Three jobs that all overlap, the third one running: the first ends.
    The survivors move up one slot each; the job that was running must
    still be the one the active slot points at (else the scheduler switches
    it out at once and it loses the rest of its time slice)."""
    m = Matrix(cluster(2, cores=1), max_slots=4)
    for j in (1, 2, 3):
        admit(m, rec(j, 2))
    m.active = 2  # job 3 runs now
    m.remove(1)
    assert m.slots == [[2], [3]]
    assert m.slots[m.active] == [3], f"active slot {m.active} holds {m.slots[m.active]}, but job 3 was the one running"


def test_compaction_keeps_active_when_the_middle_slot_goes():
    m = Matrix(cluster(2, cores=1), max_slots=4)
    for j in (1, 2, 3):
        admit(m, rec(j, 2))
    m.active = 2  # job 3 runs now
    m.remove(2)
    assert m.slots == [[1], [3]]
    assert m.slots[m.active] == [3], f"active slot {m.active} holds {m.slots[m.active]}, but job 3 was the one running"


def test_compaction_of_the_active_slot_itself_resets_active_to_a_valid_slot():
    m = Matrix(cluster(2, cores=1), max_slots=4)
    admit(m, rec(1, 2))
    admit(m, rec(2, 2))
    m.active = 0
    m.remove(1)  # job 2 moves up; the slot that was running is gone
    assert m.slots == [[2]] and m.active == 0


# ---------------------------------------------------------------- properties

NODE_NAMES = [f"n{i}" for i in range(1, 6)]


@st.composite
def scenarios(draw):
    count = draw(st.integers(1, 5))
    cores = {name: draw(st.integers(1, 4)) for name in NODE_NAMES[:count]}
    max_slots = draw(st.integers(1, 4))
    ops = []
    for _ in range(draw(st.integers(1, 40))):
        if draw(st.booleans()) or not ops:
            nodelist = draw(st.none() | st.lists(st.sampled_from(list(cores)), min_size=1, unique=True))
            per_node = draw(st.none() | st.integers(1, 4))
            nodes_wanted = draw(st.none() | st.integers(1, count))
            ops.append(("admit", draw(st.integers(1, 3 * sum(cores.values()))), nodelist, per_node, nodes_wanted))
        else:
            ops.append(("remove", draw(st.integers(0, 1000)), None, None, None))
        if draw(st.integers(0, 4)) == 0:
            ops.append(("active", draw(st.integers(0, 10)), None, None, None))
    down = draw(st.sets(st.sampled_from(list(cores)), max_size=count - 1))
    return cores, max_slots, ops, down


def check_invariants(m: Matrix, admitted: dict[int, list[str]], cores: dict[str, int]) -> None:
    # a node's usage in any slot never exceeds its cores
    for index in range(len(m.slots)):
        used = Counter()
        for job_id in m.slots[index]:
            used.update(m.usage[job_id])
        for node, count in used.items():
            assert count <= cores[node], f"slot {index}: {count} ranks on {node} with {cores[node]} cores: {m.slots}"
        assert all(v >= 0 for v in m.free(index).values())
    # no empty slots, never more than max_slots
    assert all(m.slots), m.slots
    assert len(m.slots) <= m.max_slots
    # every admitted job in exactly one slot, with the placement it was given
    members = [j for slot in m.slots for j in slot]
    assert sorted(members) == sorted(admitted), (m.slots, sorted(admitted))
    assert set(m.usage) == set(admitted)
    for job_id, placement in admitted.items():
        assert m.usage[job_id] == Counter(placement)
    # the table draws exactly that
    table = m.table()
    assert len(table) == len(m.slots)
    for index, row in enumerate(table):
        assert set(row) == set(cores)
        for node, ids in row.items():
            assert sorted(ids) == sorted(j for j in m.slots[index] if node in m.usage[j])
    # active names a slot (or 0 when there is none)
    assert 0 <= m.active < max(1, len(m.slots))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_matrix_invariants_hold_under_random_admits_and_removes(scenario):
    cores, max_slots, ops, down = scenario
    up = set(cores) - down
    m = Matrix(cores, max_slots)
    admitted: dict[int, list[str]] = {}
    next_id = 1
    for op, value, nodelist, per_node, nodes_wanted in ops:
        if op == "admit":
            record = rec(next_id, value, nodelist=nodelist, per_node=per_node, nodes=nodes_wanted)
            next_id += 1
            slots_before = [list(s) for s in m.slots]
            result = m.admit(record, place, up)
            if result is None:
                # refused only if it fits in no existing slot and no new slot may be opened
                assert m.slots == slots_before
                assert len(m.slots) == max_slots or place(record, {n: c for n, c in m.free(len(m.slots), up).items() if c > 0}) is None
                for index in range(len(m.slots)):
                    assert place(record, {n: c for n, c in m.free(index, up).items() if c > 0}) is None
            else:
                slot, placement = result
                assert len(placement) == value
                assert set(placement) <= up
                if nodelist:
                    assert set(placement) <= set(nodelist)
                assert m.slot_of(record["id"]) == slot
                # the first slot it fits in
                for index in range(slot):
                    free = {n: c for n, c in Matrix.free(_without(m, record["id"]), index, up).items() if c > 0}
                    assert place(record, free) is None
                admitted[record["id"]] = placement
        elif op == "remove":
            if not admitted:
                continue
            victim = sorted(admitted)[value % len(admitted)]
            before = {j: m.slot_of(j) for j in admitted}
            moved = m.remove(victim)
            del admitted[victim]
            after = {j: m.slot_of(j) for j in admitted}
            # the caller learns every move, and only real moves
            assert moved == {j: after[j] for j in admitted if after[j] != before[j]}
            # compacted: nobody fits in an earlier slot any more
            for index, slot in enumerate(m.slots):
                for job_id in slot:
                    for earlier in range(index):
                        assert not m.fits(job_id, earlier), (job_id, index, earlier, m.slots)
            assert m.slot_of(victim) is None
        else:  # the scheduler moves on to another slot
            m.active = value % len(m.slots) if m.slots else 0
        check_invariants(m, admitted, cores)


def _without(m: Matrix, job_id: int) -> Matrix:
    """A copy of ``m`` without ``job_id`` and without compaction."""
    copy = Matrix(m.cores, m.max_slots)
    copy.slots = [[j for j in slot if j != job_id] for slot in m.slots]
    copy.usage = {j: c for j, c in m.usage.items() if j != job_id}
    return copy


@pytest.mark.parametrize("cores", [1, 2, 3])
def test_admission_is_first_come_first_served_into_the_first_slot_with_room(cores):
    m = Matrix(cluster(2, cores=cores), max_slots=8)
    for j in range(1, 2 * cores + 1):
        slot, _ = admit(m, rec(j, 1, nodelist=["n1"]))
        assert slot == (j - 1) // cores


# ---------------------------------------------------------------- spawned jobs (gangd.daemon.spawns)


def child_rec(job_id: int, nranks: int, parent: int) -> dict:
    return dict(rec(job_id, nranks), spawned_by=parent)


def test_a_spawned_job_goes_in_its_parents_slot_or_is_refused_with_the_reason():
    from gangd.daemon import spawns

    matrix = Matrix(cluster(2, cores=2), max_slots=4)
    admit(matrix, rec(1, 4))  # slot 0, full
    admit(matrix, rec(2, 1))  # slot 1, 3 cores free
    assert matrix.slot_of(2) == 1
    assert spawns.admit(matrix, child_rec(3, 3, parent=2), place, set(matrix.cores)) == (1, ["n1", "n2", "n2"])
    # The slot is full: the next child shares the parent's core on n1 (as many past the cores as the parent has ranks there) ...
    assert spawns.admit(matrix, child_rec(4, 1, parent=2), place, set(matrix.cores)) == (1, ["n1"])
    assert matrix.free(1)["n1"] == -1
    # ... and no more: n1 already runs one process past its cores for job 2's single rank there.
    why = spawns.admit(matrix, child_rec(6, 1, parent=2), place, set(matrix.cores))
    assert why == (
        "no room for 1 spawned processes beside job 2: 0 cores free in its time slot, and 0 more processes its own nodes "
        "may run on its cores (a node takes at most as many spawned processes past its cores as the job has ranks there)"
    )
    assert matrix.slot_of(6) is None
    # Too few free cores: every one of them, and only the rest share the parent's.
    matrix = Matrix(cluster(2, cores=2), max_slots=4)
    admit(matrix, rec(1, 2, nodelist=["n1"]))  # the parent fills n1
    admit(matrix, rec(2, 1, nodelist=["n2"]))  # one core free, on n2
    assert spawns.admit(matrix, child_rec(3, 3, parent=1), place, set(matrix.cores)) == (0, ["n1", "n1", "n2"])
    assert spawns.admit(matrix, child_rec(4, 1, parent=1), place, set(matrix.cores)).startswith("no room for 1 spawned processes")
    # A spawn's hosts (its nodelist) limit both: free cores elsewhere are not taken, the parent's nodes only where named.
    matrix = Matrix(cluster(2, cores=2), max_slots=4)
    admit(matrix, rec(1, 2, nodelist=["n1"]))  # n1 full, n2 free
    assert spawns.admit(matrix, dict(child_rec(2, 2, parent=1), nodelist=["n1"]), place, set(matrix.cores)) == (0, ["n1", "n1"])
    why = spawns.admit(matrix, dict(child_rec(3, 1, parent=1), nodelist=["n1"]), place, set(matrix.cores))
    assert why.startswith("no room for 1 spawned processes beside job 1 on n1 (its host info key): 0 cores free"), why
    assert spawns.admit(matrix, dict(child_rec(4, 2, parent=1), nodelist=["n2"]), place, set(matrix.cores)) == (0, ["n2", "n2"])
    assert spawns.admit(matrix, child_rec(5, 1, parent=99), place, set(matrix.cores)) == "its parent job 99 holds no time slot (it is not running)"


@settings(max_examples=200, deadline=None)
@given(
    cores=st.integers(1, 4),
    others=st.lists(st.integers(1, 6), max_size=3),
    parent=st.integers(1, 6),
    spawns_asked=st.lists(st.tuples(st.integers(1, 6), st.sampled_from([None, ["n1"], ["n2"], ["n1", "n3"]])), max_size=8),
)
def test_spawned_processes_never_pass_cores_plus_the_parents_ranks_on_a_node(cores, others, parent, spawns_asked):
    """Whatever a program spawns, a node of the parent's slot runs at most its
    cores plus the parent's ranks there (and only the parent's nodes run past
    their cores); a spawn either gets all its processes placed or none."""
    from gangd.daemon import spawns

    matrix = Matrix(cluster(3, cores=cores), max_slots=4)
    for job_id, nranks in enumerate(others, start=10):
        admit(matrix, rec(job_id, nranks))
    if admit(matrix, rec(1, parent)) is None:
        return
    slot = matrix.slot_of(1)
    for job_id, (nprocs, hosts) in enumerate(spawns_asked, start=100):
        answer = spawns.admit(matrix, dict(child_rec(job_id, nprocs, parent=1), nodelist=hosts), place, set(matrix.cores))
        if isinstance(answer, str):
            assert matrix.slot_of(job_id) is None and answer.startswith(f"no room for {nprocs} spawned processes beside job 1")
            continue
        assert answer[0] == slot and len(answer[1]) == nprocs and (not hosts or set(answer[1]) <= set(hosts))
        used = Counter()
        for member in matrix.slots[slot]:
            used.update(matrix.usage[member])
        for node, count in used.items():
            assert count <= cores + matrix.usage[1].get(node, 0), (node, used, matrix.usage[1])


def test_a_new_coordinators_matrix_keeps_each_family_together_and_within_its_cores():
    from gangd.daemon.coordinator import rebuilt

    # Job 1 on n1 ended; its slot held job 3 (n2), the next slot the family of
    # job 2 (n1) and its child 4 (n2): rebuilt in id order, job 3 would
    # have been compacted beside job 2 and left job 4 no core on n2.
    records = [
        dict(rec(2, 1), placement=["n1"]),
        dict(rec(3, 1), placement=["n2"]),
        dict(child_rec(4, 1, parent=2), placement=["n2"]),
        dict(rec(5, 1), placement=["n9"]),  # (a node the configuration dropped: left out)
    ]
    matrix = rebuilt(cluster(2, cores=1), 4, records)
    assert matrix.slot_of(2) == matrix.slot_of(4) != matrix.slot_of(3) and matrix.slot_of(5) is None, matrix.slots
    assert {2, 4} <= matrix.tied and all(c >= 0 for slot in range(len(matrix.slots)) for c in matrix.free(slot).values())


def test_compaction_never_moves_a_parent_or_its_children_apart():
    from gangd.daemon import spawns

    matrix = Matrix(cluster(2, cores=2), max_slots=4)
    admit(matrix, rec(1, 2))  # slot 0: n1 n1
    admit(matrix, rec(2, 3))  # slot 1
    spawns.admit(matrix, child_rec(3, 1, parent=2), place, set(matrix.cores))
    assert matrix.slot_of(3) == 1
    matrix.remove(1)  # slot 0 empties: the family moves together (as a slot), never one job of it alone
    assert matrix.slot_of(2) == matrix.slot_of(3) == 0
    # A parent that would fit in an earlier slot alone is not pulled there without its child; an untied job is.
    matrix = Matrix(cluster(2, cores=2), max_slots=4)
    matrix.add(1, 0, ["n1", "n1", "n2"])  # slot 0: one core free, on n2
    matrix.add(2, 1, ["n2"])  # the parent
    matrix.add(3, 1, ["n1"])  # its child
    matrix.tied.update((2, 3))
    matrix.add(9, 1, ["n2"])  # untied, the parent's shape
    matrix.add(5, 2, ["n1"])
    matrix.remove(5)  # (a compaction)
    assert (matrix.slot_of(2), matrix.slot_of(3), matrix.slot_of(9)) == (1, 1, 0)


def test_spawns_per_job_and_processes_spawned_per_job_are_bounded():
    from gangd.daemon import spawns
    from gangd.rpc import RemoteError

    parent = rec(1, 1)
    spawns.bounds_check(parent, [rec(i, 1) for i in range(spawns.MAX_SPAWNS_PER_JOB - 1)], 1)
    with pytest.raises(RemoteError, match="has spawned 16 times"):
        spawns.bounds_check(parent, [rec(i, 1) for i in range(spawns.MAX_SPAWNS_PER_JOB)], 1)
    with pytest.raises(RemoteError, match="has spawned 250 processes; 7 more would pass the 256"):
        spawns.bounds_check(parent, [rec(2, 250)], 7)
