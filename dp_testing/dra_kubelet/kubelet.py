"""A DRA kubelet on grpcio: the plugin watcher, DRA registration, and claim calls.

What the kubelet does with a DRA driver, and nothing else:

* The plugin watcher notices every Unix socket in the registry directory whose
  name does not start with "." (the kubelet takes any such socket; drivers
  name theirs `<driver>-reg.sock`). The kubelet uses inotify; this polls
  (`poll_interval`), and a socket whose file was made again (another inode or
  modification time) is registered again, as a create event makes the
  kubelet do. A socket that is gone is deregistered.
* Registering dials the socket (blocking, 10 s), calls GetInfo (1 s), checks
  the type is "DRAPlugin", takes the first of the plugin's supported versions
  that the kubelet supports (by default "v1.DRAPlugin", "v1beta1.DRAPlugin"),
  and calls NotifyRegistrationStatus (5 s): true, or false with the error.
* NodePrepareResources and NodeUnprepareResources go to the endpoint GetInfo
  named, on the chosen version's service, each with a 45 s deadline, on one
  connection per plugin, made and connected when it registers, before it
  is told. Claims missing from a reply are asked for again.
* On that connection a registered plugin is asked for its health stream, and
  asked again `health_retry` seconds (5 s) after every end (`_health`): by a
  1.36 kubelet (`release`) for v1alpha1, whether it advertised it or not; by
  a 1.37 one for v1 if it advertised it, else v1alpha1 if it advertised
  that, else not at all (`pick_health_service`). What the plugin says of each device of
  a prepared claim is what `claim_health` gives, as the kubelet puts it in
  the pod's `allocatedResourcesStatus`.
* `container_cdi_devices` gives, for a pod, the CDI devices each container
  is handed from the claims prepared here, the claim the scheduler made for
  the pod's extended resources included (`_containers`).
* restart() forgets every plugin and connection and discovers the sockets
  again; the sockets stay, as the kubelet leaves plugins_registry alone.

Thread based (synchronous grpcio), like the device-plugin emulator: the
blocking methods must run outside a loop that serves the plugin under test
(`asyncio.to_thread`).
"""

from __future__ import annotations

import os
import stat
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, NamedTuple

import grpc

from dp_testing.dra_kubelet._containers import container_cdi_devices
from dp_testing.dra_kubelet._health import HealthCache, HealthStream
from dp_testing.dra_kubelet._rpc import (
    CALL_TIMEOUT,
    DIAL_TIMEOUT,
    DRA_PLUGIN_TYPE,
    GET_INFO,
    GET_INFO_TIMEOUT,
    HEALTH_RETRY,
    HEALTH_SERVICES_BY_RELEASE,
    KUBELET_SERVICES,
    NOTIFY,
    NOTIFY_TIMEOUT,
    SERVICE_MESSAGES,
    Claim,
    Device,
    Plugin,
    PrepareResult,
    ResourceHealth,
    device,
    method_path,
    pick_health_service,
    reg,
)

__all__ = ["DraCallError", "DraEvent", "DraKubeletEmulator"]


class DraEvent(NamedTuple):
    """One thing the emulated kubelet did or saw.

    Kinds: "discovered" (a socket appeared or was made again), "info" (GetInfo
    answered; detail: the plugin info), "rejected" (registration refused;
    detail: the error sent), "registered" (detail: the chosen service),
    "register-failed" (dial, GetInfo or Notify failed), "deregistered",
    "prepare", "unprepare" (detail: the claim UIDs asked), "retry" (claims
    missing from a reply asked again), "health-opened" (detail: the health
    service asked for, e.g. "v1.DRAResourceHealth"), "health-ended"
    (detail: the stream's error, or "EOF"), "health" (detail: a device whose
    health changed, `pool/device=Health`), "restart", "stop". `driver` is
    the plugin name, or the socket path before GetInfo named it.
    """

    time: float
    kind: str
    driver: str
    detail: str


