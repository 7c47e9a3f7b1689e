"""Incremental checkpoints in the cluster (issue 17, WP-D and the rank agent of WP-B).

Pure: retention by chains (:mod:`gangd.checkpoint.retention`), recovery's
choice of a generation with links, the coordinator's gate (a job writes
deltas unless its mode, its ``--ckpt-mode`` else the cluster's, is full).

Cluster: a 2-node job in each mode checkpointed ten times with a few blocks
changed between, killed and restarted twice from its newest generation (a
delta with its chain), ends with the result of an uninterrupted run; the
files are the deltas the entries say, and retention keeps exactly what the
kept generations need. A damaged link is named by node and path and the
restart falls back to the newest intact chain; a restart elsewhere from a
delta is refused with a sentence.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gangd import ckptstore
from gangd.checkpoint import delta, retention
from gangd.checkpoint import round as rd
from gangd.ckptlib import blocks
from gangd.daemon.recover import usable_generation

JOB = Path(__file__).parent / "jobs" / "deltajob.py"

# ------------------------------------------------------------------ pure: retention


def entry(gen: int, needs=(), state: str = "complete", **extra) -> dict:
    return {"gen": gen, "state": state, "needs": list(needs), "placement": ["n1", "n2"], **extra}


def gens_of(doomed: list[dict]) -> list[int]:
    return [e["gen"] for e in doomed]


def test_an_incremental_chain_is_kept_whole_while_its_newest_is_kept():
    chain = [entry(1)] + [entry(g, range(g - 1, 0, -1)) for g in range(2, 6)]  # 5 needs 4, 3, 2, 1
    assert gens_of(retention.doomed(chain, 2)) == []
    with_full = [*chain, entry(6), entry(7, [6])]
    assert gens_of(retention.doomed(with_full, 2)) == [1, 2, 3, 4, 5]  # (6 is a new full: the old chain goes)


def test_differentials_keep_their_base_and_drop_the_differentials_between():
    gens = [entry(1), entry(2, [1]), entry(3, [1]), entry(4, [1]), entry(5, [1])]
    assert gens_of(retention.doomed(gens, 2)) == [2, 3]


def test_a_generation_whose_link_is_gone_is_not_usable_and_does_not_count_as_kept():
    gens = [entry(1, state="removed"), entry(2, [1]), entry(3), entry(4, [3])]
    assert [e["gen"] for e in retention.usable(gens)] == [3, 4]
    assert gens_of(retention.doomed(gens, 1)) == [2]  # (keep 1: 4, and 3 it needs)
    gens = [entry(1), entry(2, [1]), entry(3, [2, 1], state="damaged"), entry(4, [3, 2, 1])]
    assert [e["gen"] for e in retention.usable(gens)] == [1, 2]
    assert gens_of(retention.doomed(gens, 1)) == [4]  # (4 cannot restore; 2 is the newest usable, with 1)


def test_a_link_no_entry_records_does_not_make_retention_remove_what_needs_it():
    gens = [entry(5, [4, 3]), entry(6, [5, 4, 3])]  # (3 and 4: a job of the lineage whose record is gone)
    assert gens_of(retention.doomed(gens, 1)) == []
    assert [e["gen"] for e in retention.usable(gens)] == [5, 6]


def test_what_a_checkpoint_under_way_was_offered_stays_until_it_is_recorded():
    gens = [entry(1), entry(2, [1]), entry(3), entry(4, [3])]
    assert gens_of(retention.doomed(gens, 1)) == [1, 2]
    assert gens_of(retention.doomed(gens, 1, holding=[2])) == []  # (2 and the 1 it needs)
    assert gens_of(retention.doomed(gens, 1, flushing=1)) == [2]


def test_the_newest_protected_and_flushed_keep_their_chains():
    gens = [entry(1, state="protected"), entry(2, [1], state="protected"), entry(3), entry(4, [3]), entry(5, [4, 3])]
    assert gens_of(retention.doomed(gens, 1)) == []  # (2 is the newest protected: it keeps 1)
    gens = [entry(1), entry(2, [1], flushed=True), entry(3), entry(4, [3])]
    assert gens_of(retention.doomed(gens, 1)) == []


#: The strategies ``lineages`` draws from, made once: a ``sampled_from`` of a new list at every draw
#: was validated again each time (nine tenths of the test's 300 examples' time, ~40 s of a loaded
#: run). The same choices in the same order, so the same examples as before.
_OLDER = {g: st.sets(st.sampled_from(range(1, g)), max_size=3) for g in range(2, 15)}
_STATES = st.sampled_from(["complete", "complete", "complete", "protected", "removed", "aborted", "damaged"])


@st.composite
def lineages(draw):
    """Generations 1..n, each a full or a delta of a chain of older complete ones, some removed or aborted."""
    n = draw(st.integers(1, 14))
    gens: list[dict] = []
    for g in range(1, n + 1):
        needs = sorted(draw(_OLDER[g]) if g > 1 else [], reverse=True)  # (of the generations before g: 1 .. g-1)
        state = draw(_STATES)
        gens.append(entry(g, needs, state, flushed=draw(st.booleans()) and state in retention.DONE))
    return gens


@given(lineages(), st.integers(1, 4), st.sets(st.integers(1, 14), max_size=2))
@settings(max_examples=300, deadline=None)
def test_retention_removes_nothing_a_kept_generation_needs_and_keeps_nothing_else(gens, keep, holding):
    doomed = {e["gen"] for e in retention.doomed(gens, keep, holding=holding)}
    done = {e["gen"] for e in gens if e["state"] in retention.DONE}
    kept = done - doomed
    needs = retention.needs_of(gens)
    for g in kept:  # nothing a kept generation needs is removed
        assert not (set(needs[g]) & doomed)
    usable = [e["gen"] for e in retention.usable(gens)]
    assert set(usable[-keep:]) <= kept  # the newest keep usable stay
    assert all(delta.chain_usable(g, needs, done) for g in usable)
    seeds = set(usable[-keep:]) | set(holding)
    for state in ("protected",):
        newest = [g for g in usable if {e["gen"]: e for e in gens}[g]["state"] == state]
        seeds |= set(newest[-1:])
    seeds |= set([g for g in usable if {e["gen"]: e for e in gens}[g].get("flushed")][-1:])
    assert kept <= delta.needed(needs, seeds)  # nothing else is kept


def test_recovery_takes_a_delta_only_where_it_and_every_link_survive():
    gens = [entry(1, state="protected", flushed=True), entry(2, [1], state="protected")]
    gens[0]["placement"] = gens[1]["placement"] = ["n1", "n2"]
    chosen, _ = usable_generation(gens, set())
    assert chosen is not None and chosen["gen"] == 2
    chosen, _ = usable_generation(gens, {"n2"})  # (every link protected: each is rebuilt from its own redundancy)
    assert chosen is not None and chosen["gen"] == 2
    gens[0]["state"] = "complete"  # (a link only complete: its lost files cannot be rebuilt; it is flushed, 2 is not)
    chosen, _ = usable_generation(gens, {"n2"})
    assert chosen is not None and chosen["gen"] == 1
    gens[1]["flushed"] = True  # (the whole chain flushed: it comes back from the flush directory)
    chosen, _ = usable_generation(gens, {"n2"})
    assert chosen is not None and chosen["gen"] == 2
    del gens[1]["flushed"]
    chosen, _ = usable_generation(gens, {"n3"})  # (nothing of the chain was on n3)
    assert chosen is not None and chosen["gen"] == 2
    gens[0]["state"] = "removed"
    chosen, _ = usable_generation(gens, set())
    assert chosen is None


def test_the_begin_asks_for_whole_files_when_the_gate_is_closed():
    def begin(force_full: bool) -> dict:
        rnd = rd.Round(job=1, gen=3, lineage=1, nodes=frozenset({"n1"}), trigger="user", started=0.0, placement=["n1"],
                       expect=lambda counters, n: {}, nranks=1, force_full=force_full)
        (call,) = rnd.handle(rd.Start(3))
        assert isinstance(call, rd.CallNodes) and call.op == "ckpt_begin"
        return call.args

    assert begin(True)["force_full"] is True
    assert "force_full" not in begin(False)


def test_the_gate_follows_the_jobs_mode_else_the_clusters_default_adaptive():
    from gangd.daemon.ckptcoord import delta_gate
    from gangd.daemon.config import Config

    assert Config.checkpoint_mode == "adaptive"
    for cluster in ("full", "incremental", "differential", "adaptive"):
        assert delta_gate("incremental", cluster) and delta_gate("adaptive", cluster) and delta_gate("differential", cluster)
        assert not delta_gate("full", cluster)  # (the job's --ckpt-mode over the cluster's)
        assert delta_gate(None, cluster) == (cluster != "full")  # (no --ckpt-mode: the cluster's [checkpoint] mode)


def test_gang_run_and_submit_offer_ckpt_mode_and_say_a_job_without_it_follows_the_clusters_mode():
    from click.testing import CliRunner

    from gangd.client.cli import main as cli_main

    for command in ("run", "submit"):
        # (asked in this process of the group the gang script runs, gangd.client.cli:main: not a Python each)
        result = CliRunner().invoke(cli_main, [command, "--help"], catch_exceptions=False)
        assert result.exit_code == 0, result.output
        shown = result.stdout
        assert "--ckpt-mode [full|incremental|differential|adaptive]" in shown
        assert "Default: the cluster's [checkpoint] mode (adaptive unless set)" in " ".join(shown.split())


# ------------------------------------------------------------------ cluster


@pytest.fixture(scope="module")
def _two_nodes():
    from conftest import shared_cluster

    with shared_cluster(2) as cluster:
        yield cluster


@pytest.fixture
def gc2(_two_nodes):
    """A 2-node cluster shared by the tests that lose no node (a cluster's start-up each was
    seconds of CPU on 2 cores); each test's jobs are killed after it, and what the tests check
    is per lineage (its generations, its files), so none sees another's."""
    from ckpthelpers import kill_what_is_left

    yield _two_nodes
    kill_what_is_left(_two_nodes)


