"""What both gRPC front ends (the device plugin and DRA) share: reading a
call's request, and protobuf read strictly where a garbled message would do
harm."""

from dp_server.rpc.protobuf import StrictCodec, WireError, check_message, fields
from dp_server.rpc.requests import read_request

__all__ = ["StrictCodec", "WireError", "check_message", "fields", "read_request"]
