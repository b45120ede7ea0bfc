"""A CDI spec reader for tests, written from the CDI specification alone.

It reads a spec file as a runtime would and resolves a fully qualified
device name (`vendor/class=name`) to the container edits it stands for. It
shares nothing with dp's writer (dp_core.cdi, dp_server.cdi): its rules are
taken from the specification's text, cncf-tags/container-device-interface
SPEC.md (spec version 1.1.0, at commit 05ae4b5), and where the prose leaves
a rule open, from that repository's reference parser, which containerd,
CRI-O and Podman load specs with:

- a vendor (the kind's prefix) is a DNS subdomain; a vendor and a class start
  with a letter (pkg/parser: validateVendorOrClassName);
- a device name may hold `:` (pkg/parser: ValidateDeviceName; SPEC.md's
  prose lists only `-`, `_` and `.`);
- loading fails on a field the spec does not define, and when `cdiVersion`
  is lower than what the fields used need (SPEC.md, "Released versions");
- a device's `containerEdits` must not be empty (pkg/cdi: Device.validate).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "CdiError",
    "DeviceNode",
    "Edits",
    "Mount",
    "Spec",
    "read_dir",
    "read_spec",
    "resolve",
]

VERSIONS = (
    "0.1.0", "0.2.0", "0.3.0", "0.4.0", "0.5.0", "0.6.0", "0.7.0", "0.8.0", "1.0.0", "1.1.0",
)  # fmt: skip

_SPEC_FIELDS = {"cdiVersion", "kind", "annotations", "devices", "containerEdits"}
_DEVICE_FIELDS = {"name", "annotations", "containerEdits"}
_EDIT_FIELDS = {
    "env", "deviceNodes", "mounts", "hooks", "additionalGids", "intelRdt", "netDevices",
}  # fmt: skip
_MOUNT_FIELDS = {"hostPath", "containerPath", "type", "options"}
_NODE_FIELDS = {
    "path", "hostPath", "type", "major", "minor", "fileMode", "permissions", "uid", "gid",
}  # fmt: skip

_SEMVER = re.compile(r"(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)")
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_CLASS = re.compile(r"[A-Za-z]([-_.A-Za-z0-9]*[A-Za-z0-9])?")
_NAME = re.compile(r"[A-Za-z0-9]([-_.:A-Za-z0-9]*[A-Za-z0-9])?")


class CdiError(ValueError):
    pass


@dataclass(frozen=True)
class DeviceNode:
    path: str
    host_path: str  # the path itself when the spec gives none
    permissions: str


@dataclass(frozen=True)
class Mount:
    host_path: str
    container_path: str
    options: tuple[str, ...]


@dataclass(frozen=True)
class Edits:
    env: tuple[str, ...] = ()
    device_nodes: tuple[DeviceNode, ...] = ()
    mounts: tuple[Mount, ...] = ()

    def __add__(self, other: Edits) -> Edits:
        return Edits(
            self.env + other.env,
            self.device_nodes + other.device_nodes,
            self.mounts + other.mounts,
        )


@dataclass(frozen=True)
class Spec:
    source: str
    version: str
    kind: str
    devices: dict[str, Edits]
    common: Edits  # applied whenever any device of the spec is asked for


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


class _Reader:
    def __init__(self, source: str) -> None:
        self.source = source
        self.needs = "0.3.0"  # the earliest version with the rules above

    def fail(self, message: str) -> CdiError:
        return CdiError(f"{self.source}: {message}")

    def need(self, version: str) -> None:
        if _version_key(version) > _version_key(self.needs):
            self.needs = version

    def fields(self, value: Any, allowed: set[str], where: str) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise self.fail(f"{where} is not an object")
        unknown = sorted(set(value) - allowed)
        if unknown:
            raise self.fail(f"{where} has unknown fields {unknown}")
        return value

    def string(self, value: Any, where: str) -> str:
        if not isinstance(value, str):
            raise self.fail(f"{where} is not a string")
        return value

    def kind(self, kind: str) -> None:
        vendor, slash, klass = kind.partition("/")
        if not slash or not vendor or not klass:
            raise self.fail(f"kind {kind!r} is not <vendor>/<class>")
        labels = vendor.split(".")
        if len(vendor) > 253 or not all(_DNS_LABEL.fullmatch(label) for label in labels):
            raise self.fail(f"vendor {vendor!r} is not a DNS subdomain")
        if not vendor[0].isalpha():
            raise self.fail(f"vendor {vendor!r} does not start with a letter")
        if len(klass) > 63 or not _CLASS.fullmatch(klass):
            raise self.fail(f"class {klass!r} is not a valid class name")
        if "." in klass:
            self.need("0.6.0")

    def edits(self, value: Any, where: str) -> Edits:
        edits = self.fields(value, _EDIT_FIELDS, where)
        for field in ("hooks", "additionalGids", "intelRdt", "netDevices"):
            if field in edits:
                # dp writes none of these; a reader for them is not needed to check dp.
                raise self.fail(f"{where}.{field}: not read by this test reader")
        env = edits.get("env", [])
        if not isinstance(env, list):
            raise self.fail(f"{where}.env is not a list")
        for item in env:
            name, equals, _ = self.string(item, f"{where}.env[]").partition("=")
            if not equals or not name:
                raise self.fail(f"{where}.env: {item!r} is not NAME=value")
        nodes = edits.get("deviceNodes", [])
        if not isinstance(nodes, list):
            raise self.fail(f"{where}.deviceNodes is not a list")
        read = []
        for index, raw in enumerate(nodes):
            at = f"{where}.deviceNodes[{index}]"
            node = self.fields(raw, _NODE_FIELDS, at)
            if "path" not in node:
                raise self.fail(f"{at}: path is required")
            path = self.string(node["path"], f"{at}.path")
            if not path:
                raise self.fail(f"{at}: path is empty")
            host_path = path
            if "hostPath" in node:
                host_path = self.string(node["hostPath"], f"{at}.hostPath")
                self.need("0.5.0")
            permissions = self.string(node.get("permissions", ""), f"{at}.permissions")
            if permissions.strip("rwm") and permissions != "none":
                raise self.fail(f"{at}: permissions {permissions!r} are not of r, w and m")
            read.append(DeviceNode(path, host_path, permissions))
        return Edits(tuple(str(item) for item in env), tuple(read), self.mounts(edits, where))

    def mounts(self, edits: dict[str, Any], where: str) -> tuple[Mount, ...]:
        raw = edits.get("mounts", [])
        if not isinstance(raw, list):
            raise self.fail(f"{where}.mounts is not a list")
        found = []
        for index, item in enumerate(raw):
            at = f"{where}.mounts[{index}]"
            mount = self.fields(item, _MOUNT_FIELDS, at)
            for field in ("hostPath", "containerPath"):
                if not self.string(mount.get(field), f"{at}.{field}"):
                    raise self.fail(f"{at}: {field} is empty")
            options = mount.get("options", [])
            if not isinstance(options, list):
                raise self.fail(f"{at}.options is not a list")
            found.append(
                Mount(
                    mount["hostPath"],
                    mount["containerPath"],
                    tuple(self.string(o, f"{at}.options[]") for o in options),
                )
            )
        return tuple(found)

    def spec(self, document: Any) -> Spec:
        spec = self.fields(document, _SPEC_FIELDS, "the spec")
        for field in ("cdiVersion", "kind", "devices"):
            if field not in spec:
                raise self.fail(f"{field} is required")
        version = self.string(spec["cdiVersion"], "cdiVersion")
        if not _SEMVER.fullmatch(version) or version not in VERSIONS:
            raise self.fail(f"cdiVersion {version!r} is not a released CDI version")
        kind = self.string(spec["kind"], "kind")
        self.kind(kind)
        if "annotations" in spec:
            self.need("0.6.0")
        common = Edits()
        if "containerEdits" in spec:
            common = self.edits(spec["containerEdits"], "containerEdits")
        devices = spec["devices"]
        if not isinstance(devices, list) or not devices:
            raise self.fail("devices must be a non-empty list")
        read: dict[str, Edits] = {}
        for index, raw in enumerate(devices):
            at = f"devices[{index}]"
            device = self.fields(raw, _DEVICE_FIELDS, at)
            if "name" not in device or "containerEdits" not in device:
                raise self.fail(f"{at}: name and containerEdits are required")
            name = self.string(device["name"], f"{at}.name")
            if not _NAME.fullmatch(name):
                raise self.fail(f"{at}: {name!r} is not a valid device name")
            if name[0].isdigit():
                self.need("0.5.0")
            if "annotations" in device:
                self.need("0.6.0")
            if name in read:
                raise self.fail(f"{at}: device {name!r} is listed twice")
            edits = self.edits(device["containerEdits"], f"{at}.containerEdits")
            if not edits.env and not edits.device_nodes and not edits.mounts:
                raise self.fail(f"{at}: device {name!r} has empty containerEdits")
            read[name] = edits
        if _version_key(version) < _version_key(self.needs):
            raise self.fail(f"cdiVersion {version} is too low: the content needs {self.needs}")
        return Spec(self.source, version, kind, read, common)


def read_spec(data: str | bytes, source: str = "<spec>") -> Spec:
    """Read one spec file's content; CdiError says what is wrong with it, and where."""
    try:
        document = json.loads(data)
    except ValueError as error:
        raise CdiError(f"{source}: not JSON: {error}") from None
    return _Reader(source).spec(document)


def read_dir(directory: Path) -> list[Spec]:
    """Every spec in `directory`, as a runtime finds them: `*.json`, no subdirectories."""
    return [
        read_spec(path.read_bytes(), str(path))
        for path in sorted(directory.iterdir())
        if path.suffix == ".json" and path.is_file()
    ]


def resolve(specs: Iterable[Spec], qualified: str) -> Edits:
    """The edits a container asking for `qualified` gets: its device's, then its spec's."""
    kind, equals, name = qualified.partition("=")
    if not equals or not name or "/" not in kind:
        raise CdiError(f"{qualified!r} is not a fully qualified name vendor/class=name")
    found = [spec for spec in specs if spec.kind == kind and name in spec.devices]
    if not found:
        raise CdiError(f"unresolvable CDI device {qualified!r}")
    if len(found) > 1:
        sources = ", ".join(spec.source for spec in found)
        raise CdiError(f"conflicting device {qualified!r} (specs {sources})")
    spec = found[0]
    return spec.devices[name] + spec.common
