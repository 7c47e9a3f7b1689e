"""The checkpoint protocol's pure state machines (gangd.checkpoint): the races
that cluster tests reach only now and then, as deterministic tests and as
hypothesis stateful tests over random interleavings."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from gangd.checkpoint import messages as m
from gangd.checkpoint import node as nd
from gangd.checkpoint import rank as rk
from gangd.checkpoint import round as rd

NODES = ("n1", "n2", "n3")
RARE = st.integers(0, 7)  # a failure rule acts only when this draws 0: rounds also get to complete


def expect(counters: dict, nranks: int) -> dict:
    return {"nodes": sorted(counters)}


def commit_answer(node: str) -> dict:
    return {"node": node, "ranks": 1, "bytes": 10, "state_bytes": 5, "times": {"begin": 1.0, "committed": 2.0}}


def make_round(gen: int = 1, nodes=NODES, redundancy: str = "local") -> rd.Round:
    return rd.Round(
        job=7, gen=gen, lineage=7, nodes=frozenset(nodes), trigger="test", started=0.0, placement=list(nodes),
        expect=expect, nranks=len(nodes), redundancy=redundancy,
    )


def answer_for(phase: rd.Phase, node: str, iteration: int = 3):
    if phase is rd.Phase.BEGIN:
        return {"iteration": iteration}
    if phase is rd.Phase.COMMIT:
        return commit_answer(node)
    return {}


def run_phase(r: rd.Round, results=None) -> list:
    out: list = []
    phase = r.phase
    for node in sorted(r.nodes):
        out += r.handle(rd.Answered(r.gen, phase, node, (results or {}).get(node, answer_for(phase, node))))
    return out


# ---------------------------------------------------------------- messages: hostile input


@pytest.mark.parametrize(
    "args",
    [
        None, [], "x", {"gen": "1", "iteration": 2}, {"gen": True, "iteration": 2}, {"gen": 1, "iteration": 2.5},
        {"gen": -1, "iteration": 2}, {"gen": 2**70, "iteration": 1}, {"gen": 1, "iteration": 1, "why": 5},
    ],
)
def test_a_hostile_report_is_refused_with_a_sentence(args):
    with pytest.raises(m.BadMessage) as info:
        m.RankReport.from_wire(args)
    assert str(info.value)


def test_messages_round_trip_and_keep_the_wire_ops():
    messages = (m.RankReport(3, 5), m.RankReport(None, 2), m.RankReport(3, None, "past the cut"), m.StartSync(3, 5))
    for msg in (*messages, m.EndSync(3, {"size": 1}), m.EndSync(3, None, True)):
        assert type(msg).from_wire(msg.to_wire()) == msg
    assert m.RankReport.op == "ckpt_report" and m.RankWritten.op == "ckpt_written" and m.CutNote.op == "ckpt_cut"
    assert m.daemon_note("ckpt_cut", {"gen": 1, "iteration": "x"}) is None
    assert m.rank_note("ckpt_report", {"gen": 2, "iteration": 4, "why": "\x1b[2J" * 400}).why.count("\x1b") == 0


@pytest.mark.parametrize(
    "result, words",
    [
        ({"size": -1, "digest": "ab"}, "byte count"), ({"size": 2**40, "digest": "ab"}, "more than"),
        ({"size": 1, "digest": ""}, "checksum"), ({"size": 1, "digest": "a", "seconds": float("nan")}, "seconds"), ("x", "malformed"),
    ],
)
def test_a_hostile_write_report_is_refused(result, words):
    with pytest.raises(m.BadMessage, match=words):
        m.WriteReport.parse(result, 2**30)


# ---------------------------------------------------------------- the round: deterministic races


def test_a_round_runs_its_phases_in_order_and_completes_only_when_every_node_committed():
    r = make_round()
    [call] = r.handle(rd.Start(1))
    assert call.op == "ckpt_begin" and call.args == {"gen": 1, "lineage": 7}
    out = run_phase(r, {"n1": {"iteration": 4}, "n2": {"iteration": 9}, "n3": {"iteration": None}})
    assert r.cut == 9 and out == [rd.CallNodes(rd.Phase.CUT, "ckpt_cut", {"gen": 1, "iteration": 9})]
    [capture] = run_phase(r)
    assert capture.args["expect"] == {"nodes": list(NODES)}
    run_phase(r)
    run_phase(r)
    assert r.phase is rd.Phase.COMMIT
    assert r.handle(rd.Answered(1, rd.Phase.COMMIT, "n1", commit_answer("n1"))) == []
    assert r.handle(rd.Answered(1, rd.Phase.COMMIT, "n2", commit_answer("n2"))) == []
    out = r.handle(rd.Answered(1, rd.Phase.COMMIT, "n3", commit_answer("n3")))
    assert r.phase is rd.Phase.COMPLETE
    assert [type(i) for i in out] == [rd.Record, rd.Prune, rd.Finish]
    assert out[0].entry["state"] == "complete" and set(out[0].entry["nodes"]) == set(NODES)


def test_an_abort_between_cut_and_capture_leaves_nothing_to_commit():
    r = make_round()
    r.handle(rd.Start(1))
    run_phase(r)
    run_phase(r)  # cut answered: capture called
    out = r.handle(rd.NodeFailed(1, rd.Phase.CAPTURE, "n2", "checkpoint_failed", "rank 1 exited"))
    assert [type(i) for i in out] == [rd.AbortNodes, rd.Record, rd.Finish] and out[1].entry["state"] == "aborted"
    for phase in rd.Phase:
        for node in NODES:
            assert r.handle(rd.Answered(1, phase, node, answer_for(phase, node))) == []
    assert r.phase is rd.Phase.ABORTED


def test_answers_for_a_stale_generation_give_no_instruction():
    r = make_round(gen=5)
    r.handle(rd.Start(5))
    for node in NODES:
        assert r.handle(rd.Answered(4, rd.Phase.BEGIN, node, {"iteration": 1})) == []
        assert r.handle(rd.NodeFailed(4, rd.Phase.BEGIN, node, "x", "y")) == []
    assert r.handle(rd.Failed(4, "x", "y")) == [] and r.handle(rd.Deposed(4)) == [] and r.handle(rd.Protected(4)) == []
    assert r.phase is rd.Phase.BEGIN and not r.answers


def test_a_node_lost_mid_round_aborts_it_and_after_complete_only_spoils_protection():
    r = make_round()
    r.handle(rd.Start(1))
    run_phase(r)
    assert r.handle(rd.NodeLost("elsewhere")) == []
    out = r.handle(rd.NodeLost("n3"))
    assert r.phase is rd.Phase.ABORTED and out[1].entry["code"] == "node_lost"
    r2 = make_round(redundancy="xor")
    r2.handle(rd.Start(1))
    for _ in range(5):
        out = run_phase(r2)
    assert r2.phase is rd.Phase.COMPLETE and out[-1] == rd.WriteRedundancy(1, "xor")
    out = r2.handle(rd.NodeLost("n1"))
    assert r2.phase is rd.Phase.COMPLETE and "lost" in out[0].entry["redundancy"]
    assert r2.handle(rd.Protected(1)) == [rd.Record({**r2.entry})] and r2.phase is rd.Phase.PROTECTED


def test_a_refusal_at_begin_is_not_recorded_and_a_deposed_coordinator_records_nothing():
    r = make_round()
    r.handle(rd.Start(1))
    out = r.handle(rd.NodeFailed(1, rd.Phase.BEGIN, "n1", "not_ready", "rank 0 has not called init()"))
    assert r.phase is rd.Phase.REFUSED and [type(i) for i in out] == [rd.AbortNodes, rd.Finish]
    r = make_round()
    r.handle(rd.Start(1))
    run_phase(r)
    out = r.handle(rd.Deposed(1))
    assert [type(i) for i in out] == [rd.Finish] and out[0].result["state"] == "aborted"


def test_a_peer_answering_garbage_aborts_the_round():
    r = make_round()
    r.handle(rd.Start(1))
    out = r.handle(rd.Answered(1, rd.Phase.BEGIN, "n1", {"iteration": "lots"}))
    assert r.phase is rd.Phase.ABORTED and "iteration" in out[0].why
    r = make_round()
    r.handle(rd.Start(1))
    out = run_phase(r, {n: {"iteration": None} for n in NODES})
    assert r.phase is rd.Phase.ABORTED and "boundary" in out[0].why


def test_every_transition_taken_is_in_the_table():
    phases = {p for p, _ in rd.TRANSITIONS} | {q for qs in rd.TRANSITIONS.values() for q in qs}
    assert phases == set(rd.Phase)


# ---------------------------------------------------------------- the node: deterministic races


def test_a_begin_arriving_after_its_abort_is_refused_and_a_late_abort_spares_the_next_round():
    jobs = nd.NodeJobs("n1", 2**30)
    assert jobs.abort(7, 3, "coordinator gave up") == (True, None)
    with pytest.raises(nd.Refusal) as info:
        jobs.begin(7, 3, 7, [0])
    assert info.value.code == "checkpoint_failed"
    rnd = jobs.begin(7, 4, 7, [0])
    assert jobs.abort(7, 3, "late") == (False, None) and jobs.rounds[7] is rnd and rnd.failed is None
    with pytest.raises(nd.Refusal) as info:
        jobs.begin(7, 5, 7, [0])
    assert info.value.code == "busy"


def test_the_node_remembers_a_bounded_number_of_aborts():
    jobs = nd.NodeJobs("n1", 2**30)
    for gen in range(1, 1000):
        jobs.abort(7, gen, "x")
    assert len(jobs.aborted[7]) == nd.MAX_ABORTED


def node_through_resume(ranks=(0, 1)) -> nd.NodeRound:
    rnd = nd.NodeRound(7, 2, 7, "n1", list(ranks), 2**30)
    for r in ranks:
        rnd.handle(nd.Reported(r, m.RankReport(2, 5 + r)))
    assert rnd.phase is nd.NodePhase.REPORTED and rnd.cut_answer() == 5 + max(ranks)
    rnd.handle(nd.CutSet(9))
    for r in ranks:
        rnd.handle(nd.Arrived(r, 9, 1.0))
    rnd.handle(nd.Released({r: f"/x/{r}" for r in ranks}))
    for r in ranks:
        rnd.handle(nd.Ended(r, None))
    rnd.handle(nd.Resumed())
    return rnd


def test_a_rank_exiting_after_the_end_sync_gets_a_grace_for_its_write_report_and_before_it_fails_the_round():
    rnd = node_through_resume()
    assert rnd.handle(nd.RankGone(0, "rank 0 exited")) == [nd.AwaitWrite(0, "rank 0 exited before its state was written (checkpoint 2)")]
    rnd.handle(nd.Written(0, {"size": 3, "digest": "ab"}))
    rnd.handle(nd.Written(1, {"size": 3, "digest": "ab"}))
    assert rnd.phase is nd.NodePhase.WRITTEN
    rnd.handle(nd.Committed())
    assert rnd.phase is nd.NodePhase.COMMITTED
    early = nd.NodeRound(7, 2, 7, "n1", [0, 1], 2**30)
    early.handle(nd.RankGone(1, "rank 1 exited"))
    assert early.phase is nd.NodePhase.FAILED and "rank 1 exited during checkpoint 2" == early.failed


def test_stale_and_hostile_rank_reports_do_not_move_the_node():
    rnd = nd.NodeRound(7, 2, 7, "n1", [0, 1], 2**30)
    rnd.handle(nd.Reported(0, m.RankReport(1, 50)))  # stale generation
    rnd.handle(nd.Reported(5, m.RankReport(2, 50)))  # not a rank of this node
    rnd.handle(nd.Reported(0, m.RankReport(None, 50)))  # its own request while this runs
    assert rnd.reports == {} and rnd.phase is nd.NodePhase.BEGUN
    rnd.handle(nd.Arrived(0, 3, 0.0))  # the start sync before any cut
    assert rnd.phase is nd.NodePhase.FAILED


def test_a_write_report_past_the_size_limit_fails_the_round():
    rnd = node_through_resume()
    rnd.handle(nd.Written(0, {"size": 2**40, "digest": "ab"}))
    assert rnd.phase is nd.NodePhase.FAILED and "checkpoint_max_rank_bytes" in rnd.failed
    assert rnd.handle(nd.Committed()) == [] and rnd.phase is nd.NodePhase.FAILED


def test_reports_outside_a_round():
    assert nd.outside_round(m.RankReport(None, 4)) is nd.Outside.REQUEST
    assert nd.outside_round(m.RankReport(3, 4)) is nd.Outside.ABORT
    assert nd.outside_round(m.RankReport(None, None)) is nd.Outside.NONE


# ---------------------------------------------------------------- the rank: deterministic


def test_a_rank_past_the_cut_declines_and_one_at_it_saves():
    a = rk.RankAgreement()
    assert a.on_note(m.BeginNote(3)).request is True
    step = a.report(True, 4, 0, None)
    assert step.reports == [m.RankReport(3, 5)]
    assert a.boundary(5, True).action is rk.Action.WAIT
    a.on_note(m.CutNote(2, 99))  # another generation's cut: ignored
    assert a.cut is None
    a.on_note(m.CutNote(3, 7))
    assert a.boundary(5, True).action is rk.Action.RUN
    step = a.boundary(7, True)
    assert (step.action, step.gen) == (rk.Action.SAVE, 3)
    b = rk.RankAgreement()
    b.on_note(m.BeginNote(3))
    b.report(True, 4, 0, None)
    b.on_note(m.CutNote(3, 2))
    step = b.boundary(5, True)
    assert step.reports[0].iteration is None and "past the cut" in step.reports[0].why and step.request is False and b.state == "idle"


def test_an_abort_of_another_generation_leaves_the_rank_alone_and_its_own_warns_after_the_cut():
    a = rk.RankAgreement()
    a.on_note(m.BeginNote(3))
    a.report(True, 0, 0, None)
    a.on_note(m.CutNote(3, 1))
    assert a.on_note(m.AbortNote(2, "old")).warn is None and a.state == "cut"
    step = a.on_note(m.AbortNote(3, "a node died"))
    assert step.warn == "checkpoint 3 was aborted: a node died" and step.request is False and a.state == "idle"


# ---------------------------------------------------------------- stateful: the coordinator's rounds


class Rounds(RuleBasedStateMachine):
    """A lineage's rounds under random answers, failures, node losses,
    stale events, coordinator changes and redundancy outcomes."""

    def __init__(self):
        super().__init__()
        self.issued = 0
        self.finished: dict[int, int] = {}
        self.begin_answers: dict[str, int | None] = {}
        self.committed: set[str] = set()
        self.log: list = []
        self.round = self._new()

    def _new(self, redundancy: str = "xor") -> rd.Round:
        self.issued += 1
        r = make_round(gen=self.issued, redundancy=redundancy)
        self._feed(r, rd.Start(r.gen), r)
        return r

    def _feed(self, r: rd.Round, event, target=None) -> list:
        out = r.handle(event)
        for instr in out:
            gen = instr.args["gen"] if isinstance(instr, rd.CallNodes) else getattr(instr, "gen", None)
            if gen is None:
                gen = (getattr(instr, "entry", None) or getattr(instr, "result", None) or {}).get("gen")
            assert gen == r.gen, f"an instruction for generation {gen} from round {r.gen}"
            if isinstance(instr, rd.Finish):
                self.finished[r.gen] = self.finished.get(r.gen, 0) + 1
            if isinstance(instr, rd.Record) and instr.entry["state"] == "complete":
                assert self.committed == set(NODES), "complete without every node committed"
        self.log.append((event, out))
        return out

    @rule(pick=st.integers(0, 5), again=RARE, iteration=st.one_of(st.none(), st.integers(-1, 20)))
    def answer(self, pick, again, iteration):
        """A node answers (mostly one that has not yet: now and then one answers twice)."""
        r = self.round
        phase = r.phase
        waiting = [n for n in NODES if n not in r.answers] if again else list(NODES)
        node = (waiting or list(NODES))[pick % len(waiting or NODES)]
        if phase is rd.Phase.BEGIN and node not in r.answers:
            self.begin_answers[node] = iteration
        if phase is rd.Phase.COMMIT and not r.over:
            self.committed.add(node)
        self._feed(r, rd.Answered(r.gen, phase, node, answer_for(phase, node, iteration)))
        if phase is rd.Phase.BEGIN and r.phase is rd.Phase.CUT:
            assert r.cut == max(i for i in self.begin_answers.values() if i is not None)

    @rule(node=st.sampled_from(NODES), phase=st.sampled_from(list(rd.Phase)), stale=st.integers(1, 3))
    def stale_answer(self, node, phase, stale):
        r = self.round
        before = (r.phase, dict(r.answers))
        assert r.handle(rd.Answered(r.gen - stale, phase, node, answer_for(phase, node))) == []
        assert r.handle(rd.Failed(r.gen - stale, "x", "stale")) == []
        assert (r.phase, r.answers) == before

    @rule(node=st.sampled_from(NODES), code=st.sampled_from(["not_ready", "checkpoint_failed", "timeout"]), rare=RARE)
    def node_fails(self, node, code, rare):
        if rare:
            return
        r = self.round
        was = r.phase
        out = self._feed(r, rd.NodeFailed(r.gen, r.phase, node, code, "it failed"))
        if was in rd.RUNNING:
            assert r.phase is (rd.Phase.REFUSED if code == "not_ready" and was is rd.Phase.BEGIN else rd.Phase.ABORTED)
            assert isinstance(out[0], rd.AbortNodes)
        else:
            assert out == []

    @rule(node=st.sampled_from((*NODES, "n9")), rare=RARE)
    def node_lost(self, node, rare):
        if rare:
            return
        r = self.round
        was = r.phase
        self._feed(r, rd.NodeLost(node))
        if node != "n9" and was in rd.RUNNING:
            assert r.phase is rd.Phase.ABORTED
        if was is rd.Phase.COMPLETE:
            assert r.phase is rd.Phase.COMPLETE  # the generation stays complete, never protected

    @rule()
    def protected(self):
        r = self.round
        was = r.phase
        self._feed(r, rd.Protected(r.gen))
        assert r.phase is (rd.Phase.PROTECTED if was in (rd.Phase.COMPLETE, rd.Phase.PROTECTED) else was)

    @rule(rare=RARE)
    def coordinator_changes(self, rare):
        """The old coordinator's round can never finish; the new one numbers past it."""
        if rare:
            return
        old = self.round
        was = old.phase
        out = self._feed(old, rd.Deposed(old.gen))
        if was in rd.RUNNING:
            assert [type(i) for i in out] == [rd.Finish]
        self._next()

    @precondition(lambda self: self.round.over)
    @rule()
    def next_round(self):
        self._next()

    def _next(self):
        self.begin_answers, self.committed = {}, set()
        self.round = self._new()

    @invariant()
    def finished_at_most_once(self):
        assert all(n == 1 for n in self.finished.values())

    @invariant()
    def aborted_never_commits(self):
        r = self.round
        if r.phase in (rd.Phase.ABORTED, rd.Phase.REFUSED):
            assert r.entry["state"] in ("aborted", "refused")
        if r.phase in rd.USABLE:
            assert self.committed == set(NODES)


