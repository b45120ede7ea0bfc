"""The queue that carries out BindDevice and UnbindDevice effects, with stand-ins
for the binder and the node."""

from __future__ import annotations

import asyncio
import threading

from dp_core import BindDevice, BindingFinished, Input, PciAddress
from dp_server.binding.queue import BindQueue


class SlowBinder:
    """Holds the first bind until released; records what it wrote."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.written: list[PciAddress] = []

    def on_vfio(self, address: PciAddress) -> bool:
        return False

    def move(self, address: PciAddress, driver: str | None) -> tuple[str | None, bool]:
        self.release.wait(5)
        self.written.append(address)
        return None, False


class AlwaysPlanned:
    def bind_planned(self, address: PciAddress, driver: str | None) -> bool:
        return True


def test_nothing_is_written_or_rescanned_once_stopping() -> None:
    """A stopping dp may be replaced by a new one at once: binds still waiting
    their turn are withdrawn unwritten, and no rescan follows the batch. The
    write already under way is reported, so the move reaches the moves file."""
    binder = SlowBinder()
    fed: list[Input] = []
    rescans: list[bool] = []
    stopping = False

    async def main() -> None:
        nonlocal stopping
        queue = BindQueue(
            binder,  # type: ignore[arg-type]
            AlwaysPlanned(),  # type: ignore[arg-type]
            fed.append,
            lambda: 0.0,
            lambda: stopping,
            lambda: rescans.append(stopping),
        )
        first = asyncio.ensure_future(
            queue.submit(BindDevice(PciAddress.parse("0000:01:00.0"), "i40e"))
        )
        second = asyncio.ensure_future(
            queue.submit(BindDevice(PciAddress.parse("0000:02:00.0"), "i40e"))
        )
        await asyncio.sleep(0.05)
        stopping = True
        binder.release.set()
        await asyncio.gather(first, second)

    asyncio.run(main())
    assert binder.written == [PciAddress.parse("0000:01:00.0")]
    assert fed == [BindingFinished(PciAddress.parse("0000:01:00.0"), None, 0.0)]
    assert rescans == []


def test_the_core_hears_back_and_the_host_is_scanned_after_a_batch() -> None:
    binder = SlowBinder()
    binder.release.set()
    fed: list[Input] = []
    rescans: list[int] = []

    async def main() -> None:
        queue = BindQueue(
            binder,  # type: ignore[arg-type]
            AlwaysPlanned(),  # type: ignore[arg-type]
            fed.append,
            lambda: 1.5,
            lambda: False,
            lambda: rescans.append(len(fed)),
        )
        addresses = [PciAddress.parse(f"0000:0{n}:00.0") for n in (1, 2)]
        await asyncio.gather(*(queue.submit(BindDevice(x, "i40e")) for x in addresses))

    asyncio.run(main())
    assert fed == [
        BindingFinished(PciAddress.parse("0000:01:00.0"), None, 1.5),
        BindingFinished(PciAddress.parse("0000:02:00.0"), None, 1.5),
    ]
    assert rescans == [2]  # once, after both
