"""dp_server.config.loader: YAML -> dp_core.Config, and the errors an operator sees."""

from __future__ import annotations

import logging
import re
import textwrap
from pathlib import Path

import attrs
import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from dp_core import (
    DEFAULT_SHARED_DEVICES,
    Config,
    MediatedDevice,
    Naming,
    PciHostDevice,
    PciId,
    PermittedHostDevices,
    SharedDevice,
    Vfio,
)
from dp_server.config.loader import (
    ConfigFileError,
    config_converter,
    dump_config,
    load_config,
    parse_config,
    parse_config_file,
)

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
DOCS = Path(__file__).resolve().parent.parent / "docs" / "config.md"


def problems(text: str, source: str = "test.yaml") -> list[str]:
    """The lines of the ConfigFileError that `text` raises."""
    with pytest.raises(ConfigFileError) as info:
        parse_config(textwrap.dedent(text), source)
    lines = str(info.value).splitlines()
    assert lines == list(info.value.problems)
    return lines


def only_problem(text: str, source: str = "test.yaml") -> str:
    lines = problems(text, source)
    assert len(lines) == 1, lines
    return lines[0]


# --- defaults -------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["", "\n", "# only a comment\n", "---\n", "~\n"])
def test_empty_document_gives_defaults(text: str) -> None:
    assert parse_config(text) == Config()


def test_defaults() -> None:
    config = parse_config("")
    assert config.permitted_host_devices is None
    assert [d.resource_name for d in config.shared_devices] == [
        "devices.kubevirt.io/kvm",
        "devices.kubevirt.io/tun",
        "devices.kubevirt.io/vhost-net",
    ]
    assert [d.path for d in config.shared_devices] == ["/dev/kvm", "/dev/net/tun", "/dev/vhost-net"]
    assert all(
        d.count == 110 and d.enabled and d.permissions == "rw" for d in config.shared_devices
    )
    assert config.naming == Naming(source="vendor-device", domain="devices.kubevirt.io")


def test_load_config_none_gives_defaults() -> None:
    assert load_config(None) == Config()


@pytest.mark.parametrize(
    "text",
    ["permittedHostDevices:\n", "permittedHostDevices: null\n"],
)
def test_null_permitted_host_devices_means_no_selectors(text: str) -> None:
    assert parse_config(text).permitted_host_devices is None


def test_empty_permitted_host_devices_selects_nothing() -> None:
    config = parse_config("permittedHostDevices: {}\n")
    assert config.permitted_host_devices == PermittedHostDevices()


@pytest.mark.parametrize("text", ["naming:\n", "sharedDevices:\n", "sharedDevices: {}\n"])
def test_empty_sections_keep_defaults(text: str) -> None:
    assert parse_config(text) == Config()


# --- a full document ------------------------------------------------------------------

FULL = """\
permittedHostDevices:
  pciHostDevices:
    - pciVendorSelector: "10de:1eb8"
      resourceName: "nvidia.com/TU104GL_Tesla_T4"
    - pciVendorSelector: "8086:4941"
      externalResourceProvider: true
  mediatedDevices:
    - mdevNameSelector: "GRID T4-1Q"
      resourceName: "nvidia.com/GRID_T4-1Q"
sharedDevices:
  devices.kubevirt.io/kvm: {count: 1000}
  devices.kubevirt.io/tun: {enabled: false}
  example.com/fuse: {path: /dev/fuse, count: 10, permissions: rw}
naming:
  source: pci-ids
  domain: example.com
  pciIdsPath: /usr/share/misc/pci.ids
"""


def test_full_document() -> None:
    config = parse_config(FULL)
    assert config.permitted_host_devices == PermittedHostDevices(
        pci_host_devices=(
            PciHostDevice(PciId(0x10DE, 0x1EB8), "nvidia.com/TU104GL_Tesla_T4"),
            PciHostDevice(PciId(0x8086, 0x4941), None, external_resource_provider=True),
        ),
        mediated_devices=(MediatedDevice("GRID T4-1Q", "nvidia.com/GRID_T4-1Q"),),
    )
    assert config.naming == Naming("pci-ids", "example.com", "/usr/share/misc/pci.ids")


@pytest.mark.parametrize("interface", ["group", "group+cdev", "iommufd"])
def test_vfio_interface(interface: str) -> None:
    config = parse_config(f"vfio: {{interface: {interface}}}\n")
    assert config.vfio == Vfio(interface)  # type: ignore[arg-type]
    assert parse_config(yaml.safe_dump(dump_config(config))) == config


def test_vfio_interface_defaults_to_group_and_cdev() -> None:
    assert parse_config("").vfio.interface == "group+cdev"
    assert parse_config("vfio: {}\n").vfio.interface == "group+cdev"
    assert parse_config("vfio:\n").vfio.interface == "group+cdev"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "vfio: {interface: cdev}",
            "vfio.interface: 'cdev' is not one of 'group', 'group+cdev', 'iommufd'",
        ),
        (
            "vfio: {interface: Group}",
            "vfio.interface: 'Group' is not one of 'group', 'group+cdev', 'iommufd'",
        ),
        ("vfio: {interface: 3}", "vfio.interface: 3 is not a string"),
        ("vfio: {interfce: group}", "vfio.interfce: unknown key 'interfce' (did you mean"),
        ("vfio: iommufd", "vfio: expected a mapping, got a string: 'iommufd'"),
    ],
)
def test_bad_vfio_interface_names_the_field(text: str, expected: str) -> None:
    assert only_problem(text).startswith(f"test.yaml: {expected}")


def test_selector_is_case_insensitive() -> None:
    lower = parse_config(
        'permittedHostDevices: {pciHostDevices: [{pciVendorSelector: "10de:1eb8"}]}'
    )
    upper = parse_config(
        'permittedHostDevices: {pciHostDevices: [{pciVendorSelector: "10DE:1EB8"}]}'
    )
    assert lower == upper


# --- shared devices merge -------------------------------------------------------------


