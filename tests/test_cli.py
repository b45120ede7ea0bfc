"""`dp-server scan`, `serve` and `demo` as an operator runs them."""

from __future__ import annotations

import json
import os
import re
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
    assert "a synthetic node" in out and "Nothing on this machine is read or changed." in out
    # dp's socket, and only dp's: kubelet.sock is the emulated kubelet's.
    (registered,) = [line for line in out.splitlines() if " resources registered " in line]
    assert re.fullmatch(
        r"8 resources registered with the emulated kubelet \(its kubelet\.sock\) "
        r"through dp's socket dp-[0-9a-f]{6}\.sock",
        registered,
    )
    assert "Capacity:" in out and "Allocatable:" in out
    assert "devices.kubevirt.io/kvm:        1000" in out
    assert (
        "(devices.kubevirt.io/kvm is 1000: the config's sharedDevices count; the default is 110)"
        in out
    )
    # The T4s' audio functions, which share each GPU's IOMMU group.
    assert "nvidia.com/TU104_HD_Audio:      2" in out
    assert "PCI_RESOURCE_NVIDIA_COM_TU104GL_TESLA_T4=" in out
    assert "MDEV_PCI_RESOURCE_NVIDIA_COM_GRID_RTX6000-4Q=" in out
    # Why one QAT VF gets its character device and the next does not.
    assert "device  /dev/vfio/devices/vfio0 (mrw)" in out
    assert (
        "(no VFIO character device for 0000:6b:00.2: /dev/vfio/devices/vfio1 does not exist)" in out
    )
    # Each reason for a missing character device is said once, naming every device it applies to.
    notes = [line for line in out.splitlines() if "no VFIO character device" in line]
    reasons = [line.split(": ", 1)[1] for line in notes]
    assert len(notes) >= 2 and len(reasons) == len(set(reasons))
    assert out.count("no vfio-dev entry in sysfs (not on vfio-pci, or Linux before 6.1)") == 1
    # The whole-group DRA device shows every function it holds.
    (whole,) = [line for line in out.splitlines() if line.strip().startswith("iommu-group-93 ")]
    assert "0000:5e:00.0,0000:5e:01.0" in whole
    assert "FAILED_PRECONDITION: IOMMU group 93" in out
    # The DRA half names the device whose Allocate it refuses.
    assert "Allocate(0000:3b:00.1 of nvidia.com/TU104_HD_Audio, in IOMMU group 59 with" in out
    assert "refused" not in out.split("The DRA front end")[0]  # every sample pod is admitted
    assert out.rstrip().endswith("Done; the temporary directory is removed.")


