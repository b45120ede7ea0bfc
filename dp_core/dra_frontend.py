"""The DRA front end's state: its devices, its prepared claims and its pool.

It shares the node's one `AllocationBook` with the device-plugin front end:
preparing a claim reserves the IOMMU groups of its devices there, so a claim
can never take a group a device-plugin allocation holds, nor the other way
round; unpreparing frees them at once. What it prepared is reported as the
checkpoint (`ClaimsChanged`) and taken back at start (`ClaimsRecalled`), so
a restarted dp holds the same groups and an Unprepare for a claim deleted
from the API meanwhile still frees its group.

It also keeps the kubelet's health streams (`dra_health_watch`): the health
of every device is worked out again after each change of the catalogue or
of the prepared claims, and sent to every stream when it changed.

Which DRA features the pool uses (`dra_pool`: shared counters, device taints)
is the config's `dra.partitionableDevices`/`dra.deviceTaints` when true or
false; with "auto", what the API server showed it keeps (`DraFeaturesObserved`:
the shell asks with a server-side dry run before it writes the pool, and again
later, and compares every write). Until then the pool is computed as if the
cluster had both, but the shell writes nothing before it has asked. A
finding is logged when it is new or changes, and the pool changes with it;
a server that cannot be asked counts as lacking what was not seen yet.

A claim the core cannot prepare (a device it does not offer, another node's
pool, a group held elsewhere) is the peer's problem and gets `ClaimRefused`
with a message naming what; nothing held is released. `UsageError` is kept
for the shell's mistakes.
"""

from __future__ import annotations

from collections.abc import Iterable

from .advertised import AdvertisedDevice
from .allocation import AllocationBook, container_allocation
from .answers import ContainerAllocation, DeviceSpec
from .config import Dra, DraFeatureSetting
from .dra_effects import (
    ClaimPrepared,
    ClaimRefused,
    ClaimsChanged,
    ClaimUnprepared,
    DraEffect,
    PoolChanged,
)
from .dra_health_watch import HealthWatch, device_health
from .dra_inputs import (
    ClaimPrepareRequested,
    ClaimsRecalled,
    ClaimUnprepareRequested,
    DraFeaturesObserved,
)
from .dra_pool import DraDevice, PoolOptions, dra_catalogue, pool_content
from .dra_prepared import ClaimDevice, PreparedClaim
from .effects import Effect, Log
from .errors import UsageError
from .host import HostSnapshot
from .inventory import Inventory, Resource
from .slices import PoolContent

__all__ = ["DraFrontend"]

Effects = list[Effect | DraEffect]


class _Refusal(Exception):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def _claim_name(prepared: PreparedClaim) -> str:
    return f"{prepared.claim.namespace}/{prepared.claim.name}"


