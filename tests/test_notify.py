"""The sd_notify protocol against real datagram sockets, and the unit file it serves."""

from __future__ import annotations

import configparser
import fcntl
import logging
import os
import socket
import threading
import uuid
from pathlib import Path, PurePosixPath

import pytest
import trio

from gangd.daemon import config as daemon_config
from gangd.daemon.notify import SystemdNotifier, scrub_environ, watchdog_loop

UNIT_FILE = Path(__file__).resolve().parents[1] / "systemd" / "gangd.service"


class Receiver:
    """What systemd would be: a datagram socket bound at NOTIFY_SOCKET."""

    def __init__(self, notify_socket: str, sockaddr: str) -> None:
        self.notify_socket = notify_socket  # as it appears in the environment
        self.sockaddr = sockaddr
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(sockaddr)
        self.sock.settimeout(5)

    def recv(self) -> bytes:
        return self.sock.recv(65536)

    def recv_fields(self) -> dict[str, str]:
        return parse(self.recv())

    def pending(self) -> list[bytes]:
        """Every datagram already queued, without waiting for more."""
        out = []
        self.sock.setblocking(False)
        try:
            while True:
                out.append(self.sock.recv(65536))
        except BlockingIOError:
            return out
        finally:
            self.sock.settimeout(5)

    def environ(self, **extra: str) -> dict[str, str]:
        return {"NOTIFY_SOCKET": self.notify_socket, **extra}

    def close(self) -> None:
        self.sock.close()


def parse(datagram: bytes) -> dict[str, str]:
    text = datagram.decode()
    assert text.endswith("\n")
    fields = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        assert sep, line
        assert key not in fields, f"duplicate {key} in {text!r}"
        fields[key] = value
    return fields


@pytest.fixture(params=["path", "abstract"])
def receiver(request, tmp_path):
    if request.param == "path":
        path = str(tmp_path / "notify.sock")
        r = Receiver(path, path)
    else:
        name = f"gangd-test-{os.getpid()}-{uuid.uuid4().hex}"
        r = Receiver("@" + name, "\0" + name)
    yield r
    r.close()


@pytest.fixture
def path_receiver(tmp_path):
    path = str(tmp_path / "notify.sock")
    r = Receiver(path, path)
    yield r
    r.close()


@pytest.fixture
def notifier(receiver):
    n = SystemdNotifier.from_environ(receiver.environ())
    assert n is not None
    yield n
    n.close()


# -- from_environ -------------------------------------------------------------


@pytest.mark.parametrize("environ", [{}, {"NOTIFY_SOCKET": ""}, {"WATCHDOG_USEC": "1000000"}])
def test_from_environ_none_without_notify_socket(environ):
    assert SystemdNotifier.from_environ(environ) is None


def test_from_environ_none_for_relative_address(caplog):
    with caplog.at_level(logging.WARNING, logger="gangd.notify"):
        assert SystemdNotifier.from_environ({"NOTIFY_SOCKET": "notify.sock"}) is None
    assert "NOTIFY_SOCKET" in caplog.text


def test_from_environ_reads_os_environ_by_default(path_receiver, monkeypatch):
    monkeypatch.setenv("NOTIFY_SOCKET", path_receiver.notify_socket)
    with SystemdNotifier.from_environ() as n:
        assert n.pid == os.getpid()
        n.status("hello")
    assert path_receiver.recv_fields() == {"STATUS": "hello"}


def test_socket_is_close_on_exec(notifier):
    flags = fcntl.fcntl(notifier._sock.fileno(), fcntl.F_GETFD)
    assert flags & fcntl.FD_CLOEXEC


# -- messages -----------------------------------------------------------------


def test_ready(receiver, notifier):
    notifier.ready("serving 4 nodes")
    assert receiver.recv_fields() == {
        "READY": "1",
        "STATUS": "serving 4 nodes",
        "MAINPID": str(os.getpid()),
    }
    assert receiver.pending() == []  # one datagram, not one per field


def test_ready_without_status(receiver, notifier):
    notifier.ready()
    assert receiver.recv_fields() == {"READY": "1", "MAINPID": str(os.getpid())}


def test_ready_reports_given_pid(receiver):
    with SystemdNotifier.from_environ(receiver.environ(), pid=4242) as n:
        n.ready()
    assert receiver.recv_fields()["MAINPID"] == "4242"


def test_stopping(receiver, notifier):
    notifier.stopping("stopping 3 ranks")
    assert receiver.recv_fields() == {"STOPPING": "1", "STATUS": "stopping 3 ranks"}
    notifier.stopping()
    assert receiver.recv_fields() == {"STOPPING": "1"}


def test_status(receiver, notifier):
    notifier.status("2 jobs running")
    assert receiver.recv() == b"STATUS=2 jobs running\n"


def test_watchdog(receiver, notifier):
    notifier.watchdog()
    assert receiver.recv() == b"WATCHDOG=1\n"


def test_notify_arbitrary_fields_in_one_datagram(receiver, notifier):
    notifier.notify(READY=True, STATUS="up", EXTEND_TIMEOUT_USEC=5_000_000)
    assert receiver.recv() == b"READY=1\nSTATUS=up\nEXTEND_TIMEOUT_USEC=5000000\n"


