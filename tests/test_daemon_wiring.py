"""The daemon's parts built without a daemon: the coordinator, the handlers
and the calls between them, each given what it uses, on a real etcd.

This is what the one-way structure buys (handlers -> domain ->
infrastructure, wired in one place): a coordinator that wins a real
election and serves real requests through the same dispatcher a daemon
runs, with no daemon object, no sockets and no ranks. Two nodes are
configured; only n1 runs (n2's jobs wait for it), so nothing launches.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from gangd import jobs
from gangd.daemon.calls import Calls
from gangd.daemon.config import Config, EtcdSettings, NodeSpec
from gangd.daemon.controlplane import ControlPlane
from gangd.daemon.coordinator import Coordinator
from gangd.daemon.handlers import CLIENT, PEER, REGISTRY, Dispatcher, Services
from gangd.daemon.handlers.jobs import Listing
from gangd.daemon.peers import Peers
from gangd.daemon.store import JobTable, Keys
from gangd.etcd.client import Etcd
from gangd.protocol import Request
from gangd.rpc import RemoteError

ROOT = {"uid": 0, "gid": 0, "user": "root"}
ALICE = {"uid": 1000, "gid": 1000, "user": "alice"}
STRANGER = {"uid": 65534, "gid": 65534, "user": "nobody"}

_prefixes = iter(range(1, 1 << 30))



class _Channel:
    """What a handler reads off a connection: its context (who is calling), and whether it closed."""

    def __init__(self, cred: dict | None = None, node: str | None = None):
        self.context = {"peer": False, "cred": cred, "pid": None} if cred is not None else {"peer": True, "node": node}
        self.closed = False


class _NodeParts:
    """This node's answers to a new coordinator's take-over (no ranks run here)."""


    @staticmethod
    def resend_exits() -> int:
        return 0

    @staticmethod
    async def abort_all(args: dict) -> list:
        return []


def _config(tmp: Path, endpoints: list[str]) -> Config:
    return Config(
        node_name="n1",
        nodes=(NodeSpec("n1", "127.0.0.1", 1, cores=2), NodeSpec("n2", "127.0.0.2", 1, cores=2)),
        state_dir=tmp, socket=tmp / "gangd.sock", secret_file=tmp / "secret",
        etcd=EtcdSettings(endpoints=tuple(endpoints), prefix=f"/test-wiring/{next(_prefixes)}", lease_ttl=5),
    )


class Wired:
    """Coordinator, membership, calls and dispatcher of node n1, wired as server.py does, minus the daemon."""

    def __init__(self, etcd: Etcd, config: Config):
        noop = _NodeParts()
        self.table = JobTable(etcd, Keys(config.etcd.prefix))
        self.peers = Peers(config=config, secret=b"x" * 32, heartbeat_info=dict, spawn=lambda *a: None)  # (never run: no links)

        async def serve_term(fence, lease):
            await self.coordinator.serve_term(fence, lease)

        async def nothing(*_args):
            return None

        self.membership = ControlPlane(
            etcd=etcd, keys=self.table.keys, node="n1", node_info=dict, ttl=config.etcd.lease_ttl, grace=60.0, table=self.table,
            serve_term=serve_term, on_session=nothing, on_nodes_changed=lambda: None, on_grace_over=nothing,
        )
        self.calls = Calls(node="n1", peers=self.peers, membership=self.membership, patience=10.0)
        self.coordinator = Coordinator(node="n1", config=config, table=self.table, membership=self.membership, calls=self.calls, peers=self.peers)
        self.dispatcher = Dispatcher(
            Services(
                node="n1", config=config, table=self.table, membership=self.membership, calls=self.calls,
                coordinator=self.coordinator, listing=Listing(table=self.table, calls=self.calls, membership=self.membership),
                checkpoints=noop, resend_exits=noop.resend_exits,
            ),
            check_term=self.membership.check_term,
        )
        self.calls.local = self.dispatcher.dispatch_peer

    async def client(self, cred: dict, op: str, /, **args):
        return await self.dispatcher.handle(_Channel(cred=cred), Request(1, op, args))

    async def peer(self, node: str, op: str, /, **args):
        return await self.dispatcher.handle(_Channel(node=node), Request(1, op, args))


@pytest.fixture
async def wired(etcd_endpoints, tmp_path):
    config = _config(tmp_path, etcd_endpoints)
    async with Etcd(etcd_endpoints, timeout=10) as etcd, trio.open_nursery() as nursery:
        parts = Wired(etcd, config)
        nursery.start_soon(parts.membership.run)
        with trio.fail_after(30):
            while not parts.coordinator.active:  # noqa: ASYNC110 -- bounded poll: the term begins inside the election
                await trio.sleep(0.05)
        yield parts
        nursery.cancel_scope.cancel()


def _spec(**extra) -> dict:
    # Only n2 may run it, and n2 is not up: it waits in the queue.
    return {"argv": ["sleep", "60"], "nranks": 1, "nodelist": ["n2"], "env": {}, "cwd": "/", **extra}


async def test_a_strangers_kill_is_refused_and_the_owners_kill_ends_the_job(wired):
    job = await wired.coordinator.submit(_spec(), ALICE)
    assert job["state"] == jobs.QUEUED and job["owner_uid"] == ALICE["uid"]

    with pytest.raises(RemoteError) as refused:
        await wired.client(STRANGER, "kill", job=job["id"])
    assert refused.value.code == "permission_denied"
    assert "only its owner or root may kill it" in refused.value.message
    assert wired.table.get(job["id"])["state"] == jobs.QUEUED  # untouched

    with pytest.raises(RemoteError) as nosy:
        await wired.client(STRANGER, "output", job=job["id"])
    assert nosy.value.code == "permission_denied"

    ended = await wired.client(ALICE, "kill", job=job["id"])
    assert ended["state"] == jobs.KILLED
    assert ended["reason"] == "killed by alice"


async def test_unknown_and_daemon_only_operations_are_refused_from_a_client(wired):
    with pytest.raises(RemoteError) as unknown:
        await wired.client(ROOT, "frobnicate")
    assert (unknown.value.code, unknown.value.message) == ("unknown_op", "unknown operation 'frobnicate'")

    # A peer operation from a local user, even root: refused before it runs (nothing is launched).
    record = jobs.new_record(job_id=1, spec={"argv": ["x"], "nranks": 1}, owner_uid=0, owner_name="root", owner_gid=0)
    for op, args in (("launch", {"record": record}), ("coord_submit", {"spec": _spec(), "cred": ROOT}), ("kill_ranks", {"job": 1})):
        with pytest.raises(RemoteError) as denied:
            await wired.client(ROOT, op, **args)
        assert (denied.value.code, denied.value.message) == ("permission_denied", f"{op!r} is a daemon-to-daemon operation")
    assert not wired.table.records  # no job was created

    # And a client operation is no peer's to call.
    with pytest.raises(RemoteError) as peer_unknown:
        await wired.peer("n2", "submit", spec=_spec())
    assert (peer_unknown.value.code, peer_unknown.value.message) == ("unknown_op", "unknown peer operation 'submit'")


async def test_a_coordinator_command_with_a_stale_term_is_refused(wired):
    term = wired.coordinator.term
    assert term > 0
    for stale in (None, 0, term - 1):
        with pytest.raises(RemoteError) as refused:
            await wired.peer("n2", "resend_exits", term=stale)
        assert refused.value.code == "stale_term"
    assert await wired.peer("n2", "resend_exits", term=term) == 0  # the current term passes the fence
    with pytest.raises(RemoteError) as older:
        await wired.peer("n2", "resend_exits", term=term - 1)
    assert "is over" in older.value.message


async def test_a_submit_through_the_client_handler_reaches_the_coordinator_and_lists(wired):
    job = await wired.client(ALICE, "submit", spec=_spec())
    assert job["owner"] == "alice" and job["state"] == jobs.QUEUED
    listed = await wired.client(ALICE, "jobs")
    assert [s["id"] for s in listed] == [job["id"]]
    assert (await wired.client(ROOT, "info"))["coordinator"] == "n1"


def test_the_wire_keeps_every_operation_name_and_audience():
    """The client and the other daemons speak these names: none may go missing or change sides."""
    client = {
        "info", "submit", "kill", "jobs", "history", "job", "nodes", "wait", "output", "suspend", "resume", "schedule",
        "comm_attach", "net", "net_capture", "checkpoint", "restart", "ckpt_list", "ckpt_attach", "ckpt_start", "ckpt_end",
        "ckpt_refused",  # (a rank's ckpt.init() refused its settings: said with its exit)
        "ckpt_interval",  # (gang ckpt plan: issue 19)
    }
    fenced = {
        "launch", "kill_ranks", "switch", "resend_exits", "ckpt_begin", "ckpt_cut", "ckpt_capture", "ckpt_resume",
        "ckpt_commit", "ckpt_abort", "ckpt_prune", "ckpt_verify", "ckpt_open", "ckpt_abort_all", "ckpt_protect",
        "ckpt_stage",  # (restart anywhere: a node pulls the files of the ranks it will run)
        "ckpt_rebuild",  # (a lost node's files rebuilt from its partner's copy or its XOR set)
        "ckpt_flush", "ckpt_unflush", "ckpt_flush_remove",  # (the flush directory: copies there, restores, retention)
        "ckpt_set_plan",  # (--ckpt-every auto: the coordinator's plan, told to a job's ranks)
    }
    peer = fenced | {
        "ping", "ranks_exited", "coord_submit", "coord_kill", "output_local", "coord_suspend", "coord_schedule",
        "job_usage", "comm_gather", "net_gate", "net_wait_closed", "net_counters", "net_capture_local", "net_restore",
        "pmi_fence", "coord_names", "coord_spawn", "coord_fail", "ckpt_job_env", "coord_checkpoint", "coord_checkpoint_all", "coord_restart",
        "coord_ckpt_restored", "ckpt_file_read", "ckpt_data_read", "ckpt_bulk_read",  # (peer-only: the files hold network contexts)
        "ckpt_holds",  # (whether a node still holds a generation's files: its disk may have been wiped)
        "ckpt_pace", "coord_ckpt_interval",  # (--ckpt-every auto: where a job's ranks are; its plan, from the coordinator)
    }
    assert REGISTRY.names(CLIENT) == client
    assert REGISTRY.names(PEER) == peer
    assert REGISTRY.fenced() == fenced


async def test_a_call_on_many_nodes_fails_with_one_error_naming_the_node_that_failed(wired):
    """What `gang net` and a checkpoint round show when a node of the job is away: one error, naming it."""
    term = wired.coordinator.term
    with pytest.raises(RemoteError) as failed:
        await wired.calls.on_nodes(["n1", "n2"], "resend_exits", term=term)
    assert failed.value.code == "node_down"
    assert "n2" in failed.value.message and "n1" not in failed.value.message.replace("n2", "")
    assert await wired.calls.on_nodes(["n1"], "resend_exits", term=term) == {"n1": 0}


def test_a_daemon_starts_without_importing_numpy_or_the_checkpoint_codecs():
    """Every node starts a daemon, every test cluster several: what the
    server module imports is paid at each start (numpy alone was 0.1-0.15 s
    of it). The XOR parity and the rank counters load numpy only when used."""
    import subprocess
    import sys

    code = "import sys, gangd.daemon.server; print(sorted(m for m in ('numpy', 'blosc2', 'lz4') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out