CONFIGS = {
    **{path.name: path.read_text() for path in sorted((REPO / "examples").glob("*.yaml"))},
    "empty permittedHostDevices": "permittedHostDevices: {}\n",
    "CR without permittedHostDevices": "apiVersion: kubevirt.io/v1\nkind: KubeVirt\n"
    "spec: {configuration: {developerConfiguration: {featureGates: [GPU]}}}\n",
    "dra": (REPO / "dp_server" / "cli" / "demo_dra.py")
    .read_text()
    .split('DRA_DEMO_CONFIG = """')[1]
    .split('"""')[0],
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_demo_serves_the_operators_own_config(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Sample pods only for what the config serves; a config serving nothing says
    so; the DRA half only with the config's dra section."""
    config = tmp_path / "config.yaml"
    config.write_text(CONFIGS[name])
    assert main(["demo", "--config", str(config)]) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert "Traceback" not in captured.err
    assert f"config {config}" in out
    capacity = (
        out.split("Capacity:\n", 1)[1].split("Allocatable:", 1)[0] if "Capacity:" in out else ""
    )
    served = {line.split(":")[0].strip() for line in capacity.splitlines() if line.strip()}
    requested = set(re.findall(r"^    (\S+/\S+)$", out.split("The DRA front end")[0], re.M))
    assert requested <= served
    if not served:
        assert "The config serves nothing on this node through the device-plugin API." in out
    if "dra:" in CONFIGS[name]:
        assert "The DRA front end, driver vfio.dp.example.com:" in out
        assert "claim vm-c: prepared" in out
    else:
        assert "The DRA front end: the config has no dra section, so it is off." in out
    assert out.rstrip().endswith("Done; the temporary directory is removed.")


def test_demo_with_a_temp_dir_too_long_for_unix_sockets_says_so_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    deep = tmp_path / ("t" * 90)
    deep.mkdir()
    monkeypatch.setenv("TMPDIR", str(deep))
    monkeypatch.setattr("tempfile.tempdir", None)  # read TMPDIR again
    assert main(["demo"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith(f"dp-server: demo: TMPDIR={deep} is too long for the demo's unix sockets")
    assert err.rstrip().endswith("run it with a shorter TMPDIR, such as TMPDIR=/tmp")
    assert list(deep.iterdir()) == []


def _events_until(
    server: subprocess.Popen[str], done: Any, timeout: float = 20.0
) -> tuple[list[dict[str, Any]], str]:
    """The JSON log lines `server` writes, read until `done(lines so far)` holds;
    and the start of a line read past them. Read from the descriptor, so that no
    buffer hides a line from select."""
    import select

    assert server.stderr is not None
    fd = server.stderr.fileno()
    seen: list[dict[str, Any]] = []
    pending = b""
    deadline = time.monotonic() + timeout
    while not done(seen):
        left = deadline - time.monotonic()
        assert left > 0, f"not seen in {timeout} s: {seen}"
        if not select.select([fd], [], [], left)[0]:
            continue
        chunk = os.read(fd, 65536)
        assert chunk, f"serve ended: {seen}"
        *lines, pending = (pending + chunk).split(b"\n")
        seen += [json.loads(line) for line in lines if line]
    return seen, pending.decode()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_serve_stops_cleanly_on_signal(
    signum: int, host: tuple[Path, Path], config_file: Path, short_dir: Path
) -> None:
    sysfs, dev = host
    plugin_dir = short_dir
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
        # The kubelet lists a resource as soon as it has answered Register; dp
        # logs `registered` once that answer has reached it. Stop after that.
        events, partial = _events_until(
            server,
            lambda seen: {e["resource"] for e in seen if e["event"] == "registered"} == set(ALL),
        )
        ours = [p for p in plugin_dir.iterdir() if p.name.startswith("dp-")]
        assert len(ours) == 1
        started = time.monotonic()
        server.send_signal(signum)
        code = server.wait(timeout=10)
        elapsed = time.monotonic() - started
        assert code == 0
        assert elapsed < 5
        assert not ours[0].exists()
        rest = partial + server.stderr.read()  # type: ignore[union-attr]
        events += [json.loads(line) for line in rest.splitlines() if line]
        registered = {e["resource"] for e in events if e["event"] == "registered"}
        assert registered == set(ALL)
        # One line per resource and cause, with the count, however many devices.
        health = [e for e in events if e["event"] == "health-changed"]
        assert health
        assert len(health) == len({(e["resource"], e["health"], e["reason"]) for e in health})
        assert all(e["devices"] >= 1 for e in health)
        (serving,) = [e for e in events if e["event"] == "serving"]
        assert serving["resources"] == len(ALL)
        assert serving["sockets"] == ours[0].name
        assert serving["config"] == str(config_file)
        assert events[-1]["event"] == "stopped"
        # The kubelet saw the streams end, as it does when a plugin goes away.
        assert emulator.wait_for(lambda e: all(not e.resources()[n].registered for n in ALL), 5)
    finally:
        if server.poll() is None:
            server.kill()
        emulator.stop()


EXPLAINED_CONFIG = """
permittedHostDevices:
  pciHostDevices:
    - {pciVendorSelector: "%s", resourceName: "nvidia.com/T4"}
    - {pciVendorSelector: "8086:1572", resourceName: "intel.com/x710"}
sharedDevices:
  devices.kubevirt.io/kvm: {enabled: false}
  devices.kubevirt.io/tun: {enabled: false}
  devices.kubevirt.io/vhost-net: {enabled: false}
"""


def test_serve_logs_what_scan_explains_at_start_and_when_it_changes(
    host: tuple[Path, Path], tmp_path: Path, short_dir: Path
) -> None:
    """A selector that matches nothing, named, and a device skipped and why:
    once at start, once more when the config changes what holds, and not at
    every rescan (one a second here)."""
    sysfs, dev = host
    config = tmp_path / "config" / "config.yaml"
    config.parent.mkdir()
    config.write_text(EXPLAINED_CONFIG % "10DE:1EB9")
    emulator = KubeletEmulator(short_dir).start()
    command = [sys.executable, "-m", "dp_server", "serve", "--sysfs", str(sysfs)]
    command += ["--dev", str(dev), "--config", str(config), "--rescan-interval", "1"]
    command += ["--device-plugin-dir", str(short_dir), "--log-format", "json"]
    command += ["--pod-resources-socket", str(short_dir / "none.sock")]
    server = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, cwd=REPO)
    try:
        events, partial = _events_until(
            server,
            lambda seen: (
                {"selector-matches-nothing", "devices-skipped"} <= {e["event"] for e in seen}
            ),
        )
        (nothing,) = [e for e in events if e["event"] == "selector-matches-nothing"]
        assert (nothing["entry"], nothing["selector"], nothing["resource"]) == (
            "pciHostDevices[0]",
            "10DE:1EB9",
            "nvidia.com/T4",
        )
        assert nothing["reason"].endswith("the nearest is 10DE:1EB8 (3 functions)")
        (skipped,) = [e for e in events if e["event"] == "devices-skipped"]
        assert (skipped["resource"], skipped["devices"]) == ("intel.com/x710", "0000:18:00.0")
        assert skipped["reason"].startswith("bound to host driver i40e")

        config.write_text(EXPLAINED_CONFIG % "10DE:1EB8")  # the typo mended
        more, partial = _events_until(
            server,
            lambda seen: any(e["event"] == "explained-no-longer" for e in seen),
        )
        events += more
        (over,) = [e for e in more if e["event"] == "explained-no-longer"]
        assert (over["was"], over["selector"]) == ("selector-matches-nothing", "10DE:1EB9")
        time.sleep(2.5)  # rescans, which find nothing new to say
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=10) == 0
        rest = partial + server.stderr.read()  # type: ignore[union-attr]
        events += [json.loads(line) for line in rest.splitlines() if line]
        said = [e["event"] for e in events]
        assert said.count("selector-matches-nothing") == 1
        assert said.count("devices-skipped") == 1, "the skipped NIC, said once"
        assert said.count("explained-no-longer") == 1
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
    host: tuple[Path, Path], tmp_path: Path, short_dir: Path
) -> None:
    """vfio-pci's unbind, or a driver's, can hang in the kernel while the
    device's user holds it. A stopping dp waits 2 s for the write under way,
    then exits 0 all the same, its sockets removed; the write is left to the
    kernel. Here i40e's unbind is a FIFO nobody reads: opening it blocks."""
    sysfs, dev = host
    unbind = sysfs / "bus/pci/drivers/i40e/unbind"
    unbind.unlink()
    os.mkfifo(unbind)
    override = sysfs / "bus/pci/devices/0000:18:00.0/driver_override"
    config = tmp_path / "binding.yaml"
    config.write_text(BINDING_CONFIG)
    plugin_dir = short_dir
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


# --- flags and the operator's shell ----------------------------------------------------


@pytest.mark.parametrize("value", ["0", "-5", "0.001", "nan", "inf", "86401", "soon"])
def test_a_rescan_interval_out_of_range_is_one_line_and_exit_2(
    value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as stopped:
        main(["serve", f"--rescan-interval={value}"])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith("dp-server serve: argument --rescan-interval: ")
    assert f"{value!r} is not a number of seconds from 1 to 86400" in err


def test_version_and_help_with_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    from importlib.metadata import version

    with pytest.raises(SystemExit) as stopped:
        main(["--version"])
    assert stopped.value.code == 0
    assert capsys.readouterr().out == f"dp-server {version('dp')}\n"
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    # argparse wraps help text at hyphens and spaces; compare it unwrapped.
    help_text = " ".join(capsys.readouterr().out.split()).replace("- ", "-")
    for flag, default in [
        ("--device-plugin-dir", "/var/lib/kubelet/device-plugins"),
        ("--pod-resources-socket", "/var/lib/kubelet/pod-resources/kubelet.sock"),
        ("--rescan-interval", "30"),
        ("--log-level", "info"),
        ("--log-format", "text"),
        ("--socket-mode", "single"),
    ]:
        after = help_text.split(f" {flag} ", 2)[-1]
        assert f"(default: {default})" in after.split(" --", 1)[0], flag


def test_every_line_of_a_config_error_says_dp_server(
    tmp_path: Path, host: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "permittedHostDevices:\n  pciHostDevices:\n"
        "    - pciVendorSelector: 'ZZZZ:1EB8'\n    - pciVendorSelector: 12\n"
        "sharedDevices: {example.com/x: {count: 0}}\n"
    )
    sysfs, dev = host
    assert main(["scan", "--sysfs", str(sysfs), "--dev", str(dev), "--config", str(bad)]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) >= 3
    assert all(line.startswith(f"dp-server: {bad}: ") for line in lines), lines


def test_scan_into_head_is_quiet(host: tuple[Path, Path], config_file: Path) -> None:
    """`dp-server scan | head -1`: the reader leaves early, and no traceback follows."""
    sysfs, dev = host
    command = [sys.executable, "-m", "dp_server", "scan", "--sysfs", str(sysfs), "--dev", str(dev)]
    command += ["--config", str(config_file), "--format", "json"]
    scan = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO)
    assert scan.stdout is not None and scan.stderr is not None
    assert scan.stdout.readline() == b"{\n"
    scan.stdout.close()  # as `head -1` exits
    code = scan.wait(timeout=30)
    assert scan.stderr.read() == b""
    assert code == 141  # as for a process that SIGPIPE ended


def test_serve_waits_for_the_kubelets_directory_and_says_so(
    host: tuple[Path, Path], config_file: Path, short_dir: Path
) -> None:
    """dp does not make the kubelet's directory; it says what it waits for, then serves."""
    sysfs, dev = host
    plugin_dir = short_dir / "device-plugins"
    command = [sys.executable, "-m", "dp_server", "serve", "--sysfs", str(sysfs), "--dev", str(dev)]
    command += ["--config", str(config_file), "--device-plugin-dir", str(plugin_dir)]
    command += ["--pod-resources-socket", str(short_dir / "pr.sock"), "--state-dir", ""]
    command += ["--log-format", "json"]
    server = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, cwd=REPO)
    emulator = None
    try:
        assert server.stderr is not None
        seen: list[dict[str, Any]] = []
        while not seen or seen[-1]["event"] != "waiting-for-kubelet":
            line = server.stderr.readline()
            assert line, "serve ended without saying what it waits for"
            seen.append(json.loads(line))
        waiting = seen[-1]
        assert waiting["level"] == "warning"
        assert waiting["socket"] == str(plugin_dir / "kubelet.sock")
        assert f"{plugin_dir} does not exist" in waiting["reason"]
        assert not plugin_dir.exists()
        emulator = KubeletEmulator(plugin_dir).start()
        assert emulator.wait_registered(ALL, 20, listed=True)
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=10) == 0
        rest = [json.loads(line) for line in server.stderr.read().splitlines() if line]
        # Said once at start (the next would come a minute later), and only that way.
        assert [e for e in rest if e["event"] == "waiting-for-kubelet"] == []
        assert [e for e in seen + rest if e["event"] == "plugin-dir-missing"] == []
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
        if emulator is not None:
            emulator.stop()


