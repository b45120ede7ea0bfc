"""Hypothesis strategies for whole hosts: `topologies()` and `snapshots()`.

Hypothesis is a test dependency only, so this is the one module of dp_server
that imports it; nothing at run time imports this module.

A topology is drawn as a list of hardware units (see `dp_testing.topology`) and
placed with `build_topology`, so addresses and group numbers are always
consistent and shrinking works on the parts a human reasons about: fewer
units, fewer VFs, drivers shrinking towards vfio-pci, the IOMMU on, no group
node missing, no mdevs.
"""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from dp_core import VFIO_DRIVER, HostSnapshot
from dp_testing.generator import (
    BRIDGES,
    ENDPOINTS,
    GPU_AUDIO,
    GPUS,
    SRIOV_CARDS,
    VGPU_TYPES,
    VIRTUAL_MDEV_PARENTS,
    Bridged,
    Function,
    MdevParent,
    Multifunction,
    Sriov,
    Unit,
    VirtualMdevParent,
    build_topology,
)
from dp_testing.topology import SHARED_DEV_PATHS, Topology, to_snapshot

__all__ = ["drivers", "numa_nodes", "snapshots", "topologies", "units"]

_BOOT_VGA = Function(0x1A03, 0x2000, 0x030000, "ast", boot_vga=True)


def drivers(host_driver: str) -> st.SearchStrategy[str | None]:
    """vfio-pci, no driver, or the device's host driver; shrinks towards vfio-pci."""
    return st.sampled_from((VFIO_DRIVER, None, host_driver))


def numa_nodes() -> st.SearchStrategy[int | None]:
    """A NUMA node 0..3, or None for a host that reports -1; shrinks towards 0."""
    return st.one_of(st.integers(0, 3), st.none())


def _function(entry: tuple[int, int, int, str]) -> st.SearchStrategy[Function]:
    vendor, device, class_code, host = entry
    return st.builds(Function, st.just(vendor), st.just(device), st.just(class_code), drivers(host))


def _catalogue_function(
    catalogue: tuple[tuple[int, int, int, str], ...],
) -> st.SearchStrategy[Function]:
    return st.sampled_from(catalogue).flatmap(_function)


@st.composite
def _gpu(draw: Any) -> Multifunction:
    gpu = draw(_catalogue_function(GPUS))
    functions = [gpu]
    if draw(st.booleans()):
        functions.append(draw(_function(GPU_AUDIO)))
    return Multifunction(functions, draw(numa_nodes()))


@st.composite
def _sriov(draw: Any, max_vfs: int) -> Sriov:
    vendor, pf_id, vf_id, class_code, pf_driver, vf_driver = draw(st.sampled_from(SRIOV_CARDS))
    pf = Function(vendor, pf_id, class_code, pf_driver)
    vf = _function((vendor, vf_id, class_code, vf_driver))
    return Sriov(pf, draw(st.lists(vf, max_size=max_vfs)), draw(numa_nodes()))


@st.composite
def _bridged(draw: Any, max_endpoints: int) -> Bridged:
    vendor, device = draw(st.sampled_from(BRIDGES))
    bridge = Function(vendor, device, 0x060400, draw(st.sampled_from((None, "pcieport"))))
    endpoints = draw(st.lists(_catalogue_function(ENDPOINTS), min_size=1, max_size=max_endpoints))
    return Bridged(bridge, endpoints, draw(numa_nodes()))


@st.composite
def _mdev_parent(draw: Any) -> MdevParent:
    vendor, device, class_code, host = draw(st.sampled_from(GPUS))
    offered = draw(st.lists(st.sampled_from(VGPU_TYPES), min_size=1, max_size=3, unique=True))
    types = [(type_id, name, draw(st.integers(0, 8))) for type_id, name in offered]
    created = draw(st.lists(st.integers(0, len(types) - 1), max_size=4))
    return MdevParent(
        Function(vendor, device, class_code, host), types, created, draw(numa_nodes())
    )


@st.composite
def _virtual_mdev_parent(draw: Any) -> VirtualMdevParent:
    name, offered = draw(st.sampled_from(VIRTUAL_MDEV_PARENTS))
    chosen = draw(
        st.lists(st.sampled_from(offered), min_size=1, max_size=len(offered), unique=True)
    )
    types = [(type_id, type_name, draw(st.integers(0, 8))) for type_id, type_name in chosen]
    created = draw(st.lists(st.integers(0, len(types) - 1), max_size=3))
    return VirtualMdevParent(name, types, created)


def units(max_vfs: int = 8, max_endpoints: int = 4) -> st.SearchStrategy[Unit]:
    """One hardware unit: an endpoint, a GPU (+audio), an SR-IOV card, a bridge, a vGPU
    parent, or an mdev parent that is no PCI function."""
    single = _catalogue_function(ENDPOINTS).map(lambda fn: Multifunction((fn,)))
    return st.one_of(
        single,
        _gpu(),
        _sriov(max_vfs),
        _bridged(max_endpoints),
        _mdev_parent(),
        _virtual_mdev_parent(),
    )


@st.composite
def topologies(draw: Any, max_devices: int = 60) -> Topology:
    """A valid host with at most `max_devices` PCI functions.

    Units that would exceed the budget are dropped (not truncated), so every
    drawn unit appears whole. Shrinks towards: few units, the IOMMU on, a boot
    VGA device absent, every group node present, no shared device nodes.
    """
    drawn: list[Unit] = draw(st.lists(units(), max_size=max(1, max_devices // 2)))
    chosen: list[Unit] = []
    if draw(st.booleans()) and max_devices > 0:
        chosen.append(Multifunction((_BOOT_VGA,), draw(numa_nodes())))
    total = len(chosen)
    for unit in drawn:
        if total + unit.size <= max_devices:
            chosen.append(unit)
            total += unit.size
    no_iommu = draw(st.booleans())
    omit = draw(st.frozensets(st.integers(0, max_devices + 16), max_size=3))
    shared = draw(st.sets(st.sampled_from(SHARED_DEV_PATHS)))
    uuid_seed = draw(st.integers(0, 2**32 - 1))
    return build_topology(
        chosen,
        iommu=not no_iommu,
        omit_group_nodes=omit,
        shared_dev_nodes=shared,
        uuid_seed=uuid_seed,
    )


def snapshots(max_devices: int = 60) -> st.SearchStrategy[HostSnapshot]:
    """The snapshot of a drawn topology, for core tests that need no disk."""
    return topologies(max_devices=max_devices).map(to_snapshot)
