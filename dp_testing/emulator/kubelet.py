"""A kubelet emulator on grpcio: the independent peer the server is tested against.

The server under test speaks grpclib + betterproto2. If the tests' kubelet spoke
the same stack, a bug shared by both ends (framing, headers, message encoding,
connection handling) would pass unnoticed. So this emulator uses grpcio (the
C-core stack) and protobuf's own runtime messages, and reproduces the kubelet's
device-manager behaviour that the server depends on (docs/design.md §3):

* Register is synchronous: inside the handler the kubelet dials the endpoint
  (blocking, 10 s), calls GetDevicePluginOptions, then replies; ListAndWatch
  starts right after. Kubelets before 1.25 replied first, then dialled and took
  the options from the RegisterRequest (`dial_mode="after-reply"`).
* Each registration gets a connection of its own, with `:authority` localhost.
* While it holds a client for a name (until it sees that client's stream end),
  a Register for the same socket is answered at once without a dial ("already
  connected"), and one for another socket is refused, as 1.26 and later do
  (`keeps_clients=False`: every Register dials and replaces the old client).
* Each ListAndWatch response replaces the device list; when the stream ends all
  devices turn unhealthy and the kubelet never redials.
* A restart deletes every socket in the device-plugins directory except the
  checkpoint, then serves `kubelet.sock` again.
* The device manager's checkpoint (`kubelet_internal_checkpoint`) is written
  as the kubelet writes it: at every device list and every admission; it is
  read back at every start, and the devices of pods the API server no longer
  has stay allocated until the kubelet has synced (`_checkpoint`).
* A kubelet that has just started does not list its pods at once (`Startup`):
  its PodResources API refuses, then lists no pods, then lists them; new pods
  are admitted once it has synced, as they come with the pods it already has.

Everything is thread based (synchronous grpcio), so it works from plain code
and from asyncio tests through `asyncio.to_thread` for the blocking calls. The
query methods never block on the network and may be called from the loop.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from types import TracebackType

from dp_testing.emulator._checkpoint import Checkpoint, PodDevicesEntry
from dp_testing.emulator._pod_resources import PodResourcesServer, Startup
from dp_testing.emulator._pods import PodsMixin
from dp_testing.emulator._registration import DialMode, RefuseHook, Registration
from dp_testing.emulator._rpc import CHECKPOINT_FILE, DIAL_TIMEOUT, KUBELET_SOCKET, MAX_UNIX_PATH
from dp_testing.emulator._state import (
    Event,
    KubeletError,
    KubeletState,
    PluginOptions,
    Pod,
    ResourceState,
)


def _check_socket_path(path: Path) -> None:
    if len(os.fsencode(path)) > MAX_UNIX_PATH:
        raise ValueError(
            f"unix socket path {str(path)!r} is {len(os.fsencode(path))} bytes; Linux "
            f"allows {MAX_UNIX_PATH}. Use a short directory (tempfile.mkdtemp(prefix='dp-'))."
        )


class KubeletEmulator(PodsMixin):
    """The kubelet's device manager (and optionally its PodResources API).

    Use as a context manager or call start()/stop(). Blocking methods (the plugin
    calls, admit, restart, wait_*) must not run on an asyncio loop that also
    serves the plugin under test: call them through `asyncio.to_thread`.
    """

    def __init__(
        self,
        plugin_dir: Path,
        *,
        dial_mode: DialMode = "sync",
        refuse: RefuseHook | None = None,
        pod_resources_socket: Path | None = None,
        dial_timeout: float = DIAL_TIMEOUT,
        pod_resources_qps: float | None = 100.0,
        keeps_clients: bool = True,
        startup: Startup | None = None,
    ) -> None:
        if dial_mode not in ("sync", "after-reply"):
            raise ValueError(f"dial_mode must be 'sync' or 'after-reply', not {dial_mode!r}")
        self.plugin_dir = Path(plugin_dir).absolute()
        self.socket_path = self.plugin_dir / KUBELET_SOCKET
        _check_socket_path(self.socket_path)
        if pod_resources_socket is not None:
            pod_resources_socket = Path(pod_resources_socket).absolute()
            _check_socket_path(pod_resources_socket)
        self._state = KubeletState()
        self._admit_lock = threading.Lock()
        self.startup = startup if startup is not None else Startup()
        self.checkpoint = Checkpoint(self.plugin_dir / CHECKPOINT_FILE, self._checkpoint_data)
        self._registration = Registration(
            self._state,
            self.plugin_dir,
            self.socket_path,
            dial_mode=dial_mode,
            dial_timeout=dial_timeout,
            refuse=refuse,
            keeps_clients=keeps_clients,
            on_list=self.checkpoint.soon,
        )
        self._running = False
        self._stopped = False
        self.last_restart: float | None = None
        self._pod_resources = (
            PodResourcesServer(pod_resources_socket, self, qps=pod_resources_qps)
            if pod_resources_socket is not None
            else None
        )

    @property
    def dial_mode(self) -> DialMode:
        return self._registration.dial_mode

    @property
    def dial_timeout(self) -> float:
        return self._registration.dial_timeout

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> KubeletEmulator:
        """Serve Registration on `<plugin_dir>/kubelet.sock` (and PodResources)."""
        with self._state.cond:
            if self._stopped:
                raise KubeletError("a stopped KubeletEmulator cannot be started again")
            if self._running:
                return self
            self._running = True
        self.plugin_dir.mkdir(parents=True, exist_ok=True)
        self._begin()
        self._registration.serve()
        return self

    def _begin(self) -> None:
        """What a kubelet does as it starts: read its checkpoint back, and
        start syncing its pods (PodResources answers as `startup` says)."""
        recalled = self.checkpoint.read()
        now = time.monotonic()
        with self._state.cond:
            active = {pod.uid for pod in self._state.pods.values()}
            # Entries of pods the API server still has are those pods' devices.
            self._state.lingering = [e for e in recalled if e.pod_uid not in active]
            self._state.synced_at = now + self.startup.refuse + self.startup.empty
        if self._pod_resources is not None:
            self._pod_resources.start(after=self.startup.refuse)

    @property
    def synced_at(self) -> float:
        """time.monotonic() from which PodResources lists pods and new pods are admitted."""
        with self._state.cond:
            return self._state.synced_at

    def _checkpoint_data(self) -> tuple[list[PodDevicesEntry], dict[str, list[str]]]:
        with self._state.cond:
            entries = [
                PodDevicesEntry(
                    pod.uid,
                    container,
                    resource,
                    devices,
                    allocation.responses.get(resource, b""),
                )
                for pod in self._state.pods.values()
                for container, allocation in pod.containers.items()
                for resource, devices in allocation.devices.items()
            ]
            entries += self._state.lingering
            registered = {
                name: sorted(d.id for d in r.devices.values() if d.healthy)
                for name, r in self._state.resources.items()
            }
        return entries, registered

    def stop(self) -> None:
        """Stop serving, close every plugin connection, join threads. Idempotent."""
        with self._state.cond:
            if self._stopped:
                return
            self._stopped = True
            self._running = False
            self._registration.retire_locked()
        self._registration.stop_server()
        if self._pod_resources is not None:
            self._pod_resources.stop()
        self._registration.disconnect_all(reason="kubelet stopped")
        self._registration.join_threads()
        self._registration.close()
        self.checkpoint.close()
        self._state.event("stop", "", "")

    def restart(self, *, removed: Iterable[str] = ()) -> None:
        """Restart as the kubelet does; plugins must notice and register again.

        Stops the Registration server, drops every plugin connection (devices
        turn unhealthy, capacity stays known), deletes every socket in the
        device-plugins directory except the checkpoint, then serves a fresh
        `kubelet.sock`. Pods and their allocations survive, as the kubelet
        restores them from its checkpoint; the pods named in `removed`
        (`namespace/name`, or a name in `default`) were deleted from the API
        server while it was down, and their devices stay allocated until it
        has synced. PodResources answers as `startup` says. `last_restart` is
        the moment just before the new socket is created: a plugin may
        register through it before serve() (let alone PodResources' start)
        has returned.
        """
        registration = self._registration
        with self._state.cond:
            if not self._running:
                raise KubeletError("restart() needs a started emulator")
            registration.retire_locked()
        registration.stop_server()
        if self._pod_resources is not None:
            self._pod_resources.stop()
        registration.disconnect_all(reason="kubelet restarted")
        registration.join_threads()
        registration.cleanup_plugin_dir()
        with self._state.cond:
            for key in removed:
                self._state.pods.pop(key if "/" in key else f"default/{key}", None)
            self.last_restart = time.monotonic()
        self._begin()
        registration.serve()
        self._state.event("restart", "", str(self.socket_path))

    def break_connection(self, resource: str, *, linger: float = 0.0) -> None:
        """Close the connection of `resource`'s client, as a transport failure
        would. The kubelet drops the client once it sees the stream end: after
        `linger` seconds here, so that a Register in between meets the client
        still held."""
        self._registration.break_connection(resource, linger)

    def __enter__(self) -> KubeletEmulator:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # ------------------------------------------------------------------ queries

    def resources(self) -> dict[str, ResourceState]:
        """Snapshot of every resource the kubelet has known since it was created."""
        with self._state.cond:
            return {name: r.snapshot() for name, r in self._state.resources.items()}

    def capacity(self) -> dict[str, int]:
        """Node capacity per resource: every device, healthy or not."""
        with self._state.cond:
            return {name: len(r.devices) for name, r in self._state.resources.items()}

    def allocatable(self) -> dict[str, int]:
        """Node allocatable per resource: the healthy devices."""
        with self._state.cond:
            return {
                name: sum(1 for d in r.devices.values() if d.healthy)
                for name, r in self._state.resources.items()
            }

    def options(self, resource: str) -> PluginOptions | None:
        """Options of the current (else last) registration of `resource`."""
        with self._state.cond:
            res = self._state.resources.get(resource)
            return res.snapshot().options if res is not None else None

    def registration_count(self, resource: str) -> int:
        with self._state.cond:
            res = self._state.resources.get(resource)
            return res.registrations if res is not None else 0

    @property
    def events(self) -> list[Event]:
        """A copy of the event log, oldest first."""
        with self._state.cond:
            return list(self._state.events)

    def events_of(self, kind: str, resource: str | None = None) -> list[Event]:
        """The events of one kind (and resource, if given), oldest first."""
        with self._state.cond:
            return [
                e
                for e in self._state.events
                if e.kind == kind and (resource is None or e.resource == resource)
            ]

    def pods(self) -> dict[str, Pod]:
        """The admitted pods (copies), keyed by `namespace/name`."""
        with self._state.cond:
            return {
                key: Pod(p.name, p.namespace, dict(p.containers), p.uid)
                for key, p in self._state.pods.items()
            }

    def wait_for(
        self,
        predicate: Callable[[KubeletEmulator], bool],
        timeout: float,
        *,
        interval: float | None = None,
    ) -> bool:
        """Block until `predicate(self)` holds; re-checked on every state change,
        or, with `interval`, every `interval` seconds.

        Returns False on timeout. Do not call from the loop serving the plugin.
        A waiter woken by every change runs its predicate, under the state
        lock, between the kubelet's own steps: that is what tests want, but it
        takes the lock and the GIL from the kubelet's threads, some 50 ms of a
        64-resource re-registration (a fifth), which no real kubelet pays. A
        benchmark, which reads its timings from the events, looks every few
        milliseconds instead.
        """
        cond = self._state.cond
        if interval is None:
            with cond:
                return cond.wait_for(lambda: predicate(self), timeout)
        deadline = time.monotonic() + timeout
        while True:
            with cond:
                if predicate(self):
                    return True
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            time.sleep(min(interval, remaining))

    def wait_registered(
        self,
        names: str | Iterable[str],
        timeout: float,
        *,
        listed: bool = False,
        interval: float | None = None,
    ) -> bool:
        """Wait until every resource in `names` has a live registration.

        With `listed=True`, also until a ListAndWatch response arrived for it
        since that registration. `interval` is as for `wait_for`.
        """
        wanted = [names] if isinstance(names, str) else list(names)

        def ok(_: KubeletEmulator) -> bool:
            for name in wanted:
                res = self._state.resources.get(name)
                if res is None or res.endpoint is None:
                    return False
                if listed and not res.listed:
                    return False
            return True

        return self.wait_for(ok, timeout, interval=interval)


__all__ = ["KubeletEmulator"]
