"""The static front end's core: a fixed list of consumers, each wanting a
fixed list of PCI functions, whose IOMMU groups it holds in the node's ledger
while the consumer runs. Nothing here does I/O."""

from __future__ import annotations

from collections.abc import Callable, Collection, Hashable, Mapping, Sequence
from typing import Any

import attrs

from dp_core import Ledger, Log, MetricFamily, Outcome, PciAddress, World
from dp_core.frontend import Handler
from dp_core.host.snapshot import HostSnapshot
from dp_core.metric import family

NAME = "static"


@attrs.frozen
class ConsumerStarted:
    consumer: str
    now: float


@attrs.frozen
class ConsumerStopped:
    consumer: str
    now: float


@attrs.frozen
class ConsumerHanded:
    """The consumer has its devices: give them to it."""

    consumer: str
    devices: tuple[str, ...]
    groups: tuple[int, ...]


@attrs.frozen
class ConsumerRefused:
    consumer: str
    reason: str


@attrs.frozen
class ConsumerHold:
    """A consumer's hold on the ledger."""

    consumer: str
    device_ids: tuple[str, ...]
    groups: tuple[int, ...]

    @property
    def key(self) -> Hashable:
        return (NAME, self.consumer)

    @property
    def frontend(self) -> str:
        return NAME

    @property
    def owner(self) -> str:
        return NAME

    def describe(self) -> str:
        return f"static consumer {self.consumer}"


Effect = ConsumerHanded | ConsumerRefused | Log
Done = Outcome[Effect]


def _unclocked(step: Callable[[Any], Done]) -> Handler[Effect]:
    def handle(event: Any, now: float) -> Done:
        return step(event)

    return handle


class StaticFrontend:
    """Holds `consumers`' devices (consumer -> PCI addresses) while they run."""

    def __init__(self, ledger: Ledger, consumers: Mapping[str, Sequence[str]]) -> None:
        self._ledger = ledger
        self._consumers = {name: tuple(devices) for name, devices in consumers.items()}
        self._snapshot = HostSnapshot()
        self.handed = 0  # consumers given their devices, since start

    # -- as a front end ----------------------------------------------------------

    @property
    def name(self) -> str:
        return NAME

    @property
    def holders_known(self) -> bool:
        return True

    def handlers(self) -> Mapping[type, Handler[Effect]]:
        steps: dict[type, Callable[[Any], Done]] = {
            ConsumerStarted: self._started,
            ConsumerStopped: self._stopped,
        }
        return {kind: _unclocked(step) for kind, step in steps.items()}

    def world_changed(self, world: World) -> Done:
        self._snapshot = world.snapshot
        return Outcome()

    def holders_changed(self, groups: Collection[int]) -> Sequence[Effect]:
        return ()

    def holders_wanted(self) -> Sequence[Effect]:
        return ()

    def due(self, now: float) -> Sequence[Effect]:
        return ()

    def next_deadline(self) -> float | None:
        return None

    def metrics(self) -> Sequence[MetricFamily]:
        held = [h for h in self._ledger.holders() if isinstance(h, ConsumerHold)]
        return (
            family(
                "gauge",
                "dp_static_consumers_running",
                "Static consumers holding their devices.",
                [((), len(held))],
            ),
        )

    # -- its inputs ----------------------------------------------------------------

    def running(self) -> tuple[str, ...]:
        return tuple(h.consumer for h in self._ledger.holders() if isinstance(h, ConsumerHold))

    def _started(self, event: ConsumerStarted) -> Done:
        consumer = event.consumer
        if self._ledger.holding((NAME, consumer)) is not None:
            return Outcome()
        wanted = self._consumers.get(consumer)
        if wanted is None:
            return self._refused(consumer, f"no consumer {consumer!r} is configured")
        devices = []
        for address in wanted:
            device = self._snapshot.device(PciAddress.parse(address))
            if device is None or device.iommu_group is None:
                return self._refused(consumer, f"{address} is not a function in an IOMMU group")
            devices.append((address, device.iommu_group))
        refusal = self._ledger.refusal(NAME, devices, takes_over=False)
        if refusal is not None:
            return self._refused(consumer, refusal)
        groups = tuple(sorted({group for _, group in devices}))
        self._ledger.hold(ConsumerHold(consumer, tuple(wanted), groups))
        handed = ConsumerHanded(consumer, tuple(wanted), groups)
        self.handed += 1
        return Outcome((handed, Log.info("consumer-started", consumer=consumer)), groups)

    def _stopped(self, event: ConsumerStopped) -> Done:
        hold = self._ledger.holding((NAME, event.consumer))
        if hold is None:
            return Outcome()
        self._ledger.release(hold)
        stopped = Log.info("consumer-stopped", consumer=event.consumer)
        return Outcome((stopped,), hold.groups, released=True)

    def _refused(self, consumer: str, reason: str) -> Done:
        log = Log.warning("consumer-refused", consumer=consumer, reason=reason)
        return Outcome((ConsumerRefused(consumer, reason), log))
