"""The kubelet's PodResources API (v1) for the emulator, on grpcio.

The kubelet never tells a device plugin that a pod ended; this API is how the
server learns which devices are still held. It is modelled on the kubelet's
podresources server: List reports the devices of every container of every
active pod, grouped per resource and NUMA node; GetAllocatableResources reports
one entry per allocatable device and NUMA node; calls beyond ~100 QPS are
refused with RESOURCE_EXHAUSTED as the kubelet's rate limiter does.

A kubelet that has just started answers before it has synced its pods
(`Startup`): nothing listens at first, then List answers with no pods (the
pod manager is empty until the API server's first update is handled), then
with the pods. Each List also does what the kubelet's does first
(`UpdateAllocatedDevices`): once synced, the device manager drops the
entries of pods that are not active.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import grpc

from dp_testing.emulator._rpc import POD_RESOURCES_SERVICE, pr

if TYPE_CHECKING:
    from dp_testing.emulator._state import DeviceState, Pod

#: The kubelet's defaults: podresources.DefaultQPS and DefaultBurstTokens.
DEFAULT_BURST = 10
_NO_TOPOLOGY = -1


@dataclass(frozen=True)
class Startup:
    """How the PodResources API of a kubelet that has just (re)started answers.

    For `refuse` seconds nothing listens on its socket; for `empty` seconds
    more List answers with no pods; then it lists them. A v1.36 kubelet
    polled every 0.1 s from its start did not answer at 0.01 s, answered
    "no pods" at 0.32 s and listed them at 1.34 s (`measured()`); the default
    keeps that shape, shorter, so that every test meets a young kubelet.
    """

    refuse: float = 0.05
    empty: float = 0.25

    @classmethod
    def measured(cls) -> Startup:
        return cls(refuse=0.3, empty=1.0)

    @classmethod
    def none(cls) -> Startup:
        """A kubelet that lists its pods from its first answer (no real one does)."""
        return cls(refuse=0.0, empty=0.0)


class _Source(Protocol):
    def _pods_snapshot(self) -> list[Pod]: ...
    def _healthy_devices(self) -> Iterator[tuple[str, DeviceState]]: ...
    def _synced(self) -> bool: ...
    def _drop_inactive(self) -> None: ...


class _TokenBucket:
    """golang.org/x/time/rate.Limiter's Allow(), which the kubelet uses."""

    def __init__(self, qps: float, burst: int) -> None:
        self._qps = qps
        self._burst = float(burst)
        self._tokens = float(burst)
        self._last = time.monotonic()
        self._lock = threading.Lock()

    def allow(self) -> bool:
        with self._lock:
            now = time.monotonic()
            self._tokens = min(self._burst, self._tokens + (now - self._last) * self._qps)
            self._last = now
            if self._tokens >= 1.0:
                self._tokens -= 1.0
                return True
            return False


def _topology(node: int) -> pr.TopologyInfo | None:
    return None if node == _NO_TOPOLOGY else pr.TopologyInfo(nodes=[pr.NUMANode(ID=node)])


def _container_devices(resource: str, devices: Iterable[DeviceState]) -> list[pr.ContainerDevices]:
    """One ContainerDevices per NUMA node, as the kubelet's podDevices stores them.

    A device on several NUMA nodes is listed under each; one without topology
    goes in an entry without topology.
    """
    per_node: dict[int, list[str]] = {}
    for d in devices:
        for node in d.numa_nodes or (_NO_TOPOLOGY,):
            per_node.setdefault(node, []).append(d.id)
    return [
        pr.ContainerDevices(resource_name=resource, device_ids=ids, topology=_topology(node))
        for node, ids in per_node.items()
    ]


