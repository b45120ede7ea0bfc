"""The config file: YAML in, `dp_core.Config` out, with every problem reported.

The core classes validate themselves; this module only maps the YAML shape
(camelCase keys, as in KubeVirt's CR) onto them with cattrs (`config_hooks`),
and turns the cattrs error tree into lines of the form `<source>: <field path>: <message>`.

Two documents are accepted:

* our own config, a mapping with `permittedHostDevices`, `sharedDevices` and
  `naming` (all optional; an empty file means the defaults);
* a whole KubeVirt CR (`apiVersion: kubevirt.io/...`, `kind: KubeVirt`), of
  which only `spec.configuration.permittedHostDevices` is read, with
  KubeVirt's meaning: dp serves the entries virt-handler leaves to an outside
  plugin (`externalResourceProvider: true`) and nothing virt-handler serves
  itself (the other entries, and kvm, tun and vhost-net).

What an operator should know about a config that loads (an ignored section,
what a CR leaves to virt-handler) comes back as `ConfigNote`s with the config
(`read_config_file`); `load_config` logs them.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar

import attrs
import yaml
from cattrs.errors import (
    AttributeValidationNote,
    ClassValidationError,
    ForbiddenExtraKeysError,
    IterableValidationError,
    IterableValidationNote,
)

from dp_core.config import (
    DEFAULT_SHARED_DEVICES,
    Config,
    MediatedDevice,
    PciHostDevice,
    PermittedHostDevices,
)
from dp_core.host import PciId
from dp_server.config.hooks import (
    IGNORED_KEYS,
    KEYS,
    FieldError,
    Segment,
    config_converter,
    kind_of,
    path_segment,
    show,
)

__all__ = [
    "ConfigFile",
    "ConfigFileError",
    "ConfigNote",
    "config_converter",
    "dump_config",
    "load_config",
    "parse_config",
    "parse_config_file",
    "read_config_file",
]

log = logging.getLogger("dp.config")

T = TypeVar("T")


class ConfigFileError(Exception):
    """A config file the server cannot use; `str()` lists every problem, one per line."""

    def __init__(self, problems: Sequence[str]) -> None:
        self.problems: tuple[str, ...] = tuple(problems)
        super().__init__("\n".join(self.problems))

    def __str__(self) -> str:
        return "\n".join(self.problems)


@attrs.frozen
class ConfigNote:
    """Something to know about a config that loads: `<source>: <field path>: <message>`."""

    level: Literal["info", "warning"]
    path: str
    message: str


@attrs.frozen
class ConfigFile:
    """A config as read: the `Config`, where it came from, and its notes."""

    config: Config
    source: str | None = None  # the file; None: no file, the defaults
    kubevirt_cr: bool = False  # read from a KubeVirt CR, with KubeVirt's meaning
    notes: tuple[ConfigNote, ...] = ()

    def log_notes(self) -> None:
        for note in self.notes:
            log.log(
                logging.WARNING if note.level == "warning" else logging.INFO,
                "%s: %s: %s",
                self.source or "<config>",
                note.path,
                note.message,
            )


# --- error plumbing ------------------------------------------------------------------


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
        return f"unknown key {show(key)} (did you mean {close[0]!r}?)"
    return f"unknown key {show(key)}; expected one of: {', '.join(choices)}"


def _flatten(
    exc: BaseException, path: tuple[Segment, ...]
) -> list[tuple[tuple[Segment, ...], str, bool]]:
    """(path, message, is_cross_field) for every leaf of a cattrs error tree."""
    if isinstance(exc, ClassValidationError):
        keys = KEYS.get(exc.cl, {})
        out: list[tuple[tuple[Segment, ...], str, bool]] = []
        for sub in exc.exceptions:
            attr_note = _note(sub, AttributeValidationNote)
            if attr_note is not None:
                out += _flatten(sub, (*path, keys.get(attr_note.name, attr_note.name)))
            elif isinstance(sub, ValueError) and not isinstance(sub, FieldError):
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
        allowed = [*KEYS.get(exc.cl, {}).values(), *IGNORED_KEYS.get(exc.cl, ())]
        return [
            ((*path, path_segment(key)), _suggest(key, allowed), False)
            for key in sorted(exc.extra_fields, key=str)
        ]
    if isinstance(exc, KeyError):
        return [(path, "is required", False)]
    if isinstance(exc, ValueError | TypeError):
        return [(path, str(exc), False)]
    return [(path, f"unexpected error: {exc!r}", False)]


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
                                f"{show(selector)} is listed twice "
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
                    f"found key {show(key)} a second time "
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


def _entries(count: int) -> str:
    return f"{count} entry" if count == 1 else f"{count} entries"


def _ignored(permitted: object, prefix: tuple[Segment, ...]) -> list[ConfigNote]:
    if isinstance(permitted, Mapping) and "usb" in permitted:
        entries = permitted["usb"]
        count = len(entries) if isinstance(entries, list) else 0
        return [
            ConfigNote(
                "warning",
                _format_path((*prefix, "usb")),
                f"ignored ({_entries(count)}): dp does not serve USB host devices",
            )
        ]
    return []


def _entry_lists(
    permitted: PermittedHostDevices,
) -> tuple[tuple[str, tuple[PciHostDevice | MediatedDevice, ...]], ...]:
    return (
        ("pciHostDevices", permitted.pci_host_devices),
        ("mediatedDevices", permitted.mediated_devices),
    )


def _pasted_block(config: Config) -> list[ConfigNote]:
    """A block whose entries say `externalResourceProvider: true` and not, as in a CR.

    In dp's own config an entry that says nothing is dp's; in a KubeVirt CR
    the same entry is virt-handler's. A block mixing the two was most likely
    copied from a CR, where dp would leave the silent ones alone.
    """
    if config.permitted_host_devices is None:
        return []
    flags = [
        entry.external_resource_provider
        for _, entries in _entry_lists(config.permitted_host_devices)
        for entry in entries
    ]
    if True not in flags or None not in flags:
        return []
    return [
        ConfigNote(
            "warning",
            "permittedHostDevices",
            f"externalResourceProvider is true on {_entries(flags.count(True))} and absent "
            f"on {_entries(flags.count(None))}: dp serves both, as its own config lists what "
            "it serves, but in a KubeVirt CR an entry without it is virt-handler's; if this "
            "block comes from a CR, give dp the whole CR, or write "
            "externalResourceProvider: false on virt-handler's entries",
        )
    ]


def parse_config(text: str, source: str = "<config>") -> Config:
    """The Config that a YAML document describes, or ConfigFileError listing every problem.

    Its notes are logged to the `dp.config` logger.
    """
    loaded = parse_config_file(text, source)
    loaded.log_notes()
    return loaded.config


def parse_config_file(
    text: str, source: str = "<config>", kubevirt_resources: Collection[str] | None = None
) -> ConfigFile:
    """A YAML document's Config with its notes, or ConfigFileError listing every problem.

    `kubevirt_resources` (`--kubevirt-resources`), for a KubeVirt CR: serve only
    these of the entries the CR leaves to outside plugins (default: all of them).
    """
    try:
        document = yaml.load(text, Loader=_Loader)  # a SafeLoader subclass
    except yaml.YAMLError as exc:
        raise ConfigFileError([_yaml_error_line(source, exc)]) from None
    if document is None:
        return ConfigFile(Config(), source)
    if not isinstance(document, Mapping):
        raise ConfigFileError(
            [
                _line(
                    source,
                    (),
                    f"expected a mapping of settings, got {kind_of(document)}: {show(document)}",
                )
            ]
        )

    if "apiVersion" in document or "kind" in document:
        return _parse_kubevirt_cr(document, source, kubevirt_resources)
    if kubevirt_resources is not None:
        raise ConfigFileError(
            [
                f"{source}: --kubevirt-resources chooses among the entries of a KubeVirt CR, "
                "and this is dp's own config, which lists what dp serves: leave the flag out, "
                "or drop the entries dp is not to serve"
            ]
        )

    permitted = document.get("permittedHostDevices")
    config, errors = _structure_at(document, Config, ())
    cross = _cross_checks(permitted, document.get("sharedDevices"), ("permittedHostDevices",))
    config = _result(config, errors, cross, source)
    notes = _ignored(permitted, ("permittedHostDevices",)) + _pasted_block(config)
    return ConfigFile(config, source, notes=tuple(notes))


# What virt-handler serves on every node (its permanent device plugins:
# PermanentHostDevicePlugins in pkg/virt-handler/device-manager).
_VIRT_HANDLER_ALWAYS = ConfigNote(
    "info",
    "sharedDevices",
    "devices.kubevirt.io/kvm, tun and vhost-net are not served: KubeVirt's virt-handler "
    "always serves them",
)
_NOT_SHARED = tuple(attrs.evolve(device, enabled=False) for device in DEFAULT_SHARED_DEVICES)


def _kubevirt_entry(entry: Any) -> Any:
    """An entry of a CR as KubeVirt reads it: no externalResourceProvider is false."""
    if entry.external_resource_provider is None:
        return attrs.evolve(entry, external_resource_provider=False)
    return entry


def _parse_kubevirt_cr(
    document: Mapping[Any, Any], source: str, named: Collection[str] | None = None
) -> ConfigFile:
    if not _is_kubevirt_cr(document):
        found = f"apiVersion {show(document.get('apiVersion'))}, kind {show(document.get('kind'))}"
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
    for key in ("spec", "configuration", "permittedHostDevices"):
        assert isinstance(node, Mapping)
        node = node.get(key)
        prefix = (*prefix, key)
        if node is None:
            # KubeVirt then starts no host-device plugin and lists none for an
            # outside one: nothing here names a device for dp. Serving every
            # vfio-pci function instead would take devices nobody named.
            absent = ConfigNote(
                "warning",
                _format_path(prefix),
                "is absent: the CR names no host device, so dp serves none from it; "
                "list them there with externalResourceProvider: true, or give dp its own config",
            )
            if named:
                raise ConfigFileError([_not_outside(source, named, [])])
            config = Config(PermittedHostDevices(), shared_devices=_NOT_SHARED)
            return ConfigFile(config, source, True, (absent, _VIRT_HANDLER_ALWAYS))
        if not isinstance(node, Mapping):
            raise ConfigFileError(
                [_line(source, prefix, f"expected a mapping, got {kind_of(node)}: {show(node)}")]
            )
    permitted = node
    structured, errors = _structure_at(permitted, PermittedHostDevices, prefix)
    cross = _cross_checks(permitted, None, prefix)
    config: Config | None = None
    if not errors and not cross:
        kubevirt = PermittedHostDevices(
            tuple(_kubevirt_entry(entry) for entry in structured.pci_host_devices),
            tuple(_kubevirt_entry(entry) for entry in structured.mediated_devices),
        )
        try:
            config = Config(permitted_host_devices=kubevirt, shared_devices=_NOT_SHARED)
        except ValueError as exc:
            errors.append((prefix, str(exc), True))
    config = _result(config, errors, cross, source)
    notes = [*_ignored(permitted, prefix), _VIRT_HANDLER_ALWAYS]
    assert config.permitted_host_devices is not None
    outside = [
        entry
        for _, entries in _entry_lists(config.permitted_host_devices)
        for entry in entries
        if not entry.virt_handler_serves
    ]
    if not outside:
        notes.append(
            ConfigNote(
                "warning",
                _format_path(prefix),
                "no entry says externalResourceProvider: true: virt-handler serves every one, "
                "and dp none",
            )
        )
    if named is not None:
        config, note = _only_named(config, outside, set(named), source)
        notes.append(note)
    return ConfigFile(config, source, True, tuple(notes))


def _only_named(
    config: Config,
    outside: Sequence[PciHostDevice | MediatedDevice],
    named: set[str],
    source: str,
) -> tuple[Config, ConfigNote]:
    """`config` with the outside entries `named` does not name left to another plugin."""
    unknown = named - {entry.resource_name for entry in outside if entry.resource_name}
    if unknown:
        raise ConfigFileError([_not_outside(source, sorted(unknown), outside)])

    def choose(entry: Any) -> Any:
        if entry.virt_handler_serves or entry.resource_name in named:
            return entry
        return attrs.evolve(entry, another_plugin=True)

    permitted = config.permitted_host_devices
    assert permitted is not None
    chosen = PermittedHostDevices(
        tuple(choose(entry) for entry in permitted.pci_host_devices),
        tuple(choose(entry) for entry in permitted.mediated_devices),
    )
    served = [entry for entry in outside if entry.resource_name in named]
    others = len(outside) - len(served)
    note = ConfigNote(
        "info",
        "--kubevirt-resources",
        f"dp serves {_entries(len(served))} of the {len(outside)} the CR leaves to outside "
        f"plugins ({', '.join(sorted(named))}); "
        + (f"{_entries(others)} left to another outside plugin" if others else "none left"),
    )
    return attrs.evolve(config, permitted_host_devices=chosen), note


def _not_outside(
    source: str, names: Iterable[str], outside: Sequence[PciHostDevice | MediatedDevice]
) -> str:
    listed = sorted({entry.resource_name for entry in outside if entry.resource_name})
    offered = (
        f"the CR leaves these to outside plugins: {', '.join(listed)}"
        if listed
        else "the CR leaves no entry to an outside plugin (externalResourceProvider: true)"
    )
    wrong = ", ".join(names)
    return (
        f"{source}: --kubevirt-resources names {wrong}: not an entry the CR leaves to an "
        f"outside plugin; {offered}"
    )


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
    """Read and parse the config file at `path`; None means the defaults.

    Its notes are logged to the `dp.config` logger.
    """
    loaded = read_config_file(path)
    loaded.log_notes()
    return loaded.config


def read_config_file(
    path: str | os.PathLike[str] | None, kubevirt_resources: Collection[str] | None = None
) -> ConfigFile:
    """The config file at `path` with its notes; None means the defaults.

    `kubevirt_resources`: as for `parse_config_file`.
    """
    if path is None:
        if kubevirt_resources is not None:
            raise ConfigFileError(["--kubevirt-resources needs a KubeVirt CR as --config"])
        return ConfigFile(Config())
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
    return parse_config_file(text, source, kubevirt_resources)


def dump_config(config: Config) -> dict[str, Any]:
    """The YAML shape of `config`: `parse_config(yaml.dump(dump_config(c)))` gives `c` back."""
    result: dict[str, Any] = config_converter.unstructure(config, Config)
    return result
