"""The DRA front end's two sockets as the kubelet expects them, and their state.

- `<plugins-registry-dir>/<driver>-reg.sock`: `pluginregistration.Registration`,
  which the kubelet's plugin watcher finds and calls;
- `<plugins-dir>/<driver>/dra.sock`: `DRAPlugin` v1 and v1beta1, the endpoint
  GetInfo names, and, given a health watcher, the kubelet's health stream in
  both versions (`v1.DRAResourceHealth` and `v1alpha1.DRAResourceHealth`,
  advertised after them as the Go helper does: a 1.37 kubelet opens the
  stream only on a plugin that advertises it, and v1 when it is there).

The DRA socket is listened on first, so it is there by the time the kubelet,
woken by the registration socket's creation, calls it. The kubelet makes the
plugins and plugin-registry directories at its start; dp makes only the
driver's own directory. Until the kubelet's are there, dp says what it waits
for, and looks again every second.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from pathlib import Path

from dp_server.dra.health import HEALTH_APIS, HEALTH_SERVICES, DraHealthService, HealthWatcher
from dp_server.dra.preparer import ClaimPreparer
from dp_server.dra.registration import RegistrationService, RegistrationStatus
from dp_server.dra.service import SUPPORTED_VERSIONS, DraPluginService
from dp_server.dra.sockets import MissingDirectory, ServedSocket
from dp_server.rpc import StrictCodec

__all__ = ["DRA_SOCKET", "DraEndpoints", "registration_socket_name"]

_log = logging.getLogger("dp")

DRA_SOCKET = "dra.sock"
_LOOK_AGAIN = 1.0  # seconds, while the kubelet's directories are missing
_SAY_AGAIN = 60.0  # seconds between two "waiting" logs


def registration_socket_name(driver: str) -> str:
    """The Go helper's name for it (kubeletplugin's RegistrarSocketFilename default)."""
    return f"{driver}-reg.sock"


class DraEndpoints:
    """Registration and DRA service sockets for `driver`, answering claims through
    `preparer` and, with `health`, the kubelet's health stream from it.

    `restore()` listens again on a socket whose file was deleted; the runtime
    calls it when it checks its sockets, or, with `check_interval`, this
    object does so itself every that many seconds.
    """

    def __init__(
        self,
        driver: str,
        registry_dir: Path,
        plugins_dir: Path,
        preparer: ClaimPreparer,
        *,
        check_interval: float | None = None,
        on_status: Callable[[RegistrationStatus], None] | None = None,
        health: HealthWatcher | None = None,
    ) -> None:
        if not driver or "/" in driver or driver.startswith(".") or driver in ("..",):
            # The kubelet's watcher ignores names starting with "."; "/" would
            # put the socket in another directory.
            raise ValueError(f"driver name {driver!r} cannot name a socket file")
        self.driver = driver
        self.dra_socket_path = Path(plugins_dir) / driver / DRA_SOCKET
        self.registration_socket_path = Path(registry_dir) / registration_socket_name(driver)
        self._on_status = on_status
        services: list[object] = [DraPluginService(preparer)]
        versions: tuple[str, ...] = SUPPORTED_VERSIONS
        if health is not None:
            services += [DraHealthService(health, version) for version in HEALTH_APIS]
            versions += HEALTH_SERVICES
        self._registration = RegistrationService(
            driver, str(self.dra_socket_path), versions, self._status_changed
        )
        self._dra = ServedSocket(self.dra_socket_path, services, StrictCodec(), own_directory=True)
        self._reg = ServedSocket(self.registration_socket_path, [self._registration], StrictCodec())
        self._check_interval = check_interval
        self._checker: asyncio.Task[None] | None = None
        # While the kubelet's directories are missing: what looks for them.
        self._waiter: asyncio.Task[None] | None = None

    @property
    def registration_status(self) -> RegistrationStatus | None:
        """What the kubelet last said since our registration socket was made (None: nothing)."""
        return self._registration.status

    @property
    def ready(self) -> bool:
        """Both sockets are ours and the kubelet said it registered us."""
        status = self._registration.status
        return (
            status is not None and status.registered and self._dra.listening and self._reg.listening
        )

    @property
    def waiting(self) -> bool:
        """Whether it waits for the kubelet's directories before it can listen."""
        return self._waiter is not None and not self._waiter.done()

    async def start(self) -> None:
        """Listen on both sockets; if the kubelet's directories are not there
        yet, say so and listen once they are. Raises OSError for anything else."""
        try:
            await self._listen()
        except MissingDirectory as missing:
            self._say_waiting(missing)
            self._waiter = asyncio.create_task(self._wait_for_kubelet())
            return
        self._check_from_now_on()

    async def _listen(self) -> None:
        await self._dra.start()
        try:
            await self._reg.start()
        except BaseException:
            await self._dra.close()
            raise
        _log.info(
            "dra-listening",
            extra={
                "dp_fields": {
                    "driver": self.driver,
                    "registration": str(self.registration_socket_path),
                    "endpoint": str(self.dra_socket_path),
                }
            },
        )

    def _say_waiting(self, missing: MissingDirectory) -> None:
        _log.warning(
            "dra-waiting-for-kubelet",
            extra={
                "dp_fields": {
                    "registration": str(self.registration_socket_path),
                    "endpoint": str(self.dra_socket_path),
                    "reason": missing.strerror,
                }
            },
        )

    async def _wait_for_kubelet(self) -> None:
        loop = asyncio.get_running_loop()
        said = loop.time()
        while True:
            await asyncio.sleep(_LOOK_AGAIN)
            try:
                await self._listen()
            except MissingDirectory as missing:
                if loop.time() - said >= _SAY_AGAIN:
                    said = loop.time()
                    self._say_waiting(missing)
            except Exception:  # noqa: BLE001 - logged; the next look tries again
                _log.exception("dra-socket-check-failed")
            else:
                self._check_from_now_on()
                return

    def _check_from_now_on(self) -> None:
        if self._check_interval is not None:
            self._checker = asyncio.create_task(self._check_forever(self._check_interval))

    async def restore(self) -> None:
        """Listen again on whichever socket's file was deleted or replaced."""
        if self.waiting:
            return  # it listens once the kubelet's directories are there
        await self._dra.restore()
        if await self._reg.restore():
            # The kubelet dropped the old registration with its file; the new
            # socket is registered only once it says so again.
            self._registration.status = None

    async def close(self, timeout: float = 5.0) -> None:
        """Stop listening and remove our socket files (the registration one first)."""
        if self._waiter is not None:
            self._waiter.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._waiter
            self._waiter = None
        if self._checker is not None:
            self._checker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._checker
            self._checker = None
        await self._reg.close(timeout)
        await self._dra.close(timeout)

    async def _check_forever(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                await self.restore()
            except Exception:  # a failed check must not end the checking
                _log.exception("dra-socket-check-failed")

    def _status_changed(self, status: RegistrationStatus) -> None:
        if self._on_status is not None:
            self._on_status(status)
