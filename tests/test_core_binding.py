"""Binding (docs/design.md §6): which selected devices the core moves to vfio-pci, and why not.

Tables of host + config -> decisions, the Node's BindDevice / BindingFinished
cycle, and properties over generated hosts: nothing outside the config's
selection is ever bound, and nothing is bound that could not end up usable.
"""

from __future__ import annotations

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dp_core import (
    VFIO_DRIVER,
    AllocationsObserved,
    BindDevice,
    Binding,
    BindingBook,
    BindingFinished,
    Config,
    ConfigApplied,
    ConfigError,
    HostObserved,
    HostSnapshot,
    KubeletStarted,
    Log,
    Move,
    MovesChanged,
    MovesRecalled,
    PciAddress,
    PciDevice,
    PciHostDevice,
    PciId,
    PermittedHostDevices,
    RefreshAllocations,
    Reject,
    Reply,
    StandardNode,
    UnbindDevice,
    UnbindingFinished,
    UsageError,
    WriteDecided,
    WriteDue,
    build_inventory,
    plan_bindings,
)

from core_builders import (
    AUDIO,
    GPU,
    Kubelet,
    configs,
    effects_of,
    host_snapshots,
    live_node,
    one,
    pci,
    snapshot,
    started_node,
)

NIC = PciId(0x8086, 0x1572)
VGA = PciId(0x1A03, 0x2000)
LOADED = frozenset({VFIO_DRIVER, "i40e", "nouveau", "snd_hda_intel", "ast", "4xxx"})


def a(text: str) -> PciAddress:
    return PciAddress.parse(text)


def host(devices: list[PciDevice], drivers: frozenset[str] | None = LOADED) -> HostSnapshot:
    return attrs.evolve(snapshot(devices), pci_drivers=drivers)


def config(*ids: PciId, drivers: tuple[str, ...] = (), unbound: bool = False) -> Config:
    return Config(
        PermittedHostDevices(tuple(PciHostDevice(pci_id) for pci_id in ids)),
        shared_devices=(),
        binding=Binding(drivers, unbound),
    )


def nic(
    address: str = "0000:18:00.0", driver: str | None = "i40e", group: int | None = 18
) -> PciDevice:
    return pci(address, NIC, group, driver=driver, class_code=0x020000)


def refusal(plan: dict[PciAddress, object], address: str) -> str:
    decision = plan[a(address)]
    return decision.refusal  # type: ignore[attr-defined, no-any-return]


# ---------------------------------------------------------------------------
# One device, one rule at a time

NIC_CONFIG = config(NIC, drivers=("i40e",))

REFUSALS = [
    # (why, host, config, expected refusal substring; "" = it is bound)
    ("listed driver", host([nic()]), NIC_CONFIG, ""),
    ("driver not listed", host([nic(driver="ixgbe")]), NIC_CONFIG, "does not list ixgbe"),
    (
        "boot display",
        host([attrs.evolve(pci("0000:03:00.0", VGA, 3, driver="ast"), boot_vga=True)]),
        config(VGA, drivers=("ast",)),
        "boot display",
    ),
    ("no IOMMU group", host([nic(group=None)]), NIC_CONFIG, "no IOMMU group"),
    (
        "physical function with VFs",
        host([attrs.evolve(nic(), virtfns=(a("0000:18:02.0"), a("0000:18:02.1")))]),
        NIC_CONFIG,
        "2 virtual functions enabled",
    ),
    (
        "VFs the kernel counts, links not seen",
        host([attrs.evolve(nic(), sriov_numvfs=3)]),
        NIC_CONFIG,
        "3 virtual functions enabled",
    ),
    (
        "VFs unknown",
        host([attrs.evolve(nic(), sriov_numvfs=None)]),
        NIC_CONFIG,
        "virtual functions could not be read",
    ),
    ("vfio-pci not loaded", host([nic()], frozenset({"i40e"})), NIC_CONFIG, "modprobe vfio-pci"),
    ("driver list unreadable", host([nic()], None), NIC_CONFIG, "could not be read"),
    ("no driver, bindUnbound", host([nic(driver=None)]), config(NIC, unbound=True), ""),
]


@pytest.mark.parametrize(
    ("host_", "config_", "expected"),
    [case[1:] for case in REFUSALS],
    ids=[case[0] for case in REFUSALS],
)
def test_each_rule(host_: HostSnapshot, config_: Config, expected: str) -> None:
    plan = plan_bindings(host_, config_)
    address = str(host_.pci_devices[0].address)
    if expected:
        assert expected in refusal(plan, address)
    else:
        assert plan[a(address)].binds


def test_nothing_is_considered_without_a_binding_section() -> None:
    unbound = Config(PermittedHostDevices((PciHostDevice(NIC),)), shared_devices=())
    assert plan_bindings(host([nic()]), unbound) == {}


@pytest.mark.parametrize(
    "device",
    [
        nic(driver=VFIO_DRIVER),  # already there
        nic(driver=None),  # no driver, and bindUnbound is off
        pci("0000:19:00.0", GPU, 19, driver="nouveau"),  # no selector names it
        pci("0000:5d:00.0", NIC, 93, driver="pcieport", class_code=0x060400),  # a bridge
    ],
    ids=["on vfio-pci", "unbound", "unselected", "bridge"],
)
def test_devices_binding_does_not_look_at(device: PciDevice) -> None:
    assert plan_bindings(host([device]), config(NIC, drivers=("i40e", "pcieport"))) == {}


def test_a_device_virt_handler_serves_is_left_to_it() -> None:
    theirs = Config(
        PermittedHostDevices((PciHostDevice(NIC, external_resource_provider=False),)),
        shared_devices=(),
        binding=Binding(("i40e",)),
    )
    assert plan_bindings(host([nic()]), theirs) == {}
    # Left by virt-handler to an outside plugin: dp's, to move.
    ours = attrs.evolve(
        theirs, permitted_host_devices=PermittedHostDevices((PciHostDevice(NIC, None, True),))
    )
    assert [d.binds for d in plan_bindings(host([nic()]), ours).values()] == [True]


# ---------------------------------------------------------------------------
# IOMMU groups: bind all of a group's blockers or none


def gpu_and_audio(audio_driver: str = "snd_hda_intel") -> HostSnapshot:
    return host(
        [
            pci("0000:d8:00.0", GPU, 216, driver="nouveau"),
            pci("0000:d8:00.1", AUDIO, 216, driver=audio_driver, class_code=0x040300),
        ]
    )


