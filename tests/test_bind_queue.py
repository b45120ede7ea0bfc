"""The queue that carries out BindDevice and UnbindDevice effects, with stand-ins
for the binder and the core."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

from dp_core import BindDevice, BindingFinished, Input, PciAddress, WriteDecided, WriteDue
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


class Decides:
    """Answers each `WriteDue` as `planned` says; records what was asked."""

    def __init__(self, planned: Callable[[PciAddress], bool] = lambda address: True) -> None:
        self.planned = planned
        self.asked: list[WriteDue] = []

    def __call__(self, make: Callable[[int], Input]) -> WriteDecided:
        due = make(len(self.asked) + 1)
        assert isinstance(due, WriteDue)
        self.asked.append(due)
        return WriteDecided(due.call, carry_out=self.planned(due.write.address))


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
            Decides(),
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
            Decides(),
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


def test_a_write_the_core_withdraws_when_its_turn_comes_is_neither_written_nor_reported() -> None:
    """The core withdraws it itself (`WriteDecided(carry_out=False)`): the queue
    writes nothing and feeds nothing for it, and the next write still goes."""
    binder = SlowBinder()
    binder.release.set()
    fed: list[Input] = []
    rescans: list[int] = []
    first, second = PciAddress.parse("0000:01:00.0"), PciAddress.parse("0000:02:00.0")
    core = Decides(lambda address: address != first)

    async def main() -> None:
        queue = BindQueue(
            binder,  # type: ignore[arg-type]
            core,
            fed.append,
            lambda: 2.5,
            lambda: False,
            lambda: rescans.append(len(fed)),
        )
        await asyncio.gather(*(queue.submit(BindDevice(x, "i40e")) for x in (first, second)))

    asyncio.run(main())
    assert [(due.write, due.now) for due in core.asked] == [
        (BindDevice(first, "i40e"), 2.5),
        (BindDevice(second, "i40e"), 2.5),
    ]
    assert binder.written == [second]
    assert fed == [BindingFinished(second, None, 2.5)]
    assert rescans == [1]
