"""Wire-level constants shared by the emulator's clients and servers.

Everything here is spelled the way the kubelet spells it, so the emulator needs
no grpcio-generated stubs: only the protobuf message classes and method paths.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dp_testing.emulator.pb.deviceplugin.v1beta1 import api_pb2 as dp
from dp_testing.emulator.pb.podresources.v1 import api_pb2 as pr

API_VERSION = "v1beta1"
HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"
KUBELET_SOCKET = "kubelet.sock"
CHECKPOINT_FILE = "kubelet_internal_checkpoint"

#: The kubelet dials each plugin for at most 10 s (grpc.WithBlock + context timeout).
DIAL_TIMEOUT = 10.0
#: PreStartContainer is the only plugin call the kubelet gives a deadline.
PRE_START_TIMEOUT = 30.0
#: grpc-go's default receive limit, which the kubelet does not raise.
MAX_RECEIVE_MESSAGE_LENGTH = 4 * 1024 * 1024
#: Linux `sockaddr_un.sun_path` is 108 bytes including the terminating NUL.
MAX_UNIX_PATH = 107

REGISTER = "/v1beta1.Registration/Register"
DEVICE_PLUGIN_SERVICE = "v1beta1.DevicePlugin"
POD_RESOURCES_SERVICE = "v1.PodResourcesLister"

# Messages the kubelet returns (fmt.Errorf, so gRPC status UNKNOWN).
ERR_UNSUPPORTED_VERSION = (
    'requested API version "{version}" is not supported by kubelet. '
    'Supported versions are ["v1beta1"]'
)
ERR_INVALID_RESOURCE_NAME = 'the ResourceName "{name}" is invalid'
ERR_FAILED_TO_DIAL = "failed to dial device plugin: {reason}"

#: Channel options that make a grpcio channel behave like the kubelet's grpc-go
#: client: a connection of its own per channel (grpcio otherwise shares one
#: subchannel, hence one connection, between channels to the same target) and
#: `:authority` forced to "localhost" (grpc.WithAuthority("localhost")).
PLUGIN_CHANNEL_OPTIONS: tuple[tuple[str, Any], ...] = (
    ("grpc.use_local_subchannel_pool", 1),
    ("grpc.default_authority", "localhost"),
    ("grpc.max_receive_message_length", MAX_RECEIVE_MESSAGE_LENGTH),
)


@dataclass(frozen=True)
class Method:
    """One RPC: its path, message types and whether the reply is a stream."""

    path: str
    request: type[Any]
    response: type[Any]
    server_streaming: bool = False

    @property
    def serialize(self) -> Callable[[Any], bytes]:
        return self.request.SerializeToString  # type: ignore[no-any-return]

    @property
    def deserialize(self) -> Callable[[bytes], Any]:
        return self.response.FromString  # type: ignore[no-any-return]


DEVICE_PLUGIN_METHODS: dict[str, Method] = {
    "GetDevicePluginOptions": Method(
        f"/{DEVICE_PLUGIN_SERVICE}/GetDevicePluginOptions", dp.Empty, dp.DevicePluginOptions
    ),
    "ListAndWatch": Method(
        f"/{DEVICE_PLUGIN_SERVICE}/ListAndWatch",
        dp.Empty,
        dp.ListAndWatchResponse,
        server_streaming=True,
    ),
    "GetPreferredAllocation": Method(
        f"/{DEVICE_PLUGIN_SERVICE}/GetPreferredAllocation",
        dp.PreferredAllocationRequest,
        dp.PreferredAllocationResponse,
    ),
    "Allocate": Method(
        f"/{DEVICE_PLUGIN_SERVICE}/Allocate", dp.AllocateRequest, dp.AllocateResponse
    ),
    "PreStartContainer": Method(
        f"/{DEVICE_PLUGIN_SERVICE}/PreStartContainer",
        dp.PreStartContainerRequest,
        dp.PreStartContainerResponse,
    ),
}

_DNS1123_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS1123_SUBDOMAIN = re.compile(rf"{_DNS1123_LABEL}(\.{_DNS1123_LABEL})*")
_QUALIFIED_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")


def is_extended_resource_name(name: str) -> bool:
    """The kubelet's `v1helper.IsExtendedResourceName`, transcribed.

    Written here rather than imported from `dp_core.config.names` on purpose: the
    emulator is the independent peer the server is checked against, so it must
    not share the server's idea of what a valid name is.
    """
    # IsNativeResource: no domain, or anywhere under kubernetes.io/.
    if "/" not in name or "kubernetes.io/" in name or name.startswith("requests."):
        return False
    # validation.IsQualifiedName("requests." + name), the quota resource name.
    parts = ("requests." + name).split("/")
    if len(parts) != 2:
        return False
    prefix, short = parts
    if not prefix or len(prefix) > 253 or not _DNS1123_SUBDOMAIN.fullmatch(prefix):
        return False
    return 0 < len(short) <= 63 and _QUALIFIED_NAME.fullmatch(short) is not None


__all__ = [
    "API_VERSION",
    "CHECKPOINT_FILE",
    "DEVICE_PLUGIN_METHODS",
    "DIAL_TIMEOUT",
    "HEALTHY",
    "KUBELET_SOCKET",
    "PLUGIN_CHANNEL_OPTIONS",
    "PRE_START_TIMEOUT",
    "UNHEALTHY",
    "Method",
    "dp",
    "is_extended_resource_name",
    "pr",
]