def test_an_unselected_sibling_on_a_host_driver_blocks_the_group() -> None:
    plan = plan_bindings(gpu_and_audio(), config(GPU, drivers=("nouveau", "snd_hda_intel")))
    assert list(plan) == [a("0000:d8:00.0")]
    assert refusal(plan, "0000:d8:00.0") == (
        "IOMMU group 216 also holds 0000:d8:00.1, bound to snd_hda_intel, which stays there "
        "(no selector names it); the group would not be usable"
    )


def test_a_bridge_class_sibling_on_a_host_driver_blocks_the_group() -> None:
    """An Intel chipset's group: the LPC bridge (class 0x0601, driven by
    lpc_ich) beside the audio function. VFIO would refuse the group, so the
    audio is not taken from the host for nothing."""
    lpc = pci("0000:00:1f.0", PciId(0x8086, 0xA30E), 12, driver="lpc_ich", class_code=0x060100)
    audio = pci("0000:00:1f.3", AUDIO, 12, driver="snd_hda_intel", class_code=0x040300)
    plan = plan_bindings(host([lpc, audio]), config(AUDIO, drivers=("snd_hda_intel",)))
    assert "also holds 0000:00:1f.0, bound to lpc_ich" in refusal(plan, "0000:00:1f.3")
    assert a("0000:00:1f.0") not in plan  # and the bridge itself is never a candidate


def test_a_selected_sibling_whose_driver_is_not_listed_blocks_the_group() -> None:
    plan = plan_bindings(gpu_and_audio(), config(GPU, AUDIO, drivers=("nouveau",)))
    assert "does not list snd_hda_intel" in refusal(plan, "0000:d8:00.1")
    assert "0000:d8:00.1, bound to snd_hda_intel" in refusal(plan, "0000:d8:00.0")


def test_a_group_whose_blockers_all_move_is_bound_whole() -> None:
    plan = plan_bindings(gpu_and_audio(), config(GPU, AUDIO, drivers=("nouveau", "snd_hda_intel")))
    assert [d.binds for d in plan.values()] == [True, True]


def test_siblings_without_a_driver_or_on_vfio_do_not_block() -> None:
    for sibling in (None, VFIO_DRIVER):
        plan = plan_bindings(gpu_and_audio(sibling), config(GPU, drivers=("nouveau",)))  # type: ignore[arg-type]
        assert plan[a("0000:d8:00.0")].binds


def test_a_refusal_spreads_through_the_group() -> None:
    # The boot display refuses itself, which leaves its sibling's group
    # unusable, which refuses the sibling too.
    vga = attrs.evolve(pci("0000:03:00.0", VGA, 3, driver="ast"), boot_vga=True)
    audio = pci("0000:03:00.1", AUDIO, 3, driver="snd_hda_intel", class_code=0x040300)
    plan = plan_bindings(host([vga, audio]), config(VGA, AUDIO, drivers=("ast", "snd_hda_intel")))
    assert "boot display" in refusal(plan, "0000:03:00.0")
    assert "0000:03:00.0, bound to ast, which stays there (drives the boot" in refusal(
        plan, "0000:03:00.1"
    )


# ---------------------------------------------------------------------------
# What the inventory shows


def test_inventory_advertises_a_device_being_moved_and_skips_a_refused_one() -> None:
    snap = host([nic(), nic("0000:18:00.1", driver="ixgbe", group=19)])
    plan = plan_bindings(snap, NIC_CONFIG)
    inventory = build_inventory(snap, NIC_CONFIG, bindings=plan)
    (resource,) = inventory.resources
    (device,) = resource.devices
    assert device.id == "0000:18:00.0" and not device.healthy
    assert (
        device.reason
        == "bound to host driver i40e; the config's binding has dp move it to vfio-pci"
    )
    (skipped,) = inventory.skipped
    assert skipped.id == "0000:18:00.1"
    assert skipped.reason == (
        "bound to host driver ixgbe; not moved to vfio-pci: binding.replaceDrivers does not "
        "list ixgbe"
    )


def test_inventory_without_a_plan_keeps_host_held_devices_out() -> None:
    (skipped,) = build_inventory(host([nic()]), NIC_CONFIG).skipped
    assert "no binding policy moves it" in skipped.reason


# ---------------------------------------------------------------------------
def gpu_beside_driverless_audio() -> tuple[StandardNode, Kubelet, PciDevice]:
    """bindUnbound: a T4 on nouveau and its audio function on no driver, both
    to be moved; live, and PodResources has answered (binds may start)."""
    unbound_audio = pci("0000:d8:00.1", AUDIO, 216, driver=None, class_code=0x040300)
    node, kubelet = live_node(
        config(GPU, AUDIO, drivers=("nouveau",), unbound=True),
        host([pci("0000:d8:00.0", GPU, 216, driver="nouveau"), unbound_audio]),
    )
    node.handle(AllocationsObserved({}, 1.0))
    return node, kubelet, unbound_audio


def binding_node(config_: Config) -> StandardNode:
    """A StandardNode that has heard from PodResources, so binds may start."""
    node = StandardNode(config_)
    node.handle(KubeletStarted(0.0))
    node.handle(AllocationsObserved({}, 0.0))  # its checkpoint names nothing: trusted
    return node


# The StandardNode: BindDevice once, BindingFinished, failures until the config changes


def turn(
    node: StandardNode, write: BindDevice | UnbindDevice, now: float
) -> tuple[bool, list[object]]:
    """`write`'s turn in the queue has come: whether it goes, and the effects."""
    effects = node.handle(WriteDue(7, write, now))
    (decided,) = effects_of(effects, WriteDecided)
    assert decided.call == 7
    return decided.carry_out, effects


def test_node_binds_once_and_reports_the_result() -> None:
    node = binding_node(NIC_CONFIG)
    effects = node.handle(HostObserved(host([nic()]), 1.0))
    assert effects_of(effects, BindDevice) == [BindDevice(a("0000:18:00.0"), "i40e")]
    bind_log = [e for e in effects_of(effects, Log) if e.event == "bind"]
    assert bind_log and dict(bind_log[0].fields) == {"device": "0000:18:00.0", "driver": "i40e"}
    # A rescan while the bind is under way does not start a second one.
    assert effects_of(node.handle(HostObserved(host([nic()]), 2.0)), BindDevice) == []
    done = node.handle(BindingFinished(a("0000:18:00.0"), None, 3.0))
    assert [e.event for e in effects_of(done, Log)] == ["bound"]
    # The kernel moved it: the next scan shows it on vfio-pci, Healthy.
    effects = node.handle(HostObserved(host([nic(driver=VFIO_DRIVER)]), 4.0))
    assert effects_of(effects, BindDevice) == []
    assert [d.healthy for d in node.inventory.resources[0].devices] == [True]


