"""A prepared DRA claim's CDI specs: their kinds, names and content.

The one place these names are made, for the core's answer to the kubelet
(the CDI IDs of each device) and for the files the shell writes:

- `<driver>_claim_<UID>.json`, kind `<driver>/claim`, a device
  `<UID>-<device>` per device of the claim, with the VFIO nodes Allocate
  gives it, and for a claim made for extended resources a device
  `<UID>_<request>` per request, with KubeVirt's variable naming the
  request's devices (`dra.extended`); a UID is 36 characters, so the `-` or
  `_` after it tells the two apart whatever the device or request is called;
- `<driver>_metadata_<UID>_<request>.json`, kind `<driver>/metadata`, a
  device `<UID>_<request>` that bind-mounts the request's KEP-5304 metadata
  file read-only, as the Kubernetes helper names and mounts them
  (`k8s.io/dynamic-resource-allocation/kubeletplugin/metadata.go`).

None starts with `dp-`, which the device-plugin front end's spec files keep
as their own (`names.SPEC_PREFIX`), so neither front end removes the other's.
"""

from __future__ import annotations

from collections.abc import Iterable

from ..inventory.edits import DeviceSpec
from .names import qualified_name
from .spec import CdiDevice, CdiMount, CdiSpec

__all__ = [
    "METADATA_MOUNT_OPTIONS",
    "claim_device_id",
    "claim_kind",
    "claim_request_device_id",
    "claim_spec",
    "claim_spec_name",
    "metadata_device_id",
    "metadata_kind",
    "metadata_spec",
    "metadata_spec_prefix",
]

# As the Kubernetes helper mounts it: read-only, nothing to execute or open as a device.
METADATA_MOUNT_OPTIONS = ("ro", "nosuid", "nodev", "bind")


def claim_kind(driver: str) -> str:
    return f"{driver}/claim"


def metadata_kind(driver: str) -> str:
    return f"{driver}/metadata"


def _claim_device(uid: str, device: str) -> str:
    return f"{uid}-{device}"


def _metadata_device(uid: str, request: str) -> str:
    return f"{uid}_{request}"


def _request_device(uid: str, request: str) -> str:
    return f"{uid}_{request}"


def claim_request_device_id(driver: str, uid: str, request: str) -> str:
    """The CDI ID of the variables of claim `uid`'s request `request`."""
    return qualified_name(claim_kind(driver), _request_device(uid, request))


def claim_device_id(driver: str, uid: str, device: str) -> str:
    """The CDI ID a container asks for claim `uid`'s device `device` by."""
    return qualified_name(claim_kind(driver), _claim_device(uid, device))


def metadata_device_id(driver: str, uid: str, request: str) -> str:
    """The CDI ID of the metadata of claim `uid`'s base request `request`."""
    return qualified_name(metadata_kind(driver), _metadata_device(uid, request))


def claim_spec_name(driver: str, uid: str) -> str:
    """The name (the file's, without extension) of claim `uid`'s spec."""
    return f"{driver}_claim_{uid}"


def claim_spec(
    driver: str,
    uid: str,
    devices: Iterable[tuple[str, tuple[DeviceSpec, ...]]],
    requests: Iterable[tuple[str, tuple[str, ...]]] = (),
) -> CdiSpec | None:
    """The claim's spec: a device per (name, device nodes) that has nodes
    and per (request, variables) that has variables (CDI refuses a device
    with empty edits); None when none has."""
    found = tuple(CdiDevice(_claim_device(uid, name), nodes) for name, nodes in devices if nodes)
    found += tuple(
        CdiDevice(_request_device(uid, request), env=env) for request, env in requests if env
    )
    if not found:
        return None
    return CdiSpec(claim_spec_name(driver, uid), claim_kind(driver), found)


def metadata_spec_prefix(driver: str, uid: str) -> str:
    """What the names of claim `uid`'s metadata specs start with (each ends in its request)."""
    return f"{driver}_metadata_{uid}_"


def metadata_spec(
    driver: str, uid: str, request: str, host_path: str, container_path: str
) -> CdiSpec:
    """The spec that mounts request `request`'s metadata file, `host_path` on
    the host, at `container_path` in the container."""
    mount = CdiMount(host_path, container_path, METADATA_MOUNT_OPTIONS)
    return CdiSpec(
        metadata_spec_prefix(driver, uid) + request,
        metadata_kind(driver),
        (CdiDevice(_metadata_device(uid, request), mounts=(mount,)),),
    )
