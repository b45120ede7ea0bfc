"""A pool's content as ResourceSlice objects (lightkube's models), and what counts as a change.

`cut` splits a `PoolContent` into the specs of its slices, within the limits
of `resource.k8s.io/v1` (`k8s.io/api/resource/v1/types.go` and
`pkg/apis/resource/validation/validation.go`): at most 128 devices in a
slice, 64 if any of them has taints or consumes counters; since 1.35 a slice
holds either devices or shared counter sets, never both, and at most 8 sets.
Devices are cut in name order, 64 to a slice whatever they carry, so the same
content always gives the same slices, and a taint coming or going (a health
change) never moves a device to another slice: it changes one slice only.

`content_key` is what a slice says apart from its pool generation, count and
server-set fields: two slices with the same key need no write.

`features_kept` compares a slice as sent with the slice the API server
stored: a server without a DRA feature drops that feature's fields on write
(`dropDisabledFields` in kubernetes' `pkg/registry/resource/resourceslice/
strategy.go`), which is how dp learns what the cluster has.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from lightkube.models.meta_v1 import ObjectMeta, OwnerReference
from lightkube.models.resource_v1 import (
    Counter,
    CounterSet,
    Device,
    DeviceAttribute,
    DeviceCounterConsumption,
    DeviceTaint,
    ResourcePool,
    ResourceSliceSpec,
)
from lightkube.resources.resource_v1 import ResourceSlice

from dp_core.dra import (
    MAX_COUNTER_SETS_PER_SLICE,
    MAX_DEVICES_PER_SLICE_ADVANCED,
    AttributeValue,
    PoolContent,
    PoolDevice,
    Version,
)
from dp_core.dra import CounterConsumption as CoreCounterConsumption
from dp_core.dra import CounterSet as CoreCounterSet
from dp_core.dra import DeviceTaint as CoreDeviceTaint

__all__ = [
    "COUNTERS",
    "TAINTS",
    "SliceBody",
    "content_key",
    "cut",
    "features_kept",
    "generate_name",
    "node_owner",
    "probe_object",
    "slice_object",
]

# What one slice carries besides the pool: its devices or its counter sets.
SliceBody = tuple[tuple[PoolDevice, ...], tuple[CoreCounterSet, ...]]

_NAME_MAX = 253
_GENERATED_SUFFIX = 5


def cut(content: PoolContent) -> list[SliceBody]:
    """The slices `content` is published as: counter sets first, then devices in name order."""
    bodies: list[SliceBody] = []
    sets = sorted(content.shared_counters, key=lambda s: s.name)
    for start in range(0, len(sets), MAX_COUNTER_SETS_PER_SLICE):
        bodies.append(((), tuple(sets[start : start + MAX_COUNTER_SETS_PER_SLICE])))
    devices = sorted(content.devices, key=lambda d: d.name)
    for start in range(0, len(devices), MAX_DEVICES_PER_SLICE_ADVANCED):
        bodies.append((tuple(devices[start : start + MAX_DEVICES_PER_SLICE_ADVANCED]), ()))
    return bodies


def generate_name(content: PoolContent) -> str:
    """`metadata.generateName` of a new slice: `<node>-<driver>-`, within a name's length."""
    prefix = f"{content.node_name}-{content.driver}"[: _NAME_MAX - _GENERATED_SUFFIX - 1]
    return prefix.rstrip(".-") + "-"


def node_owner(node: str, uid: str) -> OwnerReference:
    """The Node as controller of the slice: deleting the Node deletes its slices."""
    return OwnerReference(apiVersion="v1", kind="Node", name=node, uid=uid, controller=True)


def _attribute(value: AttributeValue) -> DeviceAttribute:
    # bool before int: a bool is an int to Python, not to Kubernetes.
    if isinstance(value, bool):
        return DeviceAttribute(bool=value)
    if isinstance(value, int):
        return DeviceAttribute(int=value)
    if isinstance(value, Version):
        return DeviceAttribute(version=value.text)
    return DeviceAttribute(string=value)


def _counters(pairs: Sequence[tuple[str, int]]) -> dict[str, Counter]:
    return {name: Counter(value=str(value)) for name, value in pairs}


def _device(device: PoolDevice) -> Device:
    return Device(
        name=device.name,
        attributes={key: _attribute(value) for key, value in device.attributes} or None,
        consumesCounters=[
            DeviceCounterConsumption(counterSet=c.counter_set, counters=_counters(c.counters))
            for c in device.consumes_counters
        ]
        or None,
        taints=[
            DeviceTaint(key=t.key, value=t.value or None, effect=t.effect) for t in device.taints
        ]
        or None,
    )


