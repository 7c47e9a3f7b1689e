"""One node's part of a checkpoint generation, as a pure state machine.

:class:`NodeRound` holds what :class:`gangd.daemon.checkpoint.NodeCheckpoints`
kept as a dataclass of flags: which ranks reported, the cut, which reached
it, whether they are released and resumed, what each wrote, and why the
round failed. Its shell feeds it the coordinator's rounds and the ranks'
messages and waits on its predicates (``all_reported`` …); every rule about
what a message means in which phase is here.

Phases::

    BEGUN --every rank reported--> REPORTED --CutSet--> CUT
    CUT --every rank at the cut--> AT_CUT --Released--> RELEASED
    RELEASED --every rank ended--> SAVED --Resumed--> RESUMED
    RESUMED --every rank's state written--> WRITTEN --Committed--> COMMITTED
    any phase before COMMITTED --a failure--> FAILED

A rank that exits (or drops its connection) before the end sync fails the
round; after it (a snapshot at the program's last step) its write report may
still be on its way: the machine asks the shell to wait a grace period for it
(:class:`AwaitWrite`).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field

from .messages import BadMessage, DeltaOffer, RankReport, WriteReport


class NodePhase(enum.IntEnum):
    BEGUN = 1
    REPORTED = 2
    CUT = 3
    AT_CUT = 4
    RELEASED = 5
    SAVED = 6
    RESUMED = 7
    WRITTEN = 8
    COMMITTED = 9
    FAILED = 10


# ---------------------------------------------------------------- events


@dataclass(frozen=True)
class Reported:
    rank: int
    report: RankReport


@dataclass(frozen=True)
class CutSet:
    iteration: int


@dataclass(frozen=True)
class Arrived:
    """A rank asked for the start sync at ``iteration``."""

    rank: int
    iteration: int | None
    at: float


@dataclass(frozen=True)
class Released:
    """Network context and job record on disk: the ranks may write, each to
    its path, as a delta of what it was offered (none: a full file)."""

    paths: dict
    offers: dict = field(default_factory=dict)  # rank -> DeltaOffer


@dataclass(frozen=True)
class Ended:
    """A rank asked for the end sync (with its write ``result``, or ``None`` if it writes in the background)."""

    rank: int
    result: dict | None


@dataclass(frozen=True)
class Written:
    """A rank's write report (or error) arrived."""

    rank: int
    result: object


@dataclass(frozen=True)
class Resumed:
    pass


@dataclass(frozen=True)
class Committed:
    pass


@dataclass(frozen=True)
class RankGone:
    """A rank exited or closed its checkpoint connection."""

    rank: int
    why: str


@dataclass(frozen=True)
class Fail:
    why: str


NodeEvent = Reported | CutSet | Arrived | Released | Ended | Written | Resumed | Committed | RankGone | Fail


# ---------------------------------------------------------------- instructions


@dataclass(frozen=True)
class AwaitWrite:
    """Wait a grace period for ``rank``'s write report; then :class:`Fail` with ``why`` if it is missing."""

    rank: int
    why: str


@dataclass(frozen=True)
class Changed:
    """Wake whoever waits on a predicate."""


# ---------------------------------------------------------------- the machine