def shared(text: str) -> dict[str, SharedDevice]:
    return {d.resource_name: d for d in parse_config(text).shared_devices}


def test_shared_override_keeps_other_fields_and_other_defaults() -> None:
    devices = shared("sharedDevices: {devices.kubevirt.io/kvm: {count: 1000}}")
    assert devices["devices.kubevirt.io/kvm"] == SharedDevice(
        "devices.kubevirt.io/kvm", "/dev/kvm", count=1000
    )
    assert devices["devices.kubevirt.io/tun"] == DEFAULT_SHARED_DEVICES[1]
    assert devices["devices.kubevirt.io/vhost-net"] == DEFAULT_SHARED_DEVICES[2]


def test_shared_disable_a_default() -> None:
    config = parse_config("sharedDevices: {devices.kubevirt.io/tun: {enabled: false}}")
    assert [d.resource_name for d in config.enabled_shared_devices] == [
        "devices.kubevirt.io/kvm",
        "devices.kubevirt.io/vhost-net",
    ]
    tun = shared("sharedDevices: {devices.kubevirt.io/tun: {enabled: false}}")[
        "devices.kubevirt.io/tun"
    ]
    assert (tun.path, tun.count, tun.enabled) == ("/dev/net/tun", 110, False)


def test_shared_new_device_gets_defaults() -> None:
    config = parse_config("sharedDevices: {example.com/fuse: {path: /dev/fuse}}")
    assert config.shared_devices == (
        *DEFAULT_SHARED_DEVICES,
        SharedDevice("example.com/fuse", "/dev/fuse", count=110, permissions="rw", enabled=True),
    )


def test_shared_devices_are_sorted_by_name() -> None:
    text = """\
    sharedDevices:
      z.example.com/b: {path: /dev/b}
      a.example.com/a: {path: /dev/a}
      devices.kubevirt.io/vhost-net: {count: 5}
    """
    config = parse_config(textwrap.dedent(text))
    assert [d.resource_name for d in config.shared_devices] == [
        "a.example.com/a",
        "devices.kubevirt.io/kvm",
        "devices.kubevirt.io/tun",
        "devices.kubevirt.io/vhost-net",
        "z.example.com/b",
    ]


def test_shared_default_can_move_path() -> None:
    devices = shared("sharedDevices: {devices.kubevirt.io/tun: {path: /dev/tun, permissions: rwm}}")
    assert devices["devices.kubevirt.io/tun"] == SharedDevice(
        "devices.kubevirt.io/tun", "/dev/tun", permissions="rwm"
    )


def test_shared_null_entry_keeps_default() -> None:
    assert parse_config("sharedDevices: {devices.kubevirt.io/kvm: }") == Config()


# --- errors: YAML and document shape --------------------------------------------------


def test_yaml_syntax_error_names_line_and_column() -> None:
    line = only_problem("permittedHostDevices:\n  pciHostDevices: [\n", "node.yaml")
    assert line.startswith("node.yaml: line 3, column 1: YAML syntax error: ")


def test_yaml_syntax_error_bad_indent() -> None:
    line = only_problem("naming:\n  source: pci-ids\n domain: x\n")
    assert line.startswith("test.yaml: line 3, column 2: YAML syntax error: ")


def test_duplicate_yaml_key() -> None:
    line = only_problem("naming:\n  source: pci-ids\n  source: vendor-device\n")
    assert line.startswith("test.yaml: line 3, column 3: ")
    assert "'source'" in line and "first at line 2" in line


@pytest.mark.parametrize(
    ("text", "kind"),
    [
        ("- a\n- b\n", "a list: ['a', 'b']"),
        ("hello\n", "a string: 'hello'"),
        ("42\n", "an integer: 42"),
    ],
)
def test_document_not_a_mapping(text: str, kind: str) -> None:
    assert (
        only_problem(text) == f"test.yaml: (document): expected a mapping of settings, got {kind}"
    )


@pytest.mark.parametrize(
    ("text", "path", "key"),
    [
        ("permittedHostDevice: {}\n", "permittedHostDevice", "permittedHostDevice"),
        (
            "permittedHostDevices: {pciHostDevice: []}\n",
            "permittedHostDevices.pciHostDevice",
            "pciHostDevice",
        ),
        (
            "permittedHostDevices: {pciHostDevices: "
            "[{pciVendorSelecter: '10de:1eb8', pciVendorSelector: '10de:1eb8'}]}\n",
            "permittedHostDevices.pciHostDevices[0].pciVendorSelecter",
            "pciVendorSelecter",
        ),
        ("naming: {sorce: pci-ids}\n", "naming.sorce", "sorce"),
        (
            "sharedDevices: {devices.kubevirt.io/kvm: {cout: 5}}\n",
            'sharedDevices["devices.kubevirt.io/kvm"].cout',
            "cout",
        ),
    ],
)
def test_unknown_key_is_named_with_a_suggestion(text: str, path: str, key: str) -> None:
    line = only_problem(text)
    assert line.startswith(f"test.yaml: {path}: unknown key {key!r} (did you mean ")


def test_unknown_key_without_a_close_match_lists_the_keys() -> None:
    line = only_problem("colour: blue\n")
    assert line == (
        "test.yaml: colour: unknown key 'colour'; "
        "expected one of: binding, dra, naming, permittedHostDevices, sharedDevices, vfio"
    )


