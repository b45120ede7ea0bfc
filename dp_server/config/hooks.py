"""The cattrs side of the config file: YAML keys, strict hooks and the converter.

`config_file` parses documents and reports problems; this module maps the YAML
shape (camelCase keys, as in KubeVirt's CR) onto the core's classes. Each hook
raises `FieldError` for a value of the wrong shape, and cattrs collects every
one with its place, which `config_file` turns into lines.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal, TypeVar, get_args, get_origin

import attrs
import cattrs
from cattrs.errors import (
    AttributeValidationNote,
    ClassValidationError,
    IterableValidationError,
    IterableValidationNote,
)
from cattrs.gen import make_dict_structure_fn, make_dict_unstructure_fn, override

from dp_core.config import (
    DEFAULT_SHARED_DEVICES,
    Binding,
    Config,
    Dra,
    DraFeatureSetting,
    MediatedDevice,
    Naming,
    PciHostDevice,
    PermittedHostDevices,
    SharedDevice,
    Vfio,
    resource_name_error,
)
from dp_core.host import PciId
from dp_server.files.codec import FieldError, register_strict_scalars, show, structure_str

__all__ = [
    "IGNORED_KEYS",
    "KEYS",
    "FieldError",
    "Segment",
    "config_converter",
    "kind_of",
    "path_segment",
    "register_strict_scalars",
    "show",
]

T = TypeVar("T")
Segment = str | int
Hook = Callable[[Any, Any], Any]


# --- YAML keys --------------------------------------------------------------------

# YAML key of each attribute, per class. The same table drives structuring,
# unstructuring and the field paths in error messages; an attribute it does
# not list is no part of the YAML shape.
KEYS: dict[type, dict[str, str]] = {
    PciHostDevice: {
        "pci_vendor_selector": "pciVendorSelector",
        "resource_name": "resourceName",
        "external_resource_provider": "externalResourceProvider",
        "frontend": "frontend",
    },
    MediatedDevice: {
        "mdev_name_selector": "mdevNameSelector",
        "resource_name": "resourceName",
        "external_resource_provider": "externalResourceProvider",
        "frontend": "frontend",
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
        "binding": "binding",
        "vfio": "vfio",
        "dra": "dra",
    },
    Vfio: {"interface": "interface"},
    Dra: {
        "driver_name": "driverName",
        "partitionable_devices": "partitionableDevices",
        "device_taints": "deviceTaints",
    },
    Binding: {"replace_drivers": "replaceDrivers", "bind_unbound": "bindUnbound"},
    SharedDevice: {
        "path": "path",
        "count": "count",
        "permissions": "permissions",
        "enabled": "enabled",
    },
}

# Keys accepted (for KubeVirt compatibility) but not structured.
IGNORED_KEYS: dict[type, tuple[str, ...]] = {PermittedHostDevices: ("usb",)}


@attrs.frozen
class _SharedDevicePatch:
    """One `sharedDevices` entry as written: every field optional, merged over a default."""

    path: str | None = None
    count: int | None = None
    permissions: str | None = None
    enabled: bool | None = None


KEYS[_SharedDevicePatch] = dict(KEYS[SharedDevice])


# --- values in messages ------------------------------------------------------------------


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


# --- strict scalar hooks -----------------------------------------------------------------


def _structure_feature_setting(value: object, _type: object) -> DraFeatureSetting:
    # YAML's true and false, or the string auto; "true" in quotes is a typo to name.
    if value == "auto" or isinstance(value, bool):
        return value  # type: ignore[return-value]
    raise FieldError(f"{show(value)} is not auto, true or false")


def _structure_pci_id(value: object, _type: object) -> PciId:
    if not isinstance(value, str):
        raise FieldError(f"{show(value)} is not VVVV:DDDD hex (write it as a quoted string)")
    return PciId.parse(value)


def _is_homogeneous_tuple(type_: Any) -> bool:
    args = get_args(type_)
    return get_origin(type_) is tuple and len(args) == 2 and args[1] is Ellipsis


def _tuple_hook_factory(type_: Any, converter: cattrs.Converter) -> Hook:
    element_type = get_args(type_)[0]

    def structure_tuple(value: object, _type: object) -> tuple[Any, ...]:
        if value is None:
            return ()
        if not isinstance(value, list | tuple):
            raise FieldError(f"expected a list, got {kind_of(value)}: {show(value)}")
        element_hook = converter.get_structure_hook(element_type)
        items: list[Any] = []
        errors: list[Exception] = []
        for index, element in enumerate(value):
            try:
                items.append(element_hook(element, element_type))
            except Exception as exc:
                exc.add_note(
                    IterableValidationNote(
                        f"Structuring {type_} @ index {index}", index, element_type
                    )
                )
                errors.append(exc)
        if errors:
            raise IterableValidationError(f"While structuring {type_}", errors, tuple)
        return tuple(items)

    return structure_tuple


# --- class hooks ---------------------------------------------------------------------------


def _validated_hook(field: attrs.Attribute[Any], base: Hook) -> Hook:
    """Structure one field, then run its attrs validator alone.

    attrs runs validators in `__init__` and stops at the first failure; running
    each one here, inside cattrs' per-attribute error collection, reports every
    bad field with its own path.
    """
    validator = field.validator

    def structure_field(value: object, type_: object) -> Any:
        result = base(value, type_)
        if validator is not None:
            try:
                validator(None, field, result)
            except ValueError:
                raise
            except Exception:
                # A validator that needs the real instance: it runs again in
                # __init__, and cattrs reports what it raises there.
                pass
        return result

    return structure_field


def _mapping_hook(cls: type[T], generated: Hook) -> Hook:
    def structure_mapping(value: object, type_: object) -> T:
        if value is None:
            value = {}  # `naming:` with nothing under it means the defaults
        if not isinstance(value, Mapping):
            raise FieldError(f"expected a mapping, got {kind_of(value)}: {show(value)}")
        ignored = IGNORED_KEYS.get(cls, ())
        if any(key in value for key in ignored):
            value = {k: v for k, v in value.items() if k not in ignored}
        result: T = generated(value, type_)
        return result

    return structure_mapping


def _structure_shared_devices(value: object, _type: object) -> tuple[SharedDevice, ...]:
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
    errors: list[Exception] = []
    for key, raw in value.items():
        try:
            merged[key] = _merge_shared_device(key, raw, merged.get(key))
        except Exception as exc:
            exc.add_note(
                IterableValidationNote(
                    f"Structuring sharedDevices @ key {key!r}", path_segment(key), SharedDevice
                )
            )
            errors.append(exc)
    if errors:
        raise IterableValidationError("While structuring sharedDevices", errors, dict)
    # One canonical order, so that a dump whose keys YAML sorted reads back equal.
    # The defaults (kvm, tun, vhost-net) are already in this order.
    return tuple(sorted(merged.values(), key=lambda device: device.resource_name))


_SHARED_DEFAULTS = {
    name: attrs.fields_dict(SharedDevice)[name].default
    for name in ("count", "permissions", "enabled")
}


def _merge_shared_device(key: object, raw: object, base: SharedDevice | None) -> SharedDevice:
    errors: list[Exception] = []
    if not isinstance(key, str):
        raise FieldError(f"{show(key)} is not a resource name (a string)")
    name_error = resource_name_error(key)
    if name_error is not None:
        errors.append(FieldError(name_error))
    patch: _SharedDevicePatch | None = None
    try:
        patch = config_converter.structure(raw, _SharedDevicePatch)
    except ClassValidationError as exc:
        errors.extend(exc.exceptions)
    except Exception as exc:
        errors.append(exc)
    if patch is not None:
        values: dict[str, Any] = {}
        for name in ("path", "count", "permissions", "enabled"):
            given = getattr(patch, name)
            if given is not None:
                values[name] = given
            elif base is not None:
                values[name] = getattr(base, name)
            elif name in _SHARED_DEFAULTS:
                values[name] = _SHARED_DEFAULTS[name]
        if "path" not in values:
            defaults = ", ".join(d.resource_name for d in DEFAULT_SHARED_DEVICES)
            missing = FieldError(
                f"is required for a new shared device (only {defaults} have defaults)"
            )
            missing.add_note(AttributeValidationNote("path", "path", str))
            errors.append(missing)
        fields = attrs.fields_dict(SharedDevice)
        for name, given in values.items():
            validator = fields[name].validator
            if validator is None:
                continue
            try:
                validator(None, fields[name], given)
            except ValueError as exc:
                exc.add_note(AttributeValidationNote(name, name, fields[name].type))
                errors.append(exc)
        if not errors:
            return SharedDevice(resource_name=key, **values)
    raise ClassValidationError(f"While structuring sharedDevices[{key!r}]", errors, SharedDevice)


def _make_converter() -> cattrs.Converter:
    converter = cattrs.Converter(detailed_validation=True, forbid_extra_keys=True)
    register_strict_scalars(converter)
    converter.register_structure_hook(PciId, _structure_pci_id)
    converter.register_structure_hook_factory(_is_homogeneous_tuple, _tuple_hook_factory)
    converter.register_unstructure_hook(PciId, lambda pci_id: str(pci_id).upper())
    converter.register_unstructure_hook_factory(
        _is_homogeneous_tuple,
        lambda type_, conv: lambda value: [conv.unstructure(item) for item in value],
    )

    for cls in (
        PciHostDevice,
        MediatedDevice,
        PermittedHostDevices,
        Naming,
        Binding,
        Vfio,
        _SharedDevicePatch,
    ):
        _register_class(converter, cls)
    _register_class(
        converter,
        Dra,
        struct_hooks={
            "partitionable_devices": _structure_feature_setting,
            "device_taints": _structure_feature_setting,
        },
        unstruct_hooks={"partitionable_devices": _same, "device_taints": _same},
    )
    _register_class(
        converter,
        Config,
        struct_hooks={"shared_devices": _structure_shared_devices},
        unstruct_hooks={"shared_devices": _unstructure_shared_devices},
    )
    return converter


def _register_class(
    converter: cattrs.Converter,
    cls: type[Any],
    struct_hooks: Mapping[str, Hook] | None = None,
    unstruct_hooks: Mapping[str, Callable[[Any], Any]] | None = None,
) -> None:
    attrs.resolve_types(cls)
    struct_hooks = struct_hooks or {}
    unstruct_hooks = unstruct_hooks or {}
    # Any: mypy cannot tell these names from make_dict_*_fn's own keyword arguments.
    struct_overrides: dict[str, Any] = {}
    unstruct_overrides: dict[str, Any] = {}
    for field in attrs.fields(cls):
        key = KEYS[cls].get(field.name)
        if key is None:
            # Not part of the YAML shape: set by the reader (e.g. `another_plugin`).
            struct_overrides[field.name] = unstruct_overrides[field.name] = override(omit=True)
            continue
        hook = struct_hooks.get(field.name)
        if hook is None and (field.validator is not None or get_origin(field.type) is Literal):
            base = (
                structure_str
                if get_origin(field.type) is Literal
                else converter.get_structure_hook(field.type)
            )
            hook = _validated_hook(field, base)
        struct_overrides[field.name] = override(rename=key, struct_hook=hook)
        # None means "not given" everywhere in the YAML shape; leave it out.
        unstruct_overrides[field.name] = override(
            rename=key,
            omit_if_default=field.default is None,
            unstruct_hook=unstruct_hooks.get(field.name),
        )
    generated = make_dict_structure_fn(
        cls, converter, _cattrs_forbid_extra_keys=True, **struct_overrides
    )
    converter.register_structure_hook(cls, _mapping_hook(cls, generated))
    unstructure = make_dict_unstructure_fn(cls, converter, **unstruct_overrides)
    order = list(KEYS[cls].values())

    def unstructure_in_order(value: Any) -> dict[str, Any]:
        # cattrs puts omit-if-default keys last; keep the documented order instead.
        unordered = unstructure(value)
        return {key: unordered[key] for key in order if key in unordered}

    converter.register_unstructure_hook(cls, unstructure_in_order)


def _same(value: Any) -> Any:
    return value


def _unstructure_shared_devices(devices: Iterable[SharedDevice]) -> dict[str, Any]:
    return {
        device.resource_name: {
            "path": device.path,
            "count": device.count,
            "permissions": device.permissions,
            "enabled": device.enabled,
        }
        for device in devices
    }


config_converter: cattrs.Converter = _make_converter()
