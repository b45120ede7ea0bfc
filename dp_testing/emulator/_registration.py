"""The kubelet's device-manager side of registration, on grpcio.

Serves `Registration.Register` on `kubelet.sock`; for each accepted request
dials the plugin's endpoint on a channel (hence a connection) of its own, gets
its options, stores the endpoint and reads its ListAndWatch stream until it
ends. Also the teardown a kubelet restart does: drop every client, delete the
sockets in the device-plugins directory.
"""

from __future__ import annotations

import contextlib
import logging
import stat
import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import grpc

from dp_testing.emulator._rpc import (
    API_VERSION,
    CHECKPOINT_FILE,
    DEVICE_PLUGIN_METHODS,
    ERR_FAILED_TO_DIAL,
    ERR_INVALID_RESOURCE_NAME,
    ERR_UNSUPPORTED_VERSION,
    PLUGIN_CHANNEL_OPTIONS,
    dp,
    is_extended_resource_name,
)
from dp_testing.emulator._state import (
    DeviceState,
    KubeletError,
    KubeletState,
    PluginOptions,
    _Resource,
)
from dp_testing.emulator._workers import Task, Workers

log = logging.getLogger(__name__)

DialMode = Literal["sync", "after-reply"]
RefuseHook = Callable[[dp.RegisterRequest], "str | None"]

#: How long stop()/restart() wait for a background thread before giving up on it.
#: Threads are daemons, so one that is stuck cannot keep the process alive.
JOIN_TIMEOUT = 5.0


@dataclass
class _Endpoint:
    """The kubelet's client for one registration: one channel, one stream."""

    resource: str
    endpoint: str
    channel: grpc.Channel
    options: PluginOptions
    call: Any = None  # the ListAndWatch call, cancellable
    watcher: Task | None = None
    # After its stream ends, how long the kubelet keeps the client before it
    # notices and drops it (see `KubeletEmulator.break_connection`).
    linger: float = 0.0

    def close(self, *, join: bool = True) -> None:
        """Stop the client as the kubelet does: cancel the stream, close the conn."""
        if self.call is not None:
            self.call.cancel()
        self.channel.close()
        if join and self.watcher is not None:
            self.watcher.join(JOIN_TIMEOUT)


class _DialError(Exception):
    pass


def _options_from_pb(msg: dp.DevicePluginOptions) -> PluginOptions:
    return PluginOptions(
        pre_start_required=msg.pre_start_required,
        get_preferred_allocation_available=msg.get_preferred_allocation_available,
    )