class PodResourcesServer:
    """Serves /v1.PodResourcesLister on one unix socket from the emulator's state."""

    def __init__(self, socket_path: Path, source: _Source, *, qps: float | None) -> None:
        self.socket_path = socket_path
        self._source = source
        self._limiter = _TokenBucket(qps, DEFAULT_BURST) if qps is not None else None
        self._server: grpc.Server | None = None
        self._executor: futures.ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None
        self._generation = 0  # each start and stop; a late timer of an old one does nothing

    def start(self, after: float = 0.0) -> None:
        """Serve, `after` seconds from now (nothing listens meanwhile)."""
        with self._lock:
            self._generation += 1
            generation = self._generation
        if after <= 0:
            self._start(generation)
            return
        timer = threading.Timer(after, self._start, args=(generation,))
        timer.daemon = True
        with self._lock:
            self._timer = timer
        timer.start()

    def _start(self, generation: int) -> None:
        self.socket_path.parent.mkdir(parents=True, exist_ok=True)
        executor = futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="kubelet-podres")
        server = grpc.server(executor)
        server.add_generic_rpc_handlers(
            (
                grpc.method_handlers_generic_handler(
                    POD_RESOURCES_SERVICE,
                    {
                        "List": grpc.unary_unary_rpc_method_handler(
                            self._list,
                            request_deserializer=pr.ListPodResourcesRequest.FromString,
                            response_serializer=pr.ListPodResourcesResponse.SerializeToString,
                        ),
                        "GetAllocatableResources": grpc.unary_unary_rpc_method_handler(
                            self._allocatable,
                            request_deserializer=pr.AllocatableResourcesRequest.FromString,
                            response_serializer=pr.AllocatableResourcesResponse.SerializeToString,
                        ),
                        "Get": grpc.unary_unary_rpc_method_handler(
                            self._get,
                            request_deserializer=pr.GetPodResourcesRequest.FromString,
                            response_serializer=pr.GetPodResourcesResponse.SerializeToString,
                        ),
                    },
                ),
            )
        )
        with self._lock:
            if generation != self._generation:  # stopped (or started again) meanwhile
                executor.shutdown(wait=False)
                return
            server.add_insecure_port(f"unix:{self.socket_path}")
            server.start()
            self._server, self._executor = server, executor

    def stop(self) -> None:
        with self._lock:
            self._generation += 1
            timer, self._timer = self._timer, None
            server, executor = self._server, self._executor
            self._server = self._executor = None
        if timer is not None:
            timer.cancel()
        if server is not None:
            server.stop(grace=None).wait(5.0)
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)

    def _limit(self, context: grpc.ServicerContext) -> None:
        if self._limiter is not None and not self._limiter.allow():
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "rejected by rate limit")

    @staticmethod
    def _pod_message(pod: Pod) -> pr.PodResources:
        return pr.PodResources(
            name=pod.name,
            namespace=pod.namespace,
            containers=[
                pr.ContainerResources(
                    name=container,
                    devices=[
                        cd
                        for resource, devices in alloc.devices.items()
                        for cd in _container_devices(resource, devices)
                    ],
                )
                for container, alloc in pod.containers.items()
            ],
        )

    def _list(
        self, request: pr.ListPodResourcesRequest, context: grpc.ServicerContext
    ) -> pr.ListPodResourcesResponse:
        self._limit(context)
        if not self._source._synced():
            return pr.ListPodResourcesResponse()
        self._source._drop_inactive()
        return pr.ListPodResourcesResponse(
            pod_resources=[self._pod_message(p) for p in self._source._pods_snapshot()]
        )

    def _get(
        self, request: pr.GetPodResourcesRequest, context: grpc.ServicerContext
    ) -> pr.GetPodResourcesResponse:
        self._limit(context)
        for pod in self._source._pods_snapshot() if self._source._synced() else ():
            if pod.name == request.pod_name and pod.namespace == request.pod_namespace:
                return pr.GetPodResourcesResponse(pod_resources=self._pod_message(pod))
        context.abort(
            grpc.StatusCode.UNKNOWN,
            f"pod {request.pod_name} not found in {request.pod_namespace}",
        )
        raise AssertionError("unreachable: context.abort raises")

    def _allocatable(
        self, request: pr.AllocatableResourcesRequest, context: grpc.ServicerContext
    ) -> pr.AllocatableResourcesResponse:
        self._limit(context)
        return pr.AllocatableResourcesResponse(
            devices=[
                cd
                for resource, device in self._source._healthy_devices()
                for cd in _container_devices(resource, [device])
            ]
        )
