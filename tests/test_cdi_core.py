"""CDI in the core: names, kinds, versions, what a spec holds, and Allocate's CDI names."""

from __future__ import annotations

import hashlib

import attrs
import pytest
from cdi_reader import read_spec
from hypothesis import given
from hypothesis import strategies as st

from dp_core import (
    AllocateAnswer,
    CdiDevice,
    CdiSpec,
    CdiSpecsChanged,
    CdiSpecsWritten,
    Config,
    DeviceSpec,
    HostObserved,
    KubeletStarted,
    Log,
    Reply,
    SharedDevice,
    StandardNode,
    UsageError,
    cdi_kind,
    collect,
    device_name_error,
    minimum_version,
    qualified_name,
    spec_name,
)
from dp_server.cdi import render

from core_builders import (
    GPU,
    GPU_RESOURCE,
    VF_RESOURCE,
    Kubelet,
    effects_of,
    gpu_config,
    pci,
    snapshot,
    two_gpus_and_vfs,
)

KVM = "devices.kubevirt.io/kvm"


@pytest.mark.parametrize(
    ("resource", "kind", "file"),
    [
        (
            "nvidia.com/TU104GL_Tesla_T4",
            "nvidia.com/dp-TU104GL_Tesla_T4",
            "dp-nvidia.com_TU104GL_Tesla_T4",
        ),
        ("devices.kubevirt.io/kvm", "devices.kubevirt.io/dp-kvm", "dp-devices.kubevirt.io_kvm"),
        ("intel.com/qat_vf", "intel.com/dp-qat_vf", "dp-intel.com_qat_vf"),
        # CDI wants a letter first; a Kubernetes name part may start with a digit.
        (
            "devices.kubevirt.io/10de_1eb8",
            "devices.kubevirt.io/dp-10de_1eb8",
            "dp-devices.kubevirt.io_10de_1eb8",
        ),
        ("3com.example/nic", "dp.3com.example/dp-nic", "dp-dp.3com.example_nic"),
        ("example.com/a.b", "example.com/dp-a.b", "dp-example.com_a.b"),
        # 63 characters of name: the class keeps 51 and a hash, 63 in all.
        (
            "example.com/" + "x" * 63,
            "example.com/dp-" + "x" * 51 + "-" + hashlib.sha256(b"x" * 63).hexdigest()[:8],
            "dp-example.com_" + "x" * 51 + "-" + hashlib.sha256(b"x" * 63).hexdigest()[:8],
        ),
    ],
)
def test_resource_names_map_to_kinds_and_files(resource: str, kind: str, file: str) -> None:
    assert cdi_kind(resource) == kind
    assert spec_name(kind) == file
    assert len(kind.partition("/")[2]) <= 63
    # The independent reader accepts the kind (and the version its class needs).
    version = minimum_version(kind, (CdiDevice("d", (DeviceSpec("/dev/x", "/dev/x", "rw"),)),))
    document = f'{{"cdiVersion": "{version}", "kind": "{kind}", "devices": [{{"name": "d", '
    document += '"containerEdits": {"deviceNodes": [{"path": "/dev/x"}]}}]}'
    assert read_spec(document).kind == kind


