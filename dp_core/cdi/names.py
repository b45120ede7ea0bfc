"""Container Device Interface (CDI) names: kinds, device names, spec files (docs/design.md §9).

A CDI spec file names a `kind` (`vendor/class`) and lists devices, each with
the container edits a runtime applies when a container asks for
`vendor/class=name`. This module holds the naming rules, as the CDI
specification (cncf-tags/container-device-interface SPEC.md, `pkg/parser`,
v1.1.0) states them, and how a device-plugin resource's kind and spec file
are named; `spec` holds what a spec says. Which devices go into a spec is the
front end's decision (`resources` for the device-plugin front end, `claims`
for DRA's).

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

__all__ = [
    "CLASS_PREFIX",
    "SPEC_PREFIX",
    "cdi_kind",
    "device_name_error",
    "qualified_name",
    "spec_name",
]

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
    """The file name (without extension) dp keeps the spec of resource kind `kind` under."""
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
