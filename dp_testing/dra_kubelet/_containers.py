"""Which CDI devices the kubelet hands each container of a pod, from its prepared claims.

From kubernetes v1.36 `pkg/kubelet/cm/dra/manager.go` (`GetResources`) and
`claiminfo.go` (`cdiDevicesAsList`):

- a container's claims are its `resources.claims` entries (a claim of
  `pod.spec.resourceClaims`, optionally one request of it), the claim's name
  from `pod.status.resourceClaimStatuses` for a claim made from a template;
- with `pod.status.extendedResourceClaimStatus`, the container also gets the
  requests of that claim mapped to it (`requestMappings` entries with its
  name, for a resource the container asks a nonzero amount of);
- for each (claim, request), the CDI IDs of every device whose request names
  hold the request (or name none), in the order the driver answered them,
  repeats and all: nothing is removed twice given.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from dp_testing.dra_kubelet._rpc import Device

__all__ = ["container_cdi_devices"]

Obj = dict[str, Any]
_IMPLICIT = "deviceclass.resource.kubernetes.io/"


def _is_extended(name: str) -> bool:
    # schedutil.IsDRAExtendedResourceName: an extended (not native) name, or an implicit one.
    if name.startswith(_IMPLICIT):
        return True
    return "/" in name and not name.split("/", 1)[0].endswith("kubernetes.io")


def _nonzero(container: Obj) -> set[str]:
    resources = container.get("resources") or {}
    # Defaulting: a limit without a request is the request.
    wanted = {**(resources.get("limits") or {}), **(resources.get("requests") or {})}
    return {name for name, value in wanted.items() if str(value) not in ("0", "")}


def container_cdi_devices(pod: Obj, claims: Mapping[str, Sequence[Device]]) -> dict[str, list[str]]:
    """Container name -> the CDI IDs its runtime is given, for `pod` whose
    claims the kubelet prepared: `claims` has each claim's answered devices
    by the claim's name (a claim not there is an error, as in the kubelet)."""
    spec = pod.get("spec") or {}
    status = pod.get("status") or {}
    generated = {
        s["name"]: s.get("resourceClaimName") for s in status.get("resourceClaimStatuses") or ()
    }
    names = {}
    for pod_claim in spec.get("resourceClaims") or ():
        name = pod_claim.get("resourceClaimName") or generated.get(pod_claim["name"])
        if name:
            names[pod_claim["name"]] = name
    extended = status.get("extendedResourceClaimStatus")
    found: dict[str, list[str]] = {}
    for container in list(spec.get("initContainers") or ()) + list(spec.get("containers") or ()):
        wanted: dict[str, list[str]] = {}  # claim name -> requests ("" = all)
        for ref in (container.get("resources") or {}).get("claims") or ():
            claim = names.get(ref["name"])
            if claim is not None:
                wanted.setdefault(claim, []).append(ref.get("request") or "")
        if extended is not None:
            asked = {n for n in _nonzero(container) if _is_extended(n)}
            for mapping in extended.get("requestMappings") or ():
                if (
                    mapping["containerName"] == container["name"]
                    and mapping["resourceName"] in asked
                ):
                    wanted.setdefault(extended["resourceClaimName"], []).append(
                        mapping["requestName"]
                    )
        ids: list[str] = []
        for claim, requests in wanted.items():
            if claim not in claims:
                raise KeyError(
                    f"internal error: unable to get claim info for ResourceClaim {claim}"
                )
            for request in requests:
                for device in claims[claim]:
                    if not request or not device.request_names or request in device.request_names:
                        ids += device.cdi_device_ids
        found[container["name"]] = ids
    return found
