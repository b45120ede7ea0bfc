"""dp_core.host.pci and dp_core.host: addresses, IDs, functions and IOMMU group viability."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dp_core import VFIO_DRIVER, IommuGroup, PciAddress, PciDevice, PciId
from dp_core.host import Viability

addresses = st.builds(
    PciAddress,
    domain=st.integers(0, 0xFFFFFFFF),
    bus=st.integers(0, 0xFF),
    slot=st.integers(0, 0x1F),
    function=st.integers(0, 7),
)


# --- PciAddress ----------------------------------------------------------------------


@given(addresses)
def test_address_str_parse_round_trip(address: PciAddress) -> None:
    assert PciAddress.parse(str(address)) == address


@given(addresses)
def test_address_upper_case_parses_the_same(address: PciAddress) -> None:
    assert PciAddress.parse(str(address).upper()) == address


@given(addresses)
def test_address_str_is_sysfs_form(address: PciAddress) -> None:
    text = str(address)
    assert text == text.lower()
    domain, bus, slot_function = text.split(":")
    assert len(domain) >= 4 and len(bus) == 2 and len(slot_function) == 4


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0000:3b:00.0", PciAddress(0, 0x3B, 0, 0)),
        ("0000:AF:1F.7", PciAddress(0, 0xAF, 0x1F, 7)),
        ("10000:00:01.1", PciAddress(0x10000, 0, 1, 1)),
        (" 0000:00:02.0\n", PciAddress(0, 0, 2, 0)),
    ],
)
def test_address_parse(text: str, expected: PciAddress) -> None:
    assert PciAddress.parse(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "",
        "3b:00.0",  # no domain
        "000:3b:00.0",  # domain too short
        "000000000:3b:00.0",  # domain too long
        "0000:3b:00",  # no function
        "0000:3b:00.8",  # function > 7
        "0000:3b:20.0",  # slot > 0x1f
        "0000:3b:0.0",  # slot one digit
        "0000:3g:00.0",  # not hex
        "0000-3b-00.0",
        "0000:3b:00.0.1",
    ],
)
def test_address_parse_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        PciAddress.parse(text)


@pytest.mark.parametrize(
    "fields",
    [(-1, 0, 0, 0), (0, 0x100, 0, 0), (0, 0, 0x20, 0), (0, 0, 0, 8), (0, True, 0, 0)],
)
def test_address_fields_are_checked(fields: tuple[int, int, int, int]) -> None:
    with pytest.raises(ValueError):
        PciAddress(*fields)


def test_address_ordering() -> None:
    texts = ["0001:00:00.0", "0000:3b:00.1", "0000:3b:00.0", "0000:af:00.0", "0000:3b:01.0"]
    ordered = sorted(PciAddress.parse(t) for t in texts)
    assert [str(a) for a in ordered] == [
        "0000:3b:00.0",
        "0000:3b:00.1",
        "0000:3b:01.0",
        "0000:af:00.0",
        "0001:00:00.0",
    ]


@given(addresses, addresses)
def test_address_order_is_field_order(a: PciAddress, b: PciAddress) -> None:
    key = lambda x: (x.domain, x.bus, x.slot, x.function)  # noqa: E731
    assert (a < b) == (key(a) < key(b))
    assert (a == b) == (key(a) == key(b))


def test_address_is_hashable_and_frozen() -> None:
    address = PciAddress.parse("0000:3b:00.0")
    assert {address: 1}[PciAddress(0, 0x3B, 0, 0)] == 1
    with pytest.raises(AttributeError):
        address.bus = 1  # type: ignore[misc]


# --- PciId --------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["10DE:1EB8", "10de:1eb8", "10De:1eB8", " 10de:1eb8 "])
def test_pci_id_parse_case_insensitive(text: str) -> None:
    assert PciId.parse(text) == PciId(0x10DE, 0x1EB8)


def test_pci_id_str_is_lower_case() -> None:
    assert str(PciId.parse("10DE:1EB8")) == "10de:1eb8"


@given(st.integers(0, 0xFFFF), st.integers(0, 0xFFFF))
def test_pci_id_round_trip(vendor: int, device: int) -> None:
    pci_id = PciId(vendor, device)
    assert PciId.parse(str(pci_id)) == pci_id
    assert PciId.parse(str(pci_id).upper()) == pci_id


@pytest.mark.parametrize("text", ["", "10de", "10de1eb8", "10de:1eb", "10de:1eb8a", "ZZZZ:1EB8"])
def test_pci_id_parse_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="is not VVVV:DDDD hex"):
        PciId.parse(text)


def test_pci_id_range() -> None:
    with pytest.raises(ValueError):
        PciId(0x10000, 0)
    with pytest.raises(ValueError):
        PciId(0, -1)


# --- PciDevice ------------------------------------------------------------------------------

GPU = PciAddress.parse("0000:3b:00.0")


def device(**overrides: object) -> PciDevice:
    fields: dict[str, object] = {
        "address": GPU,
        "vendor": 0x10DE,
        "device": 0x1EB8,
        "class_code": 0x030200,
    }
    fields.update(overrides)
    return PciDevice(**fields)  # type: ignore[arg-type]


def test_pci_device_defaults_and_properties() -> None:
    gpu = device()
    assert gpu.pci_id == PciId(0x10DE, 0x1EB8)
    assert gpu.driver is None and gpu.iommu_group is None and gpu.numa_node is None
    assert not gpu.is_bridge
    assert not gpu.is_virtual_function
    assert not gpu.boot_vga


@pytest.mark.parametrize(
    "overrides",
    [
        {"vendor": 0x10000},
        {"vendor": -1},
        {"device": 0x10000},
        {"class_code": 0x1000000},
        {"numa_node": -1},
        {"numa_node": -2},
    ],
)
def test_pci_device_rejects(overrides: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        device(**overrides)


@pytest.mark.parametrize("numa", [None, 0, 1, 7])
def test_pci_device_numa(numa: int | None) -> None:
    assert device(numa_node=numa).numa_node == numa


@pytest.mark.parametrize(
    ("class_code", "bridge"),
    [(0x060400, True), (0x060000, True), (0x030000, False), (0x010802, False), (0x120000, False)],
)
def test_pci_device_is_bridge(class_code: int, bridge: bool) -> None:
    assert device(class_code=class_code).is_bridge is bridge


def test_pci_device_virtual_function() -> None:
    vf = device(
        address=PciAddress.parse("0000:3d:00.1"),
        vendor=0x8086,
        device=0x4941,
        physfn=PciAddress.parse("0000:3d:00.0"),
    )
    assert vf.is_virtual_function


# --- IommuGroup.viability ---------------------------------------------------------------------


def member(address: str, driver: str | None, class_code: int = 0x030200) -> PciDevice:
    return PciDevice(
        PciAddress.parse(address), 0x10DE, 0x1EB8, class_code, driver=driver, iommu_group=12
    )


BRIDGE = 0x060400
AUDIO = 0x040300


@pytest.mark.parametrize(
    ("members", "viable", "blockers"),
    [
        pytest.param(
            [member("0000:3b:00.0", VFIO_DRIVER)],
            True,
            [],
            id="one-vfio-function",
        ),
        pytest.param(
            [member("0000:3b:00.0", VFIO_DRIVER), member("0000:3b:00.1", VFIO_DRIVER, AUDIO)],
            True,
            [],
            id="all-vfio",
        ),
        pytest.param(
            [member("0000:3b:00.0", VFIO_DRIVER), member("0000:3b:00.1", "snd_hda_intel", AUDIO)],
            False,
            [("0000:3b:00.1", "snd_hda_intel")],
            id="one-endpoint-on-host-driver",
        ),
        pytest.param(
            [
                member("0000:3a:00.0", "pcieport", BRIDGE),
                member("0000:3b:00.0", VFIO_DRIVER),
            ],
            True,
            [],
            id="bridge-on-its-port-driver-ignored",
        ),
        pytest.param(
            [
                member("0000:00:1f.0", "lpc_ich", 0x060100),
                member("0000:00:1f.3", VFIO_DRIVER, AUDIO),
            ],
            False,
            [("0000:00:1f.0", "lpc_ich")],
            # Bridge class, ordinary header and a driver that does DMA: the kernel
            # keeps the group from VFIO (a chipset's LPC bridge beside its audio).
            id="isa-bridge-on-a-host-driver-blocks",
        ),
        pytest.param(
            [member("0000:00:00.0", None, 0x060000), member("0000:00:00.1", VFIO_DRIVER)],
            True,
            [],
            id="host-bridge-without-driver-ok",
        ),
        pytest.param(
            [member("0000:3b:00.0", VFIO_DRIVER), member("0000:3b:00.1", None, AUDIO)],
            True,
            [],
            id="endpoint-without-driver-ok",
        ),
        pytest.param(
            [
                member("0000:3a:00.0", "pcieport", BRIDGE),
                member("0000:3b:00.0", "nvidia"),
                member("0000:3b:00.1", "snd_hda_intel", AUDIO),
            ],
            False,
            [("0000:3b:00.0", "nvidia"), ("0000:3b:00.1", "snd_hda_intel")],
            id="every-host-endpoint-listed",
        ),
        pytest.param([], True, [], id="empty"),
    ],
)
def test_viability(members: list[PciDevice], viable: bool, blockers: list[tuple[str, str]]) -> None:
    result = IommuGroup(12, members).viability
    assert result.viable is viable
    assert [(str(a), d) for a, d in result.blockers] == blockers
    if viable:
        assert result.reason == ""
    else:
        for address, driver in blockers:
            assert f"{address} is bound to {driver}" in result.reason


def test_viability_reason_text() -> None:
    result = Viability(False, ((PciAddress.parse("0000:3b:00.1"), "snd_hda_intel"),))
    assert result.reason == "0000:3b:00.1 is bound to snd_hda_intel"


def test_endpoints_exclude_bridges() -> None:
    group = IommuGroup(
        3, [member("0000:3a:00.0", "pcieport", BRIDGE), member("0000:3b:00.0", VFIO_DRIVER)]
    )
    assert [str(m.address) for m in group.endpoints] == ["0000:3b:00.0"]


def test_group_number_must_not_be_negative() -> None:
    with pytest.raises(ValueError):
        IommuGroup(-1, [])
