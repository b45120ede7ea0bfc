"""A state file: one versioned list of records as JSON, through a cattrs converter.

`{"version": N, "<key>": [...]}`, written whole (`atomic.write_atomically`).
A file that is missing holds nothing; one that cannot be read, is not JSON,
is of another version or holds a record the converter refuses raises
`RecordsFileError`, whose message names the file and what is wrong.
`RecordStore` is such a file kept across restarts, for whatever records.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, Generic, TypeVar

import attrs
import cattrs

from dp_server.files.atomic import sync_directory, write_atomically

__all__ = ["RecordKind", "RecordStore", "RecordsFileError", "read_records"]

_log = logging.getLogger("dp.runtime")

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


def _json(value: object) -> str:
    # Compact, so that json's C encoder writes it: the claims checkpoint is
    # written at every Prepare and Unprepare, and its size grows with them.
    return json.dumps(value, separators=(",", ":"))


def _write_document(path: Path, key: str, version: int, records: list[str]) -> None:
    """`{"version": version, key: [records...]}`, each record JSON text already."""
    path.parent.mkdir(parents=True, exist_ok=True)
    head = _json({"version": version, key: []})[:-2]  # `{"version":N,"key":[`
    data = f"{head}{','.join(records)}]}}\n".encode()
    write_atomically(path, data, mode=0o600)
    sync_directory(path.parent)


@attrs.frozen
class RecordKind(Generic[_T]):
    """What one kind of state file holds: its file name in the state directory,
    its records and how they are read (`converter`, then `check`, which raises
    ValueError naming what is wrong), and what a failure to read (`error`) or
    to write (`consequence`) says."""

    file: str
    record: type[_T]
    key: str
    version: int
    converter: cattrs.Converter
    check: Callable[[tuple[_T, ...]], object]
    error: type[RecordsFileError] = RecordsFileError
    consequence: str | None = None


class RecordStore(Generic[_T]):
    """One state file of records, kept across restarts: `recall` at start, `keep`
    at each change (the moves dp made, the DRA claims it prepared).

    A file that cannot be read is logged (`<key>-unreadable`) and recalled as
    none: nothing is made up. One that cannot be written is logged
    (`<key>-unwritable`, with the kind's `consequence`) and counted in
    `failures`; dp goes on. The file is `kind.file` in `state_dir`, or `path`;
    with neither, nothing is kept.
    """

    def __init__(
        self, kind: RecordKind[_T], state_dir: str | None = None, *, path: Path | None = None
    ) -> None:
        self.kind = kind
        self.path = path or (None if state_dir is None else Path(state_dir) / kind.file)
        self.failures = 0  # writes that failed, since start
        # id -> (record, its JSON text) for the records written last: they are
        # frozen, and most of them are in the next write too.
        self._written: dict[int, tuple[_T, str]] = {}

    def read(self) -> tuple[_T, ...]:
        """The records in the file; none when there is none. Raises `error`."""
        kind = self.kind
        if self.path is None:
            return ()
        try:
            records = read_records(
                self.path, kind.record, key=kind.key, version=kind.version, converter=kind.converter
            )
        except RecordsFileError as problem:
            raise kind.error(str(problem)) from None
        try:
            kind.check(records)  # what the core will be handed must be valid input
        except ValueError as problem:
            raise kind.error(f"{self.path}: {problem}") from None
        return records

    def write(self, records: tuple[_T, ...]) -> None:
        """Replace the file with `records`, atomically; raises OSError."""
        if self.path is not None:
            kind = self.kind
            _write_document(self.path, kind.key, kind.version, self._encode(records))

    def _encode(self, records: tuple[_T, ...]) -> list[str]:
        """Each record's JSON text; a record written last time is not encoded again."""
        known = self._written
        written: dict[int, tuple[_T, str]] = {}
        unstructure = self.kind.converter.unstructure
        for record in records:
            entry = known.get(id(record))
            if entry is None or entry[0] is not record:
                entry = (record, _json(unstructure(record)))
            written[id(record)] = entry
        self._written = written
        return [written[id(record)][1] for record in records]

    def recall(self) -> tuple[_T, ...]:
        """The records kept last; none if the file is missing or unreadable (logged)."""
        try:
            return self.read()
        except RecordsFileError as problem:
            _log.error(f"{self.kind.key}-unreadable", extra={"dp_fields": {"reason": str(problem)}})
            return ()

    def keep(self, records: tuple[_T, ...]) -> None:
        try:
            self.write(records)
        except OSError as problem:
            self.failures += 1
            fields: dict[str, object] = {"reason": f"{self.path}: {problem.strerror or problem}"}
            if self.kind.consequence is not None:
                fields["consequence"] = self.kind.consequence
            _log.error(f"{self.kind.key}-unwritable", extra={"dp_fields": fields})