def test_a_failed_bind_withdraws_the_queued_binds_of_its_group() -> None:
    """Binds run one at a time. The GPU's failed, so its group cannot become
    usable: the audio function's bind, still queued, is no longer planned."""
    node = binding_node(config(GPU, AUDIO, drivers=("nouveau", "snd_hda_intel")))
    effects = node.handle(HostObserved(gpu_and_audio(), 1.0))
    gpu, audio = a("0000:d8:00.0"), a("0000:d8:00.1")
    assert effects_of(effects, BindDevice) == [
        BindDevice(gpu, "nouveau"),
        BindDevice(audio, "snd_hda_intel"),
    ]
    goes, effects = turn(node, BindDevice(audio, "snd_hda_intel"), 1.5)
    assert goes and effects == [WriteDecided(7, carry_out=True)]
    effects = node.handle(BindingFinished(gpu, "unbind: device busy", 2.0))
    assert [e.event for e in effects_of(effects, Log)] == ["bind-failed"]
    goes, effects = turn(node, BindDevice(audio, "snd_hda_intel"), 2.1)
    assert not goes  # withdrawn by the core itself: nothing is written or reported
    assert [e.event for e in effects_of(effects, Log)] == ["bind-withdrawn"]
    assert node.bind_book.in_flight == {}
    assert effects_of(node.handle(HostObserved(gpu_and_audio(), 3.0)), BindDevice) == []


GPU_AND_AUDIO = config(GPU, AUDIO, drivers=("nouveau", "snd_hda_intel"))


def test_a_group_that_cannot_be_moved_whole_is_given_back() -> None:
    """The GPU moved, then its audio function's bind failed: the GPU would sit
    on vfio-pci in a group no VM can use, so it goes back to nouveau, and
    neither is tried again until the config changes."""
    node = binding_node(GPU_AND_AUDIO)
    node.handle(HostObserved(gpu_and_audio(), 1.0))
    gpu, audio = a("0000:d8:00.0"), a("0000:d8:00.1")
    assert [e.event for e in effects_of(node.handle(BindingFinished(gpu, None, 2.0)), Log)] == [
        "bound"
    ]
    effects = node.handle(BindingFinished(audio, "unbind: device busy", 2.1))
    reason = "0000:d8:00.1, in the same IOMMU group, could not be moved to vfio-pci"
    assert effects_of(effects, UnbindDevice) == [UnbindDevice(gpu, "nouveau", reason)]
    logs = effects_of(effects, Log)
    assert [(e.level, e.event) for e in logs] == [
        ("warning", "bind-failed"),
        ("warning", "give-back"),
        # Both now skipped, and the log says so once (dp_core.explain).
        ("info", "devices-skipped"),
        ("info", "devices-skipped"),
    ]
    assert [dict(e.fields)["devices"] for e in logs[2:]] == ["0000:d8:00.1", "0000:d8:00.0"]
    assert node.bind_book.giving_back == {gpu}
    done = node.handle(UnbindingFinished(gpu, None, 2.5))
    given = one(done, Log)
    assert given.event == "given-back" and dict(given.fields)["driver"] == "nouveau"
    assert node.bind_book.giving_back == set() and node.bind_book.moved == {}
    # The rescan shows both on their drivers again; nothing is moved again.
    effects = node.handle(HostObserved(gpu_and_audio(), 3.0))
    assert effects_of(effects, BindDevice) == []
    reasons = {s.id: s.reason for s in node.inventory.skipped}
    assert "given back to nouveau: " + reason in reasons["0000:d8:00.0"]
    assert "unbind: device busy" in reasons["0000:d8:00.1"]
    # A new config tries the group again.
    retried = node.handle(ConfigApplied(GPU_AND_AUDIO, now=4.0))
    assert effects_of(retried, BindDevice) == [
        BindDevice(gpu, "nouveau"),
        BindDevice(audio, "snd_hda_intel"),
    ]


def test_a_bind_that_finishes_after_its_groups_failure_is_given_back_at_once() -> None:
    node = binding_node(GPU_AND_AUDIO)
    node.handle(HostObserved(gpu_and_audio(), 1.0))
    gpu, audio = a("0000:d8:00.0"), a("0000:d8:00.1")
    failed = node.handle(BindingFinished(gpu, "EIO", 2.0))
    assert effects_of(failed, UnbindDevice) == []  # nothing of the group was moved
    # The audio function's bind was already under way, and succeeded.
    effects = node.handle(BindingFinished(audio, None, 2.1))
    assert effects_of(effects, UnbindDevice) == [
        UnbindDevice(
            audio,
            "snd_hda_intel",
            "0000:d8:00.0, in the same IOMMU group, could not be moved to vfio-pci",
        )
    ]


def test_a_failed_give_back_is_an_error_and_the_device_stays_failed() -> None:
    node = binding_node(GPU_AND_AUDIO)
    node.handle(HostObserved(gpu_and_audio(), 1.0))
    gpu, audio = a("0000:d8:00.0"), a("0000:d8:00.1")
    node.handle(BindingFinished(gpu, None, 2.0))
    node.handle(BindingFinished(audio, "EBUSY", 2.1))
    effects = node.handle(UnbindingFinished(gpu, "nouveau would not take it", 2.2))
    error = one(effects, Log)
    assert (error.level, error.event) == ("error", "give-back-failed")
    assert dict(error.fields)["reason"] == "nouveau would not take it"
    # Still on vfio-pci, as the next scan shows: Unhealthy, and not moved again.
    on_vfio = host(
        [
            pci("0000:d8:00.0", GPU, 216, driver=VFIO_DRIVER),
            pci("0000:d8:00.1", AUDIO, 216, driver="snd_hda_intel", class_code=0x040300),
        ]
    )
    effects = node.handle(HostObserved(on_vfio, 3.0))
    assert effects_of(effects, BindDevice) == effects_of(effects, UnbindDevice) == []
    (gpu_advertised,) = node.device_plugin.advertised("devices.kubevirt.io/10de_1eb8")
    assert not gpu_advertised.healthy and "not viable" in gpu_advertised.reason


