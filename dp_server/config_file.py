"""The config file: YAML in, `dp_core.Config` out, with every problem reported.

The core classes validate themselves; this module only maps the YAML shape
(camelCase keys, as in KubeVirt's CR) onto them with cattrs, and turns the
cattrs error tree into lines of the form `<source>: <field path>: <message>`.

Two documents are accepted:

* our own config, a mapping with `permittedHostDevices`, `sharedDevices` and
  `naming` (all optional; an empty file means the defaults);
* a whole KubeVirt CR (`apiVersion: kubevirt.io/...`, `kind: KubeVirt`), of
  which only `spec.configuration.permittedHostDevices` is read.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args, get_origin

import attrs
import cattrs
import yaml
from cattrs.errors import (
    AttributeValidationNote,
    ClassValidationError,
    ForbiddenExtraKeysError,
    IterableValidationError,
    IterableValidationNote,
)
from cattrs.gen import make_dict_structure_fn, make_dict_unstructure_fn, override

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
    "ConfigFileError",
    "config_converter",
    "dump_config",
    "load_config",
    "parse_config",
]

log = logging.getLogger("dp.config")

T = TypeVar("T")
Segment = str | int
Hook = Callable[[Any, Any], Any]


class ConfigFileError(Exception):
    """A config file the server cannot use; `str()` lists every problem, one per line."""

    def __init__(self, problems: Sequence[str]) -> None:
        self.problems: tuple[str, ...] = tuple(problems)
        super().__init__("\n".join(self.problems))

    def __str__(self) -> str:
        return "\n".join(self.problems)


# --- YAML keys --------------------------------------------------------------------

# YAML key of each attribute, per class. The same table drives structuring,
# unstructuring and the field paths in error messages.
_KEYS: dict[type, dict[str, str]] = {
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
_IGNORED_KEYS: dict[type, tuple[str, ...]] = {PermittedHostDevices: ("usb",)}


@attrs.frozen
class _SharedDevicePatch:
    """One `sharedDevices` entry as written: every field optional, merged over a default."""

    path: str | None = None
    count: int | None = None
    permissions: str | None = None
    enabled: bool | None = None


_KEYS[_SharedDevicePatch] = dict(_KEYS[SharedDevice])


# --- error plumbing ------------------------------------------------------------------


class _FieldError(ValueError):
    """A value of the wrong shape, found while structuring."""


def _show(value: object) -> str:
    """A value as the operator wrote it, short enough for one line."""
    if value is None:
        text = "null"
    elif isinstance(value, bool):
        text = "true" if value else "false"
    else:
        text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _kind(value: object) -> str:
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


def _note(exc: BaseException, kind: type[T]) -> T | None:
    for note in getattr(exc, "__notes__", ()):
        if type(note) is kind:
            return note
    return None


def _suggest(key: object, allowed: Iterable[str]) -> str:
    import difflib  # only a broken config needs it; the server keeps it out of memory

    choices = sorted(allowed)
    close = difflib.get_close_matches(str(key), choices, n=1)
    if close:
        return f"unknown key {_show(key)} (did you mean {close[0]!r}?)"
    return f"unknown key {_show(key)}; expected one of: {', '.join(choices)}"


def _flatten(
    exc: BaseException, path: tuple[Segment, ...]
) -> list[tuple[tuple[Segment, ...], str, bool]]:
    """(path, message, is_cross_field) for every leaf of a cattrs error tree."""
    if isinstance(exc, ClassValidationError):
        keys = _KEYS.get(exc.cl, {})
        out: list[tuple[tuple[Segment, ...], str, bool]] = []
        for sub in exc.exceptions:
            attr_note = _note(sub, AttributeValidationNote)
            if attr_note is not None:
                out += _flatten(sub, (*path, keys.get(attr_note.name, attr_note.name)))
            elif isinstance(sub, ValueError) and not isinstance(sub, _FieldError):
                # Raised by the class itself once every field was valid: a rule
                # across fields, such as a selector listed twice.
                out.append((path, str(sub), True))
            else:
                out += _flatten(sub, path)
        return out
    if isinstance(exc, IterableValidationError):
        out = []
        for sub in exc.exceptions:
            index_note = _note(sub, IterableValidationNote)
            sub_path = path if index_note is None else (*path, index_note.index)
            out += _flatten(sub, sub_path)
        return out
    if isinstance(exc, ForbiddenExtraKeysError):
        allowed = [*_KEYS.get(exc.cl, {}).values(), *_IGNORED_KEYS.get(exc.cl, ())]
        return [
            ((*path, _segment(key)), _suggest(key, allowed), False)
            for key in sorted(exc.extra_fields, key=str)
        ]
    if isinstance(exc, KeyError):
        return [(path, "is required", False)]
    if isinstance(exc, ValueError | TypeError):
        return [(path, str(exc), False)]
    return [(path, f"unexpected error: {exc!r}", False)]


def _segment(key: object) -> Segment:
    """A mapping key as a path segment (ints are list indices, so show other keys)."""
    return key if isinstance(key, str) else _show(key)


_PLAIN_SEGMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _format_path(segments: Sequence[Segment]) -> str:
    text = ""
    for segment in segments:
        if isinstance(segment, int):
            text += f"[{segment}]"
        elif isinstance(segment, str) and _PLAIN_SEGMENT.match(segment):
            text += f".{segment}" if text else segment
        else:
            quoted = str(segment).replace("\\", "\\\\").replace('"', '\\"')
            text += f'["{quoted}"]'
    return text or "(document)"


def _line(source: str, segments: Sequence[Segment], message: str) -> str:
    return f"{source}: {_format_path(segments)}: {message}"


# --- strict scalar hooks -----------------------------------------------------------------


def _structure_str(value: object, _type: object) -> str:
    if not isinstance(value, str):
        raise _FieldError(f"{_show(value)} is not a string")
    return value


def _structure_int(value: object, _type: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _FieldError(f"{_show(value)} is not an integer")
    return value


def _structure_bool(value: object, _type: object) -> bool:
    if not isinstance(value, bool):
        raise _FieldError(f"{_show(value)} is not a boolean (true or false)")
    return value


def _structure_pci_id(value: object, _type: object) -> PciId:
    if not isinstance(value, str):
        raise _FieldError(f"{_show(value)} is not VVVV:DDDD hex (write it as a quoted string)")
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
            raise _FieldError(f"expected a list, got {_kind(value)}: {_show(value)}")
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
            raise _FieldError(f"expected a mapping, got {_kind(value)}: {_show(value)}")
        ignored = _IGNORED_KEYS.get(cls, ())
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
        raise _FieldError(
            f"expected a mapping of resource name to device, got {_kind(value)}: {_show(value)}"
        )
    merged = {device.resource_name: device for device in DEFAULT_SHARED_DEVICES}
    errors: list[Exception] = []
    for key, raw in value.items():
        try:
            merged[key] = _merge_shared_device(key, raw, merged.get(key))
        except Exception as exc:
            exc.add_note(
                IterableValidationNote(
                    f"Structuring sharedDevices @ key {key!r}", _segment(key), SharedDevice
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
        raise _FieldError(f"{_show(key)} is not a resource name (a string)")
    name_error = resource_name_error(key)
    if name_error is not None:
        errors.append(_FieldError(name_error))
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
            missing = _FieldError(
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
    converter.register_structure_hook(str, _structure_str)
    converter.register_structure_hook(int, _structure_int)
    converter.register_structure_hook(bool, _structure_bool)
    converter.register_structure_hook(PciId, _structure_pci_id)
    converter.register_structure_hook_factory(_is_homogeneous_tuple, _tuple_hook_factory)
    converter.register_unstructure_hook(PciId, lambda pci_id: str(pci_id).upper())
    converter.register_unstructure_hook_factory(
        _is_homogeneous_tuple,
        lambda type_, conv: lambda value: [conv.unstructure(item) for item in value],
    )

    for cls in (PciHostDevice, MediatedDevice, PermittedHostDevices, Naming, _SharedDevicePatch):
        _register_class(converter, cls)
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
        key = _KEYS[cls][field.name]
        hook = struct_hooks.get(field.name)
        if hook is None and (field.validator is not None or get_origin(field.type) is Literal):
            base = (
                _structure_str
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
    order = list(_KEYS[cls].values())

    def unstructure_in_order(value: Any) -> dict[str, Any]:
        # cattrs puts omit-if-default keys last; keep the documented order instead.
        unordered = unstructure(value)
        return {key: unordered[key] for key in order if key in unordered}

    converter.register_unstructure_hook(cls, unstructure_in_order)


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


# --- checks across entries, with exact paths ----------------------------------------------


def _cross_checks(
    permitted: object, shared: object, prefix: tuple[Segment, ...]
) -> list[tuple[tuple[Segment, ...], str]]:
    """Selectors listed twice and resource names used by two kinds of device.

    The core refuses these too, but only the first one, and without saying
    where; this finds every one in the raw document.
    """
    problems: list[tuple[tuple[Segment, ...], str]] = []
    # (resource name, index of the entry) for every entry that names one.
    named: dict[str, list[tuple[str, int]]] = {"pciHostDevices": [], "mediatedDevices": []}
    if isinstance(permitted, Mapping):
        for list_key, selector_key in (
            ("pciHostDevices", "pciVendorSelector"),
            ("mediatedDevices", "mdevNameSelector"),
        ):
            entries = permitted.get(list_key)
            if not isinstance(entries, list):
                continue
            seen: dict[object, int] = {}
            for index, entry in enumerate(entries):
                if not isinstance(entry, Mapping):
                    continue
                selector = entry.get(selector_key)
                normal: object = selector
                if list_key == "pciHostDevices" and isinstance(selector, str):
                    try:
                        normal = PciId.parse(selector)
                    except ValueError:
                        normal = None
                if isinstance(normal, str | PciId):
                    if normal in seen:
                        problems.append(
                            (
                                (*prefix, list_key, index, selector_key),
                                f"{_show(selector)} is listed twice "
                                f"(first at {list_key}[{seen[normal]}])",
                            )
                        )
                    else:
                        seen[normal] = index
                name = entry.get("resourceName")
                if isinstance(name, str):
                    named[list_key].append((name, index))
    first_pci: dict[str, int] = {}
    for name, index in named["pciHostDevices"]:
        first_pci.setdefault(name, index)
    shared_names = {device.resource_name for device in DEFAULT_SHARED_DEVICES}
    if isinstance(shared, Mapping):
        shared_names |= {key for key in shared if isinstance(key, str)}
    for list_key, entries_named in named.items():
        for name, index in entries_named:
            where = (*prefix, list_key, index, "resourceName")
            if list_key == "mediatedDevices" and name in first_pci:
                problems.append(
                    (
                        where,
                        f"{name!r} is also the resourceName of pciHostDevices[{first_pci[name]}]",
                    )
                )
            if name in shared_names:
                problems.append((where, f"{name!r} is also the name of a shared device"))
    return problems


# --- documents ------------------------------------------------------------------------------


class _Loader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (PyYAML keeps the last)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, yaml.Node] = {}
        for key_node, _value_node in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.get(key)
            except TypeError:
                continue  # unhashable; the base class reports it
            if first is not None:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping",
                    node.start_mark,
                    f"found key {_show(key)} a second time "
                    f"(first at line {first.start_mark.line + 1})",
                    key_node.start_mark,
                )
            seen[key] = key_node
        return super().construct_mapping(node, deep=deep)


def _yaml_error_line(source: str, exc: yaml.YAMLError) -> str:
    if isinstance(exc, yaml.MarkedYAMLError) and exc.problem_mark is not None:
        mark = exc.problem_mark
        problem = exc.problem or "invalid YAML"
        context = f" ({exc.context})" if exc.context else ""
        return (
            f"{source}: line {mark.line + 1}, column {mark.column + 1}: "
            f"YAML syntax error: {problem}{context}"
        )
    return f"{source}: YAML syntax error: {exc}"


def _is_kubevirt_cr(document: Mapping[Any, Any]) -> bool:
    api_version = document.get("apiVersion")
    return (
        isinstance(api_version, str)
        and api_version.startswith("kubevirt.io/")
        and document.get("kind") == "KubeVirt"
    )


def _structure_at(
    data: object, type_: Any, prefix: tuple[Segment, ...]
) -> tuple[Any, list[tuple[tuple[Segment, ...], str, bool]]]:
    try:
        return config_converter.structure(data, type_), []
    except Exception as exc:
        return None, _flatten(exc, prefix)


def _warn_ignored(permitted: object, prefix: tuple[Segment, ...], source: str) -> None:
    if isinstance(permitted, Mapping) and "usb" in permitted:
        entries = permitted["usb"]
        count = len(entries) if isinstance(entries, list) else 0
        log.warning(
            "%s: %s: ignored (%d entries); dp does not serve USB host devices",
            source,
            _format_path((*prefix, "usb")),
            count,
        )


def parse_config(text: str, source: str = "<config>") -> Config:
    """The Config that a YAML document describes, or ConfigFileError listing every problem."""
    try:
        document = yaml.load(text, Loader=_Loader)  # a SafeLoader subclass
    except yaml.YAMLError as exc:
        raise ConfigFileError([_yaml_error_line(source, exc)]) from None
    if document is None:
        return Config()
    if not isinstance(document, Mapping):
        raise ConfigFileError(
            [
                _line(
                    source,
                    (),
                    f"expected a mapping of settings, got {_kind(document)}: {_show(document)}",
                )
            ]
        )

    if "apiVersion" in document or "kind" in document:
        return _parse_kubevirt_cr(document, source)

    permitted = document.get("permittedHostDevices")
    _warn_ignored(permitted, ("permittedHostDevices",), source)
    config, errors = _structure_at(document, Config, ())
    cross = _cross_checks(permitted, document.get("sharedDevices"), ("permittedHostDevices",))
    return _result(config, errors, cross, source)


def _parse_kubevirt_cr(document: Mapping[Any, Any], source: str) -> Config:
    if not _is_kubevirt_cr(document):
        found = (
            f"apiVersion {_show(document.get('apiVersion'))}, kind {_show(document.get('kind'))}"
        )
        raise ConfigFileError(
            [
                _line(
                    source,
                    ("kind",),
                    f"{found} is not a KubeVirt CR (apiVersion kubevirt.io/..., kind KubeVirt); "
                    "give either a dp config or a KubeVirt CR",
                )
            ]
        )
    node: object = document
    prefix: tuple[Segment, ...] = ()
    for key in ("spec", "configuration"):
        assert isinstance(node, Mapping)
        node = node.get(key)
        prefix = (*prefix, key)
        if node is None:
            log.warning(
                "%s: %s is absent: no permittedHostDevices, serving every vfio-pci function",
                source,
                _format_path(prefix),
            )
            return Config()
        if not isinstance(node, Mapping):
            raise ConfigFileError(
                [_line(source, prefix, f"expected a mapping, got {_kind(node)}: {_show(node)}")]
            )
    assert isinstance(node, Mapping)
    prefix = (*prefix, "permittedHostDevices")
    permitted = node.get("permittedHostDevices")
    _warn_ignored(permitted, prefix, source)
    structured, errors = _structure_at(permitted, PermittedHostDevices | None, prefix)
    cross = _cross_checks(permitted, None, prefix)
    config: Config | None = None
    if not errors and not cross:
        try:
            config = Config(permitted_host_devices=structured)
        except ValueError as exc:
            errors.append((prefix, str(exc), True))
    return _result(config, errors, cross, source)


def _result(
    config: Config | None,
    errors: list[tuple[tuple[Segment, ...], str, bool]],
    cross: list[tuple[tuple[Segment, ...], str]],
    source: str,
) -> Config:
    if cross:
        # Ours say the same as the core's first cross-field error, with the place.
        problems = [(path, message) for path, message, is_cross in errors if not is_cross]
        problems += cross
    else:
        problems = [(path, message) for path, message, _ in errors]
    if problems or config is None:
        raise ConfigFileError([_line(source, path, message) for path, message in problems])
    return config


def load_config(path: str | os.PathLike[str] | None) -> Config:
    """Read and parse the config file at `path`; None means the defaults."""
    if path is None:
        return Config()
    source = os.fspath(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigFileError([f"{source}: config file does not exist"]) from None
    except UnicodeDecodeError as exc:
        raise ConfigFileError([f"{source}: config file is not UTF-8 text ({exc.reason})"]) from None
    except OSError as exc:
        raise ConfigFileError(
            [f"{source}: cannot read config file: {exc.strerror or exc}"]
        ) from None
    return parse_config(text, source)


def dump_config(config: Config) -> dict[str, Any]:
    """The YAML shape of `config`: `parse_config(yaml.dump(dump_config(c)))` gives `c` back."""
    result: dict[str, Any] = config_converter.unstructure(config, Config)
    return result
