"""An emulated kube-scheduler for DRA: waiting claims allocated the moment slices allow it.

The real scheduler allocates a pending pod's claims as soon as a complete
pool generation it can allocate from is visible (it ignores a generation
until `resourceSliceCount` slices of it exist), so a driver's first slices
are allocated from within milliseconds when claims wait. `Scheduler` does
the same against the emulator's store: every change to a ResourceSlice or a
ResourceClaim schedules one attempt on the next turn of the loop, which
allocates each waiting claim whole or not at all, first fit, following the
structured-parameters allocator's rules (`k8s.io/dynamic-resource-allocation/
structured`):

- only devices of a complete pool, in slice-name then device order;
- a device in another claim's allocation is taken;
- with `DRADeviceTaints` on (in the server's gates), a device tainted
  `NoSchedule` or `NoExecute` is not allocated (claims here tolerate nothing);
- with `DRAPartitionableDevices` on, a device is allocated only while every
  counter it consumes has room left in its pool's shared counter set, after
  what the allocated devices consume; with it off, counters are ignored.

A claim waits with a matcher per request (a predicate on the device, as a
DeviceClass's CEL selector would be); its allocation is written to
`status.allocation.devices.results`, as the scheduler writes it.

A pod given to `schedule` is scheduled to its node as KEP-5004 has it
(`extended`): its extended resources that the node serves through DRA are
allocated together, whole or not at all, and only then is the pod's claim
made (its name generated, the pod its controller owner), allocated and
reserved for the pod, the pod's `status.extendedResourceClaimStatus`
written, and the pod bound (`spec.nodeName`), in the order of the real
scheduler's PreBind and Bind; a pod whose extended resources the node serves
through the device plugin alone is bound with no claim. A pod that does not
fit yet waits, and is tried again on every change to slices, claims, classes,
pods and nodes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from dp_testing.apiserver.extended import ANNOTATION, node_rule, pod_extended_requests
from dp_testing.apiserver.rules import DEVICE_TAINTS, PARTITIONABLE_DEVICES
from dp_testing.apiserver.store import Event

if TYPE_CHECKING:
    from dp_testing.apiserver.server import ApiServerEmulator

__all__ = ["Device", "Scheduler"]

Obj = dict[str, Any]
Matcher = Callable[["Device"], bool]


class Device:
    """A device of a complete pool, as a selector sees it."""

    def __init__(self, driver: str, pool: str, obj: Obj) -> None:
        self.driver = driver
        self.pool = pool
        self.name: str = obj["name"]
        self.obj = obj

    def attribute(self, name: str) -> object:
        """The value of attribute `name` (`domain/id`; a bare id is in the driver's)."""
        attributes = self.obj.get("attributes") or {}
        short = name.removeprefix(f"{self.driver}/")
        value = attributes.get(name, attributes.get(short))
        if value is None:
            return None
        (kind,) = [k for k, v in value.items() if v is not None]
        return value[kind]

    @property
    def key(self) -> tuple[str, str, str]:
        return self.driver, self.pool, self.name


class Scheduler:
    """Allocates the claims given to `wait` from `server`'s slices, as soon as it can."""

    def __init__(self, server: ApiServerEmulator) -> None:
        self.server = server
        self.waiting: dict[tuple[str, str], dict[str, Matcher]] = {}
        self.counts: dict[tuple[str, str], dict[str, int]] = {}
        # (namespace, pod) -> node, for pods not bound yet; and why each does not fit now.
        self.pending: dict[tuple[str, str], str] = {}
        self.unschedulable: dict[tuple[str, str], str] = {}
        # (namespace, claim) -> [(request, driver, pool, device)], in the order allocated.
        self.allocated: dict[tuple[str, str], list[tuple[str, str, str, str]]] = {}
        self._due = False
        self._stop = server.store.listen(self._changed)

    def close(self) -> None:
        self._stop()

    def wait(
        self,
        namespace: str,
        name: str,
        requests: Mapping[str, Matcher],
        counts: Mapping[str, int] | None = None,
    ) -> None:
        """Claim `namespace/name` (in the store already) waits for one device per
        request (`counts` of a request, where given)."""
        self.waiting[(namespace, name)] = dict(requests)
        self.counts[(namespace, name)] = dict(counts or {})
        self._soon()

    def schedule(self, namespace: str, name: str, node: str) -> None:
        """Pod `namespace/name` (in the store already) is to be scheduled to `node`."""
        self.pending[(namespace, name)] = node
        self._soon()

    def _changed(self, event: Event) -> None:
        if event.resource in ("resourceslices", "resourceclaims", "deviceclasses", "nodes"):
            self._soon()
        elif event.resource == "pods" and self.pending:
            self._soon()

    def _soon(self) -> None:
        if not self._due:
            self._due = True
            asyncio.get_running_loop().call_soon(self._attempt)

    # -- one attempt -------------------------------------------------------------------

    def _attempt(self) -> None:
        self._due = False
        devices, counters = self._pools()
        used = self._in_use()
        taints = DEVICE_TAINTS not in self.server.disabled_features
        partitionable = PARTITIONABLE_DEVICES not in self.server.disabled_features
        left = {key: dict(values) for key, values in counters.items()}
        if partitionable:
            for device in devices:
                if device.key in used:
                    _consume(device, left)

        def choose(
            wanted: list[tuple[str, Matcher, int]],
        ) -> list[tuple[str, Device]] | None:
            """Devices for every request, whole or not at all (None)."""
            nonlocal left, used
            chosen: list[tuple[str, Device]] = []
            trial = {key: dict(values) for key, values in left.items()}
            taken = set(used)
            for request, matches, count in wanted:
                for _ in range(count):
                    for device in devices:
                        if device.key in taken or not matches(device):
                            continue
                        if taints and _tainted(device):
                            continue
                        if partitionable and not _consume(device, trial):
                            continue
                        chosen.append((request, device))
                        taken.add(device.key)
                        break
            if len(chosen) < sum(count for _, _, count in wanted):
                return None
            left, used = trial, taken
            return chosen

        for claim, requests in list(self.waiting.items()):
            counts = self.counts.get(claim, {})
            chosen = choose([(r, m, counts.get(r, 1)) for r, m in requests.items()])
            if chosen is None:
                continue  # whole or not at all; it waits on
            self._allocate(claim, chosen)
            del self.waiting[claim]
        for pod_key, node in list(self.pending.items()):
            try:
                self._schedule_pod(pod_key, node, choose)
            except ValueError as error:
                # What the emulator does not model is said, not retried forever.
                del self.pending[pod_key]
                self.unschedulable[pod_key] = f"not emulated: {error}"

    def _schedule_pod(
        self,
        pod_key: tuple[str, str],
        node: str,
        choose: Callable[[list[tuple[str, Matcher, int]]], list[tuple[str, Device]] | None],
    ) -> None:
        namespace, name = pod_key
        store = self.server.store
        pod = store.get("pods", namespace, name)
        by_dra, unfit = node_rule(pod, store.get("nodes", "", node), store.objects("deviceclasses"))
        if unfit is not None:
            self.unschedulable[pod_key] = unfit
            return
        requests, mappings = pod_extended_requests(pod, by_dra)
        if requests:
            chosen = choose([(r.name, r.matcher(), r.count) for r in requests])
            if chosen is None:
                self.unschedulable[pod_key] = "cannot allocate all claims"
                return
            claim = store.create(
                "resourceclaims",
                namespace,
                {
                    "apiVersion": "resource.k8s.io/v1",
                    "kind": "ResourceClaim",
                    "metadata": {
                        "generateName": f"{name}-extended-resources-",
                        "annotations": {ANNOTATION: "true"},
                        "ownerReferences": [
                            {
                                "apiVersion": "v1",
                                "kind": "Pod",
                                "name": name,
                                "uid": pod["metadata"]["uid"],
                                "controller": True,
                            }
                        ],
                    },
                    "spec": {"devices": {"requests": [r.obj() for r in requests]}},
                },
            )
            claim_name = claim["metadata"]["name"]
            reserved = [{"resource": "pods", "name": name, "uid": pod["metadata"]["uid"]}]
            self._allocate((namespace, claim_name), chosen, reserved)
            pod = store.get("pods", namespace, name)
            pod["status"] = {
                **(pod.get("status") or {}),
                "extendedResourceClaimStatus": {
                    "resourceClaimName": claim_name,
                    "requestMappings": mappings,
                },
            }
            pod = store.update("pods", namespace, name, pod, status=True)
        pod["spec"]["nodeName"] = node
        store.update("pods", namespace, name, pod, status=False)
        del self.pending[pod_key]
        self.unschedulable.pop(pod_key, None)

    def _pools(self) -> tuple[list[Device], dict[tuple[str, str, str], dict[str, int]]]:
        """The devices of every complete pool, and its counter sets' values."""
        by_pool: dict[tuple[str, str], list[Obj]] = {}
        for obj in self.server.store.objects("resourceslices"):
            spec = obj["spec"]
            by_pool.setdefault((spec["driver"], spec["pool"]["name"]), []).append(obj)
        devices: list[Device] = []
        counters: dict[tuple[str, str, str], dict[str, int]] = {}
        for (driver, pool), slices in sorted(by_pool.items()):
            top = max(s["spec"]["pool"]["generation"] for s in slices)
            current = [s for s in slices if s["spec"]["pool"]["generation"] == top]
            if len(current) != current[0]["spec"]["pool"]["resourceSliceCount"]:
                continue  # an incomplete generation: not visible to the allocator
            for obj in sorted(current, key=lambda s: s["metadata"]["name"]):
                spec = obj["spec"]
                for counter_set in spec.get("sharedCounters") or ():
                    counters[(driver, pool, counter_set["name"])] = {
                        name: int(value["value"])
                        for name, value in (counter_set.get("counters") or {}).items()
                    }
                devices += [Device(driver, pool, d) for d in spec.get("devices") or ()]
        return devices, counters

    def _in_use(self) -> set[tuple[str, str, str]]:
        used = set()
        for claim in self.server.store.objects("resourceclaims"):
            allocation = (claim.get("status") or {}).get("allocation") or {}
            for result in (allocation.get("devices") or {}).get("results") or ():
                used.add((result["driver"], result["pool"], result["device"]))
        return used

    def _allocate(
        self,
        claim: tuple[str, str],
        chosen: list[tuple[str, Device]],
        reserved_for: list[Obj] | None = None,
    ) -> None:
        namespace, name = claim
        obj = self.server.store.get("resourceclaims", namespace, name)
        results = [
            {"request": request, "driver": d.driver, "pool": d.pool, "device": d.name}
            for request, d in chosen
        ]
        obj["status"] = {
            **(obj.get("status") or {}),
            "allocation": {"devices": {"results": results}},
        }
        if reserved_for:
            obj["status"]["reservedFor"] = reserved_for
        self.server.store.update("resourceclaims", namespace, name, obj, status=True)
        self.allocated[claim] = [(r, d.driver, d.pool, d.name) for r, d in chosen]


def _tainted(device: Device) -> bool:
    return any(
        t.get("effect") in ("NoSchedule", "NoExecute") for t in device.obj.get("taints") or ()
    )


def _consume(device: Device, left: dict[tuple[str, str, str], dict[str, int]]) -> bool:
    """Take what `device` consumes from `left`; False (and nothing taken) if it does not fit."""
    wanted = []
    for consumption in device.obj.get("consumesCounters") or ():
        key = (device.driver, device.pool, consumption["counterSet"])
        for counter, value in (consumption.get("counters") or {}).items():
            wanted.append((key, counter, int(value["value"])))
    if any(left.get(key, {}).get(counter, 0) < amount for key, counter, amount in wanted):
        return False
    for key, counter, amount in wanted:
        left[key][counter] -= amount
    return True