@dataclass
class NodeRound:
    job: int
    gen: int
    lineage: int
    node: str
    ranks: list[int]
    max_rank_bytes: int
    phase: NodePhase = NodePhase.BEGUN
    reports: dict[int, int] = field(default_factory=dict)
    cut: int | None = None
    arrived: dict[int, float] = field(default_factory=dict)
    path: dict[int, str] = field(default_factory=dict)
    offers: dict[int, DeltaOffer] = field(default_factory=dict)  # what each rank may write a delta of
    ended: set[int] = field(default_factory=set)
    written: dict[int, WriteReport] = field(default_factory=dict)
    failed: str | None = None

    # -------------------------------------------------------- predicates

    @property
    def released(self) -> bool:
        return NodePhase.RELEASED <= self.phase < NodePhase.FAILED

    @property
    def resumed(self) -> bool:
        return NodePhase.RESUMED <= self.phase < NodePhase.FAILED

    def all_reported(self) -> bool:
        return set(self.reports) >= set(self.ranks)

    def all_arrived(self) -> bool:
        return set(self.arrived) >= set(self.ranks)

    def all_ended(self) -> bool:
        return self.ended >= set(self.ranks)

    def all_written(self) -> bool:
        return set(self.written) >= set(self.ranks)

    def needs(self) -> dict[int, list[int]]:
        """Each rank whose file is a delta: the generations a restore of it reads, newest first."""
        return {rank: list(report.links) for rank, report in self.written.items() if report.links}

    def cut_answer(self) -> int | None:
        """The largest boundary this node's ranks reported."""
        return max(self.reports.values()) if self.reports else None

    # -------------------------------------------------------- events

    def handle(self, event: NodeEvent) -> list[Changed | AwaitWrite]:
        if self.phase is NodePhase.FAILED or (self.phase is NodePhase.COMMITTED and not isinstance(event, Fail)):
            return []
        if isinstance(event, Fail):
            if self.phase is NodePhase.COMMITTED:
                return []
            return self._fail(event.why)
        if isinstance(event, Reported):
            return self._reported(event.rank, event.report)
        if isinstance(event, CutSet):
            if self.phase > NodePhase.REPORTED and self.cut is not None:
                return []
            self.cut = event.iteration
            self.phase = max(self.phase, NodePhase.CUT)
            return self._settle()
        if isinstance(event, Arrived):
            if event.rank not in self.ranks:
                return []
            if event.iteration != self.cut or self.phase not in (NodePhase.CUT, NodePhase.AT_CUT):
                return self._fail(f"rank {event.rank} stopped at iteration {event.iteration}, not at the cut {self.cut}")
            self.arrived.setdefault(event.rank, event.at)
            return self._settle()
        if isinstance(event, Released):
            if self.phase is not NodePhase.AT_CUT:
                return self._fail(f"released in phase {self.phase.name.lower()}, before every rank reached the cut")
            self.path = dict(event.paths)
            self.offers = dict(event.offers)
            self.phase = NodePhase.RELEASED
            return self._settle()
        if isinstance(event, Ended):
            if event.rank not in self.ranks or not self.released:
                return []
            self.ended.add(event.rank)
            if event.result is not None:
                out = self._written(event.rank, event.result)
                if self.failed:
                    return out
            return self._settle()
        if isinstance(event, Written):
            if event.rank not in self.ranks or not self.released:
                return []
            out = self._written(event.rank, event.result)
            return out if self.failed else self._settle()
        if isinstance(event, Resumed):
            if self.phase is not NodePhase.SAVED:
                return self._fail(f"resumed in phase {self.phase.name.lower()}, before every rank saved")
            self.phase = NodePhase.RESUMED
            return self._settle()
        if isinstance(event, Committed):
            if self.phase is not NodePhase.WRITTEN:
                return self._fail(f"committed in phase {self.phase.name.lower()}, before every rank's state was written")
            self.phase = NodePhase.COMMITTED
            return [Changed()]
        if isinstance(event, RankGone):
            if event.rank not in self.ranks or event.rank in self.written:
                return []
            if self.resumed:
                return [AwaitWrite(event.rank, f"{event.why} before its state was written (checkpoint {self.gen})")]
            return self._fail(f"{event.why} during checkpoint {self.gen}")
        return []

    def _reported(self, rank: int, report: RankReport) -> list[Changed | AwaitWrite]:
        if rank not in self.ranks or report.gen != self.gen:
            return []  # its own request while this runs (the begin note reaches it), or a stale one
        if report.iteration is None:
            return self._fail(f"rank {rank} on {self.node} cannot take part: {report.why or 'no reason given'}")
        if self.cut is not None or self.phase is not NodePhase.BEGUN:
            return []  # too late to move the cut; the rank hears it
        self.reports[rank] = report.iteration
        if self.all_reported():
            self.phase = NodePhase.REPORTED
        return [Changed()]

    def _written(self, rank: int, result: object) -> list[Changed | AwaitWrite]:
        if isinstance(result, dict) and result.get("error"):
            from .. import text

            return self._fail(f"rank {rank} on {self.node} could not write its state: {text.printable(text.brief(result['error'], 1000, quote=False))[:1000]}")
        try:
            report = WriteReport.parse(result, self.max_rank_bytes, self.offers.get(rank), self.gen)
        except BadMessage as exc:
            return self._fail(f"rank {rank} on {self.node} reported {exc}")
        self.written[rank] = report
        return [Changed()]

    def _settle(self) -> list[Changed | AwaitWrite]:
        """Move on while a phase's condition holds."""
        if self.phase is NodePhase.CUT and self.all_arrived():
            self.phase = NodePhase.AT_CUT
        if self.phase is NodePhase.RELEASED and self.all_ended():
            self.phase = NodePhase.SAVED
        if self.phase is NodePhase.RESUMED and self.all_written():
            self.phase = NodePhase.WRITTEN
        return [Changed()]

    def _fail(self, why: str) -> list[Changed | AwaitWrite]:
        if self.failed is None:
            self.failed = why
        self.phase = NodePhase.FAILED
        return [Changed()]


# ---------------------------------------------------------------- reports outside a round


