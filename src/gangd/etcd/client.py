"""An etcd v3 client over etcd's JSON gateway, for trio.

Why the gateway: no maintained etcd client runs under trio (python-etcd3 and etcd3gw are synchronous, the
aio ones are asyncio-only and gRPC's own aio stack is asyncio-bound), and a hand-written gRPC/HTTP-2 stack
is not something to maintain. etcd serves every KV, lease, watch, maintenance and cluster call as JSON over
HTTP/1.1 (grpc-gateway: POST /v3/kv/range etc.; keys and values base64, int64 as strings, fields at their
default value omitted). ``httpx.AsyncClient`` speaks it and runs on trio through anyio; one client, one
persistent connection pool, for the life of an ``Etcd``.

Failures. A request that cannot reach an endpoint goes to the next one (the last that answered is tried
first); when none answered, ``Unavailable`` names them all. A read (or any request that cannot change the
store) is retried on the next endpoint after any transport failure; a write that was sent but whose answer
was lost is not retried -- it raises ``Indeterminate`` (a subclass of ``Unavailable``): it may or may not
have been applied, and only the caller knows how to check (e.g. by reading the key and comparing
revisions). etcd's own errors raise ``EtcdError`` with etcd's gRPC code and message.

Bounds: a response larger than ``max_response_bytes`` (a setting, 64 MiB by default: etcd refuses
requests above 1.5 MiB, but a range can return many keys) is refused, as is a single watch message above it.
"""

from __future__ import annotations

import base64
import contextlib
import json
import math
import ssl
from collections.abc import AsyncGenerator, Iterable, Iterator, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Final, Literal

import httpx
import trio

__all__ = [
    "EtcdError", "Unavailable", "Indeterminate", "Compacted",
    "KeyValue", "Range", "TxnResult", "WatchEvent", "WatchBatch",
    "Compare", "Op", "Etcd", "Watch", "prefix_end",
]

DEFAULT_MAX_RESPONSE_BYTES: Final = 64 * 1024 * 1024

# gRPC status codes etcd answers with (the gateway's "code").
CODE_NOT_FOUND: Final = 5
CODE_UNAVAILABLE: Final = 14
CODE_UNAUTHENTICATED: Final = 16
CODE_PERMISSION_DENIED: Final = 7
CODE_INVALID_ARGUMENT: Final = 3
CODE_FAILED_PRECONDITION: Final = 9
CODE_OUT_OF_RANGE: Final = 11


class EtcdError(Exception):
    """etcd refused a request (``code`` is etcd's gRPC status code when it gave one)."""

    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class Unavailable(EtcdError):
    """No endpoint answered in time (connection refused, reset or timed out on every one)."""


class Indeterminate(Unavailable):
    """A write was sent but its answer was lost: it may or may not have been applied."""


class Compacted(EtcdError):
    """A watch's start revision was compacted away: the events before ``compact_revision`` are gone."""

    def __init__(self, message: str, compact_revision: int) -> None:
        super().__init__(message, CODE_OUT_OF_RANGE)
        self.compact_revision = compact_revision


Bytes = str | bytes


def _b(data: Bytes) -> bytes:
    return data.encode() if isinstance(data, str) else bytes(data)


def _enc(data: Bytes) -> str:
    return base64.b64encode(_b(data)).decode("ascii")


def _dec(field: object) -> bytes:
    if field is None:
        return b""
    if not isinstance(field, str):
        raise EtcdError(f"etcd answered a non-string where base64 was expected: {field!r:.80}")
    return base64.b64decode(field, validate=True)


def _int(field: object) -> int:
    """An int64 as the gateway sends it: a decimal string (or absent for 0)."""
    if field is None:
        return 0
    if isinstance(field, bool):
        raise EtcdError(f"etcd answered a bool where an integer was expected: {field!r}")
    if isinstance(field, int):
        return field
    if isinstance(field, str):
        try:
            return int(field)
        except ValueError:
            pass
    raise EtcdError(f"etcd answered {field!r:.80} where an integer was expected")


def _dict(field: object) -> dict[str, Any]:
    if field is None:
        return {}
    if not isinstance(field, dict):
        raise EtcdError(f"etcd answered {field!r:.80} where an object was expected")
    return field


def _list(field: object) -> list[Any]:
    if field is None:
        return []
    if not isinstance(field, list):
        raise EtcdError(f"etcd answered {field!r:.80} where a list was expected")
    return field


