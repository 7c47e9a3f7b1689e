"""What other daemons ask of this node: heartbeats, and the coordinator's
commands about this node's ranks (launch, kill, switch), their CPU use and output."""

from __future__ import annotations

import time

from ...rpc import RemoteError, Stream
from ..access import integer
from .registry import PEER, Call, op


@op("ping", audience=PEER)
async def ping(s, call: Call):
    # Our clock when the ping came and when the answer leaves, and our
    # bounds on the pinger's clock: it bounds our offset with them (see clock.py).
    came = time.time()
    info = s.heartbeat_info()
    link = s.peers.links.get(call.from_node)
    info["clock"] = [came, time.time(), link.clock.ours if link is not None else None]
    return info


@op("launch", audience=PEER, fenced=True)
async def launch(s, call: Call):
    record = call.args.get("record")
    if not isinstance(record, dict):
        raise RemoteError("bad_request", "launch needs a job record")
    return await s.node_jobs.launch(record, call.args.get("contexts"))


@op("kill_ranks", audience=PEER, fenced=True)
async def kill_ranks(s, call: Call):
    await s.node_jobs.kill(integer(call.args, "job"))
    return True


@op("resend_exits", audience=PEER, fenced=True)
async def resend_exits(s, call: Call):
    return s.resend_exits()


def _job_ids(value) -> list[int]:
    return [j for j in value or [] if isinstance(j, int) and not isinstance(j, bool)]


@op("switch", audience=PEER, fenced=True)
async def switch(s, call: Call):
    args = call.args
    at = args.get("at")
    when = float(at) if isinstance(at, (int, float)) and not isinstance(at, bool) else None
    return await s.node_jobs.switch(_job_ids(args.get("stop")), _job_ids(args.get("cont")), when)


@op("job_usage", audience=PEER)
async def job_usage(s, call: Call):
    return s.node_jobs.usage(_job_ids(call.args.get("jobs")))


@op("output_local", audience=PEER)
async def output_local(s, call: Call):
    args = call.args
    job_id = integer(args, "job")
    ranks = [r for r in args.get("ranks") or [] if isinstance(r, int)]
    follow = bool(args.get("follow", True))
    return Stream(lambda emit: s.node_jobs.local_output(job_id, ranks, follow, emit))