# --- errors: wrong types --------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "sharedDevices: {devices.kubevirt.io/kvm: {count: lots}}",
            "sharedDevices[\"devices.kubevirt.io/kvm\"].count: 'lots' is not an integer",
        ),
        (
            'sharedDevices: {devices.kubevirt.io/kvm: {count: "10"}}',
            "sharedDevices[\"devices.kubevirt.io/kvm\"].count: '10' is not an integer",
        ),
        (
            "sharedDevices: {devices.kubevirt.io/kvm: {count: 10.5}}",
            'sharedDevices["devices.kubevirt.io/kvm"].count: 10.5 is not an integer',
        ),
        (
            "sharedDevices: {devices.kubevirt.io/kvm: {count: true}}",
            'sharedDevices["devices.kubevirt.io/kvm"].count: true is not an integer',
        ),
        (
            "sharedDevices: {devices.kubevirt.io/kvm: {enabled: 1}}",
            'sharedDevices["devices.kubevirt.io/kvm"].enabled: 1 is not a boolean (true or false)',
        ),
        (
            "permittedHostDevices: {pciHostDevices: "
            '[{pciVendorSelector: "10DE:1EB8", externalResourceProvider: "yes"}]}',
            "permittedHostDevices.pciHostDevices[0].externalResourceProvider: "
            "'yes' is not a boolean (true or false)",
        ),
        (
            "permittedHostDevices: {mediatedDevices: "
            '[{mdevNameSelector: "x", externalResourceProvider: 0}]}',
            "permittedHostDevices.mediatedDevices[0].externalResourceProvider: "
            "0 is not a boolean (true or false)",
        ),
        (
            "permittedHostDevices: {pciHostDevices: "
            '[{pciVendorSelector: "10DE:1EB8", resourceName: 5}]}',
            "permittedHostDevices.pciHostDevices[0].resourceName: 5 is not a string",
        ),
        (
            "permittedHostDevices: {mediatedDevices: [{mdevNameSelector: [a]}]}",
            "permittedHostDevices.mediatedDevices[0].mdevNameSelector: ['a'] is not a string",
        ),
        (
            "permittedHostDevices: {pciHostDevices: [{pciVendorSelector: 1234}]}",
            "permittedHostDevices.pciHostDevices[0].pciVendorSelector: "
            "1234 is not VVVV:DDDD hex (write it as a quoted string)",
        ),
        (
            "permittedHostDevices: {pciHostDevices: {pciVendorSelector: '10DE:1EB8'}}",
            "permittedHostDevices.pciHostDevices: expected a list, got a mapping: "
            "{'pciVendorSelector': '10DE:1EB8'}",
        ),
        (
            "permittedHostDevices: {pciHostDevices: ['10DE:1EB8']}",
            "permittedHostDevices.pciHostDevices[0]: expected a mapping, got a string: '10DE:1EB8'",
        ),
        (
            "permittedHostDevices: [a]",
            "permittedHostDevices: expected a mapping, got a list: ['a']",
        ),
        (
            "sharedDevices: [devices.kubevirt.io/kvm]",
            "sharedDevices: expected a mapping of resource name to device, got a list: "
            "['devices.kubevirt.io/kvm']",
        ),
        (
            "sharedDevices: {devices.kubevirt.io/kvm: 1000}",
            'sharedDevices["devices.kubevirt.io/kvm"]: expected a mapping, got an integer: 1000',
        ),
        ("naming: vendor-device", "naming: expected a mapping, got a string: 'vendor-device'"),
        ("naming: {pciIdsPath: 5}", "naming.pciIdsPath: 5 is not a string"),
        ("naming: {source: 5}", "naming.source: 5 is not a string"),
    ],
)
def test_wrong_type(text: str, expected: str) -> None:
    assert only_problem(text) == f"test.yaml: {expected}"


# --- errors: bad values ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("selector", "message"),
    [
        ("ZZZZ:1EB8", "'ZZZZ:1EB8' is not VVVV:DDDD hex"),
        ("10DE1EB8", "'10DE1EB8' is not VVVV:DDDD hex"),
        ("10DE:1EB", "'10DE:1EB' is not VVVV:DDDD hex"),
        ("", "'' is not VVVV:DDDD hex"),
    ],
)
def test_bad_selector(selector: str, message: str) -> None:
    text = f'permittedHostDevices: {{pciHostDevices: [{{pciVendorSelector: "{selector}"}}]}}'
    assert only_problem(text) == (
        f"test.yaml: permittedHostDevices.pciHostDevices[0].pciVendorSelector: {message}"
    )


def test_missing_selector() -> None:
    text = 'permittedHostDevices: {pciHostDevices: [{resourceName: "nvidia.com/x"}]}'
    assert only_problem(text) == (
        "test.yaml: permittedHostDevices.pciHostDevices[0].pciVendorSelector: is required"
    )


def test_empty_mdev_selector() -> None:
    line = only_problem('permittedHostDevices: {mediatedDevices: [{mdevNameSelector: "  "}]}')
    assert line.startswith("test.yaml: permittedHostDevices.mediatedDevices[0].mdevNameSelector: ")
    assert "empty" in line


@pytest.mark.parametrize(
    "name",
    [
        "nvidia",
        "kubernetes.io/foo",
        "foo.kubernetes.io/bar",
        "NVIDIA.com/x",
        "nvidia.com/-x",
        "nvidia.com/",
    ],
)
def test_bad_resource_name_uses_core_message(name: str) -> None:
    from dp_core.config.names import resource_name_error

    message = resource_name_error(name)
    assert message is not None
    for text, path in (
        (
            "permittedHostDevices: {pciHostDevices: "
            f'[{{pciVendorSelector: "10DE:1EB8", resourceName: "{name}"}}]}}',
            "permittedHostDevices.pciHostDevices[0].resourceName",
        ),
        (
            "permittedHostDevices: {mediatedDevices: "
            f'[{{mdevNameSelector: "x", resourceName: "{name}"}}]}}',
            "permittedHostDevices.mediatedDevices[0].resourceName",
        ),
    ):
        assert only_problem(text) == f"test.yaml: {path}: {message}"
    assert repr(name) in message


def test_bad_shared_device_name() -> None:
    line = only_problem('sharedDevices: {"kubernetes.io/kvm": {path: /dev/kvm}}')
    assert line == (
        'test.yaml: sharedDevices["kubernetes.io/kvm"]: '
        "'kubernetes.io/kvm' is in the kubernetes.io namespace, which is reserved"
    )