Rounds.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
test_rounds = Rounds.TestCase


# ---------------------------------------------------------------- stateful: one node's part


class NodeSide(RuleBasedStateMachine):
    RANKS = (0, 1, 2)

    def __init__(self):
        super().__init__()
        self.jobs = nd.NodeJobs("n1", 1000)
        self.gen = 1
        self.rnd = self.jobs.begin(7, 1, 7, list(self.RANKS))
        self.max_phase = self.rnd.phase

    @rule(rank=st.sampled_from((*RANKS, 9)), gen=st.integers(0, 3), it=st.one_of(st.none(), st.integers(-1, 9)))
    def report(self, rank, gen, it):
        before = dict(self.rnd.reports)
        self.rnd.handle(nd.Reported(rank, m.RankReport(gen or None, it)))
        if gen != self.rnd.gen or rank == 9:
            assert self.rnd.reports == before

    @rule(it=st.integers(0, 9))
    def cut(self, it):
        if self.rnd.phase is nd.NodePhase.REPORTED:
            self.rnd.handle(nd.CutSet(max(self.rnd.reports.values())))

    @rule(rank=st.sampled_from(RANKS))
    def arrive(self, rank):
        self.rnd.handle(nd.Arrived(rank, self.rnd.cut, 0.0))

    @rule()
    def release(self):
        if self.rnd.phase is nd.NodePhase.AT_CUT:
            self.rnd.handle(nd.Released({}))

    @rule(rank=st.sampled_from(RANKS), inline=st.booleans(), size=st.integers(0, 2000))
    def end(self, rank, inline, size):
        self.rnd.handle(nd.Ended(rank, {"size": size, "digest": "ab"} if inline else None))

    @rule(rank=st.sampled_from(RANKS), size=st.integers(0, 2000))
    def written(self, rank, size):
        self.rnd.handle(nd.Written(rank, {"size": size, "digest": "ab"}))

    @rule()
    def resume(self):
        if self.rnd.phase is nd.NodePhase.SAVED:
            self.rnd.handle(nd.Resumed())

    @rule()
    def commit(self):
        if self.rnd.phase is nd.NodePhase.WRITTEN:
            self.rnd.handle(nd.Committed())
            self.jobs.finished(self.rnd)

    @rule(rank=st.sampled_from(RANKS))
    def rank_exits(self, rank):
        out = self.rnd.handle(nd.RankGone(rank, f"rank {rank} exited"))
        if any(isinstance(i, nd.AwaitWrite) for i in out):
            assert self.rnd.resumed

    @rule(stale=st.booleans())
    def abort(self, stale):
        gen = self.rnd.gen - 1 if stale else self.rnd.gen
        under_way, before = self.jobs.rounds.get(7) is self.rnd, (self.rnd.phase, self.rnd.failed)
        applies, ended = self.jobs.abort(7, gen, "aborted")
        if stale and under_way:  # a late abort of an older generation spares the one under way
            assert not applies and (self.rnd.phase, self.rnd.failed) == before
        if applies and ended is not None:
            assert ended.phase in (nd.NodePhase.FAILED, nd.NodePhase.COMMITTED)
            if ended.phase is nd.NodePhase.FAILED:
                with pytest.raises(nd.Refusal):
                    self.jobs.begin(7, gen, 7, list(self.RANKS))  # the begin arriving after its abort

    @precondition(lambda self: self.rnd.phase in (nd.NodePhase.FAILED, nd.NodePhase.COMMITTED))
    @rule()
    def next_generation(self):
        self.jobs.finished(self.rnd)
        self.gen += 1
        self.rnd = self.jobs.begin(7, self.gen, 7, list(self.RANKS))
        self.max_phase = self.rnd.phase

    @invariant()
    def phases_only_move_forward(self):
        assert self.rnd.phase >= self.max_phase
        self.max_phase = self.rnd.phase

    @invariant()
    def committed_only_with_every_write(self):
        if self.rnd.phase is nd.NodePhase.COMMITTED:
            assert self.rnd.all_written() and self.rnd.all_ended() and self.rnd.all_arrived() and self.rnd.failed is None
            assert all(w.size <= 1000 for w in self.rnd.written.values())

    @invariant()
    def the_cut_is_the_largest_report(self):
        if self.rnd.cut is not None:
            assert self.rnd.cut == self.rnd.cut_answer()


