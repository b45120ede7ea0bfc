"""An HTTP endpoint for monitoring and probes, on the server's own event loop.

`GET /metrics` answers in Prometheus' text format, which prometheus-client
renders from a registry of the endpoint's own (dp's families beside its
process and platform collectors). `GET /healthz` says whether the server is
alive (for a liveness probe) and `GET /readyz` whether every resource is
registered with the kubelet (for a readiness probe, which makes a DaemonSet
rollout wait for each node). HTTP/1.1 is parsed by h11 on the running loop:
no thread and no HTTP server is added (prometheus-client's own are not used);
a client that stalls is cut off, and a malformed request gets a 4xx naming
what is wrong, without touching anything else the server does.

What is reported is read through `ServerView`, never from the runtime itself.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.metadata
import logging
from collections.abc import Callable

import attrs
import h11
from prometheus_client import CollectorRegistry

from dp_core import MetricFamily, Phase, Sample, collect
from dp_server.monitoring.exposition import CONTENT_TYPE, metrics_registry, render
from dp_server.monitoring.view import DraView, ServerView

__all__ = [
    "Check",
    "ServerView",
    "StatusEndpoint",
    "build_info",
    "runtime_families",
    "runtime_health",
    "runtime_readiness",
    "start_status",
]

_log = logging.getLogger("dp.status")

_READ_SIZE = 8192
_MAX_HEADER_BYTES = 16 * 1024
_TEXT = "text/plain; charset=utf-8"


@attrs.frozen
class Check:
    """The answer to a probe: whether it passes, and a line saying why."""

    ok: bool
    detail: str


@functools.cache
def build_info() -> MetricFamily:
    """dp_build_info: always 1, with the installed dp's version ("unknown" if not installed)."""
    try:
        version = importlib.metadata.version("dp")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    return MetricFamily(
        "gauge",
        "dp_build_info",
        "Always 1; the version label says which dp is running.",
        (Sample((("version", version),), 1),),
    )


@attrs.frozen
class _Route:
    check: Callable[[], Check] | None = None
    metrics: CollectorRegistry | None = None