_LABEL = r"[a-z0-9]([-a-z0-9]{0,8}[a-z0-9])?"
_DOMAIN = st.from_regex(rf"{_LABEL}(\.{_LABEL}){{0,2}}", fullmatch=True)
_SHORT = st.from_regex(r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?", fullmatch=True)


@given(st.lists(st.tuples(_DOMAIN, _SHORT), min_size=2, max_size=6, unique=True))
def test_distinct_resources_get_distinct_kinds_and_files(names: list[tuple[str, str]]) -> None:
    kinds = [cdi_kind(f"{domain}/{short}") for domain, short in names]
    assert len(set(kinds)) == len(kinds)
    assert len({spec_name(kind) for kind in kinds}) == len(kinds)
    for kind in kinds:
        assert spec_name(kind).startswith("dp-")


def _node(path: str) -> DeviceSpec:
    return DeviceSpec(path, path, "rw")


@pytest.mark.parametrize(
    ("kind", "devices", "version"),
    [
        ("devices.kubevirt.io/dp-kvm", (CdiDevice("kvm-000", (_node("/dev/kvm"),)),), "0.3.0"),
        ("nvidia.com/dp-T4", (CdiDevice("0000:3b:00.0", (_node("/dev/vfio/10"),)),), "0.5.0"),
        # An mdev UUID that starts with a letter needs nothing newer.
        ("nvidia.com/dp-Q", (CdiDevice("ab5e2c3a-0000", (_node("/dev/vfio/9"),)),), "0.3.0"),
        ("nvidia.com/dp-Q", (CdiDevice("1b5e2c3a-0000", (_node("/dev/vfio/9"),)),), "0.5.0"),
        ("a.com/dp-x", (CdiDevice("d", (DeviceSpec("/dev/x", "/dev/y", "rw"),)),), "0.5.0"),
        ("a.com/dp-x.y", (CdiDevice("d", (_node("/dev/x"),)),), "0.6.0"),
        ("a.com/dp-x.y", (CdiDevice("0", (_node("/dev/x"),)),), "0.6.0"),
    ],
)
def test_the_lowest_version_that_fits(
    kind: str, devices: tuple[CdiDevice, ...], version: str
) -> None:
    assert minimum_version(kind, devices) == version
    spec = CdiSpec(spec_name(kind), kind, devices)
    assert read_spec(render(spec)).version == version
    if version != "0.3.0":  # one lower is refused by the independent reader
        lower = render(spec).replace(version.encode(), b"0.3.0", 1)
        with pytest.raises(ValueError, match="too low"):
            read_spec(lower)


@pytest.mark.parametrize(
    ("name", "ok"),
    [
        ("0000:3b:00.0", True),
        ("kvm-000", True),
        ("4b20d080-1b54-4048-85b3-a6a62d165c01", True),
        ("a", True),
        ("-a", False),
        ("a-", False),
        ("a b", False),
        ("a/b", False),
        ("", False),
    ],
)
def test_device_names(name: str, ok: bool) -> None:
    assert (device_name_error(name) is None) is ok


# -- the node ------------------------------------------------------------------------


def _config() -> Config:
    return gpu_config(shared_devices=(SharedDevice(KVM, "/dev/kvm", count=3),))


def _cdi_node(host=None, config=None):  # type: ignore[no-untyped-def]
    node = StandardNode(config or _config(), cdi=True)
    effects = node.handle(HostObserved(host or two_gpus_and_vfs(), 0.0))
    effects += node.handle(KubeletStarted(0.0))
    return node, effects


def _specs(effects: list) -> dict[str, CdiSpec]:  # type: ignore[type-arg]
    (changed,) = effects_of(effects, CdiSpecsChanged)
    return {spec.kind: spec for spec in changed.specs}


def _answer(effects: list) -> AllocateAnswer:  # type: ignore[type-arg]
    (reply,) = effects_of(effects, Reply)
    assert isinstance(reply.answer, AllocateAnswer)
    return reply.answer


def _names(kubelet: Kubelet, resource: str, *ids: str) -> tuple[str, ...]:
    """The CDI names an Allocate of `ids` for one container answers with."""
    return _answer(kubelet.allocate(resource, ids)).containers[0].cdi_devices


def test_a_spec_per_resource_with_each_device_and_its_own_nodes() -> None:
    node, effects = _cdi_node()
    specs = _specs(effects)
    assert sorted(specs) == [
        "devices.kubevirt.io/dp-kvm",
        "intel.com/dp-qat_vf",
        "nvidia.com/dp-T4",
    ]
    gpu = specs["nvidia.com/dp-T4"]
    assert gpu.name == "dp-nvidia.com_T4"
    assert [d.name for d in gpu.devices] == ["0000:3b:00.0", "0000:af:00.0"]
    # Exactly what Allocate gives for the device alone, less the env var (cdi.resources).
    assert gpu.devices[0] == CdiDevice(
        "0000:3b:00.0",
        (
            DeviceSpec("/dev/vfio/vfio", "/dev/vfio/vfio", "mrw"),
            DeviceSpec("/dev/vfio/10", "/dev/vfio/10", "mrw"),
        ),
    )
    assert [d.name for d in specs["devices.kubevirt.io/dp-kvm"].devices] == [
        "kvm-0",
        "kvm-1",
        "kvm-2",
    ]


def test_without_cdi_no_spec_and_no_names() -> None:
    node = StandardNode(_config())
    effects = node.handle(HostObserved(two_gpus_and_vfs(), 0.0))
    effects += node.handle(KubeletStarted(0.0))
    assert effects_of(effects, CdiSpecsChanged) == []
    kubelet = Kubelet(node)
    kubelet.register_all(effects)
    assert _names(kubelet, GPU_RESOURCE, "0000:3b:00.0") == ()
    assert not any(family.name.startswith("dp_cdi") for family in collect(node))
    with pytest.raises(UsageError):
        node.handle(CdiSpecsWritten(()))


def test_allocate_names_devices_only_once_their_spec_is_in_place() -> None:
    node, effects = _cdi_node()
    specs = _specs(effects)
    kubelet = Kubelet(node)
    kubelet.register_all(effects)
    # Not reported written yet: no CDI name the runtime might not resolve.
    first = _answer(kubelet.allocate(GPU_RESOURCE, ("0000:3b:00.0",))).containers[0]
    assert first.cdi_devices == ()
    node.handle(CdiSpecsWritten(specs.values()))
    answer = _answer(
        kubelet.allocate(VF_RESOURCE, ("0000:3d:01.1", "0000:3d:01.0"), ("0000:3d:01.2",))
    )
    assert [c.cdi_devices for c in answer.containers] == [
        ("intel.com/dp-qat_vf=0000:3d:01.1", "intel.com/dp-qat_vf=0000:3d:01.0"),
        ("intel.com/dp-qat_vf=0000:3d:01.2",),
    ]
    # Allocate's own answer is unchanged: the env var lists every device of the container.
    assert answer.containers[0].envs == (
        ("PCI_RESOURCE_INTEL_COM_QAT_VF", "0000:3d:01.1,0000:3d:01.0"),
    )
    assert qualified_name("intel.com/dp-qat_vf", "x") == "intel.com/dp-qat_vf=x"


def test_a_spec_reported_in_place_only_for_the_content_asked_for() -> None:
    node, effects = _cdi_node()
    specs = _specs(effects)
    stale = attrs.evolve(specs["nvidia.com/dp-T4"], devices=specs["nvidia.com/dp-T4"].devices[:1])
    others = [spec for kind, spec in specs.items() if kind != "nvidia.com/dp-T4"]
    logs = node.handle(CdiSpecsWritten([stale, *others]))
    assert node.device_plugin.cdi is not None and not node.device_plugin.cdi.in_place
    assert "nvidia.com/T4" in node.device_plugin.cdi.problem
    assert node.device_plugin.view().cdi_problem == node.device_plugin.cdi.problem  # monitoring's
    assert [log.event for log in effects_of(logs, Log)] == ["cdi-specs-not-written"]
    kubelet = Kubelet(node)
    kubelet.register_all(effects)
    assert _names(kubelet, GPU_RESOURCE, "0000:3b:00.0") == ()
    assert _names(kubelet, VF_RESOURCE, "0000:3d:01.0") == ("intel.com/dp-qat_vf=0000:3d:01.0",)


def _metric(node: StandardNode, name: str) -> float:
    (family,) = [f for f in collect(node) if f.name == name]
    return family.samples[0].value


def test_a_failing_directory_is_logged_once_retried_on_each_scan_and_recovers() -> None:
    node, effects = _cdi_node()
    kubelet = Kubelet(node)
    kubelet.register_all(effects)
    problem = "cannot list /var/run/cdi: No such file or directory"
    logs = node.handle(CdiSpecsWritten((), problem))
    assert [(log.level, log.event) for log in effects_of(logs, Log)] == [
        ("error", "cdi-specs-not-written")
    ]
    assert ("reason", problem) in effects_of(logs, Log)[0].fields
    assert (_metric(node, "dp_cdi_specs_ok"), _metric(node, "dp_cdi_spec_errors_total")) == (0, 1)
    # The host has not changed, yet each scan asks for the specs again.
    retry = node.handle(HostObserved(two_gpus_and_vfs(), 1.0))
    kubelet.now = 1.0
    specs = _specs(retry)
    assert effects_of(node.handle(CdiSpecsWritten((), problem)), Log) == []  # logged once
    assert _metric(node, "dp_cdi_spec_errors_total") == 2
    assert _names(kubelet, GPU_RESOURCE, "0000:3b:00.0") == ()
    back = node.handle(CdiSpecsWritten(specs.values()))
    assert [(log.level, log.event) for log in effects_of(back, Log)] == [
        ("info", "cdi-specs-written")
    ]
    assert _metric(node, "dp_cdi_specs_ok") == 1
    assert _names(kubelet, GPU_RESOURCE, "0000:3b:00.0") == ("nvidia.com/dp-T4=0000:3b:00.0",)
    # In place and unchanged: a scan asks for nothing.
    assert effects_of(node.handle(HostObserved(two_gpus_and_vfs(), 2.0)), CdiSpecsChanged) == []


def test_specs_follow_the_host() -> None:
    node, effects = _cdi_node()
    node.handle(CdiSpecsWritten(_specs(effects).values()))
    # One T4's group node vanished: its entry goes (a runtime would fail to stat it);
    # the other stays. The VFs' resource goes entirely with its devices.
    host = snapshot(
        [pci("0000:3b:00.0", GPU, 10), pci("0000:af:00.0", GPU, 20)],
        missing_nodes=("/dev/vfio/20",),
    )
    specs = _specs(node.handle(HostObserved(host, 1.0)))
    assert sorted(specs) == ["devices.kubevirt.io/dp-kvm", "nvidia.com/dp-T4"]
    assert [d.name for d in specs["nvidia.com/dp-T4"].devices] == ["0000:3b:00.0"]
    # Every node missing: no spec at all (CDI refuses one without devices).
    host = snapshot([pci("0000:3b:00.0", GPU, 10)], missing_nodes=("/dev/vfio/10",))
    assert sorted(_specs(node.handle(HostObserved(host, 2.0)))) == ["devices.kubevirt.io/dp-kvm"]


def test_an_unhealthy_device_whose_nodes_exist_keeps_its_entry() -> None:
    # Unbound from any driver: Unhealthy, but its nodes exist. A container it
    # was given before keeps resolving; Allocate refuses it to new ones.
    host = snapshot([pci("0000:3b:00.0", GPU, 10, driver=None), pci("0000:af:00.0", GPU, 20)])
    node, effects = _cdi_node(host)
    (resource,) = [r for r in node.inventory.resources if r.name == GPU_RESOURCE]
    assert [d.healthy for d in resource.devices] == [False, True]
    spec = _specs(effects)["nvidia.com/dp-T4"]
    assert [d.name for d in spec.devices] == ["0000:3b:00.0", "0000:af:00.0"]


def test_a_restarted_node_asks_once_even_with_nothing_to_keep() -> None:
    # The directory may hold specs of an earlier run: the first scan always asks,
    # so that the shell removes them.
    node = StandardNode(Config(shared_devices=()), cdi=True)
    (changed,) = effects_of(node.handle(HostObserved(snapshot([]), 0.0)), CdiSpecsChanged)
    assert changed.specs == ()
    node.handle(CdiSpecsWritten(()))
    assert effects_of(node.handle(HostObserved(snapshot([]), 1.0)), CdiSpecsChanged) == []
