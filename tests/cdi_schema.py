"""The CDI specification's published JSON schema, as vendored in tests/data/cdi/.

schema.json and defs.json are cncf-tags/container-device-interface's
`schema/` at commit 05ae4b5 (spec version 1.1.0); docs/operations.md names
them. schema.json refers to defs.json by its relative name.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT7

__all__ = ["schema_errors"]

_DATA = Path(__file__).parent / "data" / "cdi"


def _validator() -> jsonschema.Draft7Validator:
    schema = json.loads((_DATA / "schema.json").read_text())
    defs = json.loads((_DATA / "defs.json").read_text())
    registry = Registry().with_resource("defs.json", Resource.from_contents(defs, DRAFT7))
    return jsonschema.Draft7Validator(schema, registry=registry)


_VALIDATOR = _validator()


def schema_errors(document: Any) -> list[str]:
    """What the schema finds wrong with `document` (a parsed spec file); [] if nothing."""
    return [
        f"{'/'.join(map(str, error.absolute_path)) or '<spec>'}: {error.message}"
        for error in _VALIDATOR.iter_errors(document)
    ]