def test_notify_without_fields_sends_nothing(receiver, notifier):
    notifier.notify()
    notifier.watchdog()
    assert receiver.pending() == [b"WATCHDOG=1\n"]


def test_newlines_cannot_forge_fields(receiver, notifier):
    notifier.status("job foo\nREADY=1\r\nSTOPPING=1\rx\0y")
    datagram = receiver.recv()
    assert datagram.count(b"\n") == 1
    assert b"\r" not in datagram and b"\0" not in datagram
    assert parse(datagram) == {"STATUS": "job foo READY=1 STOPPING=1 x y"}


def test_non_ascii_status(receiver, notifier):
    notifier.status("job «ünïcode»")
    assert receiver.recv_fields() == {"STATUS": "job «ünïcode»"}


# -- watchdog -----------------------------------------------------------------


def test_watchdog_interval_is_half_of_watchdog_usec(receiver):
    with SystemdNotifier.from_environ(receiver.environ(WATCHDOG_USEC="30000000")) as n:
        assert n.watchdog_interval == pytest.approx(15.0)
    with SystemdNotifier.from_environ(receiver.environ(WATCHDOG_USEC="100000")) as n:
        assert n.watchdog_interval == pytest.approx(0.05)


def test_watchdog_interval_for_our_pid(receiver):
    environ = receiver.environ(WATCHDOG_USEC="100000", WATCHDOG_PID=str(os.getpid()))
    with SystemdNotifier.from_environ(environ) as n:
        assert n.watchdog_interval == pytest.approx(0.05)
    environ = receiver.environ(WATCHDOG_USEC="100000", WATCHDOG_PID="4242")
    with SystemdNotifier.from_environ(environ, pid=4242) as n:
        assert n.watchdog_interval == pytest.approx(0.05)


def test_watchdog_interval_ignored_for_another_pid(receiver):
    environ = receiver.environ(WATCHDOG_USEC="100000", WATCHDOG_PID=str(os.getpid() + 1))
    with SystemdNotifier.from_environ(environ) as n:
        assert n.watchdog_interval is None


@pytest.mark.parametrize(
    "extra",
    [{}, {"WATCHDOG_USEC": ""}, {"WATCHDOG_USEC": "0"}, {"WATCHDOG_USEC": "soon"},
     {"WATCHDOG_USEC": "100000", "WATCHDOG_PID": "me"}],
)
def test_no_watchdog_interval(receiver, extra):
    with SystemdNotifier.from_environ(receiver.environ(**extra)) as n:
        assert n.watchdog_interval is None


async def test_watchdog_loop_pings_repeatedly(receiver):
    n = SystemdNotifier.from_environ(receiver.environ(WATCHDOG_USEC="100000"))  # ping every 50ms
    received: list[bytes] = []
    tsock = trio.socket.from_stdlib_socket(receiver.sock)
    receiver.sock.setblocking(False)

    async def collect():
        while True:
            received.append(await tsock.recv(65536))

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(collect)
            with trio.move_on_after(0.3):
                await watchdog_loop(n)
            await trio.sleep(0.02)  # let the last datagram be collected
            nursery.cancel_scope.cancel()
    finally:
        n.close()
    assert len(received) >= 4
    assert set(received) == {b"WATCHDOG=1\n"}


async def test_watchdog_loop_runs_until_cancelled(receiver):
    with SystemdNotifier.from_environ(receiver.environ(WATCHDOG_USEC="100000")) as n:
        with trio.move_on_after(0.12) as scope:
            await watchdog_loop(n)
    assert scope.cancelled_caught  # it never returns of its own accord


async def test_watchdog_loop_returns_without_watchdog(receiver):
    for extra in ({}, {"WATCHDOG_USEC": "100000", "WATCHDOG_PID": str(os.getpid() + 1)}):
        with SystemdNotifier.from_environ(receiver.environ(**extra)) as n:
            with trio.fail_after(1):
                await watchdog_loop(n)
    assert receiver.pending() == []


# -- failure never reaches the daemon -----------------------------------------


def test_vanished_socket_does_not_raise(path_receiver, caplog):
    n = SystemdNotifier.from_environ(path_receiver.environ())
    path_receiver.close()
    os.unlink(path_receiver.sockaddr)
    with caplog.at_level(logging.DEBUG, logger="gangd.notify"):
        n.ready("up")
        n.watchdog()
        n.watchdog()
    warnings = [r for r in caplog.records if r.name == "gangd.notify" and r.levelno == logging.WARNING]
    # warned once, not once per watchdog ping
    assert len(warnings) == 1
    assert path_receiver.sockaddr in warnings[0].getMessage()

    # systemd back (e.g. after daemon-reexec): notifications flow again
    back = Receiver(path_receiver.notify_socket, path_receiver.sockaddr)
    try:
        n.status("again")
        assert back.recv_fields() == {"STATUS": "again"}
    finally:
        back.close()
        n.close()


