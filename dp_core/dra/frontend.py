"""The DRA front end: its devices, its prepared claims and its pool.

It shares the node's one ledger with the device-plugin front end: the life
of its claims (`lifecycle`: read, prepared, their files, unprepared) holds
and frees the IOMMU groups of their devices there, so a claim can never
take a group a device-plugin allocation holds, nor the other way round.

It also keeps the kubelet's health streams (`watch`): the health of every
device is worked out again after each change of the catalogue or of the
prepared claims, and sent to every stream when it changed. Which DRA
features the pool uses is `features`.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from ..config.config import DRA, FrontendName
from ..errors import UsageError
from ..frontend import Clock, Handler, Outcome, World
from ..inventory.resources import Inventory
from ..ledger import Ledger
from ..log import Log
from ..metric import MetricFamily, family
from .claims import ClaimHold
from .effects import DraEffect
from .features import Features
from .health_watch import HealthWatch
from .inputs import DraFeaturesObserved, HealthWatchEnded, HealthWatchStarted
from .lifecycle import ClaimLifecycle
from .offer import Offer
from .pool import DraDevice
from .pool_content import PoolContent
from .prepared import PreparedClaim

__all__ = ["DraEffects", "DraFrontend"]

#: What the DRA front end asks of the shell.
DraEffects = DraEffect | Log
Effects = list[DraEffects]
Done = Outcome[DraEffects]


class DraFrontend:
    """One node's DRA front end. `driver` is None while the config has no `dra`."""

    def __init__(
        self,
        ledger: Ledger,
        node_name: str = "",
        *,
        partitionable: bool = True,
        device_taints: bool = True,
        health_resend: float = 10.0,
    ) -> None:
        self._clock = Clock()  # the node's, at the step being handled
        self._ledger = ledger
        self.offer = Offer(
            ledger,
            node_name,
            partitionable=partitionable,
            device_taints=device_taints,
            health_resend=health_resend,
        )
        self._claims = ClaimLifecycle(ledger, self.offer, self._clock)

    # -- as a front end ----------------------------------------------------------

    @property
    def name(self) -> FrontendName:
        return DRA

    @property
    def holders_known(self) -> bool:
        return True  # its holds are its prepared claims, recalled before it serves

    def handlers(self) -> Mapping[type, Handler[DraEffects]]:
        steps: dict[type, Callable[[Any], Done]] = {
            **self._claims.steps(),
            DraFeaturesObserved: self._features_observed,
            HealthWatchStarted: self._health_watch_started,
            HealthWatchEnded: self._health_watch_ended,
        }
        return self._clock.handlers(steps)

    def world_changed(self, world: World) -> Done:
        """Take its devices from the inventory again (after a scan or a config)."""
        self._clock.now = world.now
        config = world.config
        prepared = self._claims.held()
        if config.dra is None or config.permitted_host_devices is None:
            off = self.offer.rebuild(None, Inventory(), world.snapshot, None, world.now, prepared)
            return Outcome(tuple(off))
        if not self.node_name:
            raise UsageError("the config turns DRA on, but the Node was made without node_name")
        driver = config.dra.driver_name
        return Outcome.of(
            self.offer.rebuild(
                driver, world.inventory, world.snapshot, config.dra, world.now, prepared
            )
        )

    def holders_changed(self, groups: Collection[int]) -> Effects:
        return self.offer.holders_changed(groups)

    def holders_wanted(self) -> Effects:
        return []

    def due(self, now: float) -> Sequence[DraEffects]:
        return self.health.tick(now)

    def next_deadline(self) -> float | None:
        return self.health.next_deadline()

    def metrics(self) -> Sequence[MetricFamily]:
        if self.driver is None:
            return ()
        driver = (("driver", self.driver),)
        return (
            family(
                "gauge",
                "dp_dra_prepared_claims",
                "Claims prepared on this node and not unprepared since.",
                [(driver, len(self._claims.held()))],
            ),
            family(
                "gauge",
                "dp_dra_claim_reads_waiting",
                "Prepare calls waiting for their claim to be read from the API server.",
                [(driver, self._claims.reads_waiting())],
            ),
            family(
                "gauge",
                "dp_dra_devices",
                "Devices in the driver's pool (a whole IOMMU group's device counts once).",
                [(driver, len(self.offer.devices()))],
            ),
        )

    # -- what it offers (`offer`) ------------------------------------------------

    @property
    def driver(self) -> str | None:
        return self.offer.driver

    @property
    def node_name(self) -> str:
        return self.offer.node_name

    @property
    def features(self) -> Features:
        return self.offer.features

    @property
    def health(self) -> HealthWatch:
        return self.offer.health

    def devices(self) -> tuple[DraDevice, ...]:
        return self.offer.devices()

    @property
    def pool(self) -> PoolContent | None:
        """The pool content last reported with `PoolChanged`."""
        return self.offer.pool

    @property
    def partitionable(self) -> bool:
        return self.offer.partitionable

    @property
    def device_taints(self) -> bool:
        return self.offer.device_taints

    def _features_observed(self, event: DraFeaturesObserved) -> Done:
        """Follow what the API server showed of its features: a log once per finding,
        and `PoolChanged` when the pool must change with it."""
        return Outcome((*self.features.observed(event), *self.offer.refresh()))

    def _health_watch_started(self, event: HealthWatchStarted) -> Done:
        return Outcome(tuple(self.health.started(event)))

    def _health_watch_ended(self, event: HealthWatchEnded) -> Done:
        return Outcome(tuple(self.health.ended(event)))

    # -- claims ------------------------------------------------------------------

    def prepared(self) -> tuple[PreparedClaim, ...]:
        """Every prepared claim, sorted by UID: the checkpoint."""
        return self._claims.prepared()

    def holds(self) -> tuple[ClaimHold, ...]:
        """Every prepared claim's hold on the ledger."""
        return tuple(h for h in self._ledger.holders() if isinstance(h, ClaimHold))
