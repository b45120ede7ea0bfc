"""KubeVirt's variables for a claim the scheduler made for extended resources (KEP-5004).

With `DRAExtendedResource` (beta, on by default in Kubernetes 1.36) a pod
that asks `resources.limits: {nvidia.com/TU104GL_Tesla_T4: 1}` on a node
whose allocatable for that name is 0, while a DeviceClass names it as its
`extendedResourceName`, is served through one claim the scheduler makes for
the pod (annotated `resource.kubernetes.io/extended-resource-claim: "true"`,
the pod its controller owner), one request per container and resource
(`container-<i>-request-<j>`); the pod's `status.extendedResourceClaimStatus.
requestMappings` say which container's resource each request serves, and the
kubelet hands a container the CDI devices of its mapped requests.

KubeVirt's virt-controller writes exactly such limits for a `hostDevices` or
`gpus` entry of a VMI, and virt-launcher then finds the entry's addresses in
`PCI_RESOURCE_<NAME>` (`MDEV_PCI_RESOURCE_<NAME>` for an mdev), `<NAME>` the
resource name as `env_var_name` folds it: what a device-plugin Allocate
gives. A request of such a claim therefore gets one more CDI device of its
own carrying that variable, naming every device of the request, comma-joined,
in allocation order. One per request and not per device: a runtime applying
CDI edits replaces a variable of the same name, so per-device variables would
leave only the last device's address.

`<NAME>` comes from the resource name the pod asked for (the mapping's), not
from dp's own name for the device: an operator's DeviceClass may name the
devices under another extended resource name, and KubeVirt derives the
variable from the name in the VMI's spec, which is the name the pod asked for.

Other claims get no variable: KubeVirt's DRA path (`GPUsWithDRA`,
`HostDevicesWithDRA`) reads a device's address from the KEP-5304 metadata
(`metadata`), and no resource name belongs to an ordinary claim's request.
"""

from __future__ import annotations

import attrs

from ..config.names import env_var_name
from ..inventory.classes import CLASSES
from .prepared import PreparedClaim

__all__ = ["EXTENDED_RESOURCE_CLAIM_ANNOTATION", "RequestEnv", "request_envs"]

#: The annotation (k8s.io/api/resource/v1 `ExtendedResourceClaimAnnotation`)
#: on the claim the scheduler makes for a pod's extended resources.
EXTENDED_RESOURCE_CLAIM_ANNOTATION = "resource.kubernetes.io/extended-resource-claim"

# Longest first: no prefix is another's start today, and none may shadow one later.
_PREFIXES = tuple(
    sorted(
        {c.env_prefix for c in CLASSES.values() if c.env_prefix is not None},
        key=len,
        reverse=True,
    )
)


@attrs.frozen
class RequestEnv:
    """The variables a container mapped to `request` gets ("NAME=value")."""

    request: str
    env: tuple[str, ...]


def _prefix(name: str) -> str | None:
    return next((p for p in _PREFIXES if name.startswith(p)), None)


def request_envs(prepared: PreparedClaim) -> tuple[RequestEnv, ...]:
    """KubeVirt's variables for each request of `prepared` that serves an
    extended resource (`PreparedClaim.extended_resources`), sorted by request;
    a request whose devices have no variable (a shared character device) has none."""
    found = []
    for request, resource in prepared.extended_resources:
        values: dict[str, list[str]] = {}  # prefix -> the devices' IDs, in order
        for device in prepared.devices:
            if request not in device.requests:
                continue
            for name, value in device.edits.envs:
                prefix = _prefix(name)
                if prefix is not None:
                    values.setdefault(prefix, []).append(value)
        env = tuple(
            f"{env_var_name(prefix, resource)}={','.join(ids)}"
            for prefix, ids in sorted(values.items())
        )
        if env:
            found.append(RequestEnv(request, env))
    return tuple(found)