def test_a_device_the_config_no_longer_selects_is_not_given_back() -> None:
    """dp writes to no device the config does not select: once a reload drops
    the GPU's selector, a failure in its group leaves it where it is. The GPU
    may have gone to another plugin's VMs meanwhile (externalResourceProvider),
    whose allocations dp cannot see: selected again, it is not dp's to give back."""
    node = binding_node(GPU_AND_AUDIO)
    node.handle(HostObserved(gpu_and_audio(), 1.0))
    gpu, audio = a("0000:d8:00.0"), a("0000:d8:00.1")
    node.handle(BindingFinished(gpu, None, 2.0))
    node.handle(ConfigApplied(config(AUDIO, drivers=("snd_hda_intel",)), now=2.05))
    effects = node.handle(BindingFinished(audio, "EBUSY", 2.1))
    assert effects_of(effects, UnbindDevice) == []
    on_vfio = host(
        [
            pci("0000:d8:00.0", GPU, 216, driver=VFIO_DRIVER),
            pci("0000:d8:00.1", AUDIO, 216, driver="snd_hda_intel", class_code=0x040300),
        ]
    )
    node.handle(HostObserved(on_vfio, 2.15))
    effects = node.handle(ConfigApplied(GPU_AND_AUDIO, now=2.2))
    assert effects_of(effects, BindDevice) == [BindDevice(audio, "snd_hda_intel")]
    effects = node.handle(BindingFinished(audio, "EBUSY", 2.3))
    assert effects_of(effects, UnbindDevice) == []
    # Selected all along, even across a reload, it is given back.
    node = binding_node(GPU_AND_AUDIO)
    node.handle(HostObserved(gpu_and_audio(), 1.0))
    node.handle(BindingFinished(gpu, None, 2.0))
    node.handle(ConfigApplied(GPU_AND_AUDIO, now=2.05))
    effects = node.handle(BindingFinished(audio, "EBUSY", 2.1))
    assert [u.address for u in effects_of(effects, UnbindDevice)] == [gpu]


def test_a_given_back_device_stays_unhealthy_until_a_scan_shows_it_gone_from_vfio() -> None:
    """The last scan showed the GPU on vfio-pci and the group viable (the audio
    function had no driver): once given back, the GPU is on nouveau, whatever
    that scan says, until the next one."""
    gpu, audio = a("0000:d8:00.0"), a("0000:d8:00.1")
    node, kubelet, unbound_audio = gpu_beside_driverless_audio()
    resource = "devices.kubevirt.io/10de_1eb8"
    node.handle(BindingFinished(gpu, None, 2.0))
    node.handle(HostObserved(host([pci("0000:d8:00.0", GPU, 216, driver=VFIO_DRIVER),
                                   unbound_audio]), 2.05))  # fmt: skip
    node.handle(BindingFinished(audio, "after the probe it has no driver", 2.1))
    node.handle(UnbindingFinished(gpu, None, 2.2))
    (advertised,) = node.device_plugin.advertised(resource)
    assert not advertised.healthy
    kubelet.now = 2.3
    assert effects_of(kubelet.allocate(resource, ("0000:d8:00.0",)), Reply) == []
    # The next scan shows it on nouveau: skipped, as given back.
    node.handle(HostObserved(host([pci("0000:d8:00.0", GPU, 216, driver="nouveau"),
                                   unbound_audio]), 2.4))  # fmt: skip
    assert node.device_plugin.advertised(resource) == ()
    assert node.bind_book.leaving == frozenset()


def test_a_group_re_added_after_a_hot_unplug_is_not_given_back_for_its_old_failure() -> None:
    node = binding_node(GPU_AND_AUDIO)
    node.handle(HostObserved(gpu_and_audio(), 1.0))
    gpu, audio = a("0000:d8:00.0"), a("0000:d8:00.1")
    node.handle(BindingFinished(gpu, None, 2.0))
    node.handle(BindingFinished(audio, "EBUSY", 2.1))
    node.handle(UnbindingFinished(gpu, None, 2.2))
    node.handle(HostObserved(host([]), 3.0))  # the card is removed, then rescanned
    assert node.bind_book.failed == {}
    effects = node.handle(HostObserved(gpu_and_audio(), 4.0))
    assert effects_of(effects, BindDevice) == [
        BindDevice(gpu, "nouveau"),
        BindDevice(audio, "snd_hda_intel"),
    ]
    # This time the GPU's move stays: its group has not failed since.
    assert effects_of(node.handle(BindingFinished(gpu, None, 5.0)), UnbindDevice) == []


def test_a_bind_result_reported_after_its_card_left_does_not_outlive_the_re_add() -> None:
    node = binding_node(GPU_AND_AUDIO)
    node.handle(HostObserved(gpu_and_audio(), 1.0))
    gpu, audio = a("0000:d8:00.0"), a("0000:d8:00.1")
    node.handle(BindingFinished(gpu, None, 2.0))
    node.handle(HostObserved(host([]), 2.05))  # the card is removed while the audio bind runs
    effects = node.handle(BindingFinished(audio, "ENODEV", 2.1))
    assert effects_of(effects, UnbindDevice) == [] and node.bind_book.failed == {}
    back = node.handle(HostObserved(gpu_and_audio(), 3.0))
    assert effects_of(back, BindDevice) == [
        BindDevice(gpu, "nouveau"),
        BindDevice(audio, "snd_hda_intel"),
    ]


def test_a_bind_result_from_before_a_card_left_and_came_back_is_forgotten() -> None:
    """The card is seen gone, then back (a new bind of the GPU starts), before
    the audio function's old bind reports: its failure is about a device that
    is no more, and must not refuse the new one nor give the GPU back."""
    node = binding_node(GPU_AND_AUDIO)
    node.handle(HostObserved(gpu_and_audio(), 1.0))
    gpu, audio = a("0000:d8:00.0"), a("0000:d8:00.1")
    node.handle(BindingFinished(gpu, None, 2.0))
    node.handle(HostObserved(host([]), 2.05))
    back = node.handle(HostObserved(gpu_and_audio(), 2.1))
    assert effects_of(back, BindDevice) == [BindDevice(gpu, "nouveau")]
    effects = node.handle(BindingFinished(audio, "ENODEV", 2.2))
    assert effects_of(effects, UnbindDevice) == [] and node.bind_book.failed == {}
    assert effects_of(node.handle(BindingFinished(gpu, None, 2.3)), UnbindDevice) == []
    gpu_moved = host(
        [
            pci("0000:d8:00.0", GPU, 216, driver=VFIO_DRIVER),
            pci("0000:d8:00.1", AUDIO, 216, driver="snd_hda_intel", class_code=0x040300),
        ]
    )
    again = node.handle(HostObserved(gpu_moved, 3.0))
    assert effects_of(again, BindDevice) == [BindDevice(audio, "snd_hda_intel")]


