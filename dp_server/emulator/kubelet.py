"""A kubelet emulator on grpcio: the independent peer the server is tested against.

The server under test speaks grpclib + betterproto2. If the tests' kubelet spoke
the same stack, a bug shared by both ends (framing, headers, message encoding,
connection handling) would pass unnoticed. So this emulator uses grpcio (the
C-core stack) and protobuf's own runtime messages, and reproduces the kubelet's
device-manager behaviour that the server depends on (DESIGN.md §3):

* Register is synchronous: inside the handler the kubelet dials the endpoint
  (blocking, 10 s), calls GetDevicePluginOptions, then replies; ListAndWatch
  starts right after. Kubelets before ~1.20 replied first, then dialled and took
  the options from the RegisterRequest (`dial_mode="after-reply"`).
* Each registration gets a connection of its own, with `:authority` localhost.
* Each ListAndWatch response replaces the device list; when the stream ends all
  devices turn unhealthy and the kubelet never redials.
* A restart deletes every socket in the device-plugins directory except the
  checkpoint, then serves `kubelet.sock` again.

Everything is thread based (synchronous grpcio), so it works from plain code
and from asyncio tests through `asyncio.to_thread` for the blocking calls. The
query methods never block on the network and may be called from the loop.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType, TracebackType
from typing import Any, Literal, NamedTuple

import grpc

from ._pod_resources import PodResourcesServer
from ._rpc import (
    API_VERSION,
    CHECKPOINT_FILE,
    DEVICE_PLUGIN_METHODS,
    DIAL_TIMEOUT,
    ERR_FAILED_TO_DIAL,
    ERR_INVALID_RESOURCE_NAME,
    ERR_UNSUPPORTED_VERSION,
    HEALTHY,
    KUBELET_SOCKET,
    MAX_UNIX_PATH,
    PLUGIN_CHANNEL_OPTIONS,
    PRE_START_TIMEOUT,
    UNHEALTHY,
    dp,
    is_extended_resource_name,
)

log = logging.getLogger(__name__)

DialMode = Literal["sync", "after-reply"]
RefuseHook = Callable[[dp.RegisterRequest], "str | None"]

#: How long stop()/restart() wait for a background thread before giving up on it.
#: Threads are daemons, so one that is stuck cannot keep the process alive.
_JOIN_TIMEOUT = 5.0


class KubeletError(Exception):
    """An error the kubelet itself raises (not a gRPC status from the plugin)."""


class AdmissionError(KubeletError):
    """A pod the kubelet would refuse to admit (UnexpectedAdmissionError and kin)."""


class Event(NamedTuple):
    """One thing the emulated kubelet did or saw, for ordering and timing asserts.

    Kinds: "register" (request received), "rejected" (validation failed),
    "refused" (the `refuse` hook said no), "dial", "dial-failed", "options",
    "registered" (endpoint stored), "replied" (Register RPC finished server
    side), "replaced" (a re-registration retired the old endpoint), "list",
    "stream-ended", "stale-stream-ended" (stream of a retired endpoint),
    "preferred", "allocate", "pre-start", "admit", "remove-pod", "restart",
    "stop".
    """

    time: float
    kind: str
    resource: str
    detail: str


@dataclass(frozen=True)
class DeviceState:
    """A device as the kubelet knows it: the last reported state, or Unhealthy."""

    id: str
    health: str
    numa_nodes: tuple[int, ...] = ()

    @property
    def healthy(self) -> bool:
        # The kubelet treats anything but exactly "Healthy" as unhealthy.
        return self.health == HEALTHY


@dataclass(frozen=True)
class PluginOptions:
    """The options the kubelet holds for a registration."""

    pre_start_required: bool = False
    get_preferred_allocation_available: bool = False


@dataclass(frozen=True)
class ResourceState:
    """Snapshot of one extended resource as the emulated kubelet sees it."""

    name: str
    devices: Mapping[str, DeviceState]
    #: True while a registration with a live ListAndWatch client exists.
    registered: bool
    #: Endpoint (socket name) of the current or last registration.
    endpoint: str | None
    options: PluginOptions | None
    #: Successful registrations of this resource since the emulator was created.
    registrations: int
    #: ListAndWatch responses received for this resource, over all endpoints.
    lists: int
    #: time.monotonic() of the current registration, None when not registered.
    registered_at: float | None

    @property
    def capacity(self) -> int:
        return len(self.devices)

    @property
    def allocatable(self) -> int:
        return sum(1 for d in self.devices.values() if d.healthy)


@dataclass
class _Endpoint:
    """The kubelet's client for one registration: one channel, one stream."""

    resource: str
    endpoint: str
    channel: grpc.Channel
    options: PluginOptions
    call: Any = None  # the ListAndWatch call, cancellable
    thread: threading.Thread | None = None

    def close(self, *, join: bool = True) -> None:
        """Stop the client as the kubelet does: cancel the stream, close the conn."""
        if self.call is not None:
            self.call.cancel()
        self.channel.close()
        thread = self.thread
        if join and thread is not None and thread is not threading.current_thread():
            thread.join(_JOIN_TIMEOUT)


