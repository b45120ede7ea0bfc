"""The kubelet plugin watcher's `pluginregistration.Registration`, for a DRA driver.

The kubelet finds our socket in its plugins_registry directory, asks GetInfo
what we are and where the DRA service listens, checks the versions, and tells
us the result through NotifyRegistrationStatus. That result is what readiness
reports: until the kubelet has said "registered", no claim can reach us.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import grpclib.const
import grpclib.server
from grpclib.const import Cardinality

from dp_server.proto import pluginregistration as pb

__all__ = ["PLUGIN_TYPE", "RegistrationService", "RegistrationStatus"]

_log = logging.getLogger("dp")

#: `registerapi.DRAPlugin` in k8s.io/kubelet/pkg/apis/pluginregistration/v1/constants.go.
PLUGIN_TYPE = "DRAPlugin"
_PREFIX = "/pluginregistration.Registration/"


@attrs.frozen
class RegistrationStatus:
    """What the kubelet last said of our registration; `error` is empty when registered."""

    registered: bool
    error: str


class RegistrationService:
    """GetInfo and NotifyRegistrationStatus for one driver."""

    def __init__(
        self,
        driver: str,
        endpoint: str,
        versions: Sequence[str],
        on_status: Callable[[RegistrationStatus], None] | None = None,
    ) -> None:
        self._info = pb.PluginInfo(
            type=PLUGIN_TYPE, name=driver, endpoint=endpoint, supported_versions=list(versions)
        )
        self._driver = driver
        self._on_status = on_status
        self.status: RegistrationStatus | None = None
        self.info_calls = 0

    async def get_info(self, stream: grpclib.server.Stream[Any, Any]) -> None:
        await stream.recv_message()
        self.info_calls += 1
        await stream.send_message(self._info)

    async def notify_registration_status(self, stream: grpclib.server.Stream[Any, Any]) -> None:
        message = await stream.recv_message()
        status = RegistrationStatus(
            bool(message and message.plugin_registered), message.error if message else ""
        )
        self.status = status
        fields = {"driver": self._driver, "registered": status.registered}
        if status.registered:
            _log.info("dra-registered", extra={"dp_fields": fields})
        else:
            fields["error"] = status.error
            _log.error("dra-registration-failed", extra={"dp_fields": fields})
        if self._on_status is not None:
            self._on_status(status)
        await stream.send_message(pb.RegistrationStatusResponse())

    def __mapping__(self) -> dict[str, grpclib.const.Handler]:
        unary = Cardinality.UNARY_UNARY
        return {
            _PREFIX + "GetInfo": grpclib.const.Handler(
                self.get_info, unary, pb.InfoRequest, pb.PluginInfo
            ),
            _PREFIX + "NotifyRegistrationStatus": grpclib.const.Handler(
                self.notify_registration_status,
                unary,
                pb.RegistrationStatus,
                pb.RegistrationStatusResponse,
            ),
        }