def prefix_end(key: Bytes) -> bytes:
    """The range end that selects every key starting with ``key`` (etcd's GetPrefixRangeEnd)."""
    k = bytearray(_b(key))
    for i in range(len(k) - 1, -1, -1):
        if k[i] < 0xFF:
            k[i] += 1
            return bytes(k[: i + 1])
    return b"\0"  # every key


# ---------------------------------------------------------------------------------------------- results


@dataclass(frozen=True, slots=True)
class KeyValue:
    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int

    @classmethod
    def from_json(cls, d: object) -> KeyValue:
        m = _dict(d)
        return cls(_dec(m.get("key")), _dec(m.get("value")), _int(m.get("create_revision")), _int(m.get("mod_revision")),
                   _int(m.get("version")), _int(m.get("lease")))


@dataclass(frozen=True, slots=True)
class Range:
    kvs: list[KeyValue]
    count: int
    more: bool
    revision: int  # the store's revision when the range was served (response header)

    @classmethod
    def from_json(cls, d: object) -> Range:
        m = _dict(d)
        return cls([KeyValue.from_json(kv) for kv in _list(m.get("kvs"))], _int(m.get("count")), bool(m.get("more", False)),
                   _header_revision(m))


@dataclass(frozen=True, slots=True)
class TxnResult:
    succeeded: bool
    revision: int
    # One per op of the branch taken: a Range for a get, the revision (int) for a put, the deleted count (int) for a delete.
    responses: list[Range | int]


@dataclass(frozen=True, slots=True)
class WatchEvent:
    type: Literal["PUT", "DELETE"]
    kv: KeyValue
    prev_kv: KeyValue | None


@dataclass(frozen=True, slots=True)
class WatchBatch:
    """The events of one watch response, in revision order; ``revision`` is the response header's (the
    store's revision when it was sent, >= every event's mod_revision). Iterates and indexes like its list."""

    revision: int
    events: list[WatchEvent]

    def __iter__(self) -> Iterator[WatchEvent]:
        return iter(self.events)

    def __len__(self) -> int:
        return len(self.events)

    def __getitem__(self, i: int) -> WatchEvent:
        return self.events[i]


def _header_revision(m: dict[str, Any]) -> int:
    return _int(_dict(m.get("header")).get("revision"))


# ---------------------------------------------------------------------------------------------- txn builders


class _CompareTarget:
    def __init__(self, target: str, field: str, key: Bytes) -> None:
        self.target, self.field, self.key = target, field, _b(key)

    def _make(self, result: str, other: object) -> Compare:
        if self.target == "VALUE":
            if not isinstance(other, str | bytes):
                raise TypeError("Compare.value(key) compares with str or bytes")
            operand: object = _enc(other)
        else:
            if not isinstance(other, int) or isinstance(other, bool):
                raise TypeError(f"Compare.{self.field}(key) compares with an int")
            operand = str(other)
        return Compare({"result": result, "target": self.target, "key": _enc(self.key), self.field: operand})

    def __eq__(self, other: object) -> Compare:  # type: ignore[override]
        return self._make("EQUAL", other)

    def __ne__(self, other: object) -> Compare:  # type: ignore[override]
        return self._make("NOT_EQUAL", other)

    def __lt__(self, other: object) -> Compare:
        return self._make("LESS", other)

    def __gt__(self, other: object) -> Compare:
        return self._make("GREATER", other)

    __hash__ = None  # type: ignore[assignment]


class Compare:
    """A txn condition: ``Compare.version(key) == 0``, ``Compare.mod_revision(key) < n``, ``Compare.value(key) == b"x"``..."""

    def __init__(self, body: dict[str, Any]) -> None:
        self.body = body

    @staticmethod
    def version(key: Bytes) -> _CompareTarget:
        return _CompareTarget("VERSION", "version", key)

    @staticmethod
    def create_revision(key: Bytes) -> _CompareTarget:
        return _CompareTarget("CREATE", "create_revision", key)

    @staticmethod
    def mod_revision(key: Bytes) -> _CompareTarget:
        return _CompareTarget("MOD", "mod_revision", key)

    @staticmethod
    def value(key: Bytes) -> _CompareTarget:
        return _CompareTarget("VALUE", "value", key)

    @staticmethod
    def lease(key: Bytes) -> _CompareTarget:
        return _CompareTarget("LEASE", "lease", key)

    def __repr__(self) -> str:
        return f"Compare({self.body!r})"


