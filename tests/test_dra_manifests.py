"""The DRA deployment (deploy/dra/) and examples (examples/dra/), offline.

Every manifest is validated against a published schema: Kubernetes v1.34.0's
for the core, apps, rbac and resource.k8s.io kinds, KubeVirt v1.9.0's for the
VirtualMachineInstance (tests/data/k8s/README.md says where each comes from).
The component is applied to the base here, as kustomize does, and compared with
`kubectl kustomize` where kubectl is installed. Then what the pieces say of
each other is checked: the flags against `dp-server serve`, the config against
`dp-server scan`, the DeviceClass selectors against the attributes dp publishes
for a fixture host, and the VMIs' claims against the templates and classes.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import jsonschema
import pytest
import yaml

from dp_core.config import Config, MediatedDevice, PciHostDevice
from dp_core.dra.names import MDEV_UUID, PCI_BUS_ID, RESOURCE_NAME
from dp_core.dra.pool import DraDevice, dra_catalogue
from dp_core.host import HostSnapshot, MdevDevice, MdevType
from dp_core.host.pci import PciAddress
from dp_core.inventory import build_inventory
from dp_server.config.loader import parse_config
from dp_testing.topology import fixture_topology, to_snapshot, write_sysfs

from benchmarks_doc import measured_peak_mib, mebibytes
from strategic_merge import strategic_merge

REPO = Path(__file__).resolve().parent.parent
DEPLOY = REPO / "deploy"
COMPONENT = DEPLOY / "dra"
EXAMPLES = REPO / "examples" / "dra"
SCHEMAS = Path(__file__).resolve().parent / "data" / "k8s"
K8S_SCHEMA = SCHEMAS / "kubernetes-v1.34.0-manifests.schema.json"
KUBEVIRT_SCHEMA = SCHEMAS / "kubevirt-v1.9.0-vmi.swagger.json"

Object = dict[str, Any]


def _documents(path: Path) -> list[Object]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _key(obj: Object) -> tuple[str, str]:
    return obj["kind"], obj["metadata"]["name"]


# --- schemas ------------------------------------------------------------------------


def swagger_to_json_schema(node: Any) -> Any:
    """A Swagger 2.0 / OpenAPI schema as strict JSON Schema 2020-12.

    - `$ref`s to `#/definitions/` point at `#/$defs/`;
    - `format: int-or-string` (typed `string` in the spec) takes integers too;
    - `nullable: true` adds "null" to the type;
    - `x-kubernetes-*` extensions go (they constrain merges, not documents);
    - an object with `properties` and no `additionalProperties` gets
      `additionalProperties: false`, so a misspelt field fails, as in the
      strict form of the Kubernetes schema. The API server would drop such a
      field (or reject it under strict field validation); either way the
      manifest would not do what it says.
    Walks schema keywords only: a property may itself be named `type` or `format`.
    """
    if not isinstance(node, dict):
        return node
    out: Object = {}
    for key, value in node.items():
        if key.startswith("x-kubernetes-") or key == "nullable":
            continue
        if key == "$ref":
            out[key] = value.replace("#/definitions/", "#/$defs/")
        elif key == "properties":
            out[key] = {name: swagger_to_json_schema(s) for name, s in value.items()}
        elif key in ("items", "additionalProperties", "not"):
            out[key] = swagger_to_json_schema(value)
        elif key in ("allOf", "anyOf", "oneOf"):
            out[key] = [swagger_to_json_schema(s) for s in value]
        else:
            out[key] = value
    if node.get("format") == "int-or-string":
        out["type"] = ["integer", "string"]
    if node.get("nullable") is True and "type" in out:
        types = out["type"] if isinstance(out["type"], list) else [out["type"]]
        out["type"] = [*types, "null"]
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


class Schemas:
    """One validator per (apiVersion, kind) of the vendored schemas."""

    # KubeVirt's definitions carry no group-version-kind.
    KUBEVIRT_KINDS = {("kubevirt.io/v1", "VirtualMachineInstance"): "v1.VirtualMachineInstance"}

    def __init__(self) -> None:
        k8s = json.loads(K8S_SCHEMA.read_text())
        self._k8s_defs: Object = k8s["$defs"]
        self._k8s_kinds: dict[tuple[str, str], str] = {}
        for name, definition in self._k8s_defs.items():
            for gvk in definition.get("x-kubernetes-group-version-kind", ()):
                group, version = gvk["group"], gvk["version"]
                api_version = f"{group}/{version}" if group else version
                self._k8s_kinds[(api_version, gvk["kind"])] = name
        swagger = json.loads(KUBEVIRT_SCHEMA.read_text())
        assert swagger["swagger"] == "2.0"
        self._kubevirt_defs: Object = {
            name: swagger_to_json_schema(s) for name, s in swagger["definitions"].items()
        }

    def validator(self, api_version: str, kind: str) -> jsonschema.Draft202012Validator:
        key = (api_version, kind)
        if key in self._k8s_kinds:
            defs, name = self._k8s_defs, self._k8s_kinds[key]
        elif key in self.KUBEVIRT_KINDS:
            defs, name = self._kubevirt_defs, self.KUBEVIRT_KINDS[key]
        else:
            raise KeyError(f"no schema vendored for {api_version} {kind}")
        schema = {
            "$schema": "https://json-schema.org/draft/2020-12/schema",
            "$defs": defs,
            "$ref": f"#/$defs/{name}",
        }
        return jsonschema.Draft202012Validator(schema)

    def errors(self, obj: Object) -> list[str]:
        validator = self.validator(obj["apiVersion"], obj["kind"])
        return [
            f"{'/'.join(str(p) for p in e.absolute_path) or '(root)'}: {e.message}"
            for e in validator.iter_errors(obj)
        ]


@pytest.fixture(scope="module")
def schemas() -> Schemas:
    return Schemas()


# --- kustomize, as far as these manifests use it ----------------------------------


def _pointer(document: Any, pointer: str) -> tuple[Any, str | int]:
    *parents, last = pointer.lstrip("/").split("/")
    for part in parents:
        document = document[int(part)] if isinstance(document, list) else document[part]
    return document, (last if isinstance(document, dict) or last == "-" else int(last))


def json6902(document: Object, operations: list[Object]) -> Object:
    """RFC 6902 `add` and `replace`, what the deploy/ patches use."""
    result = copy.deepcopy(document)
    for operation in operations:
        parent, key = _pointer(result, operation["path"])
        value = copy.deepcopy(operation["value"])
        if operation["op"] == "add":
            if isinstance(parent, list):
                if key == "-":
                    parent.append(value)
                else:
                    assert isinstance(key, int)
                    parent.insert(key, value)
            else:
                assert key not in parent, f"add {operation['path']}: already there"
                parent[key] = value
        elif operation["op"] == "replace":
            assert key != "-"
            if isinstance(parent, dict):
                assert key in parent, f"replace {operation['path']}: nothing there"
            parent[key] = value  # type: ignore[index]
        else:
            raise AssertionError(f"unsupported op {operation['op']!r}")
    return result


def build(root: Path) -> dict[tuple[str, str], Object]:
    """A kustomization's objects by (kind, name), with its components applied."""
    kustomization = yaml.safe_load((root / "kustomization.yaml").read_text())
    objects: dict[tuple[str, str], Object] = {}
    for resource in kustomization.get("resources", ()):
        path = root / resource
        found = build(path) if path.is_dir() else {_key(d): d for d in _documents(path)}
        assert not set(found) & set(objects), f"{resource}: an object twice"
        objects.update(found)
    for component in kustomization.get("components", ()):
        objects = apply_component(objects, root / component)
    namespace = kustomization.get("namespace")
    if namespace:
        for obj in objects.values():
            if obj["kind"] not in ("Namespace", "ClusterRole", "ClusterRoleBinding"):
                obj["metadata"]["namespace"] = namespace
    return objects