class DraFrontend:
    """One node's DRA front end. `driver` is None while the config has no `dra`."""

    def __init__(
        self,
        book: AllocationBook,
        node_name: str,
        *,
        partitionable: bool = True,
        device_taints: bool = True,
        health_resend: float = 10.0,
    ) -> None:
        self._book = book
        self.node_name = node_name
        # What "auto" computes until the API server has shown what it keeps:
        # the rich pool, which the shell holds back until it has asked.
        self._assumed = {_PARTITIONABLE: partitionable, _TAINTS: device_taints}
        self._observed: dict[str, bool] = {}
        self._guessed: set[str] = set()  # taken as absent: the server could not be asked
        self._settings: dict[str, DraFeatureSetting] = {_PARTITIONABLE: "auto", _TAINTS: "auto"}
        self.driver: str | None = None
        self._devices: dict[str, DraDevice] = {}
        self._resources: dict[str, Resource] = {}
        self._prepared: dict[str, PreparedClaim] = {}
        self._published: PoolContent | None = None
        self._problems: set[str] = set()
        self._snapshot = HostSnapshot()
        self.health = HealthWatch(health_resend)

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
        return self._feature(_PARTITIONABLE)

    @property
    def device_taints(self) -> bool:
        """Whether devices that cannot be allocated now are tainted rather than left out."""
        return self._feature(_TAINTS)

    def _feature(self, feature: str) -> bool:
        setting = self._settings[feature]
        if isinstance(setting, bool):
            return setting
        return self._observed.get(feature, self._assumed[feature])

    def rebuild(
        self,
        driver: str | None,
        inventory: Inventory,
        snapshot: HostSnapshot,
        settings: Dra | None = None,
        *,
        now: float,
    ) -> Effects:
        """Take the DRA front end's inventory again (after a scan or a config)."""
        effects: Effects = []
        self._snapshot = snapshot
        if settings is not None:
            self._settings = {
                _PARTITIONABLE: settings.partitionable_devices,
                _TAINTS: settings.device_taints,
            }
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
        self._resources = {resource.name: resource for resource in inventory.resources}
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
        options = PoolOptions(self.driver, self.node_name, self.partitionable, self.device_taints)
        content = pool_content(self._devices.values(), self._book.reserved_groups(), options)
        if content == self._published:
            return []
        self._published = content
        return [PoolChanged(content)]

    def features_observed(self, event: DraFeaturesObserved) -> Effects:
        """Follow what the API server showed of its features: a log once per finding,
        and `PoolChanged` when the pool must change with it."""
        effects: Effects = []
        for feature, seen in (
            (_PARTITIONABLE, event.partitionable),
            (_TAINTS, event.device_taints),
        ):
            if seen is None:
                if event.unknown is not None and feature not in self._observed:
                    self._observed[feature] = False
                    self._guessed.add(feature)
                    effects.append(_unknown_log(feature, event.unknown, self._settings[feature]))
                continue
            if self._observed.get(feature) == seen and feature not in self._guessed:
                continue
            self._observed[feature] = seen
            self._guessed.discard(feature)
            effects.append(_feature_log(feature, seen, self._settings[feature]))
        effects.extend(self.refresh())
        return effects

    # -- claims ------------------------------------------------------------------

    def prepared(self) -> tuple[PreparedClaim, ...]:
        """Every prepared claim, sorted by UID: the checkpoint."""
        return tuple(self._prepared[uid] for uid in sorted(self._prepared))

    def prepare(self, event: ClaimPrepareRequested) -> tuple[Effects, set[int]]:
        """Prepare one claim; the effects, and the IOMMU groups whose holder changed."""
        known = self._prepared.get(event.claim.uid)
        if known is not None:
            return [ClaimPrepared(event.call, known)], set()
        claim = event.claim
        try:
            devices = self._claim_devices(event)
        except _Refusal as refusal:
            message = str(refusal)
            return [
                ClaimRefused(event.call, claim, message, refusal.reason),
                Log.warning(
                    "claim-refused",
                    claim=f"{claim.namespace}/{claim.name}",
                    uid=claim.uid,
                    reason=message,
                ),
            ], set()
        prepared = PreparedClaim(claim, devices, event.pod_claim_name)
        names = [device.name for device in devices]
        self._book.hold_claim(claim, self.driver or "", names, prepared.groups, event.now)
        self._prepared[claim.uid] = prepared
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
        effects.extend(self.refresh())
        return effects, set(prepared.groups)

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
            holder = self._book.group_holder(group) if group is not None else None
            if holder is not None:
                raise _Refusal(
                    "IOMMUGroupHeld",
                    f"IOMMU group {group} of device {name} is held by {holder.describe()}; "
                    "VFIO cannot split a group between holders; the kubelet retries until "
                    "that holder lets go, or delete the pod to have its claim allocated again",
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

    def unprepare(self, event: ClaimUnprepareRequested) -> tuple[Effects, set[int]]:
        """Unprepare one claim, known or not; the effects, and the groups freed."""
        claim = event.claim
        self._book.release_claim(claim.uid)
        prepared = self._prepared.pop(claim.uid, None)
        effects: Effects = [ClaimUnprepared(event.call, claim, prepared)]
        if prepared is None:
            return effects, set()
        effects += [
            Log.info(
                "claim-unprepared",
                claim=_claim_name(prepared),
                uid=claim.uid,
                groups=",".join(str(g) for g in prepared.groups),
            ),
            ClaimsChanged(self.prepared()),
        ]
        effects.extend(self.refresh())
        if any(device.name not in self._devices for device in prepared.devices):
            # Held but no longer offered: reported for the claim's sake until now.
            effects.extend(self._health(event.now))
        return effects, set(prepared.groups)

    def recalled(self, event: ClaimsRecalled, now: float) -> tuple[Effects, set[int]]:
        """Hold again what the checkpoint says was prepared; report groups found held."""
        if self._prepared:
            raise UsageError("ClaimsRecalled after claims were prepared: recall them first")
        effects: Effects = []
        touched: set[int] = set()
        for prepared in event.prepared:
            free, split = _free_groups(self._book, prepared.groups)
            for group in split:
                holder = self._book.group_holder(group)
                held_by = holder.describe() if holder is not None else "another holder"
                effects.append(
                    Log.error(
                        "group-split",
                        detail=f"IOMMU group {group} is split: {prepared.describe()} was "
                        f"prepared with it, and {held_by} holds it",
                    )
                )
            names = [device.name for device in prepared.devices]
            self._book.hold_claim(prepared.claim, self.driver or "", names, free, now)
            self._prepared[prepared.claim.uid] = prepared
            touched.update(free)
        if event.prepared:
            effects.append(Log.info("claims-recalled", claims=len(event.prepared)))
        effects.extend(self.refresh())
        effects.extend(self._health(now))
        return effects, touched


_PARTITIONABLE = "partitionable"
_TAINTS = "device_taints"
# feature -> (its gate, the fields, its config key, what dp publishes without it)
_FEATURES = {
    _PARTITIONABLE: (
        "DRAPartitionableDevices",
        "sharedCounters",
        "dra.partitionableDevices",
        "publishing one device per multi-device IOMMU group",
    ),
    _TAINTS: (
        "DRADeviceTaints",
        "device taints",
        "dra.deviceTaints",
        "leaving unhealthy devices, and devices whose IOMMU group is held elsewhere, "
        "out of the pool instead of tainting them NoSchedule",
    ),
}


def _feature_log(feature: str, kept: bool, setting: DraFeatureSetting) -> Log:
    gate, fields, key, without = _FEATURES[feature]
    if kept:
        return Log.info(
            "dra-feature-found",
            feature=gate,
            detail=f"the API server kept {fields}: the cluster has {gate}",
        )
    dropped = f"the API server dropped {fields}"
    if setting is True:
        detail = (
            f"{dropped}, so the cluster lacks {gate}; {key} is true, so dp keeps "
            "publishing them, and the scheduler does not see them"
        )
    else:
        detail = f"{dropped} ({gate} is off): {without}"
    return Log.warning("dra-feature-missing", feature=gate, detail=detail)


def _unknown_log(feature: str, why: str, setting: DraFeatureSetting) -> Log:
    gate, _, key, without = _FEATURES[feature]
    if isinstance(setting, bool):
        detail = f"cannot ask the API server whether it has {gate} ({why}); {key} decides"
    else:
        detail = (
            f"cannot ask the API server whether it has {gate} ({why}): taking it as off, {without}"
        )
    return Log.warning("dra-feature-unknown", feature=gate, detail=detail)


def _free_groups(book: AllocationBook, groups: Iterable[int]) -> tuple[list[int], list[int]]:
    free: list[int] = []
    held: list[int] = []
    for group in groups:
        (held if book.group_holder(group) is not None else free).append(group)
    return free, held
