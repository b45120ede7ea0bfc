"""An emulated Kubernetes API server for what dp's DRA front end asks of a real one.

It serves, over HTTP/1.1 (h11) on the running asyncio loop, with the REST
conventions of the real server:

- `/api/v1/nodes` (get, list and watch; `add_node`, `delete_node`: a Node
  registered again has a new UID);
- `resource.k8s.io/v1` `resourceslices` (cluster-scoped) and `resourceclaims`
  (namespaced, with the `status` subresource): get, list, watch, create, update,
  delete and, by field selector, deletecollection (as the kubelet wipes its
  node's slices at start);
- `events.k8s.io/v1` `events` (namespaced), as a controller reports on an
  object: create, get and list;
- `/api/v1` `pods` (namespaced, with the `status` subresource) and
  `resource.k8s.io/v1` `deviceclasses` (cluster-scoped), stored as given,
  for the scheduler's extended resources (`scheduler`, `extended`);
  `set_allocatable` stands for the kubelet's report of a Node's
  device-plugin resources (`status.allocatable`);
- list and watch with field selectors (`metadata.name`, `spec.nodeName`,
  `spec.driver` for slices; `metadata.name`, `metadata.namespace` for claims)
  and `resourceVersion`; watch events as JSON lines in a chunked answer,
  ended after `timeoutSeconds`;
- `generateName`, `uid`, `generation`, `creationTimestamp`; ownerReferences
  kept as given, and honoured by a garbage collector: `gc_delay` seconds
  (0.1) after an object is deleted, everything whose owners are all gone is
  deleted too (`collected`); an update with a stale `resourceVersion` is a 409 Conflict;
  a watch from a version no longer in the history (`compact`, or
  `expire_watches` for the open ones) gets a 410 Gone ERROR event;
- `?dryRun=All` on a create, update or delete: the same defaulting, field
  dropping and validation as the real write, and the same answer (a create's
  with a UID and a name but no resourceVersion), but nothing is stored and
  no watch hears of it; counted in `dry_runs`, not `requests`;
- every object written is checked against the published schema and the rules
  in code (`rules.Validator`, 422 Invalid when it fails) and rejects are kept
  in `rejected`.

Feature gates: `disabled_features` (empty by default: every feature on)
names `DRAPartitionableDevices` and `DRADeviceTaints` to behave like a
server that has them off, which drops their fields from the slices it is
given (`rules.drop_disabled_fields`).

Faults for tests: `delay` (seconds before every answer), `unavailable`
(503 to everything), `fail_next(verb, resource, code)`, `garble_next(verb,
resource)` (200 and a body that is no object), `delay_answer(verb,
resource, seconds)` (a write stored at once, its answer late), and
`stop`/`start` (nothing listening). `requests` counts what was asked, by (verb, resource).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import re
import urllib.parse
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import h11

from dp_testing.apiserver.rules import FEATURES, Validator, default_slice, drop_disabled_fields
from dp_testing.apiserver.store import (
    ApiFailure,
    Event,
    Store,
    field_value,
    parse_field_selector,
)

__all__ = ["ApiServerEmulator"]

Obj = dict[str, Any]

_GROUP = "/apis/resource.k8s.io/v1"
_ROUTES = [
    (re.compile(r"/api/v1/nodes(?:/(?P<name>[^/]+))?"), "nodes", False),
    (
        re.compile(
            r"/api/v1/namespaces/(?P<ns>[^/]+)/pods(?:/(?P<name>[^/]+)(?P<status>/status)?)?"
        ),
        "pods",
        False,
    ),
    (re.compile(_GROUP + r"/resourceslices(?:/(?P<name>[^/]+))?"), "resourceslices", False),
    (re.compile(_GROUP + r"/deviceclasses(?:/(?P<name>[^/]+))?"), "deviceclasses", False),
    (
        re.compile(
            _GROUP
            + r"/namespaces/(?P<ns>[^/]+)/resourceclaims(?:/(?P<name>[^/]+)(?P<status>/status)?)?"
        ),
        "resourceclaims",
        False,
    ),
    (
        re.compile(r"/apis/events.k8s.io/v1/namespaces/(?P<ns>[^/]+)/events(?:/(?P<name>[^/]+))?"),
        "events",
        False,
    ),
]
_KINDS = {
    "nodes": ("v1", "Node"),
    "pods": ("v1", "Pod"),
    "resourceslices": ("resource.k8s.io/v1", "ResourceSlice"),
    "deviceclasses": ("resource.k8s.io/v1", "DeviceClass"),
    "resourceclaims": ("resource.k8s.io/v1", "ResourceClaim"),
    "events": ("events.k8s.io/v1", "Event"),
}
_FIELDS = {
    "nodes": {"metadata.name"},
    "pods": {"metadata.name", "metadata.namespace", "spec.nodeName"},
    "deviceclasses": {"metadata.name"},
    "resourceslices": {"metadata.name", "spec.nodeName", "spec.driver"},
    "resourceclaims": {"metadata.name", "metadata.namespace"},
    "events": {"metadata.name", "metadata.namespace", "regarding.name", "regarding.uid", "reason"},
}
_MAX_BODY = 3 * 1024 * 1024


class ApiServerEmulator:
    """The emulated server; `start()` listens on 127.0.0.1 (a free port unless given)."""

    def __init__(
        self,
        *,
        schema: Path | None = None,
        history: int = 1000,
        disabled_features: Iterable[str] = (),
    ) -> None:
        self.disabled_features = frozenset(disabled_features)
        unknown = sorted(self.disabled_features - FEATURES)
        if unknown:
            raise ValueError(f"unknown feature gates {unknown}; known: {sorted(FEATURES)}")
        self.store = Store(history=history)
        # The garbage collector (kube-controller-manager's): what a deleted
        # object owned goes `gc_delay` seconds later (about 100 ms on a real
        # control plane); None turns it off.
        self.gc_delay: float | None = 0.1
        self.collected: list[tuple[str, str, str]] = []
        self.store.listen(self._owner_deleted)
        self.validator = Validator(schema) if schema is not None else None
        self.delay = 0.0
        self.unavailable = False
        self.requests: collections.Counter[tuple[str, str]] = collections.Counter()
        # Requests with ?dryRun=All, apart: they write nothing.
        self.dry_runs: collections.Counter[tuple[str, str]] = collections.Counter()
        self.rejected: list[tuple[str, str]] = []
        self.port = 0
        self._faults: list[tuple[str, str, int]] = []
        self._late: list[tuple[str, str, float]] = []
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[None]] = set()
        self._watches: set[asyncio.Queue[Event | None]] = set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def writes(self) -> int:
        return sum(
            n for (verb, _), n in self.requests.items() if verb in {"create", "update", "delete"}
        )

    async def start(self, port: int | None = None) -> None:
        self._server = await asyncio.start_server(
            self._connection, "127.0.0.1", self.port if port is None else port
        )
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        """Stop listening and drop every connection, open watches included."""
        if self._server is None:
            return
        self._server.close()
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)
        await self._server.wait_closed()
        self._server = None

    def add_node(self, name: str) -> Obj:
        """Register Node `name`; registered again after `delete_node`, it has a new UID."""
        return self.store.create(
            "nodes", "", {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}}
        )

    def set_allocatable(self, node: str, allocatable: dict[str, int]) -> Obj:
        """Node `node`'s `status.allocatable` for these resources, as the kubelet
        reports what its device plugins offer (a registered resource stays, at 0)."""
        obj = self.store.get("nodes", "", node)
        status = obj.get("status") or {}
        status["allocatable"] = {
            **(status.get("allocatable") or {}),
            **{name: str(count) for name, count in allocatable.items()},
        }
        obj["status"] = status
        return self.store.update("nodes", "", node, obj, status=True)

    def delete_node(self, name: str) -> Obj:
        """`kubectl delete node`: what it owns goes after `gc_delay`."""
        return self.store.delete("nodes", "", name)

    def _owner_deleted(self, event: Event) -> None:
        uid = event.object.get("metadata", {}).get("uid")
        if event.type != "DELETED" or not uid or self.gc_delay is None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # the collector runs on the emulator's loop
        loop.call_later(self.gc_delay, self._collect, uid)

    def _collect(self, uid: str) -> None:
        """Delete every object one of whose owners was `uid` and none of whose
        owners exists any more, as the garbage collector does for dangling
        owner references (background propagation)."""
        alive = {o["metadata"]["uid"] for o in self.store.everything()}
        for resource, namespace, obj in self.store.everything_with_keys():
            owners = {r.get("uid") for r in obj.get("metadata", {}).get("ownerReferences") or ()}
            if uid in owners and not owners & alive:
                name = obj["metadata"]["name"]
                with contextlib.suppress(ApiFailure):  # someone was quicker
                    self.store.delete(resource, namespace, name)
                    self.collected.append((resource, namespace, name))

    def fail_next(self, verb: str, resource: str, code: int) -> None:
        """Answer the next `verb` on `resource` with `code` (409, 500, 503...)."""
        self._faults.append((verb, resource, code))

    def garble_next(self, verb: str, resource: str) -> None:
        """Answer the next `verb` on `resource` with 200 and a body that is no
        object (a proxy's error page), without serving it."""
        self._faults.append((verb, resource, 0))

    def delay_answer(self, verb: str, resource: str, seconds: float) -> None:
        """Answer the next `verb` on `resource` `seconds` after it took effect: what it
        changed is stored and its watch events go out at once, as when an answer is
        slow on its way back."""
        self._late.append((verb, resource, seconds))

    def expire_watches(self) -> None:
        """End every open watch with a 410 Gone, and forget the history (a compaction)."""
        self.store.compact()
        for queue in list(self._watches):
            queue.put_nowait(None)

    def slices(self) -> list[Obj]:
        return self.store.objects("resourceslices")

    # -- HTTP ---------------------------------------------------------------

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        conn = h11.Connection(h11.SERVER)
        try:
            while True:
                request, body = await _read_request(conn, reader)
                if request is None:
                    return
                keep = await self._answer(conn, writer, request, body)
                if not keep or conn.our_state is not h11.DONE:
                    return
                conn.start_next_cycle()
        except (OSError, h11.ProtocolError, asyncio.IncompleteReadError):
            pass
        except asyncio.CancelledError:
            pass
        finally:
            self._connections.discard(task)
            writer.transport.abort()

    async def _answer(
        self, conn: h11.Connection, writer: asyncio.StreamWriter, request: h11.Request, body: bytes
    ) -> bool:
        if self.delay:
            await asyncio.sleep(self.delay)
        target = urllib.parse.urlsplit(request.target.decode())
        query = dict(urllib.parse.parse_qsl(target.query))
        method = request.method.decode()
        try:
            if self.unavailable:
                raise ApiFailure(503, "ServiceUnavailable", "the server is currently unavailable")
            resource, namespace, name, status = _route(target.path)
            verb = _verb(method, name, query)
            dry_run = _dry_run(verb, query)
            (self.dry_runs if dry_run else self.requests)[(verb, resource)] += 1
            for fault in self._faults:
                if fault[:2] == (verb, resource):
                    self._faults.remove(fault)
                    if fault[2] == 0:
                        await _send_text(conn, writer, 200, b"<html>502 Bad Gateway</html>")
                        return True
                    raise ApiFailure(fault[2], "Injected", f"injected {fault[2]} for {verb}")
            if verb == "watch":
                await self._watch(conn, writer, resource, namespace, query)
                return False
            code, answer = self._serve(
                verb, resource, namespace, name, status, query, body, dry_run=dry_run
            )
            for late in self._late:
                if late[:2] == (verb, resource):
                    self._late.remove(late)
                    await asyncio.sleep(late[2])
                    break
        except ApiFailure as failure:
            code, answer = failure.code, failure.status()
        await _send_json(conn, writer, code, answer)
        return True

    def _serve(
        self,
        verb: str,
        resource: str,
        namespace: str,
        name: str,
        status: bool,
        query: dict[str, str],
        body: bytes,
        *,
        dry_run: bool = False,
    ) -> tuple[int, Obj]:
        api_version, kind = _KINDS[resource]
        if verb == "get":
            return 200, _typed(resource, self.store.get(resource, namespace, name))
        if verb == "list":
            selector = _selector(resource, query)
            items = [o for o in self.store.objects(resource, namespace) if _matches(o, selector)]
            listing = {
                "kind": f"{kind}List",
                "apiVersion": api_version,
                "metadata": {"resourceVersion": str(self.store.version)},
                "items": items,
            }
            return 200, listing
        if verb == "delete":
            return 200, _typed(
                resource, self.store.delete(resource, namespace, name, dry_run=dry_run)
            )
        if verb == "deletecollection":
            selector = _selector(resource, query)
            gone = [
                self.store.delete(resource, namespace, o["metadata"]["name"], dry_run=dry_run)
                for o in self.store.objects(resource, namespace)
                if _matches(o, selector)
            ]
            listing = {"kind": f"{kind}List", "apiVersion": api_version, "items": gone}
            return 200, {**listing, "metadata": {"resourceVersion": str(self.store.version)}}
        obj = _decode(body)
        if obj.get("kind", kind) != kind or obj.get("apiVersion", api_version) != api_version:
            raise ApiFailure(400, "BadRequest", f"expected {api_version} {kind}")
        if namespace:
            meta = obj.setdefault("metadata", {})
            if meta.setdefault("namespace", namespace) != namespace:
                raise ApiFailure(
                    400,
                    "BadRequest",
                    "the namespace of the provided object does not match the namespace "
                    "sent on the request",
                )
        if resource == "resourceslices":
            obj = default_slice(obj)
            if self.disabled_features:
                old = None
                if verb == "update":
                    with contextlib.suppress(ApiFailure):  # the store answers the 404
                        old = self.store.get(resource, namespace, name)
                obj = drop_disabled_fields(obj, old, self.disabled_features)
        if self.validator is not None:
            try:
                self.validator.check(resource, {**obj, "kind": kind, "apiVersion": api_version})
            except ApiFailure as failure:
                self.rejected.append((resource, failure.message))
                raise
        if verb == "create":
            created = self.store.create(resource, namespace, obj, dry_run=dry_run)
            return 201, _typed(resource, created)
        return 200, _typed(
            resource,
            self.store.update(resource, namespace, name, obj, status=status, dry_run=dry_run),
        )

    async def _watch(
        self,
        conn: h11.Connection,
        writer: asyncio.StreamWriter,
        resource: str,
        namespace: str,
        query: dict[str, str],
    ) -> None:
        selector = _selector(resource, query)
        queue: asyncio.Queue[Event | None] = asyncio.Queue()

        def wanted(event: Event) -> bool:
            return (
                event.resource == resource
                and (not namespace or event.namespace == namespace)
                and _matches(event.object, selector)
            )

        unlisten = self.store.listen(lambda e: queue.put_nowait(e) if wanted(e) else None)
        self._watches.add(queue)
        try:
            since = query.get("resourceVersion", "")
            backlog: list[Event] | ApiFailure
            if since in ("", "0"):
                backlog = [
                    Event("ADDED", resource, namespace, o, self.store.version)
                    for o in self.store.objects(resource, namespace)
                    if _matches(o, selector)
                ]
            else:
                try:
                    backlog = [e for e in self.store.events_since(int(since)) if wanted(e)]
                except ApiFailure as failure:
                    backlog = failure
            headers = [("Content-Type", "application/json"), ("Transfer-Encoding", "chunked")]
            await _send(conn, writer, h11.Response(status_code=200, headers=headers))
            if isinstance(backlog, ApiFailure):
                await _send(conn, writer, h11.Data(data=_line("ERROR", backlog.status())))
                await _send(conn, writer, h11.EndOfMessage())
                return
            for event in backlog:
                await _send(conn, writer, h11.Data(data=_event_line(event)))
            timeout = float(query["timeoutSeconds"]) if "timeoutSeconds" in query else None
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    while True:
                        event = await queue.get()
                        if event is None:
                            gone = ApiFailure(410, "Expired", "too old resource version")
                            await _send(conn, writer, h11.Data(data=_line("ERROR", gone.status())))
                            break
                        await _send(conn, writer, h11.Data(data=_event_line(event)))
            await _send(conn, writer, h11.EndOfMessage())
        finally:
            unlisten()
            self._watches.discard(queue)


def _route(path: str) -> tuple[str, str, str, bool]:
    for pattern, resource, _ in _ROUTES:
        match = pattern.fullmatch(path)
        if match:
            groups = match.groupdict()
            return (
                resource,
                groups.get("ns") or "",
                groups.get("name") or "",
                bool(groups.get("status")),
            )
    raise ApiFailure(404, "NotFound", f"the server could not find the requested resource {path}")


def _verb(method: str, name: str, query: dict[str, str]) -> str:
    if method == "GET":
        if name:
            return "get"
        return "watch" if query.get("watch") in ("true", "1") else "list"
    if method == "DELETE" and not name:
        return "deletecollection"
    verbs = {"POST": "create", "PUT": "update", "DELETE": "delete"}
    if method not in verbs or (method == "POST") == bool(name):
        raise ApiFailure(405, "MethodNotAllowed", f"{method} is not allowed here")
    return verbs[method]


def _dry_run(verb: str, query: dict[str, str]) -> bool:
    """Whether the request is a server-side dry run; `All` is the one value a
    server takes (`ValidateDryRun`, apimachinery's `meta/v1/validation`)."""
    if "dryRun" not in query:
        return False
    if verb not in ("create", "update", "delete", "deletecollection") or query["dryRun"] != "All":
        raise ApiFailure(
            422,
            "Invalid",
            f'dryRun: Unsupported value: "{query["dryRun"]}": supported values: "All"',
        )
    return True


def _selector(resource: str, query: dict[str, str]) -> list[tuple[str, str, bool]]:
    terms = parse_field_selector(query.get("fieldSelector", ""))
    for field, _, _ in terms:
        if field not in _FIELDS[resource]:
            raise ApiFailure(
                400, "BadRequest", f'field label not supported: "{field}" for {resource}'
            )
    return terms


def _matches(obj: Obj, selector: list[tuple[str, str, bool]]) -> bool:
    return all((field_value(obj, f) == v) == equal for f, v, equal in selector)


def _typed(resource: str, obj: Obj) -> Obj:
    api_version, kind = _KINDS[resource]
    return {"apiVersion": api_version, "kind": kind, **obj}


def _decode(body: bytes) -> Obj:
    try:
        obj = json.loads(body)
    except ValueError as error:
        raise ApiFailure(400, "BadRequest", f"the body is not JSON: {error}") from None
    if not isinstance(obj, dict):
        raise ApiFailure(400, "BadRequest", "the body is not a JSON object")
    return obj


def _line(kind: str, obj: Obj) -> bytes:
    return json.dumps({"type": kind, "object": obj}).encode() + b"\n"


def _event_line(event: Event) -> bytes:
    return _line(event.type, _typed(event.resource, event.object))


async def _read_request(
    conn: h11.Connection, reader: asyncio.StreamReader
) -> tuple[h11.Request | None, bytes]:
    request: h11.Request | None = None
    body = bytearray()
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            data = await reader.read(65536)
            conn.receive_data(data)
            if not data and request is None:
                return None, b""
            continue
        if isinstance(event, h11.Request):
            request = event
        elif isinstance(event, h11.Data):
            body += event.data
            if len(body) > _MAX_BODY:
                raise h11.LocalProtocolError("body too large")
        elif isinstance(event, h11.EndOfMessage):
            return request, bytes(body)
        elif isinstance(event, h11.ConnectionClosed):
            return None, b""


async def _send(conn: h11.Connection, writer: asyncio.StreamWriter, event: h11.Event) -> None:
    data = conn.send(event)
    if data:
        writer.write(data)
        await writer.drain()


async def _send_json(
    conn: h11.Connection, writer: asyncio.StreamWriter, code: int, obj: Obj
) -> None:
    await _send_text(conn, writer, code, json.dumps(obj).encode(), "application/json")


async def _send_text(
    conn: h11.Connection,
    writer: asyncio.StreamWriter,
    code: int,
    data: bytes,
    content_type: str = "text/html",
) -> None:
    headers = [("Content-Type", content_type), ("Content-Length", str(len(data)))]
    await _send(conn, writer, h11.Response(status_code=code, headers=headers))
    await _send(conn, writer, h11.Data(data=data))
    await _send(conn, writer, h11.EndOfMessage())
