"""Driving dp_core from your own shell: one GPU, one kubelet, one Allocate.

dp_core does no I/O. You tell it what happened (inputs, each with the time)
and it tells you what to do (effects). The node coordinates its front ends
(here the device-plugin one, `node.device_plugin`) over one ledger of IOMMU
groups (`node.ledger`). This script plays both the host and
the kubelet by hand, so every step is visible; `dp_server` does the same with
sysfs, sockets and grpclib. Run it: `python examples/plugin_author.py`.
See docs/core.md for what each input and effect means.
"""

from __future__ import annotations

from dp_core import (
    AllocateAnswer,
    AllocateRequested,
    AttributeConnection,
    Config,
    ConnectionOpened,
    Effect,
    HostObserved,
    HostSnapshot,
    IommuGroup,
    KubeletStarted,
    Log,
    OptionsRequested,
    PciAddress,
    PciDevice,
    PciHostDevice,
    PciId,
    PermittedHostDevices,
    Publish,
    Register,
    RegistrationSucceeded,
    Reject,
    Reply,
    SharedDevice,
    StandardNode,
    WatchStarted,
    collect,
)

T4 = PciId(0x10DE, 0x1EB8)
RESOURCE = "nvidia.com/TU104GL_Tesla_T4"


def show(step: str, effects: list[Effect]) -> None:
    print(f"{step}:")
    for effect in effects:
        if isinstance(effect, Publish):
            healthy = sum(d.healthy for d in effect.devices)
            shown = ", ".join(d.id for d in effect.devices[:3])
            more = ", ..." if len(effect.devices) > 3 else ""
            print(
                f"  Publish on stream {effect.stream} for {effect.resource}: "
                f"{len(effect.devices)} devices ({shown}{more}), {healthy} Healthy"
            )
        elif isinstance(effect, Log):
            print(f"  Log {effect.level} {effect.event} {dict(effect.fields)}")
        else:
            print(f"  {effect!r}")


def main() -> None:
    # 1. What the host looks like. A real shell reads this from sysfs and /dev
    #    (dp_server.host.scanner.scan_host does); here it is written out.
    gpu = PciDevice(
        address=PciAddress.parse("0000:3b:00.0"),
        vendor=T4.vendor,
        device=T4.device,
        class_code=0x030200,
        driver="vfio-pci",
        iommu_group=10,
        numa_node=0,
    )
    host = HostSnapshot(
        pci_devices=[gpu],
        iommu_groups=[IommuGroup(10, [gpu])],
        dev_nodes=frozenset({"/dev/vfio/vfio", "/dev/vfio/10", "/dev/kvm"}),
    )
    # 2. What to serve: the T4 by name, and /dev/kvm to any number of pods.
    config = Config(
        permitted_host_devices=PermittedHostDevices(
            pci_host_devices=(PciHostDevice(T4, RESOURCE),)
        ),
        shared_devices=(SharedDevice("devices.kubevirt.io/kvm", "/dev/kvm"),),
    )
    node = StandardNode(config)
    now = 0.0

    show("host observed", node.handle(HostObserved(host, now)))

    # 3. The kubelet's socket appeared. In single-socket mode the node asks to
    #    register one resource at a time; carry out each Register effect.
    effects = node.handle(KubeletStarted(now))
    show("kubelet started", effects)
    connection = gpu_connection = 0
    while registers := [e for e in effects if isinstance(e, Register)]:
        (register,) = registers
        # A modern kubelet dials the endpoint and asks for options while its
        # Register call is still in flight: that is how the connection is
        # attributed to the resource.
        connection += 1
        call = connection * 100
        effects = node.handle(ConnectionOpened(connection, now))
        effects += node.handle(OptionsRequested(connection, call, now))
        assert any(isinstance(e, AttributeConnection) for e in effects)
        assert any(isinstance(e, Reply) and e.call == call for e in effects)
        effects += node.handle(RegistrationSucceeded(register.resource, register.attempt, now))
        effects += node.handle(WatchStarted(connection, stream=connection, now=now))
        show(f"registered {register.resource} on connection {connection}", effects)
        if register.resource == RESOURCE:
            gpu_connection = connection

    # 4. A pod asks for the GPU: answer the kubelet with the Reply's answer.
    now += 1.0
    effects = node.handle(AllocateRequested(gpu_connection, 9001, [["0000:3b:00.0"]], now))
    show("Allocate 0000:3b:00.0", effects)
    (reply,) = [e for e in effects if isinstance(e, Reply)]
    assert isinstance(reply.answer, AllocateAnswer)
    (container,) = reply.answer.containers
    print("  devices:", ", ".join(spec.host_path for spec in container.devices))
    print("  env:", dict(container.envs))

    # 5. An ID the resource never advertised is refused, not crashed on.
    effects = node.handle(AllocateRequested(gpu_connection, 9002, [["0000:00:00.0"]], now))
    (reject,) = [e for e in effects if isinstance(e, Reject)]
    print(f"Allocate 0000:00:00.0: {reject.status.name}: {reject.message}")

    # 6. The GPU's IOMMU group is held now, in the node's one ledger, by the
    #    allocation the device-plugin front end made; either front end would
    #    refuse a device of that group to anyone else.
    holder = node.ledger.holder(10)
    print("IOMMU group 10 is held by", holder.describe() if holder else "nobody")
    (published,) = node.device_plugin.advertised(RESOURCE)
    print(f"  {RESOURCE} publishes {published.id}: {published.health}")

    # 7. What monitoring would see.
    for family in collect(node):
        if family.name in ("dp_resource_allocated_devices", "dp_rpcs_total"):
            for sample in family.samples:
                print(f"  {family.name}{dict(sample.labels)} = {sample.value}")


if __name__ == "__main__":
    main()
