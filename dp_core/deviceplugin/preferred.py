"""Preferred allocations: which devices to hand a container, packed into as
few NUMA nodes and IOMMU groups as the request allows."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from ..inventory.advertised import AdvertisedDevice

__all__ = ["preferred_devices"]


def preferred_devices(
    available: Sequence[AdvertisedDevice],
    must_include: Sequence[AdvertisedDevice],
    size: int,
) -> tuple[str, ...]:
    """Pick `size` devices, packing into as few NUMA nodes and IOMMU groups as we can.

    Must-include devices always come first. The rest are taken from the NUMA
    node that can hold the whole request (preferring nodes the must-include
    devices are on, then the fullest), and within it from groups already in
    use, then from the groups with the most free devices. Ties break on ID so
    the answer is deterministic.
    """
    chosen = list(dict.fromkeys(d.id for d in must_include))
    if len(chosen) >= size:
        return tuple(chosen)
    chosen_set = set(chosen)
    free = [d for d in available if d.id not in chosen_set]
    need = size - len(chosen)
    by_node: dict[int | None, list[AdvertisedDevice]] = {}
    for device in free:
        by_node.setdefault(device.numa_node, []).append(device)
    must_nodes = Counter(d.numa_node for d in must_include)
    node_order = sorted(
        by_node,
        key=lambda node: (
            -must_nodes.get(node, 0),
            len(by_node[node]) < need,
            -len(by_node[node]),
            -1 if node is None else node,
        ),
    )
    used_groups = {d.iommu_group for d in must_include if d.iommu_group is not None}
    for node in node_order:
        if need <= 0:
            break
        picks = _pack_groups(by_node[node], used_groups, need)
        chosen.extend(d.id for d in picks)
        used_groups.update(d.iommu_group for d in picks if d.iommu_group is not None)
        need -= len(picks)
    return tuple(chosen)


def _pack_groups(
    candidates: Sequence[AdvertisedDevice], used_groups: set[int], need: int
) -> list[AdvertisedDevice]:
    groups: dict[int | None, list[AdvertisedDevice]] = {}
    for device in sorted(candidates, key=lambda d: d.id):
        groups.setdefault(device.iommu_group, []).append(device)

    def rank(group: int | None) -> tuple[bool, bool, int, int]:
        members = groups[group]
        return (
            group not in used_groups,
            # A group that fits entirely is better than one we would split.
            len(members) > need,
            -len(members),
            -1 if group is None else group,
        )

    picks: list[AdvertisedDevice] = []
    for group in sorted(groups, key=rank):
        for device in groups[group]:
            if len(picks) == need:
                return picks
            picks.append(device)
    return picks
