"""`dp-server demo`: a synthetic node served to a built-in kubelet emulator.

Everything runs in one command and leaves nothing behind: the fixture host
(fixtures/sysfs, from `dp_testing.topology`) is written to a temporary
directory, the emulator (grpcio, like a real kubelet's independent gRPC
stack) serves `kubelet.sock` there, and the real server runtime registers
every resource the config serves through one socket, exactly as `serve`
would. Nothing outside that directory is read or written.

The sample pods come from what the config serves. With a config that has a
`dra` section, the same runtime is also a DRA driver, served to the DRA
kubelet and API-server emulators (`demo_dra`); without `--config`, the DRA
half runs on its own built-in config.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import shutil
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import grpc

from dp_core import (
    DEFAULT_SHARED_DEVICES,
    BindDecision,
    Config,
    DeviceClass,
    DevicePluginFrontend,
    PciDevice,
    PciId,
    Resource,
    SocketMode,
    cdev_state,
    plan_bindings,
)
from dp_server.cli.demo_dra import DRA_DEMO_CONFIG, dra_lines
from dp_server.cli.demo_node import DemoError, Served, check_room, serving
from dp_server.cli.explain import explain
from dp_server.cli.report import explained_lines
from dp_server.cli.settings import pci_names
from dp_server.config.loader import (
    ConfigFile,
    ConfigFileError,
    parse_config_file,
    read_config_file,
)
from dp_server.deviceplugin.wiring import DevicePluginRuntime
from dp_server.host.scanner import scan_host
from dp_testing.topology import fixture_topology, write_sysfs

__all__ = ["DEMO_CONFIG", "DemoError", "device_plugin_lines", "run_demo"]

# What the tests serve the fixture node with (tests/e2e_harness.py).
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

# What `dp-server demo` serves without --config: the same, and the T4s'
# audio functions, which share each GPU's IOMMU group.
_BUILT_IN = DEMO_CONFIG.replace(
    '    - pciVendorSelector: "8086:4941"',
    '    - pciVendorSelector: "10DE:10F8"\n'
    '      resourceName: "nvidia.com/TU104_HD_Audio"\n'
    '    - pciVendorSelector: "8086:4941"',
)

_DEFAULT_COUNT = {d.resource_name: d.count for d in DEFAULT_SHARED_DEVICES}


# --- the device-plugin half ------------------------------------------------------------


def _columns(rows: Iterable[tuple[str, object]], indent: str = "  ") -> list[str]:
    rows = list(rows)
    width = max((len(name) for name, _ in rows), default=0)
    return [f"{indent}{name + ':':<{width + 1}}  {value}" for name, value in rows]


def _node_description(served: Served, config: Config) -> list[str]:
    capacity = served.kubelet.capacity()
    lines = ["Capacity:", *_columns(sorted(capacity.items())), "Allocatable:"]
    lines += _columns(sorted(served.kubelet.allocatable().items()))
    for shared in config.enabled_shared_devices:
        default = _DEFAULT_COUNT.get(shared.resource_name, 110)
        if shared.resource_name in capacity and shared.count != default:
            lines.append(
                f"  ({shared.resource_name} is {shared.count}: the config's sharedDevices "
                f"count; the default is {default})"
            )
    return lines


def _unhealthy_lines(resources: Sequence[Resource]) -> list[str]:
    lines = []
    for resource in resources:
        unhealthy = [d for d in resource.devices if not d.healthy]
        if resource.device_class.alike and unhealthy:
            first = unhealthy[0]
            lines.append(f"  {resource.name}: {len(unhealthy)} devices: {first.reason}")
            continue
        lines += [f"  {resource.name} {d.id}: {d.reason}" for d in unhealthy]
    return ["", "Unhealthy devices, and why:", *lines] if lines else []


def _pod_name(resource: str) -> str:
    return "vm-" + re.sub(r"[^a-z0-9]+", "-", resource.rsplit("/", 1)[-1].lower()).strip("-")


def _allocation_lines(
    responses: dict[str, Any],
    served: Served,
    classes: dict[str, DeviceClass],
    no_cdev: dict[str, list[str]],
) -> list[str]:
    """A sample's answer; the devices without a VFIO character device go to
    `no_cdev` by reason, said once after every sample."""
    snapshot = served.runtime.node.snapshot
    interface = served.runtime.config.vfio.interface
    lines = []
    for resource, response in sorted(responses.items()):
        lines.append(f"    {resource}")
        for key, value in sorted(response.envs.items()):
            lines.append(f"      env     {key}={value}")
        for spec in response.devices:
            lines.append(f"      device  {spec.host_path} ({spec.permissions})")
        device_class = classes.get(resource)
        host_device = device_class.host_device if device_class is not None else None
        if host_device is None or interface == "group":
            continue
        for device_id in _env_ids(response):
            found = host_device(device_id, snapshot)
            state = None if found is None else cdev_state(found, snapshot)
            if state is not None and state.path is None and state.reason:
                no_cdev.setdefault(state.reason, []).append(device_id)
    return lines


def _no_cdev_lines(no_cdev: dict[str, list[str]]) -> list[str]:
    return [
        f"  (no VFIO character device for {', '.join(devices)}: {reason})"
        for reason, devices in no_cdev.items()
    ]


def _env_ids(response: Any) -> list[str]:
    return [i for v in response.envs.values() for i in v.split(",") if i]


def _until_unhealthy(served: Served, devices: Iterable[tuple[str, str]]) -> None:
    """Wait until the kubelet lists `devices` Unhealthy: a reservation reaches it
    as a ListAndWatch update, after the Allocate that made it."""
    wanted = list(devices)
    served.kubelet.wait_for(
        lambda e: all(not e.resources()[name].devices[id_].healthy for name, id_ in wanted),
        5.0,
    )


def _group_siblings(served: Served, responses: dict[str, Any]) -> list[tuple[str, str]]:
    """The other advertised members of the IOMMU groups an admitted container holds."""
    chosen = {(name, i) for name, response in responses.items() for i in _env_ids(response)}
    published = served.runtime.node.frontend(DevicePluginFrontend).describe().resources
    held = {d.iommu_group for r in published for d in r.devices if (r.name, d.id) in chosen}
    return [
        (r.name, d.id)
        for r in published
        for d in r.devices
        if d.iommu_group is not None and d.iommu_group in held and (r.name, d.id) not in chosen
    ]


def _samples(served: Served, resources: Sequence[Resource]) -> tuple[list[str], list[str]]:
    """One sample pod per device resource and one for the shared devices, each
    admitted as the kubelet admits it; the lines, and the pods admitted."""
    classes = {r.name: r.device_class for r in resources}
    snapshot = served.runtime.node.snapshot
    pods: list[tuple[str, str, dict[str, int]]] = []
    for resource in resources:
        healthy = resource.healthy_count
        device_class = resource.device_class
        if device_class.alike or not healthy:
            continue
        title = device_class.title
        count = 1
        host_device = device_class.host_device
        first = host_device(resource.devices[0].id, snapshot) if host_device else None
        if isinstance(first, PciDevice) and first.physfn is not None:
            title, count = "SR-IOV virtual functions", min(2, healthy)
        pods.append((title, _pod_name(resource.name), {resource.name: count}))
    alike = [r for r in resources if r.device_class.alike and r.healthy_count]
    if alike:
        shared = {r.name: 1 for r in alike}
        pods.append((alike[0].device_class.title, "vm-plain", shared))
    lines = ["", "Sample allocations (GetPreferredAllocation, then Allocate):"]
    admitted = []
    no_cdev: dict[str, list[str]] = {}
    for title, pod, requests in pods:
        lines.append(f"  {title}: pod {pod}")
        try:
            responses = served.kubelet.admit(pod, "compute", requests)
        except grpc.RpcError as error:
            lines.append(f"    refused: {error.code().name}: {error.details()}")
            continue
        admitted.append(pod)
        lines += _allocation_lines(responses, served, classes, no_cdev)
        # The next pod is admitted on the kubelet's view of what is still free.
        _until_unhealthy(served, _group_siblings(served, responses))
    return lines + _no_cdev_lines(no_cdev), admitted


def _held_group_lines(served: Served) -> list[str]:
    """For each IOMMU group a sample pod holds, its other members: Unhealthy, and refused."""
    held: dict[int, tuple[str, str]] = {}  # group -> (pod, device)
    taken: set[tuple[str, str]] = set()
    published = served.runtime.node.frontend(DevicePluginFrontend).describe().resources
    groups = {
        (r.name, d.id): d.iommu_group
        for r in published
        for d in r.devices
        if d.iommu_group is not None
    }
    for admitted in served.kubelet.pods().values():
        for container in admitted.containers.values():
            for resource, devices in container.devices.items():
                for device in devices:
                    taken.add((resource, device.id))
                    group = groups.get((resource, device.id))
                    if group is not None:
                        held.setdefault(group, (admitted.name, device.id))
    siblings = [
        (device.iommu_group, resource.name, device.id)
        for resource in published
        for device in resource.devices
        if device.iommu_group in held and (resource.name, device.id) not in taken
    ]
    if not siblings:
        return []
    lines = ["", "IOMMU groups are handed out whole: the other members of a held group:"]
    _until_unhealthy(served, [(name, device_id) for _, name, device_id in siblings])
    for group, name, device_id in siblings:
        pod, holder = held[group]
        health = served.kubelet.resources()[name].devices[device_id].health
        lines.append(f"  {device_id} ({name}), group {group} with {holder} of {pod}: {health}")
        try:
            served.kubelet.allocate(name, [device_id])
            lines.append(f"    Allocate({device_id}) was accepted (unexpected)")
        except grpc.RpcError as error:
            lines.append(f"    Allocate({device_id}) -> {error.code().name}: {error.details()}")
    return lines


def device_plugin_lines(
    served: Served, config: Config, plan: Mapping[Any, BindDecision] | None = None
) -> list[str]:
    """What the device-plugin half shows: the node, unhealthy devices, sample pods.

    `plan`: what the config's binding section would have serve move, which
    the demo served without (no kernel moves anything under its host)."""
    resources = [
        r
        for r in served.runtime.node.frontend(DevicePluginFrontend).describe().resources
        if r.name in served.kubelet.capacity()
    ]
    if not resources:
        return ["The config serves nothing on this node through the device-plugin API."]
    sockets = sorted(p.name for p in served.runtime.frontend(DevicePluginRuntime).socket_paths)
    lines = [
        f"{len(resources)} resources registered with the emulated kubelet (its kubelet.sock) "
        f"through dp's {'socket' if len(sockets) == 1 else f'{len(sockets)} sockets'} "
        f"{', '.join(sockets)}",
        "",
    ]
    lines += _node_description(served, config)
    lines += _unhealthy_lines(resources)
    skipped = served.runtime.node.frontend(DevicePluginFrontend).describe().skipped
    if skipped:
        lines += ["", "Selected but not advertised, and why:"]
        moves = {str(d.address): d for d in (plan or {}).values()}
        lines += [f"  {s.id} ({s.resource_name}): {_skip_reason(s, moves)}" for s in skipped]
    samples, _ = _samples(served, resources)
    lines += samples
    lines += _held_group_lines(served)
    return lines


# --- the whole demo ----------------------------------------------------------------------


async def _demo(
    loaded: ConfigFile | None, socket_mode: SocketMode, names: dict[PciId, str]
) -> list[str]:
    config = loaded.config if loaded is not None else parse_config_file(_BUILT_IN).config
    dra_config = config if loaded is not None else parse_config_file(DRA_DEMO_CONFIG).config
    workdir = Path(tempfile.mkdtemp(prefix="dp-demo-"))
    try:
        check_room(workdir / "n", (config, dra_config))
        sysfs, dev = write_sysfs(fixture_topology(), workdir / "host")
        lines = [
            "dp-server demo: a synthetic node (the fixture host of fixtures/sysfs: T4 GPUs with",
            "their audio functions, QAT virtual functions, two NVMe drives in one IOMMU group,",
            "vGPUs), written to a temporary directory and served to emulated kubelets.",
            "Nothing on this machine is read or changed.",
            "",
        ]
        plan: Mapping[Any, BindDecision] | None = None
        if loaded is not None:
            shared = [d.path for d in config.enabled_shared_devices]
            snapshot = scan_host(sysfs, dev, dev_paths=shared)
            lines += explained_lines(explain(loaded, snapshot, str(sysfs))) + [""]
            if config.binding is not None:
                plan = plan_bindings(snapshot, config)
                lines += _binding_lines(plan)
                # No kernel under the synthetic sysfs moves a device.
                config = attrs.evolve(config, binding=None)
        root = workdir / "n"
        root.mkdir()
        async with serving(config, root, sysfs, dev, socket_mode, names) as served:
            lines += await asyncio.to_thread(device_plugin_lines, served, config, plan)
            if config.dra is not None:
                lines += await dra_lines(served, config)
        if loaded is None:
            root = workdir / "d"
            root.mkdir()
            async with serving(dra_config, root, sysfs, dev) as served:
                lines += await dra_lines(served, dra_config)
        elif config.dra is None:
            lines += ["", "The DRA front end: the config has no dra section, so it is off."]
        lines += ["", "Done; the temporary directory is removed."]
        return lines
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _skip_reason(skipped: Any, moves: Mapping[str, BindDecision]) -> str:
    """Why a device is not advertised, as serve would say it: the demo served
    without binding, so the core's reason says no policy moves it."""
    decision = moves.get(skipped.id)
    if decision is None:
        return str(skipped.reason)
    held = str(skipped.reason).split("; ", 1)[0]  # "bound to host driver i40e"
    if decision.binds:
        return f"{held}; serve would move it to vfio-pci (the demo moves nothing)"
    return f"{held}; not moved to vfio-pci: {decision.refusal}"


def _binding_lines(plan: Mapping[Any, BindDecision]) -> list[str]:
    return [
        "The config's binding section has serve move devices to vfio-pci; no kernel moves",
        "anything under the synthetic host, so the demo serves what is on vfio-pci already.",
        "serve would move:",
        *[f"  {d.address} from {d.driver or 'no driver'}" for d in plan.values() if d.binds],
        "and would not move:",
        *[f"  {d.address}: {d.refusal}" for d in plan.values() if not d.binds],
        "",
    ]


def run_demo(args: argparse.Namespace) -> int:
    if args.config is None and args.kubevirt_resources is not None:
        raise ConfigFileError(["--kubevirt-resources needs a KubeVirt CR as --config"])
    loaded = read_config_file(args.config, args.kubevirt_resources) if args.config else None
    names: dict[PciId, str] = {}
    if loaded is not None:
        names, missing = pci_names(loaded.config)
        if missing is not None:
            loaded = attrs.evolve(loaded, notes=(*loaded.notes, missing))
    for line in asyncio.run(_demo(loaded, SocketMode(args.socket_mode), names)):
        print(line)
    return 0
