"""gangd as MPICH's process manager: the node daemons serve PMI-1 to MPI ranks.

Each rank of an ``--mpi`` job starts with one end of a socket pair as
``PMI_FD`` (plus ``PMI_RANK``/``PMI_SIZE``), as Hydra or Slurm would give it;
its node daemon serves the other end. The key-value space spans the job:

* ``put`` lands in this node's pending puts;
* ``barrier_in`` from every local rank sends this node's puts to the job's
  leader (the node of rank 0), which answers once every node of the job
  came in — with everything anyone put. Then each local rank gets
  ``barrier_out`` and its ``get``s see the whole job's keys;
* ``abort`` fails the whole job with the rank's message;
* ``publish_name`` / ``lookup_name`` / ``unpublish_name`` go to the
  coordinator's name service (:mod:`.names`: cluster-wide, per user);
* ``spawn`` (``MPI_Comm_spawn`` / ``_multiple``) becomes a child job
  (:mod:`.spawns`): its commands are checked here (bounds, and that the
  job's owner could exec them), then the coordinator submits, places and
  launches it; the rank's ``spawn_result`` comes once it runs, or with
  the reason it cannot. A spawned job's ranks get ``PMI_SPAWNED=1``, the
  spawn's ``preput`` keys in their key-value space from the start, and
  their segment's appnum;
* everything else PMI-1 has gets the error reply MPICH waits for, which
  the program sees as an MPI error.

MPI's own traffic never passes through gangd: the ranks connect to each
other with the business cards they exchanged here.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
import socket
from dataclasses import dataclass, field

import trio

from .. import jobs
from ..protocol import pmi
from ..rpc import RemoteError
from . import spawns
from .gather import Gathers

log = logging.getLogger("gangd.pmi")

READ_SIZE = 65536
ABORT_GRACE = 2.0  # seconds an aborting rank has to exit with its code
#: A spawn's answer from the coordinator comes within its own timeout (spawns.SPAWN_TIMEOUT); this is the rank's bound.
SPAWN_WAIT = spawns.SPAWN_TIMEOUT + 15.0


@dataclass
class PmiJob:
    job_id: int
    kvsname: str
    ranks: list[int]  # this node's ranks
    kvs: dict[str, str] = field(default_factory=dict)  # what every rank may get
    puts: dict[str, str] = field(default_factory=dict)  # this node's, not yet through a barrier
    entered: dict[int, set[int]] = field(default_factory=dict)  # barrier number -> local ranks in it
    done: dict[int, trio.Event] = field(default_factory=dict)  # barrier number -> out
    nranks: int = 1
    kvs_bytes: int = 0  # keys and values in kvs

    def put(self, command: pmi.Put) -> None:
        """Store a rank's put, within the job's budget (:func:`gangd.protocol.pmi.kvs_budget`)."""
        max_bytes, max_keys = pmi.kvs_budget(self.nranks)
        old = self.kvs.get(command.key)
        used = self.kvs_bytes - (len(command.key) + len(old) if old is not None else 0)
        keys = len(self.kvs) - (old is not None)
        if keys + 1 > max_keys:
            raise pmi.Refused("put_result", f"the job's key-value space is full ({max_keys} keys)")
        if used + command.size > max_bytes:
            raise pmi.Refused("put_result", f"the job's key-value space is full ({max_bytes} bytes)")
        self.puts[command.key] = command.value
        self.kvs[command.key] = command.value  # this node's own ranks see it at once
        self.kvs_bytes = used + command.size

    def merge(self, everything: dict[str, str]) -> None:
        """What a barrier brought: every node's puts (each checked where it was put)."""
        self.kvs.update(everything)
        self.kvs_bytes = sum(len(k) + len(v) for k, v in self.kvs.items())


