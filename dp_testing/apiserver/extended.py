"""Extended resources served by DRA (KEP-5004), as the 1.36 scheduler decides and names them.

From kubernetes v1.36 `pkg/scheduler/framework/plugins/dynamicresources/
extendeddynamicresources.go`:

- A pod's request for an extended resource is backed by DRA when a
  DeviceClass names it (`spec.extendedResourceName`, or the implicit
  `deviceclass.resource.kubernetes.io/<class>`); on a node it is served by
  DRA when it is backed and the node's allocatable for it is 0, by the
  device plugin when the node has it allocatable (above 0), and the pod does
  not fit a node that has neither (`filterExtendedResources`).
- The requests served by DRA go into one claim per pod, in the pod's
  namespace, named `<pod>-extended-resources-<5 random>` (`generateName`),
  annotated `resource.kubernetes.io/extended-resource-claim: "true"`, with the
  pod as its controller owner; one request per container and resource,
  `container-<i>-request-<j>` (`i` the container's index among init and
  regular containers, `j` the resource's index among the container's sorted
  request names), `exactly` the class and the container's count, requests
  sorted by name (`createRequestsAndMappings`). Init containers that are not
  sidecars reuse a later container's request where it is big enough; this
  emulator models regular containers and sidecars, and refuses the rest.
- `pod.status.extendedResourceClaimStatus` gets the claim's name and one
  mapping (container name, resource name, request name) per container and
  resource (`patchPodExtendedResourceClaimStatus`), before the pod is bound.

The device classes' CEL selectors are evaluated for the one form dp writes:
equalities joined by `&&` on `device.driver` and on `device.attributes[
"<domain>"].<id>`; any other form is refused, so a test can never pass on a
selector nothing here understood.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any, Protocol

__all__ = [
    "ANNOTATION",
    "IMPLICIT_PREFIX",
    "ExtendedRequest",
    "class_for",
    "node_rule",
    "pod_extended_requests",
    "selector_matcher",
]

Obj = dict[str, Any]


class Device(Protocol):
    """A device as a selector sees it (`scheduler.Device`)."""

    driver: str

    def attribute(self, name: str) -> object: ...


ANNOTATION = "resource.kubernetes.io/extended-resource-claim"
IMPLICIT_PREFIX = "deviceclass.resource.kubernetes.io/"
_NATIVE = ("cpu", "memory", "ephemeral-storage", "pods", "storage")

_DRIVER = re.compile(r'device\.driver == "([^"]+)"')
_ATTRIBUTE = re.compile(r'device\.attributes\["([^"]+)"\]\.([A-Za-z_][A-Za-z0-9_]*) == "([^"]*)"')


def is_extended(name: str) -> bool:
    """`schedutil.IsDRAExtendedResourceName`: an extended resource name, or an implicit one."""
    if name.startswith(IMPLICIT_PREFIX):
        return True
    if name in _NATIVE or name.startswith("hugepages-") or "/" not in name:
        return False
    return not name.split("/", 1)[0].endswith("kubernetes.io")


def _driver_is(driver: str) -> Callable[[Device], bool]:
    return lambda d: d.driver == driver


def _attribute_is(domain: str, identifier: str, value: str) -> Callable[[Device], bool]:
    def check(d: Device) -> bool:
        # A bare attribute is in the driver's domain; another's is qualified.
        name = identifier if domain == d.driver else f"{domain}/{identifier}"
        return d.attribute(name) == value

    return check


def selector_matcher(expression: str) -> Callable[[Device], bool]:
    """A device predicate for a CEL expression of the form dp writes; ValueError for any other."""
    checks: list[Callable[[Device], bool]] = []
    for clause in (c.strip() for c in expression.split("&&")):
        if match := _DRIVER.fullmatch(clause):
            checks.append(_driver_is(match.group(1)))
        elif match := _ATTRIBUTE.fullmatch(clause):
            checks.append(_attribute_is(*match.groups()))
        else:
            raise ValueError(f"the emulator cannot evaluate the CEL clause {clause!r}")
    return lambda d: all(check(d) for check in checks)


def class_for(resource: str, classes: list[Obj]) -> Obj | None:
    """The DeviceClass backing `resource`: by its explicit name, or the implicit one."""
    if resource.startswith(IMPLICIT_PREFIX):
        wanted = resource.removeprefix(IMPLICIT_PREFIX)
        return next((c for c in classes if c["metadata"]["name"] == wanted), None)
    named = [c for c in classes if (c.get("spec") or {}).get("extendedResourceName") == resource]
    # The scheduler's cache keeps the newest class for a name.
    named.sort(key=lambda c: c["metadata"].get("creationTimestamp", ""))
    return named[-1] if named else None


def _quantity(value: object) -> int:
    text = str(value)
    if not text.isdigit():
        raise ValueError(f"the emulator takes whole counts of extended resources, not {text!r}")
    return int(text)


def _requests(container: Obj) -> dict[str, int]:
    """A container's requests; limits stand for missing requests, as defaulting does."""
    resources = container.get("resources") or {}
    found = {k: _quantity(v) for k, v in (resources.get("limits") or {}).items() if is_extended(k)}
    found.update(
        {k: _quantity(v) for k, v in (resources.get("requests") or {}).items() if is_extended(k)}
    )
    return found


