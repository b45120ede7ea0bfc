"""What `serve` logs of what `scan` explains: once when it first holds, again
only when it changes or stops holding, never at every rescan."""

from __future__ import annotations

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dp_core import Config, HostObserved, HostSnapshot, Log, StandardNode, build_inventory
from dp_core.config import Dra, PciHostDevice, PermittedHostDevices
from dp_core.explain import Explainer, findings
from dp_core.host.pci import PciId
from dp_core.inventory import OFFERED_BY_DRA
from dp_testing.topology import fixture_topology, to_snapshot

HOST = to_snapshot(fixture_topology())
# The same host, read again: equal, and a new object, as every rescan gives.
HOST_AGAIN = to_snapshot(fixture_topology())
NO_IOMMU = attrs.evolve(HOST, iommu_groups=())


def config(*selectors: str) -> Config:
    entries = tuple(
        PciHostDevice(PciId.parse(s), resource_name=f"example.com/d{i}")
        for i, s in enumerate(selectors)
    )
    return Config(PermittedHostDevices(pci_host_devices=entries))


T4 = config("10DE:1EB8")
TYPO = config("10DE:1EB9")  # matches nothing; 10DE:1EB8 is the nearest
NIC = config("8086:1572")  # held by i40e, and no binding section: skipped


def logs(explainer: Explainer, snapshot: HostSnapshot, cfg: Config) -> list[Log]:
    return explainer.changed(snapshot, cfg, build_inventory(snapshot, cfg), scanned=True)


def events(found: list[Log]) -> list[tuple[str, str, dict[str, object]]]:
    return [(log.level, log.event, dict(log.fields)) for log in found]


@pytest.mark.parametrize(
    "snapshot, cfg, expected",
    [
        (HOST, T4, []),
        (
            HOST,
            TYPO,
            [
                (
                    "warning",
                    "selector-matches-nothing",
                    {
                        "entry": "pciHostDevices[0]",
                        "selector": "10DE:1EB9",
                        "resource": "example.com/d0",
                        "reason": "no PCI function on this host has the ID 10DE:1EB9; "
                        "the nearest is 10DE:1EB8 (3 functions)",
                    },
                )
            ],
        ),
        (
            HOST,
            NIC,
            [
                (
                    "info",
                    "devices-skipped",
                    {
                        "resource": "example.com/d0",
                        "devices": "0000:18:00.0",
                        "reason": "bound to host driver i40e; no binding policy moves it to "
                        "vfio-pci",
                    },
                )
            ],
        ),
    ],
    ids=["all-served", "selector-matches-nothing", "skipped"],
)
def test_at_start_each_finding_is_logged_once(
    snapshot: HostSnapshot, cfg: Config, expected: list[tuple[str, str, dict[str, object]]]
) -> None:
    explainer = Explainer()
    assert events(logs(explainer, snapshot, cfg)) == expected
    # A rescan of the same host says nothing again.
    assert logs(explainer, HOST_AGAIN, cfg) == []


def test_a_host_without_iommu_groups_is_named() -> None:
    found = events(logs(Explainer(), NO_IOMMU, T4))
    (iommu,) = [f for f in found if f[1] == "no-iommu-groups"]
    assert iommu[0] == "warning"
    assert str(iommu[2]["reason"]).startswith(
        "no IOMMU groups under /sys/kernel/iommu_groups: the IOMMU is off"
    )


def test_what_stops_holding_is_said_once_and_what_comes_is_said() -> None:
    explainer = Explainer()
    logs(explainer, HOST, TYPO)
    fixed = events(logs(explainer, HOST, T4))
    assert fixed == [
        (
            "info",
            "explained-no-longer",
            {
                "was": "selector-matches-nothing",
                "entry": "pciHostDevices[0]",
                "selector": "10DE:1EB9",
                "resource": "example.com/d0",
                "reason": "no PCI function on this host has the ID 10DE:1EB9; "
                "the nearest is 10DE:1EB8 (3 functions)",
            },
        )
    ]
    assert [e[1] for e in events(logs(explainer, NO_IOMMU, T4))] == ["no-iommu-groups"]


def test_a_device_the_dra_front_end_offers_is_not_said_to_be_skipped() -> None:
    on_dra = Config(
        PermittedHostDevices(
            pci_host_devices=(
                PciHostDevice(
                    PciId.parse("10DE:1EB8"), resource_name="nvidia.com/T4", frontend="dra"
                ),
                PciHostDevice(PciId.parse("8086:1572"), resource_name="intel.com/x710"),
            )
        ),
        dra=Dra("vfio.example.com"),
    )
    inventory = build_inventory(HOST, on_dra)
    assert any(s.reason == OFFERED_BY_DRA for s in inventory.skipped)  # the API's view
    said = events(Explainer().changed(HOST, on_dra, inventory, scanned=True))
    assert [(e[1], e[2]["resource"]) for e in said] == [("devices-skipped", "intel.com/x710")]


def test_nothing_before_the_first_scan() -> None:
    empty = HostSnapshot()
    assert Explainer().changed(empty, TYPO, build_inventory(empty, TYPO), scanned=False) == []


def test_the_node_logs_it_when_it_rebuilds_its_inventory() -> None:
    node = StandardNode(TYPO)
    first = [e for e in node.handle(HostObserved(HOST, 1.0)) if isinstance(e, Log)]
    assert [log.event for log in first if log.event == "selector-matches-nothing"] == [
        "selector-matches-nothing"
    ]
    again = [e for e in node.handle(HostObserved(HOST_AGAIN, 2.0)) if isinstance(e, Log)]
    assert all(log.event != "selector-matches-nothing" for log in again)


STATES = [(HOST, T4), (HOST_AGAIN, T4), (HOST, TYPO), (HOST, NIC), (NO_IOMMU, T4), (NO_IOMMU, NIC)]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(STATES), min_size=1, max_size=8))
def test_the_logs_are_exactly_what_changed(sequence: list[tuple[HostSnapshot, Config]]) -> None:
    """After each rebuild: the new findings logged, the ones gone said to be
    over, and nothing for a finding that held before and holds now."""
    explainer = Explainer()
    before: frozenset[object] = frozenset()
    for snapshot, cfg in sequence:
        inventory = build_inventory(snapshot, cfg)
        now = findings(cfg, snapshot, inventory)
        said = explainer.changed(snapshot, cfg, inventory, scanned=True)
        new = {f.log() for f in now - before}  # type: ignore[operator]
        over = [log for log in said if log.event == "explained-no-longer"]
        assert {log for log in said if log.event != "explained-no-longer"} == new
        assert len(over) == len(before - now)
        assert len(said) == len(new) + len(over)
        before = now
