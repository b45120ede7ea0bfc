"""The DRA front end in the server. The kubelet's side: plugin registration,
NodePrepare/UnprepareResources and the health stream; the API's side: claims
read, ResourceSlices published, Events; and their wiring onto the loop
(`runtime.DraRuntime`, imported only with the config's `dra`), with the
prepared claims' checkpoint."""

from dp_server.dra.endpoints import DRA_SOCKET, DraEndpoints, registration_socket_name
from dp_server.dra.health import HEALTH_SERVICES, HealthReport, HealthWatcher, health_message
from dp_server.dra.preparer import ClaimPreparer, PrepareOutcome, refused
from dp_server.dra.registration import PLUGIN_TYPE, RegistrationStatus
from dp_server.dra.service import SUPPORTED_VERSIONS
from dp_server.dra.sockets import ForeignSocket

__all__ = [
    "DRA_SOCKET",
    "HEALTH_SERVICES",
    "PLUGIN_TYPE",
    "SUPPORTED_VERSIONS",
    "ClaimPreparer",
    "DraEndpoints",
    "ForeignSocket",
    "HealthReport",
    "HealthWatcher",
    "PrepareOutcome",
    "refused",
    "RegistrationStatus",
    "health_message",
    "registration_socket_name",
]