class Op:
    """A txn operation: ``Op.put``, ``Op.get``, ``Op.delete``."""

    def __init__(self, kind: str, body: dict[str, Any]) -> None:
        self.kind, self.body = kind, body

    @staticmethod
    def put(key: Bytes, value: Bytes, lease: int = 0) -> Op:
        body: dict[str, Any] = {"key": _enc(key), "value": _enc(value)}
        if lease:
            body["lease"] = str(lease)
        return Op("request_put", body)

    @staticmethod
    def get(key: Bytes, prefix: bool = False, limit: int = 0) -> Op:
        body: dict[str, Any] = {"key": _enc(key)}
        if prefix:
            body["range_end"] = _enc(prefix_end(key))
        if limit:
            body["limit"] = str(limit)
        return Op("request_range", body)

    @staticmethod
    def delete(key: Bytes, prefix: bool = False) -> Op:
        body: dict[str, Any] = {"key": _enc(key)}
        if prefix:
            body["range_end"] = _enc(prefix_end(key))
        return Op("request_delete_range", body)

    def to_json(self) -> dict[str, Any]:
        return {self.kind: self.body}

    def __repr__(self) -> str:
        return f"Op({self.kind}, {self.body!r})"


def _txn_response(r: object) -> Range | int:
    m = _dict(r)
    if "response_range" in m:
        return Range.from_json(m["response_range"])
    if "response_put" in m:
        return _header_revision(_dict(m["response_put"]))
    if "response_delete_range" in m:
        return _int(_dict(m["response_delete_range"]).get("deleted"))
    if "response_txn" in m:
        raise EtcdError("nested txn responses are not supported")
    raise EtcdError(f"etcd answered an unknown txn response {m!r:.80}")


# ---------------------------------------------------------------------------------------------- the client

_CONNECT_ERRORS = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)
_TRANSPORT_ERRORS = (httpx.TransportError,)


