"""`dp-server scan`, `serve` and `demo` as an operator runs them."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from dp_server.cli.demo import DEMO_CONFIG
from dp_server.cli.main import main
from dp_testing.emulator import KubeletEmulator
from dp_testing.topology import fixture_topology, write_sysfs

from e2e_harness import ALL

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def host(tmp_path: Path) -> tuple[Path, Path]:
    return write_sysfs(fixture_topology(), tmp_path / "host")


@pytest.fixture
def config_file(tmp_path: Path) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(DEMO_CONFIG)
    return path


def test_scan_json_lists_every_resource_with_health(
    host: tuple[Path, Path], config_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sysfs, dev = host
    code = main(
        [
            "scan",
            "--sysfs",
            str(sysfs),
            "--dev",
            str(dev),
            "--config",
            str(config_file),
            "--format",
            "json",
        ]
    )
    assert code == 0
    document = json.loads(capsys.readouterr().out)
    by_name = {r["name"]: r for r in document["resources"]}
    assert sorted(by_name) == sorted(ALL)
    gpus = {d["id"]: d for d in by_name["nvidia.com/TU104GL_Tesla_T4"]["devices"]}
    assert gpus["0000:3b:00.0"] == {
        "id": "0000:3b:00.0",
        "health": "Healthy",
        "numa_node": 0,
        "iommu_group": 59,
        "driver": "vfio-pci",
        "host_paths": ["/dev/vfio/vfio", "/dev/vfio/59"],
        # Since issue 19: every PCI device says which VFIO character device it has.
        "cdev": None,
        "cdev_reason": "no vfio-dev entry in sysfs (not on vfio-pci, or Linux before 6.1)",
    }
    assert gpus["0000:d8:00.0"]["health"] == "Unhealthy"
    assert "snd_hda_intel" in gpus["0000:d8:00.0"]["reason"]
    skipped = {s["id"]: s for s in document["skipped"]}
    assert "0000:6b:00.0" not in by_name["intel.com/qat_vf"]  # the PF is not a VF
    assert all(s["reason"] for s in skipped.values())


def _scan_json(
    sysfs: Path, dev: Path, config_file: Path, capsys: pytest.CaptureFixture[str]
) -> Any:
    args = ["scan", "--sysfs", str(sysfs), "--dev", str(dev), "--config", str(config_file)]
    assert main([*args, "--format", "json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_scan_json_shows_each_vfio_character_device_or_why_none(
    host: tuple[Path, Path], config_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    document = _scan_json(*host, config_file, capsys)
    assert document["iommufd"] == {"path": "/dev/iommu", "present": True}
    (qat,) = [r for r in document["resources"] if r["name"] == "intel.com/qat_vf"]
    vfs = {d["id"]: d for d in qat["devices"]}
    assert vfs["0000:6b:00.1"]["cdev"] == "/dev/vfio/devices/vfio0"
    assert "cdev_reason" not in vfs["0000:6b:00.1"]
    assert vfs["0000:6b:00.1"]["host_paths"] == [
        "/dev/vfio/vfio",
        "/dev/vfio/108",
        "/dev/vfio/devices/vfio0",
    ]
    assert vfs["0000:6b:00.2"]["cdev"] is None
    assert vfs["0000:6b:00.2"]["cdev_reason"] == "/dev/vfio/devices/vfio1 does not exist"
    assert vfs["0000:6b:00.2"]["health"] == "Healthy"
    assert vfs["0000:6b:00.3"]["cdev"] is None
    assert "vfio-dev/vfio2 has no dev file" in vfs["0000:6b:00.3"]["cdev_reason"]
    assert vfs["0000:6b:00.3"]["health"] == "Healthy"
    # The fixture's mdevs have no vfio-dev entry, as before Linux 6.1.
    mdevs = [r for r in document["resources"] if r["kind"] == "mdev"]
    assert mdevs and all(d["cdev"] is None for r in mdevs for d in r["devices"])


def test_scan_shows_an_absent_dev_iommu_and_an_unreadable_vfio_dev(
    host: tuple[Path, Path], config_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sysfs, dev = host
    (dev / "iommu").unlink()
    entry = sysfs / "bus/pci/devices/0000:6b:00.1/vfio-dev"
    shutil.rmtree(entry.resolve())
    entry.resolve().write_text("")  # a file where the kernel keeps a directory
    document = _scan_json(sysfs, dev, config_file, capsys)
    assert document["iommufd"] == {"path": "/dev/iommu", "present": False}
    (qat,) = [r for r in document["resources"] if r["name"] == "intel.com/qat_vf"]
    vf = {d["id"]: d for d in qat["devices"]}["0000:6b:00.1"]
    assert vf["health"] == "Healthy" and vf["cdev"] is None
    assert vf["cdev_reason"].startswith("vfio-dev cannot be read: cannot list: ")
    assert vf["host_paths"] == ["/dev/vfio/vfio", "/dev/vfio/108"]
    (problem,) = [p for p in document["problems"] if p["path"].endswith("/vfio-dev")]
    assert "the group interface stays" in problem["reason"]
    args = ["scan", "--sysfs", str(sysfs), "--dev", str(dev), "--config", str(config_file)]
    assert main(args) == 0
    table = capsys.readouterr().out
    assert "/dev/iommu: absent" in table
    assert "  0000:6b:00.1  Healthy    numa=0  group=108  cdev=-" in table
    assert "[no cdev: vfio-dev cannot be read: cannot list: " in table


def test_scan_changes_nothing_on_the_host(host: tuple[Path, Path], config_file: Path) -> None:
    sysfs, dev = host

    def state() -> dict[str, object]:
        found: dict[str, object] = {}
        for root in (sysfs, dev):
            for path in sorted(root.rglob("*")):
                found[str(path)] = (
                    os.readlink(path)
                    if path.is_symlink()
                    else path.read_bytes()
                    if path.is_file()
                    else "dir"
                )
        return found

    before = state()
    assert (
        main(["scan", "--sysfs", str(sysfs), "--dev", str(dev), "--config", str(config_file)]) == 0
    )
    assert state() == before


def test_scan_table_names_reasons(
    host: tuple[Path, Path], config_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sysfs, dev = host
    assert (
        main(["scan", "--sysfs", str(sysfs), "--dev", str(dev), "--config", str(config_file)]) == 0
    )
    out = capsys.readouterr().out
    assert "nvidia.com/TU104GL_Tesla_T4  (pci, 2/3 healthy)" in out
    assert "/dev/vfio/111 does not exist" in out


def test_bad_config_exits_2_naming_the_field(
    tmp_path: Path, host: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "permittedHostDevices:\n  pciHostDevices:\n"
        "    - pciVendorSelector: 'ZZZZ:1EB8'\n      resourceName: nvidia.com/x\n"
    )
    sysfs, dev = host
    code = main(["scan", "--sysfs", str(sysfs), "--dev", str(dev), "--config", str(bad)])
    assert code == 2
    err = capsys.readouterr().err
    assert "permittedHostDevices.pciHostDevices[0].pciVendorSelector" in err
    assert "'ZZZZ:1EB8' is not VVVV:DDDD hex" in err


def test_serve_refuses_a_device_plugin_dir_too_long_for_socket_paths(
    tmp_path: Path, host: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    sysfs, dev = host
    plugin_dir = tmp_path / ("d" * (100 - len(str(tmp_path))))
    plugin_dir.mkdir()
    code = main(
        ["serve", "--sysfs", str(sysfs), "--dev", str(dev), "--device-plugin-dir", str(plugin_dir)]
    )
    assert code == 2
    err = capsys.readouterr().err
    assert f"--device-plugin-dir {str(plugin_dir)!r} is too long" in err
    assert "at most 83 bytes for the directory" in err
    assert list(plugin_dir.iterdir()) == []


def test_demo_prints_node_and_sample_allocations(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    assert "Capacity:" in out and "Allocatable:" in out
    assert "devices.kubevirt.io/kvm:        1000" in out
    assert "PCI_RESOURCE_NVIDIA_COM_TU104GL_TESLA_T4=" in out
    assert "MDEV_PCI_RESOURCE_NVIDIA_COM_GRID_RTX6000-4Q=" in out
    assert "FAILED_PRECONDITION: IOMMU group 93" in out


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_serve_stops_cleanly_on_signal(
    signum: int, host: tuple[Path, Path], config_file: Path
) -> None:
    import tempfile

    sysfs, dev = host
    plugin_dir = Path(tempfile.mkdtemp(prefix="dp-s-"))
    emulator = KubeletEmulator(plugin_dir).start()
    command = [
        sys.executable,
        "-m",
        "dp_server",
        "serve",
        "--sysfs",
        str(sysfs),
        "--dev",
        str(dev),
        "--config",
        str(config_file),
        "--device-plugin-dir",
        str(plugin_dir),
        "--pod-resources-socket",
        str(plugin_dir / "none.sock"),
        "--log-format",
        "json",
    ]
    server = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert emulator.wait_registered(ALL, 20, listed=True)
        ours = [p for p in plugin_dir.iterdir() if p.name.startswith("dp-")]
        assert len(ours) == 1
        started = time.monotonic()
        server.send_signal(signum)
        code = server.wait(timeout=10)
        elapsed = time.monotonic() - started
        assert code == 0
        assert elapsed < 5
        assert not ours[0].exists()
        events = [json.loads(line) for line in server.stderr.read().splitlines() if line]  # type: ignore[union-attr]
        registered = {e["resource"] for e in events if e["event"] == "registered"}
        assert registered == set(ALL)
        assert any(e["event"] == "health-changed" for e in events)
        assert events[-1]["event"] == "stopped"
        # The kubelet saw the streams end, as it does when a plugin goes away.
        assert emulator.wait_for(lambda e: all(not e.resources()[n].registered for n in ALL), 5)
    finally:
        if server.poll() is None:
            server.kill()
        emulator.stop()


BINDING_CONFIG = """
permittedHostDevices:
  pciHostDevices:
    - {pciVendorSelector: "8086:1572", resourceName: "intel.com/x710"}
