"""The transport's reads, from two event loops in two threads at once: each
connection must only ever see its own peer's bytes."""

from __future__ import annotations

import asyncio
import socket
import threading

from dp_server import transport


class Probe(transport._CoalescingProtocol):
    """The transport's reading (get_buffer, buffer_updated), counting bytes not its peer's."""

    def __init__(self, mine: int, foreign: list[int]) -> None:
        self.mine, self.foreign = mine, foreign

    def connection_made(self, raw: asyncio.BaseTransport) -> None:
        pass

    def data_received(self, data: bytes) -> None:
        self.foreign[0] += len(data) - data.count(self.mine)

    def connection_lost(self, exc: BaseException | None) -> None:
        pass


def serve(mine: int, foreign: list[int], seconds: float) -> None:
    async def main() -> None:
        ours, peer = socket.socketpair()
        stop = threading.Event()

        def pump() -> None:
            block = bytes([mine]) * 65536
            try:
                while not stop.is_set():
                    peer.sendall(block)
            except OSError:
                pass  # closed at the end

        writer = threading.Thread(target=pump, daemon=True)
        writer.start()
        raw, _ = await asyncio.get_running_loop().connect_accepted_socket(
            lambda: Probe(mine, foreign), ours
        )
        await asyncio.sleep(seconds)
        stop.set()
        raw.close()
        await asyncio.sleep(0)
        writer.join()
        peer.close()

    asyncio.run(main())


def test_two_loops_in_two_threads_each_read_only_their_own_bytes() -> None:
    foreign = {ord("A"): [0], ord("B"): [0]}
    threads = [
        threading.Thread(target=serve, args=(mine, counts, 0.5)) for mine, counts in foreign.items()
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert {chr(k): v[0] for k, v in foreign.items()} == {"A": 0, "B": 0}
