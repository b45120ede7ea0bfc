"""DeviceClasses written by dp from its config (`dp-server device-classes`).

The shipped copies (deploy/dra/deviceclasses.yaml, examples/dra/
deviceclasses.yaml) must be the command's output for deploy/dra's config, so
they never drift from what dp publishes; each class selects exactly one
resource's functions or mdevs (never a whole-group device) and names, as its
extendedResourceName, the name the device plugin would advertise for them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dp_core import PciId, build_inventory
from dp_core.dra import dra_catalogue
from dp_core.dra.deviceclasses import device_class_name, device_classes, dra_resource_names
from dp_server.config.loader import parse_config
from tests.test_dra_manifests import _fixture_host, selects

ROOT = Path(__file__).parent.parent
SHIPPED = (
    ROOT / "deploy" / "dra" / "deviceclasses.yaml",
    ROOT / "examples" / "dra" / "deviceclasses.yaml",
)
DRIVER = "vfio.dp.example.com"


def deploy_config() -> str:
    configmap = yaml.safe_load((ROOT / "deploy" / "dra" / "configmap.yaml").read_text())
    return str(configmap["data"]["config.yaml"])


def command(config: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dp_server", "device-classes", "--config", str(config), *extra],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.parametrize("shipped", SHIPPED, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_shipped_classes_are_the_commands_output(shipped: Path, tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(deploy_config())
    result = command(config)
    assert result.returncode == 0, result.stderr
    assert shipped.read_text() == result.stdout, (
        f"{shipped.relative_to(ROOT)} drifted from the config: write it again with "
        "dp-server device-classes --config <deploy/dra/configmap.yaml's config.yaml>"
    )


def test_each_class_takes_one_resources_devices_by_the_name_the_plugin_advertises() -> None:
    config = parse_config(deploy_config(), "<deploy/dra>")
    classes, problems = device_classes(config)
    assert problems == ()
    host = _fixture_host()
    devices, _ = dra_catalogue(build_inventory(host, config), host)
    assert any(d.members for d in devices), "the fixture must have a whole-group device"
    for device_class in classes:
        chosen = [d for d in devices if selects(device_class.expression, DRIVER, d)]
        assert chosen, f"{device_class.name} selects nothing"
        assert all(not d.members for d in chosen), f"{device_class.name} selects a whole group"
        assert {d.resource for d in chosen} == {device_class.extended_resource_name}
        every = [d for d in devices if d.resource == device_class.extended_resource_name]
        assert len(chosen) == len([d for d in every if not d.members])


@pytest.mark.parametrize(
    "resource, name",
    [
        ("nvidia.com/TU104GL_Tesla_T4", "tu104gl-tesla-t4.nvidia.com.vfio.dp.example.com"),
        ("nvidia.com/GRID_T4-1Q", "grid-t4-1q.nvidia.com.vfio.dp.example.com"),
        ("devices.kubevirt.io/10de_1eb8", "10de-1eb8.devices.kubevirt.io.vfio.dp.example.com"),
        ("example.com/a.b", "a.b.example.com.vfio.dp.example.com"),
    ],
)
def test_class_names(resource: str, name: str) -> None:
    assert device_class_name(resource, DRIVER) == name


@pytest.mark.parametrize("resource", ["example.com/a_.b", "example.com/" + "x" * 63 * 4])
def test_a_name_that_cannot_fold_into_a_subdomain_is_an_error_naming_it(resource: str) -> None:
    with pytest.raises(ValueError, match="cannot name a DeviceClass") as error:
        device_class_name(resource, DRIVER)
    assert resource in str(error.value)


CONFIG = f"""
dra:
  driverName: {DRIVER}
naming:
  source: vendor-device
permittedHostDevices:
  pciHostDevices:
    - pciVendorSelector: "10DE:1EB8"
      frontend: dra
    - pciVendorSelector: "10DE:10F8"
      resourceName: nvidia.com/TU104_HDA
    - pciVendorSelector: "144D:A808"
      resourceName: example.com/Nvme_A
      frontend: dra
    - pciVendorSelector: "144D:A809"
      resourceName: example.com/nvme-a
      frontend: dra
  mediatedDevices:
    - mdevNameSelector: "GRID T4-1Q"
      frontend: dra
"""


def test_names_of_entries_without_one_are_derived_as_the_plugin_derives_them() -> None:
    config = parse_config(CONFIG, "<test>")
    assert dra_resource_names(config) == (
        "devices.kubevirt.io/10de_1eb8",
        "example.com/Nvme_A",
        "example.com/nvme-a",
        "devices.kubevirt.io/GRID_T4-1Q",
    )
    named = parse_config(CONFIG.replace("vendor-device", "pci-ids"), "<test>")
    names = {PciId(0x10DE, 0x1EB8): "TU104GL [Tesla T4]"}
    assert dra_resource_names(named, names)[0] == "devices.kubevirt.io/TU104GL_TESLA_T4"


def test_two_resources_folding_to_one_class_name_are_refused_by_the_command(
    tmp_path: Path,
) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(CONFIG)
    result = command(config)
    assert result.returncode == 2
    assert "'example.com/Nvme_A' and 'example.com/nvme-a'" in result.stderr
    assert str(config) in result.stderr
    assert result.stdout == ""


def test_a_config_without_dra_has_no_class(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text("sharedDevices:\n  devices.kubevirt.io/kvm: {count: 10}\n")
    result = command(config)
    assert result.returncode == 2
    assert "no dra section" in result.stderr


def test_scan_says_who_serves_each_resource_and_the_class_dra_needs(tmp_path: Path) -> None:
    from dp_testing.topology import fixture_topology, write_sysfs

    sysfs, dev = write_sysfs(fixture_topology(), tmp_path / "host")
    config = tmp_path / "config.yaml"
    # The shipped config leaves /dev/kvm to virt-handler; served here, it is
    # the device plugin's, beside DRA's resources.
    kvm_off = "devices.kubevirt.io/kvm: {enabled: false}"
    assert kvm_off in deploy_config()
    config.write_text(deploy_config().replace(kvm_off, "devices.kubevirt.io/kvm: {enabled: true}"))
    result = subprocess.run(
        [sys.executable, "-m", "dp_server", "scan", "--format", "json"]
        + ["--sysfs", str(sysfs), "--dev", str(dev), "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    rows = {r["resource"]: r for r in json.loads(result.stdout)["frontends"]}
    assert rows["devices.kubevirt.io/kvm"] == {
        "resource": "devices.kubevirt.io/kvm",
        "frontend": "device-plugin",
    }
    shipped = {
        c["spec"]["extendedResourceName"]: c["metadata"]["name"]
        for c in yaml.safe_load_all(SHIPPED[0].read_text())
    }
    on_dra = {name: row["device_class"] for name, row in rows.items() if row["frontend"] == "dra"}
    # The fixture host has T4s and their audio functions, and no T4 vGPU.
    assert on_dra == {k: v for k, v in shipped.items() if k != "nvidia.com/GRID_T4-1Q"}
    table = subprocess.run(
        [sys.executable, "-m", "dp_server", "scan"]
        + ["--sysfs", str(sysfs), "--dev", str(dev), "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    ).stdout
    assert (
        "  nvidia.com/TU104GL_Tesla_T4: dra, DeviceClass "
        "tu104gl-tesla-t4.nvidia.com.vfio.dp.example.com"
    ) in table.splitlines()