def slice_object(
    content: PoolContent,
    body: SliceBody,
    *,
    generation: int,
    count: int,
    owner: OwnerReference,
    name: str | None = None,
    resource_version: str | None = None,
) -> ResourceSlice:
    """One slice of the pool at `generation` of `count` slices: named `name` (an update,
    with `resource_version` as its precondition) or to be named by the server (a create)."""
    devices, sets = body
    spec = ResourceSliceSpec(
        driver=content.driver,
        pool=ResourcePool(name=content.pool, generation=generation, resourceSliceCount=count),
        nodeName=content.node_name,
        devices=[_device(d) for d in devices] if devices else None,
        sharedCounters=[CounterSet(name=s.name, counters=_counters(s.counters)) for s in sets]
        or None,
    )
    metadata = ObjectMeta(
        name=name,
        generateName=None if name else generate_name(content),
        resourceVersion=resource_version,
        ownerReferences=[owner],
    )
    return ResourceSlice(
        apiVersion="resource.k8s.io/v1", kind="ResourceSlice", metadata=metadata, spec=spec
    )


# The fields of partitionable devices (KEP-4815) and of device taints (KEP-5055).
COUNTERS = "counters"
TAINTS = "taints"

_PROBE = "dp-feature-probe"


def probe_object(content: PoolContent, owner: OwnerReference) -> ResourceSlice:
    """A slice for a server-side dry run that tells which DRA features the cluster
    keeps: one device that consumes a counter (`DRAPartitionableDevices`) and is
    tainted (`DRADeviceTaints`). The server drops what it lacks, as on a real
    write, and stores nothing; a counter set named by a device is not checked
    against the pool's (it may be in another slice since 1.35)."""
    device = PoolDevice(
        _PROBE,
        consumes_counters=(CoreCounterConsumption(_PROBE, (("slot", 1),)),),
        taints=(CoreDeviceTaint(f"{content.driver}/feature-probe"),),
    )
    probe = slice_object(content, ((device,), ()), generation=0, count=1, owner=owner)
    assert probe.metadata is not None
    probe.metadata.generateName = f"{generate_name(content)}probe-"[: _NAME_MAX - _GENERATED_SUFFIX]
    return probe


def _uses(spec: dict[str, Any], feature: str) -> bool:
    devices = spec.get("devices") or ()
    if feature == COUNTERS:
        return bool(spec.get("sharedCounters")) or any(d.get("consumesCounters") for d in devices)
    return any(d.get("taints") for d in devices)


def features_kept(sent: ResourceSlice, stored: ResourceSlice) -> dict[str, bool]:
    """For each feature whose fields `sent` used: whether `stored` still has them."""
    assert sent.spec is not None and stored.spec is not None
    before, after = sent.spec.to_dict(), stored.spec.to_dict()
    return {f: _uses(after, f) for f in (COUNTERS, TAINTS) if _uses(before, f)}


def _strip(spec: dict[str, Any], without: frozenset[str]) -> dict[str, Any]:
    spec = dict(spec)
    spec.pop("pool", None)
    if COUNTERS in without:
        spec.pop("sharedCounters", None)
    devices = []
    for device in spec.get("devices") or ():
        device = dict(device)
        if COUNTERS in without:
            device.pop("consumesCounters", None)
        if TAINTS in without:
            device.pop("taints", None)
        if device.get("taints"):
            # The API server stamps timeAdded on a taint that has none.
            device["taints"] = [
                {k: v for k, v in t.items() if k != "timeAdded"} for t in device["taints"]
            ]
        devices.append(device)
    if devices:
        spec["devices"] = devices
    return spec


def content_key(obj: ResourceSlice, without: frozenset[str] = frozenset()) -> str:
    """What `obj` offers and to whom: its spec without the pool, and its owners.

    `without` names features (`COUNTERS`, `TAINTS`) whose fields the API
    server drops: what it would store of `obj` is compared, so a write it
    cannot keep as sent is not made again and again."""
    assert obj.spec is not None and obj.metadata is not None
    owners = [
        {"kind": o.kind, "name": o.name, "uid": o.uid, "controller": bool(o.controller)}
        for o in obj.metadata.ownerReferences or ()
    ]
    return json.dumps([_strip(obj.spec.to_dict(), without), owners], sort_keys=True)