# --- scan explains its answer ----------------------------------------------------------


def _scan(
    capsys: pytest.CaptureFixture[str],
    sysfs: Path | str,
    dev: Path | str,
    *extra: str,
    status: int = 0,
) -> tuple[str, dict[str, Any]]:
    """The table and the JSON document `scan` prints for one host and config."""
    base = ["scan", "--sysfs", str(sysfs), "--dev", str(dev), *extra]
    assert main(base) == status
    table = capsys.readouterr()
    assert table.err == ""
    assert main([*base, "--format", "json"]) == status
    return table.out, json.loads(capsys.readouterr().out)


def test_scan_on_a_kubevirt_cr_says_which_entries_it_serves_and_why(
    host: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    cr = REPO / "examples" / "kubevirt-cr.yaml"
    table, document = _scan(capsys, *host, "--config", str(cr))
    assert [r["name"] for r in document["resources"]] == [
        "intel.com/qat_vf",
        "nvidia.com/GRID_RTX6000-4Q",
        "nvidia.com/TU104GL_Tesla_T4",
    ]
    config = document["config"]
    assert (config["source"], config["kubevirt_cr"]) == (str(cr), True)
    who = {e["entry"]: (e["selector"], e["served_by"], e["devices"]) for e in config["entries"]}
    assert who == {
        "pciHostDevices[0]": ("10DE:1EB8", "dp", 3),
        "pciHostDevices[1]": ("8086:4941", "dp", 4),
        "pciHostDevices[2]": ("144D:A808", "virt-handler", 2),
        "mediatedDevices[0]": ("GRID RTX6000-4Q", "dp", 2),
    }
    nvme = config["entries"][2]
    assert (
        nvme["why"]
        == "externalResourceProvider is false (KubeVirt's default): virt-handler serves it"
    )
    assert config["entries"][0]["why"] == (
        "externalResourceProvider is true: KubeVirt leaves it to an outside plugin"
    )
    assert [n["message"] for n in config["notes"]] == [
        "devices.kubevirt.io/kvm, tun and vhost-net are not served: KubeVirt's virt-handler "
        "always serves them"
    ]
    assert f"config {cr}, a KubeVirt CR read as KubeVirt reads it:" in table
    assert (
        "  pciHostDevices[2]  144D:A808 -> devices.kubevirt.io/nvme: selects 2 functions here, "
        "left to virt-handler: externalResourceProvider is false (KubeVirt's default): "
        "virt-handler serves it" in table
    )
    assert "  info: sharedDevices: devices.kubevirt.io/kvm, tun and vhost-net" in table


def test_scan_and_demo_with_binding_say_one_thing_of_each_device(
    host: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """A count says what it counts, and the demo does not deny the move it
    announced (examples/config-binding.yaml)."""
    config = str(REPO / "examples" / "config-binding.yaml")
    table, document = _scan(capsys, *host, "--config", config)
    assert (
        "  pciHostDevices[3]  1A03:2000 -> devices.kubevirt.io/aspeed_vga: selects 1 function "
        "here, for dp: dp's config lists it" in table
    )
    assert [s["id"] for s in document["skipped"]] == ["0000:03:00.0"]
    assert "served by dp" not in table

    assert main(["demo", "--config", config]) == 0
    out = capsys.readouterr().out
    moved = out.split("serve would move:\n", 1)[1].split("and would not move:", 1)[0]
    assert "0000:18:00.0 from i40e" in moved
    not_advertised = out.split("Selected but not advertised, and why:\n", 1)[1]
    assert (
        "  0000:18:00.0 (intel.com/x710): bound to host driver i40e; serve would move it to "
        "vfio-pci (the demo moves nothing)\n" in not_advertised
    )
    assert "no binding policy" not in out
    assert (
        "  0000:03:00.0 (devices.kubevirt.io/aspeed_vga): bound to host driver ast; not moved "
        "to vfio-pci: drives the boot display (boot_vga is 1); dp never rebinds it\n"
        in not_advertised
    )


def test_scan_on_a_kubevirt_cr_with_kubevirt_resources_serves_only_those_named(
    host: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    cr = REPO / "examples" / "kubevirt-cr.yaml"
    named = "intel.com/qat_vf,nvidia.com/GRID_RTX6000-4Q"
    table, document = _scan(capsys, *host, "--config", str(cr), "--kubevirt-resources", named)
    assert [r["name"] for r in document["resources"]] == [
        "intel.com/qat_vf",
        "nvidia.com/GRID_RTX6000-4Q",
    ]
    entries = document["config"]["entries"]
    assert [e["served_by"] for e in entries] == ["another plugin", "dp", "virt-handler", "dp"]
    assert entries[0]["why"] == (
        "externalResourceProvider is true, but --kubevirt-resources does not name it: "
        "another outside plugin serves it"
    )
    assert (
        "  pciHostDevices[0]  10DE:1EB8 -> nvidia.com/TU104GL_Tesla_T4: selects 3 functions "
        "here, left to another plugin: externalResourceProvider is true, but "
        "--kubevirt-resources does not name it: another outside plugin serves it" in table
    )
    assert (
        "  info: --kubevirt-resources: dp serves 2 entries of the 3 the CR leaves to outside "
        "plugins (intel.com/qat_vf, nvidia.com/GRID_RTX6000-4Q); 1 entry left to another "
        "outside plugin" in table
    )


@pytest.mark.parametrize(
    ("extra", "error"),
    [
        (
            ["--kubevirt-resources", "a,,b"],
            "argument --kubevirt-resources: 'a,,b' is not a comma-separated list of names",
        ),
        (["--kubevirt-resources", "a"], "--kubevirt-resources needs a KubeVirt CR as --config"),
    ],
)
def test_kubevirt_resources_without_a_cr_or_names_is_a_one_line_error(
    host: tuple[Path, Path], capsys: pytest.CaptureFixture[str], extra: list[str], error: str
) -> None:
    sysfs, dev = host
    try:
        code = main(["scan", "--sysfs", str(sysfs), "--dev", str(dev), *extra])
    except SystemExit as exited:  # argparse's own exit, for a malformed value
        code = exited.code
    assert code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and error in err


def test_scan_names_the_nearest_id_and_mdev_type_of_a_selector_that_matches_nothing(
    host: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "typo.yaml"
    config.write_text(
        "permittedHostDevices:\n"
        "  pciHostDevices: [{pciVendorSelector: '10DE:1EB9', resourceName: nvidia.com/T4}]\n"
        "  mediatedDevices: [{mdevNameSelector: GRID RTX6000-4C}]\n"
        "sharedDevices:\n"
        + "".join(f"  devices.kubevirt.io/{n}: {{enabled: false}}\n" for n in SHARED_NAMES)
    )
    table, document = _scan(capsys, *host, "--config", str(config))
    assert document["resources"] == []
    pci, mdev = document["config"]["entries"]
    assert (pci["devices"], pci["nearest"]) == (0, "10DE:1EB8")
    assert pci["note"] == (
        "no PCI function on this host has the ID 10DE:1EB9; the nearest is 10DE:1EB8 (3 functions)"
    )
    assert (mdev["devices"], mdev["nearest"]) == (0, "GRID RTX6000-4Q")
    assert mdev["note"] == (
        "no mdev type on this host is named 'GRID RTX6000-4C'; "
        "the nearest is 'GRID RTX6000-4Q' (2 mdevs)"
    )
    assert table.startswith("no resources would be advertised (why: below)\n")
    assert f"    {pci['note']}\n" in table and f"    {mdev['note']}\n" in table


SHARED_NAMES = ("kvm", "tun", "vhost-net")


@pytest.mark.parametrize("where", ["nonexistent", "one level too high", "inside it"])
def test_scan_says_when_sysfs_is_not_a_sysfs_root(
    where: str, host: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """And exits 2, as for any bad flag, so that a script can tell it from a
    host where nothing matches (0)."""
    sysfs, dev = host
    given = {
        "nonexistent": tmp_path / "nonexistent",
        "one level too high": sysfs.parent,
        # bus/mdev has a `devices` of its own: not the root to suggest.
        "inside it": sysfs / "bus",
    }[where]
    table, document = _scan(capsys, given, dev, status=2)
    (problem,) = document["problems"]
    assert problem["path"] == str(given)
    if where == "nonexistent":
        assert problem["reason"] == "does not exist; --sysfs must be /sys or a copy of it"
    elif where == "inside it":
        assert problem["reason"] == (
            f"is inside {sysfs}, which is /sys or a copy of it: did you mean --sysfs {sysfs}?"
        )
    else:
        assert problem["reason"] == (
            f"is not /sys or a copy of it, but {sysfs} is: did you mean --sysfs {sysfs}?"
        )
    assert f"problems reading the host:\n  {given}: {problem['reason']}" in table
    assert document["host_notes"] == []  # nothing under a wrong root means anything


def test_scan_with_the_shipped_fixture_inside_its_root_suggests_the_root() -> None:
    """`--sysfs fixtures/sysfs/sys/bus`, as a user might type it, through the
    installed command: the root it is inside, never bus/mdev."""
    result = subprocess.run(
        [sys.executable, "-m", "dp_server", "scan", "--sysfs", "fixtures/sysfs/sys/bus"]
        + ["--dev", "fixtures/sysfs/dev"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2, result.stderr
    assert "did you mean --sysfs fixtures/sysfs/sys?" in result.stdout
    assert "bus/mdev" not in result.stdout


@pytest.mark.parametrize("command", [["scan"], ["demo"]])
def test_output_that_cannot_be_written_is_an_error_line_not_a_traceback(
    command: list[str], host: tuple[Path, Path]
) -> None:
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    sysfs, dev = host
    where = ["--sysfs", str(sysfs), "--dev", str(dev)] if command == ["scan"] else []
    with open("/dev/full", "w") as full:
        result = subprocess.run(
            [sys.executable, "-m", "dp_server", *command, *where],
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
            check=False,
        )
    assert result.returncode == 1
    assert result.stderr == (
        f"dp-server: {command[0]}: cannot write the output: No space left on device\n"
    )


def test_scan_says_a_host_without_iommu_groups_has_its_iommu_off(
    host: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    sysfs, dev = host
    shutil.rmtree(sysfs / "kernel" / "iommu_groups")
    (sysfs / "kernel" / "iommu_groups").mkdir()  # what a kernel without an IOMMU shows
    for link in (sysfs / "bus" / "pci" / "devices").glob("*/iommu_group"):
        (link.parent.resolve() / "iommu_group").unlink()
    table, document = _scan(capsys, sysfs, dev)
    (note,) = document["host_notes"]
    assert note.startswith(f"no IOMMU groups under {sysfs}/kernel/iommu_groups: the IOMMU is off")
    assert f"the host:\n  {note}" in table


def test_the_troubleshooting_table_quotes_what_scan_prints(
    host: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every `scan` output that docs/operations.md's troubleshooting table quotes
    is printed, word for word, by scan on a host that has that trouble."""
    sysfs, dev = host
    configs = {
        "examples": "examples/config.yaml",
        "cr": "examples/kubevirt-cr.yaml",
        "nic": None,
        "typo": None,
        "cr-empty": None,
        "cr-nothing-outside": None,
    }
    texts = {
        "nic": "permittedHostDevices: {pciHostDevices: [{pciVendorSelector: '8086:1572'}]}\n",
        "typo": "permittedHostDevices:\n"
        "  pciHostDevices: [{pciVendorSelector: '10DE:1EB9'}]\n"
        "  mediatedDevices: [{mdevNameSelector: GRID RTX6000-4C}]\n",
        "cr-empty": "apiVersion: kubevirt.io/v1\nkind: KubeVirt\nspec: {configuration: {}}\n",
        "cr-nothing-outside": "apiVersion: kubevirt.io/v1\nkind: KubeVirt\nspec:\n"
        "  configuration: {permittedHostDevices: {pciHostDevices: "
        "[{pciVendorSelector: '8086:1572', resourceName: intel.com/x710}]}}\n",
    }
    outputs = []
    for name, shipped in configs.items():
        path = REPO / shipped if shipped else tmp_path / f"{name}.yaml"
        if not shipped:
            path.write_text(texts[name])
        outputs.append(_scan(capsys, sysfs, dev, "--config", str(path))[0])
    outputs.append(_scan(capsys, tmp_path / "nonexistent", dev, status=2)[0])
    outputs.append(_scan(capsys, sysfs.parent, dev, status=2)[0])
    shutil.rmtree(sysfs / "kernel" / "iommu_groups")
    (sysfs / "kernel" / "iommu_groups").mkdir()
    outputs.append(_scan(capsys, sysfs, dev)[0])
    printed = "\n".join(outputs)

    operations = (REPO / "docs" / "operations.md").read_text()
    table = operations.split("## Troubleshooting", 1)[1].split("\n## ", 1)[0]
    symptoms = [row.split("|")[1] for row in table.splitlines() if row.startswith("| ")]
    quoted = [
        phrase
        for symptom in symptoms
        if "`scan`" in symptom
        for phrase in re.findall(r"`([^`]+)`", symptom.split("`scan`", 1)[1])
    ]
    assert len(quoted) >= 8, quoted
    for phrase in quoted:
        # The docs write the host's own paths (/sys/...) and elide with "...".
        pattern = ".*?".join(re.escape(part) for part in re.split(r"/sys\b|\.\.\.", phrase))
        assert re.search(pattern, printed), phrase
