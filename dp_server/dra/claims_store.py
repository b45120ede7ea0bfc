"""The DRA front end's checkpoint: the prepared claims, kept in the state directory.

The core reports every change as `ClaimsChanged`; the file holds the last one,
and a restarted dp hands it back as `ClaimsRecalled` before it serves the DRA
sockets. Without it, a restarted dp would not know which IOMMU groups its
claims hold, and an Unprepare for a claim deleted from the API meanwhile
could not be told apart from one it never prepared.

The file is JSON, written whole to a temporary file and renamed over the old
one, so a crash leaves the old file or the new one, never half of either
(`files.RecordStore`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import cattrs

from dp_core import ClaimsRecalled, PreparedClaim
from dp_core.dra import Attributes, AttributeValue, Version, attribute_json
from dp_server.files import RecordKind, RecordsFileError, RecordStore, register_strict_scalars

__all__ = ["CLAIMS_FILE", "ClaimsFileError", "ClaimsStore"]

CLAIMS_FILE = "claims.json"
_VERSION = 1

_converter = cattrs.Converter(forbid_extra_keys=True)
register_strict_scalars(_converter)


def _attribute(value: Any) -> AttributeValue:
    # `resource.k8s.io/v1` DeviceAttribute: exactly one of int, bool, string, version.
    if not isinstance(value, dict) or len(value) != 1:
        raise TypeError(f"expected one of int, bool, string, version, got {value!r}")
    ((kind, raw),) = value.items()
    if kind == "int" and type(raw) is int:
        return raw
    if kind == "bool" and type(raw) is bool:
        return raw
    if kind == "string" and type(raw) is str:
        return raw
    if kind == "version" and type(raw) is str:
        return Version(raw)
    raise TypeError(f"{kind}: {raw!r} is not an attribute value")


def _structure_attributes(value: Any, _: Any) -> Attributes:
    if not isinstance(value, dict):
        raise TypeError(f"expected attributes by name, got {value!r}")
    return tuple(sorted((str(name), _attribute(raw)) for name, raw in value.items()))


def _unstructure_attributes(value: Attributes) -> dict[str, object]:
    return {name: attribute_json(raw) for name, raw in value}


_converter.register_structure_hook_func(lambda t: t == Attributes, _structure_attributes)
_converter.register_unstructure_hook_func(lambda t: t == Attributes, _unstructure_attributes)


class ClaimsFileError(RecordsFileError):
    """A checkpoint that cannot be read; the message names the file and what is wrong."""


CLAIMS = RecordKind(
    CLAIMS_FILE,
    PreparedClaim,
    "claims",
    _VERSION,
    _converter,
    check=ClaimsRecalled,
    error=ClaimsFileError,
    consequence="a restarted dp would not know these claims",
)


class ClaimsStore(RecordStore[PreparedClaim]):
    """The checkpoint of a state directory (or at `path`). One that cannot be
    read recalls nothing: nothing held is made up, and the kubelet prepares
    its claims again."""

    def __init__(self, state_dir: str | None = None, *, path: Path | None = None) -> None:
        super().__init__(CLAIMS, state_dir, path=path)
