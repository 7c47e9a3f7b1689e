"""The coordinator's round of one checkpoint generation, as a pure state machine.

:class:`Round` is fed events (:class:`Start`, a node's :class:`Answered` or
:class:`NodeFailed`, :class:`Failed`, :class:`NodeLost`, :class:`Deposed`,
then after completion :class:`Protected` or :class:`RedundancyFailed`) and
answers each with a list of instructions for its shell
(:mod:`gangd.daemon.ckptcoord`) to execute: call an op on every node of the
job, abort the generation on them, record the generation, prune, finish.

The table (``TRANSITIONS``; drawn in the README)::

    BEGIN   --all nodes answered--> CUT      (cut = max reported boundary)
    CUT     --all nodes answered--> CAPTURE  (expected deliveries from the counters)
    CAPTURE --all nodes answered--> RESUME
    RESUME  --all nodes answered--> COMMIT
    COMMIT  --all nodes answered--> COMPLETE (every node committed locally)
    COMPLETE --Protected---------> PROTECTED (the redundancy writer's word)
    COMPLETE --RedundancyFailed/NodeLost--> COMPLETE (never protected)
    BEGIN   --"not_ready" failure--> REFUSED (no record; the number is spent)
    any running phase --failure, node lost--> ABORTED
    any running phase --Deposed--> ABORTED   (the new coordinator aborts on the nodes)

An event of another generation, or an answer for a phase that is not the
current one, or anything after a final state, yields no instruction.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .messages import BadMessage, BeginAnswer, CommitAnswer, generation_mode


class Phase(enum.Enum):
    BEGIN = "begin"
    CUT = "cut"
    CAPTURE = "capture"
    RESUME = "resume"
    COMMIT = "commit"
    COMPLETE = "complete"  # every node committed locally
    PROTECTED = "protected"  # the redundancy writer made it survive the loss of a node of each set
    ABORTED = "aborted"
    REFUSED = "refused"


RUNNING = (Phase.BEGIN, Phase.CUT, Phase.CAPTURE, Phase.RESUME, Phase.COMMIT)
#: Generation states a restart may use (``protected`` also survives a lost node).
USABLE = (Phase.COMPLETE, Phase.PROTECTED)

#: The node op of each running phase.
OPS = {Phase.BEGIN: "ckpt_begin", Phase.CUT: "ckpt_cut", Phase.CAPTURE: "ckpt_capture", Phase.RESUME: "ckpt_resume", Phase.COMMIT: "ckpt_commit"}

#: (phase, event kind) -> the phases it may lead to.
TRANSITIONS: dict[tuple[Phase, str], tuple[Phase, ...]] = {
    (Phase.BEGIN, "answered"): (Phase.CUT, Phase.ABORTED),  # (aborted: no rank reported a boundary)
    (Phase.CUT, "answered"): (Phase.CAPTURE,),
    (Phase.CAPTURE, "answered"): (Phase.RESUME,),
    (Phase.RESUME, "answered"): (Phase.COMMIT,),
    (Phase.COMMIT, "answered"): (Phase.COMPLETE, Phase.ABORTED),  # (aborted: a malformed answer)
    (Phase.BEGIN, "failed"): (Phase.REFUSED, Phase.ABORTED),
    **{(p, "failed"): (Phase.ABORTED,) for p in (Phase.CUT, Phase.CAPTURE, Phase.RESUME, Phase.COMMIT)},
    **{(p, "node_lost"): (Phase.ABORTED,) for p in RUNNING},
    **{(p, "deposed"): (Phase.ABORTED,) for p in RUNNING},
    (Phase.COMPLETE, "protected"): (Phase.PROTECTED,),
    (Phase.COMPLETE, "redundancy_failed"): (Phase.COMPLETE,),
    (Phase.COMPLETE, "node_lost"): (Phase.COMPLETE,),
}


# ---------------------------------------------------------------- events


@dataclass(frozen=True)
class Start:
    gen: int


@dataclass(frozen=True)
class Answered:
    """``node`` answered the op of ``phase`` for generation ``gen``."""

    gen: int
    phase: Phase
    node: str
    result: Any


@dataclass(frozen=True)
class NodeFailed:
    gen: int
    phase: Phase
    node: str
    code: str
    message: str


@dataclass(frozen=True)
class Failed:
    """The round failed as a whole (a call to several nodes, a timeout, a bug)."""

    gen: int
    code: str
    message: str


@dataclass(frozen=True)
class NodeLost:
    node: str


@dataclass(frozen=True)
class Deposed:
    """This coordinator stepped down: its round can never finish."""

    gen: int


@dataclass(frozen=True)
class Protected:
    gen: int


@dataclass(frozen=True)
class RedundancyFailed:
    gen: int
    message: str


Event = Start | Answered | NodeFailed | Failed | NodeLost | Deposed | Protected | RedundancyFailed


# ---------------------------------------------------------------- instructions


@dataclass(frozen=True)
class CallNodes:
    """Call ``op`` with ``args`` on every node of the job; feed back one
    :class:`Answered` per node (or :class:`Failed`/:class:`NodeFailed`)."""

    phase: Phase
    op: str
    args: dict


@dataclass(frozen=True)
class AbortNodes:
    gen: int
    why: str


@dataclass(frozen=True)
class Record:
    """Append (or update) the generation's entry in the job's record."""

    entry: dict


@dataclass(frozen=True)
class Prune:
    gen: int


@dataclass(frozen=True)
class WriteRedundancy:
    """Start the redundancy write of a complete generation (none exists yet
    for ``local``; the writer answers with :class:`Protected` or
    :class:`RedundancyFailed`)."""

    gen: int
    level: str


@dataclass(frozen=True)
class Finish:
    """The round is over: release the job, answer whoever waits."""

    result: dict


Instruction = CallNodes | AbortNodes | Record | Prune | WriteRedundancy | Finish


# ---------------------------------------------------------------- the machine


def node_stats(result: dict, answer: CommitAnswer | None = None) -> dict:
    """One node's checkpoint, broken down like paper 000's Table 4 (seconds); with ``pipeline``, the
    node's compressed writes (issue 18: bytes in and out, each stage's busy and CPU seconds) from its
    checked ``answer``. ``blocked`` (the job stopped) and ``disk`` (until the state was durable) stay
    two figures: a forked snapshot's job is blocked milliseconds while its disk time is seconds."""
    t = result["times"]

    def span(a: str, b: str) -> float:
        return round(max(0.0, t.get(b, t.get(a, 0.0)) - t.get(a, 0.0)), 6)

    prep_wait = span("closed", "capture")  # waiting for the other nodes' ranks to reach the cut
    finish_wait = span("saved", "resume")  # waiting for the slowest node to save
    prep, write, finish = span("at_cut", "released"), span("released", "saved"), span("saved", "resumed")
    disk = span("released", "written")
    return {
        "ranks": result["ranks"],
        "bytes": result["bytes"],
        "state_bytes": result["state_bytes"],
        "agree": span("begin", "reported"),  # ranks answering SIGQUIT (the job runs on)
        "reach": span("reported", "at_cut"),  # ranks computing up to the cut (the job runs on)
        "prep": prep,
        "write": write,
        "finish": finish,
        "blocked": span("at_cut", "resumed"),
        "disk": disk,  # released -> state on disk (in the background, for forked snapshots)
        "commit": span("written", "committed"),
        "sync_overhead": round(max(0.0, prep - prep_wait) + max(0.0, finish - finish_wait), 6),
        "bandwidth": round(result["bytes"] / disk, 1) if disk > 0 else None,
        **({"pipeline": answer.pipeline} if answer is not None and answer.pipeline is not None else {}),
    }


