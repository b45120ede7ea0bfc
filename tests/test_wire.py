"""The hand-written ListAndWatch encoder against betterproto2 and Google's protobuf."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from dp_core import AdvertisedDevice
from dp_server import wire
from dp_server.emulator._rpc import dp
from dp_server.proto import v1beta1 as pb


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
    message = wire.options_message(__import__("dp_core").PluginOptions(False, True))
    assert codec.encode(message, type(message)) == bytes(message)