class Steered:
    """A deltajob of 2 ranks, one per node, and the file that says how far it may go."""

    STEPS = 30

    def __init__(self, gc, tmp: Path, *options: str):
        self.gc = gc
        tmp.mkdir(mode=0o755, parents=True, exist_ok=True)
        os.chmod(tmp, 0o755)
        self.target = tmp / "target"
        self.go(0)
        self.argv = [str(JOB), "--steps", str(self.STEPS), "--target", str(self.target), *options]

    def go(self, step: int) -> None:
        tmp = self.target.with_suffix(".new")
        tmp.write_text(str(step))
        os.chmod(tmp, 0o644)
        os.replace(tmp, self.target)

    def submit(self, *options, n: int = 2, where: tuple[str, ...] = ("-N", "2")) -> int:
        from ckpthelpers import submit

        return submit(self.gc, self.argv, n, *where, *options)


def take(gc, job: int, timeout: float = 90) -> dict:
    """A checkpoint of ``job`` once its ranks take them (a restarted job's ranks register a moment after it starts)."""
    from ckpthelpers import checkpoint

    return checkpoint(gc, job, ready=timeout)  # (asked in this process, as `gang checkpoint --json` asks: 55 of them in this file)


#: Uninterrupted runs' results by (options, ranks, placement): the job is deterministic (its result
#: depends on its arguments and its number of ranks only), so each is run once, as ckpthelpers.reference does.
_references: dict[tuple, str] = {}