class Outside(enum.Enum):
    """What a rank's report means when no round of its job is under way here."""

    REQUEST = "request"  # the program's own SIGQUIT or ckpt.request(): ask the coordinator for a checkpoint
    ABORT = "abort"  # a generation that is over: tell the rank, so it lets go
    NONE = "none"  # nothing to checkpoint: tell the rank


def outside_round(report: RankReport) -> Outside:
    if report.gen is None and report.iteration is not None:
        return Outside.REQUEST
    if report.gen is not None:
        return Outside.ABORT
    return Outside.NONE


# ---------------------------------------------------------------- the node's rounds of all jobs


MAX_ABORTED = 64  # aborted generations remembered per job (a begin after its abort is refused)


class Refusal(Exception):
    """A round op this node cannot do: ``code`` and a sentence, for a RemoteError."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code, self.message = code, message


@dataclass
class NodeJobs:
    """Every job's round under way on this node, and the generations aborted
    here: a begin that arrives after its abort (the coordinator's calls race)
    must be refused, and an abort of an older generation must not touch the
    one under way."""

    node: str
    max_rank_bytes: int
    rounds: dict[int, NodeRound] = field(default_factory=dict)
    aborted: dict[int, list[int | None]] = field(default_factory=dict)

    def begin(self, job: int, gen: int, lineage: int, ranks: list[int], make: Callable[..., NodeRound] = NodeRound) -> NodeRound:
        if job in self.rounds:
            raise Refusal("busy", f"checkpoint {self.rounds[job].gen} of job {job} is still under way on {self.node}")
        if gen in self.aborted.get(job, ()):
            raise Refusal("checkpoint_failed", f"checkpoint {gen} of job {job} was aborted before it began on {self.node}")
        rnd = make(job, gen, lineage, self.node, list(ranks), self.max_rank_bytes)
        self.rounds[job] = rnd
        return rnd

    def get(self, job: object, gen: object) -> NodeRound:
        rnd = self.rounds.get(job) if type(job) is int else None
        if rnd is None or rnd.gen != gen:
            raise Refusal("no_checkpoint", f"checkpoint {gen} of job {job} is not under way on {self.node}")
        return rnd

    def abort(self, job: int, gen: int | None, why: str) -> tuple[bool, NodeRound | None]:
        """(whether the abort applies, the round it ended). A late abort of an
        older generation does not apply: the one under way goes on."""
        seen = self.aborted.setdefault(job, [])
        if gen not in seen:
            seen.append(gen)
            del seen[:-MAX_ABORTED]
        rnd = self.rounds.get(job)
        if rnd is not None and rnd.gen != gen:
            return False, None
        if rnd is not None:
            del self.rounds[job]
            rnd.handle(Fail(why))
        return True, rnd

    def finished(self, rnd: NodeRound) -> None:
        """The round committed or failed: it is no longer under way."""
        if self.rounds.get(rnd.job) is rnd:
            del self.rounds[rnd.job]

    def forget(self, job: int) -> None:
        self.aborted.pop(job, None)


# ---------------------------------------------------------------- what a rank may diff against (issue 17)


def sound(entry: dict) -> bool:
    """A generation a delta may build on: complete or protected, and no
    redundancy write of it failed or found it damaged (its descendants would
    then be no better protected than it is: §5 of DESIGN17)."""
    return entry.get("state") in ("complete", "protected") and not str(entry.get("redundancy") or "").startswith(("failed", "damaged"))


@dataclass(frozen=True)
class Candidates:
    """What a node may offer the ranks of generation ``gen``: ``parents``, the
    newest sound generations first, and ``linkable``, every sound generation
    (each link of a parent's chain must be one). ``why``: why there is no
    parent at all ("" when there are some)."""

    parents: tuple[int, ...]
    linkable: frozenset[int]
    why: str = ""


def parent_candidates(entries: list[dict], placement: list[str], gen: int, limit: int) -> Candidates:
    """The lineage's recorded generations (``entries``, any order) that ranks
    placed as ``placement`` may diff generation ``gen`` against. A layout
    change forces a full file: candidates stop at the newest generation
    taken with another placement."""
    usable = sorted((e for e in entries if type(e.get("gen")) is int and e["gen"] < gen and sound(e)), key=lambda e: -e["gen"])
    linkable = frozenset(e["gen"] for e in usable)
    parents: list[int] = []
    for entry in usable:
        if list(entry.get("placement") or ()) != list(placement):
            if not parents:
                return Candidates((), linkable, f"the ranks moved since generation {entry['gen']}")
            break
        parents.append(entry["gen"])
        if len(parents) >= limit:
            break
    return Candidates(tuple(parents), linkable, "" if parents else "no complete generation to build on")
