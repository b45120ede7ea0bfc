"""What the emulated API server accepts: the published schema, and rules checked in code.

The schema is `resource.k8s.io/v1`'s, as published (see tests/data/k8s/README.md);
it is given by path so the emulator carries no copy of its own. The rules in
code are those of `pkg/apis/resource/validation/validation.go` that a driver
can break: device and counter-set limits per slice, devices and shared
counters never in one slice, DNS-label names, unique device names, exactly one
node selection field, attribute limits. Defaulting: a device taint without
`timeAdded` gets the current time, as the API server does.

Feature gates: a server without `DRAPartitionableDevices` or `DRADeviceTaints`
drops those features' fields from a slice before it validates and stores it,
unless the slice it replaces uses them already (`dropDisabledFields` in
`pkg/registry/resource/resourceslice/strategy.go`); `drop_disabled_fields`
does the same.
"""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from dp_testing.apiserver.store import ApiFailure

__all__ = [
    "DEVICE_TAINTS",
    "FEATURES",
    "PARTITIONABLE_DEVICES",
    "Validator",
    "default_slice",
    "drop_disabled_fields",
]

Obj = dict[str, Any]

_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_KINDS = {
    "resourceslices": "io.k8s.api.resource.v1.ResourceSlice",
    "resourceclaims": "io.k8s.api.resource.v1.ResourceClaim",
    "events": "io.k8s.api.events.v1.Event",
}
_NODE_FIELDS = ("nodeName", "nodeSelector", "allNodes", "perDeviceNodeSelection")
MAX_DEVICES = 128
MAX_DEVICES_WITH_TAINTS_OR_COUNTERS = 64
MAX_COUNTER_SETS = 8
MAX_ATTRIBUTES_AND_CAPACITIES = 32
MAX_STRING_ATTRIBUTE = 64


class Validator:
    """Checks an object of `resource` against the schema at `schema_path` and the code rules."""

    def __init__(self, schema_path: Path) -> None:
        # Imported here: jsonschema is a test dependency, and `dp-server demo`
        # runs the emulator without a schema after a plain `pip install .`.
        import jsonschema
        import referencing
        import referencing.jsonschema

        document = json.loads(schema_path.read_text())
        resource = referencing.jsonschema.DRAFT202012.create_resource(document)
        registry: referencing.Registry[Any] = referencing.Registry().with_resource(
            document["$id"], resource
        )
        self._validators = {
            plural: jsonschema.Draft202012Validator(
                {"$ref": f"{document['$id']}#/$defs/{name}"}, registry=registry
            )
            for plural, name in _KINDS.items()
        }

    def check(self, resource: str, obj: Obj) -> None:
        """Raise a 422 `ApiFailure` naming every problem of `obj`, if it has any."""
        problems = []
        validator = self._validators.get(resource)
        if validator is not None:
            for error in validator.iter_errors(obj):
                where = ".".join(str(p) for p in error.absolute_path) or "<object>"
                problems.append(f"{where}: {error.message}")
        if resource == "resourceslices" and not problems:
            problems.extend(_slice_rules(obj.get("spec") or {}))
        if resource == "events" and not problems:
            problems.extend(_event_rules(obj))
        if problems:
            raise ApiFailure(422, "Invalid", "; ".join(problems))


def _slice_rules(spec: Obj) -> list[str]:
    problems = []
    devices = spec.get("devices")
    counter_sets = spec.get("sharedCounters")
    chosen = [k for k in _NODE_FIELDS if spec.get(k)]
    if len(chosen) != 1:
        problems.append(f"spec: exactly one of {', '.join(_NODE_FIELDS)} must be set, not {chosen}")
    if not _DNS_SUBDOMAIN.fullmatch(spec.get("driver", "")) or len(spec.get("driver", "")) > 63:
        problems.append(
            f"spec.driver: {spec.get('driver')!r} is not a DNS subdomain of at most 63 characters"
        )
    pool = spec.get("pool", {})
    if pool.get("generation", -1) < 0 or pool.get("resourceSliceCount", 0) <= 0:
        problems.append(f"spec.pool: generation must be >= 0 and resourceSliceCount > 0: {pool}")
    if devices is not None and counter_sets is not None:
        problems.append("spec: only one of `sharedCounters` or `devices` is allowed")
    devices = devices or []
    advanced = any(d.get("taints") or d.get("consumesCounters") for d in devices)
    limit = MAX_DEVICES_WITH_TAINTS_OR_COUNTERS if advanced else MAX_DEVICES
    if len(devices) > limit:
        problems.append(f"spec.devices: {len(devices)} devices, at most {limit} allowed")
    if len(counter_sets or []) > MAX_COUNTER_SETS:
        problems.append(f"spec.sharedCounters: more than {MAX_COUNTER_SETS} sets")
    names = [d.get("name", "") for d in devices]
    if len(set(names)) != len(names):
        problems.append("spec.devices: device names are not unique")
    for index, device in enumerate(devices):
        where = f"spec.devices[{index}]"
        if not _DNS_LABEL.fullmatch(device.get("name", "")) or len(device.get("name", "")) > 63:
            problems.append(f"{where}.name: {device.get('name')!r} is not a DNS label")
        attributes = device.get("attributes") or {}
        if len(attributes) + len(device.get("capacity") or {}) > MAX_ATTRIBUTES_AND_CAPACITIES:
            problems.append(
                f"{where}: more than {MAX_ATTRIBUTES_AND_CAPACITIES} attributes and capacities"
            )
        for key, value in attributes.items():
            set_fields = [k for k, v in value.items() if v is not None]
            if len(set_fields) != 1:
                problems.append(f"{where}.attributes[{key}]: exactly one value type must be set")
            if len(str(value.get("string", ""))) > MAX_STRING_ATTRIBUTE:
                problems.append(
                    f"{where}.attributes[{key}]: string longer than {MAX_STRING_ATTRIBUTE}"
                )
    return problems