def reference_of(gc, tmp: Path, options: tuple[str, ...] = (), n: int = 2, where: tuple[str, ...] = ("-N", "2")) -> str:
    from ckpthelpers import result_of

    key = (tuple(options), n, tuple(where))
    if key not in _references:
        ref = Steered(gc, tmp, *options)
        ref.go(Steered.STEPS)
        _references[key] = result_of(gc, ref.submit("--ckpt-mode", "full", n=n, where=where), timeout=120)
    return _references[key]


def rank_file(gc, record: dict, lineage: int, gen: int, rank: int) -> Path:
    from ckpthelpers import gen_dir

    return gen_dir(gc, record["placement"][rank], lineage, gen) / ckptstore.cluster_rank_file(rank)


def on_disk(gc, lineage: int) -> set[int]:
    out: set[int] = set()
    for node in ("n1", "n2"):
        out |= set(ckptstore.generations(gc.dir / node / "state" / "checkpoints" / node, lineage))
    return out


@dataclass
class Chain:
    """A Steered job in --ckpt-mode incremental with generations 1 (full) <- 2 <- 3 (see :func:`incremental_chain`)."""

    expected: str  # an uninterrupted run's result
    job: Steered
    id: int
    entries: dict[int, dict]  # gen -> its entry (settled, if asked)

    @property
    def newest(self) -> dict:
        return self.entries[max(self.entries)]


