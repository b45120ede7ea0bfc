"""The device-plugin front end's CDI specs: one per resource (docs/design.md §9).

`CdiKeeper` decides what each resource's spec holds, asks the shell to keep
the spec directory in step (`CdiSpecsChanged`) and remembers which specs the
shell reported in place (`CdiSpecsWritten`): Allocate names a device by its
CDI name only then, so the kubelet never hands the runtime a name it cannot
resolve.

What a spec holds, and why:

- Every device of the resource whose device nodes all exist on the host,
  healthy or not. A runtime resolves a CDI name when it creates the
  container and stats each node then ("failed to stat CDI host device"), so
  an entry whose node is missing could only fail; an entry for a device
  that is merely Unhealthy (its group held by another pod, a sibling being
  moved) resolves as it would have when it was allocated, for a container
  still being created. Allocate refuses Unhealthy devices, so no new
  container is given one.
- For each device, the device nodes Allocate gives for that device alone.
  Not its environment variable: KubeVirt's `PCI_RESOURCE_<NAME>` lists
  every device of the container, and a runtime applying CDI edits replaces
  a variable of the same name (the CDI library's spec editor does), so one
  entry per device would leave only the last device's address. Allocate
  keeps setting the variable, for all of them.
- Nothing for a device whose ID is not a CDI device name, or that has no
  device node (CDI refuses a device with empty edits).
"""

from __future__ import annotations

from collections.abc import Sequence

from ..host.snapshot import HostSnapshot
from ..inventory.advertised import AdvertisedDevice
from ..inventory.edits import container_allocation
from ..inventory.resources import Inventory, Resource
from ..log import Log
from .names import cdi_kind, device_name_error, qualified_name, spec_name
from .spec import CdiDevice, CdiSpec, CdiSpecsChanged, CdiSpecsWritten

__all__ = ["CdiKeeper", "resource_spec"]


def resource_spec(resource: Resource, snapshot: HostSnapshot) -> CdiSpec | None:
    """The spec of `resource` on this host, or None when no device belongs in one."""
    try:
        kind = cdi_kind(resource.name)
    except ValueError:
        return None
    devices = []
    for device in resource.devices:
        if device_name_error(device.id) is not None:
            continue
        nodes = container_allocation(resource, (device,)).devices
        if nodes and all(snapshot.has_dev_node(node.host_path) for node in nodes):
            devices.append(CdiDevice(device.id, nodes))
    if not devices:
        return None
    return CdiSpec(spec_name(kind), kind, tuple(devices))


class CdiKeeper:
    """The specs a node keeps, and which of them the shell has in place."""

    def __init__(self) -> None:
        self.specs: dict[str, CdiSpec] = {}  # by resource
        # resource -> (kind, device names) of its spec as the shell has it in place.
        self._in_place: dict[str, tuple[str, frozenset[str]]] = {}
        self._asked = False  # whether a CdiSpecsChanged has gone out yet
        self.problem = ""  # why some spec is not in place, as last reported
        self.failures = 0  # CdiSpecsWritten reports with a problem

    @property
    def in_place_count(self) -> int:
        """How many of the specs the shell reported in place."""
        return len(self._in_place.keys() & self.specs.keys())

    @property
    def in_place(self) -> bool:
        """Whether the shell reported every spec in place."""
        return self._asked and not self.problem and self._in_place.keys() == self.specs.keys()

    def refresh(self, inventory: Inventory, snapshot: HostSnapshot) -> list[CdiSpecsChanged | Log]:
        """A `CdiSpecsChanged` if a spec changed, none was asked for yet, or some is not
        in place (each host scan retries then)."""
        specs = {}
        for resource in inventory.resources:
            spec = resource_spec(resource, snapshot)
            if spec is not None:
                specs[resource.name] = spec
        if specs == self.specs and self.in_place:
            return []
        for name, spec in self.specs.items():
            if specs.get(name) != spec:
                self._in_place.pop(name, None)  # until the shell says the new one is in
        for name in self._in_place.keys() - specs.keys():
            del self._in_place[name]
        self.specs = specs
        self._asked = True
        return [CdiSpecsChanged(tuple(specs[name] for name in sorted(specs)))]

    def written(self, event: CdiSpecsWritten) -> list[CdiSpecsChanged | Log]:
        self._in_place = {
            name: (spec.kind, frozenset(device.name for device in spec.devices))
            for name, spec in self.specs.items()
            if spec in event.in_place
        }
        problem = event.problem
        if not problem and self._in_place.keys() != self.specs.keys():
            missing = sorted(self.specs.keys() - self._in_place.keys())
            problem = f"no spec in place for {', '.join(missing)}"
        effects: list[CdiSpecsChanged | Log] = []
        if problem:
            self.failures += 1
            if problem != self.problem:  # once while it lasts: each scan retries
                effects.append(
                    Log.error(
                        "cdi-specs-not-written",
                        reason=problem,
                        consequence="Allocate names no CDI device of a spec not in place",
                    )
                )
        elif self.problem:
            effects.append(Log.info("cdi-specs-written", specs=len(self.specs)))
        self.problem = problem
        return effects

    def names(self, resource: str, devices: Sequence[AdvertisedDevice]) -> tuple[str, ...]:
        """The CDI names of `devices` of `resource` whose spec is in place."""
        entry = self._in_place.get(resource)
        if entry is None:
            return ()
        kind, names = entry
        return tuple(qualified_name(kind, device.id) for device in devices if device.id in names)