binding:
  replaceDrivers: [i40e]
"""


def test_serve_exits_on_signal_while_a_sysfs_write_hangs(
    host: tuple[Path, Path], tmp_path: Path
) -> None:
    """vfio-pci's unbind, or a driver's, can hang in the kernel while the
    device's user holds it. A stopping dp waits 2 s for the write under way,
    then exits 0 all the same, its sockets removed; the write is left to the
    kernel. Here i40e's unbind is a FIFO nobody reads: opening it blocks."""
    import tempfile

    sysfs, dev = host
    unbind = sysfs / "bus/pci/drivers/i40e/unbind"
    unbind.unlink()
    os.mkfifo(unbind)
    override = sysfs / "bus/pci/devices/0000:18:00.0/driver_override"
    config = tmp_path / "binding.yaml"
    config.write_text(BINDING_CONFIG)
    plugin_dir = Path(tempfile.mkdtemp(prefix="dp-h-"))
    emulator = KubeletEmulator(plugin_dir, pod_resources_socket=plugin_dir / "pr.sock").start()
    command = [
        *(sys.executable, "-m", "dp_server", "serve", "--sysfs", str(sysfs), "--dev", str(dev)),
        *("--config", str(config), "--device-plugin-dir", str(plugin_dir)),
        *("--pod-resources-socket", str(plugin_dir / "pr.sock")),
        *("--state-dir", str(tmp_path / "state"), "--log-format", "json"),
    ]
    server = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, cwd=REPO)
    try:
        # The override is written first; the unbind comes next, and hangs.
        deadline = time.monotonic() + 20
        while override.read_text().strip() != "vfio-pci":
            assert server.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(0.3)
        started = time.monotonic()
        server.send_signal(signal.SIGTERM)
        code = server.wait(timeout=15)
        elapsed = time.monotonic() - started
        assert code == 0
        assert 2 <= elapsed < 5
        assert [p.name for p in plugin_dir.iterdir() if p.name.startswith("dp-")] == []
        events = [json.loads(line) for line in server.stderr.read().splitlines() if line]  # type: ignore[union-attr]
        assert events[-1]["event"] == "stopped"
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
        emulator.stop()