def incremental_chain(gc, tmp: Path, level: str = "local", *, n: int = 2, where: tuple[str, ...] = ("-N", "2"), settle: bool = False) -> Chain:
    """An uninterrupted run's result, then a Steered job at ``level`` that took
    three incremental checkpoints, the newest needing the two before it."""
    from ckpthelpers import generations, settled

    expected = reference_of(gc, tmp / "ref", n=n, where=where)
    job = Steered(gc, tmp / "run")
    current = job.submit("--ckpt-mode", "incremental", "--ckpt-redundancy", level, n=n, where=where)
    for step in (2, 4, 6):
        job.go(step)
        assert take(gc, current)["state"] == "complete"
    chain = Chain(expected, job, current, {e["gen"]: e for e in (settled if settle else generations)(gc, current)})
    assert len(chain.newest.get("needs") or ()) == 2, chain.entries
    return chain


@pytest.mark.parametrize(("mode", "inline"), [("full", False), ("incremental", False), ("differential", True), ("adaptive", False)])
def test_a_job_in_each_mode_checkpointed_and_restarted_from_its_deltas_ends_as_an_uninterrupted_run(gc2, tmp_path, mode, inline):
    """Ten generations, a few blocks changed between each, the job killed and
    restarted from its newest generation after the 4th and the 7th: the
    result is bit-identical to an uninterrupted run's. In a delta mode the
    kept generations include deltas (their entries and `gang ckpt ls` say
    mode and base, their files are smaller than the state), each restart
    got its chain, and the kept generations are exactly the newest two and
    what they need, with nothing removed left on disk."""
    from ckpthelpers import generations, kill_and_restart, result_of

    gc = gc2
    options = ("--inline",) if inline else ()
    expected = reference_of(gc, tmp_path / "ref", options)
    job = Steered(gc, tmp_path / "run", *options)
    current = first = job.submit("--ckpt-mode", mode, "--ckpt-redundancy", "local")
    step = 0
    for n in range(1, 11):
        step += 2
        job.go(step)
        taken = take(gc, current)
        assert taken["state"] == "complete", taken
        if n in (4, 7):
            current = kill_and_restart(gc, current)
    job.go(Steered.STEPS)
    assert result_of(gc, current, timeout=120) == expected

    entries = {e["gen"]: e for e in generations(gc, current)}
    kept = {g for g, e in entries.items() if e["state"] in retention.DONE}
    needs = {g: e.get("needs") or [] for g, e in entries.items()}
    assert on_disk(gc, first) >= kept
    assert not (on_disk(gc, first) - delta.needed(needs, kept) - {g for g, e in entries.items() if e["state"] != "removed"})
    for g in kept:
        assert set(needs[g]) <= kept, f"generation {g} needs {needs[g]}, kept are {sorted(kept)}"
    assert kept == delta.needed(needs, sorted(kept)[-2:]), f"kept {sorted(kept)}, needs {needs}"  # (checkpoint_keep = 2, and nothing else)
    newest = max(kept)
    record = gc.job(current)
    if mode == "full":
        assert all(not needs[g] for g in entries)
        assert all(entries[g].get("mode") in (None, "full") for g in kept)
        return
    deltas = [g for g in sorted(kept) if needs[g]]  # (adaptive and incremental write a full now and then: chain_max, full_above)
    assert deltas, f"no kept generation of a {mode} job is a delta: {entries}"
    newest = deltas[-1]
    # (each rank chooses from its own blocks: one whose state changed nearly everywhere writes a full, full_above,
    # while the other writes a delta, and adaptive's new base is a rebase: how far the ranks got between two
    # checkpoints is up to the scheduler)
    assert entries[newest]["mode"] in ("incremental", "differential", "rebase", "mixed"), entries[newest]
    listing = gc.gang("ckpt", "ls", current, check=True).stdout.splitlines()
    assert listing[0].split()[4:8] == ["MODE", "BASE", "WRITTEN", "RESTORE"], listing[0]
    row = next(line.split() for line in listing[1:] if line.split()[0] == str(newest))
    assert row[4:6] == [entries[newest].get("mode") or "full", str(min(needs[newest])) if needs[newest] else "-"], row
    state_bytes = 512 * 1024
    roles = {"incremental": {"incr"}, "differential": {"diff"}, "adaptive": {"diff", "rebase"}}[mode]
    files = [rank_file(gc, record, first, newest, rank) for rank in (0, 1)]
    written = {path: blocks.read_index(path).role for path in files}
    assert set(written.values()) <= roles | {"full"} and set(written.values()) & roles, written
    for path, role in written.items():
        size = path.stat().st_size
        if role != "full":
            assert size < state_bytes * 0.9, f"{path}, a {role}, is {size} bytes"  # (else a full: full_above)
    if mode == "differential":
        assert all(len(needs[g]) <= 1 for g in entries)