@dataclass
class _Resource:
    name: str
    devices: dict[str, DeviceState] = field(default_factory=dict)
    endpoint: _Endpoint | None = None
    last_endpoint: str | None = None
    last_options: PluginOptions | None = None
    registrations: int = 0
    lists: int = 0
    registered_at: float | None = None
    #: A ListAndWatch response arrived since the current registration.
    listed: bool = False

    def mark_unhealthy(self) -> None:
        self.devices = {i: DeviceState(i, UNHEALTHY, d.numa_nodes) for i, d in self.devices.items()}

    def snapshot(self) -> ResourceState:
        return ResourceState(
            name=self.name,
            devices=MappingProxyType(dict(self.devices)),
            registered=self.endpoint is not None,
            endpoint=self.endpoint.endpoint if self.endpoint else self.last_endpoint,
            options=self.endpoint.options if self.endpoint else self.last_options,
            registrations=self.registrations,
            lists=self.lists,
            registered_at=self.registered_at,
        )


@dataclass(frozen=True)
class ContainerAllocation:
    """Devices one container holds, per resource, with their NUMA nodes then."""

    devices: Mapping[str, tuple[DeviceState, ...]]


@dataclass
class Pod:
    """The emulator's pod model: just enough for allocations and PodResources."""

    name: str
    namespace: str
    containers: dict[str, ContainerAllocation] = field(default_factory=dict)


class _DialError(Exception):
    pass


def _options_from_pb(msg: dp.DevicePluginOptions) -> PluginOptions:
    return PluginOptions(
        pre_start_required=msg.pre_start_required,
        get_preferred_allocation_available=msg.get_preferred_allocation_available,
    )


def _check_socket_path(path: Path) -> None:
    if len(os.fsencode(path)) > MAX_UNIX_PATH:
        raise ValueError(
            f"unix socket path {str(path)!r} is {len(os.fsencode(path))} bytes; Linux "
            f"allows {MAX_UNIX_PATH}. Use a short directory (tempfile.mkdtemp(prefix='dp-'))."
        )


