"""The DRA front end: its devices, its prepared claims and its pool.

It shares the node's one ledger with the device-plugin front end: preparing
a claim holds the IOMMU groups of its devices there (`ClaimHold`), so a claim
can never take a group a device-plugin allocation holds, nor the other way
round; unpreparing frees them at once. What it prepared is reported as the
checkpoint (`ClaimsChanged`) and taken back at start (`ClaimsRecalled`), so
a restarted dp holds the same groups and an Unprepare for a claim deleted
from the API meanwhile still frees its group.

A claim is answered once its files are in place: `ClaimPrepared` asks the
shell to write its CDI specs and metadata, and the shell's report
(`ClaimFilesWritten`) is answered with `ClaimAnswered`, the devices and their
CDI IDs. A claim prepared by that call whose files could not be written is
released again (nothing may stay held for a claim the kubelet is told
failed), its files removed, and then answered with the error. Unpreparing
likewise: `ClaimUnprepared` (the groups are free at once), the shell's
`ClaimFilesRemoved`, then `ClaimAnswered`.

It also keeps the kubelet's health streams (`watch`): the health of every
device is worked out again after each change of the catalogue or of the
prepared claims, and sent to every stream when it changed. Which DRA
features the pool uses is `features`.

A claim the core cannot prepare (a device it does not offer, another node's
pool, a group held elsewhere) is the peer's problem and gets `ClaimRefused`
with a message naming what; nothing held is released. `UsageError` is kept
for the shell's mistakes.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import attrs

from ..config.config import DRA, Dra, FrontendName
from ..errors import UsageError
from ..frontend import Handler, Outcome, World
from ..host.snapshot import HostSnapshot
from ..inventory.advertised import AdvertisedDevice
from ..inventory.edits import ContainerAllocation, DeviceSpec, container_allocation
from ..inventory.resources import Inventory, Resource
from ..ledger import Ledger
from ..log import Log
from ..metric import MetricFamily, family
from .claims import ClaimHold, ClaimRef
from .effects import (
    ClaimAnswered,
    ClaimPrepared,
    ClaimRefused,
    ClaimsChanged,
    ClaimUnprepared,
    DraEffect,
    PoolChanged,
)
from .features import Features
from .inputs import (
    ClaimFilesRemoved,
    ClaimFilesWritten,
    ClaimPrepareRequested,
    ClaimsRecalled,
    ClaimUnprepareRequested,
    DraFeaturesObserved,
    HealthWatchEnded,
    HealthWatchStarted,
)
from .metadata import prepared_devices
from .pool import DraDevice, Pool, PoolOptions, dra_catalogue
from .prepared import ClaimDevice, PreparedClaim
from .slices import PoolContent
from .watch import HealthWatch, device_health

__all__ = ["DraEffects", "DraFrontend"]

#: What the DRA front end asks of the shell.
DraEffects = DraEffect | Log
Effects = list[DraEffects]
Done = Outcome[DraEffects]


class _Refusal(Exception):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@attrs.frozen
class _Waiting:
    """A call waiting for the shell's report on its claim's files."""

    claim: ClaimRef
    removing: bool  # a removal's report (else a write's)
    fresh: bool = False  # prepared by this call: released if its files cannot be written
    error: str = ""  # its answer, decided already (a failed write, its files being removed)


def _claim_name(prepared: PreparedClaim) -> str:
    return f"{prepared.claim.namespace}/{prepared.claim.name}"


def _show(claim: ClaimRef) -> str:
    return f"{claim.namespace}/{claim.name} (UID {claim.uid})"


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
        self._now = 0.0  # the node's clock at the step being handled
        self._ledger = ledger
        self.node_name = node_name
        self.features = Features(partitionable, device_taints)
        self.driver: str | None = None
        self._devices: dict[str, DraDevice] = {}
        self._pool: Pool | None = None  # the pool of `_devices`, kept as holders change
        self._groups: frozenset[int] = frozenset()  # the IOMMU groups of its devices
        self._resources: dict[str, Resource] = {}
        self._prepared: dict[str, PreparedClaim] = {}
        self._waiting: dict[int, _Waiting] = {}  # by call
        self._published: PoolContent | None = None
        self._problems: set[str] = set()
        self._snapshot = HostSnapshot()
        self.health = HealthWatch(health_resend)

    # -- as a front end ----------------------------------------------------------

    @property
    def name(self) -> FrontendName:
        return DRA

    @property
    def holders_known(self) -> bool:
        return True  # its holds are its prepared claims, recalled before it serves

    def handlers(self) -> Mapping[type, Handler[DraEffects]]:
        steps: dict[type, Callable[[Any], Done]] = {
            ClaimPrepareRequested: self._prepare,
            ClaimFilesWritten: self._files_written,
            ClaimUnprepareRequested: self._unprepare,
            ClaimFilesRemoved: self._files_removed,
            ClaimsRecalled: self._recalled,
            DraFeaturesObserved: self._features_observed,
            HealthWatchStarted: self._health_watch_started,
            HealthWatchEnded: self._health_watch_ended,
        }
        return {kind: self._clocked(step) for kind, step in steps.items()}

    def _clocked(self, step: Callable[[Any], Done]) -> Handler[DraEffects]:
        def handle(event: Any, now: float) -> Done:
            self._now = now
            return step(event)

        return handle

    def world_changed(self, world: World) -> Done:
        """Take its devices from the inventory again (after a scan or a config)."""
        self._now = world.now
        config = world.config
        if config.dra is None or config.permitted_host_devices is None:
            return Outcome(tuple(self._rebuild(None, Inventory(), world.snapshot, None, world.now)))
        if not self.node_name:
            raise UsageError("the config turns DRA on, but the Node was made without node_name")
        return Outcome.of(
            self._rebuild(
                config.dra.driver_name, world.inventory, world.snapshot, config.dra, world.now
            )
        )

    def holders_changed(self, groups: Collection[int]) -> Effects:
        # Only the holders of its devices' groups can change the pool.
        if self.driver is None or self._groups.isdisjoint(groups):
            return []
        return self.refresh()

    def holders_wanted(self) -> Effects:
        return []

    def due(self, now: float) -> Sequence[DraEffects]:
        return self.health.tick(now)

    def next_deadline(self) -> float | None:
        return self.health.next_deadline()

    def observe(self, event: object, effects: Sequence[object]) -> None:
        pass  # what it counts is its state: `metrics`

    def metrics(self) -> Sequence[MetricFamily]:
        if self.driver is None:
            return ()
        driver = (("driver", self.driver),)
        return (
            family(
                "gauge",
                "dp_dra_prepared_claims",
                "Claims prepared on this node and not unprepared since.",
                [(driver, len(self._prepared))],
            ),
            family(
                "gauge",
                "dp_dra_devices",
                "Devices in the driver's pool (a whole IOMMU group's device counts once).",
                [(driver, len(self._devices))],
            ),
        )

    # -- what it offers --------------------------------------------------------

    def devices(self) -> tuple[DraDevice, ...]:
        return tuple(self._devices.values())

    @property
    def pool(self) -> PoolContent | None:
        """The pool content last reported with `PoolChanged`."""
        return self._published

    @property
    def partitionable(self) -> bool:
        """Whether the pool has a shared counter per multi-device IOMMU group."""
        return self.features.partitionable

    @property
    def device_taints(self) -> bool:
        """Whether devices that cannot be allocated now are tainted rather than left out."""
        return self.features.device_taints

    def _rebuild(
        self,
        driver: str | None,
        inventory: Inventory,
        snapshot: HostSnapshot,
        settings: Dra | None,
        now: float,
    ) -> Effects:
        effects: Effects = []
        self._snapshot = snapshot
        if settings is not None:
            self.features.configure(settings)
        if driver != self.driver and self.driver is not None and self._published is not None:
            # The driver was renamed or turned off: its pool empties.
            effects.append(PoolChanged(PoolContent(self.driver, self.node_name, self.node_name)))
            self._published = None
        self.driver = driver
        catalogue: tuple[DraDevice, ...] = ()
        problems: tuple[str, ...] = ()
        if driver is not None:
            catalogue, problems = dra_catalogue(inventory, snapshot)
        self._devices = {device.name: device for device in catalogue}
        self._pool = None
        self._groups = frozenset(d.iommu_group for d in catalogue if d.iommu_group is not None)
        self._resources = {r.name: r for r in inventory.resources if r.frontend == DRA}
        effects.extend(
            Log.warning("dra-device-problem", detail=p) for p in problems if p not in self._problems
        )
        self._problems = set(problems)
        effects.extend(self.refresh())
        effects.extend(self._health(now))
        return effects

    def _health(self, now: float) -> Effects:
        """Work the devices' health out again; what the health streams are sent if it changed."""
        if self.driver is None:
            return []
        health = device_health(
            self._devices.values(), self._prepared.values(), self._snapshot, self.node_name
        )
        return list(self.health.observe(health, now))

    def refresh(self) -> Effects:
        """`PoolChanged` if the pool's content differs from what was last reported."""
        if self.driver is None:
            return []
        features = self.features
        options = PoolOptions(
            self.driver, self.node_name, features.partitionable, features.device_taints
        )
        if self._pool is None or self._pool.options != options:
            self._pool = Pool(self._devices.values(), options)
        content = self._pool.content(self._ledger.held())
        if content == self._published:
            return []
        self._published = content
        return [PoolChanged(content)]

    def _features_observed(self, event: DraFeaturesObserved) -> Done:
        """Follow what the API server showed of its features: a log once per finding,
        and `PoolChanged` when the pool must change with it."""
        return Outcome((*self.features.observed(event), *self.refresh()))

    def _health_watch_started(self, event: HealthWatchStarted) -> Done:
        return Outcome(tuple(self.health.started(event)))

    def _health_watch_ended(self, event: HealthWatchEnded) -> Done:
        return Outcome(tuple(self.health.ended(event)))

    # -- claims ------------------------------------------------------------------

    def prepared(self) -> tuple[PreparedClaim, ...]:
        """Every prepared claim, sorted by UID: the checkpoint."""
        return tuple(self._prepared[uid] for uid in sorted(self._prepared))

    def is_prepared(self, uid: str) -> bool:
        return uid in self._prepared

    def holds(self) -> tuple[ClaimHold, ...]:
        """Every prepared claim's hold on the ledger."""
        return tuple(h for h in self._ledger.holders() if isinstance(h, ClaimHold))

    def _prepare(self, event: ClaimPrepareRequested) -> Done:
        """Prepare one claim: hold its groups and ask for its files (`ClaimPrepared`)."""
        claim = event.claim
        known = self._prepared.get(claim.uid)
        if known is not None:
            self._waiting[event.call] = _Waiting(claim, removing=False)
            return Outcome((ClaimPrepared(event.call, known),))
        try:
            devices = self._claim_devices(event)
        except _Refusal as refusal:
            message = str(refusal)
            return Outcome.of(
                [
                    ClaimRefused(event.call, claim, message, refusal.reason),
                    Log.warning(
                        "claim-refused",
                        claim=f"{claim.namespace}/{claim.name}",
                        uid=claim.uid,
                        reason=message,
                    ),
                ]
            )
        prepared = PreparedClaim(claim, devices, event.pod_claim_name, event.extended_resources)
        names = tuple(device.name for device in devices)
        hold = ClaimHold(claim, names, prepared.groups)
        self._ledger.hold(hold)
        self._prepared[claim.uid] = prepared
        self._waiting[event.call] = _Waiting(claim, removing=False, fresh=True)
        effects: Effects = [
            ClaimPrepared(event.call, prepared),
            Log.info(
                "claim-prepared",
                claim=_claim_name(prepared),
                uid=claim.uid,
                devices=",".join(names),
                groups=",".join(str(g) for g in prepared.groups),
            ),
            ClaimsChanged(self.prepared()),
        ]
        # Its devices are all offered (else it was refused): no device's health changed.
        return Outcome(tuple(effects), prepared.groups)

    def _files_written(self, event: ClaimFilesWritten) -> Done:
        """The shell's report on `ClaimPrepared`: the answer, or the claim let go."""
        waiting = self._take(event.call, removing=False, what="ClaimFilesWritten")
        claim = waiting.claim
        if not event.problem:
            prepared = self._prepared.get(claim.uid)
            if prepared is None:
                raise UsageError(f"ClaimFilesWritten for claim {claim.uid}, unprepared since")
            devices = prepared_devices(self.driver or "", prepared)
            return Outcome((ClaimAnswered(event.call, claim, devices),))
        error = f"claim {_show(claim)}: its CDI files could not be written: {event.problem}"
        if not waiting.fresh:
            return Outcome((ClaimAnswered(event.call, claim, error=error),))
        # Nothing may stay held for a claim the kubelet is told failed: its
        # files go, and it is answered once they have.
        released = self._release(claim, event.call, self._now)
        self._waiting[event.call] = _Waiting(claim, removing=True, error=error)
        return released

    def _claim_devices(self, event: ClaimPrepareRequested) -> tuple[ClaimDevice, ...]:
        driver = self.driver
        if driver is None:
            raise _Refusal(
                "DriverOff", "the DRA front end is off: the config has no dra.driverName"
            )
        requests: dict[str, list[str]] = {}  # device -> the requests it serves, in order
        for result in event.results:
            if result.driver != driver:
                continue
            if result.pool != self.node_name:
                raise _Refusal(
                    "OtherPool",
                    f"request {result.request!r}: device {result.device!r} is in pool "
                    f"{result.pool!r}, not this node's pool {self.node_name!r}",
                )
            if result.device not in self._devices:
                raise _Refusal(
                    "DeviceNotOffered",
                    f"request {result.request!r}: device {result.device!r} is not offered "
                    f"by {driver} in pool {self.node_name!r}",
                )
            requests.setdefault(result.device, []).append(result.request)
        devices = []
        for name, served in requests.items():
            device = self._devices[name]
            if not device.advertised.healthy:
                raise _Refusal(
                    "DeviceUnhealthy",
                    f"device {name} is unhealthy: {device.advertised.reason}; the claim "
                    "cannot be prepared on this node while it is: delete the pod to have "
                    "its claim allocated again",
                )
            group = device.iommu_group
            refusal = self._ledger.refusal(DRA, [(name, group)], takes_over=False)
            if refusal is not None:
                raise _Refusal(
                    "IOMMUGroupHeld",
                    f"{refusal}; VFIO cannot split a group between holders; the kubelet "
                    "retries until that holder lets go, or delete the pod to have its claim "
                    "allocated again",
                )
            edits = self._edits(device)
            devices.append(
                ClaimDevice(
                    served,
                    self.node_name,
                    name,
                    device.advertised.id,
                    device.resource,
                    group,
                    edits,
                    device.attributes,
                )
            )
        return tuple(devices)

    def _edits(self, device: DraDevice) -> ContainerAllocation:
        """What a container gets for `device`: for a whole group, every member's
        nodes, and each member resource's variable (as Allocate gives them)."""
        by_resource: dict[str, list[AdvertisedDevice]] = {}
        for part in device.parts:
            by_resource.setdefault(part.resource, []).append(part.advertised)
        envs: list[tuple[str, str]] = []
        specs: dict[str, DeviceSpec] = {}
        for name, advertised in by_resource.items():
            one = container_allocation(self._resources[name], advertised)
            envs += one.envs
            specs.update((spec.container_path, spec) for spec in one.devices)
        return ContainerAllocation(envs=tuple(envs), devices=tuple(specs.values()))

    def _unprepare(self, event: ClaimUnprepareRequested) -> Done:
        """Unprepare one claim, known or not: free its groups, and ask for its
        files to go (`ClaimUnprepared`)."""
        released = self._release(event.claim, event.call, event.now)
        self._waiting[event.call] = _Waiting(event.claim, removing=True)
        return released

    def _files_removed(self, event: ClaimFilesRemoved) -> Done:
        """The shell's report on `ClaimUnprepared`: the answer."""
        waiting = self._take(event.call, removing=True, what="ClaimFilesRemoved")
        error = waiting.error
        if not error and event.problem:
            # The group is free already; the kubelet asks again, and the files go then.
            claim = waiting.claim
            error = f"claim {_show(claim)}: its CDI files could not be removed: {event.problem}"
        return Outcome((ClaimAnswered(event.call, waiting.claim, error=error),))

    def _take(self, call: int, *, removing: bool, what: str) -> _Waiting:
        waiting = self._waiting.get(call)
        if waiting is None or waiting.removing is not removing:
            raise UsageError(f"{what} for call {call}, which waits for no such report")
        del self._waiting[call]
        return waiting

    def _release(self, claim: ClaimRef, call: int, now: float) -> Done:
        """Let `claim` go: its groups at once, its files through `ClaimUnprepared`."""
        hold = self._ledger.holding(ClaimHold.key_of(claim))
        if hold is not None:
            self._ledger.release(hold)
        prepared = self._prepared.pop(claim.uid, None)
        effects: Effects = [ClaimUnprepared(call, claim, prepared)]
        if prepared is None:
            return Outcome(tuple(effects))
        effects += [
            Log.info(
                "claim-unprepared",
                claim=_claim_name(prepared),
                uid=claim.uid,
                groups=",".join(str(g) for g in prepared.groups),
            ),
            ClaimsChanged(self.prepared()),
        ]
        if any(device.name not in self._devices for device in prepared.devices):
            # Held but no longer offered: reported for the claim's sake until now.
            effects.extend(self._health(now))
        # Binds put off while the claim held a group may go now.
        return Outcome(tuple(effects), prepared.groups, released=bool(prepared.groups))

    def _recalled(self, event: ClaimsRecalled) -> Done:
        """Hold again what the checkpoint says was prepared; report groups found held."""
        if self._prepared:
            raise UsageError("ClaimsRecalled after claims were prepared: recall them first")
        effects: Effects = []
        touched: set[int] = set()
        for prepared in event.prepared:
            free = []
            for group in prepared.groups:
                claimant = f"{prepared.describe()} was prepared with it"
                report = self._ledger.split_report(group, claimant)
                if report is None:
                    free.append(group)
                else:
                    effects.append(Log.error("group-split", detail=report))
            names = tuple(device.name for device in prepared.devices)
            hold = ClaimHold(prepared.claim, names, tuple(sorted(set(free))))
            self._ledger.hold(hold)
            self._prepared[prepared.claim.uid] = prepared
            touched.update(free)
        if event.prepared:
            effects.append(Log.info("claims-recalled", claims=len(event.prepared)))
        effects.extend(self._health(self._now))
        return Outcome(tuple(effects), touched)