_EVENT_REQUIRED = ("reportingController", "reportingInstance", "action", "reason")
_EVENT_FIELD_MAX = 128
_EVENT_NOTE_MAX = 1024
_MICRO_TIME = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}(Z|[+-]\d\d:\d\d)")


def _event_rules(event: Obj) -> list[str]:
    """`ValidateEventCreate` of events.k8s.io/v1 (`pkg/apis/core/validation/events.go`)."""
    problems = []
    for field in _EVENT_REQUIRED:
        value = event.get(field) or ""
        if not value:
            problems.append(f"{field}: Required value")
        elif len(value) > _EVENT_FIELD_MAX:
            problems.append(f"{field}: longer than {_EVENT_FIELD_MAX} characters")
    if not event.get("eventTime"):
        problems.append("eventTime: Required value")
    elif not _MICRO_TIME.fullmatch(str(event["eventTime"])):
        # metav1.MicroTime is read as RFC 3339 with exactly six fractional digits.
        problems.append(f"eventTime: {event['eventTime']!r} is not RFC3339Micro")
    if event.get("type") not in ("Normal", "Warning"):
        problems.append(f"type: Unsupported value: {event.get('type')!r}")
    if len((event.get("note") or "").encode()) > _EVENT_NOTE_MAX:
        problems.append(f"note: longer than {_EVENT_NOTE_MAX} bytes")
    regarding = event.get("regarding") or {}
    namespace = (event.get("metadata") or {}).get("namespace")
    if regarding.get("namespace") and namespace and regarding["namespace"] != namespace:
        problems.append("regarding.namespace: does not match the event's namespace")
    return problems


def default_slice(obj: Obj) -> Obj:
    """The API server's defaulting of a ResourceSlice: taints get their `timeAdded`."""
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    for device in (obj.get("spec") or {}).get("devices") or []:
        for taint in device.get("taints") or []:
            taint.setdefault("timeAdded", now)
    return obj


PARTITIONABLE_DEVICES = "DRAPartitionableDevices"
DEVICE_TAINTS = "DRADeviceTaints"
FEATURES = frozenset({PARTITIONABLE_DEVICES, DEVICE_TAINTS})


def _uses_counters(spec: Obj) -> bool:
    devices = spec.get("devices") or []
    return bool(
        spec.get("sharedCounters")
        or spec.get("perDeviceNodeSelection") is not None
        or any(
            d.get("consumesCounters")
            or any(k in d for k in ("nodeName", "nodeSelector", "allNodes"))
            for d in devices
        )
    )


def _uses_taints(spec: Obj) -> bool:
    return any(d.get("taints") for d in spec.get("devices") or [])


def drop_disabled_fields(obj: Obj, old: Obj | None, disabled: frozenset[str]) -> Obj:
    """`obj` (a slice being created, or replacing `old`) as a server with the
    `disabled` feature gates off keeps it."""
    spec = obj.get("spec") or {}
    old_spec = (old or {}).get("spec") or {}
    devices = spec.get("devices") or []
    if DEVICE_TAINTS in disabled and not _uses_taints(old_spec):
        for device in devices:
            device.pop("taints", None)
    if PARTITIONABLE_DEVICES in disabled and not _uses_counters(old_spec):
        spec.pop("sharedCounters", None)
        spec.pop("perDeviceNodeSelection", None)
        for device in devices:
            for key in ("consumesCounters", "nodeName", "nodeSelector", "allNodes"):
                device.pop(key, None)
    return obj
