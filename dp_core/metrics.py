"""What a Node reports to monitoring, as metric families.

`collect(node)` reads the Node's state (gauges) and its `Tally` (counters)
into plain `MetricFamily` values. The names, label sets and help texts here
are dp's monitoring interface; rendering them in Prometheus' text format is the
shell's job, so another shell can export them another way.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable
from typing import Literal

import attrs

from .config.config import DEVICE_PLUGIN
from .deviceplugin.registration import Phase
from .deviceplugin.sync import SyncPhase
from .node import Node
from .tally import OK, RPC_METHODS

__all__ = ["MetricFamily", "Sample", "collect"]

_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")

Labels = tuple[tuple[str, str], ...]


def _check_labels(instance: object, attribute: object, labels: Labels) -> None:
    for name, _ in labels:
        if not _LABEL_NAME.fullmatch(name) or name.startswith("__"):
            raise ValueError(f"{name!r} is not a metric label name")


@attrs.frozen
class Sample:
    """One value of a family, with its labels in a fixed order."""

    labels: Labels = attrs.field(validator=_check_labels)
    value: float


def _check_name(instance: MetricFamily, attribute: object, name: str) -> None:
    if not _METRIC_NAME.fullmatch(name):
        raise ValueError(f"{name!r} is not a metric name")
    if instance.kind == "counter" and not name.endswith("_total"):
        raise ValueError(f"counter {name!r} must end in _total")


@attrs.frozen
class MetricFamily:
    kind: Literal["gauge", "counter"] = attrs.field(
        validator=attrs.validators.in_(("gauge", "counter"))
    )
    name: str = attrs.field(validator=_check_name)
    help: str
    samples: tuple[Sample, ...]


def _family(
    kind: Literal["gauge", "counter"],
    name: str,
    text: str,
    samples: Iterable[tuple[Labels, float]],
) -> MetricFamily:
    return MetricFamily(kind, name, text, tuple(Sample(labels, value) for labels, value in samples))


def _per_resource(node: Node) -> list[MetricFamily]:
    front = node.device_plugin
    names = front.resource_names()
    held: Counter[str] = Counter()
    for allocation in front.allocations.all():
        held[allocation.resource] += len(allocation.device_ids)
    phases = front.registrar.phases()
    # Healthy before reservations: a device whose group another holder has
    # is Unhealthy to the kubelet, but it is reserved, not broken.
    usable = {
        resource.name: {device.id for device in resource.devices if device.healthy}
        for resource in node.inventory.offered_by(DEVICE_PLUGIN).resources
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
        _family(
            "gauge",
            "dp_resource_devices",
            "Devices a resource advertises to the kubelet: healthy, unhealthy, or reserved "
            "(Unhealthy to the kubelet while another allocation holds their IOMMU group).",
            devices,
        ),
        _family(
            "gauge",
            "dp_resource_allocated_devices",
            "Devices of a resource that dp handed out and has not seen released.",
            [((("resource", name),), held[name]) for name in names],
        ),
        _family(
            "gauge",
            "dp_resource_registration_phase",
            "1 for the phase a resource's registration with the kubelet is in, else 0.",
            (
                ((("resource", name), ("phase", phase.value)), int(phases.get(name) is phase))
                for name in names
                for phase in Phase
            ),
        ),
        _family(
            "gauge",
            "dp_resource_streams",
            "ListAndWatch streams the kubelet has open for a resource.",
            [((("resource", name),), len(front.streams(name))) for name in names],
        ),
    ]


def _node_wide(node: Node) -> list[MetricFamily]:
    tally = node.tally
    errors: Counter[str] = Counter()
    unattributed = 0
    for (method, resource, code), count in tally.rpcs.items():
        if code != OK:
            errors[method] += count
        if not resource:
            unattributed += count
    return [
        _family(
            "gauge",
            "dp_skipped_devices",
            "Selected devices dp does not advertise; `dp-server scan` says why.",
            [((), len(node.inventory.skipped))],
        ),
        _family(
            "gauge",
            "dp_host_scan_problems",
            "Entries the last host scan could not read (malformed or vanished sysfs).",
            [((), len(node.snapshot.problems))],
        ),
        _family(
            "gauge",
            "dp_bind_functions",
            "Functions dp is moving to vfio-pci now (in_flight), failed to move (failed), "
            "or is giving back to their driver because their IOMMU group could not be "
            "moved whole (giving_back).",
            [
                ((("state", "in_flight"),), len(node.bind_book.in_flight)),
                ((("state", "failed"),), len(node.bind_book.failed)),
                ((("state", "giving_back"),), len(node.bind_book.giving_back)),
            ],
        ),
        _family(
            "counter",
            "dp_rpcs_total",
            "Device-plugin RPCs the kubelet made, by method, resource and status code "
            "(resource empty when the connection could not be attributed).",
            (
                ((("method", method), ("resource", resource), ("code", code)), count)
                for (method, resource, code), count in sorted(tally.rpcs.items())
            ),
        ),
        _family(
            "counter",
            "dp_rpc_errors_total",
            "Device-plugin RPCs answered with an error, by method; every method is always "
            "reported, so the first error shows as an increase.",
            [((("method", method),), errors[method]) for method in sorted(RPC_METHODS.values())],
        ),
        _family(
            "counter",
            "dp_unattributed_rpcs_total",
            "RPCs on a connection dp could not attribute to a resource (answered UNAVAILABLE).",
            [((), unattributed)],
        ),
        _family(
            "counter",
            "dp_allocated_devices_total",
            "Devices handed out by successful Allocate calls.",
            (((("resource", r),), n) for r, n in sorted(tally.allocated_devices.items())),
        ),
        _family(
            "counter",
            "dp_registrations_total",
            "Register calls to the kubelet that ended, by resource and result.",
            (
                ((("resource", r), ("result", "ok" if ok else "failed")), n)
                for (r, ok), n in sorted(tally.registrations.items())
            ),
        ),
        _family(
            "counter",
            "dp_health_changes_total",
            "Devices that turned healthy or unhealthy to the kubelet, by resource and new "
            "health (a device first seen unhealthy, or reserved with its group, counts).",
            (
                ((("resource", r), ("health", "healthy" if ok else "unhealthy")), n)
                for (r, ok), n in sorted(tally.health_changes.items())
            ),
        ),
        _family(
            "counter",
            "dp_binds_total",
            "Moves of a function to vfio-pci that dp carried out, by result.",
            (
                ((("result", "ok" if ok else "failed"),), n)
                for ok, n in sorted(tally.bindings.items())
            ),
        ),
        _family(
            "gauge",
            "dp_kubelet_sync_phase",
            "1 for the phase of the kubelet's pod sync dp is in, else 0: syncing while a "
            "kubelet that has just started may not list every pod that holds a device.",
            [
                ((("phase", phase.value),), int(node.device_plugin.sync.phase is phase))
                for phase in SyncPhase
            ],
        ),
        _family(
            "gauge",
            "dp_iommu_groups_held_for_unlisted_pods",
            "IOMMU groups held because the kubelet's checkpoint gives a member to a pod "
            "PodResources does not list yet (while the kubelet syncs).",
            [((), len(node.device_plugin.allocations.unlisted_holds()))],
        ),
        _family(
            "counter",
            "dp_kubelet_starts_total",
            "Times kubelet.sock appeared, the first included: each makes dp register again.",
            [((), tally.kubelet_starts)],
        ),
        _family(
            "counter",
            "dp_host_scans_total",
            "Host scans the core was given.",
            [((), tally.host_scans)],
        ),
    ]


def _cdi(node: Node) -> list[MetricFamily]:
    keeper = node.device_plugin.cdi
    if keeper is None:
        return []
    return [
        _family(
            "gauge",
            "dp_cdi_specs_ok",
            "1 while every CDI spec dp keeps is in place in the spec directory, else 0 "
            "(Allocate then names no CDI device of a spec not in place).",
            [((), int(keeper.in_place))],
        ),
        _family(
            "gauge",
            "dp_cdi_specs",
            "CDI spec files in place in the spec directory (dp keeps one per resource with "
            "a device whose nodes exist; 0 while the directory is missing).",
            [((), keeper.in_place_count)],
        ),
        _family(
            "counter",
            "dp_cdi_spec_errors_total",
            "Times the spec directory could not be brought in step (each retried at the next "
            "host scan; logged as cdi-specs-not-written when the reason changes).",
            [((), keeper.failures)],
        ),
    ]


def collect(node: Node) -> tuple[MetricFamily, ...]:
    """Every dp metric family of `node`, in a stable order."""
    return (*_per_resource(node), *_node_wide(node), *_cdi(node))
