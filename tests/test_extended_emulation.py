"""The emulators' model of KEP-5004 against the 1.36 sources' rules (tables).

`extendeddynamicresources.go` names the scheduler's requests and mappings;
`filterExtendedResources` says which front end serves a name on a node;
`GetResources` in the kubelet's DRA manager says which CDI devices a
container gets.
"""

from __future__ import annotations

from typing import Any

import pytest

from dp_testing.apiserver.extended import (
    class_for,
    node_rule,
    pod_extended_requests,
    selector_matcher,
)
from dp_testing.apiserver.scheduler import Device
from dp_testing.dra_kubelet._containers import container_cdi_devices
from dp_testing.dra_kubelet._rpc import Device as Prepared

T4, NVME = "nvidia.com/T4", "devices.kubevirt.io/nvme"


def device_class(name: str, extended: str | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"selectors": [{"cel": {"expression": 'device.driver == "d.example"'}}]}
    if extended:
        spec["extendedResourceName"] = extended
    return {"metadata": {"name": name}, "spec": spec}


def container(name: str, limits: dict[str, int], **extra: Any) -> dict[str, Any]:
    return {"name": name, "resources": {"limits": {k: str(v) for k, v in limits.items()}}, **extra}


def pod(*containers: dict[str, Any], inits: tuple[dict[str, Any], ...] = ()) -> dict[str, Any]:
    return {"spec": {"initContainers": list(inits), "containers": list(containers)}}


CLASSES = [device_class("t4", T4), device_class("nvme", NVME), device_class("other")]


def test_requests_are_named_by_container_index_and_sorted_resource_index() -> None:
    sidecar = container("sidecar", {NVME: 1}, restartPolicy="Always")
    spec = pod(
        container("compute", {"cpu": 2, T4: 2, NVME: 1}),
        container("helper", {"memory": 1, T4: 1}),
        inits=(sidecar,),
    )
    by_dra = {T4: CLASSES[0], NVME: CLASSES[1]}
    requests, mappings = pod_extended_requests(spec, by_dra)
    # compute is container 1 (after the init); its sorted names: cpu, nvme, T4.
    assert [(r.name, r.device_class["metadata"]["name"], r.count) for r in requests] == [
        ("container-0-request-0", "nvme", 1),
        ("container-1-request-1", "nvme", 1),
        ("container-1-request-2", "t4", 2),
        ("container-2-request-1", "t4", 1),
    ]
    assert {(m["containerName"], m["resourceName"], m["requestName"]) for m in mappings} == {
        ("sidecar", NVME, "container-0-request-0"),
        ("compute", NVME, "container-1-request-1"),
        ("compute", T4, "container-1-request-2"),
        ("helper", T4, "container-2-request-1"),
    }


def test_a_plain_init_container_is_refused_rather_than_modelled_wrong() -> None:
    spec = pod(container("c", {T4: 1}), inits=(container("init", {T4: 1}),))
    with pytest.raises(ValueError, match="init containers"):
        pod_extended_requests(spec, {T4: CLASSES[0]})


@pytest.mark.parametrize(
    ("allocatable", "by_dra", "unfit"),
    [
        ({}, {T4}, None),  # not on the node, and a class: DRA
        ({T4: "0"}, {T4}, None),  # registered at 0 (a device plugin left it): DRA
        ({T4: "4"}, set(), None),  # the device plugin offers it here
    ],
)
def test_the_node_rule(allocatable: dict[str, str], by_dra: set[str], unfit: str | None) -> None:
    node = {"status": {"allocatable": allocatable}}
    found, why = node_rule(pod(container("c", {T4: 1})), node, CLASSES)
    assert (set(found), why) == (by_dra, unfit)


def test_a_name_neither_served_nor_backed_does_not_fit() -> None:
    found, why = node_rule(pod(container("c", {"example.com/x": 1})), {}, CLASSES)
    assert (found, why) == ({}, "cannot fit resource example.com/x")


