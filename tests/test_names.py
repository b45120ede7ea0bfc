"""Resource names (kubelet rules), KubeVirt env names, PCI ID database names."""

from __future__ import annotations

import gzip
import re
from pathlib import Path

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from dp_core import PciId
from dp_core.config.names import (
    DEFAULT_DOMAIN,
    default_pci_resource_name,
    env_var_name,
    normalize_pci_ids_name,
    parse_pci_ids,
    pci_ids_resource_name,
    resource_name_error,
)
from dp_server.config.loader import ConfigFileError
from dp_server.config.pci_ids import PCI_IDS_SEARCH_PATHS, find_pci_ids, load_pci_names
from dp_testing.emulator._rpc import is_extended_resource_name

SAMPLE = Path(__file__).resolve().parent / "data" / "pci.ids"


# --- resource_name_error ---------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    [
        "devices.kubevirt.io/10de_1eb8",
        "nvidia.com/TU106_GEFORCE_RTX_2060_REV__A",
        "nvidia.com/TU104GL_Tesla_T4",
        "nvidia.com/GRID_T4-1Q",
        "intel.com/qat",
        "devices.kubevirt.io/vhost-net",
        "a/b",
        "example.com/" + "x" * 63,
        "my-domain.example.com/a.b_c-d",
        "1.2.3/x",
        # 244 characters of domain: with "requests." in front, exactly 253.
        ".".join(["a" * 60] * 3) + "." + "b" * 61 + "/x",
    ],
)
def test_valid_resource_names(name: str) -> None:
    assert resource_name_error(name) is None


@pytest.mark.parametrize(
    ("name", "fragment"),
    [
        ("nvidia", "is not of the form <domain>/<name>"),
        ("", "is not of the form <domain>/<name>"),
        ("kubernetes.io/foo", "kubernetes.io namespace"),
        ("foo.kubernetes.io/bar", "kubernetes.io namespace"),
        ("NVIDIA.com/x", "domain 'NVIDIA.com' is not a DNS-1123 subdomain"),
        ("/x", "domain '' is not a DNS-1123 subdomain"),
        ("-nvidia.com/x", "is not a DNS-1123 subdomain"),
        ("nvidia..com/x", "is not a DNS-1123 subdomain"),
        ("nvidia_com/x", "is not a DNS-1123 subdomain"),
        ("nvidia.com/" + "x" * 64, "must be 1-63 characters"),
        ("nvidia.com/-x", "must be 1-63 characters"),
        ("nvidia.com/x-", "must be 1-63 characters"),
        ("nvidia.com/", "name '' must be 1-63 characters"),
        ("nvidia.com/a b", "must be 1-63 characters"),
        ("nvidia.com/a/b", "must be 1-63 characters"),
        # 245 characters of domain: "requests." + domain is 254 > 253.
        (".".join(["a" * 60] * 3) + "." + "b" * 62 + "/x", "is not a DNS-1123 subdomain"),
    ],
)
def test_invalid_resource_names(name: str, fragment: str) -> None:
    error = resource_name_error(name)
    assert error is not None
    assert fragment in error
    assert repr(name) in error


def test_requests_prefix_is_refused() -> None:
    assert resource_name_error("requests.example.com/foo") is not None


# The kubelet's rule (k8s.io/kubernetes pkg/apis/core/v1/helper IsExtendedResourceName
# and apimachinery IsQualifiedName), written out independently as an oracle.
# The emulator's copy of the kubelet's rule is written independently of
# dp_core.config.names, so it serves as the oracle here.
kubelet_accepts = is_extended_resource_name


_labels = st.sampled_from(
    ["nvidia", "com", "io", "kubevirt", "devices", "intel", "a", "x1", "my-domain", "kubernetes",
     "requests", "", "-a", "a-", "A", "a_b", "9"]
)  # fmt: skip
_names = st.sampled_from(
    ["qat", "TU104GL_Tesla_T4", "GRID_T4-1Q", "a.b", "-a", "a-", "_x", "x_", "a b", "", "Ü",
     "x" * 63, "x" * 64, "a/b", "10de_1eb8"]
)  # fmt: skip


@st.composite
def candidate_names(draw: st.DrawFn) -> str:
    domain = ".".join(draw(st.lists(_labels, min_size=0, max_size=4)))
    if draw(st.integers(0, 9)) == 0:
        return domain  # no slash at all
    name = draw(_names | st.from_regex(r"\A[-A-Za-z0-9_.]{0,70}\Z"))
    return f"{domain}/{name}"


@given(candidate_names())
def test_resource_name_error_agrees_with_the_kubelet(name: str) -> None:
    assert (resource_name_error(name) is None) == kubelet_accepts(name)


_valid_names = st.from_regex(
    r"\A[a-z0-9]([-a-z0-9]{0,10}[a-z0-9])?(\.[a-z0-9]([-a-z0-9]{0,10}[a-z0-9])?){0,3}"
    r"/[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?\Z"
)


