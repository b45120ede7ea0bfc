"""dp_server.cdi: spec files as the CDI schema and an independent reader take them,
and a spec directory kept in step without touching anything that is not dp's."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from cdi_reader import DeviceNode, read_dir, read_spec, resolve
from cdi_schema import schema_errors

from dp_core import CdiDevice, CdiSpec, DeviceSpec, cdi_kind, spec_name
from dp_server.cdi import SpecDirectory, render, spec_document

VFIO = DeviceSpec("/dev/vfio/vfio", "/dev/vfio/vfio", "mrw")


def _spec(resource: str, *devices: CdiDevice) -> CdiSpec:
    kind = cdi_kind(resource)
    return CdiSpec(spec_name(kind), kind, devices)


def _gpu(address: str, group: int) -> CdiDevice:
    return CdiDevice(address, (VFIO, DeviceSpec(f"/dev/vfio/{group}", f"/dev/vfio/{group}", "mrw")))


GPUS = _spec("nvidia.com/TU104GL_Tesla_T4", _gpu("0000:3b:00.0", 59), _gpu("0000:af:00.0", 60))
KVM = _spec(
    "devices.kubevirt.io/kvm",
    *(CdiDevice(f"kvm-{i}", (DeviceSpec("/dev/kvm", "/dev/kvm", "rw"),)) for i in range(3)),
)
# What a DRA front end may write: env, a different host path, a class with a dot.
OTHER = _spec(
    "example.com/a.b",
    CdiDevice("x", (DeviceSpec("/dev/x", "/dev/host-x", "rw"),), env=("A=1", "B=two=2")),
)


@pytest.mark.parametrize("spec", [GPUS, KVM, OTHER], ids=lambda s: s.kind)
def test_a_written_spec_passes_the_schema_and_the_independent_reader(spec: CdiSpec) -> None:
    document = json.loads(render(spec))
    assert document == spec_document(spec)
    assert schema_errors(document) == []
    read = read_spec(render(spec))
    assert (read.kind, read.version) == (spec.kind, spec.cdi_version)
    for device in spec.devices:
        edits = resolve([read], spec.qualified_name(device.name))
        assert edits.device_nodes == tuple(
            DeviceNode(node.container_path, node.host_path, node.permissions)
            for node in device.device_nodes
        )
        assert edits.env == device.env


def test_the_independent_reader_refuses_what_the_spec_refuses() -> None:
    good = json.loads(render(GPUS))
    cases = {
        "unknown fields": {**good, "extra": 1},
        "non-empty list": {**good, "devices": []},
        "is required": {k: v for k, v in good.items() if k != "kind"},
        "not a released": {**good, "cdiVersion": "0.9.0"},
        "too low": {**good, "cdiVersion": "0.4.0"},  # names start with a digit
        "empty containerEdits": {**good, "devices": [{"name": "a", "containerEdits": {}}]},
        "listed twice": {**good, "devices": good["devices"][:1] * 2},
        "class": {**good, "kind": "nvidia.com/-gpu"},
        "DNS subdomain": {**good, "kind": "Nvidia_com/gpu"},
    }
    for message, document in cases.items():
        with pytest.raises(ValueError, match=message):
            read_spec(json.dumps(document))
    with pytest.raises(ValueError, match="unresolvable"):
        resolve([read_spec(render(GPUS))], GPUS.qualified_name("0000:00:00.0"))


def _files(directory: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(directory.iterdir()) if path.is_file()}


def test_sync_writes_one_file_per_spec_and_only_what_changed(tmp_path: Path) -> None:
    directory = SpecDirectory(tmp_path)
    result = directory.sync([GPUS, KVM])
    assert result.problem == ""
    assert set(result.in_place) == {GPUS, KVM}
    assert sorted(_files(tmp_path)) == [
        "dp-devices.kubevirt.io_kvm.json",
        "dp-nvidia.com_TU104GL_Tesla_T4.json",
    ]
    assert {spec.kind for spec in read_dir(tmp_path)} == {GPUS.kind, KVM.kind}
    for path in tmp_path.iterdir():
        assert schema_errors(json.loads(path.read_bytes())) == []
        assert path.stat().st_mode & 0o777 == 0o644
    inodes = {path.name: path.stat().st_ino for path in tmp_path.iterdir()}
    # The same content again: nothing is rewritten (a write replaces the inode).
    assert set(directory.sync([GPUS, KVM]).in_place) == {GPUS, KVM}
    assert {path.name: path.stat().st_ino for path in tmp_path.iterdir()} == inodes
    # One spec changed: only its file is replaced, and no temporary file is left.
    fewer = CdiSpec(GPUS.name, GPUS.kind, GPUS.devices[:1])
    assert directory.sync([fewer, KVM]).problem == ""
    after = {path.name: path.stat().st_ino for path in tmp_path.iterdir()}
    assert after.keys() == inodes.keys()
    assert after[KVM.name + ".json"] == inodes[KVM.name + ".json"]
    assert after[GPUS.name + ".json"] != inodes[GPUS.name + ".json"]
    assert [d for d in read_spec(_files(tmp_path)[GPUS.name + ".json"]).devices] == ["0000:3b:00.0"]


def test_sync_removes_only_dp_files_no_spec_names(tmp_path: Path) -> None:
    foreign = {
        "nvidia.yaml": b"cdiVersion: 0.5.0\n",
        "vendor.json": b'{"cdiVersion": "0.3.0"}',
        "dp.json": b"{}",  # not dp-*: not dp's
        ".hidden.tmp": b"x",
    }
    for name, data in foreign.items():
        (tmp_path / name).write_bytes(data)
    (tmp_path / "dp-sub.json.d").mkdir()
    # Left by an earlier run: a spec of a resource gone since, and a write cut short.
    (tmp_path / "dp-example.com_gone.json").write_bytes(render(OTHER))
    (tmp_path / ".dp-example.com_gone.json.abc123.tmp").write_bytes(b"{")
    stats = {name: (tmp_path / name).stat() for name in foreign}
    directory = SpecDirectory(tmp_path)
    assert directory.sync([GPUS]).problem == ""
    assert sorted(os.listdir(tmp_path)) == sorted(
        [*foreign, "dp-sub.json.d", "dp-nvidia.com_TU104GL_Tesla_T4.json"]
    )
    for name, data in foreign.items():
        assert (tmp_path / name).read_bytes() == data
        assert (tmp_path / name).stat().st_mtime_ns == stats[name].st_mtime_ns
    # The resource goes: its file goes, the rest stays.
    assert directory.sync([]).problem == ""
    assert sorted(os.listdir(tmp_path)) == sorted([*foreign, "dp-sub.json.d"])


def test_a_missing_directory_is_reported_and_written_once_it_exists(tmp_path: Path) -> None:
    missing = tmp_path / "cdi"
    directory = SpecDirectory(missing)
    result = directory.sync([GPUS])
    assert result.in_place == ()
    assert result.problem == f"cannot list {missing}: No such file or directory"
    missing.mkdir()
    assert directory.sync([GPUS]).in_place == (GPUS,)
    assert [spec.kind for spec in read_dir(missing)] == [GPUS.kind]


def test_a_directory_that_is_a_file_is_reported(tmp_path: Path) -> None:
    (tmp_path / "cdi").write_bytes(b"")
    result = SpecDirectory(tmp_path / "cdi").sync([GPUS])
    assert (result.in_place, result.problem) == ((), f"cannot list {tmp_path}/cdi: Not a directory")


def test_a_spec_that_cannot_be_written_leaves_the_others_in_place(tmp_path: Path) -> None:
    # Something that is not a file sits where one spec's file goes.
    (tmp_path / f"{KVM.name}.json").mkdir()
    result = SpecDirectory(tmp_path).sync([GPUS, KVM])
    assert result.in_place == (GPUS,)
    assert result.problem.startswith(f"cannot write {tmp_path}/{KVM.name}.json: ")
    assert not [name for name in os.listdir(tmp_path) if name.endswith(".tmp")]


def test_a_spec_dp_would_not_name_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not named dp-"):
        SpecDirectory(tmp_path).sync([CdiSpec("nvidia", GPUS.kind, GPUS.devices)])
    assert os.listdir(tmp_path) == []
