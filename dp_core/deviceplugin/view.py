"""The device-plugin front end as monitoring reads it: a frozen value taken
at one moment (`DevicePluginFrontend.view`), so that what reads it never
holds the front end's live state, and never sees it change under it."""

from __future__ import annotations

import attrs

from .phases import Phase

__all__ = ["DevicePluginView"]


def _phases(value: object) -> tuple[tuple[str, Phase], ...]:
    return tuple((str(name), Phase(phase)) for name, phase in value)  # type: ignore[attr-defined]


def _names(value: object) -> tuple[str, ...]:
    return tuple(str(name) for name in value)  # type: ignore[attr-defined]


@attrs.frozen
class DevicePluginView:
    # Each resource the registrar tracks, with its registration phase, by name.
    phases: tuple[tuple[str, Phase], ...] = attrs.field(converter=_phases)
    # The resources it publishes, by name.
    resources: tuple[str, ...] = attrs.field(converter=_names)
    # Why some CDI spec is not in place ("": they all are, or no CDI).
    cdi_problem: str = attrs.field(default="", validator=attrs.validators.instance_of(str))

    @phases.validator
    def _check_phases(self, attribute: object, value: tuple[tuple[str, Phase], ...]) -> None:
        names = [name for name, _ in value]
        if len(set(names)) != len(names):
            raise ValueError(f"a resource has two phases: {names}")
