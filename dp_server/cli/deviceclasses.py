"""`dp-server device-classes`: the DeviceClasses of dp's config, as YAML to apply.

The classes are the core's (`dp_core.dra.deviceclasses`); this renders them,
one document each, in the config's order, with a header that says where
they came from. The same config always gives the same text, so a shipped
copy can be checked against the command (tests/test_device_classes.py).
"""

from __future__ import annotations

import json

from dp_core.dra import DraDeviceClass

__all__ = ["HEADER", "render"]

HEADER = """\
# A DeviceClass per resource dp serves through DRA (`frontend: dra`), written
# by `dp-server device-classes --config <dp's config>`: write them again
# whenever the config changes (docs/operations.md, "Moving a node from
# device plugins to DRA").
#
# Each takes exactly its resource's devices (dp's `resourceName` attribute,
# in the driver's domain; never a whole-IOMMU-group device), and names the
# resource as its extendedResourceName: a pod asking
# `resources.limits: {<resource>: N}`, as KubeVirt's launcher pods do, is
# served through DRA on a node whose allocatable for the name is 0, and by
# the device plugin where the node offers it (Kubernetes 1.36,
# DRAExtendedResource).
"""


def _document(device_class: DraDeviceClass) -> str:
    first, _, rest = device_class.expression.partition(" && ")
    lines = [
        "apiVersion: resource.k8s.io/v1",
        "kind: DeviceClass",
        "metadata:",
        f"  name: {device_class.name}",
        "  labels:",
        "    app.kubernetes.io/part-of: dp",
        "spec:",
        f"  extendedResourceName: {json.dumps(device_class.extended_resource_name)}",
        "  selectors:",
        "    - cel:",
        "        expression: >-",
        f"          {first} &&",
        f"          {rest}",
    ]
    return "\n".join(lines) + "\n"


def render(classes: tuple[DraDeviceClass, ...]) -> str:
    """The YAML stream of `classes`, after `HEADER`."""
    return HEADER + "---\n".join(_document(c) for c in classes)
