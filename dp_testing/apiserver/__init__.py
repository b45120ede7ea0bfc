"""An emulated Kubernetes API server for the DRA front end's tests and benchmarks."""

from dp_testing.apiserver.rules import Validator
from dp_testing.apiserver.scheduler import Device, Scheduler
from dp_testing.apiserver.server import ApiServerEmulator
from dp_testing.apiserver.store import ApiFailure, Store

__all__ = ["ApiFailure", "ApiServerEmulator", "Device", "Scheduler", "Store", "Validator"]