def test_a_damaged_link_is_named_and_the_restart_starts_from_the_newest_intact_chain(gc2, tmp_path):
    """Incremental generations 1 (full) <- 2 <- 3: a byte flipped in rank 1's
    file of generation 2 on its node makes `gang restart` skip 3 and 2,
    naming generation 2, the node and the path, and start from 1; the
    job still ends with the uninterrupted result."""
    from ckpthelpers import flip_byte, result_of

    gc = gc2
    chain = incremental_chain(gc, tmp_path)
    job, current, entries = chain.job, chain.id, chain.entries
    middle = chain.newest["needs"][0]
    record = gc.job(current)
    damaged = rank_file(gc, record, current, middle, 1)
    flip_byte(damaged, damaged.stat().st_size // 3)
    gc.gang("kill", current, check=True)
    out = json.loads(gc.gang("restart", current, "--json", check=True).stdout)
    restarted = out["record"]["id"]
    said = json.dumps(out)
    assert f"it needs generation {middle}, which is damaged" in said and str(damaged) in said and record["placement"][1] in said, said
    assert out["record"]["restart_of"]["gen"] == min(entries), out["record"]["restart_of"]
    job.go(Steered.STEPS)
    assert result_of(gc, restarted, timeout=120) == chain.expected


def test_a_restart_elsewhere_from_a_delta_stages_every_link(gc2, tmp_path):
    """`gang restart -w n1` of a job that ran on n1 and n2, from an
    incremental generation: rank 1's files of the generation and of every
    generation it needs are staged on n1, and the job ends bit-identical to
    an uninterrupted run."""
    from ckpthelpers import generations, result_of

    gc = gc2
    chain = incremental_chain(gc, tmp_path)
    job, current, newest = chain.job, chain.id, chain.newest
    gc.gang("kill", current, check=True)
    out = json.loads(gc.gang("restart", current, "-g", newest["gen"], "-w", "n1", "--json", check=True).stdout)
    moved = out["record"]["id"]
    entries = {e["gen"]: e for e in generations(gc, moved)}
    for gen in (newest["gen"], *newest["needs"]):
        assert entries[gen]["copies"] == {"n1": [1]}, entries[gen]  # (recorded: retention removes them)
    job.go(Steered.STEPS)
    assert result_of(gc, moved, timeout=120) == chain.expected



@pytest.mark.parametrize("level", ["partner", "xor"])
def test_a_lost_node_s_chain_is_rebuilt_link_by_link_and_the_restart_is_bit_identical(make_cluster, tmp_path, level):
    """A 3-rank job on n1-n3 at partner or XOR level writing incremental
    generations (each protected); n2 lost with its disk: `gang restart`
    rebuilds n2's files of the generation and of every link it needs on n4,
    from each one's own redundancy, and the job ends bit-identical to an
    uninterrupted run."""
    from ckpthelpers import generations, kill_what_is_left, result_of
    from test_rebuild import lose
    from test_restart_anywhere import restart

    gc = make_cluster(4)
    try:
        chain = incremental_chain(gc, tmp_path, level, n=3, where=("-w", "n1,n2,n3"), settle=True)
        job, current, entries, newest = chain.job, chain.id, chain.entries, chain.newest
        assert all(entries[g]["state"] == "protected" for g in (newest["gen"], *newest["needs"])), entries
        gc.gang("kill", current, check=True)
        lose(gc, "n2")
        answer = restart(gc, current)
        assert answer["gen"] == newest["gen"] and answer["rebuilt"] == {"n2": "n4"}, answer
        recorded = {e["gen"]: e for e in generations(gc, current)}
        for gen in (newest["gen"], *newest["needs"]):
            assert recorded[gen]["copies"].get("n4") == [1], recorded[gen]
        job.go(Steered.STEPS)
        assert result_of(gc, answer["record"]["id"], timeout=180) == chain.expected
    finally:
        kill_what_is_left(gc)


def test_a_flushed_delta_comes_back_with_its_links_after_its_node_is_lost(make_cluster, tmp_path):
    """In a cluster that flushes, a delta's links are flushed before it; the
    job's second node lost with its disk (local level: no redundancy), the
    restart restores that node's files of the generation and of every link
    from the flush directory and ends bit-identical to an uninterrupted run."""
    from ckpthelpers import generations, kill_what_is_left, result_of
    from conftest import wait_for
    from test_rebuild import lose
    from test_restart_anywhere import restart

    shared = tmp_path / "shared"
    gc = make_cluster(2, flush_dir=shared)
    try:
        chain = incremental_chain(gc, tmp_path)
        job, current, newest = chain.job, chain.id, chain.newest

        def all_flushed():
            entries = {e["gen"]: e for e in generations(gc, current)}
            return all(entries[g].get("flushed") for g in (newest["gen"], *newest["needs"]))

        wait_for(all_flushed, 60, "the generation and its links flushed")
        for gen in (newest["gen"], *newest["needs"]):
            assert ckptstore.verify(shared / f"job-{current}" / f"gen-{gen}" / "n2") == []
        gc.gang("kill", current, check=True)
        lose(gc, "n2")
        answer = restart(gc, current)
        assert answer["gen"] == newest["gen"] and answer["placement"] == ["n1", "n1"], answer
        recorded = {e["gen"]: e for e in generations(gc, current)}
        for gen in (newest["gen"], *newest["needs"]):
            assert recorded[gen]["copies"].get("n1") == [1], recorded[gen]
        job.go(Steered.STEPS)
        assert result_of(gc, answer["record"]["id"], timeout=180) == chain.expected
    finally:
        kill_what_is_left(gc)
