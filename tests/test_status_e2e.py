"""/metrics, /healthz and /readyz of a serving runtime, and what bad clients get."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import logging
import socket
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from dp_core import MetricFamily, Sample
from dp_server.cli.main import main
from dp_server.loop.tasks import Tasks
from dp_server.monitoring.endpoint import StatusEndpoint, start_status
from dp_server.monitoring.exposition import metrics_registry
from dp_server.monitoring.probes import Check
from dp_server.monitoring.view import ServerView

from e2e_harness import ALL, GPU, Harness

LOCAL = ("127.0.0.1", 0)


async def request(port: int, raw: bytes, timeout: float = 5.0) -> tuple[int, dict[str, str], str]:
    """Send `raw` and read the whole answer (the server closes, or the request asked it to)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(raw)
        await writer.drain()
        data = await asyncio.wait_for(reader.read(), timeout)
    finally:
        writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode().split("\r\n")
    headers = {}
    for line in header_lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(status_line.split()[1]), headers, body.decode()


async def get(port: int, path: str, method: str = "GET") -> tuple[int, dict[str, str], str]:
    return await request(
        port, f"{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode()
    )


def samples(body: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(body)
        for s in family.samples
    }


def port_of(harness: Harness) -> int:
    assert harness.runtime is not None and harness.runtime.status_address is not None
    return harness.runtime.status_address[1]


async def test_metrics_report_devices_registrations_and_allocations(harness: Harness) -> None:
    await harness.serve(metrics_address=LOCAL)
    port = port_of(harness)
    await harness.kubelet("allocate", GPU, ["0000:af:00.0"])
    with pytest.raises(Exception, match="0000:00:00.0"):
        await harness.kubelet("allocate", GPU, ["0000:00:00.0"])
    status, headers, body = await get(port, "/metrics")
    assert status == 200
    assert headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    got = samples(body)
    for name in ALL:
        assert got["dp_resource_registration_phase", (("phase", "live"), ("resource", name))] == 1
        assert got["dp_registrations_total", (("resource", name), ("result", "ok"))] == 1
    gpu = (("resource", GPU),)
    assert got["dp_rpcs_total", (("code", "OK"), ("method", "Allocate"), *gpu)] == 1
    assert got["dp_rpcs_total", (("code", "INVALID_ARGUMENT"), ("method", "Allocate"), *gpu)] == 1
    assert got["dp_allocated_devices_total", gpu] == 1
    assert got["dp_resource_allocated_devices", gpu] == 1
    healthy = got["dp_resource_devices", (("health", "healthy"), *gpu)]
    unhealthy = got["dp_resource_devices", (("health", "unhealthy"), *gpu)]
    assert healthy + unhealthy == len(harness.emulator.resources()[GPU].devices)  # type: ignore[union-attr]
    assert got["dp_kubelet_starts_total", ()] == 1
    assert got["dp_host_scan_duration_seconds", ()] > 0
    assert got["process_resident_memory_bytes", ()] > 0
    assert got["process_cpu_seconds_total", ()] > 0  # prometheus-client's ProcessCollector
    # A kubelet restart shows in the counters.
    await harness.restart_kubelet()
    got = samples((await get(port, "/metrics"))[2])
    assert got["dp_kubelet_starts_total", ()] == 2
    assert got["dp_registrations_total", (("resource", GPU), ("result", "ok"))] == 2


async def test_readiness_waits_for_every_registration(harness: Harness) -> None:
    await harness.start_server(metrics_address=LOCAL)  # no kubelet yet
    port = port_of(harness)
    status, _, body = await get(port, "/readyz")
    assert status == 503
    assert f"{len(ALL)} of {len(ALL)} resources not registered" in body
    assert "(waiting)" in body
    assert (await get(port, "/healthz"))[0] == 200
    harness.start_kubelet()
    assert await harness.registered()
    status, _, body = await get(port, "/readyz")
    assert (status, body) == (200, f"ok: {len(ALL)} resources registered with the kubelet\n")


