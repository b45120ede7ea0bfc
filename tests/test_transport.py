"""The connection layer under grpclib: coalesced writes and the sweep of finished calls."""

from __future__ import annotations

import asyncio
import gc

import pytest

from dp_server import runtime, transport, unary
from dp_server.emulator._rpc import dp
from dp_server.transport import CoalescingTransport

from e2e_harness import ALL, GPU, Harness, RecordingTransport, live, served_protocol

pytestmark = pytest.mark.asyncio


async def test_writes_of_one_loop_turn_go_out_as_one_send() -> None:
    raw = RecordingTransport()
    transport = CoalescingTransport(raw)
    transport.write(b"headers")
    transport.write(b"")
    transport.write(bytearray(b"message"))
    transport.write(memoryview(b"trailers"))
    assert raw.sent == []
    await asyncio.sleep(0)
    assert raw.sent == [b"headersmessagetrailers"]
    transport.write(b"next")
    await asyncio.sleep(0)
    assert raw.sent == [b"headersmessagetrailers", b"next"]
    assert transport.get_extra_info("peername") == "kubelet"


async def test_close_sends_what_is_pending_first() -> None:
    raw = RecordingTransport()
    transport = CoalescingTransport(raw)
    transport.write(b"goaway")
    transport.close()
    assert raw.sent == [b"goaway"] and raw.closed
    await asyncio.sleep(0)  # the scheduled flush finds nothing left to send
    assert raw.sent == [b"goaway"]


async def test_abort_drops_pending_and_nothing_is_sent_after_it() -> None:
    raw = RecordingTransport()
    transport = CoalescingTransport(raw)
    transport.write(b"late")
    transport.abort()
    await asyncio.sleep(0)
    assert raw.sent == [] and raw.aborted


async def test_finished_calls_are_not_kept(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every call through grpclib's handler, rather than answered whole.
    monkeypatch.setattr(unary, "whole_calls", lambda events, answers: {})
    runtime = await harness.serve()
    for _ in range(25):
        await harness.kubelet("call", GPU, "GetDevicePluginOptions", dp.Empty())
    handlers = [h for server in runtime._sockets.servers for h in server._handlers]
    assert handlers
    # Each connection holds its ListAndWatch at most: no finished call is kept.
    assert max(len(handler._tasks) for handler in handlers) <= 1


async def test_a_connection_remembers_a_bounded_number_of_closed_streams(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(transport, "CLOSED_STREAMS_KEPT", 8)
    await harness.serve()
    for _ in range(30):
        options = await harness.kubelet("call", GPU, "GetDevicePluginOptions", dp.Empty())
        assert options.get_preferred_allocation_available
    protocols = live(transport._TrackedProtocol)
    h2_connections = [p.connection._connection for p in protocols if p.connection is not None]
    busiest = max(h2_connections, key=lambda c: c.highest_inbound_stream_id)
    assert busiest.highest_inbound_stream_id > 2 * 30  # client streams are odd: 30+ calls
    assert 0 < len(busiest._closed_streams) <= 8


async def test_kubelet_restarts_leave_no_dead_connections_behind(harness: Harness) -> None:
    await harness.serve()
    for _ in range(3):
        await harness.restart_kubelet()
    # One handler per live kubelet connection, once the server has collected
    # what the restarts dropped.
    for _ in range(50):
        if len(live(transport._Handler)) == len(ALL):
            break
        await asyncio.sleep(0.1)
    assert len(live(transport._Handler)) == len(ALL)


async def test_a_restarted_kubelet_finds_its_old_connections_already_freed(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The new connections should reuse the memory of the old ones, not add to
    # the high-water mark: the old ones must be collected as soon as the last
    # of them closes, not by the collection a second after re-registering (put
    # out of reach here) nor by the automatic one (off during the test).
    monkeypatch.setattr(runtime, "_COLLECT_AFTER_REGISTRATION", 3600.0)
    await harness.serve()
    gc.collect()
    gc.disable()
    try:
        await harness.restart_kubelet()
        assert len(live(transport._Handler)) == len(ALL)
    finally:
        gc.enable()


async def test_a_connections_settings_take_a_tenth_of_the_room_and_still_apply() -> None:
    import sys

    import h2.config
    import h2.connection
    import h2.settings

    protocol, sent = served_protocol({})
    connection = protocol.connection._connection
    stores = [connection.local_settings._settings, connection.remote_settings._settings]
    room = sum(sys.getsizeof(values) for store in stores for values in store.values())
    assert room < 2_000  # h2's deques: 10,640 bytes
    # Our SETTINGS await the client's ACK; the client's change applies on receipt.
    window = h2.settings.SettingCodes.INITIAL_WINDOW_SIZE
    assert list(connection.local_settings._settings[window]) == [65_535, 4_194_304]
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    client.initiate_connection()
    client.update_settings({window: 40})
    client.receive_data(b"".join(sent.sent))
    protocol.data_received(client.data_to_send())
    assert connection.remote_settings.initial_window_size == 40
    assert list(connection.local_settings._settings[window]) == [4_194_304]
    assert connection.local_settings.initial_window_size == 4_194_304
    protocol.connection_lost(None)
