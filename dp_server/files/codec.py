"""Values read strictly: strings, integers and booleans only as written.

What an operator writes (the config file) and what an earlier run of dp wrote
(the moves and claims files) is read through cattrs converters that take no
3 for "3" and no true for 1; each wrong value raises `FieldError`, whose
message shows the value as it was written (`show`).
"""

from __future__ import annotations

import cattrs

__all__ = ["FieldError", "register_strict_scalars", "show", "structure_str"]


class FieldError(ValueError):
    """A value of the wrong shape, found while structuring."""


def show(value: object) -> str:
    """A value as the operator wrote it, short enough for one line."""
    if value is None:
        text = "null"
    elif isinstance(value, bool):
        text = "true" if value else "false"
    else:
        text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def structure_str(value: object, _type: object) -> str:
    """A string, as written."""
    if not isinstance(value, str):
        raise FieldError(f"{show(value)} is not a string")
    return value


def _structure_int(value: object, _type: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise FieldError(f"{show(value)} is not an integer")
    return value


def _structure_bool(value: object, _type: object) -> bool:
    if not isinstance(value, bool):
        raise FieldError(f"{show(value)} is not a boolean (true or false)")
    return value


def register_strict_scalars(converter: cattrs.Converter) -> None:
    """Take strings, integers and booleans only as written: no 3 for "3", no true for 1."""
    converter.register_structure_hook(str, structure_str)
    converter.register_structure_hook(int, _structure_int)
    converter.register_structure_hook(bool, _structure_bool)
