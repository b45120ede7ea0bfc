"""What both gRPC front ends (the device plugin and DRA) share: the server
of every socket (a method it does not serve is a well-formed UNIMPLEMENTED),
reading a call's request, a stream's latest message, and protobuf read
strictly where a garbled message would do harm."""

from dp_server.rpc.protobuf import StrictCodec, WireError, check_message, fields
from dp_server.rpc.requests import read_request
from dp_server.rpc.server import GrpcServer
from dp_server.rpc.streams import StreamSlot

__all__ = [
    "GrpcServer",
    "StrictCodec",
    "StreamSlot",
    "WireError",
    "check_message",
    "fields",
    "read_request",
]