class Etcd:
    """A client of one etcd cluster (any number of its members' client URLs)."""

    def __init__(self, endpoints: Sequence[str], *, timeout: float = 5.0, ca: str | None = None, cert: str | None = None,
                 key: str | None = None, user: str | None = None, password: str | None = None,
                 max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES, max_connections: int = 64,
                 max_watches: int = 256) -> None:
        if isinstance(endpoints, str):
            endpoints = [e for e in endpoints.split(",") if e]
        if not endpoints:
            raise ValueError("Etcd needs at least one endpoint URL")
        self.endpoints = [e.rstrip("/") for e in endpoints]
        for e in self.endpoints:
            if not e.startswith(("http://", "https://")):
                raise ValueError(f"an etcd endpoint is a URL (http://host:port or https://host:port), not {e!r}")
        self.timeout = timeout
        self.max_response_bytes = max_response_bytes
        self._urls: dict[tuple[int, str], httpx.URL] = {}
        self._current = 0  # index of the endpoint that answered last
        self._user, self._password = user, password
        self._token: str | None = None
        self._auth_lock = trio.Lock()
        verify: ssl.SSLContext | bool = True
        if ca is not None or cert is not None:
            ctx = ssl.create_default_context(cafile=ca)
            if cert is not None:
                ctx.load_cert_chain(cert, key)
            verify = ctx
        # Requests go straight to the transport (its connection pool): the client's per-request machinery
        # (cookies, auth flow, redirects, header merging) cost about as much CPU as etcd's answer itself,
        # and none of it applies to etcd. ``_http`` owns the transport and closes it.
        self._transport = httpx.AsyncHTTPTransport(
            verify=verify, limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
        )
        self._http = httpx.AsyncClient(transport=self._transport, timeout=httpx.Timeout(timeout))
        self._timeouts = {"timeout": httpx.Timeout(timeout).as_dict()}
        # Each watch holds a connection for its life: they get their own pool, so watches never starve requests.
        self._watch_http = httpx.AsyncClient(
            verify=verify,
            timeout=httpx.Timeout(timeout, read=None),
            limits=httpx.Limits(max_connections=max_watches, max_keepalive_connections=0),
            headers={"Content-Type": "application/json"},
        )

    async def aclose(self) -> None:
        await self._http.aclose()
        await self._watch_http.aclose()

    async def __aenter__(self) -> Etcd:
        return self

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        await self.aclose()

    # -------------------------------------------------------------------------------------- transport

    def _url(self, i: int, path: str) -> httpx.URL:
        url = self._urls.get((i, path))
        if url is None:
            url = self._urls[i, path] = httpx.URL(self.endpoints[i] + path)  # parsed once: a URL costs ~0.1 ms to parse
        return url

    def _order(self) -> list[int]:
        n = len(self.endpoints)
        return [(self._current + i) % n for i in range(n)]

    def _headers(self) -> dict[str, str] | None:
        return {"Authorization": self._token} if self._token else None

    def _request_headers(self, url: httpx.URL, length: int) -> list[tuple[bytes, bytes]]:
        headers = [(b"Host", url.netloc), (b"Content-Type", b"application/json"), (b"Content-Length", str(length).encode())]
        if self._token:
            headers.append((b"Authorization", self._token.encode()))
        return headers

    async def _read_bounded(self, response: httpx.Response) -> bytes:
        length = response.headers.get("content-length")
        if length is not None and length.isdigit():
            if int(length) > self.max_response_bytes:
                raise EtcdError(f"etcd's answer of {int(length)} bytes is larger than the limit of {self.max_response_bytes} bytes")
            return await response.aread()  # the common case, in one call: h11 stops at Content-Length
        parts: list[bytes] = []
        size = 0
        async for chunk in response.aiter_bytes():
            size += len(chunk)
            if size > self.max_response_bytes:
                raise EtcdError(f"etcd's answer is larger than the limit of {self.max_response_bytes} bytes")
            parts.append(chunk)
        return b"".join(parts)

    async def _post(self, path: str, body: dict[str, Any], *, mutates: bool) -> dict[str, Any]:
        """POST ``body`` to ``path`` on the first endpoint that answers; etcd's answer as a dict."""
        if self._user is not None and self._token is None:
            await self._authenticate()
        for attempt in range(2):
            try:
                return await self._post_once(path, body, mutates=mutates)
            except EtcdError as e:
                if attempt == 0 and e.code == CODE_UNAUTHENTICATED and self._user is not None and "token" in e.message:
                    await self._authenticate(stale=self._token)
                    continue
                raise
        raise AssertionError("unreachable")

    async def _post_once(self, path: str, body: dict[str, Any], *, mutates: bool) -> dict[str, Any]:
        content = json.dumps(body, separators=(",", ":")).encode()
        failures: list[str] = []
        for i in self._order():
            try:
                url = self._url(i, path)
                request = httpx.Request("POST", url, headers=self._request_headers(url, len(content)), content=content,
                                        extensions=self._timeouts)
                response = await self._transport.handle_async_request(request)
                try:
                    data = await self._read_bounded(response)
                finally:
                    await response.aclose()
                status = response.status_code
            except _CONNECT_ERRORS as e:
                failures.append(f"{self.endpoints[i]}: {_describe(e)}")
                continue
            except _TRANSPORT_ERRORS as e:
                if mutates:
                    self._current = (i + 1) % len(self.endpoints)  # this one is stalled or gone: the next call tries another
                    raise Indeterminate(
                        f"etcd at {self.endpoints[i]} did not answer a write ({_describe(e)}): it may or may not have been applied",
                        CODE_UNAVAILABLE) from e
                failures.append(f"{self.endpoints[i]}: {_describe(e)}")
                continue
            answer = _parse(data, self.endpoints[i])
            if status != 200:
                code = answer.get("code")
                message = str(answer.get("message") or answer.get("error") or f"HTTP {status}")
                code = code if isinstance(code, int) else None
                if code == CODE_UNAVAILABLE and not mutates:
                    # This member has no leader or timed out; another may serve it.
                    failures.append(f"{self.endpoints[i]}: {message}")
                    continue
                if code == CODE_UNAVAILABLE:
                    self._current = (i + 1) % len(self.endpoints)
                    raise Indeterminate(f"etcd at {self.endpoints[i]}: {message} (a write that may or may not have been applied)", code)
                raise EtcdError(message, code)
            self._current = i
            return answer
        raise Unavailable(f"etcd is unreachable: no endpoint answered (each given {self.timeout:g} s): " + "; ".join(failures),
                          CODE_UNAVAILABLE)

    async def _authenticate(self, stale: str | None = None) -> None:
        async with self._auth_lock:
            if self._token is not None and self._token != stale:
                return  # another task refreshed it meanwhile
            self._token = None
            answer = await self._post_once("/v3/auth/authenticate", {"name": self._user, "password": self._password}, mutates=False)
            token = answer.get("token")
            if not isinstance(token, str) or not token:
                raise EtcdError("etcd's authentication answer carries no token", CODE_UNAUTHENTICATED)
            self._token = token

    async def call(self, path: str, body: dict[str, Any], *, mutates: bool = True) -> dict[str, Any]:
        """A gateway call this class does not wrap (user and role management, auth enable, defragment...):
        ``path`` like ``/v3/auth/user/add``, ``body`` etcd's JSON (bytes fields base64, int64 as strings)."""
        return await self._post(path, body, mutates=mutates)

    # -------------------------------------------------------------------------------------- KV

    async def get(self, key: Bytes) -> KeyValue | None:
        r = await self.range(key)
        return r.kvs[0] if r.kvs else None

    async def range(self, key: Bytes, *, prefix: bool = False, range_end: Bytes | None = None, limit: int = 0, revision: int = 0,
                    keys_only: bool = False, count_only: bool = False, sort_target: str | None = None, sort_order: str | None = None,
                    min_create_revision: int = 0, max_create_revision: int = 0, serializable: bool = False) -> Range:
        """Keys ``key`` (or ``[key, range_end)``, or every key with prefix ``key``). ``sort_target`` is one of KEY, VERSION,
        CREATE, MOD, VALUE; ``sort_order`` NONE, ASCEND or DESCEND."""
        body: dict[str, Any] = {"key": _enc(key)}
        if prefix:
            body["range_end"] = _enc(prefix_end(key))
        elif range_end is not None:
            body["range_end"] = _enc(range_end)
        for name, v in (("limit", limit), ("revision", revision), ("min_create_revision", min_create_revision),
                        ("max_create_revision", max_create_revision)):
            if v:
                body[name] = str(v)
        if keys_only:
            body["keys_only"] = True
        if count_only:
            body["count_only"] = True
        if serializable:
            body["serializable"] = True
        if sort_target is not None:
            body["sort_target"] = sort_target
        if sort_order is not None:
            body["sort_order"] = sort_order
        return Range.from_json(await self._post("/v3/kv/range", body, mutates=False))

    async def put(self, key: Bytes, value: Bytes, *, lease: int = 0) -> int:
        """Store ``value`` at ``key``; the revision of the write."""
        return _header_revision(await self._post("/v3/kv/put", Op.put(key, value, lease).body, mutates=True))

    async def delete(self, key: Bytes, *, prefix: bool = False) -> int:
        """Delete ``key`` (or every key with that prefix); how many keys were deleted."""
        return _int((await self._post("/v3/kv/deleterange", Op.delete(key, prefix).body, mutates=True)).get("deleted"))

    async def txn(self, compare: Iterable[Compare], success: Iterable[Op], failure: Iterable[Op] = ()) -> TxnResult:
        """If every ``compare`` holds, apply ``success``, else ``failure``, atomically."""
        success, failure = list(success), list(failure)
        body = {"compare": [c.body for c in compare], "success": [o.to_json() for o in success],
                "failure": [o.to_json() for o in failure]}
        mutates = any(o.kind != "request_range" for o in (*success, *failure))
        answer = await self._post("/v3/kv/txn", body, mutates=mutates)
        return TxnResult(bool(answer.get("succeeded", False)), _header_revision(answer),
                         [_txn_response(r) for r in _list(answer.get("responses"))])

    async def compact(self, revision: int, *, physical: bool = True) -> None:
        """Forget every revision below ``revision`` (watches from before it raise ``Compacted``)."""
        await self._post("/v3/kv/compaction", {"revision": str(revision), "physical": physical}, mutates=True)

    # -------------------------------------------------------------------------------------- leases

    async def lease_grant(self, ttl: int, lease_id: int = 0) -> tuple[int, int]:
        """A new lease of ``ttl`` seconds: (its id, the TTL etcd granted)."""
        body: dict[str, Any] = {"TTL": str(int(ttl))}
        if lease_id:
            body["ID"] = str(lease_id)
        answer = await self._post("/v3/lease/grant", body, mutates=True)
        if answer.get("error"):
            raise EtcdError(f"etcd refused the lease: {answer['error']}")
        return _int(answer.get("ID")), _int(answer.get("TTL"))

    async def lease_keepalive(self, lease_id: int) -> int:
        """Renew the lease once: its TTL again from now, or 0 when etcd no longer has it."""
        answer = await self._post("/v3/lease/keepalive", {"ID": str(lease_id)}, mutates=False)
        if "error" in answer:
            err = _dict(answer["error"])
            raise EtcdError(str(err.get("message", err)), _int(err.get("grpc_code")) or None)
        return max(0, _int(_dict(answer.get("result")).get("TTL")))

    async def lease_revoke(self, lease_id: int) -> None:
        """End the lease now, deleting every key attached to it (no error when it is already gone)."""
        try:
            await self._post("/v3/lease/revoke", {"ID": str(lease_id)}, mutates=True)
        except EtcdError as e:
            if e.code != CODE_NOT_FOUND:
                raise

    async def lease_ttl(self, lease_id: int) -> int:
        """Seconds the lease has left on the server (-1 when it is gone)."""
        answer = await self._post("/v3/lease/timetolive", {"ID": str(lease_id)}, mutates=False)
        return _int(answer.get("TTL"))

    # -------------------------------------------------------------------------------------- cluster

    async def status(self, endpoint: str | None = None) -> dict[str, Any]:
        """The answering member's status: version, member_id, leader, raft_term, raft_index, db_size, revision, endpoint."""
        if endpoint is not None:
            client = Etcd([endpoint], timeout=self.timeout)
            try:
                return await client.status()
            finally:
                await client.aclose()
        answer = await self._post("/v3/maintenance/status", {}, mutates=False)
        header = _dict(answer.get("header"))

        def get(*names: str) -> Any:
            for n in names:
                if n in answer:
                    return answer[n]
            return None

        return {
            "version": str(get("version") or ""),
            "member_id": _int(header.get("member_id")),
            "leader": _int(get("leader")),
            "raft_term": _int(get("raftTerm", "raft_term")),
            "raft_index": _int(get("raftIndex", "raft_index")),
            "db_size": _int(get("dbSize", "db_size")),
            "revision": _int(header.get("revision")),
            "errors": [str(e) for e in _list(get("errors"))],
            "endpoint": self.endpoints[self._current],
        }

    async def members(self) -> list[dict[str, Any]]:
        """The cluster's members: id, name, peer_urls, client_urls, learner."""
        answer = await self._post("/v3/cluster/member/list", {}, mutates=False)
        out = []
        for m in _list(answer.get("members")):
            d = _dict(m)
            out.append({"id": _int(d.get("ID")), "name": str(d.get("name", "")),
                        "peer_urls": [str(u) for u in _list(d.get("peerURLs"))],
                        "client_urls": [str(u) for u in _list(d.get("clientURLs"))], "learner": bool(d.get("isLearner", False))})
        return out

    # -------------------------------------------------------------------------------------- watch

    def watch(self, key: Bytes, *, prefix: bool = False, start_revision: int = 0, prev_kv: bool = False,
              range_end: Bytes | None = None, progress_timeout: float | None = None) -> Watch:
        """``async with etcd.watch(key) as w: async for batch in w:`` -- each batch a ``WatchBatch`` (a non-empty list of
        events with the response's header revision). Entering waits until etcd confirmed the watch, so every change
        after that point is seen; with ``start_revision`` the changes since that revision come first.

        A member that stalls (stopped, partitioned) keeps the connection open and sends nothing: with
        ``progress_timeout`` the watch asks etcd for progress notifications and moves to another endpoint when
        nothing came for that long. etcd sends them every ``--experimental-watch-progress-notify-interval``
        (10 min by default; LocalEtcd sets 2 s), so ``progress_timeout`` must be comfortably longer."""
        end = prefix_end(key) if prefix else (_b(range_end) if range_end is not None else None)
        return Watch(self, _b(key), end, start_revision, prev_kv, progress_timeout)


