"""Reading the kubelet's device-manager checkpoint, `kubelet_internal_checkpoint`.

The kubelet keeps it in its device-plugin directory (the directory of
kubelet.sock, pkg/kubelet/cm/devicemanager/manager.go), writing it whole
to a temporary file it renames over the old one. Its shape
(pkg/kubelet/cm/devicemanager/checkpoint/checkpoint.go):

    {"Data": {"PodDeviceEntries": [{"PodUID": ..., "ContainerName": ...,
              "ResourceName": ..., "DeviceIDs": {"<NUMA node>": [IDs]},
              "AllocResp": <base64>}], "RegisteredDevices": {...}},
     "Checksum": N}

Kubelets before 1.20 wrote `DeviceIDs` as a plain list (checkpointv1.go);
both are read. Only what the core needs is kept: which devices of which
resource the kubelet gave which pod. The checksum is the kubelet's own (a
hash of Go's printing of the data) and is not checked: a file dp cannot
parse is unreadable, and one it can is what the kubelet last wrote.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import cattrs
import cattrs.v
from cattrs.gen import make_dict_structure_fn, override

from dp_core import CheckpointEntry, KubeletCheckpoint
from dp_server.files import register_strict_scalars

__all__ = ["CHECKPOINT_FILE", "CheckpointFile", "read_kubelet_checkpoint"]

CHECKPOINT_FILE = "kubelet_internal_checkpoint"

_converter = cattrs.Converter(detailed_validation=True)  # other fields (AllocResp) are ignored
register_strict_scalars(_converter)


class _NotDeviceIds(ValueError):
    pass


def _device_ids(value: Any, _: Any) -> tuple[str, ...]:
    if isinstance(value, dict):  # per NUMA node
        lists = list(value.values())
    elif isinstance(value, list):  # kubelets before 1.20
        lists = [value]
    else:
        raise _NotDeviceIds(f"expected device IDs by NUMA node, got {value!r}")
    found: list[str] = []
    for ids in lists:
        if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
            raise _NotDeviceIds(f"expected a list of device IDs, got {ids!r}")
        found += [i for i in ids if i not in found]  # a device on two NUMA nodes is listed twice
    return tuple(found)


_GO_NAMES = {
    "pod_uid": "PodUID",
    "container": "ContainerName",
    "resource": "ResourceName",
    "device_ids": "DeviceIDs",
}
_converter.register_structure_hook(
    CheckpointEntry,
    make_dict_structure_fn(
        CheckpointEntry,
        _converter,
        pod_uid=override(rename=_GO_NAMES["pod_uid"]),
        container=override(rename=_GO_NAMES["container"]),
        resource=override(rename=_GO_NAMES["resource"]),
        device_ids=override(rename=_GO_NAMES["device_ids"], struct_hook=_device_ids),
    ),
)


def _describe(error: BaseException, type_: type | None) -> str:
    if isinstance(error, _NotDeviceIds):
        return str(error)
    return cattrs.v.format_exception(error, type_)


def _problems(error: cattrs.BaseValidationError | cattrs.ClassValidationError) -> str:
    lines = cattrs.transform_error(error, path="PodDeviceEntries", format_exception=_describe)
    for name, go in _GO_NAMES.items():  # the file's names, not the core's
        lines = [line.replace(f"].{name}", f"].{go}") for line in lines]
    return "; ".join(lines)


def read_kubelet_checkpoint(path: Path) -> KubeletCheckpoint:
    """The checkpoint at `path`: empty when there is none, or why it cannot be read."""
    try:
        text = path.read_bytes()
    except FileNotFoundError:
        return KubeletCheckpoint()
    except OSError as error:
        return KubeletCheckpoint(problem=f"{path}: cannot be read: {error.strerror or error}")
    try:
        document: Any = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        return KubeletCheckpoint(problem=f"{path}: not JSON: {error}")
    data = document.get("Data") if isinstance(document, dict) else None
    entries = data.get("PodDeviceEntries", ()) if isinstance(data, dict) else None
    if entries is None and isinstance(data, dict):
        entries = ()  # Go writes an empty slice as null
    if not isinstance(entries, list | tuple):
        return KubeletCheckpoint(
            problem=f"{path}: not a device-manager checkpoint (no Data.PodDeviceEntries list)"
        )
    try:
        found = _converter.structure(entries, tuple[CheckpointEntry, ...])
    except (cattrs.BaseValidationError, cattrs.ClassValidationError) as error:
        return KubeletCheckpoint(problem=f"{path}: {_problems(error)}")
    return KubeletCheckpoint(found)


class CheckpointFile:
    """The checkpoint in a device-plugin directory, and whether it changed
    since it was last read (by inode, size and modification time)."""

    def __init__(self, plugin_dir: Path) -> None:
        self.path = plugin_dir / CHECKPOINT_FILE
        self._seen: tuple[int, int, int] | None = None

    def _identity(self) -> tuple[int, int, int] | None:
        try:
            status = os.stat(self.path)
        except OSError:
            return None
        return (status.st_ino, status.st_size, status.st_mtime_ns)

    def changed(self) -> bool:
        return self._identity() != self._seen

    def read(self) -> KubeletCheckpoint:
        self._seen = self._identity()
        return read_kubelet_checkpoint(self.path)
