"""A CDI spec as the JSON document a runtime reads (CDI SPEC.md, "CDI JSON Specification")."""

from __future__ import annotations

import json
from typing import Any

from dp_core import CdiDevice, CdiSpec

__all__ = ["render", "spec_document"]


def spec_document(spec: CdiSpec) -> dict[str, Any]:
    """The spec as JSON values, fields in the order SPEC.md lists them."""
    return {
        "cdiVersion": spec.cdi_version,
        "kind": spec.kind,
        "devices": [_device(device) for device in spec.devices],
    }


def render(spec: CdiSpec) -> bytes:
    """The bytes of the spec's file: the same spec always gives the same bytes."""
    return (json.dumps(spec_document(spec), indent=2) + "\n").encode()


def _device(device: CdiDevice) -> dict[str, Any]:
    edits: dict[str, Any] = {}
    if device.env:
        edits["env"] = list(device.env)
    if device.device_nodes:
        nodes = []
        for spec in device.device_nodes:
            node = {"path": spec.container_path}
            # Absent, hostPath is the path (and needs no cdiVersion 0.5.0).
            if spec.host_path != spec.container_path:
                node["hostPath"] = spec.host_path
            if spec.permissions:
                node["permissions"] = spec.permissions
            nodes.append(node)
        edits["deviceNodes"] = nodes
    if device.mounts:
        edits["mounts"] = [
            {
                "hostPath": mount.host_path,
                "containerPath": mount.container_path,
                "options": list(mount.options),
            }
            for mount in device.mounts
        ]
    return {"name": device.name, "containerEdits": edits}