def node_rule(pod: Obj, node: Obj, classes: list[Obj]) -> tuple[dict[str, Obj], str | None]:
    """The pod's extended resources to serve through DRA on `node` (name -> class),
    or why the pod does not fit the node."""
    allocatable = (node.get("status") or {}).get("allocatable") or {}
    wanted: set[str] = set()
    for container in _containers(pod):
        wanted |= {name for name, count in _requests(container).items() if count}
    by_dra: dict[str, Obj] = {}
    for name in sorted(wanted):
        found = class_for(name, classes)
        if found is not None and _quantity(allocatable.get(name, "0")) == 0:
            by_dra[name] = found
        elif name not in allocatable:
            return {}, f"cannot fit resource {name}"
    return by_dra, None


def _containers(pod: Obj) -> list[Obj]:
    spec = pod.get("spec") or {}
    return list(spec.get("initContainers") or ()) + list(spec.get("containers") or ())


class ExtendedRequest:
    """One request of the claim, and the class whose selector its devices must match."""

    def __init__(self, name: str, device_class: Obj, count: int) -> None:
        self.name = name
        self.device_class = device_class
        self.count = count

    def obj(self) -> Obj:
        return {
            "name": self.name,
            "exactly": {
                "deviceClassName": self.device_class["metadata"]["name"],
                "allocationMode": "ExactCount",
                "count": self.count,
            },
        }

    def matcher(self) -> Callable[[Device], bool]:
        checks = [
            selector_matcher(s["cel"]["expression"])
            for s in (self.device_class.get("spec") or {}).get("selectors") or ()
        ]
        return lambda d: all(check(d) for check in checks)


def pod_extended_requests(
    pod: Obj, by_dra: Mapping[str, Obj]
) -> tuple[list[ExtendedRequest], list[Obj]]:
    """The claim's requests, sorted by name, and the pod's request mappings."""
    spec = pod.get("spec") or {}
    inits = len(spec.get("initContainers") or ())
    requests: list[ExtendedRequest] = []
    mappings: list[Obj] = []
    for resource in sorted(by_dra):
        for index, container in enumerate(_containers(pod)):
            wanted = _requests(container)
            count = wanted.get(resource, 0)
            if not count:
                continue
            sidecar = container.get("restartPolicy") == "Always"
            if index < inits and not sidecar:
                raise ValueError("the emulator does not model init containers' reuse of requests")
            # Defaulting makes every limit without a request a request.
            resources = container.get("resources") or {}
            names = sorted({*(resources.get("requests") or {}), *(resources.get("limits") or {})})
            request = f"container-{index}-request-{names.index(resource)}"
            requests.append(ExtendedRequest(request, by_dra[resource], count))
            mappings.append(
                {
                    "containerName": container["name"],
                    "resourceName": resource,
                    "requestName": request,
                }
            )
    requests.sort(key=lambda r: r.name)
    return requests, mappings
