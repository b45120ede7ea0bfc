"""The kubelet's client side towards a registered plugin: pod admission and calls.

`PodsMixin` gives `KubeletEmulator` its plugin calls (Allocate,
GetPreferredAllocation, PreStartContainer, raw `call`) and the pod model built
on them: `admit` picks devices the way the kubelet's device manager does,
`remove_pod` frees them.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping
from types import MappingProxyType
from typing import Any

import grpc

from dp_testing.emulator._checkpoint import Checkpoint, PodDevicesEntry
from dp_testing.emulator._rpc import DEVICE_PLUGIN_METHODS, PRE_START_TIMEOUT, dp
from dp_testing.emulator._state import (
    AdmissionError,
    ContainerAllocation,
    DeviceState,
    KubeletError,
    KubeletState,
    PluginOptions,
    Pod,
)


class PodsMixin:
    """Plugin calls and pod admission; needs the emulator's `_state`."""

    _state: KubeletState
    _admit_lock: threading.Lock
    checkpoint: Checkpoint

    # ------------------------------------------------------------------ plugin calls

    def _channel(self, resource: str) -> grpc.Channel:
        with self._state.cond:
            res = self._state.resources.get(resource)
            if res is None or res.endpoint is None:
                # The kubelet's own wording for a resource with no live endpoint.
                raise KubeletError(f"unknown Device Plugin {resource}")
            return res.endpoint.channel

    def call(
        self, resource: str, method: str, request: Any, *, timeout: float | None = None
    ) -> Any:
        """Send a raw request to `resource`'s plugin over its registered connection.

        `method` is a DevicePlugin method name ("Allocate") or full path. For the
        streaming ListAndWatch the grpcio call iterator is returned; cancel it when
        done. grpc.RpcError propagates, so tests can check status codes.
        """
        short = method.rsplit("/", 1)[-1]
        spec = DEVICE_PLUGIN_METHODS.get(short)
        if spec is None:
            raise ValueError(f"not a DevicePlugin method: {method!r}")
        channel = self._channel(resource)
        if spec.server_streaming:
            return channel.unary_stream(
                spec.path,
                request_serializer=spec.serialize,
                response_deserializer=spec.deserialize,
            )(request, timeout=timeout)
        return channel.unary_unary(
            spec.path, request_serializer=spec.serialize, response_deserializer=spec.deserialize
        )(request, timeout=timeout)

    def allocate(
        self, resource: str, device_ids: Iterable[str], *, timeout: float | None = None
    ) -> dp.ContainerAllocateResponse:
        """Allocate as the kubelet does: one container request, first response used."""
        ids = list(device_ids)
        request = dp.AllocateRequest(
            container_requests=[dp.ContainerAllocateRequest(devices_ids=ids)]
        )
        self._state.event("allocate", resource, ",".join(ids))
        response = self.call(resource, "Allocate", request, timeout=timeout)
        if not response.container_responses:
            raise KubeletError(f"no containers return in allocation response {response}")
        return response.container_responses[0]

    def preferred_allocation(
        self,
        resource: str,
        available: Iterable[str],
        must_include: Iterable[str],
        size: int,
        *,
        timeout: float | None = None,
    ) -> list[str]:
        """GetPreferredAllocation for one container; the first response's IDs."""
        request = dp.PreferredAllocationRequest(
            container_requests=[
                dp.ContainerPreferredAllocationRequest(
                    available_deviceIDs=list(available),
                    must_include_deviceIDs=list(must_include),
                    allocation_size=size,
                )
            ]
        )
        self._state.event("preferred", resource, f"size={size}")
        response = self.call(resource, "GetPreferredAllocation", request, timeout=timeout)
        if not response.container_responses:
            return []
        return list(response.container_responses[0].deviceIDs)

    def pre_start(
        self, resource: str, device_ids: Iterable[str], *, timeout: float = PRE_START_TIMEOUT
    ) -> dp.PreStartContainerResponse:
        """PreStartContainer, with the kubelet's 30 s deadline."""
        ids = list(device_ids)
        self._state.event("pre-start", resource, ",".join(ids))
        request = dp.PreStartContainerRequest(devices_ids=ids)
        return self.call(resource, "PreStartContainer", request, timeout=timeout)

    # ------------------------------------------------------------------ pods

    def admit(
        self,
        pod: str,
        container: str,
        requests: Mapping[str, int],
        *,
        namespace: str = "default",
    ) -> dict[str, dp.ContainerAllocateResponse]:
        """Admit one container: pick devices, ask the plugins, record the allocation.

        For each resource: the candidates are the healthy devices no admitted pod
        holds; if the plugin asked for it, GetPreferredAllocation chooses among
        them (the kubelet keeps what it can use and fills up the rest itself);
        then Allocate, then PreStartContainer if required. Nothing is recorded
        unless every resource succeeds; then the checkpoint is written. Raises
        AdmissionError when the kubelet would refuse the pod, grpc.RpcError
        when a plugin call fails.

        A kubelet that has just started admits new pods once it has synced
        (they come from the API server with the pods it already has): until
        then this waits. Devices of pods no longer active stay allocated until
        the kubelet has synced (`UpdateAllocatedDevices`).
        """
        key = f"{namespace}/{pod}"
        self._wait_synced()
        with self._admit_lock:  # the kubelet admits pods one at a time
            self._drop_inactive()
            with self._state.cond:
                existing = self._state.pods.get(key)
                if existing is not None and container in existing.containers:
                    raise ValueError(f"container {container!r} of {key} was already admitted")
            responses: dict[str, dp.ContainerAllocateResponse] = {}
            held: dict[str, tuple[DeviceState, ...]] = {}
            # The kubelet's podDevices holds each container's Allocate answer.
            for resource, count in requests.items():
                if count <= 0:
                    continue
                chosen, options = self._choose(resource, count)
                responses[resource] = self.allocate(resource, [d.id for d in chosen])
                if options.pre_start_required:
                    self.pre_start(resource, [d.id for d in chosen])
                held[resource] = chosen
            answers = {r: response.SerializeToString() for r, response in responses.items()}
            with self._state.cond:
                entry = self._state.pods.setdefault(key, Pod(pod, namespace, uid=str(uuid.uuid4())))
                entry.containers[container] = ContainerAllocation(
                    MappingProxyType(held), MappingProxyType(answers)
                )
                detail = "; ".join(f"{r}={','.join(d.id for d in ds)}" for r, ds in held.items())
                self._state.event_locked("admit", key, f"{container}: {detail}")
            if held:
                self.checkpoint.write()
            return responses

    def _wait_synced(self) -> None:
        while (left := self._state.synced_at - time.monotonic()) > 0:
            time.sleep(left)

    def _synced(self) -> bool:
        return time.monotonic() >= self._state.synced_at

    def _drop_inactive(self) -> None:
        """The device manager's UpdateAllocatedDevices: once synced, the
        entries of pods that are not active go (in memory; the checkpoint
        shows it at its next write)."""
        with self._state.cond:
            if self._synced() and self._state.lingering:
                dropped = self._state.lingering
                self._state.lingering = []
                pods = sorted({entry.pod_uid for entry in dropped})
                self._state.event_locked("dropped", "", ",".join(pods))

    def _choose(self, resource: str, count: int) -> tuple[tuple[DeviceState, ...], PluginOptions]:
        with self._state.cond:
            res = self._state.resources.get(resource)
            if res is None or res.endpoint is None:
                raise AdmissionError(
                    f"UnexpectedAdmissionError: cannot allocate unregistered device {resource}"
                )
            in_use = self._in_use_locked(resource)
            available = [d for d in res.devices.values() if d.healthy and d.id not in in_use]
            options = res.endpoint.options
        if len(available) < count:
            raise AdmissionError(
                f"UnexpectedAdmissionError: requested number of devices unavailable for "
                f"{resource}. Requested: {count}, Available: {len(available)}"
            )
        by_id = {d.id: d for d in available}
        chosen: list[DeviceState] = []
        if options.get_preferred_allocation_available:
            for device_id in self.preferred_allocation(resource, list(by_id), [], count):
                device = by_id.get(device_id)
                if device is not None and device not in chosen and len(chosen) < count:
                    chosen.append(device)
        for device in available:
            if len(chosen) >= count:
                break
            if device not in chosen:
                chosen.append(device)
        return tuple(chosen), options

    def _in_use_locked(self, resource: str) -> set[str]:
        in_use = {
            d.id
            for p in self._state.pods.values()
            for c in p.containers.values()
            for d in c.devices.get(resource, ())
        }
        lingering = self._state.lingering
        return in_use | {d.id for e in lingering if e.resource == resource for d in e.devices}

    def remove_pod(self, pod: str, *, namespace: str = "default") -> bool:
        """The API server deleted a pod: it is no longer active, and the device
        manager drops its devices at its next PodResources List or admission
        (at once for a kubelet that has synced). The plugin is not told (nor
        by the kubelet)."""
        key = f"{namespace}/{pod}"
        with self._state.cond:
            removed = self._state.pods.pop(key, None)
            if removed is not None:
                self._state.lingering.extend(
                    PodDevicesEntry(removed.uid, container, resource, devices)
                    for container, allocation in removed.containers.items()
                    for resource, devices in allocation.devices.items()
                )
                self._state.event_locked("remove-pod", key, ",".join(removed.containers))
            return removed is not None

    # ------------------------------------------------------------------ for PodResources

    def _pods_snapshot(self) -> list[Pod]:
        with self._state.cond:
            return [
                Pod(p.name, p.namespace, dict(p.containers), p.uid)
                for p in self._state.pods.values()
            ]

    def _healthy_devices(self) -> Iterator[tuple[str, DeviceState]]:
        with self._state.cond:
            items = [
                (name, d)
                for name, r in self._state.resources.items()
                for d in r.devices.values()
                if d.healthy
            ]
        yield from items


__all__ = ["PodsMixin"]
