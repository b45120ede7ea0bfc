"""The kubelet's side of a DRA plugin's health stream, and its cache of device health.

As the 1.36 kubelet (pkg/kubelet/cm/dra: dra_plugin_manager.go, manager.go's
HandleWatchResourcesStream, healthinfo.go), and the 1.37 one, which differs
only in which service it asks for (`_rpc.pick_health_service`):

* A registered plugin is asked for `NodeWatchResources` of its health service
  on its one connection, and asked again `retry` seconds (5 s) after the
  stream ends, whether it failed or ended cleanly, until the plugin is
  deregistered.
* Each message is the plugin's whole list. An entry per `pool/device` keeps
  its health, its time (the message's `last_updated_time`, Unix seconds)
  and its timeout (`health_check_timeout_seconds`, or 30 s when not given).
  A device not in a message, or not heard of for longer than its timeout,
  reads Unknown.
* When a stream ends the driver's entries are forgotten: its devices read
  Unknown until the next stream says otherwise.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from dp_testing.dra_kubelet._rpc import HEALTH_MESSAGES, HEALTH_TIMEOUT, health, health_watch_path

__all__ = ["HealthCache", "HealthStream"]

_NAMES = {
    health.HEALTHY: "Healthy",
    health.UNHEALTHY: "Unhealthy",
    health.UNKNOWN: "Unknown",
}


@dataclass(frozen=True)
class _Entry:
    health: str
    updated: float
    timeout: float
    message: str


class HealthCache:
    """Device health by driver and `pool/device`, as the kubelet keeps it. Not locked."""

    def __init__(self) -> None:
        self._drivers: dict[str, dict[tuple[str, str], _Entry]] = {}

    def update(self, driver: str, response: Any, now: float) -> list[str]:
        """Take one message; the devices whose health changed, as `pool/device=Health`."""
        entries = self._drivers.setdefault(driver, {})
        changed = []
        reported = set()
        for reported_device in response.devices:
            key = (reported_device.device.pool_name, reported_device.device.device_name)
            reported.add(key)
            timeout = reported_device.health_check_timeout_seconds
            entry = _Entry(
                _NAMES.get(reported_device.health, "Unknown"),
                float(reported_device.last_updated_time),
                float(timeout) if timeout > 0 else HEALTH_TIMEOUT,
                reported_device.message,
            )
            old = entries.get(key)
            if old is None or old.health != entry.health:
                changed.append(f"{key[0]}/{key[1]}={entry.health}")
            entries[key] = entry
        for key, entry in list(entries.items()):
            if key in reported or entry.health == "Unknown":
                continue
            if now - entry.updated > entry.timeout:
                entries[key] = _Entry("Unknown", now, entry.timeout, "")
                changed.append(f"{key[0]}/{key[1]}=Unknown")
        return changed

    def get(self, driver: str, pool: str, device: str, now: float) -> tuple[str, str]:
        """A device's health now, and its message."""
        entry = self._drivers.get(driver, {}).get((pool, device))
        if entry is None or now - entry.updated > entry.timeout:
            return "Unknown", ""
        return entry.health, entry.message

    def clear(self, driver: str) -> None:
        self._drivers.pop(driver, None)


class HealthStream:
    """One plugin's health stream of `service` (e.g. "v1.DRAResourceHealth") on
    `channel`, opened again `retry` s after each end.

    `on_message(response)` gets each message; `on_event(kind, detail)` gets
    "health-opened" with the service, and "health-ended" with the stream's
    error ("EOF" for a clean end), after which the driver's health is to be
    forgotten.
    """

    def __init__(
        self,
        channel: grpc.Channel,
        service: str,
        retry: float,
        on_message: Callable[[Any], None],
        on_event: Callable[[str, str], None],
    ) -> None:
        self.service = service
        self._messages = HEALTH_MESSAGES[service]
        self._watch = channel.unary_stream(
            health_watch_path(service),
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=self._messages.NodeWatchResourcesResponse.FromString,
        )
        self._retry = retry
        self._on_message = on_message
        self._on_event = on_event
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._call: Any = None
        self._thread = threading.Thread(target=self._run, name="dra-health-stream", daemon=True)

    def start(self) -> HealthStream:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            if self._call is not None:
                self._call.cancel()
        if self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        while True:
            with self._lock:  # stop() cancels whatever call this makes
                if self._stop.is_set():
                    return
                self._call = self._watch(self._messages.NodeWatchResourcesRequest())
            self._on_event("health-opened", self.service)
            try:
                for response in self._call:
                    self._on_message(response)
                ended = "EOF"
            except grpc.RpcError as error:
                ended = f"{error.code().name}: {error.details()}"
            if self._stop.is_set():
                return
            self._on_event("health-ended", ended)
            self._stop.wait(self._retry)