class KubeletEmulator:
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
    ) -> None:
        if dial_mode not in ("sync", "after-reply"):
            raise ValueError(f"dial_mode must be 'sync' or 'after-reply', not {dial_mode!r}")
        self.plugin_dir = Path(plugin_dir).absolute()
        self.socket_path = self.plugin_dir / KUBELET_SOCKET
        _check_socket_path(self.socket_path)
        if pod_resources_socket is not None:
            pod_resources_socket = Path(pod_resources_socket).absolute()
            _check_socket_path(pod_resources_socket)
        self.dial_mode: DialMode = dial_mode
        self.dial_timeout = dial_timeout
        self._refuse = refuse
        self._cond = threading.Condition(threading.RLock())
        self._admit_lock = threading.Lock()
        self._resources: dict[str, _Resource] = {}
        self._pods: dict[str, Pod] = {}
        self._events: list[Event] = []
        # Dials in flight, so stop()/restart() can abort them instead of waiting 10 s.
        self._pending: set[grpc.Channel] = set()
        self._threads: set[threading.Thread] = set()
        self._server: grpc.Server | None = None
        self._executor: futures.ThreadPoolExecutor | None = None
        # Bumped by restart()/stop(): a dial that began in an older generation
        # belongs to a kubelet that no longer exists and must not register.
        self._generation = 0
        self._running = False
        self._stopped = False
        self.last_restart: float | None = None
        self._pod_resources = (
            PodResourcesServer(pod_resources_socket, self, qps=pod_resources_qps)
            if pod_resources_socket is not None
            else None
        )

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> KubeletEmulator:
        """Serve Registration on `<plugin_dir>/kubelet.sock` (and PodResources)."""
        with self._cond:
            if self._stopped:
                raise KubeletError("a stopped KubeletEmulator cannot be started again")
            if self._running:
                return self
            self._running = True
        self.plugin_dir.mkdir(parents=True, exist_ok=True)
        self._serve_registration()
        if self._pod_resources is not None:
            self._pod_resources.start()
        return self

    def stop(self) -> None:
        """Stop serving, close every plugin connection, join threads. Idempotent."""
        with self._cond:
            if self._stopped:
                return
            self._stopped = True
            self._running = False
            self._generation += 1
        self._stop_registration_server()
        if self._pod_resources is not None:
            self._pod_resources.stop()
        self._disconnect_all(reason="kubelet stopped")
        self._join_threads()
        self._event("stop", "", "")

    def restart(self) -> None:
        """Restart as the kubelet does; plugins must notice and register again.

        Stops the Registration server, drops every plugin connection (devices
        turn unhealthy, capacity stays known), deletes every socket in the
        device-plugins directory except the checkpoint, then serves a fresh
        `kubelet.sock`. Pods and their allocations survive, as the kubelet
        restores them from its checkpoint. `last_restart` is set to the moment
        the new socket accepts connections.
        """
        with self._cond:
            if not self._running:
                raise KubeletError("restart() needs a started emulator")
            self._generation += 1
        self._stop_registration_server()
        if self._pod_resources is not None:
            self._pod_resources.stop()
        self._disconnect_all(reason="kubelet restarted")
        self._join_threads()
        self._cleanup_plugin_dir()
        self._serve_registration()
        if self._pod_resources is not None:
            self._pod_resources.start()
        with self._cond:
            self.last_restart = time.monotonic()
        self._event("restart", "", str(self.socket_path))

    def __enter__(self) -> KubeletEmulator:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def _serve_registration(self) -> None:
        # Sync-mode Register handlers block for up to dial_timeout each, so give
        # concurrent registrations enough workers not to queue behind each other.
        executor = futures.ThreadPoolExecutor(max_workers=32, thread_name_prefix="kubelet-reg")
        server = grpc.server(executor)
        handler = grpc.method_handlers_generic_handler(
            "v1beta1.Registration",
            {
                "Register": grpc.unary_unary_rpc_method_handler(
                    self._register,
                    request_deserializer=dp.RegisterRequest.FromString,
                    response_serializer=dp.Empty.SerializeToString,
                )
            },
        )
        server.add_generic_rpc_handlers((handler,))
        # grpcio unlinks a stale socket at this path before bind, and unlinks the
        # socket again on stop: creating it is the "kubelet.sock was created"
        # signal plugins watch for.
        server.add_insecure_port(f"unix:{self.socket_path}")
        server.start()
        with self._cond:
            self._server, self._executor = server, executor

    def _stop_registration_server(self) -> None:
        with self._cond:
            server, executor = self._server, self._executor
            self._server = self._executor = None
            pending = list(self._pending)
        # Abort dials in flight first: their Register handlers then return quickly.
        for channel in pending:
            channel.close()
        if server is not None:
            server.stop(grace=None).wait(_JOIN_TIMEOUT)
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)

    def _disconnect_all(self, reason: str) -> None:
        """Close every plugin client; devices turn unhealthy, capacity stays."""
        endpoints: list[_Endpoint] = []
        with self._cond:
            for res in self._resources.values():
                if res.endpoint is not None:
                    endpoints.append(res.endpoint)
                    res.endpoint = None
                    res.registered_at = None
                    res.mark_unhealthy()
                    self._event_locked("stream-ended", res.name, reason)
            self._cond.notify_all()
        for ep in endpoints:
            ep.close()

    def _cleanup_plugin_dir(self) -> None:
        """The kubelet's CleanupPluginDirectory: remove sockets, keep the checkpoint."""
        try:
            entries = list(self.plugin_dir.iterdir())
        except FileNotFoundError:
            return
        for path in entries:
            if path.name == CHECKPOINT_FILE:
                continue
            try:
                mode = path.lstat().st_mode
            except FileNotFoundError:
                continue
            if stat.S_ISSOCK(mode):
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()

    def _spawn(self, target: Callable[[], None], name: str) -> threading.Thread:
        def run() -> None:
            try:
                target()
            except Exception:  # a background failure must show up, not vanish
                log.exception("kubelet emulator thread %s failed", name)
            finally:
                with self._cond:
                    self._threads.discard(threading.current_thread())

        thread = threading.Thread(target=run, name=name, daemon=True)
        with self._cond:
            self._threads.add(thread)
        thread.start()
        return thread

    def _join_threads(self) -> None:
        deadline = time.monotonic() + _JOIN_TIMEOUT
        while True:
            with self._cond:
                threads = [t for t in self._threads if t is not threading.current_thread()]
            if not threads:
                return
            for t in threads:
                t.join(max(0.0, deadline - time.monotonic()))
            if time.monotonic() >= deadline:
                alive = [t.name for t in threads if t.is_alive()]
                if alive:
                    log.warning("kubelet emulator threads still running: %s", alive)
                return

    # ------------------------------------------------------------------ events

    def _event_locked(self, kind: str, resource: str, detail: str) -> None:
        self._events.append(Event(time.monotonic(), kind, resource, detail))
        self._cond.notify_all()

    def _event(self, kind: str, resource: str, detail: str) -> None:
        with self._cond:
            self._event_locked(kind, resource, detail)

    # ------------------------------------------------------------------ Register

    def _register(self, request: dp.RegisterRequest, context: grpc.ServicerContext) -> dp.Empty:
        """The kubelet's Registration.Register handler."""
        name = request.resource_name
        self._event("register", name, f"endpoint={request.endpoint!r} version={request.version!r}")
        error = self._validate(request)
        if error is not None:
            self._event("rejected", name, error)
            context.abort(grpc.StatusCode.UNKNOWN, error)
        with self._cond:
            generation = self._generation
        context.add_callback(lambda: self._event("replied", name, ""))
        if self.dial_mode == "after-reply":
            # Old kubelets: `go m.addEndpoint(r)`. The callback runs once the
            # reply has been sent, so the dial really comes after it.
            context.add_callback(
                lambda: self._spawn(
                    lambda: self._connect_quietly(request, generation),
                    name=f"kubelet-dial-{name}",
                )
            )
            return dp.Empty()
        try:
            self._connect(request, generation)
        except _DialError as exc:
            message = str(exc)
        else:
            return dp.Empty()
        context.abort(grpc.StatusCode.UNKNOWN, message)
        raise AssertionError("unreachable: context.abort raises")

    def _validate(self, request: dp.RegisterRequest) -> str | None:
        if request.version != API_VERSION:
            return ERR_UNSUPPORTED_VERSION.format(version=request.version)
        if not is_extended_resource_name(request.resource_name):
            return ERR_INVALID_RESOURCE_NAME.format(name=request.resource_name)
        if self._refuse is not None:
            refusal = self._refuse(request)
            if refusal is not None:
                self._event("refused", request.resource_name, refusal)
                return refusal
        return None

    def _connect_quietly(self, request: dp.RegisterRequest, generation: int) -> None:
        # After the reply nobody can be told about a failure: the kubelet logs it.
        with contextlib.suppress(_DialError):
            self._connect(request, generation)

    def _connect(self, request: dp.RegisterRequest, generation: int) -> None:
        """Dial the endpoint, get the options, store the endpoint, start ListAndWatch."""
        name = request.resource_name
        target = self.plugin_dir / request.endpoint
        channel = grpc.insecure_channel(f"unix:{target}", options=list(PLUGIN_CHANNEL_OPTIONS))
        with self._cond:
            if generation != self._generation:
                channel.close()
                raise _DialError(ERR_FAILED_TO_DIAL.format(reason="kubelet shutting down"))
            # Closing the channel aborts the dial in flight (stop()/restart()).
            self._pending.add(channel)
        try:
            if self.dial_mode == "sync":
                options = self._dial_and_get_options(channel, name, target)
            else:
                ready = grpc.channel_ready_future(channel)
                try:
                    ready.result(timeout=self.dial_timeout)
                except grpc.FutureTimeoutError:
                    raise self._dial_failed(channel, name, "context deadline exceeded") from None
                except grpc.FutureCancelledError:
                    raise self._dial_failed(channel, name, "context canceled") from None
                self._event("dial", name, str(target))
                # Kubelets that dialled after replying used the request's options.
                options = _options_from_pb(request.options)
                self._event("options", name, f"from RegisterRequest: {options}")
        finally:
            with self._cond:
                self._pending.discard(channel)
        ep = _Endpoint(resource=name, endpoint=request.endpoint, channel=channel, options=options)
        with self._cond:
            if generation != self._generation:
                channel.close()
                raise _DialError(ERR_FAILED_TO_DIAL.format(reason="kubelet restarted"))
            res = self._resources.setdefault(name, _Resource(name))
            old = res.endpoint
            res.endpoint = ep
            res.last_endpoint = request.endpoint
            res.last_options = options
            res.registrations += 1
            res.registered_at = time.monotonic()
            res.listed = False
            self._event_locked("registered", name, request.endpoint)
            # ListAndWatch begins before Register returns (the kubelet's
            # `go runClient`), on the thread's own schedule.
            ep.thread = self._spawn(lambda: self._watch(ep), name=f"kubelet-law-{name}")
        if old is not None:
            self._event("replaced", name, f"old endpoint {old.endpoint!r} closed")
            old.close()

    def _dial_and_get_options(
        self, channel: grpc.Channel, name: str, target: Path
    ) -> PluginOptions:
        """The kubelet's blocking dial, then GetDevicePluginOptions.

        A wait-for-ready call connects and asks in one step, as grpc-go's
        blocking dial followed by the call does; grpcio's channel_ready_future
        would add a polling thread and milliseconds to every registration.
        """
        method = DEVICE_PLUGIN_METHODS["GetDevicePluginOptions"]
        stub = channel.unary_unary(
            method.path,
            request_serializer=method.serialize,
            response_deserializer=method.deserialize,
        )
        try:
            reply = stub(dp.Empty(), wait_for_ready=True, timeout=self.dial_timeout)
        except grpc.RpcError as exc:
            if exc.code() is grpc.StatusCode.DEADLINE_EXCEEDED:
                raise self._dial_failed(channel, name, "context deadline exceeded") from None
            if exc.code() is grpc.StatusCode.CANCELLED:
                raise self._dial_failed(channel, name, "context canceled") from None
            reason = f"{exc.code().name}: {exc.details()}"
            raise self._dial_failed(channel, name, reason, "GetDevicePluginOptions") from None
        except ValueError:  # the channel was closed under us: stop()/restart()
            raise self._dial_failed(
                channel, name, "channel closed", "GetDevicePluginOptions"
            ) from None
        options = _options_from_pb(reply)
        self._event("dial", name, str(target))
        self._event("options", name, str(options))
        return options

    def _dial_failed(
        self, channel: grpc.Channel, name: str, reason: str, rpc: str | None = None
    ) -> _DialError:
        channel.close()
        message = f"{rpc} failed: {reason}" if rpc else ERR_FAILED_TO_DIAL.format(reason=reason)
        self._event("dial-failed", name, message)
        return _DialError(message)

    def _watch(self, ep: _Endpoint) -> None:
        """Read one endpoint's ListAndWatch stream until it ends; never redial."""
        method = DEVICE_PLUGIN_METHODS["ListAndWatch"]
        name = ep.resource
        detail = "stream ended (EOF)"
        try:
            call = ep.channel.unary_stream(
                method.path,
                request_serializer=method.serialize,
                response_deserializer=method.deserialize,
            )(dp.Empty())
            ep.call = call
            for response in call:
                with self._cond:
                    res = self._resources[name]
                    if res.endpoint is not ep:
                        break
                    res.devices = {
                        d.ID: DeviceState(d.ID, d.health, tuple(n.ID for n in d.topology.nodes))
                        for d in response.devices
                    }
                    res.lists += 1
                    res.listed = True
                    healthy = sum(1 for d in res.devices.values() if d.healthy)
                    self._event_locked(
                        "list", name, f"{len(res.devices)} devices, {healthy} healthy"
                    )
        except grpc.RpcError as exc:
            detail = f"{exc.code().name}: {exc.details()}"
        except ValueError as exc:  # grpcio raises this for calls on a closed channel
            detail = f"channel closed: {exc}"
        with self._cond:
            res = self._resources[name]
            if res.endpoint is not ep:
                self._event_locked("stale-stream-ended", name, detail)
                return
            # The kubelet disconnects the client and marks the resource unhealthy;
            # it forgets the resource 5 minutes later unless it registers again.
            res.endpoint = None
            res.registered_at = None
            res.mark_unhealthy()
            self._event_locked("stream-ended", name, detail)
        ep.channel.close()

    # ------------------------------------------------------------------ queries

    def resources(self) -> dict[str, ResourceState]:
        """Snapshot of every resource the kubelet has known since it was created."""
        with self._cond:
            return {name: r.snapshot() for name, r in self._resources.items()}

    def capacity(self) -> dict[str, int]:
        """Node capacity per resource: every device, healthy or not."""
        with self._cond:
            return {name: len(r.devices) for name, r in self._resources.items()}

    def allocatable(self) -> dict[str, int]:
        """Node allocatable per resource: the healthy devices."""
        with self._cond:
            return {
                name: sum(1 for d in r.devices.values() if d.healthy)
                for name, r in self._resources.items()
            }

    def options(self, resource: str) -> PluginOptions | None:
        """Options of the current (else last) registration of `resource`."""
        with self._cond:
            res = self._resources.get(resource)
            return res.snapshot().options if res is not None else None

    def registration_count(self, resource: str) -> int:
        with self._cond:
            res = self._resources.get(resource)
            return res.registrations if res is not None else 0

    @property
    def events(self) -> list[Event]:
        """A copy of the event log, oldest first."""
        with self._cond:
            return list(self._events)

    def events_of(self, kind: str, resource: str | None = None) -> list[Event]:
        """The events of one kind (and resource, if given), oldest first."""
        with self._cond:
            return [
                e
                for e in self._events
                if e.kind == kind and (resource is None or e.resource == resource)
            ]

    def pods(self) -> dict[str, Pod]:
        """The admitted pods (copies), keyed by `namespace/name`."""
        with self._cond:
            return {
                key: Pod(p.name, p.namespace, dict(p.containers)) for key, p in self._pods.items()
            }

    def wait_for(self, predicate: Callable[[KubeletEmulator], bool], timeout: float) -> bool:
        """Block until `predicate(self)` holds; re-checked on every state change.

        Returns False on timeout. Do not call from the loop serving the plugin.
        """
        with self._cond:
            return self._cond.wait_for(lambda: predicate(self), timeout)

    def wait_registered(
        self, names: str | Iterable[str], timeout: float, *, listed: bool = False
    ) -> bool:
        """Wait until every resource in `names` has a live registration.

        With `listed=True`, also until a ListAndWatch response arrived for it
        since that registration.
        """
        wanted = [names] if isinstance(names, str) else list(names)

        def ok(_: KubeletEmulator) -> bool:
            for name in wanted:
                res = self._resources.get(name)
                if res is None or res.endpoint is None:
                    return False
                if listed and not res.listed:
                    return False
            return True

        return self.wait_for(ok, timeout)

    # ------------------------------------------------------------------ plugin calls

    def _channel(self, resource: str) -> grpc.Channel:
        with self._cond:
            res = self._resources.get(resource)
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
        self._event("allocate", resource, ",".join(ids))
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
        self._event("preferred", resource, f"size={size}")
        response = self.call(resource, "GetPreferredAllocation", request, timeout=timeout)
        if not response.container_responses:
            return []
        return list(response.container_responses[0].deviceIDs)

    def pre_start(
        self, resource: str, device_ids: Iterable[str], *, timeout: float = PRE_START_TIMEOUT
    ) -> dp.PreStartContainerResponse:
        """PreStartContainer, with the kubelet's 30 s deadline."""
        ids = list(device_ids)
        self._event("pre-start", resource, ",".join(ids))
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
        unless every resource succeeds. Raises AdmissionError when the kubelet
        would refuse the pod, grpc.RpcError when a plugin call fails.
        """
        key = f"{namespace}/{pod}"
        with self._admit_lock:  # the kubelet admits pods one at a time
            with self._cond:
                existing = self._pods.get(key)
                if existing is not None and container in existing.containers:
                    raise ValueError(f"container {container!r} of {key} was already admitted")
            responses: dict[str, dp.ContainerAllocateResponse] = {}
            held: dict[str, tuple[DeviceState, ...]] = {}
            for resource, count in requests.items():
                if count <= 0:
                    continue
                chosen, options = self._choose(resource, count)
                responses[resource] = self.allocate(resource, [d.id for d in chosen])
                if options.pre_start_required:
                    self.pre_start(resource, [d.id for d in chosen])
                held[resource] = chosen
            with self._cond:
                entry = self._pods.setdefault(key, Pod(pod, namespace))
                entry.containers[container] = ContainerAllocation(MappingProxyType(held))
                detail = "; ".join(f"{r}={','.join(d.id for d in ds)}" for r, ds in held.items())
                self._event_locked("admit", key, f"{container}: {detail}")
            return responses

    def _choose(self, resource: str, count: int) -> tuple[tuple[DeviceState, ...], PluginOptions]:
        with self._cond:
            res = self._resources.get(resource)
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
        return {
            d.id
            for p in self._pods.values()
            for c in p.containers.values()
            for d in c.devices.get(resource, ())
        }

    def remove_pod(self, pod: str, *, namespace: str = "default") -> bool:
        """Forget a pod and free its devices. The plugin is not told (nor by the kubelet)."""
        key = f"{namespace}/{pod}"
        with self._cond:
            removed = self._pods.pop(key, None)
            if removed is not None:
                self._event_locked("remove-pod", key, ",".join(removed.containers))
            return removed is not None

    # ------------------------------------------------------------------ for PodResources

    def _pods_snapshot(self) -> list[Pod]:
        with self._cond:
            return [Pod(p.name, p.namespace, dict(p.containers)) for p in self._pods.values()]

    def _healthy_devices(self) -> Iterator[tuple[str, DeviceState]]:
        with self._cond:
            items = [
                (name, d)
                for name, r in self._resources.items()
                for d in r.devices.values()
                if d.healthy
            ]
        yield from items