def apply_component(objects: dict[tuple[str, str], Object], root: Path) -> dict:
    component = yaml.safe_load((root / "kustomization.yaml").read_text())
    assert component["apiVersion"] == "kustomize.config.k8s.io/v1alpha1"
    assert component["kind"] == "Component"
    result = copy.deepcopy(objects)
    for resource in component.get("resources", ()):
        for document in _documents(root / resource):
            assert _key(document) not in result, f"{resource}: {_key(document)} twice"
            result[_key(document)] = document
    for patch in component.get("patches", ()):
        (content,) = _documents(root / patch["path"]) if "target" not in patch else [None]
        if "target" in patch:
            key = (patch["target"]["kind"], patch["target"]["name"])
            operations = yaml.safe_load((root / patch["path"]).read_text())
            result[key] = json6902(result[key], operations)
        else:
            assert content is not None
            result[_key(content)] = strategic_merge(result[_key(content)], content)
    return result


@pytest.fixture(scope="module")
def variant() -> dict[tuple[str, str], Object]:
    """The DRA variant: deploy/ with the deploy/dra component."""
    return apply_component(build(DEPLOY), COMPONENT)


def _container(variant: dict[tuple[str, str], Object]) -> Object:
    (container,) = variant[("DaemonSet", "dp")]["spec"]["template"]["spec"]["containers"]
    assert isinstance(container, dict)
    return container