@pytest.mark.parametrize(
    ("fields", "field", "value"),
    [
        ("{path: /etc/passwd}", "path", "'/etc/passwd'"),
        ("{path: dev/kvm}", "path", "'dev/kvm'"),
        ("{path: /dev/../etc/shadow}", "path", "'/dev/../etc/shadow'"),
        ("{count: 0}", "count", "0"),
        ("{count: -5}", "count", "-5"),
        ("{count: 100000000}", "count", "100000000"),
        ("{permissions: rwx}", "permissions", "'rwx'"),
        ("{permissions: ''}", "permissions", "''"),
    ],
)
def test_bad_shared_device_field(fields: str, field: str, value: str) -> None:
    line = only_problem(f"sharedDevices: {{devices.kubevirt.io/kvm: {fields}}}")
    assert line.startswith(f'test.yaml: sharedDevices["devices.kubevirt.io/kvm"].{field}: {value} ')


def test_new_shared_device_needs_a_path() -> None:
    line = only_problem("sharedDevices: {example.com/fuse: {count: 10}}")
    assert line.startswith(
        'test.yaml: sharedDevices["example.com/fuse"].path: is required for a new shared device'
    )


@pytest.mark.parametrize(
    ("naming", "path", "value"),
    [
        ("{source: pciids}", "naming.source", "'pciids'"),
        ("{domain: Example.com}", "naming.domain", "'Example.com'"),
        ("{domain: kubernetes.io}", "naming.domain", "'kubernetes.io'"),
    ],
)
def test_bad_naming(naming: str, path: str, value: str) -> None:
    line = only_problem(f"naming: {naming}")
    assert line.startswith(f"test.yaml: {path}: {value} ")


# --- errors: across entries -----------------------------------------------------------


def test_duplicate_pci_selector_any_case() -> None:
    text = """\
    permittedHostDevices:
      pciHostDevices:
        - pciVendorSelector: "10de:1eb8"
        - pciVendorSelector: "8086:4941"
        - pciVendorSelector: "10DE:1EB8"
        - pciVendorSelector: "8086:4941"
    """
    assert problems(text) == [
        "test.yaml: permittedHostDevices.pciHostDevices[2].pciVendorSelector: "
        "'10DE:1EB8' is listed twice (first at pciHostDevices[0])",
        "test.yaml: permittedHostDevices.pciHostDevices[3].pciVendorSelector: "
        "'8086:4941' is listed twice (first at pciHostDevices[1])",
    ]


def test_duplicate_mdev_selector() -> None:
    text = """\
    permittedHostDevices:
      mediatedDevices:
        - mdevNameSelector: "GRID T4-1Q"
        - mdevNameSelector: "GRID T4-1Q"
    """
    assert only_problem(text) == (
        "test.yaml: permittedHostDevices.mediatedDevices[1].mdevNameSelector: "
        "'GRID T4-1Q' is listed twice (first at mediatedDevices[0])"
    )


def test_same_resource_name_for_several_pci_selectors_is_fine() -> None:
    text = """\
    permittedHostDevices:
      pciHostDevices:
        - {pciVendorSelector: "10de:1eb8", resourceName: nvidia.com/turing}
        - {pciVendorSelector: "10de:1e07", resourceName: nvidia.com/turing}
    """
    assert parse_config(textwrap.dedent(text)).permitted_host_devices is not None


def test_resource_name_for_two_kinds() -> None:
    text = """\
    permittedHostDevices:
      pciHostDevices:
        - {pciVendorSelector: "10de:1eb8", resourceName: nvidia.com/t4}
        - {pciVendorSelector: "8086:4941", resourceName: devices.kubevirt.io/kvm}
      mediatedDevices:
        - {mdevNameSelector: "GRID T4-1Q", resourceName: nvidia.com/t4}
    """
    assert problems(text) == [
        "test.yaml: permittedHostDevices.pciHostDevices[1].resourceName: "
        "'devices.kubevirt.io/kvm' is also the name of a shared device",
        "test.yaml: permittedHostDevices.mediatedDevices[0].resourceName: "
        "'nvidia.com/t4' is also the resourceName of pciHostDevices[0]",
    ]


def test_resource_name_clash_with_new_shared_device() -> None:
    text = """\
    permittedHostDevices:
      pciHostDevices: [{pciVendorSelector: "10de:1eb8", resourceName: example.com/fuse}]
    sharedDevices:
      example.com/fuse: {path: /dev/fuse}
    """
    assert only_problem(text) == (
        "test.yaml: permittedHostDevices.pciHostDevices[0].resourceName: "
        "'example.com/fuse' is also the name of a shared device"
    )


# --- all errors at once ---------------------------------------------------------------

MANY_ERRORS = """\
permittedHostDevices:
  pciHostDevice: []
  pciHostDevices:
    - pciVendorSelector: "ZZZZ:1EB8"
      resourceName: "kubernetes.io/foo"
      externalResourceProvider: "yes"
    - pciVendorSelector: "10de:1eb8"
    - pciVendorSelector: "10DE:1EB8"
  mediatedDevices:
    - resourceName: nvidia.com/x
sharedDevices:
  devices.kubevirt.io/kvm: {count: lots}
  example.com/fuse: {count: 10}
naming:
  source: pciids
extra: 1
"""


def test_every_error_is_reported() -> None:
    assert problems(MANY_ERRORS, "node.yaml") == [
        "node.yaml: permittedHostDevices.pciHostDevices[0].pciVendorSelector: "
        "'ZZZZ:1EB8' is not VVVV:DDDD hex",
        "node.yaml: permittedHostDevices.pciHostDevices[0].resourceName: "
        "'kubernetes.io/foo' is in the kubernetes.io namespace, which is reserved",
        "node.yaml: permittedHostDevices.pciHostDevices[0].externalResourceProvider: "
        "'yes' is not a boolean (true or false)",
        "node.yaml: permittedHostDevices.mediatedDevices[0].mdevNameSelector: is required",
        "node.yaml: permittedHostDevices.pciHostDevice: "
        "unknown key 'pciHostDevice' (did you mean 'pciHostDevices'?)",
        "node.yaml: sharedDevices[\"devices.kubevirt.io/kvm\"].count: 'lots' is not an integer",
        'node.yaml: sharedDevices["example.com/fuse"].path: is required for a new shared device '
        "(only devices.kubevirt.io/kvm, devices.kubevirt.io/tun, devices.kubevirt.io/vhost-net "
        "have defaults)",
        "node.yaml: naming.source: 'pciids' is not one of 'vendor-device', 'pci-ids'",
        "node.yaml: extra: unknown key 'extra'; "
        "expected one of: binding, dra, naming, permittedHostDevices, sharedDevices, vfio",
        "node.yaml: permittedHostDevices.pciHostDevices[2].pciVendorSelector: "
        "'10DE:1EB8' is listed twice (first at pciHostDevices[1])",
    ]


