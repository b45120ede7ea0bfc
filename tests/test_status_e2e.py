"""/metrics, /healthz and /readyz of a serving runtime, and what bad clients get."""

from __future__ import annotations

import asyncio
import http.client
import socket
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from dp_server.cli import main
from dp_server.status import Check, StatusEndpoint

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
    assert runtime._timer is not None
    runtime._timer.cancel()
    await asyncio.sleep(0)
    status, _, body = await get(port, "/healthz")
    assert status == 503 and "timer loop has stopped" in body


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

    def two_requests() -> list[int]:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        statuses = []
        for path in ("/healthz", "/readyz", "/metrics"):
            connection.request("GET", path)
            response = connection.getresponse()
            response.read()
            statuses.append(response.status)
        connection.close()
        return statuses

    assert await asyncio.to_thread(two_requests) == [200, 200, 200]


async def test_a_stalled_client_is_cut_off_and_others_still_get_through() -> None:
    endpoint = StatusEndpoint(
        metrics=list,
        health=lambda: Check(True, "ok"),
        readiness=lambda: Check(True, "ok"),
        idle_timeout=0.2,
        max_clients=2,
    )
    await endpoint.start(*LOCAL)
    assert endpoint.address is not None
    port = endpoint.address[1]
    try:
        stalled = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
        await asyncio.sleep(0.05)
        # Both slots taken: a third client is closed at once, without an answer.
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        assert await asyncio.wait_for(reader.read(), 1) == b""
        writer.close()
        # The stalled ones are dropped after the idle timeout...
        for reader, writer in stalled:
            assert await asyncio.wait_for(reader.read(), 2) == b""
            writer.close()
        # ...and the endpoint answers again.
        assert (await get(port, "/healthz"))[:1] == (200,)
    finally:
        await endpoint.close()


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