def test_podresources_is_not_asked_for_a_plan_that_binds_nothing() -> None:
    node, effects = started_node(NIC_CONFIG, host([nic(driver="ixgbe")]))
    assert effects_of(effects, RefreshAllocations) == [
        RefreshAllocations("the kubelet started: which pods hold devices")
    ]


def test_a_device_being_given_back_is_not_allocatable() -> None:
    """With bindUnbound the audio function had no driver, and the probe left it
    with none. Until the GPU's give-back has its turn, a rescan shows the group
    viable (GPU on vfio-pci, audio on no driver): the GPU must stay Unhealthy,
    and when its turn comes the give-back still goes ahead."""
    gpu, audio = a("0000:d8:00.0"), a("0000:d8:00.1")
    node, kubelet, unbound_audio = gpu_beside_driverless_audio()
    node.handle(BindingFinished(gpu, None, 2.0))
    effects = node.handle(BindingFinished(audio, "after the probe it has no driver", 2.1))
    (give_back,) = effects_of(effects, UnbindDevice)
    assert give_back.address == gpu
    node.handle(HostObserved(host([pci("0000:d8:00.0", GPU, 216, driver=VFIO_DRIVER),
                                   unbound_audio]), 2.2))  # fmt: skip
    (advertised,) = node.device_plugin.advertised("devices.kubevirt.io/10de_1eb8")
    assert not advertised.healthy and "giving it back" in advertised.reason
    kubelet.now = 2.3
    refused = kubelet.allocate("devices.kubevirt.io/10de_1eb8", ("0000:d8:00.0",))
    assert effects_of(refused, Reply) == [] and effects_of(refused, Reject)
    assert turn(node, give_back, 2.4)[0]


def test_a_give_back_whose_device_the_config_dropped_is_withdrawn_when_its_turn_comes() -> None:
    node = binding_node(GPU_AND_AUDIO)
    node.handle(HostObserved(gpu_and_audio(), 1.0))
    gpu, audio = a("0000:d8:00.0"), a("0000:d8:00.1")
    node.handle(BindingFinished(gpu, None, 2.0))
    (give_back,) = effects_of(node.handle(BindingFinished(audio, "EBUSY", 2.1)), UnbindDevice)
    assert turn(node, give_back, 2.15)[0]
    node.handle(ConfigApplied(config(AUDIO, drivers=("snd_hda_intel",)), now=2.2))
    goes, done = turn(node, give_back, 2.3)
    assert not goes
    assert [e.event for e in effects_of(done, Log)] == ["give-back-withdrawn"]
    assert node.bind_book.giving_back == set()


def test_a_bind_that_finishes_after_a_reload_dropped_its_device_is_never_given_back() -> None:
    """The GPU's bind was under way (its turn had come) when a reload dropped
    the GPU's selector; its still-selected sibling then fails."""
    node = binding_node(GPU_AND_AUDIO)
    node.handle(HostObserved(gpu_and_audio(), 1.0))
    gpu, audio = a("0000:d8:00.0"), a("0000:d8:00.1")
    node.handle(ConfigApplied(config(AUDIO, drivers=("nouveau", "snd_hda_intel")), now=1.5))
    node.handle(BindingFinished(gpu, None, 2.0))
    node.handle(BindingFinished(audio, None, 2.1, withdrawn=True))
    on_vfio = host(
        [
            pci("0000:d8:00.0", GPU, 216, driver=VFIO_DRIVER),
            pci("0000:d8:00.1", AUDIO, 216, driver="snd_hda_intel", class_code=0x040300),
        ]
    )
    effects = node.handle(HostObserved(on_vfio, 3.0))
    assert effects_of(effects, BindDevice) == [BindDevice(audio, "snd_hda_intel")]
    effects = node.handle(BindingFinished(audio, "EBUSY", 4.0))
    assert effects_of(effects, UnbindDevice) == []


def test_a_failed_give_back_is_not_published_healthy_from_the_scan_before_it() -> None:
    """vfio-pci let the GPU go and nouveau would not take it: whatever the last
    scan (GPU on vfio-pci, group viable) says, it is not usable until the next."""
    gpu, audio = a("0000:d8:00.0"), a("0000:d8:00.1")
    node, kubelet, unbound_audio = gpu_beside_driverless_audio()
    node.handle(BindingFinished(gpu, None, 2.0))
    node.handle(HostObserved(host([pci("0000:d8:00.0", GPU, 216, driver=VFIO_DRIVER),
                                   unbound_audio]), 2.05))  # fmt: skip
    node.handle(BindingFinished(audio, "after the probe it has no driver", 2.1))
    node.handle(UnbindingFinished(gpu, "writing to nouveau/bind failed: EBUSY", 2.2))
    (advertised,) = node.device_plugin.advertised("devices.kubevirt.io/10de_1eb8")
    assert not advertised.healthy
    kubelet.now = 2.3
    refused = kubelet.allocate("devices.kubevirt.io/10de_1eb8", ("0000:d8:00.0",))
    assert effects_of(refused, Reply) == []


T4_RESOURCE = "devices.kubevirt.io/10de_1eb8"


def test_nothing_is_moved_before_podresources_says_which_groups_pods_hold() -> None:
    """dp restarted under a running VM that holds the GPU (on vfio-pci beside
    its driverless audio function, with bindUnbound): no bind starts before
    PodResources has answered, and then none into the VM's group until the
    VM's pod is gone."""
    audio = a("0000:d8:00.1")
    unbound_audio = pci("0000:d8:00.1", AUDIO, 216, driver=None, class_code=0x040300)
    on_vfio = host([pci("0000:d8:00.0", GPU, 216, driver=VFIO_DRIVER), unbound_audio])
    node, effects = started_node(
        config(GPU, AUDIO, drivers=("nouveau",), unbound=True), on_vfio, synced=False
    )
    assert effects_of(effects, BindDevice) == [] and not node.bind_book.in_flight
    asks = [r.reason for r in effects_of(effects, RefreshAllocations)]
    assert "binds wait to learn which IOMMU groups pods hold" in asks  # even with no kubelet
    assert [e.event for e in effects_of(effects, Log)].count("binds-waiting") == 1
    later = node.handle(HostObserved(on_vfio, 0.5))  # logged once, asked again
    assert [e.event for e in effects_of(later, Log)].count("binds-waiting") == 0
    assert effects_of(later, RefreshAllocations)
    effects = node.handle(AllocationsObserved({T4_RESOURCE: frozenset({"0000:d8:00.0"})}, 1.0))
    assert effects_of(effects, BindDevice) == []
    assert not node.bindings[audio].binds and audio not in node.bind_book.in_flight
    assert "an allocation holds IOMMU group 216" in refusal(node.bindings, "0000:d8:00.1")
    assert effects_of(node.handle(HostObserved(on_vfio, 3.0)), BindDevice) == []
    released = node.handle(AllocationsObserved({}, 40.0))
    assert effects_of(released, BindDevice) == [BindDevice(audio, None)]