def test_several_errors_in_one_entry() -> None:
    text = "sharedDevices: {devices.kubevirt.io/tun: {count: 0, permissions: x, path: /tmp/tun}}"
    lines = problems(text)
    assert [line.split(": ")[1] for line in lines] == [
        'sharedDevices["devices.kubevirt.io/tun"].path',
        'sharedDevices["devices.kubevirt.io/tun"].count',
        'sharedDevices["devices.kubevirt.io/tun"].permissions',
    ]


# --- KubeVirt CR form -----------------------------------------------------------------

CR = """\
apiVersion: kubevirt.io/v1
kind: KubeVirt
metadata: {name: kubevirt, namespace: kubevirt}
spec:
  configuration:
    developerConfiguration: {featureGates: [GPU]}
    permittedHostDevices:
      pciHostDevices:
        - pciVendorSelector: "10DE:1EB8"
          resourceName: "nvidia.com/TU104GL_Tesla_T4"
          externalResourceProvider: true
      mediatedDevices:
        - mdevNameSelector: "GRID T4-1Q"
          resourceName: "nvidia.com/GRID_T4-1Q"
  imagePullPolicy: IfNotPresent
"""


NOT_SHARED = tuple(attrs.evolve(device, enabled=False) for device in DEFAULT_SHARED_DEVICES)


def test_kubevirt_cr_means_what_it_means_in_kubevirt() -> None:
    """virt-handler serves an entry unless it says externalResourceProvider: true
    (pkg/virt-handler/device-manager/device_controller.go), and kvm, tun and
    vhost-net always: dp serves exactly the entries left to an outside plugin."""
    config = parse_config(CR)
    assert config == Config(
        permitted_host_devices=PermittedHostDevices(
            pci_host_devices=(
                PciHostDevice(
                    PciId(0x10DE, 0x1EB8),
                    "nvidia.com/TU104GL_Tesla_T4",
                    external_resource_provider=True,
                ),
            ),
            mediated_devices=(
                MediatedDevice(
                    "GRID T4-1Q", "nvidia.com/GRID_T4-1Q", external_resource_provider=False
                ),
            ),
        ),
        shared_devices=NOT_SHARED,
    )
    assert config.enabled_shared_devices == ()
    (gpu,) = config.permitted_host_devices.pci_host_devices  # type: ignore[union-attr]
    (vgpu,) = config.permitted_host_devices.mediated_devices  # type: ignore[union-attr]
    assert not gpu.virt_handler_serves and vgpu.virt_handler_serves


def test_a_kubevirt_cr_serves_through_dp_only_what_virt_handler_leaves() -> None:
    """Served on the fixture host: the T4s (true), not the vGPUs (no flag),
    nor kvm, tun and vhost-net, which virt-handler registers on every node."""
    from dp_core import build_inventory
    from dp_testing.topology import fixture_topology, to_snapshot

    cr = CR.replace('"GRID T4-1Q"', '"GRID RTX6000-4Q"')
    inventory = build_inventory(to_snapshot(fixture_topology()), parse_config(cr))
    assert inventory.names == ("nvidia.com/TU104GL_Tesla_T4",)
    left = {s.resource_name: s.reason for s in inventory.skipped}
    assert left["nvidia.com/GRID_T4-1Q"] == (
        "externalResourceProvider is false (KubeVirt's default): virt-handler serves it"
    )


def test_dps_own_config_reads_the_flag_as_kubevirt_does_when_it_is_given() -> None:
    """Absent: dp's own config lists what dp serves. true: left to an outside
    plugin, dp. false: virt-handler's; dp leaves it alone."""
    config = parse_config(
        "permittedHostDevices:\n  pciHostDevices:\n"
        '    - {pciVendorSelector: "10DE:1EB8"}\n'
        '    - {pciVendorSelector: "8086:4941", externalResourceProvider: true}\n'
        '    - {pciVendorSelector: "144D:A808", externalResourceProvider: false}\n'
    )
    assert config.permitted_host_devices is not None
    served = [not e.virt_handler_serves for e in config.permitted_host_devices.pci_host_devices]
    assert served == [True, True, False]
    assert config.enabled_shared_devices == DEFAULT_SHARED_DEVICES


def test_a_block_pasted_from_a_cr_into_dps_own_config_is_warned_about() -> None:
    block = (
        "permittedHostDevices:\n  pciHostDevices:\n"
        '    - {pciVendorSelector: "10DE:1EB8", externalResourceProvider: true}\n'
        '    - {pciVendorSelector: "8086:4941"}\n'
        '    - {pciVendorSelector: "144D:A808"}\n'
    )
    (note,) = parse_config_file(block, "node.yaml").notes
    assert note.level == "warning" and note.path == "permittedHostDevices"
    assert note.message.startswith(
        "externalResourceProvider is true on 1 entry and absent on 2 entries: dp serves both"
    )
    assert "give dp the whole CR" in note.message
    # Every entry saying it, or none: nothing to warn about.
    assert parse_config_file(block.replace('"}', '", externalResourceProvider: false}')).notes == ()
    assert parse_config_file(block.replace(", externalResourceProvider: true", "")).notes == ()


