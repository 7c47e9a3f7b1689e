"""Job messaging (:mod:`gangd.comm`) and MPI's key exchange: the ranks'
rendezvous, ``gang net``, and the gates and counters a capture needs."""

from __future__ import annotations

from ..access import integer, job_for
from ..jobnet import expected_deliveries
from .registry import CLIENT, PEER, Call, op


@op("comm_attach", audience=CLIENT)
async def comm_attach(s, call: Call):
    return await s.jobnet.attach(call.user, call.channel.context.get("pid"), call.args, call.channel)


@op("net", audience=CLIENT)
async def net(s, call: Call):
    """Per channel (sender -> receiver): messages sent, received, delivered, in flight."""
    record = await job_for(s.table, call.args, call.user, "inspect")
    counters = await s.calls.on_job_nodes(record, "net_counters", job=record["id"])
    n = record["nranks"]
    rows = {}
    for per_node in counters.values():
        for rank, (sent, received, delivered) in per_node.items():
            rows[int(rank)] = (sent, received, delivered)
    channels = []
    for src in range(n):
        for dst in range(n):
            if src not in rows or dst not in rows:
                continue
            sent, received, delivered = rows[src][0][dst], rows[dst][1][src], rows[dst][2][src]
            if sent or received:
                channels.append({"src": src, "dst": dst, "sent": sent, "received": received, "delivered": delivered, "in_flight": sent - delivered})
    return {"job": record["id"], "attached": sorted(rows), "channels": channels}


@op("net_capture", audience=CLIENT)
async def net_capture(s, call: Call):
    """Close the job's gates everywhere, capture its network context, open them again.
    Returns {rank: context bytes}: what a checkpoint writes to disk."""
    record = await job_for(s.table, call.args, call.user, "capture the network of")
    job_id = record["id"]
    on_job_nodes = s.calls.on_job_nodes
    # Closed everywhere first, then confirmed everywhere: a rank behind a
    # closed gate keeps draining its connections, so a send under way to
    # it completes — but only once its own node has closed too.
    await on_job_nodes(record, "net_gate", job=job_id, open=False, wait=False)
    try:
        await on_job_nodes(record, "net_wait_closed", job=job_id)
        counters = await on_job_nodes(record, "net_counters", job=job_id)
        expect = expected_deliveries(counters, record["nranks"])
        contexts = await on_job_nodes(record, "net_capture_local", job=job_id, expect=expect)
    finally:
        if call.args.get("reopen", True):
            await on_job_nodes(record, "net_gate", job=job_id, open=True, wait=False)
    return {rank: blob for per_node in contexts.values() for rank, blob in per_node.items()}


@op("comm_gather", audience=PEER)
async def comm_gather(s, call: Call):
    args = call.args
    return await s.jobnet.gather(integer(args, "job"), str(args.get("reporter")), args.get("addrs") or {})


@op("net_gate", audience=PEER)
async def net_gate(s, call: Call):
    args = call.args
    job_id = integer(args, "job")
    epoch = await s.jobnet.set_gate(job_id, bool(args.get("open")))
    if not args.get("open") and args.get("wait"):
        await s.jobnet.wait_gate_closed(job_id)
    return epoch


@op("net_wait_closed", audience=PEER)
async def net_wait_closed(s, call: Call):
    await s.jobnet.wait_gate_closed(integer(call.args, "job"))
    return True


@op("net_counters", audience=PEER)
async def net_counters(s, call: Call):
    return s.jobnet.counters(integer(call.args, "job"))


@op("net_capture_local", audience=PEER)
async def net_capture_local(s, call: Call):
    return await s.jobnet.capture(integer(call.args, "job"), call.args.get("expect") or {})


@op("net_restore", audience=PEER)
async def net_restore(s, call: Call):
    s.jobnet.set_context(integer(call.args, "job"), call.args.get("contexts") or {})
    return True


@op("pmi_fence", audience=PEER)
async def pmi_fence(s, call: Call):
    args = call.args
    return await s.pmi.fence(integer(args, "job"), integer(args, "number"), str(args.get("reporter")), args.get("puts") or {})
