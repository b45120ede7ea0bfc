"""Resource names and the names derived from them.

The rules are the kubelet's (an extended resource name is a qualified name
outside `kubernetes.io/`) and KubeVirt's (env var names, PCI ID database names).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from ..host.pci import PciId

__all__ = [
    "DEFAULT_DOMAIN",
    "MAX_DEVICE_ID_LENGTH",
    "default_pci_resource_name",
    "env_var_name",
    "normalize_pci_ids_name",
    "parse_pci_ids",
    "pci_ids_resource_name",
    "resource_name_error",
]

DEFAULT_DOMAIN = "devices.kubevirt.io"
MAX_DEVICE_ID_LENGTH = 63

_DNS1123_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS1123_SUBDOMAIN = re.compile(rf"^{_DNS1123_LABEL}(\.{_DNS1123_LABEL})*$")
_QUALIFIED_NAME_PART = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
# The kubelet checks `requests.<name>` too, so the domain loses 9 characters.
_REQUESTS_PREFIX = "requests."


def resource_name_error(name: str) -> str | None:
    """Why the kubelet would refuse `name` as an extended resource, or None."""
    if "/" not in name:
        return f"{name!r} is not of the form <domain>/<name>"
    domain, _, short = name.partition("/")
    if "kubernetes.io/" in name:
        return f"{name!r} is in the kubernetes.io namespace, which is reserved"
    if name.startswith(_REQUESTS_PREFIX):
        return f"{name!r} starts with 'requests.', which Kubernetes reserves for quota names"
    if not domain or len(_REQUESTS_PREFIX + domain) > 253 or not _DNS1123_SUBDOMAIN.match(domain):
        return f"{name!r}: domain {domain!r} is not a DNS-1123 subdomain"
    if not short or len(short) > 63 or not _QUALIFIED_NAME_PART.match(short):
        return (
            f"{name!r}: name {short!r} must be 1-63 characters of [A-Za-z0-9-_.], "
            "starting and ending with an alphanumeric"
        )
    return None


def env_var_name(prefix: str, resource_name: str) -> str:
    """KubeVirt's env var for a resource: `PCI_RESOURCE_NVIDIA_COM_T4` and the like."""
    return prefix + resource_name.upper().replace("/", "_").replace(".", "_")


def default_pci_resource_name(pci_id: PciId, domain: str = DEFAULT_DOMAIN) -> str:
    return f"{domain}/{pci_id.vendor:04x}_{pci_id.device:04x}"


def normalize_pci_ids_name(device_name: str) -> str:
    """`TU106 [GeForce RTX 2060 Rev. A]` -> `TU106_GEFORCE_RTX_2060_REV__A`."""
    upper = device_name.upper().replace("/", "_").replace(".", "_")
    underscored = re.sub(r"\s+", "_", upper)
    return re.sub(r"[^A-Z0-9_]", "", underscored)


def pci_ids_resource_name(
    pci_id: PciId, names: Mapping[PciId, str], domain: str = DEFAULT_DOMAIN
) -> str:
    """The PCI ID database name for `pci_id`, or the vendor_device default.

    The default also stands in when the database name would not be a valid
    resource name (too long, or empty after normalization).
    """
    device_name = names.get(pci_id)
    if device_name:
        candidate = f"{domain}/{normalize_pci_ids_name(device_name)}"
        if resource_name_error(candidate) is None:
            return candidate
    return default_pci_resource_name(pci_id, domain)


def parse_pci_ids(text: str) -> dict[PciId, str]:
    """Device names from the text of a `pci.ids` file.

    Vendor lines start at column 0, device lines with one tab, subsystem lines
    with two; the class section (`C xx`) ends the vendor list.
    """
    names: dict[PciId, str] = {}
    vendor: int | None = None
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        if line.startswith("C "):
            break
        if not line.startswith("\t"):
            head = line[:4]
            vendor = int(head, 16) if _is_hex4(head) and line[4:6] == "  " else None
            continue
        if vendor is None or line.startswith("\t\t"):
            continue
        head = line[1:5]
        if _is_hex4(head) and line[5:7] == "  ":
            names[PciId(vendor, int(head, 16))] = line[7:].strip()
    return names


def _is_hex4(text: str) -> bool:
    return len(text) == 4 and all(c in "0123456789abcdefABCDEF" for c in text)