class DraCallError(RuntimeError):
    """A DRA call failed as a whole: a gRPC status, or claims left out of every reply."""

    def __init__(self, code: grpc.StatusCode | None, details: str) -> None:
        super().__init__(f"{code.name if code else 'MISSING'}: {details}")
        self.code = code
        self.details = details


def _ignore(state: grpc.ChannelConnectivity) -> None:
    pass


class _Connection:
    """The kubelet's one connection per registered plugin (grpc.NewClient, then Connect)."""

    def __init__(self, plugin: Plugin) -> None:
        self.plugin = plugin
        self.channel = grpc.insecure_channel(
            f"unix:{plugin.endpoint}", options=[("grpc.default_authority", "localhost")]
        )
        # conn.Connect(): the kubelet connects at once, to see early whether
        # the plugin is there, not at the first call.
        self.channel.subscribe(_ignore, try_to_connect=True)

    def call(self, method: str, request: Any, response: type[Any], timeout: float) -> Any:
        rpc = self.channel.unary_unary(
            method_path(self.plugin.service, method),
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=response.FromString,
        )
        return rpc(request, timeout=timeout)


class DraKubeletEmulator:
    """The kubelet's DRA side, watching `registry_dir`. Use start()/stop() or `with`.

    At start it makes the plugin registry and the plugins directory
    (`plugins_dir`, beside the registry unless given), as the kubelet does
    (`setupDataDirs`); a plugin makes only its own directory in the latter.
    """

    def __init__(
        self,
        registry_dir: Path,
        *,
        plugins_dir: Path | None = None,
        poll_interval: float = 0.05,
        supported_services: Sequence[str] = KUBELET_SERVICES,
        call_timeout: float = CALL_TIMEOUT,
        retries: int = 2,
        health_retry: float = HEALTH_RETRY,
        release: str = "1.36",
    ) -> None:
        unknown = [s for s in supported_services if s not in SERVICE_MESSAGES]
        if unknown:
            raise ValueError(f"no messages for services {unknown}; known: {list(SERVICE_MESSAGES)}")
        if release not in HEALTH_SERVICES_BY_RELEASE:
            known = list(HEALTH_SERVICES_BY_RELEASE)
            raise ValueError(f"no kubelet release {release!r} is modelled; known: {known}")
        self.release = release
        self.registry_dir = Path(registry_dir).absolute()
        self.plugins_dir = (
            Path(plugins_dir).absolute() if plugins_dir else self.registry_dir.parent / "plugins"
        )
        self.poll_interval = poll_interval
        self.supported_services = tuple(supported_services)
        self.call_timeout = call_timeout
        self.retries = retries
        self.health_retry = health_retry
        self._lock = threading.Condition()
        self._events: list[DraEvent] = []
        self._plugins: dict[str, _Connection] = {}  # by driver name
        self._seen: dict[Path, tuple[int, int]] = {}  # socket -> identity registered from
        self._by_socket: dict[Path, str] = {}  # socket -> driver registered through it
        self._health = HealthCache()
        self._health_streams: dict[str, HealthStream] = {}  # by driver name
        # Prepared claims by UID: the driver and the devices it answered with.
        self._claims: dict[str, tuple[str, tuple[Device, ...]]] = {}
        self._names: dict[tuple[str, str], str] = {}  # (namespace, name) -> UID prepared
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- lifecycle ---------------------------------------------------------------------

    def start(self) -> DraKubeletEmulator:
        # The kubelet makes both at start (0750); the plugin watcher makes
        # its directory (0755) if it is not there.
        self.plugins_dir.mkdir(mode=0o750, parents=True, exist_ok=True)
        self.registry_dir.mkdir(mode=0o755, parents=True, exist_ok=True)
        self._stop.clear()
        self._thread = threading.Thread(target=self._watch, name="dra-plugin-watcher", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._halt()
        self._record("stop", "", "")

    def restart(self) -> None:
        """Forget every plugin and connection; discover the sockets again."""
        self._halt()
        self._record("restart", "", "")
        self.start()

    def __enter__(self) -> DraKubeletEmulator:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def _halt(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        with self._lock:
            streams = list(self._health_streams.values())
            self._health_streams.clear()
        for stream in streams:
            stream.stop()
        with self._lock:
            for connection in self._plugins.values():
                connection.channel.close()
            self._plugins.clear()
            self._seen.clear()
            self._by_socket.clear()
            self._health = HealthCache()

    # -- queries -----------------------------------------------------------------------

    def plugins(self) -> dict[str, Plugin]:
        """The registered plugins by driver name."""
        with self._lock:
            return {name: c.plugin for name, c in self._plugins.items()}

    def events(self, kind: str | None = None) -> list[DraEvent]:
        with self._lock:
            return [e for e in self._events if kind is None or e.kind == kind]

    def wait_for(
        self, kind: str, driver: str | None = None, *, count: int = 1, timeout: float = 10.0
    ) -> list[DraEvent]:
        """Block until `count` events of `kind` (for `driver`) have happened; return them."""

        def matching() -> list[DraEvent]:
            return [
                e for e in self._events if e.kind == kind and (driver is None or e.driver == driver)
            ]

        with self._lock:
            if not self._lock.wait_for(lambda: len(matching()) >= count, timeout):
                raise TimeoutError(
                    f"{count} {kind!r} event(s) for {driver!r} not seen in {timeout} s; "
                    f"events: {self._events}"
                )
            return matching()

    # -- claims ------------------------------------------------------------------------

    def prepare(
        self, driver: str, claims: Iterable[Any], *, service: str | None = None
    ) -> dict[str, PrepareResult]:
        """NodePrepareResources for `claims` (namespace, uid, name); results by claim UID."""
        claims = list(claims)
        replies = self._claims_call(driver, "NodePrepareResources", claims, service)
        results = {
            uid: PrepareResult(tuple(device(d) for d in reply.devices), reply.error)
            for uid, reply in replies.items()
        }
        with self._lock:
            for claim in claims:
                result = results.get(claim.uid)
                if result is not None and not result.error:
                    self._claims[claim.uid] = (driver, result.devices)
                    self._names[(claim.namespace, claim.name)] = claim.uid
        return results

    def container_cdi_devices(self, pod: dict[str, Any]) -> dict[str, list[str]]:
        """The CDI IDs the kubelet gives each container of `pod` (a Pod object,
        with its status), from the claims prepared here (`_containers`)."""
        namespace = pod["metadata"].get("namespace", "default")
        with self._lock:
            claims = {
                name: self._claims[uid][1]
                for (ns, name), uid in self._names.items()
                if ns == namespace and uid in self._claims
            }
        return container_cdi_devices(pod, claims)

    def unprepare(
        self, driver: str, claims: Iterable[Any], *, service: str | None = None
    ) -> dict[str, str]:
        """NodeUnprepareResources; each claim's error ("" when it was released), by UID."""
        replies = self._claims_call(driver, "NodeUnprepareResources", claims, service)
        with self._lock:
            for uid, reply in replies.items():
                if not reply.error:
                    self._claims.pop(uid, None)
        return {uid: reply.error for uid, reply in replies.items()}

    # -- device health -----------------------------------------------------------------

    def claim_health(self, uid: str) -> tuple[ResourceHealth, ...]:
        """The health of each device of prepared claim `uid`, as the kubelet
        writes it into the pod's `allocatedResourcesStatus` now; () if the
        claim is not prepared."""
        with self._lock:
            return self._claim_health(uid)

    def _claim_health(self, uid: str) -> tuple[ResourceHealth, ...]:
        driver, devices = self._claims.get(uid, ("", ()))
        now = time.time()
        return tuple(
            ResourceHealth(
                d.cdi_device_ids[0]
                if d.cdi_device_ids
                else f"{driver}/{d.pool_name}/{d.device_name}",
                self._health.get(driver, d.pool_name, d.device_name, now)[0],
            )
            for d in devices
        )

    def wait_claim_health(
        self, uid: str, health: str, *, timeout: float = 10.0
    ) -> tuple[ResourceHealth, ...]:
        """Block until every device of claim `uid` reads `health`; return them."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while True:
                now = self._claim_health(uid)
                if now and all(entry.health == health for entry in now):
                    return now
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"claim {uid} never read {health} in {timeout} s: {now}; "
                        f"events: {[e for e in self._events if e.kind.startswith('health')]}"
                    )
                # Also woken by each message; a timeout turns health Unknown unannounced.
                self._lock.wait(min(left, 0.05))

    def health_message(self, driver: str, pool: str, device_name: str) -> str:
        """What the plugin last said of a device (its `message`)."""
        with self._lock:
            return self._health.get(driver, pool, device_name, time.time())[1]

    def _watch_health(self, driver: str, connection: _Connection) -> None:
        service = pick_health_service(self.release, connection.plugin.versions)
        if not service:
            return  # a 1.37 kubelet opens no stream on a plugin that advertised none

        def on_message(response: Any) -> None:
            with self._lock:
                changed = self._health.update(driver, response, time.time())
            for change in changed:
                self._record("health", driver, change)
            if not changed:
                with self._lock:
                    self._lock.notify_all()

        def on_event(kind: str, detail: str) -> None:
            if kind == "health-ended":
                with self._lock:
                    self._health.clear(driver)
            self._record(kind, driver, detail)

        stream = HealthStream(connection.channel, service, self.health_retry, on_message, on_event)
        with self._lock:
            old = self._health_streams.pop(driver, None)
            self._health_streams[driver] = stream
        if old is not None:
            old.stop()
        with self._lock:
            self._health.clear(driver)
        stream.start()

    def _forget_health(self, driver: str) -> None:
        with self._lock:
            stream = self._health_streams.pop(driver, None)
            self._health.clear(driver)
        if stream is not None:
            stream.stop()

    def _claims_call(
        self, driver: str, method: str, claims: Iterable[Any], service: str | None
    ) -> dict[str, Any]:
        with self._lock:
            connection = self._plugins.get(driver)
        if connection is None:
            raise DraCallError(None, f"DRA driver {driver} is not registered")
        if service is not None and service != connection.plugin.service:
            # The kubelet only ever uses the chosen service; a test may ask for
            # another to check that the plugin serves it too.
            connection = _Connection(Plugin(driver, connection.plugin.endpoint, service, "", ()))
        pb = SERVICE_MESSAGES[connection.plugin.service]
        wanted = [Claim(c.namespace, c.uid, c.name) for c in claims]
        request_type = getattr(pb, f"{method}Request")
        response_type = getattr(pb, f"{method}Response")
        got: dict[str, Any] = {}
        pending = wanted
        kind = "prepare" if method == "NodePrepareResources" else "unprepare"
        for attempt in range(self.retries + 1):
            self._record(
                kind if attempt == 0 else "retry", driver, ",".join(c.uid for c in pending)
            )
            request = request_type(
                claims=[pb.Claim(namespace=c.namespace, uid=c.uid, name=c.name) for c in pending]
            )
            try:
                response = connection.call(method, request, response_type, self.call_timeout)
            except grpc.RpcError as error:
                raise DraCallError(error.code(), error.details() or "") from None
            for uid, reply in response.claims.items():
                got[uid] = reply
            pending = [c for c in pending if c.uid not in response.claims]
            if not pending:
                return got
        raise DraCallError(
            None,
            f"{method} left out claims {[c.uid for c in pending]} after {self.retries} retries",
        )

    # -- the plugin watcher ------------------------------------------------------------

    def _record(self, kind: str, driver: str, detail: str) -> None:
        with self._lock:
            self._events.append(DraEvent(time.monotonic(), kind, driver, detail))
            self._lock.notify_all()

    def _watch(self) -> None:
        while not self._stop.is_set():
            self._scan()
            self._stop.wait(self.poll_interval)

    def _scan(self) -> None:
        found: dict[Path, tuple[int, int]] = {}
        try:
            entries = list(os.scandir(self.registry_dir))
        except OSError:
            entries = []
        for entry in entries:
            if entry.name.startswith("."):
                continue
            try:
                info = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISSOCK(info.st_mode):
                found[Path(entry.path)] = (info.st_ino, info.st_mtime_ns)
        for path in list(self._seen):
            if found.get(path) != self._seen[path]:
                self._deregister(path)
        for path, identity in found.items():
            if path not in self._seen and not self._stop.is_set():
                self._seen[path] = identity
                self._record("discovered", str(path), "")
                self._register(path)

    def _deregister(self, path: Path) -> None:
        self._seen.pop(path, None)
        driver = self._by_socket.pop(path, None)
        if driver is None:
            return
        with self._lock:
            connection = self._plugins.get(driver)
            gone = connection is not None and connection.plugin.socket == str(path)
        if gone:
            self._forget_health(driver)
            with self._lock:
                if self._plugins.get(driver) is connection:
                    del self._plugins[driver]
                    connection.channel.close()
        self._record("deregistered", driver, str(path))

    def _register(self, path: Path) -> None:
        channel = grpc.insecure_channel(f"unix:{path}")
        try:
            try:
                grpc.channel_ready_future(channel).result(timeout=DIAL_TIMEOUT)
                info = channel.unary_unary(
                    GET_INFO,
                    request_serializer=lambda m: m.SerializeToString(),
                    response_deserializer=reg.PluginInfo.FromString,
                )(reg.InfoRequest(), timeout=GET_INFO_TIMEOUT)
            except (grpc.RpcError, grpc.FutureTimeoutError) as failure:
                self._record("register-failed", str(path), f"GetInfo: {failure!r}")
                return
            versions = tuple(info.supported_versions)
            endpoint = info.endpoint or str(path)
            self._record(
                "info",
                info.name,
                f"type={info.type} endpoint={endpoint} versions={list(versions)}",
            )
            problem = self._validate(info.type, info.name, endpoint, versions, path)
            if problem:
                self._notify(channel, info.name, False, problem)
                self._record("rejected", info.name, problem)
                return
            service = next(s for s in versions if s in self.supported_services)
            plugin = Plugin(info.name, endpoint, service, str(path), versions)
            self._forget_health(info.name)
            # Registering makes the connection, starts connecting it and starts
            # the health stream on it, all before the plugin is told (pm.add).
            connection = _Connection(plugin)
            with self._lock:
                old = self._plugins.get(info.name)
                if old is not None:
                    old.channel.close()
                self._plugins[info.name] = connection
                self._by_socket[path] = info.name
            self._watch_health(info.name, connection)
            if self._notify(channel, info.name, True, ""):
                self._record("registered", info.name, service)
        finally:
            channel.close()

    def _validate(
        self, kind: str, name: str, endpoint: str, versions: tuple[str, ...], path: Path
    ) -> str:
        if kind != DRA_PLUGIN_TYPE:
            return (
                f"RegisterPlugin error -- no handler registered for plugin type: {kind} "
                f"at socket {path}"
            )
        if not versions:
            reason = "empty list of supported gRPC services (aka supported versions)"
        elif not any(v in self.supported_services for v in versions):
            reason = (
                f"none of services supported by the plugin ({list(versions)}) are supported "
                f"by the kubelet ({list(self.supported_services)})"
            )
        else:
            return ""
        return (
            "RegisterPlugin error -- plugin validation failed with err: invalid supported "
            f"gRPC services of DRA driver plugin {name} at endpoint {endpoint}: {reason}"
        )

    def _notify(self, channel: grpc.Channel, name: str, registered: bool, error: str) -> bool:
        try:
            channel.unary_unary(
                NOTIFY,
                request_serializer=lambda m: m.SerializeToString(),
                response_deserializer=reg.RegistrationStatusResponse.FromString,
            )(
                reg.RegistrationStatus(plugin_registered=registered, error=error),
                timeout=NOTIFY_TIMEOUT,
            )
        except grpc.RpcError as failure:
            self._record("register-failed", name, f"NotifyRegistrationStatus: {failure}")
            return False
        return True