def test_socket_replaced_by_non_socket_does_not_raise(path_receiver):
    with SystemdNotifier.from_environ(path_receiver.environ()) as n:
        path_receiver.close()
        os.unlink(path_receiver.sockaddr)
        Path(path_receiver.sockaddr).write_text("not a socket")
        n.ready()


def test_absent_abstract_socket_does_not_raise():
    environ = {"NOTIFY_SOCKET": f"@gangd-test-absent-{uuid.uuid4().hex}"}
    with SystemdNotifier.from_environ(environ) as n:
        n.ready("up")
        n.stopping()


def test_full_receiver_does_not_block(path_receiver, caplog):
    # Nobody reads: the receive queue fills and sending must drop, not wait.
    n = SystemdNotifier.from_environ(path_receiver.environ())
    done = threading.Event()

    def flood():
        for _ in range(5000):
            n.status("x" * 512)
        done.set()

    with caplog.at_level(logging.WARNING, logger="gangd.notify"):
        thread = threading.Thread(target=flood, daemon=True)
        thread.start()
        thread.join(10)
    n.close()
    assert done.is_set(), "notify() blocked on a full socket"
    assert len([r for r in caplog.records if r.name == "gangd.notify"]) == 1


def test_closed_notifier_drops_silently(receiver, notifier):
    notifier.close()
    notifier.close()
    notifier.ready()
    assert receiver.pending() == []


# -- child environments -------------------------------------------------------


def test_scrub_environ():
    env = {
        "PATH": "/usr/bin",
        "HOME": "/root",
        "NOTIFY_SOCKET": "/run/systemd/notify",
        "WATCHDOG_USEC": "30000000",
        "WATCHDOG_PID": "1234",
    }
    before = dict(env)
    scrubbed = scrub_environ(env)
    assert scrubbed == {"PATH": "/usr/bin", "HOME": "/root"}
    assert env == before  # a copy; the daemon's own environment is untouched
    assert scrubbed is not env


def test_scrub_environ_of_os_environ(monkeypatch):
    monkeypatch.setenv("NOTIFY_SOCKET", "@x")
    monkeypatch.setenv("WATCHDOG_USEC", "1")
    scrubbed = scrub_environ(os.environ)
    assert isinstance(scrubbed, dict)
    assert "NOTIFY_SOCKET" not in scrubbed and "WATCHDOG_USEC" not in scrubbed
    assert scrubbed["PATH"] == os.environ["PATH"]
    assert os.environ["NOTIFY_SOCKET"] == "@x"


# -- the unit file stays in step with the daemon ------------------------------


def load_unit() -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # systemd keys are case-sensitive
    parser.read_string(UNIT_FILE.read_text())
    return parser


def parse_timespan(value: str) -> float:
    units = {"us": 1e-6, "ms": 1e-3, "s": 1, "sec": 1, "min": 60, "m": 60, "h": 3600}
    for suffix in sorted(units, key=len, reverse=True):
        if value.endswith(suffix):
            return float(value[: -len(suffix)]) * units[suffix]
    return float(value)


def test_unit_file_matches_notify_implementation():
    unit = load_unit()
    service = unit["Service"]
    assert service["Type"] == "notify"
    assert service["NotifyAccess"] == "main"
    assert service["KillMode"] == "mixed"
    assert service["Delegate"] == "yes"
    assert service["Restart"] == "on-failure"
    assert service["ExecStart"].split()[:3] == ["/usr/local/bin/gangd", "--config", "/etc/gangd/gangd.toml"]
    watchdog = parse_timespan(service["WatchdogSec"])
    assert watchdog > 0
    # What the daemon will do with the WATCHDOG_USEC systemd derives from it
    environ = {"NOTIFY_SOCKET": "@unused", "WATCHDOG_USEC": str(int(watchdog * 1_000_000))}
    with SystemdNotifier.from_environ(environ) as n:
        assert n.watchdog_interval == pytest.approx(watchdog / 2)
    # The daemon must get its SIGTERM-driven shutdown done before SIGKILL
    assert parse_timespan(service["TimeoutStopSec"]) >= 10


def test_unit_file_directories_match_daemon_defaults():
    unit = load_unit()
    service = unit["Service"]
    assert PurePosixPath("/run") / service["RuntimeDirectory"] == PurePosixPath(daemon_config.DEFAULT_SOCKET).parent
    assert PurePosixPath("/var/lib") / service["StateDirectory"] == PurePosixPath(daemon_config.DEFAULT_STATE_DIR)


def test_unit_file_ordering_and_install():
    unit = load_unit()
    assert "network-online.target" in unit["Unit"]["After"].split()
    assert "network-online.target" in unit["Unit"]["Wants"].split()
    assert unit["Unit"]["Documentation"]
    assert unit["Install"]["WantedBy"] == "multi-user.target"


def test_unit_file_has_no_trailing_comments():
    # systemd has no end-of-line comments: "Delegate=yes # why" sets Delegate
    # to the whole string. Explanations must sit on lines of their own.
    for number, line in enumerate(UNIT_FILE.read_text().splitlines(), 1):
        stripped = line.strip()
        if stripped and not stripped.startswith(("#", ";", "[")):
            assert "#" not in stripped, f"{UNIT_FILE.name}:{number}: {line}"