class Registration:
    """Registration server plus one client per registered plugin endpoint."""

    def __init__(
        self,
        state: KubeletState,
        plugin_dir: Path,
        socket_path: Path,
        *,
        dial_mode: DialMode,
        dial_timeout: float,
        refuse: RefuseHook | None,
        keeps_clients: bool = True,
        on_list: Callable[[], None] = lambda: None,
    ) -> None:
        self.state = state
        self.plugin_dir = plugin_dir
        self.socket_path = socket_path
        self.dial_mode: DialMode = dial_mode
        self.keeps_clients = keeps_clients
        self.dial_timeout = dial_timeout
        self._refuse = refuse
        # Called after each device list is stored: the kubelet writes its checkpoint.
        self._on_list = on_list
        # Dials in flight, so stop()/restart() can abort them instead of waiting 10 s.
        self._pending: set[grpc.Channel] = set()
        self._workers = Workers()
        self._tasks: set[Task] = set()
        self._server: grpc.Server | None = None
        self._executor: futures.ThreadPoolExecutor | None = None
        # Bumped by restart()/stop(): a dial that began in an older generation
        # belongs to a kubelet that no longer exists and must not register.
        self._generation = 0

    def retire_locked(self) -> None:
        """Make every dial begun so far belong to a kubelet that is gone."""
        self._generation += 1

    # ------------------------------------------------------------------ lifecycle

    def serve(self) -> None:
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
        with self.state.cond:
            self._server, self._executor = server, executor

    def stop_server(self) -> None:
        with self.state.cond:
            server, executor = self._server, self._executor
            self._server = self._executor = None
            pending = list(self._pending)
        # Abort dials in flight first: their Register handlers then return quickly.
        for channel in pending:
            channel.close()
        if server is not None:
            server.stop(grace=None).wait(JOIN_TIMEOUT)
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)

    def disconnect_all(self, reason: str) -> None:
        """Close every plugin client; devices turn unhealthy, capacity stays.

        The readers are not joined one by one here: join_threads() waits for
        all of them, which lets them wind down at the same time.
        """
        endpoints: list[_Endpoint] = []
        state = self.state
        with state.cond:
            for res in state.resources.values():
                if res.endpoint is not None:
                    endpoints.append(res.endpoint)
                    res.detach()
                    state.event_locked("stream-ended", res.name, reason)
            state.cond.notify_all()
        for ep in endpoints:
            ep.close(join=False)

    def cleanup_plugin_dir(self) -> None:
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

    def _spawn(self, target: Callable[[], None], name: str) -> Task:
        def run() -> None:
            try:
                target()
            finally:
                with self.state.cond:
                    self._tasks.discard(task)

        # Holding the lock keeps run()'s finally from reading `task` before it is bound.
        with self.state.cond:
            task = self._workers.submit(run, name)
            self._tasks.add(task)
        return task

    def join_threads(self) -> None:
        """Wait for every client task (ListAndWatch readers, late dials) to end."""
        deadline = time.monotonic() + JOIN_TIMEOUT
        while True:
            with self.state.cond:
                tasks = [t for t in self._tasks if t.thread is not threading.current_thread()]
            if not tasks:
                return
            for t in tasks:
                t.join(max(0.0, deadline - time.monotonic()))
            if time.monotonic() >= deadline:
                alive = [t.name for t in tasks if not t.done()]
                if alive:
                    log.warning("kubelet emulator threads still running: %s", alive)
                return

    def close(self) -> None:
        """Release the worker threads; the emulator is not started again."""
        self._workers.close()

    # ------------------------------------------------------------------ Register

    def _register(self, request: dp.RegisterRequest, context: grpc.ServicerContext) -> dp.Empty:
        """The kubelet's Registration.Register handler."""
        name = request.resource_name
        event = self.state.event
        event("register", name, f"endpoint={request.endpoint!r} version={request.version!r}")
        error = self._validate(request)
        if error is not None:
            event("rejected", name, error)
            context.abort(grpc.StatusCode.UNKNOWN, error)
        with self.state.cond:
            generation = self._generation
        context.add_callback(lambda: event("replied", name, ""))
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
        held, refusal = self._held_client(request)
        if refusal is not None:
            event("rejected", name, refusal)
            context.abort(grpc.StatusCode.UNKNOWN, refusal)
        if held:
            return dp.Empty()
        try:
            self._connect(request, generation)
        except _DialError as exc:
            message = str(exc)
        else:
            return dp.Empty()
        context.abort(grpc.StatusCode.UNKNOWN, message)
        raise AssertionError("unreachable: context.abort raises")

    def _held_client(self, request: dp.RegisterRequest) -> tuple[bool, str | None]:
        """The kubelet's connectClient (1.26 and later): while it holds a client
        for the name, a Register for the same socket is answered at once,
        without a dial, and one for another socket is refused."""
        if not self.keeps_clients:
            return False, None
        name = request.resource_name
        with self.state.cond:
            res = self.state.resources.get(name)
            held = res.endpoint if res is not None else None
        if held is None:
            return False, None
        if held.endpoint != request.endpoint:
            path = self.plugin_dir / held.endpoint
            why = f"the device plugin {name} already registered with a different socket path"
            return True, f"{why} {path}"
        self.state.event("already-connected", name, request.endpoint)
        return True, None

    def break_connection(self, name: str, linger: float) -> None:
        """Close the client's connection; the client is dropped `linger` s later."""
        with self.state.cond:
            res = self.state.resources.get(name)
            ep = res.endpoint if res is not None else None
            if ep is None:
                raise KubeletError(f"{name} has no client")
            ep.linger = linger
        ep.channel.close()

    def _validate(self, request: dp.RegisterRequest) -> str | None:
        if request.version != API_VERSION:
            return ERR_UNSUPPORTED_VERSION.format(version=request.version)
        if not is_extended_resource_name(request.resource_name):
            return ERR_INVALID_RESOURCE_NAME.format(name=request.resource_name)
        if self._refuse is not None:
            refusal = self._refuse(request)
            if refusal is not None:
                self.state.event("refused", request.resource_name, refusal)
                return refusal
        return None

    def _connect_quietly(self, request: dp.RegisterRequest, generation: int) -> None:
        # After the reply nobody can be told about a failure: the kubelet logs it.
        with contextlib.suppress(_DialError):
            self._connect(request, generation)

    def _connect(self, request: dp.RegisterRequest, generation: int) -> None:
        """Dial the endpoint, get the options, store the endpoint, start ListAndWatch."""
        name = request.resource_name
        state = self.state
        target = self.plugin_dir / request.endpoint
        channel = grpc.insecure_channel(f"unix:{target}", options=list(PLUGIN_CHANNEL_OPTIONS))
        with state.cond:
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
                state.event("dial", name, str(target))
                # Kubelets that dialled after replying used the request's options.
                options = _options_from_pb(request.options)
                state.event("options", name, f"from RegisterRequest: {options}")
        finally:
            with state.cond:
                self._pending.discard(channel)
        ep = _Endpoint(resource=name, endpoint=request.endpoint, channel=channel, options=options)
        with state.cond:
            if generation != self._generation:
                channel.close()
                raise _DialError(ERR_FAILED_TO_DIAL.format(reason="kubelet restarted"))
            res = state.resources.get(name)
            if res is None:
                res = state.resources[name] = _Resource(name)
            old = res.attach(ep, time.monotonic())
            state.event_locked("registered", name, request.endpoint)
            # ListAndWatch begins before Register returns (the kubelet's
            # `go runClient`), on the thread's own schedule.
            ep.watcher = self._spawn(lambda: self._watch(ep), name=f"kubelet-law-{name}")
        if old is not None:
            state.event("replaced", name, f"old endpoint {old.endpoint!r} closed")
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
        self.state.event("dial", name, str(target))
        self.state.event("options", name, str(options))
        return options

    def _dial_failed(
        self, channel: grpc.Channel, name: str, reason: str, rpc: str | None = None
    ) -> _DialError:
        channel.close()
        message = f"{rpc} failed: {reason}" if rpc else ERR_FAILED_TO_DIAL.format(reason=reason)
        self.state.event("dial-failed", name, message)
        return _DialError(message)

    def _watch(self, ep: _Endpoint) -> None:
        """Read one endpoint's ListAndWatch stream until it ends; never redial."""
        method = DEVICE_PLUGIN_METHODS["ListAndWatch"]
        name = ep.resource
        state = self.state
        detail = "stream ended (EOF)"
        try:
            call = ep.channel.unary_stream(
                method.path,
                request_serializer=method.serialize,
                response_deserializer=method.deserialize,
            )(dp.Empty())
            ep.call = call
            for response in call:
                devices = {
                    d.ID: DeviceState(d.ID, d.health, tuple(n.ID for n in d.topology.nodes))
                    for d in response.devices
                }
                with state.cond:
                    res = state.resources[name]
                    if res.endpoint is not ep:
                        break
                    res.replace_devices(devices)
                    healthy = sum(1 for d in devices.values() if d.healthy)
                    state.event_locked("list", name, f"{len(devices)} devices, {healthy} healthy")
                self._on_list()
        except grpc.RpcError as exc:
            detail = f"{exc.code().name}: {exc.details()}"
        except ValueError as exc:  # grpcio raises this for calls on a closed channel
            detail = f"channel closed: {exc}"
        if ep.linger:
            time.sleep(ep.linger)  # the kubelet's runClient has not noticed yet
        with state.cond:
            res = state.resources[name]
            if res.endpoint is not ep:
                state.event_locked("stale-stream-ended", name, detail)
                return
            # The kubelet disconnects the client and marks the resource unhealthy;
            # it forgets the resource 5 minutes later unless it registers again.
            res.detach()
            state.event_locked("stream-ended", name, detail)
        ep.channel.close()


__all__ = ["JOIN_TIMEOUT", "DialMode", "RefuseHook", "Registration"]