async def test_health_fails_when_the_timer_loop_is_gone(harness: Harness) -> None:
    runtime = await harness.serve(metrics_address=LOCAL)
    port = port_of(harness)
    status, _, body = await get(port, "/healthz")
    assert status == 200 and body.startswith("ok: last host scan")
    # The same server, seen through the one thing that changes once its timer
    # loop has ended: what `timer_stopped()` says.
    stopped = StoppedTimer(runtime)
    server = await start_status(stopped, LOCAL)
    assert server.address is not None
    try:
        status, _, body = await get(server.address[1], "/healthz")
        assert status == 503 and "timer loop has stopped" in body
    finally:
        await server.close()


class StoppedTimer:
    """A ServerView of `view` whose timer loop has ended."""

    def __init__(self, view: ServerView) -> None:
        self.node = view.node
        self.last_rescan = view.last_rescan
        self.rescan_failures = view.rescan_failures
        self.now = view.now
        self.frontends = view.frontends
        self.essential_tasks = view.essential_tasks

    def timer_stopped(self) -> bool:
        return True


async def test_essential_tasks_are_reported_and_one_that_ends_fails_liveness(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    runtime = await harness.serve(metrics_address=LOCAL)
    port = port_of(harness)
    got = samples((await get(port, "/metrics"))[2])
    assert got["dp_task_running", (("task", "timer-loop"),)] == 1
    assert got["dp_task_running", (("task", "file-watch"),)] == 1

    # What the runtime's Tasks record when one ends: the reason, logged.
    tasks = Tasks()

    async def broken() -> None:
        raise RuntimeError("lost its way")

    task = tasks.spawn(broken(), essential="publisher")
    await asyncio.gather(task, return_exceptions=True)
    assert tasks.ended == {"publisher": "RuntimeError: lost its way"}
    (logged,) = [r for r in caplog.records if r.getMessage() == "essential-task-ended"]
    assert getattr(logged, "dp_fields", {}) == {
        "task": "publisher",
        "reason": "RuntimeError: lost its way",
    }
    # Once dp is stopping, a task that ends is no failure.
    calm = Tasks(stopping=lambda: True)
    await asyncio.gather(calm.spawn(broken(), essential="publisher"), return_exceptions=True)
    assert calm.ended == {}

    ended = EndedTask(runtime, tasks.essential)
    server = await start_status(ended, LOCAL)
    assert server.address is not None
    try:
        status, _, body = await get(server.address[1], "/healthz")
        assert status == 503
        assert "publisher (RuntimeError: lost its way)" in body
        got = samples((await get(server.address[1], "/metrics"))[2])
        assert got["dp_task_running", (("task", "publisher"),)] == 0
    finally:
        await server.close()


class EndedTask(StoppedTimer):
    """A ServerView of `view` whose essential tasks are `tasks`."""

    def __init__(self, view: ServerView, tasks: dict[str, str]) -> None:
        super().__init__(view)
        self.essential_tasks = lambda: tasks

    def timer_stopped(self) -> bool:
        return False


async def test_bad_requests_get_4xx_and_the_server_keeps_serving(harness: Harness) -> None:
    await harness.serve(metrics_address=LOCAL)
    port = port_of(harness)
    status, headers, body = await request(port, b"\x16\x03\x01\x02\x00garbage\r\n\r\n")
    assert status == 400 and "bad request" in body and headers["connection"] == "close"
    status, _, body = await get(port, "/nope")
    assert status == 404 and "/metrics" in body
    status, headers, _ = await get(port, "/metrics", method="POST")
    assert status == 405 and headers["allow"] == "GET, HEAD"
    status, headers, body = await get(port, "/metrics", method="HEAD")
    assert status == 200 and body == "" and int(headers["content-length"]) > 1000
    huge = b"GET /metrics HTTP/1.1\r\nHost: x\r\nX: " + b"a" * 40_000 + b"\r\n\r\n"
    assert (await request(port, huge))[0] == 431
    # A client that hangs up mid-request costs nothing.
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /metr")
    writer.close()
    # Meanwhile the kubelet is served and /metrics still answers.
    response = await harness.kubelet("allocate", GPU, ["0000:af:00.0"])
    assert response.envs
    assert (await get(port, "/metrics"))[0] == 200


async def test_keep_alive_serves_several_requests_on_one_connection(harness: Harness) -> None:
    await harness.serve(metrics_address=LOCAL)
    port = port_of(harness)

    def three_requests() -> tuple[list[int], int]:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        statuses, sockets = [], set()
        for path in ("/healthz", "/readyz", "/metrics"):
            connection.request("GET", path)
            response = connection.getresponse()
            response.read()
            statuses.append(response.status)
            sockets.add(id(connection.sock))  # http.client reconnects silently otherwise
        connection.close()
        return statuses, len(sockets)

    assert await asyncio.to_thread(three_requests) == ([200, 200, 200], 1)


async def test_failing_host_scans_are_reported_but_do_not_fail_liveness(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    runtime = await harness.serve(metrics_address=LOCAL)
    port = port_of(harness)

    def broken_scan(*args: object, **kwargs: object) -> None:
        raise OSError("sysfs went away")

    monkeypatch.setattr("dp_server.runtime.runtime.scan_host", broken_scan)
    assert not runtime.try_rescan()  # what the timer loop does
    assert not runtime.try_rescan()
    # A restart would meet the same sysfs: the probe passes and says what failed.
    status, _, body = await get(port, "/healthz")
    assert status == 200 and "2 failed since start" in body
    got = samples((await get(port, "/metrics"))[2])
    assert got["dp_host_scan_failures_total", ()] == 2
    assert got["dp_host_scan_age_seconds", ()] >= 0
    # Everything else is still served from the last good scan.
    response = await harness.kubelet("allocate", GPU, ["0000:af:00.0"])
    assert response.envs


# -- the endpoint alone, against clients that misbehave -----------------------------


def big_metrics() -> list[MetricFamily]:
    samples = tuple(Sample((("i", str(i)),), i) for i in range(5000))
    return [MetricFamily("gauge", "dp_test_big", "Many samples.", samples)]


@contextlib.asynccontextmanager
async def endpoint(**kwargs: Any) -> AsyncIterator[tuple[StatusEndpoint, int]]:
    kwargs.setdefault("metrics", metrics_registry(big_metrics))
    kwargs.setdefault("health", lambda: Check(True, "ok"))
    kwargs.setdefault("readiness", lambda: Check(True, "ok"))
    server = StatusEndpoint(**kwargs)
    await server.start("127.0.0.1", 0)
    assert server.address is not None
    try:
        yield server, server.address[1]
    finally:
        await server.close()


async def eventually(predicate: Callable[[], bool], timeout: float) -> bool:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            return False
        await asyncio.sleep(0.01)
    return True


async def test_a_full_endpoint_pushes_out_its_oldest_client_so_probes_get_in() -> None:
    async with endpoint(request_timeout=30.0, max_clients=2) as (server, port):
        stalled = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
        assert await eventually(lambda: server.clients == 2, 5)
        # Both slots are held by clients that send nothing, for longer than any
        # probe waits; a probe still gets its answer, at once.
        # (Far below the 30 s a probe would wait if nobody were pushed out.)
        started = asyncio.get_running_loop().time()
        assert (await get(port, "/healthz"))[0] == 200
        assert asyncio.get_running_loop().time() - started < 10.0
        # To make room, the oldest was dropped.
        assert await asyncio.wait_for(stalled[0][0].read(), 1) == b""
        for _, writer in stalled:
            writer.close()


async def test_a_client_that_trickles_its_request_is_cut_off_at_the_deadline() -> None:
    async with endpoint(request_timeout=0.3) as (server, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        closed_by_server = asyncio.ensure_future(reader.read())  # b"" once the server hangs up
        request = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Padding: " + b"a" * 100
        for byte in request:  # one byte every 50 ms: never idle for long, never done
            if closed_by_server.done():
                break
            with contextlib.suppress(ConnectionError):
                writer.write(bytes([byte]))
                await writer.drain()
            await asyncio.sleep(0.05)
        assert closed_by_server.done(), "a request trickled in byte by byte was never cut off"
        assert await closed_by_server == b""
        writer.close()
        assert await eventually(lambda: server.clients == 0, 5)


async def test_a_client_that_never_reads_is_dropped_and_close_does_not_wait_for_it() -> None:
    async with endpoint(request_timeout=0.3) as (server, port):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", port))
        sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n" * 50)  # and never reads
        assert await eventually(lambda: server.clients == 1, 5)
        assert await eventually(lambda: server.clients == 0, 5), "the stalled reader was kept"
        sock.close()
    async with endpoint(request_timeout=30.0) as (server, port):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", port))
        sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n" * 50)
        assert await eventually(lambda: server.clients == 1, 5)
        await asyncio.sleep(0.2)  # its answers are stuck in the socket buffers now
        # Waiting for the stuck answers to drain would take the 30 s deadline.
        await asyncio.wait_for(server.close(), 10)
        assert server.clients == 0
        sock.close()


async def test_head_errors_and_failing_checks_are_answered_without_tracebacks(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def broken() -> Check:
        raise RuntimeError("no /proc here")

    async with endpoint(readiness=broken) as (server, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        # Two requests on one connection: the HEAD 404 must leave it usable.
        writer.write(b"HEAD /nope HTTP/1.1\r\nHost: x\r\n\r\n")
        writer.write(b"GET /readyz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        data = await asyncio.wait_for(reader.read(), 2)
        writer.close()
        first, _, rest = data.partition(b"\r\n\r\n")
        assert first.startswith(b"HTTP/1.1 404 ")
        assert rest.startswith(b"HTTP/1.1 500 ")
        assert rest.endswith(b"/readyz failed: RuntimeError('no /proc here')\n")
        # Clients still connected when the endpoint closes end quietly.
        still_open = [await asyncio.open_connection("127.0.0.1", port) for _ in range(3)]
        assert await eventually(lambda: server.clients == 3, 5), server.clients
    for _, open_writer in still_open:
        open_writer.close()
    unexpected = [r for r in caplog.records if r.levelno >= logging.ERROR and r.name == "asyncio"]
    assert unexpected == []
    (logged,) = [r for r in caplog.records if r.getMessage() == "status-failed"]
    assert logged.exc_info is not None


async def test_every_address_means_ipv4_and_ipv6() -> None:
    if not socket.has_ipv6:
        pytest.skip("this Python has no IPv6")
    server = StatusEndpoint(
        metrics=metrics_registry(list),
        health=lambda: Check(True, "ok"),
        readiness=lambda: Check(True, "ok"),
    )
    with socket.socket() as probe:  # port 0 would give each family its own port
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    await server.start(None, port)
    try:
        # The port was free on IPv4 only when picked; both families answer on it.
        assert (await get(port, "/healthz"))[0] == 200
        reader, writer = await asyncio.open_connection("::1", port)
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert (await asyncio.wait_for(reader.read(), 2)).startswith(b"HTTP/1.1 200 ")
        writer.close()
    finally:
        await server.close()


def test_serve_exits_with_a_message_when_the_metrics_port_is_taken(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        code = main(
            [
                "serve",
                "--sysfs",
                str(tmp_path / "sys"),
                "--dev",
                str(tmp_path / "dev"),
                "--device-plugin-dir",
                str(tmp_path / "dp"),
                "--metrics-address",
                f"127.0.0.1:{port}",
            ]
        )
    finally:
        taken.close()
    assert code == 2
    err = capsys.readouterr().err
    assert f"--metrics-address 127.0.0.1:{port}: cannot listen" in err
    assert not any(p.is_socket() for p in (tmp_path / "dp").glob("*")), "no socket left behind"


def test_serve_refuses_a_malformed_metrics_address(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--metrics-address", "9475"]) == 2
    assert "--metrics-address: '9475' is not HOST:PORT" in capsys.readouterr().err
