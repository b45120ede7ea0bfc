"""What `dp-server serve` runs with, and the limits its flags must respect."""

from __future__ import annotations

import os

import attrs

from dp_core import SocketMode, Timing, min_endpoint_length
from dp_server.files.sockets import SOCKET_PATH_MAX

__all__ = ["SOCKET_NAME_MAX", "SOCKET_PATH_MAX", "Settings", "SettingsError", "socket_name_room"]

# The kubelet dials <its device-plugin dir>/<endpoint>, which must fit in a
# unix socket address (SOCKET_PATH_MAX) as well as ours does. Its directory on
# the host may be longer than ours in the container
# (MicroK8s: /var/snap/microk8s/common/var/lib/kubelet/device-plugins, 52
# bytes): names are kept to 48 bytes, which leaves 58 for the kubelet's.
SOCKET_NAME_MAX = 48


@attrs.frozen
class Settings:
    sysfs: str = "/sys"
    dev: str = "/dev"
    device_plugin_dir: str = "/var/lib/kubelet/device-plugins"
    pod_resources_socket: str = "/var/lib/kubelet/pod-resources/kubelet.sock"
    socket_mode: SocketMode = SocketMode.SINGLE
    rescan_interval: float = 30.0
    # While it holds any IOMMU group for an allocation, dp asks PodResources
    # this often: a deleted pod's group siblings come back this long at most
    # after the kubelet stops listing the pod (docs/operations.md).
    pod_resources_interval: float = 2.0
    register_timeout: float = 15.0
    # The kubelet's own limit is 100 QPS (burst 10). dp asks every 2 s while
    # it holds reservations, and every 0.2 s while a kubelet that has just
    # started syncs its pods (Timing.sync_poll): the gap only spaces out
    # asks made for several reasons at once.
    pod_resources_min_gap: float = 0.1
    endpoint_prefix: str | None = None
    timing: Timing = Timing()
    config_path: str | None = None  # reloaded when it changes (see FileVersion)
    metrics_address: tuple[str | None, int] | None = None  # host None: every address
    # Where what dp moved to vfio-pci is kept across restarts (moves_file); None: nowhere.
    state_dir: str | None = None
    # Where dp keeps a CDI spec per resource (dp_server.cdi); None: no CDI.
    cdi_spec_dir: str | None = None
    # The DRA front end (config `dra`): this node's name (its pool's), the
    # kubelet's plugin watcher directory and the plugins' data directory.
    node_name: str | None = None
    plugins_registry_dir: str = "/var/lib/kubelet/plugins_registry"
    plugins_dir: str = "/var/lib/kubelet/plugins"
    # The API server: a kubeconfig file, or with neither, the pod's service
    # account; `kube_api_server` is a URL without credentials (tests, a local proxy).
    kubeconfig: str | None = None
    kube_api_server: str | None = None
    # Bounds of each ResourceSlice watch request, in seconds.
    slice_watch_period: tuple[float, float] = (300.0, 600.0)


class SettingsError(ValueError):
    """Settings the server cannot run with; the message names the setting."""


def socket_name_room(directory: str, prefix: str) -> int:
    """How long a socket file name in `directory` may be."""
    room = min(SOCKET_NAME_MAX, SOCKET_PATH_MAX - len(os.fsencode(directory.rstrip("/"))) - 1)
    if room < min_endpoint_length(prefix):
        longest = SOCKET_PATH_MAX - 1 - min_endpoint_length(prefix)
        raise SettingsError(
            f"--device-plugin-dir {directory!r} is too long: a unix socket path is at most "
            f"{SOCKET_PATH_MAX} bytes, which leaves at most {longest} bytes for the directory"
        )
    return room
