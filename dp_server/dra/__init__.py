"""The DRA front end's kubelet side: plugin registration, NodePrepare/UnprepareResources
and the health stream."""

from dp_server.dra.endpoints import DRA_SOCKET, DraEndpoints, registration_socket_name
from dp_server.dra.health import HEALTH_SERVICE, HealthWatcher, health_message
from dp_server.dra.preparer import ClaimPreparer, Prepared, PrepareFailed, PrepareOutcome
from dp_server.dra.registration import PLUGIN_TYPE, RegistrationStatus
from dp_server.dra.service import SUPPORTED_VERSIONS
from dp_server.dra.sockets import ForeignSocket

__all__ = [
    "DRA_SOCKET",
    "HEALTH_SERVICE",
    "PLUGIN_TYPE",
    "SUPPORTED_VERSIONS",
    "ClaimPreparer",
    "DraEndpoints",
    "ForeignSocket",
    "HealthWatcher",
    "PrepareFailed",
    "PrepareOutcome",
    "Prepared",
    "RegistrationStatus",
    "health_message",
    "registration_socket_name",
]