def test_kubevirt_cr_errors_keep_the_cr_path() -> None:
    text = CR.replace('"10DE:1EB8"', '"ZZZZ:1EB8"').replace("mdevNameSelector", "mdevNameSelecter")
    assert problems(text) == [
        "test.yaml: spec.configuration.permittedHostDevices.pciHostDevices[0].pciVendorSelector: "
        "'ZZZZ:1EB8' is not VVVV:DDDD hex",
        "test.yaml: spec.configuration.permittedHostDevices.mediatedDevices[0].mdevNameSelector: "
        "is required",
        "test.yaml: spec.configuration.permittedHostDevices.mediatedDevices[0].mdevNameSelecter: "
        "unknown key 'mdevNameSelecter' (did you mean 'mdevNameSelector'?)",
    ]


def test_kubevirt_cr_duplicate_selector_path() -> None:
    text = CR.replace(
        "      mediatedDevices:",
        '        - pciVendorSelector: "10de:1eb8"\n      mediatedDevices:',
    )
    assert only_problem(text) == (
        "test.yaml: spec.configuration.permittedHostDevices.pciHostDevices[1].pciVendorSelector: "
        "'10de:1eb8' is listed twice (first at pciHostDevices[0])"
    )


@pytest.mark.parametrize(
    ("spec", "absent"),
    [
        (
            "spec: {configuration: {developerConfiguration: {featureGates: [GPU]}}}",
            "spec.configuration.permittedHostDevices",
        ),
        (
            "spec: {configuration: {permittedHostDevices: null}}",
            "spec.configuration.permittedHostDevices",
        ),
        ("spec: {configuration: {}}", "spec.configuration.permittedHostDevices"),
        ("spec: {imagePullPolicy: IfNotPresent}", "spec.configuration"),
        ("metadata: {name: kubevirt}", "spec"),
    ],
)
def test_a_kubevirt_cr_without_permitted_host_devices_serves_nothing_and_says_so(
    spec: str, absent: str
) -> None:
    """KubeVirt then names no host device: dp must not serve every vfio-pci function."""
    loaded = parse_config_file(f"apiVersion: kubevirt.io/v1\nkind: KubeVirt\n{spec}\n", "cr")
    assert loaded.kubevirt_cr
    assert loaded.config == Config(PermittedHostDevices(), shared_devices=NOT_SHARED)
    warning, always = loaded.notes
    assert (warning.level, warning.path) == ("warning", absent)
    assert warning.message.startswith("is absent: the CR names no host device, so dp serves none")
    assert (always.level, always.path) == ("info", "sharedDevices")
    assert "virt-handler always serves them" in always.message


def test_a_kubevirt_cr_that_leaves_nothing_to_outside_plugins_says_so() -> None:
    loaded = parse_config_file(CR.replace("externalResourceProvider: true", ""), "cr")
    assert [n.message for n in loaded.notes if n.level == "warning"] == [
        "no entry says externalResourceProvider: true: virt-handler serves every one, and dp none"
    ]


# Two entries left to outside plugins, and virt-handler's vGPU.
TWO_OUTSIDE = CR.replace(
    """      mediatedDevices:""",
    """        - pciVendorSelector: "8086:4941"
          resourceName: "intel.com/qat_vf"
          externalResourceProvider: true
      mediatedDevices:""",
)


def test_kubevirt_resources_names_the_outside_entries_dp_serves() -> None:
    """Another outside plugin (NVIDIA's GPU operator, say) may serve some of the
    entries a CR leaves to outside plugins: dp serves only the ones named, and
    leaves the rest, and virt-handler's, alone."""
    from dp_core import build_inventory
    from dp_testing.topology import fixture_topology, to_snapshot

    loaded = parse_config_file(TWO_OUTSIDE, "cr", kubevirt_resources=["intel.com/qat_vf"])
    inventory = build_inventory(to_snapshot(fixture_topology()), loaded.config)
    assert inventory.names == ("intel.com/qat_vf",)
    left = {s.resource_name: s.reason for s in inventory.skipped}
    assert left["nvidia.com/TU104GL_Tesla_T4"] == (
        "externalResourceProvider is true, but --kubevirt-resources does not name it: "
        "another outside plugin serves it"
    )
    (note,) = [n for n in loaded.notes if n.path == "--kubevirt-resources"]
    assert note.message == (
        "dp serves 1 entry of the 2 the CR leaves to outside plugins (intel.com/qat_vf); "
        "1 entry left to another outside plugin"
    )
    # Without the flag, both; the flag is never part of the YAML shape.
    assert build_inventory(to_snapshot(fixture_topology()), parse_config(TWO_OUTSIDE)).names == (
        "intel.com/qat_vf",
        "nvidia.com/TU104GL_Tesla_T4",
    )
    assert "another_plugin" not in yaml.safe_dump(dump_config(loaded.config))


@pytest.mark.parametrize(
    ("text", "names", "message"),
    [
        (
            TWO_OUTSIDE,
            ["nvidia.com/GRID_T4-1Q"],
            "cr: --kubevirt-resources names nvidia.com/GRID_T4-1Q: not an entry the CR leaves "
            "to an outside plugin; the CR leaves these to outside plugins: intel.com/qat_vf, "
            "nvidia.com/TU104GL_Tesla_T4",
        ),
        (
            "apiVersion: kubevirt.io/v1\nkind: KubeVirt\nspec: {}\n",
            ["intel.com/qat_vf"],
            "cr: --kubevirt-resources names intel.com/qat_vf: not an entry the CR leaves to an "
            "outside plugin; the CR leaves no entry to an outside plugin "
            "(externalResourceProvider: true)",
        ),
        (
            "permittedHostDevices: {}\n",
            ["intel.com/qat_vf"],
            "cr: --kubevirt-resources chooses among the entries of a KubeVirt CR, and this is "
            "dp's own config, which lists what dp serves: leave the flag out, or drop the "
            "entries dp is not to serve",
        ),
    ],
)
def test_kubevirt_resources_that_name_no_outside_entry_are_refused(
    text: str, names: list[str], message: str
) -> None:
    with pytest.raises(ConfigFileError) as caught:
        parse_config_file(text, "cr", kubevirt_resources=names)
    assert caught.value.problems == (message,)