@given(_valid_names)
def test_accepted_names_make_kubevirt_env_names(name: str) -> None:
    assume(resource_name_error(name) is None)
    for prefix in ("PCI_RESOURCE_", "MDEV_PCI_RESOURCE_"):
        env = env_var_name(prefix, name)
        assert env.startswith(prefix)
        assert re.fullmatch(r"[A-Z0-9_-]+", env[len(prefix) :])
        # Same length: one character of the env name per character of the resource name.
        assert len(env) == len(prefix) + len(name)
        assert env == env.upper()


# --- env_var_name --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prefix", "resource", "expected"),
    [
        ("PCI_RESOURCE_", "nvidia.com/TU104GL_Tesla_T4", "NVIDIA_COM_TU104GL_TESLA_T4"),
        ("PCI_RESOURCE_", "devices.kubevirt.io/10de_1eb8", "DEVICES_KUBEVIRT_IO_10DE_1EB8"),
        ("MDEV_PCI_RESOURCE_", "nvidia.com/GRID_T4-1Q", "NVIDIA_COM_GRID_T4-1Q"),
        ("PCI_RESOURCE_", "intel.com/qat_vf", "INTEL_COM_QAT_VF"),
    ],
)
def test_env_var_name(prefix: str, resource: str, expected: str) -> None:
    assert env_var_name(prefix, resource) == prefix + expected


def test_env_var_name_t4() -> None:
    assert (
        env_var_name("PCI_RESOURCE_", "nvidia.com/TU104GL_Tesla_T4")
        == "PCI_RESOURCE_NVIDIA_COM_TU104GL_TESLA_T4"
    )


# --- PCI ID database names -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("device_name", "expected"),
    [
        ("TU106 [GeForce RTX 2060 Rev. A]", "TU106_GEFORCE_RTX_2060_REV__A"),
        ("TU102 [GeForce RTX 2080 Ti Rev. A]", "TU102_GEFORCE_RTX_2080_TI_REV__A"),
        ("TU104GL [Tesla T4]", "TU104GL_TESLA_T4"),
        ("TU102GL [Quadro RTX 6000/8000]", "TU102GL_QUADRO_RTX_6000_8000"),
        ("NV1 [STG2000X-B Series]", "NV1_STG2000XB_SERIES"),
        ("NVMe SSD Controller SM981/PM981/PM983", "NVME_SSD_CONTROLLER_SM981_PM981_PM983"),
        ("a  \t b", "A_B"),
        ("HD 7970 IceQ X²", "HD_7970_ICEQ_X"),
        ("", ""),
        ("[]()", ""),
    ],
)
def test_normalize_pci_ids_name(device_name: str, expected: str) -> None:
    assert normalize_pci_ids_name(device_name) == expected


@given(st.text())
def test_normalized_names_use_only_upper_digits_underscore(text: str) -> None:
    assert re.fullmatch(r"[A-Z0-9_]*", normalize_pci_ids_name(text))


def test_default_pci_resource_name() -> None:
    assert default_pci_resource_name(PciId(0x10DE, 0x1EB8)) == "devices.kubevirt.io/10de_1eb8"
    assert default_pci_resource_name(PciId(0x8086, 0x4941), "intel.com") == "intel.com/8086_4941"
    assert DEFAULT_DOMAIN == "devices.kubevirt.io"


def test_pci_ids_resource_name() -> None:
    names = {PciId(0x10DE, 0x1F08): "TU106 [GeForce RTX 2060 Rev. A]"}
    assert (
        pci_ids_resource_name(PciId(0x10DE, 0x1F08), names, "nvidia.com")
        == "nvidia.com/TU106_GEFORCE_RTX_2060_REV__A"
    )


@pytest.mark.parametrize(
    "names",
    [
        {},  # not in the database
        {PciId(0x10DE, 0x1EB8): ""},  # empty name
        {PciId(0x10DE, 0x1EB8): "[]"},  # empty after normalization
        {PciId(0x10DE, 0x1EB8): "x" * 64},  # too long
        {PciId(0x10DE, 0x1EB8): "Tesla T4 ."},  # ends with '_'
        {PciId(0x10DE, 0x1EB8): "_Tesla T4"},  # starts with '_'
    ],
)
def test_pci_ids_resource_name_falls_back(names: dict[PciId, str]) -> None:
    pci_id = PciId(0x10DE, 0x1EB8)
    assert pci_ids_resource_name(pci_id, names, "nvidia.com") == "nvidia.com/10de_1eb8"


@given(st.text(), st.integers(0, 0xFFFF), st.integers(0, 0xFFFF))
def test_pci_ids_resource_name_is_always_valid(device_name: str, vendor: int, device: int) -> None:
    pci_id = PciId(vendor, device)
    name = pci_ids_resource_name(pci_id, {pci_id: device_name})
    assert resource_name_error(name) is None


# --- parse_pci_ids on the committed sample ------------------------------------------------


def sample_names() -> dict[PciId, str]:
    return parse_pci_ids(SAMPLE.read_text(encoding="utf-8"))