class StatusEndpoint:
    """Serves `/metrics`, `/healthz` and `/readyz` until closed.

    `/metrics` renders what the `metrics` registry collects at that moment, in
    prometheus-client's text format; the probes answer what their checks say.

    A request must arrive whole within `request_timeout` of the connection
    opening or of the previous answer, and a client must take each answer
    within that time too; otherwise the connection is dropped. At most
    `max_clients` connections are kept: a new one pushes out the oldest, so
    stalled or slow clients can never keep a probe out.
    """

    def __init__(
        self,
        *,
        metrics: CollectorRegistry,
        health: Callable[[], Check],
        readiness: Callable[[], Check],
        request_timeout: float = 10.0,
        max_clients: int = 16,
    ) -> None:
        self._routes = {
            "/metrics": _Route(metrics=metrics),
            "/healthz": _Route(check=health),
            "/readyz": _Route(check=readiness),
        }
        self.request_timeout = request_timeout
        self.max_clients = max_clients
        self._server: asyncio.Server | None = None
        # Oldest first; a connection stays here until its task has ended.
        self._clients: dict[asyncio.Task[None], asyncio.StreamWriter] = {}
        self.address: tuple[str, int] | None = None

    @property
    def clients(self) -> int:
        return len(self._clients)

    async def start(self, host: str | None, port: int) -> None:
        """Listen on `host:port`; None: every address, IPv4 and IPv6. Port 0: any free one."""
        self._server = await asyncio.start_server(self._client, host, port)
        bound = self._server.sockets[0].getsockname()
        self.address = (bound[0], bound[1])
        shown = f"{host or '*'}:{bound[1]}"
        _log.info("status-listening", extra={"dp_fields": {"address": shown}})

    async def close(self) -> None:
        if self._server is None:
            return
        self._server.close()
        for task, writer in list(self._clients.items()):
            writer.transport.abort()
            task.cancel()
        await asyncio.gather(*self._clients, return_exceptions=True)
        await self._server.wait_closed()

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        if len(self._clients) >= self.max_clients:
            oldest, oldest_writer = next(iter(self._clients.items()))
            oldest_writer.transport.abort()
            oldest.cancel()
        self._clients[task] = writer
        finished = False
        try:
            await self._converse(reader, writer)
            finished = True
        except (OSError, TimeoutError, h11.ProtocolError):
            pass  # the peer went away, stalled or broke HTTP; nothing of ours is half-done
        except asyncio.CancelledError:
            pass  # closed or pushed out; this task is the connection's own, nobody awaits it
        finally:
            try:
                if finished:
                    writer.close()  # sends what is buffered (a last answer), then closes
                    await asyncio.wait_for(writer.wait_closed(), self.request_timeout)
            except (OSError, TimeoutError, asyncio.CancelledError):
                pass
            finally:
                writer.transport.abort()  # no-op once closed; never waits on the peer
                del self._clients[task]

    async def _converse(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=_MAX_HEADER_BYTES)
        deadline = loop.time() + self.request_timeout
        while True:
            try:
                event = conn.next_event()
            except h11.RemoteProtocolError as error:
                if conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
                    message = f"bad request: {error}\n"
                    await self._send(conn, writer, error.error_status_hint, message, close=True)
                return
            if event is h11.NEED_DATA:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise TimeoutError
                data = await asyncio.wait_for(reader.read(_READ_SIZE), remaining)
                conn.receive_data(data)
            elif isinstance(event, h11.Request):
                await self._answer(conn, writer, event)
            elif event is h11.PAUSED:
                if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                    return
                conn.start_next_cycle()
                deadline = loop.time() + self.request_timeout
            elif isinstance(event, h11.ConnectionClosed):
                return
            if conn.our_state is h11.MUST_CLOSE:
                return

    async def _answer(
        self, conn: h11.Connection, writer: asyncio.StreamWriter, request: h11.Request
    ) -> None:
        method = request.method.decode("ascii", "replace")
        head = method == "HEAD"
        path = request.target.decode("ascii", "replace").partition("?")[0]
        route = self._routes.get(path)
        if route is None:
            known = ", ".join(sorted(self._routes))
            text = f"no such path {path!r}; try {known}\n"
            await self._send(conn, writer, 404, text, head=head)
            return
        if method not in ("GET", "HEAD"):
            text = f"{method} is not allowed on {path}; use GET\n"
            await self._send(conn, writer, 405, text, allow=True)
            return
        try:
            if route.metrics is not None:
                status, body, content_type = 200, render(route.metrics), CONTENT_TYPE
            else:
                assert route.check is not None
                check = route.check()
                status, body = (200 if check.ok else 503), (check.detail + "\n").encode()
                content_type = _TEXT
        except Exception as error:  # noqa: BLE001 - answer it; the server goes on
            _log.exception("status-failed", extra={"dp_fields": {"path": path}})
            status, body, content_type = 500, f"{path} failed: {error!r}\n".encode(), _TEXT
        await self._send(conn, writer, status, body, content_type, head=head)

    async def _send(
        self,
        conn: h11.Connection,
        writer: asyncio.StreamWriter,
        status: int,
        body: str | bytes,
        content_type: str = _TEXT,
        *,
        head: bool = False,
        allow: bool = False,
        close: bool = False,
    ) -> None:
        payload = body.encode() if isinstance(body, str) else body
        headers = [
            ("content-type", content_type),
            ("content-length", str(len(payload))),
            ("cache-control", "no-store"),
        ]
        if allow:
            headers.append(("allow", "GET, HEAD"))
        if close:
            headers.append(("connection", "close"))
        writer.write(conn.send(h11.Response(status_code=status, headers=headers)))
        if not head:
            writer.write(conn.send(h11.Data(data=payload)))
        writer.write(conn.send(h11.EndOfMessage()))
        await asyncio.wait_for(writer.drain(), self.request_timeout)


# -- what the serving process reports ---------------------------------------------