def test_a_group_with_a_bind_under_way_is_not_allocatable() -> None:
    """The GPU is on vfio-pci beside its driverless audio function: the group
    is usable, but while the audio function's bind runs it may fail and hand
    the function to a host driver, so nothing in the group is handed out."""
    unbound_audio = pci("0000:d8:00.1", AUDIO, 216, driver=None, class_code=0x040300)
    on_vfio = host([pci("0000:d8:00.0", GPU, 216, driver=VFIO_DRIVER), unbound_audio])
    node, kubelet = live_node(config(GPU, AUDIO, drivers=("nouveau",), unbound=True), on_vfio)
    node.handle(AllocationsObserved({}, 1.0))
    assert list(node.bind_book.in_flight) == [a("0000:d8:00.1")]
    assert turn(node, BindDevice(a("0000:d8:00.1"), None), 1.5)[0]
    (gpu,) = node.device_plugin.advertised(T4_RESOURCE)
    assert not gpu.healthy and "moving a member of IOMMU group 216" in gpu.reason
    kubelet.now = 2.0
    assert effects_of(kubelet.allocate(T4_RESOURCE, ("0000:d8:00.0",)), Reply) == []


def test_nothing_an_allocation_holds_is_given_back_until_it_is_released() -> None:
    book = BindingBook()
    gpu, audio = a("0000:d8:00.0"), a("0000:d8:00.1")
    book.replan(gpu_and_audio(), GPU_AND_AUDIO)
    book.finished(BindingFinished(gpu, None, 1.0), held_groups=())
    effects = book.finished(BindingFinished(audio, "EBUSY", 1.1), held_groups={216})
    assert [e.event for e in effects_of(effects, Log)] == ["bind-failed", "give-back-put-off"]
    assert effects_of(effects, UnbindDevice) == [] and book.giving_back == set()
    assert book.give_back_stranded(held_groups={216}) == []  # logged once, not per look
    effects = book.give_back_stranded(held_groups=())
    assert [u.address for u in effects_of(effects, UnbindDevice)] == [gpu]
    assert book.giving_back == {gpu}


def test_a_give_back_put_off_by_a_holder_podresources_reports_goes_ahead_after_it() -> None:
    """PodResources reports a pod holding the GPU that dp did not allocate (a
    second dp during an upgrade, say) while the group is being moved: the
    give-back waits until that pod is gone."""
    gpu, audio = a("0000:d8:00.0"), a("0000:d8:00.1")
    node = binding_node(GPU_AND_AUDIO)
    node.handle(HostObserved(gpu_and_audio(), 1.0))
    node.handle(BindingFinished(gpu, None, 2.0))
    node.handle(AllocationsObserved({"devices.kubevirt.io/10de_1eb8": frozenset({str(gpu)})}, 2.05))
    effects = node.handle(BindingFinished(audio, "EBUSY", 2.1))
    assert effects_of(effects, UnbindDevice) == []  # put off: a pod holds group 216
    assert gpu not in node.bind_book.giving_back
    released = node.handle(AllocationsObserved({}, 40.0))
    (give_back,) = effects_of(released, UnbindDevice)
    assert give_back.address == gpu
    assert turn(node, give_back, 40.5)[0]


@pytest.mark.parametrize("finished", [BindingFinished, UnbindingFinished])
def test_a_withdrawn_result_has_no_error(finished: type[BindingFinished]) -> None:
    with pytest.raises(ValueError, match="wrote nothing, so has no error"):
        finished(a("0000:18:00.0"), "EBUSY", 1.0, withdrawn=True)


@pytest.mark.parametrize(
    ("write", "what"),
    [
        (BindDevice(a("0000:18:00.0"), "i40e"), "no bind of 0000:18:00.0 is in flight"),
        (
            UnbindDevice(a("0000:18:00.0"), "i40e", "a sibling failed"),
            "no give-back of 0000:18:00.0 is in flight",
        ),
    ],
)
def test_the_turn_of_a_write_never_asked_for_is_a_caller_error(
    write: BindDevice | UnbindDevice, what: str
) -> None:
    with pytest.raises(UsageError, match=f"WriteDue: {what}"):
        StandardNode(NIC_CONFIG).handle(WriteDue(1, write, 1.0))


def test_a_give_back_result_never_asked_for_is_a_caller_error() -> None:
    with pytest.raises(UsageError, match="no give-back of 0000:18:00.0 is in flight"):
        StandardNode(NIC_CONFIG).handle(UnbindingFinished(a("0000:18:00.0"), None, 1.0))


def test_a_failed_bind_is_not_retried_until_the_config_changes() -> None:
    node = binding_node(NIC_CONFIG)
    node.handle(HostObserved(host([nic()]), 1.0))
    failed = node.handle(BindingFinished(a("0000:18:00.0"), "writing to unbind failed: EBUSY", 2.0))
    assert [(e.level, e.event) for e in effects_of(failed, Log)] == [("warning", "bind-failed")]
    again = node.handle(HostObserved(host([nic()]), 3.0))
    assert effects_of(again, BindDevice) == []
    (skipped,) = node.inventory.skipped
    assert "binding it to vfio-pci failed: writing to unbind failed: EBUSY" in skipped.reason
    # One log line for the refusal, not one per rescan.
    assert [e.event for e in effects_of(again, Log)].count("bind-refused") == 1
    later = node.handle(HostObserved(host([nic()]), 4.0))
    assert [e.event for e in effects_of(later, Log)].count("bind-refused") == 0
    retried = node.handle(ConfigApplied(NIC_CONFIG, now=5.0))
    assert effects_of(retried, BindDevice) == [BindDevice(a("0000:18:00.0"), "i40e")]


def test_a_failed_device_that_leaves_and_returns_is_tried_again() -> None:
    node = binding_node(NIC_CONFIG)
    node.handle(HostObserved(host([nic()]), 1.0))
    node.handle(BindingFinished(a("0000:18:00.0"), "EIO", 2.0))
    node.handle(HostObserved(host([]), 3.0))
    back = node.handle(HostObserved(host([nic()]), 4.0))
    assert effects_of(back, BindDevice) == [BindDevice(a("0000:18:00.0"), "i40e")]