def _flags(container: Object) -> dict[str, str | None]:
    """`--flag value` and `--flag=value` pairs of the container's args."""
    args = container["args"]
    flags: dict[str, str | None] = {}
    i = 0
    while i < len(args):
        word = args[i]
        if word.startswith("--"):
            name, sep, value = word.partition("=")
            if not sep and i + 1 < len(args) and not args[i + 1].startswith("--"):
                value, i = args[i + 1], i + 1
            assert name not in flags, f"{name} given twice"
            flags[name] = value if (sep or value) else None
        i += 1
    return flags


def _config(variant: dict[tuple[str, str], Object]) -> Config:
    text = variant[("ConfigMap", "dp-config")]["data"]["config.yaml"]
    return parse_config(text, "deploy/dra/configmap.yaml")


# --- every manifest against its schema ----------------------------------------------


def _all_manifests() -> Iterator[tuple[str, Object]]:
    for path in sorted(DEPLOY.glob("*.yaml")):
        if path.name != "kustomization.yaml":
            for document in _documents(path):
                yield f"deploy/{path.name}", document
    for name in ("binding", "without-kubevirt"):
        for key, obj in sorted(apply_component(build(DEPLOY), DEPLOY / name).items()):
            yield f"deploy/{name} ({key[0]} {key[1]})", obj
    for key, obj in sorted(apply_component(build(DEPLOY), COMPONENT).items()):
        yield f"deploy/dra ({key[0]} {key[1]})", obj
    for path in sorted(EXAMPLES.glob("*.yaml")):
        for document in _documents(path):
            yield f"examples/dra/{path.name} ({document['kind']})", document


@pytest.mark.parametrize(
    "where, obj", [pytest.param(where, obj, id=where) for where, obj in _all_manifests()]
)
def test_manifest_validates_against_the_published_schema(
    schemas: Schemas, where: str, obj: Object
) -> None:
    # deploy/monitoring/ is not here: its kinds are the Prometheus Operator's
    # CRDs, whose schemas are not vendored.
    assert schemas.errors(obj) == [], where


def test_the_manifests_cover_every_kind_used() -> None:
    kinds = {(obj["apiVersion"], obj["kind"]) for _, obj in _all_manifests()}
    assert kinds == {
        ("v1", "Namespace"),
        ("v1", "ConfigMap"),
        ("v1", "ServiceAccount"),
        ("apps/v1", "DaemonSet"),
        ("rbac.authorization.k8s.io/v1", "ClusterRole"),
        ("rbac.authorization.k8s.io/v1", "ClusterRoleBinding"),
        ("resource.k8s.io/v1", "DeviceClass"),
        ("resource.k8s.io/v1", "ResourceClaimTemplate"),
        ("kubevirt.io/v1", "VirtualMachineInstance"),
    }


def _vmi() -> Object:
    (vmi,) = _documents(EXAMPLES / "vmi-hostdevice.yaml")
    return vmi


@pytest.mark.parametrize(
    "pointer, value, message",
    [
        # A misspelt field, where the strict conversion must catch it.
        ("/spec/domain/devices/hostDevices/0/claimname", "t4", "claimname"),
        ("/spec/resourceClaims/0/resourceClaimTemplate", "x", "resourceClaimTemplate"),
        # A wrong type.
        ("/spec/domain/devices/hostDevices/0/requestName", 3, "3 is not of type 'string'"),
        # A required field missing (v1.HostDevice requires name).
        ("/spec/domain/devices/hostDevices/0", {"claimName": "t4"}, "'name' is a required"),
    ],
)
def test_the_kubevirt_schema_can_fail(
    schemas: Schemas, pointer: str, value: Any, message: str
) -> None:
    vmi = _vmi()
    parent, key = _pointer(vmi, pointer)
    parent[key] = value
    errors = schemas.errors(vmi)
    assert any(message in error for error in errors), errors


