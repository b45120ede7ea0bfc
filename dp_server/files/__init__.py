"""Files dp keeps: written whole or not at all, and read back strictly."""

from dp_server.files.atomic import sync_directory, write_atomically
from dp_server.files.records import RecordsFileError, read_records, write_records

__all__ = [
    "RecordsFileError",
    "read_records",
    "sync_directory",
    "write_atomically",
    "write_records",
]
