"""The DRA and plugin-registration RPCs as the kubelet spells them, and its messages' shapes.

Like the device-plugin emulator, no grpcio-generated stubs: protobuf's
runtime messages (`dp_testing.emulator.pb`) and method paths only. The
constants are the kubelet's (Kubernetes 1.34/1.35), read from
pkg/kubelet/pluginmanager/operationexecutor/operation_generator.go and
pkg/kubelet/cm/dra/plugin/.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any, NamedTuple

from dp_testing.emulator.pb.dra.v1 import api_pb2 as dra_v1
from dp_testing.emulator.pb.dra.v1beta1 import api_pb2 as dra_v1beta1
from dp_testing.emulator.pb.drahealth.v1 import api_pb2 as health_v1
from dp_testing.emulator.pb.drahealth.v1alpha1 import api_pb2 as health
from dp_testing.emulator.pb.pluginregistration.v1 import api_pb2 as reg

#: `registerapi.DRAPlugin`: the only plugin type this kubelet has a handler for.
DRA_PLUGIN_TYPE = "DRAPlugin"
#: What the kubelet supports, newest first (`servicesSupportedByKubelet`).
KUBELET_SERVICES = ("v1.DRAPlugin", "v1beta1.DRAPlugin")
#: The plugin watcher's dial (blocking), GetInfo and NotifyRegistrationStatus deadlines.
DIAL_TIMEOUT = 10.0
GET_INFO_TIMEOUT = 1.0
NOTIFY_TIMEOUT = 5.0
#: `defaultClientCallTimeout` for NodePrepareResources and NodeUnprepareResources.
CALL_TIMEOUT = 45.0

#: The health stream (ResourceHealthStatus, on by default from 1.36), and how
#: long after it ends it is asked for again (`wait.UntilWithContext(...,
#: 5*time.Second)` in dra_plugin_manager.go). A 1.36 kubelet asks every
#: registered plugin for v1alpha1, whatever it advertised. A 1.37 kubelet
#: (kubernetes/kubernetes#139477, `pickHealthService`) asks only a plugin that
#: advertised a health service, for v1 when it did, else for v1alpha1, which
#: it still reads from drivers older than v1 (1.37 to 1.39).
HEALTH_WATCH = "/v1alpha1.DRAResourceHealth/NodeWatchResources"
HEALTH_RETRY = 5.0
#: The health services a kubelet of each release can read, newest first.
HEALTH_SERVICES_BY_RELEASE: dict[str, tuple[str, ...]] = {
    "1.36": ("v1alpha1.DRAResourceHealth",),
    "1.37": ("v1.DRAResourceHealth", "v1alpha1.DRAResourceHealth"),
}
#: "<proto package>.DRAResourceHealth" -> its messages (the same in both).
HEALTH_MESSAGES: dict[str, ModuleType] = {
    "v1.DRAResourceHealth": health_v1,
    "v1alpha1.DRAResourceHealth": health,
}
#: How long a device's reported health holds when the plugin gives no
#: `health_check_timeout_seconds` (DefaultHealthTimeout, pkg/kubelet/cm/dra).
HEALTH_TIMEOUT = 30.0

GET_INFO = "/pluginregistration.Registration/GetInfo"
NOTIFY = "/pluginregistration.Registration/NotifyRegistrationStatus"

#: "<proto package's last element>.DRAPlugin" (what plugins advertise) -> messages.
SERVICE_MESSAGES: dict[str, ModuleType] = {
    "v1.DRAPlugin": dra_v1,
    "v1beta1.DRAPlugin": dra_v1beta1,
}


def pick_health_service(release: str, advertised: Sequence[str]) -> str:
    """The health service a kubelet of `release` opens on a plugin that
    advertised `advertised`, or "" when it opens none."""
    readable = HEALTH_SERVICES_BY_RELEASE[release]
    if release == "1.36":
        return readable[0]  # asked of every plugin, advertised or not
    return next((service for service in readable if service in advertised), "")


def health_watch_path(service: str) -> str:
    """`v1.DRAResourceHealth` -> its NodeWatchResources path."""
    return f"/{service}/NodeWatchResources"


def method_path(service: str, method: str) -> str:
    """`v1.DRAPlugin` + `NodePrepareResources` -> the full gRPC path."""
    module = SERVICE_MESSAGES[service]
    return f"/{module.DESCRIPTOR.package}.DRAPlugin/{method}"


class Claim(NamedTuple):
    """A claim as the kubelet names it in a request (any object with these fields will do)."""

    namespace: str
    uid: str
    name: str


@dataclass(frozen=True)
class Device:
    request_names: tuple[str, ...]
    pool_name: str
    device_name: str
    cdi_device_ids: tuple[str, ...]


@dataclass(frozen=True)
class PrepareResult:
    """One claim's entry in a NodePrepareResources reply."""

    devices: tuple[Device, ...]
    error: str


@dataclass(frozen=True)
class ResourceHealth:
    """One entry of a container's `allocatedResourcesStatus[].resources` for a
    claim: the device's first CDI ID (else driver/pool/device) and its health."""

    resource_id: str
    health: str  # "Healthy", "Unhealthy" or "Unknown"


@dataclass(frozen=True)
class Plugin:
    """A registered DRA plugin as the kubelet keeps it."""

    name: str
    endpoint: str
    service: str  # the chosen one, e.g. "v1.DRAPlugin"
    socket: str  # the registration socket it was found through
    versions: tuple[str, ...]


def device(message: Any) -> Device:
    return Device(
        tuple(message.request_names),
        message.pool_name,
        message.device_name,
        tuple(message.cdi_device_ids),
    )


__all__ = [
    "CALL_TIMEOUT",
    "DIAL_TIMEOUT",
    "DRA_PLUGIN_TYPE",
    "GET_INFO",
    "GET_INFO_TIMEOUT",
    "HEALTH_MESSAGES",
    "HEALTH_RETRY",
    "HEALTH_SERVICES_BY_RELEASE",
    "HEALTH_TIMEOUT",
    "HEALTH_WATCH",
    "KUBELET_SERVICES",
    "NOTIFY",
    "NOTIFY_TIMEOUT",
    "SERVICE_MESSAGES",
    "Claim",
    "Device",
    "Plugin",
    "PrepareResult",
    "ResourceHealth",
    "device",
    "health",
    "health_watch_path",
    "method_path",
    "pick_health_service",
    "reg",
]