def test_kubevirt_cr_spec_not_a_mapping() -> None:
    text = "apiVersion: kubevirt.io/v1\nkind: KubeVirt\nspec: {configuration: [1]}\n"
    assert only_problem(text) == (
        "test.yaml: spec.configuration: expected a mapping, got a list: [1]"
    )


def test_other_kubernetes_object_is_refused() -> None:
    line = only_problem("apiVersion: v1\nkind: ConfigMap\ndata: {}\n")
    assert line.startswith(
        "test.yaml: kind: apiVersion 'v1', kind 'ConfigMap' is not a KubeVirt CR"
    )


def test_usb_is_ignored_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    text = """\
    permittedHostDevices:
      usb:
        - resourceName: kubevirt.io/storage
          selectors: [{vendor: "46f4", product: "0001"}]
      pciHostDevices: [{pciVendorSelector: "10de:1eb8"}]
    """
    with caplog.at_level(logging.WARNING, logger="dp.config"):
        config = parse_config(textwrap.dedent(text), "node.yaml")
    assert config.permitted_host_devices is not None
    assert len(config.permitted_host_devices.pci_host_devices) == 1
    assert [r.name for r in caplog.records] == ["dp.config"]
    assert (
        "node.yaml: permittedHostDevices.usb: ignored (1 entry): "
        "dp does not serve USB host devices" in caplog.text
    )


def test_usb_in_cr_warns_with_cr_path(caplog: pytest.LogCaptureFixture) -> None:
    text = CR.replace("      mediatedDevices:", "      usb: []\n      mediatedDevices:")
    with caplog.at_level(logging.WARNING, logger="dp.config"):
        parse_config(text)
    assert "spec.configuration.permittedHostDevices.usb: ignored" in caplog.text


# --- files ----------------------------------------------------------------------------


def test_load_config_reads_a_file(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(FULL, encoding="utf-8")
    assert load_config(path) == parse_config(FULL)
    assert load_config(str(path)) == parse_config(FULL)


def test_load_config_uses_the_path_as_source(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("naming: {source: x}\n", encoding="utf-8")
    with pytest.raises(ConfigFileError) as info:
        load_config(path)
    assert str(info.value).startswith(f"{path}: naming.source: 'x' ")


def test_load_config_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.yaml"
    with pytest.raises(ConfigFileError) as info:
        load_config(path)
    assert str(info.value) == f"{path}: config file does not exist"


def test_load_config_directory(tmp_path: Path) -> None:
    with pytest.raises(ConfigFileError) as info:
        load_config(tmp_path)
    assert str(info.value).startswith(f"{tmp_path}: cannot read config file: ")


def test_load_config_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "latin1.yaml"
    path.write_bytes(b"naming: {domain: caf\xe9}\n")
    with pytest.raises(ConfigFileError) as info:
        load_config(path)
    assert str(info.value).startswith(f"{path}: config file is not UTF-8 text")


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_examples_load(path: Path) -> None:
    config = load_config(path)
    assert parse_config(yaml.safe_dump(dump_config(config))) == config


def test_examples_exist() -> None:
    names = {p.name for p in EXAMPLES.glob("*.yaml")}
    assert {"config.yaml", "kubevirt-cr.yaml", "config-pci-ids.yaml"} <= names


def test_example_config_is_the_fixture_node() -> None:
    config = load_config(EXAMPLES / "config.yaml")
    assert config.permitted_host_devices is not None
    pci = {
        str(e.pci_vendor_selector): e.resource_name
        for e in config.permitted_host_devices.pci_host_devices
    }
    assert pci == {
        "10de:1eb8": "nvidia.com/TU104GL_Tesla_T4",
        "8086:4941": "intel.com/qat_vf",
        "144d:a808": "devices.kubevirt.io/nvme",
    }
    assert [
        (m.mdev_name_selector, m.resource_name)
        for m in config.permitted_host_devices.mediated_devices
    ] == [("GRID RTX6000-4Q", "nvidia.com/GRID_RTX6000-4Q")]
    assert config.shared_devices[0].count == 1000


# --- round trip -----------------------------------------------------------------------


def test_dump_shape() -> None:
    dumped = dump_config(parse_config(FULL))
    # `vfio` since issue 19: the VFIO interface is dumped, default or not.
    assert list(dumped) == ["permittedHostDevices", "sharedDevices", "naming", "vfio"]
    assert dumped["vfio"] == {"interface": "group+cdev"}
    assert dumped["permittedHostDevices"]["pciHostDevices"] == [
        # Not given, not dumped: an entry of dp's own config that does not say is dp's.
        {
            "pciVendorSelector": "10DE:1EB8",
            "resourceName": "nvidia.com/TU104GL_Tesla_T4",
            "frontend": "device-plugin",
        },
        {
            "pciVendorSelector": "8086:4941",
            "externalResourceProvider": True,
            "frontend": "device-plugin",
        },
    ]
    assert dumped["sharedDevices"]["devices.kubevirt.io/kvm"] == {
        "path": "/dev/kvm",
        "count": 1000,
        "permissions": "rw",
        "enabled": True,
    }
    assert dumped["naming"] == {
        "source": "pci-ids",
        "domain": "example.com",
        "pciIdsPath": "/usr/share/misc/pci.ids",
    }


def test_dump_defaults_omits_permitted_host_devices() -> None:
    assert "permittedHostDevices" not in dump_config(Config())
    assert "pciIdsPath" not in dump_config(Config())["naming"]


@pytest.mark.parametrize("text", ["", FULL, CR], ids=["defaults", "full", "cr"])
def test_round_trip(text: str) -> None:
    config = parse_config(text)
    assert parse_config(yaml.safe_dump(dump_config(config))) == config
    assert parse_config(yaml.dump(dump_config(config))) == config


def test_converter_is_usable_directly() -> None:
    entry = config_converter.structure({"pciVendorSelector": "10DE:1EB8"}, PciHostDevice)
    assert entry == PciHostDevice(PciId(0x10DE, 0x1EB8))
    assert config_converter.unstructure(PciId(0x10DE, 0x1EB8)) == "10DE:1EB8"


# Generated configs: anything the core accepts survives dump -> YAML -> parse.

_resource_names = st.from_regex(
    r"\A[a-z][a-z0-9]{0,8}\.(com|io|org)/[A-Za-z][A-Za-z0-9_.-]{0,20}[A-Za-z0-9]\Z"
)
_pci_ids = st.builds(PciId, st.integers(0, 0xFFFF), st.integers(0, 0xFFFF))


@st.composite
def configs(draw: st.DrawFn) -> Config:
    permitted = None
    if draw(st.booleans()):
        pci = draw(
            st.lists(
                st.builds(
                    PciHostDevice,
                    _pci_ids,
                    st.none() | _resource_names,
                    st.booleans(),
                ),
                unique_by=lambda e: e.pci_vendor_selector,
                max_size=4,
            )
        )
        mdev = draw(
            st.lists(
                st.builds(
                    MediatedDevice,
                    st.text(st.characters(codec="utf-8"), min_size=1, max_size=20).filter(
                        lambda s: s.strip() != ""
                    ),
                    st.none() | _resource_names,
                    st.booleans(),
                ),
                unique_by=lambda e: e.mdev_name_selector,
                max_size=3,
            )
        )
        permitted = PermittedHostDevices(pci, mdev)
    overrides = draw(
        st.lists(
            st.builds(
                SharedDevice,
                _resource_names,
                st.from_regex(r"\A/dev/[a-z][a-z0-9/_-]{0,15}\Z"),
                st.integers(1, 10_000),
                st.sampled_from(["r", "rw", "rwm", "w", "mr"]),
                st.booleans(),
            ),
            unique_by=lambda d: d.resource_name,
            max_size=3,
        )
    )
    naming = draw(
        st.builds(
            Naming,
            st.sampled_from(["vendor-device", "pci-ids"]),
            st.sampled_from(["devices.kubevirt.io", "nvidia.com", "example.org"]),
            st.none() | st.sampled_from(["/usr/share/misc/pci.ids", "/tmp/pci ids.gz"]),
        )
    )
    try:
        shared = sorted((*DEFAULT_SHARED_DEVICES, *overrides), key=lambda d: d.resource_name)
        return Config(permitted, shared, naming)
    except ValueError:
        from hypothesis import reject

        reject()


@given(configs())
def test_round_trip_generated(config: Config) -> None:
    assert parse_config(yaml.safe_dump(dump_config(config))) == config


def test_docs_error_example_is_what_the_parser_says() -> None:
    text = DOCS.read_text(encoding="utf-8")
    match = re.search(
        r"For example, with this file:\n\n```yaml\n(.*?)```\n\n```\n(.*?)```", text, re.S
    )
    assert match is not None
    assert problems(match[1], "node.yaml") == match[2].splitlines()


def test_docs_first_example_parses() -> None:
    text = DOCS.read_text(encoding="utf-8")
    match = re.search(r"```yaml\n(.*?)```", text, re.S)
    assert match is not None
    config = parse_config(match[1])
    assert config.permitted_host_devices is not None


# Any document at all: a Config or a ConfigFileError, never another exception.

_keys = st.sampled_from(
    [
        "permittedHostDevices",
        "pciHostDevices",
        "mediatedDevices",
        "usb",
        "pciVendorSelector",
        "mdevNameSelector",
        "resourceName",
        "externalResourceProvider",
        "sharedDevices",
        "devices.kubevirt.io/kvm",
        "example.com/fuse",
        "path",
        "count",
        "permissions",
        "enabled",
        "naming",
        "source",
        "domain",
        "pciIdsPath",
        "apiVersion",
        "kind",
        "spec",
        "configuration",
    ]
)
_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False)
    | st.sampled_from(["10DE:1EB8", "/dev/fuse", "rw", "pci-ids", "kubevirt.io/v1", "KubeVirt"])
    | st.text(max_size=10)
)
_documents = st.recursive(
    _scalars,
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(_keys | st.integers(0, 3), children, max_size=5)
    ),
    max_leaves=25,
)


