"""IOMMU groups for the scanner: the kernel's member lists checked against each function's link."""

from __future__ import annotations

from collections.abc import Callable

from dp_core import IommuGroup, MdevDevice, PciDevice

__all__ = ["cross_checked_groups"]


def cross_checked_groups(
    sysfs_root: str,
    kernel_groups: dict[int, list[str] | None] | None,
    devices: dict[str, PciDevice],
    mdevs: list[MdevDevice],
    problem: Callable[[str, str], None],
) -> list[IommuGroup]:
    """Cross-check the groups the kernel lists against each function's own link.

    Members are the union of both views. A group is left out when the kernel
    lists a member we could not read, lists a function whose own link names
    another group, or its member list was unreadable: a group with an unknown
    member has unknown viability, and leaving it out makes every function in it
    look group-less to the core, which is the safe reading.

    `kernel_groups` are the members each `kernel/iommu_groups/<n>/devices`
    lists (None where unreadable; None as a whole if the groups could not be
    listed), `devices` the functions read, by `bus/pci/devices` name and in
    address order, so members come out sorted. Each disagreement is reported
    through `problem(path, reason)`.
    """
    groups_dir = f"{sysfs_root}/kernel/iommu_groups"
    mdev_names = {m.uuid for m in mdevs}
    # Names only: a list per group is far smaller than a dict per group.
    claims: dict[int, list[str]] = {}
    for name, dev in devices.items():
        if dev.iommu_group is not None:
            claims.setdefault(dev.iommu_group, []).append(name)
    numbers = set(claims) | {m.iommu_group for m in mdevs if m.iommu_group is not None}
    if kernel_groups is not None:
        numbers |= set(kernel_groups)

    result = []
    for number in sorted(numbers):
        claimed = claims.get(number, [])
        if kernel_groups is not None and number in kernel_groups:
            listed = kernel_groups[number]
            if listed is None:
                continue  # unreadable member list, already reported
            trusted = True
            confirmed = 0
            for name in listed:
                member = devices.get(name)
                if member is not None and member.iommu_group == number:
                    confirmed += 1
                    continue
                if member is None and name in mdev_names:
                    continue
                if member is None:
                    reason = "member is not a readable device"
                else:
                    reason = f"member's own iommu_group link names {member.iommu_group}"
                problem(
                    f"{groups_dir}/{number}/devices/{name}",
                    f"{reason}; group left out of the snapshot",
                )
                trusted = False
            if confirmed != len(claimed):
                listed_names = set(listed)
                for name in claimed:
                    if name not in listed_names:
                        problem(
                            f"{sysfs_root}/bus/pci/devices/{name}/iommu_group",
                            f"names group {number}, which does not list it; counted as a member",
                        )
            if not trusted:
                continue
        result.append(IommuGroup(number, tuple(devices[name] for name in claimed)))
    return result
