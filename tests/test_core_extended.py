"""A claim the scheduler made for a pod's extended resources (KEP-5004), in the core: tables.

The host of test_core_dra: two T4s (groups 10 and 20), their audio functions,
a NIC (group 30) and a T4 vGPU (group 40).
"""

from __future__ import annotations

import pytest
from test_core_dra import DRIVER, NODE, VGPU_UUID, config, started

from dp_core.cdi.claims import claim_request_device_id, claim_spec
from dp_core.dra.claims import ClaimRef
from dp_core.dra.effects import ClaimPrepared
from dp_core.dra.extended import RequestEnv, request_envs
from dp_core.dra.inputs import AllocatedDevice
from dp_core.dra.metadata import prepared_devices
from dp_core.dra.prepared import PreparedClaim
from dp_core.inventory.edits import DeviceSpec

from core_builders import one, prepare_claim

T4 = "nvidia.com/TU104GL_Tesla_T4"
CLAIM = ClaimRef(
    "vms", "0f1e2d3c-4b5a-6978-8695-a4b3c2d1e0f9", "virt-launcher-a-extended-resources-x1y2z"
)


def prepared(results: list[tuple[str, str]], extended: list[tuple[str, str]]) -> PreparedClaim:
    node, _ = started(config(audio_frontend="dra"))
    allocated = [AllocatedDevice(r, DRIVER, NODE, d) for r, d in results]
    effects = prepare_claim(node, 1, CLAIM, allocated, 1.0, extended_resources=extended)
    return one(effects, ClaimPrepared).prepared


@pytest.mark.parametrize(
    ("results", "extended", "envs"),
    [
        # Two T4s for one request: one variable naming both, in allocation order.
        (
            [
                ("container-0-request-1", "pci-0000-af-00-0"),
                ("container-0-request-1", "pci-0000-3b-00-0"),
            ],
            [("container-0-request-1", T4)],
            [
                RequestEnv(
                    "container-0-request-1",
                    ("PCI_RESOURCE_NVIDIA_COM_TU104GL_TESLA_T4=0000:af:00.0,0000:3b:00.0",),
                )
            ],
        ),
        # An mdev: KubeVirt's MDEV_ variable, the UUID.
        (
            [("container-0-request-0", f"mdev-{VGPU_UUID}")],
            [("container-0-request-0", "nvidia.com/GRID_T4-1Q")],
            [
                RequestEnv(
                    "container-0-request-0",
                    (f"MDEV_PCI_RESOURCE_NVIDIA_COM_GRID_T4-1Q={VGPU_UUID}",),
                )
            ],
        ),
        # The name is the one the pod asked for (an operator's class may name
        # dp's T4s otherwise), folded as KubeVirt folds it.
        (
            [("container-1-request-0", "pci-0000-3b-00-0")],
            [("container-1-request-0", "example.com/gpu.big")],
            [
                RequestEnv(
                    "container-1-request-0", ("PCI_RESOURCE_EXAMPLE_COM_GPU_BIG=0000:3b:00.0",)
                )
            ],
        ),
        # A request without a mapping gets no variable; an ordinary claim none at all.
        ([("gpu", "pci-0000-3b-00-0")], [], []),
    ],
)
def test_request_envs(
    results: list[tuple[str, str]], extended: list[tuple[str, str]], envs: list[RequestEnv]
) -> None:
    assert list(request_envs(prepared(results, extended))) == envs


def test_each_device_of_a_request_lists_the_requests_variable_device() -> None:
    claim = prepared(
        [
            ("container-0-request-0", "pci-0000-3b-00-0"),
            ("container-1-request-0", "pci-0000-af-00-0"),
        ],
        [("container-0-request-0", T4), ("container-1-request-0", T4)],
    )
    answer = prepared_devices(DRIVER, claim)
    uid = CLAIM.uid
    assert [d.cdi_device_ids for d in answer] == [
        (
            f"{DRIVER}/claim={uid}-pci-0000-3b-00-0",
            f"{DRIVER}/metadata={uid}_container-0-request-0",
            claim_request_device_id(DRIVER, uid, "container-0-request-0"),
        ),
        (
            f"{DRIVER}/claim={uid}-pci-0000-af-00-0",
            f"{DRIVER}/metadata={uid}_container-1-request-0",
            claim_request_device_id(DRIVER, uid, "container-1-request-0"),
        ),
    ]
    assert claim_request_device_id(DRIVER, uid, "container-0-request-0") == (
        f"{DRIVER}/claim={uid}_container-0-request-0"
    )


def test_the_claim_spec_holds_a_variables_device_per_request() -> None:
    node_spec = DeviceSpec("/dev/vfio/10", "/dev/vfio/10", "mrw")
    spec = claim_spec(
        DRIVER,
        "u",
        [("pci-0000-3b-00-0", (node_spec,)), ("nothing", ())],
        [("container-0-request-0", ("PCI_RESOURCE_A=1",)), ("empty", ())],
    )
    assert spec is not None
    assert [(d.name, d.device_nodes, d.env) for d in spec.devices] == [
        ("u-pci-0000-3b-00-0", (node_spec,), ()),
        ("u_container-0-request-0", (), ("PCI_RESOURCE_A=1",)),
    ]
    assert claim_spec(DRIVER, "u", [], [("r", ())]) is None


def test_a_request_mapped_to_two_resources_is_refused_at_construction() -> None:
    with pytest.raises(ValueError, match="request 'r' is mapped to two extended resources"):
        PreparedClaim(CLAIM, (), None, [("r", "a.com/x"), ("r", "a.com/y")])
    # The same mapping twice (init containers sharing a request) is one.
    assert PreparedClaim(CLAIM, (), None, [("r", "a.com/x")] * 2).extended_resources == (
        ("r", "a.com/x"),
    )
