"""VFIO character devices through the real runtime and the grpcio kubelet emulator (issue 19)."""

from __future__ import annotations

from typing import Any

import attrs

from dp_core import Vfio
from dp_server.cli.demo import DEMO_CONFIG
from dp_server.config.loader import parse_config

from e2e_harness import QAT, Harness


def device_paths(response: Any) -> list[tuple[str, str, str]]:
    return [(d.host_path, d.container_path, d.permissions) for d in response.devices]


async def test_allocate_returns_the_vfio_character_device(harness: Harness) -> None:
    await harness.serve()
    # 0000:6b:00.1 has vfio-dev/vfio0 with `dev` and /dev/vfio/devices/vfio0.
    response = await harness.kubelet("allocate", QAT, ["0000:6b:00.1", "0000:6b:00.2"])
    assert response.envs["PCI_RESOURCE_INTEL_COM_QAT_VF"] == "0000:6b:00.1,0000:6b:00.2"
    # 0000:6b:00.2's vfio1 has no node: it gets the group interface only.
    assert device_paths(response) == [
        ("/dev/vfio/vfio", "/dev/vfio/vfio", "mrw"),
        ("/dev/vfio/108", "/dev/vfio/108", "mrw"),
        ("/dev/vfio/devices/vfio0", "/dev/vfio/devices/vfio0", "mrw"),
        ("/dev/vfio/109", "/dev/vfio/109", "mrw"),
    ]


async def test_iommufd_interface_serves_only_functions_with_a_character_device(
    harness: Harness,
) -> None:
    config = attrs.evolve(parse_config(DEMO_CONFIG, "<demo>"), vfio=Vfio("iommufd"))
    emulator = (await harness.serve(config=config), harness.emulator)[1]
    assert emulator is not None
    health = {i: device.health for i, device in emulator.resources()[QAT].devices.items()}
    assert health == {
        "0000:6b:00.1": "Healthy",
        "0000:6b:00.2": "Unhealthy",  # vfio1 has no node
        "0000:6b:00.3": "Unhealthy",  # vfio2 has no `dev`
        "0000:6b:00.4": "Unhealthy",  # no vfio-dev at all
    }
    response = await harness.kubelet("allocate", QAT, ["0000:6b:00.1"])
    assert device_paths(response) == [
        ("/dev/iommu", "/dev/iommu", "mrw"),
        ("/dev/vfio/devices/vfio0", "/dev/vfio/devices/vfio0", "mrw"),
    ]
