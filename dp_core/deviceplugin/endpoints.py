"""The socket file names the device-plugin front end listens on.

The kubelet joins its device-plugin directory and the endpoint a `Register`
names into one unix socket path, so a name must fit what is left of it.
"""

from __future__ import annotations

import binascii
import re

from ..errors import UsageError

__all__ = ["NAME_MAX", "check_endpoint_room", "endpoint_name", "min_endpoint_length"]

# The kubelet joins its directory and the endpoint into one unix socket path,
# which Linux limits to 107 bytes: long resource names must be cut.
NAME_MAX = 255
_DIGEST_LENGTH = 8


def endpoint_name(prefix: str, resource: str | None, max_length: int = NAME_MAX) -> str:
    """Socket file name: `<prefix>.sock`, or `<prefix>-<resource>.sock` per resource.

    A per-resource name longer than `max_length` keeps the start of the
    resource name and ends in a checksum of all of it, so that names stay
    distinct; `min_endpoint_length` is the least `max_length` that works.
    """
    if resource is None:
        return f"{prefix}.sock"
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", resource)
    name = f"{prefix}-{safe}.sock"
    if len(name) <= max_length:
        return name
    check_endpoint_room(prefix, max_length)
    # CRC-32, not hashlib (which loads OpenSSL, 4 MB of the server's 35 MB), and
    # binascii's rather than zlib's: the same checksum, from a module the server
    # has loaded anyway.
    digest = f"{binascii.crc32(resource.encode()):08x}"
    room = max_length - min_endpoint_length(prefix) - 1  # the dash before the digest
    return f"{prefix}-{safe[:room]}-{digest}.sock" if room > 0 else f"{prefix}-{digest}.sock"


def min_endpoint_length(prefix: str) -> int:
    """The shortest name limit `endpoint_name` can meet for every resource."""
    return len(f"{prefix}-.sock") + _DIGEST_LENGTH


def check_endpoint_room(prefix: str, max_length: int) -> None:
    if max_length < min_endpoint_length(prefix):
        raise UsageError(
            f"socket names of at most {max_length} characters are too short for prefix "
            f"{prefix!r} (at least {min_endpoint_length(prefix)})"
        )
