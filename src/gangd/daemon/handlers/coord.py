"""Requests to the coordinator, forwarded by the node a client or a rank came through.

Each runs only on the node that is coordinator right now (``not_coordinator``
elsewhere: the sender retries with whoever leads, see :mod:`..calls`)."""

from __future__ import annotations

from ...protocol import pmi
from ...rpc import RemoteError
from ..access import integer
from .registry import PEER, Call, op


def coordinator(s):
    if not s.coordinator.active:
        raise RemoteError("not_coordinator", f"{s.node} is not the coordinator")
    return s.coordinator


@op("ranks_exited", audience=PEER)
async def ranks_exited(s, call: Call):
    args = call.args
    exits = [(rank, status) for rank, status in args.get("exits") or [] if isinstance(rank, int) and isinstance(status, dict)]
    await coordinator(s).ranks_exited(integer(args, "job"), exits)
    return True


@op("coord_submit", audience=PEER)
async def coord_submit(s, call: Call):
    args = call.args
    token = args.get("token")
    return await coordinator(s).submit(args["spec"], args["cred"], token=token if isinstance(token, str) and len(token) <= 64 else None)


@op("coord_kill", audience=PEER)
async def coord_kill(s, call: Call):
    return await coordinator(s).kill(integer(call.args, "job"), call.args["cred"])


@op("coord_suspend", audience=PEER)
async def coord_suspend(s, call: Call):
    args = call.args
    return await coordinator(s).suspend(integer(args, "job"), args["cred"], bool(args.get("hold")))


@op("coord_schedule", audience=PEER)
async def coord_schedule(s, call: Call):
    co = coordinator(s)
    result = co.schedule()
    if call.args.get("switches"):
        result["switch_log"] = list(co.switches)
    return result


@op("coord_fail", audience=PEER)
async def coord_fail(s, call: Call):
    args = call.args
    co = coordinator(s)
    if args.get("kill", True):
        await co.fail(integer(args, "job"), str(args.get("reason") or "failed"))
    else:
        code = args.get("code")
        await co.set_reason(integer(args, "job"), str(args.get("reason") or "failed"), code if isinstance(code, int) else None)
    return True


@op("coord_names", audience=PEER)
async def coord_names(s, call: Call):
    """MPI's name service for a rank of ``job`` (:mod:`..names`); the lengths were checked by the rank's node."""
    args = call.args
    coordinator(s)
    job_id = integer(args, "job")
    service = args.get("service")
    if type(service) is not str or not service or len(service.encode()) > pmi.SERVICE_MAX:
        raise RemoteError("bad_request", f"a service name is text of 1 to {pmi.SERVICE_MAX} bytes")
    what = args.get("what")
    if what == "publish":
        port = args.get("port")
        if type(port) is not str or len(port.encode()) > pmi.PORT_MAX:
            raise RemoteError("bad_request", f"a port is text of at most {pmi.PORT_MAX} bytes")
        await s.names.publish(job_id, service, port)
        return True
    if what == "lookup":
        return await s.names.lookup(job_id, service)
    if what == "unpublish":
        await s.names.unpublish(job_id, service)
        return True
    raise RemoteError("bad_request", f"no name service operation {str(what)[:40]!r}")


@op("coord_spawn", audience=PEER)
async def coord_spawn(s, call: Call):
    """MPI_Comm_spawn from a rank of ``job`` (:mod:`..spawns`); the command was checked
    (:func:`gangd.protocol.pmi.spawn`) by the rank's node, the shapes are checked again here."""
    args = call.args
    co = coordinator(s)
    job_id, rank = integer(args, "job"), integer(args, "rank")
    segments, preput = args.get("segments"), args.get("preput")
    if not isinstance(segments, list) or not 1 <= len(segments) <= pmi.SPAWN_SEGMENTS_MAX:
        raise RemoteError("bad_request", f"a spawn has 1 to {pmi.SPAWN_SEGMENTS_MAX} commands")
    checked = []
    for segment in segments:
        if not (isinstance(segment, list) and len(segment) == 3):
            raise RemoteError("bad_request", "a spawn's command is [argv, nprocs, wdir]")
        argv, nprocs, wdir = segment
        if not (isinstance(argv, list) and 1 <= len(argv) <= pmi.SPAWN_ARGS_MAX + 1 and all(type(a) is str for a in argv) and argv[0]):
            raise RemoteError("bad_request", "a spawn's argv is a list of text")
        if type(nprocs) is not int or not 1 <= nprocs <= pmi.SPAWN_NPROCS_MAX or type(wdir) is not str:
            raise RemoteError("bad_request", f"a spawn starts 1 to {pmi.SPAWN_NPROCS_MAX} processes")
        checked.append((argv, nprocs, wdir))
    if not isinstance(preput, dict) or len(preput) > pmi.SPAWN_PREPUT_MAX or not all(
        type(k) is str and type(v) is str and len(k) <= pmi.KEYLEN_MAX and len(v) <= pmi.VALLEN_MAX for k, v in preput.items()
    ):
        raise RemoteError("bad_request", "a spawn's preput maps keys to values within PMI's limits")
    hosts = args.get("hosts") or []
    if not isinstance(hosts, list) or len(hosts) > pmi.SPAWN_HOSTS_MAX or not all(
        type(h) is str and 0 < len(h.encode()) <= pmi.SPAWN_HOST_BYTES for h in hosts
    ):
        raise RemoteError("bad_request", f"a spawn's hosts are at most {pmi.SPAWN_HOSTS_MAX} names of at most {pmi.SPAWN_HOST_BYTES} bytes")
    token = args.get("token")
    return await co.spawn_job(job_id, rank, checked, preput, hosts, token if isinstance(token, str) and 0 < len(token) <= 64 else None)