class PmiServer:
    def __init__(self, *, node: str, table, calls, spawn, note=None):
        """``calls``: :class:`.calls.Calls` (the barrier's leader, the coordinator); ``spawn``: the daemon's contained tasks;
        ``note(job, rank, text)``: a line in the rank's stderr (a refused spawn's reason: MPICH's error string has none)."""
        self.node = node
        self.note = note
        self.table = table
        self.calls = calls
        self.spawn = spawn
        self.jobs: dict[int, PmiJob] = {}
        self.fences = Gathers()  # leader side: (job, barrier number) -> {node: puts}

    def job(self, record: dict) -> PmiJob:
        # The kvsname must be unique on the host, not just in this cluster:
        # MPICH names its shared-memory segments after it.
        if record["id"] not in self.jobs:
            # (not the token itself: kvsnames show in /dev/shm, and the token keys the job's network)
            tag = hashlib.sha256(b"gangd kvsname " + str(record["token"]).encode()).hexdigest()[:12]
            state = PmiJob(record["id"], f"gangd_{record['id']}_{tag}", jobs.ranks_on(record, self.node), nranks=int(record["nranks"]))
            preput = record.get("pmi_preput")  # (a spawned job's: what its parent put, checked by the coordinator)
            if isinstance(preput, dict):
                state.merge({k: v for k, v in preput.items() if type(k) is str and type(v) is str})
            self.jobs[record["id"]] = state
        return self.jobs[record["id"]]

    def forget(self, job_id: int) -> None:
        self.jobs.pop(job_id, None)
        self.fences.forget(lambda key: isinstance(key, tuple) and key[0] == job_id)  # (keys are (job, barrier number))

    # ------------------------------------------------------------ launch

    def prepare(self, record: dict, rank: int, spawn) -> tuple[dict[str, str], int]:
        """Before rank ``rank`` starts: its socket pair. Returns (env, fd the child inherits)."""
        state = self.job(record)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        ours.setblocking(False)
        spawn(self._serve, state, record, rank, trio.SocketStream(trio.socket.from_stdlib_socket(ours)))
        env = {"PMI_FD": str(theirs.fileno()), "PMI_RANK": str(rank), "PMI_SIZE": str(record["nranks"]), "PMI_JOBID": state.kvsname}
        if record.get("spawned_by") is not None:
            env["PMI_SPAWNED"] = "1"  # (MPICH's PMI_Init: then it gets PARENT_ROOT_PORT_NAME and connects to its parent)
        return env, theirs.detach()

    # ------------------------------------------------------------ one rank's connection

    async def _serve(self, state: PmiJob, record: dict, rank: int, stream: trio.SocketStream) -> None:
        reader = pmi.Reader()
        barriers = 0
        async with stream:
            while True:
                try:
                    data = await stream.receive_some(READ_SIZE)
                except trio.BrokenResourceError:
                    return
                if not data:
                    return
                try:
                    lines = reader.feed(data)
                except pmi.PMIError as exc:
                    log.warning("job %d rank %d: broken PMI connection: %s", state.job_id, rank, exc)
                    return
                for fields in lines:
                    log.debug("job %d rank %d PMI: %s", state.job_id, rank, fields)
                    command: pmi.Command | None = None
                    try:
                        parsed = pmi.command(fields)
                    except pmi.Refused as exc:
                        reply: bytes | None = exc.reply()
                        if exc.reply_cmd == "spawn_result":
                            self._spawn_refused(state.job_id, rank, exc.msg)
                    else:
                        command = parsed
                        if isinstance(parsed, pmi.BarrierIn):
                            barriers += 1
                            reply = await self._barrier(state, record, rank, barriers)
                        elif isinstance(parsed, pmi.Publish | pmi.Lookup | pmi.Unpublish):
                            reply = await self._name(state, rank, parsed)
                        elif isinstance(parsed, pmi.Spawn):
                            reply = await self._spawn(state, record, rank, parsed)
                        else:
                            reply = self._answer(state, record, rank, parsed)
                    if reply:
                        try:
                            await stream.send_all(reply)
                        except (trio.BrokenResourceError, trio.ClosedResourceError):
                            return
                    if isinstance(command, pmi.Finalize):
                        return

    def _answer(self, state: PmiJob, record: dict, rank: int, command: pmi.Command) -> bytes | None:
        match command:
            case pmi.Init(version=version):
                return pmi.line("response_to_init", pmi_version=1, pmi_subversion=1, rc=0 if version == "1" else -1)
            case pmi.Query(what="get_maxes"):
                return pmi.line("maxes", kvsname_max=pmi.KVSNAME_MAX, keylen_max=pmi.KEYLEN_MAX, vallen_max=pmi.VALLEN_MAX, rc=0)
            case pmi.Query(what="get_appnum"):
                return pmi.line("appnum", appnum=jobs.segment_of(record, rank)[1], rc=0)
            case pmi.Query(what="get_my_kvsname"):
                return pmi.line("my_kvsname", kvsname=state.kvsname, rc=0)
            case pmi.Query(what="get_universe_size"):
                return pmi.line("universe_size", size=record["nranks"], rc=0)
            case pmi.Query(what="get_rank"):
                return pmi.line("my_rank", rank=rank, rc=0)
            case pmi.Query(what="get_size"):
                return pmi.line("my_size", size=record["nranks"], rc=0)
            case pmi.Put():
                try:
                    state.put(command)
                except pmi.Refused as exc:
                    log.warning("job %d rank %d: PMI put refused: %s", state.job_id, rank, exc.msg)
                    return exc.reply()
                return pmi.line("put_result", rc=0)
            case pmi.Get(key=key):
                value = state.kvs.get(key)
                if value is None:
                    return pmi.line("get_result", rc=-1, msg="key_not_found")
                return pmi.line("get_result", rc=0, value=value)
            case pmi.Finalize():
                return pmi.line("finalize_ack", rc=0)
            case pmi.Abort(code=code, asked=asked, in_range=in_range):
                if in_range:
                    why = f"rank {rank} on {self.node} called MPI_Abort (exit code {code})"
                else:
                    why = f"rank {rank} on {self.node} called MPI_Abort with exit code {asked}, not 1..255: the job exits with {code}"
                log.info("job %d: %s", state.job_id, why)
                self.spawn(self._fail, state.job_id, why, code)
                return None
            case pmi.Unsupported(cmd=cmd):
                log.info("job %d rank %d: PMI %s is not served by gangd", state.job_id, rank, cmd)
                return command.reply()
        return None

    async def _name(self, state: PmiJob, rank: int, command: pmi.Publish | pmi.Lookup | pmi.Unpublish) -> bytes:
        """The name service's answer, under the response name MPICH waits for.
        The error messages are Hydra's (``key_already_present``, ``service_not_found``)."""
        args = {"service": command.service}
        if isinstance(command, pmi.Publish):
            reply_cmd, args["what"], args["port"] = "publish_result", "publish", command.port
        elif isinstance(command, pmi.Lookup):
            reply_cmd, args["what"] = "lookup_result", "lookup"
        else:
            reply_cmd, args["what"] = "unpublish_result", "unpublish"
        try:
            answer = await self.calls.to_coordinator("coord_names", job=state.job_id, **args)
        except RemoteError as exc:
            msg = {"name_exists": "key_already_present", "name_not_found": "service_not_found"}.get(exc.code, exc.message)
            if exc.code not in ("name_exists", "name_not_found"):
                log.warning("job %d rank %d: PMI %s refused: %s", state.job_id, rank, args["what"], exc)
            return pmi.line(reply_cmd, rc=1, msg=pmi.token(msg))
        if isinstance(command, pmi.Lookup):
            if type(answer) is not str or len(answer.encode()) > pmi.PORT_MAX or not answer or any(c.isspace() for c in answer):
                return pmi.line(reply_cmd, rc=1, msg="service_not_found")
            return pmi.line(reply_cmd, rc=0, port=answer)
        return pmi.line(reply_cmd, rc=0)

    async def _spawn(self, state: PmiJob, record: dict, rank: int, command: pmi.Spawn) -> bytes:
        """MPI_Comm_spawn: the child job's start, or an error reply saying why not (within :data:`SPAWN_WAIT`)."""
        why = await trio.to_thread.run_sync(spawns.check_commands, record, command)
        if why is None:
            segments = [[list(s.argv), s.nprocs, s.wdir] for s in command.segments]
            # The spawn's own token: the call is retried when the coordinator changes, and one
            # whose child job the old coordinator made must get that child, not a second one.
            token = f"spawn-{state.job_id}-{rank}-{secrets.token_hex(8)}"
            with trio.move_on_after(SPAWN_WAIT):
                try:
                    answer = await self.calls.to_coordinator(
                        "coord_spawn", job=state.job_id, rank=rank, segments=segments, preput=dict(command.preput), hosts=list(command.hosts),
                        token=token,
                    )
                except RemoteError as exc:
                    why = exc.message
                else:
                    log.info("job %d rank %d: spawned job %s", state.job_id, rank, answer.get("job") if isinstance(answer, dict) else answer)
                    return pmi.line("spawn_result", rc=0)
            why = why or f"no answer within {SPAWN_WAIT:g} s"
        self._spawn_refused(state.job_id, rank, why)
        return pmi.line("spawn_result", rc=-1, msg=pmi.token(why))

    def _spawn_refused(self, job_id: int, rank: int, why: str) -> None:
        log.info("job %d rank %d: spawn refused: %s", job_id, rank, why)
        if self.note is not None:
            self.note(job_id, rank, f"MPI_Comm_spawn refused: {why}")

    async def _fail(self, job_id: int, why: str, code: int) -> None:
        """The job fails with the aborting rank's message. MPICH exits with the
        abort's code right after telling us: that exit (kill-on-bad-exit)
        takes the other ranks down and gives `gang run` its code; only if
        the rank lingers is the job killed outright."""
        try:
            await self.calls.to_coordinator("coord_fail", job=job_id, reason=why, kill=False, code=code)
            await trio.sleep(ABORT_GRACE)
            record = self.table.get(job_id)
            if record is not None and not jobs.is_terminal(record):
                await self.calls.to_coordinator("coord_fail", job=job_id, reason=why, kill=True)
        except RemoteError as exc:
            log.warning("job %d: could not fail the job after MPI_Abort: %s", job_id, exc)

    # ------------------------------------------------------------ barriers (the key exchange)

    async def _barrier(self, state: PmiJob, record: dict, rank: int, number: int) -> bytes:
        entered = state.entered.setdefault(number, set())
        done = state.done.setdefault(number, trio.Event())
        entered.add(rank)
        if entered >= set(state.ranks):
            puts, state.puts = state.puts, {}
            leader = record["placement"][0]
            try:
                everything = await self.calls.call(leader, "pmi_fence", job=state.job_id, number=number, reporter=self.node, puts=puts)
            except RemoteError as exc:
                log.warning("job %d: PMI barrier %d through %s failed: %s", state.job_id, number, leader, exc)
                return pmi.line("barrier_out", rc=-1, msg="the_job's_barrier_failed")
            state.merge(everything)
            state.entered.pop(number, None)
            done.set()
        await done.wait()
        return pmi.line("barrier_out", rc=0)

    async def fence(self, job_id: int, number: int, node: str, puts: object) -> dict[str, str]:
        """Leader side: wait for every node of the job at barrier ``number``; return all puts."""
        record = self.table.get(job_id)
        if record is None:
            raise RemoteError("no_such_job", f"no job {job_id}")
        if not isinstance(puts, dict) or not all(type(k) is str and type(v) is str for k, v in puts.items()):
            raise RemoteError("bad_request", f"PMI puts for job {job_id} must map text keys to text values")
        table = await self.fences.gather((job_id, number), node, dict(puts), jobs.nodes_of(record))
        merged: dict[str, str] = {}
        for node_puts in table.values():
            if isinstance(node_puts, dict):  # (always: each came through the check above)
                merged.update(node_puts)
        return merged