def test_the_kubernetes_schema_can_fail(schemas: Schemas, variant: dict) -> None:
    daemonset = copy.deepcopy(variant[("DaemonSet", "dp")])
    daemonset["spec"]["template"]["spec"]["serviceAcountName"] = "dp"
    assert any("serviceAcountName" in e for e in schemas.errors(daemonset))
    device_class = _documents(EXAMPLES / "deviceclasses.yaml")[0]
    device_class["spec"]["selectors"][0]["cel"] = {"expresion": "true"}
    assert schemas.errors(device_class)


def test_int_or_string_takes_both() -> None:
    converted = swagger_to_json_schema(
        {"type": "object", "properties": {"port": {"type": "string", "format": "int-or-string"}}}
    )
    validator = jsonschema.Draft202012Validator(converted)
    assert validator.is_valid({"port": 8080}) and validator.is_valid({"port": "metrics"})
    assert not validator.is_valid({"port": 1.5}) and not validator.is_valid({"prot": 1})


# --- the component, and kubectl's view of it -------------------------------------


def test_kubectl_kustomize_renders_the_same_objects(
    tmp_path: Path, variant: dict[tuple[str, str], Object]
) -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed")
    # kustomize refuses absolute paths and a base that contains its overlay,
    # so the overlay an operator writes lives outside deploy/.
    relative = os.path.relpath(DEPLOY, tmp_path)
    (tmp_path / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\n"
        "kind: Kustomization\n"
        f"resources: [{relative}]\n"
        f"components: [{relative}/dra]\n"
    )
    result = subprocess.run(
        [kubectl, "kustomize", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    rendered = {_key(d): d for d in yaml.safe_load_all(result.stdout) if d}
    assert rendered == variant


def test_the_component_adds_and_never_removes(variant: dict[tuple[str, str], Object]) -> None:
    base = build(DEPLOY)
    assert set(variant) - set(base) == {
        ("ServiceAccount", "dp"),
        ("ClusterRole", "dp-dra"),
        ("ClusterRoleBinding", "dp-dra"),
        ("DeviceClass", "tu104gl-tesla-t4.nvidia.com.vfio.dp.example.com"),
        ("DeviceClass", "tu104-hda.nvidia.com.vfio.dp.example.com"),
        ("DeviceClass", "grid-t4-1q.nvidia.com.vfio.dp.example.com"),
    }
    (base_container,) = base[("DaemonSet", "dp")]["spec"]["template"]["spec"]["containers"]
    container = _container(variant)
    assert container["args"][: len(base_container["args"])] == base_container["args"]
    assert all(m in container["volumeMounts"] for m in base_container["volumeMounts"])
    assert container["securityContext"] == base_container["securityContext"]


# --- the DaemonSet ------------------------------------------------------------------


DRA_FLAGS = {
    "--plugins-registry-dir": "/var/lib/kubelet/plugins_registry",
    "--plugins-dir": "/var/lib/kubelet/plugins",
    "--cdi-spec-dir": "/var/run/cdi",
    "--state-dir": "/run/dp",
}


def test_daemonset_flags_mounts_and_node_name(variant: dict[tuple[str, str], Object]) -> None:
    pod = variant[("DaemonSet", "dp")]["spec"]["template"]["spec"]
    container = _container(variant)
    flags = _flags(container)
    for flag, path in DRA_FLAGS.items():
        assert flags.get(flag) == path, flag

    # Each directory a flag names is the host's own, mounted at the same path
    # and writable: the kubelet and the container runtime read what dp puts there.
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert len(mounts) == len(container["volumeMounts"])
    for flag, path in DRA_FLAGS.items():
        mount = mounts.get(path)
        assert mount is not None, f"{flag} {path} is not mounted"
        assert not mount.get("readOnly", False), path
        assert "subPath" not in mount
        assert volumes[mount["name"]]["hostPath"]["path"] == path
    assert volumes[mounts["/var/run/cdi"]["name"]]["hostPath"]["type"] == "DirectoryOrCreate"
    assert {m["name"] for m in container["volumeMounts"]} == set(volumes)

    # --node-name is the pod's node, through the downward API.
    env = {e["name"]: e for e in container["env"]}
    assert flags["--node-name"] == "$(NODE_NAME)"
    assert env["NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}


def test_daemonset_flags_are_accepted_by_serve(variant: dict[tuple[str, str], Object]) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "dp_server", "serve", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    options = set(re.findall(r"(--[a-z][a-z0-9-]*)", result.stdout))
    assert set(_flags(_container(variant))) <= options


def test_the_pod_has_its_token_and_memory_for_both_front_ends(
    variant: dict[tuple[str, str], Object],
) -> None:
    pod = variant[("DaemonSet", "dp")]["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is True, "the DRA front end calls the API"
    resources = _container(variant)["resources"]
    # The peak bench/bench_memory.py measured with both front ends under load
    # (docs/benchmarks.md), with at least half as much again on top.
    peak = measured_peak_mib("bench/bench_memory.py")
    assert mebibytes(resources["limits"]["memory"]) >= 1.5 * peak
    assert mebibytes(resources["requests"]["memory"]) >= peak


# --- RBAC ---------------------------------------------------------------------------


def test_rbac_is_what_the_driver_does(variant: dict[tuple[str, str], Object]) -> None:
    role = variant[("ClusterRole", "dp-dra")]
    granted = {
        (group, resource): sorted(rule["verbs"])
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
    }
    assert granted == {
        ("resource.k8s.io", "resourceslices"): sorted(
            ["get", "list", "watch", "create", "update", "delete"]
        ),
        ("resource.k8s.io", "resourceclaims"): ["get"],
        ("", "nodes"): ["get", "list", "watch"],
        ("", "pods"): ["get"],
        ("events.k8s.io", "events"): ["create"],
    }
    assert all("resourceNames" not in r and "nonResourceURLs" not in r for r in role["rules"])

    binding = variant[("ClusterRoleBinding", "dp-dra")]
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": "dp-dra",
    }
    daemonset = variant[("DaemonSet", "dp")]
    account = daemonset["spec"]["template"]["spec"]["serviceAccountName"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account, "namespace": "dp-system"}
    ]
    assert variant[("ServiceAccount", account)]["metadata"]["namespace"] == "dp-system"
    assert daemonset["metadata"]["namespace"] == "dp-system"


# --- the config ---------------------------------------------------------------------


def test_config_puts_the_gpus_on_dra_and_leaves_the_shared_devices_to_virt_handler(
    variant: dict[tuple[str, str], Object],
) -> None:
    config = _config(variant)
    assert config.dra is not None and config.dra.driver_name == "vfio.dp.example.com"
    permitted = config.permitted_host_devices
    assert permitted is not None
    entries: tuple[PciHostDevice | MediatedDevice, ...] = (
        *permitted.pci_host_devices,
        *permitted.mediated_devices,
    )
    assert {e.resource_name: e.frontend for e in entries} == {
        "nvidia.com/TU104GL_Tesla_T4": "dra",
        "nvidia.com/TU104_HDA": "dra",
        "nvidia.com/GRID_T4-1Q": "dra",
    }
    # Off, as in the base: virt-handler serves them on a KubeVirt node.
    assert {d.resource_name: d.enabled for d in config.shared_devices} == {
        "devices.kubevirt.io/kvm": False,
        "devices.kubevirt.io/tun": False,
        "devices.kubevirt.io/vhost-net": False,
    }


def test_scan_accepts_the_config(tmp_path: Path, variant: dict[tuple[str, str], Object]) -> None:
    sysfs, dev = write_sysfs(fixture_topology(), tmp_path / "host")
    config_file = tmp_path / "config.yaml"
    config_file.write_text(variant[("ConfigMap", "dp-config")]["data"]["config.yaml"])
    result = subprocess.run(
        [sys.executable, "-m", "dp_server", "scan", "--format", "json"]
        + ["--sysfs", str(sysfs), "--dev", str(dev), "--config", str(config_file)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    # The device-plugin front end serves nothing: the T4s are the DRA front
    # end's, and the shared devices virt-handler's.
    assert document["resources"] == []
    on_dra = [s for s in document["skipped"] if s["resource_name"] == "nvidia.com/TU104GL_Tesla_T4"]
    assert on_dra and all("dra" in s["reason"] for s in on_dra)


# --- DeviceClasses against what dp publishes ----------------------------------------


_DRIVER_CLAUSE = re.compile(r'device\.driver == "([^"]+)"')
_ATTRIBUTE_CLAUSE = re.compile(
    r'device\.attributes\["([^"]+)"\]\.([A-Za-z_][A-Za-z0-9_]*) == "([^"]*)"'
)


def selects(expression: str, driver: str, device: DraDevice) -> bool:
    """The selector's value for a device of `driver`, for the one form the
    examples use: equalities joined by &&. Any other clause fails the test, so
    an example cannot drift into a form nothing here checks."""
    published: dict[tuple[str, str], object] = {}
    for name, value in device.attributes:
        domain, slash, identifier = name.rpartition("/")
        # An attribute without a domain is in the driver's.
        published[(domain if slash else driver, identifier)] = value
    result = True
    for clause in (c.strip() for c in expression.split("&&")):
        if match := _DRIVER_CLAUSE.fullmatch(clause):
            result = result and match.group(1) == driver
        elif match := _ATTRIBUTE_CLAUSE.fullmatch(clause):
            key = (match.group(1), match.group(2))
            # CEL fails on a missing key; the scheduler treats that as a mismatch.
            result = result and published.get(key) == match.group(3)
        else:
            raise AssertionError(f"cannot evaluate {clause!r}")
    return result


T4_VGPU = "0f6c4e2a-7d1b-4c3e-9a5f-1b2c3d4e5f60"


def _fixture_host() -> HostSnapshot:
    """The fixture host, with a T4 vGPU besides its RTX 6000 ones."""
    host = to_snapshot(fixture_topology())
    parent = PciAddress.parse("0000:86:00.0")
    return attrs.evolve(
        host,
        mdev_types=(*host.mdev_types, MdevType(parent, "nvidia-222", "GRID T4-1Q", 1)),
        mdevs=(*host.mdevs, MdevDevice(T4_VGPU, parent, "nvidia-222", 303)),
        dev_nodes=frozenset({*host.dev_nodes, "/dev/vfio/303"}),
    )


@pytest.fixture(scope="module")
def published(variant: dict[tuple[str, str], Object]) -> tuple[str, tuple[DraDevice, ...]]:
    config = _config(variant)
    assert config.dra is not None and config.permitted_host_devices is not None
    host = _fixture_host()
    devices, problems = dra_catalogue(build_inventory(host, config), host)
    assert problems == ()
    return config.dra.driver_name, devices


def _classes() -> dict[str, str]:
    """DeviceClass name -> its one CEL expression."""
    classes = {}
    shipped = _documents(EXAMPLES / "deviceclasses.yaml")
    for device_class in shipped + _documents(EXAMPLES / "deviceclass-iommu-groups.yaml"):
        (selector,) = device_class["spec"]["selectors"]
        classes[device_class["metadata"]["name"]] = selector["cel"]["expression"]
    return classes


T4 = "nvidia.com/TU104GL_Tesla_T4"


def _kind(device: DraDevice) -> tuple[str, str]:
    """What a class may select: the functions of one resource, or the whole
    IOMMU groups led by one resource."""
    return ("group" if device.members else "function", device.resource)


def test_each_device_class_selects_exactly_one_kind_of_device(
    published: tuple[str, tuple[DraDevice, ...]],
) -> None:
    driver, devices = published
    assert {_kind(d) for d in devices} == {
        ("function", T4),
        ("function", "nvidia.com/TU104_HDA"),
        ("function", "nvidia.com/GRID_T4-1Q"),
        ("group", T4),
    }
    selected_by: dict[tuple[str, str], set[str]] = {}
    for name, expression in _classes().items():
        chosen = {_kind(d) for d in devices if selects(expression, driver, d)}
        assert len(chosen) == 1, f"{name} selects {chosen or 'nothing'}"
        (kind,) = chosen
        assert all(selects(expression, driver, d) for d in devices if _kind(d) == kind)
        selected_by.setdefault(kind, set()).add(name)
    # A class per resource, written by dp, and one for the whole group.
    assert {k: len(n) for k, n in selected_by.items()} == {
        ("function", T4): 1,
        ("function", "nvidia.com/TU104_HDA"): 1,
        ("function", "nvidia.com/GRID_T4-1Q"): 1,
        ("group", T4): 1,
    }


def test_the_selector_check_can_fail(published: tuple[str, tuple[DraDevice, ...]]) -> None:
    driver, devices = published
    t4 = next(d for d in devices if d.resource == T4 and not d.members)
    good = f'device.attributes["{driver}"].{RESOURCE_NAME} == "nvidia.com/TU104GL_Tesla_T4"'
    assert selects(good, driver, t4)
    # The attribute is in the driver's domain, not unqualified or another's.
    assert not selects(good.replace(f'["{driver}"]', '["other.example.com"]'), driver, t4)
    assert not selects(f'device.driver == "other.example.com" && {good}', driver, t4)
    pci = f'device.attributes["resource.kubernetes.io"].pciBusID == "{t4.advertised.id}"'
    assert selects(pci, driver, t4)
    with pytest.raises(AssertionError, match="cannot evaluate"):
        selects('device.attributes["x"].y != "z"', driver, t4)


# --- claims and VMIs ----------------------------------------------------------------


def _templates() -> dict[str, dict[str, str]]:
    """ResourceClaimTemplate name -> request name -> DeviceClass name."""
    templates: dict[str, dict[str, str]] = {}
    for template in _documents(EXAMPLES / "resourceclaimtemplates.yaml"):
        requests = template["spec"]["spec"]["devices"]["requests"]
        for request in requests:
            # KubeVirt 1.9 takes exactly one device per request.
            assert request["exactly"].get("allocationMode", "ExactCount") == "ExactCount"
            assert request["exactly"].get("count", 1) == 1
        templates[template["metadata"]["name"]] = {
            r["name"]: r["exactly"]["deviceClassName"] for r in requests
        }
    return templates


# What KubeVirt 1.9 reads from the metadata for each kind of VMI device
# (pkg/dra/utils.go: GetPCIAddressForClaim for host devices; a GPU by its PCI
# address or, for a vGPU, its mdev UUID).
READS = {"hostDevices": {PCI_BUS_ID}, "gpus": {PCI_BUS_ID, MDEV_UUID}}


@pytest.mark.parametrize("name", ["vmi-hostdevice.yaml", "vmi-vgpu.yaml"])
def test_vmi_devices_name_a_claim_request_whose_devices_kubevirt_can_read(
    name: str, published: tuple[str, tuple[DraDevice, ...]]
) -> None:
    driver, devices = published
    classes = _classes()
    templates = _templates()
    (vmi,) = _documents(EXAMPLES / name)
    claims = {c["name"]: c for c in vmi["spec"]["resourceClaims"]}
    used = 0
    for field, reads in READS.items():
        for entry in vmi["spec"]["domain"]["devices"].get(field, ()):
            assert "deviceName" not in entry, "a DRA device names no device-plugin resource"
            claim = claims[entry["claimName"]]
            requests = templates[claim["resourceClaimTemplateName"]]
            device_class = requests[entry["requestName"]]
            chosen = [d for d in devices if selects(classes[device_class], driver, d)]
            assert chosen, f"{device_class} selects nothing on the fixture host"
            for device in chosen:
                keys = {k for k, _ in device.attributes}
                assert keys & reads, f"{field}: KubeVirt finds none of {reads} on {device.name}"
            used += 1
    assert used == 1
    # Every claim the VMI declares is used by a device.
    assert len(claims) == used


def test_every_claim_template_gets_devices_kubevirt_can_read(
    published: tuple[str, tuple[DraDevice, ...]],
) -> None:
    """Each template's requests select devices with the one attribute KubeVirt
    1.9 reads per request: a PCI address (a whole group's is its lead's) or an
    mdev UUID."""
    driver, devices = published
    classes = _classes()
    for template, requests in _templates().items():
        for request, class_name in requests.items():
            chosen = [d for d in devices if selects(classes[class_name], driver, d)]
            assert chosen, f"{template}/{request}: {class_name} selects nothing"
            for device in chosen:
                keys = {k for k, _ in device.attributes}
                assert keys & {PCI_BUS_ID, MDEV_UUID}, f"{template}/{request}: {device.name}"
