"""The YAML shape of the config: keys, strict value checks, structuring and dumping.

`config_file` parses documents and reports problems; this module maps the YAML
shape (camelCase keys, as in KubeVirt's CR) onto the core's classes and back.
Structuring never stops at the first problem: `Invalid` carries every one,
each with its path below the value structured, and whether it is a rule
across fields (raised by a class once each of its fields was valid).

It is written by hand rather than with a general converter: the shape is six
small classes, and the server imports this module at every start.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

import attrs

from dp_core.config import (
    DEFAULT_SHARED_DEVICES,
    Config,
    MediatedDevice,
    Naming,
    PciHostDevice,
    PermittedHostDevices,
    SharedDevice,
)
from dp_core.names import resource_name_error
from dp_core.pci import PciId

__all__ = [
    "IGNORED_KEYS",
    "KEYS",
    "ConfigConverter",
    "FieldError",
    "Invalid",
    "Problem",
    "Segment",
    "config_converter",
    "kind_of",
    "path_segment",
    "show",
]

T = TypeVar("T")
Segment = str | int
# (path below the value structured, message, is the rule across fields)
Problem = tuple[tuple[Segment, ...], str, bool]


# --- YAML keys --------------------------------------------------------------------

# YAML key of each attribute, per class, in attribute order. The same table
# drives structuring, dumping and the field paths in error messages.
KEYS: dict[type, dict[str, str]] = {
    PciHostDevice: {
        "pci_vendor_selector": "pciVendorSelector",
        "resource_name": "resourceName",
        "external_resource_provider": "externalResourceProvider",
    },
    MediatedDevice: {
        "mdev_name_selector": "mdevNameSelector",
        "resource_name": "resourceName",
        "external_resource_provider": "externalResourceProvider",
    },
    PermittedHostDevices: {
        "pci_host_devices": "pciHostDevices",
        "mediated_devices": "mediatedDevices",
    },
    Naming: {"source": "source", "domain": "domain", "pci_ids_path": "pciIdsPath"},
    Config: {
        "permitted_host_devices": "permittedHostDevices",
        "shared_devices": "sharedDevices",
        "naming": "naming",
    },
    SharedDevice: {
        "path": "path",
        "count": "count",
        "permissions": "permissions",
        "enabled": "enabled",
    },
}

# Keys accepted (for KubeVirt compatibility) but not structured.
IGNORED_KEYS: dict[type, tuple[str, ...]] = {PermittedHostDevices: ("usb",)}


# --- values in messages ------------------------------------------------------------------


class FieldError(ValueError):
    """A value of the wrong shape."""


class Invalid(Exception):
    """Every problem found in one value."""

    def __init__(self, problems: list[Problem]) -> None:
        super().__init__(problems)
        self.problems = problems


def show(value: object) -> str:
    """A value as the operator wrote it, short enough for one line."""
    if value is None:
        text = "null"
    elif isinstance(value, bool):
        text = "true" if value else "false"
    else:
        text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def kind_of(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, list | tuple):
        return "a list"
    return type(value).__name__


def path_segment(key: object) -> Segment:
    """A mapping key as a path segment (ints are list indices, so show other keys)."""
    return key if isinstance(key, str) else show(key)


def unknown_key(key: object, allowed: Iterable[str]) -> str:
    import difflib  # only a broken config needs it; the server keeps it out of memory

    choices = sorted(allowed)
    close = difflib.get_close_matches(str(key), choices, n=1)
    if close:
        return f"unknown key {show(key)} (did you mean {close[0]!r}?)"
    return f"unknown key {show(key)}; expected one of: {', '.join(choices)}"


def _problem(exc: Exception, path: tuple[Segment, ...] = ()) -> list[Problem]:
    """What a hook raised, as problems at `path`."""
    if isinstance(exc, Invalid):
        return [((*path, *where), message, cross) for where, message, cross in exc.problems]
    if isinstance(exc, ValueError | TypeError):
        return [(path, str(exc), False)]
    return [(path, f"unexpected error: {exc!r}", False)]


# --- strict values -------------------------------------------------------------------------

Hook = Callable[[object], Any]


def _str(value: object) -> str:
    if not isinstance(value, str):
        raise FieldError(f"{show(value)} is not a string")
    return value


def _int(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise FieldError(f"{show(value)} is not an integer")
    return value


def _bool(value: object) -> bool:
    if not isinstance(value, bool):
        raise FieldError(f"{show(value)} is not a boolean (true or false)")
    return value


def _pci_id(value: object) -> PciId:
    if not isinstance(value, str):
        raise FieldError(f"{show(value)} is not VVVV:DDDD hex (write it as a quoted string)")
    return PciId.parse(value)


def _optional(hook: Hook) -> Hook:
    def structure(value: object) -> Any:
        return None if value is None else hook(value)

    return structure


def _tuple_of(hook: Hook) -> Hook:
    def structure(value: object) -> tuple[Any, ...]:
        if value is None:
            return ()
        if not isinstance(value, list | tuple):
            raise FieldError(f"expected a list, got {kind_of(value)}: {show(value)}")
        items: list[Any] = []
        problems: list[Problem] = []
        for index, element in enumerate(value):
            try:
                items.append(hook(element))
            except Exception as exc:
                problems += _problem(exc, (index,))
        if problems:
            raise Invalid(problems)
        return tuple(items)

    return structure


def _mapping(value: object) -> Mapping[Any, Any]:
    if value is None:
        return {}  # `naming:` with nothing under it means the defaults
    if not isinstance(value, Mapping):
        raise FieldError(f"expected a mapping, got {kind_of(value)}: {show(value)}")
    return value


def _structure_fields(
    cls: type[Any], value: Mapping[Any, Any], hooks: Mapping[str, Hook]
) -> tuple[dict[str, Any], list[Problem]]:
    """Each attribute of `cls` that `value` gives, and every problem, unknown keys last.

    An attribute's own validator runs as soon as it is structured, so every
    bad field is reported with its path, not only the first one `__init__`
    would stop at.
    """
    keys = KEYS[cls]
    values: dict[str, Any] = {}
    problems: list[Problem] = []
    for field in attrs.fields(cls):
        key = keys[field.name]
        if key not in value:
            if field.default is attrs.NOTHING:
                problems.append(((key,), "is required", False))
            continue
        try:
            result = hooks[field.name](value[key])
            _validate(field, result)
        except Exception as exc:
            problems += _problem(exc, (key,))
        else:
            values[field.name] = result
    allowed = [*keys.values(), *IGNORED_KEYS.get(cls, ())]
    for extra in sorted((key for key in value if key not in allowed), key=str):
        problems.append(((path_segment(extra),), unknown_key(extra, allowed), False))
    return values, problems


def _validate(field: attrs.Attribute[Any], value: object) -> None:
    if field.validator is None:
        return
    try:
        field.validator(None, field, value)
    except ValueError:
        raise
    except Exception:
        # A validator that needs the real instance: it runs again in __init__,
        # and what it raises there is reported.
        pass


def _class(cls: type[T], hooks: Mapping[str, Hook]) -> Callable[[object], T]:
    def structure(value: object) -> T:
        values, problems = _structure_fields(cls, _mapping(value), hooks)
        if problems:
            raise Invalid(problems)
        try:
            return cls(**values)
        except ValueError as exc:
            # Raised by the class once every field was valid: a rule across
            # fields, such as a selector listed twice.
            raise Invalid([((), str(exc), not isinstance(exc, FieldError))]) from None
        except Exception as exc:
            raise Invalid(_problem(exc)) from None

    return structure


# --- shared devices ------------------------------------------------------------------------


@attrs.frozen
class _SharedDevicePatch:
    """One `sharedDevices` entry as written: every field optional, merged over a default."""

    path: str | None = None
    count: int | None = None
    permissions: str | None = None
    enabled: bool | None = None


KEYS[_SharedDevicePatch] = dict(KEYS[SharedDevice])
_SHARED_FIELDS = tuple(KEYS[_SharedDevicePatch])
_SHARED_DEFAULTS = {
    name: attrs.fields_dict(SharedDevice)[name].default
    for name in ("count", "permissions", "enabled")
}
_PATCH_HOOKS: dict[str, Hook] = {
    "path": _optional(_str),
    "count": _optional(_int),
    "permissions": _optional(_str),
    "enabled": _optional(_bool),
}


def _shared_devices(value: object) -> tuple[SharedDevice, ...]:
    """`sharedDevices`, a mapping of resource name to fields, merged over the defaults.

    The result is sorted by resource name.
    """
    if value is None:
        return DEFAULT_SHARED_DEVICES
    if not isinstance(value, Mapping):
        raise FieldError(
            f"expected a mapping of resource name to device, got {kind_of(value)}: {show(value)}"
        )
    merged = {device.resource_name: device for device in DEFAULT_SHARED_DEVICES}
    problems: list[Problem] = []
    for key, raw in value.items():
        try:
            merged[key] = _shared_device(key, raw, merged.get(key))
        except Exception as exc:
            problems += _problem(exc, (path_segment(key),))
    if problems:
        raise Invalid(problems)
    # One canonical order, so that a dump whose keys YAML sorted reads back equal.
    # The defaults (kvm, tun, vhost-net) are already in this order.
    return tuple(sorted(merged.values(), key=lambda device: device.resource_name))


def _shared_device(key: object, raw: object, base: SharedDevice | None) -> SharedDevice:
    if not isinstance(key, str):
        raise FieldError(f"{show(key)} is not a resource name (a string)")
    problems: list[Problem] = []
    name_error = resource_name_error(key)
    if name_error is not None:
        problems.append(((), name_error, False))
    try:
        given, patch_problems = _structure_fields(_SharedDevicePatch, _mapping(raw), _PATCH_HOOKS)
    except Exception as exc:
        problems += _problem(exc)
    else:
        problems += patch_problems
        if not patch_problems:
            values: dict[str, Any] = {}
            for name in _SHARED_FIELDS:
                if given.get(name) is not None:
                    values[name] = given[name]
                elif base is not None:
                    values[name] = getattr(base, name)
                elif name in _SHARED_DEFAULTS:
                    values[name] = _SHARED_DEFAULTS[name]
            if "path" not in values:
                defaults = ", ".join(d.resource_name for d in DEFAULT_SHARED_DEVICES)
                message = f"is required for a new shared device (only {defaults} have defaults)"
                problems.append((("path",), message, False))
            fields = attrs.fields_dict(SharedDevice)
            for name, field_value in values.items():
                validator = fields[name].validator
                if validator is None:
                    continue
                try:
                    validator(None, fields[name], field_value)
                except ValueError as exc:
                    problems.append(((KEYS[SharedDevice][name],), str(exc), False))
            if not problems:
                return SharedDevice(resource_name=key, **values)
    raise Invalid(problems)


# --- the classes ---------------------------------------------------------------------------

_pci_host_device = _class(
    PciHostDevice,
    {
        "pci_vendor_selector": _pci_id,
        "resource_name": _optional(_str),
        "external_resource_provider": _bool,
    },
)
_mediated_device = _class(
    MediatedDevice,
    {
        "mdev_name_selector": _str,
        "resource_name": _optional(_str),
        "external_resource_provider": _bool,
    },
)
_permitted_host_devices = _class(
    PermittedHostDevices,
    {
        "pci_host_devices": _tuple_of(_pci_host_device),
        "mediated_devices": _tuple_of(_mediated_device),
    },
)
_naming = _class(Naming, {"source": _str, "domain": _str, "pci_ids_path": _optional(_str)})
_config = _class(
    Config,
    {
        "permitted_host_devices": _optional(_permitted_host_devices),
        "shared_devices": _shared_devices,
        "naming": _naming,
    },
)
_HOOKS: dict[Any, Hook] = {
    PciHostDevice: _pci_host_device,
    MediatedDevice: _mediated_device,
    PermittedHostDevices: _permitted_host_devices,
    PermittedHostDevices | None: _optional(_permitted_host_devices),
    Naming: _naming,
    Config: _config,
    PciId: _pci_id,
}


def _dump(value: object) -> Any:
    if isinstance(value, PciId):
        return str(value).upper()
    if isinstance(value, tuple):
        return [_dump(item) for item in value]
    if type(value) is Config:
        document: dict[str, Any] = {}
        if value.permitted_host_devices is not None:
            document["permittedHostDevices"] = _dump(value.permitted_host_devices)
        document["sharedDevices"] = {
            device.resource_name: {name: getattr(device, name) for name in _SHARED_FIELDS}
            for device in value.shared_devices
        }
        document["naming"] = _dump(value.naming)
        return document
    if type(value) in KEYS:
        return _dump_fields(value)
    return value


def _dump_fields(value: Any) -> dict[str, Any]:
    keys = KEYS[type(value)]
    document: dict[str, Any] = {}
    for field in attrs.fields(type(value)):
        item = getattr(value, field.name)
        # None means "not given" everywhere in the YAML shape; leave it out.
        if field.default is None and item is None:
            continue
        document[keys[field.name]] = _dump(item)
    return document


class ConfigConverter:
    """Structures the YAML shape into the core's config classes, and back."""

    def structure(self, value: object, type_: Any) -> Any:
        """`value` as `type_` (a config class, `PciId`), or `Invalid` with every problem."""
        try:
            return _HOOKS[type_](value)
        except Invalid:
            raise
        except Exception as exc:
            raise Invalid(_problem(exc)) from None

    def unstructure(self, value: object, type_: object = None) -> Any:
        """The YAML shape of a config object: camelCase keys, lists, `VVVV:DDDD`."""
        return _dump(value)


config_converter = ConfigConverter()