def _describe(e: BaseException) -> str:
    """The exception's type and the first non-empty message along its cause chain (httpx's ConnectError around an
    SSL error says nothing itself), with how each connection attempt failed where trio grouped them under "all
    attempts to connect ... failed" (a refused connection and a timed-out one are different stories)."""
    name = type(e).__name__
    chain: list[BaseException] = []
    seen: BaseException | None = e
    while seen is not None and len(chain) < 5:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    text = next((str(x) for x in chain if str(x)), "")
    group = next((x for x in chain if isinstance(x, BaseExceptionGroup)), None)
    if group is not None:
        reasons = sorted({getattr(x, "strerror", None) or str(x) or type(x).__name__ for x in group.exceptions})
        text = f"{text} ({'; '.join(reasons)})"
    return f"{name}: {text}" if text else name


def _parse(data: bytes, endpoint: str) -> dict[str, Any]:
    try:
        answer = json.loads(data)
    except ValueError as e:
        raise EtcdError(f"etcd at {endpoint} answered something that is not JSON: {data[:80]!r}") from e
    if not isinstance(answer, dict):
        raise EtcdError(f"etcd at {endpoint} answered {data[:80]!r}, not a JSON object")
    return answer


class Watch:
    """A watch that survives lost connections: it reconnects (to any endpoint) from the revision after the last
    one it delivered, so no event is lost or repeated. Raises ``Compacted`` if those revisions are gone."""

    def __init__(self, etcd: Etcd, key: bytes, range_end: bytes | None, start_revision: int, prev_kv: bool,
                 progress_timeout: float | None = None) -> None:
        self._etcd = etcd
        self._progress_timeout = progress_timeout
        self._endpoint = etcd._current  # the endpoint the stream is on
        self._key, self._range_end = key, range_end
        self._next = start_revision  # 0 until the first creation tells the current revision
        self._prev_kv = prev_kv
        self._stack: contextlib.AsyncExitStack | None = None
        self._lines: AsyncGenerator[bytes, None] | None = None
        self._closed = False
        self._reauthenticated = False  # since the last successful connect
        self.revision = 0  # the header revision of the last response seen

    async def __aenter__(self) -> Watch:
        try:
            await self._connect(first=True)
        except EtcdError as e:
            if not await self._reauthenticate(e):
                raise
            await self._connect(first=True)
        return self

    async def _reauthenticate(self, e: EtcdError) -> bool:
        """After an authentication error: a fresh token if this client has credentials (then try again, once: an
        expired token reads as permission denied to a watch, a real denial comes back)."""
        if self._reauthenticated or self._etcd._user is None:
            return False
        if e.code in (CODE_UNAUTHENTICATED, CODE_PERMISSION_DENIED) or "user name is empty" in e.message:
            self._reauthenticated = True
            await self._etcd._authenticate(stale=self._etcd._token)
            return True
        return False

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        self._closed = True
        await self._drop()

    def __aiter__(self) -> Watch:
        return self

    async def _drop(self) -> None:
        stack, lines, self._stack, self._lines = self._stack, self._lines, None, None
        with trio.CancelScope(shield=True), trio.move_on_after(1):
            if lines is not None:
                with contextlib.suppress(Exception):
                    await lines.aclose()
            if stack is not None:
                await stack.aclose()

    async def _lines_of(self, response: httpx.Response) -> AsyncGenerator[bytes, None]:
        limit = self._etcd.max_response_bytes
        buffer = bytearray()
        async for chunk in response.aiter_bytes():
            buffer += chunk
            while True:
                nl = buffer.find(b"\n")
                if nl < 0:
                    break
                line = bytes(buffer[:nl])
                del buffer[: nl + 1]
                if line.strip():
                    yield line
            if len(buffer) > limit:
                raise EtcdError(f"a watch message from etcd is larger than the limit of {limit} bytes")
        if buffer.strip():
            yield bytes(buffer)

    async def _connect(self, first: bool = False) -> None:
        """Open the stream on the first endpoint that answers and wait for etcd's confirmation."""
        etcd = self._etcd
        if etcd._user is not None and etcd._token is None:
            await etcd._authenticate()
        create: dict[str, Any] = {"key": _enc(self._key)}
        if self._range_end is not None:
            create["range_end"] = _enc(self._range_end)
        if self._next:
            create["start_revision"] = str(self._next)
        if self._prev_kv:
            create["prev_kv"] = True
        if self._progress_timeout is not None:
            create["progress_notify"] = True
        content = json.dumps({"create_request": create}).encode()
        failures: list[str] = []
        n = len(etcd.endpoints)
        for i in [(self._endpoint + k) % n for k in range(n)]:
            url = etcd.endpoints[i] + "/v3/watch"
            stack = contextlib.AsyncExitStack()
            try:
                # No read timeout: a quiet watch is a healthy one.
                response = await stack.enter_async_context(etcd._watch_http.stream(
                    "POST", url, content=content, headers=etcd._headers(),
                    timeout=httpx.Timeout(etcd.timeout, read=None)))
                if response.status_code != 200:
                    data = await etcd._read_bounded(response)
                    answer = _parse(data, etcd.endpoints[i])
                    code = answer.get("code")
                    raise EtcdError(str(answer.get("message") or f"HTTP {response.status_code}"), code if isinstance(code, int) else None)
                lines = self._lines_of(response)
                with trio.fail_after(etcd.timeout):
                    line = await anext(lines)
                result = self._result(line, etcd.endpoints[i])
            except (*_TRANSPORT_ERRORS, trio.TooSlowError, StopAsyncIteration) as e:
                await stack.aclose()
                failures.append(f"{etcd.endpoints[i]}: {_describe(e)}")
                continue
            except BaseException:
                await stack.aclose()
                raise
            if result.get("canceled"):
                await stack.aclose()
                self._raise_canceled(result)
            if not result.get("created"):
                await stack.aclose()
                raise EtcdError(f"etcd at {etcd.endpoints[i]} answered a watch with {line[:120]!r} before confirming it")
            if not self._next:
                self._next = _header_revision(result) + 1
            self.revision = max(self.revision, _header_revision(result))
            etcd._current = self._endpoint = i
            self._reauthenticated = False
            self._stack, self._lines = stack, lines
            return
        raise Unavailable("no etcd endpoint accepted the watch: " + "; ".join(failures), CODE_UNAVAILABLE)

    def _result(self, line: bytes, endpoint: str) -> dict[str, Any]:
        message = _parse(line, endpoint)
        if "error" in message:
            err = message["error"]
            if isinstance(err, dict):
                code = err.get("grpc_code")
                raise EtcdError(str(err.get("message", err)), code if isinstance(code, int) else None)
            raise EtcdError(str(err))
        return _dict(message.get("result"))

    def _raise_canceled(self, result: dict[str, Any]) -> None:
        compact = _int(result.get("compact_revision"))
        if compact:
            raise Compacted(f"the watch's start revision {self._next} was compacted (etcd keeps revisions from {compact} on)", compact)
        reason = str(result.get("cancel_reason", "no reason given"))
        code = CODE_PERMISSION_DENIED if "PermissionDenied" in reason else CODE_UNAUTHENTICATED if "Unauthenticated" in reason else None
        raise EtcdError(f"etcd cancelled the watch: {reason}", code)

    async def __anext__(self) -> WatchBatch:
        backoff = 0.05
        while True:
            if self._closed:
                raise StopAsyncIteration
            if self._lines is None:
                try:
                    await self._connect()
                except Unavailable:
                    await trio.sleep(backoff)
                    backoff = min(1.0, backoff * 2)
                    continue
                except EtcdError as e:
                    if not await self._reauthenticate(e):
                        raise
                    continue
                backoff = 0.05
            if self._lines is None:
                continue
            try:
                with trio.move_on_after(self._progress_timeout if self._progress_timeout is not None else math.inf) as quiet:
                    line = await anext(self._lines)
                if quiet.cancelled_caught:
                    # Not even a progress notification: that member is stalled. Resume on the next one.
                    await self._drop()
                    self._endpoint = (self._endpoint + 1) % len(self._etcd.endpoints)
                    continue
                result = self._result(line, self._etcd.endpoints[self._endpoint])
            except (*_TRANSPORT_ERRORS, StopAsyncIteration):
                await self._drop()  # the connection went away: reconnect from self._next
                continue
            except EtcdError as e:
                if e.code == CODE_UNAVAILABLE:
                    await self._drop()
                    continue
                raise
            if result.get("canceled"):
                await self._drop()
                self._raise_canceled(result)
            revision = _header_revision(result)
            self.revision = max(self.revision, revision)
            events = []
            for ev in _list(result.get("events")):
                d = _dict(ev)
                kv = KeyValue.from_json(d.get("kv"))
                if kv.mod_revision < self._next:
                    continue  # already delivered before a reconnect
                prev = KeyValue.from_json(d["prev_kv"]) if d.get("prev_kv") else None
                events.append(WatchEvent("DELETE" if d.get("type") == "DELETE" else "PUT", kv, prev))
            if not events:
                if not result.get("created") and not result.get("events") and revision >= self._next:
                    # A progress notification (etcd sends them to a watch that has caught
                    # up only): nothing up to ``revision`` is left to deliver, so a
                    # reconnect resumes from there -- a quiet key's watch does not
                    # resume from a revision a compaction has since removed.
                    self._next = revision + 1
                continue  # a progress notification or a created echo
            self._next = events[-1].kv.mod_revision + 1
            return WatchBatch(revision, events)

