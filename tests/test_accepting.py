"""Connections started in the callback that accepts them (dp_server.accepting)."""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from dp_server import accepting, transport

pytestmark = pytest.mark.asyncio


class TurnCounter:
    """Counts turns of the running loop: a callback that schedules itself again."""

    def __init__(self) -> None:
        self.turn = 0
        self._loop = asyncio.get_running_loop()
        self._handle = self._loop.call_soon(self._tick)

    def _tick(self) -> None:
        self.turn += 1
        self._handle = self._loop.call_soon(self._tick)

    def stop(self) -> None:
        self._handle.cancel()


class Recorded(asyncio.Protocol):
    def __init__(self, started: list[Any], greeting: bytes = b"") -> None:
        self.started = started
        self.greeting = greeting
        self.lost: list[BaseException | None] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.WriteTransport)
        self.started.append(transport)
        if self.greeting:
            transport.write(self.greeting)

    def connection_lost(self, exc: BaseException | None) -> None:
        self.lost.append(exc)


def dial(path: Path) -> socket.socket:
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    client.connect(str(path))
    client.setblocking(False)
    return client


async def received(client: socket.socket, timeout: float = 2.0) -> bytes:
    loop = asyncio.get_running_loop()
    return await asyncio.wait_for(loop.sock_recv(client, 4096), timeout)


@pytest.fixture
def short_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    # Unix socket paths are limited to 108 bytes.
    yield tmp_path_factory.mktemp("acc")


async def serve(
    path: Path,
    factory: Callable[[], asyncio.BaseProtocol],
    accepting_on: Callable[[socket.socket], Any] = lambda sock: sock,
) -> asyncio.AbstractServer:
    """An asyncio server on `path` whose connections `accept_at_once` starts,
    accepting through what `accepting_on` makes of the listening socket."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    server = await asyncio.get_running_loop().create_unix_server(factory, sock=sock)
    assert accepting.accept_at_once(server, accepting_on(sock), factory)
    return server


async def test_the_plugin_servers_settings_go_out_in_the_turn_that_accepts(
    short_dir: Path,
) -> None:
    """The kubelet sends no call before our SETTINGS: they leave in the turn
    the connection is accepted, not two or three turns later."""
    path = short_dir / "p.sock"
    made_at: list[int] = []
    counter = TurnCounter()
    tracker = transport.ConnectionTracker(
        lambda made, listener: made_at.append(counter.turn) or 1, lambda connection: None
    )
    server = transport.TrackedServer([], tracker, None, {})
    await server.start_unix(str(path))
    try:
        client = dial(path)
        dialled_at = counter.turn
        settings = await received(client)
        # A HEADERS-free SETTINGS frame (type 4) on stream 0 is the first thing sent.
        assert settings[3] == 0x4 and settings[5:9] == b"\0\0\0\0"
        # Accepted in the turn after the dial at the latest, and started in that one.
        assert made_at and made_at[0] - dialled_at <= 1
        client.close()
    finally:
        counter.stop()
        server.close()
        await server.wait_closed()


async def test_each_connection_is_accepted_and_served(short_dir: Path) -> None:
    path = short_dir / "p.sock"
    started: list[Any] = []
    server = await serve(path, lambda: Recorded(started, b"hello"))
    try:
        clients = [dial(path) for _ in range(5)]
        for client in clients:
            assert await received(client) == b"hello"
        assert len(started) == 5
        # The transports are asyncio's, with the peer's address as asyncio gives it.
        assert all(t.get_extra_info("peername") == "" for t in started)
    finally:
        for client in clients:
            client.close()
        server.close()
        await server.wait_closed()


class RunsOutOfDescriptors:
    """A listening socket whose first accept fails as when the process is out of fds."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self.failures = 0

    def accept(self) -> tuple[socket.socket, Any]:
        if not self.failures:
            self.failures += 1
            raise OSError(errno.EMFILE, "Too many open files")
        return self._sock.accept()

    def fileno(self) -> int:
        return self._sock.fileno()

    def getsockname(self) -> Any:
        return self._sock.getsockname()


async def test_out_of_descriptors_pauses_accepting_then_resumes(
    short_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(accepting, "RETRY_AFTER_EXHAUSTION", 0.05)
    caplog.set_level(logging.WARNING, logger="dp.transport")
    path = short_dir / "p.sock"
    started: list[Any] = []
    listeners: list[RunsOutOfDescriptors] = []

    def flaky_listener(sock: socket.socket) -> RunsOutOfDescriptors:
        listeners.append(RunsOutOfDescriptors(sock))
        return listeners[0]

    server = await serve(path, lambda: Recorded(started, b"late"), flaky_listener)
    [flaky] = listeners
    try:
        client = dial(path)
        await asyncio.sleep(0.01)
        # Failed once, and not tried again at once: no busy loop on a readable socket.
        assert flaky.failures == 1 and not started
        assert await received(client) == b"late"
        failures = [r for r in caplog.records if r.getMessage() == "accept-failed"]
        assert len(failures) == 1
        assert "Too many open files" in failures[0].dp_fields["error"]  # type: ignore[attr-defined]
        assert str(path) in failures[0].dp_fields["socket"]  # type: ignore[attr-defined]
        client.close()
    finally:
        server.close()
        await server.wait_closed()


async def test_a_connection_that_fails_to_start_is_closed_and_others_are_served(
    short_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="dp.transport")
    path = short_dir / "p.sock"
    started: list[Any] = []
    broken: list[Recorded] = []

    class FailsToStart(Recorded):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            raise RuntimeError("cannot start")

    def factory() -> asyncio.BaseProtocol:
        if not broken:
            broken.append(FailsToStart(started))
            return broken[0]
        return Recorded(started, b"served")

    server = await serve(path, factory)
    try:
        first = dial(path)
        assert await received(first) == b""  # closed by the server
        second = dial(path)
        assert await received(second) == b"served"
        # The protocol that failed hears nothing more of its connection.
        await asyncio.sleep(0.01)
        assert broken[0].lost == []
        warnings = [r for r in caplog.records if r.getMessage() == "connection-start-failed"]
        assert len(warnings) == 1 and "cannot start" in warnings[0].dp_fields["error"]  # type: ignore[attr-defined]
        first.close()
        second.close()
    finally:
        server.close()
        await server.wait_closed()


async def test_a_closed_server_accepts_nothing_more(short_dir: Path) -> None:
    path = short_dir / "p.sock"
    started: list[Any] = []
    server = await serve(path, lambda: Recorded(started))
    server.close()
    await server.wait_closed()
    with pytest.raises(OSError):
        dial(path)
    assert started == []
