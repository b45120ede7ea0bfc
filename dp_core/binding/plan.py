"""Which selected PCI functions the server moves to vfio-pci itself (docs/design.md §6).

Binding takes a device away from the host, so it is opt-in (`Config.binding`)
and bounded by rules that refuse it with a reason:

- only functions a `pciHostDevices` selector names, never a bridge, never one
  whose resource another plugin provides;
- only from a driver that `binding.replaceDrivers` lists (or from no driver,
  with `bindUnbound`);
- never the boot display, a function without an IOMMU group, or a physical
  function whose virtual functions are enabled (unbinding it removes them);
- only while vfio-pci is loaded;
- only when the whole IOMMU group becomes usable: a sibling endpoint held by a
  host driver that is not itself being moved keeps the group unusable, so its
  selected members are left alone too;
- a bind that failed is not retried until the config changes or the device
  is re-added, and the members of its group that dp had already moved are
  given back to their drivers.

`plan_bindings` is a pure function, so `dp-server scan` shows exactly what
`serve` would do. `book.BindingBook` remembers what is in flight and what failed.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Mapping

import attrs

from ..config.config import Binding, Config, PciHostDevice
from ..host.pci import PciAddress, PciDevice
from ..host.snapshot import VFIO_DRIVER, HostSnapshot, blocks_vfio

__all__ = ["BindDecision", "plan_bindings", "selected_for_binding"]


@attrs.frozen
class BindDecision:
    """What binding does with one selected function not on vfio-pci.

    `driver` is the driver it would be taken from (None: it has none);
    `refusal` says why it is left alone, and is empty when it is to be bound.
    """

    address: PciAddress
    driver: str | None
    iommu_group: int | None
    refusal: str = ""

    @property
    def binds(self) -> bool:
        return not self.refusal


_Check = Callable[[PciDevice, HostSnapshot, Binding], str]


def _replaceable_driver(pci: PciDevice, snapshot: HostSnapshot, binding: Binding) -> str:
    if pci.driver is not None and pci.driver not in binding.replace_drivers:
        return f"binding.replaceDrivers does not list {pci.driver}"
    return ""


def _not_boot_display(pci: PciDevice, snapshot: HostSnapshot, binding: Binding) -> str:
    return "drives the boot display (boot_vga is 1); dp never rebinds it" if pci.boot_vga else ""


def _has_group(pci: PciDevice, snapshot: HostSnapshot, binding: Binding) -> str:
    if pci.iommu_group is None:
        return "has no IOMMU group (is the IOMMU enabled?), so vfio-pci could not use it"
    return ""


def _no_enabled_vfs(pci: PciDevice, snapshot: HostSnapshot, binding: Binding) -> str:
    if pci.driver is None:
        return ""
    if pci.sriov_numvfs is None:
        return (
            "its virtual functions could not be read (sriov_numvfs or a virtfn link); "
            f"unbinding {pci.driver} could remove them"
        )
    enabled = max(len(pci.virtfns), pci.sriov_numvfs)
    if enabled:
        return f"has {enabled} virtual functions enabled; unbinding {pci.driver} would remove them"
    return ""


def _vfio_loaded(pci: PciDevice, snapshot: HostSnapshot, binding: Binding) -> str:
    if snapshot.pci_drivers is None:
        return "the PCI driver list could not be read; binding waits for the next scan"
    if VFIO_DRIVER not in snapshot.pci_drivers:
        return "the vfio-pci driver is not loaded (modprobe vfio-pci)"
    return ""


# Checked in order; the first that objects gives the refusal.
_CHECKS: tuple[_Check, ...] = (
    _replaceable_driver,
    _not_boot_display,
    _has_group,
    _no_enabled_vfs,
    _vfio_loaded,
)


def selected_for_binding(
    pci: PciDevice, selectors: Mapping[tuple[int, int], PciHostDevice]
) -> bool:
    """Whether a selector names `pci` for dp to serve (and so, to move)."""
    if pci.is_bridge:
        return False
    entry = selectors.get((pci.vendor, pci.device))
    return entry is not None and entry.not_served_because is None


def _candidate(
    pci: PciDevice, selectors: Mapping[tuple[int, int], PciHostDevice], binding: Binding
) -> bool:
    """Whether binding considers `pci` at all (the config selects it, it is not on vfio-pci)."""
    if pci.driver == VFIO_DRIVER:
        return False
    if pci.driver is None and not binding.bind_unbound:
        return False
    return selected_for_binding(pci, selectors)


def plan_bindings(
    snapshot: HostSnapshot,
    config: Config,
    failed: Mapping[PciAddress, str] | None = None,
    held_groups: Container[int] = (),
) -> dict[PciAddress, BindDecision]:
    """A decision for every selected function that binding would move or refuses to.

    `failed` maps functions whose bind failed to the error; they are refused
    with it. Nothing is moved into an IOMMU group in `held_groups` (groups
    allocations hold: a VM uses it, and a failed move could hand a member to
    a host driver under it). Empty without `config.binding`: then nothing is
    ever rebound.
    """
    binding = config.binding
    if binding is None:
        return {}
    failed = failed or {}
    selectors = config.pci_selectors()
    decisions: dict[PciAddress, BindDecision] = {}
    for pci in snapshot.pci_devices:
        if not _candidate(pci, selectors, binding):
            continue
        refusal = next((r for r in (check(pci, snapshot, binding) for check in _CHECKS) if r), "")
        if not refusal and pci.address in failed:
            refusal = (
                f"binding it to vfio-pci failed: {failed[pci.address]}; dp tries again when "
                "the config changes or the device is re-added"
            )
        if not refusal and pci.iommu_group in held_groups:
            refusal = (
                f"an allocation holds IOMMU group {pci.iommu_group}; dp moves it once "
                "that allocation ends"
            )
        decisions[pci.address] = BindDecision(pci.address, pci.driver, pci.iommu_group, refusal)
    # A refusal can leave a sibling's group unusable, which refuses the sibling,
    # which can do the same to another: repeat until nothing changes.
    changed = True
    while changed:
        changed = False
        for address, decision in decisions.items():
            if decision.binds:
                blocker = _group_blocker(decision, snapshot, decisions)
                if blocker:
                    decisions[address] = attrs.evolve(decision, refusal=blocker)
                    changed = True
    return decisions


def _group_blocker(
    decision: BindDecision, snapshot: HostSnapshot, decisions: Mapping[PciAddress, BindDecision]
) -> str:
    group = snapshot.group(decision.iommu_group)
    if group is None:
        return f"IOMMU group {decision.iommu_group} is not listed in sysfs"
    for member in group.members:
        if member.address == decision.address or not blocks_vfio(member):
            continue
        other = decisions.get(member.address)
        if other is not None and other.binds:
            continue
        why = other.refusal if other is not None else "no selector names it"
        return (
            f"IOMMU group {group.number} also holds {member.address}, bound to "
            f"{member.driver}, which stays there ({why}); the group would not be usable"
        )
    return ""