def test_a_class_by_its_implicit_name_and_the_newest_of_two() -> None:
    assert class_for("deviceclass.resource.kubernetes.io/other", CLASSES) is CLASSES[2]
    older = {**device_class("t4-old", T4), "metadata": {"name": "t4-old", "creationTimestamp": "1"}}
    newer = {**device_class("t4-new", T4), "metadata": {"name": "t4-new", "creationTimestamp": "2"}}
    assert class_for(T4, [newer, older]) is newer


def test_the_selector_form_dp_writes_and_nothing_else() -> None:
    device = Device(
        "d.example",
        "node-a",
        {
            "name": "pci-0000-3b-00-0",
            "attributes": {
                "resourceName": {"string": T4},
                "resource.kubernetes.io/pciBusID": {"string": "0000:3b:00.0"},
            },
        },
    )
    good = (
        'device.driver == "d.example" && device.attributes["d.example"].resourceName == '
        f'"{T4}" && device.attributes["resource.kubernetes.io"].pciBusID == "0000:3b:00.0"'
    )
    assert selector_matcher(good)(device)
    assert not selector_matcher(good.replace(T4, NVME))(device)
    assert not selector_matcher('device.driver == "e.example"')(device)
    with pytest.raises(ValueError, match="cannot evaluate"):
        selector_matcher('device.attributes["d.example"].resourceName != "x"')


def test_each_container_gets_the_cdi_devices_of_its_mapped_requests_and_claims() -> None:
    spec = pod(
        container("compute", {T4: 1}),
        container("other", {NVME: 1}),
    )
    spec["spec"]["containers"][1]["resources"]["claims"] = [{"name": "gpu"}]
    spec["spec"]["resourceClaims"] = [{"name": "gpu", "resourceClaimTemplateName": "t"}]
    spec["status"] = {
        "resourceClaimStatuses": [{"name": "gpu", "resourceClaimName": "p-gpu-abcde"}],
        "extendedResourceClaimStatus": {
            "resourceClaimName": "p-extended-resources-xyz12",
            "requestMappings": [
                {"containerName": "compute", "resourceName": T4, "requestName": "r0"},
                # A mapping for a resource the container does not ask for is not its.
                {"containerName": "compute", "resourceName": NVME, "requestName": "r1"},
                {"containerName": "other", "resourceName": NVME, "requestName": "r1"},
            ],
        },
    }
    claims = {
        "p-extended-resources-xyz12": [
            Prepared(("r0",), "n", "a", ("x/claim=a", "x/meta=r0", "x/claim=env_r0")),
            Prepared(("r1",), "n", "b", ("x/claim=b",)),
        ],
        "p-gpu-abcde": [Prepared((), "n", "g", ("x/claim=g",))],
    }
    assert container_cdi_devices(spec, claims) == {
        "compute": ["x/claim=a", "x/meta=r0", "x/claim=env_r0"],
        "other": ["x/claim=g", "x/claim=b"],
    }
    with pytest.raises(KeyError, match="p-gpu-abcde"):
        container_cdi_devices(spec, {"p-extended-resources-xyz12": []})


async def test_a_pod_the_emulator_cannot_model_is_said_so_not_retried() -> None:
    import asyncio

    from dp_testing.apiserver import ApiServerEmulator, Scheduler

    server = ApiServerEmulator()
    scheduler = Scheduler(server)
    try:
        server.add_node("n")
        server.store.create("deviceclasses", "", device_class("t4", T4))
        spec = pod(container("c", {T4: 1}), inits=(container("init", {T4: 1}),))
        server.store.create("pods", "default", {"metadata": {"name": "p"}, **spec})
        scheduler.schedule("default", "p", "n")
        await asyncio.sleep(0.05)
        assert scheduler.pending == {}
        assert scheduler.unschedulable[("default", "p")].startswith("not emulated: ")
    finally:
        scheduler.close()
