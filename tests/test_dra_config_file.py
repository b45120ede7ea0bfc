"""The DRA keys of the config file: `dra.driverName` and `frontend` per entry."""

from __future__ import annotations

import textwrap

import pytest

from dp_core import PciId
from dp_core.config import Dra
from dp_server.config.loader import ConfigFileError, parse_config

GOOD = """\
dra:
  driverName: vfio.dp.example.com
permittedHostDevices:
  pciHostDevices:
    - pciVendorSelector: "10DE:1EB8"
      resourceName: nvidia.com/TU104GL_Tesla_T4
      frontend: dra
    - pciVendorSelector: "8086:4941"
  mediatedDevices:
    - mdevNameSelector: "GRID T4-1Q"
      resourceName: nvidia.com/GRID_T4-1Q
      frontend: dra
"""


def test_the_issue_example_parses() -> None:
    config = parse_config(GOOD, "test.yaml")
    assert config.dra == Dra("vfio.dp.example.com")
    assert config.permitted_host_devices is not None
    pci = {
        e.pci_vendor_selector: e.frontend for e in config.permitted_host_devices.pci_host_devices
    }
    assert pci == {PciId(0x10DE, 0x1EB8): "dra", PciId(0x8086, 0x4941): "device-plugin"}
    assert config.permitted_host_devices.mediated_devices[0].frontend == "dra"


@pytest.mark.parametrize(
    ("text", "line"),
    [
        (
            "dra: {driverName: Not_A_Domain}\n",
            "test.yaml: dra.driverName: 'Not_A_Domain' is not a DNS subdomain",
        ),
        ("dra: {driverName: 7}\n", "test.yaml: dra.driverName: 7 is not a string"),
        (
            "dra: {driverName: a.example.com}\n"
            "permittedHostDevices: {pciHostDevices: [{pciVendorSelector: '10DE:1EB8', "
            "frontend: gpu}]}\n",
            "test.yaml: permittedHostDevices.pciHostDevices[0].frontend: 'gpu' is not one of "
            "'device-plugin', 'dra'",
        ),
        (
            "permittedHostDevices: {mediatedDevices: [{mdevNameSelector: x, frontend: dra}]}\n",
            "test.yaml: (document): permittedHostDevices.mediatedDevices[0].frontend is dra, "
            "which needs the dra section with its driverName",
        ),
    ],
)
def test_bad_dra_config_names_the_field(text: str, line: str) -> None:
    with pytest.raises(ConfigFileError) as info:
        parse_config(textwrap.dedent(text), "test.yaml")
    problems = list(info.value.problems)
    assert len(problems) == 1, problems
    assert problems[0].startswith(line), problems[0]


@pytest.mark.parametrize(
    ("text", "partitionable", "taints"),
    [
        ("dra: {driverName: a.example.com}\n", "auto", "auto"),
        (
            "dra: {driverName: a.example.com, partitionableDevices: false, deviceTaints: true}\n",
            False,
            True,
        ),
        (
            "dra: {driverName: a.example.com, partitionableDevices: auto, deviceTaints: auto}\n",
            "auto",
            "auto",
        ),
    ],
)
def test_dra_feature_overrides(text: str, partitionable: object, taints: object) -> None:
    dra = parse_config(text, "test.yaml").dra
    assert dra is not None
    assert (dra.partitionable_devices, dra.device_taints) == (partitionable, taints)


@pytest.mark.parametrize(
    ("text", "line"),
    [
        (
            "dra: {driverName: a.example.com, partitionableDevices: 'true'}\n",
            "test.yaml: dra.partitionableDevices: 'true' is not auto, true or false",
        ),
        (
            "dra: {driverName: a.example.com, deviceTaints: 1}\n",
            "test.yaml: dra.deviceTaints: 1 is not auto, true or false",
        ),
        (
            "dra: {driverName: a.example.com, deviceTaints: Auto}\n",
            "test.yaml: dra.deviceTaints: 'Auto' is not auto, true or false",
        ),
    ],
)
def test_bad_dra_feature_override_names_the_field(text: str, line: str) -> None:
    with pytest.raises(ConfigFileError) as info:
        parse_config(text, "test.yaml")
    problems = list(info.value.problems)
    assert len(problems) == 1, problems
    assert problems[0].startswith(line), problems[0]
