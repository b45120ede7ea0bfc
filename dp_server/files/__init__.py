"""Files dp keeps: written whole or not at all, and read back strictly (one
store for every state file); and the Unix socket files it listens on."""

from dp_server.files.atomic import sync_directory, write_atomically
from dp_server.files.codec import FieldError, register_strict_scalars, show
from dp_server.files.records import (
    RecordKind,
    RecordsFileError,
    RecordStore,
    read_records,
)
from dp_server.files.sockets import SOCKET_PATH_MAX, listened_on, socket_identity

__all__ = [
    "SOCKET_PATH_MAX",
    "FieldError",
    "RecordKind",
    "RecordStore",
    "RecordsFileError",
    "listened_on",
    "read_records",
    "register_strict_scalars",
    "show",
    "socket_identity",
    "sync_directory",
    "write_atomically",
]