def test_a_result_for_a_bind_never_asked_for_is_a_caller_error() -> None:
    with pytest.raises(UsageError, match="no bind of 0000:18:00.0 is in flight"):
        StandardNode(NIC_CONFIG).handle(BindingFinished(a("0000:18:00.0"), None, 1.0))


# ---------------------------------------------------------------------------
# Config validation


@pytest.mark.parametrize(
    ("drivers", "message"),
    [
        (("vfio-pci",), "moved to, not from"),
        (("../unbind",), "not a kernel driver name"),
        (("",), "not a kernel driver name"),
        (("i40e", "i40e"), "'i40e' is listed twice"),
    ],
)
def test_binding_refuses_bad_driver_names(drivers: tuple[str, ...], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        Binding(drivers)


def test_binding_needs_selectors() -> None:
    with pytest.raises(ConfigError, match="only devices a selector names are ever rebound"):
        Config(binding=Binding(("i40e",)))


# ---------------------------------------------------------------------------
# Properties over generated hosts

HOST_DRIVERS = ("nvidia", "snd_hda_intel")


@st.composite
def binding_cases(draw: st.DrawFn) -> tuple[HostSnapshot, Config]:
    base = draw(host_snapshots())
    devices = [
        attrs.evolve(
            device,
            boot_vga=draw(st.integers(0, 7)) == 0,
            virtfns=(a("0000:f0:00.0"),) if draw(st.integers(0, 7)) == 0 else (),
        )
        for device in base.pci_devices
    ]
    loaded = {VFIO_DRIVER, *HOST_DRIVERS} if draw(st.integers(0, 5)) else set(HOST_DRIVERS)
    snap = host(devices, frozenset(loaded))
    chosen = draw(configs())
    if chosen.permitted_host_devices is None or not chosen.permitted_host_devices.pci_host_devices:
        return snap, chosen
    binding = Binding(
        tuple(d for d in HOST_DRIVERS if draw(st.booleans())), bind_unbound=draw(st.booleans())
    )
    return snap, attrs.evolve(chosen, binding=binding)


@settings(max_examples=300, deadline=None)
@given(binding_cases())
def test_only_selected_devices_that_can_end_up_usable_are_bound(
    case: tuple[HostSnapshot, Config],
) -> None:
    snap, config_ = case
    plan = plan_bindings(snap, config_)
    assert plan == plan_bindings(snap, config_)  # same inputs, same plan
    binds = {address for address, decision in plan.items() if decision.binds}
    if config_.binding is None:
        assert plan == {}
        return
    for address in plan:
        device = snap.device(address)
        assert device is not None and not device.is_bridge
        entry = config_.pci_selectors().get((device.vendor, device.device))
        assert entry is not None and not entry.virt_handler_serves
    for address in binds:
        device = snap.device(address)
        assert device is not None
        assert device.driver in config_.binding.replace_drivers or (
            device.driver is None and config_.binding.bind_unbound
        )
        assert not device.boot_vga and not (device.virtfns and device.driver)
        assert snap.pci_drivers is not None and VFIO_DRIVER in snap.pci_drivers
        group = snap.group(device.iommu_group)
        assert group is not None
        # Once every bind is done, the group is viable.
        for member in group.endpoints:
            assert member.driver in (None, VFIO_DRIVER) or member.address in binds


@settings(max_examples=100, deadline=None)
@given(binding_cases())
def test_node_asks_for_exactly_the_planned_binds(case: tuple[HostSnapshot, Config]) -> None:
    snap, config_ = case
    node = binding_node(config_)
    effects = node.handle(HostObserved(snap, 1.0))
    planned = {address for address, d in plan_bindings(snap, config_).items() if d.binds}
    assert {effect.address for effect in effects_of(effects, BindDevice)} == planned
    # Every selected device is advertised or skipped, whatever binding decided.
    inventory = node.inventory
    seen = {d.id for r in inventory.resources for d in r.devices} | {
        s.id for s in inventory.skipped
    }
    assert {str(address) for address in plan_bindings(snap, config_)} <= seen


# ---------------------------------------------------------------------------
# Moves kept across restarts: MovesChanged out, MovesRecalled in


def test_every_change_to_what_dp_moved_is_reported_whole() -> None:
    node = binding_node(GPU_AND_AUDIO)
    node.handle(HostObserved(gpu_and_audio(), 1.0))
    gpu, audio = a("0000:d8:00.0"), a("0000:d8:00.1")
    bound = node.handle(BindingFinished(gpu, None, 2.0))
    assert effects_of(bound, MovesChanged) == [MovesChanged((Move(gpu, "nouveau", 216),))]
    failed = node.handle(BindingFinished(audio, "EBUSY", 2.1))
    assert effects_of(failed, MovesChanged) == []  # still moved, until given back
    given_back = node.handle(UnbindingFinished(gpu, None, 2.2))
    assert effects_of(given_back, MovesChanged) == [MovesChanged(())]
    assert effects_of(node.handle(HostObserved(gpu_and_audio(), 3.0)), MovesChanged) == []


def gpu_moved_audio_not() -> HostSnapshot:
    """An earlier run moved the GPU; its audio function is still on snd_hda_intel."""
    return host(
        [
            pci("0000:d8:00.0", GPU, 216, driver=VFIO_DRIVER),
            pci("0000:d8:00.1", AUDIO, 216, driver="snd_hda_intel", class_code=0x040300),
        ]
    )


@pytest.mark.parametrize("recalled", [True, False])
def test_a_move_recalled_from_an_earlier_run_is_given_back_when_its_group_breaks(
    recalled: bool,
) -> None:
    """dp restarted after moving the GPU and before the audio function's move
    failed. Told what it moved before, it gives the GPU back; without that,
    the GPU is just a function on vfio-pci, and stays there."""
    gpu, audio = a("0000:d8:00.0"), a("0000:d8:00.1")
    node = binding_node(GPU_AND_AUDIO)
    if recalled:
        logs = node.handle(MovesRecalled((Move(gpu, "nouveau", 216),)))
        assert [(e.event, dict(e.fields)) for e in effects_of(logs, Log)] == [
            ("moves-recalled", {"count": 1})
        ]
    effects = node.handle(HostObserved(gpu_moved_audio_not(), 1.0))
    assert effects_of(effects, BindDevice) == [BindDevice(audio, "snd_hda_intel")]
    assert effects_of(effects, MovesChanged) == []
    effects = node.handle(BindingFinished(audio, "EBUSY", 2.0))
    reason = "0000:d8:00.1, in the same IOMMU group, could not be moved to vfio-pci"
    expected = [UnbindDevice(gpu, "nouveau", reason)] if recalled else []
    assert effects_of(effects, UnbindDevice) == expected


def test_a_recalled_function_the_first_scan_shows_elsewhere_is_forgotten() -> None:
    """Put back by hand while dp was down: it is not dp's to give back any more."""
    gpu = a("0000:d8:00.0")
    node = binding_node(GPU_AND_AUDIO)
    node.handle(MovesRecalled((Move(gpu, "nouveau", 216),)))
    effects = node.handle(HostObserved(gpu_and_audio(), 1.0))
    assert effects_of(effects, MovesChanged) == [MovesChanged(())]
    assert node.bind_book.moved == {}


def test_a_recalled_function_the_config_does_not_select_is_forgotten() -> None:
    gpu = a("0000:d8:00.0")
    node = binding_node(config(AUDIO, drivers=("snd_hda_intel",)))
    node.handle(MovesRecalled((Move(gpu, "nouveau", 216),)))
    effects = node.handle(HostObserved(gpu_moved_audio_not(), 1.0))
    assert effects_of(effects, MovesChanged) == [MovesChanged(())]


def test_moves_are_recalled_before_the_first_scan_only() -> None:
    node = binding_node(GPU_AND_AUDIO)
    node.handle(HostObserved(gpu_and_audio(), 1.0))
    with pytest.raises(UsageError, match="before the first HostObserved"):
        node.handle(MovesRecalled((Move(a("0000:d8:00.0"), "nouveau", 216),)))


def test_a_function_recalled_twice_is_refused_at_construction() -> None:
    gpu = a("0000:d8:00.0")
    with pytest.raises(ValueError, match="moved twice: 0000:d8:00.0"):
        MovesRecalled([Move(gpu, "nouveau", 216), Move(gpu, None, 216)])  # type: ignore[arg-type]


def test_a_recalled_move_whose_group_changed_is_forgotten() -> None:
    """The file says IOMMU group 216; the scan puts the function alone in 59
    (another boot's numbering, or a hand-edited file): it is not given back
    when 216 breaks."""
    old_gpu, gpu, audio = a("0000:3b:00.0"), a("0000:d8:00.0"), a("0000:d8:00.1")
    node = binding_node(GPU_AND_AUDIO)
    node.handle(MovesRecalled((Move(old_gpu, "nouveau", 216),)))
    scan = host(
        [
            pci("0000:3b:00.0", GPU, 59, driver=VFIO_DRIVER),
            pci("0000:d8:00.0", GPU, 216, driver="nouveau"),
            pci("0000:d8:00.1", AUDIO, 216, driver="snd_hda_intel", class_code=0x040300),
        ]
    )
    assert effects_of(node.handle(HostObserved(scan, 1.0)), MovesChanged) == [MovesChanged(())]
    node.handle(BindingFinished(gpu, None, 2.0))
    effects = node.handle(BindingFinished(audio, "EBUSY", 2.1))
    assert [e.address for e in effects_of(effects, UnbindDevice)] == [gpu]


@pytest.mark.parametrize("driver", ["../../../usb/drivers/usb", "vfio-pci", "", "a b"])
def test_a_move_names_a_driver_a_config_could_name(driver: str) -> None:
    """Given back, it reaches a sysfs path: drivers/<driver>/bind."""
    with pytest.raises(ValueError):
        Move(a("0000:d8:00.0"), driver, 216)


@pytest.mark.parametrize("first", ["allocations", "config"])
def test_recalled_moves_wait_for_the_first_scan_whatever_comes_before_it(first: str) -> None:
    gpu, audio = a("0000:d8:00.0"), a("0000:d8:00.1")
    node = StandardNode(GPU_AND_AUDIO)
    node.handle(MovesRecalled((Move(gpu, "nouveau", 216),)))
    node.handle(KubeletStarted(0.4))
    if first == "allocations":
        before = node.handle(AllocationsObserved({}, 0.5))
    else:
        before = node.handle(ConfigApplied(GPU_AND_AUDIO, 0.5, {}))
        node.handle(AllocationsObserved({}, 0.6))
    assert effects_of(before, MovesChanged) == []
    node.handle(HostObserved(gpu_moved_audio_not(), 1.0))
    effects = node.handle(BindingFinished(audio, "EBUSY", 2.0))
    reason = "0000:d8:00.1, in the same IOMMU group, could not be moved to vfio-pci"
    assert effects_of(effects, UnbindDevice) == [UnbindDevice(gpu, "nouveau", reason)]


def test_a_pin_on_the_driver_is_kept_with_the_move_and_written_back_at_give_back() -> None:
    """pci-stub or an administrator's driver_override held the GPU on its
    driver: the move remembers it (and keeps it across restarts), and the
    give-back asks for it back."""
    gpu, audio = a("0000:d8:00.0"), a("0000:d8:00.1")
    node = binding_node(GPU_AND_AUDIO)
    node.handle(HostObserved(gpu_and_audio(), 1.0))
    bound = node.handle(BindingFinished(gpu, None, 2.0, pinned=True))
    assert effects_of(bound, MovesChanged) == [
        MovesChanged((Move(gpu, "nouveau", 216, pinned=True),))
    ]
    effects = node.handle(BindingFinished(audio, "EBUSY", 2.1))
    reason = "0000:d8:00.1, in the same IOMMU group, could not be moved to vfio-pci"
    assert effects_of(effects, UnbindDevice) == [UnbindDevice(gpu, "nouveau", reason, pinned=True)]
    restarted = binding_node(GPU_AND_AUDIO)
    restarted.handle(MovesRecalled((Move(gpu, "nouveau", 216, pinned=True),)))
    restarted.handle(HostObserved(gpu_moved_audio_not(), 3.0))
    effects = restarted.handle(BindingFinished(audio, "EBUSY", 4.0))
    assert effects_of(effects, UnbindDevice) == [UnbindDevice(gpu, "nouveau", reason, pinned=True)]


def test_only_a_bind_that_moved_the_function_reports_a_pin() -> None:
    with pytest.raises(ValueError, match="only a bind that moved"):
        BindingFinished(a("0000:d8:00.0"), "EBUSY", 1.0, pinned=True)
    with pytest.raises(ValueError, match="only a bind that moved"):
        BindingFinished(a("0000:d8:00.0"), None, 1.0, withdrawn=True, pinned=True)