NodeSide.TestCase.settings = settings(max_examples=150, stateful_step_count=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
test_node_side = NodeSide.TestCase


# ---------------------------------------------------------------- stateful: the ranks' agreement


class Ranks(RuleBasedStateMachine):
    """Ranks compute at their own pace; the daemons begin a generation, take
    the largest report as the cut; no rank is ever past the cut, and every
    rank saves at it."""

    N = 3

    def __init__(self):
        super().__init__()
        self.ranks = [rk.RankAgreement() for _ in range(self.N)]
        self.k = [-1] * self.N  # the last boundary each rank passed
        self.requested = [False] * self.N
        self.reports: dict[int, int] = {}
        self.gen = 0
        self.cut: int | None = None
        self.saved: dict[int, int] = {}
        self.waiting = [False] * self.N

    def _apply(self, i: int, step: rk.Step) -> None:
        if step.request is not None:
            self.requested[i] = step.request
        for report in step.reports:
            assert report.iteration is not None, f"rank {i} declined: {report.why}"
            if report.gen == self.gen and self.gen:
                assert self.cut is None or report.iteration <= self.cut
                self.reports[i] = report.iteration

    @rule(i=st.integers(0, N - 1))
    def compute(self, i):
        """Rank i reaches its next boundary."""
        if i in self.saved:
            return
        k = self.k[i] + 1
        step = self.ranks[i].boundary(k, self.requested[i])
        self._apply(i, step)
        if step.action is rk.Action.WAIT:
            return  # it stays before boundary k until the daemons speak
        if step.action is rk.Action.SAVE:
            assert step.gen == self.gen and k == self.cut
            self.saved[i] = k
        self.k[i] = k

    @precondition(lambda self: self.gen == 0)
    @rule()
    def begin(self):
        self.gen = 1
        for i, a in enumerate(self.ranks):
            self._apply(i, a.on_note(m.BeginNote(1)))
            self._apply(i, a.report(self.requested[i], self.k[i], 0, None))

    @precondition(lambda self: self.gen == 1 and self.cut is None and len(self.reports) == Ranks.N)
    @rule()
    def cut_note(self):
        self.cut = max(self.reports.values())
        assert all(k <= self.cut for k in self.k), "a rank is past the cut"
        for a in self.ranks:
            a.on_note(m.CutNote(1, self.cut))

    @rule(i=st.integers(0, N - 1))
    def stale_notes(self, i):
        state = (self.ranks[i].gen, self.ranks[i].cut)
        self.ranks[i].on_note(m.CutNote(99, 0))
        self.ranks[i].on_note(m.AbortNote(99, "stale"))
        assert (self.ranks[i].gen, self.ranks[i].cut) == state

    @invariant()
    def every_save_is_at_the_cut(self):
        assert all(k == self.cut for k in self.saved.values())


Ranks.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
test_ranks = Ranks.TestCase


# ---------------------------------------------------------------- stateful: a coordinator and its nodes together


class Cluster(RuleBasedStateMachine):
    """A coordinator's rounds driving three nodes' machines (one rank each)
    over calls that arrive in any order — an abort may overtake its begin —
    with node losses and coordinator changes (the new one aborts every round
    under way on every node, then numbers past the old one's generations)."""

    def __init__(self):
        super().__init__()
        self.nodes = {n: nd.NodeJobs(n, 1000) for n in NODES}
        self.rank_of = {n: i for i, n in enumerate(NODES)}
        self.inflight: dict[str, list] = {n: [] for n in NODES}
        self.gen = 0
        self.committed: set[tuple[str, int]] = set()
        self.aborted_at: set[tuple[str, int]] = set()
        self.reports: dict[int, dict[str, int]] = {}
        self.round = self._new_round()

    def _new_round(self) -> rd.Round:
        self.gen += 1
        r = make_round(gen=self.gen)
        self._run(r.handle(rd.Start(r.gen)))
        return r

    def _run(self, instructions):
        for instr in instructions:
            if isinstance(instr, rd.CallNodes):
                for n in NODES:
                    self.inflight[n].append(("call", self.round_gen(instr), instr))
            elif isinstance(instr, rd.AbortNodes):
                for n in NODES:
                    self.inflight[n].append(("abort", instr.gen, instr))
            elif isinstance(instr, rd.Record) and instr.entry["state"] == "complete":
                assert all((n, instr.entry["gen"]) in self.committed for n in NODES), "complete without every node's commit"

    @staticmethod
    def round_gen(instr: rd.CallNodes) -> int:
        return instr.args["gen"]

    def _answer(self, gen: int, phase: rd.Phase, node: str, result=None, failure: str | None = None):
        if failure is not None:
            self._run(self.round.handle(rd.NodeFailed(gen, phase, node, "checkpoint_failed", failure)))
        else:
            self._run(self.round.handle(rd.Answered(gen, phase, node, result)))

    @rule(node=st.sampled_from(NODES), pick=st.integers(0, 5), iteration=st.integers(0, 9))
    def deliver(self, node, pick, iteration):
        queue = self.inflight[node]
        if not queue:
            return
        kind, gen, instr = queue.pop(pick % len(queue))
        jobs, rank = self.nodes[node], self.rank_of[node]
        if kind == "abort":
            jobs.abort(7, gen, instr.why)
            self.aborted_at.add((node, gen))
            return
        phase = instr.phase
        if phase is rd.Phase.BEGIN:
            try:
                rnd = jobs.begin(7, gen, 7, [rank])
            except nd.Refusal as exc:
                assert exc.code == "busy" or (node, gen) in self.aborted_at
                self._answer(gen, phase, node, failure=exc.message)
                return
            rnd.handle(nd.Reported(rank, m.RankReport(gen, iteration)))
            self.reports.setdefault(gen, {})[node] = iteration
            self._answer(gen, phase, node, {"iteration": rnd.cut_answer()})
            return
        try:
            rnd = jobs.get(7, gen)
        except nd.Refusal as exc:
            self._answer(gen, phase, node, failure=exc.message)
            return
        if phase is rd.Phase.CUT:
            assert instr.args["iteration"] == max(self.reports[gen].values()), "the cut is not the largest report"
            rnd.handle(nd.CutSet(instr.args["iteration"]))
            rnd.handle(nd.Arrived(rank, instr.args["iteration"], 0.0))
            result: dict = {}
        elif phase is rd.Phase.CAPTURE:
            rnd.handle(nd.Released({rank: "x"}))
            rnd.handle(nd.Ended(rank, {"size": 1, "digest": "ab"}))
            result = {}
        elif phase is rd.Phase.RESUME:
            rnd.handle(nd.Resumed())
            result = {}
        else:
            rnd.handle(nd.Committed())
            jobs.finished(rnd)
            if rnd.phase is not nd.NodePhase.COMMITTED:
                self._answer(gen, phase, node, failure=rnd.failed or "not committed")
                return
            assert (node, gen) not in self.aborted_at, "a node committed a generation after its abort"
            self.committed.add((node, gen))
            result = commit_answer(node)
        if rnd.failed:
            self._answer(gen, phase, node, failure=rnd.failed)
        else:
            self._answer(gen, phase, node, result)

    @rule(node=st.sampled_from(NODES), rare=RARE)
    def node_lost(self, node, rare):
        if rare:
            return
        self._run(self.round.handle(rd.NodeLost(node)))

    @rule(rare=RARE)
    def coordinator_changes(self, rare):
        if rare:
            return
        self._run(self.round.handle(rd.Deposed(self.round.gen)))
        for n, jobs in self.nodes.items():  # ckpt_abort_all on every node
            for job, rnd in list(jobs.rounds.items()):
                jobs.abort(job, rnd.gen, "the coordinator changed")
                self.aborted_at.add((n, rnd.gen))
        self.inflight = {n: [] for n in NODES}  # the old coordinator's calls die with it
        self.round = self._new_round()

    @precondition(lambda self: self.round.over)
    @rule()
    def next_round(self):
        self.round = self._new_round()

    @invariant()
    def complete_means_every_node_committed(self):
        if self.round.phase in rd.USABLE:
            assert all((n, self.round.gen) in self.committed for n in NODES)


Cluster.TestCase.settings = settings(max_examples=200, stateful_step_count=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
test_cluster = Cluster.TestCase


# ---------------------------------------------------------------- the rank: an interval plan (issue 19)


def _planned(next_: int, every: int, lead: int) -> rk.RankAgreement:
    a = rk.RankAgreement()
    a.on_note(m.PlanNote(next_, every, lead))
    return a


def test_a_planned_rank_asks_lead_iterations_ahead_and_every_rank_saves_at_the_planned_iteration():
    asker, other = _planned(10, 5, 2), _planned(10, 5, 2)
    assert asker.due(7, False, now=0.0).reports == []  # (not yet: 10 - 2 = 8)
    step = asker.due(8, False, now=0.0)
    assert step.request is True and step.reports == [m.RankReport(None, 10)]
    assert asker.boundary(8, True).action is rk.Action.RUN  # (no stop: it asked for 10)
    # The daemons begin the generation at the planned iteration; both report it, whatever their own position.
    for a, at in ((asker, 8), (other, 3)):
        assert a.on_note(m.BeginNote(4, at=10)).request is True
        assert a.report(True, at, 0, None).reports == [m.RankReport(4, 10)]
    for a in (asker, other):
        a.on_note(m.CutNote(4, 10))
        assert a.boundary(9, True).action is rk.Action.RUN
        step = a.boundary(10, True)
        assert (step.action, step.gen) == (rk.Action.SAVE, 4)
        assert a.plan == m.PlanNote(15, 5, 2)  # then every 5


def test_with_no_lead_the_rank_stops_at_the_planned_iteration_and_reports_it_not_the_next():
    a = _planned(6, 3, 0)
    step = a.due(6, False, now=0.0)
    assert step.reports == [m.RankReport(None, 6)]
    assert a.boundary(6, True).action is rk.Action.WAIT  # (it sits at 6: it can still stop there)
    a.on_note(m.BeginNote(2, at=6))
    assert a.report(True, 6, 0, None).reports == [m.RankReport(2, 6)]
    a.on_note(m.CutNote(2, 6))
    assert a.boundary(6, True).action is rk.Action.SAVE and a.plan.next == 9


def test_a_plan_that_arrives_late_is_checkpointed_at_once_never_skipped():
    a = rk.RankAgreement()
    a.on_note(m.PlanNote(5, 4, 1))
    step = a.due(9, False, now=0.0)  # (already past 5)
    assert step.reports == [m.RankReport(None, 9)] and step.request is True
    a.on_note(m.BeginNote(3, at=9))
    a.report(True, 9, 0, None)
    a.on_note(m.CutNote(3, 10))  # (another rank was further on)
    assert a.boundary(9, True).action is rk.Action.RUN
    assert a.boundary(10, True).action is rk.Action.SAVE and a.plan.next == 14


def test_a_planned_request_that_was_not_taken_up_is_asked_again_after_a_pause():
    a = _planned(4, 4, 1)
    assert a.due(3, False, now=100.0).reports == [m.RankReport(None, 4)]
    a.on_note(m.NoneNote())  # (refused: say a checkpoint was still being committed)
    assert a.reported is None
    assert a.due(4, False, now=100.5).reports == []  # (not at once)
    assert a.due(5, False, now=100.0 + rk.PLAN_RETRY).reports == [m.RankReport(None, 5)]


def test_a_manual_checkpoint_during_a_plan_is_not_held_to_the_planned_iteration_and_resets_the_count():
    a = _planned(50, 10, 1)
    a.on_note(m.BeginNote(7))  # (gang checkpoint: no `at`)
    assert a.report(True, 12, 0, None).reports == [m.RankReport(7, 13)]
    a.on_note(m.CutNote(7, 13))
    assert a.boundary(13, True).action is rk.Action.SAVE
    assert a.plan.next == 23
    a.clear(7)  # (the agent, once the generation is saved)
    assert a.due(21, False, now=0.0).reports == []  # (23 - lead 1 = 22)
    assert a.due(22, False, now=0.0).reports == [m.RankReport(None, 23)]


def test_no_plan_request_while_a_generation_is_under_way_and_a_zero_plan_is_none():
    a = _planned(5, 5, 1)
    a.on_note(m.BeginNote(2))
    assert a.due(6, True, now=0.0).reports == []
    a.on_note(m.PlanNote(0, 0))
    assert a.plan is None


def test_plan_and_begin_notes_are_checked_at_the_boundary():
    assert m.daemon_note("ckpt_plan", {"next": -1, "every": 3}) is None
    assert m.daemon_note("ckpt_plan", {"next": 3, "every": "x"}) is None
    assert m.daemon_note("ckpt_begin", {"gen": 2, "at": "soon"}) is None
    assert m.daemon_note("ckpt_plan", {"next": 3, "every": 2}) == m.PlanNote(3, 2, 0)
    with pytest.raises(m.BadMessage):
        m.rank_note("ckpt_progress", {"iteration": 3, "t_iter": float("nan")})
    with pytest.raises(m.BadMessage):
        m.rank_note("ckpt_progress", {"iteration": 3, "t_iter": -1.0})
    assert m.rank_note("ckpt_progress", {"iteration": 3, "t_iter": 0.5}) == m.RankProgress(3, 0.5)


class PlannedRanks(RuleBasedStateMachine):
    """Ranks under a plan compute at their own pace and ask for the planned
    checkpoint themselves; the daemons begin at the first request's
    iteration and cut at the largest report. Every save is at the cut, and
    when every rank was still before the planned iteration as the begin came,
    the cut is the planned iteration."""

    N = 3

    def __init__(self):
        super().__init__()
        self.plan = m.PlanNote(6, 4, 1)
        self.ranks = [_planned(6, 4, 1) for _ in range(self.N)]
        self.k = [0] * self.N  # the boundary each rank reaches next (or waits at)
        self.requested = [False] * self.N
        self.asked: list[int] = []
        self.gen = 0
        self.reports: dict[int, int] = {}
        self.cut: int | None = None
        self.saved: dict[int, int] = {}
        self.before_plan = True
        self.now = 0.0

    def _apply(self, i, step):
        if step.request is not None:
            self.requested[i] = step.request
        for report in step.reports:
            assert report.iteration is not None, report.why
            if report.gen is None:
                self.asked.append(report.iteration)
            elif report.gen == self.gen:
                self.reports[i] = report.iteration

    @rule(i=st.integers(0, N - 1))
    def compute(self, i):
        if i in self.saved:
            return
        k = self.k[i]
        self._apply(i, self.ranks[i].due(k, self.requested[i], self.now))
        step = self.ranks[i].boundary(k, self.requested[i])
        self._apply(i, step)
        if step.action is rk.Action.WAIT:
            return
        if step.action is rk.Action.SAVE:
            assert k == self.cut
            self.saved[i] = k
            assert self.ranks[i].plan.next == k + self.plan.every
            return
        self.k[i] = k + 1

    @precondition(lambda self: self.gen == 0 and self.asked)
    @rule()
    def begin(self):
        self.gen = 1
        at = self.asked[0]
        self.before_plan = all(k <= self.plan.next for k in self.k)  # (none has passed it)
        for i, a in enumerate(self.ranks):
            self._apply(i, a.on_note(m.BeginNote(1, at=at)))
            # (the last boundary passed, as cp.iteration says: the one it waits at, else the one before the next)
            iteration = self.k[i] if a.waiting == self.k[i] else self.k[i] - 1
            self._apply(i, a.report(self.requested[i], iteration, 0, None))

    @precondition(lambda self: self.gen == 1 and self.cut is None and len(self.reports) == PlannedRanks.N)
    @rule()
    def cut_note(self):
        self.cut = max(self.reports.values())
        if self.before_plan:
            assert self.cut == self.plan.next, (self.cut, self.k)
        for a in self.ranks:
            a.on_note(m.CutNote(1, self.cut))

    @invariant()
    def every_save_is_at_the_cut(self):
        assert all(k == self.cut for k in self.saved.values())


PlannedRanks.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
test_planned_ranks = PlannedRanks.TestCase
