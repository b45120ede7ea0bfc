"""`dp-server demo`: the fixture node served to a built-in kubelet emulator.

Everything runs in one command and leaves nothing behind: the fixture host is
written to a temporary directory, the emulator (grpcio, like a real kubelet's
independent gRPC stack) serves `kubelet.sock` there, and the real server runtime
registers every resource through one socket, exactly as `serve` would.

Then the DRA path (`demo_dra`): the same node with its GPUs and NVMe pair
offered through DRA, served to the DRA kubelet emulator and the API-server
emulator.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import grpc

from dp_core import Config, SocketMode
from dp_server.cli.demo_dra import demo_dra
from dp_server.config.loader import load_config, parse_config
from dp_server.runtime.runtime import Runtime, Settings
from dp_testing.emulator import KubeletEmulator
from dp_testing.topology import fixture_topology, write_sysfs

__all__ = ["DEMO_CONFIG", "run_demo"]

DEMO_CONFIG = """
permittedHostDevices:
  pciHostDevices:
    - pciVendorSelector: "10DE:1EB8"
      resourceName: "nvidia.com/TU104GL_Tesla_T4"
    - pciVendorSelector: "8086:4941"
      resourceName: "intel.com/qat_vf"
    - pciVendorSelector: "144D:A808"
      resourceName: "devices.kubevirt.io/nvme"
  mediatedDevices:
    - mdevNameSelector: "GRID RTX6000-4Q"
      resourceName: "nvidia.com/GRID_RTX6000-4Q"
sharedDevices:
  devices.kubevirt.io/kvm: {count: 1000}
"""

# One sample container per class of device, in the order they are shown.
_SAMPLES: tuple[tuple[str, str, dict[str, int]], ...] = (
    ("PCI passthrough (GPU)", "vm-gpu", {"nvidia.com/TU104GL_Tesla_T4": 1}),
    ("SR-IOV virtual function (QAT)", "vm-qat", {"intel.com/qat_vf": 2}),
    ("mediated device (vGPU)", "vm-vgpu", {"nvidia.com/GRID_RTX6000-4Q": 1}),
    (
        "shared character devices",
        "vm-plain",
        {
            "devices.kubevirt.io/kvm": 1,
            "devices.kubevirt.io/tun": 1,
            "devices.kubevirt.io/vhost-net": 1,
        },
    ),
    ("IOMMU group shared by two NVMe drives", "vm-nvme", {"devices.kubevirt.io/nvme": 1}),
)


def _columns(rows: Iterable[tuple[str, int]], indent: str = "  ") -> list[str]:
    rows = list(rows)
    width = max((len(name) for name, _ in rows), default=0)
    return [f"{indent}{name + ':':<{width + 1}}  {value}" for name, value in rows]


def _node_description(emulator: KubeletEmulator) -> list[str]:
    capacity = emulator.capacity()
    allocatable = emulator.allocatable()
    lines = ["Capacity:"]
    lines += _columns(sorted(capacity.items()))
    lines.append("Allocatable:")
    lines += _columns(sorted(allocatable.items()))
    return lines


def _allocation_lines(responses: dict[str, Any]) -> list[str]:
    lines = []
    for resource, response in sorted(responses.items()):
        lines.append(f"    {resource}")
        for key, value in sorted(response.envs.items()):
            lines.append(f"      env     {key}={value}")
        for spec in response.devices:
            lines.append(f"      device  {spec.host_path} ({spec.permissions})")
    return lines


def _unhealthy_count(emulator: KubeletEmulator, resource: str) -> int:
    state = emulator.resources().get(resource)
    return 0 if state is None else sum(1 for d in state.devices.values() if not d.healthy)


def _unhealthy_lines(runtime: Runtime) -> list[str]:
    lines = ["", "Unhealthy devices, and why:"]
    for resource in runtime.node.describe().resources:
        for device in resource.devices:
            if not device.healthy:
                lines.append(f"  {resource.name} {device.id}: {device.reason}")
    return lines if len(lines) > 2 else []


def _samples(emulator: KubeletEmulator) -> list[str]:
    lines = ["", "Sample allocations (GetPreferredAllocation, then Allocate):"]
    for title, pod, requests in _SAMPLES:
        lines.append(f"  {title}: pod {pod}")
        try:
            lines += _allocation_lines(emulator.admit(pod, "compute", requests))
        except grpc.RpcError as error:
            lines.append(f"    refused: {error.code().name}: {error.details()}")
    # The reservation reaches the kubelet as a ListAndWatch update; wait for it.
    emulator.wait_for(lambda e: _unhealthy_count(e, "devices.kubevirt.io/nvme") > 0, 5.0)
    nvme = emulator.resources().get("devices.kubevirt.io/nvme")
    if nvme is not None:
        lines.append("  the sibling NVMe drive while vm-nvme holds its IOMMU group:")
        for device in sorted(nvme.devices.values(), key=lambda d: d.id):
            lines.append(f"    {device.id}  {device.health}")
        held = {d.id for d in nvme.devices.values() if not d.healthy}
        for device_id in sorted(held):
            try:
                emulator.allocate("devices.kubevirt.io/nvme", [device_id])
                lines.append(f"    Allocate({device_id}) was accepted (unexpected)")
            except grpc.RpcError as error:
                lines.append(f"    Allocate({device_id}) -> {error.code().name}: {error.details()}")
    return lines


async def _demo(config: Config, socket_mode: SocketMode) -> list[str]:
    workdir = Path(tempfile.mkdtemp(prefix="dp-demo-"))
    try:
        sysfs, dev = write_sysfs(fixture_topology(), workdir / "host")
        plugin_dir = workdir / "device-plugins"
        emulator = KubeletEmulator(plugin_dir, pod_resources_socket=workdir / "pod-resources.sock")
        await asyncio.to_thread(emulator.start)
        settings = Settings(
            sysfs=str(sysfs),
            dev=str(dev),
            device_plugin_dir=str(plugin_dir),
            pod_resources_socket=str(workdir / "pod-resources.sock"),
            socket_mode=socket_mode,
        )
        runtime = Runtime(settings, config)
        serving = asyncio.create_task(runtime.run())
        try:
            await runtime.ready.wait()
            names = runtime.node.resource_names()
            registered = await asyncio.to_thread(emulator.wait_registered, names, 10.0, listed=True)
            if not registered:
                raise RuntimeError("the emulated kubelet did not see every resource register")
            sockets = sorted(p.name for p in plugin_dir.iterdir() if p.is_socket())
            lines = [
                f"dp-server demo: the fixture node, {len(names)} resources registered through "
                f"{len(runtime.socket_paths)} socket(s) ({', '.join(sockets)})",
                "",
            ]
            lines += _node_description(emulator)
            lines += _unhealthy_lines(runtime)
            lines += await asyncio.to_thread(_samples, emulator)
        finally:
            runtime.stop()
            await serving
            await asyncio.to_thread(emulator.stop)
        lines += await demo_dra(workdir, sysfs, dev)
        return lines
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def run_demo(args: argparse.Namespace) -> int:
    config = load_config(args.config) if args.config else parse_config(DEMO_CONFIG, "<demo>")
    for line in asyncio.run(_demo(config, SocketMode(args.socket_mode))):
        print(line)
    return 0
