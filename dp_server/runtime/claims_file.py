"""The DRA front end's checkpoint: the prepared claims, kept in the state directory.

The core reports every change as `ClaimsChanged`; the file holds the last one,
and a restarted dp hands it back as `ClaimsRecalled` before it serves the DRA
sockets. Without it, a restarted dp would not know which IOMMU groups its
claims hold, and an Unprepare for a claim deleted from the API meanwhile
could not be told apart from one it never prepared.

The file is JSON, written whole to a temporary file and renamed over the old
one, so a crash leaves the old file or the new one, never half of either.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import cattrs

from dp_core import ClaimsRecalled, PreparedClaim
from dp_core.dra_metadata import attribute_json
from dp_core.dra_names import Attributes
from dp_core.slices import AttributeValue, Version
from dp_server.config.hooks import register_strict_scalars
from dp_server.files import RecordsFileError, read_records, write_records

__all__ = ["CLAIMS_FILE", "ClaimsFileError", "ClaimsStore", "read_claims", "write_claims"]

CLAIMS_FILE = "claims.json"
_VERSION = 1

_log = logging.getLogger("dp.runtime")
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


class ClaimsStore:
    """The checkpoint of a state directory."""

    def __init__(self, state_dir: str) -> None:
        self.path = Path(state_dir) / CLAIMS_FILE
        self.failures = 0  # writes that failed, since start

    def recall(self) -> tuple[PreparedClaim, ...]:
        """The claims kept last; none if the file is missing or unreadable (logged)."""
        try:
            return read_claims(self.path)
        except ClaimsFileError as error:
            # Nothing held is made up: the kubelet prepares its claims again.
            _log.error("claims-unreadable", extra={"dp_fields": {"reason": str(error)}})
            return ()

    def keep(self, prepared: tuple[PreparedClaim, ...]) -> None:
        try:
            write_claims(self.path, prepared)
        except OSError as error:
            self.failures += 1
            reason = f"{self.path}: {error.strerror or error}"
            _log.error(
                "claims-unwritable",
                extra={
                    "dp_fields": {
                        "reason": reason,
                        "consequence": "a restarted dp would not know these claims",
                    }
                },
            )


def read_claims(path: Path) -> tuple[PreparedClaim, ...]:
    """The claims in `path`; none when there is no such file."""
    try:
        claims = read_records(
            path, PreparedClaim, key="claims", version=_VERSION, converter=_converter
        )
    except RecordsFileError as error:
        raise ClaimsFileError(str(error)) from None
    try:
        ClaimsRecalled(claims)  # what the core will be handed must be valid input
    except ValueError as error:
        raise ClaimsFileError(f"{path}: {error}") from None
    return claims


def write_claims(path: Path, prepared: tuple[PreparedClaim, ...]) -> None:
    """Replace `path` with `prepared`, atomically; raises OSError."""
    write_records(path, prepared, key="claims", version=_VERSION, converter=_converter)
