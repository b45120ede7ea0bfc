"""What the DRA front end offers: its devices, its pool and their health.

`Offer` takes the DRA front end's part of the inventory at every change of
the world (`rebuild`): the devices of the config's `frontend: dra` entries
(`dra_catalogue`), each whole IOMMU group's device among them. It keeps the
pool that publishes them (`Pool`, worked out again only for the groups whose
holder changed), reported with `PoolChanged` when its content changes, with
the cluster's DRA features (`Features`), and the health of every device,
streamed to the kubelet (`HealthWatch`). What is claimed is the front end's
(`frontend`); the offer is told of it.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

from ..config.config import DRA, Dra
from ..host.snapshot import HostSnapshot
from ..inventory.advertised import AdvertisedDevice
from ..inventory.edits import ContainerAllocation, DeviceSpec, container_allocation
from ..inventory.resources import Inventory, Resource
from ..ledger import Ledger
from ..log import Log
from .effects import DraEffect, PoolChanged
from .features import Features
from .health_watch import HealthWatch, device_health
from .inputs import AllocatedDevice
from .pool import DraDevice, Pool, PoolOptions, dra_catalogue
from .pool_content import PoolContent
from .prepared import ClaimDevice, PreparedClaim

__all__ = ["Offer", "Refusal"]

Effects = list[DraEffect | Log]


class Refusal(Exception):
    """A claim the offer cannot give its devices: `reason` is a CamelCase word."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class Offer:
    """One node's DRA devices, pool and health. `driver` is None while the
    config has no `dra`."""

    def __init__(
        self,
        ledger: Ledger,
        node_name: str,
        *,
        partitionable: bool = True,
        device_taints: bool = True,
        health_resend: float = 10.0,
    ) -> None:
        self._ledger = ledger
        self.node_name = node_name
        self.features = Features(partitionable, device_taints)
        self.driver: str | None = None
        self._devices: dict[str, DraDevice] = {}
        self._pool: Pool | None = None  # the pool of `_devices`, kept as holders change
        self._groups: frozenset[int] = frozenset()  # the IOMMU groups of its devices
        self._resources: dict[str, Resource] = {}
        self._published: PoolContent | None = None
        self._problems: set[str] = set()
        self._snapshot = HostSnapshot()
        self.health = HealthWatch(health_resend)

    def device(self, name: str) -> DraDevice | None:
        return self._devices.get(name)

    def resource(self, name: str) -> Resource:
        return self._resources[name]

    def holders_changed(self, groups: Collection[int]) -> Effects:
        # Only the holders of its devices' groups can change the pool.
        if self.driver is None or self._groups.isdisjoint(groups):
            return []
        return self.refresh()

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

    def rebuild(
        self,
        driver: str | None,
        inventory: Inventory,
        snapshot: HostSnapshot,
        settings: Dra | None,
        now: float,
        prepared: Iterable[PreparedClaim],
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
        effects.extend(self.health_now(prepared, now))
        return effects

    def health_now(self, prepared: Iterable[PreparedClaim], now: float) -> Effects:
        """Work the devices' health out again, `prepared` claims' devices
        included; what the health streams are sent if it changed."""
        if self.driver is None:
            return []
        health = device_health(self._devices.values(), prepared, self._snapshot, self.node_name)
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

    def claim_devices(self, results: Iterable[AllocatedDevice]) -> tuple[ClaimDevice, ...]:
        """The devices a claim's allocation `results` name here, with what each
        gives a container; Refusal if one cannot be had (a device it does not
        offer, another node's pool, a group another holder has)."""
        driver = self.driver
        if driver is None:
            raise Refusal("DriverOff", "the DRA front end is off: the config has no dra.driverName")
        requests: dict[str, list[str]] = {}  # device -> the requests it serves, in order
        for result in results:
            if result.driver != driver:
                continue
            if result.pool != self.node_name:
                raise Refusal(
                    "OtherPool",
                    f"request {result.request!r}: device {result.device!r} is in pool "
                    f"{result.pool!r}, not this node's pool {self.node_name!r}",
                )
            if result.device not in self._devices:
                raise Refusal(
                    "DeviceNotOffered",
                    f"request {result.request!r}: device {result.device!r} is not offered "
                    f"by {driver} in pool {self.node_name!r}",
                )
            requests.setdefault(result.device, []).append(result.request)
        devices = []
        for name, served in requests.items():
            device = self._devices[name]
            if not device.advertised.healthy:
                raise Refusal(
                    "DeviceUnhealthy",
                    f"device {name} is unhealthy: {device.advertised.reason}; the claim "
                    "cannot be prepared on this node while it is: delete the pod to have "
                    "its claim allocated again",
                )
            group = device.iommu_group
            refusal = self._ledger.refusal(DRA, [(name, group)], takes_over=False)
            if refusal is not None:
                raise Refusal(
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
