"""The kubelet's PodResources API (v1) for the emulator, on grpcio.

The kubelet never tells a device plugin that a pod ended; this API is how the
server learns which devices are still held. It is modelled on the kubelet's
podresources server: List reports the devices of every container of every
active pod, grouped per resource and NUMA node; GetAllocatableResources reports
one entry per allocatable device and NUMA node; calls beyond ~100 QPS are
refused with RESOURCE_EXHAUSTED as the kubelet's rate limiter does.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator
from concurrent import futures
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import grpc

from dp_testing.emulator._rpc import POD_RESOURCES_SERVICE, pr

if TYPE_CHECKING:
    from dp_testing.emulator._state import DeviceState, Pod

#: The kubelet's defaults: podresources.DefaultQPS and DefaultBurstTokens.
DEFAULT_BURST = 10
_NO_TOPOLOGY = -1


class _Source(Protocol):
    def _pods_snapshot(self) -> list[Pod]: ...
    def _healthy_devices(self) -> Iterator[tuple[str, DeviceState]]: ...


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

    def start(self) -> None:
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
        server.add_insecure_port(f"unix:{self.socket_path}")
        server.start()
        self._server, self._executor = server, executor

    def stop(self) -> None:
        server, executor = self._server, self._executor
        self._server = self._executor = None
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
        return pr.ListPodResourcesResponse(
            pod_resources=[self._pod_message(p) for p in self._source._pods_snapshot()]
        )

    def _get(
        self, request: pr.GetPodResourcesRequest, context: grpc.ServicerContext
    ) -> pr.GetPodResourcesResponse:
        self._limit(context)
        for pod in self._source._pods_snapshot():
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
