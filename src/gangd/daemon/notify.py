"""The systemd notification protocol (sd_notify), spoken directly.

gangd runs as ``Type=notify`` (see ``systemd/gangd.service``): systemd counts
the daemon as started only once it says ``READY=1``, so units ordered after
gangd start when the node can actually take jobs, not merely when the process
exists. ``WatchdogSec=`` makes systemd restart a daemon that stops sending
``WATCHDOG=1``.

The protocol is one ``AF_UNIX``/``SOCK_DGRAM`` datagram of ``KEY=value`` lines
sent to the address in ``$NOTIFY_SOCKET``. That is small enough to implement
here, which spares every node a dependency on libsystemd and its Python
binding (a C extension that must be built against libsystemd's headers for
whichever Python the daemon runs under).

Why the details are as they are:

* Notifying is advisory. A failure to send (systemd restarting, the socket
  gone, its buffer full) must never block the event loop or raise into the
  daemon; it is logged and dropped. The socket is non-blocking for that reason.
* The watchdog is pinged from the trio event loop (:func:`watchdog_loop`), not
  from a thread: if the loop wedges, the pings stop and systemd restarts us,
  which is the point of having a watchdog. systemd arms it once start-up is
  complete (``READY=1``; start-up itself is bounded by ``TimeoutStartSec=``);
  pinging before that is harmless, so the loop can start with the daemon.
* Ranks spawned by the daemon must not inherit ``NOTIFY_SOCKET`` and
  ``WATCHDOG_*`` (:func:`scrub_environ`). A rank that is itself systemd-aware
  (an sd_notify-ing server, another Python using this protocol) would otherwise
  send READY/STOPPING/WATCHDOG on gangd's behalf; with ``NotifyAccess=main``
  systemd rejects those but logs every one, and with a laxer setting they would
  change gangd's state (a rank's pings would keep a wedged daemon alive).
  ``WATCHDOG_PID`` exists for exactly this reason, but not every client checks
  it, and ``NOTIFY_SOCKET`` has no such guard.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping

import trio

__all__ = ["SystemdNotifier", "scrub_environ", "watchdog_loop", "NOTIFY_ENV_VARS"]

log = logging.getLogger("gangd.notify")

#: The variables systemd sets for the notify protocol; children must not see them.
NOTIFY_ENV_VARS = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")

# socket.SOCK_CLOEXEC is Linux-only; elsewhere Python's sockets are still
# non-inheritable (PEP 446), just not atomically at creation.
_SOCK_CLOEXEC = getattr(socket, "SOCK_CLOEXEC", 0)


def _parse_address(value: str) -> str | None:
    """``$NOTIFY_SOCKET`` to a socket address, or None if we cannot speak to it.

    Like sd_notify(3): an absolute path, or ``@name`` for the abstract
    namespace (the leading NUL that marks it cannot be carried in an
    environment variable, hence the ``@``).
    """
    if value.startswith("@"):
        return "\0" + value[1:]
    if value.startswith("/"):
        return value
    return None  # relative paths are rejected by sd_notify; vsock: is not supported here


def _format_value(value: object) -> str:
    if isinstance(value, bool):  # READY=True would not parse as a boolean in systemd
        value = int(value)
    # A newline would end the assignment and start a forged one (a STATUS
    # quoting a job name must not become READY=1); a NUL would cut the
    # message short or get it rejected by systemd's parser.
    return str(value).replace("\r\n", " ").replace("\n", " ").replace("\r", " ").replace("\0", " ")


class SystemdNotifier:
    """A connection-less sender to systemd's notification socket.

    Build it with :meth:`from_environ`; ``None`` means the daemon was not
    started by systemd as a notify service and there is no one to tell.
    """

    def __init__(
        self,
        address: str,
        *,
        pid: int | None = None,
        watchdog_usec: int | None = None,
        watchdog_pid: int | None = None,
    ) -> None:
        parsed = _parse_address(address)
        if parsed is None:
            raise ValueError(f"unsupported NOTIFY_SOCKET address: {address!r}")
        self.address = address
        self._sockaddr = parsed
        self.pid = os.getpid() if pid is None else pid
        self.watchdog_usec = watchdog_usec
        self.watchdog_pid = watchdog_pid
        self._sock: socket.socket | None = socket.socket(
            socket.AF_UNIX, socket.SOCK_DGRAM | _SOCK_CLOEXEC
        )
        self._sock.setblocking(False)
        # Warn once per kind of failure rather than on every watchdog ping;
        # a dead socket would otherwise fill the log every few seconds.
        self._last_error: tuple[type, int | None] | None = None

    @classmethod
    def from_environ(
        cls, environ: Mapping[str, str] = os.environ, pid: int | None = None
    ) -> SystemdNotifier | None:
        """The notifier systemd asked for in ``environ``, or None if there is none."""
        address = environ.get("NOTIFY_SOCKET", "")
        if not address:
            return None
        if _parse_address(address) is None:
            log.warning("ignoring NOTIFY_SOCKET=%r: not an absolute path or @abstract name", address)
            return None
        try:
            return cls(
                address,
                pid=pid,
                watchdog_usec=_parse_int(environ, "WATCHDOG_USEC"),
                watchdog_pid=_parse_int(environ, "WATCHDOG_PID"),
            )
        except OSError as exc:  # e.g. out of file descriptors: run on, unsupervised
            log.warning("cannot create systemd notify socket: %s", exc)
            return None

    def __repr__(self) -> str:
        return f"SystemdNotifier({self.address!r}, pid={self.pid}, watchdog_usec={self.watchdog_usec})"

    def __enter__(self) -> SystemdNotifier:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def watchdog_interval(self) -> float | None:
        """Seconds between ``WATCHDOG=1`` pings, or None if no watchdog is ours.

        Half of ``WATCHDOG_USEC``, as sd_watchdog_enabled(3) recommends, so a
        single late ping does not get us killed. ``WATCHDOG_PID`` names the
        process the watchdog is meant for; if it is someone else (we inherited
        the environment), the watchdog is not ours to feed.
        """
        if not self.watchdog_usec or self.watchdog_usec <= 0:
            return None
        if self.watchdog_pid is not None and self.watchdog_pid != self.pid:
            return None
        return self.watchdog_usec / 2 / 1_000_000

    def notify(self, **fields: object) -> None:
        """Send ``KEY=value`` lines in one datagram; never blocks, never raises."""
        if not fields:
            return
        message = "".join(f"{key}={_format_value(value)}\n" for key, value in fields.items())
        self._send(message.encode("utf-8", "surrogateescape"))

    def ready(self, status: str | None = None) -> None:
        fields: dict[str, object] = {"READY": 1}
        if status is not None:
            fields["STATUS"] = status
        # MAINPID tells systemd which process is main even if it guessed
        # otherwise; with NotifyAccess=main it must match the sender anyway.
        fields["MAINPID"] = self.pid
        self.notify(**fields)

    def status(self, text: str) -> None:
        self.notify(STATUS=text)

    def watchdog(self) -> None:
        self.notify(WATCHDOG=1)

    def stopping(self, status: str | None = None) -> None:
        fields: dict[str, object] = {"STOPPING": 1}
        if status is not None:
            fields["STATUS"] = status
        self.notify(**fields)

    def close(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()

    def _send(self, data: bytes) -> None:
        sock = self._sock
        if sock is None:
            log.debug("systemd notify socket closed; dropped %r", data)
            return
        try:
            sock.sendto(data, self._sockaddr)
        except OSError as exc:
            # Covers ENOENT/ECONNREFUSED (socket gone, systemd re-executing),
            # EAGAIN (systemd not reading; we will not wait for it) and more.
            key = (type(exc), exc.errno)
            level = logging.DEBUG if key == self._last_error else logging.WARNING
            self._last_error = key
            log.log(level, "systemd notification to %s failed: %s", self.address, exc)
        else:
            if self._last_error is not None:
                log.info("systemd notifications to %s work again", self.address)
            self._last_error = None


def _parse_int(environ: Mapping[str, str], name: str) -> int | None:
    value = environ.get(name, "")
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        log.warning("ignoring %s=%r: not an integer", name, value)
        # An unparseable WATCHDOG_PID must not make the watchdog ours by
        # default; -1 matches no process.
        return -1 if name == "WATCHDOG_PID" else None


async def watchdog_loop(notifier: SystemdNotifier) -> None:
    """Ping systemd's watchdog forever; return at once if there is none to ping.

    Run it in the daemon's top-level nursery from the start of startup.
    """
    interval = notifier.watchdog_interval
    if interval is None:
        return
    log.debug("pinging the systemd watchdog every %.3fs", interval)
    while True:
        notifier.watchdog()
        await trio.sleep(interval)


def scrub_environ(env: Mapping[str, str]) -> dict[str, str]:
    """A copy of ``env`` without the notify protocol's variables, for children."""
    return {key: value for key, value in env.items() if key not in NOTIFY_ENV_VARS}
