"""An HTTP endpoint for monitoring and probes, on the server's own event loop.

`GET /metrics` answers in Prometheus' text format, `GET /healthz` says whether
the server is alive (for a liveness probe) and `GET /readyz` whether every
resource is registered with the kubelet (for a readiness probe, which makes a
DaemonSet rollout wait for each node). HTTP/1.1 is parsed by h11, so no thread
and no HTTP server package is added; a client that stalls is cut off, and a
malformed request gets a 4xx naming what is wrong, without touching anything
else the server does.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import resource
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Literal

import attrs
import h11

from dp_core import MetricFamily, Phase, Sample, collect

from .__main__ import _installed_version
from .exposition import CONTENT_TYPE, render

if TYPE_CHECKING:
    from .runtime import Runtime

__all__ = [
    "Check",
    "StatusEndpoint",
    "parse_address",
    "process_families",
    "runtime_health",
    "runtime_readiness",
    "start_status",
]

_log = logging.getLogger("dp.status")

_CLK_TCK = os.sysconf("SC_CLK_TCK")
_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")
_READ_SIZE = 8192
_MAX_HEADER_BYTES = 16 * 1024


@attrs.frozen
class Check:
    """The answer to a probe: whether it passes, and a line saying why."""

    ok: bool
    detail: str


def parse_address(text: str) -> tuple[str, int]:
    """`host:port`, `:port` (every interface) or `[v6]:port`, as (host, port)."""
    host, sep, port_text = text.rpartition(":")
    if not sep or not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ValueError(f"{text!r} is not HOST:PORT (for example :9475 or 127.0.0.1:9475)")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ValueError(f"{text!r}: write an IPv6 host in brackets, as [{host}]:{port_text}")
    return host or "0.0.0.0", int(port_text)  # noqa: S104 - the operator's choice; documented


def _boot_time() -> float:
    with open("/proc/stat", encoding="ascii") as stat:
        for line in stat:
            if line.startswith("btime "):
                return float(line.split()[1])
    raise OSError("/proc/stat has no btime line")


def process_families() -> list[MetricFamily]:
    """The standard `process_*` metrics of this process, read from /proc."""
    with open("/proc/self/stat", encoding="ascii") as stat:
        # The command name, in parentheses, may hold spaces; the fields follow it.
        fields = stat.read().rpartition(")")[2].split()
    utime, stime = int(fields[11]), int(fields[12])
    threads, start_ticks = int(fields[17]), int(fields[19])
    virtual, resident_pages = int(fields[20]), int(fields[21])
    soft_fds, _ = resource.getrlimit(resource.RLIMIT_NOFILE)

    def one(kind: Literal["gauge", "counter"], name: str, text: str, value: float) -> MetricFamily:
        return MetricFamily(kind, name, text, (Sample((), value),))

    return [
        one(
            "counter",
            "process_cpu_seconds_total",
            "User and system CPU time spent in seconds.",
            (utime + stime) / _CLK_TCK,
        ),
        one(
            "gauge",
            "process_resident_memory_bytes",
            "Resident memory size in bytes.",
            resident_pages * _PAGE_SIZE,
        ),
        one("gauge", "process_virtual_memory_bytes", "Virtual memory size in bytes.", virtual),
        one(
            "gauge",
            "process_start_time_seconds",
            "Start time of the process since unix epoch in seconds.",
            _boot_time() + start_ticks / _CLK_TCK,
        ),
        one(
            "gauge",
            "process_open_fds",
            "Number of open file descriptors.",
            len(os.listdir("/proc/self/fd")),
        ),
        one("gauge", "process_max_fds", "Maximum number of open file descriptors.", soft_fds),
        one("gauge", "process_threads", "Number of OS threads in the process.", threads),
    ]


@functools.cache
def build_info() -> MetricFamily:
    # Not importlib.metadata: the server keeps it (and what it imports) unloaded.
    version = _installed_version("dp") or "unknown"
    return MetricFamily(
        "gauge",
        "dp_build_info",
        "Always 1; the version label says which dp is running.",
        (Sample((("version", version),), 1),),
    )


@attrs.frozen
class _Route:
    check: Callable[[], Check] | None = None
    metrics: Callable[[], Iterable[MetricFamily]] | None = None


class StatusEndpoint:
    """Serves `/metrics`, `/healthz` and `/readyz` until closed."""

    def __init__(
        self,
        *,
        metrics: Callable[[], Iterable[MetricFamily]],
        health: Callable[[], Check],
        readiness: Callable[[], Check],
        idle_timeout: float = 10.0,
        max_clients: int = 16,
    ) -> None:
        self._routes = {
            "/metrics": _Route(metrics=metrics),
            "/healthz": _Route(check=health),
            "/readyz": _Route(check=readiness),
        }
        self.idle_timeout = idle_timeout
        self.max_clients = max_clients
        self._server: asyncio.Server | None = None
        self._clients: set[asyncio.Task[None]] = set()
        self.address: tuple[str, int] | None = None

    async def start(self, host: str, port: int) -> None:
        """Listen on `host:port` (port 0: any free port; `address` says which)."""
        self._server = await asyncio.start_server(self._client, host, port)
        bound = self._server.sockets[0].getsockname()
        self.address = (bound[0], bound[1])
        _log.info("status-listening", extra={"dp_fields": {"address": f"{host}:{bound[1]}"}})

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for task in list(self._clients):
                task.cancel()
            await asyncio.gather(*self._clients, return_exceptions=True)
            await self._server.wait_closed()

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        try:
            if len(self._clients) >= self.max_clients:
                return  # closed at once: a monitoring endpoint is no reason to run out of fds
            self._clients.add(task)
            await self._converse(reader, writer)
        except (OSError, TimeoutError):
            pass  # the peer went away or stalled; nothing of ours is left half-done
        finally:
            self._clients.discard(task)
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    async def _converse(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=_MAX_HEADER_BYTES)
        while True:
            try:
                event = conn.next_event()
            except h11.RemoteProtocolError as error:
                if conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
                    await self._send(
                        conn, writer, error.error_status_hint, f"bad request: {error}\n", close=True
                    )
                return
            if event is h11.NEED_DATA:
                data = await asyncio.wait_for(reader.read(_READ_SIZE), self.idle_timeout)
                conn.receive_data(data)
            elif isinstance(event, h11.Request):
                await self._answer(conn, writer, event)
            elif event is h11.PAUSED:
                if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                    return
                conn.start_next_cycle()
            elif isinstance(event, h11.ConnectionClosed):
                return
            if conn.our_state is h11.MUST_CLOSE:
                return

    async def _answer(
        self, conn: h11.Connection, writer: asyncio.StreamWriter, request: h11.Request
    ) -> None:
        method = request.method.decode("ascii", "replace")
        path = request.target.decode("ascii", "replace").partition("?")[0]
        route = self._routes.get(path)
        if route is None:
            known = ", ".join(sorted(self._routes))
            await self._send(conn, writer, 404, f"no such path {path!r}; try {known}\n")
        elif method not in ("GET", "HEAD"):
            await self._send(
                conn, writer, 405, f"{method} is not allowed on {path}; use GET\n", allow=True
            )
        elif route.metrics is not None:
            body = render(route.metrics())
            await self._send(conn, writer, 200, body, CONTENT_TYPE, head=method == "HEAD")
        else:
            assert route.check is not None
            check = route.check()
            await self._send(
                conn, writer, 200 if check.ok else 503, check.detail + "\n", head=method == "HEAD"
            )

    async def _send(
        self,
        conn: h11.Connection,
        writer: asyncio.StreamWriter,
        status: int,
        body: str | bytes,
        content_type: str = "text/plain; charset=utf-8",
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
        await asyncio.wait_for(writer.drain(), self.idle_timeout)


# -- what the serving process reports ---------------------------------------------

#: A host scan older than this many rescan intervals (plus a margin for a slow
#: sysfs) means the timer loop or the scanner is stuck: worth a restart.
_STALE_SCANS = 3
_STALE_MARGIN = 30.0


def runtime_health(runtime: Runtime) -> Check:
    if runtime.timer_stopped():
        return Check(False, "the timer loop has stopped: no rescans, ticks or re-registrations")
    if runtime.last_rescan is None:
        return Check(True, "ok: starting")
    age = runtime.now() - runtime.last_rescan[0]
    limit = _STALE_SCANS * runtime.settings.rescan_interval + _STALE_MARGIN
    if age > limit:
        return Check(
            False,
            f"the last host scan that succeeded was {age:.0f} s ago, with a scan due every "
            f"{runtime.settings.rescan_interval:g} s; see the rescan-failed log lines",
        )
    return Check(True, f"ok: last host scan {age:.1f} s ago")


def runtime_readiness(runtime: Runtime) -> Check:
    phases = runtime.node.registrar.phases()
    pending = sorted(name for name, phase in phases.items() if phase is not Phase.LIVE)
    if not pending:
        return Check(True, f"ok: {len(phases)} resources registered with the kubelet")
    shown = ", ".join(f"{name} ({phases[name].value})" for name in pending[:8])
    more = f" and {len(pending) - 8} more" if len(pending) > 8 else ""
    return Check(False, f"{len(pending)} of {len(phases)} resources not registered: {shown}{more}")


def runtime_families(runtime: Runtime) -> list[MetricFamily]:
    shell = []
    if runtime.last_rescan is not None:
        shell.append(
            MetricFamily(
                "gauge",
                "dp_host_scan_duration_seconds",
                "How long the last host scan (sysfs and /dev) took.",
                (Sample((), round(runtime.last_rescan[1], 6)),),
            )
        )
    return [*collect(runtime.node), *shell, *process_families(), build_info()]


async def start_status(runtime: Runtime, address: tuple[str, int]) -> StatusEndpoint:
    endpoint = StatusEndpoint(
        metrics=lambda: runtime_families(runtime),
        health=lambda: runtime_health(runtime),
        readiness=lambda: runtime_readiness(runtime),
    )
    await endpoint.start(*address)
    return endpoint
