"""What a container gets for a prepared claim: CDI names and KEP-5304 metadata.

Per device, a CDI device (`cdi.claims`) whose edits are the VFIO nodes
`Allocate` gives (`ClaimDevice.edits`); per request of a claim made for
extended resources, one with KubeVirt's variable (`extended`). Per request, the KEP-5304 device
metadata, as the Kubernetes helper writes it
(`k8s.io/dynamic-resource-allocation/kubeletplugin/metadata.go`): one
`DeviceMetadata` object per API version, newest first, attribute values as
`{"string": ...}`, mounted by a CDI device of its own (`cdi.claims`) at
`/var/run/kubernetes.io/dra-device-attributes/resourceclaims/<claim>/
<request>/<driver>-metadata.json` (`resourceclaimtemplates/<podClaimName>/...`
for a claim made from a template; `api/metadata/helpers.go`). KubeVirt 1.9
reads only `v1alpha1`. The content is plain data; the shell renders and
writes the files.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs

from ..cdi.claims import claim_device_id, claim_request_device_id, metadata_device_id
from .claims import PreparedDevice
from .extended import request_envs
from .pool_content import AttributeValue, Version
from .prepared import ClaimDevice, PreparedClaim

__all__ = [
    "CONTAINER_METADATA_DIR",
    "METADATA_API_VERSIONS",
    "RequestMetadata",
    "attribute_json",
    "base_request",
    "prepared_devices",
    "request_metadata",
]

CONTAINER_METADATA_DIR = "/var/run/kubernetes.io/dra-device-attributes"
# Newest first: a reader takes the first object whose apiVersion it knows.
METADATA_API_VERSIONS = ("metadata.resource.k8s.io/v1beta1", "metadata.resource.k8s.io/v1alpha1")


def attribute_json(value: AttributeValue) -> dict[str, object]:
    """`resource.k8s.io/v1` `DeviceAttribute`: exactly one of int, bool, string, version."""
    if isinstance(value, Version):
        return {"version": value.text}
    if isinstance(value, bool):
        return {"bool": value}
    if isinstance(value, int):
        return {"int": value}
    return {"string": value}


def base_request(request: str) -> str:
    """`gpu/high-memory` -> `gpu` (resourceclaim.BaseRequestRef)."""
    return request.split("/", 1)[0]


@attrs.frozen
class RequestMetadata:
    """One request's metadata file: its CDI device, where the container sees
    it, and its objects (one per `METADATA_API_VERSIONS`, in that order)."""

    request: str  # the base request name: the file's and the CDI device's
    cdi_device_id: str
    container_path: str
    objects: tuple[Mapping[str, object], ...] = attrs.field(hash=False)


def _container_path(driver: str, prepared: PreparedClaim, request: str) -> str:
    if prepared.pod_claim_name:
        return (
            f"{CONTAINER_METADATA_DIR}/resourceclaimtemplates/{prepared.pod_claim_name}/"
            f"{request}/{driver}-metadata.json"
        )
    return (
        f"{CONTAINER_METADATA_DIR}/resourceclaims/{prepared.claim.name}/"
        f"{request}/{driver}-metadata.json"
    )


def _by_request(prepared: PreparedClaim) -> dict[str, list[ClaimDevice]]:
    """Request reference (`req` or `req/sub`) -> its devices, in claim order."""
    found: dict[str, list[ClaimDevice]] = {}
    for device in prepared.devices:
        for request in device.requests:
            found.setdefault(request, []).append(device)
    return found


def request_metadata(driver: str, prepared: PreparedClaim) -> tuple[RequestMetadata, ...]:
    """Every request's metadata file for `prepared`, sorted by request."""
    claim = prepared.claim
    files = []
    for request, devices in sorted(_by_request(prepared).items()):
        base = base_request(request)
        objects = []
        for api_version in METADATA_API_VERSIONS:
            content: dict[str, object] = {
                "apiVersion": api_version,
                "kind": "DeviceMetadata",
                "metadata": {
                    "name": claim.name,
                    "namespace": claim.namespace,
                    "uid": claim.uid,
                    "generation": 1,
                },
            }
            if prepared.pod_claim_name:
                content["podClaimName"] = prepared.pod_claim_name
            content["requests"] = [
                {
                    "name": request,
                    "devices": [
                        {
                            "driver": driver,
                            "pool": device.pool,
                            "name": device.name,
                            "attributes": {
                                key: attribute_json(value) for key, value in device.attributes
                            },
                        }
                        for device in devices
                    ],
                }
            ]
            objects.append(content)
        files.append(
            RequestMetadata(
                base,
                metadata_device_id(driver, claim.uid, base),
                _container_path(driver, prepared, base),
                tuple(objects),
            )
        )
    return tuple(files)


def prepared_devices(driver: str, prepared: PreparedClaim) -> tuple[PreparedDevice, ...]:
    """The NodePrepareResources answer's devices: each with its own CDI device,
    the metadata CDI device of each request it serves and, in a claim made
    for extended resources, the variables' CDI device of each of those
    requests. The kubelet gives a container the IDs of every device of its
    requests, so an ID shared by two devices reaches it twice: a runtime
    applies the same edits twice, which changes nothing."""
    uid = prepared.claim.uid
    with_env = {e.request for e in request_envs(prepared)}
    answer = []
    for device in prepared.devices:
        ids = [claim_device_id(driver, uid, device.name)]
        for request in device.requests:
            meta = metadata_device_id(driver, uid, base_request(request))
            if meta not in ids:
                ids.append(meta)
        ids += [claim_request_device_id(driver, uid, r) for r in device.requests if r in with_env]
        answer.append(PreparedDevice(device.requests, device.pool, device.name, tuple(ids)))
    return tuple(answer)
