"""What the device-plugin front end reports to monitoring, as metric families.

Its gauges read its state; its counters read its `RpcTally`. Names, label
sets and help texts are part of dp's monitoring interface (docs/operations.md).
"""

from __future__ import annotations

from collections import Counter
from typing import Protocol

from ..cdi.resources import CdiKeeper
from ..inventory.advertised import AdvertisedDevice
from ..inventory.resources import Inventory
from ..metric import Labels, MetricFamily, family
from .allocations import AllocationBook
from .registration import Phase, Registrar
from .sync import KubeletSync, SyncPhase
from .tally import OK, RPC_METHODS, RpcTally

__all__ = ["families"]


class DevicePluginFrontend(Protocol):
    """What of the device-plugin front end its metrics read."""

    @property
    def offered(self) -> Inventory: ...
    @property
    def allocations(self) -> AllocationBook: ...
    @property
    def registrar(self) -> Registrar: ...
    @property
    def sync(self) -> KubeletSync: ...
    @property
    def tally(self) -> RpcTally: ...
    @property
    def cdi(self) -> CdiKeeper | None: ...
    def resource_names(self) -> tuple[str, ...]: ...
    def advertised(self, resource: str) -> tuple[AdvertisedDevice, ...]: ...
    def streams(self, resource: str) -> list[int]: ...


def _per_resource(front: DevicePluginFrontend) -> list[MetricFamily]:
    names = front.resource_names()
    held: Counter[str] = Counter()
    for allocation in front.allocations.all():
        held[allocation.resource] += len(allocation.device_ids)
    phases = front.registrar.phases()
    # Healthy before reservations: a device whose group another holder has
    # is Unhealthy to the kubelet, but it is reserved, not broken.
    usable = {
        resource.name: {device.id for device in resource.devices if device.healthy}
        for resource in front.offered.resources
    }
    devices: list[tuple[Labels, float]] = []
    for name in names:
        health: Counter[str] = Counter({"healthy": 0, "unhealthy": 0, "reserved": 0})
        for device in front.advertised(name):
            if device.healthy:
                health["healthy"] += 1
            elif device.id in usable.get(name, ()):
                health["reserved"] += 1
            else:
                health["unhealthy"] += 1
        devices.extend(((("resource", name), ("health", h)), n) for h, n in health.items())
    return [
        family(
            "gauge",
            "dp_resource_devices",
            "Devices a resource advertises to the kubelet: healthy, unhealthy, or reserved "
            "(Unhealthy to the kubelet while another allocation holds their IOMMU group).",
            devices,
        ),
        family(
            "gauge",
            "dp_resource_allocated_devices",
            "Devices of a resource that dp handed out and has not seen released.",
            [((("resource", name),), held[name]) for name in names],
        ),
        family(
            "gauge",
            "dp_resource_registration_phase",
            "1 for the phase a resource's registration with the kubelet is in, else 0.",
            (
                ((("resource", name), ("phase", phase.value)), int(phases.get(name) is phase))
                for name in names
                for phase in Phase
            ),
        ),
        family(
            "gauge",
            "dp_resource_streams",
            "ListAndWatch streams the kubelet has open for a resource.",
            [((("resource", name),), len(front.streams(name))) for name in names],
        ),
    ]


def _counters(front: DevicePluginFrontend) -> list[MetricFamily]:
    tally = front.tally
    errors: Counter[str] = Counter()
    unattributed = 0
    for (method, resource, code), count in tally.rpcs.items():
        if code != OK:
            errors[method] += count
        if not resource:
            unattributed += count
    return [
        family(
            "counter",
            "dp_rpcs_total",
            "Device-plugin RPCs the kubelet made, by method, resource and status code "
            "(resource empty when the connection could not be attributed).",
            (
                ((("method", method), ("resource", resource), ("code", code)), count)
                for (method, resource, code), count in sorted(tally.rpcs.items())
            ),
        ),
        family(
            "counter",
            "dp_rpc_errors_total",
            "Device-plugin RPCs answered with an error, by method; every method is always "
            "reported, so the first error shows as an increase.",
            [((("method", method),), errors[method]) for method in sorted(RPC_METHODS.values())],
        ),
        family(
            "counter",
            "dp_unattributed_rpcs_total",
            "RPCs on a connection dp could not attribute to a resource (answered UNAVAILABLE).",
            [((), unattributed)],
        ),
        family(
            "counter",
            "dp_allocated_devices_total",
            "Devices handed out by successful Allocate calls.",
            (((("resource", r),), n) for r, n in sorted(tally.allocated_devices.items())),
        ),
        family(
            "counter",
            "dp_registrations_total",
            "Register calls to the kubelet that ended, by resource and result.",
            (
                ((("resource", r), ("result", "ok" if ok else "failed")), n)
                for (r, ok), n in sorted(tally.registrations.items())
            ),
        ),
        family(
            "counter",
            "dp_health_changes_total",
            "Devices that turned healthy or unhealthy to the kubelet, by resource and new "
            "health (a device first seen unhealthy, or reserved with its group, counts).",
            (
                ((("resource", r), ("health", "healthy" if ok else "unhealthy")), n)
                for (r, ok), n in sorted(tally.health_changes.items())
            ),
        ),
        family(
            "gauge",
            "dp_kubelet_sync_phase",
            "1 for the phase of the kubelet's pod sync dp is in, else 0: syncing while a "
            "kubelet that has just started may not list every pod that holds a device.",
            [((("phase", phase.value),), int(front.sync.phase is phase)) for phase in SyncPhase],
        ),
        family(
            "gauge",
            "dp_iommu_groups_held_for_unlisted_pods",
            "IOMMU groups held because the kubelet's checkpoint gives a member to a pod "
            "PodResources does not list yet (while the kubelet syncs).",
            [((), len(front.allocations.unlisted_holds()))],
        ),
        family(
            "counter",
            "dp_kubelet_starts_total",
            "Times kubelet.sock appeared, the first included: each makes dp register again.",
            [((), tally.kubelet_starts)],
        ),
    ]


def _cdi(front: DevicePluginFrontend) -> list[MetricFamily]:
    keeper = front.cdi
    if keeper is None:
        return []
    return [
        family(
            "gauge",
            "dp_cdi_specs_ok",
            "1 while every CDI spec dp keeps is in place in the spec directory, else 0 "
            "(Allocate then names no CDI device of a spec not in place).",
            [((), int(keeper.in_place))],
        ),
        family(
            "gauge",
            "dp_cdi_specs",
            "CDI spec files in place in the spec directory (dp keeps one per resource with "
            "a device whose nodes exist; 0 while the directory is missing).",
            [((), keeper.in_place_count)],
        ),
        family(
            "counter",
            "dp_cdi_spec_errors_total",
            "Times the spec directory could not be brought in step (each retried at the next "
            "host scan; logged as cdi-specs-not-written when the reason changes).",
            [((), keeper.failures)],
        ),
    ]


def families(front: DevicePluginFrontend) -> list[MetricFamily]:
    """Every family of the device-plugin front end, in a stable order."""
    return [*_per_resource(front), *_counters(front), *_cdi(front)]
