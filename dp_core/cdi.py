"""Container Device Interface (CDI) specs as values: names, kinds, versions (docs/design.md §9).

A CDI spec file names a `kind` (`vendor/class`) and lists devices, each with
the container edits a runtime applies when a container asks for
`vendor/class=name`. This module holds what such a spec says and the
naming rules, as the CDI specification (cncf-tags/container-device-interface
SPEC.md, `pkg/parser`, `specs-go/version.go`, v1.1.0) states them. It does no
I/O and renders no JSON: the shell writes the files (`dp_server.cdi`). Which
devices go into a spec is the front end's decision (`node_cdi` for the
device-plugin front end).

How a resource name becomes a kind:

- vendor: the resource's domain (`nvidia.com`). A Kubernetes domain is a DNS
  subdomain, which fits CDI's vendor rule except that CDI wants a letter
  first: a domain that starts with a digit gets `dp.` in front.
- class: `dp-` and the resource's name part (`dp-TU104GL_Tesla_T4`). The
  prefix keeps dp's kinds apart from every other spec writer's (NVIDIA's
  `nvidia.com/gpu`, a DRA driver's) even when an operator names a resource
  after theirs, and gives the class the letter CDI wants first. A class is at
  most 63 characters: a longer one keeps 51 characters of the name and ends
  in `-` and 8 hex digits of its SHA-256.
- file: `dp-<vendor>_<class without its dp- prefix>`, so dp's files are
  recognisably dp's (`_` cannot occur in a domain, so the name is unique).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable

import attrs

from .answers import DeviceSpec

__all__ = [
    "CLASS_PREFIX",
    "MIN_CDI_VERSION",
    "SPEC_PREFIX",
    "CdiDevice",
    "CdiMount",
    "CdiSpec",
    "CdiSpecsChanged",
    "CdiSpecsWritten",
    "cdi_kind",
    "device_name_error",
    "minimum_version",
    "qualified_name",
    "spec_name",
]

# The earliest version the reference library accepts and writes (vEarliest).
MIN_CDI_VERSION = "0.3.0"
CLASS_PREFIX = "dp-"
SPEC_PREFIX = "dp-"
_CLASS_MAX = 63
_HASH_DIGITS = 8

# CDI's rules (pkg/parser): a vendor or class starts with a letter, ends with
# a letter or digit, and has letters, digits, `_`, `-` and `.` between; a
# device name may also hold `:` and start with a digit.
_VENDOR_OR_CLASS = re.compile(r"[A-Za-z]([A-Za-z0-9_.-]*[A-Za-z0-9])?")
_LETTER = re.compile(r"[A-Za-z]")
_DEVICE_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9_.:-]*[A-Za-z0-9])?")


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


def cdi_kind(resource_name: str) -> str:
    """The CDI kind (`vendor/class`) of a Kubernetes extended resource name."""
    domain, _, short = resource_name.partition("/")
    vendor = domain if _LETTER.match(domain) else f"dp.{domain}"
    klass = CLASS_PREFIX + short
    if len(klass) > _CLASS_MAX:
        digest = hashlib.sha256(short.encode()).hexdigest()[:_HASH_DIGITS]
        klass = klass[: _CLASS_MAX - _HASH_DIGITS - 1] + "-" + digest
    kind = f"{vendor}/{klass}"
    if not _VENDOR_OR_CLASS.fullmatch(vendor) or not _VENDOR_OR_CLASS.fullmatch(klass):
        raise ValueError(f"{resource_name!r} gives CDI kind {kind!r}, which CDI does not accept")
    return kind


def spec_name(kind: str) -> str:
    """The file name (without extension) dp keeps the spec of `kind` under."""
    vendor, _, klass = kind.partition("/")
    return f"{SPEC_PREFIX}{vendor}_{klass.removeprefix(CLASS_PREFIX)}"


def qualified_name(kind: str, device: str) -> str:
    """`vendor/class=name`, the name a container asks for a device by."""
    return f"{kind}={device}"


def device_name_error(name: str) -> str | None:
    """Why CDI would refuse `name` as a device name, or None."""
    if _DEVICE_NAME.fullmatch(name):
        return None
    return (
        f"{name!r} is not a CDI device name: letters, digits, '_', '-', '.' and ':', "
        "starting and ending with a letter or digit"
    )


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
