"""The hand-written protobuf on the hot paths against betterproto2 and Google's protobuf."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dp_core import AdvertisedDevice, AllocateAnswer, ContainerAllocation, DeviceSpec
from dp_server.deviceplugin import wire
from dp_server.proto import v1beta1 as pb
from dp_testing.emulator._rpc import dp


def betterproto2_device_list(devices: list[AdvertisedDevice]) -> bytes:
    """The same message built with the generated classes: the reference encoding."""
    return bytes(
        pb.ListAndWatchResponse(
            devices=[
                pb.Device(
                    id=device.id,
                    health=device.health,
                    topology=(
                        pb.TopologyInfo(nodes=[pb.NumaNode(id=device.numa_node)])
                        if device.numa_node is not None
                        else None
                    ),
                )
                for device in devices
            ]
        )
    )


devices = st.builds(
    AdvertisedDevice,
    id=st.text(min_size=0, max_size=80),
    healthy=st.booleans(),
    numa_node=st.none() | st.integers(min_value=-(2**63), max_value=2**63 - 1),
)


@given(st.lists(devices, max_size=40))
def test_hand_encoding_equals_betterproto2(advertised: list[AdvertisedDevice]) -> None:
    assert wire.encoded_device_list(advertised) == betterproto2_device_list(advertised)


@given(st.lists(devices, max_size=40))
def test_google_protobuf_reads_what_we_write(advertised: list[AdvertisedDevice]) -> None:
    decoded = dp.ListAndWatchResponse.FromString(wire.encoded_device_list(advertised))
    assert [d.ID for d in decoded.devices] == [d.id for d in advertised]
    assert [d.health for d in decoded.devices] == [d.health for d in advertised]
    for message, device in zip(decoded.devices, advertised, strict=True):
        if device.numa_node is None:
            assert not message.HasField("topology")
        else:
            assert [n.ID for n in message.topology.nodes] == [device.numa_node]


def test_pre_encoded_codec_passes_bytes_and_encodes_messages() -> None:
    codec = wire.PreEncodedCodec()
    assert codec.encode(b"\x0a\x00", object) == b"\x0a\x00"
    message = pb.DevicePluginOptions(pre_start_required=True)
    assert codec.encode(message, type(message)) == bytes(message)
    assert codec.decode(b"\x08\x01", wire.Raw) == b"\x08\x01"
    assert codec.decode(b"\x08\x01", pb.DevicePluginOptions) == message


text = st.text(max_size=40)
pairs = st.lists(st.tuples(text, text), max_size=4, unique_by=lambda pair: pair[0]).map(tuple)
answers = st.builds(
    AllocateAnswer,
    containers=st.lists(
        st.builds(
            ContainerAllocation,
            envs=pairs,
            devices=st.lists(st.builds(DeviceSpec, text, text, text), max_size=4).map(tuple),
            mounts=st.lists(st.tuples(text, text, st.booleans()), max_size=3).map(tuple),
            annotations=pairs,
        ),
        max_size=3,
    ).map(tuple),
)


@given(answers)
def test_google_protobuf_reads_our_allocate_response(answer: AllocateAnswer) -> None:
    decoded = dp.AllocateResponse.FromString(wire.allocate_response(answer))
    assert len(decoded.container_responses) == len(answer.containers)
    for message, container in zip(decoded.container_responses, answer.containers, strict=True):
        assert dict(message.envs) == dict(container.envs)
        assert dict(message.annotations) == dict(container.annotations)
        assert [(m.container_path, m.host_path, m.read_only) for m in message.mounts] == list(
            container.mounts
        )
        assert [(d.container_path, d.host_path, d.permissions) for d in message.devices] == [
            (s.container_path, s.host_path, s.permissions) for s in container.devices
        ]


@given(answers)
def test_allocate_response_matches_betterproto2_semantically(answer: AllocateAnswer) -> None:
    decoded = pb.AllocateResponse.parse(wire.allocate_response(answer))
    assert [dict(c.envs) for c in decoded.container_responses] == [
        dict(c.envs) for c in answer.containers
    ]
    assert [len(c.devices) for c in decoded.container_responses] == [
        len(c.devices) for c in answer.containers
    ]


id_lists = st.lists(st.lists(st.text(max_size=30), max_size=5), max_size=4)


@given(id_lists, st.binary(max_size=8))
def test_allocate_request_reads_google_protobuf(containers: list[list[str]], junk: bytes) -> None:
    request = dp.AllocateRequest(
        container_requests=[dp.ContainerAllocateRequest(devices_ids=ids) for ids in containers]
    )
    data = request.SerializeToString()
    assert wire.allocate_request(data) == tuple(tuple(ids) for ids in containers)
    # Fields this server does not know (a newer kubelet's) are skipped, wherever they are.
    unknown = b"\x10\x96\x01" + b"\x1a" + bytes([len(junk)]) + junk + b"\x25\x00\x00\x00\x00"
    assert wire.allocate_request(unknown + data + unknown) == wire.allocate_request(data)


@pytest.mark.parametrize(
    ("data", "problem"),
    [
        (b"\x0a", "truncated varint"),
        (b"\x0a\x05\x0a\x01", "runs past the end"),
        (b"\x0a\x03\x0a\x01\xff", "not valid UTF-8"),
        (b"\x08\x01", "container_requests: expected a length-delimited field"),
        (b"\x0b", "unsupported wire type 3"),
        (b"\x10" + b"\xff" * 11, "longer than 10 bytes"),
        (b"\x15\x00", "runs past the end"),
    ],
)
def test_malformed_allocate_request_names_the_problem(data: bytes, problem: str) -> None:
    with pytest.raises(wire.WireError, match=problem):
        wire.allocate_request(data)


def _pod_resources_answer(*pods: list[list[tuple[str, list[str]]]]) -> bytes:
    from dp_server.proto import v1 as podresources

    return bytes(
        podresources.ListPodResourcesResponse(
            pod_resources=[
                podresources.PodResources(
                    name=f"pod-{i}",
                    namespace="default",
                    containers=[
                        podresources.ContainerResources(
                            name="compute",
                            devices=[
                                podresources.ContainerDevices(
                                    resource_name=resource,
                                    device_ids=ids,
                                    topology=podresources.TopologyInfo(
                                        nodes=[podresources.NumaNode(id=1)]
                                    ),
                                )
                                for resource, ids in container
                            ],
                            cpu_ids=[2, 3],
                        )
                        for container in containers
                    ],
                )
                for i, containers in enumerate(pods)
            ]
        )
    )


def test_held_devices_merges_every_container_of_every_pod() -> None:
    answer = _pod_resources_answer(
        [[("gpu", ["a"]), ("qat", ["q1"])]],
        [[("gpu", ["b", "a"])], []],
    )
    assert wire.held_devices(answer) == {
        "gpu": frozenset({"a", "b"}),
        "qat": frozenset({"q1"}),
    }
    assert wire.held_devices(b"") == {}


@pytest.mark.parametrize(
    ("mangle", "complaint"),
    [
        (lambda good: good[:-3], "runs past the end"),
        (lambda good: b"\xff\xfe\xfd\x00\x01", "unsupported wire type"),
        (lambda good: good + b"\x08\x01", "pod_resources: expected a length-delimited field"),
        (lambda good: b"\x0a\x02\x18\x00", "containers: expected a length-delimited"),
        (lambda good: b"\x0a\x07\x1a\x05\x12\x03\x0a\x01\xff", "resource_name: not valid UTF-8"),
    ],
    ids=["truncated", "garbage", "pod as a number", "container as a number", "bad UTF-8"],
)
def test_held_devices_refuses_a_malformed_answer(
    mangle: Callable[[bytes], bytes], complaint: str
) -> None:
    # Read loosely, each of these would say "nothing is held" or name devices
    # nobody holds, and end IOMMU group reservations of running VMs.
    good = _pod_resources_answer([[("gpu", ["0000:3b:00.0"])]])
    with pytest.raises(wire.WireError, match=complaint):
        wire.held_devices(mangle(good))
