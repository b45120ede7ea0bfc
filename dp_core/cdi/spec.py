"""A CDI spec file's content as values: devices, their edits, the version
the content needs (CDI `specs-go/version.go`, v1.1.0); and the effect and
input by which the shell keeps a front end's specs in place."""

from __future__ import annotations

from collections.abc import Iterable

import attrs

from ..inventory.edits import DeviceSpec
from .names import qualified_name

__all__ = [
    "MIN_CDI_VERSION",
    "CdiDevice",
    "CdiMount",
    "CdiSpec",
    "CdiSpecsChanged",
    "CdiSpecsWritten",
    "minimum_version",
]

# The earliest version the reference library accepts and writes (vEarliest).
MIN_CDI_VERSION = "0.3.0"


@attrs.frozen
class CdiMount:
    """A mount a device's edits add to the container (CDI `containerEdits.mounts`)."""

    host_path: str
    container_path: str
    options: tuple[str, ...] = ()


@attrs.frozen
class CdiDevice:
    """One device of a spec: its name and the edits a container asking for it gets.

    A device node whose `host_path` equals its `container_path` is written
    without `hostPath`, which CDI reads as the same path (and which needs
    cdiVersion 0.5.0 only when it differs).
    """

    name: str
    device_nodes: tuple[DeviceSpec, ...] = ()
    env: tuple[str, ...] = ()  # "NAME=value"
    mounts: tuple[CdiMount, ...] = ()


@attrs.frozen(cache_hash=True)
class CdiSpec:
    """One spec file's content. `name` is the file's name without its extension."""

    name: str
    kind: str
    devices: tuple[CdiDevice, ...]

    @property
    def cdi_version(self) -> str:
        return minimum_version(self.kind, self.devices)

    def qualified_name(self, device: str) -> str:
        return qualified_name(self.kind, device)


@attrs.frozen
class CdiSpecsChanged:
    """Effect: make the spec directory hold exactly `specs`, dp's files among what is there.

    Every spec the node keeps is listed, changed or not: the shell writes those
    whose content differs from the file, removes the files of specs no longer
    listed and answers with `CdiSpecsWritten`. Emitted when a spec changed, and
    on every host scan while some spec is not in place (a retry).
    """

    specs: tuple[CdiSpec, ...]


def _spec_set(specs: Iterable[CdiSpec]) -> frozenset[CdiSpec]:
    return frozenset(specs)


@attrs.frozen
class CdiSpecsWritten:
    """Input: which of the specs of the last `CdiSpecsChanged` are in place.

    `in_place` holds the specs as written; `problem` says why the others are
    not (empty when all are). Allocate names only devices of specs in place,
    so that the kubelet never hands the runtime a CDI name it cannot resolve.
    """

    in_place: frozenset[CdiSpec] = attrs.field(converter=_spec_set)
    problem: str = ""


def minimum_version(kind: str, devices: tuple[CdiDevice, ...]) -> str:
    """The lowest cdiVersion whose rules allow this content (specs-go/version.go).

    0.6.0 allows a `.` in the class; 0.5.0 a device name that starts with a
    digit, and `hostPath` on a device node. Nothing dp writes needs more.
    """
    _, _, klass = kind.partition("/")
    if "." in klass:
        return "0.6.0"
    for device in devices:
        if device.name[:1].isdigit():
            return "0.5.0"
        if any(node.host_path != node.container_path for node in device.device_nodes):
            return "0.5.0"
    return MIN_CDI_VERSION
