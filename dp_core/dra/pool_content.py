"""What one DRA resource pool holds, as plain values (`resource.k8s.io/v1`).

The core decides a pool's whole content (`PoolContent`): its devices with
their attributes, the counters they consume and their taints, and the shared
counter sets. Cutting it into ResourceSlices within the API's limits, the
pool generation and the Kubernetes objects themselves are the shell's job;
the limits it must keep are here, read from `k8s.io/api/resource/v1/types.go`
(1.35 and later; 1.34 had no separate counter-set slice).
"""

from __future__ import annotations

from collections.abc import Iterable

import attrs

__all__ = [
    "MAX_ATTRIBUTES_AND_CAPACITIES",
    "MAX_ATTRIBUTE_VALUE_LENGTH",
    "MAX_COUNTER_SETS_PER_SLICE",
    "MAX_COUNTERS_PER_SET",
    "MAX_DEVICES_PER_SLICE",
    "MAX_DEVICES_PER_SLICE_ADVANCED",
    "AttributeValue",
    "CounterConsumption",
    "CounterSet",
    "DeviceTaint",
    "PoolContent",
    "PoolDevice",
    "Version",
]

# ResourceSliceMaxDevices, and ResourceSliceMaxDevicesWithAdvancedFeatures for
# a slice where any device has taints or consumes counters.
MAX_DEVICES_PER_SLICE = 128
MAX_DEVICES_PER_SLICE_ADVANCED = 64
# ResourceSliceMaxCounterSets, ResourceSliceMaxCountersPerCounterSet.
MAX_COUNTER_SETS_PER_SLICE = 8
MAX_COUNTERS_PER_SET = 32
# ResourceSliceMaxAttributesAndCapacitiesPerDevice, DeviceAttributeMaxValueLength.
MAX_ATTRIBUTES_AND_CAPACITIES = 32
MAX_ATTRIBUTE_VALUE_LENGTH = 64


@attrs.frozen
class Version:
    """A semantic-version attribute value (`{"version": ...}`), apart from a plain string."""

    text: str


# str -> {"string": v}, bool -> {"bool": v}, int -> {"int": v}, Version -> {"version": v.text}.
AttributeValue = str | bool | int | Version


def _pairs(value: Iterable[tuple[str, int]]) -> tuple[tuple[str, int], ...]:
    return tuple(sorted(value))


@attrs.frozen
class CounterSet:
    """`sharedCounters[]`: a named set of counters (name -> value) devices consume."""

    name: str
    counters: tuple[tuple[str, int], ...] = attrs.field(converter=_pairs)


@attrs.frozen
class CounterConsumption:
    """`devices[].consumesCounters[]`: how much of each counter of `counter_set` a device takes."""

    counter_set: str
    counters: tuple[tuple[str, int], ...] = attrs.field(converter=_pairs)


@attrs.frozen
class DeviceTaint:
    """`devices[].taints[]` (KEP-5055); dp only ever sets `NoSchedule`."""

    key: str
    effect: str = "NoSchedule"
    value: str = ""


def _attributes(
    value: Iterable[tuple[str, AttributeValue]],
) -> tuple[tuple[str, AttributeValue], ...]:
    return tuple(sorted(value, key=lambda pair: pair[0]))


def _consumptions(value: Iterable[CounterConsumption]) -> tuple[CounterConsumption, ...]:
    return tuple(value)


def _taints(value: Iterable[DeviceTaint]) -> tuple[DeviceTaint, ...]:
    return tuple(value)


@attrs.frozen
class PoolDevice:
    """One `devices[]` entry: a DNS-label name, attributes sorted by name, counters, taints."""

    name: str
    attributes: tuple[tuple[str, AttributeValue], ...] = attrs.field(
        default=(), converter=_attributes
    )
    consumes_counters: tuple[CounterConsumption, ...] = attrs.field(
        default=(), converter=_consumptions
    )
    taints: tuple[DeviceTaint, ...] = attrs.field(default=(), converter=_taints)

    def attribute(self, name: str) -> AttributeValue | None:
        for key, value in self.attributes:
            if key == name:
                return value
        return None

    @property
    def advanced(self) -> bool:
        """Whether a slice holding it is limited to `MAX_DEVICES_PER_SLICE_ADVANCED`."""
        return bool(self.consumes_counters or self.taints)


def _devices(value: Iterable[PoolDevice]) -> tuple[PoolDevice, ...]:
    return tuple(value)


def _counter_sets(value: Iterable[CounterSet]) -> tuple[CounterSet, ...]:
    return tuple(value)


@attrs.frozen
class PoolContent:
    """Everything one driver offers in one node's pool, before it is cut into slices.

    `pool` is the pool's name (the node's); `node_name` goes to every slice's
    `spec.nodeName`. Devices are sorted by name and counter sets by name, so
    equal content compares equal and the shell writes only on a change.
    """

    driver: str
    pool: str
    node_name: str
    devices: tuple[PoolDevice, ...] = attrs.field(default=(), converter=_devices)
    shared_counters: tuple[CounterSet, ...] = attrs.field(default=(), converter=_counter_sets)

    def device(self, name: str) -> PoolDevice | None:
        for device in self.devices:
            if device.name == name:
                return device
        return None
