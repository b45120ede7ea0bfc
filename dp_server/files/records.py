"""A state file: one versioned list of records as JSON, through a cattrs converter.

`{"version": N, "<key>": [...]}`, written whole (`atomic.write_atomically`).
A file that is missing holds nothing; one that cannot be read, is not JSON,
is of another version or holds a record the converter refuses raises
`RecordsFileError`, whose message names the file and what is wrong.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, TypeVar

import cattrs

from dp_server.files.atomic import sync_directory, write_atomically

__all__ = ["RecordsFileError", "read_records", "write_records"]

_T = TypeVar("_T")


class RecordsFileError(ValueError):
    """A state file that cannot be read; the message names the file and what is wrong."""


def read_records(
    path: Path, record: type[_T], *, key: str, version: int, converter: cattrs.Converter
) -> tuple[_T, ...]:
    """The records under `key` in `path`; none when there is no such file."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return ()
    except (OSError, UnicodeDecodeError) as error:
        raise RecordsFileError(f"{path}: cannot read: {error}") from None
    try:
        document: Any = json.loads(text)
    except json.JSONDecodeError as error:
        raise RecordsFileError(f"{path}: not JSON: {error}") from None
    if (
        not isinstance(document, dict)
        or type(document.get("version")) is not int
        or document["version"] != version
        or not isinstance(document.get(key), list)
    ):
        raise RecordsFileError(f"{path}: not a version {version} {key} file")
    try:
        records: tuple[_T, ...] = converter.structure(document[key], tuple[record, ...])  # type: ignore[valid-type]
    except Exception as error:  # noqa: BLE001 - cattrs wraps what the hooks raise
        detail = (
            "; ".join(cattrs.transform_error(error))
            if isinstance(error, cattrs.BaseValidationError | cattrs.ClassValidationError)
            else str(error)
        )
        raise RecordsFileError(f"{path}: {detail}") from None
    return records


def write_records(
    path: Path, records: tuple[Any, ...], *, key: str, version: int, converter: cattrs.Converter
) -> None:
    """Replace `path` with `records`, atomically; raises OSError."""
    document = {"version": version, key: converter.unstructure(records)}
    path.parent.mkdir(parents=True, exist_ok=True)
    # Compact, so that json's C encoder writes it: the claims checkpoint is
    # written at every Prepare and Unprepare, and its size grows with them.
    data = json.dumps(document, separators=(",", ":")).encode() + b"\n"
    write_atomically(path, data, mode=0o600)
    sync_directory(path.parent)