def delta_fields(answers: list[CommitAnswer]) -> dict:
    """A complete generation's entry fields of issue 17: its ``mode`` (full,
    incremental, differential, mixed), the older generations its files
    ``needs`` (the union over nodes, newest first), the bytes of its rank files
    (``written``) and the bytes a restore of it reads (``restore_bytes``)."""
    modes: dict[str, int] = {}
    for answer in answers:
        for role, count in answer.modes.items():
            modes[role] = modes.get(role, 0) + count
    needs = sorted({g for answer in answers for g in answer.needs}, reverse=True)
    out = {"mode": generation_mode(modes), "needs": needs, "written": sum(a.written for a in answers),
           "restore_bytes": sum(a.restore for a in answers)}
    codecs = sorted({c for a in answers for c in a.codecs})
    if codecs:  # (issue 18: the codecs its files record; none listed: raw files)
        out["codecs"] = codecs
    return out


@dataclass
class Round:
    """The coordinator's checkpoint of one job (one generation)."""

    job: int
    gen: int
    lineage: int
    nodes: frozenset[str]
    trigger: str
    started: float
    placement: list[str]
    expect: Callable[[dict, int], dict]  # counters of every node, nranks -> expected deliveries (jobnet's)
    nranks: int
    redundancy: str = "local"
    force_full: bool = False  # every rank writes its whole state (no delta offered: see ckptcoord.delta_gate)
    at: int | None = None  # the iteration an interval plan named (issue 19): no rank reports before it
    clock: Callable[[], float] = field(default=lambda: 0.0)
    phase: Phase = Phase.BEGIN
    answers: dict[str, Any] = field(default_factory=dict)  # node -> answer of the current phase
    cut: int | None = None
    entry: dict = field(default_factory=dict)
    marks: dict[str, float] = field(default_factory=dict)
    started_calls: bool = False
    expected: dict = field(default_factory=dict)  # the deliveries capture drains up to (from the cut's counters)

    def __post_init__(self) -> None:
        if not self.nodes:
            raise ValueError("a round needs at least one node")
        self.entry = {
            "gen": self.gen, "state": "running", "trigger": self.trigger, "started": self.started, "ended": None,
            "iteration": None, "reason": "", "placement": list(self.placement), "nodes": {},
        }
        if self.at is not None:  # (issue 19: the iteration an interval plan named; the cut is it unless a rank was past it)
            self.entry["planned_at"] = self.at

    @property
    def over(self) -> bool:
        return self.phase not in RUNNING

    # -------------------------------------------------------- events

    def handle(self, event: Event) -> list[Instruction]:
        if isinstance(event, NodeLost):
            return self._node_lost(event.node)
        if getattr(event, "gen", None) != self.gen:
            return []  # another generation's: never an instruction for it
        if isinstance(event, Start):
            if self.started_calls or self.phase is not Phase.BEGIN:
                return []
            self.started_calls = True
            self.marks["start"] = self.clock()
            return [self._call()]
        if isinstance(event, Answered):
            return self._answered(event)
        if isinstance(event, NodeFailed):
            if event.phase is not self.phase or event.node not in self.nodes:
                return []
            return self._fail(event.code, f"{event.message}")
        if isinstance(event, Failed):
            return self._fail(event.code, event.message) if not self.over else []
        if isinstance(event, Deposed):
            if self.over:
                return []
            self._to(Phase.ABORTED, "deposed")
            self.entry.update(state="aborted", code="deposed", reason="the coordinator changed during the checkpoint", ended=self.clock())
            return [Finish(self._result())]  # (the new coordinator aborts it on the nodes; this one may not record)
        if isinstance(event, Protected):
            if self.phase is not Phase.COMPLETE:
                return []
            self._to(Phase.PROTECTED, "protected")
            self.entry["state"] = "protected"
            return [Record(dict(self.entry))]
        if isinstance(event, RedundancyFailed):
            if self.phase is not Phase.COMPLETE:
                return []
            self.entry["redundancy"] = f"failed: {event.message}"
            return [Record(dict(self.entry))]
        return []

    def _to(self, phase: Phase, kind: str) -> None:
        allowed = TRANSITIONS.get((self.phase, kind), ())
        if phase not in allowed:
            raise AssertionError(f"no transition {self.phase.value} --{kind}--> {phase.value}")
        self.phase = phase
        self.answers = {}

    def _call(self) -> CallNodes:
        base: dict = {"gen": self.gen}
        if self.phase in (Phase.BEGIN, Phase.COMMIT):
            base["lineage"] = self.lineage
        if self.phase is Phase.BEGIN and self.force_full:
            base["force_full"] = True
        if self.phase is Phase.BEGIN and self.at is not None:
            base["at"] = self.at
        if self.phase is Phase.CUT:
            base["iteration"] = self.cut
        if self.phase is Phase.CAPTURE:
            base["expect"] = self.expected
        return CallNodes(self.phase, OPS[self.phase], base)

    def _answered(self, event: Answered) -> list[Instruction]:
        if event.phase is not self.phase or self.over or event.node not in self.nodes or event.node in self.answers:
            return []
        if self.phase is Phase.BEGIN:
            try:
                self.answers[event.node] = BeginAnswer.from_wire(event.result)
            except BadMessage as exc:
                return self._fail("bad_answer", f"{event.node} answered the begin with {exc}")
        elif self.phase is Phase.COMMIT:
            try:
                answer = CommitAnswer.from_wire(event.result)
            except BadMessage as exc:
                return self._fail("bad_answer", f"{event.node} answered the commit with {exc}")
            if any(g >= self.gen for g in answer.needs):  # (a need of itself or of a later one pins what is not taken yet)
                return self._fail("bad_answer", f"{event.node} answered the commit of generation {self.gen} with needs "
                                                f"{list(answer.needs)[:8]}, not all older generations")
            self.answers[event.node] = event.result
        else:
            self.answers[event.node] = event.result
        if set(self.answers) != set(self.nodes):
            return []
        return self._advance()

    def _advance(self) -> list[Instruction]:
        now = self.clock()
        if self.phase is Phase.BEGIN:
            reported = [a.iteration for a in self.answers.values() if a.iteration is not None]
            if not reported:
                return self._fail("checkpoint_failed", "no rank reported a boundary it can stop at")
            self.cut = max(reported)
            self.entry["iteration"] = self.cut
            self.marks["agreed"] = now
            self._to(Phase.CUT, "answered")
            return [self._call()]
        if self.phase is Phase.CUT:
            self.expected = self.expect(dict(self.answers), self.nranks)
            self.marks["cut"] = now
            self._to(Phase.CAPTURE, "answered")
            return [self._call()]
        if self.phase is Phase.CAPTURE:
            self.marks["saved"] = now
            self._to(Phase.RESUME, "answered")
            return [self._call()]
        if self.phase is Phase.RESUME:
            self.marks["resumed"] = now
            self._to(Phase.COMMIT, "answered")
            return [self._call()]
        # COMMIT: every node committed
        self.marks["committed"] = now
        committed = self.answers
        self._to(Phase.COMPLETE, "answered")
        answers = {node: CommitAnswer.from_wire(r) for node, r in committed.items()}
        self.entry.update(state="complete", nodes={node: node_stats(r, answers[node]) for node, r in sorted(committed.items())}, ended=now,
                          marks=dict(self.marks))
        self.entry.update(delta_fields(list(answers.values())))  # (issue 17)
        out: list[Instruction] = [Record(dict(self.entry)), Prune(self.gen), Finish(self._result())]
        if self.redundancy != "local":
            out.append(WriteRedundancy(self.gen, self.redundancy))
        return out

    def _fail(self, code: str, message: str) -> list[Instruction]:
        if self.over:
            return []
        refused = code == "not_ready" and self.phase is Phase.BEGIN
        self._to(Phase.REFUSED if refused else Phase.ABORTED, "failed")
        self.entry.update(state=self.phase.value, code=code, reason=message, ended=self.clock(), marks=dict(self.marks))
        if refused:
            return [AbortNodes(self.gen, message), Finish(self._result())]
        return [AbortNodes(self.gen, message), Record(dict(self.entry)), Finish(self._result())]

    def _node_lost(self, node: str) -> list[Instruction]:
        if node not in self.nodes:
            return []
        if self.phase is Phase.COMPLETE:
            return self.handle(RedundancyFailed(self.gen, f"node {node} was lost before the generation was protected"))
        if self.over:
            return []
        message = f"node {node} was lost during checkpoint {self.gen}"
        self._to(Phase.ABORTED, "node_lost")
        self.entry.update(state="aborted", code="node_lost", reason=message, ended=self.clock(), marks=dict(self.marks))
        return [AbortNodes(self.gen, message), Record(dict(self.entry)), Finish(self._result())]

    def _result(self) -> dict:
        return {"job": self.job, **self.entry}