def runtime_health(view: ServerView) -> Check:
    # Only what a restart can mend fails the probe. Host scans that keep
    # failing would fail again after a restart, and the node would lose its
    # resources meanwhile; they show in the log and in the scan metrics.
    if view.timer_stopped():
        return Check(False, "the timer loop has stopped: no rescans, ticks or re-registrations")
    # A task that meets outages by retrying inside has ended: a bug, which a
    # restart cures. An outage never ends one, so it never fails this probe.
    ended = {name: why for name, why in view.essential_tasks().items() if why}
    if ended:
        shown = "; ".join(f"{name} ({why})" for name, why in sorted(ended.items()))
        return Check(False, f"a task dp cannot work without has ended: {shown}")
    # CDI specs that cannot be written do not fail it either: a restart would
    # not make the directory writable, and Allocate works without them.
    cdi = view.node.cdi
    specs = f"; CDI specs not in place: {cdi.problem}" if cdi is not None and cdi.problem else ""
    if view.last_rescan is None:
        return Check(True, f"ok: starting{specs}")
    age = view.now() - view.last_rescan[0]
    failing = f", {view.rescan_failures} failed since start" if view.rescan_failures else ""
    return Check(True, f"ok: last host scan {age:.1f} s ago{failing}{specs}")


def _dra(view: ServerView) -> DraView | None:
    return view.dra


def _dra_readiness(view: ServerView) -> str | None:
    """Why the DRA front end is not ready, or None when it is (or is off)."""
    dra = _dra(view)
    if dra is None or dra.ready:
        return None
    said = dra.registration()
    if said is None:
        return f"DRA driver {dra.driver} not registered: the kubelet has not said it registered it"
    if not said[0]:
        return f"DRA driver {dra.driver} not registered: the kubelet said: {said[1]}"
    return f"DRA driver {dra.driver} not registered: its sockets are not listening"


def runtime_readiness(view: ServerView) -> Check:
    phases = view.node.registrar.phases()
    pending = sorted(name for name, phase in phases.items() if phase is not Phase.LIVE)
    dra = _dra_readiness(view)
    if dra is not None:
        return Check(False, dra)
    if not pending:
        on = _dra(view)
        driver = f" and DRA driver {on.driver}" if on is not None else ""
        return Check(True, f"ok: {len(phases)} resources{driver} registered with the kubelet")
    shown = ", ".join(f"{name} ({phases[name].value})" for name in pending[:8])
    more = f" and {len(pending) - 8} more" if len(pending) > 8 else ""
    return Check(False, f"{len(pending)} of {len(phases)} resources not registered: {shown}{more}")


def runtime_families(view: ServerView) -> list[MetricFamily]:
    """dp's own families: the core's, the shell's host scans, and dp_build_info.

    The `process_*` metrics are not here: prometheus-client's ProcessCollector
    adds them in the registry `start_status` builds.
    """
    shell = [
        MetricFamily(
            "counter",
            "dp_host_scan_failures_total",
            "Host scans that raised instead of finishing (each logged as rescan-failed).",
            (Sample((), view.rescan_failures),),
        )
    ]
    if view.last_rescan is not None:
        when, took = view.last_rescan
        shell.append(
            MetricFamily(
                "gauge",
                "dp_host_scan_duration_seconds",
                "How long reading sysfs and /dev took in the last host scan that finished.",
                (Sample((), round(took, 6)),),
            )
        )
        shell.append(
            MetricFamily(
                "gauge",
                "dp_host_scan_age_seconds",
                "Seconds since the last host scan that finished.",
                (Sample((), round(view.now() - when, 3)),),
            )
        )
    tasks = view.essential_tasks()
    if tasks:
        shell.append(
            MetricFamily(
                "gauge",
                "dp_task_running",
                "1 while a task dp cannot work without runs, 0 once it has ended "
                "(logged as essential-task-ended; /healthz fails).",
                tuple(
                    Sample((("task", name),), 0 if why else 1)
                    for name, why in sorted(tasks.items())
                ),
            )
        )
    on = _dra(view)
    dra = list(on.families()) if on is not None else []
    return [*collect(view.node), *shell, *dra, build_info()]


async def start_status(view: ServerView, address: tuple[str | None, int]) -> StatusEndpoint:
    """Serve `view`'s metrics and probes on `address`, on the running loop."""
    endpoint = StatusEndpoint(
        metrics=metrics_registry(lambda: runtime_families(view)),
        health=lambda: runtime_health(view),
        readiness=lambda: runtime_readiness(view),
    )
    await endpoint.start(*address)
    return endpoint