@given(_documents)
def test_any_document_gives_config_or_config_file_error(document: object) -> None:
    text = yaml.safe_dump(document)
    try:
        result = parse_config(text)
    except ConfigFileError as exc:
        assert exc.problems
        assert all(line.startswith("<config>: ") for line in exc.problems)
    else:
        assert isinstance(result, Config)


# --- binding --------------------------------------------------------------------------

SELECT_NIC = """\
permittedHostDevices:
  pciHostDevices:
    - pciVendorSelector: "8086:1572"
"""


def test_binding_section() -> None:
    config = parse_config(
        SELECT_NIC + "binding: {replaceDrivers: [i40e, ixgbe], bindUnbound: true}"
    )
    assert config.binding is not None
    assert config.binding.replace_drivers == ("i40e", "ixgbe")
    assert config.binding.bind_unbound is True
    assert parse_config(yaml.safe_dump(dump_config(config))) == config
    assert parse_config(SELECT_NIC).binding is None


@pytest.mark.parametrize(
    ("binding", "path", "message"),
    [
        ("{replaceDrivers: [vfio-pci]}", "binding.replaceDrivers", "moved to, not from"),
        ("{replaceDrivers: [../../x]}", "binding.replaceDrivers", "not a kernel driver name"),
        ("{replaceDrivers: i40e}", "binding.replaceDrivers", "expected a list"),
        ("{bindUnbound: yes please}", "binding.bindUnbound", ""),
        ("{replaceDriver: [i40e]}", "binding", "replaceDrivers"),
    ],
)
def test_bad_binding(binding: str, path: str, message: str) -> None:
    line = only_problem(SELECT_NIC + f"binding: {binding}")
    assert line.startswith(f"test.yaml: {path}"), line
    assert message in line


def test_binding_without_selectors_is_refused() -> None:
    line = only_problem("binding: {replaceDrivers: [i40e]}")
    assert "only devices a selector names are ever rebound" in line