def test_parse_pci_ids_devices() -> None:
    names = sample_names()
    assert names[PciId(0x10DE, 0x1E07)] == "TU102 [GeForce RTX 2080 Ti Rev. A]"
    assert names[PciId(0x10DE, 0x1F08)] == "TU106 [GeForce RTX 2060 Rev. A]"
    assert names[PciId(0x10DE, 0x1EB8)] == "TU104GL [Tesla T4]"
    assert names[PciId(0x144D, 0xA808)] == "NVMe SSD Controller SM981/PM981/PM983"
    assert names[PciId(0x8086, 0x37C9)] == "C62x Chipset QuickAssist Technology Virtual Function"
    # A device line after a comment line still belongs to its vendor.
    assert names[PciId(0x0010, 0x8139)] == "AT-2500TX V3 Ethernet"


def test_parse_pci_ids_skips_subsystems_and_classes() -> None:
    names = sample_names()
    # Subsystem lines ("\t\t10de 129e  Quadro RTX 8000") are not devices.
    assert "Quadro RTX 8000" not in names.values()
    assert "RTX 2080 Ti GAMING X TRIO" not in names.values()
    # Class lines ("C 06  Bridge", "\t04  PCI bridge") are not devices.
    assert "PCI bridge" not in names.values()
    assert "Bridge" not in names.values()
    assert len(names) == 12


def test_parse_pci_ids_ignores_garbage() -> None:
    text = (
        "10de  NVIDIA\n\tzzzz  bad\n\t1eb8 one space\n\t1eb8  Tesla T4\n"
        "not a vendor\n\t0001  orphan\n"
    )
    assert parse_pci_ids(text) == {PciId(0x10DE, 0x1EB8): "Tesla T4"}


# --- dp_server.config.pci_ids: finding and reading the file ---


def test_search_paths() -> None:
    assert PCI_IDS_SEARCH_PATHS == (
        "/usr/share/misc/pci.ids",
        "/usr/share/hwdata/pci.ids",
        "/usr/share/pci.ids",
        "/usr/local/share/pci.ids",
    )


def test_find_pci_ids_explicit() -> None:
    assert find_pci_ids(str(SAMPLE)) == SAMPLE


@pytest.mark.parametrize("kind", ["missing", "directory"])
def test_find_pci_ids_explicit_must_exist(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "pci.ids"
    if kind == "directory":
        path.mkdir()
    with pytest.raises(ConfigFileError) as info:
        find_pci_ids(str(path), search_paths=[str(SAMPLE)])
    reason = "does not exist" if kind == "missing" else "is not a file"
    assert str(info.value) == f"naming.pciIdsPath: {str(path)!r} {reason}"


def test_find_pci_ids_searches_in_order(tmp_path: Path) -> None:
    first, second = tmp_path / "a" / "pci.ids", tmp_path / "b" / "pci.ids"
    second.parent.mkdir()
    second.write_text("")
    assert find_pci_ids(search_paths=[first, second]) == second
    first.parent.mkdir()
    first.write_text("")
    assert find_pci_ids(search_paths=[first, second]) == first


def test_find_pci_ids_gzip_variant(tmp_path: Path) -> None:
    plain = tmp_path / "pci.ids"
    gz = tmp_path / "pci.ids.gz"
    gz.write_bytes(gzip.compress(b""))
    assert find_pci_ids(search_paths=[plain]) == gz
    plain.write_text("")
    assert find_pci_ids(search_paths=[plain]) == plain


def test_find_pci_ids_none(tmp_path: Path) -> None:
    assert find_pci_ids(search_paths=[tmp_path / "pci.ids"]) is None


def test_load_pci_names_plain_and_gzip(tmp_path: Path) -> None:
    gz = tmp_path / "pci.ids.gz"
    gz.write_bytes(gzip.compress(SAMPLE.read_bytes()))
    assert load_pci_names(SAMPLE) == sample_names()
    assert load_pci_names(gz) == sample_names()


def test_load_pci_names_bad_utf8_is_replaced(tmp_path: Path) -> None:
    path = tmp_path / "pci.ids"
    path.write_bytes(b"10de  NVIDIA\n\t1eb8  Tesla \xff T4\n")
    assert load_pci_names(path) == {PciId(0x10DE, 0x1EB8): "Tesla \ufffd T4"}


def test_load_pci_names_errors_name_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "pci.ids"
    with pytest.raises(ConfigFileError, match=re.escape(f"{missing}: cannot read")):
        load_pci_names(missing)
    broken = tmp_path / "pci.ids.gz"
    broken.write_bytes(gzip.compress(b"10de  NVIDIA\n")[:-6])
    with pytest.raises(ConfigFileError, match=re.escape(f"{broken}: cannot read")):
        load_pci_names(broken)


def test_sample_names_resources() -> None:
    names = load_pci_names(SAMPLE)
    assert (
        pci_ids_resource_name(PciId(0x10DE, 0x1F08), names, "nvidia.com")
        == "nvidia.com/TU106_GEFORCE_RTX_2060_REV__A"
    )
    assert (
        pci_ids_resource_name(PciId(0x10DE, 0x1E07), names, "nvidia.com")
        == "nvidia.com/TU102_GEFORCE_RTX_2080_TI_REV__A"
    )
    assert pci_ids_resource_name(PciId(0x10DE, 0xFFFF), names) == "devices.kubevirt.io/10de_ffff"
