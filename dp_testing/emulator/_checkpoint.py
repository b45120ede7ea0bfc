"""The kubelet's device-manager checkpoint, as the emulator keeps it.

The kubelet writes `kubelet_internal_checkpoint` in its device-plugin
directory (pkg/kubelet/cm/devicemanager/manager.go, `writeCheckpoint`) at
every device list a plugin sends and after every allocation, whole, through a
temporary file renamed over the old one (pkg/kubelet/util/store/filestore.go);
it reads it back when it starts, before it serves kubelet.sock, and a
restart's clean-up of the directory leaves it. The JSON is Go's encoding of
pkg/kubelet/cm/devicemanager/checkpoint/checkpoint.go's `Data`: field names
as in Go, `DeviceIDs` by NUMA node (-1 for a device without one) with the
node as a string key, `AllocResp` base64, no entries as `null`. Its
`Checksum` is the kubelet's hash of Go's printing of the data, which cannot be
reproduced here; a CRC of the JSON stands in for it.

Written here, not shared with dp_server's reader: the emulator is the
independent peer dp is checked against.
"""

from __future__ import annotations

import base64
import json
import os
import tempfile
import threading
import zlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from dp_testing.emulator._rpc import HEALTHY
from dp_testing.emulator._state import DeviceState

__all__ = ["Checkpoint", "PodDevicesEntry"]

_NO_NUMA = -1


@dataclass(frozen=True)
class PodDevicesEntry:
    """The devices of one resource the kubelet gave one container of one pod."""

    pod_uid: str
    container: str
    resource: str
    devices: tuple[DeviceState, ...]
    alloc_resp: bytes = b""

    def to_json(self) -> dict[str, object]:
        per_node: dict[str, list[str]] = {}
        for device in self.devices:
            for node in device.numa_nodes or (_NO_NUMA,):
                per_node.setdefault(str(node), []).append(device.id)
        return {
            "PodUID": self.pod_uid,
            "ContainerName": self.container,
            "ResourceName": self.resource,
            "DeviceIDs": per_node,
            "AllocResp": base64.b64encode(self.alloc_resp).decode(),
        }

    @classmethod
    def from_json(cls, raw: Mapping[str, object]) -> PodDevicesEntry:
        nodes: dict[str, tuple[int, ...]] = {}
        per_node = raw["DeviceIDs"]
        assert isinstance(per_node, dict)
        for node, ids in per_node.items():
            for device_id in ids:
                found = () if int(node) == _NO_NUMA else (int(node),)
                nodes[device_id] = nodes.get(device_id, ()) + found
        return cls(
            str(raw["PodUID"]),
            str(raw["ContainerName"]),
            str(raw["ResourceName"]),
            tuple(DeviceState(i, HEALTHY, numa) for i, numa in nodes.items()),
            base64.b64decode(str(raw.get("AllocResp") or "")),
        )


def encode(entries: Iterable[PodDevicesEntry], registered: Mapping[str, list[str]]) -> bytes:
    data = {
        "PodDeviceEntries": [entry.to_json() for entry in entries] or None,
        "RegisteredDevices": dict(registered),
    }
    checksum = zlib.crc32(json.dumps(data, separators=(",", ":")).encode())
    return json.dumps({"Data": data, "Checksum": checksum}, separators=(",", ":")).encode()


class Checkpoint:
    """The file, written from `snapshot` (entries, healthy devices by resource).

    `write` writes at once (an admission: the kubelet writes before it starts
    the container); `soon` has a writer thread write it (a device list: the
    kubelet writes in the goroutine that reads that plugin's stream, beside
    the others). Lists that arrive while it writes are written once after:
    each write is of the state as it is then, so the file ends as the kubelet
    would leave it, without the emulator's threads queueing behind 64 writes
    when 64 resources register at once.
    """

    def __init__(
        self,
        path: Path,
        snapshot: Callable[[], tuple[list[PodDevicesEntry], dict[str, list[str]]]],
    ) -> None:
        self.path = path
        self._snapshot = snapshot
        # One write at a time, each of the state as it is then: the file never
        # goes back to an older state than one already written.
        self._lock = threading.Lock()
        self.writes = 0
        self._due = threading.Event()
        self._writer: threading.Thread | None = None
        self._writer_lock = threading.Lock()
        self._closed = False

    def soon(self) -> None:
        with self._writer_lock:
            if self._closed:
                return
            if self._writer is None:
                self._writer = threading.Thread(
                    target=self._write_when_due, name="kubelet-checkpoint", daemon=True
                )
                self._writer.start()
        self._due.set()

    def _write_when_due(self) -> None:
        while True:
            self._due.wait()
            self._due.clear()
            if self._closed:
                return
            try:
                self.write()
            except OSError:
                pass  # the directory went away (a test removed it); the next list writes

    def close(self) -> None:
        """No more writes from lists (the kubelet stopped); waits for one under way."""
        with self._writer_lock:
            self._closed = True
            writer = self._writer
        self._due.set()
        if writer is not None:
            writer.join(5.0)

    def write(self) -> None:
        with self._lock:
            data = encode(*self._snapshot())
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, temporary = tempfile.mkstemp(prefix=f".{self.path.name}", dir=self.path.parent)
            try:
                with os.fdopen(fd, "wb") as out:
                    out.write(data)
                    out.flush()
                    os.fsync(out.fileno())
                os.replace(temporary, self.path)
            except BaseException:
                Path(temporary).unlink(missing_ok=True)
                raise
            self.writes += 1

    def read(self) -> list[PodDevicesEntry]:
        """What the file holds; nothing when there is none (a kubelet that
        cannot read it starts with nothing, as the kubelet does)."""
        try:
            document = json.loads(self.path.read_bytes())
            entries = document["Data"]["PodDeviceEntries"] or []
            return [PodDevicesEntry.from_json(raw) for raw in entries]
        except (OSError, ValueError, KeyError, TypeError, AssertionError):
            return []
