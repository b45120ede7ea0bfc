"""Reading the kubelet's `kubelet_internal_checkpoint` (dp_server.deviceplugin.kubelet_checkpoint).

The documents are shaped as the kubelet writes them
(pkg/kubelet/cm/devicemanager/checkpoint/checkpoint.go and checkpointv1.go).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from dp_core import CheckpointEntry, KubeletCheckpoint
from dp_server.deviceplugin.kubelet_checkpoint import (
    CHECKPOINT_FILE,
    CheckpointFile,
    read_kubelet_checkpoint,
)

UID = "5d3c1f4e-9b2a-4f61-8c7e-2a1b3c4d5e6f"


def document(entries: object, **extra: object) -> bytes:
    return json.dumps(
        {"Data": {"PodDeviceEntries": entries, "RegisteredDevices": {}}, "Checksum": 1, **extra}
    ).encode()


def entry(**overrides: object) -> dict[str, object]:
    base: dict[str, object] = {
        "PodUID": UID,
        "ContainerName": "compute",
        "ResourceName": "devices.kubevirt.io/nvme",
        "DeviceIDs": {"0": ["0000:5e:00.0"], "-1": ["0000:5e:01.0"]},
        "AllocResp": "CgQKAkE=",
    }
    return {**base, **overrides}


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / CHECKPOINT_FILE


def test_entries_are_read_with_their_devices_from_every_numa_node(path: Path) -> None:
    path.write_bytes(document([entry()], BootID="0d7c9a1e"))  # a newer kubelet's extra field
    assert read_kubelet_checkpoint(path) == KubeletCheckpoint(
        (
            CheckpointEntry(
                UID, "compute", "devices.kubevirt.io/nvme", ("0000:5e:00.0", "0000:5e:01.0")
            ),
        )
    )


def test_a_device_on_two_numa_nodes_is_one_device(path: Path) -> None:
    path.write_bytes(document([entry(DeviceIDs={"0": ["a"], "1": ["a", "b"]})]))
    (found,) = read_kubelet_checkpoint(path).entries
    assert found.device_ids == ("a", "b")


def test_the_format_of_kubelets_before_1_20_is_read(path: Path) -> None:
    path.write_bytes(document([entry(DeviceIDs=["0000:5e:00.0"])]))
    (found,) = read_kubelet_checkpoint(path).entries
    assert found.device_ids == ("0000:5e:00.0",)


@pytest.mark.parametrize("entries", [None, []])
def test_no_entries_is_an_empty_checkpoint(path: Path, entries: object) -> None:
    path.write_bytes(document(entries))
    assert read_kubelet_checkpoint(path) == KubeletCheckpoint()


def test_no_file_is_an_empty_checkpoint(path: Path) -> None:
    """A kubelet writes the file at every device list: with none, it gave nothing out."""
    assert read_kubelet_checkpoint(path) == KubeletCheckpoint()


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (b'{"Data": ', "not JSON"),
        (b"\xff\xfe", "not JSON"),
        (b"[]", "not a device-manager checkpoint"),
        (b'{"Data": {"PodDeviceEntries": {}}}', "not a device-manager checkpoint"),
        (document([{"ContainerName": "c"}]), "PodDeviceEntries[0]"),
        (document([entry(DeviceIDs="0000:5e:00.0")]), "PodDeviceEntries[0].DeviceIDs"),
        (document([entry(), entry(ResourceName=7)]), "PodDeviceEntries[1].ResourceName"),
    ],
)
def test_a_checkpoint_that_cannot_be_read_says_where_and_why(
    path: Path, content: bytes, problem: str
) -> None:
    path.write_bytes(content)
    found = read_kubelet_checkpoint(path)
    assert found.entries == ()
    assert found.problem is not None
    assert found.problem.startswith(f"{path}: ") and problem in found.problem


def test_a_file_that_cannot_be_opened_says_so(path: Path) -> None:
    path.mkdir()
    found = read_kubelet_checkpoint(path)
    assert found.problem == f"{path}: cannot be read: Is a directory"


def test_a_rewrite_is_seen_as_a_change_and_a_look_alone_is_not(tmp_path: Path) -> None:
    checkpoint = CheckpointFile(tmp_path)
    assert checkpoint.changed() is False  # none, and none seen
    checkpoint.path.write_bytes(document([entry()]))
    assert checkpoint.changed()
    assert len(checkpoint.read().entries) == 1
    assert not checkpoint.changed()
    # The kubelet writes a new file and renames it over the old one.
    replacement = tmp_path / ".kubelet_internal_checkpoint.tmp"
    replacement.write_bytes(document(None))
    os.replace(replacement, checkpoint.path)
    assert checkpoint.changed()
    assert checkpoint.read() == KubeletCheckpoint()
